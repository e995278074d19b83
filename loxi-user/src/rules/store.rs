//! The rule store: validated rules, an immutable snapshot per change, and the state file.
//!
//! Readers take [`RuleStore::snapshot`] (an `ArcSwap` load, wait-free) or follow
//! [`RuleStore::subscribe`] (a `watch` channel that always holds the newest snapshot). Writers
//! (the REST API) call [`RuleStore::upsert`] / [`RuleStore::delete`], which validate, persist
//! atomically, then publish. A write is acknowledged only after the state file is on disk, so
//! an accepted rule survives a restart (LoxiLB auto-persists its rules too, in `snapshot.json`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::sync::watch;

use super::error::RuleError;
use super::model::{LbRule, RuleKey};
use super::persist::{self, PersistError};
use super::spec::ServiceSpec;
use super::validate;

/// One of `validate`'s `reset_inert_*` (or `text::reset_informational`): clears fields of a
/// restored rule that the API now refuses but that change nothing it serves, and names them.
type ResetInert = fn(&mut LbRule) -> Vec<&'static str>;

/// A stored rule with its stable service id (the `service` metric label and the `service_id`
/// of the KV inventory API). Ids are assigned on creation, never reused while the daemon runs,
/// and persisted with the rule. Equality ignores [`StoredRule::updated`]: two stores of the same
/// rule are the same rule (the proxy reuses a pool whose rule compares equal).
#[derive(Debug, Clone)]
pub struct StoredRule {
    /// Stable service id, ≥ 1.
    pub id: u32,
    /// The validated rule as the user gave it (defaults filled in).
    pub rule: LbRule,
    /// The typed spec validation compiled from `rule` (what routing, the KV tier and the proxy
    /// read).
    pub spec: ServiceSpec,
    /// When this rule was last created or changed in this process (a restored rule: when it
    /// was restored). In memory only, like LoxiLB's `lastUpdated` (reset to now on restart);
    /// reported by `GET .../protocol/{proto}/status`.
    pub updated: std::time::SystemTime,
}

impl PartialEq for StoredRule {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id && self.rule == other.rule && self.spec == other.spec
    }
}

impl StoredRule {
    /// Validates `rule` and compiles its spec; `updated` is now.
    pub fn new(id: u32, rule: LbRule) -> Result<Self, RuleError> {
        let (rule, spec) = validate::compile(rule)?;
        Ok(Self {
            id,
            rule,
            spec,
            updated: std::time::SystemTime::now(),
        })
    }
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
    /// The data paths that follow the snapshots ([`RuleStore::follower`]) and the newest
    /// version each has put into effect.
    followers: Mutex<Vec<(&'static str, watch::Receiver<u64>)>>,
}

/// One data path's mark of the newest rule snapshot it has put into effect (the fullproxy's
/// listeners and pools, the KV tier's members and streams, the L4 maps). Made by
/// [`RuleStore::follower`]; the REST API waits on the marks ([`RuleStore::settled`]) before
/// it acknowledges a change, so a `200` means new connections and requests follow the rule.
/// Dropping it (the data path stopped) releases every waiter.
#[derive(Debug)]
pub struct Applied(watch::Sender<u64>);

impl Applied {
    /// Records that snapshot `version` ([`RuleSnapshot::version`]) and every older one are in
    /// effect. Versions only grow: an older mark is ignored.
    pub fn mark(&self, version: u64) {
        self.0.send_if_modified(|v| {
            let newer = version > *v;
            if newer {
                *v = version;
            }
            newer
        });
    }
}

/// Writes the rules dropped at restore (id, as stored, why: a clause completing "dropping a
/// restored rule") beside the state `file` and logs each naming the file they are kept in.
fn keep_dropped(
    file: &Path,
    dropped: Vec<(u32, serde_json::Value, String)>,
) -> Result<(), PersistError> {
    if dropped.is_empty() {
        return Ok(());
    }
    let stored: Vec<serde_json::Value> = dropped.iter().map(|(_, s, _)| s.clone()).collect();
    let kept = persist::save_dropped(file, &stored)?;
    for (id, stored, why) in &dropped {
        tracing::error!(
            rule = id,
            key = %stored_key(stored),
            error = %why,
            kept = %kept.display(),
            "dropping a restored rule {why}; it is kept as stored in {} (rules.json no longer \
             holds it once it is next written: at this start when restore changed another rule, \
             else at the next change)",
            kept.display()
        );
    }
    Ok(())
}

/// The `externalIP:port/protocol` a stored rule's JSON names, as far as it names them (`?` for
/// a part that is missing or not of its type): the drop log says which rule it was even when
/// the rule does not parse.
fn stored_key(stored: &serde_json::Value) -> String {
    // A stored entry is `{"id", "rule"}`; the rule's own shape is read as well.
    // Keys are matched ignoring case, as the API (and restore) match them.
    let get = |v: &'_ serde_json::Value, key: &str| {
        v.as_object()
            .and_then(|o| o.iter().find(|(k, _)| k.eq_ignore_ascii_case(key)))
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let entry_rule = get(stored, "rule");
    let rule = if entry_rule.is_null() {
        stored
    } else {
        &entry_rule
    };
    let svc = get(rule, "serviceArguments");
    let part = |key: &str| match get(&svc, key) {
        serde_json::Value::String(s) => s,
        serde_json::Value::Number(n) => n.to_string(),
        _ => "?".to_string(),
    };
    let text = format!(
        "{}:{}/{}",
        part("externalIP"),
        part("port"),
        part("protocol")
    );
    shown_text(&text)
}

/// `text` cut after [`SHOWN_VALUE_LEN`] characters, with its length said when cut.
fn shown_text(text: &str) -> String {
    if text.chars().count() <= SHOWN_VALUE_LEN {
        return text.to_string();
    }
    let cut: String = text.chars().take(SHOWN_VALUE_LEN).collect();
    format!("{cut}... ({} bytes)", text.len())
}

/// Longest JSON text of a value [`changed_values`] shows; a longer one is cut and its length
/// said (a stored id or name can be megabytes long).
const SHOWN_VALUE_LEN: usize = 60;

/// A value as [`changed_values`] shows it: its JSON text, cut after [`SHOWN_VALUE_LEN`]
/// characters.
fn shown_value(v: &serde_json::Value) -> String {
    shown_text(&v.to_string())
}

/// Appends to `out` each value of `before` that `after` holds otherwise, as
/// `path old -> new` (`serviceArguments.kvHashAlgo "xxhash_cbor" -> "sha256_sglang"`,
/// `endpoints[1].weight 3 -> 1`); `path` is where `before` and `after` sit (empty: the rule).
fn changed_values(
    path: &str,
    before: &serde_json::Value,
    after: &serde_json::Value,
    out: &mut Vec<String>,
) {
    use serde_json::Value;
    match (before, after) {
        (Value::Object(b), Value::Object(a)) => {
            let keys: std::collections::BTreeSet<&String> = b.keys().chain(a.keys()).collect();
            for k in keys {
                let sub = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                let (b, a) = (
                    b.get(k.as_str()).unwrap_or(&Value::Null),
                    a.get(k.as_str()).unwrap_or(&Value::Null),
                );
                changed_values(&sub, b, a, out);
            }
        }
        (Value::Array(b), Value::Array(a)) if b.len() == a.len() => {
            for (i, (b, a)) in b.iter().zip(a).enumerate() {
                changed_values(&format!("{path}[{i}]"), b, a, out);
            }
        }
        (b, a) if b != a => out.push(format!("{path} {} -> {}", shown_value(b), shown_value(a))),
        _ => {}
    }
}

impl RuleStore {
    /// A store without persistence (tests and tools).
    pub fn in_memory() -> Self {
        Self::with(None, BTreeMap::new(), 0)
    }

    /// Opens the store in `state_dir` (created if missing) and restores `rules.json`, each rule
    /// read by `parse` (the daemon passes the API's field checks, which live above this layer:
    /// `crate::api::fields::restored_rule`).
    /// A corrupt file (not JSON, or no `rules` list) is moved aside
    /// (`rules.json.corrupt-<unix secs>`), logged, and the store starts empty. A rule that does
    /// not parse (an unknown field, a wrong type, a key named twice), no longer validates (or
    /// whose key a later rule of the file takes) is dropped, and kept as stored in
    /// `rules.dropped-<unix secs>.json` ([`persist::save_dropped`]) before the next write can
    /// erase it from `rules.json`; each is logged naming that file. A rule restored with fields
    /// the API now refuses reset (each logged once with its old and new value) or with an id
    /// minted is written back to `rules.json` (the store's atomic write), so the next start
    /// restores it as it is now.
    ///
    /// A valid rule that `check` refuses is dropped (and kept aside) too: what the API checks at
    /// `POST` outside this layer (the daemon passes the fullproxy's backend TLS check: a
    /// `security: 2` rule whose `backend_ca_file` is no longer readable). `check`'s `Err`
    /// completes "dropping a restored rule that …".
    ///
    /// # Errors
    /// The state directory cannot be created, or dropped rules cannot be kept.
    pub fn open_checked(
        state_dir: &Path,
        parse: persist::RuleParser<'_>,
        check: &dyn Fn(&LbRule) -> Result<(), String>,
    ) -> Result<Self, PersistError> {
        let file = persist::state_file(state_dir)?;
        let mut rules: BTreeMap<RuleKey, Arc<StoredRule>> = BTreeMap::new();
        let mut max_id = 0;
        let mut stored_by_id = std::collections::HashMap::new();
        // Dropped rules: their id, as stored, and why.
        let mut dropped: Vec<(u32, serde_json::Value, String)> = Vec::new();
        // A restored rule was changed (fields reset, an id minted): rules.json is rewritten.
        let mut rewrite = false;
        for loaded in persist::load(&file, parse) {
            let loaded = match loaded {
                Ok(l) => l,
                Err(u) => {
                    let why = format!("that does not parse as a rule ({})", u.error);
                    dropped.push((u.id, u.stored, why));
                    continue;
                }
            };
            let stored = loaded.parsed;
            stored_by_id.insert(stored.id, loaded.stored.clone());
            let mut rule = stored.rule;
            // Fields an older loxi stored that nothing reads: reset, and the API refuses them.
            let resets: [(ResetInert, &str); 6] = [
                (
                    |r| super::validate::reset_inert_kv_knobs(&mut r.service),
                    "tier-1.5 knobs without kvExactMode (never read) reset to their defaults",
                ),
                (
                    |r| super::validate::reset_incoherent_hash(&mut r.service),
                    "a kvHashAlgo its kvEngineType never publishes (no block could match) set \
                     to the engine's own",
                ),
                (
                    |r| super::validate::reset_inert_probe_fields(&mut r.service),
                    "probe fields no probe reads cleared",
                ),
                (
                    |r| super::validate::reset_inert_selector_knobs(&mut r.service),
                    "selector knobs its selector never reads reset to their defaults",
                ),
                (
                    super::validate::reset_inert_weights,
                    "unequal endpoint weights its selector never reads set to 1",
                ),
                (
                    super::text::reset_informational,
                    "a name or id with control characters or over 253 bytes cleared (an id is \
                     minted again)",
                ),
            ];
            // Logged only for a rule that is then restored: a dropped one is logged as such.
            // Each reset with the values it changed (`path old -> new`).
            let mut reset: Vec<(&str, Vec<String>)> = Vec::new();
            for (reset_fn, what) in resets {
                let before = serde_json::to_value(&rule).unwrap_or_default();
                if reset_fn(&mut rule).is_empty() {
                    continue;
                }
                let after = serde_json::to_value(&rule).unwrap_or_default();
                let mut changes = Vec::new();
                changed_values("", &before, &after, &mut changes);
                reset.push((what, changes));
            }
            // A rule changed at restore is written back below, so the next start restores it
            // as it is now (silently) instead of resetting and logging it again.
            let mut changed = !reset.is_empty();
            if rule.service.id.is_empty() {
                // A state file written before rules had LoxiLB's opaque id, or one just cleared:
                // the minted id is written back too, so it stays the rule's across restarts.
                rule.service.id = mint_uuid();
                changed = true;
            }
            match StoredRule::new(stored.id, rule) {
                Ok(rule) => {
                    if let Err(why) = check(&rule.rule) {
                        dropped.push((rule.id, loaded.stored, format!("that {why}")));
                        continue;
                    }
                    // Ids are unique (the API answers 409 to a second rule with an id in use):
                    // a later rule of the file with an earlier one's serviceId or id under
                    // another key (a copied entry, edited by hand) is dropped, not served
                    // beside it with the same metric series and KV state.
                    let key = rule.rule.key();
                    if let Some(first) = rules.values().find(|r| {
                        r.rule.key() != key
                            && (r.id == rule.id
                                || (!r.rule.service.id.is_empty()
                                    && r.rule.service.id == rule.rule.service.id))
                    }) {
                        let which = if first.id == rule.id {
                            "serviceId"
                        } else {
                            "id"
                        };
                        let why = format!(
                            "whose {which} an earlier rule of the file ({}) has too; ids are \
                             unique, so only the first is restored",
                            first.rule.key()
                        );
                        dropped.push((rule.id, loaded.stored, why));
                        continue;
                    }
                    for (what, changes) in reset {
                        tracing::warn!(
                            rule = stored.id,
                            key = %rule.rule.key(),
                            "restored rule: {what} ({}); the API now refuses them; rules.json \
                             is rewritten with the new values",
                            changes.join(", ")
                        );
                    }
                    rewrite |= changed;
                    max_id = max_id.max(rule.id);
                    let id = rule.id;
                    if let Some(old) = rules.insert(rule.rule.key(), Arc::new(rule)) {
                        let why = format!(
                            "whose key {} a later rule of the file ({id}) has too once \
                             normalised (protocol and host case, a host's trailing dot), so \
                             only one was ever served",
                            old.rule.key()
                        );
                        let raw = stored_by_id.get(&old.id).cloned().unwrap_or_default();
                        dropped.push((old.id, raw, why));
                    }
                }
                Err(e) => {
                    let why = format!("that no longer validates ({e})");
                    dropped.push((stored.id, loaded.stored, why));
                }
            }
        }
        keep_dropped(&file, dropped)?;
        if rewrite {
            // The store's own atomic write, after the dropped rules are kept aside. A failure
            // leaves the file as it was (the same resets are made at the next start); the
            // daemon serves the corrected rules either way.
            if let Err(e) = persist::save(&file, rules.values().map(|r| (r.id, &r.rule))) {
                tracing::error!(file = %file.display(), error = %e,
                    "cannot write the rules changed at restore back; the next start changes \
                     them again");
            }
        }
        tracing::info!(rules = rules.len(), file = %file.display(), "rules restored");
        Ok(Self::with(Some(file), rules, max_id))
    }

    fn with(
        state_file: Option<PathBuf>,
        rules: BTreeMap<RuleKey, Arc<StoredRule>>,
        max_id: u32,
    ) -> Self {
        let snap = Arc::new(RuleSnapshot { version: 1, rules });
        let (tx, _) = watch::channel(snap.clone());
        Self {
            current: ArcSwap::new(snap),
            tx,
            write: Mutex::new(max_id),
            state_file,
            followers: Mutex::new(Vec::new()),
        }
    }

    /// Registers a data path named `name` (for the log) that follows [`Self::subscribe`] and
    /// marks each snapshot it has applied. Register before the API serves, so no change is
    /// acknowledged before every data path has it.
    pub fn follower(&self, name: &'static str) -> Applied {
        let (tx, rx) = watch::channel(0);
        self.followers.lock().push((name, rx));
        Applied(tx)
    }

    /// Waits until every follower has applied snapshot `version` or a newer one, for at most
    /// `within`. `Err` names the followers still behind (the change is stored and they apply
    /// it when they get to it); a follower that stopped is not waited for.
    pub async fn settled(
        &self,
        version: u64,
        within: std::time::Duration,
    ) -> Result<(), Vec<&'static str>> {
        let followers = self.followers.lock().clone();
        let deadline = tokio::time::Instant::now() + within;
        let mut behind = Vec::new();
        for (name, mut rx) in followers {
            let caught_up = rx.wait_for(|v| *v >= version);
            if tokio::time::timeout_at(deadline, caught_up).await.is_err() {
                behind.push(name);
            }
        }
        if behind.is_empty() {
            Ok(())
        } else {
            Err(behind)
        }
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
    ///
    /// The rule's opaque `id` (LoxiLB's) is kept from the stored rule on an update (as LoxiLB
    /// keeps it), taken as posted on a create, or minted (UUIDv4) when absent; an `id` another
    /// rule already has is [`RuleError::IdTaken`] (HTTP 409).
    pub fn upsert(&self, rule: LbRule) -> Result<UpsertOutcome, StoreError> {
        let (mut rule, spec) = validate::compile(rule)?;
        let mut next_id = self.write.lock();
        let cur = self.current.load_full();
        let key = rule.key();
        if let Some(old) = cur.rules.get(&key) {
            rule.service.id.clone_from(&old.rule.service.id);
        } else if rule.service.id.is_empty() {
            rule.service.id = mint_uuid();
        } else if let Some(other) = cur
            .rules
            .values()
            .find(|r| r.rule.service.id == rule.service.id)
        {
            return Err(RuleError::IdTaken {
                id: rule.service.id,
                rule: other.rule.key().to_string(),
            }
            .into());
        }
        check_tls_sharing(&cur, &key, &rule)?;
        let (outcome, id) = match cur.rules.get(&key) {
            Some(old) if old.rule == rule => return Ok(UpsertOutcome::Unchanged),
            Some(old) => {
                validate::check_same_shape(&old.rule, &rule)?;
                (UpsertOutcome::Updated, old.id)
            }
            None => {
                check_l4_capacity(&cur, &rule)?;
                *next_id += 1;
                (UpsertOutcome::Created, *next_id)
            }
        };
        let mut rules = cur.rules.clone();
        rules.insert(
            key,
            Arc::new(StoredRule {
                id,
                rule,
                spec,
                updated: std::time::SystemTime::now(),
            }),
        );
        self.commit(&cur, rules)?;
        Ok(outcome)
    }

    /// Deletes the rule with exactly this key: `host` and `model_name` are part of it, and an
    /// empty one means "the rule without a host / model", never "any" (LoxiLB's semantics).
    /// Returns the deleted rule; none matching is [`StoreError::NotFound`].
    pub fn delete(
        &self,
        ip: &str,
        port: u16,
        protocol: &str,
        host: &str,
        model_name: &str,
    ) -> Result<Vec<Arc<StoredRule>>, StoreError> {
        let proto = protocol.to_ascii_lowercase();
        let ip = validate::normalize_ip(ip).unwrap_or_else(|_| ip.to_string());
        let key = RuleKey {
            external_ip: ip,
            port,
            protocol: proto,
            host: validate::host_key(host),
            model_name: model_name.to_string(),
        };
        self.delete_where(&key.to_string(), |k, _| *k == key)
            .map_err(|e| match e {
                StoreError::NotFound(what) => StoreError::NotFound(self.near_keys(&key, what)),
                e => e,
            })
    }

    /// `what`, and when rules share `key`'s address, port and protocol under another host or
    /// model (the key of a delete must match exactly), the first few of them and how to name
    /// one: a delete without `--host` never reaches a host rule.
    fn near_keys(&self, key: &RuleKey, what: String) -> String {
        const SHOWN: usize = 4;
        let cur = self.current.load();
        let near: Vec<&RuleKey> = cur
            .rules
            .keys()
            .filter(|k| {
                k.external_ip == key.external_ip && k.port == key.port && k.protocol == key.protocol
            })
            .collect();
        if near.is_empty() {
            return what;
        }
        let listed: Vec<String> = near
            .iter()
            .take(SHOWN)
            .map(|k| format!("{:?}", k.to_string()))
            .collect();
        format!(
            "{what}; the host and model are part of a rule's key, and {} {} on this address and \
             port{}: name it with loxicmd's --host/--model-name (REST: ?host=, ?model_name=)",
            if near.len() == 1 {
                "this rule is"
            } else {
                "these rules are"
            },
            listed.join(", "),
            if near.len() > SHOWN {
                format!(" (and {} more)", near.len() - SHOWN)
            } else {
                String::new()
            }
        )
    }

    /// Deletes every rule named `name` (`serviceArguments.name`, LoxiLB's
    /// `DELETE .../loadbalancer/name/{name}`). An empty name matches nothing.
    pub fn delete_by_name(&self, name: &str) -> Result<Vec<Arc<StoredRule>>, StoreError> {
        self.delete_where(&format!("name {name:?}"), |_, r| {
            !name.is_empty() && r.rule.service.name == name
        })
    }

    /// Deletes every rule `pick` selects; `what` names the selection in the not-found error.
    fn delete_where(
        &self,
        what: &str,
        pick: impl Fn(&RuleKey, &StoredRule) -> bool,
    ) -> Result<Vec<Arc<StoredRule>>, StoreError> {
        let _w = self.write.lock();
        let cur = self.current.load_full();
        let mut rules = cur.rules.clone();
        let gone: Vec<_> = cur
            .rules
            .iter()
            .filter(|(k, v)| pick(k, v))
            .map(|(k, v)| {
                rules.remove(k);
                v.clone()
            })
            .collect();
        if gone.is_empty() {
            return Err(StoreError::NotFound(what.to_string()));
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
            persist::save(file, rules.values().map(|r| (r.id, &r.rule)))?;
        }
        let snap = Arc::new(RuleSnapshot {
            version: cur.version + 1,
            rules,
        });
        self.current.store(snap.clone());
        self.tx.send_replace(snap);
        Ok(())
    }
}

/// Plain (`security: 0`) and TLS rules cannot share a fullproxy address: one listener either
/// terminates TLS or does not. `Err` names the other rule.
fn check_tls_sharing(cur: &RuleSnapshot, key: &RuleKey, rule: &LbRule) -> Result<(), RuleError> {
    let s = &rule.service;
    if s.mode != loxi_common::mode::FULLPROXY {
        return Ok(());
    }
    let clash = cur.rules.iter().find(|(k, r)| {
        let o = &r.rule.service;
        *k != key
            && o.mode == s.mode
            && k.external_ip == key.external_ip
            && k.port == key.port
            && k.protocol == key.protocol
            && (o.security != 0) != (s.security != 0)
    });
    match clash {
        None => Ok(()),
        Some((k, r)) => Err(RuleError::Invalid {
            field: "serviceArguments.security".into(),
            message: format!(
                "{} conflicts with rule {k} (security {}) on {}:{}: plain and TLS rules cannot \
                 share an address",
                s.security, r.rule.service.security, key.external_ip, key.port
            ),
        }),
    }
}

/// A random (version 4) UUID in LoxiLB's lower-case 8-4-4-4-12 form.
pub fn mint_uuid() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// A new L4 rule (mode other than 4) needs a free rule slot of the XDP data path
/// (`loxi_common::maps::MAX_RULES`, the size of its maps); an update keeps its slot and a
/// mode-4 rule takes none. Checked under the store's write lock, so two writes cannot both
/// take the last slot; without it the rule would be stored and never programmed.
fn check_l4_capacity(cur: &RuleSnapshot, rule: &LbRule) -> Result<(), RuleError> {
    use loxi_common::maps::MAX_RULES;
    let l4 = |r: &LbRule| r.service.mode != loxi_common::mode::FULLPROXY;
    if !l4(rule) {
        return Ok(());
    }
    let held = cur.rules.values().filter(|r| l4(&r.rule)).count();
    if held < MAX_RULES as usize {
        return Ok(());
    }
    Err(RuleError::Invalid {
        field: "serviceArguments.mode".into(),
        message: format!(
            "the L4 (XDP) data path holds at most {MAX_RULES} rules and {held} are stored; \
             delete one first, or use mode 4; nothing was stored"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`RuleStore::open_checked`] with the API's rule parser (as the daemon's) and no further
    /// check.
    fn open(state_dir: &Path) -> Result<RuleStore, PersistError> {
        RuleStore::open_checked(state_dir, &crate::api::fields::restored_rule, &|_| Ok(()))
    }
    use crate::rules::model::ServiceArgs;
    use serde_json::json;

    fn rule(port: u16, sel: u8, model: &str) -> LbRule {
        serde_json::from_value(json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": port, "mode": 4, "sel": sel,
                "model_name": model},
            "endpoints": [{"endpointIP": "10.0.1.1", "targetPort": 8000}]
        }))
        .expect("rule")
    }

    #[test]
    fn upsert_assigns_ids_and_publishes_each_change_once() {
        let store = RuleStore::in_memory();
        let mut rx = store.subscribe();
        assert_eq!(
            store.upsert(rule(80, 0, "")).expect("ok"),
            UpsertOutcome::Created
        );
        assert_eq!(
            store.upsert(rule(81, 0, "")).expect("ok"),
            UpsertOutcome::Created
        );
        assert!(rx.has_changed().expect("open"));
        let snap = rx.borrow_and_update().clone();
        assert_eq!(snap.version, 3);
        let ids: Vec<u32> = snap.rules.values().map(|r| r.id).collect();
        assert_eq!(ids, vec![1, 2]);
        assert_eq!(
            store.upsert(rule(80, 0, "")).expect("ok"),
            UpsertOutcome::Unchanged
        );
        assert!(
            !rx.has_changed().expect("open"),
            "an identical re-post publishes nothing"
        );
        let mut w = rule(80, 0, "");
        w.endpoints[0].weight = 9;
        assert_eq!(store.upsert(w).expect("ok"), UpsertOutcome::Updated);
        assert_eq!(
            store.snapshot().rules.values().next().map(|r| r.id),
            Some(1),
            "id kept"
        );
    }

    #[test]
    fn conflicting_upsert_leaves_the_store_unchanged() {
        let store = RuleStore::in_memory();
        store.upsert(rule(80, 0, "")).expect("ok");
        let v = store.snapshot().version;
        let e = store.upsert(rule(80, 8, "")).expect_err("conflict");
        assert!(
            matches!(e, StoreError::Invalid(RuleError::Conflict { .. })),
            "{e:?}"
        );
        assert_eq!(store.snapshot().version, v);
        assert_eq!(
            store
                .snapshot()
                .rules
                .values()
                .next()
                .map(|r| r.rule.service.sel),
            Some(0)
        );
    }

    #[test]
    fn delete_matches_the_exact_key_an_absent_host_or_model_is_empty_not_any() {
        let store = RuleStore::in_memory();
        store.upsert(rule(80, 0, "a")).expect("ok");
        store.upsert(rule(80, 0, "b")).expect("ok");
        store.upsert(rule(81, 0, "")).expect("ok");
        let e = store
            .delete("10.0.0.1", 80, "tcp", "", "")
            .expect_err("no model-less rule on :80");
        assert_eq!(
            e.to_string(),
            "no rule matches 10.0.0.1:80/tcp; the host and model are part of a rule's key, and \
             these rules are \"10.0.0.1:80/tcp model=a\", \"10.0.0.1:80/tcp model=b\" on this \
             address and port: name it with loxicmd's --host/--model-name (REST: ?host=, \
             ?model_name=)"
        );
        assert_eq!(store.snapshot().rules.len(), 3, "the model pools stay");
        let gone = store
            .delete("10.0.0.1", 80, "TCP", "", "b")
            .expect("deleted");
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].rule.service.model_name, "b");
        let e = store
            .delete("10.0.0.1", 80, "tcp", "h", "a")
            .expect_err("no host h");
        assert!(matches!(e, StoreError::NotFound(_)), "{e:?}");
        assert_eq!(
            store
                .delete("10.0.0.1", 81, "tcp", "", "")
                .expect("rest")
                .len(),
            1
        );
        assert_eq!(store.snapshot().rules.len(), 1);
        let e = store
            .delete("10.0.0.1", 81, "tcp", "", "")
            .expect_err("gone");
        assert_eq!(
            e.to_string(),
            "no rule matches 10.0.0.1:81/tcp",
            "nothing near: no hint"
        );
    }

    #[test]
    fn ids_are_minted_kept_across_updates_and_delete_by_name_works() {
        let store = RuleStore::in_memory();
        let mut r = rule(80, 0, "");
        r.service.name = "my-ai-rule".into();
        store.upsert(r.clone()).expect("ok");
        let id = store
            .snapshot()
            .rules
            .values()
            .next()
            .map(|x| x.rule.service.id.clone());
        let id = id.expect("rule");
        assert_eq!((id.len(), &id[14..15]), (36, "4"), "{id}");
        r.endpoints[0].weight = 5;
        assert_eq!(store.upsert(r.clone()).expect("ok"), UpsertOutcome::Updated);
        let again = store
            .snapshot()
            .rules
            .values()
            .next()
            .map(|x| x.rule.service.id.clone());
        assert_eq!(again.as_deref(), Some(id.as_str()), "kept across an update");
        let mut other = rule(81, 0, "");
        other.service.id.clone_from(&id);
        let e = store.upsert(other).expect_err("id taken");
        assert!(
            matches!(&e, StoreError::Invalid(RuleError::IdTaken { rule, .. })
                if rule == "10.0.0.1:80/tcp"),
            "{e:?}"
        );
        assert!(matches!(
            store.delete_by_name("nope"),
            Err(StoreError::NotFound(_))
        ));
        assert_eq!(store.delete_by_name("my-ai-rule").expect("gone").len(), 1);
        assert!(store.snapshot().rules.is_empty());
    }

    #[test]
    fn reopening_the_state_dir_restores_rules_and_ids_and_never_reuses_an_id() {
        let dir = tempfile::tempdir().expect("tmp");
        {
            let store = open(dir.path()).expect("open");
            store.upsert(rule(80, 0, "")).expect("ok");
            store.upsert(rule(81, 2, "")).expect("ok");
            store.upsert(rule(82, 0, "")).expect("ok");
            store
                .delete("10.0.0.1", 82, "tcp", "", "")
                .expect("deleted");
        }
        let store = open(dir.path()).expect("reopen");
        let snap = store.snapshot();
        let got: Vec<(u16, u8, u32)> = snap
            .rules
            .values()
            .map(|r| (r.rule.service.port, r.rule.service.sel, r.id))
            .collect();
        assert_eq!(got, vec![(80, 0, 1), (81, 2, 2)]);
        store.upsert(rule(83, 0, "")).expect("ok");
        let id = store
            .snapshot()
            .rules
            .values()
            .find(|r| r.rule.service.port == 83)
            .map(|r| r.id);
        assert_eq!(id, Some(3), "ids continue after the highest restored id");
        assert!(
            !dir.path().join("rules.json.tmp").exists(),
            "no temp file left behind"
        );
    }

    #[test]
    fn a_failed_write_rejects_the_change_and_keeps_the_snapshot() {
        let dir = tempfile::tempdir().expect("tmp");
        let state = dir.path().join("state");
        let store = open(&state).expect("open");
        std::fs::remove_dir_all(&state).expect("pull the state dir away");
        let e = store.upsert(rule(80, 0, "")).expect_err("cannot persist");
        assert!(matches!(e, StoreError::Persist(_)), "{e:?}");
        assert!(e.to_string().contains("rules.json"), "{e}");
        assert!(store.snapshot().rules.is_empty());
    }

    /// The rules a store restores from a state file holding `rules` (`{"id", "rule"}` each):
    /// each one's id and service arguments, in key order.
    fn restored(rules: serde_json::Value) -> Vec<(u32, ServiceArgs)> {
        let dir = tempfile::tempdir().expect("tmp");
        let file = json!({"version": 1, "rules": rules});
        std::fs::write(dir.path().join("rules.json"), file.to_string()).expect("write");
        let store = open(dir.path()).expect("open");
        let snap = store.snapshot();
        snap.rules
            .values()
            .map(|r| (r.id, r.rule.service.clone()))
            .collect()
    }

    #[test]
    fn restored_rules_with_inert_kv_knobs_are_kept_with_the_knobs_reset() {
        let mut r = serde_json::to_value(rule(80, 0, "")).expect("v");
        r["serviceArguments"]["kvBlockSize"] = json!(32);
        r["serviceArguments"]["kvZmqPort"] = json!(6000);
        let kept: Vec<(u32, u32, u16)> = restored(json!([{"id": 7, "rule": r}]))
            .into_iter()
            .map(|(id, s)| (id, s.kv_block_size, s.kv_zmq_port))
            .collect();
        assert_eq!(kept, vec![(7, 16, 5557)]);
        // A plain pool stored with an engine name (and the algorithm derived from it): both
        // back to their defaults, the rule kept.
        let mut r = serde_json::to_value(rule(80, 0, "")).expect("v");
        r["serviceArguments"]["kvEngineType"] = json!("sglang");
        r["serviceArguments"]["kvHashAlgo"] = json!("sha256_sglang");
        let kept: Vec<(u32, String, String)> = restored(json!([{"id": 8, "rule": r}]))
            .into_iter()
            .map(|(id, s)| (id, s.kv_engine_type, s.kv_hash_algo))
            .collect();
        assert_eq!(kept, vec![(8, "vllm".to_owned(), "sha256_cbor".to_owned())]);
        // An SGLang pool stored with vLLM's hash: kept, with SGLang's own.
        let mut r = serde_json::to_value(rule(80, 0, "")).expect("v");
        r["serviceArguments"]["kvEngineType"] = json!("sglang");
        r["serviceArguments"]["kvExactMode"] = json!(3);
        r["serviceArguments"]["kvHashAlgo"] = json!("xxhash_cbor");
        let kept: Vec<(u32, String)> = restored(json!([{"id": 9, "rule": r}]))
            .into_iter()
            .map(|(id, s)| (id, s.kv_hash_algo))
            .collect();
        assert_eq!(kept, vec![(9, "sha256_sglang".to_owned())]);
    }

    /// A rule restored with a field reset is logged once with the field's old and new value,
    /// and written back (as is a rule whose id was minted): the next start restores both as
    /// they are, logging nothing and leaving the file as it is.
    #[test]
    fn a_rule_changed_at_restore_is_logged_with_its_values_and_written_back() {
        use crate::telemetry::LogBuf;
        let dir = tempfile::tempdir().expect("tmp");
        let mut r = serde_json::to_value(rule(80, 0, "")).expect("v");
        r["serviceArguments"]["kvEngineType"] = json!("sglang");
        r["serviceArguments"]["kvExactMode"] = json!(3);
        r["serviceArguments"]["kvHashAlgo"] = json!("xxhash_cbor");
        let mut no_id = serde_json::to_value(rule(81, 0, "")).expect("v");
        no_id["serviceArguments"]["id"] = json!("");
        let path = dir.path().join("rules.json");
        let file =
            json!({"version": 1, "rules": [{"id": 9, "rule": r}, {"id": 10, "rule": no_id}]});
        std::fs::write(&path, file.to_string()).expect("write");
        let (_, text) = LogBuf::capture(|| open(dir.path()).expect("open"));
        let warns: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
        assert_eq!(warns.len(), 1, "{text}");
        assert!(
            warns[0].contains(
                "restored rule: a kvHashAlgo its kvEngineType never publishes (no block could \
                 match) set to the engine's own (serviceArguments.kvHashAlgo \"xxhash_cbor\" -> \
                 \"sha256_sglang\")"
            ) && warns[0].contains("10.0.0.1:80/tcp"),
            "{text}"
        );
        let written = std::fs::read(&path).expect("read");
        let on_disk: serde_json::Value = serde_json::from_slice(&written).expect("JSON");
        let svc = |i: usize| &on_disk["rules"][i]["rule"]["serviceArguments"];
        assert_eq!(svc(0)["kvHashAlgo"], "sha256_sglang");
        assert_eq!(on_disk["rules"][0]["id"], 9);
        let minted = svc(1)["id"].as_str().unwrap_or_default().to_owned();
        assert_eq!(minted.len(), 36, "the minted id is written back: {on_disk}");
        // The next start: nothing to reset, nothing logged, nothing written.
        let (again, text) = LogBuf::capture(|| open(dir.path()).expect("reopen"));
        assert!(!text.contains("WARN"), "{text}");
        assert_eq!(std::fs::read(&path).expect("read"), written);
        let got: Vec<(u32, String, String)> = again
            .snapshot()
            .rules
            .values()
            .map(|r| {
                (
                    r.id,
                    r.rule.service.kv_hash_algo.clone(),
                    r.rule.service.id.clone(),
                )
            })
            .collect();
        assert_eq!(got[0].1, "sha256_sglang");
        assert_eq!((got[1].0, got[1].2.as_str()), (10, minted.as_str()));
    }

    /// A value too long to log is cut and its length said.
    #[test]
    fn changed_values_name_each_path_and_cut_long_values() {
        let mut out = Vec::new();
        changed_values(
            "",
            &json!({"a": {"b": 1, "c": "x"}, "e": [{"w": 3}, {"w": 1}]}),
            &json!({"a": {"b": 1, "c": "y"}, "e": [{"w": 1}, {"w": 1}]}),
            &mut out,
        );
        assert_eq!(out, ["a.c \"x\" -> \"y\"", "e[0].w 3 -> 1"]);
        out.clear();
        changed_values("id", &json!("i".repeat(100)), &json!(""), &mut out);
        assert_eq!(
            out,
            [format!("id \"{}... (102 bytes) -> \"\"", "i".repeat(59))]
        );
    }

    #[test]
    fn restored_rules_with_inert_selector_knobs_are_kept_with_the_knobs_reset() {
        let mut rr = serde_json::to_value(rule(80, 0, "")).expect("v");
        rr["serviceArguments"]["chwbl_mean_load_factor"] = json!(250);
        rr["serviceArguments"]["session_header_name"] = json!("X-S");
        let mut chwbl = serde_json::to_value(rule(81, 8, "")).expect("v");
        chwbl["serviceArguments"]["chwbl_mean_load_factor"] = json!(250);
        let kept: Vec<(u32, u32, String)> =
            restored(json!([{"id": 7, "rule": rr}, {"id": 8, "rule": chwbl}]))
                .into_iter()
                .map(|(id, s)| (id, s.chwbl_mean_load_factor, s.session_header_name))
                .collect();
        assert_eq!(
            kept,
            vec![(7, 175, String::new()), (8, 250, String::new())],
            "sel 0's knobs reset, sel 8's kept"
        );
    }

    #[test]
    fn restored_rules_with_inert_probe_fields_are_kept_with_them_cleared() {
        let mut r = serde_json::to_value(rule(80, 0, "")).expect("v");
        r["serviceArguments"]["probeport"] = json!(1234);
        r["serviceArguments"]["probereq"] = json!("/x");
        let mut http = serde_json::to_value(rule(81, 0, "")).expect("v");
        http["serviceArguments"]["probetype"] = json!("http");
        http["serviceArguments"]["probereq"] = json!("/health");
        let kept: Vec<(u32, u16, String)> =
            restored(json!([{"id": 7, "rule": r}, {"id": 8, "rule": http}]))
                .into_iter()
                .map(|(id, s)| (id, s.probeport, s.probereq))
                .collect();
        assert_eq!(kept, vec![(7, 0, String::new()), (8, 0, "/health".into())]);
    }

    /// A name or id the API now refuses (control characters, over 253 bytes) selects no
    /// traffic: the restored rule is kept serving, the name cleared and the id minted again.
    #[test]
    fn restored_rules_with_a_bad_name_or_id_are_kept_with_them_cleared() {
        let mut nl = serde_json::to_value(rule(80, 0, "")).expect("v");
        nl["serviceArguments"]["name"] = json!("web\nprod");
        nl["serviceArguments"]["id"] = json!("fixed-id");
        let mut long = serde_json::to_value(rule(81, 0, "")).expect("v");
        long["serviceArguments"]["name"] = json!("kept-name");
        long["serviceArguments"]["id"] = json!("i".repeat(1 << 20));
        let kept = restored(json!([{"id": 7, "rule": nl}, {"id": 8, "rule": long}]));
        let got: Vec<(u32, &str, usize)> = kept
            .iter()
            .map(|(id, s)| (*id, s.name.as_str(), s.id.len()))
            .collect();
        assert_eq!(got, vec![(7, "", 8), (8, "kept-name", 36)]);
        assert_eq!(kept[0].1.id, "fixed-id", "a valid id is kept");
        assert_eq!(
            &kept[1].1.id[14..15],
            "4",
            "a UUIDv4 minted for the cleared one"
        );
    }

    #[test]
    fn restored_rules_that_no_longer_validate_are_dropped() {
        let good = json!({"id": 4, "rule": serde_json::to_value(rule(80, 0, "")).expect("v")});
        let mut bad = json!({"id": 5, "rule": serde_json::to_value(rule(81, 0, "")).expect("v")});
        // Out of range under the one selector that reads it (a knob its selector never reads
        // would be reset, not dropped: the next test).
        bad["rule"]["serviceArguments"]["sel"] = json!(8);
        bad["rule"]["serviceArguments"]["chwbl_replication"] = json!(5000);
        let ids: Vec<u32> = restored(json!([good, bad]))
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(ids, vec![4]);
    }

    /// A hand edit that leaves one rule unparsable (an unknown field) drops that rule alone,
    /// kept as stored beside the state file; the file's other rules are restored.
    #[test]
    fn a_restored_rule_that_does_not_parse_is_dropped_alone() {
        let dir = tempfile::tempdir().expect("tmp");
        let good = json!({"id": 4, "rule": serde_json::to_value(rule(80, 0, "")).expect("v")});
        let mut bad = json!({"id": 5, "rule": serde_json::to_value(rule(81, 0, "")).expect("v")});
        bad["rule"]["serviceArguments"]["bogusField"] = json!(1);
        let other = json!({"id": 6, "rule": serde_json::to_value(rule(82, 0, "")).expect("v")});
        let file = json!({"version": 1, "rules": [good, bad.clone(), other]});
        std::fs::write(dir.path().join("rules.json"), file.to_string()).expect("write");
        let (store, log) = crate::telemetry::LogBuf::capture(|| open(dir.path()).expect("open"));
        let ids: Vec<u32> = store.snapshot().rules.values().map(|r| r.id).collect();
        assert_eq!(ids, vec![4, 6]);
        assert_eq!(
            dropped_files(dir.path()),
            [json!({"version": 1, "rules": [bad]})]
        );
        // The log names the field and the rule, not serde's list of every field.
        let line = log
            .lines()
            .find(|l| l.contains("dropping a restored rule"))
            .unwrap_or_else(|| panic!("no drop log in {log}"));
        assert!(
            line.contains(
                "that does not parse as a rule (serviceArguments.bogusField: \"bogusField\" \
                 is not a field)"
            ),
            "{line}"
        );
        assert!(line.contains("10.0.0.1:81/tcp"), "{line}");
        assert!(!line.contains("expected one of"), "{line}");
    }

    /// A stored rule naming a key twice (`"port"` twice: a hand edit) is dropped with its
    /// reason, as a `POST` naming a key twice is refused, not restored with the last value;
    /// the file's other rules are restored and the file as read is kept (the dropped-rules
    /// file can hold only one of the values).
    #[test]
    fn a_restored_rule_naming_a_key_twice_is_dropped_alone() {
        let dir = tempfile::tempdir().expect("tmp");
        let text = r#"{"version": 1, "rules": [
            {"id": 4, "rule": {"serviceArguments": {"externalIP": "10.0.0.1", "port": 80,
                "mode": 4}, "endpoints": [{"endpointIP": "10.0.1.1", "targetPort": 8000}]}},
            {"id": 5, "rule": {"serviceArguments": {"externalIP": "10.0.0.1", "port": 81,
                "port": 82, "mode": 4}, "endpoints": [{"endpointIP": "10.0.1.1",
                "targetPort": 8000}]}}
        ]}"#;
        std::fs::write(dir.path().join("rules.json"), text).expect("write");
        let (store, log) = crate::telemetry::LogBuf::capture(|| open(dir.path()).expect("open"));
        let ids: Vec<u32> = store.snapshot().rules.values().map(|r| r.id).collect();
        assert_eq!(ids, vec![4]);
        let line = log
            .lines()
            .find(|l| l.contains("dropping a restored rule"))
            .unwrap_or_else(|| panic!("no drop log in {log}"));
        assert!(
            line.contains(
                "that does not parse as a rule (rule.serviceArguments.port appears twice in its \
                 object; loxi drops the rule rather than keep one of the values silently"
            ),
            "{line}"
        );
        assert_eq!(dropped_files(dir.path()).len(), 1);
        assert_eq!(
            crate::rules::persist::tests::as_read_copies(&dir.path().join("rules.json")),
            [text]
        );
    }

    /// A stored rule whose keys differ from loxi's spelling only in case (a hand edit, as the
    /// API takes them: Go's key matching) is restored as the API would have stored it, not
    /// dropped; the drop log of another rule names its key in any case of its fields.
    #[test]
    fn a_restored_rule_with_keys_in_another_case_is_restored() {
        let dir = tempfile::tempdir().expect("tmp");
        let mut r = serde_json::to_value(rule(80, 0, "")).expect("v");
        let svc = r["serviceArguments"].as_object_mut().expect("object");
        let ip = svc.remove("externalIP").expect("externalIP");
        svc.insert("ExternalIP".into(), ip);
        for (canonical, variant, value) in [
            ("kvBlockSize", "KVBLOCKSIZE", json!(32)),
            ("kvExactMode", "kvexactmode", json!(3)),
        ] {
            svc.remove(canonical);
            svc.insert(variant.into(), value);
        }
        let ep = r["endpoints"][0].as_object_mut().expect("endpoint");
        let port = ep.remove("targetPort").expect("targetPort");
        ep.insert("TargetPort".into(), port);
        let file = json!({"version": 1, "rules": [{"id": 9, "rule": r.clone()}]});
        std::fs::write(dir.path().join("rules.json"), file.to_string()).expect("write");
        let store = open(dir.path()).expect("open");
        let snap = store.snapshot();
        let kept: Vec<(u32, String, u16, u32, u8, u16)> = snap
            .rules
            .values()
            .map(|s| {
                let v = &s.rule.service;
                (
                    s.id,
                    v.external_ip.clone(),
                    v.port,
                    v.kv_block_size,
                    v.kv_exact_mode,
                    s.rule.endpoints[0].target_port,
                )
            })
            .collect();
        assert_eq!(kept, vec![(9, "10.0.0.1".to_owned(), 80, 32, 3, 8000)]);
        assert!(dropped_files(dir.path()).is_empty());
        assert_eq!(stored_key(&json!({"rule": r})), "10.0.0.1:80/tcp");
    }

    /// A copied entry of the file that keeps another rule's serviceId, or its id, under
    /// another key is dropped (kept aside), not restored beside the first; the drop names the
    /// stored rule's key even when it does not parse.
    #[test]
    fn a_restored_rule_with_an_earlier_rules_service_id_or_id_is_dropped() {
        let dir = tempfile::tempdir().expect("tmp");
        let mut first = rule(80, 0, "");
        first.service.id = "uuid-a".into();
        let first = json!({"id": 2, "rule": serde_json::to_value(first).expect("v")});
        let same_sid = json!({"id": 2, "rule": serde_json::to_value(rule(81, 0, "")).expect("v")});
        let mut r = rule(82, 0, "");
        r.service.id = "uuid-a".into();
        let same_uuid = json!({"id": 3, "rule": serde_json::to_value(r).expect("v")});
        let ok = json!({"id": 4, "rule": serde_json::to_value(rule(83, 0, "")).expect("v")});
        let file = json!({"version": 1, "rules": [first, same_sid.clone(), same_uuid.clone(), ok]});
        std::fs::write(dir.path().join("rules.json"), file.to_string()).expect("write");
        let store = open(dir.path()).expect("open");
        let kept: Vec<(u32, u16)> = store
            .snapshot()
            .rules
            .values()
            .map(|r| (r.id, r.rule.service.port))
            .collect();
        assert_eq!(kept, vec![(2, 80), (4, 83)]);
        assert_eq!(
            dropped_files(dir.path()),
            [json!({"version": 1, "rules": [same_sid.clone(), same_uuid]})]
        );
        assert_eq!(stored_key(&same_sid), "10.0.0.1:81/tcp");
        assert_eq!(
            stored_key(&json!({"rule": {"serviceArguments": {"port": "x"}}})),
            "?:x/?"
        );
    }

    /// The `rules.dropped-*.json` files in `dir`, parsed.
    fn dropped_files(dir: &Path) -> Vec<serde_json::Value> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .expect("dir")
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("rules.dropped-")
            })
            .map(|e| e.path())
            .collect();
        files.sort();
        files
            .iter()
            .map(|f| serde_json::from_slice(&std::fs::read(f).expect("read")).expect("JSON"))
            .collect()
    }

    /// A dropped rule is kept as stored in a side file before any write; the next write then
    /// leaves it out of `rules.json`, but the side file still holds it.
    #[test]
    fn restored_rules_that_are_dropped_are_kept_as_stored_beside_the_state_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let good = json!({"id": 4, "rule": serde_json::to_value(rule(80, 0, "")).expect("v")});
        let mut bad = json!({"id": 5, "rule": serde_json::to_value(rule(81, 0, "")).expect("v")});
        bad["rule"]["serviceArguments"]["externalIP"] = json!("999.1.1.1");
        let file = json!({"version": 1, "rules": [good, bad.clone()]});
        std::fs::write(dir.path().join("rules.json"), file.to_string()).expect("write");
        let store = open(dir.path()).expect("open");
        assert_eq!(store.snapshot().rules.len(), 1);
        let kept = dropped_files(dir.path());
        assert_eq!(kept, [json!({"version": 1, "rules": [bad.clone()]})]);
        store.upsert(rule(82, 0, "")).expect("a write");
        let state = std::fs::read_to_string(dir.path().join("rules.json")).expect("read");
        assert!(!state.contains("999.1.1.1"), "{state}");
        assert_eq!(
            dropped_files(dir.path()),
            kept,
            "the side file is untouched"
        );
        // Nothing dropped, no side file.
        let clean = tempfile::tempdir().expect("tmp");
        open(clean.path()).expect("open");
        assert!(dropped_files(clean.path()).is_empty());
    }

    /// A mode-4 rule on 10.0.0.1:80 for `host`, with the one endpoint `ep`:8000.
    fn with_host(host: &str, ep: &str) -> LbRule {
        serde_json::from_value(json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 4,
                "host": host},
            "endpoints": [{"endpointIP": ep, "targetPort": 8000}]
        }))
        .expect("rule")
    }

    /// Hosts match case-insensitively and with one trailing dot dropped, so a host differing
    /// only in those is the same rule (stored once, lower case, without the dot), not a second
    /// rule that would never see a request.
    #[test]
    fn hosts_differing_in_case_are_one_rule() {
        let store = RuleStore::in_memory();
        let first = store.upsert(with_host("X.Example.COM", "10.0.1.1"));
        assert_eq!(first.expect("stored"), UpsertOutcome::Created);
        let second = store.upsert(with_host("x.example.com", "10.0.1.2"));
        assert_eq!(second.expect("stored"), UpsertOutcome::Updated);
        // The fully qualified spelling (one trailing dot) is the same host too.
        let third = store.upsert(with_host("x.example.com.", "10.0.1.3"));
        assert_eq!(third.expect("stored"), UpsertOutcome::Updated);
        let snap = store.snapshot();
        let hosts: Vec<&str> = snap.rules.keys().map(|k| k.host.as_str()).collect();
        assert_eq!(hosts, ["x.example.com"]);
        let gone = store.delete("10.0.0.1", 80, "tcp", "X.EXAMPLE.com.", "");
        assert_eq!(gone.expect("deleted").len(), 1);
        assert!(store.snapshot().rules.is_empty());
    }

    /// An IPv6 host is one rule whether bracketed or not, in any spelling of the address: the
    /// key is the canonical address without brackets, which is what the fullproxy matches a
    /// `Host: [::1]:8080` against (a bracketed key never matched a request).
    #[test]
    fn an_ipv6_host_bracketed_or_not_is_one_rule() {
        let store = RuleStore::in_memory();
        let first = store.upsert(with_host("[FD00::1]", "10.0.1.1"));
        assert_eq!(first.expect("stored"), UpsertOutcome::Created);
        let second = store.upsert(with_host("fd00:0::1", "10.0.1.2"));
        assert_eq!(second.expect("stored"), UpsertOutcome::Updated);
        let snap = store.snapshot();
        let hosts: Vec<&str> = snap.rules.keys().map(|k| k.host.as_str()).collect();
        assert_eq!(hosts, ["fd00::1"]);
        let gone = store.delete("10.0.0.1", 80, "tcp", "[fd00::1]", "");
        assert_eq!(gone.expect("deleted").len(), 1);
    }

    #[tokio::test]
    async fn settled_waits_for_every_follower_and_names_the_ones_behind() {
        let store = RuleStore::in_memory();
        let fast = store.follower("fast");
        let slow = store.follower("slow");
        let stopped = store.follower("stopped");
        store.upsert(rule(80, 0, "")).expect("stored");
        let v = store.snapshot().version;
        assert_eq!(v, 2);
        fast.mark(v);
        slow.mark(v - 1);
        drop(stopped);
        let short = std::time::Duration::from_millis(50);
        assert_eq!(store.settled(v, short).await, Err(vec!["slow"]));
        // An older mark never moves a follower back.
        fast.mark(1);
        let marker = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            slow.mark(v + 1);
            slow
        });
        let long = std::time::Duration::from_secs(5);
        assert_eq!(store.settled(v, long).await, Ok(()));
        drop(marker.await.expect("marker"));
        drop(fast);
    }
}
