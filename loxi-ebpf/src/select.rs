//! In-kernel endpoint selection for new flows, loop-free: the loader keeps per rule a table of
//! the active endpoint rows (`LOXI_ACTIVE`) and a weight table (`LOXI_WRR`), so every selector
//! is one index computation: 0 rr (per-CPU cursor), 1 hash (5-tuple), 2 wrr (cursor over the
//! weight table), 3 persist (client address hash), 4 lc (of two candidates, the one with fewer
//! open connections — power of two choices over the conntrack-maintained counts).
use loxi_common::{
    maps::{MAX_EPS, ServiceValue, WRR_SLOTS},
    sel,
};

use crate::{
    maps::{ACTIVE, LC, RR, WRR},
    parse::Pkt,
};

const MASK: u32 = WRR_SLOTS - 1;

#[inline(always)]
fn mix(h: u32, v: u32) -> u32 {
    (h ^ v).wrapping_mul(0x9e37_79b1).rotate_left(13)
}

/// Hash of an address (16 raw bytes).
#[inline(always)]
pub fn hash_addr(mut h: u32, a: &[u8; 16]) -> u32 {
    let mut i = 0;
    while i < 4 {
        h = mix(
            h,
            u32::from_ne_bytes([a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]]),
        );
        i += 1;
    }
    h ^ (h >> 16)
}

/// Hash of the packet's 5-tuple.
#[inline(always)]
pub fn hash5(pkt: &Pkt) -> u32 {
    let h = hash_addr(0x1234_5678, &pkt.key.saddr);
    let h = hash_addr(h, &pkt.key.daddr);
    let h = mix(h, ((pkt.key.sport as u32) << 16) | pkt.key.dport as u32);
    let h = mix(h, pkt.key.proto as u32);
    h ^ (h >> 16)
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
fn open_conns(slot: u32, row: u32) -> u32 {
    LC.get(slot * MAX_EPS + row).copied().unwrap_or(u32::MAX)
}

/// Picks an endpoint row for a new flow of `svc`; `None` if no row is active.
#[inline(always)]
pub fn select(svc: &ServiceValue, pkt: &Pkt) -> Option<u32> {
    let n = svc.nact as u32;
    if n == 0 {
        return None;
    }
    let slot = svc.slot;
    let act = ACTIVE.get(slot)?;
    // `& MASK` keeps indices provably inside the 64-entry tables (n ≤ 64 is not visible to
    // LLVM, so the mask survives for the verifier).
    let at = |i: u32| act[(i & MASK) as usize] as u32;
    let row = match svc.sel {
        sel::HASH => at(hash5(pkt) % n),
        sel::PERSIST => at(hash_addr(0x0bad_cafe, &pkt.key.saddr) % n),
        sel::WRR if svc.wrr_len != 0 => {
            let w = WRR.get(slot)?;
            w[((cursor(slot) % svc.wrr_len) & MASK) as usize] as u32
        }
        sel::LC => {
            let c = cursor(slot);
            let a = at(c % n);
            if n > 1 {
                let b = at((c + 1 + hash5(pkt) % (n - 1)) % n);
                if open_conns(slot, b) < open_conns(slot, a) {
                    b
                } else {
                    a
                }
            } else {
                a
            }
        }
        _ => at(cursor(slot) % n),
    };
    Some(row)
}
