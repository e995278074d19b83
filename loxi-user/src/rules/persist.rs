//! The state file: `<state-dir>/rules.json`, written atomically (temp file, fsync, rename,
//! fsync of the directory) and read once at start.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::model::LbRule;

/// One rule as the state file holds it: its service id and the rule as validated.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PersistedRule {
    /// Stable service id.
    pub id: u32,
    /// The rule.
    pub rule: LbRule,
}

/// The borrowed form [`save`] writes (same JSON as [`PersistedRule`]).
#[derive(serde::Serialize)]
struct RuleRef<'a> {
    id: u32,
    rule: &'a LbRule,
}

/// Errors writing the state file.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// Creating the state directory failed.
    #[error("state dir {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Writing or renaming the file failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Creates `state_dir` if needed and returns the path of the rules file in it.
pub fn state_file(state_dir: &Path) -> Result<PathBuf, PersistError> {
    fs::create_dir_all(state_dir).map_err(|source| PersistError::Dir {
        path: state_dir.to_path_buf(),
        source,
    })?;
    Ok(state_dir.join("rules.json"))
}

/// On-disk format, versioned so later changes can migrate.
#[derive(serde::Serialize, serde::Deserialize)]
struct StateFile<R> {
    version: u32,
    rules: Vec<R>,
}

/// One rule read from the state file: parsed, and as it was stored (the JSON text's value), so
/// a rule that is dropped at restore can be kept as it was ([`save_dropped`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedRule {
    /// The rule, parsed.
    pub parsed: PersistedRule,
    /// The rule's entry in the file (`{"id", "rule"}`), as stored.
    pub stored: serde_json::Value,
}

/// A rule entry of the state file that does not parse as one (a hand edit: an unknown or
/// misspelt field, a wrong type): dropped at restore and kept as stored, as a rule that no
/// longer validates is, while the file's other rules are restored.
#[derive(Debug, Clone, PartialEq)]
pub struct UnparsedRule {
    /// The entry's `id`, when it has a numeric one (0 otherwise).
    pub id: u32,
    /// The entry, as stored.
    pub stored: serde_json::Value,
    /// Why it does not parse (serde's message, naming the field).
    pub error: String,
}

/// Reads the rules file: one result per rule entry, an entry that does not parse as a rule
/// being an [`UnparsedRule`]. A missing file is an empty list; an unreadable or corrupt one
/// (not JSON, or not the state file's shape: no `rules` list) is moved aside to
/// `rules.json.corrupt-<unix secs>` with an error log, and an empty list is returned.
///
/// The file's keys are read as a rule's are: `version`, `rules` and each entry's `id` and
/// `rule` in any ASCII case (`Rules`); each rule is read by `parse` (the daemon's reads its
/// keys as a `POST`'s are, `crate::api::fields::restored_rule`). An entry that names a key
/// twice anywhere (`"port"` twice in one object), as a `POST` naming one twice is refused, or
/// that has a key other than `id` and `rule`, is an [`UnparsedRule`] naming it. A key of the file other than `version` and `rules` is logged as
/// an error naming it (the next rewrite of `rules.json` does not keep it). Whenever the file
/// holds something a rewrite would not keep (such a key, a repeated key), it is first copied
/// as read to `rules.json.as-read-<unix secs>`, so nothing of it is lost.
pub fn load(file: &Path, parse: RuleParser<'_>) -> Vec<Result<LoadedRule, UnparsedRule>> {
    let bytes = match fs::read(file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::error!(file = %file.display(), error = %e, "cannot read the rules file");
            return Vec::new();
        }
    };
    let StateRead {
        entries,
        unknown,
        repeated,
    } = match read_state(&bytes) {
        Ok(r) => r,
        Err(e) => {
            let aside = file.with_extension(format!("json.corrupt-{}", unix_secs()));
            let moved = fs::rename(file, &aside);
            tracing::error!(
                file = %file.display(), aside = %aside.display(), error = %e, moved = moved.is_ok(),
                "rules file is corrupt; moved aside, starting with no rules"
            );
            return Vec::new();
        }
    };
    if !unknown.is_empty() || !repeated.is_empty() {
        keep_as_read(file, &unknown);
    }
    entries
        .into_iter()
        .enumerate()
        .map(|(n, stored)| {
            let prefix = format!("rules[{n}].");
            let twice = repeated.iter().find_map(|p| p.strip_prefix(&prefix));
            let parsed = match twice {
                Some(field) => Err(format!(
                    "{field} appears twice in its object; loxi drops the rule rather than keep \
                     one of the values silently, as a POST naming a key twice is refused"
                )),
                None => parse_entry(&stored, parse),
            };
            match parsed {
                Ok(parsed) => Ok(LoadedRule { parsed, stored }),
                Err(error) => Err(UnparsedRule {
                    id: key_ci(&stored, "id")
                        .and_then(serde_json::Value::as_u64)
                        .and_then(|id| u32::try_from(id).ok())
                        .unwrap_or(0),
                    stored,
                    error,
                }),
            }
        })
        .collect()
}

/// What [`read_state`] finds in the state file.
struct StateRead {
    /// The rule entries, as stored.
    entries: Vec<serde_json::Value>,
    /// The file's keys other than `version` and `rules`.
    unknown: Vec<String>,
    /// The path of every key named twice (`rules[0].rule.serviceArguments.port`).
    repeated: Vec<String>,
}

/// The rule entries of the state file `bytes`, the file's keys other than `version` and
/// `rules`, and the path of every key named twice (`rules[0].rule.serviceArguments.port`).
/// Errors (the file is corrupt): not JSON, not an object, no `rules` list, `version` not a
/// number, or one of them named twice (`rules` and `Rules`).
fn read_state(bytes: &[u8]) -> Result<StateRead, String> {
    let (value, repeated) = super::json::with_repeats(bytes).map_err(|e| e.to_string())?;
    let serde_json::Value::Object(top) = value else {
        return Err("not a JSON object {version, rules}".into());
    };
    if let Some(p) = repeated.iter().find(|p| !p.starts_with("rules[")) {
        return Err(format!("key {p} appears twice"));
    }
    let mut rules = None;
    let mut unknown = Vec::new();
    for (k, v) in top {
        let slot = if k.eq_ignore_ascii_case("rules") {
            Some(&mut rules)
        } else if k.eq_ignore_ascii_case("version") {
            if !v.is_u64() {
                return Err(format!("{k:?} is not a version number"));
            }
            None
        } else {
            unknown.push(k);
            continue;
        };
        if let Some(slot) = slot {
            if slot.is_some() {
                return Err(format!("two keys name the rules list (one is {k:?})"));
            }
            *slot = Some(v);
        }
    }
    match rules {
        Some(serde_json::Value::Array(entries)) => Ok(StateRead {
            entries,
            unknown,
            repeated,
        }),
        Some(_) => Err("\"rules\" is not a list".into()),
        None => Err("no \"rules\" list".into()),
    }
}

/// Copies the rules file as read beside it (`rules.json.as-read-<unix secs>`, mode 0600) and
/// logs it, naming the file's keys other than `version` and `rules` (`unknown`).
/// A copy holding the same bytes already (an earlier start read the same file: nothing has
/// rewritten it since) is kept instead of adding one more per restart.
fn keep_as_read(file: &Path, unknown: &[String]) {
    let mut copy = file.with_extension(format!("json.as-read-{}", unix_secs()));
    let copied = fs::read(file).and_then(|b| match same_copy(file, &b) {
        Some(earlier) => {
            copy = earlier;
            Ok(())
        }
        None => write_atomic(&copy, &b),
    });
    if !unknown.is_empty() {
        tracing::error!(file = %file.display(), keys = ?unknown,
            "rules.json has keys other than \"version\" and \"rules\"; loxi does not read them \
             and the next rewrite of rules.json does not keep them");
    }
    match copied {
        Ok(()) => tracing::warn!(file = %file.display(), copy = %copy.display(),
            "rules.json holds what its next rewrite will not keep; the file as read is kept in the copy"),
        Err(e) => tracing::error!(file = %file.display(), copy = %copy.display(), error = %e,
            "copying rules.json as read failed"),
    }
}

/// An `as-read` copy beside `file` whose contents are `bytes`, if there is one.
fn same_copy(file: &Path, bytes: &[u8]) -> Option<std::path::PathBuf> {
    let dir = file.parent()?;
    let prefix = format!("{}.as-read-", file.file_name()?.to_string_lossy());
    fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .find(|p| fs::read(p).is_ok_and(|b| b == bytes))
}

/// The value of `obj`'s key `name`, matched ignoring ASCII case (the first such key).
fn key_ci<'a>(obj: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    obj.as_object()?
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
}

/// Reads one rule of the state file (its `rule` value): the rule, or why it is not one, naming
/// the field. The daemon passes the API's own field checks, so a rule is restored only as a
/// `POST` of it would be read.
pub type RuleParser<'a> = &'a dyn Fn(serde_json::Value) -> Result<LbRule, String>;

/// One entry of the state file (`{"id", "rule"}`, keys in any ASCII case) as a rule, the rule
/// read by `parse`. Another key of the entry, or `id`/`rule` named twice in different cases, is
/// an error naming it.
fn parse_entry(stored: &serde_json::Value, parse: RuleParser<'_>) -> Result<PersistedRule, String> {
    let obj = stored
        .as_object()
        .ok_or("the entry is not a JSON object {id, rule}")?;
    let (mut id, mut rule) = (None, None);
    for (k, v) in obj {
        let slot = if k.eq_ignore_ascii_case("id") {
            &mut id
        } else if k.eq_ignore_ascii_case("rule") {
            &mut rule
        } else {
            return Err(format!(
                "{k:?} is not a key of a rules.json entry (id, rule)"
            ));
        };
        if slot.is_some() {
            return Err(format!("{k:?} names a key of the entry a second time"));
        }
        *slot = Some(v);
    }
    let id = id.ok_or("missing field `id`")?;
    let id: u32 = serde_json::from_value(id.clone()).map_err(|e| format!("id: {e}"))?;
    let rule = parse(rule.ok_or("missing field `rule`")?.clone())?;
    Ok(PersistedRule { id, rule })
}

/// Seconds since the Unix epoch (0 if the clock is before it).
fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Keeps rules dropped at restore (`stored`, each as [`LoadedRule::stored`]) beside the state
/// file `file`, before anything overwrites them: `rules.dropped-<unix secs>.json` (`-<secs>-N`
/// when that name is taken), in the state file's format (fix a rule and post it, or move the
/// file back to `rules.json`), mode 0600, synced. Returns the file written.
pub fn save_dropped(file: &Path, stored: &[serde_json::Value]) -> Result<PathBuf, PersistError> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = file.parent().unwrap_or(Path::new("."));
    let body = serde_json::to_vec_pretty(&StateFile {
        version: 1,
        rules: stored.to_vec(),
    })
    .map_err(|e| PersistError::Write {
        path: file.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    let secs = unix_secs();
    let mut n = 0;
    loop {
        let name = match n {
            0 => format!("rules.dropped-{secs}.json"),
            n => format!("rules.dropped-{secs}-{n}.json"),
        };
        let path = dir.join(name);
        let err = |source| PersistError::Write {
            path: path.clone(),
            source,
        };
        let opened = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path);
        match opened {
            Ok(mut f) => {
                f.write_all(&body).map_err(err)?;
                f.sync_all().map_err(err)?;
                return Ok(path);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 100 => n += 1,
            Err(e) => return Err(err(e)),
        }
    }
}

/// Writes `rules` (service id, rule) atomically to `file`, mode 0600 (the rules name the
/// fleet's addresses, hosts and event ports: readable by the daemon's user alone, as the
/// dropped-rules file and the certificate keys are).
pub fn save<'a>(
    file: &Path,
    rules: impl IntoIterator<Item = (u32, &'a LbRule)>,
) -> Result<(), PersistError> {
    let err = |source| PersistError::Write {
        path: file.to_path_buf(),
        source,
    };
    let body = serde_json::to_vec_pretty(&StateFile {
        version: 1,
        rules: rules
            .into_iter()
            .map(|(id, rule)| RuleRef { id, rule })
            .collect(),
    })
    .map_err(|e| err(std::io::Error::other(e)))?;
    write_atomic(file, &body).map_err(err)
}

/// Replaces `file` with `body` atomically, mode 0600: a temporary file beside it (`<file>.tmp`
/// with the extension replaced, e.g. `rules.json.tmp`), fsync, rename over `file`, fsync of the
/// directory. A reader (or a restart after a crash) sees the old contents or the new, never a
/// part.
pub fn write_atomic(file: &Path, body: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let ext = match file.extension() {
        Some(e) => format!("{}.tmp", e.to_string_lossy()),
        None => "tmp".to_string(),
    };
    let tmp = file.with_extension(ext);
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        // A temporary file left by an older loxi keeps its mode through `open`.
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        f.write_all(body)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, file)?;
    if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
        // Make the rename itself durable.
        fs::File::open(dir).and_then(|d| d.sync_all())?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn missing_file_is_an_empty_list() {
        let dir = tempfile::tempdir().expect("tmp");
        assert!(
            load(
                &dir.path().join("rules.json"),
                &crate::api::fields::restored_rule
            )
            .is_empty()
        );
    }

    #[test]
    fn corrupt_file_is_moved_aside_and_loads_empty() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = state_file(dir.path()).expect("state file");
        std::fs::write(&file, b"{not json").expect("write");
        assert!(load(&file, &crate::api::fields::restored_rule).is_empty());
        assert!(!file.exists(), "the corrupt file is no longer in the way");
        let aside: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("rules.json.corrupt-")
            })
            .collect();
        assert_eq!(aside.len(), 1);
        assert_eq!(std::fs::read(aside[0].path()).expect("read"), b"{not json");
    }

    #[test]
    fn a_rule_entry_that_does_not_parse_is_reported_beside_the_others() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = state_file(dir.path()).expect("state file");
        let good = serde_json::json!({"id": 3, "rule": {
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80},
            "endpoints": [{"endpointIP": "10.0.1.1"}]
        }});
        let mut bad = good.clone();
        bad["id"] = serde_json::json!(4);
        bad["rule"]["serviceArguments"]["bogusField"] = serde_json::json!(1);
        let text = serde_json::json!({"version": 1, "rules": [good, bad]}).to_string();
        std::fs::write(&file, &text).expect("write");
        let loaded = load(&file, &crate::api::fields::restored_rule);
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded[0].as_ref().map(|l| l.parsed.id), Ok(3));
        let unparsed = loaded[1].as_ref().expect_err("unknown field");
        assert_eq!((unparsed.id, &unparsed.stored), (4, &bad));
        assert_eq!(
            unparsed.error,
            "serviceArguments.bogusField: \"bogusField\" is not a field"
        );
        assert!(
            !unparsed.error.contains("expected one of"),
            "{}",
            unparsed.error
        );
        assert!(file.exists(), "the file is not moved aside");
    }

    /// The files beside `file` whose names start with `rules.json.as-read-`, their contents
    /// (also the store's restore tests').
    pub(crate) fn as_read_copies(file: &Path) -> Vec<String> {
        let dir = file.parent().expect("dir");
        std::fs::read_dir(dir)
            .expect("dir")
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("rules.json.as-read-")
            })
            .map(|e| std::fs::read_to_string(e.path()).expect("read"))
            .collect()
    }

    const GOOD_RULE: &str = r#"{"serviceArguments": {"externalIP": "10.0.0.1", "port": 80},
        "endpoints": [{"endpointIP": "10.0.1.1"}]}"#;

    #[test]
    fn the_files_keys_are_read_in_any_case_like_a_rules_keys() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = state_file(dir.path()).expect("state file");
        let text = format!(r#"{{"Version": 1, "RULES": [{{"ID": 3, "Rule": {GOOD_RULE}}}]}}"#);
        std::fs::write(&file, &text).expect("write");
        let loaded = load(&file, &crate::api::fields::restored_rule);
        assert_eq!(loaded.len(), 1);
        let rule = loaded[0].as_ref().expect("restored");
        assert_eq!(rule.parsed.id, 3);
        assert_eq!(rule.parsed.rule.service.port, 80);
        assert!(as_read_copies(&file).is_empty(), "nothing to keep aside");
        assert!(file.exists());
    }

    #[test]
    fn a_key_named_twice_drops_its_entry_naming_the_key_and_keeps_the_file_as_read() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = state_file(dir.path()).expect("state file");
        let twice = r#"{"serviceArguments": {"externalIP": "10.0.0.1", "port": 81, "port": 82},
            "endpoints": [{"endpointIP": "10.0.1.1"}]}"#;
        let text = format!(
            r#"{{"version": 1, "rules": [{{"id": 3, "rule": {GOOD_RULE}}},
                {{"id": 4, "rule": {twice}}}, {{"id": 5, "id": 6, "rule": {GOOD_RULE}}}]}}"#
        );
        std::fs::write(&file, &text).expect("write");
        let loaded = load(&file, &crate::api::fields::restored_rule);
        assert_eq!(loaded.len(), 3);
        assert_eq!(loaded[0].as_ref().map(|l| l.parsed.id), Ok(3));
        let bad = loaded[1].as_ref().expect_err("port twice");
        assert_eq!(bad.id, 4);
        assert!(
            bad.error.starts_with(
                "rule.serviceArguments.port appears twice in its object; loxi drops the rule"
            ),
            "{}",
            bad.error
        );
        let bad = loaded[2].as_ref().expect_err("id twice");
        assert!(bad.error.starts_with("id appears twice"), "{}", bad.error);
        assert_eq!(as_read_copies(&file), [text]);
    }

    #[test]
    fn keys_that_are_not_the_files_are_refused_or_kept_as_read_never_dropped_silently() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = state_file(dir.path()).expect("state file");
        let text = format!(
            r#"{{"version": 1, "comment": "by hand", "rules": [{{"id": 3, "rule": {GOOD_RULE}}},
                {{"id": 4, "note": "x", "rule": {GOOD_RULE}}}]}}"#
        );
        std::fs::write(&file, &text).expect("write");
        let (loaded, log) =
            crate::telemetry::LogBuf::capture(|| load(&file, &crate::api::fields::restored_rule));
        assert_eq!(loaded.len(), 2);
        assert_eq!(loaded[0].as_ref().map(|l| l.parsed.id), Ok(3));
        let bad = loaded[1].as_ref().expect_err("unknown entry key");
        assert_eq!(bad.id, 4);
        assert_eq!(
            bad.error,
            "\"note\" is not a key of a rules.json entry (id, rule)"
        );
        assert!(
            log.contains("rules.json has keys other than") && log.contains("comment"),
            "{log}"
        );
        assert_eq!(as_read_copies(&file), std::slice::from_ref(&text));
        // The next start reads the same file (no rule changed, nothing rewrote it): the copy
        // it already has is kept, not a second one added; a changed file gets its own. (Copies
        // are named by the second: each load here starts in a later one.)
        std::thread::sleep(std::time::Duration::from_millis(1100));
        load(&file, &crate::api::fields::restored_rule);
        assert_eq!(
            as_read_copies(&file),
            std::slice::from_ref(&text),
            "one copy per contents"
        );
        let edited = text.replace("by hand", "edited");
        std::fs::write(&file, &edited).expect("write");
        std::thread::sleep(std::time::Duration::from_millis(1100));
        load(&file, &crate::api::fields::restored_rule);
        let mut copies = as_read_copies(&file);
        copies.sort();
        let mut want = vec![text, edited];
        want.sort();
        assert_eq!(copies, want);
    }

    #[test]
    fn the_rules_list_named_twice_in_two_cases_is_a_corrupt_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = state_file(dir.path()).expect("state file");
        std::fs::write(&file, r#"{"version": 1, "rules": [], "Rules": []}"#).expect("write");
        let (loaded, log) =
            crate::telemetry::LogBuf::capture(|| load(&file, &crate::api::fields::restored_rule));
        assert!(loaded.is_empty());
        assert!(!file.exists(), "moved aside");
        assert!(log.contains("two keys name the rules list"), "{log}");
    }

    #[test]
    fn save_then_load_round_trips_and_creates_the_state_dir() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = state_file(&dir.path().join("a/b")).expect("nested dir created");
        let rule: crate::rules::LbRule = serde_json::from_value(serde_json::json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80},
            "endpoints": [{"endpointIP": "10.0.1.1"}]
        }))
        .expect("rule");
        save(&file, [(7, &rule)]).expect("save");
        let loaded: Vec<LoadedRule> = load(&file, &crate::api::fields::restored_rule)
            .into_iter()
            .collect::<Result<_, _>>()
            .expect("parses");
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].parsed, PersistedRule { id: 7, rule });
        assert_eq!(loaded[0].stored["id"], serde_json::json!(7));
        let text = std::fs::read_to_string(&file).expect("read");
        assert!(text.contains("\"version\": 1"), "{text}");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        // Also when an older loxi's world-readable temporary file is still there.
        let tmp = file.with_extension("json.tmp");
        std::fs::write(&tmp, b"{}").expect("stale tmp");
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        save(&file, [(7, &loaded[0].parsed.rule)]).expect("save again");
        let mode = std::fs::metadata(&file).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }

    #[test]
    fn dropped_rules_are_kept_as_stored_in_a_file_of_their_own_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tmp");
        let file = state_file(dir.path()).expect("state file");
        let stored = vec![
            serde_json::json!({"id": 5, "rule": {"serviceArguments": {"externalIP": "999.1.1.1"}}}),
        ];
        let a = save_dropped(&file, &stored).expect("kept");
        let b = save_dropped(&file, &stored).expect("kept again");
        assert_ne!(a, b, "a second drop in the same second gets its own file");
        let name = a.file_name().expect("name").to_string_lossy().into_owned();
        assert!(
            name.starts_with("rules.dropped-") && name.ends_with(".json"),
            "{name}"
        );
        let back: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&a).expect("read")).expect("JSON");
        assert_eq!(back, serde_json::json!({"version": 1, "rules": stored}));
        let mode = std::fs::metadata(&a).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
