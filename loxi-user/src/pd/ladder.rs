//! The P/D selection ladder of a rule with `pd_disagg_mode: true`.
//!
//! Prefill leg, in order (each tier honours health: an endpoint whose probe is down or whose
//! breaker is open is not `eligible`, and no tier picks it):
//! - tier 0, the session pin ([`super::pins`]): the conversation's pinned prefill endpoint;
//! - tier 1, the prefix trie ([`super::trie`]) when `pd_cache_aware_mode` is true: bypassed
//!   when the most and least loaded eligible prefill endpoints differ by more than
//!   `pd_balance_abs_threshold` (in flight + queued); otherwise, when the eligible prefill
//!   endpoint(s) holding the longest prefix of the request's key hold at least
//!   `pd_cache_threshold` % of it, the one of them with the least load per unit of weight
//!   (ties: the lowest index), else a miss (the bypass compares absolute loads). Every routed
//!   prefill leg is learned ([`PdLadder::routed`]), whichever tier chose it;
//! - tier 1.5, KV overlap over the prefill endpoints when `kvExactMode` is 1: the KV tier
//!   (`kv::route`, through the [`AffinityTier`] seam) sees a candidate set in which every
//!   endpoint that is not a prefill endpoint is excluded (the KV manager subscribes only the
//!   prefill endpoints in mode 1 anyway); its misses are counted by the KV tier;
//! - tier 2, weighted least load among eligible prefill endpoints, as nginx's `least_conn`
//!   with weights: the least (in flight + queued) / weight, ties broken by smooth weighted
//!   round robin over the tied endpoints (so idle endpoints of weights 5 and 1 take 5 and 1 of
//!   every 6 sequential requests).
//!
//! Weights steer new work only: a pin (tier 0) holds whatever the weights, and a tier-1 hit
//! goes to a holder of the prefix whatever the weights (weights only rank the holders).
//!
//! Decode leg: the pin's decode endpoint if eligible, else weighted least load among decode
//! endpoints (as tier 2). The role-0 fallback picks the same way among role-0 endpoints.
//! When no prefill or no decode endpoint is eligible, [`PdLadder::aggregated`] names a role-0
//! endpoint (minimum load) to serve the request in one leg; with none, the proxy answers 503
//! `pd_pool_unavailable`.

use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use super::pins::{PIN_CAPACITY, Pin, PinTable};
use super::trie::{PrefixTrie, TRIE_CAPACITY};
use crate::request::RequestMeta;
use crate::routing::tier::AffinityTier;
use crate::routing::{Candidates, EpIdx, Excluded};
use crate::rules::spec::{PdSpec, Role};
use crate::rules::{KvMode, StoredRule};

/// Which tier chose an endpoint (the `tier` label of `loxilb_ai_pd_tier_selected_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PdTier {
    /// Tier 0: the session pin.
    Session,
    /// Tier 1: the prefix trie.
    Trie,
    /// Tier 1.5: KV overlap over the prefill endpoints.
    KvOverlap,
    /// Tier 2 (prefill) or the decode leg's fallback: weighted least load.
    MinLoad,
    /// No prefill or no decode endpoint was eligible: a role-0 endpoint served in one leg.
    Aggregated,
}

impl PdTier {
    /// Every tier, in ladder order.
    pub const ALL: [PdTier; 5] = [
        PdTier::Session,
        PdTier::Trie,
        PdTier::KvOverlap,
        PdTier::MinLoad,
        PdTier::Aggregated,
    ];

    /// The metric label: `0`, `1`, `1.5`, `2`, `aggregated`.
    pub fn as_str(self) -> &'static str {
        match self {
            PdTier::Session => "0",
            PdTier::Trie => "1",
            PdTier::KvOverlap => "1.5",
            PdTier::MinLoad => "2",
            PdTier::Aggregated => "aggregated",
        }
    }
}

/// What tier 1 made of one prefill decision (the `loxilb_ai_pd_tier1_*` counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrieOutcome {
    /// Tier 1 was not consulted: the rule has it off, the request has no prompt, tier 0
    /// answered, or no prefill endpoint is eligible.
    #[default]
    NotAsked,
    /// Tier 1 chose the endpoint.
    Hit,
    /// No eligible endpoint holds `pd_cache_threshold` % of the key: the next tiers chose.
    Miss,
    /// The prefill endpoints' loads differ by more than `pd_balance_abs_threshold`: tier 1
    /// was skipped and the next tiers chose.
    Bypass,
}

/// An endpoint, the tier that chose it, and (prefill leg) what tier 1 made of the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// The endpoint.
    pub ep: EpIdx,
    /// The tier.
    pub tier: PdTier,
    /// Tier 1's outcome ([`TrieOutcome::NotAsked`] on the decode leg).
    pub trie: TrieOutcome,
}

impl Choice {
    fn new(ep: EpIdx, tier: PdTier) -> Self {
        Self {
            ep,
            tier,
            trie: TrieOutcome::NotAsked,
        }
    }
}

/// The P/D state of one rule's pool: its pins, its tier-1 trie and the smooth-WRR current
/// weights that break weighted-least-load ties.
/// Built with the pool (a changed rule starts with no pins; the trie is carried over, see
/// [`PdState::successor`]).
#[derive(Debug)]
pub struct PdState {
    /// Tier-0 pins.
    pub pins: PinTable,
    /// Tier 1's prefix trie, when the rule has `pd_cache_aware_mode` (one lock per rule: a
    /// decision and a learn each walk at most [`super::trie::KEY_MAX`] symbols under it).
    pub trie: Option<Mutex<PrefixTrie>>,
    /// Smooth-WRR current weights by endpoint (each endpoint has one role, so one vector
    /// serves the three choices); resized to the rule's endpoint count on first use.
    swrr: Mutex<Vec<i64>>,
}

impl PdState {
    /// State for a rule with `spec` (an empty trie of [`TRIE_CAPACITY`] symbols when tier 1
    /// is on).
    pub fn new(spec: &PdSpec) -> Self {
        Self {
            pins: PinTable::new(spec.session_ttl, PIN_CAPACITY),
            trie: spec
                .trie
                .map(|_| Mutex::new(PrefixTrie::new(TRIE_CAPACITY))),
            swrr: Mutex::new(Vec::new()),
        }
    }

    /// State for a changed rule with `spec`: [`Self::new`], with the trie of `old` (the rule's
    /// previous state) when both have tier 1 on, renumbered by `map` (an old endpoint index to
    /// its new one; `None` for a removed endpoint, which the trie forgets).
    pub fn successor(
        spec: &PdSpec,
        old: Option<&PdState>,
        map: impl Fn(EpIdx) -> Option<EpIdx>,
    ) -> Self {
        let mut s = Self::new(spec);
        if let (Some(t), Some(old)) = (s.trie.as_mut(), old.and_then(|o| o.trie.as_ref())) {
            let mut carried = old.lock().clone();
            carried.remap(map);
            *t.get_mut() = carried;
        }
        s
    }
}

/// The ladder of one P/D rule for one request.
pub struct PdLadder<'a, T: AffinityTier + ?Sized> {
    /// The rule.
    pub rule: &'a StoredRule,
    /// Its P/D spec.
    pub pd: &'a PdSpec,
    /// Its pins, trie and tie-breaking state.
    pub state: &'a PdState,
    /// The KV tier (tier 1.5), when the daemon runs one.
    pub tier: Option<&'a T>,
    /// The request's tier-1 key ([`super::trie::key_of`]); `None` when the rule has tier 1
    /// off or the request has no prompt.
    pub key: Option<&'a [u32]>,
}

impl<T: AffinityTier + ?Sized> PdLadder<'_, T> {
    /// Tier 1.5's per-request work (tokenizing and hashing the prompt, on the tier's own pool
    /// within its budget: [`AffinityTier::prepare`]) when this rule has `kvExactMode` 1; once
    /// per request, before [`Self::prefill`]. Without it the tier would do that work inline, on
    /// the thread that serves the connection, in `prefill` or `routed`.
    pub async fn prepare(&self, meta: &RequestMeta, ticket: &mut T::Ticket) {
        if let Some(tier) = self.kv_tier() {
            tier.prepare(self.rule, meta, ticket).await;
        }
    }

    /// Tier 1.5 when this rule has `kvExactMode` 1.
    fn kv_tier(&self) -> Option<&T> {
        self.tier
            .filter(|_| self.rule.spec.kv_mode() == KvMode::PdPrefill)
    }

    /// The prefill endpoint: tier 0 (`pin`), tier 1, tier 1.5, tier 2. `None` when no prefill
    /// endpoint is eligible. Called again with a failed endpoint in `cands.excluded` after a
    /// connect failure, with the same `ticket` (tier 1 then decides again: each call is one
    /// decision and has its own [`TrieOutcome`]).
    pub fn prefill(
        &self,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        pin: Option<Pin>,
        ticket: &mut T::Ticket,
    ) -> Option<Choice> {
        if let Some(p) = pin.filter(|p| self.usable(cands, p.prefill, Role::Prefill)) {
            return Some(Choice::new(p.prefill, PdTier::Session));
        }
        let trie = match self.trie_tier(cands) {
            (Some(ep), trie) => {
                return Some(Choice {
                    ep,
                    tier: PdTier::Trie,
                    trie,
                });
            }
            (None, trie) => trie,
        };
        self.after_trie(meta, cands, ticket)
            .map(|c| Choice { trie, ..c })
    }

    /// Tier 1: the endpoint and [`TrieOutcome::Hit`], or `None` and why not.
    fn trie_tier(&self, cands: &Candidates<'_>) -> (Option<EpIdx>, TrieOutcome) {
        let (Some(spec), Some(trie), Some(key)) =
            (self.pd.trie, self.state.trie.as_ref(), self.key)
        else {
            return (None, TrieOutcome::NotAsked);
        };
        let prefill = |ep: EpIdx| self.usable(cands, ep, Role::Prefill);
        let mut range: Option<(u64, u64)> = None;
        for ep in (0..cands.len()).filter(|&ep| prefill(ep)) {
            let l = load(cands, ep);
            range = Some(range.map_or((l, l), |(lo, hi)| (lo.min(l), hi.max(l))));
        }
        let Some((lo, hi)) = range else {
            return (None, TrieOutcome::NotAsked);
        };
        if hi - lo > spec.balance_abs {
            return (None, TrieOutcome::Bypass);
        }
        let Some(m) = trie.lock().longest_match(key, prefill) else {
            return (None, TrieOutcome::Miss);
        };
        // The tag (the key's first symbol) is not part of the prompt.
        let (matched, total) = (m.matched.saturating_sub(1) as u64, (key.len() - 1) as u64);
        if matched == 0 || matched * 100 < u64::from(spec.threshold_pct) * total {
            return (None, TrieOutcome::Miss);
        }
        let ep = m
            .holders
            .iter()
            .copied()
            .reduce(|best, ep| if lighter(cands, ep, best) { ep } else { best });
        (ep, ep.map_or(TrieOutcome::Miss, |_| TrieOutcome::Hit))
    }

    /// Tiers 1.5 and 2.
    fn after_trie(
        &self,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        ticket: &mut T::Ticket,
    ) -> Option<Choice> {
        if let Some(tier) = self.kv_tier() {
            let mut only_prefill: Excluded = cands.excluded.clone();
            for ep in 0..cands.len() {
                if self.pd.role(ep) != Role::Prefill {
                    only_prefill.insert(ep);
                }
            }
            let sub = Candidates {
                weights: cands.weights,
                loads: cands.loads,
                excluded: &only_prefill,
            };
            let d =
                crate::routing::ladder::off_reactor(|| tier.select(self.rule, meta, &sub, ticket));
            if let Some(ep) = d
                .and_then(|d| d.endpoint)
                .filter(|&ep| self.usable(cands, ep, Role::Prefill))
            {
                return Some(Choice::new(ep, PdTier::KvOverlap));
            }
        }
        self.min_load(cands, Role::Prefill)
            .map(|ep| Choice::new(ep, PdTier::MinLoad))
    }

    /// The decode endpoint: the pin's if eligible, else weighted least load among decode
    /// endpoints.
    pub fn decode(&self, cands: &Candidates<'_>, pin: Option<Pin>) -> Option<Choice> {
        if let Some(p) = pin.filter(|p| self.usable(cands, p.decode, Role::Decode)) {
            return Some(Choice::new(p.decode, PdTier::Session));
        }
        self.min_load(cands, Role::Decode)
            .map(|ep| Choice::new(ep, PdTier::MinLoad))
    }

    /// A role-0 endpoint (weighted least load) for a request the P/D pools cannot serve.
    pub fn aggregated(&self, cands: &Candidates<'_>) -> Option<Choice> {
        self.min_load(cands, Role::Normal)
            .map(|ep| Choice::new(ep, PdTier::Aggregated))
    }

    /// The prefill leg goes to `ep`: tier 1 learns the request's key under `ep`, and the KV
    /// tier (mode 1) records its predicted blocks.
    pub fn routed(&self, meta: &RequestMeta, ep: EpIdx, ticket: &mut T::Ticket) {
        if let (Some(trie), Some(key)) = (self.state.trie.as_ref(), self.key) {
            trie.lock().insert(key, ep);
        }
        if let Some(tier) = self.kv_tier() {
            tier.routed(self.rule, meta, ep, ticket);
        }
    }

    fn usable(&self, cands: &Candidates<'_>, ep: EpIdx, role: Role) -> bool {
        self.pd.role(ep) == role && cands.eligible(ep)
    }

    /// The eligible endpoint of `role` with the least load (in flight + queued) per unit of
    /// weight, nginx's weighted `least_conn`: among equals, smooth weighted round robin over
    /// exactly the tied endpoints (each adds its weight to its current weight, the largest
    /// wins, ties to the lower index, and the winner gives back the tied endpoints' total),
    /// so idle endpoints split sequential requests by weight. Two passes, no allocation.
    fn min_load(&self, cands: &Candidates<'_>, role: Role) -> Option<EpIdx> {
        let mut best: Option<EpIdx> = None;
        for ep in (0..cands.len()).filter(|&ep| self.usable(cands, ep, role)) {
            if best.is_none_or(|b| lighter(cands, ep, b)) {
                best = Some(ep);
            }
        }
        let first = best?;
        let (bl, bw) = (
            u128::from(load(cands, first)),
            u128::from(weight(cands, first)),
        );
        let tied = (0..cands.len())
            .filter(|&ep| self.usable(cands, ep, role))
            .map(|ep| (ep, weight(cands, ep)))
            .filter(|&(ep, w)| u128::from(load(cands, ep)) * bw == bl * u128::from(w));
        crate::routing::wrr::smooth_pick(&mut self.state.swrr.lock(), cands.len(), tied)
            // A load changed between the passes: the first pass's choice.
            .or(Some(first))
    }
}

/// Whether `a` carries less load per unit of weight than `b` (`load_a / w_a < load_b / w_b`,
/// compared as `load_a * w_b < load_b * w_a`).
fn lighter(cands: &Candidates<'_>, a: EpIdx, b: EpIdx) -> bool {
    u128::from(load(cands, a)) * u128::from(weight(cands, b))
        < u128::from(load(cands, b)) * u128::from(weight(cands, a))
}

/// The weight of `ep` (validation keeps weights in 1..=65535; a missing or 0 weight counts 1).
fn weight(cands: &Candidates<'_>, ep: EpIdx) -> u32 {
    cands.weights.get(ep).copied().unwrap_or(1).max(1)
}

/// In flight + queued requests of `ep` (the load every tier compares).
fn load(cands: &Candidates<'_>, ep: EpIdx) -> u64 {
    let l = &cands.loads[ep];
    l.in_flight() + l.queued.load(Ordering::Relaxed)
}

#[cfg(test)]
#[path = "ladder_tests.rs"]
mod tests;
