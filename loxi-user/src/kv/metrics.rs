//! Metric families of the KV tier, with the names and labels of LoxiLB's spec
//! (`../shared/spec/kv-cache-aware-routing.txt` §10.2, `configuration-and-tuning.txt`).
//!
//! Counters are registered without the `_total` suffix; the OpenMetrics encoder appends it.
//! `service` is the rule's stable id; `ep_idx` / `ep` the endpoint index in the rule (for a DP
//! rank r > 0 the subscriber label `ep` is `<idx>.r<r>`). `loxilb_pd_ep_info{service,ep_idx,ep}`
//! (control plane, `crate::metrics`) joins `ep_idx` to the endpoint's address.

use std::sync::OnceLock;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::cross::OUTCOME_LABELS;
use super::route::miss::MissReason;

/// `{service, ep_idx}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EpIdxLabels {
    /// Rule id.
    pub service: String,
    /// Endpoint index.
    pub ep_idx: String,
}

/// `{service, ep}` (subscriber stream).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EpLabels {
    /// Rule id.
    pub service: String,
    /// Endpoint index, `<idx>.r<rank>` for DP ranks above 0.
    pub ep: String,
}

/// Every endpoint readiness state (`kv::readiness`), the `state` label values of
/// `loxilb_kv_endpoint_readiness`.
pub const READINESS_STATES: &[&str] = &[
    "syncing",
    "no_events",
    "no_blocks",
    "events_no_tokens",
    "ok",
    "mismatch",
    "disconnected",
    "never_matched",
    "crossed",
    "unseen",
    "not_subscribed",
];

/// `{service, ep_idx, state}` (endpoint readiness).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EpStateLabels {
    /// Rule id.
    pub service: String,
    /// Endpoint index.
    pub ep_idx: String,
    /// A readiness state ([`READINESS_STATES`]).
    pub state: String,
}

/// `{service, reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Rule id.
    pub service: String,
    /// A [`MissReason`] label.
    pub reason: String,
}

/// `{service}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    /// Rule id.
    pub service: String,
}

/// `{service, ep_idx, outcome}` for `loxilb_kv_cross_probes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EpOutcomeLabels {
    /// Rule id.
    pub service: String,
    /// Endpoint index.
    pub ep_idx: String,
    /// `landed`, `strayed` or `unseen`.
    pub outcome: String,
}

/// `{service, ep, reason}` for rejected events and replay outcomes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EpReasonLabels {
    /// Rule id.
    pub service: String,
    /// Endpoint stream.
    pub ep: String,
    /// Why (`malformed`, `block_size`, `ok`, `failed`...).
    pub reason: String,
}

/// Routing latency stage.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum Stage {
    /// Prompt → token ids (template + tokenizer).
    Tokenize,
    /// Token ids → block keys.
    Hash,
    /// Index lookup + guard ladder + blend law.
    Score,
}

/// `{stage}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// Which stage.
    pub stage: Stage,
}

/// Handles to every KV family. Cheap to clone.
#[derive(Clone)]
pub struct KvMetrics {
    /// `loxilb_pd_kv_tier15_hits_total{service,ep_idx}`.
    pub hits: Family<EpIdxLabels, Counter>,
    /// `loxilb_pd_kv_tier15_miss_reason_total{service,reason}`.
    pub misses: Family<ReasonLabels, Counter>,
    /// `loxilb_pd_kv_tier15_fallthrough_total{service}`.
    pub fallthrough: Family<ServiceLabels, Counter>,
    /// `loxilb_pd_kv_tier15_bypass_total{service,reason}` (loxi extension): requests of a
    /// tier-1.5 rule routed by the rule's `sel` without entering the tier, neither hits nor
    /// misses nor fallthroughs; `reason` is one of [`BYPASS_REASONS`].
    pub bypasses: Family<ReasonLabels, Counter>,
    /// `loxilb_pd_kv_tier15_media_prefix_total{service}` (loxi extension): chat requests with a
    /// media part (image, audio, video, file) whose text before the first such part was scored;
    /// the blocks from the part on were not (see `crate::request::MEDIA_MARKER`).
    pub media_prefix: Family<ServiceLabels, Counter>,
    /// `loxilb_pd_kv_tier15_spills_total{service,ep_idx}` (`ep_idx`: the endpoint the
    /// request spilled to, as LoxiLB labels it).
    pub spills: Family<EpIdxLabels, Counter>,
    /// `loxilb_pd_kv_tier15_cold_seeds_total{service,ep_idx}` (`ep_idx`: the endpoint that
    /// received the seed).
    pub cold_seeds: Family<EpIdxLabels, Counter>,
    /// `loxilb_pd_kv_tier15_cold_placements_total{service,ep_idx}` (loxi extension): requests
    /// no endpoint held a first block of, placed by the tier on the endpoint with the least
    /// prefill wait (`LOXI_KV_COLD_PLACEMENT=least-work`) instead of falling through to `sel`.
    pub cold_placements: Family<EpIdxLabels, Counter>,
    /// `loxilb_pd_kv_blocks{service,ep_idx}`.
    pub blocks: Family<EpIdxLabels, Gauge>,
    /// `loxilb_kv_subscriber_connected{service,ep}`.
    pub connected: Family<EpLabels, Gauge>,
    /// `loxilb_kv_subscriber_reconnect_total{service,ep}`.
    pub reconnects: Family<EpLabels, Counter>,
    /// `loxilb_kv_subscriber_recv_error_total{service,ep}`.
    pub recv_errors: Family<EpLabels, Counter>,
    /// `loxilb_kv_events_applied_total{service,ep}`.
    pub events_applied: Family<EpLabels, Counter>,
    /// `loxilb_kv_events_rejected_total{service,ep,reason}` (loxi extension).
    pub events_rejected: Family<EpReasonLabels, Counter>,
    /// `loxilb_kv_replay_total{service,ep,reason}` (loxi extension; reason = outcome).
    pub replays: Family<EpReasonLabels, Counter>,
    /// `loxilb_kv_inv_cap_evictions_total{service,ep}` (LoxiLB's labels; `ep` as the
    /// subscriber families spell it).
    pub cap_evictions: Family<EpLabels, Counter>,
    /// `loxilb_kv_parity_ok{service,ep}`: 1 agree, 0 mismatch (token re-hash active).
    pub parity_ok: Family<EpLabels, Gauge>,
    /// `loxilb_kv_routing_stage_seconds{stage}`.
    pub stage_seconds: Family<StageLabels, Histogram>,
    /// `loxilb_kv_endpoint_readiness{service,ep_idx,state}` (loxi extension): 1 for the
    /// endpoint's current readiness state, 0 for the others (`kv::readiness`).
    pub readiness: Family<EpStateLabels, Gauge>,
    /// `loxilb_kv_cross_probes_total{service,ep_idx,outcome}` (loxi extension): probes of the
    /// crossed-stream check (`kv::cross`) resolved for new prompts placed on the endpoint
    /// alone, by outcome (`landed`, `strayed`, `unseen`; `kv::cross::OUTCOME_LABELS`).
    pub cross_probes: Family<EpOutcomeLabels, Counter>,
    /// `loxilb_pd_kv_zero_hit_watchdog_total{service}`: endpoints the zero-hit watchdog
    /// flagged (`never_matched`: blocks held, `LOXI_KV_NEVER_MATCHED_AFTER` requests routed to
    /// it, none of its blocks ever matched a request).
    pub zero_hit_watchdog: Family<ServiceLabels, Counter>,
}

impl KvMetrics {
    /// Registers every family in `reg`.
    pub fn register(reg: &mut Registry) -> Self {
        let m = Self {
            hits: Family::default(),
            misses: Family::default(),
            fallthrough: Family::default(),
            bypasses: Family::default(),
            media_prefix: Family::default(),
            spills: Family::default(),
            cold_seeds: Family::default(),
            cold_placements: Family::default(),
            blocks: Family::default(),
            connected: Family::default(),
            reconnects: Family::default(),
            recv_errors: Family::default(),
            events_applied: Family::default(),
            events_rejected: Family::default(),
            replays: Family::default(),
            cap_evictions: Family::default(),
            parity_ok: Family::default(),
            readiness: Family::default(),
            zero_hit_watchdog: Family::default(),
            cross_probes: Family::default(),
            stage_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(1e-6, 2.0, 22))
            }),
        };
        let r = reg;
        r.register(
            "loxilb_pd_kv_tier15_hits",
            "Tier 1.5 selected this endpoint",
            m.hits.clone(),
        );
        r.register(
            "loxilb_pd_kv_tier15_miss_reason",
            "Tier 1.5 guard misses by reason",
            m.misses.clone(),
        );
        r.register(
            "loxilb_pd_kv_tier15_fallthrough",
            "Requests that left tier 1.5",
            m.fallthrough.clone(),
        );
        r.register(
            "loxilb_pd_kv_tier15_bypass",
            "Requests routed by the rule's sel without entering tier 1.5 (not generation)",
            m.bypasses.clone(),
        );
        r.register(
            "loxilb_pd_kv_tier15_media_prefix",
            "Chat requests with a media part scored on the text before it only",
            m.media_prefix.clone(),
        );
        r.register(
            "loxilb_pd_kv_tier15_spills",
            "Overlap owner over cap, spilled",
            m.spills.clone(),
        );
        r.register(
            "loxilb_pd_kv_tier15_cold_seeds",
            "Requests sent to a cold endpoint to seed it with a held prefix (cold-start and replica seeding)",
            m.cold_seeds.clone(),
        );
        r.register(
            "loxilb_pd_kv_tier15_cold_placements",
            "Requests no endpoint held a prefix of, placed by least prefill wait",
            m.cold_placements.clone(),
        );
        r.register(
            "loxilb_pd_kv_blocks",
            "Indexed blocks per endpoint",
            m.blocks.clone(),
        );
        r.register(
            "loxilb_kv_subscriber_connected",
            "KV-event socket up (1) or down (0)",
            m.connected.clone(),
        );
        r.register(
            "loxilb_kv_subscriber_reconnect",
            "KV-event socket rebuilds",
            m.reconnects.clone(),
        );
        r.register(
            "loxilb_kv_subscriber_recv_error",
            "KV-event receive errors",
            m.recv_errors.clone(),
        );
        r.register(
            "loxilb_kv_events_applied",
            "KV events applied to the index",
            m.events_applied.clone(),
        );
        r.register(
            "loxilb_kv_events_rejected",
            "KV events rejected, by reason",
            m.events_rejected.clone(),
        );
        r.register(
            "loxilb_kv_replay",
            "Replay attempts by outcome",
            m.replays.clone(),
        );
        r.register(
            "loxilb_kv_inv_cap_evictions",
            "Blocks evicted by LOXILB_KV_MAX_BLOCKS",
            m.cap_evictions.clone(),
        );
        r.register(
            "loxilb_kv_parity_ok",
            "Engine hashes match loxi's recomputation",
            m.parity_ok.clone(),
        );
        r.register(
            "loxilb_kv_endpoint_readiness",
            "Endpoint readiness state (1 = current): syncing, no_events, no_blocks, events_no_tokens, ok, mismatch, disconnected, never_matched, crossed, unseen, not_subscribed",
            m.readiness.clone(),
        );
        r.register(
            "loxilb_pd_kv_zero_hit_watchdog",
            "Endpoints flagged by the zero-hit watchdog (blocks held, requests routed, no block ever matched)",
            m.zero_hit_watchdog.clone(),
        );
        r.register(
            "loxilb_kv_cross_probes",
            "Crossed-stream check: new prompts placed on this endpoint alone whose first block was published on its own stream (landed), on another endpoint's only (strayed) or on none within 30 s (unseen)",
            m.cross_probes.clone(),
        );
        r.register(
            "loxilb_kv_routing_stage_seconds",
            "Tier 1.5 latency by stage",
            m.stage_seconds.clone(),
        );
        m
    }

    /// Creates every per-service series at zero (all miss and bypass reasons, fallthrough, and per
    /// endpoint spills, cold seeds and cap evictions), so dashboards see them before the first
    /// event.
    pub fn init_service(&self, service: &str, endpoints: usize) {
        for r in MissReason::ALL {
            let _ = self.misses.get_or_create(&ReasonLabels {
                service: service.into(),
                reason: r.as_str().into(),
            });
        }
        for r in BYPASS_REASONS {
            let _ = self.bypasses.get_or_create(&reason(service, r));
        }
        let s = ServiceLabels {
            service: service.into(),
        };
        let _ = self.fallthrough.get_or_create(&s);
        let _ = self.media_prefix.get_or_create(&s);
        for ep in 0..endpoints {
            self.init_ep(service, ep);
        }
    }

    /// Pre-creates the per-position series of position `ep` that start at 0 (spills, cold
    /// seeds, cap evictions, and the indexed blocks), so that dashboards and alerts see them
    /// before the first event: the spec's "subscriber connected but `loxilb_pd_kv_blocks` = 0
    /// ⇒ the engine is not publishing" alert needs the 0.
    pub fn init_ep(&self, service: &str, ep: usize) {
        let l = ep_idx(service, ep);
        let _ = self.blocks.get_or_create(&l);
        let _ = self.spills.get_or_create(&l);
        let _ = self.cold_seeds.get_or_create(&l);
        let _ = self.cold_placements.get_or_create(&l);
        for o in OUTCOME_LABELS {
            let _ = self.cross_probes.get_or_create(&cross_labels(&l, o));
        }
        let _ = self.cap_evictions.get_or_create(&EpLabels {
            service: service.into(),
            ep: ep_label(ep, 0),
        });
    }

    /// Counts one miss of `reason` and the fallthrough it causes.
    pub fn miss(&self, service: &str, reason: MissReason) {
        self.misses
            .get_or_create(&ReasonLabels {
                service: service.into(),
                reason: reason.as_str().into(),
            })
            .inc();
        self.fallthrough
            .get_or_create(&ServiceLabels {
                service: service.into(),
            })
            .inc();
    }

    /// Counts one hit on `ep`.
    pub fn hit(&self, service: &str, ep: usize) {
        self.hits
            .get_or_create(&EpIdxLabels {
                service: service.into(),
                ep_idx: ep.to_string(),
            })
            .inc();
    }

    /// Sets the block gauge of `ep`.
    pub fn set_blocks(&self, service: &str, ep: usize, n: u64) {
        let g = self.blocks.get_or_create(&EpIdxLabels {
            service: service.into(),
            ep_idx: ep.to_string(),
        });
        g.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Adds `counts` (by [`OUTCOME_LABELS`] position) to position `ep`'s
    /// `loxilb_kv_cross_probes_total`.
    pub fn cross_probes(&self, service: &str, ep: usize, counts: [u64; 3]) {
        let l = ep_idx(service, ep);
        for (o, n) in OUTCOME_LABELS.iter().zip(counts) {
            if n > 0 {
                self.cross_probes
                    .get_or_create(&cross_labels(&l, o))
                    .inc_by(n);
            }
        }
    }

    /// Removes every series of position `ep` of `service` (its endpoint left, or another one
    /// sits there now): hits, blocks, spills, cold seeds, and every subscriber series of its
    /// `ranks` ranks.
    pub fn forget_ep(&self, service: &str, ep: usize, ranks: u32) {
        let l = ep_idx(service, ep);
        self.hits.remove(&l);
        self.blocks.remove(&l);
        self.spills.remove(&l);
        self.cold_seeds.remove(&l);
        self.cold_placements.remove(&l);
        for o in OUTCOME_LABELS {
            self.cross_probes.remove(&cross_labels(&l, o));
        }
        for state in READINESS_STATES {
            self.readiness.remove(&EpStateLabels {
                service: l.service.clone(),
                ep_idx: l.ep_idx.clone(),
                state: (*state).into(),
            });
        }
        for r in 0..ranks.max(1) {
            let e = EpLabels {
                service: service.into(),
                ep: ep_label(ep, r),
            };
            self.connected.remove(&e);
            self.parity_ok.remove(&e);
            self.reconnects.remove(&e);
            self.recv_errors.remove(&e);
            self.events_applied.remove(&e);
            self.cap_evictions.remove(&e);
            for reason in REJECT_REASONS {
                self.events_rejected.remove(&EpReasonLabels {
                    service: service.into(),
                    ep: e.ep.clone(),
                    reason: (*reason).into(),
                });
            }
            for outcome in REPLAY_OUTCOMES {
                self.replays.remove(&EpReasonLabels {
                    service: service.into(),
                    ep: e.ep.clone(),
                    reason: (*outcome).into(),
                });
            }
        }
    }

    /// Removes every series of one service (rule deleted): the per-position ones of its
    /// `endpoints` endpoints and the per-service ones.
    pub fn forget_service(&self, service: &str, endpoints: usize, ranks: u32) {
        for ep in 0..endpoints {
            self.forget_ep(service, ep, ranks);
        }
        self.zero_hit_watchdog.remove(&ServiceLabels {
            service: service.into(),
        });
        for r in MissReason::ALL {
            self.misses.remove(&ReasonLabels {
                service: service.into(),
                reason: r.as_str().into(),
            });
        }
        for r in BYPASS_REASONS {
            self.bypasses.remove(&reason(service, r));
        }
        let s = ServiceLabels {
            service: service.into(),
        };
        self.fallthrough.remove(&s);
        self.media_prefix.remove(&s);
    }
}

/// Every `reason` of `loxilb_pd_kv_tier15_bypass_total` (non_generation: not a completions,
/// chat completions or responses request, e.g. `/v1/embeddings`, `/tokenize`, `/health`).
pub const BYPASS_REASONS: &[&str] = &["non_generation"];

fn reason(service: &str, reason: &str) -> ReasonLabels {
    ReasonLabels {
        service: service.into(),
        reason: reason.into(),
    }
}

/// Every `reason` of `loxilb_kv_events_rejected_total` (frame: a multipart message without the
/// 3 frames; frame_size: a frame or message over
/// [`crate::kv::ingest::guard::MAX_MESSAGE_BYTES`] or
/// [`crate::kv::ingest::guard::MAX_MESSAGE_FRAMES`], its connection closed; batch: an undecodable payload; malformed: one undecodable event; block_size: a
/// `BlockStored` with another block size; group_idx: a `BlockStored` naming a KV cache group
/// past [`crate::kv::ingest::apply::MAX_GROUPS_PER_ENDPOINT`] distinct ones).
pub const REJECT_REASONS: &[&str] = &[
    "frame",
    "frame_size",
    "batch",
    "malformed",
    "block_size",
    "group_idx",
];

/// Every `reason` (outcome) of `loxilb_kv_replay_total`.
pub const REPLAY_OUTCOMES: &[&str] = &["ok", "failed"];

/// Counters of one `{service, ep_idx}` family by endpoint position, resolved once per position
/// (a hit is one read lock and one atomic add); a position whose endpoint changed is reset by
/// [`PosCounters::forget`] after its series was removed.
struct PosCounters {
    family: Family<EpIdxLabels, Counter>,
    service: String,
    cells: parking_lot::RwLock<Vec<Option<Counter>>>,
}

impl PosCounters {
    /// Counters of `family` for `service`; the first `eager` positions are created now (their
    /// series appear at 0).
    fn new(family: &Family<EpIdxLabels, Counter>, service: &str, eager: usize) -> Self {
        let c = Self {
            family: family.clone(),
            service: service.into(),
            cells: parking_lot::RwLock::new(Vec::new()),
        };
        for ep in 0..eager {
            c.inc_by(ep, 0);
        }
        c
    }

    fn inc_by(&self, ep: usize, n: u64) {
        if let Some(Some(c)) = self.cells.read().get(ep) {
            c.inc_by(n);
            return;
        }
        let mut cells = self.cells.write();
        if cells.len() <= ep {
            cells.resize(ep + 1, None);
        }
        cells[ep]
            .get_or_insert_with(|| {
                self.family
                    .get_or_create(&ep_idx(&self.service, ep))
                    .clone()
            })
            .inc_by(n);
    }

    fn forget(&self, ep: usize) {
        if let Some(c) = self.cells.write().get_mut(ep) {
            *c = None;
        }
    }
}

/// The request-path series of one service, resolved once when its KV state is created (like
/// the proxy's pool metrics), so that a hit or a miss is one atomic add with no label built.
/// Hit and stage series appear on first use (as before), then stay resolved.
pub struct RouteMetrics {
    family: KvMetrics,
    /// `loxilb_pd_kv_tier15_hits_total{service,ep_idx}` (series appear on first hit).
    hits: PosCounters,
    misses: Vec<Counter>,
    fallthrough: Counter,
    /// `loxilb_pd_kv_tier15_bypass_total{service,reason="non_generation"}`.
    non_generation: Counter,
    /// `loxilb_pd_kv_tier15_media_prefix_total{service}`.
    media_prefix: Counter,
    /// `loxilb_pd_kv_tier15_spills_total{service,ep_idx}`, pre-created at 0.
    spills: PosCounters,
    /// `loxilb_pd_kv_tier15_cold_seeds_total{service,ep_idx}`, pre-created at 0.
    cold_seeds: PosCounters,
    /// `loxilb_pd_kv_tier15_cold_placements_total{service,ep_idx}`, pre-created at 0.
    cold_placements: PosCounters,
    stages: [OnceLock<Histogram>; 3],
}

impl RouteMetrics {
    /// Counts one spill to the endpoint at position `ep`.
    pub fn spill(&self, ep: usize) {
        self.spills.inc_by(ep, 1);
    }

    /// Counts one cold-start seed to the endpoint at position `ep`.
    pub fn cold_seed(&self, ep: usize) {
        self.cold_seeds.inc_by(ep, 1);
    }

    /// Counts one cold placement on the endpoint at position `ep`.
    pub fn cold_placement(&self, ep: usize) {
        self.cold_placements.inc_by(ep, 1);
    }

    /// Counts one hit on the endpoint at position `ep`.
    pub fn hit(&self, ep: usize) {
        self.hits.inc_by(ep, 1);
    }

    /// Drops the cached counters of position `ep` after [`KvMetrics::forget_ep`] removed its
    /// series; when an endpoint still sits there (`present`), its zero series are created again.
    pub fn forget_ep(&self, ep: usize, present: bool) {
        self.hits.forget(ep);
        self.spills.forget(ep);
        self.cold_seeds.forget(ep);
        self.cold_placements.forget(ep);
        if present {
            self.spills.inc_by(ep, 0);
            self.cold_seeds.inc_by(ep, 0);
            self.cold_placements.inc_by(ep, 0);
        }
    }

    /// Counts one miss of `reason` and the fallthrough it causes.
    pub fn miss(&self, reason: MissReason) {
        self.misses[reason as usize].inc();
        self.fallthrough.inc();
    }

    /// Counts one chat scored on the text before its first media part.
    pub fn media_prefix(&self) {
        self.media_prefix.inc();
    }

    /// Counts one request routed without entering the tier because it is not a generation.
    pub fn non_generation(&self) {
        self.non_generation.inc();
    }

    /// Observes one stage's latency in seconds.
    pub fn stage(&self, stage: Stage, seconds: f64) {
        let i = match stage {
            Stage::Tokenize => 0,
            Stage::Hash => 1,
            Stage::Score => 2,
        };
        self.stages[i]
            .get_or_init(|| {
                let labels = StageLabels { stage };
                self.family.stage_seconds.get_or_create(&labels).clone()
            })
            .observe(seconds);
    }
}

impl KvMetrics {
    /// The request-path handles of `service` with `endpoints` endpoints.
    pub fn route(&self, service: &str, endpoints: usize) -> RouteMetrics {
        let s = ServiceLabels {
            service: service.into(),
        };
        RouteMetrics {
            family: self.clone(),
            hits: PosCounters::new(&self.hits, service, 0),
            misses: MissReason::ALL
                .iter()
                .map(|r| {
                    let labels = ReasonLabels {
                        service: service.into(),
                        reason: r.as_str().into(),
                    };
                    self.misses.get_or_create(&labels).clone()
                })
                .collect(),
            fallthrough: self.fallthrough.get_or_create(&s).clone(),
            non_generation: self
                .bypasses
                .get_or_create(&reason(service, "non_generation"))
                .clone(),
            media_prefix: self.media_prefix.get_or_create(&s).clone(),
            spills: PosCounters::new(&self.spills, service, endpoints),
            cold_seeds: PosCounters::new(&self.cold_seeds, service, endpoints),
            cold_placements: PosCounters::new(&self.cold_placements, service, endpoints),
            stages: Default::default(),
        }
    }
}

fn ep_idx(service: &str, ep: usize) -> EpIdxLabels {
    EpIdxLabels {
        service: service.into(),
        ep_idx: ep.to_string(),
    }
}

fn cross_labels(l: &EpIdxLabels, outcome: &str) -> EpOutcomeLabels {
    EpOutcomeLabels {
        service: l.service.clone(),
        ep_idx: l.ep_idx.clone(),
        outcome: outcome.into(),
    }
}

/// The `ep` label of a subscriber stream.
pub fn ep_label(ep: usize, rank: u32) -> String {
    if rank == 0 {
        ep.to_string()
    } else {
        format!("{ep}.r{rank}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn every_miss_reason_is_precreated_per_service_with_spec_names() {
        let mut reg = Registry::default();
        let m = KvMetrics::register(&mut reg);
        m.init_service("7", 2);
        m.hit("7", 1);
        m.miss("7", MissReason::NoWorker);
        let mut out = String::new();
        encode(&mut out, &reg).expect("encode");
        for r in MissReason::ALL {
            let line = format!(
                "loxilb_pd_kv_tier15_miss_reason_total{{service=\"7\",reason=\"{}\"}}",
                r.as_str()
            );
            assert!(out.contains(&line), "missing {line}");
        }
        assert!(out.contains("loxilb_pd_kv_tier15_hits_total{service=\"7\",ep_idx=\"1\"} 1"));
        assert!(out.contains(
            "loxilb_pd_kv_tier15_miss_reason_total{service=\"7\",reason=\"no_worker\"} 1"
        ));
        assert!(out.contains("loxilb_pd_kv_tier15_fallthrough_total{service=\"7\"} 1"));
        assert!(out.contains("loxilb_pd_kv_tier15_spills_total{service=\"7\",ep_idx=\"1\"} 0"));
        // Every position's indexed blocks from the start, 0 before any event: the spec's
        // "connected but not publishing" alert compares it with 0.
        for ep in 0..2 {
            let line = format!("loxilb_pd_kv_blocks{{service=\"7\",ep_idx=\"{ep}\"}} 0");
            assert!(out.contains(&line), "missing {line}");
        }
        assert!(out.contains("loxilb_pd_kv_tier15_cold_seeds_total{service=\"7\",ep_idx=\"0\"} 0"));
        assert!(out.contains("loxilb_kv_inv_cap_evictions_total{service=\"7\",ep=\"1\"} 0"));
    }

    #[test]
    fn a_bypass_is_counted_apart_from_misses_and_fallthrough() {
        let mut reg = Registry::default();
        let m = KvMetrics::register(&mut reg);
        m.init_service("7", 1);
        let text = |reg: &Registry| {
            let mut out = String::new();
            encode(&mut out, reg).expect("encode");
            out
        };
        let bypass = "loxilb_pd_kv_tier15_bypass_total{service=\"7\",reason=\"non_generation\"}";
        assert!(text(&reg).contains(&format!("{bypass} 0")), "pre-created");
        m.route("7", 1).non_generation();
        let out = text(&reg);
        assert!(out.contains(&format!("{bypass} 1")), "{out}");
        assert!(out.contains("loxilb_pd_kv_tier15_fallthrough_total{service=\"7\"} 0"));
        for r in MissReason::ALL {
            let line = format!(
                "loxilb_pd_kv_tier15_miss_reason_total{{service=\"7\",reason=\"{}\"}} 0",
                r.as_str()
            );
            assert!(out.contains(&line), "{line}: {out}");
        }
    }

    #[test]
    fn forget_service_leaves_no_series_of_the_service() {
        let mut reg = Registry::default();
        let m = KvMetrics::register(&mut reg);
        for svc in ["7", "8"] {
            m.init_service(svc, 2);
            m.hit(svc, 1);
            m.set_blocks(svc, 1, 3);
            let e = EpLabels {
                service: svc.into(),
                ep: ep_label(1, 1),
            };
            m.connected.get_or_create(&e).set(1);
            m.events_applied.get_or_create(&e).inc();
            for r in REJECT_REASONS {
                m.events_rejected
                    .get_or_create(&EpReasonLabels {
                        service: svc.into(),
                        ep: e.ep.clone(),
                        reason: (*r).into(),
                    })
                    .inc();
            }
        }
        m.forget_service("7", 2, 2);
        let mut out = String::new();
        encode(&mut out, &reg).expect("encode");
        let of = |svc: &str| {
            out.lines()
                .filter(|l| l.contains(&format!("service=\"{svc}\"")))
                .count()
        };
        assert_eq!(of("7"), 0, "{out}");
        assert!(of("8") >= 6 + MissReason::ALL.len(), "{out}");
    }

    #[test]
    fn exposition_passes_promtool_check_metrics() {
        let mut reg = Registry::default();
        let m = KvMetrics::register(&mut reg);
        m.init_service("1", 1);
        m.hit("1", 0);
        m.set_blocks("1", 0, 42);
        m.connected
            .get_or_create(&EpLabels {
                service: "1".into(),
                ep: ep_label(0, 1),
            })
            .set(1);
        m.stage_seconds
            .get_or_create(&StageLabels {
                stage: Stage::Score,
            })
            .observe(2e-5);
        let out = crate::metrics::encode_text(&reg).expect("encode as the daemon serves it");
        crate::metrics::promtool_check(&out);
    }
}
