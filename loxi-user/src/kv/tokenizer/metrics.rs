//! Tokenizer metrics: load failures and degraded state per model, template failures per model,
//! and the tokenization cache's hits and misses.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label set `{model}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    /// The model id as requested.
    pub model: String,
}

impl ModelLabel {
    /// The label for `model`.
    pub fn new(model: &str) -> Self {
        ModelLabel {
            model: model.to_owned(),
        }
    }
}

/// Handles to the tokenizer metrics (cheap to clone).
#[derive(Debug, Clone, Default)]
pub struct TokenizerMetrics {
    /// `loxilb_kv_tokenizer_degraded{model}`: 1 while the model has no usable tokenizer (KV
    /// routing for it falls through to the rule's selector), 0 once one loaded.
    pub degraded: Family<ModelLabel, Gauge>,
    /// `loxilb_kv_tokenizer_load_failures_total{model}`: failed load attempts (at most one per
    /// retry interval per model).
    pub load_failures: Family<ModelLabel, Counter>,
    /// `loxilb_kv_tokenizer_template_errors_total{model}`: chat templates that failed to render.
    pub template_errors: Family<ModelLabel, Counter>,
    /// `loxilb_kv_tokenize_cache_hits_total`: tokenizations served from the cache.
    pub cache_hits: Counter,
    /// `loxilb_kv_tokenize_cache_misses_total`: tokenizations computed.
    pub cache_misses: Counter,
}

impl TokenizerMetrics {
    /// Registers every tokenizer metric in `registry` and returns the handles.
    pub fn register(registry: &mut Registry) -> Self {
        let m = TokenizerMetrics::default();
        registry.register(
            "loxilb_kv_tokenizer_degraded",
            "1 while KV routing for the model is degraded because its tokenizer is missing or failed to load",
            m.degraded.clone(),
        );
        registry.register(
            "loxilb_kv_tokenizer_load_failures",
            "Failed tokenizer load attempts per model",
            m.load_failures.clone(),
        );
        registry.register(
            "loxilb_kv_tokenizer_template_errors",
            "Chat templates that failed to render, per model",
            m.template_errors.clone(),
        );
        registry.register(
            "loxilb_kv_tokenize_cache_hits",
            "Tokenizations served from the recent-tokenization cache",
            m.cache_hits.clone(),
        );
        registry.register(
            "loxilb_kv_tokenize_cache_misses",
            "Tokenizations computed (not in the cache)",
            m.cache_misses.clone(),
        );
        m
    }
}
