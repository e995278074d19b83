//! Upstream HTTP clients: hyper-util's pooled legacy client (one connection pool per endpoint
//! authority), HTTP/1.1 or HTTP/2 prior knowledge per the rule's `backend_protocol`, with a
//! connect timeout. Connect failures are reported apart from other failures so the caller can
//! retry another endpoint safely (nothing was sent). The fullproxy's own cleartext HTTP/1.1
//! requests take [`Upstreams::send_h1`] instead: connections driven by the request's task
//! (`upstream_h1.rs`).
//!
//! Requests that may go out over HTTP/2 (`backend_protocol: http2`, and every `security: 2`
//! rule, whose ALPN may pick `h2`) name their host in the URI, not in `Host`: the host the
//! HTTP/1.1 path sends as `Host` (the client's) becomes `:authority` over HTTP/2 (and `Host`
//! again over HTTP/1.1), so no `Host` can differ from `:authority` (RFC 9113 §8.3.1). Their
//! connections are pooled per endpoint and host ([`PerEndpoint`], `per_endpoint.rs`): the URI
//! no longer names the endpoint.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Uri, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub use super::attempt::{Attempt, H2cFailed, LocalShortage, UpstreamError, error_chain};
use super::per_endpoint::PerEndpoint;
use super::upstream_h1::{DrivenBody, H1Pool};

/// A response body from either client: hyper-util's pooled one or a driven HTTP/1.1
/// connection ([`Upstreams::send_h1`]).
pub enum UpstreamBody {
    /// From [`Upstreams::send`].
    Pooled(Incoming),
    /// From [`Upstreams::send_h1`].
    Driven(DrivenBody),
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            Self::Pooled(b) => std::pin::Pin::new(b).poll_frame(cx),
            Self::Driven(b) => std::pin::Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Pooled(b) => b.is_end_stream(),
            Self::Driven(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            Self::Pooled(b) => b.size_hint(),
            Self::Driven(b) => b.size_hint(),
        }
    }
}

/// How a pool reaches its endpoints.
#[derive(Clone, Debug)]
pub enum Via {
    /// Cleartext HTTP/1.1 (`backend_protocol: http1`).
    H1,
    /// Cleartext HTTP/2 with prior knowledge (`backend_protocol: http2`).
    H2,
    /// TLS (`security: 2`) with the rule's own pooled clients (ALPN per `backend_protocol`).
    Tls(Box<super::upstream_tls::TlsClient>),
    /// A `security: 2` rule whose TLS client could not be built (its CA file became
    /// unreadable after the rule was accepted): every connect fails with this reason.
    Unavailable(std::sync::Arc<str>),
}

/// HTTP/1.1 and HTTP/2 pooled clients.
#[derive(Clone, Debug)]
pub struct Upstreams {
    h1: Client<HttpConnector, Full<Bytes>>,
    h2: Arc<PerEndpoint<HttpConnector>>,
    driven: Arc<H1Pool>,
}

impl Upstreams {
    /// Clients whose connects give up after `connect_timeout`; the cleartext HTTP/1.1 pool
    /// keeps idle connections apart for each of `workers` connection workers (0: no workers,
    /// see [`super::workers`]).
    pub fn new(connect_timeout: Duration, workers: usize) -> Self {
        let mut conn = HttpConnector::new();
        conn.set_connect_timeout(Some(connect_timeout));
        conn.set_nodelay(true);
        let h1 = Client::builder(TokioExecutor::new()).build(conn.clone());
        let mut h2 = Client::builder(TokioExecutor::new());
        h2.http2_only(true);
        Self {
            h1,
            h2: Arc::new(PerEndpoint::new(conn, h2, http::uri::Scheme::HTTP)),
            driven: H1Pool::new(connect_timeout, workers),
        }
    }

    /// Sends `req` (origin-form URI and `Host`, see [`origin_request`]) over cleartext
    /// HTTP/1.1 to `authority` on a connection the response body drives (`upstream_h1.rs`).
    /// A connect failure gives `req` back unsent (`H1Pool::send`).
    /// Not an `async fn`: a wrapper future would hold a second copy of `req`.
    pub fn send_h1<'a>(
        &'a self,
        req: Request<Full<Bytes>>,
        authority: &'a str,
    ) -> impl Future<Output = (Attempt<DrivenBody>, Option<Request<Full<Bytes>>>)> + 'a {
        self.driven.send(req, authority)
    }

    /// Sends `req` (absolute URI naming the endpoint, see [`upstream_request`]) the way `via`
    /// says: HTTP/1.1, HTTP/2 prior knowledge, or the rule's own TLS clients; the latter two
    /// with the host as the URI's authority ([`super::per_endpoint::host_as_authority`]).
    ///
    /// Over HTTP/2 (cleartext or TLS), a request the backend's GOAWAY left unprocessed (its
    /// stream above the GOAWAY's last stream id, or opened after it: RFC 9113 §6.8, "can be
    /// safely retried"; or canceled unwritten as that connection closed,
    /// [`unprocessed_by_goaway`]) is sent again on a new connection to the same endpoint, up to
    /// [`GOAWAY_RESENDS`] times: a backend draining its connection (a graceful restart, a
    /// per-connection request limit) is no failure of the request or of the backend. When the
    /// last resend meets a GOAWAY too, the endpoint takes no requests: the attempt is
    /// [`Attempt::ConnectFailed`] (another endpoint is tried; the breaker counts it).
    pub async fn send(&self, req: Request<Full<Bytes>>, via: &Via) -> Attempt {
        let sent = match via {
            Via::H1 => self.h1.request(req).await,
            Via::H2 => resend_after_goaway(req, |r| self.h2.request(r)).await,
            Via::Tls(c) => resend_after_goaway(req, |r| c.request(r)).await,
            Via::Unavailable(why) => return Attempt::ConnectFailed(why.to_string()),
        };
        match sent {
            Ok(r) => Attempt::answered(r),
            // Every resend met a GOAWAY too: the endpoint takes no request (RFC 9113 §8.7:
            // none was processed), so another endpoint may run it, as after a refused connect.
            Err(e) if unprocessed_by_goaway(&e) => Attempt::ConnectFailed(format!(
                "the backend's HTTP/2 connections went away before processing the request \
                 ({} attempts, each answered by a GOAWAY or closed unwritten): {}",
                GOAWAY_RESENDS + 1,
                error_chain(&e)
            )),
            Err(e) if e.is_connect() => match LocalShortage::of(&e) {
                Some(s) => Attempt::NoLocalResources(s),
                None => Attempt::ConnectFailed(error_chain(&e)),
            },
            Err(e) => match h2_error(&e) {
                // RFC 9113 §8.7: a refused stream was not processed; another endpoint may run it.
                Some(h) if h.is_remote() && h.reason() == Some(h2::Reason::REFUSED_STREAM) => {
                    Attempt::ConnectFailed(format!(
                        "the backend refused the HTTP/2 stream before processing it \
                         (REFUSED_STREAM): {}",
                        error_chain(&e)
                    ))
                }
                // An HTTP/2 peer's own GOAWAY or reset: no hint about HTTP/1.1.
                Some(h) if h.is_remote() => Attempt::Failed(Box::new(e)),
                _ if matches!(via, Via::H2) => Attempt::Failed(Box::new(H2cFailed(e))),
                _ => Attempt::Failed(Box::new(e)),
            },
        }
    }
}

/// Times an HTTP/2 request left unprocessed by a backend's GOAWAY is sent again.
pub const GOAWAY_RESENDS: usize = 3;

/// Sends `req` with `send`, again (a copy: method, URI, version, headers, body) while the
/// failure is the backend's GOAWAY for it ([`unprocessed_by_goaway`]), at most
/// [`GOAWAY_RESENDS`] more times.
async fn resend_after_goaway<F, Fut>(
    mut req: Request<Full<Bytes>>,
    send: F,
) -> Result<http::Response<Incoming>, hyper_util::client::legacy::Error>
where
    F: Fn(Request<Full<Bytes>>) -> Fut,
    Fut: Future<Output = Result<http::Response<Incoming>, hyper_util::client::legacy::Error>>,
{
    let mut resends = 0;
    loop {
        let spare = (resends < GOAWAY_RESENDS).then(|| {
            let mut c = Request::new(req.body().clone());
            *c.method_mut() = req.method().clone();
            *c.uri_mut() = req.uri().clone();
            *c.version_mut() = req.version();
            *c.headers_mut() = req.headers().clone();
            c
        });
        match (send(req).await, spare) {
            (Err(e), Some(next)) if unprocessed_by_goaway(&e) => {
                resends += 1;
                tracing::debug!(
                    resends,
                    error = %error_chain(&e),
                    "a backend GOAWAY left the request unprocessed: sending it again"
                );
                req = next;
            }
            (r, _) => return r,
        }
    }
}

/// True when `e` says the backend never got the request because its connection was going
/// away: the backend's GOAWAY failing this request's stream (h2 fails with the peer's GOAWAY
/// only the streams above its last stream id, `recv_go_away`, and the streams opened after
/// it, none of which the backend processed: RFC 9113 §6.8), or hyper canceling the request
/// before writing it because that connection closed (`client error (Canceled)`; hyper-util
/// resends those itself only on a reused connection). Streams at or below the last id that
/// break later fail otherwise (a broken pipe, a reset) and are not resent.
fn unprocessed_by_goaway(e: &hyper_util::client::legacy::Error) -> bool {
    h2_error(e).is_some_and(|h| h.is_go_away() && h.is_remote())
        || super::attempt::sources(e)
            .find_map(|s| s.downcast_ref::<hyper::Error>())
            .is_some_and(hyper::Error::is_canceled)
}

/// The HTTP/2 error under `e`, if the failure was one.
fn h2_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a h2::Error> {
    super::attempt::sources(e).find_map(|s| s.downcast_ref::<h2::Error>())
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) that a proxy must not forward.
static HOP_BY_HOP: [header::HeaderName; 9] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    header::HeaderName::from_static("keep-alive"),
    header::HeaderName::from_static("proxy-connection"),
];

/// True for the names of [`HOP_BY_HOP`] (lowercase, as `HeaderName::as_str` gives them).
fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "proxy-authorization"
            | "proxy-authenticate"
            | "keep-alive"
            | "proxy-connection"
    )
}

/// Removes hop-by-hop headers, including those named by `Connection`.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    // Most messages carry none: one pass matching each name's text (a length switch, then
    // one comparison) instead of a hashed removal per hop-by-hop name. Headers named by
    // `Connection` need a `Connection` header, itself hop-by-hop, so none present means
    // nothing to remove.
    if !h.keys().any(|k| is_hop_by_hop(k.as_str())) {
        return;
    }
    let named: Vec<String> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .collect();
    for n in named.iter().filter(|n| !n.is_empty()) {
        h.remove(n.as_str());
    }
    for n in &HOP_BY_HOP {
        h.remove(n);
    }
}

/// The request for `authority`: the client's method, path and query, headers (hop-by-hop ones
/// removed; an HTTP/2 client's `:authority` as `Host`) and `body`; 500 `internal_error` when
/// the URI cannot be built.
pub fn upstream_request(
    parts: &http::request::Parts,
    authority: &str,
    body: Bytes,
) -> Result<Request<Full<Bytes>>, super::error::ProxyError> {
    let uri = upstream_uri(authority, &parts.uri)
        .map_err(|e| super::error::ProxyError::Internal(e.to_string()))?;
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    *req.headers_mut() = parts.headers.clone();
    strip_hop_by_hop(req.headers_mut());
    authority_as_host(req.headers_mut(), &parts.uri);
    Ok(req)
}

/// The request for `authority` over HTTP/1.1 on a connection of its own
/// ([`Upstreams::send_h1`]): as [`upstream_request`], but with the origin-form target (path and
/// query) hyper's HTTP/1.1 connection writes as is, the client's `Host` (an HTTP/2 client's
/// `:authority`), and `Host: {authority}` only for a request naming no host at all (HTTP/1.0).
///
/// The client's header map moves into the request (`parts.headers` is left empty): a copy cost
/// ~1,000 instructions a request, and the copy, sized to its entries, reallocated when
/// `X-Forwarded-*` were added (callgrind, `scripts/bench-proxy-instructions.sh`). A retry on
/// another endpoint reuses the request the failed connect gave back ([`readdress`]). Returns
/// the request and whether `Host` was added.
pub fn origin_request(
    parts: &mut http::request::Parts,
    authority: &str,
    body: Bytes,
) -> Result<(Request<Full<Bytes>>, bool), super::error::ProxyError> {
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = parts.method.clone();
    if let Some(pq) = parts.uri.path_and_query() {
        *req.uri_mut() = Uri::from(pq.clone());
    }
    *req.headers_mut() = std::mem::take(&mut parts.headers);
    strip_hop_by_hop(req.headers_mut());
    let add_host = !authority_as_host(req.headers_mut(), &parts.uri);
    if add_host {
        readdress(&mut req, authority)?;
    }
    Ok((req, add_host))
}

/// Gives `headers` the `Host` of `uri`'s authority when it has one: an HTTP/2 request names its
/// host in `:authority`, and an intermediary forwards that value (RFC 9113 §8.3.1: as
/// `:authority` over HTTP/2, as `Host` over HTTP/1.1), in its spelling even when the client's
/// `Host` spells it in another case (the handler refuses any other difference,
/// `authority_mismatch`). An HTTP/1.1 request's URI has an authority only in absolute form,
/// whose `Host` the handler already made it; in origin form its `Host` is passed on. False when
/// there is no `Host` at all (an HTTP/1.0 request without one: the endpoint's address is used).
fn authority_as_host(headers: &mut HeaderMap, uri: &Uri) -> bool {
    match uri
        .authority()
        .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok())
    {
        Some(a) => {
            headers.insert(header::HOST, a);
            true
        }
        None => headers.contains_key(header::HOST),
    }
}

/// Sets `Host: {authority}` on an [`origin_request`] whose `Host` it added (a request with
/// neither a `Host` nor an authority: HTTP/1.0), for the endpoint
/// `authority` (a retry after a connect failure goes to another endpoint).
///
/// # Errors
/// `Internal` when `authority` is no valid header value (endpoint authorities are `ip:port`).
pub fn readdress(
    req: &mut Request<Full<Bytes>>,
    authority: &str,
) -> Result<(), super::error::ProxyError> {
    let host = http::HeaderValue::from_str(authority)
        .map_err(|e| super::error::ProxyError::Internal(e.to_string()))?;
    req.headers_mut().insert(header::HOST, host);
    Ok(())
}

/// `http://{authority}{path_and_query}`.
pub fn upstream_uri(authority: &str, original: &Uri) -> Result<Uri, http::Error> {
    let pq = original.path_and_query().map_or("/", |p| p.as_str());
    Uri::builder()
        .scheme("http")
        .authority(authority)
        .path_and_query(pq)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_check_knows_every_hop_by_hop_name() {
        for n in &HOP_BY_HOP {
            assert!(is_hop_by_hop(n.as_str()), "{n}");
        }
        for n in [header::HOST, header::CONTENT_TYPE, header::USER_AGENT] {
            assert!(!is_hop_by_hop(n.as_str()), "{n}");
        }
        // Each hop-by-hop header alone is removed (the check lets none through).
        for n in &HOP_BY_HOP {
            let mut h = HeaderMap::new();
            h.insert(n.clone(), "1".parse().expect("hv"));
            h.insert("x-keep", "1".parse().expect("hv"));
            strip_hop_by_hop(&mut h);
            assert_eq!(h.len(), 1, "{n}");
        }
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "keep-alive, x-drop".parse().expect("hv"),
        );
        h.insert("x-drop", "1".parse().expect("hv"));
        h.insert("keep-alive", "timeout=5".parse().expect("hv"));
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().expect("hv"));
        h.insert("x-keep", "1".parse().expect("hv"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-keep"));
    }

    #[test]
    fn origin_request_has_the_origin_form_target_and_a_host() {
        let (mut parts, ()) = Request::builder()
            .method("POST")
            .uri("/v1/completions?x=1")
            .header(header::CONNECTION, "close")
            .header("x-keep", "1")
            .body(())
            .expect("request")
            .into_parts();
        let (mut req, added) =
            origin_request(&mut parts, "127.0.0.1:9000", Bytes::from_static(b"{}")).expect("req");
        assert_eq!(req.uri().to_string(), "/v1/completions?x=1");
        assert_eq!(req.method(), http::Method::POST);
        assert_eq!(
            req.headers()[header::HOST],
            "127.0.0.1:9000",
            "no Host: the upstream's"
        );
        assert!(added);
        assert!(!req.headers().contains_key(header::CONNECTION));
        assert_eq!(req.headers()["x-keep"], "1");
        assert!(parts.headers.is_empty(), "the client's headers moved");
        // A retry to another endpoint: the added Host follows it.
        readdress(&mut req, "127.0.0.1:9001").expect("readdress");
        assert_eq!(req.headers()[header::HOST], "127.0.0.1:9001");
        assert_eq!(req.headers().get_all(header::HOST).iter().count(), 1);
        parts
            .headers
            .insert(header::HOST, "vip".parse().expect("hv"));
        let (req, added) = origin_request(&mut parts, "127.0.0.1:9000", Bytes::new()).expect("req");
        assert_eq!(
            req.headers()[header::HOST],
            "vip",
            "the client's Host is kept"
        );
        assert!(!added);
        // HTTP/2: no Host header, the authority in the URI becomes it.
        let (mut parts, ()) = Request::builder()
            .method("POST")
            .version(http::Version::HTTP_2)
            .uri("http://api.example.com:8443/v1/completions")
            .body(())
            .expect("request")
            .into_parts();
        let (req, added) = origin_request(&mut parts, "127.0.0.1:9000", Bytes::new()).expect("req");
        assert_eq!(req.headers()[header::HOST], "api.example.com:8443");
        assert_eq!(req.uri().to_string(), "/v1/completions");
        assert!(!added, "the same Host for every endpoint");
    }

    #[test]
    fn builds_absolute_uri() {
        let u = upstream_uri(
            "127.0.0.1:9000",
            &"/v1/completions?x=1".parse().expect("uri"),
        )
        .expect("uri");
        assert_eq!(u.to_string(), "http://127.0.0.1:9000/v1/completions?x=1");
    }
}
