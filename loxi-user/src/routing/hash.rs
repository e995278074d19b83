//! sel 1: client-address hash. The key is the client's socket address (IP and port, the
//! userspace view of LoxiLB's tuple hash), placed by rendezvous hashing over eligible endpoints,
//! so a connection keeps its endpoint and an unhealthy endpoint moves only its own keys.

use super::key::{client_key, rendezvous_pick};
use super::state::SelectorState;
use super::{Candidates, Decision, Reason};
use crate::request::RequestMeta;

/// The endpoint owning the client's address.
pub fn select(meta: &RequestMeta, cands: &Candidates<'_>, state: &SelectorState) -> Decision {
    let topo = state.topology.load();
    rendezvous_pick(client_key(meta, true), &topo.ids, cands.eligible_iter())
        .map_or_else(Decision::none, |ep| Decision::pick(ep, Reason::Hash))
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Fixture;
    use super::*;

    fn meta(addr: &str) -> RequestMeta {
        RequestMeta {
            client: Some(addr.parse().expect("addr")),
            ..Default::default()
        }
    }

    #[test]
    fn same_client_address_same_endpoint() {
        let f = Fixture::new(&[1, 1, 1, 1]);
        let first = select(&meta("192.0.2.7:40000"), &f.cands(), &f.state);
        for _ in 0..20 {
            assert_eq!(
                select(&meta("192.0.2.7:40000"), &f.cands(), &f.state),
                first
            );
        }
        assert_eq!(first.reason, Reason::Hash);
    }

    #[test]
    fn stable_across_restarts() {
        // Computed once from the algorithm (xxh3 of the client address, rendezvous over the
        // identities of 127.0.0.1:9000..9003) and pinned: a fresh state must agree.
        let f = Fixture::new(&[1, 1, 1, 1]);
        let got: Vec<_> = EXPECTED
            .iter()
            .map(|(a, _)| select(&meta(a), &f.cands(), &f.state).endpoint.expect("ep"))
            .collect();
        assert_eq!(got, EXPECTED.iter().map(|e| e.1).collect::<Vec<_>>());
    }
    const EXPECTED: [(&str, usize); 6] = [
        ("192.0.2.7:40000", 0),
        ("192.0.2.7:40001", 3),
        ("192.0.2.8:40000", 2),
        ("10.0.0.1:1", 2),
        ("[2001:db8::1]:443", 1),
        ("172.16.0.9:65535", 2),
    ];

    #[test]
    fn clients_spread_over_endpoints() {
        let f = Fixture::new(&[1, 1, 1, 1]);
        let mut counts = [0; 4];
        for port in 0..4000u16 {
            let ep = select(
                &meta(&format!("192.0.2.7:{}", 20000 + port)),
                &f.cands(),
                &f.state,
            );
            counts[ep.endpoint.expect("ep")] += 1;
        }
        assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
    }
}
