//! Parsing of OpenAI request bodies (the fields the emulator needs), with 400s that name the
//! field, like vLLM's validation errors.

use loxi_user::request::{ApiKind, ChatMessage, Prompt};
use serde_json::{Map, Value};

use super::prompt::RequestExtras;

/// vLLM's default `max_tokens` when a request gives none (completions' OpenAI default).
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// A client error: HTTP status and message (built into vLLM's error JSON by the server).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// 400 or 404.
    pub status: u16,
    /// Human-readable, names the field.
    pub message: String,
}

impl ApiError {
    /// A 400 naming `field`.
    pub fn bad(field: &str, what: &str) -> Self {
        Self {
            status: 400,
            message: format!("{field}: {what}"),
        }
    }
}

/// P/D transfer flags from `kv_transfer_params`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvTransfer {
    /// Prefill leg: the engine should keep the KV for a remote decoder.
    pub do_remote_decode: bool,
    /// Decode leg: the KV comes from a remote prefiller.
    pub do_remote_prefill: bool,
    /// The object as received (the P/D test log shows what the decode leg was given).
    pub raw: Value,
}

/// The fields of one OpenAI request that the emulator uses.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRequest {
    /// Endpoint.
    pub api: ApiKind,
    /// `model` as given.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// SSE streaming.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Salt / LoRA.
    pub extras: RequestExtras,
    /// `kv_transfer_params`, when present.
    pub kv_transfer: Option<KvTransfer>,
    /// The request's own `add_special_tokens`, when given.
    pub add_special_tokens: Option<bool>,
    /// Compute the whole prompt without reading the prefix cache (vLLM does this for
    /// `prompt_logprobs`); computed blocks are still stored.
    pub skip_prefix_cache: bool,
    /// `vllm_xargs.kv_cache_report_mode: "full"`: the request's `BlockStored` covers every full
    /// block from block 0, cache hits included (as the golden capture shows: the hit blocks are
    /// re-reported with parent nil, and no block is allocated for them).
    pub report_all_blocks: bool,
}

/// Parses a request body for `api`; `served` is the served model name (others are 404).
pub fn parse_request(api: ApiKind, body: &[u8], served: &str) -> Result<SimRequest, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", &format!("invalid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| ApiError::bad("body", "expected a JSON object"))?;
    let model = match obj.get("model") {
        Some(Value::String(m)) => m.clone(),
        None => served.to_string(),
        Some(_) => return Err(ApiError::bad("model", "expected a string")),
    };
    if model != served {
        return Err(ApiError {
            status: 404,
            message: format!("The model `{model}` does not exist."),
        });
    }
    let prompt = match api {
        ApiKind::ChatCompletions => {
            Prompt::Messages(parse_messages(obj.get("messages"), "messages")?)
        }
        ApiKind::Responses => Prompt::Messages(parse_responses_input(obj)?),
        _ => parse_completion_prompt(obj.get("prompt"))?,
    };
    let max_key = match api {
        ApiKind::ChatCompletions if obj.contains_key("max_completion_tokens") => {
            "max_completion_tokens"
        }
        ApiKind::Responses => "max_output_tokens",
        _ => "max_tokens",
    };
    Ok(SimRequest {
        api,
        model,
        prompt,
        max_tokens: parse_max_tokens(obj.get(max_key), max_key)?,
        stream: parse_bool(obj.get("stream"), "stream")?,
        include_usage: obj
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        extras: RequestExtras {
            lora: None,
            cache_salt: opt_string(obj.get("cache_salt"), "cache_salt")?,
        },
        kv_transfer: obj.get("kv_transfer_params").map(parse_transfer),
        add_special_tokens: match obj.get("add_special_tokens") {
            None | Some(Value::Null) => None,
            Some(v) => Some(parse_bool(Some(v), "add_special_tokens")?),
        },
        skip_prefix_cache: obj.get("prompt_logprobs").is_some_and(|v| !v.is_null()),
        report_all_blocks: obj
            .get("vllm_xargs")
            .and_then(|x| x.get("kv_cache_report_mode"))
            .and_then(Value::as_str)
            == Some("full"),
    })
}

fn parse_max_tokens(v: Option<&Value>, field: &str) -> Result<usize, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(DEFAULT_MAX_TOKENS),
        Some(n) => match n.as_u64() {
            Some(n) if n >= 1 => Ok(n as usize),
            _ => Err(ApiError::bad(field, "expected an integer >= 1")),
        },
    }
}

fn parse_bool(v: Option<&Value>, field: &str) -> Result<bool, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad(field, "expected a boolean")),
    }
}

fn opt_string(v: Option<&Value>, field: &str) -> Result<Option<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad(field, "expected a string")),
    }
}

fn parse_transfer(v: &Value) -> KvTransfer {
    let flag = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
    KvTransfer {
        do_remote_decode: flag("do_remote_decode"),
        do_remote_prefill: flag("do_remote_prefill"),
        raw: v.clone(),
    }
}

/// `prompt`: a string, a one-element array of strings, token ids, or one array of token ids.
fn parse_completion_prompt(v: Option<&Value>) -> Result<Prompt, ApiError> {
    let v = v.ok_or_else(|| ApiError::bad("prompt", "required"))?;
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(a) if a.is_empty() => Err(ApiError::bad("prompt", "must not be empty")),
        Value::Array(a) if a.len() > 1 && !a[0].is_number() => Err(ApiError::bad(
            "prompt",
            "batched prompts are not supported by vllm-sim",
        )),
        Value::Array(a) => match &a[0] {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(ids) => token_ids(ids).map(Prompt::TokenIds),
            Value::Number(_) => token_ids(a).map(Prompt::TokenIds),
            _ => Err(ApiError::bad("prompt", "expected a string or token ids")),
        },
        _ => Err(ApiError::bad("prompt", "expected a string or token ids")),
    }
}

fn token_ids(a: &[Value]) -> Result<Vec<u32>, ApiError> {
    a.iter()
        .map(|t| t.as_u64().and_then(|x| u32::try_from(x).ok()))
        .collect::<Option<Vec<u32>>>()
        .filter(|ids| !ids.is_empty())
        .ok_or_else(|| ApiError::bad("prompt", "token ids must be non-negative 32-bit integers"))
}

fn parse_messages(v: Option<&Value>, field: &str) -> Result<Vec<ChatMessage>, ApiError> {
    let arr = v
        .and_then(Value::as_array)
        .filter(|a| !a.is_empty())
        .ok_or_else(|| ApiError::bad(field, "expected a non-empty array of messages"))?;
    arr.iter()
        .enumerate()
        .map(|(i, m)| parse_message(m, &format!("{field}[{i}]")))
        .collect()
}

fn parse_message(m: &Value, field: &str) -> Result<ChatMessage, ApiError> {
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad(&format!("{field}.role"), "required string"))?;
    let content = content_text(m.get("content"), &format!("{field}.content"))?;
    Ok(ChatMessage {
        role: role.to_string(),
        content,
    })
}

/// `content`: a string, null, or parts whose text parts are joined by "".
fn content_text(v: Option<&Value>, field: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => Ok(parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("")),
        Some(_) => Err(ApiError::bad(
            field,
            "expected a string or an array of parts",
        )),
    }
}

/// `/v1/responses`: `instructions` → a system message, then `input` (a string → one user
/// message, or an array of messages).
fn parse_responses_input(obj: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let mut msgs = Vec::new();
    if let Some(s) = opt_string(obj.get("instructions"), "instructions")? {
        msgs.push(ChatMessage {
            role: "system".into(),
            content: s,
        });
    }
    match obj.get("input") {
        Some(Value::String(s)) => msgs.push(ChatMessage {
            role: "user".into(),
            content: s.clone(),
        }),
        Some(Value::Array(_)) => msgs.extend(parse_messages(obj.get("input"), "input")?),
        _ => {
            return Err(ApiError::bad(
                "input",
                "expected a string or an array of messages",
            ));
        }
    }
    Ok(msgs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(api: ApiKind, body: &str) -> Result<SimRequest, ApiError> {
        parse_request(api, body.as_bytes(), "tiny")
    }

    #[test]
    fn completion_fields_are_read() {
        let r = parse(
            ApiKind::Completions,
            r#"{"model":"tiny","prompt":"hi","max_tokens":3,"stream":true,"cache_salt":"s","stream_options":{"include_usage":true}}"#,
        )
        .expect("valid");
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert_eq!((r.max_tokens, r.stream, r.include_usage), (3, true, true));
        assert_eq!(r.extras.cache_salt.as_deref(), Some("s"));
    }

    #[test]
    fn token_id_prompts_and_nested_arrays_are_accepted() {
        let r = parse(ApiKind::Completions, r#"{"prompt":[[1,2,3]]}"#).expect("valid");
        assert_eq!(r.prompt, Prompt::TokenIds(vec![1, 2, 3]));
        assert_eq!(r.max_tokens, DEFAULT_MAX_TOKENS);
    }

    #[test]
    fn errors_name_the_field_and_unknown_model_is_404() {
        let e = parse(ApiKind::Completions, r#"{"prompt":"x","max_tokens":0}"#).expect_err("bad");
        assert_eq!(e.status, 400);
        assert!(e.message.starts_with("max_tokens"), "{e}");
        let e = parse(
            ApiKind::ChatCompletions,
            r#"{"messages":[{"content":"x"}]}"#,
        )
        .expect_err("bad");
        assert!(e.message.starts_with("messages[0].role"), "{e}");
        let e = parse(ApiKind::Completions, r#"{"model":"other","prompt":"x"}"#).expect_err("404");
        assert_eq!(e.status, 404);
    }

    #[test]
    fn responses_instructions_become_a_system_message() {
        let r = parse(
            ApiKind::Responses,
            r#"{"instructions":"be brief","input":"hello","max_output_tokens":2}"#,
        )
        .expect("valid");
        let Prompt::Messages(m) = r.prompt else {
            panic!("messages expected")
        };
        assert_eq!(m[0].role, "system");
        assert_eq!(m[1].content, "hello");
        assert_eq!(r.max_tokens, 2);
    }
}
