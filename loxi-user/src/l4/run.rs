//! The L4 task: load + attach, reconcile maps and VIPs from every rule snapshot, fold counters,
//! retire unwanted reply-VIP entries ([`super::reply`]) and refresh the XDP-capable egress set
//! ([`super::egress`]) every stats tick, check the endpoints' managed neighbour entries
//! ([`super::neigh`]) at the ticks that call for it, detach and release VIPs on shutdown.
use std::sync::Arc;

use loxi_common::maps::ctr;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::netlink::VipManager;
use crate::rules::store::{Applied, RuleSnapshot};

use super::{
    ConntrackHandle, Datapath, L4Config, L4Error, L4Metrics, Plan, SlotTable, metrics::CounterFold,
    plan, route_source,
};

/// Runs the L4 data path until `shutdown` is cancelled (or the rule store goes away).
///
/// Errors: start-up only ([`L4Error::NoObject`], load/verifier failures, a missing
/// `--xdp-iface`/`--vip-iface` interface). Later map or netlink failures are logged and retried
/// on the next snapshot; the data path keeps serving what it has.
///
/// Once the program is loaded, its conntrack map is published in `conntrack` (for the API's
/// `GET /config/conntrack/all`); it is withdrawn when the data path stops. Each snapshot the
/// maps and VIPs have been reconciled with is marked in `applied`.
pub async fn run(
    cfg: L4Config,
    mut rules: watch::Receiver<Arc<RuleSnapshot>>,
    applied: Applied,
    metrics: L4Metrics,
    conntrack: ConntrackHandle,
    shutdown: CancellationToken,
) -> Result<(), L4Error> {
    let mut vips = match &cfg.vip_iface {
        Some(i) => {
            let record = cfg
                .vip_state_dir
                .as_deref()
                .map(|d| VipManager::record_file(d, i));
            Some(VipManager::new(i, record).await?)
        }
        None => None,
    };
    let links = if cfg.xdp_ifaces.is_empty() && cfg.tc_ifaces.is_empty() {
        None
    } else {
        Some(netlink_handle()?)
    };
    let mut dp = match links.as_ref() {
        Some(h) => Some(start_datapath(&cfg, &metrics, h).await?),
        None => None,
    };
    if let Some(d) = dp.as_ref() {
        conntrack.publish(d.conntrack_map_id()?);
    }
    let mut slots = SlotTable::default();
    let mut fold = CounterFold::default();
    let mut current = Plan::default();
    let mut tick = tokio::time::interval(cfg.stats_interval);
    let mut dirty = true;
    // Bumped whenever the plan changes; with `neigh`, when the managed neighbour entries are
    // checked (`neigh::due`).
    let mut plan_gen: u64 = 0;
    let mut neigh = super::neigh::Schedule::default();
    // `--xdp-iface` and `--tc-iface` interfaces currently absent (reported once each, until
    // they come back).
    let mut missing = std::collections::BTreeSet::new();
    loop {
        if dirty {
            let snap = rules.borrow_and_update().clone();
            let next = reconcile(&snap, &mut slots, dp.as_mut(), vips.as_mut()).await;
            if next != current {
                plan_gen += 1;
            }
            current = next;
            applied.mark(snap.version);
            dirty = false;
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            changed = rules.changed() => match changed {
                Ok(()) => dirty = true,
                Err(_) => break,
            },
            _ = tick.tick() => {
                if let Some(d) = dp.as_mut() {
                    let fib_pass_before = fold.last(ctr::FIB_PASS);
                    if let Err(e) = fold.fold(d, &current, &metrics) {
                        tracing::warn!(error = %e, "reading XDP counters");
                    }
                    let fib_pass_delta = fold.last(ctr::FIB_PASS).saturating_sub(fib_pass_before);
                    if let Err(e) = d.sync_reply_vips(&current, std::time::Instant::now()) {
                        tracing::warn!(error = %e, "updating the reply-VIP map");
                    }
                    if let Some(h) = links.as_ref() {
                        // One link dump a tick, for both checks.
                        let mut link_up = false;
                        match super::egress::links(h).await {
                            Ok(all) => {
                                link_up = keep_attached(d, &all, &cfg, &metrics, &mut missing);
                                refresh_egress(d, h, &all).await;
                            }
                            Err(e) => tracing::warn!(error = %e, "listing links for the XDP attachments and egress map"),
                        }
                        let now = std::time::Instant::now();
                        if neigh.due(plan_gen, fib_pass_delta, link_up, now) {
                            tracing::debug!(plan_gen, fib_pass_delta, link_up,
                                "checking the L4 endpoints' neighbour entries");
                            let ok = keep_resolved(h, &current).await;
                            neigh.ran(plan_gen, ok, now);
                        }
                    }
                }
            }
        }
    }
    // Last fold, so the metrics include the final packets.
    if let Some(d) = dp.as_ref()
        && let Err(e) = fold.fold(d, &current, &metrics)
    {
        tracing::warn!(error = %e, "reading XDP counters");
    }
    conntrack.withdraw();
    stop(dp, vips, &metrics).await
}

/// Gives the endpoints of `plan` their managed neighbour entries ([`super::neigh`]), logging
/// each one added; false when the address or neighbour dump failed.
async fn keep_resolved(h: &rtnetlink::Handle, plan: &Plan) -> bool {
    match super::neigh::keep_resolved(h, &super::neigh::endpoint_addrs(plan)).await {
        Ok(added) => {
            for (ifindex, ep) in added {
                tracing::info!(endpoint = %ep, ifindex,
                    "managed neighbour entry added for an L4 endpoint (the kernel resolves it and keeps it resolved)");
            }
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "listing addresses and neighbours for the L4 endpoints");
            false
        }
    }
}

/// Loads the data path and attaches it to every `--xdp-iface` and `--tc-iface` interface
/// (`h` finds the TC interfaces' indexes). An absent interface is an error.
async fn start_datapath(
    cfg: &L4Config,
    metrics: &L4Metrics,
    h: &rtnetlink::Handle,
) -> Result<Datapath, L4Error> {
    let mut dp = Datapath::load()?;
    for iface in &cfg.xdp_ifaces {
        let mode = dp.attach(iface, cfg.force_generic)?;
        metrics.set_attached(iface, mode, true);
    }
    if cfg.tc_ifaces.is_empty() {
        return Ok(dp);
    }
    let all = super::egress::links(h).await.map_err(|source| {
        L4Error::Netlink(crate::netlink::NetlinkError::Request {
            action: "list links".into(),
            iface: cfg.tc_ifaces.join(","),
            source,
        })
    })?;
    for iface in &cfg.tc_ifaces {
        let index = all
            .iter()
            .find(|l| {
                l.attributes.iter().any(|a| {
                    matches!(a, rtnetlink::packet_route::link::LinkAttribute::IfName(n) if n == iface)
                })
            })
            .map(|l| l.header.index)
            .ok_or_else(|| L4Error::NoInterface(iface.clone()))?;
        let mode = dp.attach_tc(iface, index)?;
        metrics.set_attached(iface, mode, true);
    }
    Ok(dp)
}

#[allow(
    clippy::disallowed_methods,
    reason = "rtnetlink's connection task ends when the handle it serves is dropped"
)]
fn netlink_handle() -> Result<rtnetlink::Handle, L4Error> {
    let (conn, handle, _) = rtnetlink::new_connection()
        .map_err(|e| L4Error::Netlink(crate::netlink::NetlinkError::Socket(e)))?;
    tokio::spawn(conn);
    Ok(handle)
}

/// Keeps every `--xdp-iface` and `--tc-iface` attached. An interface deleted and created again
/// (a veth pair recreated, a driver reloaded), or whose program was removed from outside, no
/// longer carries loxi's program: it is attached again here, at the next stats tick, and
/// logged. An interface that is absent is logged once and reported `loxilb_l4_xdp_attached 0`
/// until it comes back. Start-up still refuses an absent interface ([`start_datapath`]).
/// Returns whether it attached an interface again (a link came back).
fn keep_attached(
    dp: &mut Datapath,
    links: &[rtnetlink::packet_route::link::LinkMessage],
    cfg: &L4Config,
    metrics: &L4Metrics,
    missing: &mut std::collections::BTreeSet<String>,
) -> bool {
    let mut came_back = false;
    use rtnetlink::packet_route::link::LinkAttribute;
    let ours = dp.xdp_prog_id();
    let wanted = cfg
        .xdp_ifaces
        .iter()
        .map(|i| (i, false))
        .chain(cfg.tc_ifaces.iter().map(|i| (i, true)));
    for (iface, in_tc) in wanted {
        let hook = if in_tc { "TC" } else { "XDP" };
        let link = links.iter().find(|l| {
            l.attributes
                .iter()
                .any(|a| matches!(a, LinkAttribute::IfName(n) if n == iface))
        });
        let attached = dp.attachments().find(|(i, _)| i == iface).map(|(_, m)| m);
        let Some(link) = link else {
            if missing.insert(iface.clone()) {
                tracing::warn!(
                    iface,
                    hook,
                    "L4 interface is gone: the L4 data path serves nothing \
                    on it until it is back (then loxi attaches again)"
                );
                if let Some(m) = attached {
                    metrics.set_attached(iface, m, false);
                }
            }
            continue;
        };
        let index = link.header.index;
        let carried = if in_tc {
            dp.tc_attached(iface, index)
        } else {
            attached.is_some() && super::egress::carries_prog(link, ours)
        };
        if carried {
            continue;
        }
        if let Some(m) = dp.forget(iface) {
            metrics.set_attached(iface, m, false);
        }
        let again = if in_tc {
            dp.attach_tc(iface, index)
        } else {
            dp.attach(iface, cfg.force_generic)
        };
        match again {
            Ok(mode) => {
                tracing::warn!(
                    iface,
                    mode = mode.as_str(),
                    index,
                    "L4 interface had lost loxi's program (recreated, or detached from outside): attached again"
                );
                metrics.set_attached(iface, mode, true);
                missing.remove(iface);
                came_back = true;
            }
            Err(e) => {
                if missing.insert(iface.clone()) {
                    tracing::error!(iface, hook, error = %e,
                        "L4 interface lost loxi's program and attaching again failed; retrying every tick");
                }
            }
        }
    }
    came_back
}

/// Recomputes which egresses take XDP frames and updates the map (failures are logged; the
/// previous set stays, and an egress missing from it still delivers through TC).
async fn refresh_egress(
    dp: &mut Datapath,
    handle: &rtnetlink::Handle,
    links: &[rtnetlink::packet_route::link::LinkMessage],
) {
    let set = super::egress::xdp_capable(handle, links, &dp.native_ifaces()).await;
    if let Err(e) = dp.set_xdp_egress(&set) {
        tracing::warn!(error = %e, "updating the XDP egress map");
    }
    if let Err(e) = dp.set_peer_egress(&super::egress::peer_elsewhere(links)) {
        tracing::warn!(error = %e, "updating the peer egress map");
    }
}

async fn reconcile(
    snap: &RuleSnapshot,
    slots: &mut SlotTable,
    dp: Option<&mut Datapath>,
    vips: Option<&mut VipManager>,
) -> Plan {
    let p = plan(snap, slots, &route_source);
    for (rule, e) in &p.skipped {
        tracing::error!(rule, error = %e, version = snap.version,
            "rule NOT programmed into the L4 data path (over its capacity); the other rules are");
    }
    if let Some(d) = dp
        && let Err(e) = d.apply(&p)
    {
        tracing::error!(error = %e, version = snap.version, "programming XDP maps");
    }
    if let Some(v) = vips
        && let Err(e) = v.sync(&p.vips).await
    {
        tracing::error!(error = %e, "syncing VIPs");
    }
    tracing::debug!(
        version = snap.version,
        services = p.services.len(),
        "L4 reconciled"
    );
    p
}

async fn stop(
    dp: Option<Datapath>,
    vips: Option<VipManager>,
    metrics: &L4Metrics,
) -> Result<(), L4Error> {
    if let Some(mut v) = vips {
        v.release_all().await?;
    }
    if let Some(mut d) = dp {
        let att: Vec<(String, super::AttachMode)> =
            d.attachments().map(|(i, m)| (i.to_string(), m)).collect();
        d.detach_all()?;
        for (i, m) in att {
            metrics.set_attached(&i, m, false);
        }
    }
    Ok(())
}
