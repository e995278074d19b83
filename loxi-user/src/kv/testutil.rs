//! Test helpers shared by the KV unit tests: locating `../shared/golden` and decoding hex.

use std::path::PathBuf;

/// `$LOXI_SHARED` if set, else `<workspace root>/../shared`.
pub(crate) fn shared_dir() -> PathBuf {
    match std::env::var_os("LOXI_SHARED") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"),
    }
}

/// Parses `golden/<name>` as JSON.
pub(crate) fn golden_json(name: &str) -> serde_json::Value {
    let path = shared_dir().join("golden").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

/// Decodes a hex string (test data only).
pub(crate) fn unhex(s: &str) -> Vec<u8> {
    hex::decode(s).unwrap_or_else(|e| panic!("bad hex in golden data: {e}"))
}
