//! Per-packet decision: established flow (conntrack) → rewrite; new flow to a service → select,
//! create conntrack, rewrite; anything else → pass.
use aya_ebpf::{bindings::xdp_action, programs::XdpContext};
use loxi_common::{
    maps::{
        CtKey, CtValue, DEFAULT_TCP_TIMEOUT_S, DEFAULT_UDP_TIMEOUT_S, MAX_EPS, ServiceKey, ctr,
        dir, proto,
    },
    mode,
};

use crate::{
    csum::rewrite,
    ct,
    fwd::forward,
    maps::{CT, ENDPOINTS, SERVICES, count, count_ep},
    parse::{ParseError, Pkt, parse},
    select::select,
};

/// The program body; `Err` means "drop" (only for truncated frames).
#[inline(always)]
pub fn try_loxi(ctx: &XdpContext) -> Result<u32, u32> {
    count(ctr::RX, 1);
    let pkt = match parse(ctx) {
        Ok(p) => p,
        Err(ParseError::NotOurs) => return Ok(pass()),
        Err(ParseError::Truncated) => return Err(truncated()),
    };
    match handle(ctx, &pkt) {
        Ok(a) => Ok(a),
        Err(ParseError::NotOurs) => Ok(pass()),
        Err(ParseError::Truncated) => Err(truncated()),
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

#[inline(never)]
fn handle(ctx: &XdpContext, pkt: &Pkt) -> Result<u32, ParseError> {
    let key = ct::key_of(pkt);
    let t = ct::now();
    if let Some(v) = CT.get_ptr_mut(&key) {
        // SAFETY: pointer from the map helper; the value stays readable for this run (RCU) even
        // if the entry is deleted below.
        let cur = unsafe { &*v };
        if !ct::expired(cur, t) {
            ct::on_packet(&key, v, pkt, t);
            return apply(ctx, pkt, cur);
        }
        count(ctr::CT_EXPIRED, 1);
        ct::close(&key, cur);
        if cur.dir == dir::REV {
            return Err(ParseError::NotOurs);
        }
    }
    new_flow(ctx, pkt, &key)
}

#[inline(never)]
fn new_flow(ctx: &XdpContext, pkt: &Pkt, key: &CtKey) -> Result<u32, ParseError> {
    let sk = ServiceKey { addr: pkt.daddr, port: pkt.dport, proto: pkt.proto, family: pkt.family };
    // SAFETY: read-only copy of the map value.
    let svc = match unsafe { SERVICES.get(&sk) } {
        Some(s) => *s,
        None => return Err(ParseError::NotOurs),
    };
    if svc.mode == mode::FULLPROXY {
        return Err(ParseError::NotOurs);
    }
    let Some(idx) = select(&svc, pkt) else {
        count(ctr::DROP_NO_ENDPOINT, 1);
        return Ok(xdp_action::XDP_DROP);
    };
    let Some(ep) = ENDPOINTS.get(svc.slot * MAX_EPS + idx) else {
        count(ctr::DROP_NO_ENDPOINT, 1);
        return Ok(xdp_action::XDP_DROP);
    };
    let timeout = match (svc.idle_timeout_s, pkt.proto) {
        (0, proto::TCP) => DEFAULT_TCP_TIMEOUT_S,
        (0, _) => DEFAULT_UDP_TIMEOUT_S,
        (s, _) => s,
    };
    let Some(fwd) = ct::create(key, pkt, &svc, idx, ep, timeout) else {
        return Ok(xdp_action::XDP_DROP);
    };
    apply(ctx, pkt, &fwd)
}

/// Rewrites the packet per the conntrack value and forwards it.
#[inline(never)]
fn apply(ctx: &XdpContext, pkt: &Pkt, v: &CtValue) -> Result<u32, ParseError> {
    let bytes = (ctx.data_end() - ctx.data()) as u64;
    count_ep(v.slot, v.ep as u32, bytes);
    if v.mode == mode::DSR {
        count(ctr::DSR, 1);
        if v.dir == dir::REV {
            return forward(ctx, pkt.family, &v.ndaddr);
        }
        // The route to the endpoint gives its MAC; the IP header stays (dst = VIP).
        let ep = ENDPOINTS.get(v.slot * MAX_EPS + v.ep as u32).ok_or(ParseError::NotOurs)?;
        return forward(ctx, pkt.family, &ep.addr);
    }
    rewrite(ctx, pkt, &v.nsaddr, &v.ndaddr, v.nsport, v.ndport)?;
    count(if v.dir == dir::FWD { ctr::NAT_FWD } else { ctr::NAT_REV }, 1);
    forward(ctx, pkt.family, &v.ndaddr)
}
