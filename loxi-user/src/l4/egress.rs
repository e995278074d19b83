//! Which egress interfaces take XDP frames (`loxi_common::maps::egress` explains why it
//! matters): the set the loader writes into `LOXI_EGRESS_XDP`.
//!
//! An interface is in the set when
//! - it is a veth whose peer (in this or another network namespace, asked over rtnetlink with
//!   `IFLA_TARGET_NETNSID`) has a native (driver-mode) XDP program: that is what starts the
//!   peer's NAPI receive path that `bpf_redirect`/`XDP_TX` frames need;
//! - it is not a veth and loxi attached its program to it natively (the driver implements
//!   XDP, and its XDP transmit rings exist).
//!
//! Everything else (veths with plain peers, as containers and pods have; devices loxi did not
//! attach to) gets the TC hand-off, which delivers on any device at socket-buffer cost. A peer
//! with GRO switched on would also take XDP frames, but GRO is not visible over rtnetlink, so
//! such a peer is treated as plain: correct, only slower. The set is recomputed at every stats
//! tick (1 s, [`super::run`]), so a peer that gains or loses its program moves between the paths.

use std::collections::BTreeSet;

use futures::TryStreamExt as _;
use rtnetlink::Handle;
use rtnetlink::packet_route::link::{
    InfoKind, LinkAttribute, LinkInfo, LinkMessage, LinkXdp, XdpAttached,
};

/// Every link of this namespace (one rtnetlink dump).
pub async fn links(handle: &Handle) -> Result<Vec<LinkMessage>, rtnetlink::Error> {
    handle.link().get().execute().try_collect().await
}

/// The ifindexes among `links` (this namespace's, [`links`]) whose egress takes XDP frames;
/// `native` names the interfaces loxi attached its program to in driver mode. `handle` asks
/// for veth peers in other namespaces.
pub async fn xdp_capable(
    handle: &Handle,
    links: &[LinkMessage],
    native: &BTreeSet<String>,
) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    for l in links {
        let index = l.header.index;
        let capable = match veth_peer(l) {
            Some((peer, nsid)) => peer_has_native_xdp(handle, peer, nsid).await,
            None => l
                .attributes
                .iter()
                .any(|a| matches!(a, LinkAttribute::IfName(n) if native.contains(n))),
        };
        if capable {
            out.insert(index);
        }
    }
    out
}

/// The ifindexes among `links` (this namespace's, [`links`]) that are veths whose peer is in
/// another network namespace (rtnetlink reports the peer's namespace id): the set the loader
/// writes into `LOXI_EGRESS_PEER`, for the TC data path's `bpf_redirect_peer`.
pub fn peer_elsewhere(links: &[LinkMessage]) -> BTreeSet<u32> {
    links
        .iter()
        .filter(|l| matches!(veth_peer(l), Some((_, Some(_)))))
        .map(|l| l.header.index)
        .collect()
}

/// `(peer ifindex, peer namespace id)` of a veth; the id is `None` in the same namespace.
fn veth_peer(l: &LinkMessage) -> Option<(u32, Option<i32>)> {
    let is_veth = l.attributes.iter().any(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos
            .iter()
            .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth))),
        _ => false,
    });
    if !is_veth {
        return None;
    }
    let mut peer = None;
    let mut nsid = None;
    for a in &l.attributes {
        match a {
            LinkAttribute::Link(p) => peer = Some(*p),
            LinkAttribute::LinkNetNsId(n) => nsid = Some(*n),
            _ => {}
        }
    }
    peer.map(|p| (p, nsid))
}

/// Whether the veth peer `index` (namespace `nsid`) runs a driver-mode XDP program. Unknown
/// (the peer vanished, no permission) counts as no.
async fn peer_has_native_xdp(handle: &Handle, index: u32, nsid: Option<i32>) -> bool {
    let mut req = handle.link().get().match_index(index);
    if let Some(n) = nsid {
        req.message_mut()
            .attributes
            .push(LinkAttribute::IfNetnsId(n));
    }
    match req.execute().try_next().await {
        Ok(Some(peer)) => has_native_xdp(&peer),
        Ok(None) | Err(_) => false,
    }
}

/// Whether program `prog_id` is attached to the link, in any mode.
pub(crate) fn carries_prog(l: &LinkMessage, prog_id: u32) -> bool {
    l.attributes.iter().any(|a| match a {
        LinkAttribute::Xdp(xdp) => xdp.iter().any(|x| {
            matches!(x, LinkXdp::ProgId(id) | LinkXdp::DrvProgId(id) | LinkXdp::SkbProgId(id)
                if *id == prog_id)
        }),
        _ => false,
    })
}

/// A driver-mode program on the link (alone, or among several attachment modes).
pub(crate) fn has_native_xdp(l: &LinkMessage) -> bool {
    l.attributes.iter().any(|a| match a {
        LinkAttribute::Xdp(xdp) => xdp.iter().any(|x| {
            matches!(x, LinkXdp::Attached(XdpAttached::Driver))
                || matches!(x, LinkXdp::DrvProgId(id) if *id != 0)
        }),
        _ => false,
    })
}
