//! The daemon: builds the registry, restores the rule store, starts the API and the fullproxy,
//! and drains on SIGTERM/SIGINT (SIGHUP is logged and ignored).
//!
//! Order matters: rules are restored from the state dir *before* any listener opens, so the
//! first request after a restart already sees every rule. On a signal every listener stops
//! accepting at once; in-flight requests get [`crate::config::Flags::shutdown_grace`] to finish.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::api::security::ApiSecurity;
use crate::api::{self, ApiState, EndpointHealth, HealthBoard};
use crate::config::Config;
use crate::kv;
use crate::l4::{self, L4Config, L4Error, L4Metrics};
use crate::listen::{ListenMetrics, ListenSockets};
use crate::metrics::{self, ControlMetrics};
use crate::proxy::{self, ProxyConfig, ProxyContext, ProxyMetrics};
use crate::rules::RuleStore;
use crate::rules::persist::PersistError;

/// Errors that stop the daemon from starting.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The state directory cannot be created.
    #[error("opening the rule store: {0}")]
    Store(#[from] PersistError),
    /// Another process holds the state directory's lock (`<state-dir>/loxilb.lock`), or the
    /// lock cannot be taken.
    #[error("state dir {}: {why}", dir.display())]
    StateLocked {
        /// The state directory.
        dir: std::path::PathBuf,
        /// Who holds it, or the OS error.
        why: String,
    },
    /// The certificate directory of the state dir cannot be opened.
    #[error("opening the certificate store {}: {source}", path.display())]
    Certs {
        /// The directory (`<state-dir>/certs`).
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `--cert-dir` exists but is not a directory, or cannot be read.
    #[error("--cert-dir {}: {source}", path.display())]
    CertDir {
        /// The path given.
        path: std::path::PathBuf,
        /// Why it cannot be used.
        #[source]
        source: std::io::Error,
    },
    /// The API address cannot be bound.
    #[error("binding the REST API on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The L4 data path or VIP management failed (missing interface, XDP load/attach).
    #[error("L4 data path: {0}")]
    L4(#[source] L4Error),
    /// The API's TLS certificate or key cannot be used.
    #[error("REST API TLS: {0}")]
    Tls(#[from] crate::api::tls::TlsError),
    /// An API token source is set but unusable.
    #[error("REST API token: {0}")]
    Token(#[from] crate::config::TokenError),
    /// Installing the signal handlers failed.
    #[error("installing signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    /// The fullproxy's connection workers (`--proxy-workers`) could not be started.
    #[error("starting {n} fullproxy connection workers (--proxy-workers): {source}")]
    Workers {
        /// How many were asked for.
        n: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Runs the daemon until SIGTERM/SIGINT, then drains (SIGHUP is logged and ignored). Returns
/// after shutdown.
pub async fn run(cfg: Config) -> Result<(), AppError> {
    let shutdown = CancellationToken::new();
    spawn_signal_watch(shutdown.clone())?;
    run_until(cfg, shutdown).await
}

/// Runs the daemon until `shutdown` is cancelled (tests and embedders cancel it themselves).
pub async fn run_until(cfg: Config, shutdown: CancellationToken) -> Result<(), AppError> {
    // Held until this function returns: one daemon per state dir.
    let _state_lock = lock_state_dir(&cfg.flags.state_dir)?;
    let tokens = crate::config::ApiTokens::load(&cfg.flags.api, |k| std::env::var(k).ok())?;
    let tls = match (&cfg.flags.api.api_tls_cert, &cfg.flags.api.api_tls_key) {
        (Some(cert), Some(key)) => Some(api::tls::server_config(cert, key)?),
        _ => None,
    };
    let security = Arc::new(
        ApiSecurity::new(
            &tokens.admin,
            &tokens.read,
            &cfg.flags.api.api_allowed_origins,
            tls.is_some(),
        )
        .with_allowed_hosts(&cfg.flags.api.api_allowed_hosts),
    );
    warn_if_exposed(cfg.flags.api_addr, &tokens, tls.is_some());
    warn_token_setup(&tokens, &cfg.flags.api.api_allowed_hosts);
    let mut registry = metrics::new_registry();
    let sockets = ListenSockets::new(ListenMetrics::register(&mut registry));
    let control = ControlMetrics::register(&mut registry);
    let proxy_metrics = ProxyMetrics::register(&mut registry);
    // The fullproxy's connection workers (`--proxy-workers`; 0: the shared runtime).
    let workers = match cfg.proxy_workers() {
        0 => None,
        n => {
            let w = proxy::workers::Workers::start(n)
                .map_err(|source| AppError::Workers { n, source })?;
            proxy::workers::WorkersCollector::register(&mut registry, w.clone());
            Some(w)
        }
    };
    // Restore before any listener opens.
    let certs = Arc::new(crate::certs::CertStore::open(&cfg.flags.state_dir).map_err(
        |source| AppError::Certs {
            path: cfg.flags.state_dir.join("certs"),
            source,
        },
    )?);
    // Staged certificates (`--cert-dir`): the ones the store lacks are added now; one that
    // would replace a stored certificate is applied only when its files are newer than the
    // stored one (a rotation through the API is never undone by a stale file), and only once
    // the rules are restored, if it leaves none of them without a certificate (`certs::stage`).
    let staged =
        crate::certs::stage::read_dir(&cfg.flags.cert_dir).map_err(|source| AppError::CertDir {
            path: cfg.flags.cert_dir.clone(),
            source,
        })?;
    let (_, replacements) = crate::certs::stage::apply_new(&certs, staged);
    crate::certs::ExpiryCollector::register(&mut registry, certs.clone());
    // A rule is restored only if the API would accept it now: its backend TLS, and for a TLS
    // rule (`security: 1`) a certificate for its host among those restored, or the `default`
    // one (a stored certificate that no longer loads is skipped above; an expired one is
    // restored). An L4 rule on a daemon started
    // without `--xdp-iface` is kept and reported not served (`report_l4_rules_without_datapath`).
    let restored_certs = certs.snapshot();
    // A rule the newer staged certificates cover is kept too (they are applied below, each
    // only if it leaves no restored rule without a certificate).
    let staged_certs = crate::certs::stage::with_replacements(&restored_certs, &replacements);
    let store = Arc::new(RuleStore::open_checked(
        &cfg.flags.state_dir,
        &api::fields::restored_rule,
        &|rule| {
            proxy::upstream_tls::check(&rule.service)
                .map_err(|e| format!("no longer configures its backend TLS ({e})"))?;
            let s = &rule.service;
            if s.security != 0
                && !api::certs::servable(&restored_certs, &s.host)
                && !api::certs::servable(&staged_certs, &s.host)
            {
                return Err(format!(
                    "serves TLS (security {}) but no restored certificate covers host {:?} and \
                 there is no `default` one",
                    s.security, s.host
                ));
            }
            // Only the `default` certificate would answer its handshakes. When a stored
            // certificate failed to load, it may have been the host's: dropped, as POST would
            // refuse it now (else clients that verify get the wrong certificate). Otherwise it was
            // served so before the restart: kept, and said (below, once staging is done).
            if s.security != 0
                && !api::certs::has_certificate(&restored_certs, &s.host)
                && !api::certs::has_certificate(&staged_certs, &s.host)
                && !certs.unloaded().is_empty()
            {
                let (what, fix) = api::certs::missing_certificate(&restored_certs, &s.host);
                return Err(format!(
                    "serves TLS (security {}) for host {:?}, and stored certificates failed to \
                 load ({}): {what}; {fix}, then the rule",
                    s.security,
                    s.host,
                    certs
                        .unloaded()
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            Ok(())
        },
    )?);
    let rules = store.snapshot();
    crate::certs::stage::apply_replacements(&certs, replacements, |cur, next| {
        api::certs::uncovered(&rules, cur, next).map_or(Ok(()), Err)
    });
    warn_rules_without_certificate(&rules, &certs.snapshot());
    let mut tasks = JoinSet::new();
    // A warning the moment a served certificate expires (`certs::store`).
    tasks.spawn(certs.clone().watch_expiry(shutdown.clone()));
    let kv = kv::wiring::start(
        cfg.env.kv.clone(),
        cfg.flags.tokenizer_dir.clone(),
        &mut registry,
        store.subscribe(),
        store.follower("kv"),
        shutdown.clone(),
        &mut tasks,
    );
    // Endpoint health for `GET .../all`: the proxy publishes every pool's loads (whose
    // `healthy` flags the probes and the breaker drive) after each reconcile.
    let board = HealthBoard::new();
    let health: Arc<dyn EndpointHealth> = board.clone();
    crate::health::metrics::HealthCollector::register(&mut registry, board.clone());
    // Engine-reported load (`LOXI_ENGINE_METRICS_INTERVAL_MS`, 0 = off): each KV-rule
    // endpoint's `/metrics`, blended into the loads the proxy publishes on `board`.
    let engines = crate::health::engine::EngineBoard::new();
    crate::health::engine::EngineCollector::register(&mut registry, engines.clone());
    if cfg.env.engine_metrics_interval_ms > 0 {
        tasks.spawn(crate::health::engine::run(
            Duration::from_millis(cfg.env.engine_metrics_interval_ms),
            store.subscribe(),
            board.clone(),
            engines,
            shutdown.clone(),
        ));
    }
    let l4_metrics = L4Metrics::register(&mut registry);
    let registry = Arc::new(registry);
    let l4_failed = Arc::new(Mutex::new(None));
    let conntrack = l4::ConntrackHandle::default();
    tasks.spawn(run_l4(
        L4Config {
            vip_state_dir: Some(cfg.flags.state_dir.clone()),
            ..L4Config::from(&cfg.flags.l4)
        },
        store.subscribe(),
        store.follower("l4"),
        l4_metrics,
        conntrack.clone(),
        shutdown.clone(),
        l4_failed.clone(),
    ));
    tasks.spawn(track_rule_count(
        store.clone(),
        control.lb_rules.clone(),
        shutdown.clone(),
    ));
    let ctx = ProxyContext {
        workers,
        metrics: proxy_metrics,
        tier: Some(kv.tier.clone()),
        config: proxy_config(&cfg),
        health: board.clone(),
        sockets: sockets.clone(),
        certs: certs.clone(),
    };
    tasks.spawn(proxy::run(
        store.subscribe(),
        store.follower("fullproxy"),
        ctx,
        shutdown.clone(),
    ));
    let listener = TcpListener::bind(cfg.flags.api_addr)
        .await
        .map_err(|source| AppError::Bind {
            addr: cfg.flags.api_addr,
            source,
        })?;
    // The bound address: `--api-addr 127.0.0.1:0` gets its port from the OS.
    let bound = listener.local_addr().unwrap_or(cfg.flags.api_addr);
    // `url`: what a client types (`https://` under --api-tls-cert, where plain HTTP gets 400).
    let scheme = if tls.is_some() { "https" } else { "http" };
    tracing::info!(addr = %bound, url = %format!("{scheme}://{bound}"),
        rules = store.snapshot().rules.len(), "REST API listening");
    let l4_datapath = cfg.flags.l4.datapath_on();
    report_l4_rules_without_datapath(&store, l4_datapath);
    let rules = store.subscribe();
    let state = ApiState {
        store,
        registry,
        metrics: control,
        health,
        sockets,
        l4_datapath,
        conntrack,
        certs,
    };
    let app = api::router(state, api::kv::router(kv.state, rules)).layer(
        axum::middleware::from_fn_with_state(security, api::security::guard),
    );
    tasks.spawn(serve_api(listener, tls, app, shutdown.clone()));
    shutdown.cancelled().await;
    drain(tasks, cfg.flags.shutdown_grace()).await;
    match l4_failed.lock().take() {
        Some(e) => Err(AppError::L4(e)),
        None => Ok(()),
    }
}

/// Runs the L4 data path (XDP on `--xdp-iface`, TC on `--tc-iface`, VIPs on `--vip-iface`); a failure is logged,
/// recorded in `failed` and stops the daemon, so a missing interface is a start-up error.
async fn run_l4(
    cfg: L4Config,
    rules: tokio::sync::watch::Receiver<Arc<crate::rules::RuleSnapshot>>,
    applied: crate::rules::store::Applied,
    metrics: L4Metrics,
    conntrack: l4::ConntrackHandle,
    shutdown: CancellationToken,
    failed: Arc<Mutex<Option<L4Error>>>,
) {
    if let Err(e) = l4::run(cfg, rules, applied, metrics, conntrack, shutdown.clone()).await {
        tracing::error!(error = %e, "L4 data path failed; stopping");
        *failed.lock() = Some(e);
        shutdown.cancel();
    }
}

fn proxy_config(cfg: &Config) -> ProxyConfig {
    ProxyConfig {
        max_body_bytes: cfg.env.max_body_bytes,
        shutdown_grace: cfg.flags.shutdown_grace(),
        origin_err_threshold: cfg.env.pd_origin_err_threshold,
        conn: proxy::conn::ConnLimits {
            header_timeout: Duration::from_millis(cfg.env.header_timeout_ms),
            idle_timeout: Duration::from_millis(cfg.env.idle_timeout_ms),
            send_timeout: Duration::from_millis(cfg.env.send_timeout_ms),
            max_conns: cfg.env.max_conns_per_listener,
        },
        max_total_inflight: cfg.env.pd_max_total_inflight,
        admission: cfg.env.admission(),
        pd_prefill_timeout: Duration::from_secs(cfg.env.pd_prefill_timeout_sec.into()),
        pd_decode_timeout: Duration::from_secs(cfg.env.pd_decode_timeout_sec.into()),
        body_timeout: Duration::from_millis(cfg.env.body_timeout_ms),
        response_timeout: (cfg.env.upstream_response_timeout_ms > 0)
            .then(|| Duration::from_millis(cfg.env.upstream_response_timeout_ms)),
        body_budget: proxy::budget::BodyBudget::new(cfg.env.max_body_bytes_in_flight),
        models: proxy::models::ModelsConfig {
            cache: Duration::from_millis(cfg.env.models_cache_ms),
            timeout: Duration::from_millis(cfg.env.models_timeout_ms),
        },
        parse: crate::request::ParseLimits {
            max_string_bytes: cfg.env.kv.bounds.max_bytes,
            ..Default::default()
        },
        ..ProxyConfig::default()
    }
}

async fn serve_api(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    app: axum::Router,
    shutdown: CancellationToken,
) {
    let limits = api::serve::ApiLimits::default();
    match tls {
        None => api::serve::serve(listener, app, limits, shutdown).await,
        Some(cfg) => match api::tls::TlsListener::new(listener, cfg) {
            Ok(l) => api::serve::serve(l, app, limits, shutdown).await,
            Err(e) => tracing::error!(error = %e, "REST API server failed"),
        },
    }
}

/// Logs loudly when the API is reachable from other hosts without a token: anyone who can
/// reach it could then create, change and delete rules.
fn warn_if_exposed(addr: SocketAddr, tokens: &crate::config::ApiTokens, tls: bool) {
    if addr.ip().is_loopback() {
        return;
    }
    if tokens.admin.is_empty() {
        tracing::warn!(
            %addr,
            "SECURITY WARNING: the REST API listens on a non-loopback address WITHOUT a token: \
             anyone who can reach {addr} can create, change and delete rules. Set \
             --api-token-file (or LOXI_API_TOKEN), or bind --api-addr to 127.0.0.1"
        );
    } else if !tls {
        tracing::warn!(
            %addr,
            "the REST API listens on a non-loopback address without TLS: tokens cross the \
             network in clear text; set --api-tls-cert and --api-tls-key"
        );
    }
}

/// Logs the token setups that leave something the operator configured without effect: a
/// `--api-allowed-host` beside a token (with a token every request needs it whatever its
/// `Host`: the host check is for tokenless APIs only, `api::security`), and a read-only token
/// with no admin token (no request can write, and nothing else says so until a write fails).
fn warn_token_setup(tokens: &crate::config::ApiTokens, allowed_hosts: &[String]) {
    if !allowed_hosts.is_empty() && !tokens.is_empty() {
        tracing::warn!(
            hosts = ?allowed_hosts,
            "--api-allowed-host has no effect: an API token is configured, and with a token \
             every request needs the token whatever its Host (the token is the DNS-rebinding \
             defence; the Host check guards only a tokenless API), so any Host is answered; \
             drop --api-allowed-host"
        );
    }
    if tokens.admin.is_empty() && !tokens.read.is_empty() {
        tracing::warn!(
            "only a read-only API token is configured: every write (POST, PUT, DELETE) is \
             refused, 401 without a token and 403 with the read-only one; set \
             --api-token-file (or LOXI_API_TOKEN) for an admin token"
        );
    }
}

/// Warns for each restored TLS rule whose host no certificate's names match (kept: it was
/// served so before the restart): its handshakes get the `default` certificate, which clients
/// that verify refuse. The warning says what the host lacks and the fix for its kind (an IP
/// host needs `default` with that IP address, `api::certs::missing_certificate`).
fn warn_rules_without_certificate(
    rules: &crate::rules::store::RuleSnapshot,
    certs: &crate::certs::CertSnapshot,
) {
    for (key, r) in &rules.rules {
        let s = &r.rule.service;
        if s.security != 0 && !api::certs::has_certificate(certs, &s.host) {
            let (what, fix) = api::certs::missing_certificate(certs, &s.host);
            tracing::warn!(host = %s.host, rule = %key,
                "restored TLS rule whose host no certificate's names match: its handshakes get \
                 the `default` certificate, which clients that verify the certificate refuse \
                 ({what}); {fix}");
        }
    }
}

/// Takes the exclusive lock of `<dir>/loxilb.lock` (created, mode 0600; the directory too if
/// missing) and writes this process's id into it. Two daemons on one state dir would each
/// acknowledge rules and overwrite each other's `rules.json`, losing the other's; the second
/// one therefore does not start, and its error names the holder's pid. The lock is the
/// kernel's (`flock`), so it ends with the process, however it ends.
fn lock_state_dir(dir: &std::path::Path) -> Result<std::fs::File, AppError> {
    use std::io::{Read as _, Seek as _, Write as _};
    use std::os::unix::fs::OpenOptionsExt as _;
    let err = |why: String| AppError::StateLocked {
        dir: dir.to_path_buf(),
        why,
    };
    std::fs::create_dir_all(dir).map_err(|e| err(format!("creating it: {e}")))?;
    let path = dir.join("loxilb.lock");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|e| err(format!("opening {}: {e}", path.display())))?;
    match f.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = f.read_to_string(&mut holder);
            let holder = holder.trim();
            return Err(err(format!(
                "another loxilb (pid {}) uses it: two daemons on one state dir overwrite each \
                 other's rules; stop it or give this one its own --state-dir",
                if holder.is_empty() { "unknown" } else { holder }
            )));
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(err(format!("locking {}: {e}", path.display())));
        }
    }
    let pid = std::process::id();
    let written = f
        .set_len(0)
        .and_then(|()| f.rewind())
        .and_then(|()| writeln!(f, "{pid}"));
    if let Err(e) = written {
        tracing::warn!(file = %path.display(), error = %e, "writing the pid into the state dir lock");
    }
    Ok(f)
}

/// A restored L4 rule on a daemon without `--xdp-iface` or `--tc-iface` forwards nothing: say
/// so at start.
fn report_l4_rules_without_datapath(store: &RuleStore, l4_datapath: bool) {
    for r in store.snapshot().rules.values() {
        if !api::rules::has_data_path(&r.rule, l4_datapath) {
            tracing::error!(rule = %r.rule.key(), mode = r.rule.service.mode,
                "restored L4 rule is NOT served: this daemon runs without --xdp-iface or --tc-iface \
                 (no L4 data path); the API reports it OFFLINE until a restart with one of them");
        }
    }
}

/// Keeps `loxilb_lb_rules` equal to the number of stored rules.
async fn track_rule_count(
    store: Arc<RuleStore>,
    gauge: prometheus_client::metrics::gauge::Gauge,
    shutdown: CancellationToken,
) {
    let mut rx = store.subscribe();
    loop {
        let n = rx.borrow_and_update().rules.len();
        gauge.set(i64::try_from(n).unwrap_or(i64::MAX));
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            _ = shutdown.cancelled() => return,
        }
    }
}

/// Waits for every task up to `grace`, then aborts the rest.
async fn drain(mut tasks: JoinSet<()>, grace: Duration) {
    tracing::info!(
        grace_secs = grace.as_secs(),
        "shutting down: listeners closed, draining in-flight requests"
    );
    let all = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(grace, all).await.is_err() {
        tracing::warn!("grace period over; aborting remaining requests");
        tasks.abort_all();
    }
    tracing::info!("stopped");
}

#[allow(
    clippy::disallowed_methods,
    reason = "the root of the task tree: lives until a signal or the process ends"
)]
fn spawn_signal_watch(shutdown: CancellationToken) -> Result<(), AppError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(AppError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(AppError::Signals)?;
    // SIGHUP's default action ends the process at once, without the drain: an operator's
    // habitual reload (or a closed terminal) would cut every stream. Nothing is read from a
    // file that a reload could re-read, so it is logged and ignored.
    let mut hup = signal(SignalKind::hangup()).map_err(AppError::Signals)?;
    tokio::spawn(async move {
        let which = loop {
            tokio::select! {
                _ = term.recv() => break "SIGTERM",
                _ = int.recv() => break "SIGINT",
                _ = hup.recv() => tracing::warn!(
                    "SIGHUP ignored: loxi has no configuration file to reload (rules and \
                     certificates change through the REST API, flags and environment at a \
                     restart); SIGTERM stops it with a drain"
                ),
            }
        };
        tracing::info!(signal = which, "shutdown requested");
        shutdown.cancel();
    });
    Ok(())
}

/// `e` and its sources as the text of a start-up failure: the message, then a `Caused by:` line
/// per source whose text the lines before do not already hold (the daemon's error messages
/// embed their source, and some parsers' errors repeat their own source's text, so printing
/// every link showed one reason two or three times).
pub fn report(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut said = text.clone();
    let mut causes = Vec::new();
    let mut next = e.source();
    while let Some(cause) = next {
        let t = cause.to_string();
        if !said.contains(&t) {
            said.push_str(&t);
            causes.push(t);
        }
        next = cause.source();
    }
    if !causes.is_empty() {
        text.push_str("\n\nCaused by:");
        for c in causes {
            text.push_str("\n    ");
            text.push_str(&c);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_says_a_reason_once_and_names_the_certificate_directory() {
        let e = AppError::Certs {
            path: "/proc/nope/certs".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert_eq!(
            report(&e),
            "opening the certificate store /proc/nope/certs: entity not found"
        );
        let filter = crate::telemetry::init("a=b=c", crate::telemetry::LogFormat::Text, |_| None)
            .expect_err("not a filter");
        let text = report(&filter);
        assert!(text.starts_with("--log \"a=b=c\": "), "{text}");
        let reason = text.trim_start_matches("--log \"a=b=c\": ");
        assert!(!reason.is_empty() && !text.contains("Caused by"), "{text}");
    }

    #[test]
    fn report_adds_a_source_the_message_does_not_hold() {
        #[derive(Debug, thiserror::Error)]
        #[error("starting")]
        struct Outer(#[source] std::io::Error);
        let e = Outer(std::io::Error::other("disk full"));
        assert_eq!(report(&e), "starting\n\nCaused by:\n    disk full");
    }
}
