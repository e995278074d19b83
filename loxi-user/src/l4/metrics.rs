//! Prometheus metrics of the L4 data path, folded from the program's per-CPU counters.
//!
//! Families (prometheus-client appends `_total` to counters):
//! - `loxilb_l4_events_total{event}`: global data-path counters (`rx`, `pass`, `nat_fwd`, …),
//! - `loxilb_l4_endpoint_packets_total{service,endpoint}` / `..._bytes_total`: per endpoint,
//! - `loxilb_l4_xdp_attached{iface,mode}`: 1 while attached in that mode (`native`/`generic`
//!   XDP, or `tc`: the whole data path in TC ingress, `--tc-iface`).
use std::collections::BTreeMap;

use loxi_common::maps::ctr;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::{AttachMode, Datapath, L4Error, Plan};

/// Global counters: (label, index).
pub const EVENTS: &[(&str, u32)] = &[
    ("rx", ctr::RX),
    ("pass", ctr::PASS),
    ("drop_truncated", ctr::DROP_TRUNCATED),
    ("drop_no_endpoint", ctr::DROP_NO_ENDPOINT),
    ("drop_ct_full", ctr::DROP_CT_FULL),
    ("new_flow", ctr::NEW_FLOW),
    ("nat_fwd", ctr::NAT_FWD),
    ("nat_rev", ctr::NAT_REV),
    ("tx", ctr::TX),
    ("redirect", ctr::REDIRECT),
    ("fib_pass", ctr::FIB_PASS),
    ("ct_rst", ctr::CT_RST),
    ("ct_fin", ctr::CT_FIN),
    ("ct_expired", ctr::CT_EXPIRED),
    ("dsr", ctr::DSR),
    ("egress_tc", ctr::EGRESS_TC),
    ("tc_redirect", ctr::TC_REDIRECT),
    ("egress_no_meta", ctr::EGRESS_NO_META),
    ("ct_reply_deferred", ctr::CT_REPLY_DEFERRED),
    ("ct_reply_added", ctr::CT_REPLY_ADDED),
    ("redirect_peer", ctr::REDIRECT_PEER),
];

/// Label of `loxilb_l4_events_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    /// Counter name from [`EVENTS`].
    pub event: String,
}

/// Labels of the per-endpoint families.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    /// `StoredRule::id`.
    pub service: u32,
    /// Endpoint index in the rule's endpoint list.
    pub endpoint: u32,
}

/// Labels of `loxilb_l4_xdp_attached`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttachLabels {
    /// Interface name.
    pub iface: String,
    /// `native` or `generic`.
    pub mode: String,
}

/// Handles to the L4 metric families (cheap to clone).
#[derive(Clone, Debug)]
pub struct L4Metrics {
    events: Family<EventLabels, Counter>,
    ep_packets: Family<EndpointLabels, Counter>,
    ep_bytes: Family<EndpointLabels, Counter>,
    attached: Family<AttachLabels, Gauge>,
}

impl L4Metrics {
    /// Registers the families in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            events: Family::default(),
            ep_packets: Family::default(),
            ep_bytes: Family::default(),
            attached: Family::default(),
        };
        registry.register(
            "loxilb_l4_events",
            "XDP data-path events by kind",
            m.events.clone(),
        );
        registry.register(
            "loxilb_l4_endpoint_packets",
            "Packets the XDP data path forwarded for an endpoint (both directions)",
            m.ep_packets.clone(),
        );
        registry.register(
            "loxilb_l4_endpoint_bytes",
            "Bytes the XDP data path forwarded for an endpoint (both directions)",
            m.ep_bytes.clone(),
        );
        registry.register(
            "loxilb_l4_xdp_attached",
            "1 while the L4 data path is attached to the interface in this mode (native, generic: XDP; tc: TC ingress)",
            m.attached.clone(),
        );
        m
    }

    /// Records an attachment (`up`) or its removal.
    pub fn set_attached(&self, iface: &str, mode: AttachMode, up: bool) {
        let l = AttachLabels {
            iface: iface.to_string(),
            mode: mode.as_str().to_string(),
        };
        self.attached.get_or_create(&l).set(i64::from(up));
    }
}

/// Last values seen per counter index, so monotonic Prometheus counters get deltas even when a
/// rule slot is reused.
#[derive(Debug, Default)]
pub struct CounterFold {
    last: BTreeMap<u32, u64>,
}

impl CounterFold {
    /// Reads every global and per-endpoint counter of `plan` and adds the increase.
    pub fn fold(&mut self, dp: &Datapath, plan: &Plan, m: &L4Metrics) -> Result<(), L4Error> {
        for (name, idx) in EVENTS {
            let d = self.delta(*idx, dp.counter(*idx)?);
            m.events
                .get_or_create(&EventLabels {
                    event: (*name).to_string(),
                })
                .inc_by(d);
        }
        for svc in plan.services.values() {
            for ep in 0..svc.endpoints.len() as u32 {
                let (p, b) = dp.endpoint_counters(svc.value.slot, ep)?;
                let i = ctr::ep_packets(svc.value.slot, ep);
                let l = EndpointLabels {
                    service: svc.rule_id,
                    endpoint: ep,
                };
                m.ep_packets.get_or_create(&l).inc_by(self.delta(i, p));
                m.ep_bytes.get_or_create(&l).inc_by(self.delta(i + 1, b));
            }
        }
        Ok(())
    }

    /// The value counter `idx` had at the last [`Self::fold`] (0 before the first).
    pub fn last(&self, idx: u32) -> u64 {
        self.last.get(&idx).copied().unwrap_or(0)
    }

    fn delta(&mut self, idx: u32, now: u64) -> u64 {
        let prev = self.last.insert(idx, now).unwrap_or(0);
        now.saturating_sub(prev)
    }
}
