//! Rule handlers: create (`POST`), list (`GET .../all`), delete.

use std::collections::HashMap;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::response::Response;
use serde::Serialize;

use super::error::{self, ApiError};
use super::fields;
use super::{ApiState, EndpointHealth};
use crate::rules::{LbRule, StoredRule, UpsertOutcome};

/// `GET /config/loadbalancer/all` body: LoxiLB's `{"lbAttr": [...]}`.
#[derive(Debug, Serialize)]
pub struct LbAttrList {
    /// Every rule in key order, endpoints in user order with their live `state`.
    #[serde(rename = "lbAttr")]
    pub lb_attr: Vec<LbRule>,
}

/// `POST /config/loadbalancer`: strict parse, validate, persist, publish.
pub async fn create(
    State(st): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| ApiError::bad_body(format!("cannot read the body: {e}")))?;
    let rule = fields::parse_rule(&body)?;
    let key = rule.key();
    let outcome = st.store.upsert(rule)?;
    if outcome != UpsertOutcome::Unchanged {
        tracing::info!(rule = %key, ?outcome, "rule stored");
    }
    Ok(error::success())
}

/// `GET /config/loadbalancer/all`.
pub async fn list(State(st): State<ApiState>) -> Json<LbAttrList> {
    let snap = st.store.snapshot();
    let lb_attr = snap
        .rules
        .values()
        .map(|r| with_states(r, st.health.as_ref()))
        .collect();
    Json(LbAttrList { lb_attr })
}

/// The rule as stored, each endpoint carrying `state: active|inactive`.
pub fn with_states(stored: &StoredRule, health: &dyn EndpointHealth) -> LbRule {
    let mut rule = stored.rule.clone();
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
