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

fn state(store: Arc<RuleStore>) -> ApiState {
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
