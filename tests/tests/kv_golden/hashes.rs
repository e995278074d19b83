//! Block-hash vectors of real vLLM 0.32 and SGLang 0.5.23.

use loxi_user::kv::BlockKey;
use loxi_user::kv::block_hash::{BlockDigest, BlockHasher, ExtraKey, HashAlgo, RequestExtras};
use serde_json::Value;

use super::support::{golden, str_of, unhex};

fn wide_tokens_of(v: &Value) -> Vec<u64> {
    v["tokens"]
        .as_array()
        .expect("tokens array")
        .iter()
        .map(|t| t.as_u64().expect("token is uint"))
        .collect()
}

/// The tokens as u32, or `None` when one exceeds `u32::MAX` (the CBOR-width boundary case).
fn narrow_tokens_of(v: &Value) -> Option<Vec<u32>> {
    wide_tokens_of(v)
        .into_iter()
        .map(|t| u32::try_from(t).ok())
        .collect()
}

fn tokens_of(v: &Value) -> Vec<u32> {
    narrow_tokens_of(v).expect("tokens fit u32")
}

fn extras_of(case: &Value) -> RequestExtras {
    let lora = case["lora"].as_object().map(|l| {
        (
            l["lora_name"].as_str().expect("lora_name").to_owned(),
            l["lora_path"].as_str().expect("lora_path").to_owned(),
        )
    });
    let cache_salt = case["cache_salt"].as_str().map(str::to_owned);
    RequestExtras { lora, cache_salt }
}

fn extra_keys_of(block: &Value) -> Vec<ExtraKey> {
    let Some(keys) = block["extra_keys_hashed"].as_array() else {
        return Vec::new();
    };
    keys.iter()
        .map(|k| {
            let parts: Vec<&str> = k
                .as_array()
                .expect("tagged tuple")
                .iter()
                .map(|p| p.as_str().expect("text"))
                .collect();
            match parts.as_slice() {
                ["lora", name, path] => ExtraKey::Lora((*name).into(), (*path).into()),
                ["cache_salt", salt] => ExtraKey::CacheSalt((*salt).into()),
                other => panic!("unexpected extra key {other:?}"),
            }
        })
        .collect()
}

/// Checks one algorithm entry of one seed run; returns the number of blocks checked.
fn check_algo(seed_name: &str, algo: HashAlgo, entry: &Value) -> usize {
    let seed = str_of(entry, "none_hash_seed");
    // "unset" runs record the seed vLLM actually used; for sha256_cbor it must be ours.
    let hasher = if seed_name == "unset" && algo == HashAlgo::Sha256Cbor {
        BlockHasher::new(algo, None)
    } else {
        BlockHasher::new(algo, Some(seed))
    };
    let ctx = format!("seed={seed_name} algo={algo}");
    assert_eq!(
        hasher.none_hash().to_hex(),
        str_of(entry, "none_hash_hex"),
        "{ctx} NONE_HASH"
    );
    assert_eq!(
        hasher.none_hash().key(algo),
        BlockKey(entry["none_hash_wire_u64"].as_u64().expect("u64")),
        "{ctx} NONE_HASH key"
    );
    let mut checked = 0;
    for (bs, cases) in entry["block_sizes"].as_object().expect("block_sizes map") {
        let bs: usize = bs.parse().expect("block size");
        for case in cases.as_array().expect("cases") {
            checked += check_case(
                &hasher,
                algo,
                bs,
                case,
                &format!("{ctx} bs={bs} case={}", str_of(case, "name")),
            );
        }
    }
    checked
}

fn check_case(hasher: &BlockHasher, algo: HashAlgo, bs: usize, case: &Value, ctx: &str) -> usize {
    let wide = wide_tokens_of(case);
    let blocks = case["blocks"].as_array().expect("blocks");
    let Some(tokens) = narrow_tokens_of(case) else {
        return check_wide_case(hasher, algo, &wide, blocks, ctx);
    };
    let extras = extras_of(case);
    let digests = hasher.hash_prompt(&tokens, bs, &extras);
    let keys = hasher.keys(&tokens, bs, &extras);
    assert_eq!(digests.len(), blocks.len(), "{ctx}: full blocks only");
    for (i, block) in blocks.iter().enumerate() {
        let range = block["token_range"].as_array().expect("range");
        let (start, end) = (
            range[0].as_u64().expect("start") as usize,
            range[1].as_u64().expect("end") as usize,
        );
        let parent = match block["parent_hex"].as_str() {
            None => *hasher.none_hash(),
            Some(h) => BlockDigest::from_bytes(&unhex(h)).expect("digest"),
        };
        let extra = extra_keys_of(block);
        let cbor = hasher.cbor_input(&parent, &tokens[start..end], &extra);
        assert_eq!(
            hex_of(&cbor),
            str_of(block, "cbor_input_hex"),
            "{ctx} block {i}: CBOR bytes"
        );
        let one = hasher.hash_block(&parent, &tokens[start..end], &extra);
        assert_eq!(
            one.to_hex(),
            str_of(block, "digest_hex"),
            "{ctx} block {i}: hash_block digest"
        );
        assert_eq!(
            digests[i].to_hex(),
            str_of(block, "digest_hex"),
            "{ctx} block {i}: hash_prompt digest"
        );
        let wire = BlockKey(block["wire_u64"].as_u64().expect("wire_u64"));
        assert_eq!(keys[i], wire, "{ctx} block {i}: wire key");
        assert_eq!(
            format!("{:016x}", keys[i].0),
            str_of(block, "wire_u64_hex"),
            "{ctx} block {i}"
        );
    }
    blocks.len()
}

/// A case with a token id above `u32::MAX` (2^32 in the CBOR-width case): hashed block by
/// block through the wide entry point, as events carrying such ids would be.
fn check_wide_case(
    hasher: &BlockHasher,
    algo: HashAlgo,
    tokens: &[u64],
    blocks: &[Value],
    ctx: &str,
) -> usize {
    assert!(
        tokens.iter().any(|&t| t > u64::from(u32::MAX)),
        "{ctx}: wide case"
    );
    let mut parent = *hasher.none_hash();
    for (i, block) in blocks.iter().enumerate() {
        let range = block["token_range"].as_array().expect("range");
        let (start, end) = (
            range[0].as_u64().expect("start") as usize,
            range[1].as_u64().expect("end") as usize,
        );
        let extra = extra_keys_of(block);
        let cbor = hasher.cbor_input(&parent, &tokens[start..end], &extra);
        assert_eq!(
            hex_of(&cbor),
            str_of(block, "cbor_input_hex"),
            "{ctx} block {i}: CBOR bytes"
        );
        parent = hasher
            .hash_block_wide(&parent, &tokens[start..end], &extra)
            .expect("CBOR algos take any u64");
        assert_eq!(
            parent.to_hex(),
            str_of(block, "digest_hex"),
            "{ctx} block {i}: digest"
        );
        assert_eq!(
            parent.key(algo),
            BlockKey(block["wire_u64"].as_u64().expect("wire_u64")),
            "{ctx} block {i}"
        );
    }
    blocks.len()
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn every_vllm_golden_vector_matches_for_both_cbor_algorithms_all_seeds_and_block_sizes() {
    let g = golden("vllm_block_hashes.json");
    let mut blocks = 0;
    let mut entries = 0;
    for (seed_name, run) in g["runs"].as_object().expect("runs") {
        for (algo_name, entry) in run["algos"].as_object().expect("algos") {
            if algo_name == "sha256" {
                continue; // vLLM's pickle-based algorithm: Python-only reference.
            }
            let algo: HashAlgo = algo_name.parse().expect("known algorithm");
            blocks += check_algo(seed_name, algo, entry);
            entries += 1;
        }
    }
    assert_eq!(entries, 6, "3 seeds x 2 CBOR algorithms");
    assert!(blocks > 200, "checked {blocks} blocks");
}

#[test]
fn unset_seed_sha256_cbor_matches_vllm_across_processes() {
    let g = golden("vllm_block_hashes.json");
    let d = &g["none_hash_determinism_unset"]["sha256_cbor"];
    let h = BlockHasher::new(HashAlgo::Sha256Cbor, None);
    assert_eq!(h.none_hash().to_hex(), str_of(d, "unset_run1_none_hash"));
    assert_eq!(h.none_hash().to_hex(), str_of(d, "unset_run2_none_hash"));
}

#[test]
fn every_sglang_golden_page_matches_including_partial_pages_and_negative_i64() {
    let g = golden("sglang_page_hashes.json");
    let hasher = BlockHasher::new(HashAlgo::Sha256Sglang, None);
    let cases = g["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 5);
    for case in cases {
        let name = str_of(case, "name");
        let tokens = tokens_of(case);
        let page = case["page_size"].as_u64().expect("page_size") as usize;
        let pages = case["pages"].as_array().expect("pages");
        // The vectors hash a trailing partial page too (LoxiLB's gateway does); chain by hand.
        let mut parent = *hasher.none_hash();
        for (i, chunk) in tokens.chunks(page).enumerate() {
            parent = hasher.hash_block(&parent, chunk, &[]);
            assert_eq!(
                parent.to_hex(),
                str_of(&pages[i], "digest_hex"),
                "{name} page {i}"
            );
            let wire = pages[i]["event_int64"].as_i64().expect("i64");
            assert_eq!(
                parent.key(HashAlgo::Sha256Sglang),
                BlockKey(wire as u64),
                "{name} page {i} key"
            );
        }
        assert_eq!(tokens.chunks(page).count(), pages.len(), "{name}");
        // hash_prompt announces full pages only, as SGLang does.
        let full = hasher.keys(&tokens, page, &RequestExtras::default());
        assert_eq!(full.len(), tokens.len() / page, "{name}");
        for (i, k) in full.iter().enumerate() {
            assert_eq!(
                k.0 as i64,
                pages[i]["event_int64"].as_i64().expect("i64"),
                "{name} full page {i}"
            );
        }
    }
}
