//! Applying decoded event batches of one (endpoint, rank) stream to a service's index, with the
//! block-size guard, the parity check / token re-hash, and the per-event metrics.
//!
//! Semantics: `BlockStored` adds one reference per listed block; `BlockRemoved` drops one;
//! `AllBlocksCleared` empties every rank of the endpoint (vLLM resets the whole engine cache).
//! A `BlockStored` whose `block_size` differs from `kvBlockSize` is rejected and counted
//! (`loxilb_kv_events_rejected_total{reason="block_size"}`) and shown in the parity report;
//! malformed events are counted with `reason="malformed"`. Neither stops the stream.

use super::events::{EventBatch, KvEvent};
use crate::kv::BlockKey;
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
                    t.keys
                };
                let out = self.index.store(ep, rank, &keys);
                if out.evicted > 0 {
                    m.cap_evictions
                        .get_or_create(&EpLabels {
                            service: self.label(),
                            ep: ep_label(at.pos, rank),
                        })
                        .inc_by(out.evicted);
                }
            }
            KvEvent::BlockRemoved { block_hashes } => {
                let engine: Vec<BlockKey> = block_hashes.iter().map(|h| h.key()).collect();
                let keys = self
                    .parity
                    .lock()
                    .on_removed(ep, &engine, self.hasher.algo());
                self.index.remove(ep, rank, &keys);
            }
            KvEvent::AllBlocksCleared => self.clear_endpoint(ep),
        }
        Ok(())
    }

    /// Drops every block of member `ep` (all ranks) and its cached digests.
    pub fn clear_endpoint(&self, ep: Member) {
        self.index.clear_endpoint(ep);
        self.parity.lock().clear(ep);
    }

    fn publish_parity(&self, at: Position, m: &KvMetrics) {
        let ok = self
            .parity
            .lock()
            .get(at.member)
            .map(|p| p.verdict == super::parity::Verdict::Ok)
            .unwrap_or(false);
        m.parity_ok
            .get_or_create(&EpLabels {
                service: self.label(),
                ep: ep_label(at.pos, at.rank),
            })
            .set(i64::from(ok));
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
    fn all_blocks_cleared_empties_every_rank_of_the_endpoint() {
        let (st, _reg) = state(KvSettings::default());
        let svc = st
            .service(&rule(1, 2, serde_json::json!({})))
            .expect("kv rule");
        let stored = decode_batch(&stored_batch(&[1, 2], 16)).expect("decode");
        svc.apply_batch(0, 0, &stored, &st.metrics);
        svc.apply_batch(0, 1, &stored, &st.metrics);
        svc.apply_batch(1, 0, &stored, &st.metrics);
        let clear = V::Map(vec![(V::from("type"), V::from("AllBlocksCleared"))]);
        svc.apply_batch(0, 1, &batch(vec![clear], V::from(1)), &st.metrics);
        assert_eq!((svc.index.blocks(0), svc.index.blocks(1)), (0, 2));
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
