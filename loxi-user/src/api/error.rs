//! Every HTTP status body of the REST API is built here, in LoxiLB's shapes.
//!
//! Success (POST/DELETE): 200 `{"result":"Success"}` (what LoxiLB's handler writes; its
//! clients, loxicmd and kube-loxilb, read `result`). Errors: LoxiLB's `models.Error`,
//! `{"code":N,"fields":null,"message":"...","result":"..."}` with HTTP status N, plus loxi's
//! `field` (the JSON path at fault), e.g. `{"code":400,"fields":["serviceArguments.kv_exact_mode"],
//! "message":"\"kv_exact_mode\" is not a field; did you mean \"kvExactMode\"?","result":"...",
//! "field":"serviceArguments.kv_exact_mode"}`. LoxiLB puts a generic class text in `message`
//! and its internal error in `result`; loxi puts its specific reason in both (loxicmd prints
//! `message`, kube-loxilb reads `result`), worded for each in one case: the 409 of a rule
//! posted again with another shape says in `message` that the rule already exists, and avoids
//! the word in `result`, since kube-loxilb takes an error containing "exist" for its rule
//! installed ([`RuleError::message`]). Every body ends with `\n`, as go-openapi's encoder
//! writes it. Client mistakes are 400 (validation), 404 (nothing to delete) or 409 (same key,
//! other shape); only a failed state-file write is a 500.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::rules::RuleError;
use crate::rules::store::StoreError;

/// An API error: status, message, and the JSON path of the field at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable reason (printed verbatim by `loxicmd`).
    pub message: String,
    /// JSON path of the offending field (`serviceArguments.kvBlockSize`, `endpoints[1].weight`).
    pub field: Option<String>,
    /// The body's `result` (what kube-loxilb reads) when it must differ from `message`; `None`
    /// = `message`.
    pub result: Option<String>,
}

/// LoxiLB's error body (`models.Error`, keys in its order) plus loxi's `field`.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    /// HTTP status code repeated in the body.
    pub code: u16,
    /// The fields at fault (`null` when none, as LoxiLB sends it).
    pub fields: Option<[&'a str; 1]>,
    /// The reason.
    pub message: &'a str,
    /// The reason again (LoxiLB's internal error text; kube-loxilb reads this key).
    pub result: &'a str,
    /// The offending field's JSON path, on errors that have one (loxi's addition).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<&'a str>,
}

/// LoxiLB's success body, `{"result":"Success"}`.
#[derive(Debug, Serialize)]
pub struct ResultBody<'a> {
    /// `Success`.
    pub result: &'a str,
}

/// `value` as JSON plus the trailing newline go-openapi writes, with `status`.
pub fn json_response<T: Serialize>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(mut body) => {
            body.push(b'\n');
            (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
        }
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the answer failed: {e}\n"),
        )
            .into_response(),
    }
}

impl ApiError {
    /// A 400 naming `field`.
    pub fn bad_field(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            field: Some(field.into()),
            result: None,
        }
    }

    /// A 400 naming query parameter `key`, which the route does not read (`known` are the
    /// ones it does, none for a route that reads none): a typo would otherwise answer another
    /// view than the one asked for, and a parameter nothing reads would be silently inert.
    pub fn unknown_query_param(key: &str, known: &[&str]) -> Self {
        let reads = if known.is_empty() {
            "it reads none".to_string()
        } else {
            known.join(", ")
        };
        Self::bad_field(
            key,
            format!("{key:?} is not a query parameter of this route ({reads})"),
        )
    }

    /// A 400 about a rule's field, its message prefixed with the field's path as the
    /// validator's [`RuleError::Invalid`] is (`serviceArguments.security: 1 (TLS) needs ...`),
    /// so every refusal of a rule body names its field in `message`, the text loxicmd prints.
    /// (`bad_field` keeps `message` as given, for messages that quote their key already.)
    pub fn invalid_field(field: impl Into<String>, message: impl Into<String>) -> Self {
        RuleError::Invalid {
            field: field.into(),
            message: message.into(),
        }
        .into()
    }

    /// A 400 about the body as a whole (not JSON, not an object).
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            field: None,
            result: None,
        }
    }

    /// An error with any status and no field (401, 403, 409, 413, 415, ...).
    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            field: None,
            result: None,
        }
    }

    /// A 404 (nothing matched).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            field: None,
            result: None,
        }
    }

    /// A 500 with the reason.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            field: None,
            result: None,
        }
    }
}

impl From<RuleError> for ApiError {
    fn from(e: RuleError) -> Self {
        let (message, result) = (e.message(), e.to_string());
        let result = (result != message).then_some(result);
        let (status, field) = match e {
            RuleError::Invalid { field, .. } | RuleError::UnknownField { field, .. } => {
                (StatusCode::BAD_REQUEST, field)
            }
            RuleError::Conflict { field, .. } => (StatusCode::CONFLICT, field),
            RuleError::IdTaken { .. } => (StatusCode::CONFLICT, "serviceArguments.id".into()),
        };
        Self {
            status,
            message,
            field: Some(field),
            result,
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Invalid(r) => r.into(),
            StoreError::NotFound(_) => Self::not_found(e.to_string()),
            StoreError::Persist(_) => Self::internal(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = %self.status, message = %self.message, "API error");
        }
        let body = ErrorBody {
            code: self.status.as_u16(),
            fields: self.field.as_deref().map(|f| [f]),
            message: &self.message,
            result: self.result.as_deref().unwrap_or(&self.message),
            field: self.field.as_deref(),
        };
        json_response(self.status, &body)
    }
}

/// LoxiLB's success answer: 200 `{"result":"Success"}\n`.
pub fn success() -> Response {
    json_response(StatusCode::OK, &ResultBody { result: "Success" })
}

/// An unreadable request body is 400; one over the API's body limit is 413.
pub(super) fn body_error(e: axum::extract::rejection::BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return body_too_large();
    }
    ApiError::bad_body(format!("cannot read the body: {}", e.body_text()))
}

/// 400 when the request body is not UTF-8 (JSON is UTF-8 text, RFC 8259 §8.1), naming the
/// first byte that is not: serde_json would report it as an invalid code point at a line and
/// column, or as an unexpected character. Like every error about the body as a whole, it
/// names no field (`fields` is `null`, as in LoxiLB's errors without one).
pub(super) fn utf8_body(body: &[u8]) -> Result<(), ApiError> {
    std::str::from_utf8(body).map(|_| ()).map_err(|e| {
        ApiError::bad_body(format!(
            "request body is not UTF-8 at byte {} (of {}); JSON is UTF-8 text",
            e.valid_up_to(),
            body.len()
        ))
    })
}

/// 413: the request body is (or declares itself) larger than [`API_BODY_LIMIT`].
pub(super) fn body_too_large() -> ApiError {
    ApiError::with_status(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("request body exceeds the API's {API_BODY_LIMIT}-byte limit"),
    )
}

/// The REST API's request body limit in bytes (axum's default, 2 MiB): a rule with the
/// maximum [`crate::rules::validate::MAX_ENDPOINTS`] endpoints is about 100 KiB.
pub const API_BODY_LIMIT: usize = 2 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule_errors_map_to_400_and_409_with_the_field() {
        let e: ApiError = RuleError::UnknownField {
            field: "serviceArguments.kv_exact_mode".into(),
            suggestion: Some("kvExactMode".into()),
        }
        .into();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            e.message,
            "\"kv_exact_mode\" is not a field; did you mean \"kvExactMode\"?"
        );
        assert_eq!(e.field.as_deref(), Some("serviceArguments.kv_exact_mode"));
        let c: ApiError = RuleError::Conflict {
            field: "serviceArguments.sel".into(),
            existing: "0".into(),
        }
        .into();
        assert_eq!(c.status, StatusCode::CONFLICT);
        assert_eq!(c.field.as_deref(), Some("serviceArguments.sel"));
    }

    /// The 409 of a rule posted again with another shape tells a person that the rule exists
    /// (`message`, printed by loxicmd), and keeps the word "exist" out of `result`: kube-loxilb
    /// reads `result` and takes an error containing "exist" for its rule installed.
    #[test]
    fn a_reshape_409_says_exists_in_message_and_not_in_result() {
        let c: ApiError = RuleError::Conflict {
            field: "serviceArguments.sel".into(),
            existing: "0".into(),
        }
        .into();
        let body: serde_json::Value = serde_json::from_slice(&body_bytes(c)).expect("JSON");
        assert_eq!(body["code"], 409);
        assert_eq!(
            body["message"],
            "serviceArguments.sel: a rule with this key already exists with another shape \
             (serviceArguments.sel = 0); delete it first (loxi does not change a rule's shape in \
             place)"
        );
        assert_eq!(
            body["result"],
            "serviceArguments.sel: the rule with this key has serviceArguments.sel = 0; delete \
             it first"
        );
        assert!(!body["result"].as_str().unwrap_or("exist").contains("exist"));
        assert_eq!(body["field"], "serviceArguments.sel");
        // Any other error carries one text in both.
        let id: ApiError = RuleError::IdTaken {
            id: "a".into(),
            rule: "10.0.0.1:80/tcp".into(),
        }
        .into();
        assert_eq!(id.status, StatusCode::CONFLICT);
        let body: serde_json::Value = serde_json::from_slice(&body_bytes(id)).expect("JSON");
        assert_eq!(body["message"], body["result"]);
        assert!(!body["result"].as_str().unwrap_or("exist").contains("exist"));
    }

    /// A body that is not UTF-8 is refused naming the byte, in the shape of every error about
    /// the body as a whole (`fields` null, no `field`).
    #[test]
    fn a_body_that_is_not_utf8_names_the_byte() {
        assert_eq!(utf8_body("{\"a\": \"é\"}".as_bytes()), Ok(()));
        let e = utf8_body(b"{\"a\": \"\xff\"}").expect_err("not UTF-8");
        let body: serde_json::Value = serde_json::from_slice(&body_bytes(e)).expect("JSON");
        assert_eq!(
            body,
            serde_json::json!({
                "code": 400,
                "fields": null,
                "message": "request body is not UTF-8 at byte 7 (of 10); JSON is UTF-8 text",
                "result": "request body is not UTF-8 at byte 7 (of 10); JSON is UTF-8 text"
            })
        );
        let not_json: serde_json::Value =
            serde_json::from_slice(&body_bytes(ApiError::bad_body("x"))).expect("JSON");
        assert_eq!(not_json["fields"], body["fields"], "the same shape");
    }

    /// The body `e` answers with.
    fn body_bytes(e: ApiError) -> Vec<u8> {
        let resp = e.into_response();
        let body = resp.into_body();
        let bytes = futures::executor::block_on(axum::body::to_bytes(body, 1 << 16));
        bytes.expect("body").to_vec()
    }

    #[test]
    fn invalid_field_names_the_field_in_the_message_as_the_validator_does() {
        let e = ApiError::invalid_field("serviceArguments.security", "1 (TLS) needs a certificate");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            e.message,
            "serviceArguments.security: 1 (TLS) needs a certificate"
        );
        assert_eq!(e.field.as_deref(), Some("serviceArguments.security"));
    }

    #[test]
    fn store_errors_map_to_404_and_500() {
        let nf: ApiError = StoreError::NotFound("1.2.3.4:80/tcp".into()).into();
        assert_eq!(nf.status, StatusCode::NOT_FOUND);
        let io = std::io::Error::other("disk full");
        let p = crate::rules::persist::PersistError::Write {
            path: "/x".into(),
            source: io,
        };
        let e: ApiError = StoreError::Persist(p).into();
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(e.message.contains("disk full"), "{}", e.message);
    }
}
