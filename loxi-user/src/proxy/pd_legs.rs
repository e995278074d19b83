//! One leg of a P/D request on one endpoint, for every dialect: the prefill (context) leg, read
//! whole within `LLB_PD_PREFILL_TIMEOUT_SEC`, and the decode (generation) leg, whose response
//! is handed back once its first body byte arrived (the caller bounds that wait with
//! `LLB_PD_DECODE_TIMEOUT_SEC`). `pd.rs` and `pd_dialects.rs` order the legs.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::{Map, Value};
use tracing::Instrument;

use super::body::{PrimedBody, ProxyBody, Tracked};
use super::error::{ProxyError, full};
use super::handler::{ENDPOINT_HEADER, Handler, downstream_response};
use super::pool::Pool;
use super::upstream::{Attempt, strip_hop_by_hop, upstream_request};
use crate::health::breaker::Outcome;
use crate::pd::handoff;
use crate::pd::metrics::svc;
use crate::request::RequestMeta;
use crate::rules::model::authority;
use crate::telemetry::span as trace_span;

/// Header carrying the request id on both legs.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Response header naming the prefill endpoint of a two-leg P/D request (the decode endpoint is
/// in `x-loxilb-endpoint`).
pub const PREFILL_ENDPOINT_HEADER: &str = "x-loxilb-prefill-endpoint";

/// What every leg of one client request shares.
pub(super) struct Legs<'a> {
    /// The pool of the request's rule.
    pub pool: &'a Arc<Pool>,
    /// The client's request head.
    pub parts: &'a Parts,
    /// The request's metadata.
    pub meta: &'a RequestMeta,
    /// The client's JSON body, parsed whole.
    pub obj: &'a Map<String, Value>,
    /// The request id the legs carry: LoxiLB's form naming the current pair's KV addresses,
    /// renewed when a connect failure moves a leg to another endpoint ([`Legs::renew_rid`]).
    pub rid: Mutex<HeaderValue>,
    /// The request id of the last leg that may have reached an engine (its connection was
    /// made, or it was dropped in flight), `None` while none has: what an error answer names,
    /// so the client can find the failing work in the engines' logs ([`Reach`]).
    pub reached: Mutex<Option<HeaderValue>>,
    /// When the client's request arrived.
    pub start: Instant,
}

impl Legs<'_> {
    /// LoxiLB's request id for the pair (prefill `pre`, decode `dec`): each endpoint's IP and
    /// KV side-channel port ([`crate::rules::spec::PdSpec::nixl_ports`]), and a fresh UUID. Errors:
    /// `Internal` for a rule without a P/D spec (legs are built only for P/D rules).
    pub fn request_id(pool: &Pool, pre: usize, dec: usize) -> Result<HeaderValue, ProxyError> {
        let endpoints = &pool.rule.rule.endpoints;
        let pd = pool.rule.spec.pd.as_ref().ok_or_else(|| {
            ProxyError::Internal("a P/D request id for a rule without pd_disagg_mode".into())
        })?;
        let rid = handoff::request_id(
            &authority(&endpoints[pre].endpoint_ip, pd.nixl_ports[pre]),
            &authority(&endpoints[dec].endpoint_ip, pd.nixl_ports[dec]),
        );
        HeaderValue::from_str(&rid).map_err(|e| ProxyError::Internal(e.to_string()))
    }

    /// The request id the legs carry now.
    pub fn rid(&self) -> HeaderValue {
        self.rid.lock().clone()
    }

    /// The request id of the last leg that may have reached an engine.
    pub fn reached(&self) -> Option<HeaderValue> {
        self.reached.lock().clone()
    }

    /// A new request id for the pair (`pre`, `dec`), after a connect failure moved a leg: the
    /// next legs name the endpoints that serve them (vLLM's P2P connector sends the KV to the
    /// id's decode address).
    pub fn renew_rid(&self, pre: usize, dec: usize) -> Result<(), ProxyError> {
        *self.rid.lock() = Self::request_id(self.pool, pre, dec)?;
        Ok(())
    }

    /// `body` as JSON bytes.
    pub fn encode(body: Map<String, Value>) -> Result<Bytes, ProxyError> {
        serde_json::to_vec(&Value::Object(body))
            .map(Bytes::from)
            .map_err(|e| ProxyError::Internal(e.to_string()))
    }
}

/// Records a leg's request id in [`Legs::reached`] when dropped, unless [`Reach::refused`]
/// said its connection was never made: a leg that was answered, failed after it was sent, or
/// was dropped in flight (SGLang's other leg, a timeout) may have reached its engine.
struct Reach<'a> {
    reached: &'a Mutex<Option<HeaderValue>>,
    rid: Option<HeaderValue>,
}

impl<'a> Reach<'a> {
    fn new(legs: &'a Legs<'_>, rid: &HeaderValue) -> Self {
        Self {
            reached: &legs.reached,
            rid: Some(rid.clone()),
        }
    }

    /// The connection was never made (refused, or no local resources to make it).
    fn refused(&mut self) {
        self.rid = None;
    }
}

impl Drop for Reach<'_> {
    fn drop(&mut self) {
        if let Some(rid) = self.rid.take() {
            *self.reached.lock() = Some(rid);
        }
    }
}

/// The per-endpoint active gauge, decremented when dropped (the prefill leg's accounting).
struct ActiveGuard(Gauge);

impl ActiveGuard {
    fn new(g: Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Why a prefill leg's request got no response.
enum LegFailure {
    /// The connection could not be made (the endpoint's failure: try another).
    Connect,
    /// The gateway is out of its own resources (503, no endpoint blamed).
    Local(super::attempt::LocalShortage),
    /// Sent, then failed.
    Sent(super::attempt::UpstreamError),
}

/// What the prefill leg ended with.
pub(super) enum Prefill {
    /// 2xx: the whole response body.
    Done(Bytes),
    /// Non-2xx: relayed to the client as it is.
    Refused(Response<ProxyBody>),
    /// The connection could not be made: try another prefill endpoint.
    ConnectFailed,
}

impl Handler {
    /// The prefill leg on `ep`, bounded by the prefill timeout.
    pub(super) async fn prefill_leg(
        &self,
        legs: &Legs<'_>,
        body: Bytes,
        ep: usize,
    ) -> Result<Prefill, ProxyError> {
        let pool = legs.pool;
        let service = pool.rule.id;
        let pm = pool.metrics(&self.ctx.metrics);
        // The prefill endpoint's admission slot, held for the leg (proxy/admission.rs).
        let _slot = self.admit(pool, ep).await?;
        let _load = pool.loads[ep].begin();
        let _active = ActiveGuard::new(pm.eps[ep].active.clone());
        let span = trace_span::leg("prefill", ep, &pool.authorities[ep]);
        let rid = legs.rid();
        let req = leg_request(legs, &pool.authorities[ep], body, &span, &rid)?;
        let timeout = self.ctx.config.pd_prefill_timeout;
        let limit = self.ctx.config.max_body_bytes;
        let t0 = Instant::now();
        let leg = async {
            let mut reach = Reach::new(legs, &rid);
            match self
                .upstreams
                .send(req, &pool.via)
                .instrument(span.clone())
                .await
            {
                Attempt::Response(resp) => {
                    trace_span::record_attempt(&span, Some(resp.status()), None);
                    let (head, body) = resp.into_parts();
                    match Limited::new(body, limit).collect().await {
                        Ok(c) => Ok(Ok((head, c.to_bytes()))),
                        Err(e) => Ok(Err(e.to_string())),
                    }
                }
                Attempt::ConnectFailed(e) => {
                    reach.refused();
                    tracing::warn!(service, ep, request_id = ?rid, error = %e, "prefill connect failed");
                    trace_span::record_attempt(&span, None, Some("connect"));
                    Err(LegFailure::Connect)
                }
                Attempt::NoLocalResources(s) => {
                    reach.refused();
                    trace_span::record_attempt(&span, None, Some("local_resources"));
                    Err(LegFailure::Local(s))
                }
                Attempt::Failed(source) => {
                    trace_span::record_attempt(&span, None, Some("request"));
                    Err(LegFailure::Sent(source))
                }
            }
        };
        let outcome = match tokio::time::timeout(timeout, leg).await {
            Ok(o) => o,
            Err(_) => {
                trace_span::record_attempt(&span, None, Some("timeout"));
                tracing::warn!(
                    service,
                    ep,
                    request_id = ?rid,
                    secs = timeout.as_secs(),
                    "prefill leg did not answer within the prefill timeout (LLB_PD_PREFILL_TIMEOUT_SEC)"
                );
                self.ctx.metrics.pd.failure(service, "pd_prefill_timeout");
                let e = ProxyError::PdPrefillTimeout {
                    ep_idx: ep,
                    secs: timeout.as_secs(),
                };
                return Err(self.answered_failure(pool, legs.start, e));
            }
        };
        let failed = |message: String| {
            tracing::warn!(service, ep, request_id = ?rid, error = %message, "prefill leg failed after it was sent");
            self.observe(pool, ep, Outcome::StreamFailed);
            self.ctx.metrics.pd.failure(service, "pd_prefill_failed");
            let e = ProxyError::PdPrefillFailed {
                ep_idx: ep,
                message,
            };
            Err(self.answered_failure(pool, legs.start, e))
        };
        match outcome {
            Err(LegFailure::Connect) => {
                pm.eps[ep].connect_failures.inc();
                self.observe(pool, ep, Outcome::ConnectFailed);
                Ok(Prefill::ConnectFailed)
            }
            Err(LegFailure::Local(s)) => {
                self.ctx.metrics.local_shortage(service, &s);
                Err(ProxyError::LocalResources(s))
            }
            Err(LegFailure::Sent(source)) => failed(source.to_string()),
            Ok(Err(message)) => {
                pm.stream_errors(ep).inc();
                failed(message)
            }
            Ok(Ok((head, bytes))) => {
                let status = head.status;
                self.observe(pool, ep, Outcome::Status(status.as_u16()));
                self.ctx
                    .metrics
                    .pd
                    .prefill_duration
                    .get_or_create(&svc(service))
                    .observe(t0.elapsed().as_secs_f64());
                if !status.is_success() {
                    pm.request(ep, status);
                    // The client gets this answer: LoxiLB's family counts it as any other.
                    pm.ai
                        .count(status.as_u16(), legs.start.elapsed().as_secs_f64());
                    tracing::warn!(service, ep, %status, "prefill leg refused; relaying its answer");
                    return Ok(Prefill::Refused(relayed(head, bytes, ep, &rid)));
                }
                Ok(Prefill::Done(bytes))
            }
        }
    }

    /// The decode leg on `ep`: `Ok` with the response once its first body byte arrived (a
    /// non-2xx answer at once), `Err(None)` on a connect failure (try another decode
    /// endpoint), `Err(Some(_))` when the request was sent and the decode failed or closed
    /// before its first byte (502 `pd_decode_backend_died`), or when the gateway is out of
    /// its own resources to connect (503 `gateway_resources_exhausted`). Unbounded: the
    /// caller applies the decode timeout.
    pub(super) async fn decode_leg(
        &self,
        legs: &Legs<'_>,
        body: Bytes,
        ep: usize,
    ) -> Result<Response<ProxyBody>, Option<ProxyError>> {
        let pool = legs.pool;
        let service = pool.rule.id;
        let pm = pool.metrics(&self.ctx.metrics);
        let tracked = Tracked::new(
            pool.loads[ep].begin(),
            pool,
            ep,
            &self.ctx.metrics,
            legs.start,
        );
        let span = trace_span::leg("decode", ep, &pool.authorities[ep]);
        let rid = legs.rid();
        let req = leg_request(legs, &pool.authorities[ep], body, &span, &rid).map_err(Some)?;
        let mut reach = Reach::new(legs, &rid);
        let died = |message: String| {
            tracing::warn!(service, ep, request_id = ?rid, error = %message, "decode leg took the request and failed before its first byte");
            // Counted in `loxilb_proxy_requests_total` under `ep` by the error answer.
            pm.ai.count(
                StatusCode::BAD_GATEWAY.as_u16(),
                legs.start.elapsed().as_secs_f64(),
            );
            self.observe(pool, ep, Outcome::StreamFailed);
            self.ctx
                .metrics
                .pd
                .failure(service, "pd_decode_backend_died");
            Err(Some(ProxyError::PdDecodeDied {
                ep_idx: ep,
                message,
            }))
        };
        let sent = self
            .upstreams
            .send(req, &pool.via)
            .instrument(span.clone())
            .await;
        let resp = match sent {
            Attempt::Response(resp) => {
                trace_span::record_attempt(&span, Some(resp.status()), None);
                resp
            }
            Attempt::ConnectFailed(e) => {
                reach.refused();
                trace_span::record_attempt(&span, None, Some("connect"));
                tracing::warn!(service, ep, request_id = ?rid, error = %e, "decode connect failed");
                pm.eps[ep].connect_failures.inc();
                self.observe(pool, ep, Outcome::ConnectFailed);
                return Err(None);
            }
            Attempt::NoLocalResources(s) => {
                reach.refused();
                self.ctx.metrics.local_shortage(service, &s);
                return Err(Some(ProxyError::LocalResources(s)));
            }
            Attempt::Failed(source) => {
                trace_span::record_attempt(&span, None, Some("request"));
                return died(source.to_string());
            }
        };
        let (head, mut body) = resp.into_parts();
        let first = if head.status.is_success() {
            match body.frame().await {
                Some(Ok(f)) => Some(f),
                Some(Err(e)) => return died(e.to_string()),
                None => return died(format!("answered {} with an empty body", head.status)),
            }
        } else {
            None
        };
        self.ctx
            .metrics
            .pd
            .decode_ttft
            .get_or_create(&svc(service))
            .observe(legs.start.elapsed().as_secs_f64());
        let end = self.end_accounting(head.status);
        let resp = Response::from_parts(head, PrimedBody::new(first, body));
        Ok(downstream_response(resp, ep, tracked.with_end(end)))
    }

    /// The decode leg within `LLB_PD_DECODE_TIMEOUT_SEC` (504 `pd_decode_timeout` past it).
    pub(super) async fn decode_within(
        &self,
        legs: &Legs<'_>,
        ep: usize,
        leg: impl Future<Output = Result<Response<ProxyBody>, Option<ProxyError>>>,
    ) -> Result<Response<ProxyBody>, Option<ProxyError>> {
        let timeout = self.ctx.config.pd_decode_timeout;
        match tokio::time::timeout(timeout, leg).await {
            Ok(r) => r,
            Err(_) => {
                let service = legs.pool.rule.id;
                tracing::warn!(
                    service,
                    ep,
                    request_id = ?legs.reached(),
                    "decode leg sent nothing within the decode timeout"
                );
                self.ctx.metrics.pd.failure(service, "pd_decode_timeout");
                let e = ProxyError::PdDecodeTimeout {
                    ep_idx: ep,
                    secs: timeout.as_secs(),
                };
                Err(Some(self.answered_failure(legs.pool, legs.start, e)))
            }
        }
    }
}

/// A leg's upstream request: the client's head (hop-by-hop headers stripped, the length left
/// to the new body), `X-Forwarded-For`, the request id, and the trace context.
fn leg_request(
    legs: &Legs<'_>,
    authority: &str,
    body: Bytes,
    span: &tracing::Span,
    rid: &HeaderValue,
) -> Result<Request<Full<Bytes>>, ProxyError> {
    let mut req = upstream_request(legs.parts, authority, body)?;
    let h = req.headers_mut();
    h.remove(header::CONTENT_LENGTH);
    h.remove(header::ACCEPT_ENCODING);
    h.insert(REQUEST_ID_HEADER, rid.clone());
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    super::forwarded::append(h, legs.meta.client, legs.meta.https);
    trace_span::inject(span, h);
    Ok(req)
}

/// A refused prefill answer as the client's response (status, headers and body as they came),
/// traceable as a failed leg's answer is: the request id both legs were sent with
/// (`x-request-id`, replacing any the engine sent) and the prefill endpoint `ep` in
/// `x-loxilb-prefill-endpoint`. It has no `x-loxilb-endpoint`: on a P/D answer that header
/// names the decode endpoint, and no decode answered (an engine's own is removed too).
fn relayed(
    mut head: http::response::Parts,
    bytes: Bytes,
    ep: usize,
    rid: &HeaderValue,
) -> Response<ProxyBody> {
    strip_hop_by_hop(&mut head.headers);
    let h = &mut head.headers;
    h.remove(header::CONTENT_LENGTH);
    h.remove(ENDPOINT_HEADER);
    h.insert(REQUEST_ID_HEADER, rid.clone());
    h.insert(PREFILL_ENDPOINT_HEADER, HeaderValue::from(ep));
    Response::from_parts(head, full(bytes))
}
