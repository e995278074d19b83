//! The prefix cache: a pool of `num_gpu_blocks` KV blocks with vLLM v1's `BlockPool` semantics.
//!
//! - Block 0 is the null block (never used), so `num_gpu_blocks - 1` blocks are usable.
//! - Blocks of running requests are referenced (`ref_cnt > 0`). A block whose count drops to 0
//!   goes to the END of the free queue and KEEPS its hash: it can still be hit until it is reused.
//!   A freed block without a hash (a request's partial tail) goes to the FRONT: it is worthless,
//!   so it is reused first. (This is what the golden capture shows: with 40 blocks, the
//!   511-token request after eight smaller ones evicts nothing, and the next evicts exactly the
//!   15 blocks listed in frame 11, in that order.)
//! - New blocks are taken from the FRONT of the free queue (least recently freed). Reusing a block
//!   that still has a hash evicts it: the hash leaves the cache and a `BlockRemoved` event is
//!   queued (one block per event, lazily: nothing is emitted when a block is merely freed).
//! - A hit touches blocks: referenced again and taken out of the free queue.
//! - Requests free their blocks in reverse order (tail first), so a prefix outlives its suffix.
//!
//! | operation         | cost                 |
//! |-------------------|----------------------|
//! | `lookup_prefix`   | O(hit blocks)        |
//! | `touch`, `free`   | O(blocks · log free) |
//! | `allocate(n)`     | O(n · log free)      |

use std::collections::{BTreeMap, HashMap};

use super::events::KvEvent;
use super::prompt::Digest;

/// Index of a block in the pool.
pub type BlockId = usize;

#[derive(Debug, Clone, Default)]
struct Block {
    hash: Option<Digest>,
    ref_cnt: u32,
    /// Position key in the free queue while free.
    free_key: Option<i64>,
}

/// The block pool. Events it produces (`BlockRemoved`, `AllBlocksCleared`) accumulate in
/// [`BlockPool::take_events`] order together with the `BlockStored` events the engine adds.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    free: BTreeMap<i64, BlockId>,
    next_key: i64,
    front_key: i64,
    cached: HashMap<Digest, Vec<BlockId>>,
    events: Vec<KvEvent>,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (≥ 2); block 0 is reserved as the null block.
    pub fn new(num_gpu_blocks: usize) -> Self {
        let mut pool = Self {
            blocks: vec![Block::default(); num_gpu_blocks.max(2)],
            free: BTreeMap::new(),
            next_key: 0,
            front_key: -1,
            cached: HashMap::new(),
            events: Vec::new(),
        };
        for id in 1..pool.blocks.len() {
            pool.push_free(id);
        }
        pool
    }

    /// Usable blocks (`num_gpu_blocks - 1`).
    pub fn capacity(&self) -> usize {
        self.blocks.len() - 1
    }

    /// Blocks in the free queue (cached or not).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// True while block `id` sits in the free queue (unreferenced).
    pub fn is_free(&self, id: BlockId) -> bool {
        self.blocks.get(id).is_some_and(|b| b.free_key.is_some())
    }

    /// vLLM's `kv_cache_usage_perc`: fraction of usable blocks referenced, 0..1.
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free() as f64 / self.capacity() as f64
    }

    /// The cached blocks holding the leading run of `hashes` (stops at the first miss).
    pub fn lookup_prefix(&self, hashes: &[Digest]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).and_then(|ids| ids.first().copied()))
            .collect()
    }

    /// Takes a reference on each block (a hit), removing free ones from the free queue.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            let b = &mut self.blocks[id];
            if let Some(k) = b.free_key.take() {
                self.free.remove(&k);
            }
            b.ref_cnt += 1;
        }
    }

    /// Takes `n` blocks from the front of the free queue, evicting cached ones (queues one
    /// `BlockRemoved` per evicted block). `None`, with nothing changed, when fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, id) = self.free.pop_first()?;
            self.evict(id);
            let b = &mut self.blocks[id];
            b.free_key = None;
            b.ref_cnt = 1;
            out.push(id);
        }
        Some(out)
    }

    fn evict(&mut self, id: BlockId) {
        let Some(hash) = self.blocks[id].hash.take() else {
            return;
        };
        if let Some(ids) = self.cached.get_mut(&hash) {
            ids.retain(|&b| b != id);
            if ids.is_empty() {
                self.cached.remove(&hash);
            }
        }
        self.events.push(KvEvent::BlockRemoved { hash });
    }

    /// Marks block `id` full with digest `hash` (hittable from now on). A no-op when the block
    /// already holds that hash (a hit being re-reported).
    pub fn cache(&mut self, id: BlockId, hash: Digest) {
        if self.blocks[id].hash.as_ref() == Some(&hash) {
            return;
        }
        self.blocks[id].hash = Some(hash);
        self.cached.entry(hash).or_default().push(id);
    }

    /// Drops one reference from each block of a request, tail first, as vLLM frees them
    /// (`ids` in request order). Blocks reaching 0 join the end of the free queue.
    pub fn free(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id];
            b.ref_cnt = b.ref_cnt.saturating_sub(1);
            if b.ref_cnt == 0 && b.free_key.is_none() {
                if b.hash.is_some() {
                    self.push_free(id);
                } else {
                    self.push_free_front(id);
                }
            }
        }
    }

    fn push_free_front(&mut self, id: BlockId) {
        self.blocks[id].free_key = Some(self.front_key);
        self.free.insert(self.front_key, id);
        self.front_key -= 1;
    }

    fn push_free(&mut self, id: BlockId) {
        self.blocks[id].free_key = Some(self.next_key);
        self.free.insert(self.next_key, id);
        self.next_key += 1;
    }

    /// vLLM's `reset_prefix_cache`: fails (returns false) while any block is referenced;
    /// otherwise drops every hash and queues `AllBlocksCleared`.
    pub fn reset(&mut self) -> bool {
        if self.num_free() != self.capacity() {
            return false;
        }
        self.cached.clear();
        self.blocks.iter_mut().for_each(|b| b.hash = None);
        self.events.push(KvEvent::AllBlocksCleared);
        true
    }

    /// Queues an event produced by the engine (a `BlockStored`).
    pub fn push_event(&mut self, ev: KvEvent) {
        self.events.push(ev);
    }

    /// Takes the events queued since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u8) -> Digest {
        Digest::from_bytes(&[n; 32])
    }

    fn removed(evs: &[KvEvent]) -> Vec<u8> {
        evs.iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved { hash } => Some(hash.as_bytes()[0]),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn null_block_is_not_usable() {
        let p = BlockPool::new(5);
        assert_eq!(p.capacity(), 4);
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.usage(), 0.0);
    }

    #[test]
    fn freed_blocks_keep_their_hash_and_can_be_hit() {
        let mut p = BlockPool::new(5);
        let ids = p.allocate(2).expect("free");
        p.cache(ids[0], d(1));
        p.cache(ids[1], d(2));
        p.free(&ids);
        assert_eq!(p.lookup_prefix(&[d(1), d(2), d(3)]), ids);
        assert_eq!(p.lookup_prefix(&[d(2)]), vec![ids[1]]);
        assert!(
            p.lookup_prefix(&[d(3), d(1)]).is_empty(),
            "only the leading run counts"
        );
        assert!(
            removed(&p.take_events()).is_empty(),
            "freeing emits nothing"
        );
    }

    #[test]
    fn eviction_takes_least_recently_freed_tail_first_and_emits_on_reuse() {
        let mut p = BlockPool::new(5); // 4 usable
        let a = p.allocate(2).expect("free");
        p.cache(a[0], d(1));
        p.cache(a[1], d(2));
        let b = p.allocate(2).expect("free");
        p.cache(b[0], d(3));
        p.cache(b[1], d(4));
        p.free(&a); // queue: a1(d2), a0(d1)
        p.free(&b); // queue: a1, a0, b1(d4), b0(d3)
        assert!(p.take_events().is_empty());
        let _c = p.allocate(1).expect("free");
        assert_eq!(
            removed(&p.take_events()),
            vec![2],
            "tail of the oldest request goes first"
        );
        let _c = p.allocate(2).expect("free");
        assert_eq!(removed(&p.take_events()), vec![1, 4]);
        assert_eq!(
            p.lookup_prefix(&[d(3)]).len(),
            1,
            "most recently freed survives"
        );
        assert!(p.lookup_prefix(&[d(1)]).is_empty());
    }

    #[test]
    fn freed_partial_blocks_are_reused_before_cached_ones() {
        let mut p = BlockPool::new(4); // 3 usable
        let a = p.allocate(2).expect("free");
        p.cache(a[0], d(1)); // a[1] stays partial (no hash)
        p.free(&a); // queue: a[1] (front), fresh, a[0]
        let b = p.allocate(2).expect("free");
        assert_eq!(b[0], a[1], "the unhashed block goes first");
        assert!(p.take_events().is_empty(), "no cached block was evicted");
        assert_eq!(p.lookup_prefix(&[d(1)]), vec![a[0]]);
    }

    #[test]
    fn a_hit_protects_blocks_from_eviction() {
        let mut p = BlockPool::new(4); // 3 usable
        let a = p.allocate(3).expect("free");
        for (i, id) in a.iter().enumerate() {
            p.cache(*id, d(i as u8 + 1));
        }
        p.free(&a); // queue: d3, d2, d1
        let hit = p.lookup_prefix(&[d(1)]);
        p.touch(&hit);
        assert_eq!(p.num_free(), 2);
        assert!(
            p.allocate(3).is_none(),
            "a referenced block cannot be taken"
        );
        p.allocate(2).expect("two free");
        assert_eq!(removed(&p.take_events()), vec![3, 2]);
        assert_eq!(p.lookup_prefix(&[d(1)]), hit);
    }

    #[test]
    fn reset_clears_only_when_nothing_runs() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(1).expect("free");
        p.cache(a[0], d(9));
        assert!(!p.reset());
        p.free(&a);
        assert!(p.reset());
        assert!(p.lookup_prefix(&[d(9)]).is_empty());
        assert_eq!(p.take_events(), vec![KvEvent::AllBlocksCleared]);
        p.allocate(3).expect("free");
        assert!(
            p.take_events().is_empty(),
            "cleared blocks are not removed again"
        );
    }
}
