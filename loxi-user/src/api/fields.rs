//! Field checking of a rule body before serde sees it: LoxiLB's schema, Go's key matching,
//! loxi's strictness.
//!
//! LoxiLB silently drops unknown or wrongly spelled keys (`kv_exact_mode` for `kvExactMode`),
//! so the feature never engages. loxi walks the raw JSON against the field lists of
//! [`crate::rules::model`] and LoxiLB's own schema ([`crate::rules::schema`]):
//!
//! - a key of loxi's model is kept; a key that equals one ignoring ASCII case (`BGP`,
//!   `Monitor`, `KvExactMode`) is renamed to it, as Go's `encoding/json` matches keys, and the
//!   spelling is logged once per process;
//! - a LoxiLB field loxi does not model is accepted at its zero value (or, output-only ones,
//!   with any value) and dropped; another value is a 400 saying loxi does not implement it;
//! - any other key is a 400 naming the right spelling when one is close: equal after
//!   lower-casing and removing `_`/`-` (separator mistakes), or within a small edit distance.
//!
//! Then [`parse_rule`] deserialises with `serde_path_to_error`, so a wrong type names its field.

use std::collections::HashSet;
use std::sync::OnceLock;

use parking_lot::Mutex;
use serde_json::{Map, Value};

use super::error::ApiError;
use crate::rules::RuleError;
use crate::rules::model::{ENDPOINT_FIELDS, LbRule, RULE_FIELDS, SERVICE_FIELDS};
use crate::rules::schema::{self, ENDPOINT_FOREIGN, Foreign, RULE_FOREIGN, SERVICE_FOREIGN};

/// Parses a POSTed rule body: JSON syntax (an object naming one key twice is refused, see
/// [`strict_json`]), then every key, then types. Errors name the field.
pub fn parse_rule(body: &[u8]) -> Result<LbRule, ApiError> {
    rule_from_value(strict_json(body)?)
}

/// [`parse_rule`] for a rule already read as JSON (a rule of the state file at restore): the
/// same key checks (a case variant of a field renamed to it, LoxiLB's zero-valued fields
/// dropped, any other key refused naming it) and the same typed deserialisation, errors naming
/// the field.
pub fn rule_from_value(mut value: Value) -> Result<LbRule, ApiError> {
    normalize_rule_fields(&mut value)?;
    serde_path_to_error::deserialize(value).map_err(type_error)
}

/// [`rule_from_value`] for a rule of the state file at restore (`crate::rules::persist::load`'s
/// parser): the error as one line naming the field
/// (`serviceArguments.bogusField: "bogusField" is not a field`), not a list of every field
/// serde knows.
pub fn restored_rule(value: Value) -> Result<LbRule, String> {
    rule_from_value(value).map_err(|e| match e.field {
        Some(field) if !e.message.starts_with(&field) => format!("{field}: {}", e.message),
        _ => e.message,
    })
}

/// `body` as a JSON value, refusing an object that names the same key twice: serde_json's
/// `Value` (and Go's `encoding/json`, so LoxiLB) keep the last silently, so the first value
/// would be accepted and inert. 400 `body is not valid JSON` for a syntax error; 400 naming
/// the field (`serviceArguments.port`, `endpoints[1].weight`) for a repeated key; 400
/// `request body is not UTF-8 at byte N` for bytes that are not UTF-8. Nesting is
/// bounded by serde_json's recursion limit (128).
pub fn strict_json(body: &[u8]) -> Result<Value, ApiError> {
    super::error::utf8_body(body)?;
    match crate::rules::json::first_repeat(body) {
        (_, Some(field)) => Err(ApiError::invalid_field(
            field,
            "appears twice in its object; loxi refuses the body rather than keep one of the \
             values silently",
        )),
        (Ok(v), None) => Ok(v),
        (Err(e), None) => Err(ApiError::bad_body(format!("body is not valid JSON: {e}"))),
    }
}

/// Checks every key of a rule object (top level, `serviceArguments`, each endpoint), renames
/// case variants to loxi's spelling and drops LoxiLB fields that are at their zero value or
/// output only. Errors name the field.
pub fn normalize_rule_fields(value: &mut Value) -> Result<(), ApiError> {
    let obj = value.as_object_mut().ok_or_else(|| {
        ApiError::bad_body("body must be a JSON object {serviceArguments, endpoints}")
    })?;
    normalize_keys(obj, "", RULE_FIELDS, RULE_FOREIGN)?;
    match obj.get_mut("serviceArguments") {
        Some(Value::Object(s)) => {
            normalize_keys(s, "serviceArguments.", SERVICE_FIELDS, SERVICE_FOREIGN)?;
        }
        Some(_) => {
            return Err(ApiError::invalid_field(
                "serviceArguments",
                "must be an object",
            ));
        }
        None => return Err(ApiError::invalid_field("serviceArguments", "is required")),
    }
    match obj.get_mut("endpoints") {
        Some(Value::Array(eps)) => {
            for (i, ep) in eps.iter_mut().enumerate() {
                let ep = ep.as_object_mut().ok_or_else(|| {
                    ApiError::invalid_field(format!("endpoints[{i}]"), "must be an object")
                })?;
                normalize_keys(
                    ep,
                    &format!("endpoints[{i}]."),
                    ENDPOINT_FIELDS,
                    ENDPOINT_FOREIGN,
                )?;
            }
        }
        Some(Value::Null) | None => {}
        Some(_) => return Err(ApiError::invalid_field("endpoints", "must be an array")),
    }
    Ok(())
}

/// Spellings already logged (each non-canonical spelling is logged once per process).
fn logged() -> &'static Mutex<HashSet<String>> {
    static LOGGED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    LOGGED.get_or_init(|| Mutex::new(HashSet::new()))
}

/// At most this many distinct spellings are remembered (and logged): a client cycling through
/// casings cannot grow the set without bound.
const MAX_LOGGED_SPELLINGS: usize = 256;

fn log_once(given: &str, canonical: &str) {
    let mut seen = logged().lock();
    if seen.len() < MAX_LOGGED_SPELLINGS && seen.insert(given.to_string()) {
        tracing::info!(
            given,
            canonical,
            "accepted a key that matches a field only ignoring case (as LoxiLB's Go decoder does)"
        );
    }
}

/// What a key of a body object is.
enum Known<'a> {
    Model(&'a str),
    Foreign(&'a Foreign),
}

fn lookup<'a>(key: &str, model: &[&'a str], foreign: &'a [Foreign]) -> Option<Known<'a>> {
    if let Some(m) = model.iter().find(|m| **m == key) {
        return Some(Known::Model(m));
    }
    if let Some(f) = schema::find(foreign, key) {
        return Some(Known::Foreign(f));
    }
    if let Some(m) = model.iter().find(|m| m.eq_ignore_ascii_case(key)) {
        return Some(Known::Model(m));
    }
    foreign
        .iter()
        .find(|f| f.name.eq_ignore_ascii_case(key))
        .map(Known::Foreign)
}

fn normalize_keys(
    obj: &mut Map<String, Value>,
    prefix: &str,
    model: &[&str],
    foreign: &[Foreign],
) -> Result<(), ApiError> {
    let keys: Vec<String> = obj.keys().cloned().collect();
    let mut renamed: Vec<(String, &str)> = Vec::new();
    for key in keys {
        let field = format!("{prefix}{key}");
        match lookup(&key, model, foreign) {
            Some(Known::Model(canonical)) if canonical == key => {}
            Some(Known::Model(canonical)) => renamed.push((key, canonical)),
            Some(Known::Foreign(f)) => {
                if let Some(v) = obj.get(&key) {
                    f.check(v).map_err(|m| ApiError::invalid_field(field, m))?;
                }
                if f.name != key {
                    log_once(&key, f.name);
                }
                obj.remove(&key);
            }
            None => {
                let mut names: Vec<&str> = model.to_vec();
                names.extend(foreign.iter().map(|f| f.name));
                let suggestion = suggest(&key, &names).map(str::to_string);
                return Err(RuleError::UnknownField { field, suggestion }.into());
            }
        }
    }
    for (key, canonical) in renamed {
        if obj.contains_key(canonical) {
            return Err(ApiError::bad_field(
                format!("{prefix}{key}"),
                format!("\"{key}\" and \"{canonical}\" are the same field; give it once"),
            ));
        }
        if let Some(v) = obj.remove(&key) {
            log_once(&key, canonical);
            obj.insert(canonical.to_string(), v);
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
    fn a_key_named_twice_is_refused_naming_it_where_serde_json_keeps_the_last() {
        let cases = [
            (
                r#"{"serviceArguments":{"externalIP":"10.0.0.1","port":80,"port":81,"mode":4}}"#,
                "serviceArguments.port",
            ),
            (
                r#"{"serviceArguments":{"externalIP":"10.0.0.1","port":80,"mode":4},
                    "endpoints":[{"endpointIP":"127.0.0.1","targetPort":1},
                                 {"endpointIP":"127.0.0.1","weight":1,"targetPort":2,"weight":9}]}"#,
                "endpoints[1].weight",
            ),
            (
                r#"{"serviceArguments":{"externalIP":"10.0.0.1","port":80,"mode":4},
                    "endpoints":[],"endpoints":[]}"#,
                "endpoints",
            ),
        ];
        for (body, field) in cases {
            let plain: Value =
                serde_json::from_slice(body.as_bytes()).expect("serde_json takes it");
            assert!(plain.is_object(), "{plain}");
            let e = parse_rule(body.as_bytes()).expect_err(body);
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.field.as_deref(), Some(field), "{}", e.message);
            assert!(e.message.contains("appears twice"), "{}", e.message);
        }
        // A syntax error is still one.
        let e = parse_rule(b"{\"serviceArguments\": ").expect_err("truncated");
        assert!(
            e.message.starts_with("body is not valid JSON"),
            "{}",
            e.message
        );
        assert_eq!(e.field, None);
        // Bytes that are not UTF-8 (inside a string or not) name the byte, not a code point.
        let e = parse_rule(b"{\"serviceArguments\": {\"name\": \"a\xe9\"}}").expect_err("latin-1");
        assert_eq!(
            e.message,
            "request body is not UTF-8 at byte 32 (of 36); JSON is UTF-8 text"
        );
        assert_eq!(e.field, None);
        let e = parse_rule(b"{} x").expect_err("trailing characters");
        assert!(
            e.message.starts_with("body is not valid JSON"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_body_without_repeated_keys_parses_as_serde_json_parses_it() {
        let body = r#"{"a":[1,-2,3.5,18446744073709551615,1e300,null,true,"s\u00e9"],
                       "b":{"c":{"d":[[],{}]},"C":0},"e":""}"#;
        let strict = strict_json(body.as_bytes()).expect("valid");
        let plain: Value = serde_json::from_slice(body.as_bytes()).expect("valid");
        assert_eq!(strict, plain);
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
        for bad in ["kv_block_size", "kv-block-size", "KV_BLOCK_SIZE"] {
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
        v["endpoints"][0]["endpoint_ip"] = json!("127.0.0.2");
        let e = err_of(&v);
        assert_eq!(e.field.as_deref(), Some("endpoints[0].endpoint_ip"));
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
    fn go_style_case_insensitive_keys_are_accepted_under_their_canonical_name() {
        let r = parse_rule(
            rule_with(json!({"KvExactMode": 3, "BGP": false, "Monitor": true, "KVBLOCKSIZE": 32}))
                .to_string()
                .as_bytes(),
        )
        .expect("Go matches keys ignoring case");
        assert_eq!(
            (
                r.service.kv_exact_mode,
                r.service.kv_block_size,
                r.service.monitor
            ),
            (3, 32, true)
        );
        let e = err_of(&rule_with(json!({"monitor": true, "Monitor": false})));
        assert_eq!(e.field.as_deref(), Some("serviceArguments.Monitor"));
        assert!(e.message.contains("same field"), "{}", e.message);
    }

    #[test]
    fn loxilb_fields_at_zero_are_accepted_and_others_refused_as_not_implemented() {
        let mut v = rule_with(
            json!({"block": 0, "proxyprotocolv2": false, "egress": false,
            "portMax": 0, "privateIP": "", "adminStateUp": true, "alpn_protocols": null,
            "path_match_mode": "disabled"}),
        );
        v["hw_pkts"] = json!(5);
        v["secondaryIPs"] = json!(null);
        v["allowedSources"] = json!([]);
        v["endpoints"][0]["backup"] = json!(false);
        v["endpoints"][0]["counter"] = json!("10:1000");
        let r = parse_rule(v.to_string().as_bytes()).expect("zero values accepted");
        assert_eq!(r.endpoints.len(), 1);
        let e = err_of(&rule_with(json!({"portMax": 8081})));
        assert_eq!(e.field.as_deref(), Some("serviceArguments.portMax"));
        assert!(e.message.contains("not implemented"), "{}", e.message);
        let mut v = rule_with(json!({}));
        v["endpoints"][0]["backup"] = json!(true);
        assert_eq!(err_of(&v).field.as_deref(), Some("endpoints[0].backup"));
        let mut v = rule_with(json!({}));
        v["allowedSources"] = json!([{"prefix": "10.0.0.0/8"}]);
        assert_eq!(err_of(&v).field.as_deref(), Some("allowedSources"));
        let e = err_of(&rule_with(json!({"Block": 7})));
        assert_eq!(e.field.as_deref(), Some("serviceArguments.Block"));
    }

    #[test]
    fn a_correct_rule_parses() {
        let r =
            parse_rule(rule_with(json!({"kvBlockSize": 32})).to_string().as_bytes()).expect("ok");
        assert_eq!(r.service.kv_block_size, 32);
        assert_eq!(r.endpoints[0].target_port, 8000);
    }
}
