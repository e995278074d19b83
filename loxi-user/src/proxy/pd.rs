//! The two legs of a P/D request (`pd_disagg_mode: true`, vLLM dialect, see
//! [`crate::pd::handoff`] for the bodies and where each field was checked).
//!
//! For a JSON `/v1/completions` or `/v1/chat/completions` request:
//! 1. the P/D ladder ([`crate::pd::PdLadder`]) picks the prefill endpoint (tier 0 pin, tier 1
//!    prefix trie with `pd_cache_aware_mode`, keyed by the prompt's token ids when the KV tier
//!    has a tokenizer staged for the model, else by its text; tier 1.5 in `kvExactMode` 1, tier
//!    2 minimum load) and the decode endpoint (the pin's, else minimum
//!    load); with no eligible prefill or decode endpoint a role-0 endpoint serves the request in
//!    one leg, and with none the answer is 503 `pd_pool_unavailable`;
//! 2. one request id in LoxiLB's form goes on both legs as `X-Request-Id`;
//! 3. prefill leg: the client's body rewritten for prefill, sent and read whole within
//!    `LLB_PD_PREFILL_TIMEOUT_SEC` (else 504 `pd_prefill_timeout`); a connect failure moves to
//!    the next prefill endpoint; a non-2xx answer is relayed to the client as it is (and feeds
//!    the breaker); a 2xx answer without `kv_transfer_params` is counted and the decode leg runs
//!    without them (the decode engine then recomputes the prompt);
//! 4. decode leg: the client's body with the prefill's `kv_transfer_params` verbatim, streamed
//!    back as the client asked; a connect failure moves to the next decode endpoint; a decode
//!    that took the request and sent nothing is 502 `pd_decode_backend_died`. The pin is set
//!    once the decode answered.
//!
//! Other requests of a P/D rule (`/v1/embeddings`, `/tokenize`, `/health`, `/v1/responses`,
//! non-JSON bodies) are one leg to the endpoint the rule's `sel` picks; `GET /v1/models` never
//! gets here (`models.rs` answers it for every pool of the listener). A client that goes away drops this future: the prefill
//! leg in flight is dropped with it (its connection closes), and a decode leg's body is dropped
//! with the response; the in-flight counts are guards, so they return to 0 either way.

use std::time::Instant;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use prometheus_client::metrics::gauge::Gauge;
use serde_json::Value;

use super::body::{ProxyBody, Tracked};
use super::error::{ProxyError, full};
use super::handler::{ENDPOINT_HEADER, Handler, downstream_response};
use super::pool::Pool;
use super::upstream::{Attempt, strip_hop_by_hop, upstream_request};
use crate::health::breaker::Outcome;
use crate::kv::route::select::KvTicket;
use crate::kv::wiring::KvTier;
use crate::pd::metrics::svc;
use crate::pd::{Choice, PdLadder, PdTier, Pin, handoff, trie};
use crate::request::{ApiKind, RequestMeta};
use crate::routing::{Candidates, Excluded};
use crate::rules::model::authority;
use crate::telemetry::span as trace_span;

/// Response header naming the prefill endpoint of a two-leg P/D request (the decode endpoint is
/// in `x-loxilb-endpoint`).
pub const PREFILL_ENDPOINT_HEADER: &str = "x-loxilb-prefill-endpoint";

/// Header carrying the request id on both legs.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

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

/// What the prefill leg ended with.
enum Prefill {
    /// 2xx: the transfer parameters, if the engine returned some.
    Done(Option<Value>),
    /// Non-2xx: relayed to the client.
    Refused(Response<ProxyBody>),
    /// The connection could not be made: try another prefill endpoint.
    ConnectFailed,
}

impl Handler {
    /// Serves one request of a P/D rule (see the module doc).
    pub(super) async fn forward_pd(
        &self,
        pool: &Pool,
        parts: Parts,
        body: Bytes,
        meta: &RequestMeta,
        start: Instant,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let two_leg = matches!(meta.api, ApiKind::Completions | ApiKind::ChatCompletions);
        // The legs carry the client's whole body, so it is parsed here in full (the routing
        // parse is bounded and may have cut a long prompt); `body` is already within
        // `max_body_bytes`.
        let full: Option<Value> = two_leg
            .then(|| serde_json::from_slice(&body).ok())
            .flatten();
        let (Some(spec), Some(state), Some(obj)) = (
            pool.rule.spec.pd.as_ref(),
            pool.pd.as_ref(),
            full.as_ref().and_then(Value::as_object),
        ) else {
            return self.forward(pool, parts, body, meta, start).await;
        };
        let service = pool.rule.id;
        let m = &self.ctx.metrics.pd;
        // Tier 1's key: token ids when a tokenizer is staged for the model, else the text.
        let trie_key = match (spec.trie, self.ctx.tier.as_deref()) {
            (None, _) => None,
            (Some(_), Some(t)) => {
                let tokens = t.prompt_tokens(meta, trie::KEY_MAX).await;
                trie::key_of(meta, tokens.as_deref())
            }
            (Some(_), None) => trie::key_of(meta, None),
        };
        let ladder: PdLadder<'_, KvTier> = PdLadder {
            rule: &pool.rule,
            pd: spec,
            state,
            tier: self.ctx.tier.as_deref(),
            key: trie_key.as_deref(),
        };
        let key = meta.pin_key();
        let pin = key.and_then(|k| state.pins.get(k));
        let mut ticket = KvTicket::default();
        let mut excluded = Excluded::default();
        let Some(mut dec) = ladder.decode(&cands(pool, &excluded), pin) else {
            return self
                .aggregated(pool, &ladder, parts, body, meta, start, "no_decode")
                .await;
        };
        let mut pre = match ladder.prefill(meta, &cands(pool, &excluded), pin, &mut ticket) {
            Some(c) => {
                m.trie_outcome(service, c.trie);
                c
            }
            None => {
                return self
                    .aggregated(pool, &ladder, parts, body, meta, start, "no_prefill")
                    .await;
            }
        };
        m.requests.get_or_create(&svc(service)).inc();
        let endpoints = &pool.rule.rule.endpoints;
        let rid = handoff::request_id(
            &authority(&endpoints[pre.ep].endpoint_ip, spec.nixl_ports[pre.ep]),
            &pool.authorities[dec.ep],
        );
        let rid_value =
            HeaderValue::from_str(&rid).map_err(|e| ProxyError::Internal(e.to_string()))?;
        let prefill_body = Bytes::from(
            serde_json::to_vec(&Value::Object(handoff::prefill_body(obj)))
                .map_err(|e| ProxyError::Internal(e.to_string()))?,
        );
        let params = loop {
            ladder.routed(meta, pre.ep, &mut ticket);
            match self
                .prefill_leg(pool, &parts, prefill_body.clone(), &rid_value, meta, pre.ep)
                .await?
            {
                Prefill::Done(p) => break p,
                Prefill::Refused(resp) => {
                    m.failure(service, "pd_prefill_status");
                    return Ok(resp);
                }
                Prefill::ConnectFailed => {
                    excluded.insert(pre.ep);
                    match ladder.prefill(meta, &cands(pool, &excluded), None, &mut ticket) {
                        Some(c) => {
                            m.trie_outcome(service, c.trie);
                            pre = c;
                        }
                        None => return Err(self.pool_unavailable(service, "no_prefill")),
                    }
                }
            }
        };
        count_choice(m, service, "prefill", pre);
        if pre.tier == PdTier::Session {
            m.session_hits.get_or_create(&svc(service)).inc();
        }
        if params.is_none() {
            m.params_missing.get_or_create(&svc(service)).inc();
            tracing::warn!(service, ep = pre.ep, request_id = %rid,
                "prefill answered without kv_transfer_params; the decode leg recomputes the prompt");
        }
        let decode_body = Bytes::from(
            serde_json::to_vec(&Value::Object(handoff::decode_body(obj, params.as_ref())))
                .map_err(|e| ProxyError::Internal(e.to_string()))?,
        );
        let mut attempts = 0;
        loop {
            attempts += 1;
            trace_span::record_decision("pd", dec.tier.as_str(), dec.ep, attempts);
            match self
                .decode_leg(
                    pool,
                    &parts,
                    decode_body.clone(),
                    &rid_value,
                    meta,
                    dec.ep,
                    start,
                )
                .await
            {
                Ok(mut resp) => {
                    count_choice(m, service, "decode", dec);
                    if let Some(k) = key {
                        state.pins.pin(
                            k,
                            Pin {
                                prefill: pre.ep,
                                decode: dec.ep,
                            },
                        );
                    }
                    resp.headers_mut()
                        .insert(PREFILL_ENDPOINT_HEADER, HeaderValue::from(pre.ep));
                    return Ok(resp);
                }
                Err(None) => {
                    excluded.insert(dec.ep);
                    match ladder.decode(&cands(pool, &excluded), None) {
                        Some(c) => dec = c,
                        None => return Err(self.pool_unavailable(service, "no_decode")),
                    }
                }
                Err(Some(e)) => {
                    m.failure(service, e.token());
                    return Err(e);
                }
            }
        }
    }

    /// Counts and builds 503 `pd_pool_unavailable`.
    fn pool_unavailable(&self, service: u32, reason: &'static str) -> ProxyError {
        self.ctx.metrics.pd.failure(service, "pd_pool_unavailable");
        ProxyError::PdPoolUnavailable { reason }
    }

    /// No prefill or no decode endpoint is eligible: one leg to a role-0 endpoint, else 503.
    #[allow(
        clippy::too_many_arguments,
        reason = "the request's parts travel together; a struct would only rename them"
    )]
    async fn aggregated(
        &self,
        pool: &Pool,
        ladder: &PdLadder<'_, KvTier>,
        parts: Parts,
        body: Bytes,
        meta: &RequestMeta,
        start: Instant,
        reason: &'static str,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let service = pool.rule.id;
        let excluded = Excluded::default();
        let Some(c) = ladder.aggregated(&cands(pool, &excluded)) else {
            return Err(self.pool_unavailable(service, reason));
        };
        count_choice(&self.ctx.metrics.pd, service, "prefill", c);
        trace_span::record_decision("pd", c.tier.as_str(), c.ep, 1);
        let pm = pool.metrics(&self.ctx.metrics);
        let slot = self.admit(pool, c.ep).await?;
        let tracked = Tracked::new(
            pool.loads[c.ep].begin(),
            pm.eps[c.ep].active.clone(),
            pm.duration.clone(),
            start,
        )
        .with_slot(slot);
        let mut req = upstream_request(&parts, &pool.authorities[c.ep], body)?;
        super::forwarded::append(req.headers_mut(), meta.client);
        match self.upstreams.send(req, pool.http2).await {
            Attempt::Response(resp) => {
                let end = self.end_accounting(pool, c.ep, resp.status());
                Ok(downstream_response(resp, c.ep, tracked.with_end(end)))
            }
            Attempt::ConnectFailed(e) => {
                tracing::warn!(service, ep = c.ep, error = %e, "upstream connect failed");
                pm.eps[c.ep].connect_failures.inc();
                self.observe(pool, c.ep, Outcome::ConnectFailed);
                Err(ProxyError::BackendUnreachable { attempts: 1 })
            }
            Attempt::Failed(source) => Err(ProxyError::Upstream {
                ep_idx: c.ep,
                source,
            }),
        }
    }

    /// The prefill leg on `ep`, bounded by the prefill timeout.
    async fn prefill_leg(
        &self,
        pool: &Pool,
        parts: &Parts,
        body: Bytes,
        rid: &HeaderValue,
        meta: &RequestMeta,
        ep: usize,
    ) -> Result<Prefill, ProxyError> {
        let service = pool.rule.id;
        let pm = pool.metrics(&self.ctx.metrics);
        // The prefill endpoint's admission slot, held for the leg (proxy/admission.rs).
        let _slot = self.admit(pool, ep).await?;
        let _load = pool.loads[ep].begin();
        let _active = ActiveGuard::new(pm.eps[ep].active.clone());
        let req = leg_request(parts, &pool.authorities[ep], body, rid, meta)?;
        let timeout = self.ctx.config.pd_prefill_timeout;
        let limit = self.ctx.config.max_body_bytes;
        let t0 = Instant::now();
        let leg = async {
            match self.upstreams.send(req, pool.http2).await {
                Attempt::Response(resp) => {
                    let (head, body) = resp.into_parts();
                    match Limited::new(body, limit).collect().await {
                        Ok(c) => Ok(Ok((head, c.to_bytes()))),
                        Err(e) => Ok(Err(e.to_string())),
                    }
                }
                Attempt::ConnectFailed(e) => {
                    tracing::warn!(service, ep, error = %e, "prefill connect failed; trying another prefill endpoint");
                    Err(None)
                }
                Attempt::Failed(source) => Err(Some(source)),
            }
        };
        let outcome = match tokio::time::timeout(timeout, leg).await {
            Ok(o) => o,
            Err(_) => {
                self.ctx.metrics.pd.failure(service, "pd_prefill_timeout");
                return Err(ProxyError::PdPrefillTimeout {
                    ep_idx: ep,
                    secs: timeout.as_secs(),
                });
            }
        };
        match outcome {
            Err(None) => {
                pm.eps[ep].connect_failures.inc();
                self.observe(pool, ep, Outcome::ConnectFailed);
                Ok(Prefill::ConnectFailed)
            }
            Err(Some(source)) => {
                self.observe(pool, ep, Outcome::StreamFailed);
                self.ctx.metrics.pd.failure(service, "pd_prefill_failed");
                Err(ProxyError::PdPrefillFailed {
                    ep_idx: ep,
                    message: source.to_string(),
                })
            }
            Ok(Err(message)) => {
                pm.stream_errors(ep).inc();
                self.observe(pool, ep, Outcome::StreamFailed);
                self.ctx.metrics.pd.failure(service, "pd_prefill_failed");
                Err(ProxyError::PdPrefillFailed {
                    ep_idx: ep,
                    message,
                })
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
                    pm.class_counter(ep, status).inc();
                    tracing::warn!(service, ep, %status, "prefill leg refused; relaying its answer");
                    return Ok(Prefill::Refused(relayed(head, bytes, ep)));
                }
                Ok(Prefill::Done(handoff::transfer_params(&bytes)))
            }
        }
    }

    /// The decode leg on `ep`: `Ok` with the streaming response, `Err(None)` on a connect
    /// failure (try another decode endpoint), `Err(Some(_))` when the request was sent and
    /// nothing came back.
    #[allow(
        clippy::too_many_arguments,
        reason = "the request's parts travel together; a struct would only rename them"
    )]
    async fn decode_leg(
        &self,
        pool: &Pool,
        parts: &Parts,
        body: Bytes,
        rid: &HeaderValue,
        meta: &RequestMeta,
        ep: usize,
        start: Instant,
    ) -> Result<Response<ProxyBody>, Option<ProxyError>> {
        let service = pool.rule.id;
        let pm = pool.metrics(&self.ctx.metrics);
        let tracked = Tracked::new(
            pool.loads[ep].begin(),
            pm.eps[ep].active.clone(),
            pm.duration.clone(),
            start,
        );
        let req = leg_request(parts, &pool.authorities[ep], body, rid, meta).map_err(Some)?;
        match self.upstreams.send(req, pool.http2).await {
            Attempt::Response(resp) => {
                self.ctx
                    .metrics
                    .pd
                    .decode_ttft
                    .get_or_create(&svc(service))
                    .observe(start.elapsed().as_secs_f64());
                let end = self.end_accounting(pool, ep, resp.status());
                Ok(downstream_response(resp, ep, tracked.with_end(end)))
            }
            Attempt::ConnectFailed(e) => {
                tracing::warn!(service, ep, error = %e, "decode connect failed; trying another decode endpoint");
                pm.eps[ep].connect_failures.inc();
                self.observe(pool, ep, Outcome::ConnectFailed);
                Err(None)
            }
            Attempt::Failed(source) => {
                pm.class_counter(ep, StatusCode::BAD_GATEWAY).inc();
                self.observe(pool, ep, Outcome::StreamFailed);
                Err(Some(ProxyError::PdDecodeDied { ep_idx: ep, source }))
            }
        }
    }
}

/// A leg's upstream request: the client's head (hop-by-hop headers stripped, the length left
/// to the new body), `X-Forwarded-For`, the request id, and the trace context.
fn leg_request(
    parts: &Parts,
    authority: &str,
    body: Bytes,
    rid: &HeaderValue,
    meta: &RequestMeta,
) -> Result<Request<Full<Bytes>>, ProxyError> {
    let mut req = upstream_request(parts, authority, body)?;
    let h = req.headers_mut();
    h.remove(header::CONTENT_LENGTH);
    h.remove(header::ACCEPT_ENCODING);
    h.insert(REQUEST_ID_HEADER, rid.clone());
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    super::forwarded::append(h, meta.client);
    trace_span::inject(&tracing::Span::current(), h);
    Ok(req)
}

/// A refused prefill answer as the client's response.
fn relayed(mut head: http::response::Parts, bytes: Bytes, ep: usize) -> Response<ProxyBody> {
    strip_hop_by_hop(&mut head.headers);
    head.headers.remove(header::CONTENT_LENGTH);
    head.headers.insert(ENDPOINT_HEADER, HeaderValue::from(ep));
    Response::from_parts(head, full(bytes))
}

/// The pool's endpoints as candidates, minus `excluded`.
fn cands<'a>(pool: &'a Pool, excluded: &'a Excluded) -> Candidates<'a> {
    Candidates {
        weights: &pool.weights,
        loads: &pool.loads,
        excluded,
    }
}

fn count_choice(m: &crate::pd::PdMetrics, service: u32, leg: &str, c: Choice) {
    m.tier(service, leg, c.tier).inc();
}
