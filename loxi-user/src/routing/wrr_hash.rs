//! sel 10: weighted consistent hash. Same keys as CHWBL (prefix, then conversation / session,
//! then a round-robin-derived fallback) on a ring whose virtual nodes are proportional to
//! endpoint weight (`replication × n × w / Σw` each, see
//! [`super::state::weighted_vnodes`]). Ineligible owners are skipped along the ring. No load
//! cap: the weights are the intended split.

use super::chwbl::ring_key;
use super::state::SelectorState;
use super::{Candidates, Decision};
use crate::request::RequestMeta;
use crate::rules::ServiceArgs;

/// The weighted-ring owner of the request's key.
pub fn select(
    args: &ServiceArgs,
    meta: &RequestMeta,
    cands: &Candidates<'_>,
    state: &SelectorState,
) -> Decision {
    let (key, reason) = ring_key(args, meta, state);
    let topo = state.topology.load();
    topo.weighted_ring
        .walk(key)
        .find(|&ep| cands.eligible(ep))
        .map_or_else(Decision::none, |ep| Decision::pick(ep, reason))
}

#[cfg(test)]
mod tests {
    use super::super::Reason;
    use super::super::test_util::{Fixture, args};
    use super::*;
    use crate::request::Prompt;

    fn text(t: String) -> RequestMeta {
        RequestMeta {
            prompt: Some(Prompt::Text(t)),
            ..Default::default()
        }
    }

    #[test]
    fn shares_follow_weights_over_many_prefixes() {
        let f = Fixture::with_args(args(serde_json::json!({"sel": 10})), &[4, 2, 1]);
        let mut counts = [0f64; 3];
        for k in 0..20_000 {
            let d = select(&f.args, &text(format!("p{k}")), &f.cands(), &f.state);
            assert_eq!(d.reason, Reason::RingPrefix);
            counts[d.endpoint.expect("ep")] += 1.0;
        }
        let share: Vec<f64> = counts.iter().map(|c| c / 20_000.0).collect();
        for (s, want) in share.iter().zip([4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0]) {
            assert!((s - want).abs() < 0.05, "shares {share:?}");
        }
    }

    #[test]
    fn same_prefix_same_owner_and_unhealthy_skipped() {
        let f = Fixture::with_args(args(serde_json::json!({"sel": 10})), &[4, 2, 1]);
        let d = select(&f.args, &text("same".into()), &f.cands(), &f.state);
        assert_eq!(
            select(&f.args, &text("same".into()), &f.cands(), &f.state),
            d
        );
        f.set_healthy(d.endpoint.expect("ep"), false);
        let moved = select(&f.args, &text("same".into()), &f.cands(), &f.state);
        assert!(moved.endpoint.is_some() && moved.endpoint != d.endpoint);
    }
}
