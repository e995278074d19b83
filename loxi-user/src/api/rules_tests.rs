//! The rule handlers against a real store, with data-path followers driven by the test.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use prometheus_client::registry::Registry;
use serde_json::json;

use super::*;
use crate::metrics::ControlMetrics;
use crate::rules::RuleStore;

/// An API state over `store`, with fresh metrics, an in-memory certificate store and no L4
/// data path (also the cert API tests').
pub(crate) fn state(store: Arc<RuleStore>) -> ApiState {
    let mut registry = Registry::default();
    let metrics = ControlMetrics::register(&mut registry);
    let listen = crate::listen::ListenMetrics::register(&mut registry);
    ApiState {
        store,
        registry: Arc::new(registry),
        metrics,
        health: crate::health::board::HealthBoard::new(),
        sockets: crate::listen::ListenSockets::new(listen),
        l4_datapath: false,
        conntrack: crate::l4::ConntrackHandle::default(),
        certs: Arc::new(crate::certs::CertStore::in_memory()),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A write is acknowledged only once every data path has marked its snapshot: a `POST` (and a
/// `DELETE`) waits for the slowest follower, and answers as soon as it marks.
#[tokio::test]
async fn a_write_is_acknowledged_once_every_data_path_applied_it() {
    let store = Arc::new(RuleStore::in_memory());
    let fast = store.follower("fast");
    let slow = store.follower("slow");
    let st = state(store.clone());
    let port = free_port();
    let body = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4},
        "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8000}]
    });
    let post = tokio::spawn(create(
        State(st.clone()),
        NoQuery,
        Ok(Bytes::from(body.to_string())),
    ));
    // Stored and published at once; not acknowledged while `slow` has not applied it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while store.snapshot().version < 2 {
        assert!(tokio::time::Instant::now() < deadline, "never stored");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    fast.mark(2);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !post.is_finished(),
        "acknowledged before every data path applied the rule"
    );
    slow.mark(2);
    assert_eq!(answer(post).await, StatusCode::OK);

    let del = tokio::spawn(remove(
        State(st),
        Path(("127.0.0.1".into(), port.to_string(), "tcp".into())),
        OnceQuery(HashMap::new()),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!del.is_finished(), "a delete waits too");
    assert!(
        store.snapshot().rules.is_empty(),
        "deleted before it is acknowledged"
    );
    fast.mark(3);
    slow.mark(3);
    assert_eq!(answer(del).await, StatusCode::OK);
}

/// The status of a handler run on its own task, which must end within 2 s.
async fn answer(task: tokio::task::JoinHandle<Result<Response, ApiError>>) -> StatusCode {
    match tokio::time::timeout(Duration::from_secs(2), task).await {
        Ok(Ok(Ok(resp))) => resp.status(),
        Ok(Ok(Err(e))) => panic!("refused: {e:?}"),
        Ok(Err(e)) => panic!("handler task: {e}"),
        Err(_) => panic!("not acknowledged within 2 s of the last mark"),
    }
}

/// The L4 data path's rule slots are checked before a rule is stored: the rule past
/// `MAX_RULES` is refused with 400 and not stored, an update of a stored L4 rule and a mode-4
/// rule still pass, and a freed slot takes a new rule again.
#[tokio::test]
async fn an_l4_rule_past_the_data_paths_rule_slots_is_refused() {
    use loxi_common::maps::MAX_RULES;
    let store = Arc::new(RuleStore::in_memory());
    let mut st = state(store.clone());
    st.l4_datapath = true;
    let l4 = |i: u32, port: u16| {
        json!({
            "serviceArguments": {"externalIP": format!("20.1.{}.{}", i / 250, i % 250 + 1),
                "port": port, "protocol": "tcp", "mode": 0},
            "endpoints": [{"endpointIP": "10.9.0.2", "targetPort": 8080}]
        })
    };
    let post = |body: serde_json::Value| {
        create(
            State(st.clone()),
            NoQuery,
            Ok(Bytes::from(body.to_string())),
        )
    };
    for i in 0..MAX_RULES {
        store
            .upsert(serde_json::from_value(l4(i, 80)).expect("rule"))
            .expect("stored");
    }
    let refused = post(l4(MAX_RULES, 80)).await.expect_err("past the slots");
    let text = format!("{refused:?}");
    assert!(
        text.contains("at most 256 rules") && text.contains("256 are stored"),
        "{text}"
    );
    assert_eq!(
        store.snapshot().rules.len(),
        MAX_RULES as usize,
        "nothing stored"
    );
    // An update of a stored rule keeps its slot; a mode-4 rule takes none.
    let mut update = l4(0, 80);
    update["endpoints"][0]["targetPort"] = json!(9090);
    assert_eq!(answer(tokio::spawn(post(update))).await, StatusCode::OK);
    let fp = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": free_port(), "protocol": "tcp", "mode": 4},
        "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8000}]
    });
    assert_eq!(answer(tokio::spawn(post(fp))).await, StatusCode::OK);
    store.delete("20.1.0.1", 80, "tcp", "", "").expect("delete");
    assert_eq!(
        answer(tokio::spawn(post(l4(MAX_RULES, 80)))).await,
        StatusCode::OK
    );
}

/// A TLS rule posted without a certificate is refused quoting the `security` it was posted
/// with (2 was once answered as "1 (TLS) needs a certificate"), saying which values loxi
/// serves; nothing is stored.
#[tokio::test]
async fn a_tls_rule_without_a_certificate_is_refused_quoting_its_own_security() {
    let store = Arc::new(RuleStore::in_memory());
    let st = state(store.clone());
    for (security, says) in [
        (1, "security: 1 (TLS terminated here) needs a certificate"),
        (
            2,
            "security: 2 (TLS terminated here, re-encrypted to the endpoints) needs a certificate",
        ),
    ] {
        let body = json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": free_port(),
                "protocol": "tcp", "mode": 4, "security": security},
            "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8443}]
        });
        let e = create(
            State(st.clone()),
            NoQuery,
            Ok(Bytes::from(body.to_string())),
        )
        .await
        .expect_err("no certificate");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.field.as_deref(), Some("serviceArguments.security"));
        assert!(e.message.contains(says), "{}", e.message);
        assert!(
            e.message.contains(
                "loxi serves security 0 (plain), 1 (TLS terminated here) and 2 (TLS \
                 terminated here, re-encrypted to the endpoints)"
            ),
            "{}",
            e.message
        );
        if security == 2 {
            assert!(!e.message.contains("security: 1"), "{}", e.message);
        }
        assert!(store.snapshot().rules.is_empty(), "nothing stored");
    }
}

/// A TLS rule `security` (1 or 2) on a free loopback port with `host` (none when empty).
fn tls_rule(security: u8, host: &str) -> serde_json::Value {
    let mut s = json!({"externalIP": "127.0.0.1", "port": free_port(), "protocol": "tcp",
        "mode": 4, "security": security});
    if !host.is_empty() {
        s["host"] = json!(host);
    }
    json!({"serviceArguments": s, "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8443}]})
}

/// The refusal of a TLS rule `body` (400 naming `serviceArguments.security`): its message.
async fn refusal(st: &ApiState, body: &serde_json::Value) -> String {
    let e = create(
        State(st.clone()),
        NoQuery,
        Ok(Bytes::from(body.to_string())),
    )
    .await
    .expect_err("refused");
    assert_eq!(e.status, StatusCode::BAD_REQUEST, "{}", e.message);
    assert_eq!(e.field.as_deref(), Some("serviceArguments.security"));
    e.message
}

/// The loxicmd upload of a certificate file pair, as the refusals spell it.
const CREATE_CERT: &str =
    "loxicmd create cert --cert-file CERT.pem --key-file KEY.pem [--chain-file CHAIN.pem]";

/// A refused TLS rule says the loxicmd command that uploads the certificate it needs: for a
/// host-less rule (security 2 too) the `default` one, `--cert-id default`; for a host, one whose
/// subjectAltName names it, any id. Doing what it says makes the same rule accepted.
#[tokio::test]
async fn a_refused_tls_rule_says_the_loxicmd_command_that_uploads_its_certificate() {
    use crate::certs::testutil::{dns, with_sans};
    let store = Arc::new(RuleStore::in_memory());
    let st = state(store.clone());
    let hostless = tls_rule(2, "");
    let m = refusal(&st, &hostless).await;
    assert!(
        m.contains(&format!(
            "needs a certificate: a rule without host serves the `default` certificate, and \
             there is none; upload one with the id `default`: `{CREATE_CERT} --cert-id default` \
             (or POST /netlox/v1/config/cert with \"certId\":\"default\"); nothing was stored"
        )),
        "{m}"
    );
    let named = tls_rule(1, "api.example.com");
    let m = refusal(&st, &named).await;
    assert!(
        m.contains(&format!(
            "needs a certificate: no certificate covers host \"api.example.com\" and there is no \
             `default` one; upload one whose subjectAltName has DNS:api.example.com (or \
             DNS:*.example.com): `{CREATE_CERT} [--cert-id ID]` (or POST \
             /netlox/v1/config/cert); nothing was stored"
        )),
        "{m}"
    );
    // As told: a certificate for another name with the id `default` serves the host-less rule
    // but not the named one; one naming the host (any id) serves it.
    st.certs
        .create(
            Some("default".into()),
            with_sans(vec![dns("lb.example")], None),
        )
        .expect("default");
    for ok in [&hostless] {
        let post = create(State(st.clone()), NoQuery, Ok(Bytes::from(ok.to_string())));
        assert_eq!(answer(tokio::spawn(post)).await, StatusCode::OK);
    }
    assert!(refusal(&st, &named).await.contains("DNS:api.example.com"));
    st.certs
        .create(None, with_sans(vec![dns("api.example.com")], None))
        .expect("named");
    let post = create(State(st), NoQuery, Ok(Bytes::from(named.to_string())));
    assert_eq!(answer(tokio::spawn(post)).await, StatusCode::OK);
}

/// A TLS rule whose host is an IP address is covered only by the `default` certificate having
/// that address as a SAN IP address: clients send no SNI for an address, so `default` is what
/// they get, and they check the address against IP SANs only. A DNS SAN spelled like the
/// address (accepted before), or the address on another certificate, is refused saying so,
/// with the command (or call) that fixes it.
#[tokio::test]
async fn an_ip_host_needs_the_default_certificate_with_that_ip_address() {
    use crate::certs::testutil::{dns, ip, with_sans};
    let store = Arc::new(RuleStore::in_memory());
    let st = state(store.clone());
    let rule = tls_rule(1, "10.0.0.5");
    st.certs
        .create(
            Some("spelled".into()),
            with_sans(vec![dns("10.0.0.5")], None),
        )
        .expect("a DNS name spelled like the address");
    let m = refusal(&st, &rule).await;
    assert!(
        m.contains(&format!(
            "needs a certificate: host \"10.0.0.5\" is an IP address: clients connecting to an IP \
             address send no SNI and get the `default` certificate, and there is no `default` \
             one; upload one whose subjectAltName has IP:10.0.0.5 with the id `default`: \
             `{CREATE_CERT} --cert-id default` (or POST /netlox/v1/config/cert with \
             \"certId\":\"default\"); nothing was stored"
        )),
        "{m}"
    );
    st.certs
        .create(Some("vip".into()), with_sans(vec![ip("10.0.0.5")], None))
        .expect("the address, not default");
    let m = refusal(&st, &rule).await;
    assert!(
        m.contains(
            "; certificate \"vip\" has IP:10.0.0.5 but is not `default`, so no client gets it; "
        ),
        "{m}"
    );
    st.certs
        .create(
            Some("default".into()),
            with_sans(vec![dns("10.0.0.5")], Some("10.0.0.5")),
        )
        .expect("default, the address as a DNS name");
    let m = refusal(&st, &rule).await;
    assert!(
        m.contains(
            "get the `default` certificate, whose names [\"10.0.0.5\"] include no IP address (a \
             DNS name spelled like an address does not count: clients check an IP host against \
             the IP addresses only)"
        ) && m.contains(
            "rotate `default` to a certificate whose subjectAltName also has IP:10.0.0.5: PUT \
             /netlox/v1/config/cert/default with {\"certPem\", \"keyPem\", \"chainPem\"?} \
             (`loxicmd create cert` refuses an id in use)"
        ),
        "{m}"
    );
    assert!(store.snapshot().rules.is_empty(), "nothing stored");
    st.certs
        .replace(
            "default",
            with_sans(vec![dns("lb.example"), ip("10.0.0.5")], None),
            |_, _| Ok(()),
        )
        .expect("rotated");
    let post = create(State(st), NoQuery, Ok(Bytes::from(rule.to_string())));
    assert_eq!(answer(tokio::spawn(post)).await, StatusCode::OK);
}

/// A TLS rule's `POST` racing the `DELETE` of the only certificate for its host: never both
/// succeed (both did, leaving the rule stored with no certificate: the delete's check read the
/// rules before the rule was stored, the rule's check read the certificate before it was
/// deleted). Each round runs the two concurrently on a multi-threaded runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_rule_and_the_delete_of_its_certificate_are_never_both_accepted() {
    let st = state(Arc::new(RuleStore::in_memory()));
    for round in 0..400 {
        let (id, host) = (format!("c{round}"), format!("h{round}.example"));
        st.certs
            .create(
                Some(id.clone()),
                crate::certs::testutil::self_signed(&[&host], None),
            )
            .expect("certificate");
        let body = Bytes::from(tls_rule(1, &host).to_string());
        let post = tokio::spawn(create(State(st.clone()), NoQuery, Ok(body)));
        let delete = tokio::spawn(super::super::certs::remove(
            State(st.clone()),
            axum::extract::Path(id.clone()),
            NoQuery,
        ));
        let posted = post.await.expect("join").is_ok();
        let deleted = delete.await.expect("join").is_ok();
        assert!(
            !(posted && deleted),
            "round {round}: the rule for {host} was stored and its only certificate deleted"
        );
        assert!(posted || deleted, "round {round}: one of them succeeds");
    }
}
