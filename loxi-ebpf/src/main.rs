//! loxi's XDP L4 data path: service lookup, in-kernel endpoint selection, conntrack and NAT
//! (modes 0 DNAT, 1 one-arm, 2 full-NAT, 3 DSR, 5 host one-arm). Mode 4 and all traffic that
//! matches no service is passed to the kernel untouched. A TC ingress program finishes
//! forwarding to egresses that take no XDP frames (veths with plain peers). The same data path
//! also runs whole in TC ingress (`loxi_tc_full`, [`hook`]) on interfaces named for it.
#![no_std]
#![no_main]
// Map keys/values are passed by reference on purpose: by-value would copy 40–56-byte structs
// onto the 512-byte BPF stack.
#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "by-value would copy 40–56-byte map structs onto the 512-byte BPF stack"
)]

mod csum;
mod ct;
mod flow;
mod fwd;
mod hook;
mod maps;
mod parse;
mod select;
mod tc;

use aya_ebpf::{
    bindings::xdp_action,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

/// XDP entry point (shim; all logic in [`flow::try_loxi`]).
#[xdp]
pub fn loxi_xdp(ctx: XdpContext) -> u32 {
    flow::try_loxi(&ctx).unwrap_or(xdp_action::XDP_DROP)
}

/// TC ingress entry point (shim; see [`tc::try_tc`]): finishes forwarding frames the XDP
/// program handed off because their egress takes no XDP frames.
#[classifier]
pub fn loxi_tc(ctx: TcContext) -> i32 {
    tc::try_tc(&ctx)
}

/// TC ingress entry point of the whole data path (shim; all logic in [`flow::try_loxi`], on
/// the socket buffer: [`hook::TcFull`]), for interfaces where the frame would reach TC anyway
/// (`--tc-iface`: egresses without XDP receive, where XDP would only hand off).
#[classifier]
pub fn loxi_tc_full(ctx: TcContext) -> i32 {
    let ctx = hook::TcFull(ctx);
    ctx.pull_headers();
    match flow::try_loxi(&ctx) {
        Ok(a) | Err(a) => a as i32,
    }
}

/// Pass-everything program for the peers of veths that receive redirected frames (a veth
/// delivers `bpf_redirect`ed frames only when its peer runs XDP).
#[xdp]
pub fn loxi_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Drop-everything-IP program: the packet sink of `scripts/bench-l4.sh` (the sender-only
/// baseline on the LB's ingress and the backend's end of the forwarded path), so the benchmark
/// measures the path up to a driver and nothing of what a receiver does with the packet. Frames
/// that are not IPv4/IPv6 (ARP) pass, so the sender's neighbour entries resolve.
#[xdp]
pub fn loxi_drop(ctx: XdpContext) -> u32 {
    match parse::ptr_at::<[u8; 2], _>(&ctx, 12) {
        // SAFETY: ptr_at checked the bounds.
        Ok(et) => match unsafe { *et } {
            [0x08, 0x00] | [0x86, 0xdd] => xdp_action::XDP_DROP,
            _ => xdp_action::XDP_PASS,
        },
        Err(_) => xdp_action::XDP_DROP,
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // SAFETY: the program contains no reachable panics (the verifier rejects what it cannot
    // prove bounded); this only satisfies `no_std`.
    unsafe { core::hint::unreachable_unchecked() }
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
