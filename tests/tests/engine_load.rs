//! Engine-reported load (issue 13) through a real `loxilb`: with
//! `LOXI_ENGINE_METRICS_INTERVAL_MS` set, the daemon scrapes each KV-rule endpoint's
//! `GET /metrics` and the KV laws see `max(own in-flight, engine running + waiting)`, so load
//! that other gateways put on an engine counts.
//!
//! Two real HTTP backends behind a `kvExactMode: 3` rule under the `work` law (tiny model's
//! tokenizer, block 32, holdings from the tier's predicted blocks, cold seeding off; the
//! spill scenario places cold requests by the rule's `sel`, `LOXI_KV_COLD_PLACEMENT=sel`).
//! Endpoint 0 serves vLLM-style `/metrics` with 50 requests waiting (another gateway's queue);
//! endpoint 1 serves no Prometheus text at all. Prompt `A = S + tail` goes to endpoint 0 (round
//! robin's first pick, nothing held yet); `B = S + other tail` shares `S` with it. Without
//! engine metrics both endpoints are idle to this gateway and `B` follows its prefix to 0; with
//! them, endpoint 0's 50 queued requests outweigh what `S` saves and `B` goes to 1. Endpoint
//! 1's families are reported missing (never read as 0), endpoint 0's values are exported.

use std::net::SocketAddr;

use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, DaemonOpts};
use loxi_tests::http::{client, full, metric, send};
use loxi_tests::kv::stage_tiny_tokenizer;
use serde_json::json;

/// What a vLLM 0.x engine with a 50-request queue exports (subset, real label sets).
const BUSY_ENGINE: &str = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 50.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny\"} 0.75
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size=\"32\",engine=\"0\",num_gpu_blocks=\"30\"} 1.0
";

/// `S`: the shared prefix, then `n` words `tag0 tag1 …` of its own.
fn prompt(tag: &str, n: usize) -> String {
    let shared: String = (0..40).map(|i| format!("s{i} ")).collect();
    let tail: String = (0..n).map(|i| format!("{tag}{i} ")).collect();
    format!("shared system prompt {shared}{tail}")
}

/// A completion through `vip`: the endpoint index answered.
async fn complete(vip: SocketAddr, text: String) -> usize {
    let body = json!({"model": "tiny", "prompt": text, "max_tokens": 2}).to_string();
    let req = http::Request::post(format!("http://{vip}/v1/completions"))
        .header("content-type", "application/json")
        .body(full(body))
        .expect("request");
    let r = send(&client(), req).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.header("x-loxilb-endpoint")
        .and_then(|v| v.parse().ok())
        .expect("x-loxilb-endpoint")
}

/// Runs `A` then `B` with engine metrics scraped every `interval_ms` (`None`: unset, off) and
/// `LOXI_KV_COLD_PLACEMENT=cold` (`None`: the default, least work): their endpoints and the
/// daemon's metrics text at the end.
async fn scenario(interval_ms: Option<&str>, cold: Option<&str>) -> ([usize; 2], String) {
    let backends = [Backend::start("0").await, Backend::start("1").await];
    backends[0].set_metrics(Some(BUSY_ENGINE));
    let tok = tempfile::tempdir().expect("tmp");
    stage_tiny_tokenizer(tok.path());
    let mut opts = DaemonOpts {
        tokenizer_dir: Some(tok.path().to_path_buf()),
        ..Default::default()
    }
    .env("LLB_KV_NONE_HASH_SEED", "0")
    .env("LOXILB_KV_COLDSTART_SEED_N", "0")
    .env("LOXILB_KV_LB_MODE", "work");
    if let Some(ms) = interval_ms {
        opts = opts.env("LOXI_ENGINE_METRICS_INTERVAL_MS", ms);
    }
    if let Some(c) = cold {
        opts = opts.env("LOXI_KV_COLD_PLACEMENT", c);
    }
    let d = Daemon::start(opts).await;
    let vip = d
        .post_kv_pool_rule(&backends.iter().map(Backend::port).collect::<Vec<_>>())
        .await;
    if interval_ms.is_some() {
        // The first scrape has landed: endpoint 0's queue is known.
        d.wait_metric(
            "loxilb_engine_requests",
            &["ep_idx=\"0\"", "state=\"waiting\""],
            50.0,
        )
        .await;
    }
    let a = complete(vip, prompt("a", 30)).await;
    let b = complete(vip, prompt("b", 30)).await;
    ([a, b], d.metrics_text().await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_reported_queue_sends_the_prefix_sharer_elsewhere() {
    let ([a, b], m) = scenario(Some("100"), Some("sel")).await;
    assert_eq!(a, 0, "round robin's first pick");
    assert_eq!(b, 1, "endpoint 0's 50 waiting outweigh the shared prefix");
    let spills = metric(&m, "loxilb_pd_kv_tier15_spills_total", &["ep_idx=\"1\""]);
    assert_eq!(spills, 1.0, "{m}");
    let get = |name: &str, needles: &[&str]| metric(&m, name, needles);
    assert_eq!(
        get("loxilb_engine_metrics_up", &["ep_idx=\"0\""]),
        1.0,
        "{m}"
    );
    assert_eq!(
        get(
            "loxilb_engine_requests",
            &["ep_idx=\"0\"", "state=\"running\""]
        ),
        4.0
    );
    assert_eq!(
        get("loxilb_engine_kv_cache_usage_ratio", &["ep_idx=\"0\""]),
        0.75
    );
    assert_eq!(get("loxilb_engine_gpu_blocks", &["ep_idx=\"0\""]), 30.0);
    for family in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    ] {
        let fam = format!("family=\"{family}\"");
        assert_eq!(
            get("loxilb_engine_metric_missing", &["ep_idx=\"0\"", &fam]),
            0.0,
            "{m}"
        );
        assert_eq!(
            get("loxilb_engine_metric_missing", &["ep_idx=\"1\"", &fam]),
            1.0,
            "endpoint 1 serves no Prometheus text: {family} is missing, not 0\n{m}"
        );
    }
    assert!(
        !m.contains("ep_idx=\"1\",state="),
        "no engine-reported value for endpoint 1: {m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_engine_metrics_the_prefix_sharer_stays_on_its_holder() {
    let ([a, b], m) = scenario(None, None).await;
    assert_eq!((a, b), (0, 0), "both idle to this gateway: B follows S");
    assert!(!m.contains("loxilb_engine_metrics_up{"), "not scraped: {m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_request_is_placed_away_from_the_engine_reported_queue() {
    // Default cold placement: nothing is held and nothing is queued through this gateway, so
    // the effective load decides, and endpoint 0's 54 engine-reported requests send `A` to 1;
    // `B` then follows its prefix there. Nothing spills.
    let ([a, b], m) = scenario(Some("100"), None).await;
    assert_eq!((a, b), (1, 1), "A avoids the busy engine, B follows S: {m}");
    let placed = |ep: &str| {
        metric(
            &m,
            "loxilb_pd_kv_tier15_cold_placements_total",
            &[&format!("ep_idx=\"{ep}\"")],
        )
    };
    assert_eq!((placed("0"), placed("1")), (0.0, 1.0), "{m}");
    let spills = metric(&m, "loxilb_pd_kv_tier15_spills_total", &["ep_idx=\"1\""]);
    assert_eq!(spills, 0.0, "{m}");
}
