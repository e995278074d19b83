//! One rule by its LoxiLB key, and its lifecycle status and statistics (LoxiLB's Octavia
//! read routes, `loxilb-inference-gateway` `api/restapi/handler/loadbalancer.go`
//! `ConfigGetLoadbalancerByKey`, `ConfigGetLoadbalancerStatus`, `ConfigGetLoadbalancerStats`):
//!
//! - `GET .../externalipaddress/{ip}/port/{port}/protocol/{proto}`: the rule as a
//!   `LoadbalanceEntry` (the shape of `GET .../all`).
//! - `GET .../status`: `{"adminStateUp", "operatingStatus", "lastUpdated"}`
//!   (`models.LoadbalanceStatus`).
//! - `GET .../stats`: `{"activeConnections", "bytesIn", "bytesOut", "totalConnections"}`
//!   (`models.LoadbalanceStats`, zero values omitted as Go's `omitempty` does).
//!
//! loxi keys rules by `host` and `model_name` too (model pools and host rules share one
//! `VIP:port`). The optional query parameters `host` and `model_name` select among them
//! (absent = the rule without one, as for deletes); without them, an address that carries
//! several rules is a 409 that lists their ids (LoxiLB answers 409 for its colliding rules
//! too). Statistics are per `VIP:port:protocol`, as LoxiLB keys them, so they need no
//! selection.

use std::collections::HashMap;
use std::time::SystemTime;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use loxi_common::maps::{CtKey, CtValue, ct_state, dir, proto};
use serde::Serialize;
use serde_json::json;

use super::error::{ApiError, json_response};
use super::loxilb::{ct_service, read_conntrack};
use super::query::{NoQuery, OnceQuery};
use super::rules::{entry, listen_addr};
use super::{ApiState, EndpointHealth};
use crate::listen::{ListenerStatus, TrafficSnapshot};
use crate::rules::{StoredRule, validate};

/// LoxiLB's `operatingStatus` of a rule from its endpoints' health
/// (`deriveOperatingStatus`): `NO_MONITOR` when no endpoint's health is tracked, `ONLINE`
/// when every endpoint is up, `OFFLINE` when none is (or there are none), `DEGRADED` between.
pub fn operating_status(stored: &StoredRule, health: &dyn EndpointHealth) -> &'static str {
    let n = stored.rule.endpoints.len();
    let known: Vec<bool> = (0..n).filter_map(|i| health.healthy(stored, i)).collect();
    if n > 0 && known.is_empty() {
        return "NO_MONITOR";
    }
    // An endpoint without a reading counts as up (as `GET .../all` reports it `active`).
    let up = (0..n)
        .filter(|&i| health.healthy(stored, i).unwrap_or(true))
        .count();
    match up {
        0 => "OFFLINE",
        u if u == n => "ONLINE",
        _ => "DEGRADED",
    }
}

/// RFC 3339 UTC with seconds (`2026-12-02T01:30:00Z`), LoxiLB's `strfmt.DateTime` as JSON.
fn rfc3339(t: SystemTime) -> String {
    let t = time::OffsetDateTime::from(t)
        .replace_nanosecond(0)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// LoxiLB's statistics quad; zero fields are omitted (`omitempty`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Stats {
    /// Connections open now.
    #[serde(skip_serializing_if = "is_zero")]
    pub active_connections: u64,
    /// Bytes from clients.
    #[serde(skip_serializing_if = "is_zero")]
    pub bytes_in: u64,
    /// Bytes to clients.
    #[serde(skip_serializing_if = "is_zero")]
    pub bytes_out: u64,
    /// Connections since the rule's address was first served (monotonic); `None` for L4
    /// rules, whose data path keeps no cumulative count (the key is then absent).
    #[serde(skip_serializing_if = "zero_or_none")]
    pub total_connections: Option<u64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn zero_or_none(n: &Option<u64>) -> bool {
    n.is_none_or(|n| n == 0)
}

impl From<TrafficSnapshot> for Stats {
    fn from(t: TrafficSnapshot) -> Self {
        Self {
            active_connections: t.active_connections,
            bytes_in: t.bytes_in,
            bytes_out: t.bytes_out,
            total_connections: Some(t.total_connections),
        }
    }
}

/// The statistics of the L4 service `(ip, port, proto)` from a conntrack listing: flows whose
/// forward entry is not closing are active; `bytesIn` sums the forward (client → VIP)
/// entries, `bytesOut` the reply entries. The map keeps no cumulative flow count.
pub fn l4_stats<'a>(
    entries: impl IntoIterator<Item = &'a (CtKey, CtValue)>,
    service: &(String, u16, String),
) -> Stats {
    let mut s = Stats::default();
    for (k, v) in entries {
        if ct_service(k, v) != *service {
            continue;
        }
        if v.dir == dir::FWD {
            s.bytes_in += v.bytes;
            let closing = k.proto == proto::TCP && v.state & ct_state::FIN != 0;
            if !closing {
                s.active_connections += 1;
            }
        } else {
            s.bytes_out += v.bytes;
        }
    }
    s
}

/// A service address as the routes name it (`ip` normalised, port, lower-case protocol) and
/// the rules on it.
type OnAddress = (String, u16, String, Vec<std::sync::Arc<StoredRule>>);

/// The rules on `(ip, port, proto)` (`ip` normalised, IPv6 brackets stripped).
fn rules_on(st: &ApiState, ip: &str, port: &str, proto: &str) -> Result<OnAddress, ApiError> {
    let port = super::rules::parse_port(port)?;
    let bare = ip.trim_start_matches('[').trim_end_matches(']');
    let ip = validate::normalize_ip(bare).map_err(|_| {
        ApiError::bad_field("externalipaddress", format!("{ip:?} is not an IP address"))
    })?;
    let proto = super::rules::parse_protocol(proto)?;
    let snap = st.store.snapshot();
    let rules = snap
        .rules
        .values()
        .filter(|r| {
            let s = &r.rule.service;
            s.external_ip == ip && s.port == port && s.protocol.eq_ignore_ascii_case(&proto)
        })
        .cloned()
        .collect();
    Ok((ip, port, proto, rules))
}

/// The one rule a key route names (see the module doc for `host` / `model_name`).
fn one_rule(
    st: &ApiState,
    (ip, port, proto): (String, String, String),
    q: &HashMap<String, String>,
) -> Result<std::sync::Arc<StoredRule>, ApiError> {
    if let Some(k) = q.keys().find(|k| *k != "host" && *k != "model_name") {
        return Err(ApiError::unknown_query_param(k, &["host", "model_name"]));
    }
    let (ip, port, proto, rules) = rules_on(st, &ip, &port, &proto)?;
    let what = format!("{ip}:{port}/{proto}");
    let selected: Vec<_> = if q.is_empty() {
        rules
    } else {
        let host = q.get("host").map(String::as_str).unwrap_or_default();
        let model = q.get("model_name").map(String::as_str).unwrap_or_default();
        rules
            .into_iter()
            .filter(|r| {
                r.rule.service.host == crate::rules::validate::host_key(host)
                    && r.rule.service.model_name == model
            })
            .collect()
    };
    match selected.as_slice() {
        [] => Err(ApiError::not_found(format!(
            "no rule on {what} with this key"
        ))),
        [one] => Ok(one.clone()),
        many => {
            let ids: Vec<String> = many
                .iter()
                .map(|r| {
                    let s = &r.rule.service;
                    format!(
                        "{} (host {:?}, model_name {:?})",
                        s.id, s.host, s.model_name
                    )
                })
                .collect();
            Err(ApiError::with_status(
                StatusCode::CONFLICT,
                format!(
                    "{} rules share {what}: {}; select one with ?host=&model_name= or use /config/loadbalancer/id/{{id}}",
                    many.len(),
                    ids.join(", ")
                ),
            ))
        }
    }
}

/// `GET /config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}`: one rule
/// as a `LoadbalanceEntry`; 404 none, 409 several (see the module doc), 400 a bad port/IP.
pub async fn get_by_key(
    State(st): State<ApiState>,
    Path(key): Path<(String, String, String)>,
    OnceQuery(q): OnceQuery,
) -> Result<Response, ApiError> {
    let rule = one_rule(&st, key, &q)?;
    Ok(json_response(StatusCode::OK, &entry(&st, &rule)))
}

/// `GET .../protocol/{proto}/status`: `{"adminStateUp": true, "operatingStatus",
/// "lastUpdated"}` (see [`operating_status`]; `lastUpdated` is [`StoredRule::updated`]).
/// loxi has no paused rules, so `adminStateUp` is always true. A mode-4 rule whose listener
/// could not be bound, and an L4 rule on a daemon without the L4 data path, serve nothing
/// whatever their endpoints' health: `OFFLINE` (their `listenerState` in `GET .../all` says
/// why).
pub async fn status(
    State(st): State<ApiState>,
    Path(key): Path<(String, String, String)>,
    OnceQuery(q): OnceQuery,
) -> Result<Response, ApiError> {
    let rule = one_rule(&st, key, &q)?;
    let unbound = listen_addr(&rule.rule)
        .is_some_and(|a| matches!(st.sockets.status(a), ListenerStatus::Unbound(_)))
        || !super::rules::has_data_path(&rule.rule, st.l4_datapath);
    let operating = if unbound {
        "OFFLINE"
    } else {
        operating_status(&rule, st.health.as_ref())
    };
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "adminStateUp": true,
            "operatingStatus": operating,
            "lastUpdated": rfc3339(rule.updated),
        }),
    ))
}

/// `GET .../protocol/{proto}/stats`: LoxiLB's quad for the service `VIP:port:protocol`.
/// A fullproxy (mode-4) address: its listener's client connections and bytes
/// ([`crate::listen::Traffic`]), shared by every model pool / host rule on it. An L4 rule:
/// summed from the live XDP conntrack map ([`l4_stats`]; no `totalConnections`). 404 when no
/// rule is on the address.
pub async fn stats(
    State(st): State<ApiState>,
    Path((ip, port, proto)): Path<(String, String, String)>,
    _: NoQuery,
) -> Result<Response, ApiError> {
    let (ip, port, proto, rules) = rules_on(&st, &ip, &port, &proto)?;
    let Some(rule) = rules.first() else {
        return Err(ApiError::not_found(format!(
            "no rule on {ip}:{port}/{proto}"
        )));
    };
    let stats = match listen_addr(&rule.rule) {
        Some(addr) => st
            .sockets
            .traffic_snapshot(addr)
            .map(Stats::from)
            .unwrap_or_default(),
        None => l4(&st, (ip, port, proto)).await?,
    };
    Ok(json_response(StatusCode::OK, &stats))
}

async fn l4(st: &ApiState, service: (String, u16, String)) -> Result<Stats, ApiError> {
    if !st.l4_datapath {
        return Ok(Stats::default());
    }
    Ok(read_conntrack(st)
        .await?
        .map(|d| l4_stats(&d.entries, &service))
        .unwrap_or_default())
}
