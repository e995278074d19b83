//! The `work` blend law (issue 13) through a real `loxilb`: a request's uncached prompt tokens
//! count as its endpoint's queued prefill work from dispatch until its response starts, and
//! the law weighs that work against what a cached prefix saves. Two real HTTP backends behind a
//! `kvExactMode: 3` rule over the tiny model's tokenizer (block 32); holdings come from the
//! tier's predicted blocks (no engine events), cold seeding off, `LOXILB_KV_WORK_REQUEST_TOKENS`
//! 0 so that only prefill work and overlap decide.
//!
//! A long prompt `A = S + tail` is held on its endpoint for 1.5 s (`x-delay-ms`); a second
//! prompt `B = S + other tail` then shares only `S` (2–3 blocks) with it. Under `work` the
//! holder's queued prefill (all of `A`, ~600 tokens) costs more than `S` saves, so `B` spills
//! to the idle endpoint; under `hard` (cap 2 at one request in flight) it stays on the holder.
//! Once `A` has answered its work is released: a third prompt `C = S + tail` finds both
//! endpoints holding `S`, idle, and goes to the lower index (it would go to the other
//! endpoint if `A`'s work had leaked).

use std::net::SocketAddr;
use std::time::Duration;

use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, DaemonOpts};
use loxi_tests::http::{client, full, metric, send};
use loxi_tests::kv::stage_tiny_tokenizer;
use serde_json::json;

/// `S`: the shared prefix, then `n` words `tag0 tag1 …` of its own.
fn prompt(tag: &str, n: usize) -> String {
    let shared: String = (0..40).map(|i| format!("s{i} ")).collect();
    let tail: String = (0..n).map(|i| format!("{tag}{i} ")).collect();
    format!("shared system prompt {shared}{tail}")
}

/// A completion through `vip`, held `delay_ms` by the backend: the endpoint index answered.
async fn complete(vip: SocketAddr, text: String, delay_ms: u64) -> usize {
    let body = json!({"model": "tiny", "prompt": text, "max_tokens": 2}).to_string();
    let req = http::Request::post(format!("http://{vip}/v1/completions"))
        .header("content-type", "application/json")
        .header("x-delay-ms", delay_ms.to_string())
        .body(full(body))
        .expect("request");
    let r = send(&client(), req).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.header("x-loxilb-endpoint")
        .and_then(|v| v.parse().ok())
        .expect("x-loxilb-endpoint")
}

/// Runs the scenario under `law` (`None`: unset, i.e. `hard`) with the daemon environment
/// `extra`: the endpoints of `A`, `B`, `C` and the daemon's metrics text at the end.
async fn scenario(law: Option<&str>, extra: &[(&str, &str)]) -> ([usize; 3], String) {
    let backends = [Backend::start("0").await, Backend::start("1").await];
    let tok = tempfile::tempdir().expect("tmp");
    stage_tiny_tokenizer(tok.path());
    let mut opts = DaemonOpts {
        tokenizer_dir: Some(tok.path().to_path_buf()),
        ..Default::default()
    }
    .env("LLB_KV_NONE_HASH_SEED", "0")
    .env("LOXILB_KV_COLDSTART_SEED_N", "0")
    .env("LOXILB_KV_WORK_REQUEST_TOKENS", "0");
    if let Some(law) = law {
        opts = opts.env("LOXILB_KV_LB_MODE", law);
    }
    for (k, v) in extra {
        opts = opts.env(k, v);
    }
    let d = Daemon::start(opts).await;
    let vip = d
        .post_kv_pool_rule(&backends.iter().map(Backend::port).collect::<Vec<_>>())
        .await;

    // A: nobody holds anything yet (a cold placement: every endpoint idle and empty, the
    // lowest index).
    let a = tokio::spawn(complete(vip, prompt("a", 300), 1500));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while backends.iter().map(Backend::request_count).sum::<usize>() == 0 {
        assert!(std::time::Instant::now() < deadline, "A never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // B while A is in flight (its response 1.5 s away).
    let b = complete(vip, prompt("b", 30), 0).await;
    let a = a.await.expect("A");
    // C once both answered.
    let c = complete(vip, prompt("c", 30), 0).await;
    let m = d.metrics_text().await;
    ([a, b, c], m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_law_spills_past_queued_prefill_and_releases_it_when_the_response_starts() {
    let ([a, b, c], m) = scenario(Some("work"), &[]).await;
    assert_eq!(a, 0, "cold placement's first pick");
    assert_eq!(
        b, 1,
        "B spills: A's queued prefill outweighs the shared prefix"
    );
    let spills = metric(&m, "loxilb_pd_kv_tier15_spills_total", &["ep_idx=\"1\""]);
    assert_eq!(spills, 1.0, "{m}");
    assert_eq!(
        c, 0,
        "A's work was released: both hold S, idle, tie to the lower index"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_law_keeps_the_same_request_on_the_busy_holder() {
    // LoxiLB's `hard` (the work guard off): the request count alone decides.
    let ([a, b, _], m) = scenario(None, &[("LOXI_KV_WORK_GUARD_PERCENT", "0")]).await;
    assert_eq!((a, b), (0, 0), "hard: one in flight is under the cap of 2");
    let spills = metric(&m, "loxilb_pd_kv_tier15_spills_total", &["ep_idx=\"1\""]);
    assert_eq!(spills, 0.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_law_with_the_work_guard_moves_b_off_a_queue_that_outweighs_twice_its_saving() {
    // The default guard (200 %): A's queued prefill (its 300-word prompt) on 0 is more than
    // B's uncached tail plus twice the shared prefix B would recompute on 1, and 1 is idle
    // (within its request share): B moves, counted as a spill.
    let ([a, b, _], m) = scenario(None, &[]).await;
    assert_eq!((a, b), (0, 1), "the guard moves B off A's queue");
    let spills = metric(&m, "loxilb_pd_kv_tier15_spills_total", &["ep_idx=\"1\""]);
    assert_eq!(spills, 1.0, "{m}");
}
