//! `loxilb`: the loxi daemon (REST API, rule store, fullproxy). See `loxi_user::app`.
use loxi_user::config::Config;

fn main() -> std::process::ExitCode {
    large_allocations_mmapped();
    let fds = raise_fd_limit();
    match run(fds) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Each reason once (anyhow's own report repeats sources the messages embed).
            eprintln!("Error: {}", loxi_user::app::report(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Parses flags and environment, sets up logging, runs the daemon until a signal. `fds` is
/// what [`raise_fd_limit`] did, logged here once logging exists.
fn run(fds: std::io::Result<(u64, u64)>) -> anyhow::Result<()> {
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
    log_fd_limit(fds, cfg.env.max_conns_per_listener);
    for u in &cfg.unknown_env {
        tracing::warn!(var = %u.name, "{u}");
    }
    for var in &cfg.empty_env {
        tracing::warn!(%var, "{var} is set but empty: read as unset, its default is used");
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

/// Raises the soft limit of open file descriptors to the hard limit, as nginx's
/// `worker_rlimit_nofile` and Go's runtime do: every fullproxy client connection may hold an
/// upstream connection too, and the usual soft default (1,024) runs out long before
/// `LOXI_MAX_CONNS_PER_LISTENER` (4,096). Returns the soft limit before and after.
///
/// Errors: `getrlimit`/`setrlimit`'s (e.g. a hard limit above `fs.nr_open`); the limit is then
/// left as it was.
fn raise_fd_limit() -> std::io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    #[allow(
        unsafe_code,
        reason = "getrlimit/setrlimit are the only way to read and raise RLIMIT_NOFILE"
    )]
    // SAFETY: both calls only read or write the `rlimit` they are given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let before = lim.rlim_cur;
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok((before, lim.rlim_cur))
    }
}

/// Logs the file-descriptor limit [`raise_fd_limit`] left, and warns when it is below what one
/// listener at `max_conns` client connections can need (two descriptors each: the client's
/// and its upstream's).
fn log_fd_limit(fds: std::io::Result<(u64, u64)>, max_conns: usize) {
    let limit = match fds {
        Ok((before, after)) => {
            if after > before {
                tracing::info!(
                    before,
                    after,
                    "raised the open-file limit (RLIMIT_NOFILE) to its hard limit"
                );
            }
            after
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read or raise the open-file limit (RLIMIT_NOFILE)");
            return;
        }
    };
    let want = 2 * max_conns as u64 + 64;
    if limit < want {
        tracing::warn!(
            limit,
            max_conns,
            "the open-file limit is below what LOXI_MAX_CONNS_PER_LISTENER can need ({want}: a client and an upstream \
             connection each); beyond it upstream connects fail with EMFILE (503 gateway_resources_exhausted). \
             Raise the hard limit (ulimit -Hn, podman/docker --ulimit nofile=N:N) or lower LOXI_MAX_CONNS_PER_LISTENER"
        );
    }
}
