use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::kv::ingest::events::decode_batch;
use crate::kv::settings::KvSettings;
use crate::kv::testutil::{rule, state, stored_batch};

/// Serves `router(state)` on an OS-chosen loopback port, with an empty rule snapshot.
async fn serve(state: Arc<KvState>) -> std::net::SocketAddr {
    serve_with_rules(state, RuleSnapshot::default()).await
}

/// Serves `router(state)` with `rules` as the rule store's current snapshot.
async fn serve_with_rules(state: Arc<KvState>, rules: RuleSnapshot) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, rx) = watch::channel(Arc::new(rules));
    tokio::spawn(async move {
        let _keep = tx;
        axum::serve(l, router(state, rx)).await
    });
    addr
}

async fn get_json(addr: std::net::SocketAddr, path: &str) -> (u16, serde_json::Value) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: loxi\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.expect("read");
    let status = raw[9..12].parse().expect("status");
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or_default();
    (
        status,
        serde_json::from_str(body).unwrap_or_else(|e| panic!("json body {body:?}: {e}")),
    )
}

/// The API's error body (`crate::api::error`) for `code`, `message` and the field at fault.
fn api_error(code: u16, message: &str, field: Option<&str>) -> serde_json::Value {
    let mut v = serde_json::json!({
        "code": code, "fields": field.map(|f| [f]), "message": message, "result": message
    });
    if let Some(f) = field {
        v["field"] = f.into();
    }
    v
}

fn populated() -> Arc<KvState> {
    let (st, _reg) = state(KvSettings::default());
    let svc = st
        .service(&rule(4, 2, serde_json::json!({})))
        .expect("kv rule");
    let b = decode_batch(&stored_batch(&[11, u64::MAX], 16)).expect("decode");
    svc.apply_batch(1, 0, &b, &st.metrics);
    svc.set_connected(1, 0, true);
    svc.streams.lock().entry((1, 0)).or_default().last_seq = Some(7);
    let bad = decode_batch(&stored_batch(&[5], 768)).expect("decode");
    svc.apply_batch(0, 0, &bad, &st.metrics);
    st
}

#[tokio::test]
async fn inventory_lists_blocks_connection_and_last_seq_per_endpoint() {
    let addr = serve(populated()).await;
    let (code, v) = get_json(
        addr,
        "/netlox/v1/config/ai/kv/inventory?service_id=4&ep_idx=1",
    )
    .await;
    assert_eq!(code, 200);
    let ep = &v["endpoints"][0];
    assert_eq!(
        (
            ep["epIdx"].as_u64(),
            ep["blockCount"].as_u64(),
            ep["connected"].as_bool()
        ),
        (Some(1), Some(2), Some(true))
    );
    assert_eq!(ep["ranks"][0]["lastSeq"].as_u64(), Some(7));
    assert_eq!(ep["hashes"], serde_json::json!([11, u64::MAX]));
    assert_eq!(v["endpoints"].as_array().map(Vec::len), Some(1));
    // LoxiLB's keys beside loxi's view.
    assert_eq!(
        (
            v["service_id"].clone(),
            v["ep_idx"].clone(),
            v["total"].clone()
        ),
        (
            serde_json::json!(4),
            serde_json::json!(1),
            serde_json::json!(2)
        )
    );
    assert_eq!(
        v["blocks"],
        serde_json::json!([{"block_idx": 0, "hash_uint64": 11}, {"block_idx": 1, "hash_uint64": u64::MAX}])
    );
    assert!(v["hash_algo"].is_string(), "{v}");
    let (_, all) = get_json(addr, "/netlox/v1/config/ai/kv/inventory?service_id=4").await;
    assert_eq!(all["endpoints"].as_array().map(Vec::len), Some(2));
    assert!(
        all.get("blocks").is_none(),
        "LoxiLB's keys only with ep_idx: {all}"
    );
}

/// Block lists are paged (`offset`, `limit` ≤ `INVENTORY_LIMIT`): `total` and `blockCount`
/// still count every block held.
#[tokio::test]
async fn inventory_pages_the_block_list() {
    let (st, _reg) = state(KvSettings::default());
    let svc = st
        .service(&rule(4, 1, serde_json::json!({})))
        .expect("kv rule");
    let b = decode_batch(&stored_batch(&[21, 22, 23, 24, 25], 16)).expect("decode");
    svc.apply_batch(0, 0, &b, &st.metrics);
    let addr = serve(st).await;
    let path = "/netlox/v1/config/ai/kv/inventory?service_id=4&ep_idx=0";
    let (code, v) = get_json(addr, &format!("{path}&offset=1&limit=2")).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        v["blocks"],
        serde_json::json!([{"block_idx": 1, "hash_uint64": 22}, {"block_idx": 2, "hash_uint64": 23}])
    );
    assert_eq!(v["endpoints"][0]["hashes"], serde_json::json!([22, 23]));
    assert_eq!(
        (
            v["total"].as_u64(),
            v["offset"].as_u64(),
            v["limit"].as_u64()
        ),
        (Some(5), Some(1), Some(2))
    );
    assert_eq!(v["endpoints"][0]["blockCount"].as_u64(), Some(5));
    let (_, all) = get_json(addr, path).await;
    assert_eq!(all["limit"].as_u64(), Some(INVENTORY_LIMIT as u64));
    assert_eq!(all["blocks"].as_array().map(Vec::len), Some(5));
    let over = INVENTORY_LIMIT + 1;
    let (code, e) = get_json(addr, &format!("{path}&limit={over}")).await;
    assert_eq!(code, 400, "{e}");
    assert_eq!(e["field"], "limit");
}

#[tokio::test]
async fn a_rule_in_the_store_is_visible_before_the_subscriber_manager_applied_it() {
    // The daemon answered the POST; the manager has not run yet: no KV state at all.
    let (st, _reg) = state(KvSettings::default());
    let stored = rule(1, 2, serde_json::json!({}));
    let off = rule(2, 1, serde_json::json!({"kvExactMode": 0, "port": 8081}));
    let mut snap = RuleSnapshot::default();
    snap.rules.insert(stored.rule.key(), Arc::new(stored));
    snap.rules.insert(off.rule.key(), Arc::new(off));
    assert!(st.get(1).is_none());
    let addr = serve_with_rules(st.clone(), snap).await;
    let (code, v) = get_json(
        addr,
        "/netlox/v1/config/ai/kv/inventory?service_id=1&ep_idx=1",
    )
    .await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        (
            v["service_id"].clone(),
            v["ep_idx"].clone(),
            v["total"].clone()
        ),
        (
            serde_json::json!(1),
            serde_json::json!(1),
            serde_json::json!(0)
        )
    );
    assert_eq!(v["hash_algo"], "sha256_cbor");
    let (code, v) = get_json(addr, "/netlox/v1/config/ai/kv/parity?service_id=1").await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["endpoints"].as_array().map(Vec::len), Some(2), "{v}");
    assert!(st.get(1).is_some(), "the view applied the stored rule");
    // A stored rule with tier 1.5 off has no KV view.
    let (code, _) = get_json(addr, "/netlox/v1/config/ai/kv/inventory?service_id=2").await;
    assert_eq!(code, 404);
    assert!(st.get(2).is_none());
}

/// Each `(path, status, message, field)` answers `status` with the API's error body.
async fn assert_api_errors(addr: std::net::SocketAddr, cases: &[(&str, u16, &str, Option<&str>)]) {
    for &(path, status, message, field) in cases {
        let (code, v) = get_json(addr, path).await;
        assert_eq!(code, status, "{path}");
        assert_eq!(v, api_error(status, message, field), "{path}");
    }
}

#[tokio::test]
async fn inventory_errors_name_the_field() {
    let addr = serve(populated()).await;
    assert_api_errors(
        addr,
        &[
            (
                "/netlox/v1/config/ai/kv/inventory",
                400,
                "query field `service_id` is required",
                Some("service_id"),
            ),
            (
                "/netlox/v1/config/ai/kv/inventory?service_id=4&ep_idx=x",
                400,
                "query field `ep_idx`: \"x\" is not a non-negative integer",
                Some("ep_idx"),
            ),
            (
                "/netlox/v1/config/ai/kv/inventory?service_id=99",
                404,
                "service_id 99: no KV state (unknown rule or kvExactMode 0); a rule's id is its \
                 `serviceId` in `loxicmd get lb -o json` (GET /netlox/v1/config/loadbalancer/all)",
                None,
            ),
            (
                "/netlox/v1/config/ai/kv/inventory?service_id=4&ep_idx=2",
                404,
                "ep_idx 2: the rule has 2 endpoints",
                None,
            ),
            // A typo and a repeat: they answered the unfiltered view / the last value's.
            (
                "/netlox/v1/config/ai/kv/inventory?service_id=4&ep_id=0",
                400,
                "\"ep_id\" is not a query parameter of this route (service_id, ep_idx, offset, \
                 limit)",
                Some("ep_id"),
            ),
            (
                "/netlox/v1/config/ai/kv/inventory?service_id=99&service_id=4",
                400,
                "query field `service_id` is given twice; give it once",
                Some("service_id"),
            ),
            (
                "/netlox/v1/config/ai/kv/parity?service_id=4&verbose=1",
                400,
                "\"verbose\" is not a query parameter of this route (service_id)",
                Some("verbose"),
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn parity_errors_have_the_api_error_shape() {
    let addr = serve(populated()).await;
    assert_api_errors(
        addr,
        &[
            (
                "/netlox/v1/config/ai/kv/parity?service_id=-1",
                400,
                "query field `service_id`: \"-1\" is not a non-negative integer",
                Some("service_id"),
            ),
            (
                "/netlox/v1/config/ai/kv/parity",
                400,
                "query field `service_id` is required",
                Some("service_id"),
            ),
        ],
    )
    .await;
    let (code, v) = get_json(addr, "/netlox/v1/config/ai/kv/parity?service_id=99").await;
    assert_eq!(code, 404);
    assert_eq!(
        (v["code"].as_u64(), v.get("error")),
        (Some(404), None),
        "{v}"
    );
    assert_eq!(v["message"], v["result"]);
}

#[tokio::test]
async fn parity_report_shows_block_size_mismatch() {
    let addr = serve(populated()).await;
    let (code, v) = get_json(addr, "/netlox/v1/config/ai/kv/parity?service_id=4").await;
    assert_eq!(code, 200);
    assert_eq!(
        (v["kvHashAlgo"].as_str(), v["kvBlockSize"].as_u64()),
        (Some("sha256_cbor"), Some(16))
    );
    let ep0 = &v["endpoints"][0];
    assert_eq!(
        (
            ep0["epIdx"].as_u64(),
            ep0["block_size_rejects"].as_u64(),
            ep0["engine_block_size"].as_u64()
        ),
        (Some(0), Some(1), Some(768))
    );
    assert_eq!(ep0["verdict"].as_str(), Some("unknown"));
    // Every endpoint of the rule is listed with its readiness state.
    let states: Vec<(Option<&str>, Option<&str>)> = v["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .map(|e| (e["state"].as_str(), e["leg"].as_str()))
        .collect();
    assert_eq!(
        states,
        vec![
            (Some("mismatch"), Some("block_size")),
            (Some("events_no_tokens"), None)
        ]
    );
}

/// A P/D rule in exact mode 1: the report lists the decode endpoints (not followed by tier
/// 1.5) as `not_subscribed`, the prefill endpoint as `no_events`, then `syncing` while its
/// stream catches up from the replay socket.
#[tokio::test]
async fn parity_report_lists_decode_endpoints_not_subscribed_and_a_catching_up_one_syncing() {
    let (st, _reg) = state(KvSettings::default());
    let svc = st
        .service(&rule(
            5,
            3,
            serde_json::json!({"kvExactMode": 1, "pd_disagg_mode": true, "ep_roles": [0, 1, 2]}),
        ))
        .expect("kv rule");
    let addr = serve(st.clone()).await;
    let states = |v: &serde_json::Value| -> Vec<String> {
        v["endpoints"]
            .as_array()
            .expect("endpoints")
            .iter()
            .map(|e| e["state"].as_str().expect("state").to_owned())
            .collect()
    };
    let (code, v) = get_json(addr, "/netlox/v1/config/ai/kv/parity?service_id=5").await;
    assert_eq!(code, 200);
    assert_eq!(
        states(&v),
        vec!["not_subscribed", "no_events", "not_subscribed"]
    );
    svc.set_syncing(1, 0, true);
    let (_, v) = get_json(addr, "/netlox/v1/config/ai/kv/parity?service_id=5").await;
    assert_eq!(
        states(&v),
        vec!["not_subscribed", "syncing", "not_subscribed"]
    );
    assert!(
        v["endpoints"][1]["remedy"]
            .as_str()
            .is_some_and(|r| r.contains("replay socket")),
        "{v}"
    );
}
