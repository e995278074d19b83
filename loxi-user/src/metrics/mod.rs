//! The Prometheus registry and its text encoding.
//!
//! One `prometheus_client` [`Registry`] is built at start by `app.rs`; every module registers its
//! own families through a `XxxMetrics::register(&mut Registry) -> Self` constructor (no globals),
//! then the API serves it at `GET /netlox/v1/metrics`: OpenMetrics text ([`encode`]) to clients
//! that ask for it in `Accept` (Prometheus does), the classic text format 0.0.4
//! ([`encode_text`]) otherwise (curl, `promtool check metrics`). Metric names follow the spec
//! (`loxilb_*`). The control plane's own families live in [`ControlMetrics`].

mod text;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub use text::openmetrics_to_text;

/// Content type of [`encode`]'s output (OpenMetrics text 1.0.0).
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Content type of [`encode_text`]'s output (Prometheus text exposition format 0.0.4).
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A fresh, empty registry (no prefix: every family carries its full `loxilb_*` name).
pub fn new_registry() -> Registry {
    Registry::default()
}

/// Encodes `registry` as OpenMetrics text, ending with `# EOF`.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

/// Encodes `registry` in the Prometheus text format 0.0.4 (see [`openmetrics_to_text`]).
pub fn encode_text(registry: &Registry) -> Result<String, std::fmt::Error> {
    encode(registry).map(|om| openmetrics_to_text(&om))
}

/// Labels of `loxilb_api_requests_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiRequestLabels {
    /// HTTP method (`GET`, `POST`, `DELETE`, ...).
    pub method: String,
    /// The matched route template (`/netlox/v1/config/loadbalancer`), or `unmatched`; never the
    /// raw URL, so the label set stays small.
    pub route: String,
    /// Response status code (`200`, `400`, ...).
    pub code: String,
}

/// The control plane's own metric families.
#[derive(Debug, Clone)]
pub struct ControlMetrics {
    /// `loxilb_lb_rules`: number of load-balancer rules in the store.
    pub lb_rules: Gauge,
    /// `loxilb_api_requests_total{method,route,code}`: REST API requests answered.
    pub api_requests: Family<ApiRequestLabels, Counter>,
}

impl ControlMetrics {
    /// Registers `loxilb_lb_rules` and `loxilb_api_requests` in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let lb_rules = Gauge::default();
        registry.register(
            "loxilb_lb_rules",
            "Load-balancer rules in the store",
            lb_rules.clone(),
        );
        let api_requests = Family::<ApiRequestLabels, Counter>::default();
        registry.register(
            "loxilb_api_requests",
            "REST API requests answered, by method, route template and status code",
            api_requests.clone(),
        );
        Self {
            lb_rules,
            api_requests,
        }
    }

    /// Counts one answered API request.
    pub fn api_request(&self, method: &str, route: &str, code: u16) {
        let labels = ApiRequestLabels {
            method: method.to_string(),
            route: route.to_string(),
            code: code.to_string(),
        };
        self.api_requests.get_or_create(&labels).inc();
    }
}

/// Test helper: `promtool check metrics` must accept `text` (promtool comes from Debian's
/// `prometheus` package, installed by `scripts/setup.sh`).
#[cfg(test)]
pub(crate) fn promtool_check(text: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool installed (scripts/setup.sh)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let res = child.wait_with_output().expect("promtool ran");
    let report =
        String::from_utf8_lossy(&res.stdout).to_string() + &String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "promtool: {report}\n{text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_families_encode_with_their_values() {
        let mut reg = new_registry();
        let m = ControlMetrics::register(&mut reg);
        m.lb_rules.set(3);
        m.api_request("POST", "/netlox/v1/config/loadbalancer", 400);
        m.api_request("POST", "/netlox/v1/config/loadbalancer", 400);
        let text = encode(&reg).expect("encode");
        assert!(text.contains("# TYPE loxilb_lb_rules gauge\n"), "{text}");
        assert!(text.contains("\nloxilb_lb_rules 3\n"), "{text}");
        assert!(
            text.contains(
                "loxilb_api_requests_total{method=\"POST\",route=\"/netlox/v1/config/loadbalancer\",code=\"400\"} 2\n"
            ),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
