//! Nothing accepted is silently dead, and rules have limits: the real daemon refuses what it
//! cannot serve (a port in use, an L4 rule without the XDP data path, values it does not
//! implement, too many endpoints, an over-long body), reports a restored listener it cannot
//! bind and retries it, names inert environment variables at start, and labels tokenizer
//! metrics by rule model only.

use std::time::{Duration, Instant};

use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use serde_json::{Value, json};

fn rule(port: u16, extra: Value) -> Value {
    let mut svc =
        json!({"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4, "sel": 0});
    if let (Some(o), Some(e)) = (svc.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    json!({"serviceArguments": svc, "endpoints": [
        {"endpointIP": "127.0.0.2", "targetPort": 8001},
        {"endpointIP": "127.0.0.3", "targetPort": 8002}
    ]})
}

fn rules_of(v: &Value) -> Vec<Value> {
    v["lbAttr"].as_array().cloned().unwrap_or_default()
}

/// Value of the sample whose name and labels are exactly `series`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_whose_port_is_in_use_is_refused_and_not_persisted() {
    let mut d = Daemon::start_default().await;
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = squatter.local_addr().expect("addr").port();
    let (status, body) = d.post_rule(&rule(port, json!({}))).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["field"], json!("serviceArguments.port"));
    let msg = body["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(&format!("127.0.0.1:{port}")) && msg.contains("nothing was stored"),
        "{msg}"
    );
    // The API's own port is a port in use too.
    let (status, body) = d.post_rule(&rule(d.api_port(), json!({}))).await;
    assert_eq!(status, 409, "{body}");
    assert!(rules_of(&d.rules().await).is_empty());
    d.restart().await;
    assert!(rules_of(&d.rules().await).is_empty(), "nothing persisted");
    // The same rule on a free port is accepted and already listening when acknowledged.
    let free = free_port();
    let (status, body) = d.post_rule(&rule(free, json!({}))).await;
    assert_eq!(status, 200, "{body}");
    std::net::TcpStream::connect(("127.0.0.1", free)).expect("listening at the 200");
    assert_eq!(
        rules_of(&d.rules().await)[0]["listenerState"],
        json!("listening")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_rule_whose_port_is_taken_is_reported_and_served_once_it_frees() {
    let mut d = Daemon::start_default().await;
    let b = Backend::start("b0").await;
    let port = free_port();
    let r = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4},
        "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": b.port()}]
    });
    let (status, body) = d.post_rule(&r).await;
    assert_eq!(status, 200, "{body}");
    d.stop().await;
    let squatter = std::net::TcpListener::bind(("127.0.0.1", port)).expect("take the port");
    d.restart().await;
    let listed = rules_of(&d.rules().await);
    assert_eq!(listed.len(), 1, "the rule was restored");
    let deadline = Instant::now() + Duration::from_secs(5);
    let state = loop {
        let listed = rules_of(&d.rules().await);
        let state = listed[0]["listenerState"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if state != "pending" || Instant::now() > deadline {
            break state;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        state.starts_with("unbound: ") && state.contains("in use") && state.contains("retrying"),
        "{state}"
    );
    // A rule that serves nothing is OFFLINE in its status, whatever its endpoints' health.
    let status_path = format!(
        "/netlox/v1/config/loadbalancer/externalipaddress/127.0.0.1/port/{port}/protocol/tcp/status"
    );
    let operating = |text: String| -> Value {
        serde_json::from_str::<Value>(&text).expect("status JSON")["operatingStatus"].clone()
    };
    let (code, text) = d.get(&status_path).await.expect("GET status");
    assert_eq!(code, 200, "{text}");
    assert_eq!(operating(text), json!("OFFLINE"));
    let m = d.metrics_text().await;
    let up = format!(r#"loxilb_fullproxy_listener_up{{address="127.0.0.1:{port}"}}"#);
    let failures =
        format!(r#"loxilb_fullproxy_listener_bind_failures_total{{address="127.0.0.1:{port}"}}"#);
    assert_eq!(sample(&m, &up), Some(0.0), "{m}");
    assert!(sample(&m, &failures).unwrap_or(0.0) >= 1.0, "{m}");

    drop(squatter);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let listed = rules_of(&d.rules().await);
        if listed[0]["listenerState"] == json!("listening") {
            break;
        }
        assert!(Instant::now() < deadline, "never rebound: {listed:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let m = d.metrics_text().await;
    assert_eq!(sample(&m, &up), Some(1.0), "{m}");
    let (code, text) = d.get(&status_path).await.expect("GET status");
    assert_eq!(code, 200, "{text}");
    assert_eq!(
        operating(text),
        json!("ONLINE"),
        "bound, its one endpoint up"
    );
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert_eq!(b.request_count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_l4_rule_without_the_xdp_data_path_is_refused_naming_it() {
    let d = Daemon::start_default().await;
    let (status, body) = d.post_rule(&rule(free_port(), json!({"mode": 2}))).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], json!("serviceArguments.mode"));
    let msg = body["message"].as_str().unwrap_or_default();
    assert!(msg.contains("--xdp-iface") && msg.contains("L4"), "{msg}");
    assert!(rules_of(&d.rules().await).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_but_unimplemented_values_are_400_saying_so() {
    let d = Daemon::start_default().await;
    let cases = [
        (
            json!({"kvEngineType": "trtllm", "kvExactMode": 3}),
            "serviceArguments.kvExactMode",
        ),
        (json!({"bgp": true}), "serviceArguments.bgp"),
    ];
    for (extra, field) in cases {
        let (status, body) = d.post_rule(&rule(free_port(), extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {body}");
        assert_eq!(body["field"], json!(field), "{extra}");
        let msg = body["message"].as_str().unwrap_or_default();
        assert!(msg.contains("not implemented"), "{extra}: {msg}");
    }
    // Tier 1's knobs without tier 1 would be inert: refused naming what they need.
    for (extra, field) in [
        (
            json!({"pd_cache_threshold": 50}),
            "serviceArguments.pd_cache_threshold",
        ),
        (
            json!({"pd_balance_abs_threshold": 9}),
            "serviceArguments.pd_balance_abs_threshold",
        ),
    ] {
        let (status, body) = d.post_rule(&rule(free_port(), extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {body}");
        assert_eq!(body["field"], json!(field), "{extra}");
        let msg = body["message"].as_str().unwrap_or_default();
        assert!(msg.contains("pd_cache_aware_mode"), "{extra}: {msg}");
    }
    // llama.cpp has no P/D handoff dialect: its P/D rule is refused.
    let mut pd = rule(
        free_port(),
        json!({"pd_disagg_mode": true, "kvEngineType": "llamacpp"}),
    );
    pd["endpoints"][0]["ep_role"] = json!(1);
    pd["endpoints"][1]["ep_role"] = json!(2);
    let (status, body) = d.post_rule(&pd).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], json!("serviceArguments.kvEngineType"));
    assert!(rules_of(&d.rules().await).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inert_environment_variables_are_named_in_a_warning_at_start() {
    let d = Daemon::start(
        DaemonOpts::default()
            .env("LLB_PD_MAX_INFLIGHT_PER_EP", "8")
            .env("LOXILB_AI_CTRL_ADDR", "10.0.0.1:18856")
            .env("LLB_PD_ORIGIN_ERR_THRESHOLD", "5"),
    )
    .await;
    let log = d.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("without effect"))
        .unwrap_or_else(|| panic!("no warning naming inert variables:\n{log}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("LOXILB_AI_CTRL_ADDR"), "{line}");
    assert!(
        !line.contains("LLB_PD_MAX_INFLIGHT_PER_EP"),
        "the admission gate works: {line}"
    );
    assert!(
        !line.contains("LLB_PD_ORIGIN_ERR_THRESHOLD"),
        "the breaker works: {line}"
    );
    let quiet = Daemon::start_default().await;
    assert!(!quiet.log_text().contains("without effect"));
}

/// A misspelt variable would leave its default in force without a word: every set `LOXI_*`,
/// `LOXILB_*` or `LLB_*` variable loxi does not read is warned about once at start, with the
/// closest known name; known ones (and the value the right name sets) are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_environment_variables_are_warned_with_the_closest_known_name() {
    let d = Daemon::start(
        DaemonOpts::default()
            .env("LOXI_MAX_BODY_BYTE", "1024")
            .env("LOXI_HEADER_TIMEOUT", "5")
            .env("LLB_SOMETHING_NEW", "1")
            .env("LOXI_MAX_BODY_BYTES", "2048"),
    )
    .await;
    let log = d.log_text();
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("loxi reads no such variable"))
        .collect();
    assert_eq!(warned.len(), 3, "one warning per unknown variable:\n{log}");
    for (var, tail) in [
        (
            "LLB_SOMETHING_NEW",
            "LLB_SOMETHING_NEW is set but loxi reads no such variable (ignored)",
        ),
        (
            "LOXI_HEADER_TIMEOUT",
            "LOXI_HEADER_TIMEOUT is set but loxi reads no such variable; did you mean \
             LOXI_HEADER_TIMEOUT_MS?",
        ),
        (
            "LOXI_MAX_BODY_BYTE",
            "LOXI_MAX_BODY_BYTE is set but loxi reads no such variable; did you mean \
             LOXI_MAX_BODY_BYTES?",
        ),
    ] {
        let line = warned
            .iter()
            .find(|l| l.split_whitespace().any(|w| w == format!("var={var}")))
            .unwrap_or_else(|| panic!("no warning for {var}:\n{log}"));
        assert!(line.contains("WARN") && line.contains(tail), "{line}");
    }
    // The right name works: a 4 KiB body is over its 2 KiB limit.
    let port = free_port();
    let b = Backend::start("b").await;
    let mut r = rule(port, json!({}));
    r["endpoints"] = json!([{"endpointIP": "127.0.0.1", "targetPort": b.port()}]);
    let (status, body) = d.post_rule(&r).await;
    assert_eq!(status, 200, "{body}");
    let c = loxi_tests::http::client();
    let req = http::Request::post(format!("http://127.0.0.1:{port}/v1/completions"))
        .header("content-type", "application/json")
        .body(loxi_tests::http::full(format!(
            "{{\"prompt\":\"{}\"}}",
            "x".repeat(4096)
        )))
        .expect("request");
    assert_eq!(loxi_tests::http::send(&c, req).await.status, 413);
    let quiet = Daemon::start_default().await;
    assert!(!quiet.log_text().contains("no such variable"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_api_limit_is_413() {
    let d = Daemon::start_default().await;
    let mut big = rule(free_port(), json!({}));
    big["serviceArguments"]["name"] = json!("x".repeat(3 << 20));
    let (status, body) = d.post_rule(&big).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["code"], json!(413));
    // The API closed that connection without reading the rest of the body: ask on a new one.
    let out = d.loxicmd(&["get", "lb", "-o", "json"]);
    let listed: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(rules_of(&listed).is_empty(), "{listed}");
}

/// A request that declares a body over the 2 MiB limit (and sends none of it) is answered 413
/// in the API's error shape at once, not left waiting for its body until the 30 s request
/// timeout's 408; on the rule and the cert routes alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_body_over_the_api_limit_is_413_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = Daemon::start_default().await;
    for (method, path) in [
        ("POST", "/netlox/v1/config/loadbalancer"),
        ("POST", "/netlox/v1/config/cert"),
        ("PUT", "/netlox/v1/config/cert/api"),
    ] {
        let mut s = tokio::net::TcpStream::connect(d.api_addr())
            .await
            .expect("connect");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: 999999999999\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.expect("write head");
        let started = Instant::now();
        // The whole answer (head and its Content-Length of body) arrives at once ...
        let text = loxi_tests::http::read_answer(&mut s).await;
        let answered = started.elapsed();
        assert!(
            loxi_tests::http::answer_complete(text.as_bytes()),
            "{method} {path}: no answer within 5 s: {text:?}"
        );
        // ... and the connection is closed once the bounded drain of the body ends (2 s).
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
        assert!(
            matches!(closed, Ok(Ok(0))),
            "{method} {path}: connection not closed after the 413: {closed:?} {rest:?}"
        );
        assert!(
            text.to_ascii_lowercase()
                .contains("\r\nconnection: close\r\n"),
            "{text:?}"
        );
        assert!(
            text.starts_with("HTTP/1.1 413 "),
            "{method} {path}: {text:?}"
        );
        let body: Value = serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap_or(""))
            .unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert_eq!(body["code"], json!(413), "{body}");
        assert_eq!(
            body["message"],
            json!("request body exceeds the API's 2097152-byte limit"),
            "{body}"
        );
        assert!(
            answered < Duration::from_secs(1),
            "{method} {path}: {answered:?}"
        );
    }
    assert!(rules_of(&d.rules().await).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_are_capped_at_1024_per_rule() {
    let d = Daemon::start_default().await;
    let eps = |n: usize| -> Vec<Value> {
        (0..n)
            .map(|i| json!({"endpointIP": format!("127.1.{}.{}", i / 250, i % 250 + 1), "targetPort": 8000}))
            .collect()
    };
    let mut r = rule(free_port(), json!({}));
    r["endpoints"] = json!(eps(1025));
    let (status, body) = d.post_rule(&r).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], json!("endpoints"));
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("1024"),
        "{body}"
    );
    r["endpoints"] = json!(eps(1024));
    let (status, body) = d.post_rule(&r).await;
    assert_eq!(status, 200, "{body}");
    let listed = rules_of(&d.rules().await);
    assert_eq!(listed[0]["endpoints"].as_array().map(Vec::len), Some(1024));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenizer_metrics_are_labelled_by_rule_model_never_by_the_clients_string() {
    let d = Daemon::start_default().await;
    let b = Backend::start("b0").await;
    let (wild, named) = (free_port(), free_port());
    for (port, model) in [(wild, ""), (named, "acme/named")] {
        let r = json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                "mode": 4, "kvExactMode": 3, "kvZmqPort": free_port(), "model_name": model},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": b.port()}]
        });
        let (status, body) = d.post_rule(&r).await;
        assert_eq!(status, 200, "{body}");
    }
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let send = |port: u16, model: String| {
        let body = json!({"model": model, "prompt": "a prompt long enough to be tokenized", "max_tokens": 1});
        let req = http::Request::post(format!("http://127.0.0.1:{port}/v1/completions"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_string(),
            )))
            .expect("request");
        client.request(req)
    };
    for i in 0..3 {
        let resp = send(wild, format!("client-invented-{i}"))
            .await
            .expect("proxied");
        assert_eq!(resp.status(), 200);
    }
    let resp = send(named, "acme/named".into()).await.expect("proxied");
    assert_eq!(resp.status(), 200);
    let m = d.metrics_text().await;
    assert!(
        !m.contains("client-invented"),
        "a client created series:\n{m}"
    );
    assert_eq!(
        sample(
            &m,
            r#"loxilb_kv_tokenizer_load_failures_total{model="other"}"#
        ),
        Some(3.0),
        "{m}"
    );
    assert_eq!(
        sample(
            &m,
            r#"loxilb_kv_tokenizer_load_failures_total{model="acme/named"}"#
        ),
        Some(1.0),
        "{m}"
    );
}

/// `GET /config/endpoint/all` names the probe loxi really runs: `monitor: true` without a
/// `probetype` is probed with a TCP connect (listed `tcp`, with the 2 s timeout and 2 retries
/// applied for 0), `https` is probed with a TCP connect too, and a rule without either is
/// `none`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_list_names_the_probe_that_runs() {
    let d = Daemon::start_default().await;
    let entry = |v: &Value, host: &str| -> Value {
        v["Attr"]
            .as_array()
            .and_then(|a| a.iter().find(|e| e["hostName"] == json!(host)).cloned())
            .unwrap_or_else(|| panic!("{host} in {v}"))
    };
    let with = |port: u16, extra: Value, ip: &str| {
        let mut r = rule(port, extra);
        r["endpoints"] = json!([{"endpointIP": ip, "targetPort": 8001}]);
        r
    };
    for (extra, ip) in [
        (json!({"monitor": true}), "127.0.0.2"),
        (
            json!({"probetype": "https", "probeTimeout": 5}),
            "127.0.0.3",
        ),
        (json!({}), "127.0.0.4"),
        (
            json!({"probetype": "http", "probereq": "/health", "probeRetries": 4}),
            "127.0.0.5",
        ),
    ] {
        let (status, body) = d.post_rule(&with(free_port(), extra, ip)).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, text) = d.get("/netlox/v1/config/endpoint/all").await.expect("GET");
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    let got = |ip: &str| {
        let e = entry(&v, ip);
        (
            e["probeType"].as_str().unwrap_or_default().to_string(),
            e["probeDuration"].as_u64(),
            e["inactiveReTries"].as_u64(),
            e["name"].as_str().unwrap_or_default().to_string(),
        )
    };
    assert_eq!(
        got("127.0.0.2"),
        ("tcp".into(), Some(2), Some(2), "127.0.0.2_tcp_8001".into())
    );
    assert_eq!(
        got("127.0.0.3"),
        ("tcp".into(), Some(5), Some(2), "127.0.0.3_tcp_8001".into())
    );
    assert_eq!(
        got("127.0.0.4"),
        (
            "none".into(),
            Some(0),
            Some(0),
            "127.0.0.4_none_8001".into()
        )
    );
    assert_eq!(
        got("127.0.0.5"),
        (
            "http".into(),
            Some(2),
            Some(4),
            "127.0.0.5_http_8001".into()
        )
    );
}
