//! Shared helpers: locating `../shared/golden` and reading its JSON.

use loxi_user::request::{ApiKind, ChatMessage, Prompt};
use serde_json::Value;

pub use loxi_tests::shared_dir;

pub fn golden(name: &str) -> Value {
    let path = shared_dir().join("golden").join(name);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden file is JSON")
}

pub fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}

pub fn str_of<'a>(v: &'a Value, field: &str) -> &'a str {
    v[field]
        .as_str()
        .unwrap_or_else(|| panic!("field {field} is a string: {v}"))
}

/// A tokenizer directory with the two captured models staged under their served names
/// (`tiny` → `golden/tiny-model`, `bos-tiny` → `golden/bos-model`), as symlinks.
pub fn staged_tokenizer_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let golden = shared_dir().join("golden");
    for (name, src) in [("tiny", "tiny-model"), ("bos-tiny", "bos-model")] {
        std::os::unix::fs::symlink(golden.join(src), dir.path().join(name)).expect("symlink");
    }
    dir
}

/// What the proxy's extractor yields for a captured request: the API, the prompt and the
/// request's own `add_special_tokens`. `endpoint` is the capture's (`/v1/completions`,
/// `POST /tokenize`, ...); `None` for requests without a prompt (cache reset).
pub fn request_of(endpoint: &str, body: &Value) -> Option<(ApiKind, Prompt, Option<bool>)> {
    let add = body["add_special_tokens"].as_bool();
    let path = endpoint.trim_start_matches("POST ");
    let prompt_api = |api| -> Option<(ApiKind, Prompt, Option<bool>)> {
        match &body["prompt"] {
            Value::String(s) => Some((api, Prompt::Text(s.clone()), add)),
            Value::Array(ids) => {
                let ids = ids.iter().map(|t| t.as_u64().expect("id") as u32).collect();
                Some((api, Prompt::TokenIds(ids), add))
            }
            _ => None,
        }
    };
    match path {
        "/v1/completions" => prompt_api(ApiKind::Completions),
        "/v1/chat/completions" => Some((
            ApiKind::ChatCompletions,
            Prompt::Messages(messages_of(&body["messages"])),
            add,
        )),
        "/tokenize" if body.get("messages").is_some() => Some((
            ApiKind::ChatCompletions,
            Prompt::Messages(messages_of(&body["messages"])),
            add,
        )),
        "/tokenize" => prompt_api(ApiKind::Completions),
        "/v1/responses" => {
            let mut msgs = Vec::new();
            if let Some(i) = body["instructions"].as_str() {
                msgs.push(ChatMessage {
                    role: "system".into(),
                    content: i.into(),
                });
            }
            match &body["input"] {
                Value::String(s) => msgs.push(ChatMessage {
                    role: "user".into(),
                    content: s.clone(),
                }),
                other => msgs.extend(messages_of(other)),
            }
            Some((ApiKind::Responses, Prompt::Messages(msgs), add))
        }
        _ => None,
    }
}

/// Chat messages with string content or content-part arrays (text parts joined by "").
pub fn messages_of(v: &Value) -> Vec<ChatMessage> {
    v.as_array()
        .expect("messages array")
        .iter()
        .map(|m| {
            let content = match &m["content"] {
                Value::String(s) => s.clone(),
                Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
                _ => String::new(),
            };
            ChatMessage {
                role: str_of(m, "role").to_owned(),
                content,
            }
        })
        .collect()
}

/// `prompt_token_ids_from_vllm` of a captured request.
pub fn vllm_ids(req: &Value) -> Option<Vec<u32>> {
    let ids = req["prompt_token_ids_from_vllm"].as_array()?;
    Some(ids.iter().map(|t| t.as_u64().expect("id") as u32).collect())
}

pub use loxi_tests::harness::promtool_check;
