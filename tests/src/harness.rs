//! The shared integration-test harness: runs the real `loxilb` daemon binary on a loopback port
//! reserved for the test process ([`free_port`]) with a temporary state directory, talks to its
//! REST API, and runs `loxicmd`.
//!
//! Binaries: the harness never builds anything. `cargo test --workspace` builds `loxilb` and
//! `loxicmd` into the profile directory of the test executable (`target/<profile>/`; the
//! `loxi-user/tests/bins.rs` integration test makes cargo build them), and the harness finds
//! them from [`std::env::current_exe`] (`target/<profile>/deps/<test>` → `target/<profile>/`).
//! With `cargo test -p loxi-tests` alone run `cargo build -p loxi-user --bins` first.
//! Set `LOXI_BIN_DIR` to use binaries from elsewhere.
//!
//! The daemon's stdout and stderr go to `<tmp>/loxilb.log` ([`Daemon::log_text`]); the
//! readiness timeout and [`Daemon::dump_log_on_panic`] print it so a failing test shows why.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// How long [`Daemon::start`] waits for the API to answer before giving up.
pub const READY_TIMEOUT: Duration = Duration::from_secs(15);

/// How long a graceful stop (SIGTERM) may take before the harness sends SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Options for [`Daemon::start`]. `Default` gives an empty temp state dir and `--log info`.
#[derive(Debug, Clone, Default)]
pub struct DaemonOpts {
    /// Extra environment variables for the daemon (`LOXILB_*`, `LLB_*`, `LOXI_*`).
    pub env: Vec<(String, String)>,
    /// Use this state dir instead of a fresh temp dir (it is not deleted on drop).
    pub state_dir: Option<PathBuf>,
    /// `--tokenizer-dir`; default `<tmp>/tokenizers` (empty).
    pub tokenizer_dir: Option<PathBuf>,
    /// `--log` filter; default `info`.
    pub log: Option<String>,
    /// Extra command-line arguments appended last.
    pub args: Vec<String>,
    /// Bearer token the harness sends with every API request (the daemon's token options go
    /// in `args` / `env`).
    pub api_token: Option<String>,
    /// PEM CA file: the harness talks HTTPS to the API, trusting this CA (the daemon's
    /// `--api-tls-cert` / `--api-tls-key` go in `args`).
    pub tls_ca: Option<PathBuf>,
    /// IP the API binds (`--api-addr`); default 127.0.0.1. The harness always connects to
    /// 127.0.0.1 (so `0.0.0.0` works too).
    pub api_bind_ip: Option<std::net::IpAddr>,
    /// The daemon's open-file limit `(soft, hard)` (`RLIMIT_NOFILE`, set with util-linux's
    /// `prlimit`, which then runs the daemon in its own process); default: the harness's own.
    pub nofile: Option<(u64, u64)>,
}

impl DaemonOpts {
    /// Adds one environment variable.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }
}

/// A running `loxilb`. Killed (SIGKILL) on drop; the temp dir goes with it.
pub struct Daemon {
    opts: DaemonOpts,
    child: Option<Child>,
    api: SocketAddr,
    tmp: tempfile::TempDir,
    state_dir: PathBuf,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// The directory holding the workspace binaries (`loxilb`, `loxicmd`, test helpers).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("LOXI_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("current_exe of the test binary");
    let deps = exe.parent().expect("test binary has a parent dir");
    let dir = if deps.ends_with("deps") {
        deps.parent().expect("deps has a parent")
    } else {
        deps
    };
    dir.to_path_buf()
}

/// Path of a workspace binary; panics with a hint when it is missing.
pub fn bin_path(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} not found: run the tests with `cargo test --workspace` (it builds the binaries) or set LOXI_BIN_DIR",
        p.display()
    );
    p
}

/// A TCP port for a listener another process opens (the daemon's API, a rule's VIP, a
/// publisher), reserved for this test process until it exits.
///
/// Binding port 0 and releasing it is racy: the kernel hands the same number to the next
/// `bind(0)` or outgoing connection of any process (parallel test threads, other test runs)
/// before the daemon binds it. So the port comes from outside the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`, where no `bind(0)` or `connect` ever lands), is claimed with
/// an exclusive `flock` on `$TMPDIR/loxi-test-ports/<port>.lock` that this process holds until
/// it exits (so no other thread or test process using this harness gets it), and is skipped
/// when something already listens on it. Listeners the test opens itself bind port 0 and keep
/// the socket instead ([`crate::backend::Backend`]).
pub fn free_port() -> u16 {
    ports::reserve()
}

mod ports {
    use std::fs::File;
    use std::net::TcpListener;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use parking_lot::Mutex;

    /// Lowest port handed out (below it: well-known and commonly configured service ports).
    const FLOOR: u16 = 10_000;

    /// The lock files of the ports this process holds (the locks last as long as the files).
    static HELD: Mutex<Vec<File>> = Mutex::new(Vec::new());
    /// Where the next search starts, so one process walks its candidates in order.
    static NEXT: AtomicUsize = AtomicUsize::new(usize::MAX);

    /// The kernel's ephemeral range, `(low, high)` inclusive (Linux's default when unreadable).
    fn ephemeral() -> (u16, u16) {
        let text =
            std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
        let mut it = text.split_whitespace().map(str::parse::<u16>);
        match (it.next(), it.next()) {
            (Some(Ok(lo)), Some(Ok(hi))) if lo <= hi => (lo, hi),
            _ => (32_768, 60_999),
        }
    }

    /// Ports outside the ephemeral range, from [`FLOOR`] up.
    fn candidates() -> Vec<u16> {
        let (lo, hi) = ephemeral();
        (FLOOR..=u16::MAX).filter(|p| *p < lo || *p > hi).collect()
    }

    fn lock_dir() -> PathBuf {
        let dir = std::env::temp_dir().join("loxi-test-ports");
        std::fs::create_dir_all(&dir).expect("create the test port lock dir");
        dir
    }

    /// Claims `port` for this process: its lock file is free and nothing listens on it.
    fn claim(dir: &std::path::Path, port: u16) -> Option<File> {
        let file = File::create(dir.join(format!("{port}.lock"))).ok()?;
        file.try_lock().ok()?;
        TcpListener::bind(("0.0.0.0", port)).ok()?;
        Some(file)
    }

    /// A port claimed for this process (see [`super::free_port`]).
    pub(super) fn reserve() -> u16 {
        let cands = candidates();
        assert!(!cands.is_empty(), "no ports outside the ephemeral range");
        let dir = lock_dir();
        // Each process starts at its own place (pid), so concurrent runs rarely probe the same
        // ports; the locks make a collision impossible either way.
        let _ = NEXT.compare_exchange(
            usize::MAX,
            std::process::id() as usize * 7919 % cands.len(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        for _ in 0..cands.len() {
            let i = NEXT.fetch_add(1, Ordering::Relaxed) % cands.len();
            if let Some(file) = claim(&dir, cands[i]) {
                HELD.lock().push(file);
                return cands[i];
            }
        }
        panic!("every port outside the ephemeral range is taken");
    }
}

impl Daemon {
    /// Starts `loxilb` with `opts` and waits until `GET /netlox/v1/config/loadbalancer/all`
    /// answers 200. Panics (showing the daemon log) if it exits or does not answer within
    /// [`READY_TIMEOUT`].
    pub async fn start(opts: DaemonOpts) -> Daemon {
        let tmp = tempfile::tempdir().expect("temp dir");
        let state_dir = opts
            .state_dir
            .clone()
            .unwrap_or_else(|| tmp.path().join("state"));
        let client = Client::builder(TokioExecutor::new()).build_http();
        let api = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut d = Daemon {
            opts,
            child: None,
            api,
            tmp,
            state_dir,
            client,
        };
        d.spawn_and_wait().await;
        d
    }

    /// Starts with default options.
    pub async fn start_default() -> Daemon {
        Self::start(DaemonOpts::default()).await
    }

    fn spawn(&mut self) {
        let log_path = self.log_path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("open daemon log");
        let tok = self
            .opts
            .tokenizer_dir
            .clone()
            .unwrap_or_else(|| self.tmp.path().join("tokenizers"));
        let mut cmd = match self.opts.nofile {
            None => Command::new(bin_path("loxilb")),
            Some((soft, hard)) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={soft}:{hard}"))
                    .arg("--")
                    .arg(bin_path("loxilb"));
                c
            }
        };
        let bind = SocketAddr::new(
            self.opts.api_bind_ip.unwrap_or(self.api.ip()),
            self.api.port(),
        );
        cmd.arg("--api-addr")
            .arg(bind.to_string())
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--tokenizer-dir")
            .arg(tok)
            .arg("--log")
            .arg(self.opts.log.clone().unwrap_or_else(|| "info".into()))
            .args(&self.opts.args)
            // Tests assert exact KV routing decisions; on a loaded CI machine the first
            // tokenizer load or a cold tokenization may exceed the 10 ms default decision
            // budget (a `budget` miss by design). The budget has its own tests; here it is wide
            // unless a test sets it.
            .env("LOXI_KV_DECISION_BUDGET_MS", "30000")
            .envs(self.opts.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log fd"))
            .stderr(log);
        self.child = Some(cmd.spawn().expect("spawn loxilb"));
    }

    async fn spawn_and_wait(&mut self) {
        self.spawn();
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut port_retries = 3;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                // A program outside this harness may have bound the reserved port meanwhile.
                if port_retries > 0 && self.log_text().contains("binding the REST API") {
                    port_retries -= 1;
                    self.child = None;
                    self.api = SocketAddr::from(([127, 0, 0, 1], free_port()));
                    self.spawn();
                    continue;
                }
                panic!(
                    "loxilb exited during start with {status}; log:\n{}",
                    self.log_text()
                );
            }
            let ready = tokio::time::timeout(
                Duration::from_secs(1),
                self.get("/netlox/v1/config/loadbalancer/all"),
            )
            .await;
            if let Ok(Ok((200, _))) = ready {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "loxilb did not answer on {} within {READY_TIMEOUT:?}; log:\n{}",
                    self.api,
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// `http://127.0.0.1:PORT` (`https://` with [`DaemonOpts::tls_ca`]) of the REST API (no
    /// trailing slash).
    pub fn api_url(&self) -> String {
        let scheme = if self.opts.tls_ca.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.api)
    }

    /// Sends `req` (URI = path and query) to the API with the options' token, over TLS when
    /// [`DaemonOpts::tls_ca`] is set.
    async fn send(
        &self,
        mut req: http::Request<Full<Bytes>>,
    ) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
        if let Some(token) = &self.opts.api_token {
            req.headers_mut()
                .insert("authorization", format!("Bearer {token}").parse()?);
        }
        if let Some(ca) = &self.opts.tls_ca {
            req.headers_mut()
                .insert("host", self.api.to_string().parse()?);
            return crate::tls::https_send(self.api, ca, req).await;
        }
        *req.uri_mut() = format!("{}{}", self.api_url(), req.uri()).parse()?;
        Ok(self.client.request(req).await?)
    }

    /// Changes the bearer token the harness sends from now on (`None`: no token).
    pub fn set_api_token(&mut self, token: Option<&str>) {
        self.opts.api_token = token.map(str::to_string);
    }

    /// The REST API's socket address.
    pub fn api_addr(&self) -> SocketAddr {
        self.api
    }

    /// The API port (for `loxicmd --port`).
    pub fn api_port(&self) -> u16 {
        self.api.port()
    }

    /// The state directory (kept across [`Daemon::restart`]).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The daemon's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    fn log_path(&self) -> PathBuf {
        self.tmp.path().join("loxilb.log")
    }

    /// Everything the daemon has written to stdout/stderr so far (all runs, appended).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// One HTTP request to the API with extra headers; `(status, response headers, body text)`.
    pub async fn request_with(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> anyhow::Result<(u16, http::HeaderMap, String)> {
        let mut req = http::Request::builder().method(method).uri(path);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(Bytes::from(body.unwrap_or("").to_string())))?;
        let resp = self.send(req).await?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((
            status,
            headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        ))
    }

    /// One HTTP request to the API; `(status, body text)`.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> anyhow::Result<(u16, String)> {
        let mut req = http::Request::builder().method(method).uri(path);
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req.body(Full::new(Bytes::from(body.unwrap_or("").to_string())))?;
        let resp = self.send(req).await?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    }

    /// `GET path` → `(status, body)`.
    pub async fn get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        self.request("GET", path, None).await
    }

    /// `POST /netlox/v1/config/loadbalancer` with `rule` → `(status, JSON body)`.
    pub async fn post_rule(&self, rule: &serde_json::Value) -> (u16, serde_json::Value) {
        self.post_rule_raw(&rule.to_string()).await
    }

    /// Posts a mode-4 `sel: 0` rule on a free loopback port in front of `backend_ports`
    /// (127.0.0.1) with the KV tier role-less (`kvExactMode: 3`, 32-token blocks,
    /// `sha256_cbor`; each endpoint its own KV-event port, where nothing publishes: engines on
    /// one host cannot share one), asserts 200 and waits (10 s at most) until its listener
    /// accepts. Returns the VIP address.
    pub async fn post_kv_pool_rule(&self, backend_ports: &[u16]) -> SocketAddr {
        let port = free_port();
        let endpoints: Vec<_> = backend_ports
            .iter()
            .map(|p| {
                serde_json::json!({"endpointIP": "127.0.0.1", "targetPort": p,
                    "kvZmqPort": free_port()})
            })
            .collect();
        let (status, body) = self
            .post_rule(&serde_json::json!({
                "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "mode": 4, "sel": 0,
                    "kvExactMode": 3, "kvBlockSize": 32, "kvHashAlgo": "sha256_cbor"},
                "endpoints": endpoints,
            }))
            .await;
        assert_eq!(status, 200, "{body}");
        let vip: SocketAddr = ([127, 0, 0, 1], port).into();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(vip).await.is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "listener never opened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        vip
    }

    /// Like [`Daemon::post_rule`] with a raw body (for malformed JSON tests).
    pub async fn post_rule_raw(&self, body: &str) -> (u16, serde_json::Value) {
        let (status, text) = self
            .request("POST", "/netlox/v1/config/loadbalancer", Some(body))
            .await
            .expect("POST /netlox/v1/config/loadbalancer");
        (status, parse_json(&text))
    }

    /// `DELETE /netlox/v1/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}`
    /// with an optional query string (`host=..&model_name=..`) → `(status, JSON body)`.
    pub async fn delete_rule(
        &self,
        ip: &str,
        port: u16,
        proto: &str,
        query: Option<&str>,
    ) -> (u16, serde_json::Value) {
        let q = query.map(|q| format!("?{q}")).unwrap_or_default();
        let path = format!(
            "/netlox/v1/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}{q}"
        );
        let (status, text) = self
            .request("DELETE", &path, None)
            .await
            .expect("DELETE rule");
        (status, parse_json(&text))
    }

    /// `GET /netlox/v1/config/loadbalancer/all` parsed (`{"lbAttr": [...]}`).
    pub async fn rules(&self) -> serde_json::Value {
        let (status, text) = self
            .get("/netlox/v1/config/loadbalancer/all")
            .await
            .expect("GET rules");
        assert_eq!(status, 200, "GET /config/loadbalancer/all: {text}");
        parse_json(&text)
    }

    /// The Prometheus text of `GET /netlox/v1/metrics` (asserts 200).
    pub async fn metrics_text(&self) -> String {
        let (status, text) = self.get("/netlox/v1/metrics").await.expect("GET metrics");
        assert_eq!(status, 200, "GET /netlox/v1/metrics: {text}");
        text
    }

    /// Polls the metrics until the sample `name{needles}` ([`crate::http::metric`]) equals
    /// `want`, 10 s at most (then panics naming the last value); returns that scrape.
    pub async fn wait_metric(&self, name: &str, needles: &[&str], want: f64) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let m = self.metrics_text().await;
            let v = crate::http::metric(&m, name, needles);
            if v == want {
                return m;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}{needles:?} = {v}, want {want}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Sends SIGTERM and waits up to [`STOP_TIMEOUT`] for exit (then SIGKILL). Returns the exit
    /// status when the process ended on its own.
    pub async fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status();
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// Stops the daemon gracefully and starts it again with the same options, state dir and API
    /// port (a new port if the old one cannot be reused).
    pub async fn restart(&mut self) {
        self.stop().await;
        self.spawn();
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Ok((200, _))) = tokio::time::timeout(
                Duration::from_secs(1),
                self.get("/netlox/v1/config/loadbalancer/all"),
            )
            .await
            {
                return;
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
                .is_some();
            if exited || Instant::now() > deadline {
                // The old port may be taken by now: try once more on a fresh one.
                self.kill();
                self.api = SocketAddr::from(([127, 0, 0, 1], free_port()));
                self.spawn_and_wait().await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Sends SIGKILL (no cleanup runs in the daemon) and reaps the process; [`Self::restart`]
    /// starts it again.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Runs `loxicmd --apiserver 127.0.0.1 --port <api port> <args>` and returns its output.
    pub fn loxicmd(&self, args: &[&str]) -> Output {
        loxicmd_at(self.api, args)
    }

    /// Prints the daemon log to stderr (call before an assertion you expect may fail).
    pub fn dump_log(&self) {
        eprintln!("---- loxilb log ----\n{}\n---- end ----", self.log_text());
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_log();
        }
        self.kill();
    }
}

/// Runs `loxicmd` against the API at `api` with `args` (global flags first).
pub fn loxicmd_at(api: SocketAddr, args: &[&str]) -> Output {
    Command::new(bin_path("loxicmd"))
        .arg("--apiserver")
        .arg(api.ip().to_string())
        .arg("--port")
        .arg(api.port().to_string())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run loxicmd")
}

/// Runs `loxilb` on a free loopback API port with `--tokenizer-dir <dir>/tok`, then `args`, and
/// the environment variables `env`, expecting it to refuse to start: returns its exit code and
/// stderr. A daemon still running after 20 s is killed and the calling test fails.
pub fn failed_start(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut child = Command::new(bin_path("loxilb"))
        .args(["--api-addr", &format!("127.0.0.1:{}", free_port())])
        .arg("--tokenizer-dir")
        .arg(dir.join("tok"))
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run loxilb");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait loxilb") {
            break Some(s);
        }
        if Instant::now() > deadline {
            child.kill().expect("kill loxilb");
            child.wait().expect("reap loxilb");
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        e.read_to_string(&mut err).expect("stderr");
    }
    let status = status.unwrap_or_else(|| panic!("loxilb {args:?} {env:?} did not exit:\n{err}"));
    (status.code(), err)
}

/// Parses a response body as JSON; a non-JSON body becomes `{"raw": text}` so assertions show it.
pub fn parse_json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|_| serde_json::json!({ "raw": text }))
}

/// Runs `promtool check metrics`; when promtool is missing, fails under `CI`, else skips loudly.
pub fn promtool_check(text: &str) {
    use std::io::Write;
    let spawn = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match spawn {
        Ok(c) => c,
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!(
                "SKIPPING promtool check: promtool not runnable ({e}); install Debian package `prometheus`"
            );
            return;
        }
        Err(e) => panic!("promtool is required under CI: {e}"),
    };
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write metrics");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n--- metrics ---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The prefix of LoxiLB's P/D request id (`___prefill_addr_<ip:port>___decode_addr_<ip:port>_`,
/// then a UUID) for a prefill and a decode on 127.0.0.1 whose KV side channels are these ports.
pub fn loopback_pd_rid_prefix(prefill: u16, decode: u16) -> String {
    format!("___prefill_addr_127.0.0.1:{prefill}___decode_addr_127.0.0.1:{decode}_")
}
