//! `vllm-sim`: an emulator of a vLLM OpenAI server, good enough to benchmark KV-aware routing.
//!
//! It serves the OpenAI API like vLLM 0.32 (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/responses`, streaming or not, `/v1/models`, `POST /tokenize`, `/health`, `/metrics`,
//! `POST /reset_prefix_cache`), tokenizes with the model's real tokenizer and chat template and
//! hashes blocks with vLLM's contract (both reused from `loxi_user::kv`), keeps a prefix cache of
//! `--num-gpu-blocks` blocks with vLLM's block-pool semantics (LRU of unreferenced blocks, lazy
//! eviction, unhashed blocks reused first), publishes KV events on ZMQ exactly as vLLM does (see
//! `../shared/golden/README.md`; the capture's prompt frames are reproduced byte for byte), and
//! times requests with a simulated clock: TTFT = queueing + prefill of the uncached prompt
//! tokens; decode in continuous-batching steps. `--time-scale` shrinks every simulated delay;
//! metrics report simulated seconds.
//!
//! Interface for scripts and benchmarks (beyond vLLM's own):
//! - stdout line once every socket is bound: `VLLM_SIM_READY http=HOST:PORT pub=EP|- replay=EP|-`
//!   (ports 0 let the OS choose);
//! - response headers `x-sim-recv-unix-ns` / `x-sim-respond-unix-ns` (wall clock, for the
//!   latency a gateway adds) and, on non-streaming responses, `x-sim-ttft-s` / `x-sim-e2e-s`
//!   (exact simulated seconds); streams carry the latter two in an SSE comment
//!   `: vllm-sim ttft_s=… e2e_s=…` before `data: [DONE]`;
//! - `GET /sim/requests`: the last 256 generation requests as received (`request_id` from
//!   `X-Request-Id`, `path`, `kv_transfer_params`, `stream`, `max_tokens`, `prompt_tokens`), so a
//!   P/D test can check what each leg was sent; `X-Request-Id` is echoed on every response (vLLM
//!   does so with `--enable-request-id-headers`).
//!
//! P/D (`--kv-role`): a `producer` answers a request whose `kv_transfer_params` has
//! `do_remote_decode: true` with NixlConnector-shaped `kv_transfer_params`; a `consumer` given
//! `do_remote_prefill: true` treats every prompt token but the last as transferred (vLLM
//! recomputes the last one), so it prefills one token, counted in
//! `vllm:prompt_tokens_by_source_total{source="local_compute"}` (the rest under
//! `external_kv_transfer`).
//!
//! Modules: [`config`] (flags), [`timing`] (step durations, simulated clock), [`block_pool`]
//! (prefix cache), [`events`] (msgpack wire encoding), [`publisher`] (ZMQ PUB + replay ROUTER),
//! [`prompt`] (tokenize + hash), [`seq`] (one request in the engine), [`engine`] (scheduler
//! loop), [`metrics`] (vLLM families), [`openai`] (request parsing), [`response`] (response
//! bodies), [`http`] (hyper server), [`server`] (wiring).

pub mod block_pool;
pub mod config;
pub mod engine;
pub mod events;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod prompt;
pub mod publisher;
pub mod response;
pub mod seq;
pub mod server;
pub mod timing;
