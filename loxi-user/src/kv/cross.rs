//! The crossed-stream check: does each endpoint's event stream carry its own engine's blocks?
//!
//! Parity checks the hash contract (seed, algorithm, block size), not the owner. Two endpoints
//! whose `kvZmqPort`s are swapped pass it: every hash is right, only filed under the other
//! endpoint, so repeats of a prompt go to the engine that does not hold it while
//! `loxilb_pd_kv_tier15_hits_total` counts hits.
//!
//! The check uses what loxi knows of ownership: where it sent each new prompt. When a request
//! is placed cold on endpoint `Y` (no endpoint holds or is predicted to hold its first block),
//! that first block key becomes a probe ([`CrossWatch::routed`] with `cold`); every later request with the
//! same first block adds its endpoint to the probe's *routed* set while the probe is pending
//! ([`CrossWatch::routed`]). Every stored block an endpoint's stream delivers is matched
//! against the pending probes ([`CrossWatch::observed`]): the probe's *seen* set. Only a probe
//! routed to `Y` alone is evidence (a prompt loxi also sent elsewhere, a replica seed or a
//! concurrent copy, could be published by either engine):
//! - seen on `Y`'s stream only: the placement *landed*;
//! - seen on the stream of an endpoint `X` it was never routed to (none on `Y`'s): it
//!   *strayed* to `X`. This is decided as soon as it is seen, whatever `Y`'s speed: a slow
//!   engine is not outrun by a copy, since a copy would be routed;
//! - seen nowhere within [`PROBE_WINDOW`] while `Y`'s stream did deliver stored blocks after
//!   the placement: *unseen* (the engine's publisher is not on its endpoint's stream at all;
//!   an engine that failed the request, or publishes nothing, has a quiet stream and gives no
//!   outcome).
//!
//! Each endpoint keeps the outcomes of its last [`OUTCOMES`] resolved probes.
//! [`CrossWatch::verdict`] says:
//! - `Strays(X)` when none of them landed and at least [`MIN_EVIDENCE`] strayed to `X`:
//!   readiness `crossed` for `Y` and for `X` (whose stream carries `Y`'s engine's blocks,
//!   [`CrossWatch::carries`]);
//! - `Unseen` when none landed, none strayed and at least [`MIN_EVIDENCE`] were unseen, and
//!   the readiness pass checks that `Y`'s stream did deliver blocks (someone's): readiness
//!   `unseen` (its stream is another engine's, one outside the rule, or its engine already
//!   held those prompts: engines publish a block once, so a warm engine loxi did not see fill
//!   looks the same).
//!
//! The endpoints with a verdict, and those their strays went to, are
//! [`CrossWatch::suspects`]: their inventories are not their engines' caches, so routing gives
//! their blocks no overlap and cold placement counts them as not heard (loads still spread
//! over them; only prefix reuse is lost for them). A landing clears a verdict while it is among
//! the last outcomes; moving an endpoint to another `kvZmqPort` (the fix) makes it a new member
//! with no outcomes.
//!
//! Cost: per routed request with keys, one lock and one lookup of its first key among at most
//! [`MAX_PENDING`] probes, plus, when it had no hit, one index lookup of that key
//! ([`super::index::KvIndex::held_or_predicted`], no allocation); per stored event, one lock
//! and, while probes are pending, a binary search per block among the probes' sorted keys.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::BlockKey;
use super::members::Member;

/// How long a probe waits for its key to be published (after that it resolves as unseen when
/// it was routed to one endpoint and seen nowhere, and is dropped otherwise).
pub const PROBE_WINDOW: Duration = Duration::from_secs(30);
/// Pending probes kept per service (the oldest is dropped for a new one beyond this).
pub const MAX_PENDING: usize = 64;
/// Resolved outcomes kept per endpoint.
pub const OUTCOMES: usize = 8;
/// Strays to one other endpoint (or unseen placements), with no landing among the kept
/// outcomes, that make a verdict.
pub const MIN_EVIDENCE: usize = 3;

/// One probe: the first block key of a cold placement.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Probe {
    key: BlockKey,
    placed: Instant,
    /// Endpoints loxi sent a request with this first block to (the cold placement first).
    routed: Vec<Member>,
    /// Endpoints whose streams published the key.
    seen: Vec<Member>,
}

/// What became of one probe routed to a single endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Published on its own endpoint's stream only.
    Landed,
    /// Published on this endpoint's stream (one it was never routed to), not on its own.
    Strayed(Member),
    /// Published on no endpoint's stream within [`PROBE_WINDOW`].
    Unseen,
}

/// The label values of [`Outcome`]s in `loxilb_kv_cross_probes_total{outcome}`, by
/// [`Outcome::index`].
pub const OUTCOME_LABELS: [&str; 3] = ["landed", "strayed", "unseen"];

impl Outcome {
    /// Its position in [`OUTCOME_LABELS`].
    pub fn index(self) -> usize {
        match self {
            Outcome::Landed => 0,
            Outcome::Strayed(_) => 1,
            Outcome::Unseen => 2,
        }
    }
}

/// An endpoint's verdict ([`CrossWatch::verdict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// `n` of its last `of` placements were published only on member `to`'s stream.
    Strays {
        /// The member whose stream carries its engine's blocks.
        to: Member,
        /// Placements that strayed there.
        n: usize,
        /// Outcomes kept.
        of: usize,
    },
    /// `n` of its last `of` placements were published on no stream of the rule.
    Unseen {
        /// Placements seen nowhere.
        n: usize,
        /// Outcomes kept.
        of: usize,
    },
}

/// Per-service state of the crossed-stream check (see the module doc).
#[derive(Debug, Default)]
pub struct CrossWatch {
    /// Unresolved probes, oldest first (at most [`MAX_PENDING`]).
    pending: VecDeque<Probe>,
    /// Per member placed on: its last resolved outcomes, newest last (at most [`OUTCOMES`]).
    outcomes: HashMap<Member, VecDeque<Outcome>>,
    /// Per member: when its stream last delivered stored blocks (while probes were pending).
    active: HashMap<Member, Instant>,
    /// Per member placed on: outcomes resolved since the last [`Self::take_tally`], by
    /// [`OUTCOME_LABELS`] position (landed, strayed, unseen).
    tally: HashMap<Member, [u64; 3]>,
    /// The keys of `pending`, sorted (rebuilt whenever `pending` changes): a stored event's
    /// keys are matched by binary search, not against every probe.
    keys: Vec<BlockKey>,
}

impl CrossWatch {
    /// A request whose first block key is `key` was sent to `member` at `now`: adds `member`
    /// to the routed set of a pending probe of `key`; otherwise, when `cold` (no endpoint
    /// holds or is predicted to hold `key`), starts a probe. Returns whether a probe of `key`
    /// is pending afterwards.
    pub fn routed(&mut self, member: Member, key: BlockKey, cold: bool, now: Instant) -> bool {
        if let Some(p) = self.pending.iter_mut().find(|p| p.key == key) {
            if !p.routed.contains(&member) {
                p.routed.push(member);
            }
            return true;
        }
        if cold {
            self.placed(member, key, now);
        }
        cold
    }

    /// Starts a probe: a cold placement on `member` of a request whose first block key is
    /// `key`, at `now` (the oldest probe is dropped beyond [`MAX_PENDING`]).
    fn placed(&mut self, member: Member, key: BlockKey, now: Instant) {
        if self.pending.len() >= MAX_PENDING {
            self.pending.pop_front();
        }
        self.pending.push_back(Probe {
            key,
            placed: now,
            routed: vec![member],
            seen: Vec::new(),
        });
        self.reindex();
    }

    /// Rebuilds [`Self::keys`] from the pending probes.
    fn reindex(&mut self) {
        self.keys.clear();
        self.keys.extend(self.pending.iter().map(|p| p.key));
        self.keys.sort_unstable();
    }

    /// `member`'s stream published `keys` (stored blocks, index keys): marks the pending
    /// probes of those keys as seen there and resolves those that are decided.
    pub fn observed(&mut self, member: Member, keys: &[BlockKey]) {
        self.observed_at(member, keys, Instant::now());
    }

    /// [`Self::observed`] at `now`.
    pub fn observed_at(&mut self, member: Member, keys: &[BlockKey], now: Instant) {
        if self.pending.is_empty() {
            return;
        }
        if !keys.is_empty() {
            self.active.insert(member, now);
        }
        let mut touched = false;
        for k in keys {
            if self.keys.binary_search(k).is_err() {
                continue;
            }
            for p in self.pending.iter_mut().filter(|p| p.key == *k) {
                if !p.seen.contains(&member) {
                    p.seen.push(member);
                    touched = true;
                }
            }
        }
        if touched {
            self.settle(None);
        }
    }

    /// Resolves what is decided among the pending probes; with `expire` (the readiness pass,
    /// with the service's current `members` and the time), also drops probes of members that
    /// left and ends those older than [`PROBE_WINDOW`], and forgets the outcomes of members
    /// that left.
    pub fn resolve(&mut self, members: &[Member], now: Instant) {
        self.settle(Some((members, now)));
        self.outcomes.retain(|m, _| members.contains(m));
        self.active.retain(|m, _| members.contains(m));
        self.tally.retain(|m, _| members.contains(m));
    }

    fn settle(&mut self, expire: Option<(&[Member], Instant)>) {
        let mut keep = VecDeque::with_capacity(self.pending.len());
        while let Some(p) = self.pending.pop_front() {
            if let Some((members, _)) = expire
                && !members.contains(&p.routed[0])
            {
                continue;
            }
            let expired =
                expire.is_some_and(|(_, now)| now.duration_since(p.placed) >= PROBE_WINDOW);
            match (decide(&p), expired) {
                (Some(o), _) => self.record(p.routed[0], o),
                (None, false) => keep.push_back(p),
                (None, true) => {
                    // Unseen counts only if its stream delivered blocks meanwhile (someone's):
                    // an engine that failed the request, or publishes nothing, is quiet.
                    let y = p.routed[0];
                    let busy = self.active.get(&y).is_some_and(|t| *t >= p.placed);
                    if p.routed.len() == 1 && p.seen.is_empty() && busy {
                        self.record(y, Outcome::Unseen);
                    }
                }
            }
        }
        self.pending = keep;
        self.reindex();
    }

    fn record(&mut self, member: Member, o: Outcome) {
        self.tally.entry(member).or_default()[o.index()] += 1;
        let ring = self.outcomes.entry(member).or_default();
        if ring.len() >= OUTCOMES {
            ring.pop_front();
        }
        ring.push_back(o);
    }

    /// `member`'s verdict from its kept outcomes (see the module doc); `None` while one of
    /// them landed or the evidence is short, and an `Unseen` verdict only when `holds_blocks`
    /// (the index holds blocks of `member`: its stream carries someone's engine; without any,
    /// placements published nowhere say nothing of whose). Strays to several endpoints name
    /// the most frequent (the lowest id on a tie).
    pub fn verdict(&self, member: Member, holds_blocks: bool) -> Option<Verdict> {
        match self.evidence(member)? {
            Verdict::Unseen { .. } if !holds_blocks => None,
            v => Some(v),
        }
    }

    /// [`Self::verdict`] before the `holds_blocks` gate.
    fn evidence(&self, member: Member) -> Option<Verdict> {
        let ring = self.outcomes.get(&member)?;
        if ring.contains(&Outcome::Landed) {
            return None;
        }
        let of = ring.len();
        let mut counts: Vec<(Member, usize)> = Vec::new();
        for o in ring {
            if let Outcome::Strayed(x) = o {
                match counts.iter_mut().find(|(m, _)| m == x) {
                    Some(c) => c.1 += 1,
                    None => counts.push((*x, 1)),
                }
            }
        }
        if let Some((to, n)) = counts
            .iter()
            .copied()
            .filter(|(_, n)| *n >= MIN_EVIDENCE)
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
        {
            return Some(Verdict::Strays { to, n, of });
        }
        let n = ring.iter().filter(|o| **o == Outcome::Unseen).count();
        (counts.is_empty() && n >= MIN_EVIDENCE).then_some(Verdict::Unseen { n, of })
    }

    /// The member whose placements' blocks `member`'s stream carries: the lowest member `y`
    /// whose verdict strays to `member`, with that verdict.
    pub fn carries(&self, member: Member) -> Option<(Member, Verdict)> {
        let mut ys: Vec<Member> = self.outcomes.keys().copied().collect();
        ys.sort_unstable();
        ys.into_iter().find_map(|y| match self.evidence(y) {
            Some(v @ Verdict::Strays { to, .. }) if to == member => Some((y, v)),
            _ => None,
        })
    }

    /// Every member with a verdict and every member a verdict strays to (ascending, each
    /// once): their inventories are not their engines' caches. `holds_blocks` says whether
    /// the index holds blocks of a member (its [`Self::verdict`] gate).
    pub fn suspects(&self, holds_blocks: impl Fn(Member) -> bool) -> Vec<Member> {
        let mut out = Vec::new();
        for &y in self.outcomes.keys() {
            match self.verdict(y, holds_blocks(y)) {
                Some(Verdict::Strays { to, .. }) => {
                    out.push(y);
                    out.push(to);
                }
                Some(Verdict::Unseen { .. }) => out.push(y),
                None => {}
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Drops everything known of `member` (it left the rule).
    pub fn forget(&mut self, member: Member) {
        self.pending.retain(|p| p.routed[0] != member);
        for p in self.pending.iter_mut() {
            p.routed.retain(|m| *m != member);
            p.seen.retain(|m| *m != member);
        }
        self.reindex();
        self.outcomes.remove(&member);
        self.active.remove(&member);
        self.tally.remove(&member);
    }

    /// The outcomes resolved per member since the last call (counts by [`OUTCOME_LABELS`]
    /// position), for `loxilb_kv_cross_probes_total`; members that left are dropped by
    /// [`Self::resolve`] and [`Self::forget`] before they are taken.
    pub fn take_tally(&mut self) -> HashMap<Member, [u64; 3]> {
        std::mem::take(&mut self.tally)
    }

    /// Unresolved probes.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }
}

/// The outcome of probe `p` if it is decided: only a probe routed to one endpoint is
/// evidence (landed: seen there and nowhere else; strayed: seen where it was not routed and
/// not on its endpoint's stream).
fn decide(p: &Probe) -> Option<Outcome> {
    let [y] = p.routed[..] else {
        return None;
    };
    if p.seen.contains(&y) {
        return (p.seen.len() == 1).then_some(Outcome::Landed);
    }
    p.seen.first().map(|&x| Outcome::Strayed(x))
}

#[cfg(test)]
#[path = "cross_tests.rs"]
mod tests;
