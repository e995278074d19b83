//! The per-endpoint admission gate end to end (`LLB_PD_MAX_INFLIGHT_PER_EP`,
//! `LLB_PD_QUEUE_DEPTH_PER_EP`, `LLB_PD_MAX_PARK_SEC`, `LOXI_ADMISSION_SCOPE`): the real
//! `loxilb` daemon, real HTTP test backends on loopback that hold each request for the time its
//! `x-delay-ms` header asks (the header reaches both P/D legs).
//!
//! With a cap of 1 and a park queue of 2 on one prefill endpoint: parked requests reach the
//! prefill in arrival order once the slot frees, the one beyond the queue gets 429
//! `pd_overloaded` with `Retry-After`, a request parked past the deadline gets 504
//! `pd_admission_timeout`, a parked request is answered (503 `pd_admission_closed`) when its
//! rule is deleted or the daemon stops, and a client that leaves while parked leaves the queue.

use std::time::{Duration, Instant};

use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use loxi_tests::http::metric;

const PARKED: &str = "loxilb_pd_admission_parked";
const QUEUED: &str = "loxilb_pd_admission_queued_total";
const SHED: &str = "loxilb_pd_admission_shed_total";

/// A P/D rule on `port`: one prefill endpoint and one decode endpoint.
fn pd_rule(port: u16, prefill: u16, decode: u16) -> Value {
    json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
            "mode": 4, "sel": 0, "pd_disagg_mode": true},
        "endpoints": [
            {"endpointIP": "127.0.0.1", "targetPort": prefill, "ep_role": 1},
            {"endpointIP": "127.0.0.1", "targetPort": decode, "ep_role": 2},
        ],
    })
}

/// A single-pool mode-4 rule on `port` with one endpoint.
fn pool_rule(port: u16, ep: u16) -> Value {
    json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
            "mode": 4, "sel": 0},
        "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": ep}],
    })
}

/// The daemon with `env`, serving `rule`.
async fn started(env: &[(&str, &str)], rule: &Value) -> Daemon {
    let opts = env
        .iter()
        .fold(DaemonOpts::default(), |o, (k, v)| o.env(k, v));
    let d = Daemon::start(opts).await;
    let (status, body) = d.post_rule(rule).await;
    assert_eq!(status, 200, "rule rejected: {body}");
    let port = rule["serviceArguments"]["port"].as_u64().expect("port") as u16;
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(Instant::now() < deadline, "listener on {port} did not open");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    d
}

/// One answer as the tests see it.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
    /// When the answer was complete.
    at: Instant,
}

impl Answer {
    fn token(&self) -> Value {
        serde_json::from_str::<Value>(&self.body)
            .map_or(Value::Null, |v| v["error"]["type"].clone())
    }
    fn retry_after(&self) -> Option<String> {
        self.head.lines().find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("retry-after:")
                .map(|v| v.trim().to_string())
        })
    }
}

/// The raw request of completion `prompt`, held `delay_ms` by each backend.
fn request(prompt: &str, delay_ms: u64) -> String {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 4}).to_string();
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nx-delay-ms: {delay_ms}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Opens a connection and sends completion `prompt`.
async fn open(port: u16, prompt: &str, delay_ms: u64) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(request(prompt, delay_ms).as_bytes())
        .await
        .expect("write");
    s
}

/// Reads the answer on `s` (the daemon closes the connection after it).
async fn answer(mut s: TcpStream) -> Answer {
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_string(&mut text))
        .await
        .expect("answered within 20 s")
        .expect("read");
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Answer {
        status: head.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0),
        head: head.to_string(),
        body: body.to_string(),
        at: Instant::now(),
    }
}

/// Sends completion `prompt` in the background.
async fn spawn(port: u16, prompt: &str, delay_ms: u64) -> JoinHandle<Answer> {
    let s = open(port, prompt, delay_ms).await;
    tokio::spawn(answer(s))
}

/// Waits until `b` has received `n` requests.
async fn wait_requests(b: &Backend, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.request_count() < n {
        assert!(
            Instant::now() < deadline,
            "backend got {} requests, want {n}",
            b.request_count()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The prompts the backend received, in arrival order.
fn prompts(b: &Backend) -> Vec<String> {
    b.requests()
        .iter()
        .filter_map(|r| serde_json::from_slice::<Value>(&r.body).ok())
        .filter_map(|v| v["prompt"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test]
async fn parked_requests_are_served_in_order_and_the_one_beyond_the_queue_gets_429() {
    let (pre, dec) = (Backend::start("pre").await, Backend::start("dec").await);
    let port = free_port();
    let env = [
        ("LLB_PD_MAX_INFLIGHT_PER_EP", "1"),
        ("LLB_PD_QUEUE_DEPTH_PER_EP", "2"),
        ("LLB_PD_MAX_PARK_SEC", "10"),
    ];
    let d = started(&env, &pd_rule(port, pre.port(), dec.port())).await;
    let a = spawn(port, "a", 700).await;
    wait_requests(&pre, 1).await;
    let b = spawn(port, "b", 700).await;
    d.wait_metric(PARKED, &[], 1.0).await;
    let c = spawn(port, "c", 700).await;
    d.wait_metric(PARKED, &[], 2.0).await;
    let t = Instant::now();
    let refused = answer(open(port, "d", 0).await).await;
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.token(), "pd_overloaded", "{refused:?}");
    assert_eq!(refused.retry_after().as_deref(), Some("1"), "{refused:?}");
    assert!(t.elapsed() < Duration::from_millis(500), "refused at once");
    assert_eq!(pre.request_count(), 1, "parked requests wait for the slot");

    let (a, b, c) = (
        a.await.expect("a"),
        b.await.expect("b"),
        c.await.expect("c"),
    );
    for r in [&a, &b, &c] {
        assert_eq!(r.status, 200, "{r:?}");
    }
    assert_eq!(prompts(&pre), ["a", "b", "c"], "served in arrival order");
    assert!(
        a.at < b.at && b.at < c.at,
        "one prefill at a time, so the answers end in order"
    );
    assert_eq!(dec.request_count(), 3, "the decode leg is not gated");
    let m = d.wait_metric(PARKED, &[], 0.0).await;
    assert_eq!(metric(&m, QUEUED, &[]), 2.0, "two parks");
    assert_eq!(metric(&m, SHED, &["reason=\"ep_queue_full\""]), 1.0);
    assert_eq!(metric(&m, SHED, &["reason=\"park_timeout\""]), 0.0);
    eprintln!(
        "cap 1, queue 2: a served, b and c parked then served in order ({:?} and {:?} after a), d got 429 in {:?}",
        b.at - a.at,
        c.at - a.at,
        refused.at - t
    );
}

#[tokio::test]
async fn a_request_parked_past_the_deadline_gets_504() {
    let (pre, dec) = (Backend::start("pre").await, Backend::start("dec").await);
    let port = free_port();
    let env = [
        ("LLB_PD_MAX_INFLIGHT_PER_EP", "1"),
        ("LLB_PD_QUEUE_DEPTH_PER_EP", "2"),
        ("LLB_PD_MAX_PARK_SEC", "1"),
    ];
    let d = started(&env, &pd_rule(port, pre.port(), dec.port())).await;
    let a = spawn(port, "a", 3000).await;
    wait_requests(&pre, 1).await;
    let t = Instant::now();
    let late = answer(open(port, "b", 0).await).await;
    let waited = late.at - t;
    assert_eq!(late.status, 504, "{late:?}");
    assert_eq!(late.token(), "pd_admission_timeout", "{late:?}");
    assert!(
        waited >= Duration::from_millis(950) && waited < Duration::from_millis(2000),
        "reaped at LLB_PD_MAX_PARK_SEC=1: {waited:?}"
    );
    assert_eq!(
        pre.request_count(),
        1,
        "the reaped request never reached the prefill"
    );
    let m = d.wait_metric(PARKED, &[], 0.0).await;
    assert_eq!(metric(&m, SHED, &["reason=\"park_timeout\""]), 1.0);
    assert_eq!(metric(&m, QUEUED, &[]), 1.0);
    assert_eq!(a.await.expect("a").status, 200);
    // The slot is free again: the next request is admitted at once.
    assert_eq!(answer(open(port, "c", 0).await).await.status, 200);
    eprintln!("park deadline 1 s: 504 pd_admission_timeout after {waited:?}");
}

#[tokio::test]
async fn a_parked_request_is_answered_when_its_rule_is_deleted() {
    let (pre, dec) = (Backend::start("pre").await, Backend::start("dec").await);
    let port = free_port();
    let env = [
        ("LLB_PD_MAX_INFLIGHT_PER_EP", "1"),
        ("LLB_PD_QUEUE_DEPTH_PER_EP", "2"),
        ("LLB_PD_MAX_PARK_SEC", "30"),
    ];
    let d = started(&env, &pd_rule(port, pre.port(), dec.port())).await;
    let a = spawn(port, "a", 2000).await;
    wait_requests(&pre, 1).await;
    let b = spawn(port, "b", 0).await;
    d.wait_metric(PARKED, &[], 1.0).await;
    let t = Instant::now();
    let (status, body) = d.delete_rule("127.0.0.1", port, "tcp", None).await;
    assert_eq!(status, 200, "{body}");
    let b = b.await.expect("b");
    assert_eq!(b.status, 503, "{b:?}");
    assert_eq!(b.token(), "pd_admission_closed", "{b:?}");
    assert!(b.body.contains("endpoint_removed"), "{b:?}");
    assert!(
        b.at - t < Duration::from_secs(1),
        "answered at the delete, not at the park deadline: {:?}",
        b.at - t
    );
    assert_eq!(b.retry_after().as_deref(), Some("1"));
    // The admitted request finishes on the closing listener.
    assert_eq!(a.await.expect("a").status, 200);
    assert_eq!(pre.request_count(), 1);
    let m = d.metrics_text().await;
    assert_eq!(metric(&m, SHED, &["reason=\"closed\""]), 1.0);
    assert_eq!(
        metric(&m, PARKED, &[]),
        0.0,
        "the deleted service's gauge is gone"
    );
}

#[tokio::test]
async fn a_parked_request_is_answered_when_the_daemon_stops() {
    let (pre, dec) = (Backend::start("pre").await, Backend::start("dec").await);
    let port = free_port();
    let env = [
        ("LLB_PD_MAX_INFLIGHT_PER_EP", "1"),
        ("LLB_PD_QUEUE_DEPTH_PER_EP", "1"),
        ("LLB_PD_MAX_PARK_SEC", "30"),
    ];
    let mut d = started(&env, &pd_rule(port, pre.port(), dec.port())).await;
    let a = spawn(port, "a", 1500).await;
    wait_requests(&pre, 1).await;
    let b = spawn(port, "b", 0).await;
    d.wait_metric(PARKED, &[], 1.0).await;
    let t = Instant::now();
    let stopping = tokio::spawn(async move {
        let exit = d.stop().await;
        (exit, d)
    });
    let b = b.await.expect("b");
    assert_eq!(b.status, 503, "{b:?}");
    assert_eq!(b.token(), "pd_admission_closed", "{b:?}");
    assert!(b.body.contains("shutdown"), "{b:?}");
    assert!(b.at - t < Duration::from_secs(1), "{:?}", b.at - t);
    assert_eq!(a.await.expect("a").status, 200, "the admitted one finished");
    let (exit, _d) = stopping.await.expect("stop");
    assert!(exit.is_some_and(|e| e.success()), "clean exit: {exit:?}");
}

#[tokio::test]
async fn a_client_that_leaves_while_parked_leaves_the_queue() {
    let (pre, dec) = (Backend::start("pre").await, Backend::start("dec").await);
    let port = free_port();
    let env = [
        ("LLB_PD_MAX_INFLIGHT_PER_EP", "1"),
        ("LLB_PD_QUEUE_DEPTH_PER_EP", "1"),
        ("LLB_PD_MAX_PARK_SEC", "30"),
    ];
    let d = started(&env, &pd_rule(port, pre.port(), dec.port())).await;
    let a = spawn(port, "a", 1500).await;
    wait_requests(&pre, 1).await;
    let leaving = open(port, "b", 0).await;
    d.wait_metric(PARKED, &[], 1.0).await;
    drop(leaving);
    let t = Instant::now();
    d.wait_metric(PARKED, &[], 0.0).await;
    let left = t.elapsed();
    // The queue (depth 1) is free again while the slot is still held: a new request parks
    // rather than getting 429, and is served after a.
    let c = spawn(port, "c", 0).await;
    d.wait_metric(PARKED, &[], 1.0).await;
    assert_eq!(a.await.expect("a").status, 200);
    assert_eq!(c.await.expect("c").status, 200);
    assert_eq!(
        prompts(&pre),
        ["a", "c"],
        "the request that left never reached the prefill"
    );
    let m = d.wait_metric(PARKED, &[], 0.0).await;
    assert_eq!(metric(&m, QUEUED, &[]), 2.0);
    assert_eq!(metric(&m, SHED, &["reason=\"ep_queue_full\""]), 0.0);
    eprintln!("client left while parked: gauge back to 0 after {left:?}");
}

#[tokio::test]
async fn single_pools_are_gated_only_with_scope_all() {
    let ep = Backend::start("ep").await;
    let port = free_port();
    let gate = [
        ("LLB_PD_MAX_INFLIGHT_PER_EP", "1"),
        ("LLB_PD_QUEUE_DEPTH_PER_EP", "1"),
        ("LLB_PD_MAX_PARK_SEC", "10"),
    ];
    // Default scope (`pd`): a single-pool rule is not gated.
    let d = started(&gate, &pool_rule(port, ep.port())).await;
    let held: Vec<_> = [
        spawn(port, "a", 800).await,
        spawn(port, "b", 800).await,
        spawn(port, "c", 0).await,
    ]
    .into_iter()
    .collect();
    wait_requests(&ep, 3).await;
    for h in held {
        assert_eq!(h.await.expect("req").status, 200);
    }
    assert_eq!(metric(&d.metrics_text().await, QUEUED, &[]), 0.0);
    drop(d);

    let ep = Backend::start("ep").await;
    let port = free_port();
    let mut env = gate.to_vec();
    env.push(("LOXI_ADMISSION_SCOPE", "all"));
    let d = started(&env, &pool_rule(port, ep.port())).await;
    let a = spawn(port, "a", 800).await;
    wait_requests(&ep, 1).await;
    let b = spawn(port, "b", 0).await;
    d.wait_metric(PARKED, &[], 1.0).await;
    let c = answer(open(port, "c", 0).await).await;
    assert_eq!(c.status, 429, "{c:?}");
    assert_eq!(c.token(), "pd_overloaded");
    let (a, b) = (a.await.expect("a"), b.await.expect("b"));
    assert_eq!((a.status, b.status), (200, 200));
    assert!(a.at <= b.at);
    assert_eq!(prompts(&ep), ["a", "b"]);
    let m = d.wait_metric(PARKED, &[], 0.0).await;
    assert_eq!(metric(&m, QUEUED, &[]), 1.0);
    assert_eq!(metric(&m, SHED, &["reason=\"ep_queue_full\""]), 1.0);
}
