//! sel 3: persist (session affinity). The key is the session key the proxy extracted per
//! `session_header_name` (a header, `cookie:NAME`, `query:NAME` or `basic-auth`), else the
//! client IP. The key is placed by rendezvous hashing (xxh3, no random seed) over the eligible
//! endpoints' identities: stable across restarts, and an unhealthy owner moves only its own
//! sessions, deterministically.

use super::key::{client_key, hash_str, rendezvous_pick};
use super::state::SelectorState;
use super::{Candidates, Decision, Reason};
use crate::request::RequestMeta;

/// The session's endpoint.
pub fn select(meta: &RequestMeta, cands: &Candidates<'_>, state: &SelectorState) -> Decision {
    let key = match &meta.session_key {
        Some(s) => hash_str(s),
        None => client_key(meta, false),
    };
    let topo = state.topology.load();
    rendezvous_pick(key, &topo.ids, cands.eligible_iter())
        .map_or_else(Decision::none, |ep| Decision::pick(ep, Reason::Persist))
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{Fixture, args};
    use super::*;
    use crate::request::RequestMeta;

    fn extract(header: &str, req: http::Request<()>, client: &str) -> RequestMeta {
        let args = args(serde_json::json!({ "sel": 3, "session_header_name": header }));
        let (parts, ()) = req.into_parts();
        RequestMeta::extract(&parts, b"{}", Some(client.parse().expect("addr")), &args)
    }

    fn req(uri: &str, headers: &[(&str, &str)]) -> http::Request<()> {
        let mut b = http::Request::post(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).expect("request")
    }

    /// For one extraction method: 200 sessions, each sent from 5 different client addresses,
    /// must always reach the same endpoint, and the sessions must use every endpoint.
    fn assert_sticky(header: &str, make: impl Fn(&str) -> http::Request<()>) {
        let f = Fixture::new(&[1, 1, 1]);
        let mut used = [false; 3];
        for s in 0..200 {
            let sid = format!("sess-{s}");
            let owner = select(
                &extract(header, make(&sid), "10.1.1.1:1000"),
                &f.cands(),
                &f.state,
            );
            assert_eq!(owner.reason, Reason::Persist);
            used[owner.endpoint.expect("ep")] = true;
            for c in 0..5 {
                let client = format!("10.9.{c}.{}:{}", s % 200, 2000 + c);
                let again = select(&extract(header, make(&sid), &client), &f.cands(), &f.state);
                assert_eq!(again, owner, "session {sid} via {header} moved");
            }
        }
        assert_eq!(used, [true; 3]);
    }

    #[test]
    fn sticky_by_header() {
        assert_sticky("X-Session-ID", |s| {
            req("/v1/chat/completions", &[("x-session-id", s)])
        });
    }

    #[test]
    fn sticky_by_cookie() {
        assert_sticky("cookie:JSESSIONID", |s| {
            req(
                "/v1/completions",
                &[("cookie", &format!("a=1; JSESSIONID={s}; b=2"))],
            )
        });
    }

    #[test]
    fn sticky_by_query() {
        assert_sticky("query:session_id", |s| {
            req(&format!("/v1/completions?x=1&session_id={s}"), &[])
        });
    }

    #[test]
    fn sticky_by_basic_auth_username() {
        use base64::Engine as _;
        assert_sticky("basic-auth", |s| {
            // Same user, a different password each time: the username is the key.
            let cred =
                base64::engine::general_purpose::STANDARD.encode(format!("{s}:pw-{}", s.len()));
            req(
                "/v1/completions",
                &[("authorization", &format!("Basic {cred}"))],
            )
        });
    }

    #[test]
    fn empty_header_name_sticks_by_client_ip() {
        let f = Fixture::new(&[1, 1, 1]);
        let a = select(
            &extract("", req("/", &[]), "10.2.3.4:1111"),
            &f.cands(),
            &f.state,
        );
        let b = select(
            &extract("", req("/", &[]), "10.2.3.4:2222"),
            &f.cands(),
            &f.state,
        );
        assert_eq!(a, b);
    }

    #[test]
    fn stable_across_restarts() {
        // Pinned once from the algorithm: rendezvous of xxh3(session key) over the identities
        // of 127.0.0.1:9000..9002. A fresh fixture (a restarted daemon) must agree.
        let f = Fixture::new(&[1, 1, 1]);
        let got: Vec<_> = EXPECTED
            .iter()
            .map(|(k, _)| {
                let m = RequestMeta {
                    session_key: Some((*k).into()),
                    ..Default::default()
                };
                select(&m, &f.cands(), &f.state).endpoint.expect("ep")
            })
            .collect();
        assert_eq!(got, EXPECTED.iter().map(|e| e.1).collect::<Vec<_>>());
    }
    const EXPECTED: [(&str, usize); 6] = [
        ("user-42", 0),
        ("user-43", 0),
        ("alice", 2),
        ("bob", 0),
        ("JSESSIONID-1", 2),
        ("", 1),
    ];

    #[test]
    fn unhealthy_owner_moves_only_its_sessions() {
        let f = Fixture::new(&[1, 1, 1]);
        let m = |s: usize| RequestMeta {
            session_key: Some(format!("s{s}")),
            ..Default::default()
        };
        let before: Vec<_> = (0..300)
            .map(|s| select(&m(s), &f.cands(), &f.state))
            .collect();
        f.set_healthy(1, false);
        for (s, b) in before.iter().enumerate() {
            let after = select(&m(s), &f.cands(), &f.state);
            if b.endpoint != Some(1) {
                assert_eq!(after, *b);
            } else {
                assert_ne!(after.endpoint, Some(1));
            }
        }
    }
}
