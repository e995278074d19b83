//! `xtask bench-l4` (run by `scripts/bench-l4.sh`): per-packet forwarding cost of the LB in the
//! netns topology (client ns — LB ns — backend ns over veth) for XDP native DNAT, XDP generic
//! DNAT and kernel nftables DNAT, over a sender-only baseline, for two traffic shapes:
//! - `established`: one long flow (every packet the same 5-tuple: the conntrack fast path);
//! - `new flows`: every packet a 5-tuple never sent before (endpoint selection and conntrack
//!   creation per packet). Both tables below capacity: every XDP run starts a fresh LB (empty
//!   conntrack map, 32 K flows) and sends fewer flows than it holds; nftables' table
//!   (`nf_conntrack_max`, 262 K flows here) holds every run's flows. One more row measures XDP
//!   native with its map full, where every insert also evicts (LRU).
//!
//! The sender is a raw-socket UDP flood from the client namespace pinned to one CPU (veth
//! receive work runs in the sender's softirq on that CPU, so its CPU time covers the whole
//! path); the backend's veth drops every frame in XDP (`loxi_drop`), so the path ends at the
//! backend's driver. The baseline is the same flood dropped by `loxi_drop` on the LB's ingress:
//! the forwarding cost of a case is its CPU time per packet minus the baseline's, and the
//! program's own run time per packet (BPF run-time statistics, in a separate run) is printed
//! for the XDP cases.
use std::{
    net::{Ipv4Addr, SocketAddrV4},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, ensure};

use crate::netns::{Topo, cmd, wait, wait_xdp};

/// Flags of `bench-l4`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Packets per measured run of the established-flow shape.
    #[arg(long, default_value_t = 200_000)]
    packets: u64,
    /// Packets (= new flows) per measured run of the new-flow shape, at most
    /// `CT_ENTRIES / 2 − 2,000` (the XDP map's flows less the warm-up; nftables keeps every
    /// flow in its conntrack table, whose limit is shared by the runs: keep runs × this well
    /// under `net.netfilter.nf_conntrack_max`).
    #[arg(long, default_value_t = 25_000)]
    new_packets: u64,
    /// Runs per case (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// Flags of `udp-flood`.
#[derive(clap::Args)]
pub struct FloodArgs {
    /// Destination `ip:port` (IPv4).
    #[arg(long)]
    dst: SocketAddrV4,
    /// Datagrams to send.
    #[arg(long)]
    count: u64,
    /// Source `ip:port` of the established-flow shape (every datagram the same 5-tuple).
    #[arg(long, default_value = "10.100.0.2:40000")]
    src: SocketAddrV4,
    /// Every datagram from a new source: tuple `i` (from `--first`) has source port
    /// `1024 + i % 64000` and source address `10.100.0.(16 + i / 64000)`.
    #[arg(long)]
    new_flows: bool,
    /// First tuple index of `--new-flows` (callers advance it so no tuple repeats).
    #[arg(long, default_value_t = 0)]
    first: u64,
}

/// CPU time (user + system) of this process, ns. The kernel charges softirq work that runs in
/// the sender's context (the veth receive path, XDP, forwarding) to its system time.
#[allow(unsafe_code, reason = "getrusage(2) through libc")]
fn cpu_ns() -> u128 {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as u128 * 1_000_000_000 + t.tv_usec as u128 * 1000;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// One's-complement sum of big-endian 16-bit words.
fn csum_add(mut acc: u32, b: &[u8]) -> u32 {
    for w in b.chunks(2) {
        acc += u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]));
    }
    acc
}

fn csum_fold(mut acc: u32) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// Length of the flood's datagrams: IPv4 header, UDP header, 18 bytes of payload.
const DGRAM_LEN: usize = 20 + 8 + 18;

/// Writes an IPv4/UDP datagram from `src` to `dst` with valid checksums into `p`.
fn datagram(p: &mut [u8; DGRAM_LEN], src: SocketAddrV4, dst: SocketAddrV4) {
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(DGRAM_LEN as u16).to_be_bytes());
    p[8] = 64;
    p[9] = 17;
    p[10..12].fill(0);
    p[12..16].copy_from_slice(&src.ip().octets());
    p[16..20].copy_from_slice(&dst.ip().octets());
    let ip = csum_fold(csum_add(0, &p[..20]));
    p[10..12].copy_from_slice(&ip.to_be_bytes());
    p[20..22].copy_from_slice(&src.port().to_be_bytes());
    p[22..24].copy_from_slice(&dst.port().to_be_bytes());
    p[24..26].copy_from_slice(&((DGRAM_LEN - 20) as u16).to_be_bytes());
    p[26..28].fill(0);
    let mut acc = csum_add(0, &p[12..20]);
    acc += 17 + (DGRAM_LEN - 20) as u32;
    let mut udp = csum_fold(csum_add(acc, &p[20..]));
    if udp == 0 {
        udp = 0xffff;
    }
    p[26..28].copy_from_slice(&udp.to_be_bytes());
}

/// Source of tuple `i` of the new-flow shape.
fn new_src(i: u64) -> SocketAddrV4 {
    let port = 1024 + (i % 64_000) as u16;
    let host = 16 + i / 64_000;
    SocketAddrV4::new(Ipv4Addr::new(10, 100, 0, host.min(254) as u8), port)
}

/// Sends `count` datagrams through a raw IPv4 socket (the sender's cost does not depend on the
/// tuple); prints `wall_ns_per_packet cpu_ns_per_packet`.
#[allow(unsafe_code, reason = "a raw socket through libc")]
pub fn flood(a: FloodArgs) -> anyhow::Result<()> {
    if a.new_flows {
        ensure!(
            (a.first + a.count) / 64_000 <= 254 - 16,
            "--first + --count exceeds the new-flow tuple space"
        );
    }
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    ensure!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(a.dst.ip().octets()),
        },
        sin_zero: [0; 8],
    };
    // A send blocked for 2 s (socket buffer never drained) fails the flood instead of hanging.
    let tv = libc::timeval {
        tv_sec: 2,
        tv_usec: 0,
    };
    // SAFETY: valid fd and option value of the declared size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    let mut p = [0u8; DGRAM_LEN];
    datagram(&mut p, a.src, a.dst);
    let t0 = Instant::now();
    let c0 = cpu_ns();
    for i in 0..a.count {
        if a.new_flows {
            datagram(&mut p, new_src(a.first + i), a.dst);
        }
        // SAFETY: valid buffer and address of the declared sizes.
        let rc = unsafe {
            libc::sendto(
                fd,
                p.as_ptr().cast(),
                p.len(),
                0,
                (&sa as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        // ENOBUFS is part of a flood; a timeout is not.
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            ensure!(
                e.raw_os_error() == Some(libc::ENOBUFS),
                "send {i} of {}: {e}",
                a.count
            );
        }
    }
    let n = a.count.max(1) as f64;
    let wall = t0.elapsed().as_nanos() as f64 / n;
    let cpu = (cpu_ns() - c0) as f64 / n;
    // SAFETY: our own fd.
    unsafe { libc::close(fd) };
    println!("{wall:.1} {cpu:.1}");
    Ok(())
}

fn rx_packets(ns: &str, iface: &str) -> anyhow::Result<u64> {
    let s = cmd(&format!("ip netns exec {ns} cat /proc/net/dev"))?;
    let line = s
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{iface}:")))
        .with_context(|| format!("{iface} not in /proc/net/dev of {ns}"))?;
    let fields: Vec<&str> = line
        .split(':')
        .nth(1)
        .context("dev line")?
        .split_whitespace()
        .collect();
    Ok(fields.get(1).context("rx packets field")?.parse()?)
}

/// The LB kernel's `Ip: ForwDatagrams` (packets the kernel stack forwarded, i.e. not XDP).
fn kernel_forwarded(ns: &str) -> anyhow::Result<u64> {
    let s = cmd(&format!("ip netns exec {ns} cat /proc/net/snmp"))?;
    let mut ip = s.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (
        ip.next().context("Ip header")?,
        ip.next().context("Ip values")?,
    );
    let i = names
        .split_whitespace()
        .position(|f| f == "ForwDatagrams")
        .context("ForwDatagrams")?;
    Ok(values.split_whitespace().nth(i).context("value")?.parse()?)
}

/// Traffic shape of a measurement.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    Established,
    NewFlows,
}

const SHAPES: [Shape; 2] = [Shape::Established, Shape::NewFlows];

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Established => "established flow",
            Shape::NewFlows => "new flows",
        }
    }
}

/// One case's figures: median CPU ns and wall ns per packet, share of packets the LB kernel
/// forwarded, and (XDP cases) the program's own run time per packet.
#[derive(Clone, Copy)]
struct Figures {
    cpu: f64,
    wall: f64,
    kernel_share: f64,
    prog_ns: Option<f64>,
}

/// State of a benchmark run: the topology, the next unused new-flow tuple and the running LB
/// (pid, generic), which new-flow runs restart for an empty conntrack map when `fresh_ct`.
struct Bench {
    t: Topo,
    next_tuple: u64,
    packets: u64,
    new_packets: u64,
    runs: usize,
    lb: Option<(u32, bool)>,
    fresh_ct: bool,
}

/// Warm-up packets before a measured run (neighbours, the LB's next-hop cache).
const WARMUP: u64 = 2000;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// XDP program id attached to `iface` in `ns` (`ip link` shows `prog/xdp id N`).
fn xdp_prog_id(ns: &str, iface: &str) -> anyhow::Result<u32> {
    let s = cmd(&format!("ip -n {ns} link show dev {iface}"))?;
    let rest = s
        .split("prog/xdp id ")
        .nth(1)
        .with_context(|| format!("no XDP program on {ns}/{iface}: {s}"))?;
    Ok(rest.split_whitespace().next().context("prog id")?.parse()?)
}

/// (run time ns, run count) of program `id`.
fn prog_stats(id: u32) -> anyhow::Result<(u128, u64)> {
    for p in aya::programs::loaded_programs() {
        let p = p?;
        if p.id() == id {
            return Ok((p.run_time().as_nanos(), p.run_count()));
        }
    }
    anyhow::bail!("program {id} not loaded")
}

impl Bench {
    /// One flood of `count` packets of `shape` from the client namespace: (wall, cpu) ns per
    /// packet.
    fn flood(&mut self, shape: Shape, count: u64) -> anyhow::Result<(f64, f64)> {
        let exe = std::env::current_exe()?.display().to_string();
        let extra = match shape {
            Shape::Established => String::new(),
            Shape::NewFlows => {
                let s = format!(" --new-flows --first {}", self.next_tuple);
                self.next_tuple += count;
                s
            }
        };
        let out = cmd(&format!(
            "ip netns exec {} taskset -c 0 {exe} udp-flood --dst 20.0.0.1:80 --count {count}{extra}",
            self.t.c
        ))?;
        let mut it = out.split_whitespace().map(str::parse::<f64>);
        Ok((it.next().context("wall")??, it.next().context("cpu")??))
    }

    /// Median per-packet cost of `shape` over the runs; with `xdp_iface`, one more run with BPF
    /// run-time statistics on gives the program's own time per packet.
    fn measure(
        &mut self,
        shape: Shape,
        expect_forwarded: bool,
        xdp_iface: Option<&str>,
    ) -> anyhow::Result<Figures> {
        let n = match shape {
            Shape::Established => self.packets,
            Shape::NewFlows => self.new_packets,
        };
        let fresh = shape == Shape::NewFlows && self.fresh_ct && self.lb.is_some();
        if !fresh {
            self.flood(shape, WARMUP)?; // warm-up: neighbours, conntrack
            thread::sleep(Duration::from_millis(300));
        }
        let (l, b) = (self.t.l.clone(), self.t.b[0].clone());
        let kf0 = kernel_forwarded(&l)?;
        let (mut cpu, mut wall) = (Vec::new(), Vec::new());
        for _ in 0..self.runs {
            if fresh {
                self.fresh_lb()?;
            }
            let before = rx_packets(&b, "b0")?;
            let (w, c) = self.flood(shape, n)?;
            wall.push(w);
            cpu.push(c);
            thread::sleep(Duration::from_millis(200));
            let got = rx_packets(&b, "b0")? - before;
            if expect_forwarded {
                ensure!(
                    got >= n * 9 / 10,
                    "{}: only {got} of {n} packets reached the backend",
                    shape.name()
                );
            } else {
                ensure!(
                    got < n / 100,
                    "{}: {got} packets reached the backend in the drop baseline",
                    shape.name()
                );
            }
        }
        let kernel_share = (kernel_forwarded(&l)? - kf0) as f64 / (n * self.runs as u64) as f64;
        let prog_ns = match xdp_iface {
            Some(i) => {
                if fresh {
                    self.fresh_lb()?;
                }
                let id = xdp_prog_id(&l, i)?;
                // Statistics stay on while the fd is open (and cost every program two clock
                // reads per run, so the timed runs above go without).
                let _stats =
                    aya::sys::enable_stats(aya::sys::Stats::RunTime).context("BPF_ENABLE_STATS")?;
                let (t0, c0) = prog_stats(id)?;
                self.flood(shape, n)?;
                let (t1, c1) = prog_stats(id)?;
                ensure!(c1 > c0, "program {id} did not run");
                Some((t1 - t0) as f64 / (c1 - c0) as f64)
            }
            None => None,
        };
        Ok(Figures {
            cpu: median(cpu),
            wall: median(wall),
            kernel_share,
            prog_ns,
        })
    }

    /// Restarts the running LB (a new conntrack map, empty) and warms it up.
    fn fresh_lb(&mut self) -> anyhow::Result<()> {
        let (pid, generic) = self.lb.context("no LB running")?;
        self.stop_lb(pid)?;
        self.start_lb(generic)?;
        self.flood(Shape::NewFlows, WARMUP)?;
        thread::sleep(Duration::from_millis(300));
        Ok(())
    }

    fn stop_lb(&mut self, pid: u32) -> anyhow::Result<()> {
        self.t.stop(pid)?;
        wait_xdp(&self.t.l, "l0", false)?;
        self.lb = None;
        Ok(())
    }

    fn start_lb(&mut self, generic: bool) -> anyhow::Result<u32> {
        let rules = self.t.dir.join("rules.json").display().to_string();
        let l = self.t.l.clone();
        let mut args = vec![
            "l4-serve",
            "--xdp-iface",
            "l0",
            "--xdp-iface",
            "l1",
            "--rules",
            &rules,
        ];
        if generic {
            args.push("--xdp-generic");
        }
        let pid = self.t.spawn(&l, &args)?;
        for i in 0..2 {
            wait_xdp(&l, &format!("l{i}"), true)?;
        }
        thread::sleep(Duration::from_millis(500));
        self.lb = Some((pid, generic));
        Ok(pid)
    }
}

fn rule() -> String {
    r#"{"serviceArguments":{"externalIP":"20.0.0.1","port":80,"protocol":"udp","mode":0,"sel":0},"endpoints":[{"endpointIP":"10.100.1.2","targetPort":8080}]}"#.to_string()
}

/// Runs the benchmark and prints one table per traffic shape.
pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    ensure!(a.runs > 0, "--runs must be at least 1");
    let ct_flows = u64::from(loxi_common::maps::CT_ENTRIES / 2);
    ensure!(
        a.new_packets + WARMUP <= ct_flows,
        "--new-packets {} + {WARMUP} warm-up exceed the XDP conntrack map's {ct_flows} flows: \
         the fresh-table runs would evict",
        a.new_packets
    );
    let mut t = Topo::new("lxb")?;
    t.start_peers_with(true)?;
    let l = t.l.clone();
    cmd(&format!("ip -n {l} addr add 20.0.0.1/32 dev lo"))?;
    t.write_rules(&[rule()])?;
    let mut b = Bench {
        t,
        next_tuple: 0,
        packets: a.packets,
        new_packets: a.new_packets,
        runs: a.runs,
        lb: None,
        fresh_ct: true,
    };
    // Baseline: the LB's ingress drops everything in XDP.
    let drop = b.t.spawn(&l, &["xdp-pass", "--drop", "--iface", "l0"])?;
    wait_xdp(&l, "l0", true)?;
    let mut base = Vec::new();
    for s in SHAPES {
        base.push(b.measure(s, false, None)?);
    }
    b.t.stop(drop)?;
    wait_xdp(&l, "l0", false)?;
    let mut cases: Vec<(&str, Vec<Figures>)> = Vec::new();
    for (name, generic) in [("XDP native DNAT", false), ("XDP generic DNAT", true)] {
        b.start_lb(generic)?;
        let mut v = Vec::new();
        for s in SHAPES {
            v.push(b.measure(s, true, Some("l0"))?);
        }
        if let Some((pid, _)) = b.lb {
            b.stop_lb(pid)?;
        }
        cases.push((name, v));
    }
    // XDP native with its conntrack map full: fill it, then every new flow also evicts.
    b.start_lb(false)?;
    b.fresh_ct = false;
    b.flood(Shape::NewFlows, ct_flows + WARMUP)?;
    let full = b.measure(Shape::NewFlows, true, Some("l0"))?;
    if let Some((pid, _)) = b.lb {
        b.stop_lb(pid)?;
    }
    cmd(&format!(
        "ip netns exec {l} nft -f - <<'EOF'\ntable ip lxbench {{\n chain pre {{ type nat hook prerouting priority -100; ip daddr 20.0.0.1 udp dport 80 dnat to 10.100.1.2:8080; }}\n}}\nEOF"
    ))?;
    wait("nft rule", || {
        Ok(cmd(&format!("ip netns exec {l} nft list ruleset"))?.contains("dnat"))
    })?;
    let mut v = Vec::new();
    for s in SHAPES {
        v.push(b.measure(s, true, None)?);
    }
    cases.push(("nftables DNAT", v));
    println!(
        "bench-l4: median of {} runs; established flow {} packets/run, new flows {} packets/run \
         (XDP: a fresh conntrack map per run, below capacity like nftables'); UDP 18-byte \
         payload from a raw socket, sender pinned to CPU 0",
        a.runs, a.packets, a.new_packets
    );
    println!(
        "cpu = sender's CPU time per packet incl. softirq work charged to it; wall = elapsed; \
         fwd cost = minus the baseline; prog = the LB's XDP program's own run time per packet"
    );
    for (si, s) in SHAPES.iter().enumerate() {
        let bs = base[si];
        println!("\n[{}]", s.name());
        println!(
            "{:<24} {:>9} {:>9} {:>14} {:>14} {:>10} {:>9}",
            "case", "cpu ns", "wall ns", "fwd cost cpu", "fwd cost wall", "kernel-fwd", "prog ns"
        );
        println!(
            "{:<24} {:>9.0} {:>9.0} {:>14} {:>14} {:>10} {:>9}",
            "sender-only (XDP drop)", bs.cpu, bs.wall, "-", "-", "-", "-"
        );
        let full_row = (*s == Shape::NewFlows).then_some(("XDP native, CT map full", full));
        let rows = cases.iter().map(|(name, v)| (*name, v[si])).chain(full_row);
        for (name, f) in rows {
            println!(
                "{:<24} {:>9.0} {:>9.0} {:>14.0} {:>14.0} {:>9.0}% {:>9}",
                name,
                f.cpu,
                f.wall,
                f.cpu - bs.cpu,
                f.wall - bs.wall,
                f.kernel_share * 100.0,
                f.prog_ns.map_or("-".to_string(), |p| format!("{p:.0}"))
            );
        }
        let fc = cases[2].1[si].cpu - bs.cpu;
        println!(
            "ratio native/nftables forwarding cost (cpu), {}: {:.2}",
            s.name(),
            (cases[0].1[si].cpu - bs.cpu) / fc
        );
        println!(
            "ratio generic/nftables forwarding cost (cpu), {}: {:.2}",
            s.name(),
            (cases[1].1[si].cpu - bs.cpu) / fc
        );
        if *s == Shape::NewFlows {
            println!(
                "ratio native (CT map full, evicting)/nftables forwarding cost (cpu), {}: {:.2}",
                s.name(),
                (full.cpu - bs.cpu) / fc
            );
        }
    }
    Ok(())
}
