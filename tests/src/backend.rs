//! Real test backends: small hyper HTTP/1.1 servers on `127.0.0.1:0` that report who they are,
//! can be told to fail or hang, stream SSE, and record what happened to each request.
//!
//! Every response carries header `x-backend: NAME`; JSON responses are
//! `{"backend": NAME, "path": PATH, "body_len": N}`.
//!
//! Per-request controls (request headers):
//! - `x-delay-ms: N` — wait N ms before answering (a "long non-streaming request").
//! - `x-sse: COUNT:INTERVAL_MS` — answer `text/event-stream` with COUNT events
//!   `data: {"backend":NAME,"i":I}` INTERVAL_MS apart (0: back to back, no timer), then
//!   `data: [DONE]`. A JSON body with `"stream": true` and no `x-sse` header streams 20 events
//!   100 ms apart.
//! - `x-sse-pad: N` — each of those events also carries `"pad"`, N bytes of `x` (large events).
//!
//! `GET /metrics`: when [`Backend::set_metrics`] gave a text, it is answered as Prometheus text
//! (not counted nor recorded, so an engine-metrics scraper does not disturb request counts);
//! otherwise it is an ordinary request.
//!
//! Whole-backend modes ([`Mode`]): normal, fail (500 `{"error": ...}`), hang (never answer, up
//! to [`HANG_LIMIT`]).
//!
//! A request counts as *cancelled* when the client (the proxy) went away before the response
//! finished: the handler future was dropped mid-wait, or an SSE write found the body gone.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// The longest a hanging backend holds a request.
pub const HANG_LIMIT: Duration = Duration::from_secs(60);

/// What the backend does with every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Answer normally.
    Normal,
    /// Answer 500.
    Fail,
    /// Never answer (until [`HANG_LIMIT`]).
    Hang,
}

/// One received request.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Method.
    pub method: String,
    /// Path and query.
    pub uri: String,
    /// Headers (lower-case names).
    pub headers: Vec<(String, String)>,
    /// Body bytes.
    pub body: Bytes,
}

impl Recorded {
    /// A header value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug)]
struct State {
    name: String,
    mode: Mutex<Mode>,
    record: std::sync::atomic::AtomicBool,
    count: AtomicUsize,
    requests: Mutex<Vec<Recorded>>,
    cancelled: AtomicUsize,
    completed: AtomicUsize,
    /// When each SSE event (by index) of the latest stream was handed to hyper.
    sse_written: Mutex<Vec<Instant>>,
    /// `GET /metrics` text, when set.
    metrics: Mutex<Option<String>>,
}

/// A running test backend; stops accepting on drop.
pub struct Backend {
    /// Socket address (127.0.0.1, OS-chosen port unless given).
    pub addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Backend {
    /// Starts a backend named `name` on an OS-chosen loopback port.
    pub async fn start(name: &str) -> Backend {
        Self::bind(name, SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind test backend")
    }

    /// Starts a backend on `addr`.
    pub async fn bind(name: &str, addr: SocketAddr) -> std::io::Result<Backend> {
        let tcp = TcpListener::bind(addr).await?;
        let addr = tcp.local_addr()?;
        let state = Arc::new(State {
            name: name.to_string(),
            mode: Mutex::new(Mode::Normal),
            record: std::sync::atomic::AtomicBool::new(true),
            count: AtomicUsize::new(0),
            requests: Mutex::new(Vec::new()),
            cancelled: AtomicUsize::new(0),
            completed: AtomicUsize::new(0),
            sse_written: Mutex::new(Vec::new()),
            metrics: Mutex::new(None),
        });
        let task = tokio::spawn(accept_loop(tcp, state.clone()));
        Ok(Backend { addr, state, task })
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The name it reports.
    pub fn name(&self) -> &str {
        &self.state.name
    }

    /// Switches the mode for subsequent requests.
    pub fn set_mode(&self, mode: Mode) {
        *self.state.mode.lock() = mode;
    }

    /// Keep (true, the default) or skip copies of received requests; counting goes on.
    /// Benchmarks turn it off so memory stays flat.
    pub fn set_recording(&self, on: bool) {
        self.state.record.store(on, Ordering::SeqCst);
    }

    /// Serve `text` (Prometheus exposition) on `GET /metrics` from now on; `None` turns it
    /// back into an ordinary request.
    pub fn set_metrics(&self, text: Option<&str>) {
        *self.state.metrics.lock() = text.map(str::to_string);
    }

    /// Requests received so far.
    pub fn request_count(&self) -> usize {
        self.state.count.load(Ordering::SeqCst)
    }

    /// All received requests.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().clone()
    }

    /// Requests whose client went away before the response finished.
    pub fn cancelled(&self) -> usize {
        self.state.cancelled.load(Ordering::SeqCst)
    }

    /// Requests whose response finished.
    pub fn completed(&self) -> usize {
        self.state.completed.load(Ordering::SeqCst)
    }

    /// Write instants of the latest SSE stream's events, by index.
    pub fn sse_written(&self) -> Vec<Instant> {
        self.state.sse_written.lock().clone()
    }

    /// Waits until `cancelled() >= n` or `timeout`; returns whether it happened.
    pub async fn wait_cancelled(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.cancelled() >= n {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.cancelled() >= n
    }

    /// Serves until the accept loop ends (for the `echo-backend` binary: forever).
    pub async fn serve_forever(mut self) {
        let _ = (&mut self.task).await;
    }
}

async fn accept_loop(tcp: TcpListener, state: Arc<State>) {
    loop {
        let Ok((stream, _)) = tcp.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(req, state.clone()));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

type TestBody = BoxBody<Bytes, Infallible>;

/// Marks a request cancelled if dropped before [`Probe::done`].
struct Probe {
    state: Arc<State>,
    done: bool,
}

impl Probe {
    fn done(mut self) {
        self.done = true;
        self.state.completed.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        if !self.done {
            self.state.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

async fn handle(
    req: Request<Incoming>,
    state: Arc<State>,
) -> Result<Response<TestBody>, Infallible> {
    if req.uri().path() == "/metrics"
        && let Some(text) = state.metrics.lock().clone()
    {
        return Ok(Response::builder()
            .header("content-type", "text/plain; version=0.0.4")
            .header("x-backend", state.name.as_str())
            .body(Full::new(Bytes::from(text)).boxed())
            .expect("static response parts"));
    }
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let rec = Recorded {
        method: parts.method.to_string(),
        uri: parts.uri.to_string(),
        headers: parts
            .headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
            .collect(),
        body: body.clone(),
    };
    state.count.fetch_add(1, Ordering::SeqCst);
    if state.record.load(Ordering::Relaxed) {
        state.requests.lock().push(rec.clone());
    }
    let probe = Probe {
        state: state.clone(),
        done: false,
    };
    let mode = *state.mode.lock();
    match mode {
        Mode::Hang => {
            tokio::time::sleep(HANG_LIMIT).await;
            probe.done();
            return Ok(json(&state, 504, serde_json::json!({"error": "hung"})));
        }
        Mode::Fail => {
            probe.done();
            return Ok(json(
                &state,
                500,
                serde_json::json!({"error": "told to fail", "backend": state.name}),
            ));
        }
        Mode::Normal => {}
    }
    if let Some(ms) = rec.header("x-delay-ms").and_then(|v| v.parse::<u64>().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some((count, interval)) = sse_plan(&rec) {
        let pad = rec
            .header("x-sse-pad")
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
        return Ok(sse(
            state,
            probe,
            count,
            Duration::from_millis(interval),
            "x".repeat(pad),
        ));
    }
    probe.done();
    Ok(json(
        &state,
        200,
        serde_json::json!({"backend": state.name, "path": rec.uri, "body_len": body.len()}),
    ))
}

fn sse_plan(rec: &Recorded) -> Option<(usize, u64)> {
    if let Some(v) = rec.header("x-sse") {
        let (c, i) = v.split_once(':')?;
        return Some((c.parse().ok()?, i.parse().ok()?));
    }
    let v: serde_json::Value = serde_json::from_slice(&rec.body).ok()?;
    (v.get("stream") == Some(&serde_json::Value::Bool(true))).then_some((20, 100))
}

fn json(state: &State, status: u16, v: serde_json::Value) -> Response<TestBody> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("x-backend", state.name.as_str())
        .body(Full::new(Bytes::from(v.to_string())).boxed())
        .expect("static response parts")
}

fn sse(
    state: Arc<State>,
    probe: Probe,
    count: usize,
    interval: Duration,
    pad: String,
) -> Response<TestBody> {
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(1);
    state.sse_written.lock().clear();
    tokio::spawn(async move {
        for i in 0..count {
            let ev = if pad.is_empty() {
                format!("data: {{\"backend\":{:?},\"i\":{i}}}\n\n", probe.state.name)
            } else {
                format!(
                    "data: {{\"backend\":{:?},\"i\":{i},\"pad\":\"{pad}\"}}\n\n",
                    probe.state.name
                )
            };
            if tx.send(Ok(Frame::data(Bytes::from(ev)))).await.is_err() {
                return; // probe drops undone: cancelled
            }
            probe.state.sse_written.lock().push(Instant::now());
            if !interval.is_zero() {
                tokio::time::sleep(interval).await;
            }
            if tx.is_closed() {
                return;
            }
        }
        if tx
            .send(Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n"))))
            .await
            .is_ok()
        {
            probe.done();
        }
    });
    let body = ChannelBody { rx };
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .header("x-backend", state.name.as_str())
        .body(body.boxed())
        .expect("static response parts")
}

/// A response body fed frame by frame from a channel; dropping it closes the channel, which is
/// how the SSE writer learns that the client went away.
struct ChannelBody {
    rx: mpsc::Receiver<Result<Frame<Bytes>, Infallible>>,
}

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx)
    }
}
