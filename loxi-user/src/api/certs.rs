//! LoxiLB's certificate API (`/config/cert`): the certificates TLS rules (`security: 1`) serve.
//!
//! | Method | Path | Answer |
//! |---|---|---|
//! | `POST` | `/config/cert` | 201 `{"result":"Success"}` with the `GET` entry's keys (`"warning"` too when it expires within 14 days) for `{"certId"?, "certPem", "keyPem", "chainPem"?}` (id minted when absent); 400 malformed PEM, no key, key not the certificate's, expired, bad id; 409 the id exists |
//! | `PUT` | `/config/cert/{certId}` | 200 the same body: the certificate rotated (new handshakes get it, open connections keep theirs); 404 unknown id; 409 when a `security: 1` rule's host would be left with no certificate whose names match it |
//! | `GET` | `/config/cert`, `/config/cert/all` | 200 `{"certAttr":[{"certId","hostnames","ipAddresses"?,"notBefore","notAfter","expiresSoon"}]}` (never the key; `ipAddresses`, the SAN IP addresses, only when there is one) |
//! | `GET` | `/config/cert/{certId}` | 200 one entry; 404 |
//! | `DELETE` | `/config/cert/{certId}` | 200; 404; 409 while a `security: 1` rule's host has no other certificate whose names match it (a `default` one whose names do not match does not count) |
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
use crate::certs::parse::{EXPIRY_WARNING_SECS, ip_host};
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

/// The body's keys.
const BODY_FIELDS: [&str; 4] = ["certId", "certPem", "keyPem", "chainPem"];

/// The shape of the body, said in body errors.
const BODY_SHAPE: &str = "the body is {\"certId\"?, \"certPem\", \"keyPem\", \"chainPem\"?} \
                          (PEM text in JSON strings)";

/// The body of `POST` and `PUT`; a 400 naming the key at fault (`field`) for an unknown key,
/// a key given twice (also as two spellings of one field), a missing `certPem`/`keyPem`, or a
/// value that is not a string (`null` is absent for the optional `certId` and `chainPem`); a
/// body that is not a JSON object names none. Keys match ignoring ASCII case (`CertPem`), as
/// Go's `encoding/json` and the rule API ([`super::fields`]) match them.
fn parse_body(body: Result<Bytes, BytesRejection>) -> Result<CertBody, ApiError> {
    let body = body.map_err(super::error::body_error)?;
    super::error::utf8_body(&body)?;
    let mut v = match crate::rules::json::first_repeat(&body) {
        (_, Some(field)) => {
            return Err(ApiError::bad_field(
                field.clone(),
                format!(
                    "{field}: appears twice; loxi refuses the body rather than keep one of the \
                     values silently; {BODY_SHAPE}"
                ),
            ));
        }
        (Ok(v), None) => v,
        (Err(e), None) => {
            return Err(ApiError::bad_body(format!("not JSON ({e}); {BODY_SHAPE}")));
        }
    };
    let Value::Object(map) = &mut v else {
        return Err(ApiError::bad_body(format!(
            "not a JSON object; {BODY_SHAPE}"
        )));
    };
    let keys: Vec<String> = map.keys().cloned().collect();
    for k in keys {
        let Some(canonical) = BODY_FIELDS.iter().find(|f| f.eq_ignore_ascii_case(&k)) else {
            return Err(ApiError::bad_field(
                k.as_str(),
                format!("{k:?} is not a field of a certificate; {BODY_SHAPE}"),
            ));
        };
        if *canonical == k {
            continue;
        }
        if map.contains_key(*canonical) {
            return Err(ApiError::bad_field(
                k.as_str(),
                format!("\"{k}\" and \"{canonical}\" are the same field; give it once"),
            ));
        }
        if let Some(value) = map.remove(&k) {
            map.insert((*canonical).to_string(), value);
        }
    }
    for f in BODY_FIELDS {
        let required = matches!(f, "certPem" | "keyPem");
        match map.get(f) {
            Some(Value::String(_)) => {}
            None | Some(Value::Null) if !required => {}
            None => {
                return Err(ApiError::bad_field(
                    f,
                    format!("{f}: missing; {BODY_SHAPE}"),
                ));
            }
            Some(other) => {
                return Err(ApiError::bad_field(
                    f,
                    format!("{f}: {other} is not a string; {BODY_SHAPE}"),
                ));
            }
        }
    }
    serde_json::from_value(v).map_err(|e| ApiError::bad_body(format!("{e}; {BODY_SHAPE}")))
}

/// The PEM of an upload, its `certPem` and `chainPem` holding certificates only (400 naming
/// the field and the first other item, [`crate::certs::parse::check_items`]).
fn pem(b: CertBody) -> Result<CertPem, ApiError> {
    let pem = CertPem {
        cert_pem: b.cert_pem,
        key_pem: b.key_pem,
        chain_pem: b.chain_pem.filter(|c| !c.trim().is_empty()),
    };
    crate::certs::parse::check_items(&pem).map_err(|e| store_error(CertStoreError::Invalid(e)))?;
    Ok(pem)
}

/// The API error of a refused store change: 400 naming the body field at fault (`certPem`,
/// `keyPem`, `chainPem` or `certId`, as [`crate::certs::CertError::field`] says), 409 naming
/// `certId` for an existing id, 409 (a rule needs the certificate), 404, 500.
fn store_error(e: CertStoreError) -> ApiError {
    let message = e.to_string();
    match e {
        CertStoreError::Invalid(c) => ApiError::bad_field(c.field(), message),
        CertStoreError::Exists(_) => ApiError {
            field: Some("certId".into()),
            ..ApiError::with_status(StatusCode::CONFLICT, message)
        },
        CertStoreError::InUse(_) => ApiError::with_status(StatusCode::CONFLICT, message),
        CertStoreError::NotFound(_) => ApiError::not_found(message),
        CertStoreError::Persist { .. } => ApiError::internal(message),
    }
}

/// One certificate as the API lists it (no key). `hostnames` is LoxiLB's (SAN DNS names, else
/// the CN when there is no subjectAltName extension); `ipAddresses`, a loxi extension, lists the SAN IP addresses and is present only
/// when there is one (a certificate without IP addresses is answered as LoxiLB answers it).
fn entry(c: &Certificate) -> Value {
    let mut e = json!({
        "certId": c.id,
        "hostnames": c.hostnames,
        "notBefore": c.not_before,
        "notAfter": c.not_after,
        "expiresSoon": c.not_after - unix_now() < EXPIRY_WARNING_SECS,
    });
    if !c.ip_addresses.is_empty() {
        e["ipAddresses"] = json!(c.ip_addresses);
    }
    e
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
    let c = st.certs.create(id, pem(b)?).map_err(store_error)?;
    tracing::info!(cert_id = %c.id, hostnames = ?c.names(), "certificate stored");
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
    // A body's certId, when given, names the path's (an empty one too: POST refuses it).
    if b.cert_id.as_deref().is_some_and(|i| i != id) {
        return Err(ApiError::bad_field(
            "certId",
            format!("the body's certId differs from the path's {id:?}"),
        ));
    }
    let _coverage = st.certs.coverage_lock().await;
    let rules = st.store.snapshot();
    let c = st
        .certs
        .replace(&id, pem(b)?, |cur, next| {
            match uncovered(&rules, cur, next) {
                None => Ok(()),
                Some(msg) => Err(format!(
                    "the new certificate for {id:?} does not cover every rule the old one served: \
                 {msg}; nothing was changed"
                )),
            }
        })
        .map_err(store_error)?;
    tracing::info!(cert_id = %c.id, hostnames = ?c.names(), "certificate rotated");
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
    let _coverage = st.certs.coverage_lock().await;
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

/// `DELETE /config/cert/all`: deletes the certificate with id `all`, which versions before
/// the id was reserved accepted and restore still loads (`GET` of this path is the list, so
/// without this route it could never be removed); as [`remove`] otherwise.
pub async fn remove_all_id(State(st): State<ApiState>, q: NoQuery) -> Result<Response, ApiError> {
    remove(State(st), Path("all".into()), q).await
}

/// The TLS rules that have a certificate in `before` and none in `after` (in the sense of
/// [`has_certificate`]: for a rule with a `host`, a certificate whose names match it; the
/// `default` one counts only when its names do; only certificates valid now count, so
/// deleting a valid certificate beside an expired one for the same host is refused, and
/// removing an expired one is not this check's business), each described with its key and host, joined
/// by `; ` (the first [`UNCOVERED_NAMED`], then how many more); `None` when there is none. A
/// rule already without one (its certificate was staged away, say) is not this change's doing
/// and does not block it.
pub fn uncovered(
    rules: &RuleSnapshot,
    before: &CertSnapshot,
    after: &CertSnapshot,
) -> Option<String> {
    let now = unix_now();
    let (before, after) = (&before.valid_at(now), &after.valid_at(now));
    let lost: Vec<String> = rules
        .rules
        .iter()
        .filter_map(|(key, r)| uncovered_rule(key, &r.rule.service, before, after))
        .collect();
    if lost.is_empty() {
        return None;
    }
    let mut msg = lost
        .iter()
        .take(UNCOVERED_NAMED)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("; ");
    if lost.len() > UNCOVERED_NAMED {
        msg.push_str(&format!(
            "; and {} more rules",
            lost.len() - UNCOVERED_NAMED
        ));
    }
    Some(msg)
}

/// How many rules a refusal of [`uncovered`] describes; it counts the rest.
pub const UNCOVERED_NAMED: usize = 8;

/// [`uncovered`] for one rule (`key`, its service arguments `s`).
fn uncovered_rule(
    key: &impl std::fmt::Display,
    s: &crate::rules::model::ServiceArgs,
    before: &CertSnapshot,
    after: &CertSnapshot,
) -> Option<String> {
    let lost =
        s.security != 0 && has_certificate(before, &s.host) && !has_certificate(after, &s.host);
    if !lost {
        return None;
    }
    if s.host.is_empty() {
        return Some(format!(
            "rule {key} (no host) would have no certificate: a rule without host serves the \
             `default` one"
        ));
    }
    if ip_host(&s.host).is_some() {
        return Some(format!(
            "rule {key} (host {:?}) would have no certificate whose names match its host \
             ({})",
            s.host,
            ip_host_default(after, &s.host)
        ));
    }
    let default = match after.default_cert() {
        Some(d) => format!(
            " (the `default` certificate's names {:?} do not match it, and clients that \
             verify the certificate would refuse it)",
            d.names()
        ),
        None => String::new(),
    };
    Some(format!(
        "rule {key} (host {:?}) would have no certificate whose names match its host{default}",
        s.host
    ))
}

/// True when a TLS rule with `host` has a certificate clients can verify for it: for a rule
/// with a DNS name as `host`, one whose names match the host exactly or by wildcard, as the
/// SNI selection matches ([`CertSnapshot::for_name`]; the `default` certificate counts only
/// when its names match); for a rule whose `host` is an IP address, the `default` certificate
/// with that SAN IP address (clients send no SNI for an IP address, RFC 6066 §3, so the
/// `default` certificate is the one they get; a DNS name spelled like the address does not
/// count, [`crate::certs::Certificate::covers`]); for a host-less rule, the `default`
/// certificate (it serves every handshake of such a rule).
pub fn has_certificate(certs: &CertSnapshot, host: &str) -> bool {
    if host.is_empty() {
        certs.default_cert().is_some()
    } else if ip_host(host).is_some() {
        certs.default_cert().is_some_and(|d| d.covers(host))
    } else {
        certs.for_name(host).is_some()
    }
}

/// Why the `default` certificate does not serve IP host `host` (see [`has_certificate`]): the
/// clause said in refusals, naming what it has instead and any other certificate with the
/// address (which clients never get: without SNI only `default` is served).
fn ip_host_default(certs: &CertSnapshot, host: &str) -> String {
    let why = "clients connecting to an IP address send no SNI and get the `default` certificate";
    let default = match certs.default_cert() {
        None => "and there is no `default` one".to_string(),
        Some(d) if d.ip_addresses.is_empty() => format!(
            "whose names {:?} include no IP address (a DNS name spelled like an address does not \
             count: clients check an IP host against the IP addresses only)",
            d.hostnames
        ),
        Some(d) => format!(
            "whose IP addresses {:?} do not include it",
            d.ip_addresses
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        ),
    };
    let elsewhere = certs
        .certs
        .values()
        .find(|c| c.id != crate::certs::store::DEFAULT_ID && c.covers(host))
        .map(|c| {
            format!(
                "; certificate {:?} has IP:{} but is not `default`, so no client gets it",
                c.id,
                ip_host(host).map_or_else(|| host.to_string(), |ip| ip.to_string())
            )
        })
        .unwrap_or_default();
    format!("{why}, {default}{elsewhere}")
}

/// What a TLS rule with `host` lacks when it has no certificate ([`has_certificate`] is
/// false), and the exact command that uploads one: `(what, fix)`. Said by the rule API's
/// refusal of such a rule.
pub fn missing_certificate(certs: &CertSnapshot, host: &str) -> (String, String) {
    const FILES: &str = "--cert-file CERT.pem --key-file KEY.pem [--chain-file CHAIN.pem]";
    if host.is_empty() {
        return (
            "a rule without host serves the `default` certificate, and there is none".into(),
            format!(
                "upload one with the id `default`: `loxicmd create cert {FILES} --cert-id \
                 default` (or POST /netlox/v1/config/cert with \"certId\":\"default\")"
            ),
        );
    }
    if let Some(ip) = ip_host(host) {
        let what = format!(
            "host {host:?} is an IP address: {}",
            ip_host_default(certs, host)
        );
        let fix = if certs.default_cert().is_some() {
            format!(
                "rotate `default` to a certificate whose subjectAltName also has IP:{ip}: PUT \
                 /netlox/v1/config/cert/default with {{\"certPem\", \"keyPem\", \
                 \"chainPem\"?}} (`loxicmd create cert` refuses an id in use)"
            )
        } else {
            format!(
                "upload one whose subjectAltName has IP:{ip} with the id `default`: `loxicmd \
                 create cert {FILES} --cert-id default` (or POST /netlox/v1/config/cert with \
                 \"certId\":\"default\")"
            )
        };
        return (what, fix);
    }
    let what = match certs.default_cert() {
        Some(d) => format!(
            "no certificate covers host {host:?} (the `default` certificate's names {:?} do not \
             match it, and clients that verify the certificate would refuse it)",
            d.names()
        ),
        None => format!("no certificate covers host {host:?} and there is no `default` one"),
    };
    let wildcard = match host.split_once('.') {
        Some((_, parent)) if parent.contains('.') => format!(" (or DNS:*.{parent})"),
        _ => String::new(),
    };
    let fix = format!(
        "upload one whose subjectAltName has DNS:{host}{wildcard}: `loxicmd create cert {FILES} \
         [--cert-id ID]` (or POST /netlox/v1/config/cert)"
    );
    (what, fix)
}

/// When the certificate that would serve a TLS rule with `host` in `all` (for a host-less
/// rule or an IP host: the `default` one, if its names cover the host) is not valid now
/// (expired, or not valid yet), what [`missing_certificate`] says instead, as `(what, fix)`:
/// that certificate named with its validity, and its rotation (`PUT`, since `POST` refuses an
/// id in use). `None` otherwise.
pub fn expired_match(all: &CertSnapshot, host: &str) -> Option<(String, String)> {
    let now = unix_now();
    let matching = if host.is_empty() {
        all.default_cert()
    } else if ip_host(host).is_some() {
        all.default_cert().filter(|d| d.covers(host))
    } else {
        all.for_name(host)
    };
    let c = matching.filter(|c| !c.valid_at(now))?;
    let what = format!(
        "certificate {:?}, the one {} serves, is not valid now (notBefore {}, notAfter {}, Unix \
         seconds), and only a valid certificate covers a new rule",
        c.id,
        if host.is_empty() {
            "a rule without host".to_string()
        } else {
            format!("host {host:?}")
        },
        c.not_before,
        c.not_after
    );
    let fix = format!(
        "rotate it: PUT /netlox/v1/config/cert/{} with {{\"certPem\", \"keyPem\", \
         \"chainPem\"?}} of a valid certificate (`loxicmd create cert` refuses an id in use)",
        c.id
    );
    Some((what, fix))
}

/// True when a TLS rule with `host` gets some certificate in its handshakes: one that
/// [`has_certificate`], or else the `default` one whatever its names (clients that verify
/// the certificate refuse that one). Restore keeps a stored rule that is servable (a rule
/// stored before the API asked for a matching certificate would otherwise be dropped at
/// upgrade), warning when it is served only by a non-matching `default`.
pub fn servable(certs: &CertSnapshot, host: &str) -> bool {
    has_certificate(certs, host) || certs.default_cert().is_some()
}

#[cfg(test)]
#[path = "certs_tests.rs"]
mod tests;
