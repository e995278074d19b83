//! Token ids and block keys against the two live vLLM captures.

use std::collections::HashSet;

use loxi_user::kv::BlockKey;
use loxi_user::kv::block_hash::{BlockHasher, HashAlgo, RequestExtras};
use loxi_user::kv::tokenizer::encode::ModelTokenizer;
use loxi_user::kv::tokenizer::{TokenizerMetrics, TokenizerPool};
use loxi_user::request::Prompt;
use serde_json::Value;

use super::support::{golden, request_of, staged_tokenizer_dir, str_of, vllm_ids};

const CAPTURES: [&str; 2] = ["vllm_kv_events_capture.json", "bos_kv_events_capture.json"];

fn name_of(req: &Value) -> String {
    req.get("name")
        .or_else(|| req.get("kind"))
        .and_then(Value::as_str)
        .unwrap_or("?")
        .to_owned()
}

fn our_ids(pool: &TokenizerPool, req: &Value, body: &Value) -> Option<Vec<u32>> {
    let (api, prompt, add) = request_of(str_of(req, "endpoint"), body)?;
    let model = body["model"].as_str().expect("model");
    let ids = pool
        .encode(model, api, &prompt, add)
        .unwrap_or_else(|e| panic!("{}: {e}", name_of(req)));
    Some(ids.to_vec())
}

#[test]
fn our_token_ids_equal_vllms_for_every_captured_request_of_both_models() {
    let dir = staged_tokenizer_dir();
    // Default caches, and caching off (every request encoded whole by the tokenizer).
    for cache in [None, Some(0)] {
        let mut pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
        if let Some(c) = cache {
            pool = pool.with_cache_capacity(c);
        }
        captured_ids_equal_vllms(&pool);
    }
}

/// Every captured request's ids from `pool` equal the ids vLLM computed.
fn captured_ids_equal_vllms(pool: &TokenizerPool) {
    for (file, expected_count) in CAPTURES.iter().zip([16, 17]) {
        let cap = golden(file);
        let mut checked = 0;
        for req in cap["requests"].as_array().expect("requests") {
            let Some(expected) = vllm_ids(req) else {
                continue;
            };
            let ours = our_ids(pool, req, &req["request_body"]).expect("request with a prompt");
            assert_eq!(ours, expected, "{file}: {}", name_of(req));
            checked += 1;
        }
        assert_eq!(checked, expected_count, "{file}");
    }
}

#[test]
fn tokenize_confirmations_give_the_same_ids_as_the_request() {
    let dir = staged_tokenizer_dir();
    let pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    let cap = golden("bos_kv_events_capture.json");
    let mut checked = 0;
    for req in cap["requests"].as_array().expect("requests") {
        let Some(tc) = req.get("tokenize_confirmation").filter(|v| v.is_object()) else {
            continue;
        };
        assert_eq!(tc["ids_equal"], Value::Bool(true));
        let ours = our_ids(
            &pool,
            &serde_json::json!({"endpoint": "POST /tokenize", "name": name_of(req)}),
            &tc["request_body"],
        )
        .expect("prompt");
        assert_eq!(Some(ours), vllm_ids(req), "{}", name_of(req));
        checked += 1;
    }
    assert_eq!(checked, 10);
}

#[test]
fn bos_quirks_per_endpoint_match_vllm() {
    let dir = staged_tokenizer_dir();
    let pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    let cap = golden("bos_kv_events_capture.json");
    for req in cap["requests"].as_array().expect("requests") {
        let Some(ours) = our_ids(&pool, req, &req["request_body"]) else {
            continue;
        };
        let leading_bos = ours.iter().take_while(|&&t| t == 0).count() as u64;
        assert_eq!(
            leading_bos,
            req["leading_bos_count"].as_u64().expect("count"),
            "{}",
            name_of(req)
        );
    }
}

/// Every BlockStored hash published in a capture's frames.
fn published_keys(cap: &Value) -> HashSet<BlockKey> {
    let mut keys = HashSet::new();
    for frame in cap["frames"].as_array().expect("frames") {
        for ev in frame["decoded"][1].as_array().expect("events") {
            if ev["type"] == "BlockStored" {
                for h in ev["block_hashes"].as_array().expect("hashes") {
                    keys.insert(BlockKey(h.as_u64().expect("int hash")));
                }
            }
        }
    }
    keys
}

/// Parents stored by requests whose frames are not in the file (BOS capture only).
fn external_parents(cap: &Value) -> HashSet<BlockKey> {
    let Some(list) = cap["verification"]["external_parents"].as_array() else {
        return HashSet::new();
    };
    list.iter()
        .map(|k| BlockKey(k.as_str().expect("key string").parse().expect("u64")))
        .collect()
}

#[test]
fn keys_hashed_from_our_token_ids_are_the_ones_the_engine_published() {
    let dir = staged_tokenizer_dir();
    let pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    // Both engines: --block-size 32, sha256_cbor, PYTHONHASHSEED=0.
    let hasher = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"));
    for (file, min_blocks) in CAPTURES.iter().zip([100, 150]) {
        let cap = golden(file);
        let published = published_keys(&cap);
        let external = external_parents(&cap);
        let mut blocks = 0;
        for req in cap["requests"].as_array().expect("requests") {
            let body = &req["request_body"];
            let Some(ours) = our_ids(&pool, req, body) else {
                continue;
            };
            let extras = RequestExtras {
                lora: None,
                cache_salt: body["cache_salt"].as_str().map(str::to_owned),
            };
            let keys = hasher.keys(&ours, 32, &extras);
            // Blocks up to an external parent were stored by requests outside this file.
            let start = keys
                .iter()
                .position(|k| external.contains(k))
                .map_or(0, |p| p + 1);
            for (i, key) in keys.iter().enumerate().skip(start) {
                assert!(
                    published.contains(key),
                    "{file}: {} block {i} key {} never published",
                    name_of(req),
                    key.0
                );
                blocks += 1;
            }
        }
        assert!(blocks >= min_blocks, "{file}: {blocks} blocks checked");
    }
}

const PALETTE: [&str; 24] = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<think>",
    "</think>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "hello",
    " world",
    "12345",
    " 7",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "北京和上海",
    " 🚚📦",
    "Résumé",
    "don't",
    "(+7.5%)",
    "fn main() {}",
    " ",
];

/// A deterministic xorshift64 sequence from `seed` (non-zero).
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Asserts segment encoding equals the tokenizer's whole-text encoding for every text, with and
/// without special tokens, twice (the second pass is served from the segment cache).
fn assert_segments_match_whole(tok: &ModelTokenizer, model: &str, texts: &[String]) {
    for pass in 0..2 {
        for text in texts {
            for add in [false, true] {
                let whole = tok.encode_whole(text, add).expect("whole");
                let seg = tok
                    .encode_by_segments(text, add)
                    .expect("segment mode is exact here")
                    .expect("ok");
                assert_eq!(
                    seg,
                    whole.to_vec(),
                    "{model} pass {pass} add={add} text {text:?}"
                );
            }
        }
    }
}

/// Deterministic texts mixing added tokens, digits, whitespace runs and non-ASCII.
fn random_texts(n: usize) -> Vec<String> {
    let mut next = xorshift(0x2545_f491);
    (0..n)
        .map(|_| {
            let len = 1 + (next() % 30) as usize;
            (0..len)
                .map(|_| PALETTE[(next() % PALETTE.len() as u64) as usize])
                .collect()
        })
        .collect()
}

/// Long texts (hundreds of pieces, many `letter space letter` word boundaries) so splits are cut
/// into word-boundary chunks.
fn long_texts(n: usize) -> Vec<String> {
    // "e\u{301}": a decomposed é, which Qwen2's NFC normalizer composes.
    const WORDS: [&str; 9] = [
        " the",
        " It",
        "'s",
        "ok",
        " a",
        "x",
        " don't",
        "Zed",
        " e\u{301}",
    ];
    let mut next = xorshift(0x9e37_79b9);
    (0..n)
        .map(|_| {
            let len = 200 + (next() % 400) as usize;
            (0..len)
                .map(|_| {
                    // Added tokens (the first 9 palette entries) rarely, so most splits
                    // between them are long enough to be chunked.
                    let r = next();
                    match r % 100 {
                        0 => PALETTE[(r / 100 % 9) as usize],
                        1..=30 => PALETTE[9 + (r / 100 % (PALETTE.len() as u64 - 9)) as usize],
                        _ => WORDS[(r / 100 % WORDS.len() as u64) as usize],
                    }
                })
                .collect()
        })
        .collect()
}

#[test]
fn word_chunked_encoding_equals_whole_text_encoding_on_long_texts() {
    let dir = staged_tokenizer_dir();
    let pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    for model in ["tiny", "bos-tiny"] {
        let tok = pool.get(model).expect("loads");
        assert!(
            tok.word_chunked(),
            "{model}: pre-tokenizer is on the allow-list"
        );
        assert!(
            tok.raw_chunked(),
            "{model}: added tokens keep off word boundaries"
        );
        assert_segments_match_whole(&tok, model, &long_texts(150));
    }
}

#[test]
fn prompts_sharing_a_long_prefix_encode_only_their_new_chunks() {
    let dir = staged_tokenizer_dir();
    let pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    let tok = pool.get("tiny").expect("loads");
    let system: String = (0..3000)
        .map(|i| format!(" word{}", i % 97))
        .collect::<String>()
        .replace(|c: char| c.is_ascii_digit(), "x");
    let first = format!("{system} What is the first question?");
    let second = format!("{system} And here comes another one entirely");
    let a = tok
        .encode_by_segments(&first, true)
        .expect("exact")
        .expect("ok");
    let after_first = tok.segment_entries();
    assert!(
        after_first >= 30,
        "{} bytes cut into {after_first} chunks",
        first.len()
    );
    let b = tok
        .encode_by_segments(&second, true)
        .expect("exact")
        .expect("ok");
    let added = tok.segment_entries() - after_first;
    assert!(
        added <= 2,
        "second prompt added {added} chunks (only its tail is new)"
    );
    assert_eq!(a, tok.encode_whole(&first, true).expect("whole").to_vec());
    assert_eq!(b, tok.encode_whole(&second, true).expect("whole").to_vec());
}

#[test]
fn segment_cached_encoding_equals_whole_text_encoding_for_both_models() {
    let dir = staged_tokenizer_dir();
    let pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
    for model in ["tiny", "bos-tiny"] {
        let tok = pool.get(model).expect("loads");
        let mut texts = random_texts(400);
        for file in CAPTURES {
            for req in golden(file)["requests"].as_array().expect("requests") {
                let body = &req["request_body"];
                match request_of(str_of(req, "endpoint"), body) {
                    Some((_, Prompt::Text(t), _)) => texts.push(t),
                    Some((_, Prompt::Messages(m), _)) => {
                        texts.push(tok.render(model, &m).expect("renders"))
                    }
                    _ => {}
                }
            }
        }
        assert_segments_match_whole(&tok, model, &texts);
    }
}

/// Issue 9 §1: only the part of a prompt that can matter is tokenized. A bounded encoding is
/// always a prefix of the engine's ids: cut at a token bound, at the model's context from its
/// `config.json` (4096 for both golden models), or for a prompt the body parse cut mid-word
/// (encoded up to its last word boundary). And it stops encoding once it has enough.
#[test]
fn bounded_encoding_is_a_prefix_of_the_whole_and_stops_at_the_context() {
    use loxi_user::kv::tokenizer::EncodeBounds;
    use loxi_user::request::ApiKind;
    let dir = staged_tokenizer_dir();
    let metrics = TokenizerMetrics::default();
    let text: String = long_texts(60).concat();
    for model in ["tiny", "bos-tiny"] {
        let pool = TokenizerPool::new(dir.path().to_owned(), TokenizerMetrics::default());
        let tok = pool.get(model).expect("loads");
        assert_eq!(tok.max_context(), Some(4096), "{model}: config.json");
        let whole = tok.encode_whole(&text, true).expect("whole");
        assert!(whole.len() > 5000, "{model}: {} tokens", whole.len());
        let bounded = |prompt: &str, max_tokens, prefix| {
            tok.encode_bounded(
                model,
                ApiKind::Completions,
                &Prompt::Text(prompt.to_owned()),
                None,
                EncodeBounds { max_tokens, prefix },
                &metrics,
            )
        };
        let ids = bounded(&text, Some(300), false).expect("bounded");
        assert_eq!(&ids[..], &whole[..300], "{model}: token bound");
        // Encoding stopped after the chunks that gave 300 tokens.
        let chunks = tok.segment_entries();
        assert!(
            chunks < 20,
            "{model}: {chunks} chunks encoded for 300 tokens"
        );
        let ids = bounded(&text, None, false).expect("bounded");
        assert_eq!(
            &ids[..],
            &whole[..4096],
            "{model}: context from config.json"
        );
        for cut in [700, 5_001, 20_003] {
            let mut end = cut;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            let ids = bounded(&text[..end], None, true).expect("prefix");
            assert!(ids.len() > 100, "{model}: cut {cut}: {} ids", ids.len());
            assert_eq!(&ids[..], &whole[..ids.len()], "{model}: cut at {cut}");
        }
        assert!(
            bounded("aaaaaaaaaaaaaaaaaaaaaaaaa", None, true).is_err(),
            "{model}: a cut prefix without a word boundary has no exact encoding"
        );
    }
}
