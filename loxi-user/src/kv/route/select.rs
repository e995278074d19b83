//! Tier 1.5 selection: the guard ladder, overlap scoring, the blend law, cold-start seeding.
//!
//! Guard ladder (LoxiLB's order and labels, `kv-cache-aware-routing.txt` §7, plus loxi's
//! `short_prompt`): `mode_off` (kvExactMode 0) → `warmup` (within `kvWarmupSec` of the first
//! subscriber connect; loxi arms it, default 0 = off) → `text_empty` → `model_empty` →
//! `oversize` (loxi: a prompt beyond `PromptBounds`, not tokenized) → `overload` (loxi: the
//! tokenization queue is full) → `budget` (loxi: no result within the decision budget) →
//! `tokenize` (`multimodal` when a chat's text before its first media part cannot be encoded
//! as an exact prefix; otherwise only that text is scored, counted in
//! `loxilb_pd_kv_tier15_media_prefix_total`) → `shallow` (fewer than `LLB_KV_MIN_MATCH_TOKENS` tokens) → `hashes` (a `lora_name`
//! the adapter catalog does not know, checked before tokenizing; or extras SGLang's contract cannot hash) → `short_prompt` (no full block: nothing is cacheable) → `no_worker`
//! (no endpoint holds the first block) → `excluded` (only excluded / unhealthy / unsubscribed
//! endpoints hold it). Then [`super::blend::blend`], cold-start seeding and replica seeding
//! ([`super::blend::replica`], loxi: a copy of the pick's prefix onto an idle endpoint with an
//! empty cache when the pick carries more than its share). Every miss counts
//! one `loxilb_pd_kv_tier15_miss_reason_total` and one fallthrough; every hit one
//! `loxilb_pd_kv_tier15_hits_total{ep_idx}`.
//!
//! The proxy calls [`KvRouter::prepare`] first: it runs the cheap guards inline and the
//! tokenization and hashing on the fixed tokenization pool (`workers.rs`), waiting at most the
//! decision budget. [`KvRouter::select`] then only scores (microseconds).
//!
//! The prompt is tokenized and hashed once per request: the outcome of `text_empty` …
//! `short_prompt` (keys or the miss) is kept in the request's [`KvTicket`] with the service's
//! state, which a connect-failure retry and [`KvRouter::routed`] reuse. `warmup` is not kept: every attempt
//! checks it, and `routed` skips it (blocks of requests sent during warmup are still predicted).

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant as StdInstant;

use tokio::time::Instant;

use super::blend::{Cand, LawParams, blend, replica};
pub use super::miss::MissReason;
use super::workers::TokenizeWorkers;
use crate::kv::BlockKey;
use crate::kv::block_hash::RequestExtras;
use crate::kv::index::ScoreScratch;
use crate::kv::members::Member;
use crate::kv::metrics::Stage;
use crate::kv::settings::PromptBounds;
use crate::kv::state::{KvState, ServiceKv};
use crate::kv::tokenizer::{EncodeBounds, TokenizeError};
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

    /// Token ids of `prompt` within `bounds` (at most `max_tokens`, a cut `prefix` encoded only
    /// where exact), or the miss: `oversize` for a prefix this tokenizer cannot encode exactly,
    /// `tokenize` otherwise. The default encodes whole, refuses prefixes and truncates.
    fn encode_bounded(
        &self,
        model: &str,
        api: ApiKind,
        prompt: &Prompt,
        add_special_tokens: Option<bool>,
        bounds: EncodeBounds,
    ) -> Result<Arc<[u32]>, MissReason> {
        if bounds.prefix {
            return Err(MissReason::Oversize);
        }
        let ids = self
            .encode(model, api, prompt, add_special_tokens)
            .map_err(|_| MissReason::Tokenize)?;
        let max = bounds.limit(None);
        Ok(if ids.len() > max {
            Arc::from(&ids[..max])
        } else {
            ids
        })
    }
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

    fn encode_bounded(
        &self,
        model: &str,
        api: ApiKind,
        prompt: &Prompt,
        add_special_tokens: Option<bool>,
        bounds: EncodeBounds,
    ) -> Result<Arc<[u32]>, MissReason> {
        crate::kv::tokenizer::TokenizerPool::encode_bounded(
            self,
            model,
            api,
            prompt,
            add_special_tokens,
            bounds,
        )
        .map_err(|e| match e {
            TokenizeError::Oversize { .. } => MissReason::Oversize,
            TokenizeError::Media { .. } => MissReason::Multimodal,
            _ => MissReason::Tokenize,
        })
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
    /// The last hit's endpoint and the leading request blocks it holds.
    hit: Option<(EpIdx, usize)>,
    /// Uncached prompt tokens of the request on the endpoint [`KvRouter::routed`] was last
    /// told about.
    work: u64,
    /// The fingerprint of the request's prompt opening ([`opening`]), once `prepare` saw it.
    opening: Option<u64>,
    /// The request is counted in its service's `waiting` (from `prepare` to its first
    /// selection, or to the ticket's drop).
    waiting: bool,
    /// The request's decision was recorded in its service's [`ServiceKv::openings`].
    seen: bool,
}

impl Drop for KvTicket {
    fn drop(&mut self) {
        self.decided();
    }
}

impl KvTicket {
    /// The request's block keys, once a call computed them.
    pub fn keys(&self) -> Option<&[BlockKey]> {
        self.keys.as_ref()?.as_deref().ok()
    }

    /// The request's prefill work on the endpoint of the last [`KvRouter::routed`] call, in
    /// tokens: its full blocks that endpoint does not hold (per this tier's last decision; all
    /// of them when the tier missed or picked another endpoint) × the block size. 0 when the
    /// tier computed no keys (a miss before hashing, or a rule without tier 1.5). The proxy
    /// counts it in the endpoint's `EndpointLoad::prefill_tokens` until the response starts.
    pub fn prefill_tokens(&self) -> u64 {
        self.work
    }

    /// Takes the request out of its service's `waiting` (once).
    fn decided(&mut self) {
        if std::mem::take(&mut self.waiting)
            && let (Some(svc), Some(fp)) = (&self.svc, self.opening)
        {
            svc.wait_remove(fp);
        }
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
    /// The member id of each of the request's endpoints (`kv::members`).
    members: Vec<Option<Member>>,
    /// The service's crossed members ([`ServiceKv::crossed`]), copied so no lock is held
    /// through the decision.
    crossed: Vec<Member>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Tier 1.5: implements the proxy's affinity-tier seam (`select` / `routed`).
pub struct KvRouter {
    state: Arc<KvState>,
    tokenizer: Arc<dyn PromptTokenizer>,
    workers: TokenizeWorkers,
}

impl KvRouter {
    /// A router over shared KV state and a tokenizer, with its tokenization pool
    /// (`LOXI_KV_TOKENIZE_WORKERS` threads, a queue of `LOXI_KV_TOKENIZE_QUEUE`).
    pub fn new(state: Arc<KvState>, tokenizer: Arc<dyn PromptTokenizer>) -> Self {
        let s = &state.settings;
        let workers = TokenizeWorkers::new(s.tokenize_workers, s.tokenize_queue);
        Self {
            state,
            tokenizer,
            workers,
        }
    }

    /// The tokenization pool (its counters).
    pub fn workers(&self) -> &TokenizeWorkers {
        &self.workers
    }

    /// Computes the request's block keys (or the miss that stops them) into `ticket`, within
    /// the decision budget: the cheap guards run here, the tokenization and hashing on the
    /// tokenization pool. A full queue is the miss `overload`; no result within
    /// `LOXI_KV_DECISION_BUDGET_MS` (queue wait included) is the miss `budget`, and the job
    /// is skipped if it has not started. Then [`Self::select`] and [`Self::routed`] only score
    /// and predict (microseconds). Nothing to do when the rule has tier 1.5 off or the ticket
    /// already holds the keys.
    pub async fn prepare(&self, rule: &StoredRule, meta: &RequestMeta, ticket: &mut KvTicket) {
        let Some(svc) = ticket.service(&self.state, rule) else {
            return;
        };
        if ticket.keys.is_none() {
            if !ticket.waiting
                && let Some(fp) = opening(meta)
            {
                svc.wait_add(fp);
                ticket.opening = Some(fp);
                ticket.waiting = true;
            }
            ticket.keys = Some(self.keys_in_budget(svc, meta).await);
        }
    }

    async fn keys_in_budget(
        &self,
        svc: Arc<ServiceKv>,
        meta: &RequestMeta,
    ) -> Result<Vec<BlockKey>, MissReason> {
        let (bounded, prefix) = screen(meta, &self.state.settings.bounds)?;
        let budget = self.state.settings.decision_budget;
        let (state, tok) = (self.state.clone(), self.tokenizer.clone());
        let span = tracing::Span::current();
        let job = move || span.in_scope(|| keys_of(&state, &*tok, &svc, &bounded, prefix));
        let rx = self
            .workers
            .submit(StdInstant::now() + budget, job)
            .map_err(|_| MissReason::Overload)?;
        match tokio::time::timeout(budget, rx).await {
            Ok(Ok(keys)) => keys,
            // Skipped by the worker: its deadline passed while it was queued.
            Ok(Err(_)) | Err(_) => Err(MissReason::Budget),
        }
    }

    /// The token ids of the request's text or chat prompt (at most `max`) when a tokenizer is
    /// staged for its model, computed on the tokenization pool within
    /// `LOXI_KV_DECISION_BUDGET_MS`; `None` without a model or prompt, for a token-id prompt
    /// (its ids need no tokenizer), without a staged tokenizer, on a full queue or past the
    /// budget. P/D tier 1's trie key.
    pub async fn prompt_tokens(&self, meta: &RequestMeta, max: usize) -> Option<Arc<[u32]>> {
        let (Some(model), Some(prompt)) = (meta.model.clone(), meta.prompt.clone()) else {
            return None;
        };
        if matches!(prompt, Prompt::TokenIds(_)) {
            return None;
        }
        let budget = self.state.settings.decision_budget;
        let tok = self.tokenizer.clone();
        let (api, add) = (meta.api, meta.add_special_tokens);
        let bounds = EncodeBounds {
            max_tokens: Some(max),
            prefix: meta.body_cut,
        };
        let job = move || tok.encode_bounded(&model, api, &prompt, add, bounds).ok();
        let rx = self.workers.submit(StdInstant::now() + budget, job).ok()?;
        tokio::time::timeout(budget, rx).await.ok()?.ok()?
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
        ticket.decided();
        if ticket.opening.is_none() {
            ticket.opening = opening(meta);
        }
        // Requests that opened differently and still wait for their decision (a burst of
        // several prefixes) may need the idle endpoints: no replica seed then.
        let hold = Hold {
            others_waiting: svc.others_waiting(ticket.opening),
            opening: ticket.opening,
        };
        let res = self.guarded_keys(&svc, meta, ticket).and_then(|keys| {
            let t = StdInstant::now();
            let r = crate::kv_stage_span!("kv.score")
                .in_scope(|| self.decide(&svc, rule, keys, cands, hold));
            svc.route.stage(Stage::Score, t.elapsed().as_secs_f64());
            r
        });
        ticket.hit = None;
        match res {
            Ok((d, cached)) => {
                ticket.hit = d.endpoint.map(|ep| (ep, cached));
                // A prompt with blocks to cache was placed: it holds other prompts' replica
                // seeds for the hold window.
                if !std::mem::replace(&mut ticket.seen, true)
                    && let Some(fp) = ticket.opening
                    && ticket.keys().is_some_and(|k| !k.is_empty())
                {
                    svc.openings.lock().seen(fp, Instant::now());
                }
                if d.reason == Reason::KvColdPlace {
                    svc.route.cold_placement(d.endpoint.unwrap_or_default());
                } else {
                    svc.route.hit(d.endpoint.unwrap_or_default());
                }
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

    /// A request of `rule` that is not a generation was routed by the rule's `sel` without
    /// entering the tier: counted in `loxilb_pd_kv_tier15_bypass_total{reason="non_generation"}`,
    /// not as a miss. Nothing when the rule has tier 1.5 off.
    pub fn bypassed(&self, rule: &StoredRule) {
        if let Some(svc) = self.state.service(rule) {
            svc.route.non_generation();
        }
    }

    /// The proxy sent the request to `ep`: its blocks become predicted holdings of `ep` for
    /// the predicted-block TTL. The keys come from `ticket` (the request's `select` calls);
    /// only when those all stopped at `warmup` are they computed here (and kept).
    /// It also sets the ticket's [`KvTicket::prefill_tokens`] for `ep`.
    pub fn routed(&self, rule: &StoredRule, meta: &RequestMeta, ep: EpIdx, ticket: &mut KvTicket) {
        ticket.work = 0;
        let Some(svc) = ticket.service(&self.state, rule) else {
            return;
        };
        let eps = rule.spec.kv.as_ref().map_or(&[][..], |k| &k.endpoints[..]);
        let member = eps
            .get(ep)
            .and_then(|e| svc.members.read().member_of(e, ep));
        if let (Some(Ok(keys)), Some(m)) = (&ticket.keys, member)
            && svc.index.blocks(m) > 0
        {
            let mut w = svc.watch.lock();
            let e = w.entry(m).or_default();
            e.routed_holding = e.routed_holding.saturating_add(1);
            if !e.matched
                && let Some(first) = keys.first()
            {
                let slot = usize::from(e.next_probe) % e.probes.len();
                e.probes[slot] = Some(*first);
                e.next_probe = e.next_probe.wrapping_add(1);
            }
        }
        // The request's uncached prefill work on `ep`, in tokens (whole cached blocks only).
        let keys = ticket.keys.get_or_insert_with(|| self.keys(&svc, meta));
        if let Ok(k) = keys {
            let cached = ticket.hit.filter(|h| h.0 == ep).map_or(0, |h| h.1);
            ticket.work = (k.len().saturating_sub(cached) * svc.config.block_size as usize) as u64;
        }
        // The crossed-stream check (`kv::cross`): a cold placement on a subscribed endpoint (no
        // endpoint holds or is predicted to hold its first block) starts a probe of its first
        // key; any request with a pending probe's first key adds its endpoint to that probe.
        if let (Ok(k), Some(m)) = (&*keys, member)
            && let Some(first) = k.first()
            && eps.get(ep).is_some_and(|e| e.subscribed)
        {
            let now = Instant::now();
            let cold =
                ticket.hit.is_none_or(|h| h.1 == 0) && !svc.index.held_or_predicted(*first, now);
            svc.cross.lock().routed(m, *first, cold, now);
        }
        if self.state.settings.predicted_ttl.is_zero() {
            return;
        }
        if let (Ok(keys), Some(member)) = (keys, member) {
            let now = Instant::now();
            svc.index
                .predict(member, keys, now + self.state.settings.predicted_ttl);
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

    /// Guards `text_empty` to `short_prompt`, returning the request's block keys (inline, on
    /// the calling thread: the path of [`Self::select`] without [`Self::prepare`]).
    fn keys(&self, svc: &ServiceKv, meta: &RequestMeta) -> Result<Vec<BlockKey>, MissReason> {
        let (bounded, prefix) = screen(meta, &self.state.settings.bounds)?;
        keys_of(&self.state, &*self.tokenizer, svc, &bounded, prefix)
    }
    /// Scoring, eligibility, blend law and cold seeding (on this thread's reused buffers): the
    /// decision and the number of leading request blocks its endpoint holds.
    fn decide(
        &self,
        svc: &ServiceKv,
        rule: &StoredRule,
        keys: &[BlockKey],
        cands: &Candidates<'_>,
        hold: Hold,
    ) -> Result<(Decision, usize), MissReason> {
        SCRATCH.with(|s| match s.try_borrow_mut() {
            Ok(mut s) => self.decide_in(&mut s, svc, rule, keys, cands, hold),
            Err(_) => self.decide_in(&mut Scratch::default(), svc, rule, keys, cands, hold),
        })
    }

    fn decide_in(
        &self,
        scratch: &mut Scratch,
        svc: &ServiceKv,
        rule: &StoredRule,
        keys: &[BlockKey],
        cands: &Candidates<'_>,
        hold: Hold,
    ) -> Result<(Decision, usize), MissReason> {
        let Scratch {
            score,
            cands: law_cands,
            members,
            crossed,
        } = scratch;
        // The index is keyed by member id; the request's positions come from its own snapshot
        // of the rule (which may differ from the service's while an update is applied).
        let eps = rule.spec.kv.as_ref().map_or(&[][..], |k| &k.endpoints[..]);
        svc.members.read().resolve(eps, members);
        let scores = svc.index.score_with(keys, Instant::now(), score);
        // Offload-tier credit: per endpoint, the prefix it holds on either tier beyond its GPU
        // prefix counts `credit` per block. Overlaps are in milli-blocks (the laws compare
        // overlaps with each other and with the request length, both scaled alike).
        let credit = self.offload_credit_milli();
        let any_tier = if credit > 0 {
            svc.index.any_tier_runs(keys)
        } else {
            Vec::new()
        };
        let member = |ep: EpIdx| members.get(ep).copied().flatten();
        // Endpoints whose event streams are crossed (`kv::cross`): their inventories are not
        // their engines' caches, so their blocks win nothing.
        crossed.clear();
        crossed.extend_from_slice(&svc.crossed.read());
        let crossed = &*crossed;
        let overlap = |ep: EpIdx| {
            let Some(m) = member(ep) else { return 0 };
            if !crossed.is_empty() && crossed.binary_search(&m).is_ok() {
                return 0;
            }
            let gpu = scores.iter().find(|(x, _)| *x == m).map_or(0, |s| s.1);
            let both = any_tier.iter().find(|(x, _)| *x == m).map_or(0, |s| s.1);
            gpu * MILLI + both.saturating_sub(gpu) * credit
        };
        // Zero-hit watchdog: an endpoint whose confirmed blocks hold this request's first block
        // matches (once is enough).
        if let Some(first) = keys.first() {
            let mut w = svc.watch.lock();
            for m in members.iter().flatten() {
                let e = w.entry(*m).or_default();
                if !e.matched && svc.index.holds_key(*m, *first) {
                    e.matched = true;
                }
            }
        }
        let subscribed = |ep: EpIdx| eps.get(ep).is_some_and(|e| e.subscribed);
        let usable = |ep: EpIdx| cands.eligible(ep) && subscribed(ep) && member(ep).is_some();
        if !(0..cands.len()).any(|ep| usable(ep) && overlap(ep) > 0) {
            // No usable endpoint holds the first block: nothing to win, priced by wait alone.
            if self.state.settings.cold_least_work
                && let Some(ep) = cold_place(keys.len(), svc, cands, &usable, &member)
            {
                tracing::debug!(
                    service = rule.id,
                    to = ep,
                    blocks = keys.len(),
                    work = ?cands.loads.iter().map(|l| l.prefill_work()).collect::<Vec<_>>(),
                    held = ?(0..cands.len()).map(|e| member(e).map_or(0, |m| svc.index.blocks(m))).collect::<Vec<_>>(),
                    "kv cold place"
                );
                return Ok((Decision::pick(ep, Reason::KvColdPlace), 0));
            }
            return Err(if scores.is_empty() && any_tier.is_empty() {
                MissReason::NoWorker
            } else {
                MissReason::Excluded
            });
        }
        law_cands.clear();
        law_cands.extend((0..cands.len()).filter(|&ep| usable(ep)).map(|ep| Cand {
            ep,
            overlap: overlap(ep),
            load: cands.loads[ep].effective_load(),
            work: cands.loads[ep].prefill_work(),
            weight: cands.weights.get(ep).copied().unwrap_or(1),
        }));
        let s = &self.state.settings;
        let params = LawParams {
            mode: s.lb_mode,
            mean_load_factor: s.mean_load_factor,
            load_penalty: s.load_penalty,
            spill_relief: s.spill_relief_for(rule.spec.kv_mode()),
            cap_sum_milli: s.cap_sum_milli,
            request_blocks: keys.len() * MILLI,
            block_size: svc.config.block_size as usize,
            unit: MILLI,
            copy_percent: s.work_copy_percent,
            request_tokens: s.work_request_tokens,
            batch_slots: s.batch_slots,
            spill_floor: s.spill_floor,
            work_guard_percent: s.work_guard_percent,
        };
        let pick = blend(law_cands, &params).ok_or(MissReason::Excluded)?;
        let cached = |ep: EpIdx| {
            law_cands
                .iter()
                .find(|c| c.ep == ep)
                .map_or(0, |c| c.overlap / MILLI)
        };
        if let Some(cold) = self.cold_seed(svc, law_cands, &member, pick.ep) {
            tracing::debug!(service = rule.id, pick = pick.ep, to = cold, cands = ?law_cands, "kv cold seed");
            svc.route.cold_seed(cold);
            return Ok((Decision::pick(cold, Reason::KvColdSeed), cached(cold)));
        }
        // Replica seeding (`blend::replica`): free room is an empty cache; held while requests
        // of other prompts wait for their decision or were placed within the hold window (in
        // a burst of several prompts the idle empty endpoint is about to be one's home).
        let has_room = |c: &Cand| member(c.ep).map_or(0, |m| svc.index.blocks(m)) == 0;
        if let Some(copy) = replica(law_cands, pick.ep, s.replica_load, has_room) {
            let placed = svc.openings.lock().other_than(hold.opening);
            let window = s.replica_hold_window();
            let recent =
                placed.is_some_and(|at| Instant::now().saturating_duration_since(at) < window);
            if !hold.others_waiting && !recent {
                tracing::debug!(service = rule.id, pick = pick.ep, to = copy, cands = ?law_cands, "kv replica seed");
                svc.route.cold_seed(copy);
                return Ok((Decision::pick(copy, Reason::KvColdSeed), cached(copy)));
            }
            tracing::debug!(
                service = rule.id,
                pick = pick.ep,
                to = copy,
                others_waiting = hold.others_waiting,
                placed_ms_ago = ?placed.map(|at| Instant::now().saturating_duration_since(at).as_millis()),
                "kv replica seed held: a request of another prompt waits for its decision or was placed within the hold window"
            );
        }
        if pick.spilled {
            tracing::debug!(
                service = rule.id,
                pick = pick.ep,
                blocks = keys.len(),
                cands = ?law_cands,
                "kv spill"
            );
            svc.route.spill(pick.ep);
            return Ok((Decision::pick(pick.ep, Reason::KvSpill), cached(pick.ep)));
        }
        Ok((Decision::pick(pick.ep, Reason::KvOverlap), cached(pick.ep)))
    }

    /// `LOXI_KV_CPU_TIER_CREDIT` in milli-blocks per offload-tier block, at most 999 (a GPU
    /// block, 1000, always counts more).
    fn offload_credit_milli(&self) -> usize {
        ((self.state.settings.cpu_tier_credit.clamp(0.0, 1.0) * 1000.0).round() as usize).min(999)
    }

    /// Every `LOXILB_KV_COLDSTART_SEED_N`-th hit goes to the lowest-index eligible endpoint with
    /// fewer than `_MIN_BLOCKS` blocks (0 = empty only), if that is not the pick already. The
    /// cold endpoint must also be idle (no request in flight or queued, no queued prefill work;
    /// loxi deviation, every law, issue 13): a seed onto a busy endpoint queues behind its work
    /// for nothing, and at the start of a burst the busy "cold" endpoint is already prefilling
    /// groups of its own whose blocks the copy would later evict (measured on real vLLM
    /// engines and the emulated fleet: each such seed cost about two points of hit rate,
    /// docs/bench-real-vllm.md).
    fn cold_seed(
        &self,
        svc: &ServiceKv,
        cands: &[Cand],
        member: &dyn Fn(EpIdx) -> Option<Member>,
        pick: EpIdx,
    ) -> Option<EpIdx> {
        let s = &self.state.settings;
        let n = svc.hits.fetch_add(1, Ordering::Relaxed) + 1;
        if s.coldstart_seed_n == 0 || !n.is_multiple_of(s.coldstart_seed_n) {
            return None;
        }
        let cold = |ep: EpIdx| {
            let b = member(ep).map_or(0, |m| svc.index.blocks(m));
            if s.coldstart_min_blocks == 0 {
                b == 0
            } else {
                b < s.coldstart_min_blocks
            }
        };
        let idle = |c: &Cand| c.load == 0 && c.work == 0;
        cands
            .iter()
            .filter(|c| idle(c))
            .map(|c| c.ep)
            .find(|&ep| cold(ep))
            .filter(|&ep| ep != pick)
    }
}

/// Cold placement (`LOXI_KV_COLD_PLACEMENT=least-work`, loxi extension): no usable endpoint
/// holds the request's first block, so no placement saves anything; the request is priced by
/// what it waits for, and the new prefix goes where the least is cached. With `n` request
/// blocks of `B` tokens, `W_i` the prefill work queued on `i` (tokens,
/// `EndpointLoad::prefill_work`), `w_i` its weight, `N` the usable endpoints, `b_i` the blocks
/// the index holds for it and `L_i` its effective load, the usable endpoint with the least
///
/// `q_i = floor((W_i + n·B) · Σw / (w_i · N · n·B))`
///
/// (its queue in units of this request's own prefill, per capacity share), ties → least
/// `b_i` → least `L_i` → index. `None` when no endpoint is usable (the rule's `sel` decides).
///
/// Why the quantum: the prefix placed here draws its later requests here. Waits within one
/// prefill of each other are the same to this request, and the emptiest cache then spreads
/// new prefixes (8 groups over 4 workers at 30 requests/s: exact least work placed them
/// 3/1/2/2 and `hard` spilled 28 requests to even the load; with the quantum 2/2/2/2).
///
/// Why at all: LoxiLB falls through to the rule's `sel` (round robin in the common setup),
/// blind to both the queued prefill and the request's own: with little reuse (4 `vllm-sim`
/// workers, 150 groups, 24 requests/s) 91 % of requests were placed that way and the KV
/// policy's TTFT p99 was 1.1–1.35× round robin's (issue 13 goal 4).
fn cold_place(
    blocks: usize,
    svc: &ServiceKv,
    cands: &Candidates<'_>,
    usable: &dyn Fn(EpIdx) -> bool,
    member: &dyn Fn(EpIdx) -> Option<Member>,
) -> Option<EpIdx> {
    let nb = (blocks as u64 * u64::from(svc.config.block_size)).max(1);
    let weight = |ep: EpIdx| u64::from(cands.weights.get(ep).copied().unwrap_or(1).max(1));
    let (count, wsum) = (0..cands.len())
        .filter(|&ep| usable(ep))
        .fold((0u64, 0u64), |(c, s), ep| (c + 1, s + weight(ep)));
    // An endpoint whose engine is not heard (`ServiceKv::heard`: its publisher unreachable,
    // its stream down) holds no blocks in the index whatever its cache holds: counted as
    // holding the mean of the heard ones, so a dead stream costs hits, never a pull of every
    // new prefix onto that endpoint as "the emptiest cache".
    let heard = svc.heard_members();
    let held: Vec<Option<u64>> = (0..cands.len())
        .map(|ep| {
            member(ep)
                .filter(|m| usable(ep) && heard.binary_search(m).is_ok())
                .map(|m| svc.index.blocks(m))
        })
        .collect();
    let (sum, n_heard) = held
        .iter()
        .flatten()
        .fold((0u64, 0u64), |(s, c), b| (s + b, c + 1));
    let mean = sum / n_heard.max(1);
    // Endpoints equal on every criterion take turns (a fleet whose streams are all down, or
    // equal idle engines, would otherwise send every new prefix to the lowest index).
    let n = cands.len().max(1);
    let turn = svc
        .cold_turn
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        % n;
    (0..cands.len()).filter(|&ep| usable(ep)).min_by_key(|&ep| {
        let l = &cands.loads[ep];
        let wait = u128::from(l.prefill_work() + nb) * u128::from(wsum);
        let quanta = wait / (u128::from(weight(ep)) * u128::from(count) * u128::from(nb));
        (
            quanta,
            held[ep].unwrap_or(mean),
            l.effective_load(),
            (ep + n - turn) % n,
        )
    })
}

/// What holds a replica seed: requests of another prompt opening still waiting for their
/// decision, or placed within `LOXI_KV_REPLICA_HOLD_MS` ([`ServiceKv::openings`]).
#[derive(Debug, Clone, Copy)]
struct Hold {
    others_waiting: bool,
    /// The request's own opening ([`opening`]).
    opening: Option<u64>,
}

/// Bytes of a prompt's opening that [`opening`] fingerprints (a system prompt's first
/// sentences, which tell requests of different prompts apart in a burst).
const OPENING_BYTES: usize = 256;

/// The fingerprint of a request's prompt opening, for [`ServiceKv::waiting`]: XXH3 of the
/// first [`OPENING_BYTES`] bytes of a text prompt, of the first chat message's role and
/// content, or of the first 64 token ids. `None` without a prompt (the request never reaches
/// a decision that could seed a replica).
fn opening(meta: &RequestMeta) -> Option<u64> {
    use xxhash_rust::xxh3::Xxh3;
    let mut h = Xxh3::new();
    match meta.prompt.as_ref()? {
        Prompt::Text(t) => h.update(&t.as_bytes()[..t.len().min(OPENING_BYTES)]),
        Prompt::TokenIds(ids) => {
            for id in ids.iter().take(64) {
                h.update(&id.to_le_bytes());
            }
        }
        Prompt::Messages(msgs) => {
            let m = msgs.first()?;
            h.update(m.role.as_bytes());
            h.update(&[0]);
            h.update(&m.content.as_bytes()[..m.content.len().min(OPENING_BYTES)]);
        }
    }
    Some(h.digest())
}

/// The cheap guards, on the request's thread: `text_empty`, `model_empty`, then `oversize`
/// (see [`PromptBounds`]): a chat cut by the body parse, with more than `max_messages`
/// messages, more than `max_bytes` of content or a whitespace-free run longer than
/// `max_run_bytes`; a text whose first `max_bytes` bytes hold such a run. Returns the part of
/// the request the tokenization job needs (the prompt at most `max_bytes` of text, or
/// `max_tokens` ids) and whether the text is a cut prefix of the client's.
fn screen(meta: &RequestMeta, b: &PromptBounds) -> Result<(RequestMeta, bool), MissReason> {
    // A body that is not OpenAI JSON names no model (LoxiLB's Guard D, `model_empty`, the
    // spec's "client is not sending OpenAI JSON" signature), whatever else it lacks.
    if !meta.json_ok && meta.model.as_deref().is_none_or(str::is_empty) {
        return Err(MissReason::ModelEmpty);
    }
    let prompt = meta
        .prompt
        .as_ref()
        .filter(|p| !p.is_empty())
        .ok_or(MissReason::TextEmpty)?;
    meta.model
        .as_deref()
        .filter(|m| !m.is_empty())
        .ok_or(MissReason::ModelEmpty)?;
    let (prompt, prefix) = match prompt {
        Prompt::Messages(msgs) => {
            let bytes: usize = msgs.iter().map(|m| m.content.len() + m.role.len()).sum();
            if meta.body_cut
                || msgs.len() > b.max_messages
                || bytes > b.max_bytes
                || msgs
                    .iter()
                    .any(|m| longest_run(&m.content, b.max_run_bytes) > b.max_run_bytes)
            {
                return Err(MissReason::Oversize);
            }
            (Prompt::Messages(msgs.clone()), false)
        }
        Prompt::Text(text) => {
            let mut end = text.len().min(b.max_bytes);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            let head = &text[..end];
            if longest_run(head, b.max_run_bytes) > b.max_run_bytes {
                return Err(MissReason::Oversize);
            }
            // The body parse cuts strings at `max_bytes` (at a character boundary).
            let cut = end < text.len() || (meta.body_cut && text.len() + 4 > b.max_bytes);
            (Prompt::Text(head.to_owned()), cut)
        }
        Prompt::TokenIds(ids) => {
            let max = EncodeBounds {
                max_tokens: b.max_tokens,
                prefix: false,
            }
            .limit(None);
            (Prompt::TokenIds(ids[..ids.len().min(max)].to_vec()), false)
        }
    };
    let bounded = RequestMeta {
        api: meta.api,
        model: meta.model.clone(),
        prompt: Some(prompt),
        add_special_tokens: meta.add_special_tokens,
        cache_salt: meta.cache_salt.clone(),
        lora_name: meta.lora_name.clone(),
        ..RequestMeta::default()
    };
    Ok((bounded, prefix))
}

/// The longest run of bytes without ASCII whitespace in `text`, counted up to just past
/// `stop` (a longer run answers `stop + 1`).
fn longest_run(text: &str, stop: usize) -> usize {
    let mut run = 0usize;
    let mut longest = 0usize;
    for &c in text.as_bytes() {
        if c.is_ascii_whitespace() {
            run = 0;
        } else {
            run += 1;
            if run > longest {
                longest = run;
                if longest > stop {
                    break;
                }
            }
        }
    }
    longest
}

/// Overlap unit of the blend laws in tier 1.5: a GPU prefix block counts `MILLI`, an
/// offload-tier block `LOXI_KV_CPU_TIER_CREDIT × MILLI` (at most `MILLI − 1`).
const MILLI: usize = 1000;

/// Tokenization and hashing of a screened request: `hashes` (an unknown `lora_name`) →
/// `model_unknown` → `tokenize` → `shallow` → `short_prompt`, the stages timed into the
/// service's histograms.
fn keys_of(
    state: &KvState,
    tokenizer: &dyn PromptTokenizer,
    svc: &ServiceKv,
    meta: &RequestMeta,
    prefix: bool,
) -> Result<Vec<BlockKey>, MissReason> {
    let (Some(prompt), Some(model)) = (meta.prompt.as_ref(), meta.model.as_deref()) else {
        return Err(MissReason::TextEmpty);
    };
    let s = &state.settings;
    let t = StdInstant::now();
    let span = crate::kv_stage_span!("kv.tokenize");
    let bounds = EncodeBounds {
        max_tokens: s.bounds.max_tokens,
        prefix,
    };
    let (lora, tok_model) = lora_of(state, meta, model)?;
    // A model no engine lists (once a poll answered) and no adapter names: nothing to look up
    // a tokenizer for, and nothing any engine caches; not a tokenizer failure.
    if lora.is_none() && state.lora.lists(model) == Some(false) {
        return Err(MissReason::ModelUnknown);
    }
    let encoded;
    let tokens: &[u32] = match prompt {
        Prompt::TokenIds(ids) => ids,
        p => {
            let r = span.in_scope(|| {
                tokenizer.encode_bounded(&tok_model, meta.api, p, meta.add_special_tokens, bounds)
            });
            let chat = matches!(p, Prompt::Messages(_));
            match r {
                Ok(_) => svc.tokenize.succeeded(&tok_model, chat),
                Err(MissReason::Tokenize) => svc.tokenize.failed(&tok_model, chat),
                Err(_) => {}
            }
            encoded = r?;
            &encoded
        }
    };
    svc.route.stage(Stage::Tokenize, t.elapsed().as_secs_f64());
    if prompt.has_media() {
        svc.route.media_prefix();
    }
    span.record("loxi.kv.tokens", crate::telemetry::span::int(tokens.len()));
    tracing::Span::current().record("loxi.kv.tokens", crate::telemetry::span::int(tokens.len()));
    if tokens.len() < s.min_match_tokens {
        return Err(MissReason::Shallow);
    }
    let extras = RequestExtras {
        lora,
        cache_salt: meta.cache_salt.clone(),
    };
    let t = StdInstant::now();
    let span = crate::kv_stage_span!("kv.hash");
    let keys = span.in_scope(|| {
        svc.hasher
            .keys(tokens, svc.config.block_size as usize, &extras)
    });
    svc.route.stage(Stage::Hash, t.elapsed().as_secs_f64());
    span.record("loxi.kv.blocks", crate::telemetry::span::int(keys.len()));
    tracing::Span::current().record("loxi.kv.blocks", crate::telemetry::span::int(keys.len()));
    if s.hash_debug {
        tracing::info!(service = svc.id, blocks = keys.len(), keys = ?keys, "kv hash debug");
    }
    if keys.is_empty() {
        return Err(MissReason::ShortPrompt);
    }
    Ok(keys)
}

/// A request's LoRA extra key `(name, path)`, if any, and the model whose tokenizer encodes it.
type LoraAndTokenizer<'a> = (Option<(String, String)>, Cow<'a, str>);

/// The request's LoRA extra key `(name, path)` and the model whose tokenizer encodes it: when
/// `model` (or an explicit `lora_name`) names an adapter of the catalog, its name and path, and
/// its base model (the adapter's own name when no engine listed a parent). A `lora_name` the
/// catalog does not know misses with `hashes` (its path, part of every key, is unknown).
fn lora_of<'a>(
    state: &KvState,
    meta: &RequestMeta,
    model: &'a str,
) -> Result<LoraAndTokenizer<'a>, MissReason> {
    let (name, adapter) = match &meta.lora_name {
        Some(n) => (
            n.as_str(),
            Some(state.lora.resolve(n).ok_or(MissReason::Hashes)?),
        ),
        None => (model, state.lora.resolve(model)),
    };
    Ok(match adapter {
        Some(a) => (
            Some((name.to_owned(), a.path)),
            a.parent.map_or(Cow::Borrowed(model), Cow::Owned),
        ),
        None => (None, Cow::Borrowed(model)),
    })
}

#[cfg(test)]
#[path = "select_tests.rs"]
mod tests;
