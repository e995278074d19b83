use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use super::*;
use crate::routing::{Decision, EndpointLoad, Reason};

/// Roles per endpoint (0 normal, 1 prefill, 2 decode), `kvExactMode` as given.
fn rule(roles: &[u8], kv_exact_mode: u8) -> StoredRule {
    let eps: Vec<_> = roles
        .iter()
        .enumerate()
        .map(|(i, r)| serde_json::json!({"endpointIP": "127.0.0.1", "targetPort": 9000 + i, "ep_role": r}))
        .collect();
    let r = serde_json::from_value(serde_json::json!({
        "serviceArguments": {"externalIP": "10.0.0.1", "port": 8080, "mode": 4,
            "pd_disagg_mode": true, "kvExactMode": kv_exact_mode},
        "endpoints": eps,
    }))
    .expect("rule");
    StoredRule::new(1, r).expect("valid P/D rule")
}

struct Fx {
    rule: StoredRule,
    state: PdState,
    weights: Vec<u32>,
    loads: Vec<Arc<EndpointLoad>>,
    excluded: Excluded,
}

impl Fx {
    fn new(roles: &[u8], mode: u8) -> Self {
        let rule = rule(roles, mode);
        let state = PdState::new(rule.spec.pd.as_ref().expect("pd"));
        Self {
            state,
            weights: vec![1; roles.len()],
            loads: roles.iter().map(|_| EndpointLoad::new()).collect(),
            excluded: Excluded::default(),
            rule,
        }
    }
    fn cands(&self) -> Candidates<'_> {
        Candidates {
            weights: &self.weights,
            loads: &self.loads,
            excluded: &self.excluded,
        }
    }
    fn ladder<'a>(&'a self, tier: Option<&'a FakeKv>) -> PdLadder<'a, FakeKv> {
        PdLadder {
            rule: &self.rule,
            pd: self.rule.spec.pd.as_ref().expect("pd"),
            state: &self.state,
            tier,
        }
    }
    fn load(&self, ep: usize, n: u64) {
        self.loads[ep].in_flight.store(n, Ordering::Relaxed);
    }
    fn down(&self, ep: usize) {
        self.loads[ep].healthy.store(false, Ordering::Relaxed);
    }
}

/// A KV tier double: answers `answer` and records which endpoints were eligible when asked.
#[derive(Default)]
struct FakeKv {
    answer: Option<EpIdx>,
    saw_eligible: Mutex<Vec<Vec<EpIdx>>>,
    routed: Mutex<Vec<EpIdx>>,
}

impl AffinityTier for FakeKv {
    type Ticket = ();
    fn select(
        &self,
        _rule: &StoredRule,
        _meta: &RequestMeta,
        cands: &Candidates<'_>,
        _ticket: &mut (),
    ) -> Option<Decision> {
        self.saw_eligible
            .lock()
            .push(cands.eligible_iter().collect());
        self.answer.map(|ep| Decision::pick(ep, Reason::KvOverlap))
    }
    fn routed(&self, _rule: &StoredRule, _meta: &RequestMeta, ep: EpIdx, _ticket: &mut ()) {
        self.routed.lock().push(ep);
    }
}

fn meta() -> RequestMeta {
    RequestMeta::default()
}

#[test]
fn tier_2_picks_the_least_loaded_prefill_and_rotates_ties() {
    let fx = Fx::new(&[1, 2, 1, 2, 1], 0);
    fx.load(0, 3);
    fx.load(2, 1);
    fx.load(4, 1);
    let l = fx.ladder(None);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..6 {
        let c = l
            .prefill(&meta(), &fx.cands(), None, &mut ())
            .expect("prefill");
        assert_eq!(c.tier, PdTier::MinLoad);
        assert!(c.ep == 2 || c.ep == 4, "least loaded prefill, got {}", c.ep);
        seen.insert(c.ep);
    }
    assert_eq!(seen.len(), 2, "ties rotate between 2 and 4");
    fx.load(1, 5);
    assert_eq!(l.decode(&fx.cands(), None).map(|c| c.ep), Some(3));
}

#[test]
fn every_tier_skips_down_and_excluded_endpoints() {
    let mut fx = Fx::new(&[1, 2, 1, 2], 0);
    let pin = Pin {
        prefill: 0,
        decode: 1,
    };
    {
        let l = fx.ladder(None);
        let c = l
            .prefill(&meta(), &fx.cands(), Some(pin), &mut ())
            .expect("pin");
        assert_eq!((c.ep, c.tier), (0, PdTier::Session));
        assert_eq!(
            l.decode(&fx.cands(), Some(pin)).map(|c| (c.ep, c.tier)),
            Some((1, PdTier::Session))
        );
        fx.down(0);
        fx.down(1);
        let c = l
            .prefill(&meta(), &fx.cands(), Some(pin), &mut ())
            .expect("moved");
        assert_eq!(
            (c.ep, c.tier),
            (2, PdTier::MinLoad),
            "a down pin is not used"
        );
        assert_eq!(l.decode(&fx.cands(), Some(pin)).map(|c| c.ep), Some(3));
    }
    fx.excluded.insert(2);
    let l = fx.ladder(None);
    assert_eq!(l.prefill(&meta(), &fx.cands(), None, &mut ()), None);
}

#[test]
fn tier_1_5_sees_only_prefill_endpoints_in_mode_1() {
    let fx = Fx::new(&[1, 2, 1, 0], 1);
    let kv = FakeKv {
        answer: Some(2),
        ..Default::default()
    };
    let l = fx.ladder(Some(&kv));
    let c = l.prefill(&meta(), &fx.cands(), None, &mut ()).expect("kv");
    assert_eq!((c.ep, c.tier), (2, PdTier::KvOverlap));
    assert_eq!(kv.saw_eligible.lock()[0], vec![0, 2]);
    l.routed(&meta(), 2, &mut ());
    assert_eq!(*kv.routed.lock(), vec![2]);
    // A pin wins over tier 1.5.
    let pin = Pin {
        prefill: 0,
        decode: 1,
    };
    let c = l
        .prefill(&meta(), &fx.cands(), Some(pin), &mut ())
        .expect("pin");
    assert_eq!(c.tier, PdTier::Session);
    // A tier answer that is not an eligible prefill endpoint is not taken.
    let bad = FakeKv {
        answer: Some(1),
        ..Default::default()
    };
    let l = fx.ladder(Some(&bad));
    let c = l
        .prefill(&meta(), &fx.cands(), None, &mut ())
        .expect("tier 2");
    assert_eq!(c.tier, PdTier::MinLoad);
    // kvExactMode 0: the tier is not asked.
    let fx0 = Fx::new(&[1, 2], 0);
    let kv0 = FakeKv {
        answer: Some(0),
        ..Default::default()
    };
    let c = fx0
        .ladder(Some(&kv0))
        .prefill(&meta(), &fx0.cands(), None, &mut ())
        .expect("tier 2");
    assert_eq!(c.tier, PdTier::MinLoad);
    assert!(kv0.saw_eligible.lock().is_empty());
}

#[test]
fn aggregated_fallback_uses_role_0_endpoints_only() {
    let fx = Fx::new(&[1, 2, 0, 0], 0);
    fx.load(2, 4);
    let l = fx.ladder(None);
    assert_eq!(
        l.aggregated(&fx.cands()).map(|c| (c.ep, c.tier)),
        Some((3, PdTier::Aggregated))
    );
    let fx = Fx::new(&[1, 2], 0);
    assert_eq!(fx.ladder(None).aggregated(&fx.cands()), None);
}
