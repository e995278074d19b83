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
    /// Started as the leader of its own process group ([`Proc::spawn_group`]): stopping it
    /// stops the whole group (e.g. vLLM's API server and its engine-core child).
    group: Option<u32>,
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
            group: None,
        })
    }

    /// The process id (`None` once it has been reaped).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// [`Proc::spawn`] as the leader of a new process group: [`Proc::stop`] sends SIGTERM to the
    /// group, then SIGKILL after `GROUP_GRACE`; dropping it SIGKILLs the group.
    pub fn spawn_group(name: &str, mut cmd: Command, log_dir: &Path) -> Result<Self, String> {
        cmd.process_group(0);
        let mut p = Self::spawn(name, cmd, log_dir)?;
        p.group = p.child.id();
        Ok(p)
    }

    /// The process-group id of a [`Proc::spawn_group`] child (None otherwise, or once stopped).
    pub fn group_id(&self) -> Option<u32> {
        self.group
    }

    /// Sends `sig` to the process group this child leads (its id was kept at spawn, so the
    /// group's other members are reached after the leader exited).
    fn signal_group(&self, sig: &str) {
        if let Some(pid) = self.group {
            let _ = std::process::Command::new("kill")
                .args([sig, "--", &format!("-{pid}")])
                .stderr(Stdio::null())
                .status();
        }
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

    /// Kills and reaps the process now (a group: SIGTERM, up to `GROUP_GRACE` to exit, then
    /// SIGKILL to the whole group).
    pub async fn stop(mut self) {
        if self.group.is_some() {
            self.signal_group("-TERM");
            let _ = tokio::time::timeout(GROUP_GRACE, self.child.wait()).await;
            self.signal_group("-KILL");
        }
        let _ = self.child.kill().await;
        self.group = None;
    }
}

/// How long a process group gets between SIGTERM and SIGKILL in [`Proc::stop`].
const GROUP_GRACE: Duration = Duration::from_secs(10);

impl Drop for Proc {
    /// A group leader's descendants are not covered by `kill_on_drop`: SIGKILL the group.
    fn drop(&mut self) {
        self.signal_group("-KILL");
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
