//! Rule validation: every range of the spec, mode-4-only fields, and the same-shape check.
//!
//! Errors name the JSON field as the user wrote it (`serviceArguments.kvBlockSize`,
//! `endpoints[2].weight`), the value, and what is allowed.

use loxi_common::maps::MAX_EPS;
use std::net::IpAddr;

use super::error::RuleError;
use super::model::{
    Endpoint, LbRule, ServiceArgs, default_chwbl_mean_load_factor, default_chwbl_prefix_hash_level,
    default_chwbl_replication, default_kv_block_size, default_kv_dp_rank_count,
    default_kv_engine_type, default_kv_zmq_port,
};
use super::spec::{Engine, ServiceSpec};

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

/// Most endpoints a rule may have. Every endpoint costs a pool slot, metric series, a health
/// prober and a KV subscriber; a rule 30 times this size took seconds to apply.
pub const MAX_ENDPOINTS: usize = 1024;

/// Validates a rule and returns it normalised (lower-case protocol, canonical IPs,
/// `kvHashAlgo` derived from the engine when empty). Values loxi accepts syntactically but does
/// not implement are refused too ([`super::unsupported`]).
pub fn validate(mut rule: LbRule) -> Result<LbRule, RuleError> {
    rule.service_id = None;
    validate_service(&mut rule.service)?;
    if rule.endpoints.is_empty() {
        return Err(invalid("endpoints", "at least one endpoint is required"));
    }
    if rule.endpoints.len() > MAX_ENDPOINTS {
        return Err(invalid(
            "endpoints",
            format!(
                "{} endpoints; a rule may have at most {MAX_ENDPOINTS}",
                rule.endpoints.len()
            ),
        ));
    }
    for (i, ep) in rule.endpoints.iter_mut().enumerate() {
        validate_endpoint(i, ep, &rule.service)?;
    }
    // After the L4 check: it names an IPv4-mapped endpoint's own fault (the dotted form).
    weights_need_a_reader(&rule)?;
    check_l4(&rule)?;
    check_duplicate_endpoints(&rule.endpoints)?;
    check_pd_roles(&rule)?;
    super::unsupported::check(&rule)?;
    ServiceSpec::compile(&rule)?;
    Ok(rule)
}

/// [`validate`], then the rule's typed [`ServiceSpec`] (what the store keeps beside the rule).
pub fn compile(rule: LbRule) -> Result<(LbRule, ServiceSpec), RuleError> {
    let rule = validate(rule)?;
    let spec = ServiceSpec::compile(&rule)?;
    Ok((rule, spec))
}

/// Whether anything reads rule `r`'s endpoint weights: the L4 data path (every mode but 4,
/// `l4/plan.rs`), the fullproxy's sel 2 (wrr) and 10 (weighted hash), the KV tier
/// (`kvExactMode` 3, its blend laws weigh capacity) and the P/D ladder. Elsewhere (sel 0, 1,
/// 3, 4, 8, 9 of a plain fullproxy rule) each endpoint gets an equal share whatever its weight.
fn weights_are_read(s: &ServiceArgs) -> bool {
    s.mode != loxi_common::mode::FULLPROXY
        || matches!(s.sel, 2 | 10)
        || s.kv_exact_mode == 3
        || s.pd_disagg_mode
}

/// Unequal weights nothing reads (see [`weights_are_read`]) would be silently inert: a user
/// asking for a 1:4 split would get 1:1. Equal weights (LoxiLB's clients send 1) pass.
fn weights_need_a_reader(r: &LbRule) -> Result<(), RuleError> {
    let Some(first) = r.endpoints.first().map(|e| e.weight) else {
        return Ok(());
    };
    if weights_are_read(&r.service) {
        return Ok(());
    }
    match r.endpoints.iter().position(|e| e.weight != first) {
        Some(i) => Err(invalid(
            &format!("endpoints[{i}].weight"),
            format!(
                "{} differs from endpoints[0]'s {first}, but sel {} gives every endpoint an \
                 equal share: only sel 2 (wrr), sel 10 (weighted hash) and the KV tier \
                 (kvExactMode 3) read weights (set one of those, or give every endpoint the \
                 same weight)",
                r.endpoints[i].weight, r.service.sel
            ),
        )),
        None => Ok(()),
    }
}

/// For a rule restored from the state file (stored before [`weights_need_a_reader`] refused
/// them): sets unequal weights nothing reads to 1, so the rule is kept and behaves as before.
/// Returns `["weight"]` when it changed any.
pub fn reset_inert_weights(r: &mut LbRule) -> Vec<&'static str> {
    let first = r.endpoints.first().map(|e| e.weight);
    if weights_are_read(&r.service) || r.endpoints.iter().all(|e| Some(e.weight) == first) {
        return Vec::new();
    }
    for e in &mut r.endpoints {
        e.weight = 1;
    }
    vec!["weight"]
}

/// The same `endpointIP:targetPort` twice would make two `ep_idx` for one backend; an
/// IPv4-mapped IPv6 address (`::ffff:10.0.0.2`) is its IPv4 host ([`super::addr::same_host`]).
fn check_duplicate_endpoints(eps: &[Endpoint]) -> Result<(), RuleError> {
    for (i, ep) in eps.iter().enumerate() {
        let first = eps.iter().position(|e| {
            e.target_port == ep.target_port
                && super::addr::same_host(&e.endpoint_ip, &ep.endpoint_ip)
        });
        if let Some(j) = first.filter(|j| *j < i) {
            return Err(invalid(
                &format!("endpoints[{i}]"),
                format!(
                    "{} is already endpoints[{j}]{}",
                    super::addr::host_port(&ep.endpoint_ip, ep.target_port),
                    if eps[j].endpoint_ip == ep.endpoint_ip {
                        String::new()
                    } else {
                        format!(" ({}, the same host)", eps[j].endpoint_ip)
                    }
                ),
            ));
        }
    }
    Ok(())
}

/// What the L4 (XDP) data path can carry, for a rule it serves (mode other than 4): at most
/// [`MAX_EPS`] endpoints (the endpoint table's row width, `loxi_common::maps`), a VIP it can
/// match (its service lookup is exact, so not the unspecified address), endpoints of the VIP's
/// address family (it translates within one family), no endpoint that is the VIP's own
/// address and port (a loop), and in DSR (mode 3, only the destination MAC is rewritten) a
/// `targetPort` equal to `port`. Anything else would be stored and never forward a packet.
fn check_l4(rule: &LbRule) -> Result<(), RuleError> {
    let s = &rule.service;
    if s.mode == loxi_common::mode::FULLPROXY {
        return Ok(());
    }
    let l4 = "the L4 (XDP) data path";
    if rule.endpoints.len() > MAX_EPS as usize {
        return Err(invalid(
            "endpoints",
            format!(
                "{} endpoints; {l4} (mode {}) holds at most {MAX_EPS} per rule (a mode-4 rule up \
                 to {MAX_ENDPOINTS})",
                rule.endpoints.len(),
                s.mode
            ),
        ));
    }
    let Ok(vip) = s.external_ip.parse::<IpAddr>() else {
        return Ok(());
    };
    if super::addr::is_unspecified(vip) {
        return Err(invalid(
            "serviceArguments.externalIP",
            format!(
                "{vip} matches no packet in {l4}, which looks a VIP up exactly; name the \
                 address clients send to (only mode 4 listens on every address)"
            ),
        ));
    }
    for (i, ep) in rule.endpoints.iter().enumerate() {
        let Ok(ip) = ep.endpoint_ip.parse::<IpAddr>() else {
            continue;
        };
        if ip.is_ipv4() != vip.is_ipv4() {
            return Err(invalid(
                &format!("endpoints[{i}].endpointIP"),
                format!(
                    "{ip} is not of the VIP's address family ({vip}): {l4} translates within one \
                     family (write an IPv4 endpoint in its dotted form, not as ::ffff:a.b.c.d)"
                ),
            ));
        }
        if ip == vip && ep.target_port == s.port {
            return Err(invalid(
                &format!("endpoints[{i}]"),
                format!(
                    "{ip}:{} is this rule's own VIP and port: every packet would be sent back to \
                     the rule",
                    ep.target_port
                ),
            ));
        }
        if s.mode == loxi_common::mode::DSR && ep.target_port != s.port {
            return Err(invalid(
                &format!("endpoints[{i}].targetPort"),
                format!(
                    "{} differs from port {}: DSR (mode 3) rewrites only the destination MAC, so \
                     packets reach the endpoint on the VIP's port; use {} (or omit it)",
                    ep.target_port, s.port, s.port
                ),
            ));
        }
    }
    Ok(())
}

/// A P/D rule needs at least one prefill (`ep_role` 1) and one decode (2) endpoint (spec:
/// "pd_disagg_mode:true, ≥1 ep_role:1 + ≥1 ep_role:2").
fn check_pd_roles(rule: &LbRule) -> Result<(), RuleError> {
    if !rule.service.pd_disagg_mode {
        return Ok(());
    }
    let has = |role: u8| rule.endpoints.iter().any(|e| e.ep_role == role);
    if !has(1) || !has(2) {
        return Err(invalid(
            "endpoints",
            "pd_disagg_mode needs at least one prefill (ep_role 1) and one decode (ep_role 2) endpoint",
        ));
    }
    Ok(())
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

/// A VIP names one host: not a multicast or the broadcast address ([`super::addr`]).
fn check_vip(vip: &str) -> Result<(), RuleError> {
    let what = vip
        .parse::<IpAddr>()
        .ok()
        .and_then(super::addr::not_one_host);
    match what {
        Some(what) => Err(invalid(
            "serviceArguments.externalIP",
            format!(
                "{vip} is {what}; a VIP is the one unicast address clients connect to (mode 4 \
                 also takes 0.0.0.0 or :: to listen on every address)"
            ),
        )),
        None => Ok(()),
    }
}

fn validate_service(s: &mut ServiceArgs) -> Result<(), RuleError> {
    s.external_ip = normalize_ip(&s.external_ip)?;
    check_vip(&s.external_ip)?;
    super::text::check(s)?;
    if s.port == 0 {
        return Err(invalid(
            "serviceArguments.port",
            "0 is out of range 1..=65535",
        ));
    }
    s.protocol = s.protocol.to_ascii_lowercase();
    one_of("protocol", &s.protocol, &["tcp", "udp", "sctp"])?;
    // Host names match case-insensitively (RFC 9110 §4.2.3; the fullproxy matches `Host` and
    // SNI so): two rules whose hosts differ only in case would share every request, and one
    // of them would be stored and never used. One spelling, lower case, is the key.
    s.host = host_key(&s.host);
    check_host(&s.host)?;
    if let Some((name, port)) = s.host.rsplit_once(':')
        && !name.contains(':')
        && port.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(invalid(
            "serviceArguments.host",
            format!(
                "{:?} carries a port; a rule's host is matched against the request's host name \
                 (its port is the rule's port): use {name:?}",
                s.host
            ),
        ));
    }
    // An IP address is canonical by now (`host_key`); what still has IPv6 punctuation is none
    // (`[::1`, `[::1]:80`, a zone `fe80::1%eth0`, brackets around IPv4), and no request's
    // host would ever be matched against it.
    if s.host.contains(['[', ']', '%'])
        || (s.host.contains(':') && s.host.parse::<std::net::Ipv6Addr>().is_err())
    {
        return Err(invalid(
            "serviceArguments.host",
            format!(
                "{:?} is neither a host name nor an IP address: give an IPv6 address with or \
                 without brackets, with no port and no zone (%)",
                s.host
            ),
        ));
    }
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
    if super::model::security_name(s.security).is_none() {
        return Err(invalid(
            "serviceArguments.security",
            format!(
                "{} is not a security value; {}",
                s.security,
                super::model::SECURITY_VALUES
            ),
        ));
    }
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
        s.kv_hash_algo = Engine::of_name(&s.kv_engine_type)
            .map_or("sha256_cbor", Engine::default_hash_algo)
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
    if u32::from(s.kv_zmq_port) + u32::from(s.kv_dp_rank_count) - 1 > 65535 {
        return Err(invalid(
            "serviceArguments.kvZmqPort",
            format!(
                "{} + {} DP ranks runs past port 65535",
                s.kv_zmq_port, s.kv_dp_rank_count
            ),
        ));
    }
    range("chwbl_prefix_hash_level", s.chwbl_prefix_hash_level, 1, 3)?;
    range("chwbl_mean_load_factor", s.chwbl_mean_load_factor, 100, 300)?;
    range("chwbl_replication", s.chwbl_replication, 1, 1024)?;
    if !s.probetype.is_empty() {
        one_of(
            "probetype",
            &s.probetype,
            &["tcp", "udp", "http", "https", "ping", "none"],
        )?;
        // The `http` probe speaks cleartext HTTP; a `security: 2` rule's backends speak TLS,
        // so it would fail on every endpoint and mark the whole pool down.
        if s.security == 2 && s.probetype.eq_ignore_ascii_case("http") {
            return Err(invalid(
                "serviceArguments.probetype",
                "\"http\" probes are cleartext and the backends of a security 2 rule speak TLS; \
                 use \"tcp\" (or \"https\", probed with a TCP connect)",
            ));
        }
    }
    probe_fields_need_a_probe(s)?;
    check_fullproxy_only(s)
}

/// For a rule restored from the state file (stored before [`probe_fields_need_a_probe`]
/// refused them): clears the probe fields no probe reads, so the rule is kept and behaves as
/// before. Returns the JSON names of the fields cleared.
pub fn reset_inert_probe_fields(s: &mut ServiceArgs) -> Vec<&'static str> {
    let mut reset = Vec::new();
    let mut probe = s.active_probe();
    if probe.is_some() && s.mode != loxi_common::mode::FULLPROXY {
        s.monitor = false;
        s.probetype.clear();
        probe = None;
        reset.extend(["monitor", "probetype"]);
    }
    if s.probeport != 0 && probe.is_none() {
        s.probeport = 0;
        reset.push("probeport");
    }
    if s.probe_timeout != 0 && probe.is_none() {
        s.probe_timeout = 0;
        reset.push("probeTimeout");
    }
    if s.probe_retries != 0 && probe.is_none() {
        s.probe_retries = 0;
        reset.push("probeRetries");
    }
    let http = probe.as_deref() == Some("http");
    if !http && !s.probereq.is_empty() {
        s.probereq.clear();
        reset.push("probereq");
    }
    if !http && !s.proberesp.is_empty() {
        s.proberesp.clear();
        reset.push("proberesp");
    }
    reset
}

/// Probe fields no probe reads would be silently inert: `probeport`, `probeTimeout` and
/// `probeRetries` without a probe,
/// `probereq`/`proberesp` without an `http` probe, and any probe on a rule outside mode 4
/// (active probes run in the fullproxy's pools, `health/probe.rs`; the L4 data path has none).
/// A probe runs when `probetype` is set (other than `none`) or `monitor` is true, as
/// `ProbeSpec::from_args` reads them. The zero values LoxiLB's clients send pass.
fn probe_fields_need_a_probe(s: &ServiceArgs) -> Result<(), RuleError> {
    let probe = s.active_probe();
    if let Some(t) = &probe
        && s.mode != loxi_common::mode::FULLPROXY
    {
        let field = if t.is_empty() { "monitor" } else { "probetype" };
        return Err(invalid(
            &format!("serviceArguments.{field}"),
            format!(
                "active probes run for mode 4 (fullproxy) rules only; mode is {} (the L4 data \
                 path has no prober)",
                s.mode
            ),
        ));
    }
    if probe.is_none() {
        for (field, set) in [
            ("probeport", s.probeport != 0),
            ("probeTimeout", s.probe_timeout != 0),
            ("probeRetries", s.probe_retries != 0),
        ] {
            if set {
                return Err(invalid(
                    &format!("serviceArguments.{field}"),
                    format!(
                        "no probe runs on this rule, so nothing reads {field} (set monitor: \
                         true or a probetype, or leave {field} out)"
                    ),
                ));
            }
        }
    }
    let http = probe.as_deref() == Some("http");
    for (field, value) in [("probereq", &s.probereq), ("proberesp", &s.proberesp)] {
        if !value.is_empty() && !http {
            return Err(invalid(
                &format!("serviceArguments.{field}"),
                format!(
                    "only an http probe reads {field}; this rule's probe is {} (set probetype: \
                     \"http\", or leave {field} out)",
                    probe.as_ref().map_or("none".into(), |t| format!("{t:?}"))
                ),
            ));
        }
    }
    if http && !is_probe_path(&s.probereq) {
        return Err(invalid(
            "serviceArguments.probereq",
            format!(
                "probereq {:?} must be a path such as \"/health\" (the probe sends GET <path>; \
                 no method, scheme, host, space or fragment)",
                s.probereq
            ),
        ));
    }
    Ok(())
}

/// True when `probereq` can be an http probe's request path: empty (`/`), or an origin-form
/// path with an optional query (`/health`, `/health?full=1`; LoxiLB's `health`, which its
/// prober appends to `http://<ep>:<port>/`, is taken as `/health`), with no whitespace,
/// control character, fragment or `://`. Anything else (`GET /health`, a URL) made a request
/// that failed on every probe and held the endpoints down.
fn is_probe_path(probereq: &str) -> bool {
    if probereq.is_empty() {
        return true;
    }
    let path = if probereq.starts_with('/') {
        probereq.to_string()
    } else {
        format!("/{probereq}")
    };
    !probereq
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || c == '#')
        && !probereq.contains("://")
        && path.parse::<http::uri::PathAndQuery>().is_ok()
}

/// `sel` 8/9/10 and every AI field need `mode: 4`.
/// The largest `inactiveTimeOut` of a fullproxy rule, in seconds.
pub const MAX_FULLPROXY_IDLE_SECS: u32 = 86_400;

fn check_fullproxy_only(s: &mut ServiceArgs) -> Result<(), RuleError> {
    if s.mode == loxi_common::mode::FULLPROXY {
        // The listener's client-connection idle timeout (`PoolTable::idle_timeout`).
        if s.inactive_timeout > MAX_FULLPROXY_IDLE_SECS {
            return Err(invalid(
                "serviceArguments.inactiveTimeOut",
                format!(
                    "{} s: a fullproxy rule's inactiveTimeOut is how long an idle client \
                     connection is kept, at most {MAX_FULLPROXY_IDLE_SECS} s (a day); 0 keeps \
                     LOXI_IDLE_TIMEOUT_MS",
                    s.inactive_timeout
                ),
            ));
        }
        if s.kv_exact_mode != 0 && s.kv_engine_type == "llamacpp" {
            return Err(invalid(
                "serviceArguments.kvExactMode",
                "llamacpp has no KV event plane, so tier 1.5 cannot run over it; a pool of \
                 llama.cpp servers is served with kvExactMode 0 and kvEngineType left out",
            ));
        }
        engine_hash_coherent(s)?;
        if s.kv_exact_mode == 3 && s.pd_disagg_mode {
            return Err(invalid(
                "serviceArguments.kvExactMode",
                "3 is the role-less pool; it cannot be combined with pd_disagg_mode",
            ));
        }
        if s.kv_exact_mode == 1 && !s.pd_disagg_mode {
            return Err(invalid(
                "serviceArguments.kvExactMode",
                "1 (KV-exact selection over the prefill endpoints) needs pd_disagg_mode: true; \
                 use 3 for a single pool",
            ));
        }
        if s.pd_session_ttl_sec != 0 && !s.pd_disagg_mode {
            return Err(invalid(
                "serviceArguments.pd_session_ttl_sec",
                "the tier-0 pin belongs to P/D; it requires pd_disagg_mode: true",
            ));
        }
        if s.pd_cache_aware_mode && !s.pd_disagg_mode {
            return Err(invalid(
                "serviceArguments.pd_cache_aware_mode",
                "requires pd_disagg_mode: true",
            ));
        }
        // The tier-1 knobs tune the prefix trie only; set without it they would be inert.
        // A submitted 0 means the default (the spec), so 0 is accepted anywhere.
        for (field, set) in [
            (
                "pd_cache_threshold",
                !matches!(s.pd_cache_threshold, 0 | 20),
            ),
            (
                "pd_balance_abs_threshold",
                !matches!(s.pd_balance_abs_threshold, 0 | 3),
            ),
        ] {
            if set && !s.pd_cache_aware_mode {
                return Err(invalid(
                    &format!("serviceArguments.{field}"),
                    "tunes P/D tier 1 (the prefix trie); it requires pd_cache_aware_mode: true",
                ));
            }
        }
        kv_knobs_need_kv_mode(s)?;
        selector_knobs_need_their_selector(s)?;
        return bootstrap_port(s);
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
    need("pdBootstrapPort", s.pd_bootstrap_port != 0)?;
    need("sel", matches!(s.sel, 8..=10))?;
    need("kvExactMode", s.kv_exact_mode != 0)?;
    need("pd_disagg_mode", s.pd_disagg_mode)?;
    need("pd_cache_aware_mode", s.pd_cache_aware_mode)?;
    need("model_name", !s.model_name.is_empty())?;
    need("session_header_name", !s.session_header_name.is_empty())?;
    need("sse_mode", s.sse_mode)?;
    need("backend_protocol", s.backend_protocol != "http1")?;
    need_defaults_outside_fullproxy(s, need)
}

/// Tier 1.5 compares the block hashes loxi computes with the ones the engines publish, so with
/// `kvExactMode` 1 or 3 an explicit `kvHashAlgo` must be one the rule's `kvEngineType` publishes
/// (vLLM: `sha256_cbor`, `xxhash_cbor`; SGLang: `sha256_sglang`): any other pair would be
/// stored and never match a block (LoxiLB's spec: "engine-compatible value"). TensorRT-LLM and
/// llama.cpp are refused with tier 1.5 elsewhere. Errors: `serviceArguments.kvHashAlgo`.
fn engine_hash_coherent(s: &ServiceArgs) -> Result<(), RuleError> {
    let published: &[&str] = match s.kv_engine_type.as_str() {
        "vllm" => &["sha256_cbor", "xxhash_cbor"],
        "sglang" => &["sha256_sglang"],
        _ => return Ok(()),
    };
    if s.kv_exact_mode == 0
        || s.kv_hash_algo.is_empty()
        || published.contains(&s.kv_hash_algo.as_str())
    {
        return Ok(());
    }
    Err(invalid(
        "serviceArguments.kvHashAlgo",
        format!(
            "{:?} is not a hash kvEngineType {} publishes ({}), so no block would ever match; \
             leave kvHashAlgo out (the engine's own is used) or set one of those",
            s.kv_hash_algo,
            s.kv_engine_type,
            published.join(", ")
        ),
    ))
}

/// The rule-level tier-1.5 knobs are read only when `kvExactMode` is 1 or 3; set away from
/// their defaults on a fullproxy rule without it they would be stored and inert, so they are
/// refused as an endpoint's own `kvZmqPort` is. The defaults stay accepted (LoxiLB's clients
/// send them): LoxiLB's `kvWarmupSec` 30 besides 0, and `sha256_cbor` besides the engine's own
/// hash algorithm. `kvEngineType` is also read by the P/D handoff: refused only on a rule with
/// neither.
fn kv_knobs_need_kv_mode(s: &ServiceArgs) -> Result<(), RuleError> {
    match inert_kv_knobs(s).into_iter().next() {
        Some(("kvEngineType", value, _)) => Err(invalid(
            "serviceArguments.kvEngineType",
            format!(
                "{value} names the engine for tier 1.5 (kvExactMode 1 or 3) and for the P/D \
                 handoff (pd_disagg_mode: true); this rule has neither, so it would change \
                 nothing ({})",
                match s.kv_engine_type.as_str() {
                    // Neither reads llama.cpp (no KV events, no handoff dialect).
                    "llamacpp" => "leave kvEngineType out: a llama.cpp pool needs no engine name",
                    "trtllm" => "set pd_disagg_mode: true, or leave kvEngineType out",
                    _ => "set one of them, or leave kvEngineType out",
                }
            ),
        )),
        Some((field, value, _)) => Err(invalid(
            &format!("serviceArguments.{field}"),
            format!(
                "{value} tunes tier 1.5 (KV-event routing), which is read only with kvExactMode 1 \
                 or 3; this rule's kvExactMode is 0 (set kvExactMode, or leave {field} out)"
            ),
        )),
        None => Ok(()),
    }
}

/// A selector knob set away from its default under a selector that never reads it would be
/// silently inert (`GET` would show it, nothing would apply it): refused, naming the selectors
/// that read it.
fn selector_knobs_need_their_selector(s: &ServiceArgs) -> Result<(), RuleError> {
    match inert_selector_knobs(s).into_iter().next() {
        Some((field, value, _)) => Err(invalid(
            &format!("serviceArguments.{field}"),
            format!(
                "{value} is read only by {}; this rule's sel is {} (set one of those selectors, \
                 or leave {field} out)",
                selectors_reading(field),
                s.sel
            ),
        )),
        None => Ok(()),
    }
}

/// The selectors that read a selector knob (`routing/`: sel 3 persist reads the session key;
/// the ring selectors 8 CHWBL, 9 GPU-aware and 10 weighted hash build their key from the prefix
/// and the conversation / session; only 8 walks with the bounded-load factor; 8 and 10 build
/// rings of `chwbl_replication` points).
fn selectors_reading(field: &str) -> &'static str {
    match field {
        "chwbl_mean_load_factor" => "sel 8 (CHWBL)",
        "chwbl_replication" => "sel 8 (CHWBL) and sel 10 (weighted hash)",
        "session_header_name" => "sel 3 (persist) and sels 8, 9, 10 (the conversation key)",
        _ => "sels 8 (CHWBL), 9 (GPU-aware) and 10 (weighted hash)",
    }
}

/// The selector knobs of a fullproxy rule `s` set away from their defaults under a selector
/// that does not read them (see [`selectors_reading`]).
fn inert_selector_knobs(s: &ServiceArgs) -> Vec<InertKnob> {
    let ring = matches!(s.sel, 8..=10);
    let knobs: [(bool, InertKnob); 6] = [
        (
            s.sel != 8 && s.chwbl_mean_load_factor != default_chwbl_mean_load_factor(),
            (
                "chwbl_mean_load_factor",
                s.chwbl_mean_load_factor.to_string(),
                |s| s.chwbl_mean_load_factor = default_chwbl_mean_load_factor(),
            ),
        ),
        (
            !matches!(s.sel, 8 | 10) && s.chwbl_replication != default_chwbl_replication(),
            ("chwbl_replication", s.chwbl_replication.to_string(), |s| {
                s.chwbl_replication = default_chwbl_replication()
            }),
        ),
        (
            !ring && s.chwbl_prefix_hash_level != default_chwbl_prefix_hash_level(),
            (
                "chwbl_prefix_hash_level",
                s.chwbl_prefix_hash_level.to_string(),
                |s| s.chwbl_prefix_hash_level = default_chwbl_prefix_hash_level(),
            ),
        ),
        (
            !ring && s.chwbl_prefix_hash_flags != 0,
            (
                "chwbl_prefix_hash_flags",
                s.chwbl_prefix_hash_flags.to_string(),
                |s| s.chwbl_prefix_hash_flags = 0,
            ),
        ),
        (
            !ring && s.chwbl_enable_cache_salt,
            ("chwbl_enable_cache_salt", "true".into(), |s| {
                s.chwbl_enable_cache_salt = false
            }),
        ),
        (
            !ring && s.sel != 3 && !s.session_header_name.is_empty(),
            (
                "session_header_name",
                format!("{:?}", s.session_header_name),
                |s| s.session_header_name.clear(),
            ),
        ),
    ];
    knobs
        .into_iter()
        .filter_map(|(set, knob)| set.then_some(knob))
        .collect()
}

/// For a rule restored from the state file (stored before [`selector_knobs_need_their_selector`]
/// refused them): resets the fullproxy rule's inert selector knobs to their defaults, as
/// [`reset_inert_kv_knobs`] does for tier 1.5. Returns the JSON names of the knobs reset.
pub fn reset_inert_selector_knobs(s: &mut ServiceArgs) -> Vec<&'static str> {
    reset_knobs(s, inert_selector_knobs)
}

/// Resets the knobs `inert` lists on a fullproxy rule; returns their JSON names.
fn reset_knobs(
    s: &mut ServiceArgs,
    inert: fn(&ServiceArgs) -> Vec<InertKnob>,
) -> Vec<&'static str> {
    if s.mode != loxi_common::mode::FULLPROXY {
        return Vec::new();
    }
    inert(s)
        .into_iter()
        .map(|(name, _, reset)| {
            reset(s);
            name
        })
        .collect()
}

/// A tier-1.5 knob set away from its defaults: its JSON name, its value as an error shows
/// it, and what sets it back to its default.
type InertKnob = (&'static str, String, fn(&mut ServiceArgs));

/// The tier-1.5 knobs of `s` that [`kv_knobs_need_kv_mode`] refuses: each one set away from its
/// defaults while `kvExactMode` is 0 (none otherwise), `kvEngineType` only without
/// `pd_disagg_mode` too.
fn inert_kv_knobs(s: &ServiceArgs) -> Vec<InertKnob> {
    if s.kv_exact_mode != 0 {
        return Vec::new();
    }
    let engine_algo =
        Engine::of_name(&s.kv_engine_type).map_or("sha256_cbor", Engine::default_hash_algo);
    let algo = &s.kv_hash_algo;
    let knobs: [(bool, InertKnob); 7] = [
        (
            // Read by tier 1.5 (the hash algorithm it derives) and by the P/D handoff (its
            // dialect); a plain pool's engine name changes nothing.
            !s.pd_disagg_mode && s.kv_engine_type != default_kv_engine_type(),
            ("kvEngineType", format!("{:?}", s.kv_engine_type), |s| {
                let derived = Engine::of_name(&s.kv_engine_type).map(Engine::default_hash_algo);
                if derived == Some(s.kv_hash_algo.as_str()) {
                    // Derived from the engine, not chosen: derived again for vllm.
                    s.kv_hash_algo.clear();
                }
                s.kv_engine_type = default_kv_engine_type();
            }),
        ),
        (
            !algo.is_empty() && algo != "sha256_cbor" && algo != engine_algo,
            ("kvHashAlgo", format!("{algo:?}"), |s| {
                s.kv_hash_algo.clear()
            }),
        ),
        (
            s.kv_block_size != default_kv_block_size(),
            ("kvBlockSize", s.kv_block_size.to_string(), |s| {
                s.kv_block_size = default_kv_block_size()
            }),
        ),
        (
            s.kv_zmq_port != default_kv_zmq_port(),
            ("kvZmqPort", s.kv_zmq_port.to_string(), |s| {
                s.kv_zmq_port = default_kv_zmq_port()
            }),
        ),
        (
            !matches!(s.kv_warmup_sec, 0 | 30),
            ("kvWarmupSec", s.kv_warmup_sec.to_string(), |s| {
                s.kv_warmup_sec = 0
            }),
        ),
        (
            s.kv_dp_rank_count != default_kv_dp_rank_count(),
            ("kvDpRankCount", s.kv_dp_rank_count.to_string(), |s| {
                s.kv_dp_rank_count = default_kv_dp_rank_count()
            }),
        ),
        (
            s.kv_replay_port != 0,
            ("kvReplayPort", s.kv_replay_port.to_string(), |s| {
                s.kv_replay_port = 0
            }),
        ),
    ];
    knobs
        .into_iter()
        .filter_map(|(set, knob)| set.then_some(knob))
        .collect()
}

/// For a rule restored from the state file (stored before [`kv_knobs_need_kv_mode`] refused
/// them): resets the fullproxy rule's inert tier-1.5 knobs to their defaults, so the rule is
/// kept (they were never read, so it behaves as before) instead of dropped for failing
/// validation. Returns the JSON names of the knobs reset (the caller logs them).
pub fn reset_inert_kv_knobs(s: &mut ServiceArgs) -> Vec<&'static str> {
    reset_knobs(s, inert_kv_knobs)
}

/// For a rule restored from the state file (stored before [`engine_hash_coherent`] refused
/// it): a tier-1.5 `kvHashAlgo` its `kvEngineType` does not publish, under which no block ever
/// matched, is set to the engine's own, so the rule is kept instead of dropped. Returns
/// `["kvHashAlgo"]` when it was reset (the caller logs it), else nothing.
pub fn reset_incoherent_hash(s: &mut ServiceArgs) -> Vec<&'static str> {
    if engine_hash_coherent(s).is_ok() {
        return Vec::new();
    }
    s.kv_hash_algo = Engine::of_name(&s.kv_engine_type)
        .map_or("sha256_cbor", Engine::default_hash_algo)
        .into();
    vec!["kvHashAlgo"]
}

/// `pdBootstrapPort` means something only to SGLang's P/D handoff: a non-zero port elsewhere
/// is refused (as LoxiLB does), and an SGLang P/D rule stores SGLang's default 8998 for 0.
fn bootstrap_port(s: &mut ServiceArgs) -> Result<(), RuleError> {
    let sglang_pd = s.pd_disagg_mode && s.kv_engine_type == "sglang";
    if s.pd_bootstrap_port != 0 && !sglang_pd {
        return Err(invalid(
            "serviceArguments.pdBootstrapPort",
            format!(
                "{} is SGLang's P/D bootstrap port; it needs pd_disagg_mode: true and \
                 kvEngineType: sglang (leave it out or 0 otherwise)",
                s.pd_bootstrap_port
            ),
        ));
    }
    if sglang_pd && s.pd_bootstrap_port == 0 {
        s.pd_bootstrap_port = super::spec::DEFAULT_SGLANG_BOOTSTRAP_PORT;
    }
    Ok(())
}

/// AI knobs set away from their defaults on a non-fullproxy rule would be silently inert.
fn need_defaults_outside_fullproxy(
    s: &ServiceArgs,
    need: impl Fn(&str, bool) -> Result<(), RuleError>,
) -> Result<(), RuleError> {
    need("kvEngineType", s.kv_engine_type != "vllm")?;
    need("kvHashAlgo", s.kv_hash_algo != "sha256_cbor")?;
    need("kvBlockSize", s.kv_block_size != 16)?;
    need("kvZmqPort", s.kv_zmq_port != 5557)?;
    need("kvWarmupSec", s.kv_warmup_sec != 0)?;
    need("kvDpRankCount", s.kv_dp_rank_count != 1)?;
    need("kvReplayPort", s.kv_replay_port != 0)?;
    need("pd_session_ttl_sec", s.pd_session_ttl_sec != 0)?;
    need("pd_cache_threshold", s.pd_cache_threshold != 20)?;
    need("pd_balance_abs_threshold", s.pd_balance_abs_threshold != 3)?;
    need("chwbl_prefix_hash_level", s.chwbl_prefix_hash_level != 1)?;
    need("chwbl_prefix_hash_flags", s.chwbl_prefix_hash_flags != 0)?;
    need("chwbl_mean_load_factor", s.chwbl_mean_load_factor != 175)?;
    need("chwbl_replication", s.chwbl_replication != 256)?;
    need("chwbl_enable_cache_salt", s.chwbl_enable_cache_salt)
}

/// A rule host as its key: lower case (RFC 9110 §4.2.3) and without one trailing dot (the
/// fully qualified spelling of the same name, RFC 1034 §3.1), as the fullproxy matches `Host`
/// and SNI: `A.com.` and `a.com` are one rule's key, not two rules of which one never serves.
/// An IP address is its canonical text, an IPv6 one without brackets (`[::1]`, `0:0::1` →
/// `::1`): the fullproxy matches a `Host` of `[::1]:8080` as `::1`, so a bracketed
/// rule host never served.
pub fn host_key(host: &str) -> String {
    if let Some(v6) = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .and_then(|h| h.parse::<std::net::Ipv6Addr>().ok())
    {
        return v6.to_string();
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return ip.to_string();
    }
    let h = host.to_ascii_lowercase();
    match h.strip_suffix('.') {
        Some(d) if !d.is_empty() => d.to_string(),
        _ => h,
    }
}

/// A host is matched exactly against the ASCII `Host` header and SNI a request sends: a
/// wildcard, a non-ASCII name, empty labels, whitespace and URL delimiters could never match
/// one and are refused. (Control characters and the length are [`super::text`]'s checks.)
fn check_host(v: &str) -> Result<(), RuleError> {
    let why = if v.contains('*') {
        Some(
            "wildcard hosts are not supported (a host is matched exactly): give each host its own rule",
        )
    } else if !v.is_ascii() {
        Some("a host is matched against the request's ASCII Host header: give its IDNA (xn--) form")
    } else if v.ends_with('.') || v.starts_with('.') || v.contains("..") {
        Some("that is not a host name")
    } else {
        None
    };
    if let Some(why) = why {
        return Err(invalid("serviceArguments.host", format!("{v:?}: {why}")));
    }
    if let Some(c) = v
        .chars()
        .find(|c| c.is_whitespace() || matches!(c, '/' | '?' | '#' | '@'))
    {
        return Err(invalid(
            "serviceArguments.host",
            format!("{v:?} contains {c:?}; a host is a DNS name or an IP address"),
        ));
    }
    Ok(())
}

/// True when a connection to `ep` (at the listener's port) lands on a listener bound to
/// `listener`: the same address (an IPv4-mapped IPv6 address is its IPv4 one), or a loopback
/// address when the listener is a wildcard (`0.0.0.0` takes IPv4 loopback; `::` takes both,
/// as Linux binds it dual-stack by default). Loops through another address of the host or
/// through other rules are caught per request instead (`X-Loxi-Hop`, 508 `loop_detected`).
fn reaches_listener(ep: IpAddr, listener: IpAddr) -> bool {
    let (e, l) = (ep.to_canonical(), listener.to_canonical());
    e == l
        || match l {
            IpAddr::V4(v4) => v4.is_unspecified() && e.is_ipv4() && e.is_loopback(),
            IpAddr::V6(v6) => v6.is_unspecified() && e.is_loopback(),
        }
}

/// One endpoint: its IP canonical and one host to send to (not the unspecified, a multicast or
/// the broadcast address, [`super::addr`]), its target port defaulted to the service port,
/// never the rule's own listener (a loop), and its fields in range.
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
    if let Some(what) = ep
        .endpoint_ip
        .parse::<IpAddr>()
        .ok()
        .and_then(super::addr::endpoint_fault)
    {
        return Err(invalid(
            &f("endpointIP"),
            format!(
                "{} is {what}, not a host to send requests to",
                ep.endpoint_ip
            ),
        ));
    }
    if ep.target_port == 0 {
        ep.target_port = s.port;
    }
    if s.mode == loxi_common::mode::FULLPROXY
        && ep.target_port == s.port
        && let (Ok(e), Ok(l)) = (
            ep.endpoint_ip.parse::<IpAddr>(),
            s.external_ip.trim().parse::<IpAddr>(),
        )
        && reaches_listener(e, l)
    {
        return Err(invalid(
            &f("endpointIP"),
            format!(
                "{}:{} is this rule's own listener ({}:{}): every request would be forwarded to \
                 itself until the gateway runs out of connections",
                ep.endpoint_ip, ep.target_port, s.external_ip, s.port
            ),
        ));
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
    if ep.nixl_port != 0 && !s.pd_disagg_mode {
        return Err(invalid(
            &f("nixl_port"),
            "the NIXL side channel is part of the P/D handoff; it needs pd_disagg_mode: true",
        ));
    }
    if ep.nixl_port != 0 && ep.ep_role == 0 {
        return Err(invalid(
            &f("nixl_port"),
            "a role-0 endpoint serves a request in one leg, with no KV handoff, so its nixl_port \
             would never be read; set it only on prefill (ep_role 1) and decode (ep_role 2) \
             endpoints, or 0",
        ));
    }
    validate_endpoint_kv_ports(&f, ep, s)?;
    // Output-only fields are ignored on input.
    ep.state = None;
    ep.counter = None;
    Ok(())
}

/// An endpoint's own KV-event ports (`kvZmqPort`, `kvReplayPort`) are only read for an
/// endpoint whose events are subscribed: `kvExactMode` 3 (every endpoint) or 1 (prefill
/// endpoints); anywhere else they would be inert, so they are refused. The publisher port's
/// DP-rank span must fit below 65536 as the rule's does.
fn validate_endpoint_kv_ports(
    f: &dyn Fn(&str) -> String,
    ep: &Endpoint,
    s: &ServiceArgs,
) -> Result<(), RuleError> {
    for (name, port) in [
        ("kvZmqPort", ep.kv_zmq_port),
        ("kvReplayPort", ep.kv_replay_port),
    ] {
        if port == 0 {
            continue;
        }
        let subscribed = s.kv_exact_mode == 3 || (s.kv_exact_mode == 1 && ep.ep_role == 1);
        if !subscribed {
            return Err(invalid(
                &f(name),
                format!(
                    "an endpoint's own KV-event port is read only when its events are subscribed \
                     (kvExactMode 3, or kvExactMode 1 on a prefill endpoint, ep_role 1); this \
                     endpoint's are not (kvExactMode {}, ep_role {})",
                    s.kv_exact_mode, ep.ep_role
                ),
            ));
        }
        if u32::from(port) + u32::from(s.kv_dp_rank_count.max(1)) - 1 > 65535 {
            return Err(invalid(
                &f(name),
                format!(
                    "{port} + {} DP ranks runs past port 65535",
                    s.kv_dp_rank_count
                ),
            ));
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rule(extra: serde_json::Value) -> LbRule {
        let mut v = json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 4},
            "endpoints": [
                {"endpointIP": "10.0.1.2", "targetPort": 8000},
                {"endpointIP": "10.0.1.1", "targetPort": 8000}
            ]
        });
        for (k, x) in extra.as_object().expect("object") {
            v["serviceArguments"][k] = x.clone();
        }
        serde_json::from_value(v).expect("rule parses")
    }

    fn field_of(r: LbRule) -> String {
        match validate(r).expect_err("must be rejected") {
            RuleError::Invalid { field, .. } => field,
            other => panic!("not Invalid: {other:?}"),
        }
    }

    #[test]
    fn valid_rule_is_normalised_and_keeps_endpoint_order() {
        let r = validate(rule(
            json!({"externalIP": "::FFFF:10.0.0.1", "protocol": "TCP"}),
        ))
        .expect("valid");
        assert_eq!(r.service.external_ip, "::ffff:10.0.0.1");
        assert_eq!(r.service.protocol, "tcp");
        assert_eq!(r.service.kv_hash_algo, "sha256_cbor");
        let ips: Vec<_> = r.endpoints.iter().map(|e| e.endpoint_ip.as_str()).collect();
        assert_eq!(ips, ["10.0.1.2", "10.0.1.1"], "ep_idx = user order");
    }

    /// An L4 rule the XDP data path cannot carry is refused, naming the field; the same shapes
    /// stay valid in mode 4, where the proxy dials the endpoint itself.
    #[test]
    fn what_the_l4_data_path_cannot_carry_is_refused() {
        let l4 =
            |svc: serde_json::Value, eps: Vec<serde_json::Value>| -> Result<LbRule, RuleError> {
                let mut v = json!({
                    "serviceArguments": {"externalIP": "20.0.0.1", "port": 80, "mode": 0},
                    "endpoints": eps
                });
                for (k, x) in svc.as_object().expect("object") {
                    v["serviceArguments"][k] = x.clone();
                }
                validate(serde_json::from_value(v).expect("rule parses"))
            };
        let ep = |ip: &str, port: u16| json!({"endpointIP": ip, "targetPort": port});
        let field = |r: Result<LbRule, RuleError>| match r.expect_err("must be refused") {
            RuleError::Invalid { field, message } => (field, message),
            other => panic!("not Invalid: {other:?}"),
        };
        let many: Vec<_> = (0..17).map(|i| ep(&format!("10.1.0.{i}"), 8080)).collect();
        let (f, m) = field(l4(json!({}), many.clone()));
        assert_eq!(f, "endpoints");
        assert!(m.contains("at most 16"), "{m}");
        assert!(l4(json!({}), many[..16].to_vec()).is_ok());
        assert!(
            l4(json!({"mode": 4}), many).is_ok(),
            "mode 4 takes up to 1024"
        );
        for mode in [0, 1, 2, 3, 5] {
            let (f, _) = field(l4(json!({"mode": mode}), vec![ep("fd00::2", 80)]));
            assert_eq!(f, "endpoints[0].endpointIP", "mode {mode}");
        }
        let (f, m) = field(l4(
            json!({}),
            vec![ep("10.1.0.1", 80), ep("::ffff:10.1.0.1", 80)],
        ));
        assert_eq!(f, "endpoints[1].endpointIP");
        assert!(m.contains("dotted form"), "{m}");
        let (f, _) = field(l4(
            json!({"externalIP": "0.0.0.0"}),
            vec![ep("10.1.0.1", 80)],
        ));
        assert_eq!(f, "serviceArguments.externalIP");
        let (f, _) = field(l4(json!({}), vec![ep("20.0.0.1", 80)]));
        assert_eq!(f, "endpoints[0]");
        assert!(
            l4(json!({}), vec![ep("20.0.0.1", 81)]).is_ok(),
            "another port"
        );
        let (f, m) = field(l4(json!({"mode": 3}), vec![ep("10.1.0.1", 8080)]));
        assert_eq!(f, "endpoints[0].targetPort");
        assert!(m.contains("DSR"), "{m}");
        assert!(l4(json!({"mode": 3}), vec![ep("10.1.0.1", 80)]).is_ok());
        let omitted = json!({"endpointIP": "10.1.0.1"});
        assert!(
            l4(json!({"mode": 3}), vec![omitted]).is_ok(),
            "defaulted to port"
        );
        assert!(l4(json!({"mode": 4}), vec![ep("fd00::2", 8080)]).is_ok());
    }

    #[test]
    fn hash_algo_is_derived_from_the_engine() {
        let r = validate(rule(json!({"kvEngineType": "sglang", "kvExactMode": 3}))).expect("valid");
        assert_eq!(r.service.kv_hash_algo, "sha256_sglang");
        let r = pd(json!({"kvEngineType": "sglang"})).expect("valid");
        assert_eq!(r.service.kv_hash_algo, "sha256_sglang");
        // A plain pool's engine name would change nothing: refused, saying what reads it.
        match validate(rule(json!({"kvEngineType": "sglang"}))) {
            Err(RuleError::Invalid { field, message }) => {
                assert_eq!(field, "serviceArguments.kvEngineType");
                assert_eq!(
                    message,
                    "\"sglang\" names the engine for tier 1.5 (kvExactMode 1 or 3) and for the \
                     P/D handoff (pd_disagg_mode: true); this rule has neither, so it would change \
                     nothing (set one of them, or leave kvEngineType out)"
                );
            }
            other => panic!("expected a refusal: {other:?}"),
        }
        validate(rule(json!({"kvEngineType": "vllm"}))).expect("the default stays accepted");
        // TensorRT-LLM's KV-event contract is not implemented: refused rather than stored inert.
        assert_eq!(
            field_of(rule(json!({"kvEngineType": "trtllm", "kvExactMode": 3}))),
            "serviceArguments.kvExactMode"
        );
    }

    fn pd(extra: serde_json::Value) -> Result<LbRule, RuleError> {
        let mut v = json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 4,
                "pd_disagg_mode": true},
            "endpoints": [{"endpointIP": "10.0.1.1", "targetPort": 8000, "ep_role": 1},
                {"endpointIP": "10.0.1.2", "targetPort": 8000, "ep_role": 2}]
        });
        for (k, x) in extra.as_object().expect("object") {
            v["serviceArguments"][k] = x.clone();
        }
        validate(serde_json::from_value(v).expect("rule parses"))
    }

    #[test]
    fn the_bootstrap_port_belongs_to_sglang_p_d_and_defaults_to_8998() {
        let r = pd(json!({"kvEngineType": "sglang"})).expect("valid");
        assert_eq!(
            r.service.pd_bootstrap_port, 8998,
            "SGLang's default, stored"
        );
        let r = pd(json!({"kvEngineType": "sglang", "pdBootstrapPort": 9998})).expect("valid");
        assert_eq!(r.service.pd_bootstrap_port, 9998);
        assert_eq!(pd(json!({})).expect("vllm").service.pd_bootstrap_port, 0);
        for bad in [
            pd(json!({"pdBootstrapPort": 9998})),
            pd(json!({"kvEngineType": "trtllm", "pdBootstrapPort": 9998})),
            validate(rule(
                json!({"kvEngineType": "sglang", "kvExactMode": 3, "pdBootstrapPort": 9998}),
            )),
            validate(rule(json!({"mode": 2, "pdBootstrapPort": 9998}))),
        ] {
            match bad {
                Err(RuleError::Invalid { field, message }) => {
                    assert_eq!(field, "serviceArguments.pdBootstrapPort", "{message}");
                }
                other => panic!("expected a refusal: {other:?}"),
            }
        }
    }

    #[test]
    fn an_http_probe_on_a_backend_tls_rule_is_refused() {
        let f = field_of(rule(json!({"security": 2, "probetype": "http"})));
        assert_eq!(f, "serviceArguments.probetype");
        validate(rule(json!({"security": 2, "probetype": "tcp"}))).expect("tcp probes TLS ports");
        validate(rule(json!({"security": 0, "probetype": "http"}))).expect("cleartext backends");
    }

    /// A `security` loxi does not serve is quoted as posted, with the values it serves.
    #[test]
    fn an_unknown_security_names_the_values_loxi_serves() {
        match validate(rule(json!({"security": 3}))).expect_err("3") {
            RuleError::Invalid { field, message } => {
                assert_eq!(field, "serviceArguments.security");
                assert_eq!(
                    message,
                    "3 is not a security value; loxi serves security 0 (plain), 1 (TLS \
                     terminated here) and 2 (TLS terminated here, re-encrypted to the endpoints)"
                );
            }
            other => panic!("not Invalid: {other:?}"),
        }
    }

    #[test]
    fn every_spec_range_is_enforced_at_both_ends() {
        let cases = [
            ("mode", json!(6)),
            ("sel", json!(11)),
            ("sel", json!(7)),
            ("security", json!(3)),
            ("protocol", json!("icmp")),
            ("backend_protocol", json!("http3")),
            ("pd_session_ttl_sec", json!(-1)),
            ("pd_cache_threshold", json!(-1)),
            ("pd_cache_threshold", json!(101)),
            ("pd_balance_abs_threshold", json!(256)),
            ("kvEngineType", json!("tgi")),
            ("kvExactMode", json!(2)),
            ("kvExactMode", json!(4)),
            ("kvBlockSize", json!(0)),
            ("kvHashAlgo", json!("pickle")),
            ("kvZmqPort", json!(0)),
            ("kvDpRankCount", json!(0)),
            ("kvDpRankCount", json!(9)),
            ("chwbl_prefix_hash_level", json!(0)),
            ("chwbl_prefix_hash_level", json!(4)),
            ("chwbl_mean_load_factor", json!(99)),
            ("chwbl_mean_load_factor", json!(301)),
            ("chwbl_replication", json!(0)),
            ("chwbl_replication", json!(1025)),
            ("probetype", json!("icmp")),
            ("externalIP", json!("not-an-ip")),
            ("port", json!(0)),
        ];
        for (key, value) in cases {
            let f = field_of(rule(json!({ key: value.clone() })));
            assert_eq!(f, format!("serviceArguments.{key}"), "{key}={value}");
        }
        let edges = [
            ("chwbl_mean_load_factor", json!(300)),
            ("chwbl_replication", json!(1024)),
            ("kvDpRankCount", json!(8)),
            ("chwbl_prefix_hash_level", json!(3)),
        ];
        for (key, value) in edges {
            validate(rule(
                json!({"kvExactMode": 3, "sel": 8, key: value.clone()}),
            ))
            .expect("edge of the range is valid");
        }
    }

    #[test]
    fn probe_fields_no_probe_reads_are_refused() {
        let refused = [
            (json!({"probeport": 1234}), "probeport"),
            (json!({"probetype": "none", "probeport": 1234}), "probeport"),
            (json!({"probereq": "/x"}), "probereq"),
            (json!({"probetype": "tcp", "proberesp": "OK"}), "proberesp"),
            (json!({"monitor": true, "probereq": "/x"}), "probereq"),
            (json!({"mode": 0, "monitor": true}), "monitor"),
            (json!({"mode": 0, "probetype": "tcp"}), "probetype"),
            (json!({"probeTimeout": 5}), "probeTimeout"),
            (
                json!({"probetype": "none", "probeRetries": 3}),
                "probeRetries",
            ),
        ];
        for (extra, field) in refused {
            assert_eq!(
                field_of(rule(extra.clone())),
                format!("serviceArguments.{field}"),
                "{extra}"
            );
        }
        for extra in [
            json!({"probetype": "", "probeport": 0, "probereq": "", "proberesp": ""}),
            json!({"monitor": true, "probeport": 9000}),
            json!({"probeTimeout": 0, "probeRetries": 0}),
            json!({"probetype": "tcp", "probeTimeout": 5, "probeRetries": 3}),
            json!({"probetype": "http", "probereq": "/health", "proberesp": "OK", "probeport": 9}),
            json!({"mode": 0, "probetype": "none"}),
        ] {
            validate(rule(extra.clone())).unwrap_or_else(|e| panic!("{extra}: {e}"));
        }
    }

    #[test]
    fn an_http_probereq_is_a_path_not_a_request_line_or_url() {
        for bad in [
            "GET /health",
            "/health check",
            "http://10.0.0.1/health",
            "/health#top",
        ] {
            let e = validate(rule(json!({"probetype": "http", "probereq": bad}))).expect_err(bad);
            assert_eq!(
                e.to_string(),
                format!(
                    "serviceArguments.probereq: probereq {bad:?} must be a path such as \
                     \"/health\" (the probe sends GET <path>; no method, scheme, host, space or \
                     fragment)"
                ),
                "{bad}"
            );
        }
        for good in ["", "/", "/health", "/health?full=1", "health", "v1/models"] {
            validate(rule(
                json!({"monitor": true, "probetype": "http", "probereq": good}),
            ))
            .unwrap_or_else(|e| panic!("{good:?}: {e}"));
        }
    }

    #[test]
    fn a_fullproxy_inactive_timeout_is_a_day_at_most() {
        for secs in [0, 1, 1800, 86_400] {
            let v = validate(rule(json!({"inactiveTimeOut": secs}))).expect("in range");
            assert_eq!(v.service.inactive_timeout, secs);
        }
        assert_eq!(
            field_of(rule(json!({"inactiveTimeOut": 86_401}))),
            "serviceArguments.inactiveTimeOut"
        );
    }

    #[test]
    fn unequal_weights_are_refused_where_nothing_reads_them_and_reset_on_restore() {
        let weighted = |extra: serde_json::Value, w: [u32; 2]| {
            let mut r = rule(extra);
            r.endpoints[0].weight = w[0];
            r.endpoints[1].weight = w[1];
            r
        };
        // Plain fullproxy selectors give each endpoint an equal share.
        for sel in [0, 1, 3, 4, 8, 9] {
            let r = weighted(json!({"sel": sel}), [1, 4]);
            assert_eq!(field_of(r), "endpoints[1].weight", "sel {sel}");
            validate(weighted(json!({"sel": sel}), [3, 3]))
                .unwrap_or_else(|e| panic!("equal weights under sel {sel}: {e}"));
        }
        // Read: wrr, weighted hash, the KV tier's blend.
        for extra in [
            json!({"sel": 2}),
            json!({"sel": 10}),
            json!({"sel": 0, "kvExactMode": 3}),
        ] {
            validate(weighted(extra.clone(), [1, 4])).unwrap_or_else(|e| panic!("{extra}: {e}"));
        }
        // A rule stored before the refusal is kept with weights 1 (as it behaved) and the
        // reset named; one whose weights are read is left alone.
        let mut old = weighted(json!({"sel": 0}), [1, 4]);
        assert_eq!(reset_inert_weights(&mut old), ["weight"]);
        assert_eq!((old.endpoints[0].weight, old.endpoints[1].weight), (1, 1));
        validate(old).expect("valid after the reset");
        let mut wrr = weighted(json!({"sel": 2}), [1, 4]);
        assert!(reset_inert_weights(&mut wrr).is_empty());
        assert_eq!(wrr.endpoints[1].weight, 4);
    }

    #[test]
    fn selector_knobs_are_refused_under_a_selector_that_never_reads_them() {
        let refused = [
            (
                json!({"sel": 0, "chwbl_mean_load_factor": 250}),
                "chwbl_mean_load_factor",
            ),
            (
                json!({"sel": 10, "chwbl_mean_load_factor": 250}),
                "chwbl_mean_load_factor",
            ),
            (
                json!({"sel": 9, "chwbl_replication": 8}),
                "chwbl_replication",
            ),
            (
                json!({"sel": 0, "chwbl_prefix_hash_level": 2}),
                "chwbl_prefix_hash_level",
            ),
            (
                json!({"sel": 3, "chwbl_prefix_hash_flags": 1}),
                "chwbl_prefix_hash_flags",
            ),
            (
                json!({"sel": 0, "chwbl_enable_cache_salt": true}),
                "chwbl_enable_cache_salt",
            ),
            (
                json!({"sel": 0, "session_header_name": "X-S"}),
                "session_header_name",
            ),
            (
                json!({"sel": 5, "kvExactMode": 3, "session_header_name": "X-S"}),
                "session_header_name",
            ),
        ];
        for (extra, field) in refused {
            let e = validate(rule(extra.clone())).expect_err("inert knob refused");
            let RuleError::Invalid { field: f, message } = &e else {
                panic!("{e:?}")
            };
            assert_eq!(f, &format!("serviceArguments.{field}"), "{extra}");
            assert!(message.contains("is read only by sel"), "{message}");
            assert!(
                message.contains(&format!("this rule's sel is {}", extra["sel"])),
                "{message}"
            );
        }
        let accepted = [
            json!({"sel": 8, "chwbl_mean_load_factor": 250, "chwbl_replication": 8,
                   "chwbl_prefix_hash_level": 2, "chwbl_prefix_hash_flags": 1,
                   "chwbl_enable_cache_salt": true, "session_header_name": "X-S"}),
            json!({"sel": 10, "chwbl_replication": 8, "chwbl_prefix_hash_level": 3}),
            json!({"sel": 9, "chwbl_prefix_hash_flags": 32, "session_header_name": "X-S"}),
            json!({"sel": 3, "session_header_name": "cookie:sid"}),
            // Defaults are accepted anywhere (saved rules carry them).
            json!({"sel": 0, "chwbl_mean_load_factor": 175, "chwbl_replication": 256,
                   "chwbl_prefix_hash_level": 1, "chwbl_prefix_hash_flags": 0,
                   "chwbl_enable_cache_salt": false, "session_header_name": ""}),
        ];
        for extra in accepted {
            validate(rule(extra.clone())).unwrap_or_else(|e| panic!("{extra}: {e}"));
        }
    }

    #[test]
    fn names_loops_and_unspecified_endpoints_are_refused_naming_the_field() {
        let with = |svc: serde_json::Value, ep: serde_json::Value| {
            let mut r = json!({
                "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 4},
                "endpoints": [{"endpointIP": "10.0.0.2", "targetPort": 8000}]
            });
            for (k, v) in svc.as_object().expect("object") {
                r["serviceArguments"][k] = v.clone();
            }
            for (k, v) in ep.as_object().expect("object") {
                r["endpoints"][0][k] = v.clone();
            }
            validate(serde_json::from_value(r).expect("rule"))
        };
        for (svc, ep, field) in [
            (
                json!({"model_name": "\n\u{0}"}),
                json!({}),
                "serviceArguments.model_name",
            ),
            (
                json!({"host": "a.com:80"}),
                json!({}),
                "serviceArguments.host",
            ),
            (json!({"host": "a b"}), json!({}), "serviceArguments.host"),
            // IPv6 punctuation around no IPv6 address: no request's host is matched so.
            (
                json!({"host": "[::1]:80"}),
                json!({}),
                "serviceArguments.host",
            ),
            (json!({"host": "[::1"}), json!({}), "serviceArguments.host"),
            (json!({"host": "::1]"}), json!({}), "serviceArguments.host"),
            (
                json!({"host": "[[::1]]"}),
                json!({}),
                "serviceArguments.host",
            ),
            (json!({"host": "[]"}), json!({}), "serviceArguments.host"),
            (
                json!({"host": "[v1.fe]"}),
                json!({}),
                "serviceArguments.host",
            ),
            (
                json!({"host": "fd00::1%eth0"}),
                json!({}),
                "serviceArguments.host",
            ),
            (
                json!({"host": "[fe80::1%eth0]"}),
                json!({}),
                "serviceArguments.host",
            ),
            (
                json!({"host": "[127.0.0.1]"}),
                json!({}),
                "serviceArguments.host",
            ),
            (
                json!({"host": "a::b.example"}),
                json!({}),
                "serviceArguments.host",
            ),
            (
                json!({"host": "*.example.com"}),
                json!({}),
                "serviceArguments.host",
            ),
            (
                json!({"host": "bücher.example"}),
                json!({}),
                "serviceArguments.host",
            ),
            (json!({"host": "."}), json!({}), "serviceArguments.host"),
            (
                json!({"host": "a.com.."}),
                json!({}),
                "serviceArguments.host",
            ),
            (
                json!({"host": "a.com/x"}),
                json!({}),
                "serviceArguments.host",
            ),
            (
                json!({}),
                json!({"endpointIP": "0.0.0.0"}),
                "endpoints[0].endpointIP",
            ),
            (
                json!({}),
                json!({"endpointIP": "::"}),
                "endpoints[0].endpointIP",
            ),
            (
                json!({}),
                json!({"endpointIP": "10.0.0.1", "targetPort": 0}),
                "endpoints[0].endpointIP",
            ),
            (
                json!({}),
                json!({"endpointIP": "10.0.0.1", "targetPort": 80}),
                "endpoints[0].endpointIP",
            ),
            (
                json!({}),
                json!({"endpointIP": "::ffff:10.0.0.1", "targetPort": 80}),
                "endpoints[0].endpointIP",
            ),
            (
                json!({"externalIP": "0.0.0.0"}),
                json!({"endpointIP": "127.0.0.1", "targetPort": 80}),
                "endpoints[0].endpointIP",
            ),
            (
                json!({"externalIP": "::"}),
                json!({"endpointIP": "::1", "targetPort": 80}),
                "endpoints[0].endpointIP",
            ),
            (
                json!({"externalIP": "::"}),
                json!({"endpointIP": "127.0.0.1", "targetPort": 80}),
                "endpoints[0].endpointIP",
            ),
        ] {
            match with(svc.clone(), ep.clone()) {
                Err(RuleError::Invalid { field: f, .. }) => assert_eq!(f, field, "{svc} {ep}"),
                other => panic!("{svc} {ep}: {other:?}"),
            }
        }
        // Still accepted: a model name with '/', ':' and spaces, an IPv6 host literal, the
        // rule's own address on another port, and an L4 rule whose endpoint shares the VIP.
        for (svc, ep) in [
            (json!({"model_name": "org/Model 7B:q4"}), json!({})),
            (json!({"host": "::1"}), json!({})),
            (json!({"host": "[FD00:0::1]"}), json!({})),
            (json!({"host": "127.0.0.1"}), json!({})),
            (
                json!({}),
                json!({"endpointIP": "10.0.0.1", "targetPort": 81}),
            ),
            (
                json!({"externalIP": "0.0.0.0"}),
                json!({"endpointIP": "10.0.0.2", "targetPort": 80}),
            ),
            (
                json!({"externalIP": "0.0.0.0"}),
                json!({"endpointIP": "127.0.0.1", "targetPort": 81}),
            ),
        ] {
            assert!(with(svc.clone(), ep.clone()).is_ok(), "{svc} {ep}");
        }
    }

    /// A VIP or an endpoint that names no single host is refused naming the field, in every
    /// mode and in its IPv4-mapped spelling; a mode-4 VIP may still be 0.0.0.0 or ::.
    #[test]
    fn multicast_broadcast_and_unspecified_addresses_are_refused_naming_the_field() {
        let refusal = |r: LbRule| match validate(r) {
            Err(RuleError::Invalid { field, message }) => (field, message),
            other => panic!("expected a refusal, got {other:?}"),
        };
        for (vip, what) in [
            ("224.0.0.1", "a multicast address"),
            ("ff02::1", "a multicast address"),
            ("::ffff:239.1.2.3", "a multicast address"),
            ("255.255.255.255", "the broadcast address"),
        ] {
            for mode in [0, 4] {
                let (field, message) = refusal(rule(json!({"externalIP": vip, "mode": mode})));
                assert_eq!(field, "serviceArguments.externalIP", "{vip} mode {mode}");
                assert!(
                    message.contains(&format!("is {what}; a VIP is the one unicast address")),
                    "{message}"
                );
            }
        }
        let three = |bad: &str| {
            let mut r = rule(json!({}));
            let mut ep = r.endpoints[0].clone();
            ep.endpoint_ip = bad.into();
            r.endpoints.push(ep);
            r
        };
        for (ip, what) in [
            ("224.0.0.251", "a multicast address"),
            ("ff05::1:3", "a multicast address"),
            ("255.255.255.255", "the broadcast address"),
            ("::ffff:255.255.255.255", "the broadcast address"),
            ("0.0.0.0", "the unspecified address"),
            ("::ffff:0.0.0.0", "the unspecified address"),
        ] {
            let (field, message) = refusal(three(ip));
            assert_eq!(field, "endpoints[2].endpointIP", "{ip}");
            assert!(
                message.ends_with(&format!("is {what}, not a host to send requests to")),
                "{message}"
            );
        }
        // "Listen on every address" stays a mode-4 VIP; the L4 data path refuses it, also
        // spelled as an IPv4-mapped address.
        validate(rule(json!({"externalIP": "0.0.0.0"}))).expect("mode 4 on every address");
        validate(rule(json!({"externalIP": "::"}))).expect("mode 4 on every address");
        let (field, _) = refusal(rule(json!({"externalIP": "::ffff:0.0.0.0", "mode": 0})));
        assert_eq!(field, "serviceArguments.externalIP");
    }

    #[test]
    fn a_rules_name_is_printable_and_253_bytes_at_most() {
        for name in [
            "web\nprod".to_string(),
            "a\tb".to_string(),
            "nul\u{0}".to_string(),
            "x".repeat(1 << 20),
            "x".repeat(254),
        ] {
            let shown: String = name.chars().take(20).collect();
            assert_eq!(
                field_of(rule(json!({ "name": name }))),
                "serviceArguments.name",
                "{shown:?}"
            );
        }
        let kept = validate(rule(json!({"name": "default_tcp-lb-default:llb-inst0"})))
            .expect("kube-loxilb's name");
        assert_eq!(kept.service.name, "default_tcp-lb-default:llb-inst0");
        validate(rule(json!({"name": "x".repeat(253)}))).expect("at the bound");
        validate(rule(json!({"name": "Modèle français 7B"}))).expect("printable non-ASCII");
    }

    #[test]
    fn n3_selector_only_for_udp() {
        assert_eq!(field_of(rule(json!({"sel": 6}))), "serviceArguments.sel");
        // Accepted by the schema for udp, but no data path implements n3: refused too.
        assert_eq!(
            field_of(rule(json!({"sel": 6, "protocol": "udp", "mode": 0}))),
            "serviceArguments.sel"
        );
    }

    #[test]
    fn zmq_port_span_of_all_dp_ranks_must_fit() {
        let f = field_of(rule(
            json!({"kvExactMode": 3, "kvZmqPort": 65535, "kvDpRankCount": 2}),
        ));
        assert_eq!(f, "serviceArguments.kvZmqPort");
        validate(rule(
            json!({"kvExactMode": 3, "kvZmqPort": 65534, "kvDpRankCount": 2}),
        ))
        .expect("fits");
    }

    #[test]
    fn ai_fields_require_fullproxy() {
        for (key, value) in [
            ("sel", json!(8)),
            ("kvExactMode", json!(3)),
            ("model_name", json!("m")),
            ("kvBlockSize", json!(32)),
            ("chwbl_replication", json!(64)),
            ("pd_cache_threshold", json!(10)),
            ("backend_protocol", json!("http2")),
        ] {
            let f = field_of(rule(json!({"mode": 2, key: value.clone()})));
            assert_eq!(f, format!("serviceArguments.{key}"), "{key}={value}");
        }
        validate(rule(json!({"mode": 2, "sel": 2}))).expect("plain L4 rule");
    }

    #[test]
    fn kv_topology_rules() {
        assert_eq!(
            field_of(rule(json!({"kvExactMode": 1}))),
            "serviceArguments.kvExactMode"
        );
        assert_eq!(
            field_of(rule(json!({"kvExactMode": 3, "kvEngineType": "llamacpp"}))),
            "serviceArguments.kvExactMode"
        );
        assert_eq!(
            field_of(rule(json!({"pd_cache_aware_mode": true}))),
            "serviceArguments.pd_cache_aware_mode"
        );
        assert_eq!(
            field_of(rule(
                json!({"pd_disagg_mode": true, "pd_cache_threshold": 50})
            )),
            "serviceArguments.pd_cache_threshold"
        );
        assert_eq!(
            field_of(rule(
                json!({"pd_disagg_mode": true, "pd_balance_abs_threshold": 9})
            )),
            "serviceArguments.pd_balance_abs_threshold"
        );
        validate(rule(json!({"kvExactMode": 3}))).expect("single pool");
    }

    #[test]
    fn tier_1_knobs_compile_with_zero_meaning_the_default() {
        let spec = |extra: serde_json::Value| {
            let mut r = rule(extra);
            r.endpoints[0].ep_role = 1;
            r.endpoints[1].ep_role = 2;
            ServiceSpec::compile(&validate(r).expect("valid"))
                .expect("spec")
                .pd
                .expect("pd")
                .trie
        };
        use super::super::spec::TrieSpec;
        assert_eq!(spec(json!({"pd_disagg_mode": true})), None);
        let zero = json!({"pd_disagg_mode": true, "pd_cache_aware_mode": true,
            "pd_cache_threshold": 0, "pd_balance_abs_threshold": 0});
        assert_eq!(
            spec(zero),
            Some(TrieSpec {
                threshold_pct: 20,
                balance_abs: 3
            })
        );
        let set = json!({"pd_disagg_mode": true, "pd_cache_aware_mode": true,
            "pd_cache_threshold": 50, "pd_balance_abs_threshold": 9});
        assert_eq!(
            spec(set),
            Some(TrieSpec {
                threshold_pct: 50,
                balance_abs: 9
            })
        );
    }

    #[test]
    fn pd_rules_need_a_prefill_and_a_decode_endpoint() {
        let mut r = rule(json!({"pd_disagg_mode": true}));
        assert_eq!(field_of(r.clone()), "endpoints");
        r.endpoints[0].ep_role = 1;
        assert_eq!(field_of(r.clone()), "endpoints");
        r.endpoints[1].ep_role = 2;
        let ok = validate(r.clone()).expect("one prefill and one decode");
        let spec = ServiceSpec::compile(&ok).expect("spec");
        assert!(spec.needs_body());
        let pd = spec.pd.expect("pd spec");
        use super::super::spec::Role;
        assert_eq!(pd.roles, vec![Role::Prefill, Role::Decode]);
        assert_eq!(pd.session_ttl, std::time::Duration::from_secs(300));
        assert_eq!(
            pd.nixl_ports,
            vec![8000, 8000],
            "nixl_port 0 means targetPort"
        );
        let mut r1 = r.clone();
        r1.service.kv_exact_mode = 1;
        r1.service.pd_session_ttl_sec = 7;
        r1.endpoints[0].nixl_port = 5600;
        let spec = ServiceSpec::compile(&validate(r1).expect("valid")).expect("spec");
        let kv = spec.kv.expect("tier 1.5");
        assert_eq!(
            kv.endpoints
                .iter()
                .map(|e| e.subscribed)
                .collect::<Vec<_>>(),
            vec![true, false],
            "mode 1 subscribes only the prefill endpoint"
        );
        let pd = spec.pd.expect("pd");
        assert_eq!(pd.session_ttl, std::time::Duration::from_secs(7));
        assert_eq!(pd.nixl_ports, vec![5600, 8000]);
        let mut r3 = r.clone();
        r3.service.kv_exact_mode = 3;
        assert_eq!(field_of(r3), "serviceArguments.kvExactMode");
        let mut plain = rule(json!({}));
        plain.endpoints[0].ep_role = 1;
        assert_eq!(field_of(plain), "endpoints[0].ep_role");
        let mut plain = rule(json!({}));
        plain.endpoints[0].nixl_port = 5600;
        assert_eq!(field_of(plain), "endpoints[0].nixl_port");
        assert_eq!(
            field_of(rule(json!({"pd_session_ttl_sec": 60}))),
            "serviceArguments.pd_session_ttl_sec"
        );
    }

    /// A decode endpoint's `nixl_port` is not inert by LoxiLB's contract: the spec gives every
    /// endpoint one, LoxiLB's docs' loxicmd example sets one per endpoint (`--ep-role=prefill,
    /// decode --nixl-port=9001,9002`, fixture f1) and LoxiLB's CI expects it in the request
    /// id's decode address. It is accepted and kept, for both roles.
    #[test]
    fn a_decode_endpoints_nixl_port_is_accepted_and_kept() {
        let mut r = rule(json!({"pd_disagg_mode": true}));
        r.endpoints[0].ep_role = 1;
        r.endpoints[0].nixl_port = 9001;
        r.endpoints[1].ep_role = 2;
        r.endpoints[1].nixl_port = 9002;
        let v = validate(r).expect("LoxiLB's own example");
        let ports: Vec<u16> = v.endpoints.iter().map(|e| e.nixl_port).collect();
        assert_eq!(ports, [9001, 9002]);
        let spec = ServiceSpec::compile(&v).expect("spec");
        assert_eq!(spec.pd.expect("pd").nixl_ports, [9001, 9002]);
        // A role-0 endpoint's would never be read (one leg, no handoff): refused.
        let mut r = rule(json!({"pd_disagg_mode": true}));
        r.endpoints[0].ep_role = 1;
        r.endpoints[1].ep_role = 2;
        r.endpoints.push(r.endpoints[1].clone());
        r.endpoints[2].ep_role = 0;
        r.endpoints[2].endpoint_ip = "10.0.0.9".into();
        r.endpoints[2].nixl_port = 9003;
        assert_eq!(field_of(r), "endpoints[2].nixl_port");
    }

    #[test]
    fn endpoint_checks_name_the_index() {
        let mut r = rule(json!({}));
        r.endpoints[1].weight = 0;
        assert_eq!(field_of(r), "endpoints[1].weight");
        let mut r = rule(json!({}));
        r.endpoints[1].endpoint_ip = "host.example".into();
        assert_eq!(field_of(r), "endpoints[1].endpointIP");
        let mut r = rule(json!({}));
        r.endpoints[1].endpoint_ip = "10.0.1.2".into();
        assert_eq!(field_of(r), "endpoints[1]", "duplicate endpoint");
        // An IPv4-mapped spelling of the same host is the same endpoint.
        let mut r = rule(json!({}));
        r.endpoints[1].endpoint_ip = "::ffff:10.0.1.2".into();
        r.endpoints[1].target_port = r.endpoints[0].target_port;
        match validate(r) {
            Err(RuleError::Invalid { field, message }) => {
                assert_eq!(field, "endpoints[1]");
                assert!(
                    message.contains("is already endpoints[0] (10.0.1.2, the same host)"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        let mut r = rule(json!({}));
        r.endpoints.clear();
        assert_eq!(field_of(r), "endpoints");
    }

    #[test]
    fn target_port_zero_means_the_service_port_and_output_fields_are_dropped() {
        let mut r = rule(json!({}));
        r.endpoints[0].target_port = 0;
        r.endpoints[0].state = Some("inactive".into());
        let v = validate(r).expect("valid");
        assert_eq!(v.endpoints[0].target_port, 80);
        assert_eq!(v.endpoints[0].state, None);
    }

    #[test]
    fn reshaping_a_key_is_a_conflict_but_new_endpoints_are_not() {
        let old = validate(rule(json!({}))).expect("valid");
        let resel = validate(rule(json!({"sel": 2}))).expect("valid");
        match check_same_shape(&old, &resel) {
            Err(RuleError::Conflict { field, existing }) => {
                assert_eq!(
                    (field.as_str(), existing.as_str()),
                    ("serviceArguments.sel", "0")
                );
            }
            other => panic!("expected a conflict: {other:?}"),
        }
        let mut more = old.clone();
        more.endpoints[0].weight = 5;
        check_same_shape(&old, &more).expect("same shape");
    }

    #[test]
    fn endpoint_kv_ports_need_a_subscribed_endpoint() {
        let mut r = rule(json!({"kvExactMode": 3}));
        r.endpoints[0].kv_zmq_port = 5601;
        r.endpoints[0].kv_replay_port = 5701;
        let ok = validate(r).expect("mode 3 subscribes every endpoint");
        assert_eq!(
            (ok.endpoints[0].kv_zmq_port, ok.endpoints[0].kv_replay_port),
            (5601, 5701)
        );
        let mut plain = rule(json!({}));
        plain.endpoints[0].kv_zmq_port = 5601;
        assert_eq!(field_of(plain), "endpoints[0].kvZmqPort");
        let mut span = rule(json!({"kvExactMode": 3, "kvDpRankCount": 4}));
        span.endpoints[0].kv_replay_port = 65534;
        assert_eq!(field_of(span), "endpoints[0].kvReplayPort");
    }

    #[test]
    fn an_explicit_hash_the_engine_does_not_publish_is_refused_with_tier_1_5() {
        for (engine, algo, ok) in [
            ("sglang", "sha256_cbor", false),
            ("sglang", "xxhash_cbor", false),
            ("vllm", "sha256_sglang", false),
            ("sglang", "sha256_sglang", true),
            ("vllm", "xxhash_cbor", true),
            ("vllm", "sha256_cbor", true),
        ] {
            let got = validate(rule(
                json!({"kvEngineType": engine, "kvHashAlgo": algo, "kvExactMode": 3}),
            ));
            match (ok, got) {
                (true, Ok(r)) => assert_eq!(r.service.kv_hash_algo, algo),
                (false, Err(RuleError::Invalid { field, message })) => {
                    assert_eq!(field, "serviceArguments.kvHashAlgo", "{engine}/{algo}");
                    assert!(
                        message.contains(&format!(
                            "{algo:?} is not a hash kvEngineType {engine} publishes"
                        )) && message.contains("leave kvHashAlgo out"),
                        "{message}"
                    );
                }
                (_, other) => panic!("{engine}/{algo}: {other:?}"),
            }
        }
        // The P/D ladder's tier 1.5 (kvExactMode 1) reads the same events.
        match pd(json!({"kvEngineType": "sglang", "kvHashAlgo": "sha256_cbor", "kvExactMode": 1})) {
            Err(RuleError::Invalid { field, .. }) => {
                assert_eq!(field, "serviceArguments.kvHashAlgo")
            }
            other => panic!("P/D sglang with sha256_cbor: {other:?}"),
        }
    }

    #[test]
    fn rule_kv_knobs_away_from_their_defaults_need_kv_exact_mode() {
        for (key, value) in [
            ("kvZmqPort", json!(6000)),
            ("kvHashAlgo", json!("xxhash_cbor")),
            ("kvBlockSize", json!(7)),
            ("kvWarmupSec", json!(5)),
            ("kvDpRankCount", json!(2)),
            ("kvReplayPort", json!(5700)),
        ] {
            match validate(rule(json!({ key: value.clone() }))) {
                Err(RuleError::Invalid { field, message }) => {
                    assert_eq!(field, format!("serviceArguments.{key}"), "{key}={value}");
                    assert!(
                        message.contains("read only with kvExactMode 1 or 3")
                            && message.contains(&format!("leave {key} out")),
                        "{message}"
                    );
                }
                other => panic!("{key}={value}: expected a refusal, got {other:?}"),
            }
            let kv = validate(rule(json!({"kvExactMode": 3, key: value.clone()})))
                .expect("read by tier 1.5");
            let stored = serde_json::to_value(&kv.service).expect("serialises");
            assert_eq!(stored[key], value, "{key} kept with kvExactMode 3");
        }
        // The defaults, as LoxiLB's clients send them, stay accepted without kvExactMode.
        validate(rule(json!({
            "kvZmqPort": 5557, "kvHashAlgo": "sha256_cbor", "kvBlockSize": 16,
            "kvWarmupSec": 30, "kvDpRankCount": 1, "kvReplayPort": 0
        })))
        .expect("defaults");
        let r = validate(rule(
            json!({"kvEngineType": "sglang", "kvHashAlgo": "sha256_sglang", "kvExactMode": 3}),
        ))
        .expect("the engine's own algorithm is its default");
        assert_eq!(r.service.kv_hash_algo, "sha256_sglang");
    }

    #[test]
    fn rule_error_messages_have_no_runs_of_spaces() {
        let mut ep = rule(json!({}));
        ep.endpoints[0].kv_zmq_port = 6000;
        let mut refused = vec![validate(ep).expect_err("endpoint port without kvExactMode")];
        refused.push(validate(rule(json!({"kvZmqPort": 6000}))).expect_err("rule port"));
        refused.push(
            validate(rule(json!({"security": 2, "probetype": "http"}))).expect_err("http probe"),
        );
        for e in refused {
            let text = e.to_string();
            assert!(!text.contains("  "), "double space in {text:?}");
        }
    }

    #[test]
    fn endpoints_are_capped_per_rule() {
        let mut r = rule(json!({}));
        r.endpoints = (0..MAX_ENDPOINTS)
            .map(|i| Endpoint {
                endpoint_ip: format!("10.1.{}.{}", i / 256, i % 256),
                ..r.endpoints[0].clone()
            })
            .collect();
        validate(r.clone()).expect("the cap itself is allowed");
        let mut extra = r.endpoints[0].clone();
        extra.endpoint_ip = "10.9.9.9".into();
        r.endpoints.push(extra);
        assert_eq!(field_of(r), "endpoints");
    }

    #[test]
    fn unknown_field_message_names_only_the_key() {
        let e = RuleError::UnknownField {
            field: "endpoints[0].weigth".into(),
            suggestion: Some("weight".into()),
        };
        assert_eq!(
            e.to_string(),
            "\"weigth\" is not a field; did you mean \"weight\"?"
        );
    }
}
