//! The management plane's request guard, applied to every route of the REST API.
//!
//! In order:
//! 1. **Origin.** A request carrying an `Origin` header (every browser `POST`/`DELETE` does) is
//!    refused with 403 unless that origin is the API's own: `http(s)://<Host>` where the `Host`
//!    names the API by IP literal or `localhost` (a DNS name could be rebound to us by a
//!    foreign page), or an origin listed with `--api-allowed-origin`. Clients that are not
//!    browsers send no `Origin` and are not affected.
//! 1. **Host**, when no token is configured. A request whose `Host` is a DNS name is refused
//!    with 403 unless that name is listed with `--api-allowed-host`: a page that rebinds its
//!    own name to us sends same-origin `GET`s without an `Origin` header, and only its `Host`
//!    gives it away. IP literals and `localhost` always pass, and so does a request without a
//!    `Host` (HTTP/1.0). A request target's authority (an HTTP/2 request's `:authority`, an
//!    HTTP/1 absolute-form target) is its `Host` for both checks, whatever `Host` says; two
//!    `Host` headers are refused (400). With a token the browser cannot authenticate, so the
//!    token is the defence and DNS names pass.
//! 2. **Bearer token**, when one is configured (`--api-token-file` / `LOXI_API_TOKEN` for
//!    admin, `--api-read-token-file` / `LOXI_API_READ_TOKEN` for read-only): every request
//!    needs `Authorization: Bearer <token>`, or the bare token as kube-loxilb sends it and
//!    LoxiLB accepts (401 with `WWW-Authenticate: Bearer` otherwise);
//!    a read-only token may only `GET`/`HEAD` (403 otherwise). `GET /netlox/v1/version`, LoxiLB's
//!    readiness probe, needs no token (as in LoxiLB). Tokens are compared as SHA-256
//!    digests in constant time (`subtle`), so neither the content nor the length leaks.
//! 3. **Content type** ([`require_json`], on the routes only: a method no route serves is 405
//!    first). A mutating request (`POST`, `PUT`, `PATCH`, and a `DELETE` that says what it
//!    carries) must be `application/json` (415 otherwise): a browser can send `text/plain`
//!    cross-origin without a CORS preflight, never `application/json`.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error::ApiError;

/// What a presented token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Every route.
    Admin,
    /// `GET` and `HEAD` only.
    ReadOnly,
}

/// The API's access policy (see the module doc). `Default`: no token, no extra origins, http.
#[derive(Clone, Default)]
pub struct ApiSecurity {
    admin: Vec<[u8; 32]>,
    read: Vec<[u8; 32]>,
    allowed_origins: Vec<String>,
    allowed_hosts: Vec<String>,
    tls: bool,
}

impl std::fmt::Debug for ApiSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiSecurity")
            .field("admin_tokens", &self.admin.len())
            .field("read_tokens", &self.read.len())
            .field("allowed_origins", &self.allowed_origins)
            .field("allowed_hosts", &self.allowed_hosts)
            .field("tls", &self.tls)
            .finish()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl ApiSecurity {
    /// A policy with these admin and read-only tokens (empty = no token required), extra allowed
    /// browser origins (`scheme://host[:port]`), served over TLS or not.
    pub fn new(admin: &[String], read: &[String], allowed_origins: &[String], tls: bool) -> Self {
        Self {
            admin: admin.iter().map(|t| digest(t)).collect(),
            read: read.iter().map(|t| digest(t)).collect(),
            allowed_origins: allowed_origins
                .iter()
                .map(|o| o.trim_end_matches('/').to_ascii_lowercase())
                .collect(),
            allowed_hosts: Vec::new(),
            tls,
        }
    }

    /// The same policy, also answering tokenless requests addressed to these DNS names
    /// (`--api-allowed-host`; names without a port, compared case-insensitively).
    pub fn with_allowed_hosts(mut self, hosts: &[String]) -> Self {
        self.allowed_hosts = hosts.iter().map(|h| h.to_ascii_lowercase()).collect();
        self
    }

    /// `Ok` when the request's `Host` may reach a tokenless API (see the module doc).
    ///
    /// # Errors
    /// The refusal message when `Host` is a DNS name that is not listed.
    pub fn check_host(&self, headers: &HeaderMap) -> Result<(), String> {
        if self.requires_token() {
            return Ok(());
        }
        let Some(host) = headers.get(header::HOST) else {
            return Ok(());
        };
        let host = host
            .to_str()
            .map_err(|_| "the Host header is not text".to_string())?
            .to_ascii_lowercase();
        if names_us_directly(&host) {
            return Ok(());
        }
        let name = host.rsplit_once(':').map_or(host.as_str(), |(n, _)| n);
        if self.allowed_hosts.iter().any(|h| h == name) {
            return Ok(());
        }
        Err(format!(
            "request refused: Host {host:?} is a DNS name, and without an API token this API \
             answers only requests addressed to an IP address, localhost or a name listed with \
             --api-allowed-host (a web page could rebind such a name to this address)"
        ))
    }

    /// True when requests need a token.
    pub fn requires_token(&self) -> bool {
        !self.admin.is_empty() || !self.read.is_empty()
    }

    /// The access a request's `Authorization` header grants; `None` when it grants none.
    pub fn access(&self, headers: &HeaderMap) -> Option<Access> {
        if !self.requires_token() {
            return Some(Access::Admin);
        }
        let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
        // `Bearer <token>`, or the bare token: kube-loxilb sends it without a scheme
        // (`pkg/api/request.go`), and LoxiLB strips an optional `Bearer ` before comparing.
        let presented = match value.split_once(' ') {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => rest.trim(),
            _ => value,
        };
        let d = digest(presented);
        // Walk every digest so the time does not depend on which one matches.
        let hit = |list: &[[u8; 32]]| {
            list.iter()
                .fold(subtle::Choice::from(0), |acc, t| acc | t.ct_eq(&d))
        };
        let (admin, read) = (hit(&self.admin), hit(&self.read));
        if bool::from(admin) {
            Some(Access::Admin)
        } else if bool::from(read) {
            Some(Access::ReadOnly)
        } else {
            None
        }
    }

    /// `Ok` when the request's `Origin` (if any) is the API's own (see the module doc).
    pub fn check_origin(&self, headers: &HeaderMap) -> Result<(), String> {
        let Some(origin) = headers.get(header::ORIGIN) else {
            return Ok(());
        };
        let origin = origin
            .to_str()
            .map_err(|_| "the Origin header is not text".to_string())?
            .trim_end_matches('/')
            .to_ascii_lowercase();
        if self.allowed_origins.contains(&origin) {
            return Ok(());
        }
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_ascii_lowercase)
            .unwrap_or_default();
        let scheme = if self.tls { "https" } else { "http" };
        if !host.is_empty() && origin == format!("{scheme}://{host}") && names_us_directly(&host) {
            return Ok(());
        }
        Err(format!(
            "cross-origin request refused: Origin {origin:?} is not this API's origin \
             (list it with --api-allowed-origin to allow it)"
        ))
    }
}

/// True when `host` (`name[:port]`) is an IP literal or `localhost`: names that a foreign web
/// page cannot point at us through DNS rebinding.
fn names_us_directly(host: &str) -> bool {
    if let Some(rest) = host.strip_prefix('[') {
        return rest
            .split_once(']')
            .is_some_and(|(ip, _)| ip.parse::<std::net::Ipv6Addr>().is_ok());
    }
    let name = host.rsplit_once(':').map_or(host, |(n, _)| n);
    name == "localhost" || name.parse::<std::net::IpAddr>().is_ok()
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

/// Whether `method` with these headers must carry `application/json`.
fn needs_json(method: &Method, headers: &HeaderMap) -> bool {
    match *method {
        Method::POST | Method::PUT | Method::PATCH => true,
        Method::DELETE => headers.contains_key(header::CONTENT_TYPE),
        _ => false,
    }
}

fn read_only(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD)
}

/// Makes the request's `Host` the host it addressed, for the `Host` and `Origin` checks:
/// when the request target carries an authority (an HTTP/2 request's `:authority`, RFC 9113
/// §8.3.1, or an HTTP/1 absolute-form target such as `GET http://name/path`, RFC 9112 §3.2.2,
/// where the target's host is the one to use and a `Host` header is ignored), that authority
/// replaces any `Host`. Without it the checks read a `Host` header the request does not go by:
/// HTTP/2 requests without one passed every check, and one whose `Host` named us while its
/// authority named another host passed too.
///
/// # Errors
/// A request with more than one `Host` header (RFC 9112 §3.2: answered 400).
fn authority_as_host(req: &mut Request) -> Result<(), &'static str> {
    if req.headers().get_all(header::HOST).iter().nth(1).is_some() {
        return Err("a request may carry one Host header; this one has several");
    }
    let Some(value) = req
        .uri()
        .authority()
        .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    else {
        return Ok(());
    };
    req.headers_mut().insert(header::HOST, value);
    Ok(())
}

/// The one route answered without a token (LoxiLB's readiness probe).
pub const VERSION_PATH: &str = "/netlox/v1/version";

/// Checks 1 and 2 of the module doc, as a layer over every route and the fallbacks:
/// `axum::middleware::from_fn_with_state(policy, guard)`.
pub async fn guard(
    State(policy): State<Arc<ApiSecurity>>,
    mut req: Request,
    next: Next,
) -> Response {
    if let Err(msg) = authority_as_host(&mut req) {
        return ApiError::with_status(StatusCode::BAD_REQUEST, msg).into_response();
    }
    let (method, headers) = (req.method(), req.headers());
    if let Err(msg) = policy
        .check_origin(headers)
        .and_then(|()| policy.check_host(headers))
    {
        return ApiError::with_status(StatusCode::FORBIDDEN, msg).into_response();
    }
    // LoxiLB's `/version` is its readiness probe and needs no token (`security: []`).
    let open = *method == Method::GET && req.uri().path() == VERSION_PATH;
    match policy.access(headers) {
        None if open => {}
        None => {
            let mut resp = ApiError::with_status(
                StatusCode::UNAUTHORIZED,
                "a bearer token is required (Authorization: Bearer <token>)",
            )
            .into_response();
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"loxilb\""),
            );
            return resp;
        }
        Some(Access::ReadOnly) if !read_only(method) => {
            return ApiError::with_status(
                StatusCode::FORBIDDEN,
                format!("this token is read-only; {method} needs an admin token"),
            )
            .into_response();
        }
        Some(_) => {}
    }
    next.run(req).await
}

/// Check 3 of the module doc, as a route layer
/// (`Router::route_layer(axum::middleware::from_fn(require_json))`): it runs only for a
/// method a route serves, so a method no route serves is 405 whatever its body says, and an
/// unknown path 404.
pub async fn require_json(req: Request, next: Next) -> Response {
    let (method, headers) = (req.method(), req.headers());
    if needs_json(method, headers) && !is_json(headers) {
        let got = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none");
        return ApiError::with_status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("{method} needs Content-Type: application/json (got {got})"),
        )
        .into_response();
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn tokens_grant_admin_or_read_and_nothing_else() {
        let p = ApiSecurity::new(
            &["admin-secret".into()],
            &["read-secret".into()],
            &[],
            false,
        );
        let with = |t: &str| headers(&[("authorization", format!("Bearer {t}").as_str())]);
        assert_eq!(p.access(&with("admin-secret")), Some(Access::Admin));
        assert_eq!(p.access(&with("read-secret")), Some(Access::ReadOnly));
        assert_eq!(p.access(&with("admin-secre")), None);
        assert_eq!(p.access(&with("admin-secret-")), None);
        assert_eq!(
            p.access(&headers(&[("authorization", "Basic admin-secret")])),
            None
        );
        assert_eq!(p.access(&HeaderMap::new()), None);
        // kube-loxilb's form: the bare token, no scheme (fixture i1's `http.authorization`).
        let bare = |t: &str| headers(&[("authorization", t)]);
        assert_eq!(p.access(&bare("admin-secret")), Some(Access::Admin));
        assert_eq!(p.access(&bare("read-secret")), Some(Access::ReadOnly));
        assert_eq!(p.access(&bare("admin-secre")), None);
        assert_eq!(p.access(&bare("Bearer")), None);
        let open = ApiSecurity::default();
        assert_eq!(open.access(&HeaderMap::new()), Some(Access::Admin));
    }

    #[test]
    fn only_the_apis_own_origin_passes() {
        let p = ApiSecurity::new(&[], &[], &["https://lb.example.com".into()], false);
        let ok = |o: &str, host: &str| p.check_origin(&headers(&[("origin", o), ("host", host)]));
        ok("http://127.0.0.1:11111", "127.0.0.1:11111").expect("own origin");
        ok("http://localhost:11111", "localhost:11111").expect("localhost");
        ok("http://[::1]:11111", "[::1]:11111").expect("v6 literal");
        ok("https://lb.example.com", "lb.example.com").expect("listed");
        assert!(ok("http://evil.example", "127.0.0.1:11111").is_err());
        assert!(
            ok("http://evil.example:11111", "evil.example:11111").is_err(),
            "rebinding"
        );
        assert!(
            ok("https://127.0.0.1:11111", "127.0.0.1:11111").is_err(),
            "wrong scheme"
        );
        assert!(ok("null", "127.0.0.1:11111").is_err());
        p.check_origin(&headers(&[("host", "evil.example")]))
            .expect("no Origin: not a browser");
    }

    #[test]
    fn tokenless_api_answers_dns_names_only_when_listed() {
        let p =
            ApiSecurity::new(&[], &[], &[], false).with_allowed_hosts(&["LB.example.com".into()]);
        let host = |h: &str| p.check_host(&headers(&[("host", h)]));
        host("127.0.0.1:11111").expect("v4 literal");
        host("[::1]:11111").expect("v6 literal");
        host("localhost:11111").expect("localhost");
        host("lb.example.com:11111").expect("listed, any port, any case");
        let err = host("rebound.evil.example:11111").expect_err("rebinding name");
        assert!(err.contains("--api-allowed-host"), "{err}");
        p.check_host(&HeaderMap::new()).expect("no Host (HTTP/1.0)");
        let with_token = ApiSecurity::new(&["t".into()], &[], &[], false);
        with_token
            .check_host(&headers(&[("host", "rebound.evil.example")]))
            .expect("a token is the defence");
    }

    #[test]
    fn mutating_methods_need_json() {
        let json = headers(&[("content-type", "Application/JSON; charset=utf-8")]);
        let text = headers(&[("content-type", "text/plain")]);
        assert!(needs_json(&Method::POST, &text) && !is_json(&text));
        assert!(is_json(&json));
        assert!(needs_json(&Method::POST, &HeaderMap::new()));
        assert!(!needs_json(&Method::DELETE, &HeaderMap::new()));
        assert!(needs_json(&Method::DELETE, &text));
        assert!(!needs_json(&Method::GET, &text));
    }
}
