//! sel 9: GPU-aware, plain-pool law (LoxiLB's): the prefix key, else the conversation / session
//! key, modulo the number of eligible endpoints, indexing the eligible endpoints in order
//! ([`Reason::Modulo`]); with neither key, round-robin. Worker metrics are not read (as LoxiLB).

use super::key::affinity_key;
use super::state::SelectorState;
use super::{Candidates, Decision, Reason, rr};
use crate::request::RequestMeta;
use crate::rules::ServiceArgs;

/// Modulo placement of the request's key over eligible endpoints.
pub fn select(
    args: &ServiceArgs,
    meta: &RequestMeta,
    cands: &Candidates<'_>,
    state: &SelectorState,
) -> Decision {
    let Some((key, _)) = affinity_key(meta, args) else {
        return rr::select(cands, state);
    };
    let eligible: Vec<_> = cands.eligible_iter().collect();
    if eligible.is_empty() {
        return Decision::none();
    }
    Decision::pick(
        eligible[(key % eligible.len() as u64) as usize],
        Reason::Modulo,
    )
}

#[cfg(test)]
mod tests {
    use super::super::key::prefix_key;
    use super::super::test_util::{Fixture, args};
    use super::*;
    use crate::request::Prompt;

    #[test]
    fn prefix_hash_modulo_eligible() {
        let f = Fixture::with_args(args(serde_json::json!({"sel": 9})), &[1, 1, 1]);
        let m = RequestMeta {
            prompt: Some(Prompt::Text("hello".into())),
            ..Default::default()
        };
        let k = prefix_key(&m, &f.args).expect("prefix");
        assert_eq!(
            select(&f.args, &m, &f.cands(), &f.state),
            Decision::pick((k % 3) as usize, Reason::Modulo)
        );
        f.set_healthy(0, false);
        let want = [1, 2][(k % 2) as usize];
        assert_eq!(
            select(&f.args, &m, &f.cands(), &f.state).endpoint,
            Some(want)
        );
    }

    #[test]
    fn no_key_falls_back_to_round_robin() {
        let f = Fixture::with_args(args(serde_json::json!({"sel": 9})), &[1, 1]);
        let picks: Vec<_> = (0..4)
            .map(|_| select(&f.args, &RequestMeta::default(), &f.cands(), &f.state))
            .collect();
        assert_eq!(
            picks.iter().map(|d| d.endpoint).collect::<Vec<_>>(),
            [0, 1, 0, 1].map(Some)
        );
        assert!(picks.iter().all(|d| d.reason == Reason::RoundRobin));
    }
}
