//! The per-service KV block index: block key → the (endpoint, DP rank) streams holding it.
//!
//! Layout (see `README.md`): one `parking_lot::RwLock` over the key space. Keys live in
//! *chains*: the keys of one `store` call, in order (a new key continues the chain of the
//! previous key of the same call when that key is its chain's last, else starts one), each
//! position a key and a 32-bit *holder word*: one inline slot, or an interned (hash-consed)
//! sorted set of slots shared by every position with exactly those holders, plus a flag bit
//! when the key has a prediction entry. A `hashbrown::HashTable` maps a key to its position
//! (8 bytes per bucket: the key is read from the chain). A *slot* is
//! `ep << 5 | tier << 4 | rank` (ranks 0..=14; tier 0 = the engine's GPU, 1 = its offload tier:
//! CPU or any non-GPU `medium`); slot `ep << 5 | 15` stands for *predicted* blocks (inserted
//! after routing, with a TTL, in a side map `key → [(ep, expiry)]`). `ep` here is the
//! endpoint's [`Member`] id (stable across rule updates, `kv::members`), not its position in
//! the rule. Dead positions stay until their chain is freed (no live position), loses its dead
//! tail, or is rebuilt (fewer than half live).
//!
//! Refcounts: vLLM can store the same hash twice (two physical copies); one `BlockRemoved`
//! decrements, the block leaves the slot at zero. References beyond the first live in a side
//! map (rare). Each slot keeps a FIFO of the keys it gained (lazily cleaned) for the
//! `LOXILB_KV_MAX_BLOCKS` cap: over the cap the oldest held key is evicted and counted.
//!
//! Scoring returns, per endpoint, the length of the leading run of request blocks one of its
//! slots holds (predictions included). It walks the request along the chains: a request block
//! that follows the previous one in its chain costs one key compare (eight at a time while the
//! holder word stays the same), a map probe only where the request leaves a chain, and
//! per-holder work only where the holder word changes: the first change writes the result once
//! from the first block's holders and gives those that hold the new set a *survival tag*
//! (changes survived, in an 8-byte per-slot scratch entry with their result position); each
//! later change advances the tags of the new set's holders that survived every change before
//! (one compare each); at the end the survivors' entries take their lengths. A block with a
//! live prediction hands over to a general pass (a merge of the sorted live streams with the
//! set). So a query is O(request blocks / 8 + chain breaks + first-block holders + holder-set
//! changes × holders of the new set), whatever the index size and however many endpoints
//! share the prefix. Writers remember the last holder-set transition (old set + slot → new
//! set, and the reverse for removes): a run of blocks moving between the same two sets
//! re-interns once. Nothing about a key is inferred
//! from its chain: a block removed from the middle of a chain, an orphan, a key stored by
//! another call elsewhere all score by their own holder words; the chains only decide how
//! cheaply the next key is found.
//!
//! Scope: one index per service (rule). A service fronts one model pool; events carry no model
//! name, and vLLM mixes the LoRA name into the block hash, so blocks of different adapters never
//! collide. Two different base models would need two rules (LoxiLB's "one model per rule").

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashTable;
use parking_lot::{Mutex, RwLock};
use tokio::time::Instant;

use super::BlockKey;
use super::members::Member;

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

/// Holder word of a chain position: bit 31 set = an interned holder set (low 30 bits = its
/// id), clear = one inline slot (low 30 bits); bit 30 = the key has a prediction entry.
const MULTI: u32 = 1 << 31;
const PRED: u32 = 1 << 30;
const LOW: u32 = PRED - 1;
/// The word of a dead chain position (and of a key nobody holds): its rank bits are
/// [`PREDICTED_RANK`], which no stored holder has.
const EMPTY: u32 = LOW;
const NO_SET: u32 = u32::MAX;
/// Writers release the table lock every this many blocks, so a query waits for at most this
/// many block updates.
const LOCK_BATCH: usize = 16;
/// A chain is rebuilt without its dead positions once fewer than half of them are live.
const MIN_COMPACT: usize = 16;

/// One interned holder set: sorted distinct slots, shared by every chain position whose
/// holders are exactly these.
struct SetRec {
    slots: Box<[u32]>,
    /// Chain positions using it; freed at 0.
    uses: u32,
    hash: u64,
    /// Next set with the same content hash ([`NO_SET`] ends the list).
    next: u32,
}

/// Keys stored together, in store order: `keys[i]`'s holders are `words[i]`.
#[derive(Default)]
struct Chain {
    keys: Vec<u64>,
    words: Vec<u32>,
    live: u32,
}

/// Everything keyed by block: one lock for the whole key space.
#[derive(Default)]
struct Table {
    /// Key → its position.
    map: Positions,
    chains: Vec<Chain>,
    free_chains: Vec<u32>,
    sets: Vec<SetRec>,
    free_sets: Vec<u32>,
    /// Content hash → first set with that hash.
    set_index: KeyMap<u32>,
    /// References beyond the first of `(key, slot)` (vLLM stored the same hash twice).
    extra: HashMap<(u64, u32), u32, BuildHasherDefault<KeyHasher>>,
    /// Predicted holders of a key: (endpoint, expiry).
    predicted: KeyMap<Vec<(u32, Instant)>>,
    scratch: Vec<u32>,
    /// The last holder-set transitions of [`Self::transition`], removal at 0 and addition at
    /// 1: `(old word, slot, new word)` (flags cleared). A store (remove) of a run of blocks by one
    /// slot mostly repeats the previous block's transition, which then costs a use count
    /// instead of a set hash and probe. Cleared when either set is freed (its id may be
    /// reused for other holders).
    memo: [Option<(u32, u32, u32)>; 2],
}

fn loc_of(l: u64) -> (usize, usize) {
    ((l >> 32) as usize, l as u32 as usize)
}

fn key_hash(key: u64) -> u64 {
    let h = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^ (h >> 32)
}

fn key_at(chains: &[Chain], l: u64) -> u64 {
    let (c, p) = loc_of(l);
    chains[c].keys[p]
}

/// Key → position `chain << 32 | pos`, stored without the key (8 bytes and a control byte
/// per bucket): a probe compares the key at the candidate position, so a key is stored once,
/// in its chain. Every method takes the chains the positions point into.
#[derive(Default)]
struct Positions(HashTable<u64>);

impl Positions {
    fn get(&self, chains: &[Chain], key: u64) -> Option<u64> {
        self.0
            .find(key_hash(key), |&l| key_at(chains, l) == key)
            .copied()
    }

    /// Records `key` (absent) at `l`, where `chains` already hold it.
    fn insert(&mut self, chains: &[Chain], key: u64, l: u64) {
        self.0
            .insert_unique(key_hash(key), l, |&x| key_hash(key_at(chains, x)));
    }

    /// Forgets `key`, whose position in `chains` still holds it.
    fn remove(&mut self, chains: &[Chain], key: u64) {
        if let Ok(e) = self
            .0
            .find_entry(key_hash(key), |&l| key_at(chains, l) == key)
        {
            e.remove();
        }
    }

    /// Moves `key` (present, its old position in `chains` still holding it) to `l`.
    fn set(&mut self, chains: &[Chain], key: u64, l: u64) {
        if let Some(x) = self
            .0
            .find_mut(key_hash(key), |&x| key_at(chains, x) == key)
        {
            *x = l;
        }
    }
}

fn set_hash(slots: &[u32]) -> u64 {
    slots.iter().fold(slots.len() as u64, |h, &s| {
        (h.rotate_left(5) ^ u64::from(s)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    })
}

impl Table {
    /// The holders of `word` (its [`PRED`] bit ignored).
    fn holders(&self, word: u32) -> Holders<'_> {
        let w = word & !PRED;
        if w == EMPTY {
            Holders::None
        } else if w & MULTI != 0 {
            Holders::Many(&self.sets[(w & LOW) as usize].slots)
        } else {
            Holders::One([w])
        }
    }

    /// The word of `key` ([`EMPTY`] when nobody holds it).
    fn word(&self, key: u64) -> u32 {
        self.map.get(&self.chains, key).map_or(EMPTY, |l| {
            let (c, p) = loc_of(l);
            self.chains[c].words[p]
        })
    }

    fn holds(&self, key: u64, slot: u32) -> bool {
        self.holders(self.word(key)).contains(slot)
    }

    /// The word of the set `slots` (sorted, ≥ 2), one more use of it.
    fn intern(&mut self, slots: &[u32]) -> u32 {
        let hash = set_hash(slots);
        let head = self.set_index.get(&hash).copied().unwrap_or(NO_SET);
        let mut id = head;
        while id != NO_SET {
            let rec = &mut self.sets[id as usize];
            if *rec.slots == *slots {
                rec.uses += 1;
                return MULTI | id;
            }
            id = rec.next;
        }
        let rec = SetRec {
            slots: slots.into(),
            uses: 1,
            hash,
            next: head,
        };
        let id = match self.free_sets.pop() {
            Some(i) => {
                self.sets[i as usize] = rec;
                i
            }
            None => {
                self.sets.push(rec);
                (self.sets.len() - 1) as u32
            }
        };
        self.set_index.insert(hash, id);
        MULTI | id
    }

    /// Drops one use of `word`'s set (no-op for an inline word).
    fn release(&mut self, word: u32) {
        if word & MULTI == 0 {
            return;
        }
        let id = word & LOW;
        let rec = &mut self.sets[id as usize];
        rec.uses -= 1;
        if rec.uses > 0 {
            return;
        }
        let (hash, next) = (rec.hash, rec.next);
        rec.slots = Box::default();
        let freed = MULTI | id;
        let gone = |m: Option<(u32, u32, u32)>| m.is_some_and(|(o, _, n)| o == freed || n == freed);
        for m in &mut self.memo {
            if gone(*m) {
                *m = None;
            }
        }
        if self.set_index.get(&hash) == Some(&id) {
            if next == NO_SET {
                self.set_index.remove(&hash);
            } else {
                self.set_index.insert(hash, next);
            }
        } else {
            let mut at = self.set_index[&hash];
            while self.sets[at as usize].next != id {
                at = self.sets[at as usize].next;
            }
            self.sets[at as usize].next = next;
        }
        self.free_sets.push(id);
    }

    /// The word for `word`'s holders with `slot` added (`add`; `slot` not among them) or
    /// removed (one of them), flag kept; [`EMPTY`] when none is left. The last transition of
    /// each kind is memoized (`memo[add]`).
    fn transition(&mut self, word: u32, slot: u32, add: bool) -> u32 {
        let old = word & !PRED;
        let kind = usize::from(add);
        let new = match self.memo[kind] {
            Some((o, s, n)) if o == old && s == slot => {
                self.reuse(n);
                n
            }
            _ => {
                let mut s = std::mem::take(&mut self.scratch);
                s.clear();
                self.holders(word).for_each(|x| {
                    if x != slot {
                        s.push(x)
                    }
                });
                if add {
                    let at = s.partition_point(|&x| x < slot);
                    s.insert(at, slot);
                }
                let new = match s.len() {
                    0 => EMPTY,
                    1 => s[0],
                    _ => self.intern(&s),
                };
                self.scratch = s;
                self.memo[kind] = Some((old, slot, new));
                new
            }
        };
        self.release(old);
        if new == EMPTY {
            EMPTY
        } else {
            new | (word & PRED)
        }
    }

    /// One more use of `word`'s set (no-op for an inline word or [`EMPTY`]).
    fn reuse(&mut self, word: u32) {
        if word & MULTI != 0 {
            self.sets[(word & LOW) as usize].uses += 1;
        }
    }

    /// Adds one reference of `slot` to `key`; true when the slot newly holds it. A new key is
    /// appended to the chain of `cursor` (the previous key of the same store) when that key
    /// is its chain's last, else starts a chain; `cursor` moves to `key`.
    fn add(&mut self, key: u64, slot: u32, cursor: &mut Option<u64>, room: usize) -> bool {
        if let Some(l) = self.map.get(&self.chains, key) {
            *cursor = Some(l);
            let (c, p) = loc_of(l);
            let w = self.chains[c].words[p];
            if self.holders(w).contains(slot) {
                let e = self.extra.entry((key, slot)).or_default();
                *e = e.saturating_add(1).min(u32::MAX - 1);
                return false;
            }
            let new = self.transition(w, slot, true);
            self.chains[c].words[p] = new;
            return true;
        }
        let word = if self.predicted.contains_key(&key) {
            slot | PRED
        } else {
            slot
        };
        let c = match *cursor {
            Some(l) => {
                let (c, p) = loc_of(l);
                (p + 1 == self.chains[c].keys.len()).then_some(c)
            }
            None => None,
        };
        let c = c.unwrap_or_else(|| self.new_chain(room));
        let ch = &mut self.chains[c];
        ch.keys.push(key);
        ch.words.push(word);
        ch.live += 1;
        let l = ((c as u64) << 32) | (ch.keys.len() - 1) as u64;
        self.map.insert(&self.chains, key, l);
        *cursor = Some(l);
        true
    }

    fn new_chain(&mut self, room: usize) -> usize {
        let ch = Chain {
            keys: Vec::with_capacity(room),
            words: Vec::with_capacity(room),
            live: 0,
        };
        match self.free_chains.pop() {
            Some(i) => {
                self.chains[i as usize] = ch;
                i as usize
            }
            None => {
                self.chains.push(ch);
                self.chains.len() - 1
            }
        }
    }

    /// Drops `count` references of `slot` (`u32::MAX` = all); true when the slot lost the key.
    fn sub(&mut self, key: u64, slot: u32, count: u32) -> bool {
        let Some(l) = self.map.get(&self.chains, key) else {
            return false;
        };
        let (c, p) = loc_of(l);
        let w = self.chains[c].words[p];
        if !self.holders(w).contains(slot) {
            return false;
        }
        if !self.extra.is_empty()
            && let Some(e) = self.extra.get_mut(&(key, slot))
        {
            // References held: 1 + *e.
            if *e >= count {
                *e -= count;
                if *e == 0 {
                    self.extra.remove(&(key, slot));
                }
                return false;
            }
            self.extra.remove(&(key, slot));
        }
        let new = self.transition(w, slot, false);
        self.chains[c].words[p] = new;
        if new == EMPTY {
            self.map.remove(&self.chains, key);
            self.kill(c);
        }
        true
    }

    /// Accounts for one dead position of chain `c`: frees the chain when none is live, drops
    /// its dead tail, rebuilds it when fewer than half its positions are live.
    fn kill(&mut self, c: usize) {
        let Table {
            map,
            chains,
            free_chains,
            ..
        } = self;
        let ch = &mut chains[c];
        ch.live -= 1;
        if ch.live == 0 {
            *ch = Chain::default();
            free_chains.push(c as u32);
            return;
        }
        while ch.words.last() == Some(&EMPTY) {
            ch.words.pop();
            ch.keys.pop();
        }
        let len = ch.keys.len();
        if len < MIN_COMPACT || ch.live as usize * 2 >= len {
            return;
        }
        let live = ch.live as usize;
        let (mut keys, mut words) = (Vec::with_capacity(live), Vec::with_capacity(live));
        let ch = &chains[c];
        for (&k, &w) in ch.keys.iter().zip(&ch.words) {
            if w != EMPTY {
                map.set(chains, k, ((c as u64) << 32) | keys.len() as u64);
                keys.push(k);
                words.push(w);
            }
        }
        let ch = &mut chains[c];
        ch.keys = keys;
        ch.words = words;
    }

    /// Sets or clears the [`PRED`] flag of `key`'s position, if it has one.
    fn flag(&mut self, key: u64, on: bool) {
        flag_in(&self.map, &mut self.chains, key, on);
    }

    /// Drops `ep`'s prediction of `key`.
    fn unpredict(&mut self, key: u64, ep: Member) {
        if let Some(v) = self.predicted.get_mut(&key) {
            v.retain(|(e, _)| *e != ep as u32);
            if v.is_empty() {
                self.predicted.remove(&key);
                self.flag(key, false);
            }
        }
    }

    /// Drops prediction entries `keep` rejects (and entries left empty), clearing the flags.
    fn retain_predicted(&mut self, mut keep: impl FnMut(&(u32, Instant)) -> bool) {
        let Table {
            map,
            chains,
            predicted,
            ..
        } = self;
        predicted.retain(|&k, v| {
            v.retain(&mut keep);
            if v.is_empty() {
                flag_in(map, chains, k, false);
            }
            !v.is_empty()
        });
    }
}

fn flag_in(map: &Positions, chains: &mut [Chain], key: u64, on: bool) {
    if let Some(l) = map.get(chains, key) {
        let (c, p) = loc_of(l);
        let w = &mut chains[c].words[p];
        *w = if on { *w | PRED } else { *w & !PRED };
    }
}

enum Holders<'a> {
    None,
    One([u32; 1]),
    Many(&'a [u32]),
}

impl Holders<'_> {
    /// The holding slots, sorted.
    fn slots(&self) -> &[u32] {
        match self {
            Holders::None => &[],
            Holders::One(s) => s,
            Holders::Many(l) => l,
        }
    }

    fn for_each(&self, f: impl FnMut(u32)) {
        self.slots().iter().copied().for_each(f);
    }

    fn contains(&self, slot: u32) -> bool {
        self.slots().binary_search(&slot).is_ok()
    }

    fn any(&self, f: impl FnMut(u32) -> bool) -> bool {
        self.slots().iter().copied().any(f)
    }
}

/// A cursor over the chains: locates each next request key with one compare when it follows
/// the previous one in its chain, else with a map probe.
struct Walk<'t> {
    t: &'t Table,
    keys: &'t [u64],
    words: &'t [u32],
    pos: usize,
}

impl<'t> Walk<'t> {
    fn new(t: &'t Table) -> Self {
        Self {
            t,
            keys: &[],
            words: &[],
            pos: 0,
        }
    }

    /// The word of `key`, with [`PRED`] also set when the key has no position and some
    /// prediction exists (the caller then looks it up).
    fn word(&mut self, key: u64) -> u32 {
        let next = self.pos + 1;
        if next < self.keys.len() && self.keys[next] == key && self.words[next] != EMPTY {
            self.pos = next;
            return self.words[next];
        }
        match self.t.map.get(&self.t.chains, key) {
            Some(l) => {
                let (c, p) = loc_of(l);
                let ch = &self.t.chains[c];
                (self.keys, self.words, self.pos) = (&ch.keys, &ch.words, p);
                self.words[p]
            }
            None => {
                self.keys = &[];
                if self.t.predicted.is_empty() {
                    EMPTY
                } else {
                    EMPTY | PRED
                }
            }
        }
    }

    /// How many of `rest` (the request keys after the current one) follow the current key in
    /// its chain with holder word exactly `w`; moves past them.
    fn run(&mut self, rest: &[BlockKey], w: u32) -> usize {
        let from = self.pos + 1;
        if w == EMPTY || from >= self.keys.len() {
            return 0;
        }
        let n = same_run(&self.keys[from..], &self.words[from..], rest, w);
        self.pos += n;
        n
    }
}

/// Length of the common prefix of `keys` and `rest` over which `words` stays `w`: eight
/// positions per step, branch-free within a step.
fn same_run(keys: &[u64], words: &[u32], rest: &[BlockKey], w: u32) -> usize {
    let n = keys.len().min(words.len()).min(rest.len());
    let (keys, words, rest) = (&keys[..n], &words[..n], &rest[..n]);
    let mut i = 0;
    while i + 8 <= n {
        let mut diff = 0;
        for j in i..i + 8 {
            diff |= (keys[j] ^ rest[j].0) | u64::from(words[j] ^ w);
        }
        if diff != 0 {
            break;
        }
        i += 8;
    }
    while i < n && keys[i] == rest[i].0 && words[i] == w {
        i += 1;
    }
    i
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

/// The block index of one service. All methods take `&self`; a query takes one read lock.
pub struct KvIndex {
    table: RwLock<Table>,
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

/// Collects into `out` the endpoints predicted (and not expired at `now`) to hold `key`,
/// whose word is `w`; true when there is one.
fn live_predictions(t: &Table, w: u32, key: u64, now: Instant, out: &mut Vec<Member>) -> bool {
    out.clear();
    if w & PRED != 0
        && let Some(p) = t.predicted.get(&key)
    {
        p.iter()
            .filter(|(_, exp)| *exp > now)
            .for_each(|(ep, _)| out.push(*ep as Member));
    }
    !out.is_empty()
}

/// Per slot, what the survival pass of [`KvIndex::score_with`] knows of its stream.
#[derive(Debug, Default, Clone, Copy)]
struct Survivor {
    /// `base + m` once the stream held the first request block and every holder set up to
    /// the `m`-th change (written from the first change on); anything below `base` is stale
    /// (an earlier query's).
    tag: u32,
    /// Its endpoint's entry in the result.
    pos: u32,
}

/// Reusable buffers of [`KvIndex::score_with`]: 8 bytes per slot (256 per endpoint index)
/// plus a few words per holder of the request's first holder-set change and per change.
#[derive(Debug, Default)]
pub struct ScoreScratch {
    /// Indexed by slot.
    survivors: Vec<Survivor>,
    /// The slots that held the first block and the first changed holder set.
    surv: Vec<u32>,
    /// The tag origin of the next query; advances past every tag a query writes.
    base: u32,
    /// `ends[m]`: the request length a stream that survived exactly `m` holder-set changes
    /// holds (the block index of change `m + 1`, or the request length).
    ends: Vec<u32>,
    // The general pass (a live prediction in play):
    alive: Vec<u32>,
    /// The streams alive at the first block, sorted: every endpoint of the result is one of
    /// theirs, so the result comes out sorted without a sort.
    first: Vec<u32>,
    predicted: Vec<Member>,
    best: Vec<(Member, usize)>,
    /// Per endpoint, the longest run recorded so far in this query (reset on output).
    ep_len: Vec<usize>,
    /// Per slot / per endpoint, the stamp of the last request block that listed it among its
    /// holders: membership tests in O(1), so a block costs O(alive + holders), not their
    /// product.
    slot_seen: Vec<u32>,
    ep_seen: Vec<u32>,
    stamp: u32,
}

impl ScoreScratch {
    /// The pass of [`KvIndex::score_with`] while no request block has a live prediction
    /// (`keys[0]` has none; its word is `w0`, `walk` is at it). Nothing is done per holder of
    /// the first block until the holders first change: that change fills `best` from the
    /// first block's holders (one entry per endpoint, the change's block index) and tags
    /// those of them that hold the new set; each later change advances the tags of the new
    /// set's holders that survived every change before, and the walk stops when none did. At
    /// the end the survivors' entries take their lengths. Returns `None`; or, at the first
    /// block with a live prediction, its index and word, with `alive`, `first` and `ep_len`
    /// set up for [`Self::general`] to go on from there.
    fn survive(
        &mut self,
        t: &Table,
        walk: &mut Walk<'_>,
        keys: &[BlockKey],
        w0: u32,
        now: Instant,
    ) -> Option<(usize, u32)> {
        let h0 = t.holders(w0);
        let set0 = h0.slots();
        if set0.iter().all(|&x| is_offload(x)) {
            return None;
        }
        // Tag 0 is every fresh entry's: the first query starts at 1.
        if self.base == 0 || (u32::MAX - self.base) as usize <= keys.len() + 2 {
            self.survivors.fill(Survivor::default());
            self.base = 1;
        }
        let b = self.base;
        self.ends.clear();
        self.surv.clear();
        let mut changes = 0u32;
        let mut prev = w0;
        let mut i = 1;
        if w0 & PRED == 0 {
            i += walk.run(&keys[1..], w0);
        }
        let mut general = None;
        while i < keys.len() {
            let k = keys[i].0;
            let w = walk.word(k);
            if w == prev && w & PRED == 0 {
                i += 1 + walk.run(&keys[i + 1..], w);
                continue;
            }
            if live_predictions(t, w, k, now, &mut self.predicted) {
                general = Some((i, w));
                break;
            }
            prev = w;
            let here = t.holders(w);
            let kept = if changes == 0 {
                self.first_change(set0, here.slots(), i, b)
            } else {
                self.next_change(here.slots(), b + changes)
            };
            self.ends.push(i as u32);
            changes += 1;
            if kept == 0 {
                break;
            }
            i += 1;
            if w & PRED == 0 {
                i += walk.run(&keys[i..], w);
            }
        }
        self.ends.push(keys.len() as u32);
        self.base = b + changes + 1;
        if general.is_some() {
            self.hand_over(set0, b, changes);
            return general;
        }
        if changes == 0 {
            self.fill(set0, keys.len());
        }
        let Self {
            survivors,
            surv,
            ends,
            best,
            ..
        } = self;
        for &x in surv.iter() {
            let e = survivors[x as usize];
            let n = ends[(e.tag - b) as usize] as usize;
            let at = &mut best[e.pos as usize].1;
            *at = (*at).max(n);
        }
        None
    }

    /// One `best` entry per endpoint among `set0`'s GPU slots, each of length `n`; true when
    /// that is one entry per slot (no offload slot, no two ranks of one endpoint: then a
    /// slot's position in `set0` is its entry's).
    fn fill(&mut self, set0: &[u32], n: usize) -> bool {
        let best = &mut self.best;
        // Sorted slots share an endpoint iff they differ in the low 5 bits only.
        let mut mixed = 0;
        for (&y, &z) in set0.iter().zip(set0.iter().skip(1)) {
            mixed |= u32::from((y ^ z) < 32) | (y & OFFLOAD_BIT);
        }
        if let Some(&y) = set0.last() {
            mixed |= y & OFFLOAD_BIT;
        }
        if mixed == 0 {
            best.extend(set0.iter().map(|&y| (slot_ep(y), n)));
            return true;
        }
        best.resize(set0.len(), (0, 0));
        // Branch-free: every slot writes the next entry, which only advances for a GPU slot
        // of a new endpoint (`Member::MAX` is no endpoint).
        let (mut out, mut last) = (0, Member::MAX);
        for (&y, k) in set0.iter().zip(0..) {
            let ep = slot_ep(y);
            best[out.min(k)] = (ep, n);
            let new = !is_offload(y) && ep != last;
            out += usize::from(new);
            if new {
                last = ep;
            }
        }
        best.truncate(out);
        false
    }

    /// The first holder-set change, to `here` at request block `i`: [`Self::fill`] with
    /// length `i`, then the GPU slots of `here` that are in `set0` (a binary search each for
    /// a few holders, else one merge pass) tagged `b + 1` (one change survived) with their
    /// entry's position, and listed in `surv`. Returns how many there are.
    fn first_change(&mut self, set0: &[u32], here: &[u32], i: usize, b: u32) -> u32 {
        let exact = self.fill(set0, i);
        if let Some(&last) = here.last()
            && self.survivors.len() <= last as usize
        {
            self.survivors
                .resize(last as usize + 1, Survivor::default());
        }
        let Self {
            survivors,
            surv,
            best,
            ..
        } = self;
        let search = here.len() * 8 < set0.len();
        let mut from = 0;
        for &x in here {
            if is_offload(x) {
                continue;
            }
            if search {
                match set0[from..].binary_search(&x) {
                    Ok(j) => from += j + 1,
                    Err(j) => {
                        from += j;
                        continue;
                    }
                }
            } else {
                while from < set0.len() && set0[from] < x {
                    from += 1;
                }
                if from == set0.len() {
                    break;
                }
                if set0[from] != x {
                    continue;
                }
                from += 1;
            }
            let pos = if exact {
                from - 1
            } else {
                best.partition_point(|e| e.0 < slot_ep(x))
            };
            survivors[x as usize] = Survivor {
                tag: b + 1,
                pos: pos as u32,
            };
            surv.push(x);
        }
        surv.len() as u32
    }

    /// A later holder-set change, to `here`: the streams tagged `alive` (every change so far
    /// survived) that hold it advance by one. Returns how many did.
    fn next_change(&mut self, here: &[u32], alive: u32) -> u32 {
        let mut kept = 0;
        for &x in here {
            if let Some(e) = self.survivors.get_mut(x as usize) {
                let hit = u32::from(e.tag == alive);
                e.tag += hit;
                kept += hit;
            }
        }
        kept
    }

    /// Hands the survival pass's state after `changes` changes over to [`Self::general`]:
    /// `first` = `set0`'s GPU slots, `alive` = those that survived every change, the others'
    /// lengths in `ep_len`.
    fn hand_over(&mut self, set0: &[u32], b: u32, changes: u32) {
        self.alive.clear();
        self.first.clear();
        self.best.clear();
        if let Some(&last) = set0.last()
            && self.ep_len.len() <= slot_ep(last)
        {
            self.ep_len.resize(slot_ep(last) + 1, 0);
        }
        for &x in set0 {
            if is_offload(x) {
                continue;
            }
            self.first.push(x);
            let m = self
                .survivors
                .get(x as usize)
                .map_or(0, |e| e.tag.saturating_sub(b));
            if m == changes {
                self.alive.push(x);
            } else {
                let (ep, n) = (slot_ep(x), self.ends[m as usize] as usize);
                self.ep_len[ep] = self.ep_len[ep].max(n);
            }
        }
    }

    /// The general pass of [`KvIndex::score_with`], from request block `from` (word `w`,
    /// `walk` at it): from block 0, or where [`Self::survive`] met a live prediction. Per
    /// holder-set change, O(alive streams + holders). Fills `best`.
    fn general(
        &mut self,
        t: &Table,
        walk: &mut Walk<'_>,
        keys: &[BlockKey],
        from: usize,
        w: u32,
        now: Instant,
    ) {
        if from == 0 {
            self.alive.clear();
            self.first.clear();
        }
        let mut pending = Some(w);
        let mut prev = EMPTY;
        // Whether a predicted stream is alive (only the first block starts them).
        let mut pred_streams = false;
        let mut i = from;
        while i < keys.len() {
            let k = keys[i];
            let w = pending.take().unwrap_or_else(|| walk.word(k.0));
            // The same holders as the previous block and no prediction on either: every
            // live stream goes on, through this block and the ones after it in its chain
            // with the same word.
            if i > from && w == prev && w & PRED == 0 {
                i += 1 + walk.run(&keys[i + 1..], w);
                continue;
            }
            prev = w;
            live_predictions(t, w, k.0, now, &mut self.predicted);
            let here = t.holders(w);
            if i == 0 {
                let Self {
                    alive,
                    first,
                    predicted,
                    ep_len,
                    ..
                } = &mut *self;
                let here = here.slots();
                alive.extend_from_slice(here);
                if here.iter().any(|&s| is_offload(s)) {
                    alive.retain(|&s| !is_offload(s));
                }
                if !predicted.is_empty() {
                    alive.extend(predicted.iter().map(|&ep| slot(ep, PREDICTED_RANK)));
                    alive.sort_unstable();
                    pred_streams = true;
                }
                first.extend_from_slice(alive);
                if let Some(&last) = alive.last()
                    && ep_len.len() <= slot_ep(last)
                {
                    ep_len.resize(slot_ep(last) + 1, 0);
                }
            } else if self.predicted.is_empty() && !pred_streams {
                // No prediction in play: `alive` and the holders are both sorted, so one
                // merge pass decides every stream.
                let here = here.slots();
                let Self { alive, ep_len, .. } = &mut *self;
                let mut j = 0;
                alive.retain(|&s| {
                    while j < here.len() && here[j] < s {
                        j += 1;
                    }
                    let go_on = j < here.len() && here[j] == s;
                    if !go_on {
                        let ep = slot_ep(s);
                        ep_len[ep] = ep_len[ep].max(i);
                    }
                    go_on
                });
            } else {
                let stamp = self.mark(&here);
                let Self {
                    alive,
                    predicted,
                    ep_len,
                    slot_seen,
                    ep_seen,
                    ..
                } = &mut *self;
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
                        ep_len[ep] = ep_len[ep].max(i);
                    }
                    go_on
                });
            }
            if self.alive.is_empty() {
                break;
            }
            i += 1;
            if w & PRED == 0 {
                i += walk.run(&keys[i..], w);
            }
        }
        let Self {
            alive,
            first,
            best,
            ep_len,
            ..
        } = self;
        alive.iter().for_each(|&s| ep_len[slot_ep(s)] = keys.len());
        // Branch-free: every stream writes its endpoint's entry, which only advances when
        // non-zero (an endpoint's later streams find its length taken).
        best.resize(first.len(), (0, 0));
        let mut out = 0;
        for (&s, b) in first.iter().zip(0..) {
            let ep = slot_ep(s);
            let n = std::mem::take(&mut ep_len[ep]);
            best[out.min(b)] = (ep, n);
            out += usize::from(n > 0);
        }
        best.truncate(out);
    }

    /// Stamps `here`'s slots and endpoints as seen at a new stamp, which it returns.
    fn mark(&mut self, here: &Holders<'_>) -> u32 {
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.slot_seen.fill(0);
            self.ep_seen.fill(0);
            self.stamp = 1;
        }
        let (stamp, slot_seen, ep_seen) = (self.stamp, &mut self.slot_seen, &mut self.ep_seen);
        here.for_each(|s| {
            let (si, ep) = (s as usize, slot_ep(s));
            if slot_seen.len() <= si {
                slot_seen.resize(si + 1, 0);
            }
            slot_seen[si] = stamp;
            // Offload-tier copies do not continue a GPU run: only GPU holders mark their
            // endpoint (alive streams are GPU slots, so `slot_seen` needs no filter).
            if is_offload(s) {
                return;
            }
            if ep_seen.len() <= ep {
                ep_seen.resize(ep + 1, 0);
            }
            ep_seen[ep] = stamp;
        });
        stamp
    }
}

impl KvIndex {
    /// An empty index whose streams hold at most `max_blocks` keys each (`LOXILB_KV_MAX_BLOCKS`).
    pub fn new(max_blocks: u64) -> Self {
        Self {
            table: RwLock::new(Table::default()),
            slots: Mutex::new(HashMap::new()),
            max_blocks: max_blocks.max(1),
            evictions: AtomicU64::new(0),
            ep_blocks: RwLock::new(Vec::new()),
            offload_held: AtomicU64::new(0),
        }
    }

    /// Applies a GPU `BlockStored` from endpoint `ep`, DP rank `rank` (ranks above
    /// [`MAX_RANK`] are folded onto it). `keys` are one chain, parent first. Evicts the slot's
    /// oldest keys beyond the cap.
    pub fn store(&self, ep: Member, rank: u32, keys: &[BlockKey]) -> StoreOutcome {
        self.store_in(ep, rank, Tier::Gpu, keys)
    }

    /// [`Self::store`] into `tier` (each tier of a stream is capped on its own).
    pub fn store_in(&self, ep: Member, rank: u32, tier: Tier, keys: &[BlockKey]) -> StoreOutcome {
        let s = slot_in(ep, rank.min(MAX_RANK), tier);
        let mut slots = self.slots.lock();
        let st = slots.entry(s).or_default();
        let mut out = StoreOutcome::default();
        let mut cursor = None;
        for (n, chunk) in keys.chunks(LOCK_BATCH).enumerate() {
            let mut t = self.table.write();
            for (i, k) in chunk.iter().enumerate() {
                t.unpredict(k.0, ep);
                let room = keys.len() - n * LOCK_BATCH - i;
                if t.add(k.0, s, &mut cursor, room) {
                    st.held += 1;
                    st.fifo.push_back(k.0);
                    out.added += 1;
                }
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
            let mut t = self.table.write();
            for _ in 0..LOCK_BATCH {
                if st.held <= self.max_blocks {
                    break;
                }
                let Some(k) = st.fifo.pop_front() else { break };
                if t.sub(k, s, u32::MAX) {
                    st.held -= 1;
                    evicted += 1;
                }
            }
            if st.fifo.is_empty() {
                break;
            }
        }
        self.evictions.fetch_add(evicted, Ordering::Relaxed);
        evicted
    }

    /// Drops `count` references (`u32::MAX` = all) of slot `s` from each key, releasing the
    /// table lock every [`LOCK_BATCH`] keys; returns how many keys the slot lost.
    fn sub_each(&self, keys: impl IntoIterator<Item = u64>, s: u32, count: u32) -> u64 {
        let mut dropped = 0;
        let mut keys = keys.into_iter().peekable();
        while keys.peek().is_some() {
            let mut t = self.table.write();
            for k in keys.by_ref().take(LOCK_BATCH) {
                dropped += u64::from(t.sub(k, s, count));
            }
        }
        dropped
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
        let dropped = self.sub_each(keys.iter().map(|k| k.0), s, 1);
        st.held -= dropped;
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
            if self.table.read().holds(k, s) && seen.insert(k) {
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
                self.sub_each(st.fifo, s, u32::MAX);
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
        self.table
            .write()
            .retain_predicted(|(e, _)| *e != ep as u32);
        if let Some(n) = self.ep_blocks.read().get(ep) {
            n.store(0, Ordering::Relaxed);
        }
    }

    /// Marks `keys` as predicted on `ep` until `expires` (after routing a request there).
    /// A later real store of a key by `ep` replaces the prediction.
    pub fn predict(&self, ep: Member, keys: &[BlockKey], expires: Instant) {
        for chunk in keys.chunks(LOCK_BATCH) {
            let mut t = self.table.write();
            for k in chunk {
                let real = t
                    .holders(t.word(k.0))
                    .any(|x| slot_ep(x) == ep && !is_offload(x));
                if real {
                    continue;
                }
                let v = t.predicted.entry(k.0).or_default();
                match v.iter_mut().find(|(e, _)| *e == ep as u32) {
                    Some(e) => e.1 = expires,
                    None => v.push((ep as u32, expires)),
                }
                t.flag(k.0, true);
            }
        }
    }

    /// Removes predictions that expired at or before `now`.
    pub fn sweep_predicted(&self, now: Instant) {
        self.table.write().retain_predicted(|(_, exp)| *exp > now);
    }

    /// Per endpoint, the number of leading request blocks one of its streams holds (its
    /// contiguous cached prefix), predictions that have not expired at `now` included.
    /// Endpoints with 0 are omitted; the result is sorted by endpoint index.
    pub fn score(&self, keys: &[BlockKey], now: Instant) -> Vec<(Member, usize)> {
        self.score_with(keys, now, &mut ScoreScratch::default())
            .to_vec()
    }

    /// [`Self::score`] into `scratch`'s buffers: no allocation once they have grown to the
    /// request's holder count. Takes one read lock; a request block that follows the previous
    /// one in its chain costs one key compare, and one whose holder word equals the
    /// previous block's (same interned set, no prediction) nothing more. Where the holder word
    /// changes, each holder of the new set costs one scratch read (and a write if it is still
    /// alive); the result is filled once, from the first block's holders, at the end. A block
    /// with a live prediction switches to a general pass (per live stream and holder).
    pub fn score_with<'s>(
        &self,
        keys: &[BlockKey],
        now: Instant,
        scratch: &'s mut ScoreScratch,
    ) -> &'s [(Member, usize)] {
        scratch.best.clear();
        let Some(k0) = keys.first() else {
            return &scratch.best;
        };
        let t = self.table.read();
        let mut walk = Walk::new(&t);
        let w0 = walk.word(k0.0);
        let general = if live_predictions(&t, w0, k0.0, now, &mut scratch.predicted) {
            Some((0, w0))
        } else {
            scratch.survive(&t, &mut walk, keys, w0, now)
        };
        if let Some((i, w)) = general {
            scratch.general(&t, &mut walk, keys, i, w, now);
        }
        &scratch.best
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
        let t = self.table.read();
        let mut walk = Walk::new(&t);
        let mut prev = EMPTY;
        let mut i = 0;
        while i < keys.len() {
            let w = walk.word(keys[i].0) & !PRED;
            if i > 0 && w == prev {
                i += 1 + walk.run(&keys[i + 1..], w);
                continue;
            }
            prev = w;
            here.clear();
            t.holders(w).for_each(|s| here.push(slot_ep(s)));
            if i == 0 {
                alive.extend(here.iter().copied());
                alive.sort_unstable();
                alive.dedup();
            } else {
                alive.retain(|ep| {
                    let go_on = here.contains(ep);
                    if !go_on {
                        best.push((*ep, i));
                    }
                    go_on
                });
            }
            if alive.is_empty() {
                break;
            }
            i += 1;
            i += walk.run(&keys[i..], w);
        }
        best.extend(alive.iter().map(|&ep| (ep, keys.len())));
        best.sort_unstable();
        best
    }

    /// Distinct keys held by `ep` (confirmed only), oldest first per rank and tier, each listed
    /// once: a block held on several ranks, or on the GPU and in the offload tier, appears at
    /// its first place (rank order, GPU before offload).
    pub fn keys_of(&self, ep: Member) -> Vec<BlockKey> {
        let slots = self.slots.lock();
        let t = self.table.read();
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for s in
            (0..=MAX_RANK).flat_map(|r| [slot_in(ep, r, Tier::Gpu), slot_in(ep, r, Tier::Offload)])
        {
            if let Some(st) = slots.get(&s) {
                out.extend(
                    st.fifo
                        .iter()
                        .filter(|&&k| t.holds(k, s) && seen.insert(k))
                        .map(|&k| BlockKey(k)),
                );
            }
        }
        out
    }

    /// Whether any endpoint holds `key` on the GPU tier (any rank) or is predicted to hold it
    /// with a prediction alive at `now`: exactly when [`Self::score`] of `[key]` is non-empty,
    /// without its allocations (one read lock, one map lookup). The crossed-stream check's
    /// "cold placement" test (`kv::cross`), run for every routed request without a hit.
    pub fn held_or_predicted(&self, key: BlockKey, now: Instant) -> bool {
        let t = self.table.read();
        let w = t.word(key.0);
        // A key with no position (no holder) may still carry a prediction: only a positioned
        // key's word carries the `PRED` flag.
        let predicted = (w == EMPTY || w & PRED != 0)
            && t.predicted
                .get(&key.0)
                .is_some_and(|p| p.iter().any(|(_, exp)| *exp > now));
        predicted || t.holders(w).slots().iter().any(|&x| !is_offload(x))
    }

    /// Does `ep` hold `key` on any rank (confirmed blocks only)?
    pub fn holds_key(&self, ep: Member, key: BlockKey) -> bool {
        let t = self.table.read();
        t.holders(t.word(key.0))
            .any(|x| slot_ep(x) == ep && x & 0xF != PREDICTED_RANK)
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
        self.table.read().predicted.len()
    }

    /// Keys evicted by the cap since creation (`loxilb_kv_inv_cap_evictions_total`).
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "index_model_tests.rs"]
mod model_tests;
