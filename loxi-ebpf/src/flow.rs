//! Per-packet decision: established flow (conntrack) → rewrite; new flow to a service → select,
//! create conntrack, rewrite; anything else → pass.
//!
//! Code that touches packet memory is inlined into the entry function (the verifier tracks
//! packet pointers only within one frame); the map-heavy decision runs in its own frame
//! ([`decide`]) so the two stacks stay under the 512-byte limit together.
use aya_ebpf::{bindings::xdp_action, programs::XdpContext};
use loxi_common::{
    maps::{CtKey, CtValue, ServiceKey, ctr, dir},
    mode,
};

use crate::{
    csum::rewrite,
    ct,
    fwd::forward,
    maps::{CT, SERVICES, count, count_ep},
    parse::{ParseError, Pkt, parse},
    select::select,
};

/// What [`decide`] concluded.
const V_PASS: u32 = 0;
const V_DROP: u32 = 1;
const V_APPLY: u32 = 2;

/// The program body; `Err` means "drop" (only for truncated frames).
#[inline(always)]
pub fn try_loxi(ctx: &XdpContext) -> Result<u32, u32> {
    count(ctr::RX, 1);
    let pkt = match parse(ctx) {
        Ok(p) => p,
        Err(ParseError::NotOurs) => return Ok(pass()),
        Err(ParseError::Truncated) => return Err(truncated()),
    };
    let mut v = CtValue::default();
    match decide(&pkt, &mut v) {
        V_PASS => Ok(pass()),
        V_APPLY => match apply(ctx, &pkt, &v) {
            Ok(a) => Ok(a),
            Err(ParseError::NotOurs) => Ok(pass()),
            Err(ParseError::Truncated) => Err(truncated()),
        },
        _ => Ok(xdp_action::XDP_DROP),
    }
}

#[inline(always)]
fn pass() -> u32 {
    count(ctr::PASS, 1);
    xdp_action::XDP_PASS
}

#[inline(always)]
fn truncated() -> u32 {
    count(ctr::DROP_TRUNCATED, 1);
    xdp_action::XDP_DROP
}

/// Conntrack hit, or a new flow to a service; fills `out` with the mapping to apply.
#[inline(never)]
fn decide(pkt: &Pkt, out: &mut CtValue) -> u32 {
    let key = ct::key_of(pkt);
    let t = ct::now();
    if let Some(v) = CT.get_ptr_mut(&key) {
        // SAFETY: pointer from the map helper; copied out before any delete.
        *out = unsafe { *v };
        if !ct::expired(out, t) {
            ct::on_packet(&key, v, pkt, t);
            return V_APPLY;
        }
        count(ctr::CT_EXPIRED, 1);
        ct::close(&key, out);
        if out.dir == dir::REV {
            return V_PASS;
        }
    }
    new_flow(pkt, &key, out)
}

#[inline(always)]
fn new_flow(pkt: &Pkt, key: &CtKey, out: &mut CtValue) -> u32 {
    let sk = ServiceKey {
        addr: pkt.daddr,
        port: pkt.dport,
        proto: pkt.proto,
        family: pkt.family,
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
    if ct::create(key, pkt, &svc, idx, out) {
        V_APPLY
    } else {
        V_DROP
    }
}

/// Rewrites the packet per the conntrack value and forwards it.
#[inline(always)]
fn apply(ctx: &XdpContext, pkt: &Pkt, v: &CtValue) -> Result<u32, ParseError> {
    let bytes = (ctx.data_end() - ctx.data()) as u64;
    count_ep(v.slot, v.ep as u32, bytes);
    if v.mode == mode::DSR {
        count(ctr::DSR, 1);
        // Forward: the route to the endpoint (`ndaddr`) gives its MAC; the IP header stays
        // (dst = VIP). Reply: on to the client unchanged.
        return forward(ctx, pkt.family, &v.ndaddr);
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
    forward(ctx, pkt.family, &v.ndaddr)
}
