//! Rule handlers: create (`POST`), list (`GET .../all`), get by id, and LoxiLB's delete
//! routes (by key, by `hosturl/.../portmax`, by name).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{Map, Value, json};

use super::error::{self, ApiError, json_response};
use super::fields;
use super::query::{NoQuery, OnceQuery};
use super::{ApiState, EndpointHealth};
use crate::listen::Reservation;
use crate::rules::schema::is_zero;
use crate::rules::{LbRule, StoredRule, UpsertOutcome, validate};

/// `POST /config/loadbalancer`: strict parse, validate, check that the rule can be served
/// (its data path exists, its fullproxy address can be bound), persist, publish.
pub async fn create(
    State(st): State<ApiState>,
    _: NoQuery,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let rule = validate::validate(fields::parse_rule(&body)?)?;
    check_data_path(&rule, st.l4_datapath)?;
    // A TLS rule's certificate check and its commit are one step against certificate changes.
    let coverage = match rule.service.security {
        0 => None,
        _ => Some(st.certs.coverage_lock().await),
    };
    check_certificate(&rule, &st)?;
    crate::proxy::upstream_tls::check(&rule.service).map_err(|e| {
        let field = match e {
            crate::proxy::upstream_tls::BackendTlsError::Name(_) => "backend_tls_server_name",
            _ => "backend_ca_file",
        };
        ApiError::invalid_field(
            format!("serviceArguments.{field}"),
            format!("{e}; nothing was stored"),
        )
    })?;
    // Bound before the rule is stored: a rule whose listener cannot open is never acknowledged.
    let reservation = match listen_addr(&rule) {
        Some(addr) => Some(reserve(&st, addr).await?),
        None => None,
    };
    let key = rule.key();
    let outcome = st.store.upsert(rule)?;
    drop(coverage);
    if let Some(r) = reservation {
        r.commit();
    }
    if outcome != UpsertOutcome::Unchanged {
        tracing::info!(rule = %key, ?outcome, "rule stored");
    }
    settle(&st, &key.to_string()).await;
    Ok(error::success())
}

/// How long a rule change waits for the data paths to put it into effect before it is
/// acknowledged anyway (with a warning naming the ones behind; they apply it when they get to
/// it). Applying takes milliseconds: a listener swap, the KV members, the L4 maps.
pub const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Waits until every data path (fullproxy, KV tier, L4) has applied the store's newest
/// snapshot, so that a `200` means the next connection or request follows the change (a
/// client that updates a rule and sends traffic at once is routed by the new endpoint set,
/// and `x-loxilb-endpoint` indexes it). Bounded by [`SETTLE_TIMEOUT`].
async fn settle(st: &ApiState, what: &str) {
    let version = st.store.snapshot().version;
    if let Err(behind) = st.store.settled(version, SETTLE_TIMEOUT).await {
        tracing::warn!(rule = what, version, ?behind, timeout = ?SETTLE_TIMEOUT,
            "rule change stored, but these data paths have not applied it yet; acknowledged anyway");
    }
}

pub use super::error::API_BODY_LIMIT;
use super::error::body_error;

/// A rule with `mode` other than 4 needs the L4 data path, which only `--xdp-iface` or
/// `--tc-iface` starts.
fn check_data_path(rule: &LbRule, l4_datapath: bool) -> Result<(), ApiError> {
    let mode = rule.service.mode;
    if has_data_path(rule, l4_datapath) {
        return Ok(());
    }
    Err(ApiError::invalid_field(
        "serviceArguments.mode",
        format!(
            "mode {mode} is served by the L4 (XDP/TC) data path, which this daemon runs without \
             (start loxilb with --xdp-iface IFACE or --tc-iface IFACE, or use mode 4); nothing \
             was stored"
        ),
    ))
}

/// A TLS rule (`security` 1 or 2) needs a certificate whose names match its `host` (exact or
/// wildcard, as the SNI selection matches; the `default` certificate counts only when its
/// names match; an IP host needs the `default` certificate with that SAN IP address, since
/// clients send no SNI for an address), or for a host-less rule the `default` one: the rule
/// the cert API's `DELETE` and `PUT` keep covered ([`super::certs::has_certificate`]); only
/// certificates valid now count (an expired one still serves, but covers no new rule). The
/// refusal says what is missing and the `loxicmd create cert` command (or the cert API call)
/// that provides it ([`super::certs::missing_certificate`]).
fn check_certificate(rule: &LbRule, st: &ApiState) -> Result<(), ApiError> {
    let s = &rule.service;
    if s.security == 0 {
        return Ok(());
    }
    let all = st.certs.snapshot();
    let certs = all.valid_at(crate::certs::store::unix_now());
    if super::certs::has_certificate(&certs, &s.host) {
        return Ok(());
    }
    let (what, fix) = super::certs::expired_match(&all, &s.host)
        .unwrap_or_else(|| super::certs::missing_certificate(&certs, &s.host));
    Err(ApiError::invalid_field(
        "serviceArguments.security",
        format!(
            "{security} ({}) needs a certificate: {what}; {fix}; nothing was stored \
             ({SECURITY_VALUES}; 1 and 2 need a certificate)",
            crate::rules::model::security_name(s.security).unwrap_or("TLS"),
            security = s.security,
            SECURITY_VALUES = crate::rules::model::SECURITY_VALUES,
        ),
    ))
}

/// The fullproxy address of a mode-4 rule.
pub fn listen_addr(rule: &LbRule) -> Option<SocketAddr> {
    let s = &rule.service;
    if s.mode != loxi_common::mode::FULLPROXY || !s.protocol.eq_ignore_ascii_case("tcp") {
        return None;
    }
    Some(SocketAddr::new(
        s.external_ip.parse::<IpAddr>().ok()?,
        s.port,
    ))
}

/// Reserves `addr`, retrying "in use" briefly: a listener of a rule deleted a moment ago closes
/// its socket asynchronously, just after the proxy released it.
async fn reserve(st: &ApiState, addr: SocketAddr) -> Result<Reservation, ApiError> {
    let mut tries = 0;
    loop {
        match st.sockets.reserve(addr) {
            Ok(r) => return Ok(r),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 3 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => return Err(bind_error(addr, &e)),
        }
    }
}

fn bind_error(addr: SocketAddr, e: &std::io::Error) -> ApiError {
    let status = if e.kind() == std::io::ErrorKind::AddrInUse {
        StatusCode::CONFLICT
    } else {
        StatusCode::BAD_REQUEST
    };
    ApiError {
        status,
        message: format!("cannot listen on {addr}: {e}; nothing was stored"),
        field: Some("serviceArguments.port".into()),
        result: None,
    }
}

/// `GET /config/loadbalancer/all`: LoxiLB's `{"lbAttr":[LoadbalanceEntry...]}` (see
/// [`loxilb_entry`]), rules in key order.
pub async fn list(State(st): State<ApiState>, _: NoQuery) -> Response {
    let snap = st.store.snapshot();
    let lb_attr: Vec<Value> = snap.rules.values().map(|r| entry(&st, r)).collect();
    json_response(StatusCode::OK, &json!({ "lbAttr": lb_attr }))
}

/// `GET /config/loadbalancer/id/{id}`: one rule by LoxiLB's opaque id, as a
/// `LoadbalanceEntry`; 404 when no rule has it.
pub async fn get_by_id(
    State(st): State<ApiState>,
    Path(id): Path<String>,
    _: NoQuery,
) -> Result<Response, ApiError> {
    let snap = st.store.snapshot();
    let rule = snap
        .rules
        .values()
        .find(|r| !id.is_empty() && r.rule.service.id == id)
        .ok_or_else(|| ApiError::not_found(format!("no rule has id {id:?}")))?;
    Ok(json_response(StatusCode::OK, &entry(&st, rule)))
}

/// `r` as a `LoadbalanceEntry` ([`loxilb_entry`]) with its live endpoint states and, for
/// mode 4, its `listenerState`; an L4 rule on a daemon without the L4 data path (restored from
/// the state dir after a start without `--xdp-iface` or `--tc-iface`) carries [`L4_NOT_SERVED`] there instead.
pub fn entry(st: &ApiState, r: &StoredRule) -> Value {
    let listener = match listen_addr(&r.rule) {
        Some(a) => Some(st.sockets.status(a).describe()),
        None if !has_data_path(&r.rule, st.l4_datapath) => Some(L4_NOT_SERVED.to_string()),
        None => None,
    };
    loxilb_entry(r, st.health.as_ref(), listener)
}

/// `listenerState` of an L4 rule that nothing serves (see [`has_data_path`]).
pub const L4_NOT_SERVED: &str = "not served: this daemon runs without --xdp-iface or --tc-iface (no L4 data path); restart it with --xdp-iface IFACE or --tc-iface IFACE";

/// Whether a data path serves `rule`: always for mode 4 (the fullproxy); for an L4 rule (mode
/// other than 4) only with the L4 data path. False for an L4 rule on a daemon without it: the API
/// refuses such a rule, but one restored from the state dir is kept (restarting with
/// `--xdp-iface` serves it again), reported `OFFLINE` and with [`L4_NOT_SERVED`].
pub fn has_data_path(rule: &LbRule, l4_datapath: bool) -> bool {
    rule.service.mode == loxi_common::mode::FULLPROXY || l4_datapath
}

/// The rule as stored with its `serviceId`, each endpoint carrying `state: active|inactive`.
pub fn with_states(stored: &StoredRule, health: &dyn EndpointHealth) -> LbRule {
    let mut rule = stored.rule.clone();
    rule.service_id = Some(stored.id);
    for (i, ep) in rule.endpoints.iter_mut().enumerate() {
        let up = health.healthy(stored, i).unwrap_or(true);
        ep.state = Some(if up { "active" } else { "inactive" }.to_string());
    }
    rule
}

/// One rule in the shape of LoxiLB's `LoadbalanceEntry` as its `GET .../all` serialises it
/// (`loxilb-inference-gateway@5e5dd88c:api/restapi/handler/loadbalancer.go` `serializeLBRule`):
///
/// - `serviceArguments`: zero values omitted (Go's `omitempty`); always `externalIP`, `port`,
///   `protocol`, `id`, `adminStateUp: true`, `alpn_protocols: null`, `tls_versions: null`;
///   `inactiveTimeOut` is the effective L4 idle timeout (the rule's, else the data path's
///   default: 300 s tcp, 60 s udp/sctp; LoxiLB's defaults are 240/20) and absent for mode 4
///   (the fullproxy has no idle timeout); `backend_protocol` only for mode 4. loxi's filled-in
///   defaults (`kvBlockSize: 16`, `chwbl_replication: 256`, ...) are reported because they are
///   what runs.
/// - endpoints in the user's order (`ep_idx`; LoxiLB sorts by IP, and
///   `loxilb_pd_ep_info{service,ep_idx,ip,port}` joins the two), each with `state`
///   (`active`/`inactive`) and `backup: false`; `counter` is absent (loxi does not count
///   packets per fullproxy endpoint; the L4 data path's per-endpoint packets and bytes are the
///   `loxilb_l4_endpoint_*` metrics).
/// - `allowedSources`, `secondaryIPs`, `secondaryVIPs`: `null`.
/// - loxi's additions, which LoxiLB's clients ignore: `serviceId` (the `service` metric label
///   and the KV views' `service_id`) and, for mode 4, `listenerState`.
pub fn loxilb_entry(
    stored: &StoredRule,
    health: &dyn EndpointHealth,
    listener_state: Option<String>,
) -> Value {
    let rule = with_states(stored, health);
    let s = &rule.service;
    let fullproxy = s.mode == loxi_common::mode::FULLPROXY;
    let mut svc = match serde_json::to_value(s) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    };
    svc.retain(|_, v| !is_zero(v));
    for k in ["externalIP", "port", "protocol", "id"] {
        if let Some(v) = serde_json::to_value(s).ok().and_then(|m| m.get(k).cloned()) {
            svc.insert(k.into(), v);
        }
    }
    svc.insert("adminStateUp".into(), json!(true));
    svc.insert("alpn_protocols".into(), Value::Null);
    svc.insert("tls_versions".into(), Value::Null);
    if fullproxy {
        // The rule's own client idle timeout when it set one (`PoolTable::idle_timeout`).
        if s.inactive_timeout == 0 {
            svc.remove("inactiveTimeOut");
        }
    } else {
        svc.remove("backend_protocol");
        let t = match (s.inactive_timeout, s.protocol.as_str()) {
            (0, "tcp") => loxi_common::maps::DEFAULT_TCP_TIMEOUT_S,
            (0, _) => loxi_common::maps::DEFAULT_UDP_TIMEOUT_S,
            (t, _) => t,
        };
        svc.insert("inactiveTimeOut".into(), json!(t));
    }
    let endpoints: Vec<Value> = rule
        .endpoints
        .iter()
        .map(|ep| {
            let mut m = match serde_json::to_value(ep) {
                Ok(Value::Object(m)) => m,
                _ => Map::new(),
            };
            m.retain(|k, v| !is_zero(v) || k == "weight" || k == "targetPort");
            m.insert("backup".into(), json!(false));
            Value::Object(m)
        })
        .collect();
    let mut out = Map::new();
    out.insert("allowedSources".into(), Value::Null);
    out.insert("endpoints".into(), Value::Array(endpoints));
    out.insert("secondaryIPs".into(), Value::Null);
    out.insert("secondaryVIPs".into(), Value::Null);
    out.insert("serviceArguments".into(), Value::Object(svc));
    out.insert("serviceId".into(), json!(stored.id));
    if let Some(l) = listener_state {
        out.insert("listenerState".into(), json!(l));
    }
    Value::Object(out)
}

/// The rule key a delete path names.
struct DeleteKey {
    ip: String,
    port: u16,
    proto: String,
    host: String,
}

impl DeleteKey {
    /// The key of a delete route: `port` parsed, `portmax` (when the route has one) checked
    /// against it (see [`check_portmax`]).
    fn of(
        host: String,
        ip: String,
        port: &str,
        portmax: Option<&str>,
        proto: String,
    ) -> Result<Self, ApiError> {
        let port = parse_port(port)?;
        if let Some(max) = portmax {
            check_portmax(port, max)?;
        }
        Ok(Self {
            ip,
            port,
            proto: parse_protocol(&proto)?,
            host,
        })
    }
}

/// The `protocol` path segment of the key routes, lower-cased: `tcp`, `udp` or `sctp` (what a
/// rule can have); anything else is the client's mistake (400), not a rule that does not exist.
pub(super) fn parse_protocol(proto: &str) -> Result<String, ApiError> {
    let p = proto.to_ascii_lowercase();
    match p.as_str() {
        "tcp" | "udp" | "sctp" => Ok(p),
        _ => Err(ApiError::bad_field(
            "protocol",
            format!("{proto:?} is not a protocol (tcp, udp, sctp)"),
        )),
    }
}

pub(super) fn parse_port(port: &str) -> Result<u16, ApiError> {
    port.parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| ApiError::bad_field("port", format!("{port:?} is not a port (1..=65535)")))
}

/// The delete query parameters LoxiLB's clients send, checked: `model_name` (part of the
/// key; absent = the rule without a model), loxi's `host` (absent = the rule without a host;
/// the `hosturl` routes carry it in the path), `bgp` (any value: loxi has no BGP speaker and so
/// no route to withdraw), `block` (0: loxi has no firewall-marked rules), `path_match_mode`
/// (absent, empty or `disabled`) and `path_prefix` (absent or empty: loxi has no path routing).
/// Any other parameter is a 400.
fn delete_key(
    key: DeleteKey,
    q: &HashMap<String, String>,
    host_in_path: bool,
) -> Result<(String, u16, String, String, String), ApiError> {
    for (k, v) in q {
        match k.as_str() {
            "model_name" | "bgp" => {}
            "host" if !host_in_path => {}
            "block" if v.is_empty() || v == "0" => {}
            "path_match_mode" if v.is_empty() || v == "disabled" => {}
            "path_prefix" if v.is_empty() => {}
            "block" | "path_match_mode" | "path_prefix" => {
                return Err(ApiError::bad_field(
                    k.clone(),
                    format!(
                        "{k}={v} selects a rule feature loxi does not implement (not implemented in loxi), so no loxi rule has it"
                    ),
                ));
            }
            _ => {
                return Err(ApiError::unknown_query_param(
                    k,
                    &[
                        "model_name",
                        "host",
                        "bgp",
                        "block",
                        "path_match_mode",
                        "path_prefix",
                    ],
                ));
            }
        }
    }
    let host = if host_in_path {
        key.host
    } else {
        q.get("host").cloned().unwrap_or_default()
    };
    let model = q.get("model_name").cloned().unwrap_or_default();
    // As the GET-by-key routes answer: a malformed address is the client's mistake (400), not
    // a rule that does not exist (404).
    let ip = crate::rules::validate::normalize_ip(&key.ip).map_err(|_| {
        ApiError::bad_field(
            "externalipaddress",
            format!("{:?} is not an IP address", key.ip),
        )
    })?;
    Ok((ip, key.port, key.proto, host, model))
}

async fn delete_rule(
    st: &ApiState,
    key: DeleteKey,
    q: &HashMap<String, String>,
    host_in_path: bool,
) -> Result<Response, ApiError> {
    let (ip, port, proto, host, model) = delete_key(key, q, host_in_path)?;
    let gone = st.store.delete(&ip, port, &proto, &host, &model)?;
    for r in &gone {
        tracing::info!(rule = %r.rule.key(), id = r.id, "rule deleted");
    }
    settle(st, &format!("{ip}:{port}/{proto}")).await;
    Ok(error::success())
}

/// `hosturl` of LoxiLB's delete routes: `any` (what loxicmd sends without `--host`) means the
/// rule without a host.
fn host_of(hosturl: &str) -> String {
    if hosturl == "any" {
        String::new()
    } else {
        hosturl.to_string()
    }
}

/// `portmax` of LoxiLB's delete routes: 0 or the port itself (loxi has no port ranges).
fn check_portmax(port: u16, portmax: &str) -> Result<(), ApiError> {
    match portmax.parse::<u16>() {
        Ok(0) => Ok(()),
        Ok(m) if m == port => Ok(()),
        _ => Err(ApiError::bad_field(
            "portmax",
            format!("{portmax:?}: port ranges are not implemented in loxi; use 0"),
        )),
    }
}

/// `DELETE /config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}`
/// (kube-loxilb's route; its body, the rule it created, is ignored) with optional `host` and
/// `model_name` query parameters: absent means the rule without a host / model (LoxiLB's
/// semantics), never "any".
pub async fn remove(
    State(st): State<ApiState>,
    Path((ip, port, proto)): Path<(String, String, String)>,
    OnceQuery(q): OnceQuery,
) -> Result<Response, ApiError> {
    let key = DeleteKey::of(String::new(), ip, &port, None, proto)?;
    delete_rule(&st, key, &q, false).await
}

/// `DELETE /config/loadbalancer/hosturl/{hosturl}/externalipaddress/{ip}/port/{port}/portmax/{portmax}/protocol/{proto}`
/// (what LoxiLB's loxicmd always sends).
pub async fn remove_hosturl_portmax(
    State(st): State<ApiState>,
    Path((hosturl, ip, port, portmax, proto)): Path<(String, String, String, String, String)>,
    OnceQuery(q): OnceQuery,
) -> Result<Response, ApiError> {
    let key = DeleteKey::of(host_of(&hosturl), ip, &port, Some(&portmax), proto)?;
    delete_rule(&st, key, &q, true).await
}

/// `DELETE /config/loadbalancer/hosturl/{hosturl}/externalipaddress/{ip}/port/{port}/protocol/{proto}`.
pub async fn remove_hosturl(
    State(st): State<ApiState>,
    Path((hosturl, ip, port, proto)): Path<(String, String, String, String)>,
    OnceQuery(q): OnceQuery,
) -> Result<Response, ApiError> {
    let key = DeleteKey::of(host_of(&hosturl), ip, &port, None, proto)?;
    delete_rule(&st, key, &q, true).await
}

/// `DELETE /config/loadbalancer/externalipaddress/{ip}/port/{port}/portmax/{portmax}/protocol/{proto}`.
pub async fn remove_portmax(
    State(st): State<ApiState>,
    Path((ip, port, portmax, proto)): Path<(String, String, String, String)>,
    OnceQuery(q): OnceQuery,
) -> Result<Response, ApiError> {
    let key = DeleteKey::of(String::new(), ip, &port, Some(&portmax), proto)?;
    delete_rule(&st, key, &q, false).await
}

/// `DELETE /config/loadbalancer/name/{name}`: every rule with this `name`; 404 when none.
pub async fn remove_by_name(
    State(st): State<ApiState>,
    Path(name): Path<String>,
    _: NoQuery,
) -> Result<Response, ApiError> {
    let gone = st.store.delete_by_name(&name)?;
    for r in &gone {
        tracing::info!(rule = %r.rule.key(), id = r.id, "rule deleted by name");
    }
    settle(&st, &format!("name {name:?}")).await;
    Ok(error::success())
}

#[cfg(test)]
#[path = "rules_tests.rs"]
pub(crate) mod tests;
