//! The two hooks the whole data path ([`crate::flow::try_loxi`]) runs on, behind one trait:
//! XDP (`loxi_xdp`, the frame before the kernel builds a socket buffer) and TC ingress
//! (`loxi_tc_full`, the socket buffer, for interfaces named with `--tc-iface`). They differ in
//! their verdict codes, in how the L4 checksum is fixed and in how a rewritten frame leaves:
//! - XDP fixes the checksum in place (the frame's checksum is always complete) and sends
//!   through `XDP_TX`, the XDP device map or the TC hand-off ([`crate::fwd::send`]);
//! - TC fixes it with `bpf_l4_csum_replace`, which follows the socket buffer's checksum state
//!   (a frame from a local socket through a veth carries `CHECKSUM_PARTIAL`: its checksum field
//!   holds the pseudo-header's sum, which only the addresses change; a `CHECKSUM_COMPLETE`
//!   frame's `skb->csum`, a NIC's sum of the whole packet, is kept right: the helper does it for
//!   IPv4, and for IPv6, where the helper moves it by the address difference that the header
//!   itself already carries, `bpf_csum_update` moves it back; see [`TcFull`]'s `l4_csum`), and
//!   sends with `bpf_redirect` of the socket
//!   buffer, which any egress takes (a veth with a plain peer included): no XDP frame, no
//!   hand-off, no second lookup. An egress veth whose peer is in another namespace (a container,
//!   a pod) gets it with `bpf_redirect_peer`, into the peer's ingress directly.
use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    helpers::generated::bpf_csum_update,
    programs::{TcContext, XdpContext},
};
use loxi_common::maps::{ctr, nh_flags};

use crate::{
    fwd::{FibCtx, send, write_macs},
    maps::count,
    tc::redirect_skb,
    parse::{Frame, ParseError, ptr_at},
};

/// What the data path needs of the hook it runs on.
pub trait Hook: Frame + FibCtx {
    /// Verdict: the kernel takes the frame as it is now.
    const PASS: u32;
    /// Verdict: drop the frame.
    const DROP: u32;
    /// Fixes the TCP/UDP checksum at byte `off` after the addresses changed by `addrs` and the
    /// ports by `ports` (one's-complement differences as `csum::diff` accumulates them). `udp`:
    /// a zero checksum (a UDP datagram without one) stays zero, a result of zero becomes
    /// `0xffff`. `v6`: the addresses are IPv6 ones (no header checksum carries their change).
    fn l4_csum(
        &self,
        off: usize,
        addrs: u32,
        ports: u32,
        udp: bool,
        v6: bool,
    ) -> Result<(), ParseError>;
    /// Writes the MACs (`smac` → `dmac`) and sends the rewritten frame out `ifindex`. `flags`:
    /// the next hop's `nh_flags` (`XDP_OK` for XDP, `PEER` for TC).
    fn send(
        &self,
        ifindex: u32,
        smac: &[u8; 6],
        dmac: &[u8; 6],
        flags: u8,
    ) -> Result<u32, ParseError>;
}

/// Folds `acc` into checksum field value `csum` (RFC 1624: HC' = ~(~HC + ~m + m')).
#[inline(always)]
pub fn fold_into(csum: u16, acc: u32) -> u16 {
    let mut s = (!csum) as u32 + acc;
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    !(s as u16)
}

impl Hook for XdpContext {
    const PASS: u32 = xdp_action::XDP_PASS;
    const DROP: u32 = xdp_action::XDP_DROP;

    #[inline(always)]
    fn l4_csum(
        &self,
        off: usize,
        addrs: u32,
        ports: u32,
        udp: bool,
        _v6: bool,
    ) -> Result<(), ParseError> {
        let c: *mut u16 = ptr_at(self, off)?;
        // SAFETY: checked by ptr_at.
        let old = unsafe { c.read_unaligned() };
        if udp && old == 0 {
            return Ok(());
        }
        let mut n = fold_into(old, addrs + ports);
        if udp && n == 0 {
            n = 0xffff;
        }
        // SAFETY: checked by ptr_at.
        unsafe { c.write_unaligned(n) };
        Ok(())
    }

    #[inline(always)]
    fn send(
        &self,
        ifindex: u32,
        smac: &[u8; 6],
        dmac: &[u8; 6],
        flags: u8,
    ) -> Result<u32, ParseError> {
        send(self, ifindex, smac, dmac, flags & nh_flags::XDP_OK != 0)
    }
}

/// The socket buffer of the TC ingress program that runs the whole data path
/// (`loxi_tc_full`); a type of its own so that its FIB lookups count `fib_pass` (the hand-off
/// program's, on `TcContext`, do not).
#[repr(transparent)]
pub struct TcFull(pub TcContext);

/// Most header bytes the data path reads: Ethernet with one VLAN tag (18), IPv6 (40) or IPv4
/// with options (60), TCP with options (60).
const HEADERS_MAX: u32 = 138;

impl TcFull {
    /// Makes the headers linear when the socket buffer's linear part is shorter than both
    /// [`HEADERS_MAX`] and the packet (a GRO-merged or paged buffer). A failed pull leaves the
    /// buffer as it was; the parse then finds the headers cut short.
    #[inline(always)]
    pub fn pull_headers(&self) {
        let len = self.0.len();
        let want = if len < HEADERS_MAX { len } else { HEADERS_MAX };
        if ((self.0.data_end() - self.0.data()) as u32) < want {
            let _ = self.0.pull_data(want);
        }
    }
}

impl Frame for TcFull {
    #[inline(always)]
    fn data(&self) -> usize {
        self.0.data()
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        self.0.data_end()
    }
    #[inline(always)]
    fn frame_len(&self) -> u32 {
        self.0.len()
    }
}

impl FibCtx for TcFull {
    const XDP: bool = false;
    const PEER: bool = true;
    const COUNTS_FIB_PASS: bool = true;
    #[inline(always)]
    fn raw(&self) -> *mut core::ffi::c_void {
        FibCtx::raw(&self.0)
    }
    #[inline(always)]
    fn ingress(&self) -> u32 {
        FibCtx::ingress(&self.0)
    }
}

impl Hook for TcFull {
    const PASS: u32 = TC_ACT_OK as u32;
    const DROP: u32 = TC_ACT_SHOT as u32;

    /// With `CHECKSUM_COMPLETE` (a NIC's sum of the whole packet in `skb->csum`), the
    /// pseudo-header replace moves `skb->csum` by minus the address difference. Right for IPv4,
    /// whose header checksum cancels the addresses' change in the packet's sum, so the packet's
    /// sum moves by the L4 field's change alone; wrong for IPv6, which has no header checksum:
    /// the packet's sum does not move at all. Linux 6.16's `BPF_F_IPV6` flag (backported to
    /// some stable kernels) skips that move, but older kernels refuse the flag, so for IPv6
    /// `bpf_csum_update` adds the difference back, which any kernel does (and which is a no-op
    /// error in every other checksum state). Checked by the kernel itself in
    /// `l4::testing::tc` (`BPF_F_TEST_SKB_CHECKSUM_COMPLETE`).
    #[inline(always)]
    fn l4_csum(
        &self,
        off: usize,
        addrs: u32,
        ports: u32,
        udp: bool,
        v6: bool,
    ) -> Result<(), ParseError> {
        let zero = if udp { BPF_F_MARK_MANGLED_0 as u64 } else { 0 };
        // A UDP datagram without a checksum is left alone by the helper, `skb->csum` included.
        let untouched = udp && {
            let c: *const u16 = ptr_at(self, off)?;
            // SAFETY: checked by ptr_at.
            unsafe { c.read_unaligned() == 0 }
        };
        // A `from` of 0 with no size in the flags: `to` is a precomputed difference. The
        // addresses are in the pseudo-header (a partial checksum follows them); the ports are
        // not (a partial checksum is summed over them later, by the device or the kernel).
        self.0
            .l4_csum_replace(off, 0, addrs as u64, BPF_F_PSEUDO_HDR as u64 | zero)
            .map_err(|_| ParseError::Truncated)?;
        if v6 && !untouched {
            // SAFETY: a helper call on this program's own socket buffer; its error (not
            // `CHECKSUM_COMPLETE`: nothing to move back) is the expected outcome then.
            let _ = unsafe { bpf_csum_update(self.0.skb.skb, addrs) };
        }
        self.0
            .l4_csum_replace(off, 0, ports as u64, zero)
            .map_err(|_| ParseError::Truncated)
    }

    #[inline(always)]
    fn send(
        &self,
        ifindex: u32,
        smac: &[u8; 6],
        dmac: &[u8; 6],
        flags: u8,
    ) -> Result<u32, ParseError> {
        write_macs(self, smac, dmac)?;
        count(
            if ifindex == self.ingress() {
                ctr::TX
            } else {
                ctr::REDIRECT
            },
            1,
        );
        Ok(redirect_skb(ifindex, flags & nh_flags::PEER != 0))
    }
}
