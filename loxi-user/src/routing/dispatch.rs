//! `select`: the rule's `sel` → its selector (the last step of the ladder).

use super::state::SelectorState;
use super::{Candidates, Decision, chwbl, gpu_aware, hash, lc, persist, rr, wrr, wrr_hash};
use crate::request::RequestMeta;
use crate::rules::ServiceArgs;
use crate::rules::spec::Sel;

/// Runs the rule's selector for one request (`sel` from the rule's typed spec, the selector
/// knobs from its raw arguments). `sel` 5 and 6 (N2/N3, not HTTP selectors) use round-robin.
pub fn select(
    sel: Sel,
    args: &ServiceArgs,
    meta: &RequestMeta,
    cands: &Candidates<'_>,
    state: &SelectorState,
) -> Decision {
    match sel {
        Sel::Hash => hash::select(meta, cands, state),
        Sel::Wrr => wrr::select(cands, state),
        Sel::Persist => persist::select(meta, cands, state),
        Sel::Lc => lc::select(cands),
        Sel::Chwbl => chwbl::select(args, meta, cands, state),
        Sel::GpuAware => gpu_aware::select(args, meta, cands, state),
        Sel::WrrHash => wrr_hash::select(args, meta, cands, state),
        Sel::Rr | Sel::N2 | Sel::N3 => rr::select(cands, state),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Reason;
    use super::super::test_util::{Fixture, args};
    use super::*;

    #[test]
    fn dispatches_by_sel() {
        for (s, reason) in [
            (0, Reason::RoundRobin),
            (1, Reason::Hash),
            (2, Reason::WeightedRoundRobin),
            (3, Reason::Persist),
            (4, Reason::LeastConnections),
            (8, Reason::RingFallback),
            (9, Reason::RoundRobin),
            (10, Reason::RingFallback),
        ] {
            let f = Fixture::with_args(args(serde_json::json!({"sel": s})), &[1, 1]);
            let m = RequestMeta {
                client: Some("10.0.0.9:5000".parse().expect("addr")),
                ..Default::default()
            };
            assert_eq!(
                select(Sel::of(s).expect("sel"), &f.args, &m, &f.cands(), &f.state).reason,
                reason,
                "sel {s}"
            );
        }
    }
}
