//! The mode-4 fullproxy.
//!
//! [`run`] follows the rule store's snapshots: every distinct mode-4 TCP `externalIP:port`
//! gets one [`listener::Listener`]; the rules sharing it are its model pools
//! ([`pool::PoolTable`]). Rules added, changed or deleted at runtime reconcile without a
//! restart; a listener whose last rule is deleted stops accepting and closes once its in-flight
//! requests finish (bounded by [`ProxyConfig::shutdown_grace`]).
//!
//! Files: `handler.rs` (one request), `pool.rs` (pools and model routing), `upstream.rs`
//! (clients; `upstream_h1.rs`: cleartext HTTP/1.1 connections driven by the request's task), `body.rs` (streaming with in-flight guards), `error.rs` (every error body),
//! `metrics.rs` (and `ai_metrics.rs`, LoxiLB's `loxilb_ai_*` families), `listener.rs` (accept
//! loop, connection cap), `conn.rs` (header-read, idle and send timeouts; `h2scan.rs`: where HTTP/2 heads begin and end), `valve.rs` (the global
//! in-flight valve `LLB_PD_MAX_TOTAL_INFLIGHT`), `admission.rs` (the per-endpoint admission
//! gate `LLB_PD_MAX_INFLIGHT_PER_EP` on the request path), `models.rs` (`GET /v1/models`: the union of
//! the pools' model lists), `pd.rs` (the
//! two legs of a P/D request: prefill, then decode with the prefill's transfer parameters). The request
//! metadata the handler extracts is the shared vocabulary of [`crate::request`].

pub mod admission;
pub mod ai_metrics;
pub mod attempt;
pub mod body;
pub mod budget;
pub mod conn;
pub mod error;
pub mod forwarded;
pub mod h2scan;
pub mod handler;
pub mod listener;
pub mod metrics;
pub mod models;
pub mod pd;
mod pd_dialects;
mod pd_legs;
pub mod per_endpoint;
pub mod pool;
pub mod tls;
pub mod upstream;
pub mod upstream_h1;
pub mod upstream_tls;
pub mod valve;
pub mod workers;

#[cfg(test)]
mod tier_tests;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use metrics::ProxyMetrics;

use crate::kv::wiring::KvTier;
use crate::routing::admission::CloseReason;
use crate::rules::store::Applied;
use crate::rules::{RuleSnapshot, StoredRule};
use handler::Handler;
use listener::Listener;
use pool::PoolTable;
use upstream::Upstreams;

impl ProxyConfig {
    /// The passive circuit breaker these settings describe, its timers tracked by `timers` and
    /// ended by `stop`.
    pub fn breaker(
        &self,
        timers: TaskTracker,
        stop: CancellationToken,
    ) -> crate::health::breaker::Breaker {
        crate::health::breaker::Breaker {
            threshold: self.origin_err_threshold,
            cooldown: self.breaker_cooldown,
            timers,
            stop,
        }
    }
}

/// Limits and timeouts of the fullproxy.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Largest request body read (bytes); larger → 413. Default 32 MiB.
    pub max_body_bytes: usize,
    /// Upstream TCP connect timeout. Default 3 s.
    pub connect_timeout: Duration,
    /// How long a closing listener (rule deleted, daemon shutdown) waits for in-flight
    /// requests. Default 30 s.
    pub shutdown_grace: Duration,
    /// Consecutive origin 5xx / connect failures that open an endpoint's breaker
    /// (`LLB_PD_ORIGIN_ERR_THRESHOLD`, default 3; 0 disables).
    pub origin_err_threshold: u32,
    /// How long an open breaker holds an endpoint down before half-opening. Default 10 s.
    pub breaker_cooldown: Duration,
    /// Header-read timeout, idle timeout and connection cap of every listener.
    pub conn: conn::ConnLimits,
    /// Requests in flight across all listeners before new ones get 429
    /// (`LLB_PD_MAX_TOTAL_INFLIGHT`; 0 = off, the default).
    pub max_total_inflight: u32,
    /// The per-endpoint admission gate (`LLB_PD_MAX_INFLIGHT_PER_EP`,
    /// `LLB_PD_QUEUE_DEPTH_PER_EP`, `LLB_PD_MAX_PARK_SEC`, `LOXI_ADMISSION_SCOPE`); off by
    /// default. See [`admission`].
    pub admission: crate::routing::admission::AdmissionSettings,
    /// P/D prefill-leg timeout (`LLB_PD_PREFILL_TIMEOUT_SEC`, default 30 s): 504
    /// `pd_prefill_timeout` past it.
    pub pd_prefill_timeout: Duration,
    /// P/D decode-leg first-byte timeout (`LLB_PD_DECODE_TIMEOUT_SEC`, default 60 s): 504
    /// `pd_decode_timeout` past it.
    pub pd_decode_timeout: Duration,
    /// Longest a request's body may take to arrive, from its head, waiting for the body
    /// budget included (`LOXI_BODY_TIMEOUT_MS`, default 60 s); past it 408.
    pub body_timeout: Duration,
    /// Longest a request waits for its backend's response head after dispatch
    /// (`LOXI_UPSTREAM_RESPONSE_TIMEOUT_MS`, default 30 min; `None` = no limit); past it 504
    /// `upstream_timeout`, and the breaker counts a failure.
    pub response_timeout: Option<Duration>,
    /// Request-body bytes held at once across every listener
    /// (`LOXI_MAX_BODY_BYTES_IN_FLIGHT`, default 256 MiB).
    pub body_budget: budget::BodyBudget,
    /// Bounds of the routing parse of request bodies (strings cut at
    /// `LOXI_KV_MAX_PROMPT_BYTES`, a node budget; see `request::bounded`).
    pub parse: crate::request::ParseLimits,
    /// The aggregated `GET /v1/models` answer's cache and per-endpoint timeout
    /// (`LOXI_MODELS_CACHE_MS`, `LOXI_MODELS_TIMEOUT_MS`).
    pub models: models::ModelsConfig,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 32 << 20,
            connect_timeout: Duration::from_secs(3),
            shutdown_grace: Duration::from_secs(30),
            origin_err_threshold: 3,
            breaker_cooldown: Duration::from_secs(10),
            conn: conn::ConnLimits::default(),
            max_total_inflight: 0,
            admission: crate::routing::admission::AdmissionSettings::default(),
            pd_prefill_timeout: Duration::from_secs(30),
            pd_decode_timeout: Duration::from_secs(60),
            parse: crate::request::ParseLimits::default(),
            body_timeout: Duration::from_secs(60),
            response_timeout: Some(Duration::from_secs(1800)),
            body_budget: budget::BodyBudget::default(),
            models: models::ModelsConfig::default(),
        }
    }
}

/// What the proxy needs from the app.
#[derive(Clone)]
pub struct ProxyContext {
    /// Metric handles (registered by the app).
    pub metrics: ProxyMetrics,
    /// Tier 1.5 for rules with `kvExactMode: 3`, when the KV subsystem runs.
    pub tier: Option<Arc<KvTier>>,
    /// Limits.
    pub config: ProxyConfig,
    /// Where each rule's live endpoint loads (health flags) are published for the API.
    pub health: Arc<crate::health::board::HealthBoard>,
    /// Listening sockets: staged by the API for new rules, bind failures reported back.
    pub sockets: Arc<crate::listen::ListenSockets>,
    /// The certificates TLS listeners (`security: 1`) serve, looked up per handshake.
    pub certs: Arc<crate::certs::CertStore>,
    /// Where accepted client connections are served: the connection workers
    /// (`--proxy-workers`, see [`workers`]), or `None` for the runtime that runs [`run`].
    pub workers: Option<Arc<workers::Workers>>,
}

/// Runs the fullproxy until `shutdown`: reconciles listeners with every rule snapshot (and
/// marks each one in `applied` once its pools serve new requests), then on shutdown closes
/// every listener and waits for in-flight requests (up to the grace period).
pub async fn run(
    mut rules: watch::Receiver<Arc<RuleSnapshot>>,
    applied: Applied,
    ctx: ProxyContext,
    shutdown: CancellationToken,
) {
    let mut rec = Reconciler::new(ctx);
    let mut snap = rules.borrow_and_update().clone();
    rec.apply(&snap).await;
    applied.mark(snap.version);
    loop {
        let retry = rec.next_retry();
        tokio::select! {
            _ = shutdown.cancelled() => break,
            changed = rules.changed() => {
                if changed.is_err() { shutdown.cancelled().await; break }
                snap = rules.borrow_and_update().clone();
                rec.apply(&snap).await;
                applied.mark(snap.version);
            }
            _ = sleep_until_opt(retry) => rec.retry_unbound(&snap).await,
        }
    }
    rec.close_all().await;
}

/// Sleeps until `at`, or forever when there is nothing to retry.
async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// An address whose listener could not be bound, retried with [`crate::listen::backoff`].
struct Unbound {
    attempts: u32,
    next: tokio::time::Instant,
}

/// Listener bookkeeping across snapshots.
struct Reconciler {
    ctx: ProxyContext,
    upstreams: Upstreams,
    valve: Arc<valve::Valve>,
    listeners: HashMap<SocketAddr, Listener>,
    unbound: HashMap<SocketAddr, Unbound>,
    /// Every task the pools and handlers spawn (active probers, breaker timers), stopped and
    /// awaited at shutdown.
    tasks: TaskTracker,
    /// Parent of every prober's cancel token; ends breaker timers.
    stop: CancellationToken,
}

impl Reconciler {
    fn new(ctx: ProxyContext) -> Self {
        let shards = ctx.workers.as_ref().map_or(0, |w| w.len());
        let upstreams = Upstreams::new(ctx.config.connect_timeout, shards);
        let valve = valve::Valve::new(ctx.config.max_total_inflight);
        Self {
            ctx,
            upstreams,
            valve,
            listeners: HashMap::new(),
            unbound: HashMap::new(),
            tasks: TaskTracker::new(),
            stop: CancellationToken::new(),
        }
    }

    /// When the earliest unbound listener is due for another bind attempt.
    fn next_retry(&self) -> Option<tokio::time::Instant> {
        self.unbound.values().map(|u| u.next).min()
    }

    /// Retries the unbound listeners that are due (only those: bound ones are untouched).
    async fn retry_unbound(&mut self, snap: &RuleSnapshot) {
        let now = tokio::time::Instant::now();
        let due: Vec<SocketAddr> = self
            .unbound
            .iter()
            .filter(|(_, u)| u.next <= now)
            .map(|(a, _)| *a)
            .collect();
        let mut wanted = group_by_address(snap);
        for addr in due {
            match wanted.remove(&addr) {
                Some(rules) => self.upsert_listener(addr, &rules).await,
                None => {
                    self.unbound.remove(&addr);
                }
            }
        }
        self.publish_health();
    }

    async fn apply(&mut self, snap: &RuleSnapshot) {
        let wanted = group_by_address(snap);
        let gone: Vec<SocketAddr> = self
            .listeners
            .keys()
            .filter(|a| !wanted.contains_key(a))
            .copied()
            .collect();
        for addr in gone {
            if let Some(l) = self.listeners.remove(&addr) {
                tracing::info!(%addr, "last rule deleted; closing listener after in-flight requests");
                let gone = PoolTable::default();
                let table = l.table.load();
                table.forget_replaced(&gone, &self.ctx.metrics);
                table.close_dropped_gates(&gone, CloseReason::Removed);
                drop(l.close());
                self.ctx.metrics.forget_listener(addr);
                self.ctx.sockets.release(addr);
            }
        }
        self.unbound.retain(|a, _| wanted.contains_key(a));
        self.ctx.sockets.retain_wanted(|a| wanted.contains_key(a));
        for (addr, rules) in wanted {
            self.upsert_listener(addr, &rules).await;
        }
        self.publish_health();
    }

    /// Publishes every pool's loads by service id (see [`crate::health::board::HealthBoard`]).
    fn publish_health(&self) {
        let mut all = HashMap::new();
        for l in self.listeners.values() {
            for pool in &l.table.load().pools {
                all.insert(pool.rule.id, pool.loads.clone());
            }
        }
        self.ctx.health.replace_all(all);
    }

    async fn upsert_listener(&mut self, addr: SocketAddr, rules: &[Arc<StoredRule>]) {
        if let Some(l) = self.listeners.get(&addr) {
            let current = l.table.load();
            let next = Arc::new(PoolTable::build(rules, &current));
            current.forget_replaced(&next, &self.ctx.metrics);
            l.table.store(next.clone());
            current.close_dropped_gates(&next, CloseReason::Removed);
            next.activate(&self.tasks, &self.stop);
            return;
        }
        let first = Arc::new(PoolTable::build(rules, &PoolTable::default()));
        first.activate(&self.tasks, &self.stop);
        let table = Arc::new(ArcSwap::from(first));
        let handler = Arc::new(Handler {
            table,
            breaker: Arc::new(
                self.ctx
                    .config
                    .breaker(self.tasks.clone(), self.stop.clone()),
            ),
            ctx: self.ctx.clone(),
            upstreams: self.upstreams.clone(),
            models: models::ModelsCache::default(),
        });
        let tcp = self
            .ctx
            .sockets
            .acquire(addr)
            .and_then(tokio::net::TcpListener::from_std);
        match tcp {
            Ok(tcp) => {
                self.unbound.remove(&addr);
                self.listeners.insert(
                    addr,
                    Listener::serve(addr, tcp, handler, self.valve.clone()),
                );
            }
            Err(e) => {
                let u = self.unbound.entry(addr).or_insert(Unbound {
                    attempts: 0,
                    next: tokio::time::Instant::now(),
                });
                u.attempts += 1;
                let delay = crate::listen::backoff(u.attempts);
                u.next = tokio::time::Instant::now() + delay;
                tracing::error!(%addr, error = %e, attempt = u.attempts, retry_in = ?delay,
                    "cannot open fullproxy listener; retrying");
            }
        }
    }

    async fn close_all(&mut self) {
        for (addr, l) in &self.listeners {
            self.ctx.sockets.release(*addr);
            // Parked requests are answered (503 `pd_admission_closed`) now, not left to the
            // grace period; admitted ones finish within it.
            l.table
                .load()
                .close_dropped_gates(&PoolTable::default(), CloseReason::Shutdown);
        }
        let closing: Vec<_> = self.listeners.drain().map(|(_, l)| l.close()).collect();
        for c in closing {
            let _ = c.await;
        }
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Mode-4 TCP rules grouped by listen address, in rule-key order.
fn group_by_address(snap: &RuleSnapshot) -> BTreeMap<SocketAddr, Vec<Arc<StoredRule>>> {
    let mut out: BTreeMap<SocketAddr, Vec<Arc<StoredRule>>> = BTreeMap::new();
    for r in snap.rules.values() {
        let s = &r.rule.service;
        if s.mode != loxi_common::mode::FULLPROXY || !s.protocol.eq_ignore_ascii_case("tcp") {
            continue;
        }
        match s.external_ip.parse::<IpAddr>() {
            Ok(ip) => out
                .entry(SocketAddr::new(ip, s.port))
                .or_default()
                .push(r.clone()),
            Err(e) => tracing::error!(ip = %s.external_ip, error = %e, "bad externalIP"),
        }
    }
    out
}
