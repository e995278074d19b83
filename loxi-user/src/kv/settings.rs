//! Process-wide knobs of the KV tier (`LOXILB_KV_*`, `LLB_KV_*`), with the spec's defaults
//! (`../shared/spec/configuration-and-tuning.txt`). The daemon reads the environment once at
//! start (`config::env::Env`, the one parser of these variables); `Env::kv_settings` maps it.

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
    /// `LOXILB_KV_COLDSTART_SEED_N`: divert every Nth hit to a cold endpoint, 0 = off. Default 16.
    pub coldstart_seed_n: u64,
    /// `LOXILB_KV_COLDSTART_MIN_BLOCKS`: below this many blocks an endpoint is cold (0 = only
    /// empty endpoints). Default 16.
    pub coldstart_min_blocks: u64,
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
    /// LoRA block's extra key `("lora", name, path)`. A request naming an unknown adapter misses
    /// with `hashes`.
    pub lora_paths: HashMap<String, String>,
}

impl Default for KvSettings {
    fn default() -> Self {
        Self {
            lb_mode: LbMode::Hard,
            mean_load_factor: 175,
            load_penalty: 32,
            spill_relief: None,
            cap_sum_milli: 0,
            coldstart_seed_n: 16,
            coldstart_min_blocks: 16,
            max_blocks: 1_000_000,
            min_match_tokens: 16,
            none_hash_seed: None,
            hash_debug: false,
            predicted_ttl: Duration::from_secs(5),
            lora_paths: HashMap::new(),
        }
    }
}

impl KvSettings {
    /// Spill relief for a rule of `mode` (auto = on for the role-less pool, kvExactMode 3).
    pub fn spill_relief_for(&self, mode: KvMode) -> bool {
        self.spill_relief.unwrap_or(mode == KvMode::Pool)
    }
}

/// Parses `LOXI_KV_LORA_PATHS` (`name=path,name=path`; entries without `=` are skipped).
pub fn parse_lora_paths(v: &str) -> HashMap<String, String> {
    v.split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, p)| (k.trim().to_owned(), p.trim().to_owned()))
        .collect()
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
        assert_eq!(
            parse_lora_paths("sql=/a/sql, x=/b,junk")
                .get("x")
                .map(String::as_str),
            Some("/b")
        );
    }
}
