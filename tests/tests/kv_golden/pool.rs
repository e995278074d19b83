//! Scenarios 9 (template failure), 10 (`/v1/responses` shapes), 11 (missing tokenizer) and
//! 12 (BOS) on the real captured tokenizers.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use loxi_user::kv::block_hash::{BlockHasher, HashAlgo, RequestExtras};
use loxi_user::kv::tokenizer::{TokenizeError, TokenizerMetrics, TokenizerPool};
use loxi_user::request::{ApiKind, ChatMessage, Prompt};
use prometheus_client::registry::Registry;

use super::support::{golden, promtool_check, request_of, shared_dir, staged_tokenizer_dir};

#[derive(Clone, Default)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogBuf {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log buffer")).into_owned()
    }
}

fn with_logs<R>(f: impl FnOnce() -> R) -> (R, String) {
    let buf = LogBuf::default();
    let writer = buf.clone();
    let sub = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let out = tracing::subscriber::with_default(sub, f);
    (out, buf.text())
}

fn metrics_text(registry: &Registry) -> String {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, registry).expect("encode metrics");
    s
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

fn text(s: &str) -> Prompt {
    Prompt::Text(s.into())
}

#[test]
fn missing_tokenizer_logs_once_sets_degraded_gauge_and_is_negative_cached() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut registry = Registry::default();
    let metrics = TokenizerMetrics::register(&mut registry);
    // Labelled by name only because a rule names the model (else `other`).
    metrics.set_rule_models(["acme/ghost"]);
    let pool = TokenizerPool::new(dir.path().to_owned(), metrics)
        .with_retry_interval(Duration::from_secs(3600));
    let ((), logs) = with_logs(|| {
        for _ in 0..100 {
            let err = pool
                .encode("acme/ghost", ApiKind::Completions, &text("hello"), None)
                .expect_err("no tokenizer");
            assert_eq!(
                err,
                TokenizeError::NoTokenizer {
                    model: "acme/ghost".into()
                }
            );
        }
        // Staged after the failure: still negative-cached within the retry interval.
        std::os::unix::fs::symlink(
            shared_dir().join("golden/tiny-model"),
            dir.path().join("acme__ghost"),
        )
        .expect("symlink");
        assert!(
            pool.encode("acme/ghost", ApiKind::Completions, &text("hello"), None)
                .is_err()
        );
        // Token-id prompts need no tokenizer.
        let ids = pool
            .encode(
                "acme/ghost",
                ApiKind::Completions,
                &Prompt::TokenIds(vec![5, 6]),
                None,
            )
            .expect("ids");
        assert_eq!(&ids[..], &[5, 6]);
    });
    assert_eq!(
        logs.lines().count(),
        1,
        "exactly one log line for 101 failing requests:\n{logs}"
    );
    assert!(
        logs.contains("ERROR") && logs.contains("acme/ghost"),
        "{logs}"
    );
    let m = metrics_text(&registry);
    assert!(
        m.contains("loxilb_kv_tokenizer_degraded{model=\"acme/ghost\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("loxilb_kv_tokenizer_load_failures_total{model=\"acme/ghost\"} 1"),
        "{m}"
    );
    promtool_check(&loxi_user::metrics::encode_text(&registry).expect("encode"));
}

#[test]
fn failed_load_is_retried_after_the_interval_and_clears_the_degraded_gauge() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut registry = Registry::default();
    let metrics = TokenizerMetrics::register(&mut registry);
    metrics.set_rule_models(["late"]);
    let pool =
        TokenizerPool::new(dir.path().to_owned(), metrics).with_retry_interval(Duration::ZERO);
    let ((), logs) = with_logs(|| {
        for _ in 0..3 {
            assert!(
                pool.encode("late", ApiKind::Completions, &text("hello"), None)
                    .is_err()
            );
        }
        std::os::unix::fs::symlink(
            shared_dir().join("golden/tiny-model"),
            dir.path().join("late"),
        )
        .expect("symlink");
        let ids = pool
            .encode("late", ApiKind::Completions, &text("hello"), None)
            .expect("loaded on retry");
        assert!(!ids.is_empty());
    });
    assert_eq!(logs.matches("ERROR").count(), 1, "{logs}");
    let m = metrics_text(&registry);
    assert!(
        m.contains("loxilb_kv_tokenizer_degraded{model=\"late\"} 0"),
        "{m}"
    );
    assert!(
        m.contains("loxilb_kv_tokenizer_load_failures_total{model=\"late\"} 3"),
        "{m}"
    );
}

fn stage_with_template(dir: &std::path::Path, model: &str, template: &str) {
    let mdir = dir.join(model);
    std::fs::create_dir_all(&mdir).expect("mkdir");
    std::fs::copy(
        shared_dir().join("golden/tiny-model/tokenizer.json"),
        mdir.join("tokenizer.json"),
    )
    .expect("copy");
    let cfg = serde_json::json!({ "eos_token": "<|im_end|>", "chat_template": template });
    std::fs::write(mdir.join("tokenizer_config.json"), cfg.to_string()).expect("write config");
}

#[test]
fn template_failure_is_a_template_error_counted_per_model_and_completions_still_work() {
    let dir = tempfile::tempdir().expect("tempdir");
    stage_with_template(
        dir.path(),
        "raises",
        "{{ raise_exception('System role not supported') }}",
    );
    stage_with_template(dir.path(), "broken", "{% for m in messages %}");
    let mut registry = Registry::default();
    let metrics = TokenizerMetrics::register(&mut registry);
    metrics.set_rule_models(["raises", "broken"]);
    let pool = TokenizerPool::new(dir.path().to_owned(), metrics);
    let chat = Prompt::Messages(vec![msg("system", "s"), msg("user", "u")]);
    let ((), logs) = with_logs(|| {
        for _ in 0..2 {
            match pool.encode("raises", ApiKind::ChatCompletions, &chat, None) {
                Err(TokenizeError::Template { model, message }) => {
                    assert_eq!(model, "raises");
                    assert!(message.contains("System role not supported"), "{message}");
                }
                other => panic!("expected a template error, got {other:?}"),
            }
        }
        let err = pool
            .encode("broken", ApiKind::Responses, &chat, None)
            .expect_err("syntax error");
        assert!(matches!(err, TokenizeError::Template { .. }), "{err:?}");
        assert!(
            pool.encode("raises", ApiKind::Completions, &text("plain text"), None)
                .is_ok()
        );
    });
    let m = metrics_text(&registry);
    assert!(
        m.contains("loxilb_kv_tokenizer_template_errors_total{model=\"raises\"} 2"),
        "{m}"
    );
    assert!(
        m.contains("loxilb_kv_tokenizer_template_errors_total{model=\"broken\"} 1"),
        "{m}"
    );
    assert_eq!(
        logs.matches("WARN").count(),
        2,
        "one warning per model:\n{logs}"
    );
    promtool_check(&loxi_user::metrics::encode_text(&registry).expect("encode"));
}

#[test]
fn bos_completions_add_one_bos_chat_renders_one_and_responses_two() {
    let dir = staged_tokenizer_dir();
    let pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    let lead = |ids: &[u32]| ids.iter().take_while(|&&t| t == 0).count();
    let c = pool
        .encode("bos-tiny", ApiKind::Completions, &text("Hello there"), None)
        .expect("ok");
    assert_eq!(lead(&c), 1);
    let c = pool
        .encode(
            "bos-tiny",
            ApiKind::Completions,
            &text("Hello there"),
            Some(false),
        )
        .expect("ok");
    assert_eq!(lead(&c), 0);
    let chat = Prompt::Messages(vec![msg("user", "Hello there")]);
    let ch = pool
        .encode("bos-tiny", ApiKind::ChatCompletions, &chat, None)
        .expect("ok");
    assert_eq!(lead(&ch), 1);
    // `<｜User｜>` = 128803 right after the template's BOS; generation prompt ends `<think>\n`.
    assert_eq!(ch[1], 128_803);
    assert!(ch.contains(&128_804) && ch.contains(&128_821));
    let ch2 = pool
        .encode("bos-tiny", ApiKind::ChatCompletions, &chat, Some(true))
        .expect("ok");
    assert_eq!(lead(&ch2), 2);
    let r = pool
        .encode("bos-tiny", ApiKind::Responses, &chat, None)
        .expect("ok");
    assert_eq!(lead(&r), 2);
    assert_eq!(&r[1..], &ch[..]);
    // The ChatML model has no BOS at all.
    let t = pool
        .encode("tiny", ApiKind::Completions, &text("Hello there"), None)
        .expect("ok");
    let t_plain = pool
        .encode(
            "tiny",
            ApiKind::Completions,
            &text("Hello there"),
            Some(false),
        )
        .expect("ok");
    assert_eq!(t, t_plain);
}

#[test]
fn responses_next_turn_shares_leading_blocks_and_all_input_shapes_work() {
    let dir = staged_tokenizer_dir();
    let pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    let cap = golden("bos_kv_events_capture.json");
    let req = cap["requests"]
        .as_array()
        .expect("requests")
        .iter()
        .find(|r| r["name"] == "responses_instructions_and_messages")
        .expect("captured responses request");
    let body = &req["request_body"];
    let (api, first, add) = request_of("POST /v1/responses", body).expect("prompt");
    let mut next = body.clone();
    let input = next["input"].as_array_mut().expect("input list");
    input.push(serde_json::json!({"role": "assistant", "content": "It was signed by R. Diaz."}));
    input.push(serde_json::json!({"role": "user", "content": "At what time?"}));
    let (_, second, _) = request_of("POST /v1/responses", &next).expect("prompt");
    let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"));
    let keys = |p: &Prompt| {
        let ids = pool.encode("bos-tiny", api, p, add).expect("tokenizes");
        hasher.keys(&ids, 32, &RequestExtras::default())
    };
    let (k1, k2) = (keys(&first), keys(&second));
    assert!(!k1.is_empty() && k2.len() > k1.len());
    let shared = k1.iter().zip(&k2).take_while(|(a, b)| a == b).count();
    assert!(shared >= 4, "shared leading blocks: {shared}");
    // A plain string `input`, with and without `instructions`.
    let plain = serde_json::json!({"model": "bos-tiny", "input": "Where is order 3003?"});
    let (_, p, _) = request_of("POST /v1/responses", &plain).expect("prompt");
    let ids = pool
        .encode("bos-tiny", ApiKind::Responses, &p, None)
        .expect("string input");
    assert_eq!(&ids[..3], &[0, 0, 128_803]);
    let with_instr = serde_json::json!({"model": "bos-tiny", "instructions": "Be brief.", "input": "Where is order 3003?"});
    let (_, p2, _) = request_of("POST /v1/responses", &with_instr).expect("prompt");
    let ids2 = pool
        .encode("bos-tiny", ApiKind::Responses, &p2, None)
        .expect("instructions + input");
    assert!(ids2.len() > ids.len());
    assert_eq!(&ids2[..2], &[0, 0]);
    assert_ne!(ids2[2], 128_803, "the system text comes before <｜User｜>");
}

#[test]
fn empty_prompts_are_reported_as_empty() {
    let dir = staged_tokenizer_dir();
    let pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    assert_eq!(
        pool.encode("tiny", ApiKind::Completions, &text(""), None),
        Err(TokenizeError::Empty)
    );
    assert_eq!(
        pool.encode(
            "tiny",
            ApiKind::Completions,
            &Prompt::TokenIds(vec![]),
            None
        ),
        Err(TokenizeError::Empty)
    );
    assert_eq!(
        pool.encode(
            "tiny",
            ApiKind::ChatCompletions,
            &Prompt::Messages(vec![]),
            None
        ),
        Err(TokenizeError::Empty)
    );
}

#[test]
fn repeated_prompt_is_served_from_the_cache() {
    let dir = staged_tokenizer_dir();
    let mut registry = Registry::default();
    let metrics = TokenizerMetrics::register(&mut registry);
    let pool = TokenizerPool::new(dir.path().to_owned(), metrics);
    let chat = Prompt::Messages(vec![msg("system", "sys"), msg("user", "question")]);
    let a = pool
        .encode("tiny", ApiKind::ChatCompletions, &chat, None)
        .expect("ok");
    let b = pool
        .encode("tiny", ApiKind::ChatCompletions, &chat, None)
        .expect("ok");
    assert!(Arc::ptr_eq(&a, &b), "second call returns the cached ids");
    let m = metrics_text(&registry);
    assert!(m.contains("loxilb_kv_tokenize_cache_hits_total 1"), "{m}");
    assert!(m.contains("loxilb_kv_tokenize_cache_misses_total 1"), "{m}");
}
