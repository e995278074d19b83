//! KV index benches: event ingest (blocks applied per second on one core, raw index and through
//! msgpack decode + apply), scoring a 4,096-token request (256 blocks) over 16 endpoints with 1M
//! indexed blocks (p50/p99 printed from a seeded sweep), and memory per million indexed blocks
//! (counted by a tracking global allocator).
//!
//! Also the full tier-1.5 decision for a 4,249-token chat, cold and warm, with the CPU per stage.
//!
//! Run: `cargo bench -p loxi-user --bench kv_index`; `LOXI_BENCH_ONLY=decision` prints the
//! decision figures only, `LOXI_BENCH_ONLY=index` the index figures only (memory, scoring,
//! ingest).
#![allow(
    unsafe_code,
    reason = "a counting GlobalAlloc wrapper measures index memory"
)]
#![allow(
    missing_docs,
    reason = "criterion_group! generates an undocumented pub fn"
)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant as StdInstant;

use std::sync::Arc;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use loxi_user::kv::BlockKey;
use loxi_user::kv::index::KvIndex;
use loxi_user::kv::ingest::events::decode_batch;
use loxi_user::kv::metrics::KvMetrics;
use loxi_user::kv::route::select::KvRouter;
use loxi_user::kv::route::select::KvTicket;
use loxi_user::kv::settings::KvSettings;
use loxi_user::kv::state::KvState;
use loxi_user::kv::tokenizer::{TokenizerMetrics, TokenizerPool};
use loxi_user::request::{ApiKind, ChatMessage, Prompt, RequestMeta};
use loxi_user::routing::{Candidates, EndpointLoad, Excluded};
use loxi_user::rules::store::StoredRule;
use prometheus_client::registry::Registry;
use rmpv::Value as V;
use tokio::time::Instant;

/// Counts live heap bytes.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
/// Counts allocation calls (`alloc` and `realloc`), for allocations per decision.
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// Forwards to the system allocator and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new, Ordering::Relaxed);
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// splitmix64: seeded, uniform keys like digest tails.
fn key(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn keys(from: u64, n: u64) -> Vec<BlockKey> {
    (from..from + n).map(|i| BlockKey(key(i))).collect()
}

/// 16 endpoints × 62,500 blocks = 1M; endpoint 3 also holds the request's first 200 blocks.
fn fleet() -> (KvIndex, Vec<BlockKey>) {
    let ix = KvIndex::new(10_000_000);
    for ep in 0..16u64 {
        for chunk in 0..(62_500 / 250) {
            ix.store(ep as usize, 0, &keys(ep * 1_000_000 + chunk * 250, 250));
        }
    }
    let request = keys(50_000_000, 256);
    ix.store(3, 0, &request[..200]);
    (ix, request)
}

fn memory_report() {
    for n in [1_000_000u64, 4_000_000] {
        let before = LIVE.load(Ordering::Relaxed);
        let ix = KvIndex::new(100_000_000);
        for c in 0..n / 1000 {
            ix.store(0, 0, &keys(c * 1000, 1000));
        }
        let bytes = LIVE.load(Ordering::Relaxed) - before;
        println!(
            "memory: {n} blocks on one endpoint: {:.1} MB live heap = {:.1} MB per million blocks ({:.1} B/block)",
            bytes as f64 / 1e6,
            bytes as f64 / 1e6 * 1e6 / n as f64,
            bytes as f64 / n as f64
        );
        drop(ix);
    }
    let before = LIVE.load(Ordering::Relaxed);
    let (ix, _) = fleet();
    let bytes = LIVE.load(Ordering::Relaxed) - before;
    println!(
        "memory: 1M blocks over 16 endpoints: {:.1} MB live heap",
        bytes as f64 / 1e6
    );
    drop(ix);
}

fn percentile_report() {
    let (ix, request) = fleet();
    let mut samples: Vec<u128> = (0..20_000)
        .map(|_| {
            let t = StdInstant::now();
            black_box(ix.score(black_box(&request), Instant::now()));
            t.elapsed().as_nanos()
        })
        .collect();
    samples.sort_unstable();
    let p = |q: f64| samples[((samples.len() as f64 - 1.0) * q) as usize] as f64 / 1000.0;
    println!(
        "score 256-block request, 16 endpoints, 1M blocks: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
        p(0.5),
        p(0.99),
        p(1.0)
    );
}

/// CPU seconds this thread has used (`/proc/thread-self/stat` utime + stime, 10 ms ticks): the
/// machine is shared, so throughput per CPU-second is the "one core" figure.
fn thread_cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    let after_comm = stat.rsplit(')').next().unwrap_or_default();
    let f: Vec<f64> = after_comm
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // Fields after ")" start at field 3 (state); utime is field 14, stime 15.
    (f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0)) / 100.0
}

/// Ingest throughput per CPU-second, raw index and decode + apply, 4M blocks each.
fn ingest_report() {
    let ix = KvIndex::new(1_000_000);
    let batches: Vec<Vec<BlockKey>> = (0..62_500u64).map(|i| keys(i * 64, 64)).collect();
    let (cpu0, wall) = (thread_cpu_secs(), StdInstant::now());
    for b in &batches {
        black_box(ix.store(0, 0, b));
    }
    let (cpu, wall) = (thread_cpu_secs() - cpu0, wall.elapsed().as_secs_f64());
    println!(
        "ingest index.store: 4M blocks (1M cap, 3M evictions): {:.2} M blocks/CPU-s ({:.2} M/s wall)",
        4.0 / cpu,
        4.0 / wall
    );
    drop(ix);
    let state = KvState::new(
        KvSettings::default(),
        KvMetrics::register(&mut Registry::default()),
    );
    let svc = state.service(&bench_rule()).expect("kv rule");
    let payloads: Vec<Vec<u8>> = (0..31_250u64).map(|i| stored_payload(i * 64, 64)).collect();
    let (cpu0, wall) = (thread_cpu_secs(), StdInstant::now());
    for p in &payloads {
        let batch = decode_batch(p).expect("decode");
        black_box(svc.apply_batch(0, 0, &batch, &state.metrics));
    }
    let (cpu, wall) = (thread_cpu_secs() - cpu0, wall.elapsed().as_secs_f64());
    println!(
        "ingest decode+apply: 2M blocks in 64-block events: {:.2} M blocks/CPU-s ({:.2} M/s wall)",
        2.0 / cpu,
        2.0 / wall
    );
}

fn shared_dir() -> std::path::PathBuf {
    std::env::var_os("LOXI_SHARED")
        .map(Into::into)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared")
        })
}

/// A chat request of at least 4,096 tokens on the golden `tiny` model (ChatML template).
fn long_chat(pool: &TokenizerPool) -> (RequestMeta, Arc<[u32]>) {
    let mut msgs = vec![ChatMessage {
        role: "system".into(),
        content: "You are a careful assistant for the logistics team.".into(),
    }];
    for turn in 0u32.. {
        let text = format!(
            "Turn {turn}: the pallet {} moved from aisle {} to dock {} after inspection {}. ",
            turn * 13,
            turn % 7,
            turn % 5,
            turn * 3
        );
        msgs.push(ChatMessage {
            role: if turn % 2 == 0 { "user" } else { "assistant" }.into(),
            content: text.repeat(4),
        });
        let meta = RequestMeta {
            api: ApiKind::ChatCompletions,
            model: Some("tiny".into()),
            prompt: Some(Prompt::Messages(msgs.clone())),
            ..Default::default()
        };
        let ids = pool
            .encode(
                "tiny",
                meta.api,
                meta.prompt.as_ref().expect("prompt"),
                None,
            )
            .expect("tokenize");
        if ids.len() >= 4096 && turn % 2 == 0 {
            return (meta, ids);
        }
    }
    unreachable!("the loop returns")
}

/// `meta` with every message's content prefixed by a tag naming `v`.
fn tagged(meta: &RequestMeta, v: usize) -> RequestMeta {
    let Some(Prompt::Messages(msgs)) = &meta.prompt else {
        unreachable!("long_chat builds a message list")
    };
    let msgs = msgs
        .iter()
        .map(|m| ChatMessage {
            role: m.role.clone(),
            content: format!("[v{v}] {}", m.content),
        })
        .collect();
    RequestMeta {
        prompt: Some(Prompt::Messages(msgs)),
        ..meta.clone()
    }
}

/// CPU nanoseconds this thread has used (`CLOCK_THREAD_CPUTIME_ID`): on a shared machine the
/// per-decision CPU is the comparable figure, wall time includes waiting for a core.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn percentiles(mut ns: Vec<u128>) -> (f64, f64) {
    ns.sort_unstable();
    let p = |q: f64| ns[((ns.len() as f64 - 1.0) * q) as usize] as f64 / 1000.0;
    (p(0.5), p(0.99))
}

/// Full tier-1.5 decision for a ≥4,096-token chat: template + tokenize + hash + score over 16
/// endpoints holding 1M blocks; tokenization cache off (cold), cache on with every prompt new
/// (cold, as production sees a new conversation), and cache on with one repeated prompt
/// (warm). Wall and thread-CPU percentiles, and for the cold cases the CPU per stage.
fn decision_report() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dst = tmp.path().join("tiny");
    std::fs::create_dir_all(&dst).expect("mkdir");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(shared_dir().join("golden/tiny-model").join(f), dst.join(f))
            .expect("stage tokenizer");
    }
    let rule = StoredRule::new(
        1,
        serde_json::from_value(serde_json::json!({
            "serviceArguments": {"externalIP": "10.0.0.1", "port": 8080, "mode": 4, "kvExactMode": 3, "kvBlockSize": 16},
            "endpoints": (0..16).map(|i| serde_json::json!({"endpointIP": format!("10.1.0.{}", i + 1), "targetPort": 8000})).collect::<Vec<_>>()
        }))
        .expect("rule"),
    )
    .expect("valid rule");
    let loads: Vec<Arc<EndpointLoad>> = (0..16).map(|_| EndpointLoad::new()).collect();
    let weights = vec![1u32; 16];
    let excluded = Excluded::default();
    let cands = Candidates {
        weights: &weights,
        loads: &loads,
        excluded: &excluded,
    };
    for (label, cache, distinct) in [
        ("cold (tokenization cache off)", 0usize, false),
        ("cold (cache on, every prompt new)", 1024, true),
        ("warm (tokenization cache on)", 1024, false),
    ] {
        let mut reg = Registry::default();
        let pool = Arc::new(
            TokenizerPool::new(
                tmp.path().to_path_buf(),
                TokenizerMetrics::register(&mut reg),
            )
            .with_cache_capacity(cache),
        );
        let (meta, ids) = long_chat(&pool);
        let state = KvState::new(
            KvSettings {
                coldstart_seed_n: 0,
                ..KvSettings::default()
            },
            KvMetrics::register(&mut reg),
        );
        let svc = state.service(&rule).expect("kv rule");
        for ep in 0..16u64 {
            for chunk in 0..(62_500 / 250) {
                svc.index
                    .store(ep as usize, 0, &keys(ep * 1_000_000 + chunk * 250, 250));
            }
        }
        let hasher = svc.hasher.clone();
        let own = hasher.keys(&ids, 16, &Default::default());
        svc.index.store(5, 0, &own[..200.min(own.len())]);
        let router = KvRouter::new(state.clone(), pool.clone());
        let d = router
            .select(&rule, &meta, &cands, &mut KvTicket::default())
            .expect("hit");
        assert_eq!(d.endpoint, Some(5));
        let n = if cache == 0 || distinct { 200 } else { 2000 };
        // Distinct prompts: every message tagged with the call number, so no full-text,
        // message-list or chunk cache entry can answer (each ~512-byte chunk holds a tag).
        let metas: Vec<RequestMeta> = if distinct {
            (0..n).map(|v| tagged(&meta, v)).collect()
        } else {
            vec![meta.clone()]
        };
        let (wall, cpu): (Vec<u128>, Vec<u128>) = (0..n)
            .map(|i| {
                let m = &metas[i % metas.len()];
                let (t, c) = (StdInstant::now(), thread_cpu_ns());
                // A fresh memo per call: every decision tokenizes and hashes, as a request does.
                black_box(router.select(&rule, m, &cands, &mut KvTicket::default()));
                (t.elapsed().as_nanos(), u128::from(thread_cpu_ns() - c))
            })
            .unzip();
        let ((p50, p99), (c50, c99)) = (percentiles(wall), percentiles(cpu));
        println!(
            "decision {} tokens chat, 16 eps, 1M blocks, {label}: wall p50 {p50:.1} µs, p99 {p99:.1} µs; thread CPU p50 {c50:.1} µs, p99 {c99:.1} µs",
            ids.len()
        );
        if cache == 0 || distinct {
            // Where a cold decision's CPU goes: template + tokenize, block hashing, scoring.
            let cpu_of = |f: &mut dyn FnMut(usize)| {
                let ns: Vec<u128> = (0..n)
                    .map(|i| {
                        let c = thread_cpu_ns();
                        f(i);
                        u128::from(thread_cpu_ns() - c)
                    })
                    .collect();
                percentiles(ns).0
            };
            // Prompts the caches have not seen (the decisions above filled them).
            let fresh: Vec<RequestMeta> = (0..n)
                .map(|v| {
                    if distinct {
                        tagged(&meta, n + v)
                    } else {
                        meta.clone()
                    }
                })
                .collect();
            let msgs: Vec<Vec<ChatMessage>> = fresh
                .iter()
                .map(|m| match &m.prompt {
                    Some(Prompt::Messages(m)) => m.clone(),
                    _ => unreachable!("long_chat builds a message list"),
                })
                .collect();
            let tok = pool.get("tiny").expect("tokenizer");
            let template = cpu_of(&mut |i| {
                black_box(tok.render("tiny", &msgs[i]).expect("render"));
            });
            let tokenize = cpu_of(&mut |i| {
                let m = &fresh[i];
                let p = m.prompt.as_ref().expect("prompt");
                black_box(pool.encode("tiny", m.api, p, None).expect("tokenize"));
            });
            let hash = cpu_of(&mut |_| {
                black_box(hasher.keys(&ids, 16, &Default::default()));
            });
            let mut scratch = Default::default();
            let score = cpu_of(&mut |_| {
                black_box(svc.index.score_with(&own, Instant::now(), &mut scratch));
            });
            if distinct {
                // The tokenizer's whole-text `encode_fast` (the cache-off path) against the
                // segment path on a prompt it has not seen (every chunk a miss: the cold path
                // with the cache on), interleaved call by call so both see the same load.
                // Tags no call above used, so no chunk is cached yet.
                let texts: Vec<String> = (0..n)
                    .map(|v| match tagged(&meta, 2 * n + v).prompt {
                        Some(Prompt::Messages(m)) => tok.render("tiny", &m).expect("render"),
                        _ => unreachable!("long_chat builds a message list"),
                    })
                    .collect();
                let (mut whole, mut seg) = (Vec::new(), Vec::new());
                // Alternating which goes first: the second benefits from the BPE model's
                // word cache the first filled.
                for (i, text) in texts.iter().enumerate() {
                    let mut run_whole = || {
                        let c = thread_cpu_ns();
                        black_box(tok.encode_whole(text, false).expect("whole"));
                        whole.push(u128::from(thread_cpu_ns() - c));
                    };
                    let mut run_seg = || {
                        let c = thread_cpu_ns();
                        black_box(tok.encode_by_segments(text, false).expect("exact")).expect("ok");
                        seg.push(u128::from(thread_cpu_ns() - c));
                    };
                    if i % 2 == 0 {
                        run_whole();
                        run_seg();
                    } else {
                        run_seg();
                        run_whole();
                    }
                }
                let ((w50, w99), (s50, s99)) = (percentiles(whole), percentiles(seg));
                println!(
                    "  encode a new {}-byte prompt, thread CPU: HF encode_fast (whole text) p50 {w50:.1} µs p99 {w99:.1} µs; segments (all misses) p50 {s50:.1} µs p99 {s99:.1} µs",
                    texts[0].len()
                );
            }
            println!(
                "  stages, thread CPU p50: template {template:.1} µs, template + tokenize {tokenize:.1} µs, hash {} blocks {hash:.1} µs, score {score:.1} µs",
                own.len()
            );
        }
        if cache > 0 && !distinct {
            let ids_meta = RequestMeta {
                prompt: Some(Prompt::TokenIds(ids.to_vec())),
                api: ApiKind::Completions,
                ..meta.clone()
            };
            for (what, m) in [("chat, warm cache", &meta), ("token-id prompt", &ids_meta)] {
                let per = allocs_per_decision(&router, &rule, m, &cands);
                println!("allocations per decision (select + routed), {what}: {per:.1}");
            }
        }
    }
}

/// Heap allocations of one request's tier-1.5 work: `select` with a fresh ticket, then
/// `routed` to the chosen endpoint (averaged over 1,000 requests after a warm-up).
fn allocs_per_decision(
    router: &KvRouter,
    rule: &StoredRule,
    meta: &RequestMeta,
    cands: &Candidates<'_>,
) -> f64 {
    let one = || {
        let mut ticket = KvTicket::default();
        let d = router.select(rule, meta, cands, &mut ticket);
        router.routed(
            rule,
            meta,
            d.and_then(|d| d.endpoint).unwrap_or(0),
            &mut ticket,
        );
    };
    for _ in 0..10 {
        one();
    }
    let before = ALLOCS.load(Ordering::Relaxed);
    for _ in 0..1000 {
        one();
    }
    (ALLOCS.load(Ordering::Relaxed) - before) as f64 / 1000.0
}

fn stored_payload(from: u64, n: u64) -> Vec<u8> {
    let ev = V::Map(vec![
        (V::from("type"), V::from("BlockStored")),
        (
            V::from("block_hashes"),
            V::Array((from..from + n).map(|i| V::from(key(i))).collect()),
        ),
        (V::from("parent_block_hash"), V::Nil),
        (V::from("token_ids"), V::Array(vec![])),
        (V::from("block_size"), V::from(16)),
        (V::from("lora_id"), V::Nil),
        (V::from("medium"), V::from("GPU")),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &V::Array(vec![V::F64(0.0), V::Array(vec![ev]), V::from(0)]),
    )
    .expect("encode");
    out
}

fn bench_rule() -> StoredRule {
    let rule = serde_json::from_value(serde_json::json!({
        "serviceArguments": {"externalIP": "10.0.0.1", "port": 8080, "mode": 4, "kvExactMode": 3},
        "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": 8000}]
    }))
    .expect("rule");
    StoredRule::new(1, rule).expect("valid rule")
}

fn benches(c: &mut Criterion) {
    // `LOXI_BENCH_ONLY=decision`: the decision figures alone (for profiling them).
    if std::env::var("LOXI_BENCH_ONLY").as_deref() == Ok("decision") {
        decision_report();
        return;
    }
    // `LOXI_BENCH_ONLY=index`: the index figures alone (memory, scoring, ingest).
    if std::env::var("LOXI_BENCH_ONLY").as_deref() == Ok("index") {
        memory_report();
        percentile_report();
        ingest_report();
        return;
    }
    memory_report();
    percentile_report();
    ingest_report();
    decision_report();

    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(64));
    let ix = KvIndex::new(1_000_000);
    let mut next = 0u64;
    g.bench_function("index_store_64_blocks_at_1M_cap", |b| {
        b.iter(|| {
            next += 64;
            black_box(ix.store(0, 0, &keys(next, 64)))
        })
    });
    let state = KvState::new(
        KvSettings::default(),
        KvMetrics::register(&mut Registry::default()),
    );
    let svc = state.service(&bench_rule()).expect("kv rule");
    let mut n2 = 0u64;
    g.bench_function("decode_and_apply_batch_64_blocks", |b| {
        b.iter_batched(
            || {
                n2 += 64;
                stored_payload(n2, 64)
            },
            |payload| {
                let batch = decode_batch(&payload).expect("decode");
                black_box(svc.apply_batch(0, 0, &batch, &state.metrics))
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();

    let (ix, request) = fleet();
    let mut g = c.benchmark_group("score");
    g.bench_function("request_256_blocks_16_eps_1M_blocks", |b| {
        b.iter(|| black_box(ix.score(black_box(&request), Instant::now())))
    });
    g.finish();
}

criterion_group!(kv_index, benches);
criterion_main!(kv_index);
