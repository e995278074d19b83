//! loxi's gateway under test: `loxilb` started with a temporary state directory, and one rule
//! per policy created with `loxicmd` (the CLI of the LoxiLB compatibility contract,
//! `../shared/spec/`).

use super::client::HttpClient;
use super::fleet::Fleet;
use super::procs::{Proc, free_port, wait_http, wait_tcp};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::Command;

/// The gateway's binaries and shared settings.
#[derive(Debug, Clone)]
pub struct GatewaySpec {
    /// `loxilb` binary.
    pub loxilb: PathBuf,
    /// `loxicmd` binary.
    pub loxicmd: PathBuf,
    /// Staged tokenizer root (same as the workers').
    pub tokenizer_dir: PathBuf,
    /// `LLB_KV_NONE_HASH_SEED` (= the workers' `PYTHONHASHSEED`).
    pub hash_seed: String,
    /// `kvHashAlgo`.
    pub hash_algo: String,
    /// `kvBlockSize`.
    pub block_size: usize,
    /// `Some(cpu)`: `loxilb` runs pinned to that CPU (`taskset -c`) with one tokio worker and one
    /// tokenization thread (`bench-gateway`'s per-core measurement); `None`: unpinned defaults.
    pub pin_cpu: Option<usize>,
}

/// How a rule selects endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleKind {
    /// `--select=rr` (sel 0).
    RoundRobin,
    /// `--select=chwbl` (sel 8).
    Chwbl,
    /// `--kv-exact-mode=3` over `--select=rr`, blend law from `LOXILB_KV_LB_MODE` (None = unset).
    Kv(Option<String>),
    /// `--pd-disagg`: the first half of the workers prefill (`ep_role` 1), the rest decode
    /// (`ep_role` 2); each request is a prefill leg and a decode leg. `true`: with
    /// `--kv-exact-mode=1` (tier 1.5 over the prefill workers).
    Pd(bool),
    /// [`RuleKind::Pd`] with `--pd-cache-aware`: tier 1, the prefix trie over the prefill
    /// workers (no KV events).
    PdTrie,
}

/// A running `loxilb` with one rule.
pub struct Gateway {
    /// The daemon.
    pub proc: Proc,
    /// `http://127.0.0.1:API_PORT`.
    pub api: String,
    /// `http://127.0.0.1:VIP_PORT`: where clients send requests.
    pub vip: String,
    _state: tempfile::TempDir,
}

impl Gateway {
    /// Starts `loxilb` (fresh state dir and API port; env read at start, so one daemon per
    /// blend law), creates the rule over `fleet` with `loxicmd`, and waits until the rule's
    /// listener accepts. `replica`: this daemon's index among several replicas of the same
    /// rule (`--replicas N`; its log is `loxilb-<policy>-r<i>.log`), `None` for a lone gateway.
    pub async fn start(
        spec: &GatewaySpec,
        kind: &RuleKind,
        fleet: &Fleet,
        client: &HttpClient,
        logs: &Path,
        replica: Option<usize>,
    ) -> Result<Self, String> {
        let state = tempfile::tempdir().map_err(|e| format!("state dir: {e}"))?;
        let local = vec!["127.0.0.1".to_string()];
        let api_port = free_port(&local)?;
        let name = match replica {
            Some(i) => format!("{}-r{i}", log_name(kind)),
            None => log_name(kind),
        };
        let mut proc = Proc::spawn(&name, daemon(spec, kind, api_port, state.path()), logs)?;
        let api = format!("http://127.0.0.1:{api_port}");
        wait_http(
            client,
            &format!("{api}/netlox/v1/metrics"),
            Duration::from_secs(30),
            &mut proc,
        )
        .await?;
        let vip_port = free_port(&local)?;
        create_rule(spec, kind, fleet, api_port, vip_port).await?;
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], vip_port));
        wait_tcp(addr, Duration::from_secs(10), &mut proc).await?;
        let vip = format!("http://127.0.0.1:{vip_port}");
        Ok(Self {
            proc,
            api,
            vip,
            _state: state,
        })
    }

    /// The daemon's metrics text.
    pub async fn metrics(&self, client: &HttpClient) -> Result<String, String> {
        super::scrape::fetch(client, &format!("{}/netlox/v1/metrics", self.api)).await
    }
}

fn log_name(kind: &RuleKind) -> String {
    match kind {
        RuleKind::RoundRobin => "loxilb-rr".into(),
        RuleKind::Chwbl => "loxilb-chwbl".into(),
        RuleKind::Kv(None) => "loxilb-kv".into(),
        RuleKind::Kv(Some(law)) => format!("loxilb-kv-{law}"),
        RuleKind::Pd(false) => "loxilb-pd".into(),
        RuleKind::Pd(true) => "loxilb-pd-kv".into(),
        RuleKind::PdTrie => "loxilb-pd-trie".into(),
    }
}

fn daemon(spec: &GatewaySpec, kind: &RuleKind, api_port: u16, state: &Path) -> Command {
    let mut cmd = match spec.pin_cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu.to_string()])
                .arg(&spec.loxilb)
                .env("TOKIO_WORKER_THREADS", "1")
                .env("LOXI_KV_TOKENIZE_WORKERS", "1");
            c
        }
        None => Command::new(&spec.loxilb),
    };
    cmd.args(["--api-addr", &format!("127.0.0.1:{api_port}")])
        .arg("--state-dir")
        .arg(state)
        .arg("--tokenizer-dir")
        .arg(&spec.tokenizer_dir)
        // LOXI_BENCH_GATEWAY_LOG: the daemon's `--log` filter (default `info`: the rule, its
        // listener, tokenizers and each endpoint's KV readiness, nothing per request), e.g.
        // `warn,loxi_user::kv=debug` to see each tier-1.5 miss in logs/loxilb-*.log.
        .args([
            "--log",
            &std::env::var("LOXI_BENCH_GATEWAY_LOG").unwrap_or_else(|_| "info".into()),
        ])
        .env("LLB_KV_NONE_HASH_SEED", &spec.hash_seed)
        .env_remove("LOXILB_KV_LB_MODE");
    if let RuleKind::Kv(Some(law)) = kind {
        cmd.env("LOXILB_KV_LB_MODE", law);
    }
    cmd
}

/// The `loxicmd create lb` arguments for `kind` (spec: `kv-cache-aware-routing.txt` §8.1).
pub fn rule_args(spec: &GatewaySpec, kind: &RuleKind, fleet: &Fleet, vip_port: u16) -> Vec<String> {
    let eps: Vec<String> = fleet.hosts.iter().map(|h| format!("{h}:1")).collect();
    let mut args = vec![
        "create".to_string(),
        "lb".into(),
        "127.0.0.1".into(),
        format!("--tcp={vip_port}:{}", fleet.port),
        format!("--endpoints={}", eps.join(",")),
        "--mode=fullproxy".into(),
    ];
    match kind {
        RuleKind::RoundRobin => args.push("--select=rr".into()),
        RuleKind::Chwbl => args.push("--select=chwbl".into()),
        RuleKind::Kv(_) => args.extend([
            "--select=rr".into(),
            "--kv-exact-mode=3".into(),
            format!("--kv-zmq-port={}", fleet.zmq_port),
            format!("--kv-hash-algo={}", spec.hash_algo),
            format!("--kv-block-size={}", spec.block_size),
        ]),
        RuleKind::PdTrie => {
            args.extend(pd_args(fleet));
            args.push("--pd-cache-aware".into());
        }
        RuleKind::Pd(kv) => {
            args.extend(pd_args(fleet));
            if *kv {
                args.extend([
                    "--kv-exact-mode=1".into(),
                    format!("--kv-zmq-port={}", fleet.zmq_port),
                    format!("--kv-hash-algo={}", spec.hash_algo),
                    format!("--kv-block-size={}", spec.block_size),
                ]);
            }
        }
    }
    args
}

/// The P/D part of a rule: the first half of the workers prefill, the rest decode.
fn pd_args(fleet: &Fleet) -> Vec<String> {
    let n = fleet.hosts.len();
    let prefill = n.div_ceil(2).min(n.saturating_sub(1)).max(1);
    let roles: Vec<&str> = (0..n)
        .map(|i| if i < prefill { "prefill" } else { "decode" })
        .collect();
    vec![
        "--select=rr".into(),
        "--pd-disagg".into(),
        format!("--ep-role={}", roles.join(",")),
    ]
}

/// Creates the rule of `kind` over `fleet` on the daemon at `127.0.0.1:api_port` with
/// `loxicmd create lb` (VIP `127.0.0.1:vip_port`). Errors carry loxicmd's output.
async fn create_rule(
    spec: &GatewaySpec,
    kind: &RuleKind,
    fleet: &Fleet,
    api_port: u16,
    vip_port: u16,
) -> Result<(), String> {
    let mut cmd = Command::new(&spec.loxicmd);
    cmd.args(rule_args(spec, kind, fleet, vip_port)).args([
        "--apiserver",
        "127.0.0.1",
        "--port",
        &api_port.to_string(),
    ]);
    let out = cmd
        .output()
        .await
        .map_err(|e| format!("cannot run loxicmd: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "loxicmd create lb failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}
