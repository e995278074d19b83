//! Conntrack entries: creation for a new flow (both directions, or the forward one only with
//! the reply entry deferred to the first reply: [`late_reply`]), expiry, FIN/RST handling.
use aya_ebpf::helpers::generated::{bpf_jiffies64, bpf_ktime_get_coarse_ns};
use loxi_common::{
    maps::{
        CtKey, CtValue, DEFAULT_TCP_TIMEOUT_S, DEFAULT_UDP_TIMEOUT_S, FIN_TIMEOUT_S, MAX_EPS,
        ServiceKey, ServiceValue, ct_state, ctr, dir, nat_other_key, proto,
    },
    mode,
};

use crate::{
    maps::{CLOCK, CT, ENDPOINTS, LC, REPLY_VIP, SCRATCH_KEY, count},
    parse::Pkt,
    select::hash5,
};

const BPF_ANY: u64 = 0;
const BPF_NOEXIST: u64 = 1;
const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;
/// Full-NAT source ports are taken from `PORT_BASE..PORT_BASE + PORT_SPAN`.
const PORT_BASE: u32 = 32768;
const PORT_SPAN: u32 = 28000;
const PORT_TRIES: u32 = 4;

/// Current time, ns: `CLOCK_MONOTONIC` at scheduler-tick resolution (the timekeeper's coarse
/// time, no clock-source access: idle timeouts are seconds, and the precise clock cost every
/// packet a clock-source read). Both advance with the tick, so the coarse time is read once per
/// CPU per tick ([`CLOCK`]): other packets pay one load of `jiffies` (the verifier inlines
/// `bpf_jiffies64`) instead of the timekeeper's seqlock and timespec conversion.
#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: helper without arguments.
    let j = unsafe { bpf_jiffies64() };
    let Some(c) = CLOCK.get_ptr_mut(0) else {
        // SAFETY: helper without arguments.
        return unsafe { bpf_ktime_get_coarse_ns() };
    };
    // SAFETY: per-CPU slot from the map helper (no other writer on this CPU).
    let c = unsafe { &mut *c };
    if c.jiffies != j {
        c.jiffies = j;
        // SAFETY: helper without arguments.
        c.ns = unsafe { bpf_ktime_get_coarse_ns() };
    }
    c.ns
}

/// Key of the opposite direction of the flow an entry belongs to. NAT entries: the swap of
/// the tuple they write. DSR entries rewrite nothing (their `ndaddr` is the endpoint the frame
/// is sent to), so the opposite key is the swap of their own key.
#[inline(always)]
pub fn other_key(k: &CtKey, v: &CtValue) -> CtKey {
    if v.mode == mode::DSR {
        return CtKey {
            saddr: k.daddr,
            daddr: k.saddr,
            sport: k.dport,
            dport: k.sport,
            ..*k
        };
    }
    nat_other_key(k, v)
}

/// True when the entry has been idle longer than its timeout.
#[inline(always)]
pub fn expired(v: &CtValue, t: u64) -> bool {
    t.saturating_sub(v.last_ns) > (v.timeout_s as u64) * 1_000_000_000
}

#[inline(always)]
fn lc_dec(v: &CtValue) {
    if let Some(p) = LC.get_ptr_mut(v.slot * MAX_EPS + v.ep as u32) {
        // SAFETY: valid map pointer; approximate counter.
        unsafe { *p = (*p).saturating_sub(1) };
    }
}

/// True when the entry `(pk, pv)` is the opposite direction of the flow whose entry is under
/// `k` ([`other_key`] of it is `k`): the entry a flow's close or FIN may touch. An entry under
/// that key can belong to another flow (a newer flow of the same client port that took the
/// reply key, or a reply entry left behind by a forward entry the LRU evicted).
#[inline(always)]
pub fn answers(k: &CtKey, pk: &CtKey, pv: &CtValue) -> bool {
    if pv.mode == mode::DSR {
        return pk.saddr == k.daddr
            && pk.daddr == k.saddr
            && pk.sport == k.dport
            && pk.dport == k.sport;
    }
    pv.ndaddr == k.saddr && pv.nsaddr == k.daddr && pv.ndport == k.sport && pv.nsport == k.dport
}

/// Removes a flow's entry `(k, v)` and its opposite direction when that is this flow's
/// ([`answers`]; a deferred reply entry that does not exist yet is simply not found).
/// `partner`: `None` looks the opposite entry up (after RST); `Some(answers)` is what
/// [`revive`] found for an idle entry it could not refresh, so it is not looked up twice. Its
/// own frame, with the opposite key built in a per-CPU scratch slot to keep the call chain's
/// stack small.
#[inline(never)]
pub fn close(k: &CtKey, v: &CtValue, partner: Option<bool>) {
    if partner != Some(false)
        && let Some(o) = SCRATCH_KEY.get_ptr_mut(0)
    {
        // SAFETY: per-CPU scratch slot and a map value, both from the map helpers.
        unsafe {
            *o = other_key(k, v);
            if partner == Some(true) || CT.get(&*o).is_some_and(|p| answers(k, &*o, p)) {
                let _ = CT.remove(&*o);
            }
        }
    }
    let _ = CT.remove(k);
    lc_dec(v);
}

/// What [`revive`] did with an entry found idle past its timeout.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Revive {
    /// Refreshed in place: the flow lives.
    Refreshed,
    /// Left untouched, to be closed ([`close`]); `partner`: the opposite direction's
    /// entry is this flow's ([`answers`]) and goes with it.
    Stale { partner: bool },
}

/// An entry `(k, *v)` found idle past its timeout: when the opposite direction's entry is
/// live and is this entry's opposite ([`answers`]), the flow is alive (as in the kernel's
/// conntrack, a packet in either direction keeps a flow: one direction was only quiet, e.g.
/// a UDP stream the server pushes, or this reply entry outlived an evicted forward entry of an
/// earlier flow of the same tuple): the entry is refreshed in place (a reply entry also takes
/// the forward entry's rule, endpoint and timeout): [`Revive::Refreshed`]. Otherwise the
/// entry is untouched and [`Revive::Stale`] says whether the opposite entry is this flow's.
#[inline(always)]
pub fn revive(k: &CtKey, v: *mut CtValue, t: u64) -> Revive {
    let Some(o) = SCRATCH_KEY.get_ptr_mut(0) else {
        return Revive::Stale { partner: false };
    };
    // SAFETY: per-CPU scratch slot, the pointer from the map helper the caller holds, and a
    // map value read in place.
    unsafe {
        *o = other_key(k, &*v);
        let Some(f) = CT.get(&*o) else {
            return Revive::Stale { partner: false };
        };
        let partner = answers(k, &*o, f);
        if !partner || f.dir == (*v).dir || expired(f, t) {
            return Revive::Stale { partner };
        }
        (*v).last_ns = t;
        if f.dir == dir::FWD {
            (*v).timeout_s = f.timeout_s;
            (*v).slot = f.slot;
            (*v).ep = f.ep;
        }
    }
    Revive::Refreshed
}

/// Updates an established entry for this packet's TCP flags. Returns false if the flow was
/// reset (entries removed; the packet is still forwarded with the old mapping).
#[inline(always)]
pub fn on_packet(k: &CtKey, v: *mut CtValue, pkt: &Pkt, t: u64) -> bool {
    // SAFETY: pointer from the map helper, valid for this program run.
    let v = unsafe { &mut *v };
    v.last_ns = t;
    v.packets += 1;
    v.bytes += pkt.len as u64;
    if pkt.key.proto != proto::TCP {
        return true;
    }
    if pkt.tcp_flags & TCP_RST != 0 {
        count(ctr::CT_RST, 1);
        close(k, v, None);
        return false;
    }
    if pkt.tcp_flags & TCP_FIN != 0 && v.state & ct_state::FIN == 0 {
        count(ctr::CT_FIN, 1);
        v.state |= ct_state::FIN;
        v.timeout_s = FIN_TIMEOUT_S;
        if v.dir == dir::FWD {
            lc_dec(v);
        }
        // The opposite key in the per-CPU scratch slot: a 40-byte key on the stack here would
        // sit in every frame that inlines this function.
        if let Some(o) = SCRATCH_KEY.get_ptr_mut(0) {
            // SAFETY: per-CPU scratch slot, then a pointer from the map helper.
            unsafe {
                *o = other_key(k, v);
                if let Some(e) = CT.get_ptr_mut(&*o)
                    && answers(k, &*o, &*e)
                {
                    (*e).timeout_s = FIN_TIMEOUT_S;
                }
            }
        }
    }
    true
}

/// Zeroes `packets` through the end of the value (counters, next-hop cache, padding) with
/// word stores: a run of zero stores compiles to a call of the byte-at-a-time `memset` on BPF.
#[inline(always)]
fn zero_tail(v: &mut CtValue) {
    const FROM: usize = core::mem::offset_of!(CtValue, packets);
    const WORDS: usize = (core::mem::size_of::<CtValue>() - FROM) / 8;
    const _: () = assert!(
        FROM.is_multiple_of(8) && (core::mem::size_of::<CtValue>() - FROM).is_multiple_of(8)
    );
    let p = v as *mut CtValue as *mut u8;
    let mut i = 0;
    while i < WORDS {
        // SAFETY: 8-byte-aligned words inside the value (asserted above).
        unsafe { (p.add(FROM) as *mut u64).add(i).write_volatile(0) };
        i += 1;
    }
}

/// First half of creating a new flow to endpoint row `ep_idx`: inserts the reply direction's
/// entry (DNAT to an endpoint listed for this VIP in `LOXI_REPLY_VIP`: not now, see
/// [`late_reply`]) and writes the forward value into `v` (next-hop cache empty); [`commit`]
/// inserts it.
/// False when full-NAT found no free source port (or the insert failed).
#[inline(always)]
pub fn create(
    k: &CtKey,
    pkt: &Pkt,
    svc: &ServiceValue,
    ep_idx: u32,
    t: u64,
    v: &mut CtValue,
) -> bool {
    let Some(ep) = ENDPOINTS.get(svc.slot * MAX_EPS + ep_idx) else {
        return false;
    };
    let timeout_s = match (svc.idle_timeout_s, pkt.key.proto) {
        (0, proto::TCP) => DEFAULT_TCP_TIMEOUT_S,
        (0, _) => DEFAULT_UDP_TIMEOUT_S,
        (s, _) => s,
    };
    let eport = if ep.port == 0 { pkt.key.dport } else { ep.port };
    // One value, first filled as the reply direction, then turned into the forward one.
    v.last_ns = t;
    v.nsaddr = pkt.key.daddr;
    v.ndaddr = pkt.key.saddr;
    v.nsport = pkt.key.dport;
    v.ndport = pkt.key.sport;
    v.dir = dir::REV;
    v.state = 0;
    v.ep = ep_idx as u8;
    v.mode = svc.mode;
    v.slot = svc.slot;
    v.timeout_s = timeout_s;
    // Counters 0 and an empty next-hop cache (the first packet of each direction fills it).
    zero_tail(v);
    let mut rk = *k;
    rk.saddr = ep.addr;
    rk.sport = eport;
    match svc.mode {
        mode::DSR => {
            // Replies come from the VIP itself (the endpoint owns it); when they pass through
            // us they are forwarded unchanged.
            rk.saddr = pkt.key.daddr;
            rk.sport = pkt.key.dport;
            rk.daddr = pkt.key.saddr;
            rk.dport = pkt.key.sport;
            if CT.insert(&rk, &*v, BPF_ANY).is_err() {
                return false;
            }
        }
        mode::DNAT => {
            rk.daddr = pkt.key.saddr;
            rk.dport = pkt.key.sport;
            // The reply entry waits for the first reply when the loader lists this endpoint
            // for this VIP ([`late_reply`] finds the flow from the reply); otherwise now.
            let ek = ServiceKey {
                addr: ep.addr,
                port: eport,
                proto: pkt.key.proto,
                family: pkt.key.family,
            };
            // SAFETY: read-only access to the map value.
            let defer = match unsafe { REPLY_VIP.get(&ek) } {
                Some(vip) => {
                    vip.addr == pkt.key.daddr
                        && vip.port == pkt.key.dport
                        && vip.proto == pkt.key.proto
                        && vip.family == pkt.key.family
                }
                None => false,
            };
            if defer {
                // No look under the reply key for a leftover of an earlier flow (that look was
                // a second bucket miss, ~15 % of a new flow): the loader lists only endpoints
                // that no other VIP's live flow reaches, so a leftover is of this VIP and
                // rewrites as this flow would; a stale one is replaced at the first reply
                // (`revive`, or `close` then `late_reply`: flow.rs `decide`).
                count(ctr::CT_REPLY_DEFERRED, 1);
            } else if CT.insert(&rk, &*v, BPF_ANY).is_err() {
                return false;
            }
        }
        _ => {
            // Full-NAT family (1 one-arm, 2 full-NAT, 5 host one-arm): source → LB address.
            rk.daddr = ep.snat_addr;
            let h = hash5(pkt);
            let mut i = 0;
            let mut done = false;
            while i < PORT_TRIES {
                let port = (PORT_BASE + (h.wrapping_add(i * 7919)) % PORT_SPAN) as u16;
                rk.dport = port.to_be();
                if CT.insert(&rk, &*v, BPF_NOEXIST).is_ok() {
                    done = true;
                    break;
                }
                i += 1;
            }
            if !done {
                count(ctr::DROP_CT_FULL, 1);
                return false;
            }
        }
    }
    v.dir = dir::FWD;
    v.nsaddr = pkt.key.saddr;
    v.nsport = pkt.key.sport;
    if svc.mode == mode::DSR {
        // No rewrite: the endpoint owns the VIP. `ndaddr` pins the endpoint the frames go to
        // (by MAC), so the flow survives endpoint-table changes.
        v.ndaddr = ep.addr;
        v.ndport = pkt.key.dport;
    } else {
        v.ndaddr = ep.addr;
        v.ndport = eport;
        if svc.mode != mode::DNAT {
            v.nsaddr = ep.snat_addr;
            v.nsport = rk.dport;
        }
    }
    // The forward entry counts the packet that created the flow.
    v.packets = 1;
    v.bytes = pkt.len as u64;
    true
}

/// A reply of a DNAT flow whose reply entry was deferred (see [`create`]): `pkt` (endpoint →
/// client) missed conntrack; [`REPLY_VIP`] names the VIP its endpoint serves, which gives the
/// forward key (client → VIP). When that forward entry is live and maps to this packet's
/// source, the reply entry is built from it (into `out`, as scratch) and inserted: true, and
/// the caller handles the packet as a conntrack hit on it ([`on_packet`]: counters, RST,
/// FIN). False (conntrack untouched) for any other packet.
#[inline(always)]
pub fn late_reply(pkt: &Pkt, t: u64, out: &mut CtValue) -> bool {
    let ek = ServiceKey {
        addr: pkt.key.saddr,
        port: pkt.key.sport,
        proto: pkt.key.proto,
        family: pkt.key.family,
    };
    let Some(vip) = REPLY_VIP.get_ptr(&ek) else {
        return false;
    };
    let Some(fk) = SCRATCH_KEY.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: per-CPU scratch slot and a map value, both from the map helpers (read in place:
    // no copy on the stack).
    let (fk, vip) = unsafe { (&mut *fk, &*vip) };
    fk.saddr = pkt.key.daddr;
    fk.sport = pkt.key.dport;
    fk.daddr = vip.addr;
    fk.dport = vip.port;
    fk.proto = pkt.key.proto;
    fk.family = pkt.key.family;
    fk._pad = [0; 2];
    // SAFETY: read-only copy of the map value.
    match unsafe { CT.get(&*fk) } {
        Some(f) => *out = *f,
        None => return false,
    }
    if out.dir != dir::FWD
        || out.mode != mode::DNAT
        || out.ndaddr != pkt.key.saddr
        || out.ndport != pkt.key.sport
        || expired(out, t)
    {
        return false;
    }
    // The reply value: from the VIP to the client, with the forward entry's rule, endpoint and
    // timeout (a FIN seen forward has shortened it); its own state starts empty, as an entry
    // inserted at creation does.
    out.state = 0;
    out.nsaddr = fk.daddr;
    out.nsport = fk.dport;
    out.ndaddr = pkt.key.daddr;
    out.ndport = pkt.key.dport;
    out.dir = dir::REV;
    out.last_ns = t;
    zero_tail(out);
    // Another CPU may have inserted it first from the same flow's other reply: same value.
    if CT.insert(&pkt.key, &*out, BPF_NOEXIST).is_ok() {
        count(ctr::CT_REPLY_ADDED, 1);
    }
    true
}

/// Second half of creating a new flow: inserts the forward entry `v` (from [`create`], its
/// next-hop cache filled by the caller when known) under key `k` and counts the connection for
/// its endpoint. False when the insert failed.
#[inline(always)]
pub fn commit(k: &CtKey, v: &CtValue) -> bool {
    if CT.insert(k, v, BPF_ANY).is_err() {
        return false;
    }
    if let Some(p) = LC.get_ptr_mut(v.slot * MAX_EPS + v.ep as u32) {
        // SAFETY: valid map pointer; approximate counter.
        unsafe { *p += 1 };
    }
    count(ctr::NEW_FLOW, 1);
    true
}
