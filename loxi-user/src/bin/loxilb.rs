//! `loxilb`: the loxi daemon (REST API, rule store, fullproxy). See `loxi_user::app`.
use loxi_user::config::Config;

fn main() -> anyhow::Result<()> {
    let cfg = Config::from_process();
    let mut telemetry = loxi_user::telemetry::init(&cfg.flags.log, cfg.flags.log_format, |k| {
        std::env::var(k).ok()
    })?;
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
    for w in &telemetry.warnings {
        tracing::warn!(var = w.var, value = %w.value, "{w}");
    }
    if telemetry.tracing_enabled() {
        tracing::info!("OpenTelemetry traces on (OTLP http/protobuf)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let res = rt.block_on(loxi_user::app::run(cfg));
    telemetry.shutdown();
    res?;
    Ok(())
}
