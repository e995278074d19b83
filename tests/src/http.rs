//! A plain HTTP/1 client for tests that talk to a VIP or an engine on loopback: one body type,
//! one bounded send that collects the whole answer, and a Prometheus sample reader.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// The request body type of [`client`].
pub type Body = BoxBody<Bytes, Infallible>;

/// The test client (plain HTTP/1, pooled).
pub type TestClient = Client<HttpConnector, Body>;

/// A new [`TestClient`].
pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A whole request body.
pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

/// A response as the tests see it: status, headers and the whole body as text.
pub struct Resp {
    /// HTTP status.
    pub status: u16,
    /// Response headers.
    pub headers: http::HeaderMap,
    /// The body, lossily decoded as UTF-8.
    pub text: String,
}

impl Resp {
    /// Header `n` as text, if present and valid.
    pub fn header(&self, n: &str) -> Option<&str> {
        self.headers.get(n).and_then(|v| v.to_str().ok())
    }

    /// The body as JSON; panics naming the body when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("{e}: {}", self.text))
    }
}

/// Sends `req` and collects the answer (20 s at most; panics past it or on a transport error).
pub async fn send(c: &TestClient, req: http::Request<Body>) -> Resp {
    let resp = tokio::time::timeout(Duration::from_secs(20), c.request(req))
        .await
        .expect("response within 20 s")
        .expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    Resp {
        status,
        headers,
        text: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// Value of a sample `name{labels} value` whose labels contain every needle (0 when absent).
pub fn metric(text: &str, name: &str, needles: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .find(|l| needles.iter().all(|n| l.contains(n)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Reads one whole HTTP/1.1 answer (its head and `Content-Length` of body) from `s`, for at
/// most 5 s; what arrived by then, as text (incomplete when the time ran out or the
/// connection closed first).
pub async fn read_answer<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> String {
    use tokio::io::AsyncReadExt as _;
    let started = std::time::Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer_complete(&got) && started.elapsed() < Duration::from_secs(5) {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Whether `got` holds an HTTP/1.1 head and as much body as its `Content-Length` says.
pub fn answer_complete(got: &[u8]) -> bool {
    let text = String::from_utf8_lossy(got);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    head.lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
        })
        .is_some_and(|n| body.len() >= n)
}
