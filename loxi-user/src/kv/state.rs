//! Shared KV state: one [`ServiceKv`] per rule with kvExactMode ≠ 0 (its index, hash contract,
//! stream status and parity book), held in [`KvState`] which the router, the subscriber manager
//! and the REST API share.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tokio::time::Instant;

use super::block_hash::{BlockHasher, HashAlgo};
use super::index::KvIndex;
use super::metrics::KvMetrics;
use super::parity::ParityBook;
use super::settings::KvSettings;
use crate::routing::EpIdx;
use crate::rules::model::LbRule;
use crate::rules::store::StoredRule;

/// The KV contract of one rule, derived from its fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceKvConfig {
    /// `kvExactMode` (0 off, 1 P/D prefill, 3 single pool).
    pub mode: u8,
    /// `kvHashAlgo`, or derived from `kvEngineType`; `Err(name)` when unknown.
    pub algo: Result<HashAlgo, String>,
    /// `kvBlockSize`.
    pub block_size: u32,
    /// `kvWarmupSec`.
    pub warmup: Duration,
    /// `kvZmqPort`.
    pub zmq_port: u16,
    /// `kvReplayPort` (0 = none).
    pub replay_port: u16,
    /// `kvDpRankCount`.
    pub dp_ranks: u32,
    /// `(endpointIP, subscribed?)` per endpoint, in rule order.
    pub endpoints: Vec<(String, bool)>,
}

impl ServiceKvConfig {
    /// Reads the KV fields of `rule`. Mode 3 subscribes every endpoint, mode 1 the prefill ones
    /// (`ep_role: 1`).
    pub fn of(rule: &LbRule) -> Self {
        let s = &rule.service;
        let algo_name = if s.kv_hash_algo.is_empty() {
            match s.kv_engine_type.as_str() {
                "sglang" => "sha256_sglang",
                _ => "sha256_cbor",
            }
        } else {
            s.kv_hash_algo.as_str()
        };
        let endpoints = rule
            .endpoints
            .iter()
            .map(|e| {
                (
                    e.endpoint_ip.clone(),
                    s.kv_exact_mode == 3 || (s.kv_exact_mode == 1 && e.ep_role == 1),
                )
            })
            .collect();
        Self {
            mode: s.kv_exact_mode,
            algo: algo_name
                .parse::<HashAlgo>()
                .map_err(|_| algo_name.to_owned()),
            block_size: s.kv_block_size,
            warmup: Duration::from_secs(u64::from(s.kv_warmup_sec)),
            zmq_port: s.kv_zmq_port,
            replay_port: s.kv_replay_port,
            dp_ranks: u32::from(s.kv_dp_rank_count.max(1)),
            endpoints,
        }
    }
}

/// Live status of one (endpoint, rank) event stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamStatus {
    /// Socket connected now.
    pub connected: bool,
    /// Last sequence number applied.
    pub last_seq: Option<u64>,
}

/// KV state of one service.
pub struct ServiceKv {
    /// Rule id (`service` label, `service_id` in the API).
    pub id: u32,
    /// Contract derived from the rule.
    pub config: ServiceKvConfig,
    /// The block index.
    pub index: KvIndex,
    /// Hasher for the rule's contract (`None` when the algorithm is unknown).
    pub hasher: Option<BlockHasher>,
    /// When the first subscriber of this service connected (warmup start).
    pub warm_start: Mutex<Option<Instant>>,
    /// Tier 1.5 hits so far (drives cold-start seeding).
    pub hits: AtomicU64,
    /// Status per (endpoint, rank).
    pub streams: Mutex<HashMap<(EpIdx, u32), StreamStatus>>,
    /// Parity verdicts and token re-hash state per endpoint.
    pub parity: Mutex<ParityBook>,
}

impl ServiceKv {
    /// Fresh state for `rule`.
    pub fn new(rule: &StoredRule, settings: &KvSettings) -> Self {
        let config = ServiceKvConfig::of(&rule.rule);
        let hasher = config
            .algo
            .as_ref()
            .ok()
            .map(|a| BlockHasher::new(*a, settings.none_hash_seed.as_deref()));
        Self {
            id: rule.id,
            index: KvIndex::new(settings.max_blocks),
            hasher,
            warm_start: Mutex::new(None),
            hits: AtomicU64::new(0),
            streams: Mutex::new(HashMap::new()),
            parity: Mutex::new(ParityBook::default()),
            config,
        }
    }

    /// The `service` label.
    pub fn label(&self) -> String {
        self.id.to_string()
    }

    /// Records a subscriber connect/disconnect; the first connect starts the warmup window.
    pub fn set_connected(&self, ep: EpIdx, rank: u32, up: bool) {
        self.streams.lock().entry((ep, rank)).or_default().connected = up;
        if up {
            self.warm_start.lock().get_or_insert_with(Instant::now);
        }
    }

    /// True while `kvWarmupSec` has not elapsed since the first subscriber connected (or none
    /// has connected yet). Always false when `kvWarmupSec` is 0.
    pub fn warming(&self, now: Instant) -> bool {
        if self.config.warmup.is_zero() {
            return false;
        }
        match *self.warm_start.lock() {
            None => true,
            Some(start) => now < start + self.config.warmup,
        }
    }
}

/// Everything the KV tier shares across tasks.
pub struct KvState {
    /// Process settings.
    pub settings: KvSettings,
    /// Metric handles.
    pub metrics: KvMetrics,
    services: RwLock<HashMap<u32, Arc<ServiceKv>>>,
}

impl KvState {
    /// Empty state.
    pub fn new(settings: KvSettings, metrics: KvMetrics) -> Arc<Self> {
        Arc::new(Self {
            settings,
            metrics,
            services: RwLock::new(HashMap::new()),
        })
    }

    /// The service's state, created when missing or when the rule's KV contract changed.
    pub fn service(&self, rule: &StoredRule) -> Arc<ServiceKv> {
        let cfg = ServiceKvConfig::of(&rule.rule);
        if let Some(s) = self.services.read().get(&rule.id)
            && s.config == cfg
        {
            return s.clone();
        }
        let mut map = self.services.write();
        match map.get(&rule.id) {
            Some(s) if s.config == cfg => s.clone(),
            _ => {
                let s = Arc::new(ServiceKv::new(rule, &self.settings));
                self.metrics.init_service(&s.label());
                map.insert(rule.id, s.clone());
                s
            }
        }
    }

    /// The service's state if it exists.
    pub fn get(&self, id: u32) -> Option<Arc<ServiceKv>> {
        self.services.read().get(&id).cloned()
    }

    /// Drops a service's state (rule deleted or KV turned off).
    pub fn drop_service(&self, id: u32) {
        if let Some(s) = self.services.write().remove(&id) {
            self.metrics
                .forget_service(&s.label(), s.config.endpoints.len(), s.config.dp_ranks);
        }
    }

    /// Ids of services with state.
    pub fn ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.services.read().keys().copied().collect();
        v.sort_unstable();
        v
    }
}
