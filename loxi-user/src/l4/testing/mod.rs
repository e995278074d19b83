//! Packet-table tests of the XDP program through `BPF_PROG_TEST_RUN` (root only: they load the
//! program). Each test runs in a fresh network namespace of its own thread, so FIB lookups are
//! deterministic (no route → the rewritten frame is passed to the kernel) unless the test adds
//! a veth and a permanent neighbour.
#![allow(
    unsafe_code,
    clippy::unwrap_used,
    reason = "root-only packet tests: unshare(2) per test thread; a failed setup step is a test failure"
)]

mod control;
mod packet;
mod reply;
mod selection;
mod tables;
mod tc;

use std::{net::IpAddr, process::Command};

use crate::{
    l4::{Datapath, Plan, SlotTable, plan},
    rules::{model::LbRule, store::RuleStore},
};

pub use packet::*;

pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_REDIRECT: u32 = 4;
/// Source address the full-NAT modes put on packets in these tests.
pub const LB_V4: &str = "192.168.0.254";
pub const LB_V6: &str = "fd00::fe";

/// Moves this thread into a new, empty network namespace and pins it to CPU 0 (per-CPU
/// cursors then behave deterministically).
pub fn fresh_netns() {
    // SAFETY: plain syscalls on the calling thread; arguments are valid.
    unsafe {
        assert_eq!(
            libc::unshare(libc::CLONE_NEWNET),
            0,
            "unshare(CLONE_NEWNET) needs root"
        );
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0
        );
    }
}

/// Runs `ip`/`sysctl` style commands inside this thread's namespace.
pub fn sh(cmd: &str) {
    let st = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .status()
        .expect("spawn sh");
    assert!(st.success(), "command failed: {cmd}");
}

/// The ifindex of `dev` in this thread's namespace.
pub fn ifindex(dev: &str) -> u32 {
    let out = Command::new("ip")
        .args(["-o", "link", "show", "dev", dev])
        .output()
        .expect("spawn ip");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split(':')
        .next()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no ifindex for {dev} in {text:?}"))
}

/// A veth `lbv0` (MAC 02:00:00:00:01:01, 10.0.1.1/24) holding the route to the endpoint
/// 10.0.1.2, whose MAC is a permanent neighbour entry (02:00:00:00:01:02), forwarding on. Its
/// peer `lbv1` is in this namespace (up, no XDP), or moved to the named namespace `peer_ns`
/// (created here; the caller deletes it). Returns lbv0's ifindex.
pub fn route_via_veth(peer_ns: Option<&str>) -> u32 {
    let peer = match peer_ns {
        Some(ns) => format!("ip netns add {ns} && ip link add lbv0 address 02:00:00:00:01:01 type veth peer name lbv1 netns {ns}"),
        None => "ip link add lbv0 address 02:00:00:00:01:01 type veth peer name lbv1 && ip link set lbv1 up".to_string(),
    };
    sh(&format!(
        "{peer} && ip addr add 10.0.1.1/24 dev lbv0 && ip link set lo up && ip link set lbv0 up \
        && ip neigh replace 10.0.1.2 lladdr 02:00:00:00:01:02 dev lbv0 nud permanent \
        && sysctl -qw net.ipv4.conf.all.forwarding=1"
    ));
    ifindex("lbv0")
}

/// A loaded data path with a rule store feeding it.
pub struct Lb {
    pub dp: Datapath,
    store: RuleStore,
    slots: SlotTable,
    current: Plan,
}

impl Lb {
    /// Fresh namespace, program loaded, `rules` (JSON `LbRule`s) installed.
    pub fn new(rules: &[&str]) -> Self {
        fresh_netns();
        let dp = Datapath::load().expect("load XDP object (root and the eBPF toolchain needed)");
        let mut lb = Self {
            dp,
            store: RuleStore::in_memory(),
            slots: SlotTable::default(),
            current: Plan::default(),
        };
        lb.set_rules(rules);
        lb
    }

    /// Replaces the rule set and reconciles the maps.
    pub fn set_rules(&mut self, rules: &[&str]) {
        let rules: Vec<LbRule> = rules
            .iter()
            .map(|r| serde_json::from_str(r).expect("test rule JSON"))
            .collect();
        let keep: Vec<_> = rules.iter().map(|r| r.key()).collect();
        for k in self.store.snapshot().rules.keys() {
            if !keep.contains(k) {
                self.store
                    .delete(&k.external_ip, k.port, &k.protocol, &k.host, &k.model_name)
                    .expect("delete");
            }
        }
        for rule in rules {
            // Same key keeps its rule id (an update), like the REST API.
            self.store.upsert(rule).expect("valid test rule");
        }
        let snat = |ip: IpAddr| -> Option<IpAddr> {
            Some(if ip.is_ipv4() {
                LB_V4.parse().ok()?
            } else {
                LB_V6.parse().ok()?
            })
        };
        let p = plan(&self.store.snapshot(), &mut self.slots, &snat);
        assert!(p.skipped.is_empty(), "rules left out: {:?}", p.skipped);
        self.dp.apply(&p).expect("apply plan");
        self.current = p;
    }

    /// The plan last applied.
    pub fn current(&self) -> &Plan {
        &self.current
    }

    /// (rule id, slot) of every planned service.
    pub fn plan_slots(&self) -> Vec<(u32, u32)> {
        self.current
            .services
            .values()
            .map(|s| (s.rule_id, s.value.slot))
            .collect()
    }

    /// Runs one frame through the program.
    pub fn run(&mut self, f: &Frame) -> (u32, Vec<u8>) {
        self.dp.test_run(&f.bytes()).expect("BPF_PROG_TEST_RUN")
    }

    /// Runs one frame through the TC data path (`--tc-iface`'s program) as a socket buffer.
    pub fn run_tc(&mut self, f: &Frame) -> (u32, Vec<u8>) {
        self.run_tc_bytes(&f.bytes())
    }

    /// [`Lb::run_tc`] on raw bytes (a cut frame), arriving on `lo` (the FIB lookup's input).
    pub fn run_tc_bytes(&mut self, bytes: &[u8]) -> (u32, Vec<u8>) {
        self.dp
            .test_run_tc(bytes, ifindex("lo"))
            .expect("BPF_PROG_TEST_RUN (TC)")
    }

    /// Runs one frame through the TC data path as a socket buffer whose checksum state is
    /// `CHECKSUM_COMPLETE` (a NIC's receive checksum over the whole packet, as mlx5 and most
    /// server NICs deliver): `BPF_PROG_TEST_RUN` with `BPF_F_TEST_SKB_CHECKSUM_COMPLETE`
    /// (Linux 6.11+), where the kernel sums the frame into `skb->csum` before the program and
    /// fails the run with `EBADMSG` if `skb->csum` no longer sums the frame after it. aya 0.14
    /// passes no test-run flags but XDP's, hence the raw `bpf(2)` call. Arrives on `lo`;
    /// returns (TC action, output frame).
    pub fn run_tc_checksum_complete(&mut self, f: &Frame) -> std::io::Result<(u32, Vec<u8>)> {
        use std::os::fd::{AsFd, AsRawFd};
        /// `BPF_PROG_TEST_RUN` (include/uapi/linux/bpf.h `enum bpf_cmd`).
        const BPF_PROG_TEST_RUN: libc::c_long = 10;
        /// `BPF_F_TEST_SKB_CHECKSUM_COMPLETE` (include/uapi/linux/bpf.h).
        const CHECKSUM_COMPLETE: u32 = 1 << 2;
        let frame = f.bytes();
        let mut out = vec![0u8; frame.len() + 256];
        // `struct __sk_buff` up to `ifindex`, as `Datapath::test_run_tc` gives it.
        let mut ctx = [0u8; 44];
        let lo = ifindex("lo");
        ctx[36..40].copy_from_slice(&lo.to_ne_bytes());
        ctx[40..44].copy_from_slice(&lo.to_ne_bytes());
        let prog: &mut aya::programs::SchedClassifier = self
            .dp
            .ebpf_mut()
            .program_mut(loxi_common::maps::TC_FULL_PROG_NAME)
            .expect("the TC data path program")
            .try_into()
            .expect("a classifier");
        let fd = prog.fd().expect("loaded").as_fd().as_raw_fd();
        // `union bpf_attr`'s `test` member: prog_fd, retval, data_size_in, data_size_out at 0,
        // 4, 8, 12; data_in, data_out at 16, 24; repeat, duration at 32, 36; ctx_size_in,
        // ctx_size_out at 40, 44; ctx_in, ctx_out at 48, 56; flags, cpu, batch_size at 64, 68,
        // 72 (80 bytes with padding).
        let mut attr = [0u8; 80];
        let put32 =
            |a: &mut [u8; 80], at: usize, v: u32| a[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        let put64 =
            |a: &mut [u8; 80], at: usize, v: u64| a[at..at + 8].copy_from_slice(&v.to_ne_bytes());
        put32(&mut attr, 0, fd as u32);
        put32(&mut attr, 8, frame.len() as u32);
        put32(&mut attr, 12, out.len() as u32);
        put64(&mut attr, 16, frame.as_ptr() as u64);
        put64(&mut attr, 24, out.as_mut_ptr() as u64);
        put32(&mut attr, 32, 1);
        put32(&mut attr, 40, ctx.len() as u32);
        put64(&mut attr, 48, ctx.as_ptr() as u64);
        put32(&mut attr, 64, CHECKSUM_COMPLETE);
        // SAFETY: `attr` is a valid `bpf_attr` prefix of its stated size; the buffers it points
        // to (`frame`, `out`, `ctx`) outlive the call and have the sizes given.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_PROG_TEST_RUN,
                attr.as_mut_ptr(),
                attr.len() as libc::c_uint,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        out.truncate(u32::from_ne_bytes([attr[12], attr[13], attr[14], attr[15]]) as usize);
        Ok((
            u32::from_ne_bytes([attr[4], attr[5], attr[6], attr[7]]),
            out,
        ))
    }

    /// Counter value (`loxi_common::maps::ctr`).
    pub fn ctr(&self, idx: u32) -> u64 {
        self.dp.counter(idx).expect("counter")
    }

    /// Moves the idle clock of the conntrack entry under `k` back past its timeout, as if no
    /// packet had refreshed it since (the program then finds it expired).
    pub fn age_out(&mut self, k: &loxi_common::maps::CtKey) {
        let mut ct = self.ct_map();
        let mut v = ct.get(k, 0).expect("entry to age");
        v.last_ns -= (u64::from(v.timeout_s) + 1) * 1_000_000_000;
        ct.insert(k, v, 0).expect("aged entry written back");
    }

    /// Removes the conntrack entry under `k` alone, as the LRU evicts one entry.
    pub fn evict(&mut self, k: &loxi_common::maps::CtKey) {
        self.ct_map().remove(k).expect("entry to evict");
    }

    /// Every entry in the conntrack map, idle-expired ones included.
    pub fn stored(&mut self) -> usize {
        self.ct_map().keys().count()
    }

    fn ct_map(
        &mut self,
    ) -> aya::maps::HashMap<
        &mut aya::maps::MapData,
        loxi_common::maps::CtKey,
        loxi_common::maps::CtValue,
    > {
        let map = self
            .dp
            .ebpf_mut()
            .map_mut(loxi_common::maps::MAP_CONNTRACK)
            .expect("conntrack map");
        aya::maps::HashMap::try_from(map).expect("conntrack map type")
    }

    /// The live conntrack entries, as `GET /config/conntrack/all` reads them.
    pub fn ct(&self) -> Vec<(loxi_common::maps::CtKey, loxi_common::maps::CtValue)> {
        let h = crate::l4::ConntrackHandle::default();
        h.publish(self.dp.conntrack_map_id().expect("conntrack map id"));
        h.read(1024)
            .expect("read conntrack")
            .expect("published")
            .entries
    }
}

/// A rule JSON with endpoints `eps` (IP, weight) on port 8080 (in DSR, mode 3, on the VIP's
/// port: the API refuses another).
pub fn rule(vip: &str, port: u16, proto: &str, mode: u8, sel: u8, eps: &[(&str, u32)]) -> String {
    let target = if mode == loxi_common::mode::DSR {
        port
    } else {
        8080
    };
    let eps: Vec<String> = eps
        .iter()
        .map(|(ip, w)| format!(r#"{{"endpointIP":"{ip}","targetPort":{target},"weight":{w}}}"#))
        .collect();
    format!(
        r#"{{"serviceArguments":{{"externalIP":"{vip}","port":{port},"protocol":"{proto}","mode":{mode},"sel":{sel}}},"endpoints":[{}]}}"#,
        eps.join(",")
    )
}

/// Destination address of an output frame (no VLAN).
pub fn dst_of(out: &[u8]) -> IpAddr {
    match u16::from_be_bytes([out[12], out[13]]) {
        0x0800 => IpAddr::from(<[u8; 4]>::try_from(&out[30..34]).unwrap()),
        _ => IpAddr::from(<[u8; 16]>::try_from(&out[38..54]).unwrap()),
    }
}

/// Source port of an IPv4 output frame without options or VLAN.
pub fn sport_v4(out: &[u8]) -> u16 {
    u16::from_be_bytes([out[34], out[35]])
}
