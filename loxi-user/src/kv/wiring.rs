//! How the daemon starts tier 1.5: settings from the process environment, the tokenizer pool,
//! the shared KV state, the subscriber manager following rule snapshots, the REST views, and the
//! [`AffinityTier`] the proxy calls.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::manager::KvManager;
use super::metrics::KvMetrics;
use super::select::KvRouter;
use super::settings::KvSettings;
use super::state::KvState;
use super::subscriber::StreamTiming;
use super::tokenizer::{TokenizerMetrics, TokenizerPool};
use crate::config::env::Env;
use crate::proxy::meta::RequestMeta;
use crate::routing::{AffinityTier, Candidates, Decision, EpIdx, TierMemo};
use crate::rules::{RuleSnapshot, StoredRule};

impl AffinityTier for KvRouter {
    fn select(
        &self,
        rule: &StoredRule,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        memo: &mut TierMemo,
    ) -> Option<Decision> {
        KvRouter::select(self, rule, meta, cands, memo)
    }
    fn routed(&self, rule: &StoredRule, meta: &RequestMeta, ep: EpIdx, memo: &TierMemo) {
        KvRouter::routed(self, rule, meta, ep, memo)
    }
}

impl KvSettings {
    /// The KV knobs of the environment the daemon read once at start.
    pub fn from_env(env: &Env) -> Self {
        Self {
            lb_mode: env.kv_lb_mode,
            mean_load_factor: env.kv_mean_load_factor,
            load_penalty: env.kv_load_penalty,
            spill_relief: env.kv_spill_relief,
            cap_sum_milli: env.kv_cap_sum_milli,
            coldstart_seed_n: u64::from(env.kv_coldstart_seed_n),
            coldstart_min_blocks: u64::from(env.kv_coldstart_min_blocks),
            max_blocks: env.kv_max_blocks,
            min_match_tokens: env.kv_min_match_tokens as usize,
            none_hash_seed: env.kv_none_hash_seed.clone(),
            hash_debug: env.kv_hash_debug,
            predicted_ttl: Duration::from_millis(env.kv_predict_ttl_ms),
            lora_paths: env.kv_lora_paths.clone(),
        }
    }
}

/// The running tier: what the proxy calls and what the API serves.
pub struct KvRuntime {
    /// Tier 1.5 for the proxy.
    pub tier: Arc<dyn AffinityTier>,
    /// Shared state (inventory, parity) for the REST views.
    pub state: Arc<KvState>,
}

/// Registers the KV metric families, builds the tokenizer pool over `tokenizer_dir`, and spawns
/// the subscriber manager, which follows `rules` until `shutdown`.
pub fn start(
    settings: KvSettings,
    tokenizer_dir: PathBuf,
    registry: &mut Registry,
    rules: watch::Receiver<Arc<RuleSnapshot>>,
    shutdown: CancellationToken,
) -> KvRuntime {
    let metrics = KvMetrics::register(registry);
    let tok_metrics = TokenizerMetrics::register(registry);
    tokio::spawn(track_rule_models(
        tok_metrics.clone(),
        rules.clone(),
        shutdown.clone(),
    ));
    let state = KvState::new(settings, metrics);
    let pool = Arc::new(TokenizerPool::new(tokenizer_dir, tok_metrics));
    let router = Arc::new(KvRouter::new(state.clone(), pool));
    let manager = KvManager::new(state.clone(), StreamTiming::default());
    tokio::spawn(manager.run(rules, shutdown));
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
