//! Harness for the `vllm-sim` tests: starts the real binary on OS-chosen ports, talks HTTP to
//! it with hyper, and reads its ZMQ sockets with python3 + pyzmq (a libzmq peer, independent of
//! the Rust `zeromq` crate the emulator publishes with).

#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub use loxi_tests::shared_dir;

/// `../shared` relative to the workspace root, or `LOXI_SHARED`.
/// The golden live capture.
pub fn golden_capture() -> Value {
    let p = shared_dir().join("golden/vllm_kv_events_capture.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {p:?}: {e}"));
    serde_json::from_str(&text).expect("golden capture is JSON")
}

/// A running `vllm-sim` process (killed on drop); derefs to its HTTP [`Client`].
pub struct Sim {
    child: Child,
    /// HTTP client for the emulator.
    pub client: Client,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// PUB endpoint as `tcp://127.0.0.1:PORT`, when events are on.
    pub publisher: Option<String>,
    /// ROUTER endpoint, when configured.
    pub replay: Option<String>,
    _stdout: BufReader<ChildStdout>,
}

/// The `--kv-events-config` JSON with OS-chosen loopback ports and replay on.
pub const EVENTS_CFG: &str = r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:0","replay_endpoint":"tcp://127.0.0.1:0","topic":"kv"}"#;

impl Sim {
    /// Starts `vllm-sim` with `args` (plus `--host 127.0.0.1 --port 0`) and `envs`.
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Sim {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vllm-sim"));
        cmd.args(["--host", "127.0.0.1", "--port", "0"]).args(args);
        cmd.env_remove("PYTHONHASHSEED")
            .env_remove("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn vllm-sim");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("ready line");
        assert!(
            line.starts_with("VLLM_SIM_READY"),
            "unexpected first line: {line:?}"
        );
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .filter(|v| *v != "-")
                .map(str::to_string)
        };
        let base = format!("http://{}", field("http").expect("http"));
        Sim {
            client: Client { base: base.clone() },
            base,
            publisher: field("pub"),
            replay: field("replay"),
            child,
            _stdout: stdout,
        }
    }

    /// A client for `base` that does not own the process (for spawned tasks).
    pub fn client_for(base: &str) -> Client {
        Client {
            base: base.to_string(),
        }
    }
}

impl std::ops::Deref for Sim {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

/// A small HTTP/1 client for one base URL.
#[derive(Debug, Clone)]
pub struct Client {
    /// `http://HOST:PORT`.
    pub base: String,
}

impl Client {
    /// POSTs JSON; returns (status, body as JSON or as a string value).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (s, b) = self.request("POST", path, Some(body.to_string())).await;
        (
            s,
            serde_json::from_slice(&b).unwrap_or(Value::String(String::from_utf8_lossy(&b).into())),
        )
    }

    /// POSTs JSON; returns (status, raw body text) (for SSE).
    pub async fn post_raw(&self, path: &str, body: &Value) -> (u16, String) {
        let (s, b) = self.request("POST", path, Some(body.to_string())).await;
        (s, String::from_utf8_lossy(&b).into_owned())
    }

    /// POSTs JSON; returns (status, response headers, body as JSON).
    pub async fn post_headers(&self, path: &str, body: &Value) -> (u16, http::HeaderMap, Value) {
        let (s, h, b) = self
            .request_full("POST", path, Some(body.to_string()))
            .await;
        (s, h, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    /// GETs a path; returns (status, body text).
    pub async fn get(&self, path: &str) -> (u16, String) {
        let (s, b) = self.request("GET", path, None).await;
        (s, String::from_utf8_lossy(&b).into_owned())
    }

    async fn request(&self, method: &str, path: &str, body: Option<String>) -> (u16, Bytes) {
        let (s, _, b) = self.request_full(method, path, body).await;
        (s, b)
    }

    async fn request_full(
        &self,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> (u16, http::HeaderMap, Bytes) {
        let client: HyperClient<HttpConnector, Full<Bytes>> =
            HyperClient::builder(TokioExecutor::new()).build_http();
        let req = http::Request::builder()
            .method(method)
            .uri(format!("{}{}", self.base, path))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .expect("request");
        let fut = client.request(req);
        let resp = tokio::time::timeout(Duration::from_secs(30), fut)
            .await
            .expect("timeout")
            .expect("http");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, headers, body)
    }

    /// The value of the first sample of metric `name` (exact series name, any labels).
    pub async fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} missing in:\n{text}"))
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One ZMQ multipart message as hex frames.
pub type Frames = Vec<Vec<u8>>;

const SUB_PY: &str = r#"
import sys, time, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.SUB)
s.connect(sys.argv[1])
s.setsockopt(zmq.SUBSCRIBE, b"")
time.sleep(0.5)
print("READY", flush=True)
idle = float(sys.argv[2])
poller = zmq.Poller(); poller.register(s, zmq.POLLIN)
while True:
    if not poller.poll(idle * 1000):
        break
    parts = s.recv_multipart()
    print(" ".join(p.hex() or "-" for p in parts), flush=True)
"#;

/// A python3 + pyzmq SUB connected to `endpoint`; collects messages until `idle_s` passes
/// without one.
pub struct PySub {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl PySub {
    /// Connects and waits until the subscription is in place.
    pub fn connect(endpoint: &str, idle_s: f64) -> PySub {
        let mut child = Command::new("python3")
            .args(["-c", SUB_PY, endpoint, &idle_s.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("READY");
        assert_eq!(line.trim(), "READY");
        PySub { child, out }
    }

    /// Every message received until the subscriber went idle.
    pub fn collect(mut self) -> Vec<Frames> {
        let msgs = read_hex_lines(&mut self.out);
        let _ = self.child.wait();
        msgs
    }
}

fn read_hex_lines(out: &mut BufReader<ChildStdout>) -> Vec<Frames> {
    let mut msgs = Vec::new();
    for line in out.lines().map_while(Result::ok) {
        msgs.push(
            line.split_whitespace()
                .map(|p| if p == "-" { vec![] } else { hex(p) })
                .collect(),
        );
    }
    msgs
}

const REPLAY_PY: &str = r#"
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.connect(sys.argv[1])
s.send_multipart([b"", int(sys.argv[2]).to_bytes(8, "big")])
poller = zmq.Poller(); poller.register(s, zmq.POLLIN)
while poller.poll(5000):
    parts = s.recv_multipart()
    print(" ".join(p.hex() or "-" for p in parts), flush=True)
    if len(parts) >= 3 and parts[2] == b"\xff" * 8:
        break
"#;

/// Replays from `start_seq` with a python DEALER; returns every reply including the end marker.
pub fn replay(endpoint: &str, start_seq: u64) -> Vec<Frames> {
    let mut child = Command::new("python3")
        .args(["-c", REPLAY_PY, endpoint, &start_seq.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let msgs = read_hex_lines(&mut out);
    let _ = child.wait();
    msgs
}

/// Hex string → bytes.
pub fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

/// Decodes one msgpack value.
pub fn decode(payload: &[u8]) -> rmpv::Value {
    rmpv::decode::read_value(&mut &payload[..]).expect("msgpack")
}

/// Waits until `f` is true or `timeout` passes.
pub async fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// Waits until the async predicate `f` is true or `timeout` passes.
pub async fn wait_until_async<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f().await
}
