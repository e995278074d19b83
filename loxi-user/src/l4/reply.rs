//! Deferred reply entries of DNAT flows: what the loader keeps in `LOXI_REPLY_VIP`
//! ([`loxi_common::maps::MAP_REPLY_VIP`]).
//!
//! A new DNAT flow normally costs two conntrack inserts, one per direction; inserts are most
//! of a new flow's program time (issue 17 §4's profile). When the flow's endpoint is listed in
//! `LOXI_REPLY_VIP` with the flow's VIP, the program inserts only the forward entry; the
//! reply entry is built from it at the flow's first reply (the reply misses conntrack, the map
//! gives the VIP, which completes the forward key). A flow that never answers (a UDP probe, a
//! spoofed SYN) then holds one entry instead of two.
//!
//! The map must not lose an entry while a deferred flow may still need it: [`ReplyVipTable`]
//! adds an entry for each DNAT endpoint of the plan that exactly one VIP reaches (an endpoint
//! shared by several VIPs defers for none: its flows insert both entries, and an insert
//! replaces whatever entry of an earlier flow is under the reply key), and retires an entry
//! only after no plan has wanted it for [`RETIRE_AFTER`]: the loader then inserts the reply
//! entry of every deferred flow of that pair itself
//! ([`crate::l4::Datapath::sync_reply_vips`]) before it deletes the map entry.
//!
//! A deferred flow does not look for an entry of an earlier flow under its reply key (that
//! look was a second conntrack bucket miss, ~15 % of a new flow's cost in the threaded-NAPI
//! flood of `scripts/bench-l4.sh`). That is sound because such an entry can only be this
//! VIP's:
//! - the loader inserts an endpoint's pair only when a walk of conntrack finds no live DNAT
//!   entry of a flow between that endpoint and another VIP ([`is_foreign`]; flows of a deleted
//!   rule live on in conntrack, so the insert waits for them, retried every [`RETRY_AFTER`]; a
//!   walk cut off by its bound counts as finding one);
//! - no other VIP reaches the endpoint while the pair is listed: a plan in which another VIP
//!   gains it retires the pair in the same apply, without the grace (walk, delete, walk again
//!   for the flows that deferred during the first walk), and an entry once unwanted is retired
//!   even if a later plan wants it again, so only a fresh insert, with its walk, lists it.
//!   One exception: a retirement walk cut off by its bound (only under churn of twice the
//!   map's capacity during one walk) keeps the pair until the next stats tick's walk (1 s):
//!   deleting it would leave the deferred flows the walk did not reach, which have not
//!   answered yet, with no reply path at all; keeping it lets another VIP's flow from the same
//!   client port own the reply key of a flow of this VIP meanwhile, which needs one client
//!   port talking to both VIPs through the endpoint within that second.
//!
//! An entry of this VIP rewrites replies as the new flow's own would (same VIP, endpoint and
//! client port); one left idle past its timeout is refreshed from the new flow's forward entry
//! or replaced at the first reply (`decide` in `loxi-ebpf/src/flow.rs`). Such an entry exists
//! only when the LRU evicted its flow's forward entry alone, and what carries over from it to
//! the new flow is its packet counts, its FIN bit (an endpoint FIN of the new flow then does
//! not shorten the timeouts) and, if the rule was re-planned into another slot since, its
//! endpoint row for the per-endpoint counters until it is refreshed.
//! The windows left are a packet's run: a flow of the other VIP whose program run read the
//! endpoint rows just before a plan change and inserts its entries after the walk passed
//! their bucket, or a flow of the listed VIP that read the map entry just before the delete
//! and inserts after the second walk passed its bucket (microseconds, against walks of
//! milliseconds).
//!
//! What deferral gives up: a reply finds its flow only through the forward entry, so a flow
//! whose forward entry is gone before its first reply (evicted by the LRU under a flood of new
//! flows) has that reply passed to the kernel un-NATed, where an entry inserted at creation
//! would still have rewritten it. Under such a flood, deferral also halves the entries each
//! unanswered flow takes.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use loxi_common::{
    maps::{CtKey, CtValue, ServiceKey, dir, nat_other_key},
    mode,
};

use super::{Plan, plan::key_bytes};

/// How long an entry no plan wants stays before it is retired: longer than any packet that
/// read the endpoint table before the change takes to finish (microseconds), so no flow is
/// deferred against an entry after its retirement scan.
pub const RETIRE_AFTER: Duration = Duration::from_secs(2);

/// The DNAT endpoints of `p` as replies leave them (address, port — the service port when the
/// rule gives none — protocol and family of the service), each with the VIPs whose DNAT rules
/// have it, in service-key order.
pub fn candidates(p: &Plan) -> BTreeMap<[u8; 20], (ServiceKey, Vec<ServiceKey>)> {
    let mut out: BTreeMap<[u8; 20], (ServiceKey, Vec<ServiceKey>)> = BTreeMap::new();
    for svc in p.services.values() {
        if svc.value.mode != mode::DNAT {
            continue;
        }
        for e in &svc.endpoints {
            let ep = ServiceKey {
                addr: e.addr,
                port: if e.port == 0 { svc.key.port } else { e.port },
                proto: svc.key.proto,
                family: svc.key.family,
            };
            let (_, vips) = out.entry(key_bytes(&ep)).or_insert((ep, Vec::new()));
            if !vips.contains(&svc.key) {
                vips.push(svc.key);
            }
        }
    }
    out
}

/// How long a pair whose endpoint another VIP's live flow still reaches waits before the
/// loader walks conntrack for it again ([`ReplyVipTable::wait`]): a walk of a full map is
/// ~130 k syscalls, and such flows (of a deleted rule) can live for the rule's idle timeout.
pub const RETRY_AFTER: Duration = Duration::from_secs(10);

/// One entry of the map as the loader wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    ep: ServiceKey,
    vip: ServiceKey,
    /// When the plans stopped wanting this pair (`None` while wanted).
    unwanted_since: Option<Instant>,
}

/// Map changes one [`ReplyVipTable::step`] asks for.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReplyVipSteps {
    /// (endpoint, VIP) pairs to insert.
    pub insert: Vec<(ServiceKey, ServiceKey)>,
    /// (endpoint, VIP) pairs to retire: give their deferred flows reply entries, then delete.
    pub retire: Vec<(ServiceKey, ServiceKey)>,
}

/// The loader's copy of `LOXI_REPLY_VIP`, and the rules for changing it (module doc).
#[derive(Debug, Default)]
pub struct ReplyVipTable {
    entries: BTreeMap<[u8; 20], Entry>,
    /// Endpoints whose pair waits for another VIP's flows to end, with the time of the next
    /// try ([`Self::wait`]).
    waiting: BTreeMap<[u8; 20], Instant>,
}

impl ReplyVipTable {
    /// What to change for plan `p` at time `now`: every candidate endpoint that one VIP
    /// reaches gets an entry if it has none; an entry whose VIP another VIP now shares the
    /// endpoint with is retired at once (its VIP's flows go on deferring until the map entry
    /// is deleted, while the other VIP's flows may leave reply entries for the same client
    /// ports); an entry whose VIP no longer reaches the endpoint is retired once it has been
    /// unwanted for [`RETIRE_AFTER`]. An unwanted entry is retired even if a later plan wants
    /// it again: another VIP may have reached the endpoint meanwhile, and only a new insert
    /// checks for its flows ([`crate::l4::Datapath::sync_reply_vips`]). An entry is never
    /// repointed to another VIP while it exists. Call [`Self::inserted`] / [`Self::retired`]
    /// for the changes that took.
    pub fn step(&mut self, p: &Plan, now: Instant) -> ReplyVipSteps {
        let cands = candidates(p);
        let mut steps = ReplyVipSteps::default();
        for (kb, e) in &mut self.entries {
            let vips = cands.get(kb).map_or(&[][..], |(_, vips)| &vips[..]);
            if vips == [e.vip] && e.unwanted_since.is_none() {
                continue;
            }
            let since = *e.unwanted_since.get_or_insert(now);
            if vips.len() > 1 || now.saturating_duration_since(since) >= RETIRE_AFTER {
                steps.retire.push((e.ep, e.vip));
            }
        }
        self.waiting
            .retain(|kb, _| cands.get(kb).is_some_and(|(_, vips)| vips.len() == 1));
        for (kb, (ep, vips)) in &cands {
            if let [vip] = vips[..]
                && !self.entries.contains_key(kb)
                && self.waiting.get(kb).is_none_or(|t| now >= *t)
            {
                steps.insert.push((*ep, vip));
            }
        }
        steps
    }

    /// Records that `ep`'s pair was not inserted at `now` because another VIP's live flow
    /// reaches the endpoint: [`Self::step`] offers it again from `now +` [`RETRY_AFTER`] (or
    /// at once if the plans change who reaches the endpoint and back).
    pub fn wait(&mut self, ep: &ServiceKey, now: Instant) {
        self.waiting.insert(key_bytes(ep), now + RETRY_AFTER);
    }

    /// Records that `(ep, vip)` is in the map.
    pub fn inserted(&mut self, ep: ServiceKey, vip: ServiceKey) {
        self.waiting.remove(&key_bytes(&ep));
        self.entries.insert(
            key_bytes(&ep),
            Entry {
                ep,
                vip,
                unwanted_since: None,
            },
        );
    }

    /// Records that `ep`'s entry left the map.
    pub fn retired(&mut self, ep: &ServiceKey) {
        self.entries.remove(&key_bytes(ep));
    }

    /// The (endpoint, VIP) pairs in the map.
    pub fn pairs(&self) -> impl Iterator<Item = (ServiceKey, ServiceKey)> + '_ {
        self.entries.values().map(|e| (e.ep, e.vip))
    }
}

/// True when `(k, v)` is the forward entry of a DNAT flow from VIP `vip` to endpoint `ep`
/// (the flows [`ReplyVipTable`] pairs may have deferred).
pub fn is_deferrable(k: &CtKey, v: &CtValue, ep: &ServiceKey, vip: &ServiceKey) -> bool {
    v.dir == dir::FWD
        && v.mode == mode::DNAT
        && k.proto == ep.proto
        && k.family == ep.family
        && v.ndaddr == ep.addr
        && v.ndport == ep.port
        && k.daddr == vip.addr
        && k.dport == vip.port
}

/// True when `(k, v)` is a conntrack entry of a DNAT flow between endpoint `ep` and a VIP
/// other than `vip`: its forward entry (to that VIP, rewritten to `ep`) or its reply entry
/// (from `ep`, rewritten to come from that VIP). While such a flow lives, `(ep, vip)` is not
/// listed: its reply entry would catch the replies of a deferred flow of `vip` from the same
/// client port (module doc).
pub fn is_foreign(k: &CtKey, v: &CtValue, ep: &ServiceKey, vip: &ServiceKey) -> bool {
    if v.mode != mode::DNAT || k.proto != ep.proto || k.family != ep.family {
        return false;
    }
    if v.dir == dir::FWD {
        v.ndaddr == ep.addr && v.ndport == ep.port && (k.daddr, k.dport) != (vip.addr, vip.port)
    } else {
        k.saddr == ep.addr && k.sport == ep.port && (v.nsaddr, v.nsport) != (vip.addr, vip.port)
    }
}

/// True when `rv`, found under the reply key of forward key `k`, is that flow's reply entry
/// (and not a leftover of an earlier flow of the same client port through another VIP).
pub fn is_reply_of(rv: &CtValue, k: &CtKey) -> bool {
    rv.dir == dir::REV
        && rv.nsaddr == k.daddr
        && rv.nsport == k.dport
        && rv.ndaddr == k.saddr
        && rv.ndport == k.sport
}

/// The reply entry of the DNAT flow whose forward entry is `(k, v)`: key endpoint → client,
/// value rewriting the source back to the VIP, the flow's timeout, rule and endpoint, its idle
/// clock (`last_ns`), no state bits (this direction has sent no FIN), no packets and an empty
/// next-hop cache. The same entry the data
/// path inserts at a deferred flow's first reply (`late_reply` in `loxi-ebpf/src/ct.rs`), less
/// that packet's count.
pub fn reply_entry(k: &CtKey, v: &CtValue) -> (CtKey, CtValue) {
    let rk = nat_other_key(k, v);
    let rv = CtValue {
        last_ns: v.last_ns,
        nsaddr: k.daddr,
        ndaddr: k.saddr,
        nsport: k.dport,
        ndport: k.sport,
        dir: dir::REV,
        state: 0,
        ep: v.ep,
        mode: v.mode,
        slot: v.slot,
        timeout_s: v.timeout_s,
        ..CtValue::default()
    };
    (rk, rv)
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use loxi_common::maps::{EndpointValue, ServiceValue, WRR_SLOTS, family, proto};

    use super::*;
    use crate::l4::{PlannedService, plan::addr_bytes};

    fn key(ip: [u8; 4], port: u16) -> ServiceKey {
        ServiceKey {
            addr: addr_bytes(IpAddr::V4(Ipv4Addr::from(ip))),
            port: port.to_be(),
            proto: proto::UDP,
            family: family::V4,
        }
    }

    fn ep(ip: [u8; 4], port: u16) -> EndpointValue {
        EndpointValue {
            addr: addr_bytes(IpAddr::V4(Ipv4Addr::from(ip))),
            port: port.to_be(),
            weight: 1,
            active: 1,
            ..EndpointValue::default()
        }
    }

    /// The forward conntrack key of a UDP flow from `client` to `to`.
    fn fwd_key(client: ServiceKey, to: ServiceKey) -> CtKey {
        CtKey {
            saddr: client.addr,
            daddr: to.addr,
            sport: client.port,
            dport: to.port,
            proto: proto::UDP,
            family: family::V4,
            _pad: [0; 2],
        }
    }

    /// A plan of `(vip, mode, endpoints)` services.
    fn plan_of(svcs: &[(ServiceKey, u8, Vec<EndpointValue>)]) -> Plan {
        let mut p = Plan::default();
        for (i, (k, m, eps)) in svcs.iter().enumerate() {
            p.services.insert(
                key_bytes(k),
                PlannedService {
                    rule_id: i as u32,
                    key: *k,
                    value: ServiceValue {
                        slot: i as u32,
                        mode: *m,
                        nep: eps.len() as u8,
                        ..ServiceValue::default()
                    },
                    endpoints: eps.clone(),
                    wrr: [0; WRR_SLOTS as usize],
                    active: [0; WRR_SLOTS as usize],
                },
            );
        }
        p
    }

    #[test]
    fn dnat_endpoints_are_candidates_with_every_vip_and_the_service_port_for_port_0() {
        let (a, b) = (key([20, 0, 0, 1], 53), key([20, 0, 0, 2], 53));
        let p = plan_of(&[
            (
                a,
                mode::DNAT,
                vec![ep([10, 0, 1, 2], 8053), ep([10, 0, 1, 3], 0)],
            ),
            (b, mode::DNAT, vec![ep([10, 0, 1, 2], 8053)]),
            // Full NAT and DSR flows always insert both entries: never candidates.
            (
                key([20, 0, 0, 3], 53),
                mode::FULLNAT,
                vec![ep([10, 0, 1, 9], 53)],
            ),
            (
                key([20, 0, 0, 4], 53),
                mode::DSR,
                vec![ep([10, 0, 1, 8], 53)],
            ),
        ]);
        let c = candidates(&p);
        assert_eq!(c.len(), 2);
        let shared = &c[&key_bytes(&key([10, 0, 1, 2], 8053))];
        assert_eq!(shared.1, vec![a, b]);
        // targetPort 0 keeps the service port, which is what replies leave from.
        let same_port = &c[&key_bytes(&key([10, 0, 1, 3], 53))];
        assert_eq!(same_port.1, vec![a]);
    }

    #[test]
    fn entries_are_added_kept_while_wanted_and_retired_only_after_the_grace() {
        let vip = key([20, 0, 0, 1], 53);
        let e = ep([10, 0, 1, 2], 8053);
        let epk = key([10, 0, 1, 2], 8053);
        let with = plan_of(&[(vip, mode::DNAT, vec![e])]);
        let without = Plan::default();
        let mut t = ReplyVipTable::default();
        let t0 = Instant::now();
        let s = t.step(&with, t0);
        assert_eq!(s.insert, vec![(epk, vip)]);
        assert!(s.retire.is_empty());
        t.inserted(epk, vip);
        assert_eq!(t.step(&with, t0), ReplyVipSteps::default());
        // Unwanted: kept through the grace, then retired, also when a plan within the grace
        // wants it again (another VIP may have reached the endpoint meanwhile: only a new
        // insert checks for its flows); then re-added.
        assert_eq!(t.step(&without, t0), ReplyVipSteps::default());
        let late = t0 + RETIRE_AFTER - Duration::from_millis(1);
        assert_eq!(t.step(&without, late), ReplyVipSteps::default());
        assert_eq!(t.step(&with, late), ReplyVipSteps::default());
        let s = t.step(&with, t0 + RETIRE_AFTER);
        assert_eq!(s.retire, vec![(epk, vip)]);
        t.retired(&epk);
        assert_eq!(t.pairs().count(), 0);
        assert_eq!(t.step(&with, t0 + RETIRE_AFTER).insert, vec![(epk, vip)]);
    }

    #[test]
    fn an_entry_is_never_repointed_while_its_vip_may_have_deferred_flows() {
        let (a, b) = (key([20, 0, 0, 1], 53), key([20, 0, 0, 2], 53));
        let e = ep([10, 0, 1, 2], 8053);
        let epk = key([10, 0, 1, 2], 8053);
        let mut t = ReplyVipTable::default();
        let t0 = Instant::now();
        t.step(&plan_of(&[(a, mode::DNAT, vec![e])]), t0);
        t.inserted(epk, a);
        // The endpoint moves from VIP a to VIP b: a's entry stays until retired, b's flows
        // insert both entries meanwhile (nothing to insert), then b gets the entry.
        let moved = plan_of(&[(b, mode::DNAT, vec![e])]);
        assert_eq!(t.step(&moved, t0), ReplyVipSteps::default());
        let s = t.step(&moved, t0 + RETIRE_AFTER);
        assert_eq!(s.retire, vec![(epk, a)]);
        assert!(s.insert.is_empty());
        t.retired(&epk);
        assert_eq!(t.step(&moved, t0 + RETIRE_AFTER).insert, vec![(epk, b)]);
    }

    #[test]
    fn an_endpoint_a_second_vip_reaches_gets_no_entry_and_loses_the_one_it_had() {
        let (a, b) = (key([20, 0, 0, 1], 53), key([20, 0, 0, 2], 53));
        let e = ep([10, 0, 1, 2], 8053);
        let epk = key([10, 0, 1, 2], 8053);
        let both = plan_of(&[(a, mode::DNAT, vec![e]), (b, mode::DNAT, vec![e])]);
        let mut t = ReplyVipTable::default();
        let t0 = Instant::now();
        assert_eq!(t.step(&both, t0), ReplyVipSteps::default());
        t.step(&plan_of(&[(a, mode::DNAT, vec![e])]), t0);
        t.inserted(epk, a);
        // b gains the endpoint: a's entry is retired at once (no grace: a's flows go on
        // deferring until it is deleted, and b's may leave reply entries for the same client
        // ports), and none is added while both VIPs reach it.
        let s = t.step(&both, t0);
        assert_eq!(s.retire, vec![(epk, a)]);
        assert!(s.insert.is_empty());
        t.retired(&epk);
        assert_eq!(t.step(&both, t0), ReplyVipSteps::default());
    }

    #[test]
    fn a_waiting_pair_is_offered_again_after_the_retry_delay() {
        let vip = key([20, 0, 0, 1], 53);
        let e = ep([10, 0, 1, 2], 8053);
        let epk = key([10, 0, 1, 2], 8053);
        let with = plan_of(&[(vip, mode::DNAT, vec![e])]);
        let mut t = ReplyVipTable::default();
        let t0 = Instant::now();
        assert_eq!(t.step(&with, t0).insert, vec![(epk, vip)]);
        t.wait(&epk, t0);
        assert!(t.step(&with, t0 + RETRY_AFTER / 2).insert.is_empty());
        assert_eq!(t.step(&with, t0 + RETRY_AFTER).insert, vec![(epk, vip)]);
        // A plan where another VIP reaches the endpoint too forgets the wait.
        let other = key([20, 0, 0, 2], 53);
        t.step(
            &plan_of(&[(vip, mode::DNAT, vec![e]), (other, mode::DNAT, vec![e])]),
            t0,
        );
        t.wait(&epk, t0);
        t.step(
            &plan_of(&[(vip, mode::DNAT, vec![e]), (other, mode::DNAT, vec![e])]),
            t0,
        );
        assert_eq!(t.step(&with, t0).insert, vec![(epk, vip)]);
    }

    #[test]
    fn foreign_entries_are_another_vip_s_dnat_entries_of_the_endpoint() {
        let client = key([192, 168, 0, 1], 40000);
        let (vip, other) = (key([20, 0, 0, 1], 53), key([20, 0, 0, 2], 53));
        let epk = key([10, 0, 1, 2], 8053);
        let fwd = |to: ServiceKey| {
            let k = fwd_key(client, to);
            let v = CtValue {
                nsaddr: client.addr,
                nsport: client.port,
                ndaddr: epk.addr,
                ndport: epk.port,
                dir: dir::FWD,
                mode: mode::DNAT,
                ..CtValue::default()
            };
            (k, v)
        };
        let (ok, ov) = fwd(other);
        let (mk, mv) = fwd(vip);
        assert!(is_foreign(&ok, &ov, &epk, &vip));
        assert!(!is_foreign(&mk, &mv, &epk, &vip), "the pair's own VIP");
        let (rk, rv) = reply_entry(&ok, &ov);
        assert!(is_foreign(&rk, &rv, &epk, &vip));
        let (mrk, mrv) = reply_entry(&mk, &mv);
        assert!(!is_foreign(&mrk, &mrv, &epk, &vip));
        // Another endpoint, or another mode, is not the pair's business.
        assert!(!is_foreign(&ok, &ov, &key([10, 0, 1, 3], 8053), &vip));
        let full_nat = CtValue {
            mode: mode::FULLNAT,
            ..ov
        };
        assert!(!is_foreign(&ok, &full_nat, &epk, &vip));
    }

    #[test]
    fn the_reply_entry_reverses_the_forward_entry_of_a_dnat_flow() {
        let client = key([192, 168, 0, 1], 40000);
        let vip = key([20, 0, 0, 1], 53);
        let epk = key([10, 0, 1, 2], 8053);
        let fk = fwd_key(client, vip);
        let fv = CtValue {
            last_ns: 77,
            nsaddr: client.addr,
            ndaddr: epk.addr,
            nsport: client.port,
            ndport: epk.port,
            dir: dir::FWD,
            ep: 3,
            mode: mode::DNAT,
            slot: 5,
            timeout_s: 60,
            packets: 9,
            bytes: 900,
            nh_ns: 5,
            nh_ifindex: 2,
            ..CtValue::default()
        };
        assert!(is_deferrable(&fk, &fv, &epk, &vip));
        assert!(!is_deferrable(&fk, &fv, &epk, &key([20, 0, 0, 2], 53)));
        assert!(!is_deferrable(
            &fk,
            &CtValue {
                dir: dir::REV,
                ..fv
            },
            &epk,
            &vip
        ));
        let (rk, rv) = reply_entry(&fk, &fv);
        assert_eq!(
            (rk.saddr, rk.sport, rk.daddr, rk.dport),
            (epk.addr, epk.port, client.addr, client.port)
        );
        assert_eq!(
            (rv.nsaddr, rv.nsport, rv.ndaddr, rv.ndport),
            (vip.addr, vip.port, client.addr, client.port)
        );
        assert_eq!(
            (rv.dir, rv.ep, rv.slot, rv.timeout_s, rv.last_ns),
            (dir::REV, 3, 5, 60, 77)
        );
        let fin = CtValue {
            state: loxi_common::maps::ct_state::FIN,
            timeout_s: 10,
            ..fv
        };
        let (_, rv_fin) = reply_entry(&fk, &fin);
        assert_eq!(
            (rv_fin.state, rv_fin.timeout_s),
            (0, 10),
            "timeout kept, FIN bit not"
        );
        assert!(is_reply_of(&rv, &fk));
        assert!(!is_reply_of(&rv, &CtKey { sport: 1, ..fk }));
        assert_eq!(
            (rv.packets, rv.bytes, rv.nh_ns, rv.nh_ifindex),
            (0, 0, 0, 0)
        );
    }
}
