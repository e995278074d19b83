use rmpv::Value;
use serde_json::Value as J;

use super::*;
use crate::kv::BlockKey;
use crate::kv::testutil::{golden_json, unhex};

fn hash_json(h: &EngineBlockHash) -> J {
    match h {
        EngineBlockHash::Int(v) => J::from(*v),
        EngineBlockHash::Bytes(b) => serde_json::json!({ "bytes_hex": hex::encode(b) }),
    }
}

fn rmpv_json(v: &Value) -> J {
    match v {
        Value::Nil => J::Null,
        Value::String(s) => J::from(s.as_str().unwrap_or_default()),
        Value::Integer(i) => i
            .as_u64()
            .map(J::from)
            .or(i.as_i64().map(J::from))
            .unwrap_or(J::Null),
        Value::Array(a) => J::Array(a.iter().map(rmpv_json).collect()),
        other => J::from(other.to_string()),
    }
}

/// Asserts every field we decode equals the golden JSON's decoded event.
fn assert_event_matches(ours: &KvEvent, want: &J, ctx: &str) {
    let ty = want["type"].as_str().expect("golden event has a type");
    match ours {
        KvEvent::BlockStored(b) => {
            assert_eq!(ty, "BlockStored", "{ctx}");
            let hashes: Vec<J> = b.block_hashes.iter().map(hash_json).collect();
            assert_eq!(J::Array(hashes), want["block_hashes"], "{ctx} block_hashes");
            let parent = b
                .parent_block_hash
                .as_ref()
                .map(hash_json)
                .unwrap_or(J::Null);
            assert_eq!(parent, want["parent_block_hash"], "{ctx} parent");
            assert_eq!(
                J::from(b.token_ids.clone()),
                want["token_ids"],
                "{ctx} token_ids"
            );
            assert_eq!(
                b.block_size.map(J::from).unwrap_or(J::Null),
                want["block_size"],
                "{ctx}"
            );
            assert_eq!(
                b.lora_id.map(J::from).unwrap_or(J::Null),
                want["lora_id"],
                "{ctx}"
            );
            assert_eq!(
                b.lora_name.clone().map(J::from).unwrap_or(J::Null),
                want["lora_name"],
                "{ctx}"
            );
            let extra = b
                .extra_keys
                .as_ref()
                .map(|e| J::Array(e.iter().map(rmpv_json).collect()));
            assert_eq!(
                extra.unwrap_or(J::Null),
                want.get("extra_keys").cloned().unwrap_or(J::Null),
                "{ctx}"
            );
        }
        KvEvent::BlockRemoved { block_hashes, .. } => {
            assert_eq!(ty, "BlockRemoved", "{ctx}");
            let hashes: Vec<J> = block_hashes.iter().map(hash_json).collect();
            assert_eq!(J::Array(hashes), want["block_hashes"], "{ctx}");
        }
        KvEvent::AllBlocksCleared => assert_eq!(ty, "AllBlocksCleared", "{ctx}"),
    }
}

fn assert_batch_matches(batch: &EventBatch, want: &J, ctx: &str) {
    let want_ts = want[0].as_f64().expect("golden ts");
    assert!(
        (batch.ts - want_ts).abs() < 1e-5,
        "{ctx} ts {} vs {want_ts}",
        batch.ts
    );
    let events = want[1].as_array().expect("golden events array");
    assert_eq!(batch.events.len(), events.len(), "{ctx} event count");
    for (i, (ours, w)) in batch.events.iter().zip(events).enumerate() {
        let ours = ours
            .as_ref()
            .unwrap_or_else(|e| panic!("{ctx} event {i}: {e}"));
        assert_event_matches(ours, w, &format!("{ctx} event {i}"));
    }
    assert_eq!(
        batch.dp_rank.map(J::from).unwrap_or(J::Null),
        want[2],
        "{ctx} dp_rank"
    );
}

#[test]
fn every_golden_encoding_batch_decodes_to_its_json() {
    let g = golden_json("vllm_kv_events_encoding.json");
    let batches = g["batches"].as_object().expect("batches");
    assert_eq!(batches.len(), 5);
    for (name, b) in batches {
        let payload = unhex(b["payload_hex"].as_str().expect("payload_hex"));
        let batch = decode_batch(&payload).expect(name);
        assert_batch_matches(&batch, &b["decoded_generic"], name);
    }
}

#[test]
fn every_captured_frame_of_both_engines_decodes_to_its_json() {
    for file in ["vllm_kv_events_capture.json", "bos_kv_events_capture.json"] {
        let g = golden_json(file);
        let frames = g["frames"].as_array().expect("frames");
        assert!(frames.len() >= 10, "{file}");
        for f in frames {
            let payload = unhex(f["parts_hex"][2].as_str().expect("payload frame"));
            let ctx = format!("{file} frame {}", f["i"]);
            let batch = decode_batch(&payload).expect(&ctx);
            assert_batch_matches(&batch, &f["decoded"], &ctx);
        }
    }
}

fn enc(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("encode to vec");
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn stored_map(hash: u64) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(vec![Value::from(hash)])),
        (s("parent_block_hash"), Value::Nil),
        (
            s("token_ids"),
            Value::Array((0..4u32).map(Value::from).collect()),
        ),
        (s("block_size"), Value::from(4)),
        (s("lora_id"), Value::Nil),
        (s("some_future_key"), s("ignored")),
    ])
}

fn stored_array(hash: u64) -> Value {
    Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(hash)]),
        Value::Nil,
        Value::Array((0..4u32).map(Value::from).collect()),
        Value::from(4),
        Value::Nil,
    ])
}

fn batch(events: Vec<Value>, rank: Option<Value>) -> Vec<u8> {
    let mut parts = vec![Value::F64(1.5), Value::Array(events)];
    parts.extend(rank);
    enc(&Value::Array(parts))
}

fn stored_keys(ev: &Result<KvEvent, EventError>) -> Vec<BlockKey> {
    match ev {
        Ok(KvEvent::BlockStored(b)) => b.block_hashes.iter().map(EngineBlockHash::key).collect(),
        other => panic!("expected BlockStored, got {other:?}"),
    }
}

#[test]
fn map_event_with_hash_above_i64_max_stores_exact_u64() {
    let h = 0x8000_0000_0000_0001u64;
    let b = decode_batch(&batch(vec![stored_map(h)], Some(Value::from(0)))).expect("decodes");
    assert_eq!(stored_keys(&b.events[0]), vec![BlockKey(h)]);
}

#[test]
fn legacy_array_event_decodes_same_as_map() {
    let h = 0xDEAD_BEEF_0000_0001u64;
    let b = decode_batch(&batch(vec![stored_array(h)], Some(Value::from(0)))).expect("decodes");
    assert_eq!(stored_keys(&b.events[0]), vec![BlockKey(h)]);
    let KvEvent::BlockStored(st) = b.events[0].clone().expect("ok") else {
        panic!("kind")
    };
    assert_eq!(st.token_ids, vec![0, 1, 2, 3]);
    assert_eq!(st.block_size, Some(4));
}

#[test]
fn batch_mixing_array_and_map_events_decodes_both() {
    let b = decode_batch(&batch(vec![stored_array(7), stored_map(9)], None)).expect("decodes");
    assert_eq!(stored_keys(&b.events[0]), vec![BlockKey(7)]);
    assert_eq!(stored_keys(&b.events[1]), vec![BlockKey(9)]);
}

#[test]
fn array_event_with_unknown_trailing_fields_and_max_hash_decodes() {
    let mut ev = stored_array(u64::MAX);
    if let Value::Array(items) = &mut ev {
        items.extend([
            s("GPU"),
            Value::Nil,
            Value::Nil,
            s("x"),
            Value::from(3),
            Value::Boolean(true),
        ]);
    }
    let b = decode_batch(&batch(vec![ev], None)).expect("decodes");
    assert_eq!(stored_keys(&b.events[0]), vec![BlockKey(u64::MAX)]);
}

#[test]
fn negative_int_hash_is_twos_complement() {
    let ev = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::from(-1i64)]),
    ]);
    let b = decode_batch(&batch(vec![ev], None)).expect("decodes");
    let Ok(KvEvent::BlockRemoved { block_hashes, .. }) = &b.events[0] else {
        panic!("kind")
    };
    assert_eq!(block_hashes[0].key(), BlockKey(u64::MAX));
}

#[test]
fn block_removed_with_only_tag_and_hashes_decodes() {
    let ev = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::from(5u64)]),
    ]);
    let b = decode_batch(&batch(vec![ev], None)).expect("decodes");
    assert_eq!(
        b.events[0],
        Ok(KvEvent::BlockRemoved {
            block_hashes: vec![EngineBlockHash::Int(5)],
            medium: Medium::Gpu,
            group_idx: None,
        })
    );
}

#[test]
fn malformed_event_is_an_error_entry_and_others_still_apply() {
    let bad = Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::from(3)),
    ]);
    let b = decode_batch(&batch(vec![stored_map(1), bad, stored_map(2)], None)).expect("decodes");
    assert_eq!(stored_keys(&b.events[0]), vec![BlockKey(1)]);
    assert_eq!(
        b.events[1],
        Err(EventError::Field {
            field: "block_hashes",
            problem: "missing or not an array"
        })
    );
    assert_eq!(stored_keys(&b.events[2]), vec![BlockKey(2)]);
}

#[test]
fn envelopes_of_two_and_three_elements_decode_with_their_rank() {
    let two = decode_batch(&batch(vec![stored_map(1)], None)).expect("2");
    let nil = decode_batch(&batch(vec![stored_map(1)], Some(Value::Nil))).expect("nil");
    let one = decode_batch(&batch(vec![stored_map(1)], Some(Value::from(1)))).expect("1");
    assert_eq!(
        (two.dp_rank, nil.dp_rank, one.dp_rank),
        (None, None, Some(1))
    );
}

#[test]
fn garbage_payloads_are_errors_never_panics() {
    let cases: Vec<Vec<u8>> = vec![
        vec![],
        vec![0xc1],
        vec![0x93, 0xcb],
        enc(&Value::from(3)),
        enc(&Value::Array(vec![Value::F64(1.0)])),
        enc(&Value::Array(vec![s("ts"), Value::Array(vec![])])),
        enc(&Value::Array(vec![Value::F64(1.0), Value::from(2)])),
        vec![0x91; 100_000],
    ];
    for c in cases {
        assert!(decode_batch(&c).is_err(), "{:?}", &c[..c.len().min(8)]);
    }
    let odd = batch(
        vec![
            Value::from(1),
            s("BlockStored"),
            Value::Array(vec![s("Nope")]),
        ],
        None,
    );
    let b = decode_batch(&odd).expect("envelope fine");
    assert!(b.events.iter().all(Result::is_err));
}

/// vLLM 0.32's hybrid and offload fields, in array (`array_like`) layout: `BlockStored`
/// `[.., medium (6), lora_name, extra_keys, group_idx (9), kv_cache_spec_kind,
/// kv_cache_spec_sliding_window, locality, ownership]`, `BlockRemoved` `[tag, hashes, medium,
/// group_idx]`; nil / absent medium is GPU.
#[test]
fn hybrid_and_offload_fields_decode_in_both_layouts() {
    let stored = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(3u64)]),
        Value::Nil,
        Value::Array(vec![]),
        Value::from(16),
        Value::Nil,
        s("CPU"),
        Value::Nil,
        Value::Nil,
        Value::from(1),
        s("sliding_window"),
        Value::from(4096),
        s("LOCAL"),
        s("OWNED"),
    ]);
    let removed = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::from(3u64)]),
        s("DISK"),
        Value::from(1),
    ]);
    let plain = Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), Value::Array(vec![Value::from(4u64)])),
    ]);
    let b = decode_batch(&batch(vec![stored, removed, plain], None)).expect("decodes");
    let Ok(KvEvent::BlockStored(st)) = &b.events[0] else {
        panic!("stored: {:?}", b.events[0])
    };
    assert_eq!(
        (
            &st.medium,
            st.group_idx,
            st.kv_cache_spec_kind.as_deref(),
            st.kv_cache_spec_sliding_window,
            st.locality.as_deref(),
            st.ownership.as_deref()
        ),
        (
            &Medium::Cpu,
            Some(1),
            Some("sliding_window"),
            Some(4096),
            Some("LOCAL"),
            Some("OWNED")
        )
    );
    assert_eq!(
        b.events[1],
        Ok(KvEvent::BlockRemoved {
            block_hashes: vec![EngineBlockHash::Int(3)],
            medium: Medium::Other("DISK".into()),
            group_idx: Some(1),
        })
    );
    assert_eq!(
        b.events[2],
        Ok(KvEvent::BlockRemoved {
            block_hashes: vec![EngineBlockHash::Int(4)],
            medium: Medium::Gpu,
            group_idx: None,
        })
    );
}

/// Every msgpack value of a tree, as `count_values` counts them.
fn nodes(v: &Value) -> u64 {
    1 + match v {
        Value::Array(a) => a.iter().map(nodes).sum(),
        Value::Map(m) => m.iter().map(|(k, v)| nodes(k) + nodes(v)).sum(),
        _ => 0,
    }
}

/// The pre-decode count agrees with the decoder's tree on every golden payload (every encoding
/// and both engines' captures): it passes with exactly as many values as the tree has and
/// fails with one fewer.
#[test]
fn the_value_count_matches_the_decoded_tree_on_every_golden_payload() {
    let mut payloads: Vec<Vec<u8>> = golden_json("vllm_kv_events_encoding.json")["batches"]
        .as_object()
        .expect("batches")
        .values()
        .map(|b| unhex(b["payload_hex"].as_str().expect("hex")))
        .collect();
    for file in ["vllm_kv_events_capture.json", "bos_kv_events_capture.json"] {
        for f in golden_json(file)["frames"].as_array().expect("frames") {
            payloads.push(unhex(f["parts_hex"][2].as_str().expect("hex")));
        }
    }
    for p in &payloads {
        let tree = rmpv::decode::read_value(&mut p.as_slice()).expect("msgpack");
        let n = nodes(&tree);
        assert!(n > 3);
        assert!(count_values(p, n).is_ok());
        assert!(matches!(
            count_values(p, n - 1),
            Err(EventError::TooManyValues)
        ));
        // Truncated anywhere: an error, never a panic.
        for cut in [1, p.len() / 2, p.len() - 1] {
            assert!(count_values(&p[..cut], u64::MAX).is_err(), "cut at {cut}");
        }
    }
}

/// A 16 MiB batch of nils (16.7 M events) decoded to gigabytes: it is refused before decoding.
#[test]
fn a_batch_of_millions_of_tiny_values_is_refused_before_decoding() {
    let n: u32 = (16 << 20) - 64;
    let mut p = vec![0x92, 0xcb];
    p.extend(1.0f64.to_be_bytes());
    p.push(0xdd);
    p.extend(n.to_be_bytes());
    p.resize(p.len() + n as usize, 0xc0);
    assert!(matches!(decode_batch(&p), Err(EventError::TooManyValues)));
    // Under the value bound, an events array past the event bound is refused before any event
    // is decoded (each slot costs a few hundred bytes, even a nil's).
    let n = u32::try_from(MAX_BATCH_EVENTS).expect("fits") + 1;
    let mut p = vec![0x92, 0xcb];
    p.extend(1.0f64.to_be_bytes());
    p.push(0xdd);
    p.extend(n.to_be_bytes());
    p.resize(p.len() + n as usize, 0xc0);
    assert!(matches!(
        decode_batch(&p),
        Err(EventError::TooManyEvents(k)) if k == n as usize
    ));
    p.truncate(p.len() - 1);
    p[11..15].copy_from_slice(&(n - 1).to_be_bytes());
    let ok = decode_batch(&p).expect("at the bound");
    assert_eq!(ok.events.len(), MAX_BATCH_EVENTS);
    // Nested arrays each under any per-array bound add up the same way.
    let mut nested = vec![0x92, 0x00, 0xdc, 0x01, 0x00];
    for _ in 0..256 {
        nested.extend([0xdd, 0x00, 0x00, 0x10, 0x00]);
        nested.resize(nested.len() + 0x1000, 0xc0);
    }
    assert_eq!(count_values(&nested, u64::MAX).map(|()| 0), Ok(0));
    assert_eq!(256 * 0x1000, MAX_BATCH_VALUES);
    assert!(matches!(
        decode_batch(&nested),
        Err(EventError::TooManyValues)
    ));
}
