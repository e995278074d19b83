//! Shared steps of the KV-tier integration tests: the staged tiny tokenizer, a daemon set up
//! for tier 1.5 against pyzmq publishers, one completion through the VIP, metric series and
//! inventory polling.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::harness::{Daemon, DaemonOpts};
use crate::shared_dir;

/// Stages `<dir>/tiny/{tokenizer.json, tokenizer_config.json}` from the golden tiny model.
pub fn stage_tiny_tokenizer(dir: &Path) {
    let src = shared_dir().join("golden/tiny-model");
    let dst = dir.join("tiny");
    std::fs::create_dir_all(&dst).expect("mkdir");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy tokenizer file");
    }
}

/// `loxilb` with the staged tokenizers in `tok_dir`, hash seed 0 (the golden capture's
/// `PYTHONHASHSEED`) and predicted blocks off, so only the engines' events decide.
pub async fn kv_daemon(tok_dir: &Path) -> Daemon {
    let opts = DaemonOpts {
        tokenizer_dir: Some(tok_dir.to_path_buf()),
        ..Default::default()
    }
    .env("LLB_KV_NONE_HASH_SEED", "0")
    .env("LOXI_KV_PREDICT_TTL_MS", "0");
    Daemon::start(opts).await
}

/// POSTs `body` to `http://<vip>/v1/completions`: the status and the endpoint index the proxy
/// reports in `x-loxilb-endpoint`.
pub async fn completion(vip: SocketAddr, body: &Value) -> (u16, Option<usize>) {
    completion_with(vip, body, &[]).await
}

/// [`completion`] with extra request headers (e.g. `traceparent`).
pub async fn completion_with(
    vip: SocketAddr,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, Option<usize>) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = http::Request::post(format!("http://{vip}/v1/completions"))
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = client.request(req).await.expect("proxy answered");
    let ep = resp
        .headers()
        .get("x-loxilb-endpoint")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    (status, ep)
}

/// The value of the first line of `text` starting with `series` (name and labels), `None`
/// when the series is absent.
pub fn series(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Polls the inventory of rule `service`'s endpoint `ep` until it holds `want` blocks (10 s).
pub async fn wait_blocks(d: &Daemon, service: u32, ep: usize, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let path = format!("/netlox/v1/config/ai/kv/inventory?service_id={service}&ep_idx={ep}");
        let (code, body) = d.get(&path).await.expect("inventory");
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        if code == 200 && v["endpoints"][0]["blockCount"].as_u64() == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "inventory of service {service} ep {ep} never reached {want}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
