//! Applying decoded event batches of one (endpoint, rank) stream to a service's index, with the
//! block-size guard, the parity check / token re-hash, and the per-event metrics.
//!
//! Semantics: `BlockStored` adds one reference per listed block; `BlockRemoved` drops one;
//! `AllBlocksCleared` empties the publishing DP rank's blocks of the endpoint (each vLLM DP
//! rank is an engine core with its own cache and publisher; see [`ServiceKv::clear_rank`]).
//! A `BlockStored` whose `block_size` differs from `kvBlockSize` is rejected and counted
//! (`loxilb_kv_events_rejected_total{reason="block_size"}`) and shown in the parity report;
//! malformed events are counted with `reason="malformed"`. Neither stops the stream.
//!
//! Hybrid models and offload tiers: only blocks of a prefix group ([`is_prefix_group`]) enter
//! the index; a `BlockRemoved` of a group last seen as non-prefix (by `group_idx`) is ignored
//! (the full-attention group's copy of the same hash stays). Blocks are kept per tier
//! ([`tier_of`] of `medium`) and removed from the tier the event names.

use super::events::{EventBatch, KvEvent, Medium};
use crate::kv::BlockKey;
use crate::kv::index::Tier;
use crate::kv::members::Member;
use crate::kv::metrics::{EpLabels, EpReasonLabels, KvMetrics, ep_label};
use crate::kv::state::ServiceKv;
use crate::routing::EpIdx;

/// Where a batch is applied: the stream's member, its current position in the rule (for
/// labels) and its DP rank.
#[derive(Debug, Clone, Copy)]
struct Position {
    member: Member,
    pos: EpIdx,
    rank: u32,
}

/// Counts of one applied batch.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Events applied.
    pub applied: u64,
    /// Events rejected (malformed or wrong block size).
    pub rejected: u64,
}

/// Most distinct KV cache groups (`group_idx`) one endpoint's events may name; a `BlockStored`
/// naming another is rejected (`loxilb_kv_events_rejected_total{reason="group_idx"}`). Real
/// models have a few (hybrid ones a few dozen).
pub const MAX_GROUPS_PER_ENDPOINT: usize = 256;

impl ServiceKv {
    /// Applies `batch`, received on stream (`member`, `rank`), to the index and updates metrics
    /// at the member's current position. A batch of a member that left the rule is dropped
    /// (its stream is being stopped); the member list is read-locked for the whole batch, so a
    /// concurrent [`ServiceKv::sync_endpoints`] cannot forget the member half-way through it.
    pub fn apply_batch(
        &self,
        member: Member,
        rank: u32,
        batch: &EventBatch,
        m: &KvMetrics,
    ) -> Applied {
        let members = self.members.read();
        let Some(pos) = members.idx_of(member).filter(|_| !self.is_retired()) else {
            return Applied::default();
        };
        let mut out = Applied::default();
        let at = Position { member, pos, rank };
        for ev in &batch.events {
            let reason = match ev {
                Ok(ev) => self.apply_event(at, ev, m).err(),
                Err(_) => Some("malformed"),
            };
            match reason {
                None => out.applied += 1,
                Some(r) => {
                    out.rejected += 1;
                    let l = EpReasonLabels {
                        service: self.label(),
                        ep: ep_label(pos, rank),
                        reason: r.into(),
                    };
                    m.events_rejected.get_or_create(&l).inc();
                }
            }
        }
        let l = EpLabels {
            service: self.label(),
            ep: ep_label(pos, rank),
        };
        m.events_applied.get_or_create(&l).inc_by(out.applied);
        m.set_blocks(&self.label(), pos, self.index.blocks(member));
        out
    }

    fn apply_event(&self, at: Position, ev: &KvEvent, m: &KvMetrics) -> Result<(), &'static str> {
        let (ep, rank) = (at.member, at.rank);
        match ev {
            KvEvent::BlockStored(st) => {
                let prefix = is_prefix_group(
                    st.kv_cache_spec_kind.as_deref(),
                    st.kv_cache_spec_sliding_window,
                );
                if let Some(g) = st.group_idx {
                    let mut groups = self.groups.lock();
                    // A model has a handful of KV cache groups; a publisher naming ever new
                    // ones would grow this map without bound (nothing else clears it).
                    if !groups.contains_key(&(ep, g))
                        && groups.keys().filter(|(m, _)| *m == ep).count()
                            >= MAX_GROUPS_PER_ENDPOINT
                    {
                        return Err("group_idx");
                    }
                    groups.insert((ep, g), prefix);
                }
                if !prefix {
                    // A sliding-window / state-space group: its blocks are not a reusable
                    // prefix on their own (see README "Hybrid models and offload tiers").
                    return Ok(());
                }
                let bs = self.config.block_size;
                if let Some(ebs) = st.block_size.filter(|&b| b != bs) {
                    self.parity.lock().reject_block_size(ep, ebs);
                    return Err("block_size");
                }
                let keys = if st.token_ids.is_empty() {
                    st.block_hashes.iter().map(|h| h.key()).collect()
                } else {
                    let t =
                        self.parity
                            .lock()
                            .on_stored(ep, st, &self.hasher, bs as usize, &self.lora);
                    if t.verdict_changed {
                        self.publish_parity(at, m);
                    }
                    if t.first_untranslated > 0 {
                        tracing::warn!(
                            service = self.id,
                            ep_idx = at.pos,
                            rank,
                            blocks = t.first_untranslated,
                            "KV re-hash: blocks the engine stored cannot be re-hashed (no token \
                             ids, an unknown parent or extra keys) and are left out of the \
                             index; counted in the parity report's untranslated_blocks"
                        );
                    }
                    t.keys
                };
                let out = self.index.store_in(ep, rank, tier_of(&st.medium), &keys);
                self.cross.lock().observed(ep, &keys);
                if out.evicted > 0 {
                    m.cap_evictions
                        .get_or_create(&EpLabels {
                            service: self.label(),
                            ep: ep_label(at.pos, rank),
                        })
                        .inc_by(out.evicted);
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => {
                if let Some(g) = group_idx
                    && self.groups.lock().get(&(ep, *g)) == Some(&false)
                {
                    // The copy a non-prefix group dropped; the full-attention group's stays.
                    return Ok(());
                }
                let engine: Vec<BlockKey> = block_hashes.iter().map(|h| h.key()).collect();
                let tier = tier_of(medium);
                let keys = match tier {
                    Tier::Gpu => self
                        .parity
                        .lock()
                        .on_removed(ep, &engine, self.hasher.algo()),
                    Tier::Offload => self
                        .parity
                        .lock()
                        .translate(ep, &engine, self.hasher.algo()),
                };
                self.index.remove_in(ep, rank, tier, &keys);
            }
            KvEvent::AllBlocksCleared => self.clear_rank(ep, rank),
        }
        Ok(())
    }

    /// `AllBlocksCleared` from DP rank `rank` of member `ep`: drops that rank's blocks (both
    /// tiers) only. In vLLM every data-parallel rank is its own engine core with its own
    /// prefix cache and its own `ZmqEventPublisher` (`vllm/distributed/kv_events.py`,
    /// `EventPublisher`: "each DP rank runs its own EventPublisher instance ... annotate events
    /// with their data_parallel_rank"), so a reset published by one rank says nothing about
    /// the others. The member's cached digests are dropped only when the rule has one rank
    /// (they are shared by its ranks' re-hash translation).
    pub fn clear_rank(&self, ep: Member, rank: u32) {
        self.index.clear_rank(ep, rank);
        if self.config.dp_ranks <= 1 {
            self.parity.lock().clear(ep);
        }
    }

    /// Drops every block of member `ep` (all ranks, both tiers) and its cached digests.
    pub fn clear_endpoint(&self, ep: Member) {
        self.index.clear_endpoint(ep);
        self.parity.lock().clear(ep);
    }

    /// Sets the endpoint's `loxilb_kv_parity_ok` gauge after its verdict changed, and logs the
    /// diagnosis when the change was to a mismatch.
    fn publish_parity(&self, at: Position, m: &KvMetrics) {
        let (ok, mismatch) = {
            let book = self.parity.lock();
            let p = book.get(at.member);
            let mismatch = p
                .filter(|p| p.verdict == super::parity::Verdict::Mismatch)
                .and_then(|p| p.diagnosis.clone());
            (
                p.is_some_and(|p| p.verdict == super::parity::Verdict::Ok),
                mismatch,
            )
        };
        if let Some(diagnosis) = mismatch {
            tracing::warn!(
                service = self.id,
                ep_idx = at.pos,
                rank = at.rank,
                %diagnosis,
                "KV parity mismatch: engine block hashes differ from loxi's; switching this \
                 endpoint to token re-hash (loxicmd get kvparity)"
            );
        }
        m.parity_ok
            .get_or_create(&EpLabels {
                service: self.label(),
                ep: ep_label(at.pos, at.rank),
            })
            .set(i64::from(ok));
    }
}

/// True for a KV cache group whose blocks form a reusable prefix: full attention
/// (`full_attention`, `mla_attention`, `sink_full_attention`) or a single-group model that
/// publishes no kind. Sliding-window, chunked-local and state-space (`mamba`) groups keep only
/// a window or a state; vLLM's prefix cache can reuse a hybrid model's prefix only as far as
/// its full-attention group holds it, so only that group is scored.
pub fn is_prefix_group(kind: Option<&str>, sliding_window: Option<u32>) -> bool {
    if sliding_window.is_some() {
        return false;
    }
    match kind {
        None => true,
        Some(k) => ["full_attention", "mla_attention", "sink_full_attention"]
            .iter()
            .any(|f| k.eq_ignore_ascii_case(f)),
    }
}

/// The index tier of a published `medium`: GPU, or the offload tier for anything else.
pub fn tier_of(m: &Medium) -> Tier {
    match m {
        Medium::Gpu => Tier::Gpu,
        Medium::Cpu | Medium::Other(_) => Tier::Offload,
    }
}

#[cfg(test)]
mod tests {
    use rmpv::Value as V;

    use super::*;
    use crate::kv::ingest::events::decode_batch;
    use crate::kv::settings::KvSettings;
    use crate::kv::testutil::{msgpack, rule, state, stored_batch};

    fn batch(events: Vec<V>, rank: V) -> EventBatch {
        decode_batch(&msgpack(&V::Array(vec![
            V::F64(0.0),
            V::Array(events),
            rank,
        ])))
        .expect("decode")
    }

    #[test]
    fn all_blocks_cleared_from_one_dp_rank_empties_that_rank_only() {
        let (st, _reg) = state(KvSettings::default());
        let svc = st
            .service(&rule(1, 2, serde_json::json!({})))
            .expect("kv rule");
        let stored = decode_batch(&stored_batch(&[1, 2], 16)).expect("decode");
        svc.apply_batch(0, 0, &stored, &st.metrics);
        svc.apply_batch(0, 1, &stored, &st.metrics);
        svc.apply_batch(1, 0, &stored, &st.metrics);
        let clear = V::Map(vec![(V::from("type"), V::from("AllBlocksCleared"))]);
        assert_eq!((svc.index.blocks(0), svc.index.blocks(1)), (4, 2));
        svc.apply_batch(0, 1, &batch(vec![clear], V::from(1)), &st.metrics);
        assert_eq!((svc.index.blocks(0), svc.index.blocks(1)), (2, 2));
        let now = tokio::time::Instant::now();
        assert_eq!(
            svc.index.score(&[BlockKey(1), BlockKey(2)], now),
            vec![(0, 2), (1, 2)],
            "rank 0 of endpoint 0 still holds the prefix"
        );
    }

    /// A map `BlockStored` (no token ids) of `keys` with vLLM 0.32's hybrid/offload fields.
    fn stored(keys: &[u64], medium: &str, group: u32, kind: &str, window: Option<u32>) -> V {
        V::Map(vec![
            (V::from("type"), V::from("BlockStored")),
            (
                V::from("block_hashes"),
                V::Array(keys.iter().map(|&k| V::from(k)).collect()),
            ),
            (V::from("parent_block_hash"), V::Nil),
            (V::from("token_ids"), V::Array(vec![])),
            (V::from("block_size"), V::from(16)),
            (V::from("lora_id"), V::Nil),
            (V::from("medium"), V::from(medium)),
            (V::from("lora_name"), V::Nil),
            (V::from("group_idx"), V::from(group)),
            (V::from("kv_cache_spec_kind"), V::from(kind)),
            (
                V::from("kv_cache_spec_sliding_window"),
                window.map_or(V::Nil, V::from),
            ),
            (V::from("locality"), V::from("LOCAL")),
            (V::from("ownership"), V::from("OWNED")),
        ])
    }

    fn removed(keys: &[u64], medium: &str, group: u32) -> V {
        V::Map(vec![
            (V::from("type"), V::from("BlockRemoved")),
            (
                V::from("block_hashes"),
                V::Array(keys.iter().map(|&k| V::from(k)).collect()),
            ),
            (V::from("medium"), V::from(medium)),
            (V::from("group_idx"), V::from(group)),
        ])
    }

    /// A hybrid model publishes the same hashes for its full-attention group 0 and its
    /// sliding-window group 1: only group 0 enters the index, and group 1's removal of a hash
    /// leaves group 0's copy.
    #[test]
    fn only_the_full_attention_group_is_indexed_and_other_groups_removals_are_ignored() {
        let (st, _reg) = state(KvSettings::default());
        let svc = st
            .service(&rule(1, 2, serde_json::json!({})))
            .expect("kv rule");
        let b = batch(
            vec![
                stored(&[1, 2], "GPU", 0, "full_attention", None),
                stored(&[1, 2, 3, 4], "GPU", 1, "sliding_window", Some(128)),
            ],
            V::from(0),
        );
        assert_eq!(svc.apply_batch(0, 0, &b, &st.metrics).applied, 2);
        svc.apply_batch(
            1,
            0,
            &batch(
                vec![stored(&[1, 2, 3], "GPU", 1, "mamba", None)],
                V::from(0),
            ),
            &st.metrics,
        );
        let keys: Vec<BlockKey> = [1, 2, 3, 4].map(BlockKey).to_vec();
        assert_eq!(
            svc.index.score(&keys, tokio::time::Instant::now()),
            vec![(0, 2)]
        );
        assert_eq!(svc.index.blocks(1), 0);
        svc.apply_batch(
            0,
            0,
            &batch(vec![removed(&[1], "GPU", 1)], V::from(0)),
            &st.metrics,
        );
        assert_eq!(svc.index.blocks(0), 2, "group 1 dropped its copy only");
        svc.apply_batch(
            0,
            0,
            &batch(vec![removed(&[1], "GPU", 0)], V::from(0)),
            &st.metrics,
        );
        assert_eq!(svc.index.blocks(0), 1);
    }

    /// A publisher naming ever new `group_idx` values is cut at the per-endpoint bound: the
    /// events past it are rejected (counted by reason), groups already known still apply, and
    /// another endpoint has its own bound.
    #[test]
    fn distinct_groups_per_endpoint_are_bounded() {
        let (st, reg) = state(KvSettings::default());
        let svc = st
            .service(&rule(1, 2, serde_json::json!({})))
            .expect("kv rule");
        let n = u32::try_from(MAX_GROUPS_PER_ENDPOINT).expect("fits") + 10;
        let evs: Vec<V> = (0..n)
            .map(|g| stored(&[7], "GPU", g, "sliding_window", Some(128)))
            .collect();
        let out = svc.apply_batch(0, 0, &batch(evs, V::from(0)), &st.metrics);
        assert_eq!(
            (out.applied, out.rejected),
            (MAX_GROUPS_PER_ENDPOINT as u64, 10)
        );
        assert_eq!(svc.groups.lock().len(), MAX_GROUPS_PER_ENDPOINT);
        let known = batch(
            vec![stored(&[1], "GPU", 3, "full_attention", None)],
            V::from(0),
        );
        assert_eq!(svc.apply_batch(0, 0, &known, &st.metrics).applied, 1);
        let other = batch(
            vec![stored(&[1], "GPU", n + 1, "full_attention", None)],
            V::from(0),
        );
        assert_eq!(svc.apply_batch(1, 0, &other, &st.metrics).applied, 1);
        let rejected = crate::kv::testutil::metric_value(
            &reg,
            "loxilb_kv_events_rejected_total{service=\"1\",ep=\"0\",reason=\"group_idx\"}",
        );
        assert_eq!(rejected, 10.0);
    }

    /// Blocks are kept per medium: a CPU copy is not a GPU prefix, a CPU removal leaves the GPU
    /// copy and a GPU removal leaves the CPU copy; a clear empties both.
    #[test]
    fn blocks_are_tracked_and_removed_per_medium() {
        let (st, _reg) = state(KvSettings::default());
        let svc = st
            .service(&rule(1, 1, serde_json::json!({})))
            .expect("kv rule");
        let keys: Vec<BlockKey> = [1, 2].map(BlockKey).to_vec();
        let b = batch(
            vec![
                stored(&[1, 2], "CPU", 0, "full_attention", None),
                stored(&[1], "GPU", 0, "full_attention", None),
            ],
            V::from(0),
        );
        svc.apply_batch(0, 0, &b, &st.metrics);
        let now = tokio::time::Instant::now();
        assert_eq!(svc.index.score(&keys, now), vec![(0, 1)], "GPU prefix");
        assert_eq!(svc.index.any_tier_runs(&keys), vec![(0, 2)], "either tier");
        svc.apply_batch(
            0,
            0,
            &batch(vec![removed(&[1], "CPU", 0)], V::from(0)),
            &st.metrics,
        );
        assert_eq!(svc.index.score(&keys, now), vec![(0, 1)], "GPU copy stays");
        // Block 1 on the GPU, block 2 on the CPU: a two-block prefix across the tiers.
        assert_eq!(svc.index.any_tier_runs(&keys), vec![(0, 2)]);
        svc.apply_batch(
            0,
            0,
            &batch(vec![removed(&[1], "GPU", 0)], V::from(0)),
            &st.metrics,
        );
        assert_eq!(svc.index.score(&keys, now), vec![]);
        assert_eq!(
            svc.index.any_tier_runs(&[BlockKey(2)]),
            vec![(0, 1)],
            "CPU copy of 2 stays"
        );
        let clear = V::Map(vec![(V::from("type"), V::from("AllBlocksCleared"))]);
        svc.apply_batch(0, 0, &batch(vec![clear], V::from(0)), &st.metrics);
        assert_eq!(svc.index.any_tier_runs(&[BlockKey(2)]), vec![]);
        assert_eq!(svc.index.blocks(0), 0);
    }

    /// On an endpoint in token re-hash mode (engine seed differs), blocks stored by an event
    /// without token ids are held under the engine's keys and a `BlockRemoved` removes them.
    #[test]
    fn rehash_endpoint_removes_blocks_stored_without_token_ids() {
        let (st, _reg) = state(KvSettings::default());
        let svc = st
            .service(&rule(1, 1, serde_json::json!({})))
            .expect("kv rule");
        let engine = crate::kv::block_hash::BlockHasher::new(
            crate::kv::block_hash::HashAlgo::Sha256Cbor,
            Some("42"),
        );
        let toks: Vec<u32> = (0..32).collect();
        let keys: Vec<u64> = engine
            .keys(&toks, 16, &Default::default())
            .iter()
            .map(|k| k.0)
            .collect();
        let with_tokens =
            crate::kv::testutil::vllm_stored_event(&keys, &toks, 16, None, vec![V::Nil, V::Nil]);
        let (_, logged) = crate::telemetry::LogBuf::capture(|| {
            svc.apply_batch(0, 0, &batch(vec![with_tokens], V::from(0)), &st.metrics)
        });
        assert!(svc.parity.lock().get(0).expect("report").rehash);
        assert!(
            logged.contains("KV parity mismatch")
                && logged.contains("service=1 ep_idx=0 rank=0 diagnosis="),
            "the WARN names the service and endpoint: {logged}"
        );
        let bare = decode_batch(&stored_batch(&[77, 78], 16)).expect("decode");
        svc.apply_batch(0, 0, &bare, &st.metrics);
        assert_eq!(svc.index.blocks(0), 4);
        svc.apply_batch(
            0,
            0,
            &batch(vec![removed(&[77], "GPU", 0)], V::from(0)),
            &st.metrics,
        );
        assert_eq!(svc.index.blocks(0), 3);
        assert!(!svc.index.holds_key(0, BlockKey(77)));
    }

    #[test]
    fn block_size_mismatch_is_rejected_counted_and_reported() {
        let (st, _reg) = state(KvSettings::default());
        let svc = st
            .service(&rule(1, 1, serde_json::json!({"kvBlockSize": 16})))
            .expect("kv rule");
        let b = decode_batch(&stored_batch(&[7], 768)).expect("decode");
        let out = svc.apply_batch(0, 0, &b, &st.metrics);
        assert_eq!(
            out,
            Applied {
                applied: 0,
                rejected: 1
            }
        );
        assert_eq!(svc.index.blocks(0), 0);
        let p = svc.parity.lock().get(0).cloned().expect("report");
        assert_eq!((p.block_size_rejects, p.engine_block_size), (1, Some(768)));
        let l = EpReasonLabels {
            service: "1".into(),
            ep: "0".into(),
            reason: "block_size".into(),
        };
        assert_eq!(st.metrics.events_rejected.get_or_create(&l).get(), 1);
    }

    #[test]
    fn malformed_event_counted_rest_of_batch_applies() {
        let (st, _reg) = state(KvSettings::default());
        let svc = st
            .service(&rule(1, 1, serde_json::json!({})))
            .expect("kv rule");
        let good = V::Array(vec![
            V::from("BlockStored"),
            V::Array(vec![V::from(9u64)]),
            V::Nil,
            V::Array(vec![]),
            V::from(16),
        ]);
        let bad = V::Array(vec![V::from("BlockStored"), V::from("not a list")]);
        let out = svc.apply_batch(0, 0, &batch(vec![bad, good], V::Nil), &st.metrics);
        assert_eq!(
            out,
            Applied {
                applied: 1,
                rejected: 1
            }
        );
        assert!(svc.index.holds_key(0, BlockKey(9)));
        let l = EpReasonLabels {
            service: "1".into(),
            ep: "0".into(),
            reason: "malformed".into(),
        };
        assert_eq!(st.metrics.events_rejected.get_or_create(&l).get(), 1);
    }
}
