//! The selection ladder: which tiers a rule's request goes through, in order, and which one
//! decided. Today: tier 1.5 (KV overlap, for `kvExactMode` 3 when a tier runs, generation
//! requests only), then the rule's `sel`. A request that is not a generation
//! (`/v1/embeddings`, `/tokenize`, `/health`, ...) goes to the rule's `sel` without entering the
//! tier (the tier counts it as bypassed, not as a miss). A P/D rule (`pd_disagg_mode`) has its own ladder, `pd::ladder` (session pin, tier 1.5
//! over the prefill endpoints, min load), which reaches tier 1.5 through the same seam.
//!
//! The ladder takes the rule (its spec and raw selector knobs), the request, the candidates
//! and the selector state; it knows nothing of pools, listeners or HTTP. CPU-heavy tier work
//! (tokenizing a long prompt) happens in [`Ladder::prepare`], which the tier bounds in time and
//! runs off the runtime's threads (tier 1.5: its tokenization pool); [`Ladder::decide`] is
//! then cheap.

use super::tier::AffinityTier;
use super::{Candidates, Decision, EpIdx, SelectorState, dispatch};
use crate::request::RequestMeta;
use crate::rules::{KvMode, StoredRule};

/// A ladder decision and the step that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// The decision (endpoint and reason).
    pub decision: Decision,
    /// True when an affinity tier decided (false: the rule's `sel`).
    pub by_tier: bool,
}

/// The ladder of one rule: the rule, its selector state and the affinity tier, if one runs.
pub struct Ladder<'a, T: AffinityTier + ?Sized> {
    /// The rule (typed spec and raw selector knobs).
    pub rule: &'a StoredRule,
    /// The rule's selector state (cursor, WRR weights, rings).
    pub state: &'a SelectorState,
    /// The affinity tier (tier 1.5), when the daemon runs one.
    pub tier: Option<&'a T>,
}

impl<T: AffinityTier + ?Sized> Ladder<'_, T> {
    /// The tier this rule uses: tier 1.5 runs for `kvExactMode` 3 (the role-less pool;
    /// `kvExactMode` 1 belongs to the P/D ladder).
    fn rule_tier(&self) -> Option<&T> {
        self.tier
            .filter(|_| self.rule.spec.kv_mode() == KvMode::Pool)
    }

    /// The tier this request enters: the rule's tier, for generation requests only.
    pub fn tier(&self, meta: &RequestMeta) -> Option<&T> {
        self.rule_tier().filter(|_| meta.api.is_generation())
    }

    /// The tier's per-request preparation (tokenizing and hashing for tier 1.5, within its
    /// decision budget), once per request before the first [`Self::decide`]. A request the
    /// rule's tier does not take (not a generation) is reported to it as bypassed here.
    pub async fn prepare(&self, meta: &RequestMeta, ticket: &mut T::Ticket) {
        match (self.rule_tier(), self.tier(meta)) {
            (_, Some(tier)) => tier.prepare(self.rule, meta, ticket).await,
            (Some(tier), None) => tier.bypassed(self.rule, meta),
            (None, None) => {}
        }
    }

    /// Tier 1.5, then the rule's `sel` on a miss (or when tier 1.5 picked nothing).
    pub fn decide(
        &self,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        ticket: &mut T::Ticket,
    ) -> Step {
        if let Some(tier) = self.tier(meta)
            && let Some(d) = tier
                .select(self.rule, meta, cands, ticket)
                .filter(|d| d.endpoint.is_some())
        {
            return Step {
                decision: d,
                by_tier: true,
            };
        }
        Step {
            decision: dispatch::select(
                self.rule.spec.sel,
                &self.rule.rule.service,
                meta,
                cands,
                self.state,
            ),
            by_tier: false,
        }
    }

    /// Tells the tier (if this rule uses one) that the request goes to `ep`.
    pub fn routed(&self, meta: &RequestMeta, ep: EpIdx, ticket: &mut T::Ticket) {
        if let Some(tier) = self.tier(meta) {
            tier.routed(self.rule, meta, ep, ticket);
        }
    }
}

/// Runs CPU-heavy work with `block_in_place`, so the runtime hands this worker's other
/// connections to another thread instead of stalling them. On a current-thread runtime (some
/// tests) it just runs `f`. Unbounded: a tier's per-request work belongs in its `prepare`
/// (tier 1.5 runs it on a fixed pool with a bounded queue and a time budget) instead.
pub fn off_reactor<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::request::ApiKind;
    use crate::routing::test_util::Fixture;
    use crate::routing::{Candidates, Reason};

    /// Hits endpoint 1 on every request it is asked about; counts each call.
    #[derive(Default)]
    struct Tier {
        prepared: AtomicUsize,
        asked: AtomicUsize,
        routed: AtomicUsize,
        bypassed: AtomicUsize,
    }

    impl AffinityTier for Tier {
        type Ticket = ();

        fn prepare<'a>(
            &'a self,
            _: &'a StoredRule,
            _: &'a RequestMeta,
            _: &'a mut (),
        ) -> futures::future::BoxFuture<'a, ()> {
            self.prepared.fetch_add(1, Ordering::Relaxed);
            Box::pin(std::future::ready(()))
        }
        fn select(
            &self,
            _: &StoredRule,
            _: &RequestMeta,
            _: &Candidates<'_>,
            _: &mut (),
        ) -> Option<Decision> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            Some(Decision::pick(1, Reason::KvOverlap))
        }
        fn routed(&self, _: &StoredRule, _: &RequestMeta, _: EpIdx, _: &mut ()) {
            self.routed.fetch_add(1, Ordering::Relaxed);
        }
        fn bypassed(&self, _: &StoredRule, _: &RequestMeta) {
            self.bypassed.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn kv_rule(kv: u8) -> StoredRule {
        let rule = serde_json::from_value(serde_json::json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 8080, "mode": 4, "sel": 0,
                "kvExactMode": kv},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": 9000},
                          {"endpointIP": "127.0.0.2", "targetPort": 9001}],
        }))
        .expect("rule");
        StoredRule::new(1, rule).expect("valid rule")
    }

    /// One request through the ladder: prepare, decide, routed. The step and the tier's counts
    /// (prepared, asked, routed, bypassed).
    async fn run(kv: u8, api: ApiKind) -> (Step, [usize; 4]) {
        let (rule, fx, tier) = (kv_rule(kv), Fixture::new(&[1, 1]), Tier::default());
        let ladder = Ladder {
            rule: &rule,
            state: &fx.state,
            tier: Some(&tier),
        };
        let meta = RequestMeta {
            api,
            ..Default::default()
        };
        ladder.prepare(&meta, &mut ()).await;
        let step = ladder.decide(&meta, &fx.cands(), &mut ());
        if let Some(ep) = step.decision.endpoint {
            ladder.routed(&meta, ep, &mut ());
        }
        let n = |c: &AtomicUsize| c.load(Ordering::Relaxed);
        let counts = [&tier.prepared, &tier.asked, &tier.routed, &tier.bypassed].map(n);
        (step, counts)
    }

    #[tokio::test]
    async fn generation_requests_enter_the_tier() {
        for api in [
            ApiKind::Completions,
            ApiKind::ChatCompletions,
            ApiKind::Responses,
        ] {
            let (step, counts) = run(3, api).await;
            assert!(step.by_tier, "{api:?}");
            assert_eq!(step.decision, Decision::pick(1, Reason::KvOverlap));
            assert_eq!(
                counts,
                [1, 1, 1, 0],
                "{api:?}: prepared, asked, routed, bypassed"
            );
        }
    }

    #[tokio::test]
    async fn other_requests_skip_the_tier_and_are_reported_bypassed_once() {
        let (step, counts) = run(3, ApiKind::Other).await;
        assert!(!step.by_tier);
        assert_eq!(step.decision, Decision::pick(0, Reason::RoundRobin));
        assert_eq!(counts, [0, 0, 0, 1], "prepared, asked, routed, bypassed");
    }

    #[tokio::test]
    async fn rules_without_the_tier_report_nothing() {
        let (step, counts) = run(0, ApiKind::Other).await;
        assert_eq!(step.decision, Decision::pick(0, Reason::RoundRobin));
        assert_eq!(counts, [0; 4]);
    }
}
