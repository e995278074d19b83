use super::*;
use crate::kv::EngineBlockHash;
use crate::kv::block_hash::RequestExtras;
use crate::kv::ingest::events::{KvEvent, decode_batch};
use crate::kv::testutil::{golden_json, unhex};

fn tokens(n_blocks: usize, bs: usize, salt: u32) -> Vec<u32> {
    (0..(n_blocks * bs) as u32)
        .map(|t| (t * 7 + salt) % 2000)
        .collect()
}

/// A BlockStored the way an engine with `engine` hashing would publish the first `n` blocks.
fn engine_event(engine: &BlockHasher, toks: &[u32], bs: usize) -> BlockStored {
    let keys = engine.keys(toks, bs, &RequestExtras::default());
    BlockStored {
        block_hashes: keys.iter().map(|k| EngineBlockHash::Int(k.0)).collect(),
        token_ids: toks.to_vec(),
        block_size: Some(bs as u32),
        ..Default::default()
    }
}

fn rule_hasher() -> BlockHasher {
    BlockHasher::new(HashAlgo::Sha256Cbor, Some("0"))
}

#[test]
fn every_golden_capture_block_agrees_and_keeps_engine_keys() {
    for file in ["vllm_kv_events_capture.json", "bos_kv_events_capture.json"] {
        let g = golden_json(file);
        let mut book = ParityBook::default();
        let h = rule_hasher();
        for f in g["frames"].as_array().expect("frames") {
            let batch =
                decode_batch(&unhex(f["parts_hex"][2].as_str().expect("hex"))).expect("decode");
            for ev in batch.events.into_iter().flatten() {
                if let KvEvent::BlockStored(st) = ev {
                    let t = book.on_stored(0, &st, &h, 32, &LoraCatalog::default());
                    let engine: Vec<BlockKey> =
                        st.block_hashes.iter().map(EngineBlockHash::key).collect();
                    assert_eq!(t.keys, engine, "{file}");
                }
            }
        }
        let p = book.get(0).expect("report");
        assert_eq!(
            (p.verdict.clone(), p.mismatched_blocks, p.rehash),
            (Verdict::Ok, 0, false),
            "{file}"
        );
        assert!(p.checked_blocks >= ESTABLISH_BLOCKS);
    }
}

#[test]
fn engine_with_other_seed_is_diagnosed_as_seed_and_rehashed() {
    let engine = BlockHasher::new(HashAlgo::Sha256Cbor, Some("42"));
    let toks = tokens(4, 16, 1);
    let ev = engine_event(&engine, &toks, 16);
    let mut book = ParityBook::default();
    let t = book.on_stored(3, &ev, &rule_hasher(), 16, &LoraCatalog::default());
    let p = book.get(3).expect("report");
    assert_eq!(p.verdict, Verdict::Mismatch);
    let diag = p.diagnosis.clone().expect("diagnosis");
    assert!(
        diag.starts_with("seed: engine matches sha256_cbor with seed \"42\""),
        "{diag}"
    );
    assert!(t.verdict_changed && p.rehash);
    assert_eq!(
        t.keys,
        rule_hasher().keys(&toks, 16, &RequestExtras::default())
    );
}

#[test]
fn engine_with_other_algorithm_is_diagnosed_as_algorithm() {
    let engine = BlockHasher::new(HashAlgo::XxhashCbor, Some("0"));
    let ev = engine_event(&engine, &tokens(2, 16, 5), 16);
    let mut book = ParityBook::default();
    book.on_stored(0, &ev, &rule_hasher(), 16, &LoraCatalog::default());
    let diag = book
        .get(0)
        .and_then(|p| p.diagnosis.clone())
        .expect("diagnosis");
    assert!(
        diag.starts_with("algorithm: engine matches xxhash_cbor with seed \"0\""),
        "{diag}"
    );
}

#[test]
fn rehash_chains_children_through_engine_parents_and_maps_removals() {
    let engine = BlockHasher::new(HashAlgo::Sha256Cbor, Some("42"));
    let toks = tokens(3, 16, 9);
    let all = engine_event(&engine, &toks, 16);
    let first = BlockStored {
        block_hashes: all.block_hashes[..1].to_vec(),
        token_ids: toks[..16].to_vec(),
        ..all.clone()
    };
    let rest = BlockStored {
        block_hashes: all.block_hashes[1..].to_vec(),
        parent_block_hash: Some(all.block_hashes[0].clone()),
        token_ids: toks[16..].to_vec(),
        ..all.clone()
    };
    let mut book = ParityBook::default();
    let own = rule_hasher().keys(&toks, 16, &RequestExtras::default());
    assert_eq!(
        book.on_stored(0, &first, &rule_hasher(), 16, &LoraCatalog::default())
            .keys,
        own[..1]
    );
    assert_eq!(
        book.on_stored(0, &rest, &rule_hasher(), 16, &LoraCatalog::default())
            .keys,
        own[1..]
    );
    let removed = book.on_removed(0, &[all.block_hashes[2].key()], HashAlgo::Sha256Cbor);
    assert_eq!(removed, own[2..]);
}

/// In re-hash mode a block loxi cannot digest (here: an event without token ids, and a child of
/// a parent it never saw) is left out of the index and counted, not dropped silently.
#[test]
fn rehash_counts_the_blocks_it_cannot_translate() {
    let engine = BlockHasher::new(HashAlgo::Sha256Cbor, Some("42"));
    let toks = tokens(4, 16, 3);
    let mut book = ParityBook::default();
    let lora = LoraCatalog::default();
    let first = engine_event(&engine, &toks[..32], 16);
    assert_eq!(
        book.on_stored(0, &first, &rule_hasher(), 16, &lora)
            .keys
            .len(),
        2
    );
    assert!(book.get(0).expect("report").rehash);
    let no_tokens = BlockStored {
        token_ids: Vec::new(),
        ..engine_event(&engine, &tokens(3, 16, 8), 16)
    };
    let t = book.on_stored(0, &no_tokens, &rule_hasher(), 16, &lora);
    assert!(t.keys.is_empty());
    assert_eq!(
        t.first_untranslated, 3,
        "the endpoint's first untranslated blocks: warned"
    );
    let all = engine_event(&engine, &toks, 16);
    let orphan = BlockStored {
        block_hashes: all.block_hashes[3..].to_vec(),
        parent_block_hash: Some(EngineBlockHash::Int(0xdead)),
        token_ids: toks[48..].to_vec(),
        ..all.clone()
    };
    let t = book.on_stored(0, &orphan, &rule_hasher(), 16, &lora);
    assert!(t.keys.is_empty());
    assert_eq!(t.first_untranslated, 0, "counted, not warned again");
    assert_eq!(book.get(0).expect("report").untranslated_blocks, 3 + 1);
}

/// A report's clone (what the readiness sweep and the parity view take every second, under
/// the lock) leaves the digest table behind; the book keeps it, so re-hash mode still maps
/// the engine's removals.
#[test]
fn a_report_clone_leaves_the_digest_table_behind() {
    let engine = BlockHasher::new(HashAlgo::Sha256Cbor, Some("42"));
    let toks = tokens(3, 16, 9);
    let all = engine_event(&engine, &toks, 16);
    let mut book = ParityBook::default();
    book.on_stored(0, &all, &rule_hasher(), 16, &LoraCatalog::default());
    let held = book.get(0).expect("report");
    assert!(held.rehash);
    assert_eq!(held.digests.len(), 3);
    let report = held.clone();
    assert!(report.digests.is_empty());
    assert_eq!(
        (report.rehash, report.verdict.clone(), report.checked_blocks),
        (held.rehash, held.verdict.clone(), held.checked_blocks)
    );
    let own = rule_hasher().keys(&toks, 16, &RequestExtras::default());
    let removed = book.on_removed(0, &[all.block_hashes[2].key()], HashAlgo::Sha256Cbor);
    assert_eq!(removed, own[2..]);
}

#[test]
fn token_count_not_matching_block_size_is_diagnosed_as_block_size() {
    let ev = BlockStored {
        block_hashes: vec![EngineBlockHash::Int(1)],
        token_ids: vec![1; 20],
        ..Default::default()
    };
    let d = diagnose(&ev, 0, BlockKey(1), &rule_hasher(), 16);
    assert!(d.starts_with("block_size: 20 tokens for 1 blocks"), "{d}");
}

#[test]
fn salted_root_block_is_checked_with_its_cache_salt_extra_key() {
    let h = rule_hasher();
    let toks = tokens(2, 16, 3);
    let extras = RequestExtras {
        lora: None,
        cache_salt: Some("tenant-A".into()),
    };
    let keys = h.keys(&toks, 16, &extras);
    let salt_entry = rmpv::Value::Array(vec![rmpv::Value::from("tenant-A")]);
    let ev = BlockStored {
        block_hashes: keys.iter().map(|k| EngineBlockHash::Int(k.0)).collect(),
        token_ids: toks,
        block_size: Some(16),
        extra_keys: Some(vec![salt_entry, rmpv::Value::Nil]),
        ..Default::default()
    };
    let mut book = ParityBook::default();
    book.on_stored(0, &ev, &h, 16, &LoraCatalog::default());
    let p = book.get(0).expect("report");
    assert_eq!((p.checked_blocks, p.mismatched_blocks), (2, 0));
}

/// A `BlockStored` batch exactly as vLLM 0.32's publisher encodes it (map event, every field
/// in the struct's order, `extra_keys` one entry per block), decoded by the ingest decoder.
fn vllm_event(
    keys: &[BlockKey],
    toks: &[u32],
    lora_name: Option<&str>,
    extra_keys: Vec<rmpv::Value>,
) -> BlockStored {
    use rmpv::Value as V;
    let keys: Vec<u64> = keys.iter().map(|k| k.0).collect();
    let ev = crate::kv::testutil::vllm_stored_event(&keys, toks, 16, lora_name, extra_keys);
    let payload =
        crate::kv::testutil::msgpack(&V::Array(vec![V::F64(1.0), V::Array(vec![ev]), V::from(0)]));
    match decode_batch(&payload).expect("batch").events.remove(0) {
        Ok(KvEvent::BlockStored(st)) => st,
        other => panic!("not a BlockStored: {other:?}"),
    }
}

/// `(checked, mismatched, unverified, verdict)` of a fresh book after `ev`.
fn verdict_after(ev: &BlockStored, lora: &LoraCatalog) -> (u64, u64, u64, Verdict) {
    let mut book = ParityBook::default();
    book.on_stored(0, ev, &rule_hasher(), 16, lora);
    let p = book.get(0).expect("report");
    (
        p.checked_blocks,
        p.mismatched_blocks,
        p.unverified_blocks,
        p.verdict.clone(),
    )
}

/// Extra keys as vLLM 0.32 publishes them (untagged, one entry per block: LoRA name, then
/// multimodal `(identifier, offset)` pairs, then the cache salt on block 0, then a
/// prompt-embeddings digest) confirm a correct engine when loxi can reproduce them and never
/// flip it to a mismatch when it cannot.
#[test]
fn extra_keys_as_vllm_publishes_them_never_flip_a_correct_engine() {
    use rmpv::Value as V;
    let h = rule_hasher();
    let toks = tokens(3, 16, 11);
    let cat = LoraCatalog::new([("sql".to_owned(), "/adapters/sql".to_owned())].into());
    let tup = |items: Vec<V>| V::Array(items);

    // Salt and LoRA + salt: reproduced, every block checked and agreeing.
    let salted = RequestExtras {
        lora: None,
        cache_salt: Some("tenant-A".into()),
    };
    let ev = vllm_event(
        &h.keys(&toks, 16, &salted),
        &toks,
        None,
        vec![tup(vec![V::from("tenant-A")]), V::Nil, V::Nil],
    );
    assert_eq!(verdict_after(&ev, &cat), (3, 0, 0, Verdict::Unknown));
    let lora_salted = RequestExtras {
        lora: Some(("sql".into(), "/adapters/sql".into())),
        cache_salt: Some("tenant-A".into()),
    };
    let ev = vllm_event(
        &h.keys(&toks, 16, &lora_salted),
        &toks,
        Some("sql"),
        vec![
            tup(vec![V::from("sql"), V::from("tenant-A")]),
            tup(vec![V::from("sql")]),
            tup(vec![V::from("sql")]),
        ],
    );
    assert_eq!(verdict_after(&ev, &cat), (3, 0, 0, Verdict::Unknown));

    // Keys loxi cannot reproduce: the engine's ids differ from anything loxi computes (they
    // come from the image / embeddings / the engine's adapter path), and the engine is right.
    let foreign: Vec<BlockKey> = (0..3).map(|i| BlockKey(0xabc0 + i)).collect();
    let cases = [
        // One string on block 0 that is not a salt loxi can reproduce (a multimodal
        // identifier, say): before, it was hashed as a salt and flipped the engine.
        (
            None,
            vec![tup(vec![V::from("f0a1b2c3-image")]), V::Nil, V::Nil],
        ),
        // A multimodal item at offset 5 of block 0 and its continuation in block 1.
        (
            None,
            vec![
                tup(vec![tup(vec![V::from("img-1"), V::from(5)])]),
                tup(vec![tup(vec![V::from("img-1"), V::from(-11)])]),
                V::Nil,
            ],
        ),
        // Prompt embeddings (a digest per block).
        (
            None,
            vec![
                tup(vec![V::Binary(vec![1; 32])]),
                tup(vec![V::Binary(vec![2; 32])]),
                tup(vec![V::Binary(vec![3; 32])]),
            ],
        ),
        // An adapter the engine loaded from another path than loxi's catalog says.
        (
            Some("sql"),
            vec![
                tup(vec![V::from("sql")]),
                tup(vec![V::from("sql")]),
                tup(vec![V::from("sql")]),
            ],
        ),
    ];
    for (lora_name, extra) in cases {
        let ev = vllm_event(&foreign, &toks, lora_name, extra.clone());
        let (checked, mismatched, _, verdict) = verdict_after(&ev, &cat);
        assert_eq!(
            (checked, mismatched, verdict),
            (0, 0, Verdict::Unknown),
            "{extra:?}"
        );
    }

    // The same foreign ids without extra keys are a real mismatch.
    let ev = vllm_event(&foreign, &toks, None, vec![V::Nil, V::Nil, V::Nil]);
    assert_eq!(verdict_after(&ev, &cat).3, Verdict::Mismatch);
}
