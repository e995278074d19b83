//! A rule's free-text fields: the strings of `serviceArguments` that reach loxicmd's tables,
//! log lines, metric labels, URL paths and request lines. Each is printable text (no control
//! character: a newline in `name` split a `loxicmd get lb` row in two, one in `model_name`
//! broke every `/metrics` scrape) of at most [`MAX_TEXT_BYTES`] bytes (a 1 MB `name` was
//! stored, and listed again on every `GET .../all`).
//!
//! `host` is further checked as a host name (`validate.rs`); `backend_tls_server_name` must
//! parse as a DNS name or IP address (`proxy::upstream_tls::check`, which bounds it too);
//! `backend_ca_file` is a path that must be readable; `proberesp` is a substring of a probe's
//! answer body that appears in no table, label or request, so it is left as given.

use super::error::RuleError;
use super::model::{LbRule, ServiceArgs};

/// The longest free-text field of a rule, in bytes: a DNS name's length (RFC 1035 §2.3.4),
/// which bounds Kubernetes object names too. kube-loxilb names its rules
/// `<namespace>_<service>:<zone>-inst<n>`, three DNS labels of at most 63 bytes each, so its
/// names stay well under it; an Octavia id (a UUID) is 36 bytes.
pub const MAX_TEXT_BYTES: usize = 253;

/// The free-text fields of `s`: JSON name, value, and where the text ends up (completing
/// "... so it is printable text of at most 253 bytes").
fn fields(s: &ServiceArgs) -> [(&'static str, &str, &'static str); 6] {
    [
        (
            "name",
            &s.name,
            "a rule name is a column of loxicmd's tables",
        ),
        (
            "id",
            &s.id,
            "an id is listed by loxicmd and is the path segment of GET .../loadbalancer/id/{id}",
        ),
        (
            "host",
            &s.host,
            "a host is matched against the request's Host header and is a column of loxicmd's tables",
        ),
        (
            "model_name",
            &s.model_name,
            "a model name is matched against the request's model and is the `model` label of the metrics",
        ),
        (
            "session_header_name",
            &s.session_header_name,
            "a session key source names a request header, cookie or query parameter",
        ),
        (
            "probereq",
            &s.probereq,
            "a probe request is the path of the http probe's request line and a column of loxicmd get ep",
        ),
    ]
}

/// Why text `v` cannot be a free-text field's value, or `None` when it can.
fn fault(v: &str) -> Option<String> {
    if v.len() > MAX_TEXT_BYTES {
        // Never echoed: the value may be megabytes long.
        return Some(format!("{} bytes is too long", v.len()));
    }
    v.chars()
        .find(|c| c.is_control())
        .map(|c| format!("{v:?} contains the control character {c:?}"))
}

/// Refuses a control character or more than [`MAX_TEXT_BYTES`] bytes in any free-text field of
/// `s`, naming the field.
pub fn check(s: &ServiceArgs) -> Result<(), RuleError> {
    for (field, value, role) in fields(s) {
        if let Some(why) = fault(value) {
            return Err(RuleError::Invalid {
                field: format!("serviceArguments.{field}"),
                message: format!(
                    "{why}; {role}, so it is printable text of at most {MAX_TEXT_BYTES} bytes"
                ),
            });
        }
    }
    Ok(())
}

/// For a rule restored from the state file (stored before [`check`] refused them): clears a
/// `name` or `id` that [`check`] refuses, so the rule is kept and serves as before (neither
/// selects any traffic; the store mints a new id for an empty one). Returns the JSON names of
/// the fields cleared. A `host`, `model_name`, `session_header_name` or `probereq` that fails
/// is left: each changes what the rule serves, so such a rule is dropped (and kept aside) as
/// any rule that no longer validates.
pub fn reset_informational(r: &mut LbRule) -> Vec<&'static str> {
    let s = &mut r.service;
    let mut reset = Vec::new();
    if fault(&s.name).is_some() {
        s.name.clear();
        reset.push("name");
    }
    if fault(&s.id).is_some() {
        s.id.clear();
        reset.push("id");
    }
    reset
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(extra: serde_json::Value) -> ServiceArgs {
        let mut v = json!({"externalIP": "10.0.0.1", "port": 80, "mode": 4});
        for (k, x) in extra.as_object().expect("object") {
            v[k] = x.clone();
        }
        serde_json::from_value(v).expect("service arguments")
    }

    fn refusal(extra: serde_json::Value) -> (String, String) {
        match check(&args(extra.clone())) {
            Err(RuleError::Invalid { field, message }) => (field, message),
            other => panic!("{extra}: expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn control_characters_in_a_free_text_field_are_refused_naming_it() {
        for key in [
            "name",
            "id",
            "host",
            "model_name",
            "session_header_name",
            "probereq",
        ] {
            for bad in ["a\nb", "a\tb", "a\u{0}b", "a\u{7f}b", "a\u{85}b"] {
                let (field, message) = refusal(json!({ key: bad }));
                assert_eq!(field, format!("serviceArguments.{key}"), "{key}={bad:?}");
                assert!(
                    message.contains("contains the control character")
                        && message.contains("printable text of at most 253 bytes"),
                    "{message}"
                );
            }
        }
        let (_, message) = refusal(json!({"name": "web\nprod"}));
        assert_eq!(
            message,
            "\"web\\nprod\" contains the control character '\\n'; a rule name is a column of \
             loxicmd's tables, so it is printable text of at most 253 bytes"
        );
    }

    #[test]
    fn a_free_text_field_is_253_bytes_at_most_and_the_refusal_does_not_echo_it() {
        let at_bound = "n".repeat(MAX_TEXT_BYTES);
        check(&args(json!({"name": at_bound}))).expect("253 bytes");
        let (field, message) = refusal(json!({"name": "x".repeat(1 << 20)}));
        assert_eq!(field, "serviceArguments.name");
        assert_eq!(
            message,
            "1048576 bytes is too long; a rule name is a column of loxicmd's tables, so it is \
             printable text of at most 253 bytes"
        );
        // Bytes, not characters: 127 two-byte characters are 254 bytes.
        let (field, _) = refusal(json!({"model_name": "é".repeat(127)}));
        assert_eq!(field, "serviceArguments.model_name");
    }

    #[test]
    fn what_loxilbs_clients_send_passes() {
        check(&args(json!({
            "name": "default_tcp-lb-default:llb-inst0",
            "id": "3f0c5a52-1d1e-4c6f-9a43-2b6f0c1d9e77",
            "model_name": "meta-llama/Llama-3.1-8B-Instruct",
            "session_header_name": "cookie:sid",
            "probereq": "/health?full=1",
            "host": "api.example.com",
        })))
        .expect("printable and short");
        // The longest name kube-loxilb can make: namespace and service names and the zone are
        // DNS labels of at most 63 bytes.
        let label = "a".repeat(63);
        let kube = format!("{label}_{label}:{label}-inst99");
        check(&args(json!({ "name": kube }))).expect("kube-loxilb's longest name");
    }

    #[test]
    fn a_restored_rules_bad_name_and_id_are_cleared_and_nothing_else() {
        let mut r: LbRule = serde_json::from_value(json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "mode": 4,
                "name": "a\nb", "id": "x".repeat(300), "model_name": "m"},
            "endpoints": [{"endpointIP": "10.0.1.1", "targetPort": 8000}]
        }))
        .expect("rule");
        assert_eq!(reset_informational(&mut r), ["name", "id"]);
        assert_eq!((r.service.name.as_str(), r.service.id.as_str()), ("", ""));
        assert_eq!(r.service.model_name, "m");
        assert!(
            reset_informational(&mut r).is_empty(),
            "nothing left to clear"
        );
    }
}
