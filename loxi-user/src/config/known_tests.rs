//! The known-variable list against the code that reads variables, the README that documents
//! them and the tooling that sets them.

use super::*;

fn names(set: &[&str]) -> Vec<String> {
    set.iter().map(|s| s.to_string()).collect()
}

#[test]
fn edit_distance_counts_insertions_deletions_and_substitutions() {
    assert_eq!(edit_distance("", ""), 0);
    assert_eq!(edit_distance("abc", "abc"), 0);
    assert_eq!(edit_distance("abc", "abcd"), 1);
    assert_eq!(edit_distance("abcd", "abc"), 1);
    assert_eq!(edit_distance("abc", "axc"), 1);
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(edit_distance("", "abc"), 3);
}

#[test]
fn misspelt_variables_are_reported_with_the_closest_known_name() {
    let found = unknown_vars(names(&[
        "LOXI_MAX_BODY_BYTE",
        "LOXI_HEADER_TIMEOUT",
        "LLB_PD_MAX_INFLIGHT_PER_EPS",
        "LOXILB_SOMETHING_ELSE_ENTIRELY",
    ]));
    let got: Vec<(&str, Option<&str>)> = found
        .iter()
        .map(|u| (u.name.as_str(), u.closest.as_deref()))
        .collect();
    assert_eq!(
        got,
        [
            (
                "LLB_PD_MAX_INFLIGHT_PER_EPS",
                Some("LLB_PD_MAX_INFLIGHT_PER_EP")
            ),
            ("LOXILB_SOMETHING_ELSE_ENTIRELY", None),
            ("LOXI_HEADER_TIMEOUT", Some("LOXI_HEADER_TIMEOUT_MS")),
            ("LOXI_MAX_BODY_BYTE", Some("LOXI_MAX_BODY_BYTES")),
        ]
    );
    assert_eq!(
        found[3].to_string(),
        "LOXI_MAX_BODY_BYTE is set but loxi reads no such variable; did you mean \
         LOXI_MAX_BODY_BYTES?"
    );
    assert_eq!(
        found[1].to_string(),
        "LOXILB_SOMETHING_ELSE_ENTIRELY is set but loxi reads no such variable (ignored)"
    );
}

#[test]
fn known_tooling_and_foreign_variables_are_not_reported() {
    let quiet = unknown_vars(names(&[
        "LOXI_MAX_BODY_BYTES",
        "LOXI_API_ADDR",
        "LOXI_PROXY_WORKERS",
        "LOXI_API_TOKEN",
        "LOXI_API_READ_TOKEN",
        "LOXILB_AI_CTRL_ADDR",
        "LLB_KV_LOADGUARD",
        "LOXILB_ARGS",
        "LOXI_REQUIRE_EBPF",
        "LOXI_BENCH_FONT",
        "LOXI_CONTAINER_TAG",
        "OTEL_SERVICE_NAME",
        "TOKIO_WORKER_THREADS",
        "PATH",
        "LOXIX_NOT_OURS",
    ]));
    assert_eq!(quiet, []);
}

#[test]
fn every_variable_env_rs_reads_is_known() {
    let known = daemon_vars();
    for n in [
        "LOXILB_KV_LB_MODE",
        "LOXILB_AI_CTRL_DECAY_WINDOW_SEC",
        "LLB_KV_NONE_HASH_SEED",
        "LLB_PD_QUEUE_DEPTH_PER_EP",
        "LOXI_KV_LORA_PATHS",
        "LOXI_MAX_CONNS_PER_LISTENER",
    ] {
        assert!(known.contains(n), "{n}: {known:?}");
    }
    for n in super::super::env::INERT_VARS {
        assert!(known.contains(*n), "{n}");
    }
    assert!(
        known.len() > 50,
        "{} names: is Env::from_lookup still asking?",
        known.len()
    );
}

/// Names with a checked prefix in `text`, each with whether it is written as a family
/// (`LOXILB_AI_CTRL_*`).
fn mentioned(text: &str) -> BTreeSet<(String, bool)> {
    let b = text.as_bytes();
    let name_byte = |c: u8| c.is_ascii_uppercase() || c.is_ascii_digit() || c == b'_';
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i < b.len() {
        let boundary = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if boundary && PREFIXES.iter().any(|p| b[i..].starts_with(p.as_bytes())) {
            let end = b[i..]
                .iter()
                .position(|&c| !name_byte(c))
                .map_or(b.len(), |n| i + n);
            let family = b.get(end) == Some(&b'*');
            out.insert((text[i..end].to_string(), family));
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// The README's "Daemon flags and environment" section and the sections up to "Where loxi
/// differs from LoxiLB" (security model, fullproxy limits, admission gate): the variable
/// tables.
fn readme_env_sections() -> &'static str {
    let readme = include_str!("../../../README.md");
    let start = readme
        .find("\n## Daemon flags and environment")
        .expect("README section");
    let end = readme[start..]
        .find("\n## Where loxi differs")
        .map_or(readme.len(), |n| start + n);
    &readme[start..end]
}

#[test]
fn every_variable_the_readme_documents_is_known_and_every_known_one_is_documented() {
    let known = daemon_vars();
    let documented = mentioned(readme_env_sections());
    let families: Vec<&str> = documented
        .iter()
        .filter(|(_, family)| *family)
        .map(|(n, _)| n.as_str())
        .collect();
    for (name, family) in &documented {
        if *family {
            assert!(
                known.iter().any(|k| k.starts_with(name.as_str())),
                "README family {name}* names no variable loxi reads"
            );
        } else {
            assert!(
                known.contains(name) || is_tooling(name),
                "README documents {name}, which loxi does not read and is no tooling variable"
            );
        }
    }
    for name in &known {
        let by_name = documented.contains(&(name.clone(), false));
        // Inert variables (read, no feature yet) are documented as their family.
        let inert = super::super::env::INERT_VARS.contains(&name.as_str())
            && families.iter().any(|f| name.starts_with(f));
        assert!(
            by_name || inert,
            "{name} is read by loxi but not documented in README's \"Daemon flags and \
             environment\" (or the variable tables after it)"
        );
    }
}

/// Every name with a checked prefix that loxi's scripts, deploy files, CI, test harness and
/// benches use is either read by the daemon or listed as tooling, so neither warns.
#[test]
fn every_variable_the_tooling_sets_is_known() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ["scripts", "deploy", ".ci", "tests/src", "bench/src"] {
        collect_files(&root.join(dir), &mut files);
    }
    files.push(root.join("Containerfile"));
    files.push(root.join("loxi-user/build.rs"));
    let known = daemon_vars();
    let mut seen = 0;
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        for (name, family) in mentioned(&text) {
            seen += 1;
            let ok = if family {
                known.iter().any(|k| k.starts_with(&name)) || is_tooling(&name)
            } else {
                known.contains(&name) || is_tooling(&name)
            };
            assert!(
                ok,
                "{} uses {name}: add it to TOOLING_VARS (or read it in the daemon)",
                f.display()
            );
        }
    }
    assert!(
        seen > 20,
        "only {seen} names found in {} files",
        files.len()
    );
}

/// Every file under `dir` (recursively; a missing directory adds none).
fn collect_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        let p = e.path();
        if p.is_dir() {
            collect_files(&p, out);
        } else {
            out.push(p);
        }
    }
}

#[test]
fn daemon_variables_set_empty_are_reported_and_others_not() {
    assert_eq!(
        empty_vars(names(&[
            "LOXI_MAX_BODY_BYTES",
            "LOXI_SEND_TIMEOUT_MS",
            "LOXI_NO_SUCH_THING",
            "HOME",
            "LOXI_SHARED",
            // Refused when empty (`TokenError::Empty`), not read as unset.
            "LOXI_API_TOKEN",
            "LOXI_API_READ_TOKEN",
        ])),
        ["LOXI_MAX_BODY_BYTES", "LOXI_SEND_TIMEOUT_MS"]
    );
}
