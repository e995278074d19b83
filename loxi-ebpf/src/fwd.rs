//! Sending a rewritten packet on: FIB lookup for the next hop (or a flow's cached copy of it),
//! MAC rewrite, then `XDP_TX` (same interface) or `bpf_redirect_map` through [`EGRESS_XDP`] when
//! the egress takes XDP frames, else the TC hand-off (`loxi_common::maps::egress`: `XDP_PASS`
//! with metadata naming the egress where the kernel allows it ([`meta_ok`]), and the TC program
//! redirects the socket buffer). Without a FIB/neighbour entry the packet goes to the kernel,
//! which forwards it (and resolves the neighbour for the next packets).
use core::{
    ffi::c_void,
    mem::MaybeUninit,
    ptr::{addr_of, addr_of_mut},
};

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, bpf_fib_lookup, xdp_action},
    helpers::generated::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_xdp_adjust_meta},
    programs::{TcContext, XdpContext},
};
use loxi_common::maps::{
    CtValue, MAX_EPS, NH_TTL_NS, ctr, nh_flags,
    egress::{META_LEN, META_MAGIC, Meta},
    family,
};

use crate::{
    maps::{EGRESS_PEER, EGRESS_XDP, EP_NH, count},
    parse::{Frame, ParseError, ptr_at},
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Where a rewritten frame goes: a FIB lookup's result, or a cached copy of it (a flow's
/// `CtValue::nh_*`, an endpoint's [`EpNextHop`]).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NextHop {
    /// Egress interface.
    pub ifindex: u32,
    /// Egress interface's MAC.
    pub smac: [u8; 6],
    /// Next hop's MAC.
    pub dmac: [u8; 6],
    /// `loxi_common::maps::nh_flags`: `XDP_OK`, the egress takes XDP frames ([`EGRESS_XDP`];
    /// else the TC hand-off), decided in the XDP program's lookups; `PEER`, the egress is a veth
    /// whose peer is in another namespace ([`EGRESS_PEER`]), decided in the TC data path's.
    pub flags: u8,
    /// Padding, written like the fields (the struct is copied as whole words).
    pub _pad: [u8; 3],
}

const _: () = assert!(core::mem::size_of::<bpf_fib_lookup>() == 64);

/// Value of `LOXI_EP_NH`: the next hop towards an endpoint row's address as a FIB lookup found
/// it, reused by new flows to the endpoint for [`NH_TTL_NS`] (the bound a flow's own cache has).
/// Writers clear `ns` first and set it last; readers check it before and after copying, so a
/// copy torn by a concurrent refresh on another CPU is never used.
#[repr(C)]
pub struct EpNextHop {
    /// Time of the lookup (`crate::ct::now`); 0 = empty or being written.
    pub ns: u64,
    /// Endpoint address looked up (the row may be reassigned to another address).
    pub addr: [u64; 2],
    /// Ingress interface the lookup was made for (the FIB lookup's input).
    pub ingress: u32,
    /// The lookup's result.
    pub nh: NextHop,
}

/// Copies a [`NextHop`] as five volatile word loads and stores (kept in order with the
/// volatile accesses of `EpNextHop::ns` around them).
///
/// # Safety
/// `from` and `to` point at valid, 4-aligned `NextHop`s.
#[inline(always)]
unsafe fn copy_words(from: *const NextHop, to: *mut NextHop) {
    const WORDS: usize = core::mem::size_of::<NextHop>() / 4;
    const _: () = assert!(core::mem::size_of::<NextHop>() == 20);
    let (f, t) = (from as *const u32, to as *mut u32);
    let mut i = 0;
    while i < WORDS {
        // SAFETY: word `i` of both structs (caller's contract).
        unsafe { t.add(i).write_volatile(f.add(i).read_volatile()) };
        i += 1;
    }
}

/// `ndaddr` as two words (it sits 8-aligned in the 8-aligned `CtValue`, asserted here).
#[inline(always)]
fn ndaddr_words(v: &CtValue) -> [u64; 2] {
    const _: () = assert!(core::mem::offset_of!(CtValue, ndaddr).is_multiple_of(8));
    // SAFETY: 16 bytes at an 8-aligned offset of an 8-aligned struct.
    unsafe { *(addr_of!(v.ndaddr) as *const [u64; 2]) }
}

/// Next hop for a new flow's forward value `v` (family `fam`) towards its endpoint
/// (`v.ndaddr`): the endpoint row's cached lookup while fresh, else a FIB lookup (then cached
/// for the row). Returns the next hop and the time of the lookup that found it; `None` as
/// [`lookup`].
#[inline(always)]
pub fn endpoint_next_hop<C: FibCtx>(
    ctx: &C,
    fam: u8,
    v: &CtValue,
    t: u64,
) -> Option<(NextHop, u64)> {
    let ingress = ctx.ingress();
    let addr = ndaddr_words(v);
    let Some(c) = EP_NH.get_ptr_mut(v.slot * MAX_EPS + v.ep as u32) else {
        return lookup(ctx, fam, &v.ndaddr).map(|nh| (nh, t));
    };
    // SAFETY: pointer from the map helper, valid for this program run; `ns` is read volatile
    // before and after the copy (see EpNextHop).
    unsafe {
        let ns = addr_of!((*c).ns).read_volatile();
        if ns != 0
            && t.wrapping_sub(ns) < NH_TTL_NS
            && (*c).ingress == ingress
            && (*c).addr[0] == addr[0]
            && (*c).addr[1] == addr[1]
        {
            let mut nh = MaybeUninit::<NextHop>::uninit();
            copy_words(addr_of!((*c).nh), nh.as_mut_ptr());
            if addr_of!((*c).ns).read_volatile() == ns {
                return Some((nh.assume_init(), ns));
            }
        }
    }
    let nh = lookup(ctx, fam, &v.ndaddr)?;
    // SAFETY: as above; `ns` cleared first and set last.
    unsafe {
        addr_of_mut!((*c).ns).write_volatile(0);
        addr_of_mut!((*c).addr).write_volatile(addr);
        addr_of_mut!((*c).ingress).write_volatile(ingress);
        copy_words(&nh, addr_of_mut!((*c).nh));
        addr_of_mut!((*c).ns).write_volatile(t);
    }
    Some((nh, t))
}

/// 1 when the loader found that this kernel lets XDP programs call `bpf_xdp_adjust_meta`
/// (`loxi_common::maps::egress::GLOBAL_META_OK`); read-only, so at 0 the verifier never sees
/// the call.
#[unsafe(no_mangle)]
static LOXI_META_OK: u8 = 0;

/// Whether the TC hand-off carries [`Meta`] (see [`LOXI_META_OK`]).
#[inline(always)]
pub fn meta_ok() -> bool {
    // SAFETY: a plain read of a static; volatile so the compiler keeps the load the loader's
    // value decides (it would fold the default in).
    unsafe { core::ptr::read_volatile(&LOXI_META_OK) != 0 }
}

/// FIB lookup for `dst` arriving on `ingress` (own stack frame; touches only the context,
/// never packet data). `ctx` is the XDP or TC program's context. Returns false when the
/// kernel has no usable route or neighbour.
#[inline(never)]
fn fib(ctx: *mut c_void, ingress: u32, fam: u8, dst: &[u8; 16], out: *mut NextHop) -> bool {
    // Zero-filled with eight word stores: a zero-initialised struct compiles to a call of the
    // byte-at-a-time `memset` subprogram on BPF.
    let mut raw = MaybeUninit::<bpf_fib_lookup>::uninit();
    let w = raw.as_mut_ptr() as *mut u64;
    let mut i = 0;
    while i < 8 {
        // SAFETY: 8 words = the struct's 64 bytes (asserted above).
        unsafe { w.add(i).write_volatile(0) };
        i += 1;
    }
    // SAFETY: every byte written above; bpf_fib_lookup is plain data.
    let p = unsafe { raw.assume_init_mut() };
    p.ifindex = ingress;
    if fam == family::V6 {
        p.family = AF_INET6;
        let mut d = [0u32; 4];
        let mut i = 0;
        while i < 4 {
            d[i] = u32::from_ne_bytes([dst[4 * i], dst[4 * i + 1], dst[4 * i + 2], dst[4 * i + 3]]);
            i += 1;
        }
        p.__bindgen_anon_4.ipv6_dst = d;
    } else {
        p.family = AF_INET;
        p.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes([dst[0], dst[1], dst[2], dst[3]]);
    }
    // SAFETY: helper call with the context and a stack buffer of the declared size.
    let rc = unsafe {
        fib_lookup(
            ctx,
            p,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return false;
    }
    // SAFETY: `out` points at the caller's (uninitialised) NextHop; written field by field.
    unsafe {
        addr_of_mut!((*out).ifindex).write(p.ifindex);
        addr_of_mut!((*out).smac).write(p.smac);
        addr_of_mut!((*out).dmac).write(p.dmac);
    }
    true
}

/// A program context [`lookup`] runs in: the XDP program's or a TC program's.
pub trait FibCtx {
    /// Whether this is the XDP program, which sends through [`EGRESS_XDP`] (its lookups
    /// decide `NextHop`'s `XDP_OK`). Known at compile time: the TC programs' lookups do not
    /// touch the map.
    const XDP: bool;
    /// Whether lookups decide `NextHop`'s `PEER` from [`EGRESS_PEER`] (the TC data path's).
    const PEER: bool;
    /// Whether a failed lookup counts `fib_pass` (the caller passes the frame to the kernel):
    /// the XDP program's and the full TC program's (`crate::hook::TcFull`), not the hand-off
    /// TC program's, which looks up frames that may not be loxi's.
    const COUNTS_FIB_PASS: bool;
    /// The context pointer the FIB helper takes.
    fn raw(&self) -> *mut c_void;
    /// The interface the frame arrived on (the FIB lookup's input).
    fn ingress(&self) -> u32;
}

impl FibCtx for XdpContext {
    const XDP: bool = true;
    const PEER: bool = false;
    const COUNTS_FIB_PASS: bool = true;
    #[inline(always)]
    fn raw(&self) -> *mut c_void {
        self.ctx as *mut c_void
    }
    #[inline(always)]
    fn ingress(&self) -> u32 {
        // SAFETY: the context pointer is valid for the program's run.
        unsafe { (*self.ctx).ingress_ifindex }
    }
}

impl FibCtx for TcContext {
    const XDP: bool = false;
    const PEER: bool = false;
    const COUNTS_FIB_PASS: bool = false;
    #[inline(always)]
    fn raw(&self) -> *mut c_void {
        self.skb.skb as *mut c_void
    }
    #[inline(always)]
    fn ingress(&self) -> u32 {
        // SAFETY: the context pointer is valid for the program's run; a plain readable field.
        unsafe { (*self.skb.skb).ingress_ifindex }
    }
}

/// Looks up the next hop towards `dst` for the frame of `ctx` (route, neighbour and, in the
/// XDP program, whether the egress takes XDP frames; in the TC data path, whether it is a veth
/// with its peer elsewhere: [`NextHop::flags`]); `None` when the
/// kernel has none yet (counted where [`FibCtx::COUNTS_FIB_PASS`]: the caller passes the frame on).
#[inline(always)]
pub fn lookup<C: FibCtx>(ctx: &C, fam: u8, dst: &[u8; 16]) -> Option<NextHop> {
    // Not zero-filled first: that compiles to a call of the byte-at-a-time `memset` on BPF.
    let mut nh = MaybeUninit::<NextHop>::uninit();
    if !fib(ctx.raw(), ctx.ingress(), fam, dst, nh.as_mut_ptr()) {
        if C::COUNTS_FIB_PASS {
            count(ctr::FIB_PASS, 1);
        }
        return None;
    }
    let p = nh.as_mut_ptr();
    // SAFETY: fib wrote every other field; read-only lookups of a plain u32.
    unsafe {
        let ifindex = *addr_of!((*p).ifindex);
        let flags = if C::XDP && EGRESS_XDP.get_ifindex(ifindex).is_some() {
            nh_flags::XDP_OK
        } else if C::PEER && EGRESS_PEER.get(&ifindex).is_some() {
            nh_flags::PEER
        } else {
            0
        };
        addr_of_mut!((*p).flags).write(flags);
        addr_of_mut!((*p)._pad).write([0; 3]);
        Some(nh.assume_init())
    }
}

/// Writes the frame's Ethernet addresses: destination `dmac`, source `smac` (either hook).
#[inline(always)]
pub fn write_macs<C: Frame>(ctx: &C, smac: &[u8; 6], dmac: &[u8; 6]) -> Result<(), ParseError> {
    let eth: *mut [u8; 12] = ptr_at(ctx, 0)?;
    // SAFETY: 12 bytes checked by ptr_at.
    let eth = unsafe { &mut *eth };
    eth[..6].copy_from_slice(dmac);
    eth[6..].copy_from_slice(smac);
    Ok(())
}

/// Sends the frame to egress `ifindex` (MACs `smac` → `dmac`): `XDP_TX` out the ingress,
/// `bpf_redirect_map` through [`EGRESS_XDP`] where the egress takes XDP frames (`xdp_ok`), else
/// the TC hand-off. An egress that left the device map since `xdp_ok` was decided (a cached next
/// hop) is redirected by ifindex (`bpf_redirect`), as before the map.
#[inline(always)]
pub fn send(
    ctx: &XdpContext,
    ifindex: u32,
    smac: &[u8; 6],
    dmac: &[u8; 6],
    xdp_ok: bool,
) -> Result<u32, ParseError> {
    let ingress = ctx.ingress();
    // Make room for the hand-off metadata before touching the frame (it moves data_meta only).
    // A driver without metadata support refuses: then redirect anyway (counted). A kernel
    // that refuses the helper to XDP programs hands off without it (see `meta_ok`).
    let with_meta = meta_ok();
    let to_tc = !xdp_ok && (!with_meta || reserve_meta(ctx));
    write_macs(ctx, smac, dmac)?;
    if to_tc {
        if !with_meta {
            count(ctr::EGRESS_TC, 1);
            return Ok(xdp_action::XDP_PASS);
        }
        return Ok(hand_to_tc(ctx, ifindex));
    }
    if !xdp_ok {
        count(ctr::EGRESS_NO_META, 1);
    }
    if ifindex == ingress {
        count(ctr::TX, 1);
        return Ok(xdp_action::XDP_TX);
    }
    count(ctr::REDIRECT, 1);
    match EGRESS_XDP.redirect(ifindex, 0) {
        Ok(a) => Ok(a),
        // SAFETY: helper call; the kernel validates the ifindex.
        Err(_) => Ok(unsafe { bpf_redirect(ifindex, 0) } as u32),
    }
}

/// Grows the frame's metadata area by [`META_LEN`]; false when the driver does not support it.
#[inline(always)]
fn reserve_meta(ctx: &XdpContext) -> bool {
    // SAFETY: helper call with the program's context.
    unsafe { bpf_xdp_adjust_meta(ctx.ctx, -(META_LEN as i32)) == 0 }
}

/// Writes the hand-off metadata and passes the frame to the stack, where the TC program
/// redirects it to `ifindex`.
#[inline(always)]
fn hand_to_tc(ctx: &XdpContext, ifindex: u32) -> u32 {
    let meta = ctx.metadata();
    if meta + META_LEN > ctx.data() {
        // Cannot happen after a successful reserve_meta; the verifier needs the check.
        return xdp_action::XDP_DROP;
    }
    // SAFETY: META_LEN bytes of metadata checked against data above.
    unsafe {
        *(meta as *mut Meta) = Meta {
            magic: META_MAGIC,
            ifindex,
        };
    }
    count(ctr::EGRESS_TC, 1);
    xdp_action::XDP_PASS
}
