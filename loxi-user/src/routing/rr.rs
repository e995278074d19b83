//! sel 0: round-robin over eligible endpoints (atomic cursor; ineligible endpoints skipped).

use super::state::SelectorState;
use super::{Candidates, Decision, Reason};

/// The next endpoint in rotation: ticket `t` starts at `t % n` and walks forward to the first
/// eligible endpoint. A retry (something excluded) reuses the latest ticket instead of taking a
/// new one, so a dead endpoint does not shift the rotation of later requests onto itself.
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
    let start = ticket % n;
    (0..n)
        .map(|i| (start + i) % n)
        .find(|&ep| cands.eligible(ep))
        .map_or_else(Decision::none, |ep| Decision::pick(ep, Reason::RoundRobin))
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
