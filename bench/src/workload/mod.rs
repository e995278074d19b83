//! Seeded, reproducible benchmark workloads.
//!
//! Three generators produce a [`Workload`]: a list of [`WorkRequest`]s, each with its arrival
//! offset from the start of the run, its OpenAI payload and, for multi-turn conversations, the
//! request it must wait for. The same seed and parameters always produce the same workload
//! (byte-identical prompts, identical offsets).
//!
//! - [`shared_prefix`]: groups × prompts sharing a system prompt (inference-perf `shared_prefix`).
//! - [`multi_turn`]: users × rounds with a shared system prompt and growing history
//!   (production-stack multi-round QA), sent as chat requests.
//! - [`trace`]: replay of a Mooncake-format JSONL trace (`{timestamp, input_length,
//!   output_length, hash_ids}`), each hash id one block of tokens shared by every request that
//!   names it.
//!
//! Prompt text is built from [`vocab::Vocab`]: words that each encode to exactly one token of the
//! tiny model's tokenizer, so a text of `n` words is `n` tokens long.

pub mod arrival;
pub mod multi_turn;
pub mod shared_prefix;
pub mod trace;
pub mod vocab;

use serde::{Deserialize, Serialize};
use std::time::Duration;

pub use arrival::Arrival;
pub use vocab::Vocab;

/// One chat message (`{"role", "content"}`), as the OpenAI chat API takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: role.to_string(),
            content: content.into(),
        }
    }
}

/// What a request sends: a completion prompt or a chat conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// `POST /v1/completions` with `prompt`.
    Completion(String),
    /// `POST /v1/chat/completions` with `messages`.
    Chat(Vec<ChatMessage>),
}

impl Payload {
    /// The OpenAI path this payload is posted to.
    pub fn path(&self) -> &'static str {
        match self {
            Payload::Completion(_) => "/v1/completions",
            Payload::Chat(_) => "/v1/chat/completions",
        }
    }

    /// The streaming request body for `model` with `max_tokens` output tokens.
    pub fn body(&self, model: &str, max_tokens: u32) -> serde_json::Value {
        let mut body = serde_json::json!({
            "model": model,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        match self {
            Payload::Completion(p) => body["prompt"] = serde_json::json!(p),
            Payload::Chat(m) => body["messages"] = serde_json::json!(m),
        }
        body
    }
}

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkRequest {
    /// Index in [`Workload::requests`] (requests are sorted by `at`).
    pub id: usize,
    /// Arrival offset from the start of the run.
    pub at: Duration,
    /// What is sent.
    pub payload: Payload,
    /// Output tokens asked for (`max_tokens` = `min_tokens`, `ignore_eos`).
    pub max_tokens: u32,
    /// A request that must complete before this one is sent (the previous round of a
    /// conversation); `None` for independent requests.
    pub after: Option<usize>,
    /// Sharing unit: the prefix group, the user, or the trace's first hash id.
    pub group: usize,
}

/// A named, ordered list of requests for one model.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Short name used in reports (`shared_prefix`, `multi_turn`, `trace`).
    pub name: String,
    /// Requests sorted by arrival offset; `requests[i].id == i`.
    pub requests: Vec<WorkRequest>,
    /// Closed-loop concurrency for this workload (0 = the run's `--concurrency`).
    pub concurrency: usize,
}

impl Workload {
    /// Builds a workload from unsorted requests, sorting by arrival and renumbering ids
    /// (remapping `after` links to the new ids).
    pub fn new(name: &str, mut requests: Vec<WorkRequest>) -> Self {
        requests.sort_by_key(|r| (r.at, r.id));
        let mut remap = vec![0usize; requests.len()];
        for (new, r) in requests.iter().enumerate() {
            remap[r.id] = new;
        }
        for (new, r) in requests.iter_mut().enumerate() {
            r.id = new;
            r.after = r.after.map(|a| remap[a]);
        }
        Self {
            name: name.to_string(),
            requests,
            concurrency: 0,
        }
    }

    /// Scheduled duration: the last arrival offset.
    pub fn span(&self) -> Duration {
        self.requests.last().map(|r| r.at).unwrap_or_default()
    }

    /// `drop` (by request id; shorter = false for the rest) extended to every request that
    /// waits for a dropped one through `after`, transitively: one flag per request.
    pub fn with_followers(&self, drop: &[bool]) -> Vec<bool> {
        let mut gone = vec![false; self.requests.len()];
        // `after` always names an earlier request (arrival order), so one pass is transitive.
        for r in &self.requests {
            gone[r.id] = drop.get(r.id).copied().unwrap_or(false)
                || r.after
                    .is_some_and(|a| gone.get(a).copied().unwrap_or(false));
        }
        gone
    }

    /// This workload without the requests whose `drop[id]` is true, nor any request that
    /// waits (through `after`, transitively) for a dropped one: a conversation round cannot be
    /// sent without its predecessor. Ids are renumbered in order. Returns the workload and the
    /// number of requests removed. `drop` shorter than the workload keeps the rest.
    pub fn excluding(&self, drop: &[bool]) -> (Workload, usize) {
        let gone = self.with_followers(drop);
        let mut new_id = vec![0usize; self.requests.len()];
        let mut kept: Vec<WorkRequest> = Vec::with_capacity(self.requests.len());
        for r in self.requests.iter().filter(|r| !gone[r.id]) {
            new_id[r.id] = kept.len();
            kept.push(WorkRequest {
                id: kept.len(),
                after: r.after.map(|a| new_id[a]),
                ..r.clone()
            });
        }
        let removed = self.requests.len() - kept.len();
        let w = Workload {
            name: self.name.clone(),
            requests: kept,
            concurrency: self.concurrency,
        };
        (w, removed)
    }
}

/// Whether a prompt of `prompt_tokens` plus `max_tokens` output fits an engine whose KV cache
/// holds `usable_blocks` blocks of `block_size` tokens (vLLM and vllm-sim refuse it otherwise:
/// `… do not fit the KV cache`). `block_size` 0 is taken as 1.
pub fn fits_cache(
    prompt_tokens: usize,
    max_tokens: u32,
    block_size: usize,
    usable_blocks: usize,
) -> bool {
    (prompt_tokens + max_tokens as usize).div_ceil(block_size.max(1)) <= usable_blocks
}

/// Errors from building a workload.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file's content is not what was expected.
    #[error("{path}: {msg}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong, naming the field.
        msg: String,
    },
    /// A parameter is out of range.
    #[error("invalid parameter {field}: {msg}")]
    Param {
        /// The parameter name.
        field: &'static str,
        /// Why.
        msg: String,
    },
}

#[cfg(test)]
mod tests;
