//! `xtask bench-l4` (run by `scripts/bench-l4.sh`): per-packet forwarding cost of the LB in the
//! netns topology (client ns — LB ns — backend ns over veth) for XDP native DNAT, XDP generic
//! DNAT and kernel nftables DNAT, over a sender-only baseline, for two traffic shapes:
//! - `established`: one long flow (every packet the same 5-tuple: the conntrack fast path);
//! - `new flows`: every packet a 5-tuple never sent before (endpoint selection and conntrack
//!   creation per packet; no replies, so a DNAT flow that defers its reply entry inserts one
//!   entry). Both tables below capacity: every XDP run starts a fresh LB (empty conntrack map,
//!   32 K flows) and sends fewer flows than it holds; nftables' table (`nf_conntrack_max`)
//!   holds every run's flows (checked). One more case measures XDP native with its map full,
//!   where every insert also evicts (LRU).
//!
//! The sender is a flood from the client namespace pinned to one CPU (veth receive work runs
//! in the sender's softirq on that CPU, so its CPU time covers the whole path): by default
//! Ethernet frames through a qdisc-bypassing packet socket, 64 per `sendmmsg`, so the sender's
//! own cost (~2.5 µs a packet here) is small next to the raw IP socket's (~4.4 µs, one
//! `sendto`, route lookup and IP output per packet; `--sender raw`). The backend's veth drops
//! every frame in XDP (`loxi_drop`), so the path ends at the backend's driver. The baseline is
//! the same flood dropped by `loxi_drop` on the LB's ingress: a case's forwarding cost is its
//! CPU time per packet minus the baseline's. The program's own run time per packet (BPF
//! run-time statistics, in a separate run) is printed for the XDP cases.
//!
//! `--napi threaded` times the forwarding CPU alone: the LB ingress veth's NAPI runs as a kernel
//! thread pinned to CPU 1 (GRO on, so that nftables' case polls too), the sender on CPU 0 only
//! queues frames, and a case's cost is the NAPI thread's CPU time per packet (with CPU 1's
//! softirq thread's). The thread polls what the sender queued in batches of up to 64 frames,
//! as a NIC's poll does, where the default placement runs one frame per poll in the sender's
//! own softirq; the sender's cost and its drift are out of the figure.
//!
//! On a shared VM the baseline alone drifts by hundreds of ns a packet between minutes, so
//! the cases are interleaved: every round runs each case once, in an order rotated by the
//! round, forwarding costs are taken against the same round's baseline and ratios per round;
//! the report gives medians, every round's forwarding cost and the ratios' spread.
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
    /// Rounds: each runs every case once (the medians over rounds are reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// How the client sends: `packet` (frames through a qdisc-bypassing packet socket, 64 per
    /// `sendmmsg`: the sender's own cost is small, so the forwarding cost is a steady share)
    /// or `raw` (one datagram per `sendto` on a raw IP socket, the method of the figures
    /// before 2026-12-03 afternoon).
    #[arg(long, value_enum, default_value_t = Sender::Packet)]
    sender: Sender,
    /// Where the LB's receive work runs and what is timed: `softirq` (the LB ingress's veth
    /// receive runs in the sender's softirq on CPU 0, one frame per NAPI poll, and the
    /// sender's CPU time is measured) or `threaded` (the ingress veth's NAPI runs as a kernel
    /// thread pinned to CPU 1, polling the frames the sender queued in batches of up to 64 as
    /// a NIC's poll does, and that thread's CPU time is measured: the forwarding CPU alone,
    /// without the sender's own cost and its noise).
    #[arg(long, value_enum, default_value_t = Napi::Softirq)]
    napi: Napi,
    /// What the peers of the LB's veths run: `xdp` (a pass-through XDP program, the backend's
    /// dropping every frame: the XDP cases forward with `bpf_redirect` into the peer's NAPI) or
    /// `plain` (no XDP program and GRO off, as containers' and pods' veths: the XDP cases take
    /// the TC hand-off, `XDP_PASS` then the TC program's redirect; the backend's veth drops
    /// every frame in an nftables netdev ingress chain instead). On a kernel whose XDP programs may not
    /// call `bpf_xdp_adjust_meta` (Linux 6.18) the hand-off carries no metadata and the TC
    /// program finds the next hop again (conntrack or FIB).
    #[arg(long, value_enum, default_value_t = BenchPeers::Xdp)]
    peers: BenchPeers,
}

/// The LB's veth peers in `bench-l4` ([`BenchArgs::peers`]).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BenchPeers {
    Xdp,
    Plain,
}

/// Receive-work placement of `bench-l4` ([`BenchArgs::napi`]).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Napi {
    Softirq,
    Threaded,
}

/// Sending method of `bench-l4` ([`BenchArgs::sender`]).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Sender {
    Packet,
    Raw,
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
    /// Send Ethernet frames on this interface through a packet socket that bypasses the qdisc
    /// (`PACKET_QDISC_BYPASS`), `--batch` frames per `sendmmsg`, instead of datagrams through
    /// a raw IP socket: the sender's own cost per packet falls from ~4 µs (a syscall, a route
    /// lookup and the IP output path per packet) to the frame copy and the driver's transmit,
    /// so the forwarding cost measured on top of it is a larger, steadier share.
    #[arg(long, requires = "dst_mac")]
    iface: Option<String>,
    /// Destination MAC of `--iface`'s frames (the LB's ingress veth), `aa:bb:cc:dd:ee:ff`.
    #[arg(long, requires = "iface")]
    dst_mac: Option<String>,
    /// Frames per `sendmmsg` with `--iface` (1..=1024; refused without `--iface`).
    #[arg(long, requires = "iface", value_parser = clap::value_parser!(u16).range(1..=1024))]
    batch: Option<u16>,
}

/// Parses `aa:bb:cc:dd:ee:ff`.
fn parse_mac(s: &str) -> anyhow::Result<[u8; 6]> {
    let v: Vec<u8> = s
        .trim()
        .split(':')
        .map(|h| u8::from_str_radix(h, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("MAC address {s:?}"))?;
    v.try_into()
        .map_err(|_| anyhow::anyhow!("MAC address {s:?}: six bytes expected"))
}

/// MAC address of `iface` in network namespace `ns`.
fn mac_of(ns: &str, iface: &str) -> anyhow::Result<String> {
    let s = cmd(&format!(
        "ip netns exec {ns} cat /sys/class/net/{iface}/address"
    ))?;
    parse_mac(&s)?;
    Ok(s.trim().to_string())
}

/// Length of a flood frame: Ethernet header and [`DGRAM_LEN`] (60 bytes, the Ethernet
/// minimum without FCS, so no padding).
const FRAME_LEN: usize = 14 + DGRAM_LEN;

/// Sends `a.count` frames on `iface` through a qdisc-bypassing packet socket, `a.batch` per
/// `sendmmsg`; returns (wall, cpu) ns per packet.
#[allow(unsafe_code, reason = "a packet socket and sendmmsg(2) through libc")]
fn flood_frames(a: &FloodArgs, iface: &str, dst_mac: [u8; 6]) -> anyhow::Result<(f64, f64)> {
    let src_mac = parse_mac(&std::fs::read_to_string(format!(
        "/sys/class/net/{iface}/address"
    ))?)?;
    let name = std::ffi::CString::new(iface)?;
    // SAFETY: NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    ensure!(ifindex != 0, "no interface {iface}");
    let proto = (libc::ETH_P_IP as u16).to_be();
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
    ensure!(
        fd >= 0,
        "packet socket: {}",
        std::io::Error::last_os_error()
    );
    let one: libc::c_int = 1;
    // SAFETY: valid fd and option value of the declared size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_PACKET,
            libc::PACKET_QDISC_BYPASS,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    ensure!(
        rc == 0,
        "PACKET_QDISC_BYPASS: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: zeroed sockaddr_ll is valid; the fields are set below.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto;
    sll.sll_ifindex = ifindex as i32;
    // SAFETY: valid fd and address of the declared size.
    let rc = unsafe {
        libc::bind(
            fd,
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    ensure!(rc == 0, "bind {iface}: {}", std::io::Error::last_os_error());
    let batch = usize::from(a.batch.unwrap_or(64));
    let mut frames = vec![[0u8; FRAME_LEN]; batch];
    for f in &mut frames {
        f[0..6].copy_from_slice(&dst_mac);
        f[6..12].copy_from_slice(&src_mac);
        f[12..14].copy_from_slice(&(libc::ETH_P_IP as u16).to_be_bytes());
        let d: &mut [u8; DGRAM_LEN] = (&mut f[14..]).try_into().expect("frame length");
        datagram(d, a.src, a.dst);
    }
    let t0 = Instant::now();
    let c0 = cpu_ns();
    let mut sent = 0u64;
    while sent < a.count {
        let n = (a.count - sent).min(batch as u64) as usize;
        if a.new_flows {
            for (j, f) in frames[..n].iter_mut().enumerate() {
                let d: &mut [u8; DGRAM_LEN] = (&mut f[14..]).try_into().expect("frame length");
                datagram(d, new_src(a.first + sent + j as u64), a.dst);
            }
        }
        let mut iov: Vec<libc::iovec> = frames[..n]
            .iter_mut()
            .map(|f| libc::iovec {
                iov_base: f.as_mut_ptr().cast(),
                iov_len: FRAME_LEN,
            })
            .collect();
        // SAFETY: zeroed mmsghdr is valid; each points at one iovec of a live frame.
        let mut msgs: Vec<libc::mmsghdr> = iov
            .iter_mut()
            .map(|v| {
                let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
                m.msg_hdr.msg_iov = v;
                m.msg_hdr.msg_iovlen = 1;
                m
            })
            .collect();
        // SAFETY: `msgs` holds `n` valid headers whose buffers outlive the call.
        let rc = unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr(), n as libc::c_uint, 0) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            ensure!(
                e.raw_os_error() == Some(libc::ENOBUFS),
                "sendmmsg after {sent} of {}: {e}",
                a.count
            );
            continue;
        }
        sent += rc as u64;
    }
    let n = a.count.max(1) as f64;
    let wall = t0.elapsed().as_nanos() as f64 / n;
    let cpu = (cpu_ns() - c0) as f64 / n;
    // SAFETY: our own fd.
    unsafe { libc::close(fd) };
    Ok((wall, cpu))
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

/// Sets socket timeout `opt` (`SO_SNDTIMEO`, `SO_RCVTIMEO`) of `fd` to `d`.
#[allow(unsafe_code, reason = "setsockopt(2) through libc")]
pub(crate) fn sock_timeout(fd: i32, opt: i32, d: Duration) {
    let tv = libc::timeval {
        tv_sec: d.as_secs() as libc::time_t,
        tv_usec: libc::suseconds_t::from(d.subsec_micros()),
    };
    // SAFETY: valid fd and option value of the declared size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
}

/// One's-complement sum of big-endian 16-bit words.
pub(crate) fn csum_add(mut acc: u32, b: &[u8]) -> u32 {
    for w in b.chunks(2) {
        acc += u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]));
    }
    acc
}

/// `acc` folded to 16 bits and complemented: the checksum field value.
pub(crate) fn csum_fold(mut acc: u32) -> u16 {
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
    if let (Some(iface), Some(mac)) = (&a.iface, &a.dst_mac) {
        let (wall, cpu) = flood_frames(&a, iface, parse_mac(mac)?)?;
        println!("{wall:.1} {cpu:.1}");
        return Ok(());
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
    sock_timeout(fd, libc::SO_SNDTIMEO, Duration::from_secs(2));
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

pub(crate) fn rx_packets(ns: &str, iface: &str) -> anyhow::Result<u64> {
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
    lb: Option<(u32, LbHook)>,
    fresh_ct: bool,
    /// With the packet-socket sender: the `udp-flood` flags that select it (interface and the
    /// LB ingress's MAC).
    frames: Option<String>,
    /// `--napi threaded`: the pid of [`NAPI_CPU`]'s softirq thread; the ingress NAPI thread's
    /// CPU time (with that thread's) is measured instead of the sender's.
    threaded: Option<u32>,
}

/// CPU the ingress NAPI thread is pinned to with `--napi threaded` (the sender has CPU 0).
const NAPI_CPU: u32 = 1;

/// The kernel thread polling the LB ingress `l0` with threaded NAPI (`napi/l0-<id>`), pinned to
/// [`NAPI_CPU`]. The thread is created anew whenever the device's NAPI is (an XDP program
/// attached or detached), so it is looked up for every measurement; a second thread of that
/// name (another namespace's `l0` with threaded NAPI) would make the figure ambiguous and is
/// refused.
pub(crate) fn napi_thread() -> anyhow::Result<u32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc")? {
        let e = e?;
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(e.path().join("comm")) else {
            continue;
        };
        if comm.trim_end().starts_with("napi/l0-") {
            found.push(pid);
        }
    }
    ensure!(
        found.len() == 1,
        "expected one napi/l0-* thread (the LB ingress's), found {found:?}: is another threaded \
         l0 up, or did the device lose its NAPI?"
    );
    cmd(&format!("taskset -pc {NAPI_CPU} {}", found[0]))?;
    Ok(found[0])
}

/// CPU time in ns a thread has run (`/proc/PID/schedstat`, first field).
fn run_ns(pid: u32) -> anyhow::Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/schedstat"))?;
    Ok(s.split_whitespace().next().context("schedstat")?.parse()?)
}

/// CPU ns of the receive work of [`NAPI_CPU`]: the NAPI thread's, plus that CPU's softirq
/// thread's, `ksoft` (softirqs the NAPI thread raises, the backend veth's poll among them, run
/// in it when they do not run on the thread's own exit from a bottom-half section).
pub(crate) fn napi_cpu_ns(napi: u32, ksoft: u32) -> anyhow::Result<u64> {
    Ok(run_ns(napi)? + run_ns(ksoft)?)
}

/// Runs this binary's `udp-flood --dst 20.0.0.1:80 <args>` in the client namespace `c_ns`,
/// pinned to CPU 0: (wall, cpu) ns per packet.
pub(crate) fn udp_flood(c_ns: &str, args: &str) -> anyhow::Result<(f64, f64)> {
    let exe = std::env::current_exe()?.display().to_string();
    let out = cmd(&format!(
        "ip netns exec {c_ns} taskset -c 0 {exe} udp-flood --dst 20.0.0.1:80 {args}"
    ))?;
    let mut it = out.split_whitespace().map(str::parse::<f64>);
    Ok((it.next().context("wall")??, it.next().context("cpu")??))
}

/// Threaded NAPI on the LB ingress `l0` of `t` (see the module doc): GRO on `l0` (a veth polls
/// with NAPI only under XDP or with GRO on, and then only frames that may be merged, so the
/// client's `c0` offers no TSO), `l0`'s NAPI made a thread; returns the pid of [`NAPI_CPU`]'s
/// softirq thread, measured with it.
pub(crate) fn threaded_napi(t: &Topo) -> anyhow::Result<u32> {
    let l = &t.l;
    cmd(&format!("ip netns exec {l} ethtool -K l0 gro on"))?;
    cmd(&format!("ip netns exec {} ethtool -K c0 tso off", t.c))?;
    cmd(&format!(
        "ip netns exec {l} sh -c 'echo 1 > /sys/class/net/l0/threaded'"
    ))?;
    let ksoft = cmd(&format!("pgrep -x ksoftirqd/{NAPI_CPU}"))?;
    ksoft.trim().parse().context("ksoftirqd pid")
}

/// Warm-up packets before a measured run (neighbours, the LB's next-hop cache).
pub(crate) const WARMUP: u64 = 2000;

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
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
        let extra = match shape {
            Shape::Established => String::new(),
            Shape::NewFlows => {
                let s = format!(" --new-flows --first {}", self.next_tuple);
                self.next_tuple += count;
                s
            }
        };
        udp_flood(
            &self.t.c,
            &format!(
                "--count {count}{extra}{}",
                self.frames.as_deref().unwrap_or("")
            ),
        )
    }

    /// One measured run of `shape` (after a warm-up): its per-packet cost, the share of its
    /// packets the LB kernel forwarded and, with `xdp_iface`, the program's own time per
    /// packet from one more run with BPF run-time statistics on.
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
        if fresh {
            self.fresh_lb()?;
        } else {
            self.flood(shape, WARMUP)?; // warm-up: neighbours, conntrack
            thread::sleep(Duration::from_millis(300));
        }
        let (l, b) = (self.t.l.clone(), self.t.b[0].clone());
        let kf0 = kernel_forwarded(&l)?;
        let before = rx_packets(&b, "b0")?;
        let napi = match self.threaded {
            Some(ksoft) => {
                let pid = napi_thread()?;
                Some((pid, ksoft, napi_cpu_ns(pid, ksoft)?))
            }
            None => None,
        };
        let (wall, mut cpu) = self.flood(shape, n)?;
        thread::sleep(Duration::from_millis(200));
        if let Some((pid, ksoft, ns0)) = napi {
            cpu = (napi_cpu_ns(pid, ksoft)? - ns0) as f64 / n as f64;
        }
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
        let kernel_share = (kernel_forwarded(&l)? - kf0) as f64 / n as f64;
        let prog_ns = match xdp_iface {
            Some(i) => {
                if fresh {
                    self.fresh_lb()?;
                }
                let id = xdp_prog_id(&l, i)?;
                // Statistics stay on while the fd is open (and cost every program two clock
                // reads per run, so the timed run above goes without).
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
            cpu,
            wall,
            kernel_share,
            prog_ns,
        })
    }

    /// Restarts the running LB (a new conntrack map, empty) and warms it up.
    fn fresh_lb(&mut self) -> anyhow::Result<()> {
        let (pid, hook) = self.lb.context("no LB running")?;
        self.stop_lb(pid)?;
        self.start_lb(hook)?;
        self.flood(Shape::NewFlows, WARMUP)?;
        thread::sleep(Duration::from_millis(300));
        Ok(())
    }

    fn stop_lb(&mut self, pid: u32) -> anyhow::Result<()> {
        stop_lb(&mut self.t, pid)?;
        self.lb = None;
        Ok(())
    }

    fn start_lb(&mut self, hook: LbHook) -> anyhow::Result<u32> {
        let pid = start_lb(&mut self.t, &std::env::current_exe()?, hook)?;
        self.lb = Some((pid, hook));
        Ok(pid)
    }
}

/// The benchmarks' topology (`tag` names its namespaces): client — LB — backends, the peers'
/// XDP in place (the first backend's veth dropping every frame), the VIP 20.0.0.1 on the LB
/// namespace's loopback and the one DNAT rule ([`rule`]) written for `l4-serve`.
pub(crate) fn lb_topology(tag: &str) -> anyhow::Result<Topo> {
    lb_topology_with(tag, BenchPeers::Xdp)
}

/// [`lb_topology`] with the peers `peers` says: with [`BenchPeers::Plain`] no XDP program and
/// GRO off on every peer, and the first backend's veth dropping every frame in an nftables
/// netdev ingress chain (the path still ends at the backend's device, counted in its receive
/// statistics).
fn lb_topology_with(tag: &str, peers: BenchPeers) -> anyhow::Result<Topo> {
    let mut t = Topo::new(tag)?;
    match peers {
        BenchPeers::Xdp => t.start_peers_with(true)?,
        BenchPeers::Plain => {
            t.plain_peers()?;
            // nftables' netdev ingress hook: before the IP stack, as the XDP sink is (the TC
            // drop action and classifiers are modules this machine kind may lack). IPv4 only:
            // ARP passes, so the LB resolves the backend's MAC as in the XDP case.
            let b = t.b[0].clone();
            cmd(&format!(
                "ip netns exec {b} nft -f - <<'EOF'\ntable netdev lxsink {{\n chain in {{ type filter hook ingress device \"b0\" priority 0; ether type ip drop; }}\n}}\nEOF"
            ))?;
        }
    }
    cmd(&format!("ip -n {} addr add 20.0.0.1/32 dev lo", t.l))?;
    t.write_rules(&[rule()])?;
    Ok(t)
}

/// The `udp-flood` flags of the packet-socket sender: frames on `c0` to the LB ingress's MAC
/// (with a leading space).
pub(crate) fn packet_sender(t: &Topo) -> anyhow::Result<String> {
    Ok(format!(" --iface c0 --dst-mac {}", mac_of(&t.l, "l0")?))
}

/// Where the LB's data path runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LbHook {
    /// XDP in driver mode (`--xdp-iface`).
    Native,
    /// XDP in generic mode (`--xdp-iface --xdp-generic`).
    Generic,
    /// The whole data path in TC ingress (`--tc-iface`).
    Tc,
}

/// Starts `exe`'s `l4-serve` (an `xtask` binary: its build's program and loader) as the LB of
/// `t` on both LB veths, on `hook`, and waits until both have the program (XDP on the links,
/// or the loader's two "attached in TC ingress" log lines) and the loader has written the
/// rule; its pid.
pub(crate) fn start_lb(t: &mut Topo, exe: &std::path::Path, hook: LbHook) -> anyhow::Result<u32> {
    let rules = t.dir.join("rules.json").display().to_string();
    let l = t.l.clone();
    let flag = if hook == LbHook::Tc {
        "--tc-iface"
    } else {
        "--xdp-iface"
    };
    let mut args = vec!["l4-serve", flag, "l0", flag, "l1", "--rules", &rules];
    if hook == LbHook::Generic {
        args.push("--xdp-generic");
    }
    let pid = t.spawn_exe(&l, exe, &args)?;
    if hook == LbHook::Tc {
        let log = t.dir.join(format!("{l}-{}.log", t.children_started() - 1));
        wait("the TC data path on l0 and l1", || {
            Ok(std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .filter(|x| x.contains("L4 data path attached in TC ingress"))
                .count()
                == 2)
        })?;
    } else {
        for i in 0..2 {
            wait_xdp(&l, &format!("l{i}"), true)?;
        }
    }
    thread::sleep(Duration::from_millis(500));
    Ok(pid)
}

/// Stops the LB `pid` started by [`start_lb`] (it detaches before it exits) and waits until
/// its XDP program, if any, left `l0`.
pub(crate) fn stop_lb(t: &mut Topo, pid: u32) -> anyhow::Result<()> {
    t.stop(pid)?;
    wait_xdp(&t.l, "l0", false)
}

fn rule() -> String {
    r#"{"serviceArguments":{"externalIP":"20.0.0.1","port":80,"protocol":"udp","mode":0,"sel":0},"endpoints":[{"endpointIP":"10.100.1.2","targetPort":8080}]}"#.to_string()
}

/// The measured cases. Every round runs each once, in an order rotated by the round, so that
/// the machine's drift (a shared VM's baseline moves by hundreds of ns a packet between
/// minutes) falls on all cases alike and every ratio compares runs of the same round.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Case {
    /// The LB's ingress drops everything in XDP: the sender's own cost.
    Baseline,
    Native,
    Generic,
    /// XDP native with its conntrack map full: every new flow's insert also evicts.
    NativeFull,
    Nft,
    /// The whole data path in TC ingress (`--tc-iface`).
    Tc,
}

const CASES: [Case; 6] = [
    Case::Baseline,
    Case::Native,
    Case::Generic,
    Case::NativeFull,
    Case::Nft,
    Case::Tc,
];

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Baseline => "sender-only (XDP drop)",
            Case::Native => "XDP native DNAT",
            Case::Generic => "XDP generic DNAT",
            Case::NativeFull => "XDP native, CT map full",
            Case::Nft => "nftables DNAT",
            Case::Tc => "TC DNAT (--tc-iface)",
        }
    }

    /// Whether the case measures `shape` (the full map only matters to new flows).
    fn has(self, shape: Shape) -> bool {
        self != Case::NativeFull || shape == Shape::NewFlows
    }
}

/// `min–max` of `v`, for the per-round spread of a ratio.
fn spread(v: &[f64]) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.2}–{hi:.2}")
}

impl Bench {
    /// Runs `case` once for every shape it has: (shape index, figures).
    fn round(&mut self, case: Case, ct_flows: u64) -> anyhow::Result<Vec<(usize, Figures)>> {
        let l = self.t.l.clone();
        let mut out = Vec::new();
        match case {
            Case::Baseline => {
                let drop = self.t.spawn(&l, &["xdp-pass", "--drop", "--iface", "l0"])?;
                wait_xdp(&l, "l0", true)?;
                for (si, s) in SHAPES.into_iter().enumerate() {
                    // Its program time is the statistics' own floor (two clock reads around a
                    // program that only reads the EtherType).
                    out.push((si, self.measure(s, false, Some("l0"))?));
                }
                self.t.stop(drop)?;
                wait_xdp(&l, "l0", false)?;
            }
            Case::Native | Case::Generic => {
                self.start_lb(if case == Case::Generic {
                    LbHook::Generic
                } else {
                    LbHook::Native
                })?;
                self.fresh_ct = true;
                for (si, s) in SHAPES.into_iter().enumerate() {
                    out.push((si, self.measure(s, true, Some("l0"))?));
                }
            }
            Case::Tc => {
                self.start_lb(LbHook::Tc)?;
                self.fresh_ct = true;
                for (si, s) in SHAPES.into_iter().enumerate() {
                    out.push((si, self.measure(s, true, None)?));
                }
            }
            Case::NativeFull => {
                self.start_lb(LbHook::Native)?;
                self.fresh_ct = false;
                self.flood(Shape::NewFlows, ct_flows + WARMUP)?;
                out.push((1, self.measure(Shape::NewFlows, true, Some("l0"))?));
            }
            Case::Nft => {
                cmd(&format!(
                    "ip netns exec {l} nft -f - <<'EOF'\ntable ip lxbench {{\n chain pre {{ type nat hook prerouting priority -100; ip daddr 20.0.0.1 udp dport 80 dnat to 10.100.1.2:8080; }}\n}}\nEOF"
                ))?;
                wait("nft rule", || {
                    Ok(cmd(&format!("ip netns exec {l} nft list ruleset"))?.contains("dnat"))
                })?;
                for (si, s) in SHAPES.into_iter().enumerate() {
                    out.push((si, self.measure(s, true, None)?));
                }
                cmd(&format!("ip netns exec {l} nft delete table ip lxbench"))?;
            }
        }
        if let Some((pid, _)) = self.lb {
            self.stop_lb(pid)?;
        }
        Ok(out)
    }
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
    let t = lb_topology_with("lxb", a.peers)?;
    let l = t.l.clone();
    let threaded = if a.napi == Napi::Threaded {
        Some(threaded_napi(&t)?)
    } else {
        None
    };
    let frames = match a.sender {
        Sender::Packet => Some(packet_sender(&t)?),
        Sender::Raw => None,
    };
    let mut b = Bench {
        t,
        next_tuple: 0,
        packets: a.packets,
        new_packets: a.new_packets,
        lb: None,
        fresh_ct: true,
        frames,
        threaded,
    };
    // figs[round][case][shape]
    let mut figs = vec![[[None::<Figures>; 2]; CASES.len()]; a.runs];
    for (r, row) in figs.iter_mut().enumerate() {
        for k in 0..CASES.len() {
            let ci = (k + r) % CASES.len();
            for (si, f) in b.round(CASES[ci], ct_flows)? {
                row[ci][si] = Some(f);
            }
        }
        if r == 0 {
            // nftables keeps every run's flows (UDP entries idle out after 30 s): they must fit.
            let max: u64 = cmd(&format!(
                "ip netns exec {l} sysctl -n net.netfilter.nf_conntrack_max"
            ))?
            .trim()
            .parse()?;
            ensure!(
                (a.runs as u64) * (a.new_packets + WARMUP) < max,
                "--runs {} × (--new-packets {} + {WARMUP}) new flows would fill nftables' \
                 conntrack table ({max} entries)",
                a.runs,
                a.new_packets
            );
        }
    }
    println!(
        "bench-l4: {} rounds, each case once per round (order rotated), medians over rounds; \
         established flow {} packets/run, new flows {} packets/run (XDP: a fresh conntrack map \
         per run, below capacity like nftables'); UDP 18-byte payload {}, sender pinned to CPU 0",
        a.runs,
        a.packets,
        a.new_packets,
        match a.sender {
            Sender::Packet => "in frames from a qdisc-bypassing packet socket, 64 per sendmmsg",
            Sender::Raw => "from a raw IP socket, one per sendto",
        }
    );
    println!(
        "peers: {}",
        match a.peers {
            BenchPeers::Xdp => {
                "XDP (pass-through programs; the backend's veth drops in XDP): XDP cases redirect"
            }
            BenchPeers::Plain => {
                "plain (no XDP, GRO off; the backend's veth drops in an nftables netdev ingress \
                 chain): XDP \
                 cases take the TC hand-off (every packet reaching the backend with kernel-fwd 0% \
                 went XDP_PASS, then the TC program's redirect)"
            }
        }
    );
    println!(
        "cpu = {}; wall = the sender's elapsed time; fwd cost = minus the same round's baseline; \
         prog = the LB's XDP program's own run time per packet; ratios are per round (median, \
         and min–max over rounds)",
        if threaded.is_some() {
            "CPU time per packet of the LB ingress's threaded NAPI (pinned to CPU 1, batches of \
             up to 64 frames a poll) and of CPU 1's softirq thread"
        } else {
            "sender's CPU time per packet incl. softirq work charged to it (one frame per NAPI \
             poll)"
        }
    );
    let base = |r: usize, si: usize| figs[r][0][si].map(|f| f.cpu);
    for (si, s) in SHAPES.iter().enumerate() {
        println!("\n[{}]", s.name());
        println!(
            "{:<24} {:>9} {:>9} {:>14} {:>14} {:>10} {:>9}",
            "case", "cpu ns", "wall ns", "fwd cost cpu", "fwd cost wall", "kernel-fwd", "prog ns"
        );
        // Median program time of a case (NaN when not measured).
        let prog_median = |ci: usize| -> f64 {
            let v: Vec<f64> = (0..a.runs)
                .filter_map(|r| figs[r][ci][si]?.prog_ns)
                .collect();
            if v.is_empty() { f64::NAN } else { median(v) }
        };
        // Per-round forwarding cost (cpu) of each case.
        let cost = |ci: usize| -> Vec<f64> {
            (0..a.runs)
                .filter_map(|r| Some(figs[r][ci][si]?.cpu - base(r, si)?))
                .collect()
        };
        for (ci, c) in CASES.iter().enumerate() {
            if !c.has(*s) {
                continue;
            }
            let rows: Vec<Figures> = (0..a.runs).filter_map(|r| figs[r][ci][si]).collect();
            let col = |f: fn(&Figures) -> f64| median(rows.iter().map(f).collect());
            if *c == Case::Baseline {
                println!(
                    "{:<24} {:>9.0} {:>9.0} {:>14} {:>14} {:>10} {:>9.0}",
                    c.name(),
                    col(|f| f.cpu),
                    col(|f| f.wall),
                    "-",
                    "-",
                    "-",
                    prog_median(0)
                );
                continue;
            }
            let wall_cost: Vec<f64> = (0..a.runs)
                .filter_map(|r| Some(figs[r][ci][si]?.wall - figs[r][0][si]?.wall))
                .collect();
            let prog = prog_median(ci);
            println!(
                "{:<24} {:>9.0} {:>9.0} {:>14.0} {:>14.0} {:>9.0}% {:>9}",
                c.name(),
                col(|f| f.cpu),
                col(|f| f.wall),
                median(cost(ci)),
                median(wall_cost),
                col(|f| f.kernel_share) * 100.0,
                if prog.is_nan() {
                    "-".to_string()
                } else {
                    format!("{prog:.0}")
                }
            );
        }
        // Every round's forwarding cost, so the spread behind the medians is on the page.
        for (ci, c) in CASES.iter().enumerate().skip(1) {
            if c.has(*s) {
                let v: Vec<String> = cost(ci).iter().map(|x| format!("{x:.0}")).collect();
                println!("  per round, {:<22} {}", c.name(), v.join(" "));
            }
        }
        let nft = cost(4);
        for (ci, c) in CASES.iter().enumerate().skip(1).take(3) {
            if !c.has(*s) {
                continue;
            }
            let ratios: Vec<f64> = cost(ci).iter().zip(&nft).map(|(x, n)| x / n).collect();
            let label = match c {
                Case::Native => "native",
                Case::Generic => "generic",
                _ => "native (CT map full, evicting)",
            };
            println!(
                "ratio {label}/nftables forwarding cost (cpu), {}: {:.2} (rounds {})",
                s.name(),
                median(ratios.clone()),
                spread(&ratios)
            );
        }
        let tc: Vec<f64> = cost(5).iter().zip(&nft).map(|(x, n)| x / n).collect();
        println!(
            "ratio tc/nftables forwarding cost (cpu), {}: {:.2} (rounds {})",
            s.name(),
            median(tc.clone()),
            spread(&tc)
        );
        // How much of XDP native's cost is loxi's program: its run time less the statistics'
        // floor (the drop program's), and the ratio the rest of the path (redirect, the
        // egress veth's delivery) would have alone.
        let own = prog_median(1) - prog_median(0);
        let fwd = median(cost(1));
        println!(
            "XDP native program time net of the statistics' floor ({:.0} ns): {own:.0} ns of a \
             {fwd:.0} ns forwarding cost; the path without the program: ratio {:.2}",
            prog_median(0),
            (fwd - own) / median(nft.clone())
        );
    }
    Ok(())
}
