//! The TC ingress half of the hand-off to egresses without XDP receive
//! (`loxi_common::maps::egress`): a frame that carries loxi's metadata was already rewritten by
//! the XDP program; redirect its socket buffer to the egress the metadata names. Anything else
//! continues up the stack untouched.
use aya_ebpf::{bindings::TC_ACT_OK, helpers::generated::bpf_redirect, programs::TcContext};
use loxi_common::maps::{
    ctr,
    egress::{META_LEN, META_MAGIC, Meta},
};

use crate::maps::count;

/// The program body: `TC_ACT_REDIRECT` for handed-off frames, else `TC_ACT_OK`.
#[inline(always)]
pub fn try_tc(ctx: &TcContext) -> i32 {
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
    count(ctr::TC_REDIRECT, 1);
    // SAFETY: helper call; the kernel validates the ifindex.
    unsafe { bpf_redirect(m.ifindex, 0) as i32 }
}
