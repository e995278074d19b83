//! Trace replay in the Mooncake format, and a seeded generator of such traces.
//!
//! A trace is JSONL, one request per line: `{"timestamp": ms, "input_length": tokens,
//! "output_length": tokens, "hash_ids": [u64, …]}`. Hash id `h` stands for one block of
//! `block_tokens` tokens (512 in Mooncake's published traces); every request naming `h` at the
//! same position gets the same tokens for it, so requests that share leading ids share a prompt
//! prefix. The last block is cut so the prompt is `input_length` tokens long (a prompt longer
//! than its blocks is padded with tokens unique to the request), then capped at
//! `max_prompt_tokens`.

use super::{Arrival, Payload, Vocab, WorkRequest, Workload, WorkloadError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

/// One trace line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival time, milliseconds from the trace start.
    pub timestamp: u64,
    /// Prompt length, tokens.
    pub input_length: usize,
    /// Output length, tokens.
    pub output_length: u32,
    /// Block ids of the prompt, in order.
    pub hash_ids: Vec<u64>,
}

/// How a trace becomes a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceReplay {
    /// Tokens per hash id (Mooncake: 512).
    pub block_tokens: usize,
    /// Prompts are cut to this many tokens (the model's context limit minus output).
    pub max_prompt_tokens: usize,
    /// Output tokens are capped to this.
    pub max_output_tokens: u32,
    /// `None`: replay the trace's timestamps divided by `speedup`; `Some`: draw new offsets.
    pub arrival: Option<Arrival>,
    /// Timestamp compression factor (2.0 = twice as fast); used when `arrival` is `None`.
    pub speedup: f64,
    /// Seed for the block texts, the padding and the arrival draw.
    pub seed: u64,
}

/// KV blocks per worker (vLLM's `num_gpu_blocks`, block 0 included) so that every replayed
/// prompt fits an engine with `block_size`-token blocks: a prompt of at most
/// `max_prompt_tokens` tokens, one block of slack for the special tokens the tokenizer adds
/// (BOS), `max_output_tokens` of output, and vLLM's null block. Trace mode's default cache
/// size, so that no request fails with `… do not fit the KV cache`.
pub fn cache_blocks_for(
    max_prompt_tokens: usize,
    max_output_tokens: u32,
    block_size: usize,
) -> usize {
    let bs = block_size.max(1);
    (max_prompt_tokens + bs + max_output_tokens as usize).div_ceil(bs) + 1
}

/// Reads a JSONL trace. Errors name the line and the field serde rejected.
pub fn read_trace(path: &Path) -> Result<Vec<TraceRecord>, WorkloadError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
        path: shown.clone(),
        source,
    })?;
    parse_trace(&text).map_err(|msg| WorkloadError::Format { path: shown, msg })
}

/// Parses JSONL trace text (blank lines skipped). The error names the 1-based line.
pub fn parse_trace(text: &str) -> Result<Vec<TraceRecord>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("line {}: {e}", i + 1)))
        .collect()
}

impl TraceReplay {
    /// Builds the workload from trace records (in any order; sorted by arrival).
    pub fn build(&self, vocab: &Vocab, records: &[TraceRecord]) -> Result<Workload, WorkloadError> {
        if self.block_tokens == 0 {
            return Err(WorkloadError::Param {
                field: "block_tokens",
                msg: "must be ≥ 1".into(),
            });
        }
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut blocks = BlockTexts::new(vocab, self.seed, self.block_tokens);
        let offsets = match self.arrival {
            Some(a) => a.offsets(records.len(), &mut rng),
            None => records.iter().map(|r| self.replayed(r.timestamp)).collect(),
        };
        let requests = records
            .iter()
            .zip(offsets)
            .enumerate()
            .map(|(id, (r, at))| WorkRequest {
                id,
                at,
                payload: Payload::Completion(self.prompt(r, &mut blocks, &mut rng)),
                max_tokens: r.output_length.clamp(1, self.max_output_tokens.max(1)),
                after: None,
                group: r.hash_ids.first().copied().unwrap_or(0) as usize,
            })
            .collect();
        Ok(Workload::new("trace", requests))
    }

    fn replayed(&self, ms: u64) -> Duration {
        let speedup = if self.speedup > 0.0 {
            self.speedup
        } else {
            1.0
        };
        Duration::from_secs_f64(ms as f64 / 1000.0 / speedup)
    }

    /// The prompt: the blocks' words, cut/padded to `input_length`, capped at the limit.
    fn prompt(&self, r: &TraceRecord, blocks: &mut BlockTexts<'_>, rng: &mut StdRng) -> String {
        let len = r.input_length.min(self.max_prompt_tokens).max(1);
        let mut out = String::new();
        let mut used = 0usize;
        for h in &r.hash_ids {
            if used >= len {
                break;
            }
            let take = (len - used).min(self.block_tokens);
            out.extend(blocks.get(*h).iter().take(take).map(String::as_str));
            used += take;
        }
        out.push_str(&blocks.vocab.text(rng, len - used));
        out
    }
}

/// Lazily generated word lists per hash id, each seeded by (seed, id) only.
struct BlockTexts<'a> {
    vocab: &'a Vocab,
    seed: u64,
    block_tokens: usize,
    cache: HashMap<u64, Vec<String>>,
}

impl<'a> BlockTexts<'a> {
    fn new(vocab: &'a Vocab, seed: u64, block_tokens: usize) -> Self {
        Self {
            vocab,
            seed,
            block_tokens,
            cache: HashMap::new(),
        }
    }

    fn get(&mut self, id: u64) -> &[String] {
        let (vocab, seed, n) = (self.vocab, self.seed, self.block_tokens);
        self.cache.entry(id).or_insert_with(|| {
            let mut rng = StdRng::seed_from_u64(seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            (0..n).map(|_| vocab.text(&mut rng, 1)).collect()
        })
    }
}

/// Parameters of a synthetic Mooncake-format trace.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthTrace {
    /// Number of requests.
    pub requests: usize,
    /// Distinct shared documents (prefix pools).
    pub documents: usize,
    /// Blocks per document (shared prefix length in blocks).
    pub doc_blocks: usize,
    /// Unique blocks appended per request (0..=this, uniform).
    pub max_unique_blocks: usize,
    /// Tokens per block (the `block_tokens` of the replay).
    pub block_tokens: usize,
    /// Output length per request.
    pub output_length: u32,
    /// Arrival schedule for the timestamps.
    pub arrival: Arrival,
    /// RNG seed.
    pub seed: u64,
}

impl SynthTrace {
    /// Generates records: each request picks a document with a Zipf-like weight `1/(k+1)`,
    /// uses a random-length prefix of its blocks (at least half), then unique blocks.
    pub fn generate(&self) -> Vec<TraceRecord> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let offsets = self.arrival.offsets(self.requests, &mut rng);
        let weights: Vec<f64> = (0..self.documents.max(1))
            .map(|k| 1.0 / (k as f64 + 1.0))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut next_unique = (self.documents.max(1) * self.doc_blocks) as u64;
        offsets
            .into_iter()
            .map(|at| {
                let doc = pick(&weights, total, rng.random::<f64>());
                let keep = rng.random_range(self.doc_blocks.div_ceil(2)..=self.doc_blocks);
                let mut ids: Vec<u64> = (0..keep)
                    .map(|b| (doc * self.doc_blocks + b) as u64)
                    .collect();
                for _ in 0..rng.random_range(0..=self.max_unique_blocks) {
                    ids.push(next_unique);
                    next_unique += 1;
                }
                let input_length = ids.len().max(1) * self.block_tokens;
                let timestamp = at.as_millis() as u64;
                TraceRecord {
                    timestamp,
                    input_length,
                    output_length: self.output_length,
                    hash_ids: ids,
                }
            })
            .collect()
    }
}

fn pick(weights: &[f64], total: f64, u: f64) -> usize {
    let mut acc = 0.0;
    for (i, w) in weights.iter().enumerate() {
        acc += w / total;
        if u < acc {
            return i;
        }
    }
    weights.len() - 1
}

/// Writes records as JSONL.
pub fn write_trace(path: &Path, records: &[TraceRecord]) -> std::io::Result<()> {
    let mut out = String::new();
    for r in records {
        out.push_str(&serde_json::to_string(r).map_err(std::io::Error::other)?);
        out.push('\n');
    }
    std::fs::write(path, out)
}
