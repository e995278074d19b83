//! The P/D selection ladder of a rule with `pd_disagg_mode: true`.
//!
//! Prefill leg, in order (each tier honours health: an endpoint whose probe is down or whose
//! breaker is open is not `eligible`, and no tier picks it):
//! - tier 0, the session pin ([`super::pins`]): the conversation's pinned prefill endpoint;
//! - tier 1.5, KV overlap over the prefill endpoints when `kvExactMode` is 1: the KV tier
//!   (`kv::route`, through the [`AffinityTier`] seam) sees a candidate set in which every
//!   endpoint that is not a prefill endpoint is excluded (the KV manager subscribes only the
//!   prefill endpoints in mode 1 anyway); its misses are counted by the KV tier;
//! - tier 2, minimum load among eligible prefill endpoints: in flight + queued, ties rotate.
//!
//! Decode leg: the pin's decode endpoint if eligible, else minimum load among decode endpoints.
//! When no prefill or no decode endpoint is eligible, [`PdLadder::aggregated`] names a role-0
//! endpoint (minimum load) to serve the request in one leg; with none, the proxy answers 503
//! `pd_pool_unavailable`.
//!
//! Tier 1 (the prefix trie, `pd_cache_aware_mode`) is not implemented: validation refuses it.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::pins::{PIN_CAPACITY, Pin, PinTable};
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
    /// Tier 1.5: KV overlap over the prefill endpoints.
    KvOverlap,
    /// Tier 2 (prefill) or the decode leg's fallback: minimum load.
    MinLoad,
    /// No prefill or no decode endpoint was eligible: a role-0 endpoint served in one leg.
    Aggregated,
}

impl PdTier {
    /// Every tier, in ladder order.
    pub const ALL: [PdTier; 4] = [
        PdTier::Session,
        PdTier::KvOverlap,
        PdTier::MinLoad,
        PdTier::Aggregated,
    ];

    /// The metric label: `0`, `1.5`, `2`, `aggregated`.
    pub fn as_str(self) -> &'static str {
        match self {
            PdTier::Session => "0",
            PdTier::KvOverlap => "1.5",
            PdTier::MinLoad => "2",
            PdTier::Aggregated => "aggregated",
        }
    }
}

/// An endpoint and the tier that chose it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// The endpoint.
    pub ep: EpIdx,
    /// The tier.
    pub tier: PdTier,
}

/// The P/D state of one rule's pool: its pins and the tie-rotation cursor. Built with the pool
/// (a changed rule starts with no pins).
#[derive(Debug)]
pub struct PdState {
    /// Tier-0 pins.
    pub pins: PinTable,
    /// Tie-rotation cursor per role (normal, prefill, decode).
    cursors: [AtomicUsize; 3],
}

impl PdState {
    /// State for a rule with `spec`.
    pub fn new(spec: &PdSpec) -> Self {
        Self {
            pins: PinTable::new(spec.session_ttl, PIN_CAPACITY),
            cursors: Default::default(),
        }
    }
}

/// The ladder of one P/D rule for one request.
pub struct PdLadder<'a, T: AffinityTier + ?Sized> {
    /// The rule.
    pub rule: &'a StoredRule,
    /// Its P/D spec.
    pub pd: &'a PdSpec,
    /// Its pins and cursor.
    pub state: &'a PdState,
    /// The KV tier (tier 1.5), when the daemon runs one.
    pub tier: Option<&'a T>,
}

impl<T: AffinityTier + ?Sized> PdLadder<'_, T> {
    /// Tier 1.5 when this rule has `kvExactMode` 1.
    fn kv_tier(&self) -> Option<&T> {
        self.tier
            .filter(|_| self.rule.spec.kv_mode() == KvMode::PdPrefill)
    }

    /// The prefill endpoint: tier 0 (`pin`), tier 1.5, tier 2. `None` when no prefill endpoint
    /// is eligible. Called again with a failed endpoint in `cands.excluded` after a connect
    /// failure, with the same `ticket`.
    pub fn prefill(
        &self,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        pin: Option<Pin>,
        ticket: &mut T::Ticket,
    ) -> Option<Choice> {
        if let Some(p) = pin.filter(|p| self.usable(cands, p.prefill, Role::Prefill)) {
            return Some(Choice {
                ep: p.prefill,
                tier: PdTier::Session,
            });
        }
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
                return Some(Choice {
                    ep,
                    tier: PdTier::KvOverlap,
                });
            }
        }
        self.min_load(cands, Role::Prefill).map(|ep| Choice {
            ep,
            tier: PdTier::MinLoad,
        })
    }

    /// The decode endpoint: the pin's if eligible, else minimum load among decode endpoints.
    pub fn decode(&self, cands: &Candidates<'_>, pin: Option<Pin>) -> Option<Choice> {
        if let Some(p) = pin.filter(|p| self.usable(cands, p.decode, Role::Decode)) {
            return Some(Choice {
                ep: p.decode,
                tier: PdTier::Session,
            });
        }
        self.min_load(cands, Role::Decode).map(|ep| Choice {
            ep,
            tier: PdTier::MinLoad,
        })
    }

    /// A role-0 endpoint (minimum load) for a request the P/D pools cannot serve.
    pub fn aggregated(&self, cands: &Candidates<'_>) -> Option<Choice> {
        self.min_load(cands, Role::Normal).map(|ep| Choice {
            ep,
            tier: PdTier::Aggregated,
        })
    }

    /// Tells the KV tier (mode 1) that the prefill leg goes to `ep` (predicted blocks).
    pub fn routed(&self, meta: &RequestMeta, ep: EpIdx, ticket: &mut T::Ticket) {
        if let Some(tier) = self.kv_tier() {
            tier.routed(self.rule, meta, ep, ticket);
        }
    }

    fn usable(&self, cands: &Candidates<'_>, ep: EpIdx, role: Role) -> bool {
        self.pd.role(ep) == role && cands.eligible(ep)
    }

    /// The eligible endpoint of `role` with the least in-flight + queued requests; among equals
    /// the role's cursor picks the next one in turn, so ties rotate over exactly the tied
    /// endpoints (two passes, no allocation).
    fn min_load(&self, cands: &Candidates<'_>, role: Role) -> Option<EpIdx> {
        let load = |ep: EpIdx| {
            let l = &cands.loads[ep];
            l.in_flight() + l.queued.load(Ordering::Relaxed)
        };
        let mut min: Option<(u64, usize)> = None;
        for ep in (0..cands.len()).filter(|&ep| self.usable(cands, ep, role)) {
            let l = load(ep);
            min = match min {
                Some((m, n)) if l == m => Some((m, n + 1)),
                Some((m, n)) if l > m => Some((m, n)),
                _ => Some((l, 1)),
            };
        }
        let (m, ties) = min?;
        let cursor = &self.state.cursors[match role {
            Role::Normal => 0,
            Role::Prefill => 1,
            Role::Decode => 2,
        }];
        let k = cursor.fetch_add(1, Ordering::Relaxed) % ties;
        (0..cands.len())
            .filter(|&ep| self.usable(cands, ep, role) && load(ep) == m)
            .nth(k)
            // A load changed between the passes: any eligible endpoint of the role will do.
            .or_else(|| (0..cands.len()).find(|&ep| self.usable(cands, ep, role)))
    }
}

#[cfg(test)]
#[path = "ladder_tests.rs"]
mod tests;
