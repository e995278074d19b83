//! REST API integration tests against the real `loxilb` binary (see `loxi_tests::harness`).

use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use serde_json::{Value, json};

/// A mode-4 rule on 127.0.0.1:`port` with two endpoints that nobody needs to serve.
fn rule(port: u16) -> Value {
    json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4, "sel": 0},
        "endpoints": [
            {"endpointIP": "127.0.0.3", "targetPort": 8001, "weight": 1},
            {"endpointIP": "127.0.0.2", "targetPort": 8002, "weight": 1}
        ]
    })
}

fn with_service(mut r: Value, key: &str, v: Value) -> Value {
    r["serviceArguments"][key] = v;
    r
}

fn lb_attr(v: &Value) -> Vec<Value> {
    v["lbAttr"].as_array().cloned().expect("lbAttr array")
}

fn counter(metrics: &str, line_prefix: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_list_delete_round_trip_keeps_user_endpoint_order() {
    let d = Daemon::start_default().await;
    let port = free_port();
    let (status, body) = d.post_rule(&rule(port)).await;
    assert_eq!((status, body), (200, json!({"result": "Success"})));

    let rules = lb_attr(&d.rules().await);
    assert_eq!(rules.len(), 1);
    let s = &rules[0]["serviceArguments"];
    assert_eq!(
        (
            s["externalIP"].clone(),
            s["port"].clone(),
            s["mode"].clone()
        ),
        (json!("127.0.0.1"), json!(port), json!(4))
    );
    assert_eq!(s["kvBlockSize"], json!(16), "defaults are filled in");
    let eps = rules[0]["endpoints"].as_array().expect("endpoints");
    let ips: Vec<_> = eps
        .iter()
        .map(|e| e["endpointIP"].as_str().expect("ip"))
        .collect();
    assert_eq!(
        ips,
        ["127.0.0.3", "127.0.0.2"],
        "ep_idx is the user's order, not sorted by IP"
    );
    assert!(eps.iter().all(|e| e["state"] == json!("active")), "{eps:?}");

    let (status, body) = d.delete_rule("127.0.0.1", port, "tcp", None).await;
    assert_eq!((status, body), (200, json!({"result": "Success"})));
    assert!(lb_attr(&d.rules().await).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reposting_the_same_key_with_another_selector_is_409_and_keeps_the_rule() {
    let d = Daemon::start_default().await;
    let port = free_port();
    assert_eq!(d.post_rule(&rule(port)).await.0, 200);
    assert_eq!(
        d.post_rule(&rule(port)).await.0,
        200,
        "identical re-post is idempotent"
    );
    let (status, body) = d
        .post_rule(&with_service(rule(port), "sel", json!(2)))
        .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["code"], json!(409));
    assert_eq!(body["field"], json!("serviceArguments.sel"));
    // loxicmd prints `message`: it says the rule exists. kube-loxilb reads `result` and takes
    // an error containing "exist" for its rule installed, so `result` keeps the word out.
    assert_eq!(
        body["message"],
        json!(
            "serviceArguments.sel: a rule with this key already exists with another shape \
             (serviceArguments.sel = 0); delete it first (loxi does not change a rule's shape in \
             place)"
        )
    );
    let result = body["result"].as_str().unwrap_or_default();
    assert!(
        result.contains("serviceArguments.sel") && !result.contains("exist"),
        "{body}"
    );
    let rules = lb_attr(&d.rules().await);
    assert_eq!(rules.len(), 1);
    // sel 0 is omitted as LoxiLB's omitempty does; it is still not the 2 posted above.
    assert_eq!(rules[0]["serviceArguments"].get("sel"), None);
    // Same shape, new endpoint weights: an in-place update.
    let mut updated = rule(port);
    updated["endpoints"][0]["weight"] = json!(7);
    updated["endpoints"][1]["weight"] = json!(7);
    assert_eq!(d.post_rule(&updated).await.0, 200);
    assert_eq!(
        lb_attr(&d.rules().await)[0]["endpoints"][1]["weight"],
        json!(7)
    );
    // Unequal weights under sel 0, which gives every endpoint an equal share: refused, not
    // stored as if they split the traffic; the rule keeps its weights.
    updated["endpoints"][1]["weight"] = json!(2);
    let (status, body) = d.post_rule(&updated).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], json!("endpoints[1].weight"));
    assert!(
        body["message"]
            .as_str()
            .unwrap_or("")
            .contains("sel 2 (wrr)"),
        "{body}"
    );
    assert_eq!(
        lb_attr(&d.rules().await)[0]["endpoints"][1]["weight"],
        json!(7)
    );
    // The same weights under sel 2 (wrr), which reads them, on another port: accepted.
    let (status, body) = d
        .post_rule(&with_service(
            with_service(updated, "port", json!(free_port())),
            "sel",
            json!(2),
        ))
        .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_23_misspelled_block_size_is_rejected_naming_kv_block_size_and_nothing_is_stored()
{
    let d = Daemon::start_default().await;
    // Separator mistakes are refused. (A pure casing variant such as `kvblocksize` is accepted
    // as `kvBlockSize`, as LoxiLB's Go decoder does: see the fields module.)
    for bad in ["kv_block_size", "kv-block-size"] {
        let r = with_service(rule(free_port()), bad, json!(32));
        let (status, body) = d.post_rule(&r).await;
        assert_eq!(status, 400, "{body}");
        let msg = format!("\"{bad}\" is not a field; did you mean \"kvBlockSize\"?");
        let field = format!("serviceArguments.{bad}");
        assert_eq!(
            body,
            json!({
                "code": 400,
                "fields": [field],
                "message": msg,
                "result": msg,
                "field": field
            })
        );
    }
    assert!(
        lb_attr(&d.rules().await).is_empty(),
        "a rejected rule must not be stored"
    );
    let (status, body) = d
        .post_rule(&with_service(rule(free_port()), "kv_exact_mode", json!(3)))
        .await;
    assert_eq!(status, 400);
    assert_eq!(
        body["message"],
        json!("\"kv_exact_mode\" is not a field; did you mean \"kvExactMode\"?")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_types_and_misspelled_endpoint_keys_name_the_field() {
    let d = Daemon::start_default().await;
    let (status, body) = d
        .post_rule(&with_service(rule(free_port()), "kvBlockSize", json!("16")))
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], json!("serviceArguments.kvBlockSize"));
    assert!(
        body["message"]
            .as_str()
            .expect("message")
            .starts_with("\"kvBlockSize\" has a wrong type"),
        "{body}"
    );

    let mut r = rule(free_port());
    r["endpoints"][1]["weight"] = json!("heavy");
    let (status, body) = d.post_rule(&r).await;
    assert_eq!(
        (status, body["field"].clone()),
        (400, json!("endpoints[1].weight")),
        "{body}"
    );

    let mut r = rule(free_port());
    r["endpoints"][0]["target_port"] = json!(8000);
    let (status, body) = d.post_rule(&r).await;
    assert_eq!(status, 400);
    assert_eq!(
        body["message"],
        json!("\"target_port\" is not a field; did you mean \"targetPort\"?")
    );
    assert_eq!(body["field"], json!("endpoints[0].target_port"));

    let (status, body) = d.post_rule_raw("{\"serviceArguments\": {").await;
    assert_eq!(status, 400, "malformed JSON is a client error: {body}");
    assert!(lb_attr(&d.rules().await).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_values_are_400_naming_the_field() {
    let d = Daemon::start_default().await;
    let cases = [
        ("sel", json!(7), "serviceArguments.sel"),
        ("mode", json!(6), "serviceArguments.mode"),
        (
            "chwbl_mean_load_factor",
            json!(99),
            "serviceArguments.chwbl_mean_load_factor",
        ),
        (
            "chwbl_replication",
            json!(1025),
            "serviceArguments.chwbl_replication",
        ),
        ("kvBlockSize", json!(0), "serviceArguments.kvBlockSize"),
        ("kvExactMode", json!(2), "serviceArguments.kvExactMode"),
        (
            "pd_cache_threshold",
            json!(101),
            "serviceArguments.pd_cache_threshold",
        ),
        ("kvDpRankCount", json!(9), "serviceArguments.kvDpRankCount"),
        (
            "externalIP",
            json!("10.0.0.300"),
            "serviceArguments.externalIP",
        ),
    ];
    for (key, value, field) in cases {
        let (status, body) = d
            .post_rule(&with_service(rule(free_port()), key, value.clone()))
            .await;
        assert_eq!(status, 400, "{key}={value}: {body}");
        assert_eq!(body["field"], json!(field), "{key}={value}: {body}");
    }
    let mut r = rule(free_port());
    r["endpoints"][0]["weight"] = json!(0);
    assert_eq!(
        d.post_rule(&r).await.1["field"],
        json!("endpoints[0].weight")
    );
    // AI selectors need fullproxy.
    let r = with_service(
        with_service(rule(free_port()), "mode", json!(0)),
        "sel",
        json!(8),
    );
    let (status, body) = d.post_rule(&r).await;
    assert_eq!(
        (status, body["field"].clone()),
        (400, json!("serviceArguments.sel")),
        "{body}"
    );
    assert!(lb_attr(&d.rules().await).is_empty());
}

/// A rule's free text (name, id, model_name, ...) is printable and 253 bytes at most, and its
/// VIP and endpoints each name one host: otherwise 400 naming the field, and nothing stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_long_names_and_group_addresses_are_400_naming_the_field() {
    let d = Daemon::start_default().await;
    let cases = [
        (json!({"name": "web\nprod"}), "serviceArguments.name"),
        (json!({"name": "a\tb"}), "serviceArguments.name"),
        (json!({"name": "nul\u{0}"}), "serviceArguments.name"),
        (
            json!({"name": "x".repeat(1 << 20)}),
            "serviceArguments.name",
        ),
        (json!({"id": "id\r\n"}), "serviceArguments.id"),
        (
            json!({"model_name": "m".repeat(254)}),
            "serviceArguments.model_name",
        ),
        (
            json!({"sel": 3, "session_header_name": "X-Session\n"}),
            "serviceArguments.session_header_name",
        ),
        (
            json!({"probetype": "http", "probereq": "/health\r\nX: y"}),
            "serviceArguments.probereq",
        ),
        (
            json!({"externalIP": "224.0.0.1"}),
            "serviceArguments.externalIP",
        ),
        (
            json!({"externalIP": "255.255.255.255"}),
            "serviceArguments.externalIP",
        ),
        (
            json!({"externalIP": "ff02::1"}),
            "serviceArguments.externalIP",
        ),
    ];
    for (extra, field) in cases {
        let mut r = rule(free_port());
        for (k, v) in extra.as_object().expect("object") {
            r = with_service(r, k, v.clone());
        }
        let (status, body) = d.post_rule(&r).await;
        assert_eq!((status, &body["field"]), (400, &json!(field)), "{body}");
        let message = body["message"].as_str().unwrap_or_default();
        assert!(message.starts_with(&format!("{field}: ")), "{message}");
        assert!(
            message.len() < 400,
            "the value is not echoed: {} bytes",
            message.len()
        );
    }
    let (_, body) = d
        .post_rule(&with_service(rule(free_port()), "name", json!("web\nprod")))
        .await;
    assert_eq!(
        body["message"],
        json!(
            "serviceArguments.name: \"web\\nprod\" contains the control character '\\n'; a \
             rule name is a column of loxicmd's tables, so it is printable text of at most 253 \
             bytes"
        )
    );
    let mut r = rule(free_port());
    r["endpoints"]
        .as_array_mut()
        .expect("endpoints")
        .push(json!({"endpointIP": "255.255.255.255", "targetPort": 8003}));
    let (status, body) = d.post_rule(&r).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], json!("endpoints[2].endpointIP"));
    assert_eq!(
        body["message"],
        json!(
            "endpoints[2].endpointIP: 255.255.255.255 is the broadcast address, not a host to send \
             requests to"
        )
    );
    assert!(lb_attr(&d.rules().await).is_empty(), "nothing stored");
    // kube-loxilb's name is stored and listed as posted.
    let (status, body) = d
        .post_rule(&with_service(
            rule(free_port()),
            "name",
            json!("default_tcp-lb-default:llb-inst0"),
        ))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        lb_attr(&d.rules().await)[0]["serviceArguments"]["name"],
        json!("default_tcp-lb-default:llb-inst0")
    );
}

/// An http probe sends `GET <probereq>`, so a `probereq` that is a request line or a URL made
/// a probe that failed forever and held every endpoint down: 400 naming it. A path passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_probereq_that_is_not_a_path_is_400_naming_it() {
    let d = Daemon::start_default().await;
    let probe = |req: &str| {
        let r = with_service(rule(free_port()), "monitor", json!(true));
        let r = with_service(r, "probetype", json!("http"));
        with_service(r, "probereq", json!(req))
    };
    let (status, body) = d.post_rule(&probe("GET /health")).await;
    assert_eq!(
        (status, body["field"].clone(), body["message"].clone()),
        (
            400,
            json!("serviceArguments.probereq"),
            json!(
                "serviceArguments.probereq: probereq \"GET /health\" must be a path such as \
                 \"/health\" (the probe sends GET <path>; no method, scheme, host, space or \
                 fragment)"
            )
        ),
        "{body}"
    );
    assert!(lb_attr(&d.rules().await).is_empty(), "nothing stored");
    let (status, body) = d.post_rule(&probe("/health")).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_by_model_name_removes_only_that_pool_and_unknown_rule_is_404() {
    let d = Daemon::start_default().await;
    let port = free_port();
    let llama = with_service(rule(port), "model_name", json!("llama"));
    let qwen = with_service(rule(port), "model_name", json!("Qwen/Qwen2.5-7B"));
    assert_eq!(d.post_rule(&llama).await.0, 200);
    assert_eq!(d.post_rule(&qwen).await.0, 200);
    assert_eq!(lb_attr(&d.rules().await).len(), 2);

    let (status, _) = d
        .delete_rule(
            "127.0.0.1",
            port,
            "tcp",
            Some("model_name=Qwen%2FQwen2.5-7B"),
        )
        .await;
    assert_eq!(status, 200);
    let left = lb_attr(&d.rules().await);
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["serviceArguments"]["model_name"], json!("llama"));

    let (status, body) = d
        .delete_rule("127.0.0.1", port, "tcp", Some("model_name=nope"))
        .await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["code"], json!(404));
    let (status, body) = d.delete_rule("127.0.0.1", 0, "tcp", None).await;
    assert_eq!((status, body["field"].clone()), (400, json!("port")));
    let (status, body) = d.delete_rule("notip", port, "tcp", None).await;
    assert_eq!(
        (status, body["field"].clone(), body["message"].clone()),
        (
            400,
            json!("externalipaddress"),
            json!("\"notip\" is not an IP address")
        )
    );
}

/// A protocol that no rule can have is the client's mistake, answered as a bad address or port
/// is (400 naming the field), on every route that takes one; not 404 "no rule matches". A
/// known protocol in another case still names the rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_protocol_is_400_naming_it_on_every_key_route() {
    let d = Daemon::start_default().await;
    let port = free_port();
    assert_eq!(d.post_rule(&rule(port)).await.0, 200);
    let key = |proto: &str| {
        format!(
            "/netlox/v1/config/loadbalancer/externalipaddress/127.0.0.1/port/{port}/protocol/{proto}"
        )
    };
    let hosturl = |proto: &str| {
        format!(
            "/netlox/v1/config/loadbalancer/hosturl/any/externalipaddress/127.0.0.1/port/{port}/protocol/{proto}"
        )
    };
    let portmax = |proto: &str| {
        format!(
            "/netlox/v1/config/loadbalancer/externalipaddress/127.0.0.1/port/{port}/portmax/0/protocol/{proto}"
        )
    };
    let hosturl_portmax = |proto: &str| {
        format!(
            "/netlox/v1/config/loadbalancer/hosturl/any/externalipaddress/127.0.0.1/port/{port}/portmax/0/protocol/{proto}"
        )
    };
    let routes: [(&str, String); 7] = [
        ("DELETE", key("xyz")),
        ("DELETE", hosturl("xyz")),
        ("DELETE", portmax("xyz")),
        ("DELETE", hosturl_portmax("xyz")),
        ("GET", key("xyz")),
        ("GET", format!("{}/status", key("xyz"))),
        ("GET", format!("{}/stats", key("xyz"))),
    ];
    for (method, path) in &routes {
        let (status, text) = d.request(method, path, None).await.expect("request");
        let body = loxi_tests::harness::parse_json(&text);
        assert_eq!(
            (status, body["field"].clone(), body["message"].clone()),
            (
                400,
                json!("protocol"),
                json!("\"xyz\" is not a protocol (tcp, udp, sctp)")
            ),
            "{method} {path}"
        );
    }
    assert_eq!(lb_attr(&d.rules().await).len(), 1, "nothing was deleted");
    let (status, body) = d.get(&key("TCP")).await.expect("GET");
    assert_eq!(status, 200, "{body}");
    let (status, _) = d.delete_rule("127.0.0.1", port, "TCP", None).await;
    assert_eq!(status, 200);
    assert!(lb_attr(&d.rules().await).is_empty());
}

/// A query parameter a route does not read is refused (400 naming it, with the ones the route
/// reads), on every route: `?foo=1` on `GET .../all`, `/metrics` or `/version` answered 200 and
/// ignored it, while the key routes refused it. Nothing is acted on: the posted rule is not
/// stored and nothing is deleted. LoxiLB's clients send no parameter these routes do not read
/// (`shared/loxilb-clients/`, replayed by `tests/tests/loxilb_clients.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_refuses_a_query_parameter_it_does_not_read() {
    let d = Daemon::start_default().await;
    let port = free_port();
    assert_eq!(d.post_rule(&rule(port)).await.0, 200);
    let id = lb_attr(&d.rules().await)[0]["serviceArguments"]["id"]
        .as_str()
        .expect("the rule's id")
        .to_string();
    let key = format!(
        "/netlox/v1/config/loadbalancer/externalipaddress/127.0.0.1/port/{port}/protocol/tcp"
    );
    let hosturl = format!(
        "/netlox/v1/config/loadbalancer/hosturl/any/externalipaddress/127.0.0.1/port/{port}/protocol/tcp"
    );
    let portmax = format!(
        "/netlox/v1/config/loadbalancer/externalipaddress/127.0.0.1/port/{port}/portmax/0/protocol/tcp"
    );
    let hosturl_portmax = format!(
        "/netlox/v1/config/loadbalancer/hosturl/any/externalipaddress/127.0.0.1/port/{port}/portmax/0/protocol/tcp"
    );
    let none = "it reads none";
    let by_key = "host, model_name";
    let delete = "model_name, host, bgp, block, path_match_mode, path_prefix";
    let other_rule = rule(free_port()).to_string();
    let routes: Vec<(&str, String, Option<&str>, &str)> = vec![
        (
            "GET",
            "/netlox/v1/config/loadbalancer/all".into(),
            None,
            none,
        ),
        (
            "GET",
            format!("/netlox/v1/config/loadbalancer/id/{id}"),
            None,
            none,
        ),
        ("GET", key.clone(), None, by_key),
        ("GET", format!("{key}/status"), None, by_key),
        ("GET", format!("{key}/stats"), None, none),
        ("GET", "/netlox/v1/config/cert".into(), None, none),
        ("GET", "/netlox/v1/config/cert/all".into(), None, none),
        ("GET", "/netlox/v1/config/cert/default".into(), None, none),
        ("GET", "/netlox/v1/version".into(), None, none),
        ("GET", "/netlox/v1/config/endpoint/all".into(), None, none),
        ("GET", "/netlox/v1/config/conntrack/all".into(), None, none),
        ("GET", "/netlox/v1/config/metrics".into(), None, none),
        ("GET", "/netlox/v1/metrics".into(), None, none),
        (
            "GET",
            "/netlox/v1/config/ai/kv/inventory".into(),
            None,
            "service_id, ep_idx, offset, limit",
        ),
        (
            "GET",
            "/netlox/v1/config/ai/kv/parity".into(),
            None,
            "service_id",
        ),
        (
            "POST",
            "/netlox/v1/config/loadbalancer".into(),
            Some(other_rule.as_str()),
            none,
        ),
        ("POST", "/netlox/v1/config/cert".into(), Some("{}"), none),
        (
            "PUT",
            "/netlox/v1/config/cert/default".into(),
            Some("{}"),
            none,
        ),
        (
            "DELETE",
            "/netlox/v1/config/cert/default".into(),
            None,
            none,
        ),
        (
            "DELETE",
            "/netlox/v1/config/loadbalancer/name/x".into(),
            None,
            none,
        ),
        ("DELETE", key.clone(), None, delete),
        ("DELETE", hosturl, None, delete),
        ("DELETE", portmax, None, delete),
        ("DELETE", hosturl_portmax, None, delete),
    ];
    for (method, path, body, reads) in &routes {
        let path = format!("{path}?x=1");
        let (status, text) = d.request(method, &path, *body).await.expect("request");
        let v = loxi_tests::harness::parse_json(&text);
        assert_eq!(
            (status, v["field"].clone(), v["message"].clone()),
            (
                400,
                json!("x"),
                json!(format!(
                    "\"x\" is not a query parameter of this route ({reads})"
                ))
            ),
            "{method} {path}"
        );
    }
    let rules = lb_attr(&d.rules().await);
    assert_eq!(rules.len(), 1, "nothing was stored or deleted");
    assert_eq!(rules[0]["serviceArguments"]["port"], json!(port));
    // Without the parameter the same routes answer.
    for path in [
        "/netlox/v1/config/loadbalancer/all".to_string(),
        format!("{key}/stats"),
        "/netlox/v1/version".into(),
        "/netlox/v1/metrics".into(),
        "/netlox/v1/config/metrics".into(),
        "/netlox/v1/config/endpoint/all".into(),
        "/netlox/v1/config/conntrack/all".into(),
        "/netlox/v1/config/cert/all".into(),
    ] {
        let (status, text) = d.get(&path).await.expect("GET");
        assert_eq!(status, 200, "{path}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_are_restored_after_a_restart_with_their_order() {
    let mut d = Daemon::start_default().await;
    let (p1, p2) = (free_port(), free_port());
    assert_eq!(d.post_rule(&rule(p1)).await.0, 200);
    assert_eq!(
        d.post_rule(&with_service(rule(p2), "sel", json!(2)))
            .await
            .0,
        200
    );
    let before = d.rules().await;
    let status = d.stop().await;
    assert!(
        status.is_some_and(|s| s.success()),
        "SIGTERM must end the daemon cleanly: {status:?}"
    );
    d.restart().await;
    assert_eq!(
        d.rules().await,
        before,
        "restored rules equal the rules before the restart"
    );
    assert!(d.log_text().contains("rules restored"), "{}", d.log_text());
    let m = d.metrics_text().await;
    assert!(m.contains("\nloxilb_lb_rules 2\n"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_state_file_is_moved_aside_and_the_daemon_still_starts() {
    let state = tempfile::tempdir().expect("tmp");
    std::fs::write(
        state.path().join("rules.json"),
        b"{\"version\":1,\"rules\":[{broken",
    )
    .expect("write");
    let opts = DaemonOpts {
        state_dir: Some(state.path().to_path_buf()),
        ..Default::default()
    };
    let d = Daemon::start(opts).await;
    assert!(lb_attr(&d.rules().await).is_empty());
    let aside: Vec<String> = std::fs::read_dir(state.path())
        .expect("read dir")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.starts_with("rules.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1, "the corrupt file is kept for inspection");
    assert!(d.log_text().contains("corrupt"), "{}", d.log_text());
    // The store works again and writes a fresh file.
    assert_eq!(d.post_rule(&rule(free_port())).await.0, 200);
    let text = std::fs::read_to_string(state.path().join("rules.json")).expect("new state file");
    assert!(text.contains("\"externalIP\": \"127.0.0.1\""), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_pass_promtool_and_count_rules_and_api_requests() {
    let d = Daemon::start_default().await;
    let before = d.metrics_text().await;
    assert!(before.contains("\nloxilb_lb_rules 0\n"), "{before}");
    let ok = r#"loxilb_api_requests_total{method="POST",route="/netlox/v1/config/loadbalancer",code="200"}"#;
    let bad = r#"loxilb_api_requests_total{method="POST",route="/netlox/v1/config/loadbalancer",code="400"}"#;
    assert_eq!(d.post_rule(&rule(free_port())).await.0, 200);
    assert_eq!(
        d.post_rule(&with_service(rule(free_port()), "kv_block_size", json!(1)))
            .await
            .0,
        400
    );
    let after = d.metrics_text().await;
    assert!(after.contains("\nloxilb_lb_rules 1\n"), "{after}");
    assert_eq!(counter(&after, ok) - counter(&before, ok), 1.0, "{after}");
    assert_eq!(counter(&after, bad) - counter(&before, bad), 1.0, "{after}");
    assert!(
        !after.contains("# EOF"),
        "the text format 0.0.4 is the default"
    );
    loxi_tests::harness::promtool_check(&after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_environment_value_is_logged_once_naming_variable_value_and_default() {
    let opts = DaemonOpts::default()
        .env("LOXILB_KV_LB_MODE", "fastest")
        .env("LOXILB_KV_MAX_BLOCKS", "12");
    let d = Daemon::start(opts).await;
    let log = d.log_text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("LOXILB_KV_LB_MODE"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains("WARN")
            && lines[0].contains("fastest")
            && lines[0].contains("using hard"),
        "{log}"
    );
    assert!(
        log.contains("LOXILB_KV_MAX_BLOCKS=\"12\"") && log.contains("using 1000000"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_route_is_a_json_404() {
    let d = Daemon::start_default().await;
    let (status, text) = d.get("/netlox/v1/config/nothing").await.expect("get");
    assert_eq!(status, 404);
    let body: Value = serde_json::from_str(&text).expect("json body");
    assert_eq!(body["code"], json!(404));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_method_a_route_does_not_serve_is_a_json_405() {
    let d = Daemon::start_default().await;
    let (status, text) = d
        .request("PUT", "/netlox/v1/config/loadbalancer", Some("{}"))
        .await
        .expect("put");
    assert_eq!(status, 405);
    let body: Value = serde_json::from_str(&text).expect("json body");
    assert_eq!(body["code"], json!(405));
    assert_eq!(
        body["message"],
        json!("method PUT is not allowed on /netlox/v1/config/loadbalancer")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_format_follows_the_accept_header() {
    let d = Daemon::start_default().await;
    let (status, headers, text) = d
        .request_with("GET", "/netlox/v1/metrics", &[], None)
        .await
        .expect("get");
    assert_eq!(status, 200);
    assert_eq!(
        headers["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    assert!(
        text.contains("# TYPE loxilb_api_requests_total counter"),
        "{text}"
    );
    let accept = [(
        "accept",
        "application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
    )];
    let (status, headers, text) = d
        .request_with("GET", "/netlox/v1/metrics", &accept, None)
        .await
        .expect("get");
    assert_eq!(status, 200);
    assert!(
        headers["content-type"]
            .to_str()
            .expect("ascii")
            .starts_with("application/openmetrics-text")
    );
    assert!(
        text.contains("# TYPE loxilb_api_requests counter") && text.ends_with("# EOF\n"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_file_that_cannot_be_written_is_a_500_with_the_reason_and_nothing_changes() {
    let tmp = tempfile::tempdir().expect("tmp");
    let state = tmp.path().join("state");
    let d = Daemon::start(DaemonOpts {
        state_dir: Some(state.clone()),
        ..Default::default()
    })
    .await;
    std::fs::remove_dir_all(&state).expect("pull the state dir away");
    let (status, body) = d.post_rule(&rule(free_port())).await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(body["code"], json!(500));
    let msg = body["message"].as_str().expect("message");
    assert!(
        msg.starts_with("persisting rules failed") && msg.contains("rules.json"),
        "{msg}"
    );
    assert!(
        lb_attr(&d.rules().await).is_empty(),
        "an unpersisted rule is not applied"
    );
}

/// Polls `path` until `done` holds for its JSON body (at most 5 s), returning the last body.
async fn poll_json(d: &Daemon, path: &str, done: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..100 {
        let (status, body) = d.get(path).await.expect("GET");
        assert_eq!(status, 200, "{path}: {body}");
        last = loxi_tests::harness::parse_json(&body);
        if done(&last) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_by_key_its_status_and_its_stats_answer_as_loxilb() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = Daemon::start_default().await;
    let backend = loxi_tests::backend::Backend::start("a").await;
    let port = free_port();
    let pool = |model: &str| {
        json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                                 "mode": 4, "sel": 0, "model_name": model},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": backend.port(), "weight": 1}]
        })
    };
    assert_eq!(d.post_rule(&pool("")).await.0, 200);
    let key = format!(
        "/netlox/v1/config/loadbalancer/externalipaddress/127.0.0.1/port/{port}/protocol/tcp"
    );

    // Served but no client yet: every field is zero, so omitted.
    let before = poll_json(&d, &format!("{key}/stats"), |v| v == &json!({})).await;
    assert_eq!(before, json!({}));

    // One client connection: exactly its request bytes in, its response bytes out.
    let req =
        format!("GET /stats-probe HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).await.expect("read");
    assert!(
        resp.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&resp)
    );
    drop(s);
    let stats = poll_json(&d, &format!("{key}/stats"), |v| {
        v.get("activeConnections").is_none()
    })
    .await;
    assert_eq!(
        stats,
        json!({"bytesIn": req.len(), "bytesOut": resp.len(), "totalConnections": 1})
    );

    // By key: the rule as GET .../all shows it.
    let (status, body) = d.get(&key).await.expect("GET by key");
    assert_eq!(status, 200, "{body}");
    let one = loxi_tests::harness::parse_json(&body);
    assert_eq!(one, lb_attr(&d.rules().await)[0]);

    // Status: every endpoint tracked and up; lastUpdated stable while nothing changes.
    let (status, body) = d.get(&format!("{key}/status")).await.expect("GET status");
    assert_eq!(status, 200, "{body}");
    let st = loxi_tests::harness::parse_json(&body);
    assert_eq!(st["adminStateUp"], json!(true));
    assert_eq!(st["operatingStatus"], json!("ONLINE"));
    let t1 = st["lastUpdated"].as_str().expect("lastUpdated").to_string();
    assert_eq!(t1.len(), "2026-12-02T01:30:00Z".len(), "{t1}");
    assert!(
        t1.ends_with('Z') && t1.as_bytes()[10] == b'T',
        "RFC 3339 UTC: {t1}"
    );
    assert_eq!(d.post_rule(&pool("")).await.0, 200, "unchanged re-POST");
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let again = parse(&d, &format!("{key}/status")).await;
    assert_eq!(
        again["lastUpdated"],
        json!(t1),
        "an unchanged rule keeps its time"
    );
    let mut heavier = pool("");
    heavier["endpoints"][0]["weight"] = json!(3);
    assert_eq!(d.post_rule(&heavier).await.0, 200);
    let t2 = parse(&d, &format!("{key}/status")).await["lastUpdated"]
        .as_str()
        .expect("lastUpdated")
        .to_string();
    assert!(t2 > t1, "an update moves lastUpdated: {t1} -> {t2}");

    // A second model pool on the address: the bare key is ambiguous (409 naming both),
    // `model_name` selects; stats stay per address.
    assert_eq!(d.post_rule(&pool("m2")).await.0, 200);
    let (status, body) = d.get(&key).await.expect("GET by key");
    assert_eq!(status, 409, "{body}");
    let ids: Vec<String> = lb_attr(&d.rules().await)
        .iter()
        .map(|r| {
            r["serviceArguments"]["id"]
                .as_str()
                .expect("id")
                .to_string()
        })
        .collect();
    assert!(
        ids.iter().all(|id| body.contains(id.as_str())),
        "{body} names {ids:?}"
    );
    let m2 = parse(&d, &format!("{key}?model_name=m2")).await;
    assert_eq!(m2["serviceArguments"]["model_name"], json!("m2"));
    let plain = parse(&d, &format!("{key}?model_name=")).await;
    assert!(
        plain["serviceArguments"].get("model_name").is_none(),
        "{plain}"
    );
    assert_eq!(
        parse(&d, &format!("{key}/status?model_name=m2")).await["operatingStatus"],
        json!("ONLINE")
    );
    assert_eq!(
        parse(&d, &format!("{key}/stats")).await["totalConnections"],
        json!(1)
    );

    // Errors: unknown address 404, bad port 400, unknown query parameter 400.
    let other = free_port();
    let (status, _) = d
        .get(&format!("/netlox/v1/config/loadbalancer/externalipaddress/127.0.0.1/port/{other}/protocol/tcp/stats"))
        .await
        .expect("GET");
    assert_eq!(status, 404);
    let (status, body) = d
        .get(
            "/netlox/v1/config/loadbalancer/externalipaddress/127.0.0.1/port/x/protocol/tcp/status",
        )
        .await
        .expect("GET");
    assert_eq!(status, 400, "{body}");
    let (status, body) = d.get(&format!("{key}?bgp=true")).await.expect("GET");
    assert_eq!(status, 400, "{body}");
}

async fn parse(d: &Daemon, path: &str) -> Value {
    let (status, body) = d.get(path).await.expect("GET");
    assert_eq!(status, 200, "{path}: {body}");
    loxi_tests::harness::parse_json(&body)
}
