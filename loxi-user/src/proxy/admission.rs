//! The per-endpoint admission gate on the request path (`LLB_PD_MAX_INFLIGHT_PER_EP`,
//! `LLB_PD_QUEUE_DEPTH_PER_EP`, `LLB_PD_MAX_PARK_SEC`; the gate itself is
//! [`crate::routing::admission`]).
//!
//! Where it applies ([`crate::routing::admission::AdmissionSettings::applies`]): P/D rules by
//! default, every mode-4 rule with `LOXI_ADMISSION_SCOPE=all`. The ladder picks the endpoint
//! first; the request then takes a slot of that endpoint's gate, or parks in its FIFO:
//! - the prefill leg of a two-leg P/D request holds the prefill endpoint's slot until the
//!   prefill answer is read (LoxiLB: "per-endpoint in-flight prefill cap"); the decode leg is
//!   not gated;
//! - a one-leg request (single pool under `all`, a P/D rule's role-0 fallback or non-generation
//!   request) holds its endpoint's slot until its response body ends.
//!
//! Answers: queue full → 429 `pd_overloaded` + `Retry-After: 1`
//! (`loxilb_pd_admission_shed_total{reason="ep_queue_full"}`); parked past the deadline → 504
//! `pd_admission_timeout` (`reason="park_timeout"`); gate closed while parked (endpoint or rule
//! removed, daemon stopping) → 503 `pd_admission_closed` + `Retry-After: 1` (`reason="closed"`).
//! Every park counts in `loxilb_pd_admission_queued_total{service}` and, while it lasts, in
//! `loxilb_pd_admission_parked{service}` and the endpoint's `queued` load (which the P/D tier-2
//! minimum load reads). A client that goes away while parked drops the wait: the request
//! leaves the queue and both gauges fall back.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::metrics::gauge::Gauge;

use super::error::ProxyError;
use super::handler::Handler;
use super::metrics::ServiceLabels;
use super::pool::Pool;
use crate::routing::EndpointLoad;
use crate::routing::admission::{Entry, Refusal, Slot};

/// Counts one parked request in the service gauge and the endpoint's `queued` load until
/// dropped.
struct ParkedGuard {
    gauge: Gauge,
    load: Arc<EndpointLoad>,
}

impl ParkedGuard {
    fn new(gauge: Gauge, load: Arc<EndpointLoad>) -> Self {
        gauge.inc();
        load.queued.fetch_add(1, Ordering::Relaxed);
        Self { gauge, load }
    }
}

impl Drop for ParkedGuard {
    fn drop(&mut self) {
        self.gauge.dec();
        self.load.queued.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Handler {
    /// Passes endpoint `ep`'s admission gate (see the module doc): `Ok(None)` when the gate
    /// does not apply to the pool's rule, `Ok(Some(slot))` once admitted (at once or after
    /// parking; the caller holds the slot for the gated span), else the error to answer.
    pub(super) async fn admit(&self, pool: &Pool, ep: usize) -> Result<Option<Slot>, ProxyError> {
        let a = self.ctx.config.admission;
        if !a.applies(pool.rule.spec.pd.is_some()) {
            return Ok(None);
        }
        let Some(gate) = pool.gates.get(ep) else {
            return Ok(None);
        };
        let parked = match gate.enter(a.max_inflight, a.queue_depth) {
            Ok(Entry::Admitted(slot)) => return Ok(Some(slot)),
            Ok(Entry::Parked(p)) => p,
            Err(r) => return Err(self.refused(pool, ep, r)),
        };
        let m = &self.ctx.metrics;
        let svc = ServiceLabels {
            service: pool.rule.id.to_string(),
        };
        m.admission_queued.get_or_create(&svc).inc();
        let _counted = ParkedGuard::new(
            m.admission_parked.get_or_create(&svc).clone(),
            pool.loads[ep].clone(),
        );
        tracing::debug!(
            service = pool.rule.id,
            ep,
            "endpoint at its admission cap; parked"
        );
        parked
            .wait(a.max_park)
            .await
            .map(Some)
            .map_err(|r| self.refused(pool, ep, r))
    }

    /// Counts a refusal and builds its answer.
    fn refused(&self, pool: &Pool, ep: usize, r: Refusal) -> ProxyError {
        let a = self.ctx.config.admission;
        let (reason, e) = match r {
            Refusal::Full => (
                "ep_queue_full",
                ProxyError::EndpointOverloaded {
                    ep_idx: ep,
                    limit: a.max_inflight,
                    depth: a.queue_depth,
                },
            ),
            Refusal::TimedOut => (
                "park_timeout",
                ProxyError::AdmissionTimeout {
                    ep_idx: ep,
                    secs: a.max_park.as_secs(),
                },
            ),
            Refusal::Closed(why) => (
                "closed",
                ProxyError::AdmissionClosed {
                    ep_idx: ep,
                    reason: why.as_str(),
                },
            ),
        };
        tracing::debug!(service = pool.rule.id, ep, reason, "admission refused");
        self.ctx.metrics.shed(reason);
        e
    }
}
