//! In-process tests of the proxy with a fake tier 1.5: real listener, real backends on
//! loopback, a real rule store; checks tier-first selection for `kvExactMode: 3`, the
//! fallback to `sel` on a miss, `routed()` notifications and that other rules skip the tier.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use super::meta::{Prompt, RequestMeta};
use super::{ProxyConfig, ProxyContext, ProxyMetrics};
use crate::routing::{AffinityTier, Candidates, Decision, EpIdx, Reason};
use crate::rules::{RuleStore, StoredRule};

/// Hits (endpoint 1) when the prompt contains "warm"; otherwise misses.
#[derive(Default)]
struct FakeTier {
    routed: Mutex<Vec<EpIdx>>,
    asked: Mutex<usize>,
}

impl AffinityTier for FakeTier {
    fn select(
        &self,
        _: &StoredRule,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
    ) -> Option<Decision> {
        *self.asked.lock() += 1;
        let warm = matches!(&meta.prompt, Some(Prompt::Text(t)) if t.contains("warm"));
        (warm && cands.eligible(1)).then(|| Decision::pick(1, Reason::KvOverlap))
    }
    fn routed(&self, _: &StoredRule, _: &RequestMeta, ep: EpIdx) {
        self.routed.lock().push(ep);
    }
}

async fn backend() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from(
                        "ok",
                    ))))
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

async fn post(port: u16, prompt: &str) -> usize {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
    let req = hyper::Request::post(format!("http://127.0.0.1:{port}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("req");
    for _ in 0..200 {
        if let Ok(resp) = client.request(req.clone()).await {
            let ep = resp.headers()["x-loxilb-endpoint"]
                .to_str()
                .expect("ascii")
                .parse()
                .expect("int");
            let _ = resp.into_body().collect().await;
            return ep;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("proxy on {port} never answered");
}

#[tokio::test]
async fn kv_exact_mode_3_asks_the_tier_first_then_sel() {
    let (b0, b1) = (backend().await, backend().await);
    let (port, plain_port) = (free_port(), free_port());
    let store = RuleStore::in_memory();
    let rule = |port: u16, kv: u8| {
        serde_json::from_value(serde_json::json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "mode": 4, "sel": 0, "kvExactMode": kv},
            "endpoints": [
                {"endpointIP": "127.0.0.1", "targetPort": b0.port()},
                {"endpointIP": "127.0.0.1", "targetPort": b1.port()}
            ]
        }))
        .expect("rule")
    };
    store.upsert(rule(port, 3)).expect("kv rule");
    store.upsert(rule(plain_port, 0)).expect("plain rule");
    let tier = Arc::new(FakeTier::default());
    let ctx = ProxyContext {
        metrics: ProxyMetrics::unregistered(),
        tier: Some(tier.clone()),
        config: ProxyConfig::default(),
        health: crate::health::board::HealthBoard::new(),
    };
    let stop = CancellationToken::new();
    let task = tokio::spawn(super::run(store.subscribe(), ctx, stop.clone()));

    // Hits go to the tier's endpoint every time; misses fall back to round-robin.
    for _ in 0..3 {
        assert_eq!(post(port, "warm prefix").await, 1);
    }
    let misses = [post(port, "cold").await, post(port, "cold").await];
    assert_eq!(misses, [0, 1], "round-robin on a miss");
    assert_eq!(*tier.routed.lock(), vec![1, 1, 1, 0, 1]);
    let asked = *tier.asked.lock();
    assert_eq!(asked, 5);
    // A rule without kvExactMode 3 never consults the tier.
    post(plain_port, "warm prefix").await;
    assert_eq!(*tier.asked.lock(), asked);
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("proxy stops")
        .expect("join");
}
