//! Generator tests: reproducibility, sharing structure, token lengths, arrival rates.

use super::multi_turn::MultiTurn as MultiTurnAlias;
use super::shared_prefix::SharedPrefix as SharedPrefixAlias;
use super::trace::{SynthTrace, TraceRecord, TraceReplay, parse_trace};
use super::{Arrival, Payload, Vocab};
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::path::PathBuf;

fn tiny_model_dir() -> PathBuf {
    crate::shared_dir().join("golden/tiny-model")
}

fn vocab() -> Vocab {
    Vocab::from_tokenizer_json(&tiny_model_dir().join("tokenizer.json")).expect("tiny vocab")
}

fn tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(tiny_model_dir().join("tokenizer.json")).expect("tokenizer")
}

fn prompt(p: &Payload) -> &str {
    match p {
        Payload::Completion(s) => s,
        Payload::Chat(_) => panic!("expected a completion"),
    }
}

fn shared_prefix(seed: u64) -> SharedPrefixAlias {
    SharedPrefixAlias {
        groups: 3,
        prompts_per_group: 4,
        system_tokens: 40,
        question_tokens: 8,
        output_tokens: 5,
        arrival: Arrival::Poisson { qps: 10.0 },
        seed,
    }
}

#[test]
fn vocab_words_encode_to_exactly_one_token_each() {
    let v = vocab();
    assert!(v.len() >= 64, "{} words", v.len());
    let text = v.text(&mut StdRng::seed_from_u64(1), 300);
    let enc = tokenizer().encode(text.as_str(), true).expect("encode");
    assert_eq!(enc.get_ids().len(), 300);
}

#[test]
fn same_seed_gives_identical_workload_and_other_seed_differs() {
    let v = vocab();
    let a = shared_prefix(7).build(&v).expect("a");
    let b = shared_prefix(7).build(&v).expect("b");
    let c = shared_prefix(8).build(&v).expect("c");
    assert_eq!(a, b);
    assert_ne!(a.requests[0].payload, c.requests[0].payload);
}

#[test]
fn shared_prefix_groups_share_exactly_the_system_prompt() {
    let w = shared_prefix(3).build(&vocab()).expect("workload");
    assert_eq!(w.requests.len(), 12);
    let tok = tokenizer();
    let ids = |s: &str| tok.encode(s, true).expect("encode").get_ids().to_vec();
    for a in &w.requests {
        assert_eq!(ids(prompt(&a.payload)).len(), 48);
        for b in w.requests.iter().filter(|b| b.id != a.id) {
            let (x, y) = (ids(prompt(&a.payload)), ids(prompt(&b.payload)));
            let common = x.iter().zip(&y).take_while(|(p, q)| p == q).count();
            if a.group == b.group {
                assert!((40..48).contains(&common), "same group shares {common}");
            } else {
                assert!(common < 40, "different groups share {common}");
            }
        }
    }
    for g in 0..3 {
        assert_eq!(w.requests.iter().filter(|r| r.group == g).count(), 4);
    }
    assert!(w.requests.windows(2).all(|p| p[0].at <= p[1].at));
}

#[test]
fn multi_turn_history_grows_and_rounds_wait_for_the_previous_round() {
    let mt = MultiTurnAlias {
        users: 3,
        rounds: 4,
        system_tokens: 20,
        question_tokens: 5,
        answer_tokens: 6,
        active_users: 2,
        arrival: Arrival::Fixed { qps: 5.0 },
        seed: 11,
    };
    let w = mt.build(&vocab()).expect("workload");
    assert_eq!(w.requests.len(), 12);
    let system = match &w.requests[0].payload {
        Payload::Chat(m) => m[0].clone(),
        Payload::Completion(_) => panic!("chat expected"),
    };
    for user in 0..3 {
        let turns: Vec<_> = w.requests.iter().filter(|r| r.group == user).collect();
        assert_eq!(turns.len(), 4);
        assert_eq!(turns[0].after, None);
        for (round, pair) in turns.windows(2).enumerate() {
            assert_eq!(pair[1].after, Some(pair[0].id));
            let (Payload::Chat(prev), Payload::Chat(next)) = (&pair[0].payload, &pair[1].payload)
            else {
                panic!("chat expected")
            };
            assert_eq!(prev.len(), 2 * round + 2);
            assert_eq!(next.len(), prev.len() + 2);
            assert_eq!(
                &next[..prev.len()],
                &prev[..],
                "history is a prefix of the next round"
            );
            assert_eq!(next[0], system);
            assert_eq!(next[prev.len()].role, "assistant");
        }
    }
    // Waves of 2 users: user 2 (the second wave) starts after all 8 requests of users 0 and 1.
    let first_of_user2 = w
        .requests
        .iter()
        .position(|r| r.group == 2)
        .expect("user 2");
    assert_eq!(first_of_user2, 8);
}

#[test]
fn mooncake_hash_ids_map_to_identical_token_blocks() {
    let text = r#"{"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [1, 2, 3]}
{"timestamp": 500, "input_length": 18, "output_length": 3, "hash_ids": [1, 2, 4]}

{"timestamp": 250, "input_length": 16, "output_length": 3, "hash_ids": [5, 2]}"#;
    let recs = parse_trace(text).expect("parse");
    assert_eq!(
        recs[1],
        TraceRecord {
            timestamp: 500,
            input_length: 18,
            output_length: 3,
            hash_ids: vec![1, 2, 4]
        }
    );
    let replay = TraceReplay {
        block_tokens: 8,
        max_prompt_tokens: 100,
        max_output_tokens: 10,
        arrival: None,
        speedup: 2.0,
        seed: 5,
    };
    let w = replay.build(&vocab(), &recs).expect("workload");
    let tok = tokenizer();
    let ids = |i: usize| {
        tok.encode(prompt(&w.requests[i].payload), true)
            .expect("enc")
            .get_ids()
            .to_vec()
    };
    // Sorted by arrival: 0 ms, 125 ms (250/2), 250 ms (500/2).
    let ms: Vec<u128> = w.requests.iter().map(|r| r.at.as_millis()).collect();
    assert_eq!(ms, vec![0, 125, 250]);
    let (a, c, b) = (ids(0), ids(1), ids(2));
    assert_eq!((a.len(), b.len(), c.len()), (20, 18, 16));
    assert_eq!(a[..16], b[..16], "ids 1,2 shared");
    assert_ne!(a[16..18], b[16..18], "ids 3 and 4 differ");
    assert_eq!(
        a[8..16],
        c[8..16],
        "id 2 is the same block at the same position"
    );
    assert_ne!(a[..8], c[..8]);
}

#[test]
fn trace_line_errors_name_the_line() {
    let err = parse_trace("{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": []}\n{\"timestamp\": 1}")
        .expect_err("missing fields");
    assert!(
        err.starts_with("line 2:") && err.contains("input_length"),
        "{err}"
    );
}

#[test]
fn synthetic_trace_shares_document_blocks_and_is_seeded() {
    let s = SynthTrace {
        requests: 50,
        documents: 4,
        doc_blocks: 4,
        max_unique_blocks: 2,
        block_tokens: 16,
        output_length: 8,
        arrival: Arrival::Poisson { qps: 20.0 },
        seed: 9,
    };
    let a = s.generate();
    assert_eq!(a, s.generate());
    assert!(
        a.iter()
            .all(|r| r.input_length == r.hash_ids.len() * 16 && r.hash_ids.len() >= 2)
    );
    // Document 0 has the highest weight and must be reused.
    assert!(a.iter().filter(|r| r.hash_ids[0] == 0).count() > 5);
    let mut uniques: Vec<u64> = a
        .iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .filter(|h| *h >= 16)
        .collect();
    let n = uniques.len();
    uniques.sort();
    uniques.dedup();
    assert_eq!(uniques.len(), n, "unique blocks are never shared");
}

#[test]
fn poisson_mean_rate_is_within_five_percent_over_a_fixed_seed() {
    let offs = Arrival::Poisson { qps: 50.0 }.offsets(20_000, &mut StdRng::seed_from_u64(42));
    let rate = (offs.len() - 1) as f64 / offs.last().expect("last").as_secs_f64();
    assert!((rate - 50.0).abs() < 2.5, "rate {rate}");
    let fixed = Arrival::Fixed { qps: 4.0 }.offsets(3, &mut StdRng::seed_from_u64(0));
    assert_eq!(
        fixed.iter().map(|d| d.as_millis()).collect::<Vec<_>>(),
        vec![0, 250, 500]
    );
}

#[test]
fn bad_parameters_are_named() {
    let mut p = shared_prefix(1);
    p.groups = 0;
    let e = p.build(&vocab()).expect_err("zero groups");
    assert!(e.to_string().contains("groups"), "{e}");
    let e = Arrival::parse("burst", 1.0).expect_err("kind");
    assert!(e.to_string().contains("arrival"), "{e}");
    assert!(Arrival::parse("poisson", 0.0).is_err());
}

fn req(id: usize, after: Option<usize>) -> super::WorkRequest {
    super::WorkRequest {
        id,
        at: std::time::Duration::from_millis(id as u64),
        payload: Payload::Completion(format!("p{id}")),
        max_tokens: 4,
        after,
        group: 0,
    }
}

#[test]
fn excluding_drops_marked_requests_and_their_followers_and_renumbers() {
    // 0 ← 2 ← 4 is one conversation; 1 and 3 are independent.
    let w = super::Workload::new(
        "t",
        vec![
            req(0, None),
            req(1, None),
            req(2, Some(0)),
            req(3, None),
            req(4, Some(2)),
        ],
    );
    let (kept, removed) = w.excluding(&[false, false, true, false, false]);
    assert_eq!(removed, 2, "request 2 and request 4, which waits for it");
    let prompts: Vec<&str> = kept.requests.iter().map(|r| prompt(&r.payload)).collect();
    assert_eq!(prompts, ["p0", "p1", "p3"]);
    assert_eq!(
        kept.requests.iter().map(|r| r.id).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    let (kept, removed) = w.excluding(&[true]);
    assert_eq!(removed, 3, "0, then 2 and 4 through `after`");
    let linked: Vec<(usize, Option<usize>)> =
        kept.requests.iter().map(|r| (r.id, r.after)).collect();
    assert_eq!(linked, [(0, None), (1, None)]);
    let (same, removed) = w.excluding(&[]);
    assert_eq!((removed, same), (0, w.clone()));
    // A kept follower's `after` is remapped to its predecessor's new id.
    let (kept, _) = w.excluding(&[false, true]);
    let linked: Vec<Option<usize>> = kept.requests.iter().map(|r| r.after).collect();
    assert_eq!(linked, [None, Some(0), None, Some(1)]);
}

#[test]
fn fit_check_matches_the_engines_rule() {
    // 16-token blocks, 10 usable: 160 tokens of prompt + output fit, 161 do not.
    assert!(super::fits_cache(150, 10, 16, 10));
    assert!(!super::fits_cache(151, 10, 16, 10));
    assert!(!super::fits_cache(1, 0, 16, 0));
}

#[test]
fn trace_cache_size_fits_the_longest_prompt_with_bos_and_output() {
    use super::trace::cache_blocks_for;
    // 12,288-token prompts (the run that failed 439 of 1,200), 256 output tokens, 16-token
    // blocks: 12,288 + 16 + 256 = 12,560 tokens = 785 blocks, + the null block.
    assert_eq!(cache_blocks_for(12_288, 256, 16), 786);
    for (prompt, out, bs) in [(3584, 256, 16), (12_288, 256, 16), (513, 1, 512), (1, 0, 1)] {
        let blocks = cache_blocks_for(prompt, out, bs);
        // Usable = blocks − 1 (block 0 is the null block); a BOS token more still fits.
        assert!(
            super::fits_cache(prompt + 1, out, bs, blocks - 1),
            "{prompt} {out} {bs}"
        );
    }
}
