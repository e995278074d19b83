//! Rule handlers: create (`POST`), list (`GET .../all`), delete.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Serialize;

use super::error::{self, ApiError};
use super::fields;
use super::{ApiState, EndpointHealth};
use crate::listen::Reservation;
use crate::rules::{LbRule, StoredRule, UpsertOutcome, validate};

/// `GET /config/loadbalancer/all` body: LoxiLB's `{"lbAttr": [...]}`.
#[derive(Debug, Serialize)]
pub struct LbAttrList {
    /// Every rule in key order, endpoints in user order with their live `state`.
    #[serde(rename = "lbAttr")]
    pub lb_attr: Vec<ListedRule>,
}

/// One rule as `GET .../all` lists it: the rule plus, for a fullproxy rule, its listener's
/// state (output only; ignored when the rule is posted back).
#[derive(Debug, Serialize)]
pub struct ListedRule {
    /// The rule with its id and endpoint states.
    #[serde(flatten)]
    pub rule: LbRule,
    /// `listening`, `unbound: <OS error>; retrying` or `pending` (mode-4 rules only).
    #[serde(rename = "listenerState", skip_serializing_if = "Option::is_none")]
    pub listener_state: Option<String>,
}

/// `POST /config/loadbalancer`: strict parse, validate, check that the rule can be served
/// (its data path exists, its fullproxy address can be bound), persist, publish.
pub async fn create(
    State(st): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    let rule = validate::validate(fields::parse_rule(&body)?)?;
    check_data_path(&rule, st.l4_datapath)?;
    // Bound before the rule is stored: a rule whose listener cannot open is never acknowledged.
    let reservation = match listen_addr(&rule) {
        Some(addr) => Some(reserve(&st, addr).await?),
        None => None,
    };
    let key = rule.key();
    let outcome = st.store.upsert(rule)?;
    if let Some(r) = reservation {
        r.commit();
    }
    if outcome != UpsertOutcome::Unchanged {
        tracing::info!(rule = %key, ?outcome, "rule stored");
    }
    Ok(error::success())
}

/// An unreadable body is 400; one over the API's body limit is 413.
fn body_error(e: BytesRejection) -> ApiError {
    let status = e.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::with_status(
            status,
            format!("request body exceeds the API's {API_BODY_LIMIT}-byte limit"),
        );
    }
    ApiError::bad_body(format!("cannot read the body: {}", e.body_text()))
}

/// The REST API's request body limit in bytes (axum's default, 2 MiB): a rule with the
/// maximum [`crate::rules::validate::MAX_ENDPOINTS`] endpoints is about 100 KiB.
pub const API_BODY_LIMIT: usize = 2 << 20;

/// A rule with `mode` other than 4 needs the L4 data path, which only `--xdp-iface` starts.
fn check_data_path(rule: &LbRule, l4_datapath: bool) -> Result<(), ApiError> {
    let mode = rule.service.mode;
    if mode == loxi_common::mode::FULLPROXY || l4_datapath {
        return Ok(());
    }
    Err(ApiError::bad_field(
        "serviceArguments.mode",
        format!(
            "mode {mode} is served by the L4 (XDP) data path, which this daemon runs without \
             (start loxilb with --xdp-iface IFACE, or use mode 4); nothing was stored"
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
    }
}

/// `GET /config/loadbalancer/all`.
pub async fn list(State(st): State<ApiState>) -> Json<LbAttrList> {
    let snap = st.store.snapshot();
    let lb_attr = snap
        .rules
        .values()
        .map(|r| ListedRule {
            rule: with_states(r, st.health.as_ref()),
            listener_state: listen_addr(&r.rule).map(|a| st.sockets.status(a).describe()),
        })
        .collect();
    Json(LbAttrList { lb_attr })
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

/// `DELETE /config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}`
/// with optional `host` and `model_name` query parameters (absent = any).
pub async fn remove(
    State(st): State<ApiState>,
    Path((ip, port, proto)): Path<(String, String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let port: u16 = port.parse().ok().filter(|p| *p != 0).ok_or_else(|| {
        ApiError::bad_field("port", format!("{port:?} is not a port (1..=65535)"))
    })?;
    let gone = st.store.delete(
        &ip,
        port,
        &proto,
        q.get("host").map(String::as_str),
        q.get("model_name").map(String::as_str),
    )?;
    for r in &gone {
        tracing::info!(rule = %r.rule.key(), id = r.id, "rule deleted");
    }
    Ok(error::success())
}
