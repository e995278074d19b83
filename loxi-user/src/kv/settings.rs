//! Process-wide knobs of the KV tier (`LOXILB_KV_*`, `LLB_KV_*`), with the spec's defaults
//! (`../shared/spec/configuration-and-tuning.txt`). The daemon reads the environment once at
//! start (`config::env::Env`, the one parser of these variables); `KvSettings::from_env` maps it.

use std::collections::HashMap;
use std::time::Duration;

use super::blend::LbMode;

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
    /// Spill relief for a rule of `kv_exact_mode` (auto = on for mode 3).
    pub fn spill_relief_for(&self, kv_exact_mode: u8) -> bool {
        self.spill_relief.unwrap_or(kv_exact_mode == 3)
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
    fn unset_environment_gives_spec_defaults() {
        assert_eq!(
            KvSettings::from_env(&crate::config::Env::from_lookup(|_| None)),
            KvSettings::default()
        );
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
        assert!(d.spill_relief_for(3) && !d.spill_relief_for(1));
    }

    #[test]
    fn values_parse_and_out_of_range_falls_back_to_default() {
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
        let s = KvSettings::from_env(&crate::config::Env::from_lookup(|k| {
            env.get(k).map(|v| v.to_string())
        }));
        assert_eq!(s.lb_mode, LbMode::Soft);
        assert_eq!(s.mean_load_factor, 175);
        assert_eq!(s.load_penalty, 64);
        assert!(!s.spill_relief_for(3));
        assert_eq!(s.min_match_tokens, 0);
        assert_eq!(s.none_hash_seed.as_deref(), Some("0"));
        assert_eq!(s.lora_paths.get("x").map(String::as_str), Some("/b"));
    }

    #[test]
    fn unified_mode_off_means_argmax_only_when_lb_mode_unset() {
        let s = KvSettings::from_env(&crate::config::Env::from_lookup(|k| {
            (k == "LOXILB_KV_UNIFIED_MODE").then(|| "0".to_string())
        }));
        assert_eq!(s.lb_mode, LbMode::Off);
        let s = KvSettings::from_env(&crate::config::Env::from_lookup(|k| match k {
            "LOXILB_KV_UNIFIED_MODE" => Some("0".into()),
            "LOXILB_KV_LB_MODE" => Some("bogus".into()),
            _ => None,
        }));
        assert_eq!(s.lb_mode, LbMode::Hard);
    }
}
