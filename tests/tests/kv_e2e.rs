//! End-to-end tier 1.5: the real `loxilb` daemon, two real HTTP backends, and two real libzmq
//! KV-event publishers (`tests/py/kv_pub.py`, pyzmq) standing in for the backends' engines.
//!
//! Endpoint 0 is 127.0.0.1 and endpoint 1 is 127.0.0.2 (both loopback), so both publishers can
//! use the rule's single `kvZmqPort`. The engine events are the ones a real vLLM published for
//! the same prompt (`golden/vllm_kv_events_capture.json` frame 0: `tiny` model, block size 32,
//! `sha256_cbor`, `PYTHONHASHSEED=0`), so routing depends on bit-exact hashing of loxi's own
//! tokenization. Predicted blocks are turned off (`LOXI_KV_PREDICT_TTL_MS=0`) so only the
//! engine's events can make the warm request stick.
//!
//! Scenario 15 (`../shared/cases/routing-scenarios.md`) runs four endpoints, 127.0.0.1 to
//! 127.0.0.4, with a publisher each. There is no capture of its chat conversations, so the
//! engine side of its events (token ids of the rendered chat template, block keys) is computed
//! with loxi's tokenizer pool and hasher, whose parity with vLLM the `kv_golden` tests check;
//! the parity report confirming the events is asserted too.

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use loxi_tests::backend::Backend;
use loxi_tests::harness::free_port;
use loxi_tests::kv::{completion, kv_daemon, series, stage_tiny_tokenizer, wait_blocks};
use loxi_tests::kv_pub::{Publisher, block_stored_batch};
use loxi_tests::shared_dir;
use loxi_user::kv::BlockKey;
use loxi_user::kv::block_hash::{BlockHasher, HashAlgo, RequestExtras};
use loxi_user::kv::tokenizer::{TokenizerMetrics, TokenizerPool};
use loxi_user::request::{ApiKind, ChatMessage, Prompt};
use serde_json::{Value, json};

fn capture() -> Value {
    let p = shared_dir().join("golden/vllm_kv_events_capture.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("capture json")
}

async fn complete(vip: SocketAddr, prompt: &str) -> (u16, Option<usize>) {
    completion(
        vip,
        &json!({"model": "tiny", "prompt": prompt, "max_tokens": 2}),
    )
    .await
}

fn metric(text: &str, s: &str) -> f64 {
    series(text, s).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_request_goes_to_endpoint_whose_engine_published_the_prefix() {
    let cap = capture();
    let tok_dir = tempfile::tempdir().expect("tmp");
    stage_tiny_tokenizer(tok_dir.path());
    let d = kv_daemon(tok_dir.path()).await;

    let b0 = Backend::start("b0").await;
    let b1 = Backend::bind("b1", SocketAddr::from(([127, 0, 0, 2], 0)))
        .await
        .expect("bind 127.0.0.2");
    let zmq_port = free_port();
    let mut pubs = [
        Publisher::start("127.0.0.1", zmq_port).await,
        Publisher::start("127.0.0.2", zmq_port).await,
    ];

    let vip_port = free_port();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": vip_port, "protocol": "tcp", "mode": 4, "sel": 0,
            "kvExactMode": 3, "kvBlockSize": 32, "kvHashAlgo": "sha256_cbor", "kvZmqPort": zmq_port},
        "endpoints": [
            {"endpointIP": "127.0.0.1", "targetPort": b0.port()},
            {"endpointIP": "127.0.0.2", "targetPort": b1.port()}
        ]
    });
    let (code, body) = d.post_rule(&rule).await;
    assert!(code == 200 || code == 201, "rule rejected: {code} {body}");
    for p in pubs.iter_mut() {
        p.wait_for("subscribed").await;
    }
    let vip = SocketAddr::from(([127, 0, 0, 1], vip_port));

    let cold_prompt = cap["requests"][0]["request_body"]["prompt"]
        .as_str()
        .expect("prompt 0");
    let (code, cold_ep) = complete(vip, cold_prompt).await;
    assert_eq!(code, 200);
    let cold_ep = cold_ep.expect("x-loxilb-endpoint on the cold response");
    let m = d.metrics_text().await;
    // Nothing is indexed: a cold placement (the default `LOXI_KV_COLD_PLACEMENT=least-work`),
    // not a `no_worker` miss.
    assert_eq!(
        metric(
            &m,
            &format!(
                "loxilb_pd_kv_tier15_cold_placements_total{{service=\"1\",ep_idx=\"{cold_ep}\"}}"
            )
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "loxilb_pd_kv_tier15_miss_reason_total{service=\"1\",reason=\"no_worker\"}"
        ),
        0.0
    );

    // The engine behind the cold request's endpoint stores its blocks (what vLLM published).
    pubs[cold_ep].raw(&cap["frames"][0]["parts_hex"]).await;
    wait_blocks(&d, 1, cold_ep, 7).await;

    let hits = format!("loxilb_pd_kv_tier15_hits_total{{service=\"1\",ep_idx=\"{cold_ep}\"}}");
    let before = metric(&d.metrics_text().await, &hits);
    let warm_prompt = cap["requests"][1]["request_body"]["prompt"]
        .as_str()
        .expect("prompt 1");
    let (code, warm_ep) = complete(vip, warm_prompt).await;
    assert_eq!(code, 200);
    assert_eq!(
        warm_ep,
        Some(cold_ep),
        "warm request must follow the cached prefix"
    );
    let after = metric(&d.metrics_text().await, &hits);
    assert_eq!(after - before, 1.0);
    let other = format!(
        "loxilb_pd_kv_tier15_hits_total{{service=\"1\",ep_idx=\"{}\"}}",
        1 - cold_ep
    );
    assert_eq!(metric(&d.metrics_text().await, &other), 0.0);

    // A rule update that changes only `kvWarmupSec` applies to the running window and keeps
    // the inventory: 30 s (started at the first subscriber's connect, a second ago) keeps
    // tier 1.5 out (miss `warmup`); back to 0, the warm request hits its holder again, from
    // the blocks published before both updates (engines publish a block once: a rebuilt
    // inventory would stay empty).
    let warmup_miss = "loxilb_pd_kv_tier15_miss_reason_total{service=\"1\",reason=\"warmup\"}";
    for (warmup, want_miss, want_hit) in [(30, 1.0, 0.0), (0, 0.0, 1.0)] {
        let mut updated = rule.clone();
        updated["serviceArguments"]["kvWarmupSec"] = json!(warmup);
        let (code, body) = d.post_rule(&updated).await;
        assert!(code == 200 || code == 201, "update refused: {code} {body}");
        let m0 = d.metrics_text().await;
        let (code, ep) = complete(vip, warm_prompt).await;
        assert_eq!(code, 200);
        let m1 = d.metrics_text().await;
        let d_miss = metric(&m1, warmup_miss) - metric(&m0, warmup_miss);
        let d_hit = metric(&m1, &hits) - metric(&m0, &hits);
        assert_eq!(
            (d_miss, d_hit),
            (want_miss, want_hit),
            "kvWarmupSec {warmup}"
        );
        if want_hit > 0.0 {
            assert_eq!(ep, Some(cold_ep), "the holder, from the kept inventory");
        }
        // The parity report shows the window.
        let (code, text) = d
            .get("/netlox/v1/config/ai/kv/parity?service_id=1")
            .await
            .expect("parity");
        assert_eq!(code, 200, "{text}");
        let w: Value = serde_json::from_str::<Value>(&text).expect("json")["warmup"].clone();
        assert_eq!(w["sec"], json!(f64::from(warmup)), "{w}");
        if warmup == 0 {
            assert_eq!(w["state"], "off", "{w}");
        } else {
            assert_eq!(w["state"], "running", "{w}");
            let left = w["leftSec"].as_f64().expect("leftSec");
            assert!(left > 20.0 && left <= 30.0, "{w}");
        }
    }
    drop((b0, b1));
}

/// Scenario 15's conversations: the same system prompt and the same opening exchange for all
/// (so a router that reads only the first messages sees one conversation eight times), then a
/// history of its own. This is the prompt of the turn a worker already served.
fn conversation(i: usize) -> Vec<ChatMessage> {
    let msg = |role: &str, content: &str| ChatMessage {
        role: role.into(),
        content: content.into(),
    };
    let system = "You are the support assistant of a parcel carrier. Answer in two sentences, \
        quote the tracking number, use metric units and never promise a delivery time you \
        cannot see in the tracking data. "
        .repeat(2);
    let hub = [
        "Antwerp", "Basel", "Cork", "Dresden", "Essen", "Faro", "Graz", "Hull",
    ][i];
    let own = format!(
        "It is TRK-{}. It has not moved since Monday at the {hub} hub, the box weighs {} kg \
         and it was declared as spare parts for a {hub} garage.",
        4000 + 37 * i,
        3 + i
    );
    vec![
        msg("system", &system),
        msg("user", "Hello, my parcel is late. Can you check it?"),
        msg("assistant", "Of course. What is the tracking number?"),
        msg("user", &own),
    ]
}

/// `conversation(i)` one turn later: what the client sends next.
fn next_turn(i: usize) -> Vec<ChatMessage> {
    let mut m = conversation(i);
    m.push(ChatMessage {
        role: "assistant".into(),
        content: format!("An invoice and the EORI number of customer {i}."),
    });
    m.push(ChatMessage {
        role: "user".into(),
        content: "Where do I upload them?".into(),
    });
    m
}

/// Leading blocks two key lists share.
fn shared_prefix(a: &[BlockKey], b: &[BlockKey]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

async fn chat_completion(
    vip: SocketAddr,
    messages: &[ChatMessage],
) -> (u16, Option<usize>, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let msgs: Vec<Value> = messages
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    let body = json!({"model": "tiny", "messages": msgs, "max_tokens": 2}).to_string();
    let req = http::Request::post(format!("http://{vip}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let resp = client.request(req).await.expect("proxy answered");
    let h = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    let ep = h("x-loxilb-endpoint").and_then(|v| v.parse().ok());
    let backend = h("x-backend").unwrap_or_default();
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    (status, ep, backend)
}

/// Scenario 15: eight chat conversations share one system prompt (their first message is
/// identical) but not their histories. Worker k's engine holds the prompt blocks of
/// conversations k and k + 4 (published by a real pyzmq publisher, as vLLM would: the second
/// conversation's event stores only the blocks after the shared prefix, chained to its parent).
/// Each conversation's next turn must go to the worker holding its whole history, not
/// collapse onto whichever worker matches the shared first message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_15_chat_conversations_sharing_a_system_prompt_spread_by_full_history() {
    const BS: usize = 16;
    let tok_dir = tempfile::tempdir().expect("tmp");
    stage_tiny_tokenizer(tok_dir.path());
    // The engine side: vLLM's chat tokenization (template + generation prompt) and hashing.
    let pool = TokenizerPool::new(tok_dir.path().to_path_buf(), TokenizerMetrics::default());
    let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"));
    let ids = |m: Vec<ChatMessage>| -> Vec<u32> {
        let p = Prompt::Messages(m);
        pool.encode("tiny", ApiKind::ChatCompletions, &p, None)
            .expect("tokenize")
            .to_vec()
    };
    let keys = |ids: &[u32]| hasher.keys(ids, BS, &RequestExtras::default());
    let held_ids: Vec<Vec<u32>> = (0..8).map(|i| ids(conversation(i))).collect();
    let held: Vec<Vec<BlockKey>> = held_ids.iter().map(|t| keys(t)).collect();
    let next: Vec<Vec<BlockKey>> = (0..8).map(|i| keys(&ids(next_turn(i)))).collect();
    for i in 0..8 {
        let own = shared_prefix(&next[i], &held[i]);
        assert_eq!(
            own,
            held[i].len(),
            "conversation {i}: next turn extends its history"
        );
        for j in (0..8).filter(|&j| j != i) {
            let other = shared_prefix(&next[i], &held[j]);
            assert!(
                other >= 4,
                "{i} vs {j}: the shared opening fills {other} blocks"
            );
            assert!(
                own >= other + 2,
                "{i} vs {j}: history decides ({own} vs {other})"
            );
        }
    }

    let d = kv_daemon(tok_dir.path()).await;
    let zmq_port = free_port();
    let mut backends = Vec::new();
    let mut pubs = Vec::new();
    for k in 0..4u8 {
        let ip = [127, 0, 0, k + 1];
        let b = Backend::bind(&format!("b{k}"), SocketAddr::from((ip, 0))).await;
        backends.push(b.expect("bind backend"));
        pubs.push(Publisher::start(&format!("127.0.0.{}", k + 1), zmq_port).await);
    }
    let vip_port = free_port();
    let eps: Vec<Value> = backends
        .iter()
        .map(|b| json!({"endpointIP": b.addr.ip().to_string(), "targetPort": b.port()}))
        .collect();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": vip_port, "protocol": "tcp", "mode": 4, "sel": 0,
            "kvExactMode": 3, "kvBlockSize": BS, "kvHashAlgo": "sha256_cbor", "kvZmqPort": zmq_port},
        "endpoints": eps,
    });
    let (code, body) = d.post_rule(&rule).await;
    assert!(code == 200 || code == 201, "rule rejected: {code} {body}");
    for (k, p) in pubs.iter_mut().enumerate() {
        p.wait_for("subscribed").await;
        let (a, b) = (k, k + 4);
        let raw = |v: &[BlockKey]| v.iter().map(|x| x.0).collect::<Vec<u64>>();
        let full = |i: usize, from: usize| &held_ids[i][from * BS..held[i].len() * BS];
        p.send(&block_stored_batch(
            &raw(&held[a]),
            None,
            full(a, 0),
            BS as u32,
        ))
        .await;
        let s = shared_prefix(&held[a], &held[b]);
        let parent = Some(held[b][s - 1].0);
        p.send(&block_stored_batch(
            &raw(&held[b][s..]),
            parent,
            full(b, s),
            BS as u32,
        ))
        .await;
        wait_blocks(&d, 1, k, (held[a].len() + held[b].len() - s) as u64).await;
    }
    // The events are consistent with their token ids: loxi's parity check agrees with them.
    let (code, parity) = d
        .get("/netlox/v1/config/ai/kv/parity?service_id=1")
        .await
        .expect("parity");
    let parity: Value = serde_json::from_str(&parity).expect("parity json");
    let verdicts: Vec<&Value> = parity["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .map(|e| &e["verdict"])
        .collect();
    assert_eq!((code, verdicts), (200, vec![&json!("ok"); 4]), "{parity}");

    let vip = SocketAddr::from(([127, 0, 0, 1], vip_port));
    let before = d.metrics_text().await;
    let mut chosen = Vec::new();
    for i in 0..8 {
        let (code, ep, backend) = chat_completion(vip, &next_turn(i)).await;
        assert_eq!(code, 200, "conversation {i}");
        let ep = ep.expect("x-loxilb-endpoint");
        assert_eq!(backend, format!("b{ep}"), "the named endpoint answered");
        chosen.push(ep);
    }
    assert_eq!(chosen, [0, 1, 2, 3, 0, 1, 2, 3], "each history's worker");
    let after = d.metrics_text().await;
    let delta = |s: &str| metric(&after, s) - metric(&before, s);
    let overlap = "loxilb_proxy_selections_total{selector=\"kv\",reason=\"kv_overlap\"}";
    assert_eq!(delta(overlap), 8.0, "all eight chosen by KV overlap");
    for k in 0..4 {
        let hits = format!("loxilb_pd_kv_tier15_hits_total{{service=\"1\",ep_idx=\"{k}\"}}");
        assert_eq!(delta(&hits), 2.0, "worker {k}");
    }
}
