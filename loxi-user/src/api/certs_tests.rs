//! The cert API's answers, against an in-memory store.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde_json::{Value, json};

use super::*;
use crate::certs::testutil::{dns, ip, with_sans};
use crate::rules::RuleStore;

fn state() -> ApiState {
    super::super::rules::tests::state(Arc::new(RuleStore::in_memory()))
}

async fn body(resp: Response) -> Value {
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    serde_json::from_slice(&bytes).expect("JSON")
}

/// Stores in `rules` a TLS rule (`security: 1`) on 127.0.0.1:`port` for `host`, unchecked
/// (the store's own upsert: no certificate check).
fn store_tls_rule(rules: &RuleStore, port: u16, host: &str) {
    let rule: crate::rules::LbRule = serde_json::from_value(json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "protocol": "tcp",
            "mode": 4, "security": 1, "host": host},
        "endpoints": [{"endpointIP": "127.0.0.2", "targetPort": 8443}]
    }))
    .expect("rule");
    rules.upsert(rule).expect("stored");
}

/// The upload body of `pem` under `id`.
fn upload(id: &str, pem: &CertPem) -> Result<Bytes, BytesRejection> {
    Ok(Bytes::from(
        json!({"certId": id, "certPem": pem.cert_pem, "keyPem": pem.key_pem}).to_string(),
    ))
}

/// A certificate's SAN IP addresses are answered (`ipAddresses`, after LoxiLB's `hostnames`)
/// by create, get and list (they were dropped); a certificate with none is answered with
/// LoxiLB's keys only, and one naming only addresses is taken (it was refused as naming no
/// host).
#[tokio::test]
async fn ip_addresses_are_answered_beside_the_hostnames() {
    let st = state();
    let vip = with_sans(vec![dns("lb.example"), ip("10.0.0.5"), ip("fd00::5")], None);
    let created = body(
        create(State(st.clone()), NoQuery, upload("vip", &vip))
            .await
            .expect("created"),
    )
    .await;
    assert_eq!(created["hostnames"], json!(["lb.example"]));
    assert_eq!(created["ipAddresses"], json!(["10.0.0.5", "fd00::5"]));
    let only = with_sans(vec![ip("10.0.0.6")], None);
    let created = body(
        create(State(st.clone()), NoQuery, upload("only", &only))
            .await
            .expect("a certificate naming only an address"),
    )
    .await;
    assert_eq!(
        (&created["hostnames"], &created["ipAddresses"]),
        (&json!([]), &json!(["10.0.0.6"]))
    );
    let web = with_sans(vec![dns("web.example")], None);
    create(State(st.clone()), NoQuery, upload("web", &web))
        .await
        .expect("created");
    let one = body(
        get_one(State(st.clone()), Path("vip".into()), NoQuery)
            .await
            .expect("get"),
    )
    .await;
    assert_eq!(one["ipAddresses"], json!(["10.0.0.5", "fd00::5"]));
    let all = body(list(State(st), NoQuery).await).await;
    let by_id = |id: &str| {
        all["certAttr"]
            .as_array()
            .expect("list")
            .iter()
            .find(|c| c["certId"] == id)
            .cloned()
            .expect("listed")
    };
    assert_eq!(by_id("vip")["ipAddresses"], json!(["10.0.0.5", "fd00::5"]));
    let web = by_id("web");
    let mut keys: Vec<&str> = web
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "certId",
            "expiresSoon",
            "hostnames",
            "notAfter",
            "notBefore"
        ],
        "no ipAddresses key without an IP address"
    );
}

/// A DNS host that the `default` certificate does not cover is refused naming what `default`
/// names, its IP addresses included (`names ["IP:10.0.0.5"]`; the message said `names []` of a
/// `default` certificate naming only an address), by the rule check and by a rotation.
#[test]
fn a_default_naming_only_addresses_is_named_with_them() {
    let certs = crate::certs::CertStore::in_memory();
    certs
        .create(
            Some("default".into()),
            with_sans(vec![ip("10.0.0.5")], None),
        )
        .expect("default");
    let (what, _) = missing_certificate(&certs.snapshot(), "api.example.com");
    assert_eq!(
        what,
        "no certificate covers host \"api.example.com\" (the `default` certificate's names \
         [\"IP:10.0.0.5\"] do not match it, and clients that verify the certificate would \
         refuse it)"
    );
    let rules = crate::rules::RuleStore::in_memory();
    store_tls_rule(&rules, 49150, "api.example.com");
    let before = crate::certs::CertStore::in_memory();
    before
        .create(
            Some("default".into()),
            with_sans(vec![dns("api.example.com")], None),
        )
        .expect("default");
    let msg =
        uncovered(&rules.snapshot(), &before.snapshot(), &certs.snapshot()).expect("uncovered");
    assert!(
        msg.ends_with(
            "(host \"api.example.com\") would have no certificate whose names match its host \
             (the `default` certificate's names [\"IP:10.0.0.5\"] do not match it, and clients \
             that verify the certificate would refuse it)"
        ),
        "{msg}"
    );
}

/// A rotation's body may name its certificate (`certId`) only as the path does: another id,
/// or an empty one (which POST refuses as an id), is 400 naming `certId`, and the stored
/// certificate stays; the path's own id, or none, rotates.
#[tokio::test]
async fn a_rotation_body_naming_another_id_is_refused() {
    let st = state();
    let first = with_sans(vec![dns("lb.example")], None);
    create(State(st.clone()), NoQuery, upload("vip", &first))
        .await
        .expect("created");
    let next = with_sans(vec![dns("lb.example"), dns("www.example")], None);
    for other in ["", "web"] {
        let e = replace(
            State(st.clone()),
            Path("vip".into()),
            NoQuery,
            upload(other, &next),
        )
        .await
        .expect_err("another id");
        assert_eq!(
            e.status,
            StatusCode::BAD_REQUEST,
            "{other:?}: {}",
            e.message
        );
        assert_eq!(e.field.as_deref(), Some("certId"));
        assert!(
            e.message.contains("differs from the path's \"vip\""),
            "{}",
            e.message
        );
    }
    assert_eq!(
        st.certs.snapshot().certs.get("vip").expect("kept").names(),
        ["lb.example"]
    );
    replace(
        State(st.clone()),
        Path("vip".into()),
        NoQuery,
        upload("vip", &next),
    )
    .await
    .expect("rotated");
    assert_eq!(
        st.certs
            .snapshot()
            .certs
            .get("vip")
            .expect("rotated")
            .names(),
        ["lb.example", "www.example"]
    );
}

/// A key given twice is refused naming it (serde_json kept the last value silently, so a body
/// with two `keyPem`s stored one of them unsaid), as are two spellings of one field; a key
/// matching a field ignoring ASCII case (`CertPem`, `KEYPEM`) is that field, as Go's decoder
/// and the rule API match it (it was refused as unknown).
#[tokio::test]
async fn keys_match_as_the_rule_api_matches_them() {
    let st = state();
    let pem = with_sans(vec![dns("lb.example")], None);
    let quoted = |s: &str| serde_json::to_string(s).expect("string");
    let twice = format!(
        r#"{{"certId":"vip","certPem":{},"keyPem":{},"keyPem":{}}}"#,
        quoted(&pem.cert_pem),
        quoted(&pem.key_pem),
        quoted(&pem.key_pem)
    );
    let e = create(State(st.clone()), NoQuery, Ok(Bytes::from(twice)))
        .await
        .expect_err("a key twice");
    assert_eq!(
        (e.status, e.field.as_deref()),
        (StatusCode::BAD_REQUEST, Some("keyPem")),
        "{}",
        e.message
    );
    assert!(e.message.contains("appears twice"), "{}", e.message);
    let both = json!({"certId": "vip", "certPem": pem.cert_pem, "keyPem": pem.key_pem,
                      "KeyPem": pem.key_pem});
    let e = create(
        State(st.clone()),
        NoQuery,
        Ok(Bytes::from(both.to_string())),
    )
    .await
    .expect_err("two spellings");
    assert_eq!(e.field.as_deref(), Some("KeyPem"), "{}", e.message);
    assert!(e.message.contains("are the same field"), "{}", e.message);
    assert!(st.certs.snapshot().certs.is_empty(), "nothing stored");
    let cased = json!({"CERTID": "vip", "CertPem": pem.cert_pem, "keypem": pem.key_pem});
    let created = body(
        create(
            State(st.clone()),
            NoQuery,
            Ok(Bytes::from(cased.to_string())),
        )
        .await
        .expect("keys in another case"),
    )
    .await;
    assert_eq!(created["certId"], json!("vip"));
    assert_eq!(
        st.certs
            .snapshot()
            .certs
            .get("vip")
            .expect("stored")
            .names(),
        ["lb.example"]
    );
}

/// A change that leaves several TLS rules without a certificate is refused naming each (the
/// message named the first only, so fixing it met the next 409), up to
/// [`UNCOVERED_NAMED`], then counting the rest; the certificate stays.
#[tokio::test]
async fn a_refusal_names_every_rule_left_without_a_certificate() {
    let rules = Arc::new(RuleStore::in_memory());
    for i in 0..10u16 {
        store_tls_rule(&rules, 49100 + i, &format!("h{i}.example"));
    }
    let st = super::super::rules::tests::state(rules);
    let wild = with_sans(vec![dns("*.example")], None);
    create(State(st.clone()), NoQuery, upload("wild", &wild))
        .await
        .expect("created");
    let e = remove(State(st.clone()), Path("wild".into()), NoQuery)
        .await
        .expect_err("in use");
    assert_eq!(e.status, StatusCode::CONFLICT, "{}", e.message);
    let named = (0..10)
        .filter(|i| e.message.contains(&format!("(host \"h{i}.example\")")))
        .count();
    assert_eq!(named, UNCOVERED_NAMED, "{}", e.message);
    assert!(e.message.ends_with("; and 2 more rules"), "{}", e.message);
    assert!(st.certs.snapshot().certs.contains_key("wild"), "kept");
}

/// Only certificates valid now keep a rule covered: deleting (or rotating away) the valid
/// certificate of a host whose other certificate has expired is refused (it was allowed,
/// leaving the rule the expired one), removing the expired one is not; a new rule's refusal
/// says the matching certificate is not valid now.
#[test]
fn an_expired_certificate_keeps_no_rule_covered() {
    use crate::certs::testutil::expired;
    let rules = RuleStore::in_memory();
    store_tls_rule(&rules, 49150, "s.example");
    let now = crate::certs::store::unix_now();
    let valid = Arc::new(
        crate::certs::parse::parse("z", with_sans(vec![dns("s.example")], None), now)
            .expect("valid"),
    );
    let snap = |certs: Vec<Arc<crate::certs::Certificate>>| CertSnapshot {
        certs: certs.into_iter().map(|c| (c.id.clone(), c)).collect(),
    };
    let old = expired("a", &["s.example"]);
    let both = snap(vec![old.clone(), valid.clone()]);
    let msg = uncovered(&rules.snapshot(), &both, &snap(vec![old.clone()]))
        .expect("deleting the valid one leaves the rule uncovered");
    assert!(msg.contains("(host \"s.example\")"), "{msg}");
    assert_eq!(
        uncovered(&rules.snapshot(), &both, &snap(vec![valid])),
        None,
        "removing the expired one"
    );
    let (what, fix) = expired_match(&snap(vec![old]), "s.example").expect("expired");
    assert!(
        what.starts_with("certificate \"a\", the one host \"s.example\" serves, is not valid now"),
        "{what}"
    );
    assert!(
        fix.starts_with("rotate it: PUT /netlox/v1/config/cert/a "),
        "{fix}"
    );
    assert_eq!(expired_match(&both, "s.example"), None);
}

/// A certificate with the id `all`, which older versions accepted and restore still loads,
/// can be deleted (`GET /config/cert/all` is the list, so `DELETE /config/cert/{certId}` never
/// reached it: 405).
#[tokio::test]
async fn a_stored_certificate_with_the_id_all_can_be_deleted() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::create_dir_all(dir.path().join("certs")).expect("dir");
    let pem = with_sans(vec![dns("all.example")], None);
    std::fs::write(
        dir.path().join("certs/all.json"),
        serde_json::to_vec(&pem).expect("json"),
    )
    .expect("write");
    let mut st = state();
    st.certs = Arc::new(crate::certs::CertStore::open(dir.path()).expect("open"));
    assert!(st.certs.snapshot().certs.contains_key("all"), "restored");
    remove_all_id(State(st.clone()), NoQuery)
        .await
        .expect("deleted");
    assert!(st.certs.snapshot().certs.is_empty());
    assert!(!dir.path().join("certs/all.json").exists());
}
