//! LoxiLB's AI gateway request families, the ones its dashboards and tools query
//! (LoxiLB `pkg/loxinet` `ai_metrics.go`: names, label names and histogram buckets):
//!
//! | name | type | labels |
//! |---|---|---|
//! | `loxilb_ai_requests_total` | counter | `model`, `tenant`, `status` (the HTTP status the client got) |
//! | `loxilb_ai_request_duration_seconds` | histogram | `model`, `tenant` (head received → response body ends; LoxiLB's buckets, 1 ms … 300 s) |
//! | `loxilb_ai_active_streams` | gauge | `model` (SSE responses, `text/event-stream`, streaming now) |
//!
//! Label values are bounded, never taken from the client: `model` is the serving rule's
//! `model_name`, or `other` for the wildcard pool (`model_name` empty); `tenant` is empty (loxi
//! has no API-key tenants). Differences from LoxiLB, which counts a request only when its SSE
//! stream completes: loxi counts every response a backend answered, streamed or not, when
//! its body ends (a backend that fails mid-stream counts as `502`, as in
//! `loxilb_proxy_requests_total`), and every answer reporting an endpoint's failure
//! (`ProxyError::failed_endpoint`: a response timeout, a 502 after sending, a P/D leg's
//! failure). The gateway's own refusals (no route, no healthy backend, overload, admission)
//! are in `loxilb_proxy_requests_total{ep_idx="none"}` only.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The `model` label of a pool whose rule names no model (the wildcard pool).
pub const OTHER_MODEL: &str = "other";

/// LoxiLB's `loxilb_ai_request_duration_seconds` buckets, in seconds.
pub const DURATION_BUCKETS: [f64; 16] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// `model`, `tenant`, `status`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AiRequestLabels {
    /// The rule's model name or `other`.
    pub model: String,
    /// Always empty in loxi.
    pub tenant: String,
    /// HTTP status code, e.g. `200`.
    pub status: String,
}

/// `model`, `tenant`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AiModelTenantLabels {
    /// The rule's model name or `other`.
    pub model: String,
    /// Always empty in loxi.
    pub tenant: String,
}

/// `model`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AiModelLabels {
    /// The rule's model name or `other`.
    pub model: String,
}

type DurationFamily = Family<AiModelTenantLabels, Histogram, fn() -> Histogram>;

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

/// The `loxilb_ai_*` request families (see the module doc). Cheap to clone.
#[derive(Debug, Clone)]
pub struct AiMetrics {
    /// `loxilb_ai_requests_total`.
    pub requests: Family<AiRequestLabels, Counter>,
    /// `loxilb_ai_request_duration_seconds`.
    pub duration: DurationFamily,
    /// `loxilb_ai_active_streams`.
    pub active_streams: Family<AiModelLabels, Gauge>,
}

impl AiMetrics {
    /// Families not attached to a registry.
    pub fn unregistered() -> Self {
        Self {
            requests: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
            active_streams: Family::default(),
        }
    }

    /// Registers the families in `reg`.
    pub fn register(reg: &mut Registry) -> Self {
        let m = Self::unregistered();
        reg.register(
            "loxilb_ai_requests",
            "AI gateway requests by model, tenant and HTTP status (counted when the response ends)",
            m.requests.clone(),
        );
        reg.register(
            "loxilb_ai_request_duration_seconds",
            "AI gateway request duration in seconds, until the response body ends",
            m.duration.clone(),
        );
        reg.register(
            "loxilb_ai_active_streams",
            "AI streaming (SSE) responses in progress per model",
            m.active_streams.clone(),
        );
        m
    }
}

/// One pool's `loxilb_ai_*` handles, resolved once (the model label is fixed per pool).
#[derive(Debug)]
pub struct AiPoolMetrics {
    family: Family<AiRequestLabels, Counter>,
    model: String,
    duration: Histogram,
    /// `loxilb_ai_active_streams` of the pool's model.
    pub streams: Gauge,
    /// `loxilb_ai_requests_total` by status code, resolved on first use (a handful per pool).
    by_status: parking_lot::RwLock<Vec<(u16, Counter)>>,
}

impl AiPoolMetrics {
    /// Handles for a pool whose rule names `model_name` (empty: the wildcard pool, labelled
    /// [`OTHER_MODEL`]).
    pub fn new(m: &AiMetrics, model_name: &str) -> Self {
        let model = if model_name.is_empty() {
            OTHER_MODEL.to_owned()
        } else {
            model_name.to_owned()
        };
        let mt = AiModelTenantLabels {
            model: model.clone(),
            tenant: String::new(),
        };
        Self {
            family: m.requests.clone(),
            duration: m.duration.get_or_create(&mt).clone(),
            streams: m
                .active_streams
                .get_or_create(&AiModelLabels {
                    model: model.clone(),
                })
                .clone(),
            model,
            by_status: parking_lot::RwLock::new(Vec::new()),
        }
    }

    /// The `loxilb_ai_requests_total` counter of `status`.
    pub fn status(&self, status: u16) -> Counter {
        if let Some((_, c)) = self.by_status.read().iter().find(|(s, _)| *s == status) {
            return c.clone();
        }
        let mut cache = self.by_status.write();
        if let Some((_, c)) = cache.iter().find(|(s, _)| *s == status) {
            return c.clone();
        }
        let c = self
            .family
            .get_or_create(&AiRequestLabels {
                model: self.model.clone(),
                tenant: String::new(),
                status: status.to_string(),
            })
            .clone();
        cache.push((status, c.clone()));
        c
    }

    /// Counts one response with `status` that took `elapsed_secs` (the status counter and
    /// the duration histogram; the cached counter is incremented in place, no handle cloned).
    pub fn count(&self, status: u16, elapsed_secs: f64) {
        let cached = self
            .by_status
            .read()
            .iter()
            .find(|(s, _)| *s == status)
            .map(|(_, c)| c.inc())
            .is_some();
        if !cached {
            self.status(status).inc();
        }
        self.duration.observe(elapsed_secs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_rules_model_or_other_and_counters_are_shared() {
        let mut reg = Registry::default();
        let m = AiMetrics::register(&mut reg);
        let named = AiPoolMetrics::new(&m, "llama");
        let wildcard = AiPoolMetrics::new(&m, "");
        named.status(200).inc();
        named.status(200).inc();
        wildcard.status(503).inc();
        AiPoolMetrics::new(&m, "llama").status(200).inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).expect("encode");
        assert!(
            text.contains(
                "loxilb_ai_requests_total{model=\"llama\",tenant=\"\",status=\"200\"} 3\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "loxilb_ai_requests_total{model=\"other\",tenant=\"\",status=\"503\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.lines().any(
                |l| l.starts_with("loxilb_ai_request_duration_seconds_count{")
                    && l.contains("model=\"llama\"")
                    && l.ends_with(" 0")
            ),
            "{text}"
        );
        assert!(
            text.contains("loxilb_ai_active_streams{model=\"llama\"} 0\n"),
            "{text}"
        );
    }
}
