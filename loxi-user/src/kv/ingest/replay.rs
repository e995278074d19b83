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

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqError, ZmqMessage};

use super::guard::{Cut, Guard, MAX_MESSAGE_BYTES};

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
    /// Socket trouble (connect, handshake, send or receive; from the `zeromq` crate).
    #[error("replay socket: {0}")]
    Zmq(#[from] ZmqError),
    /// No end marker within the deadline.
    #[error("replay timed out")]
    Timeout,
    /// The replies went past [`MAX_REPLAY_BATCHES`] or [`MAX_REPLAY_BYTES`] before the end
    /// marker: a peer streaming without end would otherwise make loxi buffer without bound.
    #[error(
        "replay over its bound ({batches} batches, {bytes} payload bytes; at most {MAX_REPLAY_BATCHES} and {MAX_REPLAY_BYTES})"
    )]
    TooLarge {
        /// Batches received so far.
        batches: usize,
        /// Payload bytes received so far.
        bytes: usize,
    },
    /// A reply frame or message over [`MAX_MESSAGE_BYTES`]; the connection was closed before
    /// it reached the socket.
    #[error("replay reply: {0}")]
    Oversized(Cut),
    /// A reply had an unexpected shape.
    #[error("replay reply with {0} frames")]
    Shape(usize),
}

/// Most batches one replay may return (vLLM's publisher buffers 10,000 steps by default).
pub const MAX_REPLAY_BATCHES: usize = 100_000;

/// Most payload bytes one replay may return.
pub const MAX_REPLAY_BYTES: usize = 128 << 20;

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
    let mut guard = Guard::start(addr.to_owned(), MAX_MESSAGE_BYTES)
        .await
        .map_err(ZmqError::from)?;
    let mut sock = DealerSocket::new();
    sock.connect(&guard.endpoint()).await?;
    let mut req = ZmqMessage::from(Bytes::new());
    req.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
    sock.send(req).await?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    loop {
        let reply = tokio::select! {
            r = sock.recv() => r?,
            cut = guard.next_cut() => return Err(ReplayError::Oversized(cut)),
        };
        match parse_reply(&reply.into_vec())? {
            Some(batch) => {
                bytes = bytes.saturating_add(batch.payload.len());
                out.push(batch);
                if out.len() > MAX_REPLAY_BATCHES || bytes > MAX_REPLAY_BYTES {
                    return Err(ReplayError::TooLarge {
                        batches: out.len(),
                        bytes,
                    });
                }
            }
            None => return Ok(out),
        }
    }
}

/// One ROUTER reply `[b"", (topic,) seq, payload]` → `Some(batch)`, `None` for the end marker
/// (seq `ff×8`), [`ReplayError::Shape`] for anything else.
fn parse_reply(parts: &[Bytes]) -> Result<Option<Replayed>, ReplayError> {
    let shape = || ReplayError::Shape(parts.len());
    let (seq, payload) = match parts {
        [empty, seq, payload] | [empty, _, seq, payload] if empty.is_empty() => (seq, payload),
        _ => return Err(shape()),
    };
    let seq = u64::from_be_bytes(seq.as_ref().try_into().map_err(|_| shape())?);
    Ok((seq != u64::MAX).then(|| Replayed {
        seq,
        payload: payload.to_vec(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ROUTER that answers the replay request with 1 MiB batches and never the end marker:
    /// the fetch stops at its byte bound (128 batches fit, the 129th is over), long before the
    /// deadline, instead of buffering whatever the peer sends until then.
    #[tokio::test]
    #[allow(
        clippy::disallowed_methods,
        reason = "the test's ROUTER peer; aborted at the end of the test"
    )]
    async fn a_replay_that_never_ends_is_cut_at_its_bound() {
        use zeromq::{RouterSocket, Socket as _, SocketRecv as _, SocketSend as _};
        let mut router = RouterSocket::new();
        let ep = router.bind("tcp://127.0.0.1:0").await.expect("bind");
        let addr = ep.to_string().trim_start_matches("tcp://").to_string();
        let server = tokio::spawn(async move {
            let req = router.recv().await.expect("request");
            let id = req.get(0).expect("identity").clone();
            let payload = Bytes::from(vec![0u8; 1 << 20]);
            for seq in 0u64.. {
                let mut m = ZmqMessage::from(id.clone());
                m.push_back(Bytes::new());
                m.push_back(Bytes::from_static(b"kv"));
                m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                m.push_back(payload.clone());
                if router.send(m).await.is_err() {
                    break;
                }
            }
        });
        let err = fetch(&addr, 0, Duration::from_secs(30))
            .await
            .expect_err("cut at the bound");
        server.abort();
        assert!(
            matches!(err, ReplayError::TooLarge { batches: 129, bytes } if bytes > MAX_REPLAY_BYTES),
            "{err}"
        );
    }

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

    #[test]
    fn replies_of_both_layouts_parse_and_bad_shapes_are_named() {
        let b = |v: &[u8]| Bytes::copy_from_slice(v);
        let seq7 = b(&7u64.to_be_bytes());
        let end = b(&[0xff; 8]);
        let want = Some(Replayed {
            seq: 7,
            payload: b"p".to_vec(),
        });
        let three = parse_reply(&[b(b""), b(b"kv"), seq7.clone(), b(b"p")]).expect("topic layout");
        assert_eq!(three, want);
        let two = parse_reply(&[b(b""), seq7.clone(), b(b"p")]).expect("older layout");
        assert_eq!(two, want);
        let end3 = parse_reply(&[b(b""), b(b""), end.clone(), b(b"")]).expect("end marker");
        assert_eq!(end3, None);
        assert_eq!(
            parse_reply(&[b(b""), end, b(b"")]).expect("end marker"),
            None
        );
        for bad in [
            vec![b(b"x"), seq7.clone(), b(b"p")],
            vec![b(b""), b(&[0, 7]), b(b"p")],
            vec![b(b""), seq7],
        ] {
            let err = parse_reply(&bad).expect_err("bad shape");
            assert!(
                matches!(err, ReplayError::Shape(n) if n == bad.len()),
                "{err}"
            );
        }
    }
}
