//! `loxicmd get ...` tables, rendered as LoxiLB's Go `loxicmd` renders them
//! (`loxicmd-inference-gateway` `cmd/get/get_loadbalancer.go`, `get_endpoint.go`,
//! `get_conntrack.go`, `get_kvinventory.go`; the fixtures' `expected_output_format` in
//! `../shared/loxilb-clients/`): github.com/olekukonko/tablewriter v0.0.5 as loxicmd
//! configures it, i.e. left and right borders only (no top or bottom rule), `|` between
//! columns, headers upper-cased and centred, a `-` rule under the header, numeric cells
//! right-aligned and the rest left-aligned, one space of padding on each side.

use serde_json::Value;

use super::args::OutputFormat;
use crate::rules::addr::host_port;

/// LoxiLB's `NumToSelect` (unknown numbers print `rr`).
fn sel_name(v: &Value) -> &'static str {
    match v.as_u64().unwrap_or(0) {
        1 => "hash",
        2 => "priority",
        3 => "persist",
        4 => "lc",
        5 => "n2",
        6 => "n3",
        8 => "chwbl",
        9 => "gpuaware",
        10 => "wrr-hash",
        _ => "rr",
    }
}

/// LoxiLB's `NumToMode` (0 and unknown print `default`).
fn mode_name(v: &Value) -> &'static str {
    match v.as_u64().unwrap_or(0) {
        1 => "onearm",
        2 => "fullnat",
        3 => "dsr",
        4 => "fullproxy",
        5 => "hostonearm",
        _ => "default",
    }
}

/// A JSON scalar as Go's `%v` prints it (missing → zero value `0`/`""`).
fn cell(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn num(v: &Value) -> String {
    v.as_u64().unwrap_or(0).to_string()
}

/// tablewriter's numeric test: `^-?(\d{1,3}(,\d{3})*|\d+)(\.\d+)?$`.
fn is_numeric(s: &str) -> bool {
    let s = s.strip_prefix('-').unwrap_or(s);
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    if frac.is_some_and(|f| f.is_empty() || !f.bytes().all(|b| b.is_ascii_digit())) {
        return false;
    }
    if int.is_empty() {
        return false;
    }
    if int.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    let groups: Vec<&str> = int.split(',').collect();
    groups.len() > 1
        && (1..=3).contains(&groups[0].len())
        && groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_digit()))
        && groups[1..].iter().all(|g| g.len() == 3)
}

/// Lays out `header` and `rows` as tablewriter v0.0.5 does with loxicmd's settings.
pub fn layout(header: &[&str], rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = header
        .iter()
        .enumerate()
        .map(|(c, h)| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |x| x.chars().count()))
                .max()
                .unwrap_or(0)
                .max(h.chars().count())
        })
        .collect();
    let mut out = String::from("|");
    for (h, w) in header.iter().zip(&widths) {
        let gap = w - h.chars().count();
        let left = gap / 2;
        out.push_str(&format!(
            " {}{}{} |",
            " ".repeat(left),
            h.to_uppercase(),
            " ".repeat(gap - left)
        ));
    }
    out.push('\n');
    out.push('|');
    out.push_str(
        &widths
            .iter()
            .map(|w| "-".repeat(w + 2))
            .collect::<Vec<_>>()
            .join("|"),
    );
    out.push_str("|\n");
    for r in rows {
        out.push('|');
        for (c, w) in r.iter().zip(&widths) {
            if is_numeric(c) {
                out.push_str(&format!(" {c:>w$} |"));
            } else {
                out.push_str(&format!(" {c:<w$} |"));
            }
        }
        out.push('\n');
    }
    out
}

/// LoxiLB's sort key of a rule: `externalIP|%05d port|protocol`, then (loxi) its `host` and
/// `model_name`, so the host rules and pools of one listener print in a stable order.
fn rule_key(r: &Value) -> String {
    let s = &r["serviceArguments"];
    format!(
        "{}|{:05}|{}|{}|{}",
        cell(&s["externalIP"]),
        s["port"].as_u64().unwrap_or(0),
        cell(&s["protocol"]),
        cell(&s["host"]),
        cell(&s["model_name"])
    )
}

/// Where the `Model` column goes (after `Proto`) in `header`, when any of `rules` is a model
/// pool (a non-empty `model_name`): loxi's addition to LoxiLB's tables, whose rows for two pools
/// of one listener would otherwise read the same. Without model pools the tables are LoxiLB's.
fn model_column(header: &[&str], rules: &[&Value]) -> Option<usize> {
    let pools = rules
        .iter()
        .any(|r| !cell(&r["serviceArguments"]["model_name"]).is_empty());
    pools.then(|| {
        header
            .iter()
            .position(|h| *h == "Proto")
            .map_or(0, |i| i + 1)
    })
}

/// `header` and `rows` with the `Model` column inserted at `at` (cells from `models`, one per
/// row); unchanged with `at` `None`.
fn with_model_column<'a>(
    header: &[&'a str],
    mut rows: Vec<Vec<String>>,
    models: Vec<String>,
    at: Option<usize>,
) -> (Vec<&'a str>, Vec<Vec<String>>) {
    let mut header = header.to_vec();
    if let Some(at) = at {
        header.insert(at, "Model");
        for (row, m) in rows.iter_mut().zip(models) {
            row.insert(at, m);
        }
    }
    (header, rows)
}

/// Renders the `GET /config/loadbalancer/all` answer in `format`: `table`, LoxiLB's
/// one row per rule; `wide` one row per endpoint, `json` the answer itself, pretty-printed.
/// An empty rule list prints nothing (as LoxiLB's loxicmd, which sets the header per rule).
pub fn render(answer: &Value, format: OutputFormat) -> String {
    if format == OutputFormat::Json {
        return serde_json::to_string_pretty(answer).unwrap_or_else(|_| answer.to_string());
    }
    let mut rules: Vec<&Value> = answer["lbAttr"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    rules.retain(|r| r["serviceArguments"]["snat"] != Value::Bool(true));
    rules.sort_by_key(|r| rule_key(r));
    if rules.is_empty() {
        return String::new();
    }
    if format == OutputFormat::Wide {
        return render_wide(&rules);
    }
    let header = [
        "Ext IP",
        "Port",
        "Proto",
        "Name",
        "Mark",
        "Sel",
        "Mode",
        "# of Endpoints",
        "Timeout",
        "Monitor",
        "Conn Limit",
        "Queue Depth",
        "Queue Wait(ms)",
    ];
    let rows: Vec<Vec<String>> = rules
        .iter()
        .map(|r| {
            let s = &r["serviceArguments"];
            vec![
                cell(&s["externalIP"]),
                port_cell(s),
                proto_cell(s),
                cell(&s["name"]),
                num(&s["block"]),
                sel_name(&s["sel"]).into(),
                mode_cell(s),
                r["endpoints"].as_array().map_or(0, Vec::len).to_string(),
                num(&s["inactiveTimeOut"]),
                if s["monitor"] == Value::Bool(true) {
                    "On"
                } else {
                    "Off"
                }
                .into(),
                num(&s["connectionLimit"]),
                num(&s["fc_max_queue_depth"]),
                num(&s["fc_max_queue_wait_ms"]),
            ]
        })
        .collect();
    let models = rules
        .iter()
        .map(|r| cell(&r["serviceArguments"]["model_name"]))
        .collect();
    let at = model_column(&header, &rules);
    let (header, rows) = with_model_column(&header, rows, models, at);
    let (header, rows) = with_host_column(header, rows, &rules);
    layout(&header, &rows)
}

/// `header` and `rows` (one per rule of `rules`) with a `Host` column after `Ext IP` when any
/// rule is host-routed (a non-empty `serviceArguments.host`): loxi's addition to LoxiLB's
/// table, whose rows for two hosts of one listener would otherwise read the same (`-o wide`
/// always has the column). Without host-routed rules the table is LoxiLB's.
fn with_host_column<'a>(
    mut header: Vec<&'a str>,
    mut rows: Vec<Vec<String>>,
    rules: &[&Value],
) -> (Vec<&'a str>, Vec<Vec<String>>) {
    let hosts: Vec<String> = rules
        .iter()
        .map(|r| cell(&r["serviceArguments"]["host"]))
        .collect();
    if hosts.iter().all(String::is_empty) {
        return (header, rows);
    }
    header.insert(1, "Host");
    for (row, h) in rows.iter_mut().zip(hosts) {
        row.insert(1, h);
    }
    (header, rows)
}

fn port_cell(s: &Value) -> String {
    match s["portMax"].as_u64() {
        Some(m) if m != 0 => format!("{}-{m}", num(&s["port"])),
        _ => num(&s["port"]),
    }
}

fn proto_cell(s: &Value) -> String {
    let p = cell(&s["protocol"]);
    match s["security"].as_u64() {
        Some(1) => format!("{p}:https"),
        Some(2) => format!("{p}:e2ehttps"),
        _ => p,
    }
}

fn mode_cell(s: &Value) -> String {
    let mut m = mode_name(&s["mode"]).to_string();
    if s["proxyprotocolv2"] == Value::Bool(true) {
        m.push_str(":ppv2");
    }
    if s["egress"] == Value::Bool(true) {
        m.push_str(":egress");
    }
    m
}

/// `get lb -o wide`: one row per endpoint; the first carries the rule's cells.
fn render_wide(rules: &[&Value]) -> String {
    let header = [
        "Ext IP", "Sec IPs", "Sources", "Host", "Port", "Proto", "Name", "Mark", "Sel", "Mode",
        "Endpoint", "EPort", "Weight", "State", "Counters", "Gate", "Max Out", "Adaptive",
        "Tenants", "Headers",
    ];
    let join = |v: &Value, key: &str| -> String {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|x| cell(&x[key]))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    };
    let mut rows = Vec::new();
    let mut models = Vec::new();
    for r in rules {
        let s = &r["serviceArguments"];
        // LoxiLB's loxicmd prints an endpoint's state only under `monitor: true`; loxi's
        // fullproxy (mode 4) tracks every endpoint's health (its circuit breaker) without a
        // probe, so a mode-4 rule's state is printed too: `-` would hide an open breaker.
        let monitor = s["monitor"] == Value::Bool(true) || s["mode"].as_u64() == Some(4);
        let eps = r["endpoints"].as_array().cloned().unwrap_or_default();
        for (i, ep) in eps.iter().enumerate() {
            let first = i == 0;
            let rule_cell = |v: String| if first { v } else { String::new() };
            let fc = if first { "-" } else { "" };
            models.push(rule_cell(cell(&s["model_name"])));
            rows.push(vec![
                rule_cell(cell(&s["externalIP"])),
                rule_cell(join(&r["secondaryIPs"], "secondaryIP")),
                rule_cell(join(&r["allowedSources"], "prefix")),
                rule_cell(cell(&s["host"])),
                rule_cell(port_cell(s)),
                rule_cell(proto_cell(s)),
                rule_cell(cell(&s["name"])),
                rule_cell(num(&s["block"])),
                rule_cell(sel_name(&s["sel"]).into()),
                rule_cell(mode_cell(s)),
                cell(&ep["endpointIP"]),
                num(&ep["targetPort"]),
                num(&ep["weight"]),
                if monitor {
                    cell(&ep["state"])
                } else {
                    "-".into()
                },
                cell(&ep["counter"]),
                fc.into(),
                fc.into(),
                fc.into(),
                fc.into(),
                fc.into(),
            ]);
        }
    }
    let at = model_column(&header, rules);
    let (header, rows) = with_model_column(&header, rows, models, at);
    layout(&header, &rows)
}

/// `get ep`: LoxiLB's endpoint table from `{"Attr":[...]}` (empty list: no output).
pub fn render_endpoints(answer: &Value) -> String {
    let mut eps: Vec<&Value> = answer["Attr"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    if eps.is_empty() {
        return String::new();
    }
    eps.sort_by_key(|e| {
        format!(
            "{}|{:05}|{}|{}",
            cell(&e["hostName"]),
            e["probePort"].as_u64().unwrap_or(0),
            cell(&e["probeType"]),
            cell(&e["name"])
        )
    });
    let header = [
        "Host", "Name", "ptype", "port", "duration", "retries", "minDelay", "avgDelay", "maxDelay",
        "State",
    ];
    let rows: Vec<Vec<String>> = eps
        .iter()
        .map(|e| {
            vec![
                cell(&e["hostName"]),
                cell(&e["name"]),
                format!("{}:{}", cell(&e["probeType"]), cell(&e["probeReq"])),
                num(&e["probePort"]),
                num(&e["probeDuration"]),
                num(&e["inactiveReTries"]),
                cell(&e["minDelay"]),
                cell(&e["avgDelay"]),
                cell(&e["maxDelay"]),
                cell(&e["currState"]),
            ]
        })
        .collect();
    layout(&header, &rows)
}

/// `get conntrack`: LoxiLB's table from `{"ctAttr":[...]}` (header even when empty).
pub fn render_conntrack(answer: &Value) -> String {
    let mut cts: Vec<&Value> = answer["ctAttr"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    cts.sort_by_key(|c| {
        format!(
            "{}|{}|{:05}|{:05}|{}",
            cell(&c["destinationIP"]),
            cell(&c["sourceIP"]),
            c["destinationPort"].as_u64().unwrap_or(0),
            c["sourcePort"].as_u64().unwrap_or(0),
            cell(&c["protocol"])
        )
    });
    let header = [
        "Service Name",
        "destIP",
        "srcIP",
        "dport",
        "sport",
        "proto",
        "ident",
        "state",
        "act",
        "packets",
        "bytes",
    ];
    let rows: Vec<Vec<String>> = cts
        .iter()
        .map(|c| {
            vec![
                cell(&c["servName"]),
                cell(&c["destinationIP"]),
                cell(&c["sourceIP"]),
                num(&c["destinationPort"]),
                num(&c["sourcePort"]),
                cell(&c["protocol"]),
                cell(&c["ident"]),
                cell(&c["conntrackState"]),
                cell(&c["conntrackAct"]),
                num(&c["packets"]),
                num(&c["bytes"]),
            ]
        })
        .collect();
    layout(&header, &rows)
}

/// `get kvinventory`: `service_id=.. ep_idx=.. hash_algo=.. total=..` then the block table.
pub fn render_kvinventory(answer: &Value) -> String {
    let mut out = format!(
        "service_id={} ep_idx={} hash_algo={} total={}\n",
        num(&answer["service_id"]),
        num(&answer["ep_idx"]),
        cell(&answer["hash_algo"]),
        num(&answer["total"])
    );
    let rows: Vec<Vec<String>> = answer["blocks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|b| vec![num(&b["block_idx"]), num(&b["hash_uint64"])])
        .collect();
    out.push_str(&layout(&["Block Idx", "Hash (uint64)"], &rows));
    out
}

/// `get kvinventory` without `--ep-idx` (a loxi extension; LoxiLB's loxicmd requires the flag):
/// `service_id=..` then one row per subscribed endpoint: its index, address, distinct blocks
/// held, whether any rank's stream is up, and each rank as `rank:up|down:last seq` (`-` before
/// the first batch).
pub fn render_kvinventory_endpoints(answer: &Value) -> String {
    let mut out = format!("service_id={}\n", num(&answer["serviceId"]));
    let rows: Vec<Vec<String>> = answer["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let ranks: Vec<String> = e["ranks"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| {
                    let up = if r["connected"].as_bool() == Some(true) {
                        "up"
                    } else {
                        "down"
                    };
                    let seq = r["lastSeq"].as_u64().map_or("-".into(), |s| s.to_string());
                    format!("{}:{up}:{seq}", num(&r["rank"]))
                })
                .collect();
            vec![
                num(&e["epIdx"]),
                format!("{}:{}", cell(&e["endpointIP"]), num(&e["targetPort"])),
                num(&e["kvZmqPort"]),
                num(&e["blockCount"]),
                if e["connected"].as_bool() == Some(true) {
                    "yes".into()
                } else {
                    "no".into()
                },
                ranks.join(" "),
            ]
        })
        .collect();
    out.push_str(&layout(
        &[
            "Ep Idx",
            "Endpoint",
            "KV Port",
            "Blocks",
            "Connected",
            "Ranks",
        ],
        &rows,
    ));
    out
}

/// `get kvparity` (table and wide): a line with the rule's hash contract, tokenizer and warmup
/// state, one row per endpoint (readiness state, leg, parity verdict, blocks checked and
/// mismatched), then each endpoint's remedy, each failing model's, why a verdict is still
/// `unknown`, and a running warmup window (`-o json`: the answer).
/// Control characters in the answer's strings (a client chooses the model names a wildcard
/// pool reports) are printed escaped, never raw.
pub fn render_kvparity(answer: &Value) -> String {
    let t = &answer["tokenizer"];
    let mut out = format!(
        "service_id={} kvHashAlgo={} kvBlockSize={} seedSet={} tokenizer={} warmup={}\n",
        num(&answer["serviceId"]),
        clean(&cell(&answer["kvHashAlgo"])),
        num(&answer["kvBlockSize"]),
        answer["seedSet"].as_bool().unwrap_or(false),
        clean(&cell(&t["state"])),
        clean(&cell(&answer["warmup"]["state"])),
    );
    let eps: Vec<&Value> = answer["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    let rows: Vec<Vec<String>> = eps
        .iter()
        .map(|e| {
            vec![
                num(&e["epIdx"]),
                host_port(&clean(&cell(&e["endpointIP"])), num(&e["targetPort"])),
                num(&e["kvZmqPort"]),
                clean(&cell(&e["state"])),
                clean(&cell(&e["leg"])),
                clean(&cell(&e["verdict"])),
                num(&e["checked_blocks"]),
                num(&e["mismatched_blocks"]),
            ]
        })
        .collect();
    out.push_str(&layout(
        &[
            "Ep Idx",
            "Endpoint",
            "KV Port",
            "State",
            "Leg",
            "Verdict",
            "Checked",
            "Mismatched",
        ],
        &rows,
    ));
    for e in &eps {
        if let Some(r) = e["remedy"].as_str() {
            out.push_str(&format!("ep {}: {}\n", num(&e["epIdx"]), clean(r)));
        }
    }
    for m in t["failing"].as_array().into_iter().flatten() {
        let n = m["failures"].as_u64().unwrap_or(0);
        out.push_str(&format!(
            "tokenizer: model {:?}, {} prompts, {n} failed request{}: {}\n",
            cell(&m["model"]),
            clean(&cell(&m["prompts"])),
            if n == 1 { "" } else { "s" },
            clean(&cell(&m["remedy"]))
        ));
    }
    if let Some(n) = t["moreFailing"].as_u64().filter(|n| *n > 0) {
        out.push_str(&format!(
            "tokenizer: {n} more failing (-o json lists the first 8 too)\n"
        ));
    }
    for e in &eps {
        let checked = e["checked_blocks"].as_u64().unwrap_or(0);
        if e["verdict"].as_str() == Some("unknown") && checked > 0 {
            out.push_str(&format!(
                "ep {}: verdict unknown until {ESTABLISH_BLOCKS} blocks with token ids are checked ({checked} so far)\n",
                num(&e["epIdx"])
            ));
        }
    }
    let w = &answer["warmup"];
    match w["state"].as_str() {
        Some("running") => out.push_str(&format!(
            "warmup: {} s left of kvWarmupSec {}: tier 1.5 is off for this rule until then (misses counted as warmup)\n",
            w["leftSec"].as_f64().unwrap_or(0.0),
            w["sec"].as_f64().unwrap_or(0.0)
        )),
        Some("waiting") => out.push_str(&format!(
            "warmup: kvWarmupSec {} starts at the rule's first KV subscriber connect: tier 1.5 is off until it has run\n",
            w["sec"].as_f64().unwrap_or(0.0)
        )),
        _ => {}
    }
    out
}

/// Blocks the parity check compares before its verdict leaves `unknown` (the daemon's
/// `kv::ingest::parity::ESTABLISH_BLOCKS`).
const ESTABLISH_BLOCKS: u64 = crate::kv::ingest::parity::ESTABLISH_BLOCKS;

/// `s` with control characters escaped (`\n`, `\u{1b}`), so no answer string can start a
/// line or drive the terminal.
fn clean(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_owned();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The contract line, one row per endpoint, then the remedies and the failing models.
    #[test]
    fn kvparity_is_a_table_with_the_remedies_below() {
        let a = json!({"serviceId": 2, "kvHashAlgo": "sha256_cbor", "kvBlockSize": 16,
            "seedSet": false,
            "tokenizer": {"state": "failing", "moreFailing": 2, "failing": [
                {"model": "acme/ghost", "prompts": "chat", "failures": 6, "remedy": "stage it"},
                {"model": "evil\nservice_id=9 tokenizer=ok\u{1b}[31m", "prompts": "text",
                 "failures": 1, "remedy": "in \"/t/evil\nservice_id=9\u{1b}[31m\""}]},
            "endpoints": [
                {"epIdx": 0, "endpointIP": "10.0.0.1", "targetPort": 8000, "kvZmqPort": 5557,
                 "state": "ok", "verdict": "ok", "checked_blocks": 64, "mismatched_blocks": 0},
                {"epIdx": 1, "endpointIP": "fd00::2", "targetPort": 8000, "kvZmqPort": 5557,
                 "state": "mismatch", "leg": "seed", "remedy": "set LLB_KV_NONE_HASH_SEED=0",
                 "verdict": "unknown", "checked_blocks": 3, "mismatched_blocks": 3}],
            "warmup": {"sec": 30.0, "state": "running", "leftSec": 12.5}});
        assert_eq!(
            render_kvparity(&a),
            "service_id=2 kvHashAlgo=sha256_cbor kvBlockSize=16 seedSet=false tokenizer=failing warmup=running\n\
             | EP IDX |    ENDPOINT    | KV PORT |  STATE   | LEG  | VERDICT | CHECKED | MISMATCHED |\n\
             |--------|----------------|---------|----------|------|---------|---------|------------|\n\
             |      0 | 10.0.0.1:8000  |    5557 | ok       |      | ok      |      64 |          0 |\n\
             |      1 | [fd00::2]:8000 |    5557 | mismatch | seed | unknown |       3 |          3 |\n\
             ep 1: set LLB_KV_NONE_HASH_SEED=0\n\
             tokenizer: model \"acme/ghost\", chat prompts, 6 failed requests: stage it\n\
             tokenizer: model \"evil\\nservice_id=9 tokenizer=ok\\u{1b}[31m\", text prompts, 1 failed request: in \"/t/evil\\nservice_id=9\\u{1b}[31m\"\n\
             tokenizer: 2 more failing (-o json lists the first 8 too)\n\
             ep 1: verdict unknown until 8 blocks with token ids are checked (3 so far)\n\
             warmup: 12.5 s left of kvWarmupSec 30: tier 1.5 is off for this rule until then (misses counted as warmup)\n"
        );
        assert!(
            !render_kvparity(&a).contains('\u{1b}'),
            "no control character reaches the terminal"
        );
    }

    /// Without `--ep-idx`: one row per endpoint, ranks as `rank:up|down:last seq`.
    #[test]
    fn kvinventory_without_an_endpoint_is_a_table_of_endpoints() {
        let a = json!({"serviceId": 3, "offset": 0, "limit": 1000, "endpoints": [
            {"epIdx": 0, "endpointIP": "10.0.0.1", "targetPort": 8000, "kvZmqPort": 5557,
             "blockCount": 12, "connected": true,
             "ranks": [{"rank": 0, "connected": true, "lastSeq": 41},
                       {"rank": 1, "connected": false, "lastSeq": null}], "hashes": [1, 2]},
            {"epIdx": 1, "endpointIP": "10.0.0.2", "targetPort": 8001, "kvZmqPort": 5558,
             "blockCount": 0, "connected": false,
             "ranks": [], "hashes": []}]});
        assert_eq!(
            render_kvinventory_endpoints(&a),
            "service_id=3\n| EP IDX |   ENDPOINT    | KV PORT | BLOCKS | CONNECTED |      RANKS       |\n|--------|---------------|---------|--------|-----------|------------------|\n|      0 | 10.0.0.1:8000 |    5557 |     12 | yes       | 0:up:41 1:down:- |\n|      1 | 10.0.0.2:8001 |    5558 |      0 | no        |                  |\n"
        );
    }

    /// The fixture's LoxiLB answer for rule (b) and loxicmd's rendering of it
    /// (`shared/loxilb-clients/h1_get_lb.json`, `h2_get_lb_wide.json`).
    fn after_b() -> Value {
        json!({"lbAttr":[{"allowedSources":null,"endpoints":[
            {"backup":false,"counter":"0:0","endpointIP":"192.0.2.1","state":"active","targetPort":8080,"weight":1},
            {"backup":false,"counter":"0:0","endpointIP":"198.51.100.1","state":"active","targetPort":8080,"weight":1},
            {"backup":false,"counter":"0:0","endpointIP":"203.0.113.1","state":"active","targetPort":8080,"weight":1}],
            "secondaryIPs":null,"secondaryVIPs":null,"serviceArguments":{"adminStateUp":true,
            "alpn_protocols":null,"backend_protocol":"http1","externalIP":"10.10.10.254",
            "id":"x","inactiveTimeOut":240,"mode":4,"port":8080,"protocol":"tcp","sel":8,
            "tls_versions":null}}]})
    }

    #[test]
    fn get_lb_renders_byte_for_byte_as_loxilb_loxicmd() {
        let want = "|    EXT IP    | PORT | PROTO | NAME | MARK |  SEL  |   MODE    | # OF ENDPOINTS | TIMEOUT | MONITOR | CONN LIMIT | QUEUE DEPTH | QUEUE WAIT(MS) |\n|--------------|------|-------|------|------|-------|-----------|----------------|---------|---------|------------|-------------|----------------|\n| 10.10.10.254 | 8080 | tcp   |      |    0 | chwbl | fullproxy |              3 |     240 | Off     |          0 |           0 |              0 |\n";
        assert_eq!(render(&after_b(), OutputFormat::Table), want);
        assert_eq!(
            render(&json!({"lbAttr": []}), OutputFormat::Table),
            "",
            "empty list prints nothing"
        );
    }

    /// LoxiLB's rendering, but for the STATE cell of a mode-4 rule: loxi's fullproxy tracks
    /// every endpoint's health (its breaker) without `monitor`, so the state is printed (an
    /// L4 rule without `monitor` keeps LoxiLB's `-`).
    #[test]
    fn get_lb_wide_renders_byte_for_byte_as_loxilb_loxicmd_but_a_mode_4_state() {
        let mut rules = after_b();
        rules["lbAttr"][0]["endpoints"][1]["state"] = json!("inactive");
        let want = "|    EXT IP    | SEC IPS | SOURCES | HOST | PORT | PROTO | NAME | MARK |  SEL  |   MODE    |   ENDPOINT   | EPORT | WEIGHT |  STATE   | COUNTERS | GATE | MAX OUT | ADAPTIVE | TENANTS | HEADERS |\n|--------------|---------|---------|------|------|-------|------|------|-------|-----------|--------------|-------|--------|----------|----------|------|---------|----------|---------|---------|\n| 10.10.10.254 |         |         |      | 8080 | tcp   |      |    0 | chwbl | fullproxy | 192.0.2.1    |  8080 |      1 | active   | 0:0      | -    | -       | -        | -       | -       |\n|              |         |         |      |      |       |      |      |       |           | 198.51.100.1 |  8080 |      1 | inactive | 0:0      |      |         |          |         |         |\n|              |         |         |      |      |       |      |      |       |           | 203.0.113.1  |  8080 |      1 | active   | 0:0      |      |         |          |         |         |\n";
        assert_eq!(render(&rules, OutputFormat::Wide), want);
        rules["lbAttr"][0]["serviceArguments"]["mode"] = json!(0);
        let l4 = render(&rules, OutputFormat::Wide);
        assert!(
            l4.contains("| 198.51.100.1 |  8080 |      1 | -     | 0:0 "),
            "an L4 rule without monitor: LoxiLB's '-'\n{l4}"
        );
    }

    /// Two model pools of one listener: a `Model` column after `Proto` tells their rows
    /// apart, in the table and in wide, in model order; the tables above (no pool) have none.
    #[test]
    fn model_pools_of_one_listener_get_a_model_column() {
        let pool = |model: &str| {
            json!({"serviceArguments": {"externalIP": "127.0.0.1", "port": 8080,
                "protocol": "tcp", "mode": 4, "sel": 0, "model_name": model},
                "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8000, "weight": 1,
                    "state": "active", "counter": "0:0"}]})
        };
        let a = json!({"lbAttr": [pool("tiny"), pool("big")]});
        let t = render(&a, OutputFormat::Table);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].starts_with("|  EXT IP   | PORT | PROTO | MODEL | NAME |"),
            "{t}"
        );
        assert!(
            lines[2].starts_with("| 127.0.0.1 | 8080 | tcp   | big   |      |"),
            "{t}"
        );
        assert!(
            lines[3].starts_with("| 127.0.0.1 | 8080 | tcp   | tiny  |      |"),
            "{t}"
        );
        let w = render(&a, OutputFormat::Wide);
        let lines: Vec<&str> = w.lines().collect();
        assert!(lines[0].contains("| PROTO | MODEL | NAME |"), "{w}");
        assert!(lines[2].contains("| tcp   | big   |      |"), "{w}");
        assert!(lines[3].contains("| tcp   | tiny  |      |"), "{w}");
        assert!(!render(&after_b(), OutputFormat::Table).contains("MODEL"));
    }

    /// Two host rules of one listener: a `Host` column after `Ext IP` tells their rows apart
    /// in the default table (they read the same), in host order, the listener's catch-all (no
    /// host) after them; rules without a host (the
    /// tables above) have none, as LoxiLB's loxicmd prints them.
    #[test]
    fn host_rules_of_one_listener_get_a_host_column() {
        let rule = |host: &str| {
            json!({"serviceArguments": {"externalIP": "127.0.0.1", "port": 8080,
                "protocol": "tcp", "mode": 4, "sel": 0, "host": host},
                "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8000, "weight": 1}]})
        };
        let a = json!({"lbAttr": [rule("b.example"), rule(""), rule("a.example")]});
        let t = render(&a, OutputFormat::Table);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].starts_with("|  EXT IP   |   HOST    | PORT | PROTO |"),
            "{t}"
        );
        assert!(
            lines[2].starts_with("| 127.0.0.1 | a.example | 8080 | tcp   |"),
            "{t}"
        );
        assert!(
            lines[3].starts_with("| 127.0.0.1 | b.example | 8080 | tcp   |"),
            "{t}"
        );
        assert!(
            lines[4].starts_with("| 127.0.0.1 |           | 8080 | tcp   |"),
            "{t}"
        );
        assert!(!render(&after_b(), OutputFormat::Table).contains("HOST"));
    }

    #[test]
    fn rules_are_sorted_like_loxicmd_and_conntrack_prints_its_header_when_empty() {
        let a = json!({"lbAttr": [
            {"serviceArguments": {"externalIP": "10.0.0.1", "port": 8080, "protocol": "tcp"}, "endpoints": []},
            {"serviceArguments": {"externalIP": "10.0.0.1", "port": 2022, "protocol": "tcp"}, "endpoints": []}
        ]});
        let t = render(&a, OutputFormat::Table);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[2].contains(" 2022 ") && lines[3].contains(" 8080 "),
            "{t}"
        );
        assert_eq!(
            render_conntrack(&json!({"ctAttr": []})),
            "| SERVICE NAME | DESTIP | SRCIP | DPORT | SPORT | PROTO | IDENT | STATE | ACT | PACKETS | BYTES |\n|--------------|--------|-------|-------|-------|-------|-------|-------|-----|---------|-------|\n"
        );
    }

    #[test]
    fn kvinventory_renders_loxilb_header_line_and_table() {
        let a = json!({"service_id":1,"ep_idx":0,"hash_algo":"sha256_cbor","blocks":[
            {"block_idx":0,"hash_uint64":1234567890123456789u64},{"block_idx":1,"hash_uint64":42}],"total":2});
        assert_eq!(
            render_kvinventory(&a),
            "service_id=1 ep_idx=0 hash_algo=sha256_cbor total=2\n| BLOCK IDX |    HASH (UINT64)    |\n|-----------|---------------------|\n|         0 | 1234567890123456789 |\n|         1 |                  42 |\n"
        );
    }

    #[test]
    fn json_is_the_answer_itself() {
        let t = render(&after_b(), OutputFormat::Json);
        let back: Value = serde_json::from_str(&t).expect("json");
        assert_eq!(back, after_b());
    }
}
