//! Daemon lifecycle: graceful shutdown on SIGTERM (stop accepting, drain in-flight requests up
//! to the grace deadline).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use loxi_tests::backend::{Backend, Mode};
use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use serde_json::json;

/// POSTs to the VIP with a backend delay; returns (status, elapsed) or the client error text.
async fn slow_request(vip: u16, delay_ms: u64) -> Result<(u16, Duration), String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = http::Request::post(format!("http://127.0.0.1:{vip}/v1/completions"))
        .header("content-type", "application/json")
        .header("x-delay-ms", delay_ms.to_string())
        .body(Full::new(Bytes::from_static(
            b"{\"model\":\"m\",\"prompt\":\"hi\"}",
        )))
        .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    resp.into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok((status, t0.elapsed()))
}

async fn daemon_with_rule(grace_secs: u64, backend: &Backend) -> (Daemon, u16) {
    let opts = DaemonOpts {
        args: vec!["--shutdown-grace-secs".into(), grace_secs.to_string()],
        ..Default::default()
    };
    let d = Daemon::start(opts).await;
    let vip = free_port();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": vip, "mode": 4, "sel": 0},
        "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": backend.port()}]
    });
    assert_eq!(d.post_rule(&rule).await.0, 200);
    // The listener opens asynchronously after the rule is stored.
    let deadline = Instant::now() + Duration::from_secs(5);
    while tokio::net::TcpStream::connect(("127.0.0.1", vip))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "VIP listener never opened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (d, vip)
}

/// Waits (5 s at most) until a request reached `backend`.
async fn reached(backend: &Backend) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while backend.request_count() == 0 {
        assert!(
            Instant::now() < deadline,
            "request never reached the backend"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_in_flight_request_finish_and_stops_accepting() {
    let backend = Backend::start("b0").await;
    let (mut d, vip) = daemon_with_rule(10, &backend).await;
    let inflight = tokio::spawn(slow_request(vip, 1200));
    // Let the request reach the backend, then ask the daemon to stop.
    reached(&backend).await;
    let pid = d.pid().expect("running").to_string();
    let t0 = Instant::now();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    // The VIP stops accepting as soon as the daemon handles the signal, while the request
    // (1.2 s at the backend) is still draining: poll until a connect is refused, and require
    // that to happen before the request ends.
    let deadline = Instant::now() + Duration::from_secs(5);
    while tokio::net::TcpStream::connect(("127.0.0.1", vip))
        .await
        .is_ok()
    {
        assert!(
            !inflight.is_finished() && Instant::now() < deadline,
            "the VIP must stop accepting right after SIGTERM, before the drain ends"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !inflight.is_finished(),
        "the in-flight request must still be draining when the VIP closes"
    );
    let (status, took) = inflight
        .await
        .expect("join")
        .expect("in-flight request completes");
    assert_eq!(status, 200);
    assert!(took >= Duration::from_millis(1200), "{took:?}");
    let exit = d.stop().await;
    assert!(
        exit.is_some_and(|s| s.success()),
        "clean exit after the drain: {exit:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "drain took {:?}",
        t0.elapsed()
    );
    assert!(
        d.log_text().contains("shutdown requested"),
        "{}",
        d.log_text()
    );
}

/// SIGHUP (a habitual reload, a closed terminal) does not end the daemon (its default action
/// would, at once and without the drain): it is logged as ignored, and an in-flight request
/// and the next ones are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_is_logged_and_ignored() {
    let backend = Backend::start("b0").await;
    let (d, vip) = daemon_with_rule(10, &backend).await;
    let inflight = tokio::spawn(slow_request(vip, 600));
    reached(&backend).await;
    let pid = d.pid().expect("running").to_string();
    // Two signals, each after the previous one is logged: a second SIGHUP sent while the
    // first is still pending is merged into it by the kernel (standard signals do not queue).
    for n in 1..=2 {
        std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .expect("kill");
        let deadline = Instant::now() + Duration::from_secs(5);
        while d.log_text().matches("SIGHUP ignored").count() < n {
            assert!(
                Instant::now() < deadline,
                "SIGHUP {n} not logged:\n{}",
                d.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let (status, _) = inflight
        .await
        .expect("join")
        .expect("in-flight request completes");
    assert_eq!(status, 200);
    let (status, _) = slow_request(vip, 0).await.expect("served after SIGHUP");
    assert_eq!(status, 200);
    assert!(
        !d.log_text().contains("shutdown requested"),
        "{}",
        d.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_grace_bounds_the_drain_of_a_hanging_request() {
    let backend = Backend::start("b0").await;
    backend.set_mode(Mode::Hang);
    let (mut d, vip) = daemon_with_rule(1, &backend).await;
    let inflight = tokio::spawn(slow_request(vip, 0));
    reached(&backend).await;
    let t0 = Instant::now();
    let exit = d.stop().await;
    let took = t0.elapsed();
    assert!(
        exit.is_some(),
        "the daemon must exit by itself within the grace period"
    );
    assert!(
        took >= Duration::from_millis(900),
        "exited before the grace period: {took:?}"
    );
    assert!(took < Duration::from_secs(5), "grace of 1 s took {took:?}");
    let res = tokio::time::timeout(Duration::from_secs(5), inflight)
        .await
        .expect("client ends");
    assert!(
        !matches!(res, Ok(Ok((200, _)))),
        "a hung request cannot succeed: {res:?}"
    );
}

/// POSTs `body` to the VIP; returns (status, x-loxilb-endpoint, body text).
async fn post_vip(vip: u16, body: Vec<u8>) -> (u16, Option<String>, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = http::Request::post(format!("http://127.0.0.1:{vip}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let resp = client.request(req).await.expect("VIP answers");
    let status = resp.status().as_u16();
    let ep = resp
        .headers()
        .get("x-loxilb-endpoint")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, ep, String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restored_rules_serve_traffic_as_soon_as_the_api_answers_after_a_restart() {
    let backend = Backend::start("b0").await;
    let (mut d, vip) = daemon_with_rule(5, &backend).await;
    let before = post_vip(vip, b"{\"model\":\"m\",\"prompt\":\"a\"}".to_vec()).await;
    assert_eq!(
        (before.0, before.1.as_deref()),
        (200, Some("0")),
        "{}",
        before.2
    );
    d.restart().await;
    // The harness returns as soon as the API answers; rules were restored before that, so the
    // VIP listener is the proxy's first job and opens without another POST.
    let deadline = Instant::now() + Duration::from_secs(5);
    while tokio::net::TcpStream::connect(("127.0.0.1", vip))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "restored rule's listener never opened"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = post_vip(vip, b"{\"model\":\"m\",\"prompt\":\"b\"}".to_vec()).await;
    assert_eq!(
        (after.0, after.1.as_deref()),
        (200, Some("0")),
        "{}",
        after.2
    );
    assert_eq!(backend.request_count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxi_max_body_bytes_from_the_environment_limits_request_bodies() {
    let backend = Backend::start("b0").await;
    let opts = DaemonOpts::default().env("LOXI_MAX_BODY_BYTES", "2048");
    let d = Daemon::start(opts).await;
    let vip = free_port();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": vip, "mode": 4, "sel": 0},
        "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": backend.port()}]
    });
    assert_eq!(d.post_rule(&rule).await.0, 200);
    let deadline = Instant::now() + Duration::from_secs(5);
    while tokio::net::TcpStream::connect(("127.0.0.1", vip))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "VIP listener never opened");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let small = format!("{{\"model\":\"m\",\"prompt\":\"{}\"}}", "x".repeat(1000));
    assert_eq!(post_vip(vip, small.into_bytes()).await.0, 200);
    let big = format!("{{\"model\":\"m\",\"prompt\":\"{}\"}}", "x".repeat(4000));
    let (status, _, body) = post_vip(vip, big.into_bytes()).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(
        backend.request_count(),
        1,
        "the oversized request never reaches the backend"
    );
}

#[test]
fn a_missing_vip_interface_is_a_start_up_error_naming_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = loxi_tests::harness::free_port();
    let out = std::process::Command::new(loxi_tests::harness::bin_path("loxilb"))
        .args([
            "--api-addr",
            &format!("127.0.0.1:{port}"),
            "--vip-iface",
            "nosuch0",
        ])
        .arg("--state-dir")
        .arg(dir.path())
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run loxilb");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("VIP interface \"nosuch0\" does not exist (--vip-iface)"),
        "{err}"
    );
}

/// A `--tc-iface` that does not exist stops the daemon at start with an error naming it, as a
/// missing `--xdp-iface` does (root: the data path is loaded before the interfaces are
/// looked up; under `CI` a missing root is a failure).
#[test]
fn a_missing_tc_interface_is_a_start_up_error_naming_it() {
    let root = std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    if !root {
        assert!(
            std::env::var_os("CI").is_none(),
            "root is required under CI"
        );
        eprintln!("SKIPPING: not root (the eBPF data path)");
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    let (code, err) = failed_start(
        dir.path(),
        &["--state-dir", &state, "--tc-iface", "nosuch0"],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("interface \"nosuch0\" does not exist (--xdp-iface / --tc-iface)"),
        "{err}"
    );
}

/// `loxilb` with `args` and a fresh state dir under `dir` that exits at start: its exit code and
/// stderr.
fn failed_start(dir: &std::path::Path, args: &[&str]) -> (Option<i32>, String) {
    loxi_tests::harness::failed_start(dir, args, &[])
}

#[test]
fn an_unusable_state_dir_is_a_start_up_error_naming_the_path() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").expect("write");
    let state = file.join("state");
    let (code, err) = failed_start(dir.path(), &["--state-dir", &state.display().to_string()]);
    assert_eq!(code, Some(1), "{err}");
    let want = format!("Error: state dir {}: creating it: ", state.display());
    assert!(err.starts_with(&want), "{err}");
    assert!(!err.contains("Caused by"), "the reason once: {err}");
    // With JSON logs the reason is also a JSON record, so a log pipeline keeps it.
    let state = state.display().to_string();
    let (code, err) = failed_start(dir.path(), &["--state-dir", &state, "--log-format", "json"]);
    assert_eq!(code, Some(1), "{err}");
    let record = err
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["fields"]["message"] == "loxilb stopped on an error")
        .unwrap_or_else(|| panic!("no JSON record of the fatal error: {err}"));
    assert_eq!(record["level"], "ERROR", "{record}");
    assert!(
        record["fields"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("creating it")),
        "{record}"
    );
}

/// Two daemons on one state dir would each acknowledge rules and overwrite each other's
/// `rules.json`: the second one does not start, and its error names the first one's pid. The
/// lock ends with the first daemon (here a SIGKILL, which runs no cleanup), so a restart on
/// the same dir starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_on_the_same_state_dir_does_not_start() {
    let mut d = Daemon::start_default().await;
    let state = d.state_dir().display().to_string();
    let pid = d.pid().expect("pid");
    let dir = tempfile::tempdir().expect("tmp");
    let (code, err) = failed_start(dir.path(), &["--state-dir", &state]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "Error: state dir {state}: another loxilb (pid {pid}) uses it"
        )),
        "{err}"
    );
    // The first one is untouched and still serves.
    let port = free_port();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "mode": 4, "sel": 0},
        "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8001}]
    });
    assert_eq!(d.post_rule(&rule).await.0, 200);
    d.kill();
    d.restart().await;
    assert_eq!(
        d.rules().await["lbAttr"].as_array().map(Vec::len),
        Some(1),
        "restarted on the same dir after the holder died"
    );
}

/// `--xdp-generic` only says how the `--xdp-iface` interfaces are attached: alone it would
/// change nothing (the daemon started without a word), so it is a usage error naming both.
#[test]
fn xdp_generic_without_xdp_iface_is_a_usage_error_naming_both_flags() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    let (code, err) = failed_start(dir.path(), &["--state-dir", &state, "--xdp-generic"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.starts_with(
            "error: the following required arguments were not provided:\n  --xdp-iface <IFACE>"
        ),
        "{err}"
    );
    let usage = err
        .lines()
        .find(|l| l.starts_with("Usage: loxilb "))
        .unwrap_or_else(|| panic!("no usage line: {err}"));
    assert!(usage.contains("--xdp-generic"), "{err}");
}

/// An interface in both `--xdp-iface` and `--tc-iface` would run the data path twice (XDP,
/// then TC on the frame XDP rewrote): a usage error naming the interface and both flags, before
/// anything is loaded. `--xdp-generic` with only `--tc-iface` stays the usage error above.
#[test]
fn one_interface_on_both_hooks_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    let (code, err) = failed_start(
        dir.path(),
        &[
            "--state-dir",
            &state,
            "--xdp-iface",
            "eth7",
            "--tc-iface",
            "eth9",
            "--tc-iface",
            "eth7",
        ],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.starts_with(
            "error: interface eth7 is named in both --xdp-iface and --tc-iface; the data path \
             runs on one hook per interface: keep one of the two"
        ),
        "{err}"
    );
    let (code, err) = failed_start(
        dir.path(),
        &[
            "--state-dir",
            &state,
            "--tc-iface",
            "eth9",
            "--tc-iface",
            "eth9",
        ],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.starts_with("error: interface eth9 is named twice in --tc-iface; name it once"),
        "{err}"
    );
    let (code, err) = failed_start(
        dir.path(),
        &["--state-dir", &state, "--tc-iface", "eth9", "--xdp-generic"],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.starts_with(
            "error: the following required arguments were not provided:\n  --xdp-iface <IFACE>"
        ),
        "{err}"
    );
}

/// `lo` attaches on either hook, but a client on the host then hangs on a VIP whose endpoints
/// are elsewhere: refused at start, saying why and what to use.
#[test]
fn the_loopback_interface_as_a_data_path_interface_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    for flag in ["--tc-iface", "--xdp-iface"] {
        let (code, err) = failed_start(dir.path(), &["--state-dir", &state, flag, "lo"]);
        assert_eq!(code, Some(2), "{flag}: {err}");
        assert!(
            err.starts_with(&format!(
                "error: {flag} lo: the loopback interface cannot carry the L4 data path: a \
                 client on this host reaches a VIP over lo"
            )),
            "{err}"
        );
        assert!(
            err.contains(
                "Name the interfaces remote clients and endpoints arrive on, and serve clients \
                 on this host with a mode-4 (fullproxy) rule"
            ),
            "{err}"
        );
    }
}

#[test]
fn a_bad_log_filter_is_reported_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    let (code, err) = failed_start(dir.path(), &["--state-dir", &state, "--log", "a=b=c"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.starts_with("Error: --log \"a=b=c\": "), "{err}");
    assert_eq!(
        err.lines().filter(|l| !l.trim().is_empty()).count(),
        1,
        "{err}"
    );
}

/// GETs `url`; the body, or the client error text.
async fn get_text(url: &str) -> Result<String, String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let uri: http::Uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(5), client.get(uri))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&body.to_bytes()).into_owned())
}

/// `--api-addr 127.0.0.1:0`: the OS picks the port and the log names the one bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_address_with_port_0_logs_the_port_bound() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("tmp");
    let mut child = std::process::Command::new(loxi_tests::harness::bin_path("loxilb"))
        .args(["--api-addr", "127.0.0.1:0", "--log", "info"])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--tokenizer-dir")
        .arg(dir.path().join("tok"))
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn loxilb");
    // Read stderr on a thread to its end (the daemon keeps logging), handing over the line.
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for l in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if l.contains("REST API listening")
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(l);
            }
        }
    });
    let line = tokio::time::timeout(Duration::from_secs(30), rx)
        .await
        .ok()
        .and_then(Result::ok);
    let addr = line.as_deref().and_then(|l| {
        let rest = &l[l.find("addr=")? + "addr=".len()..];
        rest.split_whitespace()
            .next()?
            .parse::<std::net::SocketAddr>()
            .ok()
    });
    let answer = match addr {
        Some(a) if a.port() != 0 => {
            Some(get_text(&format!("http://{a}/netlox/v1/config/loadbalancer/all")).await)
        }
        _ => None,
    };
    child.kill().expect("kill loxilb");
    child.wait().expect("reap loxilb");
    let addr = addr.unwrap_or_else(|| panic!("no bound address in {line:?}"));
    assert_eq!(addr.ip().to_string(), "127.0.0.1");
    assert_ne!(addr.port(), 0, "{line:?}");
    let body = answer.expect("asked").expect("the API answers");
    assert_eq!(
        body.trim(),
        "{\"lbAttr\":[]}",
        "the API answers on the logged address"
    );
}

/// `TOKIO_WORKER_THREADS` is the default of `--proxy-workers` and sizes the shared runtime: a
/// value tokio cannot use is a usage error at start naming the variable (tokio itself panics
/// with a stack trace), and a good one is used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_tokio_worker_threads_is_a_usage_error_naming_the_variable() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    for bad in ["abc", "0"] {
        let (code, err) = loxi_tests::harness::failed_start(
            dir.path(),
            &["--state-dir", &state],
            &[("TOKIO_WORKER_THREADS", bad)],
        );
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(
            err.starts_with(&format!(
                "error: invalid value \"{bad}\" for the environment variable TOKIO_WORKER_THREADS: "
            )),
            "{err}"
        );
        assert!(err.contains("an integer 1..=1024"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let d = Daemon::start(DaemonOpts::default().env("TOKIO_WORKER_THREADS", "2")).await;
    let m = d.metrics_text().await;
    assert!(
        m.contains("loxilb_proxy_worker_connections{worker=\"2\"}")
            && !m.contains("loxilb_proxy_worker_connections{worker=\"3\"}"),
        "two proxy workers by default (1 and 2):\n{m}"
    );
}

/// `--cert-dir` naming a regular file would stage nothing without a word: refused at start. A
/// missing directory stays fine (LoxiLB's default path usually does not exist).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cert_dir_that_is_a_file_is_a_start_up_error_and_a_missing_one_is_fine() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    let file = dir.path().join("passwd");
    std::fs::write(&file, "root:x:0:0::/root:/bin/sh\n").expect("write");
    let file = file.display().to_string();
    let (code, err) = failed_start(dir.path(), &["--state-dir", &state, "--cert-dir", &file]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with(&format!("Error: --cert-dir {file}: not a directory"))),
        "{err}"
    );
    let missing = dir.path().join("no-such-dir").display().to_string();
    let d = Daemon::start(DaemonOpts {
        args: vec!["--cert-dir".into(), missing],
        ..DaemonOpts::default()
    })
    .await;
    assert_eq!(
        d.get("/netlox/v1/config/cert/all").await.expect("GET").0,
        200
    );
}

/// A stored rule that no longer validates (here `rules.json` edited by hand) is dropped at start,
/// but not lost: it is written as stored to `rules.dropped-<secs>.json` (mode 0600) before any
/// write, and the log names that file (and does not report fields reset in it, as it does for
/// a rule it restores); the next change rewrites `rules.json` without it while the side file
/// keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_rule_that_no_longer_validates_is_kept_in_a_side_file() {
    use std::os::unix::fs::PermissionsExt;
    let mut d = Daemon::start_default().await;
    let rule = |port: u16| {
        json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "mode": 4, "sel": 0},
            "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8001}]
        })
    };
    let (p1, p2) = (free_port(), free_port());
    assert_eq!(d.post_rule(&rule(p1)).await.0, 200);
    assert_eq!(d.post_rule(&rule(p2)).await.0, 200);
    d.stop().await;
    let state = d.state_dir().join("rules.json");
    let mut file: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state).expect("read")).expect("JSON");
    let entries = file["rules"].as_array_mut().expect("rules");
    let bad = entries
        .iter_mut()
        .find(|r| r["rule"]["serviceArguments"]["port"] == json!(p2))
        .expect("the second rule");
    bad["rule"]["serviceArguments"]["externalIP"] = json!("999.1.1.1");
    // A field an older loxi stored and nothing reads, on both rules: the kept rule's reset is
    // logged; the dropped rule is logged as dropped only.
    bad["rule"]["serviceArguments"]["probeport"] = json!(9999);
    let bad = bad.clone();
    entries
        .iter_mut()
        .find(|r| r["rule"]["serviceArguments"]["port"] == json!(p1))
        .expect("the first rule")["rule"]["serviceArguments"]
        .as_object_mut()
        .expect("serviceArguments")
        .extend([
            ("probeport".to_string(), json!(9999)),
            ("probeTimeout".to_string(), json!(7)),
        ]);
    std::fs::write(&state, serde_json::to_vec_pretty(&file).expect("JSON")).expect("write");
    d.restart().await;
    let listed = d.rules().await;
    assert_eq!(
        listed["lbAttr"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );
    let side: Vec<std::path::PathBuf> = std::fs::read_dir(d.state_dir())
        .expect("state dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("rules.dropped-"))
        })
        .collect();
    assert_eq!(side.len(), 1, "{side:?}");
    let kept: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&side[0]).expect("read")).expect("JSON");
    assert_eq!(kept, json!({"version": 1, "rules": [bad]}));
    let mode = std::fs::metadata(&side[0])
        .expect("meta")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let log = d.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("dropping a restored rule that no longer validates"))
        .unwrap_or_else(|| panic!("no drop logged:\n{log}"));
    assert!(
        line.contains(&format!("kept as stored in {}", side[0].display())),
        "{line}"
    );
    assert!(line.contains("999.1.1.1"), "the reason: {line}");
    let resets: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("probe fields no probe reads cleared"))
        .collect();
    assert_eq!(
        resets.len(),
        1,
        "only the restored rule's reset: {resets:?}"
    );
    assert!(
        resets[0].contains("probeport") && resets[0].contains("probeTimeout"),
        "{resets:?}"
    );
    // The next change rewrites rules.json without the dropped rule; the side file keeps it.
    assert_eq!(d.post_rule(&rule(free_port())).await.0, 200);
    let now = std::fs::read_to_string(&state).expect("read");
    assert!(!now.contains("999.1.1.1"), "{now}");
    let still: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&side[0]).expect("read")).expect("JSON");
    assert_eq!(still, kept);
}

/// An L4 rule (here mode 0, written into `rules.json` as a daemon with `--xdp-iface` would have
/// stored it) restored by a daemon started without the L4 data path is kept, since a restart
/// with `--xdp-iface` serves it again, but never reported as serving: `status` is `OFFLINE`
/// whatever its endpoints' health, `GET .../all` says why in `listenerState`, and the log says
/// it at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_l4_rule_without_the_l4_data_path_is_reported_offline() {
    let mut d = Daemon::start_default().await;
    let port = free_port();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "mode": 4, "sel": 0},
        "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8001}]
    });
    assert_eq!(d.post_rule(&rule).await.0, 200);
    d.stop().await;
    let state = d.state_dir().join("rules.json");
    let mut file: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state).expect("read")).expect("JSON");
    file["rules"][0]["rule"]["serviceArguments"]["mode"] = json!(0);
    file["rules"][0]["rule"]["serviceArguments"]["protocol"] = json!("udp");
    std::fs::write(&state, serde_json::to_vec_pretty(&file).expect("JSON")).expect("write");
    d.restart().await;

    let listed = d.rules().await;
    let rules = listed["lbAttr"].as_array().expect("lbAttr");
    assert_eq!(rules.len(), 1, "kept: {listed}");
    // Mode 0, omitted as Go's `omitempty` omits a zero.
    assert_eq!(
        rules[0]["serviceArguments"]["protocol"],
        json!("udp"),
        "{listed}"
    );
    assert!(
        rules[0]["serviceArguments"].get("mode").is_none(),
        "{listed}"
    );
    let state_text = rules[0]["listenerState"].as_str().unwrap_or_default();
    assert!(
        state_text.starts_with("not served") && state_text.contains("--xdp-iface"),
        "{listed}"
    );
    let (s, body) = d
        .get(&format!(
            "/netlox/v1/config/loadbalancer/externalipaddress/127.0.0.1/port/{port}/protocol/udp/status"
        ))
        .await
        .expect("GET status");
    assert_eq!(s, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(status["operatingStatus"], json!("OFFLINE"), "{body}");
    let log = d.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("restored L4 rule is NOT served") && l.contains("OFFLINE")),
        "{log}"
    );
    // A fullproxy rule beside it is not affected.
    let p2 = free_port();
    let mut fp = rule.clone();
    fp["serviceArguments"]["port"] = json!(p2);
    assert_eq!(d.post_rule(&fp).await.0, 200);
    let listed = d.rules().await;
    let fp_state = listed["lbAttr"]
        .as_array()
        .expect("lbAttr")
        .iter()
        .find(|r| r["serviceArguments"]["port"] == json!(p2))
        .map(|r| r["listenerState"].clone());
    assert_eq!(fp_state, Some(json!("listening")), "{listed}");
}

/// `RUST_LOG` is not the daemon's filter (`--log` is): set, it is named in a warning at start
/// rather than silently ignored, and the filter in force is the one `--log` gave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_log_is_named_as_not_read() {
    let d =
        Daemon::start(loxi_tests::harness::DaemonOpts::default().env("RUST_LOG", "trace")).await;
    let log = d.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("RUST_LOG is set but not read") && l.contains("WARN")),
        "{log}"
    );
    assert!(
        !log.contains("TRACE"),
        "RUST_LOG=trace did not take effect: {log}"
    );
}
