//! Daemon configuration: command-line flags ([`Flags`], clap) and the process environment
//! ([`env::Env`], read once at start).
//!
//! Flags follow the daemon contract (`loxilb --api-addr 127.0.0.1:PORT --state-dir DIR
//! --tokenizer-dir DIR --log info`); the environment follows LoxiLB's `LOXILB_*` / `LLB_*`
//! variables (`../shared/spec/configuration-and-tuning.txt`) plus loxi's own `LOXI_*`.
pub mod env;
pub mod known;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser};

pub use env::{Env, EnvWarning, KvLbMode};

/// Command-line flags of the `loxilb` daemon.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "loxilb",
    version,
    about = "loxi: LoxiLB-compatible load balancer for LLM inference fleets"
)]
pub struct Flags {
    /// Address of the REST API (`/netlox/v1/...`). The flag wins over `LOXI_API_ADDR` (which
    /// the container image's health check reads too).
    #[arg(long, env = "LOXI_API_ADDR", default_value = "127.0.0.1:11111")]
    pub api_addr: SocketAddr,
    /// Directory of the persistent state (`rules.json`); created if missing.
    #[arg(long, default_value = "/var/lib/loxilb")]
    pub state_dir: PathBuf,
    /// Tokenizer staging directory: `<dir>/<model slug>/tokenizer.json`, slug = model id with
    /// `/` replaced by `__` (LoxiLB's layout).
    #[arg(long, default_value = "/etc/loxilb/tokenizers")]
    pub tokenizer_dir: PathBuf,
    /// Staged TLS certificates (LoxiLB's layout): `<dir>/server.crt` + `server.key` is the
    /// `default` certificate, `<dir>/<name>/server.crt` + `server.key` certificate `<name>`;
    /// loaded at start into the cert store (see `certs::stage`). A missing directory is fine;
    /// a path that is not a directory stops the daemon at start.
    #[arg(long, default_value = "/opt/loxilb/cert")]
    pub cert_dir: PathBuf,
    /// LoxiLB's API-server spelling of the API address's IP (`--host`; LoxiLB's default is
    /// 0.0.0.0, loxi's stays loopback). Replaces the IP of `--api-addr` / `LOXI_API_ADDR`.
    #[arg(long, value_name = "IP")]
    pub host: Option<std::net::IpAddr>,
    /// LoxiLB's API-server spelling of the API port (`--port`). Replaces the port of
    /// `--api-addr` / `LOXI_API_ADDR`.
    #[arg(long, value_name = "PORT")]
    pub port: Option<u16>,
    /// Log filter in `tracing_subscriber::EnvFilter` syntax (e.g. `info`, `loxi_user=debug`).
    #[arg(long, default_value = "info")]
    pub log: String,
    /// LoxiLB's log level (`debug`, `info`, `notice`, `warning`, `error`, `critical`, `alert`,
    /// `emergency`), mapped to `--log` (`notice` → info, `warning` → warn, the last four →
    /// error).
    #[arg(long, value_name = "LEVEL", conflicts_with = "log", value_parser = loxilb_log_level)]
    pub loglevel: Option<String>,
    /// Log line format on stderr: `text` or `json` (one object per line).
    #[arg(long, value_enum, default_value_t = crate::telemetry::LogFormat::Text)]
    pub log_format: crate::telemetry::LogFormat,
    /// Fullproxy connection workers: threads with a single-threaded runtime each, which serve
    /// the client connections the listeners accept (see `proxy::workers`). Default: the shared
    /// runtime's worker count (`TOKIO_WORKER_THREADS`, else one per available CPU). 0 serves
    /// every connection on the shared work-stealing runtime instead.
    #[arg(long, env = "LOXI_PROXY_WORKERS", value_name = "N",
          value_parser = clap::value_parser!(u16).range(0..=1024))]
    pub proxy_workers: Option<u16>,
    /// Seconds in-flight requests may take to finish after SIGTERM/SIGINT before the process
    /// exits anyway (listeners stop accepting at once).
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// The L4 (XDP) data path and VIP management.
    #[command(flatten)]
    pub l4: crate::l4::L4Args,
    /// The REST API's authentication and TLS.
    #[command(flatten)]
    pub api: ApiArgs,
}

/// Security of the REST API (see `crate::api::security` and the README's "Security model").
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ApiArgs {
    /// PEM certificate chain of the REST API; with `--api-tls-key` the API serves HTTPS only.
    #[arg(long, value_name = "FILE", requires = "api_tls_key")]
    pub api_tls_cert: Option<PathBuf>,
    /// PEM private key of `--api-tls-cert`.
    #[arg(long, value_name = "FILE", requires = "api_tls_cert")]
    pub api_tls_key: Option<PathBuf>,
    /// File whose first non-empty line is the admin bearer token (also `LOXI_API_TOKEN`).
    /// With a token configured every API request needs `Authorization: Bearer <token>`.
    #[arg(long, value_name = "FILE")]
    pub api_token_file: Option<PathBuf>,
    /// File whose first non-empty line is a read-only bearer token (`GET` only; also
    /// `LOXI_API_READ_TOKEN`).
    #[arg(long, value_name = "FILE")]
    pub api_read_token_file: Option<PathBuf>,
    /// A browser origin (`https://lb.example.com`) allowed besides the API's own (repeatable):
    /// `http` or `https`, `://`, a host and an optional port, as browsers send `Origin`; any
    /// other value is a usage error.
    #[arg(long = "api-allowed-origin", value_name = "ORIGIN", value_parser = api_origin)]
    pub api_allowed_origins: Vec<String>,
    /// A DNS name (`lb.example.com`, no port) by which tokenless clients may address the API
    /// (repeatable). Without a token, requests whose `Host` is any other DNS name get 403
    /// (DNS-rebinding defence); IP addresses and `localhost` always pass, so giving one is a
    /// usage error, as is an empty value or one with a scheme, port or path.
    #[arg(long = "api-allowed-host", value_name = "NAME", value_parser = api_host_name)]
    pub api_allowed_hosts: Vec<String>,
}

/// `--api-allowed-origin`: `http(s)://host[:port]` (one trailing `/` tolerated), as a browser
/// sends `Origin`; the value is kept as given (the API's policy compares it normalised).
fn api_origin(s: &str) -> Result<String, String> {
    let refuse = |why: &str| {
        Err(format!(
            "{s:?} is not an origin ({why}): give scheme://host[:port] with scheme http or \
             https, e.g. https://lb.example.com or http://10.0.0.5:8080, as browsers send Origin"
        ))
    };
    let Some((scheme, authority)) = s.split_once("://") else {
        return refuse("no scheme://");
    };
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return refuse("the scheme is not http or https");
    }
    let (host_ok, port) = match authority.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((ip, rest)) if ip.parse::<std::net::Ipv6Addr>().is_ok() => (true, rest),
            _ => return refuse("not an IPv6 address in brackets"),
        },
        None => match authority.split_once(':') {
            Some((h, _)) => (is_host_name(h), &authority[h.len()..]),
            None => (is_host_name(authority), ""),
        },
    };
    if !host_ok {
        return refuse("no host, or a path, user or character a host cannot have");
    }
    let port_ok = match port.strip_prefix(':') {
        None => port.is_empty(),
        Some(p) => p.parse::<u16>().is_ok_and(|p| p > 0),
    };
    if !port_ok {
        return refuse("the port is not 1..=65535");
    }
    Ok(s.to_string())
}

/// `--api-allowed-host`: a DNS name alone (letters, digits, `-`, `_`, dot-separated labels).
fn api_host_name(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err(
            "the name is empty: give a DNS name by which clients address the API, e.g. \
             lb.example.com"
                .into(),
        );
    }
    let bare = s
        .strip_prefix('[')
        .and_then(|v| v.strip_suffix(']'))
        .unwrap_or(s);
    if bare.parse::<std::net::IpAddr>().is_ok() || s.eq_ignore_ascii_case("localhost") {
        return Err(format!(
            "{s:?} is an IP address or localhost, which always pass the API's Host check, so \
             listing it would have no effect: --api-allowed-host is for DNS names (e.g. \
             lb.example.com); drop it"
        ));
    }
    if !is_host_name(s) {
        return Err(format!(
            "{s:?} is not a DNS name: give the name alone (e.g. lb.example.com), without \
             scheme, port or path"
        ));
    }
    Ok(s.to_string())
}

/// True when `s` is dot-separated non-empty labels of ASCII letters, digits, `-` and `_`.
fn is_host_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// Environment variable holding the admin API token.
pub const API_TOKEN_ENV: &str = "LOXI_API_TOKEN";
/// Environment variable holding a read-only API token.
pub const API_READ_TOKEN_ENV: &str = "LOXI_API_READ_TOKEN";

/// A token source that is set but unusable (the daemon does not start).
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The token file cannot be read.
    #[error("reading the API token file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The token file or variable holds no token (auth would silently be off).
    #[error("{0} holds no token")]
    Empty(String),
    /// A read-only token equal to an admin token: it would write (the admin token wins).
    #[error(
        "a read-only API token ({API_READ_TOKEN_ENV} / --api-read-token-file) equals an admin \
         token ({API_TOKEN_ENV} / --api-token-file), so it could write; give them different values"
    )]
    ReadEqualsAdmin,
}

/// The usage error text when a token is given twice, by its file flag and by its variable
/// (`--api-token-file` and `LOXI_API_TOKEN`, or `--api-read-token-file` and
/// `LOXI_API_READ_TOKEN`): both would be accepted, so an old token left in the environment
/// would survive a rotation of the file. `lookup` reads the environment; an empty variable
/// counts as unset, and a variable holding the file's token (its first non-empty line; both
/// trimmed) is no second token. `None` when each token has one source at most.
pub fn token_source_conflict(
    args: &ApiArgs,
    lookup: impl Fn(&str) -> Option<String>,
) -> Option<String> {
    [
        (
            &args.api_token_file,
            "--api-token-file",
            API_TOKEN_ENV,
            "admin",
        ),
        (
            &args.api_read_token_file,
            "--api-read-token-file",
            API_READ_TOKEN_ENV,
            "read-only",
        ),
    ]
    .into_iter()
    .find_map(|(file, flag, env, kind)| {
        let file = file.as_ref()?;
        let value = lookup(env).filter(|v| !v.trim().is_empty())?;
        // The same token both ways is one token: the container image's health check (loxicmd)
        // reads the variable while the daemon is given the file.
        if std::fs::read_to_string(file)
            .is_ok_and(|t| t.lines().map(str::trim).find(|l| !l.is_empty()) == Some(value.trim()))
        {
            return None;
        }
        Some(format!(
            "the {kind} API token is given twice, by {flag} {} and by the environment variable \
             {env}: both would be accepted, so an old token would outlive a rotation of the \
             file; keep one source (unset {env}, or drop {flag})",
            file.display()
        ))
    })
}

/// The API tokens: admin and read-only, each from its file and its environment variable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiTokens {
    /// Admin tokens (every route).
    pub admin: Vec<String>,
    /// Read-only tokens (`GET`/`HEAD`).
    pub read: Vec<String>,
}

impl ApiTokens {
    /// Reads the token files of `args` and the variables through `lookup`.
    pub fn load(
        args: &ApiArgs,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, TokenError> {
        let mut t = Self::default();
        for (file, env, into) in [
            (&args.api_token_file, API_TOKEN_ENV, &mut t.admin),
            (&args.api_read_token_file, API_READ_TOKEN_ENV, &mut t.read),
        ] {
            if let Some(path) = file {
                let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
                    path: path.display().to_string(),
                    source,
                })?;
                into.push(
                    first_line(&text).ok_or_else(|| {
                        TokenError::Empty(format!("token file {}", path.display()))
                    })?,
                );
            }
            if let Some(v) = lookup(env) {
                into.push(first_line(&v).ok_or_else(|| TokenError::Empty(env.to_string()))?);
            }
        }
        if t.read.iter().any(|r| t.admin.contains(r)) {
            return Err(TokenError::ReadEqualsAdmin);
        }
        Ok(t)
    }

    /// True when no token is configured (the API is open to whoever can reach it).
    pub fn is_empty(&self) -> bool {
        self.admin.is_empty() && self.read.is_empty()
    }
}

fn first_line(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
}

impl Flags {
    /// Folds LoxiLB's spellings into loxi's: `--host`/`--port` into `api_addr`, `--loglevel`
    /// into `log`.
    pub fn resolve_aliases(mut self) -> Self {
        if let Some(ip) = self.host {
            self.api_addr.set_ip(ip);
        }
        if let Some(port) = self.port {
            self.api_addr.set_port(port);
        }
        if let Some(level) = self.loglevel.take() {
            self.log = level;
        }
        self
    }

    /// The shutdown grace period as a `Duration`.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace_secs)
    }
}

/// The variable tokio reads for the shared runtime's worker count, and the default of
/// `--proxy-workers`.
pub const TOKIO_WORKERS_ENV: &str = "TOKIO_WORKER_THREADS";

/// Largest `TOKIO_WORKER_THREADS` accepted (the `--proxy-workers` range, which it defaults).
pub const MAX_RUNTIME_WORKERS: usize = 1024;

/// The shared runtime's worker threads from `TOKIO_WORKER_THREADS`'s value: an integer
/// 1..=[`MAX_RUNTIME_WORKERS`]; unset or empty: the CPUs available to the process.
///
/// # Errors
/// The usage error text (naming the variable, its value and what is accepted) for any other
/// value: tokio itself would panic on a value it cannot parse or on 0.
pub fn runtime_workers_from(value: Option<&str>) -> Result<usize, String> {
    let cpus = || std::thread::available_parallelism().map_or(1, |n| n.get());
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(cpus());
    };
    match v.parse::<usize>() {
        Ok(n) if (1..=MAX_RUNTIME_WORKERS).contains(&n) => Ok(n),
        _ => Err(format!(
            "invalid value {v:?} for the environment variable {TOKIO_WORKERS_ENV}: the shared \
             runtime's worker threads (and the default of --proxy-workers) must be an integer \
             1..={MAX_RUNTIME_WORKERS}; unset it to use one per CPU"
        )),
    }
}

/// LoxiLB's `--loglevel` values → a `tracing` filter level.
fn loxilb_log_level(s: &str) -> Result<String, String> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "debug" => "debug",
        "info" | "notice" => "info",
        "warning" | "warn" => "warn",
        "error" | "critical" | "alert" | "emergency" => "error",
        other => {
            return Err(format!(
                "{other:?} is not one of debug, info, notice, warning, error, critical, alert, emergency"
            ));
        }
    }
    .to_string())
}

/// Everything the daemon needs to start: flags plus the environment snapshot.
#[derive(Debug, Clone)]
pub struct Config {
    /// Command-line flags.
    pub flags: Flags,
    /// Environment read once at start.
    pub env: Env,
    /// The shared tokio runtime's worker threads: `TOKIO_WORKER_THREADS` (validated by
    /// [`runtime_workers_from`]), else one per CPU. The binary passes it to tokio's builder, so
    /// tokio never parses the variable itself.
    pub runtime_workers: usize,
    /// Set `LOXI_*`, `LOXILB_*` and `LLB_*` variables loxi does not know (misspellings), each
    /// with the closest known name; the binary warns once for each.
    pub unknown_env: Vec<known::UnknownVar>,
    /// The daemon's variables set to an empty value (read as unset: the default runs); the
    /// binary warns once for each.
    pub empty_env: Vec<String>,
}

impl Config {
    /// Parses the process arguments (exits with clap's usage on error) and reads the process
    /// environment. Rejected variables are in `env.warnings`; the binary logs them once
    /// tracing is up.
    pub fn from_process() -> Self {
        let flags = match Flags::try_parse() {
            Ok(f) => f.resolve_aliases(),
            Err(e) => {
                let note = env_note(&e.to_string(), |k| std::env::var(k).ok());
                let code = e.exit_code();
                let _ = e.print();
                if let Some(note) = note {
                    eprintln!("{note}");
                }
                std::process::exit(code);
            }
        };
        let runtime_workers =
            match runtime_workers_from(std::env::var(TOKIO_WORKERS_ENV).ok().as_deref()) {
                Ok(n) => n,
                Err(msg) => Flags::command()
                    .error(clap::error::ErrorKind::InvalidValue, msg)
                    .exit(),
            };
        if let Some(msg) = token_source_conflict(&flags.api, |k| std::env::var(k).ok()) {
            Flags::command()
                .error(clap::error::ErrorKind::ArgumentConflict, msg)
                .exit()
        }
        if let Err(msg) = flags.l4.check() {
            Flags::command()
                .error(clap::error::ErrorKind::ArgumentConflict, msg)
                .exit()
        }
        let env = Env::from_lookup(|k| std::env::var(k).ok());
        let set = std::env::vars_os()
            .filter(|(_, v)| !v.is_empty())
            .filter_map(|(k, _)| k.into_string().ok());
        let set_empty = std::env::vars_os()
            .filter(|(_, v)| v.to_str().is_some_and(|v| v.trim().is_empty()))
            .filter_map(|(k, _)| k.into_string().ok());
        Self {
            flags,
            env,
            runtime_workers,
            unknown_env: known::unknown_vars(set),
            empty_env: known::empty_vars(set_empty),
        }
    }

    /// How many fullproxy connection workers to start: `--proxy-workers` /
    /// `LOXI_PROXY_WORKERS`, else the shared runtime's worker count
    /// ([`Config::runtime_workers`]: `TOKIO_WORKER_THREADS`, else one per CPU).
    pub fn proxy_workers(&self) -> usize {
        self.flags
            .proxy_workers
            .map_or(self.runtime_workers, usize::from)
    }
}

/// Flags that an environment variable can set (`#[arg(env = ...)]`): the variable and the
/// flag as clap names it in an error.
const FLAG_ENVS: [(&str, &str); 2] = [
    ("LOXI_API_ADDR", "--api-addr"),
    ("LOXI_PROXY_WORKERS", "--proxy-workers"),
];

/// When clap refused a flag's value and that flag's environment variable is set, a line naming
/// the variable and its value (clap's error names only the flag, which the user may never have
/// typed). Unlike the other variables (warned about, defaults used), these two are validated as
/// their flags are: a bad value stops the daemon at start.
fn env_note(clap_error: &str, lookup: impl Fn(&str) -> Option<String>) -> Option<String> {
    FLAG_ENVS.iter().find_map(|(var, flag)| {
        let v = lookup(var)?;
        clap_error.contains(&format!("'{flag}")).then(|| {
            format!(
                "note: {flag} takes its value from the environment variable {var}={v:?} when the \
                 flag is not given"
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_flag_value_from_the_environment_names_the_variable() {
        let e = Flags::try_parse_from(["loxilb", "--proxy-workers", "5000"]).expect_err("range");
        let env = |k: &str| (k == "LOXI_PROXY_WORKERS").then(|| "5000".to_string());
        assert_eq!(
            env_note(&e.to_string(), env).as_deref(),
            Some(
                "note: --proxy-workers takes its value from the environment variable \
                 LOXI_PROXY_WORKERS=\"5000\" when the flag is not given"
            )
        );
        assert_eq!(env_note(&e.to_string(), |_| None), None, "variable unset");
        let addr = Flags::try_parse_from(["loxilb", "--api-addr", "garbage"]).expect_err("addr");
        assert_eq!(
            env_note(&addr.to_string(), env),
            None,
            "another flag's error"
        );
    }

    #[test]
    fn flags_default_to_loxilb_paths_and_port() {
        let f = Flags::try_parse_from(["loxilb"]).expect("defaults parse");
        assert_eq!(f.api_addr, "127.0.0.1:11111".parse().expect("addr"));
        assert_eq!(f.state_dir, PathBuf::from("/var/lib/loxilb"));
        assert_eq!(f.tokenizer_dir, PathBuf::from("/etc/loxilb/tokenizers"));
        assert_eq!(f.log, "info");
        assert_eq!(f.log_format, crate::telemetry::LogFormat::Text);
        assert_eq!(f.shutdown_grace(), Duration::from_secs(30));
        assert!(f.api.api_tls_cert.is_none() && f.api.api_token_file.is_none());
    }

    #[test]
    fn tokens_come_from_files_and_the_environment_and_empty_ones_are_errors() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("admin");
        std::fs::write(&file, "\n  s3cret-admin-token \n").expect("write");
        let args = ApiArgs {
            api_token_file: Some(file.clone()),
            ..ApiArgs::default()
        };
        let t = ApiTokens::load(&args, |k| {
            (k == API_READ_TOKEN_ENV).then(|| "reader".to_string())
        })
        .expect("tokens");
        assert_eq!(t.admin, ["s3cret-admin-token"]);
        assert_eq!(t.read, ["reader"]);
        std::fs::write(&file, "  \n").expect("write");
        let e = ApiTokens::load(&args, |_| None).expect_err("empty file");
        assert!(e.to_string().contains("holds no token"), "{e}");
        // A read-only token that is also an admin token would write: refused.
        std::fs::write(&file, "same\n").expect("write");
        let e = ApiTokens::load(&args, |k| (k == API_READ_TOKEN_ENV).then(|| "same".into()))
            .expect_err("read = admin");
        assert!(matches!(e, TokenError::ReadEqualsAdmin), "{e}");
        assert!(e.to_string().contains("could write"), "{e}");
        assert!(
            ApiTokens::load(&ApiArgs::default(), |_| None)
                .expect("none")
                .is_empty()
        );
    }

    #[test]
    fn proxy_workers_come_from_the_flag_then_the_runtime_s_count() {
        let cfg = |args: &[&str], runtime_workers| Config {
            flags: Flags::try_parse_from(args).expect("parse"),
            env: Env::default(),
            runtime_workers,
            unknown_env: Vec::new(),
            empty_env: Vec::new(),
        };
        assert_eq!(
            cfg(&["loxilb", "--proxy-workers", "3"], 5).proxy_workers(),
            3
        );
        assert_eq!(
            cfg(&["loxilb", "--proxy-workers", "0"], 5).proxy_workers(),
            0,
            "0: shared runtime"
        );
        assert_eq!(cfg(&["loxilb"], 5).proxy_workers(), 5);
        let f = Flags::try_parse_from(["loxilb", "--proxy-workers", "2"]).expect("parse");
        assert_eq!(f.proxy_workers, Some(2));
        let e = Flags::try_parse_from(["loxilb", "--proxy-workers", "5000"]).expect_err("range");
        assert!(e.to_string().contains("0..=1024"), "{e}");
    }

    #[test]
    fn tokio_worker_threads_is_an_integer_1_to_1024_and_anything_else_a_usage_error() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(runtime_workers_from(None), Ok(cpus));
        assert_eq!(runtime_workers_from(Some("  ")), Ok(cpus), "empty = unset");
        assert_eq!(runtime_workers_from(Some(" 5 ")), Ok(5));
        assert_eq!(runtime_workers_from(Some("1024")), Ok(1024));
        for bad in ["abc", "0", "-1", "1025", "2.5"] {
            let e = runtime_workers_from(Some(bad)).expect_err(bad);
            assert_eq!(
                e,
                format!(
                    "invalid value {bad:?} for the environment variable TOKIO_WORKER_THREADS: \
                     the shared runtime's worker threads (and the default of --proxy-workers) \
                     must be an integer 1..=1024; unset it to use one per CPU"
                )
            );
        }
    }

    #[test]
    fn allowed_origins_are_http_or_https_origins_and_anything_else_a_usage_error() {
        for good in [
            "https://lb.example.com",
            "HTTP://LB.example.com:8080",
            "http://10.0.0.5:11111/",
            "https://[::1]:8443",
            "https://[fd00::5]",
        ] {
            let f = Flags::try_parse_from(["loxilb", "--api-allowed-origin", good])
                .unwrap_or_else(|e| panic!("{good}: {e}"));
            assert_eq!(f.api.api_allowed_origins, [good]);
        }
        for (bad, why) in [
            ("not a url", "no scheme://"),
            ("lb.example.com", "no scheme://"),
            ("ftp://lb.example.com", "the scheme is not http or https"),
            ("https://", "no host"),
            ("https://lb.example.com/path", "a path"),
            ("https://user@lb.example.com", "no host"),
            ("https://lb.example.com:0", "the port is not 1..=65535"),
            ("https://lb.example.com:http", "the port is not 1..=65535"),
            ("https://[nope]:80", "not an IPv6 address in brackets"),
        ] {
            let e = Flags::try_parse_from(["loxilb", "--api-allowed-origin", bad])
                .expect_err(bad)
                .to_string();
            assert!(e.contains("--api-allowed-origin"), "{bad}: {e}");
            assert!(
                e.contains(&format!("{bad:?} is not an origin (")),
                "{bad}: {e}"
            );
            assert!(e.contains(why), "{bad}: {e}");
            assert!(e.contains("give scheme://host[:port]"), "{bad}: {e}");
        }
    }

    #[test]
    fn allowed_hosts_are_dns_names_and_empty_or_decorated_ones_a_usage_error() {
        let f = Flags::try_parse_from([
            "loxilb",
            "--api-allowed-host",
            "LB.example.com",
            "--api-allowed-host",
            "api_1.internal",
        ])
        .expect("parse");
        assert_eq!(
            f.api.api_allowed_hosts,
            ["LB.example.com", "api_1.internal"]
        );
        let e = Flags::try_parse_from(["loxilb", "--api-allowed-host", ""])
            .expect_err("empty")
            .to_string();
        assert!(e.contains("--api-allowed-host"), "{e}");
        assert!(e.contains("the name is empty"), "{e}");
        for bad in [
            "lb.example.com:8080",
            "https://lb.example.com",
            "a..b",
            "lb example",
        ] {
            let e = Flags::try_parse_from(["loxilb", "--api-allowed-host", bad])
                .expect_err(bad)
                .to_string();
            assert!(e.contains(&format!("{bad:?} is not a DNS name")), "{e}");
        }
    }

    #[test]
    fn tls_cert_and_key_go_together() {
        let e = Flags::try_parse_from(["loxilb", "--api-tls-cert", "c.pem"]).expect_err("no key");
        assert!(e.to_string().contains("--api-tls-key"), "{e}");
    }

    #[test]
    fn flags_parse_every_option() {
        let f = Flags::try_parse_from([
            "loxilb",
            "--api-addr",
            "127.0.0.1:4000",
            "--state-dir",
            "/tmp/s",
            "--tokenizer-dir",
            "/tmp/t",
            "--log",
            "debug",
            "--shutdown-grace-secs",
            "2",
            "--log-format",
            "json",
        ])
        .expect("parse");
        assert_eq!(f.api_addr.port(), 4000);
        assert_eq!(f.state_dir, PathBuf::from("/tmp/s"));
        assert_eq!(f.tokenizer_dir, PathBuf::from("/tmp/t"));
        assert_eq!(f.log, "debug");
        assert_eq!(f.shutdown_grace_secs, 2);
        assert_eq!(f.log_format, crate::telemetry::LogFormat::Json);
    }

    #[test]
    fn loxilb_host_port_and_loglevel_are_aliases() {
        let f = Flags::try_parse_from([
            "loxilb",
            "--host",
            "127.0.0.2",
            "--port",
            "4001",
            "--loglevel",
            "warning",
        ])
        .expect("parse")
        .resolve_aliases();
        assert_eq!(f.api_addr, "127.0.0.2:4001".parse().expect("addr"));
        assert_eq!(f.log, "warn");
        let f = Flags::try_parse_from(["loxilb", "--port", "4002"])
            .expect("parse")
            .resolve_aliases();
        assert_eq!(
            f.api_addr,
            "127.0.0.1:4002".parse().expect("addr"),
            "loopback stays the default"
        );
        assert!(Flags::try_parse_from(["loxilb", "--loglevel", "chatty"]).is_err());
        assert!(Flags::try_parse_from(["loxilb", "--loglevel", "info", "--log", "debug"]).is_err());
    }

    #[test]
    fn unknown_log_format_is_a_usage_error() {
        let e = Flags::try_parse_from(["loxilb", "--log-format", "xml"]).expect_err("must fail");
        assert!(e.to_string().contains("--log-format"), "{e}");
    }

    #[test]
    fn bad_api_addr_is_a_usage_error() {
        let e = Flags::try_parse_from(["loxilb", "--api-addr", "nope"]).expect_err("must fail");
        assert!(e.to_string().contains("--api-addr"), "{e}");
    }
}
