//! sel 2: smooth weighted round-robin (nginx's algorithm): every pick adds each eligible
//! endpoint's weight to its current weight, takes the largest (ties: lower index) and subtracts
//! the total. Over one cycle of `Σw` picks each endpoint gets exactly its weight, interleaved.

use super::state::SelectorState;
use super::{Candidates, Decision, Reason};

/// The next endpoint by smooth WRR.
pub fn select(cands: &Candidates<'_>, state: &SelectorState) -> Decision {
    let mut cur = state.wrr.lock();
    if cur.len() != cands.len() {
        *cur = vec![0; cands.len()];
    }
    let mut total = 0i64;
    let mut best: Option<usize> = None;
    for ep in cands.eligible_iter() {
        let w = i64::from(cands.weights.get(ep).copied().unwrap_or(1).max(1));
        cur[ep] += w;
        total += w;
        if best.is_none_or(|b| cur[ep] > cur[b]) {
            best = Some(ep);
        }
    }
    match best {
        Some(b) => {
            cur[b] -= total;
            Decision::pick(b, Reason::WeightedRoundRobin)
        }
        None => Decision::none(),
    }
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
