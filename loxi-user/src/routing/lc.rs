//! sel 4: least connections: the eligible endpoint with the fewest in-flight requests (counted
//! by RAII guards on response bodies); ties go to the lower index.

use super::{Candidates, Decision, Reason};

/// The least-loaded eligible endpoint.
pub fn select(cands: &Candidates<'_>) -> Decision {
    cands
        .eligible_iter()
        .min_by_key(|&ep| (cands.loads[ep].in_flight(), ep))
        .map_or_else(Decision::none, |ep| {
            Decision::pick(ep, Reason::LeastConnections)
        })
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Fixture;
    use super::*;

    #[test]
    fn picks_fewest_in_flight_ties_by_index() {
        let f = Fixture::new(&[1, 1, 1]);
        assert_eq!(
            select(&f.cands()),
            Decision::pick(0, Reason::LeastConnections)
        );
        f.set_in_flight(0, 2);
        f.set_in_flight(1, 1);
        f.set_in_flight(2, 1);
        assert_eq!(select(&f.cands()).endpoint, Some(1));
        f.set_healthy(1, false);
        assert_eq!(select(&f.cands()).endpoint, Some(2));
    }

    #[test]
    fn guards_steer_new_requests_to_idle_endpoint() {
        let f = Fixture::new(&[1, 1]);
        let g = f.loads[0].begin();
        assert_eq!(select(&f.cands()).endpoint, Some(1));
        drop(g);
        assert_eq!(select(&f.cands()).endpoint, Some(0));
    }
}
