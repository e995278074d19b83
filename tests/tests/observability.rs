//! Observability end to end, with the real `loxilb` binary:
//! - the Grafana dashboard (`deploy/grafana/loxi-dashboard.json`) queries only metric names that
//!   a live daemon with a KV rule under traffic exports (no dead panel);
//! - OpenTelemetry traces: an in-process OTLP/HTTP receiver (protobuf decoded with
//!   `opentelemetry-proto`) gets one server span per proxied request with the routing decision,
//!   child spans for tokenize / hash / score and one client span per upstream attempt, and the
//!   backend receives a W3C `traceparent` naming the attempt's span;
//! - `--log-format json` writes one JSON object per line.

use std::collections::{BTreeSet, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use loxi_tests::kv_pub::Publisher;
use loxi_tests::shared_dir;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::Span;
use parking_lot::Mutex;
use prost::Message as _;
use serde_json::{Value, json};

fn capture() -> Value {
    let p = shared_dir().join("golden/vllm_kv_events_capture.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("capture json")
}

fn stage_tokenizer(dir: &std::path::Path) {
    let src = shared_dir().join("golden/tiny-model");
    let dst = dir.join("tiny");
    std::fs::create_dir_all(&dst).expect("mkdir");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy tokenizer file");
    }
}

/// A KV fleet: daemon (tiny tokenizer, seed 0, predictions off), backends on 127.0.0.1 and
/// 127.0.0.2 with a publisher each, and rule 1 (`kvExactMode: 3`, sel rr) over them.
struct KvFleet {
    d: Daemon,
    b: [Backend; 2],
    pubs: [Publisher; 2],
    vip: SocketAddr,
    _tok: tempfile::TempDir,
}

impl KvFleet {
    /// A P/D rule on `port`: backend 0 the prefill, backend 1 the decode.
    fn pd_rule(&self, port: u16) -> Value {
        let ep = |i: usize, role: u8| {
            json!({"endpointIP": self.b[i].addr.ip().to_string(),
                "targetPort": self.b[i].port(), "ep_role": role})
        };
        json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                "mode": 4, "sel": 0, "pd_disagg_mode": true},
            "endpoints": [ep(0, 1), ep(1, 2)]
        })
    }

    async fn start(env: &[(&str, &str)]) -> Self {
        let tok = tempfile::tempdir().expect("tmp");
        stage_tokenizer(tok.path());
        let mut opts = DaemonOpts {
            tokenizer_dir: Some(tok.path().to_path_buf()),
            ..Default::default()
        }
        .env("LLB_KV_NONE_HASH_SEED", "0")
        .env("LOXI_KV_PREDICT_TTL_MS", "0");
        for (k, v) in env {
            opts = opts.env(k, v);
        }
        let d = Daemon::start(opts).await;
        let b = [
            Backend::start("b0").await,
            Backend::bind("b1", SocketAddr::from(([127, 0, 0, 2], 0)))
                .await
                .expect("bind 127.0.0.2"),
        ];
        let zmq_port = free_port();
        let mut pubs = [
            Publisher::start("127.0.0.1", zmq_port).await,
            Publisher::start("127.0.0.2", zmq_port).await,
        ];
        let vip_port = free_port();
        let rule = json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": vip_port, "protocol": "tcp",
                "mode": 4, "sel": 0, "kvExactMode": 3, "kvBlockSize": 32,
                "kvHashAlgo": "sha256_cbor", "kvZmqPort": zmq_port},
            "endpoints": [
                {"endpointIP": "127.0.0.1", "targetPort": b[0].port()},
                {"endpointIP": "127.0.0.2", "targetPort": b[1].port()}
            ]
        });
        let (code, body) = d.post_rule(&rule).await;
        assert_eq!(code, 200, "rule rejected: {body}");
        for p in pubs.iter_mut() {
            p.wait_for("subscribed").await;
        }
        Self {
            d,
            b,
            pubs,
            vip: SocketAddr::from(([127, 0, 0, 1], vip_port)),
            _tok: tok,
        }
    }

    /// The capture's first request (cold), then its engine's `BlockStored` on the endpoint it
    /// went to; returns that endpoint.
    async fn warm_up(&mut self, cap: &Value) -> usize {
        let prompt = cap["requests"][0]["request_body"]["prompt"]
            .as_str()
            .expect("prompt 0");
        let (code, ep) = complete(self.vip, prompt, None).await;
        assert_eq!(code, 200);
        let ep = ep.expect("x-loxilb-endpoint");
        self.pubs[ep].raw(&cap["frames"][0]["parts_hex"]).await;
        wait_blocks(&self.d, ep, 7).await;
        ep
    }
}

async fn complete(
    vip: SocketAddr,
    prompt: &str,
    traceparent: Option<&str>,
) -> (u16, Option<usize>) {
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 2});
    let headers: Vec<(&str, &str)> = traceparent
        .map(|tp| ("traceparent", tp))
        .into_iter()
        .collect();
    loxi_tests::kv::completion_with(vip, &body, &headers).await
}

/// Waits (5 s) until the fullproxy listener of a just-stored rule accepts connections.
async fn wait_listening(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(Instant::now() < deadline, "no listener on {addr}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_blocks(d: &Daemon, ep: usize, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let path = format!("/netlox/v1/config/ai/kv/inventory?service_id=1&ep_idx={ep}");
        let (code, body) = d.get(&path).await.expect("inventory");
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        if code == 200 && v["endpoints"][0]["blockCount"].as_u64() == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "inventory of ep {ep}: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---- dashboard ---------------------------------------------------------------------------------

/// Every `loxilb_*` metric name in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let starts = (b[i].is_ascii_alphabetic() || b[i] == b'_')
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'));
        if !starts {
            i += 1;
            continue;
        }
        let j = (i..b.len())
            .find(|&j| !(b[j].is_ascii_alphanumeric() || b[j] == b'_' || b[j] == b':'))
            .unwrap_or(b.len());
        let word = &expr[i..j];
        if word.starts_with("loxilb_") {
            out.insert(word.to_string());
        }
        i = j;
    }
    out
}

/// Every `expr` of every panel (rows included), with its panel title and legend format.
fn panel_queries(dash: &Value) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    let mut stack: Vec<&Value> = dash["panels"].as_array().expect("panels").iter().collect();
    while let Some(p) = stack.pop() {
        if let Some(inner) = p["panels"].as_array() {
            stack.extend(inner);
        }
        if p["type"] == "row" {
            continue;
        }
        let targets = p["targets"].as_array().expect("a panel has targets");
        assert!(!targets.is_empty(), "panel {} queries nothing", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().expect("target expr");
            out.push((
                p["title"].as_str().unwrap_or("?").to_string(),
                expr.to_string(),
                t["legendFormat"].as_str().unwrap_or_default().to_string(),
            ));
        }
    }
    out
}

/// Names a Prometheus text scrape declares (`# TYPE`), with a histogram's series suffixes.
fn declared_names(scrape: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for l in scrape.lines() {
        let mut w = l.split_whitespace();
        if let (Some("#"), Some("TYPE"), Some(name), Some(kind)) =
            (w.next(), w.next(), w.next(), w.next())
        {
            if kind == "histogram" {
                for suffix in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{name}{suffix}"));
                }
            } else {
                out.insert(name.to_string());
            }
        }
    }
    out
}

/// The labels of every `by (...)` clause of a PromQL expression.
fn by_labels(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("by (") {
        rest = &rest[i + 4..];
        let end = rest.find(')').unwrap_or(rest.len());
        out.extend(
            rest[..end]
                .split(',')
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty()),
        );
    }
    out
}

/// The `{{label}}` names of a Grafana legend format.
fn legend_labels(legend: &str) -> BTreeSet<String> {
    legend
        .split("{{")
        .skip(1)
        .filter_map(|p| p.split_once("}}").map(|(l, _)| l.trim().to_string()))
        .collect()
}

/// The label names the samples of metric `name` carry in a Prometheus text scrape (empty
/// when it has none).
fn sample_labels(scrape: &str, name: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for l in scrape.lines() {
        let Some(rest) = l.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let labels = rest.split('}').next().unwrap_or_default();
        out.extend(labels.split("\",").filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, _)| k.trim_start_matches(',').to_string())
        }));
    }
    out
}

#[test]
fn label_extraction_reads_promql_legends_and_scrapes() {
    let e = "sum by (service, ep) (x) / sum by (le, stage) (y)";
    assert_eq!(
        by_labels(e).into_iter().collect::<Vec<_>>(),
        ["ep", "le", "service", "stage"]
    );
    assert_eq!(
        legend_labels("svc {{service}} ep {{ ep_idx }}")
            .into_iter()
            .collect::<Vec<_>>(),
        ["ep_idx", "service"]
    );
    let scrape = "loxilb_a{service=\"1\",ep=\"0,1\"} 1\nloxilb_ab{x=\"1\"} 2\n";
    assert_eq!(
        sample_labels(scrape, "loxilb_a")
            .into_iter()
            .collect::<Vec<_>>(),
        ["ep", "service"]
    );
}

/// Names of the sample lines of a Prometheus text scrape.
fn sample_names(scrape: &str) -> BTreeSet<String> {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

#[test]
fn metric_name_extraction_reads_promql() {
    let e = "sum by (le, stage) (rate(loxilb_kv_routing_stage_seconds_bucket{service=~\"$service\"}[$__rate_interval])) / clamp_min(loxilb_lb_rules, 1e-9)";
    assert_eq!(
        metric_names(e).into_iter().collect::<Vec<_>>(),
        vec!["loxilb_kv_routing_stage_seconds_bucket", "loxilb_lb_rules"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_panel_queries_metrics_a_live_daemon_exports() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana/loxi-dashboard.json"
    );
    let dash: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("json");
    let queries = panel_queries(&dash);
    assert!(queries.len() >= 20, "{} queries", queries.len());

    let cap = capture();
    let mut f = KvFleet::start(&[]).await;
    let ep = f.warm_up(&cap).await;
    // Traffic: warm hits, a short prompt (a miss with a reason), a request to a dead endpoint
    // on a second rule (a connect failure and a retry), a 400 from the API.
    let warm = cap["requests"][1]["request_body"]["prompt"]
        .as_str()
        .expect("prompt 1");
    for _ in 0..5 {
        assert_eq!(complete(f.vip, warm, None).await, (200, Some(ep)));
    }
    assert_eq!(complete(f.vip, "hi", None).await.0, 200);
    let dead = free_port();
    let vip2 = free_port();
    let rule2 = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": vip2, "protocol": "tcp", "mode": 4, "sel": 0},
        "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": dead},
                      {"endpointIP": "127.0.0.1", "targetPort": f.b[0].port()}]
    });
    assert_eq!(f.d.post_rule(&rule2).await.0, 200);
    wait_listening(SocketAddr::from(([127, 0, 0, 1], vip2))).await;
    for _ in 0..2 {
        let (code, _) = complete(SocketAddr::from(([127, 0, 0, 1], vip2)), "x", None).await;
        assert_eq!(code, 200);
    }
    assert_eq!(f.d.post_rule_raw("{\"nope\":1}").await.0, 400);
    // A P/D request (prefill on backend 0, decode on backend 1).
    let vip3 = free_port();
    let rule3 = f.pd_rule(vip3);
    assert_eq!(f.d.post_rule(&rule3).await.0, 200);
    wait_listening(SocketAddr::from(([127, 0, 0, 1], vip3))).await;
    let (code, _) = complete(SocketAddr::from(([127, 0, 0, 1], vip3)), "pd", None).await;
    assert_eq!(code, 200);

    let scrape = f.d.metrics_text().await;
    // Every name a panel queries is a family the daemon declares (a misspelled or removed
    // metric fails here). Counters of events this traffic cannot cause (L4 packets without an
    // XDP interface, replays, reconnects, template errors, ...) are declared without samples.
    let have = declared_names(&scrape);
    let sampled = sample_names(&scrape);
    let mut dead_panels = Vec::new();
    let mut queried = BTreeSet::new();
    let mut bad_labels = Vec::new();
    for (title, expr, legend) in &queries {
        let names = metric_names(expr);
        assert!(
            !names.is_empty(),
            "panel {title:?} queries no loxilb metric: {expr}"
        );
        // Grouping and legend labels must be labels the queried series carry (a wrong one
        // folds every series into one unlabelled line), checked where the traffic gave the
        // metrics samples.
        let carried: BTreeSet<String> = names
            .iter()
            .flat_map(|n| sample_labels(&scrape, n))
            .collect();
        let by = by_labels(expr);
        if !carried.is_empty() {
            for l in by.iter().filter(|l| !carried.contains(*l)) {
                bad_labels.push(format!(
                    "{title}: by {l} in {expr} (series carry {carried:?})"
                ));
            }
        }
        for l in legend_labels(legend) {
            let known = if by.is_empty() { &carried } else { &by };
            if !known.is_empty() && !known.contains(&l) {
                bad_labels.push(format!(
                    "{title}: legend {{{{{l}}}}} in {legend:?} ({expr})"
                ));
            }
        }
        for n in names {
            if !have.contains(&n) {
                dead_panels.push(format!("{title}: {n}"));
            }
            queried.insert(n);
        }
    }
    assert!(
        dead_panels.is_empty(),
        "panels query metrics the daemon does not export: {dead_panels:#?}\n--- scrape ---\n{scrape}"
    );
    assert!(
        bad_labels.is_empty(),
        "panels group or label by labels their series do not have: {bad_labels:#?}"
    );
    // The panel list, by family; those this traffic exercises have live samples.
    for must in [
        "loxilb_l4_endpoint_packets_total",
        "loxilb_l4_events_total",
        "loxilb_kv_parity_ok",
        "loxilb_pd_admission_shed_total",
        "loxilb_tls_cert_expiry_timestamp_seconds",
        "loxilb_proxy_tls_handshake_failures_total",
    ] {
        assert!(queried.contains(must), "no panel shows {must}");
    }
    for must in [
        "loxilb_proxy_requests_total",
        "loxilb_proxy_request_duration_seconds_bucket",
        "loxilb_pd_kv_tier15_hits_total",
        "loxilb_pd_kv_tier15_miss_reason_total",
        "loxilb_pd_kv_tier15_spills_total",
        "loxilb_pd_kv_tier15_cold_seeds_total",
        "loxilb_kv_subscriber_connected",
        "loxilb_pd_kv_blocks",
        "loxilb_proxy_endpoint_healthy",
        "loxilb_kv_routing_stage_seconds_bucket",
        "loxilb_proxy_upstream_connect_failures_total",
        "loxilb_proxy_selections_total",
        "loxilb_kv_events_applied_total",
        "loxilb_api_requests_total",
        "loxilb_ai_pd_requests_total",
        "loxilb_ai_pd_prefill_duration_seconds_bucket",
        "loxilb_ai_pd_decode_ttft_seconds_bucket",
        "loxilb_ai_pd_tier_selected_total",
    ] {
        assert!(queried.contains(must), "no panel shows {must}");
        assert!(
            sampled.contains(must),
            "no sample of {must} under traffic:\n{scrape}"
        );
    }
}

// ---- OpenTelemetry -----------------------------------------------------------------------------

/// An OTLP/HTTP receiver on 127.0.0.1: decodes every `POST /v1/traces` body (gunzipped when
/// its `content-encoding` is `gzip`) and keeps each request's content encoding.
struct Collector {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
    encodings: Arc<Mutex<Vec<String>>>,
}

impl Collector {
    async fn start() -> Self {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let requests = Arc::new(Mutex::new(Vec::new()));
        let encodings = Arc::new(Mutex::new(Vec::new()));
        let (reqs, encs) = (requests.clone(), encodings.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (reqs, encs) = (reqs.clone(), encs.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: http::Request<Incoming>| {
                        let (reqs, encs) = (reqs.clone(), encs.clone());
                        async move {
                            let ok = req.uri().path() == "/v1/traces"
                                && req.headers().get("content-type").map(|v| v.as_bytes())
                                    == Some(b"application/x-protobuf".as_slice());
                            let encoding = req
                                .headers()
                                .get("content-encoding")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("identity")
                                .to_string();
                            let body = req.into_body().collect().await.map(|c| c.to_bytes());
                            let body = body.map(|b| {
                                if encoding != "gzip" {
                                    return b;
                                }
                                let mut out = Vec::new();
                                let mut gz = flate2::read::GzDecoder::new(&b[..]);
                                match std::io::Read::read_to_end(&mut gz, &mut out) {
                                    Ok(_) => Bytes::from(out),
                                    Err(_) => Bytes::new(),
                                }
                            });
                            encs.lock().push(encoding);
                            let status = match body.map(ExportTraceServiceRequest::decode) {
                                Ok(Ok(r)) if ok => {
                                    reqs.lock().push(r);
                                    200
                                }
                                _ => 400,
                            };
                            let resp = http::Response::builder()
                                .status(status)
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(Bytes::new()))
                                .expect("response");
                            Ok::<_, Infallible>(resp)
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        Self {
            addr,
            requests,
            encodings,
        }
    }

    fn spans(&self) -> Vec<Span> {
        self.requests
            .lock()
            .iter()
            .flat_map(|r| &r.resource_spans)
            .flat_map(|rs| &rs.scope_spans)
            .flat_map(|ss| ss.spans.clone())
            .collect()
    }

    fn service_names(&self) -> BTreeSet<String> {
        self.requests
            .lock()
            .iter()
            .flat_map(|r| &r.resource_spans)
            .filter_map(|rs| rs.resource.as_ref())
            .filter_map(|r| attr(&r.attributes, "service.name"))
            .map(|v| v.to_string())
            .collect()
    }

    /// Waits (up to 15 s) until at least `n` spans of trace `trace_id` arrived; returns them.
    async fn wait_for_trace(&self, trace_id: &[u8], n: usize) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let spans: Vec<Span> = self
                .spans()
                .into_iter()
                .filter(|s| s.trace_id == trace_id)
                .collect();
            if spans.len() >= n {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "fewer than {n} spans in trace {}: {:?}",
                to_hex(trace_id),
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// An attribute as a JSON-ish value (strings, ints, bools).
#[derive(Debug, Clone, PartialEq)]
enum Attr {
    S(String),
    I(i64),
    B(bool),
}

impl std::fmt::Display for Attr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Attr::S(s) => f.write_str(s),
            Attr::I(i) => write!(f, "{i}"),
            Attr::B(b) => write!(f, "{b}"),
        }
    }
}

fn attr(kvs: &[KeyValue], key: &str) -> Option<Attr> {
    let v: &AnyValue = kvs.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    match v.value.as_ref()? {
        any_value::Value::StringValue(s) => Some(Attr::S(s.clone())),
        any_value::Value::IntValue(i) => Some(Attr::I(*i)),
        any_value::Value::BoolValue(b) => Some(Attr::B(*b)),
        _ => None,
    }
}

fn attrs(s: &Span) -> HashMap<String, Attr> {
    s.attributes
        .iter()
        .filter_map(|kv| Some((kv.key.clone(), attr(std::slice::from_ref(kv), &kv.key)?)))
        .collect()
}

fn s(v: &str) -> Option<Attr> {
    Some(Attr::S(v.into()))
}

fn i(v: i64) -> Option<Attr> {
    Some(Attr::I(v))
}

/// Token ids vLLM produced for capture request `n`.
fn vllm_tokens(cap: &Value, n: usize) -> Vec<u64> {
    let raw = &cap["requests"][n]["prompt_token_ids_from_vllm"];
    let parsed: Value = match raw {
        Value::String(t) => serde_json::from_str(t).expect("token list"),
        v => v.clone(),
    };
    parsed
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("token id"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_spans_carry_the_decision_and_traceparent_reaches_the_backend() {
    let collector = Collector::start().await;
    let endpoint = format!("http://{}", collector.addr);
    let cap = capture();
    let mut f = KvFleet::start(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
    ])
    .await;
    assert!(
        f.d.log_text().contains("OpenTelemetry traces on"),
        "{}",
        f.d.log_text()
    );
    let ep = f.warm_up(&cap).await;
    f.b[ep].set_recording(true);

    // The client's own trace: loxi's server span must continue it.
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let tp = format!("00-{client_trace}-{client_span}-01");
    let warm = cap["requests"][1]["request_body"]["prompt"]
        .as_str()
        .expect("prompt 1");
    assert_eq!(complete(f.vip, warm, Some(&tp)).await, (200, Some(ep)));

    // Server span, kv.tokenize, kv.hash, kv.score and one attempt.
    let spans = collector.wait_for_trace(&hex(client_trace), 5).await;
    // OTEL_EXPORTER_OTLP_COMPRESSION=gzip took effect: every export was gzipped.
    let encodings = collector.encodings.lock().clone();
    assert!(
        !encodings.is_empty() && encodings.iter().all(|e| e == "gzip"),
        "{encodings:?}"
    );
    assert_eq!(
        collector.service_names(),
        BTreeSet::from(["loxilb".to_string()])
    );
    let in_trace: Vec<&Span> = spans.iter().collect();
    assert_eq!(in_trace.len(), 5, "{in_trace:#?}");
    let server = *in_trace
        .iter()
        .find(|s| s.name == "POST /v1/completions")
        .unwrap_or_else(|| panic!("no server span in the client's trace: {in_trace:#?}"));
    assert_eq!(
        server.parent_span_id,
        hex(client_span),
        "child of the caller"
    );
    assert_eq!(server.kind, 2, "SPAN_KIND_SERVER");

    // The decision, with the exact sizes: tokens from vLLM's own ids for this prompt, blocks of
    // 32, and the leading blocks the warm-up request (7 stored blocks) shares with it.
    let warm_ids = vllm_tokens(&cap, 1);
    let cold_ids = vllm_tokens(&cap, 0);
    let blocks = warm_ids.len() / 32;
    let cached = (1..=blocks.min(7))
        .take_while(|&k| warm_ids[..32 * k] == cold_ids[..32 * k])
        .count();
    assert!(cached > 0, "the capture's requests share a prefix");
    let a = attrs(server);
    let want: [(&str, Option<Attr>); 11] = [
        ("loxi.rule", i(1)),
        ("loxi.model", s("tiny")),
        ("loxi.selector", s("rr")),
        ("loxi.tier", s("kv")),
        ("loxi.reason", s("kv_overlap")),
        ("loxi.endpoint", i(ep as i64)),
        ("loxi.attempts", i(1)),
        ("loxi.kv.tokens", i(warm_ids.len() as i64)),
        ("loxi.kv.blocks", i(blocks as i64)),
        ("loxi.kv.cached_blocks", i(cached as i64)),
        ("http.response.status_code", i(200)),
    ];
    for (k, v) in want {
        assert_eq!(a.get(k).cloned(), v, "server span attribute {k}: {a:#?}");
    }
    assert_eq!(a.get("http.request.method").cloned(), s("POST"));

    // Children: the three tier-1.5 stages and the attempt, all under the server span.
    let child = |name: &str| -> &Span {
        in_trace
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span: {in_trace:#?}"))
    };
    for name in [
        "kv.tokenize",
        "kv.hash",
        "kv.score",
        "upstream 0",
        "upstream 1",
    ]
    .iter()
    .filter(|n| !n.starts_with("upstream") || **n == format!("upstream {ep}"))
    {
        assert_eq!(
            child(name).parent_span_id,
            server.span_id,
            "{name} is a child of the request span"
        );
    }
    assert_eq!(
        attrs(child("kv.tokenize")).get("loxi.kv.tokens").cloned(),
        i(warm_ids.len() as i64)
    );
    assert_eq!(
        attrs(child("kv.hash")).get("loxi.kv.blocks").cloned(),
        i(blocks as i64)
    );
    let attempt = child(&format!("upstream {ep}"));
    assert_eq!(attempt.kind, 3, "SPAN_KIND_CLIENT");
    let aa = attrs(attempt);
    assert_eq!(aa.get("loxi.attempt").cloned(), i(1));
    assert_eq!(aa.get("http.response.status_code").cloned(), i(200));
    assert_eq!(
        aa.get("server.address").cloned(),
        s(&format!("127.0.0.{}:{}", ep + 1, f.b[ep].port()))
    );

    // The backend saw the attempt's context, not the client's.
    let rec = f.b[ep].requests();
    let got = rec
        .last()
        .and_then(|r| r.header("traceparent"))
        .expect("traceparent at the backend")
        .to_string();
    assert_eq!(
        got,
        format!("00-{client_trace}-{}-01", to_hex(&attempt.span_id)),
        "W3C traceparent of the attempt span"
    );

    // A retry: the first endpoint of rule 2 refuses connections; two attempt spans, the first
    // an error of type `connect`, under one server span.
    let dead = free_port();
    let vip2 = free_port();
    let rule2 = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": vip2, "protocol": "tcp", "mode": 4, "sel": 0},
        "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": dead},
                      {"endpointIP": "127.0.0.1", "targetPort": f.b[0].port()}]
    });
    assert_eq!(f.d.post_rule(&rule2).await.0, 200);
    wait_listening(SocketAddr::from(([127, 0, 0, 1], vip2))).await;
    let tp2 = "00-11111111111111111111111111111111-2222222222222222-01";
    let (code, served) = complete(SocketAddr::from(([127, 0, 0, 1], vip2)), "x", Some(tp2)).await;
    assert_eq!((code, served), (200, Some(1)));
    // Server span and two attempts (rule 2 has no KV tier: no stage spans).
    let spans = collector
        .wait_for_trace(&hex("11111111111111111111111111111111"), 3)
        .await;
    let retry: Vec<&Span> = spans.iter().collect();
    assert_eq!(retry.len(), 3, "{retry:#?}");
    let server2 = retry
        .iter()
        .find(|s| s.kind == 2)
        .expect("server span of the retried request");
    let a2 = attrs(server2);
    let keys: Vec<&str> = server2
        .attributes
        .iter()
        .map(|kv| kv.key.as_str())
        .collect();
    assert_eq!(
        keys.iter().collect::<BTreeSet<_>>().len(),
        keys.len(),
        "each attribute key once, the retry's decision replacing the first: {keys:?}"
    );
    assert_eq!(a2.get("loxi.attempts").cloned(), i(2));
    assert_eq!(a2.get("loxi.endpoint").cloned(), i(1));
    assert_eq!(a2.get("loxi.tier").cloned(), s("sel"));
    assert_eq!(a2.get("loxi.reason").cloned(), s("rr"));
    let first = retry
        .iter()
        .find(|s| s.name == "upstream 0")
        .expect("first attempt");
    assert_eq!(attrs(first).get("error.type").cloned(), s("connect"));
    assert_eq!(
        first.status.as_ref().map(|st| st.code),
        Some(2),
        "STATUS_CODE_ERROR"
    );
    let second = retry
        .iter()
        .find(|s| s.name == "upstream 1")
        .expect("second attempt");
    assert_eq!(attrs(second).get("loxi.attempt").cloned(), i(2));
    assert_eq!(second.parent_span_id, server2.span_id);

    // A P/D request: one client span per leg, `prefill 0` and `decode 1`, each leg carrying
    // its own span's context, and the prefill endpoint recorded on the server span.
    for b in &f.b {
        b.set_recording(true);
    }
    let vip3 = free_port();
    let rule3 = f.pd_rule(vip3);
    assert_eq!(f.d.post_rule(&rule3).await.0, 200);
    wait_listening(SocketAddr::from(([127, 0, 0, 1], vip3))).await;
    let tid3 = "33333333333333333333333333333333";
    let tp3 = format!("00-{tid3}-4444444444444444-01");
    let (code, served) = complete(SocketAddr::from(([127, 0, 0, 1], vip3)), "pd", Some(&tp3)).await;
    assert_eq!((code, served), (200, Some(1)));
    let spans = collector.wait_for_trace(&hex(tid3), 3).await;
    let pd: Vec<&Span> = spans.iter().collect();
    assert_eq!(pd.len(), 3, "{pd:#?}");
    let server3 = pd.iter().find(|s| s.kind == 2).expect("server span");
    assert_eq!(attrs(server3).get("loxi.prefill_endpoint").cloned(), i(0));
    assert_eq!(attrs(server3).get("loxi.endpoint").cloned(), i(1));
    for (name, leg, ep) in [("prefill 0", "prefill", 0usize), ("decode 1", "decode", 1)] {
        let span = pd
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span: {pd:#?}"));
        assert_eq!(
            (span.kind, span.parent_span_id.clone()),
            (3, server3.span_id.clone())
        );
        let a = attrs(span);
        assert_eq!(a.get("loxi.leg").cloned(), s(leg));
        assert_eq!(a.get("loxi.endpoint").cloned(), i(ep as i64));
        assert_eq!(a.get("http.response.status_code").cloned(), i(200));
        let got = f.b[ep]
            .requests()
            .last()
            .and_then(|r| r.header("traceparent").map(str::to_owned));
        assert_eq!(
            got,
            Some(format!("00-{tid3}-{}-01", to_hex(&span.span_id))),
            "the {leg} leg carries its own span's context"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_are_off_by_default_and_a_grpc_protocol_is_refused_by_name() {
    let d = Daemon::start_default().await;
    assert!(!d.log_text().contains("OpenTelemetry traces on"));
    drop(d);
    let opts = DaemonOpts::default()
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc");
    let d = Daemon::start(opts).await;
    let log = d.log_text();
    assert!(
        log.contains("OTEL_EXPORTER_OTLP_PROTOCOL=\"grpc\" is not accepted")
            && log.contains("traces stay off"),
        "{log}"
    );
    assert!(!log.contains("OpenTelemetry traces on"), "{log}");
}

/// A collector that cannot be reached: the spans the batch processor drops are reported in the
/// log (the OTLP exporter's own errors reach only the SDK's internal logs, which loxi does not
/// show), once, not once per export.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_cannot_be_reached_is_reported_in_the_log() {
    let dead = free_port();
    let opts = DaemonOpts::default()
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            &format!("http://127.0.0.1:{dead}"),
        )
        .env("OTEL_BSP_SCHEDULE_DELAY", "100");
    let d = Daemon::start(opts).await;
    let b = Backend::start("b").await;
    let port = free_port();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4, "sel": 0},
        "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": b.port()}]
    });
    assert_eq!(d.post_rule(&rule).await.0, 200);
    let vip = SocketAddr::from(([127, 0, 0, 1], port));
    wait_listening(vip).await;
    for i in 0..3 {
        assert_eq!(complete(vip, &format!("p{i}"), None).await.0, 200);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    let failed = |log: &str| {
        log.lines()
            .filter(|l| l.contains("WARN") && l.contains("OTLP span export failed"))
            .count()
    };
    while failed(&d.log_text()) == 0 {
        assert!(Instant::now() < deadline, "not reported: {}", d.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        failed(&d.log_text()),
        1,
        "once a minute at most: {}",
        d.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_format_json_writes_one_object_per_line() {
    let opts = DaemonOpts {
        args: vec!["--log-format".into(), "json".into()],
        ..Default::default()
    }
    .env("LOXILB_KV_LB_MODE", "sideways");
    let d = Daemon::start(opts).await;
    let log = d.log_text();
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let listening = lines
        .iter()
        .find(|v| v["fields"]["message"] == "REST API listening")
        .unwrap_or_else(|| panic!("no listening line: {log}"));
    assert_eq!(listening["level"], "INFO");
    assert_eq!(listening["fields"]["addr"], d.api_addr().to_string());
    assert_eq!(
        listening["fields"]["url"],
        format!("http://{}", d.api_addr()),
        "the scheme a client uses"
    );
    let warn = lines
        .iter()
        .find(|v| v["fields"]["var"] == "LOXILB_KV_LB_MODE")
        .unwrap_or_else(|| panic!("no env warning line: {log}"));
    assert_eq!(warn["level"], "WARN");
    assert_eq!(warn["fields"]["value"], "sideways");
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
