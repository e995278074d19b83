//! One request through the fullproxy: read the body (bounded), pick the pool, extract the
//! metadata, select an endpoint with the rule's ladder (`routing::ladder`: tier 1.5 first when
//! the rule asks), forward, retry another endpoint on connect failure, and stream the response
//! back with its in-flight guard. A P/D rule's request goes through `pd.rs` instead, and
//! `GET /v1/models` through `models.rs` (the union of every pool's lists).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tracing::Instrument as _;

use super::ProxyContext;
use super::body::{EndAccounting, GuardedBody, ProxyBody, Tracked};
use super::budget::{BodyBudget, Reservation};
use super::error::ProxyError;
use super::models::{self, ModelList, ModelsCache};
use super::pool::{Pool, PoolTable};
use super::upstream::{
    Attempt, UpstreamBody, Upstreams, Via, origin_request, readdress, strip_hop_by_hop,
    upstream_request,
};
use crate::health::breaker::{Breaker, Outcome};
use crate::kv::route::select::KvTicket;
use crate::kv::wiring::KvTier;
use crate::request::{self as meta, RequestMeta};
use crate::routing::{Candidates, Decision, Excluded, Ladder};
use crate::telemetry::span as trace_span;

/// Response header naming the endpoint index that served the request.
pub const ENDPOINT_HEADER: &str = "x-loxilb-endpoint";

/// [`ENDPOINT_HEADER`] as a `HeaderName` built at compile time (not parsed per response).
static ENDPOINT_NAME: http::HeaderName = http::HeaderName::from_static(ENDPOINT_HEADER);

/// "00" to "99", two characters each: [`endpoint_value`]'s static texts.
const TWO_DIGITS: &str = concat!(
    "00010203040506070809101112131415161718192021222324",
    "25262728293031323334353637383940414243444546474849",
    "50515253545556575859606162636465666768697071727374",
    "75767778798081828384858687888990919293949596979899",
);

/// The [`ENDPOINT_HEADER`] value of endpoint index `ep` (its decimal text): a static value
/// below 100 (`From<usize>` allocates one per response).
pub(super) fn endpoint_value(ep: usize) -> HeaderValue {
    if ep >= 100 {
        return HeaderValue::from(ep);
    }
    let text = &TWO_DIGITS[ep * 2..ep * 2 + 2];
    HeaderValue::from_static(if ep < 10 { &text[1..] } else { text })
}

/// A request whose client went away before its answer's head (hyper dropped the handler's
/// future): counted on drop in `loxilb_proxy_requests_total` as nginx's 499 "client closed
/// request" (`class="4xx"`, `ep_idx="none"`, under its rule once routing knew it, else
/// `service="0"`), so that every request is counted once (before, only the duration histogram
/// saw it). A request answered, whatever the answer, is counted where it is answered.
struct Unanswered<'a> {
    metrics: &'a super::metrics::ProxyMetrics,
    /// The rule's id once routing chose it (0 before).
    service: AtomicU32,
    armed: bool,
}

impl<'a> Unanswered<'a> {
    fn new(metrics: &'a super::metrics::ProxyMetrics) -> Self {
        Self {
            metrics,
            service: AtomicU32::new(0),
            armed: true,
        }
    }

    /// The request was answered: nothing to count on drop.
    fn answered(mut self) {
        self.armed = false;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.armed {
            let service = self.service.load(Ordering::Relaxed);
            tracing::debug!(service, "client went away before its answer");
            self.metrics.request(service, None, client_closed());
        }
    }
}

/// nginx's 499 "client closed request" (no HTTP status; only counted, as a 4xx).
fn client_closed() -> http::StatusCode {
    http::StatusCode::from_u16(499).unwrap_or(http::StatusCode::BAD_REQUEST)
}

/// Per-listener request handler.
pub struct Handler {
    /// The listener's pools (swapped on rule changes).
    pub table: Arc<ArcSwap<PoolTable>>,
    /// Metrics, tier and limits.
    pub ctx: ProxyContext,
    /// The passive circuit breaker (timers tracked by the proxy), shared with every response's
    /// end accounting.
    pub breaker: Arc<Breaker>,
    /// Upstream clients.
    pub upstreams: Upstreams,
    /// The listener's aggregated `GET /v1/models` answers.
    pub models: ModelsCache,
}

impl Handler {
    /// Serves one request; errors become JSON error responses.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        client: SocketAddr,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let start = Instant::now();
        let h1 = req.version() <= http::Version::HTTP_11;
        let span = trace_span::request(req.method(), req.uri().path(), req.headers());
        let pending = Unanswered::new(&self.ctx.metrics);
        // The routing future (kilobytes) is built in its box once; unboxed it was copied into
        // the span's wrapper, and that into hyper's dispatcher with this function's future.
        let routed = Box::pin(self.route(req, client, start, &pending.service))
            .instrument(span.clone())
            .await;
        pending.answered();
        let resp = match routed {
            Ok(resp) => resp,
            Err((service, e)) => {
                // The rest of the body is not read (413: only discarded for a bounded time,
                // see `body::discard_for`; 408: it came too slowly; 400: reading it failed):
                // the connection cannot carry another request, and says so.
                let closes = matches!(
                    e,
                    ProxyError::BodyTooLarge { .. }
                        | ProxyError::BodyTimeout { .. }
                        | ProxyError::ClientBody(_)
                );
                let mut resp = self.error_response(service, e);
                if closes && h1 {
                    resp.headers_mut()
                        .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
                }
                resp
            }
        };
        trace_span::record_status(&span, resp.status());
        Ok(resp)
    }

    /// `e` as its JSON answer, logged at debug and counted for `service` in
    /// `loxilb_proxy_requests_total`: under the endpoint that failed
    /// ([`ProxyError::failed_endpoint`]), else without one (`ep_idx="none"`, the gateway's own
    /// refusals).
    pub(super) fn error_response(&self, service: u32, e: ProxyError) -> Response<ProxyBody> {
        tracing::debug!(error = %e, party = e.party().as_str(), "proxy error");
        let ep = e.failed_endpoint();
        let resp = e.into_response();
        self.ctx.metrics.request(service, ep, resp.status());
        resp
    }

    /// `e`, an endpoint's failure that becomes the client's answer, counted in the pool's
    /// `loxilb_ai_requests_total` (by its status) and `loxilb_ai_request_duration_seconds`
    /// (head received at `start` → now), as an answer the backend gave is.
    pub(super) fn answered_failure(
        &self,
        pool: &Pool,
        start: Instant,
        e: ProxyError,
    ) -> ProxyError {
        pool.metrics(&self.ctx.metrics)
            .ai
            .count(e.status().as_u16(), start.elapsed().as_secs_f64());
        e
    }

    /// Routes and forwards one request; `seen` gets its rule's id once known (for
    /// [`Unanswered`]).
    async fn route(
        &self,
        req: Request<Incoming>,
        client: SocketAddr,
        start: Instant,
        seen: &AtomicU32,
    ) -> Result<Response<ProxyBody>, (u32, ProxyError)> {
        let (mut parts, body) = req.into_parts();
        // CONNECT would tunnel anywhere; TRACE would echo the request, credentials included
        // (nginx answers both 405).
        if parts.method == http::Method::CONNECT || parts.method == http::Method::TRACE {
            return Err((0, ProxyError::MethodNotAllowed(parts.method)));
        }
        if let Some(e) = parts.headers.get(http::header::EXPECT)
            && !e.as_bytes().eq_ignore_ascii_case(b"100-continue")
        {
            let shown = String::from_utf8_lossy(e.as_bytes()).into_owned();
            return Err((0, ProxyError::ExpectationFailed(shown)));
        }
        if let Some(coding) = unsupported_transfer_coding(&parts.headers) {
            return Err((0, ProxyError::UnsupportedTransferCoding(coding)));
        }
        // One lookup for both checks of `Host`.
        let mut hosts = parts.headers.get_all(http::header::HOST).iter();
        let (first_host, second_host) = (hosts.next().is_some(), hosts.next().is_some());
        if parts.version == http::Version::HTTP_11 && !first_host {
            return Err((0, ProxyError::MissingHost));
        }
        if second_host {
            return Err((0, ProxyError::DuplicateHost));
        }
        if super::forwarded::is_loop(&parts.headers) {
            return Err((0, ProxyError::Loop));
        }
        absolute_form_host(&mut parts);
        if let Some(e) = authority_mismatch(&parts) {
            return Err((0, e));
        }
        // The host routing reads: `Host`, else (HTTP/2 without one) `:authority`, which may
        // carry userinfo no `Host` may (RFC 9113 §8.3.1).
        if let Some(h) = parts
            .headers
            .get(http::header::HOST)
            .map(|h| h.as_bytes())
            .or_else(|| parts.uri.authority().map(|a| a.as_str().as_bytes()))
            && !valid_host(h)
        {
            let shown = String::from_utf8_lossy(h).into_owned();
            return Err((0, ProxyError::InvalidHost(shown)));
        }
        let cfg = &self.ctx.config;
        let (bytes, _reserved) = timed_if_pending(
            cfg.body_timeout,
            read_body(body, cfg.max_body_bytes, &cfg.body_budget),
        )
        .await
        .ok_or_else(|| {
            let ms = u64::try_from(cfg.body_timeout.as_millis()).unwrap_or(u64::MAX);
            (0, ProxyError::BodyTimeout { ms })
        })?
        .map_err(|e| (0, e))?;
        if models::is_list_request(&parts) {
            let table = self.table.load_full();
            let pools = table.for_host(request_host(&parts)).map_err(|e| (0, e))?;
            // The same 421 as for any other request: the listed pools all serve one host.
            if let (Some(tls), Some(pool)) = (
                parts.extensions.get::<super::tls::ClientTls>(),
                pools.first(),
            ) {
                tls.check_host(&pool.rule.rule.service.host)
                    .map_err(|e| (0, e))?;
            }
            // The fan-out is forwarded like any request: `X-Forwarded-*`, and this process's
            // hop id, so a rule leading back to this gateway is refused 508 by its listener
            // at once instead of being asked until the timeout.
            let https = parts.extensions.get::<super::tls::ClientTls>().is_some();
            super::forwarded::append(&mut parts.headers, Some(client), https);
            let list = ModelList {
                upstreams: &self.upstreams,
                config: self.ctx.config.models,
                cache: &self.models,
            };
            // Boxed, as the P/D path below: rare, and inline it would size every request's
            // routing future.
            return Box::pin(list.answer(&parts, &pools))
                .await
                .map_err(|e| (0, e));
        }
        // Parse the body only when routing reads it: for the model of a multi-pool listener,
        // or for a prefix-keyed selector / tier 1.5. Plain rr/wrr/lc/hash/persist skip it.
        // The parse is bounded (`request::bounded`): what routing keeps of a 32 MiB body is
        // small, and it is dropped once the metadata is read.
        let table = self.table.load_full();
        let limits = self.ctx.config.parse;
        // A body declared as something other than JSON is not read (`meta::declares_json`),
        // checked only when the body would be parsed (plain selectors never look).
        let mut json = (table.routes_by_model() && meta::declares_json(&parts.headers))
            .then(|| meta::parse_body_bounded(&bytes, limits))
            .flatten();
        let model = meta::request_model(&parts.headers, json.as_ref().map(|p| &p.value));
        let pool = table
            .choose(request_host(&parts), model.as_deref())
            .map_err(|e| (0, e))?
            .clone();
        let tls = parts.extensions.get::<super::tls::ClientTls>();
        if let Some(tls) = tls {
            tls.check_host(&pool.rule.rule.service.host)
                .map_err(|e| (0, e))?;
        }
        if json.is_none() && pool.needs_body() && meta::declares_json(&parts.headers) {
            json = meta::parse_body_bounded(&bytes, limits);
        }
        let service = pool.rule.id;
        seen.store(service, Ordering::Relaxed);
        let mut meta = RequestMeta::from_json(
            &parts,
            json.as_ref().map(|p| &p.value),
            Some(client),
            &pool.rule.rule.service,
        );
        meta.body_cut = json.is_some_and(|p| p.cut);
        meta.https = tls.is_some();
        trace_span::record_rule(service, meta.model.as_deref());
        if pool.rule.spec.pd.is_some() {
            // Boxed: its future is kilobytes larger than the plain path's, and inline it would
            // size (and be copied with) every request's routing future.
            return Box::pin(self.forward_pd(&pool, parts, bytes, &meta, start))
                .await
                .map_err(|e| (service, e));
        }
        self.forward(&pool, &mut parts, bytes, &meta, start)
            .await
            .map_err(|e| (service, e))
    }

    /// Forwards the request to the endpoint the ladder picks, and on a connect failure to the
    /// next one (the failed endpoint excluded); an idempotent request (GET, HEAD, OPTIONS, PUT,
    /// DELETE) also when the endpoint dropped it without a response head (counted in
    /// `loxilb_proxy_upstream_retries_total`). A response timeout is not retried. Cleartext HTTP/1.1 takes the client's header
    /// map into the upstream request (`origin_request`; `parts.headers` is empty afterwards).
    /// `parts` is borrowed, not owned: an owned argument of an async fn is stored twice in its
    /// future (the argument and the body's local), and every request's future is copied once.
    pub(super) async fn forward(
        &self,
        pool: &Arc<Pool>,
        parts: &mut Parts,
        body: Bytes,
        meta: &RequestMeta,
        start: Instant,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let service = pool.rule.id;
        let pm = pool.metrics(&self.ctx.metrics);
        let mut excluded = Excluded::default();
        let ladder = Ladder {
            rule: &pool.rule,
            state: &pool.state,
            tier: self.ctx.tier.as_deref(),
        };
        // Tier 1.5's per-request state (service and block keys), shared by its calls below.
        let mut ticket = KvTicket::default();
        ladder.prepare(meta, &mut ticket).await;
        let mut attempts = 0;
        let mut last = String::new();
        // Cleartext HTTP/1.1 builds the upstream request once; a connect failure gives it back
        // (boxed: rare, and inline it would size every request's future).
        let mut unsent: Option<Box<Request<Full<Bytes>>>> = None;
        // Whether that request's `Host` was added (then it names each attempt's endpoint).
        let mut host_added = false;
        // An idempotent request (RFC 9110 §9.2.2) an endpoint drops without an answer is sent
        // again to another one, as nginx's `proxy_next_upstream error`: running it twice is
        // harmless. A POST (every inference request) is not: it may have run.
        let idempotent = is_idempotent(&parts.method);
        // Cleartext HTTP/1.1 moves the header map into the request it sends, so an idempotent
        // one keeps a copy for that retry (boxed, rare).
        let mut spare: Option<Box<Request<Full<Bytes>>>> = None;
        // The endpoint that dropped the idempotent request being sent again: counted in
        // `loxilb_proxy_upstream_retries_total` when another endpoint takes it.
        let mut dropped_by: Option<usize> = None;
        loop {
            let d = self.decide(pool, &ladder, meta, &excluded, &mut ticket);
            if let (Some(_), Some(prev)) = (d.endpoint, dropped_by.take()) {
                pm.upstream_retry(prev);
            }
            let Some(ep) = d.endpoint else {
                return Err(if attempts == 0 {
                    ProxyError::NoHealthyBackend { service }
                } else {
                    ProxyError::BackendUnreachable { attempts, last }
                });
            };
            attempts += 1;
            let sel = pool.rule.spec.sel.name();
            trace_span::record_decision(sel, d.reason.as_str(), ep, attempts);
            // The endpoint's admission slot (when the gate applies), held with the response.
            let slot = self.admit(pool, ep).await?;
            // At dispatch, not at the response: a non-streaming response (or a streaming one
            // behind a slow prefill) arrives after the prefill, and requests sharing this
            // prefix in that window would otherwise see no holder and scatter. Inline: the
            // block keys come from the ticket `prepare` filled, so this is microseconds.
            ladder.routed(meta, ep, &mut ticket);
            // The request's uncached prompt tokens count as the endpoint's queued prefill
            // work until its response starts (the `work` law reads it).
            let tracked = Tracked::new(
                pool.loads[ep].begin().with_work(ticket.prefill_tokens()),
                pool,
                ep,
                &self.ctx.metrics,
                start,
            )
            .with_slot(slot);
            // Cleartext HTTP/1.1 goes on a connection this task drives (`upstream_h1.rs`).
            let authority = &pool.authorities[ep];
            let attempt = trace_span::attempt(ep, authority, attempts);
            // The requests go straight into the send calls, never into a local: a local held
            // across the await is one more slot of ~250 bytes in the future.
            let outcome = if matches!(pool.via, Via::H1) {
                let next = H1Attempt {
                    unsent: unsent.take().map(|b| *b),
                    authority,
                    body: &body,
                    meta,
                    span: &attempt,
                };
                let send = |req| self.upstreams.send_h1(req, authority);
                let limit = self.ctx.config.response_timeout;
                // Without traces the send is awaited bare: `instrument` moves the whole send
                // future into its wrapper (a ~1 KB copy a request, callgrind).
                let request = || -> Result<_, ProxyError> {
                    let req = next.request(parts, &mut host_added)?;
                    Ok(keep_spare(req, idempotent, &mut spare))
                };
                let answered = if attempt.is_disabled() {
                    within(limit, send(request()?)).await
                } else {
                    let sent = send(request()?);
                    within(limit, sent.instrument(attempt.clone())).await
                };
                let Some((outcome, back)) = answered else {
                    return Err(self.timed_out(pool, ep, start));
                };
                unsent = back.map(Box::new);
                outcome.map_body(UpstreamBody::Driven)
            } else {
                let build = || -> Result<_, ProxyError> {
                    let mut req = upstream_request(parts, authority, body.clone())?;
                    super::forwarded::append(req.headers_mut(), meta.client, meta.https);
                    trace_span::inject(&attempt, req.headers_mut());
                    Ok(req)
                };
                let limit = self.ctx.config.response_timeout;
                let answered = if attempt.is_disabled() {
                    within(limit, self.upstreams.send(build()?, &pool.via)).await
                } else {
                    let sent = self.upstreams.send(build()?, &pool.via);
                    within(limit, sent.instrument(attempt.clone())).await
                };
                let Some(outcome) = answered else {
                    return Err(self.timed_out(pool, ep, start));
                };
                outcome.map_body(UpstreamBody::Pooled)
            };
            trace_span::record_attempt(&attempt, outcome.status(), outcome.error_type());
            match outcome {
                Attempt::Response(resp) => {
                    // Counted and judged by the breaker when the body ends (a backend dying
                    // mid-stream is an upstream error, not the 2xx its head said).
                    let end = self.end_accounting(resp.status());
                    return Ok(downstream_response(resp, ep, tracked.with_end(end)));
                }
                Attempt::ConnectFailed(e) => {
                    tracing::warn!(service, ep, error = %e, "upstream connect failed; trying another endpoint");
                    pm.eps[ep].connect_failures.inc();
                    self.observe(pool, ep, Outcome::ConnectFailed);
                    excluded.insert(ep);
                    last = e;
                }
                Attempt::NoLocalResources(s) => {
                    self.ctx.metrics.local_shortage(service, &s);
                    return Err(ProxyError::LocalResources(s));
                }
                Attempt::Failed(source) => {
                    // Sent, then no usable head (none, or an unsolicited 101): a failure of
                    // the endpoint; retried elsewhere only when idempotent and no head came.
                    self.observe(pool, ep, Outcome::NoResponse);
                    if idempotent && !source.is::<super::attempt::UnsolicitedUpgrade>() {
                        let error = super::attempt::error_chain(&*source);
                        tracing::warn!(
                            service,
                            ep,
                            method = %parts.method,
                            error = %error,
                            "the backend dropped an idempotent request without answering; sending it to another endpoint, if one is left"
                        );
                        dropped_by = Some(ep);
                        excluded.insert(ep);
                        last = error;
                        unsent = spare.take();
                        continue;
                    }
                    let e = ProxyError::Upstream { ep_idx: ep, source };
                    return Err(self.answered_failure(pool, start, e));
                }
            }
        }
    }

    /// The ladder's decision, counted in the pool's selection metrics.
    fn decide(
        &self,
        pool: &Pool,
        ladder: &Ladder<'_, KvTier>,
        meta: &RequestMeta,
        excluded: &Excluded,
        ticket: &mut KvTicket,
    ) -> Decision {
        let cands = Candidates {
            weights: &pool.weights,
            loads: &pool.loads,
            excluded,
        };
        let step = ladder.decide(meta, &cands, ticket);
        pool.metrics(&self.ctx.metrics)
            .selection(step.by_tier, step.decision.reason);
        step.decision
    }

    /// How a response with `status` is counted when its body ends.
    pub(super) fn end_accounting(&self, status: http::StatusCode) -> EndAccounting {
        EndAccounting {
            status,
            breaker: self.breaker.clone(),
            streaming: false,
        }
    }

    /// Feeds the passive circuit breaker.
    /// Endpoint `ep` sent no response head within the response timeout: counted
    /// (`loxilb_proxy_upstream_timeouts_total`), fed to the breaker as a failure (a hung or
    /// black-holed backend is taken out like one that fails), and answered 504. The caller
    /// drops the send, which closes the upstream connection and so aborts the request there.
    fn timed_out(&self, pool: &Pool, ep: usize, start: Instant) -> ProxyError {
        let limit = self.ctx.config.response_timeout.unwrap_or_default();
        let ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
        pool.metrics(&self.ctx.metrics).upstream_timeout(ep);
        tracing::warn!(
            service = pool.rule.id,
            ep,
            ms,
            "no response head from the backend in time (LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS); aborted, 504"
        );
        self.observe(pool, ep, Outcome::TimedOut);
        self.answered_failure(pool, start, ProxyError::UpstreamTimeout { ep_idx: ep, ms })
    }

    pub(super) fn observe(&self, pool: &Pool, ep: usize, outcome: Outcome) {
        if self
            .breaker
            .observe(&pool.health[ep], &pool.loads[ep], outcome)
        {
            tracing::warn!(
                service = pool.rule.id,
                ep,
                ?outcome,
                "circuit breaker opened"
            );
        }
    }
}

/// What one cleartext HTTP/1.1 attempt sends (see [`H1Attempt::request`]).
struct H1Attempt<'a> {
    /// The request a connect failure gave back, if any.
    unsent: Option<Request<Full<Bytes>>>,
    /// The endpoint's `ip:port`.
    authority: &'a str,
    body: &'a Bytes,
    meta: &'a RequestMeta,
    /// The attempt's span, whose trace context goes into the request.
    span: &'a tracing::Span,
}

impl H1Attempt<'_> {
    /// The request: the one a connect failure gave back (its `Host` readdressed to this
    /// endpoint when it was added), else built from the client's head ([`origin_request`] takes
    /// `parts.headers`) with `X-Forwarded-*`; with the attempt's trace context. `host_added`
    /// is set when the first build adds `Host`.
    fn request(
        self,
        parts: &mut Parts,
        host_added: &mut bool,
    ) -> Result<Request<Full<Bytes>>, ProxyError> {
        let mut req = match self.unsent {
            Some(mut req) => {
                if *host_added {
                    readdress(&mut req, self.authority)?;
                }
                req
            }
            None => {
                let (mut req, added) = origin_request(parts, self.authority, self.body.clone())?;
                *host_added = added;
                let meta = self.meta;
                super::forwarded::append(req.headers_mut(), meta.client, meta.https);
                req
            }
        };
        trace_span::inject(self.span, req.headers_mut());
        Ok(req)
    }
}

/// True for the methods RFC 9110 §9.2.2 calls idempotent (TRACE is refused before routing).
fn is_idempotent(m: &http::Method) -> bool {
    use http::Method;
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE
    )
}

/// `req`, after keeping a copy of it in `spare` when `keep` (an idempotent request, which is
/// sent again elsewhere if its endpoint drops it; see [`Handler::forward`]). The copy has
/// `req`'s method, target, version, headers and body; not its extensions (none are set on an
/// upstream request).
fn keep_spare(
    req: Request<Full<Bytes>>,
    keep: bool,
    spare: &mut Option<Box<Request<Full<Bytes>>>>,
) -> Request<Full<Bytes>> {
    if keep {
        let mut copy = Request::new(req.body().clone());
        *copy.method_mut() = req.method().clone();
        *copy.uri_mut() = req.uri().clone();
        *copy.version_mut() = req.version();
        *copy.headers_mut() = req.headers().clone();
        *spare = Some(Box::new(copy));
    }
    req
}

/// `fut`'s output, or `None` when `limit` passes first (`fut` is then dropped). Without a
/// limit `fut` is awaited as it is (no timer).
async fn within<F: std::future::Future>(limit: Option<Duration>, fut: F) -> Option<F::Output> {
    match limit {
        None => Some(fut.await),
        Some(d) => tokio::time::timeout(d, fut).await.ok(),
    }
}

/// `fut`'s output, or `None` when `limit` passes first (`fut` is then dropped); the timer
/// starts only if `fut` is not ready at its first poll, so a request body that came whole with
/// its head (most prompts) costs no clock read and no timer. The limit then runs from that
/// first poll, microseconds after the call.
async fn timed_if_pending<F: std::future::Future>(limit: Duration, fut: F) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    match std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
        Poll::Ready(out) => Some(out),
        Poll::Pending => tokio::time::timeout(limit, fut).await.ok(),
    }
}

/// How long a body refused by its declared `Content-Length` is read and discarded after its
/// 413 at most (see [`super::body::discard_for`]).
const OVERSIZE_DRAIN_TIME: Duration = Duration::from_secs(2);

/// Reads the whole request body (chunked included) up to `limit` bytes: a body that arrives in
/// one data frame is that frame, uncopied; a longer one is collected into one buffer sized
/// by `Content-Length` when given (a `Content-Length` over `limit` is 413 at once, the body
/// discarded by [`super::body::discard_for`]; so a large body is held once, not twice while collected;
/// pages a client never sends are never touched), reserving in `budget` the bytes received as
/// they arrive: the first frame may wait for budget, later ones only when this body is the
/// eldest holder (else 503 `body_budget_exhausted` when it is spent; see [`super::budget`]).
/// The reservation is the
/// caller's until the request no longer holds the body.
async fn read_body(
    mut body: Incoming,
    limit: usize,
    budget: &BodyBudget,
) -> Result<(Bytes, Reservation<'_>), ProxyError> {
    // A `Content-Length` over the limit is refused before any of it is read (a client that
    // declares a terabyte and sends nothing gets its 413 now, not the body timeout's 408).
    let hint = http_body::Body::size_hint(&body);
    if hint.lower() > limit as u64 {
        super::body::discard_for(body, OVERSIZE_DRAIN_TIME);
        return Err(ProxyError::BodyTooLarge { limit });
    }
    let lower = usize::try_from(hint.lower()).unwrap_or(limit).min(limit);
    let mut reserved = Reservation::default();
    let mut covered = 0;
    // The first data frame is kept as it came (a slice of hyper's read buffer): a body that
    // arrives in one frame, as a small one with its head does, is neither copied nor given a
    // buffer of its own. A second frame starts the buffer.
    let mut first: Option<Bytes> = None;
    let mut buf = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(ProxyError::ClientBody)?;
        if let Ok(data) = frame.into_data() {
            let held = first.as_ref().map_or(0, Bytes::len) + buf.len();
            let len = held + data.len();
            if len > limit {
                return Err(ProxyError::BodyTooLarge { limit });
            }
            if len > covered {
                // Whole KiB, so small frames do not each round up.
                let more = (len - covered).next_multiple_of(1024);
                if !budget.grow(&mut reserved, more).await {
                    return Err(ProxyError::BodyBudgetExhausted {
                        budget: budget.bytes(),
                    });
                }
                covered += more;
            }
            if held == 0 {
                first = Some(data);
                continue;
            }
            if let Some(f) = first.take() {
                buf.reserve(reserve_ahead(lower, len));
                buf.extend_from_slice(&f);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok((first.unwrap_or_else(|| buf.freeze()), reserved))
}

/// `host[:port]` per RFC 3986 (§3.2.2, §3.2.3): an IPv6 literal in brackets
/// ([`ipv6_literal`]), or a reg-name / IPv4 address of unreserved, sub-delims and `%`
/// characters; then optionally `:` and a port ([`valid_port`]). Empty is valid (RFC 9112 §3.2: a target without an authority). No userinfo (`@`), no `/`,
/// no spaces.
fn valid_host(v: &[u8]) -> bool {
    let (host, port) = if v.first() == Some(&b'[') {
        let Some(end) = v.iter().position(|&b| b == b']') else {
            return false;
        };
        if !ipv6_literal(&v[1..end]) {
            return false;
        }
        match &v[end + 1..] {
            [] => return true,
            [b':', port @ ..] => (&[][..], port),
            _ => return false,
        }
    } else {
        match v.iter().rposition(|&b| b == b':') {
            Some(i) => (&v[..i], &v[i + 1..]),
            None => (v, &[][..]),
        }
    };
    let reg_name = |b: &u8| {
        b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'-' | b'.'
                    | b'_'
                    | b'~'
                    | b'%'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
            )
    };
    host.iter().all(reg_name) && valid_port(port)
}

/// The inside of a `Host`'s brackets: an IPv6 address, optionally with an RFC 6874 zone
/// (`fe80::1%25eth0`). Brackets around anything else (`[x.test]`, `[127.0.0.1]`) are no URI
/// host (RFC 3986 §3.2.2; IPvFuture literals are not taken), and host routing would read the
/// name inside them.
fn ipv6_literal(literal: &[u8]) -> bool {
    let (addr, zone) = match literal.windows(3).position(|w| w == b"%25") {
        Some(i) => (&literal[..i], Some(&literal[i + 3..])),
        None => (literal, None),
    };
    let zone_ok = zone.is_none_or(|z| {
        !z.is_empty()
            && z.iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
    });
    zone_ok
        && std::str::from_utf8(addr)
            .ok()
            .and_then(|a| a.parse::<std::net::Ipv6Addr>().ok())
            .is_some()
}

/// A `Host` port: empty (RFC 3986 allows `host:`), or decimal digits naming 0–65535 (a TCP
/// port; `b.example:99999` names no port a client could have connected to).
fn valid_port(port: &[u8]) -> bool {
    port.is_empty()
        || (port.iter().all(u8::is_ascii_digit)
            && std::str::from_utf8(port)
                .ok()
                .and_then(|p| p.parse::<u16>().ok())
                .is_some())
}

/// The first transfer coding of the request's `Transfer-Encoding` other than `chunked`
/// (case-insensitive, parameters ignored), if any. Looked up once per request: absent on
/// nearly every one.
fn unsupported_transfer_coding(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get_all(http::header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("\u{fffd}").split(','))
        .map(|c| c.split(';').next().unwrap_or("").trim())
        .find(|c| !c.is_empty() && !c.eq_ignore_ascii_case("chunked"))
        .map(str::to_string)
}

/// How much of a body's buffer to allocate once its second frame arrives, `len` bytes held
/// and `declared` the `Content-Length` (0 when chunked): the declared length, but never more
/// than [`RESERVE_AHEAD`] beyond what arrived; a larger body grows the buffer as it comes.
/// Reserving the whole declared length let a client that declares a megabyte, sends a few
/// kilobytes and leaves make the gateway allocate (and glibc keep) the megabyte, beyond the
/// body budget, which counts bytes received.
fn reserve_ahead(declared: usize, len: usize) -> usize {
    declared.min(len.saturating_add(RESERVE_AHEAD)).max(len)
}

/// See [`reserve_ahead`]: one allocation for bodies up to 64 KiB past their first frame (a
/// 64 KiB prompt takes one), doubling growth beyond.
const RESERVE_AHEAD: usize = 64 << 10;

/// An HTTP/1.x request in absolute form (`GET http://b.example/p`) names its host in the
/// request target, and RFC 9112 §3.2.2 makes a server ignore the `Host` header then: the
/// header is replaced by the target's authority, so host routing and the backend read the same
/// host. HTTP/2 requests always carry their authority in the URI and are left as they are.
fn absolute_form_host(parts: &mut Parts) {
    if parts.version >= http::Version::HTTP_2 {
        return;
    }
    if let Some(v) = parts
        .uri
        .authority()
        .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok())
    {
        parts.headers.insert(http::header::HOST, v);
    }
}

/// An HTTP/2 request's `Host` that names another authority than its `:authority` (RFC 9113
/// §8.3.1; compared without case), as the error to answer.
fn authority_mismatch(parts: &Parts) -> Option<ProxyError> {
    if parts.version < http::Version::HTTP_2 {
        return None;
    }
    let authority = parts.uri.authority()?.as_str();
    let host = parts.headers.get(http::header::HOST)?.as_bytes();
    (!host.eq_ignore_ascii_case(authority.as_bytes())).then(|| ProxyError::AuthorityMismatch {
        authority: authority.to_string(),
        host: String::from_utf8_lossy(host).into_owned(),
    })
}

/// The request's host: the `Host` header, else the URI authority (HTTP/2).
fn request_host(parts: &Parts) -> Option<&str> {
    parts
        .headers
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| parts.uri.authority().map(|a| a.as_str()))
}

pub(super) fn downstream_response<B>(
    resp: Response<B>,
    ep: usize,
    tracked: Tracked,
) -> Response<ProxyBody>
where
    B: http_body::Body<Data = bytes::Bytes, Error = hyper::Error> + Unpin + Send + Sync + 'static,
{
    let (mut parts, body) = resp.into_parts();
    let mut tracked = tracked;
    if is_event_stream(&parts.headers) {
        tracked.mark_streaming();
    }
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.insert(&ENDPOINT_NAME, endpoint_value(ep));
    Response::from_parts(parts, GuardedBody::new(body, tracked).boxed())
}

/// True when `headers` say `Content-Type: text/event-stream` (an SSE response; parameters
/// after `;` and surrounding whitespace ignored, the media type compared case-insensitively).
/// On the value's bytes: every response passes here.
fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers.get(http::header::CONTENT_TYPE).is_some_and(|v| {
        let b = v.as_bytes();
        let media = b.split(|&c| c == b';').next().unwrap_or(b);
        media
            .trim_ascii()
            .eq_ignore_ascii_case(b"text/event-stream")
    })
}

#[cfg(test)]
mod tests {
    use super::is_event_stream;

    fn with_type(v: &'static str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(v),
        );
        h
    }

    #[test]
    fn hosts_are_host_and_port_as_rfc_3986_spells_them() {
        for ok in [
            "",
            "x",
            "b.example",
            "b.example:8080",
            "127.0.0.1:19001",
            "[::1]",
            "[::1]:80",
            "[fe80::1%25eth0]:80",
            "a_b.example:",
            "b.example:65535",
            "[::1]:0",
        ] {
            assert!(super::valid_host(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "a b/c",
            "evil@127.0.0.1:19001",
            "u:p@b.example:99",
            "b.example/p",
            "b.example:80x",
            "[::1",
            "[::1]x",
            "[]",
            "b.example\t",
            "b.example:65536",
            "b.example:99999",
            "[x.test]",
            "[x.test]:80",
            "[127.0.0.1]",
            "[fe80::1%eth0]",
            "[fe80::1%25]",
            "[v1.x]",
            "[::1]:123456789012345678901",
        ] {
            assert!(!super::valid_host(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn a_transfer_coding_other_than_chunked_is_named() {
        let te = |vals: &[&'static str]| {
            let mut h = http::HeaderMap::new();
            for v in vals {
                h.append(
                    http::header::TRANSFER_ENCODING,
                    http::HeaderValue::from_static(v),
                );
            }
            super::unsupported_transfer_coding(&h)
        };
        assert_eq!(te(&[]), None);
        assert_eq!(te(&["chunked"]), None);
        assert_eq!(te(&["Chunked"]), None);
        assert_eq!(te(&["gzip, chunked"]).as_deref(), Some("gzip"));
        assert_eq!(te(&["gzip", "chunked"]).as_deref(), Some("gzip"));
        assert_eq!(te(&["x-custom;q=1, chunked"]).as_deref(), Some("x-custom"));
    }

    #[test]
    fn a_bodys_buffer_is_reserved_at_most_64_kib_past_what_arrived() {
        use super::{RESERVE_AHEAD, reserve_ahead};
        // A 64 KiB prompt whose first frame held 16 KiB: one allocation of the whole body.
        assert_eq!(reserve_ahead(65_536, 16_384), 65_536);
        // Declared a megabyte, sent 60 KB: 60 KB + 64 KiB, not the megabyte.
        assert_eq!(reserve_ahead(1_000_000, 60_000), 60_000 + RESERVE_AHEAD);
        // Chunked (nothing declared), or declared less than arrived: what arrived.
        assert_eq!(reserve_ahead(0, 20_000), 20_000);
        assert_eq!(reserve_ahead(10, 20_000), 20_000);
    }

    #[test]
    fn endpoint_values_are_the_indexes_decimal_text() {
        for ep in [0, 7, 9, 10, 63, 64, 99, 100, 1000] {
            assert_eq!(
                super::endpoint_value(ep).to_str().expect("ASCII digits"),
                ep.to_string()
            );
        }
    }

    #[test]
    fn event_stream_is_told_by_its_media_type_only() {
        for yes in [
            "text/event-stream",
            "Text/Event-Stream",
            " text/event-stream ; charset=utf-8",
            "text/event-stream;charset=utf-8",
        ] {
            assert!(is_event_stream(&with_type(yes)), "{yes:?}");
        }
        for no in [
            "application/json",
            "text/event-streams",
            "text/event",
            "x text/event-stream",
            "",
        ] {
            assert!(!is_event_stream(&with_type(no)), "{no:?}");
        }
        assert!(!is_event_stream(&http::HeaderMap::new()));
    }
}
