//! The selection ladder: which tiers a rule's request goes through, in order, and which one
//! decided. Today: tier 1.5 (KV overlap, for `kvExactMode` 3 when a tier runs), then the rule's
//! `sel`. A P/D rule (`pd_disagg_mode`) has its own ladder, `pd::ladder` (session pin, tier 1.5
//! over the prefill endpoints, min load), which reaches tier 1.5 through the same seam.
//!
//! The ladder takes the rule (its spec and raw selector knobs), the request, the candidates
//! and the selector state; it knows nothing of pools, listeners or HTTP. CPU-heavy tier work
//! (tokenizing a long prompt) happens in [`Ladder::prepare`], which the tier bounds in time and
//! runs off the runtime's threads (tier 1.5: its tokenization pool); [`Ladder::decide`] is
//! then cheap.

use super::tier::AffinityTier;
use super::{Candidates, Decision, EpIdx, SelectorState, dispatch};
use crate::request::RequestMeta;
use crate::rules::{KvMode, StoredRule};

/// A ladder decision and the step that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// The decision (endpoint and reason).
    pub decision: Decision,
    /// True when an affinity tier decided (false: the rule's `sel`).
    pub by_tier: bool,
}

/// The ladder of one rule: the rule, its selector state and the affinity tier, if one runs.
pub struct Ladder<'a, T: AffinityTier + ?Sized> {
    /// The rule (typed spec and raw selector knobs).
    pub rule: &'a StoredRule,
    /// The rule's selector state (cursor, WRR weights, rings).
    pub state: &'a SelectorState,
    /// The affinity tier (tier 1.5), when the daemon runs one.
    pub tier: Option<&'a T>,
}

impl<T: AffinityTier + ?Sized> Ladder<'_, T> {
    /// The tier this rule uses: tier 1.5 runs for `kvExactMode` 3 (the role-less pool;
    /// `kvExactMode` 1 belongs to the P/D ladder).
    pub fn tier(&self) -> Option<&T> {
        self.tier
            .filter(|_| self.rule.spec.kv_mode() == KvMode::Pool)
    }

    /// The tier's per-request preparation (tokenizing and hashing for tier 1.5, within its
    /// decision budget), once per request before the first [`Self::decide`].
    pub async fn prepare(&self, meta: &RequestMeta, ticket: &mut T::Ticket) {
        if let Some(tier) = self.tier() {
            tier.prepare(self.rule, meta, ticket).await;
        }
    }

    /// Tier 1.5, then the rule's `sel` on a miss (or when tier 1.5 picked nothing).
    pub fn decide(
        &self,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        ticket: &mut T::Ticket,
    ) -> Step {
        if let Some(tier) = self.tier()
            && let Some(d) = tier
                .select(self.rule, meta, cands, ticket)
                .filter(|d| d.endpoint.is_some())
        {
            return Step {
                decision: d,
                by_tier: true,
            };
        }
        Step {
            decision: dispatch::select(
                self.rule.spec.sel,
                &self.rule.rule.service,
                meta,
                cands,
                self.state,
            ),
            by_tier: false,
        }
    }

    /// Tells the tier (if this rule uses one) that the request goes to `ep`.
    pub fn routed(&self, meta: &RequestMeta, ep: EpIdx, ticket: &mut T::Ticket) {
        if let Some(tier) = self.tier() {
            tier.routed(self.rule, meta, ep, ticket);
        }
    }
}

/// Runs CPU-heavy work with `block_in_place`, so the runtime hands this worker's other
/// connections to another thread instead of stalling them. On a current-thread runtime (some
/// tests) it just runs `f`. Unbounded: a tier's per-request work belongs in its `prepare`
/// (tier 1.5 runs it on a fixed pool with a bounded queue and a time budget) instead.
pub fn off_reactor<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}
