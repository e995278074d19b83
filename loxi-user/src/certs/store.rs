//! The certificate store: checked certificates by id, an immutable snapshot per change, and
//! one file per certificate in `<state-dir>/certs/` (`<certId>.json`, mode 0600: it holds the
//! private key).
//!
//! Handshakes read [`CertStore::snapshot`] (an `ArcSwap` load), so a rotation
//! ([`CertStore::replace`]) is atomic: a handshake after it gets the new certificate, and a
//! connection that completed its handshake before keeps the session it has.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use super::parse::{self, CertError, CertPem, Certificate, ValidityError, ip_host};

/// The id of the certificate served when the client's SNI is absent or names no rule's host.
pub const DEFAULT_ID: &str = "default";

/// Every certificate, by id.
#[derive(Debug, Default)]
pub struct CertSnapshot {
    /// Certificates by id.
    pub certs: BTreeMap<String, Arc<Certificate>>,
}

impl CertSnapshot {
    /// The certificate serving host `name`: among the certificates valid now, one naming it
    /// exactly, else one whose wildcard covers it; else, among the expired (or not yet valid)
    /// ones, in the same order (lowest id first in each case). So a renewal uploaded under a
    /// new id, or as a wildcard, serves as soon as it is stored, and an expired certificate is
    /// served only while nothing valid covers the name. An IP address is served only by a
    /// certificate with that SAN IP address ([`Certificate::covers`]), never by a DNS name
    /// spelled like it.
    pub fn for_name(&self, name: &str) -> Option<&Arc<Certificate>> {
        let now = unix_now();
        let live = |c: &&Arc<Certificate>| c.valid_at(now);
        if ip_host(name).is_some() {
            let mut covering = self.certs.values().filter(|c| c.covers(name));
            return covering.clone().find(live).or_else(|| covering.next());
        }
        let exact =
            |c: &&Arc<Certificate>| c.hostnames.iter().any(|h| h.eq_ignore_ascii_case(name));
        let covers = |c: &&Arc<Certificate>| c.covers(name);
        let all = || self.certs.values();
        all()
            .filter(exact)
            .find(live)
            .or_else(|| all().filter(covers).find(live))
            .or_else(|| all().find(exact))
            .or_else(|| all().find(covers))
    }

    /// The certificates valid at Unix time `now` (not expired, not before their `notBefore`):
    /// what the API's coverage checks count (an expired certificate still serves, but it keeps
    /// no rule covered).
    pub fn valid_at(&self, now: i64) -> CertSnapshot {
        CertSnapshot {
            certs: self
                .certs
                .iter()
                .filter(|(_, c)| c.valid_at(now))
                .map(|(id, c)| (id.clone(), c.clone()))
                .collect(),
        }
    }

    /// The default certificate (id [`DEFAULT_ID`]).
    pub fn default_cert(&self) -> Option<&Arc<Certificate>> {
        self.certs.get(DEFAULT_ID)
    }
}

/// Errors of the store's writes.
#[derive(Debug, thiserror::Error)]
pub enum CertStoreError {
    /// The certificate was refused (400).
    #[error(transparent)]
    Invalid(#[from] CertError),
    /// `POST` with an id that exists (409).
    #[error("certificate {0:?} exists; rotate it with PUT /netlox/v1/config/cert/{0}")]
    Exists(String),
    /// No certificate has this id (404).
    #[error("no certificate has id {0:?}")]
    NotFound(String),
    /// A caller's check refused the change (409), e.g. a rule still needs the certificate.
    #[error("{0}")]
    InUse(String),
    /// The file could not be written or removed; nothing changed (500).
    #[error("persisting certificate {id:?}: {source}")]
    Persist {
        /// The certificate.
        id: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// The store. Share it as `Arc<CertStore>`.
pub struct CertStore {
    current: ArcSwap<CertSnapshot>,
    write: Mutex<()>,
    dir: Option<PathBuf>,
    /// Wakes [`CertStore::watch_expiry`] after every change (a stored permit: a change while it
    /// is not waiting is seen at its next wait).
    changed: tokio::sync::Notify,
    /// Files of `<state_dir>/certs` that [`CertStore::open`] skipped because they no longer
    /// load (sorted).
    unloaded: Vec<PathBuf>,
    /// Serializes the changes whose check reads both stores ([`CertStore::coverage_lock`]).
    coverage: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for CertStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertStore").field("dir", &self.dir).finish()
    }
}

/// Unix time now (seconds).
pub fn unix_now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

impl CertStore {
    /// A store without persistence (tests).
    pub fn in_memory() -> Self {
        Self::with(None, BTreeMap::new())
    }

    /// Opens `<state_dir>/certs` (created mode 0700 if missing) and restores every
    /// `<id>.json` in it. A certificate that has expired or is not valid yet is restored all
    /// the same, and served as it was before the restart, with a warning naming it, its
    /// hostnames and its `notAfter` (a restart must not turn an expiry into an outage: the TLS
    /// rules it covers would otherwise be dropped, or fall back to the `default` certificate).
    /// A file that no longer loads otherwise (not JSON, corrupt PEM, a key that is not the
    /// certificate's) is logged and skipped (left on disk); the daemon always starts.
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        let dir = state_dir.join("certs");
        fs::create_dir_all(&dir)?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))?;
        let mut certs = BTreeMap::new();
        let mut unloaded = Vec::new();
        for entry in fs::read_dir(&dir)? {
            let path = entry?.path();
            let Some(id) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            match restore(id, &path) {
                Ok((c, None)) => {
                    warn_if_expiring(&c);
                    certs.insert(c.id.clone(), Arc::new(c));
                }
                Ok((c, Some(why))) => {
                    warn_restored_out_of_validity(&c, &why);
                    certs.insert(c.id.clone(), Arc::new(c));
                }
                Err(e) => {
                    tracing::error!(file = %path.display(), error = %e,
                        "skipping a stored certificate that no longer loads");
                    unloaded.push(path);
                }
            }
        }
        tracing::info!(certs = certs.len(), dir = %dir.display(), "certificates restored");
        unloaded.sort();
        Ok(Self {
            unloaded,
            ..Self::with(Some(dir), certs)
        })
    }

    /// When certificate `id` was last written to the state dir: the modification time of
    /// `<state-dir>/certs/<id>.json` (every write, by the API or by staging, writes a fresh
    /// file and renames it into place, so its mtime is the time of that write). `None` for a
    /// store in memory, an unknown id, or a file system without modification times.
    pub fn stored_at(&self, id: &str) -> Option<std::time::SystemTime> {
        let dir = self.dir.as_ref()?;
        fs::metadata(dir.join(format!("{id}.json")))
            .and_then(|m| m.modified())
            .ok()
    }

    /// The stored certificate files [`CertStore::open`] skipped because they no longer load
    /// (empty for a store opened without one, or in memory).
    pub fn unloaded(&self) -> &[PathBuf] {
        &self.unloaded
    }

    fn with(dir: Option<PathBuf>, certs: BTreeMap<String, Arc<Certificate>>) -> Self {
        Self {
            current: ArcSwap::from_pointee(CertSnapshot { certs }),
            write: Mutex::new(()),
            dir,
            changed: tokio::sync::Notify::new(),
            unloaded: Vec::new(),
            coverage: tokio::sync::Mutex::new(()),
        }
    }

    /// Held across a change whose check reads the rules and the certificates together, from
    /// the check to the commit: storing a TLS rule (its host needs a certificate) and deleting
    /// or rotating a certificate (no TLS rule may be left without one). Without it, a rule
    /// checked against a certificate that a concurrent `DELETE` (checked against the rules
    /// before that rule was stored) then removed was stored with no certificate, both
    /// answered 200. Waiters are served in order (tokio's fair mutex).
    pub async fn coverage_lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.coverage.lock().await
    }

    /// The newest snapshot.
    pub fn snapshot(&self) -> Arc<CertSnapshot> {
        self.current.load_full()
    }

    /// Adds a new certificate (`id` minted when `None`); an existing id is
    /// [`CertStoreError::Exists`].
    pub fn create(
        &self,
        id: Option<String>,
        pem: CertPem,
    ) -> Result<Arc<Certificate>, CertStoreError> {
        let id = id.unwrap_or_else(|| format!("cert-{}", crate::rules::store::mint_uuid()));
        let cert = parse::parse(&id, pem, unix_now())?;
        let _w = self.write.lock();
        if self.current.load().certs.contains_key(&id) {
            return Err(CertStoreError::Exists(id));
        }
        self.put(Arc::new(cert))
    }

    /// Replaces certificate `id` (a rotation) once `allowed` accepts the change from the
    /// current snapshot to the one with the new certificate (else [`CertStoreError::InUse`]
    /// with its message: the API refuses a rotation that leaves a TLS rule without a
    /// certificate); an unknown id is [`CertStoreError::NotFound`].
    pub fn replace(
        &self,
        id: &str,
        pem: CertPem,
        allowed: impl FnOnce(&CertSnapshot, &CertSnapshot) -> Result<(), String>,
    ) -> Result<Arc<Certificate>, CertStoreError> {
        let cert = parse::parse(id, pem, unix_now())?;
        let _w = self.write.lock();
        let cur = self.current.load_full();
        if !cur.certs.contains_key(id) {
            return Err(CertStoreError::NotFound(id.to_string()));
        }
        let cert = Arc::new(cert);
        let mut certs = cur.certs.clone();
        certs.insert(id.to_string(), cert.clone());
        allowed(&cur, &CertSnapshot { certs }).map_err(CertStoreError::InUse)?;
        self.put(cert)
    }

    /// Adds or replaces certificate `id` (files staged at start).
    pub fn upsert(&self, id: &str, pem: CertPem) -> Result<Arc<Certificate>, CertStoreError> {
        let cert = parse::parse(id, pem, unix_now())?;
        let _w = self.write.lock();
        self.put(Arc::new(cert))
    }

    /// Deletes certificate `id` once `allowed` accepts the change from the current snapshot
    /// to the one without it (else [`CertStoreError::InUse`] with its message).
    pub fn delete(
        &self,
        id: &str,
        allowed: impl FnOnce(&CertSnapshot, &CertSnapshot) -> Result<(), String>,
    ) -> Result<(), CertStoreError> {
        let _w = self.write.lock();
        let cur = self.current.load_full();
        if !cur.certs.contains_key(id) {
            return Err(CertStoreError::NotFound(id.to_string()));
        }
        let mut certs = cur.certs.clone();
        certs.remove(id);
        let next = CertSnapshot { certs };
        allowed(&cur, &next).map_err(CertStoreError::InUse)?;
        if let Some(dir) = &self.dir {
            match fs::remove_file(dir.join(format!("{id}.json"))) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(CertStoreError::Persist {
                        id: id.to_string(),
                        source,
                    });
                }
            }
        }
        self.current.store(Arc::new(next));
        self.changed.notify_one();
        Ok(())
    }

    /// Persists and publishes `cert` (the write lock is held).
    fn put(&self, cert: Arc<Certificate>) -> Result<Arc<Certificate>, CertStoreError> {
        if let Some(dir) = &self.dir {
            save(dir, &cert).map_err(|source| CertStoreError::Persist {
                id: cert.id.clone(),
                source,
            })?;
        }
        warn_if_expiring(&cert);
        let mut certs = self.current.load().certs.clone();
        certs.insert(cert.id.clone(), cert.clone());
        self.current.store(Arc::new(CertSnapshot { certs }));
        self.changed.notify_one();
        Ok(cert)
    }

    /// Logs a warning the moment each certificate of the store expires while the daemon runs
    /// ([`warn_expired`]: its id, hostnames and `notAfter`), once per certificate and end of
    /// validity (a rotated certificate is watched anew), until `shutdown`. Certificates
    /// already expired when it starts were warned about at restore and are not warned again.
    /// Cost: one pass over the snapshot per expiry, per change of the store, and at most
    /// every [`EXPIRY_WATCH_MAX_SLEEP`] otherwise; it sleeps until the next `notAfter`.
    pub async fn watch_expiry(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let now = unix_now();
        let mut warned: std::collections::HashSet<(String, i64)> = self
            .snapshot()
            .certs
            .values()
            .filter(|c| c.not_after <= now)
            .map(|c| (c.id.clone(), c.not_after))
            .collect();
        loop {
            let now = unix_now();
            let snap = self.snapshot();
            warned.retain(|(id, at)| snap.certs.get(id).is_some_and(|c| c.not_after == *at));
            let mut next: Option<i64> = None;
            for c in snap.certs.values() {
                if c.not_after <= now {
                    if warned.insert((c.id.clone(), c.not_after)) {
                        warn_expired(c);
                    }
                } else {
                    next = Some(next.map_or(c.not_after, |n| n.min(c.not_after)));
                }
            }
            // `now` is whole seconds, truncated: waking `next - now` seconds later is at or
            // after `notAfter`, when the certificate counts as expired (`notAfter <= now`).
            let wait = next.map_or(EXPIRY_WATCH_MAX_SLEEP, |at| {
                std::time::Duration::from_secs(u64::try_from(at - now).unwrap_or(1).max(1))
                    .min(EXPIRY_WATCH_MAX_SLEEP)
            });
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
                () = self.changed.notified() => {}
            }
        }
    }
}

/// Longest [`CertStore::watch_expiry`] sleeps between two looks at the store (the wall clock
/// may jump while it sleeps on the monotonic one).
pub const EXPIRY_WATCH_MAX_SLEEP: std::time::Duration = std::time::Duration::from_secs(60);

/// The warning of a served certificate that has just expired.
pub fn warn_expired(cert: &Certificate) {
    tracing::warn!(cert_id = %cert.id, hostnames = ?cert.names(), not_after = cert.not_after,
        not_after_utc = %parse::rfc3339(cert.not_after),
        "TLS certificate expired; it is still served for the names no valid certificate covers, \
         and clients that verify it refuse the handshake: rotate it (PUT \
         /netlox/v1/config/cert/{{certId}})");
}

/// The warning of a stored certificate restored outside its validity (served as before the
/// restart).
fn warn_restored_out_of_validity(cert: &Certificate, why: &ValidityError) {
    let what = match why {
        ValidityError::Expired { .. } => "has expired",
        ValidityError::NotYetValid { .. } => "is not valid yet",
    };
    tracing::warn!(cert_id = %cert.id, hostnames = ?cert.names(), not_after = cert.not_after,
        not_after_utc = %parse::rfc3339(cert.not_after), not_before = cert.not_before,
        "restored a stored TLS certificate that {what}; it is served as before the restart, and \
         clients that verify it refuse the handshake: rotate it (PUT \
         /netlox/v1/config/cert/{{certId}})");
}

/// Logs a warning when `cert` expires within [`parse::EXPIRY_WARNING_SECS`].
pub fn warn_if_expiring(cert: &Certificate) {
    let left = cert.not_after - unix_now();
    if left < parse::EXPIRY_WARNING_SECS {
        tracing::warn!(cert_id = %cert.id, not_after = cert.not_after,
            not_after_utc = %parse::rfc3339(cert.not_after), days_left = left / 86_400,
            "TLS certificate expires within 14 days; rotate it (PUT /netlox/v1/config/cert/{{certId}})");
    }
}

/// A stored certificate, loaded whatever its validity (returned beside it).
fn restore(id: &str, path: &Path) -> Result<(Certificate, Option<ValidityError>), String> {
    let bytes = fs::read(path).map_err(|e| e.to_string())?;
    let pem: CertPem = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    parse::parse_stored(id, pem, unix_now()).map_err(|e| e.to_string())
}

/// Writes `<dir>/<id>.json` atomically, mode 0600 (temp file, fsync, rename, fsync dir).
fn save(dir: &Path, cert: &Certificate) -> std::io::Result<()> {
    let body = serde_json::to_vec_pretty(&cert.pem).map_err(std::io::Error::other)?;
    let file = dir.join(format!("{}.json", cert.id));
    let tmp = dir.join(format!(".{}.json.tmp", cert.id));
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, &file)?;
    fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pem(names: &[&str]) -> CertPem {
        crate::certs::testutil::self_signed(names, None)
    }

    #[test]
    fn certificates_persist_with_mode_0600_and_restore() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = CertStore::open(dir.path()).expect("open");
        store
            .create(Some("a".into()), pem(&["a.example"]))
            .expect("create");
        let minted = store.create(None, pem(&["*.b.example"])).expect("create");
        assert!(minted.id.starts_with("cert-") && minted.id.len() <= parse::MAX_ID_LEN);
        let mode = fs::metadata(dir.path().join("certs/a.json"))
            .expect("file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = CertStore::open(dir.path()).expect("reopen");
        let snap = again.snapshot();
        assert_eq!(snap.certs.len(), 2);
        assert_eq!(snap.for_name("A.example").map(|c| c.id.as_str()), Some("a"));
        assert_eq!(
            snap.for_name("x.b.example").map(|c| c.id.as_str()),
            Some(minted.id.as_str())
        );
        assert!(snap.for_name("c.example").is_none());
    }

    /// A certificate valid now is served before an expired one for the same name, whatever
    /// their ids and whether the valid one matches exactly or by wildcard (an expired `a`
    /// sorting first was served while a renewal `z` was stored); an expired one is served
    /// only when nothing valid covers the name; [`CertSnapshot::valid_at`] leaves it out. A
    /// certificate whose `notBefore` is still ahead is not valid either (the upload's 5
    /// minutes of skew made it so, and it was served, failing verifying clients).
    #[test]
    fn a_valid_certificate_is_served_before_an_expired_one() {
        use crate::certs::testutil::{expired, ip, with_sans};
        let now = unix_now();
        let valid = |id: &str, pem: CertPem| Arc::new(parse::parse(id, pem, now).expect("valid"));
        let mut snap = CertSnapshot::default();
        for c in [
            expired("a", &["s.example"]),
            valid("z", pem(&["*.example"])),
            expired("b", &["only.other"]),
            expired("c", &["10.0.0.5"]),
            valid("y", with_sans(vec![ip("10.0.0.5")], None)),
        ] {
            snap.certs.insert(c.id.clone(), c);
        }
        // Valid in two minutes (an upload allows 5 minutes of clock skew): not valid now.
        let mut early = parse::parse("x", pem(&["s.example"]), now).expect("valid");
        early.not_before = now + 120;
        snap.certs.insert("x".into(), Arc::new(early));
        let id = |name: &str| snap.for_name(name).map(|c| c.id.clone());
        assert_eq!(
            id("s.example").as_deref(),
            Some("z"),
            "the valid wildcard, not the expired or the early exact names"
        );
        assert_eq!(
            id("only.other").as_deref(),
            Some("b"),
            "nothing valid: the expired"
        );
        assert_eq!(id("10.0.0.5").as_deref(), Some("y"));
        let live = snap.valid_at(now);
        assert_eq!(live.certs.keys().collect::<Vec<_>>(), ["y", "z"]);
    }

    #[test]
    fn create_refuses_an_existing_id_and_replace_an_unknown_one() {
        let store = CertStore::in_memory();
        store
            .create(Some("a".into()), pem(&["a.example"]))
            .expect("create");
        assert!(matches!(
            store.create(Some("a".into()), pem(&["a.example"])),
            Err(CertStoreError::Exists(_))
        ));
        assert!(matches!(
            store.replace("zz", pem(&["a.example"]), |_, _| Ok(())),
            Err(CertStoreError::NotFound(_))
        ));
        let old = store.snapshot().certs["a"].key.clone();
        store
            .replace("a", pem(&["a.example"]), |_, _| Ok(()))
            .expect("rotate");
        assert!(!Arc::ptr_eq(&old, &store.snapshot().certs["a"].key));
    }

    #[test]
    fn delete_asks_the_caller_first() {
        let store = CertStore::in_memory();
        store
            .create(Some("a".into()), pem(&["a.example"]))
            .expect("create");
        assert!(matches!(
            store.delete("a", |_, _| Err("rule x needs it".into())),
            Err(CertStoreError::InUse(_))
        ));
        store.delete("a", |_, _| Ok(())).expect("delete");
        assert!(store.snapshot().certs.is_empty());
    }

    /// Writes the stored file of certificate `id` for `host`, expired at `not_after`, under
    /// `state`'s `certs/` (created); returns that directory.
    fn stored_expired(
        state: &std::path::Path,
        id: &str,
        host: &str,
        not_after: time::OffsetDateTime,
    ) -> std::path::PathBuf {
        let certs = state.join("certs");
        fs::create_dir_all(&certs).expect("dir");
        let old = crate::certs::testutil::self_signed(&[host], Some(not_after));
        fs::write(
            certs.join(format!("{id}.json")),
            serde_json::to_vec(&old).expect("json"),
        )
        .expect("write");
        certs
    }

    /// A stored certificate that has expired is restored (it was skipped, and the TLS rules it
    /// covered were dropped at restart) with a warning naming its id, hostnames and notAfter;
    /// a corrupt one is still skipped.
    #[test]
    fn an_expired_stored_certificate_is_restored_with_a_warning() {
        let dir = tempfile::tempdir().expect("tmp");
        let past = time::OffsetDateTime::now_utc() - time::Duration::hours(1);
        let certs = stored_expired(dir.path(), "s2", "s2.example.com", past);
        fs::write(
            certs.join("bad.json"),
            b"{\"certPem\": \"x\", \"keyPem\": \"y\"}",
        )
        .expect("write");
        let (store, log) =
            crate::telemetry::LogBuf::capture(|| CertStore::open(dir.path()).expect("open"));
        let snap = store.snapshot();
        let c = snap.for_name("s2.example.com").expect("restored");
        assert_eq!(c.id, "s2");
        assert_eq!(c.not_after, past.unix_timestamp());
        assert_eq!(snap.certs.len(), 1, "the corrupt one is skipped");
        let want = format!(
            "restored a stored TLS certificate that has expired; it is served as before the \
             restart, and clients that verify it refuse the handshake: rotate it (PUT \
             /netlox/v1/config/cert/{{certId}}) cert_id=s2 hostnames=[\"s2.example.com\"] \
             not_after={}",
            past.unix_timestamp()
        );
        assert!(
            log.lines()
                .any(|l| l.contains(" WARN ") && l.contains(&want)),
            "{log}"
        );
        assert!(
            log.lines().any(|l| l.contains("ERROR")
                && l.contains("skipping a stored certificate that no longer loads")
                && l.contains("bad.json")),
            "{log}"
        );
    }

    /// The watcher warns when a served certificate expires while the daemon runs, once, naming
    /// it; one expired before it started is not warned again.
    #[tokio::test]
    async fn the_expiry_watcher_warns_when_a_certificate_expires() {
        use tracing::instrument::WithSubscriber as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        let dir = tempfile::tempdir().expect("tmp");
        let past = time::OffsetDateTime::now_utc() - time::Duration::hours(1);
        stored_expired(dir.path(), "old", "old.example", past);
        let store = Arc::new(CertStore::open(dir.path()).expect("open"));
        let buf = crate::telemetry::LogBuf::default();
        let layer = buf.layer();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let watcher = store
            .clone()
            .watch_expiry(shutdown.clone())
            .with_subscriber(tracing_subscriber::registry().with(layer));
        let check = async {
            // Created after the watcher's first look (it then had nothing to wait for and
            // slept its longest): the change wakes it to watch this one.
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let soon = time::OffsetDateTime::now_utc() + time::Duration::seconds(2);
            let c = store
                .create(
                    Some("soon".into()),
                    crate::certs::testutil::self_signed(&["soon.example"], Some(soon)),
                )
                .expect("create");
            let want = format!(
                "TLS certificate expired; it is still served for the names no valid certificate \
                 covers, and clients that verify it refuse the handshake: rotate it (PUT \
                 /netlox/v1/config/cert/{{certId}}) \
                 cert_id=soon hostnames=[\"soon.example\"] not_after={}",
                c.not_after
            );
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !buf.text().contains(&want) {
                assert!(std::time::Instant::now() < deadline, "{}", buf.text());
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            assert!(unix_now() >= c.not_after, "warned at expiry, not before");
            // Once: the next looks do not warn again.
            tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
            shutdown.cancel();
        };
        let ((), ()) = tokio::join!(watcher, check);
        let text = buf.text();
        assert_eq!(text.matches("TLS certificate expired").count(), 1, "{text}");
        assert!(
            !text.contains("cert_id=old"),
            "warned at restore only: {text}"
        );
    }
}
