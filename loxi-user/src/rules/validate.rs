//! Rule validation: every range of the spec, mode-4-only fields, and the same-shape check.
//!
//! Errors name the JSON field as the user wrote it (`serviceArguments.kvBlockSize`,
//! `endpoints[2].weight`), the value, and what is allowed.

use std::net::IpAddr;

use super::model::{Endpoint, LbRule, ServiceArgs};

/// A rejected rule. `field` is the JSON path of the offending field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RuleError {
    /// A field's value is out of range or malformed (HTTP 400).
    #[error("{field}: {message}")]
    Invalid {
        /// JSON path, e.g. `serviceArguments.sel`.
        field: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// A field that does not exist, with the right spelling when it is a casing or
    /// separator mistake (HTTP 400).
    #[error("\"{}\" is not a field{}", leaf(field), suggestion.as_ref().map(|s| format!("; did you mean \"{s}\"?")).unwrap_or_default())]
    UnknownField {
        /// JSON path of the unknown key (the message names only its last segment).
        field: String,
        /// The right field name, when one is close.
        suggestion: Option<String>,
    },
    /// A rule with the same key exists with another shape (HTTP 409).
    #[error("{field}: a rule with this key exists with {field} = {existing}; delete it first")]
    Conflict {
        /// The field whose value differs.
        field: String,
        /// The existing value.
        existing: String,
    },
}

/// The last segment of a JSON path (`serviceArguments.kv_exact_mode` → `kv_exact_mode`).
fn leaf(path: &str) -> &str {
    path.rsplit_once('.').map_or(path, |(_, last)| last)
}

fn invalid(field: &str, message: impl Into<String>) -> RuleError {
    RuleError::Invalid {
        field: field.to_string(),
        message: message.into(),
    }
}

/// Parses and canonicalises an IP literal (`::FFFF:1` → `::ffff:1`).
pub fn normalize_ip(ip: &str) -> Result<String, RuleError> {
    ip.trim()
        .parse::<IpAddr>()
        .map(|a| a.to_string())
        .map_err(|_| {
            invalid(
                "serviceArguments.externalIP",
                format!("{ip:?} is not an IP address"),
            )
        })
}

/// Validates a rule and returns it normalised (lower-case protocol, canonical IPs,
/// `kvHashAlgo` derived from the engine when empty).
pub fn validate(mut rule: LbRule) -> Result<LbRule, RuleError> {
    validate_service(&mut rule.service)?;
    if rule.endpoints.is_empty() {
        return Err(invalid("endpoints", "at least one endpoint is required"));
    }
    for (i, ep) in rule.endpoints.iter_mut().enumerate() {
        validate_endpoint(i, ep, &rule.service)?;
    }
    Ok(rule)
}

fn range<T: PartialOrd + std::fmt::Display>(
    field: &str,
    v: T,
    lo: T,
    hi: T,
) -> Result<(), RuleError> {
    if v < lo || v > hi {
        return Err(invalid(
            &format!("serviceArguments.{field}"),
            format!("{v} is out of range {lo}..={hi}"),
        ));
    }
    Ok(())
}

fn one_of(field: &str, v: &str, allowed: &[&str]) -> Result<(), RuleError> {
    if allowed.contains(&v) {
        return Ok(());
    }
    Err(invalid(
        &format!("serviceArguments.{field}"),
        format!("{v:?} is not one of {allowed:?}"),
    ))
}

fn validate_service(s: &mut ServiceArgs) -> Result<(), RuleError> {
    s.external_ip = normalize_ip(&s.external_ip)?;
    if s.port == 0 {
        return Err(invalid(
            "serviceArguments.port",
            "0 is out of range 1..=65535",
        ));
    }
    s.protocol = s.protocol.to_ascii_lowercase();
    one_of("protocol", &s.protocol, &["tcp", "udp", "sctp"])?;
    range("mode", s.mode, 0, 5)?;
    range("sel", s.sel, 0, 10)?;
    if s.sel == 7 {
        return Err(invalid("serviceArguments.sel", "7 is reserved"));
    }
    if s.sel == 6 && s.protocol != "udp" {
        return Err(invalid(
            "serviceArguments.sel",
            "6 (N3) is accepted only for udp services",
        ));
    }
    range("security", s.security, 0, 2)?;
    one_of(
        "backend_protocol",
        &s.backend_protocol,
        &["http1", "http2", "both"],
    )?;
    range("pd_session_ttl_sec", s.pd_session_ttl_sec, 0, i32::MAX)?;
    range("pd_cache_threshold", s.pd_cache_threshold, 0, 100)?;
    range(
        "pd_balance_abs_threshold",
        s.pd_balance_abs_threshold,
        0,
        255,
    )?;
    one_of(
        "kvEngineType",
        &s.kv_engine_type,
        &["vllm", "sglang", "trtllm", "llamacpp"],
    )?;
    if s.kv_exact_mode == 2 {
        return Err(invalid(
            "serviceArguments.kvExactMode",
            "2 is reserved; use 0, 1 or 3",
        ));
    }
    range("kvExactMode", s.kv_exact_mode, 0, 3)?;
    range("kvBlockSize", s.kv_block_size, 1, 1 << 20)?;
    if s.kv_hash_algo.is_empty() {
        s.kv_hash_algo = match s.kv_engine_type.as_str() {
            "sglang" => "sha256_sglang",
            "trtllm" => "blockhash_trtllm",
            _ => "sha256_cbor",
        }
        .into();
    }
    one_of(
        "kvHashAlgo",
        &s.kv_hash_algo,
        &[
            "sha256_cbor",
            "xxhash_cbor",
            "sha256_sglang",
            "blockhash_trtllm",
        ],
    )?;
    if s.kv_zmq_port == 0 {
        return Err(invalid(
            "serviceArguments.kvZmqPort",
            "0 is out of range 1..=65535",
        ));
    }
    range("kvDpRankCount", s.kv_dp_rank_count, 1, 8)?;
    range("chwbl_prefix_hash_level", s.chwbl_prefix_hash_level, 1, 3)?;
    range("chwbl_mean_load_factor", s.chwbl_mean_load_factor, 100, 300)?;
    range("chwbl_replication", s.chwbl_replication, 1, 1024)?;
    if !s.probetype.is_empty() {
        one_of(
            "probetype",
            &s.probetype,
            &["tcp", "udp", "http", "https", "ping", "none"],
        )?;
    }
    check_fullproxy_only(s)
}

/// `sel` 8/9/10 and every AI field need `mode: 4`.
fn check_fullproxy_only(s: &ServiceArgs) -> Result<(), RuleError> {
    if s.mode == loxi_common::mode::FULLPROXY {
        if s.kv_exact_mode != 0 && s.kv_engine_type == "llamacpp" {
            return Err(invalid(
                "serviceArguments.kvExactMode",
                "llamacpp has no KV event plane; use 0",
            ));
        }
        if s.kv_exact_mode == 3 && s.pd_disagg_mode {
            return Err(invalid(
                "serviceArguments.kvExactMode",
                "3 is the role-less pool; it cannot be combined with pd_disagg_mode",
            ));
        }
        if s.kv_exact_mode == 1 && !s.pd_disagg_mode {
            return Err(invalid(
                "serviceArguments.kvExactMode",
                "1 needs pd_disagg_mode: true (use 3 for a single pool)",
            ));
        }
        if s.pd_cache_aware_mode && !s.pd_disagg_mode {
            return Err(invalid(
                "serviceArguments.pd_cache_aware_mode",
                "requires pd_disagg_mode: true",
            ));
        }
        return Ok(());
    }
    let need = |field: &str, set: bool| -> Result<(), RuleError> {
        if set {
            return Err(invalid(
                &format!("serviceArguments.{field}"),
                format!("requires mode 4 (fullproxy); mode is {}", s.mode),
            ));
        }
        Ok(())
    };
    need("sel", matches!(s.sel, 8..=10))?;
    need("kvExactMode", s.kv_exact_mode != 0)?;
    need("pd_disagg_mode", s.pd_disagg_mode)?;
    need("pd_cache_aware_mode", s.pd_cache_aware_mode)?;
    need("model_name", !s.model_name.is_empty())?;
    need("session_header_name", !s.session_header_name.is_empty())?;
    need("sse_mode", s.sse_mode)
}

fn validate_endpoint(i: usize, ep: &mut Endpoint, s: &ServiceArgs) -> Result<(), RuleError> {
    let f = |name: &str| format!("endpoints[{i}].{name}");
    ep.endpoint_ip = ep
        .endpoint_ip
        .trim()
        .parse::<IpAddr>()
        .map(|a| a.to_string())
        .map_err(|_| {
            invalid(
                &f("endpointIP"),
                format!("{:?} is not an IP address", ep.endpoint_ip),
            )
        })?;
    if ep.target_port == 0 {
        ep.target_port = s.port;
    }
    if ep.weight == 0 || ep.weight > 65535 {
        return Err(invalid(
            &f("weight"),
            format!("{} is out of range 1..=65535", ep.weight),
        ));
    }
    if ep.ep_role > 2 {
        return Err(invalid(
            &f("ep_role"),
            format!(
                "{} is not 0 (normal), 1 (prefill) or 2 (decode)",
                ep.ep_role
            ),
        ));
    }
    if ep.ep_role != 0 && !s.pd_disagg_mode {
        return Err(invalid(
            &f("ep_role"),
            "prefill/decode roles need pd_disagg_mode: true",
        ));
    }
    // Output-only fields are ignored on input.
    ep.state = None;
    ep.counter = None;
    Ok(())
}

/// Same key, other shape → 409. Endpoints, weights and tuning knobs may change in place;
/// mode, protocol family, selector, topology and engine contract may not.
pub fn check_same_shape(old: &LbRule, new: &LbRule) -> Result<(), RuleError> {
    let (o, n) = (&old.service, &new.service);
    let fields: [(&str, String, String); 5] = [
        ("mode", o.mode.to_string(), n.mode.to_string()),
        ("sel", o.sel.to_string(), n.sel.to_string()),
        (
            "kvEngineType",
            o.kv_engine_type.clone(),
            n.kv_engine_type.clone(),
        ),
        (
            "kvExactMode",
            o.kv_exact_mode.to_string(),
            n.kv_exact_mode.to_string(),
        ),
        (
            "pd_disagg_mode",
            o.pd_disagg_mode.to_string(),
            n.pd_disagg_mode.to_string(),
        ),
    ];
    for (field, a, b) in fields {
        if a != b {
            return Err(RuleError::Conflict {
                field: format!("serviceArguments.{field}"),
                existing: a,
            });
        }
    }
    Ok(())
}
