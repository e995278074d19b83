//! Per-packet decision. Fast path, inline: a conntrack hit on a live entry whose next hop is
//! cached (younger than `NH_TTL_NS`) and, for TCP, no FIN/RST → counters, rewrite, MAC rewrite,
//! send: one hash lookup, no FIB lookup, no copy of the entry. New flows to a service: select,
//! insert the reply direction's entry (or defer it to the first reply, DNAT: [`ct::late_reply`],
//! which a reply that misses conntrack tries before passing), take the next hop towards the
//! endpoint (the endpoint's
//! cached FIB lookup while fresh), insert the forward entry with that next hop already cached
//! (the flow's next packets take the fast path; no lookup of the new entry), rewrite, send.
//! Slow path: expired or closing entries and stale next hops → rewrite, FIB lookup, cache the
//! next hop in the entry; anything else → pass.
//!
//! Code that touches packet memory is inlined into the entry function (the verifier tracks
//! packet pointers only within one frame); the map-heavy decision of the slow path runs in its
//! own frame ([`decide`]) so the two stacks stay under the 512-byte limit together.
use core::ptr::addr_of_mut;

use loxi_common::{
    maps::{CtKey, CtValue, NH_TTL_NS, ServiceKey, ctr, dir, proto},
    mode,
};

use crate::{
    csum::rewrite,
    ct,
    fwd::{endpoint_next_hop, lookup},
    hook::Hook,
    maps::{CT, SCRATCH_CT, SERVICES, count, count_ep},
    parse::{ParseError, Pkt, parse},
    select::select,
};

/// What [`decide`] concluded.
const V_PASS: u32 = 0;
const V_DROP: u32 = 1;
const V_APPLY: u32 = 2;
/// A new flow: reply entry inserted (or deferred), forward value in `out`, to [`open`].
const V_NEW: u32 = 3;

const TCP_FIN_RST: u8 = 0x01 | 0x04;

/// The program body; `Err` means "drop" (only for truncated frames).
#[inline(always)]
pub fn try_loxi<C: Hook>(ctx: &C) -> Result<u32, u32> {
    count(ctr::RX, 1);
    let pkt = match parse(ctx) {
        Ok(p) => p,
        Err(ParseError::NotOurs) => return Ok(pass::<C>()),
        Err(ParseError::Truncated) => return Err(truncated::<C>()),
    };
    let t = ct::now();
    let mut hit = false;
    if let Some(v) = CT.get_ptr_mut(&pkt.key) {
        hit = true;
        // SAFETY: pointer from the map helper, valid for this program run.
        let v = unsafe { &mut *v };
        if fast_ok(v, &pkt, t) {
            return finish::<C>(fast(ctx, &pkt, v, t));
        }
    }
    let Some(out) = SCRATCH_CT.get_ptr_mut(0) else {
        return Ok(pass::<C>());
    };
    // SAFETY: per-CPU scratch slot from the map helper.
    let out = unsafe { &mut *out };
    match decide(&pkt, hit, t, out) {
        V_PASS => Ok(pass::<C>()),
        V_APPLY => finish::<C>(apply(ctx, &pkt, out, t)),
        V_NEW => finish::<C>(open(ctx, &pkt, out, t)),
        _ => Ok(C::DROP),
    }
}

#[inline(always)]
fn finish<C: Hook>(r: Result<u32, ParseError>) -> Result<u32, u32> {
    match r {
        Ok(a) => Ok(a),
        Err(ParseError::NotOurs) => Ok(pass::<C>()),
        Err(ParseError::Truncated) => Err(truncated::<C>()),
    }
}

#[inline(always)]
fn pass<C: Hook>() -> u32 {
    count(ctr::PASS, 1);
    C::PASS
}

#[inline(always)]
fn truncated<C: Hook>() -> u32 {
    count(ctr::DROP_TRUNCATED, 1);
    C::DROP
}

/// True when the packet can take the fast path: live entry, cached next hop still fresh, and
/// no TCP flag that changes the entry's state.
#[inline(always)]
fn fast_ok(v: &CtValue, pkt: &Pkt, t: u64) -> bool {
    v.nh_ns != 0
        && t.wrapping_sub(v.nh_ns) < NH_TTL_NS
        && !ct::expired(v, t)
        && (pkt.key.proto != proto::TCP || pkt.tcp_flags & TCP_FIN_RST == 0)
}

/// Established flow with a cached next hop: update the entry in place, rewrite, send.
#[inline(always)]
fn fast<C: Hook>(ctx: &C, pkt: &Pkt, v: &mut CtValue, t: u64) -> Result<u32, ParseError> {
    v.last_ns = t;
    v.packets += 1;
    v.bytes += pkt.len as u64;
    rewrite_for(ctx, pkt, v)?;
    ctx.send(v.nh_ifindex, &v.nh_smac, &v.nh_dmac, v.nh_flags)
}

/// Counts the packet for its endpoint and writes the entry's tuple into it (DSR: nothing to
/// rewrite).
#[inline(always)]
fn rewrite_for<C: Hook>(ctx: &C, pkt: &Pkt, v: &CtValue) -> Result<(), ParseError> {
    count_ep(v.slot, v.ep as u32, pkt.len as u64);
    if v.mode == mode::DSR {
        // Forward: the route to the endpoint (`ndaddr`) gives its MAC; the IP header stays
        // (dst = VIP). Reply: on to the client unchanged.
        count(ctr::DSR, 1);
        return Ok(());
    }
    rewrite(ctx, pkt, &v.nsaddr, &v.ndaddr, v.nsport, v.ndport)?;
    count(
        if v.dir == dir::FWD {
            ctr::NAT_FWD
        } else {
            ctr::NAT_REV
        },
        1,
    );
    Ok(())
}

/// Slow path: conntrack entry (expired, closing, or next hop to refresh), or a new flow to a
/// service; fills `out` with the mapping to apply. `hit`: the fast path found an entry.
#[inline(never)]
fn decide(pkt: &Pkt, hit: bool, t: u64, out: &mut CtValue) -> u32 {
    let key = &pkt.key;
    // Conntrack before services, as when both entries are inserted at creation: a miss may be
    // the first reply of a flow that deferred its reply entry (also when the client's address
    // and port are themselves a service); then that entry exists now and the packet is a hit.
    let hit = hit || ct::late_reply(pkt, t, out);
    let Some(mut v) = hit.then(|| CT.get_ptr_mut(key)).flatten() else {
        return new_flow(pkt, key, t, out);
    };
    // SAFETY: pointer from the map helper; copied out before any delete.
    *out = unsafe { *v };
    if ct::expired(out, t) {
        // A direction lives as long as its flow's other direction does: only quiet, or (a
        // reply entry) left behind by an earlier flow of this tuple whose forward entry the
        // LRU evicted.
        if let ct::Revive::Stale { partner } = ct::revive(key, v, t) {
            count(ctr::CT_EXPIRED, 1);
            ct::close(key, out, Some(partner));
            if out.dir == dir::FWD {
                return new_flow(pkt, key, t, out);
            }
            // The stale entry may have stood in front of a deferred flow's first reply.
            if !ct::late_reply(pkt, t, out) {
                return V_PASS;
            }
            match CT.get_ptr_mut(key) {
                Some(p) => v = p,
                None => return V_PASS,
            }
        } else {
            // SAFETY: as above (refreshed in place).
            *out = unsafe { *v };
        }
    }
    ct::on_packet(key, v, pkt, t);
    V_APPLY
}

#[inline(always)]
fn new_flow(pkt: &Pkt, key: &CtKey, t: u64, out: &mut CtValue) -> u32 {
    let sk = ServiceKey {
        addr: pkt.key.daddr,
        port: pkt.key.dport,
        proto: pkt.key.proto,
        family: pkt.key.family,
    };
    // SAFETY: read-only copy of the map value.
    let svc = match unsafe { SERVICES.get(&sk) } {
        Some(s) => *s,
        None => return V_PASS,
    };
    if svc.mode == mode::FULLPROXY {
        return V_PASS;
    }
    let Some(idx) = select(&svc, pkt) else {
        count(ctr::DROP_NO_ENDPOINT, 1);
        return V_DROP;
    };
    if ct::create(key, pkt, &svc, idx, t, out) {
        V_NEW
    } else {
        V_DROP
    }
}

/// A new flow's second half: the next hop towards the endpoint goes into the forward value
/// `v` before the entry is inserted, then rewrite and send (no route or neighbour yet: the
/// entry goes in with an empty next-hop cache and the kernel forwards the packet).
#[inline(always)]
fn open<C: Hook>(ctx: &C, pkt: &Pkt, v: &mut CtValue, t: u64) -> Result<u32, ParseError> {
    let nh = endpoint_next_hop(ctx, pkt.key.family, v, t);
    if let Some((nh, ns)) = &nh {
        v.nh_ifindex = nh.ifindex;
        v.nh_smac = nh.smac;
        v.nh_dmac = nh.dmac;
        v.nh_flags = nh.flags;
        v.nh_ns = *ns;
    }
    if !ct::commit(&pkt.key, v) {
        return Ok(C::DROP);
    }
    rewrite_for(ctx, pkt, v)?;
    match nh {
        Some((nh, _)) => ctx.send(nh.ifindex, &nh.smac, &nh.dmac, nh.flags),
        None => Ok(C::PASS),
    }
}

/// Slow path's second half: rewrites the packet per `v`, looks the next hop up, caches it in
/// the flow's entry for the fast path, and sends.
#[inline(always)]
fn apply<C: Hook>(ctx: &C, pkt: &Pkt, v: &CtValue, t: u64) -> Result<u32, ParseError> {
    let key = &pkt.key;
    rewrite_for(ctx, pkt, v)?;
    let Some(nh) = lookup(ctx, pkt.key.family, &v.ndaddr) else {
        // No route or neighbour yet: the kernel forwards (and resolves the neighbour).
        return Ok(C::PASS);
    };
    if let Some(e) = CT.get_ptr_mut(key) {
        // SAFETY: pointer from the map helper. Volatile stores keep their order, `nh_ns`
        // last (x86 keeps store order too): a reader on another CPU sees an empty or stale
        // time (slow path) until the whole next hop is written.
        unsafe {
            addr_of_mut!((*e).nh_ifindex).write_volatile(nh.ifindex);
            addr_of_mut!((*e).nh_smac).write_volatile(nh.smac);
            addr_of_mut!((*e).nh_dmac).write_volatile(nh.dmac);
            addr_of_mut!((*e).nh_flags).write_volatile(nh.flags);
            addr_of_mut!((*e).nh_ns).write_volatile(t);
        }
    }
    ctx.send(nh.ifindex, &nh.smac, &nh.dmac, nh.flags)
}
