//! Tokenization of a ~4,096-token chat request (template render + encode) on the real DeepSeek
//! tokenizer of `golden/bos-model`, cold (cache disabled: every call renders and encodes) vs
//! cached (the full-text cache answers after the first call), the conversation's next turn
//! (history segments cached, one new message), and a ~4,000-token completion cold and with its
//! long prefix chunk-cached (a new question after a shared system prompt).
//!
//! `cargo bench -p loxi-user --bench kv_tokenize -- --warm-up-time 1 --measurement-time 3`
//! (reads `$LOXI_SHARED/golden`, default `<workspace>/../shared/golden`).
// `criterion_group!` generates an undocumented `pub fn`.
#![allow(
    missing_docs,
    reason = "criterion_group! generates an undocumented pub fn"
)]

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use loxi_user::kv::tokenizer::{TokenizerMetrics, TokenizerPool};
use loxi_user::request::{ApiKind, ChatMessage, Prompt};

fn shared() -> PathBuf {
    std::env::var_os("LOXI_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"))
}

fn staged() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(
        shared().join("golden/bos-model"),
        dir.path().join("bos-tiny"),
    )
    .expect("symlink");
    dir
}

const FILLER: &str = "Carrier customs dock route claim fragile insurance sorting inventory \
freight 82490 warehouse temperature shipment schedule. Résumé: 北京和上海的订单增长了。 ";

/// A multi-turn chat whose rendered prompt is at least `target` tokens.
fn chat_of(pool: &TokenizerPool, target: usize) -> (Prompt, usize) {
    let mut turns = 1;
    loop {
        let mut msgs = vec![ChatMessage {
            role: "system".into(),
            content: FILLER.repeat(4),
        }];
        for i in 0..turns {
            msgs.push(ChatMessage {
                role: "user".into(),
                content: format!("Question {i}: {}", FILLER.repeat(3)),
            });
            msgs.push(ChatMessage {
                role: "assistant".into(),
                content: format!("Answer {i}: {}", FILLER.repeat(2)),
            });
        }
        msgs.push(ChatMessage {
            role: "user".into(),
            content: "Summarise.".into(),
        });
        let p = Prompt::Messages(msgs);
        let n = pool
            .encode("bos-tiny", ApiKind::ChatCompletions, &p, None)
            .expect("tokenizes")
            .len();
        if n >= target {
            return (p, n);
        }
        turns += 1;
    }
}

fn chat_4k(c: &mut Criterion) {
    let dir = staged();
    let cold = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default())
        .with_cache_capacity(0);
    let warm = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    let (prompt, n) = chat_of(&cold, 4096);
    eprintln!("chat request: {n} tokens");
    let text = Prompt::Text(FILLER.repeat(4096 / 30));
    let tn = cold
        .encode("bos-tiny", ApiKind::Completions, &text, None)
        .expect("tokenizes")
        .len();
    eprintln!("completion prompt: {tn} tokens");
    let mut g = c.benchmark_group("tokenize_chat_4k");
    g.bench_function("cold", |b| {
        b.iter(|| {
            cold.encode(
                "bos-tiny",
                ApiKind::ChatCompletions,
                black_box(&prompt),
                None,
            )
        })
    });
    g.bench_function("cached", |b| {
        b.iter(|| {
            warm.encode(
                "bos-tiny",
                ApiKind::ChatCompletions,
                black_box(&prompt),
                None,
            )
        })
    });
    // A conversation's next turn: the history's segments are cached, the new user message is
    // not (unique per iteration), so only it is encoded.
    let history = match &prompt {
        Prompt::Messages(m) => m.clone(),
        _ => Vec::new(),
    };
    let mut turn = 0u64;
    g.bench_function("next_turn_segment_cached", |b| {
        b.iter_batched(
            || {
                turn += 1;
                let mut msgs = history.clone();
                msgs.push(ChatMessage {
                    role: "assistant".into(),
                    content: "Done.".into(),
                });
                msgs.push(ChatMessage {
                    role: "user".into(),
                    content: format!("And item {turn}?"),
                });
                Prompt::Messages(msgs)
            },
            |p| warm.encode("bos-tiny", ApiKind::ChatCompletions, &p, None),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("completion_cold", |b| {
        b.iter(|| cold.encode("bos-tiny", ApiKind::Completions, black_box(&text), None))
    });
    // A shared-prefix completion (a long system prompt + a new question each time): the system
    // prompt's word-boundary chunks are cached, only the question's tail is encoded.
    let mut question = 0u64;
    let system = match &text {
        Prompt::Text(t) => t.clone(),
        _ => String::new(),
    };
    g.bench_function("completion_shared_prefix_chunk_cached", |b| {
        b.iter_batched(
            || {
                question += 1;
                Prompt::Text(format!(
                    "{system} Which carrier handles order {question} today?"
                ))
            },
            |p| warm.encode("bos-tiny", ApiKind::Completions, &p, None),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// The demo's workload shape on the tiny model (GPT-2 byte-level BPE): a 3,072-word system
/// prompt of single-token words and a new 128-word question per request.
fn shared_prefix_tiny(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(shared().join("golden/tiny-model"), dir.path().join("tiny"))
        .expect("symlink");
    let json: serde_json::Value = serde_json::from_slice(
        &std::fs::read(shared().join("golden/tiny-model/tokenizer.json")).expect("read"),
    )
    .expect("json");
    let words: Vec<String> = json["model"]["vocab"]
        .as_object()
        .expect("vocab")
        .keys()
        .filter_map(|k| k.strip_prefix('\u{120}'))
        .filter(|w| w.len() >= 3 && w.bytes().all(|b| b.is_ascii_lowercase()))
        .map(|w| format!(" {w}"))
        .collect();
    let mut x = 7u64;
    let mut pick = move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) as usize
    };
    let system: String = (0..3072)
        .map(|_| words[pick() % words.len()].as_str())
        .collect();
    let warm = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    let cold = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default())
        .with_cache_capacity(0);
    let mut g = c.benchmark_group("tokenize_shared_prefix_tiny");
    let mut question = || -> Prompt {
        let q: String = (0..128)
            .map(|_| words[pick() % words.len()].as_str())
            .collect();
        Prompt::Text(format!("{system}{q}"))
    };
    g.bench_function("cold", |b| {
        b.iter_batched(
            &mut question,
            |p| cold.encode("tiny", ApiKind::Completions, &p, None),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("chunk_cached", |b| {
        b.iter_batched(
            &mut question,
            |p| warm.encode("tiny", ApiKind::Completions, &p, None),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, chat_4k, shared_prefix_tiny);
criterion_main!(benches);
