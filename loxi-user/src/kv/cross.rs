//! The crossed-stream check: does each endpoint's event stream carry its own engine's blocks?
//!
//! Parity checks the hash contract (seed, algorithm, block size), not the owner. Two endpoints
//! whose `kvZmqPort`s are swapped pass it: every hash is right, only filed under the other
//! endpoint, so repeats of a prompt go to the engine that does not hold it while
//! `loxilb_pd_kv_tier15_hits_total` counts hits.
//!
//! The check: when a request is placed cold on endpoint `Y` (no endpoint holds or is predicted
//! to hold its first block), the first block key is a probe: the engine that prefills it
//! publishes that key within seconds. The readiness pass (once a second,
//! [`CrossWatch::resolve`]) looks for each pending probe among the endpoints' confirmed blocks:
//! - on `Y`'s stream: the placement *landed*;
//! - only on other endpoints' streams (the first of them, `X`): it *strayed* to `X`;
//! - nowhere yet: it stays pending until [`PROBE_WINDOW`] after the placement, then is dropped
//!   (an engine that evicts at once, or a request that failed, is no evidence).
//!
//! Each endpoint keeps the outcomes of its last [`OUTCOMES`] resolved probes.
//! [`CrossWatch::crossed`] names `X` when none of them landed and at least [`MIN_STRAYS`]
//! strayed to `X`: readiness `crossed` for `Y` and for `X` (whose stream carries `Y`'s
//! engine's blocks, [`CrossWatch::carries`]), each remedy naming both ports. Both are
//! [`CrossWatch::suspects`]: their inventories are not their engines' caches, so routing
//! gives their blocks no overlap and cold placement counts them as not heard (loads still
//! spread over them; only prefix reuse is lost for them). A later landing (a wrong verdict)
//! clears it as soon as it is among the last outcomes; moving an endpoint to another
//! `kvZmqPort` (the fix) makes it a new member with no outcomes.
//!
//! Cost: one [`KvIndex::score`] of one key per routed request with keys (to tell a cold
//! placement), a lock push for cold ones; the pass costs at most [`MAX_PENDING`] × endpoints
//! key lookups a second.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::BlockKey;
use super::index::KvIndex;
use super::members::Member;

/// How long a probe waits for its key to be published (after that it is dropped, unresolved).
pub const PROBE_WINDOW: Duration = Duration::from_secs(30);
/// Pending probes kept per service (the oldest is dropped for a new one beyond this).
pub const MAX_PENDING: usize = 64;
/// Resolved outcomes kept per endpoint.
pub const OUTCOMES: usize = 8;
/// Strays to one other endpoint, with no landing among the kept outcomes, that make the
/// verdict `crossed`.
pub const MIN_STRAYS: usize = 3;

/// One probe: the first block key of a cold placement on `member`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Probe {
    key: BlockKey,
    member: Member,
    placed: Instant,
}

/// Per-service state of the crossed-stream check (see the module doc).
#[derive(Debug, Default)]
pub struct CrossWatch {
    /// Unresolved probes, oldest first (at most [`MAX_PENDING`]).
    pending: VecDeque<Probe>,
    /// Per member placed on: its last resolved outcomes, newest last (at most [`OUTCOMES`]):
    /// `None` landed on its own stream, `Some(x)` arrived only on member `x`'s stream.
    outcomes: HashMap<Member, VecDeque<Option<Member>>>,
}

impl CrossWatch {
    /// Records a cold placement on `member` of a request whose first block key is `key`, at
    /// `now`. The caller has checked that no endpoint holds or is predicted to hold `key`.
    pub fn placed(&mut self, member: Member, key: BlockKey, now: Instant) {
        if self.pending.len() >= MAX_PENDING {
            self.pending.pop_front();
        }
        self.pending.push_back(Probe {
            key,
            member,
            placed: now,
        });
    }

    /// Resolves the pending probes against `index`'s confirmed blocks of `members` (the
    /// service's current members) at `now`; probes of members that left are dropped, and
    /// probes older than [`PROBE_WINDOW`] with no holder are dropped unresolved.
    pub fn resolve(&mut self, index: &KvIndex, members: &[Member], now: Instant) {
        let mut keep = VecDeque::with_capacity(self.pending.len());
        while let Some(p) = self.pending.pop_front() {
            if !members.contains(&p.member) {
                continue;
            }
            let outcome = if index.holds_key(p.member, p.key) {
                Some(None)
            } else {
                members
                    .iter()
                    .find(|&&x| x != p.member && index.holds_key(x, p.key))
                    .map(|&x| Some(x))
            };
            match outcome {
                Some(o) => {
                    let ring = self.outcomes.entry(p.member).or_default();
                    if ring.len() >= OUTCOMES {
                        ring.pop_front();
                    }
                    ring.push_back(o);
                }
                None if now.duration_since(p.placed) < PROBE_WINDOW => keep.push_back(p),
                None => {}
            }
        }
        self.pending = keep;
        self.outcomes.retain(|m, _| members.contains(m));
    }

    /// The member whose stream carries `member`'s blocks, with how many of `member`'s last
    /// outcomes strayed there: `Some` when none of its kept outcomes landed and at least
    /// [`MIN_STRAYS`] strayed to that one member (the most frequent; the lowest id on a tie).
    pub fn crossed(&self, member: Member) -> Option<(Member, usize)> {
        let ring = self.outcomes.get(&member)?;
        if ring.iter().any(Option::is_none) {
            return None;
        }
        let mut counts: Vec<(Member, usize)> = Vec::new();
        for x in ring.iter().flatten() {
            match counts.iter_mut().find(|(m, _)| m == x) {
                Some(c) => c.1 += 1,
                None => counts.push((*x, 1)),
            }
        }
        counts
            .into_iter()
            .filter(|(_, n)| *n >= MIN_STRAYS)
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
    }

    /// The member whose placements' blocks `member`'s stream carries: the lowest member `y`
    /// whose [`Self::crossed`] names `member`, with its count.
    pub fn carries(&self, member: Member) -> Option<(Member, usize)> {
        let mut ys: Vec<Member> = self.outcomes.keys().copied().collect();
        ys.sort_unstable();
        ys.into_iter().find_map(|y| match self.crossed(y) {
            Some((x, n)) if x == member => Some((y, n)),
            _ => None,
        })
    }

    /// Every member whose inventory is not its own engine's cache: each crossed member and
    /// each member named by one (ascending, each once).
    pub fn suspects(&self) -> Vec<Member> {
        let mut out = Vec::new();
        for &y in self.outcomes.keys() {
            if let Some((x, _)) = self.crossed(y) {
                out.push(y);
                out.push(x);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Drops everything known of `member` (it left the rule).
    pub fn forget(&mut self, member: Member) {
        self.pending.retain(|p| p.member != member);
        self.outcomes.remove(&member);
    }

    /// Unresolved probes (for tests and the report).
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
#[path = "cross_tests.rs"]
mod tests;
