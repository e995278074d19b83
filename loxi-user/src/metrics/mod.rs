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

/// Labels of `loxilb_pd_ep_info`: LoxiLB's `{service, ep_idx, ep}` (ep = the endpoint's IP)
/// plus loxi's `ip` and `port`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EpInfoLabels {
    /// Rule id (the `service` label of every per-endpoint family).
    pub service: String,
    /// Endpoint index in the rule (the user's order).
    pub ep_idx: String,
    /// The endpoint's IP (LoxiLB's join label: `* on(ep_idx) group_left(ep) loxilb_pd_ep_info`).
    pub ep: String,
    /// The endpoint's IP.
    pub ip: String,
    /// The endpoint's target port.
    pub port: String,
}

/// The control plane's own metric families.
#[derive(Debug, Clone)]
pub struct ControlMetrics {
    /// `loxilb_lb_rules`: number of load-balancer rules in the store.
    pub lb_rules: Gauge,
    /// `loxilb_api_requests_total{method,route,code}`: REST API requests answered.
    pub api_requests: Family<ApiRequestLabels, Counter>,
    /// `loxilb_pd_ep_info{service,ep_idx,ep,ip,port}` = 1 for every endpoint of every rule:
    /// joins the `ep_idx` of the per-endpoint families to an address (set at scrape time).
    pub ep_info: Family<EpInfoLabels, Gauge>,
    /// `loxilb_healthy_endpoints`: endpoints (of all rules) currently healthy.
    pub healthy_endpoints: Gauge,
    /// `loxilb_unhealthy_endpoints`: endpoints currently marked down.
    pub unhealthy_endpoints: Gauge,
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
        let ep_info = Family::<EpInfoLabels, Gauge>::default();
        registry.register(
            "loxilb_pd_ep_info",
            "Endpoint identity: maps ep_idx (the label of the per-endpoint families) to the endpoint address; always 1",
            ep_info.clone(),
        );
        let healthy_endpoints = Gauge::default();
        registry.register(
            "loxilb_healthy_endpoints",
            "Number of healthy endpoints (all rules)",
            healthy_endpoints.clone(),
        );
        let unhealthy_endpoints = Gauge::default();
        registry.register(
            "loxilb_unhealthy_endpoints",
            "Number of unhealthy endpoints (all rules)",
            unhealthy_endpoints.clone(),
        );
        Self {
            lb_rules,
            api_requests,
            ep_info,
            healthy_endpoints,
            unhealthy_endpoints,
        }
    }

    /// Sets `loxilb_pd_ep_info` and the healthy/unhealthy gauges from `endpoints`
    /// (`(service, ep_idx, ip, port, healthy)` of every endpoint of every rule); series of
    /// endpoints no longer listed are dropped.
    pub fn set_endpoints<'a>(
        &self,
        endpoints: impl IntoIterator<Item = (u32, usize, &'a str, u16, bool)>,
    ) {
        self.ep_info.clear();
        let (mut up, mut down) = (0i64, 0i64);
        for (service, ep_idx, ip, port, healthy) in endpoints {
            self.ep_info
                .get_or_create(&EpInfoLabels {
                    service: service.to_string(),
                    ep_idx: ep_idx.to_string(),
                    ep: ip.to_string(),
                    ip: ip.to_string(),
                    port: port.to_string(),
                })
                .set(1);
            if healthy {
                up += 1;
            } else {
                down += 1;
            }
        }
        self.healthy_endpoints.set(up);
        self.unhealthy_endpoints.set(down);
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
    fn endpoint_info_and_health_gauges_follow_the_rules_and_pass_promtool() {
        let mut reg = new_registry();
        let m = ControlMetrics::register(&mut reg);
        m.set_endpoints([
            (3, 0, "10.0.0.2", 8000, true),
            (3, 1, "10.0.0.1", 8001, false),
        ]);
        let text = encode_text(&reg).expect("encode");
        assert!(
            text.contains("loxilb_pd_ep_info{service=\"3\",ep_idx=\"1\",ep=\"10.0.0.1\",ip=\"10.0.0.1\",port=\"8001\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("loxilb_healthy_endpoints 1\n"), "{text}");
        assert!(text.contains("loxilb_unhealthy_endpoints 1\n"), "{text}");
        promtool_check(&text);
        m.set_endpoints([(4, 0, "10.0.0.9", 80, true)]);
        let text = encode_text(&reg).expect("encode");
        assert!(
            !text.contains("service=\"3\""),
            "deleted rules' series go: {text}"
        );
        assert!(text.contains("loxilb_unhealthy_endpoints 0\n"), "{text}");
    }

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
