//! Command-line flags of `vllm-sim`, mirroring `vllm serve` where vLLM has the knob, plus the
//! timing-model knobs (defaults: "8B model on one H200", from
//! `../shared/calibration/h200-llama8b-prefill.json`).

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use serde::Deserialize;

/// Errors in the flags, each naming the flag and the bad value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `--kv-events-config` is not the JSON object vLLM accepts.
    #[error("--kv-events-config: {0}")]
    KvEventsJson(#[from] serde_json::Error),
    /// A numeric flag is out of range.
    #[error("{flag}: {value} is out of range ({allowed})")]
    Range {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: String,
        /// The allowed range.
        allowed: &'static str,
    },
    /// `--prefix-caching-hash-algo` names an algorithm we cannot reproduce.
    #[error("--prefix-caching-hash-algo: {0:?} is not supported (use sha256_cbor or xxhash_cbor)")]
    HashAlgo(String),
}

/// P/D disaggregation role (`--kv-role`), after vLLM's `kv_transfer_config.kv_role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum KvRole {
    /// Ordinary engine.
    #[default]
    None,
    /// Prefill engine: answers `do_remote_decode` requests with `kv_transfer_params`.
    Producer,
    /// Decode engine: takes transferred blocks without prefill work.
    Consumer,
    /// Both (vLLM's `kv_both`, how NixlConnector fleets usually run): a producer for requests
    /// with `do_remote_decode`, a consumer for requests with `do_remote_prefill`, an ordinary
    /// engine for the rest.
    Both,
}

impl KvRole {
    /// Answers `do_remote_decode` requests with transfer parameters.
    pub fn produces(self) -> bool {
        matches!(self, Self::Producer | Self::Both)
    }
    /// Takes `do_remote_prefill` requests' KV as transferred.
    pub fn consumes(self) -> bool {
        matches!(self, Self::Consumer | Self::Both)
    }
}

/// `vllm-sim` flags.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "vllm-sim",
    about = "Emulator of a vLLM OpenAI server for routing benchmarks"
)]
pub struct SimArgs {
    /// Served model name (what clients put in `model`; also the tokenizer directory name with
    /// `/` replaced by `__`).
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Tokenizer directory: `<dir>/<model with / → __>/tokenizer.json` (+ tokenizer_config.json).
    #[arg(long)]
    pub tokenizer_dir: Option<PathBuf>,
    /// HTTP listen host.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP listen port (0: the OS chooses; the chosen port is printed on the ready line).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Block-hash algorithm: `sha256_cbor` or `xxhash_cbor` (vLLM's pickle `sha256` is not
    /// reproducible outside Python).
    #[arg(long, default_value = "sha256_cbor")]
    pub prefix_caching_hash_algo: String,
    /// vLLM's KV-events config JSON; events are off when absent or `enable_kv_cache_events` false.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// Publish events in the legacy array shape `[tag, fields...]` instead of maps.
    #[arg(long)]
    pub kv_events_legacy_array: bool,
    /// Maximum sequences running at once (continuous batching width).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget per engine step (chunked prefill).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// KV cache size in blocks (block 0 is vLLM's null block, so one fewer is usable).
    #[arg(long, default_value_t = 4096, alias = "num-gpu-blocks-override")]
    pub num_gpu_blocks: usize,
    /// Prefill throughput in tokens per simulated second.
    #[arg(long, default_value_t = 33_000.0)]
    pub prefill_tokens_per_s: f64,
    /// Minimum duration of a step that prefills anything, simulated ms (the calibration's floor).
    #[arg(long, default_value_t = 31.0)]
    pub prefill_floor_ms: f64,
    /// Duration of a decode-only step, simulated ms.
    #[arg(long, default_value_t = 8.0)]
    pub decode_step_ms: f64,
    /// Real seconds per simulated second (0.01: 100× faster than real time).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// P/D role.
    #[arg(long, value_enum, default_value_t = KvRole::None)]
    pub kv_role: KvRole,
    /// `PYTHONHASHSEED` (NONE_HASH seed, vLLM 0.32 semantics: any value is used as a string).
    #[arg(long, env = "PYTHONHASHSEED")]
    pub python_hash_seed: Option<String>,
    /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`: `0` publishes raw digest bytes.
    #[arg(long, env = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", default_value = "1")]
    pub int_block_hashes: String,
}

/// vLLM's `KVEventsConfig` (the fields we use; others are accepted and ignored like vLLM's
/// pydantic model does not, but a benchmark should not fail on a knob it does not need).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct KvEventsConfig {
    /// Master switch.
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// Only `zmq` is supported.
    #[serde(default = "default_publisher")]
    pub publisher: String,
    /// PUB endpoint (`tcp://*:5557`).
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// Replay ROUTER endpoint, if any.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Topic frame.
    #[serde(default)]
    pub topic: String,
    /// Batches kept for replay.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
}

fn default_publisher() -> String {
    "zmq".into()
}
fn default_endpoint() -> String {
    "tcp://*:5557".into()
}
fn default_buffer_steps() -> usize {
    10_000
}

impl SimArgs {
    /// The parsed `--kv-events-config`, `None` when events are off.
    pub fn kv_events(&self) -> Result<Option<KvEventsConfig>, ConfigError> {
        let Some(raw) = &self.kv_events_config else {
            return Ok(None);
        };
        let cfg: KvEventsConfig = serde_json::from_str(raw)?;
        Ok(cfg.enable_kv_cache_events.then_some(cfg))
    }

    /// True when hashes go on the wire as u64 (the vLLM default).
    pub fn int_hashes(&self) -> bool {
        self.int_block_hashes.trim() != "0"
    }

    /// Checks ranges; returns the first bad flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let range = |flag, value: String, allowed| ConfigError::Range {
            flag,
            value,
            allowed,
        };
        if self.block_size == 0 {
            return Err(range("--block-size", "0".into(), ">= 1"));
        }
        if self.num_gpu_blocks < 2 {
            return Err(range(
                "--num-gpu-blocks",
                self.num_gpu_blocks.to_string(),
                ">= 2",
            ));
        }
        if self.max_num_seqs == 0 {
            return Err(range("--max-num-seqs", "0".into(), ">= 1"));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(range("--max-num-batched-tokens", "0".into(), ">= 1"));
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        let non_negative = |v: f64| v.is_finite() && v >= 0.0;
        if !positive(self.time_scale) {
            return Err(range("--time-scale", self.time_scale.to_string(), "> 0"));
        }
        if !positive(self.prefill_tokens_per_s) {
            let v = self.prefill_tokens_per_s.to_string();
            return Err(range("--prefill-tokens-per-s", v, "> 0"));
        }
        if !non_negative(self.prefill_floor_ms) {
            return Err(range(
                "--prefill-floor-ms",
                self.prefill_floor_ms.to_string(),
                ">= 0",
            ));
        }
        if !non_negative(self.decode_step_ms) {
            return Err(range(
                "--decode-step-ms",
                self.decode_step_ms.to_string(),
                ">= 0",
            ));
        }
        if !matches!(
            self.prefix_caching_hash_algo.as_str(),
            "sha256_cbor" | "xxhash_cbor"
        ) {
            return Err(ConfigError::HashAlgo(self.prefix_caching_hash_algo.clone()));
        }
        self.kv_events().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> SimArgs {
        let mut v = vec!["vllm-sim"];
        v.extend_from_slice(extra);
        SimArgs::parse_from(v)
    }

    #[test]
    fn kv_events_config_parses_vllm_json() {
        let a = args(&[
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv"}"#,
        ]);
        let cfg = a.kv_events().expect("valid json").expect("enabled");
        assert_eq!(cfg.endpoint, "tcp://*:5557");
        assert_eq!(cfg.replay_endpoint.as_deref(), Some("tcp://*:5558"));
        assert_eq!(cfg.topic, "kv");
    }

    #[test]
    fn disabled_events_config_means_no_publisher() {
        let a = args(&["--kv-events-config", r#"{"enable_kv_cache_events":false}"#]);
        assert_eq!(a.kv_events().expect("valid"), None);
    }

    #[test]
    fn validate_names_the_bad_flag() {
        let err = args(&["--block-size", "0"])
            .validate()
            .expect_err("must fail");
        assert!(err.to_string().contains("--block-size"), "{err}");
        let err = args(&["--prefix-caching-hash-algo", "sha256"])
            .validate()
            .expect_err("must fail");
        assert!(
            err.to_string().contains("--prefix-caching-hash-algo"),
            "{err}"
        );
    }
}
