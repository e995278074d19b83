//! The deployment files under `deploy/`, checked against the real daemon:
//! - Kubernetes manifests pass strict schema validation (`kubernetes-validate --strict`, PyPI),
//!   and the DaemonSet's container spec (args, env, ConfigMap, probes, metrics Service) runs
//!   the real `loxilb` and its probe and scrape paths answer;
//! - the systemd unit passes `systemd-analyze verify`, and its capability set (and no more) lets
//!   an unprivileged user load and attach XDP and manage VIPs; without CAP_BPF or CAP_PERFMON
//!   the daemon refuses to start.
//!
//! A missing tool (`kubernetes-validate`, `systemd-analyze`, PyYAML) or not being root skips a
//! test loudly, and fails it when `CI` is set.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use loxi_tests::harness::{bin_path, free_port};
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// `Err(reason)` from a missing prerequisite: skip locally, fail under CI.
fn require(what: &str, ok: bool) -> bool {
    if ok {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{what} is required under CI"
    );
    eprintln!("SKIPPING: {what} not available");
    false
}

fn runs(cmd: &str, arg: &str) -> bool {
    Command::new(cmd)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Every YAML document of `file`, as JSON (PyYAML's safe loader).
fn yaml_docs(file: &Path) -> Vec<Value> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, json, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(file)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

fn manifests() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(deploy_dir().join("kubernetes"))
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    v.sort();
    v
}

fn have_pyyaml() -> bool {
    require(
        "python3 with PyYAML (scripts/setup.sh)",
        Command::new("python3")
            .args(["-c", "import yaml"])
            .status()
            .is_ok_and(|s| s.success()),
    )
}

#[test]
fn kubernetes_manifests_pass_strict_schema_validation() {
    let have = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--version"])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !require("kubernetes-validate (pip, scripts/setup.sh)", have) {
        return;
    }
    let files = manifests();
    assert_eq!(files.len(), 4, "{files:?}");
    let out = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict", "--quiet"])
        .args(&files)
        .output()
        .expect("python3 -m kubernetes_validate");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The same check fails on a misspelled field, so it would catch one in our files.
    let tmp = tempfile::tempdir().expect("tmp");
    let bad = tmp.path().join("daemonset.yaml");
    let text = std::fs::read_to_string(deploy_dir().join("kubernetes/daemonset.yaml"))
        .expect("daemonset")
        .replace("hostNetwork: true", "hostNetworking: true");
    std::fs::write(&bad, text).expect("write");
    let out = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict", "--quiet"])
        .arg(&bad)
        .output()
        .expect("python3 -m kubernetes_validate");
    assert!(!out.status.success(), "a misspelled field must fail");
}

#[test]
fn kustomization_lists_every_manifest() {
    if !have_pyyaml() {
        return;
    }
    let k = &yaml_docs(&deploy_dir().join("kubernetes/kustomization.yaml"))[0];
    let listed: BTreeSet<String> = k["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|v| v.as_str().expect("name").to_string())
        .collect();
    let present: BTreeSet<String> = manifests()
        .iter()
        .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    assert_eq!(listed, present);
}

/// Kubernetes `$(VAR)` expansion over `env` (as the kubelet does for args and env values).
fn expand(s: &str, env: &[(String, String)]) -> String {
    env.iter().fold(s.to_string(), |acc, (k, v)| {
        acc.replace(&format!("$({k})"), v)
    })
}

/// Polls `GET http://addr{path}` (with `Authorization: Bearer <token>` when given) until 200
/// (10 s); returns the body.
fn http_get_200(addr: &str, path: &str, token: Option<&str>) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let auth = token.map(|t| format!("Authorization: Bearer {t}"));
        let out = Command::new("curl")
            .args(["-s", "-m", "2", "-w", "\n%{http_code}"])
            .args(auth.iter().flat_map(|h| ["-H", h.as_str()]))
            .arg(format!("http://{addr}{path}"))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if let Some((body, code)) = text.rsplit_once('\n')
            && code == "200"
        {
            return body.to_string();
        }
        assert!(Instant::now() < deadline, "GET {addr}{path}: {text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn daemonset_container_spec_runs_the_real_daemon_and_its_probes_answer() {
    if !have_pyyaml() {
        return;
    }
    let k8s = deploy_dir().join("kubernetes");
    let ds = &yaml_docs(&k8s.join("daemonset.yaml"))[0];
    let cm = &yaml_docs(&k8s.join("configmap.yaml"))[0];
    let svc = &yaml_docs(&k8s.join("service.yaml"))[0];
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    let c = &pod["containers"][0];
    let api_port = c["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == "api")
        .and_then(|p| p["containerPort"].as_u64())
        .expect("container port named api");

    // The environment as the kubelet builds it: the env list in order ($(VAR) expanded, the
    // node IP = loopback here), then the ConfigMap.
    let port = free_port();
    let mut env: Vec<(String, String)> = Vec::new();
    for e in c["env"].as_array().expect("env") {
        let name = e["name"].as_str().expect("name").to_string();
        let value = match e["value"].as_str() {
            Some(v) => expand(v, &env),
            None if e["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP" => {
                "127.0.0.1".to_string()
            }
            None => panic!("unhandled env source: {e}"),
        };
        env.push((name, value));
    }
    let mut cmd = Command::new(bin_path("loxilb"));
    for (k, v) in cm["data"].as_object().expect("configmap data") {
        cmd.env(k, v.as_str().expect("string value"));
    }
    for (k, v) in &env {
        cmd.env(k, v);
    }
    // An operator who adds an API token (the API is on the node's address): the probes must
    // still answer without one.
    let token = "deploy-test-token";
    cmd.env("LOXI_API_TOKEN", token);
    // Volume mounts → temp dirs.
    let tmp = tempfile::tempdir().expect("tmp");
    let mut args: Vec<String> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| expand(a.as_str().expect("arg"), &env))
        .collect();
    // The API on the node's address (bare: IPv6 nodes need no brackets) and the named port.
    assert!(args.contains(&"--host=127.0.0.1".to_string()), "{args:?}");
    let port_arg = format!("--port={api_port}");
    assert!(args.contains(&port_arg), "API on the named port: {args:?}");
    // The host's port 11111 may be taken: the same spec on a free port.
    for a in &mut args {
        if *a == port_arg {
            *a = format!("--port={port}");
        }
    }
    let api_addr = format!("127.0.0.1:{port}");
    for m in c["volumeMounts"].as_array().expect("mounts") {
        let mount = m["mountPath"].as_str().expect("mountPath");
        let local = tmp.path().join(m["name"].as_str().expect("name"));
        std::fs::create_dir_all(&local).expect("mkdir");
        for a in &mut args {
            *a = a.replace(mount, &local.display().to_string());
        }
    }
    let log = tmp.path().join("loxilb.log");
    let mut child = cmd
        .args(&args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).expect("log"))
        .stderr(std::fs::File::create(tmp.path().join("stderr.log")).expect("log"))
        .spawn()
        .expect("spawn loxilb");
    let probe = |p: &str| {
        let probe = &c[p]["httpGet"];
        assert_eq!(probe["port"], "api", "{p} probes the API port");
        http_get_200(&api_addr, probe["path"].as_str().expect("path"), None)
    };
    // Without a token: LoxiLB's version route, which answers once the state is restored.
    for p in ["readinessProbe", "livenessProbe"] {
        let body = probe(p);
        assert!(body.contains("version"), "{p}: {body}");
    }
    // The metrics Service: its annotations name the API port and the metrics path.
    let ann = &svc["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/port"], api_port.to_string());
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "api");
    let scrape = http_get_200(
        &api_addr,
        ann["prometheus.io/path"].as_str().expect("path"),
        Some(token),
    );
    assert!(scrape.contains("loxilb_proxy_requests"), "{scrape}");
    // The token is enforced (so the probes above answered without one by design).
    let code = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-m", "2", "-w", "%{http_code}"])
        .arg(format!(
            "http://{api_addr}/netlox/v1/config/loadbalancer/all"
        ))
        .output()
        .expect("curl");
    assert_eq!(String::from_utf8_lossy(&code.stdout), "401");
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().expect("wait");
    let logs = std::fs::read_to_string(tmp.path().join("stderr.log")).expect("log");
    assert!(status.success(), "{status}: {logs}");
    // Every ConfigMap value and flag was accepted (a refused value is a warning naming it).
    assert!(!logs.contains("is not accepted"), "{logs}");
    assert!(
        logs.contains("\"message\":\"REST API listening\""),
        "JSON logs: {logs}"
    );
}

fn unit_text() -> String {
    std::fs::read_to_string(deploy_dir().join("systemd/loxilb.service")).expect("unit")
}

#[test]
fn systemd_unit_passes_systemd_analyze_verify() {
    if !require("systemd-analyze", runs("systemd-analyze", "--version")) {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let unit = tmp.path().join("loxilb.service");
    // verify checks that ExecStart is executable: point it at the built binary.
    let text = unit_text().replace(
        "/usr/local/bin/loxilb",
        &bin_path("loxilb").display().to_string(),
    );
    assert_ne!(text, unit_text());
    std::fs::write(&unit, text).expect("write");
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "{err}");
}

/// `CAP_BPF CAP_PERFMON ...` → `+bpf,+perfmon,...` (setpriv's syntax).
fn unit_caps() -> Vec<String> {
    let text = unit_text();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("AmbientCapabilities="))
        .expect("AmbientCapabilities");
    let bounding = text
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("CapabilityBoundingSet");
    assert_eq!(line, bounding, "ambient = bounding set");
    line.split_whitespace()
        .map(|c| c.trim_start_matches("CAP_").to_ascii_lowercase())
        .collect()
}

struct Netns(String);

impl Netns {
    fn new() -> Self {
        let name = format!("loxiunit{}", std::process::id());
        let sh = |c: &str| {
            let ok = Command::new("sh").args(["-c", c]).status().expect("sh");
            assert!(ok.success(), "{c}");
        };
        sh(&format!("ip netns add {name}"));
        sh(&format!(
            "ip -n {name} link add ux0 type veth peer name ux1"
        ));
        sh(&format!(
            "ip -n {name} link set ux0 up && ip -n {name} link set ux1 up && ip -n {name} link set lo up"
        ));
        Self(name)
    }

    fn sh(&self, c: &str) -> String {
        let out = Command::new("ip")
            .args(["-n", &self.0])
            .args(c.split_whitespace())
            .output()
            .expect("ip");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Starts `loxilb` in `ns` as uid/gid 65534 with exactly `caps` (ambient, inheritable and
/// bounding), XDP and VIPs on `ux0`.
fn run_unprivileged(ns: &Netns, caps: &[String], dir: &Path, port: u16) -> std::process::Child {
    let set = format!(
        "-all,{}",
        caps.iter()
            .map(|c| format!("+{c}"))
            .collect::<Vec<_>>()
            .join(",")
    );
    Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.0,
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ])
        .arg(format!("--inh-caps={set}"))
        .arg(format!("--ambient-caps={set}"))
        .arg(format!("--bounding-set={set}"))
        .arg("--")
        .arg(bin_path("loxilb"))
        .args(["--api-addr", &format!("127.0.0.1:{port}")])
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--tokenizer-dir")
        .arg(dir.join("tok"))
        .args(["--xdp-iface", "ux0", "--vip-iface", "ux0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("log")).expect("log"))
        .spawn()
        .expect("spawn setpriv loxilb")
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn systemd_capability_set_is_enough_for_xdp_and_vips_as_an_unprivileged_user() {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    if !require(
        "root (netns, setpriv)",
        root && runs("setpriv", "--version"),
    ) {
        return;
    }
    let caps = unit_caps();
    assert_eq!(caps, ["bpf", "perfmon", "net_admin", "net_bind_service"]);
    let ns = Netns::new();
    let tmp = tempfile::tempdir().expect("tmp");
    // The dynamic user owns its state directory (StateDirectory=); here uid 65534 does.
    std::fs::create_dir_all(tmp.path().join("state")).expect("mkdir");
    let _ = Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(tmp.path())
        .status();
    let port = free_port();
    let mut child = run_unprivileged(&ns, &caps, tmp.path(), port);
    let log = || std::fs::read_to_string(tmp.path().join("log")).unwrap_or_default();
    wait_until("XDP attached by the unprivileged daemon", || {
        ns.sh("link show dev ux0").contains("prog/xdp")
    });
    let rule = r#"{"serviceArguments":{"externalIP":"127.77.1.1","port":80,"protocol":"tcp","mode":4,"sel":0},"endpoints":[{"endpointIP":"127.0.0.1","targetPort":9}]}"#;
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.0,
            "curl",
            "-s",
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "-d",
            rule,
        ])
        .arg(format!(
            "http://127.0.0.1:{port}/netlox/v1/config/loadbalancer"
        ))
        .output()
        .expect("curl");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\"result\":\"Success\""),
        "{} {}",
        String::from_utf8_lossy(&out.stdout),
        log()
    );
    // VIP added over netlink, and the fullproxy listener bound port 80 (NET_BIND_SERVICE).
    wait_until("VIP added", || {
        ns.sh("-4 addr show dev ux0").contains("127.77.1.1/32")
    });
    wait_until("listener on 127.77.1.1:80", || {
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns.0,
                "ss",
                "-Hltn",
                "src",
                "127.77.1.1:80",
            ])
            .output()
            .is_ok_and(|o| !o.stdout.is_empty())
    });
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().expect("wait");
    assert!(status.success(), "{status}: {}", log());
    assert!(
        !ns.sh("link show dev ux0").contains("prog/xdp"),
        "XDP detached on SIGTERM"
    );
    assert!(
        !ns.sh("-4 addr show dev ux0").contains("127.77.1.1"),
        "VIP removed on SIGTERM"
    );

    // Each of CAP_BPF and CAP_PERFMON is needed: without one the data path cannot load.
    for missing in ["bpf", "perfmon"] {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != missing).cloned().collect();
        let mut child = run_unprivileged(&ns, &fewer, tmp.path(), free_port());
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(s) = child.try_wait().expect("try_wait") {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "started without CAP_{missing}: {}",
                log()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(!status.success());
        assert!(
            log().contains("L4 data path"),
            "without CAP_{missing}: {}",
            log()
        );
    }
}
