//! How the daemon starts tier 1.5: the tokenizer pool, the shared KV state, the subscriber
//! manager following rule snapshots, the predicted-block sweep, and the [`AffinityTier`] the
//! proxy calls. (The KV knobs come from `config::Env::kv`; this layer never reads the
//! environment.)

use std::path::PathBuf;
use std::sync::Arc;

use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::index::SWEEP_INTERVAL;
use super::ingest::manager::KvManager;
use super::ingest::subscriber::StreamTiming;
use super::metrics::KvMetrics;
use super::route::select::{KvRouter, KvTicket};
use super::settings::KvSettings;
use super::state::KvState;
use super::tokenizer::{TokenizerMetrics, TokenizerPool};
use crate::request::RequestMeta;
use crate::routing::{AffinityTier, Candidates, Decision, EpIdx};
use crate::rules::store::Applied;
use crate::rules::{RuleSnapshot, StoredRule};

impl AffinityTier for KvRouter {
    type Ticket = KvTicket;

    fn prepare<'a>(
        &'a self,
        rule: &'a StoredRule,
        meta: &'a RequestMeta,
        ticket: &'a mut KvTicket,
    ) -> futures::future::BoxFuture<'a, ()> {
        Box::pin(KvRouter::prepare(self, rule, meta, ticket))
    }

    fn select(
        &self,
        rule: &StoredRule,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        ticket: &mut KvTicket,
    ) -> Option<Decision> {
        KvRouter::select(self, rule, meta, cands, ticket)
    }
    fn routed(&self, rule: &StoredRule, meta: &RequestMeta, ep: EpIdx, ticket: &mut KvTicket) {
        KvRouter::routed(self, rule, meta, ep, ticket)
    }
    fn bypassed(&self, rule: &StoredRule, _: &RequestMeta) {
        KvRouter::bypassed(self, rule)
    }
    fn prompt_tokens<'a>(
        &'a self,
        meta: &'a RequestMeta,
        max: usize,
    ) -> futures::future::BoxFuture<'a, Option<Arc<[u32]>>> {
        Box::pin(KvRouter::prompt_tokens(self, meta, max))
    }
}

/// Tier 1.5 as the proxy holds it: any [`AffinityTier`] whose per-request ticket is the KV
/// tier's (the real [`KvRouter`], or a test double).
pub type KvTier = dyn AffinityTier<Ticket = KvTicket>;

/// The running tier: what the proxy calls and what the API serves.
pub struct KvRuntime {
    /// Tier 1.5 for the proxy.
    pub tier: Arc<KvTier>,
    /// Shared state (inventory, parity) for the REST views.
    pub state: Arc<KvState>,
}

/// Registers the KV metric families, builds the tokenizer pool over `tokenizer_dir`, and spawns
/// into `tasks` the subscriber manager, which follows `rules` until `shutdown`, the
/// predicted-block sweep and (unless `LOXI_KV_MODELS_POLL_MS` is 0) the `/v1/models` poller
/// that learns the engines' LoRA adapters.
pub fn start(
    settings: KvSettings,
    tokenizer_dir: PathBuf,
    registry: &mut Registry,
    rules: watch::Receiver<Arc<RuleSnapshot>>,
    applied: Applied,
    shutdown: CancellationToken,
    tasks: &mut JoinSet<()>,
) -> KvRuntime {
    let metrics = KvMetrics::register(registry);
    let tok_metrics = TokenizerMetrics::register(registry);
    tasks.spawn(track_rule_models(
        tok_metrics.clone(),
        rules.clone(),
        shutdown.clone(),
    ));
    let poll = settings.models_poll;
    let settings = KvSettings {
        tokenizer_dir: tokenizer_dir.clone(),
        ..settings
    };
    let state = KvState::new(settings, metrics);
    if !poll.is_zero() {
        tasks.spawn(super::lora::poll_models(
            state.lora.clone(),
            rules.clone(),
            poll,
            shutdown.clone(),
        ));
    }
    let pool = Arc::new(TokenizerPool::new(tokenizer_dir, tok_metrics));
    let router = Arc::new(KvRouter::new(state.clone(), pool));
    let manager = KvManager::new(state.clone(), StreamTiming::default());
    tasks.spawn(manager.run(rules, applied, shutdown.clone()));
    tasks.spawn(sweep_predictions(state.clone(), shutdown));
    KvRuntime {
        tier: router,
        state,
    }
}

/// Keeps the tokenizer metrics' label set equal to the model names of the current rules.
async fn track_rule_models(
    metrics: TokenizerMetrics,
    mut rules: watch::Receiver<Arc<RuleSnapshot>>,
    shutdown: CancellationToken,
) {
    loop {
        let snap = rules.borrow_and_update().clone();
        metrics.set_rule_models(
            snap.rules
                .values()
                .map(|r| r.rule.service.model_name.as_str()),
        );
        tokio::select! {
            changed = rules.changed() => if changed.is_err() { return },
            _ = shutdown.cancelled() => return,
        }
    }
}

/// Frees the expired predicted blocks of every service and publishes every endpoint's
/// readiness (`kv::readiness`) once per [`SWEEP_INTERVAL`] until `shutdown` (off the request path: a sweep takes each service index's write lock in turn; expired
/// predictions never score, so the sweep only bounds their memory).
pub async fn sweep_predictions(state: Arc<KvState>, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(SWEEP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = tokio::time::Instant::now();
        for svc in state.all() {
            svc.index.sweep_predicted(now);
        }
        super::readiness::publish(&state);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::kv::BlockKey;
    use crate::kv::testutil::{rule, state};

    #[tokio::test(start_paused = true)]
    async fn background_sweep_frees_expired_predictions() {
        let (st, _reg) = state(KvSettings::default());
        let svc = st
            .service(&rule(1, 2, serde_json::json!({})))
            .expect("kv rule");
        let now = tokio::time::Instant::now();
        svc.index
            .predict(1, &[BlockKey(7)], now + Duration::from_millis(1500));
        let stop = CancellationToken::new();
        let task = tokio::spawn(sweep_predictions(st.clone(), stop.clone()));
        tokio::time::sleep(Duration::from_millis(1100)).await;
        assert_eq!(svc.index.predicted_len(), 1, "not expired at the 1 s sweep");
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(svc.index.predicted_len(), 0, "freed by the 2 s sweep");
        stop.cancel();
        task.await.expect("sweep task ends on shutdown");
    }
}
