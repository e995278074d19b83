//! Issue 12 §2: several engines on one host. vLLM binds its KV-event publisher on a port of its
//! own host, so engines sharing an address need one port each: an endpoint's own `kvZmqPort`
//! overrides the rule's. Three real `vllm-sim` engines on 127.0.0.1 publish on three distinct
//! ports; the rule's own `kvZmqPort` has no publisher at all. Each engine's blocks must reach
//! its own endpoint's inventory, and requests must follow them.

use std::time::{Duration, Instant};

use loxi_tests::harness::free_port;
use loxi_tests::kv::{completion, kv_daemon, series, stage_tiny_tokenizer, wait_blocks};
use serde_json::{Value, json};

const BS: usize = 16;

/// `vllm-sim` serving `tiny` on 127.0.0.1 (HTTP port chosen by the OS), publishing KV events on
/// `tcp://127.0.0.1:zmq` with the golden capture's hash seed and block size 16.
async fn engine(tok: &std::path::Path, zmq: u16) -> loxi_tests::sim::Sim {
    let mut cmd = loxi_tests::sim::Sim::command();
    let cfg = json!({"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://127.0.0.1:{zmq}")});
    cmd.args(["--model", "tiny", "--host", "127.0.0.1", "--port", "0"])
        .arg("--tokenizer-dir")
        .arg(tok)
        .env("PYTHONHASHSEED", "0")
        .args(["--block-size", &BS.to_string()])
        .args(["--kv-events-config", &cfg.to_string()])
        .args(["--time-scale", "0.05"]);
    loxi_tests::sim::Sim::spawn(cmd).await
}

/// A completion of the token ids `from..from+4·BS` plus one (exactly 4 full blocks to cache)
/// sent to `to`: its status, the endpoint that served it and the prompt.
async fn four_blocks(to: std::net::SocketAddr, from: u32) -> (u16, Option<usize>, Vec<u32>) {
    let mut ids: Vec<u32> = (from..from + 4 * BS as u32).collect();
    ids.push(7);
    let (code, ep) = completion(
        to,
        &json!({"model": "tiny", "prompt": ids, "max_tokens": 1}),
    )
    .await;
    (code, ep, ids)
}

/// [`four_blocks`] straight to an engine (not through loxi): the engine caches and publishes
/// exactly 4 full blocks.
async fn warm(engine: &loxi_tests::sim::Sim, from: u32) -> Vec<u32> {
    let (code, _, ids) = four_blocks(engine.addr, from).await;
    assert_eq!(code, 200);
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_on_one_address_publish_on_their_own_ports() {
    let tok = tempfile::tempdir().expect("tmp");
    stage_tiny_tokenizer(tok.path());
    let zmq: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut engines = Vec::new();
    for z in &zmq {
        engines.push(engine(tok.path(), *z).await);
    }
    let d = kv_daemon(tok.path()).await;
    let vip_port = free_port();
    let eps: Vec<Value> = engines
        .iter()
        .zip(&zmq)
        .map(|(e, z)| json!({"endpointIP": "127.0.0.1", "targetPort": e.port(), "kvZmqPort": z}))
        .collect();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": vip_port, "protocol": "tcp",
            "mode": 4, "sel": 0, "kvExactMode": 3, "kvBlockSize": BS,
            "kvHashAlgo": "sha256_cbor", "kvZmqPort": free_port()},
        "endpoints": eps,
    });
    let (code, body) = d.post_rule(&rule).await;
    assert_eq!(code, 200, "{body}");

    // Read back: each endpoint keeps its own port.
    let all = d.rules().await;
    let back: Vec<Value> = all["lbAttr"][0]["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .map(|e| e["kvZmqPort"].clone())
        .collect();
    assert_eq!(back, zmq.iter().map(|z| json!(z)).collect::<Vec<_>>());

    // All three subscribers connect (each to its own engine's port).
    all_connected(&d, 3).await;

    // Engine i caches its own prefix; its 4 blocks land on endpoint i only.
    let mut prompts = Vec::new();
    for (i, e) in engines.iter().enumerate() {
        prompts.push(warm(e, 1000 * (i as u32 + 1)).await);
        wait_blocks(&d, 1, i, 4).await;
    }
    for i in 0..3 {
        wait_blocks(&d, 1, i, 4).await;
    }

    // Through the VIP, each prefix goes to the engine holding it.
    let vip = std::net::SocketAddr::from(([127, 0, 0, 1], vip_port));
    for (i, ids) in prompts.iter().enumerate() {
        let (code, ep) = completion(
            vip,
            &json!({"model": "tiny", "prompt": ids, "max_tokens": 1}),
        )
        .await;
        assert_eq!((code, ep), (200, Some(i)), "prefix of engine {i}");
    }
    let m = d.metrics_text().await;
    for i in 0..3 {
        assert_eq!(
            series(
                &m,
                &format!("loxilb_pd_kv_tier15_hits_total{{service=\"1\",ep_idx=\"{i}\"}}")
            ),
            Some(1.0),
            "one hit on endpoint {i}: {m}"
        );
    }

    // Moving an endpoint to another publisher port is a new source: its inventory starts
    // afresh, the others keep theirs.
    let mut moved = rule.clone();
    moved["endpoints"][2]["kvZmqPort"] = json!(free_port());
    let (code, body) = d.post_rule(&moved).await;
    assert_eq!(code, 200, "{body}");
    wait_blocks(&d, 1, 2, 0).await;
    wait_blocks(&d, 1, 0, 4).await;
    wait_blocks(&d, 1, 1, 4).await;
}

/// The parity report's `(state, remedy)` of every endpoint of rule 1.
async fn readiness(d: &loxi_tests::harness::Daemon) -> Vec<(String, String)> {
    let (code, body) = d
        .get("/netlox/v1/config/ai/kv/parity?service_id=1")
        .await
        .expect("parity");
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("parity json");
    v["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .map(|e| {
            (
                e["state"].as_str().unwrap_or("").to_owned(),
                e["remedy"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

/// Waits (15 s at most) until rule 1's first `n` event subscribers are connected, then for
/// the subscriptions to reach the publishers.
async fn all_connected(d: &loxi_tests::harness::Daemon, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let m = d.metrics_text().await;
        let up = (0..n)
            .filter(|i| {
                series(
                    &m,
                    &format!("loxilb_kv_subscriber_connected{{service=\"1\",ep=\"{i}\"}}"),
                ) == Some(1.0)
            })
            .count();
        if up == n {
            break;
        }
        assert!(Instant::now() < deadline, "subscribers not connected: {m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // ZeroMQ's subscription reaches a publisher a moment after the connection.
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// Sends `n` new prompts (4 full blocks of distinct token ids each, from `from` on) through the
/// VIP; returns how many went to each of the two endpoints.
async fn new_prompts(vip: std::net::SocketAddr, from: u32, n: u32) -> [u32; 2] {
    let mut per = [0; 2];
    for i in 0..n {
        let (code, ep, _) = four_blocks(vip, from + i * 1000).await;
        assert_eq!(code, 200);
        per[ep.expect("x-loxilb-endpoint")] += 1;
        // Each placement's blocks are published before the next prompt is placed.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    per
}

/// Two engines whose `kvZmqPort`s are swapped in the rule: every hash is right (parity `ok`),
/// but each engine's blocks are filed under the other endpoint. The crossed-stream check finds
/// it from the new prompts placed on them: readiness `crossed`, with a remedy naming the other
/// endpoint's port, and neither inventory is used (no hit counted, new prompts spread).
/// Posting the rule with the right ports starts both inventories afresh, and new prompts then
/// land where they were placed: `ok`. An engine then stopped reads `disconnected`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapped_event_ports_read_crossed_until_fixed() {
    let tok = tempfile::tempdir().expect("tmp");
    stage_tiny_tokenizer(tok.path());
    let zmq: Vec<u16> = (0..2).map(|_| free_port()).collect();
    let mut engines = Vec::new();
    for z in &zmq {
        engines.push(engine(tok.path(), *z).await);
    }
    let d = kv_daemon(tok.path()).await;
    let vip_port = free_port();
    let rule_with = |ports: [u16; 2]| {
        json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": vip_port, "protocol": "tcp",
                "mode": 4, "sel": 0, "kvExactMode": 3, "kvBlockSize": BS,
                "kvHashAlgo": "sha256_cbor"},
            "endpoints": [
                {"endpointIP": "127.0.0.1", "targetPort": engines[0].port(), "kvZmqPort": ports[0]},
                {"endpointIP": "127.0.0.1", "targetPort": engines[1].port(), "kvZmqPort": ports[1]},
            ],
        })
    };
    let (code, body) = d.post_rule(&rule_with([zmq[1], zmq[0]])).await;
    assert_eq!(code, 200, "{body}");
    all_connected(&d, 2).await;
    let vip = std::net::SocketAddr::from(([127, 0, 0, 1], vip_port));

    // With every placement's blocks filed under the other endpoint, endpoint 0 looks the
    // emptiest cache and cold placement sends it every new prompt.
    let per = new_prompts(vip, 10_000, 8).await;
    assert!(per.iter().any(|n| *n >= 3), "placements {per:?}");
    // Once 3 of an endpoint's placements were published on the other's stream, it reads
    // `crossed`, naming that stream; the other endpoint reads `crossed` too: from its own
    // placements when it had 3, else as the stream carrying the first one's blocks.
    let deadline = Instant::now() + Duration::from_secs(15);
    let states = loop {
        let states = readiness(&d).await;
        if states.iter().all(|s| s.0 == "crossed") || Instant::now() > deadline {
            break states;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for i in 0..2 {
        let other = 1 - i;
        // Endpoint i's kvZmqPort is zmq[other], the port of engine `other`.
        let (own, others) = (zmq[other], zmq[i]);
        assert_eq!(states[i].0, "crossed", "placements {per:?}: {states:?}");
        let text = &states[i].1;
        let named = if per[i] >= 3 {
            text.contains(&format!(
                "published on the event stream of endpoint {other} (127.0.0.1:{}, kvZmqPort {others})",
                engines[other].port()
            )) && text.contains(&format!("none on its own (kvZmqPort {own})"))
        } else {
            text.contains(&format!(
                "its event stream (kvZmqPort {own}) carries the first blocks of"
            )) && text.contains(&format!("sent to endpoint {other} (127.0.0.1:"))
        };
        assert!(named, "endpoint {i}, placements {per:?}: {states:?}");
    }
    let m = d.metrics_text().await;
    for i in 0..2 {
        assert_eq!(
            series(
                &m,
                &format!(
                    "loxilb_kv_endpoint_readiness{{service=\"1\",ep_idx=\"{i}\",state=\"crossed\"}}"
                )
            ),
            Some(1.0),
            "{m}"
        );
    }
    // The probes behind the verdict are counted: strays only, no landing.
    let probes = |outcome: &str| -> f64 {
        (0..2)
            .map(|i| {
                series(
                    &m,
                    &format!(
                        "loxilb_kv_cross_probes_total{{service=\"1\",ep_idx=\"{i}\",outcome=\"{outcome}\"}}"
                    ),
                )
                .unwrap_or(0.0)
            })
            .sum()
    };
    assert!(
        probes("strayed") >= 3.0 && probes("landed") == 0.0,
        "strayed {}, landed {}: {m}",
        probes("strayed"),
        probes("landed")
    );
    assert!(
        d.log_text().contains("state=\"crossed\""),
        "the change is logged"
    );

    // Neither inventory is used any more: repeats of the first prompts (filed under the wrong
    // endpoint) count no tier-1.5 hit, and new prompts are spread over both engines.
    let hits = |m: &str| -> f64 {
        (0..2)
            .map(|i| {
                series(
                    m,
                    &format!("loxilb_pd_kv_tier15_hits_total{{service=\"1\",ep_idx=\"{i}\"}}"),
                )
                .unwrap_or(0.0)
            })
            .sum()
    };
    let before = hits(&m);
    new_prompts(vip, 10_000, 4).await;
    let spread = new_prompts(vip, 30_000, 4).await;
    assert_eq!(
        hits(&d.metrics_text().await),
        before,
        "no hit counted on a crossed stream"
    );
    assert!(
        spread.iter().all(|n| *n > 0),
        "new prompts spread: {spread:?}"
    );

    // Fixed: each endpoint on its own engine's port.
    let (code, body) = d.post_rule(&rule_with([zmq[0], zmq[1]])).await;
    assert_eq!(code, 200, "{body}");
    all_connected(&d, 2).await;
    let per = new_prompts(vip, 50_000, 6).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let states = readiness(&d).await;
        let ok = (0..2).all(|i| {
            if per[i] > 0 {
                states[i].0 == "ok"
            } else {
                states[i].0 != "crossed"
            }
        });
        if ok {
            break;
        }
        assert!(Instant::now() < deadline, "placements {per:?}: {states:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // An engine that stops after publishing: its endpoint reads `disconnected`, naming its
    // event socket (readiness said `ok` while its stream was down).
    let gone = if per[1] > 0 { 1 } else { 0 };
    engines.remove(gone).kill().await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let states = readiness(&d).await;
        if states[gone].0 == "disconnected" {
            assert!(
                states[gone].1.starts_with(&format!(
                    "its event stream tcp://127.0.0.1:{} is down",
                    zmq[gone]
                )),
                "{states:?}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "{states:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
