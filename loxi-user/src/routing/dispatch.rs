//! `select`: the rule's `sel` → its selector.

use loxi_common::sel;

use super::state::SelectorState;
use super::{Candidates, Decision, chwbl, gpu_aware, hash, lc, persist, rr, wrr, wrr_hash};
use crate::proxy::meta::RequestMeta;
use crate::rules::ServiceArgs;

/// Runs the selector named by `args.sel` for one request. `sel` 5 and 6 (N2/N3, not HTTP
/// selectors) and any unknown value use round-robin.
pub fn select(
    args: &ServiceArgs,
    meta: &RequestMeta,
    cands: &Candidates<'_>,
    state: &SelectorState,
) -> Decision {
    match args.sel {
        sel::HASH => hash::select(meta, cands, state),
        sel::WRR => wrr::select(cands, state),
        sel::PERSIST => persist::select(meta, cands, state),
        sel::LC => lc::select(cands),
        sel::CHWBL => chwbl::select(args, meta, cands, state),
        sel::GPU_AWARE => gpu_aware::select(args, meta, cands, state),
        sel::WRR_HASH => wrr_hash::select(args, meta, cands, state),
        _ => rr::select(cands, state),
    }
}

/// The metric label of a selector number.
pub fn selector_name(s: u8) -> &'static str {
    match s {
        sel::RR => "rr",
        sel::HASH => "hash",
        sel::WRR => "wrr",
        sel::PERSIST => "persist",
        sel::LC => "lc",
        sel::CHWBL => "chwbl",
        sel::GPU_AWARE => "gpuaware",
        sel::WRR_HASH => "wrr-hash",
        _ => "rr",
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
                select(&f.args, &m, &f.cands(), &f.state).reason,
                reason,
                "sel {s}"
            );
        }
    }
}
