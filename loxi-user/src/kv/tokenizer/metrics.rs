//! Tokenizer metrics: load failures and degraded state per model, template failures per model,
//! and the tokenization cache's hits and misses.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::RwLock;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label set `{model}`: a model name some rule configures (`model_name`), or [`OTHER_MODEL`]
/// for every other model a request names (a wildcard pool serves any model string a client
/// sends; labelling by it would let any client create series without bound).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    /// A rule's model name, or `other`.
    pub model: String,
}

/// The `model` label of requests for a model no rule names.
pub const OTHER_MODEL: &str = "other";

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
    /// The model names the rules configure: the only values the `model` label takes besides
    /// [`OTHER_MODEL`] (kept current by the KV wiring from every rule snapshot).
    pub rule_models: Arc<RwLock<HashSet<String>>>,
}

impl TokenizerMetrics {
    /// The label for a request naming `model`: `model` when a rule names it, else `other`.
    pub fn label(&self, model: &str) -> ModelLabel {
        if self.rule_models.read().contains(model) {
            ModelLabel::new(model)
        } else {
            ModelLabel::new(OTHER_MODEL)
        }
    }

    /// Replaces the set of rule model names (empty names, the wildcard, are skipped).
    pub fn set_rule_models<'a>(&self, models: impl IntoIterator<Item = &'a str>) {
        let set = models
            .into_iter()
            .filter(|m| !m.is_empty())
            .map(str::to_owned)
            .collect();
        *self.rule_models.write() = set;
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_rule_model_names_become_labels() {
        let m = TokenizerMetrics::default();
        m.set_rule_models(["Qwen/Qwen2.5-7B-Instruct", ""]);
        assert_eq!(
            m.label("Qwen/Qwen2.5-7B-Instruct").model,
            "Qwen/Qwen2.5-7B-Instruct"
        );
        assert_eq!(m.label("made-up-by-a-client-1").model, OTHER_MODEL);
        assert_eq!(m.label("").model, OTHER_MODEL);
    }
}
