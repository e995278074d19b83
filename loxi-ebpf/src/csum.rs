//! Address/port rewriting with incremental checksum updates (RFC 1624: HC' = ~(~HC + ~m + m')).
//!
//! All words are loaded in native order straight from memory; one's-complement sums are
//! byte-order independent as long as the checksum field is treated the same way.
use loxi_common::maps::{family, proto};

use crate::{
    hook::{Hook, fold_into},
    parse::{ParseError, Pkt, ptr_at},
};

/// Accumulates `~old + new` for one 16-bit word.
#[inline(always)]
fn diff(acc: u32, old: u16, new: u16) -> u32 {
    acc + (!old) as u32 + new as u32
}

/// Accumulates the difference of two addresses (`words` 16-bit words: 2 for v4, 8 for v6).
#[inline(always)]
fn diff_addr(mut acc: u32, old: &[u8; 16], new: &[u8; 16], v6: bool) -> u32 {
    let words = if v6 { 8 } else { 2 };
    let mut i = 0;
    while i < 8 {
        if i < words {
            let o = u16::from_ne_bytes([old[2 * i], old[2 * i + 1]]);
            let n = u16::from_ne_bytes([new[2 * i], new[2 * i + 1]]);
            acc = diff(acc, o, n);
        }
        i += 1;
    }
    acc
}

/// Writes the new tuple into the packet and fixes the IPv4 header and TCP/UDP checksums (the
/// L4 one as the hook does it, [`Hook::l4_csum`]). SCTP's CRC32c is not touched (SCTP is only
/// supported in DSR mode).
#[inline(always)]
pub fn rewrite<C: Hook>(
    ctx: &C,
    pkt: &Pkt,
    saddr: &[u8; 16],
    daddr: &[u8; 16],
    sport: u16,
    dport: u16,
) -> Result<(), ParseError> {
    let v6 = pkt.key.family == family::V6;
    let mut acc = diff_addr(0, &pkt.key.saddr, saddr, v6);
    acc = diff_addr(acc, &pkt.key.daddr, daddr, v6);
    let ports = diff(diff(0, pkt.key.sport, sport), pkt.key.dport, dport);
    if v6 {
        let a: *mut [u8; 32] = ptr_at(ctx, pkt.l3 + 8)?;
        // SAFETY: 32 bytes checked by ptr_at.
        let a = unsafe { &mut *a };
        a[..16].copy_from_slice(saddr);
        a[16..].copy_from_slice(daddr);
    } else {
        let a: *mut [u8; 8] = ptr_at(ctx, pkt.l3 + 12)?;
        // SAFETY: 8 bytes checked by ptr_at.
        let a = unsafe { &mut *a };
        a[..4].copy_from_slice(&saddr[..4]);
        a[4..].copy_from_slice(&daddr[..4]);
        let c: *mut u16 = ptr_at(ctx, pkt.l3 + 10)?;
        // SAFETY: checked by ptr_at.
        unsafe { c.write_unaligned(fold_into(c.read_unaligned(), acc)) };
    }
    let p: *mut [u16; 2] = ptr_at(ctx, pkt.l4)?;
    // SAFETY: checked by ptr_at.
    unsafe { p.write_unaligned([sport, dport]) };
    match pkt.key.proto {
        proto::TCP => ctx.l4_csum(pkt.l4 + 16, acc, ports, false, v6)?,
        // UDP may carry no checksum (0, IPv4 only; an IPv6 receiver drops it anyway): it
        // keeps none.
        proto::UDP => ctx.l4_csum(pkt.l4 + 6, acc, ports, true, v6)?,
        _ => {}
    }
    Ok(())
}
