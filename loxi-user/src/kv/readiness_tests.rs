use rmpv::Value as V;

use super::*;
use crate::kv::block_hash::{BlockHasher, HashAlgo};
use crate::kv::ingest::events::decode_batch;
use crate::kv::settings::KvSettings;
use crate::kv::testutil::{metric_value, msgpack, rule, state, stored_batch, vllm_stored_event};

/// Endpoint `m`'s readiness now, with its parity report (as the readiness pass reads it).
fn current(svc: &ServiceKv, eps: &[crate::rules::KvEndpoint], m: usize) -> Readiness {
    let p = svc.parity.lock().get(m).cloned();
    readiness(svc, &svc.members.read(), m, &eps[m], p.as_ref(), 20)
}

fn batch(ev: V) -> crate::kv::ingest::events::EventBatch {
    decode_batch(&msgpack(&V::Array(vec![
        V::F64(0.0),
        V::Array(vec![ev]),
        V::from(0),
    ])))
    .expect("decode")
}

/// A 32-token event from an engine hashing with `seed`.
fn engine_event(seed: Option<&str>) -> crate::kv::ingest::events::EventBatch {
    let toks: Vec<u32> = (100..132).collect();
    let keys: Vec<u64> = BlockHasher::new(HashAlgo::Sha256Cbor, seed)
        .keys(&toks, 16, &Default::default())
        .iter()
        .map(|k| k.0)
        .collect();
    batch(vllm_stored_event(
        &keys,
        &toks,
        16,
        None,
        vec![V::Nil, V::Nil],
    ))
}

/// Every endpoint gets a state: one that never published, one whose events carry no token
/// ids, one agreeing, one whose engine runs another seed (with the remedy naming the seed) and
/// one with another block size.
#[test]
fn every_endpoint_has_a_state_and_a_remedy() {
    let (st, _reg) = state(KvSettings::default());
    let r = rule(1, 5, serde_json::json!({}));
    let svc = st.service(&r).expect("kv rule");
    for m in 1..5 {
        svc.set_connected(m, 0, true);
    }
    svc.apply_batch(
        1,
        0,
        &decode_batch(&stored_batch(&[5, 6], 16)).expect("decode"),
        &st.metrics,
    );
    svc.streams.lock().entry((1, 0)).or_default().last_seq = Some(0);
    svc.apply_batch(2, 0, &engine_event(None), &st.metrics);
    svc.apply_batch(3, 0, &engine_event(Some("0")), &st.metrics);
    svc.apply_batch(
        4,
        0,
        &decode_batch(&stored_batch(&[7], 32)).expect("decode"),
        &st.metrics,
    );
    let eps = r.spec.kv.as_ref().expect("kv").endpoints.clone();
    let got: Vec<Readiness> = (0..5)
        .map(|m| {
            let p = svc.parity.lock().get(m).cloned();
            readiness(&svc, &svc.members.read(), m, &eps[m], p.as_ref(), 20)
        })
        .collect();
    let states: Vec<&str> = got.iter().map(|r| r.state).collect();
    assert_eq!(
        states,
        vec![
            "no_events",
            "events_no_tokens",
            "ok",
            "mismatch",
            "mismatch"
        ]
    );
    assert_eq!(got[3].leg.as_deref(), Some("seed"));
    assert_eq!(
        got[3].remedy.as_deref(),
        Some("set LLB_KV_NONE_HASH_SEED=0 to match the engine")
    );
    assert_eq!(got[4].leg.as_deref(), Some("block_size"));
    assert!(
        got[4]
            .remedy
            .as_deref()
            .is_some_and(|r| r.contains("kvBlockSize 32"))
    );
    assert!(
        got[0]
            .remedy
            .as_deref()
            .is_some_and(|r| r.contains("tcp://*:"))
    );
    assert_eq!(got[2].remedy, None);
    // A publisher claiming 0-token blocks gets no remedy the API would refuse (kvBlockSize 0).
    svc.apply_batch(
        0,
        0,
        &decode_batch(&stored_batch(&[9], 0)).expect("decode"),
        &st.metrics,
    );
    let p = svc.parity.lock().get(0).cloned();
    let zero = readiness(&svc, &svc.members.read(), 0, &eps[0], p.as_ref(), 20);
    assert_eq!(zero.leg.as_deref(), Some("block_size"));
    let remedy = zero.remedy.unwrap_or_default();
    assert!(
        remedy.contains("block_size 0") && !remedy.contains("set kvBlockSize"),
        "{remedy}"
    );
}

#[test]
fn remedies_name_the_setting_to_change() {
    assert_eq!(
        remedy_of(
            "algorithm: engine matches xxhash_cbor with seed \"42\"; rule uses sha256_cbor",
            false
        ),
        "set kvHashAlgo xxhash_cbor and LLB_KV_NONE_HASH_SEED=42 to match the engine"
    );
    assert_eq!(
        remedy_of(
            "seed: engine matches sha256_cbor with seed \"vllm-none-hash\"; rule uses sha256_cbor",
            true
        ),
        "unset LLB_KV_NONE_HASH_SEED to match the engine"
    );
    // Never "unset" a variable that is not set.
    assert_eq!(
        remedy_of(
            "algorithm: engine matches sha256_cbor with seed \"vllm-none-hash\"; rule uses xxhash_cbor with loxi's LLB_KV_NONE_HASH_SEED",
            false
        ),
        "set kvHashAlgo sha256_cbor and keep LLB_KV_NONE_HASH_SEED unset to match the engine"
    );
}

/// Connected to its publisher with no batch yet (a new rule over idle engines: the replay
/// answered nothing) is `no_blocks`; `no_events` and its "start the engine with a publisher"
/// remedy are for an endpoint whose publisher is not reached (before, both read `no_events`
/// with that remedy, so a wrong `kvZmqPort` looked like every idle engine).
#[test]
fn connected_with_no_batch_is_no_blocks_and_unreached_is_no_events() {
    let (st, _reg) = state(KvSettings::default());
    let r = rule(1, 2, serde_json::json!({}));
    let svc = st.service(&r).expect("kv rule");
    let eps = r.spec.kv.as_ref().expect("kv").endpoints.clone();
    let now = |m: usize| readiness(&svc, &svc.members.read(), m, &eps[m], None, 20);
    svc.set_connected(0, 0, true);
    let idle = now(0);
    assert_eq!(idle.state, "no_blocks", "{idle:?}");
    let unreached = now(1);
    assert_eq!(unreached.state, "no_events", "{unreached:?}");
    assert!(
        unreached
            .remedy
            .as_deref()
            .is_some_and(|r| r.contains("start the engine with a ZMQ publisher")),
        "{unreached:?}"
    );
    svc.set_connected(0, 0, false);
    assert_eq!(now(0).state, "no_events", "down again, nothing heard");
}

/// An engine that restarts (its parity report reset) or has stored nothing yet reads
/// `no_blocks`, not `events_no_tokens`: it is idle, its events do carry token ids. Its first
/// stored blocks with token ids make it `ok` again; blocks without them, `events_no_tokens`.
#[test]
fn an_idle_or_restarted_engine_reads_no_blocks_until_it_stores_one() {
    let (st, _reg) = state(KvSettings::default());
    let r = rule(1, 2, serde_json::json!({}));
    let svc = st.service(&r).expect("kv rule");
    let eps = r.spec.kv.as_ref().expect("kv").endpoints.clone();
    let now = |m: usize| current(&svc, &eps, m);
    svc.set_connected(0, 0, true);
    svc.set_connected(1, 0, true);
    svc.apply_batch(0, 0, &engine_event(None), &st.metrics);
    assert_eq!(now(0).state, "ok");
    // The subscriber's restart handling: blocks cleared, parity forgotten; the stream is live.
    svc.index.forget(0);
    svc.parity.lock().reset(0);
    svc.streams.lock().entry((0, 0)).or_default().last_seq = Some(0);
    let idle = now(0);
    assert_eq!(idle.state, "no_blocks");
    assert!(
        idle.remedy
            .as_deref()
            .is_some_and(|r| r.contains("holds no block of this engine: it is idle or just restarted, or it cached its blocks before loxi subscribed")),
        "{idle:?}"
    );
    svc.apply_batch(0, 0, &engine_event(None), &st.metrics);
    assert_eq!(now(0).state, "ok");
    // Endpoint 1: live but idle, then blocks without token ids.
    svc.streams.lock().entry((1, 0)).or_default().last_seq = Some(0);
    assert_eq!(now(1).state, "no_blocks");
    svc.apply_batch(
        1,
        0,
        &decode_batch(&stored_batch(&[5, 6], 16)).expect("decode"),
        &st.metrics,
    );
    assert_eq!(now(1).state, "events_no_tokens");
}

/// A vLLM `BlockStored` of the 32 tokens `from..from + 32` (two 16-token blocks, default seed)
/// and its first block key.
fn prompt_event(from: u32) -> (crate::kv::ingest::events::EventBatch, crate::kv::BlockKey) {
    let toks: Vec<u32> = (from..from + 32).collect();
    let keys = BlockHasher::new(HashAlgo::Sha256Cbor, None).keys(&toks, 16, &Default::default());
    let raw: Vec<u64> = keys.iter().map(|k| k.0).collect();
    (
        batch(vllm_stored_event(
            &raw,
            &toks,
            16,
            None,
            vec![V::Nil, V::Nil],
        )),
        keys[0],
    )
}

/// Swapped event streams: new prompts placed on endpoint 0 are published on endpoint 1's
/// stream and those placed on 1 on 0's. Parity reads `ok` for both (every hash is right); from
/// the third stray the readiness pass says `crossed` for both, the gauge follows and the remedy
/// names the other endpoint's port. Endpoint 2, whose placements land on its own stream,
/// stays `ok`.
#[test]
fn swapped_streams_read_crossed_with_both_ports_named() {
    let (st, reg) = state(KvSettings::default());
    let r = rule(1, 3, serde_json::json!({}));
    let svc = st.service(&r).expect("kv rule");
    let eps = r.spec.kv.as_ref().expect("kv").endpoints.clone();
    for m in 0..3 {
        svc.set_connected(m, 0, true);
    }
    let now = |m: usize| current(&svc, &eps, m);
    let gauge = |ep: usize, state: &str| {
        metric_value(
            &reg,
            &format!(
                "loxilb_kv_endpoint_readiness{{service=\"1\",ep_idx=\"{ep}\",state=\"{state}\"}}"
            ),
        )
    };
    let mut from = 1000;
    let mut place = |on: usize, published_by: usize| {
        let (ev, first) = prompt_event(from);
        from += 100;
        svc.cross
            .lock()
            .routed(on, first, true, tokio::time::Instant::now());
        svc.apply_batch(published_by, 0, &ev, &st.metrics);
    };
    for _ in 0..2 {
        place(0, 1);
        place(1, 0);
        place(2, 2);
    }
    publish(&st);
    assert_eq!(
        (now(0).state, now(1).state, now(2).state),
        ("ok", "ok", "ok")
    );
    place(0, 1);
    place(1, 0);
    place(2, 2);
    publish(&st);
    let zero = now(0);
    assert_eq!(zero.state, "crossed", "{zero:?}");
    assert_eq!(
        zero.remedy.as_deref(),
        Some(
            "the first blocks of 3 of its last 3 new prompts (sent to it alone) were published \
             on the event stream of endpoint 1 (127.0.0.2:8001, kvZmqPort 5557), none on its \
             own (kvZmqPort 5557): its engine publishes on that endpoint's port; check every \
             endpoint's kvZmqPort against the port its own engine publishes on (two swapped, \
             or a rotation); until then these blocks are not used for routing"
        )
    );
    let one = now(1);
    assert_eq!(one.state, "crossed");
    assert!(
        one.remedy
            .as_deref()
            .is_some_and(|r| r.contains("endpoint 0 (127.0.0.1:8000, kvZmqPort 5557)")),
        "{one:?}"
    );
    assert_eq!(now(2).state, "ok");
    assert_eq!(
        (
            gauge(0, "crossed"),
            gauge(1, "crossed"),
            gauge(2, "crossed"),
            gauge(2, "ok")
        ),
        (1.0, 1.0, 0.0, 1.0)
    );
    // Every resolved probe is counted once, under the endpoint it was placed on.
    let probes = |ep: usize, outcome: &str| {
        metric_value(
            &reg,
            &format!(
                "loxilb_kv_cross_probes_total{{service=\"1\",ep_idx=\"{ep}\",outcome=\"{outcome}\"}}"
            ),
        )
    };
    assert_eq!(
        [0, 1, 2].map(|ep| [
            probes(ep, "landed"),
            probes(ep, "strayed"),
            probes(ep, "unseen")
        ]),
        [[0.0, 3.0, 0.0], [0.0, 3.0, 0.0], [3.0, 0.0, 0.0]]
    );
    publish(&st);
    assert_eq!((probes(0, "strayed"), probes(2, "landed")), (3.0, 3.0));
}

/// An engine heard from whose event stream goes down (stopped engine or publisher) reads
/// `disconnected`, naming the socket and the blocks kept; it is `ok` again on reconnect. With
/// two DP ranks, the rank that is down is named by its port (`kvZmqPort` + rank).
#[test]
fn a_stream_down_after_events_reads_disconnected_with_its_socket() {
    let (st, _reg) = state(KvSettings::default());
    let r = rule(1, 2, serde_json::json!({"kvDpRankCount": 2}));
    let svc = st.service(&r).expect("kv rule");
    let eps = r.spec.kv.as_ref().expect("kv").endpoints.clone();
    let now = |m: usize| current(&svc, &eps, m);
    for rank in 0..2 {
        svc.set_connected(0, rank, true);
    }
    svc.apply_batch(0, 0, &engine_event(None), &st.metrics);
    assert_eq!(now(0).state, "ok");
    svc.set_connected(0, 1, false);
    let down = now(0);
    assert_eq!(down.state, "disconnected", "{down:?}");
    assert_eq!(
        down.remedy.as_deref(),
        Some(
            "its event stream tcp://127.0.0.1:5558 is down (engine or publisher stopped?): its 2 \
             blocks are as last published and new ones are not seen until it reconnects (a \
             restarted engine's are cleared at once on reconnect with a kvReplayPort, else at \
             its first event)"
        )
    );
    svc.set_connected(0, 0, false);
    let both = now(0);
    assert!(
        both.remedy.as_deref().is_some_and(|r| r
            .starts_with("its event stream tcp://127.0.0.1:5557, tcp://127.0.0.1:5558 is down")),
        "{both:?}"
    );
    for rank in 0..2 {
        svc.set_connected(0, rank, true);
    }
    assert_eq!(now(0).state, "ok");
    // Never heard from: down is `no_events`, not `disconnected`.
    svc.set_connected(1, 0, false);
    assert_eq!(now(1).state, "no_events");
}

/// An endpoint whose kvZmqPort is an engine's outside the rule: its stream carries blocks, but
/// the first blocks of the new prompts sent to it alone are published on no stream of the
/// rule within the window. From the third it reads `unseen`, and its blocks are suspect; an
/// endpoint whose stream carries nothing is not (its engine may publish nothing at all).
#[test]
fn placements_published_nowhere_read_unseen_when_the_stream_carries_blocks() {
    let (st, _reg) = state(KvSettings::default());
    let r = rule(1, 2, serde_json::json!({}));
    let svc = st.service(&r).expect("kv rule");
    let eps = r.spec.kv.as_ref().expect("kv").endpoints.clone();
    for m in 0..2 {
        svc.set_connected(m, 0, true);
    }
    let t0 = tokio::time::Instant::now();
    for from in [1000, 1100, 1200] {
        for m in 0..2 {
            svc.cross
                .lock()
                .routed(m, prompt_event(from + m as u32 * 1000).1, true, t0);
        }
    }
    // The outside engine's blocks on endpoint 0's stream, meanwhile.
    svc.apply_batch(0, 0, &prompt_event(5000).0, &st.metrics);
    svc.cross
        .lock()
        .resolve(&[0, 1], t0 + crate::kv::cross::PROBE_WINDOW);
    let zero = current(&svc, &eps, 0);
    assert_eq!(zero.state, "unseen", "{zero:?}");
    assert_eq!(
        zero.remedy.as_deref(),
        Some(
            "the first blocks of 3 of its last 3 new prompts (sent to it alone) were published \
             on no event stream of the rule within 30 s, while its stream (kvZmqPort 5557) \
             carries other blocks: either that port is another engine's, one outside the rule \
             (check it against the port its own engine publishes on), or its engine already \
             held those prompts before loxi saw them (engines publish a block once; e.g. after \
             a loxilb restart without kvReplayPort), which the first new prompt it stores \
             clears; until then its blocks are not used for routing"
        )
    );
    assert_eq!(current(&svc, &eps, 1).state, "no_blocks");
    assert_eq!(
        svc.cross.lock().suspects(|m| svc.index.blocks(m) > 0),
        vec![0]
    );
}
