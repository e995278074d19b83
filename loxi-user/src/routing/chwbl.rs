//! sel 8: consistent hashing with bounded loads (CHWBL).
//!
//! Key, in order: the request's prefix (model + system prompt / first messages or prompt head,
//! see [`super::key::prefix_key`]) → [`Reason::RingPrefix`]; else its conversation id or
//! session key → [`Reason::RingConversation`]; else a key derived from the round-robin ticket →
//! [`Reason::RingFallback`]. The ring has `chwbl_replication` virtual nodes per endpoint.
//!
//! Bounded load: with `c = chwbl_mean_load_factor / 100` and the mean in-flight over eligible
//! endpoints counting this request, `cap = ceil(c × (Σ in_flight + 1) / eligible)`. The walk
//! starts at the key's owner, skips ineligible endpoints and takes the first one whose
//! `in_flight + 1 ≤ cap`; a pick other than the first eligible owner is [`Reason::RingSpill`].
//! Unlike LoxiLB's HTTP/1.1 path the cap applies to prefix keys too, so a hot shared prefix
//! cannot pile onto one GPU beyond the factor; both knobs take effect (LoxiLB ignores them).

use xxhash_rust::xxh3::xxh3_64;

use super::key::affinity_key;
use super::ring::Ring;
use super::state::SelectorState;
use super::{Candidates, Decision, Reason};
use crate::request::RequestMeta;
use crate::rules::ServiceArgs;

/// The endpoint for `meta` on the CHWBL ring.
pub fn select(
    args: &ServiceArgs,
    meta: &RequestMeta,
    cands: &Candidates<'_>,
    state: &SelectorState,
) -> Decision {
    let (key, reason) = ring_key(args, meta, state);
    let topo = state.topology.load();
    bounded_walk(&topo.ring, key, reason, cands, args.chwbl_mean_load_factor)
}

/// The ring key of a request and the reason it stands for (prefix, conversation, fallback).
pub fn ring_key(args: &ServiceArgs, meta: &RequestMeta, state: &SelectorState) -> (u64, Reason) {
    affinity_key(meta, args).unwrap_or_else(|| {
        (
            xxh3_64(&state.next_ticket().to_le_bytes()),
            Reason::RingFallback,
        )
    })
}

/// `ceil(factor/100 × (Σ in_flight + 1) / eligible)`; 0 when nothing is eligible.
pub fn load_cap(cands: &Candidates<'_>, factor: u32) -> u64 {
    let (mut n, mut total) = (0u64, 0u64);
    for ep in cands.eligible_iter() {
        n += 1;
        total += cands.loads[ep].in_flight();
    }
    if n == 0 {
        return 0;
    }
    (u64::from(factor) * (total + 1)).div_ceil(100 * n)
}

/// Walks the ring from `key`'s owner to the first eligible endpoint under the load cap.
pub fn bounded_walk(
    ring: &Ring,
    key: u64,
    reason: Reason,
    cands: &Candidates<'_>,
    factor: u32,
) -> Decision {
    let cap = load_cap(cands, factor);
    let mut first = None;
    for ep in ring.walk(key).filter(|&ep| cands.eligible(ep)) {
        let owner = *first.get_or_insert(ep);
        if cands.loads[ep].in_flight() < cap {
            return Decision::pick(
                ep,
                if ep == owner {
                    reason
                } else {
                    Reason::RingSpill
                },
            );
        }
    }
    // Only reachable when loads moved under us: keep affinity rather than fail.
    first.map_or_else(Decision::none, |ep| Decision::pick(ep, reason))
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{Fixture, args};
    use super::*;
    use crate::request::{ChatMessage, Prompt};

    fn text(t: &str) -> RequestMeta {
        RequestMeta {
            model: Some("m".into()),
            prompt: Some(Prompt::Text(t.into())),
            ..Default::default()
        }
    }

    fn chat(system: &str, user: &str) -> RequestMeta {
        let msg = |r: &str, c: &str| ChatMessage {
            role: r.into(),
            content: c.into(),
        };
        RequestMeta {
            model: Some("m".into()),
            prompt: Some(Prompt::Messages(vec![
                msg("system", system),
                msg("user", user),
            ])),
            ..Default::default()
        }
    }

    #[test]
    fn same_prefix_same_endpoint() {
        let f = Fixture::with_args(args(serde_json::json!({"sel": 8})), &[1, 1, 1, 1]);
        let first = select(
            &f.args,
            &chat("You are a support agent.", "hi"),
            &f.cands(),
            &f.state,
        );
        assert_eq!(first.reason, Reason::RingPrefix);
        for _ in 0..50 {
            assert_eq!(
                select(
                    &f.args,
                    &chat("You are a support agent.", "hi"),
                    &f.cands(),
                    &f.state
                ),
                first
            );
        }
    }

    #[test]
    fn adding_one_of_n_endpoints_remaps_at_most_its_share_plus_5_percent() {
        for n in [2usize, 4, 8] {
            let before = Fixture::with_args(args(serde_json::json!({"sel": 8})), &vec![1; n]);
            let after = Fixture::with_args(args(serde_json::json!({"sel": 8})), &vec![1; n + 1]);
            let moved = (0..10_000)
                .filter(|k| {
                    let m = text(&format!("prompt number {k}"));
                    select(&before.args, &m, &before.cands(), &before.state).endpoint
                        != select(&after.args, &m, &after.cands(), &after.state).endpoint
                })
                .count();
            let bound = 10_000.0 * (1.0 / (n as f64 + 1.0) + 0.05);
            assert!(
                (moved as f64) <= bound,
                "n={n}: {moved} keys moved, bound {bound}"
            );
            assert!(moved > 0, "n={n}: the new endpoint took no keys");
        }
    }

    #[test]
    fn bounded_load_never_exceeds_cap_for_a_hot_prefix() {
        for factor in [100u32, 125, 175, 300] {
            let f = Fixture::with_args(
                args(serde_json::json!({"sel": 8, "chwbl_mean_load_factor": factor})),
                &[1, 1, 1, 1],
            );
            let mut guards = Vec::new();
            let mut spills = 0;
            for i in 0..400 {
                // One hot prefix and a few cold ones; release a request now and then.
                let m = if i % 5 == 0 {
                    text(&format!("cold {i}"))
                } else {
                    text("hot shared prefix")
                };
                let cands = f.cands();
                let cap = load_cap(&cands, factor);
                let d = select(&f.args, &m, &cands, &f.state);
                let ep = d.endpoint.expect("eligible");
                guards.push(f.loads[ep].begin());
                assert!(
                    f.loads[ep].in_flight() <= cap,
                    "factor {factor}: ep {ep} over cap {cap}"
                );
                spills += usize::from(d.reason == Reason::RingSpill);
                if i % 7 == 6 {
                    guards.swap_remove(i % guards.len());
                }
            }
            assert!(spills > 0, "factor {factor}: the hot prefix never spilled");
        }
    }

    #[test]
    fn load_factor_takes_effect() {
        // A hot key with 4 idle endpoints: the owner takes requests until it reaches the cap.
        let run = |factor: u32| {
            let f = Fixture::with_args(
                args(serde_json::json!({"sel": 8, "chwbl_mean_load_factor": factor})),
                &[1, 1, 1, 1],
            );
            let mut guards = Vec::new();
            let owner = select(&f.args, &text("hot"), &f.cands(), &f.state)
                .endpoint
                .expect("ep");
            for _ in 0..40 {
                let ep = select(&f.args, &text("hot"), &f.cands(), &f.state)
                    .endpoint
                    .expect("ep");
                guards.push(f.loads[ep].begin());
            }
            f.loads[owner].in_flight()
        };
        // cap after 40 picks: ceil(1.0 × 40 / 4) = 10 vs ceil(3.0 × 40 / 4) = 30.
        assert_eq!(run(100), 10);
        assert_eq!(run(300), 30);
    }

    #[test]
    fn replication_takes_effect() {
        let f = Fixture::with_args(
            args(serde_json::json!({"sel": 8, "chwbl_replication": 7})),
            &[1, 1, 1],
        );
        assert_eq!(f.state.topology.load().ring.len(), 21);
        let f = Fixture::with_args(args(serde_json::json!({"sel": 8})), &[1, 1, 1]);
        assert_eq!(f.state.topology.load().ring.len(), 3 * 256);
    }

    #[test]
    fn unhealthy_owner_is_skipped_and_affinity_kept() {
        let f = Fixture::with_args(args(serde_json::json!({"sel": 8})), &[1, 1, 1]);
        let owner = select(&f.args, &text("abc"), &f.cands(), &f.state)
            .endpoint
            .expect("ep");
        f.set_healthy(owner, false);
        let next = select(&f.args, &text("abc"), &f.cands(), &f.state);
        assert_ne!(next.endpoint, Some(owner));
        assert_eq!(next.reason, Reason::RingPrefix);
        assert_eq!(select(&f.args, &text("abc"), &f.cands(), &f.state), next);
    }

    #[test]
    fn conversation_then_fallback_keys() {
        let f = Fixture::with_args(args(serde_json::json!({"sel": 8})), &[1, 1, 1]);
        let conv = RequestMeta {
            conversation_id: Some("c-1".into()),
            ..Default::default()
        };
        let d = select(&f.args, &conv, &f.cands(), &f.state);
        assert_eq!(d.reason, Reason::RingConversation);
        assert_eq!(select(&f.args, &conv, &f.cands(), &f.state), d);
        let picks: std::collections::HashSet<_> = (0..60)
            .map(|_| select(&f.args, &RequestMeta::default(), &f.cands(), &f.state))
            .inspect(|d| assert_eq!(d.reason, Reason::RingFallback))
            .map(|d| d.endpoint)
            .collect();
        assert_eq!(picks.len(), 3, "fallback keys should spread");
    }

    #[test]
    fn nothing_eligible_is_none() {
        let f = Fixture::with_args(args(serde_json::json!({"sel": 8})), &[1, 1]);
        f.set_healthy(0, false);
        f.set_healthy(1, false);
        assert_eq!(
            select(&f.args, &text("x"), &f.cands(), &f.state),
            Decision::none()
        );
    }
}
