//! The SGLang leg pair and TensorRT-LLM's early answer (the bodies are built in
//! [`crate::pd::dialect`], where the engines' own code that was checked is cited).
//!
//! SGLang (`kvEngineType: sglang`): one body for both legs (the client's plus
//! `bootstrap_host` = the prefill endpoint's IP, `bootstrap_port` = `pdBootstrapPort`,
//! `bootstrap_room` = a fresh random 63-bit integer), sent to the prefill and the decode
//! endpoint at once, as SGLang's mini load balancer and router do. Then:
//! - the prefill is read whole within `LLB_PD_PREFILL_TIMEOUT_SEC` (its body is discarded);
//!   a non-2xx prefill answer (a 4xx for a request the engine refuses) is relayed to the
//!   client verbatim and the decode leg is aborted; a prefill that times out (504
//!   `pd_prefill_timeout`) or fails (502 `pd_prefill_failed`) aborts the decode leg too;
//! - the decode's answer is the client's, once the prefill answered 2xx and the decode sent
//!   its first body byte, within `LLB_PD_DECODE_TIMEOUT_SEC` of the prefill's answer (504
//!   `pd_decode_timeout`); a decode that fails or answers non-2xx first aborts the prefill
//!   leg (502 `pd_decode_backend_died`, or its answer relayed);
//! - a connect failure on either leg aborts the other and runs the pair again on another
//!   endpoint of that role, with a new room.
//!
//! Aborting a leg is dropping its future: the connection closes, so the engine sees the
//! client go away and frees the request.

use std::pin::pin;

use http::{HeaderValue, Response, header};

use super::body::ProxyBody;
use super::error::{ProxyError, full};
use super::pd::{PREFILL_ENDPOINT_HEADER, Pair, SglangEnd};
use super::pd_legs::{Legs, Prefill, REQUEST_ID_HEADER};
use crate::pd::dialect::{sglang, trtllm};
use crate::request::ApiKind;
use crate::telemetry::span as trace_span;

/// Which leg of the SGLang pair ended first.
enum First<P, D> {
    Prefill(P),
    Decode(D),
}

impl super::handler::Handler {
    /// The SGLang pair (see the module doc).
    pub(super) async fn sglang_legs(
        &self,
        legs: &Legs<'_>,
        pair: &mut Pair<'_>,
        bootstrap_port: u16,
    ) -> Result<SglangEnd, ProxyError> {
        let (pool, service) = (legs.pool, legs.pool.rule.id);
        let m = &self.ctx.metrics.pd;
        loop {
            // One decode leg a round, counted where the sequential dialects count theirs.
            pair.dec_attempts += 1;
            let attempts = pair.dec_attempts;
            let (pre, dec) = (pair.pre.ep, pair.dec.ep);
            if attempts > 1 {
                // A connect failure moved a leg: the pair's request id names the new pair.
                legs.renew_rid(pre, dec)?;
            }
            let ip = &pool.rule.rule.endpoints[pre].endpoint_ip;
            let boot = sglang::Bootstrap::new(ip, bootstrap_port);
            let body = Legs::encode(sglang::leg_body(legs.obj, &boot))?;
            pair.ladder.routed(legs.meta, pre, &mut pair.ticket);
            trace_span::record_decision("pd", pair.dec.tier.as_str(), dec, attempts);
            let mut p = pin!(self.prefill_leg(legs, body.clone(), pre));
            let mut d = pin!(self.decode_leg(legs, body, dec));
            let first = tokio::select! {
                r = &mut p => First::Prefill(r),
                r = &mut d => First::Decode(r),
            };
            match first {
                First::Prefill(r) => match r? {
                    Prefill::Done(_) => {
                        self.prefill_served(legs, pair);
                        match self.decode_within(legs, dec, d).await {
                            Ok(resp) => return Ok(SglangEnd::Served(resp)),
                            Err(Some(e)) => return Err(e),
                            Err(None) if pair.next_decode(pool, dec) => {}
                            Err(None) => {
                                return Err(ProxyError::PdPoolUnavailable {
                                    reason: "no_decode",
                                });
                            }
                        }
                    }
                    Prefill::Refused(resp) => {
                        m.failure(service, "pd_prefill_status");
                        return Ok(SglangEnd::Relayed(resp));
                    }
                    Prefill::ConnectFailed if pair.next_prefill(pool, legs.meta, pre) => {
                        m.trie_outcome(service, pair.pre.trie);
                    }
                    Prefill::ConnectFailed => {
                        return Err(ProxyError::PdPoolUnavailable {
                            reason: "no_prefill",
                        });
                    }
                },
                First::Decode(Ok(resp)) if resp.status().is_success() => {
                    // The decode sent its first byte before the prefill answered: the
                    // prefill's answer still decides.
                    match p.await? {
                        Prefill::Done(_) => {
                            self.prefill_served(legs, pair);
                            return Ok(SglangEnd::Served(resp));
                        }
                        Prefill::Refused(refused) => {
                            m.failure(service, "pd_prefill_status");
                            return Ok(SglangEnd::Relayed(refused));
                        }
                        Prefill::ConnectFailed => {
                            return Err(ProxyError::BackendUnreachable {
                                attempts,
                                last: "the prefill endpoint refused the connection (logged)".into(),
                            });
                        }
                    }
                }
                First::Decode(Ok(refused)) => return Ok(SglangEnd::Served(refused)),
                First::Decode(Err(Some(e))) => return Err(e),
                First::Decode(Err(None)) if pair.next_decode(pool, dec) => {}
                First::Decode(Err(None)) => {
                    return Err(ProxyError::PdPoolUnavailable {
                        reason: "no_decode",
                    });
                }
            }
        }
    }

    /// A TensorRT-LLM context leg that already finished the request: its answer (without
    /// `disaggregated_params`) is the client's, as one SSE chunk and `[DONE]` when the client
    /// asked for a stream, with the request id the context leg carried and the prefill
    /// (context) endpoint in `x-loxilb-prefill-endpoint`; no decode ran, so it has no
    /// `x-loxilb-endpoint` (which names the decode on a P/D answer).
    pub(super) fn context_finished(
        &self,
        legs: &Legs<'_>,
        pair: &Pair<'_>,
        finished: &serde_json::Value,
    ) -> Response<ProxyBody> {
        let stream = legs.obj.get("stream").and_then(serde_json::Value::as_bool) == Some(true);
        let (bytes, ctype) = if stream {
            let chat = legs.meta.api == ApiKind::ChatCompletions;
            (trtllm::finished_stream(finished, chat), "text/event-stream")
        } else {
            (finished.to_string().into_bytes(), "application/json")
        };
        let mut resp = Response::new(full(bytes::Bytes::from(bytes)));
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
        h.insert(REQUEST_ID_HEADER, legs.rid());
        h.insert(PREFILL_ENDPOINT_HEADER, HeaderValue::from(pair.pre.ep));
        tracing::debug!(
            service = legs.pool.rule.id,
            ep = pair.pre.ep,
            "the context leg finished the request; no generation leg"
        );
        resp
    }
}
