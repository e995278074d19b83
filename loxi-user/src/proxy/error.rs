//! Every error response of the fullproxy is built here: a JSON body
//! `{"error":{"type": TOKEN, "message": TEXT, "code": STATUS, "party": WHO, "retryable": BOOL}}`
//! where `type` is LoxiLB's reason token (`no_healthy_backend`, `backend_unreachable`,
//! `model_not_found`, ...), `party` says who failed (`client`, `upstream`, `internal`) and
//! `retryable` whether sending the same request again may succeed.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};

/// The body type of every proxy response (re-exported by `body`).
pub type ProxyBody = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

/// Who caused a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Party {
    /// The client sent something we cannot serve.
    Client,
    /// A backend failed or none was available.
    Upstream,
    /// loxi itself.
    Internal,
}

impl Party {
    /// The `party` field value.
    pub fn as_str(self) -> &'static str {
        match self {
            Party::Client => "client",
            Party::Upstream => "upstream",
            Party::Internal => "internal",
        }
    }
}

/// Errors of the request path.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The request body is larger than `max_body_bytes` (413).
    #[error("request body exceeds the {limit}-byte limit")]
    BodyTooLarge {
        /// The configured limit in bytes.
        limit: usize,
    },
    /// An HTTP/1 request head is larger than `limit` bytes (431; answered by the socket wrapper,
    /// `conn.rs`, since hyper never parsed it: [`head_too_large_answer`]).
    #[error("request head exceeds the {limit}-byte limit (request line and headers)")]
    HeadTooLarge {
        /// The bound in bytes (`conn::MAX_HEAD_BYTES`).
        limit: u64,
    },
    /// The request body did not arrive within `LOXI_BODY_TIMEOUT_MS` of its head (408).
    #[error("the request body did not arrive within {ms} ms")]
    BodyTimeout {
        /// The configured timeout in milliseconds.
        ms: u64,
    },
    /// A method the fullproxy does not forward (405): `CONNECT` (no tunnels through loxi) and
    /// `TRACE` (it would echo the request, credentials included, back to whoever sent it).
    #[error("method {0} is not allowed")]
    MethodNotAllowed(http::Method),
    /// A request `Transfer-Encoding` other than `chunked` (501): hyper decodes the chunked
    /// framing only, so a `gzip, chunked` body would reach the backend still compressed and
    /// with no header saying so. RFC 9112 §6.1: a server answers a transfer coding it does not
    /// understand with 501.
    #[error(
        "transfer coding {0:?} is not implemented (only chunked is); send the body with \
         Content-Encoding instead"
    )]
    UnsupportedTransferCoding(String),
    /// An HTTP/1.1 request without a `Host` header (400): RFC 9112 §3.2 makes a server answer
    /// it with 400, as nginx does; forwarding it would leave host routing and the upstream's
    /// `Host` to guesswork.
    #[error("an HTTP/1.1 request must carry a Host header")]
    MissingHost,
    /// A `Host` (or absolute-form authority) that is not `host[:port]` as RFC 3986 spells it
    /// (400, RFC 9112 §3.2): spaces, `/`, or userinfo (`user:pass@`) would be forwarded to
    /// the backend as they came.
    #[error("Host {0:?} is not host[:port] (RFC 3986: no spaces, path or user:password@)")]
    InvalidHost(String),
    /// A request with more than one `Host` header line (400): RFC 9112 §3.2 makes a server
    /// answer it with 400; routing by one and forwarding both would let a backend read another
    /// host than the one the request was routed by.
    #[error("a request must carry at most one Host header")]
    DuplicateHost,
    /// An HTTP/2 request whose `Host` header names another authority than its `:authority`
    /// (400): RFC 9113 §8.3.1 makes it malformed; routing by one while the backend reads the
    /// other would let a client reach a host it was not routed for.
    #[error("the Host header {host:?} differs from the request's :authority {authority:?}")]
    AuthorityMismatch {
        /// The `:authority` pseudo-header.
        authority: String,
        /// The `Host` header.
        host: String,
    },
    /// An `Expect` other than `100-continue` (417, RFC 9110 §10.1.1): loxi cannot meet an
    /// expectation it does not know, and forwarding it would leave the backend to guess.
    #[error("Expect {0:?} is not supported (only 100-continue)")]
    ExpectationFailed(String),
    /// The client's body could not be read (400).
    #[error("reading the request body failed: {0}")]
    ClientBody(#[source] hyper::Error),
    /// The request's host is another rule's than the one the TLS connection's SNI named, and
    /// that connection's certificate does not cover it (421 `misdirected_request`): the client
    /// retries on a connection of its own for that host.
    #[error(
        "this TLS connection was made for {sni:?} and its certificate does not cover {host:?}; open a connection for {host:?}"
    )]
    Misdirected {
        /// The connection's SNI name.
        sni: String,
        /// The request's host.
        host: String,
    },
    /// The request already passed through this gateway (its hop id in `X-Loxi-Hop`): a rule
    /// forwards to one of this gateway's own listeners (508 `loop_detected`).
    #[error(
        "this request already passed through this gateway: a rule forwards to one of the gateway's own listeners (a loop); fix the endpoints"
    )]
    Loop,
    /// No pool on this listener serves the request's host (404).
    #[error("no service on this address serves host {host:?}")]
    NoRoute {
        /// The request's host (without port).
        host: String,
    },
    /// No pool serves the model and there is no wildcard pool (404 `model_not_found`, as vLLM
    /// and OpenAI answer an unknown model: the client's mistake, not worth a retry).
    #[error("no pool serves model {model:?}")]
    ModelUnavailable {
        /// The requested model ("" when the request named none).
        model: String,
    },
    /// Every endpoint is unhealthy or excluded before any attempt (503).
    #[error("no healthy backend for service {service}")]
    NoHealthyBackend {
        /// The service id.
        service: u32,
    },
    /// Every eligible endpoint refused or timed out the connection, or (an idempotent
    /// request) dropped the request without answering (502).
    #[error(
        "no backend took the request after {attempts} attempt(s) (each refused the connection, \
         or dropped an idempotent request unanswered); last: {last}"
    )]
    BackendUnreachable {
        /// Connection attempts made.
        attempts: usize,
        /// Why the last attempt failed (a refused connection, a TLS verification failure).
        last: String,
    },
    /// The backend failed after the request was sent (502); not retried (it may have run).
    /// The text is the whole error chain (hyper-util's own says only `client error
    /// (SendRequest)`; the reason is below it).
    #[error("backend {ep_idx} failed: {}", super::attempt::error_chain(&**source))]
    Upstream {
        /// The endpoint that failed.
        ep_idx: usize,
        /// hyper's (or hyper-util's) error.
        #[source]
        source: super::attempt::UpstreamError,
    },
    /// The backend sent no response head within `LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS` of the
    /// request's dispatch (504 `upstream_timeout`); the upstream request was aborted. Not
    /// retried on another endpoint (the backend may have run it), but the client may retry.
    #[error(
        "backend {ep_idx} sent no response within {ms} ms (LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS); the request was aborted"
    )]
    UpstreamTimeout {
        /// The endpoint that did not answer.
        ep_idx: usize,
        /// The timeout in milliseconds.
        ms: u64,
    },
    /// A request could not be built (500).
    #[error("internal error: {0}")]
    Internal(String),
    /// A P/D rule has no eligible prefill or decode endpoint and no role-0 endpoint to fall
    /// back to (503).
    #[error("P/D pool unavailable: {reason}")]
    PdPoolUnavailable {
        /// `no_prefill` or `no_decode`.
        reason: &'static str,
    },
    /// A request on a P/D rule carries a body field the gateway itself sets for the handoff of
    /// the rule's `kvEngineType` (`pd::dialect::gateway_fields`): vLLM `kv_transfer_params`,
    /// SGLang `bootstrap_host` / `bootstrap_port` / `bootstrap_room`, TensorRT-LLM
    /// `disaggregated_params` (400 `pd_handoff_field`); forwarded, it would tell an engine
    /// where to pull (or push) KV from.
    #[error(
        "the request carries {field:?}, which the gateway sets itself for the prefill/decode \
         handoff on this P/D rule; send the request without it"
    )]
    PdHandoffField {
        /// The field (the first one found, in the dialect's order).
        field: &'static str,
    },
    /// The P/D prefill leg took longer than `LLB_PD_PREFILL_TIMEOUT_SEC` (504).
    #[error(
        "the prefill leg on endpoint {ep_idx} did not finish within {secs} s (LLB_PD_PREFILL_TIMEOUT_SEC)"
    )]
    PdPrefillTimeout {
        /// The prefill endpoint.
        ep_idx: usize,
        /// The timeout in seconds.
        secs: u64,
    },
    /// The P/D prefill endpoint's response body failed before it was complete (502).
    #[error("the prefill leg on endpoint {ep_idx} failed: {message}")]
    PdPrefillFailed {
        /// The prefill endpoint.
        ep_idx: usize,
        /// What failed.
        message: String,
    },
    /// The P/D decode endpoint took the request and closed or failed before its first body
    /// byte (502).
    #[error("the decode leg on endpoint {ep_idx} sent no response: {message}")]
    PdDecodeDied {
        /// The decode endpoint.
        ep_idx: usize,
        /// What failed.
        message: String,
    },
    /// The P/D decode leg sent no byte within `LLB_PD_DECODE_TIMEOUT_SEC` (504).
    #[error(
        "the decode leg on endpoint {ep_idx} sent nothing within {secs} s (LLB_PD_DECODE_TIMEOUT_SEC)"
    )]
    PdDecodeTimeout {
        /// The decode endpoint.
        ep_idx: usize,
        /// The timeout in seconds.
        secs: u64,
    },
    /// `GET /v1/models`: no endpoint of the listener's pools answered a model list (502).
    #[error("no endpoint answered /v1/models ({tried} asked; last failure: {last})")]
    ModelsUnavailable {
        /// Endpoints asked (healthy ones of every pool for the request's host).
        tried: usize,
        /// The last failure, e.g. `127.0.0.1:8001: status 401`.
        last: String,
    },
    /// The request-body budget (`LOXI_MAX_BODY_BYTES_IN_FLIGHT`) could not cover the next bytes
    /// of a body that already holds part of it and is not the eldest holder, or is and waited
    /// [`super::budget::ELDEST_WAIT`] in vain (503 `body_budget_exhausted`, `Retry-After: 1`):
    /// only the eldest holder waits for more, so concurrent uploads cannot deadlock on it, and
    /// one of them proceeds unless budget is held by bodies already read.
    #[error(
        "the gateway holds its whole request-body budget ({budget} bytes, \
         LOXI_MAX_BODY_BYTES_IN_FLIGHT) in other requests' bodies; retry later"
    )]
    BodyBudgetExhausted {
        /// The budget in bytes.
        budget: u64,
    },
    /// The gateway ran out of its own file descriptors, local ports or kernel buffers
    /// opening a connection to a backend (503 `gateway_resources_exhausted`,
    /// `Retry-After: 1`): its own shortage, so not fed to the breaker and not retried on
    /// another endpoint.
    #[error(
        "the gateway cannot open a connection to a backend: it is out of its own resources, \
         {0}; retry later"
    )]
    LocalResources(super::attempt::LocalShortage),
    /// The global valve (`LLB_PD_MAX_TOTAL_INFLIGHT`) is full (429, `Retry-After: 1`).
    #[error("the gateway has {limit} requests in flight (LLB_PD_MAX_TOTAL_INFLIGHT); retry later")]
    Overloaded {
        /// The configured limit.
        limit: u64,
    },
    /// The chosen endpoint's admission gate is full: `LLB_PD_MAX_INFLIGHT_PER_EP` requests
    /// admitted and `LLB_PD_QUEUE_DEPTH_PER_EP` parked (429 `pd_overloaded`, `Retry-After: 1`).
    #[error(
        "endpoint {ep_idx} has {limit} requests in flight and its park queue ({depth}) is full (LLB_PD_MAX_INFLIGHT_PER_EP, LLB_PD_QUEUE_DEPTH_PER_EP); retry later"
    )]
    EndpointOverloaded {
        /// The chosen endpoint.
        ep_idx: usize,
        /// The per-endpoint cap.
        limit: u32,
        /// The park-queue depth.
        depth: u32,
    },
    /// The request was parked at its endpoint's admission gate for `LLB_PD_MAX_PARK_SEC`
    /// without getting a slot (504 `pd_admission_timeout`).
    #[error(
        "parked {secs} s for a slot on endpoint {ep_idx} without getting one (LLB_PD_MAX_PARK_SEC)"
    )]
    AdmissionTimeout {
        /// The endpoint the request waited for.
        ep_idx: usize,
        /// The park deadline in seconds.
        secs: u64,
    },
    /// The admission gate the request was parked at closed: its endpoint left the rule, the
    /// rule was deleted, or the daemon is stopping (503 `pd_admission_closed`,
    /// `Retry-After: 1`).
    #[error(
        "the admission gate of endpoint {ep_idx} closed while the request was parked: {reason}"
    )]
    AdmissionClosed {
        /// The endpoint the request waited for.
        ep_idx: usize,
        /// `endpoint_removed` (endpoint or rule gone) or `shutdown`.
        reason: &'static str,
    },
}

impl ProxyError {
    /// The endpoint whose failure this answer reports (it was sent the request and failed,
    /// timed out or died), as opposed to the gateway's own refusals (no route, no healthy
    /// backend, overload, admission): the `ep_idx` the answer is counted under in
    /// `loxilb_proxy_requests_total`.
    pub fn failed_endpoint(&self) -> Option<usize> {
        match self {
            Self::Upstream { ep_idx, .. }
            | Self::UpstreamTimeout { ep_idx, .. }
            | Self::PdPrefillTimeout { ep_idx, .. }
            | Self::PdPrefillFailed { ep_idx, .. }
            | Self::PdDecodeDied { ep_idx, .. }
            | Self::PdDecodeTimeout { ep_idx, .. } => Some(*ep_idx),
            _ => None,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::HeadTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::ClientBody(_)
            | Self::MissingHost
            | Self::DuplicateHost
            | Self::InvalidHost(_)
            | Self::AuthorityMismatch { .. }
            | Self::PdHandoffField { .. } => StatusCode::BAD_REQUEST,
            Self::ExpectationFailed(_) => StatusCode::EXPECTATION_FAILED,
            Self::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::UnsupportedTransferCoding(_) => StatusCode::NOT_IMPLEMENTED,
            Self::Misdirected { .. } => StatusCode::MISDIRECTED_REQUEST,
            Self::NoRoute { .. } | Self::ModelUnavailable { .. } => StatusCode::NOT_FOUND,
            Self::NoHealthyBackend { .. }
            | Self::PdPoolUnavailable { .. }
            | Self::AdmissionClosed { .. }
            | Self::LocalResources(_)
            | Self::BodyBudgetExhausted { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::BackendUnreachable { .. }
            | Self::Upstream { .. }
            | Self::PdPrefillFailed { .. }
            | Self::PdDecodeDied { .. }
            | Self::ModelsUnavailable { .. } => StatusCode::BAD_GATEWAY,
            Self::PdPrefillTimeout { .. }
            | Self::AdmissionTimeout { .. }
            | Self::UpstreamTimeout { .. }
            | Self::PdDecodeTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Loop => StatusCode::LOOP_DETECTED,
            Self::Overloaded { .. } | Self::EndpointOverloaded { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
        }
    }

    /// The reason token (`error.type`).
    pub fn token(&self) -> &'static str {
        match self {
            Self::BodyTooLarge { .. } => "request_too_large",
            Self::HeadTooLarge { .. } => "request_header_too_large",
            Self::ClientBody(_) => "bad_request_body",
            Self::MissingHost => "missing_host",
            Self::DuplicateHost => "duplicate_host",
            Self::InvalidHost(_) => "invalid_host",
            Self::AuthorityMismatch { .. } => "authority_mismatch",
            Self::ExpectationFailed(_) => "expectation_failed",
            Self::BodyTimeout { .. } => "request_timeout",
            Self::BodyBudgetExhausted { .. } => "body_budget_exhausted",
            Self::LocalResources(_) => "gateway_resources_exhausted",
            Self::MethodNotAllowed(_) => "method_not_allowed",
            Self::UnsupportedTransferCoding(_) => "unsupported_transfer_coding",
            Self::Misdirected { .. } => "misdirected_request",
            Self::NoRoute { .. } => "no_route",
            Self::ModelUnavailable { .. } => "model_not_found",
            Self::NoHealthyBackend { .. } => "no_healthy_backend",
            Self::BackendUnreachable { .. } => "backend_unreachable",
            Self::Upstream { .. } => "upstream_error",
            Self::UpstreamTimeout { .. } => "upstream_timeout",
            Self::Internal(_) => "internal_error",
            Self::Loop => "loop_detected",
            Self::Overloaded { .. } | Self::EndpointOverloaded { .. } => "pd_overloaded",
            Self::AdmissionTimeout { .. } => "pd_admission_timeout",
            Self::AdmissionClosed { .. } => "pd_admission_closed",
            Self::PdPoolUnavailable { .. } => "pd_pool_unavailable",
            Self::PdHandoffField { .. } => "pd_handoff_field",
            Self::PdPrefillTimeout { .. } => "pd_prefill_timeout",
            Self::PdPrefillFailed { .. } => "pd_prefill_failed",
            Self::PdDecodeDied { .. } => "pd_decode_backend_died",
            Self::PdDecodeTimeout { .. } => "pd_decode_timeout",
            Self::ModelsUnavailable { .. } => "models_unavailable",
        }
    }

    /// Who failed.
    pub fn party(&self) -> Party {
        match self {
            Self::BodyTooLarge { .. }
            | Self::HeadTooLarge { .. }
            | Self::ClientBody(_)
            | Self::MissingHost
            | Self::DuplicateHost
            | Self::InvalidHost(_)
            | Self::AuthorityMismatch { .. }
            | Self::ExpectationFailed(_)
            | Self::BodyTimeout { .. }
            | Self::MethodNotAllowed(_)
            | Self::UnsupportedTransferCoding(_)
            | Self::Misdirected { .. }
            | Self::NoRoute { .. }
            | Self::ModelUnavailable { .. }
            | Self::PdHandoffField { .. } => Party::Client,
            Self::NoHealthyBackend { .. }
            | Self::BackendUnreachable { .. }
            | Self::Upstream { .. }
            | Self::UpstreamTimeout { .. }
            | Self::PdPoolUnavailable { .. }
            | Self::PdPrefillTimeout { .. }
            | Self::PdPrefillFailed { .. }
            | Self::PdDecodeDied { .. }
            | Self::PdDecodeTimeout { .. }
            | Self::ModelsUnavailable { .. } => Party::Upstream,
            Self::Internal(_)
            | Self::Loop
            | Self::BodyBudgetExhausted { .. }
            | Self::LocalResources(_)
            | Self::Overloaded { .. }
            | Self::EndpointOverloaded { .. }
            | Self::AdmissionTimeout { .. }
            | Self::AdmissionClosed { .. } => Party::Internal,
        }
    }

    /// May the same request succeed if sent again (later)?
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            Self::NoHealthyBackend { .. }
                | Self::Misdirected { .. }
                | Self::BackendUnreachable { .. }
                | Self::Overloaded { .. }
                | Self::BodyBudgetExhausted { .. }
                | Self::LocalResources(_)
                | Self::EndpointOverloaded { .. }
                | Self::AdmissionTimeout { .. }
                | Self::AdmissionClosed { .. }
                | Self::PdPoolUnavailable { .. }
                | Self::PdPrefillTimeout { .. }
                | Self::PdDecodeTimeout { .. }
                | Self::UpstreamTimeout { .. }
                | Self::ModelsUnavailable { .. }
        )
    }

    /// The JSON error body (the module doc's shape).
    fn json(&self) -> String {
        serde_json::json!({"error": {
            "type": self.token(),
            "message": self.to_string(),
            "code": self.status().as_u16(),
            "party": self.party().as_str(),
            "retryable": self.retryable(),
        }})
        .to_string()
    }

    /// The JSON error response (with `Retry-After: 1` for [`ProxyError::Overloaded`],
    /// [`ProxyError::EndpointOverloaded`], [`ProxyError::AdmissionClosed`],
    /// [`ProxyError::BodyBudgetExhausted`], [`ProxyError::LocalResources`] and
    /// [`ProxyError::NoHealthyBackend`]: each a state that passes, where a client should
    /// come back rather than give up).
    pub fn into_response(self) -> Response<ProxyBody> {
        let overloaded = matches!(
            self,
            Self::Overloaded { .. }
                | Self::EndpointOverloaded { .. }
                | Self::AdmissionClosed { .. }
                | Self::BodyBudgetExhausted { .. }
                | Self::LocalResources(_)
                | Self::NoHealthyBackend { .. }
        );
        let mut resp = Response::new(full(Bytes::from(self.json())));
        *resp.status_mut() = self.status();
        if resp.status() == StatusCode::METHOD_NOT_ALLOWED {
            resp.headers_mut().insert(
                header::ALLOW,
                HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),
            );
        }
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if overloaded {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// The raw HTTP/1.1 answer to a request head over `limit` bytes: `431 Request Header Fields
/// Too Large`, the JSON error body ([`ProxyError::HeadTooLarge`]) and `Connection: close`.
/// Written by the socket wrapper itself (`conn::TrackedIo`), because hyper never parsed the
/// head; nginx answers the same case 400 "Request Header Or Cookie Too Large".
pub fn head_too_large_answer(limit: u64) -> Vec<u8> {
    let e = ProxyError::HeadTooLarge { limit };
    let body = e.json();
    format!(
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A complete body as a [`ProxyBody`].
pub fn full(b: Bytes) -> ProxyBody {
    Full::new(b).map_err(|never| match never {}).boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_json(r: Response<ProxyBody>) -> serde_json::Value {
        let b = r.into_body().collect().await.expect("body").to_bytes();
        serde_json::from_slice(&b).expect("json")
    }

    #[tokio::test]
    async fn unreachable_is_502_upstream_retryable() {
        let r = ProxyError::BackendUnreachable {
            attempts: 2,
            last: "connection refused".into(),
        }
        .into_response();
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        let v = body_json(r).await;
        assert_eq!(v["error"]["type"], "backend_unreachable");
        assert_eq!(v["error"]["party"], "upstream");
        assert_eq!(v["error"]["retryable"], true);
    }

    #[tokio::test]
    async fn overloaded_is_429_with_retry_after() {
        let r = ProxyError::Overloaded { limit: 8 }.into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            r.headers().get(header::RETRY_AFTER).map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
        let v = body_json(r).await;
        assert_eq!(v["error"]["type"], "pd_overloaded");
        assert_eq!(v["error"]["retryable"], true);
        assert_eq!(v["error"]["code"], 429);
    }

    #[tokio::test]
    async fn p_d_errors_carry_their_reason_tokens() {
        let r = ProxyError::PdPoolUnavailable {
            reason: "no_decode",
        }
        .into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        let v = body_json(r).await;
        assert_eq!(v["error"]["type"], "pd_pool_unavailable");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("no_decode")),
            "{v}"
        );
        let r = ProxyError::PdPrefillTimeout { ep_idx: 0, secs: 2 }.into_response();
        assert_eq!(r.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(body_json(r).await["error"]["type"], "pd_prefill_timeout");
        let r = ProxyError::PdDecodeTimeout { ep_idx: 1, secs: 2 }.into_response();
        assert_eq!(r.status(), StatusCode::GATEWAY_TIMEOUT);
        let v = body_json(r).await;
        assert_eq!(
            (
                v["error"]["type"].as_str(),
                v["error"]["retryable"].as_bool()
            ),
            (Some("pd_decode_timeout"), Some(true))
        );
        let r = ProxyError::PdDecodeDied {
            ep_idx: 1,
            message: "closed".into(),
        }
        .into_response();
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(
            body_json(r).await["error"]["type"],
            "pd_decode_backend_died"
        );
    }

    #[tokio::test]
    async fn a_client_handoff_field_is_400_client_naming_it() {
        let r = ProxyError::PdHandoffField {
            field: "kv_transfer_params",
        }
        .into_response();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let v = body_json(r).await;
        assert_eq!(
            (
                v["error"]["type"].as_str(),
                v["error"]["code"].as_u64(),
                v["error"]["party"].as_str(),
                v["error"]["retryable"].as_bool()
            ),
            (
                Some("pd_handoff_field"),
                Some(400),
                Some("client"),
                Some(false)
            )
        );
        assert_eq!(
            v["error"]["message"],
            "the request carries \"kv_transfer_params\", which the gateway sets itself for the \
             prefill/decode handoff on this P/D rule; send the request without it"
        );
    }

    #[tokio::test]
    async fn admission_errors_carry_their_status_token_and_retry_after() {
        let cases = [
            (
                ProxyError::EndpointOverloaded {
                    ep_idx: 0,
                    limit: 1,
                    depth: 2,
                },
                429,
                "pd_overloaded",
                true,
            ),
            (
                ProxyError::AdmissionTimeout { ep_idx: 0, secs: 1 },
                504,
                "pd_admission_timeout",
                false,
            ),
            (
                ProxyError::AdmissionClosed {
                    ep_idx: 0,
                    reason: "shutdown",
                },
                503,
                "pd_admission_closed",
                true,
            ),
            (
                ProxyError::BodyBudgetExhausted { budget: 1 << 20 },
                503,
                "body_budget_exhausted",
                true,
            ),
            (
                ProxyError::LocalResources(super::super::attempt::LocalShortage {
                    errno: "EMFILE",
                    message: "Too many open files (os error 24)".into(),
                }),
                503,
                "gateway_resources_exhausted",
                true,
            ),
            (
                ProxyError::NoHealthyBackend { service: 1 },
                503,
                "no_healthy_backend",
                true,
            ),
        ];
        for (e, status, token, retry_after) in cases {
            let r = e.into_response();
            assert_eq!(r.status().as_u16(), status);
            assert_eq!(r.headers().contains_key(header::RETRY_AFTER), retry_after);
            let v = body_json(r).await;
            assert_eq!(v["error"]["type"], token);
            assert_eq!(v["error"]["retryable"], true);
        }
    }

    #[tokio::test]
    async fn too_large_is_413_client_not_retryable() {
        let r = ProxyError::BodyTooLarge { limit: 10 }.into_response();
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let v = body_json(r).await;
        assert_eq!(v["error"]["party"], "client");
        assert_eq!(v["error"]["retryable"], false);
        assert_eq!(v["error"]["code"], 413);
    }
}
