//! `xtask netns-test`: client ns — LB ns — two backend ns over veth pairs; the L4 data path in
//! the LB ns (attached to its three veths). Two topologies, each in namespaces of its own:
//! - `xdp` peers: pass-through XDP on the peers, so redirected XDP frames are delivered and
//!   the data path must use `bpf_redirect` (its counters show no TC hand-off);
//! - `plain` peers: no XDP program and GRO off on every peer, like container and Kubernetes
//!   backends; a veth drops redirected XDP frames there, so the data path must hand every
//!   rewritten packet to its TC program (its counters show no XDP redirect);
//! - `tc`: plain peers with TX checksum offload on (a container's TCP and UDP leave with
//!   partial checksums, as they do in production; the LB's veths complete them in software, so
//!   the receivers verify them) and the whole data path in TC ingress
//!   (`--tc-iface`): every rewritten packet is a socket buffer redirected by the TC program, with
//!   no XDP program on any LB veth and no hand-off.
//!
//! In both, 12 real TCP connections and 12 UDP datagrams to the VIP must reach both backends
//! and come back from the VIP in modes 2, 0, 1, 5 and 3 (full NAT first, before any traffic
//! taught the LB the backends' MACs: the loader's managed neighbour entries must); in the `xdp`
//! topology a removed
//! endpoint must get no new flows while its open connection keeps working; on exit the loader
//! must leave no program attached and no VIP behind. In the `xdp` topology the real daemon
//! (`loxilb --xdp-iface …`) then lists a live flow over `GET /config/conntrack/all` and
//! `loxicmd get ct` (both binaries must be built: `cargo build --release --bins`). Everything stays in namespaces this test
//! creates; every wait is bounded.
#![allow(
    unsafe_code,
    reason = "setns(2) and unshare(2) through libc to enter the test namespaces"
)]

use std::{
    collections::BTreeSet,
    fs,
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};

use crate::bench::{csum_add, csum_fold, sock_timeout};

/// The load balancer's data-path flags in the LB namespace: XDP on its three veths, VIPs on
/// `lo` (shared by the loader-only run and the `loxilb` daemon run).
const LB_IFACE_ARGS: [&str; 8] = [
    "--xdp-iface",
    "l0",
    "--xdp-iface",
    "l1",
    "--xdp-iface",
    "l2",
    "--vip-iface",
    "lo",
];

const VIP: &str = "20.0.0.1";
const PORT: u16 = 80;
/// TCP connections and UDP datagrams per mode.
const EXCHANGES: usize = 12;

/// How the peers of the LB's veths receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peers {
    /// A pass-through XDP program on every peer.
    Xdp,
    /// No XDP program and GRO off on every peer (containers, pods).
    Plain,
    /// Plain peers with TX checksum offload on, and the data path in TC (`--tc-iface`).
    Tc,
}

/// The LB's data-path flags for the `tc` topology: the whole data path in TC ingress on its
/// three veths.
const LB_TC_ARGS: [&str; 8] = [
    "--tc-iface",
    "l0",
    "--tc-iface",
    "l1",
    "--tc-iface",
    "l2",
    "--vip-iface",
    "lo",
];

/// The namespaces, helper processes and files of one run; torn down on drop.
pub struct Topo {
    pub c: String,
    pub l: String,
    pub b: [String; 2],
    pub dir: PathBuf,
    children: Vec<Child>,
    /// Log of the LB's data-path process.
    pub lb_log: Option<PathBuf>,
}

/// Runs `ip …` (or any command) and fails with its stderr.
pub fn cmd(args: &str) -> anyhow::Result<String> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(args)
        .output()
        .with_context(|| args.to_string())?;
    ensure!(
        out.status.success(),
        "`{args}` failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Topo {
    /// Builds the topology: 10.100.0.0/24 client side, 10.100.{1,2}.0/24 backend sides.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        let id = std::process::id();
        let t = Topo {
            c: format!("{tag}c{id}"),
            l: format!("{tag}l{id}"),
            b: [format!("{tag}b1{id}"), format!("{tag}b2{id}")],
            dir: std::env::temp_dir().join(format!("loxi-{tag}-{id}")),
            children: Vec::new(),
            lb_log: None,
        };
        fs::create_dir_all(&t.dir)?;
        for ns in [&t.c, &t.l, &t.b[0], &t.b[1]] {
            cmd(&format!("ip netns add {ns}"))?;
            cmd(&format!("ip -n {ns} link set lo up"))?;
        }
        let (c, l) = (&t.c, &t.l);
        cmd(&format!(
            "ip link add c0 netns {c} type veth peer name l0 netns {l}"
        ))?;
        cmd(&format!(
            "ip -n {c} addr add 10.100.0.2/24 dev c0 && ip -n {c} link set c0 up"
        ))?;
        cmd(&format!(
            "ip -n {l} addr add 10.100.0.1/24 dev l0 && ip -n {l} link set l0 up"
        ))?;
        cmd(&format!("ip -n {c} route add default via 10.100.0.1"))?;
        for (i, b) in t.b.iter().enumerate() {
            backend_link(l, b, i + 1)?;
        }
        cmd(&format!(
            "ip netns exec {l} sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0"
        ))?;
        // Senders compute checksums in software (veth TX offload would leave them partial);
        // the backends' links are set so by `backend_link`.
        cmd(&format!(
            "ip netns exec {c} ethtool -K c0 tx off >/dev/null"
        ))?;
        cmd(&format!(
            "ip netns exec {l} ethtool -K l0 tx off >/dev/null"
        ))?;
        Ok(t)
    }

    /// Starts `xtask <args>` inside `ns` and keeps it until drop.
    pub fn spawn(&mut self, ns: &str, args: &[&str]) -> anyhow::Result<u32> {
        let exe = std::env::current_exe()?;
        self.spawn_exe(ns, &exe, args)
    }

    /// Starts `exe <args>` inside `ns` (stderr to `<dir>/<ns>-<n>.log`) and keeps it until drop.
    pub fn spawn_exe(
        &mut self,
        ns: &str,
        exe: &std::path::Path,
        args: &[&str],
    ) -> anyhow::Result<u32> {
        let log = fs::File::create(self.dir.join(format!("{ns}-{}.log", self.children.len())))?;
        let child = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(exe)
            .args(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        let pid = child.id();
        self.children.push(child);
        Ok(pid)
    }

    /// How many helpers were started so far (the `<n>` of the next one's log is this).
    pub fn children_started(&self) -> usize {
        self.children.len()
    }

    /// Stops the child started with pid `pid` (SIGTERM, bounded wait).
    pub fn stop(&mut self, pid: u32) -> anyhow::Result<()> {
        let Some(pos) = self.children.iter().position(|c| c.id() == pid) else {
            bail!("no child {pid}")
        };
        // `ip netns exec` execs the command, so the pid is the helper itself. The child stays
        // in `children` (reaped on drop) until it has exited.
        cmd(&format!("kill -TERM {pid}"))?;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if self.children[pos].try_wait()?.is_some() {
                drop(self.children.remove(pos));
                return Ok(());
            }
            thread::sleep(Duration::from_millis(50));
        }
        bail!("helper {pid} did not exit within 10 s of SIGTERM")
    }

    /// Pass-through XDP on the peers of the LB's veths.
    pub fn start_peers(&mut self) -> anyhow::Result<()> {
        self.start_peers_with(false)
    }

    /// Like [`Topo::start_peers`], but with `sink` backend 1's veth drops every frame in XDP
    /// instead (benchmarks end the forwarded path there).
    pub fn start_peers_with(&mut self, sink: bool) -> anyhow::Result<()> {
        let peers = [
            (self.c.clone(), "c0"),
            (self.b[0].clone(), "b0"),
            (self.b[1].clone(), "b0"),
        ];
        for (ns, ifs) in peers {
            if sink && ns == self.b[0] {
                self.spawn(&ns, &["xdp-pass", "--drop", "--iface", ifs])?;
            } else {
                self.spawn(&ns, &["xdp-pass", "--iface", ifs])?;
            }
            wait_xdp(&ns, ifs, true)?;
        }
        Ok(())
    }

    /// Plain peers: GRO off and no XDP program on the peers of the LB's veths.
    pub fn plain_peers(&mut self) -> anyhow::Result<()> {
        for (ns, ifs) in [(&self.c, "c0"), (&self.b[0], "b0"), (&self.b[1], "b0")] {
            cmd(&format!(
                "ip netns exec {ns} ethtool -K {ifs} gro off >/dev/null"
            ))?;
            let k = cmd(&format!("ip netns exec {ns} ethtool -k {ifs}"))?;
            ensure!(
                k.contains("generic-receive-offload: off"),
                "GRO still on for {ns}/{ifs}: {k}"
            );
            wait_xdp(ns, ifs, false)?;
        }
        Ok(())
    }

    /// Writes the LB's rules file.
    pub fn write_rules(&self, rules: &[String]) -> anyhow::Result<()> {
        let tmp = self.dir.join("rules.json.tmp");
        fs::write(&tmp, format!("[{}]", rules.join(",")))?;
        fs::rename(tmp, self.dir.join("rules.json"))?;
        Ok(())
    }

    /// Starts the data path in the LB ns on l0, l1, l2 with VIPs on its `lo`.
    pub fn start_lb(&mut self) -> anyhow::Result<u32> {
        self.start_lb_with(&LB_IFACE_ARGS)
    }

    /// Starts `xtask l4-serve` in the LB ns with `iface_args` (XDP or TC on l0, l1, l2) and
    /// waits until its three attachments are made: XDP programs on the links, or three
    /// "attached in TC ingress" lines in its log.
    pub fn start_lb_with(&mut self, iface_args: &[&str]) -> anyhow::Result<u32> {
        let rules = self.dir.join("rules.json").display().to_string();
        let l = self.l.clone();
        let pid = self.spawn(
            &l,
            &[&["l4-serve"][..], iface_args, &["--rules", &rules]].concat(),
        )?;
        let log = self
            .dir
            .join(format!("{l}-{}.log", self.children.len() - 1));
        if iface_args.contains(&"--tc-iface") {
            wait("the TC data path attached to l0 l1 l2", || {
                let text = fs::read_to_string(&log).unwrap_or_default();
                Ok(text
                    .lines()
                    .filter(|x| x.contains("L4 data path attached in TC ingress"))
                    .count()
                    == 3)
            })?;
        } else {
            for i in 0..3 {
                wait_xdp(&l, &format!("l{i}"), true)?;
            }
        }
        self.lb_log = Some(log);
        Ok(pid)
    }

    /// TX checksum offload back on for the client's and the backends' veths (a veth's default,
    /// which [`Topo::new`] switched off): their TCP and UDP leave the sockets with partial
    /// checksums (the field holds the pseudo-header's sum), as a container's do. The LB's veths
    /// keep theirs off, so the kernel completes each checksum in software as the rewritten frame
    /// leaves the LB and the receiver verifies it: a partial checksum whose pseudo-header part
    /// was not moved to the new addresses fails there (a veth receiver would trust it as
    /// partial; a NIC would put it on the wire wrong).
    pub fn partial_checksums(&mut self) -> anyhow::Result<()> {
        let mut ifs = vec![(self.c.clone(), "c0".to_string())];
        for b in &self.b {
            ifs.push((b.clone(), "b0".to_string()));
        }
        for (ns, i) in ifs {
            cmd(&format!(
                "ip netns exec {ns} ethtool -K {i} tx on >/dev/null"
            ))?;
            let k = cmd(&format!("ip netns exec {ns} ethtool -k {i}"))?;
            ensure!(
                k.contains("tx-checksumming: on"),
                "TX checksum offload still off for {ns}/{i}: {k}"
            );
        }
        Ok(())
    }
}

/// The veth pair between LB namespace `l` (`l{n}`, 10.100.{n}.1) and backend namespace `b`
/// (`b0`, 10.100.{n}.2, default route via the LB), both up, checksums computed in software
/// (veth TX offload would leave them partial).
fn backend_link(l: &str, b: &str, n: usize) -> anyhow::Result<()> {
    cmd(&format!(
        "ip link add b0 netns {b} type veth peer name l{n} netns {l}"
    ))?;
    cmd(&format!(
        "ip -n {b} addr add 10.100.{n}.2/24 dev b0 && ip -n {b} link set b0 up"
    ))?;
    cmd(&format!(
        "ip -n {l} addr add 10.100.{n}.1/24 dev l{n} && ip -n {l} link set l{n} up"
    ))?;
    cmd(&format!("ip -n {b} route add default via 10.100.{n}.1"))?;
    cmd(&format!(
        "ip netns exec {b} ethtool -K b0 tx off >/dev/null"
    ))?;
    cmd(&format!(
        "ip netns exec {l} ethtool -K l{n} tx off >/dev/null"
    ))?;
    Ok(())
}

impl Drop for Topo {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = cmd(&format!("kill -TERM {}", c.id()));
        }
        let t0 = Instant::now();
        for c in &mut self.children {
            while t0.elapsed() < Duration::from_secs(5) && matches!(c.try_wait(), Ok(None)) {
                thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in [&self.c, &self.l, &self.b[0], &self.b[1]] {
            let _ = cmd(&format!("ip netns del {ns}"));
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Waits (≤ 10 s) until `iface` in `ns` has (or has not) an XDP program.
pub fn wait_xdp(ns: &str, iface: &str, attached: bool) -> anyhow::Result<()> {
    wait(
        &format!(
            "XDP {} on {ns}/{iface}",
            if attached { "attached" } else { "detached" }
        ),
        || Ok(cmd(&format!("ip -n {ns} link show dev {iface}"))?.contains("prog/xdp") == attached),
    )
}

/// Polls `f` every 50 ms for up to 10 s.
pub fn wait(what: &str, mut f: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        if f()? {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(50));
    }
    bail!("timed out waiting for {what}")
}

/// Runs `f` on a thread that has joined network namespace `ns`; sockets it creates stay there.
pub fn in_ns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    let path = format!("/run/netns/{ns}");
    thread::spawn(move || {
        let file = fs::File::open(&path).with_context(|| path.clone())?;
        // SAFETY: setns on this thread only, with a valid namespace fd.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        ensure!(rc == 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .map_err(|_| anyhow::anyhow!("namespace thread panicked"))?
}

fn rule(proto: &str, mode: u8, backends: &[usize]) -> String {
    let port = if mode == 3 { PORT } else { 8080 };
    let eps: Vec<String> = backends
        .iter()
        .map(|b| format!(r#"{{"endpointIP":"10.100.{b}.2","targetPort":{port},"weight":1}}"#))
        .collect();
    format!(
        r#"{{"serviceArguments":{{"externalIP":"{VIP}","port":{PORT},"protocol":"{proto}","mode":{mode},"sel":0}},"endpoints":[{}]}}"#,
        eps.join(",")
    )
}

/// One TCP connection to the VIP: the backend's greeting.
fn tcp_once() -> anyhow::Result<String> {
    let addr: SocketAddr = format!("{VIP}:{PORT}").parse()?;
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    Ok(line.trim().to_string())
}

/// One UDP exchange from a fresh socket connected to the VIP (so only replies from the VIP
/// are accepted).
fn udp_once() -> anyhow::Result<String> {
    let s = UdpSocket::bind("0.0.0.0:0")?;
    s.connect((VIP, PORT))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    s.send(b"ping")?;
    let mut buf = [0u8; 64];
    let n = s.recv(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// `n` exchanges from namespace `ns`: the backend names that answered, and the failures.
fn names(
    ns: &str,
    n: usize,
    f: fn() -> anyhow::Result<String>,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    in_ns(ns, move || {
        let (mut ok, mut failed) = (Vec::new(), Vec::new());
        for _ in 0..n {
            match f() {
                Ok(name) => ok.push(name),
                Err(e) => failed.push(format!("{e:#}")),
            }
        }
        Ok((ok, failed))
    })
}

fn check_mode(t: &mut Topo, peers: Peers, mode: u8) -> anyhow::Result<()> {
    t.write_rules(&[rule("tcp", mode, &[1, 2]), rule("udp", mode, &[1, 2])])?;
    let l = t.l.clone();
    wait("VIP on the LB's lo", || {
        Ok(cmd(&format!("ip -n {l} addr show dev lo"))?.contains(VIP))
    })?;
    thread::sleep(Duration::from_millis(300));
    let (tcp, tcp_failed) = names(&t.c, EXCHANGES, tcp_once)?;
    let (udp, udp_failed) = names(&t.c, EXCHANGES, udp_once)?;
    println!(
        "netns-test: {peers:?} peers, mode {mode}: tcp {}/{EXCHANGES} {tcp:?}, udp {}/{EXCHANGES} {udp:?}",
        tcp.len(),
        udp.len()
    );
    for (what, got, failed) in [("tcp", &tcp, &tcp_failed), ("udp", &udp, &udp_failed)] {
        ensure!(
            failed.is_empty(),
            "{peers:?} peers, mode {mode} {what}: {} of {EXCHANGES} got no reply via the VIP: {failed:?}",
            failed.len()
        );
        let seen: BTreeSet<&str> = got.iter().map(String::as_str).collect();
        ensure!(
            seen == BTreeSet::from(["b1", "b2"]),
            "{peers:?} peers, mode {mode} {what}: replies {got:?}, want both backends"
        );
    }
    Ok(())
}

fn check_endpoint_removal(t: &mut Topo) -> anyhow::Result<()> {
    t.write_rules(&[rule("tcp", 0, &[1, 2])])?;
    thread::sleep(Duration::from_millis(300));
    // Open connections until one lands on b1, keep it.
    let (mut keep, mut reader) = in_ns(&t.c, || {
        for _ in 0..10 {
            let addr: SocketAddr = format!("{VIP}:{PORT}").parse()?;
            let s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
            s.set_read_timeout(Some(Duration::from_secs(3)))?;
            let mut r = BufReader::new(s.try_clone()?);
            let mut line = String::new();
            r.read_line(&mut line)?;
            if line.trim() == "b1" {
                return Ok((s, r));
            }
        }
        bail!("no connection reached b1 in 10 tries")
    })?;
    t.write_rules(&[rule("tcp", 0, &[2])])?;
    thread::sleep(Duration::from_millis(500));
    let (after, failed) = names(&t.c, 6, tcp_once)?;
    ensure!(failed.is_empty(), "after removing b1: {failed:?}");
    ensure!(
        after.iter().all(|n| n == "b2"),
        "new flows after removing b1: {after:?}"
    );
    for i in 0..3 {
        writeln!(keep, "still there {i}")?;
        let mut line = String::new();
        reader.read_line(&mut line)?;
        ensure!(
            line.trim() == "b1",
            "established flow to removed b1 answered {line:?}"
        );
    }
    println!("netns-test: removed endpoint: new flows {after:?}, open flow still on b1");
    Ok(())
}

/// An `--xdp-iface` (`--tc-iface` in the `tc` topology) deleted and created again at run time
/// (here the LB's veth to backend 2, with its peer, as re-plumbing a container does) gets
/// loxi's program again within a few stats ticks, is logged, and forwards: new flows through it
/// reach backend 2. (Before, the program was attached only at start: the new device forwarded
/// nothing until a restart.)
fn check_recreated_iface(t: &mut Topo, peers: Peers) -> anyhow::Result<()> {
    let (l, b) = (t.l.clone(), t.b[1].clone());
    cmd(&format!("ip -n {l} link del l2"))?;
    backend_link(&l, &b, 2)?;
    let log_path = t.lb_log.clone().context("LB log")?;
    let reattached = || -> anyhow::Result<bool> {
        Ok(fs::read_to_string(&log_path)?
            .lines()
            .any(|x| x.contains("attached again") && x.contains("l2")))
    };
    if peers == Peers::Tc {
        // As the topology has it: a plain peer sending partial checksums.
        cmd(&format!(
            "ip netns exec {b} ethtool -K b0 gro off tx on >/dev/null"
        ))?;
        wait("the TC data path attached again to the new l2", reattached)?;
    } else {
        // The peer's pass-through program, as the topology has it (its old device is gone).
        t.spawn(&b, &["xdp-pass", "--iface", "b0"])?;
        wait_xdp(&b, "b0", true)?;
        wait_xdp(&l, "l2", true)?;
    }
    t.write_rules(&[rule("tcp", 0, &[2])])?;
    // Two stats ticks (1 s each): the egress set then holds the new l2, whose peer has its
    // program again, so these flows take the XDP redirect as the exit check requires (before
    // that they would take the TC hand-off: delivered too, only slower).
    thread::sleep(Duration::from_millis(2500));
    let (got, failed) = names(&t.c, 4, tcp_once)?;
    ensure!(
        failed.is_empty() && got.iter().all(|n| n == "b2"),
        "through the recreated l2: replies {got:?}, failures {failed:?}"
    );
    ensure!(
        reattached()?,
        "re-attach not logged:\n{}",
        fs::read_to_string(&log_path)?
    );
    println!(
        "netns-test: {peers:?} peers: recreated l2: program attached again, new flows {got:?}"
    );
    Ok(())
}

/// A sibling binary of this xtask (`target/release/<name>`), which must have been built.
fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.parent().context("xtask path")?.join(name);
    ensure!(
        p.exists(),
        "{} missing: run `cargo build --release --bins` first",
        p.display()
    );
    Ok(p)
}

/// One HTTP/1.1 request to `127.0.0.1:11111` from inside the current namespace: (status, body).
fn http(method: &str, path: &str, body: &str) -> anyhow::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&"127.0.0.1:11111".parse()?, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    std::io::Read::read_to_string(&mut s, &mut raw)?;
    let (head, rest) = raw.split_once("\r\n\r\n").context("no header end")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .context("no status")?
        .parse()?;
    // The API answers small bodies with Content-Length; a chunked one is de-chunked here.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut r = rest;
        while let Some((len, tail)) = r.split_once("\r\n") {
            let n = usize::from_str_radix(len.trim(), 16)?;
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            r = &tail[n + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    Ok((status, body))
}

/// The real daemon with the XDP data path: after traffic through an L4 VIP (mode 0, one TCP
/// connection kept open), `GET /config/conntrack/all` lists both directions of that flow with
/// its addresses, ports, protocol, NAT action, rule name and nonzero packets/bytes, and
/// `loxicmd get ct` prints the flow in LoxiLB's table.
fn check_conntrack_api(t: &mut Topo) -> anyhow::Result<()> {
    let (loxilb, loxicmd) = (sibling("loxilb")?, sibling("loxicmd")?);
    let l = t.l.clone();
    let state = t.dir.join("state");
    fs::create_dir_all(&state)?;
    let state = state.display().to_string();
    let daemon = t.spawn_exe(
        &l,
        &loxilb,
        &[&LB_IFACE_ARGS[..], &["--state-dir", &state]].concat(),
    )?;
    for i in 0..3 {
        wait_xdp(&l, &format!("l{i}"), true)?;
    }
    let rule = format!(
        r#"{{"serviceArguments":{{"externalIP":"{VIP}","port":{PORT},"protocol":"tcp","mode":0,"sel":0,"name":"ctsvc"}},"endpoints":[{{"endpointIP":"10.100.1.2","targetPort":8080,"weight":1}}]}}"#
    );
    wait("REST API up in the LB namespace", || {
        in_ns(&l, || Ok(http("GET", "/netlox/v1/version", "").is_ok()))
    })?;
    let (st, body) = in_ns(&l, move || {
        http("POST", "/netlox/v1/config/loadbalancer", &rule)
    })?;
    ensure!(st == 200, "creating the L4 rule: {st} {body}");
    wait("VIP on the LB's lo", || {
        Ok(cmd(&format!("ip -n {l} addr show dev lo"))?.contains(VIP))
    })?;
    thread::sleep(Duration::from_millis(300));
    // One connection, kept open while the table is read: greeting + two request/answer rounds.
    let (keep, lport) = in_ns(&t.c, || {
        let addr: SocketAddr = format!("{VIP}:{PORT}").parse()?;
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        let mut r = BufReader::new(s.try_clone()?);
        let mut line = String::new();
        r.read_line(&mut line)?;
        ensure!(line.trim() == "b1", "greeting {line:?}");
        for i in 0..2 {
            writeln!(s, "ct {i}")?;
            line.clear();
            r.read_line(&mut line)?;
        }
        let lport = s.local_addr()?.port();
        Ok((s, lport))
    })?;
    let (st, body) = in_ns(&l, || http("GET", "/netlox/v1/config/conntrack/all", ""))?;
    ensure!(st == 200, "GET conntrack: {st} {body}");
    let v: serde_json::Value = serde_json::from_str(&body).context("conntrack body")?;
    let ct = v["ctAttr"].as_array().context("ctAttr")?;
    let fwd = ct
        .iter()
        .find(|e| e["sourceIP"] == "10.100.0.2" && e["sourcePort"] == lport)
        .with_context(|| format!("client flow :{lport} not listed: {body}"))?;
    let want = serde_json::json!({
        "destinationIP": VIP, "sourceIP": "10.100.0.2", "destinationPort": PORT,
        "sourcePort": lport, "protocol": "tcp", "ident": fwd["ident"].clone(),
        "conntrackState": "est", "conntrackAct": "dnat-10.100.1.2:8080",
        "packets": fwd["packets"].clone(), "bytes": fwd["bytes"].clone(), "servName": "ctsvc",
    });
    ensure!(*fwd == want, "forward entry {fwd}, want {want}");
    let (pk, by) = (
        fwd["packets"].as_u64().unwrap_or(0),
        fwd["bytes"].as_u64().unwrap_or(0),
    );
    // SYN, ACK, two data segments and their ACKs: at least 4 client packets of ≥ 54 bytes.
    ensure!(
        pk >= 4 && by >= pk * 54,
        "forward entry counters: {pk} packets, {by} bytes"
    );
    let rev = ct
        .iter()
        .find(|e| e["destinationIP"] == "10.100.0.2" && e["destinationPort"] == lport)
        .with_context(|| format!("reply direction of :{lport} not listed: {body}"))?;
    ensure!(
        rev["sourceIP"] == "10.100.1.2"
            && rev["sourcePort"] == 8080
            && rev["conntrackAct"] == format!("snat-{VIP}:{PORT}").as_str()
            && rev["servName"] == "ctsvc"
            && rev["packets"].as_u64().unwrap_or(0) >= 3,
        "reply entry {rev}"
    );
    let table = cmd(&format!("ip netns exec {l} {} get ct", loxicmd.display()))?;
    let lp = lport.to_string();
    let cells: Vec<&str> = table
        .lines()
        .map(|r| r.split('|').map(str::trim).collect::<Vec<&str>>())
        .find(|c| c.len() == 13 && c[3] == "10.100.0.2" && c[5] == lp)
        .with_context(|| format!("loxicmd get ct has no row from 10.100.0.2:{lport}:\n{table}"))?;
    let row = cells.join("|");
    ensure!(
        cells.len() == 13
            && cells[1..10]
                == [
                    "ctsvc",
                    VIP,
                    "10.100.0.2",
                    "80",
                    lp.as_str(),
                    "tcp",
                    fwd["ident"].as_str().unwrap_or(""),
                    "est",
                    "dnat-10.100.1.2:8080",
                ]
            && cells[10] == pk.to_string()
            && cells[11] == by.to_string(),
        "loxicmd get ct row {row:?}"
    );
    println!(
        "netns-test: conntrack API: flow 10.100.0.2:{lport} -> {VIP}:{PORT} listed ({pk} packets, {by} bytes forward; reply {}), loxicmd get ct prints it:\n{table}",
        rev["packets"]
    );
    drop(keep);
    t.stop(daemon)?;
    for i in 0..3 {
        wait_xdp(&l, &format!("l{i}"), false)?;
    }
    Ok(())
}

/// Entry point of `cargo xtask netns-test`.
pub fn run() -> anyhow::Result<()> {
    // SAFETY: getuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let ci = std::env::var_os("CI").is_some();
    let netns_ok = root && cmd("ip netns list").is_ok();
    if !netns_ok {
        if ci {
            bail!("netns-test needs root and network namespaces (CI is set, so this is a failure)");
        }
        eprintln!(
            "netns-test: SKIPPED (needs root and `ip netns`); set CI=1 to make this an error"
        );
        return Ok(());
    }
    run_topology(Peers::Xdp)?;
    run_topology(Peers::Plain)?;
    run_topology(Peers::Tc)?;
    println!("netns-test: PASS");
    Ok(())
}

/// Builds one topology, checks every mode through it, then the loader's clean exit and which
/// forwarding path its counters say it used.
fn run_topology(peers: Peers) -> anyhow::Result<()> {
    let mut t = Topo::new(match peers {
        Peers::Xdp => "lxt",
        Peers::Plain => "lxp",
        Peers::Tc => "lxc",
    })?;
    match peers {
        Peers::Xdp => t.start_peers()?,
        Peers::Plain => t.plain_peers()?,
        Peers::Tc => {
            t.plain_peers()?;
            t.partial_checksums()?;
        }
    }
    let (b1, b2) = (t.b[0].clone(), t.b[1].clone());
    let dsr_udp = format!("{VIP}:{PORT}");
    for (b, name) in [(&b1, "b1"), (&b2, "b2")] {
        // DSR backends own the VIP on loopback and answer UDP from it.
        cmd(&format!("ip -n {b} addr add {VIP}/32 dev lo"))?;
        t.spawn(
            b,
            &[
                "backend",
                "--name",
                name,
                "--port",
                "8080",
                "--tcp-port",
                "80",
                "--udp-bind",
                &dsr_udp,
            ],
        )?;
    }
    t.write_rules(&[])?;
    let lb = if peers == Peers::Tc {
        t.start_lb_with(&LB_TC_ARGS)?
    } else {
        t.start_lb()?
    };
    let log_path = t.lb_log.clone().context("LB log")?;
    let log = fs::read_to_string(&log_path)?;
    let l = t.l.clone();
    if peers == Peers::Tc {
        for i in 0..3 {
            ensure!(
                !cmd(&format!("ip -n {l} link show dev l{i}"))?.contains("prog/xdp"),
                "tc topology: an XDP program on l{i}"
            );
        }
        println!("netns-test: {peers:?} peers: data path attached to l0 l1 l2 in TC ingress");
    } else {
        let attached = log
            .lines()
            .filter(|l| l.contains("XDP data path attached"))
            .count();
        ensure!(
            attached == 3 && log.contains("native"),
            "attach mode not logged for l0 l1 l2:\n{log}"
        );
        println!("netns-test: {peers:?} peers: data path attached to l0 l1 l2 in native mode");
    }
    // Full NAT first, before any traffic crossed the LB: the kernel cannot forward its frames
    // (their source is the LB's own address), so nothing would teach the LB the backends'
    // MACs but the managed neighbour entries the loader adds for its endpoints (`l4/neigh.rs`).
    t.write_rules(&[rule("tcp", 2, &[1, 2]), rule("udp", 2, &[1, 2])])?;
    wait(
        "managed, resolved neighbour entries for both backends",
        || {
            let n = cmd(&format!("ip -n {l} neigh show"))?;
            Ok((1..=2).all(|i| {
                n.lines().any(|x| {
                    x.starts_with(&format!("10.100.{i}.2 "))
                        && x.contains("managed")
                        && x.contains("lladdr")
                })
            }))
        },
    )?;
    println!("netns-test: {peers:?} peers: managed neighbour entries for both backends");
    for mode in [2u8, 0, 1, 5, 3] {
        check_mode(&mut t, peers, mode)?;
    }
    if peers == Peers::Xdp {
        check_endpoint_removal(&mut t)?;
    }
    if peers == Peers::Tc {
        check_partial_checksums(&mut t)?;
    }
    if peers != Peers::Plain {
        check_recreated_iface(&mut t, peers)?;
    }
    t.stop(lb)?;
    for i in 0..3 {
        wait_xdp(&l, &format!("l{i}"), false)?;
    }
    // Read before the daemon below starts: its log may reuse the file name.
    let lb_log = fs::read_to_string(&log_path)?;
    if peers == Peers::Tc {
        let detached = lb_log
            .lines()
            .filter(|x| x.contains("TC data path detached"))
            .count();
        ensure!(
            detached == 3,
            "TC data path detached from {detached} of 3 veths on exit:\n{lb_log}"
        );
    }
    ensure!(
        !cmd(&format!("ip -n {l} addr show dev lo"))?.contains(VIP),
        "VIP left on lo after exit"
    );
    println!(
        "netns-test: {peers:?} peers: loader detached from l0 l1 l2 and removed the VIP on exit"
    );
    check_paths(peers, &lb_log)?;
    if peers == Peers::Xdp {
        check_conntrack_api(&mut t)?;
    }
    Ok(())
}

/// What an IPv4 TCP/UDP packet's checksum field holds: `Some(true)` a complete, valid
/// checksum; `Some(false)` a valid partial one (the field holds the folded sum of the
/// pseudo-header of the packet's own addresses, which the device or the kernel completes over
/// the segment); `None` neither (wrong).
fn l4_checksum_state(ip: &[u8]) -> Option<bool> {
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]])).min(ip.len());
    let (proto, l4) = (ip[9], &ip[ihl..total]);
    let at = if proto == 6 { 16 } else { 6 };
    let mut pseudo = csum_add(0, &ip[12..20]);
    pseudo += u32::from(proto) + l4.len() as u32;
    if csum_fold(csum_add(pseudo, l4)) == 0 {
        return Some(true);
    }
    (u16::from_be_bytes([l4[at], l4[at + 1]]) == !csum_fold(pseudo)).then_some(false)
}

/// IPv4 TCP/UDP packets namespace `ns` sees for `secs` seconds (an `AF_PACKET` socket, any
/// interface, both directions) whose (address, port) is `src` or `dst` as given.
fn capture(
    ns: &str,
    src: Option<(std::net::Ipv4Addr, u16)>,
    dst: Option<(std::net::Ipv4Addr, u16)>,
    secs: u64,
) -> thread::JoinHandle<anyhow::Result<Vec<Vec<u8>>>> {
    let ns = ns.to_string();
    thread::spawn(move || {
        in_ns(&ns, move || {
            // SAFETY: plain socket(2); the fd is closed below.
            let fd = unsafe {
                libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_DGRAM,
                    i32::from((libc::ETH_P_IP as u16).to_be()),
                )
            };
            ensure!(
                fd >= 0,
                "AF_PACKET socket: {}",
                std::io::Error::last_os_error()
            );
            sock_timeout(fd, libc::SO_RCVTIMEO, Duration::from_millis(100));
            let mut out = Vec::new();
            let mut buf = vec![0u8; 65536];
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(secs) {
                // SAFETY: recv into a buffer of the given length.
                let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n < 28 {
                    continue;
                }
                let p = &buf[..n as usize];
                let ihl = usize::from(p[0] & 0x0f) * 4;
                if p[0] >> 4 != 4 || !(p[9] == 6 || p[9] == 17) || p.len() < ihl + 20 {
                    continue;
                }
                let a = |o: usize| std::net::Ipv4Addr::new(p[o], p[o + 1], p[o + 2], p[o + 3]);
                let port = |o: usize| u16::from_be_bytes([p[ihl + o], p[ihl + o + 1]]);
                let ok_src = src.is_none_or(|s| s == (a(12), port(0)));
                let ok_dst = dst.is_none_or(|d| d == (a(16), port(2)));
                if ok_src && ok_dst {
                    out.push(p.to_vec());
                }
            }
            // SAFETY: the fd opened above.
            unsafe { libc::close(fd) };
            Ok(out)
        })
    })
}

/// Partial checksums through the TC data path. The client's and the backends' veths leave
/// TCP and UDP checksums partial, and the LB's redirects go into the peers
/// (`bpf_redirect_peer`), so no device completes them and the receiving sockets trust them
/// unverified: the check is on the packets as they arrive. In mode 0 (DNAT), every packet the
/// backend gets to its address and port, and every reply the client gets from the VIP, must
/// carry a complete valid checksum or a partial one seeded with the pseudo-header of its
/// rewritten addresses (a seed left at the VIP's pseudo-header would become a wrong checksum on
/// a real NIC); at least one of each direction must be partial, so the case is exercised.
fn check_partial_checksums(t: &mut Topo) -> anyhow::Result<()> {
    t.write_rules(&[rule("tcp", 0, &[1]), rule("udp", 0, &[1])])?;
    thread::sleep(Duration::from_millis(300));
    let ep: std::net::Ipv4Addr = "10.100.1.2".parse()?;
    let vip: std::net::Ipv4Addr = VIP.parse()?;
    let to_ep = capture(&t.b[0], None, Some((ep, 8080)), 3);
    let from_vip = capture(&t.c, Some((vip, PORT)), None, 3);
    thread::sleep(Duration::from_millis(300));
    let (tcp, tcp_failed) = names(&t.c, 4, tcp_once)?;
    let (udp, udp_failed) = names(&t.c, 4, udp_once)?;
    ensure!(
        tcp_failed.is_empty() && udp_failed.is_empty() && tcp.len() == 4 && udp.len() == 4,
        "partial-checksum round: tcp {tcp:?} {tcp_failed:?}, udp {udp:?} {udp_failed:?}"
    );
    for (what, h) in [("to the endpoint", to_ep), ("from the VIP", from_vip)] {
        let pkts = h
            .join()
            .map_err(|_| anyhow::anyhow!("capture thread panicked"))??;
        let states: Vec<Option<bool>> = pkts.iter().map(|p| l4_checksum_state(p)).collect();
        let bad = states.iter().filter(|s| s.is_none()).count();
        let partial = states.iter().filter(|s| **s == Some(false)).count();
        println!(
            "netns-test: Tc peers: {} packets {what}: {partial} with a partial checksum, {} complete, {bad} wrong",
            pkts.len(),
            pkts.len() - partial - bad
        );
        ensure!(
            bad == 0 && partial > 0 && pkts.len() >= 8,
            "{what}: {bad} of {} packets with a wrong checksum (partial {partial})",
            pkts.len()
        );
    }
    Ok(())
}

/// The loader's exit metrics must show the forwarding path the peers call for.
fn check_paths(peers: Peers, log: &str) -> anyhow::Result<()> {
    let event = |name: &str| -> u64 {
        let prefix = format!("loxilb_l4_events_total{{event=\"{name}\"}} ");
        log.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let (redirect, tx, egress_tc, tc_redirect) = (
        event("redirect"),
        event("tx"),
        event("egress_tc"),
        event("tc_redirect"),
    );
    let (deferred, added) = (event("ct_reply_deferred"), event("ct_reply_added"));
    println!(
        "netns-test: {peers:?} peers: XDP redirect {redirect}, XDP_TX {tx}, handed to TC {egress_tc}, TC redirect {tc_redirect}; DNAT flows with a deferred reply entry {deferred}, reply entries added at the first reply {added}"
    );
    // Mode 0's exchanges (tcp and udp) all answered through the VIP: each deferred its reply
    // entry and had it inserted by its first reply.
    let answered = 2 * EXCHANGES as u64;
    ensure!(
        deferred >= answered && added >= answered && added <= deferred,
        "{peers:?} peers: want ≥ {answered} DNAT flows with a deferred reply entry, each added at its reply (deferred {deferred}, added {added})"
    );
    match peers {
        Peers::Xdp => ensure!(
            redirect > 0 && egress_tc == 0,
            "XDP peers: want XDP redirects only (redirect {redirect}, egress_tc {egress_tc})"
        ),
        // Every LB veth's peer is in another namespace: once the loader's first stats tick
        // listed them, the hand-off's redirects go into the peers with `bpf_redirect_peer`.
        Peers::Plain => {
            let peer = event("redirect_peer");
            println!("netns-test: Plain peers: of the TC redirects, {peer} with bpf_redirect_peer");
            ensure!(
                redirect + tx == 0
                    && egress_tc > 0
                    && tc_redirect == egress_tc
                    && peer > 0
                    && peer <= tc_redirect,
                "plain peers: want the TC hand-off only, into the peers (redirect {redirect}, tx {tx}, egress_tc {egress_tc}, tc_redirect {tc_redirect}, redirect_peer {peer})"
            )
        }
        // The TC data path redirects socket buffers itself (counted as `redirect`), no hand-off;
        // every LB veth's peer is in another namespace, so once the loader's first stats tick
        // listed them the redirects go into the peers with `bpf_redirect_peer`.
        Peers::Tc => {
            let peer = event("redirect_peer");
            println!("netns-test: Tc peers: of the redirects, {peer} with bpf_redirect_peer");
            ensure!(
                redirect > 0
                    && egress_tc == 0
                    && tc_redirect == 0
                    && peer > 0
                    && peer <= redirect + tx,
                "tc: want the TC data path's own redirects only, into the peers (redirect {redirect}, tx {tx}, redirect_peer {peer}, egress_tc {egress_tc}, tc_redirect {tc_redirect})"
            )
        }
    }
    Ok(())
}
