//! The per-service KV block index: block key → the (endpoint, DP rank) streams holding it.
//!
//! Layout (see `README.md`): `SHARDS` shards, each a `parking_lot::RwLock` over an open-addressing
//! map `u64 → packed holder word` (16 bytes per entry). A holder word is either one inline
//! `(slot, refcount)` pair or, with the top bit set, an index into the shard's side table of
//! holder lists (blocks held by several streams). A *slot* is `ep << 5 | tier << 4 | rank`
//! (ranks 0..=14; tier 0 = the engine's GPU, 1 = its offload tier: CPU or any non-GPU
//! `medium`); slot `ep << 5 | 15` holds *predicted* blocks (inserted after routing, with a TTL). `ep` here
//! is the endpoint's [`Member`] id (stable across rule updates, `kv::members`), not its position
//! in the rule.
//!
//! Refcounts: vLLM can store the same hash twice (two physical copies); one `BlockRemoved`
//! decrements, the block leaves the slot at zero. Each slot keeps a FIFO of the keys it gained
//! (lazily cleaned) for the `LOXILB_KV_MAX_BLOCKS` cap: over the cap the oldest held key is
//! evicted and counted. Scoring walks the request's keys in order and returns, per endpoint, the
//! length of the leading run of request blocks one of its slots holds: O(request blocks ×
//! holders per block), independent of the index size.
//!
//! Scope: one index per service (rule). A service fronts one model pool; events carry no model
//! name, and vLLM mixes the LoRA name into the block hash, so blocks of different adapters never
//! collide. Two different base models would need two rules (LoxiLB's "one model per rule").

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};
use tokio::time::Instant;

use super::BlockKey;
use super::members::Member;

const SHARDS: usize = 16;
const MULTI: u64 = 1 << 63;
/// The rank value reserved for predicted blocks.
pub const PREDICTED_RANK: u32 = 15;
/// Highest DP rank an event stream may use.
pub const MAX_RANK: u32 = 14;

/// Hasher for keys that already are digest bytes: one multiply spreads them over the table.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// Which tier of an engine holds a block (`medium` of the event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// GPU memory (`medium` `GPU` or absent): a prefix hit is free.
    Gpu,
    /// The offload tier (`medium` `CPU` or any other non-GPU value): a hit loads the blocks
    /// back; scored with `LOXI_KV_CPU_TIER_CREDIT`.
    Offload,
}

const OFFLOAD_BIT: u32 = 1 << 4;

fn slot_in(ep: Member, rank: u32, tier: Tier) -> u32 {
    let t = match tier {
        Tier::Gpu => 0,
        Tier::Offload => OFFLOAD_BIT,
    };
    ((ep as u32) << 5) | t | (rank & 0xF)
}

fn slot(ep: Member, rank: u32) -> u32 {
    slot_in(ep, rank, Tier::Gpu)
}

fn slot_ep(slot: u32) -> Member {
    (slot >> 5) as Member
}

fn is_offload(slot: u32) -> bool {
    slot & OFFLOAD_BIT != 0
}

fn pack_one(slot: u32, refs: u32) -> u64 {
    (u64::from(slot) << 32) | u64::from(refs)
}

#[derive(Default)]
struct Shard {
    map: KeyMap<u64>,
    multi: Vec<Vec<(u32, u32)>>,
    free: Vec<u32>,
    /// Predicted holders of a key: (endpoint, expiry).
    predicted: KeyMap<Vec<(u32, Instant)>>,
}

impl Shard {
    fn holders(&self, key: u64) -> Holders<'_> {
        match self.map.get(&key) {
            None => Holders::None,
            Some(&w) if w & MULTI != 0 => Holders::Many(&self.multi[(w & !MULTI) as usize]),
            Some(&w) => Holders::One((w >> 32) as u32),
        }
    }

    /// Adds one reference of `slot`; true when the slot newly holds the key.
    fn add(&mut self, key: u64, slot: u32) -> bool {
        let Some(&w) = self.map.get(&key) else {
            self.map.insert(key, pack_one(slot, 1));
            return true;
        };
        if w & MULTI != 0 {
            let list = &mut self.multi[(w & !MULTI) as usize];
            return match list.iter_mut().find(|(s, _)| *s == slot) {
                Some(e) => {
                    e.1 = e.1.saturating_add(1);
                    false
                }
                None => {
                    list.push((slot, 1));
                    true
                }
            };
        }
        let (s, refs) = ((w >> 32) as u32, w as u32);
        if s == slot {
            self.map.insert(key, pack_one(slot, refs.saturating_add(1)));
            return false;
        }
        let idx = self.alloc(vec![(s, refs), (slot, 1)]);
        self.map.insert(key, MULTI | u64::from(idx));
        true
    }

    fn alloc(&mut self, list: Vec<(u32, u32)>) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.multi[i as usize] = list;
                i
            }
            None => {
                self.multi.push(list);
                (self.multi.len() - 1) as u32
            }
        }
    }

    /// Drops `count` references of `slot` (`u32::MAX` = all); true when the slot lost the key.
    fn sub(&mut self, key: u64, slot: u32, count: u32) -> bool {
        let Some(&w) = self.map.get(&key) else {
            return false;
        };
        if w & MULTI == 0 {
            let (s, refs) = ((w >> 32) as u32, w as u32);
            if s != slot {
                return false;
            }
            if refs > count {
                self.map.insert(key, pack_one(slot, refs - count));
                return false;
            }
            self.map.remove(&key);
            return true;
        }
        let idx = (w & !MULTI) as u32;
        let list = &mut self.multi[idx as usize];
        let Some(pos) = list.iter().position(|(s, _)| *s == slot) else {
            return false;
        };
        if list[pos].1 > count {
            list[pos].1 -= count;
            return false;
        }
        list.swap_remove(pos);
        if list.len() == 1 {
            let (s, r) = list[0];
            self.multi[idx as usize] = Vec::new();
            self.free.push(idx);
            self.map.insert(key, pack_one(s, r));
        }
        true
    }
}

enum Holders<'a> {
    None,
    One(u32),
    Many(&'a [(u32, u32)]),
}

impl Holders<'_> {
    fn for_each(&self, mut f: impl FnMut(u32)) {
        match self {
            Holders::None => {}
            Holders::One(s) => f(*s),
            Holders::Many(l) => l.iter().for_each(|(s, _)| f(*s)),
        }
    }
}

/// Per-slot bookkeeping: how many keys it holds and the order it gained them (for the cap).
#[derive(Default)]
struct SlotState {
    held: u64,
    fifo: VecDeque<u64>,
}

/// What a store did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StoreOutcome {
    /// Keys the slot did not hold before.
    pub added: u64,
    /// Keys evicted to respect the block cap.
    pub evicted: u64,
}

/// The block index of one service. All methods take `&self`; reads take shard read locks only.
pub struct KvIndex {
    shards: Box<[RwLock<Shard>]>,
    slots: Mutex<HashMap<u32, SlotState>>,
    max_blocks: u64,
    evictions: AtomicU64,
    /// Confirmed blocks per endpoint (all ranks), kept by the writers under `slots` so that
    /// request-time reads ([`Self::blocks`]) take no mutex.
    ep_blocks: RwLock<Vec<AtomicU64>>,
    /// Offload-tier keys held (all endpoints): scoring walks the offload tier only when > 0.
    offload_held: AtomicU64,
}

/// Interval of the background predicted-block sweep (`kv::wiring`): expired predictions never
/// score, the sweep only frees their memory.
pub const SWEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Reusable buffers of [`KvIndex::score_with`].
#[derive(Debug, Default)]
pub struct ScoreScratch {
    alive: Vec<u32>,
    here: Vec<u32>,
    predicted: Vec<Member>,
    best: Vec<(Member, usize)>,
    /// Per slot / per endpoint, the stamp of the last request block that listed it among its
    /// holders: membership tests in O(1), so a block costs O(alive + holders), not their
    /// product (64 holders per block made a 176-block query 40 µs).
    slot_seen: Vec<u32>,
    ep_seen: Vec<u32>,
    stamp: u32,
}

impl ScoreScratch {
    /// Stamps `here`'s slots and endpoints as seen at a new stamp, which it returns.
    fn mark(&mut self) -> u32 {
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.slot_seen.fill(0);
            self.ep_seen.fill(0);
            self.stamp = 1;
        }
        for &s in &self.here {
            let (si, ep) = (s as usize, slot_ep(s));
            if self.slot_seen.len() <= si {
                self.slot_seen.resize(si + 1, 0);
            }
            self.slot_seen[si] = self.stamp;
            // Offload-tier copies do not continue a GPU run: only GPU holders mark their
            // endpoint (alive streams are GPU slots, so `slot_seen` needs no filter).
            if is_offload(s) {
                continue;
            }
            if self.ep_seen.len() <= ep {
                self.ep_seen.resize(ep + 1, 0);
            }
            self.ep_seen[ep] = self.stamp;
        }
        self.stamp
    }
}

impl KvIndex {
    /// An empty index whose streams hold at most `max_blocks` keys each (`LOXILB_KV_MAX_BLOCKS`).
    pub fn new(max_blocks: u64) -> Self {
        let shards = (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect();
        Self {
            shards,
            slots: Mutex::new(HashMap::new()),
            max_blocks: max_blocks.max(1),
            evictions: AtomicU64::new(0),
            ep_blocks: RwLock::new(Vec::new()),
            offload_held: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: u64) -> &RwLock<Shard> {
        &self.shards[(key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize % SHARDS]
    }

    /// Applies a GPU `BlockStored` from endpoint `ep`, DP rank `rank` (ranks above
    /// [`MAX_RANK`] are folded onto it). Evicts the slot's oldest keys beyond the cap.
    pub fn store(&self, ep: Member, rank: u32, keys: &[BlockKey]) -> StoreOutcome {
        self.store_in(ep, rank, Tier::Gpu, keys)
    }

    /// [`Self::store`] into `tier` (each tier of a stream is capped on its own).
    pub fn store_in(&self, ep: Member, rank: u32, tier: Tier, keys: &[BlockKey]) -> StoreOutcome {
        let s = slot_in(ep, rank.min(MAX_RANK), tier);
        let mut slots = self.slots.lock();
        let st = slots.entry(s).or_default();
        let mut out = StoreOutcome::default();
        for k in keys {
            let mut sh = self.shard(k.0).write();
            unpredict(&mut sh, k.0, ep);
            if sh.add(k.0, s) {
                st.held += 1;
                st.fifo.push_back(k.0);
                out.added += 1;
            }
        }
        out.evicted = self.enforce_cap(s, st);
        self.count(ep, out.added as i64 - out.evicted as i64);
        if tier == Tier::Offload {
            self.offload_held.fetch_add(out.added, Ordering::Relaxed);
            self.offload_held.fetch_sub(out.evicted, Ordering::Relaxed);
        }
        out
    }

    fn enforce_cap(&self, s: u32, st: &mut SlotState) -> u64 {
        let mut evicted = 0;
        while st.held > self.max_blocks {
            let Some(k) = st.fifo.pop_front() else { break };
            if self.shard(k).write().sub(k, s, u32::MAX) {
                st.held -= 1;
                evicted += 1;
            }
        }
        self.evictions.fetch_add(evicted, Ordering::Relaxed);
        evicted
    }

    /// Applies a GPU `BlockRemoved` (one reference per listed key).
    pub fn remove(&self, ep: Member, rank: u32, keys: &[BlockKey]) -> u64 {
        self.remove_in(ep, rank, Tier::Gpu, keys)
    }

    /// [`Self::remove`] from `tier` only (the other tier's copy stays).
    pub fn remove_in(&self, ep: Member, rank: u32, tier: Tier, keys: &[BlockKey]) -> u64 {
        let s = slot_in(ep, rank.min(MAX_RANK), tier);
        let mut slots = self.slots.lock();
        let st = slots.entry(s).or_default();
        let mut dropped = 0;
        for k in keys {
            if self.shard(k.0).write().sub(k.0, s, 1) {
                st.held -= 1;
                dropped += 1;
            }
        }
        if st.fifo.len() as u64 > 2 * st.held + 1024 {
            self.compact(s, st);
        }
        self.count(ep, -(dropped as i64));
        if tier == Tier::Offload {
            self.offload_held.fetch_sub(dropped, Ordering::Relaxed);
        }
        dropped
    }

    /// Rebuilds a slot's FIFO without keys it no longer holds (keeps the latest occurrence).
    fn compact(&self, s: u32, st: &mut SlotState) {
        let mut seen = std::collections::HashSet::new();
        let mut kept: Vec<u64> = Vec::with_capacity(st.held as usize);
        for &k in st.fifo.iter().rev() {
            let held = {
                let sh = self.shard(k).read();
                let mut found = false;
                sh.holders(k).for_each(|x| found |= x == s);
                found
            };
            if held && seen.insert(k) {
                kept.push(k);
            }
        }
        kept.reverse();
        st.fifo = kept.into();
    }

    /// Drops every key of one (endpoint, rank) stream, on both tiers.
    pub fn clear_rank(&self, ep: Member, rank: u32) {
        let mut slots = self.slots.lock();
        for tier in [Tier::Gpu, Tier::Offload] {
            let s = slot_in(ep, rank.min(MAX_RANK), tier);
            if let Some(st) = slots.remove(&s) {
                self.count(ep, -(st.held as i64));
                if tier == Tier::Offload {
                    self.offload_held.fetch_sub(st.held, Ordering::Relaxed);
                }
                for k in st.fifo {
                    self.shard(k).write().sub(k, s, u32::MAX);
                }
            }
        }
    }

    /// Drops every confirmed key of every rank of `ep` (`AllBlocksCleared`). Its predictions
    /// stay: vLLM refuses `reset_prefix_cache` while any block is in use, so a live prediction
    /// stands for a request dispatched after the reset, which will store its blocks again; and
    /// vLLM publishes the clear with its next engine step, i.e. typically right after such a
    /// request arrived, so dropping them would scatter that request's followers. They expire
    /// with their TTL.
    pub fn clear_endpoint(&self, ep: Member) {
        for r in 0..=MAX_RANK {
            self.clear_rank(ep, r);
        }
    }

    /// Drops everything of `ep`: its confirmed keys on every rank and its predictions (its
    /// endpoint left the rule). O(index size) for the predictions: a fleet change, not a
    /// request, pays it.
    pub fn forget(&self, ep: Member) {
        self.clear_endpoint(ep);
        for sh in self.shards.iter() {
            sh.write().predicted.retain(|_, v| {
                v.retain(|(e, _)| *e != ep as u32);
                !v.is_empty()
            });
        }
        if let Some(n) = self.ep_blocks.read().get(ep) {
            n.store(0, Ordering::Relaxed);
        }
    }

    /// Marks `keys` as predicted on `ep` until `expires` (after routing a request there).
    /// A later real store of a key by `ep` replaces the prediction.
    pub fn predict(&self, ep: Member, keys: &[BlockKey], expires: Instant) {
        for k in keys {
            let mut sh = self.shard(k.0).write();
            let real = {
                let mut found = false;
                sh.holders(k.0)
                    .for_each(|x| found |= slot_ep(x) == ep && !is_offload(x));
                found
            };
            if !real {
                let v = sh.predicted.entry(k.0).or_default();
                match v.iter_mut().find(|(e, _)| *e == ep as u32) {
                    Some(e) => e.1 = expires,
                    None => v.push((ep as u32, expires)),
                }
            }
        }
    }

    /// Removes predictions that expired at or before `now`.
    pub fn sweep_predicted(&self, now: Instant) {
        for sh in self.shards.iter() {
            sh.write().predicted.retain(|_, v| {
                v.retain(|(_, exp)| *exp > now);
                !v.is_empty()
            });
        }
    }

    /// Per endpoint, the number of leading request blocks one of its streams holds (its
    /// contiguous cached prefix), predictions that have not expired at `now` included.
    /// Endpoints with 0 are omitted; the result is sorted by endpoint index.
    pub fn score(&self, keys: &[BlockKey], now: Instant) -> Vec<(Member, usize)> {
        self.score_with(keys, now, &mut ScoreScratch::default())
            .to_vec()
    }

    /// [`Self::score`] into `scratch`'s buffers: no allocation once they have grown to the
    /// request's holder count. Takes one shard read lock per request block.
    pub fn score_with<'s>(
        &self,
        keys: &[BlockKey],
        now: Instant,
        scratch: &'s mut ScoreScratch,
    ) -> &'s [(Member, usize)] {
        scratch.alive.clear();
        scratch.best.clear();
        for (i, k) in keys.iter().enumerate() {
            // A block with exactly the previous block's holders (same order) and no
            // predictions on either keeps every live stream: skipped without the per-stream
            // pass (shared prefixes replicated on many endpoints).
            let unchanged =
                i > 0 && scratch.predicted.is_empty() && self.same_holders(k.0, &scratch.here);
            if unchanged {
                continue;
            }
            self.holders_at(k.0, now, &mut scratch.here, &mut scratch.predicted);
            if i == 0 {
                let ScoreScratch {
                    alive,
                    here,
                    predicted,
                    ..
                } = &mut *scratch;
                alive.extend(here.iter().filter(|&&s| !is_offload(s)));
                alive.extend(predicted.iter().map(|&ep| slot(ep, PREDICTED_RANK)));
            } else {
                let stamp = scratch.mark();
                let ScoreScratch {
                    alive,
                    predicted,
                    best,
                    slot_seen,
                    ep_seen,
                    ..
                } = &mut *scratch;
                // A stream continues through a block it holds or its endpoint is predicted to
                // hold (a request just routed there computes it); the predicted stream
                // continues through a block any stream of its endpoint holds.
                alive.retain(|&s| {
                    let ep = slot_ep(s);
                    let go_on = if s & 0xF == PREDICTED_RANK {
                        predicted.contains(&ep) || ep_seen.get(ep) == Some(&stamp)
                    } else {
                        slot_seen.get(s as usize) == Some(&stamp) || predicted.contains(&ep)
                    };
                    if !go_on {
                        record(best, ep, i);
                    }
                    go_on
                });
            }
            if scratch.alive.is_empty() {
                break;
            }
        }
        let ScoreScratch { alive, best, .. } = scratch;
        alive
            .iter()
            .for_each(|&s| record(best, slot_ep(s), keys.len()));
        best.sort_unstable();
        best
    }

    /// Per endpoint, the number of leading request blocks it holds on either tier (GPU or
    /// offload, confirmed blocks only; predictions not counted): the prefix a request could
    /// reuse by loading the offloaded part back. Empty (no walk) when no endpoint holds an
    /// offload-tier block: then the GPU runs of [`Self::score_with`] are the whole answer.
    /// Sorted by endpoint.
    pub fn any_tier_runs(&self, keys: &[BlockKey]) -> Vec<(Member, usize)> {
        let mut best = Vec::new();
        if self.offload_held.load(Ordering::Relaxed) == 0 {
            return best;
        }
        let mut alive: Vec<Member> = Vec::new();
        let mut here: Vec<Member> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            here.clear();
            self.shard(k.0)
                .read()
                .holders(k.0)
                .for_each(|s| here.push(slot_ep(s)));
            if i == 0 {
                alive.extend(here.iter().copied());
                alive.sort_unstable();
                alive.dedup();
            } else {
                alive.retain(|ep| {
                    let go_on = here.contains(ep);
                    if !go_on {
                        record(&mut best, *ep, i);
                    }
                    go_on
                });
            }
            if alive.is_empty() {
                break;
            }
        }
        alive
            .iter()
            .for_each(|&ep| record(&mut best, ep, keys.len()));
        best.sort_unstable();
        best
    }

    /// Fills `here` with the streams holding `key` and `predicted` with the endpoints whose
    /// unexpired prediction covers it.
    fn holders_at(&self, key: u64, now: Instant, here: &mut Vec<u32>, predicted: &mut Vec<Member>) {
        here.clear();
        predicted.clear();
        let sh = self.shard(key).read();
        sh.holders(key).for_each(|s| here.push(s));
        if let Some(p) = sh.predicted.get(&key) {
            p.iter()
                .filter(|(_, exp)| *exp > now)
                .for_each(|(ep, _)| predicted.push(*ep as Member));
        }
    }

    /// True when `key`'s holders are exactly `here` (same order) and it has no prediction
    /// entry (live or expired).
    fn same_holders(&self, key: u64, here: &[u32]) -> bool {
        let sh = self.shard(key).read();
        if sh.predicted.contains_key(&key) {
            return false;
        }
        match sh.holders(key) {
            Holders::None => here.is_empty(),
            Holders::One(s) => here == [s],
            Holders::Many(l) => l.len() == here.len() && l.iter().zip(here).all(|(a, b)| a.0 == *b),
        }
    }

    /// Keys held by `ep` (all ranks, confirmed only), oldest first per rank.
    pub fn keys_of(&self, ep: Member) -> Vec<BlockKey> {
        let slots = self.slots.lock();
        let mut out = Vec::new();
        for s in
            (0..=MAX_RANK).flat_map(|r| [slot_in(ep, r, Tier::Gpu), slot_in(ep, r, Tier::Offload)])
        {
            if let Some(st) = slots.get(&s) {
                out.extend(
                    st.fifo
                        .iter()
                        .filter(|&&k| self.holds(k, s))
                        .map(|&k| BlockKey(k)),
                );
            }
        }
        out.dedup();
        out
    }

    fn holds(&self, key: u64, s: u32) -> bool {
        let mut found = false;
        self.shard(key)
            .read()
            .holders(key)
            .for_each(|x| found |= x == s);
        found
    }

    /// Does `ep` hold `key` on any rank (confirmed blocks only)?
    pub fn holds_key(&self, ep: Member, key: BlockKey) -> bool {
        let mut found = false;
        self.shard(key.0)
            .read()
            .holders(key.0)
            .for_each(|x| found |= slot_ep(x) == ep && x & 0xF != PREDICTED_RANK);
        found
    }

    /// Confirmed keys held by `ep`, summed over its ranks and both tiers. Lock-light: one read lock on the
    /// per-endpoint counters (written only when an endpoint is first seen).
    pub fn blocks(&self, ep: Member) -> u64 {
        self.ep_blocks
            .read()
            .get(ep)
            .map_or(0, |n| n.load(Ordering::Relaxed))
    }

    /// Moves `ep`'s block count by `delta` (called with `slots` held, so writers are serial).
    fn count(&self, ep: Member, delta: i64) {
        if delta == 0 {
            return;
        }
        if self.ep_blocks.read().len() <= ep {
            let mut w = self.ep_blocks.write();
            while w.len() <= ep {
                w.push(AtomicU64::new(0));
            }
        }
        let counts = self.ep_blocks.read();
        let n = &counts[ep];
        if delta > 0 {
            n.fetch_add(delta.unsigned_abs(), Ordering::Relaxed);
        } else {
            n.fetch_sub(delta.unsigned_abs(), Ordering::Relaxed);
        }
    }

    /// Number of keys with a live or expired (not yet swept) prediction.
    pub fn predicted_len(&self) -> usize {
        self.shards.iter().map(|s| s.read().predicted.len()).sum()
    }

    /// Keys evicted by the cap since creation (`loxilb_kv_inv_cap_evictions_total`).
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }
}

fn unpredict(sh: &mut Shard, key: u64, ep: Member) {
    if let Some(v) = sh.predicted.get_mut(&key) {
        v.retain(|(e, _)| *e != ep as u32);
        if v.is_empty() {
            sh.predicted.remove(&key);
        }
    }
}

fn record(best: &mut Vec<(Member, usize)>, ep: Member, len: usize) {
    if len == 0 {
        return;
    }
    match best.iter_mut().find(|(e, _)| *e == ep) {
        Some(e) => e.1 = e.1.max(len),
        None => best.push((ep, len)),
    }
}

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;
