//! Prefill/decode disaggregation end to end: the real `loxilb` daemon, real `vllm-sim` engines
//! in the producer and consumer roles (and small real HTTP servers where a test needs an engine
//! to misbehave), real HTTP on loopback.
//!
//! Scenarios 20–22 of `../shared/cases/routing-scenarios.md`: the decode leg carries exactly the
//! prefill's `kv_transfer_params` (unknown fields too) and does no prefill work; a prefill answer
//! without them still runs the decode and is counted; one request id on both legs. Plus the
//! P/D ladder: pins across turns and a pin that moves when its endpoint dies, the breaker, the
//! prefill timeout, a client that goes away during the prefill, and 503 `pd_pool_unavailable`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use loxi_tests::backend::{Backend, Mode};
use loxi_tests::harness::{Daemon, DaemonOpts, free_port, loopback_pd_rid_prefix};
use loxi_tests::shared_dir;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};

use loxi_tests::http::{Body, TestClient, client, full, metric, send};

fn completion(port: u16, headers: &[(&str, &str)], body: &Value) -> http::Request<Body> {
    let mut b = http::Request::post(format!("http://127.0.0.1:{port}/v1/completions"))
        .header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(full(body.to_string())).expect("request")
}

async fn get_json(c: &TestClient, url: &str) -> Value {
    let req = http::Request::get(url).body(full("")).expect("request");
    send(c, req).await.json()
}

async fn get_text(c: &TestClient, url: &str) -> String {
    let req = http::Request::get(url).body(full("")).expect("request");
    send(c, req).await.text
}

/// `(endpointIP 127.0.0.1, targetPort, ep_role, nixl_port)` endpoints of a P/D rule on `port`.
fn pd_rule(port: u16, eps: &[(u16, u8, u16)], extra: Value) -> Value {
    let mut svc = json!({"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4,
        "sel": 0, "pd_disagg_mode": true});
    if let (Some(o), Some(e)) = (svc.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    let eps: Vec<Value> = eps
        .iter()
        .map(|(p, role, nixl)| {
            json!({"endpointIP": "127.0.0.1", "targetPort": p, "ep_role": role, "nixl_port": nixl})
        })
        .collect();
    json!({"serviceArguments": svc, "endpoints": eps})
}

async fn started(opts: DaemonOpts, rule: &Value) -> Daemon {
    let d = Daemon::start(opts).await;
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
    d
}

/// A `vllm-sim` process (killed on drop) serving the golden tiny model.
struct Sim {
    _sim: loxi_tests::sim::Sim,
    addr: SocketAddr,
    _tok: tempfile::TempDir,
}

/// `<dir>/tiny/{tokenizer.json, tokenizer_config.json}` from the golden tiny model.
fn stage_tokenizer() -> tempfile::TempDir {
    let tok = tempfile::tempdir().expect("tmp");
    let dst = tok.path().join("tiny");
    std::fs::create_dir_all(&dst).expect("mkdir");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(shared_dir().join("golden/tiny-model").join(f), dst.join(f))
            .expect("copy tokenizer");
    }
    tok
}

impl Sim {
    async fn start(role: &str) -> Sim {
        Self::start_on(role, "127.0.0.1", None).await
    }

    /// A sim on `host`; with `zmq_port`, publishing KV events on `tcp://host:zmq_port`
    /// (`PYTHONHASHSEED=0`, block size 16: loxi's defaults with `LLB_KV_NONE_HASH_SEED=0`).
    async fn start_on(role: &str, host: &str, zmq_port: Option<u16>) -> Sim {
        Self::start_full(role, host, zmq_port, &["--time-scale", "0.05"]).await
    }

    /// A sim on 127.0.0.1 with `timing` arguments instead of `--time-scale 0.05`.
    async fn start_timed(role: &str, timing: &[&str]) -> Sim {
        Self::start_full(role, "127.0.0.1", None, timing).await
    }

    async fn start_full(role: &str, host: &str, zmq_port: Option<u16>, timing: &[&str]) -> Sim {
        let tok = stage_tokenizer();
        let mut cmd = loxi_tests::sim::Sim::command();
        cmd.args(["--model", "tiny", "--host", host, "--port", "0"])
            .arg("--tokenizer-dir")
            .arg(tok.path())
            .env("PYTHONHASHSEED", "0")
            .args(["--block-size", "16"]);
        if let Some(z) = zmq_port {
            let cfg = json!({"enable_kv_cache_events": true, "publisher": "zmq",
                "endpoint": format!("tcp://{host}:{z}")});
            cmd.args(["--kv-events-config", &cfg.to_string()]);
        }
        cmd.args(["--kv-role", role]).args(timing);
        let sim = loxi_tests::sim::Sim::spawn(cmd).await;
        Sim {
            addr: sim.addr,
            _sim: sim,
            _tok: tok,
        }
    }
    fn port(&self) -> u16 {
        self.addr.port()
    }
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// A 100-word prompt (well over one 16-token block of the tiny model).
fn prompt(seed: &str) -> String {
    (0..100)
        .map(|i| format!("{seed}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn vllm_sims_prefill_then_decode_with_the_params_and_one_request_id() {
    let (pre, dec) = (Sim::start("producer").await, Sim::start("consumer").await);
    let port = free_port();
    let rule = pd_rule(
        port,
        &[(pre.port(), 1, 5600), (dec.port(), 2, 5601)],
        json!({}),
    );
    let d = started(DaemonOpts::default(), &rule).await;
    let c = client();
    let body = json!({"model": "tiny", "prompt": prompt("w"), "max_tokens": 8, "min_tokens": 2});
    let r = send(&c, completion(port, &[], &body)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.header("x-loxilb-endpoint"), Some("1"), "decode served");
    assert_eq!(r.header("x-loxilb-prefill-endpoint"), Some("0"));
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().expect("prompt tokens");

    let plog = get_json(&c, &pre.url("/sim/requests")).await;
    let dlog = get_json(&c, &dec.url("/sim/requests")).await;
    assert_eq!(plog.as_array().map(Vec::len), Some(1), "{plog}");
    assert_eq!(dlog.as_array().map(Vec::len), Some(1), "{dlog}");
    let (p, dd) = (&plog[0], &dlog[0]);
    assert_eq!(
        (p["max_tokens"].clone(), p["stream"].clone()),
        (json!(1), json!(false))
    );
    assert_eq!(
        p["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null})
    );
    let rid = p["request_id"].as_str().expect("prefill request id");
    assert!(
        rid.starts_with("___prefill_addr_127.0.0.1:5600___decode_addr_127.0.0.1:5601_"),
        "{rid}"
    );
    assert_eq!(
        dd["request_id"], p["request_id"],
        "one request id on both legs"
    );
    assert_eq!(dd["max_tokens"], 8);
    let kv = &dd["kv_transfer_params"];
    assert_eq!(kv["do_remote_prefill"], true, "{kv}");
    assert_eq!(kv["remote_port"], pre.port(), "{kv}");
    assert_eq!(kv["remote_engine_id"], format!("vllm-sim-{}", pre.port()));
    assert!(
        kv["remote_block_ids"]
            .as_array()
            .is_some_and(|b| !b.is_empty()),
        "{kv}"
    );

    // The decode engine computed one prompt token (vLLM recomputes the last); the rest came
    // from the transfer. The producer computed the whole prompt.
    let dm = get_text(&c, &dec.url("/metrics")).await;
    let pm = get_text(&c, &pre.url("/metrics")).await;
    let src = |text: &str, source: &str| {
        metric(
            text,
            "vllm:prompt_tokens_by_source_total",
            &[&format!("source=\"{source}\"")],
        )
    };
    assert_eq!(src(&dm, "local_compute"), 1.0, "{dm}");
    assert_eq!(src(&dm, "external_kv_transfer"), (prompt_tokens - 1) as f64);
    assert_eq!(src(&pm, "local_compute"), prompt_tokens as f64, "{pm}");
    assert_eq!(src(&pm, "external_kv_transfer"), 0.0);
    assert_eq!(metric(&pm, "vllm:generation_tokens_total", &[]), 1.0);

    // Streaming passes through event by event from the decode leg.
    let sbody = json!({"model": "tiny", "prompt": prompt("s"), "max_tokens": 6, "stream": true});
    let r = send(&c, completion(port, &[], &sbody)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = r.text.matches("data: ").count();
    assert!(
        events >= 7,
        "6 tokens + [DONE] as separate events: {}",
        r.text
    );
    assert!(r.text.contains("data: [DONE]"));
    let dlog = get_json(&c, &dec.url("/sim/requests")).await;
    assert_eq!(dlog[1]["stream"], true);
    let plog = get_json(&c, &pre.url("/sim/requests")).await;
    assert_eq!(plog[1]["stream"], false);

    let m = d.metrics_text().await;
    assert_eq!(
        metric(&m, "loxilb_ai_pd_requests_total", &["service=\""]),
        2.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "loxilb_ai_pd_tier_selected_total",
            &["leg=\"prefill\"", "tier=\"2\""]
        ),
        2.0
    );
    assert_eq!(
        metric(
            &m,
            "loxilb_ai_pd_tier_selected_total",
            &["leg=\"decode\"", "tier=\"2\""]
        ),
        2.0
    );
    assert_eq!(metric(&m, "loxilb_ai_pd_kv_params_missing_total", &[]), 0.0);
    assert_eq!(
        metric(&m, "loxilb_ai_pd_prefill_duration_seconds_count", &[]),
        2.0
    );
    assert_eq!(
        metric(&m, "loxilb_ai_pd_decode_ttft_seconds_count", &[]),
        2.0
    );
    loxi_tests::harness::promtool_check(&m);
}

/// Requests a [`FakePrefill`] received: `(X-Request-Id, JSON body)`.
type Seen = Arc<Mutex<Vec<(Option<String>, Value)>>>;

/// A prefill engine double: answers every request 200 with `{"id": .., "kv_transfer_params":
/// PARAMS}` (or without the field when `PARAMS` is `None`) and records each request.
struct FakePrefill {
    addr: SocketAddr,
    params: Arc<Mutex<Option<Value>>>,
    seen: Seen,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakePrefill {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakePrefill {
    async fn start(params: Option<Value>) -> FakePrefill {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let params = Arc::new(Mutex::new(params));
        let seen: Seen = Arc::new(Mutex::new(Vec::new()));
        let (p2, s2) = (params.clone(), seen.clone());
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (p, seen) = (p2.clone(), s2.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let (p, seen) = (p.clone(), seen.clone());
                        async move {
                            let rid = req
                                .headers()
                                .get("x-request-id")
                                .and_then(|v| v.to_str().ok())
                                .map(String::from);
                            let b = req.into_body().collect().await.map(|c| c.to_bytes());
                            let body: Value = b
                                .ok()
                                .and_then(|b| serde_json::from_slice(&b).ok())
                                .unwrap_or(Value::Null);
                            seen.lock().push((rid, body));
                            let mut out = json!({"id": "cmpl-fake", "choices": [{"text": "x"}]});
                            if let Some(v) = p.lock().clone() {
                                out["kv_transfer_params"] = v;
                            }
                            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from(
                                out.to_string(),
                            ))))
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        FakePrefill {
            addr,
            params,
            seen,
            task,
        }
    }
}

#[tokio::test]
async fn the_decode_gets_the_params_verbatim_and_missing_ones_are_counted() {
    let params = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [[3, 4, 5]], "remote_engine_id": "e-7", "remote_host": "10.1.1.1",
        "remote_port": 5600, "tp_size": 2, "x_future_field": {"nested": [1, null, "two"]}});
    let pre = FakePrefill::start(Some(params.clone())).await;
    let dec = Backend::start("decode").await;
    let port = free_port();
    let rule = pd_rule(
        port,
        &[(pre.addr.port(), 1, 0), (dec.port(), 2, 0)],
        json!({}),
    );
    let d = started(DaemonOpts::default(), &rule).await;
    let c = client();
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 5, "stream": false,
        "x_client_field": [1]});
    let r = send(
        &c,
        completion(port, &[("x-request-id", "client-id")], &body),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let got = dec.requests();
    assert_eq!(got.len(), 1);
    let dbody: Value = serde_json::from_slice(&got[0].body).expect("decode body");
    assert_eq!(
        dbody["kv_transfer_params"], params,
        "verbatim, unknown fields too"
    );
    let mut expect = body.clone();
    expect["kv_transfer_params"] = params.clone();
    assert_eq!(dbody, expect, "otherwise the client's own body");
    let seen = pre.seen.lock().clone();
    let prid = seen[0].0.clone().expect("prefill request id");
    assert_eq!(got[0].header("x-request-id"), Some(prid.as_str()));
    assert!(
        prid.starts_with(&format!("___prefill_addr_127.0.0.1:{}", pre.addr.port())),
        "{prid}"
    );

    // Scenario 21: no params → the decode still runs, without them, and it is counted.
    *pre.params.lock() = None;
    let r = send(&c, completion(port, &[], &body)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let got = dec.requests();
    let dbody: Value = serde_json::from_slice(&got[1].body).expect("decode body");
    assert_eq!(dbody, body, "the client's body, no kv_transfer_params");
    let m = d.metrics_text().await;
    assert_eq!(
        metric(&m, "loxilb_ai_pd_kv_params_missing_total", &[]),
        1.0,
        "{m}"
    );
    assert_eq!(metric(&m, "loxilb_ai_pd_requests_total", &[]), 2.0);
}

#[tokio::test]
async fn a_conversation_stays_pinned_and_moves_when_its_prefill_dies() {
    let p0 = Backend::start("p0").await;
    let p1 = Backend::start("p1").await;
    let d0 = Backend::start("d0").await;
    let d1 = Backend::start("d1").await;
    let port = free_port();
    let rule = pd_rule(
        port,
        &[
            (p0.port(), 1, 0),
            (d0.port(), 2, 0),
            (p1.port(), 1, 0),
            (d1.port(), 2, 0),
        ],
        json!({"pd_session_ttl_sec": 60}),
    );
    let d = started(DaemonOpts::default(), &rule).await;
    let c = client();
    let turn = |conv: &str, i: usize| {
        completion(
            port,
            &[("x-conversation-id", conv)],
            &json!({"prompt": format!("turn {i}"), "max_tokens": 2}),
        )
    };
    let mut pairs = Vec::new();
    for i in 0..5 {
        let r = send(&c, turn("conv-a", i)).await;
        assert_eq!(r.status, 200, "{}", r.text);
        pairs.push((
            r.header("x-loxilb-prefill-endpoint").map(String::from),
            r.header("x-loxilb-endpoint").map(String::from),
        ));
    }
    assert!(pairs.iter().all(|p| *p == pairs[0]), "pinned: {pairs:?}");
    let m = d.metrics_text().await;
    assert_eq!(
        metric(&m, "loxilb_ai_pd_session_hits_total", &[]),
        4.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "loxilb_ai_pd_tier_selected_total",
            &["leg=\"decode\"", "tier=\"0\""]
        ),
        4.0
    );
    // The pinned prefill starts failing: its 500s are relayed until the breaker opens (3, the
    // default LLB_PD_ORIGIN_ERR_THRESHOLD); then the conversation moves to the other prefill
    // and keeps its decode pin.
    let pinned_prefill = pairs[0].0.clone().expect("prefill header");
    let (dead, alive, alive_idx) = if pinned_prefill == "0" {
        (&p0, &p1, "2")
    } else {
        (&p1, &p0, "0")
    };
    dead.set_mode(Mode::Fail);
    let before = alive.request_count();
    let mut failed = 0;
    for i in 5..12 {
        let r = send(&c, turn("conv-a", i)).await;
        if r.status == 500 {
            failed += 1;
            continue;
        }
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.header("x-loxilb-prefill-endpoint"), Some(alive_idx));
        assert_eq!(
            r.header("x-loxilb-endpoint").map(String::from),
            pairs[0].1,
            "the decode pin holds"
        );
    }
    assert_eq!(failed, 3, "relayed until the breaker opened");
    assert_eq!(alive.request_count() - before, 4);
    let _ = (&d0, &d1);
}

#[tokio::test]
async fn a_failing_prefill_opens_the_breaker_and_traffic_moves() {
    let bad = Backend::start("bad").await;
    bad.set_mode(Mode::Fail);
    let good = Backend::start("good").await;
    let dec = Backend::start("dec").await;
    let port = free_port();
    let rule = pd_rule(
        port,
        &[(bad.port(), 1, 0), (good.port(), 1, 0), (dec.port(), 2, 0)],
        json!({}),
    );
    let d = started(DaemonOpts::default(), &rule).await;
    let c = client();
    let mut statuses = Vec::new();
    for i in 0..12 {
        let r = send(
            &c,
            completion(port, &[], &json!({"prompt": format!("q{i}")})),
        )
        .await;
        if r.status == 500 {
            assert_eq!(
                (
                    r.header("x-loxilb-prefill-endpoint"),
                    r.header("x-loxilb-endpoint")
                ),
                (Some("0"), None),
                "the prefill's 500 is relayed"
            );
        }
        statuses.push(r.status);
    }
    assert_eq!(
        bad.request_count(),
        3,
        "the breaker opened after 3 origin 5xx: {statuses:?}"
    );
    assert_eq!(statuses.iter().filter(|s| **s == 500).count(), 3);
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 9);
    assert_eq!(
        dec.request_count(),
        9,
        "a refused prefill never reaches the decode"
    );
    let m = d.metrics_text().await;
    assert_eq!(
        metric(
            &m,
            "loxilb_ai_pd_failures_total",
            &["reason=\"pd_prefill_status\""]
        ),
        3.0
    );
    // LoxiLB's family counts the relayed refusals as the client got them.
    for (status, n) in [("500", 3.0), ("200", 9.0)] {
        let needle = format!("status=\"{status}\"");
        assert_eq!(
            metric(&m, "loxilb_ai_requests_total", &[&needle]),
            n,
            "{status}"
        );
    }
}

#[tokio::test]
async fn a_slow_prefill_is_504_and_a_client_that_leaves_aborts_it() {
    let slow = Backend::start("slow").await;
    slow.set_mode(Mode::Hang);
    let dec = Backend::start("dec").await;
    let port = free_port();
    let rule = pd_rule(port, &[(slow.port(), 1, 0), (dec.port(), 2, 0)], json!({}));
    let opts = DaemonOpts::default().env("LLB_PD_PREFILL_TIMEOUT_SEC", "2");
    let d = started(opts, &rule).await;
    let c = client();
    let t = Instant::now();
    let r = send(&c, completion(port, &[], &json!({"prompt": "x"}))).await;
    assert_eq!(r.status, 504, "{}", r.text);
    assert_eq!(r.json()["error"]["type"], "pd_prefill_timeout");
    // The failing pair can be traced: the request id the prefill leg was sent with, and its
    // endpoint.
    let rid = r.header("x-request-id").unwrap_or_default().to_string();
    assert!(rid.starts_with("___prefill_addr_"), "{rid:?}");
    assert_eq!(r.header("x-loxilb-prefill-endpoint"), Some("0"));
    let m = d.metrics_text().await;
    assert_eq!(
        metric(
            &m,
            "loxilb_proxy_requests_total",
            &["ep_idx=\"0\"", "class=\"5xx\""]
        ),
        1.0,
        "counted under the prefill endpoint that timed out"
    );
    assert_eq!(
        metric(&m, "loxilb_proxy_requests_total", &["ep_idx=\"none\""]),
        0.0,
        "not as a refusal of the gateway's"
    );
    assert_eq!(
        metric(&m, "loxilb_ai_requests_total", &["status=\"504\""]),
        1.0,
        "the client's answer, in LoxiLB's family"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
    assert_eq!(dec.request_count(), 0);
    assert!(
        slow.wait_cancelled(1, Duration::from_secs(2)).await,
        "the prefill leg was dropped"
    );

    // A client that gives up during the prefill: the prefill leg is aborted then, well before
    // the 2 s prefill timeout would have ended it.
    let t = Instant::now();
    let req = completion(port, &[], &json!({"prompt": "y"}));
    let _ = tokio::time::timeout(Duration::from_millis(300), c.request(req)).await;
    drop(c);
    assert!(
        slow.wait_cancelled(2, Duration::from_secs(3)).await,
        "client disconnect aborted the prefill leg"
    );
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "aborted by the disconnect, not the timeout: {:?}",
        t.elapsed()
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let m = d.metrics_text().await;
        let active = metric(&m, "loxilb_proxy_active_connections", &["ep_idx=\"0\""]);
        if active == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "in-flight gauge stuck at {active}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(dec.request_count(), 0);
}

#[tokio::test]
async fn no_reachable_decode_is_503_pd_pool_unavailable() {
    let pre = Backend::start("pre").await;
    // A decode endpoint nothing listens on: its connect fails, it is excluded, none is left.
    let (_held, closed) = closed_port();
    let port = free_port();
    let rule = pd_rule(port, &[(pre.port(), 1, 0), (closed, 2, 0)], json!({}));
    let d = started(DaemonOpts::default(), &rule).await;
    let c = client();
    let r = send(&c, completion(port, &[], &json!({"prompt": "x"}))).await;
    assert_eq!(r.status, 503, "{}", r.text);
    let v = r.json();
    assert_eq!(v["error"]["type"], "pd_pool_unavailable");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no_decode")),
        "{v}"
    );
    // The prefill ran before the decode's connect failed: the answer names it and the request
    // id it was sent with, so the pair can be found in the engines' logs.
    assert_eq!(pre.request_count(), 1);
    assert_eq!(r.header("x-loxilb-prefill-endpoint"), Some("0"));
    let rid = r.header("x-request-id").unwrap_or_default();
    assert!(!rid.is_empty(), "{:?}", r.headers);
    assert_eq!(pre.requests()[0].header("x-request-id"), Some(rid));
    let m = d.metrics_text().await;
    assert_eq!(
        metric(
            &m,
            "loxilb_ai_pd_failures_total",
            &["reason=\"pd_pool_unavailable\""]
        ),
        1.0
    );
    // No prefill took the connection: no leg was sent, so no request id or endpoint is named.
    let dec = Backend::start("dec").await;
    let port = free_port();
    let rule = pd_rule(port, &[(closed, 1, 0), (dec.port(), 2, 0)], json!({}));
    let _d = started(DaemonOpts::default(), &rule).await;
    let r = send(&c, completion(port, &[], &json!({"prompt": "x"}))).await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.json()["error"]["type"], "pd_pool_unavailable");
    assert_eq!(r.header("x-request-id"), None, "{:?}", r.headers);
    assert_eq!(r.header("x-loxilb-prefill-endpoint"), None);
    assert_eq!(dec.request_count(), 0);
}

/// A connect failure that moves a leg renews the request id, so both legs and the client carry
/// one id naming the engines that served (vLLM's P2P connector sends the KV to its decode
/// address); a decode that refused after the prefill ran gets the prefill run again for the
/// next decode, under the new id.
#[tokio::test]
async fn a_connect_failover_renews_the_request_id_for_the_pair_that_serves() {
    let (_held_pre, dead_pre) = closed_port();
    let (_held_dec, dead_dec) = closed_port();
    let pre = Backend::start("pre").await;
    let dec = Backend::start("dec").await;
    let port = free_port();
    let rule = pd_rule(
        port,
        &[
            (dead_pre, 1, 0),
            (pre.port(), 1, 0),
            (dead_dec, 2, 0),
            (dec.port(), 2, 0),
        ],
        json!({}),
    );
    let d = started(DaemonOpts::default(), &rule).await;
    let c = client();
    let want = loopback_pd_rid_prefix(pre.port(), dec.port());
    for i in 0..4 {
        let r = send(
            &c,
            completion(port, &[], &json!({"prompt": format!("failover {i}")})),
        )
        .await;
        assert_eq!(r.status, 200, "request {i}: {}", r.text);
        let rid = r.header("x-request-id").unwrap_or_default().to_owned();
        assert!(rid.starts_with(&want), "request {i}: {rid}");
        let last = |b: &Backend| {
            b.requests()
                .last()
                .and_then(|q| q.header("x-request-id").map(str::to_owned))
        };
        assert_eq!(last(&pre).as_deref(), Some(rid.as_str()), "request {i}");
        assert_eq!(last(&dec).as_deref(), Some(rid.as_str()), "request {i}");
    }
    let m = d.metrics_text().await;
    let failures = |ep: &str| {
        metric(
            &m,
            "loxilb_proxy_upstream_connect_failures_total",
            &[&format!("ep_idx=\"{ep}\"")],
        )
    };
    assert!(failures("0") >= 1.0, "the dead prefill was tried: {m}");
    assert!(failures("2") >= 1.0, "the dead decode was tried: {m}");
    assert_eq!(dec.request_count(), 4);
    assert_eq!(
        pre.request_count() as f64,
        4.0 + failures("2"),
        "one more prefill leg for each decode that refused after its prefill"
    );
}

/// Every prefill (or every decode) endpoint refusing the connection is no 503 when the rule has
/// a role-0 endpoint: that one serves the request in one leg, as when none was eligible to
/// begin with (before, each such request got 503 `pd_pool_unavailable` until the breaker took
/// the dead endpoint out, and again after each breaker cooldown).
#[tokio::test]
async fn a_dead_prefill_or_decode_falls_back_to_the_role_0_endpoint() {
    let (_held, closed) = closed_port();
    for dead_role in [1u8, 2] {
        let live = Backend::start("live").await;
        let agg = Backend::start("agg").await;
        let port = free_port();
        let rule = pd_rule(
            port,
            &[
                (closed, dead_role, 0),
                (live.port(), 3 - dead_role, 0),
                (agg.port(), 0, 0),
            ],
            json!({}),
        );
        let d = started(DaemonOpts::default(), &rule).await;
        let c = client();
        for i in 0..3 {
            let r = send(
                &c,
                completion(port, &[], &json!({"prompt": format!("x{i}")})),
            )
            .await;
            assert_eq!(
                r.status, 200,
                "dead role {dead_role}, request {i}: {}",
                r.text
            );
        }
        assert_eq!(agg.request_count(), 3, "dead role {dead_role}");
        if dead_role == 1 {
            assert_eq!(live.request_count(), 0, "no decode leg without a prefill");
        } else {
            // The prefill legs that ran before the decode's connect failed (their work lost),
            // until the breaker took the dead decode out.
            assert!(
                (1..=3).contains(&live.request_count()),
                "{}",
                live.request_count()
            );
        }
        let m = d.metrics_text().await;
        assert_eq!(
            metric(
                &m,
                "loxilb_ai_pd_failures_total",
                &["reason=\"pd_pool_unavailable\""]
            ),
            0.0,
            "dead role {dead_role}"
        );
    }
}

/// A loopback port nothing listens on: a connect to it is refused. The socket stays bound
/// (never listening) while the returned guard lives, so no backend the test starts later is
/// given the same port (with a port bound and closed at once, a backend once was: the rule
/// then named one port twice and was refused).
fn closed_port() -> (tokio::net::TcpSocket, u16) {
    let s = tokio::net::TcpSocket::new_v4().expect("socket");
    s.bind(([127, 0, 0, 1], 0).into()).expect("bind");
    let port = s.local_addr().expect("addr").port();
    (s, port)
}

/// `(endpointIP, targetPort, ep_role)` endpoints on several loopback addresses.
fn pd_rule_hosts(port: u16, eps: &[(&str, u16, u8)], extra: Value) -> Value {
    let mut r = pd_rule(port, &[], extra);
    r["endpoints"] = eps
        .iter()
        .map(|(ip, p, role)| json!({"endpointIP": ip, "targetPort": p, "ep_role": role}))
        .collect();
    r
}

#[tokio::test]
async fn tier_1_5_sends_the_prefill_leg_to_the_prefill_holding_the_prefix() {
    // Two prefill engines publishing KV events on one kvZmqPort (distinct loopback hosts), one
    // decode engine; predicted blocks off, so only the engines' events can steer.
    let zmq = free_port();
    let p0 = Sim::start_on("producer", "127.0.0.2", Some(zmq)).await;
    let p1 = Sim::start_on("producer", "127.0.0.3", Some(zmq)).await;
    let dec = Sim::start_on("consumer", "127.0.0.4", None).await;
    let tok = stage_tokenizer();
    let port = free_port();
    let rule = pd_rule_hosts(
        port,
        &[
            ("127.0.0.2", p0.port(), 1),
            ("127.0.0.3", p1.port(), 1),
            ("127.0.0.4", dec.port(), 2),
        ],
        json!({"kvExactMode": 1, "kvZmqPort": zmq, "kvBlockSize": 16}),
    );
    let opts = DaemonOpts {
        tokenizer_dir: Some(tok.path().to_path_buf()),
        ..Default::default()
    }
    .env("LLB_KV_NONE_HASH_SEED", "0")
    .env("LOXI_KV_PREDICT_TTL_MS", "0");
    let d = started(opts, &rule).await;
    let c = client();
    // Both prefill subscribers connected (the decode endpoint is not subscribed).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let m = d.metrics_text().await;
        let up = metric(&m, "loxilb_kv_subscriber_connected", &["ep=\"0\""])
            + metric(&m, "loxilb_kv_subscriber_connected", &["ep=\"1\""]);
        if up == 2.0 {
            assert!(
                !m.contains("loxilb_kv_subscriber_connected{service=\"1\",ep=\"2\"}"),
                "the decode endpoint is not subscribed: {m}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "subscribers not connected: {m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let system = prompt("sys");
    let ask =
        |q: &str| json!({"model": "tiny", "prompt": format!("{system} {q}"), "max_tokens": 2});
    let r = send(&c, completion(port, &[], &ask("first"))).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let first = r
        .header("x-loxilb-prefill-endpoint")
        .expect("prefill")
        .to_string();
    // The engine's BlockStored events reach loxi's index.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = d.metrics_text().await;
        if metric(&m, "loxilb_pd_kv_blocks", &[&format!("ep_idx=\"{first}\"")]) > 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no blocks indexed for ep {first}: {m}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Tier 2 alone would rotate to the other prefill; tier 1.5 keeps the prefix's holder.
    for q in ["second", "third", "fourth"] {
        let r = send(&c, completion(port, &[], &ask(q))).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(
            r.header("x-loxilb-prefill-endpoint"),
            Some(first.as_str()),
            "{q}"
        );
        assert_eq!(r.header("x-loxilb-endpoint"), Some("2"));
    }
    let m = d.metrics_text().await;
    assert_eq!(
        metric(
            &m,
            "loxilb_ai_pd_tier_selected_total",
            &["leg=\"prefill\"", "tier=\"1.5\""]
        ),
        4.0,
        "the first request (a cold placement: nothing indexed yet) and the three hits: {m}"
    );
    assert_eq!(
        metric(
            &m,
            "loxilb_pd_kv_tier15_hits_total",
            &[&format!("ep_idx=\"{first}\"")]
        ),
        3.0
    );
}

#[tokio::test]
async fn p_d_rules_are_validated_and_what_is_not_built_is_refused() {
    let d = Daemon::start_default().await;
    let port = free_port();
    let cases = [
        (
            pd_rule(port, &[(8000, 1, 0)], json!({})),
            "endpoints",
            "at least one prefill",
        ),
        (
            pd_rule(
                port,
                &[(8000, 1, 0), (8001, 2, 0)],
                json!({"kvExactMode": 3}),
            ),
            "serviceArguments.kvExactMode",
            "role-less",
        ),
        (
            pd_rule(
                port,
                &[(8000, 1, 0), (8001, 2, 0)],
                json!({"kvEngineType": "trtllm", "kvExactMode": 1}),
            ),
            "serviceArguments.kvExactMode",
            "not implemented",
        ),
        (
            pd_rule(
                port,
                &[(8000, 1, 0), (8001, 2, 0)],
                json!({"pd_cache_threshold": 50}),
            ),
            "serviceArguments.pd_cache_threshold",
            "requires pd_cache_aware_mode",
        ),
    ];
    for (rule, field, words) in cases {
        let (status, body) = d.post_rule(&rule).await;
        assert_eq!(status, 400, "{rule}: {body}");
        let msg = body.to_string();
        assert!(msg.contains(field) && msg.contains(words), "{field}: {msg}");
    }
    let ok = pd_rule(
        port,
        &[(8000, 1, 5600), (8001, 2, 0)],
        json!({"kvExactMode": 1, "pd_session_ttl_sec": 30}),
    );
    let (status, body) = d.post_rule(&ok).await;
    assert!(status == 200 || status == 201, "{body}");
    // Tier 1 and its knobs (a rule of its own: another port).
    let tier1 = pd_rule(
        free_port(),
        &[(8000, 1, 5600), (8001, 2, 0)],
        json!({"pd_cache_aware_mode": true, "pd_cache_threshold": 50,
            "pd_balance_abs_threshold": 9}),
    );
    let (status, body) = d.post_rule(&tier1).await;
    assert!(status == 200 || status == 201, "{body}");
}

/// `[tier-1 hits, misses, bypasses, prefill choices by tier 1, prefill choices by tier 2]`.
fn tier1_counts(m: &str) -> [f64; 5] {
    let sel = |tier: &str| {
        metric(
            m,
            "loxilb_ai_pd_tier_selected_total",
            &["leg=\"prefill\"", &format!("tier=\"{tier}\"")],
        )
    };
    [
        metric(m, "loxilb_ai_pd_tier1_hits_total", &[]),
        metric(m, "loxilb_ai_pd_tier1_misses_total", &[]),
        metric(m, "loxilb_ai_pd_tier1_bypass_total", &[]),
        sel("1"),
        sel("2"),
    ]
}

fn delta(a: [f64; 5], b: [f64; 5]) -> [f64; 5] {
    std::array::from_fn(|i| b[i] - a[i])
}

/// Waits until `n` requests are in flight on endpoint `ep` (`loxilb_proxy_active_connections`).
async fn wait_active(d: &Daemon, ep: &str, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = d.metrics_text().await;
        let active = metric(
            &m,
            "loxilb_proxy_active_connections",
            &[&format!("ep_idx=\"{ep}\"")],
        );
        if active == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "ep {ep}: {active} in flight, want {n}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn tier_1_sends_a_shared_prefix_to_one_prefill_and_is_bypassed_past_the_imbalance() {
    // Each prefill step takes at least 1.5 s of real time, so legs can be held in flight and
    // the prefill endpoints' loads set exactly.
    let timing = ["--time-scale", "1", "--prefill-floor-ms", "1500"];
    let p0 = Sim::start_timed("producer", &timing).await;
    let p1 = Sim::start_timed("producer", &timing).await;
    let dec = Sim::start("consumer").await;
    let port = free_port();
    let rule = pd_rule(
        port,
        &[(p0.port(), 1, 0), (p1.port(), 1, 0), (dec.port(), 2, 0)],
        json!({"pd_cache_aware_mode": true, "pd_balance_abs_threshold": 1}),
    );
    let d = started(DaemonOpts::default(), &rule).await;
    let c = client();
    // A 100-word shared preamble and a short question: well over the default 20 % match.
    let preamble = prompt("ctx");
    let body =
        |q: &str| json!({"model": "tiny", "prompt": format!("{preamble} {q}"), "max_tokens": 2});
    let m0 = tier1_counts(&d.metrics_text().await);
    assert_eq!(m0, [0.0; 5], "series exist at 0");

    // Cold: a miss, tier 2 chooses; the second request follows the learned prefix.
    let r1 = send(&c, completion(port, &[], &body("what is the first word?"))).await;
    assert_eq!(r1.status, 200, "{}", r1.text);
    let e = r1
        .header("x-loxilb-prefill-endpoint")
        .expect("prefill endpoint")
        .to_string();
    let r2 = send(&c, completion(port, &[], &body("and the last one?"))).await;
    assert_eq!(r2.status, 200, "{}", r2.text);
    assert_eq!(r2.header("x-loxilb-prefill-endpoint"), Some(e.as_str()));
    let m1 = tier1_counts(&d.metrics_text().await);
    assert_eq!(
        delta(m0, m1),
        [1.0, 1.0, 0.0, 1.0, 1.0],
        "hit, miss, bypass, tier 1, tier 2"
    );

    // Hold two shared-prefix legs on `e`: the first is a hit at loads 0/0, the second at 1/0
    // (not over the threshold 1). The third sees 2/0: bypassed, minimum load.
    let (other, other_sim) = if e == "0" { ("1", &p1) } else { ("0", &p0) };
    let held: Vec<_> = ["third", "fourth"]
        .iter()
        .enumerate()
        .map(|(i, q)| (i, completion(port, &[], &body(q))))
        .collect();
    let mut tasks = Vec::new();
    for (i, req) in held {
        let c2 = c.clone();
        tasks.push(tokio::spawn(async move { send(&c2, req).await }));
        wait_active(&d, &e, (i + 1) as f64).await;
    }
    let r3 = send(&c, completion(port, &[], &body("fifth"))).await;
    assert_eq!(r3.status, 200, "{}", r3.text);
    assert_eq!(r3.header("x-loxilb-prefill-endpoint"), Some(other));
    for t in tasks {
        let r = t.await.expect("task");
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.header("x-loxilb-prefill-endpoint"), Some(e.as_str()));
    }
    let m2 = tier1_counts(&d.metrics_text().await);
    assert_eq!(
        delta(m1, m2),
        [2.0, 0.0, 1.0, 2.0, 1.0],
        "hit, miss, bypass, tier 1, tier 2"
    );
    let olog = get_json(&c, &other_sim.url("/sim/requests")).await;
    assert_eq!(
        olog.as_array().map(Vec::len),
        Some(1),
        "only the bypassed request: {olog}"
    );
    let _ = &dec;
}

#[tokio::test]
async fn a_relayed_prefill_error_carries_the_request_id_and_names_only_the_prefill() {
    let dec = Backend::start("dec").await;
    let bad = Backend::start("bad").await;
    bad.set_mode(Mode::Fail);
    let port = free_port();
    // The prefill is endpoint 1, so its index cannot pass for the decode's.
    let rule = pd_rule(port, &[(dec.port(), 2, 0), (bad.port(), 1, 0)], json!({}));
    let _d = started(DaemonOpts::default(), &rule).await;
    let c = client();
    let r = send(
        &c,
        completion(port, &[], &json!({"model": "m", "prompt": "q"})),
    )
    .await;
    assert_eq!(r.status, 500, "{}", r.text);
    assert_eq!(
        r.json(),
        json!({"error": "told to fail", "backend": "bad"}),
        "verbatim"
    );
    let got = bad.requests();
    assert_eq!(got.len(), 1);
    let rid = got[0]
        .header("x-request-id")
        .expect("the prefill leg's request id");
    assert!(
        rid.starts_with(&format!(
            "___prefill_addr_127.0.0.1:{}___decode_addr_127.0.0.1:{}_",
            bad.port(),
            dec.port()
        )),
        "{rid}"
    );
    assert_eq!(
        (
            r.header("x-request-id"),
            r.header("x-loxilb-prefill-endpoint"),
            r.header("x-loxilb-endpoint")
        ),
        (Some(rid), Some("1"), None),
        "traceable to the prefill; no decode answered"
    );
    assert_eq!(dec.request_count(), 0);
}

#[tokio::test]
async fn prefill_and_decode_weights_split_sequential_requests() {
    let (p5, p1) = (Backend::start("p5").await, Backend::start("p1").await);
    let (d1, d3) = (Backend::start("d1").await, Backend::start("d3").await);
    let port = free_port();
    let mut rule = pd_rule(
        port,
        &[
            (p5.port(), 1, 0),
            (p1.port(), 1, 0),
            (d1.port(), 2, 0),
            (d3.port(), 2, 0),
        ],
        json!({}),
    );
    for (i, w) in [5, 1, 1, 3].into_iter().enumerate() {
        rule["endpoints"][i]["weight"] = json!(w);
    }
    let d = started(DaemonOpts::default(), &rule).await;
    let c = client();
    for i in 0..24 {
        let r = send(
            &c,
            completion(port, &[], &json!({"model": "m", "prompt": format!("q{i}")})),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text);
        // Sequential: nothing in flight when the next request is routed.
        for ep in ["2", "3"] {
            wait_active(&d, ep, 0.0).await;
        }
    }
    assert_eq!(
        (
            p5.request_count(),
            p1.request_count(),
            d1.request_count(),
            d3.request_count()
        ),
        (20, 4, 6, 18),
        "prefill 5:1, decode 1:3"
    );
    let m = d.metrics_text().await;
    assert_eq!(
        metric(
            &m,
            "loxilb_ai_pd_tier_selected_total",
            &["leg=\"prefill\"", "tier=\"2\""]
        ),
        24.0,
        "{m}"
    );
}
