//! Turning `loxicmd` flags into REST bodies and paths.

use serde_json::{Map, Value, json};

use super::args::{CreateLb, DeleteLb, Ports};

/// A flag value `loxicmd` cannot use; the message names the flag (`flag: message`, or the
/// message alone when `flag` is empty: LoxiLB's own sentence, which names it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", if flag.is_empty() { String::new() } else { format!("{flag}: ") })]
pub struct UsageError {
    /// The flag, e.g. `--endpoints`.
    pub flag: String,
    /// What is wrong.
    pub message: String,
}

fn usage(flag: &str, message: impl Into<String>) -> UsageError {
    UsageError {
        flag: flag.to_string(),
        message: message.into(),
    }
}

/// One `(protocol, port, targetPort)` per entry of `--tcp/--udp/--sctp`.
pub fn port_list(ports: &Ports) -> Result<Vec<(&'static str, u16, u16)>, UsageError> {
    let mut out = Vec::new();
    for (proto, list) in [
        ("tcp", &ports.tcp),
        ("udp", &ports.udp),
        ("sctp", &ports.sctp),
    ] {
        let Some(list) = list else { continue };
        let flag = format!("--{proto}");
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (p, t) = item.split_once(':').unwrap_or((item, item));
            if p.contains('-') {
                return Err(usage(
                    &flag,
                    format!("{p:?}: port ranges are not implemented in loxi; give one port"),
                ));
            }
            let port = parse_port(&flag, p)?;
            let target = parse_port(&flag, t)?;
            out.push((proto, port, target));
        }
    }
    if out.is_empty() {
        return Err(usage(
            "--tcp",
            "give at least one service port (--tcp, --udp or --sctp)",
        ));
    }
    Ok(out)
}

fn parse_port(flag: &str, s: &str) -> Result<u16, UsageError> {
    s.trim()
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| usage(flag, format!("{s:?} is not a port (1..=65535)")))
}

/// `--mode` name → LoxiLB mode number.
pub fn mode_number(name: &str) -> Result<u8, UsageError> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "default" | "dnat" => 0,
        "onearm" => 1,
        "fullnat" => 2,
        "dsr" => 3,
        "fullproxy" => 4,
        "hostonearm" => 5,
        other => {
            return Err(usage(
                "--mode",
                format!(
                    "{other:?} is not one of default, onearm, fullnat, dsr, fullproxy, hostonearm"
                ),
            ));
        }
    })
}

/// `--select` name → LoxiLB `sel` number.
pub fn sel_number(name: &str) -> Result<u8, UsageError> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "rr" | "roundrobin" => 0,
        "hash" => 1,
        "wrr" | "priority" => 2,
        "persist" => 3,
        "lc" | "leastconnection" => 4,
        "n2" => 5,
        "n3" => 6,
        "chwbl" => 8,
        "gpuaware" | "gpu-aware" => 9,
        "wrr-hash" | "wrrhash" | "chwbl-wrr" => 10,
        other => {
            return Err(usage(
                "--select",
                format!(
                    "{other:?} is not one of rr, hash, wrr, persist, lc, n2, n3, chwbl, gpuaware, wrr-hash (chwbl-wrr)"
                ),
            ));
        }
    })
}

fn role_number(s: &str) -> Result<u8, UsageError> {
    Ok(match s.trim().to_ascii_lowercase().as_str() {
        "normal" | "0" | "" => 0,
        "prefill" | "1" => 1,
        "decode" | "2" => 2,
        other => {
            return Err(usage(
                "--ep-role",
                format!("{other:?} is not normal, prefill or decode"),
            ));
        }
    })
}

/// `--endpoints=ip:weight,...` → `[(ip, weight)]` (IPv6 as `[addr]` or `[addr]:weight`; a bare
/// IPv6 address is a usage error: `::1:1` reads as the address `::1:1` or as `::1` with weight
/// 1).
pub fn endpoint_list(s: &str) -> Result<Vec<(String, u32)>, UsageError> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        if !item.starts_with('[') && item.matches(':').count() > 1 {
            return Err(usage(
                "--endpoints",
                format!(
                    "{item:?}: write an IPv6 endpoint in brackets, [addr] or [addr]:weight (a \
                     bare address is ambiguous: \"::1:1\" is both the address ::1:1 and ::1 \
                     with weight 1)"
                ),
            ));
        }
        let (ip, w) = if let Some(rest) = item.strip_prefix('[') {
            let bad = || {
                usage(
                    "--endpoints",
                    format!("{item:?}: expected [addr] or [addr]:weight"),
                )
            };
            let (ip, after) = rest.split_once(']').ok_or_else(bad)?;
            match after {
                "" => (ip, "1"),
                a => (ip, a.strip_prefix(':').ok_or_else(bad)?),
            }
        } else {
            match item.rsplit_once(':') {
                Some((ip, w)) if !ip.is_empty() => (ip, w),
                _ => (item, "1"),
            }
        };
        let ip = ip.to_string();
        let weight = w.parse::<u32>().map_err(|_| {
            usage(
                "--endpoints",
                format!("{item:?}: weight {w:?} is not a number"),
            )
        })?;
        out.push((ip, weight));
    }
    if out.is_empty() {
        return Err(usage("--endpoints", "give at least one ip:weight"));
    }
    Ok(out)
}

/// The REST bodies of `create lb` (one per service port).
pub fn create_bodies(c: &CreateLb) -> Result<Vec<Value>, UsageError> {
    c.foreign.check().map_err(|(flag, m)| usage(&flag, m))?;
    // LoxiLB's loxicmd (`validateKVEngineOptions`, shared/loxilb-clients
    // `a_create_lb_kv_exact_as_given.json`): the P/D topology is asked for explicitly.
    if c.kv_exact_mode == Some(1) && c.pd_disagg_mode != Some(true) {
        return Err(usage("", "--kv-exact-mode=1 requires --pd-disagg"));
    }
    let eps = endpoint_list(&c.endpoints)?;
    let roles = per_endpoint(&c.ep_role, eps.len(), "--ep-role", role_number)?;
    // Roles imply P/D; given with P/D turned off, say it in the CLI's words, not the rule's.
    if c.pd_disagg_mode == Some(false) && roles.as_ref().is_some_and(|r| r.iter().any(|x| *x != 0))
    {
        return Err(usage(
            "--ep-role",
            "prefill/decode roles need P/D disaggregation: drop --pd-disagg=false (roles imply --pd-disagg)",
        ));
    }
    let ports_of = |list: &Option<String>, flag: &'static str, key: &'static str| {
        let ports = per_endpoint(list, eps.len(), flag, |s| {
            s.trim().parse::<u16>().map_err(|_| {
                usage(
                    flag,
                    format!("{s:?} is not a port (0 = the default, 1..=65535)"),
                )
            })
        })?;
        Ok::<_, UsageError>(ports.map(|p| (key, p)))
    };
    // Per-endpoint ports, each sent only when its flag was given.
    let ep_ports: Vec<(&str, Vec<u16>)> = [
        ports_of(&c.nixl_port, "--nixl-port", "nixl_port")?,
        ports_of(&c.ep_kv_zmq_port, "--ep-kv-zmq-port", "kvZmqPort")?,
        ports_of(&c.ep_kv_replay_port, "--ep-kv-replay-port", "kvReplayPort")?,
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut bodies = Vec::new();
    for (proto, port, target) in port_list(&c.ports)? {
        let mut svc = service_args(c)?;
        svc.insert("externalIP".into(), json!(c.vip));
        svc.insert("port".into(), json!(port));
        svc.insert("protocol".into(), json!(proto));
        if roles.as_ref().is_some_and(|r| r.iter().any(|x| *x != 0)) {
            svc.entry("pd_disagg_mode").or_insert(json!(true));
        }
        let endpoints: Vec<Value> = eps
            .iter()
            .enumerate()
            .map(|(i, (ip, w))| {
                let mut ep = json!({"endpointIP": ip, "targetPort": target, "weight": w});
                if let Some(r) = &roles {
                    ep["ep_role"] = json!(r[i]);
                }
                for (key, ports) in &ep_ports {
                    ep[*key] = json!(ports[i]);
                }
                ep
            })
            .collect();
        bodies.push(json!({"serviceArguments": Value::Object(svc), "endpoints": endpoints}));
    }
    Ok(bodies)
}

/// A comma list with one value per endpoint.
fn per_endpoint<T>(
    list: &Option<String>,
    n: usize,
    flag: &str,
    parse: impl Fn(&str) -> Result<T, UsageError>,
) -> Result<Option<Vec<T>>, UsageError> {
    let Some(list) = list else { return Ok(None) };
    let items: Vec<T> = list.split(',').map(&parse).collect::<Result<_, _>>()?;
    if items.len() != n {
        return Err(usage(
            flag,
            format!("{} values for {n} endpoints", items.len()),
        ));
    }
    Ok(Some(items))
}

/// Optional service fields: only flags the user gave are sent.
fn service_args(c: &CreateLb) -> Result<Map<String, Value>, UsageError> {
    let mut m = Map::new();
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            m.insert(k.to_string(), v);
        }
    };
    put(
        "mode",
        c.mode
            .as_deref()
            .map(mode_number)
            .transpose()?
            .map(Value::from),
    );
    put(
        "sel",
        c.select
            .as_deref()
            .map(sel_number)
            .transpose()?
            .map(Value::from),
    );
    put("name", c.name.clone().map(Value::from));
    put("host", c.host.clone().map(Value::from));
    put("model_name", c.model_name.clone().map(Value::from));
    put("security", c.security.map(Value::from));
    put(
        "backend_ca_file",
        c.backend_ca_file.clone().map(Value::from),
    );
    put(
        "backend_tls_server_name",
        c.backend_tls_server_name.clone().map(Value::from),
    );
    put(
        "backend_tls_insecure",
        c.backend_tls_insecure.map(Value::from),
    );
    put(
        "backend_protocol",
        c.backend_protocol.clone().map(Value::from),
    );
    put("sse_mode", c.sse_mode.map(Value::from));
    put(
        "session_header_name",
        c.session_header_name.clone().map(Value::from),
    );
    put("bgp", c.bgp.map(Value::from));
    put("inactiveTimeOut", c.inatimeout.map(Value::from));
    put("monitor", c.monitor.map(Value::from));
    put("probetype", c.probetype.clone().map(Value::from));
    put("probeport", c.probeport.map(Value::from));
    put("probereq", c.probereq.clone().map(Value::from));
    put("proberesp", c.proberesp.clone().map(Value::from));
    put("probeTimeout", c.probetimeout.map(Value::from));
    put("probeRetries", c.proberetries.map(Value::from));
    put(
        "chwbl_mean_load_factor",
        c.chwbl_load_factor.map(Value::from),
    );
    put("chwbl_replication", c.chwbl_replication.map(Value::from));
    put(
        "chwbl_prefix_hash_level",
        c.chwbl_prefix_hash_level.map(Value::from),
    );
    put(
        "chwbl_prefix_hash_flags",
        c.chwbl_prefix_hash_flags.map(Value::from),
    );
    put(
        "chwbl_enable_cache_salt",
        c.chwbl_enable_cache_salt.map(Value::from),
    );
    put("pd_disagg_mode", c.pd_disagg_mode.map(Value::from));
    put("pd_session_ttl_sec", c.pd_session_ttl_sec.map(Value::from));
    put(
        "pd_cache_aware_mode",
        c.pd_cache_aware_mode.map(Value::from),
    );
    put("pd_cache_threshold", c.pd_cache_threshold.map(Value::from));
    put(
        "pd_balance_abs_threshold",
        c.pd_balance_abs_threshold.map(Value::from),
    );
    put("pdBootstrapPort", c.pd_bootstrap_port.map(Value::from));
    put("kvEngineType", c.kv_engine_type.clone().map(Value::from));
    put("kvExactMode", c.kv_exact_mode.map(Value::from));
    put("kvZmqPort", c.kv_zmq_port.map(Value::from));
    put("kvHashAlgo", c.kv_hash_algo.clone().map(Value::from));
    put("kvBlockSize", c.kv_block_size.map(Value::from));
    put("kvWarmupSec", c.kv_warmup.map(Value::from));
    put("kvDpRankCount", c.kv_dp_rank_count.map(Value::from));
    put("kvReplayPort", c.kv_replay_port.map(Value::from));
    Ok(m)
}

/// The REST delete paths of `delete lb` (one per service port), with the query string.
pub fn delete_paths(d: &DeleteLb) -> Result<Vec<String>, UsageError> {
    d.foreign.check().map_err(|(flag, m)| usage(&flag, m))?;
    if let Some(name) = &d.name {
        return Ok(vec![format!(
            "/netlox/v1/config/loadbalancer/name/{}",
            encode(name)
        )]);
    }
    let vip = d
        .vip
        .as_deref()
        .ok_or_else(|| usage("EXTERNAL-IP", "give the VIP or --name"))?;
    let mut q = "bgp=false&block=0".to_string();
    if let Some(m) = &d.model_name {
        q.push_str(&format!("&model_name={}", encode(m)));
    }
    let host = d.host.as_deref().filter(|h| !h.is_empty()).unwrap_or("any");
    let paths = port_list(&d.ports)?
        .into_iter()
        .map(|(proto, port, _)| {
            format!(
                "/netlox/v1/config/loadbalancer/hosturl/{}/externalipaddress/{}/port/{port}/portmax/0/protocol/{proto}?{q}",
                encode(host),
                encode(vip)
            )
        })
        .collect();
    Ok(paths)
}

/// Path/query escaping that keeps IP literals and model names readable.
const KEEP: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'.')
    .remove(b'-')
    .remove(b'_')
    .remove(b':');

fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, KEEP).to_string()
}

/// `s` escaped as one URL path segment (letters, digits, `.`, `-`, `_`, `:` kept).
pub(crate) fn path_segment(s: &str) -> String {
    encode(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::args::{Cli, CreateWhat, DeleteWhat, Verb};
    use clap::Parser;

    fn create(args: &[&str]) -> CreateLb {
        let cli =
            Cli::try_parse_from([&["loxicmd", "create", "lb"], args].concat()).expect("parse");
        match cli.command {
            Verb::Create {
                what: CreateWhat::Lb(c),
            } => *c,
            other => panic!("not create lb: {other:?}"),
        }
    }

    #[test]
    fn spec_chwbl_example_builds_the_rest_body() {
        let c = create(&[
            "10.10.10.254",
            "--tcp=2022:8000",
            "--endpoints=192.0.2.1:1,198.51.100.1:2",
            "--mode=fullproxy",
            "--select=chwbl",
            "--host=10.10.10.254",
            "--chwbl-load-factor=150",
            "--chwbl-replication=64",
        ]);
        let bodies = create_bodies(&c).expect("bodies");
        assert_eq!(
            bodies,
            vec![json!({
                "serviceArguments": {"externalIP": "10.10.10.254", "port": 2022, "protocol": "tcp",
                    "mode": 4, "sel": 8, "host": "10.10.10.254",
                    "chwbl_mean_load_factor": 150, "chwbl_replication": 64},
                "endpoints": [
                    {"endpointIP": "192.0.2.1", "targetPort": 8000, "weight": 1},
                    {"endpointIP": "198.51.100.1", "targetPort": 8000, "weight": 2}
                ]
            })]
        );
    }

    /// Backend TLS (`--security=e2ehttps`) is configurable from the CLI, as over REST.
    #[test]
    fn backend_tls_flags_reach_the_rule() {
        let c = create(&[
            "10.0.0.1",
            "--tcp=443:8443",
            "--endpoints=10.0.1.2:1",
            "--mode=fullproxy",
            "--host=api.example.com",
            "--security=e2ehttps",
            "--backend-ca-file=/etc/loxi/backend-ca.pem",
            "--backend-tls-server-name=engine.internal",
        ]);
        let body = &create_bodies(&c).expect("bodies")[0];
        let s = &body["serviceArguments"];
        assert_eq!(
            (
                s["security"].clone(),
                s["backend_ca_file"].clone(),
                s["backend_tls_server_name"].clone(),
                s.get("backend_tls_insecure").cloned(),
            ),
            (
                json!(2),
                json!("/etc/loxi/backend-ca.pem"),
                json!("engine.internal"),
                None
            )
        );
        let c = create(&[
            "10.0.0.1",
            "--tcp=443:8443",
            "--endpoints=10.0.1.2:1",
            "--security=e2ehttps",
            "--backend-tls-insecure",
        ]);
        let body = &create_bodies(&c).expect("bodies")[0];
        assert_eq!(
            body["serviceArguments"]["backend_tls_insecure"],
            json!(true)
        );
    }

    #[test]
    fn kv_exact_mode_1_needs_pd_disagg_and_kv_flags_map_to_camel_case() {
        let args = [
            "10.0.0.1",
            "--tcp=8080:8000",
            "--endpoints=192.0.2.1:1,192.0.2.2:1",
            "--mode=fullproxy",
            "--select=persist",
            "--kv-exact-mode=1",
            "--kv-zmq-port=5557",
            "--kv-hash-algo=sha256_cbor",
            "--kv-block-size=16",
            "--kv-warmup=30",
            "--ep-role=prefill,decode",
        ];
        // LoxiLB's loxicmd refuses it as given (shared/loxilb-clients
        // a_create_lb_kv_exact_as_given.json), even though the roles alone imply P/D.
        let e = create_bodies(&create(&args)).expect_err("refused");
        assert_eq!(e.to_string(), "--kv-exact-mode=1 requires --pd-disagg");
        let c = create(&[&args[..], &["--pd-disagg"]].concat());
        let b = &create_bodies(&c).expect("bodies")[0];
        let s = &b["serviceArguments"];
        assert_eq!(s["pd_disagg_mode"], json!(true));
        let off = create(&[&args[..5], &args[10..], &["--pd-disagg=false"]].concat());
        let e = create_bodies(&off).expect_err("roles with P/D off");
        assert!(e.to_string().contains("drop --pd-disagg=false"), "{e}");
        let roles_only = create(&[&args[..5], &args[10..]].concat());
        let b = &create_bodies(&roles_only).expect("bodies")[0];
        assert_eq!(
            b["serviceArguments"]["pd_disagg_mode"],
            json!(true),
            "prefill/decode roles imply P/D"
        );
        let s = &create_bodies(&c).expect("bodies")[0]["serviceArguments"];
        assert_eq!(
            (s["kvExactMode"].clone(), s["kvZmqPort"].clone()),
            (json!(1), json!(5557))
        );
        assert_eq!(
            (s["kvBlockSize"].clone(), s["kvWarmupSec"].clone()),
            (json!(16), json!(30))
        );
        assert_eq!(b["endpoints"][0]["ep_role"], json!(1));
        assert_eq!(b["endpoints"][1]["ep_role"], json!(2));
    }

    #[test]
    fn per_endpoint_kv_ports_go_on_each_endpoint() {
        let c = create(&[
            "127.0.0.1",
            "--tcp=8080:8000",
            "--endpoints=127.0.0.2:1,127.0.0.3:1",
            "--mode=fullproxy",
            "--kv-exact-mode=3",
            "--ep-kv-zmq-port=5601,0",
            "--ep-kv-replay-port=5701,5702",
        ]);
        let b = &create_bodies(&c).expect("bodies")[0];
        let ep = |i: usize, k: &str| b["endpoints"][i][k].clone();
        assert_eq!(
            (
                ep(0, "kvZmqPort"),
                ep(1, "kvZmqPort"),
                ep(0, "kvReplayPort"),
                ep(1, "kvReplayPort")
            ),
            (json!(5601), json!(0), json!(5701), json!(5702))
        );
        assert!(
            b["endpoints"][0].get("nixl_port").is_none(),
            "only given flags are sent"
        );
        let bad = create(&[
            "127.0.0.1",
            "--tcp=8080:8000",
            "--endpoints=127.0.0.2:1,127.0.0.3:1",
            "--ep-kv-zmq-port=5601",
        ]);
        assert!(create_bodies(&bad).is_err(), "one value per endpoint");
    }

    #[test]
    fn loxilb_p_d_spellings_are_accepted() {
        let c = create(&[
            "10.0.0.1",
            "--tcp=8080:8000",
            "--endpoints=192.0.2.1:1,192.0.2.2:1",
            "--mode=fullproxy",
            "--pd-disagg",
            "--ep-role=prefill,decode",
            "--nixl-port=5600,5601",
            "--pd-session-ttl=60",
            "--kv-engine-type=sglang",
            "--pd-bootstrap-port=9998",
        ]);
        let b = &create_bodies(&c).expect("bodies")[0];
        let s = &b["serviceArguments"];
        assert_eq!(s["pd_disagg_mode"], json!(true));
        assert_eq!(s["pd_session_ttl_sec"], json!(60));
        assert_eq!(
            (&s["kvEngineType"], &s["pdBootstrapPort"]),
            (&json!("sglang"), &json!(9998))
        );
        assert_eq!(b["endpoints"][0]["nixl_port"], json!(5600));
        assert_eq!(b["endpoints"][1]["nixl_port"], json!(5601));
        let c = create(&[
            "10.0.0.1",
            "--tcp=80",
            "--endpoints=192.0.2.1",
            "--pd-cache-aware",
        ]);
        let b = &create_bodies(&c).expect("bodies")[0];
        assert_eq!(b["serviceArguments"]["pd_cache_aware_mode"], json!(true));
    }

    #[test]
    fn several_ports_give_several_rules_and_target_defaults_to_the_port() {
        let c = create(&[
            "10.0.0.1",
            "--tcp=80,443:8443",
            "--udp=53",
            "--endpoints=127.0.0.1",
        ]);
        let b = create_bodies(&c).expect("bodies");
        let keys: Vec<_> = b
            .iter()
            .map(|r| {
                (
                    r["serviceArguments"]["protocol"].clone(),
                    r["serviceArguments"]["port"].clone(),
                    r["endpoints"][0]["targetPort"].clone(),
                )
            })
            .collect();
        assert_eq!(
            keys,
            vec![
                (json!("tcp"), json!(80), json!(80)),
                (json!("tcp"), json!(443), json!(8443)),
                (json!("udp"), json!(53), json!(53)),
            ]
        );
        assert_eq!(b[0]["endpoints"][0]["weight"], json!(1));
    }

    #[test]
    fn bad_flag_values_name_the_flag() {
        let e = create_bodies(&create(&[
            "10.0.0.1",
            "--tcp=80:0",
            "--endpoints=127.0.0.1:1",
        ]))
        .expect_err("port 0");
        assert_eq!(e.flag, "--tcp");
        let e = create_bodies(&create(&[
            "10.0.0.1",
            "--tcp=80",
            "--endpoints=127.0.0.1:x",
        ]))
        .expect_err("weight");
        assert_eq!(e.flag, "--endpoints");
        let e = create_bodies(&create(&[
            "10.0.0.1",
            "--tcp=80",
            "--endpoints=127.0.0.1",
            "--select=fastest",
        ]))
        .expect_err("sel");
        assert_eq!(e.flag, "--select");
        let e = create_bodies(&create(&[
            "10.0.0.1",
            "--tcp=80",
            "--endpoints=127.0.0.1,127.0.0.2",
            "--ep-role=prefill",
        ]))
        .expect_err("roles");
        assert_eq!(e.to_string(), "--ep-role: 1 values for 2 endpoints");
    }

    #[test]
    fn ipv6_endpoints_use_brackets() {
        assert_eq!(
            endpoint_list("[::1]:3,127.0.0.1").expect("ok"),
            vec![("::1".to_string(), 3), ("127.0.0.1".to_string(), 1)]
        );
        assert_eq!(
            endpoint_list("[::1]").expect("ok"),
            vec![("::1".to_string(), 1)]
        );
        let e = endpoint_list("127.0.0.1:2,::1:1").expect_err("bare IPv6");
        assert_eq!(
            e.to_string(),
            "--endpoints: \"::1:1\": write an IPv6 endpoint in brackets, [addr] or \
             [addr]:weight (a bare address is ambiguous: \"::1:1\" is both the address ::1:1 \
             and ::1 with weight 1)"
        );
    }

    #[test]
    fn delete_builds_the_rest_path_with_host_and_model_query() {
        let cli = Cli::try_parse_from([
            "loxicmd",
            "delete",
            "lb",
            "10.0.0.1",
            "--tcp=8080",
            "--host=a b",
            "--model-name=Qwen/Qwen2.5",
        ])
        .expect("parse");
        let Verb::Delete {
            what: DeleteWhat::Lb(d),
        } = cli.command
        else {
            panic!("not delete")
        };
        assert_eq!(
            delete_paths(&d).expect("paths"),
            vec!["/netlox/v1/config/loadbalancer/hosturl/a%20b/externalipaddress/10.0.0.1/port/8080/portmax/0/protocol/tcp?bgp=false&block=0&model_name=Qwen%2FQwen2.5".to_string()]
        );
    }

    #[test]
    fn port_ranges_are_refused_as_not_implemented() {
        let c = create(&["10.0.0.1", "--tcp=8080-8081:80", "--endpoints=10.0.1.1:1"]);
        let e = create_bodies(&c).expect_err("range");
        assert_eq!(e.flag, "--tcp");
        assert!(e.message.contains("not implemented"), "{e}");
    }

    fn delete(args: &[&str]) -> DeleteLb {
        let cli =
            Cli::try_parse_from([&["loxicmd", "delete", "lb"], args].concat()).expect("parse");
        match cli.command {
            Verb::Delete {
                what: DeleteWhat::Lb(d),
            } => d,
            other => panic!("not delete lb: {other:?}"),
        }
    }

    /// The paths LoxiLB's Go loxicmd sends (`shared/loxilb-clients/g1_…`, `g6_…`).
    #[test]
    fn delete_paths_are_loxilb_loxicmd_s() {
        assert_eq!(
            delete_paths(&delete(&["10.10.10.254", "--tcp=8080"])).expect("paths"),
            vec!["/netlox/v1/config/loadbalancer/hosturl/any/externalipaddress/10.10.10.254/port/8080/portmax/0/protocol/tcp?bgp=false&block=0".to_string()]
        );
        assert_eq!(
            delete_paths(&delete(&["--name=my-ai-rule"])).expect("paths"),
            vec!["/netlox/v1/config/loadbalancer/name/my-ai-rule".to_string()]
        );
    }
}
