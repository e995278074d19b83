use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use super::*;
use crate::routing::{Decision, EndpointLoad, Reason};

/// Roles per endpoint (0 normal, 1 prefill, 2 decode), `kvExactMode` as given.
fn rule(roles: &[u8], kv_exact_mode: u8) -> StoredRule {
    rule_with(roles, serde_json::json!({"kvExactMode": kv_exact_mode}))
}

/// Roles per endpoint, with `extra` service arguments.
fn rule_with(roles: &[u8], extra: serde_json::Value) -> StoredRule {
    let eps: Vec<_> = roles
        .iter()
        .enumerate()
        .map(|(i, r)| serde_json::json!({"endpointIP": format!("127.0.0.{}", i + 1), "targetPort": 9000 + i, "ep_role": r}))
        .collect();
    let mut v = serde_json::json!({
        "serviceArguments": {"externalIP": "10.0.0.1", "port": 8080, "mode": 4,
            "pd_disagg_mode": true},
        "endpoints": eps,
    });
    for (k, x) in extra.as_object().expect("object") {
        v["serviceArguments"][k] = x.clone();
    }
    let r = serde_json::from_value(v).expect("rule");
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
        Self::of(rule(roles, mode))
    }
    fn of(rule: StoredRule) -> Self {
        let roles = rule.spec.pd.as_ref().expect("pd").roles.clone();
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
            key: None,
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
    prepared: std::sync::atomic::AtomicUsize,
}

impl AffinityTier for FakeKv {
    type Ticket = ();
    fn prepare<'a>(
        &'a self,
        _rule: &'a StoredRule,
        _meta: &'a RequestMeta,
        _ticket: &'a mut (),
    ) -> futures::future::BoxFuture<'a, ()> {
        self.prepared.fetch_add(1, Ordering::Relaxed);
        Box::pin(std::future::ready(()))
    }
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
fn the_tier_prepares_once_per_request_in_mode_1_only() {
    let fx = Fx::new(&[1, 2], 1);
    let kv = FakeKv::default();
    futures::executor::block_on(fx.ladder(Some(&kv)).prepare(&meta(), &mut ()));
    assert_eq!(kv.prepared.load(Ordering::Relaxed), 1);
    let fx0 = Fx::new(&[1, 2], 0);
    let kv0 = FakeKv::default();
    futures::executor::block_on(fx0.ladder(Some(&kv0)).prepare(&meta(), &mut ()));
    assert_eq!(
        kv0.prepared.load(Ordering::Relaxed),
        0,
        "kvExactMode 0 has no tier"
    );
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

/// A tier-1 fixture: prefill 0, decode 1, prefill 2, prefill 3; `extra` tier-1 knobs.
fn trie_fx(extra: serde_json::Value) -> Fx {
    let mut args = serde_json::json!({"pd_cache_aware_mode": true});
    for (k, x) in extra.as_object().expect("object") {
        args[k] = x.clone();
    }
    Fx::of(rule_with(&[1, 2, 1, 1], args))
}

fn text_key(s: &str) -> Vec<u32> {
    super::super::trie::key_of(
        &RequestMeta {
            prompt: Some(crate::request::Prompt::Text(s.into())),
            ..RequestMeta::default()
        },
        None,
    )
    .expect("key")
}

/// One prefill decision with `key`, learned (as the proxy does once it sends the leg).
fn decide(fx: &Fx, key: &[u32]) -> Choice {
    let l = PdLadder {
        key: Some(key),
        ..fx.ladder(None)
    };
    let c = l
        .prefill(&meta(), &fx.cands(), None, &mut ())
        .expect("prefill");
    l.routed(&meta(), c.ep, &mut ());
    c
}

const PREAMBLE: &str = "You are a careful assistant. Answer in one sentence. Context: ";

#[test]
fn tier_1_sends_a_shared_prefix_to_the_prefill_that_learned_it() {
    let fx = trie_fx(serde_json::json!({}));
    // Cold: a miss, tier 2 picks among the three idle prefill endpoints; load 2 and 3 so it
    // is 0.
    fx.load(2, 1);
    fx.load(3, 1);
    let first = decide(&fx, &text_key(&format!("{PREAMBLE}the sky is blue")));
    assert_eq!(
        (first.ep, first.tier, first.trie),
        (0, PdTier::MinLoad, TrieOutcome::Miss)
    );
    // Now endpoint 0 is the busiest (2 vs 1): tier 1 still sends the shared prefix there.
    fx.load(0, 2);
    let second = decide(&fx, &text_key(&format!("{PREAMBLE}grass is green")));
    assert_eq!(
        (second.ep, second.tier, second.trie),
        (0, PdTier::Trie, TrieOutcome::Hit)
    );
    // An unrelated prompt: a miss, minimum load (2 or 3).
    let other = decide(&fx, &text_key("Translate to French: good morning"));
    assert_eq!(
        (other.tier, other.trie),
        (PdTier::MinLoad, TrieOutcome::Miss)
    );
    assert!(other.ep == 2 || other.ep == 3, "{}", other.ep);
    // A pin wins over tier 1 (and tier 1 is not asked).
    let pin = Pin {
        prefill: 3,
        decode: 1,
    };
    let key = text_key(&format!("{PREAMBLE}pinned"));
    let l = PdLadder {
        key: Some(&key),
        ..fx.ladder(None)
    };
    let c = l
        .prefill(&meta(), &fx.cands(), Some(pin), &mut ())
        .expect("pin");
    assert_eq!(
        (c.ep, c.tier, c.trie),
        (3, PdTier::Session, TrieOutcome::NotAsked)
    );
}

#[test]
fn tier_1_needs_the_threshold_share_of_the_prompt() {
    // 62-character preamble + 38 characters of question = 100 characters: the learned
    // preamble is a 62 % match.
    assert_eq!(PREAMBLE.chars().count(), 62);
    let q = |c: char| format!("{PREAMBLE}{}", c.to_string().repeat(38));
    for (threshold, want) in [(62, TrieOutcome::Hit), (63, TrieOutcome::Miss)] {
        let fx = trie_fx(serde_json::json!({"pd_cache_threshold": threshold}));
        fx.load(2, 1);
        fx.load(3, 1);
        assert_eq!(decide(&fx, &text_key(&q('a'))).ep, 0);
        let c = decide(&fx, &text_key(&q('b')));
        assert_eq!(c.trie, want, "threshold {threshold}");
        assert_eq!(c.ep, 0, "tier 1 or minimum load: endpoint 0 either way");
        if want == TrieOutcome::Miss {
            assert_eq!(c.tier, PdTier::MinLoad);
        }
    }
    // Threshold 0 means the default 20: a 10-character match of 100 is a miss.
    let fx = trie_fx(serde_json::json!({"pd_cache_threshold": 0}));
    decide(&fx, &text_key(&format!("0123456789{}", "x".repeat(90))));
    let c = decide(&fx, &text_key(&format!("0123456789{}", "y".repeat(90))));
    assert_eq!(c.trie, TrieOutcome::Miss);
}

#[test]
fn tier_1_is_bypassed_when_prefill_loads_differ_by_more_than_the_threshold() {
    let fx = trie_fx(serde_json::json!({"pd_balance_abs_threshold": 2}));
    let key = text_key(&format!("{PREAMBLE}question"));
    fx.load(2, 1);
    fx.load(3, 1);
    assert_eq!(decide(&fx, &key).ep, 0);
    // Loads 3, 1, 1: max − min = 2, not over 2: tier 1 holds.
    fx.load(0, 3);
    let c = decide(&fx, &key);
    assert_eq!((c.ep, c.trie), (0, TrieOutcome::Hit));
    // Loads 4, 1, 1: 3 > 2: bypassed, minimum load.
    fx.load(0, 4);
    let c = decide(&fx, &key);
    assert_eq!((c.tier, c.trie), (PdTier::MinLoad, TrieOutcome::Bypass));
    assert!(c.ep == 2 || c.ep == 3, "{}", c.ep);
    // The decode endpoint's load does not count (only prefill endpoints).
    fx.load(0, 1);
    fx.load(1, 50);
    let c = decide(&fx, &key);
    assert_eq!(c.trie, TrieOutcome::Hit);
    // Default 3 (submitted 0): loads 4, 1, 1 (3) holds; 5, 1, 1 (4) bypasses.
    let fx = trie_fx(serde_json::json!({"pd_balance_abs_threshold": 0}));
    fx.load(2, 1);
    fx.load(3, 1);
    assert_eq!(decide(&fx, &key).ep, 0);
    fx.load(0, 4);
    assert_eq!(decide(&fx, &key).trie, TrieOutcome::Hit);
    fx.load(0, 5);
    assert_eq!(decide(&fx, &key).trie, TrieOutcome::Bypass);
}

#[test]
fn tier_1_never_picks_a_down_or_excluded_prefill_and_forgets_removed_endpoints() {
    let mut fx = trie_fx(serde_json::json!({}));
    let key = text_key(&format!("{PREAMBLE}question"));
    fx.load(2, 1);
    fx.load(3, 1);
    assert_eq!(decide(&fx, &key).ep, 0);
    // Endpoint 3 learns it too (a pin sent it there).
    fx.state.trie.as_ref().expect("trie").lock().insert(&key, 3);
    fx.load(3, 0);
    fx.load(0, 0);
    fx.down(0);
    let c = decide(&fx, &key);
    assert_eq!((c.ep, c.tier), (3, PdTier::Trie), "the other holder");
    fx.excluded.insert(3);
    let c = decide(&fx, &key);
    assert_eq!(
        (c.ep, c.tier, c.trie),
        (2, PdTier::MinLoad, TrieOutcome::Miss)
    );
    // The rule loses endpoint 0 (1, 2, 3 become 0, 1, 2): the successor state forgets it.
    let next = rule_with(&[2, 1, 1], serde_json::json!({"pd_cache_aware_mode": true}));
    let carried = PdState::successor(next.spec.pd.as_ref().expect("pd"), Some(&fx.state), |ep| {
        ep.checked_sub(1)
    });
    let t = carried.trie.as_ref().expect("trie").lock();
    let m = t.longest_match(&key, |_| true).expect("kept");
    assert_eq!(m.matched, key.len());
    assert_eq!(m.holders, vec![1, 2], "old 2 and 3, renumbered; old 0 gone");
}

#[test]
fn tier_1_is_off_without_cache_aware_mode() {
    let fx = Fx::new(&[1, 2, 1], 0);
    assert!(fx.state.trie.is_none());
    let key = text_key("anything");
    let l = PdLadder {
        key: Some(&key),
        ..fx.ladder(None)
    };
    let c = l
        .prefill(&meta(), &fx.cands(), None, &mut ())
        .expect("prefill");
    assert_eq!((c.tier, c.trie), (PdTier::MinLoad, TrieOutcome::NotAsked));
}

#[test]
fn tier_2_splits_idle_endpoints_by_weight_for_prefill_and_decode() {
    // Prefill 0 (weight 5), decode 1 (weight 1), prefill 2 (weight 1), decode 3 (weight 3).
    let mut fx = Fx::new(&[1, 2, 1, 2], 0);
    fx.weights = vec![5, 1, 1, 3];
    let l = fx.ladder(None);
    let pre: Vec<EpIdx> = (0..24)
        .map(|_| {
            let c = l
                .prefill(&meta(), &fx.cands(), None, &mut ())
                .expect("prefill");
            assert_eq!(c.tier, PdTier::MinLoad);
            c.ep
        })
        .collect();
    let count = |v: &[EpIdx], ep| v.iter().filter(|&&p| p == ep).count();
    assert_eq!((count(&pre, 0), count(&pre, 2)), (20, 4), "{pre:?}");
    // Smooth: every cycle of 6 holds exactly 5 and 1.
    for cycle in pre.chunks(6) {
        assert_eq!((count(cycle, 0), count(cycle, 2)), (5, 1), "{pre:?}");
    }
    let dec: Vec<EpIdx> = (0..8)
        .map(|_| l.decode(&fx.cands(), None).expect("decode").ep)
        .collect();
    assert_eq!((count(&dec, 1), count(&dec, 3)), (2, 6), "{dec:?}");
}

#[test]
fn tier_2_compares_load_per_unit_of_weight() {
    let mut fx = Fx::new(&[1, 2, 1, 2], 0);
    fx.weights = vec![5, 1, 1, 1];
    let l = fx.ladder(None);
    let pick = |fx: &Fx| {
        l.prefill(&meta(), &fx.cands(), None, &mut ())
            .expect("prefill")
            .ep
    };
    // 4/5 < 1/1: the heavier-loaded but heavier-weighted endpoint.
    fx.load(0, 4);
    fx.load(2, 1);
    assert_eq!(pick(&fx), 0);
    // 6/5 > 1/1.
    fx.load(0, 6);
    assert_eq!(pick(&fx), 2);
    // 5/5 == 1/1: a tie, broken by weight (5:1 over six picks).
    fx.load(0, 5);
    let picks: Vec<EpIdx> = (0..6).map(|_| pick(&fx)).collect();
    assert_eq!(picks.iter().filter(|&&p| p == 0).count(), 5, "{picks:?}");
    // Queued requests count as load too.
    fx.load(0, 0);
    fx.loads[0].queued.store(6, Ordering::Relaxed);
    assert_eq!(pick(&fx), 2);
}

#[test]
fn concurrent_load_on_weighted_prefills_follows_the_weights() {
    // Requests that stay in flight: each pick adds one to its endpoint's load, as the proxy's
    // load guard does, so the choice is by load per unit of weight.
    let mut fx = Fx::new(&[1, 2, 1, 2], 0);
    fx.weights = vec![5, 1, 1, 1];
    let l = fx.ladder(None);
    let guards: Vec<_> = (0..24)
        .map(|_| {
            let ep = l
                .prefill(&meta(), &fx.cands(), None, &mut ())
                .expect("prefill")
                .ep;
            fx.loads[ep].begin()
        })
        .collect();
    assert_eq!((fx.loads[0].in_flight(), fx.loads[2].in_flight()), (20, 4));
    drop(guards);
}

#[test]
fn weights_neither_move_a_pin_nor_override_a_prefix_hit() {
    let mut fx = Fx::new(&[1, 2, 1, 2], 0);
    fx.weights = vec![1, 1, 100, 100];
    let pin = Pin {
        prefill: 0,
        decode: 1,
    };
    let l = fx.ladder(None);
    let c = l
        .prefill(&meta(), &fx.cands(), Some(pin), &mut ())
        .expect("prefill");
    assert_eq!((c.ep, c.tier), (0, PdTier::Session));
    let d = l.decode(&fx.cands(), Some(pin)).expect("decode");
    assert_eq!((d.ep, d.tier), (1, PdTier::Session));

    // Tier 1: prefill 0 learned the prefix; prefill 2 weighs 100 but holds none of it.
    let mut fx = trie_fx(serde_json::json!({}));
    fx.weights = vec![1, 1, 100, 1];
    let key = text_key(&format!("{PREAMBLE}one"));
    let l = PdLadder {
        key: Some(&key),
        ..fx.ladder(None)
    };
    l.routed(&meta(), 0, &mut ());
    let c = decide(&fx, &text_key(&format!("{PREAMBLE}two")));
    assert_eq!((c.ep, c.tier), (0, PdTier::Trie));
    // Two holders: the one with less load per unit of weight (3/100 < 1/1).
    l.routed(&meta(), 2, &mut ());
    fx.load(0, 1);
    fx.load(2, 3);
    let c = decide(&fx, &text_key(&format!("{PREAMBLE}zebra")));
    assert_eq!((c.ep, c.tier), (2, PdTier::Trie));
}
