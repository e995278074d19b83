//! Map layouts shared by the XDP program (`loxi-ebpf`) and the userspace loader (`loxi_user::l4`).
//!
//! Every address is 16 bytes of raw network-order bytes (IPv4 in the first 4, the rest zero);
//! every port is a raw network-order `u16` as it sits in the packet (`u16::from_ne_bytes` of the
//! two wire bytes). Layouts are `#[repr(C)]` with explicit padding so the kernel and userspace
//! agree byte for byte; flags are integers, never `bool`.

/// Name of the XDP program inside the object.
pub const PROG_NAME: &str = "loxi_xdp";
/// Name of the pass-everything program (for veth peers that must run XDP to receive redirects).
pub const PASS_PROG_NAME: &str = "loxi_pass";
/// Name of the program that drops every IPv4/IPv6 frame and passes the rest (the packet sink
/// of `scripts/bench-l4.sh`).
pub const DROP_PROG_NAME: &str = "loxi_drop";
/// Service map: [`ServiceKey`] → [`ServiceValue`] (hash).
pub const MAP_SERVICES: &str = "LOXI_SERVICES";
/// Endpoint table: index `slot * MAX_EPS + i` → [`EndpointValue`] (array).
pub const MAP_ENDPOINTS: &str = "LOXI_ENDPOINTS";
/// Conntrack: [`CtKey`] → [`CtValue`] (LRU hash), one entry per direction. A DNAT flow to an
/// endpoint listed in [`MAP_REPLY_VIP`] for its VIP gets its reply entry at its first reply
/// instead of at creation (one insert per flow that never answers).
pub const MAP_CONNTRACK: &str = "LOXI_CT";
/// Reply VIPs: a DNAT endpoint as replies leave it ([`ServiceKey`] of the endpoint's address,
/// its port — the service port when the rule gives none — and protocol) → the one VIP
/// ([`ServiceKey`]) whose flows to it defer their reply entry (hash, loader-written, at most
/// [`MAX_REPLY_VIPS`]). A reply that misses conntrack finds its flow's forward entry through
/// it. The loader lists an endpoint only while the DNAT rules of exactly one VIP have it and
/// no live conntrack entry ties it to another VIP, so an entry under a deferred flow's reply
/// key is of the same VIP and the program does not look for one; it retires an entry at once
/// when another VIP gains the endpoint, and 2 s after the plans stop giving it to the VIP
/// (both later when a conntrack walk is cut off: `loxi-user/src/l4/reply.rs`). An endpoint
/// without an entry, or whose entry names another VIP, gets both entries at creation.
pub const MAP_REPLY_VIP: &str = "LOXI_REPLY_VIP";
/// Most entries of [`MAP_REPLY_VIP`].
pub const MAX_REPLY_VIPS: u32 = MAX_RULES * MAX_EPS;
/// Per-CPU round-robin cursors, one `u32` per rule slot.
pub const MAP_RR: &str = "LOXI_RR";
/// Live connection count per endpoint (index `slot * MAX_EPS + i`), for `sel` 4 (lc).
pub const MAP_LC: &str = "LOXI_LC";
/// Active endpoint rows per rule slot (`[u8; WRR_SLOTS]`, first `nact` used).
pub const MAP_ACTIVE: &str = "LOXI_ACTIVE";
/// Weighted round-robin table per rule slot (`[u8; WRR_SLOTS]` of endpoint rows).
pub const MAP_WRR: &str = "LOXI_WRR";
/// Per-CPU `u64` counters; indices in [`ctr`].
pub const MAP_COUNTERS: &str = "LOXI_COUNTERS";
/// Egress interfaces known to take XDP frames: ifindex (`u32`) → that device (a
/// `BPF_MAP_TYPE_DEVMAP_HASH`, loader-written; the data path redirects through it with
/// `bpf_redirect_map`). A rewritten packet for any other egress goes out through
/// [`TC_PROG_NAME`] instead of a redirect or `XDP_TX` (see [`egress`]).
pub const MAP_EGRESS_XDP: &str = "LOXI_EGRESS_XDP";
/// Egress veths whose peer is in another network namespace: ifindex (`u32`) → 1 (`u8`), a
/// hash written by the loader from its link dump at every stats tick. The TC data path
/// (`--tc-iface`) and the hand-off program send a rewritten socket buffer for such an egress
/// with `bpf_redirect_peer`:
/// straight into the peer's ingress in its namespace, without the egress veth's transmit and
/// the CPU's backlog queue (what Cilium does for pods). The LB namespace's egress hooks on that
/// veth (its qdisc, TC egress, netfilter) are not run for those frames.
pub const MAP_EGRESS_PEER: &str = "LOXI_EGRESS_PEER";
/// Name of the TC ingress program that finishes forwarding for egresses without XDP receive.
pub const TC_PROG_NAME: &str = "loxi_tc";
/// Name of the TC ingress program that runs the whole data path on the socket buffer (the XDP
/// program's service lookup, conntrack, NAT and forwarding, sent with `bpf_redirect`), for
/// interfaces attached with `--tc-iface` instead of XDP.
pub const TC_FULL_PROG_NAME: &str = "loxi_tc_full";
/// Most entries of [`MAP_EGRESS_XDP`].
pub const MAX_EGRESS: u32 = 4096;

/// The XDP → TC hand-off for egress interfaces that cannot take XDP frames.
///
/// `bpf_redirect` and `XDP_TX` hand the kernel an XDP frame; a veth delivers such a frame only
/// when its peer has NAPI running (an XDP program, or GRO switched on, on the peer), and
/// silently drops it otherwise — which is exactly how container and Kubernetes backends are
/// attached. For those egresses the XDP program rewrites the packet (addresses, ports, MACs)
/// as usual, prepends [`Meta`] as XDP metadata and passes the frame up; the TC ingress program
/// on the same interface finds the metadata and `bpf_redirect`s the socket buffer to the
/// egress, which works for every device.
pub mod egress {
    /// [`Meta::magic`] value.
    pub const META_MAGIC: u32 = 0x6c78_6931;
    /// Metadata the XDP program leaves in front of the frame for the TC program.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Meta {
        /// [`META_MAGIC`].
        pub magic: u32,
        /// Egress interface index.
        pub ifindex: u32,
    }
    /// Size of [`Meta`] in bytes (a multiple of 4, as `bpf_xdp_adjust_meta` requires).
    pub const META_LEN: usize = core::mem::size_of::<Meta>();
    /// The program's read-only global (a `u8`) the loader sets to 1 when the kernel lets XDP
    /// programs call `bpf_xdp_adjust_meta` (Linux 6.18 as this project's VMs run it refuses:
    /// "program of this type cannot use helper bpf_xdp_adjust_meta#54"). At 0 the verifier
    /// prunes the call, and the hand-off goes without [`Meta`]: the XDP program passes the
    /// rewritten frame up as is, and the TC program knows it by the frame's MACs, which are
    /// exactly what the same FIB lookup gives (from the egress to the next hop, so the stack
    /// saw a frame for another host), and redirects it to that lookup's egress.
    pub const GLOBAL_META_OK: &str = "LOXI_META_OK";
}

/// Most rules the data path holds at once (rule slots `0..MAX_RULES`).
pub const MAX_RULES: u32 = 256;
/// Most endpoints per rule (endpoint indices `0..MAX_EPS`).
pub const MAX_EPS: u32 = 16;
/// Length of a rule's wrr table (power of two).
pub const WRR_SLOTS: u32 = 64;
/// Conntrack capacity (entries; two per answered flow, one per DNAT flow that has not answered
/// yet when its reply entry is deferred, see [`MAP_REPLY_VIP`]).
pub const CT_ENTRIES: u32 = 65536;

/// Address family flag values of [`CtKey::family`] and [`ServiceKey::family`].
pub mod family {
    /// IPv4.
    pub const V4: u8 = 4;
    /// IPv6.
    pub const V6: u8 = 6;
}

/// IP protocol numbers the data path understands.
pub mod proto {
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// SCTP (ports only; the CRC32c checksum is not rewritten, so SCTP is DSR-only).
    pub const SCTP: u8 = 132;
}

/// Counter indices into [`MAP_COUNTERS`]. Globals first, then two per endpoint.
pub mod ctr {
    /// Packets the program saw.
    pub const RX: u32 = 0;
    /// Packets passed to the kernel stack untouched (no service, not IP, mode 4, …).
    pub const PASS: u32 = 1;
    /// Dropped: headers cut short (truncated frame).
    pub const DROP_TRUNCATED: u32 = 2;
    /// Dropped: service has no active endpoint.
    pub const DROP_NO_ENDPOINT: u32 = 3;
    /// Dropped: conntrack insert failed (full-NAT port clash after retries).
    pub const DROP_CT_FULL: u32 = 4;
    /// New flows created (endpoint selected).
    pub const NEW_FLOW: u32 = 5;
    /// Packets NATed client → endpoint.
    pub const NAT_FWD: u32 = 6;
    /// Packets NATed endpoint → client (reply path).
    pub const NAT_REV: u32 = 7;
    /// Packets sent with `XDP_TX` (out the ingress interface).
    pub const TX: u32 = 8;
    /// Packets sent with `bpf_redirect` to another interface.
    pub const REDIRECT: u32 = 9;
    /// Rewritten packets handed to the kernel (no FIB/neighbour entry yet).
    pub const FIB_PASS: u32 = 10;
    /// Flows closed by TCP RST.
    pub const CT_RST: u32 = 11;
    /// Flows that saw a TCP FIN (short timeout from then on).
    pub const CT_FIN: u32 = 12;
    /// Conntrack entries found expired (idle timeout) and replaced.
    pub const CT_EXPIRED: u32 = 13;
    /// Packets forwarded by DSR (MAC rewrite only).
    pub const DSR: u32 = 14;
    /// Rewritten packets handed to the TC program (egress takes no XDP frames).
    pub const EGRESS_TC: u32 = 15;
    /// Packets the TC program redirected to their egress.
    pub const TC_REDIRECT: u32 = 16;
    /// Packets for a no-XDP egress whose driver refused XDP metadata: redirected anyway.
    pub const EGRESS_NO_META: u32 = 17;
    /// New DNAT flows created with their forward entry only (the reply entry waits for the
    /// first reply, see [`super::MAP_REPLY_VIP`]).
    pub const CT_REPLY_DEFERRED: u32 = 18;
    /// Reply entries inserted at a deferred flow's first reply.
    pub const CT_REPLY_ADDED: u32 = 19;
    /// Socket buffers a TC program sent into a veth peer's namespace with `bpf_redirect_peer`
    /// (also counted in [`REDIRECT`] or [`TX`] by the TC data path, in [`TC_REDIRECT`] by the
    /// hand-off program).
    pub const REDIRECT_PEER: u32 = 20;
    /// Number of global counters; endpoint counters start here.
    pub const GLOBALS: u32 = 24;
    /// Counter index of endpoint `(slot, ep)` packets; `+1` is its bytes.
    pub const fn ep_packets(slot: u32, ep: u32) -> u32 {
        GLOBALS + (slot * super::MAX_EPS + ep) * 2
    }
    /// Total size of the counter array.
    pub const LEN: u32 = GLOBALS + super::MAX_RULES * super::MAX_EPS * 2;
}

/// Service map key: (VIP, port, protocol) as they appear in a client's packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceKey {
    /// VIP, raw network-order bytes.
    pub addr: [u8; 16],
    /// Service port, raw network order.
    pub port: u16,
    /// IP protocol ([`proto`]).
    pub proto: u8,
    /// Address family ([`family`]).
    pub family: u8,
}

/// Service map value: the rule the data path applies.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    /// Rule slot: row of the endpoint table, RR cursor and counters (`0..MAX_RULES`).
    pub slot: u32,
    /// NAT mode (`loxi_common::mode`).
    pub mode: u8,
    /// Selector (`loxi_common::sel`; 0 rr, 1 hash, 2 wrr, 3 persist, 4 lc).
    pub sel: u8,
    /// Endpoint rows in use (`0..=MAX_EPS`).
    pub nep: u8,
    /// Active rows listed in the rule's `MAP_ACTIVE` entry (0 = no endpoint takes new flows).
    pub nact: u8,
    /// Idle timeout of an established flow, seconds.
    pub idle_timeout_s: u32,
    /// Entries used in the rule's wrr table (`1..=WRR_SLOTS`; 0 = plain rr).
    pub wrr_len: u32,
}

/// Endpoint table row.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointValue {
    /// Endpoint address, raw network-order bytes.
    pub addr: [u8; 16],
    /// Source address full-NAT / one-arm modes put on packets to this endpoint (the LB's own
    /// address on the route towards it).
    pub snat_addr: [u8; 16],
    /// Endpoint port, raw network order (0 = keep the service port).
    pub port: u16,
    /// Weight for wrr (≥ 1).
    pub weight: u16,
    /// 1 = may receive new flows; 0 = draining (existing flows continue via conntrack).
    pub active: u8,
    /// Padding.
    pub _pad: [u8; 3],
}

/// Conntrack key: a packet's tuple as it arrives at the LB.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey {
    /// Source address.
    pub saddr: [u8; 16],
    /// Destination address.
    pub daddr: [u8; 16],
    /// Source port (raw network order).
    pub sport: u16,
    /// Destination port (raw network order).
    pub dport: u16,
    /// IP protocol.
    pub proto: u8,
    /// Address family.
    pub family: u8,
    /// Padding.
    pub _pad: [u8; 2],
}

/// Conntrack value: the tuple to write into the packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtValue {
    /// `bpf_ktime_get_coarse_ns()` (`CLOCK_MONOTONIC` at scheduler-tick resolution; the data
    /// path reads it once per CPU per tick) of the last packet of this direction.
    pub last_ns: u64,
    /// New source address.
    pub nsaddr: [u8; 16],
    /// New destination address.
    pub ndaddr: [u8; 16],
    /// New source port.
    pub nsport: u16,
    /// New destination port.
    pub ndport: u16,
    /// [`dir`] of this entry.
    pub dir: u8,
    /// [`ct_state`] bits.
    pub state: u8,
    /// Endpoint index chosen for the flow.
    pub ep: u8,
    /// Mode of the rule at flow creation.
    pub mode: u8,
    /// Rule slot at flow creation.
    pub slot: u32,
    /// Idle timeout, seconds.
    pub timeout_s: u32,
    /// Packets seen in this direction (approximate under concurrent CPUs: plain adds).
    pub packets: u64,
    /// Bytes (whole frames, Ethernet header included) seen in this direction.
    pub bytes: u64,
    /// Next-hop cache of this direction: time of the FIB lookup that filled it (same clock as
    /// `last_ns`; 0 = empty). Packets of an established flow reuse it for [`NH_TTL_NS`] instead
    /// of looking the route and neighbour up again.
    pub nh_ns: u64,
    /// Cached egress interface index.
    pub nh_ifindex: u32,
    /// Cached egress interface MAC (the frame's new source MAC).
    pub nh_smac: [u8; 6],
    /// Cached next-hop MAC (the frame's new destination MAC).
    pub nh_dmac: [u8; 6],
    /// [`nh_flags`] bits of the cached next hop.
    pub nh_flags: u8,
    /// Padding.
    pub _pad: [u8; 7],
}

/// Key of the opposite direction of a NAT entry `(k, v)` (every mode but DSR): the swap of the
/// tuple `v` writes. For a DNAT forward entry that is its reply key (endpoint → client).
#[inline(always)]
pub fn nat_other_key(k: &CtKey, v: &CtValue) -> CtKey {
    CtKey {
        saddr: v.ndaddr,
        daddr: v.nsaddr,
        sport: v.ndport,
        dport: v.nsport,
        proto: k.proto,
        family: k.family,
        _pad: [0; 2],
    }
}

/// Bits of [`CtValue::nh_flags`].
pub mod nh_flags {
    /// The egress takes XDP frames (`bpf_redirect`/`XDP_TX`); else the TC hand-off.
    pub const XDP_OK: u8 = 1;
    /// The egress is a veth whose peer is in another network namespace
    /// ([`super::MAP_EGRESS_PEER`]): the TC data path sends with `bpf_redirect_peer`.
    pub const PEER: u8 = 2;
}

/// How long a flow's cached next hop ([`CtValue::nh_ns`]) is used before the route and the
/// neighbour are looked up again, ns: a changed route or neighbour MAC reaches an established
/// flow within this time. New flows to an endpoint reuse the endpoint's last lookup for as long
/// (the data path's `LOXI_EP_NH`), so the change reaches them within this time too.
pub const NH_TTL_NS: u64 = 1_000_000_000;

/// Direction values of [`CtValue::dir`].
pub mod dir {
    /// Client → endpoint.
    pub const FWD: u8 = 0;
    /// Endpoint → client.
    pub const REV: u8 = 1;
}

/// Bits of [`CtValue::state`].
pub mod ct_state {
    /// A FIN was seen in this direction.
    pub const FIN: u8 = 1;
}

/// Idle timeout after a FIN, seconds.
pub const FIN_TIMEOUT_S: u32 = 10;
/// Default idle timeout for TCP flows when the rule sets none, seconds.
pub const DEFAULT_TCP_TIMEOUT_S: u32 = 300;
/// Default idle timeout for UDP flows when the rule sets none, seconds.
pub const DEFAULT_UDP_TIMEOUT_S: u32 = 60;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all types are #[repr(C)] plain integers/arrays with explicit padding fields, so
    // every bit pattern is valid and there are no implicit padding bytes.
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker; see SAFETY above")]
    unsafe impl aya::Pod for super::ServiceKey {}
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker; see SAFETY above")]
    unsafe impl aya::Pod for super::ServiceValue {}
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker; see SAFETY above")]
    unsafe impl aya::Pod for super::EndpointValue {}
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker; see SAFETY above")]
    unsafe impl aya::Pod for super::CtKey {}
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker; see SAFETY above")]
    unsafe impl aya::Pod for super::CtValue {}
}

const _: () = assert!(core::mem::size_of::<ServiceKey>() == 20);
const _: () = assert!(core::mem::size_of::<ServiceValue>() == 16);
const _: () = assert!(core::mem::size_of::<EndpointValue>() == 40);
const _: () = assert!(core::mem::size_of::<CtKey>() == 40);
const _: () = assert!(core::mem::size_of::<CtValue>() == 104);
