use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;

use super::*;
use crate::kv::block_hash::{BlockHasher, HashAlgo};
use crate::kv::route::blend::LbMode;
use crate::kv::settings::KvSettings;
use crate::kv::state::Openings;
use crate::kv::testutil::{self, TinyTokenizer, rule, shared_dir, state};
use crate::kv::tokenizer::TokenizerPool;
use crate::request::ChatMessage;
use crate::routing::{EndpointLoad, Excluded};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. \
    The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. Question one?";

struct Fx {
    router: KvRouter,
    tok: Arc<dyn PromptTokenizer>,
    reg: Registry,
    rule: StoredRule,
    loads: Vec<Arc<EndpointLoad>>,
    weights: Vec<u32>,
}

fn fx_with(settings: KvSettings, n: usize, extra: serde_json::Value) -> Fx {
    fx_tok(settings, n, extra, TinyTokenizer::load())
}

fn fx_tok(
    settings: KvSettings,
    n: usize,
    extra: serde_json::Value,
    tok: Arc<dyn PromptTokenizer>,
) -> Fx {
    let (st, reg) = state(settings);
    let router = KvRouter::new(st, tok.clone());
    let f = Fx {
        router,
        tok,
        reg,
        rule: rule(1, n, extra),
        loads: (0..n).map(|_| EndpointLoad::new()).collect(),
        weights: vec![1; n],
    };
    if f.router.state().service(&f.rule).is_some() {
        for ep in 0..n {
            f.hear(ep, true);
        }
    }
    f
}

fn fx(n: usize) -> Fx {
    let s = KvSettings {
        // LoxiLB's miss semantics (`no_worker` falls through to `sel`).
        cold_least_work: false,
        lb_mode: LbMode::Off,
        coldstart_seed_n: 0,
        ..KvSettings::default()
    };
    fx_with(s, n, serde_json::json!({}))
}

fn meta(text: &str) -> RequestMeta {
    RequestMeta {
        model: Some("tiny".into()),
        prompt: Some(Prompt::Text(text.into())),
        api: ApiKind::Completions,
        ..Default::default()
    }
}

impl Fx {
    fn svc(&self) -> Arc<ServiceKv> {
        self.router.state().service(&self.rule).expect("kv rule")
    }
    fn tokens(&self, m: &RequestMeta) -> Arc<[u32]> {
        self.tok
            .encode(
                m.model.as_deref().expect("model"),
                m.api,
                m.prompt.as_ref().expect("prompt"),
                m.add_special_tokens,
            )
            .expect("tokenize")
    }
    fn keys_of(&self, m: &RequestMeta) -> Vec<BlockKey> {
        let h = BlockHasher::new(HashAlgo::Sha256Cbor, None);
        let extras = RequestExtras {
            lora: None,
            cache_salt: m.cache_salt.clone(),
        };
        h.keys(&self.tokens(m), 16, &extras)
    }
    /// `ep` holds the first `blocks` blocks of `m`.
    /// Marks endpoint `ep`'s event stream connected and applying batches (`heard`), or down.
    fn hear(&self, ep: EpIdx, up: bool) {
        let svc = self.svc();
        svc.set_connected(ep, 0, up);
        svc.streams.lock().entry((ep, 0)).or_default().last_seq = up.then_some(0);
    }
    fn hold(&self, ep: EpIdx, m: &RequestMeta, blocks: usize) {
        let keys = self.keys_of(m);
        self.svc()
            .index
            .store(ep, 0, &keys[..blocks.min(keys.len())]);
    }
    /// One attempt of the request whose tier state is `memo`.
    fn attempt(&self, m: &RequestMeta, ex: &Excluded, memo: &mut KvTicket) -> Option<Decision> {
        let c = Candidates {
            weights: &self.weights,
            loads: &self.loads,
            excluded: ex,
        };
        self.router.select(&self.rule, m, &c, memo)
    }
    fn select_ex(&self, m: &RequestMeta, ex: &Excluded) -> Option<Decision> {
        self.attempt(m, ex, &mut KvTicket::default())
    }
    fn select(&self, m: &RequestMeta) -> Option<Decision> {
        self.select_ex(m, &Excluded::default())
    }
    fn stage_count(&self, stage: &str) -> f64 {
        testutil::stage_count(&self.reg, stage)
    }
    fn metric(&self, needle: &str) -> f64 {
        testutil::metric_value(&self.reg, needle)
    }
    fn misses(&self, reason: &str) -> f64 {
        self.metric(&format!(
            "loxilb_pd_kv_tier15_miss_reason_total{{service=\"1\",reason=\"{reason}\"}}"
        ))
    }
}

#[test]
fn warm_request_goes_to_endpoint_holding_the_longest_prefix() {
    let f = fx(3);
    let m = meta(PROMPT);
    assert!(f.keys_of(&m).len() >= 3);
    f.hold(1, &m, 1);
    f.hold(2, &m, 3);
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvOverlap)));
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_hits_total{service=\"1\",ep_idx=\"2\"}"),
        1.0
    );
}

#[test]
fn connect_failure_retry_picks_second_best_overlap() {
    let f = fx(3);
    let m = meta(PROMPT);
    f.hold(0, &m, 2);
    f.hold(2, &m, 3);
    let mut ex = Excluded::default();
    ex.insert(2);
    assert_eq!(
        f.select_ex(&m, &ex),
        Some(Decision::pick(0, Reason::KvOverlap))
    );
}

#[test]
fn one_request_hashes_once_across_retry_and_routed() {
    let f = fx(3);
    let m = meta(PROMPT);
    f.hold(2, &m, 3);
    let mut memo = KvTicket::default();
    let mut ex = Excluded::default();
    assert_eq!(
        f.attempt(&m, &ex, &mut memo),
        Some(Decision::pick(2, Reason::KvOverlap))
    );
    // Connect failure on 2: the retry is an `excluded` miss; the proxy's `sel` then picks 1.
    ex.insert(2);
    assert_eq!(f.attempt(&m, &ex, &mut memo), None);
    f.router.routed(&f.rule, &m, 1, &mut memo);
    assert_eq!((f.misses("excluded"), f.stage_count("Score")), (1.0, 2.0));
    assert_eq!(
        (f.stage_count("Tokenize"), f.stage_count("Hash")),
        (1.0, 1.0)
    );
    // The prediction used the kept keys: endpoint 1 now holds the whole prompt.
    let keys = f.keys_of(&m);
    let scores = f.svc().index.score(&keys, Instant::now());
    assert_eq!(scores, vec![(1, keys.len()), (2, 3)]);
}

#[test]
fn a_retry_counts_its_guard_miss_again_without_retokenizing() {
    let f = fx(2);
    let m = meta("The quick brown fox");
    let mut memo = KvTicket::default();
    for _ in 0..2 {
        assert_eq!(f.attempt(&m, &Excluded::default(), &mut memo), None);
    }
    assert_eq!(f.misses("shallow"), 2.0);
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_fallthrough_total{service=\"1\"}"),
        2.0
    );
    assert_eq!(
        (f.stage_count("Tokenize"), f.stage_count("Hash")),
        (1.0, 0.0)
    );
}

#[test]
fn unhealthy_endpoint_never_wins_and_sole_holder_excluded_is_an_excluded_miss() {
    let f = fx(2);
    let m = meta(PROMPT);
    f.hold(1, &m, 3);
    f.loads[1].healthy.store(false, Ordering::Relaxed);
    assert_eq!(f.select(&m), None);
    assert_eq!(f.misses("excluded"), 1.0);
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_fallthrough_total{service=\"1\"}"),
        1.0
    );
}

#[test]
fn empty_index_is_no_worker() {
    let f = fx(2);
    assert_eq!(f.select(&meta(PROMPT)), None);
    assert_eq!(f.misses("no_worker"), 1.0);
}

#[test]
fn prompt_shorter_than_one_block_is_short_prompt_not_no_worker() {
    let s = KvSettings {
        min_match_tokens: 0,
        ..KvSettings::default()
    };
    let f = fx_with(s, 2, serde_json::json!({}));
    let m = meta("The quick brown fox");
    assert!(f.tokens(&m).len() < 16);
    assert_eq!(f.select(&m), None);
    assert_eq!(
        (f.misses("short_prompt"), f.misses("no_worker")),
        (1.0, 0.0)
    );
}

#[test]
fn prompt_below_min_match_tokens_is_shallow() {
    let f = fx(2);
    assert_eq!(f.select(&meta("The quick brown fox")), None);
    assert_eq!(f.misses("shallow"), 1.0);
}

#[test]
fn guard_ladder_reasons_for_missing_inputs() {
    let f = fx(2);
    let mut m = meta(PROMPT);
    m.prompt = None;
    assert_eq!(f.select(&m), None);
    let mut m = meta(PROMPT);
    m.model = None;
    assert_eq!(f.select(&m), None);
    let mut m = meta(PROMPT);
    m.model = Some("other".into());
    assert_eq!(f.select(&m), None);
    let mut m = meta(PROMPT);
    m.lora_name = Some("unknown-adapter".into());
    assert_eq!(f.select(&m), None);
    let got: Vec<f64> = ["text_empty", "model_empty", "tokenize", "hashes"]
        .iter()
        .map(|r| f.misses(r))
        .collect();
    assert_eq!(got, vec![1.0, 1.0, 1.0, 1.0]);
    // A body that is not JSON (`text/plain`: neither model nor prompt read) is LoxiLB's Guard
    // D, `model_empty`, not `text_empty`; a JSON body without a prompt stays `text_empty`.
    let plain = RequestMeta {
        api: ApiKind::Completions,
        json_ok: false,
        ..Default::default()
    };
    assert_eq!(f.select(&plain), None);
    let no_prompt = RequestMeta {
        model: Some("tiny".into()),
        api: ApiKind::Completions,
        json_ok: true,
        ..Default::default()
    };
    assert_eq!(f.select(&no_prompt), None);
    assert_eq!(
        (f.misses("model_empty"), f.misses("text_empty")),
        (2.0, 2.0)
    );
}

/// Once the engines' `/v1/models` answered, a model none of them lists misses with
/// `model_unknown` before any tokenizer is looked up: a client's misspelt model is no
/// tokenizer failure (none listed for the parity report, no load attempted). Before any
/// answer, and for a listed model, the request is tokenized as before.
#[test]
fn a_model_no_engine_lists_is_model_unknown_not_a_tokenizer_failure() {
    let f = fx(2);
    let cat = &f.router.state().lora;
    let mut m = meta(PROMPT);
    m.model = Some("typo-model".into());
    assert_eq!(f.select(&m), None);
    assert_eq!(
        (f.misses("tokenize"), f.misses("model_unknown")),
        (1.0, 0.0),
        "nothing polled yet: looked up and failed as before"
    );
    cat.set_listed(["tiny".to_string()].into());
    assert_eq!(f.select(&m), None);
    assert_eq!(
        (f.misses("tokenize"), f.misses("model_unknown")),
        (1.0, 1.0)
    );
    let failing: Vec<(String, u64)> = f
        .svc()
        .tokenize
        .failures()
        .into_iter()
        .map(|x| (x.model, x.failures))
        .collect();
    assert_eq!(
        failing,
        [("typo-model".to_string(), 1)],
        "the second request added no failure"
    );
    f.hold(0, &meta(PROMPT), 4);
    assert_eq!(
        f.select(&meta(PROMPT)),
        Some(Decision::pick(0, Reason::KvOverlap)),
        "a listed model is tokenized and scored"
    );
}

#[test]
fn kv_exact_mode_zero_is_mode_off() {
    let s = KvSettings::default();
    let f = fx_with(s, 2, serde_json::json!({"kvExactMode": 0}));
    assert_eq!(f.select(&meta(PROMPT)), None);
    assert_eq!(f.misses("mode_off"), 1.0);
}

/// Two endpoints, `kvWarmupSec` 30, law `off` and no cold seeding (overlap alone decides).
fn fx_warmup_30s() -> Fx {
    let s = KvSettings {
        lb_mode: LbMode::Off,
        coldstart_seed_n: 0,
        ..KvSettings::default()
    };
    fx_with(s, 2, serde_json::json!({"kvWarmupSec": 30}))
}

#[tokio::test(start_paused = true)]
async fn warmup_keeps_tier_out_until_window_after_first_connect() {
    let f = fx_warmup_30s();
    let m = meta(PROMPT);
    f.hold(0, &m, 2);
    assert_eq!(f.select(&m), None);
    f.svc().set_connected(0, 0, true);
    tokio::time::advance(Duration::from_secs(29)).await;
    assert_eq!(f.select(&m), None);
    assert_eq!(f.misses("warmup"), 2.0);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
}

#[tokio::test(start_paused = true)]
async fn requests_sent_during_warmup_still_predict_their_blocks() {
    let f = fx_with(
        KvSettings::default(),
        2,
        serde_json::json!({"kvWarmupSec": 30}),
    );
    let m = meta(PROMPT);
    let mut memo = KvTicket::default();
    assert_eq!(f.attempt(&m, &Excluded::default(), &mut memo), None);
    assert_eq!(f.misses("warmup"), 1.0);
    assert_eq!(
        f.stage_count("Hash"),
        0.0,
        "warmup stops select before tokenizing"
    );
    // `routed` skips the warmup guard, as it always has: it computes the keys itself.
    f.router.routed(&f.rule, &m, 1, &mut memo);
    assert_eq!(f.stage_count("Hash"), 1.0);
    let keys = f.keys_of(&m);
    let scores = f.svc().index.score(&keys, Instant::now());
    assert_eq!(scores, vec![(1, keys.len())]);
}

#[tokio::test(start_paused = true)]
async fn warmup_is_checked_on_every_attempt_of_a_request() {
    let f = fx_warmup_30s();
    let m = meta(PROMPT);
    f.hold(1, &m, 2);
    f.svc().set_connected(0, 0, true);
    let mut memo = KvTicket::default();
    assert_eq!(f.attempt(&m, &Excluded::default(), &mut memo), None);
    tokio::time::advance(Duration::from_secs(30)).await;
    // The window closed between the attempts: the retry computes the keys and hits.
    assert_eq!(
        f.attempt(&m, &Excluded::default(), &mut memo),
        Some(Decision::pick(1, Reason::KvOverlap))
    );
    assert_eq!((f.misses("warmup"), f.stage_count("Hash")), (1.0, 1.0));
}

#[test]
fn cache_salt_tenants_never_share_blocks() {
    let f = fx(2);
    let mut a = meta(PROMPT);
    a.cache_salt = Some("a".into());
    let mut b = meta(PROMPT);
    b.cache_salt = Some("b".into());
    let (ka, kb) = (f.keys_of(&a), f.keys_of(&b));
    assert!(ka.iter().all(|k| !kb.contains(k)));
    f.hold(0, &a, 9);
    assert_eq!(f.select(&b), None);
    assert_eq!(f.misses("no_worker"), 1.0);
    f.hold(1, &b, 9);
    assert_eq!(f.select(&a), Some(Decision::pick(0, Reason::KvOverlap)));
    assert_eq!(f.select(&b), Some(Decision::pick(1, Reason::KvOverlap)));
}

/// `n` endpoints, law `off`, no cold seeding, tokenized by the pool over the golden models
/// (`golden/tiny-model`'s real tokenizer and ChatML template, as model `tiny-model`).
fn golden_fx(n: usize) -> Fx {
    let s = KvSettings {
        lb_mode: LbMode::Off,
        coldstart_seed_n: 0,
        ..KvSettings::default()
    };
    let pool = TokenizerPool::new(
        shared_dir().join("golden"),
        crate::kv::tokenizer::TokenizerMetrics::default(),
    );
    fx_tok(s, n, serde_json::json!({}), Arc::new(pool))
}

/// Scenario 15 on chat requests: the golden tiny model's real tokenizer and ChatML template
/// (`golden/tiny-model`, loaded by the tokenizer pool as model `tiny-model`).
#[test]
fn chat_conversations_sharing_a_system_prompt_spread_by_full_history() {
    let f = golden_fx(4);
    let msg = |role: &str, content: String| ChatMessage {
        role: role.into(),
        content,
    };
    let system =
        "You are a helpful assistant for the warehouse team. Answer briefly and cite the manual. "
            .repeat(2);
    let convs: Vec<RequestMeta> = (0..8)
        .map(|i| RequestMeta {
            model: Some("tiny-model".into()),
            api: ApiKind::ChatCompletions,
            prompt: Some(Prompt::Messages(vec![
                msg("system", system.clone()),
                msg("user", "Where is my pallet?".into()),
                msg("assistant", "Which pallet number, please?".into()),
                msg(
                    "user",
                    format!(
                        "Pallet {i}, last seen in aisle {} on shelf {}.",
                        i * 7,
                        i * 3
                    ),
                ),
            ])),
            ..Default::default()
        })
        .collect();
    let keys: Vec<Vec<BlockKey>> = convs.iter().map(|c| f.keys_of(c)).collect();
    let shared = keys[0]
        .iter()
        .zip(&keys[1])
        .take_while(|(a, b)| a == b)
        .count();
    assert!(shared >= 2, "the identical opening fills {shared} blocks");
    assert!(
        keys.iter().all(|k| k.len() > shared),
        "histories differ past it"
    );
    for (i, c) in convs.iter().enumerate() {
        f.hold(i % 4, c, 99);
    }
    for (i, c) in convs.iter().enumerate() {
        assert_eq!(
            f.select(c),
            Some(Decision::pick(i % 4, Reason::KvOverlap)),
            "conversation {i}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn routed_request_predicts_blocks_so_a_burst_converges_until_ttl() {
    let f = fx(3);
    let m = meta(PROMPT);
    let mut memo = KvTicket::default();
    assert_eq!(f.attempt(&m, &Excluded::default(), &mut memo), None);
    f.router.routed(&f.rule, &m, 2, &mut memo);
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvOverlap)));
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(f.select(&m), None);
}

#[test]
fn hard_law_spills_an_over_cap_owner_and_counts_it() {
    let s = KvSettings {
        coldstart_seed_n: 0,
        ..KvSettings::default()
    };
    let f = fx_with(s, 3, serde_json::json!({}));
    let m = meta(PROMPT);
    f.hold(0, &m, 3);
    f.loads[0].in_flight.store(10, Ordering::Relaxed);
    f.loads[1].in_flight.store(1, Ordering::Relaxed);
    // T = 11, cap = ceil(1.75 · 12 / 3) = 7 and relief cap = ceil(2.5 · 12 / 3) = 10, both
    // ≤ 10: spill relief (auto on, mode 3) → ep2 (load 0).
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvSpill)));
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_spills_total{service=\"1\",ep_idx=\"2\"}"),
        1.0
    );
}

#[test]
fn every_nth_hit_seeds_the_lowest_index_cold_endpoint() {
    let s = KvSettings {
        lb_mode: LbMode::Off,
        coldstart_seed_n: 2,
        coldstart_min_blocks: 1,
        ..KvSettings::default()
    };
    let f = fx_with(s, 3, serde_json::json!({}));
    let m = meta(PROMPT);
    f.hold(0, &m, 3);
    f.hold(2, &m, 1);
    let eps: Vec<_> = (0..4)
        .map(|_| f.select(&m).map(|d| (d.endpoint, d.reason)))
        .collect();
    let hit = Some((Some(0), Reason::KvOverlap));
    let seed = Some((Some(1), Reason::KvColdSeed));
    assert_eq!(eps, vec![hit, seed, hit, seed]);
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_cold_seeds_total{service=\"1\",ep_idx=\"1\"}"),
        2.0
    );
}

#[test]
fn hard_law_cold_seeds_only_an_idle_endpoint() {
    // The default law (`hard`), a seed on every hit: ep1 is empty but busy (a request in flight,
    // as at the start of a burst), ep2 is empty and idle.
    let s = KvSettings {
        lb_mode: LbMode::Hard,
        predicted_ttl: Duration::ZERO,
        coldstart_seed_n: 1,
        coldstart_min_blocks: 0,
        ..KvSettings::default()
    };
    let f = fx_with(s, 3, serde_json::json!({}));
    let m = meta(PROMPT);
    f.hold(0, &m, 3);
    f.loads[1].in_flight.store(1, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvColdSeed)));
    // ep2 busy too: no idle cold endpoint, the holder keeps the request (LoxiLB would seed ep1).
    f.loads[2].in_flight.store(1, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    // ep1 idle again: it is the lowest-index idle cold endpoint.
    f.loads[1].in_flight.store(0, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvColdSeed)));
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_cold_seeds_total{service=\"1\",ep_idx=\"1\"}"),
        1.0
    );
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_cold_seeds_total{service=\"1\",ep_idx=\"2\"}"),
        1.0
    );
}

#[test]
fn token_id_prompts_are_used_as_given() {
    let f = fx(2);
    let m = meta(PROMPT);
    let ids = f.tokens(&m).to_vec();
    f.hold(1, &m, 2);
    let tm = RequestMeta {
        prompt: Some(Prompt::TokenIds(ids)),
        ..meta("")
    };
    assert_eq!(f.select(&tm), Some(Decision::pick(1, Reason::KvOverlap)));
}

#[test]
fn multi_turn_conversation_stays_on_its_first_worker_under_balanced_load() {
    let s = KvSettings {
        // LoxiLB's miss semantics (`no_worker` falls through to `sel`).
        cold_least_work: false,
        coldstart_seed_n: 0,
        ..KvSettings::default()
    };
    let f = fx_with(s, 4, serde_json::json!({}));
    for l in &f.loads {
        l.in_flight.store(2, Ordering::Relaxed);
    }
    let mut history = String::from("System: you are a concise assistant for the logistics team. ");
    let mut first = None;
    for turn in 0..10 {
        history.push_str(&format!(
            "User turn {turn}: where is pallet {}? Assistant: aisle {}. ",
            turn * 11,
            turn + 3
        ));
        let m = meta(&history);
        let ep = match f.select(&m) {
            Some(d) => {
                assert_eq!(d.reason, Reason::KvOverlap, "turn {turn}");
                d.endpoint.expect("endpoint")
            }
            None => {
                assert_eq!(turn, 0, "only the cold first turn may miss");
                2
            }
        };
        assert_eq!(*first.get_or_insert(ep), ep, "turn {turn} moved");
        f.hold(ep, &m, usize::MAX);
    }
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_hits_total{service=\"1\",ep_idx=\"2\"}"),
        9.0
    );
}

/// Issue 12 §3: a chat's media part (an image) is never scored. Blocks from the part on depend
/// on the image, which loxi cannot hash as vLLM does, so the chat is scored on the text before
/// it only: two chats that differ only in their image share just that prefix, and a text-only
/// chat with the same words after the image shares nothing past it.
#[test]
fn a_chats_media_part_cuts_its_blocks_at_the_text_before_it() {
    let f = golden_fx(2);
    let system =
        "You are a careful visual inspector for the warehouse team. Describe damage. ".repeat(3);
    let after = " Is the pallet damaged, and where exactly? Answer with the aisle and shelf.";
    let chat = |user: serde_json::Value| {
        let body = serde_json::json!({"messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]});
        RequestMeta {
            model: Some("tiny-model".into()),
            api: ApiKind::ChatCompletions,
            prompt: crate::request::prompt_of(&body),
            ..Default::default()
        }
    };
    let image = |n: u8| {
        serde_json::json!([
            {"type": "text", "text": "Here is the photo of pallet seven:"},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,AAAA{n}")}},
            {"type": "text", "text": after},
        ])
    };
    let (a, b) = (chat(image(1)), chat(image(2)));
    let text_only = chat(serde_json::json!(format!(
        "Here is the photo of pallet seven:{after}"
    )));
    let (ka, kb, kt) = (f.keys_of(&a), f.keys_of(&b), f.keys_of(&text_only));
    assert!(
        ka.len() >= 2,
        "the text before the image fills {} blocks",
        ka.len()
    );
    assert_eq!(ka, kb, "the same text before the image");
    assert!(
        kt.starts_with(&ka) && kt.len() > ka.len(),
        "only the text before the image is hashed: {} of {} blocks",
        ka.len(),
        kt.len()
    );
    // b's text prefix is held on endpoint 1 (from a): b routes there on that prefix, counted
    // as a media-prefix decision.
    f.hold(1, &a, 99);
    assert_eq!(f.select(&b), Some(Decision::pick(1, Reason::KvOverlap)));
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_media_prefix_total{service=\"1\"}"),
        1.0
    );
    assert_eq!(f.misses("multimodal"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_tokens_are_the_staged_tokenizers_ids_and_none_without_one() {
    let f = fx(2);
    let m = meta(PROMPT);
    let want = f
        .tok
        .encode("tiny", m.api, m.prompt.as_ref().expect("prompt"), None)
        .expect("ids");
    let got = f.router.prompt_tokens(&m, 10_000).await.expect("tokens");
    assert_eq!(got, want);
    // Bounded by `max`.
    let got = f.router.prompt_tokens(&m, 5).await.expect("tokens");
    assert_eq!(&got[..], &want[..5]);
    // No tokenizer for the model, no model, or a token-id prompt (keyed by its own ids).
    let other = RequestMeta {
        model: Some("other".into()),
        ..meta(PROMPT)
    };
    assert_eq!(f.router.prompt_tokens(&other, 10_000).await, None);
    let none = RequestMeta {
        model: None,
        ..meta(PROMPT)
    };
    assert_eq!(f.router.prompt_tokens(&none, 10_000).await, None);
    let ids = RequestMeta {
        prompt: Some(Prompt::TokenIds(vec![1, 2, 3])),
        ..meta(PROMPT)
    };
    assert_eq!(f.router.prompt_tokens(&ids, 10_000).await, None);
}

/// The golden `lora_two_blocks_tail` case (block size 16, `sha256_cbor`, seed unset): its token
/// ids, LoRA name and path, and the block ids vLLM 0.32 computed for it.
fn golden_lora_case() -> (Vec<u32>, String, String, Vec<BlockKey>) {
    let g = testutil::golden_json("vllm_block_hashes.json");
    let case = g["runs"]["unset"]["algos"]["sha256_cbor"]["block_sizes"]["16"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == "lora_two_blocks_tail")
        .expect("lora case")
        .clone();
    let tokens = case["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("token") as u32)
        .collect();
    let keys = case["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .map(|b| BlockKey(b["wire_u64"].as_u64().expect("wire_u64")))
        .collect();
    let s = |k: &str| case["lora"][k].as_str().expect("lora field").to_owned();
    (tokens, s("lora_name"), s("lora_path"), keys)
}

/// A request whose `model` is a LoRA adapter hashes with the adapter's extra key on every
/// block, exactly as vLLM 0.32 does (its own block ids): it matches the endpoint holding the
/// adapter's blocks, never the base model's, and another adapter matches neither.
#[test]
fn a_lora_adapter_request_matches_its_own_vllm_blocks_only() {
    let (tokens, name, path, vllm_keys) = golden_lora_case();
    let s = KvSettings {
        // LoxiLB's miss semantics (`no_worker` falls through to `sel`).
        cold_least_work: false,
        lb_mode: LbMode::Off,
        coldstart_seed_n: 0,
        lora_paths: [
            (name.clone(), path),
            ("other".into(), "/adapters/other".into()),
        ]
        .into(),
        ..KvSettings::default()
    };
    let f = fx_with(s, 3, serde_json::json!({}));
    let base =
        BlockHasher::new(HashAlgo::Sha256Cbor, None).keys(&tokens, 16, &RequestExtras::default());
    assert_eq!(base.len(), vllm_keys.len());
    assert!(base.iter().all(|k| !vllm_keys.contains(k)));
    f.svc().index.store(0, 0, &base);
    f.svc().index.store(1, 0, &vllm_keys);
    let req = |model: &str| RequestMeta {
        model: Some(model.into()),
        prompt: Some(Prompt::TokenIds(tokens.clone())),
        ..meta("")
    };
    assert_eq!(
        f.select(&req(&name)),
        Some(Decision::pick(1, Reason::KvOverlap))
    );
    assert_eq!(
        f.select(&req("tiny")),
        Some(Decision::pick(0, Reason::KvOverlap))
    );
    assert_eq!(f.select(&req("other")), None);
    assert_eq!(f.misses("no_worker"), 1.0);
}

/// An adapter learned from the engines' `/v1/models` is tokenized with its parent's tokenizer
/// (the golden tiny model) and hashed with the listed path.
#[test]
fn a_listed_adapter_is_tokenized_by_its_parent_and_hashed_with_its_root() {
    let f = golden_fx(2);
    let cat = &f.router.state().lora;
    cat.set_learned(
        [(
            "sql-adapter".to_owned(),
            crate::kv::lora::Adapter {
                path: "/adapters/sql-adapter".into(),
                parent: Some("tiny-model".into()),
            },
        )]
        .into(),
    );
    let base = RequestMeta {
        model: Some("tiny-model".into()),
        ..meta(PROMPT)
    };
    let tokens = f.tokens(&base);
    let extras = RequestExtras {
        lora: Some(("sql-adapter".into(), "/adapters/sql-adapter".into())),
        cache_salt: None,
    };
    let lora_keys = BlockHasher::new(HashAlgo::Sha256Cbor, None).keys(&tokens, 16, &extras);
    assert!(lora_keys.len() >= 2);
    f.hold(0, &base, 99);
    f.svc().index.store(1, 0, &lora_keys);
    let adapter = RequestMeta {
        model: Some("sql-adapter".into()),
        ..meta(PROMPT)
    };
    assert_eq!(
        f.select(&adapter),
        Some(Decision::pick(1, Reason::KvOverlap))
    );
    assert_eq!(f.select(&base), Some(Decision::pick(0, Reason::KvOverlap)));
}

/// `n` endpoints, law `off`, no cold seeding, offload-tier credit `credit`.
fn fx_credit(n: usize, credit: f64) -> Fx {
    let s = KvSettings {
        // LoxiLB's miss semantics (`no_worker` falls through to `sel`).
        cold_least_work: false,
        lb_mode: LbMode::Off,
        coldstart_seed_n: 0,
        cpu_tier_credit: credit,
        ..KvSettings::default()
    };
    fx_with(s, n, serde_json::json!({}))
}

/// At equal overlap a GPU holder beats a holder with the blocks only on its CPU tier (even at
/// credit 1), in either endpoint order; a CPU-only holder still beats nothing.
#[test]
fn a_gpu_holder_beats_a_cpu_only_holder_at_equal_overlap() {
    use crate::kv::index::Tier;
    for credit in [0.5, 1.0] {
        for (gpu, cpu) in [(0, 1), (1, 0)] {
            let f = fx_credit(2, credit);
            let m = meta(PROMPT);
            let keys = f.keys_of(&m);
            f.svc().index.store_in(gpu, 0, Tier::Gpu, &keys[..4]);
            f.svc().index.store_in(cpu, 0, Tier::Offload, &keys[..4]);
            assert_eq!(
                f.select(&m),
                Some(Decision::pick(gpu, Reason::KvOverlap)),
                "credit {credit}, gpu holder {gpu}"
            );
        }
    }
    let f = fx_credit(2, 0.5);
    let m = meta(PROMPT);
    f.svc()
        .index
        .store_in(1, 0, Tier::Offload, &f.keys_of(&m)[..4]);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvOverlap)));
}

/// CPU-tier blocks earn `LOXI_KV_CPU_TIER_CREDIT` each: 8 CPU blocks beat 3 GPU blocks at
/// 0.5 (4 > 3) and lose at 0.25 (2 < 3); at 0 the CPU tier is ignored (a CPU-only holder is
/// `no_worker`).
#[test]
fn cpu_tier_blocks_earn_the_configured_partial_credit() {
    use crate::kv::index::Tier;
    let long = PROMPT.repeat(4);
    for (credit, winner) in [(0.5, 1), (0.25, 0)] {
        let f = fx_credit(2, credit);
        let m = meta(&long);
        let keys = f.keys_of(&m);
        assert!(keys.len() >= 8);
        f.svc().index.store_in(0, 0, Tier::Gpu, &keys[..3]);
        f.svc().index.store_in(1, 0, Tier::Offload, &keys[..8]);
        assert_eq!(
            f.select(&m),
            Some(Decision::pick(winner, Reason::KvOverlap)),
            "credit {credit}"
        );
    }
    let f = fx_credit(2, 0.0);
    let m = meta(PROMPT);
    f.svc().index.store_in(1, 0, Tier::Offload, &f.keys_of(&m));
    assert_eq!(f.select(&m), None);
    assert_eq!(f.misses("no_worker"), 1.0);
}

/// `n` endpoints, law `off`, no seeding, the watchdog after 3 routed requests, and no
/// predictions (routed requests must not make an endpoint a holder).
fn watchdog_fx(n: usize) -> Fx {
    let s = KvSettings {
        lb_mode: LbMode::Off,
        coldstart_seed_n: 0,
        never_matched_after: 3,
        predicted_ttl: Duration::ZERO,
        ..KvSettings::default()
    };
    fx_with(s, n, serde_json::json!({}))
}

/// The zero-hit watchdog: an endpoint holding blocks that never match, to which 3
/// (`LOXI_KV_NEVER_MATCHED_AFTER`) requests were routed, becomes `never_matched` and is
/// counted once in `loxilb_pd_kv_zero_hit_watchdog_total`; the endpoint whose blocks match
/// does not.
#[test]
fn zero_hit_watchdog_flags_an_endpoint_whose_blocks_never_match() {
    let f = watchdog_fx(2);
    let m = meta(PROMPT);
    f.hold(0, &m, 2);
    f.svc()
        .index
        .store(1, 0, &[BlockKey(1), BlockKey(2), BlockKey(3)]);
    for member in [0, 1] {
        f.svc()
            .streams
            .lock()
            .entry((member, 0))
            .or_default()
            .last_seq = Some(0);
    }
    let state_of = |ep: &str, st: &str| {
        f.metric(&format!(
            "loxilb_kv_endpoint_readiness{{service=\"1\",ep_idx=\"{ep}\",state=\"{st}\"}}"
        ))
    };
    let watchdog = "loxilb_pd_kv_zero_hit_watchdog_total{service=\"1\"}";
    for i in 1..=4 {
        let mut t = KvTicket::default();
        assert_eq!(
            f.attempt(&m, &Excluded::default(), &mut t),
            Some(Decision::pick(0, Reason::KvOverlap))
        );
        // Routed elsewhere (a spill, the rule's selector): the watchdog counts it.
        f.router.routed(&f.rule, &m, 1, &mut t);
        crate::kv::readiness::publish(f.router.state());
        let flagged = i >= 3;
        assert_eq!(
            state_of("1", "never_matched"),
            f64::from(u8::from(flagged)),
            "after {i}"
        );
        assert_eq!(
            f.metric(watchdog),
            f64::from(u8::from(flagged)),
            "after {i}"
        );
        assert_eq!(state_of("0", "never_matched"), 0.0);
    }
}

/// A workload without reuse (each request its own prompt) is no misconfiguration: once the
/// engine publishes the first block of a request loxi routed to it, under loxi's key, its
/// hashing is shown to agree and the watchdog never flags it, however many requests go by
/// without a match (a review's run of 21 distinct prompts flagged a correctly configured
/// engine `never_matched` while the parity check said `ok`).
#[test]
fn zero_hit_watchdog_spares_an_engine_that_published_a_routed_request_s_block() {
    let f = watchdog_fx(1);
    f.svc().index.store(0, 0, &[BlockKey(1), BlockKey(2)]);
    f.svc().streams.lock().entry((0, 0)).or_default().last_seq = Some(0);
    let state = |st: &str| {
        f.metric(&format!(
            "loxilb_kv_endpoint_readiness{{service=\"1\",ep_idx=\"0\",state=\"{st}\"}}"
        ))
    };
    for i in 0..6 {
        let m = meta(&format!("{i} a prompt nobody repeats, about rivers and mills. ").repeat(8));
        let mut t = KvTicket::default();
        let _ = f.attempt(&m, &Excluded::default(), &mut t);
        f.router.routed(&f.rule, &m, 0, &mut t);
        // The engine served it and published its blocks, as vLLM does.
        f.hold(0, &m, 2);
        crate::kv::readiness::publish(f.router.state());
        assert_eq!(state("never_matched"), 0.0, "after {}", i + 1);
    }
    assert_eq!(
        f.metric("loxilb_pd_kv_zero_hit_watchdog_total{service=\"1\"}"),
        0.0
    );
}

/// Three endpoints under the `work` law, cold seeding every `seed_n`-th hit (blocks < 1), no
/// predicted blocks (a `routed` call changes no holdings).
fn work_fx(seed_n: u64) -> Fx {
    let s = KvSettings {
        lb_mode: LbMode::Work,
        predicted_ttl: Duration::ZERO,
        coldstart_seed_n: seed_n,
        coldstart_min_blocks: 1,
        ..KvSettings::default()
    };
    fx_with(s, 3, serde_json::json!({}))
}

#[tokio::test]
async fn work_law_weighs_queued_prefill_against_the_saving_and_the_ticket_prices_the_request() {
    let f = work_fx(0);
    let m = meta(PROMPT);
    let k = f.keys_of(&m).len() as u64;
    assert!(k >= 3);
    f.hold(0, &m, k as usize);
    let mut memo = KvTicket::default();
    assert_eq!(
        f.attempt(&m, &Excluded::default(), &mut memo),
        Some(Decision::pick(0, Reason::KvOverlap))
    );
    // ep0 holds every block: nothing to prefill there, the whole prompt anywhere else.
    f.router.routed(&f.rule, &m, 0, &mut memo);
    assert_eq!(memo.prefill_tokens(), 0);
    f.router.routed(&f.rule, &m, 1, &mut memo);
    assert_eq!(memo.prefill_tokens(), k * 16);
    // cost0 = W0, cost1 = cost2 = 16k (prefill) + 16k (copy): at W0 = 32k the tie goes to
    // the holder, one token more and the request goes to ep1.
    f.loads[0].prefill_tokens.store(32 * k, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    f.loads[0]
        .prefill_tokens
        .store(32 * k + 1, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvSpill)));
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_spills_total{service=\"1\",ep_idx=\"1\"}"),
        1.0
    );
}

#[test]
fn work_law_cold_seeds_only_an_idle_endpoint() {
    let f = work_fx(1);
    let m = meta(PROMPT);
    f.hold(0, &m, 3);
    // ep1 is cold but has a request in flight: the seed goes to ep2, cold and idle.
    f.loads[1].in_flight.store(1, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvColdSeed)));
    // ep2 now has prefill work queued: nothing idle and cold, the holder keeps the request.
    f.loads[2].prefill_tokens.store(5, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_cold_seeds_total{service=\"1\",ep_idx=\"2\"}"),
        1.0
    );
}

/// Replica seeding (`blend::replica`) over the default law (`hard`, `R` = 2), cold seeding off.
fn replica_fx() -> Fx {
    let s = KvSettings {
        coldstart_seed_n: 0,
        predicted_ttl: Duration::ZERO,
        ..KvSettings::default()
    };
    assert_eq!((s.lb_mode, s.replica_load), (LbMode::Hard, 2));
    fx_with(s, 3, serde_json::json!({}))
}

const OTHER: &str = "A different system prompt about the weather in the mountains and the sea, \
    with enough words to fill a block or two of the tiny model's tokens. Question two?";

#[test]
fn a_new_conversation_goes_to_an_idle_empty_endpoint_when_the_prompts_owner_is_busy() {
    let f = replica_fx();
    let m = meta(PROMPT);
    // ep0 holds the shared prompt and serves 2 conversations; ep1 and ep2 are empty and idle.
    f.hold(0, &m, 3);
    f.loads[0].in_flight.store(2, Ordering::Relaxed);
    // hard keeps the owner (T = 2: cap 2, relief cap 3); it carries R = 2 requests, more than
    // its share ceil(3 / 3) = 1, so the request seeds the lowest-index empty idle endpoint.
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvColdSeed)));
    // ep1 now caches something else: not empty, so ep2 takes it.
    f.hold(1, &meta(OTHER), 1);
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvColdSeed)));
    // ep2 is empty but has a request in flight: not idle, the owner keeps the request.
    f.loads[2].in_flight.store(1, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_cold_seeds_total{service=\"1\",ep_idx=\"1\"}"),
        1.0
    );
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_cold_seeds_total{service=\"1\",ep_idx=\"2\"}"),
        1.0
    );
}

/// A burst of several prompts at once: while a request that opens differently waits for its
/// decision, or was placed within the hold window, the idle empty endpoints may be its home,
/// so no replica is seeded; requests of the same prompt (a burst of conversations sharing one
/// system prompt) do not hold it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_seed_waits_while_requests_of_other_prompts_wait_or_were_just_placed() {
    let f = replica_fx();
    let m = meta(PROMPT);
    let other = meta(OTHER);
    let no = Excluded::default();
    f.hold(0, &m, 3);
    f.loads[0].in_flight.store(2, Ordering::Relaxed);
    // Both requests arrive; each is counted as waiting once its tokenization is queued.
    let mut waiting = KvTicket::default();
    f.router.prepare(&f.rule, &other, &mut waiting).await;
    let mut mine = KvTicket::default();
    f.router.prepare(&f.rule, &m, &mut mine).await;
    assert_eq!(f.svc().waiting.lock().len(), 2);
    // The other prompt still waits: the busy owner keeps this one (the seed of the fixture
    // above, ep1, is held).
    assert_eq!(
        f.attempt(&m, &no, &mut mine),
        Some(Decision::pick(0, Reason::KvOverlap))
    );
    // The other request's first selection takes it out of the waiting set.
    assert_eq!(
        f.attempt(&other, &no, &mut waiting),
        Some(Decision::pick(1, Reason::KvColdPlace))
    );
    assert!(f.svc().waiting.lock().is_empty());
    // Placed just now, the other prompt still holds the seed for the hold window (1 s).
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    age_openings(&f);
    // Only requests of the same prompt wait: the copy goes to the idle empty endpoint.
    let mut same = KvTicket::default();
    f.router.prepare(&f.rule, &m, &mut same).await;
    let mut next = KvTicket::default();
    f.router.prepare(&f.rule, &m, &mut next).await;
    let only: Vec<(u64, u32)> = f
        .svc()
        .waiting
        .lock()
        .iter()
        .map(|(k, n)| (*k, *n))
        .collect();
    assert_eq!(only, [(opening(&m).expect("prompt"), 2)]);
    assert_eq!(
        f.attempt(&m, &no, &mut next),
        Some(Decision::pick(1, Reason::KvColdSeed))
    );
    // A request that leaves before its selection (client gone) leaves the set too.
    drop(same);
    assert!(f.svc().waiting.lock().is_empty());
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_cold_seeds_total{service=\"1\",ep_idx=\"1\"}"),
        1.0
    );
}

/// Moves the fixture's recorded placements one hold window (1 s) into the past.
fn age_openings(f: &Fx) {
    let window = f.router.state().settings.replica_hold_window();
    assert_eq!(window, Duration::from_secs(1));
    let svc = f.svc();
    let aged = svc.openings.lock().aged(window);
    *svc.openings.lock() = aged;
}

/// A placement of another prompt that has no full block to cache (a short probe) holds no
/// replica seed: it cannot make the idle endpoint its home.
#[test]
fn a_prompt_without_blocks_holds_no_replica_seed() {
    let f = replica_fx();
    let m = meta(PROMPT);
    f.hold(0, &m, 3);
    f.loads[0].in_flight.store(2, Ordering::Relaxed);
    // A short probe misses (`shallow`) and is not recorded.
    assert_eq!(f.select(&meta("hi")), None);
    assert_eq!(f.svc().openings.lock().other_than(None), None);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvColdSeed)));
}

/// A burst of conversations that share one system prompt: every arrival opens the same way,
/// so the busy owner's next conversation seeds the idle empty endpoint at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_one_prompt_seeds_a_replica_at_once() {
    let f = replica_fx();
    let m = meta(PROMPT);
    f.hold(0, &m, 3);
    f.loads[0].in_flight.store(2, Ordering::Relaxed);
    let mut tickets: Vec<KvTicket> = (0..3).map(|_| KvTicket::default()).collect();
    for t in &mut tickets {
        f.router.prepare(&f.rule, &m, t).await;
    }
    assert_eq!(
        f.attempt(&m, &Excluded::default(), &mut tickets[2]),
        Some(Decision::pick(1, Reason::KvColdSeed))
    );
}

/// [`Openings`] answers when a request of another opening was last seen, whatever the order,
/// and [`Openings::aged`] moves both records back.
#[test]
fn openings_tell_when_another_prompt_was_last_seen() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut o = Openings::default();
    assert_eq!(o.other_than(Some(1)), None);
    assert_eq!(o.other_than(None), None);
    o.seen(1, at(0));
    assert_eq!(o.other_than(Some(1)), None);
    assert_eq!(o.other_than(Some(2)), Some(at(0)));
    o.seen(1, at(5));
    o.seen(2, at(7));
    assert_eq!(o.other_than(Some(1)), Some(at(7)));
    assert_eq!(o.other_than(Some(2)), Some(at(5)));
    o.seen(2, at(9));
    assert_eq!(o.other_than(Some(2)), Some(at(5)));
    o.seen(3, at(11));
    assert_eq!(o.other_than(Some(3)), Some(at(9)));
    assert_eq!(o.other_than(Some(1)), Some(at(11)));
    assert_eq!(o.other_than(None), Some(at(11)));
    let back = o.aged(Duration::from_millis(4));
    assert_eq!(back.other_than(Some(3)), Some(at(5)));
    assert_eq!(back.other_than(Some(1)), Some(at(7)));
}

#[test]
fn a_shared_prefix_group_stays_on_its_holder_unless_its_load_and_an_empty_cache_call_for_a_copy() {
    let f = replica_fx();
    let m = meta(PROMPT);
    f.hold(0, &m, 3);
    // The first repeat of a new group (one request in flight on its holder, < R): it stays,
    // even with two empty idle endpoints.
    f.loads[0].in_flight.store(1, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    // Every endpoint caches groups of its own: the busy holder keeps its group.
    f.hold(1, &meta(OTHER), 2);
    f.hold(2, &meta(OTHER), 2);
    f.loads[0].in_flight.store(2, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    // LOXI_KV_REPLICA_LOAD=0 turns it off: with empty idle endpoints the owner keeps it.
    let s = KvSettings {
        coldstart_seed_n: 0,
        replica_load: 0,
        ..KvSettings::default()
    };
    let f = fx_with(s, 3, serde_json::json!({}));
    f.hold(0, &m, 3);
    f.loads[0].in_flight.store(2, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_cold_seeds_total{service=\"1\",ep_idx=\"1\"}"),
        0.0
    );
}

#[test]
fn the_spill_floor_keeps_the_owner_until_it_carries_f_requests_or_its_queue_pays_for_the_copy() {
    // Default law (`hard`) and floor (8), seeding off to isolate the floor. T = L0 = 5 over
    // 3 endpoints: cap = ceil(1.75 · 6 / 3) = 4, relief cap = ceil(2.5 · 6 / 3) = 5 ≤ 5, so
    // LoxiLB's law relieves the owner onto a cold endpoint.
    let settings = |floor| KvSettings {
        coldstart_seed_n: 0,
        replica_load: 0,
        predicted_ttl: Duration::ZERO,
        spill_floor: floor,
        ..KvSettings::default()
    };
    assert_eq!(KvSettings::default().spill_floor, 8);
    let m = meta(PROMPT);
    let lax = fx_with(settings(0), 3, serde_json::json!({}));
    lax.hold(0, &m, 3);
    lax.loads[0].in_flight.store(5, Ordering::Relaxed);
    assert_eq!(lax.select(&m), Some(Decision::pick(1, Reason::KvSpill)));
    let f = fx_with(settings(8), 3, serde_json::json!({}));
    let k = f.keys_of(&m).len() as u64;
    f.hold(0, &m, k as usize);
    f.loads[0].in_flight.store(5, Ordering::Relaxed);
    // 5 requests, nothing queued to prefill: the owner keeps it.
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    // Its queued prefill reaches the copy's k blocks of 16 tokens: the law's relief stands.
    f.loads[0]
        .prefill_tokens
        .store(16 * k - 1, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    f.loads[0].prefill_tokens.store(16 * k, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvSpill)));
    // Or it carries F = 8 requests (T = 8: relief cap ceil(2.5 · 9 / 3) = 8).
    f.loads[0].prefill_tokens.store(0, Ordering::Relaxed);
    f.loads[0].in_flight.store(7, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvOverlap)));
    f.loads[0].in_flight.store(8, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvSpill)));
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_spills_total{service=\"1\",ep_idx=\"1\"}"),
        2.0
    );
}

/// Three endpoints, no cold-start or replica seeding: endpoint 0 holds 4 blocks of another
/// prompt, endpoint 1 holds 2, endpoint 2 none; every stream heard.
fn held_4_2_0() -> Fx {
    let s = KvSettings {
        coldstart_seed_n: 0,
        replica_load: 0,
        ..KvSettings::default()
    };
    let f = fx_with(s, 3, serde_json::json!({}));
    let other = |i: usize| {
        meta(&format!("{i} another prompt entirely, about sailing boats and the wind. ").repeat(8))
    };
    assert!(f.keys_of(&other(0)).len() >= 4, "long enough for 4 blocks");
    for ep in 0..3 {
        f.hear(ep, true);
    }
    f.hold(0, &other(0), 4);
    f.hold(1, &other(1), 2);
    f
}

/// An endpoint whose engine is not heard (its publisher unreachable: the index holds nothing
/// of it) is not "the emptiest cache": it counts as holding the mean of the heard ones, so a
/// dead event stream does not draw every new prefix (before: 22 of 24 sequential distinct
/// prompts went to such an endpoint).
#[test]
fn an_endpoint_whose_events_are_not_heard_is_not_the_emptiest_cache() {
    let f = held_4_2_0();
    let m = meta(PROMPT);
    // Heard and empty: truly the emptiest.
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvColdPlace)));
    // Not heard: counted as the mean of ep0 and ep1 (3 blocks), so ep1 (2) is the emptiest.
    f.hear(2, false);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvColdPlace)));
    // Queued work still decides first: an unheard endpoint with the least wait is chosen.
    let nb = 16 * f.keys_of(&m).len() as u64;
    f.loads[0].prefill_tokens.store(nb, Ordering::Relaxed);
    f.loads[1].prefill_tokens.store(nb, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvColdPlace)));
}

/// An endpoint whose engine runs another block size (every stored event refused, so the
/// index holds none of its blocks while its stream is connected) is not "the emptiest cache"
/// either (before: 16 of 16 sequential distinct prompts went to it).
#[test]
fn an_endpoint_whose_events_are_all_refused_for_block_size_is_not_the_emptiest_cache() {
    let f = held_4_2_0();
    let m = meta(PROMPT);
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvColdPlace)));
    let svc = f.svc();
    svc.parity.lock().reject_block_size(2, 32);
    assert!(
        !svc.heard(2),
        "connected, but nothing it publishes is filed"
    );
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvColdPlace)));
}

/// A fresh fleet under sequential distinct prompts: the engine that served the first one has
/// published its blocks, the others are connected and have published nothing (they hold
/// nothing). They are the emptiest caches, not "unheard" engines tied with the first at the
/// mean (which sent all 21 prompts of a review's run to endpoint 0). And when no stream is
/// connected at all (every engine equal), cold placements take turns instead of all going to
/// the lowest index.
#[test]
fn cold_placement_spreads_over_silent_engines_and_takes_turns_among_equals() {
    let s = KvSettings {
        coldstart_seed_n: 0,
        replica_load: 0,
        ..KvSettings::default()
    };
    let f = fx_with(s, 3, serde_json::json!({}));
    let prompt =
        |i: usize| meta(&format!("{i} a prompt of its own about the sea and boats. ").repeat(8));
    // Connected, nothing published: heard, empty.
    let svc = f.svc();
    for ep in 0..3 {
        svc.set_connected(ep, 0, true);
        svc.streams.lock().entry((ep, 0)).or_default().last_seq = None;
    }
    f.hold(0, &prompt(100), 4);
    assert!(svc.heard(1) && svc.heard(2));
    let first = f.select(&prompt(0)).and_then(|d| d.endpoint);
    assert!(matches!(first, Some(1 | 2)), "{first:?}");
    // No stream connected: every endpoint counts as the (empty) mean; turns, not index 0.
    for ep in 0..3 {
        f.hear(ep, false);
    }
    let picks: std::collections::BTreeSet<_> = (1..=3)
        .map(|i| {
            f.select(&prompt(i))
                .and_then(|d| d.endpoint)
                .expect("placed")
        })
        .collect();
    assert_eq!(picks.len(), 3, "{picks:?}");
}

#[test]
fn a_request_no_endpoint_holds_goes_to_the_least_prefill_wait_then_emptiest_cache_then_load() {
    // Default settings: `LOXI_KV_COLD_PLACEMENT=least-work` (seeding off to isolate it).
    let s = KvSettings {
        coldstart_seed_n: 0,
        replica_load: 0,
        ..KvSettings::default()
    };
    assert!(KvSettings::default().cold_least_work);
    let f = fx_with(s, 3, serde_json::json!({}));
    let m = meta(PROMPT);
    let placed = |ep: usize| {
        f.metric(&format!(
            "loxilb_pd_kv_tier15_cold_placements_total{{service=\"1\",ep_idx=\"{ep}\"}}"
        ))
    };
    // Nothing held, all idle: the lowest index.
    assert_eq!(f.select(&m), Some(Decision::pick(0, Reason::KvColdPlace)));
    assert_eq!(placed(0), 1.0);
    // A placement is neither a miss nor a fallthrough nor a hit.
    assert_eq!(f.misses("no_worker"), 0.0);
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_fallthrough_total{service=\"1\"}"),
        0.0
    );
    assert_eq!(
        f.metric("loxilb_pd_kv_tier15_hits_total{service=\"1\",ep_idx=\"0\"}"),
        0.0
    );
    // Queued prefill on ep0 (tokens): ep1.
    f.loads[0].prefill_tokens.store(1_000, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvColdPlace)));
    // ep1 and ep2 tie on work; ep1 carries more requests: ep2.
    f.loads[1].in_flight.store(2, Ordering::Relaxed);
    f.loads[2].in_flight.store(1, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvColdPlace)));
    // Work ties; ep2's cache holds another prompt's blocks: the emptier ep1, though it
    // carries more requests (the cache comes before the load).
    let other = meta(
        "A different prompt entirely, about sailing boats and the wind on the open sea, long enough.",
    );
    f.hold(2, &other, 2);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvColdPlace)));
    assert_eq!((placed(0), placed(1), placed(2)), (1.0, 2.0, 1.0));
    // Queues are compared in quanta of the request's own prefill (n·B tokens): less than one
    // more on ep1 is a tie, and the emptier cache still wins; one whole more is not.
    let nb = 16 * f.keys_of(&m).len() as u64;
    f.loads[1].prefill_tokens.store(nb - 1, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvColdPlace)));
    f.loads[1].prefill_tokens.store(nb, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(2, Reason::KvColdPlace)));
    f.loads[1].prefill_tokens.store(0, Ordering::Relaxed);
    // Only an unhealthy endpoint holds the prefix: placed on a healthy one, not `excluded`.
    f.hold(0, &m, 3);
    f.loads[0].healthy.store(false, Ordering::Relaxed);
    assert_eq!(f.select(&m), Some(Decision::pick(1, Reason::KvColdPlace)));
    assert_eq!(f.misses("excluded"), 0.0);
    // `sel` (LoxiLB): the same request falls through, counted as a miss.
    let lax = fx_with(
        KvSettings {
            cold_least_work: false,
            coldstart_seed_n: 0,
            ..KvSettings::default()
        },
        3,
        serde_json::json!({}),
    );
    assert_eq!(lax.select(&m), None);
    assert_eq!(lax.misses("no_worker"), 1.0);
}
