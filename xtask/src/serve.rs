//! `xtask l4-serve`: the L4 data path (`loxi_user::l4::run`) fed from a rules file that is
//! re-read every 100 ms, until SIGTERM/SIGINT. Used inside test and benchmark namespaces. On
//! exit it prints its metrics (Prometheus text) to stderr, so tests can read the data path's
//! counters from its log.
use std::{collections::BTreeSet, path::PathBuf, time::Duration};

use anyhow::Context as _;
use loxi_user::{
    l4::{L4Config, L4Metrics},
    rules::{model::LbRule, store::RuleStore},
};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Flags of `l4-serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// Interfaces to attach XDP to.
    #[arg(long = "xdp-iface")]
    xdp_iface: Vec<String>,
    /// Interfaces to run the whole data path on in TC ingress.
    #[arg(long = "tc-iface")]
    tc_iface: Vec<String>,
    /// Interface for VIPs (none: VIPs are not managed).
    #[arg(long = "vip-iface")]
    vip_iface: Option<String>,
    /// JSON array of LoxiLB rules (missing file = no rules).
    #[arg(long)]
    rules: Option<PathBuf>,
    /// Attach generic XDP instead of native.
    #[arg(long = "xdp-generic")]
    xdp_generic: bool,
}

/// Runs until a signal; detaches and releases VIPs on the way out.
pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(serve(a))
}

async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let store = RuleStore::in_memory();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = L4Metrics::register(&mut registry);
    let cfg = L4Config {
        xdp_ifaces: a.xdp_iface,
        tc_ifaces: a.tc_iface,
        vip_iface: a.vip_iface,
        vip_state_dir: None,
        stats_interval: Duration::from_secs(1),
        force_generic: a.xdp_generic,
    };
    let token = CancellationToken::new();
    let mut task = tokio::spawn(loxi_user::l4::run(
        cfg,
        store.subscribe(),
        store.follower("l4"),
        metrics,
        loxi_user::l4::ConntrackHandle::default(),
        token.clone(),
    ));
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    loop {
        if let Some(p) = &a.rules
            && let Err(e) = sync_rules(&store, p)
        {
            tracing::warn!(error = %e, "rules file");
        }
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            r = &mut task => return r.context("l4 task")?.context("l4 run"),
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    token.cancel();
    task.await.context("l4 task")?.context("l4 run")?;
    eprintln!(
        "{}",
        loxi_user::metrics::encode_text(&registry).context("encode metrics")?
    );
    Ok(())
}

fn sync_rules(store: &RuleStore, path: &PathBuf) -> anyhow::Result<()> {
    let rules: Vec<LbRule> = match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s).context("parse rules")?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    let want: BTreeSet<_> = rules.iter().map(|r| r.key()).collect();
    for k in store.snapshot().rules.keys() {
        if !want.contains(k) {
            store.delete(&k.external_ip, k.port, &k.protocol, &k.host, &k.model_name)?;
        }
    }
    for r in rules {
        if let Err(refused) = store.upsert(r.clone()) {
            // Another shape (e.g. mode) on the same key: replace the rule. No rule under the
            // key: the rule itself was refused, and that refusal is the error.
            let k = r.key();
            store
                .delete(&k.external_ip, k.port, &k.protocol, &k.host, &k.model_name)
                .map_err(|_| refused)?;
            store.upsert(r)?;
        }
    }
    Ok(())
}
