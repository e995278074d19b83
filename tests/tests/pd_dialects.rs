//! The SGLang and TensorRT-LLM P/D handoff dialects and the decode-leg timeouts of every
//! dialect, end to end: the real `loxilb` daemon in front of small fake engines (hyper servers
//! on loopback) that record the exact body, request id and arrival time of every leg, answer
//! as each test scripts them, and count the legs loxi aborts (a connection dropped before the
//! answer was sent).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use loxi_tests::harness::{Daemon, DaemonOpts, free_port, loopback_pd_rid_prefix};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};

use loxi_tests::http::{Resp, TestClient, client, full, metric};

async fn send(c: &TestClient, path: &str, port: u16, body: &Value) -> Resp {
    let req = http::Request::post(format!("http://127.0.0.1:{port}{path}"))
        .header("content-type", "application/json")
        .body(full(body.to_string()))
        .expect("request");
    loxi_tests::http::send(c, req).await
}

/// Waits until every `loxilb_proxy_active_connections` sample is 0.
async fn gauges_return_to_zero(d: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = d.metrics_text().await;
        let active: f64 = m
            .lines()
            .filter(|l| l.starts_with("loxilb_proxy_active_connections{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if active == 0.0 {
            return;
        }
        assert!(Instant::now() < deadline, "in-flight gauges stuck: {m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A P/D rule on `port`: endpoint 0 the prefill at `pre`, endpoint 1 the decode at `dec`.
fn rule(port: u16, pre: u16, dec: u16, extra: Value) -> Value {
    let mut svc = json!({"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4,
        "sel": 0, "pd_disagg_mode": true});
    if let (Some(o), Some(e)) = (svc.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    json!({"serviceArguments": svc, "endpoints": [
        {"endpointIP": "127.0.0.1", "targetPort": pre, "ep_role": 1},
        {"endpointIP": "127.0.0.1", "targetPort": dec, "ep_role": 2}]})
}

async fn post(d: &Daemon, rule: &Value) {
    let (status, body) = d.post_rule(rule).await;
    assert!(
        status == 200 || status == 201,
        "rule rejected: {status} {body}"
    );
    let port = rule["serviceArguments"]["port"].as_u64().expect("port") as u16;
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(Instant::now() < deadline, "listener on {port} did not open");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How a [`Fake`] engine answers.
#[derive(Clone)]
enum Act {
    /// `status` with this body (JSON, or SSE when `sse`), after `delay`.
    Answer {
        status: u16,
        body: String,
        sse: bool,
        delay: Duration,
    },
    /// Read the request, then close the connection without an answer after this long.
    Close(Duration),
    /// Never answer.
    Hang,
}

fn json_after(status: u16, body: &Value, delay: Duration) -> Act {
    Act::Answer {
        status,
        body: body.to_string(),
        sse: false,
        delay,
    }
}

/// One request a [`Fake`] received.
#[derive(Clone, Debug)]
struct Seen {
    rid: Option<String>,
    body: Value,
    at: Instant,
}

/// Counts an answer that was never finished (the connection dropped first).
struct Unfinished(Arc<AtomicUsize>, bool);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A fake engine: records every request and answers with its current [`Act`].
struct Fake {
    addr: SocketAddr,
    act: Arc<Mutex<Act>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    aborted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Fake {
    async fn start(act: Act) -> Fake {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let act = Arc::new(Mutex::new(act));
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let aborted: Arc<AtomicUsize> = Arc::default();
        let (a2, s2, ab2) = (act.clone(), seen.clone(), aborted.clone());
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (act, seen, aborted) = (a2.clone(), s2.clone(), ab2.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let (act, seen, aborted) = (act.clone(), seen.clone(), aborted.clone());
                        async move { answer(req, &act, &seen, aborted).await }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        Fake {
            addr,
            act,
            seen,
            aborted,
            task,
        }
    }
    fn port(&self) -> u16 {
        self.addr.port()
    }
    fn set(&self, act: Act) {
        *self.act.lock() = act;
    }
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().clone()
    }
    async fn wait_aborted(&self, n: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.aborted.load(Ordering::SeqCst) < n {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }
}

async fn answer(
    req: http::Request<hyper::body::Incoming>,
    act: &Mutex<Act>,
    seen: &Mutex<Vec<Seen>>,
    aborted: Arc<AtomicUsize>,
) -> Result<http::Response<Full<Bytes>>, std::io::Error> {
    let at = Instant::now();
    let rid = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let b = req.into_body().collect().await.map(|c| c.to_bytes());
    let body = b
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    seen.lock().push(Seen { rid, body, at });
    let mut guard = Unfinished(aborted, false);
    let act = act.lock().clone();
    match act {
        Act::Answer {
            status,
            body,
            sse,
            delay,
        } => {
            tokio::time::sleep(delay).await;
            guard.1 = true;
            let ctype = if sse {
                "text/event-stream"
            } else {
                "application/json"
            };
            let r = http::Response::builder()
                .status(status)
                .header("content-type", ctype)
                .header("x-engine", "fake")
                .body(Full::new(Bytes::from(body)))
                .expect("response");
            Ok(r)
        }
        Act::Close(delay) => {
            tokio::time::sleep(delay).await;
            guard.1 = true;
            Err(std::io::Error::other("closing without an answer"))
        }
        Act::Hang => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Err(std::io::Error::other("unreachable"))
        }
    }
}

fn chat_answer(text: &str) -> Value {
    json!({"id": "chatcmpl-d", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
        "finish_reason": "stop"}]})
}

#[tokio::test]
async fn sglang_sends_both_legs_at_once_with_one_bootstrap_and_answers_with_the_decode() {
    let pre = Fake::start(json_after(
        200,
        &json!({"id": "prefill-side", "choices": []}),
        Duration::from_millis(400),
    ))
    .await;
    let dec = Fake::start(json_after(200, &chat_answer("decoded"), Duration::ZERO)).await;
    let port = free_port();
    let d = Daemon::start_default().await;
    post(
        &d,
        &rule(
            port,
            pre.port(),
            dec.port(),
            json!({"kvEngineType": "sglang", "pdBootstrapPort": 9998}),
        ),
    )
    .await;
    let c = client();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5, "x_client_field": [1, null]});
    let t = Instant::now();
    let r = send(&c, "/v1/chat/completions", port, &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json(), chat_answer("decoded"), "the decode's answer");
    assert_eq!(
        (
            r.header("x-loxilb-endpoint"),
            r.header("x-loxilb-prefill-endpoint")
        ),
        (Some("1"), Some("0"))
    );
    assert!(
        t.elapsed() >= Duration::from_millis(390),
        "the prefill's answer is awaited"
    );
    let (p, q) = (pre.seen(), dec.seen());
    assert_eq!((p.len(), q.len()), (1, 1));
    assert_eq!(p[0].body, q[0].body, "one body for both legs");
    let room = p[0].body["bootstrap_room"].as_u64().expect("integer room");
    assert!(room < 1 << 63, "63-bit room: {room}");
    let mut want = body.clone();
    want["bootstrap_host"] = json!("127.0.0.1");
    want["bootstrap_port"] = json!(9998);
    want["bootstrap_room"] = json!(room);
    assert_eq!(q[0].body, want, "the client's body plus the three fields");
    assert!(
        q[0].at < p[0].at + Duration::from_millis(400),
        "the decode leg arrived before the prefill answered"
    );
    let rid = p[0].rid.clone().expect("request id");
    assert_eq!(q[0].rid.as_deref(), Some(rid.as_str()));

    // Streaming passes the decode's events through; a new room each request.
    let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n";
    dec.set(Act::Answer {
        status: 200,
        body: sse.into(),
        sse: true,
        delay: Duration::ZERO,
    });
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = send(&c, "/v1/chat/completions", port, &sbody).await;
    assert_eq!((r.status, r.text.as_str()), (200, sse));
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let (p, q) = (pre.seen(), dec.seen());
    assert_eq!(p[1].body, q[1].body);
    assert_eq!(q[1].body["stream"], json!(true), "streaming stays as asked");
    assert_ne!(q[1].body["bootstrap_room"], json!(room));

    // Read back: the port as posted; an SGLang P/D rule without it stores SGLang's 8998.
    let port2 = free_port();
    post(
        &d,
        &rule(
            port2,
            pre.port(),
            dec.port(),
            json!({"kvEngineType": "sglang"}),
        ),
    )
    .await;
    let rules = d.rules().await.to_string();
    for (p, want) in [(port, 9998), (port2, 8998)] {
        let all: Value = serde_json::from_str(&rules).expect("json");
        let got = all["lbAttr"]
            .as_array()
            .expect("lbAttr")
            .iter()
            .find(|r| r["serviceArguments"]["port"] == json!(p))
            .map(|r| r["serviceArguments"]["pdBootstrapPort"].clone());
        assert_eq!(got, Some(json!(want)), "{rules}");
    }
    let m = d.metrics_text().await;
    assert_eq!(metric(&m, "loxilb_ai_pd_requests_total", &[]), 2.0, "{m}");
    gauges_return_to_zero(&d).await;
}

#[tokio::test]
async fn sglang_a_failed_leg_aborts_the_other_and_a_prefill_4xx_is_relayed_verbatim() {
    let refusal = json!({"object": "error", "message": "prompt too long", "code": 400});
    let pre = Fake::start(json_after(400, &refusal, Duration::from_millis(200))).await;
    let dec = Fake::start(Act::Hang).await;
    let port = free_port();
    let d = Daemon::start_default().await;
    post(
        &d,
        &rule(
            port,
            pre.port(),
            dec.port(),
            json!({"kvEngineType": "sglang"}),
        ),
    )
    .await;
    let c = client();
    let body = json!({"model": "m", "prompt": "x", "max_tokens": 5});
    let r = send(&c, "/v1/completions", port, &body).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.text, refusal.to_string(), "verbatim");
    assert_eq!(r.header("x-engine"), Some("fake"));
    let rid = pre.seen().last().and_then(|s| s.rid.clone());
    assert!(rid.is_some());
    assert_eq!(
        (
            r.header("x-request-id"),
            r.header("x-loxilb-prefill-endpoint"),
            r.header("x-loxilb-endpoint")
        ),
        (rid.as_deref(), Some("0"), None),
        "a relayed prefill answer names the prefill and the request id, no decode"
    );
    assert!(dec.wait_aborted(1).await, "the decode leg was aborted");
    // No pair served it: no decode choice is counted and nothing is pinned (the next request
    // is routed afresh, not by tier 0).
    let m = d.metrics_text().await;
    assert_eq!(
        metric(&m, "loxilb_ai_pd_tier_selected_total", &["leg=\"decode\""]),
        0.0,
        "{m}"
    );

    // A decode that closes without an answer (once the prefill leg is in): 502, and the
    // hanging prefill is aborted.
    pre.set(Act::Hang);
    dec.set(Act::Close(Duration::from_millis(300)));
    let r = send(&c, "/v1/completions", port, &body).await;
    assert_eq!(r.status, 502, "{}", r.text);
    assert_eq!(r.json()["error"]["type"], "pd_decode_backend_died");
    assert!(r.header("x-request-id").is_some_and(|id| !id.is_empty()));
    assert_eq!(
        (
            r.header("x-loxilb-prefill-endpoint"),
            r.header("x-loxilb-endpoint")
        ),
        (Some("0"), Some("1")),
        "the failing pair"
    );
    assert!(pre.wait_aborted(1).await, "the prefill leg was aborted");
    let m = d.metrics_text().await;
    for (reason, n) in [("pd_prefill_status", 1.0), ("pd_decode_backend_died", 1.0)] {
        let needle = format!("reason=\"{reason}\"");
        assert_eq!(
            metric(&m, "loxilb_ai_pd_failures_total", &[&needle]),
            n,
            "{reason}: {m}"
        );
    }
    // LoxiLB's family counts what the client got: the relayed 400 and the 502.
    for status in ["400", "502"] {
        let needle = format!("status=\"{status}\"");
        assert_eq!(
            metric(&m, "loxilb_ai_requests_total", &[&needle]),
            1.0,
            "{status}: {m}"
        );
    }
    assert_eq!((pre.seen().len(), dec.seen().len()), (2, 2));
    assert_eq!(
        metric(
            &m,
            "loxilb_ai_pd_tier_selected_total",
            &["leg=\"prefill\"", "tier=\"0\""]
        ),
        0.0,
        "the refused pair was not pinned: {m}"
    );
    gauges_return_to_zero(&d).await;
}

/// A prefill that refuses the connection sends SGLang's pair again to the next prefill under a
/// new request id naming it: the answer and the legs that served carry that one id.
#[tokio::test]
async fn an_sglang_prefill_that_refuses_is_replaced_under_a_new_request_id() {
    let held = tokio::net::TcpSocket::new_v4().expect("socket");
    held.bind(([127, 0, 0, 1], 0).into()).expect("bind");
    let dead = held.local_addr().expect("addr").port();
    let pre = Fake::start(json_after(200, &json!({"id": "p"}), Duration::ZERO)).await;
    let dec = Fake::start(json_after(200, &chat_answer("decoded"), Duration::ZERO)).await;
    let port = free_port();
    let d = Daemon::start_default().await;
    let mut r = rule(port, dead, dec.port(), json!({"kvEngineType": "sglang"}));
    r["endpoints"] = json!([
        {"endpointIP": "127.0.0.1", "targetPort": dead, "ep_role": 1},
        {"endpointIP": "127.0.0.1", "targetPort": pre.port(), "ep_role": 1},
        {"endpointIP": "127.0.0.1", "targetPort": dec.port(), "ep_role": 2}]);
    post(&d, &r).await;
    let c = client();
    let want = loopback_pd_rid_prefix(pre.port(), dec.port());
    for i in 0..4 {
        let body = json!({"model": "m", "prompt": format!("p{i}"), "max_tokens": 2});
        let resp = send(&c, "/v1/completions", port, &body).await;
        assert_eq!(resp.status, 200, "{}", resp.text);
        let rid = resp.header("x-request-id").unwrap_or_default().to_owned();
        assert!(rid.starts_with(&want), "request {i}: {rid}");
        let last = |f: &Fake| f.seen().last().and_then(|s| s.rid.clone());
        assert_eq!(last(&pre).as_deref(), Some(rid.as_str()), "request {i}");
        assert_eq!(last(&dec).as_deref(), Some(rid.as_str()), "request {i}");
        assert_eq!(
            dec.seen().last().map(|s| s.body["bootstrap_port"].clone()),
            Some(json!(8998))
        );
    }
    let m = d.metrics_text().await;
    let refused = metric(
        &m,
        "loxilb_proxy_upstream_connect_failures_total",
        &["ep_idx=\"0\""],
    );
    assert!(refused >= 1.0, "the dead prefill was tried: {m}");
    assert_eq!(pre.seen().len(), 4);

    // Only the dead prefill: its decode leg was in flight when the prefill refused, so the
    // 503 names the id that leg carried (the engine may have it), not nothing.
    let slow = Fake::start(json_after(
        200,
        &chat_answer("late"),
        Duration::from_secs(5),
    ))
    .await;
    let port = free_port();
    post(
        &d,
        &rule(port, dead, slow.port(), json!({"kvEngineType": "sglang"})),
    )
    .await;
    let body = json!({"model": "m", "prompt": "alone", "max_tokens": 2});
    let resp = send(&c, "/v1/completions", port, &body).await;
    assert_eq!(resp.status, 503, "{}", resp.text);
    let rid = resp.header("x-request-id").unwrap_or_default().to_owned();
    assert!(
        rid.starts_with(&loopback_pd_rid_prefix(dead, slow.port())),
        "{:?}",
        resp.headers
    );
    if let Some(seen) = slow.seen().last() {
        assert_eq!(seen.rid.as_deref(), Some(rid.as_str()));
    }
}

#[tokio::test]
async fn a_client_that_leaves_cancels_both_sglang_legs() {
    let pre = Fake::start(Act::Hang).await;
    let dec = Fake::start(Act::Hang).await;
    let port = free_port();
    let d = Daemon::start_default().await;
    post(
        &d,
        &rule(
            port,
            pre.port(),
            dec.port(),
            json!({"kvEngineType": "sglang"}),
        ),
    )
    .await;
    let c = client();
    let req = http::Request::post(format!("http://127.0.0.1:{port}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(json!({"prompt": "x"}).to_string())).boxed())
        .expect("request");
    let inflight = tokio::spawn(async move { c.request(req).await.map(|r| r.status()) });
    let deadline = Instant::now() + Duration::from_secs(5);
    while pre.seen().len() + dec.seen().len() < 2 {
        assert!(Instant::now() < deadline, "both legs were sent");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!inflight.is_finished(), "both legs hang: no answer yet");
    inflight.abort();
    let _ = inflight.await;
    assert!(pre.wait_aborted(1).await, "prefill leg cancelled");
    assert!(dec.wait_aborted(1).await, "decode leg cancelled");
    gauges_return_to_zero(&d).await;
}

#[tokio::test]
async fn trtllm_generation_carries_exactly_the_context_params_and_a_finished_context_answers() {
    let params = json!({"request_type": "context_only", "first_gen_tokens": [7],
        "ctx_request_id": 42, "encoded_opaque_state": "b64==", "draft_tokens": null,
        "x_future": {"a": [1, null]}});
    let ctx_answer = |finish: &str| {
        json!({"id": "cmpl-ctx", "object": "text_completion", "created": 3, "model": "m",
            "choices": [{"index": 0, "text": "A", "finish_reason": finish,
            "disaggregated_params": params}]})
    };
    let pre = Fake::start(json_after(200, &ctx_answer("length"), Duration::ZERO)).await;
    let sse = "data: {\"choices\":[{\"text\":\"B\"}]}\n\ndata: [DONE]\n\n";
    let dec = Fake::start(Act::Answer {
        status: 200,
        body: sse.into(),
        sse: true,
        delay: Duration::ZERO,
    })
    .await;
    let port = free_port();
    let d = Daemon::start_default().await;
    post(
        &d,
        &rule(
            port,
            pre.port(),
            dec.port(),
            json!({"kvEngineType": "trtllm"}),
        ),
    )
    .await;
    let c = client();
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 9, "stream": true,
        "stream_options": {"include_usage": true}, "x_client_field": 1});
    let r = send(&c, "/v1/completions", port, &body).await;
    assert_eq!((r.status, r.text.as_str()), (200, sse));
    let (p, q) = (pre.seen(), dec.seen());
    assert_eq!(
        p[0].body,
        json!({"model": "m", "prompt": "hello", "max_tokens": 9, "stream": false,
            "x_client_field": 1, "disaggregated_params": {"request_type": "context_only"}}),
        "the context leg"
    );
    let mut want_params = params.clone();
    want_params["request_type"] = json!("generation_only");
    let mut want = body.clone();
    want["disaggregated_params"] = want_params;
    assert_eq!(
        q[0].body, want,
        "the generation leg: the context's params, verbatim"
    );
    assert!(q[0].at >= p[0].at, "context first");
    assert_eq!(q[0].rid, p[0].rid);
    assert!(p[0].rid.is_some());

    // A context leg that already finished (stop at its first token) is the answer.
    pre.set(json_after(200, &ctx_answer("stop"), Duration::ZERO));
    let mut once = body.clone();
    once["stream"] = json!(false);
    let r = send(&c, "/v1/completions", port, &once).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let mut want = ctx_answer("stop");
    want["choices"][0]
        .as_object_mut()
        .expect("choice")
        .remove("disaggregated_params");
    assert_eq!(r.json(), want);
    assert_eq!(dec.seen().len(), 1, "no generation leg");
    // Traceable as the context leg's answer: its request id and endpoint, and no decode's.
    assert_eq!(
        (
            r.header("x-request-id"),
            r.header("x-loxilb-prefill-endpoint"),
            r.header("x-loxilb-endpoint")
        ),
        (pre.seen()[1].rid.as_deref(), Some("0"), None)
    );
    let r = send(&c, "/v1/completions", port, &body).await;
    assert_eq!(r.status, 200);
    assert!(
        r.text.contains("\"text\":\"A\"") && r.text.ends_with("data: [DONE]\n\n"),
        "{}",
        r.text
    );
    assert_eq!(dec.seen().len(), 1, "no generation leg");

    // KV-event routing over TensorRT-LLM stays refused.
    let (status, b) = d
        .post_rule(&rule(
            free_port(),
            pre.port(),
            dec.port(),
            json!({"kvEngineType": "trtllm", "kvExactMode": 1}),
        ))
        .await;
    let msg = b.to_string();
    assert_eq!(status, 400, "{msg}");
    assert!(
        msg.contains("serviceArguments.kvExactMode") && msg.contains("not implemented"),
        "{msg}"
    );
    gauges_return_to_zero(&d).await;
}

#[tokio::test]
async fn every_dialects_decode_is_502_when_it_closes_and_504_when_it_is_silent() {
    let pre_answer = json!({"id": "p", "kv_transfer_params": {"remote_engine_id": "e"},
        "choices": [{"index": 0, "text": "A", "finish_reason": "length",
        "disaggregated_params": {"request_type": "context_only", "ctx_request_id": 1}}]});
    let pre = Fake::start(json_after(200, &pre_answer, Duration::ZERO)).await;
    let dec = Fake::start(Act::Close(Duration::ZERO)).await;
    let opts = DaemonOpts::default().env("LLB_PD_DECODE_TIMEOUT_SEC", "1");
    let d = Daemon::start(opts).await;
    let c = client();
    let engines = ["vllm", "sglang", "trtllm"];
    let mut ports = Vec::new();
    for e in engines {
        let port = free_port();
        post(
            &d,
            &rule(port, pre.port(), dec.port(), json!({"kvEngineType": e})),
        )
        .await;
        ports.push(port);
    }
    let body = json!({"model": "m", "prompt": "x", "max_tokens": 5});
    for (e, port) in engines.iter().zip(&ports) {
        let r = send(&c, "/v1/completions", *port, &body).await;
        assert_eq!(r.status, 502, "{e}: {}", r.text);
        assert_eq!(r.json()["error"]["type"], "pd_decode_backend_died", "{e}");
    }
    dec.set(Act::Hang);
    for (i, (e, port)) in engines.iter().zip(&ports).enumerate() {
        let t = Instant::now();
        let r = send(&c, "/v1/completions", *port, &body).await;
        assert_eq!(r.status, 504, "{e}: {}", r.text);
        assert_eq!(r.json()["error"]["type"], "pd_decode_timeout", "{e}");
        assert!(
            t.elapsed() >= Duration::from_millis(950) && t.elapsed() < Duration::from_secs(4),
            "{e}: {:?}",
            t.elapsed()
        );
        assert!(
            dec.wait_aborted(i + 1).await,
            "{e}: the silent decode was dropped"
        );
    }
    let m = d.metrics_text().await;
    let total = |reason: &str| -> f64 {
        m.lines()
            .filter(|l| l.starts_with("loxilb_ai_pd_failures_total{"))
            .filter(|l| l.contains(&format!("reason=\"{reason}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(
        (total("pd_decode_backend_died"), total("pd_decode_timeout")),
        (3.0, 3.0),
        "{m}"
    );
    gauges_return_to_zero(&d).await;
}

#[tokio::test]
async fn a_client_handoff_field_is_400_on_a_p_d_rule_and_passes_a_plain_rule() {
    let pre_answer = json!({"id": "p", "choices": [{"index": 0, "text": "A",
        "finish_reason": "length"}]});
    let pre = Fake::start(json_after(200, &pre_answer, Duration::ZERO)).await;
    let dec_answer = json!({"id": "d", "choices": [{"index": 0, "text": "B"}]});
    let dec = Fake::start(json_after(200, &dec_answer, Duration::ZERO)).await;
    let d = Daemon::start_default().await;
    let c = client();
    let vllm = free_port();
    post(&d, &rule(vllm, pre.port(), dec.port(), json!({}))).await;
    let trtllm = free_port();
    post(
        &d,
        &rule(
            trtllm,
            pre.port(),
            dec.port(),
            json!({"kvEngineType": "trtllm"}),
        ),
    )
    .await;
    let sglang = free_port();
    post(
        &d,
        &rule(
            sglang,
            pre.port(),
            dec.port(),
            json!({"kvEngineType": "sglang"}),
        ),
    )
    .await;
    let cases = [
        (
            vllm,
            "kv_transfer_params",
            json!({"do_remote_prefill": true, "remote_host": "6.6.6.6", "remote_port": 1,
                "remote_block_ids": [1]}),
        ),
        (vllm, "kv_transfer_params", Value::Null),
        (
            trtllm,
            "disaggregated_params",
            json!({"request_type": "generation_only", "ctx_request_id": 666,
                "opaque_state": "evil"}),
        ),
        (sglang, "bootstrap_host", json!("6.6.6.6")),
        (sglang, "bootstrap_port", json!(1)),
        (sglang, "bootstrap_room", json!(7)),
    ];
    for (port, field, value) in cases {
        let mut body = json!({"model": "m", "prompt": "x", "max_tokens": 5});
        body[field] = value;
        let r = send(&c, "/v1/completions", port, &body).await;
        assert_eq!(r.status, 400, "{field}: {}", r.text);
        assert_eq!(r.header("content-type"), Some("application/json"));
        let e = &r.json()["error"];
        assert_eq!(
            (
                e["type"].as_str(),
                e["code"].as_u64(),
                e["party"].as_str(),
                e["retryable"].as_bool()
            ),
            (
                Some("pd_handoff_field"),
                Some(400),
                Some("client"),
                Some(false)
            ),
            "{field}"
        );
        let msg = e["message"].as_str().expect("message");
        assert!(
            msg.contains(&format!("\"{field}\"")) && msg.contains("P/D rule"),
            "{msg}"
        );
    }
    assert_eq!(
        (pre.seen().len(), dec.seen().len()),
        (0, 0),
        "a refused request reaches no engine"
    );

    // Another dialect's field is not the gateway's on this rule: it passes to both legs.
    let body = json!({"model": "m", "prompt": "x", "max_tokens": 5, "bootstrap_host": "h"});
    let r = send(&c, "/v1/completions", vllm, &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let mut want = body.clone();
    assert_eq!(
        dec.seen()[0].body,
        want,
        "the decode leg: the client's body"
    );
    want["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
        "remote_port": null});
    want["max_tokens"] = json!(1);
    want["stream"] = json!(false);
    assert_eq!(pre.seen()[0].body, want, "the prefill leg");

    // A plain rule passes the fields through unchanged.
    let plain = free_port();
    let plain_rule = json!({"serviceArguments": {"externalIP": "127.0.0.1", "port": plain,
        "protocol": "tcp", "mode": 4, "sel": 0},
        "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": dec.port()}]});
    post(&d, &plain_rule).await;
    let body = json!({"model": "m", "prompt": "x", "kv_transfer_params": {"remote_host": "h"},
        "disaggregated_params": {"request_type": "generation_only"}, "bootstrap_room": 7});
    let r = send(&c, "/v1/completions", plain, &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let seen = dec.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, body, "verbatim on a plain rule");
}
