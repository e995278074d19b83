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

use std::io::{Error, ErrorKind};
use std::path::Path;

use super::parse::CertPem;
use super::store::{CertStore, DEFAULT_ID};

/// Stages every pair found in `dir`; returns the ids loaded (none when `dir` does not exist).
///
/// # Errors
/// `dir` exists but is not a directory (`NotADirectory`), or cannot be read.
pub fn stage_dir(store: &CertStore, dir: &Path) -> Result<Vec<String>, Error> {
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
    let mut loaded = Vec::new();
    stage_pair(store, dir, DEFAULT_ID, &mut loaded);
    let mut subdirs: Vec<_> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    subdirs.sort();
    for sub in subdirs {
        if let Some(name) = sub.file_name().and_then(|n| n.to_str()) {
            stage_pair(store, &sub, name, &mut loaded);
        }
    }
    Ok(loaded)
}

fn stage_pair(store: &CertStore, dir: &Path, id: &str, loaded: &mut Vec<String>) {
    let (crt, key) = (dir.join("server.crt"), dir.join("server.key"));
    match (crt.is_file(), key.is_file()) {
        (true, true) => {}
        (false, false) => return,
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
            return;
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
            return;
        }
    };
    match store.upsert(id, pem) {
        Ok(c) => {
            tracing::info!(cert_id = %c.id, hostnames = ?c.names(), file = %crt.display(),
                "staged certificate loaded");
            loaded.push(c.id.clone());
        }
        Err(e) => {
            // The file at fault: the key's refusals (none, encrypted, several, not the
            // certificate's) name server.key, the others server.crt.
            let file = match &e {
                super::CertStoreError::Invalid(c) if c.field() == "keyPem" => &key,
                _ => &crt,
            };
            tracing::error!(file = %file.display(), error = %e, "staged certificate refused");
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
}
