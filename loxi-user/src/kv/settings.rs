//! Process-wide knobs of the KV tier (`LOXILB_KV_*`, `LLB_KV_*`), with the spec's defaults
//! (`../shared/spec/configuration-and-tuning.txt`). The daemon reads the environment once at
//! start (`config::env::Env`, the one parser of these variables, fills `Env::kv` with this type).

use std::collections::HashMap;
use std::time::Duration;

use super::route::blend::LbMode;
use crate::rules::KvMode;

/// Every KV knob. `Default` gives the documented defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct KvSettings {
    /// `LOXILB_KV_LB_MODE` (unset → `hard`; garbage → warn + `hard`).
    pub lb_mode: LbMode,
    /// `LOXILB_KV_MEAN_LOAD_FACTOR`, 100–1000, default 175 (ε = 0.75).
    pub mean_load_factor: u32,
    /// `LOXILB_KV_LOAD_PENALTY` λ, 1–100000, default 32.
    pub load_penalty: u32,
    /// `LOXILB_KV_SPILL_RELIEF`: `None` = auto (on for kvExactMode 3, off for 1).
    pub spill_relief: Option<bool>,
    /// `LOXILB_KV_CAP_SUM_MILLI`: fleet Σcapacity for the adaptive laws, 0 = off.
    pub cap_sum_milli: u64,
    /// `LOXILB_KV_WORK_COPY_PERCENT` (loxi, `work` law ξ·100): price of recomputing a block
    /// another endpoint holds, percent of its prefill. 0–1000, default 100.
    pub work_copy_percent: u32,
    /// `LOXILB_KV_WORK_REQUEST_TOKENS` (loxi, `work` law κ): tokens charged per request in
    /// flight. 0–100000, default 32.
    pub work_request_tokens: u32,
    /// `LOXILB_KV_BATCH_SLOTS` (loxi, `work` law S): the engines' batch slots (vLLM
    /// `--max-num-seqs`); a request beyond them is charged one more prefill. 0 = unbounded
    /// (default), 1–1,000,000.
    pub batch_slots: u64,
    /// `LOXILB_KV_COLDSTART_SEED_N`: divert every Nth hit to a cold endpoint, 0 = off. Default 16.
    pub coldstart_seed_n: u64,
    /// `LOXILB_KV_COLDSTART_MIN_BLOCKS`: below this many blocks an endpoint is cold (0 = only
    /// empty endpoints). Default 16.
    pub coldstart_min_blocks: u64,
    /// `LOXI_KV_REPLICA_LOAD` (loxi extension, every law): replica seeding, `R` of
    /// `blend::replica`: the law's pick must carry at least `R` requests (and more than its
    /// request share) before a request is sent to an idle endpoint with an empty cache. 0 = off, 1–1,000,000; default 2.
    pub replica_load: u64,
    /// `LOXI_KV_REPLICA_HOLD_MS` (loxi extension, with replica seeding on): a replica seed is
    /// held (the law's pick keeps the request) while a request whose prompt opens differently
    /// and holds a full block was placed within this window (and while one still waits for its
    /// decision); the window is at least [`Self::decision_budget`], see
    /// [`Self::replica_hold_window`]. Default 1000 ms, range 0–600000 ms.
    pub replica_hold: Duration,
    /// `LOXI_KV_SPILL_FLOOR` (loxi extension, `hard` and `adaptive`): a spill (a pick with less
    /// overlap than the owner) needs the owner to carry at least this many requests, or the
    /// owner's prefill wait in tokens to reach the spill's (`blend::spill_pays`). 0 = LoxiLB's
    /// laws unchanged, 1–1,000,000; default 8.
    pub spill_floor: u64,
    /// `LOXI_KV_WORK_GUARD_PERCENT` (loxi extension, `hard` and `adaptive`): the pick moves
    /// to an endpoint within the cap when its prefill wait in tokens exceeds that endpoint's
    /// by more than this percent of the tokens its cached prefix saves
    /// (`blend::work_guard`). 0 = off (LoxiLB's laws), 1–10,000; default 200.
    pub work_guard_percent: u32,
    /// `LOXI_KV_COLD_PLACEMENT` (loxi extension, every law): `least-work` (true, the default)
    /// places a request no endpoint holds a first block of on the eligible endpoint with the
    /// least prefill wait (queued prefill tokens plus the request's), then the least load,
    /// then the fewest cached blocks; `sel` (false) lets it fall through to the rule's
    /// selector, as LoxiLB does (miss reason `no_worker`).
    pub cold_least_work: bool,
    /// `LOXILB_KV_MAX_BLOCKS`: per-stream block cap, 1000–100,000,000, default 1,000,000.
    pub max_blocks: u64,
    /// `LLB_KV_MIN_MATCH_TOKENS`: prompts with fewer tokens miss as `shallow`; 0–4096, default 16.
    pub min_match_tokens: usize,
    /// `LLB_KV_NONE_HASH_SEED` (`None` = unset; see `block_hash` for what that means).
    pub none_hash_seed: Option<String>,
    /// `LLB_KV_HASH_DEBUG=1`: log every computed block hash.
    pub hash_debug: bool,
    /// `LOXI_KV_PREDICT_TTL_MS` (loxi extension): lifetime of predicted blocks, default 5 s.
    pub predicted_ttl: Duration,
    /// `LOXI_KV_LORA_PATHS` (loxi extension, `name=path,name=path`): the path vLLM hashes in a
    /// LoRA block's extra key `("lora", name, path)`; wins over the path the engines list
    /// (`kv::lora`). An entry that is not `name=path` is dropped with a warning.
    pub lora_paths: HashMap<String, String>,
    /// `LOXI_KV_MODELS_POLL_MS` (loxi extension): how often the engines of tier-1.5 rules are
    /// asked `GET /v1/models` for their LoRA adapters (`kv::lora`). Default 10 s; 0 = never
    /// (only `LOXI_KV_LORA_PATHS`); range 0–3,600,000 ms.
    pub models_poll: Duration,
    /// `--tokenizer-dir` (the daemon flag; default `/etc/loxilb/tokenizers`): where the
    /// tokenizer pool reads `<model with / as __>/tokenizer.json`, named by remedies.
    pub tokenizer_dir: std::path::PathBuf,
    /// `LOXI_KV_CPU_TIER_CREDIT` (loxi extension): what one prefix block held only on an
    /// engine's offload tier (`medium` CPU or other non-GPU) is worth in scoring, relative to
    /// a GPU block: loading it back is cheaper than recomputing it and dearer than a GPU hit.
    /// In [0, 1] (a value outside is refused: warning, default), default 0.5; 0 ignores the
    /// offload tier. A GPU block always counts more (credit 1 counts 0.999), so a GPU holder
    /// beats an offload-only holder at equal overlap.
    pub cpu_tier_credit: f64,
    /// `LOXI_KV_NEVER_MATCHED_AFTER` (loxi extension): requests with block keys routed to an
    /// endpoint holding blocks, none of whose blocks ever matched a request, after which the
    /// zero-hit watchdog reports it `never_matched`. Default 20, range 1–1,000,000.
    pub never_matched_after: u64,
    /// How much of a prompt the tier tokenizes and what it refuses to (see [`PromptBounds`]).
    pub bounds: PromptBounds,
    /// `LOXI_KV_TOKENIZE_WORKERS` (loxi extension): threads of the tokenization pool. Default
    /// the number of CPUs, at most 4; range 1–64.
    pub tokenize_workers: usize,
    /// `LOXI_KV_TOKENIZE_QUEUE` (loxi extension): requests waiting for a tokenization worker;
    /// a request beyond it misses with `overload`. Default 64, range 1–65536.
    pub tokenize_queue: usize,
    /// `LOXI_KV_DECISION_BUDGET_MS` (loxi extension): longest the tier works on one request
    /// (queue wait, tokenization and hashing); past it the request misses with `budget` and the
    /// rule's selector decides at once. Default 10 ms, range 1–60000 ms.
    pub decision_budget: Duration,
}

/// Bounds on the prompt work of one request (loxi extension; issue 9 §1). A prompt beyond
/// them is not tokenized (miss `oversize`) or only its leading part is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptBounds {
    /// `LOXI_KV_MAX_PROMPT_BYTES`: the leading bytes of a text prompt that are tokenized (the
    /// proxy's body parse keeps no more of any string); a chat whose messages hold more
    /// misses with `oversize`. Default 1 MiB, range 4 KiB–64 MiB.
    pub max_bytes: usize,
    /// `LOXI_KV_MAX_PROMPT_TOKENS`: tokens past this can never be cached by the engine (its
    /// context ends there), so tokenization stops once it has this many. `None` (unset): the
    /// model's `config.json` (`max_model_len`, `max_position_embeddings`, `n_positions`,
    /// `max_sequence_length`, `seq_length`), else [`DEFAULT_MAX_PROMPT_TOKENS`]. Range 16–16M.
    pub max_tokens: Option<usize>,
    /// `LOXI_KV_MAX_RUN_BYTES`: a prompt holding a whitespace-free run longer than this (in
    /// its tokenized part) misses with `oversize` (BPE on one long word costs ~200 bytes of
    /// memory per byte). Default 8 KiB, range 64 B–16 MiB.
    pub max_run_bytes: usize,
    /// `LOXI_KV_MAX_MESSAGES`: a chat with more messages misses with `oversize`. Default 4096,
    /// range 1–1,000,000.
    pub max_messages: usize,
}

/// Token bound used when neither `LOXI_KV_MAX_PROMPT_TOKENS` nor the model's `config.json`
/// gives one.
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 131_072;

impl Default for PromptBounds {
    fn default() -> Self {
        Self {
            max_bytes: 1 << 20,
            max_tokens: None,
            max_run_bytes: 8 << 10,
            max_messages: 4096,
        }
    }
}

impl Default for KvSettings {
    fn default() -> Self {
        Self {
            lb_mode: LbMode::Hard,
            mean_load_factor: 175,
            load_penalty: 32,
            spill_relief: None,
            cap_sum_milli: 0,
            work_copy_percent: 100,
            work_request_tokens: 32,
            batch_slots: 0,
            coldstart_seed_n: 16,
            coldstart_min_blocks: 16,
            replica_load: 2,
            replica_hold: Duration::from_secs(1),
            spill_floor: 8,
            work_guard_percent: 200,
            cold_least_work: true,
            max_blocks: 1_000_000,
            min_match_tokens: 16,
            none_hash_seed: None,
            hash_debug: false,
            predicted_ttl: Duration::from_secs(5),
            lora_paths: HashMap::new(),
            models_poll: Duration::from_secs(10),
            tokenizer_dir: std::path::PathBuf::from("/etc/loxilb/tokenizers"),
            cpu_tier_credit: 0.5,
            never_matched_after: 20,
            bounds: PromptBounds::default(),
            tokenize_workers: default_tokenize_workers(),
            tokenize_queue: 64,
            decision_budget: Duration::from_millis(10),
        }
    }
}

impl KvSettings {
    /// How recently a request of another prompt opening must have been placed to hold a
    /// replica seed: `LOXI_KV_REPLICA_HOLD_MS`, and never less than the decision budget.
    pub fn replica_hold_window(&self) -> Duration {
        self.replica_hold.max(self.decision_budget)
    }

    /// Spill relief for a rule of `mode` (auto = on for the role-less pool, kvExactMode 3).
    pub fn spill_relief_for(&self, mode: KvMode) -> bool {
        self.spill_relief.unwrap_or(mode == KvMode::Pool)
    }
}

/// The default tokenization pool size: the CPUs this process may use, at most 4.
pub fn default_tokenize_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// Parses `LOXI_KV_LORA_PATHS` (`name=path,name=path`): the pairs, and the entries that are
/// not `name=path` with both sides non-empty (the caller warns about them; empty entries, as
/// after a trailing comma, are neither).
pub fn parse_lora_paths(v: &str) -> (HashMap<String, String>, Vec<String>) {
    let mut paths = HashMap::new();
    let mut rejected = Vec::new();
    for entry in v.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match entry.split_once('=').map(|(k, p)| (k.trim(), p.trim())) {
            Some((k, p)) if !k.is_empty() && !p.is_empty() => {
                paths.insert(k.to_owned(), p.to_owned());
            }
            _ => rejected.push(entry.to_owned()),
        }
    }
    (paths, rejected)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_spec_values_and_relief_is_auto_for_the_pool() {
        let d = KvSettings::default();
        assert_eq!(
            (
                d.lb_mode,
                d.mean_load_factor,
                d.load_penalty,
                d.max_blocks,
                d.min_match_tokens
            ),
            (LbMode::Hard, 175, 32, 1_000_000, 16)
        );
        assert!(d.spill_relief_for(KvMode::Pool) && !d.spill_relief_for(KvMode::PdPrefill));
    }

    #[test]
    fn lora_paths_keep_the_pairs_and_return_what_is_not_one() {
        let (paths, rejected) = parse_lora_paths("sql=/a/sql, x = /b,junk,=/c,y=,");
        assert_eq!(
            paths,
            HashMap::from([("sql".into(), "/a/sql".into()), ("x".into(), "/b".into())])
        );
        assert_eq!(rejected, ["junk", "=/c", "y="]);
    }
}
