//! A route's query parameters, each given at most once, and none on a route that reads none.
//!
//! axum's `Query<HashMap<_, _>>` keeps the last of a repeated key, so
//! `?model_name=a&model_name=b` would silently act on `b`: on a DELETE, the wrong rule. Every
//! loxi route reads a parameter once, so a repeated one is refused (400 naming it) instead.
//! A route that reads no parameter takes [`NoQuery`], so `?foo=1` there is a 400 too rather
//! than an answer that ignored it (the routes that read some refuse the others themselves).

use std::collections::HashMap;

use axum::extract::{FromRequestParts, Query};
use axum::http::request::Parts;

use super::error::ApiError;

/// The query as a map of single values: `?k=v&...`, each key at most once. Rejects (400) a
/// repeated key and a query that is not `application/x-www-form-urlencoded`.
#[derive(Debug, Default)]
pub struct OnceQuery(pub HashMap<String, String>);

impl<S: Send + Sync> FromRequestParts<S> for OnceQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Query(pairs) = Query::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::bad_field("query", e.body_text()))?;
        once(pairs).map(Self)
    }
}

/// The extractor of a route that reads no query parameter: any parameter (`?foo=1`, `?foo`)
/// is refused with 400 naming it ([`ApiError::unknown_query_param`]), as the routes that read
/// some refuse the ones they do not. An empty query (`?` or none) passes.
#[derive(Debug, Default)]
pub struct NoQuery;

impl<S: Send + Sync> FromRequestParts<S> for NoQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Query(pairs) = Query::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::bad_field("query", e.body_text()))?;
        none(&pairs)
    }
}

/// Refuses (400 naming the first) any of `pairs`: for a route that reads no parameter.
pub fn none(pairs: &[(String, String)]) -> Result<NoQuery, ApiError> {
    match pairs.first() {
        Some((k, _)) => Err(ApiError::unknown_query_param(k, &[])),
        None => Ok(NoQuery),
    }
}

/// `pairs` as a map, refusing (400 naming it) a key given twice.
pub fn once(pairs: Vec<(String, String)>) -> Result<HashMap<String, String>, ApiError> {
    let mut q = HashMap::with_capacity(pairs.len());
    for (k, v) in pairs {
        if q.contains_key(&k) {
            return Err(ApiError::bad_field(
                k.clone(),
                format!("query field `{k}` is given twice; give it once"),
            ));
        }
        q.insert(k, v);
    }
    Ok(q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_given_twice_is_refused_naming_it_and_single_keys_pass() {
        let pair = |k: &str, v: &str| (k.to_string(), v.to_string());
        let e = once(vec![
            pair("model_name", "a"),
            pair("host", "h"),
            pair("model_name", "b"),
        ])
        .expect_err("twice");
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert!(
            e.message.contains("`model_name` is given twice"),
            "{}",
            e.message
        );
        let q = once(vec![pair("model_name", "a"), pair("host", "")]).expect("once each");
        assert_eq!((q["model_name"].as_str(), q["host"].as_str()), ("a", ""));
    }

    #[test]
    fn a_route_that_reads_none_refuses_any_parameter_naming_it() {
        let e = none(&[("foo".to_string(), "1".to_string())]).expect_err("foo");
        assert_eq!(
            (e.status, e.field.as_deref(), e.message.as_str()),
            (
                axum::http::StatusCode::BAD_REQUEST,
                Some("foo"),
                "\"foo\" is not a query parameter of this route (it reads none)"
            )
        );
        assert!(none(&[]).is_ok(), "no parameter passes");
    }
}
