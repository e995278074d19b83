//! The management plane's protection, against the real `loxilb` binary: content type, Origin,
//! Host (DNS rebinding),
//! bearer tokens (admin and read-only), HTTPS with a CA generated per test (`loxicmd
//! --protocol https --cacert`), and the warning for an exposed API without a token.

use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use loxi_tests::tls::TestPki;
use serde_json::{Value, json};

const RULES: &str = "/netlox/v1/config/loadbalancer";

fn rule(port: u16) -> Value {
    json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp", "mode": 4},
        "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8001}]
    })
}

fn rule_count(v: &Value) -> usize {
    v["lbAttr"].as_array().map_or(0, Vec::len)
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_plain_post_is_415_and_stores_nothing() {
    let d = Daemon::start_default().await;
    let body = rule(free_port()).to_string();
    // What a browser page can send cross-origin without a CORS preflight.
    let (status, _, text) = d
        .request_with(
            "POST",
            RULES,
            &[("content-type", "text/plain")],
            Some(body.as_str()),
        )
        .await
        .expect("POST");
    assert_eq!(status, 415, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON error body");
    assert_eq!(v["code"], json!(415));
    let (status, _, text) = d
        .request_with("POST", RULES, &[], Some(body.as_str()))
        .await
        .expect("POST");
    assert_eq!(status, 415, "no content type at all: {text}");
    assert_eq!(rule_count(&d.rules().await), 0, "nothing was stored");
    // A method no route serves is 405 (LoxiLB's JSON error), whatever its content type (the
    // KV views, merged into the same router, alike), and an unknown path 404: the content-type
    // check runs on served routes only.
    for (method, path, code) in [
        ("PATCH", RULES, 405),
        ("POST", "/netlox/v1/config/ai/kv/inventory", 405),
        ("POST", "/netlox/v1/config/nothing", 404),
    ] {
        let (status, _, text) = d
            .request_with(method, path, &[], Some(body.as_str()))
            .await
            .expect("answered");
        assert_eq!(status, code, "{method} {path}: {text}");
        let v: Value = serde_json::from_str(&text).expect("JSON error body");
        assert_eq!(v["code"], json!(code), "{method} {path}");
    }
    let (status, _, text) = d
        .request_with(
            "POST",
            RULES,
            &[("content-type", "application/json; charset=utf-8")],
            Some(body.as_str()),
        )
        .await
        .expect("POST");
    assert_eq!(status, 200, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_origin_is_refused_and_the_apis_own_origin_is_not() {
    let d = Daemon::start_default().await;
    let json_ct = ("content-type", "application/json");
    let body = rule(free_port()).to_string();
    let (status, _, text) = d
        .request_with(
            "POST",
            RULES,
            &[json_ct, ("origin", "http://attacker.example")],
            Some(body.as_str()),
        )
        .await
        .expect("POST");
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("attacker.example"), "{text}");
    // DNS rebinding: the attacker's name resolving to us carries a matching Host.
    let host = format!("attacker.example:{}", d.api_port());
    let origin = format!("http://{host}");
    let (status, _, text) = d
        .request_with(
            "POST",
            RULES,
            &[
                json_ct,
                ("origin", origin.as_str()),
                ("host", host.as_str()),
            ],
            Some(body.as_str()),
        )
        .await
        .expect("POST");
    assert_eq!(status, 403, "rebinding: {text}");
    let (status, _, text) = d
        .request_with(
            "DELETE",
            &format!("{RULES}/externalipaddress/127.0.0.1/port/80/protocol/tcp"),
            &[("origin", "http://attacker.example")],
            None,
        )
        .await
        .expect("DELETE");
    assert_eq!(status, 403, "{text}");
    assert_eq!(rule_count(&d.rules().await), 0);
    let own = format!("http://127.0.0.1:{}", d.api_port());
    let (status, _, text) = d
        .request_with(
            "POST",
            RULES,
            &[json_ct, ("origin", own.as_str())],
            Some(body.as_str()),
        )
        .await
        .expect("POST");
    assert_eq!(status, 200, "the API's own origin: {text}");
    assert_eq!(rule_count(&d.rules().await), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenless_api_refuses_dns_names_it_was_not_given() {
    let d = Daemon::start(DaemonOpts {
        args: vec!["--api-allowed-host".into(), "lb.internal.test".into()],
        ..DaemonOpts::default()
    })
    .await;
    let all = "/netlox/v1/config/loadbalancer/all";
    // A rebound page's same-origin GET carries no Origin, only its own name as Host.
    let rebound = format!("rebound.attacker.example:{}", d.api_port());
    let (status, _, text) = d
        .request_with("GET", all, &[("host", rebound.as_str())], None)
        .await
        .expect("GET");
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("--api-allowed-host"), "{text}");
    let listed = format!("LB.internal.test:{}", d.api_port());
    let (status, _, text) = d
        .request_with("GET", all, &[("host", listed.as_str())], None)
        .await
        .expect("GET");
    assert_eq!(status, 200, "listed name: {text}");
    let (status, _, text) = d
        .request_with("GET", all, &[("host", "localhost")], None)
        .await
        .expect("GET");
    assert_eq!(status, 200, "localhost: {text}");
    assert!(
        !d.log_text().contains("--api-allowed-host has no effect"),
        "without a token the flag works: no warning"
    );
}

/// The Host check reads the host a request addressed: an HTTP/1 absolute-form target's
/// authority, not a `Host` header that names us beside it (it was answered 200), and a request
/// with two `Host` headers is refused 400 (the first one was read). Raw HTTP/1.1 on the socket,
/// as no client library sends either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_check_reads_an_absolute_targets_authority_and_refuses_two_host_headers() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = Daemon::start_default().await;
    let port = d.api_port();
    let raw = |head: String| async move {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        s.write_all(head.as_bytes()).await.expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    };
    let all = "/netlox/v1/config/loadbalancer/all";
    let ours = format!("127.0.0.1:{port}");
    let answer = raw(format!(
        "GET http://rebound.attacker.example:{port}{all} HTTP/1.1\r\nHost: {ours}\r\n\
         Connection: close\r\n\r\n"
    ))
    .await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.contains("rebound.attacker.example"), "{answer}");
    // The same absolute form naming us is answered.
    let answer = raw(format!(
        "GET http://{ours}{all} HTTP/1.1\r\nHost: {ours}\r\nConnection: close\r\n\r\n"
    ))
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let answer = raw(format!(
        "GET {all} HTTP/1.1\r\nHost: {ours}\r\nHost: rebound.attacker.example\r\n\
         Connection: close\r\n\r\n"
    ))
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("one Host header"), "{answer}");
}

const ALLOWED_HOST_INERT: &str = "--api-allowed-host has no effect: an API token is configured";
const READ_ONLY_ALONE: &str = "only a read-only API token is configured: every write (POST, PUT, \
                               DELETE) is refused, 401 without a token and 403 with the read-only \
                               one; set --api-token-file (or LOXI_API_TOKEN) for an admin token";

/// Token setups that leave part of the configuration without effect are warned about at start:
/// `--api-allowed-host` beside a token (any `Host` is answered once a token is the defence),
/// and a read-only token alone (nothing can write). Neither warning for the setups where
/// every flag works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_setups_that_leave_a_flag_inert_are_warned_at_start() {
    // An admin token (from the environment) and --api-allowed-host.
    let d = Daemon::start(DaemonOpts {
        env: vec![("LOXI_API_TOKEN".into(), "admin-7e2d4b9a1c".into())],
        args: vec!["--api-allowed-host".into(), "lb.internal.test".into()],
        api_token: Some("admin-7e2d4b9a1c".into()),
        ..DaemonOpts::default()
    })
    .await;
    let log = d.log_text();
    let line = log
        .lines()
        .find(|l| l.contains(ALLOWED_HOST_INERT))
        .unwrap_or_else(|| panic!("no --api-allowed-host warning:\n{log}"));
    assert!(
        line.contains("WARN")
            && line.contains("lb.internal.test")
            && line.contains("drop --api-allowed-host"),
        "{line}"
    );
    assert!(!log.contains(READ_ONLY_ALONE), "{log}");
    // What the warning says: a DNS name not listed is answered, with the token.
    let (status, _, text) = d
        .request_with(
            "GET",
            "/netlox/v1/config/loadbalancer/all",
            &[("host", "other.example.test")],
            None,
        )
        .await
        .expect("GET");
    assert_eq!(status, 200, "{text}");
    drop(d);

    // A read-only token alone (from its file): every write is refused, and the log says so.
    let dir = tempfile::tempdir().expect("tmp");
    let read_file = dir.path().join("read-token");
    std::fs::write(&read_file, "reader-1a2b3c4d5e\n").expect("write");
    let mut d = Daemon::start(DaemonOpts {
        args: vec![
            "--api-read-token-file".into(),
            read_file.display().to_string(),
        ],
        api_token: Some("reader-1a2b3c4d5e".into()),
        ..DaemonOpts::default()
    })
    .await;
    let log = d.log_text();
    let line = log
        .lines()
        .find(|l| l.contains(READ_ONLY_ALONE))
        .unwrap_or_else(|| panic!("no read-only warning:\n{log}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(!log.contains(ALLOWED_HOST_INERT), "{log}");
    let (status, v) = d.post_rule(&rule(free_port())).await;
    assert_eq!(status, 403, "{v}");
    d.set_api_token(None);
    let (status, v) = d.post_rule(&rule(free_port())).await;
    assert_eq!(status, 401, "{v}");
    drop(d);

    // Admin and read-only tokens, no --api-allowed-host: nothing to warn about.
    let d = Daemon::start(DaemonOpts {
        env: vec![
            ("LOXI_API_TOKEN".into(), "admin-7e2d4b9a1c".into()),
            ("LOXI_API_READ_TOKEN".into(), "reader-1a2b3c4d5e".into()),
        ],
        api_token: Some("admin-7e2d4b9a1c".into()),
        ..DaemonOpts::default()
    })
    .await;
    let log = d.log_text();
    assert!(
        !log.contains(ALLOWED_HOST_INERT) && !log.contains(READ_ONLY_ALONE),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tokens_configured_every_request_needs_one_and_read_tokens_cannot_write() {
    let dir = tempfile::tempdir().expect("tmp");
    let read_file = dir.path().join("read-token");
    std::fs::write(&read_file, "reader-9f3b1c7d2e\n").expect("write");
    let opts = DaemonOpts {
        env: vec![("LOXI_API_TOKEN".into(), "admin-4c8e0a6f5d".into())],
        args: vec![
            "--api-read-token-file".into(),
            read_file.display().to_string(),
        ],
        api_token: Some("admin-4c8e0a6f5d".into()),
        ..DaemonOpts::default()
    };
    let mut d = Daemon::start(opts).await;
    let body = rule(free_port());

    d.set_api_token(None);
    let (status, headers, text) = d
        .request_with("GET", "/netlox/v1/config/loadbalancer/all", &[], None)
        .await
        .expect("GET");
    assert_eq!(status, 401, "{text}");
    assert_eq!(headers["www-authenticate"], "Bearer realm=\"loxilb\"");
    let (status, _) = d.post_rule(&body).await;
    assert_eq!(status, 401);
    let (status, _) = d.get("/netlox/v1/metrics").await.expect("GET");
    assert_eq!(status, 401, "metrics need a token too");

    d.set_api_token(Some("admin-4c8e0a6f5"));
    let (status, _) = d.post_rule(&body).await;
    assert_eq!(status, 401, "a prefix of the admin token is not the token");

    d.set_api_token(Some("reader-9f3b1c7d2e"));
    assert_eq!(rule_count(&d.rules().await), 0, "read token can GET");
    let (status, v) = d.post_rule(&body).await;
    assert_eq!(status, 403, "read token cannot POST: {v}");
    assert!(
        v["message"].as_str().unwrap_or("").contains("read-only"),
        "{v}"
    );

    d.set_api_token(Some("admin-4c8e0a6f5d"));
    let (status, v) = d.post_rule(&body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(rule_count(&d.rules().await), 1);
    // kube-loxilb sends the bare token, no `Bearer ` (fixture i1), as LoxiLB accepts.
    d.set_api_token(None);
    let kube = rule(free_port()).to_string();
    let bare = [
        ("authorization", "admin-4c8e0a6f5d"),
        ("content-type", "application/json"),
    ];
    let (status, _, text) = d
        .request_with("POST", "/netlox/v1/config/loadbalancer", &bare, Some(&kube))
        .await
        .expect("POST");
    assert_eq!(status, 200, "{text}");
    let (status, _, text) = d
        .request_with(
            "POST",
            "/netlox/v1/config/loadbalancer",
            &[
                ("authorization", "reader-9f3b1c7d2e"),
                ("content-type", "application/json"),
            ],
            Some(&rule(free_port()).to_string()),
        )
        .await
        .expect("POST");
    assert_eq!(status, 403, "a bare read token is still read-only: {text}");
    d.set_api_token(Some("admin-4c8e0a6f5d"));
    assert_eq!(rule_count(&d.rules().await), 2);
    // With a token the browser cannot authenticate: any Host name is answered.
    let (status, _, text) = d
        .request_with(
            "GET",
            "/netlox/v1/config/loadbalancer/all",
            &[("host", "lb.anywhere.example")],
            None,
        )
        .await
        .expect("GET");
    assert_eq!(status, 200, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_api_serves_loxicmd_with_the_ca_and_refuses_a_client_without_it() {
    let pki = TestPki::generate().expect("certificates");
    let token_file = pki.dir().join("token");
    std::fs::write(&token_file, "tls-admin-1d2c3b4a\n").expect("token");
    let opts = DaemonOpts {
        args: [
            pki.daemon_args(),
            vec!["--api-token-file".into(), token_file.display().to_string()],
        ]
        .concat(),
        api_token: Some("tls-admin-1d2c3b4a".into()),
        tls_ca: Some(pki.ca()),
        ..DaemonOpts::default()
    };
    let d = Daemon::start(opts).await;
    assert_eq!(rule_count(&d.rules().await), 0, "HTTPS GET with the CA");

    let tcp = format!("--tcp={}:8000", free_port());
    let (ca, token) = (
        pki.ca().display().to_string(),
        token_file.display().to_string(),
    );
    let tls: [&str; 6] = [
        "--protocol",
        "https",
        "--cacert",
        &ca,
        "--token-file",
        &token,
    ];
    let with_tls =
        |rest: &[&str]| -> Vec<String> { tls.iter().chain(rest).map(|a| a.to_string()).collect() };
    let create = with_tls(&[
        "create",
        "lb",
        "127.0.0.1",
        &tcp,
        "--endpoints=127.0.0.5:1",
        "--mode=fullproxy",
    ]);
    let create: Vec<&str> = create.iter().map(String::as_str).collect();
    let out = d.loxicmd(&create);
    assert!(out.status.success(), "loxicmd over https: {}", stderr(&out));
    let get = with_tls(&["get", "lb", "-o", "json"]);
    let out = d.loxicmd(&get.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.status.success(), "{}", stderr(&out));
    let listed: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(rule_count(&listed), 1, "{listed}");

    // A client that does not trust the CA fails the handshake.
    let other = TestPki::generate().expect("another CA");
    let other_ca = other.ca().display().to_string();
    let out = d.loxicmd(&[
        "--protocol",
        "https",
        "--cacert",
        &other_ca,
        "--token-file",
        &token,
        "get",
        "lb",
    ]);
    assert_eq!(out.status.code(), Some(5), "transport failure → 5");
    assert!(
        stderr(&out).contains("TLS handshake: the peer's certificate ")
            && stderr(&out).contains("(loxicmd --cacert FILE)")
            && !stderr(&out).contains("backend_ca_file")
            && !stderr(&out).contains("BadSignature"),
        "{}",
        stderr(&out)
    );
    // Plain HTTP to the HTTPS port gets the 400 saying so (400 → 6), and what to add.
    let out = d.loxicmd(&["--token-file", &token, "get", "lb"]);
    assert_eq!(out.status.code(), Some(6), "{}", stderr(&out));
    assert_eq!(
        stderr(&out),
        format!(
            "Error: server returned 400: this port speaks HTTPS only (the API was started with \
             --api-tls-cert); the plain HTTP request was not served: use https://{} (add \
             --protocol https)\n",
            d.api_addr()
        )
    );
    // The right CA without the token: 401 → exit 3, with the server's message.
    let out = d.loxicmd(&["--protocol", "https", "--cacert", &ca, "get", "lb"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        stderr(&out).starts_with("Error: server returned 401: a bearer token is required"),
        "{}",
        stderr(&out)
    );
}

/// A plain-HTTP client on the HTTPS API port gets, as nginx answers (its 497), a plain
/// `400 Bad Request` with `Connection: close` saying the port speaks HTTPS and the URL to use,
/// then the close; not a TLS alert it would show as garbage. TLS clients are served as before,
/// and a client whose first byte is neither TLS nor a letter still meets the TLS handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_on_the_https_api_port_gets_a_400_naming_https() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pki = TestPki::generate().expect("certificates");
    let d = Daemon::start(DaemonOpts {
        args: pki.daemon_args(),
        tls_ca: Some(pki.ca()),
        ..DaemonOpts::default()
    })
    .await;
    let addr = d.api_addr();
    let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(format!("GET {RULES}/all HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .expect("send");
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        tcp.read_to_end(&mut answer),
    )
    .await
    .expect("closed within 5 s")
    .expect("read");
    let answer = String::from_utf8(answer).expect("text");
    let body = format!(
        "this port speaks HTTPS only (the API was started with --api-tls-cert); the plain HTTP \
         request was not served: use https://{addr}\n"
    );
    assert_eq!(
        answer,
        format!(
            "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    );
    // An HTTP client library (hyper) reads the same 400.
    let req = http::Request::get(format!("http://{addr}{RULES}/all"))
        .body(loxi_tests::http::full(""))
        .expect("request");
    let resp = loxi_tests::http::send(&loxi_tests::http::client(), req).await;
    assert_eq!((resp.status, resp.text.as_str()), (400, body.as_str()));
    assert_eq!(resp.header("connection"), Some("close"));
    // TLS clients are served as before.
    assert_eq!(rule_count(&d.rules().await), 0, "HTTPS GET with the CA");
    // Not a letter and not TLS: the TLS handshake answers (an alert), no HTTP text.
    let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(&[0x01, 0x02, 0x03, 0x04, 0x05])
        .await
        .expect("send");
    let mut got = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), tcp.read_to_end(&mut got))
        .await
        .expect("closed within 5 s");
    assert!(!got.starts_with(b"HTTP/"), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_bound_beyond_loopback_without_a_token_logs_a_security_warning() {
    let exposed = Daemon::start(DaemonOpts {
        api_bind_ip: Some("0.0.0.0".parse().expect("ip")),
        ..DaemonOpts::default()
    })
    .await;
    assert!(
        exposed.log_text().contains("SECURITY WARNING"),
        "{}",
        exposed.log_text()
    );
    let protected = Daemon::start(DaemonOpts {
        api_bind_ip: Some("0.0.0.0".parse().expect("ip")),
        env: vec![("LOXI_API_TOKEN".into(), "t0ken-for-exposed-api".into())],
        api_token: Some("t0ken-for-exposed-api".into()),
        ..DaemonOpts::default()
    })
    .await;
    assert!(!protected.log_text().contains("SECURITY WARNING"));
    let loopback = Daemon::start_default().await;
    assert!(!loopback.log_text().contains("SECURITY WARNING"));
}

/// A self-signed certificate for `localhost` valid from `from` to `until` (year, month, day),
/// written as `<dir>/api.pem` and `<dir>/api.key`; the daemon's `--api-tls-*` arguments.
fn api_cert(dir: &std::path::Path, from: (i32, u8, u8), until: (i32, u8, u8)) -> Vec<String> {
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("params");
    params.not_before = rcgen::date_time_ymd(from.0, from.1, from.2);
    params.not_after = rcgen::date_time_ymd(until.0, until.1, until.2);
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = params.self_signed(&key).expect("cert");
    let (c, k) = (dir.join("api.pem"), dir.join("api.key"));
    std::fs::write(&c, cert.pem()).expect("write cert");
    std::fs::write(&k, key.serialize_pem()).expect("write key");
    vec![
        "--api-tls-cert".into(),
        c.display().to_string(),
        "--api-tls-key".into(),
        k.display().to_string(),
    ]
}

/// `--api-tls-cert` with a certificate that expires within 14 days: served, with a warning at
/// start that names the file, the end date and what to do (the cert API warns alike); a
/// certificate valid for long gets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_certificate_expiring_within_14_days_is_served_with_a_warning() {
    const WARNING: &str = "the REST API's TLS certificate (--api-tls-cert) expires within 14 days";
    for (days, warned) in [(3, true), (400, false)] {
        let pki = TestPki::generate_expiring_in(days).expect("certificates");
        let d = Daemon::start(DaemonOpts {
            args: pki.daemon_args(),
            tls_ca: Some(pki.ca()),
            ..DaemonOpts::default()
        })
        .await;
        assert_eq!(rule_count(&d.rules().await), 0, "served over HTTPS");
        let log = d.log_text();
        assert!(
            log.contains(&format!("url=https://{}", d.api_addr())),
            "the listening line names https: {log}"
        );
        let line = log.lines().find(|l| l.contains(WARNING));
        if !warned {
            assert!(line.is_none(), "{days} days: {log}");
            continue;
        }
        let line = line.unwrap_or_else(|| panic!("no expiry warning:\n{log}"));
        let end = (time::OffsetDateTime::now_utc() + time::Duration::days(days)).date();
        assert!(
            line.contains("WARN")
                && line.contains(&pki.cert().display().to_string())
                && line.contains(&format!("not_after_utc={end}T"))
                // Whole days left: 3 within the certificate's second, 2 after.
                && (line.contains("days_left=2") || line.contains("days_left=3"))
                && line.contains("replace the file and restart loxilb"),
            "{line}"
        );
    }
}

/// `--api-tls-cert` with a certificate every client would refuse (expired, or not valid yet)
/// stops the daemon at start with the reason, as the cert API refuses such a certificate.
#[test]
fn an_expired_or_not_yet_valid_api_certificate_is_refused_at_start() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    for (from, until, why) in [
        (
            (2020, 1, 1),
            (2021, 1, 1),
            "the certificate expired at 2021-01-01T00:00:00Z (now ",
        ),
        (
            (2999, 1, 1),
            (3000, 1, 1),
            "the certificate is not valid before 2999-01-01T00:00:00Z (now ",
        ),
    ] {
        let mut args = vec!["--state-dir".to_string(), state.clone()];
        args.extend(api_cert(dir.path(), from, until));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, err) = loxi_tests::harness::failed_start(dir.path(), &args, &[]);
        assert_eq!(code, Some(1), "{err}");
        let want = format!(
            "Error: REST API TLS: certificate {} (--api-tls-cert): {why}",
            dir.path().join("api.pem").display()
        );
        assert!(err.starts_with(&want), "{err}");
    }
}

/// `--api-tls-key` holding two private keys, or an encrypted key, stops the daemon at start
/// saying so (rustls would take the first of two; an encrypted key read as "no private key"),
/// as the cert API refuses such a `keyPem`.
#[test]
fn an_api_key_file_with_two_keys_or_an_encrypted_key_is_refused_at_start() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    let key_file = dir.path().join("api.key");
    let encrypted = "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAECAwQFBgcI\n-----END ENCRYPTED \
                     PRIVATE KEY-----\n";
    for (second, why) in [
        (
            Some(rcgen::KeyPair::generate().expect("key").serialize_pem()),
            "the PEM holds 2 private keys; one is expected (the certificate's)",
        ),
        (
            None,
            "the key is encrypted (ENCRYPTED PRIVATE KEY); loxi needs an unencrypted key: \
             `openssl pkey -in KEY -out KEY.plain` writes one (it asks for the passphrase)",
        ),
    ] {
        let mut args = vec!["--state-dir".to_string(), state.clone()];
        args.extend(api_cert(dir.path(), (2020, 1, 1), (2999, 1, 1)));
        let own = std::fs::read_to_string(&key_file).expect("the key");
        let text = match second {
            Some(other) => format!("{own}{other}"),
            None => encrypted.to_string(),
        };
        std::fs::write(&key_file, text).expect("write key");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, err) = loxi_tests::harness::failed_start(dir.path(), &args, &[]);
        assert_eq!(code, Some(1), "{err}");
        let want = format!(
            "Error: REST API TLS: private key {} (--api-tls-key): {why}",
            key_file.display()
        );
        assert!(err.starts_with(&want), "{err}");
    }
}

/// `--api-allowed-origin` must be an origin and `--api-allowed-host` a name: anything else
/// would never match a request (silently inert), so it is a usage error.
#[test]
fn an_allowed_origin_or_host_that_cannot_match_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    for (flag, value, want) in [
        (
            "--api-allowed-origin",
            "not a url",
            "\"not a url\" is not an origin (no scheme://): give scheme://host[:port]",
        ),
        (
            "--api-allowed-origin",
            "https://lb.example.com/ui",
            "is not an origin (no host, or a path",
        ),
        ("--api-allowed-host", "", "the name is empty"),
        (
            "--api-allowed-host",
            "lb.example.com:11111",
            "\"lb.example.com:11111\" is not a DNS name",
        ),
    ] {
        let (code, err) = loxi_tests::harness::failed_start(
            dir.path(),
            &["--state-dir", &state, flag, value],
            &[],
        );
        assert_eq!(code, Some(2), "{flag} {value:?}: {err}");
        assert!(err.contains(&format!("for '{flag} ")), "{err}");
        assert!(err.contains(want), "{flag} {value:?}: {err}");
    }
}

/// `curl -sS --max-time 10 ARGS -w '\n%{http_version} %{http_code}'`: exit code, stdout,
/// stderr.
fn curl(args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .args(args)
        .args(["-w", "\n%{http_version} %{http_code}"])
        .output()
        .expect("curl runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr(&out),
    )
}

/// An HTTPS request to `addr` over TLS with no ALPN at all, spoken as HTTP/2 (a
/// prior-knowledge client: TLS, then the HTTP/2 preface); the answer's status and body.
async fn h2_over_tls_without_alpn(
    addr: std::net::SocketAddr,
    ca: &std::path::Path,
    path: &str,
) -> Result<(u16, String), String> {
    use http_body_util::BodyExt;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(ca).expect("CA file") {
        roots.add(c.expect("CA")).expect("root");
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(
            rustls::pki_types::ServerName::IpAddress(addr.ip().into()),
            tcp,
        )
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .map_err(|e| format!("h2 handshake: {e}"))?;
    #[allow(
        clippy::disallowed_methods,
        reason = "the client connection's driver; ends with the connection"
    )]
    tokio::spawn(conn);
    let req = http::Request::get(format!("https://{addr}{path}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    let resp = tokio::time::timeout(std::time::Duration::from_secs(10), send.send_request(req))
        .await
        .map_err(|_| "no answer within 10 s".to_string())?
        .map_err(|e| format!("h2 request: {e}"))?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// HTTP/2 clients of the REST API, with curl and a real TLS handshake: prior knowledge (h2c) on
/// the plain API, ALPN `h2`, `--http2-prior-knowledge` and an HTTP/2 client that offers no ALPN
/// on the HTTPS API are answered as HTTP/1.1 clients are (the API spoke HTTP/1.1 only: h2c got
/// its connection closed, h2 over TLS without ALPN an empty reply). An HTTP/2 request's
/// `:authority` is its Host for the DNS-rebinding check. h2c sent to the HTTPS port gets a
/// GOAWAY saying to use https (it got an empty reply).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_answered_on_the_plain_and_the_https_api() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let plain = Daemon::start_default().await;
    let port = plain.api_port();
    let url = format!("http://127.0.0.1:{port}{RULES}/all");
    let (code, out, err) = curl(&["--http2-prior-knowledge", &url]);
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "{\"lbAttr\":[]}\n\n2 200"),
        "{err}"
    );
    // A write over h2c: stored, then listed.
    let body = rule(free_port()).to_string();
    let create = format!("http://127.0.0.1:{port}{RULES}");
    let (code, out, err) = curl(&[
        "--http2-prior-knowledge",
        "-H",
        "content-type: application/json",
        "-d",
        &body,
        &create,
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("Success") && out.ends_with("\n2 200"), "{out}");
    assert_eq!(rule_count(&plain.rules().await), 1);
    // A rebound DNS name as the :authority is refused as it is as the Host.
    let rebound = format!("rebound.attacker.example:{port}:127.0.0.1");
    let evil = format!("http://rebound.attacker.example:{port}{RULES}/all");
    let (code, out, err) = curl(&["--http2-prior-knowledge", "--resolve", &rebound, &evil]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("--api-allowed-host") && out.ends_with("\n2 403"),
        "{out}"
    );

    let pki = TestPki::generate().expect("certificates");
    let https = Daemon::start(DaemonOpts {
        args: pki.daemon_args(),
        tls_ca: Some(pki.ca()),
        ..DaemonOpts::default()
    })
    .await;
    let addr = https.api_addr();
    let ca = pki.ca().display().to_string();
    let url = format!("https://{addr}{RULES}/all");
    for flag in ["--http2", "--http2-prior-knowledge", "--http1.1"] {
        let (code, out, err) = curl(&[flag, "--cacert", &ca, &url]);
        let version = if flag == "--http1.1" { "1.1" } else { "2" };
        assert_eq!(
            (code, out.as_str()),
            (
                Some(0),
                format!("{{\"lbAttr\":[]}}\n\n{version} 200").as_str()
            ),
            "{flag}: {err}"
        );
    }
    assert_eq!(
        h2_over_tls_without_alpn(addr, &pki.ca(), &format!("{RULES}/all")).await,
        Ok((200, "{\"lbAttr\":[]}\n".to_string()))
    );
    // h2c to the HTTPS port: curl fails, but not with an empty reply...
    let (code, _, err) = curl(&[
        "--http2-prior-knowledge",
        &format!("http://{addr}{RULES}/all"),
    ]);
    assert_ne!(code, Some(0));
    assert!(!err.contains("Empty reply"), "{err}");
    // ... it got the server's SETTINGS and a GOAWAY whose debug data says what to do.
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .expect("write");
    let mut got = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut got))
        .await
        .expect("answered and closed within 5 s")
        .expect("read");
    let goaway = got
        .get(9..)
        .filter(|_| got.starts_with(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]))
        .unwrap_or_else(|| panic!("no SETTINGS first: {got:?}"));
    assert_eq!(goaway.get(3), Some(&0x7), "GOAWAY: {got:?}");
    assert_eq!(
        String::from_utf8_lossy(&goaway[9 + 8..]),
        format!(
            "this port speaks HTTPS only (the API was started with --api-tls-cert); the plain \
             HTTP/2 (h2c) request was not served: use https://{addr}"
        )
    );
}

/// A token given both by its file flag and by its variable would have both accepted (an old
/// token in the environment would outlive a rotation of the file): a usage error naming both
/// sources, exit 2, for the admin and the read-only token.
#[test]
fn a_token_given_by_file_and_by_environment_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    let file = dir.path().join("token");
    std::fs::write(&file, "from-the-file\n").expect("write");
    let file = file.display().to_string();
    for (flag, env) in [
        ("--api-token-file", "LOXI_API_TOKEN"),
        ("--api-read-token-file", "LOXI_API_READ_TOKEN"),
    ] {
        let (code, err) = loxi_tests::harness::failed_start(
            dir.path(),
            &["--state-dir", &state, flag, &file],
            &[(env, "from-the-environment")],
        );
        assert_eq!(code, Some(2), "{flag} + {env}: {err}");
        assert!(
            err.contains(&format!(
                "given twice, by {flag} {file} and by the environment variable {env}"
            )) && err.contains(&format!("unset {env}, or drop {flag}")),
            "{flag} + {env}: {err}"
        );
    }
    // The same token both ways (the image's health check reads the variable) is one token:
    // the daemon starts.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut d = Daemon::start(DaemonOpts {
            args: vec!["--api-token-file".into(), file.clone()],
            env: vec![("LOXI_API_TOKEN".into(), "from-the-file".into())],
            api_token: Some("from-the-file".into()),
            ..DaemonOpts::default()
        })
        .await;
        d.stop().await;
    });
}

/// `--api-allowed-host` with an IP address (or `localhost`) would have no effect (they always
/// pass the Host check): a usage error saying so, exit 2.
#[test]
fn an_allowed_host_that_is_an_ip_address_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state").display().to_string();
    for value in ["10.0.0.1", "::1", "[fd00::1]", "localhost"] {
        let (code, err) = loxi_tests::harness::failed_start(
            dir.path(),
            &["--state-dir", &state, "--api-allowed-host", value],
            &[],
        );
        assert_eq!(code, Some(2), "{value}: {err}");
        assert!(
            err.contains(&format!(
                "{value:?} is an IP address or localhost, which always pass the API's Host check"
            )) && err.contains("--api-allowed-host is for DNS names"),
            "{value}: {err}"
        );
    }
}
