//! TLS termination in the fullproxy (`security: 1`) and LoxiLB's cert API, against the real
//! daemon with real handshakes (rustls client) and certificates generated here (rcgen): SNI
//! picks the certificate of each rule's host on one port, refused certificates, rotation
//! under an open stream, HTTP/2 (ALPN) and HTTP/1.1 reaching the same endpoint, persistence.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, free_port, parse_json};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio_rustls::client::TlsStream;

/// A test CA that signs leaf certificates.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

/// A leaf: PEM text and its DER (to compare with what the server presented).
struct Leaf {
    cert_pem: String,
    key_pem: String,
    der: Vec<u8>,
}

impl Ca {
    fn new() -> Self {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(DnType::CommonName, "loxi tls test CA");
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = p.self_signed(&key).expect("ca");
        Self { cert, key }
    }

    fn leaf(&self, names: &[&str]) -> Leaf {
        self.leaf_until(names, None)
    }

    fn leaf_until(&self, names: &[&str], not_after: Option<(i32, u8, u8)>) -> Leaf {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("params");
        if let Some((y, m, d)) = not_after {
            p.not_before = rcgen::date_time_ymd(y - 1, m, d);
            p.not_after = rcgen::date_time_ymd(y, m, d);
        }
        let cert = p.signed_by(&key, &self.cert, &self.key).expect("leaf");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        }
    }

    /// A leaf whose subjectAltName is `sans` as given (a DNS name spelled like an IP address
    /// stays a DNS name).
    fn leaf_sans(&self, sans: Vec<rcgen::SanType>) -> Leaf {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::default();
        p.subject_alt_names = sans;
        let cert = p.signed_by(&key, &self.cert, &self.key).expect("leaf");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        }
    }

    /// A leaf valid from a day ago until `secs` seconds from now.
    fn leaf_expiring_in(&self, names: &[&str], secs: u64) -> Leaf {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("params");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock");
        let epoch = rcgen::date_time_ymd(1970, 1, 1);
        p.not_before = epoch + (now - Duration::from_secs(86_400));
        p.not_after = epoch + (now + Duration::from_secs(secs));
        let cert = p.signed_by(&key, &self.cert, &self.key).expect("leaf");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        }
    }

    fn client_config(&self, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.cert.der().clone()).expect("root");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(cfg)
    }
}

fn cert_body(id: Option<&str>, leaf: &Leaf) -> String {
    let mut b = json!({"certPem": leaf.cert_pem, "keyPem": leaf.key_pem});
    if let Some(id) = id {
        b["certId"] = json!(id);
    }
    b.to_string()
}

async fn post_cert(d: &Daemon, id: Option<&str>, leaf: &Leaf) -> (u16, Value) {
    let (s, t) = d
        .request("POST", "/netlox/v1/config/cert", Some(&cert_body(id, leaf)))
        .await
        .expect("POST cert");
    (s, parse_json(&t))
}

fn tls_rule(port: u16, host: &str, backends: &[&Backend], sel: u8) -> Value {
    let eps: Vec<Value> = backends
        .iter()
        .map(|b| json!({"endpointIP": "127.0.0.1", "targetPort": b.port(), "weight": 1}))
        .collect();
    json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                             "mode": 4, "sel": sel, "security": 1, "host": host},
        "endpoints": eps
    })
}

/// A TLS connection to `port` with SNI `sni` (None: the IP, so no SNI is sent).
async fn connect(
    ca: &Ca,
    port: u16,
    sni: Option<&str>,
    alpn: &[&[u8]],
) -> std::io::Result<TlsStream<tokio::net::TcpStream>> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = match sni {
        Some(n) => ServerName::try_from(n.to_string()).expect("name"),
        None => ServerName::IpAddress(addr.ip().into()),
    };
    tokio_rustls::TlsConnector::from(ca.client_config(alpn))
        .connect(name, tcp)
        .await
}

fn presented(tls: &TlsStream<tokio::net::TcpStream>) -> Vec<u8> {
    let (_, conn) = tls.get_ref();
    conn.peer_certificates()
        .and_then(|c| c.first())
        .map(|c: &CertificateDer<'_>| c.as_ref().to_vec())
        .unwrap_or_default()
}

fn alpn(tls: &TlsStream<tokio::net::TcpStream>) -> Option<Vec<u8>> {
    tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec)
}

/// One request over `tls`, HTTP/2 when ALPN chose `h2`, else HTTP/1.1; `(status, endpoint
/// header, x-backend header, body)`.
async fn send(
    tls: TlsStream<tokio::net::TcpStream>,
    host: &str,
    body: &str,
) -> (u16, String, String, String) {
    send_to(tls, "POST", host, "/v1/completions", body).await
}

/// [`send`] with any method and path.
async fn send_to(
    tls: TlsStream<tokio::net::TcpStream>,
    method: &str,
    host: &str,
    path: &str,
    body: &str,
) -> (u16, String, String, String) {
    let h2 = alpn(&tls).as_deref() == Some(b"h2");
    let req = http::Request::builder()
        .method(method)
        .uri(format!("https://{host}{path}"))
        .header("host", host)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = if h2 {
        let (mut s, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .expect("h2 handshake");
        tokio::spawn(conn);
        s.send_request(req).await.expect("h2 response")
    } else {
        let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .expect("h1 handshake");
        tokio::spawn(conn);
        s.send_request(req).await.expect("h1 response")
    };
    let status = resp.status().as_u16();
    let h = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (ep, be) = (h("x-loxilb-endpoint"), h("x-backend"));
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, ep, be, String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test]
async fn sni_selects_each_hosts_certificate_and_h2_and_h1_reach_the_same_endpoint() {
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    let (a, b) = (ca.leaf(&["a.test"]), ca.leaf(&["*.b.test"]));
    assert_eq!(post_cert(&d, Some("a"), &a).await.0, 201);
    let (s, body) = post_cert(&d, None, &b).await;
    assert_eq!(s, 201, "{body}");
    assert_eq!(body["hostnames"], json!(["*.b.test"]));
    let (ba, bb, bc) = (
        Backend::start("A").await,
        Backend::start("B").await,
        Backend::start("C").await,
    );
    let port = free_port();
    let (s, r) = d.post_rule(&tls_rule(port, "a.test", &[&ba], 0)).await;
    assert_eq!(s, 200, "{r}");
    // chwbl over two endpoints: the prompt decides the endpoint.
    let (s, r) = d
        .post_rule(&tls_rule(port, "x.b.test", &[&bb, &bc], 8))
        .await;
    assert_eq!(s, 200, "{r}");

    let tls = connect(&ca, port, Some("a.test"), &[b"http/1.1"])
        .await
        .expect("a.test");
    assert_eq!(presented(&tls), a.der, "a.test gets certificate a");
    let (status, _, be, _) = send(tls, "a.test", r#"{"prompt":"hi"}"#).await;
    assert_eq!((status, be.as_str()), (200, "A"));

    let tls = connect(&ca, port, Some("x.b.test"), &[b"h2", b"http/1.1"])
        .await
        .expect("b");
    assert_eq!(
        presented(&tls),
        b.der,
        "x.b.test gets the wildcard certificate"
    );
    assert_eq!(alpn(&tls).as_deref(), Some(&b"h2"[..]));
    let mut picks = Vec::new();
    for (i, proto) in [&b"h2"[..], b"http/1.1"].iter().enumerate() {
        for prompt in ["the quick brown fox", "lorem ipsum dolor sit amet", "zzz"] {
            let tls = connect(&ca, port, Some("x.b.test"), &[proto])
                .await
                .expect("b");
            assert_eq!(alpn(&tls).as_deref(), Some(*proto));
            let body = json!({"model": "m", "prompt": prompt}).to_string();
            let (status, ep, be, text) = send(tls, "x.b.test", &body).await;
            assert_eq!(status, 200, "{text}");
            assert!(be == "B" || be == "C", "{be}");
            if i == 0 {
                picks.push(ep);
            } else {
                assert_eq!(
                    picks.remove(0),
                    ep,
                    "HTTP/1.1 picks what HTTP/2 picked for {prompt:?}"
                );
            }
        }
    }
    // curl (when present, with HTTP/2 support): --http2 and --http1.1 pick the same endpoint.
    if let Some(eps) = curl_endpoints(port, "x.b.test", r#"{"model":"m","prompt":"zzz"}"#).await {
        assert_eq!(
            eps.0, eps.1,
            "curl --http2 and --http1.1 reach the same endpoint"
        );
        assert!(!eps.0.is_empty());
    }
    // The backend is told the client spoke https.
    assert!(
        bb.requests()
            .iter()
            .chain(bc.requests().iter())
            .all(|r| r.header("x-forwarded-proto") == Some("https"))
    );

    // An unknown name with no default certificate is refused in the handshake.
    assert!(connect(&ca, port, Some("c.test"), &[]).await.is_err());
    assert!(
        connect(&ca, port, None, &[]).await.is_err(),
        "no SNI, no default"
    );
    // The server counts a refused handshake after the client already saw it fail: poll.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let text = d.metrics_text().await;
        let failures =
            loxi_tests::http::metric(&text, "loxilb_proxy_tls_handshake_failures_total", &[]);
        if failures >= 2.0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{text}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // With a default certificate, no SNI gets it.
    let def = ca.leaf(&["lb.test"]);
    assert_eq!(post_cert(&d, Some("default"), &def).await.0, 201);
    let tls = connect(&ca, port, None, &[]).await;
    // The client checks the name against the IP and refuses lb.test's certificate: the
    // server did present it, which is what is asserted.
    assert!(tls.is_err_and(|e| e.to_string().contains("certificate")));
    let tls = connect(&ca, port, Some("lb.test"), &[])
        .await
        .expect("default by name");
    assert_eq!(presented(&tls), def.der);
}

#[tokio::test]
async fn the_cert_api_refuses_bad_certificates_and_never_lists_keys() {
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    let expired = ca.leaf_until(&["old.test"], Some((2021, 1, 1)));
    let (s, body) = post_cert(&d, Some("old"), &expired).await;
    assert_eq!(s, 400, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("expired")),
        "{body}"
    );
    let mut mismatched = ca.leaf(&["m.test"]);
    mismatched.key_pem = ca.leaf(&["m.test"]).key_pem;
    let (s, body) = post_cert(&d, Some("m"), &mismatched).await;
    assert_eq!(s, 400, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("does not match")),
        "{body}"
    );
    let mut garbage = ca.leaf(&["g.test"]);
    garbage.cert_pem = "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n".into();
    assert_eq!(post_cert(&d, Some("g"), &garbage).await.0, 400);
    let mut nokey = ca.leaf(&["k.test"]);
    nokey.key_pem = String::new();
    let (s, body) = post_cert(&d, Some("k"), &nokey).await;
    assert_eq!(s, 400);
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("keyPem")),
        "{body}"
    );
    assert_eq!(
        post_cert(&d, Some("a/b"), &ca.leaf(&["x.test"])).await.0,
        400
    );
    // An empty id is refused as the id it is (an id was minted for it).
    let (s, body) = post_cert(&d, Some(""), &ca.leaf(&["e.test"])).await;
    assert_eq!(s, 400, "{body}");

    let good = ca.leaf(&["ok.test"]);
    assert_eq!(post_cert(&d, Some("ok"), &good).await.0, 201);
    assert_eq!(post_cert(&d, Some("ok"), &good).await.0, 409);
    let (s, t) = d.get("/netlox/v1/config/cert").await.expect("list");
    assert_eq!(s, 200);
    assert!(!t.contains("keyPem") && !t.contains("PRIVATE KEY"), "{t}");
    let list = parse_json(&t);
    assert_eq!(list["certAttr"][0]["certId"], "ok");
    assert_eq!(list["certAttr"][0]["hostnames"], json!(["ok.test"]));
    let (s, _) = d
        .request(
            "PUT",
            "/netlox/v1/config/cert/nope",
            Some(&cert_body(None, &good)),
        )
        .await
        .expect("put");
    assert_eq!(s, 404);
    let text = d.metrics_text().await;
    assert!(
        loxi_tests::http::metric(
            &text,
            "loxilb_tls_cert_expiry_timestamp_seconds",
            &["cert_id=\"ok\""]
        ) > 4e9,
        "rcgen's default end of validity (year 4096): {text}"
    );

    // Rules: a TLS rule needs a certificate; plain and TLS cannot share an address; security 2
    // is refused; a certificate a rule needs cannot be deleted.
    let be = Backend::start("A").await;
    let port = free_port();
    let (s, r) = d.post_rule(&tls_rule(port, "none.test", &[&be], 0)).await;
    assert_eq!(s, 400, "{r}");
    assert!(
        r["message"]
            .as_str()
            .is_some_and(|m| m.contains("certificate")),
        "{r}"
    );
    assert_eq!(
        d.post_rule(&tls_rule(port, "ok.test", &[&be], 0)).await.0,
        200
    );
    let mut plain = tls_rule(port, "", &[&be], 0);
    plain["serviceArguments"]["security"] = json!(0);
    let (s, r) = d.post_rule(&plain).await;
    assert_eq!(s, 400, "{r}");
    assert!(
        r["message"]
            .as_str()
            .is_some_and(|m| m.contains("cannot share")),
        "{r}"
    );
    let mut e2e = tls_rule(free_port(), "ok.test", &[&be], 0);
    e2e["serviceArguments"]["security"] = json!(2);
    e2e["serviceArguments"]["backend_ca_file"] = json!("/nonexistent/ca.pem");
    let (s, r) = d.post_rule(&e2e).await;
    assert_eq!(s, 400, "{r}");
    assert_eq!(r["field"], "serviceArguments.backend_ca_file", "{r}");
    // A relative path would be read from the daemon's working directory, which a restart may
    // change (the rule was accepted, then dropped at the next start): refused.
    e2e["serviceArguments"]["backend_ca_file"] = json!("pki/ca.pem");
    let (s, r) = d.post_rule(&e2e).await;
    assert_eq!(s, 400, "{r}");
    assert!(
        r["message"]
            .as_str()
            .is_some_and(|m| m.contains("pki/ca.pem: not an absolute path")),
        "{r}"
    );
    let mut named = tls_rule(free_port(), "ok.test", &[&be], 0);
    named["serviceArguments"]["backend_tls_server_name"] = json!("be.test");
    let (s, r) = d.post_rule(&named).await;
    assert_eq!(s, 400, "backend TLS fields need security 2: {r}");
    let mut mtls = tls_rule(free_port(), "ok.test", &[&be], 0);
    mtls["serviceArguments"]["mtls_frontend"] = json!(true);
    let (s, r) = d.post_rule(&mtls).await;
    assert_eq!(s, 400, "mTLS is refused: {r}");
    let (s, t) = d
        .request("DELETE", "/netlox/v1/config/cert/ok", None)
        .await
        .expect("delete");
    assert_eq!(s, 409, "{t}");
    // A rotation that would leave the rule without a certificate is refused too, and the
    // certificate stays as it was.
    let before = d.get("/netlox/v1/config/cert/ok").await.expect("get").1;
    let put = |leaf: &Leaf| cert_body(Some("ok"), leaf);
    let (s, t) = d
        .request(
            "PUT",
            "/netlox/v1/config/cert/ok",
            Some(&put(&ca.leaf(&["elsewhere.test"]))),
        )
        .await
        .expect("put");
    assert_eq!(s, 409, "{t}");
    let message = parse_json(&t)["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains(
            "(host \"ok.test\") would have no certificate whose names match its host; nothing \
             was changed"
        ),
        "{t}"
    );
    let after = d.get("/netlox/v1/config/cert/ok").await.expect("get").1;
    assert_eq!(before, after, "nothing was changed");
    let (s, t) = d
        .request(
            "PUT",
            "/netlox/v1/config/cert/ok",
            Some(&put(&ca.leaf(&["ok.test"]))),
        )
        .await
        .expect("put");
    assert_eq!(s, 200, "a rotation that keeps the host covered: {t}");
    // A certificate no rule depends on is deleted whatever the others cover.
    assert_eq!(
        post_cert(&d, Some("spare"), &ca.leaf(&["spare.test"]))
            .await
            .0,
        201
    );
    let (s, t) = d
        .request("DELETE", "/netlox/v1/config/cert/spare", None)
        .await
        .expect("delete");
    assert_eq!(s, 200, "{t}");
}

/// A daemon with a TLS listener (`security: 1`) for host `p.test` (certificate `p`, from the
/// returned CA) in front of backend `A`: the daemon, the CA, the backend and the port.
async fn p_test_listener() -> (Daemon, Ca, Backend, u16) {
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    assert_eq!(post_cert(&d, Some("p"), &ca.leaf(&["p.test"])).await.0, 201);
    let be = Backend::start("A").await;
    let port = free_port();
    assert_eq!(
        d.post_rule(&tls_rule(port, "p.test", &[&be], 0)).await.0,
        200
    );
    (d, ca, be, port)
}

/// Plain HTTP sent to a TLS port gets a 400 that says so (not a TLS alert a plain client
/// cannot read), counted as a failed handshake; TLS clients are served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_on_a_tls_port_is_told_to_use_https() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (d, ca, be, port) = p_test_listener().await;
    let mut plain = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let req = "POST /v1/completions HTTP/1.1\r\nHost: p.test\r\ncontent-length: 2\r\n\r\n{}";
    plain.write_all(req.as_bytes()).await.expect("write");
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), plain.read_to_string(&mut answer))
        .await
        .expect("answered and closed within 5 s")
        .expect("read");
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    let body = parse_json(answer.split_once("\r\n\r\n").map_or("", |(_, b)| b));
    assert_eq!(body["error"]["type"], "plain_http_on_tls_port", "{answer}");
    assert_eq!(be.request_count(), 0, "nothing was forwarded");
    // Counted once the server's lingering close ends (the client's close ends it).
    drop(plain);
    d.wait_metric("loxilb_proxy_tls_handshake_failures_total", &[], 1.0)
        .await;
    let tls = connect(&ca, port, Some("p.test"), &[b"http/1.1"])
        .await
        .expect("TLS still served");
    let (status, _, served_by, _) = send(tls, "p.test", r#"{"prompt":"hi"}"#).await;
    assert_eq!((status, served_by.as_str()), (200, "A"));
}

/// A request for another rule's host on a connection whose SNI named a rule host, and whose
/// certificate does not cover the request's host, is 421 `misdirected_request` (RFC 9110
/// §15.5.20), `GET /v1/models` included; one whose certificate covers it too (HTTP/2
/// connection reuse) is served, by the certificate that connection got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_a_host_the_connections_certificate_does_not_cover_is_421() {
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    assert_eq!(post_cert(&d, Some("a"), &ca.leaf(&["a.test"])).await.0, 201);
    assert_eq!(
        post_cert(&d, Some("w"), &ca.leaf(&["*.b.test"])).await.0,
        201
    );
    let bs = [
        Backend::start("A").await,
        Backend::start("X").await,
        Backend::start("Z").await,
    ];
    let port = free_port();
    for (host, be) in [
        ("a.test", &bs[0]),
        ("x.b.test", &bs[1]),
        ("z.b.test", &bs[2]),
    ] {
        assert_eq!(d.post_rule(&tls_rule(port, host, &[be], 0)).await.0, 200);
    }
    let body = r#"{"prompt":"hi"}"#;
    for alpn in [&b"http/1.1"[..], &b"h2"[..]] {
        let tls = connect(&ca, port, Some("a.test"), &[alpn])
            .await
            .expect("a");
        let (status, _, served, text) = send(tls, "x.b.test", body).await;
        assert_eq!(status, 421, "{text}");
        assert_eq!(parse_json(&text)["error"]["type"], "misdirected_request");
        assert_eq!(served, "", "nothing was forwarded");
        // The aggregated model list of another host is misdirected alike (it was answered).
        let tls = connect(&ca, port, Some("a.test"), &[alpn])
            .await
            .expect("a");
        let (status, _, _, text) = send_to(tls, "GET", "x.b.test", "/v1/models", "").await;
        assert_eq!(status, 421, "{text}");
        assert_eq!(parse_json(&text)["error"]["type"], "misdirected_request");
        let tls = connect(&ca, port, Some("x.b.test"), &[alpn])
            .await
            .expect("x");
        let (status, _, served, _) = send(tls, "z.b.test", body).await;
        assert_eq!(
            (status, served.as_str()),
            (200, "Z"),
            "*.b.test covers z.b.test"
        );
        let tls = connect(&ca, port, Some("a.test"), &[alpn])
            .await
            .expect("a");
        let (status, _, served, _) = send(tls, "a.test", body).await;
        assert_eq!((status, served.as_str()), (200, "A"));
    }
    assert_eq!(bs[1].request_count(), 0);

    // The check reads the certificate the connection got, not the store's current one: an
    // HTTP/2 connection for x.b.test (the wildcard, which covers z.b.test) stays allowed to
    // send z.b.test after a certificate naming x.b.test alone is added (which new handshakes
    // for x.b.test get); it was 421 from then on.
    let tls = connect(&ca, port, Some("x.b.test"), &[b"h2"])
        .await
        .expect("x");
    let (mut h2, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let z = || {
        http::Request::post("https://z.b.test/v1/completions")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("request")
    };
    let before = h2.send_request(z()).await.expect("response").status();
    let only_x = ca.leaf(&["x.b.test"]);
    assert_eq!(post_cert(&d, Some("0-x"), &only_x).await.0, 201);
    let fresh = connect(&ca, port, Some("x.b.test"), &[b"h2"])
        .await
        .expect("x again");
    assert_eq!(
        presented(&fresh),
        only_x.der,
        "new handshakes get the exact name"
    );
    let after = h2.send_request(z()).await.expect("response").status();
    assert_eq!((before.as_u16(), after.as_u16()), (200, 200));
    let (status, _, _, text) = send(fresh, "z.b.test", body).await;
    assert_eq!(
        status, 421,
        "the new connection's certificate does not cover it: {text}"
    );

    // A resumed TLS session sent no certificate: the one its client verified is unknown (the
    // store's current one was used, so a resumed x.b.test session was allowed z.b.test by
    // whatever certificate covered x.b.test now), so another host on it is 421.
    let cfg = ca.client_config(&[b"http/1.1"]);
    let open = async || {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        tokio_rustls::TlsConnector::from(cfg.clone())
            .connect(ServerName::try_from("x.b.test").expect("name"), tcp)
            .await
            .expect("tls")
    };
    let first = open().await;
    let (status, _, served, _) = send(first, "x.b.test", body).await;
    assert_eq!(
        (status, served.as_str()),
        (200, "X"),
        "a ticket was received"
    );
    let resumed = open().await;
    assert_eq!(
        resumed.get_ref().1.handshake_kind(),
        Some(rustls::HandshakeKind::Resumed)
    );
    let (status, _, _, text) = send(resumed, "z.b.test", body).await;
    assert_eq!(status, 421, "{text}");
}

#[tokio::test]
async fn rotation_keeps_an_open_stream_and_new_handshakes_get_the_new_certificate() {
    let mut d = Daemon::start_default().await;
    let ca = Ca::new();
    let (old, new) = (ca.leaf(&["r.test"]), ca.leaf(&["r.test"]));
    assert_eq!(post_cert(&d, Some("r"), &old).await.0, 201);
    let be = Backend::start("A").await;
    let port = free_port();
    assert_eq!(
        d.post_rule(&tls_rule(port, "r.test", &[&be], 0)).await.0,
        200
    );

    // An SSE stream over HTTP/2 (20 events, 100 ms apart) open across the rotation.
    let tls = connect(&ca, port, Some("r.test"), &[b"h2"])
        .await
        .expect("tls");
    assert_eq!(presented(&tls), old.der);
    let body = json!({"model": "m", "prompt": "p", "stream": true}).to_string();
    let stream = tokio::spawn(async move { send(tls, "r.test", &body).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (s, t) = d
        .request(
            "PUT",
            "/netlox/v1/config/cert/r",
            Some(&cert_body(None, &new)),
        )
        .await
        .expect("put");
    assert_eq!(s, 200, "{t}");
    let tls = connect(&ca, port, Some("r.test"), &[]).await.expect("tls");
    assert_eq!(
        presented(&tls),
        new.der,
        "a new handshake gets the rotated certificate"
    );
    let (status, _, _, text) = stream.await.expect("stream task");
    assert_eq!(status, 200);
    assert_eq!(text.matches("data: {").count(), 20, "{text}");
    assert!(
        text.contains("data: [DONE]"),
        "the open stream finished: {text}"
    );

    // Certificates survive a restart (and keep their key private).
    let file = d.state_dir().join("certs/r.json");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&file).expect("file").permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    d.restart().await;
    let tls = connect(&ca, port, Some("r.test"), &[])
        .await
        .expect("after restart");
    assert_eq!(presented(&tls), new.der);
    let (status, _, be_name, _) = send(tls, "r.test", r#"{"prompt":"x"}"#).await;
    assert_eq!((status, be_name.as_str()), (200, "A"));

    // A stored certificate that no longer loads is skipped at start; the TLS rule it covered
    // is then dropped and kept aside, as the API refuses a `security: 1` rule without one
    // (it was restored, failed every handshake and said ONLINE).
    d.stop().await;
    std::fs::write(&file, "{\"not\": \"a certificate\"}").expect("corrupt the stored cert");
    let dropped = restart_with_every_rule_dropped(
        &mut d,
        &[
            "dropping a restored rule",
            "no restored certificate covers host",
            "r.test",
        ],
    )
    .await;
    assert_eq!(dropped, 1);
    assert!(
        connect(&ca, port, Some("r.test"), &[]).await.is_err(),
        "nothing listens for the dropped rule"
    );
}

/// A stored certificate that no longer loads, with a `default` certificate beside it: the TLS
/// rule it covered is dropped at restart (before, it was kept and its handshakes got the
/// `default` certificate, which clients that verify refuse), as POST would refuse it now; the
/// `default` host's own rule stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_whose_certificate_no_longer_loads_is_dropped_despite_a_default_certificate() {
    let mut d = Daemon::start_default().await;
    let (_ca, _be, _port) = serve_then_corrupt_w(&mut d).await;
    d.restart().await;
    let listed = d.rules().await;
    assert_eq!(rule_hosts(&listed), ["default.test"], "{listed}");
    let log = d.log_text();
    assert!(
        log.lines().any(|l| l.contains("dropping a restored rule")
            && l.contains("w.test")
            && l.contains("stored certificates failed to load")
            && l.contains("w.json")),
        "{log}"
    );
}

/// As above, but a newer staged `default` certificate (`--cert-dir`) covers the rule's host:
/// the rule is kept, and its handshakes get the staged certificate (it was dropped: the check
/// at restore saw the stored certificates only, and the staged one is applied after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_a_newer_staged_default_covers_is_kept_when_its_certificate_no_longer_loads() {
    let staged = tempfile::tempdir().expect("tmp");
    let mut d = Daemon::start(loxi_tests::harness::DaemonOpts {
        args: vec!["--cert-dir".into(), staged.path().display().to_string()],
        ..Default::default()
    })
    .await;
    let (ca, _be, port) = serve_then_corrupt_w(&mut d).await;
    let both = ca.leaf(&["default.test", "w.test"]);
    stage_default(
        staged.path(),
        &both,
        std::time::SystemTime::now() + Duration::from_secs(5),
    );
    d.restart().await;
    let listed = d.rules().await;
    assert_eq!(
        rule_hosts(&listed),
        ["default.test", "w.test"],
        "{}",
        d.log_text()
    );
    let tls = connect(&ca, port, Some("w.test"), &[])
        .await
        .expect("w.test verifies against the staged default");
    assert_eq!(presented(&tls), both.der);
    let (status, _, be_name, _) = send(tls, "w.test", r#"{"prompt":"x"}"#).await;
    assert_eq!((status, be_name.as_str()), (200, "A"));
}

/// On `d`: certificates `default` (`default.test`) and `w` (`w.test`), a TLS rule for each
/// host on one port to backend `A`; then `d` stopped and `w`'s stored file corrupted. Returns
/// the CA, the backend (keep it alive) and the port.
async fn serve_then_corrupt_w(d: &mut Daemon) -> (Ca, Backend, u16) {
    let ca = Ca::new();
    assert_eq!(
        post_cert(d, Some("default"), &ca.leaf(&["default.test"]))
            .await
            .0,
        201
    );
    assert_eq!(post_cert(d, Some("w"), &ca.leaf(&["w.test"])).await.0, 201);
    let be = Backend::start("A").await;
    let port = free_port();
    for host in ["w.test", "default.test"] {
        let (s, r) = d.post_rule(&tls_rule(port, host, &[&be], 0)).await;
        assert_eq!(s, 200, "{r}");
    }
    d.stop().await;
    std::fs::write(
        d.state_dir().join("certs/w.json"),
        "{\"not\": \"a certificate\"}",
    )
    .expect("corrupt the stored cert");
    (ca, be, port)
}

/// The `serviceArguments.host` of every rule of a `GET .../all` answer, sorted.
fn rule_hosts(listed: &Value) -> Vec<&str> {
    let mut hosts: Vec<&str> = listed["lbAttr"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|r| r["serviceArguments"]["host"].as_str())
                .collect()
        })
        .unwrap_or_default();
    hosts.sort_unstable();
    hosts
}

#[tokio::test]
async fn an_h2_stream_reset_over_tls_cancels_the_upstream_request() {
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    assert_eq!(post_cert(&d, Some("c"), &ca.leaf(&["c.test"])).await.0, 201);
    let be = Backend::start("A").await;
    let port = free_port();
    assert_eq!(
        d.post_rule(&tls_rule(port, "c.test", &[&be], 0)).await.0,
        200
    );
    let tls = connect(&ca, port, Some("c.test"), &[b"h2"])
        .await
        .expect("tls");
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method("POST")
        .uri("https://c.test/v1/completions")
        .header("content-type", "application/json")
        .header("x-sse", "100:100")
        .body(Full::new(Bytes::from(
            r#"{"model":"m","prompt":"p","stream":true}"#,
        )))
        .expect("request");
    let resp = sender.send_request(req).await.expect("response");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = body.frame().await.expect("a frame").expect("data");
    assert!(first.data_ref().is_some_and(|d| d.starts_with(b"data: ")));
    // Dropping the body resets the stream (RST_STREAM CANCEL); the connection stays open.
    drop(body);
    assert!(
        be.wait_cancelled(1, Duration::from_secs(5)).await,
        "the backend saw the request cancelled"
    );
    assert_eq!(be.completed(), 0);
    // The connection still serves another stream.
    let req = http::Request::builder()
        .method("POST")
        .uri("https://c.test/v1/completions")
        .body(Full::new(Bytes::from(r#"{"prompt":"q"}"#)))
        .expect("request");
    assert_eq!(
        sender.send_request(req).await.expect("second").status(),
        200
    );
}

/// A TLS backend (certificate for `name`, signed by the test CA) speaking HTTP/1.1 and HTTP/2
/// (ALPN); answers `{"backend","version"}`, or 5 SSE events for `"stream": true`; records
/// each request as `{version} {:authority or -} {Host or -}`.
async fn tls_backend(ca: &Ca, name: &str) -> (u16, Arc<parking_lot::Mutex<Vec<String>>>) {
    tls_backend_alpn(ca, name, &[b"h2", b"http/1.1"]).await
}

/// [`tls_backend`] offering the ALPN protocols `alpn`.
async fn tls_backend_alpn(
    ca: &Ca,
    name: &str,
    alpn: &[&[u8]],
) -> (u16, Arc<parking_lot::Mutex<Vec<String>>>) {
    let leaf = ca.leaf(&[name]);
    let key = rustls::pki_types::PrivateKeyDer::try_from(
        rustls::pki_types::pem::PemObject::from_pem_slice(leaf.key_pem.as_bytes())
            .map(|k: rustls::pki_types::PrivatePkcs8KeyDer<'static>| k.secret_pkcs8_der().to_vec())
            .expect("key pem"),
    )
    .expect("key");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(vec![CertificateDer::from(leaf.der.clone())], key)
        .expect("server config");
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = tcp.local_addr().expect("addr").port();
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = tcp.accept().await else {
                continue;
            };
            let (acceptor, seen) = (acceptor.clone(), seen2.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let seen = seen.clone();
                        async move {
                            let version = format!("{:?}", req.version());
                            // The version, `:scheme` and `:authority` (the URI's) and `Host`
                            // headers, `-` for none.
                            let host: Vec<&str> = req
                                .headers()
                                .get_all(http::header::HOST)
                                .iter()
                                .filter_map(|v| v.to_str().ok())
                                .collect();
                            seen.lock().push(format!(
                                "{version} {} {} {}",
                                req.uri().scheme_str().unwrap_or("-"),
                                req.uri().authority().map_or("-", |a| a.as_str()),
                                if host.is_empty() {
                                    "-".to_owned()
                                } else {
                                    host.join(",")
                                }
                            ));
                            let body = req
                                .into_body()
                                .collect()
                                .await
                                .map(|c| c.to_bytes())
                                .unwrap_or_default();
                            let stream = String::from_utf8_lossy(&body).contains("\"stream\":true");
                            let text = if stream {
                                (0..5)
                                    .map(|i| format!("data: {{\"i\":{i}}}\n\n"))
                                    .collect::<String>()
                                    + "data: [DONE]\n\n"
                            } else {
                                json!({"backend": "tls", "version": version}).to_string()
                            };
                            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                                Bytes::from(text),
                            )))
                        }
                    });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (port, seen)
}

#[tokio::test]
async fn security_2_verifies_backends_and_speaks_h2_or_h1_by_backend_protocol() {
    let mut d = Daemon::start_default().await;
    let ca = Ca::new();
    let ca_file = d.state_dir().join("backend-ca.pem");
    std::fs::write(&ca_file, ca.cert.pem()).expect("ca file");
    assert_eq!(
        post_cert(&d, Some("f"), &ca.leaf(&["front.test"])).await.0,
        201
    );
    let (bport, seen) = tls_backend(&ca, "backend.test").await;
    let rule = |port: u16, name: &str, proto: &str| {
        json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                "mode": 4, "sel": 0, "security": 2, "host": "front.test",
                "backend_protocol": proto, "backend_tls_server_name": name,
                "backend_ca_file": ca_file.display().to_string()},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": bport, "weight": 1}]
        })
    };
    let mut expect = Vec::new();
    // Over HTTP/2 the client's host is the backend's `:authority`, with no `Host` beside it
    // (it was the endpoint's address with the client's `Host` kept: a malformed request, RFC
    // 9113 §8.3.1); over HTTP/1.1 it is the `Host`. The HTTP/2 `:scheme` is `https` (it was
    // `http` on the TLS connection).
    for (proto, version) in [
        ("http2", "HTTP/2.0 https front.test -"),
        ("both", "HTTP/2.0 https front.test -"),
        ("http1", "HTTP/1.1 - - front.test"),
    ] {
        let port = free_port();
        let (s, r) = d.post_rule(&rule(port, "backend.test", proto)).await;
        assert_eq!(s, 200, "{proto}: {r}");
        // A streamed completion through TLS on both sides.
        let tls = connect(&ca, port, Some("front.test"), &[b"h2"])
            .await
            .expect("tls");
        let body = r#"{"model":"m","prompt":"p","stream":true}"#;
        let (status, _, _, text) = send(tls, "front.test", body).await;
        assert_eq!(status, 200, "{proto}: {text}");
        assert_eq!(text.matches("data: {").count(), 5, "{proto}: {text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{proto}: {text}");
        expect.push(version.to_string());
    }
    assert_eq!(*seen.lock(), expect, "the backend saw each rule's protocol");

    // One request through a new rule's `port`: its status and body.
    let answer = async |port: u16, r: &Value| {
        assert_eq!(d.post_rule(r).await.0, 200);
        let tls = connect(&ca, port, Some("front.test"), &[])
            .await
            .expect("tls");
        let (status, _, _, text) = send(tls, "front.test", r#"{"prompt":"p"}"#).await;
        (status, text)
    };

    // A backend whose certificate names another host is refused under verification.
    let port = free_port();
    let (status, text) = answer(port, &rule(port, "other.test", "http1")).await;
    assert_eq!(status, 502, "{text}");
    assert!(
        text.contains("backend_unreachable")
            && text
                .contains("the peer's certificate is not valid for the name other.test; it names")
            && !text.contains("DnsName("),
        "{text}"
    );
    assert!(
        text.contains("backend TLS handshake with other.test:"),
        "the name as configured, not Rust's debug form: {text}"
    );
    assert_eq!(seen.lock().len(), 3, "no request reached the backend");

    // backend_protocol http2 to a backend without ALPN (an HTTP/1.1 server): the 502 says ALPN
    // did not agree on h2 (it was a bare `client error (SendRequest)`).
    let (h1port, h1seen) = tls_backend_alpn(&ca, "backend.test", &[]).await;
    let port = free_port();
    let mut h1rule = rule(port, "backend.test", "http2");
    h1rule["endpoints"][0]["targetPort"] = json!(h1port);
    let (status, text) = answer(port, &h1rule).await;
    assert_eq!(status, 502, "{text}");
    assert!(
        text.contains("did not agree on HTTP/2 over ALPN (it chose none)"),
        "{text}"
    );
    assert!(h1seen.lock().is_empty(), "no request reached the backend");

    // Restored with the CA file gone, the rules are dropped and kept aside, as the API would
    // refuse them now (they were restored, answered every request 502 and said ONLINE).
    d.stop().await;
    std::fs::remove_file(&ca_file).expect("remove the CA file");
    let dropped = restart_with_every_rule_dropped(
        &mut d,
        &[
            "dropping a restored rule that no longer configures its backend TLS",
            "backend-ca.pem",
        ],
    )
    .await;
    assert_eq!(dropped, 5);
    let side = std::fs::read_dir(d.state_dir())
        .expect("state dir")
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("rules.dropped-")
        })
        .count();
    assert_eq!(side, 1, "the five rules are kept in one side file");
}

/// Restarts `d`, checks that no rule was restored, and counts the log lines that contain every
/// one of `patterns` (one per dropped rule).
async fn restart_with_every_rule_dropped(d: &mut Daemon, patterns: &[&str]) -> usize {
    d.restart().await;
    let listed = d.rules().await;
    assert_eq!(
        listed["lbAttr"].as_array().map_or(0, Vec::len),
        0,
        "{listed}"
    );
    let log = d.log_text();
    let n = log
        .lines()
        .filter(|l| patterns.iter().all(|p| l.contains(p)))
        .count();
    assert!(n > 0, "no drop logged: {log}");
    n
}

/// `x-loxilb-endpoint` of one POST with `curl --http2` and one with `--http1.1` (the protocol
/// checked in the answer's status line); `None` when curl is missing or lacks HTTP/2.
async fn curl_endpoints(port: u16, host: &str, body: &str) -> Option<(String, String)> {
    // Async: the test's backends run on this runtime and must keep serving meanwhile.
    let v = tokio::process::Command::new("curl")
        .arg("-V")
        .output()
        .await
        .ok()?;
    if !String::from_utf8_lossy(&v.stdout).contains("HTTP2") {
        return None;
    }
    let one = async |flag: &str, status: &str| {
        let out = tokio::process::Command::new("curl")
            .args([
                "-sk",
                "--max-time",
                "10",
                flag,
                "-D",
                "-",
                "-o",
                "/dev/null",
                "-X",
                "POST",
            ])
            .args(["--resolve", &format!("{host}:{port}:127.0.0.1")])
            .args(["-H", "content-type: application/json", "-d", body])
            .arg(format!("https://{host}:{port}/v1/completions"))
            .output()
            .await
            .expect("curl runs");
        let head = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(head.starts_with(status), "{flag}: {head}");
        head.lines()
            .find_map(|l| l.strip_prefix("x-loxilb-endpoint: "))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let h2 = one("--http2", "HTTP/2 200").await;
    Some((h2, one("--http1.1", "HTTP/1.1 200").await))
}

/// `vllm-sim` serving `tiny` on 127.0.0.1, publishing its KV events on `tcp://127.0.0.1:zmq`
/// (hash seed 0, block size `KV_BS`).
async fn kv_engine(tok: &std::path::Path, zmq: u16) -> loxi_tests::sim::Sim {
    let mut cmd = loxi_tests::sim::Sim::command();
    let cfg = json!({"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://127.0.0.1:{zmq}")});
    cmd.args(["--model", "tiny", "--host", "127.0.0.1", "--port", "0"])
        .arg("--tokenizer-dir")
        .arg(tok)
        .env("PYTHONHASHSEED", "0")
        .args(["--block-size", &KV_BS.to_string()])
        .args(["--kv-events-config", &cfg.to_string()])
        .args(["--time-scale", "0.05"]);
    loxi_tests::sim::Sim::spawn(cmd).await
}

const KV_BS: usize = 16;

/// Issue 15: KV-exact routing (tier 1.5) is the same on the TLS frontend whatever the client's
/// protocol. Two real `vllm-sim` engines each cache a prefix of their own (4 blocks, published
/// as KV events); each prefix, sent through a `security: 1` rule over TLS with HTTP/2 and with
/// HTTP/1.1 (the rust client, and curl when it has HTTP/2), goes to the engine holding it,
/// every request counted as a tier-1.5 hit on that endpoint and a KV-overlap selection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_exact_over_tls_routes_h2_and_h1_to_the_engine_holding_the_prefix() {
    use loxi_tests::kv::{completion, kv_daemon, series, stage_tiny_tokenizer, wait_blocks};
    let tok = tempfile::tempdir().expect("tmp");
    stage_tiny_tokenizer(tok.path());
    let zmq = [free_port(), free_port()];
    let engines = [
        kv_engine(tok.path(), zmq[0]).await,
        kv_engine(tok.path(), zmq[1]).await,
    ];
    let d = kv_daemon(tok.path()).await;
    let ca = Ca::new();
    assert_eq!(
        post_cert(&d, Some("kv"), &ca.leaf(&["kv.test"])).await.0,
        201
    );
    let port = free_port();
    let eps: Vec<Value> = engines
        .iter()
        .zip(zmq)
        .map(|(e, z)| json!({"endpointIP": "127.0.0.1", "targetPort": e.port(), "kvZmqPort": z}))
        .collect();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
            "mode": 4, "sel": 0, "security": 1, "host": "kv.test", "kvExactMode": 3,
            "kvBlockSize": KV_BS, "kvHashAlgo": "sha256_cbor", "kvZmqPort": free_port()},
        "endpoints": eps,
    });
    let (s, r) = d.post_rule(&rule).await;
    assert_eq!(s, 200, "{r}");
    // Both subscribers connected, then a moment for ZeroMQ's subscription to reach them.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let m = d.metrics_text().await;
        let up: f64 = (0..2)
            .map(|i| {
                let s = format!("loxilb_kv_subscriber_connected{{service=\"1\",ep=\"{i}\"}}");
                series(&m, &s).unwrap_or(0.0)
            })
            .sum();
        if up == 2.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "subscribers not connected: {m}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Engine i caches token ids 1000·(i+1) .. +4 blocks (sent to it directly, not via loxi).
    let mut prompts = Vec::new();
    for (i, e) in engines.iter().enumerate() {
        let mut ids: Vec<u32> = (0..4 * KV_BS as u32)
            .map(|t| 1000 * (i as u32 + 1) + t)
            .collect();
        ids.push(7);
        let body = json!({"model": "tiny", "prompt": ids, "max_tokens": 1});
        assert_eq!(completion(e.addr, &body).await.0, 200);
        wait_blocks(&d, 1, i, 4).await;
        prompts.push(body.to_string());
    }
    for i in 0..2 {
        wait_blocks(&d, 1, i, 4).await;
    }

    let hits = |i: usize| format!("loxilb_pd_kv_tier15_hits_total{{service=\"1\",ep_idx=\"{i}\"}}");
    let overlap = "loxilb_proxy_selections_total{selector=\"kv\",reason=\"kv_overlap\"}";
    let before = d.metrics_text().await;
    let mut per_prefix = 0;
    for (i, body) in prompts.iter().enumerate() {
        let mut sent = 0;
        for proto in [&b"h2"[..], b"http/1.1"] {
            let tls = connect(&ca, port, Some("kv.test"), &[proto])
                .await
                .expect("tls");
            assert_eq!(alpn(&tls).as_deref(), Some(proto));
            let (status, ep, _, text) = send(tls, "kv.test", body).await;
            assert_eq!(status, 200, "{text}");
            assert_eq!(
                ep,
                i.to_string(),
                "{}: the prefix of engine {i}",
                String::from_utf8_lossy(proto)
            );
            sent += 1;
        }
        if let Some((h2, h1)) = curl_endpoints(port, "kv.test", body).await {
            assert_eq!((h2, h1), (i.to_string(), i.to_string()), "curl, engine {i}");
            sent += 2;
        }
        per_prefix = sent;
    }
    let after = d.metrics_text().await;
    let delta = |s: &str| series(&after, s).unwrap_or(0.0) - series(&before, s).unwrap_or(0.0);
    for i in 0..2 {
        assert_eq!(
            delta(&hits(i)),
            per_prefix as f64,
            "every request with engine {i}'s prefix is a tier-1.5 hit there: {after}"
        );
    }
    assert_eq!(delta(overlap), 2.0 * per_prefix as f64, "{after}");
}

/// Issue 15: P/D on the TLS frontend. A `security: 1` P/D rule over two real `vllm-sim` engines
/// (producer, consumer): a completion over TLS with HTTP/2, then one with HTTP/1.1, each runs
/// the prefill leg on the producer and the decode leg, with the prefill's
/// `kv_transfer_params`, on the consumer, under one request id; the decode endpoint answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_d_over_a_tls_h2_frontend_runs_the_prefill_then_the_decode() {
    use loxi_tests::http::{client, full};
    let tok = tempfile::tempdir().expect("tmp");
    loxi_tests::kv::stage_tiny_tokenizer(tok.path());
    let sim = async |role: &str| {
        let mut cmd = loxi_tests::sim::Sim::command();
        cmd.args(["--model", "tiny", "--host", "127.0.0.1", "--port", "0"])
            .arg("--tokenizer-dir")
            .arg(tok.path())
            .args(["--block-size", "16", "--kv-role", role])
            .args(["--time-scale", "0.05"]);
        loxi_tests::sim::Sim::spawn(cmd).await
    };
    let (pre, dec) = (sim("producer").await, sim("consumer").await);
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    assert_eq!(
        post_cert(&d, Some("pd"), &ca.leaf(&["pd.test"])).await.0,
        201
    );
    let port = free_port();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
            "mode": 4, "sel": 0, "security": 1, "host": "pd.test", "pd_disagg_mode": true},
        "endpoints": [
            {"endpointIP": "127.0.0.1", "targetPort": pre.port(), "ep_role": 1, "nixl_port": 5600},
            {"endpointIP": "127.0.0.1", "targetPort": dec.port(), "ep_role": 2, "nixl_port": 0}
        ]
    });
    let (s, r) = d.post_rule(&rule).await;
    assert_eq!(s, 200, "{r}");

    let c = client();
    let log = async |addr: SocketAddr| -> Value {
        let req = http::Request::get(format!("http://{addr}/sim/requests"))
            .body(full(""))
            .expect("request");
        loxi_tests::http::send(&c, req).await.json()
    };
    let words: Vec<String> = (0..100).map(|i| format!("w{i}")).collect();
    for (n, proto) in [&b"h2"[..], b"http/1.1"].iter().enumerate() {
        let tls = connect(&ca, port, Some("pd.test"), &[proto])
            .await
            .expect("tls");
        assert_eq!(alpn(&tls).as_deref(), Some(*proto));
        let body = json!({"model": "tiny", "prompt": words.join(" "), "max_tokens": 4});
        let (status, ep, _, text) = send(tls, "pd.test", &body.to_string()).await;
        let what = String::from_utf8_lossy(proto);
        assert_eq!(status, 200, "{what}: {text}");
        assert_eq!(ep, "1", "{what}: the decode endpoint answered");
        let v: Value = serde_json::from_str(&text).expect("json answer");
        assert_eq!(v["usage"]["completion_tokens"], 4, "{what}: {v}");
        let (plog, dlog) = (log(pre.addr).await, log(dec.addr).await);
        assert_eq!(plog.as_array().map(Vec::len), Some(n + 1), "{what}: {plog}");
        assert_eq!(dlog.as_array().map(Vec::len), Some(n + 1), "{what}: {dlog}");
        let (p, dd) = (&plog[n], &dlog[n]);
        assert_eq!(p["max_tokens"], 1, "{what}: the prefill leg: {p}");
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true, "{p}");
        assert_eq!(dd["request_id"], p["request_id"], "{what}: one request id");
        assert_eq!(dd["max_tokens"], 4, "{what}: {dd}");
        let kv = &dd["kv_transfer_params"];
        assert_eq!(kv["do_remote_prefill"], true, "{what}: {kv}");
        assert_eq!(kv["remote_port"], pre.port(), "{what}: {kv}");
    }
    let m = d.metrics_text().await;
    assert_eq!(
        loxi_tests::http::metric(&m, "loxilb_ai_pd_requests_total", &["service=\""]),
        2.0,
        "{m}"
    );
}

/// A TLS connection to `port` with SNI `sni` that accepts whatever certificate is presented.
async fn connect_any(port: u16, sni: &str) -> TlsStream<tokio::net::TcpStream> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(loxi_user::proxy::upstream_tls::NoVerify(
            provider,
        )))
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from(sni.to_string()).expect("name"), tcp)
        .await
        .expect("handshake")
}

/// Waits (up to 15 s) for a daemon log line containing every one of `patterns`; that line.
async fn wait_log_line(d: &Daemon, patterns: &[&str]) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let log = d.log_text();
        if let Some(l) = log.lines().find(|l| patterns.iter().all(|p| l.contains(p))) {
            return l.to_string();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no line with {patterns:?}: {log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A certificate that expires while the daemon runs is warned about at that moment, keeps
/// being served, and after a restart is restored and served as before (with a warning naming
/// it, its hosts and its notAfter): its TLS rule is not dropped, and its host does not fall
/// back to the `default` certificate (both happened: the restore skipped the expired
/// certificate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_is_warned_and_still_served_after_a_restart() {
    let mut d = Daemon::start_default().await;
    let ca = Ca::new();
    let def = ca.leaf(&["default.test"]);
    assert_eq!(post_cert(&d, Some("default"), &def).await.0, 201);
    let s2 = ca.leaf_expiring_in(&["s2.test"], 4);
    let (s, body) = post_cert(&d, Some("s2"), &s2).await;
    assert_eq!(s, 201, "{body}");
    assert_eq!(body["warning"], "the certificate expires within 14 days");
    let not_after = body["notAfter"].as_i64().expect("notAfter");
    let be = Backend::start("A").await;
    let port = free_port();
    let (s, r) = d.post_rule(&tls_rule(port, "s2.test", &[&be], 0)).await;
    assert_eq!(s, 200, "{r}");
    let fields = format!("cert_id=s2 hostnames=[\"s2.test\"] not_after={not_after}");
    let line = wait_log_line(&d, &["TLS certificate expired", &fields]).await;
    assert!(line.contains(" WARN "), "{line}");
    // Clients that verify it now refuse it (webpki: expired strictly after notAfter) ...
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let refused = connect(&ca, port, Some("s2.test"), &[])
        .await
        .expect_err("expired");
    assert!(
        refused.to_string().to_lowercase().contains("expired"),
        "{refused}"
    );
    // ... and it is what the server presents.
    assert_eq!(presented(&connect_any(port, "s2.test").await), s2.der);

    d.restart().await;
    let line = wait_log_line(
        &d,
        &[
            "restored a stored TLS certificate that has expired; it is served as before the \
             restart",
            &fields,
        ],
    )
    .await;
    assert!(line.contains(" WARN "), "{line}");
    let log = d.log_text();
    assert!(!log.contains("dropping a restored rule"), "{log}");
    assert!(!log.contains("skipping a stored certificate"), "{log}");
    let rules = d.rules().await;
    assert_eq!(
        rules["lbAttr"][0]["serviceArguments"]["host"], "s2.test",
        "{rules}"
    );
    let tls = connect_any(port, "s2.test").await;
    assert_eq!(
        presented(&tls),
        s2.der,
        "the host's own (expired) certificate, not the default one"
    );
    let (status, _, served, _) = send(tls, "s2.test", r#"{"prompt":"hi"}"#).await;
    assert_eq!((status, served.as_str()), (200, "A"));
    let (s, t) = d.get("/netlox/v1/config/cert/s2").await.expect("get");
    assert_eq!(s, 200, "{t}");
    assert_eq!(parse_json(&t)["notAfter"], json!(not_after));
}

/// A TLS rule's host counts as covered only by a certificate whose names match it: with a
/// `default` certificate for another name, deleting the host's only matching certificate or
/// rotating it to another name is refused (409 naming the rule and host) and the host keeps
/// being served its certificate; creating a rule for a host only that `default` would serve
/// is refused (400).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hosts_only_matching_certificate_is_kept_although_a_default_exists() {
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    let (api, def) = (ca.leaf(&["api.test"]), ca.leaf(&["default.local"]));
    assert_eq!(post_cert(&d, Some("api"), &api).await.0, 201);
    assert_eq!(post_cert(&d, Some("default"), &def).await.0, 201);
    let be = Backend::start("A").await;
    let port = free_port();
    let (s, r) = d.post_rule(&tls_rule(port, "other.test", &[&be], 0)).await;
    assert_eq!(s, 400, "{r}");
    assert_eq!(r["field"], "serviceArguments.security", "{r}");
    assert_eq!(
        r["message"],
        "serviceArguments.security: 1 (TLS terminated here) needs a certificate: no certificate \
         covers host \"other.test\" (the `default` certificate's names [\"default.local\"] do \
         not match it, and clients that verify the certificate would refuse it); upload one \
         whose subjectAltName has DNS:other.test: `loxicmd create cert --cert-file CERT.pem \
         --key-file KEY.pem [--chain-file CHAIN.pem] [--cert-id ID]` (or POST \
         /netlox/v1/config/cert); nothing was stored (loxi serves security 0 (plain), 1 (TLS \
         terminated here) and 2 (TLS terminated here, re-encrypted to the endpoints); 1 and 2 \
         need a certificate)"
    );
    let (s, r) = d.post_rule(&tls_rule(port, "api.test", &[&be], 0)).await;
    assert_eq!(s, 200, "{r}");
    let rule = format!(
        "rule 127.0.0.1:{port}/tcp host=api.test (host \"api.test\") would have no certificate whose names match its host (the `default` certificate's names [\"default.local\"] do not match it, and clients that verify the certificate would refuse it)"
    );
    let before = d.get("/netlox/v1/config/cert/api").await.expect("get").1;

    let (s, t) = d
        .request("DELETE", "/netlox/v1/config/cert/api", None)
        .await
        .expect("delete");
    assert_eq!(s, 409, "{t}");
    assert_eq!(
        parse_json(&t)["message"],
        json!(format!("certificate \"api\" is in use: {rule}"))
    );
    let (s, t) = d
        .request(
            "PUT",
            "/netlox/v1/config/cert/api",
            Some(&cert_body(None, &ca.leaf(&["elsewhere.test"]))),
        )
        .await
        .expect("put");
    assert_eq!(s, 409, "{t}");
    assert_eq!(
        parse_json(&t)["message"],
        json!(format!(
            "the new certificate for \"api\" does not cover every rule the old one served: \
             {rule}; nothing was changed"
        ))
    );
    assert_eq!(
        d.get("/netlox/v1/config/cert/api").await.expect("get").1,
        before
    );
    let tls = connect(&ca, port, Some("api.test"), &[])
        .await
        .expect("api.test still verifies");
    assert_eq!(presented(&tls), api.der);
    // The default certificate serves no rule's host here: deleting it is fine.
    let (s, t) = d
        .request("DELETE", "/netlox/v1/config/cert/default", None)
        .await
        .expect("delete");
    assert_eq!(s, 200, "{t}");
}

/// Every refusal of the cert API names the body field at fault in `field` and `fields` (as
/// the rule API's 400s do), and a CA certificate is refused as a server certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cert_api_refusals_name_the_field_and_a_ca_certificate_is_refused() {
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    let mut mismatched = ca.leaf(&["m.test"]);
    mismatched.key_pem = ca.leaf(&["m.test"]).key_pem;
    let mut garbage = ca.leaf(&["g.test"]);
    garbage.cert_pem = "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n".into();
    let expired = ca.leaf_until(&["old.test"], Some((2021, 1, 1)));
    let good = ca.leaf(&["ok.test"]);
    let ca_leaf = Leaf {
        cert_pem: ca.cert.pem(),
        key_pem: ca.key.serialize_pem(),
        der: ca.cert.der().to_vec(),
    };
    let body = |leaf: &Leaf| json!({"certPem": leaf.cert_pem, "keyPem": leaf.key_pem});
    let mut chain = body(&good);
    chain["chainPem"] = json!("garbage");
    let mut unknown = body(&good);
    unknown["cert"] = json!("x");
    let mut bad_id = body(&good);
    bad_id["certId"] = json!("a/b");
    let mut number = body(&good);
    number["keyPem"] = json!(7);
    let mut encrypted = body(&good);
    encrypted["keyPem"] = json!(
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAECAwQFBgcI\n-----END ENCRYPTED PRIVATE KEY-----\n"
    );
    let mut one_line = body(&good);
    one_line["certPem"] = json!(
        good.cert_pem
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    );
    let cases: Vec<(Value, &str, &str)> = vec![
        (
            body(&mismatched),
            "keyPem",
            "keyPem does not match the certificate in certPem",
        ),
        (body(&garbage), "certPem", "certPem: malformed PEM"),
        (
            body(&expired),
            "certPem",
            "certPem: the certificate expired at ",
        ),
        (chain, "chainPem", "chainPem: malformed PEM"),
        (bad_id, "certId", "certId \"a/b\": 1 to 63 characters"),
        (unknown, "cert", "\"cert\" is not a field of a certificate"),
        (
            json!({"certPem": good.cert_pem}),
            "keyPem",
            "keyPem: missing",
        ),
        (number, "keyPem", "keyPem: 7 is not a string"),
        (
            encrypted,
            "keyPem",
            "keyPem: the key is encrypted (ENCRYPTED PRIVATE KEY); loxi needs an unencrypted key",
        ),
        (
            one_line,
            "certPem",
            "certPem: malformed PEM: the PEM's line breaks are missing",
        ),
        (
            body(&ca_leaf),
            "certPem",
            "certPem: the certificate is a CA certificate (basicConstraints CA:TRUE); TLS \
             clients refuse a CA certificate as a server's certificate",
        ),
    ];
    for (b, field, starts) in cases {
        let (s, t) = d
            .request("POST", "/netlox/v1/config/cert", Some(&b.to_string()))
            .await
            .expect("POST");
        let v = parse_json(&t);
        assert_eq!(s, 400, "{t}");
        assert_eq!(v["field"], field, "{t}");
        assert_eq!(v["fields"], json!([field]), "{t}");
        assert!(
            v["message"].as_str().is_some_and(|m| m.starts_with(starts)),
            "{starts}: {t}"
        );
    }
    assert_eq!(post_cert(&d, Some("ok"), &good).await.0, 201);
    let (s, v) = post_cert(&d, Some("ok"), &good).await;
    assert_eq!((s, v["field"].clone()), (409, json!("certId")), "{v}");
    let (s, t) = d.get("/netlox/v1/config/cert/all").await.expect("list");
    assert_eq!(s, 200);
    let ids: Vec<Value> = parse_json(&t)["certAttr"]
        .as_array()
        .map(|a| a.iter().map(|c| c["certId"].clone()).collect())
        .unwrap_or_default();
    assert_eq!(ids, [json!("ok")], "nothing refused was stored: {t}");
}

/// An HTTP/2 prior-knowledge (h2c) client on a TLS port gets the server's SETTINGS and a
/// GOAWAY whose debug data says plain HTTP/2 was sent to a TLS port (it got an empty reply),
/// counted as a failed handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_h2_on_a_tls_port_gets_a_goaway_saying_so() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (d, ca, be, port) = p_test_listener().await;
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    // The preface in two writes (the server waits for "PRI"), then an empty SETTINGS frame.
    s.write_all(b"P").await.expect("write");
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.write_all(b"RI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .expect("write");
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got))
        .await
        .expect("answered and closed within 5 s")
        .expect("read");
    // Frames: 3-byte length, type, flags, 4-byte stream id, payload.
    let mut frames = Vec::new();
    let mut rest = &got[..];
    while rest.len() >= 9 {
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        assert!(rest.len() >= 9 + len, "a truncated frame: {got:?}");
        frames.push((rest[3], rest[9..9 + len].to_vec()));
        rest = &rest[9 + len..];
    }
    assert!(rest.is_empty(), "{got:?}");
    assert_eq!(frames.len(), 2, "{frames:?}");
    assert_eq!(
        frames[0],
        (0x4, vec![]),
        "SETTINGS first (the server preface)"
    );
    let (kind, payload) = &frames[1];
    assert_eq!(*kind, 0x7, "GOAWAY");
    assert_eq!(
        &payload[..8],
        &[0, 0, 0, 0, 0, 0, 0, 1],
        "last stream 0, PROTOCOL_ERROR"
    );
    assert_eq!(
        String::from_utf8_lossy(&payload[8..]),
        "plain_http_on_tls_port: plain HTTP/2 (h2c) was sent to a port that terminates TLS \
         (security 1): use https://"
    );
    drop(s);
    d.wait_metric("loxilb_proxy_tls_handshake_failures_total", &[], 1.0)
        .await;
    assert_eq!(be.request_count(), 0, "nothing was forwarded");
    let tls = connect(&ca, port, Some("p.test"), &[b"h2"])
        .await
        .expect("TLS still served");
    let (status, _, served, _) = send(tls, "p.test", r#"{"prompt":"hi"}"#).await;
    assert_eq!((status, served.as_str()), (200, "A"));
}

/// A TLS rule whose host is an IP address: its clients send no SNI (RFC 6066 §3), so they get
/// the `default` certificate, and they verify the address against its SAN IP addresses only.
/// A `default` certificate naming the address as a DNS name does not serve it (the rule was
/// accepted and every verifying client refused the handshake): the rule is refused saying
/// so, with the call that fixes it; rotated to one with the address as an IP SAN, the rule is
/// accepted and a client connecting by the address verifies it and is answered. The cert API
/// and loxicmd list the IP address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ip_host_is_served_by_the_default_certificate_with_that_ip_address() {
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    let spelled = ca.leaf_sans(vec![rcgen::SanType::DnsName(
        "127.0.0.1".try_into().expect("IA5"),
    )]);
    assert_eq!(post_cert(&d, Some("default"), &spelled).await.0, 201);
    let be = Backend::start("A").await;
    let port = free_port();
    let rule = tls_rule(port, "127.0.0.1", &[&be], 0);
    let (s, r) = d.post_rule(&rule).await;
    assert_eq!(s, 400, "{r}");
    let m = r["message"].as_str().unwrap_or_default();
    assert!(
        m.contains(
            "host \"127.0.0.1\" is an IP address: clients connecting to an IP address send no \
             SNI and get the `default` certificate, whose names [\"127.0.0.1\"] include no IP \
             address"
        ) && m.contains("PUT /netlox/v1/config/cert/default"),
        "{m}"
    );
    let by_ip = ca.leaf(&["lb.test", "127.0.0.1"]);
    let (s, t) = d
        .request(
            "PUT",
            "/netlox/v1/config/cert/default",
            Some(&cert_body(None, &by_ip)),
        )
        .await
        .expect("rotate");
    assert_eq!(s, 200, "{t}");
    let answer = parse_json(&t);
    assert_eq!(
        (&answer["hostnames"], &answer["ipAddresses"]),
        (&json!(["lb.test"]), &json!(["127.0.0.1"])),
        "{answer}"
    );
    let (s, r) = d.post_rule(&rule).await;
    assert_eq!(s, 200, "{r}");
    for alpn in [&b"h2"[..], b"http/1.1"] {
        let tls = connect(&ca, port, None, &[alpn])
            .await
            .expect("the address verifies against the IP SAN");
        assert_eq!(presented(&tls), by_ip.der);
        let (status, _, served, _) = send(tls, "127.0.0.1", r#"{"prompt":"hi"}"#).await;
        assert_eq!((status, served.as_str()), (200, "A"));
    }
    let out = d.loxicmd(&["get", "cert", "default"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        concat!(
            "| CERT ID |      HOSTNAMES       |\n",
            "|---------|----------------------|\n",
            "| default | lb.test,IP:127.0.0.1 |\n",
        )
    );
}

/// Writes `leaf` as the staged `default` pair of `dir` (`server.crt` + `server.key`), both
/// files modified at `mtime`.
fn stage_default(dir: &std::path::Path, leaf: &Leaf, mtime: std::time::SystemTime) {
    for (name, text) in [
        ("server.crt", &leaf.cert_pem),
        ("server.key", &leaf.key_pem),
    ] {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write staged file");
        std::fs::File::options()
            .write(true)
            .open(&p)
            .and_then(|f| f.set_modified(mtime))
            .expect("set mtime");
    }
}

/// The served `default` certificate's DER, through a handshake verifying 127.0.0.1 (the IP
/// host's clients send no SNI), and the answer of a request over it.
async fn ip_handshake(ca: &Ca, port: u16) -> (Vec<u8>, u16, String) {
    let tls = connect(ca, port, None, &[b"http/1.1"])
        .await
        .expect("the address verifies against the default certificate's IP SAN");
    let der = presented(&tls);
    let (status, _, served, _) = send(tls, "127.0.0.1", r#"{"prompt":"hi"}"#).await;
    (der, status, served)
}

/// `--cert-dir` at restart never undoes a rotation through the API: a staged `default` pair
/// older than the stored certificate (rotated by `PUT` since) is not applied, with a warning
/// naming the file; a staged pair newer than it that would leave a restored TLS rule without a
/// certificate is not applied either (the `PUT` making that change is refused 409), with a
/// warning naming the file, the rule and the fix; a newer pair that covers every rule replaces
/// the stored one. Each time a client verifying the IP host completes a handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_staged_default_certificate_does_not_undo_a_rotation_through_the_api() {
    let staged = tempfile::tempdir().expect("tmp");
    let ca = Ca::new();
    let other = ca.leaf(&["other.example"]);
    let start = std::time::SystemTime::now() - Duration::from_secs(3600);
    stage_default(staged.path(), &other, start);
    let mut d = Daemon::start(loxi_tests::harness::DaemonOpts {
        args: vec!["--cert-dir".into(), staged.path().display().to_string()],
        ..Default::default()
    })
    .await;
    let (s, t) = d
        .get("/netlox/v1/config/cert/default")
        .await
        .expect("GET cert");
    assert_eq!(
        (s, parse_json(&t)["hostnames"].clone()),
        (200, json!(["other.example"]))
    );
    let by_ip = ca.leaf(&["lb.test", "127.0.0.1"]);
    let (s, t) = d
        .request(
            "PUT",
            "/netlox/v1/config/cert/default",
            Some(&cert_body(None, &by_ip)),
        )
        .await
        .expect("rotate");
    assert_eq!(s, 200, "{t}");
    let be = Backend::start("A").await;
    let port = free_port();
    let (s, r) = d.post_rule(&tls_rule(port, "127.0.0.1", &[&be], 0)).await;
    assert_eq!(s, 200, "{r}");
    // The PUT back to the staged certificate is refused: it would uncover the rule.
    let (s, t) = d
        .request(
            "PUT",
            "/netlox/v1/config/cert/default",
            Some(&cert_body(None, &other)),
        )
        .await
        .expect("rotate back");
    assert_eq!(s, 409, "{t}");

    // 1. The staged pair is older than the rotation: the rotation stays.
    d.restart().await;
    let (s, t) = d
        .get("/netlox/v1/config/cert/default")
        .await
        .expect("GET cert");
    assert_eq!(
        (s, parse_json(&t)["ipAddresses"].clone()),
        (200, json!(["127.0.0.1"])),
        "{t}"
    );
    assert_eq!(
        ip_handshake(&ca, port).await,
        (by_ip.der.clone(), 200, "A".into())
    );
    let crt = staged.path().join("server.crt").display().to_string();
    let log = d.log_text();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("staged certificate NOT applied: the stored certificate \"default\"")
            && l.contains("rotated through the API")
            && l.contains(&crt)),
        "{log}"
    );

    // 2. The staged pair is newer but leaves the IP host uncovered: not applied, said.
    stage_default(
        staged.path(),
        &other,
        std::time::SystemTime::now() + Duration::from_secs(5),
    );
    d.restart().await;
    let (_, t) = d
        .get("/netlox/v1/config/cert/default")
        .await
        .expect("GET cert");
    assert_eq!(parse_json(&t)["ipAddresses"], json!(["127.0.0.1"]), "{t}");
    assert_eq!(
        ip_handshake(&ca, port).await,
        (by_ip.der.clone(), 200, "A".into())
    );
    let log = d.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("staged certificate NOT applied, although newer"))
        .unwrap_or_else(|| panic!("no refusal: {log}"));
    assert!(
        line.contains("WARN")
            && line.contains(&crt)
            && line.contains(&format!("127.0.0.1:{port}"))
            && line.contains("host \"127.0.0.1\"")
            && line.contains("PUT /netlox/v1/config/cert/default"),
        "{line}"
    );

    // 3. A newer staged pair covering the IP host replaces the stored one.
    let staged_ip = ca.leaf(&["lb2.test", "127.0.0.1"]);
    stage_default(
        staged.path(),
        &staged_ip,
        std::time::SystemTime::now() + Duration::from_secs(10),
    );
    d.restart().await;
    let (_, t) = d
        .get("/netlox/v1/config/cert/default")
        .await
        .expect("GET cert");
    assert_eq!(parse_json(&t)["hostnames"], json!(["lb2.test"]), "{t}");
    assert_eq!(
        ip_handshake(&ca, port).await,
        (staged_ip.der.clone(), 200, "A".into())
    );
    assert!(
        d.log_text()
            .contains("staged certificate loaded: it replaces the stored certificate"),
        "{}",
        d.log_text()
    );
}

/// A certificate whose subjectAltName lists IP addresses only names no host by its CN (RFC
/// 6125 §6.4.4: clients never match the CN of a certificate with a SAN): it is listed without
/// hostnames, and a TLS rule for the CN's name is refused as having no certificate (the CN was
/// taken as a hostname, and clients refused the certificate served for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cn_of_a_certificate_with_a_san_names_no_host() {
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    let key = KeyPair::generate().expect("key");
    let mut p = CertificateParams::default();
    p.subject_alt_names = vec![rcgen::SanType::IpAddress("10.0.0.9".parse().expect("ip"))];
    p.distinguished_name.push(DnType::CommonName, "cn.test");
    let cert = p.signed_by(&key, &ca.cert, &ca.key).expect("leaf");
    let leaf = Leaf {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        der: cert.der().to_vec(),
    };
    let (s, answer) = post_cert(&d, Some("ipcn"), &leaf).await;
    assert_eq!(s, 201, "{answer}");
    assert_eq!(
        (&answer["hostnames"], &answer["ipAddresses"]),
        (&json!([]), &json!(["10.0.0.9"])),
        "{answer}"
    );
    let be = Backend::start("A").await;
    let port = free_port();
    let (s, r) = d.post_rule(&tls_rule(port, "cn.test", &[&be], 0)).await;
    assert_eq!(s, 400, "no certificate names cn.test: {r}");
}

/// A self-signed certificate as `openssl req -x509` makes it (CA:TRUE) is refused with the
/// openssl option that makes it an end-entity one, as the README gives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_signed_ca_certificate_is_refused_naming_the_openssl_fix() {
    let d = Daemon::start_default().await;
    let key = KeyPair::generate().expect("key");
    let mut p = CertificateParams::new(vec!["lb.example".to_string()]).expect("params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = p.self_signed(&key).expect("cert");
    let leaf = Leaf {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        der: cert.der().to_vec(),
    };
    let (s, answer) = post_cert(&d, Some("selfca"), &leaf).await;
    assert_eq!(s, 400, "{answer}");
    let m = answer["message"].as_str().unwrap_or_default();
    assert!(
        m.contains("basicConstraints CA:TRUE")
            && m.contains("openssl req -x509 ... -addext basicConstraints=critical,CA:FALSE"),
        "{answer}"
    );
    let readme = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"),
    )
    .expect("README");
    assert!(
        readme.contains("openssl req -x509 ... -addext basicConstraints=critical,CA:FALSE"),
        "the README gives the same option"
    );
}

/// A backend whose certificate names an IPv6 address, refused for another name: the 502 names
/// the address as std writes it (`::1`; webpki's text, `0::1`, was shown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_certificate_naming_an_ipv6_address_is_named_as_std_writes_it() {
    let d = Daemon::start_default().await;
    let ca = Ca::new();
    let ca_file = d.state_dir().join("backend-ca.pem");
    std::fs::write(&ca_file, ca.cert.pem()).expect("ca file");
    assert_eq!(
        post_cert(&d, Some("f"), &ca.leaf(&["front.test"])).await.0,
        201
    );
    let (bport, seen) = tls_backend(&ca, "::1").await;
    let port = free_port();
    let (s, r) = d
        .post_rule(&json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
                "mode": 4, "sel": 0, "security": 2, "host": "front.test",
                "backend_protocol": "http1", "backend_tls_server_name": "other.test",
                "backend_ca_file": ca_file.display().to_string()},
            "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": bport, "weight": 1}]
        }))
        .await;
    assert_eq!(s, 200, "{r}");
    let tls = connect(&ca, port, Some("front.test"), &[])
        .await
        .expect("tls");
    let (status, _, _, text) = send(tls, "front.test", r#"{"prompt":"p"}"#).await;
    assert_eq!(status, 502, "{text}");
    assert!(
        text.contains("not valid for the name other.test; it names ::1") && !text.contains("0::1"),
        "{text}"
    );
    assert!(seen.lock().is_empty(), "no request reached the backend");
}
