//! In-kernel endpoint selection for new flows: 0 rr (per-CPU cursor), 1 hash (5-tuple),
//! 2 wrr (cursor over the weight sum), 3 persist (client address hash), 4 lc (fewest open
//! connections). Every selector skips inactive (draining) rows.
use loxi_common::{
    maps::{EndpointValue, MAX_EPS, ServiceValue},
    sel,
};

use crate::{
    maps::{ENDPOINTS, LC, RR},
    parse::Pkt,
};

#[inline(always)]
fn mix(h: u32, v: u32) -> u32 {
    (h ^ v).wrapping_mul(0x9e37_79b1).rotate_left(13)
}

/// Hash of an address (16 raw bytes).
#[inline(always)]
pub fn hash_addr(mut h: u32, a: &[u8; 16]) -> u32 {
    let mut i = 0;
    while i < 4 {
        h = mix(h, u32::from_ne_bytes([a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]]));
        i += 1;
    }
    h
}

/// Hash of the packet's 5-tuple.
#[inline(always)]
pub fn hash5(pkt: &Pkt) -> u32 {
    let h = hash_addr(0x1234_5678, &pkt.saddr);
    let h = hash_addr(h, &pkt.daddr);
    let h = mix(h, ((pkt.sport as u32) << 16) | pkt.dport as u32);
    let h = mix(h, pkt.proto as u32);
    h ^ (h >> 16)
}

#[inline(always)]
fn row(slot: u32, i: u32) -> Option<&'static EndpointValue> {
    ENDPOINTS.get(slot * MAX_EPS + i)
}

/// First active row at or after `start` (mod `nep`).
#[inline(always)]
fn probe(slot: u32, nep: u32, start: u32) -> Option<u32> {
    let mut i = 0;
    while i < MAX_EPS {
        if i >= nep {
            break;
        }
        let idx = (start + i) % nep;
        if let Some(e) = row(slot, idx)
            && e.active != 0
        {
            return Some(idx);
        }
        i += 1;
    }
    None
}

#[inline(always)]
fn cursor(slot: u32) -> u32 {
    match RR.get_ptr_mut(slot) {
        Some(p) => {
            // SAFETY: per-CPU slot from the map helper.
            let v = unsafe { *p };
            unsafe { *p = v.wrapping_add(1) };
            v
        }
        None => 0,
    }
}

#[inline(always)]
fn wrr(slot: u32, nep: u32, total: u32) -> Option<u32> {
    if total == 0 {
        return probe(slot, nep, cursor(slot));
    }
    let mut c = cursor(slot) % total;
    let mut i = 0;
    while i < MAX_EPS {
        if i >= nep {
            break;
        }
        if let Some(e) = row(slot, i)
            && e.active != 0
        {
            let w = e.weight as u32;
            if c < w {
                return Some(i);
            }
            c -= w;
        }
        i += 1;
    }
    probe(slot, nep, 0)
}

#[inline(always)]
fn least_conn(slot: u32, nep: u32) -> Option<u32> {
    let start = cursor(slot);
    let mut best: Option<u32> = None;
    let mut best_n = u32::MAX;
    let mut i = 0;
    while i < MAX_EPS {
        if i >= nep {
            break;
        }
        let idx = (start + i) % nep;
        if let Some(e) = row(slot, idx)
            && e.active != 0
        {
            let n = LC.get(slot * MAX_EPS + idx).copied().unwrap_or(0);
            if n < best_n {
                best_n = n;
                best = Some(idx);
            }
        }
        i += 1;
    }
    best
}

/// Picks an endpoint row for a new flow of `svc`; `None` if no row is active.
#[inline(never)]
pub fn select(svc: &ServiceValue, pkt: &Pkt) -> Option<u32> {
    let nep = svc.nep as u32;
    if nep == 0 || nep > MAX_EPS {
        return None;
    }
    let slot = svc.slot;
    match svc.sel {
        sel::HASH => probe(slot, nep, hash5(pkt) % nep),
        sel::WRR => wrr(slot, nep, svc.wrr_total),
        sel::PERSIST => probe(slot, nep, hash_addr(0x0bad_cafe, &pkt.saddr) % nep),
        sel::LC => least_conn(slot, nep),
        _ => probe(slot, nep, cursor(slot)),
    }
}
