//! sel 0: round-robin over eligible endpoints (atomic cursor; ineligible endpoints skipped).

use super::state::SelectorState;
use super::{Candidates, Decision, Reason};

/// The next endpoint in rotation: ticket `t` picks the `(t % m)`-th of the `m` eligible
/// endpoints (in rule order), so the rotation is even over the healthy ones, as LoxiLB's sel 0
/// ("rotates evenly across all healthy endpoints", shared/spec/load-balancing-algorithms.txt).
/// Walking on from `t % n` instead gave an ineligible endpoint's turns to its successor: with
/// one of four down, 15/30/15. A retry (something excluded) reuses the latest ticket instead
/// of taking a new one, so a dead endpoint does not shift the rotation of later requests.
pub fn select(cands: &Candidates<'_>, state: &SelectorState) -> Decision {
    let n = cands.len();
    if n == 0 {
        return Decision::none();
    }
    let ticket = if cands.excluded.is_empty() {
        state.next_ticket()
    } else {
        state
            .rr
            .load(std::sync::atomic::Ordering::Relaxed)
            .wrapping_sub(1)
    };
    let m = cands.eligible_iter().count();
    if m == 0 {
        return Decision::none();
    }
    let ep = if m == n {
        ticket % n
    } else {
        // `None` only when a health flag flipped between the two passes.
        match cands.eligible_iter().nth(ticket % m) {
            Some(ep) => ep,
            None => return Decision::none(),
        }
    };
    Decision::pick(ep, Reason::RoundRobin)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Fixture;
    use super::*;

    #[test]
    fn rotates_in_order() {
        let f = Fixture::new(&[1, 1, 1]);
        let picks: Vec<_> = (0..6)
            .map(|_| select(&f.cands(), &f.state).endpoint)
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2].map(Some));
    }

    #[test]
    fn retry_does_not_advance_the_rotation() {
        let mut f = Fixture::new(&[1, 1, 1]);
        assert_eq!(select(&f.cands(), &f.state).endpoint, Some(0));
        f.excluded.insert(0);
        assert_eq!(
            select(&f.cands(), &f.state).endpoint,
            Some(1),
            "retry walks on from 0"
        );
        f.excluded = Default::default();
        assert_eq!(
            select(&f.cands(), &f.state).endpoint,
            Some(1),
            "next request keeps its turn"
        );
        assert_eq!(select(&f.cands(), &f.state).endpoint, Some(2));
    }

    /// One endpoint of four down: the other three split evenly, in rule order (before, the
    /// dead one's turns went to its successor: 15/30/15 of 60).
    #[test]
    fn an_unhealthy_endpoints_turns_are_spread_over_the_others() {
        let f = Fixture::new(&[1, 1, 1, 1]);
        f.set_healthy(1, false);
        let picks: Vec<_> = (0..60)
            .map(|_| select(&f.cands(), &f.state).endpoint)
            .collect();
        assert_eq!(picks[..6], [0, 2, 3, 0, 2, 3].map(Some));
        let count = |ep| picks.iter().filter(|&&p| p == Some(ep)).count();
        assert_eq!([count(0), count(1), count(2), count(3)], [20, 0, 20, 20]);
        f.set_healthy(1, true);
        let next: Vec<_> = (0..4)
            .map(|_| select(&f.cands(), &f.state).endpoint)
            .collect();
        assert_eq!(next, [0, 1, 2, 3].map(Some), "back in the rotation");
    }

    #[test]
    fn skips_unhealthy_and_excluded() {
        let mut f = Fixture::new(&[1, 1, 1]);
        f.set_healthy(1, false);
        f.excluded.insert(2);
        for _ in 0..4 {
            assert_eq!(
                select(&f.cands(), &f.state),
                Decision::pick(0, Reason::RoundRobin)
            );
        }
        f.excluded.insert(0);
        assert_eq!(select(&f.cands(), &f.state), Decision::none());
    }
}
