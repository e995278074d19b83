use super::*;

fn listed(w: &TokenizeWatch) -> Vec<(String, bool, u64)> {
    w.failures()
        .into_iter()
        .map(|f| (f.model, f.chat, f.failures))
        .collect()
}

/// Failures count per model and prompt kind until a success of that model and kind (a chat
/// template failing is not cleared by a completion), most recent first.
#[test]
fn tokenize_failures_count_per_model_and_kind_until_their_next_success() {
    let w = TokenizeWatch::default();
    w.succeeded("a", false);
    assert!(w.failures().is_empty());
    w.failed("a", false);
    w.failed("a", false);
    w.failed("b", true);
    w.succeeded("c", false);
    w.succeeded("b", false);
    assert_eq!(
        listed(&w),
        [("b".into(), true, 1), ("a".into(), false, 2)],
        "a completion of b does not clear its chat failures"
    );
    w.succeeded("a", false);
    assert_eq!(listed(&w), [("b".into(), true, 1)]);
    w.succeeded("b", true);
    assert!(w.failures().is_empty());
}

/// Beyond `MAX_TRACKED`, the entry whose last failure is oldest is forgotten; nothing still
/// tracked is cleared by another model's success, so the list is empty only when every
/// tracked model succeeded.
#[test]
fn tracked_failures_are_bounded_and_never_cleared_by_another_model() {
    let w = TokenizeWatch::default();
    for i in 0..TokenizeWatch::MAX_TRACKED + 3 {
        w.failed(&format!("m{i}"), false);
    }
    w.failed("m3", false);
    let l = listed(&w);
    assert_eq!(l.len(), TokenizeWatch::MAX_TRACKED);
    assert_eq!(
        l[0],
        ("m3".into(), false, 2),
        "m3 failed again: the most recent"
    );
    assert!(
        !l.iter()
            .any(|(m, _, _)| m == "m0" || m == "m1" || m == "m2"),
        "the three oldest forgotten"
    );
    for i in 4..TokenizeWatch::MAX_TRACKED + 3 {
        w.succeeded(&format!("m{i}"), false);
    }
    assert_eq!(listed(&w), [("m3".into(), false, 2)], "m3 still failing");
    w.failed("m0", false);
    assert_eq!(
        listed(&w)[0],
        ("m0".into(), false, 1),
        "a forgotten model is tracked again at its next failure"
    );
}

/// A rule update changing only `kvWarmupSec` is applied in place: the same service state
/// (its KV inventory kept) reports the new value, in `warmup()` and in the window left;
/// an unchanged value leaves it as it is.
#[test]
fn a_warmup_update_applies_to_the_running_state() {
    use crate::kv::testutil::{rule, state};
    let (st, _reg) = state(KvSettings::default());
    let first = st
        .service(&rule(1, 2, serde_json::json!({"kvWarmupSec": 30})))
        .expect("kv on");
    assert_eq!(first.warmup(), Duration::from_secs(30));
    let now = Instant::now();
    first.warm_start.set(now).expect("first connect");
    let updated = st
        .service(&rule(1, 2, serde_json::json!({"kvWarmupSec": 5})))
        .expect("kv on");
    assert!(Arc::ptr_eq(&first, &updated), "the state is kept");
    assert_eq!(updated.warmup(), Duration::from_secs(5));
    assert_eq!(updated.warmup_left(now), Some(Some(Duration::from_secs(5))));
    let again = st
        .service(&rule(1, 2, serde_json::json!({"kvWarmupSec": 5})))
        .expect("kv on");
    assert_eq!(again.warmup(), Duration::from_secs(5));
    let off = st
        .service(&rule(1, 2, serde_json::json!({"kvWarmupSec": 0})))
        .expect("kv on");
    assert_eq!(off.warmup_left(now), None);
}

/// A client-chosen model name of a megabyte is kept shortened (its first 64 bytes and its
/// length), so 64 tracked names cannot hold 64 MiB nor flood `loxicmd get kvparity`.
#[test]
fn an_overlong_model_name_is_kept_shortened() {
    let w = TokenizeWatch::default();
    let long = format!("é{}", "m".repeat(1 << 20));
    w.failed(&long, false);
    w.failed(&long, false);
    let l = listed(&w);
    assert_eq!(
        l,
        [(format!("é{}… (1048578 bytes)", "m".repeat(62)), false, 2)]
    );
}
