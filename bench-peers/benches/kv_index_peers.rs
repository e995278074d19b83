//! loxi's KV index vs `smg-radix-tree` 0.1.0 and `dynamo-kv-router` 1.6.1 (issue 17 §1), on the
//! same event streams in one run:
//!
//! - `mooncake/8`, `mooncake/64`: the block chains of `$LOXI_SHARED/traces/mooncake-synthetic.jsonl`
//!   (`hash_ids` → chained block keys), each request placed on worker `hash(first block) % N`;
//! - `fleet/64`: a synthetic fleet with heavy replication: 32 system prompts of 128 blocks,
//!   2,000 conversations of 32 blocks on top, each request adds 16 new blocks and lands on a
//!   random worker of 64, so every shared prefix ends up on most workers.
//!
//! A driver models each worker's cache: a request stores the part of its chain the worker does
//! not hold (one store event, parent = the last held block), and over the per-worker cap the
//! least recently used blocks are evicted leaf-first (one remove event per request), so every
//! holder's blocks stay prefix-closed (smg refuses a store whose parent is not held). Every
//! index gets exactly this stream.
//!
//! Printed per index: bytes per worker-block (counting allocator, live heap of the built index
//! ÷ blocks held at the end), query p50/p99 (longest prefix per worker for each trace request,
//! on the final state), replay rate (stores + evictions, block-ops/s) and drain rate (remove
//! every held block in 64-block events) single-threaded, and the replay rate with one
//! concurrent reader querying in a loop (and that reader's queries/s); then loxi's ratio to each.
//!
//! How each index is driven: loxi `KvIndex::{store, remove, score_with}` (rank 0, internal cap
//! off); smg `RadixTree::{store, remove, overlap}` directly single-threaded and behind a
//! `parking_lot::RwLock` with a reader (it is `&mut self` for writes; the write lock is taken
//! per event); in the reader phase loxi's and dynamo's indexes sit behind a read-locked
//! `RwLock` too, only so that a fresh index can be swapped in between repetitions; dynamo
//! `ConcurrentRadixTreeCompressed` as its `ThreadPoolIndexer` runs it: events through a flume
//! channel into `SyncIndexer::worker` on one thread, queries by `find_matches` on the caller's
//! thread. Dynamo's rates include the channel hop (its production path).
//!
//! Run: `cd bench-peers && cargo bench` (about 10 s once built, ~30 s with `KV_PEERS_SCALE=4`;
//! target dir `../target/peers`).
//! `KV_PEERS_SCALE=k` replays the trace k times with distinct salts (k× blocks and cap) and
//! grows the fleet k×.
#![allow(
    unsafe_code,
    reason = "a counting global allocator needs `unsafe impl GlobalAlloc`"
)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant as StdInstant;

use dynamo_kv_router::indexer::SyncIndexer;
use dynamo_kv_router::indexer::WorkerTask;
use dynamo_kv_router::indexer::concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use kv_index_peers::kv::BlockKey;
use kv_index_peers::kv::index::{KvIndex, ScoreScratch};
use parking_lot::RwLock;
use radix_tree::{Config, HolderId, Overlap, OverlapScratch, RadixTree};

/// Counts live heap bytes.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// Forwards to the system allocator and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
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
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// CPU seconds of `clock` (`CLOCK_PROCESS_CPUTIME_ID` or `CLOCK_THREAD_CPUTIME_ID`): the
/// machine is shared, so rates are per CPU-second, not per wall second.
fn cpu(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer for the duration of the call.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

fn process_cpu() -> f64 {
    cpu(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn thread_cpu() -> f64 {
    cpu(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// Per-query latency: each query timed `REPEAT` times, the fastest kept (drops preemption by
/// the other tenants of a shared machine), then percentiles over the queries.
const REPEAT: usize = 3;

fn time_min(mut f: impl FnMut()) -> u64 {
    (0..REPEAT)
        .map(|_| {
            let t = StdInstant::now();
            f();
            t.elapsed().as_nanos() as u64
        })
        .min()
        .unwrap_or(0)
}

/// splitmix64.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One request's block chain: content ("local") hashes and chained ("sequence") keys.
#[derive(Clone)]
struct Chain {
    locals: Vec<u64>,
    keys: Vec<u64>,
}

impl Chain {
    fn new(locals: Vec<u64>) -> Self {
        let mut prev = 0u64;
        let keys = locals
            .iter()
            .map(|&l| {
                prev = mix(prev.rotate_left(17) ^ l);
                prev
            })
            .collect();
        Self { locals, keys }
    }
}

/// One event of the common stream.
enum Ev {
    Store {
        worker: usize,
        parent: Option<u64>,
        keys: Vec<u64>,
        locals: Vec<u64>,
    },
    Remove {
        worker: usize,
        keys: Vec<u64>,
    },
}

struct Workload {
    name: String,
    workers: usize,
    events: Vec<Ev>,
    queries: Vec<Chain>,
    /// Per worker, its held blocks at the end (for the drain phase and bytes per block).
    held: Vec<Vec<u64>>,
    evicted: u64,
}

/// Per-worker cache model: LRU with parent tick > child tick, so eviction is leaf-first.
#[derive(Default)]
struct WorkerCache {
    tick_of: HashMap<u64, u64>,
    by_tick: BTreeMap<u64, u64>,
}

fn build(name: &str, workers: usize, cap: usize, requests: &[(usize, Chain)]) -> Workload {
    let mut caches: Vec<WorkerCache> = (0..workers).map(|_| WorkerCache::default()).collect();
    let mut events = Vec::new();
    let mut tick = 0u64;
    let mut evicted = 0;
    for (w, chain) in requests {
        let c = &mut caches[*w];
        let held = chain
            .keys
            .iter()
            .take_while(|k| c.tick_of.contains_key(k))
            .count();
        // Later positions get lower ticks: a parent is always more recent than its children.
        let n = chain.keys.len() as u64;
        for (i, &k) in chain.keys.iter().enumerate() {
            let t = tick + n - i as u64;
            if let Some(old) = c.tick_of.insert(k, t) {
                c.by_tick.remove(&old);
            }
            c.by_tick.insert(t, k);
        }
        tick += n + 1;
        if held < chain.keys.len() {
            events.push(Ev::Store {
                worker: *w,
                parent: held.checked_sub(1).map(|p| chain.keys[p]),
                keys: chain.keys[held..].to_vec(),
                locals: chain.locals[held..].to_vec(),
            });
        }
        let mut gone = Vec::new();
        while c.tick_of.len() > cap {
            let Some((_, k)) = c.by_tick.pop_first() else {
                break;
            };
            c.tick_of.remove(&k);
            gone.push(k);
        }
        if !gone.is_empty() {
            evicted += gone.len() as u64;
            events.push(Ev::Remove {
                worker: *w,
                keys: gone,
            });
        }
    }
    let held = caches
        .iter()
        .map(|c| c.by_tick.values().rev().copied().collect())
        .collect();
    Workload {
        name: name.into(),
        workers,
        events,
        queries: requests.iter().map(|(_, c)| c.clone()).collect(),
        held,
        evicted,
    }
}

fn shared_dir() -> std::path::PathBuf {
    std::env::var_os("LOXI_SHARED")
        .map(Into::into)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared")
        })
}

fn mooncake(scale: u64) -> Vec<Chain> {
    let path = shared_dir().join("traces/mooncake-synthetic.jsonl");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("read {}: {e} (set LOXI_SHARED)", path.display()));
    let ids: Vec<Vec<u64>> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("trace line is JSON");
            v["hash_ids"]
                .as_array()
                .expect("hash_ids")
                .iter()
                .map(|x| x.as_u64().expect("hash id"))
                .collect()
        })
        .collect();
    (0..scale)
        .flat_map(|s| {
            ids.iter()
                .map(move |h| Chain::new(h.iter().map(|&x| mix(x ^ (s << 48))).collect()))
        })
        .collect()
}

fn mooncake_workload(chains: &[Chain], workers: usize, cap: usize) -> Workload {
    let placed: Vec<(usize, Chain)> = chains
        .iter()
        .map(|c| ((mix(c.keys[0]) % workers as u64) as usize, c.clone()))
        .collect();
    build(&format!("mooncake/{workers}"), workers, cap, &placed)
}

fn fleet_workload(scale: u64) -> Workload {
    let workers = 64;
    let convs = 2_000 * scale;
    let requests = 20_000 * scale;
    let mut placed = Vec::new();
    for r in 0..requests {
        let conv = mix(r ^ 0xC0) % convs;
        let sys = conv % 32;
        let mut locals: Vec<u64> = (0..128).map(|j| mix((1 << 40) | (sys << 16) | j)).collect();
        locals.extend((0..32).map(|j| mix((2 << 40) | (conv << 16) | j)));
        locals.extend((0..16).map(|j| mix((3 << 40) | (r << 16) | j)));
        placed.push(((mix(r ^ 0x77) % workers) as usize, Chain::new(locals)));
    }
    build("fleet/64", workers as usize, 8_192, &placed)
}

/// What one index measured on one workload.
#[derive(Default, Clone, Copy)]
struct Figures {
    bytes_per_block: f64,
    p50_ns: f64,
    p99_ns: f64,
    replay_ops: f64,
    drain_ops: f64,
    replay_ops_with_reader: f64,
    reader_qps: f64,
}

fn pct(mut v: Vec<u64>) -> (f64, f64) {
    v.sort_unstable();
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q) as usize] as f64;
    (p(0.5), p(0.99))
}

fn held_blocks(w: &Workload) -> u64 {
    w.held.iter().map(|h| h.len() as u64).sum()
}

fn replay_ops(w: &Workload) -> u64 {
    w.events
        .iter()
        .map(|e| match e {
            Ev::Store { keys, .. } | Ev::Remove { keys, .. } => keys.len() as u64,
        })
        .sum()
}

/// Replays are repeated on fresh indexes until about this many block-ops were applied, so that
/// short streams still give a measurable CPU time.
const MIN_OPS: u64 = 2_000_000;

fn reps(w: &Workload) -> u64 {
    MIN_OPS.div_ceil(replay_ops(w).max(1)).max(1)
}

/// Queries sampled for the percentiles (every query up to this many, then a stride).
const MAX_QUERIES: usize = 20_000;

fn sample(w: &Workload) -> Vec<&Chain> {
    let stride = w.queries.len().div_ceil(MAX_QUERIES).max(1);
    w.queries.iter().step_by(stride).collect()
}

// ---------------------------------------------------------------- loxi

fn loxi_keys(v: &[u64]) -> Vec<BlockKey> {
    v.iter().map(|&k| BlockKey(k)).collect()
}

fn loxi_apply(ix: &KvIndex, events: &[(usize, bool, Vec<BlockKey>)]) {
    for (w, store, keys) in events {
        if *store {
            black_box(ix.store(*w, 0, keys));
        } else {
            black_box(ix.remove(*w, 0, keys));
        }
    }
}

fn loxi(w: &Workload) -> (Figures, Vec<Vec<(usize, u32)>>) {
    let events: Vec<(usize, bool, Vec<BlockKey>)> = w
        .events
        .iter()
        .map(|e| match e {
            Ev::Store { worker, keys, .. } => (*worker, true, loxi_keys(keys)),
            Ev::Remove { worker, keys } => (*worker, false, loxi_keys(keys)),
        })
        .collect();
    let queries: Vec<Vec<BlockKey>> = sample(w).iter().map(|c| loxi_keys(&c.keys)).collect();
    let drain = drain_events(w);
    let mut f = Figures::default();
    let before = LIVE.load(Ordering::Relaxed);
    let ix = KvIndex::new(u64::MAX / 2);
    loxi_apply(&ix, &events);
    f.bytes_per_block = (LIVE.load(Ordering::Relaxed) - before) as f64 / held_blocks(w) as f64;
    let mut cpu_s = 0.0;
    for _ in 0..reps(w) {
        let ix = KvIndex::new(u64::MAX / 2);
        let c = process_cpu();
        loxi_apply(&ix, &events);
        cpu_s += process_cpu() - c;
    }
    f.replay_ops = (replay_ops(w) * reps(w)) as f64 / cpu_s;
    let now = tokio::time::Instant::now();
    let mut scratch = ScoreScratch::default();
    let mut answers = Vec::new();
    let ns: Vec<u64> = queries
        .iter()
        .map(|q| {
            let el = time_min(|| {
                black_box(ix.score_with(black_box(q), now, &mut scratch));
            });
            let r = ix.score_with(q, now, &mut scratch);
            answers.push(r.iter().map(|&(e, n)| (e, n as u32)).collect());
            el
        })
        .collect();
    (f.p50_ns, f.p99_ns) = pct(ns);
    let drain: Vec<(usize, Vec<BlockKey>)> =
        drain.iter().map(|(wk, k)| (*wk, loxi_keys(k))).collect();
    let c = process_cpu();
    for (wk, keys) in &drain {
        black_box(ix.remove(*wk, 0, keys));
    }
    f.drain_ops = held_blocks(w) as f64 / (process_cpu() - c);
    drop(ix);
    let ix = RwLock::new(KvIndex::new(u64::MAX / 2));
    let mut s = ScoreScratch::default();
    let (secs, qps) = reader_loop(
        |i| {
            black_box(
                ix.read()
                    .score_with(&queries[i % queries.len()], now, &mut s)
                    .len(),
            );
        },
        || {
            for r in 0..reps(w) {
                if r > 0 {
                    *ix.write() = KvIndex::new(u64::MAX / 2);
                }
                loxi_apply(&ix.read(), &events);
            }
        },
    );
    f.replay_ops_with_reader = (replay_ops(w) * reps(w)) as f64 / secs;
    f.reader_qps = qps;
    (f, answers)
}

/// Runs `read(i)` for i = 0.. on a second thread while `write` runs on this one; returns
/// (writer CPU seconds = process CPU minus the reader thread's, reader queries per reader
/// CPU-second). On a 2-core machine shared with others, CPU time is the comparable figure;
/// lock waits that block do not count, spinning does.
fn reader_loop(mut read: impl FnMut(usize) + Send, write: impl FnOnce()) -> (f64, f64) {
    let stop = &AtomicBool::new(false);
    let count = &AtomicUsize::new(0);
    let started = &AtomicBool::new(false);
    let reader_cpu = &parking_lot::Mutex::new(0.0f64);
    let secs = std::thread::scope(|s| {
        s.spawn(move || {
            let mut i = 0;
            let c0 = thread_cpu();
            started.store(true, Ordering::Release);
            while !stop.load(Ordering::Relaxed) {
                read(i);
                i += 1;
            }
            *reader_cpu.lock() = thread_cpu() - c0;
            count.store(i, Ordering::Relaxed);
        });
        while !started.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
        let c0 = process_cpu();
        write();
        stop.store(true, Ordering::Relaxed);
        c0
    });
    let total = process_cpu() - secs;
    let rc = *reader_cpu.lock();
    (
        (total - rc).max(1e-9),
        count.load(Ordering::Relaxed) as f64 / rc.max(1e-9),
    )
}

/// Every held block, per worker, newest-first in 64-block remove events (leaf-first order).
fn drain_events(w: &Workload) -> Vec<(usize, Vec<u64>)> {
    w.held
        .iter()
        .enumerate()
        .flat_map(|(wk, h)| {
            let mut h = h.clone();
            h.reverse();
            h.chunks(64).map(|c| (wk, c.to_vec())).collect::<Vec<_>>()
        })
        .collect()
}

// ---------------------------------------------------------------- smg

type SmgEvent = (usize, Option<u64>, Vec<(u64, u64)>, Vec<u64>);

fn smg_events(w: &Workload) -> Vec<SmgEvent> {
    w.events
        .iter()
        .map(|e| match e {
            Ev::Store {
                worker,
                parent,
                keys,
                locals,
            } => (
                *worker,
                *parent,
                keys.iter().copied().zip(locals.iter().copied()).collect(),
                Vec::new(),
            ),
            Ev::Remove { worker, keys } => (*worker, None, Vec::new(), keys.clone()),
        })
        .collect()
}

fn smg_apply_one(t: &mut RadixTree, holders: &[HolderId], e: &SmgEvent, errors: &mut u64) {
    let (wk, parent, store, remove) = e;
    if !store.is_empty() {
        if t.store(holders[*wk], *parent, store).is_err() {
            *errors += 1;
        }
    } else {
        black_box(t.remove(holders[*wk], remove));
    }
}

fn smg_new(workers: usize) -> (RadixTree, Vec<HolderId>) {
    let mut t = RadixTree::new(Config::default());
    let holders = (0..workers)
        .map(|i| t.create_holder(&format!("w{i}")))
        .collect();
    (t, holders)
}

fn smg(w: &Workload) -> (Figures, Vec<Vec<(usize, u32)>>) {
    let events = smg_events(w);
    let queries: Vec<&Chain> = sample(w);
    let drain = drain_events(w);
    let mut f = Figures::default();
    let mut errors = 0;
    let before = LIVE.load(Ordering::Relaxed);
    let (mut t, holders) = smg_new(w.workers);
    for e in &events {
        smg_apply_one(&mut t, &holders, e, &mut errors);
    }
    f.bytes_per_block = (LIVE.load(Ordering::Relaxed) - before) as f64 / held_blocks(w) as f64;
    assert_eq!(
        errors, 0,
        "smg refused stores: the stream is not prefix-closed"
    );
    let mut cpu_s = 0.0;
    for _ in 0..reps(w) {
        let (mut t, holders) = smg_new(w.workers);
        let c = process_cpu();
        for e in &events {
            smg_apply_one(&mut t, &holders, e, &mut errors);
        }
        cpu_s += process_cpu() - c;
    }
    f.replay_ops = (replay_ops(w) * reps(w)) as f64 / cpu_s;
    let slot_of: HashMap<HolderId, usize> =
        holders.iter().enumerate().map(|(i, h)| (*h, i)).collect();
    let mut scratch = OverlapScratch::default();
    let mut out: Vec<Overlap> = Vec::new();
    let mut answers = Vec::new();
    let ns: Vec<u64> = queries
        .iter()
        .map(|q| {
            let el = time_min(|| t.overlap(black_box(&q.locals), &mut scratch, &mut out));
            let mut a: Vec<(usize, u32)> = out
                .iter()
                .filter(|o| o.depth > 0)
                .map(|o| (slot_of[&o.holder], o.depth))
                .collect();
            a.sort_unstable();
            answers.push(a);
            el
        })
        .collect();
    (f.p50_ns, f.p99_ns) = pct(ns);
    let c = process_cpu();
    for (wk, keys) in &drain {
        black_box(t.remove(holders[*wk], keys));
    }
    f.drain_ops = held_blocks(w) as f64 / (process_cpu() - c);
    drop(t);
    let (t, mut holders) = smg_new(w.workers);
    let t = RwLock::new(t);
    let (mut s, mut o) = (OverlapScratch::default(), Vec::new());
    let (secs, qps) = reader_loop(
        |i| {
            t.read()
                .overlap(&queries[i % queries.len()].locals, &mut s, &mut o);
            black_box(o.len());
        },
        || {
            let mut errors = 0;
            for r in 0..reps(w) {
                if r > 0 {
                    let mut g = t.write();
                    (*g, holders) = smg_new(w.workers);
                }
                for e in &events {
                    smg_apply_one(&mut t.write(), &holders, e, &mut errors);
                }
            }
        },
    );
    f.replay_ops_with_reader = (replay_ops(w) * reps(w)) as f64 / secs;
    f.reader_qps = qps;
    (f, answers)
}

// ---------------------------------------------------------------- dynamo

fn dyn_events(w: &Workload) -> Vec<RouterEvent> {
    w.events
        .iter()
        .enumerate()
        .map(|(id, e)| match e {
            Ev::Store {
                worker,
                parent,
                keys,
                locals,
            } => RouterEvent::new(
                *worker as u64,
                KvCacheEvent {
                    event_id: id as u64,
                    dp_rank: 0,
                    data: KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: parent.map(ExternalSequenceBlockHash),
                        start_position: None,
                        blocks: keys
                            .iter()
                            .zip(locals)
                            .map(|(&k, &l)| KvCacheStoredBlockData {
                                block_hash: ExternalSequenceBlockHash(k),
                                tokens_hash: LocalBlockHash(l),
                                mm_extra_info: None,
                            })
                            .collect(),
                    }),
                },
            ),
            Ev::Remove { worker, keys } => dyn_remove(*worker, id as u64, keys),
        })
        .collect()
}

fn dyn_remove(worker: usize, id: u64, keys: &[u64]) -> RouterEvent {
    RouterEvent::new(
        worker as u64,
        KvCacheEvent {
            event_id: id,
            dp_rank: 0,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: keys.iter().map(|&k| ExternalSequenceBlockHash(k)).collect(),
            }),
        },
    )
}

/// A `ConcurrentRadixTreeCompressed` with its event worker thread (as `ThreadPoolIndexer`
/// runs it with one thread).
struct Dynamo {
    tree: Arc<ConcurrentRadixTreeCompressed>,
    tx: Option<flume::Sender<WorkerTask>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Dynamo {
    fn new() -> Self {
        let tree = Arc::new(ConcurrentRadixTreeCompressed::new());
        // Bounded so that the channel's buffer does not count as index memory.
        let (tx, rx) = flume::bounded(256);
        let t2 = tree.clone();
        let thread = std::thread::spawn(move || {
            t2.worker(rx, None).expect("dynamo worker");
        });
        Self {
            tree,
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    /// Sends `events` and waits until the worker applied all of them.
    fn apply(&self, events: impl IntoIterator<Item = RouterEvent>, barrier: RouterEvent) {
        let tx = self.tx.as_ref().expect("open");
        for e in events {
            tx.send(WorkerTask::Event(e)).expect("send");
        }
        let (resp, rx) = tokio::sync::oneshot::channel();
        tx.send(WorkerTask::EventWithAck {
            event: barrier,
            resp,
        })
        .expect("send");
        rx.blocking_recv().expect("ack");
    }
}

impl Drop for Dynamo {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn dynamo(w: &Workload) -> (Figures, Vec<Vec<(usize, u32)>>) {
    let queries: Vec<Vec<LocalBlockHash>> = sample(w)
        .iter()
        .map(|c| c.locals.iter().map(|&l| LocalBlockHash(l)).collect())
        .collect();
    let barrier = || dyn_remove(0, u64::MAX, &[]);
    let mut f = Figures::default();
    // Counted from before the events are built: the worker consumes (frees) them.
    let before = LIVE.load(Ordering::Relaxed);
    let events = dyn_events(w);
    let d = Dynamo::new();
    d.apply(events, barrier());
    f.bytes_per_block = (LIVE.load(Ordering::Relaxed) - before) as f64 / held_blocks(w) as f64;
    let mut cpu_s = 0.0;
    for _ in 0..reps(w) {
        let events = dyn_events(w);
        let d = Dynamo::new();
        let c = process_cpu();
        d.apply(events, barrier());
        cpu_s += process_cpu() - c;
    }
    f.replay_ops = (replay_ops(w) * reps(w)) as f64 / cpu_s;
    let mut answers = Vec::new();
    let ns: Vec<u64> = queries
        .iter()
        .map(|q| {
            let el = time_min(|| {
                black_box(d.tree.find_matches(black_box(q), false));
            });
            let r = d.tree.find_matches(q, false);
            let mut a: Vec<(usize, u32)> = r
                .scores
                .iter()
                .filter(|(_, s)| **s > 0)
                .map(|(wk, &s)| (wk.worker_id as usize, s))
                .collect();
            a.sort_unstable();
            answers.push(a);
            el
        })
        .collect();
    (f.p50_ns, f.p99_ns) = pct(ns);
    let drain: Vec<RouterEvent> = drain_events(w)
        .iter()
        .enumerate()
        .map(|(i, (wk, keys))| dyn_remove(*wk, (1 << 40) + i as u64, keys))
        .collect();
    let c = process_cpu();
    d.apply(drain, barrier());
    f.drain_ops = held_blocks(w) as f64 / (process_cpu() - c);
    drop(d);
    let d = RwLock::new(Dynamo::new());
    let all: Vec<Vec<RouterEvent>> = (0..reps(w)).map(|_| dyn_events(w)).collect();
    let (secs, qps) = reader_loop(
        |i| {
            black_box(
                d.read()
                    .tree
                    .find_matches(&queries[i % queries.len()], false),
            );
        },
        || {
            for (r, events) in all.into_iter().enumerate() {
                if r > 0 {
                    *d.write() = Dynamo::new();
                }
                d.read().apply(events, barrier());
            }
        },
    );
    f.replay_ops_with_reader = (replay_ops(w) * reps(w)) as f64 / secs;
    f.reader_qps = qps;
    (f, answers)
}

// ---------------------------------------------------------------- report

fn agree(a: &[Vec<(usize, u32)>], b: &[Vec<(usize, u32)>]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x == y).count()
}

fn row(name: &str, f: &Figures) {
    println!(
        "  {name:<7} {:>8.1} B/blk  query p50 {:>7.2} µs p99 {:>7.2} µs  replay {:>6.2} M ops/s  drain {:>6.2} M/s  replay+reader {:>6.2} M ops/s (reader {:>8.0} q/CPU-s)",
        f.bytes_per_block,
        f.p50_ns / 1e3,
        f.p99_ns / 1e3,
        f.replay_ops / 1e6,
        f.drain_ops / 1e6,
        f.replay_ops_with_reader / 1e6,
        f.reader_qps
    );
}

fn ratios(peer: &str, l: &Figures, p: &Figures) {
    println!(
        "  loxi/{peer:<6} bytes {:.2}  p50 {:.2}  p99 {:.2}  replay {:.2}  drain {:.2}  replay+reader {:.2}  reader q/s {:.2}   (bytes, p50, p99: lower is better; rates: higher)",
        l.bytes_per_block / p.bytes_per_block,
        l.p50_ns / p.p50_ns,
        l.p99_ns / p.p99_ns,
        l.replay_ops / p.replay_ops,
        l.drain_ops / p.drain_ops,
        l.replay_ops_with_reader / p.replay_ops_with_reader,
        l.reader_qps / p.reader_qps
    );
}

fn run(w: &Workload) {
    let blocks = held_blocks(w);
    println!(
        "{}: {} workers, {} events, {} block-ops ({} evictions), {} worker-blocks held at the end, {} queries (p50/p99 over {})",
        w.name,
        w.workers,
        w.events.len(),
        replay_ops(w),
        w.evicted,
        blocks,
        w.queries.len(),
        sample(w).len()
    );
    let (lf, la) = loxi(w);
    let (sf, sa) = smg(w);
    let (df, da) = dynamo(w);
    row("loxi", &lf);
    row("smg", &sf);
    row("dynamo", &df);
    ratios("smg", &lf, &sf);
    ratios("dynamo", &lf, &df);
    println!(
        "  answers equal to loxi's (per-worker prefix depth): smg {}/{}, dynamo {}/{}",
        agree(&la, &sa),
        la.len(),
        agree(&la, &da),
        la.len()
    );
}

fn main() {
    // `cargo bench` passes `--bench`; any other argument is ignored.
    let scale: u64 = std::env::var("KV_PEERS_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1);
    println!(
        "KV index head to head (KV_PEERS_SCALE={scale}); rates per CPU-second, single writer; query p50/p99 wall, fastest of 3 per query"
    );
    let chains = mooncake(scale);
    let cap = 4_096 * scale as usize;
    run(&mooncake_workload(&chains, 8, cap));
    run(&mooncake_workload(&chains, 64, cap / 8));
    run(&fleet_workload(scale));
}
