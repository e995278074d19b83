//! The two legs of a P/D request (`pd_disagg_mode: true`). The dialect (`kvEngineType`) says
//! how the legs are built and ordered: [`crate::pd::handoff`] (vLLM) and
//! [`crate::pd::dialect`] (SGLang, TensorRT-LLM) build the bodies and say where each field was
//! checked; `pd_legs.rs` runs one leg, `pd_dialects.rs` the SGLang pair and TensorRT-LLM's
//! early answer.
//!
//! For a JSON `/v1/completions` or `/v1/chat/completions` request:
//! 0. a body carrying a field the gateway sets for the rule's dialect
//!    ([`crate::pd::dialect::gateway_fields`]) is refused, 400 `pd_handoff_field`;
//! 1. the P/D ladder ([`crate::pd::PdLadder`]) picks the prefill endpoint (tier 0 pin, tier 1
//!    trie, tier 1.5 in `kvExactMode` 1, tier 2 weighted least load) and the decode endpoint
//!    (the pin's, else weighted least load); with no eligible prefill or decode endpoint (or
//!    when every one refused the connection, below) a role-0 endpoint serves the request in
//!    one leg, and with none the answer is 503 `pd_pool_unavailable`;
//! 2. one request id in LoxiLB's form goes on both legs as `X-Request-Id`;
//! 3. vLLM and TensorRT-LLM: the prefill (context) leg first, sent and read whole within
//!    `LLB_PD_PREFILL_TIMEOUT_SEC` (else 504 `pd_prefill_timeout`); a connect failure moves to
//!    the next prefill endpoint; a non-2xx answer is relayed to the client as it is (and feeds
//!    the breaker); the answer's transfer parameters (vLLM `kv_transfer_params`, TensorRT-LLM
//!    `choices[0].disaggregated_params`) go verbatim into the decode leg, and an answer
//!    without them is counted and the decode leg runs without them (the engine then
//!    recomputes the prompt); a TensorRT-LLM context leg that already finished the request is
//!    the answer, with no decode leg. SGLang: both legs at once, see `pd_dialects.rs`;
//! 4. decode leg: streamed back as the client asked once its first body byte arrived, within
//!    `LLB_PD_DECODE_TIMEOUT_SEC` of when it can start (else 504 `pd_decode_timeout`); a
//!    connect failure moves to the next decode endpoint; a decode that took the request and
//!    closed or failed before its first byte is 502 `pd_decode_backend_died`. The pin is set
//!    once the decode answered.
//!
//! Other requests of a P/D rule (`/v1/embeddings`, `/tokenize`, `/health`, `/v1/responses`,
//! non-JSON bodies) are one leg to the endpoint the rule's `sel` picks; `GET /v1/models` never
//! gets here (`models.rs` answers it for every pool of the listener). A client that goes away
//! drops this future: every leg in flight is dropped with it (its connection closes), and a
//! decode leg's body is dropped with the response; the in-flight counts are guards, so they
//! return to 0 either way.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Response};
use parking_lot::Mutex;
use serde_json::Value;
use tracing::Instrument;

use super::body::{ProxyBody, Tracked};
use super::error::ProxyError;
use super::handler::{Handler, downstream_response};
use super::pd_legs::{Legs, Prefill};
pub use super::pd_legs::{PREFILL_ENDPOINT_HEADER, REQUEST_ID_HEADER};
use super::pool::Pool;
use super::upstream::{Attempt, upstream_request};
use crate::health::breaker::Outcome;
use crate::kv::route::select::KvTicket;
use crate::kv::wiring::KvTier;
use crate::pd::dialect::{self, trtllm};
use crate::pd::metrics::svc;
use crate::pd::{Choice, PdLadder, PdState, PdTier, Pin, handoff, trie};
use crate::request::{ApiKind, RequestMeta};
use crate::routing::{Candidates, Excluded};
use crate::rules::spec::Dialect;
use crate::telemetry::span as trace_span;

/// The endpoints a P/D request is on and how it got there.
pub(super) struct Pair<'a> {
    /// The ladder of the request's rule.
    pub ladder: PdLadder<'a, KvTier>,
    /// The tier-1.5 ticket of the prefill pick.
    pub ticket: KvTicket,
    /// Endpoints that failed to connect during this request.
    pub excluded: Excluded,
    /// The prefill choice.
    pub pre: Choice,
    /// The decode choice.
    pub dec: Choice,
    /// The request's pin key, if any.
    pub key: Option<&'a str>,
    /// Decode legs tried so far, every dialect (the trace's attempt number).
    pub dec_attempts: usize,
}

impl Pair<'_> {
    /// Moves the prefill leg off `ep` after a connect failure; `false` when none is left.
    pub fn next_prefill(&mut self, pool: &Pool, meta: &RequestMeta, ep: usize) -> bool {
        self.excluded.insert(ep);
        match self
            .ladder
            .prefill(meta, &cands(pool, &self.excluded), None, &mut self.ticket)
        {
            Some(c) => {
                self.pre = c;
                true
            }
            None => false,
        }
    }

    /// Moves the decode leg off `ep` after a connect failure; `false` when none is left.
    pub fn next_decode(&mut self, pool: &Pool, ep: usize) -> bool {
        self.excluded.insert(ep);
        match self.ladder.decode(&cands(pool, &self.excluded), None) {
            Some(c) => {
                self.dec = c;
                true
            }
            None => false,
        }
    }
}

impl Handler {
    /// Serves one request of a P/D rule (see the module doc).
    pub(super) async fn forward_pd(
        &self,
        pool: &Arc<Pool>,
        mut parts: Parts,
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
            return self.forward(pool, &mut parts, body, meta, start).await;
        };
        let service = pool.rule.id;
        // A field the gateway sets for the handoff is the gateway's alone: a client's value
        // would tell the decode engine where to pull KV from (a role-0 fallback refuses it
        // too, so the answer does not depend on which endpoints are up).
        if let Some(field) = dialect::client_handoff_field(spec.dialect, obj) {
            tracing::debug!(
                service,
                field,
                "P/D request carries a handoff field; refused"
            );
            return Err(ProxyError::PdHandoffField { field });
        }
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
        ladder.prepare(meta, &mut ticket).await;
        let excluded = Excluded::default();
        let Some(dec) = ladder.decode(&cands(pool, &excluded), pin) else {
            return self
                .aggregated(pool, &ladder, parts, body, meta, start, "no_decode")
                .await;
        };
        let Some(pre) = ladder.prefill(meta, &cands(pool, &excluded), pin, &mut ticket) else {
            return self
                .aggregated(pool, &ladder, parts, body, meta, start, "no_prefill")
                .await;
        };
        m.trie_outcome(service, pre.trie);
        m.requests.get_or_create(&svc(service)).inc();
        let legs = Legs {
            pool,
            parts: &parts,
            meta,
            obj,
            rid: Mutex::new(Legs::request_id(pool, pre.ep, dec.ep)?),
            reached: Mutex::new(None),
            start,
        };
        let mut pair = Pair {
            ladder,
            ticket,
            excluded,
            pre,
            dec,
            key,
            dec_attempts: 0,
        };
        let resp = match spec.dialect {
            Dialect::Sglang { bootstrap_port } => {
                match self.sglang_legs(&legs, &mut pair, bootstrap_port).await {
                    Ok(SglangEnd::Relayed(resp)) => return Ok(resp),
                    Ok(SglangEnd::Served(resp)) => Ok(resp),
                    Err(e) => Err(e),
                }
            }
            // A decode endpoint that refused the connection after the prefill ran: the pair
            // is renewed (request id naming the next decode) and the prefill leg runs again
            // for it, as SGLang's pair does: vLLM's P2P connector pushed the first prefill's
            // KV to the refused decode's address.
            Dialect::Vllm | Dialect::Trtllm => loop {
                match self.prefill_first(&legs, &mut pair, spec.dialect).await {
                    Ok(Sequential::Answer(resp)) => return Ok(resp),
                    Ok(Sequential::Decode(body)) => {
                        match self.decode_legs(&legs, &mut pair, body).await {
                            Ok(Some(resp)) => break Ok(resp),
                            Ok(None) => {}
                            Err(e) => break Err(e),
                        }
                    }
                    Err(e) => break Err(e),
                }
            },
        };
        match resp {
            Ok(resp) => Ok(self.served(&legs, &pair, state, resp)),
            // Every prefill (or decode) endpoint refused the connection: the request is served
            // in one leg by a role-0 endpoint if the rule has one, as when none was eligible
            // to begin with (a finished prefill's work is lost; the role-0 endpoint recomputes).
            // Without one, the 503 carries the request id of the last leg that may have
            // reached an engine and the prefill endpoint last tried, as a failed leg's answer
            // does (neither when no leg did).
            Err(ProxyError::PdPoolUnavailable { reason }) => {
                let (reached, pre) = (legs.reached(), pair.pre.ep);
                drop(legs);
                match self
                    .aggregated(pool, &pair.ladder, parts, body, meta, start, reason)
                    .await
                {
                    Err(e @ ProxyError::PdPoolUnavailable { .. }) => {
                        let mut resp = self.error_response(service, e);
                        if let Some(rid) = reached {
                            let h = resp.headers_mut();
                            h.insert(REQUEST_ID_HEADER, rid);
                            h.insert(PREFILL_ENDPOINT_HEADER, HeaderValue::from(pre));
                        }
                        Ok(resp)
                    }
                    other => other,
                }
            }
            Err(e) => Ok(self.leg_failed(&legs, &pair, e)),
        }
    }

    /// The error answer of a failed leg (502/504 `pd_*`), counted as the handler counts an
    /// error, and carrying the request id both legs were sent with and the endpoints involved
    /// (`x-loxilb-prefill-endpoint`, and `x-loxilb-endpoint` for a decode failure) so that the
    /// failing pair can be found in the engines' logs.
    fn leg_failed(&self, legs: &Legs<'_>, pair: &Pair<'_>, e: ProxyError) -> Response<ProxyBody> {
        let decode = match &e {
            ProxyError::PdDecodeDied { ep_idx, .. }
            | ProxyError::PdDecodeTimeout { ep_idx, .. } => Some(*ep_idx),
            _ => None,
        };
        let mut resp = self.error_response(legs.pool.rule.id, e);
        // The id of the last leg that may have reached an engine (none: nothing was sent,
        // e.g. the gate refused the first prefill leg, and no endpoint is named).
        let Some(rid) = legs.reached() else {
            return resp;
        };
        trace_span::record_prefill(pair.pre.ep);
        let h = resp.headers_mut();
        h.insert(REQUEST_ID_HEADER, rid);
        h.insert(PREFILL_ENDPOINT_HEADER, HeaderValue::from(pair.pre.ep));
        if let Some(ep) = decode {
            h.insert(super::handler::ENDPOINT_HEADER, HeaderValue::from(ep));
        }
        resp
    }

    /// The prefill (context) leg of the vLLM and TensorRT-LLM dialects, moving to another
    /// prefill endpoint on a connect failure, and the decode leg's body it leads to.
    async fn prefill_first(
        &self,
        legs: &Legs<'_>,
        pair: &mut Pair<'_>,
        dialect: Dialect,
    ) -> Result<Sequential, ProxyError> {
        let (pool, service) = (legs.pool, legs.pool.rule.id);
        let m = &self.ctx.metrics.pd;
        let body = Legs::encode(match dialect {
            Dialect::Trtllm => trtllm::context_body(legs.obj),
            _ => handoff::prefill_body(legs.obj),
        })?;
        let bytes = loop {
            pair.ladder.routed(legs.meta, pair.pre.ep, &mut pair.ticket);
            match self.prefill_leg(legs, body.clone(), pair.pre.ep).await? {
                Prefill::Done(b) => break b,
                Prefill::Refused(resp) => {
                    m.failure(service, "pd_prefill_status");
                    return Ok(Sequential::Answer(resp));
                }
                Prefill::ConnectFailed => {
                    if !pair.next_prefill(pool, legs.meta, pair.pre.ep) {
                        return Err(ProxyError::PdPoolUnavailable {
                            reason: "no_prefill",
                        });
                    }
                    legs.renew_rid(pair.pre.ep, pair.dec.ep)?;
                    m.trie_outcome(service, pair.pre.trie);
                }
            }
        };
        self.prefill_served(legs, pair);
        let params = match dialect {
            Dialect::Trtllm => match trtllm::next(&bytes) {
                trtllm::Next::Generate(p) => p,
                trtllm::Next::Finished(v) => {
                    return Ok(Sequential::Answer(self.context_finished(legs, pair, &v)));
                }
            },
            _ => handoff::transfer_params(&bytes),
        };
        if params.is_none() {
            m.params_missing.get_or_create(&svc(service)).inc();
            tracing::warn!(service, ep = pair.pre.ep, request_id = ?legs.rid(),
                "prefill answered without transfer parameters; the decode leg recomputes the prompt");
        }
        let p = params.as_ref();
        Ok(Sequential::Decode(Legs::encode(match dialect {
            Dialect::Trtllm => trtllm::generation_body(legs.obj, p),
            _ => handoff::decode_body(legs.obj, p),
        })?))
    }

    /// The decode leg after the prefill: `Ok(Some)` its answer; `Ok(None)` when the decode
    /// endpoint refused the connection and the pair moved to the next decode endpoint (with a
    /// new request id: the caller runs the prefill again for it); 503 `no_decode` when none
    /// is left.
    async fn decode_legs(
        &self,
        legs: &Legs<'_>,
        pair: &mut Pair<'_>,
        body: Bytes,
    ) -> Result<Option<Response<ProxyBody>>, ProxyError> {
        let ep = pair.dec.ep;
        pair.dec_attempts += 1;
        trace_span::record_decision("pd", pair.dec.tier.as_str(), ep, pair.dec_attempts);
        let leg = self.decode_leg(legs, body, ep);
        match self.decode_within(legs, ep, leg).await {
            Ok(resp) => Ok(Some(resp)),
            Err(None) => {
                if !pair.next_decode(legs.pool, ep) {
                    return Err(ProxyError::PdPoolUnavailable {
                        reason: "no_decode",
                    });
                }
                legs.renew_rid(pair.pre.ep, pair.dec.ep)?;
                Ok(None)
            }
            Err(Some(e)) => Err(e),
        }
    }

    /// Counts the prefill choice (and a tier-0 hit) once its leg answered 2xx.
    pub(super) fn prefill_served(&self, legs: &Legs<'_>, pair: &Pair<'_>) {
        let (m, service) = (&self.ctx.metrics.pd, legs.pool.rule.id);
        count_choice(m, service, "prefill", pair.pre);
        if pair.pre.tier == PdTier::Session {
            m.session_hits.get_or_create(&svc(service)).inc();
        }
    }

    /// Counts the decode choice of a served two-leg request, pins its pair, names the prefill
    /// endpoint and the request id both legs carried.
    fn served(
        &self,
        legs: &Legs<'_>,
        pair: &Pair<'_>,
        state: &PdState,
        mut resp: Response<ProxyBody>,
    ) -> Response<ProxyBody> {
        let (m, service) = (&self.ctx.metrics.pd, legs.pool.rule.id);
        count_choice(m, service, "decode", pair.dec);
        if let Some(k) = pair.key {
            state.pins.pin(
                k,
                Pin {
                    prefill: pair.pre.ep,
                    decode: pair.dec.ep,
                },
            );
        }
        trace_span::record_prefill(pair.pre.ep);
        let h = resp.headers_mut();
        h.insert(PREFILL_ENDPOINT_HEADER, HeaderValue::from(pair.pre.ep));
        h.insert(REQUEST_ID_HEADER, legs.rid());
        resp
    }

    /// Counts and builds 503 `pd_pool_unavailable`.
    pub(super) fn pool_unavailable(&self, service: u32, reason: &'static str) -> ProxyError {
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
        pool: &Arc<Pool>,
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
            pool,
            c.ep,
            &self.ctx.metrics,
            start,
        )
        .with_slot(slot);
        let mut req = upstream_request(&parts, &pool.authorities[c.ep], body)?;
        super::forwarded::append(req.headers_mut(), meta.client, meta.https);
        // One attempt span, as a plain rule's: its context replaces the client's traceparent.
        let span = trace_span::attempt(c.ep, &pool.authorities[c.ep], 1);
        trace_span::inject(&span, req.headers_mut());
        let sent = self
            .upstreams
            .send(req, &pool.via)
            .instrument(span.clone())
            .await;
        match sent {
            Attempt::Response(resp) => {
                trace_span::record_attempt(&span, Some(resp.status()), None);
                let end = self.end_accounting(resp.status());
                Ok(downstream_response(resp, c.ep, tracked.with_end(end)))
            }
            Attempt::ConnectFailed(e) => {
                trace_span::record_attempt(&span, None, Some("connect"));
                tracing::warn!(service, ep = c.ep, error = %e, "upstream connect failed");
                pm.eps[c.ep].connect_failures.inc();
                self.observe(pool, c.ep, Outcome::ConnectFailed);
                Err(ProxyError::BackendUnreachable {
                    attempts: 1,
                    last: e,
                })
            }
            Attempt::NoLocalResources(s) => {
                self.ctx.metrics.local_shortage(service, &s);
                Err(ProxyError::LocalResources(s))
            }
            Attempt::Failed(source) => {
                trace_span::record_attempt(&span, None, Some("request"));
                Err(self.answered_failure(
                    pool,
                    start,
                    ProxyError::Upstream {
                        ep_idx: c.ep,
                        source,
                    },
                ))
            }
        }
    }
}

/// How the SGLang pair ended (`pd_dialects.rs`).
pub(super) enum SglangEnd {
    /// The decode's answer: the pair served the request (pinned, its decode choice counted).
    Served(Response<ProxyBody>),
    /// The prefill's refusal, relayed (`pd_prefill_status`): no pair served it, so nothing is
    /// pinned or counted as a decode choice, as for the sequential dialects.
    Relayed(Response<ProxyBody>),
}

/// Where the prefill leg of a sequential dialect led.
enum Sequential {
    /// The client's answer already (a relayed refusal, or a finished TensorRT-LLM context).
    Answer(Response<ProxyBody>),
    /// The decode leg's body.
    Decode(Bytes),
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
