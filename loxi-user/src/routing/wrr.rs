//! sel 2: smooth weighted round-robin (nginx's algorithm): every pick adds each eligible
//! endpoint's weight to its current weight, takes the largest (ties: lower index) and subtracts
//! the total. Over one cycle of `Σw` picks each endpoint gets exactly its weight, interleaved.

use super::state::SelectorState;
use super::{Candidates, Decision, EpIdx, Reason};

/// The next endpoint by smooth WRR.
pub fn select(cands: &Candidates<'_>, state: &SelectorState) -> Decision {
    let picked = smooth_pick(
        &mut state.wrr.lock(),
        cands.len(),
        cands
            .eligible_iter()
            .map(|ep| (ep, cands.weights.get(ep).copied().unwrap_or(1))),
    );
    match picked {
        Some(b) => Decision::pick(b, Reason::WeightedRoundRobin),
        None => Decision::none(),
    }
}

/// One smooth-WRR pick among `eps` (endpoint, weight; a weight of 0 counts 1) over the
/// current weights `cur`, one per endpoint of a pool of `len` (reset to zeros when its length
/// differs, e.g. after a rule change): each listed endpoint adds its weight to its current
/// weight, the largest wins (ties: the first listed) and gives back the listed endpoints'
/// total. `None` when `eps` is empty. Shared by sel 2 and the P/D ladder's weighted least
/// load, which lists only its tied endpoints.
pub fn smooth_pick(
    cur: &mut Vec<i64>,
    len: usize,
    eps: impl Iterator<Item = (EpIdx, u32)>,
) -> Option<EpIdx> {
    if cur.len() != len {
        *cur = vec![0; len];
    }
    let mut total = 0i64;
    let mut best: Option<EpIdx> = None;
    for (ep, w) in eps {
        let w = i64::from(w.max(1));
        cur[ep] += w;
        total += w;
        if best.is_none_or(|b| cur[ep] > cur[b]) {
            best = Some(ep);
        }
    }
    let b = best?;
    cur[b] -= total;
    Some(b)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Fixture;
    use super::*;

    #[test]
    fn ratios_exact_in_every_cycle_over_10000_picks() {
        let f = Fixture::new(&[5, 3, 2]);
        let picks: Vec<usize> = (0..10_000)
            .map(|_| select(&f.cands(), &f.state).endpoint.expect("eligible"))
            .collect();
        for cycle in picks.chunks(10) {
            let count = |ep| cycle.iter().filter(|&&p| p == ep).count();
            assert_eq!((count(0), count(1), count(2)), (5, 3, 2));
        }
    }

    #[test]
    fn sequence_is_smooth_like_nginx() {
        // nginx's documented example: weights {a:5, b:1, c:1} → a a b a c a a.
        let f = Fixture::new(&[5, 1, 1]);
        let picks: Vec<_> = (0..7)
            .map(|_| select(&f.cands(), &f.state).endpoint.expect("ep"))
            .collect();
        assert_eq!(picks, vec![0, 0, 1, 0, 2, 0, 0]);
    }

    #[test]
    fn three_to_one_cycle() {
        let f = Fixture::new(&[3, 1]);
        let picks: Vec<_> = (0..4)
            .map(|_| select(&f.cands(), &f.state).endpoint.expect("ep"))
            .collect();
        assert_eq!(picks, vec![0, 0, 1, 0]);
    }

    #[test]
    fn unhealthy_endpoint_gets_nothing_and_others_keep_ratio() {
        let f = Fixture::new(&[2, 1, 1]);
        f.set_healthy(0, false);
        let picks: Vec<_> = (0..100)
            .map(|_| select(&f.cands(), &f.state).endpoint.expect("ep"))
            .collect();
        assert_eq!(picks.iter().filter(|&&p| p == 0).count(), 0);
        assert_eq!(picks.iter().filter(|&&p| p == 1).count(), 50);
    }
}
