//! The process environment, read once at start into one typed [`Env`].
//!
//! Variables, defaults and accepted ranges are LoxiLB's (`../shared/spec/
//! configuration-and-tuning.txt`, "LoxiLB process environment variables", and
//! `kv-cache-aware-routing.txt` for `LLB_KV_MIN_MATCH_TOKENS`), plus loxi's own `LOXI_*`.
//! A set variable whose value is not accepted yields one [`EnvWarning`] naming the variable,
//! the value and the default used instead; it never stops the daemon. Tests build an `Env`
//! with [`Env::from_lookup`] so they need not touch the process environment.

use std::fmt;
use std::time::Duration;

/// Tier-1.5 selection law (`LOXILB_KV_LB_MODE`): the KV tier's own type.
pub use crate::kv::route::blend::LbMode as KvLbMode;
use crate::kv::settings::{KvSettings, PromptBounds};
pub use crate::routing::admission::{AdmissionScope, AdmissionSettings};

/// A set variable whose value was not accepted; the default was used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvWarning {
    /// Variable name, e.g. `LOXILB_KV_MAX_BLOCKS`.
    pub var: &'static str,
    /// The value as set.
    pub value: String,
    /// What was used instead (rendered default or clamped value).
    pub used: String,
    /// What is accepted.
    pub accepted: String,
}

impl fmt::Display for EnvWarning {
    /// `VAR="value" is not accepted (what is); using X`, or for a valid value another setting
    /// keeps from being read (`used` is then "no effect (why)"):
    /// `VAR="value" is set but has no effect (why): what would make it read`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.used.starts_with("no effect") {
            return write!(
                f,
                "{}={:?} is set but has {}: {}",
                self.var, self.value, self.used, self.accepted
            );
        }
        write!(
            f,
            "{}={:?} is not accepted ({}); using {}",
            self.var, self.value, self.accepted, self.used
        )
    }
}

/// Every environment knob, typed. Field docs give the variable, unit, default and range.
#[derive(Debug, Clone, PartialEq)]
pub struct Env {
    /// The KV tier's knobs (`LOXILB_KV_*`, `LLB_KV_*` and loxi's `LOXI_KV_*`), parsed straight
    /// into the tier's own type: each [`KvSettings`] field names its variable, default and
    /// range. The legacy and inert KV variables stay below.
    pub kv: KvSettings,
    /// `LOXILB_KV_UNIFIED_MODE`: legacy toggle (default on; `0/false/off/no` disables),
    /// consulted only when `LOXILB_KV_LB_MODE` is unset.
    pub kv_unified_mode: bool,
    /// `LOXILB_KV_TLOAD_LOG`: promote per-selection total-load diagnostics to info. Default off.
    pub kv_tload_log: bool,
    /// `LOXILB_AI_CTRL_ADDR`: external controller `host:port`; `None` (default) = no controller.
    pub ai_ctrl_addr: Option<String>,
    /// `LOXILB_AI_CTRL_DECAY_WINDOW_SEC`: seconds over which controller influence decays after
    /// staleness. Default 30, > 0.
    pub ai_ctrl_decay_window_sec: u32,
    /// `LLB_KV_LOADGUARD`: hard load-imbalance pre-guard before tier 1.5 (any non-0 value).
    /// Default off.
    pub kv_loadguard: bool,
    /// `LLB_PD_PREFILL_TIMEOUT_SEC`: P/D prefill-leg timeout in seconds (504
    /// `pd_prefill_timeout` past it). Default 30, range 1–100000.
    pub pd_prefill_timeout_sec: u32,
    /// `LLB_PD_DECODE_TIMEOUT_SEC` (loxi's; the spec names no decode timeout): longest a P/D
    /// decode leg may take to send its first response byte once it can start (vLLM and
    /// TensorRT-LLM: from when it is sent, after the prefill; SGLang: from the prefill's
    /// answer), else 504 `pd_decode_timeout`. Default 60, range 1–100000.
    pub pd_decode_timeout_sec: u32,
    /// `LLB_PD_MAX_INFLIGHT_PER_EP`: the per-endpoint admission gate's cap (LoxiLB: "per-EP
    /// in-flight prefill cap"); 0 = off (default), else 1–99999. With it set, a request whose
    /// chosen endpoint already has this many admitted parks in that endpoint's FIFO (see
    /// `routing::admission` and `proxy/admission.rs`): for a P/D rule the prefill leg holds the
    /// prefill endpoint's slot (decode legs are not gated) and a one-leg request holds its
    /// endpoint's slot until its response ends. Which rules: [`Env::admission_scope`].
    pub pd_max_inflight_per_ep: u32,
    /// `LLB_PD_QUEUE_DEPTH_PER_EP`: requests parked at once per endpoint; 0 (default) = none
    /// park, a request finding its endpoint full gets 429 `pd_overloaded` at once; values
    /// above 64 are clamped to 64. Beyond it: 429 `pd_overloaded` with `Retry-After: 1`.
    /// Without `LLB_PD_MAX_INFLIGHT_PER_EP` it has no effect (warned at start).
    pub pd_queue_depth_per_ep: u32,
    /// `LLB_PD_MAX_PARK_SEC`: longest a request stays parked, in seconds; past it 504
    /// `pd_admission_timeout`. 0 (default) = the prefill timeout
    /// ([`Env::effective_max_park_sec`]), else 1–99999. Without `LLB_PD_MAX_INFLIGHT_PER_EP` it
    /// has no effect (warned at start).
    pub pd_max_park_sec: u32,
    /// `LOXI_ADMISSION_SCOPE` (loxi's own): which mode-4 rules the admission gate applies to:
    /// `pd` (default; P/D rules only, as LoxiLB's prefill cap) or `all` (single-pool rules too:
    /// a request holds its endpoint's slot until its response body ends). LoxiLB has no
    /// per-rule switch for it, so it is a daemon-wide choice. Without
    /// `LLB_PD_MAX_INFLIGHT_PER_EP` it has no effect (warned at start).
    pub admission_scope: AdmissionScope,
    /// `LLB_PD_MAX_TOTAL_INFLIGHT`: global admission valve across every mode-4 rule: a request
    /// beyond this many in flight gets 429 `pd_overloaded` with `Retry-After: 1`
    /// (the proxy's valve, `proxy/valve.rs`); 0 = off (default).
    pub pd_max_total_inflight: u32,
    /// `LLB_PD_ORIGIN_ERR_THRESHOLD`: consecutive origin 5xx that open an endpoint's breaker.
    /// Default 3; 0 disables.
    pub pd_origin_err_threshold: u32,
    /// `LOXI_MAX_BODY_BYTES`: largest request body the fullproxy reads for metadata; larger
    /// JSON bodies get 413. Default 32 MiB, range 1 KiB–1 GiB.
    pub max_body_bytes: usize,
    /// `LOXI_BODY_TIMEOUT_MS`: longest a fullproxy request body may take to arrive after its
    /// head (a body trickled slowly gets 408). Default 60000, range 100–3600000.
    pub body_timeout_ms: u64,
    /// `LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS`: longest a fullproxy request waits for its
    /// backend's response head after dispatch (connect included) before 504
    /// `upstream_timeout`; 0 = no limit. Default 1800000 (30 min, the request timeout of
    /// sglang-router and vllm-router), range 0–86400000.
    pub upstream_response_timeout_ms: u64,
    /// `LOXI_MAX_BODY_BYTES_IN_FLIGHT`: request-body bytes all fullproxy listeners hold at
    /// once, reserved as they arrive (`proxy::budget`: a body's first bytes wait within
    /// `LOXI_BODY_TIMEOUT_MS`, later ones get 503 when it is spent). Default 256 MiB, range
    /// 1 MiB–64 GiB.
    pub max_body_bytes_in_flight: u64,
    /// `LOXI_MODELS_CACHE_MS`: how long a listener keeps its aggregated `GET /v1/models`
    /// answer (the union of its pools' endpoints' lists). Default 2000, range 0–600000 (0: ask
    /// the endpoints on every request).
    pub models_cache_ms: u64,
    /// `LOXI_MODELS_TIMEOUT_MS`: how long one endpoint may take to answer the aggregated
    /// `GET /v1/models` (connect, head and body); a slower one is left out. Default 2000,
    /// range 10–60000.
    pub models_timeout_ms: u64,
    /// `LOXI_ENGINE_METRICS_INTERVAL_MS`: how often the daemon scrapes each KV-rule endpoint's
    /// `GET /metrics` (vLLM's `vllm:num_requests_running` / `_waiting`, `kv_cache_usage_perc`,
    /// `cache_config_info`) and blends the engine's running+waiting count into the load the KV
    /// laws see. Default 0 (off), range 0–60000; 1–49 are raised to 50.
    pub engine_metrics_interval_ms: u64,
    /// `LOXI_HEADER_TIMEOUT_MS`: longest a fullproxy client may take to send a request head,
    /// from its first byte (slowloris bound). Default 10000, range 100–600000.
    pub header_timeout_ms: u64,
    /// `LOXI_IDLE_TIMEOUT_MS`: a fullproxy connection with no open request and no traffic for
    /// this long is closed (keep-alive idle bound). Default 60000, range 100–3600000.
    pub idle_timeout_ms: u64,
    /// `LOXI_SEND_TIMEOUT_MS`: a fullproxy connection whose write to the client has made no
    /// progress for this long (the client stopped reading; nginx's `send_timeout`) is closed,
    /// open request or not; so is an HTTP/2 connection where a response stream has waited
    /// this long for the client's flow-control window with no stream taking a piece of its
    /// response meanwhile (see `proxy/conn.rs`); an HTTP/2 stream that waited this long
    /// while others progressed drains its connection (GOAWAY). Default 60000, range
    /// 100–3600000.
    pub send_timeout_ms: u64,
    /// `LOXI_MAX_CONNS_PER_LISTENER`: open client connections per fullproxy listener; beyond
    /// it new connections wait for a slot. Default 4096, range 1–1000000.
    pub max_conns_per_listener: usize,
    /// The variables that were set but not accepted (each also logged once by
    /// [`Env::from_process`]).
    pub warnings: Vec<EnvWarning>,
    /// The [`INERT_VARS`] that are set: parsed, but their feature is not implemented, so they
    /// change nothing (the daemon logs a warning naming them at start).
    pub inert: Vec<&'static str>,
}

/// LoxiLB variables loxi reads (their values are range-checked and reported above) but whose
/// feature does not exist in loxi yet: the external AI controller (`LOXILB_AI_CTRL_*`), the per-selection
/// total-load diagnostics and the load-imbalance pre-guard. Setting one is not an error, but
/// it must not look as if it did something: [`Env::inert`] lists the ones set.
pub const INERT_VARS: &[&str] = &[
    "LOXILB_KV_TLOAD_LOG",
    "LOXILB_AI_CTRL_ADDR",
    "LOXILB_AI_CTRL_DECAY_WINDOW_SEC",
    "LLB_KV_LOADGUARD",
];

impl Default for Env {
    fn default() -> Self {
        Self::from_lookup(|_| None)
    }
}

impl Env {
    /// Reads the process environment and logs each [`EnvWarning`] once (`tracing::warn!`).
    pub fn from_process() -> Self {
        let env = Self::from_lookup(|k| std::env::var(k).ok());
        for w in &env.warnings {
            tracing::warn!(var = w.var, value = %w.value, used = %w.used, "{w}");
        }
        env
    }

    /// Builds the environment from `lookup(name) -> Some(value)` for set variables. An empty
    /// value counts as unset.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let mut r = Reader {
            lookup: &lookup,
            warnings: Vec::new(),
        };
        let kv_unified_mode = r.switch("LOXILB_KV_UNIFIED_MODE", true);
        let kv_lb_mode = r.lb_mode(kv_unified_mode);
        let kv = KvSettings {
            lb_mode: kv_lb_mode,
            mean_load_factor: r.int("LOXILB_KV_MEAN_LOAD_FACTOR", 175, 100, 1000) as u32,
            load_penalty: r.int("LOXILB_KV_LOAD_PENALTY", 32, 1, 100_000) as u32,
            spill_relief: r.tristate("LOXILB_KV_SPILL_RELIEF"),
            cap_sum_milli: r.int("LOXILB_KV_CAP_SUM_MILLI", 0, 1, u32::MAX as u64),
            work_copy_percent: r.int("LOXILB_KV_WORK_COPY_PERCENT", 100, 0, 1000) as u32,
            work_request_tokens: r.int("LOXILB_KV_WORK_REQUEST_TOKENS", 32, 0, 100_000) as u32,
            batch_slots: r.int("LOXILB_KV_BATCH_SLOTS", 0, 1, 1_000_000),
            coldstart_seed_n: r.int("LOXILB_KV_COLDSTART_SEED_N", 16, 0, u32::MAX as u64),
            coldstart_min_blocks: r.int("LOXILB_KV_COLDSTART_MIN_BLOCKS", 16, 0, u32::MAX as u64),
            replica_load: r.int("LOXI_KV_REPLICA_LOAD", 2, 0, 1_000_000),
            replica_hold: Duration::from_millis(r.int("LOXI_KV_REPLICA_HOLD_MS", 1000, 0, 600_000)),
            spill_floor: r.int("LOXI_KV_SPILL_FLOOR", 8, 0, 1_000_000),
            work_guard_percent: r.int("LOXI_KV_WORK_GUARD_PERCENT", 200, 0, 10_000) as u32,
            cold_least_work: r.cold_placement(),
            max_blocks: r.int("LOXILB_KV_MAX_BLOCKS", 1_000_000, 1000, 100_000_000),
            none_hash_seed: r.seed("LLB_KV_NONE_HASH_SEED"),
            hash_debug: r.switch("LLB_KV_HASH_DEBUG", false),
            min_match_tokens: r.int("LLB_KV_MIN_MATCH_TOKENS", 16, 0, 4096) as usize,
            predicted_ttl: Duration::from_millis(r.int("LOXI_KV_PREDICT_TTL_MS", 5000, 0, 600_000)),
            lora_paths: r.lora_paths(),
            cpu_tier_credit: r.fraction("LOXI_KV_CPU_TIER_CREDIT", 0.5),
            never_matched_after: r.int("LOXI_KV_NEVER_MATCHED_AFTER", 20, 1, 1_000_000),
            models_poll: Duration::from_millis(r.int(
                "LOXI_KV_MODELS_POLL_MS",
                10_000,
                0,
                3_600_000,
            )),
            // The flag's value is set by the KV wiring (`kv::wiring::start`).
            tokenizer_dir: crate::kv::settings::KvSettings::default().tokenizer_dir,
            bounds: PromptBounds {
                max_bytes: r.int("LOXI_KV_MAX_PROMPT_BYTES", 1 << 20, 4 << 10, 64 << 20) as usize,
                max_tokens: match r.int("LOXI_KV_MAX_PROMPT_TOKENS", 0, 16, 16 << 20) {
                    0 => None,
                    n => Some(n as usize),
                },
                max_run_bytes: r.int("LOXI_KV_MAX_RUN_BYTES", 8 << 10, 64, 16 << 20) as usize,
                max_messages: r.int("LOXI_KV_MAX_MESSAGES", 4096, 1, 1_000_000) as usize,
            },
            tokenize_workers: r.int(
                "LOXI_KV_TOKENIZE_WORKERS",
                crate::kv::settings::default_tokenize_workers() as u64,
                1,
                64,
            ) as usize,
            tokenize_queue: r.int("LOXI_KV_TOKENIZE_QUEUE", 64, 1, 65_536) as usize,
            decision_budget: Duration::from_millis(r.int(
                "LOXI_KV_DECISION_BUDGET_MS",
                10,
                1,
                60_000,
            )),
        };
        r.law_knobs(kv_lb_mode);
        // Each read only in a case the settings above rule out: warned, not silently inert.
        let lb_mode_set = r.get("LOXILB_KV_LB_MODE").is_some();
        r.unread(
            lb_mode_set,
            "LOXILB_KV_UNIFIED_MODE",
            "no effect (LOXILB_KV_LB_MODE is set)",
            "read only when LOXILB_KV_LB_MODE is unset",
        );
        r.unread(
            kv.coldstart_seed_n == 0,
            "LOXILB_KV_COLDSTART_MIN_BLOCKS",
            "no effect (cold-start seeding is off)",
            "effective only with LOXILB_KV_COLDSTART_SEED_N > 0",
        );
        r.unread(
            kv.replica_load == 0,
            "LOXI_KV_REPLICA_HOLD_MS",
            "no effect (replica seeding is off)",
            "effective only with LOXI_KV_REPLICA_LOAD > 0",
        );
        if kv.replica_load > 0
            && kv.replica_hold < kv.decision_budget
            && let Some(v) = r.get("LOXI_KV_REPLICA_HOLD_MS")
        {
            let budget = kv.decision_budget.as_millis();
            r.warn(
                "LOXI_KV_REPLICA_HOLD_MS",
                v,
                budget,
                &format!("at least LOXI_KV_DECISION_BUDGET_MS, {budget}"),
            );
        }
        let pd_queue_depth_per_ep = r.clamped(
            "LLB_PD_QUEUE_DEPTH_PER_EP",
            0,
            u64::from(crate::routing::admission::MAX_QUEUE_DEPTH),
        );
        let pd_max_inflight_per_ep = r.int("LLB_PD_MAX_INFLIGHT_PER_EP", 0, 0, 99_999) as u32;
        let pd_max_park_sec = r.int("LLB_PD_MAX_PARK_SEC", 0, 0, 99_999) as u32;
        let admission_scope = r.admission_scope();
        if pd_max_inflight_per_ep == 0 {
            r.gate_off(&[
                "LLB_PD_QUEUE_DEPTH_PER_EP",
                "LLB_PD_MAX_PARK_SEC",
                "LOXI_ADMISSION_SCOPE",
            ]);
        }
        Env {
            kv,
            kv_unified_mode,
            kv_tload_log: r.switch("LOXILB_KV_TLOAD_LOG", false),
            ai_ctrl_addr: r.host_port("LOXILB_AI_CTRL_ADDR"),
            ai_ctrl_decay_window_sec: r.int("LOXILB_AI_CTRL_DECAY_WINDOW_SEC", 30, 1, 86_400)
                as u32,
            kv_loadguard: r.nonzero("LLB_KV_LOADGUARD"),
            pd_prefill_timeout_sec: r.int("LLB_PD_PREFILL_TIMEOUT_SEC", 30, 1, 100_000) as u32,
            pd_decode_timeout_sec: r.int("LLB_PD_DECODE_TIMEOUT_SEC", 60, 1, 100_000) as u32,
            pd_max_inflight_per_ep,
            pd_queue_depth_per_ep,
            pd_max_park_sec,
            admission_scope,
            pd_max_total_inflight: r.int("LLB_PD_MAX_TOTAL_INFLIGHT", 0, 0, u32::MAX as u64) as u32,
            pd_origin_err_threshold: r.int("LLB_PD_ORIGIN_ERR_THRESHOLD", 3, 0, u32::MAX as u64)
                as u32,
            max_body_bytes: r.int("LOXI_MAX_BODY_BYTES", 32 << 20, 1 << 10, 1 << 30) as usize,
            body_timeout_ms: r.int("LOXI_BODY_TIMEOUT_MS", 60_000, 100, 3_600_000),
            upstream_response_timeout_ms: r.int(
                "LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS",
                1_800_000,
                0,
                86_400_000,
            ),
            max_body_bytes_in_flight: r.int(
                "LOXI_MAX_BODY_BYTES_IN_FLIGHT",
                256 << 20,
                1 << 20,
                64 << 30,
            ),
            models_cache_ms: r.int("LOXI_MODELS_CACHE_MS", 2000, 0, 600_000),
            models_timeout_ms: r.int("LOXI_MODELS_TIMEOUT_MS", 2000, 10, 60_000),
            engine_metrics_interval_ms: match r.int("LOXI_ENGINE_METRICS_INTERVAL_MS", 0, 0, 60_000)
            {
                0 => 0,
                ms => ms.max(50),
            },
            header_timeout_ms: r.int("LOXI_HEADER_TIMEOUT_MS", 10_000, 100, 600_000),
            idle_timeout_ms: r.int("LOXI_IDLE_TIMEOUT_MS", 60_000, 100, 3_600_000),
            send_timeout_ms: r.int("LOXI_SEND_TIMEOUT_MS", 60_000, 100, 3_600_000),
            max_conns_per_listener: r.int("LOXI_MAX_CONNS_PER_LISTENER", 4096, 1, 1_000_000)
                as usize,
            warnings: r.warnings,
            inert: INERT_VARS
                .iter()
                .copied()
                .filter(|v| lookup(v).is_some_and(|x| !x.trim().is_empty()))
                .collect(),
        }
    }

    /// The effective admission park deadline in seconds (0 → the prefill timeout).
    pub fn effective_max_park_sec(&self) -> u32 {
        match self.pd_max_park_sec {
            0 => self.pd_prefill_timeout_sec,
            n => n,
        }
    }

    /// The admission gate's settings (the gate's own type; off while
    /// `LLB_PD_MAX_INFLIGHT_PER_EP` is 0).
    pub fn admission(&self) -> AdmissionSettings {
        AdmissionSettings {
            max_inflight: self.pd_max_inflight_per_ep,
            queue_depth: self.pd_queue_depth_per_ep,
            max_park: Duration::from_secs(self.effective_max_park_sec().into()),
            scope: self.admission_scope,
        }
    }
}

/// Reads variables through the lookup and collects warnings.
struct Reader<'a> {
    lookup: &'a dyn Fn(&str) -> Option<String>,
    warnings: Vec<EnvWarning>,
}

const ON: [&str; 4] = ["1", "true", "on", "yes"];
const OFF: [&str; 4] = ["0", "false", "off", "no"];

impl Reader<'_> {
    fn get(&self, var: &str) -> Option<String> {
        (self.lookup)(var)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    fn warn(&mut self, var: &'static str, value: String, used: impl fmt::Display, accepted: &str) {
        let (used, accepted) = (used.to_string(), accepted.to_string());
        self.warnings.push(EnvWarning {
            var,
            value,
            used,
            accepted,
        });
    }

    /// `LOXI_KV_LORA_PATHS`: the `name=path` pairs; entries that are not one are dropped with
    /// one warning naming them.
    fn lora_paths(&mut self) -> std::collections::HashMap<String, String> {
        const VAR: &str = "LOXI_KV_LORA_PATHS";
        let Some(v) = self.get(VAR) else {
            return Default::default();
        };
        let (paths, rejected) = crate::kv::settings::parse_lora_paths(&v);
        if !rejected.is_empty() {
            let mut kept: Vec<&str> = paths.keys().map(String::as_str).collect();
            kept.sort_unstable();
            let used = match kept.as_slice() {
                [] => "no LoRA paths".to_string(),
                names => format!("the paths of {}", names.join(", ")),
            };
            let accepted = format!(
                "comma-separated name=path entries; not one: {}",
                rejected.join(", ")
            );
            self.warn(VAR, v, used, &accepted);
        }
        paths
    }

    /// A fraction in `[0, 1]` (a value outside it, or not a number, is refused: warning and
    /// `default`).
    fn fraction(&mut self, var: &'static str, default: f64) -> f64 {
        let Some(v) = self.get(var) else {
            return default;
        };
        match v.parse::<f64>() {
            Ok(x) if (0.0..=1.0).contains(&x) => x,
            _ => {
                self.warn(var, v, default, "a number in [0, 1]");
                default
            }
        }
    }

    /// An integer in `lo..=hi`; 0 is always accepted when it is the default (an "off" value).
    fn int(&mut self, var: &'static str, default: u64, lo: u64, hi: u64) -> u64 {
        let Some(v) = self.get(var) else {
            return default;
        };
        match v.parse::<u64>() {
            Ok(n) if (lo..=hi).contains(&n) || (n == 0 && default == 0) => n,
            _ => {
                let off = if default == 0 && lo > 0 { " or 0" } else { "" };
                self.warn(var, v, default, &format!("integer {lo}..={hi}{off}"));
                default
            }
        }
    }

    /// A non-negative integer clamped to `max` (warning on clamp or garbage).
    fn clamped(&mut self, var: &'static str, default: u64, max: u64) -> u32 {
        let Some(v) = self.get(var) else {
            return default as u32;
        };
        match v.parse::<u64>() {
            Ok(n) if n <= max => n as u32,
            Ok(_) => {
                self.warn(
                    var,
                    v,
                    max,
                    &format!("integer 0..={max} (larger values are clamped)"),
                );
                max as u32
            }
            Err(_) => {
                self.warn(var, v, default, &format!("integer 0..={max}"));
                default as u32
            }
        }
    }

    fn bool_word(v: &str) -> Option<bool> {
        let l = v.to_ascii_lowercase();
        if ON.contains(&l.as_str()) {
            Some(true)
        } else if OFF.contains(&l.as_str()) {
            Some(false)
        } else {
            None
        }
    }

    /// `1/true/on/yes` or `0/false/off/no`.
    fn switch(&mut self, var: &'static str, default: bool) -> bool {
        let Some(v) = self.get(var) else {
            return default;
        };
        Self::bool_word(&v).unwrap_or_else(|| {
            self.warn(
                var,
                v,
                if default { "on" } else { "off" },
                "1/true/on/yes or 0/false/off/no",
            );
            default
        })
    }

    /// Like [`Reader::switch`] but unset (or garbage) is `None` = auto.
    fn tristate(&mut self, var: &'static str) -> Option<bool> {
        let v = self.get(var)?;
        let parsed = Self::bool_word(&v);
        if parsed.is_none() {
            self.warn(
                var,
                v,
                "auto",
                "1/true/on/yes, 0/false/off/no, or unset for auto",
            );
        }
        parsed
    }

    /// Any non-zero integer (or an on/off word) enables.
    fn nonzero(&mut self, var: &'static str) -> bool {
        let Some(v) = self.get(var) else { return false };
        if let Ok(n) = v.parse::<i64>() {
            return n != 0;
        }
        Self::bool_word(&v).unwrap_or_else(|| {
            self.warn(var, v, "off", "an integer (non-0 enables) or on/off");
            false
        })
    }

    /// `LOXI_ADMISSION_SCOPE`: `pd` (default) or `all`.
    fn admission_scope(&mut self) -> AdmissionScope {
        match self.get("LOXI_ADMISSION_SCOPE") {
            None => AdmissionScope::Pd,
            Some(v) if v.eq_ignore_ascii_case("pd") => AdmissionScope::Pd,
            Some(v) if v.eq_ignore_ascii_case("all") => AdmissionScope::All,
            Some(v) => {
                self.warn("LOXI_ADMISSION_SCOPE", v, "pd", "pd|all");
                AdmissionScope::Pd
            }
        }
    }

    /// Warns about each of `vars` that is set while the admission gate is off
    /// (`LLB_PD_MAX_INFLIGHT_PER_EP` 0): it would otherwise look as if it did something.
    fn gate_off(&mut self, vars: &[&'static str]) {
        for &var in vars {
            if let Some(v) = self.get(var) {
                self.warn(
                    var,
                    v,
                    "no effect (the admission gate is off)",
                    "effective only with LLB_PD_MAX_INFLIGHT_PER_EP > 0",
                );
            }
        }
    }

    /// Warns about `var` when it is set while `unread` (another setting rules out reading it),
    /// saying `used` and what would make it `accepted`.
    fn unread(&mut self, unread: bool, var: &'static str, used: &str, accepted: &str) {
        if unread && let Some(v) = self.get(var) {
            self.warn(var, v, used, accepted);
        }
    }

    /// Warns about each blend-law knob that is set while `LOXILB_KV_LB_MODE` selects a law
    /// that does not read it (formulas in `kv/route/blend.rs`): it would otherwise look as if
    /// it did something.
    fn law_knobs(&mut self, mode: KvLbMode) {
        use KvLbMode::{Adaptive, AdaptiveSoft, Hard, Soft, Work};
        const KNOBS: [(&str, &[KvLbMode], &str); 9] = [
            (
                "LOXILB_KV_MEAN_LOAD_FACTOR",
                &[Hard, Adaptive],
                "hard|adaptive",
            ),
            ("LOXILB_KV_SPILL_RELIEF", &[Hard, Adaptive], "hard|adaptive"),
            ("LOXI_KV_SPILL_FLOOR", &[Hard, Adaptive], "hard|adaptive"),
            (
                "LOXI_KV_WORK_GUARD_PERCENT",
                &[Hard, Adaptive],
                "hard|adaptive",
            ),
            (
                "LOXILB_KV_LOAD_PENALTY",
                &[Soft, AdaptiveSoft],
                "soft|adaptive-soft",
            ),
            (
                "LOXILB_KV_CAP_SUM_MILLI",
                &[Adaptive, AdaptiveSoft],
                "adaptive|adaptive-soft",
            ),
            ("LOXILB_KV_WORK_COPY_PERCENT", &[Work], "work"),
            ("LOXILB_KV_WORK_REQUEST_TOKENS", &[Work], "work"),
            ("LOXILB_KV_BATCH_SLOTS", &[Work], "work"),
        ];
        for (var, laws, names) in KNOBS {
            if laws.contains(&mode) {
                continue;
            }
            if let Some(v) = self.get(var) {
                self.warn(
                    var,
                    v,
                    format!("no effect (LOXILB_KV_LB_MODE is {})", mode.as_str()),
                    &format!("read only by LOXILB_KV_LB_MODE={names}"),
                );
            }
        }
    }

    /// `LOXI_KV_COLD_PLACEMENT`: `least-work` (true, default) or `sel`; garbage → warn + default.
    fn cold_placement(&mut self) -> bool {
        let Some(v) = self.get("LOXI_KV_COLD_PLACEMENT") else {
            return true;
        };
        match v.trim().to_ascii_lowercase().as_str() {
            "least-work" => true,
            "sel" => false,
            _ => {
                self.warn("LOXI_KV_COLD_PLACEMENT", v, "least-work", "least-work|sel");
                true
            }
        }
    }

    fn lb_mode(&mut self, unified: bool) -> KvLbMode {
        let Some(v) = self.get("LOXILB_KV_LB_MODE") else {
            return if unified {
                KvLbMode::Hard
            } else {
                KvLbMode::Off
            };
        };
        KvLbMode::parse(&v).unwrap_or_else(|| {
            self.warn(
                "LOXILB_KV_LB_MODE",
                v,
                "hard",
                "off|hard|soft|adaptive|adaptive-soft|work",
            );
            KvLbMode::Hard
        })
    }

    fn host_port(&mut self, var: &'static str) -> Option<String> {
        let v = self.get(var)?;
        let ok = v
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if ok {
            return Some(v);
        }
        self.warn(var, v, "unset (no controller)", "host:port");
        None
    }

    fn seed(&mut self, var: &'static str) -> Option<String> {
        let v = (self.lookup)(var)?;
        if v.len() <= 23 {
            return Some(v);
        }
        self.warn(
            var,
            v,
            "unset (as vLLM 0.32 unseeded: `vllm-none-hash` for sha256_cbor, a random per-process seed for xxhash_cbor)",
            "at most 23 bytes",
        );
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> Env {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Env::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn unset_environment_gives_spec_defaults() {
        let e = env(&[]);
        assert_eq!(e.kv.lb_mode, KvLbMode::Hard);
        assert!(e.kv_unified_mode);
        assert_eq!(e.kv.mean_load_factor, 175);
        assert_eq!(e.kv.load_penalty, 32);
        assert_eq!(e.kv.spill_relief, None);
        assert_eq!(e.kv.cap_sum_milli, 0);
        assert!(!e.kv_tload_log);
        assert_eq!((e.kv.coldstart_seed_n, e.kv.coldstart_min_blocks), (16, 16));
        assert_eq!(e.kv.max_blocks, 1_000_000);
        assert_eq!(e.ai_ctrl_addr, None);
        assert_eq!(e.ai_ctrl_decay_window_sec, 30);
        assert_eq!(e.kv.none_hash_seed, None);
        assert!(!e.kv.hash_debug && !e.kv_loadguard);
        assert_eq!(e.kv.min_match_tokens, 16);
        assert_eq!(e.pd_prefill_timeout_sec, 30);
        assert_eq!(e.pd_decode_timeout_sec, 60);
        assert_eq!(
            e.pd_max_inflight_per_ep + e.pd_queue_depth_per_ep + e.pd_max_park_sec,
            0
        );
        assert_eq!(e.pd_max_total_inflight, 0);
        assert_eq!(e.pd_origin_err_threshold, 3);
        assert_eq!(e.kv.predicted_ttl, Duration::from_millis(5000));
        assert_eq!(e.max_body_bytes, 32 * 1024 * 1024);
        assert_eq!((e.header_timeout_ms, e.idle_timeout_ms), (10_000, 60_000));
        assert_eq!(e.send_timeout_ms, 60_000);
        assert_eq!(e.max_conns_per_listener, 4096);
        assert!(e.warnings.is_empty());
    }

    #[test]
    fn valid_values_are_taken() {
        let e = env(&[
            ("LOXILB_KV_LB_MODE", "Adaptive-Soft"),
            ("LOXILB_KV_MEAN_LOAD_FACTOR", "300"),
            ("LOXILB_KV_LOAD_PENALTY", "100000"),
            ("LOXILB_KV_SPILL_RELIEF", "no"),
            ("LOXILB_KV_CAP_SUM_MILLI", "8000"),
            ("LOXILB_KV_MAX_BLOCKS", "1000"),
            ("LLB_KV_NONE_HASH_SEED", "0"),
            ("LLB_KV_HASH_DEBUG", "1"),
            ("LLB_KV_MIN_MATCH_TOKENS", "0"),
            ("LLB_KV_LOADGUARD", "2"),
            ("LLB_PD_MAX_INFLIGHT_PER_EP", "8"),
            ("LLB_PD_PREFILL_TIMEOUT_SEC", "180"),
            ("LLB_PD_DECODE_TIMEOUT_SEC", "7"),
            ("LOXILB_AI_CTRL_ADDR", "10.0.0.1:18856"),
            ("LOXI_KV_PREDICT_TTL_MS", "250"),
            ("LOXI_MAX_BODY_BYTES", "1024"),
            ("LOXI_HEADER_TIMEOUT_MS", "250"),
            ("LOXI_IDLE_TIMEOUT_MS", "3600000"),
            ("LOXI_SEND_TIMEOUT_MS", "150"),
            ("LOXI_MAX_CONNS_PER_LISTENER", "1"),
        ]);
        assert_eq!(e.kv.lb_mode, KvLbMode::AdaptiveSoft);
        assert_eq!(e.kv.mean_load_factor, 300);
        assert_eq!(e.kv.load_penalty, 100_000);
        assert_eq!(e.kv.spill_relief, Some(false));
        assert!(!e.kv.spill_relief_for(crate::rules::KvMode::Pool));
        assert_eq!(e.kv.cap_sum_milli, 8000);
        assert_eq!(e.kv.max_blocks, 1000);
        assert_eq!(e.kv.none_hash_seed.as_deref(), Some("0"));
        assert!(e.kv.hash_debug && e.kv_loadguard);
        assert_eq!(e.kv.min_match_tokens, 0);
        assert_eq!(e.pd_max_inflight_per_ep, 8);
        assert_eq!(e.effective_max_park_sec(), 180);
        assert_eq!(e.pd_decode_timeout_sec, 7);
        assert_eq!(e.ai_ctrl_addr.as_deref(), Some("10.0.0.1:18856"));
        assert_eq!(e.kv.predicted_ttl, Duration::from_millis(250));
        assert_eq!(e.max_body_bytes, 1024);
        assert_eq!((e.header_timeout_ms, e.idle_timeout_ms), (250, 3_600_000));
        assert_eq!(e.send_timeout_ms, 150);
        assert_eq!(e.max_conns_per_listener, 1);
        // Set, valid, and not read by `adaptive-soft`: warned, not silently inert.
        let unread: Vec<&str> = e.warnings.iter().map(|w| w.var).collect();
        assert_eq!(
            unread,
            ["LOXILB_KV_MEAN_LOAD_FACTOR", "LOXILB_KV_SPILL_RELIEF"],
            "{:?}",
            e.warnings
        );
        assert!(
            e.warnings[0].used.contains("adaptive-soft"),
            "{}",
            e.warnings[0]
        );
    }

    #[test]
    fn cpu_tier_credit_outside_zero_to_one_is_refused() {
        assert_eq!(env(&[]).kv.cpu_tier_credit, 0.5);
        let e = env(&[("LOXI_KV_CPU_TIER_CREDIT", "0.25")]);
        assert_eq!((e.kv.cpu_tier_credit, e.warnings.len()), (0.25, 0));
        for bad in ["1.5", "-0.1", "half"] {
            let e = env(&[("LOXI_KV_CPU_TIER_CREDIT", bad)]);
            assert_eq!(e.kv.cpu_tier_credit, 0.5, "{bad}");
            assert_eq!(e.warnings.len(), 1, "{bad}");
            assert_eq!(e.warnings[0].var, "LOXI_KV_CPU_TIER_CREDIT");
        }
    }

    #[test]
    fn garbage_lb_mode_warns_and_uses_hard() {
        let e = env(&[("LOXILB_KV_LB_MODE", "fastest")]);
        assert_eq!(e.kv.lb_mode, KvLbMode::Hard);
        assert_eq!(e.warnings.len(), 1);
        let w = &e.warnings[0];
        assert_eq!(
            (w.var, w.value.as_str(), w.used.as_str()),
            ("LOXILB_KV_LB_MODE", "fastest", "hard")
        );
        let text = w.to_string();
        assert!(
            text.contains("LOXILB_KV_LB_MODE") && text.contains("fastest") && text.contains("hard"),
            "{text}"
        );
    }

    #[test]
    fn unified_mode_disabled_turns_the_law_off_only_when_lb_mode_unset() {
        assert_eq!(
            env(&[("LOXILB_KV_UNIFIED_MODE", "off")]).kv.lb_mode,
            KvLbMode::Off
        );
        let both = env(&[
            ("LOXILB_KV_UNIFIED_MODE", "0"),
            ("LOXILB_KV_LB_MODE", "soft"),
        ]);
        assert_eq!(both.kv.lb_mode, KvLbMode::Soft);
    }

    #[test]
    fn out_of_range_integers_warn_with_the_default_used() {
        let e = env(&[
            ("LOXILB_KV_MEAN_LOAD_FACTOR", "99"),
            ("LOXILB_KV_MAX_BLOCKS", "999"),
            ("LLB_KV_MIN_MATCH_TOKENS", "4097"),
            ("LOXI_MAX_BODY_BYTES", "12abc"),
            ("LLB_PD_MAX_INFLIGHT_PER_EP", "100000"),
        ]);
        assert_eq!(e.kv.mean_load_factor, 175);
        assert_eq!(e.kv.max_blocks, 1_000_000);
        assert_eq!(e.kv.min_match_tokens, 16);
        assert_eq!(e.max_body_bytes, 32 << 20);
        assert_eq!(e.pd_max_inflight_per_ep, 0);
        let vars: Vec<_> = e.warnings.iter().map(|w| (w.var, w.used.clone())).collect();
        assert_eq!(
            vars,
            vec![
                ("LOXILB_KV_MEAN_LOAD_FACTOR", "175".to_string()),
                ("LOXILB_KV_MAX_BLOCKS", "1000000".to_string()),
                ("LLB_KV_MIN_MATCH_TOKENS", "16".to_string()),
                ("LLB_PD_MAX_INFLIGHT_PER_EP", "0".to_string()),
                ("LOXI_MAX_BODY_BYTES", "33554432".to_string()),
            ]
        );
    }

    #[test]
    fn set_variables_without_an_implementation_are_listed_as_inert() {
        let e = env(&[
            ("LLB_PD_PREFILL_TIMEOUT_SEC", "180"),
            ("LOXILB_AI_CTRL_ADDR", "10.0.0.1:18856"),
            ("LLB_PD_ORIGIN_ERR_THRESHOLD", "5"),
            ("LLB_KV_LOADGUARD", " "),
        ]);
        assert_eq!(e.inert, ["LOXILB_AI_CTRL_ADDR"]);
        assert_eq!(
            e.pd_prefill_timeout_sec, 180,
            "read and used by the P/D proxy"
        );
        assert!(env(&[]).inert.is_empty());
    }

    #[test]
    fn queue_depth_is_clamped_to_64() {
        let e = env(&[
            ("LLB_PD_QUEUE_DEPTH_PER_EP", "500"),
            ("LLB_PD_MAX_INFLIGHT_PER_EP", "4"),
        ]);
        assert_eq!(e.pd_queue_depth_per_ep, 64);
        assert_eq!(e.warnings.len(), 1);
        assert_eq!(e.admission().queue_depth, 64);
        assert_eq!(
            env(&[("LLB_PD_QUEUE_DEPTH_PER_EP", "12")]).pd_queue_depth_per_ep,
            12
        );
    }

    #[test]
    fn admission_settings_resolve_the_park_deadline_and_the_scope() {
        let e = env(&[
            ("LLB_PD_MAX_INFLIGHT_PER_EP", "1"),
            ("LLB_PD_QUEUE_DEPTH_PER_EP", "2"),
            ("LLB_PD_PREFILL_TIMEOUT_SEC", "45"),
            ("LOXI_ADMISSION_SCOPE", "ALL"),
        ]);
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
        assert!(e.inert.is_empty(), "the gate is implemented: {:?}", e.inert);
        let a = e.admission();
        assert_eq!(
            (a.max_inflight, a.queue_depth, a.max_park, a.scope),
            (1, 2, Duration::from_secs(45), AdmissionScope::All),
            "LLB_PD_MAX_PARK_SEC 0 = the prefill timeout"
        );
        let e = env(&[
            ("LLB_PD_MAX_INFLIGHT_PER_EP", "1"),
            ("LLB_PD_MAX_PARK_SEC", "3"),
            ("LOXI_ADMISSION_SCOPE", "some"),
        ]);
        assert_eq!(e.admission().max_park, Duration::from_secs(3));
        assert_eq!(e.admission_scope, AdmissionScope::Pd);
        assert_eq!(e.warnings.len(), 1);
        assert_eq!(
            (e.warnings[0].var, e.warnings[0].used.as_str()),
            ("LOXI_ADMISSION_SCOPE", "pd")
        );
        assert!(!env(&[]).admission().applies(true), "off by default");
    }

    #[test]
    fn gate_knobs_without_the_cap_are_warned_as_without_effect() {
        let e = env(&[
            ("LLB_PD_QUEUE_DEPTH_PER_EP", "8"),
            ("LLB_PD_MAX_PARK_SEC", "5"),
            ("LOXI_ADMISSION_SCOPE", "all"),
        ]);
        let vars: Vec<_> = e.warnings.iter().map(|w| w.var).collect();
        assert_eq!(
            vars,
            [
                "LLB_PD_QUEUE_DEPTH_PER_EP",
                "LLB_PD_MAX_PARK_SEC",
                "LOXI_ADMISSION_SCOPE"
            ]
        );
        assert!(
            e.warnings[0]
                .to_string()
                .contains("LLB_PD_MAX_INFLIGHT_PER_EP > 0"),
            "{}",
            e.warnings[0]
        );
        assert!(!e.admission().applies(true));
    }

    #[test]
    fn spill_relief_auto_follows_the_topology() {
        let e = env(&[]);
        assert!(e.kv.spill_relief_for(crate::rules::KvMode::Pool));
        assert!(
            !e.kv
                .clone()
                .spill_relief_for(crate::rules::KvMode::PdPrefill)
        );
        let bad = env(&[("LOXILB_KV_SPILL_RELIEF", "maybe")]);
        assert_eq!(bad.kv.spill_relief, None);
        assert_eq!(bad.warnings[0].used, "auto");
    }

    #[test]
    fn over_long_seed_and_bad_controller_address_are_dropped_with_warnings() {
        let e = env(&[
            ("LLB_KV_NONE_HASH_SEED", "012345678901234567890123"),
            ("LOXILB_AI_CTRL_ADDR", "controller"),
            ("LLB_KV_HASH_DEBUG", "verbose"),
        ]);
        assert_eq!(e.kv.none_hash_seed, None);
        assert_eq!(e.ai_ctrl_addr, None);
        assert!(!e.kv.hash_debug);
        let vars: Vec<_> = e.warnings.iter().map(|w| w.var).collect();
        assert_eq!(
            vars,
            vec![
                "LLB_KV_NONE_HASH_SEED",
                "LLB_KV_HASH_DEBUG",
                "LOXILB_AI_CTRL_ADDR"
            ]
        );
    }

    #[test]
    fn empty_values_count_as_unset() {
        let e = env(&[("LOXILB_KV_LB_MODE", ""), ("LOXILB_KV_MAX_BLOCKS", "  ")]);
        assert_eq!(e.kv.lb_mode, KvLbMode::Hard);
        assert_eq!(e.kv.max_blocks, 1_000_000);
        assert!(e.warnings.is_empty());
    }

    #[test]
    fn unset_environment_maps_to_kv_setting_defaults() {
        assert_eq!(Env::from_lookup(|_| None).kv, KvSettings::default());
        let d = KvSettings::default();
        assert_eq!(
            (
                d.lb_mode,
                d.mean_load_factor,
                d.load_penalty,
                d.max_blocks,
                d.min_match_tokens
            ),
            (KvLbMode::Hard, 175, 32, 1_000_000, 16)
        );
        assert!(
            d.spill_relief_for(crate::rules::KvMode::Pool)
                && !d.spill_relief_for(crate::rules::KvMode::PdPrefill)
        );
    }

    #[test]
    fn kv_work_bounds_map_to_settings_and_refuse_out_of_range_values() {
        let env: HashMap<&str, &str> = [
            ("LOXI_KV_MAX_PROMPT_BYTES", "65536"),
            ("LOXI_KV_MAX_PROMPT_TOKENS", "4096"),
            ("LOXI_KV_MAX_RUN_BYTES", "100"),
            ("LOXI_KV_MAX_MESSAGES", "12"),
            ("LOXI_KV_TOKENIZE_WORKERS", "3"),
            ("LOXI_KV_TOKENIZE_QUEUE", "7"),
            ("LOXI_KV_DECISION_BUDGET_MS", "25"),
            ("LOXI_BODY_TIMEOUT_MS", "1500"),
            ("LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS", "0"),
            ("LOXI_MAX_BODY_BYTES_IN_FLIGHT", "2097152"),
            ("LOXI_MODELS_CACHE_MS", "0"),
            ("LOXI_MODELS_TIMEOUT_MS", "250"),
        ]
        .into();
        let e = Env::from_lookup(|k| env.get(k).map(|v| v.to_string()));
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
        assert_eq!(
            (e.body_timeout_ms, e.max_body_bytes_in_flight),
            (1500, 2 << 20)
        );
        assert_eq!(e.upstream_response_timeout_ms, 0, "0 = no limit");
        assert_eq!((e.models_cache_ms, e.models_timeout_ms), (0, 250));
        let s = e.kv.clone();
        let b = s.bounds;
        assert_eq!(
            (b.max_bytes, b.max_tokens, b.max_run_bytes, b.max_messages),
            (65536, Some(4096), 100, 12)
        );
        assert_eq!((s.tokenize_workers, s.tokenize_queue), (3, 7));
        assert_eq!(s.decision_budget, Duration::from_millis(25));
        let bad: HashMap<&str, &str> = [
            ("LOXI_KV_MAX_PROMPT_BYTES", "100"),
            ("LOXI_KV_MAX_PROMPT_TOKENS", "8"),
            ("LOXI_KV_TOKENIZE_WORKERS", "0"),
            ("LOXI_KV_DECISION_BUDGET_MS", "0"),
        ]
        .into();
        let e = Env::from_lookup(|k| bad.get(k).map(|v| v.to_string()));
        let vars: Vec<_> = e.warnings.iter().map(|w| w.var).collect();
        assert_eq!(
            vars,
            [
                "LOXI_KV_MAX_PROMPT_BYTES",
                "LOXI_KV_MAX_PROMPT_TOKENS",
                "LOXI_KV_TOKENIZE_WORKERS",
                "LOXI_KV_DECISION_BUDGET_MS"
            ]
        );
        let s = e.kv.clone();
        assert_eq!((s.bounds.max_bytes, s.bounds.max_tokens), (1 << 20, None));
        assert_eq!(s.decision_budget, Duration::from_millis(10));
    }

    #[test]
    fn work_law_knobs_map_to_settings_and_fall_back_out_of_range() {
        let d = Env::from_lookup(|_| None).kv;
        assert_eq!(
            (d.work_copy_percent, d.work_request_tokens, d.batch_slots),
            (100, 32, 0)
        );
        let env: HashMap<&str, &str> = [
            ("LOXILB_KV_LB_MODE", "work"),
            ("LOXILB_KV_WORK_COPY_PERCENT", "250"),
            ("LOXILB_KV_WORK_REQUEST_TOKENS", "0"),
            ("LOXILB_KV_BATCH_SLOTS", "64"),
        ]
        .into();
        let e = Env::from_lookup(|k| env.get(k).map(|v| v.to_string()));
        assert_eq!(e.kv.lb_mode, KvLbMode::Work);
        assert_eq!(
            (
                e.kv.work_copy_percent,
                e.kv.work_request_tokens,
                e.kv.batch_slots
            ),
            (250, 0, 64)
        );
        assert!(e.warnings.is_empty());
        let e = Env::from_lookup(|k| match k {
            "LOXILB_KV_WORK_COPY_PERCENT" => Some("1001".into()),
            "LOXILB_KV_LB_MODE" => Some("work".into()),
            _ => None,
        });
        assert_eq!(e.kv.work_copy_percent, 100);
        assert_eq!(e.warnings.len(), 1);
    }

    #[test]
    fn replica_load_is_read_zero_turns_it_off_and_garbage_is_refused_with_a_warning() {
        assert_eq!(Env::from_lookup(|_| None).kv.replica_load, 2);
        let one = |v: &'static str| {
            Env::from_lookup(move |k| (k == "LOXI_KV_REPLICA_LOAD").then(|| v.to_string()))
        };
        let e = one("0");
        assert_eq!((e.kv.replica_load, e.warnings.len()), (0, 0));
        let e = one("5");
        assert_eq!((e.kv.replica_load, e.warnings.len()), (5, 0));
        for bad in ["-1", "two", "1000001"] {
            let e = one(bad);
            assert_eq!(e.kv.replica_load, 2, "{bad}");
            assert_eq!(e.warnings.len(), 1, "{bad}");
            assert_eq!(e.warnings[0].var, "LOXI_KV_REPLICA_LOAD");
        }
    }

    #[test]
    fn replica_hold_is_read_at_least_the_budget_and_warned_without_replica_seeding() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            Env::from_lookup(move |k| {
                vars.iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        let e = env(&[]);
        assert_eq!(e.kv.replica_hold, Duration::from_secs(1));
        assert_eq!(e.kv.replica_hold_window(), Duration::from_secs(1));
        let e = env(&[("LOXI_KV_REPLICA_HOLD_MS", "0")]);
        assert_eq!(e.kv.replica_hold, Duration::ZERO);
        // Never below the decision budget (10 ms by default, 25 here), and said so: 0 is not
        // "off".
        assert_eq!(e.kv.replica_hold_window(), Duration::from_millis(10));
        assert_eq!(
            e.warnings
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["LOXI_KV_REPLICA_HOLD_MS=\"0\" is not accepted (at least \
              LOXI_KV_DECISION_BUDGET_MS, 10); using 10"]
        );
        let e = env(&[
            ("LOXI_KV_REPLICA_HOLD_MS", "5"),
            ("LOXI_KV_DECISION_BUDGET_MS", "25"),
        ]);
        assert_eq!(e.kv.replica_hold_window(), Duration::from_millis(25));
        assert_eq!(e.warnings[0].used, "25");
        let e = env(&[
            ("LOXI_KV_REPLICA_HOLD_MS", "25"),
            ("LOXI_KV_DECISION_BUDGET_MS", "25"),
        ]);
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
        let e = env(&[("LOXI_KV_REPLICA_HOLD_MS", "600001")]);
        assert_eq!(e.kv.replica_hold, Duration::from_secs(1));
        assert_eq!(e.warnings[0].var, "LOXI_KV_REPLICA_HOLD_MS");
        // Set while replica seeding is off: warned, not silently inert.
        let e = env(&[
            ("LOXI_KV_REPLICA_HOLD_MS", "200"),
            ("LOXI_KV_REPLICA_LOAD", "0"),
        ]);
        assert_eq!(e.warnings.len(), 1);
        assert_eq!(e.warnings[0].var, "LOXI_KV_REPLICA_HOLD_MS");
        assert_eq!(e.warnings[0].used, "no effect (replica seeding is off)");
        assert_eq!(
            e.warnings[0].to_string(),
            "LOXI_KV_REPLICA_HOLD_MS=\"200\" is set but has no effect (replica seeding is \
             off): effective only with LOXI_KV_REPLICA_LOAD > 0"
        );
    }

    #[test]
    fn a_kv_variable_another_setting_rules_out_is_warned() {
        let e = env(&[
            ("LOXILB_KV_LB_MODE", "soft"),
            ("LOXILB_KV_UNIFIED_MODE", "off"),
        ]);
        assert_eq!(e.kv.lb_mode, KvLbMode::Soft);
        let w: Vec<_> = e
            .warnings
            .iter()
            .map(|w| (w.var, w.used.as_str()))
            .collect();
        assert_eq!(
            w,
            [(
                "LOXILB_KV_UNIFIED_MODE",
                "no effect (LOXILB_KV_LB_MODE is set)"
            )]
        );
        let e = env(&[
            ("LOXILB_KV_COLDSTART_SEED_N", "0"),
            ("LOXILB_KV_COLDSTART_MIN_BLOCKS", "100"),
        ]);
        let w: Vec<_> = e
            .warnings
            .iter()
            .map(|w| (w.var, w.used.as_str()))
            .collect();
        assert_eq!(
            w,
            [(
                "LOXILB_KV_COLDSTART_MIN_BLOCKS",
                "no effect (cold-start seeding is off)"
            )]
        );
        // Each alone, or with the setting that reads it: no warning.
        for pairs in [
            &[("LOXILB_KV_UNIFIED_MODE", "off")][..],
            &[
                ("LOXILB_KV_COLDSTART_SEED_N", "4"),
                ("LOXILB_KV_COLDSTART_MIN_BLOCKS", "100"),
            ],
        ] {
            assert!(env(pairs).warnings.is_empty(), "{pairs:?}");
        }
    }

    #[test]
    fn a_law_knob_set_under_a_law_that_does_not_read_it_is_warned() {
        let with = |law: &'static str, var: &'static str| {
            Env::from_lookup(move |k| {
                (k == "LOXILB_KV_LB_MODE")
                    .then(|| law.to_string())
                    .or_else(|| (k == var).then(|| "16".to_string()))
            })
        };
        // Read by the law: no warning.
        for (law, var) in [
            ("hard", "LOXI_KV_SPILL_FLOOR"),
            ("adaptive", "LOXI_KV_SPILL_FLOOR"),
            ("hard", "LOXI_KV_WORK_GUARD_PERCENT"),
            ("adaptive", "LOXI_KV_WORK_GUARD_PERCENT"),
            ("work", "LOXILB_KV_BATCH_SLOTS"),
            ("soft", "LOXILB_KV_LOAD_PENALTY"),
            ("adaptive-soft", "LOXILB_KV_CAP_SUM_MILLI"),
        ] {
            assert!(with(law, var).warnings.is_empty(), "{law} {var}");
        }
        // Not read: one warning naming the variable, the law in force and the laws that read it.
        for (law, var, readers) in [
            ("work", "LOXI_KV_SPILL_FLOOR", "hard|adaptive"),
            ("off", "LOXI_KV_WORK_GUARD_PERCENT", "hard|adaptive"),
            ("off", "LOXILB_KV_BATCH_SLOTS", "work"),
            ("hard", "LOXILB_KV_LOAD_PENALTY", "soft|adaptive-soft"),
            ("soft", "LOXILB_KV_CAP_SUM_MILLI", "adaptive|adaptive-soft"),
        ] {
            let e = with(law, var);
            assert_eq!(e.warnings.len(), 1, "{law} {var}");
            let w = &e.warnings[0];
            assert_eq!((w.var, w.value.as_str()), (var, "16"));
            assert_eq!(w.used, format!("no effect (LOXILB_KV_LB_MODE is {law})"));
            assert!(w.accepted.ends_with(readers), "{w}");
        }
    }

    #[test]
    fn work_guard_and_cold_placement_are_read_and_garbage_is_refused_with_a_warning() {
        let d = Env::from_lookup(|_| None).kv;
        assert_eq!((d.work_guard_percent, d.cold_least_work), (200, true));
        let one = |var: &'static str, v: &'static str| {
            Env::from_lookup(move |k| (k == var).then(|| v.to_string()))
        };
        let e = one("LOXI_KV_WORK_GUARD_PERCENT", "0");
        assert_eq!((e.kv.work_guard_percent, e.warnings.len()), (0, 0));
        let e = one("LOXI_KV_WORK_GUARD_PERCENT", "150");
        assert_eq!((e.kv.work_guard_percent, e.warnings.len()), (150, 0));
        for bad in ["-1", "two", "10001"] {
            let e = one("LOXI_KV_WORK_GUARD_PERCENT", bad);
            assert_eq!(e.kv.work_guard_percent, 200, "{bad}");
            assert_eq!(e.warnings[0].var, "LOXI_KV_WORK_GUARD_PERCENT");
        }
        let e = one("LOXI_KV_COLD_PLACEMENT", "sel");
        assert_eq!((e.kv.cold_least_work, e.warnings.len()), (false, 0));
        let e = one("LOXI_KV_COLD_PLACEMENT", " Least-Work ");
        assert_eq!((e.kv.cold_least_work, e.warnings.len()), (true, 0));
        let e = one("LOXI_KV_COLD_PLACEMENT", "random");
        assert!(e.kv.cold_least_work);
        assert_eq!(e.warnings.len(), 1);
        assert_eq!(e.warnings[0].var, "LOXI_KV_COLD_PLACEMENT");
        assert!(
            e.warnings[0].accepted.contains("least-work|sel"),
            "{}",
            e.warnings[0]
        );
    }

    #[test]
    fn spill_floor_is_read_zero_turns_it_off_and_garbage_is_refused_with_a_warning() {
        assert_eq!(Env::from_lookup(|_| None).kv.spill_floor, 8);
        let one = |v: &'static str| {
            Env::from_lookup(move |k| (k == "LOXI_KV_SPILL_FLOOR").then(|| v.to_string()))
        };
        let e = one("0");
        assert_eq!((e.kv.spill_floor, e.warnings.len()), (0, 0));
        let e = one("32");
        assert_eq!((e.kv.spill_floor, e.warnings.len()), (32, 0));
        for bad in ["-1", "eight", "1000001"] {
            let e = one(bad);
            assert_eq!(e.kv.spill_floor, 8, "{bad}");
            assert_eq!(e.warnings.len(), 1, "{bad}");
            assert_eq!(e.warnings[0].var, "LOXI_KV_SPILL_FLOOR");
        }
    }

    #[test]
    fn kv_settings_take_values_and_fall_back_out_of_range() {
        let env: HashMap<&str, &str> = [
            ("LOXILB_KV_LB_MODE", "soft"),
            ("LOXILB_KV_MEAN_LOAD_FACTOR", "99"),
            ("LOXILB_KV_LOAD_PENALTY", "64"),
            ("LOXILB_KV_SPILL_RELIEF", "off"),
            ("LLB_KV_MIN_MATCH_TOKENS", "0"),
            ("LLB_KV_NONE_HASH_SEED", "0"),
            ("LOXI_KV_LORA_PATHS", "sql=/a/sql, x=/b"),
        ]
        .into();
        let s = Env::from_lookup(|k| env.get(k).map(|v| v.to_string())).kv;
        assert_eq!(s.lb_mode, KvLbMode::Soft);
        assert_eq!(s.mean_load_factor, 175);
        assert_eq!(s.load_penalty, 64);
        assert!(!s.spill_relief_for(crate::rules::KvMode::Pool));
        assert_eq!(s.min_match_tokens, 0);
        assert_eq!(s.none_hash_seed.as_deref(), Some("0"));
        assert_eq!(s.lora_paths.get("x").map(String::as_str), Some("/b"));
    }

    #[test]
    fn lora_path_entries_that_do_not_parse_are_dropped_with_one_warning() {
        let with = |v: &'static str| {
            Env::from_lookup(move |k| (k == "LOXI_KV_LORA_PATHS").then(|| v.to_string()))
        };
        let e = with("garbage");
        assert!(e.kv.lora_paths.is_empty());
        assert_eq!(e.warnings.len(), 1);
        assert_eq!(
            e.warnings[0].to_string(),
            "LOXI_KV_LORA_PATHS=\"garbage\" is not accepted (comma-separated name=path \
             entries; not one: garbage); using no LoRA paths"
        );
        let e = with("sql=/a/sql,junk,y=");
        assert_eq!(e.kv.lora_paths.len(), 1);
        assert_eq!(
            e.kv.lora_paths.get("sql").map(String::as_str),
            Some("/a/sql")
        );
        assert_eq!(e.warnings.len(), 1);
        assert_eq!(e.warnings[0].used, "the paths of sql");
        assert!(
            e.warnings[0].accepted.ends_with("not one: junk, y="),
            "{:?}",
            e.warnings
        );
        assert!(with("sql=/a/sql, x=/b,").warnings.is_empty());
    }

    #[test]
    fn unified_mode_off_means_argmax_only_when_lb_mode_unset() {
        let s = Env::from_lookup(|k| (k == "LOXILB_KV_UNIFIED_MODE").then(|| "0".to_string())).kv;
        assert_eq!(s.lb_mode, KvLbMode::Off);
        let s = Env::from_lookup(|k| match k {
            "LOXILB_KV_UNIFIED_MODE" => Some("0".into()),
            "LOXILB_KV_LB_MODE" => Some("bogus".into()),
            _ => None,
        })
        .kv;
        assert_eq!(s.lb_mode, KvLbMode::Hard);
    }
}
