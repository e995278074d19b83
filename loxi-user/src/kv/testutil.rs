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
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

/// Decodes a hex string (test data only).
pub(crate) fn unhex(s: &str) -> Vec<u8> {
    hex::decode(s).unwrap_or_else(|e| panic!("bad hex in golden data: {e}"))
}

use std::sync::Arc;

use prometheus_client::registry::Registry;

use super::metrics::KvMetrics;
use super::route::select::PromptTokenizer;
use super::settings::KvSettings;
use super::state::KvState;
use crate::request::{ApiKind, Prompt};
use crate::rules::store::StoredRule;

/// A validated rule with `n` endpoints `127.0.0.<i+1>:800<i>` (one host each: engines on one
/// host would need their own KV-event ports) and the given `serviceArguments` overrides.
pub(crate) fn rule(id: u32, n: usize, extra: serde_json::Value) -> StoredRule {
    let mut svc = serde_json::json!({
        "externalIP": "10.0.0.1", "port": 8080, "mode": 4, "sel": 0,
        "kvExactMode": 3, "kvBlockSize": 16, "kvHashAlgo": "sha256_cbor",
    });
    if let (Some(s), Some(e)) = (svc.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    // `"ep_roles": [..]` in `extra` sets the endpoints' `ep_role` (P/D rules).
    let roles = svc
        .as_object_mut()
        .and_then(|s| s.remove("ep_roles"))
        .unwrap_or_default();
    let eps: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            let role = roles.get(i).and_then(|r| r.as_u64()).unwrap_or(0);
            serde_json::json!({"endpointIP": format!("127.0.0.{}", i + 1), "targetPort": 8000 + i, "ep_role": role})
        })
        .collect();
    let rule =
        serde_json::from_value(serde_json::json!({"serviceArguments": svc, "endpoints": eps}))
            .unwrap_or_else(|e| panic!("test rule: {e}"));
    StoredRule::new(id, rule).unwrap_or_else(|e| panic!("test rule: {e}"))
}

/// Fresh KV state with its own registry.
pub(crate) fn state(settings: KvSettings) -> (Arc<KvState>, Registry) {
    let mut reg = Registry::default();
    let m = KvMetrics::register(&mut reg);
    (KvState::new(settings, m), reg)
}

/// The value of the first exposition line of `reg` starting with `series` (0 when absent).
pub(crate) fn metric_value(reg: &Registry, series: &str) -> f64 {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, reg).expect("encode");
    out.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// `loxilb_kv_routing_stage_seconds_count` of one stage (`Tokenize`, `Hash`, `Score`).
pub(crate) fn stage_count(reg: &Registry, stage: &str) -> f64 {
    metric_value(
        reg,
        &format!("loxilb_kv_routing_stage_seconds_count{{stage=\"{stage}\"}}"),
    )
}

/// The golden tiny model's real `tokenizer.json` for model `tiny` (completions only: encodes
/// with special tokens unless the request says otherwise).
pub(crate) struct TinyTokenizer(tokenizers::Tokenizer);

impl TinyTokenizer {
    pub(crate) fn load() -> Arc<Self> {
        let p = shared_dir().join("golden/tiny-model/tokenizer.json");
        Arc::new(Self(
            tokenizers::Tokenizer::from_file(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        ))
    }
}

impl PromptTokenizer for TinyTokenizer {
    fn encode(
        &self,
        model: &str,
        _api: ApiKind,
        prompt: &Prompt,
        add: Option<bool>,
    ) -> Result<Arc<[u32]>, String> {
        if model != "tiny" {
            return Err(format!("no tokenizer for {model}"));
        }
        let Prompt::Text(t) = prompt else {
            return Err("only text prompts in tests".into());
        };
        let enc = self
            .0
            .encode(t.as_str(), add.unwrap_or(true))
            .map_err(|e| e.to_string())?;
        Ok(enc.get_ids().into())
    }
}

/// Encodes one msgpack value (tests build event batches with it).
pub(crate) fn msgpack(v: &rmpv::Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap_or_else(|e| panic!("encode: {e}"));
    out
}

/// A map-shaped `BlockStored` batch `[ts, [event], rank]` for `keys` (no token ids).
pub(crate) fn stored_batch(keys: &[u64], block_size: u32) -> Vec<u8> {
    use rmpv::Value as V;
    let ev = V::Map(vec![
        (V::from("type"), V::from("BlockStored")),
        (
            V::from("block_hashes"),
            V::Array(keys.iter().map(|&k| V::from(k)).collect()),
        ),
        (V::from("parent_block_hash"), V::Nil),
        (V::from("token_ids"), V::Array(vec![])),
        (V::from("block_size"), V::from(block_size)),
    ]);
    msgpack(&V::Array(vec![V::F64(0.0), V::Array(vec![ev]), V::from(0)]))
}

/// A map-shaped `BlockStored` exactly as vLLM 0.32's publisher encodes it (every field in the
/// struct's order, `parent_block_hash` nil, `extra_keys` one entry per block).
pub(crate) fn vllm_stored_event(
    keys: &[u64],
    toks: &[u32],
    block_size: u32,
    lora_name: Option<&str>,
    extra_keys: Vec<rmpv::Value>,
) -> rmpv::Value {
    use rmpv::Value as V;
    V::Map(vec![
        (V::from("type"), V::from("BlockStored")),
        (
            V::from("block_hashes"),
            V::Array(keys.iter().map(|&k| V::from(k)).collect()),
        ),
        (V::from("parent_block_hash"), V::Nil),
        (
            V::from("token_ids"),
            V::Array(toks.iter().map(|&t| V::from(t)).collect()),
        ),
        (V::from("block_size"), V::from(block_size)),
        (V::from("lora_id"), lora_name.map_or(V::Nil, |_| V::from(7))),
        (V::from("medium"), V::from("GPU")),
        (V::from("lora_name"), lora_name.map_or(V::Nil, V::from)),
        (V::from("extra_keys"), V::Array(extra_keys)),
        (V::from("group_idx"), V::from(0)),
    ])
}
