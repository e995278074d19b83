//! Strict field checking of a rule body before serde sees it.
//!
//! LoxiLB silently drops unknown or wrongly cased keys (`kv_exact_mode` for `kvExactMode`), so
//! the feature never engages. loxi walks the raw JSON against the field lists of
//! [`crate::rules::model`] and rejects the first unknown key with the right spelling when one is
//! close: equal after lower-casing and removing `_`/`-` (casing and separator mistakes), or
//! within a small edit distance (typos). Then [`parse_rule`] deserialises with
//! `serde_path_to_error`, so a wrong type names its field too.

use serde_json::Value;

use super::error::ApiError;
use crate::rules::RuleError;
use crate::rules::model::{ENDPOINT_FIELDS, LbRule, RULE_FIELDS, SERVICE_FIELDS};

/// Top-level keys `GET .../all` adds that are not part of a rule (dropped on input, so a
/// listed rule can be posted back).
const OUTPUT_ONLY: &[&str] = &["listenerState"];

/// Parses a POSTed rule body: JSON syntax, then every key, then types. Errors name the field.
pub fn parse_rule(body: &[u8]) -> Result<LbRule, ApiError> {
    let mut value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_body(format!("body is not valid JSON: {e}")))?;
    if let Value::Object(o) = &mut value {
        for k in OUTPUT_ONLY {
            o.remove(*k);
        }
    }
    check_rule_fields(&value)?;
    serde_path_to_error::deserialize(value).map_err(type_error)
}

/// Checks every key of a rule object (top level, `serviceArguments`, each endpoint).
pub fn check_rule_fields(value: &Value) -> Result<(), ApiError> {
    let obj = value.as_object().ok_or_else(|| {
        ApiError::bad_body("body must be a JSON object {serviceArguments, endpoints}")
    })?;
    check_keys(obj.keys(), "", RULE_FIELDS)?;
    match obj.get("serviceArguments") {
        Some(Value::Object(s)) => check_keys(s.keys(), "serviceArguments.", SERVICE_FIELDS)?,
        Some(_) => return Err(ApiError::bad_field("serviceArguments", "must be an object")),
        None => return Err(ApiError::bad_field("serviceArguments", "is required")),
    }
    match obj.get("endpoints") {
        Some(Value::Array(eps)) => {
            for (i, ep) in eps.iter().enumerate() {
                let ep = ep.as_object().ok_or_else(|| {
                    ApiError::bad_field(format!("endpoints[{i}]"), "must be an object")
                })?;
                check_keys(ep.keys(), &format!("endpoints[{i}]."), ENDPOINT_FIELDS)?;
            }
        }
        Some(Value::Null) | None => {}
        Some(_) => return Err(ApiError::bad_field("endpoints", "must be an array")),
    }
    Ok(())
}

fn check_keys<'a>(
    keys: impl Iterator<Item = &'a String>,
    prefix: &str,
    known: &[&str],
) -> Result<(), ApiError> {
    for key in keys {
        if !known.contains(&key.as_str()) {
            let field = format!("{prefix}{key}");
            let suggestion = suggest(key, known).map(str::to_string);
            return Err(RuleError::UnknownField { field, suggestion }.into());
        }
    }
    Ok(())
}

/// The known field `key` was most likely meant to be, if any.
pub fn suggest<'a>(key: &str, known: &[&'a str]) -> Option<&'a str> {
    let norm = normalize(key);
    if let Some(hit) = known.iter().find(|k| normalize(k) == norm) {
        return Some(hit);
    }
    let max = if norm.len() <= 4 { 1 } else { 2 };
    known
        .iter()
        .map(|k| (edit_distance(&norm, &normalize(k)), *k))
        .filter(|(d, _)| *d <= max)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn normalize(s: &str) -> String {
    s.chars()
        .filter(|c| *c != '_' && *c != '-')
        .flat_map(char::to_lowercase)
        .collect()
}

/// Levenshtein distance over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Turns a typed-deserialisation error into a 400 naming the field.
fn type_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner().to_string();
    // "missing field `externalIP`" points at the parent object; name the field itself.
    if let Some(name) = inner
        .strip_prefix("missing field `")
        .and_then(|r| r.strip_suffix('`'))
    {
        let field = if path == "." {
            name.to_string()
        } else {
            format!("{path}.{name}")
        };
        return ApiError::bad_field(field.clone(), format!("\"{name}\" is required"));
    }
    let leaf = path
        .rsplit_once('.')
        .map_or(path.as_str(), |(_, l)| l)
        .to_string();
    ApiError::bad_field(
        path,
        format!("\"{leaf}\" has a wrong type or value: {inner}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use serde_json::json;

    fn rule_with(extra_service: Value) -> Value {
        let mut s = json!({"externalIP": "10.0.0.1", "port": 80, "mode": 4});
        for (k, v) in extra_service.as_object().expect("object") {
            s[k] = v.clone();
        }
        json!({"serviceArguments": s, "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": 8000}]})
    }

    fn err_of(v: &Value) -> ApiError {
        parse_rule(v.to_string().as_bytes()).expect_err("must be rejected")
    }

    #[test]
    fn snake_case_spelling_of_a_camel_case_field_names_the_right_one() {
        let e = err_of(&rule_with(json!({"kv_exact_mode": 3})));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            e.message,
            "\"kv_exact_mode\" is not a field; did you mean \"kvExactMode\"?"
        );
        assert_eq!(e.field.as_deref(), Some("serviceArguments.kv_exact_mode"));
    }

    #[test]
    fn scenario_23_misspelled_block_size_keys_suggest_kv_block_size() {
        for bad in [
            "kv_block_size",
            "kvblocksize",
            "KVBLOCKSIZE",
            "kv-block-size",
        ] {
            let e = err_of(&rule_with(json!({ bad: 16 })));
            assert_eq!(
                e.message,
                format!("\"{bad}\" is not a field; did you mean \"kvBlockSize\"?")
            );
            assert_eq!(e.field, Some(format!("serviceArguments.{bad}")));
        }
    }

    #[test]
    fn camel_case_spelling_of_a_snake_case_field_is_caught() {
        let e = err_of(&rule_with(json!({"pdDisaggMode": true})));
        assert_eq!(
            e.message,
            "\"pdDisaggMode\" is not a field; did you mean \"pd_disagg_mode\"?"
        );
    }

    #[test]
    fn typo_is_suggested_by_edit_distance_and_nonsense_gets_no_suggestion() {
        let e = err_of(&rule_with(json!({"kvBlokSize": 16})));
        assert!(
            e.message.ends_with("did you mean \"kvBlockSize\"?"),
            "{}",
            e.message
        );
        let e = err_of(&rule_with(json!({"temperature": 1})));
        assert_eq!(e.message, "\"temperature\" is not a field");
    }

    #[test]
    fn endpoint_and_top_level_keys_are_checked_with_their_path() {
        let mut v = rule_with(json!({}));
        v["endpoints"][0]["endpointIp"] = json!("127.0.0.2");
        let e = err_of(&v);
        assert_eq!(e.field.as_deref(), Some("endpoints[0].endpointIp"));
        assert!(
            e.message.ends_with("did you mean \"endpointIP\"?"),
            "{}",
            e.message
        );
        let e = err_of(&json!({"service_arguments": {}, "endpoints": []}));
        assert_eq!(e.field.as_deref(), Some("service_arguments"));
        assert!(
            e.message.ends_with("did you mean \"serviceArguments\"?"),
            "{}",
            e.message
        );
    }

    #[test]
    fn wrong_type_names_the_field() {
        let e = err_of(&rule_with(json!({"kvBlockSize": "sixteen"})));
        assert_eq!(e.field.as_deref(), Some("serviceArguments.kvBlockSize"));
        assert!(
            e.message
                .starts_with("\"kvBlockSize\" has a wrong type or value"),
            "{}",
            e.message
        );
        let mut v = rule_with(json!({}));
        v["endpoints"][0]["weight"] = json!(-1);
        assert_eq!(err_of(&v).field.as_deref(), Some("endpoints[0].weight"));
        let e = err_of(&rule_with(json!({"port": 70000})));
        assert_eq!(e.field.as_deref(), Some("serviceArguments.port"));
    }

    #[test]
    fn missing_required_field_is_named() {
        let v = json!({"serviceArguments": {"port": 80}, "endpoints": []});
        let e = err_of(&v);
        assert_eq!(e.field.as_deref(), Some("serviceArguments.externalIP"));
        assert_eq!(e.message, "\"externalIP\" is required");
    }

    #[test]
    fn malformed_json_and_non_objects_are_400_without_panic() {
        let e = parse_rule(b"{\"serviceArguments\": ").expect_err("truncated");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.starts_with("body is not valid JSON"),
            "{}",
            e.message
        );
        assert_eq!(
            parse_rule(b"[1,2]").expect_err("array").status,
            StatusCode::BAD_REQUEST
        );
        let e = err_of(&json!({"serviceArguments": 5}));
        assert_eq!(e.field.as_deref(), Some("serviceArguments"));
        let e = err_of(
            &json!({"serviceArguments": {"externalIP": "1.1.1.1", "port": 1}, "endpoints": [3]}),
        );
        assert_eq!(e.field.as_deref(), Some("endpoints[0]"));
    }

    #[test]
    fn a_correct_rule_parses() {
        let r =
            parse_rule(rule_with(json!({"kvBlockSize": 32})).to_string().as_bytes()).expect("ok");
        assert_eq!(r.service.kv_block_size, 32);
        assert_eq!(r.endpoints[0].target_port, 8000);
    }
}
