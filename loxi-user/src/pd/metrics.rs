//! P/D metrics. The spec's names (`configuration-and-tuning.txt`, "P/D serving"), each with the
//! `service` label loxi puts on every per-rule family:
//!
//! | name | type | labels |
//! |---|---|---|
//! | `loxilb_ai_pd_requests_total` | counter | `service` (two-leg requests started) |
//! | `loxilb_ai_pd_session_hits_total` | counter | `service` (tier 0 chose the prefill endpoint) |
//! | `loxilb_ai_pd_prefill_duration_seconds` | histogram | `service` (prefill leg: sent → body read) |
//! | `loxilb_ai_pd_decode_ttft_seconds` | histogram | `service` (client request → the decode's first body byte) |
//! | `loxilb_ai_pd_tier_selected_total` | counter | `service`, `leg` (`prefill`, `decode`), `tier` ([`PdTier::as_str`]); each leg that answered (a prefill run again after a decode refused counts again; a failed leg does not) |
//! | `loxilb_ai_pd_kv_params_missing_total` | counter | `service` (prefill answered 2xx without `kv_transfer_params`, or a TensorRT-LLM context without `disaggregated_params`) |
//! | `loxilb_ai_pd_tier1_hits_total` | counter | `service` (tier 1, the prefix trie, chose the prefill endpoint) |
//! | `loxilb_ai_pd_tier1_misses_total` | counter | `service` (tier 1 asked; no eligible prefill endpoint held `pd_cache_threshold` % of the prompt) |
//! | `loxilb_ai_pd_tier1_bypass_total` | counter | `service` (tier 1 skipped: prefill loads differ by more than `pd_balance_abs_threshold`) |
//! | `loxilb_ai_pd_failures_total` | counter | `service`, `reason` (`pd_pool_unavailable`, `pd_prefill_timeout`, `pd_prefill_failed`, `pd_prefill_status`, `pd_decode_backend_died`, `pd_decode_timeout`) |
//!
//! The three tier-1 counters count prefill decisions of rules with `pd_cache_aware_mode` that
//! reached tier 1 (no usable pin; a connect-failure retry is one more decision); a hit is also
//! `loxilb_ai_pd_tier_selected_total{leg="prefill",tier="1"}` once its prefill leg answered.
//!
//! Tier 1.5 (`kvExactMode: 1`) counts its hits and misses in the KV tier's own families
//! (`loxilb_pd_kv_tier15_*`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::ladder::{PdTier, TrieOutcome};

/// `service`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PdServiceLabels {
    /// Service id.
    pub service: String,
}

/// `service`, `leg`, `tier`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TierLabels {
    /// Service id.
    pub service: String,
    /// `prefill` or `decode`.
    pub leg: String,
    /// [`PdTier::as_str`].
    pub tier: String,
}

/// `service`, `reason`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// Service id.
    pub service: String,
    /// The error token.
    pub reason: String,
}

type Hist = Family<PdServiceLabels, Histogram, fn() -> Histogram>;

fn seconds() -> Histogram {
    // 1 ms … ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The P/D metric handles. Cheap to clone.
#[derive(Debug, Clone)]
pub struct PdMetrics {
    /// Two-leg requests started.
    pub requests: Family<PdServiceLabels, Counter>,
    /// Tier-0 hits.
    pub session_hits: Family<PdServiceLabels, Counter>,
    /// Prefill leg duration.
    pub prefill_duration: Hist,
    /// Time to the decode's first body byte.
    pub decode_ttft: Hist,
    /// Tier decisions by leg.
    pub tier_selected: Family<TierLabels, Counter>,
    /// Prefill responses without transfer parameters.
    pub params_missing: Family<PdServiceLabels, Counter>,
    /// Tier-1 hits.
    pub tier1_hits: Family<PdServiceLabels, Counter>,
    /// Tier-1 misses (below `pd_cache_threshold`).
    pub tier1_misses: Family<PdServiceLabels, Counter>,
    /// Tier-1 bypasses (load imbalance over `pd_balance_abs_threshold`).
    pub tier1_bypass: Family<PdServiceLabels, Counter>,
    /// P/D failures by reason.
    pub failures: Family<FailureLabels, Counter>,
    /// The failure reasons counted so far (any service), so a deleted service's failure
    /// series can be removed without a scan of the family.
    failure_reasons: std::sync::Arc<parking_lot::Mutex<Vec<&'static str>>>,
}

impl PdMetrics {
    /// Handles not attached to a registry.
    pub fn unregistered() -> Self {
        Self {
            requests: Family::default(),
            session_hits: Family::default(),
            prefill_duration: Family::new_with_constructor(seconds),
            decode_ttft: Family::new_with_constructor(seconds),
            tier_selected: Family::default(),
            params_missing: Family::default(),
            tier1_hits: Family::default(),
            tier1_misses: Family::default(),
            tier1_bypass: Family::default(),
            failures: Family::default(),
            failure_reasons: Default::default(),
        }
    }

    /// Registers the families in `reg`.
    pub fn register(reg: &mut Registry) -> Self {
        let m = Self::unregistered();
        reg.register(
            "loxilb_ai_pd_requests",
            "P/D two-leg requests started",
            m.requests.clone(),
        );
        reg.register(
            "loxilb_ai_pd_session_hits",
            "P/D requests whose prefill endpoint came from the tier-0 session pin",
            m.session_hits.clone(),
        );
        reg.register(
            "loxilb_ai_pd_prefill_duration_seconds",
            "P/D prefill leg duration, request sent to response body read",
            m.prefill_duration.clone(),
        );
        reg.register(
            "loxilb_ai_pd_decode_ttft_seconds",
            "P/D time from the client's request to the decode leg's first body byte",
            m.decode_ttft.clone(),
        );
        reg.register(
            "loxilb_ai_pd_tier_selected",
            "P/D endpoint choices by leg and tier (0 pin, 1 prefix trie, 1.5 KV overlap, 2 min load, aggregated), counted for each leg that answered: a prefill run again after a decode refused the connection counts again, a leg that failed does not count",
            m.tier_selected.clone(),
        );
        reg.register(
            "loxilb_ai_pd_kv_params_missing",
            "Prefill (context) responses without transfer parameters (vLLM kv_transfer_params, TensorRT-LLM disaggregated_params; the decode leg ran without them)",
            m.params_missing.clone(),
        );
        reg.register(
            "loxilb_ai_pd_tier1_hits",
            "P/D prefill decisions where tier 1 (the prefix trie) chose the prefill endpoint",
            m.tier1_hits.clone(),
        );
        reg.register(
            "loxilb_ai_pd_tier1_misses",
            "P/D prefill decisions where tier 1 found no prefill endpoint holding pd_cache_threshold % of the prompt",
            m.tier1_misses.clone(),
        );
        reg.register(
            "loxilb_ai_pd_tier1_bypass",
            "P/D prefill decisions that skipped tier 1: prefill loads differed by more than pd_balance_abs_threshold",
            m.tier1_bypass.clone(),
        );
        reg.register(
            "loxilb_ai_pd_failures",
            "P/D requests answered with an error, by reason token",
            m.failures.clone(),
        );
        m
    }

    /// Creates the series of service `id` at 0, so dashboards see them before traffic.
    pub fn init_service(&self, id: u32) {
        let s = svc(id);
        let _ = self.requests.get_or_create(&s);
        let _ = self.session_hits.get_or_create(&s);
        let _ = self.params_missing.get_or_create(&s);
        for f in self.tier1_families() {
            let _ = f.get_or_create(&s);
        }
        for leg in ["prefill", "decode"] {
            for t in PdTier::ALL {
                let _ = self.tier(id, leg, t);
            }
        }
    }

    /// The tier counter of (`service`, `leg`, `tier`).
    pub fn tier(&self, service: u32, leg: &str, tier: PdTier) -> Counter {
        self.tier_selected
            .get_or_create(&TierLabels {
                service: service.to_string(),
                leg: leg.to_string(),
                tier: tier.as_str().to_string(),
            })
            .clone()
    }

    /// Counts tier 1's `outcome` for one prefill decision of `service` (nothing for
    /// [`TrieOutcome::NotAsked`]).
    pub fn trie_outcome(&self, service: u32, outcome: TrieOutcome) {
        let f = match outcome {
            TrieOutcome::NotAsked => return,
            TrieOutcome::Hit => &self.tier1_hits,
            TrieOutcome::Miss => &self.tier1_misses,
            TrieOutcome::Bypass => &self.tier1_bypass,
        };
        f.get_or_create(&svc(service)).inc();
    }

    fn tier1_families(&self) -> [&Family<PdServiceLabels, Counter>; 3] {
        [&self.tier1_hits, &self.tier1_misses, &self.tier1_bypass]
    }

    /// Counts one failure of `service` with `reason`.
    pub fn failure(&self, service: u32, reason: &'static str) {
        {
            let mut seen = self.failure_reasons.lock();
            if !seen.contains(&reason) {
                seen.push(reason);
            }
        }
        self.failures
            .get_or_create(&FailureLabels {
                service: service.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }
}

impl PdMetrics {
    /// Removes every `loxilb_ai_pd_*` series of service `id` (its rule was deleted or no
    /// longer disaggregates), so a deleted rule leaves nothing in the scrape.
    pub fn forget_service(&self, id: u32) {
        let s = svc(id);
        self.requests.remove(&s);
        self.session_hits.remove(&s);
        self.params_missing.remove(&s);
        for f in self.tier1_families() {
            f.remove(&s);
        }
        self.prefill_duration.remove(&s);
        self.decode_ttft.remove(&s);
        for leg in ["prefill", "decode"] {
            for t in PdTier::ALL {
                self.tier_selected.remove(&TierLabels {
                    service: s.service.clone(),
                    leg: leg.to_string(),
                    tier: t.as_str().to_string(),
                });
            }
        }
        for reason in self.failure_reasons.lock().iter() {
            self.failures.remove(&FailureLabels {
                service: s.service.clone(),
                reason: (*reason).to_string(),
            });
        }
    }
}

/// The `service` label set of `id`.
pub fn svc(id: u32) -> PdServiceLabels {
    PdServiceLabels {
        service: id.to_string(),
    }
}
