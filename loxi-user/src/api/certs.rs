//! LoxiLB's certificate API (`/config/cert`): the certificates TLS rules (`security: 1`) serve.
//!
//! | Method | Path | Answer |
//! |---|---|---|
//! | `POST` | `/config/cert` | 201 `{"result":"Success","certId","hostnames","notAfter"}` for `{"certId"?, "certPem", "keyPem", "chainPem"?}` (id minted when absent); 400 malformed PEM, no key, key not the certificate's, expired, bad id; 409 the id exists |
//! | `PUT` | `/config/cert/{certId}` | 200 the same body: the certificate rotated (new handshakes get it, open connections keep theirs); 404 unknown id |
//! | `GET` | `/config/cert`, `/config/cert/all` | 200 `{"certAttr":[{"certId","hostnames","notBefore","notAfter","expiresSoon"}]}` (never the key) |
//! | `GET` | `/config/cert/{certId}` | 200 one entry; 404 |
//! | `DELETE` | `/config/cert/{certId}` | 200; 404; 409 while a `security: 1` rule's host has no other certificate |
//!
//! Times are Unix seconds. A certificate expiring within 14 days is accepted with a warning
//! (log, and `"warning"` in the answer).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{Value, json};

use super::ApiState;
use super::error::{self, ApiError, json_response};
use super::query::NoQuery;
use crate::certs::parse::EXPIRY_WARNING_SECS;
use crate::certs::store::unix_now;
use crate::certs::{CertPem, CertSnapshot, CertStoreError, Certificate};
use crate::rules::RuleSnapshot;

/// The body of `POST` and `PUT`.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CertBody {
    #[serde(default)]
    cert_id: Option<String>,
    cert_pem: String,
    key_pem: String,
    #[serde(default)]
    chain_pem: Option<String>,
}

fn parse_body(body: Result<Bytes, BytesRejection>) -> Result<CertBody, ApiError> {
    let body = body.map_err(super::error::body_error)?;
    serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_body(format!(
            "body must be {{\"certId\"?, \"certPem\", \"keyPem\", \"chainPem\"?}}: {e}"
        ))
    })
}

fn pem(b: CertBody) -> CertPem {
    CertPem {
        cert_pem: b.cert_pem,
        key_pem: b.key_pem,
        chain_pem: b.chain_pem.filter(|c| !c.trim().is_empty()),
    }
}

fn store_error(e: CertStoreError) -> ApiError {
    let status = match &e {
        CertStoreError::Invalid(_) => StatusCode::BAD_REQUEST,
        CertStoreError::Exists(_) | CertStoreError::InUse(_) => StatusCode::CONFLICT,
        CertStoreError::NotFound(_) => StatusCode::NOT_FOUND,
        CertStoreError::Persist { .. } => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError::with_status(status, e.to_string())
}

/// One certificate as the API lists it (no key).
fn entry(c: &Certificate) -> Value {
    json!({
        "certId": c.id,
        "hostnames": c.hostnames,
        "notBefore": c.not_before,
        "notAfter": c.not_after,
        "expiresSoon": c.not_after - unix_now() < EXPIRY_WARNING_SECS,
    })
}

fn saved(status: StatusCode, c: &Certificate) -> Response {
    let mut body = entry(c);
    body["result"] = json!("Success");
    if c.not_after - unix_now() < EXPIRY_WARNING_SECS {
        body["warning"] = json!("the certificate expires within 14 days");
    }
    json_response(status, &body)
}

/// `POST /config/cert`.
pub async fn create(
    State(st): State<ApiState>,
    _: NoQuery,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut b = parse_body(body)?;
    // An empty id is not "absent": the id rules (1 to 63 characters) refuse it by name.
    let id = b.cert_id.take();
    let c = st.certs.create(id, pem(b)).map_err(store_error)?;
    tracing::info!(cert_id = %c.id, hostnames = ?c.hostnames, "certificate stored");
    Ok(saved(StatusCode::CREATED, &c))
}

/// `PUT /config/cert/{certId}`: rotation.
pub async fn replace(
    State(st): State<ApiState>,
    Path(id): Path<String>,
    _: NoQuery,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let b = parse_body(body)?;
    if b.cert_id
        .as_deref()
        .is_some_and(|i| !i.is_empty() && i != id)
    {
        return Err(ApiError::bad_field(
            "certId",
            format!("the body's certId differs from the path's {id:?}"),
        ));
    }
    let rules = st.store.snapshot();
    let c = st
        .certs
        .replace(&id, pem(b), |cur, next| {
            match uncovered(&rules, cur, next) {
                None => Ok(()),
                Some(msg) => Err(format!(
                    "the new certificate for {id:?} does not cover every rule the old one served: \
                 {msg}; nothing was changed"
                )),
            }
        })
        .map_err(store_error)?;
    tracing::info!(cert_id = %c.id, hostnames = ?c.hostnames, "certificate rotated");
    Ok(saved(StatusCode::OK, &c))
}

/// `GET /config/cert` and `/config/cert/all`.
pub async fn list(State(st): State<ApiState>, _: NoQuery) -> Response {
    let snap = st.certs.snapshot();
    let all: Vec<Value> = snap.certs.values().map(|c| entry(c)).collect();
    json_response(StatusCode::OK, &json!({ "certAttr": all }))
}

/// `GET /config/cert/{certId}`.
pub async fn get_one(
    State(st): State<ApiState>,
    Path(id): Path<String>,
    _: NoQuery,
) -> Result<Response, ApiError> {
    let snap = st.certs.snapshot();
    let c = snap
        .certs
        .get(&id)
        .ok_or_else(|| ApiError::not_found(format!("no certificate has id {id:?}")))?;
    Ok(json_response(StatusCode::OK, &entry(c)))
}

/// `DELETE /config/cert/{certId}`.
pub async fn remove(
    State(st): State<ApiState>,
    Path(id): Path<String>,
    _: NoQuery,
) -> Result<Response, ApiError> {
    let rules = st.store.snapshot();
    st.certs
        .delete(&id, |cur, next| match uncovered(&rules, cur, next) {
            None => Ok(()),
            Some(msg) => Err(format!("certificate {id:?} is in use: {msg}")),
        })
        .map_err(store_error)?;
    tracing::info!(cert_id = %id, "certificate deleted");
    Ok(error::success())
}

/// The first TLS rule that has a certificate in `before` and none in `after`, described. A
/// rule already without one (its certificate was staged away, say) is not this change's
/// doing and does not block it.
pub fn uncovered(
    rules: &RuleSnapshot,
    before: &CertSnapshot,
    after: &CertSnapshot,
) -> Option<String> {
    rules.rules.iter().find_map(|(key, r)| {
        let s = &r.rule.service;
        let lost =
            s.security != 0 && has_certificate(before, &s.host) && !has_certificate(after, &s.host);
        lost.then(|| format!("rule {key} (host {:?}) would have no certificate", s.host))
    })
}

/// True when a TLS rule with `host` has a certificate to serve: one covering the host, or the
/// `default` one (a host-less rule needs it).
pub fn has_certificate(certs: &CertSnapshot, host: &str) -> bool {
    (!host.is_empty() && certs.for_name(host).is_some()) || certs.default_cert().is_some()
}
