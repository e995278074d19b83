//! Tier 1.5's tokenizer path end to end: the real `loxilb` daemon reading the golden tokenizer
//! files, two real HTTP backends on loopback, real OpenAI requests. Scenarios 9 (a chat template
//! that fails to render), 10 (`/v1/responses`) and 11 (no tokenizer for the model) of
//! `../shared/cases/routing-scenarios.md`.
//!
//! Every rule is `kvExactMode: 3` over `sel: 0` (round-robin), so a tier-1.5 miss shows twice:
//! as the tier's miss reason and as a round-robin selection, which alternates 0, 1, 0, …
//! The rule's `kvZmqPort` is a free port nobody publishes on: no engine event ever arrives, the
//! only blocks are the ones loxi predicts after routing a request.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use loxi_tests::backend::Backend;
use loxi_tests::harness::{Daemon, DaemonOpts, free_port};
use loxi_tests::shared_dir;
use loxi_tests::sim::Sim;
use serde_json::{Value, json};

const RR: &str = r#"loxilb_proxy_selections_total{selector="rr",reason="rr"}"#;
const KV_OVERLAP: &str = r#"loxilb_proxy_selections_total{selector="kv",reason="kv_overlap"}"#;

fn miss(reason: &str) -> String {
    format!(r#"loxilb_pd_kv_tier15_miss_reason_total{{service="1",reason="{reason}"}}"#)
}

fn hits(ep: usize) -> String {
    format!(r#"loxilb_pd_kv_tier15_hits_total{{service="1",ep_idx="{ep}"}}"#)
}

/// Value of the sample whose name and labels are exactly `series`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

/// Metrics before and after one request.
struct Delta {
    before: String,
    after: String,
}

impl Delta {
    fn of(&self, series: &str) -> f64 {
        let v = |t: &str| sample(t, series).unwrap_or(0.0);
        v(&self.after) - v(&self.before)
    }
}

/// One answer as the client saw it.
struct Answer {
    status: u16,
    endpoint: Option<usize>,
    backend: Option<String>,
}

/// A daemon with one kvExactMode-3 round-robin rule over two backends named "0" and "1" (none
/// when the engines are `vllm-sim`s the test keeps).
struct Fleet {
    d: Daemon,
    backends: Vec<Backend>,
    vip: u16,
    client: Client<HttpConnector, Full<Bytes>>,
    _tokenizers: tempfile::TempDir,
}

impl Fleet {
    /// `tokenizers` is staged as the daemon's `--tokenizer-dir`; `env` goes to the daemon.
    async fn start(tokenizers: tempfile::TempDir, env: &[(&str, &str)]) -> Fleet {
        let backends = [Backend::start("0").await, Backend::start("1").await];
        let (d, vip) = kv_daemon(&tokenizers, env, &backends.each_ref().map(Backend::port)).await;
        let client = Client::builder(TokioExecutor::new()).build_http();
        let f = Fleet {
            d,
            backends: backends.into(),
            vip,
            client,
            _tokenizers: tokenizers,
        };
        f.wait_listening().await;
        f
    }

    async fn wait_listening(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.vip))
            .await
            .is_err()
        {
            assert!(std::time::Instant::now() < deadline, "VIP never opened");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// POSTs `body` to `path` on the VIP; checks 200 and that the backend that answered is the
    /// one `x-loxilb-endpoint` names; returns the endpoint and the metrics delta.
    async fn routed(&self, path: &str, body: &Value) -> (usize, Delta) {
        let before = self.d.metrics_text().await;
        let a = self.post(path, body).await;
        assert_eq!(a.status, 200, "{path} {body}");
        let ep = a.endpoint.expect("x-loxilb-endpoint");
        assert_eq!(
            a.backend,
            Some(ep.to_string()),
            "the named endpoint answered"
        );
        let after = self.d.metrics_text().await;
        (ep, Delta { before, after })
    }

    async fn post(&self, path: &str, body: &Value) -> Answer {
        let req = http::Request::post(format!("http://127.0.0.1:{}{path}", self.vip))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("request");
        let resp = tokio::time::timeout(Duration::from_secs(10), self.client.request(req))
            .await
            .expect("answer within 10 s")
            .expect("proxy answered");
        let h = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(String::from)
        };
        let (endpoint, backend) = (h("x-loxilb-endpoint"), h("x-backend"));
        let status = resp.status().as_u16();
        let _ = resp.into_body().collect().await;
        Answer {
            status,
            endpoint: endpoint.and_then(|v| v.parse().ok()),
            backend,
        }
    }

    /// The `tokenizer` section of the rule's parity report (`loxicmd get kvparity`).
    async fn tokenizer_report(&self) -> Value {
        let (code, body) = self
            .d
            .get("/netlox/v1/config/ai/kv/parity?service_id=1")
            .await
            .expect("parity");
        assert_eq!(code, 200, "{body}");
        let v: Value = serde_json::from_str(&body).expect("parity json");
        v["tokenizer"].clone()
    }

    /// Log lines of the daemon that contain `needle`.
    fn log_lines(&self, needle: &str) -> Vec<String> {
        let log = self.d.log_text();
        log.lines()
            .filter(|l| l.contains(needle))
            .map(String::from)
            .collect()
    }
}

/// A daemon (`--tokenizer-dir` = `tokenizers`, environment `env`) with one kvExactMode-3
/// round-robin rule (service 1) on a free VIP port over the engines on loopback `ports`;
/// returns it and the VIP port, once the rule is in.
async fn kv_daemon(
    tokenizers: &tempfile::TempDir,
    env: &[(&str, &str)],
    ports: &[u16],
) -> (Daemon, u16) {
    let mut opts = DaemonOpts {
        tokenizer_dir: Some(tokenizers.path().to_path_buf()),
        ..Default::default()
    };
    for (k, v) in env {
        opts = opts.env(k, v);
    }
    let d = Daemon::start(opts).await;
    let vip = free_port();
    let eps: Vec<Value> = ports
        .iter()
        // Engines on one host: each its own KV-event port (nothing publishes there).
        .map(|p| json!({"endpointIP": "127.0.0.1", "targetPort": p, "kvZmqPort": free_port()}))
        .collect();
    let rule = json!({
        "serviceArguments": {"externalIP": "127.0.0.1", "port": vip, "protocol": "tcp",
            "mode": 4, "sel": 0, "kvExactMode": 3, "kvBlockSize": 16,
            "kvHashAlgo": "sha256_cbor"},
        "endpoints": eps,
    });
    let (code, body) = d.post_rule(&rule).await;
    assert!(code == 200 || code == 201, "rule rejected: {code} {body}");
    (d, vip)
}

/// A tokenizer dir with `(served name, golden model dir)` staged as symlinks.
fn tokenizer_dir(models: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, src) in models {
        std::os::unix::fs::symlink(shared_dir().join("golden").join(src), dir.path().join(name))
            .expect("symlink");
    }
    dir
}

/// A three-turn support conversation for `model` (far more than one 16-token block).
fn chat(model: &str) -> Value {
    json!({"model": model, "max_tokens": 2, "messages": [
        {"role": "system", "content": "You are the dispatch assistant of a freight company. Answer in one sentence and always quote the consignment number."},
        {"role": "user", "content": "Where is consignment 7731 right now?"},
        {"role": "assistant", "content": "Consignment 7731 left the Rotterdam depot this morning."},
        {"role": "user", "content": "When will it reach Lyon?"},
    ]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_11_missing_tokenizer_logs_once_flags_degraded_and_rr_serves_every_request() {
    let f = Fleet::start(tokenizer_dir(&[]), &[]).await;
    // The rule is a wildcard pool: a model no rule names is labelled `other`, never by the
    // client's string (which would let any client create series).
    let degraded = r#"loxilb_kv_tokenizer_degraded{model="other"}"#;
    assert_eq!(sample(&f.d.metrics_text().await, degraded), None);
    let mut eps = Vec::new();
    for i in 0..6 {
        let (ep, m) = f.routed("/v1/chat/completions", &chat("acme/ghost")).await;
        assert_eq!(
            m.of(&miss("tokenize")),
            1.0,
            "request {i}: one tokenize miss"
        );
        assert_eq!(m.of(RR), 1.0, "request {i}: routed by the rule's sel");
        assert_eq!(m.of(KV_OVERLAP), 0.0, "request {i}");
        assert_eq!(sample(&m.after, degraded), Some(1.0), "request {i}");
        eps.push(ep);
    }
    assert_eq!(eps, [0, 1, 0, 1, 0, 1], "round-robin serves every request");
    let counts: Vec<usize> = f.backends.iter().map(Backend::request_count).collect();
    assert_eq!(counts, [3, 3]);
    // The rule's parity report says its prompts do not tokenize, naming the model, the
    // failures and where its tokenizer belongs.
    let t = f.tokenizer_report().await;
    assert_eq!(
        (
            &t["state"],
            &t["failing"][0]["model"],
            &t["failing"][0]["prompts"],
            &t["failing"][0]["failures"]
        ),
        (
            &json!("failing"),
            &json!("acme/ghost"),
            &json!("chat"),
            &json!(6)
        ),
        "{t}"
    );
    let remedy = t["failing"][0]["remedy"].as_str().unwrap_or_default();
    let staged = f._tokenizers.path().join("acme__ghost");
    assert!(
        remedy.contains(&format!(
            "in the directory {:?} (--tokenizer-dir)",
            staged.display().to_string()
        )),
        "{remedy}"
    );
    let lines = f.log_lines("acme/ghost");
    assert_eq!(lines.len(), 1, "one log line for six requests: {lines:#?}");
    assert!(lines[0].contains("ERROR"), "{}", lines[0]);
}

/// A client's misspelt model on engines that list theirs (`/v1/models`, real `vllm-sim`s):
/// once the daemon's poll of the engines answered, the request misses with `model_unknown`
/// without a tokenizer lookup and the engine answers it 404; nothing reads as a tokenizer
/// failure (no degraded series, the parity report's tokenizer state `ok`, no error line),
/// while the served model is tokenized and routed by the tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misspelt_model_is_model_unknown_once_the_engines_listed_theirs() {
    let sims = [Sim::start("tiny").await, Sim::start("tiny").await];
    let tokenizers = tokenizer_dir(&[("tiny", "tiny-model")]);
    let env = [("LOXI_KV_MODELS_POLL_MS", "100")];
    let (d, vip) = kv_daemon(&tokenizers, &env, &sims.each_ref().map(Sim::port)).await;
    let f = Fleet {
        d,
        backends: Vec::new(),
        vip,
        client: Client::builder(TokioExecutor::new()).build_http(),
        _tokenizers: tokenizers,
    };
    f.wait_listening().await;
    // Ten poll intervals: the first round that sees the rule has answered by then.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let typo = chat("tiny-modle");
    for i in 0..3 {
        let before = f.d.metrics_text().await;
        let a = f.post("/v1/chat/completions", &typo).await;
        assert_eq!(
            a.status, 404,
            "request {i}: the engine answers an unknown model"
        );
        let m = Delta {
            before,
            after: f.d.metrics_text().await,
        };
        assert_eq!(
            (m.of(&miss("model_unknown")), m.of(&miss("tokenize"))),
            (1.0, 0.0),
            "request {i}"
        );
    }
    let text = f.d.metrics_text().await;
    assert_eq!(
        sample(&text, r#"loxilb_kv_tokenizer_degraded{model="other"}"#),
        None,
        "no tokenizer was looked up"
    );
    let t = f.tokenizer_report().await;
    assert_eq!(t["state"], json!("ok"), "{t}");
    assert!(f.log_lines("no usable tokenizer").is_empty());
    // The served model is tokenized: its miss is no guard's, and it is answered.
    let before = f.d.metrics_text().await;
    let a = f.post("/v1/chat/completions", &chat("tiny")).await;
    assert_eq!(a.status, 200);
    let m = Delta {
        before,
        after: f.d.metrics_text().await,
    };
    assert_eq!(
        (m.of(&miss("model_unknown")), m.of(&miss("tokenize"))),
        (0.0, 0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_model_names_cannot_flood_the_log() {
    let f = Fleet::start(tokenizer_dir(&[]), &[]).await;
    let failures = r#"loxilb_kv_tokenizer_load_failures_total{model="other"}"#;
    for i in 0..20 {
        let (_, m) = f
            .routed("/v1/chat/completions", &chat(&format!("made-up/m{i}")))
            .await;
        assert_eq!(m.of(RR), 1.0, "request {i}: routed by the rule's sel");
    }
    let errors = f.log_lines("no usable tokenizer");
    assert_eq!(
        errors.len(),
        1,
        "one error line for 20 made-up models: {errors:#?}"
    );
    assert!(errors[0].contains("made-up/m0"), "{}", errors[0]);
    assert_eq!(
        sample(&f.d.metrics_text().await, failures),
        Some(20.0),
        "every failed load is counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_9_chat_template_that_fails_to_render_is_counted_and_rr_routes_the_request() {
    let dir = tokenizer_dir(&[("tiny", "tiny-model")]);
    let raises = dir.path().join("raises");
    std::fs::create_dir(&raises).expect("mkdir");
    std::fs::copy(
        shared_dir().join("golden/tiny-model/tokenizer.json"),
        raises.join("tokenizer.json"),
    )
    .expect("copy tokenizer.json");
    let template = "{{ raise_exception('System role not supported') }}";
    let cfg = json!({"eos_token": "<|im_end|>", "chat_template": template});
    std::fs::write(raises.join("tokenizer_config.json"), cfg.to_string()).expect("config");
    // LoxiLB's miss semantics (`sel`): the cold requests below are `no_worker` misses that
    // the rule's round robin routes (the default, least-work cold placement, is tested in
    // kv_balance.rs and engine_load.rs).
    let f = Fleet::start(dir, &[("LOXI_KV_COLD_PLACEMENT", "sel")]).await;
    let errors = r#"loxilb_kv_tokenizer_template_errors_total{model="other"}"#;
    let mut eps = Vec::new();
    for i in 0..2 {
        let (ep, m) = f.routed("/v1/chat/completions", &chat("raises")).await;
        // Exactly one: the request's prompt is rendered once; `routed()` reuses the miss the
        // decision recorded (it rendered the failing template again, and counted 2, before).
        assert_eq!(
            m.of(errors),
            1.0,
            "request {i}: template error counted once for the model"
        );
        assert_eq!(m.of(&miss("tokenize")), 1.0, "request {i}");
        assert_eq!(m.of(RR), 1.0, "request {i}: routed by the rule's sel");
        eps.push(ep);
    }
    assert_eq!(eps, [0, 1]);
    let t = f.tokenizer_report().await;
    assert_eq!(
        (&t["state"], &t["failing"]),
        (
            &json!("failing"),
            &json!([{"model": "raises", "prompts": "chat", "failures": 2,
                     "remedy": t["failing"][0]["remedy"]}])
        ),
        "{t}"
    );
    // The same model's completions need no template: tokenized, an ordinary cold miss.
    let prompt = chat("raises")["messages"][0]["content"].clone();
    let body = json!({"model": "raises", "prompt": prompt, "max_tokens": 2});
    let (_, m) = f.routed("/v1/completions", &body).await;
    assert_eq!((m.of(errors), m.of(&miss("tokenize"))), (0.0, 0.0));
    assert_eq!(m.of(&miss("no_worker")), 1.0);
    let t = f.tokenizer_report().await;
    assert_eq!(
        (&t["failing"][0]["prompts"], &t["failing"][0]["failures"]),
        (&json!("chat"), &json!(2)),
        "a completion does not clear the model's failing chat template: {t}"
    );
    // Another model's template renders: its chat is tokenized, and nothing is counted for it.
    let (_, m) = f.routed("/v1/chat/completions", &chat("tiny")).await;
    assert_eq!((m.of(errors), m.of(&miss("tokenize"))), (0.0, 0.0));
    let tiny_errors = r#"loxilb_kv_tokenizer_template_errors_total{model="tiny"}"#;
    assert_eq!(sample(&m.after, tiny_errors).unwrap_or(0.0), 0.0);
    let lines = f.log_lines("chat template unusable");
    assert_eq!(lines.len(), 1, "one warning for the model: {lines:#?}");
    assert!(lines[0].contains("raises"), "{}", lines[0]);
}

/// A request and its follow-up: the first is a cold miss routed by round-robin, the second
/// goes to the same endpoint on the blocks loxi predicted there after the first (the only
/// blocks in the index: no engine publishes). Returns that endpoint.
async fn follows_first_turn(f: &Fleet, first: &Value, next: &Value) -> usize {
    let (ep, m) = f.routed("/v1/responses", first).await;
    assert_eq!(
        m.of(&miss("no_worker")),
        1.0,
        "first request is cold: {first}"
    );
    assert_eq!(m.of(RR), 1.0);
    let (next_ep, m) = f.routed("/v1/responses", next).await;
    assert_eq!(
        next_ep, ep,
        "the follow-up stays on the first request's worker: {next}"
    );
    assert_eq!(
        m.of(KV_OVERLAP),
        1.0,
        "chosen by a non-zero predicted overlap"
    );
    assert_eq!((m.of(&hits(ep)), m.of(RR)), (1.0, 0.0));
    assert_eq!(m.of(&miss("tokenize")), 0.0);
    ep
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scenario_10_responses_next_turn_and_every_input_shape_route_to_the_first_worker() {
    // Predicted blocks live 30 s (default 5 s) so a slow CI machine cannot expire them
    // between a request and its follow-up.
    let dir = tokenizer_dir(&[("bos-tiny", "bos-model")]);
    // and LoxiLB's miss semantics: a cold first turn is a `no_worker` miss routed by round
    // robin.
    let f = Fleet::start(
        dir,
        &[
            ("LOXI_KV_PREDICT_TTL_MS", "30000"),
            ("LOXI_KV_COLD_PLACEMENT", "sel"),
        ],
    )
    .await;
    let cap: Value = serde_json::from_str(
        &std::fs::read_to_string(shared_dir().join("golden/bos_kv_events_capture.json"))
            .expect("capture"),
    )
    .expect("capture json");
    let first = cap["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .find(|r| r["name"] == "responses_instructions_and_messages")
        .expect("captured /v1/responses request")["request_body"]
        .clone();
    assert!(first["input"].is_array(), "input is a message list");
    let mut next = first.clone();
    let input = next["input"].as_array_mut().expect("input list");
    input.push(json!({"role": "assistant", "content": "It was signed by R. Diaz."}));
    input.push(json!({"role": "user", "content": "At what time?"}));
    let listed = follows_first_turn(&f, &first, &next).await;
    // `input` as a plain string, then `instructions` + `input`: each repeated.
    let plain = json!({"model": "bos-tiny", "max_output_tokens": 2,
        "input": "List every consignment that left the Rotterdam depot this week, with its destination and expected arrival date."});
    let string_ep = follows_first_turn(&f, &plain, &plain).await;
    let instructed = json!({"model": "bos-tiny", "max_output_tokens": 2,
        "instructions": "Reply as the night-shift dispatcher: short sentences, metric units, consignment numbers first.",
        "input": "Which trucks are still waiting at gate four?"});
    let instructed_ep = follows_first_turn(&f, &instructed, &instructed).await;
    assert_eq!(
        [listed, string_ep, instructed_ep],
        [0, 1, 0],
        "cold requests were rr's"
    );
    let (code, inv) =
        f.d.get("/netlox/v1/config/ai/kv/inventory?service_id=1")
            .await
            .expect("inventory");
    let inv: Value = serde_json::from_str(&inv).expect("inventory json");
    let held: Vec<u64> = inv["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .map(|e| e["blockCount"].as_u64().expect("blockCount"))
        .collect();
    assert_eq!((code, held), (200, vec![0, 0]), "no engine-held blocks");
}
