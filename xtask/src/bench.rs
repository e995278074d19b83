//! `xtask bench-l4` (run by `scripts/bench-l4.sh`): per-packet forwarding cost of the LB in the
//! netns topology for XDP native DNAT, XDP generic DNAT and kernel nftables DNAT, over a
//! sender-only baseline (the LB drops every packet at ingress in XDP), with a bounded UDP flood
//! from the client namespace pinned to one CPU (veth receive work runs in the sender's softirq
//! on that CPU, so wall time per packet covers the whole path).
use std::{
    fs,
    net::UdpSocket,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, ensure};

use crate::netns::{Topo, cmd, wait, wait_xdp};

/// Flags of `bench-l4`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Packets per measured run.
    #[arg(long, default_value_t = 200_000)]
    packets: u64,
    /// Runs per case (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// Flags of `udp-flood`.
#[derive(clap::Args)]
pub struct FloodArgs {
    /// Destination `ip:port`.
    #[arg(long)]
    dst: String,
    /// Datagrams to send.
    #[arg(long)]
    count: u64,
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

/// Sends `count` 18-byte datagrams as fast as possible; prints `wall_ns_per_packet
/// cpu_ns_per_packet`.
pub fn flood(a: FloodArgs) -> anyhow::Result<()> {
    let s = UdpSocket::bind("0.0.0.0:0")?;
    s.connect(&a.dst)?;
    let payload = [0x5au8; 18];
    let t0 = Instant::now();
    let c0 = cpu_ns();
    for _ in 0..a.count {
        // ECONNREFUSED (an ICMP error from a backend) and ENOBUFS are part of a flood.
        let _ = s.send(&payload);
    }
    let n = a.count.max(1) as f64;
    let wall = t0.elapsed().as_nanos() as f64 / n;
    let cpu = (cpu_ns() - c0) as f64 / n;
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

/// Per-packet cost over `runs` floods of `n` packets: (min CPU ns, min wall ns, share of
/// packets the LB kernel forwarded). The minimum is the run least disturbed by other load.
fn measure(
    t: &Topo,
    n: u64,
    runs: usize,
    expect_forwarded: bool,
) -> anyhow::Result<(f64, f64, f64)> {
    let exe = std::env::current_exe()?.display().to_string();
    let flood = |count: u64| -> anyhow::Result<(f64, f64)> {
        let out = cmd(&format!(
            "ip netns exec {} taskset -c 0 {exe} udp-flood --dst 20.0.0.1:80 --count {count}",
            t.c
        ))?;
        let mut it = out.split_whitespace().map(str::parse::<f64>);
        Ok((it.next().context("wall")??, it.next().context("cpu")??))
    };
    flood(2000)?; // warm-up: neighbours, conntrack
    thread::sleep(Duration::from_millis(300));
    let mut v = Vec::new();
    let kf0 = kernel_forwarded(&t.l)?;
    for _ in 0..runs {
        let before = rx_packets(&t.b[0], "b0")?;
        v.push(flood(n)?);
        thread::sleep(Duration::from_millis(200));
        let got = rx_packets(&t.b[0], "b0")? - before;
        if expect_forwarded {
            ensure!(
                got >= n * 9 / 10,
                "only {got} of {n} packets reached the backend"
            );
        } else {
            ensure!(
                got < n / 100,
                "{got} packets reached the backend in the drop baseline"
            );
        }
    }
    let kernel_share = (kernel_forwarded(&t.l)? - kf0) as f64 / (n * runs as u64) as f64;
    let cpu = v
        .iter()
        .map(|x: &(f64, f64)| x.1)
        .fold(f64::INFINITY, f64::min);
    let wall = v.iter().map(|x| x.0).fold(f64::INFINITY, f64::min);
    Ok((cpu, wall, kernel_share))
}

fn rule(endpoint: &str) -> String {
    rule_at("20.0.0.1", 80, endpoint)
}

fn rule_at(vip: &str, port: u16, endpoint: &str) -> String {
    format!(
        r#"{{"serviceArguments":{{"externalIP":"{vip}","port":{port},"protocol":"udp","mode":0,"sel":0}},"endpoints":[{{"endpointIP":"{endpoint}","targetPort":8080}}]}}"#
    )
}

fn start_lb(t: &mut Topo, generic: bool) -> anyhow::Result<u32> {
    let rules = t.dir.join("rules.json").display().to_string();
    let l = t.l.clone();
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
    let pid = t.spawn(&l, &args)?;
    for i in 0..2 {
        wait_xdp(&l, &format!("l{i}"), true)?;
    }
    thread::sleep(Duration::from_millis(300));
    Ok(pid)
}

/// Runs the benchmark and prints the table.
pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let mut t = Topo::new("lxb")?;
    // The backend's veth drops the flood in XDP (a service on the endpoint address whose only
    // endpoint is of the other family), so the measured path ends at the backend's driver.
    let sink = t.dir.join("sink.json");
    fs::write(
        &sink,
        format!("[{}]", rule_at("10.100.1.2", 8080, "fd00::2")),
    )?;
    t.start_peers_with(Some(&sink.display().to_string()))?;
    let l = t.l.clone();
    cmd(&format!("ip -n {l} addr add 20.0.0.1/32 dev lo"))?;
    // Baseline: the only endpoint is of the other family → every packet dropped at ingress.
    t.write_rules(&[rule("fd00::2")])?;
    let lb = start_lb(&mut t, false)?;
    let (base, base_wall, _) = measure(&t, a.packets, a.runs, false)?;
    t.write_rules(&[rule("10.100.1.2")])?;
    thread::sleep(Duration::from_millis(500));
    let native = measure(&t, a.packets, a.runs, true)?;
    t.stop(lb)?;
    wait_xdp(&l, "l0", false)?;
    let lb = start_lb(&mut t, true)?;
    let generic = measure(&t, a.packets, a.runs, true)?;
    t.stop(lb)?;
    wait_xdp(&l, "l0", false)?;
    cmd(&format!(
        "ip netns exec {l} nft -f - <<'EOF'\ntable ip lxbench {{\n chain pre {{ type nat hook prerouting priority -100; ip daddr 20.0.0.1 udp dport 80 dnat to 10.100.1.2:8080; }}\n}}\nEOF"
    ))?;
    wait("nft rule", || {
        Ok(cmd(&format!("ip netns exec {l} nft list ruleset"))?.contains("dnat"))
    })?;
    let nft = measure(&t, a.packets, a.runs, true)?;
    println!(
        "bench-l4: {} packets x {} runs (min), UDP 18-byte payload, sender pinned to CPU 0",
        a.packets, a.runs
    );
    println!("cpu = sender's CPU time incl. softirq work charged to it; wall = elapsed");
    println!(
        "{:<24} {:>9} {:>9} {:>14} {:>14} {:>10}",
        "case", "cpu ns", "wall ns", "fwd cost cpu", "fwd cost wall", "kernel-fwd"
    );
    println!(
        "{:<24} {:>9.0} {:>9.0} {:>14} {:>14} {:>10}",
        "sender-only (XDP drop)", base, base_wall, "-", "-", "-"
    );
    for (name, (c, w, k)) in [
        ("XDP native DNAT", native),
        ("XDP generic DNAT", generic),
        ("nftables DNAT", nft),
    ] {
        println!(
            "{:<24} {:>9.0} {:>9.0} {:>14.0} {:>14.0} {:>9.0}%",
            name,
            c,
            w,
            c - base,
            w - base_wall,
            k * 100.0
        );
    }
    let (nc, gc, fc) = (native.0 - base, generic.0 - base, nft.0 - base);
    println!(
        "ratio native/nftables forwarding cost (cpu): {:.2}",
        nc / fc
    );
    println!(
        "ratio generic/nftables forwarding cost (cpu): {:.2}",
        gc / fc
    );
    Ok(())
}
