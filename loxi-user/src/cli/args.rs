//! `loxicmd` flags (clap), following LoxiLB's `loxicmd` verbs and flag names.

use clap::{Args, Parser, Subcommand, ValueEnum};

/// The directory `save` writes to without `-c` (LoxiLB's).
pub const DEFAULT_DIR: &str = "/etc/loxilb/";

/// `loxicmd [--apiserver IP] [--port N] <create|get|delete> lb ...`. Build it with
/// [`Cli::parse_with_env`], which also reads `LOXI_API_ADDR`.
#[derive(Debug, Parser)]
#[command(name = "loxicmd", version, about = "CLI for the loxilb REST API")]
pub struct Cli {
    /// Address (IP or host name) of the loxilb API server; its port goes in `--port`.
    #[arg(short = 's', long, global = true, default_value = "127.0.0.1")]
    pub apiserver: String,
    /// Port of the loxilb API server.
    #[arg(short = 'p', long, global = true, default_value_t = 11111)]
    pub port: u16,
    /// `http` (default) or `https` (the daemon runs with `--api-tls-cert`).
    #[arg(long, global = true, value_enum, default_value = "http")]
    pub protocol: Protocol,
    /// PEM file of the CA that signed the API's certificate (`https`; default: the system
    /// bundle `/etc/ssl/certs/ca-certificates.crt`).
    #[arg(long, global = true, value_name = "FILE")]
    pub cacert: Option<std::path::PathBuf>,
    /// Bearer token of the API. Prefer `--token-file` or the environment: a command line is
    /// visible to other local users.
    #[arg(long, global = true, env = "LOXI_API_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// File whose first non-empty line is the API's bearer token (wins over `--token`).
    #[arg(long, global = true, value_name = "FILE")]
    pub token_file: Option<std::path::PathBuf>,
    /// Output format of `get`: `table` (default), `wide` or `json` (LoxiLB's global `-o`).
    #[arg(short = 'o', long, global = true, value_enum, default_value = "table")]
    pub output: OutputFormat,
    /// Seconds one API call may take (connect, send, answer); LoxiLB's `-t/--timeout`. At
    /// least 1.
    #[arg(short = 't', long, global = true, default_value_t = 10, value_parser = parse_timeout)]
    pub timeout: u64,
    /// The verb.
    #[command(subcommand)]
    pub command: Verb,
}

/// Scheme of the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Protocol {
    /// Plain HTTP.
    Http,
    /// HTTPS (TLS).
    Https,
}

/// Verbs.
#[derive(Debug, Subcommand)]
pub enum Verb {
    /// Create a resource.
    Create {
        /// The resource.
        #[command(subcommand)]
        what: CreateWhat,
    },
    /// Show resources.
    Get {
        /// The resource.
        #[command(subcommand)]
        what: GetWhat,
    },
    /// Delete a resource.
    Delete {
        /// The resource.
        #[command(subcommand)]
        what: DeleteWhat,
    },
    /// Save the rule set to `<config-path>/lbconfig.txt` (LoxiLB's `save --lb` / `--all`).
    Save(SaveArgs),
    /// Apply a saved rule set (LoxiLB's `apply --lb FILE`).
    Apply(ApplyArgs),
}

/// `save` flags (LoxiLB's spellings; loxi has load-balancer rules only, so `--all` and
/// `--lb` save the same file).
#[derive(Debug, Args)]
pub struct SaveArgs {
    /// Save every configuration loxi has (its load-balancer rules).
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Save the load-balancer rules.
    #[arg(long)]
    pub lb: bool,
    /// Directory of `lbconfig.txt` (an existing one is kept as `lbconfig.txt.bk`).
    #[arg(short = 'c', long = "config-path", default_value = DEFAULT_DIR)]
    pub config_path: std::path::PathBuf,
}

/// `apply` flags.
#[derive(Debug, Args)]
pub struct ApplyArgs {
    /// A saved rule set (`{"lbAttr":[...]}`, as `save` writes and `GET
    /// /config/loadbalancer/all` answers) whose rules are created one by one.
    #[arg(short = 'l', long = "lb", value_name = "FILE")]
    pub lb: std::path::PathBuf,
}

/// `create` resources.
#[derive(Debug, Subcommand)]
pub enum CreateWhat {
    /// A load-balancer rule.
    #[command(visible_aliases = ["lbs", "loadbalancer", "loadbalancers"])]
    Lb(Box<CreateLb>),
    /// Upload a TLS certificate (`POST /config/cert`): leaf + private key, optional chain.
    Cert(CreateCert),
}

/// `loxicmd create cert` flags (LoxiLB's).
#[derive(Debug, Clone, Args)]
pub struct CreateCert {
    /// Certificate id (the server mints one when omitted).
    #[arg(long)]
    pub cert_id: Option<String>,
    /// Leaf certificate PEM file (required).
    #[arg(long)]
    pub cert_file: Option<std::path::PathBuf>,
    /// Private key PEM file (required).
    #[arg(long)]
    pub key_file: Option<std::path::PathBuf>,
    /// Intermediate chain PEM file.
    #[arg(long)]
    pub chain_file: Option<std::path::PathBuf>,
    /// What the entry is for: `server` (the default). LoxiLB's `ca` and `client` (backend
    /// TLS entries) are refused: loxi verifies backends against a rule's `backend_ca_file`.
    #[arg(long)]
    pub usage: Option<String>,
}

/// `get` resources.
#[derive(Debug, Subcommand)]
pub enum GetWhat {
    /// Load-balancer rules (LoxiLB's table; `-o wide` one row per endpoint; `-o json`).
    #[command(visible_aliases = ["lbs", "loadbalancer", "loadbalancers"])]
    Lb {
        /// Only the rules with this `name` (LoxiLB's `--servName`).
        #[arg(long = "servName")]
        serv_name: Option<String>,
    },
    /// Endpoint health (`GET /config/endpoint/all`).
    #[command(visible_aliases = ["ep", "endpoints"])]
    Endpoint,
    /// Connection tracking entries (`GET /config/conntrack/all`).
    #[command(visible_aliases = ["ct", "conntracks", "cts"])]
    Conntrack,
    /// A KV-aware service's block inventory (`GET /config/ai/kv/inventory`): with `--ep-idx`
    /// LoxiLB's `service_id=.. total=..` line and block table; without it (LoxiLB requires
    /// it) a table of the subscribed endpoints (blocks held, streams up). `-o json`: the answer.
    #[command(visible_alias = "kv-inventory")]
    Kvinventory {
        /// The service id (the rule's id; the `service` metric label).
        #[arg(long = "service-id")]
        service_id: u32,
        /// The endpoint index (the order the endpoints were given in).
        #[arg(long = "ep-idx")]
        ep_idx: Option<usize>,
    },
    /// TLS certificates: one by id (LoxiLB's `Cert ID`/`Hostnames` table), or every one
    /// without an id (a loxi extension).
    Cert {
        /// The certificate id.
        cert_id: Option<String>,
    },
    /// Whether Prometheus metrics are enabled (`GET /config/metrics`).
    Metrics,
    /// A KV-aware service's readiness, hash-parity verdict and remedy per endpoint and its
    /// tokenizer state (`GET /config/ai/kv/parity`): a table (`-o wide` the same); `-o json`
    /// the answer.
    Kvparity {
        /// The service id.
        #[arg(long = "service-id")]
        service_id: u32,
    },
}

/// `delete` resources.
#[derive(Debug, Subcommand)]
pub enum DeleteWhat {
    /// A load-balancer rule.
    #[command(visible_aliases = ["lbs", "loadbalancer", "loadbalancers"])]
    Lb(DeleteLb),
    /// A TLS certificate by id (409 while a TLS rule it serves would be left without one).
    Cert {
        /// The certificate id.
        cert_id: String,
    },
}

/// `get lb -o` formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// LoxiLB's table (the default).
    Table,
    /// The REST answer, pretty-printed.
    Json,
    /// `get lb`: LoxiLB's wide table, one row per endpoint (IP, port, weight, state).
    Wide,
}

/// The service ports of a rule: `--tcp=80:8080,443:8443` (service:target; target defaults to
/// the service port), likewise `--udp` and `--sctp`.
#[derive(Debug, Clone, Args)]
pub struct Ports {
    /// TCP `port:targetPort` list.
    #[arg(long)]
    pub tcp: Option<String>,
    /// UDP `port:targetPort` list.
    #[arg(long)]
    pub udp: Option<String>,
    /// SCTP `port:targetPort` list.
    #[arg(long)]
    pub sctp: Option<String>,
}

/// `loxicmd create lb <VIP> ...`. Flags left out are left to the server's defaults.
#[derive(Debug, Clone, Args)]
pub struct CreateLb {
    /// The VIP (externalIP).
    pub vip: String,
    /// Service ports.
    #[command(flatten)]
    pub ports: Ports,
    /// Endpoints `ip:weight,...` (weight optional, default 1; IPv6 as `[addr]:weight`), in the
    /// order that sets `ep_idx`.
    #[arg(long)]
    pub endpoints: String,
    /// NAT mode: fullproxy, onearm, fullnat, dsr, hostonearm, default.
    #[arg(long)]
    pub mode: Option<String>,
    /// Selector: rr, hash, wrr, persist, lc, n2, n3, chwbl, gpuaware, wrr-hash (or chwbl-wrr).
    #[arg(long)]
    pub select: Option<String>,
    /// Rule name.
    #[arg(long)]
    pub name: Option<String>,
    /// Host key (L7 rules; deletion must repeat it).
    #[arg(long)]
    pub host: Option<String>,
    /// Model pool (`model_name`); empty = wildcard.
    #[arg(long)]
    pub model_name: Option<String>,
    /// `http`/0 plaintext, `https`/1 TLS termination, `e2ehttps`/2 TLS termination +
    /// re-encryption to the backends (LoxiLB's names; 1 needs a certificate uploaded first).
    #[arg(long, value_parser = parse_security)]
    pub security: Option<u8>,
    /// `--security=e2ehttps`: PEM bundle (on the daemon's host) of the CAs that sign the
    /// endpoints' certificates (`backend_ca_file`; default the webpki/Mozilla roots).
    #[arg(long)]
    pub backend_ca_file: Option<String>,
    /// `--security=e2ehttps`: the name endpoints' certificates are verified against and sent
    /// as SNI (`backend_tls_server_name`; default the endpoint's IP).
    #[arg(long)]
    pub backend_tls_server_name: Option<String>,
    /// `--security=e2ehttps`: do not verify endpoints' certificates (`backend_tls_insecure`;
    /// warned in the daemon's log).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub backend_tls_insecure: Option<bool>,
    /// Backend protocol: http1, http2, both.
    #[arg(long)]
    pub backend_protocol: Option<String>,
    /// Mark the service as SSE/streaming.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub sse_mode: Option<bool>,
    /// Session key source for persist: header name, `cookie:NAME`, `query:NAME`, `basic-auth`.
    #[arg(long)]
    pub session_header_name: Option<String>,
    /// Advertise the VIP over BGP: loxi has no BGP speaker, so `true` is refused by the
    /// server (not implemented); `false` is accepted.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub bgp: Option<bool>,
    /// Inactivity timeout in seconds (`inactiveTimeOut`). L4 modes: the conntrack idle
    /// timeout (0: 300 s tcp, 60 s udp/sctp). Mode 4 (fullproxy): the listener's client idle
    /// timeout, how long an idle client connection is kept, at most 86400 (0:
    /// LOXI_IDLE_TIMEOUT_MS; rules sharing a listener: the largest).
    #[arg(long)]
    pub inatimeout: Option<u32>,
    /// Enable endpoint health monitoring.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub monitor: Option<bool>,
    /// Probe type: tcp, udp, http, https, ping, none.
    #[arg(long)]
    pub probetype: Option<String>,
    /// Probe port.
    #[arg(long)]
    pub probeport: Option<u16>,
    /// Probe request (HTTP path).
    #[arg(long)]
    pub probereq: Option<String>,
    /// Expected probe response.
    #[arg(long)]
    pub proberesp: Option<String>,
    /// Probe timeout in seconds.
    #[arg(long)]
    pub probetimeout: Option<u32>,
    /// Probe failures before an endpoint is down.
    #[arg(long)]
    pub proberetries: Option<u32>,
    /// CHWBL bounded-load factor, percent of the mean (100–300).
    #[arg(long)]
    pub chwbl_load_factor: Option<u32>,
    /// CHWBL virtual nodes per endpoint (1–1024).
    #[arg(long)]
    pub chwbl_replication: Option<u32>,
    /// CHWBL prefix scope (1–3). LoxiLB spells it `--chwbl-hash-level`.
    #[arg(long, visible_alias = "chwbl-hash-level")]
    pub chwbl_prefix_hash_level: Option<u8>,
    /// CHWBL hash-input flags (0–255). LoxiLB spells it `--chwbl-hash-flags`.
    #[arg(long, visible_alias = "chwbl-hash-flags")]
    pub chwbl_prefix_hash_flags: Option<u8>,
    /// Mix cache_salt into the CHWBL key. LoxiLB spells it `--chwbl-cache-salt`.
    #[arg(long, visible_alias = "chwbl-cache-salt", num_args = 0..=1, default_missing_value = "true")]
    pub chwbl_enable_cache_salt: Option<bool>,
    /// Endpoint roles in endpoint order: normal|prefill|decode (or 0|1|2). Prefill/decode
    /// roles imply `--pd-disagg-mode` unless it is given as false; `--kv-exact-mode=1` still
    /// needs `--pd-disagg` given (as LoxiLB's loxicmd).
    #[arg(long)]
    pub ep_role: Option<String>,
    /// NIXL side-channel ports in endpoint order.
    #[arg(long)]
    pub nixl_port: Option<String>,
    /// Each endpoint's own KV-event publisher port in endpoint order (0 = the rule's
    /// `--kv-zmq-port`): several engines on one host publish on distinct ports.
    #[arg(long)]
    pub ep_kv_zmq_port: Option<String>,
    /// Each endpoint's own KV-event replay port in endpoint order (0 = the rule's
    /// `--kv-replay-port`).
    #[arg(long)]
    pub ep_kv_replay_port: Option<String>,
    /// Enable P/D disaggregation (LoxiLB's spelling `--pd-disagg` is an alias).
    #[arg(long, alias = "pd-disagg", num_args = 0..=1, default_missing_value = "true")]
    pub pd_disagg_mode: Option<bool>,
    /// Tier-0 session pin TTL in seconds.
    #[arg(long, alias = "pd-session-ttl")]
    pub pd_session_ttl_sec: Option<i32>,
    /// Enable P/D tier 1, the prefix trie (LoxiLB's spelling `--pd-cache-aware` is an alias);
    /// requires `--pd-disagg`.
    #[arg(long, alias = "pd-cache-aware", num_args = 0..=1, default_missing_value = "true")]
    pub pd_cache_aware_mode: Option<bool>,
    /// Tier-1 minimum prefix match rate in percent (0–100; 0 means the default 20); requires
    /// `--pd-cache-aware`.
    #[arg(long)]
    pub pd_cache_threshold: Option<i32>,
    /// Tier-1 load-imbalance bypass: max − min prefill load, in requests (0–255; 0 means the
    /// default 3); requires `--pd-cache-aware`.
    #[arg(long)]
    pub pd_balance_abs_threshold: Option<i32>,
    /// SGLang's P/D bootstrap port on the prefill endpoints (`pdBootstrapPort`; 0 or absent =
    /// 8998). Only with `--pd-disagg --kv-engine-type=sglang`.
    #[arg(long)]
    pub pd_bootstrap_port: Option<u16>,
    /// Engine contract: vllm, sglang, trtllm, llamacpp.
    #[arg(long)]
    pub kv_engine_type: Option<String>,
    /// Tier-1.5 topology: 0 off, 1 P/D, 3 single pool.
    #[arg(long)]
    pub kv_exact_mode: Option<u8>,
    /// Base KV-event port.
    #[arg(long)]
    pub kv_zmq_port: Option<u16>,
    /// Block-hash contract (sha256_cbor, xxhash_cbor, sha256_sglang, blockhash_trtllm).
    #[arg(long)]
    pub kv_hash_algo: Option<String>,
    /// Engine block size in tokens.
    #[arg(long)]
    pub kv_block_size: Option<u32>,
    /// Tier-1.5 warmup in seconds (`kvWarmupSec`).
    #[arg(long, alias = "kv-warmup-sec")]
    pub kv_warmup: Option<u32>,
    /// Data-parallel ranks per endpoint (1–8). LoxiLB spells it `--kv-dp-ranks`.
    #[arg(long, visible_alias = "kv-dp-ranks")]
    pub kv_dp_rank_count: Option<u8>,
    /// KV-event replay port (0 = none).
    #[arg(long)]
    pub kv_replay_port: Option<u16>,
    /// LoxiLB's flags for features loxi does not implement: accepted at their defaults only.
    #[command(flatten)]
    pub foreign: super::foreign::Foreign<super::foreign::CreateTable>,
}

/// `loxicmd delete lb <VIP> --tcp=<port> [--host ..] [--model-name ..]`, or
/// `loxicmd delete lb --name NAME`.
#[derive(Debug, Clone, Args)]
pub struct DeleteLb {
    /// The VIP (not needed with `--name`).
    #[arg(required_unless_present = "name")]
    pub vip: Option<String>,
    /// Service ports (`port` or `port:targetPort`; the target part is ignored).
    #[command(flatten)]
    pub ports: Ports,
    /// Host key of the rule (absent: the rule without a host).
    #[arg(long)]
    pub host: Option<String>,
    /// Model pool of the rule (absent: the rule without a model).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Delete the rules with this name instead (`DELETE /config/loadbalancer/name/{name}`).
    #[arg(long, conflicts_with_all = ["host", "model_name"])]
    pub name: Option<String>,
    /// LoxiLB's `--bgp`: loxi has no BGP route to withdraw, so any value deletes the rule (as
    /// the API's `bgp` query parameter does).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub bgp: Option<bool>,
    /// LoxiLB's flags for features loxi does not implement: accepted at their defaults only.
    #[command(flatten)]
    pub foreign: super::foreign::Foreign<super::foreign::DeleteTable>,
}

/// `--timeout`: whole seconds, at least 1 (0 would fail every call before it is sent).
fn parse_timeout(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1 second (0 would time out every call)".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e} (whole seconds, at least 1)")),
    }
}

/// `--security`: LoxiLB's names or the number.
fn parse_security(s: &str) -> Result<u8, String> {
    match s.to_ascii_lowercase().as_str() {
        "" | "http" | "0" => Ok(0),
        "https" | "1" => Ok(1),
        "e2ehttps" | "2" => Ok(2),
        other => Err(format!("{other:?} is not http, https or e2ehttps")),
    }
}

impl Cli {
    /// Parses the command line (exiting with clap's usage error, code 2, when it is wrong).
    /// When neither `--apiserver` nor `--port` is given, the API address comes from
    /// `LOXI_API_ADDR` (`IP:PORT`, `[IPv6]:PORT`; the daemon's own variable, so `loxicmd` run
    /// beside it, e.g. `podman exec` or `kubectl exec`, finds the API wherever it was moved) if
    /// set; a value that is not `IP:PORT` is a usage error naming it. Flags win over the
    /// variable.
    pub fn parse_with_env() -> Self {
        use clap::{CommandFactory as _, FromArgMatches as _, parser::ValueSource};
        let m = Self::command().get_matches();
        let mut cli = Self::from_arg_matches(&m).unwrap_or_else(|e| e.exit());
        let given = |id: &str| {
            let mut sub = Some(&m);
            while let Some(mm) = sub {
                if mm
                    .value_source(id)
                    .is_some_and(|s| s != ValueSource::DefaultValue)
                {
                    return true;
                }
                sub = mm.subcommand().map(|(_, s)| s);
            }
            false
        };
        if given("apiserver") || given("port") {
            return cli;
        }
        if let Some(addr) = std::env::var_os("LOXI_API_ADDR") {
            match apply_api_addr(&mut cli, &addr.to_string_lossy()) {
                Ok(()) => {}
                Err(e) => {
                    eprintln!("loxicmd: {e}");
                    std::process::exit(2);
                }
            }
        }
        cli
    }
}

/// Sets `--apiserver` and `--port` from `LOXI_API_ADDR`'s value (`IP:PORT`).
pub fn apply_api_addr(cli: &mut Cli, value: &str) -> Result<(), String> {
    let a: std::net::SocketAddr = value.trim().parse().map_err(|_| {
        format!(
            "LOXI_API_ADDR={value:?} is not IP:PORT (e.g. 10.0.0.5:11111, [fd00::5]:11111); \
             unset it or pass --apiserver and --port"
        )
    })?;
    cli.apiserver = a.ip().to_string();
    cli.port = a.port();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from([&["loxicmd"], args, &["get", "lb"]].concat())
    }

    #[test]
    fn output_defaults_to_table_and_accepts_it_by_name() {
        assert_eq!(parse(&[]).expect("parse").output, OutputFormat::Table);
        for (name, want) in [
            ("table", OutputFormat::Table),
            ("wide", OutputFormat::Wide),
            ("json", OutputFormat::Json),
        ] {
            assert_eq!(parse(&["-o", name]).expect(name).output, want);
        }
        let e = parse(&["-o", "yaml"]).expect_err("yaml is no format");
        assert!(
            e.to_string()
                .contains("[possible values: table, json, wide]"),
            "{e}"
        );
    }

    /// `--inatimeout` is `inactiveTimeOut`, which a fullproxy rule reads as its listener's
    /// client idle timeout: the help says so, not only "conntrack".
    #[test]
    fn inatimeout_help_names_the_fullproxy_client_idle_timeout() {
        use clap::CommandFactory;
        let mut cli = Cli::command();
        let lb = cli
            .find_subcommand_mut("create")
            .and_then(|c| c.find_subcommand_mut("lb"))
            .expect("create lb");
        let help = lb
            .get_arguments()
            .find(|a| a.get_id() == "inatimeout")
            .and_then(|a| a.get_help())
            .map(|h| h.to_string())
            .expect("--inatimeout has help");
        assert_eq!(
            help,
            "Inactivity timeout in seconds (`inactiveTimeOut`). L4 modes: the conntrack idle \
             timeout (0: 300 s tcp, 60 s udp/sctp). Mode 4 (fullproxy): the listener's client \
             idle timeout, how long an idle client connection is kept, at most 86400 (0: \
             LOXI_IDLE_TIMEOUT_MS; rules sharing a listener: the largest)"
        );
    }

    #[test]
    fn timeout_of_zero_is_refused_at_parse_time() {
        assert_eq!(parse(&[]).expect("parse").timeout, 10);
        assert_eq!(parse(&["-t", "1"]).expect("parse").timeout, 1);
        let e = parse(&["--timeout", "0"]).expect_err("0 s cannot answer");
        assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation);
        let text = e.to_string();
        assert!(
            text.contains(
                "invalid value '0' for '--timeout <TIMEOUT>': must be at least 1 second \
                 (0 would time out every call)"
            ),
            "{text}"
        );
    }
}
