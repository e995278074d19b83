//! Real-engine integration test (issue 4, "Real engine, optional but wired"): two REAL vLLM CPU
//! engines behind the real `loxilb` with a `kvExactMode: 3` rule.
//!
//! Skipped unless `LOXI_REAL_VLLM=1` (the engines need the vLLM CPU venv that
//! `../shared/scripts/real-vllm-cpu.sh --install-only` builds, ~6 GB, and 1–10 minutes to start).
//! Run: `cargo build -p loxi-user --bins && LOXI_REAL_VLLM=1 cargo test -p loxi-tests --test
//! real_vllm -- --nocapture` (as root: the test creates network namespaces).
//!
//! One KV-event port per rule (`kvZmqPort`) and vLLM binding its PUB socket only for
//! `tcp://*:PORT` mean two engines cannot publish on one host. So each engine runs in its own
//! network namespace that this test creates, joined to the root namespace by a veth pair on a
//! private /30 (root side `.1`, engine side `.2`); both engines publish on port 5557 of their own
//! address. Everything (engines, veths, namespaces) is removed by [`EngineNs`]'s `Drop`, also on
//! panic. Traffic goes only to those namespaces and to loopback.
//!
//! Checks: (1) a cold ~300-token completion goes to some engine E; once E's `BlockStored`
//! events reach loxi (inventory block count > 0), a warm request sharing the prefix lands on E
//! (`x-loxilb-endpoint`) and `loxilb_pd_kv_tier15_hits_total{ep_idx="E"}` moves by exactly 1;
//! (2) the parity report says `ok` for E (and `loxilb_kv_parity_ok{ep="E"}` = 1), and no engine
//! is in `mismatch`; (3) vLLM's own prefix cache hit shows in the warm response's
//! `usage.prompt_tokens_details.cached_tokens` (asked for with `--enable-prompt-tokens-details`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use loxi_tests::real_engine::{Starter, enabled, log_tail, sample, server_log};
use loxi_tests::shared_dir;
use serde_json::{Value, json};

/// KV-event PUB port every engine uses inside its namespace (`kvZmqPort`).
const KV_PORT: u16 = 5557;
/// How long both engines together may take to become ready (2 busy cores).
const ENGINE_READY: Duration = Duration::from_secs(900);
/// How long one completion may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(180);
/// How long loxi may take to see the engine's events / connect its subscribers.
const EVENTS_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `ip ARGS`; panics with stderr when it fails (`quiet` = ignore failure, for cleanup).
fn ip(args: &[&str], quiet: bool) {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run ip");
    if !quiet {
        assert!(
            out.status.success(),
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// One engine's network namespace, veth pair and (once started) vLLM process tree.
struct EngineNs {
    ns: String,
    veth_host: String,
    /// Address of the engine inside its namespace (the rule's `endpointIP`).
    addr: String,
    /// vLLM's HTTP port (also names the script's pid and log files, so it is chosen free).
    http_port: u16,
    /// The `real-vllm-cpu.sh` start script (once started).
    starter: Option<Starter>,
    starter_log: PathBuf,
}

impl EngineNs {
    /// Creates namespace `loxi-vllm-<pid>-<idx>` with `10.213.<n>.2/30` inside and `.1` outside.
    fn create(idx: u8, tmp: &Path) -> EngineNs {
        let pid = std::process::id();
        let ns = format!("loxi-vllm-{pid}-{idx}");
        let veth_host = format!("lxv{}h{idx}", pid % 100_000);
        let veth_ns = format!("lxv{}n{idx}", pid % 100_000);
        let octet = (pid % 100) * 2 + u32::from(idx) + 1;
        let host_addr = format!("10.213.{octet}.1");
        let addr = format!("10.213.{octet}.2");
        let e = EngineNs {
            ns: ns.clone(),
            veth_host: veth_host.clone(),
            addr: addr.clone(),
            http_port: free_port(),
            starter: None,
            starter_log: tmp.join(format!("starter-{idx}.log")),
        };
        ip(&["netns", "add", &ns], false);
        ip(
            &[
                "link", "add", &veth_host, "type", "veth", "peer", "name", &veth_ns,
            ],
            false,
        );
        ip(&["link", "set", &veth_ns, "netns", &ns], false);
        ip(
            &["addr", "add", &format!("{host_addr}/30"), "dev", &veth_host],
            false,
        );
        ip(&["link", "set", &veth_host, "up"], false);
        let inside = |args: &[&str]| {
            let mut a = vec!["netns", "exec", ns.as_str(), "ip"];
            a.extend_from_slice(args);
            ip(&a, false);
        };
        inside(&["link", "set", "lo", "up"]);
        inside(&["addr", "add", &format!("{addr}/30"), "dev", &veth_ns]);
        inside(&["link", "set", &veth_ns, "up"]);
        e
    }

    /// Starts `real-vllm-cpu.sh HTTP_PORT 5557` inside the namespace (block size 32,
    /// `sha256_cbor`, `PYTHONHASHSEED=0`, KV events on; HTTP on all of the namespace's addresses).
    fn start(&mut self) {
        let shared = shared_dir();
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns, "bash"])
            .arg(shared.join("scripts/real-vllm-cpu.sh"))
            .arg(self.http_port.to_string())
            .arg(KV_PORT.to_string())
            .env("MODEL_DIR", shared.join("golden/tiny-model"))
            .env("BLOCK_SIZE", "32")
            .env("HASH_ALGO", "sha256_cbor")
            .env("PYTHONHASHSEED", "0")
            .env("READY_TIMEOUT", ENGINE_READY.as_secs().to_string())
            .env(
                "EXTRA_ARGS",
                "--host 0.0.0.0 --enable-prompt-tokens-details",
            );
        self.starter = Some(Starter::spawn(cmd, &self.starter_log));
    }

    /// `Some(Ok)` once the start script reported readiness, `Some(Err(why))` if it failed.
    fn poll_ready(&mut self) -> Option<Result<(), String>> {
        match self.starter.as_mut()?.poll()? {
            Ok(()) => Some(Ok(())),
            Err(_) => Some(Err(self.logs())),
        }
    }

    /// The start script's output and the tail of vLLM's log.
    fn logs(&self) -> String {
        let starter = std::fs::read_to_string(&self.starter_log).unwrap_or_default();
        format!(
            "[{}] starter:\n{starter}\n[{}] vLLM log tail:\n{}",
            self.ns,
            self.ns,
            log_tail(self.http_port, 30)
        )
    }

    /// Process ids living in the namespace (all started by this test).
    fn pids(&self) -> Vec<String> {
        Command::new("ip")
            .args(["netns", "pids", &self.ns])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Stops the engine (script `--stop`, then TERM/KILL by pid for the rest of its tree).
    fn stop(&mut self) {
        if let Some(mut s) = self.starter.take() {
            s.kill();
        }
        let _ = Command::new("bash")
            .arg(shared_dir().join("scripts/real-vllm-cpu.sh"))
            .args(["--stop", &self.http_port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut signal = "-TERM";
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                signal = "-KILL";
            }
            let _ = Command::new("kill").arg(signal).args(&pids).status();
            if signal == "-KILL" {
                std::thread::sleep(Duration::from_millis(500));
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for EngineNs {
    fn drop(&mut self) {
        let failed = std::thread::panicking();
        if failed {
            eprintln!("{}", self.logs());
        }
        self.stop();
        if !failed {
            let _ = std::fs::remove_file(server_log(self.http_port));
        }
        ip(&["link", "del", &self.veth_host], true);
        ip(&["netns", "del", &self.ns], true);
    }
}

/// Stages the tiny model's tokenizer as `<dir>/tiny/{tokenizer.json,tokenizer_config.json}`.
fn stage_tokenizer(dir: &Path) {
    let model = shared_dir().join("golden/tiny-model");
    let dst = dir.join("tiny");
    std::fs::create_dir_all(&dst).expect("mkdir tokenizer dir");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(model.join(f), dst.join(f)).expect("copy tokenizer file");
    }
}

/// The shared ~310-token prefix (10 distinct lines).
fn prefix() -> String {
    (0..10)
        .map(|i| {
            format!("Line {i}: the loxi gateway routes request number {i} to the worker that holds its prefix. ")
        })
        .collect()
}

/// A completion through the VIP: `(x-loxilb-endpoint, body)`.
async fn complete(
    c: &Client<HttpConnector, Full<Bytes>>,
    vip: u16,
    prompt: &str,
) -> (usize, Value) {
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0});
    let req = http::Request::post(format!("http://127.0.0.1:{vip}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = tokio::time::timeout(REQUEST_TIMEOUT, c.request(req))
        .await
        .expect("completion answered in time")
        .expect("completion request");
    let status = resp.status().as_u16();
    let ep = resp
        .headers()
        .get("x-loxilb-endpoint")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    assert_eq!(status, 200, "completion failed: {text}");
    let ep = ep.unwrap_or_else(|| panic!("no x-loxilb-endpoint header; body {text}"));
    (ep, serde_json::from_str(&text).expect("completion JSON"))
}

/// `GET` a JSON view of the API; panics on a non-200.
async fn get_json(d: &Daemon, path: &str) -> Value {
    let (status, text) = d.get(path).await.expect("GET");
    assert_eq!(status, 200, "GET {path}: {text}");
    serde_json::from_str(&text).expect("JSON")
}

/// The rule's service id: the one id the inventory view knows.
async fn service_id(d: &Daemon) -> u32 {
    for id in 1..=16 {
        let path = format!("/netlox/v1/config/ai/kv/inventory?service_id={id}");
        if let Ok((200, _)) = d.get(&path).await {
            return id;
        }
    }
    panic!("no KV service id answered the inventory view");
}

/// Polls the inventory until `ok(view)` holds; returns the view.
async fn wait_inventory(d: &Daemon, path: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + EVENTS_TIMEOUT;
    loop {
        let v = get_json(d, path).await;
        if ok(&v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{what} within {EVENTS_TIMEOUT:?}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_request_lands_on_the_real_vllm_engine_holding_its_prefix_and_parity_is_ok() {
    if !enabled(
        "real_vllm",
        "two real vLLM CPU engines (needs root and the venv of ../shared/scripts/real-vllm-cpu.sh)",
    ) {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let t0 = Instant::now();
    let mut engines = vec![
        EngineNs::create(0, tmp.path()),
        EngineNs::create(1, tmp.path()),
    ];
    for e in &mut engines {
        e.start();
    }
    let deadline = Instant::now() + ENGINE_READY + Duration::from_secs(30);
    let mut ready = [false, false];
    while !ready.iter().all(|r| *r) {
        for (i, e) in engines.iter_mut().enumerate() {
            match e.poll_ready() {
                Some(Ok(())) => {
                    ready[i] = true;
                    eprintln!(
                        "engine {i} ({}:{}) ready after {:?}",
                        e.addr,
                        e.http_port,
                        t0.elapsed()
                    );
                }
                Some(Err(logs)) => panic!("engine {i} failed to start:\n{logs}"),
                None => {}
            }
        }
        assert!(
            Instant::now() < deadline,
            "engines not ready in {ENGINE_READY:?}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }

    stage_tokenizer(tmp.path());
    let d = Daemon::start(
        DaemonOpts {
            tokenizer_dir: Some(tmp.path().to_path_buf()),
            ..DaemonOpts::default()
        }
        .env("LLB_KV_NONE_HASH_SEED", "0"),
    )
    .await;
    let vip = free_port();
    let eps: Vec<Value> = engines
        .iter()
        .map(|e| json!({"endpointIP": e.addr, "targetPort": e.http_port, "weight": 1}))
        .collect();
    let rule = json!({
        "serviceArguments": {
            "externalIP": "127.0.0.1", "port": vip, "protocol": "tcp", "mode": 4, "sel": 0,
            "kvExactMode": 3, "kvBlockSize": 32, "kvHashAlgo": "sha256_cbor", "kvZmqPort": KV_PORT
        },
        "endpoints": eps,
    });
    let (status, body) = d.post_rule(&rule).await;
    assert!(
        status == 200 || status == 201,
        "rule rejected: {status} {body}"
    );
    let id = service_id(&d).await;
    let inv = format!("/netlox/v1/config/ai/kv/inventory?service_id={id}");
    wait_inventory(&d, &inv, "both KV subscribers connected", |v| {
        v["endpoints"]
            .as_array()
            .is_some_and(|a| a.len() == 2 && a.iter().all(|e| e["connected"] == json!(true)))
    })
    .await;
    // ZeroMQ subscriptions reach the publisher just after the TCP connect.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let client = Client::builder(TokioExecutor::new()).build_http();
    let prefix = prefix();
    let sid = id.to_string();
    let no_worker = [("service", sid.as_str()), ("reason", "no_worker")];
    let all_hits = [("service", sid.as_str())];
    let m0 = d.metrics_text().await;
    let (cold_ep, cold) = complete(&client, vip, &prefix).await;
    let m1 = d.metrics_text().await;
    let miss_delta = sample(&m1, "loxilb_pd_kv_tier15_miss_reason_total", &no_worker)
        - sample(&m0, "loxilb_pd_kv_tier15_miss_reason_total", &no_worker);
    let cold_hits = sample(&m1, "loxilb_pd_kv_tier15_hits_total", &all_hits)
        - sample(&m0, "loxilb_pd_kv_tier15_hits_total", &all_hits);
    eprintln!("cold: tier15 no_worker misses +{miss_delta}, hits +{cold_hits}");
    assert_eq!(
        (miss_delta, cold_hits),
        (1.0, 0.0),
        "a cold prompt is a tier-1.5 no_worker miss"
    );
    eprintln!(
        "cold: endpoint {cold_ep}, prompt_tokens {}, usage {}",
        cold["usage"]["prompt_tokens"], cold["usage"]
    );
    assert!(cold_ep < 2, "cold endpoint {cold_ep}");
    let held_path = format!("{inv}&ep_idx={cold_ep}");
    let held = wait_inventory(
        &d,
        &held_path,
        "the cold engine's blocks in the inventory",
        |v| v["endpoints"][0]["blockCount"].as_u64().unwrap_or(0) > 0,
    )
    .await;
    let other = get_json(&d, &format!("{inv}&ep_idx={}", 1 - cold_ep)).await;
    let held_blocks = held["endpoints"][0]["blockCount"].as_u64().unwrap_or(0);
    let other_blocks = other["endpoints"][0]["blockCount"].as_u64().unwrap_or(0);
    eprintln!(
        "inventory after cold: ep {cold_ep} holds {held_blocks} blocks, ep {} holds {other_blocks}",
        1 - cold_ep
    );
    assert_eq!(other_blocks, 0, "the idle engine published blocks: {other}");

    let ep_label = cold_ep.to_string();
    let hit_labels = [("service", sid.as_str()), ("ep_idx", ep_label.as_str())];
    let before = sample(
        &d.metrics_text().await,
        "loxilb_pd_kv_tier15_hits_total",
        &hit_labels,
    );
    let warm_prompt = format!("{prefix}Now answer briefly: which worker holds this prefix?");
    let (warm_ep, warm) = complete(&client, vip, &warm_prompt).await;
    let metrics = d.metrics_text().await;
    let after = sample(&metrics, "loxilb_pd_kv_tier15_hits_total", &hit_labels);
    eprintln!(
        "warm: endpoint {warm_ep} (cold was {cold_ep}), tier15 hits on ep {cold_ep}: {before} -> {after}, usage {}",
        warm["usage"]
    );
    assert_eq!(
        warm_ep, cold_ep,
        "warm request left the engine holding its prefix"
    );
    assert_eq!(after - before, 1.0, "tier-1.5 hit counter delta");

    // (2) parity: OK for every engine whose token-carrying events were checked.
    let parity = get_json(
        &d,
        &format!("/netlox/v1/config/ai/kv/parity?service_id={id}"),
    )
    .await;
    eprintln!("parity: {parity}");
    let reports = parity["endpoints"].as_array().cloned().unwrap_or_default();
    for r in &reports {
        assert_ne!(r["verdict"], json!("mismatch"), "parity mismatch: {r}");
    }
    let cold_report = reports
        .iter()
        .find(|r| r["epIdx"] == json!(cold_ep))
        .unwrap_or_else(|| panic!("no parity report for ep {cold_ep}: {parity}"));
    assert_eq!(cold_report["verdict"], json!("ok"), "{cold_report}");
    assert!(
        cold_report["checked_blocks"].as_u64().unwrap_or(0) > 0,
        "{cold_report}"
    );
    let parity_ok = sample(
        &metrics,
        "loxilb_kv_parity_ok",
        &[("service", sid.as_str()), ("ep", ep_label.as_str())],
    );
    assert_eq!(parity_ok, 1.0, "loxilb_kv_parity_ok for ep {cold_ep}");

    // (3) the engine's own prefix cache served the shared blocks.
    let cached = &warm["usage"]["prompt_tokens_details"]["cached_tokens"];
    eprintln!("warm cached_tokens: {cached}");
    if !cached.is_null() {
        assert!(
            cached.as_u64().unwrap_or(0) > 0,
            "engine-side cache miss: {}",
            warm["usage"]
        );
    }
    eprintln!("real_vllm done in {:?}", t0.elapsed());
}
