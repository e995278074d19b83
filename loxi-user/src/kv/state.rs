//! Shared KV state: one [`ServiceKv`] per rule with kvExactMode ≠ 0 (its index, hash contract,
//! stream status and parity book), held in [`KvState`] which the router, the subscriber manager
//! and the REST API share.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tokio::time::Instant;

use super::block_hash::BlockHasher;
use super::cross::CrossWatch;
use super::index::KvIndex;
use super::ingest::parity::ParityBook;
use super::lora::LoraCatalog;
use super::members::{Member, MemberChange, Members};
use super::metrics::{EpLabels, KvMetrics, RouteMetrics, ep_label};
use super::settings::KvSettings;
use crate::routing::EpIdx;
use crate::rules::store::StoredRule;
use crate::rules::{KvEndpoint, KvSpec};

/// The two latest records of distinct prompt openings of one service: enough to tell in
/// constant time when a request whose prompt opens differently from a given one was last seen.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Openings {
    /// The latest record: its opening's fingerprint and when.
    last: Option<(u64, Instant)>,
    /// The latest record whose opening differs from `last`'s.
    other: Option<(u64, Instant)>,
}

impl Openings {
    /// Records a request with opening `fp` at `at` (calls in time order).
    pub fn seen(&mut self, fp: u64, at: Instant) {
        match self.last {
            Some((last, _)) if last == fp => {}
            _ => self.other = self.last,
        }
        self.last = Some((fp, at));
    }

    /// When a request whose opening differs from `fp` was last recorded (`fp` `None`: any
    /// request); `None` if none was.
    pub fn other_than(&self, fp: Option<u64>) -> Option<Instant> {
        match (self.last, fp) {
            (Some((last, _)), Some(fp)) if last == fp => self.other.map(|(_, at)| at),
            (last, _) => last.map(|(_, at)| at),
        }
    }

    /// The same records `by` earlier (tests: a hold window passing without waiting for it).
    #[cfg(test)]
    pub fn aged(&self, by: std::time::Duration) -> Self {
        let back = |r: Option<(u64, Instant)>| {
            r.map(|(fp, at)| (fp, at.checked_sub(by).expect("a clock past `by`")))
        };
        Self {
            last: back(self.last),
            other: back(self.other),
        }
    }
}

/// The KV contract of one rule: its compiled [`KvSpec`] (validation decided every default).
/// In a [`ServiceKv`] its `endpoints` list is empty: the live list is [`ServiceKv::members`].
pub type ServiceKvConfig = KvSpec;

/// Live status of one (endpoint, rank) event stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamStatus {
    /// Socket connected now.
    pub connected: bool,
    /// Last sequence number applied.
    pub last_seq: Option<u64>,
    /// A catch-up replay (on connect, with a replay port) is under way: the endpoint is
    /// reported `syncing`.
    pub syncing: bool,
}

/// What the zero-hit watchdog knows of one endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroHitWatch {
    /// Requests with block keys routed to it while it held confirmed blocks.
    pub routed_holding: u64,
    /// One of its confirmed blocks was the first block of a scored request, or the first
    /// block key of a request routed to it later showed up among its confirmed blocks (the
    /// engine hashed that request as loxi did: agreement without any reuse).
    pub matched: bool,
    /// First block keys of the last requests routed to it (a ring), checked against its
    /// confirmed blocks by the readiness pass until one shows up.
    pub probes: [Option<super::BlockKey>; 4],
    /// Next slot of `probes`.
    pub next_probe: u8,
    /// Already counted in `loxilb_pd_kv_zero_hit_watchdog_total`.
    pub flagged: bool,
    /// The readiness state last published (and logged) for it.
    pub reported: Option<&'static str>,
}

/// KV state of one service.
pub struct ServiceKv {
    /// Rule id (`service` label, `service_id` in the API).
    pub id: u32,
    /// The rule's compiled KV contract (without its endpoints; see [`ServiceKvConfig`]).
    pub config: ServiceKvConfig,
    /// The rule's endpoints with their stable member ids (index, parity, streams are keyed by
    /// member; positions are translated at the edges).
    pub members: RwLock<Members>,
    /// The `service` label (the id as text, made once).
    pub label: String,
    /// The block index.
    pub index: KvIndex,
    /// Hasher for the rule's contract.
    pub hasher: BlockHasher,
    /// Request-path metric handles of this service (resolved once, at creation).
    pub route: RouteMetrics,
    /// When the first subscriber of this service connected (warmup start); set once, read
    /// without a lock on every request.
    pub warm_start: OnceLock<Instant>,
    /// `kvWarmupSec` in milliseconds: the rule's, changed in place by a rule update
    /// ([`Self::apply_warmup`]; `config.warmup` keeps the value the state was built with).
    warmup_ms: AtomicU64,
    /// Tier 1.5 hits so far (drives cold-start seeding).
    pub hits: AtomicU64,
    /// Status per (member, rank).
    pub streams: Mutex<HashMap<(Member, u32), StreamStatus>>,
    /// Parity verdicts and token re-hash state per member.
    pub parity: Mutex<ParityBook>,
    /// The LoRA adapters the parity check hashes `lora_name` blocks with (the state's).
    pub lora: Arc<LoraCatalog>,
    /// Per (member, `group_idx`): is that KV cache group a prefix group (full attention)?
    /// Learned from `BlockStored`; a `BlockRemoved` of a non-prefix group is ignored.
    pub groups: Mutex<HashMap<(Member, u32), bool>>,
    /// Zero-hit watchdog per member (`kv::readiness`).
    pub watch: Mutex<HashMap<Member, ZeroHitWatch>>,
    /// The crossed-stream check: where the first blocks of cold placements were published
    /// ([`super::cross`]).
    pub cross: Mutex<CrossWatch>,
    /// [`CrossWatch::suspects`] as of the last readiness pass (ascending): their blocks give
    /// no overlap and they are not [`Self::heard`]. Read on every decision.
    pub crossed: RwLock<Vec<Member>>,
    /// Models whose prompts this rule could not tokenize since their last success (the
    /// parity report's `tokenizer` section).
    pub tokenize: TokenizeWatch,
    /// Requests waiting for their tier-1.5 decision (tokenization queued or running), by the
    /// fingerprint of their prompt's opening, with counts: replica seeding holds off while any
    /// of them opens differently from the request being decided (`kv::route::select`). Entries
    /// are added by `KvRouter::prepare` and removed when the request's first selection runs
    /// or its ticket is dropped.
    pub waiting: Mutex<HashMap<u64, u32>>,
    /// The latest decisions of distinct prompt openings that hold at least one full block:
    /// replica seeding also holds off while one of another opening was decided within the
    /// hold window ([`KvSettings::replica_hold_window`]; `kv::route::select`).
    pub openings: Mutex<Openings>,
    /// Set when the service was dropped (rule deleted, KV off, contract rebuilt): its streams,
    /// still stopping, record no more series.
    retired: AtomicBool,
    /// Cold placements so far: rotates the tie-break among endpoints that are equal on every
    /// criterion of `cold_place` (so equal idle engines take turns, not the lowest index).
    pub cold_turn: std::sync::atomic::AtomicUsize,
}

impl ServiceKv {
    /// Fresh state for service `id` with contract `config`; resolves its metric handles.
    pub fn new(id: u32, config: &KvSpec, settings: &KvSettings, metrics: &KvMetrics) -> Self {
        let label = id.to_string();
        metrics.init_service(&label, config.endpoints.len());
        Self {
            id,
            route: metrics.route(&label, config.endpoints.len()),
            label,
            index: KvIndex::new(settings.max_blocks),
            hasher: BlockHasher::new(config.algo, settings.none_hash_seed.as_deref()),
            warm_start: OnceLock::new(),
            warmup_ms: AtomicU64::new(duration_ms(config.warmup)),
            hits: AtomicU64::new(0),
            streams: Mutex::new(HashMap::new()),
            parity: Mutex::new(ParityBook::default()),
            members: RwLock::new(Members::new(&config.endpoints)),
            retired: AtomicBool::new(false),
            cold_turn: std::sync::atomic::AtomicUsize::new(0),
            lora: Arc::new(LoraCatalog::new(settings.lora_paths.clone())),
            groups: Mutex::new(HashMap::new()),
            watch: Mutex::new(HashMap::new()),
            cross: Mutex::new(CrossWatch::default()),
            crossed: RwLock::new(Vec::new()),
            tokenize: TokenizeWatch::default(),
            waiting: Mutex::new(HashMap::new()),
            openings: Mutex::new(Openings::default()),
            config: KvSpec {
                endpoints: Vec::new(),
                ..config.clone()
            },
        }
    }

    /// The same state checking LoRA blocks against `lora` (the [`KvState`]'s shared catalog).
    pub fn with_lora(mut self, lora: Arc<LoraCatalog>) -> Self {
        self.lora = lora;
        self
    }

    /// Counts one more request waiting for its decision with prompt opening `fp`.
    pub fn wait_add(&self, fp: u64) {
        *self.waiting.lock().entry(fp).or_insert(0) += 1;
    }

    /// Counts one request with opening `fp` as decided (or gone); the entry goes at zero.
    pub fn wait_remove(&self, fp: u64) {
        let mut w = self.waiting.lock();
        if let Some(n) = w.get_mut(&fp) {
            *n -= 1;
            if *n == 0 {
                w.remove(&fp);
            }
        }
    }

    /// True when a request whose prompt opens differently from `fp` is waiting for its
    /// decision (constant time: the map holds only openings with a waiting request).
    pub fn others_waiting(&self, fp: Option<u64>) -> bool {
        let w = self.waiting.lock();
        match fp {
            Some(fp) => w.len() > usize::from(w.contains_key(&fp)),
            None => !w.is_empty(),
        }
    }

    /// The current position of `member` in the rule (`None` once it left).
    pub fn ep_idx(&self, member: Member) -> Option<EpIdx> {
        if self.retired.load(Ordering::Relaxed) {
            return None;
        }
        self.members.read().idx_of(member)
    }

    /// Was the service dropped ([`KvState::drop_service`])?
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// The subscriber labels of stream (`member`, `rank`) at the member's current position;
    /// `None` once the member left the rule (its stream is being stopped: it records nothing).
    pub fn ep_labels(&self, member: Member, rank: u32) -> Option<EpLabels> {
        Some(EpLabels {
            service: self.label.clone(),
            ep: ep_label(self.ep_idx(member)?, rank),
        })
    }

    /// Follows a rule update that kept the KV contract: endpoints are matched by identity
    /// ([`Members::sync`]); a removed endpoint's blocks, predictions, parity state and stream
    /// status are dropped; every series at a position whose endpoint changed is removed (none
    /// is relabelled onto another endpoint) and the gauges at the new positions are set from
    /// the state they now name. Returns what changed.
    pub fn sync_endpoints(&self, eps: &[KvEndpoint], metrics: &KvMetrics) -> MemberChange {
        let change = self.members.write().sync(eps);
        if change.is_empty() {
            return change;
        }
        for &m in &change.removed {
            self.index.forget(m);
            self.parity.lock().reset(m);
            self.streams.lock().retain(|(sm, _), _| *sm != m);
            self.groups.lock().retain(|(gm, _), _| *gm != m);
            self.watch.lock().remove(&m);
            self.cross.lock().forget(m);
        }
        let len = self.members.read().len();
        for &pos in &change.moved {
            metrics.forget_ep(&self.label, pos, self.config.dp_ranks);
            if pos < len {
                metrics.init_ep(&self.label, pos);
            }
            self.route.forget_ep(pos, pos < len);
        }
        let members = self.members.read();
        let streams = self.streams.lock();
        for &pos in &change.moved {
            let Some(m) = members.member_at(pos) else {
                continue;
            };
            metrics.set_blocks(&self.label, pos, self.index.blocks(m));
            for ((sm, rank), st) in streams.iter() {
                if *sm == m {
                    let l = EpLabels {
                        service: self.label.clone(),
                        ep: ep_label(pos, *rank),
                    };
                    metrics
                        .connected
                        .get_or_create(&l)
                        .set(i64::from(st.connected));
                }
            }
        }
        change
    }

    /// The `service` label.
    pub fn label(&self) -> String {
        self.label.clone()
    }

    /// Records a subscriber connect/disconnect of stream (`member`, `rank`); the first connect
    /// starts the warmup window.
    pub fn set_connected(&self, member: Member, rank: u32, up: bool) {
        self.streams
            .lock()
            .entry((member, rank))
            .or_default()
            .connected = up;
        if up {
            self.warm_start.get_or_init(Instant::now);
        }
    }

    /// Whether the engine of `member` is heard: one of its streams is connected now, its
    /// stored events are not all refused for their block size and the crossed-stream check
    /// does not suspect its inventory ([`Self::crossed`]). An endpoint that is not heard (a
    /// publisher never reached, a stream down, an engine running another block size:
    /// readiness `mismatch`, leg `block_size`; readiness `crossed` or `unseen`) has an inventory that says nothing of
    /// its cache; a connected engine that has published nothing yet holds nothing (vLLM publishes
    /// every block it stores), so it is heard, and truly empty.
    pub fn heard(&self, member: Member) -> bool {
        self.heard_members().binary_search(&member).is_ok()
    }

    /// The members [`Self::heard`] is true of (ascending, each once); the stream and parity
    /// locks are taken one after the other, never together.
    pub fn heard_members(&self) -> Vec<Member> {
        let mut out: Vec<Member> = self
            .streams
            .lock()
            .iter()
            .filter(|(_, s)| s.connected)
            .map(|((m, _), _)| *m)
            .collect();
        out.sort_unstable();
        out.dedup();
        {
            let parity = self.parity.lock();
            out.retain(|m| parity.get(*m).is_none_or(|p| !p.only_block_size_rejects()));
        }
        let crossed = self.crossed.read();
        out.retain(|m| crossed.binary_search(m).is_err());
        out
    }

    /// Marks stream (`member`, `rank`) as catching up from the replay socket (`true`) or done.
    pub fn set_syncing(&self, member: Member, rank: u32, syncing: bool) {
        self.streams
            .lock()
            .entry((member, rank))
            .or_default()
            .syncing = syncing;
    }

    /// True while `kvWarmupSec` has not elapsed since the first subscriber connected (or none
    /// has connected yet). Always false when `kvWarmupSec` is 0.
    pub fn warming(&self, now: Instant) -> bool {
        self.warmup_left(now).is_some()
    }

    /// What is left of the warmup window at `now`: `None` when it is over or `kvWarmupSec` is
    /// 0; `Some(None)` while no subscriber has connected yet (the window has not started);
    /// `Some(Some(d))` with `d` left of a running window.
    pub fn warmup_left(&self, now: Instant) -> Option<Option<Duration>> {
        let warmup = self.warmup();
        if warmup.is_zero() {
            return None;
        }
        match self.warm_start.get() {
            None => Some(None),
            Some(start) => (*start + warmup)
                .checked_duration_since(now)
                .filter(|d| !d.is_zero())
                .map(Some),
        }
    }

    /// The rule's `kvWarmupSec`, as last applied.
    pub fn warmup(&self) -> Duration {
        Duration::from_millis(self.warmup_ms.load(Ordering::Relaxed))
    }

    /// Applies a rule update's `kvWarmupSec` to the running window (its start stays the first
    /// subscriber's connect): a longer window may reopen, a shorter one may end at once. The
    /// blocks indexed so far are kept. Logged when it changed the value. The request path calls
    /// it on every lookup: an unchanged value is only read, never written.
    fn apply_warmup(&self, warmup: Duration) {
        let ms = duration_ms(warmup);
        if self.warmup_ms.load(Ordering::Relaxed) == ms
            || self.warmup_ms.swap(ms, Ordering::Relaxed) == ms
        {
            return;
        }
        tracing::info!(
            service = self.id,
            warmup_sec = warmup.as_secs_f64(),
            "kvWarmupSec changed; applied to the running warmup window, the KV inventory is kept"
        );
    }
}

/// `d` in whole milliseconds, saturating.
fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Everything the KV tier shares across tasks.
pub struct KvState {
    /// Process settings.
    pub settings: KvSettings,
    /// Metric handles.
    pub metrics: KvMetrics,
    /// LoRA adapters known (configured paths and the engines' `/v1/models` listings).
    pub lora: Arc<LoraCatalog>,
    services: RwLock<HashMap<u32, Arc<ServiceKv>>>,
}

impl KvState {
    /// Empty state.
    pub fn new(settings: KvSettings, metrics: KvMetrics) -> Arc<Self> {
        Arc::new(Self {
            lora: Arc::new(LoraCatalog::new(settings.lora_paths.clone())),
            settings,
            metrics,
            services: RwLock::new(HashMap::new()),
        })
    }

    /// The state of `rule`'s service, created when missing or when its KV contract changed;
    /// `None` when the rule has tier 1.5 off. A change of endpoints alone keeps the state: the
    /// request path reads it as it is, and the subscriber manager applies the new endpoint
    /// list in snapshot order ([`Self::sync`]), so a request holding an older snapshot of the
    /// rule never moves it back.
    pub fn service(&self, rule: &StoredRule) -> Option<Arc<ServiceKv>> {
        let cfg = rule.spec.kv.as_ref()?;
        if let Some(s) = self.services.read().get(&rule.id)
            && s.config.same_contract(cfg)
        {
            s.apply_warmup(cfg.warmup);
            return Some(s.clone());
        }
        let mut map = self.services.write();
        Some(match map.get(&rule.id) {
            Some(s) if s.config.same_contract(cfg) => {
                s.apply_warmup(cfg.warmup);
                s.clone()
            }
            _ => {
                let s = Arc::new(
                    ServiceKv::new(rule.id, cfg, &self.settings, &self.metrics)
                        .with_lora(self.lora.clone()),
                );
                map.insert(rule.id, s.clone());
                s
            }
        })
    }

    /// [`Self::service`], then the rule's endpoint list applied to it
    /// ([`ServiceKv::sync_endpoints`]). Called by the subscriber manager for each snapshot.
    pub fn sync(&self, rule: &StoredRule) -> Option<Arc<ServiceKv>> {
        let svc = self.service(rule)?;
        let eps = rule.spec.kv.as_ref().map_or(&[][..], |k| &k.endpoints[..]);
        svc.sync_endpoints(eps, &self.metrics);
        Some(svc)
    }

    /// Every service's state (for the background prediction sweep).
    pub fn all(&self) -> Vec<Arc<ServiceKv>> {
        self.services.read().values().cloned().collect()
    }

    /// The service's state if it exists.
    pub fn get(&self, id: u32) -> Option<Arc<ServiceKv>> {
        self.services.read().get(&id).cloned()
    }

    /// Drops a service's state (rule deleted or KV turned off).
    pub fn drop_service(&self, id: u32) {
        if let Some(s) = self.services.write().remove(&id) {
            s.retired.store(true, Ordering::Relaxed);
            let eps = s.members.read().len();
            self.metrics
                .forget_service(&s.label(), eps, s.config.dp_ranks);
        }
    }

    /// Ids of services with state.
    pub fn ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.services.read().keys().copied().collect();
        v.sort_unstable();
        v
    }
}

/// Models whose text or chat prompts a rule could not tokenize (miss reason `tokenize`: no
/// usable tokenizer staged, a chat template that failed, the tokenizer refusing the text),
/// per model and prompt kind (chat or text: a chat template can fail while completions of the
/// same model tokenize), with the failures counted since that kind's last success; a success
/// of the same model and kind clears it. At most [`TokenizeWatch::MAX_TRACKED`] are kept
/// (clients choose the model names a wildcard pool sees): beyond, the one whose last failure
/// is oldest is forgotten (it is tracked again at its next failure). The success path costs
/// one relaxed load while nothing fails.
#[derive(Debug, Default)]
pub struct TokenizeWatch {
    any: AtomicBool,
    failing: Mutex<Failing>,
}

#[derive(Debug, Default)]
struct Failing {
    /// (model, chat) → (failures, sequence number of the last one).
    entries: HashMap<(String, bool), (u64, u64)>,
    seq: u64,
}

/// One model and prompt kind whose prompts do not tokenize ([`TokenizeWatch::failures`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizeFailure {
    /// The model the tokenizer is looked up by.
    pub model: String,
    /// Chat prompts (`true`) or text and token-less prompts (`false`).
    pub chat: bool,
    /// Failures since its last success.
    pub failures: u64,
}

impl TokenizeWatch {
    /// Models and kinds tracked at most.
    pub const MAX_TRACKED: usize = 64;

    /// A prompt of `model` (a chat one when `chat`) failed to tokenize. A model name longer
    /// than a tokenizer directory's is kept shortened
    /// ([`crate::kv::tokenizer::pool::bounded_name`]).
    pub fn failed(&self, model: &str, chat: bool) {
        let model = crate::kv::tokenizer::pool::bounded_name(model);
        let model: &str = &model;
        let mut f = self.failing.lock();
        f.seq += 1;
        let seq = f.seq;
        if let Some(e) = f.entries.get_mut(&(model.to_owned(), chat)) {
            *e = (e.0 + 1, seq);
        } else {
            if f.entries.len() >= Self::MAX_TRACKED
                && let Some(oldest) = f
                    .entries
                    .iter()
                    .min_by_key(|(_, (_, at))| *at)
                    .map(|(k, _)| k.clone())
            {
                f.entries.remove(&oldest);
            }
            f.entries.insert((model.to_owned(), chat), (1, seq));
        }
        self.any.store(true, Ordering::Relaxed);
    }

    /// A prompt of `model` (a chat one when `chat`) was tokenized: that model and kind are no
    /// longer failing.
    pub fn succeeded(&self, model: &str, chat: bool) {
        if !self.any.load(Ordering::Relaxed) {
            return;
        }
        let mut f = self.failing.lock();
        let model = crate::kv::tokenizer::pool::bounded_name(model);
        f.entries.remove(&(model.into_owned(), chat));
        if f.entries.is_empty() {
            self.any.store(false, Ordering::Relaxed);
        }
    }

    /// Every model and kind failing now, the most recent failure first.
    pub fn failures(&self) -> Vec<TokenizeFailure> {
        let f = self.failing.lock();
        let mut v: Vec<(u64, TokenizeFailure)> = f
            .entries
            .iter()
            .map(|((model, chat), (failures, at))| {
                let failure = TokenizeFailure {
                    model: model.clone(),
                    chat: *chat,
                    failures: *failures,
                };
                (*at, failure)
            })
            .collect();
        v.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
        v.into_iter().map(|(_, f)| f).collect()
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
