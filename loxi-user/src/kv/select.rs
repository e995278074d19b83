//! Tier 1.5 selection: the guard ladder, overlap scoring, the blend law, cold-start seeding.
//!
//! Guard ladder (LoxiLB's order and labels, `kv-cache-aware-routing.txt` §7, plus loxi's
//! `short_prompt`): `mode_off` (kvExactMode 0) → `warmup` (within `kvWarmupSec` of the first
//! subscriber connect; loxi arms it, default 0 = off) → `text_empty` → `model_empty` →
//! `tokenize` → `shallow` (fewer than `LLB_KV_MIN_MATCH_TOKENS` tokens) → `hashes` (unknown
//! algorithm or LoRA path) → `short_prompt` (no full block: nothing is cacheable) → `no_worker`
//! (no endpoint holds the first block) → `excluded` (only excluded / unhealthy / unsubscribed
//! endpoints hold it). Then [`super::blend::blend`] and cold-start seeding. Every miss counts
//! one `loxilb_pd_kv_tier15_miss_reason_total` and one fallthrough; every hit one
//! `loxilb_pd_kv_tier15_hits_total{ep_idx}`.
//!
//! The prompt is tokenized and hashed once per request: the outcome of `text_empty` …
//! `short_prompt` (keys or the miss) is kept in the request's [`TierMemo`], which a
//! connect-failure retry and [`KvRouter::routed`] reuse. `warmup` is not kept: every attempt
//! checks it, and `routed` skips it (blocks of requests sent during warmup are still predicted).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant as StdInstant;

use tokio::time::Instant;

use super::BlockKey;
use super::blend::{Cand, LawParams, blend};
use super::block_hash::RequestExtras;
use super::metrics::{ServiceLabels, Stage, StageLabels};
use super::state::{KvState, ServiceKv};
use crate::proxy::meta::{ApiKind, Prompt, RequestMeta};
use crate::routing::{Candidates, Decision, EpIdx, Reason, TierMemo};
use crate::rules::store::StoredRule;

/// Why tier 1.5 did not decide (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MissReason {
    /// kvExactMode 0.
    ModeOff,
    /// Inside the kvWarmupSec window.
    Warmup,
    /// No prompt text.
    TextEmpty,
    /// No model.
    ModelEmpty,
    /// Tokenizer missing or failed.
    Tokenize,
    /// Block hashes could not be computed.
    Hashes,
    /// Fewer tokens than `LLB_KV_MIN_MATCH_TOKENS`.
    Shallow,
    /// Shorter than one block: nothing cacheable (loxi extension).
    ShortPrompt,
    /// No endpoint holds the first block.
    NoWorker,
    /// Only ineligible endpoints hold it.
    Excluded,
}

impl MissReason {
    /// Every reason, for pre-creating series.
    pub const ALL: [MissReason; 10] = [
        Self::ModeOff,
        Self::Warmup,
        Self::TextEmpty,
        Self::ModelEmpty,
        Self::Tokenize,
        Self::Hashes,
        Self::Shallow,
        Self::ShortPrompt,
        Self::NoWorker,
        Self::Excluded,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ModeOff => "mode_off",
            Self::Warmup => "warmup",
            Self::TextEmpty => "text_empty",
            Self::ModelEmpty => "model_empty",
            Self::Tokenize => "tokenize",
            Self::Hashes => "hashes",
            Self::Shallow => "shallow",
            Self::ShortPrompt => "short_prompt",
            Self::NoWorker => "no_worker",
            Self::Excluded => "excluded",
        }
    }
}

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

impl PromptTokenizer for super::tokenizer::TokenizerPool {
    fn encode(
        &self,
        model: &str,
        api: ApiKind,
        prompt: &Prompt,
        add_special_tokens: Option<bool>,
    ) -> Result<Arc<[u32]>, String> {
        super::tokenizer::TokenizerPool::encode(self, model, api, prompt, add_special_tokens)
            .map_err(|e| e.to_string())
    }
}

/// A request's block keys, or the guard (`text_empty` … `short_prompt`) that stopped them; what
/// [`KvRouter`] keeps in the request's [`TierMemo`].
struct RequestKeys(Result<Arc<[BlockKey]>, MissReason>);

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
    /// `cands.excluded` after a connect failure, it returns the next best; `memo` carries the
    /// request's keys between the calls (start each request with an empty one).
    pub fn select(
        &self,
        rule: &StoredRule,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        memo: &mut TierMemo,
    ) -> Option<Decision> {
        let label = rule.id.to_string();
        let m = &self.state.metrics;
        if rule.rule.service.kv_exact_mode == 0 {
            m.miss(&label, MissReason::ModeOff);
            return None;
        }
        let svc = self.state.service(rule);
        let res = self.guarded_keys(&svc, meta, memo).and_then(|keys| {
            let t = StdInstant::now();
            let r = crate::kv_stage_span!("kv.score")
                .in_scope(|| self.decide(&svc, rule, &keys, cands));
            self.observe(Stage::Score, t);
            r
        });
        match res {
            Ok((d, cached)) => {
                m.hit(&label, d.endpoint.unwrap_or_default());
                crate::telemetry::span::record_cached_blocks(cached);
                Some(d)
            }
            Err(reason) => {
                m.miss(&label, reason);
                crate::telemetry::span::record_kv_miss(reason.as_str());
                let head = memo.get::<RequestKeys>().and_then(|k| k.0.as_ref().ok());
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
    /// the predicted-block TTL. The keys come from `memo` (the request's `select` calls); only
    /// when those all stopped at `warmup` are they computed here.
    pub fn routed(&self, rule: &StoredRule, meta: &RequestMeta, ep: EpIdx, memo: &TierMemo) {
        if rule.rule.service.kv_exact_mode == 0 || self.state.settings.predicted_ttl.is_zero() {
            return;
        }
        let svc = self.state.service(rule);
        let keys = match memo.get::<RequestKeys>() {
            Some(RequestKeys(k)) => k.clone(),
            None => self.keys(&svc, meta),
        };
        if let Ok(keys) = keys {
            let now = Instant::now();
            svc.index.maybe_sweep_predicted(now);
            svc.index
                .predict(ep, &keys, now + self.state.settings.predicted_ttl);
            tracing::trace!(service = rule.id, ep, blocks = keys.len(), first_block = ?keys.first(), "kv blocks predicted");
        }
    }

    fn observe(&self, stage: Stage, since: StdInstant) {
        let h = self
            .state
            .metrics
            .stage_seconds
            .get_or_create(&StageLabels { stage });
        h.observe(since.elapsed().as_secs_f64());
    }

    /// The `warmup` guard, then the request's keys: from `memo`, or computed and remembered
    /// there by the first attempt past `warmup`.
    fn guarded_keys(
        &self,
        svc: &ServiceKv,
        meta: &RequestMeta,
        memo: &mut TierMemo,
    ) -> Result<Arc<[BlockKey]>, MissReason> {
        if svc.warming(Instant::now()) {
            return Err(MissReason::Warmup);
        }
        if let Some(RequestKeys(k)) = memo.get() {
            return k.clone();
        }
        let k = self.keys(svc, meta);
        memo.set(RequestKeys(k.clone()));
        k
    }

    /// Guards `text_empty` to `short_prompt`, returning the request's block keys.
    fn keys(&self, svc: &ServiceKv, meta: &RequestMeta) -> Result<Arc<[BlockKey]>, MissReason> {
        let prompt = meta
            .prompt
            .as_ref()
            .filter(|p| !prompt_is_empty(p))
            .ok_or(MissReason::TextEmpty)?;
        let model = meta
            .model
            .as_deref()
            .filter(|m| !m.is_empty())
            .ok_or(MissReason::ModelEmpty)?;
        let t = StdInstant::now();
        let span = crate::kv_stage_span!("kv.tokenize");
        let tokens: Arc<[u32]> = span.in_scope(|| match prompt {
            Prompt::TokenIds(ids) => Ok(ids.as_slice().into()),
            p => self
                .tokenizer
                .encode(model, meta.api, p, meta.add_special_tokens)
                .map_err(|_| MissReason::Tokenize),
        })?;
        self.observe(Stage::Tokenize, t);
        span.record("loxi.kv.tokens", crate::telemetry::span::int(tokens.len()));
        tracing::Span::current()
            .record("loxi.kv.tokens", crate::telemetry::span::int(tokens.len()));
        if tokens.len() < self.state.settings.min_match_tokens {
            return Err(MissReason::Shallow);
        }
        let hasher = svc.hasher.as_ref().ok_or(MissReason::Hashes)?;
        let extras = self.extras(meta)?;
        let t = StdInstant::now();
        let span = crate::kv_stage_span!("kv.hash");
        let keys = span.in_scope(|| hasher.keys(&tokens, svc.config.block_size as usize, &extras));
        self.observe(Stage::Hash, t);
        span.record("loxi.kv.blocks", crate::telemetry::span::int(keys.len()));
        tracing::Span::current().record("loxi.kv.blocks", crate::telemetry::span::int(keys.len()));
        if self.state.settings.hash_debug {
            tracing::info!(service = svc.id, blocks = keys.len(), keys = ?keys, "kv hash debug");
        }
        if keys.is_empty() {
            return Err(MissReason::ShortPrompt);
        }
        Ok(keys.into())
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

    /// Scoring, eligibility, blend law and cold seeding: the decision and the number of leading
    /// request blocks its endpoint holds.
    fn decide(
        &self,
        svc: &ServiceKv,
        rule: &StoredRule,
        keys: &[BlockKey],
        cands: &Candidates<'_>,
    ) -> Result<(Decision, usize), MissReason> {
        let scores = svc.index.score(keys, Instant::now());
        let subscribed = |ep: EpIdx| svc.config.endpoints.get(ep).is_some_and(|(_, s)| *s);
        let usable = |ep: EpIdx| cands.eligible(ep) && subscribed(ep);
        if scores.is_empty() {
            return Err(MissReason::NoWorker);
        }
        if !scores.iter().any(|(ep, _)| usable(*ep)) {
            return Err(MissReason::Excluded);
        }
        let law_cands: Vec<Cand> = (0..cands.len())
            .filter(|&ep| usable(ep))
            .map(|ep| Cand {
                ep,
                overlap: scores.iter().find(|(e, _)| *e == ep).map_or(0, |s| s.1),
                load: cands.loads[ep].in_flight() + cands.loads[ep].queued.load(Ordering::Relaxed),
                weight: cands.weights.get(ep).copied().unwrap_or(1),
            })
            .collect();
        let s = &self.state.settings;
        let params = LawParams {
            mode: s.lb_mode,
            mean_load_factor: s.mean_load_factor,
            load_penalty: s.load_penalty,
            spill_relief: s.spill_relief_for(rule.rule.service.kv_exact_mode),
            cap_sum_milli: s.cap_sum_milli,
            request_blocks: keys.len(),
        };
        let pick = blend(&law_cands, &params).ok_or(MissReason::Excluded)?;
        let label = ServiceLabels {
            service: svc.label(),
        };
        let cached = |ep: EpIdx| {
            law_cands
                .iter()
                .find(|c| c.ep == ep)
                .map_or(0, |c| c.overlap)
        };
        if let Some(cold) = self.cold_seed(svc, &law_cands, pick.ep) {
            self.state.metrics.cold_seeds.get_or_create(&label).inc();
            return Ok((Decision::pick(cold, Reason::KvColdSeed), cached(cold)));
        }
        if pick.spilled {
            self.state.metrics.spills.get_or_create(&label).inc();
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

fn prompt_is_empty(p: &Prompt) -> bool {
    match p {
        Prompt::Text(t) => t.is_empty(),
        Prompt::TokenIds(ids) => ids.is_empty(),
        Prompt::Messages(m) => m.is_empty(),
    }
}

#[cfg(test)]
#[path = "select_tests.rs"]
mod tests;
