//! Parity self-check and token re-hash (DESIGN.md "KV path").
//!
//! When a `BlockStored` carries token ids, loxi recomputes each block's digest from (parent,
//! tokens, extra keys) under the rule's algorithm and seed. The first [`ESTABLISH_BLOCKS`]
//! agreeing blocks set the verdict `Ok` (`loxilb_kv_parity_ok` = 1) and checking stops. The
//! first disagreement is diagnosed — the other algorithm and the usual seed candidates are tried
//! on a chain-root block, and the token count per block is compared with `kvBlockSize` — logged
//! once, and the endpoint switches to *token re-hash*: the index stores loxi's own key for
//! each block and an engine-key → own-digest map translates later parents and removals. Blocks
//! whose parent loxi never saw (or whose extra keys it cannot reconstruct) cannot be re-hashed
//! and are not indexed.

use std::collections::HashMap;

use serde::Serialize;

use super::events::BlockStored;
use crate::kv::BlockKey;
use crate::kv::block_hash::{BlockDigest, BlockHasher, ExtraKey, HashAlgo, VLLM_UNSET_SEED};
use crate::kv::lora::LoraCatalog;
use crate::kv::members::Member;

/// Agreeing blocks needed before the verdict is `Ok` and checking stops.
pub const ESTABLISH_BLOCKS: u64 = 8;

/// Seeds tried when diagnosing a mismatch.
const SEED_CANDIDATES: [&str; 5] = [VLLM_UNSET_SEED, "0", "42", "1", ""];

/// Parity verdict of one endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// No block with token ids checked yet.
    #[default]
    Unknown,
    /// The engine's hashes equal loxi's.
    Ok,
    /// They differ; token re-hash is active.
    Mismatch,
}

/// What the parity check learned about one endpoint (the `/kv/parity` report). A clone is
/// the report only: its [`Digests`] table is not copied.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EpParity {
    /// Verdict.
    pub verdict: Verdict,
    /// Blocks compared.
    pub checked_blocks: u64,
    /// Blocks that disagreed.
    pub mismatched_blocks: u64,
    /// Which leg looks wrong (`seed`, `algorithm`, `block_size`, `unknown`) and the evidence.
    pub diagnosis: Option<String>,
    /// `BlockStored` events rejected because their `block_size` differs from `kvBlockSize`.
    pub block_size_rejects: u64,
    /// The last rejected `block_size`.
    pub engine_block_size: Option<u32>,
    /// True when the index holds loxi's own keys for this endpoint.
    pub rehash: bool,
    /// Blocks with extra keys (LoRA, cache salt) whose digest differed from the engine's, and
    /// the blocks after them in their event: not held against the engine (see `own_chain`).
    pub unverified_blocks: u64,
    /// Blocks re-hash mode left out of the index because loxi cannot compute their digest (an
    /// event without token ids, token ids that are not `blocks × kvBlockSize`, a parent it
    /// never saw, extra keys it cannot reproduce): the endpoint holds them, loxi does not
    /// know it, so requests reusing them score lower there.
    pub untranslated_blocks: u64,
    /// Engine key → loxi's full digest of that block (kept while checking and in re-hash mode).
    #[serde(skip)]
    digests: Digests,
}

impl EpParity {
    /// True when the engine runs another block size: its stored events were refused for their
    /// `block_size` and none was ever checked, so the index holds nothing of its cache
    /// (readiness `mismatch`, leg `block_size`; not "heard" for cold placement).
    pub fn only_block_size_rejects(&self) -> bool {
        self.block_size_rejects > 0 && self.checked_blocks == 0
    }
}

/// Engine key → loxi's full digest of that block: one entry per block stored in re-hash mode,
/// millions on a big cache. Its clone is empty: the readiness sweep and the parity view clone
/// an endpoint's report every second under the parity lock, and copying this table there
/// stalled routing for hundreds of milliseconds each second; only the book's own copy is used.
#[derive(Debug, Default)]
struct Digests(HashMap<u64, BlockDigest>);

impl Clone for Digests {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::ops::Deref for Digests {
    type Target = HashMap<u64, BlockDigest>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Digests {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// Parity state of every endpoint of a service.
#[derive(Debug, Default)]
pub struct ParityBook {
    eps: HashMap<Member, EpParity>,
}

/// How a stored event enters the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Translated {
    /// Keys to store for the endpoint.
    pub keys: Vec<BlockKey>,
    /// True when this event changed the verdict (the caller updates the gauge, and logs the
    /// diagnosis when it became a mismatch).
    pub verdict_changed: bool,
    /// Blocks of this event left out of the index because they cannot be re-hashed (no token
    /// ids, an unknown parent or extra keys), when they are the endpoint's first such blocks
    /// (the caller warns once); 0 otherwise.
    pub first_untranslated: u64,
}

impl ParityBook {
    /// The report of `ep`.
    pub fn get(&self, ep: Member) -> Option<&EpParity> {
        self.eps.get(&ep)
    }

    /// All endpoints with a report, sorted.
    pub fn all(&self) -> Vec<(Member, EpParity)> {
        let mut v: Vec<_> = self.eps.iter().map(|(k, v)| (*k, v.clone())).collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Records a `block_size` rejection.
    pub fn reject_block_size(&mut self, ep: Member, engine_bs: u32) {
        let p = self.eps.entry(ep).or_default();
        p.block_size_rejects += 1;
        p.engine_block_size = Some(engine_bs);
    }

    /// Forgets cached digests of `ep` (endpoint cleared); the verdict stays.
    pub fn clear(&mut self, ep: Member) {
        if let Some(p) = self.eps.get_mut(&ep) {
            p.digests.clear();
        }
    }

    /// Resets `ep` completely (engine restart: it may now run with other settings).
    pub fn reset(&mut self, ep: Member) {
        self.eps.remove(&ep);
    }

    /// Checks (while the verdict is not established) and translates one stored event into the
    /// keys the index should hold for `ep`.
    pub fn on_stored(
        &mut self,
        ep: Member,
        ev: &BlockStored,
        hasher: &BlockHasher,
        block_size: usize,
        lora: &LoraCatalog,
    ) -> Translated {
        let p = self.eps.entry(ep).or_default();
        let engine: Vec<BlockKey> = ev.block_hashes.iter().map(|h| h.key()).collect();
        let need_own = p.verdict != Verdict::Ok || p.rehash;
        let own = if need_own {
            own_chain(p, ev, &engine, hasher, block_size, lora)
        } else {
            Vec::new()
        };
        let before = p.verdict.clone();
        if p.verdict != Verdict::Mismatch {
            check(p, ev, &engine, &own, hasher, block_size);
        }
        for (k, d) in engine.iter().zip(&own) {
            if let Some(d) = d {
                p.digests.insert(k.0, *d);
            }
        }
        if p.verdict == Verdict::Ok {
            p.digests.clear();
        }
        let mut first_untranslated = 0;
        let keys = if p.rehash {
            let keys: Vec<BlockKey> = own.iter().flatten().map(|d| d.key(hasher.algo())).collect();
            let left_out = (engine.len() - keys.len()) as u64;
            if p.untranslated_blocks == 0 {
                first_untranslated = left_out;
            }
            p.untranslated_blocks += left_out;
            keys
        } else {
            engine
        };
        Translated {
            keys,
            verdict_changed: before != p.verdict,
            first_untranslated,
        }
    }

    /// Engine keys → index keys without forgetting anything (re-hash mode maps them through
    /// the digests it knows, the others stay as they are; otherwise the keys themselves). For removals
    /// from the offload tier, whose GPU copy may still be held.
    pub fn translate(&self, ep: Member, engine: &[BlockKey], algo: HashAlgo) -> Vec<BlockKey> {
        match self.eps.get(&ep) {
            Some(p) if p.rehash => engine
                .iter()
                .map(|k| p.digests.get(&k.0).map_or(*k, |d| d.key(algo)))
                .collect(),
            _ => engine.to_vec(),
        }
    }

    /// Translates removed engine keys into index keys (re-hash mode maps and forgets them; a
    /// key without a digest, stored from an event without token ids, is removed as is).
    pub fn on_removed(&mut self, ep: Member, engine: &[BlockKey], algo: HashAlgo) -> Vec<BlockKey> {
        let Some(p) = self.eps.get_mut(&ep) else {
            return engine.to_vec();
        };
        if !p.rehash {
            engine.iter().for_each(|k| {
                p.digests.remove(&k.0);
            });
            return engine.to_vec();
        }
        // A key loxi has no digest for was stored as the engine's own key (a `BlockStored`
        // without token ids): it is removed as such.
        engine
            .iter()
            .map(|k| p.digests.remove(&k.0).map_or(*k, |d| d.key(algo)))
            .collect()
    }
}

/// Reconstructs the tagged extra keys of block `j` from the untagged entry vLLM 0.32 publishes
/// (`BlockStored.extra_keys`: one entry per block, `null` or a tuple; the tuple is
/// `generate_block_hash_extra_keys`'s `lora_extra_keys + mm_extra_keys + cache_salt_keys +
/// prompt_embeds_keys` in `vllm/v1/core/kv_cache_utils.py`): the LoRA name (equal to the
/// event's `lora_name`), then one `(identifier, offset)` pair per multimodal item, then the
/// cache salt (a bare string, on the request's block 0 only, i.e. the root block of a chain),
/// then a prompt-embeddings digest (bytes). `None` when the keys cannot be reproduced: a
/// multimodal item or prompt embeddings (no vLLM-generated vectors for them), an adapter the
/// catalog does not know, or any other shape.
fn extra_of(ev: &BlockStored, j: usize, root: bool, lora: &LoraCatalog) -> Option<Vec<ExtraKey>> {
    use rmpv::Value;
    let entry = ev
        .extra_keys
        .as_ref()
        .and_then(|e| e.get(j))
        .filter(|v| !v.is_nil());
    let mut items: &[Value] = match entry {
        None => &[],
        Some(Value::Array(a)) => a,
        Some(_) => return None,
    };
    let mut out = Vec::new();
    if let Some(name) = &ev.lora_name {
        out.push(ExtraKey::Lora(name.clone(), lora.resolve(name)?.path));
        if let [Value::String(first), rest @ ..] = items
            && first.as_str() == Some(name.as_str())
        {
            items = rest;
        }
    }
    match items {
        [] => Some(out),
        [Value::String(salt)] if root && j == 0 => {
            out.push(ExtraKey::CacheSalt(salt.as_str()?.to_owned()));
            Some(out)
        }
        _ => None,
    }
}

/// loxi's digest of every block of the event (`None` where it cannot be computed).
///
/// Outside re-hash mode a block with extra keys whose digest differs from the engine's is not
/// evidence against the engine (the published form drops the LoRA path, which loxi takes from
/// its catalog, and the tags): that block and the rest of the event get no digest, so they are
/// neither checked nor chained from (counted in `unverified_blocks`). Plain blocks decide the
/// verdict.
fn own_chain(
    p: &mut EpParity,
    ev: &BlockStored,
    engine: &[BlockKey],
    hasher: &BlockHasher,
    bs: usize,
    lora: &LoraCatalog,
) -> Vec<Option<BlockDigest>> {
    let n = ev.block_hashes.len();
    if bs == 0 || ev.token_ids.len() != n * bs {
        return vec![None; n];
    }
    let root = ev.parent_block_hash.is_none();
    let mut parent = match &ev.parent_block_hash {
        None => Some(*hasher.none_hash()),
        Some(h) => p.digests.get(&h.key().0).copied(),
    };
    let mut out = Vec::with_capacity(n);
    for (j, engine_key) in engine.iter().enumerate().take(n) {
        let extra = extra_of(ev, j, root, lora);
        let has_extra = extra.as_ref().is_none_or(|x| !x.is_empty());
        let mut d = match (parent, extra) {
            (Some(par), Some(x)) => {
                Some(hasher.hash_block(&par, &ev.token_ids[j * bs..(j + 1) * bs], &x))
            }
            _ => None,
        };
        if has_extra && !p.rehash && d.is_some_and(|d| d.key(hasher.algo()) != *engine_key) {
            p.unverified_blocks += (n - j) as u64;
            d = None;
        }
        parent = d;
        out.push(d);
    }
    out
}

fn check(
    p: &mut EpParity,
    ev: &BlockStored,
    engine: &[BlockKey],
    own: &[Option<BlockDigest>],
    hasher: &BlockHasher,
    bs: usize,
) {
    for (j, (k, d)) in engine.iter().zip(own).enumerate() {
        let Some(d) = d else { continue };
        p.checked_blocks += 1;
        if d.key(hasher.algo()) == *k {
            continue;
        }
        p.mismatched_blocks += 1;
        p.verdict = Verdict::Mismatch;
        p.rehash = true;
        p.diagnosis = Some(diagnose(ev, j, *k, hasher, bs));
        return;
    }
    if p.checked_blocks >= ESTABLISH_BLOCKS && p.verdict == Verdict::Unknown {
        p.verdict = Verdict::Ok;
    }
}

/// Names the leg that looks wrong, with the evidence.
pub fn diagnose(
    ev: &BlockStored,
    j: usize,
    engine: BlockKey,
    hasher: &BlockHasher,
    bs: usize,
) -> String {
    let n = ev.block_hashes.len().max(1);
    if ev.token_ids.len() != n * bs {
        return format!(
            "block_size: {} tokens for {n} blocks, rule kvBlockSize {bs}",
            ev.token_ids.len()
        );
    }
    if ev.parent_block_hash.is_some() || j != 0 {
        return format!(
            "unknown: first mismatch at a non-root block (block {j}); no root block to test seed/algorithm against yet (rule {})",
            hasher.algo()
        );
    }
    let tokens = &ev.token_ids[..bs];
    let extra = match &ev.extra_keys {
        Some(e) if e.first().is_some_and(|v| !v.is_nil()) => {
            return "unknown: root block carries extra keys".into();
        }
        _ => Vec::new(),
    };
    for algo in [HashAlgo::Sha256Cbor, HashAlgo::XxhashCbor] {
        for seed in SEED_CANDIDATES {
            let h = BlockHasher::new(algo, Some(seed));
            if h.hash_block(h.none_hash(), tokens, &extra).key(algo) == engine {
                let leg = if algo != hasher.algo() {
                    "algorithm"
                } else {
                    "seed"
                };
                return format!(
                    "{leg}: engine matches {algo} with seed {seed:?}; rule uses {} with loxi's LLB_KV_NONE_HASH_SEED",
                    hasher.algo()
                );
            }
        }
    }
    format!(
        "unknown: no candidate algorithm/seed reproduces the engine's root block (vLLM's pickle `sha256`, an unlisted seed, or a different tokenizer); rule {}",
        hasher.algo()
    )
}

#[cfg(test)]
#[path = "parity_tests.rs"]
mod tests;
