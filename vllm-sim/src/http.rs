//! The HTTP front end (hyper): routes, handlers, streaming. Every client mistake is a 4xx with
//! vLLM's error JSON; nothing here panics on input.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use loxi_user::request::ApiKind;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use super::config::KvRole;
use super::engine::Command;
use super::openai::{ApiError, SimRequest, parse_request};
use super::prompt::PromptCodec;
use super::response::{self, RespMeta};
use super::seq::{SeqEvent, SeqRequest, SeqSummary};

/// Response body type of every handler.
pub type Body = BoxBody<Bytes, Infallible>;

/// Shared state of the HTTP handlers.
#[derive(Debug)]
pub struct HttpState {
    /// Served model name.
    pub model: String,
    /// Tokenizer + hasher.
    pub codec: Arc<PromptCodec>,
    /// Engine command channel.
    pub engine: mpsc::UnboundedSender<Command>,
    /// Metrics registry (vLLM families).
    pub registry: Registry,
    /// Usable KV blocks (requests needing more are rejected).
    pub capacity_blocks: usize,
    /// P/D role.
    pub kv_role: KvRole,
    /// Advertised host/port (P/D `remote_host`/`remote_port`).
    pub advertised: (String, u16),
    /// Response id counter.
    pub next_id: AtomicU64,
    /// The last [`REQUEST_LOG_LEN`] generation requests as received (`GET /sim/requests`).
    pub log: parking_lot::Mutex<std::collections::VecDeque<Value>>,
}

/// Generation requests kept for `GET /sim/requests`.
pub const REQUEST_LOG_LEN: usize = 256;

/// The request id header vLLM echoes on its responses (`--enable-request-id-headers`); the
/// emulator always echoes it.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Routes one request.
pub async fn handle(
    st: Arc<HttpState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    let resp = match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => Ok(plain(StatusCode::OK, "")),
        (Method::GET, "/v1/models") => Ok(json_resp(StatusCode::OK, &models(&st))),
        (Method::GET, "/metrics") => Ok(metrics(&st)),
        (Method::GET, "/sim/requests") => Ok(json_resp(
            StatusCode::OK,
            &Value::Array(st.log.lock().iter().cloned().collect()),
        )),
        (Method::POST, "/v1/completions") => generate(st, ApiKind::Completions, req).await,
        (Method::POST, "/v1/chat/completions") => generate(st, ApiKind::ChatCompletions, req).await,
        (Method::POST, "/v1/responses") => generate(st, ApiKind::Responses, req).await,
        (Method::POST, "/tokenize") => tokenize(st, req).await,
        (Method::POST, "/reset_prefix_cache") => reset(st).await,
        _ => Ok(json_resp(
            StatusCode::NOT_FOUND,
            &json!({"detail": "Not Found"}),
        )),
    };
    Ok(resp.unwrap_or_else(|e| error_resp(&e)))
}

fn plain(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())).boxed());
    *r.status_mut() = status;
    r
}

fn json_resp(status: StatusCode, v: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

fn error_resp(e: &ApiError) -> Response<Body> {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    json_resp(status, &response::error_body(e.status, &e.message))
}

fn internal(msg: &str) -> ApiError {
    ApiError {
        status: 500,
        message: msg.to_string(),
    }
}

fn models(st: &HttpState) -> Value {
    json!({"object": "list", "data": [{"id": st.model, "object": "model", "created": unix_now(),
        "owned_by": "vllm", "root": st.model, "parent": null,
        "max_model_len": st.capacity_blocks * st.codec.block_size(), "permission": []}]})
}

/// `/metrics` in the Prometheus text format vLLM serves (`text/plain; version=0.0.4`): the
/// OpenMetrics encoding without its `# EOF` trailer.
fn metrics(st: &HttpState) -> Response<Body> {
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &st.registry) {
        return error_resp(&internal(&format!("metrics encoding failed: {e}")));
    }
    if let Some(body) = text.strip_suffix("# EOF\n") {
        text.truncate(body.len());
    }
    let mut r = Response::new(Full::new(Bytes::from(text)).boxed());
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn read_body(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    req.into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| ApiError::bad("body", &format!("could not read the request body: {e}")))
}

async fn reset(st: Arc<HttpState>) -> Result<Response<Body>, ApiError> {
    let (tx, rx) = oneshot::channel();
    st.engine
        .send(Command::Reset(tx))
        .map_err(|_| internal("engine stopped"))?;
    match rx.await {
        Ok(true) => Ok(plain(StatusCode::OK, "")),
        Ok(false) => Err(ApiError {
            status: 409,
            message: "requests are running; prefix cache not reset".into(),
        }),
        Err(_) => Err(internal("engine stopped")),
    }
}

/// `POST /tokenize`: `{"prompt"}` (completion ids) or `{"messages"}` (chat ids).
async fn tokenize(st: Arc<HttpState>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body = read_body(req).await?;
    let has_messages = serde_json::from_slice::<Value>(&body)
        .ok()
        .is_some_and(|v| v.get("messages").is_some());
    let api = if has_messages {
        ApiKind::ChatCompletions
    } else {
        ApiKind::Completions
    };
    let parsed = parse_request(api, &body, &st.model)?;
    let ids = encode(&st, &parsed)?;
    let max_len = st.capacity_blocks * st.codec.block_size();
    Ok(json_resp(
        StatusCode::OK,
        &json!({"count": ids.len(), "max_model_len": max_len, "tokens": &ids[..], "token_strs": null}),
    ))
}

fn encode(st: &HttpState, r: &SimRequest) -> Result<Arc<[u32]>, ApiError> {
    st.codec
        .encode(r.api, &r.prompt, r.add_special_tokens)
        .map_err(|e| ApiError::bad("prompt", &e.to_string()))
}

async fn generate(
    st: Arc<HttpState>,
    api: ApiKind,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let request_id = req.headers().get(REQUEST_ID_HEADER).cloned();
    let path = req.uri().path().to_string();
    let body = read_body(req).await?;
    let recv_ns = unix_nanos();
    let r = parse_request(api, &body, &st.model)?;
    let ids = encode(&st, &r)?;
    record(&st, &path, request_id.as_ref(), &r, ids.len());
    let resp = generate_parsed(st, api, r, ids, recv_ns).await?;
    Ok(echo_id(resp, request_id))
}

/// Logs one generation request for `GET /sim/requests`: its `X-Request-Id`, path,
/// `kv_transfer_params` as received, `stream`, `max_tokens` and prompt length in tokens.
fn record(
    st: &HttpState,
    path: &str,
    request_id: Option<&header::HeaderValue>,
    r: &SimRequest,
    prompt_tokens: usize,
) {
    let entry = json!({
        "request_id": request_id.and_then(|v| v.to_str().ok()),
        "path": path,
        "kv_transfer_params": r.kv_transfer.as_ref().map(|k| k.raw.clone()),
        "stream": r.stream,
        "max_tokens": r.max_tokens,
        "prompt_tokens": prompt_tokens,
    });
    let mut log = st.log.lock();
    if log.len() >= REQUEST_LOG_LEN {
        log.pop_front();
    }
    log.push_back(entry);
}

fn echo_id(mut r: Response<Body>, id: Option<header::HeaderValue>) -> Response<Body> {
    if let Some(v) = id {
        r.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    r
}

async fn generate_parsed(
    st: Arc<HttpState>,
    api: ApiKind,
    r: SimRequest,
    ids: Arc<[u32]>,
    recv_ns: u128,
) -> Result<Response<Body>, ApiError> {
    let bs = st.codec.block_size();
    if ids.is_empty() {
        return Err(ApiError::bad("prompt", "encodes to no tokens"));
    }
    if (ids.len() + r.max_tokens).div_ceil(bs) > st.capacity_blocks {
        return Err(ApiError::bad(
            "prompt",
            &format!(
                "{} prompt + {} max_tokens do not fit the KV cache",
                ids.len(),
                r.max_tokens
            ),
        ));
    }
    let remote_prefill =
        st.kv_role.consumes() && r.kv_transfer.as_ref().is_some_and(|k| k.do_remote_prefill);
    let (tx, rx) = mpsc::unbounded_channel();
    let seq = SeqRequest {
        prompt_hashes: st.codec.hash_prompt(&ids, &r.extras),
        prompt: ids,
        extras: r.extras.clone(),
        max_tokens: r.max_tokens,
        remote_prefill,
        skip_prefix_cache: r.skip_prefix_cache,
        report_all_blocks: r.report_all_blocks,
        events: tx,
    };
    st.engine
        .send(Command::Submit(seq))
        .map_err(|_| internal("engine stopped"))?;
    let meta = resp_meta(&st, api);
    if r.stream {
        return Ok(stamp(
            stream_response(st, meta, r.include_usage, rx),
            recv_ns,
        ));
    }
    let (text, summary) = collect(&st.codec, rx)
        .await
        .ok_or_else(|| internal("engine dropped the request"))?;
    let kv = transfer_params(&st, &r, &summary);
    let body = response::full_body(&meta, &text, &summary, kv);
    Ok(stamp(
        sim_times(json_resp(StatusCode::OK, &body), &summary),
        recv_ns,
    ))
}

/// `x-sim-ttft-s` / `x-sim-e2e-s`: the request's simulated TTFT and latency in seconds, exact
/// (free of real-time jitter), for benchmarks running at small `--time-scale`. Streams carry the
/// same values in an SSE comment before `data: [DONE]`.
fn sim_times(mut r: Response<Body>, s: &SeqSummary) -> Response<Body> {
    for (name, v) in [("x-sim-ttft-s", s.ttft_s), ("x-sim-e2e-s", s.e2e_s)] {
        if let Ok(v) = header::HeaderValue::from_str(&format!("{v:.6}")) {
            r.headers_mut().insert(name, v);
        }
    }
    r
}

// Benchmark timing headers (added by the benchmark, `bench::client::Outcome::added_ms`).

/// Wall-clock Unix time in ns (the client compares it with its own clock on the same host).
fn unix_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Stamps `x-sim-recv-unix-ns` (the full request had been read) and `x-sim-respond-unix-ns`
/// (the response head is handed to hyper now), so a client can compute the latency a gateway
/// adds: `(recv - client send) + (client head - respond)`.
fn stamp(mut r: Response<Body>, recv_ns: u128) -> Response<Body> {
    let now = unix_nanos();
    for (name, ns) in [
        ("x-sim-recv-unix-ns", recv_ns),
        ("x-sim-respond-unix-ns", now),
    ] {
        if let Ok(v) = header::HeaderValue::from_str(&ns.to_string()) {
            r.headers_mut().insert(name, v);
        }
    }
    r
}

fn resp_meta(st: &HttpState, api: ApiKind) -> RespMeta {
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = match api {
        ApiKind::ChatCompletions => "chatcmpl-",
        ApiKind::Responses => "resp_",
        _ => "cmpl-",
    };
    RespMeta {
        id: format!("{prefix}sim{n:012x}"),
        created: unix_now(),
        model: st.model.clone(),
        api,
    }
}

/// P/D producer answer (vLLM NixlConnector shape) when the request asked for remote decode.
fn transfer_params(st: &HttpState, r: &SimRequest, s: &SeqSummary) -> Option<Value> {
    let wants = r.kv_transfer.as_ref().is_some_and(|k| k.do_remote_decode);
    if !st.kv_role.produces() || !wants {
        return None;
    }
    Some(json!({
        "do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": s.block_ids, "remote_engine_id": format!("vllm-sim-{}", st.advertised.1),
        "remote_host": st.advertised.0, "remote_port": st.advertised.1, "tp_size": 1,
    }))
}

async fn collect(
    codec: &PromptCodec,
    mut rx: mpsc::UnboundedReceiver<SeqEvent>,
) -> Option<(String, SeqSummary)> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            SeqEvent::Token(t) => text.push_str(&codec.decode_token(t)),
            SeqEvent::Done(s) => return Some((text, s)),
        }
    }
    None
}

struct StreamState {
    st: Arc<HttpState>,
    meta: RespMeta,
    include_usage: bool,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    text: String,
    sent_first: bool,
    done: bool,
}

fn stream_response(
    st: Arc<HttpState>,
    meta: RespMeta,
    include_usage: bool,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
) -> Response<Body> {
    let opening = response::opening_chunk(&meta);
    let init = StreamState {
        st,
        meta,
        include_usage,
        rx,
        text: String::new(),
        sent_first: false,
        done: false,
    };
    let chunks = futures::stream::unfold(init, |mut s| async move {
        if s.done {
            return None;
        }
        let out = match s.rx.recv().await {
            Some(SeqEvent::Token(t)) => {
                let delta = s.st.codec.decode_token(t);
                s.text.push_str(&delta);
                let c = response::delta_chunk(&s.meta, &delta, !s.sent_first);
                s.sent_first = true;
                c
            }
            Some(SeqEvent::Done(sum)) => {
                s.done = true;
                response::final_chunks(&s.meta, &s.text, &sum, s.include_usage)
            }
            None => return None,
        };
        Some((Ok::<_, Infallible>(Frame::data(Bytes::from(out))), s))
    });
    let head = futures::stream::iter(
        (!opening.is_empty()).then(|| Ok::<_, Infallible>(Frame::data(Bytes::from(opening)))),
    );
    let body = BodyExt::boxed(StreamBody::new(head.chain(chunks)));
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    r
}
