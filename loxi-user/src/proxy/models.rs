//! `GET /v1/models` on a listener: the union of the model lists of every endpoint of the pools
//! serving the request's host (all model pools of the VIP:port, so a listener whose rules are
//! told apart only by `model_name` lists every model, not one pool's by round robin).
//!
//! - Each healthy endpoint (distinct `ip:port`) is asked `GET /v1/models` with the client's
//!   headers (so an engine's API key still applies; `Accept-Encoding` is dropped so the answer
//!   is plain JSON) plus `X-Forwarded-For`, `X-Forwarded-Proto` and `X-Loxi-Hop` as on every
//!   forwarded request (an endpoint that leads back here answers 508, named in the failure),
//!   at most [`CONCURRENCY`] at once, each within `LOXI_MODELS_TIMEOUT_MS` (connect, head and
//!   body) and [`MAX_LIST_BYTES`].
//! - An endpoint that fails (no connection, timeout, non-2xx, not an OpenAI list
//!   `{"object":"list","data":[{"id":..},..]}`, too large) is left out. With none answering the
//!   client gets 502 `models_unavailable` naming the last failure.
//! - The union keeps each model id once, with the fields of the first endpoint listing it
//!   (pools in rule-key order, endpoints in rule order); entries without a string `id` are
//!   dropped.
//! - The answer is cached per listener for `LOXI_MODELS_CACHE_MS` (0: not cached), keyed by the
//!   set of pools (a rule change is a miss) and the client's `Authorization` header (a client
//!   never gets an answer fetched with another client's credentials). One refresh runs at a
//!   time per listener; others wait for it. At most [`MAX_ENTRIES`] answers are kept.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Response, header};
use http_body_util::{BodyExt, Limited};
use serde_json::Value;
use tokio::time::Instant;

use super::body::ProxyBody;
use super::error::{ProxyError, full};
use super::pool::Pool;
use super::upstream::{Attempt, Upstreams, upstream_request};

/// Largest model list read from one endpoint, in bytes; a longer answer leaves it out.
pub const MAX_LIST_BYTES: usize = 1 << 20;

/// Endpoints asked at once.
pub const CONCURRENCY: usize = 8;

/// Cached answers kept per listener (one per pool set and `Authorization` value).
pub const MAX_ENTRIES: usize = 64;

/// Cache lifetime and per-endpoint timeout of the aggregated answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelsConfig {
    /// How long an answer is served from the cache (`LOXI_MODELS_CACHE_MS`, default 2 s;
    /// zero: never cached).
    pub cache: Duration,
    /// How long one endpoint may take (`LOXI_MODELS_TIMEOUT_MS`, default 2 s).
    pub timeout: Duration,
}

impl Default for ModelsConfig {
    fn default() -> Self {
        Self {
            cache: Duration::from_secs(2),
            timeout: Duration::from_secs(2),
        }
    }
}

/// True for the request this module answers: `GET /v1/models` (a trailing `/` allowed;
/// `/v1/models/{id}` is forwarded like any request).
pub fn is_list_request(parts: &Parts) -> bool {
    parts.method == http::Method::GET && parts.uri.path().trim_end_matches('/') == "/v1/models"
}

/// A listener's cached answers. A fresh entry is served without waiting on anything; a miss
/// fetches once per key (concurrent misses of the same key wait for that fetch and then read
/// its entry), and misses of different keys (another client's credentials) fetch in
/// parallel: one client's slow fetch never holds up another's, nor a cached answer.
#[derive(Debug, Default)]
pub struct ModelsCache {
    entries: parking_lot::Mutex<HashMap<Key, Entry>>,
    /// The fetch in progress per key (its turn lock), dropped with its last waiter.
    fetching: parking_lot::Mutex<HashMap<Key, Weak<tokio::sync::Mutex<()>>>>,
}

impl ModelsCache {
    /// The body of `key`'s entry when it is fresh for `pools`.
    fn fresh(&self, key: &Key, pools: &[&Arc<Pool>], ttl: Duration) -> Option<Bytes> {
        self.entries
            .lock()
            .get(key)
            .filter(|e| e.fresh(pools, ttl, Instant::now()))
            .map(|e| e.body.clone())
    }

    /// `key`'s fetch turn: the one in progress, or a new one.
    fn turn(&self, key: &Key) -> Arc<tokio::sync::Mutex<()>> {
        let mut fetching = self.fetching.lock();
        if let Some(t) = fetching.get(key).and_then(Weak::upgrade) {
            return t;
        }
        if fetching.len() >= MAX_ENTRIES {
            fetching.retain(|_, t| t.strong_count() > 0);
        }
        let t = Arc::new(tokio::sync::Mutex::new(()));
        fetching.insert(key.clone(), Arc::downgrade(&t));
        t
    }

    /// Keeps `body`, fetched from `pools` now, as `key`'s entry.
    fn store(&self, key: Key, pools: &[&Arc<Pool>], body: Bytes, ttl: Duration) {
        let now = Instant::now();
        let mut entries = self.entries.lock();
        if entries.len() >= MAX_ENTRIES {
            entries.retain(|_, e| now.duration_since(e.at) < ttl);
        }
        if entries.len() >= MAX_ENTRIES {
            entries.clear();
        }
        let pools = pools.iter().map(|p| Arc::downgrade(*p)).collect();
        entries.insert(
            key,
            Entry {
                pools,
                at: now,
                body,
            },
        );
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq)]
struct Key {
    rules: Vec<u32>,
    auth: u64,
}

#[derive(Debug)]
struct Entry {
    /// The pools asked (weak: a cached answer does not keep a replaced pool alive).
    pools: Vec<Weak<Pool>>,
    at: Instant,
    body: Bytes,
}

impl Entry {
    /// Fetched from exactly `pools` (same `Arc`s: no rule changed) less than `ttl` ago.
    fn fresh(&self, pools: &[&Arc<Pool>], ttl: Duration, now: Instant) -> bool {
        now.duration_since(self.at) < ttl
            && self.pools.len() == pools.len()
            && self
                .pools
                .iter()
                .zip(pools)
                .all(|(w, p)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(*p)))
    }
}

/// What answering `GET /v1/models` on one listener uses: the upstream clients, the knobs and
/// the listener's cache.
pub struct ModelList<'a> {
    /// The proxy's upstream clients.
    pub upstreams: &'a Upstreams,
    /// Cache lifetime and per-endpoint timeout.
    pub config: ModelsConfig,
    /// The listener's cached answers.
    pub cache: &'a ModelsCache,
}

impl ModelList<'_> {
    /// Answers `GET /v1/models` (request head `parts`) with the union of the lists of `pools`
    /// (the pools serving the request's host, in rule-key order; see the module doc).
    pub async fn answer(
        &self,
        parts: &Parts,
        pools: &[&Arc<Pool>],
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let ttl = self.config.cache;
        let key = Key {
            rules: pools.iter().map(|p| p.rule.id).collect(),
            auth: auth_hash(&parts.headers),
        };
        if ttl.is_zero() {
            return Ok(list_response(self.aggregate(parts, pools).await?));
        }
        if let Some(body) = self.cache.fresh(&key, pools, ttl) {
            return Ok(list_response(body));
        }
        let turn = self.cache.turn(&key);
        let _turn = turn.lock().await;
        // The fetch this one waited for may have filled the entry.
        if let Some(body) = self.cache.fresh(&key, pools, ttl) {
            return Ok(list_response(body));
        }
        let body = self.aggregate(parts, pools).await?;
        self.cache.store(key, pools, body.clone(), ttl);
        Ok(list_response(body))
    }

    /// Asks every healthy endpoint of `pools` and merges the answers.
    async fn aggregate(&self, parts: &Parts, pools: &[&Arc<Pool>]) -> Result<Bytes, ProxyError> {
        let targets = targets(pools);
        if targets.is_empty() {
            return Err(ProxyError::ModelsUnavailable {
                tried: 0,
                last: "no healthy endpoint".into(),
            });
        }
        let answers: Vec<Result<Vec<Value>, String>> = futures::stream::iter(targets)
            .map(|(authority, via)| async move { self.fetch_list(parts, &authority, &via).await })
            .buffered(CONCURRENCY)
            .collect()
            .await;
        union(&answers)
    }

    /// One endpoint's `data` entries, or why it is left out (`ip:port: what failed`).
    async fn fetch_list(
        &self,
        parts: &Parts,
        authority: &str,
        via: &super::upstream::Via,
    ) -> Result<Vec<Value>, String> {
        let timeout = self.config.timeout;
        let fetch = async {
            let mut req =
                upstream_request(parts, authority, Bytes::new()).map_err(|e| e.to_string())?;
            req.headers_mut().remove(header::ACCEPT_ENCODING);
            req.headers_mut().remove(header::CONTENT_LENGTH);
            let resp = match self.upstreams.send(req, via).await {
                Attempt::Response(r) => r,
                Attempt::ConnectFailed(e) => return Err(e),
                Attempt::NoLocalResources(s) => return Err(s.to_string()),
                Attempt::Failed(e) => return Err(e.to_string()),
            };
            if resp.status() == http::StatusCode::LOOP_DETECTED {
                return Err(
                    "status 508: a forwarding loop (the endpoint leads back to a \
                            gateway this request already passed)"
                        .into(),
                );
            }
            if !resp.status().is_success() {
                return Err(format!("status {}", resp.status().as_u16()));
            }
            let body = Limited::new(resp.into_body(), MAX_LIST_BYTES)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            model_entries(&body)
        };
        let ms = timeout.as_millis();
        let res = tokio::time::timeout(timeout, fetch)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {ms} ms")))
            .map_err(|e| format!("{authority}: {e}"));
        if let Err(e) = &res {
            tracing::debug!(error = %e, "endpoint left out of /v1/models");
        }
        res
    }
}

/// The healthy endpoints of `pools` (authority, how to reach it), each authority once, in pool then
/// endpoint order.
fn targets(pools: &[&Arc<Pool>]) -> Vec<(String, super::upstream::Via)> {
    let mut seen = HashSet::new();
    pools
        .iter()
        .flat_map(|p| {
            p.authorities
                .iter()
                .zip(&p.loads)
                .filter(|(_, l)| l.is_healthy())
                .map(|(a, _)| (a.clone(), p.via.clone()))
        })
        .filter(|(a, _)| seen.insert(a.clone()))
        .collect()
}

/// The `data` array of an OpenAI model list.
fn model_entries(body: &[u8]) -> Result<Vec<Value>, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    match v.get("data") {
        Some(Value::Array(data)) => Ok(data.clone()),
        _ => Err("not an OpenAI model list (no \"data\" array)".into()),
    }
}

/// The union of the answers (each id once, first entry's fields), as an OpenAI list; 502
/// `models_unavailable` when no answer succeeded.
fn union(answers: &[Result<Vec<Value>, String>]) -> Result<Bytes, ProxyError> {
    let mut seen = HashSet::new();
    let mut data = Vec::new();
    let mut answered = false;
    let mut last = String::new();
    for a in answers {
        match a {
            Ok(entries) => {
                answered = true;
                let with_id = entries
                    .iter()
                    .filter_map(|e| Some((e.get("id")?.as_str()?, e)));
                for (id, e) in with_id {
                    if seen.insert(id.to_owned()) {
                        data.push(e.clone());
                    }
                }
            }
            Err(e) => last.clone_from(e),
        }
    }
    if !answered {
        return Err(ProxyError::ModelsUnavailable {
            tried: answers.len(),
            last,
        });
    }
    let list = serde_json::json!({"object": "list", "data": data});
    Ok(Bytes::from(list.to_string()))
}

/// A hash of the `Authorization` header values (0 without one), part of the cache key.
fn auth_hash(h: &HeaderMap) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for v in h.get_all(header::AUTHORIZATION) {
        v.as_bytes().hash(&mut hasher);
    }
    hasher.finish()
}

fn list_response(body: Bytes) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ids(body: &Bytes) -> Vec<String> {
        let v: Value = serde_json::from_slice(body).expect("json");
        assert_eq!(v["object"], "list");
        v["data"]
            .as_array()
            .expect("data")
            .iter()
            .map(|e| e["id"].as_str().expect("id").to_owned())
            .collect()
    }

    #[test]
    fn union_keeps_each_id_once_with_the_first_entrys_fields() {
        let answers = vec![
            Ok(vec![
                json!({"id": "a", "owned_by": "first"}),
                json!({"id": "b"}),
            ]),
            Err("127.0.0.1:1: status 500".into()),
            Ok(vec![
                json!({"id": "a", "owned_by": "second"}),
                json!({"id": "c"}),
                json!({"object": "model"}),
            ]),
        ];
        let body = union(&answers).expect("union");
        assert_eq!(ids(&body), ["a", "b", "c"]);
        let v: Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["data"][0]["owned_by"], "first");
    }

    #[test]
    fn union_of_failures_is_models_unavailable_naming_the_last() {
        let answers = vec![Err("x: status 401".into()), Err("y: no answer".into())];
        let e = union(&answers).expect_err("none answered");
        assert_eq!(e.token(), "models_unavailable");
        assert_eq!(e.status(), http::StatusCode::BAD_GATEWAY);
        assert!(e.to_string().contains("2 asked") && e.to_string().contains("y: no answer"));
        let empty = union(&[Ok(vec![])]).expect("an empty list is an answer");
        assert!(ids(&empty).is_empty());
    }

    #[test]
    fn only_openai_lists_are_accepted() {
        assert_eq!(
            model_entries(br#"{"object":"list","data":[{"id":"m"}]}"#).expect("list"),
            vec![json!({"id": "m"})]
        );
        assert!(model_entries(br#"{"backend":"b0"}"#).is_err());
        assert!(model_entries(b"<html>").is_err());
    }

    #[test]
    fn only_get_v1_models_is_answered_here() {
        let parts = |m: http::Method, uri: &str| {
            http::Request::builder()
                .method(m)
                .uri(uri)
                .body(())
                .expect("req")
                .into_parts()
                .0
        };
        assert!(is_list_request(&parts(http::Method::GET, "/v1/models")));
        assert!(is_list_request(&parts(
            http::Method::GET,
            "/v1/models/?x=1"
        )));
        assert!(!is_list_request(&parts(http::Method::GET, "/v1/models/m")));
        assert!(!is_list_request(&parts(http::Method::POST, "/v1/models")));
    }
}
