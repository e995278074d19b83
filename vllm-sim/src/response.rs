//! Response bodies in vLLM's OpenAI shapes: full responses, SSE chunks, usage with
//! `prompt_tokens_details.cached_tokens`.

use loxi_user::proxy::meta::ApiKind;
use serde_json::{Value, json};

use super::seq::SeqSummary;

/// Identity of one response (`id`, `created`, `model`).
#[derive(Debug, Clone)]
pub struct RespMeta {
    /// Response id (`cmpl-…`, `chatcmpl-…`, `resp_…`).
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Endpoint.
    pub api: ApiKind,
}

/// `usage` for completions and chat.
pub fn usage(s: &SeqSummary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "completion_tokens": s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    })
}

fn responses_usage(s: &SeqSummary) -> Value {
    json!({
        "input_tokens": s.prompt_tokens,
        "input_tokens_details": {"cached_tokens": s.cached_tokens},
        "output_tokens": s.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": s.prompt_tokens + s.completion_tokens,
    })
}

/// The whole (non-streaming) response for `text` and `s`; `kv` is added as
/// `kv_transfer_params` when present (P/D producer).
pub fn full_body(m: &RespMeta, text: &str, s: &SeqSummary, kv: Option<Value>) -> Value {
    let mut body = match m.api {
        ApiKind::ChatCompletions => json!({
            "id": m.id, "object": "chat.completion", "created": m.created, "model": m.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                "tool_calls": [], "reasoning_content": null},
                "logprobs": null, "finish_reason": "length", "stop_reason": null}],
            "usage": usage(s), "prompt_logprobs": null,
        }),
        ApiKind::Responses => responses_body(m, text, s, "completed"),
        _ => json!({
            "id": m.id, "object": "text_completion", "created": m.created, "model": m.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length",
                "stop_reason": null, "prompt_logprobs": null}],
            "usage": usage(s),
        }),
    };
    if let (Some(kv), Some(obj)) = (kv, body.as_object_mut()) {
        obj.insert("kv_transfer_params".into(), kv);
    }
    body
}

fn responses_body(m: &RespMeta, text: &str, s: &SeqSummary, status: &str) -> Value {
    json!({
        "id": m.id, "object": "response", "created_at": m.created, "model": m.model,
        "status": status,
        "output": [{"type": "message", "id": format!("msg_{}", m.id), "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "usage": responses_usage(s),
    })
}

/// One SSE `data:` chunk carrying `delta` text (`first`: chat's role chunk precedes it).
pub fn delta_chunk(m: &RespMeta, delta: &str, first: bool) -> String {
    let v = match m.api {
        ApiKind::ChatCompletions => {
            let d = if first {
                json!({"role": "assistant", "content": delta})
            } else {
                json!({"content": delta})
            };
            json!({"id": m.id, "object": "chat.completion.chunk", "created": m.created,
                "model": m.model, "choices": [{"index": 0, "delta": d, "logprobs": null,
                "finish_reason": null}]})
        }
        ApiKind::Responses => {
            return sse_event(
                "response.output_text.delta",
                &json!({"type": "response.output_text.delta", "item_id": format!("msg_{}", m.id),
                    "output_index": 0, "content_index": 0, "delta": delta}),
            );
        }
        _ => json!({"id": m.id, "object": "text_completion", "created": m.created,
            "model": m.model, "choices": [{"index": 0, "text": delta, "logprobs": null,
            "finish_reason": null, "stop_reason": null}]}),
    };
    sse_data(&v)
}

/// The closing SSE chunks: finish reason, usage (when asked, or always for responses), and
/// `data: [DONE]`.
pub fn final_chunks(m: &RespMeta, text: &str, s: &SeqSummary, include_usage: bool) -> String {
    let mut out = String::new();
    match m.api {
        ApiKind::Responses => {
            out.push_str(&sse_event(
                "response.completed",
                &json!({"type": "response.completed", "response": responses_body(m, text, s, "completed")}),
            ));
        }
        api => {
            let (object, choice) = if api == ApiKind::ChatCompletions {
                (
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "length"}),
                )
            } else {
                (
                    "text_completion",
                    json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length", "stop_reason": null}),
                )
            };
            let base =
                json!({"id": m.id, "object": object, "created": m.created, "model": m.model});
            let mut fin = base.clone();
            fin["choices"] = json!([choice]);
            out.push_str(&sse_data(&fin));
            if include_usage {
                let mut u = base;
                u["choices"] = json!([]);
                u["usage"] = usage(s);
                out.push_str(&sse_data(&u));
            }
        }
    }
    // An SSE comment (ignored by clients): the simulated times, exact.
    out.push_str(&format!(
        ": vllm-sim ttft_s={:.6} e2e_s={:.6}\n\n",
        s.ttft_s, s.e2e_s
    ));
    out.push_str("data: [DONE]\n\n");
    out
}

/// The opening SSE event of a streamed `/v1/responses` (`response.created`); empty otherwise.
pub fn opening_chunk(m: &RespMeta) -> String {
    if m.api != ApiKind::Responses {
        return String::new();
    }
    let empty = SeqSummary {
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        ttft_s: 0.0,
        e2e_s: 0.0,
        block_ids: Vec::new(),
    };
    sse_event(
        "response.created",
        &json!({"type": "response.created", "response": responses_body(m, "", &empty, "in_progress")}),
    )
}

fn sse_data(v: &Value) -> String {
    format!("data: {v}\n\n")
}

fn sse_event(name: &str, v: &Value) -> String {
    format!("event: {name}\ndata: {v}\n\n")
}

/// vLLM's error body.
pub fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        404 => "NotFoundError",
        400 => "BadRequestError",
        _ => "InternalServerError",
    };
    json!({"error": {"message": message, "type": kind, "param": null, "code": status}})
}
