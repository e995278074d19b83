//! Issue 12 §1: a fleet change keeps the KV inventory. The real `loxilb` daemon, real HTTP
//! backends on 127.0.0.1-3 and a real pyzmq publisher per endpoint (the rule's one
//! `kvZmqPort` on each address). Engines never re-announce blocks they hold, so a re-POST of the
//! rule that adds, removes or reorders endpoints must keep every other endpoint's inventory
//! (and route on it), must not re-subscribe the endpoints that stayed, and must leave no
//! per-position series that names another endpoint; deleting the rule leaves no series of it.

use std::net::SocketAddr;

use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, free_port};
use loxi_tests::kv::{completion, kv_daemon, series, stage_tiny_tokenizer, wait_blocks};
use loxi_tests::kv_pub::{Publisher, block_stored_batch};
use loxi_user::kv::block_hash::{BlockHasher, HashAlgo, RequestExtras};
use serde_json::{Value, json};

const BS: usize = 16;

/// Token ids `from..from + blocks·BS` and their block keys (vLLM's `sha256_cbor`, seed 0).
fn prefix(from: u32, blocks: usize) -> (Vec<u32>, Vec<u64>) {
    let ids: Vec<u32> = (from..from + (blocks * BS) as u32).collect();
    let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"));
    let keys = hasher.keys(&ids, BS, &RequestExtras::default());
    (ids, keys.iter().map(|k| k.0).collect())
}

fn rule(vip_port: u16, zmq_port: u16, eps: &[&Backend]) -> Value {
    let eps: Vec<Value> = eps
        .iter()
        .map(|b| json!({"endpointIP": b.addr.ip().to_string(), "targetPort": b.port()}))
        .collect();
    json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": vip_port, "protocol": "tcp",
            "mode": 4, "sel": 0, "kvExactMode": 3, "kvBlockSize": BS, "kvHashAlgo": "sha256_cbor",
            "kvZmqPort": zmq_port},
        "endpoints": eps,
    })
}

async fn post(d: &Daemon, rule: &Value) {
    let (code, body) = d.post_rule(rule).await;
    assert!(code == 200 || code == 201, "rule rejected: {code} {body}");
}

/// A completion of token-id prompt `ids` plus one more token (so every full block is a prefix
/// block of the request): the endpoint index it went to.
async fn route(vip: SocketAddr, ids: &[u32]) -> usize {
    let mut prompt = ids.to_vec();
    prompt.push(7);
    let (code, ep) = completion(
        vip,
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(code, 200);
    ep.expect("x-loxilb-endpoint")
}

fn blocks_series(ep: usize) -> String {
    format!("loxilb_pd_kv_blocks{{service=\"1\",ep_idx=\"{ep}\"}}")
}

fn hits_series(ep: usize) -> String {
    format!("loxilb_pd_kv_tier15_hits_total{{service=\"1\",ep_idx=\"{ep}\"}}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_removing_and_reordering_endpoints_keeps_the_others_inventory() {
    let tok_dir = tempfile::tempdir().expect("tmp");
    stage_tiny_tokenizer(tok_dir.path());
    let d = kv_daemon(tok_dir.path()).await;
    let zmq_port = free_port();
    let mut backends = Vec::new();
    let mut pubs = Vec::new();
    for k in 1..=3u8 {
        let b = Backend::bind(&format!("b{k}"), SocketAddr::from(([127, 0, 0, k], 0))).await;
        backends.push(b.expect("bind backend"));
        pubs.push(Publisher::start(&format!("127.0.0.{k}"), zmq_port).await);
    }
    let (a, b, c) = (&backends[0], &backends[1], &backends[2]);
    let vip_port = free_port();
    let vip = SocketAddr::from(([127, 0, 0, 1], vip_port));

    // Two endpoints; a's engine holds prefix A (3 blocks), b's prefix B (5 blocks).
    post(&d, &rule(vip_port, zmq_port, &[a, b])).await;
    let (ids_a, keys_a) = prefix(1000, 3);
    let (ids_b, keys_b) = prefix(5000, 5);
    pubs[0].wait_for("subscribed").await;
    pubs[1].wait_for("subscribed").await;
    pubs[0]
        .send(&block_stored_batch(&keys_a, None, &ids_a, BS as u32))
        .await;
    pubs[1]
        .send(&block_stored_batch(&keys_b, None, &ids_b, BS as u32))
        .await;
    wait_blocks(&d, 1, 0, 3).await;
    wait_blocks(&d, 1, 1, 5).await;
    assert_eq!(route(vip, &ids_b).await, 1, "B is cached on b");
    let m = d.metrics_text().await;
    assert_eq!(series(&m, &hits_series(1)), Some(1.0));

    // Add c: a and b keep their blocks, c starts empty, routing still follows B to b.
    post(&d, &rule(vip_port, zmq_port, &[a, b, c])).await;
    pubs[2].wait_for("subscribed").await;
    wait_blocks(&d, 1, 0, 3).await;
    wait_blocks(&d, 1, 1, 5).await;
    wait_blocks(&d, 1, 2, 0).await;
    assert_eq!(route(vip, &ids_b).await, 1);
    assert_eq!(route(vip, &ids_a).await, 0);
    let m = d.metrics_text().await;
    assert_eq!(series(&m, &blocks_series(1)), Some(5.0));
    assert_eq!(
        series(&m, &hits_series(1)),
        Some(2.0),
        "b kept its position"
    );

    // Remove a: b moves to position 0 with its 5 blocks, c to 1. No series at a position names
    // the endpoint that sat there before: b's hits under ep_idx 1 are gone, a's under 0 too.
    post(&d, &rule(vip_port, zmq_port, &[b, c])).await;
    wait_blocks(&d, 1, 0, 5).await;
    wait_blocks(&d, 1, 1, 0).await;
    let m = d.metrics_text().await;
    assert_eq!(series(&m, &blocks_series(0)), Some(5.0));
    assert_eq!(series(&m, &blocks_series(1)), Some(0.0));
    assert_eq!(
        series(&m, &blocks_series(2)),
        None,
        "no series for a third endpoint"
    );
    assert_eq!(
        series(&m, &hits_series(0)),
        None,
        "a's hit count is not b's"
    );
    assert_eq!(
        series(&m, &hits_series(1)),
        None,
        "b's hit count is not c's"
    );
    assert_eq!(route(vip, &ids_b).await, 0, "B still routes to b, now at 0");
    let m = d.metrics_text().await;
    assert_eq!(series(&m, &hits_series(0)), Some(1.0));

    // Reorder: c first. b keeps its blocks at position 1 and its event stream: a new batch
    // from b's engine lands on b.
    post(&d, &rule(vip_port, zmq_port, &[c, b])).await;
    wait_blocks(&d, 1, 1, 5).await;
    wait_blocks(&d, 1, 0, 0).await;
    let (ids_b2, keys_b2) = prefix(9000, 2);
    pubs[1]
        .send(&block_stored_batch(&keys_b2, None, &ids_b2, BS as u32))
        .await;
    wait_blocks(&d, 1, 1, 7).await;
    assert_eq!(route(vip, &ids_b).await, 1);
    // b's subscriber was never restarted by the three updates: one connection, no reconnect.
    let m = d.metrics_text().await;
    assert_eq!(
        series(
            &m,
            "loxilb_kv_subscriber_reconnect_total{service=\"1\",ep=\"1\"}"
        ),
        None
    );
    assert_eq!(
        series(&m, "loxilb_kv_subscriber_connected{service=\"1\",ep=\"1\"}"),
        Some(1.0)
    );

    // Delete the rule: no KV series of service 1 remains in the scrape (the stopping streams
    // record nothing more).
    let (code, body) = d.delete_rule("127.0.0.1", vip_port, "tcp", None).await;
    assert_eq!(code, 200, "{body}");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let m = d.metrics_text().await;
    let left: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("loxilb_pd_kv_") || l.starts_with("loxilb_kv_"))
        .filter(|l| l.contains("service=\"1\""))
        .collect();
    assert!(left.is_empty(), "KV series of the deleted rule: {left:?}");
}
