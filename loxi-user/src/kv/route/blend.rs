//! Blend laws of tier 1.5 (`LOXILB_KV_LB_MODE`): how cache overlap and live load combine.
//!
//! Notation, per eligible endpoint `i` (healthy, not excluded): `o_i` overlap in blocks (leading
//! cached run), `L_i` load = in-flight + queued (or, when the engine's `/metrics` is scraped,
//! `max` of that and the engine's running + waiting: `EndpointLoad::effective_load`), `w_i`
//! weight (0 counts as 1), `c_i = w_i / Σw` capacity share, `N` eligible count, `T = Σ L_i`, `n` request blocks. The *owner* is
//! `argmax o_i`, ties → lower `L_i` → lower index. Every law is pure: [`blend`] returns the pick
//! and whether it was a spill; the caller has already checked that some eligible `o_i > 0`.
//!
//! Ties (loxi deviation): LoxiLB breaks overlap ties by endpoint order only. Every request whose
//! cached prefix several endpoints share (a common system prompt, or a group the law has spilled
//! once) then goes to the lowest index, so prefixes drift onto the first endpoints and the last
//! ones idle. loxi breaks them by load first, in the owner and in the `hard` walk.
//!
//! Relief (loxi deviation): LoxiLB's `hard` relieves an over-cap owner as soon as every holder is
//! over `cap_i`, sending the request to an endpoint that must recompute the whole prefix (a cold
//! prefill, and one more copy of the prefix in the fleet's caches). A request over the cap on its
//! owner only waits for a batch slot, so loxi relieves only beyond twice the slack, `2ε`; a
//! holder under `cap_i` still takes the spill first. The `2ε` allowance is one endpoint's, for
//! the whole prefix: relief starts when the holders of the prefix *together* carry the owner's
//! relief cap (`Σ_{o_j > 0} L_j + 1 > ceil((1 + 2ε)·(T + 1)·c_owner)`, [`relief_due`]), not only
//! when the owner alone does. With one holder the two are the same; with several, each held
//! under `cap_i` but none over the relief cap, LoxiLB's bound `cap_i` would otherwise never
//! come back: a cold burst of one prefix whose blocks two endpoints hold (a cold seed or a
//! spill made the second copy) went 32/32/0/0 over 4 endpoints, above `cap_i` = 28 on both
//! (issue 13); it now spreads within `cap_i` (about 22/21/21/0). Gateway replicas that share
//! nothing but the engines each apply it to their own in-flight counts; the bound is additive
//! over replicas (each keeps its share of every endpoint under its own `cap_i`), so no
//! replica count needs configuring.
//!
//! | law | rule |
//! |-----|------|
//! | `off` | owner |
//! | `hard` | bounded load: `cap_i = ceil((1 + ε)·(T + 1)·c_i)`, `ε = (LOXILB_KV_MEAN_LOAD_FACTOR − 100)/100`. Walk endpoints with `o_i > 0` by descending `o_i` (ties by lower `L_i`, then index); the first with `L_i + 1 ≤ cap_i` wins (a spill if it is not the owner). If all are over cap: with spill relief, and the holders together over the owner's relief cap (`Σ_{o_j>0} L_j + 1 > ceil((1 + 2ε)·(T + 1)·c_owner)`), the least-loaded under-cap eligible endpoint wins (any overlap, ties by index; a spill), otherwise the owner. |
//! | `soft` | `u_i = 1000·o_i/n − λ·L_i/(N·c_i)`, `λ = LOXILB_KV_LOAD_PENALTY`; `argmax u_i` over all eligible (ties by index); a spill when it is not the owner. |
//! | `adaptive` | `hard` with `ε·f` |
//! | `adaptive-soft` | `soft` with `λ·f` |
//! | `work` (loxi) | least prefill work: `argmin cost_i` over all eligible (ties → higher `o_i` → lower `L_i` → index), a spill when not the owner; see below. |
//!
//! `work` (loxi extension, issue 13) prices a placement in prompt tokens, the unit an engine's
//! prefill is paid in. With `B` the block size, `W_i` the prefill work already queued on `i`
//! (uncached prompt tokens of requests sent to `i` whose response has not started, as this
//! tier estimated them at dispatch), `o_max = max o_j`:
//!
//! `cost_i = [W_i + (n − o_i)·B + ξ·(o_max − o_i)·B + κ·L_i + q_i·n·B] / (N·c_i)`
//!
//! - `(n − o_i)·B`: what this request prefills on `i`; `W_i` what `i` prefills before it. Their
//!   sum is the request's prefill wait on `i` in tokens (TTFT × the engine's prefill rate).
//! - `ξ·(o_max − o_i)·B`, `ξ = LOXILB_KV_WORK_COPY_PERCENT/100` (default 100): recomputing
//!   blocks another endpoint holds makes a second copy, which evicts something that a later
//!   request recomputes; ξ prices that eviction relative to the prefill itself.
//! - `κ·L_i`, `κ = LOXILB_KV_WORK_REQUEST_TOKENS` (default 32): each request in flight holds
//!   a batch slot and a share of every decode step; it breaks ties toward the idler endpoint.
//! - `q_i = max(0, L_i + 1 − S)` with `S = LOXILB_KV_BATCH_SLOTS` (0, the default, = unbounded):
//!   a request beyond the engine's free batch slots waits for a whole request, priced as one
//!   more full prefill of this request.
//!
//! What a holder saves (`o_i·B·(1 + ξ)` tokens) is weighed against what it costs (its queued
//! work): affinity holds while the holder's queue is shorter than the saving, and the burst
//! of a new group stays on its first endpoint while that endpoint has free batch slots (the
//! cap floor the request-count cap lacks: no request count at all, so the first requests of
//! a burst never spill for being "many"). When every endpoint holds the same prefix (or none),
//! the law is least work, then least load: never behind round robin on a workload with no
//! reuse. Cold seeding (`select.rs`, every law) waits for an idle endpoint (no request in
//! flight, no queued work).
//!
//! Spill floor (loxi extension, `hard` and `adaptive`, issue 13; [`spill_pays`]): with
//! `F = LOXI_KV_SPILL_FLOOR` (default 8, 0 = LoxiLB's laws unchanged), a pick with less overlap
//! than the owner (the walk's under-cap holder or relief) stands only when
//!
//! `L_owner ≥ F`  or  `W_owner + (n − o_owner)·B ≥ W_j + (n − o_j)·B`
//!
//! otherwise the owner keeps the request. `cap_i` scales with `T`, so while the fleet is
//! lightly loaded it is one or two requests and the laws spilled requests that would only have
//! waited for a batch slot on their owner: on the demo's workload (4 `vllm-sim` workers, 8
//! groups of 3,072-token system prompts, 30 requests/s) `hard` spilled 5–7 requests, each a
//! cold prefill of 3,200 tokens recomputed instead of 128 on an owner with 2–6 requests in
//! flight and 0–256 tokens of queued prefill; its TTFT p99 was a cold prefill (54–75 ms
//! against sglang-router's 44 and vllm-router `cache_aware`'s 38). With the floor: no spill,
//! the oracle's hit rate, p99 34 ms, [300, 300, 300, 300]. A cold burst still spreads: the
//! owner's queue holds the prefix's first prefill, which pays for the copy, and from `F`
//! requests on the bound of LoxiLB's law applies unchanged (64 requests of one prefix over 4
//! endpoints: [16, 16, 16, 16] with 1, 2 and 4 gateway replicas).
//!
//! Replica seeding (loxi extension, every law, issue 13; `select.rs` applies it after the law
//! and after cold seeding, [`replica`] decides): with `p` the law's pick, `b_j` the blocks the
//! index says endpoint `j` holds and `R = LOXI_KV_REPLICA_LOAD` (default 2, 0 = off), the
//! request goes to the lowest-index eligible `j` with
//!
//! `o_p > 0`, `L_p ≥ R`, `L_p + 1 > ceil((T + 1)·c_p)`, `o_j < o_p`, `L_j = 0`, `W_j = 0`, `b_j = 0`
//!
//! i.e. when the pick already carries `R` requests and more than its request share, and an
//! idle endpoint with an empty cache can take a copy of the prefix and the request. Why: an
//! overlap every endpoint can hold cheaply (a system prompt all conversations share) makes
//! every new conversation's owner the first endpoint that served one, and the laws price only
//! this request's prefill, not the conversation's growing history that will share the owner's
//! cache (3 engines of 29 blocks, 6 conversations growing to 20 blocks each: `hard` placed
//! them [7, 15, 2] and they evicted each other, 82 % of the oracle hit rate). A copy onto an
//! idle, empty endpoint costs one prefill of the prefix on an engine with nothing else to do
//! and evicts nothing; once every endpoint holds the shared prefix, the laws' ties by load
//! spread the conversations ([8, 8, 8] and 93 % of the oracle on the emulated fleet and on 3
//! real vLLM engines; docs/bench-real-vllm.md, "Replica seeding").
//!
//! Free room is an *empty* cache, not `num_gpu_blocks` minus the blocks held: a cache that
//! holds anything fills with its own traffic (vLLM keeps every computed block until it must
//! evict), so a copy into its momentary free room is paid later by the groups that land there.
//! Measured with the engines' sizes scraped (`LOXI_ENGINE_METRICS_INTERVAL_MS=50`, free room =
//! size − 1 − held ≥ the request's blocks): shared prefix at concurrency 4 fell to 94 % and
//! 98 % of the oracle (copies made at the start of the run, before each engine had its own
//! groups), against 100 % with empty caches only. `R = 2` keeps the first repeat of a new
//! group on its holder at the start of a run (`R = 1`, like a cold seed on every hit, cost
//! 1.8 points at concurrency 4). `select.rs` holds a seed (the pick keeps the request) while a
//! request whose prompt opens differently waits for its decision (`ServiceKv::waiting`) or was
//! placed within `LOXI_KV_REPLICA_HOLD_MS` (default 1 s, at least the decision budget) with a
//! full block to cache (`ServiceKv::openings`): in a burst of several prompts at once (6
//! groups, 16 requests due together) the idle empty endpoint is about to be the home of one of
//! them, and a copy made at the burst's start cost 2–10 points of the oracle hit rate on 3
//! real vLLM engines; a burst of conversations sharing one system prompt has only requests of
//! that prompt, and seeds as before. Holding only while another prompt still waited (the first
//! form) let a seed through when the burst's other prompts had been placed already (one c16
//! burst run in five, 89 % of the oracle); counting a prompt's arrival instead of its
//! placement let a short probe with no block to cache hold the multi-turn burst's seeds.
//! Counted as a cold seed (`loxilb_pd_kv_tier15_cold_seeds_total`, reason `kv_cold_seed`).
//!
//! Work guard (loxi extension, `hard` and `adaptive`, issue 13 goal 4; [`work_guard`]): with
//! `G = LOXI_KV_WORK_GUARD_PERCENT/100` (default 2, 0 = off), the law's pick moves to the
//! eligible `j` within its request share `ceil((T + 1)·c_j)` with the least
//! `wait_j + G·(o_pick − o_j)·B` when the pick's own
//! prefill wait `W_pick + (n − o_pick)·B` exceeds it: affinity holds while the holder's queue
//! costs less than `G` times what its cached prefix saves.
//!
//! Cold placement (loxi extension, every law, `select.rs` `cold_place`,
//! `LOXI_KV_COLD_PLACEMENT=least-work`, the default): when no usable endpoint holds the
//! request's first block no law runs (nothing to win); the request goes to the least queued
//! prefill per capacity share, counted in quanta of its own prefill, then the emptiest cache
//! (an endpoint whose events are not heard counts as holding the heard ones' mean), then the
//! least load (`sel` = LoxiLB's miss `no_worker`/`excluded` and the rule's selector).
//! Counted in `loxilb_pd_kv_tier15_cold_placements_total`, reason `kv_cold_place`. With little
//! reuse (4 `vllm-sim` workers, 150 groups, 24 requests/s) the two together took the KV
//! policy's TTFT p99 from 1.2× round robin's to 0.89×.
//!
//! Fleet-load factor `f = clamp(ρ, 1/8, 8)` where `ρ = 1000·T / LOXILB_KV_CAP_SUM_MILLI` when that
//! is set, else `ρ = T / N` (mean load per endpoint): the busier the fleet, the more load an
//! overlap owner may carry (`adaptive`) and the more load costs (`adaptive-soft`).

use crate::routing::EpIdx;

/// `LOXILB_KV_LB_MODE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LbMode {
    /// Pure overlap argmax.
    Off,
    /// Capacity-weighted bounded load (the default).
    #[default]
    Hard,
    /// Overlap minus load cost.
    Soft,
    /// `hard` with ε scaled by fleet load.
    Adaptive,
    /// `soft` with λ scaled by fleet load.
    AdaptiveSoft,
    /// Least prefill work in tokens (loxi extension).
    Work,
}

impl LbMode {
    /// The spelling LoxiLB accepts (`off|hard|soft|adaptive|adaptive-soft`), and loxi's `work`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Hard => "hard",
            Self::Soft => "soft",
            Self::Adaptive => "adaptive",
            Self::AdaptiveSoft => "adaptive-soft",
            Self::Work => "work",
        }
    }

    /// Parses the env value; `None` for garbage (the caller warns and uses `Hard`).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" => Some(Self::Off),
            "hard" => Some(Self::Hard),
            "soft" => Some(Self::Soft),
            "adaptive" => Some(Self::Adaptive),
            "adaptive-soft" => Some(Self::AdaptiveSoft),
            "work" => Some(Self::Work),
            _ => None,
        }
    }
}

/// One eligible endpoint as a law sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cand {
    /// Endpoint index.
    pub ep: EpIdx,
    /// Overlap in blocks.
    pub overlap: usize,
    /// In-flight + queued requests.
    pub load: u64,
    /// Queued prefill work, tokens (`W_i`; only the `work` law reads it).
    pub work: u64,
    /// Rule weight (0 is taken as 1).
    pub weight: u32,
}

/// Law parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LawParams {
    /// Which law.
    pub mode: LbMode,
    /// `LOXILB_KV_MEAN_LOAD_FACTOR` (175 = ε 0.75).
    pub mean_load_factor: u32,
    /// `LOXILB_KV_LOAD_PENALTY` (λ).
    pub load_penalty: u32,
    /// Spill relief across the whole eligible fleet.
    pub spill_relief: bool,
    /// `LOXILB_KV_CAP_SUM_MILLI` (0 = off).
    pub cap_sum_milli: u64,
    /// Request blocks `n`.
    pub request_blocks: usize,
    /// Tokens per block `B` (`work`).
    pub block_size: usize,
    /// Overlap units per block: `request_blocks` and every [`Cand::overlap`] are in these
    /// units (1 = whole blocks; tier 1.5 passes 1000, milli-blocks, so that offload-tier
    /// blocks can earn a fraction). `work` converts them back to tokens with it.
    pub unit: usize,
    /// `LOXILB_KV_WORK_COPY_PERCENT` (ξ·100, `work`).
    pub copy_percent: u32,
    /// `LOXILB_KV_WORK_REQUEST_TOKENS` (κ, `work`).
    pub request_tokens: u32,
    /// `LOXILB_KV_BATCH_SLOTS` (S, `work`; 0 = unbounded).
    pub batch_slots: u64,
    /// `LOXI_KV_SPILL_FLOOR` (F, `hard` and `adaptive`; 0 = LoxiLB's laws), see [`spill_pays`].
    pub spill_floor: u64,
    /// `LOXI_KV_WORK_GUARD_PERCENT` (G, `hard` and `adaptive`; 0 = off), see [`work_guard`].
    pub work_guard_percent: u32,
}

/// A law's pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    /// The endpoint.
    pub ep: EpIdx,
    /// True when the pick is not the overlap owner.
    pub spilled: bool,
}

/// Applies the law. `cands` are the eligible endpoints in index order; `None` only when empty.
pub fn blend(cands: &[Cand], p: &LawParams) -> Option<Pick> {
    let owner = owner(cands)?;
    let f = fleet_factor(cands, p.cap_sum_milli);
    let eps = (f64::from(p.mean_load_factor) - 100.0).max(0.0) / 100.0;
    let lambda = f64::from(p.load_penalty);
    let ep = match p.mode {
        LbMode::Off => owner,
        LbMode::Hard => guarded(cands, hard(cands, eps, p).unwrap_or(owner), p),
        LbMode::Adaptive => guarded(cands, hard(cands, eps * f, p).unwrap_or(owner), p),
        LbMode::Soft => soft(cands, lambda, p.request_blocks),
        LbMode::AdaptiveSoft => soft(cands, lambda * f, p.request_blocks),
        LbMode::Work => least_work(cands, p),
    };
    Some(Pick {
        ep,
        spilled: ep != owner,
    })
}

/// `argmax o_i`, ties → lower load → lower index.
pub fn owner(cands: &[Cand]) -> Option<EpIdx> {
    cands.iter().min_by(|a, b| by_overlap(a, b)).map(|c| c.ep)
}

/// Descending overlap, then ascending load, then ascending index.
fn by_overlap(a: &Cand, b: &Cand) -> std::cmp::Ordering {
    b.overlap
        .cmp(&a.overlap)
        .then(a.load.cmp(&b.load))
        .then(a.ep.cmp(&b.ep))
}

fn weight_sum(cands: &[Cand]) -> f64 {
    cands.iter().map(|c| f64::from(c.weight.max(1))).sum()
}

/// `cap_i = ceil((1 + ε)·(T + 1)·c_i)`.
pub fn cap(c: &Cand, cands: &[Cand], eps: f64) -> u64 {
    let total: u64 = cands.iter().map(|c| c.load).sum();
    let share = f64::from(c.weight.max(1)) / weight_sum(cands);
    ((1.0 + eps) * (total as f64 + 1.0) * share).ceil() as u64
}

fn hard(cands: &[Cand], eps: f64, p: &LawParams) -> Option<EpIdx> {
    // Holders in overlap order, without collecting them (the request path allocates nothing).
    let holders = || cands.iter().filter(|c| c.overlap > 0);
    let owner = holders().min_by(|a, b| by_overlap(a, b))?;
    // A pick other than the owner recomputes what the owner holds beyond it: the floor.
    let keep = |c: &Cand| c.ep == owner.ep || spill_pays(owner, c, p);
    // L_i + 1 ≤ cap_i
    let under = |c: &Cand| c.load < cap(c, cands, eps);
    if let Some(c) = holders()
        .filter(|c| under(c))
        .min_by(|a, b| by_overlap(a, b))
    {
        return keep(c).then_some(c.ep);
    }
    // Relief recomputes the whole prefix elsewhere, so it waits for twice the slack.
    if !p.spill_relief || !relief_due(cands, owner, eps) {
        return None;
    }
    cands
        .iter()
        .filter(|c| under(c))
        .min_by(|a, b| a.load.cmp(&b.load).then(a.ep.cmp(&b.ep)))
        .filter(|c| keep(c))
        .map(|c| c.ep)
}

/// The spill floor of `hard` and `adaptive` (loxi extension, issue 13): whether moving a
/// request from `owner` to `to` (less overlap) may happen at all. With `F = p.spill_floor`,
/// `B` tokens per overlap unit, `n` request blocks, `W` queued prefill work in tokens:
///
/// `F = 0`  or  `L_owner ≥ F`  or  `W_owner + (n − o_owner)·B ≥ W_to + (n − o_to)·B`
///
/// i.e. the owner already carries `F` requests, or the request would wait on the owner at
/// least as long (in prefill tokens) as it takes on `to`, recomputation included. Below
/// that, a request over the cap on its owner waits for a batch slot and decodes beside the
/// others, which costs less than a cold prefill and the eviction its copy causes elsewhere.
pub fn spill_pays(owner: &Cand, to: &Cand, p: &LawParams) -> bool {
    if p.spill_floor == 0 || owner.load >= p.spill_floor {
        return true;
    }
    prefill_wait(owner, p) >= prefill_wait(to, p)
}

/// `hard`'s pick `pick`, or the endpoint [`work_guard`] moves it to.
fn guarded(cands: &[Cand], pick: EpIdx, p: &LawParams) -> EpIdx {
    cands
        .iter()
        .find(|c| c.ep == pick)
        .and_then(|c| work_guard(cands, c, p))
        .unwrap_or(pick)
}

/// The work guard of `hard` and `adaptive` (loxi extension, issue 13 goal 4): where a pick
/// whose prefill queue costs more than its cached prefix saves goes instead, if anywhere.
/// With `G = p.work_guard_percent / 100`, `B` tokens per overlap unit, and
/// `wait_i = W_i + (n − o_i)·B` ([`prefill_wait`]), the request moves from `pick` to the
/// eligible `j` with the least `wait_j + G·(o_pick − o_j)·B` (ties → higher `o_j` → lower
/// `L_j` → index) when
///
/// `wait_pick > wait_j + G·(o_pick − o_j)·B`  and  `L_j + 1 ≤ ceil((T + 1)·c_j)`
///
/// i.e. the pick's queued prefill outweighs what its cached prefix saves by more than `G`
/// times (`G = 2`, the default: the saving itself, and as much again for the copy the move
/// makes, which evicts something elsewhere; the `work` law's `1 + ξ`), and `j` is within
/// its request share (round robin's: the cap with `ε = 0`). `None` when the guard is off
/// (`G = 0`), when no such `j` exists, or when it would be `pick` itself.
///
/// Why the share and not `cap_j`: a queue is transient (a prefill takes tens of ms) but a
/// placement is not (a conversation's later turns follow their history). Within `cap_j` the
/// guard moved new conversations that shared a system prompt off endpoints busy with a
/// fresh copy of it onto the one that already carried the most (3 real vLLM engines, 6
/// users × 4 rounds: [15, 5, 4] requests and 80 % of the oracle hit rate, against
/// [8, 8, 8] without the guard).
///
/// Why: the request-count cap lets an owner carry up to `(1 + ε)` times its share of requests
/// whatever they cost. With little reuse (4 `vllm-sim` workers, 150 groups of 3,200-token
/// prompts, 24 requests/s) an owner's requests are mostly cold prefills: the 9 % of requests
/// that hit waited behind them, and `hard`'s TTFT p99 was 1.2–1.35× round robin's.
pub fn work_guard(cands: &[Cand], pick: &Cand, p: &LawParams) -> Option<EpIdx> {
    if p.work_guard_percent == 0 {
        return None;
    }
    let g = f64::from(p.work_guard_percent) / 100.0;
    let b = tokens_per_unit(p);
    let price = |c: &Cand| {
        let saved = pick.overlap.saturating_sub(c.overlap) as f64 * b;
        prefill_wait(c, p) + g * saved
    };
    let best = cands
        .iter()
        .filter(|c| c.ep != pick.ep && c.load < cap(c, cands, 0.0))
        .map(|c| (price(c), c))
        .min_by(|(pa, a), (pb, b)| {
            pa.total_cmp(pb)
                .then(b.overlap.cmp(&a.overlap))
                .then(a.load.cmp(&b.load))
                .then(a.ep.cmp(&b.ep))
        })?;
    (prefill_wait(pick, p) > best.0).then_some(best.1.ep)
}

/// Tokens per overlap unit (`B` of the module doc, in the units of [`Cand::overlap`]).
fn tokens_per_unit(p: &LawParams) -> f64 {
    p.block_size.max(1) as f64 / p.unit.max(1) as f64
}

/// The request's prefill wait on `c` in tokens: its queued work `W_c` plus this request's
/// uncached part `(n − o_c)·B`.
fn prefill_wait(c: &Cand, p: &LawParams) -> f64 {
    let n = p.request_blocks.max(c.overlap) as f64;
    c.work as f64 + (n - c.overlap as f64) * tokens_per_unit(p)
}

/// `hard` relief (loxi deviation, see the module doc), when every holder is over `cap_i`: the
/// holders of the prefix (`o_j > 0`) together carry at least the owner's relief cap,
/// `Σ_{o_j > 0} L_j ≥ ceil((1 + 2ε)·(T + 1)·c_owner)`, i.e. one more request would put more
/// than one endpoint's `2ε` allowance on the prefix's copies.
pub fn relief_due(cands: &[Cand], owner: &Cand, eps: f64) -> bool {
    let held: u64 = cands.iter().filter(|c| c.overlap > 0).map(|c| c.load).sum();
    held >= cap(owner, cands, 2.0 * eps)
}

fn soft(cands: &[Cand], lambda: f64, n: usize) -> EpIdx {
    let n = n.max(1) as f64;
    let count = cands.len() as f64;
    let wsum = weight_sum(cands);
    let utility = |c: &Cand| {
        let share = f64::from(c.weight.max(1)) / wsum;
        1000.0 * c.overlap as f64 / n - lambda * c.load as f64 / (count * share)
    };
    let mut best = cands[0];
    for c in &cands[1..] {
        if utility(c) > utility(&best) {
            best = *c;
        }
    }
    best.ep
}

/// `cost_i` of the `work` law, in tokens per capacity share (see the module doc).
pub fn work_cost(c: &Cand, cands: &[Cand], p: &LawParams) -> f64 {
    let b = tokens_per_unit(p);
    let n = p.request_blocks.max(c.overlap) as f64;
    let o = c.overlap as f64;
    let o_max = cands.iter().map(|c| c.overlap).max().unwrap_or(0) as f64;
    let xi = f64::from(p.copy_percent) / 100.0;
    let queued = if p.batch_slots > 0 {
        (c.load + 1).saturating_sub(p.batch_slots)
    } else {
        0
    };
    let tokens = prefill_wait(c, p)
        + xi * (o_max - o) * b
        + f64::from(p.request_tokens) * c.load as f64
        + queued as f64 * n * b;
    let share = f64::from(c.weight.max(1)) / weight_sum(cands);
    tokens / (cands.len() as f64 * share)
}

fn least_work(cands: &[Cand], p: &LawParams) -> EpIdx {
    let mut best = cands[0];
    let mut best_cost = work_cost(&best, cands, p);
    for c in &cands[1..] {
        let cost = work_cost(c, cands, p);
        if cost < best_cost || (cost == best_cost && by_overlap(c, &best).is_lt()) {
            best = *c;
            best_cost = cost;
        }
    }
    best.ep
}

/// Replica seeding (see the module doc): the endpoint that takes a copy of the pick's prefix,
/// if any. `pick` is the law's pick, `min_load` is `R` (0 = off), and `has_room(j)` tells
/// whether `j`'s cache has room for the copy (`b_j = 0`; the caller knows the index).
pub fn replica(
    cands: &[Cand],
    pick: EpIdx,
    min_load: u64,
    has_room: impl Fn(&Cand) -> bool,
) -> Option<EpIdx> {
    if min_load == 0 {
        return None;
    }
    let p = cands.iter().find(|c| c.ep == pick)?;
    // L_p + 1 > ceil((T + 1)·c_p): over its request share.
    let over_share = p.load + 1 > cap(p, cands, 0.0);
    if p.overlap == 0 || p.load < min_load || !over_share {
        return None;
    }
    cands
        .iter()
        .find(|c| c.overlap < p.overlap && c.load == 0 && c.work == 0 && has_room(c))
        .map(|c| c.ep)
}

/// `f = clamp(ρ, 1/8, 8)`.
pub fn fleet_factor(cands: &[Cand], cap_sum_milli: u64) -> f64 {
    let total: u64 = cands.iter().map(|c| c.load).sum();
    let rho = if cap_sum_milli > 0 {
        1000.0 * total as f64 / cap_sum_milli as f64
    } else {
        total as f64 / cands.len().max(1) as f64
    };
    rho.clamp(0.125, 8.0)
}

#[cfg(test)]
#[path = "blend_tests.rs"]
mod tests;
