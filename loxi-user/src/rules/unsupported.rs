//! Values of LoxiLB's rule schema that loxi accepts syntactically but does not implement yet.
//!
//! A rule using one would be stored and reported `active` while the feature it asks for never
//! happens (LoxiLB's own docs are full of "stored but inert" notes). loxi refuses such a rule
//! with a 400 that names the field and says the value is not implemented, until the feature
//! lands. Each check below names what is missing; remove it in the change that implements it.

use super::error::RuleError;
use super::model::LbRule;

fn not_implemented(field: &str, message: impl Into<String>) -> RuleError {
    RuleError::Invalid {
        field: field.to_string(),
        message: format!("{} (not implemented in loxi yet)", message.into()),
    }
}

/// `Err` naming the first field whose value asks for something loxi does not do.
pub fn check(rule: &LbRule) -> Result<(), RuleError> {
    let s = &rule.service;
    let svc = |f: &str| format!("serviceArguments.{f}");
    let fullproxy = s.mode == loxi_common::mode::FULLPROXY;
    if s.security != 0 && !fullproxy {
        return Err(RuleError::Invalid {
            field: svc("security"),
            message: format!(
                "{} asks for TLS, which only the fullproxy (mode 4) terminates; this rule's mode \
                 {} is an L4 mode, which forwards packets and cannot terminate TLS (use mode 4, \
                 or security 0 to forward the TLS stream untouched)",
                s.security, s.mode
            ),
        });
    }
    if fullproxy && s.protocol != "tcp" {
        return Err(not_implemented(
            &svc("protocol"),
            format!("the fullproxy (mode 4) serves tcp only, not {}", s.protocol),
        ));
    }
    if !fullproxy && s.protocol == "sctp" && s.mode != 3 {
        return Err(not_implemented(
            &svc("protocol"),
            format!(
                "sctp in mode {}: the XDP data path does not rewrite SCTP's CRC32c, so sctp \
                 works in DSR (mode 3) only",
                s.mode
            ),
        ));
    }
    if matches!(s.sel, loxi_common::sel::N2 | loxi_common::sel::N3) {
        return Err(not_implemented(
            &svc("sel"),
            format!(
                "{} ({}) has no selector",
                s.sel,
                if s.sel == 5 { "n2" } else { "n3" }
            ),
        ));
    }
    if s.bgp {
        return Err(not_implemented(&svc("bgp"), "loxi has no BGP speaker"));
    }
    if !fullproxy && !s.host.is_empty() {
        return Err(not_implemented(
            &svc("host"),
            format!("host routing needs mode 4 (fullproxy); mode is {}", s.mode),
        ));
    }
    let backend_tls = !s.backend_tls_server_name.is_empty()
        || !s.backend_ca_file.is_empty()
        || s.backend_tls_insecure;
    if backend_tls && s.security != 2 {
        return Err(RuleError::Invalid {
            field: svc(if !s.backend_tls_server_name.is_empty() {
                "backend_tls_server_name"
            } else if !s.backend_ca_file.is_empty() {
                "backend_ca_file"
            } else {
                "backend_tls_insecure"
            }),
            message: format!(
                "configures backend TLS, which needs security 2 (security is {})",
                s.security
            ),
        });
    }
    if s.backend_tls_insecure && !s.backend_ca_file.is_empty() {
        // The server name stays read with verification off: it is the SNI sent.
        return Err(RuleError::Invalid {
            field: svc("backend_ca_file"),
            message: "would never be read: backend_tls_insecure: true turns certificate \
                      verification off; drop one of the two"
                .into(),
        });
    }
    if s.backend_protocol == "both" && s.security != 2 {
        // Not a missing feature: without TLS there is no ALPN to negotiate with.
        return Err(RuleError::Invalid {
            field: svc("backend_protocol"),
            message: "\"both\" (ALPN negotiation with the backend) needs backend TLS \
                      (security 2); use http1 or http2"
                .into(),
        });
    }
    check_engine(rule)?;
    check_pd(rule)
}

/// Engine contracts loxi does not speak: TensorRT-LLM's KV-event routing (tier 1.5 over its
/// block hash). TensorRT-LLM as a P/D handoff dialect (`disaggregated_params`) is implemented;
/// a plain pool of TensorRT-LLM endpoints is served with `kvEngineType` left at `vllm` (the
/// engine name would change nothing there, so `validate` refuses it).
fn check_engine(rule: &LbRule) -> Result<(), RuleError> {
    let s = &rule.service;
    if s.kv_engine_type == "trtllm" && s.kv_exact_mode != 0 {
        return Err(not_implemented(
            "serviceArguments.kvExactMode",
            format!(
                "{} with kvEngineType trtllm asks for KV-event routing over TensorRT-LLM's \
                 block hash; use kvExactMode 0 with pd_disagg_mode: true (P/D with trtllm works \
                 without it), or leave kvEngineType out for a plain pool of TensorRT-LLM servers",
                s.kv_exact_mode
            ),
        ));
    }
    if s.kv_hash_algo == "blockhash_trtllm" && s.kv_exact_mode != 0 {
        return Err(not_implemented(
            "serviceArguments.kvHashAlgo",
            "blockhash_trtllm (TensorRT-LLM's block hash); use sha256_cbor, xxhash_cbor or sha256_sglang",
        ));
    }
    Ok(())
}

/// The parts of prefill/decode disaggregation loxi does not implement: a llama.cpp handoff
/// (llama.cpp has no P/D dialect). The P/D ladder (tiers 0, 1, 1.5 and 2) and the vLLM, SGLang
/// and TensorRT-LLM handoffs are implemented, see `crate::pd`.
fn check_pd(rule: &LbRule) -> Result<(), RuleError> {
    let s = &rule.service;
    if s.pd_disagg_mode && s.kv_engine_type == "llamacpp" {
        return Err(not_implemented(
            "serviceArguments.kvEngineType",
            "llamacpp with pd_disagg_mode: llama.cpp has no P/D handoff dialect; use vllm, sglang or trtllm",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn field_of(service: serde_json::Value, endpoint: serde_json::Value) -> String {
        let mut v = json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 4},
            "endpoints": [{"endpointIP": "10.0.1.2", "targetPort": 8000}]
        });
        for (k, x) in service.as_object().expect("object") {
            v["serviceArguments"][k] = x.clone();
        }
        for (k, x) in endpoint.as_object().expect("object") {
            v["endpoints"][0][k] = x.clone();
        }
        let rule: LbRule = serde_json::from_value(v).expect("rule parses");
        match check(&rule) {
            Err(RuleError::Invalid { field, message }) => {
                assert!(message.contains("not implemented"), "{message}");
                field
            }
            other => panic!("expected a refusal: {other:?}"),
        }
    }

    #[test]
    fn every_accepted_but_unimplemented_value_is_refused_naming_its_field() {
        let cases = [
            (
                json!({"pd_disagg_mode": true, "kvEngineType": "llamacpp"}),
                "serviceArguments.kvEngineType",
            ),
            (
                json!({"kvEngineType": "trtllm", "kvExactMode": 3}),
                "serviceArguments.kvExactMode",
            ),
            (
                json!({"pd_disagg_mode": true, "kvEngineType": "trtllm", "kvExactMode": 1}),
                "serviceArguments.kvExactMode",
            ),
            (
                json!({"kvHashAlgo": "blockhash_trtllm", "kvExactMode": 3}),
                "serviceArguments.kvHashAlgo",
            ),
            (json!({"bgp": true}), "serviceArguments.bgp"),
            (json!({"protocol": "udp"}), "serviceArguments.protocol"),
            (json!({"sel": 5}), "serviceArguments.sel"),
            (
                json!({"mode": 0, "sel": 6, "protocol": "udp"}),
                "serviceArguments.sel",
            ),
            (
                json!({"mode": 2, "host": "a.example"}),
                "serviceArguments.host",
            ),
            (
                json!({"mode": 2, "protocol": "sctp"}),
                "serviceArguments.protocol",
            ),
        ];
        for (service, want) in cases {
            assert_eq!(field_of(service.clone(), json!({})), want, "{service}");
        }
    }

    /// TLS on an L4 mode is refused saying why (L4 forwards packets) and what to do, quoting
    /// the posted `security` and `mode`, without "not implemented" (a fresh-user trial read that
    /// as mode 0 itself being unimplemented).
    #[test]
    fn tls_on_an_l4_mode_is_refused_saying_why_and_what_to_do() {
        let rule: LbRule = serde_json::from_value(json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 0, "security": 2},
            "endpoints": [{"endpointIP": "10.0.1.2", "targetPort": 8000}]
        }))
        .expect("rule parses");
        match check(&rule) {
            Err(RuleError::Invalid { field, message }) => {
                assert_eq!(field, "serviceArguments.security");
                assert_eq!(
                    message,
                    "2 asks for TLS, which only the fullproxy (mode 4) terminates; this rule's \
                     mode 0 is an L4 mode, which forwards packets and cannot terminate TLS (use \
                     mode 4, or security 0 to forward the TLS stream untouched)"
                );
            }
            other => panic!("expected a refusal: {other:?}"),
        }
    }

    /// `both` without backend TLS is not a missing feature (there is no ALPN to negotiate):
    /// refused as invalid, without the "not implemented" tail.
    #[test]
    fn backend_protocol_both_without_backend_tls_is_invalid_not_unimplemented() {
        let rule: LbRule = serde_json::from_value(json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 4,
                "backend_protocol": "both"},
            "endpoints": [{"endpointIP": "10.0.1.2", "targetPort": 8000}]
        }))
        .expect("rule parses");
        match check(&rule) {
            Err(RuleError::Invalid { field, message }) => {
                assert_eq!(field, "serviceArguments.backend_protocol");
                assert!(
                    message.contains("needs backend TLS (security 2)"),
                    "{message}"
                );
                assert!(!message.contains("not implemented"), "{message}");
            }
            other => panic!("expected a refusal: {other:?}"),
        }
    }

    /// A CA bundle under `backend_tls_insecure: true` would be inert (verification is off);
    /// the server name is not (it is the SNI sent), so it passes.
    #[test]
    fn a_ca_file_without_verification_is_refused() {
        let rule = |extra: serde_json::Value| {
            let mut v = json!({"serviceArguments": {"externalIP": "10.0.0.1", "port": 80,
                "mode": 4, "security": 2, "backend_tls_insecure": true},
                "endpoints": [{"endpointIP": "10.0.1.2", "targetPort": 8000}]});
            for (k, x) in extra.as_object().expect("object") {
                v["serviceArguments"][k] = x.clone();
            }
            check(&serde_json::from_value(v).expect("rule"))
        };
        match rule(json!({"backend_ca_file": "/etc/ssl/ca.pem"})) {
            Err(RuleError::Invalid { field, message }) => {
                assert_eq!(field, "serviceArguments.backend_ca_file");
                assert!(message.contains("verification off"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert!(rule(json!({"backend_tls_server_name": "api.internal"})).is_ok());
    }

    #[test]
    fn p_d_with_vllm_and_the_tier_1_defaults_passes() {
        let rule: LbRule = serde_json::from_value(json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 4,
                "pd_disagg_mode": true, "kvExactMode": 1, "pd_session_ttl_sec": 60,
                "pd_cache_threshold": 0, "pd_balance_abs_threshold": 0},
            "endpoints": [{"endpointIP": "10.0.1.2", "targetPort": 8000, "ep_role": 1,
                "nixl_port": 5600}]
        }))
        .expect("rule");
        check(&rule).expect("implemented");
    }

    #[test]
    fn sglang_and_trtllm_p_d_pass() {
        for engine in ["sglang", "trtllm"] {
            let rule: LbRule = serde_json::from_value(json!({
                "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 4,
                    "pd_disagg_mode": true, "kvEngineType": engine,
                    "kvHashAlgo": if engine == "trtllm" { "blockhash_trtllm" } else { "" }},
                "endpoints": [{"endpointIP": "10.0.1.2", "targetPort": 8000, "ep_role": 1}]
            }))
            .expect("rule");
            check(&rule).expect(engine);
        }
    }

    #[test]
    fn implemented_values_pass() {
        let rule: LbRule = serde_json::from_value(json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 4, "sel": 8,
                "kvExactMode": 3, "kvEngineType": "sglang", "backend_protocol": "http2",
                "host": "a.example", "kvHashAlgo": "xxhash_cbor"},
            "endpoints": [{"endpointIP": "10.0.1.2", "targetPort": 8000}]
        }))
        .expect("rule");
        check(&rule).expect("implemented");
    }
}
