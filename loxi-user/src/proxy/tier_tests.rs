//! In-process tests of the proxy with tier 1.5: real listener, real backends on loopback, a
//! real rule store. With a fake tier: tier-first selection for `kvExactMode: 3`, the fallback
//! to `sel` on a miss, `routed()` notifications and that other rules skip the tier. With the
//! real KV tier: a request's prompt is tokenized and hashed once, across the first selection,
//! a connect-failure retry and the predicted-block insertion after routing.

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
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::{ProxyConfig, ProxyContext, ProxyMetrics};
use crate::kv::route::blend::LbMode;
use crate::kv::route::select::KvTicket;
use crate::kv::route::select::{KvRouter, PromptTokenizer};
use crate::kv::settings::KvSettings;
use crate::kv::testutil::{TinyTokenizer, state};
use crate::request::{ApiKind, Prompt, RequestMeta};
use crate::routing::{AffinityTier, Candidates, Decision, EpIdx, Reason};
use crate::rules::{RuleStore, StoredRule};

/// Hits (endpoint 1) when the prompt contains "warm"; otherwise misses.
#[derive(Default)]
struct FakeTier {
    routed: Mutex<Vec<EpIdx>>,
    asked: Mutex<usize>,
}

impl AffinityTier for FakeTier {
    type Ticket = KvTicket;

    fn select(
        &self,
        _: &StoredRule,
        meta: &RequestMeta,
        cands: &Candidates<'_>,
        _: &mut KvTicket,
    ) -> Option<Decision> {
        *self.asked.lock() += 1;
        let warm = matches!(&meta.prompt, Some(Prompt::Text(t)) if t.contains("warm"));
        (warm && cands.eligible(1)).then(|| Decision::pick(1, Reason::KvOverlap))
    }
    fn routed(&self, _: &StoredRule, _: &RequestMeta, ep: EpIdx, _: &mut KvTicket) {
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
    let body = serde_json::json!({"model": "tiny", "prompt": prompt}).to_string();
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
    // Two engines on one host: each its own KV-event port (nothing publishes there).
    let (z0, z1) = (free_port(), free_port());
    let rule = |port: u16, kv: u8| {
        let zmq = |z: u16| if kv == 3 { z } else { 0 };
        serde_json::from_value(serde_json::json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "mode": 4, "sel": 0, "kvExactMode": kv},
            "endpoints": [
                {"endpointIP": "127.0.0.1", "targetPort": b0.port(), "kvZmqPort": zmq(z0)},
                {"endpointIP": "127.0.0.1", "targetPort": b1.port(), "kvZmqPort": zmq(z1)}
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
        sockets: crate::listen::ListenSockets::new(Default::default()),
        certs: std::sync::Arc::new(crate::certs::CertStore::in_memory()),
        workers: None,
    };
    let stop = CancellationToken::new();
    let task = tokio::spawn(super::run(
        store.subscribe(),
        store.follower("fullproxy"),
        ctx,
        stop.clone(),
    ));

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
    // A live change is marked applied once the listeners and pools serve it (the API waits
    // for the mark before it acknowledges a change).
    store
        .delete("127.0.0.1", plain_port, "tcp", "", "")
        .expect("deleted");
    let version = store.snapshot().version;
    assert_eq!(store.settled(version, Duration::from_secs(5)).await, Ok(()));
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("proxy stops")
        .expect("join");
}

/// The proxy over the real KV tier (the golden tiny tokenizer) for one `kvExactMode: 3` rule.
struct KvProxy {
    port: u16,
    rule: Arc<StoredRule>,
    router: Arc<KvRouter>,
    reg: Registry,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl KvProxy {
    /// Round-robin fallback, no blend law and no cold seeding, so endpoints are predictable.
    fn start(endpoint_ports: &[u16]) -> Self {
        Self::start_with(endpoint_ports, KvSettings::default(), TinyTokenizer::load())
    }

    /// [`Self::start`] with other KV settings (the law and seeding stay off) and tokenizer.
    fn start_with(
        endpoint_ports: &[u16],
        settings: KvSettings,
        tokenizer: Arc<dyn PromptTokenizer>,
    ) -> Self {
        let port = free_port();
        let eps: Vec<serde_json::Value> = endpoint_ports
            .iter()
            .map(|p| serde_json::json!({"endpointIP": "127.0.0.1", "targetPort": p, "kvZmqPort": free_port()}))
            .collect();
        let store = RuleStore::in_memory();
        let rule = serde_json::from_value(serde_json::json!({
            "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "mode": 4, "sel": 0,
                "kvExactMode": 3, "kvBlockSize": 16, "kvHashAlgo": "sha256_cbor"},
            "endpoints": eps
        }))
        .expect("rule");
        store.upsert(rule).expect("kv rule");
        let rule = store
            .snapshot()
            .rules
            .values()
            .next()
            .expect("stored")
            .clone();
        let (st, reg) = state(KvSettings {
            lb_mode: LbMode::Off,
            coldstart_seed_n: 0,
            // LoxiLB's miss semantics (`no_worker` falls through to `sel`).
            cold_least_work: false,
            ..settings
        });
        let router = Arc::new(KvRouter::new(st, tokenizer));
        let ctx = ProxyContext {
            metrics: ProxyMetrics::unregistered(),
            tier: Some(router.clone()),
            config: ProxyConfig::default(),
            health: crate::health::board::HealthBoard::new(),
            sockets: crate::listen::ListenSockets::new(Default::default()),
            certs: std::sync::Arc::new(crate::certs::CertStore::in_memory()),
            workers: None,
        };
        let stop = CancellationToken::new();
        let task = tokio::spawn(super::run(
            store.subscribe(),
            store.follower("fullproxy"),
            ctx,
            stop.clone(),
        ));
        Self {
            port,
            rule,
            router,
            reg,
            stop,
            task,
        }
    }

    /// `ep` holds the first `blocks` blocks of `prompt` (as if its engine had published them).
    fn hold(&self, ep: EpIdx, prompt: &str, blocks: usize) {
        let p = Prompt::Text(prompt.into());
        let tokens = TinyTokenizer::load()
            .encode("tiny", ApiKind::Completions, &p, None)
            .expect("tokenize");
        let svc = self.router.state().service(&self.rule).expect("kv rule");
        let keys = svc.hasher.keys(&tokens, 16, &Default::default());
        assert!(
            keys.len() > blocks,
            "the prompt must be longer than what `ep` holds"
        );
        svc.index.store(ep, 0, &keys[..blocks]);
    }

    /// The value of the exposition line starting with `series` (0 when absent).
    fn metric(&self, series: &str) -> f64 {
        crate::kv::testutil::metric_value(&self.reg, series)
    }

    /// Observations of one routing stage (`Tokenize`, `Hash`, `Score`).
    fn stage_count(&self, stage: &str) -> f64 {
        crate::kv::testutil::stage_count(&self.reg, stage)
    }

    fn hits(&self, ep: EpIdx) -> f64 {
        let id = self.rule.id;
        self.metric(&format!(
            "loxilb_pd_kv_tier15_hits_total{{service=\"{id}\",ep_idx=\"{ep}\"}}"
        ))
    }

    fn misses(&self, reason: &str) -> f64 {
        let id = self.rule.id;
        self.metric(&format!(
            "loxilb_pd_kv_tier15_miss_reason_total{{service=\"{id}\",reason=\"{reason}\"}}"
        ))
    }

    async fn shutdown(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("proxy stops")
            .expect("join");
    }
}

/// A prompt of at least three 16-token blocks of the tiny tokenizer, distinct per `tag`.
fn long_prompt(tag: &str) -> String {
    format!("{tag}: the quick brown fox jumps over the lazy dog while the cat sleeps in the sun. ")
        .repeat(3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_tier_tokenizes_and_hashes_each_request_once() {
    let (b0, b1) = (backend().await, backend().await);
    let p = KvProxy::start(&[b0.port(), b1.port()]);
    let (a, b) = (long_prompt("alpha"), long_prompt("beta"));
    // A cold prompt misses (no_worker) and falls back to round-robin; `routed` then predicts
    // its blocks on that endpoint with the keys of the miss, so the repeat is a hit there.
    let eps = [
        post(p.port, &a).await,
        post(p.port, &a).await,
        post(p.port, &b).await,
        post(p.port, &b).await,
    ];
    assert_eq!(eps, [0, 0, 1, 1]);
    assert_eq!(
        (p.misses("no_worker"), p.hits(0), p.hits(1)),
        (2.0, 1.0, 1.0)
    );
    assert_eq!(
        (p.stage_count("Tokenize"), p.stage_count("Hash")),
        (4.0, 4.0)
    );
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failure_retry_reuses_the_request_keys() {
    let live = backend().await;
    let p = KvProxy::start(&[free_port(), live.port()]);
    let m = long_prompt("gamma");
    p.hold(0, &m, 1);
    // Tier hit on the dead endpoint 0; the retry excludes it, and as only endpoint 0 holds the
    // prefix that attempt is an `excluded` miss, served by round-robin on endpoint 1.
    assert_eq!(post(p.port, &m).await, 1);
    assert_eq!((p.hits(0), p.misses("excluded")), (1.0, 1.0));
    assert_eq!(
        (p.stage_count("Tokenize"), p.stage_count("Hash")),
        (1.0, 1.0)
    );
    // `routed` predicted the whole prompt on endpoint 1 from the same keys: now a hit there.
    assert_eq!(post(p.port, &m).await, 1);
    assert_eq!(p.hits(1), 1.0);
    assert_eq!(
        (p.stage_count("Tokenize"), p.stage_count("Hash")),
        (2.0, 2.0)
    );
    p.shutdown().await;
}

/// POSTs `body` to `path`: the status and the `x-loxilb-endpoint` of the answer.
async fn post_json(port: u16, path: &str, body: &serde_json::Value) -> (u16, Option<usize>) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = hyper::Request::post(format!("http://127.0.0.1:{port}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("req");
    for _ in 0..200 {
        if let Ok(resp) = client.request(req.clone()).await {
            let ep = resp
                .headers()
                .get("x-loxilb-endpoint")
                .and_then(|v| v.to_str().ok()?.parse().ok());
            let status = resp.status().as_u16();
            let _ = resp.into_body().collect().await;
            return (status, ep);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("proxy on {port} never answered");
}

/// Issue 9 §1: a single 64 KiB word and a chat with more messages than the bound are not
/// tokenized; each is served (200) by the rule's round-robin with the miss `oversize`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_beyond_the_bounds_skip_tokenization_and_are_served_by_the_fallback() {
    let (b0, b1) = (backend().await, backend().await);
    let mut settings = KvSettings::default();
    settings.bounds.max_messages = 8;
    let p = KvProxy::start_with(&[b0.port(), b1.port()], settings, TinyTokenizer::load());
    let word = "a".repeat(64 << 10);
    let body = serde_json::json!({"model": "tiny", "prompt": word});
    assert_eq!(
        post_json(p.port, "/v1/completions", &body).await,
        (200, Some(0))
    );
    let msgs: Vec<_> = (0..9)
        .map(|i| serde_json::json!({"role": "user", "content": format!("message {i}")}))
        .collect();
    let chat = serde_json::json!({"model": "tiny", "messages": msgs});
    assert_eq!(
        post_json(p.port, "/v1/chat/completions", &chat).await,
        (200, Some(1))
    );
    assert_eq!(p.misses("oversize"), 2.0);
    assert_eq!(p.stage_count("Tokenize"), 0.0, "neither was tokenized");
    // An ordinary prompt still goes through the tier.
    assert_eq!(post(p.port, &long_prompt("delta")).await, 0);
    assert_eq!(
        (p.stage_count("Tokenize"), p.misses("no_worker")),
        (1.0, 1.0)
    );
    p.shutdown().await;
}

/// The tiny tokenizer, except that a prompt containing "slow" blocks until the test releases
/// it (one release per such prompt).
struct GatedTokenizer {
    inner: Arc<TinyTokenizer>,
    started: std::sync::atomic::AtomicUsize,
    gate: Mutex<std::sync::mpsc::Receiver<()>>,
}

impl PromptTokenizer for GatedTokenizer {
    fn encode(
        &self,
        model: &str,
        api: ApiKind,
        prompt: &Prompt,
        add: Option<bool>,
    ) -> Result<Arc<[u32]>, String> {
        if matches!(prompt, Prompt::Text(t) if t.contains("slow")) {
            self.started
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = self.gate.lock().recv();
        }
        self.inner.encode(model, api, prompt, add)
    }
}

/// Issue 9 §1/§2: with one tokenization thread busy, a request waits at most the decision
/// budget (miss `budget`), a request finding the queue full is refused at once (miss
/// `overload`), every one is served by round-robin with 200 while the tokenizer is still
/// stuck, and the queued job whose requester gave up is skipped, not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_tokenizer_means_budget_and_overload_misses_served_by_the_fallback() {
    let (b0, b1) = (backend().await, backend().await);
    let (release, gate) = std::sync::mpsc::channel();
    let tok = Arc::new(GatedTokenizer {
        inner: TinyTokenizer::load(),
        started: Default::default(),
        gate: Mutex::new(gate),
    });
    let settings = KvSettings {
        tokenize_workers: 1,
        tokenize_queue: 1,
        decision_budget: Duration::from_millis(100),
        ..KvSettings::default()
    };
    let p = KvProxy::start_with(&[b0.port(), b1.port()], settings, tok.clone());
    let started = || tok.started.load(std::sync::atomic::Ordering::SeqCst);
    let slow = |tag: &str| serde_json::json!({"model": "tiny", "prompt": long_prompt(&format!("slow {tag}"))});
    // A: its job holds the only thread; A itself is served after the budget.
    let a = post_json(p.port, "/v1/completions", &slow("a")).await;
    assert_eq!(a, (200, Some(0)));
    assert_eq!((started(), p.misses("budget")), (1, 1.0));
    // B: queued behind A's job, gives up after the budget; C: the queue (1) is full.
    assert_eq!(
        post_json(p.port, "/v1/completions", &slow("b")).await,
        (200, Some(1))
    );
    assert_eq!(
        post_json(p.port, "/v1/completions", &slow("c")).await,
        (200, Some(0))
    );
    assert_eq!((p.misses("budget"), p.misses("overload")), (2.0, 1.0));
    assert_eq!(started(), 1, "the tokenizer is still stuck on A");
    release.send(()).expect("A's job waits");
    let stats = p.router.workers().stats();
    for _ in 0..500 {
        if stats.skipped.load(std::sync::atomic::Ordering::Relaxed) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        stats.skipped.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "B's job skipped"
    );
    assert_eq!(
        started(),
        1,
        "B's abandoned job never reached the tokenizer"
    );
    p.shutdown().await;
}

/// Issue 9 §3: a body trickled slower than `LOXI_BODY_TIMEOUT_MS` is answered 408 (and the
/// connection is not held for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_arrive_in_time_gets_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let b0 = backend().await;
    let port = free_port();
    let store = RuleStore::in_memory();
    store
        .upsert(
            serde_json::from_value(serde_json::json!({
                "serviceArguments": {"externalIP": "127.0.0.1", "port": port, "mode": 4, "sel": 0},
                "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": b0.port()}]
            }))
            .expect("rule"),
        )
        .expect("upsert");
    let ctx = ProxyContext {
        metrics: ProxyMetrics::unregistered(),
        tier: None,
        config: ProxyConfig {
            body_timeout: Duration::from_millis(300),
            ..ProxyConfig::default()
        },
        health: crate::health::board::HealthBoard::new(),
        sockets: crate::listen::ListenSockets::new(Default::default()),
        certs: std::sync::Arc::new(crate::certs::CertStore::in_memory()),
        workers: None,
    };
    let stop = CancellationToken::new();
    let task = tokio::spawn(super::run(
        store.subscribe(),
        store.follower("fullproxy"),
        ctx,
        stop.clone(),
    ));
    // A whole request first: the listener is up and bodies that arrive are served.
    assert_eq!(
        post_json(port, "/v1/completions", &serde_json::json!({"prompt": "x"}))
            .await
            .0,
        200
    );
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let start = std::time::Instant::now();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"",
    )
    .await
    .expect("write");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(read.is_ok(), "the connection was held");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    // The unread rest of the body ends the connection, and the answer says so.
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{answer}"
    );
    assert!(start.elapsed() >= Duration::from_millis(300));
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("proxy stops")
        .expect("join");
}
