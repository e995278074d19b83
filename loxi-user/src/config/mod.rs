//! Daemon configuration: command-line flags ([`Flags`], clap) and the process environment
//! ([`env::Env`], read once at start).
//!
//! Flags follow the daemon contract (`loxilb --api-addr 127.0.0.1:PORT --state-dir DIR
//! --tokenizer-dir DIR --log info`); the environment follows LoxiLB's `LOXILB_*` / `LLB_*`
//! variables (`../shared/spec/configuration-and-tuning.txt`) plus loxi's own `LOXI_*`.
pub mod env;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

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
    /// Log filter in `tracing_subscriber::EnvFilter` syntax (e.g. `info`, `loxi_user=debug`).
    #[arg(long, default_value = "info")]
    pub log: String,
    /// Log line format on stderr: `text` or `json` (one object per line).
    #[arg(long, value_enum, default_value_t = crate::telemetry::LogFormat::Text)]
    pub log_format: crate::telemetry::LogFormat,
    /// Seconds in-flight requests may take to finish after SIGTERM/SIGINT before the process
    /// exits anyway (listeners stop accepting at once).
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// The L4 (XDP) data path and VIP management.
    #[command(flatten)]
    pub l4: crate::l4::L4Args,
}

impl Flags {
    /// The shutdown grace period as a `Duration`.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace_secs)
    }
}

/// Everything the daemon needs to start: flags plus the environment snapshot.
#[derive(Debug, Clone)]
pub struct Config {
    /// Command-line flags.
    pub flags: Flags,
    /// Environment read once at start.
    pub env: Env,
}

impl Config {
    /// Parses the process arguments (exits with clap's usage on error) and reads the process
    /// environment. Rejected variables are in `env.warnings`; the binary logs them once
    /// tracing is up.
    pub fn from_process() -> Self {
        let flags = Flags::parse();
        let env = Env::from_lookup(|k| std::env::var(k).ok());
        Self { flags, env }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_default_to_loxilb_paths_and_port() {
        let f = Flags::try_parse_from(["loxilb"]).expect("defaults parse");
        assert_eq!(f.api_addr, "127.0.0.1:11111".parse().expect("addr"));
        assert_eq!(f.state_dir, PathBuf::from("/var/lib/loxilb"));
        assert_eq!(f.tokenizer_dir, PathBuf::from("/etc/loxilb/tokenizers"));
        assert_eq!(f.log, "info");
        assert_eq!(f.log_format, crate::telemetry::LogFormat::Text);
        assert_eq!(f.shutdown_grace(), Duration::from_secs(30));
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
