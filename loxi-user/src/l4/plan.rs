//! Pure translation of a rule snapshot into data-path map contents.
//!
//! Each kernel-served rule (mode ≠ 4) gets a stable slot (row of the endpoint table, RR cursor
//! and counters) for as long as its rule id exists, so updates rewrite rows in place and
//! established flows (which conntrack pins to addresses, not rows) are never dropped.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, UdpSocket},
};

use loxi_common::{
    maps::{EndpointValue, MAX_EPS, MAX_RULES, ServiceKey, ServiceValue, WRR_SLOTS, family, proto},
    mode,
};

use crate::rules::store::RuleSnapshot;

use super::L4Error;

/// One rule as the data path sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedService {
    /// `StoredRule::id` (metric label `service`).
    pub rule_id: u32,
    /// Service map key.
    pub key: ServiceKey,
    /// Service map value (slot, mode, sel, endpoint count).
    pub value: ServiceValue,
    /// Endpoint rows `0..value.nep`, in the user's order.
    pub endpoints: Vec<EndpointValue>,
    /// wrr table (first `value.wrr_len` entries used).
    pub wrr: [u8; WRR_SLOTS as usize],
    /// Active rows (first `value.nact` entries used).
    pub active: [u8; WRR_SLOTS as usize],
}

/// The whole desired state, keyed by service key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Kernel-served services.
    pub services: BTreeMap<[u8; 20], PlannedService>,
    /// Every VIP of the snapshot (all modes, including 4), for netlink, except those of L4
    /// rules left out (`skipped`).
    pub vips: BTreeSet<IpAddr>,
    /// L4 rules left out because the data path cannot hold them (rule id, why): the API
    /// refuses such rules, so only a state file or a race between two writes gets here. The
    /// other rules are programmed as usual.
    pub skipped: Vec<(u32, String)>,
}

/// Stable rule id → slot assignment.
#[derive(Debug, Default)]
pub struct SlotTable {
    slots: BTreeMap<u32, u32>,
}

impl SlotTable {
    /// The slot of `rule_id`, assigning the lowest free one if new.
    fn slot(&mut self, rule_id: u32) -> Result<u32, L4Error> {
        if let Some(s) = self.slots.get(&rule_id) {
            return Ok(*s);
        }
        let used: BTreeSet<u32> = self.slots.values().copied().collect();
        let free = (0..MAX_RULES)
            .find(|s| !used.contains(s))
            .ok_or(L4Error::Capacity {
                what: "rules".into(),
                value: self.slots.len() + 1,
                limit: MAX_RULES,
            })?;
        self.slots.insert(rule_id, free);
        Ok(free)
    }
    /// Forgets rules not in `live`.
    fn retain(&mut self, live: &BTreeSet<u32>) {
        self.slots.retain(|id, _| live.contains(id));
    }
}

/// 16 raw bytes of an address (IPv4 in the first 4).
pub fn addr_bytes(ip: IpAddr) -> [u8; 16] {
    let mut b = [0u8; 16];
    match ip {
        IpAddr::V4(v4) => b[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => b = v6.octets(),
    }
    b
}

/// The address in 16 raw bytes of `family` (`loxi_common::maps::family`; IPv4 in the first
/// 4): the inverse of [`addr_bytes`].
pub fn addr_ip(family: u8, a: &[u8; 16]) -> IpAddr {
    if family == loxi_common::maps::family::V6 {
        IpAddr::from(*a)
    } else {
        IpAddr::from([a[0], a[1], a[2], a[3]])
    }
}

/// Byte view of a service key (map ordering key).
pub fn key_bytes(k: &ServiceKey) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[..16].copy_from_slice(&k.addr);
    b[16..18].copy_from_slice(&k.port.to_ne_bytes());
    b[18] = k.proto;
    b[19] = k.family;
    b
}

/// The local address the kernel would use as source towards `dst` (route lookup through a
/// connected UDP socket; nothing is sent).
pub fn route_source(dst: IpAddr) -> Option<IpAddr> {
    let bind: IpAddr = if dst.is_ipv4() {
        [0, 0, 0, 0].into()
    } else {
        [0u16; 8].into()
    };
    let s = UdpSocket::bind((bind, 0)).ok()?;
    s.connect((dst, 9)).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}

fn proto_num(p: &str) -> Option<u8> {
    match p.to_ascii_lowercase().as_str() {
        "tcp" => Some(proto::TCP),
        "udp" => Some(proto::UDP),
        "sctp" => Some(proto::SCTP),
        _ => None,
    }
}

/// Builds the plan for `snap`. `snat_for(endpoint)` gives the LB address used as source in the
/// full-NAT family of modes (normally [`route_source`]). Rules whose VIP or protocol the data
/// path cannot carry (e.g. `protocol: "http"`) contribute only their VIP. A rule over the data
/// path's capacity (more than `MAX_EPS` endpoints, or no free slot of `MAX_RULES`) is left out
/// with its VIP and listed in [`Plan::skipped`]; one such rule never holds back the others.
pub fn plan(
    snap: &RuleSnapshot,
    slots: &mut SlotTable,
    snat_for: &dyn Fn(IpAddr) -> Option<IpAddr>,
) -> Plan {
    let mut out = Plan::default();
    // Free the slots of deleted rules first, so a snapshot that deletes and creates reuses them.
    let live: BTreeSet<u32> = snap
        .rules
        .values()
        .filter(|r| {
            r.rule.service.mode != mode::FULLPROXY && proto_num(&r.rule.service.protocol).is_some()
        })
        .map(|r| r.id)
        .collect();
    slots.retain(&live);
    for stored in snap.rules.values() {
        let svc = &stored.rule.service;
        let Ok(vip) = svc.external_ip.parse::<IpAddr>() else {
            continue;
        };
        let Some(p) = proto_num(&svc.protocol) else {
            out.vips.insert(vip);
            continue;
        };
        if svc.mode == mode::FULLPROXY {
            out.vips.insert(vip);
            continue;
        }
        // Endpoints first: a rule over the endpoint limit takes no slot.
        let (slot, eps) = match endpoints(stored.id, &stored.rule.endpoints, vip, snat_for)
            .and_then(|eps| Ok((slots.slot(stored.id)?, eps)))
        {
            Ok(v) => v,
            Err(e) => {
                out.skipped.push((stored.id, e.to_string()));
                continue;
            }
        };
        out.vips.insert(vip);
        let key = ServiceKey {
            addr: addr_bytes(vip),
            port: svc.port.to_be(),
            proto: p,
            family: if vip.is_ipv4() {
                family::V4
            } else {
                family::V6
            },
        };
        let (wrr, wrr_len) = wrr_table(&eps);
        let (active, nact) = active_table(&eps);
        let value = ServiceValue {
            slot,
            mode: svc.mode,
            sel: svc.sel,
            nep: eps.len() as u8,
            nact,
            idle_timeout_s: svc.inactive_timeout,
            wrr_len,
        };
        out.services.insert(
            key_bytes(&key),
            PlannedService {
                rule_id: stored.id,
                key,
                value,
                endpoints: eps,
                wrr,
                active,
            },
        );
    }
    out
}

/// The rows that take new flows, in order. Returns (table, count).
pub fn active_table(eps: &[EndpointValue]) -> ([u8; WRR_SLOTS as usize], u8) {
    let mut t = [0u8; WRR_SLOTS as usize];
    let mut n = 0u8;
    for (i, _) in eps.iter().enumerate().filter(|(_, e)| e.active != 0) {
        t[n as usize] = i as u8;
        n += 1;
    }
    (t, n)
}

/// The wrr table: each active row repeated `weight` times (scaled down proportionally, at least
/// once each, when the weights add up to more than `WRR_SLOTS`). Returns (table, used length).
pub fn wrr_table(eps: &[EndpointValue]) -> ([u8; WRR_SLOTS as usize], u32) {
    let mut t = [0u8; WRR_SLOTS as usize];
    let total: u64 = eps
        .iter()
        .filter(|e| e.active != 0)
        .map(|e| e.weight as u64)
        .sum();
    if total == 0 {
        return (t, 0);
    }
    let cap = WRR_SLOTS as u64;
    let mut n = 0usize;
    for (i, e) in eps.iter().enumerate().filter(|(_, e)| e.active != 0) {
        let share = if total <= cap {
            e.weight as u64
        } else {
            (e.weight as u64 * cap / total).max(1)
        };
        for _ in 0..share {
            if n < t.len() {
                t[n] = i as u8;
                n += 1;
            }
        }
    }
    (t, n as u32)
}

fn endpoints(
    rule_id: u32,
    eps: &[crate::rules::model::Endpoint],
    vip: IpAddr,
    snat_for: &dyn Fn(IpAddr) -> Option<IpAddr>,
) -> Result<Vec<EndpointValue>, L4Error> {
    if eps.len() > MAX_EPS as usize {
        return Err(L4Error::Capacity {
            what: format!("endpoints of rule {rule_id}"),
            value: eps.len(),
            limit: MAX_EPS,
        });
    }
    let mut out = Vec::with_capacity(eps.len());
    for e in eps {
        let ip = e
            .endpoint_ip
            .parse::<IpAddr>()
            .ok()
            .filter(|ip| ip.is_ipv4() == vip.is_ipv4());
        let snat = ip.and_then(snat_for).unwrap_or(vip);
        out.push(EndpointValue {
            addr: ip.map(addr_bytes).unwrap_or_default(),
            snat_addr: addr_bytes(snat),
            port: e.target_port.to_be(),
            weight: e.weight.clamp(1, u16::MAX as u32) as u16,
            // Unparseable / wrong-family endpoints (which validation refuses; kept as a guard)
            // and ones marked inactive take no new flows.
            active: u8::from(ip.is_some() && e.state.as_deref().is_none_or(|s| s != "inactive")),
            _pad: [0; 3],
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{LbRule, RuleSnapshot};

    fn rule(vip: &str, mode: u8) -> LbRule {
        serde_json::from_value(serde_json::json!({
            "serviceArguments": {"externalIP": vip, "port": 80, "protocol": "tcp", "mode": mode},
            "endpoints": [{"endpointIP": "10.9.0.2", "targetPort": 8080}]
        }))
        .expect("rule")
    }

    /// A rule over the data path's capacity is left out with its VIP, and every other rule,
    /// mode 4 included, is still planned (before, the whole snapshot was refused and the data
    /// path and the VIPs stayed as they were, whatever later changes said).
    /// A snapshot with one L4 rule more than the slots (the store refuses it; a state file
    /// written by an older loxi could hold it) and a mode-4 rule.
    fn over_capacity() -> RuleSnapshot {
        let mut rules = std::collections::BTreeMap::new();
        let mut add = |id: u32, r: LbRule| {
            let stored = crate::rules::StoredRule::new(id, r).expect("valid");
            rules.insert(stored.rule.key(), std::sync::Arc::new(stored));
        };
        for i in 0..=MAX_RULES {
            add(i + 1, rule(&format!("20.1.{}.{}", i / 250, i % 250 + 1), 0));
        }
        add(MAX_RULES + 2, rule("20.9.9.9", 4));
        RuleSnapshot { version: 1, rules }
    }

    #[test]
    fn a_rule_over_capacity_is_left_out_and_the_others_are_planned() {
        let mut snap = over_capacity();
        let mut slots = SlotTable::default();
        let p = plan(&snap, &mut slots, &|_| None);
        assert_eq!(p.services.len(), MAX_RULES as usize);
        assert_eq!(p.skipped.len(), 1, "{:?}", p.skipped);
        let (skipped, why) = &p.skipped[0];
        assert_eq!(why, "rules: 257 exceeds the data path limit 256");
        let vip_of = |id: u32| {
            let r = snap.rules.values().find(|r| r.id == id).expect("rule");
            r.rule.service.external_ip.parse::<IpAddr>().expect("ip")
        };
        assert!(!p.vips.contains(&vip_of(*skipped)), "its VIP is not added");
        assert!(p.vips.contains(&"20.9.9.9".parse::<IpAddr>().expect("ip")));
        assert_eq!(p.vips.len(), MAX_RULES as usize + 1);
        // Deleting a planned rule frees its slot for the one left out.
        let first = snap
            .rules
            .iter()
            .find(|(_, r)| r.id != *skipped)
            .map(|(k, _)| k.clone())
            .expect("key");
        snap.rules.remove(&first);
        snap.version += 1;
        let p = plan(&snap, &mut slots, &|_| None);
        assert!(p.skipped.is_empty(), "{:?}", p.skipped);
        assert_eq!(p.services.len(), MAX_RULES as usize);
    }
}
