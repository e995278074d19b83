//! Child processes of the benchmark: started with logs in the output directory, killed when
//! dropped, and helpers to find free ports and wait for readiness.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

/// A running child; killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct Proc {
    /// Short name for messages.
    pub name: String,
    /// Log file (stdout and stderr).
    pub log: PathBuf,
    child: Child,
}

impl Proc {
    /// Spawns `cmd` with stdout/stderr appended to `log_dir/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Result<Self, String> {
        let log = log_dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let err = file
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        Ok(Self {
            name: name.to_string(),
            log,
            child,
        })
    }

    /// The process id (`None` once it has been reaped).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// `Some(status)` when the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last `n` lines of the log (for error messages).
    pub fn tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Kills and reaps the process now.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A TCP port free on every address in `hosts` at the time of the call.
pub fn free_port(hosts: &[String]) -> Result<u16, String> {
    for _ in 0..50 {
        let probe = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
        let port = probe.local_addr().map_err(|e| e.to_string())?.port();
        drop(probe);
        let all_free = hosts
            .iter()
            .all(|h| TcpListener::bind((h.as_str(), port)).is_ok());
        if all_free {
            return Ok(port);
        }
    }
    Err("no port free on all benchmark addresses".into())
}

/// Waits until `addr` accepts TCP connections, or `limit` passes (error), or `proc` exits.
pub async fn wait_tcp(addr: SocketAddr, limit: Duration, proc: &mut Proc) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        if let Some(st) = proc.exited() {
            return Err(format!(
                "{} exited ({st}) before listening on {addr}:\n{}",
                proc.name,
                proc.tail(20)
            ));
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "{} not listening on {addr} after {limit:?}:\n{}",
                proc.name,
                proc.tail(20)
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `GET url` answers 2xx, or `limit` passes, or `proc` exits.
pub async fn wait_http(
    client: &super::client::HttpClient,
    url: &str,
    limit: Duration,
    proc: &mut Proc,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let last = match super::scrape::fetch(client, url).await {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        if let Some(st) = proc.exited() {
            return Err(format!("{} exited ({st}):\n{}", proc.name, proc.tail(20)));
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "{}: {last} after {limit:?}:\n{}",
                proc.name,
                proc.tail(20)
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
