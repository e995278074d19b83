//! Unit and property tests of the hash chain. Golden vectors: `tests/tests/kv_golden.rs`.

use super::*;
use proptest::prelude::*;

fn ciborium_encoding(parent: &BlockDigest, tokens: &[u32], extra: &[ExtraKey]) -> Vec<u8> {
    use ciborium::Value;
    let extra_value = if extra.is_empty() {
        Value::Null
    } else {
        Value::Array(
            extra
                .iter()
                .map(|k| match k {
                    ExtraKey::Lora(n, p) => Value::Array(vec![
                        Value::Text("lora".into()),
                        Value::Text(n.clone()),
                        Value::Text(p.clone()),
                    ]),
                    ExtraKey::CacheSalt(s) => Value::Array(vec![
                        Value::Text("cache_salt".into()),
                        Value::Text(s.clone()),
                    ]),
                })
                .collect(),
        )
    };
    let v = Value::Array(vec![
        Value::Bytes(parent.as_bytes().to_vec()),
        Value::Array(tokens.iter().map(|&t| Value::Integer(t.into())).collect()),
        extra_value,
    ]);
    let mut out = Vec::new();
    ciborium::into_writer(&v, &mut out).expect("ciborium writes into a Vec");
    out
}

fn algo_strategy() -> impl Strategy<Value = HashAlgo> {
    prop_oneof![
        Just(HashAlgo::Sha256Cbor),
        Just(HashAlgo::XxhashCbor),
        Just(HashAlgo::Sha256Sglang)
    ]
}

fn extras_strategy() -> impl Strategy<Value = RequestExtras> {
    (
        proptest::option::of(("[a-z]{1,8}", "/[a-z/]{0,300}")),
        proptest::option::of(".{0,40}"),
    )
        .prop_map(|(lora, cache_salt)| RequestExtras { lora, cache_salt })
}

#[test]
fn algo_names_round_trip_and_unknown_name_is_an_error_naming_the_value() {
    for name in HashAlgo::NAMES {
        let algo: HashAlgo = name.parse().expect("known name parses");
        assert_eq!(algo.to_string(), name);
    }
    let err = "sha256"
        .parse::<HashAlgo>()
        .expect_err("pickle sha256 is not portable");
    assert!(err.to_string().contains("\"sha256\""), "{err}");
}

#[test]
fn unset_seed_is_vllm_fixed_string_for_sha256_cbor_and_random_for_xxhash_cbor() {
    let a = BlockHasher::new(HashAlgo::Sha256Cbor, None);
    assert_eq!(
        a.none_hash().to_hex(),
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    );
    let x1 = BlockHasher::new(HashAlgo::XxhashCbor, None);
    let x2 = BlockHasher::new(HashAlgo::XxhashCbor, None);
    assert_ne!(x1.none_hash(), x2.none_hash());
    assert_eq!(x1.none_hash().as_bytes().len(), 16);
}

#[test]
fn sglang_none_hash_is_empty_and_ignores_the_seed() {
    let s = BlockHasher::new(HashAlgo::Sha256Sglang, Some("0"));
    assert!(s.none_hash().as_bytes().is_empty());
    assert_eq!(s.none_hash().key(HashAlgo::Sha256Sglang), BlockKey(0));
}

#[test]
fn sglang_request_with_extras_yields_no_blocks() {
    let s = BlockHasher::new(HashAlgo::Sha256Sglang, None);
    let extras = RequestExtras {
        lora: None,
        cache_salt: Some("t".into()),
    };
    assert!(s.hash_prompt(&[1; 64], 16, &extras).is_empty());
    assert_eq!(
        s.hash_prompt(&[1; 64], 16, &RequestExtras::default()).len(),
        4
    );
}

#[test]
fn zero_block_size_yields_no_blocks() {
    let h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"));
    assert!(h.keys(&[1, 2, 3], 0, &RequestExtras::default()).is_empty());
}

#[test]
fn digest_from_bytes_rejects_more_than_32_bytes() {
    assert!(BlockDigest::from_bytes(&[0; 33]).is_none());
    let d = BlockDigest::from_bytes(&[7; 16]).expect("16 bytes fit");
    assert_eq!(d.key(HashAlgo::XxhashCbor), BlockKey(0x0707_0707_0707_0707));
}

proptest! {
    #[test]
    fn cbor_encoding_equals_ciborium(
        tokens in proptest::collection::vec(any::<u32>(), 0..40),
        extras in extras_strategy(),
        first in any::<bool>(),
    ) {
        let h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"));
        let (b0, rest) = extras.per_block();
        let extra = if first { b0 } else { rest };
        let ours = h.cbor_input(h.none_hash(), &tokens, &extra);
        prop_assert_eq!(ours, ciborium_encoding(h.none_hash(), &tokens, &extra));
    }

    #[test]
    fn prefix_of_tokens_gives_prefix_of_keys(
        algo in algo_strategy(),
        tokens in proptest::collection::vec(0u32..200_000, 0..200),
        cut in 0usize..200,
        bs in 1usize..20,
        extras in extras_strategy(),
    ) {
        let extras = if algo == HashAlgo::Sha256Sglang { RequestExtras::default() } else { extras };
        let h = BlockHasher::new(algo, Some("7"));
        let full = h.keys(&tokens, bs, &extras);
        let cut = cut.min(tokens.len());
        let part = h.keys(&tokens[..cut], bs, &extras);
        prop_assert_eq!(full.len(), tokens.len() / bs);
        prop_assert_eq!(part.len(), cut / bs);
        prop_assert_eq!(&full[..part.len()], &part[..]);
    }

    #[test]
    fn changing_token_j_changes_every_key_from_block_j_over_b_on(
        algo in algo_strategy(),
        tokens in proptest::collection::vec(0u32..200_000, 1..200),
        j in 0usize..200,
        delta in 1u32..1000,
        bs in 1usize..20,
    ) {
        let h = BlockHasher::new(algo, Some("7"));
        let j = j % tokens.len();
        let mut changed = tokens.clone();
        changed[j] = changed[j].wrapping_add(delta);
        let none = RequestExtras::default();
        let a = h.keys(&tokens, bs, &none);
        let b = h.keys(&changed, bs, &none);
        for i in 0..a.len() {
            if i < j / bs {
                prop_assert_eq!(a[i], b[i], "block {} before the change must be equal", i);
            } else {
                prop_assert_ne!(a[i], b[i], "block {} from the change on must differ", i);
            }
        }
    }

    #[test]
    fn cache_salt_changes_every_key_and_lora_too(
        tokens in proptest::collection::vec(0u32..200_000, 16..100),
        salt in ".{1,20}",
    ) {
        let h = BlockHasher::new(HashAlgo::XxhashCbor, Some("1"));
        let plain = h.keys(&tokens, 8, &RequestExtras::default());
        let salted = h.keys(&tokens, 8, &RequestExtras { lora: None, cache_salt: Some(salt) });
        let lora = h.keys(&tokens, 8, &RequestExtras { lora: Some(("a".into(), "/a".into())), cache_salt: None });
        for i in 0..plain.len() {
            prop_assert_ne!(plain[i], salted[i]);
            prop_assert_ne!(plain[i], lora[i]);
        }
    }

    #[test]
    fn hash_prompt_equals_manual_chaining_of_hash_block(
        algo in algo_strategy(),
        tokens in proptest::collection::vec(any::<u32>(), 0..100),
        bs in 1usize..12,
        extras in extras_strategy(),
    ) {
        let extras = if algo == HashAlgo::Sha256Sglang { RequestExtras::default() } else { extras };
        let h = BlockHasher::new(algo, Some("x"));
        let (b0, rest) = extras.per_block();
        let mut parent = *h.none_hash();
        let mut manual = Vec::new();
        for (i, blk) in tokens.chunks_exact(bs).enumerate() {
            parent = h.hash_block(&parent, blk, if i == 0 { &b0 } else { &rest });
            manual.push(parent);
        }
        prop_assert_eq!(h.hash_prompt(&tokens, bs, &extras), manual);
    }
}
