//! One streamed OpenAI request, timed from the client side.
//!
//! Timestamps are wall-clock Unix nanoseconds (the same clock `vllm-sim` uses for its
//! `x-sim-recv-unix-ns` / `x-sim-respond-unix-ns` headers on this machine), so the gateway's added
//! latency can be computed per request:
//! `added = (sim_recv − send_start) + (head_received − sim_respond)`.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A pooled HTTP/1 client for the benchmark.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Builds the benchmark's client (no idle-connection limit, no proxy).
pub fn http_client() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(conn)
}

/// What happened to one request. Times are Unix ns; `None` when the event never happened.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Outcome {
    /// Workload request id.
    pub id: usize,
    /// HTTP status (0 when no response head arrived).
    pub status: u16,
    /// Transport or protocol error, if any.
    pub error: Option<String>,
    /// Just before the request was handed to the client.
    pub send_ns: u128,
    /// Response head received.
    pub head_ns: Option<u128>,
    /// First streamed event carrying output text.
    pub first_token_ns: Option<u128>,
    /// Body fully received.
    pub end_ns: Option<u128>,
    /// Output tokens (`usage.completion_tokens`, else the number of text events).
    pub output_tokens: u64,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// `x-loxilb-endpoint` response header (which endpoint the gateway chose).
    pub endpoint: Option<String>,
    /// The base URL the client itself chose (client-side round-robin only).
    pub direct_worker: Option<usize>,
    /// The gateway replica the client sent it to (`--replicas N`, index from 0).
    pub replica: Option<usize>,
    /// `x-sim-recv-unix-ns`: the engine had the full request.
    pub sim_recv_ns: Option<u128>,
    /// `x-sim-respond-unix-ns`: the engine sent its response head.
    pub sim_respond_ns: Option<u128>,
    /// The engine's own simulated TTFT, seconds (`: vllm-sim ttft_s=…` SSE comment).
    pub sim_ttft_s: Option<f64>,
}

impl Outcome {
    /// True for a 2xx response whose stream ended and produced a first token.
    pub fn ok(&self) -> bool {
        self.error.is_none() && (200..300).contains(&self.status) && self.first_token_ns.is_some()
    }

    /// Time to first token, real ms.
    pub fn ttft_ms(&self) -> Option<f64> {
        self.first_token_ns.map(|t| ms(t, self.send_ns))
    }

    /// End-to-end latency, real ms.
    pub fn e2e_ms(&self) -> Option<f64> {
        self.end_ns.map(|t| ms(t, self.send_ns))
    }

    /// Mean inter-token latency, real ms: the time from the first to the last output token over
    /// the gaps between them (`output_tokens - 1`); `None` below two output tokens.
    pub fn itl_ms(&self) -> Option<f64> {
        let (first, end) = (self.first_token_ns?, self.end_ns?);
        let gaps = self.output_tokens.checked_sub(1).filter(|g| *g > 0)?;
        Some(ms(end, first) / gaps as f64)
    }

    /// The engine's simulated TTFT in ms, when the engine reported it.
    pub fn engine_ttft_ms(&self) -> Option<f64> {
        self.sim_ttft_s.map(|s| s * 1000.0)
    }

    /// TTFT as a client of real-speed engines sees it, ms: the engine's simulated TTFT plus the
    /// real latency the path added ([`Self::added_ms`]), which time scaling must not magnify
    /// (a gateway's real CPU time does not shrink with the simulated engine's clock).
    pub fn projected_ttft_ms(&self) -> Option<f64> {
        Some(self.engine_ttft_ms()? + self.added_ms()?)
    }

    /// Latency added between client and engine, real ms (needs both `x-sim-*` headers).
    pub fn added_ms(&self) -> Option<f64> {
        let (recv, respond, head) = (self.sim_recv_ns?, self.sim_respond_ns?, self.head_ns?);
        let up = recv as f64 - self.send_ns as f64;
        let down = head as f64 - respond as f64;
        Some((up + down) / 1e6)
    }
}

fn ms(later: u128, earlier: u128) -> f64 {
    (later as f64 - earlier as f64) / 1e6
}

/// Wall-clock Unix time in ns.
pub fn unix_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Sends `body` to `url` (a full `http://host:port/path`) and reads the SSE stream to the end,
/// giving up after `timeout`. Never panics; failures land in `Outcome::error`.
pub async fn send(
    client: &HttpClient,
    id: usize,
    url: &str,
    body: Bytes,
    timeout: Duration,
) -> Outcome {
    let mut out = Outcome {
        id,
        ..Outcome::default()
    };
    let req = match hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
    {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("bad request: {e}"));
            return out;
        }
    };
    out.send_ns = unix_ns();
    if tokio::time::timeout(timeout, exchange(client, req, &mut out))
        .await
        .is_err()
    {
        out.error = Some(format!("timed out after {timeout:?}"));
    }
    out
}

async fn exchange(client: &HttpClient, req: hyper::Request<Full<Bytes>>, out: &mut Outcome) {
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("request failed: {e}"));
            return;
        }
    };
    out.head_ns = Some(unix_ns());
    out.status = resp.status().as_u16();
    read_headers(resp.headers(), out);
    let mut body = resp.into_body();
    let mut sse = SseState::default();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Some(data) = f.data_ref() {
                    sse.feed(data, out);
                }
            }
            Err(e) => {
                out.error = Some(format!("body: {e}"));
                return;
            }
        }
    }
    out.end_ns = Some(unix_ns());
    if out.output_tokens == 0 {
        out.output_tokens = sse.text_events;
    }
    if !(200..300).contains(&out.status) {
        out.error = Some(format!(
            "status {}: {}",
            out.status,
            String::from_utf8_lossy(&sse.buf)
        ));
    }
}

fn read_headers(h: &http::HeaderMap, out: &mut Outcome) {
    let get = |name: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    out.endpoint = get("x-loxilb-endpoint");
    out.sim_recv_ns = get("x-sim-recv-unix-ns").and_then(|v| v.parse().ok());
    out.sim_respond_ns = get("x-sim-respond-unix-ns").and_then(|v| v.parse().ok());
}

/// Incremental SSE parser: events are separated by a blank line; only `data:` lines matter.
#[derive(Default)]
struct SseState {
    buf: Vec<u8>,
    text_events: u64,
}

impl SseState {
    fn feed(&mut self, data: &Bytes, out: &mut Outcome) {
        self.buf.extend_from_slice(data);
        while let Some(pos) = find_event_end(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..pos.0 + pos.1).collect();
            self.event(&event[..pos.0], out);
        }
    }

    fn event(&mut self, raw: &[u8], out: &mut Outcome) {
        let text = String::from_utf8_lossy(raw);
        for line in text.lines() {
            if let Some(comment) = line.strip_prefix(':') {
                read_sim_comment(comment, out);
                continue;
            }
            let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
                continue;
            };
            if has_text(&v) {
                self.text_events += 1;
                out.first_token_ns.get_or_insert_with(unix_ns);
            }
            read_usage(&v["usage"], out);
        }
    }
}

/// (end of event, separator length) for the first `\n\n` or `\r\n\r\n`.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// True when a chunk carries output text (completions `text` or chat `delta.content`).
fn has_text(v: &serde_json::Value) -> bool {
    v["choices"].as_array().is_some_and(|cs| {
        cs.iter().any(|c| {
            let s = c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str());
            s.is_some_and(|s| !s.is_empty())
        })
    })
}

/// `: vllm-sim ttft_s=0.031 e2e_s=0.287` (vllm-sim's timing comment before `[DONE]`).
fn read_sim_comment(comment: &str, out: &mut Outcome) {
    let mut words = comment.split_whitespace();
    if words.next() != Some("vllm-sim") {
        return;
    }
    for w in words {
        if let Some(v) = w.strip_prefix("ttft_s=").and_then(|v| v.parse().ok()) {
            out.sim_ttft_s = Some(v);
        }
    }
}

fn read_usage(u: &serde_json::Value, out: &mut Outcome) {
    if let Some(n) = u["completion_tokens"].as_u64() {
        out.output_tokens = n;
    }
    if let Some(n) = u["prompt_tokens"].as_u64() {
        out.prompt_tokens = Some(n);
    }
    if let Some(n) = u["prompt_tokens_details"]["cached_tokens"].as_u64() {
        out.cached_tokens = Some(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_finds_first_text_usage_and_split_events() {
        let mut out = Outcome::default();
        let mut sse = SseState::default();
        let chunks = [
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\nda",
            "ta: {\"choices\":[{\"delta\":{\"content\":\" hi\"}}]}\r\n\r\n",
            "data: {\"choices\":[{\"text\":\" there\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,",
            "\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n",
            ": vllm-sim ttft_s=0.0425 e2e_s=0.3\n\ndata: [DONE]\n\n",
        ];
        for c in chunks {
            sse.feed(&Bytes::from(c), &mut out);
        }
        assert_eq!(sse.text_events, 2);
        assert!(out.first_token_ns.is_some());
        assert_eq!(
            (out.output_tokens, out.prompt_tokens, out.cached_tokens),
            (2, Some(40), Some(32))
        );
        assert!(sse.buf.is_empty());
        assert_eq!(out.engine_ttft_ms(), Some(42.5));
    }

    #[test]
    fn itl_is_first_to_last_token_over_the_gaps() {
        let o = Outcome {
            send_ns: 0,
            first_token_ns: Some(2_000_000),
            end_ns: Some(6_000_000),
            output_tokens: 5,
            ..Outcome::default()
        };
        assert_eq!(o.itl_ms(), Some(1.0), "4 ms over 4 gaps");
        let one = Outcome {
            output_tokens: 1,
            ..o.clone()
        };
        assert_eq!(one.itl_ms(), None, "a single token has no gap");
    }

    #[test]
    fn added_latency_is_upstream_plus_downstream_gap() {
        let o = Outcome {
            send_ns: 1_000_000,
            sim_recv_ns: Some(1_400_000),
            sim_respond_ns: Some(5_000_000),
            head_ns: Some(5_300_000),
            ..Outcome::default()
        };
        assert_eq!(o.added_ms(), Some(0.7));
        assert_eq!(o.projected_ttft_ms(), None, "no engine TTFT reported");
        assert_eq!(Outcome::default().added_ms(), None);
    }
}
