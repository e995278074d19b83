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
        let mut d = Daemon::start_default().await;
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
        // A graceful stop: the daemon takes the fixtures' VIPs (10.10.10.254, 192.0.2.13) off
        // this namespace's `lo`, where a SIGKILL left them on the host.
        d.stop().await;
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

/// What a capture server saw: method, request target (path and query) and body.
type Seen = (String, String, String);

/// A loopback HTTP/1.1 server that records every request and answers LoxiLB's
/// `{"result":"Success"}` (one request per connection, as loxicmd sends them). Stops when the
/// returned flag is set.
fn capture_server() -> (
    SocketAddr,
    std::sync::Arc<std::sync::Mutex<Vec<Seen>>>,
    std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::sync::atomic::Ordering;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("addr");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (seen2, stop2) = (seen.clone(), stop.clone());
    std::thread::spawn(move || {
        while !stop2.load(Ordering::Relaxed) {
            let Ok((s, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            s.set_nonblocking(false).expect("blocking");
            s.set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            let mut r = BufReader::new(s.try_clone().expect("clone"));
            let mut line = String::new();
            r.read_line(&mut line).expect("request line");
            let mut parts = line.split_whitespace();
            let method = parts.next().unwrap_or_default().to_string();
            let target = parts.next().unwrap_or_default().to_string();
            let mut len = 0usize;
            loop {
                let mut h = String::new();
                r.read_line(&mut h).expect("header");
                if h.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = h.split_once(':')
                    && k.eq_ignore_ascii_case("content-length")
                {
                    len = v.trim().parse().expect("content-length");
                }
            }
            let mut body = vec![0u8; len];
            r.read_exact(&mut body).expect("body");
            seen2.lock().expect("lock").push((
                method,
                target,
                String::from_utf8(body).expect("utf-8 body"),
            ));
            let answer = "{\"result\":\"Success\"}\n";
            let mut s = s;
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    (addr, seen, stop)
}

/// A request body as the server reads it: keys lower-cased (LoxiLB's decoder matches `BGP` /
/// `Monitor` case-insensitively) and zero values dropped (Go's loxicmd always sends `false`,
/// `0`, `""` and `null` for flags not given; loxi's omits them, which the server reads alike).
fn semantic(v: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(_, v)| match v {
                    Value::Null => false,
                    Value::Bool(b) => *b,
                    Value::Number(n) => n.as_f64() != Some(0.0),
                    Value::String(s) => !s.is_empty(),
                    Value::Array(a) => !a.is_empty(),
                    Value::Object(_) => true,
                })
                .map(|(k, v)| (k.to_ascii_lowercase(), semantic(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(semantic).collect()),
        other => other.clone(),
    }
}

/// Every `loxicmd create|delete` command of the fixtures, run through loxi's `loxicmd`: a
/// command LoxiLB's CLI refuses is refused with its exact message and exit code, sending
/// nothing; every other one sends LoxiLB's method, path, query and (up to omitted zero values)
/// body. (`get` commands' tables are checked against the fixtures' renderings in `cli::table`.)
#[test]
fn every_loxicmd_command_of_the_fixtures_sends_what_loxilb_s_loxicmd_sends() {
    let (fixtures, _) = loxilb_clients::load(&loxilb_clients::fixture_dir());
    let mut checked = 0;
    for fx in &fixtures {
        let Some(cmd) = fx.json["command"].as_str() else {
            continue;
        };
        let words: Vec<&str> = cmd.split_whitespace().collect();
        if words.first() != Some(&"loxicmd") || !matches!(words.get(1), Some(&"create" | &"delete"))
        {
            continue;
        }
        let (addr, seen, stop) = capture_server();
        let out = Command::new(bin_path("loxicmd"))
            .args([
                "--apiserver",
                "127.0.0.1",
                "--port",
                &addr.port().to_string(),
            ])
            .args(&words[1..])
            .stdin(Stdio::null())
            .output()
            .expect("run loxicmd");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let seen = seen.lock().expect("lock").clone();
        if !fx.sends() {
            let want = &fx.json["cli_result"];
            assert_eq!(
                (out.status.code(), stderr.as_str()),
                (
                    want["exit_code"].as_i64().map(|c| c as i32),
                    want["stderr"].as_str().unwrap_or_default()
                ),
                "{}: {cmd}",
                fx.id
            );
            assert!(seen.is_empty(), "{}: sent {seen:?}", fx.id);
        } else {
            assert!(out.status.success(), "{}: {cmd}: {stderr}", fx.id);
            assert_eq!(seen.len(), 1, "{}: one request, saw {seen:?}", fx.id);
            let (method, target, body) = &seen[0];
            let want_target = match fx.json["query"].as_str() {
                Some(q) => format!("{}?{q}", fx.json["path"].as_str().unwrap_or_default()),
                None => fx.json["path"].as_str().unwrap_or_default().to_string(),
            };
            assert_eq!(
                (method.as_str(), target.as_str()),
                (
                    fx.json["method"].as_str().unwrap_or_default(),
                    want_target.as_str()
                ),
                "{}: {cmd}",
                fx.id
            );
            if fx.json["body"].is_object() {
                let ours: serde_json::Value = serde_json::from_str(body).expect("JSON body");
                assert_eq!(
                    semantic(&ours),
                    semantic(&fx.json["body"]),
                    "{}: {cmd}",
                    fx.id
                );
            }
        }
        eprintln!("ok   {}: {cmd}", fx.id);
        checked += 1;
    }
    assert!(checked >= 14, "only {checked} loxicmd fixtures found");
}
