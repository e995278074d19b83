//! The SGLang and TensorRT-LLM handoff dialects: how the client's body becomes each leg's body
//! and what is read back from a leg's answer. Pure functions over JSON, like the vLLM dialect
//! (`pd/handoff.rs`, which also owns the request id all three put on both legs); the proxy
//! (`proxy/pd_dialects.rs`) sends the legs.
//!
//! [`gateway_fields`] names, per dialect, the body fields the gateway itself sets for the
//! handoff: a client request carrying one is refused on a P/D rule (the proxy answers 400
//! `pd_handoff_field`), so that no engine is ever told where to pull KV from by a client.

use serde_json::{Map, Value};

use crate::rules::spec::Dialect;

pub mod sglang;
pub mod trtllm;

/// The top-level body fields the gateway sets on the legs of `dialect`: vLLM
/// `kv_transfer_params` ([`super::handoff`]), SGLang `bootstrap_host`, `bootstrap_port`,
/// `bootstrap_room` ([`sglang::leg_body`]), TensorRT-LLM `disaggregated_params`
/// ([`trtllm::context_body`], [`trtllm::generation_body`]).
pub fn gateway_fields(dialect: Dialect) -> &'static [&'static str] {
    match dialect {
        Dialect::Vllm => &["kv_transfer_params"],
        Dialect::Sglang { .. } => &["bootstrap_host", "bootstrap_port", "bootstrap_room"],
        Dialect::Trtllm => &["disaggregated_params"],
    }
}

/// The first of [`gateway_fields`]`(dialect)` that the client's body carries (whatever its
/// value, `null` included), or `None`.
pub fn client_handoff_field(dialect: Dialect, client: &Map<String, Value>) -> Option<&'static str> {
    gateway_fields(dialect)
        .iter()
        .copied()
        .find(|f| client.contains_key(*f))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn each_dialect_names_the_fields_it_sets_and_only_those() {
        let body = |v: Value| v.as_object().expect("object").clone();
        let cases = [
            (
                Dialect::Vllm,
                json!({"kv_transfer_params": null}),
                Some("kv_transfer_params"),
            ),
            (Dialect::Vllm, json!({"disaggregated_params": {}}), None),
            (
                Dialect::Sglang {
                    bootstrap_port: 8998,
                },
                json!({"prompt": "x", "bootstrap_room": 7}),
                Some("bootstrap_room"),
            ),
            (
                Dialect::Sglang {
                    bootstrap_port: 8998,
                },
                json!({"bootstrap_host": "6.6.6.6"}),
                Some("bootstrap_host"),
            ),
            (
                Dialect::Sglang {
                    bootstrap_port: 8998,
                },
                json!({"bootstrap_port": 1}),
                Some("bootstrap_port"),
            ),
            (
                Dialect::Sglang {
                    bootstrap_port: 8998,
                },
                json!({"kv_transfer_params": {}}),
                None,
            ),
            (
                Dialect::Trtllm,
                json!({"disaggregated_params": {"request_type": "generation_only"}}),
                Some("disaggregated_params"),
            ),
            (
                Dialect::Trtllm,
                json!({"prompt": "kv_transfer_params"}),
                None,
            ),
        ];
        for (d, b, want) in cases {
            assert_eq!(client_handoff_field(d, &body(b.clone())), want, "{d:?} {b}");
        }
    }
}
