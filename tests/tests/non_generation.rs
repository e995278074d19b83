//! Requests that are not generations, with the real daemon and real backends on loopback:
//! `/v1/embeddings`, `/tokenize` and `/health` through a `kvExactMode: 3` rule are routed by
//! the rule's `sel` without entering tier 1.5 (no miss counted, `bypass` counted instead), a
//! P/D rule forwards them in one leg, and `GET /v1/models` answers the union of every model
//! pool's endpoints' lists (real `vllm-sim` engines), cached for `LOXI_MODELS_CACHE_MS`. A
//! generation whose body is declared as `text/plain` is not read (a `model_empty` miss).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use loxi_tests::kv::{kv_daemon, stage_tiny_tokenizer};
use loxi_tests::sim::Sim;
use serde_json::{Value, json};
use tokio::net::TcpStream;

/// One request to the VIP on `port`: status, response headers, body as JSON (`Null` if not).
async fn send(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, http::HeaderMap, Value) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://127.0.0.1:{port}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if body.is_some()
        && !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        req = req.header("content-type", "application/json");
    }
    let text = body.map(|b| b.to_string()).unwrap_or_default();
    let req = req.body(Full::new(Bytes::from(text))).expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("answer within 20 s")
        .expect("proxy answered");
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, headers, v)
}

async fn post_rule(d: &Daemon, rule: &Value) {
    let (status, body) = d.post_rule(rule).await;
    assert!(
        status == 200 || status == 201,
        "rule refused: {status} {body}"
    );
}

async fn wait_open(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(Instant::now() < deadline, "listener on {port} did not open");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sum of every sample of `name` (exact family name) whose labels contain every needle.
fn total(text: &str, name: &str, needles: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The tier-1.5 counters of one service: misses (all reasons), `no_worker` misses,
/// fallthroughs, hits (all endpoints), bypasses (`non_generation`), cold placements.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Tier {
    misses: f64,
    no_worker: f64,
    fallthrough: f64,
    hits: f64,
    bypass: f64,
    placed: f64,
}

async fn tier(d: &Daemon, service: &str) -> Tier {
    let m = d.metrics_text().await;
    let s = format!("service=\"{service}\"");
    let bypass = total(
        &m,
        "loxilb_pd_kv_tier15_bypass_total",
        &[&s, "reason=\"non_generation\""],
    );
    assert!(
        m.contains(&format!(
            "loxilb_pd_kv_tier15_bypass_total{{{s},reason=\"non_generation\"}}"
        )),
        "the bypass series of service {service} exists: {m}"
    );
    Tier {
        misses: total(&m, "loxilb_pd_kv_tier15_miss_reason_total", &[&s]),
        no_worker: total(
            &m,
            "loxilb_pd_kv_tier15_miss_reason_total",
            &[&s, "reason=\"no_worker\""],
        ),
        fallthrough: total(&m, "loxilb_pd_kv_tier15_fallthrough_total", &[&s]),
        hits: total(&m, "loxilb_pd_kv_tier15_hits_total", &[&s]),
        bypass,
        placed: total(&m, "loxilb_pd_kv_tier15_cold_placements_total", &[&s]),
    }
}

fn delta(after: Tier, before: Tier) -> [f64; 6] {
    [
        after.misses - before.misses,
        after.no_worker - before.no_worker,
        after.fallthrough - before.fallthrough,
        after.hits - before.hits,
        after.bypass - before.bypass,
        after.placed - before.placed,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_tokenize_and_health_skip_tier_1_5_and_count_as_bypass() {
    let (b0, b1) = (Backend::start("b0").await, Backend::start("b1").await);
    let tok = tempfile::tempdir().expect("tmp");
    stage_tiny_tokenizer(tok.path());
    let d = kv_daemon(tok.path()).await;
    let port = free_port();
    post_rule(
        &d,
        &json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                "mode": 4, "sel": 0, "kvExactMode": 3, "kvBlockSize": 16},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": b0.port(), "kvZmqPort": free_port()},
                          {"endpointIP": "127.0.0.1", "targetPort": b1.port(), "kvZmqPort": free_port()}],
        }),
    )
    .await;
    wait_open(port).await;
    let id = d.rules().await["lbAttr"][0]["serviceId"].clone();
    let service = id
        .as_u64()
        .map(|n| n.to_string())
        .or_else(|| id.as_str().map(String::from))
        .unwrap_or_else(|| panic!("serviceId: {id}"));

    // Control: a generation request enters the tier (nothing is indexed: a cold placement,
    // the default `LOXI_KV_COLD_PLACEMENT=least-work`).
    let before = tier(&d, &service).await;
    let words: Vec<String> = (0..60).map(|i| format!("w{i}")).collect();
    let prompt = json!({"model": "tiny", "prompt": words.join(" "), "max_tokens": 4});
    let (status, _, _) = send(port, "POST", "/v1/completions", &[], Some(prompt)).await;
    assert_eq!(status, 200);
    let after = tier(&d, &service).await;
    assert_eq!(
        delta(after, before),
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        "misses, no_worker, fallthrough, hits, bypass, cold placements"
    );

    let requests = [
        (
            "POST",
            "/v1/embeddings",
            Some(json!({"model": "tiny", "input": words.join(" ")})),
        ),
        (
            "POST",
            "/tokenize",
            Some(json!({"model": "tiny", "prompt": words.join(" ")})),
        ),
        ("GET", "/health", None),
    ];
    for (method, path, body) in requests {
        let before = tier(&d, &service).await;
        let (status, headers, v) = send(port, method, path, &[], body).await;
        assert_eq!(status, 200, "{method} {path}: {v}");
        assert_eq!(
            v["path"],
            json!(path),
            "the backend answered {method} {path}"
        );
        assert!(headers.contains_key("x-loxilb-endpoint"));
        let after = tier(&d, &service).await;
        assert_eq!(
            delta(after, before),
            [0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
            "{method} {path}: misses, no_worker, fallthrough, hits, bypass, cold placements"
        );
    }
    assert_eq!(b0.request_count() + b1.request_count(), 4);

    // The same generation declared as another media type is not read (vLLM refuses it with
    // 415): a `model_empty` miss that falls through to `sel`, nothing placed or predicted.
    let model_empty = |m: &str| {
        total(
            m,
            "loxilb_pd_kv_tier15_miss_reason_total",
            &[&format!("service=\"{service}\""), "reason=\"model_empty\""],
        )
    };
    for ct in ["text/plain", "application/x-www-form-urlencoded"] {
        let before = tier(&d, &service).await;
        let empty0 = model_empty(&d.metrics_text().await);
        let prompt = json!({"model": "tiny", "prompt": words.join(" "), "max_tokens": 4});
        let (status, _, _) = send(
            port,
            "POST",
            "/v1/completions",
            &[("content-type", ct)],
            Some(prompt),
        )
        .await;
        assert_eq!(status, 200, "{ct}");
        let after = tier(&d, &service).await;
        assert_eq!(
            delta(after, before),
            [1.0, 0.0, 1.0, 0.0, 0.0, 0.0],
            "{ct}: misses, no_worker, fallthrough, hits, bypass, cold placements"
        );
        assert_eq!(model_empty(&d.metrics_text().await) - empty0, 1.0, "{ct}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_p_d_rule_forwards_embeddings_in_one_leg() {
    let (pre, dec) = (Backend::start("pre").await, Backend::start("dec").await);
    pre.set_recording(true);
    dec.set_recording(true);
    let d = Daemon::start(DaemonOpts::default()).await;
    let port = free_port();
    post_rule(
        &d,
        &json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                "mode": 4, "sel": 0, "pd_disagg_mode": true},
            "endpoints": [
                {"endpointIP": "127.0.0.1", "targetPort": pre.port(), "ep_role": 1, "nixl_port": 5600},
                {"endpointIP": "127.0.0.1", "targetPort": dec.port(), "ep_role": 2, "nixl_port": 0}],
        }),
    )
    .await;
    wait_open(port).await;
    let body = json!({"model": "tiny", "input": "hello world"});
    let (status, headers, v) = send(port, "POST", "/v1/embeddings", &[], Some(body)).await;
    assert_eq!(status, 200, "{v}");
    assert!(
        !headers.contains_key("x-loxilb-prefill-endpoint"),
        "one leg: {headers:?}"
    );
    let seen: Vec<String> = [&pre, &dec]
        .iter()
        .flat_map(|b| b.requests())
        .map(|r| format!("{} {}", r.method, r.uri))
        .collect();
    assert_eq!(
        seen,
        ["POST /v1/embeddings"],
        "exactly one upstream request"
    );
    let m = d.metrics_text().await;
    assert_eq!(total(&m, "loxilb_ai_pd_requests_total", &[]), 0.0, "{m}");
}

fn ids(v: &Value) -> Vec<&str> {
    assert_eq!(v["object"], "list", "{v}");
    v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|e| e["id"].as_str().expect("id"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_models_is_the_union_of_the_model_pools_cached_then_refreshed() {
    const CACHE_MS: u64 = 3000;
    let (a0, a1, b0) = (
        Sim::start("a").await,
        Sim::start("a").await,
        Sim::start("b").await,
    );
    // An endpoint that answers, but not a model list, and one where nothing listens: both are
    // left out.
    let odd = Backend::start("odd").await;
    let dead = free_port();
    let opts = DaemonOpts::default().env("LOXI_MODELS_CACHE_MS", &CACHE_MS.to_string());
    let d = Daemon::start(opts).await;
    let port = free_port();
    let pool = |model: &str, ports: &[u16]| {
        let eps: Vec<Value> = ports
            .iter()
            .map(|p| json!({"endpointIP": "127.0.0.1", "targetPort": p}))
            .collect();
        json!({"serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
            "mode": 4, "sel": 0, "model_name": model}, "endpoints": eps})
    };
    post_rule(&d, &pool("a", &[a0.port(), a1.port(), odd.port()])).await;
    post_rule(&d, &pool("b", &[b0.port(), dead])).await;
    wait_open(port).await;

    let (status, headers, v) = send(port, "GET", "/v1/models", &[], None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        headers.get("content-type").map(|h| h.as_bytes()),
        Some(&b"application/json"[..])
    );
    assert_eq!(ids(&v), ["a", "b"], "{v}");
    assert_eq!(
        (&v["data"][0]["owned_by"], &v["data"][0]["root"]),
        (&json!("vllm"), &json!("a")),
        "the engine's own entry: {v}"
    );
    assert_eq!(odd.request_count(), 1, "every endpoint was asked");
    let first = Instant::now();

    // Within the cache lifetime: the same answer, no endpoint asked again, even with b's only
    // live engine gone. Another client's credentials are never served from this entry.
    let (_, _, again) = send(port, "GET", "/v1/models", &[], None).await;
    assert_eq!(again, v, "served from the cache");
    assert_eq!(odd.request_count(), 1);
    let (status, _, keyed) = send(
        port,
        "GET",
        "/v1/models",
        &[("authorization", "Bearer other")],
        None,
    )
    .await;
    assert_eq!((status, ids(&keyed)), (200, vec!["a", "b"]));
    assert_eq!(
        odd.request_count(),
        2,
        "another Authorization is another entry"
    );
    let auth = odd
        .requests()
        .last()
        .and_then(|r| r.header("authorization").map(String::from));
    assert_eq!(
        auth.as_deref(),
        Some("Bearer other"),
        "the client's credentials go upstream"
    );
    // Forwarded like any request: the client's address, the scheme and this gateway's hop id
    // (without it a rule leading back here was asked until the timeout, not refused 508).
    let last = odd.requests().last().cloned().expect("a request");
    assert_eq!(last.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(last.header("x-forwarded-proto"), Some("http"));
    let hop = last.header("x-loxi-hop").unwrap_or_default();
    assert!(
        hop.len() == 16 && hop.bytes().all(|b| b.is_ascii_hexdigit()),
        "{hop:?}"
    );
    b0.kill().await;
    let (_, _, cached) = send(port, "GET", "/v1/models", &[], None).await;
    assert!(
        first.elapsed() < Duration::from_millis(CACHE_MS),
        "the checks above ran within the cache lifetime"
    );
    assert_eq!(ids(&cached), ["a", "b"], "still cached");
    assert_eq!(odd.request_count(), 2);

    // Past it: asked again, and b's engine is gone.
    tokio::time::sleep(Duration::from_millis(CACHE_MS + 500)).await;
    let (status, _, fresh) = send(port, "GET", "/v1/models", &[], None).await;
    assert_eq!((status, ids(&fresh)), (200, vec!["a"]), "{fresh}");
    assert_eq!(odd.request_count(), 3);

    // No endpoint answering a list: 502 with a clear error (failures are not cached).
    a0.kill().await;
    a1.kill().await;
    tokio::time::sleep(Duration::from_millis(CACHE_MS + 500)).await;
    let (status, _, err) = send(port, "GET", "/v1/models", &[], None).await;
    assert_eq!(status, 502, "{err}");
    assert_eq!(err["error"]["type"], "models_unavailable", "{err}");
    let msg = err["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("5 asked"), "{msg}");
}

/// One client's slow `GET /v1/models` fetch (an engine that takes 1.5 s to answer it) does not
/// hold up another client's (other credentials, so another cache entry), nor a cached answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_models_fetches_of_different_clients_run_in_parallel() {
    let (sim, slow) = (Sim::start("a").await, Backend::start("slow").await);
    let opts = DaemonOpts::default().env("LOXI_MODELS_CACHE_MS", "60000");
    let d = Daemon::start(opts).await;
    let port = free_port();
    post_rule(
        &d,
        &json!({"serviceArguments": {"externalIP": "127.0.0.1", "port": port,
            "protocol": "tcp", "mode": 4, "sel": 0},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": sim.port()},
                          {"endpointIP": "127.0.0.1", "targetPort": slow.port()}]}),
    )
    .await;
    wait_open(port).await;
    // Cached for the client without credentials.
    let (status, _, v) = send(port, "GET", "/v1/models", &[], None).await;
    assert_eq!((status, ids(&v)), (200, vec!["a"]), "{v}");
    // A client whose fetch waits 1.5 s on the slow endpoint (the echo backend honours
    // `x-delay-ms`, which the fetch forwards with the client's other headers).
    let held = tokio::spawn(async move {
        let started = Instant::now();
        let (status, _, v) = send(
            port,
            "GET",
            "/v1/models",
            &[("authorization", "Bearer slow"), ("x-delay-ms", "1500")],
            None,
        )
        .await;
        assert_eq!((status, ids(&v)), (200, vec!["a"]), "{v}");
        started.elapsed()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let (status, _, v) = send(
        port,
        "GET",
        "/v1/models",
        &[("authorization", "Bearer fast")],
        None,
    )
    .await;
    let fast = started.elapsed();
    assert_eq!((status, ids(&v)), (200, vec!["a"]), "{v}");
    let started = Instant::now();
    let (status, _, _) = send(port, "GET", "/v1/models", &[], None).await;
    let cached = started.elapsed();
    assert_eq!(status, 200);
    let slow_took = held.await.expect("slow client");
    assert!(
        slow_took >= Duration::from_millis(1400),
        "the slow fetch waited: {slow_took:?}"
    );
    assert!(
        fast < Duration::from_millis(1000) && cached < Duration::from_millis(1000),
        "another client's fetch took {fast:?} and a cached answer {cached:?} while one fetch \
         took {slow_took:?}"
    );
}
