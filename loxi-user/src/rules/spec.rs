//! The typed service spec: what validation compiles a rule's raw `serviceArguments` into, and
//! what everything downstream reads instead of comparing raw numbers and strings.
//!
//! [`ServiceSpec::compile`] runs once per accepted rule (at the end of
//! [`super::validate::validate`], and again when the store builds a [`super::StoredRule`]), after
//! the range checks. Every default that depends on another field (the hash algorithm of an
//! engine, the endpoints a KV topology subscribes) is decided here and nowhere else; a
//! combination the data path cannot serve is a validation error, not a rule that misses forever.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use loxi_common::sel;

use super::addr;
use super::model::LbRule;

/// A rule that passed the range checks but cannot be compiled into a spec (validation turns it
/// into `RuleError::Invalid`, HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SpecError {
    /// JSON path, e.g. `serviceArguments.kvHashAlgo`.
    pub field: String,
    /// What is wrong and what is allowed.
    pub message: String,
}

/// NAT mode (`mode`): 0–3 and 5 run in the XDP data path, 4 is the fullproxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// 0: destination NAT.
    Dnat,
    /// 1: one-arm.
    OneArm,
    /// 2: full NAT.
    FullNat,
    /// 3: direct server return.
    Dsr,
    /// 4: the L7 fullproxy (every AI feature).
    FullProxy,
    /// 5: host one-arm.
    HostOneArm,
}

impl Mode {
    fn of(mode: u8) -> Option<Self> {
        Some(match mode {
            0 => Self::Dnat,
            1 => Self::OneArm,
            2 => Self::FullNat,
            3 => Self::Dsr,
            4 => Self::FullProxy,
            5 => Self::HostOneArm,
            _ => return None,
        })
    }
}

/// Endpoint selector (`sel`, numbers of `loxi_common::sel`; 7 is reserved and rejected).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sel {
    /// 0: round-robin.
    Rr,
    /// 1: client-address hash.
    Hash,
    /// 2: smooth weighted round-robin.
    Wrr,
    /// 3: persist (session key owner).
    Persist,
    /// 4: least in-flight requests.
    Lc,
    /// 5: SCTP N2 (accepted; the fullproxy runs round-robin for it).
    N2,
    /// 6: N3 (UDP only; the fullproxy runs round-robin for it).
    N3,
    /// 8: consistent hash with bounded loads.
    Chwbl,
    /// 9: GPU-aware modulo placement.
    GpuAware,
    /// 10: weighted consistent hash.
    WrrHash,
}

impl Sel {
    /// The selector of a `sel` number (`None` for 7 and above 10).
    pub fn of(s: u8) -> Option<Self> {
        Some(match s {
            sel::RR => Self::Rr,
            sel::HASH => Self::Hash,
            sel::WRR => Self::Wrr,
            sel::PERSIST => Self::Persist,
            sel::LC => Self::Lc,
            sel::N2 => Self::N2,
            sel::N3 => Self::N3,
            sel::CHWBL => Self::Chwbl,
            sel::GPU_AWARE => Self::GpuAware,
            sel::WRR_HASH => Self::WrrHash,
            _ => return None,
        })
    }

    /// The `sel` metric label (N2/N3 run round-robin in the fullproxy and are labelled so).
    pub fn name(self) -> &'static str {
        match self {
            Self::Rr | Self::N2 | Self::N3 => "rr",
            Self::Hash => "hash",
            Self::Wrr => "wrr",
            Self::Persist => "persist",
            Self::Lc => "lc",
            Self::Chwbl => "chwbl",
            Self::GpuAware => "gpuaware",
            Self::WrrHash => "wrr-hash",
        }
    }

    /// Does the selector key on the prompt (and so need the parsed body)?
    pub fn prefix_keyed(self) -> bool {
        matches!(self, Self::Chwbl | Self::GpuAware | Self::WrrHash)
    }
}

/// Engine contract (`kvEngineType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// vLLM (default).
    Vllm,
    /// SGLang.
    Sglang,
    /// TensorRT-LLM (no tier-1.5 hash contract in loxi).
    Trtllm,
    /// llama.cpp (no KV event plane).
    Llamacpp,
}

impl Engine {
    /// The engine of a `kvEngineType` name (`None` when unknown).
    pub fn of_name(s: &str) -> Option<Self> {
        Some(match s {
            "vllm" => Self::Vllm,
            "sglang" => Self::Sglang,
            "trtllm" => Self::Trtllm,
            "llamacpp" => Self::Llamacpp,
            _ => return None,
        })
    }

    /// The `kvHashAlgo` an empty field means for this engine (the rule keeps the name).
    pub fn default_hash_algo(self) -> &'static str {
        match self {
            Self::Sglang => "sha256_sglang",
            Self::Trtllm => "blockhash_trtllm",
            Self::Vllm | Self::Llamacpp => "sha256_cbor",
        }
    }
}

/// Tier-1.5 topology (`kvExactMode`; 2 is reserved and rejected).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvMode {
    /// 0: tier 1.5 off.
    Off,
    /// 1: P/D, the prefill endpoints (`ep_role: 1`) are subscribed.
    PdPrefill,
    /// 3: role-less single pool, every endpoint subscribed.
    Pool,
}

impl KvMode {
    fn of(m: u8) -> Option<Self> {
        Some(match m {
            0 => Self::Off,
            1 => Self::PdPrefill,
            3 => Self::Pool,
            _ => return None,
        })
    }
}

/// A prefix-cache hash contract (`kvHashAlgo`) loxi can compute. `blockhash_trtllm` is a name
/// of the compatibility contract that validation accepts only while tier 1.5 is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// vLLM `--prefix-caching-hash-algo sha256_cbor`: SHA-256 of canonical CBOR.
    Sha256Cbor,
    /// vLLM `--prefix-caching-hash-algo xxhash_cbor`: XXH3-128 of canonical CBOR.
    XxhashCbor,
    /// SGLang page hash: SHA-256 of parent digest and u32 LE token ids.
    Sha256Sglang,
}

impl HashAlgo {
    /// The names accepted by [`FromStr`] and printed by [`fmt::Display`].
    pub const NAMES: [&'static str; 3] = ["sha256_cbor", "xxhash_cbor", "sha256_sglang"];

    /// The rule / CLI name (`sha256_cbor`, `xxhash_cbor`, `sha256_sglang`).
    pub fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::XxhashCbor => "xxhash_cbor",
            HashAlgo::Sha256Sglang => "sha256_sglang",
        }
    }

    /// Digest length in bytes: 32 for the SHA-256 contracts, 16 for XXH3-128.
    pub fn digest_len(self) -> usize {
        match self {
            HashAlgo::XxhashCbor => 16,
            HashAlgo::Sha256Cbor | HashAlgo::Sha256Sglang => 32,
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error for an unknown `kvHashAlgo` name; names the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "kvHashAlgo: unknown hash algorithm {0:?} (expected one of sha256_cbor, xxhash_cbor, sha256_sglang)"
)]
pub struct UnknownHashAlgo(pub String);

impl FromStr for HashAlgo {
    type Err = UnknownHashAlgo;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sha256_cbor" => Ok(HashAlgo::Sha256Cbor),
            "xxhash_cbor" => Ok(HashAlgo::XxhashCbor),
            "sha256_sglang" => Ok(HashAlgo::Sha256Sglang),
            other => Err(UnknownHashAlgo(other.to_owned())),
        }
    }
}

/// Backend protocol (`backend_protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendProtocol {
    /// `http1` (default).
    Http1,
    /// `http2`: the upstream client speaks HTTP/2 (prior knowledge).
    Http2,
    /// `both`: ALPN offers `h2` and `http/1.1` to a TLS backend (`security: 2`); its choice
    /// decides.
    Both,
}

/// The tier-1.5 contract of a rule with `kvExactMode` 1 or 3.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSpec {
    /// `kvExactMode` (never [`KvMode::Off`] here).
    pub mode: KvMode,
    /// `kvHashAlgo`, or the engine's default when the field was empty.
    pub algo: HashAlgo,
    /// `kvBlockSize` in tokens.
    pub block_size: u32,
    /// `kvWarmupSec`.
    pub warmup: Duration,
    /// `kvZmqPort` (DP rank r publishes on `kvZmqPort + r`); an endpoint's own port
    /// ([`KvEndpoint::zmq_port`]) overrides it.
    pub zmq_port: u16,
    /// `kvReplayPort` (0 = none); an endpoint's own port overrides it.
    pub replay_port: u16,
    /// `kvDpRankCount`, ≥ 1.
    pub dp_ranks: u32,
    /// The rule's endpoints in rule order: mode 3 subscribes every endpoint, mode 1 the
    /// prefill ones (`ep_role: 1`).
    pub endpoints: Vec<KvEndpoint>,
}

impl KvSpec {
    /// Same contract (everything but the endpoint list and `kvWarmupSec`)? A change of
    /// contract rebuilds a service's KV state; a change of endpoints alone only moves, adds or
    /// drops endpoints (`kv::members`), and a change of `kvWarmupSec` alone is applied to the
    /// running window (`kv::state::ServiceKv`'s `apply_warmup`): neither says anything about the
    /// blocks the engines hold.
    pub fn same_contract(&self, other: &KvSpec) -> bool {
        let strip = |k: &KvSpec| KvSpec {
            endpoints: Vec::new(),
            warmup: Duration::ZERO,
            ..k.clone()
        };
        strip(self) == strip(other)
    }
}

/// One endpoint as the KV tier sees it: its identity (address) and whether its events are
/// subscribed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvEndpoint {
    /// `endpointIP`, normalised by validation.
    pub ip: String,
    /// `targetPort`.
    pub port: u16,
    /// Are its KV events subscribed (mode 3: all; mode 1: `ep_role: 1`)?
    pub subscribed: bool,
    /// Its KV-event publisher port (DP rank r on `zmq_port + r`): the endpoint's own
    /// `kvZmqPort` when set, else the rule's. Part of its identity: another publisher address
    /// is another source of blocks.
    pub zmq_port: u16,
    /// Its replay port: the endpoint's own `kvReplayPort` when set, else the rule's (0 = none).
    pub replay_port: u16,
}

/// Role of an endpoint in a P/D rule (`ep_role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// 0: a normal (aggregated) endpoint; in a P/D rule, the fallback when a pool is empty.
    Normal,
    /// 1: prefill.
    Prefill,
    /// 2: decode.
    Decode,
}

impl Role {
    fn of(r: u8) -> Self {
        match r {
            1 => Self::Prefill,
            2 => Self::Decode,
            _ => Self::Normal,
        }
    }
}

/// Tier-0 pin lifetime when `pd_session_ttl_sec` is 0 (the spec: "the data path converts 0 to
/// its 300-second runtime default").
pub const DEFAULT_PD_SESSION_TTL: Duration = Duration::from_secs(300);

/// SGLang's default P/D bootstrap port (`--disaggregation-bootstrap-port`), what
/// `pdBootstrapPort: 0` means.
pub const DEFAULT_SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// How the two legs of a P/D request are spoken (from `kvEngineType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// vLLM: prefill first, its `kv_transfer_params` into the decode leg.
    Vllm,
    /// SGLang: both legs at once, with `bootstrap_host` / `bootstrap_port` / `bootstrap_room`.
    Sglang {
        /// `bootstrap_port` of both legs (`pdBootstrapPort`, 0 → 8998).
        bootstrap_port: u16,
    },
    /// TensorRT-LLM: a `context_only` leg, then a `generation_only` leg with the returned
    /// `disaggregated_params`.
    Trtllm,
}

/// The P/D ladder's contract of a rule with `pd_disagg_mode: true`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdSpec {
    /// The handoff dialect (`kvEngineType`; validation refuses llama.cpp).
    pub dialect: Dialect,
    /// `ep_role` per endpoint, in rule order.
    pub roles: Vec<Role>,
    /// Tier-0 pin lifetime (`pd_session_ttl_sec`, 0 → [`DEFAULT_PD_SESSION_TTL`]).
    pub session_ttl: Duration,
    /// NIXL side-channel port per endpoint (`nixl_port`, 0 → `targetPort`), for the request id.
    pub nixl_ports: Vec<u16>,
    /// Tier 1 (the prefix trie), when `pd_cache_aware_mode` is true.
    pub trie: Option<TrieSpec>,
}

/// P/D tier 1's knobs (`configuration-and-tuning.txt`: a submitted 0 means the default for
/// both, so 0 cannot disable either check).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrieSpec {
    /// `pd_cache_threshold`: the least match rate, in percent of the request's key, for tier 1
    /// to pick the endpoint holding the longest match (1–100; 0 → 20).
    pub threshold_pct: u32,
    /// `pd_balance_abs_threshold`: tier 1 is bypassed when the most and least loaded eligible
    /// prefill endpoints differ by more than this many requests (in flight + queued; 1–255;
    /// 0 → 3).
    pub balance_abs: u64,
}

/// `pd_cache_threshold` when 0 is submitted.
pub const DEFAULT_PD_CACHE_THRESHOLD: u32 = 20;
/// `pd_balance_abs_threshold` when 0 is submitted.
pub const DEFAULT_PD_BALANCE_ABS_THRESHOLD: u64 = 3;

impl PdSpec {
    /// The role of endpoint `ep` (`Normal` past the end).
    pub fn role(&self, ep: usize) -> Role {
        self.roles.get(ep).copied().unwrap_or(Role::Normal)
    }
}

/// A validated rule's service, typed. Built by [`ServiceSpec::compile`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceSpec {
    /// `mode`.
    pub mode: Mode,
    /// `sel`.
    pub sel: Sel,
    /// `kvEngineType`.
    pub engine: Engine,
    /// `backend_protocol`.
    pub backend: BackendProtocol,
    /// Tier 1.5, when `kvExactMode` is not 0.
    pub kv: Option<KvSpec>,
    /// The P/D ladder, when `pd_disagg_mode` is true.
    pub pd: Option<PdSpec>,
}

impl ServiceSpec {
    /// Compiles the typed spec of an already range-checked rule; an unknown value or a
    /// combination loxi cannot serve is a [`SpecError`] naming the field.
    pub fn compile(rule: &LbRule) -> Result<Self, SpecError> {
        let s = &rule.service;
        let bad = |field: &str, msg: String| SpecError {
            field: format!("serviceArguments.{field}"),
            message: msg,
        };
        let engine = Engine::of_name(&s.kv_engine_type)
            .ok_or_else(|| bad("kvEngineType", format!("{:?} is unknown", s.kv_engine_type)))?;
        Ok(Self {
            mode: Mode::of(s.mode).ok_or_else(|| bad("mode", format!("{} is unknown", s.mode)))?,
            sel: Sel::of(s.sel).ok_or_else(|| bad("sel", format!("{} is unknown", s.sel)))?,
            engine,
            backend: match s.backend_protocol.as_str() {
                "http2" => BackendProtocol::Http2,
                "both" => BackendProtocol::Both,
                _ => BackendProtocol::Http1,
            },
            kv: kv_spec(rule, engine, bad)?,
            pd: s.pd_disagg_mode.then(|| pd_spec(rule)),
        })
    }

    /// `kvExactMode`.
    pub fn kv_mode(&self) -> KvMode {
        self.kv.as_ref().map_or(KvMode::Off, |k| k.mode)
    }

    /// Does routing read the parsed body (tier 1.5, P/D or a prefix-keyed selector)?
    pub fn needs_body(&self) -> bool {
        self.kv.is_some() || self.pd.is_some() || self.sel.prefix_keyed()
    }
}

fn pd_spec(rule: &LbRule) -> PdSpec {
    let s = &rule.service;
    let ttl = u64::try_from(s.pd_session_ttl_sec).unwrap_or(0);
    PdSpec {
        dialect: match s.kv_engine_type.as_str() {
            "sglang" => Dialect::Sglang {
                bootstrap_port: match s.pd_bootstrap_port {
                    0 => DEFAULT_SGLANG_BOOTSTRAP_PORT,
                    p => p,
                },
            },
            "trtllm" => Dialect::Trtllm,
            _ => Dialect::Vllm,
        },
        roles: rule.endpoints.iter().map(|e| Role::of(e.ep_role)).collect(),
        session_ttl: if ttl == 0 {
            DEFAULT_PD_SESSION_TTL
        } else {
            Duration::from_secs(ttl)
        },
        nixl_ports: rule
            .endpoints
            .iter()
            .map(|e| match (e.nixl_port, e.target_port) {
                (0, 0) => s.port,
                (0, t) => t,
                (n, _) => n,
            })
            .collect(),
        trie: s.pd_cache_aware_mode.then(|| TrieSpec {
            threshold_pct: match u32::try_from(s.pd_cache_threshold) {
                Ok(0) | Err(_) => DEFAULT_PD_CACHE_THRESHOLD,
                Ok(t) => t,
            },
            balance_abs: match u64::try_from(s.pd_balance_abs_threshold) {
                Ok(0) | Err(_) => DEFAULT_PD_BALANCE_ABS_THRESHOLD,
                Ok(b) => b,
            },
        }),
    }
}

fn kv_spec(
    rule: &LbRule,
    engine: Engine,
    bad: impl Fn(&str, String) -> SpecError,
) -> Result<Option<KvSpec>, SpecError> {
    let s = &rule.service;
    let mode = KvMode::of(s.kv_exact_mode)
        .ok_or_else(|| bad("kvExactMode", format!("{} is unknown", s.kv_exact_mode)))?;
    if mode == KvMode::Off {
        return Ok(None);
    }
    let name = match s.kv_hash_algo.as_str() {
        "" => engine.default_hash_algo(),
        n => n,
    };
    let algo = name.parse::<HashAlgo>().map_err(|_| {
        bad(
            "kvHashAlgo",
            format!(
                "{name:?} cannot be computed by loxi's tier 1.5 (kvExactMode {}); use one of {:?}, or kvExactMode 0",
                s.kv_exact_mode,
                HashAlgo::NAMES
            ),
        )
    })?;
    let endpoints = rule
        .endpoints
        .iter()
        .map(|e| KvEndpoint {
            ip: e.endpoint_ip.clone(),
            port: e.target_port,
            subscribed: mode == KvMode::Pool || e.ep_role == 1,
            zmq_port: match e.kv_zmq_port {
                0 => s.kv_zmq_port,
                p => p,
            },
            replay_port: match e.kv_replay_port {
                0 => s.kv_replay_port,
                p => p,
            },
        })
        .collect::<Vec<KvEndpoint>>();
    host_sockets(rule, &endpoints, u32::from(s.kv_dp_rank_count.max(1)))?;
    Ok(Some(KvSpec {
        mode,
        algo,
        block_size: s.kv_block_size,
        warmup: Duration::from_secs(u64::from(s.kv_warmup_sec)),
        zmq_port: s.kv_zmq_port,
        replay_port: s.kv_replay_port,
        dp_ranks: u32::from(s.kv_dp_rank_count.max(1)),
        endpoints,
    }))
}

/// One of an engine's KV sockets: the publisher (`kvZmqPort`, DP rank r on `port + r`) or the
/// replay socket (`kvReplayPort`, likewise per rank).
#[derive(Clone, Copy, PartialEq)]
enum KvSocket {
    Publisher,
    Replay,
}

impl KvSocket {
    /// The rule field that sets it.
    fn field(self) -> &'static str {
        match self {
            Self::Publisher => "kvZmqPort",
            Self::Replay => "kvReplayPort",
        }
    }

    /// What it is, for messages.
    fn what(self) -> &'static str {
        match self {
            Self::Publisher => "KV-event publisher",
            Self::Replay => "KV-event replay socket",
        }
    }

    /// Where an engine configures it (vLLM's `--kv-events-config`).
    fn engine_knob(self) -> &'static str {
        match self {
            Self::Publisher => "vLLM's --kv-events-config endpoint, default tcp://*:5557",
            Self::Replay => "vLLM's --kv-events-config replay_endpoint",
        }
    }

    /// The base port of endpoint `e`'s socket (0: it has none).
    fn port(self, e: &KvEndpoint) -> u16 {
        match self {
            Self::Publisher => e.zmq_port,
            Self::Replay => e.replay_port,
        }
    }

    /// The field that gave endpoint `i` its port: the endpoint's own when it set one, else the
    /// rule's, so the error names the value to change.
    fn source(self, rule: &LbRule, i: usize) -> String {
        let own = rule.endpoints.get(i).map_or(0, |e| match self {
            Self::Publisher => e.kv_zmq_port,
            Self::Replay => e.kv_replay_port,
        });
        if own != 0 {
            format!("endpoints[{i}].{}", self.field())
        } else {
            format!("serviceArguments.{}", self.field())
        }
    }
}

/// The ports `base .. base + ranks` (empty when `base` is 0: no such socket).
fn span(base: u16, ranks: u32) -> std::ops::Range<u32> {
    match base {
        0 => 0..0,
        b => u32::from(b)..u32::from(b) + ranks,
    }
}

/// Whether two port spans share a port.
fn overlap(a: &std::ops::Range<u32>, b: &std::ops::Range<u32>) -> bool {
    a.start < b.end && b.start < a.end
}

/// The sockets a rule's subscribed endpoints name on one host must be distinct listeners. An
/// IPv4-mapped IPv6 endpoint (`::ffff:10.0.0.2`) is its IPv4 host ([`addr::same_host`]).
/// Refused, naming the field that set the port (the endpoint's own, else the rule's):
/// - two subscribed endpoints whose publishers overlap (`kvZmqPort .. + kvDpRankCount`): each
///   would be credited with the other's blocks;
/// - a publisher or replay port that is an engine's HTTP port (`targetPort`, its own or
///   another endpoint's): one address serves one listener, so the stream would never connect
///   (readiness `no_events`) or replay would never answer;
/// - a replay port on a publisher's port, or two engines' replay ports overlapping.
fn host_sockets(rule: &LbRule, endpoints: &[KvEndpoint], ranks: u32) -> Result<(), SpecError> {
    use KvSocket::{Publisher, Replay};
    let subscribed = || endpoints.iter().enumerate().filter(|(_, e)| e.subscribed);
    for (i, a) in subscribed() {
        for (j, b) in subscribed().take_while(|(j, _)| *j < i) {
            if !addr::same_host(&a.ip, &b.ip) {
                continue;
            }
            let (pa, pb) = (span(a.zmq_port, ranks), span(b.zmq_port, ranks));
            if overlap(&pa, &pb) {
                return Err(SpecError {
                    field: format!("endpoints[{i}].kvZmqPort"),
                    message: format!(
                        "endpoints {j} and {i} ({} and {}) would both read the KV events of the \
                         publisher at {}, each credited with the other's blocks; give each engine \
                         on one host its own publisher port (endpoints[i].kvZmqPort)",
                        addr::host_port(&b.ip, b.port),
                        addr::host_port(&a.ip, a.port),
                        addr::host_port(&a.ip, pa.start.max(pb.start))
                    ),
                });
            }
        }
        for sock in [Publisher, Replay] {
            let own = span(sock.port(a), ranks);
            if own.is_empty() {
                continue;
            }
            let clash = |what: String, port: u32| SpecError {
                field: sock.source(rule, i),
                message: format!(
                    "endpoint {i}'s {} would be {} ({} {}{}), which is {what}: an engine's {} \
                     listens on a port of its own ({}); set {} to that port",
                    sock.what(),
                    addr::host_port(&a.ip, port),
                    sock.field(),
                    sock.port(a),
                    if ranks > 1 { " + DP rank" } else { "" },
                    sock.what(),
                    sock.engine_knob(),
                    sock.field()
                ),
            };
            let whose = |j: usize| {
                if i == j {
                    "its own".to_owned()
                } else {
                    format!("endpoint {j}'s")
                }
            };
            if let Some((j, b)) = endpoints
                .iter()
                .enumerate()
                .find(|(_, b)| addr::same_host(&a.ip, &b.ip) && own.contains(&u32::from(b.port)))
            {
                return Err(clash(
                    format!("{} HTTP port (targetPort {})", whose(j), b.port),
                    u32::from(b.port),
                ));
            }
            if sock == Replay {
                for (j, b) in subscribed().filter(|(_, b)| addr::same_host(&a.ip, &b.ip)) {
                    let pub_b = span(b.zmq_port, ranks);
                    if overlap(&own, &pub_b) {
                        let at = own.start.max(pub_b.start);
                        return Err(clash(
                            format!("{} KV-event publisher (kvZmqPort {})", whose(j), b.zmq_port),
                            at,
                        ));
                    }
                    let rep_b = span(b.replay_port, ranks);
                    if j < i && overlap(&own, &rep_b) {
                        let at = own.start.max(rep_b.start);
                        return Err(clash(
                            format!(
                                "{} replay socket (kvReplayPort {})",
                                whose(j),
                                b.replay_port
                            ),
                            at,
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleError;
    use crate::rules::validate::validate;
    use serde_json::json;

    /// A kvExactMode-3 rule over `eps` with `ranks` DP ranks, validated.
    fn kv_rule(eps: serde_json::Value, ranks: u8) -> Result<LbRule, RuleError> {
        kv_rule_with(json!({ "kvDpRankCount": ranks }), eps)
    }

    /// A kvExactMode-3 rule over `eps` with `extra` service arguments, validated.
    fn kv_rule_with(extra: serde_json::Value, eps: serde_json::Value) -> Result<LbRule, RuleError> {
        let mut svc = json!({"externalIP": "10.0.0.1", "port": 80, "mode": 4, "kvExactMode": 3});
        if let (Some(o), Some(x)) = (svc.as_object_mut(), extra.as_object()) {
            o.extend(x.clone());
        }
        validate(
            serde_json::from_value(json!({"serviceArguments": svc, "endpoints": eps}))
                .expect("rule"),
        )
    }

    /// The field and message of a refused rule.
    fn refusal(r: Result<LbRule, RuleError>) -> (String, String) {
        match r {
            Err(RuleError::Invalid { field, message }) => (field, message),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// Two engines on one host reading one publisher would each be credited with the other's
    /// blocks: refused naming the endpoint; their own ports (DP spans apart) or hosts pass.
    #[test]
    fn subscribed_endpoints_may_not_share_a_publisher() {
        let rule = kv_rule;
        let shared = rule(
            json!([{"endpointIP": "10.0.0.2", "targetPort": 8001},
                   {"endpointIP": "10.0.0.2", "targetPort": 8002}]),
            1,
        );
        match shared {
            Err(RuleError::Invalid { field, message }) => {
                assert_eq!(field, "endpoints[1].kvZmqPort");
                assert!(message.contains("10.0.0.2:5557"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        // Rank spans 6000..6002 and 6001..6003 overlap; 6000..6002 and 6002..6004 do not.
        let ports = |a: u16, b: u16| {
            json!([{"endpointIP": "10.0.0.2", "targetPort": 8001, "kvZmqPort": a},
                   {"endpointIP": "10.0.0.2", "targetPort": 8002, "kvZmqPort": b}])
        };
        assert!(rule(ports(6000, 6001), 2).is_err());
        assert!(rule(ports(6000, 6002), 2).is_ok());
        assert!(
            rule(
                json!([{"endpointIP": "10.0.0.2", "targetPort": 8001},
                       {"endpointIP": "10.0.0.3", "targetPort": 8001}]),
                1
            )
            .is_ok()
        );
    }

    /// A publisher port that is an engine's HTTP port on the same IP (its own, another
    /// endpoint's, or reached by a DP rank) is refused naming the endpoint; another IP passes.
    #[test]
    fn a_publisher_port_may_not_be_an_http_port_of_its_host() {
        let rule = kv_rule;
        match rule(
            json!([{"endpointIP": "10.0.0.2", "targetPort": 8001, "kvZmqPort": 8001}]),
            1,
        ) {
            Err(RuleError::Invalid { field, message }) => {
                assert_eq!(field, "endpoints[0].kvZmqPort");
                assert!(
                    message.contains("10.0.0.2:8001 (kvZmqPort 8001), which is its own HTTP port"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        let two = |zmq: u16, ranks: u8| {
            rule(
                json!([{"endpointIP": "10.0.0.2", "targetPort": 8001, "kvZmqPort": zmq},
                       {"endpointIP": "10.0.0.2", "targetPort": 8002, "kvZmqPort": 9000}]),
                ranks,
            )
        };
        match two(8000, 3) {
            Err(RuleError::Invalid { field, message }) => {
                assert_eq!(field, "endpoints[0].kvZmqPort");
                assert!(
                    message.contains("(kvZmqPort 8000 + DP rank), which is its own HTTP port"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        match two(8002, 1) {
            Err(RuleError::Invalid { message, .. }) => {
                assert!(
                    message.contains("endpoint 1's HTTP port (targetPort 8002)"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(two(7000, 1).is_ok());
        assert!(
            rule(
                json!([{"endpointIP": "10.0.0.2", "targetPort": 8001, "kvZmqPort": 5557},
                       {"endpointIP": "10.0.0.3", "targetPort": 5557, "kvZmqPort": 5558}]),
                1
            )
            .is_ok(),
            "another host's HTTP port"
        );
    }

    /// The rule's kvZmqPort on an HTTP port names the rule's field; an IPv4-mapped IPv6
    /// endpoint is its IPv4 host; IPv6 sockets are bracketed.
    #[test]
    fn publisher_clashes_name_the_field_that_set_the_port_and_compare_hosts() {
        let (field, message) = refusal(kv_rule_with(
            json!({"kvZmqPort": 8001}),
            json!([{"endpointIP": "10.0.0.2", "targetPort": 8001}]),
        ));
        assert_eq!(field, "serviceArguments.kvZmqPort");
        assert!(
            message.contains("10.0.0.2:8001 (kvZmqPort 8001), which is its own HTTP port"),
            "{message}"
        );
        let (field, message) = refusal(kv_rule(
            json!([{"endpointIP": "10.0.0.2", "targetPort": 8001, "kvZmqPort": 5557},
                   {"endpointIP": "::ffff:10.0.0.2", "targetPort": 8002, "kvZmqPort": 8001}]),
            1,
        ));
        assert_eq!(field, "endpoints[1].kvZmqPort");
        assert!(
            message.contains("endpoint 0's HTTP port (targetPort 8001)"),
            "{message}"
        );
        let (_, message) = refusal(kv_rule(
            json!([{"endpointIP": "fd00::2", "targetPort": 8001, "kvZmqPort": 5557},
                   {"endpointIP": "fd00::2", "targetPort": 8002, "kvZmqPort": 5557}]),
            1,
        ));
        assert!(
            message.contains("([fd00::2]:8001 and [fd00::2]:8002) would both read the KV events of the publisher at [fd00::2]:5557"),
            "{message}"
        );
    }

    /// A replay port may be neither an HTTP port, nor a publisher's port, nor another engine's
    /// replay port on the same host; apart, or on other hosts, they pass.
    #[test]
    fn a_replay_port_is_a_listener_of_its_own() {
        let (field, message) = refusal(kv_rule(
            json!([{"endpointIP": "10.0.0.2", "targetPort": 8001, "kvZmqPort": 5557, "kvReplayPort": 8001}]),
            1,
        ));
        assert_eq!(field, "endpoints[0].kvReplayPort");
        assert!(
            message.contains("KV-event replay socket would be 10.0.0.2:8001 (kvReplayPort 8001), which is its own HTTP port"),
            "{message}"
        );
        let (field, message) = refusal(kv_rule_with(
            json!({"kvReplayPort": 5557}),
            json!([{"endpointIP": "10.0.0.2", "targetPort": 8001}]),
        ));
        assert_eq!(field, "serviceArguments.kvReplayPort");
        assert!(
            message.contains("which is its own KV-event publisher (kvZmqPort 5557)"),
            "{message}"
        );
        let (field, message) = refusal(kv_rule(
            json!([{"endpointIP": "10.0.0.2", "targetPort": 8001, "kvZmqPort": 5557, "kvReplayPort": 5600},
                   {"endpointIP": "10.0.0.2", "targetPort": 8002, "kvZmqPort": 5560, "kvReplayPort": 5601}]),
            2,
        ));
        assert_eq!(field, "endpoints[1].kvReplayPort");
        assert!(
            message.contains("10.0.0.2:5601 (kvReplayPort 5601 + DP rank), which is endpoint 0's replay socket (kvReplayPort 5600)"),
            "{message}"
        );
        let (_, message) = refusal(kv_rule(
            json!([{"endpointIP": "10.0.0.2", "targetPort": 8001, "kvZmqPort": 5557, "kvReplayPort": 5700},
                   {"endpointIP": "10.0.0.2", "targetPort": 8002, "kvZmqPort": 5700}]),
            1,
        ));
        assert!(
            message.contains("endpoint 1's KV-event publisher (kvZmqPort 5700)"),
            "{message}"
        );
        assert!(kv_rule(
            json!([{"endpointIP": "10.0.0.2", "targetPort": 8001, "kvZmqPort": 5557, "kvReplayPort": 5600},
                   {"endpointIP": "10.0.0.2", "targetPort": 8002, "kvZmqPort": 5560, "kvReplayPort": 5602},
                   {"endpointIP": "10.0.0.3", "targetPort": 5600, "kvZmqPort": 5557, "kvReplayPort": 5601}]),
            2,
        )
        .is_ok());
    }

    fn rule(svc: serde_json::Value) -> LbRule {
        let mut s = json!({"externalIP": "10.0.0.1", "port": 8080, "mode": 4});
        if let (Some(o), Some(extra)) = (s.as_object_mut(), svc.as_object()) {
            o.extend(extra.clone());
        }
        serde_json::from_value(json!({
            "serviceArguments": s,
            "endpoints": [{"endpointIP": "10.0.0.2", "targetPort": 8000}],
        }))
        .expect("rule")
    }

    fn spec(svc: serde_json::Value) -> ServiceSpec {
        let r = validate(rule(svc)).expect("valid");
        ServiceSpec::compile(&r).expect("spec")
    }

    #[test]
    fn defaults_are_decided_once_from_the_engine() {
        let s = spec(json!({"kvExactMode": 3}));
        assert_eq!(
            (s.mode, s.sel, s.engine),
            (Mode::FullProxy, Sel::Rr, Engine::Vllm)
        );
        let kv = s.kv.expect("kv");
        assert_eq!(
            (kv.mode, kv.algo, kv.block_size),
            (KvMode::Pool, HashAlgo::Sha256Cbor, 16)
        );
        assert_eq!(
            kv.endpoints,
            vec![KvEndpoint {
                ip: "10.0.0.2".into(),
                port: 8000,
                subscribed: true,
                zmq_port: 5557,
                replay_port: 0,
            }]
        );
        let s = spec(json!({"kvExactMode": 3, "kvEngineType": "sglang"}));
        assert_eq!(s.kv.map(|k| k.algo), Some(HashAlgo::Sha256Sglang));
        let s = spec(json!({"sel": 8, "backend_protocol": "http2"}));
        assert_eq!(
            (s.sel, s.backend, s.kv_mode()),
            (Sel::Chwbl, BackendProtocol::Http2, KvMode::Off)
        );
        assert!(s.needs_body() && s.sel.prefix_keyed());
        assert!(!spec(json!({"sel": 4})).needs_body());
    }

    #[test]
    fn a_hash_loxi_cannot_compute_does_not_compile_with_tier_1_5() {
        // Validation refuses TensorRT-LLM's contract before compiling (rules/unsupported.rs);
        // the spec refuses it on its own too, so no typed spec carries an unusable algorithm.
        for (svc, ok) in [
            (
                json!({"kvExactMode": 3, "kvHashAlgo": "blockhash_trtllm"}),
                false,
            ),
            (json!({"kvExactMode": 3, "kvEngineType": "trtllm"}), false),
            (
                json!({"kvExactMode": 0, "kvHashAlgo": "blockhash_trtllm"}),
                true,
            ),
        ] {
            let got = ServiceSpec::compile(&rule(svc.clone()));
            match (got, ok) {
                (Ok(s), true) => assert_eq!(s.kv, None),
                (Err(e), false) => {
                    assert_eq!(e.field, "serviceArguments.kvHashAlgo");
                    assert!(
                        e.message
                            .contains("\"blockhash_trtllm\" cannot be computed"),
                        "{e}"
                    );
                }
                (got, _) => panic!("{svc}: unexpected {got:?}"),
            }
        }
        let e = validate(rule(
            json!({"kvExactMode": 3, "kvHashAlgo": "blockhash_trtllm"}),
        ))
        .expect_err("refused at validation");
        assert!(matches!(e, RuleError::Invalid { .. }), "{e:?}");
    }
}
