//! Every map of the program, each with its purpose. Names and layouts: `loxi_common::maps`.
use crate::fwd::EpNextHop;
use aya_ebpf::{
    macros::map,
    maps::{Array, DevMapHash, HashMap, LruHashMap, PerCpuArray},
};
use loxi_common::maps::{
    CT_ENTRIES, CtKey, CtValue, EndpointValue, MAX_EGRESS, MAX_EPS, MAX_REPLY_VIPS, MAX_RULES,
    ServiceKey, ServiceValue, WRR_SLOTS, ctr,
};

/// (VIP, port, proto) → rule, written by the loader.
#[map(name = "LOXI_SERVICES")]
pub static SERVICES: HashMap<ServiceKey, ServiceValue> = HashMap::with_max_entries(MAX_RULES, 0);

/// Endpoint rows, `slot * MAX_EPS + i`, written by the loader.
#[map(name = "LOXI_ENDPOINTS")]
pub static ENDPOINTS: Array<EndpointValue> = Array::with_max_entries(MAX_RULES * MAX_EPS, 0);

/// Conntrack, one entry per direction of every flow; a deferred DNAT flow has its reply entry
/// from its first reply on (LRU evicts the oldest when full).
#[map(name = "LOXI_CT")]
pub static CT: LruHashMap<CtKey, CtValue> = LruHashMap::with_max_entries(CT_ENTRIES, 0);

/// DNAT endpoint (address, port, protocol as replies leave it) → the VIP whose flows to it
/// insert their reply entry at the first reply, written by the loader
/// (`loxi_common::maps::MAP_REPLY_VIP`).
#[map(name = "LOXI_REPLY_VIP")]
pub static REPLY_VIP: HashMap<ServiceKey, ServiceKey> =
    HashMap::with_max_entries(MAX_REPLY_VIPS, 0);

/// Per-CPU round-robin / wrr cursor per rule slot.
#[map(name = "LOXI_RR")]
pub static RR: PerCpuArray<u32> = PerCpuArray::with_max_entries(MAX_RULES, 0);

/// Active endpoint rows per rule slot (first `nact` entries used).
#[map(name = "LOXI_ACTIVE")]
pub static ACTIVE: Array<[u8; WRR_SLOTS as usize]> = Array::with_max_entries(MAX_RULES, 0);

/// Weighted round-robin table per rule slot: endpoint rows repeated by weight.
#[map(name = "LOXI_WRR")]
pub static WRR: Array<[u8; WRR_SLOTS as usize]> = Array::with_max_entries(MAX_RULES, 0);

/// Open connections per endpoint row (approximate: non-atomic, for lc).
#[map(name = "LOXI_LC")]
pub static LC: Array<u32> = Array::with_max_entries(MAX_RULES * MAX_EPS, 0);

/// Per-CPU scratch conntrack key (keeps large keys off the small BPF stack).
#[map(name = "LOXI_SCRATCH")]
pub static SCRATCH_KEY: PerCpuArray<CtKey> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU scratch conntrack value: the mapping the slow path decides on (a 104-byte value
/// stays off the BPF stack, and needs no zero-fill).
#[map(name = "LOXI_SCRATCH_CT")]
pub static SCRATCH_CT: PerCpuArray<CtValue> = PerCpuArray::with_max_entries(1, 0);

/// Egress interfaces that take XDP frames (ifindex → that device), written by the loader; any
/// other egress gets the TC hand-off (`loxi_common::maps::egress`). A device map, so a frame is
/// redirected with `bpf_redirect_map` (the device pointer comes from the map) instead of
/// `bpf_redirect`, whose ifindex the kernel resolves again for every frame.
#[map(name = "LOXI_EGRESS_XDP")]
pub static EGRESS_XDP: DevMapHash = DevMapHash::with_max_entries(MAX_EGRESS, 0);

/// Egress veths whose peer is in another namespace (ifindex → 1), written by the loader: the TC
/// data path sends to them with `bpf_redirect_peer` (`loxi_common::maps::MAP_EGRESS_PEER`).
#[map(name = "LOXI_EGRESS_PEER")]
pub static EGRESS_PEER: HashMap<u32, u8> = HashMap::with_max_entries(MAX_EGRESS, 0);

/// Next hop per endpoint row (`slot * MAX_EPS + i`): the last FIB lookup towards the row's
/// address, so a new flow to the endpoint needs none while it is fresh ([`crate::fwd::EpNextHop`]).
#[map(name = "LOXI_EP_NH")]
pub static EP_NH: Array<EpNextHop> = Array::with_max_entries(MAX_RULES * MAX_EPS, 0);

/// Per-CPU clock cache of [`crate::ct::now`]: the tick (`jiffies`) of the last coarse-time read
/// and the time it returned.
#[map(name = "LOXI_CLOCK")]
pub static CLOCK: PerCpuArray<TickTime> = PerCpuArray::with_max_entries(1, 0);

/// Value of [`CLOCK`].
#[repr(C)]
pub struct TickTime {
    /// `jiffies` when `ns` was read (0 = never).
    pub jiffies: u64,
    /// `bpf_ktime_get_coarse_ns()` read during that tick.
    pub ns: u64,
}

/// Per-CPU counters, indices in `loxi_common::maps::ctr`.
#[map(name = "LOXI_COUNTERS")]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(ctr::LEN, 0);

/// Adds `n` to counter `idx`.
#[inline(always)]
pub fn count(idx: u32, n: u64) {
    if let Some(p) = COUNTERS.get_ptr_mut(idx) {
        // SAFETY: per-CPU slot, valid pointer from the map helper.
        unsafe { *p += n };
    }
}

/// Counts one packet of `bytes` for endpoint row (slot, ep).
#[inline(always)]
pub fn count_ep(slot: u32, ep: u32, bytes: u64) {
    if slot < MAX_RULES && ep < MAX_EPS {
        let i = ctr::ep_packets(slot, ep);
        count(i, 1);
        count(i + 1, bytes);
    }
}
