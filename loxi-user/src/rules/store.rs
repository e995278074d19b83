//! The rule store: validated rules, an immutable snapshot per change, and the state file.
//!
//! Readers take [`RuleStore::snapshot`] (an `ArcSwap` load, wait-free) or follow
//! [`RuleStore::subscribe`] (a `watch` channel that always holds the newest snapshot). Writers
//! (the REST API) call [`RuleStore::upsert`] / [`RuleStore::delete`], which validate, persist
//! atomically, then publish. A write is acknowledged only after the state file is on disk, so
//! an accepted rule survives a restart (LoxiLB loses runtime rules on restart).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::sync::watch;

use super::model::{LbRule, RuleKey};
use super::persist::{self, PersistError};
use super::validate::{self, RuleError};

/// A stored rule with its stable service id (the `service` metric label and the `service_id`
/// of the KV inventory API). Ids are assigned on creation, never reused while the daemon runs,
/// and persisted with the rule.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoredRule {
    /// Stable service id, ≥ 1.
    pub id: u32,
    /// The validated rule as the user gave it (defaults filled in).
    pub rule: LbRule,
}

/// An immutable view of every rule, ordered by key. Cheap to clone (`Arc`).
#[derive(Debug, Default)]
pub struct RuleSnapshot {
    /// Increases by one on every accepted change.
    pub version: u64,
    /// Rules by key.
    pub rules: BTreeMap<RuleKey, Arc<StoredRule>>,
}

/// What an upsert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpsertOutcome {
    /// A new rule was added.
    Created,
    /// The same key existed with the same shape; endpoints or knobs were replaced.
    Updated,
    /// The identical rule already existed; nothing changed.
    Unchanged,
}

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The rule failed validation (names the field).
    #[error(transparent)]
    Invalid(#[from] RuleError),
    /// The state file could not be written; the change was not applied.
    #[error("persisting rules failed: {0}")]
    Persist(#[from] PersistError),
    /// No rule matched a delete.
    #[error("no rule matches {0}")]
    NotFound(String),
}

/// The rule store. Share it as `Arc<RuleStore>`.
pub struct RuleStore {
    current: ArcSwap<RuleSnapshot>,
    tx: watch::Sender<Arc<RuleSnapshot>>,
    /// Serialises writers so validate → persist → publish is atomic.
    write: Mutex<u32>,
    state_file: Option<PathBuf>,
}

impl RuleStore {
    /// A store without persistence (tests and tools).
    pub fn in_memory() -> Self {
        Self::with(None, BTreeMap::new(), 0)
    }

    /// Opens the store in `state_dir` (created if missing) and restores `rules.json`.
    /// A corrupt file is moved aside (`rules.json.corrupt-<unix secs>`), logged, and the store
    /// starts empty: the daemon always starts.
    pub fn open(state_dir: &Path) -> Result<Self, PersistError> {
        let file = persist::state_file(state_dir)?;
        let restored = persist::load(&file);
        let mut rules = BTreeMap::new();
        let mut max_id = 0;
        for stored in restored {
            match validate::validate(stored.rule) {
                Ok(rule) => {
                    max_id = max_id.max(stored.id);
                    rules.insert(rule.key(), Arc::new(StoredRule { id: stored.id, rule }));
                }
                Err(e) => tracing::error!(error = %e, "dropping a restored rule that no longer validates"),
            }
        }
        tracing::info!(rules = rules.len(), file = %file.display(), "rules restored");
        Ok(Self::with(Some(file), rules, max_id))
    }

    fn with(state_file: Option<PathBuf>, rules: BTreeMap<RuleKey, Arc<StoredRule>>, max_id: u32) -> Self {
        let snap = Arc::new(RuleSnapshot { version: 1, rules });
        let (tx, _) = watch::channel(snap.clone());
        Self { current: ArcSwap::new(snap), tx, write: Mutex::new(max_id), state_file }
    }

    /// The newest snapshot.
    pub fn snapshot(&self) -> Arc<RuleSnapshot> {
        self.current.load_full()
    }

    /// A receiver that always holds the newest snapshot (marked changed on every change).
    pub fn subscribe(&self) -> watch::Receiver<Arc<RuleSnapshot>> {
        self.tx.subscribe()
    }

    /// Validates and stores `rule`. Same key with another shape (mode, protocol, selector
    /// family, P/D or KV topology, engine type) is [`RuleError::Conflict`] (HTTP 409).
    pub fn upsert(&self, rule: LbRule) -> Result<UpsertOutcome, StoreError> {
        let rule = validate::validate(rule)?;
        let mut next_id = self.write.lock();
        let cur = self.current.load_full();
        let key = rule.key();
        let (outcome, id) = match cur.rules.get(&key) {
            Some(old) if old.rule == rule => return Ok(UpsertOutcome::Unchanged),
            Some(old) => {
                validate::check_same_shape(&old.rule, &rule)?;
                (UpsertOutcome::Updated, old.id)
            }
            None => {
                *next_id += 1;
                (UpsertOutcome::Created, *next_id)
            }
        };
        let mut rules = cur.rules.clone();
        rules.insert(key, Arc::new(StoredRule { id, rule }));
        self.commit(&cur, rules)?;
        Ok(outcome)
    }

    /// Deletes every rule on `ip:port/protocol` whose host and model match (`None` = any).
    /// Returns the deleted rules; none matching is [`StoreError::NotFound`].
    pub fn delete(
        &self,
        ip: &str,
        port: u16,
        protocol: &str,
        host: Option<&str>,
        model_name: Option<&str>,
    ) -> Result<Vec<Arc<StoredRule>>, StoreError> {
        let _w = self.write.lock();
        let cur = self.current.load_full();
        let proto = protocol.to_ascii_lowercase();
        let ip = validate::normalize_ip(ip).unwrap_or_else(|_| ip.to_string());
        let mut rules = cur.rules.clone();
        let gone: Vec<_> = cur
            .rules
            .iter()
            .filter(|(k, _)| {
                k.external_ip == ip
                    && k.port == port
                    && k.protocol == proto
                    && host.is_none_or(|h| h == k.host)
                    && model_name.is_none_or(|m| m == k.model_name)
            })
            .map(|(k, v)| {
                rules.remove(k);
                v.clone()
            })
            .collect();
        if gone.is_empty() {
            return Err(StoreError::NotFound(format!("{ip}:{port}/{proto}")));
        }
        self.commit(&cur, rules)?;
        Ok(gone)
    }

    fn commit(
        &self,
        cur: &RuleSnapshot,
        rules: BTreeMap<RuleKey, Arc<StoredRule>>,
    ) -> Result<(), StoreError> {
        if let Some(file) = &self.state_file {
            let list: Vec<&StoredRule> = rules.values().map(|r| r.as_ref()).collect();
            persist::save(file, &list)?;
        }
        let snap = Arc::new(RuleSnapshot { version: cur.version + 1, rules });
        self.current.store(snap.clone());
        self.tx.send_replace(snap);
        Ok(())
    }
}
