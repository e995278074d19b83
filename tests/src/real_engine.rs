//! Helpers shared by the opt-in real-vLLM tests (`real_vllm.rs`, `real_vllm_pd.rs`): the switch,
//! the venv of `../shared/scripts/real-vllm-cpu.sh`, the engine start script's readiness and logs,
//! and a Prometheus text-format sample reader.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The env switch both real-engine tests share: they run only when it is `1`.
pub const SWITCH: &str = "LOXI_REAL_VLLM";

/// True when [`SWITCH`] is `1`; otherwise prints `"<test> skipped: ..."` and returns false, so
/// the test passes as a cheap skip (no engine, no daemon, no venv needed).
pub fn enabled(test: &str, why: &str) -> bool {
    if std::env::var(SWITCH).as_deref() == Ok("1") {
        return true;
    }
    eprintln!("{test} skipped: set {SWITCH}=1 to run {why}");
    false
}

/// The vLLM venv the shared script uses: `$VLLM_CPU_VENV`, else `$HOME/.cache/real-vllm-cpu/venv`.
pub fn venv_dir() -> PathBuf {
    std::env::var_os("VLLM_CPU_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                .join(".cache/real-vllm-cpu/venv")
        })
}

/// The log file `real-vllm-cpu.sh` gives the engine on HTTP port `port`.
pub fn server_log(port: u16) -> PathBuf {
    venv_dir().join(format!("../server-{port}.log"))
}

/// The pid file `real-vllm-cpu.sh` writes for the engine on HTTP port `port`.
pub fn server_pid_file(port: u16) -> PathBuf {
    venv_dir().join(format!("../server-{port}.pid"))
}

/// A running `real-vllm-cpu.sh` start script (it exits 0 once the engine answers `/v1/models`).
pub struct Starter {
    child: Option<Child>,
    log: PathBuf,
}

impl Starter {
    /// Spawns `cmd` (the start script, already given its args and env) with stdout and stderr
    /// going to `log`. Panics if it cannot be spawned.
    pub fn spawn(mut cmd: Command, log: &Path) -> Starter {
        let f = std::fs::File::create(log).expect("starter log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone().expect("clone log"))
            .stderr(f)
            .spawn()
            .expect("spawn real-vllm-cpu.sh");
        Starter {
            child: Some(child),
            log: log.to_path_buf(),
        }
    }

    /// `Some(Ok)` once the script reported readiness, `Some(Err(starter output))` if it failed,
    /// `None` while it still waits (and after it reported once).
    pub fn poll(&mut self) -> Option<Result<(), String>> {
        let status = self.child.as_mut()?.try_wait().expect("try_wait")?;
        self.child = None;
        if status.success() {
            Some(Ok(()))
        } else {
            Some(Err(self.output()))
        }
    }

    /// What the script printed so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills the script if it still waits.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The last `n` lines of the engine log of HTTP port `port`.
pub fn log_tail(port: u16, n: usize) -> String {
    let text = std::fs::read_to_string(server_log(port)).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The value of the Prometheus sample `name{...}` summed over every series whose labels include
/// every `labels` pair (0 if absent).
pub fn sample(metrics: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}
