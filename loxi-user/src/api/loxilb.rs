//! LoxiLB's informational routes that its clients and probes call: `/version`,
//! `/config/endpoint/all`, `/config/conntrack/all`, `/config/metrics`.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Serialize;
use serde_json::json;

use loxi_common::maps::{CtKey, CtValue, ct_state, dir, proto};
use loxi_common::mode;

use super::ApiState;
use super::error::{ApiError, json_response};
use super::query::NoQuery;
use crate::l4::CT_LIST_CAP;

/// `GET /version` (LoxiLB's readiness probe; answered without a token, as LoxiLB's
/// `security: []`): `{"version", "buildInfo", "product"}` (`VersionGetEntry`). `product` is
/// LoxiLB's API-flavour marker: `loxilb-inference-gateway`, the API loxi implements.
pub async fn version(_: NoQuery) -> Response {
    let v = env!("CARGO_PKG_VERSION");
    json_response(
        StatusCode::OK,
        &json!({
            "version": format!("loxi {v}"),
            "buildInfo": format!("loxi {v} (rust)"),
            "product": "loxilb-inference-gateway",
        }),
    )
}

/// `GET /config/metrics`: `{"prometheus": true}` (`MetricsConfig`; loxi always exports its
/// metrics at `/netlox/v1/metrics`).
pub async fn metrics_config(_: NoQuery) -> Response {
    json_response(StatusCode::OK, &json!({ "prometheus": true }))
}

/// One entry of `GET /config/endpoint/all` (LoxiLB's `EndPointGetEntry`, the keys loxicmd's
/// `get ep` reads).
#[derive(Debug, Serialize)]
pub struct EndpointEntry {
    /// The endpoint's IP.
    #[serde(rename = "hostName")]
    pub host_name: String,
    /// `<ip>_<probe type>_<probe port>` (LoxiLB names host probes the same way).
    pub name: String,
    /// Probe failures before the endpoint is down (the rule's `probeRetries`, or the 2 loxi
    /// applies for 0 when the endpoint is probed).
    #[serde(rename = "inactiveReTries")]
    pub inactive_retries: u32,
    /// The probe loxi runs: `none` (no active probe; passive health only), `tcp` (also for
    /// `monitor: true` without a `probetype`, and for `https`/`udp`/`ping`, which loxi probes
    /// with a TCP connect) or `http`.
    #[serde(rename = "probeType")]
    pub probe_type: String,
    /// Probe request (HTTP path).
    #[serde(rename = "probeReq")]
    pub probe_req: String,
    /// Expected probe response.
    #[serde(rename = "probeResp")]
    pub probe_resp: String,
    /// Probe timeout in seconds (the rule's `probeTimeout`, or the 2 loxi applies for 0 when
    /// the endpoint is probed).
    #[serde(rename = "probeDuration")]
    pub probe_duration: u32,
    /// Probed port.
    #[serde(rename = "probePort")]
    pub probe_port: u16,
    /// `ok` when every rule using this endpoint sees it healthy, `nok` otherwise.
    #[serde(rename = "currState")]
    pub curr_state: String,
}

/// `GET /config/endpoint/all`: `{"Attr":[...]}`, one entry per endpoint host and probe
/// (endpoints shared by several rules are listed once), from the live health board. LoxiLB
/// also reports probe delays (`minDelay`/`avgDelay`/`maxDelay`); loxi does not measure them and
/// leaves the keys out.
pub async fn endpoints(State(st): State<ApiState>, _: NoQuery) -> Response {
    let snap = st.store.snapshot();
    let mut by_name: BTreeMap<String, EndpointEntry> = BTreeMap::new();
    for r in snap.rules.values() {
        let s = &r.rule.service;
        for (i, ep) in r.rule.endpoints.iter().enumerate() {
            // What is really probed (`monitor: true` without a `probetype` probes with a TCP
            // connect; `https`/`udp`/`ping` are probed with one too), not the field as given.
            let spec = crate::health::probe::ProbeSpec::from_args(s);
            let probe_type = match spec.as_ref().map(|p| &p.kind) {
                None => "none",
                Some(crate::health::probe::ProbeKind::Tcp) => "tcp",
                Some(crate::health::probe::ProbeKind::Http { .. }) => "http",
            }
            .to_string();
            let port = if s.probeport != 0 {
                s.probeport
            } else {
                ep.target_port
            };
            let name = format!("{}_{probe_type}_{port}", ep.endpoint_ip);
            let up = st.health.healthy(r, i).unwrap_or(true);
            let e = by_name
                .entry(name.clone())
                .or_insert_with(|| EndpointEntry {
                    host_name: ep.endpoint_ip.clone(),
                    name,
                    inactive_retries: spec.as_ref().map_or(s.probe_retries, |p| p.retries),
                    probe_type,
                    probe_req: s.probereq.clone(),
                    probe_resp: s.proberesp.clone(),
                    probe_duration: spec
                        .as_ref()
                        .map_or(s.probe_timeout, |p| p.timeout.as_secs() as u32),
                    probe_port: port,
                    curr_state: "ok".into(),
                });
            if !up {
                e.curr_state = "nok".into();
            }
        }
    }
    let attr: Vec<EndpointEntry> = by_name.into_values().collect();
    json_response(StatusCode::OK, &json!({ "Attr": attr }))
}

/// One entry of `GET /config/conntrack/all`: LoxiLB's `ConntrackInformation` (json tags of
/// loxicmd `pkg/api/conntrack.go`), one per direction of every flow, as LoxiLB lists them.
///
/// - `destinationIP`/`sourceIP`/`destinationPort`/`sourcePort`/`protocol`: the tuple as packets
///   of this direction arrive at the LB (the map key); `protocol` is `tcp`/`udp`/`sctp` or the
///   number;
/// - `conntrackState`: LoxiLB's spellings: TCP `est`, or `fini` once a FIN was seen in this
///   direction; UDP `udp-est`; SCTP `est` (loxi tracks no finer protocol state);
/// - `conntrackAct`: LoxiLB's NAT spellings without its `:w<weight>` suffix (the flow does
///   not record the weight): `dnat-<ep>:<port>` / `snat-<vip>:<port>` (mode 0),
///   `fdnat-<lb source>,<ep>:<port>` / `fsnat-<vip>,<client>:<vip port>` (modes 1, 2, 5),
///   `ddsr-<ep>:<port>` / `sdsr-<vip>:<port>` (mode 3);
/// - `packets`/`bytes`: of this direction (whole frames), counted by the XDP program;
/// - `servName`: the `name` of the rule whose VIP:port:protocol the flow belongs to ("" when
///   the rule has none or is gone);
/// - `ident`: loxi's `<serviceId>:<endpoint index>` (service id 0 when the rule is gone).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CtEntry {
    /// Destination address of this direction.
    #[serde(rename = "destinationIP")]
    pub destination_ip: String,
    /// Source address of this direction.
    #[serde(rename = "sourceIP")]
    pub source_ip: String,
    /// Destination port.
    #[serde(rename = "destinationPort")]
    pub destination_port: u16,
    /// Source port.
    #[serde(rename = "sourcePort")]
    pub source_port: u16,
    /// `tcp`, `udp`, `sctp` or the protocol number.
    pub protocol: String,
    /// `<serviceId>:<endpoint index>`.
    pub ident: String,
    /// LoxiLB's state spelling (see the type's doc).
    #[serde(rename = "conntrackState")]
    pub conntrack_state: String,
    /// LoxiLB's NAT action spelling (see the type's doc).
    #[serde(rename = "conntrackAct")]
    pub conntrack_act: String,
    /// Packets of this direction.
    pub packets: u64,
    /// Bytes of this direction.
    pub bytes: u64,
    /// Name of the rule the flow belongs to.
    #[serde(rename = "servName")]
    pub serv_name: String,
}

fn ct_addr(family: u8, a: &[u8; 16]) -> String {
    crate::l4::plan::addr_ip(family, a).to_string()
}

/// The service tuple (VIP, port, protocol) a conntrack entry belongs to: the destination of a
/// forward entry, the rewritten source of a reply entry.
pub fn ct_service(k: &CtKey, v: &CtValue) -> (String, u16, String) {
    let (a, p) = if v.dir == dir::FWD {
        (&k.daddr, k.dport)
    } else {
        (&v.nsaddr, v.nsport)
    };
    (ct_addr(k.family, a), u16::from_be(p), ct_proto(k.proto))
}

fn ct_proto(p: u8) -> String {
    match p {
        proto::TCP => "tcp".into(),
        proto::UDP => "udp".into(),
        proto::SCTP => "sctp".into(),
        n => n.to_string(),
    }
}

/// Maps one conntrack map entry to LoxiLB's entry; `service` is the (service id, rule name)
/// of the rule the flow belongs to, if it still exists.
pub fn ct_entry(k: &CtKey, v: &CtValue, service: Option<(u32, &str)>) -> CtEntry {
    let state = match k.proto {
        proto::TCP if v.state & ct_state::FIN != 0 => "fini",
        proto::UDP => "udp-est",
        _ => "est",
    };
    let (ns, nd) = (ct_addr(k.family, &v.nsaddr), ct_addr(k.family, &v.ndaddr));
    let (nsp, ndp) = (u16::from_be(v.nsport), u16::from_be(v.ndport));
    let fwd = v.dir == dir::FWD;
    let act = match v.mode {
        mode::DNAT if fwd => format!("dnat-{nd}:{ndp}"),
        mode::DNAT => format!("snat-{ns}:{nsp}"),
        mode::DSR if fwd => format!("ddsr-{nd}:{ndp}"),
        mode::DSR => format!("sdsr-{ns}:{nsp}"),
        _ if fwd => format!("fdnat-{ns},{nd}:{ndp}"),
        _ => format!("fsnat-{ns},{nd}:{nsp}"),
    };
    let (id, name) = service.unwrap_or((0, ""));
    CtEntry {
        destination_ip: ct_addr(k.family, &k.daddr),
        source_ip: ct_addr(k.family, &k.saddr),
        destination_port: u16::from_be(k.dport),
        source_port: u16::from_be(k.sport),
        protocol: ct_proto(k.proto),
        ident: format!("{id}:{}", v.ep),
        conntrack_state: state.into(),
        conntrack_act: act,
        packets: v.packets,
        bytes: v.bytes,
        serv_name: name.into(),
    }
}

/// LoxiLB's order (loxicmd `get_conntrack.go`): by
/// `"%s|%s|%05d|%05d|%s"` of destination IP, source IP, destination port, source port, protocol.
pub fn sort_ct(entries: &mut [CtEntry]) {
    entries.sort_by_cached_key(|c| {
        format!(
            "{}|{}|{:05}|{:05}|{}",
            c.destination_ip, c.source_ip, c.destination_port, c.source_port, c.protocol
        )
    });
}

/// Up to [`CT_LIST_CAP`] live entries of the XDP conntrack map, read on a blocking thread;
/// `None` before the L4 program is loaded (or after it stopped).
///
/// Errors: 500 when the map cannot be read.
pub async fn read_conntrack(st: &ApiState) -> Result<Option<crate::l4::CtDump>, ApiError> {
    let handle = st.conntrack.clone();
    tokio::task::spawn_blocking(move || handle.read(CT_LIST_CAP))
        .await
        .map_err(|e| ApiError::internal(format!("listing the conntrack map: {e}")))?
        .map_err(|e| ApiError::internal(format!("listing the conntrack map: {e}")))
}

/// `GET /config/conntrack/all`: `{"ctAttr":[CtEntry...]}` sorted as LoxiLB sorts.
///
/// Without the L4 data path there is no conntrack table (the fullproxy terminates
/// connections): `{"ctAttr":[]}`. With `--xdp-iface` the live XDP conntrack map is listed
/// (idle-expired entries left out), at most [`CT_LIST_CAP`] entries; beyond that the answer
/// carries `"truncated": true` (an extra key LoxiLB's clients ignore) and a warning is logged.
///
/// Before the L4 task has loaded the program there are no flows: `{"ctAttr":[]}`.
///
/// Errors: 500 when the map cannot be read.
pub async fn conntrack(State(st): State<ApiState>, _: NoQuery) -> Result<Response, ApiError> {
    if !st.l4_datapath {
        return Ok(json_response(StatusCode::OK, &json!({ "ctAttr": [] })));
    }
    let Some(dump) = read_conntrack(&st).await? else {
        // Not loaded yet (or already stopped): no program, so no flows.
        return Ok(json_response(StatusCode::OK, &json!({ "ctAttr": [] })));
    };
    let snap = st.store.snapshot();
    let services: BTreeMap<(String, u16, String), (u32, &str)> = snap
        .rules
        .values()
        .map(|r| {
            let s = &r.rule.service;
            (
                (
                    s.external_ip.clone(),
                    s.port,
                    s.protocol.to_ascii_lowercase(),
                ),
                (r.id, s.name.as_str()),
            )
        })
        .collect();
    let mut attr: Vec<CtEntry> = dump
        .entries
        .iter()
        .map(|(k, v)| ct_entry(k, v, services.get(&ct_service(k, v)).copied()))
        .collect();
    sort_ct(&mut attr);
    if dump.truncated {
        tracing::warn!(
            cap = CT_LIST_CAP,
            "GET /config/conntrack/all: the conntrack map holds more live entries than the \
             listing cap; the answer is truncated"
        );
        return Ok(json_response(
            StatusCode::OK,
            &json!({ "ctAttr": attr, "truncated": true }),
        ));
    }
    Ok(json_response(StatusCode::OK, &json!({ "ctAttr": attr })))
}

#[cfg(test)]
mod tests {
    use loxi_common::maps::family;

    use super::*;

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut o = [0u8; 16];
        o[..4].copy_from_slice(&a);
        o
    }

    /// A port as the data path stores it (raw network order).
    fn port(p: u16) -> u16 {
        p.to_be()
    }

    fn key(s: [u8; 4], sp: u16, d: [u8; 4], dp: u16, p: u8) -> CtKey {
        CtKey {
            saddr: v4(s),
            daddr: v4(d),
            sport: port(sp),
            dport: port(dp),
            proto: p,
            family: family::V4,
            _pad: [0; 2],
        }
    }

    #[allow(clippy::too_many_arguments, reason = "test fixture builder")]
    fn val(
        ns: [u8; 4],
        nsp: u16,
        nd: [u8; 4],
        ndp: u16,
        d: u8,
        m: u8,
        packets: u64,
        bytes: u64,
    ) -> CtValue {
        CtValue {
            nsaddr: v4(ns),
            ndaddr: v4(nd),
            nsport: port(nsp),
            ndport: port(ndp),
            dir: d,
            mode: m,
            ep: 1,
            slot: 3,
            timeout_s: 300,
            packets,
            bytes,
            ..CtValue::default()
        }
    }

    #[test]
    fn full_nat_flow_maps_to_loxilb_entries_with_exact_values() {
        // Client 10.0.0.2:40000 -> VIP 20.0.0.1:80, endpoint 10.1.0.2:8080, LB source
        // 10.1.0.1:33000.
        let fk = key([10, 0, 0, 2], 40000, [20, 0, 0, 1], 80, proto::TCP);
        let fv = val(
            [10, 1, 0, 1],
            33000,
            [10, 1, 0, 2],
            8080,
            dir::FWD,
            mode::FULLNAT,
            7,
            910,
        );
        let rk = key([10, 1, 0, 2], 8080, [10, 1, 0, 1], 33000, proto::TCP);
        let mut rv = val(
            [20, 0, 0, 1],
            80,
            [10, 0, 0, 2],
            40000,
            dir::REV,
            mode::FULLNAT,
            5,
            4321,
        );
        rv.state = ct_state::FIN;
        assert_eq!(
            ct_service(&fk, &fv),
            ("20.0.0.1".to_string(), 80, "tcp".to_string())
        );
        assert_eq!(ct_service(&rk, &rv), ct_service(&fk, &fv));
        let f = serde_json::to_value(ct_entry(&fk, &fv, Some((12, "llm")))).expect("serialise");
        assert_eq!(
            f,
            json!({
                "destinationIP": "20.0.0.1", "sourceIP": "10.0.0.2", "destinationPort": 80,
                "sourcePort": 40000, "protocol": "tcp", "ident": "12:1",
                "conntrackState": "est", "conntrackAct": "fdnat-10.1.0.1,10.1.0.2:8080",
                "packets": 7, "bytes": 910, "servName": "llm",
            })
        );
        let r = serde_json::to_value(ct_entry(&rk, &rv, None)).expect("serialise");
        assert_eq!(
            r,
            json!({
                "destinationIP": "10.1.0.1", "sourceIP": "10.1.0.2", "destinationPort": 33000,
                "sourcePort": 8080, "protocol": "tcp", "ident": "0:1",
                "conntrackState": "fini", "conntrackAct": "fsnat-20.0.0.1,10.0.0.2:80",
                "packets": 5, "bytes": 4321, "servName": "",
            })
        );
    }

    #[test]
    fn l4_stats_sum_a_services_flows_by_direction() {
        use crate::api::status::{Stats, l4_stats};
        let svc = ("20.0.0.1".to_string(), 80, "tcp".to_string());
        // Flow 1: open, 910 bytes in, 4321 out (NAT reply entry).
        let f1 = (
            key([10, 0, 0, 2], 40000, [20, 0, 0, 1], 80, proto::TCP),
            val(
                [10, 0, 0, 2],
                40000,
                [10, 1, 0, 2],
                8080,
                dir::FWD,
                mode::DNAT,
                7,
                910,
            ),
        );
        let r1 = (
            key([10, 1, 0, 2], 8080, [10, 0, 0, 2], 40000, proto::TCP),
            val(
                [20, 0, 0, 1],
                80,
                [10, 0, 0, 2],
                40000,
                dir::REV,
                mode::DNAT,
                5,
                4321,
            ),
        );
        // Flow 2: closing (FIN on the forward entry): its bytes count, it is not active.
        let mut f2 = (
            key([10, 0, 0, 3], 40001, [20, 0, 0, 1], 80, proto::TCP),
            val(
                [10, 0, 0, 3],
                40001,
                [10, 1, 0, 2],
                8080,
                dir::FWD,
                mode::DNAT,
                3,
                100,
            ),
        );
        f2.1.state = ct_state::FIN;
        // Another service's flow: ignored.
        let other = (
            key([10, 0, 0, 2], 40002, [20, 0, 0, 1], 81, proto::TCP),
            val(
                [10, 0, 0, 2],
                40002,
                [10, 1, 0, 2],
                8081,
                dir::FWD,
                mode::DNAT,
                1,
                60,
            ),
        );
        let all = [f1, r1, f2, other];
        assert_eq!(
            l4_stats(&all, &svc),
            Stats {
                active_connections: 1,
                bytes_in: 1010,
                bytes_out: 4321,
                total_connections: None,
            }
        );
        assert_eq!(
            serde_json::to_value(l4_stats(&all, &svc)).expect("serialise"),
            json!({"activeConnections": 1, "bytesIn": 1010, "bytesOut": 4321})
        );
        assert_eq!(
            serde_json::to_value(l4_stats(&all[..0], &svc)).expect("serialise"),
            json!({}),
            "no flows: every zero field omitted, as Go's omitempty does"
        );
    }

    #[test]
    fn dnat_dsr_and_udp_spellings() {
        let k = key([10, 0, 0, 2], 5000, [20, 0, 0, 1], 53, proto::UDP);
        let fwd = val(
            [10, 0, 0, 2],
            5000,
            [10, 1, 0, 2],
            5353,
            dir::FWD,
            mode::DNAT,
            1,
            60,
        );
        let e = ct_entry(&k, &fwd, Some((2, "dns")));
        assert_eq!(
            (e.conntrack_state.as_str(), e.conntrack_act.as_str()),
            ("udp-est", "dnat-10.1.0.2:5353")
        );
        let rev = val(
            [20, 0, 0, 1],
            53,
            [10, 0, 0, 2],
            5000,
            dir::REV,
            mode::DNAT,
            1,
            60,
        );
        assert_eq!(ct_entry(&k, &rev, None).conntrack_act, "snat-20.0.0.1:53");
        let dsr = val(
            [10, 0, 0, 2],
            5000,
            [10, 1, 0, 2],
            53,
            dir::FWD,
            mode::DSR,
            1,
            60,
        );
        assert_eq!(ct_entry(&k, &dsr, None).conntrack_act, "ddsr-10.1.0.2:53");
        let dsr_rev = val(
            [20, 0, 0, 1],
            53,
            [10, 0, 0, 2],
            5000,
            dir::REV,
            mode::DSR,
            1,
            60,
        );
        assert_eq!(
            ct_entry(&k, &dsr_rev, None).conntrack_act,
            "sdsr-20.0.0.1:53"
        );
        let sctp = key([10, 0, 0, 2], 1, [20, 0, 0, 1], 2, proto::SCTP);
        assert_eq!(ct_entry(&sctp, &dsr, None).protocol, "sctp");
        let mut v6 = k;
        v6.family = family::V6;
        v6.daddr = std::net::Ipv6Addr::LOCALHOST.octets();
        assert_eq!(ct_entry(&v6, &fwd, None).destination_ip, "::1");
    }

    #[test]
    fn sorted_as_loxicmd_sorts_zero_padded_ports() {
        let mk = |d: [u8; 4], s: [u8; 4], dp: u16, sp: u16| {
            let k = key(s, sp, d, dp, proto::TCP);
            let v = val(s, sp, d, dp, dir::FWD, mode::DNAT, 1, 1);
            ct_entry(&k, &v, None)
        };
        let mut e = vec![
            mk([20, 0, 0, 1], [10, 0, 0, 2], 80, 9000),
            mk([20, 0, 0, 1], [10, 0, 0, 2], 80, 10000),
            mk([10, 0, 0, 9], [10, 0, 0, 2], 443, 1),
        ];
        sort_ct(&mut e);
        let got: Vec<(String, u16)> = e
            .iter()
            .map(|c| (c.destination_ip.clone(), c.source_port))
            .collect();
        assert_eq!(
            got,
            vec![
                ("10.0.0.9".to_string(), 1),
                ("20.0.0.1".to_string(), 9000),
                ("20.0.0.1".to_string(), 10000),
            ]
        );
    }

    #[test]
    fn idle_expired_entries_are_recognised() {
        let mut v = CtValue {
            last_ns: 1_000_000_000,
            timeout_s: 10,
            ..CtValue::default()
        };
        assert!(!crate::l4::conntrack::expired(&v, 11_000_000_000));
        assert!(crate::l4::conntrack::expired(&v, 11_000_000_001));
        v.timeout_s = 0;
        assert!(crate::l4::conntrack::expired(&v, 1_000_000_001));
    }
}
