//! LoxiLB's `LoadbalanceEntry` schema: the fields loxi's model ([`super::model`]) does not
//! carry, and what loxi does with each.
//!
//! Sources: `loxilb-io/loxilb-inference-gateway@5e5dd88c:api/models/loadbalance_entry.go` (the
//! server's model) and `loxilb-io/loxicmd-inference-gateway@15eb6834:pkg/api/loadBalancer.go`
//! (what the CLI sends, a few fields newer than that server snapshot). Every name of both is
//! either a field of loxi's model or listed here, so a body written by LoxiLB's clients never
//! meets "is not a field".
//!
//! Policy ([`Policy`]): a field whose behaviour loxi does not implement is accepted at its zero
//! value (what LoxiLB's clients send when the feature is not asked for: `false`, `0`, `""`,
//! `null`, `[]`, `{}`) and refused with a 400 that says so otherwise. Output-only fields (what
//! `GET .../all` adds) are accepted with any value and dropped, so a listed rule can be posted
//! back.

use serde_json::Value;

/// What loxi does with a LoxiLB field it does not model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Accepted (and dropped) at its zero value; any other value is a 400 naming `what` as not
    /// implemented.
    ZeroOnly {
        /// The feature the field asks for, e.g. "port ranges".
        what: &'static str,
    },
    /// Like [`Policy::ZeroOnly`], and `also` (a JSON literal) is accepted too because it is
    /// what loxi always does (`adminStateUp: true`, `path_match_mode: "disabled"`).
    ZeroOr {
        /// The feature a value other than zero or `also` asks for.
        what: &'static str,
        /// The other accepted value, as compact JSON.
        also: &'static str,
    },
    /// Accepted only as `null` or `also` (a JSON literal), not at its zero value: for a field
    /// whose zero value asks for a behaviour loxi does not have and LoxiLB's clients never
    /// send it (`adminStateUp` is `omitempty` in them, so `false` is only ever typed by hand:
    /// a paused rule). Any other value is a 400 naming `what` and the remedy.
    NullOr {
        /// What the refused values ask for, and what to do instead.
        what: &'static str,
        /// The accepted value, as compact JSON.
        also: &'static str,
    },
    /// Output only (reported by `GET`): any value is accepted and dropped.
    OutputOnly,
}

/// A LoxiLB field outside loxi's model.
#[derive(Debug, Clone, Copy)]
pub struct Foreign {
    /// JSON name as LoxiLB spells it.
    pub name: &'static str,
    /// What loxi does with it.
    pub policy: Policy,
}

const fn zero(name: &'static str, what: &'static str) -> Foreign {
    Foreign {
        name,
        policy: Policy::ZeroOnly { what },
    }
}

const fn out(name: &'static str) -> Foreign {
    Foreign {
        name,
        policy: Policy::OutputOnly,
    }
}

const TLS: &str = "TLS options beyond what loxi builds (it terminates TLS with rustls' defaults, TLS 1.2/1.3, ALPN h2 and http/1.1, certificates from the cert API, and re-encrypts to endpoints with `security: 2`, verified against the system roots or `backend_ca_file`; no client certificates either way, no cipher, version or HSTS settings, no certificates by id)";
const AUTH: &str = "per-rule client authentication (loxi has the API token only)";
const FC: &str = "the capacity admission gate (fc_*)";
const OCTAVIA: &str = "Octavia metadata round-trip";
const PD: &str = "P/D disaggregation";

/// Top-level fields of `LoadbalanceEntry` outside loxi's model.
pub const RULE_FOREIGN: &[Foreign] = &[
    zero("allowedSources", "source allow-lists (allowedSources)"),
    zero("secondaryIPs", "secondary VIPs (secondaryIPs)"),
    zero("secondaryVIPs", "secondary VIPs (secondaryVIPs)"),
    out("hw_bytes"),
    out("hw_pkts"),
    out("offload_state"),
    out("listenerState"),
];

/// `serviceArguments` fields outside loxi's model.
pub const SERVICE_FOREIGN: &[Foreign] = &[
    zero("portMax", "port ranges (portMax)"),
    zero("block", "firewall marks (block)"),
    zero("egress", "egress rules"),
    zero("proxyprotocolv2", "PROXY protocol v2 towards the endpoints"),
    zero("snat", "SNAT rules"),
    zero("oper", "rule operation codes (oper)"),
    zero("privateIP", "private-IP translation (privateIP)"),
    zero("connectionLimit", "per-rule connection limits"),
    Foreign {
        name: "adminStateUp",
        policy: Policy::NullOr {
            // LoxiLB's server decodes `false` like an absent key and creates the rule enabled:
            // a rule the user asked to pause would serve. Its clients never send `false`.
            what: "a paused rule (adminStateUp false): loxi serves every rule it stores; leave \
                   adminStateUp out or true, and delete the rule to stop serving it",
            also: "true",
        },
    },
    zero("annotations", "rule annotations"),
    zero("alpn_protocols", TLS),
    zero("tls_ciphers", TLS),
    zero("tls_versions", TLS),
    zero("hsts_max_age", TLS),
    zero("hsts_include_subdomains", TLS),
    zero("hsts_preload", TLS),
    zero("mtls_frontend", TLS),
    zero("mtls_backend", TLS),
    zero("backend_ca_cert_id", TLS),
    zero("backend_client_cert_id", TLS),
    zero(
        "backend_keepalive_interval_sec",
        "backend keep-alive probes",
    ),
    zero(
        "cb_enable",
        "the cb_enable switch (loxi's circuit breaker is always on and not switchable per rule)",
    ),
    zero("max_stream_duration_sec", "a per-stream duration cap"),
    Foreign {
        name: "path_match_mode",
        policy: Policy::ZeroOr {
            what: "path routing (path_match_mode prefix/exact)",
            also: "\"disabled\"",
        },
    },
    zero("path_prefix", "path routing (path_prefix)"),
    zero("pd_prefill_timeout_sec", PD),
    zero("projectId", OCTAVIA),
    zero("vip_qos_policy_id", OCTAVIA),
    zero("timeoutMemberConnect", "per-member connect/data timeouts"),
    zero("timeoutMemberData", "per-member connect/data timeouts"),
    zero("timeoutTcpInspect", "TCP inspection timeouts"),
    zero("trace_type", "per-rule trace types"),
    zero("sockMapMode", "sockmap acceleration"),
    zero("jwt_auth_profile", AUTH),
    zero("api_key_auth", AUTH),
    zero(
        "kvExactApiMode",
        "kvExactApiMode (KV lookups through an engine API)",
    ),
    zero("kvModelProfile", "kvModelProfile"),
    zero("fc_mode", FC),
    zero("fc_max_queue_depth", FC),
    zero("fc_max_queue_wait_ms", FC),
    zero("fc_max_outstanding", FC),
    zero("fc_ep_max_inflight", FC),
    zero("fc_prefill_max_inflight", FC),
    zero("fc_decode_max_inflight", FC),
    zero("fc_telemetry_stale_ms", FC),
    zero("fc_adaptive", FC),
    zero("fc_warmup_ms", FC),
    zero("fc_ttft_target_ms", FC),
    zero("fc_tenant_max_share_pct", FC),
    zero("fc_expose_headers", FC),
    out("fc_effective"),
    out("backend_tls_effective"),
];

/// Endpoint fields outside loxi's model.
pub const ENDPOINT_FOREIGN: &[Foreign] = &[
    zero("backup", "backup (standby) endpoints"),
    zero("domainName", "per-member health-monitor settings"),
    zero("expectedCodes", "per-member health-monitor settings"),
    zero("httpMethod", "per-member health-monitor settings"),
    zero("httpVersion", "per-member health-monitor settings"),
    zero("monitorAddress", "per-member health-monitor settings"),
    zero("urlPath", "per-member health-monitor settings"),
    zero("subnetId", OCTAVIA),
];

/// Go's zero value as JSON: `null`, `false`, `0`, `""`, `[]`, or an object of zero values.
pub fn is_zero(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_zero),
    }
}

impl Foreign {
    /// `Err(message)` when `value` asks for something loxi does not implement.
    pub fn check(&self, value: &Value) -> Result<(), String> {
        let what = match self.policy {
            Policy::OutputOnly => return Ok(()),
            Policy::ZeroOnly { what } if !is_zero(value) => what,
            Policy::ZeroOr { what, also }
                if !is_zero(value)
                    && serde_json::from_str::<Value>(also).ok().as_ref() != Some(value) =>
            {
                what
            }
            Policy::NullOr { what, also }
                if !value.is_null()
                    && serde_json::from_str::<Value>(also).ok().as_ref() != Some(value) =>
            {
                let expected = serde_json::from_str::<Value>(also).unwrap_or(Value::Null);
                if std::mem::discriminant(value) != std::mem::discriminant(&expected) {
                    return Err(format!(
                        "{value} is not of the field's type (expected {also}, or leave it out)"
                    ));
                }
                return Err(format!("{value} asks for {what} (not implemented in loxi)"));
            }
            _ => return Ok(()),
        };
        Err(format!(
            "{value} asks for {what}, which loxi does not implement; leave it out or at its zero value (not implemented in loxi)"
        ))
    }
}

/// The foreign field named exactly `name` in `table`.
pub fn find<'a>(table: &'a [Foreign], name: &str) -> Option<&'a Foreign> {
    table.iter().find(|f| f.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn zero_values_pass_and_others_are_refused_naming_the_feature() {
        let pm = find(SERVICE_FOREIGN, "portMax").expect("portMax");
        assert!(pm.check(&json!(0)).is_ok());
        let e = pm.check(&json!(8081)).expect_err("range");
        assert!(
            e.contains("port ranges") && e.contains("not implemented"),
            "{e}"
        );
        let up = find(SERVICE_FOREIGN, "adminStateUp").expect("adminStateUp");
        assert!(up.check(&json!(true)).is_ok() && up.check(&json!(null)).is_ok());
        for wrong in [json!("true"), json!(0)] {
            assert_eq!(
                up.check(&wrong).expect_err("not a boolean"),
                format!("{wrong} is not of the field's type (expected true, or leave it out)")
            );
        }
        let e = up.check(&json!(false)).expect_err("a paused rule");
        assert_eq!(
            e,
            "false asks for a paused rule (adminStateUp false): loxi serves every rule it \
             stores; leave adminStateUp out or true, and delete the rule to stop serving it \
             (not implemented in loxi)"
        );
        let pmm = find(SERVICE_FOREIGN, "path_match_mode").expect("pmm");
        assert!(pmm.check(&json!("disabled")).is_ok());
        assert!(pmm.check(&json!("prefix")).is_err());
        let m = find(SERVICE_FOREIGN, "mtls_frontend").expect("mtls");
        assert!(m.check(&json!({"client_ca_path": ""})).is_ok());
        assert!(m.check(&json!({"client_ca_path": "/x"})).is_err());
        assert!(
            find(RULE_FOREIGN, "secondaryIPs")
                .expect("s")
                .check(&json!(null))
                .is_ok()
        );
        assert!(
            find(RULE_FOREIGN, "secondaryIPs")
                .expect("s")
                .check(&json!([]))
                .is_ok()
        );
        assert!(
            find(RULE_FOREIGN, "secondaryIPs")
                .expect("s")
                .check(&json!([{"secondaryIP": "10.0.0.9"}]))
                .is_err()
        );
        assert!(
            find(RULE_FOREIGN, "hw_pkts")
                .expect("hw")
                .check(&json!(99))
                .is_ok()
        );
    }

    #[test]
    fn no_foreign_name_collides_with_the_model_even_ignoring_case() {
        use super::super::model::{ENDPOINT_FIELDS, RULE_FIELDS, SERVICE_FIELDS};
        for (model, foreign) in [
            (RULE_FIELDS, RULE_FOREIGN),
            (SERVICE_FIELDS, SERVICE_FOREIGN),
            (ENDPOINT_FIELDS, ENDPOINT_FOREIGN),
        ] {
            let mut all: Vec<String> = model.iter().map(|s| s.to_ascii_lowercase()).collect();
            all.extend(foreign.iter().map(|f| f.name.to_ascii_lowercase()));
            let n = all.len();
            all.sort();
            all.dedup();
            assert_eq!(all.len(), n, "two names equal ignoring case in {model:?}");
        }
    }
}
