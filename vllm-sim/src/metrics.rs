//! vLLM's Prometheus families (spec `kv-cache-aware-routing.txt` §6.4), labelled like vLLM
//! (`model_name`, `engine`). Times are simulated seconds.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Labels vLLM puts on its engine metrics.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct EngineLabels {
    /// Served model name.
    pub model_name: String,
    /// Engine index ("0").
    pub engine: String,
}

/// `vllm:prompt_tokens_by_source` labels (vLLM 0.32: `local_compute`, `local_cache_hit`,
/// `external_kv_transfer`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SourceLabels {
    /// Served model name.
    pub model_name: String,
    /// Engine index ("0").
    pub engine: String,
    /// Where the prompt tokens' KV came from.
    pub source: String,
}

/// `vllm:cache_config_info` labels (a subset of vLLM's, all strings like vLLM's).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CacheConfigLabels {
    /// Engine index.
    pub engine: String,
    /// Tokens per block.
    pub block_size: String,
    /// KV cache capacity in blocks (the capacity fingerprint routers read).
    pub num_gpu_blocks: String,
    /// Always "True" here.
    pub enable_prefix_caching: String,
    /// Block-hash algorithm.
    pub prefix_caching_hash_algo: String,
}

/// vLLM's TTFT buckets (seconds).
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's request-latency buckets (seconds).
const E2E_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

type F64Gauge = Gauge<f64, AtomicU64>;

/// Handles to the emulator's metric families.
#[derive(Debug, Clone)]
pub struct SimMetrics {
    labels: EngineLabels,
    waiting: Family<EngineLabels, Gauge>,
    running: Family<EngineLabels, Gauge>,
    kv_usage: Family<EngineLabels, F64Gauge>,
    prompt_tokens: Family<EngineLabels, Counter>,
    generation_tokens: Family<EngineLabels, Counter>,
    prefix_queries: Family<EngineLabels, Counter>,
    prefix_hits: Family<EngineLabels, Counter>,
    by_source: Family<SourceLabels, Counter>,
    requests_ok: Family<EngineLabels, Counter>,
    ttft: Family<EngineLabels, Histogram>,
    e2e: Family<EngineLabels, Histogram>,
}

impl SimMetrics {
    /// Registers every family in `reg` and sets `vllm:cache_config_info`.
    pub fn register(reg: &mut Registry, model: &str, cache: CacheConfigLabels) -> Self {
        let labels = EngineLabels {
            model_name: model.to_string(),
            engine: "0".into(),
        };
        let m = Self {
            labels,
            waiting: Family::default(),
            running: Family::default(),
            kv_usage: Family::default(),
            prompt_tokens: Family::default(),
            generation_tokens: Family::default(),
            prefix_queries: Family::default(),
            prefix_hits: Family::default(),
            by_source: Family::default(),
            requests_ok: Family::default(),
            ttft: Family::new_with_constructor(|| Histogram::new(TTFT_BUCKETS)),
            e2e: Family::new_with_constructor(|| Histogram::new(E2E_BUCKETS)),
        };
        reg.register(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled",
            m.waiting.clone(),
        );
        reg.register(
            "vllm:num_requests_running",
            "Requests in the running batch",
            m.running.clone(),
        );
        reg.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 = 100%",
            m.kv_usage.clone(),
        );
        reg.register(
            "vllm:prompt_tokens",
            "Prefill tokens processed",
            m.prompt_tokens.clone(),
        );
        reg.register(
            "vllm:generation_tokens",
            "Generation tokens processed",
            m.generation_tokens.clone(),
        );
        reg.register(
            "vllm:prefix_cache_queries",
            "Prefix-cache queries, in tokens",
            m.prefix_queries.clone(),
        );
        reg.register(
            "vllm:prefix_cache_hits",
            "Prefix-cache hits, in tokens",
            m.prefix_hits.clone(),
        );
        reg.register(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from (P/D: external_kv_transfer on a consumer)",
            m.by_source.clone(),
        );
        reg.register(
            "vllm:request_success",
            "Finished requests",
            m.requests_ok.clone(),
        );
        reg.register(
            "vllm:time_to_first_token_seconds",
            "Time to first token (simulated s)",
            m.ttft.clone(),
        );
        reg.register(
            "vllm:e2e_request_latency_seconds",
            "End-to-end latency (simulated s)",
            m.e2e.clone(),
        );
        let info: Family<CacheConfigLabels, Gauge> = Family::default();
        info.get_or_create(&cache).set(1);
        reg.register("vllm:cache_config_info", "Cache configuration", info);
        m.set_load(0, 0, 0.0);
        // Every series exists (at 0) from the start, as vLLM's labelled children do.
        m.admitted(0, 0);
        m.sources(0, 0, 0);
        m.step_tokens(0, 0);
        let _ = m.requests_ok.get_or_create(&m.labels);
        let _ = m.ttft.get_or_create(&m.labels);
        let _ = m.e2e.get_or_create(&m.labels);
        m
    }

    /// Sets the queue gauges and KV usage (0..1).
    pub fn set_load(&self, waiting: usize, running: usize, kv_usage: f64) {
        self.waiting.get_or_create(&self.labels).set(waiting as i64);
        self.running.get_or_create(&self.labels).set(running as i64);
        self.kv_usage.get_or_create(&self.labels).set(kv_usage);
    }

    /// A request was admitted: `queried` prompt tokens looked up, `hit` of them cached.
    pub fn admitted(&self, queried: usize, hit: usize) {
        self.prefix_queries
            .get_or_create(&self.labels)
            .inc_by(queried as u64);
        self.prefix_hits
            .get_or_create(&self.labels)
            .inc_by(hit as u64);
    }

    /// Prompt tokens of a newly admitted request by source: computed here, prefix-cache hits,
    /// and received from a remote prefill (P/D consumer).
    pub fn sources(&self, local_compute: usize, cache_hit: usize, external: usize) {
        for (source, n) in [
            ("local_compute", local_compute),
            ("local_cache_hit", cache_hit),
            ("external_kv_transfer", external),
        ] {
            self.by_source
                .get_or_create(&SourceLabels {
                    model_name: self.labels.model_name.clone(),
                    engine: self.labels.engine.clone(),
                    source: source.into(),
                })
                .inc_by(n as u64);
        }
    }

    /// Tokens processed in one step.
    pub fn step_tokens(&self, prompt: usize, generated: usize) {
        self.prompt_tokens
            .get_or_create(&self.labels)
            .inc_by(prompt as u64);
        self.generation_tokens
            .get_or_create(&self.labels)
            .inc_by(generated as u64);
    }

    /// First token produced `ttft` simulated seconds after arrival.
    pub fn first_token(&self, ttft: f64) {
        self.ttft.get_or_create(&self.labels).observe(ttft);
    }

    /// Request finished `latency` simulated seconds after arrival.
    pub fn finished(&self, latency: f64) {
        self.e2e.get_or_create(&self.labels).observe(latency);
        self.requests_ok.get_or_create(&self.labels).inc();
    }
}
