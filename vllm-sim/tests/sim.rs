//! `vllm-sim` over real HTTP and a real (pyzmq) ZMQ subscriber: OpenAI surface, cached-token
//! accounting, eviction, reset, wire variants, timing model, P/D roles, metrics.

#![allow(clippy::unwrap_used)]

mod sim_common;

use std::time::Duration;

use rmpv::Value as Mp;
use serde_json::{Value, json};
use sim_common::{EVENTS_CFG, Frames, PySub, Sim, decode};

fn ids(range: std::ops::Range<u32>) -> Value {
    json!(range.collect::<Vec<u32>>())
}

async fn complete(sim: &Sim, body: Value) -> Value {
    let (status, resp) = sim.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    resp
}

fn cached(resp: &Value) -> u64 {
    resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// Events of every batch, flattened, as (type, block hashes).
fn events(frames: &[Frames]) -> Vec<(String, Vec<Mp>)> {
    let mut out = Vec::new();
    for f in frames {
        let batch = decode(&f[2]);
        for ev in batch.as_array().unwrap()[1].as_array().unwrap() {
            let m = ev.as_map().unwrap();
            let get = |k: &str| {
                m.iter()
                    .find(|(key, _)| key.as_str() == Some(k))
                    .map(|(_, v)| v)
            };
            let ty = get("type").and_then(Mp::as_str).unwrap().to_string();
            let hashes = get("block_hashes")
                .and_then(Mp::as_array)
                .cloned()
                .unwrap_or_default();
            out.push((ty, hashes));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_count_only_the_leading_run_of_full_blocks() {
    let sim = Sim::start(
        &[
            "--block-size",
            "4",
            "--num-gpu-blocks",
            "64",
            "--time-scale",
            "0.01",
        ],
        &[],
    );
    let first = complete(&sim, json!({"prompt": ids(0..10), "max_tokens": 1})).await;
    assert_eq!(cached(&first), 0);
    assert_eq!(first["usage"]["prompt_tokens"], 10);
    // Same 10 tokens: blocks [0..4) and [4..8) are cached; the tail is computed.
    let again = complete(&sim, json!({"prompt": ids(0..10), "max_tokens": 1})).await;
    assert_eq!(cached(&again), 8);
    // Exactly 8 tokens: vLLM computes at least one token, so only the first block is a hit.
    let exact = complete(&sim, json!({"prompt": ids(0..8), "max_tokens": 1})).await;
    assert_eq!(cached(&exact), 4);
    // Diverging in block 0 hits nothing, even though later blocks are equal.
    let mut other: Vec<u32> = (0..10).collect();
    other[1] = 999;
    let diverged = complete(&sim, json!({"prompt": other, "max_tokens": 1})).await;
    assert_eq!(cached(&diverged), 0);
    // A salt changes block 0's hash and therefore every block after it.
    let salted = complete(
        &sim,
        json!({"prompt": ids(0..10), "max_tokens": 1, "cache_salt": "t"}),
    )
    .await;
    assert_eq!(cached(&salted), 0);
    assert_eq!(sim.metric("vllm:prefix_cache_queries_total").await, 48.0);
    assert_eq!(sim.metric("vllm:prefix_cache_hits_total").await, 12.0);
    assert_eq!(sim.metric("vllm:prompt_tokens_total").await, 48.0);
    assert_eq!(sim.metric("vllm:generation_tokens_total").await, 5.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_reuses_the_least_recently_used_blocks_and_reports_each_on_reuse() {
    // 7 blocks of 4 tokens = 6 usable; an 8-token prompt with max_tokens 1 holds 2 full blocks.
    let args = [
        "--block-size",
        "4",
        "--num-gpu-blocks",
        "7",
        "--time-scale",
        "0.01",
        "--kv-events-config",
        EVENTS_CFG,
    ];
    let sim = Sim::start(&args, &[]);
    let sub = PySub::connect(sim.publisher.as_deref().unwrap(), 2.0);
    for start in [0, 100, 200] {
        // A, B, C fill the cache; freeing emits nothing.
        complete(
            &sim,
            json!({"prompt": ids(start..start + 8), "max_tokens": 1}),
        )
        .await;
    }
    // A is used again (both blocks hit); its third, partial block evicts B's tail block.
    let a = complete(&sim, json!({"prompt": ids(0..9), "max_tokens": 1})).await;
    assert_eq!(cached(&a), 8);
    // D needs two blocks: the free partial block of A (reused first, nothing to report),
    // then B's head block.
    complete(&sim, json!({"prompt": ids(300..308), "max_tokens": 1})).await;
    let again = complete(&sim, json!({"prompt": ids(0..9), "max_tokens": 1})).await;
    assert_eq!(cached(&again), 8, "A, stored first but used last, survives");
    let evs = events(
        &tokio::task::spawn_blocking(move || sub.collect())
            .await
            .unwrap(),
    );
    let stored: Vec<&Vec<Mp>> = evs
        .iter()
        .filter(|(t, _)| t == "BlockStored")
        .map(|(_, h)| h)
        .collect();
    let removed: Vec<Mp> = evs
        .iter()
        .filter(|(t, _)| t == "BlockRemoved")
        .map(|(_, h)| {
            assert_eq!(h.len(), 1, "one block per BlockRemoved");
            h[0].clone()
        })
        .collect();
    let b = stored[1];
    assert_eq!(
        removed[..2],
        [b[1].clone(), b[0].clone()],
        "B evicted, tail block first"
    );
    assert_eq!(
        removed.len(),
        3,
        "the last request reused C's tail block: {removed:?}"
    );
    assert_eq!(removed[2], stored[2][1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_clears_hits_and_all_blocks_cleared_rides_the_next_batch() {
    let args = [
        "--block-size",
        "4",
        "--num-gpu-blocks",
        "64",
        "--time-scale",
        "0.01",
        "--kv-events-config",
        EVENTS_CFG,
    ];
    let sim = Sim::start(&args, &[]);
    let sub = PySub::connect(sim.publisher.as_deref().unwrap(), 2.0);
    complete(&sim, json!({"prompt": ids(0..10), "max_tokens": 1})).await;
    let (status, _) = sim.post("/reset_prefix_cache", &json!({})).await;
    assert_eq!(status, 200);
    let after = complete(&sim, json!({"prompt": ids(0..10), "max_tokens": 1})).await;
    assert_eq!(cached(&after), 0, "reset dropped every cached block");
    let frames = tokio::task::spawn_blocking(move || sub.collect())
        .await
        .unwrap();
    assert_eq!(frames.len(), 2, "no batch of its own for the reset");
    let second = decode(&frames[1][2]);
    let types: Vec<&str> = second.as_array().unwrap()[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_map().unwrap()[0].1.as_str().unwrap())
        .collect();
    assert_eq!(types, ["AllBlocksCleared", "BlockStored"]);
    assert_eq!(frames[1][1], 1u64.to_be_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_hashes_and_legacy_array_events_follow_the_flags() {
    let args = [
        "--block-size",
        "4",
        "--time-scale",
        "0.01",
        "--kv-events-config",
        EVENTS_CFG,
        "--kv-events-legacy-array",
    ];
    let sim = Sim::start(
        &args,
        &[
            ("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0"),
            ("PYTHONHASHSEED", "0"),
        ],
    );
    let sub = PySub::connect(sim.publisher.as_deref().unwrap(), 2.0);
    complete(&sim, json!({"prompt": ids(0..8), "max_tokens": 1})).await;
    let frames = tokio::task::spawn_blocking(move || sub.collect())
        .await
        .unwrap();
    let batch = decode(&frames[0][2]);
    let ev = batch.as_array().unwrap()[1].as_array().unwrap()[0]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(ev[0].as_str(), Some("BlockStored"));
    assert_eq!(
        ev.len(),
        7,
        "[tag, block_hashes, parent, token_ids, block_size, lora_id, medium]"
    );
    let hashes = ev[1].as_array().unwrap();
    assert_eq!(hashes.len(), 2);
    assert!(
        matches!(&hashes[0], Mp::Binary(b) if b.len() == 32),
        "{:?}",
        hashes[0]
    );
    assert_eq!(ev[2], Mp::Nil);
    assert_eq!(ev[4], Mp::from(4));
    assert_eq!(ev[6].as_str(), Some("GPU"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_end_with_done_for_every_api() {
    let sim = Sim::start(&["--time-scale", "0.01"], &[]);
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "hello there", "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true}),
        ),
        (
            "/v1/responses",
            json!({"input": "hi", "max_output_tokens": 3, "stream": true}),
        ),
    ];
    for (path, body) in cases {
        let (status, text) = sim.post_raw(path, &body).await;
        assert_eq!(status, 200, "{path}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{path}: {text}");
        assert!(
            text.contains("\n: vllm-sim ttft_s="),
            "{path}: simulated times comment"
        );
        let deltas = text.matches("\"delta\"").count() + text.matches("\"text\":\" t").count();
        assert!(deltas >= 3, "{path}: three token chunks expected: {text}");
    }
    let body = json!({"prompt": "x y", "max_tokens": 2, "stream": true,
        "stream_options": {"include_usage": true}});
    let (_, text) = sim.post_raw("/v1/completions", &body).await;
    assert!(text.contains("\"completion_tokens\":2"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_apis_return_vllm_shapes_and_respect_max_tokens() {
    let sim = Sim::start(&["--time-scale", "0.01"], &[]);
    let r = complete(
        &sim,
        json!({"model": "tiny", "prompt": "a b c", "max_tokens": 5}),
    )
    .await;
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["usage"]["completion_tokens"], 5);
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    let (s, chat) = sim
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}),
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["usage"]["completion_tokens"], 2);
    assert!(chat["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    let (s, resp) = sim
        .post(
            "/v1/responses",
            &json!({"input": "hi", "max_output_tokens": 4}),
        )
        .await;
    assert_eq!(s, 200);
    assert_eq!(resp["object"], "response");
    assert_eq!(resp["usage"]["output_tokens"], 4);
    let (s, models) = sim.get("/v1/models").await;
    assert_eq!(s, 200);
    assert!(models.contains("\"id\":\"tiny\""), "{models}");
    assert_eq!(sim.get("/health").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_mistakes_are_4xx_naming_the_field() {
    let sim = Sim::start(&["--time-scale", "0.01"], &[]);
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            400,
            "max_tokens",
        ),
        ("/v1/completions", json!({"max_tokens": 3}), 400, "prompt"),
        (
            "/v1/completions",
            json!({"prompt": "x", "model": "nope"}),
            404,
            "nope",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            400,
            "messages",
        ),
        ("/v1/completions", json!({"prompt": [1, -2]}), 400, "prompt"),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream": "yes"}),
            400,
            "stream",
        ),
    ];
    for (path, body, want, field) in cases {
        let (status, resp) = sim.post(path, &body).await;
        assert_eq!(status, want, "{body}: {resp}");
        let msg = resp["error"]["message"].as_str().unwrap();
        assert!(msg.contains(field), "{body}: {msg}");
    }
    let (status, _) = sim
        .post_raw("/v1/completions", &json!("not an object"))
        .await;
    assert_eq!(status, 400);
    assert_eq!(sim.get("/nope").await.0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttft_is_prefill_of_the_uncached_tokens() {
    // Simulated seconds in the histogram: cold 6,600 tokens = 0.2 s at 33,000 tok/s; warm
    // leaves 8 tokens = the 31 ms floor.
    let sim = Sim::start(&["--num-gpu-blocks", "2000", "--time-scale", "0.05"], &[]);
    complete(&sim, json!({"prompt": ids(0..6600), "max_tokens": 1})).await;
    let cold = sim.metric("vllm:time_to_first_token_seconds_sum").await;
    assert!((cold - 0.2).abs() < 0.03, "cold ttft {cold}");
    let warm = complete(&sim, json!({"prompt": ids(0..6600), "max_tokens": 1})).await;
    assert_eq!(cached(&warm), 6592);
    let warm_ttft = sim.metric("vllm:time_to_first_token_seconds_sum").await - cold;
    assert!((warm_ttft - 0.031).abs() < 0.02, "warm ttft {warm_ttft}");
    let (_, text) = sim.get("/metrics").await;
    assert!(
        text.contains("vllm:time_to_first_token_seconds_bucket{"),
        "{text}"
    );
    // The same simulated values per request, in headers.
    let body = json!({"prompt": ids(0..6600), "max_tokens": 3});
    let (_, headers, _) = sim.post_headers("/v1/completions", &body).await;
    let ttft: f64 = headers["x-sim-ttft-s"].to_str().unwrap().parse().unwrap();
    let e2e: f64 = headers["x-sim-e2e-s"].to_str().unwrap().parse().unwrap();
    assert!((ttft - 0.031).abs() < 0.02, "header ttft {ttft}");
    assert!(
        (e2e - ttft - 0.016).abs() < 0.01,
        "two decode steps after the first token: {e2e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_max_num_seqs_wait_in_the_queue() {
    let sim = Sim::start(&["--max-num-seqs", "1", "--time-scale", "1"], &[]);
    let base = sim.base.clone();
    let mut tasks = Vec::new();
    for i in 0..3u32 {
        let body = json!({"prompt": ids(i * 100..i * 100 + 20), "max_tokens": 40});
        let s = Sim::client_for(&base);
        tasks.push(tokio::spawn(async move {
            s.post("/v1/completions", &body).await
        }));
    }
    let mut max_waiting = 0.0f64;
    let mut max_running = 0.0f64;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tokio::time::Instant::now() < deadline && !tasks.iter().all(|t| t.is_finished()) {
        max_waiting = max_waiting.max(sim.metric("vllm:num_requests_waiting").await);
        max_running = max_running.max(sim.metric("vllm:num_requests_running").await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().0, 200);
    }
    assert_eq!(max_running, 1.0);
    assert!(max_waiting >= 1.0, "waiting never rose: {max_waiting}");
    assert_eq!(sim.metric("vllm:num_requests_waiting").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_hands_off_blocks_and_consumer_skips_their_prefill() {
    let producer = Sim::start(
        &[
            "--kv-role",
            "producer",
            "--block-size",
            "16",
            "--time-scale",
            "0.05",
        ],
        &[],
    );
    let prompt = ids(0..3300);
    let body = json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let p = complete(&producer, body).await;
    let kv = &p["kv_transfer_params"];
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(
        kv["remote_block_ids"].as_array().unwrap().len(),
        207,
        "ceil(3301 / 16) blocks"
    );
    assert!(kv["remote_port"].is_u64());

    let args = [
        "--kv-role",
        "consumer",
        "--block-size",
        "16",
        "--time-scale",
        "0.05",
        "--kv-events-config",
        EVENTS_CFG,
    ];
    let consumer = Sim::start(&args, &[]);
    let sub = PySub::connect(consumer.publisher.as_deref().unwrap(), 2.0);
    let body = json!({"prompt": prompt, "max_tokens": 2, "kv_transfer_params": kv});
    complete(&consumer, body).await;
    let ttft = consumer
        .metric("vllm:time_to_first_token_seconds_sum")
        .await;
    assert!(
        ttft < 0.02,
        "no prefill work on the consumer: ttft {ttft} (cold would be 0.1)"
    );
    let evs = events(
        &tokio::task::spawn_blocking(move || sub.collect())
            .await
            .unwrap(),
    );
    let stored: usize = evs
        .iter()
        .filter(|(t, _)| t == "BlockStored")
        .map(|(_, h)| h.len())
        .sum();
    assert_eq!(
        stored, 206,
        "transferred full blocks are cached (and announced) on the consumer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_have_the_vllm_families_and_pass_promtool() {
    let sim = Sim::start(
        &[
            "--num-gpu-blocks",
            "123",
            "--block-size",
            "16",
            "--time-scale",
            "0.01",
        ],
        &[],
    );
    complete(&sim, json!({"prompt": "warm up", "max_tokens": 2})).await;
    let (_, text) = sim.get("/metrics").await;
    for family in [
        "vllm:num_requests_waiting{",
        "vllm:num_requests_running{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prompt_tokens_total{",
        "vllm:generation_tokens_total{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
    ] {
        assert!(text.contains(family), "{family} missing:\n{text}");
    }
    assert!(text.contains("num_gpu_blocks=\"123\""), "{text}");
    assert!(
        !text.contains("# EOF"),
        "Prometheus 0.0.4 text like vLLM, not OpenMetrics"
    );
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let msg = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!msg.contains("error"), "promtool: {msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_frees_its_sequence() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = Sim::start(&["--time-scale", "1"], &[]);
    let addr = sim.base.trim_start_matches("http://").to_string();
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 2000, "stream": true}).to_string();
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let read = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf));
        let n = read.await.unwrap().unwrap();
        assert!(n > 0, "stream closed early");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    assert_eq!(
        sim.metric("vllm:num_requests_running").await,
        1.0,
        "2000 tokens take 16 s"
    );
    drop(conn);
    let freed = sim_common::wait_until_async(Duration::from_secs(3), || async {
        sim.metric("vllm:num_requests_running").await == 0.0
    })
    .await;
    assert!(freed, "the engine aborted the sequence of the gone client");
    assert_eq!(sim.metric("vllm:kv_cache_usage_perc").await, 0.0);
    assert_eq!(
        sim.metric("vllm:request_success_total").await,
        0.0,
        "aborted, not finished"
    );
}
