//! The API's connection bounds over real loopback TCP: a silent connection and a slowloris head
//! are closed at the header timeout, a trickled body gets 408 in LoxiLB's error shape, and the
//! connection cap holds a further client until a slot frees.

use std::time::Duration;

use axum::routing::{get, post};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, sleep, timeout};

use super::*;

fn app() -> Router {
    Router::new()
        .route("/ok", get(|| async { "ok" }))
        .route("/echo", post(|body: String| async move { body }))
}

/// Starts [`serve`] on an ephemeral loopback port; returns the address and the stop token.
async fn start(limits: ApiLimits) -> (std::net::SocketAddr, CancellationToken) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let stop = CancellationToken::new();
    let s = stop.clone();
    #[allow(
        clippy::disallowed_methods,
        reason = "test server task; stopped by the token at the end of the test"
    )]
    tokio::spawn(async move { serve(l, app(), limits, s).await });
    (addr, stop)
}

/// Reads until EOF (or a reset); returns what was read and when the socket closed.
async fn read_to_close(c: &mut TcpStream, bound: Duration) -> Option<(Vec<u8>, Instant)> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    let end = Instant::now() + bound;
    loop {
        match timeout(
            end.saturating_duration_since(Instant::now()),
            c.read(&mut buf),
        )
        .await
        {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some((got, Instant::now())),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Reads one response's head and body (the body is complete when `until` ends it).
async fn read_until(c: &mut TcpStream, until: &[u8], bound: Duration) -> Option<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    let end = Instant::now() + bound;
    while !got.ends_with(until) {
        match timeout(
            end.saturating_duration_since(Instant::now()),
            c.read(&mut buf),
        )
        .await
        {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => return None,
        }
    }
    Some(String::from_utf8_lossy(&got).into_owned())
}

fn limits(header_ms: u64, request_ms: u64, max_conns: usize) -> ApiLimits {
    ApiLimits {
        header_timeout: Duration::from_millis(header_ms),
        request_timeout: Duration::from_millis(request_ms),
        max_conns,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_idle_and_slowloris_connections_are_closed_at_the_header_timeout() {
    let (addr, stop) = start(limits(400, 5_000, 16)).await;
    let t0 = Instant::now();
    // Silent from the start.
    let mut silent = TcpStream::connect(addr).await.expect("connect");
    // Idle after one answered request (keep-alive).
    let mut idle = TcpStream::connect(addr).await.expect("connect");
    idle.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let answer = read_until(&mut idle, b"\r\n\r\nok", Duration::from_secs(5))
        .await
        .expect("the request is answered");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // A head trickled one header line every 100 ms, never finished.
    let mut slow = TcpStream::connect(addr).await.expect("connect");
    slow.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    let trickle = async {
        for i in 0..100 {
            sleep(Duration::from_millis(100)).await;
            if slow
                .write_all(format!("X-Pad-{i}: y\r\n").as_bytes())
                .await
                .is_err()
            {
                break;
            }
        }
        read_to_close(&mut slow, Duration::from_secs(5)).await
    };
    let (silent_end, idle_end, slow_end) = tokio::join!(
        read_to_close(&mut silent, Duration::from_secs(5)),
        read_to_close(&mut idle, Duration::from_secs(5)),
        trickle,
    );
    for (what, end) in [
        ("silent", silent_end),
        ("idle", idle_end),
        ("slowloris", slow_end),
    ] {
        let (_, at) = end.unwrap_or_else(|| panic!("{what} connection still open after 5 s"));
        let after = at - t0;
        assert!(
            after >= Duration::from_millis(350) && after < Duration::from_secs(4),
            "{what} connection closed after {after:?}, header timeout 400 ms"
        );
    }
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_gets_408_in_the_error_shape() {
    let (addr, stop) = start(limits(5_000, 400, 16)).await;
    let mut c = TcpStream::connect(addr).await.expect("connect");
    c.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nab")
        .await
        .expect("write");
    let answer = read_until(&mut c, b"}\n", Duration::from_secs(5))
        .await
        .expect("an answer before 5 s");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let body = answer.split("\r\n\r\n").nth(1).expect("body");
    let v: serde_json::Value = serde_json::from_str(body.trim()).expect("JSON body");
    assert_eq!(v["code"], serde_json::json!(408));
    assert_eq!(
        v["message"],
        serde_json::json!("request not completed within 0.4 s")
    );
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_holds_a_further_client_until_a_slot_frees() {
    let (addr, stop) = start(limits(5_000, 5_000, 1)).await;
    let holder = TcpStream::connect(addr).await.expect("connect");
    // Let the loop accept the holder and wait for the next slot.
    sleep(Duration::from_millis(200)).await;
    let mut next = TcpStream::connect(addr)
        .await
        .expect("connect (kernel backlog)");
    next.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    assert!(
        read_until(&mut next, b"\r\n\r\nok", Duration::from_millis(500))
            .await
            .is_none(),
        "a second client is served while the only slot is held"
    );
    drop(holder);
    let answer = read_until(&mut next, b"\r\n\r\nok", Duration::from_secs(5))
        .await
        .expect("served once the holder closed");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    stop.cancel();
}

/// An HTTP/2 prior-knowledge (h2c) client is served as an HTTP/1.1 one is (it got a closed
/// connection: the API spoke HTTP/1.1 only), several requests on one connection; and the
/// connection bounds hold for HTTP/2 too: a client that sends the preface and then nothing,
/// or goes idle after its requests, is closed at the header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_prior_knowledge_client_is_served_and_closed_when_idle() {
    use http_body_util::{BodyExt, Full};
    let (addr, stop) = start(limits(400, 5_000, 16)).await;
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("HTTP/2 handshake");
    #[allow(
        clippy::disallowed_methods,
        reason = "the client connection's driver; ends with the connection"
    )]
    let driver = tokio::spawn(conn);
    for (path, body) in [("/ok", ""), ("/echo", "hello")] {
        let method = if body.is_empty() { "GET" } else { "POST" };
        let req = http::Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"))
            .body(Full::new(bytes::Bytes::from(body)))
            .expect("request");
        let resp = timeout(Duration::from_secs(5), send.send_request(req))
            .await
            .expect("answered within 5 s")
            .expect("an HTTP/2 answer");
        assert_eq!(
            (resp.status(), resp.version()),
            (StatusCode::OK, http::Version::HTTP_2)
        );
        let got = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(got, if body.is_empty() { "ok" } else { body });
    }
    // Idle after its requests: closed (a GOAWAY, then the end) at the header timeout.
    let t0 = Instant::now();
    timeout(Duration::from_secs(4), driver)
        .await
        .expect("the idle HTTP/2 connection is closed within 4 s")
        .expect("driver task")
        .expect("closed cleanly, with a GOAWAY");
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    // The preface and an empty SETTINGS frame, then silence: closed at the header timeout.
    let mut silent = TcpStream::connect(addr).await.expect("connect");
    let t0 = Instant::now();
    silent
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .expect("write");
    let (_, at) = read_to_close(&mut silent, Duration::from_secs(5))
        .await
        .expect("the silent HTTP/2 connection is closed within 5 s");
    let after = at - t0;
    assert!(
        after >= Duration::from_millis(350) && after < Duration::from_secs(4),
        "closed after {after:?}, header timeout 400 ms"
    );
    stop.cancel();
}
