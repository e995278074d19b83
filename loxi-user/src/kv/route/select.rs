//! Tier 1.5 selection: the guard ladder, overlap scoring, the blend law, cold-start seeding.
//!
//! Guard ladder (LoxiLB's order and labels, `kv-cache-aware-routing.txt` §7, plus loxi's
//! `short_prompt`): `mode_off` (kvExactMode 0) → `warmup` (within `kvWarmupSec` of the first
//! subscriber connect; loxi arms it, default 0 = off) → `text_empty` → `model_empty` →
//! `tokenize` → `shallow` (fewer than `LLB_KV_MIN_MATCH_TOKENS` tokens) → `hashes` (LoRA adapter
//! without a path, or extras SGLang's contract cannot hash) → `short_prompt` (no full block: nothing is cacheable) → `no_worker`
//! (no endpoint holds the first block) → `excluded` (only excluded / unhealthy / unsubscribed
//! endpoints hold it). Then [`super::blend::blend`] and cold-start seeding. Every miss counts
//! one `loxilb_pd_kv_tier15_miss_reason_total` and one fallthrough; every hit one
//! `loxilb_pd_kv_tier15_hits_total{ep_idx}`.
//!
//! The prompt is tokenized and hashed once per request: the outcome of `text_empty` …
//! `short_prompt` (keys or the miss) is kept in the request's [`KvTicket`] with the service's
//! state, which a connect-failure retry and [`KvRouter::routed`] reuse. `warmup` is not kept: every attempt
//! checks it, and `routed` skips it (blocks of requests sent during warmup are still predicted).

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant as StdInstant;

use tokio::time::Instant;

use super::blend::{Cand, LawParams, blend};
pub use super::miss::MissReason;
use crate::kv::BlockKey;
use crate::kv::block_hash::RequestExtras;
use crate::kv::index::ScoreScratch;
use crate::kv::metrics::Stage;
use crate::kv::state::{KvState, ServiceKv};
use crate::request::{ApiKind, Prompt, RequestMeta};
use crate::routing::{Candidates, Decision, EpIdx, Reason};
use crate::rules::store::StoredRule;

/// Prompt → token ids for a model, exactly as the engine tokenizes for `api` (implemented over
/// the tokenizer pool by the app). Token-id prompts never reach it.
pub trait PromptTokenizer: Send + Sync + 'static {
    /// Token ids of `prompt`, or an error message (counted as `tokenize`).
    fn encode(
        &self,
        model: &str,
        api: ApiKind,
        prompt: &Prompt,
        add_special_tokens: Option<bool>,
    ) -> Result<Arc<[u32]>, String>;
}

impl PromptTokenizer for crate::kv::tokenizer::TokenizerPool {
    fn encode(
        &self,
        model: &str,
        api: ApiKind,
        prompt: &Prompt,
        add_special_tokens: Option<bool>,
    ) -> Result<Arc<[u32]>, String> {
        crate::kv::tokenizer::TokenizerPool::encode(self, model, api, prompt, add_special_tokens)
            .map_err(|e| e.to_string())
    }
}

/// What tier 1.5 keeps about one request between its calls (the first selection, a
/// connect-failure retry, and [`KvRouter::routed`] at each dispatch): the service's state,
/// resolved once, and the request's block keys or the guard (`text_empty` … `short_prompt`) that
/// stopped them. The proxy starts each request with `KvTicket::default()`.
#[derive(Default)]
pub struct KvTicket {
    svc: Option<Arc<ServiceKv>>,
    keys: Option<Result<Vec<BlockKey>, MissReason>>,
}

impl KvTicket {
    /// The request's block keys, once a call computed them.
    pub fn keys(&self) -> Option<&[BlockKey]> {
        self.keys.as_ref()?.as_deref().ok()
    }

    /// The service's state (resolved on the first call; `None` when the rule has tier 1.5 off).
    fn service(&mut self, state: &KvState, rule: &StoredRule) -> Option<Arc<ServiceKv>> {
        if self.svc.is_none() {
            self.svc = state.service(rule);
        }
        self.svc.clone()
    }
}

/// Reused per-thread buffers of one decision (scores and law candidates), so that a decision
/// allocates nothing once a thread has served a request of that size.
#[derive(Default)]
struct Scratch {
    score: ScoreScratch,
    cands: Vec<Cand>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Tier 1.5: implements the proxy's affinity-tier seam (`select` / `routed`).
pub struct KvRouter {
    state: Arc<KvState>,
    tokenizer: Arc<dyn PromptTokenizer>,
}

impl KvRouter {
    /// A router over shared KV state and a tokenizer.
    pub fn new(state: Arc<KvState>, tokenizer: Arc<dyn PromptTokenizer>) -> Self {
        Self { state, tokenizer }
    }

    /// The shared state.
    pub fn state(&self) -> &Arc<KvState> {
        &self.state
    }

    /// Tier 1.5 for one request. `Some` on a hit (reason `KvOverlap`, `KvSpill` or
    /// `KvColdSeed`), `None` on a miss (counted). Called again with the failed endpoint in
    /// `cands.excluded` after a connect failure, it returns the next best; `ticket` carries the
    /// service and the request's keys between the calls (start each request with an empty one).
    pub fn select(
        &self,
        rule: &StoredRule,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        ticket: &mut KvTicket,
    ) -> Option<Decision> {
        let Some(svc) = ticket.service(&self.state, rule) else {
            self.state
                .metrics
                .miss(&rule.id.to_string(), MissReason::ModeOff);
            return None;
        };
        let res = self.guarded_keys(&svc, meta, ticket).and_then(|keys| {
            let t = StdInstant::now();
            let r =
                crate::kv_stage_span!("kv.score").in_scope(|| self.decide(&svc, rule, keys, cands));
            svc.route.stage(Stage::Score, t.elapsed().as_secs_f64());
            r
        });
        match res {
            Ok((d, cached)) => {
                svc.route.hit(d.endpoint.unwrap_or_default());
                crate::telemetry::span::record_cached_blocks(cached);
                Some(d)
            }
            Err(reason) => {
                svc.route.miss(reason);
                crate::telemetry::span::record_kv_miss(reason.as_str());
                let head = ticket.keys();
                tracing::debug!(
                    service = rule.id,
                    reason = reason.as_str(),
                    blocks = head.map_or(0, |k| k.len()),
                    first_block = ?head.and_then(|k| k.first()),
                    retry = !cands.excluded.is_empty(),
                    "kv tier miss"
                );
                None
            }
        }
    }

    /// The proxy sent the request to `ep`: its blocks become predicted holdings of `ep` for
    /// the predicted-block TTL. The keys come from `ticket` (the request's `select` calls);
    /// only when those all stopped at `warmup` are they computed here (and kept).
    pub fn routed(&self, rule: &StoredRule, meta: &RequestMeta, ep: EpIdx, ticket: &mut KvTicket) {
        if self.state.settings.predicted_ttl.is_zero() {
            return;
        }
        let Some(svc) = ticket.service(&self.state, rule) else {
            return;
        };
        let keys = ticket.keys.get_or_insert_with(|| self.keys(&svc, meta));
        if let Ok(keys) = keys {
            let now = Instant::now();
            svc.index
                .predict(ep, keys, now + self.state.settings.predicted_ttl);
            tracing::trace!(service = rule.id, ep, blocks = keys.len(), first_block = ?keys.first(), "kv blocks predicted");
        }
    }

    /// The `warmup` guard, then the request's keys: from `ticket`, or computed and kept there
    /// by the first attempt past `warmup`.
    fn guarded_keys<'t>(
        &self,
        svc: &ServiceKv,
        meta: &RequestMeta,
        ticket: &'t mut KvTicket,
    ) -> Result<&'t [BlockKey], MissReason> {
        if svc.warming(Instant::now()) {
            return Err(MissReason::Warmup);
        }
        let keys = ticket.keys.get_or_insert_with(|| self.keys(svc, meta));
        match keys {
            Ok(k) => Ok(k),
            Err(r) => Err(*r),
        }
    }

    /// Guards `text_empty` to `short_prompt`, returning the request's block keys.
    fn keys(&self, svc: &ServiceKv, meta: &RequestMeta) -> Result<Vec<BlockKey>, MissReason> {
        let prompt = meta
            .prompt
            .as_ref()
            .filter(|p| !p.is_empty())
            .ok_or(MissReason::TextEmpty)?;
        let model = meta
            .model
            .as_deref()
            .filter(|m| !m.is_empty())
            .ok_or(MissReason::ModelEmpty)?;
        let t = StdInstant::now();
        let span = crate::kv_stage_span!("kv.tokenize");
        let encoded;
        let tokens: &[u32] = match prompt {
            Prompt::TokenIds(ids) => ids,
            p => {
                encoded = span.in_scope(|| {
                    self.tokenizer
                        .encode(model, meta.api, p, meta.add_special_tokens)
                        .map_err(|_| MissReason::Tokenize)
                })?;
                &encoded
            }
        };
        svc.route.stage(Stage::Tokenize, t.elapsed().as_secs_f64());
        span.record("loxi.kv.tokens", crate::telemetry::span::int(tokens.len()));
        tracing::Span::current()
            .record("loxi.kv.tokens", crate::telemetry::span::int(tokens.len()));
        if tokens.len() < self.state.settings.min_match_tokens {
            return Err(MissReason::Shallow);
        }
        let extras = self.extras(meta)?;
        let t = StdInstant::now();
        let span = crate::kv_stage_span!("kv.hash");
        let keys = span.in_scope(|| {
            svc.hasher
                .keys(tokens, svc.config.block_size as usize, &extras)
        });
        svc.route.stage(Stage::Hash, t.elapsed().as_secs_f64());
        span.record("loxi.kv.blocks", crate::telemetry::span::int(keys.len()));
        tracing::Span::current().record("loxi.kv.blocks", crate::telemetry::span::int(keys.len()));
        if self.state.settings.hash_debug {
            tracing::info!(service = svc.id, blocks = keys.len(), keys = ?keys, "kv hash debug");
        }
        if keys.is_empty() {
            return Err(MissReason::ShortPrompt);
        }
        Ok(keys)
    }

    fn extras(&self, meta: &RequestMeta) -> Result<RequestExtras, MissReason> {
        let lora = match &meta.lora_name {
            None => None,
            Some(n) => Some((
                n.clone(),
                self.state
                    .settings
                    .lora_paths
                    .get(n)
                    .ok_or(MissReason::Hashes)?
                    .clone(),
            )),
        };
        Ok(RequestExtras {
            lora,
            cache_salt: meta.cache_salt.clone(),
        })
    }

    /// Scoring, eligibility, blend law and cold seeding (on this thread's reused buffers): the
    /// decision and the number of leading request blocks its endpoint holds.
    fn decide(
        &self,
        svc: &ServiceKv,
        rule: &StoredRule,
        keys: &[BlockKey],
        cands: &Candidates<'_>,
    ) -> Result<(Decision, usize), MissReason> {
        SCRATCH.with(|s| match s.try_borrow_mut() {
            Ok(mut s) => self.decide_in(&mut s, svc, rule, keys, cands),
            Err(_) => self.decide_in(&mut Scratch::default(), svc, rule, keys, cands),
        })
    }

    fn decide_in(
        &self,
        scratch: &mut Scratch,
        svc: &ServiceKv,
        rule: &StoredRule,
        keys: &[BlockKey],
        cands: &Candidates<'_>,
    ) -> Result<(Decision, usize), MissReason> {
        let scores = svc
            .index
            .score_with(keys, Instant::now(), &mut scratch.score);
        let subscribed = |ep: EpIdx| svc.config.endpoints.get(ep).is_some_and(|(_, s)| *s);
        let usable = |ep: EpIdx| cands.eligible(ep) && subscribed(ep);
        if scores.is_empty() {
            return Err(MissReason::NoWorker);
        }
        if !scores.iter().any(|(ep, _)| usable(*ep)) {
            return Err(MissReason::Excluded);
        }
        let law_cands = &mut scratch.cands;
        law_cands.clear();
        law_cands.extend((0..cands.len()).filter(|&ep| usable(ep)).map(|ep| Cand {
            ep,
            overlap: scores.iter().find(|(e, _)| *e == ep).map_or(0, |s| s.1),
            load: cands.loads[ep].in_flight() + cands.loads[ep].queued.load(Ordering::Relaxed),
            weight: cands.weights.get(ep).copied().unwrap_or(1),
        }));
        let s = &self.state.settings;
        let params = LawParams {
            mode: s.lb_mode,
            mean_load_factor: s.mean_load_factor,
            load_penalty: s.load_penalty,
            spill_relief: s.spill_relief_for(rule.spec.kv_mode()),
            cap_sum_milli: s.cap_sum_milli,
            request_blocks: keys.len(),
        };
        let pick = blend(law_cands, &params).ok_or(MissReason::Excluded)?;
        let cached = |ep: EpIdx| {
            law_cands
                .iter()
                .find(|c| c.ep == ep)
                .map_or(0, |c| c.overlap)
        };
        if let Some(cold) = self.cold_seed(svc, law_cands, pick.ep) {
            svc.route.cold_seed(cold);
            return Ok((Decision::pick(cold, Reason::KvColdSeed), cached(cold)));
        }
        if pick.spilled {
            svc.route.spill(pick.ep);
            return Ok((Decision::pick(pick.ep, Reason::KvSpill), cached(pick.ep)));
        }
        Ok((Decision::pick(pick.ep, Reason::KvOverlap), cached(pick.ep)))
    }

    /// Every `LOXILB_KV_COLDSTART_SEED_N`-th hit goes to the lowest-index eligible endpoint with
    /// fewer than `_MIN_BLOCKS` blocks (0 = empty only), if that is not the pick already.
    fn cold_seed(&self, svc: &ServiceKv, cands: &[Cand], pick: EpIdx) -> Option<EpIdx> {
        let s = &self.state.settings;
        let n = svc.hits.fetch_add(1, Ordering::Relaxed) + 1;
        if s.coldstart_seed_n == 0 || !n.is_multiple_of(s.coldstart_seed_n) {
            return None;
        }
        let cold = |ep: EpIdx| {
            let b = svc.index.blocks(ep);
            if s.coldstart_min_blocks == 0 {
                b == 0
            } else {
                b < s.coldstart_min_blocks
            }
        };
        cands
            .iter()
            .map(|c| c.ep)
            .find(|&ep| cold(ep))
            .filter(|&ep| ep != pick)
    }
}

#[cfg(test)]
#[path = "select_tests.rs"]
mod tests;
