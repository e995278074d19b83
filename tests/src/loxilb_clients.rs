//! Conformance with LoxiLB's own clients: the fixtures in `shared/loxilb-clients/` (what Go
//! `loxicmd` and kube-loxilb put on the wire, re-derived from their source, and what LoxiLB's
//! server answers) replayed byte for byte over a plain TCP socket, so no Rust serializer
//! normalises them.
//!
//! [`check_fixture`] runs one fixture file against a fresh daemon reached through a [`Wire`]
//! and checks the answer LoxiLB gives: status, body shape, and that the rule was created or
//! deleted. Every `*.json` file of the directory except `server_responses.json` is a fixture,
//! so a new fixture is tested without code changes. Where loxi answers differently on purpose,
//! the expectation says so (see [`Target`] and the README's "Where loxi differs"):
//!
//! - a P/D rule asking for what loxi's P/D does not implement yet (a handoff other than
//!   vLLM's) is refused with 400 naming the field as not implemented; a vLLM P/D rule, with or
//!   without tier 1 (`pd_cache_aware_mode`), gets LoxiLB's 200;
//! - an L4 rule (mode ≠ 4) on a daemon without `--xdp-iface` is refused with 400;
//! - `/config/conntrack/all` lists the XDP conntrack map on a daemon with the data path (every
//!   entry with exactly LoxiLB's keys); without it, `{"ctAttr":[]}`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

/// The fixture directory: `$LOXI_LOXILB_FIXTURES`, else `<shared>/loxilb-clients`.
pub fn fixture_dir() -> PathBuf {
    std::env::var_os("LOXI_LOXILB_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::shared_dir().join("loxilb-clients"))
}

/// One fixture file.
#[derive(Debug, Clone)]
pub struct Fixture {
    /// File name without `.json`.
    pub id: String,
    /// The parsed file.
    pub json: Value,
}

/// Every fixture in `dir` (sorted by name), and `server_responses.json`. Panics when the
/// directory or a file cannot be read: a missing fixture set must fail the test, not pass it.
pub fn load(dir: &Path) -> (Vec<Fixture>, Value) {
    let mut fixtures = Vec::new();
    let mut responses = None;
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("fixture dir {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    entries.sort();
    for path in entries {
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let json: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
        let id = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        if id == "server_responses" {
            responses = Some(json);
        } else {
            fixtures.push(Fixture { id, json });
        }
    }
    assert!(!fixtures.is_empty(), "no fixtures in {}", dir.display());
    (
        fixtures,
        responses.unwrap_or_else(|| panic!("no server_responses.json in {}", dir.display())),
    )
}

/// One HTTP request as a client put it on the wire.
#[derive(Debug, Clone)]
pub struct WireRequest {
    /// `POST`, `DELETE`, `GET`.
    pub method: String,
    /// Path under the API root, e.g. `/netlox/v1/config/loadbalancer`.
    pub path: String,
    /// Raw query string (already encoded), if any.
    pub query: Option<String>,
    /// The exact body bytes (`body_raw`), if any.
    pub body: Option<String>,
    /// Headers the client sets (`Content-Type`).
    pub headers: Vec<(String, String)>,
}

impl WireRequest {
    /// `path?query`.
    pub fn target(&self) -> String {
        match &self.query {
            Some(q) if !q.is_empty() => format!("{}?{q}", self.path),
            _ => self.path.clone(),
        }
    }

    /// The request bytes as Go's `net/http` client writes them (HTTP/1.1, `Host`,
    /// `User-Agent: Go-http-client/1.1`, `Content-Length` when there is a body, the client's
    /// headers, `Accept-Encoding: gzip`), then the body verbatim.
    pub fn raw(&self, host: &str) -> Vec<u8> {
        let mut head = format!(
            "{} {} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: Go-http-client/1.1\r\n",
            self.method,
            self.target()
        );
        if let Some(b) = &self.body {
            head.push_str(&format!("Content-Length: {}\r\n", b.len()));
        }
        for (k, v) in &self.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("Accept-Encoding: gzip\r\n\r\n");
        let mut out = head.into_bytes();
        if let Some(b) = &self.body {
            out.extend_from_slice(b.as_bytes());
        }
        out
    }
}

impl Fixture {
    /// Whether the client sends anything (`false`: refused by the CLI before any request).
    pub fn sends(&self) -> bool {
        self.json["http_request_sent"].as_bool().unwrap_or(false)
    }

    /// The requests of this invocation: the `requests` list, else the top-level one.
    pub fn requests(&self) -> Vec<WireRequest> {
        let one = |v: &Value| -> Option<WireRequest> {
            let method = v["method"].as_str()?.to_string();
            let path = v["path"].as_str()?.to_string();
            let headers = v["http"]["headers_set_by_client"]
                .as_object()
                .map(|h| {
                    h.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                        .collect()
                })
                .unwrap_or_else(|| vec![("Content-Type".into(), "application/json".into())]);
            Some(WireRequest {
                method,
                path,
                query: v["query"].as_str().map(str::to_string),
                body: v["body_raw"].as_str().map(str::to_string),
                headers,
            })
        };
        match self.json["requests"].as_array() {
            Some(list) => list.iter().filter_map(one).collect(),
            None => one(&self.json).into_iter().collect(),
        }
    }
}

/// An HTTP response read off the socket.
#[derive(Debug, Clone)]
pub struct WireResponse {
    /// Status code.
    pub status: u16,
    /// Header lines (`name`, `value`), names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl WireResponse {
    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// Parses a complete HTTP/1.1 response with a `Content-Length` body.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let end = bytes
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or("no end of the response head")?;
        let head = String::from_utf8_lossy(&bytes[..end]);
        let mut lines = head.split("\r\n");
        let status_line = lines.next().ok_or("empty response")?;
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line {status_line:?}"))?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        Ok(Self {
            status,
            headers,
            body: bytes[end + 4..].to_vec(),
        })
    }
}

/// Longest a replayed exchange may take.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most response bytes read (the answers here are small; a runaway answer fails the test).
const MAX_RESPONSE: usize = 8 << 20;

/// Writes `raw` to `addr` over a fresh TCP connection and reads one response (head, then
/// `Content-Length` bytes of body, or up to EOF without one). Blocking, bounded by
/// [`EXCHANGE_TIMEOUT`].
pub fn exchange(addr: SocketAddr, raw: &[u8]) -> Result<Vec<u8>, String> {
    let mut s = TcpStream::connect_timeout(&addr, EXCHANGE_TIMEOUT)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(EXCHANGE_TIMEOUT))
        .map_err(|e| e.to_string())?;
    s.write_all(raw).map_err(|e| format!("write: {e}"))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            if let Some(len) = len
                && buf.len() >= end + 4 + len
            {
                buf.truncate(end + 4 + len);
                return Ok(buf);
            }
        }
        let n = s.read(&mut chunk).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Ok(buf);
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > MAX_RESPONSE {
            return Err(format!("response larger than {MAX_RESPONSE} bytes"));
        }
    }
}

/// How a request reaches the daemon under test.
pub trait Wire {
    /// Sends the raw request bytes and returns the raw response bytes.
    fn send(&self, raw: &[u8]) -> Result<Vec<u8>, String>;
    /// The `Host` header value (`127.0.0.1:PORT`).
    fn host(&self) -> String;
}

/// What the daemon under test serves, which decides the few documented differences.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// The daemon runs the XDP data path (`--xdp-iface`): L4 rules are accepted.
    pub l4: bool,
}

const API: &str = "/netlox/v1";

fn send(w: &dyn Wire, req: &WireRequest) -> Result<WireResponse, String> {
    WireResponse::parse(&w.send(&req.raw(&w.host()))?)
}

fn api(
    w: &dyn Wire,
    method: &str,
    target: &str,
    body: Option<&Value>,
) -> Result<WireResponse, String> {
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), Some(q.to_string())),
        None => (target.to_string(), None),
    };
    send(
        w,
        &WireRequest {
            method: method.into(),
            path: format!("{API}{path}"),
            query,
            body: body.map(Value::to_string),
            headers: vec![("Content-Type".into(), "application/json".into())],
        },
    )
}

fn rules(w: &dyn Wire) -> Result<Vec<Value>, String> {
    let r = api(w, "GET", "/config/loadbalancer/all", None)?;
    if r.status != 200 {
        return Err(format!("GET all: {} {}", r.status, r.text()));
    }
    Ok(r.json()["lbAttr"].as_array().cloned().unwrap_or_default())
}

/// A fixture's expectation failed.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!($($fmt)*));
        }
    };
}

/// `serviceArguments` key as loxi spells it (Go's case-insensitive match: `BGP` → `bgp`).
fn canonical_key(k: &str) -> String {
    match k {
        "BGP" => "bgp".into(),
        "Monitor" => "monitor".into(),
        _ => k.to_string(),
    }
}

fn is_zero(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_zero),
    }
}

/// LoxiLB's success body, byte for byte.
fn success_raw(responses: &Value) -> String {
    responses["post_success"]["body_raw"]
        .as_str()
        .unwrap_or("{\"result\":\"Success\"}\n")
        .to_string()
}

/// LoxiLB's error body keys (`models.Error`): `code` equal to the status, `fields` (null or a
/// list), `message` and `result` strings.
fn check_error_shape(r: &WireResponse, status: u16) -> Result<Value, String> {
    let b = r.json();
    ensure!(
        r.status == status,
        "status {} (want {status}): {}",
        r.status,
        r.text()
    );
    ensure!(b["code"] == json!(status), "code: {}", r.text());
    ensure!(
        b["fields"].is_null() || b["fields"].is_array(),
        "fields: {}",
        r.text()
    );
    ensure!(
        b["message"].is_string() && b["result"].is_string(),
        "message/result: {}",
        r.text()
    );
    ensure!(
        r.body.ends_with(b"\n"),
        "body ends with a newline as go-openapi writes it"
    );
    Ok(b)
}

/// The rule key of a listed entry.
fn key_of(e: &Value) -> (String, u64, String, String, String) {
    let s = &e["serviceArguments"];
    let st = |k: &str| s[k].as_str().unwrap_or_default().to_string();
    (
        st("externalIP"),
        s["port"].as_u64().unwrap_or(0),
        st("protocol"),
        st("host"),
        st("model_name"),
    )
}

/// Checks one fixture against a fresh daemon. `Ok(note)` says what was checked.
pub fn check_fixture(
    w: &dyn Wire,
    t: Target,
    fx: &Fixture,
    responses: &Value,
) -> Result<String, String> {
    if !fx.sends() {
        ensure!(
            fx.json["cli_result"]["exit_code"]
                .as_i64()
                .is_some_and(|c| c != 0),
            "a fixture that sends nothing must document the CLI's refusal"
        );
        return Ok("refused by the CLI before any request; nothing to replay".into());
    }
    let reqs = fx.requests();
    ensure!(!reqs.is_empty(), "no request in the fixture");
    let mut notes = Vec::new();
    for req in &reqs {
        let note = match (req.method.as_str(), req.path.as_str()) {
            ("POST", p) if p == format!("{API}/config/loadbalancer") => {
                check_create(w, t, req, responses)?
            }
            ("DELETE", _) => check_delete(w, t, req, responses)?,
            ("GET", _) => check_get(w, t, req)?,
            (m, p) => return Err(format!("no expectation for {m} {p}")),
        };
        notes.push(note);
    }
    Ok(notes.join("; "))
}

/// The P/D field of a body that asks for what loxi's P/D does not implement yet, if any: a P/D
/// handoff other than vLLM's (`kvEngineType`).
fn pd_field(body: &Value) -> Option<&'static str> {
    let s = &body["serviceArguments"];
    if s["pd_disagg_mode"] == json!(true) && s["kvEngineType"].as_str().is_some_and(|e| e != "vllm")
    {
        return Some("kvEngineType");
    }
    None
}

fn check_create(
    w: &dyn Wire,
    t: Target,
    req: &WireRequest,
    responses: &Value,
) -> Result<String, String> {
    let body: Value = serde_json::from_str(req.body.as_deref().unwrap_or("null"))
        .map_err(|e| format!("body_raw is not JSON: {e}"))?;
    let r = send(w, req)?;
    if let Some(field) = pd_field(&body) {
        // The parts of P/D loxi does not implement yet: the documented refusal.
        let b = check_error_shape(&r, 400)?;
        let msg = b["message"].as_str().unwrap_or_default();
        ensure!(
            msg.contains("not implemented"),
            "P/D refusal says so: {msg}"
        );
        let fields = b["fields"].to_string();
        ensure!(
            fields.contains("serviceArguments.pd_")
                || fields.contains("serviceArguments.kvExactMode")
                || fields.contains("serviceArguments.kvEngineType"),
            "the refusal names a P/D field ({field}): {fields}"
        );
        ensure!(rules(w)?.is_empty(), "nothing stored");
        return Ok(format!("P/D rule refused (400, {field} not implemented)"));
    }
    let mode = body["serviceArguments"]["mode"].as_u64().unwrap_or(0);
    if mode != 4 && !t.l4 {
        let b = check_error_shape(&r, 400)?;
        ensure!(
            b["message"]
                .as_str()
                .is_some_and(|m| m.contains("--xdp-iface")),
            "L4 refusal names --xdp-iface: {}",
            r.text()
        );
        ensure!(rules(w)?.is_empty(), "nothing stored");
        return Ok(format!("mode {mode} refused without the L4 data path"));
    }
    ensure!(r.status == 200, "status {}: {}", r.status, r.text());
    ensure!(
        r.text() == success_raw(responses),
        "body {:?} is not LoxiLB's {:?}",
        r.text(),
        success_raw(responses)
    );
    let listed = rules(w)?;
    ensure!(listed.len() == 1, "one rule listed: {listed:?}");
    let e = &listed[0];
    check_listed_matches_post(e, &body)?;
    let compared = check_against_loxilb_example(e, &body, responses)?;
    Ok(format!(
        "created; GET lists it in LoxiLB's shape{}",
        if compared {
            " and equal to LoxiLB's own answer (server_responses.json)"
        } else {
            ""
        }
    ))
}

/// Every non-zero `serviceArguments` value posted is listed back (canonical key), endpoints
/// keep the user's order with `state` and `backup`, and LoxiLB's always-present keys are
/// there.
fn check_listed_matches_post(e: &Value, body: &Value) -> Result<(), String> {
    let s = &e["serviceArguments"];
    if let Some(posted) = body["serviceArguments"].as_object() {
        for (k, v) in posted {
            if is_zero(v) || k == "inactiveTimeOut" {
                continue;
            }
            let k = canonical_key(k);
            ensure!(
                s[&k] == *v,
                "serviceArguments.{k}: listed {} posted {v}",
                s[&k]
            );
        }
    }
    let id = s["id"].as_str().unwrap_or_default();
    ensure!(
        id.len() == 36 && id.as_bytes().get(14) == Some(&b'4'),
        "id is a UUIDv4: {id:?}"
    );
    for (k, v) in [
        ("adminStateUp", json!(true)),
        ("alpn_protocols", Value::Null),
        ("tls_versions", Value::Null),
    ] {
        ensure!(s.get(k) == Some(&v), "serviceArguments.{k} = {v}: {s}");
    }
    for k in ["allowedSources", "secondaryIPs", "secondaryVIPs"] {
        ensure!(e.get(k) == Some(&Value::Null), "{k}: null");
    }
    let eps = e["endpoints"].as_array().cloned().unwrap_or_default();
    let posted = body["endpoints"].as_array().cloned().unwrap_or_default();
    ensure!(eps.len() == posted.len(), "endpoint count");
    for (l, p) in eps.iter().zip(&posted) {
        for k in ["endpointIP", "targetPort", "weight"] {
            ensure!(
                l[k] == p[k],
                "endpoint {k}: listed {} posted {}",
                l[k],
                p[k]
            );
        }
        ensure!(l["state"] == json!("active"), "state: {l}");
        ensure!(l["backup"] == json!(false), "backup: {l}");
    }
    Ok(())
}

/// Keys whose listed value loxi reports differently on purpose (README, "Where loxi
/// differs"): `id` (minted), `inactiveTimeOut` (loxi's effective timeout, absent for mode 4).
const EXEMPT_SERVICE: &[&str] = &["id", "inactiveTimeOut"];

/// The endpoint IPs of a rule body, sorted.
fn endpoint_ips(rule: &Value) -> Vec<String> {
    let mut v: Vec<String> = rule["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|ep| cell_str(&ep["endpointIP"]))
        .collect();
    v.sort();
    v
}

fn cell_str(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

/// When `server_responses.json` lists LoxiLB's answer for this rule (same key, selector, mode
/// and endpoint set as the posted body), every key LoxiLB lists is listed with the same value
/// (loxi's extra keys aside). Endpoints are compared as sets (LoxiLB sorts them by IP, loxi
/// keeps `ep_idx` order); `counter` is not reported by loxi.
fn check_against_loxilb_example(
    e: &Value,
    posted: &Value,
    responses: &Value,
) -> Result<bool, String> {
    let s = &e["serviceArguments"];
    let same = |x: &Value| {
        let xs = &x["serviceArguments"];
        key_of(x) == key_of(e)
            && xs["sel"] == s["sel"]
            && xs["mode"] == s["mode"]
            && endpoint_ips(x) == endpoint_ips(posted)
            && xs["pd_disagg_mode"] == posted["serviceArguments"]["pd_disagg_mode"]
    };
    let Some(example) = responses["get_all"]
        .as_object()
        .into_iter()
        .flat_map(|m| m.values())
        .filter_map(|v| v["body"]["lbAttr"].as_array())
        .flatten()
        .find(|x| same(x))
    else {
        return Ok(false);
    };
    let xs = &example["serviceArguments"];
    for (k, v) in xs.as_object().into_iter().flatten() {
        if EXEMPT_SERVICE.contains(&k.as_str()) {
            continue;
        }
        ensure!(s[k] == *v, "serviceArguments.{k}: loxi {} LoxiLB {v}", s[k]);
    }
    let strip = |eps: &Value| -> Vec<Value> {
        let mut v: Vec<Value> = eps
            .as_array()
            .into_iter()
            .flatten()
            .map(|ep| {
                let mut ep = ep.clone();
                if let Some(o) = ep.as_object_mut() {
                    o.remove("counter");
                }
                ep
            })
            .collect();
        v.sort_by_key(|ep| ep["endpointIP"].as_str().unwrap_or_default().to_string());
        v
    };
    ensure!(
        strip(&e["endpoints"]) == strip(&example["endpoints"]),
        "endpoints: loxi {} LoxiLB {}",
        e["endpoints"],
        example["endpoints"]
    );
    Ok(true)
}

/// Splits `/netlox/v1/config/loadbalancer/<a>/<b>/...` into its segment pairs.
fn segments(path: &str) -> Vec<(String, String)> {
    let rest = path
        .strip_prefix(&format!("{API}/config/loadbalancer/"))
        .unwrap_or_default();
    let parts: Vec<&str> = rest.split('/').collect();
    parts
        .chunks(2)
        .filter(|c| c.len() == 2)
        .map(|c| (c[0].to_string(), c[1].to_string()))
        .collect()
}

fn query_param(q: Option<&str>, key: &str) -> String {
    q.unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.replace("%2F", "/"))
        .unwrap_or_default()
}

/// A mode-4 rule with this key (and name), to be deleted by the fixture.
fn rule_with_key(ip: &str, port: u64, proto: &str, host: &str, model: &str, name: &str) -> Value {
    json!({
        "serviceArguments": {"externalIP": ip, "port": port, "protocol": proto, "mode": 4,
            "sel": 0, "host": host, "model_name": model, "name": name},
        "endpoints": [{"endpointIP": "192.0.2.1", "targetPort": 8000, "weight": 1}]
    })
}

fn check_delete(
    w: &dyn Wire,
    t: Target,
    req: &WireRequest,
    responses: &Value,
) -> Result<String, String> {
    let seg = segments(&req.path);
    let get = |k: &str| seg.iter().find(|(a, _)| a == k).map(|(_, b)| b.clone());
    let model = query_param(req.query.as_deref(), "model_name");
    // The rule the delete targets: the body kube-loxilb sends with it (the rule it created),
    // else a mode-4 rule with the key the path names.
    let (target, sibling) = if let Some(b) = &req.body {
        let v: Value = serde_json::from_str(b).map_err(|e| format!("body: {e}"))?;
        (v, None)
    } else if let Some(name) = get("name") {
        (
            rule_with_key("10.10.10.254", 8080, "tcp", "", "", &name),
            None,
        )
    } else {
        let ip = get("externalipaddress").ok_or("no externalipaddress segment")?;
        let port: u64 = get("port").and_then(|p| p.parse().ok()).ok_or("no port")?;
        let proto = get("protocol").ok_or("no protocol segment")?;
        let host = match get("hosturl").as_deref() {
            None | Some("any") => String::new(),
            Some(h) => h.to_string(),
        };
        let sibling = (host.is_empty() && model.is_empty())
            .then(|| rule_with_key(&ip, port, &proto, "", "keep-me", ""));
        (rule_with_key(&ip, port, &proto, &host, &model, ""), sibling)
    };
    if target["serviceArguments"]["mode"].as_u64().unwrap_or(0) != 4 && !t.l4 {
        // The L4 rule cannot exist without the data path: the delete finds nothing.
        let r = send(w, req)?;
        check_error_shape(&r, 404)?;
        return Ok(
            "L4 rule (not creatable without --xdp-iface): 404 in LoxiLB's error shape".into(),
        );
    }
    for r in std::iter::once(&target).chain(sibling.as_ref()) {
        let c = api(w, "POST", "/config/loadbalancer", Some(r))?;
        ensure!(c.status == 200, "setup POST {r}: {} {}", c.status, c.text());
    }
    let before = rules(w)?.len();
    let r = send(w, req)?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.text());
    ensure!(r.text() == success_raw(responses), "body {:?}", r.text());
    let after = rules(w)?;
    ensure!(
        after.len() + 1 == before,
        "exactly one rule deleted: {after:?}"
    );
    let gone = key_of(&json!({"serviceArguments": target["serviceArguments"].clone()}));
    ensure!(
        after.iter().all(|e| key_of(e) != gone),
        "the target rule is gone"
    );
    if sibling.is_some() {
        ensure!(
            after
                .iter()
                .any(|e| e["serviceArguments"]["model_name"] == json!("keep-me")),
            "a model pool on the same VIP:port survives a delete without model_name"
        );
    }
    // LoxiLB answers a second delete with 404 and its error body.
    let again = send(w, req)?;
    check_error_shape(&again, 404)?;
    Ok(format!(
        "deleted (200 Success), then 404{}",
        if sibling.is_some() {
            "; model pool kept"
        } else {
            ""
        }
    ))
}

fn check_get(w: &dyn Wire, t: Target, req: &WireRequest) -> Result<String, String> {
    let path = req.path.strip_prefix(API).unwrap_or(&req.path).to_string();
    match path.as_str() {
        "/config/loadbalancer/all" => {
            let r = send(w, req)?;
            ensure!(
                r.status == 200 && r.text() == "{\"lbAttr\":[]}\n",
                "empty: {}",
                r.text()
            );
            let rule = rule_with_key("10.10.10.254", 8080, "tcp", "", "", "");
            let c = api(w, "POST", "/config/loadbalancer", Some(&rule))?;
            ensure!(c.status == 200, "setup: {}", c.text());
            let r = send(w, req)?;
            let all = r.json()["lbAttr"].as_array().cloned().unwrap_or_default();
            ensure!(all.len() == 1, "one rule: {}", r.text());
            check_listed_matches_post(&all[0], &rule)?;
            Ok("lbAttr in LoxiLB's shape (empty, then one rule)".into())
        }
        "/config/endpoint/all" => {
            let rule = rule_with_key("10.10.10.254", 8080, "tcp", "", "", "");
            let c = api(w, "POST", "/config/loadbalancer", Some(&rule))?;
            ensure!(c.status == 200, "setup: {}", c.text());
            let r = send(w, req)?;
            ensure!(r.status == 200, "status {}: {}", r.status, r.text());
            let attr = r.json()["Attr"].as_array().cloned().unwrap_or_default();
            ensure!(attr.len() == 1, "one endpoint host: {}", r.text());
            let a = &attr[0];
            ensure!(a["hostName"] == json!("192.0.2.1"), "hostName: {a}");
            ensure!(a["currState"] == json!("ok"), "currState: {a}");
            for k in [
                "name",
                "probeType",
                "probePort",
                "inactiveReTries",
                "probeDuration",
            ] {
                ensure!(a.get(k).is_some(), "{k} in {a}");
            }
            Ok("Attr lists the endpoint".into())
        }
        "/config/conntrack/all" => {
            let r = send(w, req)?;
            ensure!(r.status == 200, "status {}: {}", r.status, r.text());
            if t.l4 {
                // The live XDP conntrack map: every entry has exactly LoxiLB's keys.
                let b = r.json();
                let cts = b["ctAttr"].as_array().ok_or("ctAttr is not an array")?;
                for c in cts {
                    let mut keys: Vec<&str> = c
                        .as_object()
                        .ok_or("conntrack entry is not an object")?
                        .keys()
                        .map(String::as_str)
                        .collect();
                    keys.sort_unstable();
                    ensure!(
                        keys == [
                            "bytes",
                            "conntrackAct",
                            "conntrackState",
                            "destinationIP",
                            "destinationPort",
                            "ident",
                            "packets",
                            "protocol",
                            "servName",
                            "sourceIP",
                            "sourcePort"
                        ],
                        "conntrack entry keys: {c}"
                    );
                }
                return Ok(format!(
                    "ctAttr from the XDP conntrack map ({} entries)",
                    cts.len()
                ));
            }
            Ok("ctAttr (no conntrack without the L4 data path)".into())
        }
        "/config/ai/kv/inventory" => {
            let sid = query_param(req.query.as_deref(), "service_id");
            let ep: u64 = query_param(req.query.as_deref(), "ep_idx")
                .parse()
                .unwrap_or(0);
            ensure!(
                sid == "1",
                "the fixture asks for the first rule of a fresh daemon"
            );
            let rule = json!({
                "serviceArguments": {"externalIP": "10.10.10.254", "port": 8080, "mode": 4,
                    "sel": 0, "kvExactMode": 3, "kvBlockSize": 16},
                "endpoints": [{"endpointIP": "192.0.2.1", "targetPort": 8000, "weight": 1},
                              {"endpointIP": "192.0.2.2", "targetPort": 8000, "weight": 1}]
            });
            let c = api(w, "POST", "/config/loadbalancer", Some(&rule))?;
            ensure!(c.status == 200, "setup: {}", c.text());
            let r = send(w, req)?;
            ensure!(r.status == 200, "status {}: {}", r.status, r.text());
            let b = r.json();
            let want = json!({"service_id": 1, "ep_idx": ep, "hash_algo": "sha256_cbor",
                "blocks": [], "total": 0});
            for (k, v) in want.as_object().into_iter().flatten() {
                ensure!(b[k] == *v, "LoxiLB's inventory key {k} = {v}: {}", r.text());
            }
            Ok("inventory in LoxiLB's shape".into())
        }
        p => Err(format!("no expectation for GET {p}")),
    }
}
