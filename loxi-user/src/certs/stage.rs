//! Certificates staged as files (LoxiLB's layout under `/opt/loxilb/cert/`), loaded once at
//! start into the [`CertStore`] (and persisted like posted ones):
//!
//! - `<dir>/server.crt` + `<dir>/server.key` → certificate `default` (served when SNI is
//!   absent or names no rule's host);
//! - `<dir>/<name>/server.crt` + `<dir>/<name>/server.key` → certificate `<name>` (its
//!   hostnames from the certificate, as for the API).
//!
//! A missing directory stages nothing; a path that is not a directory, or a directory that
//! cannot be listed, is an error (the daemon does not start: `--cert-dir` would otherwise be
//! silently inert); a pair that does not load, or half a pair, is logged and skipped.
//!
//! A staged pair whose id is already in the store (restored from the state dir) is compared
//! with it ([`plan`]): the same certificate (leaf and chain) is left as stored; a stored
//! certificate written after the staged files were last modified (rotated through the API
//! since) is kept, with a warning naming the file, so a restart never undoes a rotation;
//! staged files modified after the stored certificate was written replace it, once the
//! caller's check accepts the change ([`apply_replacements`]: the daemon refuses one that
//! would leave a restored TLS rule without a certificate, as the API refuses such a `PUT`).

use std::io::{Error, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use super::parse::{self, CertPem, Certificate};
use super::store::{CertSnapshot, CertStore, CertStoreError, DEFAULT_ID, unix_now};

/// A pair read from the cert dir that loads (checked as the API checks a posted certificate).
#[derive(Debug)]
pub struct Staged {
    /// The certificate's id (`default`, or the subdirectory's name).
    pub id: String,
    /// The `server.crt` file.
    pub crt: PathBuf,
    /// The pair as read.
    pub pem: CertPem,
    /// The certificate, checked.
    pub cert: Arc<Certificate>,
    /// The later of the two files' modification times (`None` when the file system has none).
    pub modified: Option<SystemTime>,
}

/// What start does with a [`Staged`] pair, given the store ([`plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// No stored certificate has its id: added.
    New,
    /// The stored certificate is the staged one (the same leaf and chain): nothing to do.
    Unchanged,
    /// The stored certificate differs and was written after the staged files were last
    /// modified (a rotation through the API since they were staged): kept.
    StoredNewer {
        /// When the stored certificate was written.
        stored_at: SystemTime,
    },
    /// The stored certificate differs and is older than the staged files (or its age is
    /// unknown): replaced, if the caller's check accepts it.
    Newer,
}

/// Reads every pair found in `dir` (the top pair first, then subdirectories by name); a pair
/// that does not load, or half a pair, is logged and skipped, and so is a `default/`
/// subdirectory beside a top pair that loads (both would be certificate `default`; an error
/// names both).
/// None when `dir` does not exist.
///
/// # Errors
/// `dir` exists but is not a directory (`NotADirectory`), or cannot be read.
pub fn read_dir(dir: &Path) -> Result<Vec<Staged>, Error> {
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
        Ok(m) if !m.is_dir() => {
            return Err(Error::new(
                ErrorKind::NotADirectory,
                "not a directory (staged certificates are <dir>/server.crt + server.key and \
                 <dir>/<name>/server.crt + server.key)",
            ));
        }
        Ok(_) => {}
    }
    let entries = std::fs::read_dir(dir)?;
    let mut staged = Vec::new();
    staged.extend(read_pair(dir, DEFAULT_ID));
    let top_staged = !staged.is_empty();
    let mut subdirs: Vec<_> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    subdirs.sort();
    let top = dir.join("server.crt");
    for sub in subdirs {
        let Some(name) = sub.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if name == DEFAULT_ID && top_staged {
            // Both name certificate `default`: one would replace the other at every start,
            // and the next start would call the survivor a rotation through the API.
            tracing::error!(
                top = %top.display(),
                subdirectory = %sub.display(),
                "two staged pairs for certificate \"default\": <dir>/server.crt + server.key \
                 and <dir>/default/; the subdirectory is skipped (LoxiLB's place for the \
                 default certificate is the top pair): remove one of them"
            );
            continue;
        }
        staged.extend(read_pair(&sub, name));
    }
    Ok(staged)
}

/// What to do with `s` given `store` (see [`Plan`]).
pub fn plan(store: &CertStore, s: &Staged) -> Plan {
    let snap = store.snapshot();
    let Some(stored) = snap.certs.get(&s.id) else {
        return Plan::New;
    };
    // The whole served chain: the same leaf with another chain (an intermediate appended to
    // server.crt) is a change to apply, not the stored certificate.
    if stored.key.cert == s.cert.key.cert {
        return Plan::Unchanged;
    }
    match (store.stored_at(&s.id), s.modified) {
        (Some(stored_at), Some(modified)) if stored_at > modified => {
            Plan::StoredNewer { stored_at }
        }
        _ => Plan::Newer,
    }
}

/// Adds the staged pairs whose id the store lacks ([`Plan::New`]), logs those left as they are
/// ([`Plan::Unchanged`], and [`Plan::StoredNewer`] with a warning naming the file and what to
/// do), and returns the ones that would replace a stored certificate ([`Plan::Newer`]), for
/// [`apply_replacements`] once the caller can check them. Returns the ids added too.
pub fn apply_new(store: &CertStore, staged: Vec<Staged>) -> (Vec<String>, Vec<Staged>) {
    let mut added = Vec::new();
    let mut replacements = Vec::new();
    for s in staged {
        match plan(store, &s) {
            Plan::New => {
                if let Some(id) = upsert(store, &s) {
                    added.push(id);
                }
            }
            Plan::Unchanged => {
                tracing::info!(cert_id = %s.id, file = %s.crt.display(),
                    "staged certificate is the stored one; nothing to do");
            }
            Plan::StoredNewer { stored_at } => {
                tracing::warn!(cert_id = %s.id, file = %s.crt.display(),
                    staged_hostnames = ?s.cert.names(),
                    staged_modified_utc = %s.modified.map_or_else(String::new, utc),
                    stored_at_utc = %utc(stored_at),
                    "staged certificate NOT applied: the stored certificate {id:?} (served \
                     before the restart) was written after this file was last modified, so it \
                     was rotated through the API since; it is kept and served. To serve the \
                     staged file instead, rotate with PUT /netlox/v1/config/cert/{id} (or \
                     replace the file, or `touch` it, and restart); to silence this, put the \
                     served certificate in the file or remove the file",
                    id = s.id);
            }
            Plan::Newer => replacements.push(s),
        }
    }
    (added, replacements)
}

/// Replaces each stored certificate by its staged pair once `allowed` accepts the change from
/// the current snapshot to the one with the staged certificate (as [`CertStore::replace`]);
/// a refused one is not applied (the stored certificate stays, and is served) and is warned
/// about naming the file, the reason `allowed` gave and what to do. Returns the ids replaced.
pub fn apply_replacements(
    store: &CertStore,
    replacements: Vec<Staged>,
    allowed: impl Fn(&CertSnapshot, &CertSnapshot) -> Result<(), String>,
) -> Vec<String> {
    let mut replaced = Vec::new();
    for s in replacements {
        match store.replace(&s.id, s.pem.clone(), &allowed) {
            Ok(c) => {
                tracing::info!(cert_id = %c.id, hostnames = ?c.names(), file = %s.crt.display(),
                    staged_modified_utc = %s.modified.map_or_else(String::new, utc),
                    "staged certificate loaded: it replaces the stored certificate, which was \
                     written before this file was last modified");
                replaced.push(c.id.clone());
            }
            Err(CertStoreError::InUse(why)) => {
                tracing::warn!(cert_id = %s.id, file = %s.crt.display(),
                    staged_hostnames = ?s.cert.names(),
                    "staged certificate NOT applied, although newer than the stored one: \
                     {why}. The stored certificate {id:?} is kept and served. Stage a \
                     certificate that also covers that rule's host (then restart), or delete \
                     the rule and restart, or rotate with PUT /netlox/v1/config/cert/{id}, which \
                     checks every rule",
                    id = s.id);
            }
            Err(e) => {
                tracing::error!(cert_id = %s.id, file = %s.crt.display(), error = %e,
                    "staged certificate refused; the stored one is kept");
            }
        }
    }
    replaced
}

/// `snapshot` with every one of `replacements` in place of the certificate of its id: what the
/// store will serve if [`apply_replacements`] applies them all. The daemon restores a rule
/// that one of them covers (whether each applies is decided once the rules are restored).
pub fn with_replacements(snapshot: &CertSnapshot, replacements: &[Staged]) -> CertSnapshot {
    let mut certs = snapshot.certs.clone();
    for s in replacements {
        certs.insert(s.id.clone(), s.cert.clone());
    }
    CertSnapshot { certs }
}

/// Stages every pair found in `dir` with no rule to check ([`read_dir`], [`apply_new`], then
/// [`apply_replacements`] accepting every change); returns the ids loaded (none when `dir`
/// does not exist). The daemon runs the steps itself, restoring its rules in between.
///
/// # Errors
/// `dir` exists but is not a directory (`NotADirectory`), or cannot be read.
pub fn stage_dir(store: &CertStore, dir: &Path) -> Result<Vec<String>, Error> {
    let (mut loaded, replacements) = apply_new(store, read_dir(dir)?);
    loaded.extend(apply_replacements(store, replacements, |_, _| Ok(())));
    Ok(loaded)
}

/// `t` as RFC 3339 UTC (whole seconds).
fn utc(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    parse::rfc3339(secs)
}

fn upsert(store: &CertStore, s: &Staged) -> Option<String> {
    match store.upsert(&s.id, s.pem.clone()) {
        Ok(c) => {
            tracing::info!(cert_id = %c.id, hostnames = ?c.names(), file = %s.crt.display(),
                "staged certificate loaded");
            Some(c.id.clone())
        }
        Err(e) => {
            tracing::error!(file = %s.crt.display(), error = %e, "staged certificate refused");
            None
        }
    }
}

fn read_pair(dir: &Path, id: &str) -> Option<Staged> {
    let (crt, key) = (dir.join("server.crt"), dir.join("server.key"));
    match (crt.is_file(), key.is_file()) {
        (true, true) => {}
        (false, false) => return None,
        // Half a pair is a staging mistake, not an unrelated directory: said, not skipped
        // silently.
        (true, false) | (false, true) => {
            let (have, missing) = if crt.is_file() {
                (&crt, &key)
            } else {
                (&key, &crt)
            };
            tracing::error!(file = %have.display(), missing = %missing.display(),
                "staged certificate refused: half a pair (server.crt and server.key go together)");
            return None;
        }
    }
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
    let pem = match (read(&crt), read(&key)) {
        (Ok(cert_pem), Ok(key_pem)) => CertPem {
            cert_pem,
            key_pem,
            chain_pem: None,
        },
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "cannot read a staged certificate");
            return None;
        }
    };
    let modified = [&crt, &key]
        .iter()
        .filter_map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .max();
    match parse::parse(id, pem.clone(), unix_now()) {
        Ok(cert) => Some(Staged {
            id: id.to_string(),
            crt,
            pem,
            cert: Arc::new(cert),
            modified,
        }),
        Err(e) => {
            // The file at fault: the key's refusals (none, encrypted, several, not the
            // certificate's) name server.key, the others server.crt.
            let file = if e.field() == "keyPem" { &key } else { &crt };
            tracing::error!(file = %file.display(), error = %e, "staged certificate refused");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path, name: &str) {
        std::fs::create_dir_all(dir).expect("dir");
        let pem = crate::certs::testutil::self_signed(&[name], None);
        std::fs::write(dir.join("server.crt"), pem.cert_pem).expect("crt");
        std::fs::write(dir.join("server.key"), pem.key_pem).expect("key");
    }

    #[test]
    fn the_top_pair_is_the_default_and_subdirectories_are_named_certificates() {
        let dir = tempfile::tempdir().expect("tmp");
        write_pair(dir.path(), "lb.example");
        write_pair(&dir.path().join("api.example"), "api.example");
        std::fs::create_dir_all(dir.path().join("empty")).expect("dir");
        let store = CertStore::in_memory();
        assert_eq!(
            stage_dir(&store, dir.path()).expect("staged"),
            ["default", "api.example"]
        );
        let snap = store.snapshot();
        assert_eq!(
            snap.default_cert().map(|c| c.hostnames[0].as_str()),
            Some("lb.example")
        );
        assert_eq!(
            snap.for_name("api.example").map(|c| c.id.as_str()),
            Some("api.example")
        );
    }

    /// A `default/` subdirectory beside the top pair is skipped with an error naming both
    /// (both were staged as `default`, the last silently winning, and the next start warned of
    /// a rotation through the API that never happened); alone, or beside half a top pair, it
    /// is the `default`.
    #[test]
    fn a_default_subdirectory_beside_the_top_pair_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        write_pair(dir.path(), "top.example");
        write_pair(&dir.path().join("default"), "sub.example");
        let store = CertStore::in_memory();
        let (staged, text) =
            crate::telemetry::LogBuf::capture(|| stage_dir(&store, dir.path()).expect("staged"));
        assert_eq!(staged, ["default"]);
        assert_eq!(
            store.snapshot().default_cert().map(|c| c.hostnames.clone()),
            Some(vec!["top.example".to_string()])
        );
        assert!(
            text.lines().any(|l| l.contains("ERROR")
                && l.contains("two staged pairs for certificate \"default\"")
                && l.contains(&dir.path().join("default").display().to_string())),
            "{text}"
        );
        let alone = tempfile::tempdir().expect("tmp");
        write_pair(&alone.path().join("default"), "sub.example");
        let store = CertStore::in_memory();
        assert_eq!(
            stage_dir(&store, alone.path()).expect("staged"),
            ["default"]
        );
        // Beside half a top pair (refused on its own), `default/` is the `default`.
        let half = tempfile::tempdir().expect("tmp");
        write_pair(half.path(), "top.example");
        std::fs::remove_file(half.path().join("server.key")).expect("rm key");
        write_pair(&half.path().join("default"), "sub.example");
        let store = CertStore::in_memory();
        assert_eq!(stage_dir(&store, half.path()).expect("staged"), ["default"]);
        assert_eq!(
            store.snapshot().default_cert().map(|c| c.hostnames.clone()),
            Some(vec!["sub.example".to_string()])
        );
    }

    /// Half a pair (a certificate without its key, a key without its certificate) stages
    /// nothing and is logged as an error naming the missing file (it was skipped silently).
    #[test]
    fn half_a_pair_is_refused_and_logged() {
        let dir = tempfile::tempdir().expect("tmp");
        write_pair(&dir.path().join("half"), "half.example");
        std::fs::remove_file(dir.path().join("half/server.key")).expect("rm key");
        write_pair(&dir.path().join("keyonly"), "keyonly.example");
        std::fs::remove_file(dir.path().join("keyonly/server.crt")).expect("rm crt");
        let store = CertStore::in_memory();
        let (staged, text) =
            crate::telemetry::LogBuf::capture(|| stage_dir(&store, dir.path()).expect("staged"));
        assert!(staged.is_empty(), "{staged:?}");
        for missing in ["half/server.key", "keyonly/server.crt"] {
            assert!(
                text.lines().any(|l| l.contains("ERROR")
                    && l.contains("half a pair")
                    && l.contains(missing)),
                "{missing}: {text}"
            );
        }
    }

    /// A pair refused for its key names server.key as the file at fault, one refused for its
    /// certificate names server.crt.
    #[test]
    fn a_refused_pair_names_the_file_at_fault() {
        let dir = tempfile::tempdir().expect("tmp");
        write_pair(&dir.path().join("badkey"), "badkey.example");
        std::fs::write(dir.path().join("badkey/server.key"), "no key here\n").expect("key");
        write_pair(&dir.path().join("badcrt"), "badcrt.example");
        std::fs::write(dir.path().join("badcrt/server.crt"), "no cert here\n").expect("crt");
        let store = CertStore::in_memory();
        let (staged, text) =
            crate::telemetry::LogBuf::capture(|| stage_dir(&store, dir.path()).expect("staged"));
        assert!(staged.is_empty(), "{staged:?}");
        let line = |file: &str| {
            text.lines()
                .find(|l| l.contains("staged certificate refused") && l.contains(file))
                .unwrap_or_default()
                .to_owned()
        };
        let key_line = line("badkey/server.key");
        assert!(
            key_line.contains("keyPem: no private key (PKCS#8, PKCS#1 or SEC1 PEM block)"),
            "{text}"
        );
        assert!(!text.contains("badkey/server.crt"), "{text}");
        let crt_line = line("badcrt/server.crt");
        assert!(crt_line.contains("certPem: no CERTIFICATE block"), "{text}");
    }

    #[test]
    fn a_missing_directory_stages_nothing_and_a_file_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = CertStore::in_memory();
        let none = stage_dir(&store, &dir.path().join("absent")).expect("missing is fine");
        assert!(none.is_empty());
        let file = dir.path().join("a-file");
        std::fs::write(&file, "x").expect("write");
        let e = stage_dir(&store, &file).expect_err("a file");
        assert_eq!(e.kind(), ErrorKind::NotADirectory);
        assert!(e.to_string().starts_with("not a directory"), "{e}");
    }

    fn set_mtime(dir: &Path, t: SystemTime) {
        for f in ["server.crt", "server.key"] {
            std::fs::File::options()
                .write(true)
                .open(dir.join(f))
                .and_then(|f| f.set_modified(t))
                .expect("mtime");
        }
    }

    /// A staged pair differing from the stored certificate: kept out when the stored one was
    /// written after the files' mtime, planned as a replacement when the files are newer, and
    /// a replacement the caller refuses leaves the stored certificate, warned naming the file
    /// and the reason; the stored certificate itself is `Unchanged`.
    #[test]
    fn the_newer_of_a_staged_pair_and_the_stored_certificate_wins() {
        let state = tempfile::tempdir().expect("tmp");
        let dir = tempfile::tempdir().expect("tmp");
        let store = CertStore::open(state.path()).expect("open");
        store
            .upsert(
                DEFAULT_ID,
                crate::certs::testutil::self_signed(&["stored.example"], None),
            )
            .expect("stored");
        write_pair(dir.path(), "staged.example");
        let hour = std::time::Duration::from_secs(3600);
        set_mtime(dir.path(), SystemTime::now() - hour);
        let staged = read_dir(dir.path()).expect("read");
        assert!(matches!(plan(&store, &staged[0]), Plan::StoredNewer { .. }));
        let (added, replacements) = apply_new(&store, staged);
        assert!(added.is_empty() && replacements.is_empty());
        set_mtime(dir.path(), SystemTime::now() + hour);
        let staged = read_dir(dir.path()).expect("read");
        assert_eq!(plan(&store, &staged[0]), Plan::Newer);
        let (_, replacements) = apply_new(&store, staged);
        let (replaced, text) = crate::telemetry::LogBuf::capture(|| {
            apply_replacements(&store, replacements, |_, _| Err("rule r needs it".into()))
        });
        assert!(replaced.is_empty());
        let served = store.snapshot();
        assert_eq!(
            served.default_cert().map(|c| c.hostnames.clone()),
            Some(vec!["stored.example".to_string()])
        );
        let crt = dir.path().join("server.crt").display().to_string();
        assert!(
            text.lines().any(|l| l.contains("WARN")
                && l.contains("NOT applied, although newer than the stored one: rule r needs it")
                && l.contains(&crt)),
            "{text}"
        );
        let (_, replacements) = apply_new(&store, read_dir(dir.path()).expect("read"));
        assert_eq!(
            apply_replacements(&store, replacements, |_, _| Ok(())),
            ["default"]
        );
        let staged = read_dir(dir.path()).expect("read");
        assert_eq!(plan(&store, &staged[0]), Plan::Unchanged);
    }

    /// A staged pair with the stored leaf but another chain (the intermediate appended to
    /// `server.crt`) is not the stored certificate: newer, it replaces the stored one, and the
    /// chain is served (the leaf alone was compared, so the chain was never updated and the
    /// log said the staged certificate was the stored one).
    #[test]
    fn a_staged_chain_differing_from_the_stored_one_is_a_change() {
        let state = tempfile::tempdir().expect("tmp");
        let dir = tempfile::tempdir().expect("tmp");
        let store = CertStore::open(state.path()).expect("open");
        let (leaf, ca) = crate::certs::testutil::ca_and_leaf("Staged CA");
        store.upsert(DEFAULT_ID, leaf.clone()).expect("stored");
        std::fs::write(dir.path().join("server.crt"), leaf.cert_pem + &ca).expect("crt");
        std::fs::write(dir.path().join("server.key"), leaf.key_pem).expect("key");
        set_mtime(
            dir.path(),
            SystemTime::now() + std::time::Duration::from_secs(3600),
        );
        let staged = read_dir(dir.path()).expect("read");
        assert_eq!(plan(&store, &staged[0]), Plan::Newer);
        assert_eq!(stage_dir(&store, dir.path()).expect("staged"), ["default"]);
        let served = store.snapshot();
        assert_eq!(served.default_cert().map(|c| c.key.cert.len()), Some(2));
        let staged = read_dir(dir.path()).expect("read");
        assert_eq!(plan(&store, &staged[0]), Plan::Unchanged);
    }
}
