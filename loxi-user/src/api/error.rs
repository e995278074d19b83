//! Every HTTP error body of the REST API is built here.
//!
//! Shape (LoxiLB's `{code, message}` plus the offending field's JSON path when there is one):
//! `{"code":400,"message":"\"kv_exact_mode\" is not a field; did you mean \"kvExactMode\"?",
//! "field":"serviceArguments.kv_exact_mode"}`. Client mistakes are 400 (validation), 404
//! (nothing to delete) or 409 (same key, other shape); only a failed state-file write is a 500.

use axum::Json;
use axum::http::StatusCode;
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
}

/// The JSON body of every API answer that is not data: `{"code", "message", "field"?}`.
#[derive(Debug, Serialize)]
pub struct StatusBody<'a> {
    /// HTTP status code repeated in the body (LoxiLB's convention).
    pub code: u16,
    /// `success` or the error message.
    pub message: &'a str,
    /// The offending field, on errors that have one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<&'a str>,
}

impl ApiError {
    /// A 400 naming `field`.
    pub fn bad_field(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            field: Some(field.into()),
        }
    }

    /// A 400 about the body as a whole (not JSON, not an object).
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            field: None,
        }
    }

    /// An error with any status and no field (401, 403, 409, 413, 415, ...).
    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            field: None,
        }
    }

    /// A 404 (nothing matched).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            field: None,
        }
    }

    /// A 500 with the reason.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            field: None,
        }
    }
}

impl From<RuleError> for ApiError {
    fn from(e: RuleError) -> Self {
        let message = e.to_string();
        match e {
            RuleError::Invalid { field, .. } | RuleError::UnknownField { field, .. } => Self {
                status: StatusCode::BAD_REQUEST,
                message,
                field: Some(field),
            },
            RuleError::Conflict { field, .. } => Self {
                status: StatusCode::CONFLICT,
                message,
                field: Some(field),
            },
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
        let body = StatusBody {
            code: self.status.as_u16(),
            message: &self.message,
            field: self.field.as_deref(),
        };
        (self.status, Json(body)).into_response()
    }
}

/// LoxiLB's success answer: 200 `{"code":200,"message":"success"}`.
pub fn success() -> Response {
    let body = StatusBody {
        code: 200,
        message: "success",
        field: None,
    };
    (StatusCode::OK, Json(body)).into_response()
}

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
