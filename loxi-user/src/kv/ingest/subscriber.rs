//! One KV-event subscriber task per (endpoint, DP rank): a `zeromq` crate SUB socket subscribed
//! to every topic (`""`) and connected to the engine's PUB, applying each `[topic, seq (u64 BE),
//! payload]` message to the service's index with the sequence rules of [`super::replay`].
//!
//! Connection life cycle: the first connect retries refused connections inside the crate
//! (`connect_forever`) for at most `backoff_max` per socket, and the task rebuilds the socket
//! with its own backoff after that, so it can start before the engine. Once connected, the crate
//! reconnects by itself (exponential backoff 100 ms .. 30 s, `zeromq::ReconnectConfig::default`,
//! not configurable) and re-sends the subscription; if it has not reconnected `backoff_max`
//! after a disconnect, the task drops the socket and builds a new one, so a restarted engine is
//! picked up within about `backoff_max` instead of up to 30 s. The socket monitor drives the metrics: each
//! `SocketEvent::Connected` sets `loxilb_kv_subscriber_connected` to 1 (and counts one
//! `reconnect` after the first), each `SocketEvent::Disconnected` (EOF, reset or a ZMTP decode
//! error) sets it to 0 and counts one `recv_error`.
//!
//! Startup replay: with a replay port (rule or endpoint `kvReplayPort`), every `Connected`
//! (the first connect and each reconnect) first asks the engine's replay ROUTER for what it
//! still buffers from the next expected seq (0 on the first connect), applies it in order
//! (duplicates dropped, a gap repaired or cleared as for live batches) and only then reads the
//! SUB socket; meanwhile the stream is marked `syncing` (`kv::readiness`). Live batches the SUB
//! socket queued during the catch-up with a seq the replay already covered are dropped as
//! duplicates for `replay_timeout` after it (later a lower seq means an engine restart again).
//! A reconnect replays from the last applied seq instead, to check that the engine answers the
//! same batch there; otherwise (or, without a replay port, when the first live batch after a
//! reconnect is not the next seq) the publisher is taken to have restarted while the stream
//! was down and the endpoint's blocks are cleared: a restarted engine's new sequence may
//! already be past the old last seq, which the sequence rules alone would take for a gap.
//! Counted in `loxilb_kv_replay_total{service,ep,reason="ok"|"failed"}` like gap repairs. The protocol is
//! vLLM's (`vllm/distributed/kv_events.py`, `ZmqEventPublisher._service_replay`): the ROUTER
//! answers every buffered batch with seq >= start, then an end marker of seq -1 (`ff×8`).
//!
//! The socket connects through a [`super::guard::Guard`], a loopback relay that closes the
//! connection when the publisher sends a frame or message over 16 MiB or 8 frames (the crate
//! would reserve whatever a frame header claims), counted `reason="frame_size"` (a replay reply
//! cut likewise, and the replay fails); the crate then reconnects.
//!
//! Never dies on input: a message with the wrong frame count or seq width is counted
//! (`loxilb_kv_events_rejected_total{reason="frame"}`), an undecodable payload likewise
//! (`reason="batch"`), bad events inside a batch per event. Only cancellation ends the task.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::channel::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket, ZmqError, ZmqMessage};

use super::events::decode_batch;
use super::guard::{Cut, Guard, MAX_MESSAGE_BYTES};
use super::replay::{self, ReplayError, Replayed, SeqAction, SeqTracker};
use crate::kv::members::Member;
use crate::kv::metrics::{EpLabels, EpReasonLabels};
use crate::kv::state::{KvState, ServiceKv};

/// Where one stream reads from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StreamAddr {
    /// The endpoint's member id in its service (`kv::members`: stable across rule updates;
    /// metric labels use its current position).
    pub member: Member,
    /// DP rank.
    pub rank: u32,
    /// Publisher `host:port` (`kvZmqPort + rank`).
    pub publisher: String,
    /// Replay ROUTER `host:port`, if the rule has `kvReplayPort`.
    pub replay: Option<String>,
}

/// Timing knobs of a stream (tests shorten them).
#[derive(Debug, Clone, Copy)]
pub struct StreamTiming {
    /// First reconnect delay; doubles up to `backoff_max`.
    pub backoff_min: Duration,
    /// Largest reconnect delay.
    pub backoff_max: Duration,
    /// Deadline of one replay exchange.
    pub replay_timeout: Duration,
    /// Missing batches tolerated without repair.
    pub keep_window: u64,
}

impl Default for StreamTiming {
    fn default() -> Self {
        Self {
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            replay_timeout: Duration::from_secs(3),
            keep_window: replay::KEEP_WINDOW,
        }
    }
}

/// A running stream's context.
pub struct Stream {
    state: Arc<KvState>,
    svc: Arc<ServiceKv>,
    addr: StreamAddr,
    timing: StreamTiming,
    seq: SeqTracker,
    ever_connected: bool,
    /// After a catch-up: the last seq it applied and until when queued live batches at or
    /// below it are duplicates, not a restart.
    replayed_through: Option<(u64, tokio::time::Instant)>,
    /// Whether a batch naming another DP rank than this stream's was reported (once).
    foreign_rank_logged: bool,
    /// Set by a reconnect (a `Connected` after the first), until the stream is shown to
    /// continue: the publisher may have restarted meanwhile, and its new sequence may already
    /// be past the old last seq (see [`Self::catch_up`] and [`Self::on_batch`]).
    reconnected: bool,
    /// XXH3 of the last applied batch's payload: a replay that continues this stream answers
    /// the same batch at that seq.
    last_digest: Option<u64>,
    /// When an oversized message was last logged as a warning ([`Self::cut`]).
    cut_warned: Option<tokio::time::Instant>,
}

impl Stream {
    /// A stream of `svc` reading `addr`.
    pub fn new(
        state: Arc<KvState>,
        svc: Arc<ServiceKv>,
        addr: StreamAddr,
        timing: StreamTiming,
    ) -> Self {
        let seq = SeqTracker::new(timing.keep_window);
        Self {
            state,
            svc,
            addr,
            timing,
            seq,
            ever_connected: false,
            replayed_through: None,
            foreign_rank_logged: false,
            reconnected: false,
            last_digest: None,
            cut_warned: None,
        }
    }

    /// Labels at the endpoint's current position; `None` once it left the rule.
    fn labels(&self) -> Option<EpLabels> {
        self.svc.ep_labels(self.addr.member, self.addr.rank)
    }

    fn reason_labels(&self, reason: &str) -> Option<EpReasonLabels> {
        self.labels().map(|l| EpReasonLabels {
            service: l.service,
            ep: l.ep,
            reason: reason.into(),
        })
    }

    fn set_up(&self, up: bool) {
        self.svc.set_connected(self.addr.member, self.addr.rank, up);
        if let Some(l) = self.labels() {
            self.state
                .metrics
                .connected
                .get_or_create(&l)
                .set(i64::from(up));
        }
    }

    /// Runs until `cancel` fires.
    pub async fn run(mut self, cancel: CancellationToken) {
        self.set_up(false);
        let mut backoff = self.timing.backoff_min;
        // Binding a loopback port fails only when the process is out of descriptors.
        let mut guard = loop {
            match Guard::start(self.addr.publisher.clone(), MAX_MESSAGE_BYTES).await {
                Ok(g) => break g,
                Err(e) => {
                    tracing::warn!(service = self.svc.id, member = self.addr.member, error = %e, "kv subscriber cannot bind its loopback relay; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(self.timing.backoff_max) => {}
                    }
                }
            }
        };
        let endpoint = guard.endpoint();
        loop {
            let opened = open(&endpoint, self.timing.backoff_max);
            let Some(opened) = self.counting_cuts(&mut guard, &cancel, opened).await else {
                break;
            };
            match opened {
                Ok((sock, events)) => {
                    backoff = self.timing.backoff_min;
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = self.serve(sock, events, &mut guard) => {}
                    }
                    self.set_up(false);
                }
                Err(e) => {
                    tracing::debug!(service = self.svc.id, member = self.addr.member, error = %e, "kv subscriber connect failed");
                    let pause = tokio::time::sleep(backoff);
                    if self
                        .counting_cuts(&mut guard, &cancel, pause)
                        .await
                        .is_none()
                    {
                        break;
                    }
                    backoff = (backoff * 2).min(self.timing.backoff_max);
                }
            }
        }
        self.svc
            .set_syncing(self.addr.member, self.addr.rank, false);
        self.set_up(false);
    }

    /// Runs `fut` to its end while counting the cuts `guard` reports (a publisher whose
    /// oversized frame follows its greeting is cut before the crate's connect completes, and
    /// again on every retry: each cut is counted and logged as in [`Self::serve`]); `None` if
    /// `cancel` fired first.
    async fn counting_cuts<F: Future>(
        &mut self,
        guard: &mut Guard,
        cancel: &CancellationToken,
        fut: F,
    ) -> Option<F::Output> {
        tokio::pin!(fut);
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return None,
                out = &mut fut => return Some(out),
                cut = guard.next_cut() => self.cut(&cut, "event"),
            }
        }
    }

    /// Reads `sock` and its monitor `events`; returns if the socket became unusable (monitor
    /// closed, or no peer left to read from) or stayed disconnected for `backoff_max` (the
    /// crate's own reconnect backs off up to 30 s and cannot be configured), so the caller
    /// rebuilds it and an engine restart costs at most about `backoff_max` of events.
    async fn serve(
        &mut self,
        mut sock: SubSocket,
        mut events: mpsc::Receiver<SocketEvent>,
        guard: &mut Guard,
    ) {
        let mut down_since: Option<tokio::time::Instant> = None;
        loop {
            let rebuild_at = down_since.map(|t| t + self.timing.backoff_max);
            tokio::select! {
                biased;
                ev = events.next() => match ev {
                    Some(ev) => {
                        match ev {
                            SocketEvent::Connected(..) => {
                                down_since = None;
                                self.reconnected |= self.ever_connected;
                                self.on_event(ev);
                                self.catch_up().await;
                                continue;
                            }
                            SocketEvent::Disconnected(_) => {
                                down_since.get_or_insert_with(tokio::time::Instant::now);
                            }
                            _ => {}
                        }
                        self.on_event(ev);
                    }
                    None => return,
                },
                cut = guard.next_cut() => self.cut(&cut, "event"),
                _ = sleep_until_some(rebuild_at) => {
                    tracing::info!(
                        service = self.svc.id,
                        member = self.addr.member,
                        "kv publisher still unreachable; rebuilding the subscriber socket"
                    );
                    return;
                }
                msg = sock.recv() => match msg {
                    Ok(msg) => self.on_message(msg).await,
                    Err(ZmqError::NoMessage) => return,
                    // The crate drops the peer, reports `Disconnected` and reconnects.
                    Err(e) => tracing::debug!(service = self.svc.id, member = self.addr.member, error = %e, "kv subscriber receive error"),
                },
            }
        }
    }

    fn on_event(&mut self, ev: SocketEvent) {
        let m = &self.state.metrics;
        match ev {
            SocketEvent::Connected(..) => {
                if self.ever_connected
                    && let Some(l) = self.labels()
                {
                    m.reconnects.get_or_create(&l).inc();
                }
                self.ever_connected = true;
                self.set_up(true);
            }
            SocketEvent::Disconnected(_) => {
                tracing::debug!(
                    service = self.svc.id,
                    member = self.addr.member,
                    "kv subscriber disconnected"
                );
                if let Some(l) = self.labels() {
                    m.recv_errors.get_or_create(&l).inc();
                }
                self.set_up(false);
            }
            _ => {}
        }
    }

    async fn on_message(&mut self, msg: ZmqMessage) {
        let parts = msg.into_vec();
        match parse_message(&parts) {
            Some((seq, payload)) => self.on_batch(seq, payload).await,
            None => self.reject("frame"),
        }
    }

    fn reject(&self, reason: &str) {
        if let Some(l) = self.reason_labels(reason) {
            self.state.metrics.events_rejected.get_or_create(&l).inc();
        }
    }

    /// An oversized message on the `socket` (`event` or `replay`) was cut: counted as rejected
    /// (`frame_size`), logged as a warning at most once a minute (a hostile publisher is cut
    /// again on every reconnect).
    fn cut(&mut self, cut: &Cut, socket: &str) {
        self.reject("frame_size");
        let now = tokio::time::Instant::now();
        if self
            .cut_warned
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(60))
        {
            tracing::debug!(service = self.svc.id, member = self.addr.member, socket, error = %cut, "kv publisher's oversized message cut again");
            return;
        }
        self.cut_warned = Some(now);
        tracing::warn!(
            service = self.svc.id,
            member = self.addr.member,
            publisher = %self.addr.publisher,
            socket,
            error = %cut,
            "kv publisher sent an oversized ZeroMQ message; connection closed, reconnecting \
             (counted as rejected, reason frame_size; repeats within a minute are logged at debug)"
        );
    }

    /// [`replay::fetch`] from `addr` with the stream's deadline; a reply cut for its size is
    /// counted as [`Self::cut`].
    async fn replay(&mut self, addr: &str, from: u64) -> Result<Vec<Replayed>, ReplayError> {
        let got = replay::fetch(addr, from, self.timing.replay_timeout).await;
        if let Err(ReplayError::Oversized(cut)) = &got {
            self.cut(cut, "replay");
        }
        got
    }

    /// Replays, from the replay socket, what the engine still buffers from the next expected
    /// seq (0 before any batch) and applies it; the stream is `syncing` meanwhile. No-op
    /// without a replay port.
    ///
    /// After a reconnect the replay starts at the last applied seq instead: the same engine
    /// answers the same batch there (compared by XXH3 of the payload), and the stream goes on.
    /// Anything else (another batch, none) means the publisher restarted while the stream was
    /// disconnected, whatever its new seq: the endpoint's blocks are cleared and the new
    /// engine's buffer is replayed from 0.
    async fn catch_up(&mut self) {
        let Some(addr) = self.addr.replay.clone() else {
            return;
        };
        self.svc.set_syncing(self.addr.member, self.addr.rank, true);
        // The duplicate filter of an earlier catch-up covers live batches queued during that
        // one; left in place it would drop this replay's batches (a restarted engine's seqs 0..
        // within `replay_timeout` of the last catch-up).
        self.replayed_through = None;
        let check = self.seq.last().filter(|_| self.reconnected);
        let from = check.or(self.seq.last().map(|l| l + 1)).unwrap_or(0);
        let mut got = self.replay(&addr, from).await;
        if let (Some(last), Ok(batches)) = (check, &got) {
            let continues = batches
                .first()
                .is_some_and(|b| b.seq == last && Some(digest(&b.payload)) == self.last_digest);
            if !continues {
                tracing::info!(
                    service = self.svc.id,
                    member = self.addr.member,
                    last,
                    "kv publisher restarted while disconnected (its replay does not continue \
                     this stream); clearing its blocks"
                );
                self.restarted();
                got = self.replay(&addr, 0).await;
            }
        }
        let ok = match got {
            Ok(batches) => {
                // Shown to continue, or cleared: live batches follow the sequence rules alone.
                self.reconnected = false;
                let from = self.seq.last().map_or(0, |l| l + 1);
                for b in batches.iter().filter(|b| b.seq >= from) {
                    if self.seq.last().is_some_and(|l| b.seq <= l) {
                        continue;
                    }
                    self.on_batch(b.seq, &b.payload).await;
                }
                tracing::info!(
                    service = self.svc.id,
                    member = self.addr.member,
                    from,
                    batches = batches.len(),
                    "kv subscriber caught up from the replay socket"
                );
                true
            }
            Err(e) => {
                tracing::info!(service = self.svc.id, member = self.addr.member, error = %e, "kv startup replay failed; following live events only");
                false
            }
        };
        let reason = if ok { "ok" } else { "failed" };
        if let Some(l) = self.reason_labels(reason) {
            self.state.metrics.replays.get_or_create(&l).inc();
        }
        self.replayed_through = self
            .seq
            .last()
            .map(|l| (l, tokio::time::Instant::now() + self.timing.replay_timeout));
        self.svc
            .set_syncing(self.addr.member, self.addr.rank, false);
    }

    /// The publisher restarted: its blocks are gone, and so is what parity learned of it.
    fn restarted(&mut self) {
        self.clear();
        self.svc.parity.lock().reset(self.addr.member);
    }

    /// Applies one received batch under the sequence rules.
    pub async fn on_batch(&mut self, seq: u64, payload: &[u8]) {
        if let Some((through, until)) = self.replayed_through {
            if seq <= through && tokio::time::Instant::now() < until {
                return;
            }
            self.replayed_through = None;
        }
        // The first live batch after a reconnect that no replay checked: anything but the next
        // seq (or a lower one, a restart below) may be a restarted publisher whose new
        // sequence already passed the old last seq; the events in between are lost either way,
        // and the blocks cannot be trusted.
        if self.reconnected
            && let Some(last) = self.seq.last()
            && seq != last
        {
            self.reconnected = false;
            if seq > last + 1 {
                tracing::info!(
                    service = self.svc.id,
                    member = self.addr.member,
                    seq,
                    last,
                    "kv stream resumed after a reconnect with a gap (the publisher may have \
                     restarted); clearing its blocks"
                );
                self.restarted();
            }
        }
        match self.seq.classify(seq) {
            SeqAction::Duplicate => return,
            SeqAction::Apply => {}
            SeqAction::Regress => {
                tracing::info!(
                    service = self.svc.id,
                    member = self.addr.member,
                    seq,
                    "kv publisher restarted; clearing its blocks"
                );
                self.restarted();
                if seq > 0 {
                    self.repair(0, seq).await;
                }
            }
            SeqAction::Gap { from } => {
                if !self.repair(from, seq).await {
                    tracing::info!(
                        service = self.svc.id,
                        member = self.addr.member,
                        from,
                        seq,
                        "kv event gap not repairable; clearing"
                    );
                    self.clear();
                }
            }
        }
        self.apply(seq, payload);
    }

    fn clear(&mut self) {
        self.svc.index.clear_rank(self.addr.member, self.addr.rank);
        self.seq.reset();
        // Seqs the cleared stream replayed say nothing about the next one's.
        self.replayed_through = None;
        self.last_digest = None;
        if let Some(ep) = self.svc.ep_idx(self.addr.member) {
            self.state.metrics.set_blocks(
                &self.svc.label(),
                ep,
                self.svc.index.blocks(self.addr.member),
            );
        }
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        match decode_batch(payload) {
            Ok(batch) => {
                // Filed under the rank of the socket it came from, whatever the batch names:
                // each vLLM DP rank publishes on its own port (`kvZmqPort + rank`), and an
                // engine started as `--data-parallel-rank 3` behind its own endpoint stamps 3
                // into every batch of its rank-0 stream. Trusting the payload kept its blocks
                // out of reach of this stream's restart and gap clears, and let a publisher
                // spread blocks over ranks no stream owns (each with its own block cap).
                if let Some(named) = batch.dp_rank.filter(|r| *r != self.addr.rank)
                    && !self.foreign_rank_logged
                {
                    self.foreign_rank_logged = true;
                    tracing::info!(
                        service = self.svc.id,
                        member = self.addr.member,
                        stream_rank = self.addr.rank,
                        batch_rank = named,
                        "KV event batches name another DP rank than their socket's; filed under \
                         the socket's rank (kvZmqPort + rank)"
                    );
                }
                self.svc.apply_batch(
                    self.addr.member,
                    self.addr.rank,
                    &batch,
                    &self.state.metrics,
                );
            }
            Err(_) => self.reject("batch"),
        }
        self.seq.applied(seq);
        self.last_digest = Some(digest(payload));
        if let Some(s) = self
            .svc
            .streams
            .lock()
            .get_mut(&(self.addr.member, self.addr.rank))
        {
            s.last_seq = Some(seq);
        }
    }

    /// Replays `[from, until)` and applies it in order; true when every missing batch came back.
    async fn repair(&mut self, from: u64, until: u64) -> bool {
        let outcome = |ok: bool| if ok { "ok" } else { "failed" };
        let Some(addr) = self.addr.replay.clone() else {
            return false;
        };
        let got = self.replay(&addr, from).await;
        let ok = match got {
            Ok(batches) => {
                let mut want = from;
                for b in batches.iter().filter(|b| b.seq >= from && b.seq < until) {
                    if b.seq != want {
                        break;
                    }
                    self.apply(b.seq, &b.payload);
                    want += 1;
                }
                want == until
            }
            Err(e) => {
                tracing::debug!(service = self.svc.id, member = self.addr.member, error = %e, "kv replay failed");
                false
            }
        };
        if let Some(l) = self.reason_labels(outcome(ok)) {
            self.state.metrics.replays.get_or_create(&l).inc();
        }
        ok
    }
}

/// XXH3 of a batch payload.
fn digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

/// Sleeps until `at`, or forever when `None`.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A SUB socket subscribed to every topic, connected to `endpoint` (the stream's
/// [`Guard`]), and its monitor (opened before connecting, so it sees the first `Connected`).
/// The publisher's handshake must complete within `connect_timeout`.
async fn open(
    endpoint: &str,
    connect_timeout: Duration,
) -> Result<(SubSocket, mpsc::Receiver<SocketEvent>), ZmqError> {
    let mut opts = SocketOptions::default();
    opts.connect_timeout(connect_timeout);
    let mut sock = SubSocket::with_options(opts);
    let events = sock.monitor();
    sock.subscribe("").await?;
    sock.connect(endpoint).await?;
    Ok((sock, events))
}

/// `[topic, seq (8 bytes BE), payload]` → `(seq, payload)`; `None` for any other shape.
pub fn parse_message(parts: &[Bytes]) -> Option<(u64, &[u8])> {
    match parts {
        [_topic, seq, payload] => {
            Some((u64::from_be_bytes(seq.as_ref().try_into().ok()?), payload))
        }
        _ => None,
    }
}

#[cfg(test)]
#[path = "subscriber_tests.rs"]
mod tests;
