//! `loxilb`: the loxi daemon (REST API, rule store, fullproxy). See `loxi_user::app`.
use loxi_user::config::Config;

fn main() -> anyhow::Result<()> {
    let cfg = Config::from_process();
    init_tracing(&cfg.flags.log)?;
    // Warnings were collected before tracing existed; log them now, once each.
    for w in &cfg.env.warnings {
        tracing::warn!(var = w.var, value = %w.value, used = %w.used, "{w}");
    }
    if !cfg.env.inert.is_empty() {
        tracing::warn!(
            vars = ?cfg.env.inert,
            "set but without effect: {} (the features they tune are not implemented in loxi yet)",
            cfg.env.inert.join(", ")
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(loxi_user::app::run(cfg))?;
    Ok(())
}

fn init_tracing(filter: &str) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|e| anyhow::anyhow!("--log {filter:?}: {e}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .init();
    Ok(())
}
