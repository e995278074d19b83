//! Shared KV state: one [`ServiceKv`] per rule with kvExactMode ≠ 0 (its index, hash contract,
//! stream status and parity book), held in [`KvState`] which the router, the subscriber manager
//! and the REST API share.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use tokio::time::Instant;

use super::block_hash::BlockHasher;
use super::index::KvIndex;
use super::ingest::parity::ParityBook;
use super::metrics::{KvMetrics, RouteMetrics};
use super::settings::KvSettings;
use crate::routing::EpIdx;
use crate::rules::KvSpec;
use crate::rules::store::StoredRule;

/// The KV contract of one rule: its compiled [`KvSpec`] (validation decided every default).
pub type ServiceKvConfig = KvSpec;

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
    /// The rule's compiled KV contract.
    pub config: ServiceKvConfig,
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
    /// Tier 1.5 hits so far (drives cold-start seeding).
    pub hits: AtomicU64,
    /// Status per (endpoint, rank).
    pub streams: Mutex<HashMap<(EpIdx, u32), StreamStatus>>,
    /// Parity verdicts and token re-hash state per endpoint.
    pub parity: Mutex<ParityBook>,
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
            hits: AtomicU64::new(0),
            streams: Mutex::new(HashMap::new()),
            parity: Mutex::new(ParityBook::default()),
            config: config.clone(),
        }
    }

    /// The `service` label.
    pub fn label(&self) -> String {
        self.label.clone()
    }

    /// Records a subscriber connect/disconnect; the first connect starts the warmup window.
    pub fn set_connected(&self, ep: EpIdx, rank: u32, up: bool) {
        self.streams.lock().entry((ep, rank)).or_default().connected = up;
        if up {
            self.warm_start.get_or_init(Instant::now);
        }
    }

    /// True while `kvWarmupSec` has not elapsed since the first subscriber connected (or none
    /// has connected yet). Always false when `kvWarmupSec` is 0.
    pub fn warming(&self, now: Instant) -> bool {
        if self.config.warmup.is_zero() {
            return false;
        }
        match self.warm_start.get() {
            None => true,
            Some(start) => now < *start + self.config.warmup,
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

    /// The state of `rule`'s service, created when missing or when its KV contract changed;
    /// `None` when the rule has tier 1.5 off.
    pub fn service(&self, rule: &StoredRule) -> Option<Arc<ServiceKv>> {
        let cfg = rule.spec.kv.as_ref()?;
        if let Some(s) = self.services.read().get(&rule.id)
            && s.config == *cfg
        {
            return Some(s.clone());
        }
        let mut map = self.services.write();
        Some(match map.get(&rule.id) {
            Some(s) if s.config == *cfg => s.clone(),
            _ => {
                let s = Arc::new(ServiceKv::new(rule.id, cfg, &self.settings, &self.metrics));
                map.insert(rule.id, s.clone());
                s
            }
        })
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
