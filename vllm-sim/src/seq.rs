//! One sequence (request) inside the engine, and what the engine reports back to the HTTP side.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::block_pool::BlockId;
use super::prompt::{Digest, RequestExtras};

/// A request as the HTTP side submits it.
#[derive(Debug)]
pub struct SeqRequest {
    /// Prompt token ids.
    pub prompt: Arc<[u32]>,
    /// Digests of the prompt's full blocks.
    pub prompt_hashes: Vec<Digest>,
    /// LoRA / cache salt.
    pub extras: RequestExtras,
    /// Tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// P/D consumer: the prompt's KV arrives by transfer, so prefilling it costs nothing.
    pub remote_prefill: bool,
    /// Do not read the prefix cache (blocks computed are still stored).
    pub skip_prefix_cache: bool,
    /// Report hit blocks again in this request's first `BlockStored`.
    pub report_all_blocks: bool,
    /// Where tokens and the final summary go.
    pub events: mpsc::UnboundedSender<SeqEvent>,
}

/// What the engine tells a request's HTTP handler.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// One generated token id.
    Token(u32),
    /// The request finished.
    Done(SeqSummary),
}

/// Accounting of a finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqSummary {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Simulated seconds from arrival to the first token.
    pub ttft_s: f64,
    /// Simulated seconds from arrival to the end.
    pub e2e_s: f64,
    /// Block ids the request held (P/D producer: `remote_block_ids`).
    pub block_ids: Vec<BlockId>,
}

/// Engine-side state of one request.
#[derive(Debug)]
pub struct Seq {
    /// The submitted request.
    pub req: SeqRequest,
    /// Generated token ids so far.
    pub output: Vec<u32>,
    /// Blocks held, in order.
    pub block_ids: Vec<BlockId>,
    /// Digests of every full block known (prompt blocks first, then generated ones).
    pub hashes: Vec<Digest>,
    /// Tokens whose KV is computed (or loaded).
    pub num_computed: usize,
    /// Leading blocks already cached in the pool (hashed and inserted).
    pub num_stored: usize,
    /// Prompt tokens that were prefix-cache hits at first admission.
    pub cached_tokens: usize,
    /// True once admitted at least once (hits are counted on the first admission).
    pub admitted_once: bool,
    /// Simulated arrival time.
    pub arrival_s: f64,
    /// Simulated time of the first token.
    pub first_token_s: Option<f64>,
    /// The client went away; the sequence is dropped at the end of the step.
    pub aborted: bool,
}

impl Seq {
    /// A waiting sequence that arrived at simulated time `arrival_s`.
    pub fn new(req: SeqRequest, arrival_s: f64) -> Self {
        let hashes = req.prompt_hashes.clone();
        Self {
            req,
            output: Vec::new(),
            block_ids: Vec::new(),
            hashes,
            num_computed: 0,
            num_stored: 0,
            cached_tokens: 0,
            admitted_once: false,
            arrival_s,
            first_token_s: None,
            aborted: false,
        }
    }

    /// Prompt plus generated tokens.
    pub fn total_tokens(&self) -> usize {
        self.req.prompt.len() + self.output.len()
    }

    /// Token `i` of prompt ++ output.
    pub fn token(&self, i: usize) -> u32 {
        let p = self.req.prompt.len();
        if i < p {
            self.req.prompt[i]
        } else {
            self.output[i - p]
        }
    }

    /// True while prompt tokens remain to be computed.
    pub fn in_prefill(&self) -> bool {
        self.num_computed < self.req.prompt.len()
    }

    /// True when the request has generated all it may, or was aborted.
    pub fn is_finished(&self) -> bool {
        self.aborted || self.output.len() >= self.req.max_tokens
    }

    /// The filler token generated at output position `i` (deterministic).
    pub fn filler_token(&self) -> u32 {
        let i = self.output.len() as u32;
        100 + (i
            .wrapping_mul(37)
            .wrapping_add(self.req.prompt.len() as u32))
            % 1000
    }

    /// The summary after the request finished at simulated time `now_s`.
    pub fn summary(&self, now_s: f64) -> SeqSummary {
        SeqSummary {
            prompt_tokens: self.req.prompt.len(),
            cached_tokens: self.cached_tokens,
            completion_tokens: self.output.len(),
            ttft_s: self.first_token_s.unwrap_or(now_s) - self.arrival_s,
            e2e_s: now_s - self.arrival_s,
            block_ids: self.block_ids.clone(),
        }
    }
}
