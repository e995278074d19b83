//! The load-balancer rule as the REST API and the state file carry it.
//!
//! Field names and casing are LoxiLB's compatibility contract (`../shared/spec/`,
//! `configuration-and-tuning.txt`): `externalIP`, `targetPort` and the `kv*` family are camelCase,
//! `pd_*`, `ep_role`, `nixl_port`, `chwbl_*`, `session_header_name`, `model_name` are snake_case.
//! Unlike LoxiLB, unknown or wrongly cased fields are rejected (`deny_unknown_fields`, and the API
//! layer names the right spelling before serde ever sees the body).
//!
//! Defaults follow the spec; where LoxiLB's schema and runtime disagree we document which one we
//! keep next to the field.

use serde::{Deserialize, Serialize};

/// `ip:port` for an endpoint address, bracketing IPv6 literals (what upstream clients and
/// ZMQ sockets connect to).
pub fn authority(ip: &str, port: impl std::fmt::Display) -> String {
    if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

/// One LB rule: `{serviceArguments, endpoints}` (LoxiLB's `LoadbalanceEntry`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LbRule {
    /// The service (VIP, port, protocol, mode, selector and every AI knob).
    #[serde(rename = "serviceArguments")]
    pub service: ServiceArgs,
    /// Endpoints in the order the user gave them; `ep_idx` is the index in this list
    /// (LoxiLB sorts by IP; loxi keeps the user's order so indices are predictable).
    #[serde(default)]
    pub endpoints: Vec<Endpoint>,
    /// Output only: the stable service id of a stored rule (the `service` metric label and the
    /// `service_id` of the KV views). Ignored on input, so a listed rule can be posted back.
    #[serde(rename = "serviceId", default, skip_serializing_if = "Option::is_none")]
    pub service_id: Option<u32>,
}

/// `serviceArguments` of a rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceArgs {
    /// VIP (IPv4 or IPv6 literal). Required.
    #[serde(rename = "externalIP")]
    pub external_ip: String,
    /// Service port, 1–65535. Required.
    pub port: u16,
    /// `tcp`, `udp` or `sctp` (lower case on output; input is case-insensitive). Default `tcp`.
    #[serde(default = "default_protocol")]
    pub protocol: String,
    /// NAT mode 0–5; 4 = fullproxy, required for every L7/AI feature.
    #[serde(default)]
    pub mode: u8,
    /// Selector 0–10 (see `loxi_common::sel`); 7 is reserved and rejected.
    #[serde(default)]
    pub sel: u8,
    /// 0 plaintext, 1 TLS termination, 2 TLS termination + re-encryption ([`security_name`]).
    #[serde(default)]
    pub security: u8,
    /// Host key for L7 rules; part of the rule key.
    #[serde(default)]
    pub host: String,
    /// Backend protocol: `http1` (default), `http2` or `both` (ALPN decides; needs
    /// `security: 2`).
    #[serde(default = "default_backend_protocol")]
    pub backend_protocol: String,
    /// `security: 2`: the name verified in the backends' certificates (and sent as SNI);
    /// empty = each endpoint's IP (LoxiLB's newer CLI's field).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub backend_tls_server_name: String,
    /// `security: 2`: PEM CA bundle (a file on the daemon's host) the backends' certificates
    /// are verified against; empty = the webpki (Mozilla) root set. A loxi extension.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub backend_ca_file: String,
    /// `security: 2`: accept any backend certificate (no verification; warned in the log).
    /// A loxi extension, off unless set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub backend_tls_insecure: bool,
    /// Marks an SSE/streaming service. loxi never applies an idle timeout to a response that is
    /// still sending data, whatever this says; the field is stored for compatibility.
    #[serde(default)]
    pub sse_mode: bool,
    /// Session key source for sel 3 (and the CHWBL conversation key): a header name,
    /// `cookie:NAME`, `query:NAME` or `basic-auth`; empty = client IP.
    #[serde(default)]
    pub session_header_name: String,
    /// Model pool key; empty = wildcard pool. Case-sensitive. Part of the rule key.
    #[serde(default)]
    pub model_name: String,
    /// Rule name: informational, and the key of `DELETE .../loadbalancer/name/{name}`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// LoxiLB's stable opaque rule id (Octavia): kept as posted, minted (a UUIDv4) when a new
    /// rule has none, kept across updates of the same key; `GET .../loadbalancer/id/{id}`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// kube-loxilb's ownership mark (`"managed": true` on the rules it creates): stored and
    /// reported back, as LoxiLB does; it changes nothing in forwarding there either.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub managed: bool,
    /// BGP advertisement (stored; loxi has no BGP speaker).
    #[serde(default)]
    pub bgp: bool,
    /// Inactivity timeout in seconds. L4 rules: the conntrack idle timeout (0 = the data
    /// path's default). Mode 4: the listener's client idle timeout, at most
    /// [`super::validate::MAX_FULLPROXY_IDLE_SECS`] (0 = `LOXI_IDLE_TIMEOUT_MS`).
    #[serde(rename = "inactiveTimeOut", default)]
    pub inactive_timeout: u32,
    /// Endpoint health monitoring enabled.
    #[serde(default)]
    pub monitor: bool,
    /// Active probe type: `""` (none), `tcp`, `udp`, `http`, `https`, `ping`, `none`.
    #[serde(default)]
    pub probetype: String,
    /// Probe port (0 = the endpoint's targetPort).
    #[serde(default)]
    pub probeport: u16,
    /// Probe request (HTTP path for http probes).
    #[serde(default)]
    pub probereq: String,
    /// Expected probe response (substring of the body for http probes).
    #[serde(default)]
    pub proberesp: String,
    /// Probe timeout in seconds (0 = default).
    #[serde(rename = "probeTimeout", default)]
    pub probe_timeout: u32,
    /// Consecutive probe failures before an endpoint is marked down (0 = default).
    #[serde(rename = "probeRetries", default)]
    pub probe_retries: u32,
    /// Enables P/D disaggregation and the full tier ladder.
    #[serde(default)]
    pub pd_disagg_mode: bool,
    /// Tier-0 pin TTL in seconds; 0 means the 300-second default.
    #[serde(default)]
    pub pd_session_ttl_sec: i32,
    /// Enables tier 1 (prefix-trie affinity); requires `pd_disagg_mode`.
    #[serde(default)]
    pub pd_cache_aware_mode: bool,
    /// Tier-1 minimum prefix match rate, 0–100. Default 20.
    #[serde(default = "default_pd_cache_threshold")]
    pub pd_cache_threshold: i32,
    /// Tier-1 load-imbalance bypass, 0–255. Default 3.
    #[serde(default = "default_pd_balance_abs_threshold")]
    pub pd_balance_abs_threshold: i32,
    /// SGLang's P/D bootstrap port on the prefill endpoints (`pdBootstrapPort`, LoxiLB's
    /// camelCase), sent as `bootstrap_port` on both legs of a `kvEngineType: sglang` P/D rule.
    /// 0 (the default when omitted) = SGLang's own default, 8998; validation stores 8998 for an
    /// SGLang P/D rule so `GET` reports the port in use. Non-zero only with `pd_disagg_mode` and
    /// `kvEngineType: sglang` (LoxiLB refuses it elsewhere too).
    #[serde(rename = "pdBootstrapPort", default)]
    pub pd_bootstrap_port: u16,
    /// Engine contract: `vllm` (default), `sglang`, `trtllm`, `llamacpp`. Immutable after creation.
    #[serde(rename = "kvEngineType", default = "default_kv_engine_type")]
    pub kv_engine_type: String,
    /// Tier-1.5 topology: 0 off, 1 P/D role-partitioned, 3 role-less single pool (2 reserved).
    #[serde(rename = "kvExactMode", default)]
    pub kv_exact_mode: u8,
    /// Engine block (page) size in tokens, ≥ 1. Default 16.
    #[serde(rename = "kvBlockSize", default = "default_kv_block_size")]
    pub kv_block_size: u32,
    /// Block-hash contract: `sha256_cbor`, `xxhash_cbor`, `sha256_sglang`, `blockhash_trtllm`;
    /// empty = derived from `kvEngineType` (vLLM → `sha256_cbor`, SGLang → `sha256_sglang`).
    #[serde(rename = "kvHashAlgo", default)]
    pub kv_hash_algo: String,
    /// Base KV-event port (DP rank r publishes on `kvZmqPort + r`). Default 5557.
    #[serde(rename = "kvZmqPort", default = "default_kv_zmq_port")]
    pub kv_zmq_port: u16,
    /// Seconds tier 1.5 stays out of decisions after an endpoint's subscriber first connects.
    /// Default 0 (LoxiLB's schema says 30 but never arms it; 0 keeps what its users get).
    #[serde(rename = "kvWarmupSec", default)]
    pub kv_warmup_sec: u32,
    /// Data-parallel ranks per endpoint, 1–8. Default 1.
    #[serde(rename = "kvDpRankCount", default = "default_kv_dp_rank_count")]
    pub kv_dp_rank_count: u8,
    /// Replay (ROUTER) port of the engine's KV-event publisher; 0 = no replay socket.
    #[serde(rename = "kvReplayPort", default)]
    pub kv_replay_port: u16,
    /// CHWBL prefix scope 1–3. Default 1.
    #[serde(default = "default_chwbl_prefix_hash_level")]
    pub chwbl_prefix_hash_level: u8,
    /// CHWBL hash-input bit flags 0–255 (1 LoRA, 8 cache salt, 32 session, ...). Default 0.
    #[serde(default)]
    pub chwbl_prefix_hash_flags: u8,
    /// CHWBL bounded-load factor in percent of the mean, 100–300. Default 175. Takes effect.
    #[serde(default = "default_chwbl_mean_load_factor")]
    pub chwbl_mean_load_factor: u32,
    /// CHWBL virtual nodes per endpoint, 1–1024. Default 256. Takes effect.
    #[serde(default = "default_chwbl_replication")]
    pub chwbl_replication: u32,
    /// Mix `cache_salt` into the CHWBL key. Default false.
    #[serde(default)]
    pub chwbl_enable_cache_salt: bool,
}

/// One backend endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// Backend IP literal. Required.
    #[serde(rename = "endpointIP")]
    pub endpoint_ip: String,
    /// Backend port; 0 = the service port.
    #[serde(rename = "targetPort", default)]
    pub target_port: u16,
    /// Weight for wrr / weighted rings, 1–65535. Default 1.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// 0 normal, 1 prefill, 2 decode (meaningful with `pd_disagg_mode`).
    #[serde(default)]
    pub ep_role: u8,
    /// vLLM NIXL side-channel port (0 = targetPort).
    #[serde(default)]
    pub nixl_port: u16,
    /// loxi extension: this endpoint's KV-event publisher port, overriding the rule's
    /// `kvZmqPort` (DP rank r on `kvZmqPort + r`); 0 = the rule's. Several engines on one host
    /// (vLLM binds its publisher on `tcp://*:P`) each need their own port. Needs `kvExactMode`
    /// 1 or 3 and a subscribed endpoint.
    #[serde(rename = "kvZmqPort", default, skip_serializing_if = "is_zero_u16")]
    pub kv_zmq_port: u16,
    /// loxi extension: this endpoint's KV-event replay port, overriding the rule's
    /// `kvReplayPort`; 0 = the rule's.
    #[serde(rename = "kvReplayPort", default, skip_serializing_if = "is_zero_u16")]
    pub kv_replay_port: u16,
    /// Output only: `active` / `inactive` health state as LoxiLB reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Output only: LoxiLB's `"packets:bytes"` counter string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counter: Option<String>,
}

/// The identity of a rule: a second rule with the same key and another shape is a 409.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RuleKey {
    /// VIP literal as normalised by validation.
    pub external_ip: String,
    /// Service port.
    pub port: u16,
    /// Lower-case protocol.
    pub protocol: String,
    /// Host key ("" when none).
    pub host: String,
    /// Model pool ("" = wildcard).
    pub model_name: String,
}

impl LbRule {
    /// The rule's identity (see [`RuleKey`]).
    pub fn key(&self) -> RuleKey {
        let s = &self.service;
        RuleKey {
            external_ip: s.external_ip.clone(),
            port: s.port,
            protocol: s.protocol.to_ascii_lowercase(),
            host: s.host.clone(),
            model_name: s.model_name.clone(),
        }
    }
}

impl std::fmt::Display for RuleKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}/{}", self.external_ip, self.port, self.protocol)?;
        if !self.host.is_empty() {
            write!(f, " host={}", self.host)?;
        }
        if !self.model_name.is_empty() {
            write!(f, " model={}", self.model_name)?;
        }
        Ok(())
    }
}

fn default_protocol() -> String {
    "tcp".into()
}
fn default_backend_protocol() -> String {
    "http1".into()
}
fn default_pd_cache_threshold() -> i32 {
    20
}
fn default_pd_balance_abs_threshold() -> i32 {
    3
}
pub(crate) fn default_kv_engine_type() -> String {
    "vllm".into()
}
pub(crate) fn default_kv_block_size() -> u32 {
    16
}
fn is_zero_u16(n: &u16) -> bool {
    *n == 0
}

impl ServiceArgs {
    /// The rule's active probe type, lower-cased (`""` = a TCP probe asked for by `monitor`
    /// alone), or `None` when no probe runs: `probetype` `none`, or unset without `monitor`.
    /// The one reading of these two fields: the prober (`health::probe::ProbeSpec`) and the
    /// validation of the fields only a probe reads both use it.
    pub fn active_probe(&self) -> Option<String> {
        let t = self.probetype.to_ascii_lowercase();
        (t != "none" && (!t.is_empty() || self.monitor)).then_some(t)
    }
}

pub(crate) fn default_kv_zmq_port() -> u16 {
    5557
}
pub(crate) fn default_kv_dp_rank_count() -> u8 {
    1
}
pub(crate) fn default_chwbl_prefix_hash_level() -> u8 {
    1
}
pub(crate) fn default_chwbl_mean_load_factor() -> u32 {
    175
}
pub(crate) fn default_chwbl_replication() -> u32 {
    256
}
fn default_weight() -> u32 {
    1
}

/// JSON field names of `serviceArguments`, for the API's did-you-mean check.
pub const SERVICE_FIELDS: &[&str] = &[
    "externalIP",
    "port",
    "protocol",
    "mode",
    "sel",
    "security",
    "host",
    "backend_protocol",
    "backend_tls_server_name",
    "backend_ca_file",
    "backend_tls_insecure",
    "sse_mode",
    "session_header_name",
    "model_name",
    "name",
    "id",
    "managed",
    "bgp",
    "inactiveTimeOut",
    "monitor",
    "probetype",
    "probeport",
    "probereq",
    "proberesp",
    "probeTimeout",
    "probeRetries",
    "pd_disagg_mode",
    "pd_session_ttl_sec",
    "pd_cache_aware_mode",
    "pd_cache_threshold",
    "pd_balance_abs_threshold",
    "pdBootstrapPort",
    "kvEngineType",
    "kvExactMode",
    "kvBlockSize",
    "kvHashAlgo",
    "kvZmqPort",
    "kvWarmupSec",
    "kvDpRankCount",
    "kvReplayPort",
    "chwbl_prefix_hash_level",
    "chwbl_prefix_hash_flags",
    "chwbl_mean_load_factor",
    "chwbl_replication",
    "chwbl_enable_cache_salt",
];

/// JSON field names of an endpoint, for the API's did-you-mean check.
pub const ENDPOINT_FIELDS: &[&str] = &[
    "endpointIP",
    "targetPort",
    "weight",
    "ep_role",
    "nixl_port",
    "kvZmqPort",
    "kvReplayPort",
    "state",
    "counter",
];

/// Top-level JSON field names of a rule.
pub const RULE_FIELDS: &[&str] = &["serviceArguments", "endpoints", "serviceId"];

/// What a `security` value asks for, in words: `plain`, `TLS terminated here`, `TLS
/// terminated here, re-encrypted to the endpoints`; `None` for a value loxi does not serve.
pub fn security_name(security: u8) -> Option<&'static str> {
    match security {
        0 => Some("plain"),
        1 => Some("TLS terminated here"),
        2 => Some("TLS terminated here, re-encrypted to the endpoints"),
        _ => None,
    }
}

/// The `security` values loxi serves, in words (for error messages).
pub const SECURITY_VALUES: &str = "loxi serves security 0 (plain), 1 (TLS terminated here) and 2 \
                                   (TLS terminated here, re-encrypted to the endpoints)";
