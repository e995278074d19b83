//! Differential test of [`KvIndex`] against a plain model: per stream a `key → refcount` map
//! and a FIFO of gained keys, predictions as `key → [(endpoint, expiry)]`, and scores computed
//! by walking the request once per stream. Seeded random event streams of chain stores (whole,
//! partial, orphan tails), middle-block removes, double stores, ranks (one above
//! [`MAX_RANK`]), both tiers, the cap, predictions with expiry and sweeps, `clear_rank`,
//! `clear_endpoint` and `forget`; after every event the two must agree on `score` (with a
//! reused scratch), `any_tier_runs`, `keys_of`, `blocks`, `evictions` and `predicted_len`.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// One event stream of the model: `(endpoint, rank, offload?)`.
type Stream = (Member, u32, bool);

#[derive(Default)]
struct ModelStream {
    refs: HashMap<u64, u32>,
    fifo: VecDeque<u64>,
}

struct Model {
    cap: u64,
    streams: HashMap<Stream, ModelStream>,
    predicted: HashMap<u64, Vec<(Member, Instant)>>,
    evictions: u64,
}

impl Model {
    fn new(cap: u64) -> Self {
        Self {
            cap,
            streams: HashMap::new(),
            predicted: HashMap::new(),
            evictions: 0,
        }
    }

    fn store(&mut self, ep: Member, rank: u32, offload: bool, keys: &[u64]) -> StoreOutcome {
        let st = self
            .streams
            .entry((ep, rank.min(MAX_RANK), offload))
            .or_default();
        let mut out = StoreOutcome::default();
        for &k in keys {
            if let Some(v) = self.predicted.get_mut(&k) {
                v.retain(|(e, _)| *e != ep);
                if v.is_empty() {
                    self.predicted.remove(&k);
                }
            }
            match st.refs.get_mut(&k) {
                Some(n) => *n = n.saturating_add(1),
                None => {
                    st.refs.insert(k, 1);
                    st.fifo.push_back(k);
                    out.added += 1;
                }
            }
        }
        while st.refs.len() as u64 > self.cap {
            let Some(k) = st.fifo.pop_front() else { break };
            if st.refs.remove(&k).is_some() {
                out.evicted += 1;
            }
        }
        self.evictions += out.evicted;
        out
    }

    fn remove(&mut self, ep: Member, rank: u32, offload: bool, keys: &[u64]) -> u64 {
        let st = self
            .streams
            .entry((ep, rank.min(MAX_RANK), offload))
            .or_default();
        let mut dropped = 0;
        for k in keys {
            if let Some(n) = st.refs.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    st.refs.remove(k);
                    dropped += 1;
                }
            }
        }
        // The same lazy FIFO cleaning as the index: keep the latest occurrence of held keys.
        if st.fifo.len() as u64 > 2 * st.refs.len() as u64 + 1024 {
            let mut seen = std::collections::HashSet::new();
            let mut kept: Vec<u64> = st
                .fifo
                .iter()
                .rev()
                .filter(|k| st.refs.contains_key(k) && seen.insert(**k))
                .copied()
                .collect();
            kept.reverse();
            st.fifo = kept.into();
        }
        dropped
    }

    fn clear_rank(&mut self, ep: Member, rank: u32) {
        for offload in [false, true] {
            self.streams.remove(&(ep, rank.min(MAX_RANK), offload));
        }
    }

    fn forget(&mut self, ep: Member) {
        for r in 0..=MAX_RANK {
            self.clear_rank(ep, r);
        }
        self.predicted.retain(|_, v| {
            v.retain(|(e, _)| *e != ep);
            !v.is_empty()
        });
    }

    fn gpu_holds(&self, ep: Member, k: u64) -> bool {
        (0..=MAX_RANK).any(|r| {
            self.streams
                .get(&(ep, r, false))
                .is_some_and(|s| s.refs.contains_key(&k))
        })
    }

    fn predict(&mut self, ep: Member, keys: &[u64], expires: Instant) {
        for &k in keys {
            if self.gpu_holds(ep, k) {
                continue;
            }
            let v = self.predicted.entry(k).or_default();
            match v.iter_mut().find(|(e, _)| *e == ep) {
                Some(e) => e.1 = expires,
                None => v.push((ep, expires)),
            }
        }
    }

    fn sweep(&mut self, now: Instant) {
        self.predicted.retain(|_, v| {
            v.retain(|(_, exp)| *exp > now);
            !v.is_empty()
        });
    }

    fn pred(&self, ep: Member, k: u64, now: Instant) -> bool {
        self.predicted
            .get(&k)
            .is_some_and(|v| v.iter().any(|(e, exp)| *e == ep && *exp > now))
    }

    /// The longest leading run over `ep`'s GPU streams (continuing through its live
    /// predictions) and its predicted stream (through its predictions and any GPU rank's
    /// blocks).
    fn score_of(&self, ep: Member, request: &[u64], now: Instant) -> usize {
        let Some(&k0) = request.first() else { return 0 };
        let mut best = 0;
        for r in 0..=MAX_RANK {
            if let Some(s) = self.streams.get(&(ep, r, false))
                && s.refs.contains_key(&k0)
            {
                let run = request
                    .iter()
                    .take_while(|&&k| s.refs.contains_key(&k) || self.pred(ep, k, now))
                    .count();
                best = best.max(run);
            }
        }
        if self.pred(ep, k0, now) {
            let run = request
                .iter()
                .take_while(|&&k| self.pred(ep, k, now) || self.gpu_holds(ep, k))
                .count();
            best = best.max(run);
        }
        best
    }

    fn score(&self, eps: usize, request: &[u64], now: Instant) -> Vec<(Member, usize)> {
        (0..eps)
            .map(|e| (e, self.score_of(e, request, now)))
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    fn any_tier_runs(&self, eps: usize, request: &[u64]) -> Vec<(Member, usize)> {
        let offload_held = self
            .streams
            .iter()
            .any(|(&(_, _, off), s)| off && !s.refs.is_empty());
        if !offload_held {
            return Vec::new();
        }
        (0..eps)
            .map(|e| {
                let run = request
                    .iter()
                    .take_while(|k| {
                        self.streams
                            .iter()
                            .any(|(&(ep, _, _), s)| ep == e && s.refs.contains_key(k))
                    })
                    .count();
                (e, run)
            })
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    /// Each held key once, at its first place (rank order, GPU before offload, oldest first).
    fn keys_of(&self, ep: Member) -> Vec<BlockKey> {
        let mut out: Vec<BlockKey> = Vec::new();
        for r in 0..=MAX_RANK {
            for offload in [false, true] {
                if let Some(s) = self.streams.get(&(ep, r, offload)) {
                    for &k in s.fifo.iter().filter(|k| s.refs.contains_key(k)) {
                        if !out.contains(&BlockKey(k)) {
                            out.push(BlockKey(k));
                        }
                    }
                }
            }
        }
        out
    }

    fn blocks(&self, ep: Member) -> u64 {
        self.streams
            .iter()
            .filter(|&(&(e, _, _), _)| e == ep)
            .map(|(_, s)| s.refs.len() as u64)
            .sum()
    }
}

fn tier(offload: bool) -> Tier {
    if offload { Tier::Offload } else { Tier::Gpu }
}

fn bk(v: &[u64]) -> Vec<BlockKey> {
    v.iter().map(|&k| BlockKey(k)).collect()
}

/// A request: a document's prefix, sometimes cut in, with one block replaced, or shuffled
/// keys of several documents.
fn request(rng: &mut StdRng, docs: &[Vec<u64>]) -> Vec<u64> {
    let d = &docs[rng.random_range(0..docs.len())];
    let mut r: Vec<u64> = match rng.random_range(0..10) {
        0 => {
            let from = rng.random_range(0..d.len());
            d[from..].to_vec()
        }
        1 => (0..rng.random_range(1..8))
            .map(|_| {
                let d = &docs[rng.random_range(0..docs.len())];
                d[rng.random_range(0..d.len())]
            })
            .collect(),
        _ => d[..rng.random_range(1..=d.len())].to_vec(),
    };
    if rng.random_range(0..5) == 0 {
        let i = rng.random_range(0..r.len());
        r[i] = rng.random_range(10_000..10_010);
    }
    r
}

/// Runs one seeded stream of `steps` events over `eps` endpoints with per-stream cap `cap`.
fn run(seed: u64, eps: usize, cap: u64, steps: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    // Documents: a few shared system prefixes, each continued by several conversations, so
    // chains share heads and holder sets repeat along them.
    let mut docs: Vec<Vec<u64>> = Vec::new();
    for sys in 0..4u64 {
        let head: Vec<u64> = (0..rng.random_range(4..24))
            .map(|j| 1_000 * (sys + 1) + j)
            .collect();
        for conv in 0..4u64 {
            let mut d = head.clone();
            d.extend((0..rng.random_range(2..30)).map(|j| 100_000 * (sys + 1) + 1_000 * conv + j));
            docs.push(d);
        }
    }
    let ix = KvIndex::new(cap);
    let mut m = Model::new(cap);
    let base = Instant::now();
    let mut ms = 0u64;
    let mut scratch = ScoreScratch::default();
    for step in 0..steps {
        ms += rng.random_range(0..40);
        let now = base + Duration::from_millis(ms);
        let ep = rng.random_range(0..eps);
        let rank = match rng.random_range(0..8) {
            0 => 20,
            1 | 2 => 1,
            _ => 0,
        };
        let offload = rng.random_range(0..6) == 0;
        let d = &docs[rng.random_range(0..docs.len())];
        let a = rng.random_range(0..d.len());
        let b = rng.random_range(a..=d.len()).max(a + 1);
        let what = rng.random_range(0..100);
        let ctx = format!("seed {seed} step {step} event {what}");
        match what {
            // A chain: the whole document from the start, or a tail (an orphan).
            0..=39 => {
                let keys = if what < 25 { &d[..b] } else { &d[a..b] };
                assert_eq!(
                    ix.store_in(ep, rank, tier(offload), &bk(keys)),
                    m.store(ep, rank, offload, keys),
                    "{ctx}"
                );
            }
            // Middle blocks removed, in any order, sometimes twice.
            40..=59 => {
                let mut keys: Vec<u64> = d[a..b]
                    .iter()
                    .copied()
                    .filter(|_| rng.random_range(0..3) > 0)
                    .collect();
                if rng.random_range(0..4) == 0 {
                    keys.reverse();
                    keys.extend_from_slice(&d[a..b]);
                }
                assert_eq!(
                    ix.remove_in(ep, rank, tier(offload), &bk(&keys)),
                    m.remove(ep, rank, offload, &keys),
                    "{ctx}"
                );
            }
            // Leaf-first eviction of a document's tail.
            60..=67 => {
                let keys: Vec<u64> = d[a..].iter().rev().copied().collect();
                assert_eq!(
                    ix.remove_in(ep, rank, tier(offload), &bk(&keys)),
                    m.remove(ep, rank, offload, &keys),
                    "{ctx}"
                );
            }
            68..=79 => {
                let keys = request(&mut rng, &docs);
                let until = now + Duration::from_millis(rng.random_range(1..400));
                ix.predict(ep, &bk(&keys), until);
                m.predict(ep, &keys, until);
            }
            80..=84 => {
                ix.sweep_predicted(now);
                m.sweep(now);
            }
            85..=88 => {
                ix.clear_rank(ep, rank);
                m.clear_rank(ep, rank);
            }
            89..=90 => {
                ix.clear_endpoint(ep);
                for r in 0..=MAX_RANK {
                    m.clear_rank(ep, r);
                }
            }
            91 => {
                ix.forget(ep);
                m.forget(ep);
            }
            // Scattered single keys: chains of one, and keys far from their neighbours.
            _ => {
                let keys: Vec<u64> = (0..rng.random_range(1..6))
                    .map(|_| {
                        let d = &docs[rng.random_range(0..docs.len())];
                        d[rng.random_range(0..d.len())]
                    })
                    .collect();
                assert_eq!(
                    ix.store_in(ep, rank, tier(offload), &bk(&keys)),
                    m.store(ep, rank, offload, &keys),
                    "{ctx}"
                );
            }
        }
        for _ in 0..3 {
            let r = request(&mut rng, &docs);
            let want = m.score(eps, &r, now);
            assert_eq!(
                ix.score_with(&bk(&r), now, &mut scratch),
                want.as_slice(),
                "{ctx}: score of {r:?}"
            );
            assert_eq!(ix.score(&bk(&r), now), want, "{ctx}: score of {r:?}");
            assert_eq!(
                ix.any_tier_runs(&bk(&r)),
                m.any_tier_runs(eps, &r),
                "{ctx}: any_tier_runs of {r:?}"
            );
        }
        for e in 0..eps {
            assert_eq!(ix.blocks(e), m.blocks(e), "{ctx}: blocks of {e}");
            if step % 8 == 0 {
                assert_eq!(ix.keys_of(e), m.keys_of(e), "{ctx}: keys_of {e}");
                for k in docs[step % docs.len()].iter().take(4) {
                    assert_eq!(
                        ix.holds_key(e, BlockKey(*k)),
                        (0..=MAX_RANK).any(|r| [false, true].iter().any(|&off| m
                            .streams
                            .get(&(e, r, off))
                            .is_some_and(|s| s.refs.contains_key(k)))),
                        "{ctx}: holds_key {e} {k}"
                    );
                }
            }
        }
        assert_eq!(ix.evictions(), m.evictions, "{ctx}: evictions");
        assert_eq!(
            ix.predicted_len(),
            m.predicted.len(),
            "{ctx}: predicted_len"
        );
    }
}

#[test]
fn random_streams_match_the_model_without_a_binding_cap() {
    for seed in 0..6 {
        run(seed, 5, 1_000_000, 1_500);
    }
}

#[test]
fn random_streams_match_the_model_under_the_cap() {
    for seed in 100..106 {
        run(seed, 4, 24, 1_500);
    }
}

#[test]
fn random_streams_match_the_model_with_many_endpoints_sharing_prefixes() {
    // Many holders per block: long runs of identical interned sets, and set transitions.
    for seed in 200..203 {
        run(seed, 24, 200, 1_200);
    }
}
