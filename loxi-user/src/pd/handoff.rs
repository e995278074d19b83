//! The vLLM handoff dialect (`kvEngineType: vllm`): how the client's body becomes the prefill
//! leg's and the decode leg's bodies, where the transfer parameters come from, and the request
//! id both legs carry. Pure functions over JSON; the proxy sends the legs.
//!
//! Checked against vLLM's own P/D proxy, `tests/v1/kv_connector/nixl_integration/
//! toy_proxy_server.py` (`send_request_to_service` / `_handle_completions`):
//! - prefill leg: the client's body with `kv_transfer_params = {"do_remote_decode": True,
//!   "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
//!   "remote_host": None, "remote_port": None}`, `stream = False`, `max_tokens = 1`,
//!   `max_completion_tokens = 1` when present, `stream_options` deleted, and `min_tokens` /
//!   `min_completion_tokens` popped ("These args are not supported for P");
//! - the prefill response's `kv_transfer_params` (when truthy) replaces the decode request's;
//!   the decode request is otherwise the client's own body;
//! - both legs carry the same `X-Request-Id`.
//!
//! and against the producer side, `NixlConnectorScheduler.request_finished` in
//! `vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`, which returns
//! `do_remote_prefill=True, do_remote_decode=False, remote_block_ids, remote_engine_id,
//! remote_request_id, remote_host, remote_port, tp_size` (fields vary with the connector and
//! version, so loxi passes the object through verbatim, unknown fields included).
//!
//! The request id has LoxiLB's form
//! `___prefill_addr_<ip:nixl_port>___decode_addr_<ip:nixl_port>_<uuid>` (the form of vLLM's
//! P2P NCCL proxy example, which LoxiLB adopted; both addresses are the engines' KV side
//! channels, `targetPort` when `nixl_port` is 0, as loxilb-inference-gateway's
//! `cicd/vllm-pd-disagg/validation.sh` checks), generated once per request and never
//! regenerated between the legs or on a retry.

use serde_json::{Map, Value, json};

/// The `kv_transfer_params` of a prefill leg (vLLM's toy proxy, verbatim).
pub fn prefill_transfer_params() -> Value {
    json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

/// The prefill leg's body from the client's JSON object (see the module doc).
pub fn prefill_body(client: &Map<String, Value>) -> Map<String, Value> {
    let mut b = client.clone();
    b.insert("kv_transfer_params".into(), prefill_transfer_params());
    b.insert("stream".into(), Value::Bool(false));
    b.insert("max_tokens".into(), json!(1));
    if b.contains_key("max_completion_tokens") {
        b.insert("max_completion_tokens".into(), json!(1));
    }
    b.remove("stream_options");
    b.remove("min_tokens");
    b.remove("min_completion_tokens");
    b
}

/// The decode leg's body: the client's own, with `params` (the prefill's transfer parameters,
/// verbatim) as its `kv_transfer_params` when the prefill returned some, and without any
/// `kv_transfer_params` when it returned none: the decode engine never gets a client's value
/// (the proxy refuses such a request before, this is the second guard).
pub fn decode_body(client: &Map<String, Value>, params: Option<&Value>) -> Map<String, Value> {
    let mut b = client.clone();
    match params {
        Some(p) => b.insert("kv_transfer_params".into(), p.clone()),
        None => b.remove("kv_transfer_params"),
    };
    b
}

/// The `kv_transfer_params` of a prefill response body: `Some` when it is a non-empty JSON
/// object (the toy proxy's "if kv_transfer_params:" truthiness), else `None` (missing, `null`,
/// `{}`, or a body that is not JSON).
pub fn transfer_params(prefill_response: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(prefill_response).ok()?;
    match v.get("kv_transfer_params") {
        Some(Value::Object(o)) if !o.is_empty() => Some(Value::Object(o.clone())),
        _ => None,
    }
}

/// LoxiLB's request id: `___prefill_addr_{prefill}___decode_addr_{decode}_{uuid}`, where
/// `prefill` and `decode` are the endpoints' `ip:nixl_port` (`targetPort` when 0; IPv6
/// bracketed), and `uuid` a random v4 UUID.
pub fn request_id(prefill: &str, decode: &str) -> String {
    format!(
        "___prefill_addr_{prefill}___decode_addr_{decode}_{}",
        uuid_v4()
    )
}

/// A random RFC 9562 version-4 UUID, lower-case hyphenated.
pub fn uuid_v4() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().expect("object").clone()
    }

    #[test]
    fn the_prefill_body_is_vllms_toy_proxy_body() {
        let client = obj(
            json!({"model": "m", "prompt": "hi", "max_tokens": 50, "stream": true,
            "stream_options": {"include_usage": true}, "min_tokens": 3, "temperature": 0.5}),
        );
        let p = prefill_body(&client);
        assert_eq!(
            Value::Object(p),
            json!({"model": "m", "prompt": "hi", "max_tokens": 1, "stream": false,
                "temperature": 0.5, "kv_transfer_params": {"do_remote_decode": true,
                "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null}})
        );
        let chat =
            obj(json!({"messages": [], "max_completion_tokens": 9, "min_completion_tokens": 2}));
        let p = prefill_body(&chat);
        assert_eq!(p["max_completion_tokens"], json!(1));
        assert_eq!(p["max_tokens"], json!(1));
        assert!(!p.contains_key("min_completion_tokens"));
    }

    #[test]
    fn the_decode_body_carries_the_params_verbatim_and_keeps_streaming() {
        let client =
            obj(json!({"prompt": "hi", "max_tokens": 50, "stream": true, "min_tokens": 3}));
        let resp = br#"{"id":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_engine_id":"e","x_unknown":{"a":[null]}}}"#;
        let params = transfer_params(resp).expect("params");
        let d = decode_body(&client, Some(&params));
        assert_eq!(
            d["kv_transfer_params"],
            json!({"do_remote_prefill": true, "remote_block_ids": [1, 2], "remote_engine_id": "e",
                "x_unknown": {"a": [null]}})
        );
        assert_eq!(
            (
                d["stream"].clone(),
                d["max_tokens"].clone(),
                d["min_tokens"].clone()
            ),
            (json!(true), json!(50), json!(3))
        );
        assert_eq!(
            Value::Object(decode_body(&client, None)),
            Value::Object(client.clone())
        );
        // A client's own parameters never reach the decode engine.
        let mut evil = client.clone();
        evil.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_prefill": true, "remote_host": "6.6.6.6", "remote_port": 1,
                "remote_block_ids": [1]}),
        );
        assert_eq!(
            Value::Object(decode_body(&evil, None)),
            Value::Object(client.clone())
        );
        assert_eq!(
            decode_body(&evil, Some(&params))["kv_transfer_params"],
            params
        );
    }

    #[test]
    fn missing_null_or_empty_params_are_none() {
        for body in [
            &br#"{"id":"x"}"#[..],
            br#"{"kv_transfer_params":null}"#,
            br#"{"kv_transfer_params":{}}"#,
            b"not json",
        ] {
            assert_eq!(
                transfer_params(body),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn request_ids_have_loxilbs_form_and_are_unique() {
        let a = request_id("10.0.0.1:5600", "10.0.0.2:8200");
        let b = request_id("10.0.0.1:5600", "10.0.0.2:8200");
        assert_ne!(a, b);
        let uuid = a
            .strip_prefix("___prefill_addr_10.0.0.1:5600___decode_addr_10.0.0.2:8200_")
            .expect("prefix");
        assert_eq!(uuid.len(), 36);
        assert_eq!(&uuid[14..15], "4", "version 4");
        assert!(
            matches!(&uuid[19..20], "8" | "9" | "a" | "b"),
            "RFC variant"
        );
    }
}
