//! Process-wide knobs of the KV tier (`LOXILB_KV_*`, `LLB_KV_*`), with the spec's defaults
//! (`../shared/spec/configuration-and-tuning.txt`). The daemon reads the environment once at
//! start; [`KvSettings::from_lookup`] does the parsing so the config layer only supplies values.

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
    /// `LOXILB_KV_PREDICT_TTL_MS` (loxi extension): lifetime of predicted blocks, default 5 s.
    pub predicted_ttl: Duration,
    /// `LOXILB_KV_LORA_PATHS` (loxi extension, `name=path,name=path`): the path vLLM hashes in a
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

fn int_in<T: std::str::FromStr + PartialOrd + Copy>(
    name: &str,
    v: Option<String>,
    lo: T,
    hi: T,
    def: T,
) -> T {
    let Some(raw) = v else { return def };
    match raw.trim().parse::<T>() {
        Ok(x) if x >= lo && x <= hi => x,
        _ => {
            tracing::warn!(var = name, value = %raw, "out of range or not a number; using the default");
            def
        }
    }
}

fn flag(name: &str, v: Option<String>) -> Option<bool> {
    let raw = v?;
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => {
            tracing::warn!(var = name, value = %raw, "not a boolean; using auto");
            None
        }
    }
}

impl KvSettings {
    /// Builds settings from an environment lookup (`|name| std::env::var(name).ok()` in the
    /// daemon). Invalid values are logged with the variable name and replaced by the default.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let d = Self::default();
        let lb_mode = match get("LOXILB_KV_LB_MODE") {
            Some(v) => LbMode::parse(&v).unwrap_or_else(|| {
                tracing::warn!(var = "LOXILB_KV_LB_MODE", value = %v, "unknown law; using hard");
                LbMode::Hard
            }),
            None if flag("LOXILB_KV_UNIFIED_MODE", get("LOXILB_KV_UNIFIED_MODE"))
                == Some(false) =>
            {
                LbMode::Off
            }
            None => LbMode::Hard,
        };
        Self {
            lb_mode,
            mean_load_factor: int_in(
                "LOXILB_KV_MEAN_LOAD_FACTOR",
                get("LOXILB_KV_MEAN_LOAD_FACTOR"),
                100,
                1000,
                175,
            ),
            load_penalty: int_in(
                "LOXILB_KV_LOAD_PENALTY",
                get("LOXILB_KV_LOAD_PENALTY"),
                1,
                100_000,
                32,
            ),
            spill_relief: flag("LOXILB_KV_SPILL_RELIEF", get("LOXILB_KV_SPILL_RELIEF")),
            cap_sum_milli: int_in(
                "LOXILB_KV_CAP_SUM_MILLI",
                get("LOXILB_KV_CAP_SUM_MILLI"),
                0,
                u64::MAX,
                0,
            ),
            coldstart_seed_n: int_in(
                "LOXILB_KV_COLDSTART_SEED_N",
                get("LOXILB_KV_COLDSTART_SEED_N"),
                0,
                u64::MAX,
                16,
            ),
            coldstart_min_blocks: int_in(
                "LOXILB_KV_COLDSTART_MIN_BLOCKS",
                get("LOXILB_KV_COLDSTART_MIN_BLOCKS"),
                0,
                u64::MAX,
                16,
            ),
            max_blocks: int_in(
                "LOXILB_KV_MAX_BLOCKS",
                get("LOXILB_KV_MAX_BLOCKS"),
                1000,
                100_000_000,
                1_000_000,
            ),
            min_match_tokens: int_in(
                "LLB_KV_MIN_MATCH_TOKENS",
                get("LLB_KV_MIN_MATCH_TOKENS"),
                0,
                4096,
                16,
            ),
            none_hash_seed: get("LLB_KV_NONE_HASH_SEED"),
            hash_debug: flag("LLB_KV_HASH_DEBUG", get("LLB_KV_HASH_DEBUG")).unwrap_or(false),
            predicted_ttl: Duration::from_millis(int_in(
                "LOXILB_KV_PREDICT_TTL_MS",
                get("LOXILB_KV_PREDICT_TTL_MS"),
                0,
                3_600_000,
                5000,
            )),
            lora_paths: get("LOXILB_KV_LORA_PATHS")
                .map(|v| parse_lora_paths(&v))
                .unwrap_or(d.lora_paths),
        }
    }

    /// Spill relief for a rule of `kv_exact_mode` (auto = on for mode 3).
    pub fn spill_relief_for(&self, kv_exact_mode: u8) -> bool {
        self.spill_relief.unwrap_or(kv_exact_mode == 3)
    }
}

fn parse_lora_paths(v: &str) -> HashMap<String, String> {
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
        assert_eq!(KvSettings::from_lookup(|_| None), KvSettings::default());
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
            ("LOXILB_KV_LORA_PATHS", "sql=/a/sql, x=/b"),
        ]
        .into();
        let s = KvSettings::from_lookup(|k| env.get(k).map(|v| v.to_string()));
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
        let s =
            KvSettings::from_lookup(|k| (k == "LOXILB_KV_UNIFIED_MODE").then(|| "0".to_string()));
        assert_eq!(s.lb_mode, LbMode::Off);
        let s = KvSettings::from_lookup(|k| match k {
            "LOXILB_KV_UNIFIED_MODE" => Some("0".into()),
            "LOXILB_KV_LB_MODE" => Some("bogus".into()),
            _ => None,
        });
        assert_eq!(s.lb_mode, LbMode::Hard);
    }
}
