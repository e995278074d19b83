//! `vllm-sim`: an emulator of a vLLM OpenAI server, good enough to benchmark KV-aware routing.
//!
//! It serves the OpenAI API like vLLM 0.32 (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/responses`, `/v1/models`, `POST /tokenize`, `/health`, `/metrics`,
//! `POST /reset_prefix_cache`), keeps a prefix cache of `--num-gpu-blocks` blocks with vLLM's
//! block-pool semantics (LRU of unreferenced blocks, lazy eviction), publishes KV events on ZMQ
//! exactly as vLLM does (see `../shared/golden/README.md`), and times requests with a simulated
//! clock: TTFT = queueing + prefill of the uncached prompt tokens; decode in continuous-batching
//! steps. `--time-scale` shrinks every simulated delay; metrics report simulated seconds.
//!
//! Modules: [`config`] (flags), [`timing`] (step durations, simulated clock), [`block_pool`]
//! (prefix cache), [`events`] (msgpack wire encoding), [`publisher`] (ZMQ PUB + replay ROUTER),
//! [`prompt`] (tokenize + hash), [`engine`] (scheduler loop), [`metrics`] (vLLM families),
//! [`openai`] (request parsing, response bodies), [`http`] (hyper server), [`server`] (wiring).

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
