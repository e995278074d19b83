//! `loxicmd` against the real daemon.

use loxi_tests::harness::{Daemon, free_port};
use serde_json::{Value, json};

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `loxicmd create lb 127.0.0.1 <tcp> --endpoints=127.0.0.5:1 <rest…>` against `d`.
fn create_lb(d: &Daemon, tcp: &str, rest: &[&str]) -> std::process::Output {
    let mut args = vec!["create", "lb", "127.0.0.1", tcp, "--endpoints=127.0.0.5:1"];
    args.extend_from_slice(rest);
    d.loxicmd(&args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_create_get_delete_round_trip() {
    let d = Daemon::start_default().await;
    let port = free_port().to_string();
    let tcp = format!("--tcp={port}:8000");
    let out = d.loxicmd(&[
        "create",
        "lb",
        "127.0.0.1",
        &tcp,
        "--endpoints=127.0.0.5:3,127.0.0.4:3",
        "--mode=fullproxy",
        "--select=chwbl",
        "--chwbl-load-factor=150",
        "--chwbl-replication=64",
        "--host=example.test",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));

    let rules = d.rules().await;
    let s = &rules["lbAttr"][0]["serviceArguments"];
    assert_eq!((s["sel"].clone(), s["mode"].clone()), (json!(8), json!(4)));
    assert_eq!(
        (
            s["chwbl_mean_load_factor"].clone(),
            s["chwbl_replication"].clone()
        ),
        (json!(150), json!(64))
    );
    assert_eq!(s["host"], json!("example.test"));
    let eps = &rules["lbAttr"][0]["endpoints"];
    assert_eq!(
        (eps[0]["endpointIP"].clone(), eps[1]["weight"].clone()),
        (json!("127.0.0.5"), json!(3))
    );
    assert_eq!(eps[0]["targetPort"], json!(8000));

    // LoxiLB's table: one row per rule.
    let table = d.loxicmd(&["get", "lb"]);
    assert!(table.status.success());
    let t = stdout(&table);
    assert!(
        t.starts_with("|    EXT IP    |") || t.starts_with("|  EXT IP   |"),
        "{t}"
    );
    let row = t
        .lines()
        .find(|l| l.contains(&format!(" {port} ")))
        .unwrap_or_else(|| panic!("no rule row:\n{t}"));
    for cell in ["127.0.0.1", "tcp", "chwbl", "fullproxy", "2", "Off"] {
        assert!(row.contains(&format!(" {cell} ")), "{cell} not in {row}");
    }
    for alias in ["lbs", "loadbalancer", "loadbalancers"] {
        assert_eq!(stdout(&d.loxicmd(&["get", alias])), t, "alias {alias}");
    }
    let json_out = d.loxicmd(&["get", "lb", "-o", "json"]);
    let parsed: Value = serde_json::from_str(&stdout(&json_out)).expect("-o json is JSON");
    assert_eq!(parsed, rules);
    // -o wide: one row per endpoint, the rule's cells on the first.
    let wide = stdout(&d.loxicmd(&["-o", "wide", "get", "lb"]));
    let row0 = wide
        .lines()
        .find(|l| l.contains("127.0.0.5"))
        .expect("first endpoint row");
    assert!(
        row0.contains(" example.test ") && row0.contains(" 8000 "),
        "{row0}"
    );
    let row1 = wide
        .lines()
        .find(|l| l.contains("127.0.0.4"))
        .expect("second endpoint row");
    assert!(
        row1.contains(" 3 ") && !row1.contains("example.test"),
        "{row1}"
    );

    // A host-keyed rule is deleted by repeating --host.
    let out = d.loxicmd(&[
        "delete",
        "lb",
        "127.0.0.1",
        &format!("--tcp={port}"),
        "--host=other.test",
    ]);
    assert_eq!(
        out.status.code(),
        Some(4),
        "wrong host matches nothing (404 → 4)"
    );
    let out = d.loxicmd(&[
        "delete",
        "lb",
        "127.0.0.1",
        &format!("--tcp={port}"),
        "--host=example.test",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(d.rules().await, json!({"lbAttr": []}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_prints_the_server_error_as_loxilb_loxicmd_and_exits_by_status() {
    let d = Daemon::start_default().await;
    let tcp = format!("--tcp={}:8000", free_port());
    let out = create_lb(&d, &tcp, &["--mode=default", "--select=chwbl"]);
    assert_eq!(out.status.code(), Some(6), "400 → 6");
    assert_eq!(
        stderr(&out),
        "Error: server returned 400: serviceArguments.sel: requires mode 4 (fullproxy); mode is 0\n"
    );
    assert_eq!(d.rules().await, json!({"lbAttr": []}));

    let out = create_lb(&d, &tcp, &["--select=fastest"]);
    assert_eq!(out.status.code(), Some(2), "usage error: {}", stderr(&out));
    assert!(stderr(&out).contains("--select"), "{}", stderr(&out));

    // A refusal found after validation (no certificate for a TLS rule) names its field too.
    let out = create_lb(
        &d,
        &tcp,
        &[
            "--mode=fullproxy",
            "--security=https",
            "--host=other.example.com",
        ],
    );
    assert_eq!(out.status.code(), Some(6), "400 → 6");
    assert_eq!(
        stderr(&out),
        "Error: server returned 400: serviceArguments.security: 1 (TLS terminated here) needs a \
         certificate: no certificate covers host \"other.example.com\" and there is no \
         `default` one; upload one whose subjectAltName has DNS:other.example.com (or \
         DNS:*.example.com): `loxicmd create cert --cert-file CERT.pem --key-file KEY.pem \
         [--chain-file CHAIN.pem] [--cert-id ID]` (or POST /netlox/v1/config/cert); nothing was \
         stored (loxi serves security 0 (plain), 1 (TLS terminated here) and 2 (TLS terminated \
         here, re-encrypted to the endpoints); 1 and 2 need a certificate)\n"
    );
    assert_eq!(d.rules().await, json!({"lbAttr": []}));
}

/// The rule's tier-1.5 flags set away from their defaults without `--kv-exact-mode` would be
/// stored and inert: the server refuses them (400 → 6) naming the field, as it refuses an
/// endpoint's own `--ep-kv-zmq-port` there, and neither message has a run of spaces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_rule_kv_flags_without_kv_exact_mode_are_refused_naming_the_field() {
    let d = Daemon::start_default().await;
    let tcp = format!("--tcp={}:18000", free_port());
    for (flags, field, value) in [
        (&["--kv-zmq-port=6000"][..], "kvZmqPort", "6000"),
        (
            &["--kv-hash-algo=xxhash_cbor"],
            "kvHashAlgo",
            "\"xxhash_cbor\"",
        ),
        (&["--kv-block-size=7"], "kvBlockSize", "7"),
    ] {
        let out = create_lb(&d, &tcp, &[&["--mode=fullproxy"][..], flags].concat());
        assert_eq!(out.status.code(), Some(6), "{flags:?}: {}", stderr(&out));
        assert_eq!(
            stderr(&out),
            format!(
                "Error: server returned 400: serviceArguments.{field}: {value} tunes tier 1.5 \
                 (KV-event routing), which is read only with kvExactMode 1 or 3; this rule's \
                 kvExactMode is 0 (set kvExactMode, or leave {field} out)\n"
            )
        );
    }
    let out = create_lb(&d, &tcp, &["--mode=fullproxy", "--ep-kv-zmq-port=6000"]);
    assert_eq!(out.status.code(), Some(6), "{}", stderr(&out));
    assert_eq!(
        stderr(&out),
        "Error: server returned 400: endpoints[0].kvZmqPort: an endpoint's own KV-event port is \
         read only when its events are subscribed (kvExactMode 3, or kvExactMode 1 on a prefill \
         endpoint, ep_role 1); this endpoint's are not (kvExactMode 0, ep_role 0)\n"
    );
    assert_eq!(d.rules().await, json!({"lbAttr": []}));
    // The same flags with kvExactMode are stored.
    let out = create_lb(
        &d,
        &tcp,
        &[
            "--mode=fullproxy",
            "--kv-exact-mode=3",
            "--kv-zmq-port=6000",
            "--kv-hash-algo=xxhash_cbor",
            "--kv-block-size=7",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let rules = d.rules().await;
    let s = &rules["lbAttr"][0]["serviceArguments"];
    assert_eq!(
        (
            s["kvZmqPort"].clone(),
            s["kvHashAlgo"].clone(),
            s["kvBlockSize"].clone()
        ),
        (json!(6000), json!("xxhash_cbor"), json!(7))
    );
}

/// `--tcp` and `--udp` together are two rules, posted one after the other (as LoxiLB's
/// loxicmd does). When the second is refused (the fullproxy serves tcp only), the error names
/// the refused rule and the one the command already stored, which stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_partial_create_names_what_it_stored() {
    let d = Daemon::start_default().await;
    let port = free_port();
    let tcp = format!("--tcp={port}:8000");
    let udp = format!("--udp={port}:53");
    let out = create_lb(&d, &tcp, &["--mode=fullproxy", &udp]);
    assert_eq!(out.status.code(), Some(6), "{}", stderr(&out));
    assert_eq!(stdout(&out), "Success\n", "the tcp rule's answer");
    assert_eq!(
        stderr(&out),
        format!(
            "Error: server returned 400: serviceArguments.protocol: the fullproxy (mode 4) serves \
             tcp only, not udp (not implemented in loxi yet) (the rule for udp {port}); this \
             command already stored tcp {port} and kept it\n"
        )
    );
    let rules = d.rules().await;
    let stored: Vec<(&Value, &Value)> = rules["lbAttr"]
        .as_array()
        .expect("lbAttr")
        .iter()
        .map(|r| {
            let s = &r["serviceArguments"];
            (&s["protocol"], &s["port"])
        })
        .collect();
    assert_eq!(stored, vec![(&json!("tcp"), &json!(port))]);
}

/// `-o table` names the default format; `--timeout 0` is refused before any request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_accepts_output_table_and_refuses_a_zero_timeout() {
    let d = Daemon::start_default().await;
    let out = create_lb(
        &d,
        &format!("--tcp={}:8000", free_port()),
        &["--mode=fullproxy"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let default = d.loxicmd(&["get", "lb"]);
    let table = d.loxicmd(&["-o", "table", "get", "lb"]);
    assert!(table.status.success(), "{}", stderr(&table));
    assert!(stdout(&table).contains("EXT IP"), "{}", stdout(&table));
    assert_eq!(stdout(&table), stdout(&default));
    let out = d.loxicmd(&["--timeout", "0", "get", "lb"]);
    assert_eq!(out.status.code(), Some(2), "usage error: {}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "invalid value '0' for '--timeout <TIMEOUT>': must be at least 1 second (0 would \
             time out every call)"
        ),
        "{}",
        stderr(&out)
    );
    assert_eq!(stdout(&out), "");
}

/// `loxicmd get lb | head -1`: a reader that went away stops loxicmd quietly (no panic, no
/// message) with 141, the status a shell shows for Go's loxicmd killed by SIGPIPE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_stops_quietly_when_stdout_is_a_closed_pipe() {
    let d = Daemon::start_default().await;
    let port = free_port().to_string();
    let out = create_lb(&d, &format!("--tcp={port}:8000"), &["--mode=fullproxy"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let api = d.api_addr();
    for args in [
        &["get", "lb", "-o", "json"][..],
        &["get", "lb"],
        &["get", "ep"],
    ] {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let out = std::process::Command::new(loxi_tests::harness::bin_path("loxicmd"))
            .args(["--apiserver", &api.ip().to_string()])
            .args(["--port", &api.port().to_string()])
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(writer)
            .output()
            .expect("run loxicmd");
        assert_eq!(
            (out.status.code(), stderr(&out)),
            (Some(141), String::new()),
            "{args:?}"
        );
    }
}

/// `--apiserver HOST:PORT` or a URL is refused before any request, naming the flags to use.
#[test]
fn loxicmd_refuses_an_apiserver_with_a_port() {
    let out = std::process::Command::new(loxi_tests::harness::bin_path("loxicmd"))
        .args(["--apiserver", "127.0.0.1:11111", "get", "lb"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run loxicmd");
    assert_eq!(out.status.code(), Some(2), "usage error");
    assert_eq!(
        stderr(&out),
        "Error: --apiserver \"127.0.0.1:11111\" carries a port; give the address alone and \
         the port with --port (--apiserver 127.0.0.1 --port 11111)\n"
    );
    assert_eq!(stdout(&out), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_kv_flags_reach_the_rule_and_pd_flags_are_refused_as_unimplemented() {
    let d = Daemon::start_default().await;
    let port = free_port();
    let tcp = format!("--tcp={port}:8000");
    let common: [&str; 13] = [
        "create",
        "lb",
        "127.0.0.1",
        &tcp,
        "--endpoints=127.0.0.5:1,127.0.0.6:1",
        "--mode=fullproxy",
        "--select=persist",
        "--kv-zmq-port=5557",
        "--kv-hash-algo=sha256_cbor",
        "--kv-block-size=16",
        "--kv-warmup=30",
        "--session-header-name=X-Session-ID",
        "--model-name=Qwen/Qwen2.5-7B-Instruct",
    ];
    // KV-event routing over TensorRT-LLM is not implemented: the rule would be stored and
    // dead, so the server refuses it (P/D with TensorRT-LLM's handoff is served; see
    // tests/pd_dialects.rs).
    let pd = [
        &common[..],
        &[
            "--pd-disagg",
            "--kv-exact-mode=1",
            "--ep-role=prefill,decode",
            "--pd-session-ttl-sec=60",
            "--kv-engine-type=trtllm",
        ],
    ]
    .concat();
    let out = d.loxicmd(&pd);
    assert_eq!(out.status.code(), Some(6), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.starts_with("Error: server returned 400: serviceArguments.kvExactMode: ")
            && err.contains("not implemented"),
        "{err}"
    );
    assert_eq!(d.rules().await, json!({"lbAttr": []}));

    // SGLang P/D with its bootstrap port.
    let sglang = [
        &common[..],
        &[
            "--ep-role=prefill,decode",
            "--kv-engine-type=sglang",
            "--pd-bootstrap-port=9998",
        ],
    ]
    .concat();
    let out = d.loxicmd(&sglang);
    assert!(out.status.success(), "{}", stderr(&out));
    let rules = d.rules().await;
    let s = &rules["lbAttr"][0]["serviceArguments"];
    assert_eq!(
        (
            s["pd_disagg_mode"].clone(),
            s["kvEngineType"].clone(),
            s["pdBootstrapPort"].clone()
        ),
        (json!(true), json!("sglang"), json!(9998))
    );
    // The model is part of the key: a delete without it names the rule that is there.
    let out = d.loxicmd(&["delete", "lb", "127.0.0.1", &tcp]);
    assert!(!out.status.success(), "deleted a rule it did not name");
    assert!(
        stderr(&out).contains(&format!(
            "this rule is \"127.0.0.1:{port}/tcp model=Qwen/Qwen2.5-7B-Instruct\" on this address"
        )),
        "{}",
        stderr(&out)
    );
    assert_eq!(d.rules().await["lbAttr"].as_array().map(Vec::len), Some(1));
    let out = d.loxicmd(&[
        "delete",
        "lb",
        "127.0.0.1",
        &tcp,
        "--model-name=Qwen/Qwen2.5-7B-Instruct",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(d.rules().await, json!({"lbAttr": []}));

    let out = d.loxicmd(&[&common[..], &["--kv-exact-mode=3"][..]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let rules = d.rules().await;
    let s = &rules["lbAttr"][0]["serviceArguments"];
    assert_eq!(
        (s["kvExactMode"].clone(), s["kvWarmupSec"].clone()),
        (json!(3), json!(30))
    );
    assert_eq!(s["model_name"], json!("Qwen/Qwen2.5-7B-Instruct"));
    assert_eq!(s["session_header_name"], json!("X-Session-ID"));
    let out = d.loxicmd(&[
        "delete",
        "lb",
        "127.0.0.1",
        &tcp,
        "--model-name=Qwen/Qwen2.5-7B-Instruct",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(d.rules().await, json!({"lbAttr": []}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_get_kvinventory_and_kvparity_show_the_kv_views() {
    let d = Daemon::start_default().await;
    let port = free_port().to_string();
    let tcp = format!("--tcp={port}:8000");
    let out = d.loxicmd(&[
        "create",
        "lb",
        "127.0.0.1",
        &tcp,
        "--endpoints=127.0.0.5:1,127.0.0.4:1",
        "--mode=fullproxy",
        "--select=rr",
        "--kv-exact-mode=3",
        "--kv-block-size=32",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let id = d.rules().await["lbAttr"][0]["serviceId"].clone();
    let id = id
        .as_u64()
        .map_or_else(|| "1".to_string(), |v| v.to_string());

    // LoxiLB's rendering: the summary line, then the block table (empty: no blocks yet).
    let inv = d.loxicmd(&["get", "kvinventory", "--service-id", &id, "--ep-idx", "1"]);
    assert!(inv.status.success(), "{}", stderr(&inv));
    assert_eq!(
        stdout(&inv),
        format!(
            "service_id={id} ep_idx=1 hash_algo=sha256_cbor total=0\n| BLOCK IDX | HASH (UINT64) |\n|-----------|---------------|\n"
        )
    );
    let inv = d.loxicmd(&[
        "get",
        "kv-inventory",
        "--service-id",
        &id,
        "--ep-idx",
        "1",
        "-o",
        "json",
    ]);
    let v: Value = serde_json::from_str(&stdout(&inv)).expect("inventory is JSON");
    assert_eq!(
        (v["service_id"].to_string(), v["total"].clone()),
        (id.clone(), json!(0))
    );
    let eps = v["endpoints"]
        .as_array()
        .expect("loxi's endpoints view beside it");
    assert_eq!(eps.len(), 1, "--ep-idx 1 selects one endpoint: {v}");
    assert_eq!(
        (eps[0]["epIdx"].clone(), eps[0]["endpointIP"].clone()),
        (json!(1), json!("127.0.0.4"))
    );
    assert_eq!(eps[0]["blockCount"], json!(0));

    let par = d.loxicmd(&["get", "kvparity", "--service-id", &id, "-o", "json"]);
    assert!(par.status.success(), "{}", stderr(&par));
    let p: Value = serde_json::from_str(&stdout(&par)).expect("parity is JSON");
    assert_eq!(p["serviceId"].to_string(), id);
    let table = d.loxicmd(&["get", "kvparity", "--service-id", &id]);
    assert!(table.status.success(), "{}", stderr(&table));
    let text = stdout(&table);
    assert!(
        text.starts_with(&format!("service_id={id} kvHashAlgo=sha256_cbor kvBlockSize=32 seedSet=false tokenizer=ok warmup=off\n| EP IDX |")),
        "{text}"
    );
    assert_eq!(
        text.lines().filter(|l| l.contains("127.0.0.")).count(),
        2,
        "one row per endpoint: {text}"
    );

    let missing = d.loxicmd(&["get", "kvinventory", "--service-id", "999"]);
    assert_eq!(
        missing.status.code(),
        Some(4),
        "unknown service is a 404 → 4"
    );
    assert_eq!(
        stderr(&missing),
        "Error: server returned 404: service_id 999: no KV state (unknown rule or kvExactMode \
         0); a rule's id is its `serviceId` in `loxicmd get lb -o json` (GET \
         /netlox/v1/config/loadbalancer/all)\n"
    );
}

/// Issue 14 §4: `loxicmd save --lb -c DIR` writes LoxiLB's `lbconfig.txt`; `loxicmd apply --lb
/// FILE` on a fresh daemon recreates the same rules, model pools and KV fields included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_save_then_apply_recreates_the_rule_set() {
    let d = Daemon::start_default().await;
    let port = free_port();
    let rule = |model: &str, ep: &str| {
        json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                "mode": 4, "sel": 8, "model_name": model},
            "endpoints": [{"endpointIP": ep, "targetPort": 8000, "weight": 2}]
        })
    };
    for (m, ep) in [("llama", "127.0.0.7"), ("", "127.0.0.8")] {
        let (status, body) = d.post_rule(&rule(m, ep)).await;
        assert_eq!(status, 200, "{body}");
    }
    let dir = tempfile::tempdir().expect("tmp");
    let out = d.loxicmd(&["save", "--lb", "-c", &dir.path().display().to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let file = dir.path().join("lbconfig.txt");
    assert!(stdout(&out).contains("Saved 2 rules"), "{}", stdout(&out));
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("lbconfig.txt")).expect("json");
    assert_eq!(saved["lbAttr"].as_array().map(Vec::len), Some(2));
    let nothing = d.loxicmd(&["save", "-c", &dir.path().display().to_string()]);
    assert_eq!(nothing.status.code(), Some(2), "save needs --lb or --all");
    let absent = dir.path().join("absent");
    let unwritable = d.loxicmd(&["save", "--lb", "-c", &absent.display().to_string()]);
    assert_eq!(
        unwritable.status.code(),
        Some(1),
        "a local file error exits 1"
    );
    assert_eq!(
        stderr(&unwritable),
        format!(
            "Error: cannot write {}: No such file or directory (os error 2) (-c DIR saves to \
             another directory; the default is /etc/loxilb/)\n",
            absent.join("lbconfig.txt").display()
        )
    );
    let no_file = d.loxicmd(&["apply", "--lb", &absent.display().to_string()]);
    assert_eq!(no_file.status.code(), Some(1), "a local file error exits 1");
    assert_eq!(
        stderr(&no_file),
        format!(
            "Error: {}: No such file or directory (os error 2)\n",
            absent.display()
        )
    );

    // The saved rules' listener port must be free for the second daemon.
    let key = |v: &Value| {
        let mut rules: Vec<(String, String, u64)> = v["lbAttr"]
            .as_array()
            .expect("rules")
            .iter()
            .map(|r| {
                (
                    r["serviceArguments"]["model_name"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    r["endpoints"][0]["endpointIP"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    r["serviceArguments"]["sel"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        rules.sort();
        rules
    };
    let before = key(&d.rules().await);
    let mut d = d;
    d.stop().await;
    let fresh = Daemon::start_default().await;
    let out = fresh.loxicmd(&["apply", "--lb", &file.display().to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("Configuration applied"),
        "{}",
        stdout(&out)
    );
    let applied = fresh.rules().await;
    assert_eq!(key(&applied), before);
    assert_eq!(
        key(&applied),
        vec![
            ("".to_string(), "127.0.0.8".to_string(), 8),
            ("llama".to_string(), "127.0.0.7".to_string(), 8)
        ]
    );
    // A file that is not a saved rule set is refused before anything is posted.
    std::fs::write(dir.path().join("bad.txt"), "{\"rules\":[]}").expect("write");
    let bad = fresh.loxicmd(&[
        "apply",
        "--lb",
        &dir.path().join("bad.txt").display().to_string(),
    ]);
    assert_eq!(bad.status.code(), Some(6), "{}", stderr(&bad));
    assert!(stderr(&bad).contains("lbAttr"), "{}", stderr(&bad));
}

/// LoxiLB's cert verbs and `get metrics` against the real daemon: a certificate uploaded from
/// PEM files (the server answers its hostnames and its IP addresses), shown as LoxiLB's table
/// (the IP addresses after the DNS names as `IP:<address>`; they were dropped), listed,
/// deleted; refusals with LoxiLB's exit codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_cert_verbs_and_get_metrics() {
    let d = Daemon::start_default().await;
    let pki = loxi_tests::tls::TestPki::generate().expect("pki");
    let (cert, key) = (
        pki.cert().display().to_string(),
        pki.key().display().to_string(),
    );
    let cert_flag = format!("--cert-file={cert}");
    let key_flag = format!("--key-file={key}");

    let out = d.loxicmd(&["create", "cert", &cert_flag, &key_flag, "--cert-id=web"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "Certificate 'web' created.\n");
    let (status, text) = d.get("/netlox/v1/config/cert/web").await.expect("get cert");
    assert_eq!(status, 200, "{text}");
    let stored: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        stored["hostnames"],
        json!(["localhost"]),
        "the leaf's SAN DNS names (IP addresses are not host names): {stored}"
    );
    assert_eq!(
        stored["ipAddresses"],
        json!(["127.0.0.1", "::1"]),
        "the leaf's SAN IP addresses, beside: {stored}"
    );

    // The id the server minted is the one printed.
    let out = d.loxicmd(&["create", "cert", &cert_flag, &key_flag]);
    assert!(out.status.success(), "{}", stderr(&out));
    let printed = stdout(&out);
    let minted = printed
        .strip_prefix("Certificate '")
        .and_then(|s| s.strip_suffix("' created.\n"))
        .unwrap_or_else(|| panic!("{printed:?}"))
        .to_string();
    assert!(minted.starts_with("cert-"), "{minted}");

    let out = d.loxicmd(&["get", "cert", "web"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        concat!(
            "| CERT ID |           HOSTNAMES           |\n",
            "|---------|-------------------------------|\n",
            "| web     | localhost,IP:127.0.0.1,IP:::1 |\n",
        )
    );
    let out = d.loxicmd(&["get", "cert"]);
    let all = stdout(&out);
    assert!(
        all.contains("| web ") && all.contains(&format!("| {minted} ")),
        "{all}"
    );
    // `get cert all` is the list too (it printed one blank row: the list read as one entry).
    let out = d.loxicmd(&["get", "cert", "all"]);
    assert_eq!(stdout(&out), all);
    let out = d.loxicmd(&["-o", "json", "get", "cert", "web"]);
    let v: Value = serde_json::from_str(&stdout(&out)).expect("json");
    assert_eq!(v["certId"], "web");
    assert_eq!(v["ipAddresses"], json!(["127.0.0.1", "::1"]), "{v}");
    assert!(v.get("keyPem").is_none(), "never the key: {v}");

    // Refusals: the id exists (409 → 4), unknown id (404 → 4), unreadable file (1), usage (2).
    let out = d.loxicmd(&["create", "cert", &cert_flag, &key_flag, "--cert-id=web"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    let out = d.loxicmd(&["get", "cert", "nope"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    let out = d.loxicmd(&["create", "cert", "--cert-file=/nonexistent.pem", &key_flag]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("reading --cert-file /nonexistent.pem"),
        "{}",
        stderr(&out)
    );
    let out = d.loxicmd(&["create", "cert", &cert_flag, "--usage=ca"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("not implemented in loxi"),
        "{}",
        stderr(&out)
    );

    for id in ["web", minted.as_str()] {
        let out = d.loxicmd(&["delete", "cert", id]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout(&out), format!("Certificate '{id}' deleted.\n"));
    }
    let (_, text) = d.get("/netlox/v1/config/cert/all").await.expect("list");
    assert_eq!(
        serde_json::from_str::<Value>(&text).expect("json")["certAttr"],
        json!([])
    );

    let out = d.loxicmd(&["get", "metrics"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "prometheus metrics: enabled\n");
    let out = d.loxicmd(&["-o", "json", "get", "metrics"]);
    let v: Value = serde_json::from_str(&stdout(&out)).expect("json");
    assert_eq!(v, json!({"prometheus": true}));
}

/// Without `--apiserver`/`--port`, loxicmd finds the API at `LOXI_API_ADDR` (the daemon's own
/// variable, as `podman exec`/`kubectl exec` beside a daemon that moved its API see it);
/// flags win over it, and a value that is not `IP:PORT` is a usage error naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_reads_loxi_api_addr_when_no_flag_names_the_api() {
    let d = Daemon::start_default().await;
    let port = free_port().to_string();
    let out = create_lb(&d, &format!("--tcp={port}:8000"), &["--mode=fullproxy"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let run = |env: &str, args: &[&str]| {
        std::process::Command::new(loxi_tests::harness::bin_path("loxicmd"))
            .env("LOXI_API_ADDR", env)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run loxicmd")
    };
    let api = d.api_addr().to_string();
    let out = run(&api, &["get", "lb", "-o", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let listed: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(
        listed["lbAttr"][0]["serviceArguments"]["port"],
        json!(port.parse::<u16>().expect("port"))
    );
    // A flag wins: the port given points nowhere.
    let out = run(&api, &["get", "lb", "--port", &free_port().to_string()]);
    assert_eq!(out.status.code(), Some(5), "unreachable: {}", stderr(&out));
    let out = run("not-an-address", &["get", "lb"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("LOXI_API_ADDR=\"not-an-address\" is not IP:PORT"),
        "{}",
        stderr(&out)
    );
}

/// Scripts written for LoxiLB's loxicmd pass its flags for features loxi lacks at their
/// defaults: accepted, and the rule is the same; any other value is a usage error (exit 2)
/// naming the flag, and nothing is sent. `get lb --servName` filters by rule name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loxicmd_takes_loxilbs_flags_at_their_defaults_and_refuses_the_rest() {
    let d = Daemon::start_default().await;
    let port = free_port().to_string();
    let tcp = format!("--tcp={port}:8000");
    let out = create_lb(
        &d,
        &tcp,
        &[
            "--mode=fullproxy",
            "--name=with-defaults",
            "--mark=0",
            "--ppv2en=false",
            "--egress=false",
            "--path-match-mode=disabled",
            "--connection-limit=0",
            "--max-stream-duration=0",
            "--api-key-auth=disabled",
            "--fc-max-queue-depth=0",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    for (flag, why) in [
        ("--mark=10", "firewall marks"),
        ("--cb-enable", "circuit-breaker"),
        ("--mtls-client-cert-mode=required", "mTLS"),
        ("--attachEP", "attaching endpoints"),
    ] {
        let other = free_port().to_string();
        let out = create_lb(
            &d,
            &format!("--tcp={other}:8000"),
            &["--mode=fullproxy", flag],
        );
        assert_eq!(out.status.code(), Some(2), "{flag}: {}", stderr(&out));
        let err = stderr(&out);
        let name = flag.split('=').next().unwrap_or(flag);
        assert!(
            err.contains(name) && err.contains(why) && err.contains("loxi does not implement"),
            "{flag}: {err}"
        );
    }
    let rules = d.rules().await;
    assert_eq!(rules["lbAttr"].as_array().map(Vec::len), Some(1), "{rules}");

    let other = free_port().to_string();
    let out = create_lb(
        &d,
        &format!("--tcp={other}:8000"),
        &["--mode=fullproxy", "--name=other"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let out = d.loxicmd(&["get", "lb", "--servName=with-defaults", "-o", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let listed: Value = serde_json::from_str(&stdout(&out)).expect("json");
    let names: Vec<&str> = listed["lbAttr"]
        .as_array()
        .expect("lbAttr")
        .iter()
        .filter_map(|r| r["serviceArguments"]["name"].as_str())
        .collect();
    assert_eq!(names, ["with-defaults"]);
    // An empty `--servName=` filters nothing (it listed no rule), as LoxiLB's loxicmd.
    let out = d.loxicmd(&["get", "lb", "--servName=", "-o", "json"]);
    let listed: Value = serde_json::from_str(&stdout(&out)).expect("json");
    assert_eq!(
        listed["lbAttr"].as_array().map(Vec::len),
        Some(2),
        "{listed}"
    );

    let out = d.loxicmd(&[
        "delete",
        "lb",
        "127.0.0.1",
        &format!("--tcp={port}"),
        "--mark=7",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let out = d.loxicmd(&[
        "delete",
        "lb",
        "127.0.0.1",
        &format!("--tcp={port}"),
        "--mark=0",
        "--bgp",
        "--path-match-mode=disabled",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let rules = d.rules().await;
    let left: Vec<Value> = rules["lbAttr"]
        .as_array()
        .expect("lbAttr")
        .iter()
        .map(|r| r["serviceArguments"]["name"].clone())
        .collect();
    assert_eq!(left, [json!("other")]);
}

/// `--protocol https` against the plain-HTTP API: the TLS handshake meets an HTTP answer, and
/// the error says what to drop (it printed rustls' `received corrupt message of type
/// InvalidContentType` alone), as the reverse case says what to add.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_to_the_plain_http_api_says_to_drop_protocol_https() {
    let d = Daemon::start_default().await;
    let out = d.loxicmd(&["--protocol", "https", "get", "lb"]);
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "the loxilb API at {} seems to speak plain HTTP: drop --protocol https",
            d.api_addr()
        )),
        "{err}"
    );
}
