//! `xtask bench-l4-ab` (run by `scripts/bench-l4-ab.sh`): the new-flow forwarding cost of two
//! builds of the XDP program, interleaved, an A/B that separates a change from this shared
//! VM's drift (whole `bench-l4` runs minutes apart do not).
//!
//! Each build is an `xtask` binary (e.g. `target/release/xtask` copied before and after a
//! change): each embeds its build's program and loader, and runs as the LB (`l4-serve`, one
//! DNAT UDP rule) in the topology of `bench-l4 --napi threaded` (see [`crate::bench`]): client
//! namespace — LB namespace — backend namespace dropping what arrives; the LB ingress's NAPI
//! runs as a thread pinned to CPU 1, the sender (this binary's `udp-flood`, a qdisc-bypassing
//! packet socket) on CPU 0. Every round runs both builds (A then B in odd rounds, B then A in
//! even ones, so drift within a round biases neither); each starts with a fresh loader (empty
//! conntrack) and is flooded twice with one datagram per new 5-tuple, tuples never repeating
//! within the run: first into the empty map, then into the map holding the first flood's flows.
//! Printed per build and flood: the CPU time per packet of the NAPI thread and of CPU 1's
//! softirq thread in every round (`/proc/PID/schedstat`: the receive, the program, the redirect
//! and the transmit), and the median over rounds.

use std::path::PathBuf;
use std::thread;
use std::time::Duration;

use anyhow::ensure;

use crate::bench::{
    LbHook, WARMUP, lb_topology, median, napi_cpu_ns, napi_thread, packet_sender, rx_packets,
    start_lb, stop_lb, threaded_napi, udp_flood,
};

/// Most flows a flood may send: a build that defers the reply entry holds one conntrack entry
/// per unanswered flow, so its two floods and the warm-up stay below the map's 64 K entries
/// and no insert evicts (a build inserting both entries at creation evicts in its second flood
/// above 16,384).
const MAX_FLOWS: u64 = 30_768;

/// Flags of `bench-l4-ab`.
#[derive(clap::Args)]
pub struct AbArgs {
    /// Build A: an `xtask` binary.
    a: PathBuf,
    /// Build B: an `xtask` binary.
    b: PathBuf,
    /// Rounds; each runs both builds, two floods each.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// New flows per flood (1..=30768).
    #[arg(long, default_value_t = 25_000, value_parser = clap::value_parser!(u64).range(1..=MAX_FLOWS))]
    flows: u64,
}

/// Runs the A/B and prints its report.
pub fn run(a: AbArgs) -> anyhow::Result<()> {
    for x in [&a.a, &a.b] {
        ensure!(x.is_file(), "{} is not a file", x.display());
    }
    let mut t = lb_topology("lxab")?;
    let (c, b0) = (t.c.clone(), t.b[0].clone());
    let ksoft = threaded_napi(&t)?;
    let frames = packet_sender(&t)?;
    let builds = [("A", &a.a), ("B", &a.b)];
    // cpu[build][flood]: ns per packet, one per round.
    let mut cpu = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
    let mut first = 0;
    for r in 0..a.rounds {
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let (name, exe) = builds[i];
            let lb = start_lb(&mut t, exe, LbHook::Native)?;
            // Looked up after each start: attaching XDP recreates the thread.
            let napi = napi_thread()?;
            let rx0 = rx_packets(&b0, "b0")?;
            udp_flood(&c, &format!("--count {WARMUP}{frames}"))?;
            thread::sleep(Duration::from_millis(200));
            let got = rx_packets(&b0, "b0")? - rx0;
            ensure!(
                got >= WARMUP * 95 / 100,
                "build {name} forwarded {got} of {WARMUP} warm-up packets"
            );
            for flood in &mut cpu[i] {
                let n0 = napi_cpu_ns(napi, ksoft)?;
                udp_flood(
                    &c,
                    &format!("--count {} --new-flows --first {first}{frames}", a.flows),
                )?;
                first += a.flows;
                thread::sleep(Duration::from_millis(200));
                let n1 = napi_cpu_ns(napi, ksoft)?;
                flood.push((n1 - n0) as f64 / a.flows as f64);
            }
            stop_lb(&mut t, lb)?;
            thread::sleep(Duration::from_millis(500));
        }
    }
    println!(
        "bench-l4-ab: CPU ns per new-flow packet (NAPI thread + CPU 1 softirq thread), {} rounds \
         x {} flows (A: {}, B: {})",
        a.rounds,
        a.flows,
        a.a.display(),
        a.b.display()
    );
    for (k, what) in [
        "empty map".to_string(),
        format!("map holding {} flows", a.flows),
    ]
    .iter()
    .enumerate()
    {
        for ((name, _), floods) in builds.iter().zip(&cpu) {
            let v = &floods[k];
            let rounds: Vec<String> = v.iter().map(|x| format!("{x:.0}")).collect();
            println!(
                "  {name} flood {} ({what})  median {:5.0} ns  rounds: {}",
                k + 1,
                median(v.clone()),
                rounds.join(" ")
            );
        }
    }
    Ok(())
}
