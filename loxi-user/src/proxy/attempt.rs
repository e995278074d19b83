//! The outcome of one upstream attempt, shared by both upstream clients (`upstream.rs`'s pooled
//! hyper-util client and `upstream_h1.rs`'s driven HTTP/1.1 connections) and by the proxy's
//! error mapping.

use hyper::Response;
use hyper::body::Incoming;

/// A failure after the request may have reached the backend (hyper's or hyper-util's error).
pub type UpstreamError = Box<dyn std::error::Error + Send + Sync>;

/// The outcome of one upstream attempt; `B` is the response body type.
#[derive(Debug)]
pub enum Attempt<B = Incoming> {
    /// The backend answered (head received; body streams).
    Response(Response<B>),
    /// The connection could not be established; the request was not sent. Retry elsewhere.
    /// The text is the whole error chain (a TLS verification failure names its reason).
    ConnectFailed(String),
    /// The request failed after it may have reached the backend. Not retried.
    Failed(UpstreamError),
}

impl<B> Attempt<B> {
    /// The same outcome with the response body mapped by `f`.
    pub fn map_body<C>(self, f: impl FnOnce(B) -> C) -> Attempt<C> {
        match self {
            Self::Response(r) => Attempt::Response(r.map(f)),
            Self::ConnectFailed(e) => Attempt::ConnectFailed(e),
            Self::Failed(e) => Attempt::Failed(e),
        }
    }

    /// The backend's status, when it answered.
    pub fn status(&self) -> Option<http::StatusCode> {
        match self {
            Self::Response(r) => Some(r.status()),
            _ => None,
        }
    }

    /// `connect` or `request` when the attempt failed (the trace's `error.type`).
    pub fn error_type(&self) -> Option<&'static str> {
        match self {
            Self::Response(_) => None,
            Self::ConnectFailed(_) => Some("connect"),
            Self::Failed(_) => Some("request"),
        }
    }
}

/// The text of `e` and every error under it, joined by `: ` (hyper-util's client errors say
/// only "client error (Connect)"; the reason, e.g. a certificate for another name, is below).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}
