//! Fullproxy hygiene with the real daemon and a recording backend: `X-Forwarded-For` is kept
//! and extended, `X-Forwarded-Proto` is the listener's, `CONNECT` is refused with 405, an
//! HTTP/1.1 request without `Host` with 400, and a retry after a connect failure carries the
//! client's headers unchanged to the next endpoint, as does a GET an endpoint dropped without an
//! answer (a dropped POST is 502).

use std::time::Duration;

use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, free_port};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn setup() -> (Daemon, Backend, u16) {
    let d = Daemon::start_default().await;
    let b = Backend::start("b0").await;
    b.set_recording(true);
    let port = free_port();
    let (status, body) = d
        .post_rule(&json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": b.port()}]
        }))
        .await;
    assert_eq!(status, 200, "{body}");
    (d, b, port)
}

/// Posts a mode-4 round-robin rule on a free port of 127.0.0.1 with endpoints
/// `127.0.0.1:first` and `127.0.0.1:second`, in that order; its port.
async fn round_robin_pair(d: &Daemon, first: u16, second: u16) -> u16 {
    let port = free_port();
    let (status, body) = d
        .post_rule(&json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": first},
                          {"endpointIP": "127.0.0.1", "targetPort": second}]
        }))
        .await;
    assert_eq!(status, 200, "{body}");
    port
}

/// Sends raw HTTP/1.1 bytes and returns everything the proxy answered (connection closed).
async fn raw(port: u16, request: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(request.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "answer within 10 s");
    String::from_utf8_lossy(&out).into_owned()
}

fn get(port: u16, extra_headers: &str) -> String {
    format!(
        "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra_headers}Connection: close\r\n\r\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_forwarded_for_is_extended_and_proto_is_the_listeners() {
    let (_d, b, port) = setup().await;
    let answer = raw(port, &get(port, "")).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let answer = raw(
        port,
        &get(
            port,
            "X-Forwarded-For: 203.0.113.9\r\nX-Forwarded-For: 198.51.100.4\r\nX-Forwarded-Proto: https\r\n",
        ),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // Naming the header in Connection (hop-by-hop) must not let a client strip it.
    let answer = raw(
        port,
        "GET /health HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 192.0.2.1\r\nConnection: close, x-forwarded-for\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let seen: Vec<(Option<String>, Option<String>)> = b
        .requests()
        .iter()
        .map(|r| {
            (
                r.header("x-forwarded-for").map(String::from),
                r.header("x-forwarded-proto").map(String::from),
            )
        })
        .collect();
    let s = |v: &str| Some(v.to_string());
    assert_eq!(
        seen,
        [
            (s("127.0.0.1"), s("http")),
            (s("203.0.113.9, 198.51.100.4, 127.0.0.1"), s("http")),
            (s("127.0.0.1"), s("http")),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http11_request_without_host_is_refused_with_400_and_http10_is_forwarded() {
    let (_d, b, port) = setup().await;
    let answer = raw(
        port,
        "POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("missing_host"), "{answer}");
    assert_eq!(b.request_count(), 0, "nothing was forwarded");
    // HTTP/1.0 has no Host requirement: forwarded, with the endpoint as Host upstream.
    let answer = raw(
        port,
        "POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
        "{answer}"
    );
    assert_eq!(b.request_count(), 1);
    let host = b.requests()[0].header("host").map(String::from);
    assert!(
        host.as_deref().is_some_and(|h| h.starts_with("127.0.0.1:")),
        "{host:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_host_headers_are_refused_and_an_absolute_form_target_names_the_host() {
    let (_d, b, port) = setup().await;
    let answer = raw(
        port,
        "GET /health HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("duplicate_host"), "{answer}");
    assert_eq!(b.request_count(), 0, "nothing was forwarded");
    // RFC 9112 §3.2.2: the request target's authority wins over Host, for routing and upstream.
    let answer = raw(
        port,
        "GET http://b.example/health HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(b.request_count(), 1);
    let hosts: Vec<String> = b.requests()[0]
        .headers
        .iter()
        .filter(|(k, _)| k == "host")
        .map(|(_, v)| v.clone())
        .collect();
    assert_eq!(hosts, ["b.example"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_connect_failure_carries_the_clients_headers_and_its_own_host() {
    let d = Daemon::start_default().await;
    let b = Backend::start("b0").await;
    b.set_recording(true);
    // Endpoint 0 refuses connections (nothing listens there); round robin sends one of the two
    // requests there first, and that one is retried on endpoint 1.
    let port = round_robin_pair(&d, free_port(), b.port()).await;
    for _ in 0..2 {
        // HTTP/1.0 without Host: the proxy adds the endpoint's, which must follow the retry.
        let answer = raw(
            port,
            "POST /v1/completions HTTP/1.0\r\nX-Keep: 1\r\nX-Forwarded-For: 203.0.113.9\r\nContent-Length: 2\r\n\r\n{}",
        )
        .await;
        assert!(answer.contains(" 200 "), "{answer}");
    }
    let seen: Vec<(Option<String>, Option<String>, Option<String>)> = b
        .requests()
        .iter()
        .map(|r| {
            (
                r.header("host").map(String::from),
                r.header("x-keep").map(String::from),
                r.header("x-forwarded-for").map(String::from),
            )
        })
        .collect();
    let want = (
        Some(format!("127.0.0.1:{}", b.port())),
        Some("1".to_string()),
        Some("203.0.113.9, 127.0.0.1".to_string()),
    );
    assert_eq!(seen, [want.clone(), want]);
    let metrics = d.metrics_text().await;
    assert!(
        metrics.lines().any(
            |l| l.starts_with("loxilb_proxy_upstream_connect_failures_total{") && l.ends_with(" 1")
        ),
        "one connect failure, retried"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_is_refused_with_405_and_never_reaches_a_backend() {
    let (_d, b, port) = setup().await;
    let answer = raw(
        port,
        "CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("\r\nallow: "),
        "{answer}"
    );
    assert!(answer.contains("method_not_allowed"), "{answer}");
    assert_eq!(b.request_count(), 0, "nothing was forwarded");
}

/// A fully qualified name with its trailing dot (`api.example.com.`, RFC 1034 §3.1) names the
/// same host as `api.example.com`: routed to that host's rule, not `no_route`; the client's
/// `Host` reaches the backend as sent. One dot only: `api.example.com..` is another name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_with_a_trailing_dot_routes_to_the_rule_of_that_host() {
    let d = Daemon::start_default().await;
    let b = Backend::start("api").await;
    b.set_recording(true);
    let port = free_port();
    let (status, body) = d
        .post_rule(&json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                                 "mode": 4, "host": "api.example.com"},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": b.port()}]
        }))
        .await;
    assert_eq!(status, 200, "{body}");
    for host in [
        "api.example.com.".to_string(),
        format!("API.Example.com.:{port}"),
    ] {
        let answer = raw(
            port,
            &format!("GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{host}: {answer}");
        assert!(answer.contains("x-backend: api"), "{host}: {answer}");
    }
    let hosts: Vec<Option<String>> = b
        .requests()
        .iter()
        .map(|r| r.header("host").map(String::from))
        .collect();
    assert_eq!(
        hosts,
        [
            Some("api.example.com.".to_string()),
            Some(format!("API.Example.com.:{port}"))
        ]
    );
    let answer = raw(
        port,
        "GET /health HTTP/1.1\r\nHost: api.example.com..\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    assert!(answer.contains("no_route"), "{answer}");
}

/// A cleartext HTTP/2 (h2c, prior knowledge) backend on loopback: answers `{"version": ..}`
/// and records each request's HTTP version.
async fn h2c_backend() -> (u16, std::sync::Arc<parking_lot::Mutex<Vec<String>>>) {
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = tcp.local_addr().expect("addr").port();
    let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = tcp.accept().await {
            let seen = seen2.clone();
            let svc =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let version = format!("{:?}", req.version());
                    seen.lock().push(version.clone());
                    async move {
                        Ok::<_, std::convert::Infallible>(http::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from(
                                json!({"version": version}).to_string(),
                            )),
                        ))
                    }
                });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc),
            );
        }
    });
    (port, seen)
}

/// An h2c backend that answers every stream with `RST_STREAM(REFUSED_STREAM)` (an overloaded
/// HTTP/2 server: RFC 9113 §8.7, the request was not processed); counts the streams.
async fn h2c_refusing_backend() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = tcp.local_addr().expect("addr").port();
    let streams = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = streams.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = tcp.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                }
            });
        }
    });
    (port, streams)
}

/// A stream an HTTP/2 backend refuses (REFUSED_STREAM: not processed) is retried on the next
/// endpoint, and its error carries no hint about HTTP/1.1 backends (the peer spoke HTTP/2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_http2_stream_is_retried_on_the_next_endpoint() {
    let d = Daemon::start_default().await;
    let (refuser, refused) = h2c_refusing_backend().await;
    let (good, seen) = h2c_backend().await;
    let port = h2c_rule(&d, &[refuser, good]).await;
    for _ in 0..4 {
        let answer = raw(port, &get(port, "")).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains(r#"{"version":"HTTP/2.0"}"#), "{answer}");
    }
    assert_eq!(
        seen.lock().len(),
        4,
        "every request served by the HTTP/2 backend"
    );
    assert!(
        refused.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "round robin sent some to the refusing backend first"
    );
    // With the refusing backend alone, the 502 names the refusal, without the HTTP/1.1 hint.
    let port = h2c_rule(&d, &[refuser]).await;
    let answer = raw(port, &get(port, "")).await;
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    assert!(answer.contains("REFUSED_STREAM"), "{answer}");
    assert!(!answer.contains("use http1"), "{answer}");
}

/// `backend_protocol: http2` without TLS speaks HTTP/2 with prior knowledge to the backend; an
/// HTTP/1.1-only backend behind it answers 502 with a message that names the setting (it was
/// a bare `client error (SendRequest)`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_protocol_http2_is_h2c_and_an_http1_backend_is_named() {
    let d = Daemon::start_default().await;
    let (h2port, h2seen) = h2c_backend().await;
    let h1 = Backend::start("h1").await;
    h1.set_recording(true);
    let rule = |port: u16, backend: u16| {
        json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                "mode": 4, "backend_protocol": "http2"},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": backend}]
        })
    };
    let post = |port: u16| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: \
             application/json\r\nContent-Length: 14\r\nConnection: close\r\n\r\n{{\"prompt\":\"p\"}}"
        )
    };
    let port = free_port();
    let (status, body) = d.post_rule(&rule(port, h2port)).await;
    assert_eq!(status, 200, "{body}");
    let answer = raw(port, &post(port)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#"{"version":"HTTP/2.0"}"#), "{answer}");
    assert_eq!(*h2seen.lock(), vec!["HTTP/2.0".to_owned()]);

    let port = free_port();
    let (status, body) = d.post_rule(&rule(port, h1.port())).await;
    assert_eq!(status, 200, "{body}");
    let answer = raw(port, &post(port)).await;
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    assert!(
        answer.contains("backend_protocol http2") && answer.contains("use http1"),
        "{answer}"
    );
    assert!(h1.requests().is_empty(), "no HTTP/1.1 request reached it");
}

/// An HTTP/1.1 backend that reads each request's head and then resets the connection (RST,
/// zero linger) without answering; returns its port and how many requests it dropped.
async fn dropping_backend() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = tcp.local_addr().expect("addr").port();
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = dropped.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = tcp.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = stream.set_zero_linger();
            });
        }
    });
    (port, dropped)
}

/// An idempotent request (GET) an HTTP/1.1 endpoint drops after it was sent, without a
/// response head, is sent again to the next endpoint with the client's headers, and counted in
/// `loxilb_proxy_upstream_retries_total`; a POST dropped the same way is not (it may have run):
/// 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_request_a_backend_drops_is_retried_and_a_post_is_not() {
    let d = Daemon::start_default().await;
    let (dropper, dropped) = dropping_backend().await;
    let b = Backend::start("b1").await;
    b.set_recording(true);
    let port = round_robin_pair(&d, dropper, b.port()).await;
    for _ in 0..2 {
        let answer = raw(port, &get(port, "X-Keep: 1\r\n")).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let drops = dropped.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        drops, 1,
        "round robin sent one of the two GETs to the dropping endpoint"
    );
    let seen: Vec<(Option<String>, Option<String>)> = b
        .requests()
        .iter()
        .map(|r| {
            (
                r.header("host").map(String::from),
                r.header("x-keep").map(String::from),
            )
        })
        .collect();
    let want = (Some(format!("127.0.0.1:{port}")), Some("1".to_string()));
    assert_eq!(
        seen,
        [want.clone(), want],
        "both GETs reached endpoint 1 whole"
    );
    let metrics = d.metrics_text().await;
    let retries: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("loxilb_proxy_upstream_retries_total{"))
        .collect();
    assert_eq!(retries.len(), 1, "{retries:?}");
    assert!(
        retries[0].contains(r#"ep_idx="0""#) && retries[0].ends_with(" 1"),
        "{retries:?}"
    );
    // A POST to an endpoint that drops it: 502, sent once, not retried.
    let port = round_robin_pair(&d, dropper, b.port()).await;
    let before = b.requests().len();
    let post = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    );
    let answers = [raw(port, &post).await, raw(port, &post).await];
    let bad: Vec<&String> = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 502"))
        .collect();
    assert_eq!(bad.len(), 1, "{answers:?}");
    assert_eq!(dropped.load(std::sync::atomic::Ordering::SeqCst), drops + 1);
    assert_eq!(
        b.requests().len(),
        before + 1,
        "the dropped POST was not sent again"
    );
    // Both endpoints drop: the GET is sent once to each, counted as one retry (the second
    // drop leaves nothing to send it to), and answered 502 `backend_unreachable`.
    let (dropper2, dropped2) = dropping_backend().await;
    let port = round_robin_pair(&d, dropper, dropper2).await;
    let retried = |m: &str| -> f64 {
        m.lines()
            .filter(|l| l.starts_with("loxilb_proxy_upstream_retries_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let (r0, d0) = (
        retried(&d.metrics_text().await),
        dropped.load(std::sync::atomic::Ordering::SeqCst),
    );
    let answer = raw(port, &get(port, "")).await;
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    assert!(
        answer.contains("backend_unreachable") && answer.contains("dropped an idempotent request"),
        "{answer}"
    );
    assert_eq!(
        (
            dropped.load(std::sync::atomic::Ordering::SeqCst) - d0,
            dropped2.load(std::sync::atomic::Ordering::SeqCst)
        ),
        (1, 1),
        "sent once to each endpoint"
    );
    assert_eq!(retried(&d.metrics_text().await) - r0, 1.0);
}

/// Connections an h2c test backend accepted in all, and holds open now.
#[derive(Default)]
struct Conns {
    accepted: std::sync::atomic::AtomicUsize,
    open: std::sync::atomic::AtomicUsize,
}

/// An h2c backend that answers each request with the `:authority` (the URI's authority) and the
/// `Host` headers it received: `{"authority": .., "host": [..]}`; with its port, it gives its
/// connection counts.
async fn h2c_host_reporting_backend() -> (u16, std::sync::Arc<Conns>) {
    use std::sync::atomic::Ordering::SeqCst;
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = tcp.local_addr().expect("addr").port();
    let conns = std::sync::Arc::new(Conns::default());
    let counts = conns.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = tcp.accept().await {
            counts.accepted.fetch_add(1, SeqCst);
            counts.open.fetch_add(1, SeqCst);
            let counts = counts.clone();
            let svc =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let authority = req.uri().authority().map(|a| a.to_string());
                    let host: Vec<String> = req
                        .headers()
                        .get_all(http::header::HOST)
                        .iter()
                        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                        .collect();
                    async move {
                        Ok::<_, std::convert::Infallible>(http::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from(
                                json!({"authority": authority, "host": host}).to_string(),
                            )),
                        ))
                    }
                });
            tokio::spawn(async move {
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                counts.open.fetch_sub(1, SeqCst);
            });
        }
    });
    (port, conns)
}

/// Posts a mode-4 rule on a free loopback port speaking cleartext HTTP/2 (`backend_protocol:
/// http2`) to the endpoints `127.0.0.1:{backends}` (round robin); gives the rule's port.
async fn h2c_rule(d: &Daemon, backends: &[u16]) -> u16 {
    let port = free_port();
    let endpoints: Vec<serde_json::Value> = backends
        .iter()
        .map(|b| json!({"endpointIP": "127.0.0.1", "targetPort": b}))
        .collect();
    let (status, body) = d
        .post_rule(&json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                "mode": 4, "backend_protocol": "http2"},
            "endpoints": endpoints
        }))
        .await;
    assert_eq!(status, 200, "{body}");
    port
}

/// Over HTTP/2 to a backend, the host the HTTP/1.1 path would send as `Host` (the client's) is
/// the request's `:authority`, with no `Host` header that could differ from it (RFC 9113
/// §8.3.1; it was the endpoint's address as `:authority` with the client's `Host` kept, which
/// loxi itself, as the backend, refused with 400 `authority_mismatch`). An HTTP/1.0 request
/// naming no host gets the endpoint's address, as over HTTP/1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_to_a_backend_carries_the_clients_host_as_authority_and_no_host_header() {
    let d = Daemon::start_default().await;
    let (backend, _) = h2c_host_reporting_backend().await;
    let port = h2c_rule(&d, &[backend]).await;
    let answer = raw(
        port,
        &format!("GET /h HTTP/1.1\r\nHost: api.example:{port}\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains(&format!(
            r#"{{"authority":"api.example:{port}","host":[]}}"#
        )),
        "{answer}"
    );
    let answer = raw(port, "GET /h HTTP/1.0\r\n\r\n").await;
    assert!(
        answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200"),
        "{answer}"
    );
    assert!(
        answer.contains(&format!(
            r#"{{"authority":"127.0.0.1:{backend}","host":[]}}"#
        )),
        "{answer}"
    );

    // loxi behind loxi (another daemon: one daemon answers a request that passed through it
    // 508): the outer rule speaks HTTP/2 to the inner rule's listener, which checks that Host
    // and :authority agree, and forwards to an HTTP/1.1 backend.
    let inner_d = Daemon::start_default().await;
    let echo = Backend::start("inner").await;
    echo.set_recording(true);
    let inner = free_port();
    let (status, body) = inner_d
        .post_rule(&json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": inner, "protocol": "tcp",
                "mode": 4},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": echo.port()}]
        }))
        .await;
    assert_eq!(status, 200, "{body}");
    let outer = h2c_rule(&d, &[inner]).await;
    let answer = raw(outer, &get(outer, "")).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let seen = echo.requests();
    assert_eq!(seen.len(), 1, "{answer}");
    assert_eq!(
        seen[0].header("host"),
        Some(format!("127.0.0.1:{outer}").as_str()),
        "the inner loxi passes on the client's host"
    );
}

/// HTTP/2 connections to a backend are pooled per (endpoint, client host), since the host is
/// the request's `:authority`: a client cycling `Host` values must not open backend
/// connections without bound. 40 distinct hosts leave at most `HOSTS_PER_ENDPOINT` (16)
/// connections open (each evicted host's idle connection closes), and a recent host's requests
/// reuse its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_connections_per_client_host_are_bounded() {
    use std::sync::atomic::Ordering::SeqCst;
    let d = Daemon::start_default().await;
    let (backend, conns) = h2c_host_reporting_backend().await;
    let port = h2c_rule(&d, &[backend]).await;
    let ask = |host: String| async move {
        let answer = raw(
            port,
            &format!("GET /h HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(
            answer.contains(&format!(r#"{{"authority":"{host}","host":[]}}"#)),
            "{answer}"
        );
    };
    for i in 0..40 {
        ask(format!("h{i}.example")).await;
    }
    assert_eq!(conns.accepted.load(SeqCst), 40, "one connection per host");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while conns.open.load(SeqCst) > 16 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        conns.open.load(SeqCst),
        16,
        "the evicted hosts' connections are closed, the 16 most recent kept"
    );
    for _ in 0..3 {
        ask("h39.example".into()).await;
        ask("h24.example".into()).await;
    }
    assert_eq!(
        conns.accepted.load(SeqCst),
        40,
        "a pooled host's connection is reused"
    );
}

/// An h2c backend whose first `draining` connections answer the client's preface with its
/// SETTINGS and a GOAWAY (NO_ERROR, last stream id 0: nothing processed) written by hand, then
/// read and discard until the client closes (so no reset loses the GOAWAY); every later
/// connection is served by the h2 crate's server (200, `served`). Gives its port and
/// connection count.
async fn h2c_backend_draining(draining: usize) -> (u16, std::sync::Arc<Conns>) {
    use std::sync::atomic::Ordering::SeqCst;
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = tcp.local_addr().expect("addr").port();
    let conns = std::sync::Arc::new(Conns::default());
    let counts = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = tcp.accept().await {
            let first = counts.accepted.fetch_add(1, SeqCst) < draining;
            tokio::spawn(async move {
                if first {
                    // SETTINGS (empty), then GOAWAY: length 8, type 7, stream 0, last stream
                    // id 0, error code NO_ERROR.
                    let mut frames = vec![0, 0, 0, 4, 0, 0, 0, 0, 0];
                    frames.extend_from_slice(&[0, 0, 8, 7, 0, 0, 0, 0, 0]);
                    frames.extend_from_slice(&[0; 8]);
                    let _ = stream.write_all(&frames).await;
                    let mut sink = [0u8; 4096];
                    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
                    return;
                }
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                while let Some(Ok((_, mut respond))) = conn.accept().await {
                    if let Ok(mut body) = respond.send_response(http::Response::new(()), false) {
                        let _ = body.send_data(bytes::Bytes::from_static(b"served"), true);
                    }
                }
            });
        }
    });
    (port, conns)
}

/// A POST of a completion (not idempotent: a failed attempt is not retried elsewhere unless
/// the backend cannot have processed it) to the proxy on `port`, `Connection: close`.
fn completion(port: u16) -> String {
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: \
         application/json\r\nContent-Length: 14\r\nConnection: close\r\n\r\n{{\"prompt\":\"p\"}}"
    )
}

/// A request an HTTP/2 backend's GOAWAY left unprocessed (RFC 9113 §6.8: safe to retry) is
/// sent again on a new connection to the same endpoint and answered 200, a POST too; it was
/// answered 502 (`connection error received: not a result of an error`), which also counted
/// against the endpoint's circuit breaker (trial finding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_backend_goaway_left_unprocessed_is_sent_again() {
    use std::sync::atomic::Ordering::SeqCst;
    let d = Daemon::start_default().await;
    let (backend, conns) = h2c_backend_draining(1).await;
    let port = h2c_rule(&d, &[backend]).await;
    let answer = raw(port, &completion(port)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\r\nserved\r\n"), "{answer}");
    assert_eq!(
        conns.accepted.load(SeqCst),
        2,
        "the drained connection, then a new one"
    );

    // An endpoint whose every connection goes away unprocessed takes no request: after its
    // resends the POST goes to another endpoint (it was 502, not retryable).
    let (gone, gone_conns) = h2c_backend_draining(usize::MAX).await;
    let (ok, _) = h2c_backend_draining(0).await;
    let port = h2c_rule(&d, &[gone, ok]).await;
    for _ in 0..2 {
        let answer = raw(port, &completion(port)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("\r\nserved\r\n"), "{answer}");
    }
    assert!(
        gone_conns.accepted.load(SeqCst) >= 4,
        "the going-away endpoint was tried with its resends"
    );
}
