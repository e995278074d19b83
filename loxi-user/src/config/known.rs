//! The environment variables loxi knows, and one warning for each set `LOXI_*`, `LOXILB_*` or
//! `LLB_*` variable it does not: a misspelt knob (`LOXI_MAX_BODY_BYTE`) would otherwise be
//! ignored without a word while its default runs.
//!
//! The daemon's names are not listed by hand: [`daemon_vars`] records every name [`Env`] looks
//! up (with nothing set) and adds the few read elsewhere (the flags' variables and the API
//! tokens), so a knob added to `env.rs` is known at once. Names of loxi's own tooling that may
//! be set where the daemon runs ([`TOOLING_VARS`]) are known but not read. The standard
//! `OTEL_*` variables have another prefix and are not checked here.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::fmt;

use super::Env;

/// Prefixes of the variables checked: LoxiLB's (`LOXILB_`, `LLB_`) and loxi's own (`LOXI_`).
pub const PREFIXES: [&str; 3] = ["LOXI_", "LOXILB_", "LLB_"];

/// Variables of loxi's build, test, bench and deploy tooling that may be set in the daemon's
/// environment (CI exports `LOXI_REQUIRE_EBPF`, the systemd unit's environment file sets
/// `LOXILB_ARGS`, the test harness's own variables reach the daemons it starts). The daemon
/// reads none of them; they are not warned about.
pub const TOOLING_VARS: &[&str] = &[
    "LOXILB_ARGS",
    "LOXI_BIN_DIR",
    "LOXI_CACHE",
    "LOXI_DEBIAN_MIRROR",
    "LOXI_LOXILB_FIXTURES",
    "LOXI_PID",
    "LOXI_REAL_VLLM",
    "LOXI_REQUIRE_EBPF",
    "LOXI_ROOT",
    "LOXI_SETUP_BUILD",
    "LOXI_SHARED",
    "LOXI_TEST_THREADS",
];

/// Prefixes of tooling variable families ([`TOOLING_VARS`]): the benches' and the container
/// scripts'.
pub const TOOLING_PREFIXES: &[&str] = &["LOXI_BENCH_", "LOXI_CONTAINER_"];

/// Every variable the daemon reads with a checked prefix: the names [`Env::from_lookup`] asks
/// for, plus the flags' variables (`LOXI_API_ADDR`, `LOXI_PROXY_WORKERS`) and the API tokens.
pub fn daemon_vars() -> BTreeSet<String> {
    let asked = RefCell::new(BTreeSet::new());
    let _ = Env::from_lookup(|k| {
        asked.borrow_mut().insert(k.to_string());
        None
    });
    let mut names = asked.into_inner();
    names.extend(super::FLAG_ENVS.iter().map(|(var, _)| var.to_string()));
    names.extend([super::API_TOKEN_ENV, super::API_READ_TOKEN_ENV].map(String::from));
    names.retain(|n| PREFIXES.iter().any(|p| n.starts_with(p)));
    names
}

/// A set variable with a checked prefix that loxi does not know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownVar {
    /// The variable's name.
    pub name: String,
    /// The known daemon variable closest to it, when one is close (a likely misspelling).
    pub closest: Option<String>,
}

impl fmt::Display for UnknownVar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is set but loxi reads no such variable", self.name)?;
        match &self.closest {
            Some(c) => write!(f, "; did you mean {c}?"),
            None => write!(f, " (ignored)"),
        }
    }
}

/// The variables among `set` (names of variables set to a non-empty value) that have a checked
/// prefix and are neither read by the daemon nor tooling's, sorted by name.
pub fn unknown_vars(set: impl IntoIterator<Item = String>) -> Vec<UnknownVar> {
    let known = daemon_vars();
    let mut out: Vec<UnknownVar> = set
        .into_iter()
        .filter(|n| PREFIXES.iter().any(|p| n.starts_with(p)))
        .filter(|n| !known.contains(n) && !is_tooling(n))
        .map(|name| UnknownVar {
            closest: closest(&name, &known),
            name,
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out.dedup();
    out
}

/// The daemon's variables among `set_empty` (names of variables set to an empty or
/// whitespace-only value), sorted: each reads as unset, so its default runs, and the binary
/// says so once (an `ENV=` line in an environment file that was meant to hold a value).
pub fn empty_vars(set_empty: impl IntoIterator<Item = String>) -> Vec<String> {
    let known = daemon_vars();
    // An empty API token variable is not read as unset: the daemon refuses it (auth would
    // silently be off), so "its default is used" would contradict that error.
    let refused = [super::API_TOKEN_ENV, super::API_READ_TOKEN_ENV];
    let mut out: Vec<String> = set_empty
        .into_iter()
        .filter(|n| known.contains(n) && !refused.contains(&n.as_str()))
        .collect();
    out.sort();
    out.dedup();
    out
}

fn is_tooling(name: &str) -> bool {
    TOOLING_VARS.contains(&name) || TOOLING_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The known name nearest to `name` by edit distance, when at most 3 edits and at most a third
/// of `name`'s length away (ties: the first in name order).
fn closest(name: &str, known: &BTreeSet<String>) -> Option<String> {
    let most = (name.len() / 3).min(3);
    known
        .iter()
        .map(|k| (edit_distance(name, k), k))
        .filter(|(d, _)| *d <= most)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.clone())
}

/// Levenshtein distance between `a` and `b` (bytes; the names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
#[path = "known_tests.rs"]
mod tests;
