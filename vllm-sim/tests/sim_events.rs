//! `vllm-sim` KV events against the live capture from a real vLLM 0.32 engine
//! (`../shared/golden/vllm_kv_events_capture.json`): the same 17 requests as sent (text,
//! token ids, chat), the same model tokenizer and engine shape (block size 32, 40 GPU blocks,
//! sha256_cbor, PYTHONHASHSEED=0), the same frames: prompt blocks byte-for-byte, blocks
//! completed by generated tokens (the emulator's filler differs from the model's output) by
//! structure and a consistent hash mapping, so eviction order is checked exactly too.

#![allow(clippy::unwrap_used)]

mod sim_common;

use std::collections::HashMap;

use rmpv::Value as Mp;
use serde_json::{Value, json};
use sim_common::{EVENTS_CFG, Frames, PySub, Sim, decode, golden_capture, hex, replay};

/// A tokenizer directory holding the golden tiny model as `tiny/`.
fn tokenizer_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let model = sim_common::shared_dir()
        .join("golden/tiny-model")
        .canonicalize()
        .unwrap();
    std::os::unix::fs::symlink(model, dir.path().join("tiny")).unwrap();
    dir
}

fn golden_sim(tok: &tempfile::TempDir) -> Sim {
    Sim::start(
        &[
            "--model",
            "tiny",
            "--tokenizer-dir",
            tok.path().to_str().unwrap(),
            "--block-size",
            "32",
            "--num-gpu-blocks",
            "40",
            "--prefix-caching-hash-algo",
            "sha256_cbor",
            "--time-scale",
            "0.001",
            "--kv-events-config",
            EVENTS_CFG,
        ],
        &[("PYTHONHASHSEED", "0")],
    )
}

/// Sends the capture's requests in order, as they were sent to vLLM, and checks that the
/// emulator tokenized each prompt to the ids vLLM reported.
async fn replay_golden_requests(sim: &Sim, golden: &Value) {
    for r in golden["requests"].as_array().unwrap() {
        if r["kind"] == "reset_prefix_cache" {
            let (status, _) = sim.post("/reset_prefix_cache", &json!({})).await;
            assert_eq!(status, 200);
            continue;
        }
        let path = r["endpoint"].as_str().unwrap();
        let (status, resp) = sim.post(path, &r["request_body"]).await;
        assert_eq!(status, 200, "{resp}");
        let want = r["prompt_token_ids_from_vllm"].as_array().unwrap().len();
        assert_eq!(
            resp["usage"]["prompt_tokens"],
            json!(want),
            "{}: prompt tokens",
            r["kind"]
        );
    }
}

fn golden_frames(golden: &Value) -> Vec<Frames> {
    golden["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            f["parts_hex"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| hex(p.as_str().unwrap()))
                .collect()
        })
        .collect()
}

/// A consistent one-to-one map between the capture's hashes and the emulator's.
#[derive(Default)]
struct HashMatch {
    fwd: HashMap<u64, u64>,
    back: HashMap<u64, u64>,
}

impl HashMatch {
    fn link(&mut self, golden: &Mp, ours: &Mp, exact: bool, at: &str) {
        match (golden, ours) {
            (Mp::Nil, Mp::Nil) => {}
            (Mp::Integer(g), Mp::Integer(o)) => {
                let (g, o) = (g.as_u64().unwrap(), o.as_u64().unwrap());
                if exact {
                    assert_eq!(o, g, "{at}: block hash");
                }
                assert_eq!(
                    *self.fwd.entry(g).or_insert(o),
                    o,
                    "{at}: golden hash {g} maps to two of ours"
                );
                assert_eq!(
                    *self.back.entry(o).or_insert(g),
                    g,
                    "{at}: our hash {o} maps to two golden"
                );
            }
            _ => panic!("{at}: hash kinds differ: {golden:?} vs {ours:?}"),
        }
    }
}

fn kind(v: &Mp) -> &'static str {
    match v {
        Mp::Nil => "nil",
        Mp::Boolean(_) => "bool",
        Mp::Integer(_) => "int",
        Mp::F32(_) => "f32",
        Mp::F64(_) => "f64",
        Mp::String(_) => "str",
        Mp::Binary(_) => "bin",
        Mp::Array(_) => "array",
        Mp::Map(_) => "map",
        Mp::Ext(..) => "ext",
    }
}

fn map_entries(v: &Mp) -> &Vec<(Mp, Mp)> {
    match v {
        Mp::Map(m) => m,
        other => panic!("event is not a map: {other:?}"),
    }
}

fn field<'a>(ev: &'a [(Mp, Mp)], key: &str) -> &'a Mp {
    &ev.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .unwrap_or_else(|| panic!("no {key}"))
        .1
}

/// Compares one event: key order, value kinds, counts, tokens, extra keys, hash links.
fn compare_event(g: &Mp, o: &Mp, compare_tokens: bool, hm: &mut HashMatch, at: &str) {
    let (ge, oe) = (map_entries(g), map_entries(o));
    let gk: Vec<_> = ge
        .iter()
        .map(|(k, v)| (k.as_str().unwrap().to_string(), kind(v)))
        .collect();
    let ok: Vec<_> = oe
        .iter()
        .map(|(k, v)| (k.as_str().unwrap().to_string(), kind(v)))
        .collect();
    assert_eq!(ok, gk, "{at}: field names, order and types");
    let stored = field(ge, "type").as_str() == Some("BlockStored");
    for (k, gv) in ge {
        let key = k.as_str().unwrap();
        let ov = field(oe, key);
        match key {
            "block_hashes" => {
                let (ga, oa) = (gv.as_array().unwrap(), ov.as_array().unwrap());
                assert_eq!(oa.len(), ga.len(), "{at}: block count");
                ga.iter()
                    .zip(oa)
                    .for_each(|(a, b)| hm.link(a, b, compare_tokens && stored, at));
            }
            "parent_block_hash" => hm.link(gv, ov, false, at),
            "token_ids" if !compare_tokens => {
                assert_eq!(
                    ov.as_array().unwrap().len(),
                    gv.as_array().unwrap().len(),
                    "{at}: tokens"
                );
            }
            _ => assert_eq!(ov, gv, "{at}: field {key}"),
        }
    }
}

/// Compares frame lists; returns how many payloads were byte-identical after the timestamp.
fn compare_frames(golden: &[Frames], ours: &[Frames], generated: &[usize]) -> usize {
    assert_eq!(ours.len(), golden.len(), "frame count");
    let mut hm = HashMatch::default();
    let mut identical = 0;
    for (i, (g, o)) in golden.iter().zip(ours).enumerate() {
        assert_eq!(o.len(), 3, "frame {i}: [topic, seq, payload]");
        assert_eq!(o[0], g[0], "frame {i}: topic");
        assert_eq!(o[1], g[1], "frame {i}: seq");
        assert_eq!(
            o[2][..2],
            g[2][..2],
            "frame {i}: batch header and float64 timestamp marker"
        );
        let (gb, ob) = (decode(&g[2]), decode(&o[2]));
        let (ga, oa) = (gb.as_array().unwrap(), ob.as_array().unwrap());
        assert_eq!(oa[2], ga[2], "frame {i}: dp rank");
        let (gev, oev) = (ga[1].as_array().unwrap(), oa[1].as_array().unwrap());
        assert_eq!(oev.len(), gev.len(), "frame {i}: event count");
        for (j, (ge, oe)) in gev.iter().zip(oev).enumerate() {
            compare_event(
                ge,
                oe,
                !generated.contains(&i),
                &mut hm,
                &format!("frame {i} event {j}"),
            );
        }
        if gev == oev {
            assert_eq!(
                o[2][10..],
                g[2][10..],
                "frame {i}: payload bytes after the timestamp"
            );
            identical += 1;
        }
    }
    identical
}

/// Frames holding blocks completed by generated tokens (every frame of a request after its
/// prefill frame): the emulator's filler ids differ from the model's output there.
fn generated_frames(golden: &Value) -> Vec<usize> {
    let mut out = Vec::new();
    for r in golden["requests"].as_array().unwrap() {
        let range = r["frames_index_range"].as_array().unwrap();
        let (a, b) = (
            range[0].as_u64().unwrap() as usize,
            range[1].as_u64().unwrap() as usize,
        );
        out.extend(a + 1..b);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_for_the_captured_requests_have_the_golden_frames() {
    let golden = golden_capture();
    let tok = tokenizer_dir();
    let sim = golden_sim(&tok);
    let sub = PySub::connect(sim.publisher.as_deref().unwrap(), 3.0);
    replay_golden_requests(&sim, &golden).await;
    let ours = tokio::task::spawn_blocking(move || sub.collect())
        .await
        .unwrap();
    let gframes = golden_frames(&golden);
    let identical = compare_frames(&gframes, &ours, &generated_frames(&golden));
    // 18 frames - 4 holding generated-token blocks (7, 8, 10, 12) - 2 removing such blocks
    // (13, 14): every other frame equals vLLM's bytes after the timestamp.
    assert_eq!(identical, 12, "byte-identical frames");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_returns_every_buffered_batch_then_the_end_marker() {
    let golden = golden_capture();
    let tok = tokenizer_dir();
    let sim = golden_sim(&tok);
    replay_golden_requests(&sim, &golden).await;
    let ep = sim.replay.clone().unwrap();
    let replies = tokio::task::spawn_blocking(move || replay(&ep, 0))
        .await
        .unwrap();
    let greplies: Vec<Frames> = golden["replay"]["replies_hex"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|p| hex(p.as_str().unwrap()))
                .collect()
        })
        .collect();
    assert_eq!(
        replies.len(),
        greplies.len(),
        "one reply per batch + end marker"
    );
    let end = replies.last().unwrap();
    assert_eq!(
        end,
        &vec![vec![], vec![], vec![0xff; 8], vec![]],
        "end marker"
    );
    let strip = |rs: &[Frames]| -> Vec<Frames> {
        rs[..rs.len() - 1].iter().map(|r| r[1..].to_vec()).collect()
    };
    for r in &replies[..replies.len() - 1] {
        assert!(r[0].is_empty(), "delimiter frame first");
    }
    compare_frames(
        &strip(&greplies),
        &strip(&replies),
        &generated_frames(&golden),
    );

    let ep = sim.replay.clone().unwrap();
    let tail = tokio::task::spawn_blocking(move || replay(&ep, 16))
        .await
        .unwrap();
    let seqs: Vec<Vec<u8>> = tail.iter().map(|r| r[2].clone()).collect();
    assert_eq!(
        seqs,
        vec![
            16u64.to_be_bytes().to_vec(),
            17u64.to_be_bytes().to_vec(),
            vec![0xff; 8]
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_returns_the_ids_vllm_reported() {
    let golden = golden_capture();
    let tok = tokenizer_dir();
    let sim = golden_sim(&tok);
    let mut checked = 0;
    for r in golden["requests"].as_array().unwrap() {
        let body = &r["request_body"];
        let req = if body.get("messages").is_some() {
            json!({"model": "tiny", "messages": body["messages"]})
        } else if body["prompt"].is_string() {
            json!({"model": "tiny", "prompt": body["prompt"]})
        } else {
            continue;
        };
        let (status, resp) = sim.post("/tokenize", &req).await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(
            resp["tokens"], r["prompt_token_ids_from_vllm"],
            "{}",
            r["kind"]
        );
        checked += 1;
    }
    assert!(checked >= 10, "text and chat requests checked: {checked}");
}
