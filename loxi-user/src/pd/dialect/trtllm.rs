//! TensorRT-LLM's P/D handoff (`kvEngineType: trtllm`): a context (prefill) leg, then a
//! generation (decode) leg carrying the parameters the context leg returned.
//!
//! Checked against TensorRT-LLM's disaggregated server,
//! `tensorrt_llm/serve/openai_disagg_service.py` (NVIDIA/TensorRT-LLM@00bb903d,
//! `_send_disagg_request_ctx_first`, `_get_ctx_request`, `_get_gen_request`, `_need_gen`; the
//! same flow lived in `openai_disagg_server.py` before) and its request model
//! (`openai_protocol.py`, `DisaggregatedParams`: `request_type` plus optional
//! `first_gen_tokens`, `ctx_request_id`, `encoded_opaque_state`, `draft_tokens`, ...):
//! - context leg: the client's request with `disaggregated_params = {"request_type":
//!   "context_only"}` (TensorRT-LLM's own server also sets its optional `disagg_request_id`,
//!   `schedule_style` and `conversation_id`; none is required), `stream = false`,
//!   `stream_options` removed;
//! - the parameters come back in the context response's `choices[0].disaggregated_params`;
//! - a generation leg is needed only when `choices[0].finish_reason` is `"length"` or
//!   `"not_finished"`; otherwise the context leg already finished the request (e.g. it
//!   stopped at its first token) and its response, with `disaggregated_params` removed from
//!   `choices[0]`, is the answer (TensorRT-LLM answers a streaming client only `[DONE]` then;
//!   loxi sends the finished choice as one SSE chunk before `[DONE]`, so no text is lost);
//! - generation leg: the client's request with those parameters as its
//!   `disaggregated_params`, `request_type` set to `"generation_only"`, every other field
//!   passed verbatim. (Newer servers also swap the prompt for the context response's
//!   `prompt_token_ids`; loxi keeps the client's prompt, which every version accepts.)

use serde_json::{Map, Value, json};

/// The context leg's body (see the module doc).
pub fn context_body(client: &Map<String, Value>) -> Map<String, Value> {
    let mut b = client.clone();
    b.insert(
        "disaggregated_params".into(),
        json!({"request_type": "context_only"}),
    );
    b.insert("stream".into(), Value::Bool(false));
    b.remove("stream_options");
    b
}

/// What the context leg's 2xx answer asks for next.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Run the generation leg with these parameters (`choices[0].disaggregated_params`,
    /// verbatim), or without any when the answer carried none (counted by the caller).
    Generate(Option<Value>),
    /// The context leg finished the request: this is the client's answer.
    Finished(Value),
}

/// Reads the context leg's answer (see the module doc). A body that is not a JSON object
/// with choices is [`Next::Generate`]`(None)`: the generation engine then computes it all.
pub fn next(context_response: &[u8]) -> Next {
    let Ok(Value::Object(mut resp)) = serde_json::from_slice::<Value>(context_response) else {
        return Next::Generate(None);
    };
    let Some(Value::Object(choice)) = resp
        .get_mut("choices")
        .and_then(Value::as_array_mut)
        .and_then(|c| c.first_mut())
    else {
        return Next::Generate(None);
    };
    let more = matches!(
        choice.get("finish_reason").and_then(Value::as_str),
        Some("length" | "not_finished")
    );
    if more {
        return Next::Generate(match choice.get("disaggregated_params") {
            Some(p @ Value::Object(o)) if !o.is_empty() => Some(p.clone()),
            _ => None,
        });
    }
    choice.remove("disaggregated_params");
    Next::Finished(Value::Object(resp))
}

/// The generation leg's body: the client's, with `params` (request type set to
/// `generation_only`) as its `disaggregated_params`, or the client's own without any
/// `disaggregated_params` when there are none (a client's value never reaches the generation
/// engine; the proxy refuses such a request before, this is the second guard).
pub fn generation_body(client: &Map<String, Value>, params: Option<&Value>) -> Map<String, Value> {
    let mut b = client.clone();
    match params {
        Some(Value::Object(p)) => {
            let mut p = p.clone();
            p.insert("request_type".into(), json!("generation_only"));
            b.insert("disaggregated_params".into(), Value::Object(p));
        }
        _ => {
            b.remove("disaggregated_params");
        }
    }
    b
}

/// A finished context answer as a server-sent-event stream for a streaming client: the choice
/// as one chunk (`chat.completion.chunk` with the message as its `delta` for a chat, a
/// `text_completion` chunk otherwise), then `data: [DONE]`.
pub fn finished_stream(finished: &Value, chat: bool) -> Vec<u8> {
    let choice = &finished["choices"][0];
    let mut c = json!({"index": choice.get("index").cloned().unwrap_or(json!(0)),
        "finish_reason": choice.get("finish_reason").cloned().unwrap_or(Value::Null)});
    if chat {
        c["delta"] = choice.get("message").cloned().unwrap_or(json!({}));
    } else {
        c["text"] = choice.get("text").cloned().unwrap_or(json!(""));
    }
    let chunk = json!({
        "id": finished.get("id").cloned().unwrap_or(Value::Null),
        "object": if chat { "chat.completion.chunk" } else { "text_completion" },
        "created": finished.get("created").cloned().unwrap_or(json!(0)),
        "model": finished.get("model").cloned().unwrap_or(Value::Null),
        "choices": [c],
    });
    format!("data: {chunk}\n\ndata: [DONE]\n\n").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().expect("object").clone()
    }

    #[test]
    fn the_context_leg_is_context_only_and_not_streamed() {
        let client = obj(
            json!({"model": "m", "prompt": "hi", "max_tokens": 9, "stream": true,
            "stream_options": {"include_usage": true}, "disaggregated_params": {"x": 1}}),
        );
        assert_eq!(
            Value::Object(context_body(&client)),
            json!({"model": "m", "prompt": "hi", "max_tokens": 9, "stream": false,
                "disaggregated_params": {"request_type": "context_only"}})
        );
    }

    #[test]
    fn the_generation_leg_carries_the_returned_params_as_generation_only() {
        let params = json!({"request_type": "context_only", "first_gen_tokens": [7],
            "ctx_request_id": 42, "encoded_opaque_state": "b64==", "draft_tokens": null,
            "x_future": {"a": [1]}});
        let resp = json!({"id": "c", "choices": [{"index": 0, "text": "A",
            "finish_reason": "not_finished", "disaggregated_params": params}]});
        let Next::Generate(Some(p)) = next(resp.to_string().as_bytes()) else {
            panic!("generation expected");
        };
        let client = obj(json!({"prompt": "hi", "stream": true, "max_tokens": 9}));
        let g = generation_body(&client, Some(&p));
        let mut want = params.clone();
        want["request_type"] = json!("generation_only");
        assert_eq!(g["disaggregated_params"], want);
        assert_eq!((&g["stream"], &g["max_tokens"]), (&json!(true), &json!(9)));
        assert_eq!(
            Value::Object(generation_body(&client, None)),
            Value::Object(client.clone())
        );
        let mut evil = client.clone();
        evil.insert(
            "disaggregated_params".into(),
            json!({"request_type": "generation_only", "ctx_request_id": 666,
                "opaque_state": "evil"}),
        );
        assert_eq!(
            Value::Object(generation_body(&evil, None)),
            Value::Object(client.clone())
        );
        assert_eq!(
            generation_body(&evil, Some(&p))["disaggregated_params"],
            want
        );
        let length = json!({"choices": [{"finish_reason": "length"}]});
        assert_eq!(next(length.to_string().as_bytes()), Next::Generate(None));
        assert_eq!(next(b"not json"), Next::Generate(None));
    }

    #[test]
    fn a_finished_context_answer_is_the_reply_without_its_params() {
        let resp = json!({"id": "c", "created": 5, "model": "m", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop",
            "disaggregated_params": {"request_type": "context_only"}}]});
        let Next::Finished(v) = next(resp.to_string().as_bytes()) else {
            panic!("finished expected");
        };
        let mut want = resp.clone();
        want["choices"][0]
            .as_object_mut()
            .expect("choice")
            .remove("disaggregated_params");
        assert_eq!(v, want);
        let sse = String::from_utf8(finished_stream(&v, true)).expect("utf-8");
        let first = sse
            .strip_prefix("data: ")
            .and_then(|s| s.split("\n\n").next())
            .expect("one chunk");
        let chunk: Value = serde_json::from_str(first).expect("json");
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["choices"][0]["delta"]["content"], "Hi");
        assert_eq!(chunk["choices"][0]["finish_reason"], "stop");
        assert!(sse.ends_with("data: [DONE]\n\n"), "{sse}");
    }
}
