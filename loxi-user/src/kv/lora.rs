//! LoRA adapters the KV tier knows: a request whose `model` names an adapter is tokenized with
//! its base model's tokenizer and hashed with vLLM 0.32's LoRA extra key `("lora", name, path)`
//! on every block (`block_hash`), so adapter A matches only A's blocks, never the base model's
//! or adapter B's.
//!
//! Two sources, merged per adapter name:
//! - `LOXI_KV_LORA_PATHS` (`name=path,...`): the path the engine loaded the adapter from.
//!   Configured paths win over learned ones.
//! - The engines' `GET /v1/models`, polled every `LOXI_KV_MODELS_POLL_MS` ([`poll_models`]).
//!   vLLM lists each loaded adapter as `{"id": lora_name, "root": local path, "parent": base
//!   model}` (`vllm/entrypoints/openai/serving_models.py::show_available_models`; base models
//!   have `parent: null`). The union of one round's answers replaces the learned set, so an
//!   unloaded adapter is forgotten; a round where no endpoint answers keeps the previous set.
//!
//! The base model names the tokenizer directory. An adapter known only from
//! `LOXI_KV_LORA_PATHS` (no engine listed its parent) is tokenized under its own name: stage
//! (or link) the base model's tokenizer directory under the adapter's name, or the request
//! misses with `tokenizer`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::RwLock;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::rules::RuleSnapshot;
use crate::rules::model::authority;

/// Largest `/v1/models` answer read from one engine, in bytes.
pub const MAX_MODELS_BYTES: usize = 1 << 20;

/// One adapter as a request for it is hashed and tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    /// The path vLLM hashes in the LoRA extra key (`LoRARequest.lora_path`).
    pub path: String,
    /// The base model (its tokenizer is the adapter's); `None` when no engine listed it.
    pub parent: Option<String>,
}

/// The adapters known now: configured paths plus what the engines list; and every model id the
/// engines list (base models, their served aliases and adapters), which tells a model no
/// engine serves ([`LoraCatalog::lists`]).
#[derive(Debug, Default)]
pub struct LoraCatalog {
    configured: HashMap<String, String>,
    learned: RwLock<HashMap<String, Adapter>>,
    /// The ids of the last polling round any engine answered; `None` before one did.
    listed: RwLock<Option<HashSet<String>>>,
}

impl LoraCatalog {
    /// A catalog with the configured `name → path` pairs (`LOXI_KV_LORA_PATHS`).
    pub fn new(configured: HashMap<String, String>) -> Self {
        Self {
            configured,
            learned: RwLock::new(HashMap::new()),
            listed: RwLock::new(None),
        }
    }

    /// The adapter `name` names, if it is one: the configured path when set, else the listed
    /// one; the parent from the engines' listing.
    pub fn resolve(&self, name: &str) -> Option<Adapter> {
        let learned = self.learned.read().get(name).cloned();
        match (self.configured.get(name), learned) {
            (Some(path), l) => Some(Adapter {
                path: path.clone(),
                parent: l.and_then(|a| a.parent),
            }),
            (None, l) => l,
        }
    }

    /// Replaces the learned adapters with `adapters` (one polling round's union).
    pub fn set_learned(&self, adapters: HashMap<String, Adapter>) {
        *self.learned.write() = adapters;
    }

    /// Replaces the listed model ids with `ids` (one polling round's union).
    pub fn set_listed(&self, ids: HashSet<String>) {
        *self.listed.write() = Some(ids);
    }

    /// Whether an engine lists `model` in its `/v1/models`: `None` while nothing can be said
    /// (no polling round answered yet, or `LOXI_KV_MODELS_POLL_MS=0`).
    pub fn lists(&self, model: &str) -> Option<bool> {
        self.listed.read().as_ref().map(|ids| ids.contains(model))
    }

    /// Names of the learned adapters, sorted (for tests and logs).
    pub fn learned_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.learned.read().keys().cloned().collect();
        v.sort_unstable();
        v
    }
}

/// The adapters of one OpenAI model list (`{"data": [{"id", "root", "parent"}, ..]}`): every
/// entry with a string `parent` other than its `id` and a string `root`. `None` when `body` is
/// not such a list.
pub fn adapters_of(body: &[u8]) -> Option<HashMap<String, Adapter>> {
    adapters_in(&serde_json::from_slice(body).ok()?)
}

/// [`adapters_of`] on the parsed list `v`.
fn adapters_in(v: &serde_json::Value) -> Option<HashMap<String, Adapter>> {
    let data = v.get("data")?.as_array()?;
    Some(
        data.iter()
            .filter_map(|m| {
                let id = m.get("id")?.as_str()?;
                let parent = m.get("parent")?.as_str()?;
                let root = m.get("root")?.as_str()?;
                (parent != id).then(|| {
                    (
                        id.to_owned(),
                        Adapter {
                            path: root.to_owned(),
                            parent: Some(parent.to_owned()),
                        },
                    )
                })
            })
            .collect(),
    )
}

/// Every string `id` of one OpenAI model list (`{"data": [{"id"}, ..]}`); `None` when `body`
/// is not such a list.
pub fn model_ids_of(body: &[u8]) -> Option<HashSet<String>> {
    model_ids_in(&serde_json::from_slice(body).ok()?)
}

/// [`model_ids_of`] on the parsed list `v`.
fn model_ids_in(v: &serde_json::Value) -> Option<HashSet<String>> {
    let data = v.get("data")?.as_array()?;
    Some(
        data.iter()
            .filter_map(|m| Some(m.get("id")?.as_str()?.to_owned()))
            .collect(),
    )
}

/// One engine's model list: its adapters and every id it lists.
type Listing = (HashMap<String, Adapter>, HashSet<String>);

/// `ip:port` of every endpoint of every rule with tier 1.5 on, once each, sorted.
fn targets(snap: &RuleSnapshot) -> BTreeSet<String> {
    snap.rules
        .values()
        .filter_map(|r| r.spec.kv.as_ref())
        .flat_map(|kv| kv.endpoints.iter())
        .map(|ep| authority(&ep.ip, u32::from(ep.port)))
        .collect()
}

/// One engine's adapters and model ids (`GET http://target/v1/models` within `timeout`), or
/// why not.
async fn fetch(target: &str, timeout: Duration) -> Result<Listing, String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let uri: http::Uri = format!("http://{target}/v1/models")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let fut = async {
        let resp = client.get(uri).await.map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("status {}", resp.status().as_u16()));
        }
        let body = Limited::new(resp.into_body(), MAX_MODELS_BYTES)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        // One parse for both readings of the list.
        serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| adapters_in(&v).zip(model_ids_in(&v)))
            .ok_or_else(|| "not an OpenAI model list".to_owned())
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| "timeout".to_owned())?
}

/// Polls `/v1/models` of every KV rule's endpoints every `interval` (each within
/// `min(interval, 2 s)`) until `shutdown`, and replaces the catalog's learned adapters and
/// listed model ids with the union of each round's answers (kept as they were when no
/// endpoint answered).
pub async fn poll_models(
    catalog: Arc<LoraCatalog>,
    rules: watch::Receiver<Arc<RuleSnapshot>>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let timeout = interval.min(Duration::from_secs(2));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let snap = rules.borrow().clone();
        let mut union = HashMap::new();
        let mut ids = HashSet::new();
        let mut answered = 0usize;
        for target in targets(&snap) {
            match fetch(&target, timeout).await {
                Ok((a, i)) => {
                    answered += 1;
                    union.extend(a);
                    ids.extend(i);
                }
                Err(e) => tracing::debug!(%target, error = %e, "kv: /v1/models poll failed"),
            }
        }
        if answered > 0 {
            catalog.set_learned(union);
            catalog.set_listed(ids);
        }
    }
}

#[cfg(test)]
#[path = "lora_tests.rs"]
mod tests;
