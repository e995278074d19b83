//! A model's chat template, rendered the way transformers 5 renders it for vLLM
//! (`apply_chat_template`): a Jinja environment with `trim_blocks` and `lstrip_blocks` on, loop
//! controls, Python string/dict methods (minijinja-contrib `pycompat`), transformers' `tojson`
//! (non-ASCII kept), `raise_exception(message)` and `strftime_now(format)`; the template sees
//! `messages`, `add_generation_prompt` and the special-token strings of `tokenizer_config.json`
//! (`bos_token`, `eos_token`, ...; a `null` token is left undefined, as transformers omits it).
//! Whitespace control must match exactly: any difference changes token ids and so block hashes.

use minijinja::{Environment, Error, ErrorKind, Value};

use super::pyjson;
use crate::request::ChatMessage;

const TEMPLATE_NAME: &str = "chat_template";

/// The special-token fields of `tokenizer_config.json` passed to the template.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A compiled chat template plus the variables transformers passes alongside `messages`.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Vec<(String, Value)>,
    reads_clock: bool,
}

impl ChatTemplate {
    /// Compiles `source` with `special_tokens` (`(name, token text)`, e.g. `("bos_token", "<s>")`).
    /// A syntax error is returned as minijinja's error (with line information).
    pub fn new(source: &str, special_tokens: Vec<(String, String)>) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", pyjson::tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", pyjson::strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())?;
        let special_tokens = special_tokens
            .into_iter()
            .map(|(k, v)| (k, Value::from(v)))
            .collect();
        let reads_clock = source.contains("strftime_now");
        Ok(ChatTemplate {
            env,
            special_tokens,
            reads_clock,
        })
    }

    /// True when the template calls `strftime_now` (its output depends on the date, so
    /// rendered prompts must not be cached by message list).
    pub fn reads_clock(&self) -> bool {
        self.reads_clock
    }

    /// The template of a parsed `tokenizer_config.json`: `chat_template` as a string, or as a
    /// list of `{name, template}` (the one named `default`, else the first). `Ok(None)` when the
    /// config has no template; `Err` (message) when it does not compile or has the wrong shape.
    pub fn from_tokenizer_config(cfg: &serde_json::Value) -> Result<Option<Self>, String> {
        let source = match &cfg["chat_template"] {
            serde_json::Value::Null => return Ok(None),
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(list) => {
                let named = |n: &str| list.iter().find(|t| t["name"].as_str() == Some(n));
                let chosen = named("default").or_else(|| list.first());
                match chosen.and_then(|t| t["template"].as_str()) {
                    Some(s) => s.to_owned(),
                    None => {
                        return Err("chat_template: list entries need a string `template`".into());
                    }
                }
            }
            _ => return Err("chat_template: expected a string or a list".into()),
        };
        ChatTemplate::new(&source, special_tokens_of(cfg))
            .map(Some)
            .map_err(|e| format!("{e:#}"))
    }

    /// Renders `messages` (`add_generation_prompt` as vLLM passes it: true for chat and
    /// responses requests). Errors: a render failure or `raise_exception` from the template.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        let tmpl = self.env.get_template(TEMPLATE_NAME)?;
        let mut ctx: Vec<(&str, Value)> = Vec::with_capacity(self.special_tokens.len() + 2);
        ctx.extend(
            self.special_tokens
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone())),
        );
        ctx.push(("messages", Value::from_serialize(messages)));
        ctx.push(("add_generation_prompt", Value::from(add_generation_prompt)));
        tmpl.render(Value::from_iter(ctx))
    }
}

/// The special-token strings of a `tokenizer_config.json`: plain strings or `AddedToken`
/// objects (`{"content": ...}`); `null` entries are skipped.
fn special_tokens_of(cfg: &serde_json::Value) -> Vec<(String, String)> {
    SPECIAL_TOKEN_KEYS
        .iter()
        .filter_map(|&k| {
            let v = &cfg[k];
            let text = v.as_str().or_else(|| v["content"].as_str())?;
            Some((k.to_owned(), text.to_owned()))
        })
        .collect()
}

/// transformers' `raise_exception(message)`: fails the render with `message`.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn trim_and_lstrip_blocks_match_jinja2_transformers_settings() {
        // Rendered by Jinja2 3.1 with trim_blocks=True, lstrip_blocks=True:
        // '[user]hi\n[assistant]'
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[user]{{ m.content }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\n[assistant]\n{%- endif %}";
        let t = ChatTemplate::new(src, vec![]).expect("compiles");
        assert_eq!(
            t.render(&[msg("user", "hi")], true).expect("renders"),
            "[user]hi\n[assistant]"
        );
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok";
        let t = ChatTemplate::new(src, vec![]).expect("compiles");
        let err = t.render(&[msg("system", "s")], true).expect_err("raises");
        assert!(
            format!("{err:#}").contains("Conversation must start with user"),
            "{err:#}"
        );
        assert_eq!(t.render(&[msg("user", "u")], true).expect("renders"), "ok");
    }

    #[test]
    fn python_string_methods_and_loop_controls_work() {
        let src = "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content.split('</think>')[-1].strip() }}|{% endfor %}";
        let t = ChatTemplate::new(src, vec![]).expect("compiles");
        let out = t
            .render(
                &[msg("a", "x</think> y "), msg("b", "z"), msg("c", "never")],
                false,
            )
            .expect("renders");
        assert_eq!(out, "y|z|");
    }

    #[test]
    fn special_tokens_come_from_config_and_null_ones_are_undefined_python_style_bools() {
        let cfg = serde_json::json!({
            "chat_template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token is defined }}",
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "pad_token": null
        });
        let t = ChatTemplate::from_tokenizer_config(&cfg)
            .expect("valid")
            .expect("present");
        assert_eq!(t.render(&[], true).expect("renders"), "<s>|</s>|False");
    }

    #[test]
    fn syntax_error_and_missing_template_are_reported() {
        let bad = serde_json::json!({"chat_template": "{% for m in messages %}"});
        assert!(ChatTemplate::from_tokenizer_config(&bad).is_err());
        let none = serde_json::json!({"bos_token": "<s>"});
        assert!(
            ChatTemplate::from_tokenizer_config(&none)
                .expect("valid")
                .is_none()
        );
    }

    /// Outputs of Python Jinja2 3.1.6 configured as transformers configures it
    /// (`testdata/gen_jinja2_reference.py`): Llama-3-like, Qwen-like and whitespace-control
    /// heavy templates, plus the `raise_exception` message.
    #[test]
    fn renders_byte_identical_to_python_jinja2_reference() {
        let reference: serde_json::Value =
            serde_json::from_str(include_str!("testdata/jinja2_reference.json")).expect("json");
        let msgs: Vec<ChatMessage> =
            serde_json::from_value(reference["messages"].clone()).expect("messages");
        let cases = reference["cases"].as_object().expect("cases");
        let specials = vec![
            ("bos_token".to_owned(), "<|begin_of_text|>".to_owned()),
            ("eos_token".to_owned(), "</s>".to_owned()),
        ];
        let mut checked = 0;
        for (name, case) in cases {
            let Some(src) = case["template"].as_str() else {
                continue;
            };
            let t = ChatTemplate::new(src, specials.clone()).expect("compiles");
            let out = t.render(&msgs, true).expect("renders");
            assert_eq!(
                out,
                case["rendered"].as_str().expect("rendered"),
                "template {name}"
            );
            checked += 1;
        }
        assert_eq!(checked, 3);
        let llama = cases["llama_like"]["template"].as_str().expect("src");
        let t = ChatTemplate::new(llama, specials).expect("compiles");
        let err = t
            .render(&[msg("user", "a"), msg("user", "b")], true)
            .expect_err("alternation");
        let expected = reference["cases"]["alternate_error"]
            .as_str()
            .expect("message");
        assert!(format!("{err:#}").contains(expected), "{err:#}");
    }
}
