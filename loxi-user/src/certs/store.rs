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

use super::parse::{self, CertError, CertPem, Certificate, name_matches};

/// The id of the certificate served when the client's SNI is absent or names no rule's host.
pub const DEFAULT_ID: &str = "default";

/// Every certificate, by id.
#[derive(Debug, Default)]
pub struct CertSnapshot {
    /// Certificates by id.
    pub certs: BTreeMap<String, Arc<Certificate>>,
}

impl CertSnapshot {
    /// The certificate serving host `name`: one naming it exactly, else one whose wildcard
    /// covers it (lowest id first in each case).
    pub fn for_name(&self, name: &str) -> Option<&Arc<Certificate>> {
        let exact = self
            .certs
            .values()
            .find(|c| c.hostnames.iter().any(|h| h.eq_ignore_ascii_case(name)));
        exact.or_else(|| {
            self.certs
                .values()
                .find(|c| c.hostnames.iter().any(|h| name_matches(h, name)))
        })
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
    /// `<id>.json` in it. A file that no longer parses or whose certificate expired is logged
    /// and skipped (left on disk); the daemon always starts.
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        let dir = state_dir.join("certs");
        fs::create_dir_all(&dir)?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))?;
        let mut certs = BTreeMap::new();
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
                Ok(c) => {
                    warn_if_expiring(&c);
                    certs.insert(c.id.clone(), Arc::new(c));
                }
                Err(e) => tracing::error!(file = %path.display(), error = %e,
                    "skipping a stored certificate that no longer loads"),
            }
        }
        tracing::info!(certs = certs.len(), dir = %dir.display(), "certificates restored");
        Ok(Self::with(Some(dir), certs))
    }

    fn with(dir: Option<PathBuf>, certs: BTreeMap<String, Arc<Certificate>>) -> Self {
        Self {
            current: ArcSwap::from_pointee(CertSnapshot { certs }),
            write: Mutex::new(()),
            dir,
        }
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
        Ok(cert)
    }
}

/// Logs a warning when `cert` expires within [`parse::EXPIRY_WARNING_SECS`].
pub fn warn_if_expiring(cert: &Certificate) {
    let left = cert.not_after - unix_now();
    if left < parse::EXPIRY_WARNING_SECS {
        tracing::warn!(cert_id = %cert.id, not_after = cert.not_after, days_left = left / 86_400,
            "TLS certificate expires within 14 days; rotate it (PUT /netlox/v1/config/cert/{{certId}})");
    }
}

fn restore(id: &str, path: &Path) -> Result<Certificate, String> {
    let bytes = fs::read(path).map_err(|e| e.to_string())?;
    let pem: CertPem = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    parse::parse(id, pem, unix_now()).map_err(|e| e.to_string())
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
}
