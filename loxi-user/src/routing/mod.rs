//! Endpoint selection for the fullproxy: one selector per file, each a pure function over an
//! immutable endpoint view that returns a [`Decision`] with a [`Reason`].
//!
//! The selection ladder ([`ladder`]: affinity tiers first, then the rule's `sel`) and the seam
//! an affinity tier implements ([`tier`]) live here too, with the shared vocabulary used by the
//! proxy and the KV tier: endpoint indices, load counters with RAII guards, the candidate set
//! with its exclusion mask, and decisions. The per-endpoint admission gate ([`admission`]) sits
//! beside them: it is taken after the selection, for the chosen endpoint.

pub mod admission;
pub mod chwbl;
pub mod dispatch;
pub mod gpu_aware;
pub mod hash;
pub mod key;
pub mod ladder;
pub mod lc;
pub mod persist;
pub mod ring;
pub mod rr;
pub mod state;
#[cfg(test)]
mod test_util;
pub mod tier;
pub mod wrr;
pub mod wrr_hash;

pub use dispatch::select;
pub use ladder::{Ladder, Step};
pub use state::SelectorState;
pub use tier::AffinityTier;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Index of an endpoint in the rule's `endpoints` list, in the order the user gave them.
pub type EpIdx = usize;

/// Why a selector (or tier) chose what it chose, or why it chose nothing.
/// [`Reason::as_str`] is the `reason` metric label; tests assert on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Round-robin turn.
    RoundRobin,
    /// Tuple / client-address hash.
    Hash,
    /// Smooth weighted round-robin turn.
    WeightedRoundRobin,
    /// Persist: the session key's owner.
    Persist,
    /// Least in-flight requests.
    LeastConnections,
    /// CHWBL ring owner for a prefix key.
    RingPrefix,
    /// CHWBL ring owner for a conversation / session key.
    RingConversation,
    /// CHWBL / wrr-hash ring owner for a fallback (round-robin derived) key.
    RingFallback,
    /// Bounded-load spill: the ring owner was over its cap, the walk moved on.
    RingSpill,
    /// GPU-aware modulo placement.
    Modulo,
    /// KV tier 1.5 chose the endpoint with the longest cached prefix.
    KvOverlap,
    /// KV tier 1.5 spilled an over-cap overlap owner.
    KvSpill,
    /// KV tier 1.5 diverted a hit to seed a cold endpoint.
    KvColdSeed,
    /// KV tier 1.5 placed a request no endpoint holds a prefix of on the endpoint with the
    /// least prefill wait (loxi extension, `LOXI_KV_COLD_PLACEMENT`).
    KvColdPlace,
    /// No endpoint is eligible (all unhealthy or excluded).
    NoHealthyEndpoint,
}

impl Reason {
    /// Every reason, in declaration order.
    pub const ALL: [Reason; 15] = [
        Reason::RoundRobin,
        Reason::Hash,
        Reason::WeightedRoundRobin,
        Reason::Persist,
        Reason::LeastConnections,
        Reason::RingPrefix,
        Reason::RingConversation,
        Reason::RingFallback,
        Reason::RingSpill,
        Reason::Modulo,
        Reason::KvOverlap,
        Reason::KvSpill,
        Reason::KvColdSeed,
        Reason::KvColdPlace,
        Reason::NoHealthyEndpoint,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RoundRobin => "rr",
            Reason::Hash => "hash",
            Reason::WeightedRoundRobin => "wrr",
            Reason::Persist => "persist",
            Reason::LeastConnections => "lc",
            Reason::RingPrefix => "ring_prefix",
            Reason::RingConversation => "ring_conversation",
            Reason::RingFallback => "ring_fallback",
            Reason::RingSpill => "ring_spill",
            Reason::Modulo => "modulo",
            Reason::KvOverlap => "kv_overlap",
            Reason::KvSpill => "kv_spill",
            Reason::KvColdSeed => "kv_cold_seed",
            Reason::KvColdPlace => "kv_cold_place",
            Reason::NoHealthyEndpoint => "no_healthy_endpoint",
        }
    }
}

/// The outcome of a selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The chosen endpoint, or `None` when nothing is eligible.
    pub endpoint: Option<EpIdx>,
    /// Why.
    pub reason: Reason,
}

impl Decision {
    /// A decision for `ep`.
    pub fn pick(ep: EpIdx, reason: Reason) -> Self {
        Self {
            endpoint: Some(ep),
            reason,
        }
    }
    /// Nothing eligible.
    pub fn none() -> Self {
        Self {
            endpoint: None,
            reason: Reason::NoHealthyEndpoint,
        }
    }
}

/// Live per-endpoint load and health, shared by the proxy, selectors and the KV tier.
/// Survives rule updates for endpoints whose address did not change.
#[derive(Debug, Default)]
pub struct EndpointLoad {
    /// Requests sent and not yet finished (response body fully streamed, failed, or cancelled).
    pub in_flight: AtomicU64,
    /// Requests parked waiting for this endpoint (admission; 0 without a gate).
    pub queued: AtomicU64,
    /// Prefill work queued on this endpoint, in tokens: the uncached prompt tokens (as the KV
    /// tier estimates them from its own overlap) of requests sent here whose response has not
    /// started yet (released at the first response frame, on error or on disconnect). 0 for
    /// requests the tier did not hash. Read by the KV tier's `work` law.
    pub prefill_tokens: AtomicU64,
    /// Requests the engine itself reports running plus waiting (`vllm:num_requests_running` +
    /// `vllm:num_requests_waiting`, scraped by the health tier's engine-metrics scraper), so
    /// that the load of other gateways in front of the same engine counts too. 0 when not
    /// scraped, unreachable, or either family is missing.
    pub engine_requests: AtomicU64,
    /// False while probes or the circuit breaker hold the endpoint down.
    pub healthy: AtomicBool,
}

impl EndpointLoad {
    /// A healthy endpoint with no load.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            healthy: AtomicBool::new(true),
            ..Default::default()
        })
    }
    /// Current in-flight count.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }
    /// Is the endpoint eligible as far as health goes?
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
    /// Counts one request in flight until the guard drops.
    pub fn begin(self: &Arc<Self>) -> InFlightGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlightGuard {
            load: self.clone(),
            work: 0,
        }
    }
    /// The load the KV laws see, requests: the larger of this gateway's own count (in flight
    /// plus parked in admission) and the engine-reported running+waiting count
    /// ([`Self::engine_requests`]). Max, not sum: the engine's count includes this gateway's
    /// requests once they arrive.
    pub fn effective_load(&self) -> u64 {
        let own = self.in_flight() + self.queued.load(Ordering::Relaxed);
        own.max(self.engine_requests.load(Ordering::Relaxed))
    }
    /// Current queued prefill work, tokens (see [`Self::prefill_tokens`]).
    pub fn prefill_work(&self) -> u64 {
        self.prefill_tokens.load(Ordering::Relaxed)
    }
}

/// RAII in-flight counter: attach it to the response body so it drops at end of stream, on
/// error, and on client disconnect.
#[derive(Debug)]
pub struct InFlightGuard {
    load: Arc<EndpointLoad>,
    /// Prefill tokens this request adds to the endpoint's `prefill_tokens` until released.
    work: u64,
}

impl InFlightGuard {
    /// Counts `tokens` of prefill work on the endpoint until [`Self::prefill_done`] or drop
    /// (added to any already counted by this guard).
    pub fn with_work(mut self, tokens: u64) -> Self {
        self.load
            .prefill_tokens
            .fetch_add(tokens, Ordering::Relaxed);
        self.work += tokens;
        self
    }
    /// The request's prefill is over (its response started): releases its work, once.
    pub fn prefill_done(&mut self) {
        if self.work > 0 {
            self.load
                .prefill_tokens
                .fetch_sub(self.work, Ordering::Relaxed);
            self.work = 0;
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.prefill_done();
        self.load.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Bit mask of endpoint indices excluded from a selection (failed connect, admin down).
/// Indices ≥ 64 grow the vector; there is no endpoint limit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Excluded(Vec<u64>);

impl Excluded {
    /// Marks `ep` excluded.
    pub fn insert(&mut self, ep: EpIdx) {
        let (w, b) = (ep / 64, ep % 64);
        if self.0.len() <= w {
            self.0.resize(w + 1, 0);
        }
        self.0[w] |= 1 << b;
    }
    /// True when nothing is excluded (a first attempt rather than a retry).
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }
    /// Is `ep` excluded?
    pub fn contains(&self, ep: EpIdx) -> bool {
        self.0
            .get(ep / 64)
            .is_some_and(|w| w & (1 << (ep % 64)) != 0)
    }
}

/// What a selector may look at for one request: per-endpoint weight and live load, plus the
/// request's exclusion mask. `eligible(i)` = healthy and not excluded.
pub struct Candidates<'a> {
    /// Endpoint weights, by `EpIdx`.
    pub weights: &'a [u32],
    /// Endpoint load/health, by `EpIdx`.
    pub loads: &'a [Arc<EndpointLoad>],
    /// Endpoints this request must not use.
    pub excluded: &'a Excluded,
}

impl Candidates<'_> {
    /// Number of endpoints in the rule.
    pub fn len(&self) -> usize {
        self.loads.len()
    }
    /// True when the rule has no endpoints.
    pub fn is_empty(&self) -> bool {
        self.loads.is_empty()
    }
    /// Healthy and not excluded.
    pub fn eligible(&self, ep: EpIdx) -> bool {
        ep < self.loads.len() && self.loads[ep].is_healthy() && !self.excluded.contains(ep)
    }
    /// Indices of eligible endpoints, ascending.
    pub fn eligible_iter(&self) -> impl Iterator<Item = EpIdx> + '_ {
        (0..self.len()).filter(|&i| self.eligible(i))
    }
}

#[cfg(test)]
mod load_tests {
    use super::*;

    #[test]
    fn prefill_work_counts_until_the_first_frame_and_in_flight_until_drop() {
        let load = EndpointLoad::new();
        let mut a = load.begin().with_work(3200);
        let b = load.begin().with_work(128);
        assert_eq!((load.in_flight(), load.prefill_work()), (2, 3328));
        a.prefill_done();
        a.prefill_done();
        assert_eq!((load.in_flight(), load.prefill_work()), (2, 128));
        drop(b);
        assert_eq!((load.in_flight(), load.prefill_work()), (1, 0));
        drop(a);
        assert_eq!((load.in_flight(), load.prefill_work()), (0, 0));
    }

    #[test]
    fn effective_load_is_the_larger_of_own_and_engine_reported() {
        let load = EndpointLoad::new();
        let _a = load.begin();
        let _b = load.begin();
        load.queued.store(1, Ordering::Relaxed);
        assert_eq!(load.effective_load(), 3);
        load.engine_requests.store(50, Ordering::Relaxed);
        assert_eq!(load.effective_load(), 50);
        load.engine_requests.store(2, Ordering::Relaxed);
        assert_eq!(load.effective_load(), 3);
    }
}
