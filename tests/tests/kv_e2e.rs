//! End-to-end tier 1.5: the real `loxilb` daemon, two real HTTP backends, and two real libzmq
//! KV-event publishers (`tests/py/kv_pub.py`, pyzmq) standing in for the backends' engines.
//!
//! Endpoint 0 is 127.0.0.1 and endpoint 1 is 127.0.0.2 (both loopback), so both publishers can
//! use the rule's single `kvZmqPort`. The engine events are the ones a real vLLM published for
//! the same prompt (`golden/vllm_kv_events_capture.json` frame 0: `tiny` model, block size 32,
//! `sha256_cbor`, `PYTHONHASHSEED=0`), so routing depends on bit-exact hashing of loxi's own
//! tokenization. Predicted blocks are turned off (`LOXI_KV_PREDICT_TTL_MS=0`) so only the
//! engine's events can make the warm request stick.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

fn shared() -> PathBuf {
    std::env::var_os("LOXI_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"))
}

fn capture() -> Value {
    let p = shared().join("golden/vllm_kv_events_capture.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("capture json")
}

/// One pyzmq publisher bound on `host:port`.
struct Publisher {
    _child: Child,
    stdin: ChildStdin,
    out: Lines<BufReader<ChildStdout>>,
}

impl Publisher {
    async fn start(host: &str, port: u16) -> Self {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/py/kv_pub.py");
        let mut child = Command::new("python3")
            .args([script, "--host", host, "--port", &port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn python3 kv_pub.py (pyzmq: scripts/setup.sh)");
        let stdin = child.stdin.take().expect("stdin");
        let out = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut p = Self {
            _child: child,
            stdin,
            out,
        };
        assert!(p.line().await.starts_with("ready"));
        p
    }

    async fn line(&mut self) -> String {
        tokio::time::timeout(Duration::from_secs(15), self.out.next_line())
            .await
            .expect("publisher answered in time")
            .expect("read publisher")
            .expect("publisher alive")
    }

    async fn wait_for(&mut self, want: &str) {
        while self.line().await != want {}
    }

    async fn raw(&mut self, frames_hex: &Value) {
        let cmd = json!({"op": "raw", "frames_hex": frames_hex});
        self.stdin
            .write_all(format!("{cmd}\n").as_bytes())
            .await
            .expect("write");
        self.wait_for("ok").await;
    }
}

/// `<tmp>/tiny/{tokenizer.json, tokenizer_config.json}` from the golden tiny model.
fn stage_tokenizer(dir: &std::path::Path) {
    let src = shared().join("golden/tiny-model");
    let dst = dir.join("tiny");
    std::fs::create_dir_all(&dst).expect("mkdir");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy tokenizer file");
    }
}

async fn complete(vip: SocketAddr, prompt: &str) -> (u16, Option<usize>) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 2}).to_string();
    let req = http::Request::post(format!("http://{vip}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let resp = client.request(req).await.expect("proxy answered");
    let ep = resp
        .headers()
        .get("x-loxilb-endpoint")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    (status, ep)
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn wait_blocks(d: &Daemon, ep: usize, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let path = format!("/netlox/v1/config/ai/kv/inventory?service_id=1&ep_idx={ep}");
        let (code, body) = d.get(&path).await.expect("inventory");
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        if code == 200 && v["endpoints"][0]["blockCount"].as_u64() == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "inventory of ep {ep} never reached {want}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_request_goes_to_endpoint_whose_engine_published_the_prefix() {
    let cap = capture();
    let tok_dir = tempfile::tempdir().expect("tmp");
    stage_tokenizer(tok_dir.path());
    let opts = DaemonOpts {
        tokenizer_dir: Some(tok_dir.path().to_path_buf()),
        ..Default::default()
    }
    .env("LLB_KV_NONE_HASH_SEED", "0")
    .env("LOXI_KV_PREDICT_TTL_MS", "0");
    let d = Daemon::start(opts).await;

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
    assert_eq!(
        metric(
            &m,
            "loxilb_pd_kv_tier15_miss_reason_total{service=\"1\",reason=\"no_worker\"}"
        ),
        1.0
    );

    // The engine behind the cold request's endpoint stores its blocks (what vLLM published).
    pubs[cold_ep].raw(&cap["frames"][0]["parts_hex"]).await;
    wait_blocks(&d, cold_ep, 7).await;

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
    drop((b0, b1));
}
