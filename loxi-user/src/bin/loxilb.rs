//! `loxilb`: the loxi daemon (REST API, rule store, fullproxy). See `loxi_user::app`.
use loxi_user::config::Config;

fn main() -> std::process::ExitCode {
    large_allocations_mmapped();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Each reason once (anyhow's own report repeats sources the messages embed).
            eprintln!("Error: {}", loxi_user::app::report(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Parses flags and environment, sets up logging, runs the daemon until a signal.
fn run() -> anyhow::Result<()> {
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
    if std::env::var_os("RUST_LOG").is_some() {
        tracing::warn!(
            log = %cfg.flags.log,
            "RUST_LOG is set but not read: the log filter is --log (or LoxiLB's --loglevel)"
        );
    }
    for u in &cfg.unknown_env {
        tracing::warn!(var = %u.name, "{u}");
    }
    for w in &telemetry.warnings {
        tracing::warn!(var = w.var, value = %w.value, "{w}");
    }
    if telemetry.tracing_enabled() {
        tracing::info!("OpenTelemetry traces on (OTLP http/protobuf)");
    }
    // The worker count is set here, validated: tokio would read `TOKIO_WORKER_THREADS` itself
    // and panic on a value it cannot use.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.runtime_workers)
        .enable_all()
        .build()?;
    let json = cfg.flags.log_format == loxi_user::telemetry::LogFormat::Json;
    let res = rt.block_on(loxi_user::app::run(cfg));
    if let Err(e) = &res
        && json
    {
        // Also as a JSON record, so a `--log-format json` pipeline keeps why the daemon
        // stopped (`main` prints the reason as plain text on stderr, as with `text` logs).
        tracing::error!(error = %loxi_user::app::report(e), "loxilb stopped on an error");
    }
    telemetry.shutdown();
    res?;
    Ok(())
}

/// Makes glibc serve every allocation of 1 MiB or more (request bodies up to
/// `LOXI_MAX_BODY_BYTES`) with its own `mmap`, returned to the kernel when freed. glibc's
/// default threshold rises with each freed large block up to 32 MiB, after which bodies of a
/// few MiB to 32 MiB come from the per-thread heaps, which keep the pages: a flood of 30 MB
/// bodies then left loxilb at ~630 MB RSS with 256 MiB of bodies live, ~290 MB with this
/// (scripts/bench-kv-bounds.sh, issue 9 §1). An operator's own `MALLOC_MMAP_THRESHOLD_` wins.
fn large_allocations_mmapped() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        #[allow(
            unsafe_code,
            reason = "mallopt is glibc's documented tuning call, made before any thread starts"
        )]
        // SAFETY: mallopt only sets an allocator parameter; no other thread exists yet.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        }
    }
}
