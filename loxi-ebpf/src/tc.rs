//! The TC ingress half of the hand-off to egresses without XDP receive
//! (`loxi_common::maps::egress`): a frame the XDP program already rewrote is redirected to its
//! egress. With XDP metadata (`fwd::meta_ok`) the metadata names the egress; without it (a
//! kernel that refuses `bpf_xdp_adjust_meta` to XDP programs) the frame is known by its MACs:
//! it arrived addressed to another host (`PACKET_OTHERHOST`) and its source and destination
//! MACs are exactly those of the next hop the XDP program sent it to, so the XDP program wrote
//! them. That next hop is the conntrack entry's cached one for a DSR frame (its tuple is the
//! flow's, the destination still the VIP), else the FIB lookup for the frame's (rewritten)
//! destination; the frame goes to its egress (into the peer's ingress with `bpf_redirect_peer`
//! for a veth whose peer is in another namespace). Anything else continues up the stack
//! untouched.
use aya_ebpf::{
    bindings::TC_ACT_OK,
    helpers::generated::{bpf_redirect, bpf_redirect_peer},
    programs::TcContext,
};
use loxi_common::{
    maps::{
        ctr,
        egress::{META_LEN, META_MAGIC, Meta},
    },
    mode,
};

use crate::{
    fwd::{lookup, meta_ok},
    maps::{CT, EGRESS_PEER, count},
    parse::{parse, ptr_at},
};

/// `skb->pkt_type` of a frame whose destination MAC is not the receiving device's.
const PACKET_OTHERHOST: u32 = 3;

/// The program body: `TC_ACT_REDIRECT` for handed-off frames, else `TC_ACT_OK`.
#[inline(always)]
pub fn try_tc(ctx: &TcContext) -> i32 {
    if !meta_ok() {
        return by_next_hop(ctx);
    }
    // SAFETY: the context pointer is valid for the program's run; data_meta and data are
    // plain fields the verifier lets cls_bpf programs read.
    let (meta, data) = unsafe {
        (
            (*ctx.skb.skb).data_meta as usize,
            (*ctx.skb.skb).data as usize,
        )
    };
    if meta + META_LEN > data {
        return TC_ACT_OK;
    }
    // SAFETY: META_LEN bytes of metadata checked against data above.
    let m = unsafe { *(meta as *const Meta) };
    if m.magic != META_MAGIC {
        return TC_ACT_OK;
    }
    redirect(m.ifindex)
}

/// The hand-off without metadata (see the module doc).
#[inline(always)]
fn by_next_hop(ctx: &TcContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's run; a plain readable field.
    let pkt_type = unsafe { (*ctx.skb.skb).pkt_type };
    if pkt_type != PACKET_OTHERHOST {
        return TC_ACT_OK;
    }
    let Ok(pkt) = parse(ctx) else {
        return TC_ACT_OK;
    };
    let Ok(eth) = ptr_at::<[u8; 12], _>(ctx, 0) else {
        return TC_ACT_OK;
    };
    // SAFETY: 12 bytes checked by ptr_at.
    let eth = unsafe { *eth };
    // A DSR flow's frame: its conntrack entry holds the next hop it was sent to.
    if let Some(v) = CT.get_ptr(&pkt.key) {
        // SAFETY: pointer from the map helper, valid for this program run.
        let (dsr, ifindex, smac, dmac) =
            unsafe { ((*v).mode == mode::DSR, (*v).nh_ifindex, (*v).nh_smac, (*v).nh_dmac) };
        if dsr && macs_are(&eth, &smac, &dmac) {
            return redirect(ifindex);
        }
    }
    let Some(nh) = lookup(ctx, pkt.key.family, &pkt.key.daddr) else {
        return TC_ACT_OK;
    };
    if !macs_are(&eth, &nh.smac, &nh.dmac) {
        return TC_ACT_OK;
    }
    redirect(nh.ifindex)
}

/// Whether the frame's Ethernet addresses (`eth`: destination, then source) are `dmac`, `smac`.
/// Byte by byte: a slice comparison compiles to a `memcmp` call BPF does not have.
#[inline(always)]
fn macs_are(eth: &[u8; 12], smac: &[u8; 6], dmac: &[u8; 6]) -> bool {
    let mut i = 0;
    while i < 6 {
        if eth[i] != dmac[i] || eth[6 + i] != smac[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Redirects the handed-off socket buffer to `ifindex` (counted), into the peer when it is a
/// veth whose peer is in another namespace ([`EGRESS_PEER`]).
#[inline(always)]
fn redirect(ifindex: u32) -> i32 {
    count(ctr::TC_REDIRECT, 1);
    // SAFETY: read-only lookup of a plain u8.
    let peer = unsafe { EGRESS_PEER.get(&ifindex) }.is_some();
    redirect_skb(ifindex, peer) as i32
}

/// Redirects a socket buffer (both TC programs): into the peer's ingress with
/// `bpf_redirect_peer` when `peer` (a veth whose peer is in another namespace: the loader lists
/// only such, `LOXI_EGRESS_PEER`; counted), else out `ifindex`'s egress with `bpf_redirect`.
/// Returns the helper's verdict (`TC_ACT_REDIRECT`).
#[inline(always)]
pub fn redirect_skb(ifindex: u32, peer: bool) -> u32 {
    if peer {
        count(ctr::REDIRECT_PEER, 1);
        // SAFETY: helper call on a listed veth.
        return unsafe { bpf_redirect_peer(ifindex, 0) } as u32;
    }
    // SAFETY: helper call; the kernel validates the ifindex (out its egress, the ingress
    // interface's included).
    unsafe { bpf_redirect(ifindex, 0) as u32 }
}
