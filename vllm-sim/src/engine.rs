//! The engine loop: a continuous-batching scheduler over the block pool, stepping a simulated
//! clock (vLLM v1's scheduler, simplified).
//!
//! Each step: running sequences first (one decode token each, or their next prefill chunk),
//! then waiting ones in FIFO order while `running < max_num_seqs`, the token budget lasts and
//! blocks can be allocated. Admission looks up the leading cached full blocks (at most
//! `(tokens - 1) / block_size`, since vLLM always computes at least one token). Blocks are hashed
//! and cached as soon as they are scheduled full, producing one `BlockStored` per request per step;
//! evictions produce `BlockRemoved`. The step lasts `TimingModel::step_seconds`; the loop sleeps
//! until that simulated instant, then emits tokens, finishes requests and publishes the step's
//! events as one batch. When a running sequence cannot get a block, the newest running sequence
//! is preempted (its blocks freed, recomputed later), as vLLM does.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};

use super::block_pool::BlockPool;
use super::events::{KvEvent, WireFormat, encode_batch};
use super::metrics::SimMetrics;
use super::prompt::PromptCodec;
use super::publisher::Publisher;
use super::seq::{Seq, SeqEvent, SeqRequest};
use super::timing::{SimClock, TimingModel};

/// Real seconds the engine may trail the wall clock before its simulated time is pulled
/// forward (absorbs timer oversleep without stretching simulated time).
const MAX_LAG_REAL_S: f64 = 0.005;

/// Commands the HTTP side sends to the engine.
#[derive(Debug)]
pub enum Command {
    /// Schedule a request.
    Submit(SeqRequest),
    /// `POST /reset_prefix_cache`; answers whether the cache was reset.
    Reset(oneshot::Sender<bool>),
}

/// Engine limits and parts.
#[derive(Debug)]
pub struct EngineParts {
    /// Block pool of `num_gpu_blocks`.
    pub pool: BlockPool,
    /// Tokenizer / hasher (for generated blocks).
    pub codec: Arc<PromptCodec>,
    /// Step durations.
    pub timing: TimingModel,
    /// Simulated clock.
    pub clock: SimClock,
    /// Metric handles.
    pub metrics: SimMetrics,
    /// KV-event publisher, when enabled.
    pub publisher: Option<Publisher>,
    /// Event wire format.
    pub wire: WireFormat,
    /// `--max-num-seqs`.
    pub max_num_seqs: usize,
    /// `--max-num-batched-tokens`.
    pub max_num_batched_tokens: usize,
}

/// The engine state (owned by one task).
#[derive(Debug)]
pub struct Engine {
    p: EngineParts,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    sim_now: f64,
    step_start_s: f64,
}

/// What one step scheduled: (index into `running`, tokens) pairs.
struct Plan {
    work: Vec<(usize, usize)>,
    prefill_tokens: usize,
    decode_seqs: usize,
}

impl Engine {
    /// A new idle engine.
    pub fn new(parts: EngineParts) -> Self {
        Self {
            p: parts,
            waiting: VecDeque::new(),
            running: Vec::new(),
            sim_now: 0.0,
            step_start_s: 0.0,
        }
    }

    /// Runs until every command sender is dropped and the work is done.
    pub async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        loop {
            if self.idle() {
                match rx.recv().await {
                    Some(c) => self.handle(c),
                    None => return,
                }
            }
            while let Ok(c) = rx.try_recv() {
                self.handle(c);
            }
            if !self.idle() {
                self.step().await;
            }
        }
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Submit(req) => {
                let now = self.p.clock.now_sim();
                self.waiting.push_back(Seq::new(req, now));
            }
            Command::Reset(tx) => {
                let _ = tx.send(self.p.pool.reset());
            }
        }
    }

    /// Simulated start of the next step: right after the previous one while the engine keeps
    /// up (timer oversleep must not stretch simulated time), or now when it was idle or has
    /// fallen more than [`MAX_LAG_REAL_S`] of real time behind.
    fn step_start(&self) -> f64 {
        let now = self.p.clock.now_sim();
        let lag_real = (now - self.sim_now) * self.p.clock.scale();
        if self.running.is_empty() || lag_real > MAX_LAG_REAL_S {
            now.max(self.sim_now)
        } else {
            self.sim_now
        }
    }

    async fn step(&mut self) {
        let start = self.step_start();
        self.step_start_s = start;
        let plan = self.schedule();
        let dur = self
            .p
            .timing
            .step_seconds(plan.prefill_tokens, plan.decode_seqs);
        self.sim_now = start + dur;
        tokio::time::sleep_until(self.p.clock.real_at(self.sim_now)).await;
        self.complete(&plan);
        self.publish();
        self.p
            .metrics
            .set_load(self.waiting.len(), self.running.len(), self.p.pool.usage());
        if plan.work.is_empty() {
            // Nothing fit (cannot happen with a validated prompt size); avoid spinning.
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    fn schedule(&mut self) -> Plan {
        let mut plan = Plan {
            work: Vec::new(),
            prefill_tokens: 0,
            decode_seqs: 0,
        };
        let mut budget = self.p.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let n = (self.running[i].total_tokens() - self.running[i].num_computed).min(budget);
            if !self.grow(i, n) {
                break; // `i` itself was preempted
            }
            budget -= n;
            self.account(&mut plan, i, n);
            i += 1;
        }
        while budget > 0 && self.running.len() < self.p.max_num_seqs {
            let Some(n) = self.admit_front(budget) else {
                break;
            };
            budget -= n;
            self.account(&mut plan, self.running.len() - 1, n);
        }
        plan
    }

    /// Records `n` tokens of running sequence `i` in the plan and advances it (vLLM caches the
    /// blocks right after allocating them, so each request's removals precede its stores).
    fn account(&mut self, plan: &mut Plan, i: usize, n: usize) {
        let s = &self.running[i];
        if s.in_prefill() && !s.req.remote_prefill {
            plan.prefill_tokens += n;
        } else {
            plan.decode_seqs += 1;
        }
        plan.work.push((i, n));
        self.advance(i, n);
    }

    /// Gives running sequence `i` blocks for `n` more tokens, preempting the newest running
    /// sequences while blocks are short. False when `i` itself had to be preempted.
    fn grow(&mut self, i: usize, n: usize) -> bool {
        let bs = self.p.codec.block_size();
        loop {
            let s = &self.running[i];
            let need = (s.num_computed + n)
                .div_ceil(bs)
                .saturating_sub(s.block_ids.len());
            if let Some(ids) = self.p.pool.allocate(need) {
                self.running[i].block_ids.extend(ids);
                return true;
            }
            let last = self.running.len() - 1;
            self.preempt_last();
            if last == i {
                return false;
            }
        }
    }

    fn preempt_last(&mut self) {
        let Some(mut s) = self.running.pop() else {
            return;
        };
        self.p.pool.free(&s.block_ids);
        s.block_ids.clear();
        s.num_computed = 0;
        s.num_stored = 0;
        self.waiting.push_front(s);
    }

    /// Admits the head of the waiting queue if its blocks fit; returns the tokens scheduled.
    fn admit_front(&mut self, budget: usize) -> Option<usize> {
        let bs = self.p.codec.block_size();
        let s = self.waiting.front()?;
        let max_hit = (s.total_tokens().saturating_sub(1)) / bs;
        let hit = if s.req.skip_prefix_cache {
            Vec::new()
        } else {
            self.p
                .pool
                .lookup_prefix(&s.hashes[..max_hit.min(s.hashes.len())])
        };
        let mut computed = hit.len() * bs;
        if s.req.remote_prefill && !s.admitted_once {
            computed = computed.max(s.req.prompt.len().saturating_sub(1));
        }
        let n = (s.total_tokens() - computed).min(budget);
        let need = (computed + n).div_ceil(bs) - hit.len();
        let free_hits = hit.iter().filter(|&&b| self.p.pool.is_free(b)).count();
        if self.p.pool.num_free() < need + free_hits {
            return None;
        }
        let mut s = self.waiting.pop_front()?;
        self.p.pool.touch(&hit);
        let fresh = self.p.pool.allocate(need)?;
        if !s.admitted_once {
            s.admitted_once = true;
            // Arrived within the jitter tolerance after the step's simulated start.
            s.arrival_s = s.arrival_s.min(self.step_start_s);
            s.cached_tokens = hit.len() * bs;
            self.p.metrics.admitted(s.req.prompt.len(), s.cached_tokens);
            let prompt = s.req.prompt.len();
            let known = computed.min(prompt);
            self.p.metrics.sources(
                prompt - known,
                s.cached_tokens.min(known),
                known.saturating_sub(s.cached_tokens),
            );
        }
        s.num_stored = if s.req.report_all_blocks {
            0
        } else {
            hit.len()
        };
        s.block_ids = hit;
        s.block_ids.extend(fresh);
        s.num_computed = computed;
        self.running.push(s);
        Some(n)
    }

    /// Marks `n` more tokens of running sequence `i` computed and caches newly full blocks.
    fn advance(&mut self, i: usize, n: usize) {
        let bs = self.p.codec.block_size();
        let s = &mut self.running[i];
        s.num_computed += n;
        let full = s.num_computed / bs;
        if full <= s.num_stored {
            return;
        }
        let first = s.num_stored;
        let mut token_ids = Vec::with_capacity((full - first) * bs);
        for b in first..full {
            if b >= s.hashes.len() {
                let toks: Vec<u32> = (b * bs..(b + 1) * bs).map(|t| s.token(t)).collect();
                let h = self
                    .p
                    .codec
                    .hash_block(s.hashes.last(), &toks, b, &s.req.extras);
                s.hashes.push(h);
            }
            token_ids.extend((b * bs..(b + 1) * bs).map(|t| s.token(t)));
            self.p.pool.cache(s.block_ids[b], s.hashes[b]);
        }
        s.num_stored = full;
        let ev = KvEvent::BlockStored {
            hashes: s.hashes[first..full].to_vec(),
            parent: first.checked_sub(1).map(|p| s.hashes[p]),
            token_ids,
            block_size: bs,
            lora_name: s.req.extras.lora.clone(),
            extra_keys: (first..full).map(|b| s.req.extras.published(b)).collect(),
        };
        self.p.pool.push_event(ev);
    }

    /// After the step: sample tokens for sequences that caught up, finish and free.
    fn complete(&mut self, plan: &Plan) {
        let mut prompt_done = 0;
        let mut generated = 0;
        for &(i, _) in &plan.work {
            let now = self.sim_now;
            let s = &mut self.running[i];
            if s.num_computed < s.total_tokens() {
                continue; // mid-prefill chunk
            }
            if s.first_token_s.is_none() {
                s.first_token_s = Some(now);
                self.p.metrics.first_token(now - s.arrival_s);
                prompt_done += s.req.prompt.len();
            }
            let tok = s.filler_token();
            s.output.push(tok);
            generated += 1;
            if s.req.events.send(SeqEvent::Token(tok)).is_err() {
                s.aborted = true; // client gone: vLLM aborts the request
            }
        }
        self.p.metrics.step_tokens(prompt_done, generated);
        self.finish_done();
    }

    fn finish_done(&mut self) {
        let now = self.sim_now;
        let mut k = 0;
        while k < self.running.len() {
            if !self.running[k].is_finished() {
                k += 1;
                continue;
            }
            let s = self.running.remove(k);
            let summary = s.summary(now);
            if !s.aborted {
                self.p.metrics.finished(summary.e2e_s);
            }
            self.p.pool.free(&s.block_ids);
            let _ = s.req.events.send(SeqEvent::Done(summary));
        }
    }

    fn publish(&mut self) {
        let events = self.p.pool.take_events();
        let Some(publisher) = &self.p.publisher else {
            return;
        };
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        match encode_batch(ts, &events, Some(0), self.p.wire) {
            Ok(payload) => publisher.publish(payload),
            Err(e) => tracing::warn!(error = %e, "kv events: encode failed"),
        }
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
