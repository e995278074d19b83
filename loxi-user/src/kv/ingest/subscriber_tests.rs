//! Subscriber tests against a real libzmq publisher (`tests/py/kv_pub.py`, pyzmq).

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use super::*;
use crate::kv::BlockKey;
use crate::kv::ingest::manager::KvManager;
use crate::kv::settings::KvSettings;
use crate::kv::testutil::{golden_json, msgpack, rule, state, stored_batch};
use crate::rules::store::RuleSnapshot;

struct Pub {
    child: Child,
    stdin: ChildStdin,
    out: Lines<BufReader<ChildStdout>>,
    port: u16,
    replay_port: u16,
}

impl Pub {
    async fn start(args: &[&str]) -> Self {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/py/kv_pub.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn python3 kv_pub.py (pyzmq installed by scripts/setup.sh)");
        let stdin = child.stdin.take().expect("stdin");
        let mut out = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let ready = next_line(&mut out).await;
        let f: Vec<&str> = ready.split_whitespace().collect();
        assert_eq!(f.first(), Some(&"ready"), "{ready}");
        let port = f[1].parse().expect("port");
        let replay_port = f[2].parse().expect("replay port");
        Self {
            child,
            stdin,
            out,
            port,
            replay_port,
        }
    }

    async fn cmd(&mut self, v: serde_json::Value) {
        self.stdin
            .write_all(format!("{v}\n").as_bytes())
            .await
            .expect("write command");
        loop {
            if next_line(&mut self.out).await == "ok" {
                return;
            }
        }
    }

    async fn wait_subscribed(&mut self) {
        loop {
            if next_line(&mut self.out).await == "subscribed" {
                return;
            }
        }
    }

    async fn send(&mut self, seq: u64, payload: &[u8]) {
        self.cmd(
            serde_json::json!({"op": "send", "seq": seq, "payload_hex": hex::encode(payload)}),
        )
        .await;
    }
}

impl Drop for Pub {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

async fn next_line(out: &mut Lines<BufReader<ChildStdout>>) -> String {
    // Above the longest command: a 12 s `restart` answers once the publisher is back.
    tokio::time::timeout(Duration::from_secs(20), out.next_line())
        .await
        .expect("publisher answered within 20 s")
        .expect("read publisher stdout")
        .expect("publisher alive")
}

fn timing(keep_window: u64) -> StreamTiming {
    StreamTiming {
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        replay_timeout: Duration::from_secs(2),
        keep_window,
    }
}

struct Sub {
    state: Arc<KvState>,
    svc: Arc<ServiceKv>,
    _reg: Registry,
    cancel: CancellationToken,
}

impl Sub {
    fn start(p: &Pub, extra: serde_json::Value, settings: KvSettings, keep_window: u64) -> Self {
        let (state, reg) = state(settings);
        let svc = state.service(&rule(1, 1, extra)).expect("kv rule");
        let replay = (p.replay_port != 0).then(|| format!("127.0.0.1:{}", p.replay_port));
        let addr = StreamAddr {
            member: 0,
            rank: 0,
            publisher: format!("127.0.0.1:{}", p.port),
            replay,
        };
        let cancel = CancellationToken::new();
        tokio::spawn(
            Stream::new(state.clone(), svc.clone(), addr, timing(keep_window)).run(cancel.clone()),
        );
        Self {
            state,
            svc,
            _reg: reg,
            cancel,
        }
    }

    fn counter(
        &self,
        fam: &prometheus_client::metrics::family::Family<
            EpLabels,
            prometheus_client::metrics::counter::Counter,
        >,
    ) -> u64 {
        fam.get_or_create(&EpLabels {
            service: "1".into(),
            ep: "0".into(),
        })
        .get()
    }

    fn applied(&self) -> u64 {
        self.counter(&self.state.metrics.events_applied)
    }

    fn rejected(&self, reason: &str) -> u64 {
        let l = EpReasonLabels {
            service: "1".into(),
            ep: "0".into(),
            reason: reason.into(),
        };
        self.state.metrics.events_rejected.get_or_create(&l).get()
    }

    fn last_seq(&self) -> Option<u64> {
        self.svc
            .streams
            .lock()
            .get(&(0, 0))
            .and_then(|s| s.last_seq)
    }

    /// Polls until `f` holds (bounded: 10 s).
    async fn until(&self, what: &str, f: impl Fn(&Self) -> bool) {
        for _ in 0..1000 {
            if f(self) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    fn held(&self) -> HashSet<u64> {
        self.svc.index.keys_of(0).into_iter().map(|k| k.0).collect()
    }
}

impl Drop for Sub {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// The inventory a capture's events leave behind: refcounted stores, removals, clears.
fn expected_inventory(g: &serde_json::Value) -> (HashSet<u64>, u64) {
    let mut refs: HashMap<u64, u32> = HashMap::new();
    let mut events = 0;
    for f in g["frames"].as_array().expect("frames") {
        for ev in f["decoded"][1].as_array().expect("events") {
            events += 1;
            let hashes = ev["block_hashes"].as_array().cloned().unwrap_or_default();
            let keys = hashes.iter().map(|h| h.as_u64().expect("int hash"));
            match ev["type"].as_str().expect("type") {
                "BlockStored" => keys.for_each(|k| *refs.entry(k).or_default() += 1),
                "BlockRemoved" => keys.for_each(|k| {
                    if let Some(r) = refs.get_mut(&k) {
                        *r -= 1;
                        if *r == 0 {
                            refs.remove(&k);
                        }
                    }
                }),
                _ => refs.clear(),
            }
        }
    }
    (refs.into_keys().collect(), events)
}

fn parity_settings() -> KvSettings {
    KvSettings {
        none_hash_seed: Some("0".into()),
        ..KvSettings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_captured_frame_through_pyzmq_builds_the_captured_inventory() {
    for file in ["vllm_kv_events_capture.json", "bos_kv_events_capture.json"] {
        let g = golden_json(file);
        let mut p = Pub::start(&[]).await;
        let s = Sub::start(
            &p,
            serde_json::json!({"kvBlockSize": 32}),
            parity_settings(),
            64,
        );
        p.wait_subscribed().await;
        for f in g["frames"].as_array().expect("frames") {
            p.cmd(serde_json::json!({"op": "raw", "frames_hex": f["parts_hex"]}))
                .await;
        }
        let (want, events) = expected_inventory(&g);
        let last = g["frames"]
            .as_array()
            .and_then(|f| f.last())
            .and_then(|f| f["seq"].as_u64());
        s.until("all events applied", |s| s.applied() == events)
            .await;
        assert_eq!(s.held(), want, "{file}");
        assert_eq!(s.last_seq(), last);
        assert_eq!(s.svc.index.blocks(0), want.len() as u64);
        let verdict = s.svc.parity.lock().get(0).map(|p| p.verdict.clone());
        assert_eq!(
            verdict,
            Some(crate::kv::ingest::parity::Verdict::Ok),
            "{file}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_restart_with_seq_zero_clears_the_endpoint_immediately() {
    let mut p = Pub::start(&[]).await;
    let s = Sub::start(&p, serde_json::json!({}), KvSettings::default(), 64);
    p.wait_subscribed().await;
    let prefix: Vec<u64> = (1..=4).collect();
    p.send(0, &stored_batch(&prefix, 16)).await;
    for seq in 1..=500 {
        p.send(seq, &stored_batch(&[10_000 + seq], 16)).await;
    }
    s.until("seq 500", |s| s.last_seq() == Some(500)).await;
    assert!(s.svc.index.holds_key(0, BlockKey(1)));
    p.cmd(serde_json::json!({"op": "restart"})).await;
    p.wait_subscribed().await;
    p.send(0, &stored_batch(&[777], 16)).await;
    s.until("restart batch", |s| s.held().contains(&777)).await;
    assert_eq!(s.held(), HashSet::from([777]));
    let keys: Vec<BlockKey> = prefix.iter().map(|&k| BlockKey(k)).collect();
    assert!(
        s.svc
            .index
            .score(&keys, tokio::time::Instant::now())
            .is_empty()
    );
    assert_eq!(s.counter(&s.state.metrics.reconnects), 1);
    assert_eq!(s.counter(&s.state.metrics.recv_errors), 1);
    assert_eq!(connected(&s.state), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_down_for_seconds_is_reconnected_and_resubscribed() {
    let mut p = Pub::start(&[]).await;
    let s = Sub::start(&p, serde_json::json!({}), KvSettings::default(), 64);
    p.wait_subscribed().await;
    p.send(0, &stored_batch(&[1], 16)).await;
    s.until("seq 0", |s| s.last_seq() == Some(0)).await;
    // Down 12 s, far beyond backoff_max (200 ms here): the stream rebuilds its socket and
    // retries through refused attempts with its own capped backoff, so it resubscribes at most
    // about 2 × backoff_max (one retry sleep, one connect window) after the publisher is back.
    // The bound adds 2 s of slack for a loaded machine. Without the rebuild only the crate's own
    // reconnect is left (`zeromq::ReconnectConfig::default`: 100 ms, doubled plus up to 0.1 s of
    // jitter per attempt): its 6th attempt falls by 12 s, its 7th 12.7 s to 24.7 s after the
    // disconnect, so at least 0.7 s and, in 99 % of 10^5 simulated schedules, more than the
    // bound after the publisher is back: the test fails without the fix. One disconnect, one
    // reconnect.
    let down = Duration::from_secs(12);
    let bound = 2 * timing(64).backoff_max + Duration::from_secs(2);
    p.cmd(serde_json::json!({"op": "restart", "down_ms": down.as_millis()}))
        .await;
    let back = std::time::Instant::now();
    p.wait_subscribed().await;
    assert!(
        back.elapsed() < bound,
        "resubscribed {:?} after the publisher came back (bound {bound:?})",
        back.elapsed()
    );
    p.send(0, &stored_batch(&[2], 16)).await;
    s.until("batch after restart", |s| s.held().contains(&2))
        .await;
    assert_eq!(s.held(), HashSet::from([2]));
    assert_eq!(s.counter(&s.state.metrics.reconnects), 1);
    assert_eq!(s.counter(&s.state.metrics.recv_errors), 1);
    assert_eq!(connected(&s.state), 1);
}

/// `skip` entries of a `restart`/`drop` command: batches the publisher sent while no
/// subscriber was connected (only its replay buffer has them), one block `key_base + seq` each.
fn skipped(seqs: std::ops::RangeInclusive<u64>, key_base: u64) -> serde_json::Value {
    seqs.map(|seq| {
        serde_json::json!({"seq": seq, "payload_hex": hex::encode(stored_batch(&[key_base + seq], 16))})
    })
    .collect()
}

/// A stream at seq 3 holding blocks 1..=4 (one per batch).
async fn at_seq_3(p: &mut Pub, s: &Sub) {
    p.wait_subscribed().await;
    for seq in 0..=3 {
        p.send(seq, &stored_batch(&[seq + 1], 16)).await;
    }
    s.until("seq 3", |s| s.last_seq() == Some(3)).await;
}

/// An engine restarted while the stream was down and published 9 batches before the
/// subscriber was back: its next live batch (seq 9) is past the old last seq (3) by less than
/// the gap window, so the sequence rules alone would keep the dead engine's blocks. Without a
/// replay port the endpoint keeps only what arrived after the reconnect; with one, the new
/// engine's whole buffer (seqs 0..=8) replaces the old blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restarted_while_disconnected_is_cleared_even_when_its_new_seq_is_ahead() {
    for replay in [false, true] {
        let mut p = Pub::start(if replay { &["--replay"][..] } else { &[] }).await;
        let s = Sub::start(&p, serde_json::json!({}), KvSettings::default(), 64);
        at_seq_3(&mut p, &s).await;
        p.cmd(serde_json::json!({"op": "restart", "skip": skipped(0..=8, 100)}))
            .await;
        p.wait_subscribed().await;
        p.send(9, &stored_batch(&[777], 16)).await;
        s.until("the new engine's live batch", |s| s.held().contains(&777))
            .await;
        let mut want: HashSet<u64> = HashSet::from([777]);
        if replay {
            want.extend(100..=108);
        }
        assert_eq!(s.held(), want, "replay port: {replay}");
        assert_eq!(s.last_seq(), Some(9));
    }
}

/// The same engine, only the connection dropped: with a replay port the replay answers the
/// stream's last batch unchanged, so the blocks stay and the batches sent meanwhile are caught
/// up; without one the next live batch continuing the sequence keeps them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_connection_to_the_same_publisher_keeps_the_blocks() {
    let mut p = Pub::start(&["--replay"]).await;
    let s = Sub::start(&p, serde_json::json!({}), KvSettings::default(), 64);
    at_seq_3(&mut p, &s).await;
    p.cmd(serde_json::json!({"op": "drop", "skip": skipped(4..=6, 200)}))
        .await;
    p.wait_subscribed().await;
    p.send(7, &stored_batch(&[207], 16)).await;
    s.until("seq 7", |s| s.last_seq() == Some(7)).await;
    assert_eq!(s.held(), HashSet::from([1, 2, 3, 4, 204, 205, 206, 207]));

    let mut p = Pub::start(&[]).await;
    let s = Sub::start(&p, serde_json::json!({}), KvSettings::default(), 64);
    at_seq_3(&mut p, &s).await;
    p.cmd(serde_json::json!({"op": "drop"})).await;
    p.wait_subscribed().await;
    p.send(4, &stored_batch(&[204], 16)).await;
    s.until("seq 4", |s| s.last_seq() == Some(4)).await;
    assert_eq!(s.held(), HashSet::from([1, 2, 3, 4, 204]));
    assert_eq!(s.counter(&s.state.metrics.reconnects), 1);
}

fn connected(state: &KvState) -> i64 {
    state
        .metrics
        .connected
        .get_or_create(&EpLabels {
            service: "1".into(),
            ep: "0".into(),
        })
        .get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_connected_or_still_connecting_stream_ends_it_promptly() {
    let mut p = Pub::start(&[]).await;
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind probe");
    let dead = probe.local_addr().expect("addr").port();
    drop(probe);
    let mut tasks = Vec::new();
    for port in [p.port, dead] {
        let (state, reg) = state(KvSettings::default());
        let svc = state
            .service(&rule(1, 1, serde_json::json!({})))
            .expect("kv rule");
        let addr = StreamAddr {
            member: 0,
            rank: 0,
            publisher: format!("127.0.0.1:{port}"),
            replay: None,
        };
        let cancel = CancellationToken::new();
        let run = Stream::new(state.clone(), svc, addr, timing(64)).run(cancel.clone());
        tasks.push((state, reg, cancel, tokio::spawn(run)));
    }
    let state = tasks[0].0.clone();
    p.wait_subscribed().await;
    for _ in 0..500 {
        if connected(&state) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(connected(&state), 1);
    for (state, _reg, cancel, task) in tasks {
        cancel.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("stream ended within 1 s of cancellation")
            .expect("stream task did not panic");
        assert_eq!(connected(&state), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_gap_keeps_state_and_large_gap_without_replay_clears() {
    let mut p = Pub::start(&[]).await;
    let s = Sub::start(&p, serde_json::json!({}), KvSettings::default(), 64);
    p.wait_subscribed().await;
    p.send(0, &stored_batch(&[1], 16)).await;
    p.send(65, &stored_batch(&[2], 16)).await;
    s.until("seq 65", |s| s.last_seq() == Some(65)).await;
    assert_eq!(s.held(), HashSet::from([1, 2]));
    p.send(131, &stored_batch(&[3], 16)).await;
    s.until("seq 131", |s| s.last_seq() == Some(131)).await;
    assert_eq!(s.held(), HashSet::from([3]));
}

/// Batch i stores key 100 + i; batch 5 also stores 555 and batch 6 removes it, so applying 5
/// after 6 (wrong order) would leave 555 behind, and a duplicate would double a refcount.
async fn replay_repairs_forced_gap(layout: &str) {
    let mut p = Pub::start(&["--replay", "--layout", layout]).await;
    let s = Sub::start(
        &p,
        serde_json::json!({"kvReplayPort": p.replay_port}),
        KvSettings::default(),
        0,
    );
    p.wait_subscribed().await;
    let replays_ok = |s: &Sub| {
        let l = EpReasonLabels {
            service: "1".into(),
            ep: "0".into(),
            reason: "ok".into(),
        };
        s.state.metrics.replays.get_or_create(&l).get()
    };
    // The connect's catch-up (of an empty buffer) ends before the first batch is sent, so
    // batch 5 can only come back through the gap repair.
    s.until("catch-up", |s| replays_ok(s) == 1).await;
    use rmpv::Value as V;
    let stored = |k: u64| {
        V::Map(vec![
            (V::from("type"), V::from("BlockStored")),
            (V::from("block_hashes"), V::Array(vec![V::from(k)])),
        ])
    };
    let removed = V::Array(vec![
        V::from("BlockRemoved"),
        V::Array(vec![V::from(555u64)]),
    ]);
    let batch6 = msgpack(&V::Array(vec![
        V::F64(0.0),
        V::Array(vec![stored(106), removed]),
    ]));
    for seq in 0..10u64 {
        let op = if seq == 5 { "skip" } else { "send" };
        let payload = match seq {
            5 => stored_batch(&[105, 555], 16),
            6 => batch6.clone(),
            _ => stored_batch(&[100 + seq], 16),
        };
        p.cmd(serde_json::json!({"op": op, "seq": seq, "payload_hex": hex::encode(payload)}))
            .await;
    }
    s.until("seq 9", |s| s.last_seq() == Some(9)).await;
    assert_eq!(
        s.held(),
        (100..110).collect::<HashSet<u64>>(),
        "layout {layout}"
    );
    assert_eq!(s.svc.index.blocks(0), 10);
    assert_eq!(replays_ok(&s), 2, "catch-up + one gap repair");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_topic_layout_applies_missing_batches_in_order_once() {
    replay_repairs_forced_gap("3").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_older_two_frame_layout_applies_missing_batches_in_order_once() {
    replay_repairs_forced_gap("2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_frames_and_wrong_block_size_do_not_kill_the_subscriber() {
    let mut p = Pub::start(&[]).await;
    let s = Sub::start(
        &p,
        serde_json::json!({"kvBlockSize": 16}),
        KvSettings::default(),
        64,
    );
    p.wait_subscribed().await;
    for frames in [
        vec!["6b76"],
        vec!["6b76", "00"],
        vec!["6b76", "000001", "90"],
        vec!["6b76", "0000000000000000", "c1c1c1"],
    ] {
        p.cmd(serde_json::json!({"op": "raw", "frames_hex": frames}))
            .await;
    }
    p.send(1, &stored_batch(&[5], 768)).await;
    p.send(2, &stored_batch(&[6], 16)).await;
    s.until("seq 2", |s| s.last_seq() == Some(2)).await;
    assert_eq!(s.held(), HashSet::from([6]));
    assert_eq!(
        (
            s.rejected("frame"),
            s.rejected("batch"),
            s.rejected("block_size")
        ),
        (3, 1, 1)
    );
    assert_eq!(s.counter(&s.state.metrics.recv_errors), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_started_before_the_engine_connects_when_it_comes_up() {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind probe");
    let port = probe.local_addr().expect("addr").port();
    drop(probe);
    let (state, _reg) = state(KvSettings::default());
    let svc = state
        .service(&rule(1, 1, serde_json::json!({})))
        .expect("kv rule");
    let cancel = CancellationToken::new();
    let addr = StreamAddr {
        member: 0,
        rank: 0,
        publisher: format!("127.0.0.1:{port}"),
        replay: None,
    };
    tokio::spawn(Stream::new(state.clone(), svc.clone(), addr, timing(64)).run(cancel.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut p = Pub::start(&["--port", &port.to_string()]).await;
    p.wait_subscribed().await;
    p.send(0, &stored_batch(&[42], 16)).await;
    for _ in 0..500 {
        if svc.index.holds_key(0, BlockKey(42)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(svc.index.holds_key(0, BlockKey(42)));
    let up = state
        .metrics
        .connected
        .get_or_create(&EpLabels {
            service: "1".into(),
            ep: "0".into(),
        })
        .get();
    assert_eq!(up, 1);
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_follows_rules_and_rule_deletion_stops_streams_and_drops_the_index() {
    // One publisher per endpoint (127.0.0.1 and 127.0.0.2), each on the endpoint's own port.
    let mut p = Pub::start(&["--host", "127.0.0.1"]).await;
    let mut q = Pub::start(&["--host", "127.0.0.2"]).await;
    let (state, _reg) = state(KvSettings::default());
    let mut r = rule(9, 2, serde_json::json!({"kvExactMode": 3}));
    r.rule.endpoints[0].kv_zmq_port = p.port;
    r.rule.endpoints[1].kv_zmq_port = q.port;
    r.spec = crate::rules::ServiceSpec::compile(&r.rule).expect("spec");
    let mut snap = RuleSnapshot::default();
    snap.rules.insert(r.rule.key(), Arc::new(r.clone()));
    let mut m = KvManager::new(state.clone(), timing(64));
    m.reconcile(&snap);
    assert_eq!(m.len(), 2);
    p.wait_subscribed().await;
    q.wait_subscribed().await;
    p.send(0, &stored_batch(&[1, 2], 16)).await;
    q.send(0, &stored_batch(&[1, 2], 16)).await;
    let svc = state.get(9).expect("service state");
    for _ in 0..500 {
        if svc.index.blocks(0) == 2 && svc.index.blocks(1) == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!((svc.index.blocks(0), svc.index.blocks(1)), (2, 2));
    m.reconcile(&RuleSnapshot::default());
    assert!(m.is_empty());
    assert!(state.get(9).is_none());
}

#[test]
fn an_endpoints_own_event_ports_override_the_rules_on_every_rank() {
    let (state, _reg) = state(KvSettings::default());
    let mut r = rule(
        6,
        2,
        serde_json::json!({"kvDpRankCount": 2, "kvZmqPort": 6000, "kvReplayPort": 6100}),
    );
    r.rule.endpoints[1].kv_zmq_port = 7000;
    r.rule.endpoints[1].kv_replay_port = 7100;
    r.spec = crate::rules::ServiceSpec::compile(&r.rule).expect("spec");
    let svc = state.sync(&r).expect("a KV service");
    let mut got: Vec<(usize, u32, String, Option<String>)> =
        crate::kv::ingest::manager::streams_of(&svc)
            .into_iter()
            .map(|a| (a.member, a.rank, a.publisher, a.replay))
            .collect();
    got.sort();
    let at = |p: u32| "127.0.0.1:".to_string() + &p.to_string();
    let at2 = |p: u32| "127.0.0.2:".to_string() + &p.to_string();
    assert_eq!(
        got,
        vec![
            (0, 0, at(6000), Some(at(6100))),
            (0, 1, at(6001), Some(at(6101))),
            (1, 0, at2(7000), Some(at2(7100))),
            (1, 1, at2(7001), Some(at2(7101))),
        ]
    );
}

#[tokio::test]
async fn an_endpoint_change_keeps_the_state_and_the_streams_of_endpoints_that_stay() {
    let (state, _reg) = state(KvSettings::default());
    let three = rule(4, 3, serde_json::json!({}));
    let mut two = three.clone();
    two.rule.endpoints.remove(0);
    two.spec = crate::rules::ServiceSpec::compile(&two.rule).expect("spec");
    let snap = |r: &crate::rules::store::StoredRule| {
        let mut s = RuleSnapshot::default();
        s.rules.insert(r.rule.key(), Arc::new(r.clone()));
        s
    };
    let mut m = KvManager::new(state.clone(), timing(64));
    m.reconcile(&snap(&three));
    let svc = state.get(4).expect("service");
    // Members 0, 1, 2 are endpoints 127.0.0.1:8000, 127.0.0.2:8001, 127.0.0.3:8002.
    svc.index.store(1, 0, &[BlockKey(11), BlockKey(12)]);
    svc.index.store(2, 0, &[BlockKey(21)]);
    svc.index.store(0, 0, &[BlockKey(1)]);
    let before: HashSet<String> = m.publishers().into_iter().collect();

    // Drop :8000: the others move to positions 0 and 1 with their blocks and streams.
    m.reconcile(&snap(&two));
    let after = state.get(4).expect("service");
    assert!(
        Arc::ptr_eq(&svc, &after),
        "same contract: the state is kept"
    );
    assert_eq!(m.len(), 2);
    let members = after.members.read();
    let (m0, m1) = (members.member_at(0), members.member_at(1));
    drop(members);
    assert_eq!((m0, m1), (Some(1), Some(2)));
    assert_eq!((after.index.blocks(1), after.index.blocks(2)), (2, 1));
    assert_eq!(
        after.index.blocks(0),
        0,
        "the removed endpoint's blocks are dropped"
    );
    let kept: HashSet<String> = m.publishers().into_iter().collect();
    assert!(
        kept.is_subset(&before),
        "no stream restarted: {kept:?} vs {before:?}"
    );

    // A contract change (block size) rebuilds the state.
    let mut other = two.clone();
    other.rule.service.kv_block_size = 32;
    other.spec = crate::rules::ServiceSpec::compile(&other.rule).expect("spec");
    m.reconcile(&snap(&other));
    let rebuilt = state.get(4).expect("service");
    assert!(!Arc::ptr_eq(&svc, &rebuilt));
    assert_eq!(rebuilt.index.blocks(1), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_subscribes_only_prefill_endpoints_in_mode_one() {
    let (state, _reg) = state(KvSettings::default());
    let r = rule(
        3,
        3,
        serde_json::json!({"kvExactMode": 1, "pd_disagg_mode": true, "ep_roles": [0, 1, 2]}),
    );
    let mut snap = RuleSnapshot::default();
    snap.rules.insert(r.rule.key(), Arc::new(r));
    let mut m = KvManager::new(state.clone(), timing(64));
    m.reconcile(&snap);
    assert_eq!(m.len(), 1);
    let svc = state.get(3).expect("service");
    let subscribed: Vec<bool> = svc
        .members
        .read()
        .iter()
        .map(|(_, e, _)| e.subscribed)
        .collect();
    assert_eq!(subscribed, vec![false, true, false]);
}

/// A batch is filed under the DP rank of the socket it came from, whatever rank it names (an
/// engine started as `--data-parallel-rank 1` behind its own endpoint stamps 1 into the
/// batches of that endpoint's rank-0 stream): the stream's own clear (a restart, a gap)
/// must reach its blocks, and a publisher cannot spread blocks over ranks no stream owns.
#[tokio::test]
async fn batches_are_filed_under_their_sockets_rank() {
    let (state, _reg) = state(KvSettings::default());
    let svc = state
        .service(&rule(1, 1, serde_json::json!({})))
        .expect("kv rule");
    let addr = StreamAddr {
        member: 0,
        rank: 0,
        publisher: "127.0.0.1:9".into(),
        replay: None,
    };
    let mut s = Stream::new(state.clone(), svc.clone(), addr, timing(64));
    use rmpv::Value as V;
    let ev = V::Array(vec![
        V::from("BlockStored"),
        V::Array(vec![V::from(31u64)]),
        V::Nil,
        V::Array(vec![]),
        V::from(16),
    ]);
    s.on_batch(
        0,
        &msgpack(&V::Array(vec![
            V::F64(0.0),
            V::Array(vec![ev.clone()]),
            V::from(1),
        ])),
    )
    .await;
    s.on_batch(
        1,
        &msgpack(&V::Array(vec![V::F64(0.0), V::Array(vec![ev])])),
    )
    .await;
    assert_eq!(
        svc.index.blocks(0),
        1,
        "one block, stored twice under rank 0"
    );
    svc.index.clear_rank(0, 1);
    assert_eq!(svc.index.blocks(0), 1, "nothing was filed under rank 1");
    svc.index.clear_rank(0, 0);
    assert_eq!(svc.index.blocks(0), 0);
}

/// A correct engine publishing, through real libzmq, blocks whose extra keys loxi cannot
/// reproduce (one string on block 0 that is no salt of loxi's) next to salted and plain blocks:
/// its verdict becomes `ok`, never `mismatch`, and the index holds the engine's own ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreproducible_extra_keys_over_pyzmq_keep_a_correct_engine_ok() {
    use rmpv::Value as V;
    let h = crate::kv::block_hash::BlockHasher::new(
        crate::kv::block_hash::HashAlgo::Sha256Cbor,
        Some("0"),
    );
    let toks =
        |salt: u32, n: u32| -> Vec<u32> { (0..n * 16).map(|t| (t * 13 + salt) % 3000).collect() };
    let extras = |salt: Option<&str>| crate::kv::block_hash::RequestExtras {
        lora: None,
        cache_salt: salt.map(str::to_owned),
    };
    let ids = |t: &[u32], salt: Option<&str>| -> Vec<u64> {
        h.keys(t, 16, &extras(salt)).iter().map(|k| k.0).collect()
    };
    let (t_mm, t_salt, t_plain) = (toks(1, 2), toks(2, 2), toks(3, 8));
    let foreign = vec![0xfeed_0001u64, 0xfeed_0002];
    let one_string = crate::kv::testutil::vllm_stored_event(
        &foreign,
        &t_mm,
        16,
        None,
        vec![V::Array(vec![V::from("7f3c-image-identifier")]), V::Nil],
    );
    let salted = crate::kv::testutil::vllm_stored_event(
        &ids(&t_salt, Some("tenant-B")),
        &t_salt,
        16,
        None,
        vec![V::Array(vec![V::from("tenant-B")]), V::Nil],
    );
    let plain = crate::kv::testutil::vllm_stored_event(
        &ids(&t_plain, None),
        &t_plain,
        16,
        None,
        vec![V::Nil; 8],
    );
    let batch = msgpack(&V::Array(vec![
        V::F64(1.0),
        V::Array(vec![one_string, salted, plain]),
        V::from(0),
    ]));
    let mut p = Pub::start(&[]).await;
    let s = Sub::start(&p, serde_json::json!({}), parity_settings(), 64);
    p.wait_subscribed().await;
    p.send(0, &batch).await;
    s.until("three events applied", |s| s.applied() == 3).await;
    let report = s.svc.parity.lock().get(0).cloned().expect("parity report");
    assert_eq!(
        (
            report.verdict,
            report.mismatched_blocks,
            report.unverified_blocks,
            report.checked_blocks
        ),
        (crate::kv::ingest::parity::Verdict::Ok, 0, 2, 10)
    );
    assert!(s.held().contains(&0xfeed_0001) && s.held().contains(&0xfeed_0002));
    assert_eq!(s.svc.index.blocks(0), 12);
}

/// The engine published batches 0..=4 (keys 200..=203, and key 204 stored then removed by
/// batch 4) before any subscriber existed: a subscriber started afterwards with the replay
/// port replays them on connect instead of waiting, holds exactly 200..=203, reports
/// `syncing` while the (delayed) replay runs, then the events state; a later live batch
/// continues the sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_started_after_the_engine_published_replays_what_it_holds() {
    use rmpv::Value as V;
    let mut p = Pub::start(&["--replay", "--replay-delay-ms", "600"]).await;
    for seq in 0..4u64 {
        p.send(seq, &stored_batch(&[200 + seq, 210 + seq], 16))
            .await;
    }
    let removed = |keys: &[u64]| {
        V::Array(vec![
            V::from("BlockRemoved"),
            V::Array(keys.iter().map(|k| V::from(*k)).collect()),
        ])
    };
    let batch4 = msgpack(&V::Array(vec![
        V::F64(0.0),
        V::Array(vec![removed(&[210, 211, 212, 213])]),
    ]));
    p.send(4, &batch4).await;
    let s = Sub::start(
        &p,
        serde_json::json!({"kvReplayPort": p.replay_port}),
        KvSettings::default(),
        64,
    );
    let state_now = |s: &Sub| {
        let members = s.svc.members.read();
        let (_, ep, m) = members.iter().next().expect("one endpoint");
        let par = s.svc.parity.lock().get(m).cloned();
        crate::kv::readiness::readiness(&s.svc, &members, m, ep, par.as_ref(), 20).state
    };
    assert_eq!(state_now(&s), "no_events");
    s.until("syncing", |s| state_now(s) == "syncing").await;
    assert_eq!(
        s.last_seq(),
        None,
        "nothing applied before the replay answers"
    );
    s.until("caught up", |s| state_now(s) != "syncing").await;
    assert_eq!(state_now(&s), "events_no_tokens");
    assert_eq!(s.last_seq(), Some(4));
    assert_eq!(s.held(), HashSet::from([200, 201, 202, 203]));
    assert_eq!(s.svc.index.blocks(0), 4);
    let l = EpReasonLabels {
        service: "1".into(),
        ep: "0".into(),
        reason: "ok".into(),
    };
    assert_eq!(s.state.metrics.replays.get_or_create(&l).get(), 1);
    p.wait_subscribed().await;
    p.send(5, &stored_batch(&[205], 16)).await;
    s.until("seq 5", |s| s.last_seq() == Some(5)).await;
    assert_eq!(s.held(), HashSet::from([200, 201, 202, 203, 205]));
}
