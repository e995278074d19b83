//! `loxicmd get lb` output: a table (one row per endpoint, like LoxiLB's loxicmd), `wide`, or
//! the raw JSON.

use serde_json::Value;

use super::args::OutputFormat;

const SEL_NAMES: [&str; 11] = [
    "rr", "hash", "wrr", "persist", "lc", "n2", "n3", "-", "chwbl", "gpuaware", "wrr-hash",
];
const MODE_NAMES: [&str; 6] = [
    "default",
    "onearm",
    "fullnat",
    "dsr",
    "fullproxy",
    "hostonearm",
];
const ROLE_NAMES: [&str; 3] = ["normal", "prefill", "decode"];

fn name_of(names: &[&'static str], v: &Value) -> String {
    v.as_u64()
        .and_then(|n| names.get(n as usize))
        .map_or_else(|| v.to_string(), |s| s.to_string())
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) if s.is_empty() => "-".into(),
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// Renders the `GET /config/loadbalancer/all` answer in `format` (None = table).
pub fn render(answer: &Value, format: Option<OutputFormat>) -> String {
    if format == Some(OutputFormat::Json) {
        return serde_json::to_string_pretty(answer).unwrap_or_else(|_| answer.to_string());
    }
    let wide = format == Some(OutputFormat::Wide);
    let mut head = vec!["EXT IP", "PORT", "PROTO", "HOST", "MODEL", "SEL", "MODE"];
    head.extend(if wide {
        &["EP", "ENDPOINT", "EPORT", "WEIGHT", "ROLE", "STATE", "KV"][..]
    } else {
        &["ENDPOINT", "EPORT", "WEIGHT", "STATE"][..]
    });
    let mut rows = vec![head.iter().map(|s| s.to_string()).collect::<Vec<_>>()];
    let empty = Vec::new();
    let rules = answer["lbAttr"].as_array().unwrap_or(&empty);
    for rule in rules {
        let s = &rule["serviceArguments"];
        let svc = [
            text(&s["externalIP"]),
            text(&s["port"]),
            text(&s["protocol"]),
            text(&s["host"]),
            text(&s["model_name"]),
            name_of(&SEL_NAMES, &s["sel"]),
            name_of(&MODE_NAMES, &s["mode"]),
        ];
        for (i, ep) in rule["endpoints"]
            .as_array()
            .unwrap_or(&empty)
            .iter()
            .enumerate()
        {
            let mut row = svc.to_vec();
            if wide {
                row.push(i.to_string());
            }
            row.extend([
                text(&ep["endpointIP"]),
                text(&ep["targetPort"]),
                text(&ep["weight"]),
            ]);
            if wide {
                row.push(name_of(&ROLE_NAMES, &ep["ep_role"]));
            }
            row.push(text(&ep["state"]));
            if wide {
                row.push(kv_summary(s));
            }
            rows.push(row);
        }
    }
    layout(&rows)
}

fn kv_summary(s: &Value) -> String {
    match s["kvExactMode"].as_u64() {
        Some(0) | None => "off".into(),
        Some(m) => format!(
            "mode={m},block={},algo={},zmq={}",
            text(&s["kvBlockSize"]),
            text(&s["kvHashAlgo"]),
            text(&s["kvZmqPort"])
        ),
    }
}

/// Pads columns to their widest cell, LoxiLB-style `|` separators.
fn layout(rows: &[Vec<String>]) -> String {
    let cols = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |x| x.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let sep = format!(
        "+{}+\n",
        widths
            .iter()
            .map(|w| "-".repeat(w + 2))
            .collect::<Vec<_>>()
            .join("+")
    );
    let mut out = sep.clone();
    for (i, r) in rows.iter().enumerate() {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!(" {c:<w$} "))
            .collect();
        out.push_str(&format!("|{}|\n", cells.join("|")));
        if i == 0 {
            out.push_str(&sep);
        }
    }
    out.push_str(&sep);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn answer() -> Value {
        json!({"lbAttr": [{
        "serviceArguments": {"externalIP": "10.0.0.1", "port": 80, "protocol": "tcp", "host": "",
            "model_name": "llama", "sel": 8, "mode": 4, "kvExactMode": 3, "kvBlockSize": 16,
            "kvHashAlgo": "sha256_cbor", "kvZmqPort": 5557},
        "endpoints": [
            {"endpointIP": "127.0.0.1", "targetPort": 8001, "weight": 1, "ep_role": 0, "state": "active"},
            {"endpointIP": "127.0.0.2", "targetPort": 8002, "weight": 3, "ep_role": 0, "state": "inactive"}
        ]}]})
    }

    #[test]
    fn table_has_one_row_per_endpoint_with_names_for_sel_and_mode() {
        let t = render(&answer(), None);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 6, "{t}");
        assert!(
            lines[1].contains("EXT IP") && lines[1].contains("STATE"),
            "{t}"
        );
        assert!(
            lines[3].contains("| 10.0.0.1 ")
                && lines[3].contains(" chwbl ")
                && lines[3].contains(" fullproxy "),
            "{t}"
        );
        assert!(
            lines[3].contains(" 127.0.0.1 ")
                && lines[3].contains(" 8001 ")
                && lines[3].contains(" active "),
            "{t}"
        );
        assert!(
            lines[4].contains(" 127.0.0.2 ")
                && lines[4].contains(" 3 ")
                && lines[4].contains(" inactive "),
            "{t}"
        );
        assert!(lines[3].contains(" - "), "empty host shows as -: {t}");
    }

    #[test]
    fn wide_adds_index_role_and_kv() {
        let t = render(&answer(), Some(OutputFormat::Wide));
        assert!(
            t.contains(" EP ") && t.contains(" ROLE ") && t.contains(" KV "),
            "{t}"
        );
        assert!(
            t.contains("mode=3,block=16,algo=sha256_cbor,zmq=5557"),
            "{t}"
        );
        assert!(
            t.lines()
                .nth(4)
                .is_some_and(|l| l.contains(" 1 ") && l.contains(" normal ")),
            "{t}"
        );
    }

    #[test]
    fn json_is_the_answer_itself() {
        let t = render(&answer(), Some(OutputFormat::Json));
        let back: Value = serde_json::from_str(&t).expect("json");
        assert_eq!(back, answer());
    }
}
