//! Header parsing through one bounds-checked accessor, [`ptr_at`], over the frame of either
//! program ([`Frame`]: the XDP program's, or the TC program's socket buffer).
use aya_ebpf::programs::{TcContext, XdpContext};
use loxi_common::maps::{CtKey, family, proto};

/// A program context whose packet bytes lie between `data` and `data_end`.
pub trait Frame {
    /// Address of the first byte.
    fn data(&self) -> usize;
    /// Address one past the last byte.
    fn data_end(&self) -> usize;
    /// The frame's length in bytes (Ethernet header included), for the byte counters: the
    /// bytes between `data` and `data_end` unless the frame has more (a socket buffer's pages).
    #[inline(always)]
    fn frame_len(&self) -> u32 {
        (self.data_end() - self.data()) as u32
    }
}

impl Frame for XdpContext {
    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }
}

impl Frame for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }
}

/// Header cut short or not parseable: the caller drops (truncated) or passes.
pub enum ParseError {
    /// The frame ends inside a header we need.
    Truncated,
    /// Not something the data path handles (ARP, fragments, ICMP, IPv6 extension headers…).
    NotOurs,
}

/// A pointer to a `T` at byte `off` of the frame, or `Truncated` if it would cross `data_end`.
#[inline(always)]
pub fn ptr_at<T, C: Frame>(ctx: &C, off: usize) -> Result<*mut T, ParseError> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + core::mem::size_of::<T>() > end {
        return Err(ParseError::Truncated);
    }
    Ok((start + off) as *mut T)
}

/// Parsed view of one packet: offsets and the 5-tuple (raw network order).
#[derive(Clone, Copy)]
pub struct Pkt {
    /// Offset of the IP header.
    pub l3: usize,
    /// Offset of the L4 header.
    pub l4: usize,
    /// TCP flags byte (0 for UDP/SCTP).
    pub tcp_flags: u8,
    /// Frame length in bytes (Ethernet header included), for the per-flow byte counters.
    pub len: u32,
    /// The 5-tuple and family, laid out as the packet's conntrack key (parsed straight into
    /// it: the lookup needs no copy).
    pub key: CtKey,
}

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88A8;
/// Length of an Ethernet header.
pub const ETH_LEN: usize = 14;

/// Parses Ethernet (+ one VLAN tag), IPv4/IPv6 and the TCP/UDP/SCTP ports.
#[inline(always)]
pub fn parse<C: Frame>(ctx: &C) -> Result<Pkt, ParseError> {
    let et: *const [u8; 2] = ptr_at(ctx, 12)?;
    // SAFETY: ptr_at checked the bounds.
    let mut ethertype = u16::from_be_bytes(unsafe { *et });
    let mut l3 = ETH_LEN;
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        let inner: *const [u8; 2] = ptr_at(ctx, 16)?;
        ethertype = u16::from_be_bytes(unsafe { *inner });
        l3 = ETH_LEN + 4;
    }
    let ip = match ethertype {
        ETH_P_IP => parse_v4(ctx, l3)?,
        ETH_P_IPV6 => parse_v6(ctx, l3)?,
        _ => return Err(ParseError::NotOurs),
    };
    let mut pkt = Pkt {
        l3,
        l4: ip.l4,
        tcp_flags: 0,
        len: ctx.frame_len(),
        key: CtKey {
            saddr: ip.saddr,
            daddr: ip.daddr,
            sport: 0,
            dport: 0,
            proto: ip.proto,
            family: ip.family,
            _pad: [0; 2],
        },
    };
    parse_ports(ctx, &mut pkt)?;
    Ok(pkt)
}

/// What the IP header gives.
struct Ip {
    family: u8,
    proto: u8,
    saddr: [u8; 16],
    daddr: [u8; 16],
    l4: usize,
}

/// The 16 address bytes of an IPv4 address (4 bytes, then 12 zero bytes), built with word
/// stores: a zero-filled array compiles to a call of the byte-at-a-time `memset` on BPF.
#[inline(always)]
fn v4_addr(b: &[u8]) -> [u8; 16] {
    let mut w = core::mem::MaybeUninit::<[u32; 4]>::uninit();
    let p = w.as_mut_ptr() as *mut u32;
    // SAFETY: four words of a local; volatile so the zero words stay word stores.
    unsafe {
        p.write_volatile(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
        p.add(1).write_volatile(0);
        p.add(2).write_volatile(0);
        p.add(3).write_volatile(0);
        core::mem::transmute::<[u32; 4], [u8; 16]>(w.assume_init())
    }
}

#[inline(always)]
fn parse_v4<C: Frame>(ctx: &C, l3: usize) -> Result<Ip, ParseError> {
    let h: *const [u8; 20] = ptr_at(ctx, l3)?;
    // SAFETY: 20 bytes checked by ptr_at.
    let h = unsafe { &*h };
    let ihl = ((h[0] & 0x0f) as usize) * 4;
    if h[0] >> 4 != 4 || ihl < 20 {
        return Err(ParseError::NotOurs);
    }
    // Fragments other than the first carry no ports; MF or offset != 0 → kernel.
    if (h[6] & 0x3f) != 0 || h[7] != 0 {
        return Err(ParseError::NotOurs);
    }
    Ok(Ip {
        family: family::V4,
        proto: h[9],
        saddr: v4_addr(&h[12..16]),
        daddr: v4_addr(&h[16..20]),
        l4: l3 + ihl,
    })
}

#[inline(always)]
fn parse_v6<C: Frame>(ctx: &C, l3: usize) -> Result<Ip, ParseError> {
    let h: *const [u8; 40] = ptr_at(ctx, l3)?;
    // SAFETY: 40 bytes checked by ptr_at.
    let h = unsafe { &*h };
    let mut saddr = [0u8; 16];
    let mut daddr = [0u8; 16];
    saddr.copy_from_slice(&h[8..24]);
    daddr.copy_from_slice(&h[24..40]);
    Ok(Ip {
        family: family::V6,
        proto: h[6],
        saddr,
        daddr,
        l4: l3 + 40,
    })
}

#[inline(always)]
fn parse_ports<C: Frame>(ctx: &C, pkt: &mut Pkt) -> Result<(), ParseError> {
    match pkt.key.proto {
        proto::TCP => {
            let t: *const [u8; 20] = ptr_at(ctx, pkt.l4)?;
            // SAFETY: checked by ptr_at.
            let t = unsafe { &*t };
            pkt.tcp_flags = t[13];
        }
        proto::UDP => {
            let _: *const [u8; 8] = ptr_at(ctx, pkt.l4)?;
        }
        proto::SCTP => {
            let _: *const [u8; 12] = ptr_at(ctx, pkt.l4)?;
        }
        _ => return Err(ParseError::NotOurs),
    }
    let p: *const [u16; 2] = ptr_at(ctx, pkt.l4)?;
    // SAFETY: checked by ptr_at.
    let p = unsafe { p.read_unaligned() };
    pkt.key.sport = p[0];
    pkt.key.dport = p[1];
    Ok(())
}
