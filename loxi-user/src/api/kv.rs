//! REST views of the KV tier, mounted by the daemon under `/netlox/v1`:
//!
//! - `GET /netlox/v1/config/ai/kv/inventory?service_id=N&ep_idx=M` — LoxiLB's shape,
//!   `{service_id, ep_idx, hash_algo, blocks:[{block_idx, hash_uint64}], total}` (what its
//!   `loxicmd get kvinventory` renders), plus loxi's per-endpoint view of that endpoint as the
//!   extra keys `serviceId` and `endpoints` (LoxiLB's clients ignore them). Without `ep_idx`
//!   (LoxiLB requires it) loxi answers its per-endpoint view of every subscribed endpoint:
//!   index, IP, block count, connected flag, per-rank stream status (connected, last seq) and
//!   the held block hashes (u64, oldest first per rank).
//! - `GET /netlox/v1/config/ai/kv/parity?service_id=N` — the rule's hash contract and, for
//!   EVERY endpoint of the rule (rule order): its readiness `state` (`syncing`, `no_events`,
//!   `no_blocks`, `events_no_tokens`, `ok`, `mismatch` with its `leg`, `disconnected`,
//!   `crossed`, `unseen`, `never_matched`, `not_subscribed`; `kv::readiness`) and `remedy`, the parity
//!   verdict (`unknown`/`ok`/`mismatch`), blocks checked, mismatched and unverified, the
//!   diagnosis, block-size rejections and whether token re-hash is active; and a `tokenizer`
//!   section: `ok`, or `failing` with each model and prompt kind (chat or text) whose prompts
//!   got no token ids since its last success (`kv::state::TokenizeWatch`), its failures and a
//!   remedy naming its tokenizer's directory; and a `warmup` section: `kvWarmupSec`, the
//!   window's `state` (`off`, `waiting`, `running`, `over`) and `leftSec` while it runs.
//!
//! Errors are the API's own ([`super::error`]: `{"code","fields","message","result","field"}`):
//! 400 naming the bad query field, 404 for an unknown service (no KV state: unknown id or
//! kvExactMode 0) or endpoint.
//!
//! Read-your-writes: a rule acknowledged by `POST /config/loadbalancer` is in the rule store's
//! snapshot at once, but the subscriber manager applies snapshots asynchronously. Both views
//! apply the current snapshot's rule to the KV state themselves ([`KvState::sync`], idempotent,
//! the manager reconciles the same snapshot), so a `loxicmd get kvinventory` right after the
//! create sees the rule and its endpoints instead of a 404.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use tokio::sync::watch;

use super::error::{ApiError, json_response};
use crate::kv::ingest::parity::EpParity;
use crate::kv::readiness::{Readiness, readiness};
use crate::kv::state::{KvState, ServiceKv};
use crate::rules::store::RuleSnapshot;

/// Inventory path.
pub const INVENTORY_PATH: &str = "/netlox/v1/config/ai/kv/inventory";
/// Parity path.
pub const PARITY_PATH: &str = "/netlox/v1/config/ai/kv/parity";

/// The router with both views; state = the shared KV state.
pub fn router(state: Arc<KvState>, rules: watch::Receiver<Arc<RuleSnapshot>>) -> axum::Router {
    axum::Router::new()
        .route(INVENTORY_PATH, get(inventory))
        .route(PARITY_PATH, get(parity))
        .with_state(KvApi { state, rules })
}

/// The views' state: the KV tier and the rule store's current snapshot.
#[derive(Clone)]
struct KvApi {
    state: Arc<KvState>,
    rules: watch::Receiver<Arc<RuleSnapshot>>,
}

/// One rank stream's status.
#[derive(Debug, Serialize)]
pub struct RankView {
    /// DP rank.
    pub rank: u32,
    /// Socket up.
    pub connected: bool,
    /// Last applied sequence number.
    #[serde(rename = "lastSeq")]
    pub last_seq: Option<u64>,
}

/// One endpoint's inventory.
#[derive(Debug, Serialize)]
pub struct EndpointInventory {
    /// Endpoint index in the rule.
    #[serde(rename = "epIdx")]
    pub ep_idx: usize,
    /// Endpoint IP.
    #[serde(rename = "endpointIP")]
    pub endpoint_ip: String,
    /// Endpoint port (engines sharing an IP are told apart by it).
    #[serde(rename = "targetPort")]
    pub target_port: u16,
    /// The KV-event publisher port its stream reads (DP rank r on this + r).
    #[serde(rename = "kvZmqPort")]
    pub kv_zmq_port: u16,
    /// Distinct blocks held (all ranks and tiers; a block on the GPU and in the offload tier
    /// counts once, as it is listed once). `loxilb_pd_kv_blocks` counts each tier's copy.
    #[serde(rename = "blockCount")]
    pub block_count: u64,
    /// Any rank connected.
    pub connected: bool,
    /// Per-rank status.
    pub ranks: Vec<RankView>,
    /// Held block hashes.
    pub hashes: Vec<u64>,
}

/// One held block in LoxiLB's inventory shape.
#[derive(Debug, Serialize)]
pub struct BlockView {
    /// Position in the endpoint's list (oldest first per rank).
    pub block_idx: usize,
    /// The block hash as an unsigned 64-bit integer.
    pub hash_uint64: u64,
}

/// LoxiLB's inventory keys (answered when the query names `ep_idx`).
#[derive(Debug, Serialize)]
pub struct LoxilbInventory {
    /// Rule id.
    pub service_id: u32,
    /// The endpoint asked for.
    pub ep_idx: usize,
    /// `kvHashAlgo` in effect.
    pub hash_algo: String,
    /// The endpoint's held blocks, the page `[offset, offset + limit)` of them.
    pub blocks: Vec<BlockView>,
    /// Every block the endpoint holds (LoxiLB's `total`; more than `blocks.len()` when the
    /// list was paged).
    pub total: usize,
}

/// `GET …/kv/inventory` body.
#[derive(Debug, Serialize)]
pub struct InventoryView {
    /// LoxiLB's keys, when the query names `ep_idx`.
    #[serde(flatten)]
    pub loxilb: Option<LoxilbInventory>,
    /// Rule id.
    #[serde(rename = "serviceId")]
    pub service_id: u32,
    /// Subscribed endpoints.
    pub endpoints: Vec<EndpointInventory>,
    /// The page of each endpoint's block list: first index listed (query `offset`, 0)...
    pub offset: usize,
    /// ...and most listed (query `limit`, [`INVENTORY_LIMIT`] at most): an endpoint's
    /// `blockCount` beyond `offset + limit` is counted, not listed.
    pub limit: usize,
}

/// Most block hashes one inventory answer lists per endpoint (and the default `limit`): an
/// engine's cache can hold millions of blocks, and a listing of all of them was hundreds of
/// megabytes of JSON built in memory for any reader; page with `offset`.
pub const INVENTORY_LIMIT: usize = 65_536;

/// One endpoint's parity and readiness.
#[derive(Debug, Serialize)]
pub struct EndpointParity {
    /// Endpoint index.
    #[serde(rename = "epIdx")]
    pub ep_idx: usize,
    /// Endpoint IP.
    #[serde(rename = "endpointIP")]
    pub endpoint_ip: String,
    /// Endpoint port (engines sharing an IP are told apart by it).
    #[serde(rename = "targetPort")]
    pub target_port: u16,
    /// The KV-event publisher port its stream reads (DP rank r on this + r).
    #[serde(rename = "kvZmqPort")]
    pub kv_zmq_port: u16,
    /// Readiness state, leg and remedy (`kv::readiness`).
    #[serde(flatten)]
    pub readiness: Readiness,
    /// Parity report (all zero / `unknown` before any event with token ids).
    #[serde(flatten)]
    pub parity: EpParity,
}

/// `GET …/kv/parity` body.
#[derive(Debug, Serialize)]
pub struct ParityView {
    /// Rule id.
    #[serde(rename = "serviceId")]
    pub service_id: u32,
    /// `kvHashAlgo` in effect.
    #[serde(rename = "kvHashAlgo")]
    pub hash_algo: String,
    /// `kvBlockSize`.
    #[serde(rename = "kvBlockSize")]
    pub block_size: u32,
    /// Whether `LLB_KV_NONE_HASH_SEED` is set.
    #[serde(rename = "seedSet")]
    pub seed_set: bool,
    /// Whether the rule's prompts tokenize (`kv::state::TokenizeWatch`): without token ids
    /// nothing is scored, whatever the endpoints' readiness says.
    pub tokenizer: TokenizerView,
    /// The `kvWarmupSec` window: while it runs tier 1.5 is off for the whole rule (misses
    /// `warmup`), whatever the endpoints' readiness says.
    pub warmup: WarmupView,
    /// Every endpoint of the rule, in rule order.
    pub endpoints: Vec<EndpointParity>,
}

/// The `tokenizer` section of the parity report.
#[derive(Debug, Serialize)]
pub struct TokenizerView {
    /// `ok` (no model's prompts are failing), or `failing`.
    pub state: &'static str,
    /// The failing models and prompt kinds, the most recent failure first (at most
    /// [`LISTED_MODELS`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failing: Vec<FailingModel>,
    /// Further failing models and kinds, not listed.
    #[serde(rename = "moreFailing", skip_serializing_if = "is_zero")]
    pub more_failing: usize,
}

/// The `warmup` section of the parity report (`kv::state::ServiceKv::warmup_left`).
#[derive(Debug, Serialize)]
pub struct WarmupView {
    /// `kvWarmupSec` in seconds.
    pub sec: f64,
    /// `off` (`kvWarmupSec` 0), `waiting` (no KV subscriber of the rule has connected yet:
    /// the window starts at the first connect), `running` (tier 1.5 off until it ends) or
    /// `over`. The window starts once per rule's KV state: at loxilb's start and when the
    /// rule's hash contract changes, not when an engine reconnects.
    pub state: &'static str,
    /// Seconds left of a `running` window.
    #[serde(rename = "leftSec", skip_serializing_if = "Option::is_none")]
    pub left_sec: Option<f64>,
}

/// The warmup section of `svc` now.
fn warmup_view(svc: &ServiceKv) -> WarmupView {
    let sec = svc.warmup().as_secs_f64();
    let (state, left_sec) = if sec == 0.0 {
        ("off", None)
    } else {
        match svc.warmup_left(tokio::time::Instant::now()) {
            None => ("over", None),
            Some(None) => ("waiting", None),
            Some(Some(left)) => ("running", Some((left.as_secs_f64() * 10.0).ceil() / 10.0)),
        }
    };
    WarmupView {
        sec,
        state,
        left_sec,
    }
}

/// Failing models listed in the parity report at most.
pub const LISTED_MODELS: usize = 8;

/// One model whose prompts of one kind do not tokenize.
#[derive(Debug, Serialize)]
pub struct FailingModel {
    /// The model the tokenizer is looked up by (a LoRA adapter's base model).
    pub model: String,
    /// `chat` (chat messages: the chat template is rendered first) or `text`.
    pub prompts: &'static str,
    /// Requests that failed since the last success of this model and kind.
    pub failures: u64,
    /// What to do about it.
    pub remedy: String,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The `tokenizer` section of `svc`'s parity report; remedies name `dir` (`--tokenizer-dir`).
fn tokenizer_view(svc: &ServiceKv, dir: &std::path::Path) -> TokenizerView {
    let all = svc.tokenize.failures();
    let more_failing = all.len().saturating_sub(LISTED_MODELS);
    let failing: Vec<FailingModel> = all
        .into_iter()
        .take(LISTED_MODELS)
        .map(|f| {
            let slug = crate::kv::tokenizer::model_slug(&f.model);
            // A name kept shortened (`… (N bytes)`) was too long for a directory.
            let named = crate::kv::tokenizer::pool::valid_model_name(&f.model).is_ok()
                && !crate::kv::tokenizer::pool::is_shortened(&f.model);
            let what = if f.chat {
                "stage its tokenizer.json and a tokenizer_config.json whose chat_template renders \
                 these messages"
            } else {
                "stage its tokenizer.json"
            };
            let remedy = if named {
                format!(
                    "its {} prompts get no token ids, so they are routed by the rule's selector \
                     (miss reason tokenize): {what} in the directory {:?} (--tokenizer-dir), or \
                     fix what the daemon's log names for it; a staged tokenizer is picked up \
                     within 30 s",
                    if f.chat { "chat" } else { "text" },
                    dir.join(&slug).display().to_string()
                )
            } else {
                "its prompts get no token ids, so they are routed by the rule's selector (miss \
                 reason tokenize): this model name cannot name a tokenizer directory under \
                 --tokenizer-dir; serve the model under another name"
                    .to_owned()
            };
            FailingModel {
                model: f.model,
                prompts: if f.chat { "chat" } else { "text" },
                failures: f.failures,
                remedy,
            }
        })
        .collect();
    TokenizerView {
        state: if failing.is_empty() { "ok" } else { "failing" },
        failing,
        more_failing,
    }
}

fn parse_field<T: std::str::FromStr>(
    q: &HashMap<String, String>,
    field: &str,
) -> Result<Option<T>, ApiError> {
    match q.get(field) {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| {
            ApiError::bad_field(
                field,
                format!("query field `{field}`: {v:?} is not a non-negative integer"),
            )
        }),
    }
}

fn service(api: &KvApi, q: &HashMap<String, String>) -> Result<Arc<ServiceKv>, ApiError> {
    let id: u32 = parse_field(q, "service_id")?
        .ok_or_else(|| ApiError::bad_field("service_id", "query field `service_id` is required"))?;
    // The store's current rule first (read-your-writes, see the module doc); a rule no longer
    // in the snapshot keeps whatever state the manager has not dropped yet.
    let current = api
        .rules
        .borrow()
        .rules
        .values()
        .find(|r| r.id == id)
        .cloned();
    let svc = match current {
        Some(rule) => api.state.sync(&rule),
        None => api.state.get(id),
    };
    svc.ok_or_else(|| {
        ApiError::not_found(format!(
                "service_id {id}: no KV state (unknown rule or kvExactMode 0); a rule's id is \
                 its `serviceId` in `loxicmd get lb -o json` (GET /netlox/v1/config/loadbalancer/all)"
        ))
    })
}

/// The query as a map, refusing (400 naming it) a key this route does not read or one given
/// twice: a typo (`ep_id` for `ep_idx`) or a repeated `service_id` would otherwise answer
/// another view than the one asked for.
fn known_query(
    pairs: Vec<(String, String)>,
    known: &[&str],
) -> Result<HashMap<String, String>, ApiError> {
    if let Some((k, _)) = pairs.iter().find(|(k, _)| !known.contains(&k.as_str())) {
        return Err(ApiError::unknown_query_param(k, known));
    }
    super::query::once(pairs)
}

async fn inventory(
    State(api): State<KvApi>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Response {
    let q = match known_query(pairs, &["service_id", "ep_idx", "offset", "limit"]) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    match inventory_view(&api, &q) {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}

fn inventory_view(api: &KvApi, q: &HashMap<String, String>) -> Result<InventoryView, ApiError> {
    let svc = service(api, q)?;
    let only: Option<usize> = parse_field(q, "ep_idx")?;
    let offset: usize = parse_field(q, "offset")?.unwrap_or(0);
    let limit: usize = parse_field(q, "limit")?.unwrap_or(INVENTORY_LIMIT);
    if limit > INVENTORY_LIMIT {
        return Err(ApiError::bad_field(
            "limit",
            format!("query field `limit`: {limit} is over {INVENTORY_LIMIT}; page with `offset`"),
        ));
    }
    let members = svc.members.read();
    if let Some(ep) = only.filter(|&e| e >= members.len()) {
        return Err(ApiError::not_found(format!(
            "ep_idx {ep}: the rule has {} endpoints",
            members.len()
        )));
    }
    let streams = svc.streams.lock().clone();
    let endpoints = members
        .iter()
        .filter(|(ep, e, _)| e.subscribed && only.is_none_or(|o| o == *ep))
        .map(|(ep, e, member)| {
            let ranks: Vec<RankView> = (0..svc.config.dp_ranks)
                .map(|rank| {
                    let s = streams.get(&(member, rank)).copied().unwrap_or_default();
                    RankView {
                        rank,
                        connected: s.connected,
                        last_seq: s.last_seq,
                    }
                })
                .collect();
            let held = svc.index.keys_of(member);
            EndpointInventory {
                ep_idx: ep,
                endpoint_ip: e.ip.clone(),
                target_port: e.port,
                kv_zmq_port: e.zmq_port,
                block_count: held.len() as u64,
                connected: ranks.iter().any(|r| r.connected),
                ranks,
                hashes: held
                    .into_iter()
                    .skip(offset)
                    .take(limit)
                    .map(|k| k.0)
                    .collect(),
            }
        })
        .collect::<Vec<EndpointInventory>>();
    let loxilb = only.map(|ep_idx| {
        let blocks: Vec<BlockView> = endpoints
            .iter()
            .flat_map(|e| e.hashes.iter())
            .enumerate()
            .map(|(i, &hash_uint64)| BlockView {
                block_idx: offset + i,
                hash_uint64,
            })
            .collect();
        let total = endpoints.iter().map(|e| e.block_count as usize).sum();
        LoxilbInventory {
            service_id: svc.id,
            ep_idx,
            hash_algo: svc.config.algo.to_string(),
            total,
            blocks,
        }
    });
    Ok(InventoryView {
        loxilb,
        service_id: svc.id,
        endpoints,
        offset,
        limit,
    })
}

async fn parity(State(api): State<KvApi>, Query(pairs): Query<Vec<(String, String)>>) -> Response {
    let q = match known_query(pairs, &["service_id"]) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    let state = &api.state;
    let svc = match service(&api, &q) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let endpoints = {
        let members = svc.members.read();
        members
            .iter()
            .map(|(ep_idx, ep, member)| {
                // `None` (no report yet) is what lets `readiness` say `no_events`.
                let report = svc.parity.lock().get(member).cloned();
                let readiness = readiness(
                    &svc,
                    &members,
                    member,
                    ep,
                    report.as_ref(),
                    state.settings.never_matched_after,
                );
                let parity = report.unwrap_or_default();
                EndpointParity {
                    ep_idx,
                    endpoint_ip: ep.ip.clone(),
                    target_port: ep.port,
                    kv_zmq_port: ep.zmq_port,
                    readiness,
                    parity,
                }
            })
            .collect::<Vec<_>>()
    };
    let hash_algo = svc.config.algo.to_string();
    let view = ParityView {
        service_id: svc.id,
        hash_algo,
        block_size: svc.config.block_size,
        seed_set: state.settings.none_hash_seed.is_some(),
        tokenizer: tokenizer_view(&svc, &state.settings.tokenizer_dir),
        warmup: warmup_view(&svc),
        endpoints,
    };
    json_response(StatusCode::OK, &view)
}

#[cfg(test)]
#[path = "kv_tests.rs"]
mod tests;
