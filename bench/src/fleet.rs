//! A fleet of `vllm-sim` workers on distinct loopback addresses.
//!
//! Worker `i` listens on `127.0.0.{i+2}:PORT` and publishes KV events on
//! `tcp://127.0.0.{i+2}:ZMQ_PORT`: one HTTP port and one ZMQ port for all workers, as a LoxiLB
//! rule expects (`--tcp=VIP_PORT:TARGET_PORT`, one `kvZmqPort` per rule).

use super::client::HttpClient;
use super::procs::{Proc, free_port, wait_http};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::Command;

/// How to start the workers.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// `vllm-sim` binary.
    pub bin: PathBuf,
    /// Number of workers.
    pub workers: usize,
    /// Served model name (also the tokenizer subdirectory).
    pub model: String,
    /// Staged tokenizer root (`<dir>/<model>/tokenizer.json`).
    pub tokenizer_dir: PathBuf,
    /// `--block-size`.
    pub block_size: usize,
    /// `--num-gpu-blocks` per worker.
    pub num_gpu_blocks: usize,
    /// `--max-num-seqs`.
    pub max_num_seqs: usize,
    /// `--time-scale`.
    pub time_scale: f64,
    /// `PYTHONHASHSEED`.
    pub hash_seed: String,
    /// Hash algorithm (`sha256_cbor`).
    pub hash_algo: String,
    /// Real vLLM CPU engines instead of `vllm-sim` (`bin` and `time_scale` are then unused;
    /// `num_gpu_blocks` is `--num-gpu-blocks-override`).
    pub real_vllm: Option<super::real_vllm::RealVllmSpec>,
}

/// Running workers.
pub struct Fleet {
    /// One process per worker.
    pub procs: Vec<Proc>,
    /// Worker host addresses, `127.0.0.{i+2}`.
    pub hosts: Vec<String>,
    /// The shared HTTP port.
    pub port: u16,
    /// The shared KV-event PUB port.
    pub zmq_port: u16,
}

/// Fleet starts tried when workers lose their probed ports to another process
/// ([`Fleet::start`]).
const PORT_ATTEMPTS: u32 = 3;

impl Fleet {
    /// Starts the workers and waits for each `/health` (real vLLM engines with
    /// [`FleetSpec::real_vllm`], see [`super::real_vllm`]).
    pub async fn start(spec: &FleetSpec, client: &HttpClient, logs: &Path) -> Result<Self, String> {
        if let Some(real) = &spec.real_vllm {
            return super::real_vllm::start(spec, real, client, logs).await;
        }
        let hosts: Vec<String> = (0..spec.workers)
            .map(|i| format!("127.0.0.{}", i + 2))
            .collect();
        let mut attempt = 1;
        loop {
            // Free when probed, but another process (a concurrent benchmark or test using the
            // same worker addresses) may bind them before the workers do: a worker that exits
            // with "already in use" makes the whole fleet start again on other ports.
            let port = free_port(&hosts)?;
            let zmq_port = free_port(&hosts)?;
            let mut procs = Vec::new();
            for (i, host) in hosts.iter().enumerate() {
                procs.push(Proc::spawn(
                    &format!("vllm-sim-{i}"),
                    command(spec, host, port, zmq_port),
                    logs,
                )?);
            }
            let mut fleet = Fleet {
                procs,
                hosts: hosts.clone(),
                port,
                zmq_port,
            };
            match fleet.wait_healthy(client).await {
                Ok(()) => return Ok(fleet),
                Err(e) if attempt < PORT_ATTEMPTS && fleet.lost_a_port() => {
                    eprintln!(
                        "[bench] worker ports {port}/{zmq_port} taken meanwhile; starting the \
                         fleet again on others (attempt {attempt} of {PORT_ATTEMPTS}): {}",
                        e.lines().next().unwrap_or_default()
                    );
                    for p in &fleet.procs {
                        let _ = std::fs::remove_file(&p.log);
                    }
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits for every worker's `/health` (30 s each).
    async fn wait_healthy(&mut self, client: &HttpClient) -> Result<(), String> {
        for i in 0..self.hosts.len() {
            let url = format!("{}/health", self.url(i));
            wait_http(client, &url, Duration::from_secs(30), &mut self.procs[i]).await?;
        }
        Ok(())
    }

    /// Whether a worker exited because its address was taken (its log says "already in
    /// use").
    fn lost_a_port(&mut self) -> bool {
        self.procs.iter_mut().any(|p| {
            p.exited().is_some()
                && std::fs::read_to_string(&p.log).is_ok_and(|t| t.contains("already in use"))
        })
    }

    /// Base URL of worker `i`.
    pub fn url(&self, i: usize) -> String {
        format!("http://{}:{}", self.hosts[i], self.port)
    }

    /// Base URLs of all workers.
    pub fn urls(&self) -> Vec<String> {
        (0..self.hosts.len()).map(|i| self.url(i)).collect()
    }

    /// KV-event endpoint of worker `i`.
    pub fn zmq(&self, i: usize) -> String {
        format!("tcp://{}:{}", self.hosts[i], self.zmq_port)
    }

    /// `POST /reset_prefix_cache` on every worker (retried while requests drain).
    pub async fn reset_caches(&self, client: &HttpClient) -> Result<(), String> {
        for i in 0..self.hosts.len() {
            reset_one(client, &self.url(i)).await?;
        }
        Ok(())
    }

    /// Each worker's `/metrics` text.
    pub async fn metrics(&self, client: &HttpClient) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        for i in 0..self.hosts.len() {
            out.push(super::scrape::fetch(client, &format!("{}/metrics", self.url(i))).await?);
        }
        Ok(out)
    }
}

fn command(spec: &FleetSpec, host: &str, port: u16, zmq_port: u16) -> Command {
    let events = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("tcp://{host}:{zmq_port}"),
        "topic": "kv",
    });
    let mut cmd = Command::new(&spec.bin);
    cmd.env("PYTHONHASHSEED", &spec.hash_seed)
        .args([
            "--model",
            &spec.model,
            "--host",
            host,
            "--port",
            &port.to_string(),
        ])
        .arg("--tokenizer-dir")
        .arg(&spec.tokenizer_dir)
        .args(["--block-size", &spec.block_size.to_string()])
        .args(["--prefix-caching-hash-algo", &spec.hash_algo])
        .args(["--kv-events-config", &events.to_string()])
        .args(["--max-num-seqs", &spec.max_num_seqs.to_string()])
        .args(["--num-gpu-blocks", &spec.num_gpu_blocks.to_string()])
        .args(["--time-scale", &spec.time_scale.to_string()])
        // vLLM's `kv_both`: a producer for P/D prefill legs, a consumer for decode legs and an
        // ordinary engine for aggregated requests, so one fleet serves every policy.
        .args(["--kv-role", "both"]);
    cmd
}

async fn reset_one(client: &HttpClient, base: &str) -> Result<(), String> {
    let url = format!("{base}/reset_prefix_cache");
    let mut last = String::new();
    for _ in 0..50 {
        let req = hyper::Request::post(url.as_str())
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .map_err(|e| e.to_string())?;
        match client.request(req).await {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => last = format!("status {}", r.status()),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("{url}: {last}"))
}

/// Copies `tokenizer.json` and `tokenizer_config.json` of `model_dir` into
/// `root/<model with / → __>/`, the layout both `vllm-sim` and `loxilb` read.
pub fn stage_tokenizer(model_dir: &Path, root: &Path, model: &str) -> Result<PathBuf, String> {
    let dir = root.join(model.replace('/', "__"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(model_dir.join(f), dir.join(f))
            .map_err(|e| format!("{}: {e}", model_dir.join(f).display()))?;
    }
    Ok(root.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits (up to 10 s) until `p` has exited.
    async fn exited(p: &mut Proc) {
        for _ in 0..200 {
            if p.exited().is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{} did not exit", p.name);
    }

    #[tokio::test]
    async fn a_worker_that_lost_its_port_is_told_from_one_that_failed_otherwise() {
        // A port on a worker address held by someone else, and a process that then binds it:
        // the kernel's own "Address already in use", as a worker losing the race gets.
        let held = std::net::TcpListener::bind("127.0.0.2:0").expect("bind");
        let port = held.local_addr().expect("addr").port();
        let logs = tempfile::tempdir().expect("tmp");
        let mut cmd = Command::new("python3");
        cmd.args([
            "-c",
            &format!("import socket; socket.socket().bind(('127.0.0.2', {port}))"),
        ]);
        let mut lost = Proc::spawn("vllm-sim-0", cmd, logs.path()).expect("spawn");
        let mut cmd = Command::new("python3");
        cmd.args(["-c", "raise SystemExit('unknown flag --x')"]);
        let mut failed = Proc::spawn("vllm-sim-1", cmd, logs.path()).expect("spawn");
        exited(&mut lost).await;
        exited(&mut failed).await;
        let mut fleet = Fleet {
            procs: vec![failed],
            hosts: vec!["127.0.0.3".into()],
            port,
            zmq_port: 0,
        };
        assert!(!fleet.lost_a_port(), "failed for another reason: no retry");
        fleet.procs.push(lost);
        fleet.hosts.push("127.0.0.2".into());
        assert!(fleet.lost_a_port(), "{}", fleet.procs[1].tail(5));
        drop(held);
    }
}
