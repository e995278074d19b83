//! One KV-event subscriber task per (endpoint, DP rank): connect (retrying with backoff, so it
//! can start before the engine), subscribe to every topic, and apply each `[topic, seq (u64 BE),
//! payload]` message to the service's index with the sequence rules of [`super::replay`].
//!
//! Never dies on input: a message with the wrong frame count or seq width is counted
//! (`loxilb_kv_events_rejected_total{reason="frame"}`), an undecodable payload likewise
//! (`reason="batch"`), bad events inside a batch per event. A socket error or EOF counts one
//! `recv_error`, drops `connected` to 0 and reconnects; each successful rebuild counts one
//! `reconnect`. Only cancellation ends the task.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::events::decode_batch;
use super::index::MAX_RANK;
use super::metrics::{EpLabels, EpReasonLabels, ep_label};
use super::replay::{self, SeqAction, SeqTracker};
use super::state::{KvState, ServiceKv};
use super::zmtp::{Conn, ZmtpError};
use crate::routing::EpIdx;

/// Where one stream reads from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StreamAddr {
    /// Endpoint index in the rule.
    pub ep: EpIdx,
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
        }
    }

    fn labels(&self) -> EpLabels {
        EpLabels {
            service: self.svc.label(),
            ep: ep_label(self.addr.ep, self.addr.rank),
        }
    }

    fn set_up(&self, up: bool) {
        self.state
            .metrics
            .connected
            .get_or_create(&self.labels())
            .set(i64::from(up));
        self.svc.set_connected(self.addr.ep, self.addr.rank, up);
    }

    /// Runs until `cancel` fires.
    pub async fn run(mut self, cancel: CancellationToken) {
        self.set_up(false);
        let mut backoff = self.timing.backoff_min;
        let mut connected_before = false;
        loop {
            let conn = tokio::select! {
                _ = cancel.cancelled() => break,
                c = connect(&self.addr.publisher) => c,
            };
            let Ok(conn) = conn else {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(self.timing.backoff_max);
                continue;
            };
            if connected_before {
                self.state
                    .metrics
                    .reconnects
                    .get_or_create(&self.labels())
                    .inc();
            }
            connected_before = true;
            backoff = self.timing.backoff_min;
            self.set_up(true);
            let res = tokio::select! {
                _ = cancel.cancelled() => Ok(()),
                r = self.pump(conn) => r,
            };
            self.set_up(false);
            if cancel.is_cancelled() {
                break;
            }
            if let Err(e) = res {
                tracing::debug!(service = self.svc.id, ep = self.addr.ep, error = %e, "kv subscriber disconnected");
                self.state
                    .metrics
                    .recv_errors
                    .get_or_create(&self.labels())
                    .inc();
            }
        }
        self.set_up(false);
    }

    async fn pump(&mut self, mut conn: Conn) -> Result<(), ZmtpError> {
        loop {
            let parts = conn.recv().await?;
            match parse_message(&parts) {
                Some((seq, payload)) => self.on_batch(seq, payload).await,
                None => self.reject("frame"),
            }
        }
    }

    fn reject(&self, reason: &str) {
        let l = EpReasonLabels {
            service: self.svc.label(),
            ep: ep_label(self.addr.ep, self.addr.rank),
            reason: reason.into(),
        };
        self.state.metrics.events_rejected.get_or_create(&l).inc();
    }

    /// Applies one received batch under the sequence rules.
    pub async fn on_batch(&mut self, seq: u64, payload: &[u8]) {
        match self.seq.classify(seq) {
            SeqAction::Duplicate => return,
            SeqAction::Apply => {}
            SeqAction::Regress => {
                tracing::info!(
                    service = self.svc.id,
                    ep = self.addr.ep,
                    seq,
                    "kv publisher restarted; clearing its blocks"
                );
                self.clear();
                self.svc.parity.lock().reset(self.addr.ep);
                if seq > 0 {
                    self.repair(0, seq).await;
                }
            }
            SeqAction::Gap { from } => {
                if !self.repair(from, seq).await {
                    tracing::info!(
                        service = self.svc.id,
                        ep = self.addr.ep,
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
        self.svc.index.clear_rank(self.addr.ep, self.addr.rank);
        self.seq.reset();
        self.state.metrics.set_blocks(
            &self.svc.label(),
            self.addr.ep,
            self.svc.index.blocks(self.addr.ep),
        );
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        match decode_batch(payload) {
            Ok(batch) => {
                let rank = batch
                    .dp_rank
                    .filter(|r| *r <= MAX_RANK)
                    .unwrap_or(self.addr.rank);
                self.svc.apply_batch(
                    self.addr.ep,
                    rank,
                    &batch,
                    &self.state.settings,
                    &self.state.metrics,
                );
            }
            Err(_) => self.reject("batch"),
        }
        self.seq.applied(seq);
        if let Some(s) = self
            .svc
            .streams
            .lock()
            .get_mut(&(self.addr.ep, self.addr.rank))
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
        let got = replay::fetch(&addr, from, self.timing.replay_timeout).await;
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
                tracing::debug!(service = self.svc.id, ep = self.addr.ep, error = %e, "kv replay failed");
                false
            }
        };
        let l = EpReasonLabels {
            service: self.svc.label(),
            ep: ep_label(self.addr.ep, self.addr.rank),
            reason: outcome(ok).into(),
        };
        self.state.metrics.replays.get_or_create(&l).inc();
        ok
    }
}

async fn connect(addr: &str) -> Result<Conn, ZmtpError> {
    let mut c = Conn::connect(addr, "SUB").await?;
    c.subscribe_all().await?;
    Ok(c)
}

/// `[topic, seq (8 bytes BE), payload]` → `(seq, payload)`; `None` for any other shape.
pub fn parse_message(parts: &[Vec<u8>]) -> Option<(u64, &[u8])> {
    match parts {
        [_topic, seq, payload] => {
            Some((u64::from_be_bytes(seq.as_slice().try_into().ok()?), payload))
        }
        _ => None,
    }
}

#[cfg(test)]
#[path = "subscriber_tests.rs"]
mod tests;
