//! Peer routers from PyPI, run against the same fleet: `vllm-router` 0.1.17 and `sglang-router`
//! 0.3.2, installed into a virtualenv (`python3 -m venv` + `pip install`) on request.

use super::fleet::Fleet;
use super::procs::{Proc, free_port, wait_tcp};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::Command;

/// Pinned peer packages (issue 4).
pub const PEER_PACKAGES: [&str; 2] = ["vllm-router==0.1.17", "sglang-router==0.3.2"];

/// The peer configurations benchmarked with `--peers`, by report name.
pub const PEERS: [&str; 4] = [
    "vllm-router-kv_aware",
    "vllm-router-cache_aware",
    "vllm-router-consistent_hash",
    "sglang-router-cache_aware",
];

/// Creates `venv` if missing and installs the pinned peers; returns its `bin` directory.
/// Errors carry pip's last output lines.
pub async fn ensure_venv(venv: &Path) -> Result<PathBuf, String> {
    let bin = venv.join("bin");
    if bin.join("vllm-router").exists() && bin.join("sglang-router").exists() {
        return Ok(bin);
    }
    run(
        Command::new("python3").arg("-m").arg("venv").arg(venv),
        "python3 -m venv",
    )
    .await?;
    let mut pip = Command::new(bin.join("pip"));
    pip.args(["install", "-q", "--disable-pip-version-check"])
        .args(PEER_PACKAGES);
    run(&mut pip, "pip install").await?;
    Ok(bin)
}

async fn run(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd.output().await.map_err(|e| format!("{what}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = err.lines().rev().take(5).collect();
    Err(format!(
        "{what} failed ({}): {}",
        out.status,
        tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
    ))
}

/// A started peer router.
pub struct Peer {
    /// The process.
    pub proc: Proc,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

/// Starts peer `name` (one of [`PEERS`]) over `fleet` and waits until it listens and answers
/// `/health` (or 30 s pass).
pub async fn start(
    name: &str,
    bin: &Path,
    fleet: &Fleet,
    model: &str,
    block_size: usize,
    logs: &Path,
) -> Result<Peer, String> {
    let local = ["127.0.0.1".to_string()];
    let port = free_port(&local)?;
    let mut cmd = command(name, bin, fleet, model, block_size, port)?;
    // Both routers bind a Prometheus exporter on 127.0.0.1:29000 by default and exit when it is
    // taken (another benchmark on the machine): a free port of its own.
    cmd.args(["--prometheus-port", &free_port(&local)?.to_string()]);
    let mut proc = Proc::spawn(name, cmd, logs)?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    wait_tcp(addr, Duration::from_secs(60), &mut proc).await?;
    Ok(Peer {
        proc,
        url: format!("http://127.0.0.1:{port}"),
    })
}

fn command(
    name: &str,
    bin: &Path,
    fleet: &Fleet,
    model: &str,
    bs: usize,
    port: u16,
) -> Result<Command, String> {
    let (exe, policy) = name
        .split_once('-')
        .and_then(|(_, rest)| rest.split_once('-'))
        .map(|(_, policy)| (name.trim_end_matches(&format!("-{policy}")), policy))
        .ok_or_else(|| format!("unknown peer {name}"))?;
    let mut cmd = Command::new(bin.join(exe));
    if exe == "sglang-router" {
        cmd.arg("launch");
    }
    cmd.args([
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--policy",
        policy,
    ])
    .arg("--worker-urls")
    .args(fleet.urls());
    if policy == "kv_aware" {
        for (i, url) in fleet.urls().iter().enumerate() {
            cmd.arg("--kv-event-source")
                .arg(format!("{url}={}", fleet.zmq(i)));
        }
        cmd.args([
            "--kv-event-model",
            model,
            "--kv-event-block-size",
            &bs.to_string(),
        ]);
    }
    Ok(cmd)
}
