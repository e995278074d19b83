//! A real `vllm-sim` engine process for tests that need an engine's own answers (`/v1/models`,
//! completions), killed when dropped.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

use crate::harness::bin_path;

/// A running `vllm-sim` on loopback (OS-chosen port), killed on drop.
pub struct Sim {
    child: tokio::process::Child,
    /// Its HTTP address, from its `VLLM_SIM_READY` line.
    pub addr: SocketAddr,
}

impl Sim {
    /// Starts `vllm-sim --model <model>` (no tokenizer, time scale 0.05) and waits (30 s at
    /// most) for its readiness line. Panics when it does not come up.
    pub async fn start(model: &str) -> Sim {
        let mut cmd = Self::command();
        cmd.args(["--model", model, "--host", "127.0.0.1", "--port", "0"])
            .args(["--time-scale", "0.05"]);
        Self::spawn(cmd).await
    }

    /// A `vllm-sim` command line to complete (model, address and options) for [`Self::spawn`].
    pub fn command() -> tokio::process::Command {
        tokio::process::Command::new(bin_path("vllm-sim"))
    }

    /// Spawns `cmd` (from [`Self::command`], with `--port 0` or a free port) and waits (30 s
    /// at most) for its readiness line. Panics when it does not come up.
    pub async fn spawn(mut cmd: tokio::process::Command) -> Sim {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn vllm-sim (build it: cargo build --release --workspace --bins)");
        let out = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(out).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(l)) = lines.next_line().await {
                if let Some(rest) = l.strip_prefix("VLLM_SIM_READY http=") {
                    return rest.split(' ').next().map(String::from);
                }
            }
            None
        })
        .await
        .expect("vllm-sim ready within 30 s")
        .expect("ready line");
        Sim {
            child,
            addr: ready.parse().expect("vllm-sim address"),
        }
    }

    /// The HTTP port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Kills the process and waits until it has exited (its port refuses connections).
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}
