//! Real-engine mode of the benchmark (issue 13): a fleet of REAL vLLM CPU 0.32 engines instead
//! of `vllm-sim`, from the virtualenv that `../shared/scripts/real-vllm-cpu.sh` installs.
//!
//! Engine `i` serves the tiny dummy-weight model on `127.0.0.{i+2}:PORT` (one HTTP port for all,
//! as a LoxiLB rule's `--tcp=VIP:PORT` expects) with prefix caching, `--num-gpu-blocks-override`
//! blocks and `--enable-scale-out` (vllm-router's prefix policies call `/v1/*/render`). vLLM
//! 0.32's KV-event publisher binds only `tcp://*:P`, `ipc://` and `inproc://` endpoints and
//! connects to anything else, so each engine publishes on its own `ipc://` sockets and one relay
//! process (`bench/py/kv_event_relay.py`, pyzmq from the same venv) re-publishes them on
//! `tcp://127.0.0.{i+2}:ZMQ_PORT` (replay ROUTER on `ZMQ_PORT + 1`): the fleet then looks
//! exactly like the sim fleet to loxi and to the peers.
//!
//! Engines are started in their own process groups (vLLM forks an engine-core process) and
//! stopped as groups; their process-group ids are written to `logs/real-vllm-pgids` so that
//! `scripts/bench-routing.sh` can stop them if this process is killed outright.

use super::client::HttpClient;
use super::fleet::{Fleet, FleetSpec};
use super::procs::{Proc, free_port, wait_http};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::Command;

/// The relay's source, written next to the logs at start.
const RELAY_PY: &str = include_str!("../py/kv_event_relay.py");

/// Settings of the real-engine fleet (the rest comes from [`FleetSpec`]: worker count, block
/// size, `num_gpu_blocks` → `--num-gpu-blocks-override`, `max_num_seqs`, hash seed and algo).
#[derive(Debug, Clone)]
pub struct RealVllmSpec {
    /// The virtualenv with `vllm-cpu` 0.32 and pyzmq (`$VLLM_CPU_VENV` or
    /// `~/.cache/real-vllm-cpu/venv`, the script's default).
    pub venv: PathBuf,
    /// Model directory (`--model`; weights are dummy, `--load-format dummy`).
    pub model_dir: PathBuf,
    /// OpenMP/torch threads per engine (`OMP_NUM_THREADS`; threads are not pinned).
    pub threads: usize,
    /// `--max-model-len`.
    pub max_model_len: usize,
    /// How long all engines together may take to answer `/health`.
    pub ready_timeout: Duration,
}

impl RealVllmSpec {
    /// The venv's Python, or an error naming the script that installs it.
    pub fn python(&self) -> Result<PathBuf, String> {
        let py = self.venv.join("bin/python");
        if py.exists() {
            Ok(py)
        } else {
            Err(format!(
                "{} missing: install the engines with ../shared/scripts/real-vllm-cpu.sh --install-only \
                 (or pass --vllm-venv)",
                py.display()
            ))
        }
    }
}

/// The default venv: `$VLLM_CPU_VENV`, else `~/.cache/real-vllm-cpu/venv`.
pub fn default_venv() -> PathBuf {
    std::env::var_os("VLLM_CPU_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into()))
                .join(".cache/real-vllm-cpu/venv")
        })
}

/// An engine's own event sockets (`ipc://`, under `sock_dir`).
pub fn ipc_endpoints(sock_dir: &Path, i: usize) -> (String, String) {
    (
        format!("ipc://{}/kv-{i}.pub", sock_dir.display()),
        format!("ipc://{}/kv-{i}.replay", sock_dir.display()),
    )
}

/// The relay's arguments: one `PUB_SRC=PUB_DST,REPLAY_SRC=REPLAY_DST` per engine, relaying
/// engine `i`'s `ipc://` sockets to `tcp://{hosts[i]}:{zmq_port}` and `:{zmq_port + 1}`.
pub fn relay_args(sock_dir: &Path, hosts: &[String], zmq_port: u16) -> Vec<String> {
    hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let (pub_ep, replay_ep) = ipc_endpoints(sock_dir, i);
            format!(
                "{pub_ep}=tcp://{h}:{zmq_port},{replay_ep}=tcp://{h}:{}",
                zmq_port + 1
            )
        })
        .collect()
}

/// The arguments of `python -m vllm.entrypoints.openai.api_server` for engine `i` on `host`.
pub fn engine_args(
    spec: &FleetSpec,
    real: &RealVllmSpec,
    sock_dir: &Path,
    i: usize,
    host: &str,
    port: u16,
) -> Vec<String> {
    let (pub_ep, replay_ep) = ipc_endpoints(sock_dir, i);
    let events = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": pub_ep,
        "replay_endpoint": replay_ep,
        "topic": "kv",
    });
    [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        &real.model_dir.display().to_string(),
        "--served-model-name",
        &spec.model,
        "--load-format",
        "dummy",
        "--dtype",
        "float32",
        "--block-size",
        &spec.block_size.to_string(),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        &spec.hash_algo,
        "--kv-events-config",
        &events.to_string(),
        "--num-gpu-blocks-override",
        &spec.num_gpu_blocks.to_string(),
        "--max-num-seqs",
        &spec.max_num_seqs.to_string(),
        "--max-model-len",
        &real.max_model_len.to_string(),
        "--enable-scale-out",
        "--host",
        host,
        "--port",
        &port.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The engine's environment (as `real-vllm-cpu.sh` sets it, plus the thread count).
pub fn engine_env(spec: &FleetSpec, real: &RealVllmSpec) -> Vec<(&'static str, String)> {
    let threads = real.threads.max(1).to_string();
    vec![
        ("PYTHONHASHSEED", spec.hash_seed.clone()),
        ("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1".into()),
        ("HF_HUB_OFFLINE", "1".into()),
        ("TRANSFORMERS_OFFLINE", "1".into()),
        ("VLLM_NO_USAGE_STATS", "1".into()),
        ("DO_NOT_TRACK", "1".into()),
        ("VLLM_CPU_KVCACHE_SPACE", "1".into()),
        ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0".into()),
        // Several engines share 2 cores with other work: no pinning, few threads.
        ("VLLM_CPU_OMP_THREADS_BIND", "nobind".into()),
        ("OMP_NUM_THREADS", threads.clone()),
        ("MKL_NUM_THREADS", threads),
        // /reset_prefix_cache between policies.
        ("VLLM_SERVER_DEV_MODE", "1".into()),
    ]
}

/// A KV-event port `p` such that `p` and `p + 1` are free on every host.
fn zmq_ports(hosts: &[String]) -> Result<u16, String> {
    for _ in 0..50 {
        let p = free_port(hosts)?;
        let next_free = p < u16::MAX
            && hosts
                .iter()
                .all(|h| std::net::TcpListener::bind((h.as_str(), p + 1)).is_ok());
        if next_free {
            return Ok(p);
        }
    }
    Err("no pair of free KV-event ports on all benchmark addresses".into())
}

/// Starts the engines and the relay, and waits for every engine's `/health` (within
/// `real.ready_timeout`; an engine that exits fails the start with its log tail).
pub async fn start(
    spec: &FleetSpec,
    real: &RealVllmSpec,
    client: &HttpClient,
    logs: &Path,
) -> Result<Fleet, String> {
    let py = real.python()?;
    let hosts: Vec<String> = (0..spec.workers)
        .map(|i| format!("127.0.0.{}", i + 2))
        .collect();
    let port = free_port(&hosts)?;
    let zmq_port = zmq_ports(&hosts)?;
    // ipc paths must stay short (sun_path is 108 bytes): a temp dir, not the output dir.
    let sock_dir = std::env::temp_dir().join(format!("loxi-bench-kv-{}", std::process::id()));
    std::fs::create_dir_all(&sock_dir).map_err(|e| format!("{}: {e}", sock_dir.display()))?;
    let relay_py = logs.join("kv_event_relay.py");
    std::fs::write(&relay_py, RELAY_PY).map_err(|e| format!("{}: {e}", relay_py.display()))?;
    let mut procs = Vec::new();
    let mut pgids = Vec::new();
    for (i, host) in hosts.iter().enumerate() {
        let mut cmd = Command::new(&py);
        cmd.args(engine_args(spec, real, &sock_dir, i, host, port))
            .envs(engine_env(spec, real));
        let p = Proc::spawn_group(&format!("vllm-{i}"), cmd, logs)?;
        pgids.extend(p.group_id());
        procs.push(p);
    }
    let mut relay = Command::new(&py);
    relay
        .arg(&relay_py)
        .args(relay_args(&sock_dir, &hosts, zmq_port));
    let relay = Proc::spawn_group("kv-event-relay", relay, logs)?;
    pgids.extend(relay.group_id());
    let ids: Vec<String> = pgids.iter().map(u32::to_string).collect();
    let _ = std::fs::write(logs.join("real-vllm-pgids"), ids.join("\n") + "\n");
    let mut fleet = Fleet {
        procs,
        hosts,
        port,
        zmq_port,
    };
    eprintln!(
        "[bench] starting {} real vLLM engines ({} blocks of {} tokens each, {} thread(s)); logs in {}",
        spec.workers,
        spec.num_gpu_blocks,
        spec.block_size,
        real.threads,
        logs.display()
    );
    let deadline = tokio::time::Instant::now() + real.ready_timeout;
    for i in 0..fleet.hosts.len() {
        let url = format!("{}/health", fleet.url(i));
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        wait_http(client, &url, left, &mut fleet.procs[i]).await?;
    }
    fleet.procs.push(relay);
    Ok(fleet)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> (FleetSpec, RealVllmSpec) {
        let fleet = FleetSpec {
            bin: "vllm-sim".into(),
            workers: 3,
            model: "tiny".into(),
            tokenizer_dir: "/tok".into(),
            block_size: 32,
            num_gpu_blocks: 30,
            max_num_seqs: 64,
            time_scale: 1.0,
            hash_seed: "0".into(),
            hash_algo: "sha256_cbor".into(),
            real_vllm: None,
        };
        let real = RealVllmSpec {
            venv: "/venv".into(),
            model_dir: "/m/tiny-model".into(),
            threads: 1,
            max_model_len: 2048,
            ready_timeout: Duration::from_secs(1),
        };
        (fleet, real)
    }

    fn after<'a>(args: &'a [String], flag: &str) -> &'a str {
        let i = args.iter().position(|a| a == flag).unwrap_or(args.len());
        args.get(i + 1).map(String::as_str).unwrap_or("<missing>")
    }

    #[test]
    fn engine_args_size_the_cache_and_publish_on_ipc() {
        let (fleet, real) = spec();
        let a = engine_args(&fleet, &real, Path::new("/s"), 2, "127.0.0.4", 8100);
        assert_eq!(after(&a, "--num-gpu-blocks-override"), "30");
        assert_eq!(after(&a, "--block-size"), "32");
        assert_eq!(after(&a, "--prefix-caching-hash-algo"), "sha256_cbor");
        assert_eq!(after(&a, "--host"), "127.0.0.4");
        assert_eq!(after(&a, "--port"), "8100");
        assert_eq!(after(&a, "--served-model-name"), "tiny");
        assert!(a.iter().any(|x| x == "--enable-scale-out"));
        assert!(a.iter().any(|x| x == "--enable-prefix-caching"));
        let ev: serde_json::Value =
            serde_json::from_str(after(&a, "--kv-events-config")).unwrap_or_default();
        assert_eq!(ev["endpoint"], "ipc:///s/kv-2.pub");
        assert_eq!(ev["replay_endpoint"], "ipc:///s/kv-2.replay");
        assert_eq!(ev["enable_kv_cache_events"], true);
    }

    #[test]
    fn relay_maps_each_engine_to_its_own_address_on_one_port() {
        let hosts = vec!["127.0.0.2".to_string(), "127.0.0.3".to_string()];
        let a = relay_args(Path::new("/s"), &hosts, 6000);
        assert_eq!(
            a,
            vec![
                "ipc:///s/kv-0.pub=tcp://127.0.0.2:6000,ipc:///s/kv-0.replay=tcp://127.0.0.2:6001",
                "ipc:///s/kv-1.pub=tcp://127.0.0.3:6000,ipc:///s/kv-1.replay=tcp://127.0.0.3:6001",
            ]
        );
    }

    #[test]
    fn engine_env_limits_threads_and_matches_the_gateway_seed() {
        let (mut fleet, mut real) = spec();
        fleet.hash_seed = "7".into();
        real.threads = 0;
        let env = engine_env(&fleet, &real);
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("PYTHONHASHSEED"), Some("7"));
        assert_eq!(get("OMP_NUM_THREADS"), Some("1"));
        assert_eq!(get("VLLM_CPU_OMP_THREADS_BIND"), Some("nobind"));
        assert_eq!(get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"), Some("1"));
    }
}
