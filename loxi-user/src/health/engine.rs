//! Engine-reported load: scrapes each KV-rule endpoint's `GET /metrics` (vLLM's Prometheus
//! text) every `LOXI_ENGINE_METRICS_INTERVAL_MS` and writes the engine's running+waiting count
//! into [`EndpointLoad::engine_requests`], which the KV laws blend with the gateway's own
//! in-flight count (see `EndpointLoad::effective_load`). The engines are the shared source of
//! truth, so several gateways in front of one fleet see each other's load without a protocol
//! of their own.
//!
//! Families read (contract: vLLM's `vllm/v1/metrics/loggers.py`; vllm-sim exports the same):
//! - `vllm:num_requests_running`, `vllm:num_requests_waiting` (gauges, requests; summed over
//!   samples, i.e. over an engine's data-parallel ranks),
//! - `vllm:kv_cache_usage_perc` (gauge, 0..1; the largest sample),
//! - `vllm:cache_config_info{num_gpu_blocks="N"}` (info gauge; the label, blocks).
//!
//! vLLM registers the request-stat families lazily (after its first request), and a backend
//! may serve no `/metrics` at all, so a family that is absent is *reported*, never read as 0:
//! `loxilb_engine_metric_missing{service,ep_idx,family}` is 1, `engine_requests` stays 0
//! (the gateway's own count decides), and the change is logged once per endpoint.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::board::HealthBoard;
use crate::routing::EndpointLoad;
use crate::rules::RuleSnapshot;
use crate::rules::model::authority;

/// `vllm:num_requests_running`.
pub const RUNNING: &str = "vllm:num_requests_running";
/// `vllm:num_requests_waiting`.
pub const WAITING: &str = "vllm:num_requests_waiting";
/// `vllm:kv_cache_usage_perc`.
pub const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
/// `vllm:cache_config_info`.
pub const CACHE_CONFIG: &str = "vllm:cache_config_info";
/// The families read, in report order.
pub const FAMILIES: [&str; 4] = [RUNNING, WAITING, KV_USAGE, CACHE_CONFIG];

/// Largest `/metrics` body read, bytes (vLLM's is a few hundred KiB with histograms).
const MAX_BODY: usize = 8 << 20;

/// What one engine's `/metrics` said; `None` = the family (or its label) was absent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineReport {
    /// `vllm:num_requests_running`, summed over samples.
    pub running: Option<f64>,
    /// `vllm:num_requests_waiting`, summed over samples.
    pub waiting: Option<f64>,
    /// `vllm:kv_cache_usage_perc`, 0..1, the largest sample.
    pub kv_usage: Option<f64>,
    /// `vllm:cache_config_info`'s `num_gpu_blocks` label.
    pub gpu_blocks: Option<u64>,
}

impl EngineReport {
    /// Running + waiting, when both families are present.
    pub fn requests(&self) -> Option<u64> {
        Some((self.running? + self.waiting?).max(0.0).round() as u64)
    }
    /// Is `family` (one of [`FAMILIES`]) absent?
    pub fn missing(&self, family: &str) -> bool {
        match family {
            RUNNING => self.running.is_none(),
            WAITING => self.waiting.is_none(),
            KV_USAGE => self.kv_usage.is_none(),
            _ => self.gpu_blocks.is_none(),
        }
    }
    /// The absent families, in [`FAMILIES`] order.
    pub fn missing_families(&self) -> Vec<&'static str> {
        FAMILIES.into_iter().filter(|f| self.missing(f)).collect()
    }
}

/// Parses Prometheus text exposition, reading only [`FAMILIES`]. Comment lines, other
/// families, malformed lines and non-finite values are skipped; a family with `# TYPE` but no
/// sample counts as absent.
pub fn parse(text: &str) -> EngineReport {
    let mut r = EngineReport::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = split_sample(line) else {
            continue;
        };
        match name {
            RUNNING => r.running = Some(r.running.unwrap_or(0.0) + value),
            WAITING => r.waiting = Some(r.waiting.unwrap_or(0.0) + value),
            KV_USAGE => r.kv_usage = Some(r.kv_usage.map_or(value, |v: f64| v.max(value))),
            CACHE_CONFIG => {
                if let Some(n) = label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok()) {
                    r.gpu_blocks = Some(n);
                }
            }
            _ => {}
        }
    }
    r
}

/// `name{labels} value [timestamp]` → (name, labels without braces, value).
fn split_sample(line: &str) -> Option<(&str, &str, f64)> {
    let (name, labels, rest) = match line.find(['{', ' ', '\t']) {
        Some(i) if line.as_bytes()[i] == b'{' => {
            let close = labels_end(&line[i + 1..])? + i + 1;
            (&line[..i], &line[i + 1..close], &line[close + 1..])
        }
        Some(i) => (&line[..i], "", &line[i..]),
        None => return None,
    };
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some((name, labels, value))
}

/// Index of the `}` closing a label set (quotes and escapes respected).
fn labels_end(s: &str) -> Option<usize> {
    let (mut quoted, mut escaped) = (false, false);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// The value of label `key` in `a="x",b="y"` (escapes `\"`, `\\`, `\n` decoded).
fn label(labels: &str, key: &str) -> Option<String> {
    let mut rest = labels;
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        let (k, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        if k.trim() == key {
            return Some(value);
        }
        rest = &after[end + 1..];
    }
}

/// One scraped endpoint's last result.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    authority: String,
    /// `None`: `/metrics` unreachable, non-2xx, or too large.
    report: Option<EngineReport>,
}

/// The last scrape of every KV-rule endpoint, by (service id, `ep_idx`); read by the metrics
/// collector at scrape time.
#[derive(Debug, Default)]
pub struct EngineBoard {
    entries: Mutex<BTreeMap<(u32, usize), Entry>>,
}

impl EngineBoard {
    /// An empty board.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
}

/// Scrapes every KV-rule endpoint each `interval` until `cancel`, writing
/// [`EndpointLoad::engine_requests`] and `engines`. `loads` is the board the proxy publishes
/// its pools' loads into (same `ep_idx` order as the rule's endpoints).
pub async fn run(
    interval: Duration,
    rules: watch::Receiver<Arc<RuleSnapshot>>,
    loads: Arc<HealthBoard>,
    engines: Arc<EngineBoard>,
    cancel: CancellationToken,
) {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(
        interval.clamp(Duration::from_millis(100), Duration::from_secs(2)),
    ));
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build(http);
    let timeout = interval.clamp(Duration::from_millis(200), Duration::from_secs(2));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let targets = targets(&rules.borrow(), &loads.snapshot());
        let round = futures::future::join_all(
            targets
                .iter()
                .map(|t| scrape(&client, &t.authority, timeout)),
        );
        let reports = tokio::select! {
            _ = cancel.cancelled() => return,
            r = round => r,
        };
        let mut next = BTreeMap::new();
        let mut entries = engines.entries.lock();
        for (t, report) in targets.into_iter().zip(reports) {
            let n = report
                .as_ref()
                .and_then(EngineReport::requests)
                .unwrap_or(0);
            t.load.engine_requests.store(n, Ordering::Relaxed);
            let entry = Entry {
                authority: t.authority,
                report,
            };
            log_change(entries.get(&t.key), &entry);
            next.insert(t.key, entry);
        }
        // Endpoints that left their rule (or rules that lost KV) drop out of the report.
        *entries = next;
    }
}

struct Target {
    key: (u32, usize),
    authority: String,
    load: Arc<EndpointLoad>,
}

/// Every endpoint of every KV rule whose loads the proxy has published.
fn targets(
    rules: &RuleSnapshot,
    loads: &std::collections::HashMap<u32, Vec<Arc<EndpointLoad>>>,
) -> Vec<Target> {
    let mut out = Vec::new();
    for rule in rules.rules.values() {
        if rule.spec.kv.is_none() {
            continue;
        }
        let eps = &rule.rule.endpoints;
        // The proxy publishes after it reconciles; skip a rule until both agree.
        let Some(ls) = loads.get(&rule.id).filter(|l| l.len() == eps.len()) else {
            continue;
        };
        for (ep, (e, load)) in eps.iter().zip(ls).enumerate() {
            let port = crate::routing::state::target_port(&rule.rule.service, e);
            out.push(Target {
                key: (rule.id, ep),
                authority: authority(&e.endpoint_ip, port),
                load: load.clone(),
            });
        }
    }
    out
}

/// `GET http://{authority}/metrics`, parsed; `None` when unreachable, non-2xx or too large.
async fn scrape(
    client: &Client<HttpConnector, Empty<Bytes>>,
    authority: &str,
    timeout: Duration,
) -> Option<EngineReport> {
    let uri: http::Uri = format!("http://{authority}/metrics").parse().ok()?;
    let fut = async {
        let resp = client.get(uri).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .ok()?
            .to_bytes();
        Some(parse(&String::from_utf8_lossy(&body)))
    };
    tokio::time::timeout(timeout, fut).await.ok().flatten()
}

/// Logs an endpoint's scrape state when it changes (first scrape included): unreachable, or
/// which families are missing, or complete again.
fn log_change(old: Option<&Entry>, new: &Entry) {
    let missing = |e: &Entry| e.report.as_ref().map(EngineReport::missing_families);
    let before = old.filter(|o| o.authority == new.authority).map(missing);
    let now = missing(new);
    if before.as_ref() == Some(&now) {
        return;
    }
    match now {
        None => tracing::warn!(
            endpoint = %new.authority,
            "engine /metrics unreachable or not 2xx; its engine-reported load is unknown (the gateway's own count is used)"
        ),
        Some(m) if m.is_empty() => tracing::info!(
            endpoint = %new.authority,
            "engine /metrics reports every family read; engine-reported load in use"
        ),
        Some(m) => tracing::warn!(
            endpoint = %new.authority,
            missing = ?m,
            "engine /metrics lacks families (vLLM registers request stats after its first request); missing ones are not read as 0"
        ),
    }
}

/// Metric names (without suffix).
pub const METRICS_UP: &str = "loxilb_engine_metrics_up";
/// Per-family missing flag.
pub const METRIC_MISSING: &str = "loxilb_engine_metric_missing";
/// Engine-reported requests by state.
pub const ENGINE_REQUESTS: &str = "loxilb_engine_requests";
/// Engine-reported KV-cache usage.
pub const ENGINE_KV_USAGE: &str = "loxilb_engine_kv_cache_usage_ratio";
/// Engine-reported KV-cache size.
pub const ENGINE_GPU_BLOCKS: &str = "loxilb_engine_gpu_blocks";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EpLabels {
    service: String,
    ep_idx: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FamilyLabels {
    service: String,
    ep_idx: String,
    family: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    service: String,
    ep_idx: String,
    state: String,
}

/// Encodes the [`EngineBoard`] at scrape time:
/// - `loxilb_engine_metrics_up{service,ep_idx}`: 1 when the last `/metrics` answered 2xx;
/// - `loxilb_engine_metric_missing{service,ep_idx,family}`: 1 when `family` was absent from the
///   last scrape (every family while the endpoint is down), 0 when read;
/// - `loxilb_engine_requests{service,ep_idx,state="running"|"waiting"}`,
///   `loxilb_engine_kv_cache_usage_ratio{service,ep_idx}` (0..1) and
///   `loxilb_engine_gpu_blocks{service,ep_idx}` (blocks): the values read, only when present.
pub struct EngineCollector(Arc<EngineBoard>);

impl std::fmt::Debug for EngineCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineCollector")
    }
}

impl EngineCollector {
    /// Registers the families of `board` in `registry`.
    pub fn register(registry: &mut Registry, board: Arc<EngineBoard>) {
        registry.register_collector(Box::new(Self(board)));
    }
}

impl Collector for EngineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let entries = self.0.entries.lock().clone();
        let ep = |k: &(u32, usize)| EpLabels {
            service: k.0.to_string(),
            ep_idx: k.1.to_string(),
        };
        let kind = ConstGauge::new(0i64).metric_type();
        let mut f = encoder.encode_descriptor(
            METRICS_UP,
            "1 when the endpoint's engine /metrics answered 2xx at the last scrape",
            None,
            kind,
        )?;
        for (k, e) in &entries {
            ConstGauge::new(i64::from(e.report.is_some())).encode(f.encode_family(&ep(k))?)?;
        }
        let mut f = encoder.encode_descriptor(
            METRIC_MISSING,
            "1 when the engine family was absent from the last scrape (not read as 0)",
            None,
            kind,
        )?;
        for (k, e) in &entries {
            for family in FAMILIES {
                let labels = FamilyLabels {
                    service: k.0.to_string(),
                    ep_idx: k.1.to_string(),
                    family: family.to_string(),
                };
                let missing = e.report.as_ref().is_none_or(|r| r.missing(family));
                ConstGauge::new(i64::from(missing)).encode(f.encode_family(&labels)?)?;
            }
        }
        let mut f = encoder.encode_descriptor(
            ENGINE_REQUESTS,
            "Requests the engine reports, by state (running, waiting)",
            None,
            kind,
        )?;
        for (k, e) in &entries {
            let Some(r) = &e.report else { continue };
            for (state, v) in [("running", r.running), ("waiting", r.waiting)] {
                if let Some(v) = v {
                    let labels = StateLabels {
                        service: k.0.to_string(),
                        ep_idx: k.1.to_string(),
                        state: state.into(),
                    };
                    ConstGauge::new(v).encode(f.encode_family(&labels)?)?;
                }
            }
        }
        let mut f = encoder.encode_descriptor(
            ENGINE_KV_USAGE,
            "KV-cache usage the engine reports, 1 = full",
            None,
            kind,
        )?;
        for (k, e) in &entries {
            if let Some(v) = e.report.as_ref().and_then(|r| r.kv_usage) {
                ConstGauge::new(v).encode(f.encode_family(&ep(k))?)?;
            }
        }
        let mut f = encoder.encode_descriptor(
            ENGINE_GPU_BLOCKS,
            "KV-cache blocks the engine reports (cache_config_info num_gpu_blocks)",
            None,
            kind,
        )?;
        for (k, e) in &entries {
            if let Some(v) = e.report.as_ref().and_then(|r| r.gpu_blocks) {
                ConstGauge::new(v as i64).encode(f.encode_family(&ep(k))?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 50.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",reason="x"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="au}to\"x",num_gpu_blocks="30",prefix="a=b"} 1.0
"#;

    #[test]
    fn reads_the_four_families_with_labels_and_sums_ranks() {
        let r = parse(VLLM);
        assert_eq!(
            r,
            EngineReport {
                running: Some(4.0),
                waiting: Some(50.0),
                kv_usage: Some(0.5),
                gpu_blocks: Some(30),
            }
        );
        assert_eq!(r.requests(), Some(54));
        assert!(r.missing_families().is_empty());
    }

    #[test]
    fn lazily_registered_families_are_missing_not_zero() {
        // vLLM before its first request: TYPE lines without samples, config info present.
        let text = "# TYPE vllm:num_requests_running gauge\n# TYPE vllm:num_requests_waiting gauge\n\
                    vllm:cache_config_info{num_gpu_blocks=\"8\"} 1\nvllm:kv_cache_usage_perc 0\n";
        let r = parse(text);
        assert_eq!(r.requests(), None);
        assert_eq!(r.missing_families(), vec![RUNNING, WAITING]);
        assert_eq!((r.kv_usage, r.gpu_blocks), (Some(0.0), Some(8)));
        let only_running = parse("vllm:num_requests_running 2\n");
        assert_eq!(only_running.requests(), None);
        assert_eq!(parse("").missing_families(), FAMILIES.to_vec());
    }

    #[test]
    fn skips_prefix_lookalikes_malformed_lines_and_non_finite_values() {
        let text = "vllm:num_requests_waiting_total 9\nvllm:num_requests_running{a=\"1\" 4\n\
                    vllm:num_requests_running NaN\nvllm:num_requests_waiting abc\n\
                    vllm:num_requests_running\t2 1700000000\nvllm:num_requests_waiting 1e1\n";
        let r = parse(text);
        assert_eq!((r.running, r.waiting), (Some(2.0), Some(10.0)));
    }

    #[test]
    fn collector_reports_missing_families_and_values() {
        let board = EngineBoard::new();
        let mut reg = Registry::default();
        EngineCollector::register(&mut reg, board.clone());
        board.entries.lock().extend([
            (
                (7, 0),
                Entry {
                    authority: "127.0.0.1:1".into(),
                    report: Some(parse(VLLM)),
                },
            ),
            (
                (7, 1),
                Entry {
                    authority: "127.0.0.1:2".into(),
                    report: None,
                },
            ),
        ]);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).expect("encode");
        for line in [
            "loxilb_engine_metrics_up{service=\"7\",ep_idx=\"0\"} 1\n",
            "loxilb_engine_metrics_up{service=\"7\",ep_idx=\"1\"} 0\n",
            "loxilb_engine_metric_missing{service=\"7\",ep_idx=\"0\",family=\"vllm:num_requests_waiting\"} 0\n",
            "loxilb_engine_metric_missing{service=\"7\",ep_idx=\"1\",family=\"vllm:num_requests_waiting\"} 1\n",
            "loxilb_engine_requests{service=\"7\",ep_idx=\"0\",state=\"waiting\"} 50.0\n",
            "loxilb_engine_kv_cache_usage_ratio{service=\"7\",ep_idx=\"0\"} 0.5\n",
            "loxilb_engine_gpu_blocks{service=\"7\",ep_idx=\"0\"} 30\n",
        ] {
            assert!(out.contains(line), "{line} not in {out}");
        }
        assert!(!out.contains("ep_idx=\"1\",state="), "{out}");
    }
}
