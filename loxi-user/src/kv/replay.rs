//! Sequence tracking per (endpoint, rank) stream and the vLLM replay client.
//!
//! Sequence rules (DESIGN.md "KV path"): the next expected seq is `last + 1`. A forward gap of
//! at most [`KEEP_WINDOW`] missing batches keeps state; a bigger gap, or a regression (seq at or
//! below the last one, except an exact duplicate of a non-zero seq: the engine restarted and
//! numbers from 0 again), asks the engine's replay socket for the missing batches. If replay is
//! unavailable or incomplete the stream's blocks are cleared (a regression always clears: the
//! restarted engine's cache is empty).
//!
//! Replay protocol (`../shared/golden/README.md`): a DEALER sends `[b"", start_seq (8 bytes
//! BE)]`; the ROUTER answers one message per buffered batch, `[b"", topic, seq, payload]` (vLLM
//! 0.32) or `[b"", seq, payload]` (older), then the end marker whose seq frame is `ff×8`
//! (`[b"", b"", ff×8, b""]` or `[b"", ff×8, b""]`).

use std::time::Duration;

use super::zmtp::{Conn, ZmtpError};

/// Missing batches tolerated without repair (LoxiLB's 64-event window).
pub const KEEP_WINDOW: u64 = 64;

/// What to do with an arriving batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqAction {
    /// In order, a tolerated gap, or the first batch: apply it.
    Apply,
    /// Already applied (duplicate): drop it.
    Duplicate,
    /// `missing` batches lost beyond the window: repair from `from`, then apply.
    Gap {
        /// First missing seq.
        from: u64,
    },
    /// The seq went backwards: the engine restarted.
    Regress,
}

/// Last applied seq of one stream.
#[derive(Debug, Clone, Copy)]
pub struct SeqTracker {
    last: Option<u64>,
    window: u64,
}

impl Default for SeqTracker {
    fn default() -> Self {
        Self::new(KEEP_WINDOW)
    }
}

impl SeqTracker {
    /// A tracker tolerating `window` missing batches ([`KEEP_WINDOW`] in production).
    pub fn new(window: u64) -> Self {
        Self { last: None, window }
    }

    /// Classifies `seq` (does not record it; call [`Self::applied`] after applying).
    pub fn classify(&self, seq: u64) -> SeqAction {
        let Some(last) = self.last else {
            return SeqAction::Apply;
        };
        if seq == last && seq != 0 {
            return SeqAction::Duplicate;
        }
        if seq <= last {
            return SeqAction::Regress;
        }
        let missing = seq - last - 1;
        if missing <= self.window {
            SeqAction::Apply
        } else {
            SeqAction::Gap { from: last + 1 }
        }
    }

    /// Records that `seq` was applied.
    pub fn applied(&mut self, seq: u64) {
        self.last = Some(seq);
    }

    /// Forgets the position (after a clear).
    pub fn reset(&mut self) {
        self.last = None;
    }

    /// The last applied seq.
    pub fn last(&self) -> Option<u64> {
        self.last
    }
}

/// A replayed batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// Its sequence number.
    pub seq: u64,
    /// Its msgpack payload.
    pub payload: Vec<u8>,
}

/// Replay failures.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Socket trouble.
    #[error("replay socket: {0}")]
    Zmtp(#[from] ZmtpError),
    /// No end marker within the deadline.
    #[error("replay timed out")]
    Timeout,
    /// A reply had an unexpected shape.
    #[error("replay reply with {0} frames")]
    Shape(usize),
}

/// Asks the ROUTER at `addr` for every buffered batch from `start`; returns them in the order
/// received, ending at the end marker. Deadline `timeout` for the whole exchange.
pub async fn fetch(
    addr: &str,
    start: u64,
    timeout: Duration,
) -> Result<Vec<Replayed>, ReplayError> {
    tokio::time::timeout(timeout, fetch_inner(addr, start))
        .await
        .map_err(|_| ReplayError::Timeout)?
}

async fn fetch_inner(addr: &str, start: u64) -> Result<Vec<Replayed>, ReplayError> {
    let mut conn = Conn::connect(addr, "DEALER").await?;
    conn.send(&[b"", &start.to_be_bytes()]).await?;
    let mut out = Vec::new();
    loop {
        let parts = conn.recv().await?;
        let body = match parts.split_first() {
            Some((empty, rest)) if empty.is_empty() => rest,
            _ => return Err(ReplayError::Shape(parts.len())),
        };
        let (seq, payload) = match body {
            [seq, payload] => (seq, payload),
            [_topic, seq, payload] => (seq, payload),
            _ => return Err(ReplayError::Shape(parts.len())),
        };
        let seq: [u8; 8] = seq
            .as_slice()
            .try_into()
            .map_err(|_| ReplayError::Shape(parts.len()))?;
        let seq = u64::from_be_bytes(seq);
        if seq == u64::MAX {
            return Ok(out);
        }
        out.push(Replayed {
            seq,
            payload: payload.clone(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(last: u64) -> SeqTracker {
        let mut t = SeqTracker::default();
        t.applied(last);
        t
    }

    #[test]
    fn sequence_classification_matches_window_rules() {
        assert_eq!(SeqTracker::default().classify(17), SeqAction::Apply);
        assert_eq!(at(4).classify(5), SeqAction::Apply);
        assert_eq!(at(4).classify(5 + 64), SeqAction::Apply);
        assert_eq!(at(4).classify(6 + 64), SeqAction::Gap { from: 5 });
        assert_eq!(at(500).classify(0), SeqAction::Regress);
        assert_eq!(at(500).classify(500), SeqAction::Duplicate);
        assert_eq!(at(0).classify(0), SeqAction::Regress);
    }
}
