//! The oracle bound on engine-side prefix hit rate, computed offline from the workload.
//!
//! Model (documented contract of the number we report as "oracle"):
//! - Each request's prompt token ids (as the engine tokenizes them, chat template included) are
//!   cut into full blocks of `block_size` tokens; block `i` is identified by the chain of all
//!   tokens up to its end (like vLLM's parent-chained block hash).
//! - Requests are processed in arrival order against ONE LRU cache whose capacity is the fleet's
//!   total (`workers × num_gpu_blocks` blocks): ideal placement, as if every request went to the
//!   worker holding its longest prefix and the workers' caches were pooled.
//! - A request hits the longest run of leading blocks present, capped like vLLM at the blocks that
//!   end before the prompt's last token (`(len − 1) / block_size` blocks: the last token is
//!   always recomputed). Hit tokens = hit blocks × `block_size`; queried tokens = prompt length.
//! - Then all full blocks of the prompt become most recently used (inserted if absent, evicting
//!   the least recently used blocks beyond capacity). Output tokens are not cached here.
//! - Bound = Σ hit tokens / Σ prompt tokens. With unbounded capacity it is the share of prompt
//!   tokens whose prefix appeared earlier in the workload.
//!
//! LRU is not Bélády-optimal and in-flight blocks are not pinned, so this is the ideal-placement
//! bound for an LRU engine, not an information-theoretic maximum.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// Result of the oracle simulation.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct OracleBound {
    /// Σ hit tokens.
    pub hit_tokens: u64,
    /// Σ prompt tokens.
    pub query_tokens: u64,
}

impl OracleBound {
    /// `hit_tokens / query_tokens` (0 when nothing was queried).
    pub fn rate(&self) -> f64 {
        super::stats::hit_rate(self.hit_tokens as f64, self.query_tokens as f64)
    }
}

/// Runs the oracle over `prompts` (token ids, arrival order) with a pooled LRU of
/// `capacity_blocks` blocks of `block_size` tokens (`block_size` 0 is treated as 1).
pub fn oracle_bound(
    prompts: &[Vec<u32>],
    block_size: usize,
    capacity_blocks: usize,
) -> OracleBound {
    let bs = block_size.max(1);
    let mut lru = Lru::new(capacity_blocks);
    let mut bound = OracleBound {
        hit_tokens: 0,
        query_tokens: 0,
    };
    for tokens in prompts {
        let chain = chain_ids(tokens, bs);
        let cap = tokens.len().saturating_sub(1) / bs;
        let hits = chain
            .iter()
            .take(cap)
            .take_while(|b| lru.contains(**b))
            .count();
        bound.hit_tokens += (hits * bs) as u64;
        bound.query_tokens += tokens.len() as u64;
        for b in chain {
            lru.touch(b);
        }
    }
    bound
}

/// Parent-chained identities of the full blocks of `tokens`.
fn chain_ids(tokens: &[u32], bs: usize) -> Vec<u64> {
    let mut parent = 0u64;
    tokens
        .chunks_exact(bs)
        .map(|block| {
            let mut h = DefaultHasher::new();
            (parent, block).hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

/// A block LRU: `tick` orders recency; the smallest tick is evicted first.
struct Lru {
    cap: usize,
    tick: u64,
    at: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl Lru {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            tick: 0,
            at: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    fn contains(&self, b: u64) -> bool {
        self.at.contains_key(&b)
    }

    fn touch(&mut self, b: u64) {
        if self.cap == 0 {
            return;
        }
        if let Some(old) = self.at.insert(b, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, b);
        self.tick += 1;
        while self.at.len() > self.cap {
            match self.order.pop_first() {
                Some((_, victim)) => self.at.remove(&victim),
                None => break,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn repeated_prompt_hits_all_blocks_but_the_one_holding_the_last_token() {
        // 8 tokens, block 4: first pass misses (0/8); second hits block 0 only (cap (8-1)/4 = 1).
        let p = seq(0..8);
        let b = oracle_bound(&[p.clone(), p], 4, 100);
        assert_eq!(
            b,
            OracleBound {
                hit_tokens: 4,
                query_tokens: 16
            }
        );
        assert_eq!(b.rate(), 0.25);
    }

    #[test]
    fn shared_prefix_counts_only_leading_common_blocks() {
        // Prompts share 8 tokens (2 blocks of 4), then differ; 10 tokens each.
        let a = seq(0..10);
        let mut b = seq(0..8);
        b.extend([100, 101]);
        let mut c = seq(0..4);
        c.extend(200..206);
        let r = oracle_bound(&[a, b, c], 4, 100);
        // a: 0; b: 2 blocks (cap (10-1)/4 = 2) = 8; c: block 0 only = 4.
        assert_eq!(
            r,
            OracleBound {
                hit_tokens: 12,
                query_tokens: 30
            }
        );
    }

    #[test]
    fn lru_capacity_evicts_least_recently_used_blocks() {
        // Capacity 2 blocks of 2 tokens. x=[0,1,2,3,9] (2 blocks), y=[5,6,7,8,9] (2 blocks).
        let x = vec![0, 1, 2, 3, 9];
        let y = vec![5, 6, 7, 8, 9];
        // x, y, x: y evicts x's blocks, so the second x misses.
        let r = oracle_bound(&[x.clone(), y.clone(), x.clone()], 2, 2);
        assert_eq!(r.hit_tokens, 0);
        // x, x, y, y: second x hits 2 blocks (4 tokens), second y hits 4 tokens.
        let r = oracle_bound(&[x.clone(), x, y.clone(), y], 2, 2);
        assert_eq!(
            r,
            OracleBound {
                hit_tokens: 8,
                query_tokens: 20
            }
        );
    }

    #[test]
    fn zero_capacity_never_hits() {
        let p = seq(0..16);
        assert_eq!(oracle_bound(&[p.clone(), p], 4, 0).hit_tokens, 0);
    }

    #[test]
    fn same_block_tokens_under_different_parents_are_different_blocks() {
        let a = vec![1, 1, 2, 2, 9];
        let b = vec![2, 2, 1, 1, 9];
        // b's first block [2,2] is not a's first block: no hit.
        assert_eq!(oracle_bound(&[a, b], 2, 10).hit_tokens, 0);
    }
}
