//! LoxiLB's own clients against the real daemon: every fixture of `shared/loxilb-clients/`
//! (Go loxicmd and kube-loxilb requests, byte for byte) replayed over a raw TCP socket, each
//! against a fresh daemon (see `loxi_tests::loxilb_clients` for the expectations).

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use loxi_tests::harness::{Daemon, bin_path};
use loxi_tests::loxilb_clients::{self, Fixture, Target, Wire, WireResponse};

/// A daemon in this network namespace, reached directly.
struct Direct(SocketAddr);

impl Wire for Direct {
    fn send(&self, raw: &[u8]) -> Result<Vec<u8>, String> {
        loxilb_clients::exchange(self.0, raw)
    }
    fn host(&self) -> String {
        self.0.to_string()
    }
}

fn report(results: Vec<(String, Result<String, String>)>) {
    let mut failed = Vec::new();
    for (id, r) in &results {
        match r {
            Ok(note) => eprintln!("ok   {id}: {note}"),
            Err(e) => {
                eprintln!("FAIL {id}: {e}");
                failed.push(id.clone());
            }
        }
    }
    assert!(failed.is_empty(), "fixtures failed: {failed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fixture_replayed_byte_for_byte_against_a_daemon_without_xdp() {
    let (fixtures, responses) = loxilb_clients::load(&loxilb_clients::fixture_dir());
    let mut results = Vec::new();
    for fx in fixtures {
        let d = Daemon::start_default().await;
        let wire = Direct(d.api_addr());
        let resp = responses.clone();
        let id = fx.id.clone();
        let r = tokio::task::spawn_blocking(move || {
            loxilb_clients::check_fixture(&wire, Target { l4: false }, &fx, &resp)
        })
        .await
        .expect("fixture task");
        if r.is_err() {
            d.dump_log();
        }
        results.push((id, r));
    }
    report(results);
}

/// Root is needed for the namespace and XDP; under `CI` its absence is a failure.
fn require_root() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    if root {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "root (netns, XDP) is required under CI"
    );
    eprintln!("SKIPPING: not root (netns, XDP)");
    false
}

fn sh(c: &str) {
    let ok = Command::new("sh").args(["-c", c]).status().expect("sh");
    assert!(ok.success(), "{c}");
}

/// A network namespace with a veth pair (`cx0` carries XDP and the VIPs).
struct Netns(String);

impl Netns {
    fn new() -> Self {
        let name = format!("loxicompat{}", std::process::id());
        sh(&format!("ip netns add {name}"));
        sh(&format!(
            "ip -n {name} link add cx0 type veth peer name cx1"
        ));
        sh(&format!(
            "ip -n {name} link set cx0 up && ip -n {name} link set cx1 up && ip -n {name} link set lo up"
        ));
        Self(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// The API address of the daemon inside the namespace (the namespace is ours alone).
const NS_API: &str = "127.0.0.1:11111";

/// Reaches the daemon inside the namespace with the `raw-replay` helper.
struct InNetns<'a>(&'a Netns);

impl Wire for InNetns<'_> {
    fn send(&self, raw: &[u8]) -> Result<Vec<u8>, String> {
        use std::io::Write;
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.0.0])
            .arg(bin_path("raw-replay"))
            .arg(NS_API)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn raw-replay: {e}"))?;
        child
            .stdin
            .take()
            .ok_or("stdin")?
            .write_all(raw)
            .map_err(|e| e.to_string())?;
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(out.stdout)
    }
    fn host(&self) -> String {
        NS_API.to_string()
    }
}

/// `loxilb` inside `ns` with XDP and the VIPs on `cx0`; killed on drop.
struct NsDaemon(Child, tempfile::TempDir);

impl NsDaemon {
    fn start(ns: &Netns) -> Self {
        let dir = tempfile::tempdir().expect("tmp");
        let log = std::fs::File::create(dir.path().join("log")).expect("log");
        let child = Command::new("ip")
            .args(["netns", "exec", &ns.0])
            .arg(bin_path("loxilb"))
            .args(["--api-addr", NS_API])
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--tokenizer-dir")
            .arg(dir.path().join("tok"))
            .args(["--xdp-iface", "cx0", "--vip-iface", "cx0", "--log", "info"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn loxilb in the netns");
        let d = NsDaemon(child, dir);
        let deadline = Instant::now() + Duration::from_secs(15);
        let probe = b"GET /netlox/v1/version HTTP/1.1\r\nHost: 127.0.0.1:11111\r\n\r\n";
        loop {
            let up = InNetns(ns)
                .send(probe)
                .ok()
                .and_then(|b| WireResponse::parse(&b).ok())
                .is_some_and(|r| r.status == 200);
            if up {
                return d;
            }
            assert!(
                Instant::now() < deadline,
                "loxilb in {} did not answer /version: {}",
                ns.0,
                d.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.1.path().join("log")).unwrap_or_default()
    }
}

impl Drop for NsDaemon {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run_in_netns(ns: &Netns, fx: &Fixture, responses: &serde_json::Value) -> Result<String, String> {
    let d = NsDaemon::start(ns);
    let r = loxilb_clients::check_fixture(&InNetns(ns), Target { l4: true }, fx, responses);
    if r.is_err() {
        eprintln!("daemon log for {}:\n{}", fx.id, d.log());
    }
    r
}

#[test]
fn every_fixture_replayed_over_a_raw_socket_to_a_daemon_with_the_xdp_data_path() {
    if !require_root() {
        return;
    }
    assert!(
        bin_path("raw-replay").exists(),
        "build the workspace first (target/release/raw-replay)"
    );
    let (fixtures, responses) = loxilb_clients::load(&loxilb_clients::fixture_dir());
    let ns = Netns::new();
    let results = fixtures
        .iter()
        .map(|fx| (fx.id.clone(), run_in_netns(&ns, fx, &responses)))
        .collect();
    report(results);
}
