//! Fullproxy integration tests: the real `loxilb` daemon, real backends on loopback, real HTTP.
//!
//! Each test starts its own daemon (`Daemon::start`), its own backends
//! (`loxi_tests::backend`), posts rules through the REST API and sends traffic to the rule's
//! VIP (127.0.0.1 on a port the harness reserved, see `loxi_tests::harness::free_port`).

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use loxi_tests::backend::{Backend, Mode};
use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

type Body = BoxBody<Bytes, Infallible>;

/// A response as the tests see it.
struct Resp {
    status: u16,
    endpoint: Option<usize>,
    backend: Option<String>,
    body: Value,
}

fn client() -> Client<HttpConnector, Body> {
    Client::builder(TokioExecutor::new()).build_http()
}

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

fn rule(port: u16, sel: u8, eps: &[(u16, u32)], extra: Value) -> Value {
    let mut svc =
        json!({"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4, "sel": sel});
    if let (Some(o), Some(e)) = (svc.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    let eps: Vec<Value> = eps
        .iter()
        .map(|(p, w)| json!({"endpointIP": "127.0.0.1", "targetPort": p, "weight": w}))
        .collect();
    json!({"serviceArguments": svc, "endpoints": eps})
}

async fn post(d: &Daemon, r: &Value) {
    let (status, body) = d.post_rule(r).await;
    assert!(
        status == 200 || status == 201,
        "rule rejected: {status} {body}"
    );
}

/// Waits until something accepts TCP connections on 127.0.0.1:port (the listener opened).
async fn wait_open(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(Instant::now() < deadline, "listener on {port} did not open");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until nothing accepts on 127.0.0.1:port (the listener closed).
async fn wait_closed(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
        assert!(
            Instant::now() < deadline,
            "listener on {port} did not close"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn send(c: &Client<HttpConnector, Body>, req: http::Request<Body>) -> Resp {
    let resp = tokio::time::timeout(Duration::from_secs(10), c.request(req))
        .await
        .expect("response within 10 s")
        .expect("request");
    let status = resp.status().as_u16();
    let h = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    let endpoint = h("x-loxilb-endpoint").and_then(|v| v.parse().ok());
    let backend = h("x-backend");
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| json!({"raw": String::from_utf8_lossy(&bytes)}));
    Resp {
        status,
        endpoint,
        backend,
        body,
    }
}

fn post_req(port: u16, path: &str, headers: &[(&str, &str)], body: Body) -> http::Request<Body> {
    let mut b = http::Request::post(format!("http://127.0.0.1:{port}{path}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.header("content-type", "application/json")
        .body(body)
        .expect("request")
}

async fn chat(
    c: &Client<HttpConnector, Body>,
    port: u16,
    body: Value,
    headers: &[(&str, &str)],
) -> Resp {
    send(
        c,
        post_req(
            port,
            "/v1/chat/completions",
            headers,
            full(body.to_string()),
        ),
    )
    .await
}

async fn backends(n: usize) -> Vec<Backend> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(Backend::start(&i.to_string()).await);
    }
    v
}

fn eps(bs: &[Backend]) -> Vec<(u16, u32)> {
    bs.iter().map(|b| (b.port(), 1)).collect()
}

/// A port on which nothing listens.
fn dead_port() -> u16 {
    free_port()
}

/// Value of a sample line `name{labels} value` whose labels contain every `needle`.
fn metric(text: &str, name: &str, needles: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .find(|l| needles.iter().all(|n| l.contains(n)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn started(rules: &[Value]) -> Daemon {
    let d = Daemon::start_default().await;
    for r in rules {
        post(&d, r).await;
        wait_open(r["serviceArguments"]["port"].as_u64().expect("port") as u16).await;
    }
    d
}

#[tokio::test]
async fn rr_alternates_exactly_and_names_the_endpoint() {
    let bs = backends(2).await;
    let port = free_port();
    let _d = started(&[rule(port, 0, &eps(&bs), json!({}))]).await;
    let c = client();
    let mut seen = Vec::new();
    for i in 0..10 {
        let r = chat(
            &c,
            port,
            json!({"model": "m", "messages": [{"role": "user", "content": format!("q{i}")}]}),
            &[],
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let ep = r.endpoint.expect("x-loxilb-endpoint");
        assert_eq!(
            r.backend.as_deref(),
            Some(ep.to_string().as_str()),
            "header names the backend that answered"
        );
        seen.push(ep);
    }
    for w in seen.windows(2) {
        assert_ne!(w[0], w[1], "rr must alternate: {seen:?}");
    }
    assert_eq!(bs[0].request_count() + bs[1].request_count(), 10);
    assert_eq!(bs[0].request_count(), 5);
}

#[tokio::test]
async fn wrr_three_to_one_exact_in_every_cycle() {
    let bs = backends(2).await;
    let port = free_port();
    let _d = started(&[rule(
        port,
        2,
        &[(bs[0].port(), 3), (bs[1].port(), 1)],
        json!({}),
    )])
    .await;
    let c = client();
    let mut seen = Vec::new();
    for _ in 0..16 {
        seen.push(
            chat(&c, port, json!({"model": "m"}), &[])
                .await
                .endpoint
                .expect("ep"),
        );
    }
    for cycle in seen.chunks(4) {
        assert_eq!(cycle.iter().filter(|&&e| e == 0).count(), 3, "{seen:?}");
    }
    assert_eq!((bs[0].request_count(), bs[1].request_count()), (12, 4));
}

/// For one `session_header_name`, 24 sessions × 3 requests: each session stays on one endpoint
/// and the sessions use both endpoints.
async fn assert_persist_sticky(
    header_name: &str,
    make: impl Fn(&str) -> (String, Vec<(String, String)>),
) {
    let bs = backends(2).await;
    let port = free_port();
    let _d = started(&[rule(
        port,
        3,
        &eps(&bs),
        json!({"session_header_name": header_name}),
    )])
    .await;
    let c = client();
    let mut used = std::collections::HashSet::new();
    for s in 0..24 {
        let (path, headers) = make(&format!("session-{s}"));
        let mut first = None;
        for _ in 0..3 {
            let mut b = http::Request::post(format!("http://127.0.0.1:{port}{path}"));
            for (k, v) in &headers {
                b = b.header(k.as_str(), v.as_str());
            }
            let r = send(&c, b.body(full("{}")).expect("req")).await;
            assert_eq!(r.status, 200);
            let ep = r.endpoint.expect("ep");
            assert_eq!(
                *first.get_or_insert(ep),
                ep,
                "{header_name}: session-{s} moved"
            );
        }
        used.extend(first);
    }
    assert_eq!(
        used.len(),
        2,
        "{header_name}: sessions should use both endpoints"
    );
}

#[tokio::test]
async fn persist_sticky_by_header() {
    assert_persist_sticky("X-Session-ID", |s| {
        (
            "/v1/completions".into(),
            vec![("x-session-id".into(), s.into())],
        )
    })
    .await;
}

#[tokio::test]
async fn persist_sticky_by_cookie() {
    assert_persist_sticky("cookie:JSESSIONID", |s| {
        (
            "/v1/completions".into(),
            vec![("cookie".into(), format!("theme=dark; JSESSIONID={s}"))],
        )
    })
    .await;
}

#[tokio::test]
async fn persist_sticky_by_query() {
    assert_persist_sticky("query:session_id", |s| {
        (format!("/v1/completions?session_id={s}"), vec![])
    })
    .await;
}

/// Standard base64 with padding (RFC 4648), enough for a Basic credential.
fn base64(input: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[tokio::test]
async fn persist_sticky_by_basic_auth_user() {
    assert_persist_sticky("basic-auth", |s| {
        let cred = base64(format!("{s}:secret").as_bytes());
        (
            "/v1/completions".into(),
            vec![("authorization".into(), format!("Basic {cred}"))],
        )
    })
    .await;
}

#[tokio::test]
async fn lc_sends_new_requests_to_the_idle_endpoint() {
    let bs = backends(2).await;
    let port = free_port();
    let _d = started(&[rule(port, 4, &eps(&bs), json!({}))]).await;
    let c = client();
    // Both idle: ties go to endpoint 0, which then holds a slow request.
    let slow = {
        let c = c.clone();
        tokio::spawn(async move {
            chat(&c, port, json!({"model": "m"}), &[("x-delay-ms", "1500")]).await
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while bs[0].request_count() == 0 {
        assert!(
            Instant::now() < deadline,
            "slow request never reached endpoint 0"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for _ in 0..4 {
        assert_eq!(
            chat(&c, port, json!({"model": "m"}), &[]).await.endpoint,
            Some(1)
        );
    }
    assert_eq!(slow.await.expect("join").endpoint, Some(0));
    // Idle again: back to the lowest index.
    assert_eq!(
        chat(&c, port, json!({"model": "m"}), &[]).await.endpoint,
        Some(0)
    );
}

#[tokio::test]
async fn chwbl_same_prefix_same_endpoint() {
    let bs = backends(3).await;
    let port = free_port();
    let _d = started(&[rule(port, 8, &eps(&bs), json!({}))]).await;
    let c = client();
    let mut owners = std::collections::HashSet::new();
    for agent in 0..12 {
        let system = format!("You are support agent number {agent}. Be precise and kind.");
        let mut first = None;
        for turn in 0..4 {
            let body = json!({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("question {turn}")},
            ]});
            let ep = chat(&c, port, body, &[]).await.endpoint.expect("ep");
            assert_eq!(
                *first.get_or_insert(ep),
                ep,
                "agent {agent} turn {turn} moved"
            );
        }
        owners.extend(first);
    }
    assert!(
        owners.len() >= 2,
        "different prefixes should spread: {owners:?}"
    );
}

#[tokio::test]
async fn dead_endpoint_is_retried_on_another() {
    let live = Backend::start("live").await;
    let port = free_port();
    let d = started(&[rule(
        port,
        0,
        &[(dead_port(), 1), (live.port(), 1)],
        json!({}),
    )])
    .await;
    let c = client();
    for _ in 0..6 {
        let r = chat(&c, port, json!({"model": "m"}), &[]).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.endpoint, Some(1));
    }
    assert_eq!(live.request_count(), 6);
    let m = d.metrics_text().await;
    let fails = metric(
        &m,
        "loxilb_proxy_upstream_connect_failures_total",
        &["ep_idx=\"0\""],
    );
    assert_eq!(
        fails,
        Some(3.0),
        "rr sends every other request to the dead endpoint first"
    );
}

/// A backend that takes the request and never answers (hung, or black-holed after the
/// connect) costs each request `LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS`, not forever: 504
/// `upstream_timeout`, the upstream request aborted, and after `LLB_PD_ORIGIN_ERR_THRESHOLD`
/// (3) timeouts the breaker takes the endpoint out, so the rest go to the live one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_backend_times_out_and_the_breaker_takes_it_out() {
    let bs = [Backend::start("hung").await, Backend::start("live").await];
    let hung = &bs[0];
    hung.set_mode(Mode::Hang);
    let port = free_port();
    let opts = DaemonOpts::default().env("LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS", "400");
    let d = Daemon::start(opts).await;
    post(&d, &rule(port, 0, &eps(&bs), json!({}))).await;
    wait_open(port).await;
    let c = client();
    let mut seen = Vec::new();
    for _ in 0..9 {
        let t = Instant::now();
        let r = chat(&c, port, json!({"model": "m"}), &[]).await;
        let took = t.elapsed();
        match r.status {
            504 => {
                assert_eq!(r.body["error"]["type"], "upstream_timeout", "{}", r.body);
                assert_eq!(r.body["error"]["party"], "upstream");
                assert!(
                    took >= Duration::from_millis(350) && took < Duration::from_secs(3),
                    "answered after {took:?}"
                );
            }
            200 => assert_eq!(r.backend.as_deref(), Some("live")),
            s => panic!("status {s}: {}", r.body),
        }
        seen.push(r.status);
    }
    // rr alternates until the third timeout opens the breaker; then only the live endpoint.
    assert_eq!(seen, [504, 200, 504, 200, 504, 200, 200, 200, 200]);
    let m = d.metrics_text().await;
    let timeouts = metric(
        &m,
        "loxilb_proxy_upstream_timeouts_total",
        &["ep_idx=\"0\""],
    );
    assert_eq!(timeouts, Some(3.0));
    // The 504s are the hung endpoint's failures, in both request families: under its
    // `ep_idx` (not the gateway's own refusals, `none`) and in LoxiLB's family by status.
    let by_ep = |ep: &str| {
        metric(
            &m,
            "loxilb_proxy_requests_total",
            &[&format!("ep_idx=\"{ep}\""), "class=\"5xx\""],
        )
    };
    assert_eq!((by_ep("0"), by_ep("none")), (Some(3.0), None));
    assert_eq!(
        metric(&m, "loxilb_ai_requests_total", &["status=\"504\""]),
        Some(3.0)
    );
    let active = metric(&m, "loxilb_proxy_active_connections", &["ep_idx=\"0\""]);
    assert_eq!(
        active,
        Some(0.0),
        "the timed-out requests are no longer in flight"
    );
    // The hung backend saw each request go away (the proxy closed the connection).
    let deadline = Instant::now() + Duration::from_secs(5);
    while hung.cancelled() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(hung.cancelled(), 3);
}

/// A backend that reads the request and closes the connection without an answer (a crashing
/// server behind a listening socket) is a failure of the endpoint: 502 `upstream_error` (not
/// retried: it may have run), and after `LLB_PD_ORIGIN_ERR_THRESHOLD` (3) of them the breaker
/// takes it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_drops_requests_is_taken_out_by_the_breaker() {
    // Read the head (and body), then close without a response.
    breaker_takes_out(raw_backend(b"").await, |r| {
        assert_eq!(r.body["error"]["type"], "upstream_error", "{}", r.body);
    })
    .await;
}

/// A loopback backend that reads each request's head (and body) and then writes `answer` as
/// is; it closes the connection at once when `answer` is empty, else holds it 2 s (as a real
/// server would after an upgrade). Returns its port.
async fn raw_backend(answer: &'static [u8]) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                let _ = tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf)).await;
                if !answer.is_empty() {
                    let _ = s.write_all(answer).await;
                    let _ = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await;
                }
            });
        }
    });
    port
}

/// Round robin over the `bad` backend and a live one: the bad one's answers (each checked by
/// `check_502`) are 502 until `LLB_PD_ORIGIN_ERR_THRESHOLD` (3) of them open its breaker, then
/// only the live one answers.
async fn breaker_takes_out(bad: u16, check_502: impl Fn(&Resp)) {
    let live = Backend::start("live").await;
    let port = free_port();
    let d = started(&[rule(port, 0, &[(bad, 1), (live.port(), 1)], json!({}))]).await;
    let c = client();
    let mut seen = Vec::new();
    for _ in 0..9 {
        let r = chat(&c, port, json!({"model": "m"}), &[]).await;
        if r.status == 502 {
            check_502(&r);
        } else {
            assert_eq!((r.status, r.backend.as_deref()), (200, Some("live")));
        }
        seen.push(r.status);
    }
    assert_eq!(seen, [502, 200, 502, 200, 502, 200, 200, 200, 200]);
    assert!(
        d.log_text().contains("circuit breaker opened"),
        "{}",
        d.log_text()
    );
}

/// A backend that answers `101 Switching Protocols` to a request that asked for no upgrade
/// (loxi forwards none) is a bad answer: the client gets 502 `upstream_error` naming it (never
/// the 101, after which its connection would die), and after `LLB_PD_ORIGIN_ERR_THRESHOLD` (3)
/// of them the breaker takes the endpoint out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsolicited_101_is_502_and_counts_for_the_breaker() {
    let upgrader = raw_backend(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    )
    .await;
    breaker_takes_out(upgrader, |r| {
        let e = &r.body["error"];
        assert_eq!(
            (
                e["type"].as_str(),
                e["party"].as_str(),
                e["retryable"].as_bool()
            ),
            (Some("upstream_error"), Some("upstream"), Some(false)),
            "{}",
            r.body
        );
        assert_eq!(
            e["message"],
            "backend 0 failed: answered 101 Switching Protocols to a request that asked for \
             no protocol upgrade",
            "{}",
            r.body
        );
    })
    .await;
}

#[tokio::test]
async fn all_endpoints_dead_is_502_backend_unreachable() {
    let port = free_port();
    let _d = started(&[rule(
        port,
        0,
        &[(dead_port(), 1), (dead_port(), 1)],
        json!({}),
    )])
    .await;
    let r = chat(&client(), port, json!({"model": "m"}), &[]).await;
    assert_eq!(r.status, 502);
    assert_eq!(r.body["error"]["type"], "backend_unreachable");
    assert_eq!(r.body["error"]["party"], "upstream");
    assert_eq!(r.body["error"]["retryable"], true);
}

#[tokio::test]
async fn model_pools_route_by_model_then_wildcard_then_503() {
    let (llama, any) = (Backend::start("llama").await, Backend::start("any").await);
    let port = free_port();
    let d = started(&[
        rule(
            port,
            0,
            &[(llama.port(), 1)],
            json!({"model_name": "llama"}),
        ),
        rule(port, 0, &[(any.port(), 1)], json!({})),
    ])
    .await;
    let c = client();
    let r = chat(&c, port, json!({"model": "llama"}), &[]).await;
    assert_eq!(r.backend.as_deref(), Some("llama"));
    assert_eq!(
        chat(&c, port, json!({"model": "Llama"}), &[])
            .await
            .backend
            .as_deref(),
        Some("any"),
        "case-sensitive"
    );
    assert_eq!(
        chat(&c, port, json!({"model": "qwen"}), &[("x-model", "llama")])
            .await
            .backend
            .as_deref(),
        Some("llama"),
        "X-Model wins"
    );
    // A chunked body is read too.
    let chunks = vec![
        Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"{\"model\": \"lla"))),
        Ok(Frame::data(Bytes::from_static(
            b"ma\", \"prompt\": \"hi\"}",
        ))),
    ];
    let body = StreamBody::new(futures::stream::iter(chunks)).boxed();
    let r = send(&c, post_req(port, "/v1/completions", &[], body)).await;
    assert_eq!(
        r.backend.as_deref(),
        Some("llama"),
        "chunked body routed by its model"
    );
    assert_eq!(
        llama.requests().last().expect("req").body.as_ref(),
        b"{\"model\": \"llama\", \"prompt\": \"hi\"}"
    );
    // Remove the wildcard pool: unknown models now get 404 model_not_found (not retryable).
    let (status, body) = d
        .delete_rule("127.0.0.1", port, "tcp", Some("model_name="))
        .await;
    assert_eq!(status, 200, "{body}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = chat(&c, port, json!({"model": "qwen"}), &[]).await;
        if r.status == 404 {
            assert_eq!(r.body["error"]["type"], "model_not_found");
            assert_eq!(r.body["error"]["party"], "client");
            assert_eq!(r.body["error"]["retryable"], false);
            break;
        }
        assert!(Instant::now() < deadline, "wildcard pool still serving");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        chat(&c, port, json!({"model": "llama"}), &[]).await.status,
        200
    );
}

/// A body over `LOXI_MAX_BODY_BYTES` (32 MiB) is 413 in the JSON shape, and a client that is
/// still sending it (hyper's, which reports a failed body write instead of the answer) gets
/// the 413: the gateway answers when the `Content-Length` says too much and reads the body to
/// its end (within 2 s) before it closes. With the drain cut at the limit, the unread rest got
/// the client a reset (`Broken pipe`, seen in CI).
#[tokio::test]
async fn oversized_body_is_413_json() {
    let b = Backend::start("0").await;
    let port = free_port();
    let _d = started(&[rule(port, 0, &[(b.port(), 1)], json!({}))]).await;
    let big = format!(
        "{{\"model\":\"m\",\"prompt\":\"{}\"}}",
        "x".repeat(48 << 20)
    );
    let r = send(&client(), post_req(port, "/v1/completions", &[], full(big))).await;
    assert_eq!(r.status, 413);
    assert_eq!(r.body["error"]["type"], "request_too_large");
    assert_eq!(r.body["error"]["party"], "client");
    assert_eq!(b.request_count(), 0);
}

#[tokio::test]
async fn non_json_body_is_forwarded_unchanged() {
    let b = Backend::start("0").await;
    let port = free_port();
    let _d = started(&[rule(port, 8, &[(b.port(), 1)], json!({}))]).await;
    let payload = b"plain text, {not json".to_vec();
    let req = http::Request::post(format!("http://127.0.0.1:{port}/upload?x=1"))
        .header("content-type", "text/plain")
        .header("x-custom", "kept")
        .body(full(payload.clone()))
        .expect("req");
    let r = send(&client(), req).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let got = b.requests().pop().expect("request reached the backend");
    assert_eq!(got.body.as_ref(), payload.as_slice());
    assert_eq!(got.uri, "/upload?x=1");
    assert_eq!(got.header("x-custom"), Some("kept"));
}

/// A client on a raw TCP connection to the VIP: sends one HTTP/1.1 request, reads what comes
/// back, and gives up (closes the socket) whenever the test says so.
struct GivingUpClient {
    s: TcpStream,
    got: Vec<u8>,
}

impl GivingUpClient {
    async fn send(port: u16, body: &str, headers: &str) -> Self {
        let mut s = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n{headers}content-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.expect("write");
        Self { s, got: Vec::new() }
    }

    /// Reads until `done(received so far)` holds; panics after 5 s or on EOF.
    async fn read_until(&mut self, done: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buf = [0u8; 4096];
        while !done(&String::from_utf8_lossy(&self.got)) {
            let left = deadline.saturating_duration_since(Instant::now());
            let n = tokio::time::timeout(left, self.s.read(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("timed out; got {:?}", self.text()))
                .expect("read");
            assert!(n > 0, "proxy closed the connection; got {:?}", self.text());
            self.got.extend_from_slice(&buf[..n]);
        }
    }

    /// Nothing at all has arrived yet (a request still waiting for its response).
    fn nothing_received(&mut self) -> bool {
        let mut buf = [0u8; 64];
        matches!(self.s.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            && self.got.is_empty()
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.got).into_owned()
    }

    /// Closes the connection; returns when it was closed.
    fn give_up(self) -> Instant {
        drop(self.s);
        Instant::now()
    }
}

/// SSE events `data: {..."i":N}` received so far.
fn sse_events(text: &str) -> usize {
    text.matches("\"i\":").count()
}

/// The in-flight gauge of endpoint 0 (`loxilb_proxy_active_connections{ep_idx="0"}`).
async fn in_flight(d: &Daemon) -> Option<f64> {
    let m = d.metrics_text().await;
    metric(&m, "loxilb_proxy_active_connections", &["ep_idx=\"0\""])
}

async fn gauge_returns_to_zero(d: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let v = in_flight(d).await;
        if v == Some(0.0) {
            return;
        }
        assert!(Instant::now() < deadline, "in-flight gauge stuck at {v:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `b` has received `n` requests.
async fn wait_received(b: &Backend, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.request_count() < n {
        assert!(
            Instant::now() < deadline,
            "request never reached the backend"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The upstream request was aborted within 1 s of `gave_up` and never completed.
async fn assert_upstream_aborted_within_1s(b: &Backend, gave_up: Instant) {
    let seen = b.wait_cancelled(1, Duration::from_secs(1)).await;
    let took = gave_up.elapsed();
    assert!(seen, "backend did not see the cancellation within 1 s");
    assert_eq!((b.cancelled(), b.completed()), (1, 0));
    eprintln!("scenario 18: upstream aborted {took:?} after the client gave up");
}

#[tokio::test]
async fn scenario_18_client_disconnect_cancels_non_streaming_upstream() {
    let b = Backend::start("0").await;
    let port = free_port();
    let d = started(&[rule(port, 0, &[(b.port(), 1)], json!({}))]).await;
    let start = Instant::now();
    // A long non-streaming completion: the backend answers after 10 s.
    let mut c = GivingUpClient::send(
        port,
        r#"{"model":"m","prompt":"long","stream":false}"#,
        "x-delay-ms: 10000\r\n",
    )
    .await;
    wait_received(&b, 1).await;
    tokio::time::sleep_until((start + Duration::from_millis(200)).into()).await;
    assert_eq!(
        in_flight(&d).await,
        Some(1.0),
        "in flight before the disconnect"
    );
    assert!(c.nothing_received(), "still waiting: {:?}", c.text());
    let gave_up = c.give_up();
    eprintln!("scenario 18: client gave up {:?} in", gave_up - start);
    assert_upstream_aborted_within_1s(&b, gave_up).await;
    gauge_returns_to_zero(&d).await;
}

#[tokio::test]
async fn scenario_18_client_disconnect_cancels_streaming_upstream() {
    let b = Backend::start("0").await;
    let port = free_port();
    let d = started(&[rule(port, 0, &[(b.port(), 1)], json!({}))]).await;
    let start = Instant::now();
    // stream: true → the backend streams 20 events 100 ms apart (2 s).
    let mut c =
        GivingUpClient::send(port, r#"{"model":"m","prompt":"long","stream":true}"#, "").await;
    // Mid-stream: at least two events received and 200 ms into the request.
    c.read_until(|t| sse_events(t) >= 2).await;
    tokio::time::sleep_until((start + Duration::from_millis(200)).into()).await;
    assert!(c.text().starts_with("HTTP/1.1 200"), "{:?}", c.text());
    assert!(!c.text().contains("[DONE]"), "stream already over");
    assert_eq!(
        in_flight(&d).await,
        Some(1.0),
        "in flight before the disconnect"
    );
    let received = sse_events(&c.text());
    let gave_up = c.give_up();
    eprintln!(
        "scenario 18: client gave up {:?} in, after {received} events",
        gave_up - start
    );
    assert_upstream_aborted_within_1s(&b, gave_up).await;
    let written = b.sse_written().len();
    assert!(
        (received..20).contains(&written),
        "backend wrote {written} of 20 events"
    );
    gauge_returns_to_zero(&d).await;
}

#[tokio::test]
async fn scenario_19_sse_events_are_flushed_as_written() {
    let b = Backend::start("0").await;
    let port = free_port();
    let _d = started(&[rule(port, 0, &[(b.port(), 1)], json!({"sse_mode": true}))]).await;
    let req = post_req(
        port,
        "/v1/chat/completions",
        &[("x-sse", "50:100")],
        full(json!({"model": "m", "stream": true}).to_string()),
    );
    let resp = client().request(req).await.expect("response");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut text = String::new();
    let mut arrivals: Vec<Instant> = Vec::new();
    let mut done = false;
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(5), body.frame())
        .await
        .expect("next frame in time")
    {
        let now = Instant::now();
        if let Ok(data) = frame.expect("frame").into_data() {
            text.push_str(&String::from_utf8_lossy(&data));
            while let Some(pos) = text.find("\n\n") {
                let event: String = text.drain(..pos + 2).collect();
                if event.contains("[DONE]") {
                    done = true;
                } else {
                    assert!(
                        event.contains(&format!("\"i\":{}", arrivals.len())),
                        "out of order: {event}"
                    );
                    arrivals.push(now);
                }
            }
        }
    }
    assert!(done, "data: [DONE] must arrive");
    let written = b.sse_written();
    assert_eq!(written.len(), 50);
    assert_eq!(arrivals.len(), 50);
    let mut worst = Duration::ZERO;
    for (i, (got, sent)) in arrivals.iter().zip(&written).enumerate() {
        let lag = got.saturating_duration_since(*sent);
        worst = worst.max(lag);
        assert!(
            lag < Duration::from_millis(50),
            "event {i} arrived {lag:?} after it was written"
        );
    }
    eprintln!(
        "scenario 19: worst event lag {worst:?} over {} events",
        arrivals.len()
    );
}

#[tokio::test]
async fn rules_added_updated_and_deleted_at_runtime() {
    let (a, bk) = (Backend::start("a").await, Backend::start("b").await);
    let port = free_port();
    let d = started(&[rule(port, 0, &[(a.port(), 1)], json!({}))]).await;
    let c = client();
    assert_eq!(
        chat(&c, port, json!({"model": "m"}), &[])
            .await
            .backend
            .as_deref(),
        Some("a")
    );
    // Update the endpoints: traffic moves to b without a restart.
    post(&d, &rule(port, 0, &[(bk.port(), 1)], json!({}))).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while chat(&c, port, json!({"model": "m"}), &[])
        .await
        .backend
        .as_deref()
        != Some("b")
    {
        assert!(Instant::now() < deadline, "update not applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A second service on another port.
    let port2 = free_port();
    post(&d, &rule(port2, 0, &[(a.port(), 1)], json!({}))).await;
    wait_open(port2).await;
    assert_eq!(
        chat(&c, port2, json!({"model": "m"}), &[])
            .await
            .backend
            .as_deref(),
        Some("a")
    );
    // Delete the first: its listener closes, the second keeps serving.
    let (status, body) = d.delete_rule("127.0.0.1", port, "tcp", None).await;
    assert_eq!(status, 200, "{body}");
    wait_closed(port).await;
    assert_eq!(
        chat(&c, port2, json!({"model": "m"}), &[]).await.status,
        200
    );
}

#[tokio::test]
async fn failing_backend_status_is_passed_through_and_counted() {
    let b = Backend::start("0").await;
    b.set_mode(Mode::Fail);
    let port = free_port();
    let d = started(&[rule(port, 0, &[(b.port(), 1)], json!({}))]).await;
    let r = chat(&client(), port, json!({"model": "m"}), &[]).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.body["error"], "told to fail");
    let m = d.metrics_text().await;
    assert_eq!(
        metric(
            &m,
            "loxilb_proxy_requests_total",
            &["class=\"5xx\"", "ep_idx=\"0\""]
        ),
        Some(1.0)
    );
    assert!(
        metric(
            &m,
            "loxilb_proxy_selections_total",
            &["selector=\"rr\"", "reason=\"rr\""]
        )
        .is_some()
    );
}

#[tokio::test]
async fn breaker_opens_after_three_5xx_then_503_no_healthy_backend() {
    let b = Backend::start("0").await;
    b.set_mode(Mode::Fail);
    let port = free_port();
    let d = started(&[rule(port, 0, &[(b.port(), 1)], json!({}))]).await;
    let state = |rules: serde_json::Value| rules["lbAttr"][0]["endpoints"][0]["state"].clone();
    assert_eq!(state(d.rules().await), json!("active"));
    let c = client();
    for _ in 0..3 {
        assert_eq!(chat(&c, port, json!({"model": "m"}), &[]).await.status, 500);
    }
    assert_eq!(
        state(d.rules().await),
        json!("inactive"),
        "GET .../all reports the open breaker"
    );
    let r = chat(&c, port, json!({"model": "m"}), &[]).await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.body["error"]["type"], "no_healthy_backend");
    assert_eq!(r.body["error"]["retryable"], true);
    assert_eq!(
        b.request_count(),
        3,
        "an open breaker sends nothing to the endpoint"
    );
}

#[tokio::test]
async fn probes_hold_a_dead_endpoint_down_and_bring_it_back() {
    let port = free_port();
    let ep_port = dead_port();
    let _d = started(&[rule(
        port,
        0,
        &[(ep_port, 1)],
        json!({"monitor": true, "probetype": "tcp", "probeRetries": 1}),
    )])
    .await;
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = chat(&c, port, json!({"model": "m"}), &[]).await;
        if r.status == 503 {
            assert_eq!(r.body["error"]["type"], "no_healthy_backend");
            break;
        }
        assert_eq!(r.status, 502, "before the first probe: unreachable");
        assert!(
            Instant::now() < deadline,
            "probe never marked the endpoint down"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let b = Backend::bind(
        "back",
        std::net::SocketAddr::from(([127, 0, 0, 1], ep_port)),
    )
    .await
    .expect("rebind port");
    let deadline = Instant::now() + Duration::from_secs(5);
    while chat(&c, port, json!({"model": "m"}), &[]).await.status != 200 {
        assert!(
            Instant::now() < deadline,
            "probe never brought the endpoint back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(b.request_count() >= 1);
}

#[tokio::test]
async fn h2c_prior_knowledge_is_served_on_the_same_port() {
    let bs = backends(2).await;
    let port = free_port();
    let _d = started(&[rule(port, 0, &eps(&bs), json!({}))]).await;
    let h2: Client<HttpConnector, Body> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let mut seen = Vec::new();
    for _ in 0..4 {
        let req = http::Request::post(format!("http://127.0.0.1:{port}/v1/completions"))
            .header("content-type", "application/json")
            .body(full(json!({"model": "m", "prompt": "hi"}).to_string()))
            .expect("req");
        let r = send(&h2, req).await;
        assert_eq!(r.status, 200, "{}", r.body);
        seen.push(r.endpoint.expect("ep"));
    }
    assert_eq!(seen, vec![0, 1, 0, 1]);
    // The client's `:authority` reaches the backends as `Host` (RFC 9113 §8.3.1), as an
    // HTTP/1.1 client's `Host` does, not the endpoint's own address.
    for b in &bs {
        for r in b.requests() {
            assert_eq!(r.header("host"), Some(format!("127.0.0.1:{port}").as_str()));
        }
    }
}

#[tokio::test]
async fn deleting_the_last_rule_lets_in_flight_requests_finish() {
    let b = Backend::start("0").await;
    let port = free_port();
    let d = started(&[rule(port, 0, &[(b.port(), 1)], json!({}))]).await;
    let c = client();
    let slow = {
        let c = c.clone();
        tokio::spawn(async move {
            chat(&c, port, json!({"model": "m"}), &[("x-delay-ms", "800")]).await
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.request_count() == 0 {
        assert!(Instant::now() < deadline, "slow request never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (status, body) = d.delete_rule("127.0.0.1", port, "tcp", None).await;
    assert_eq!(status, 200, "{body}");
    wait_closed(port).await;
    let r = slow.await.expect("join");
    assert_eq!(
        r.status, 200,
        "the in-flight request completes after the delete"
    );
    assert_eq!(r.backend.as_deref(), Some("0"));
    assert_eq!(b.cancelled(), 0);
}

/// Issue 14 §6: LoxiLB's `loxilb_ai_*` request families, labelled by the rule's model (or
/// `other` for the wildcard pool, whatever model the client names), counted when the
/// response ends; `loxilb_ai_active_streams` holds an SSE response while it streams.
#[tokio::test]
async fn loxilb_ai_families_count_by_the_rules_model() {
    let (a, w) = (Backend::start("a").await, Backend::start("w").await);
    let port = free_port();
    let d = started(&[
        rule(port, 0, &[(a.port(), 1)], json!({"model_name": "llama"})),
        rule(port, 0, &[(w.port(), 1)], json!({})),
    ])
    .await;
    let c = client();
    let llama = r#"model="llama",tenant="",status="200""#;
    let other = r#"model="other",tenant="",status="200""#;
    let before = d.metrics_text().await;
    let at = |t: &str, n: &str| metric(t, "loxilb_ai_requests_total", &[n]).unwrap_or(0.0);
    for _ in 0..3 {
        let r = chat(&c, port, json!({"model": "llama"}), &[]).await;
        assert_eq!((r.status, r.backend.as_deref()), (200, Some("a")));
    }
    // Client-chosen model names land on the wildcard pool under `other`, not as new series.
    for m in ["qwen-a", "qwen-b"] {
        let r = chat(&c, port, json!({"model": m}), &[]).await;
        assert_eq!((r.status, r.backend.as_deref()), (200, Some("w")));
    }
    let mid = d.metrics_text().await;
    assert_eq!(at(&mid, llama) - at(&before, llama), 3.0, "{mid}");
    assert_eq!(at(&mid, other) - at(&before, other), 2.0, "{mid}");
    assert!(!mid.contains("qwen-a"), "client model names mint no series");
    let count = |t: &str| {
        metric(
            t,
            "loxilb_ai_request_duration_seconds_count",
            &[r#"model="llama""#],
        )
        .unwrap_or(0.0)
    };
    assert_eq!(count(&mid) - count(&before), 3.0);
    // An SSE response is an active stream until its body ends.
    let req = post_req(
        port,
        "/v1/chat/completions",
        &[("x-sse", "30:100")],
        full(json!({"model": "llama", "stream": true}).to_string()),
    );
    let resp = c.request(req).await.expect("response");
    assert_eq!(resp.status(), 200);
    let streams =
        |t: &str| metric(t, "loxilb_ai_active_streams", &[r#"model="llama""#]).unwrap_or(-1.0);
    assert_eq!(streams(&d.metrics_text().await), 1.0, "one stream open");
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    assert!(String::from_utf8_lossy(&bytes).contains("[DONE]"));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let t = d.metrics_text().await;
        if streams(&t) == 0.0 {
            assert_eq!(at(&t, llama) - at(&before, llama), 4.0, "{t}");
            break;
        }
        assert!(Instant::now() < deadline, "stream gauge stuck: {t}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The names of the daemon's fullproxy connection-worker threads (`loxi-proxy-N`), sorted.
fn worker_threads(pid: u32) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("task dir")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .filter(|n| n.starts_with("loxi-proxy-"))
        .collect();
    names.sort();
    names
}

/// One keep-alive client connection to the VIP that has been answered once (200); it stays
/// open while the returned handle lives.
async fn answered_connection(port: u16) -> hyper::client::conn::http1::SendRequest<Body> {
    let tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = http::Request::post("/v1/chat/completions")
        .header("host", "vip")
        .header("content-type", "application/json")
        .body(full(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
        ))
        .expect("request");
    let resp = send.send_request(req).await.expect("response");
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.expect("body");
    send
}

/// `--proxy-workers 3`: three named connection workers; six open client connections are
/// spread two per worker (the least busy takes the next one), each answered, and the gauge
/// returns to 0 once they close. `--proxy-workers 0` starts no worker (and exports no gauge)
/// and serves the same connections on the shared runtime.
#[tokio::test]
async fn connection_workers_share_the_open_connections_and_0_keeps_the_shared_runtime() {
    let bs = backends(2).await;
    for workers in [3usize, 0] {
        let port = free_port();
        let d = Daemon::start(DaemonOpts {
            args: vec!["--proxy-workers".into(), workers.to_string()],
            ..Default::default()
        })
        .await;
        post(&d, &rule(port, 0, &eps(&bs), json!({}))).await;
        wait_open(port).await;
        let want: Vec<String> = (1..=workers).map(|i| format!("loxi-proxy-{i}")).collect();
        assert_eq!(worker_threads(d.pid().expect("pid")), want);
        let mut conns = Vec::new();
        for _ in 0..6 {
            conns.push(answered_connection(port).await);
        }
        let gauge = "loxilb_proxy_worker_connections";
        let text = d.metrics_text().await;
        let per_worker: Vec<Option<f64>> = (1..=workers)
            .map(|w| metric(&text, gauge, &[&format!("worker=\"{w}\"")]))
            .collect();
        assert_eq!(per_worker, vec![Some(2.0); workers], "{text}");
        if workers == 0 {
            assert!(!text.contains(gauge), "no workers, no gauge");
        }
        drop(conns);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let text = d.metrics_text().await;
            let open: f64 = (1..=workers)
                .filter_map(|w| metric(&text, gauge, &[&format!("worker=\"{w}\"")]))
                .sum();
            if open == 0.0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "connections still counted: {text}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A rule change is in effect when the API acknowledges it: the fullproxy applies each rule
/// snapshot on its own task, and the `POST` waits for it (and for the KV tier and L4 data
/// paths), so the first request after a `200` already goes by the new endpoint set. Each
/// round swaps the rule's only endpoint and sends one request at once. (The window this
/// closes is short; `api::rules` tests the wait itself with followers that lag.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_change_is_in_effect_when_acknowledged() {
    let bs = backends(2).await;
    let port = free_port();
    let d = started(&[rule(port, 0, &eps(&bs[..1]), json!({}))]).await;
    let c = client();
    for round in 0..40 {
        let b = &bs[(round + 1) % 2];
        post(&d, &rule(port, 0, &[(b.port(), 1)], json!({}))).await;
        let r = chat(
            &c,
            port,
            json!({"model": "m", "messages": [{"role": "user", "content": "q"}]}),
            &[],
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            (r.backend.as_deref(), r.endpoint),
            (Some(b.name()), Some(0)),
            "round {round}: the request right after the 200 went by the old rule"
        );
    }
    // Every data path (fullproxy, KV tier, L4) marked each change: none was acknowledged on
    // the settle timeout.
    assert!(
        !d.log_text().contains("have not applied it yet"),
        "{}",
        d.log_text()
    );
}

/// Two rules that forward to each other (127.0.0.1:A → 127.0.0.1:B → 127.0.0.1:A; each is
/// valid alone): the request comes back to the gateway carrying its own hop id and is
/// answered 508 `loop_detected` at once, instead of opening connections until descriptors and
/// memory run out (8,000–16,000 descriptors and 0.5–2 GB for one request before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarding_loop_through_two_rules_is_508_at_once() {
    let (a, b) = (free_port(), free_port());
    let d = started(&[
        rule(a, 0, &[(b, 1)], json!({})),
        rule(b, 0, &[(a, 1)], json!({})),
    ])
    .await;
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", d.pid().expect("pid")))
            .map(|r| r.count())
            .unwrap_or(0)
    };
    let before = fds();
    let c = client();
    // `GET /v1/models` fans out with the hop id too: b's listener refuses a's fan-out 508 at
    // once, and the client's 502 names the loop (before, the fan-out carried no hop id and
    // went round until `LOXI_MODELS_TIMEOUT_MS`, 2 s, ended it as "no answer"). Asked first:
    // the 508s below count against the endpoint's breaker, and the fan-out skips it then.
    let started = Instant::now();
    let req = http::Request::get(format!("http://127.0.0.1:{a}/v1/models"))
        .body(full(Bytes::new()))
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(20), c.request(req))
        .await
        .expect("answer within 20 s")
        .expect("answer");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    let v: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["error"]["type"], "models_unavailable", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("status 508: a forwarding loop"), "{msg}");
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    let started = Instant::now();
    for _ in 0..3 {
        let r = chat(&c, a, json!({"model": "m"}), &[]).await;
        assert_eq!(r.status, 508, "{}", r.body);
        assert_eq!(r.body["error"]["type"], "loop_detected", "{}", r.body);
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(fds() < before + 64, "descriptors {before} → {}", fds());
}
