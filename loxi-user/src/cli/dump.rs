//! `loxicmd save` and `loxicmd apply`: the rule set to a file and back, in LoxiLB's format.
//!
//! `save --lb` (or `--all`) writes `GET /config/loadbalancer/all`'s answer, `{"lbAttr":[...]}`,
//! to `<config-path>/lbconfig.txt` (LoxiLB's file name; default `/etc/loxilb/`), keeping a
//! previous file as `lbconfig.txt.bk`. As LoxiLB's loxicmd (`Lbdump`), rules that kube-loxilb
//! manages (`serviceArguments.managed`) are left out and each endpoint's `counter` is blanked.
//! `apply --lb FILE` posts each entry of such a file as it is. Differences from LoxiLB: `apply`
//! keeps every field of a rule (LoxiLB's keeps only the address, port, protocol, `sel`, `mode`,
//! `BGP` and the endpoints' address, port and weight, so a model pool or KV rule came back as a
//! plain one); loxi's read-back key `serviceId` is dropped so the daemon assigns ids; `save`
//! writes no timestamped copy in the working directory; a failing rule stops `apply` with the
//! error and LoxiLB's exit code (LoxiLB prints it and exits 0).

use std::path::{Path, PathBuf};

use http::Method;
use serde_json::Value;

use super::Failure;

/// The file name LoxiLB's loxicmd saves rules under.
pub const LB_FILE: &str = "lbconfig.txt";

/// What `save` keeps of `GET .../all`'s answer: rules not managed by kube-loxilb, endpoint
/// counters blanked. Errors: the answer has no `lbAttr` list.
pub fn saved_rules(all: &Value) -> Result<Value, String> {
    let rules = all["lbAttr"]
        .as_array()
        .ok_or_else(|| format!("the rule list has no lbAttr array: {all}"))?;
    let kept: Vec<Value> = rules
        .iter()
        .filter(|r| r["serviceArguments"]["managed"] != Value::Bool(true))
        .map(|r| {
            let mut r = r.clone();
            if let Some(eps) = r["endpoints"].as_array_mut() {
                for ep in eps {
                    if let Some(o) = ep.as_object_mut()
                        && o.contains_key("counter")
                    {
                        o.insert("counter".into(), Value::String(String::new()));
                    }
                }
            }
            r
        })
        .collect();
    Ok(serde_json::json!({ "lbAttr": kept }))
}

/// Writes `rules` to `dir/lbconfig.txt`, renaming an existing file to `lbconfig.txt.bk`.
/// Returns the path written. Errors: the directory or the file cannot be written.
pub fn write_saved(dir: &Path, rules: &Value) -> Result<PathBuf, String> {
    let path = dir.join(LB_FILE);
    if path.exists() {
        let bk = dir.join(format!("{LB_FILE}.bk"));
        std::fs::rename(&path, &bk)
            .map_err(|e| format!("cannot keep {} as {}: {e}", path.display(), bk.display()))?;
    }
    let tmp = dir.join(format!(".{LB_FILE}.tmp"));
    std::fs::write(&tmp, rules.to_string())
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

/// The rule bodies `apply` posts, in file order: each `lbAttr` entry without `serviceId`.
/// Errors: the file is not JSON or has no `lbAttr` list.
pub fn rules_to_apply(text: &str) -> Result<Vec<Value>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not a saved rule set: {e}"))?;
    let rules = v["lbAttr"]
        .as_array()
        .ok_or("not a saved rule set: no lbAttr array")?;
    Ok(rules
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if let Some(o) = r.as_object_mut() {
                o.remove("serviceId");
            }
            r
        })
        .collect())
}

/// `save`: fetches the rules and writes them (see the module doc).
pub(super) async fn save(api: &super::Api, a: &super::args::SaveArgs) -> Result<(), Failure> {
    if !a.all && !a.lb {
        return Err(Failure::usage(
            "say what to save: --lb (or --all; loxi's configuration is its load-balancer rules)",
        ));
    }
    let all = api.get_json("/netlox/v1/config/loadbalancer/all").await?;
    let rules = saved_rules(&all).map_err(|m| Failure {
        message: m,
        code: 7,
    })?;
    let path = write_saved(&a.config_path, &rules).map_err(|m| Failure {
        message: format!(
            "{m} (-c DIR saves to another directory; the default is {})",
            super::args::DEFAULT_DIR
        ),
        code: super::EXIT_IO,
    })?;
    super::out(&format!(
        "Saved {} rules to {}\n",
        rules["lbAttr"].as_array().map_or(0, Vec::len),
        path.display()
    ))
}

/// `apply`: creates each saved rule, stopping at the first the daemon refuses.
pub(super) async fn apply(api: &super::Api, a: &super::args::ApplyArgs) -> Result<(), Failure> {
    let text = std::fs::read_to_string(&a.lb).map_err(|e| Failure {
        message: format!("{}: {e}", a.lb.display()),
        code: super::EXIT_IO,
    })?;
    let rules = rules_to_apply(&text).map_err(|m| Failure {
        message: format!("{}: {m}", a.lb.display()),
        code: 6,
    })?;
    for (i, rule) in rules.iter().enumerate() {
        api.call(
            Method::POST,
            "/netlox/v1/config/loadbalancer",
            Some(rule.to_string()),
        )
        .await
        .map_err(|f| Failure {
            message: format!("rule {} of {}: {}", i + 1, a.lb.display(), f.message),
            code: f.code,
        })?;
    }
    super::out(&format!("Configuration applied - {}\n", a.lb.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn save_drops_managed_rules_and_blanks_counters_and_apply_drops_service_ids() {
        let all = json!({"lbAttr": [
            {"serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "model_name": "llama"},
             "endpoints": [{"endpointIP": "10.1.0.1", "targetPort": 8000, "counter": "12:3400"}],
             "serviceId": 4},
            {"serviceArguments": {"externalIP": "10.0.0.2", "port": 80, "managed": true},
             "endpoints": []}
        ]});
        let saved = saved_rules(&all).expect("saved");
        assert_eq!(
            saved,
            json!({"lbAttr": [
                {"serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "model_name": "llama"},
                 "endpoints": [{"endpointIP": "10.1.0.1", "targetPort": 8000, "counter": ""}],
                 "serviceId": 4}
            ]})
        );
        let dir = tempfile::tempdir().expect("tmp");
        let path = write_saved(dir.path(), &saved).expect("write");
        write_saved(dir.path(), &json!({"lbAttr": []})).expect("write again");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("lbconfig.txt.bk")).expect("bk"),
            saved.to_string()
        );
        let bodies = rules_to_apply(
            &std::fs::read_to_string(dir.path().join("lbconfig.txt.bk")).expect("read"),
        )
        .expect("bodies");
        assert_eq!(bodies.len(), 1);
        assert_eq!(bodies[0]["serviceArguments"]["model_name"], json!("llama"));
        assert!(bodies[0].get("serviceId").is_none());
        assert_eq!(path, dir.path().join("lbconfig.txt"));
        assert!(rules_to_apply("{}").is_err());
        assert!(saved_rules(&json!({})).is_err());
    }
}
