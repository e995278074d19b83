//! Per-connection limits of the fullproxy listeners: a header-read timeout, an idle keep-alive
//! timeout, a send-progress timeout, and the activity tracking they are measured on.
//!
//! Every accepted connection gets one [`Activity`], shared by its socket ([`TrackedIo`]
//! timestamps every read and write), its service (a [`RequestGuard`] per request, held until
//! the response body ends) and its [`Activity::expired`] watchdog. The watchdog fires:
//! - [`Expiry::HeaderTimeout`] when bytes arrived while no request was open (the head of a
//!   request, or anything a client sends on an otherwise idle connection) and no request head
//!   completed within [`ConnLimits::header_timeout`] of the first such byte: slowloris clients
//!   trickling headers are cut at that bound however slowly they send;
//! - [`Expiry::Idle`] when no request is open, nothing is pending and nothing was read or
//!   written for [`ConnLimits::idle_timeout`] (keep-alive connections, and connections that
//!   never sent a byte);
//! - [`Expiry::SendTimeout`] when a write to the client has been pending (the socket's send
//!   buffer full: the client stopped reading) for [`ConnLimits::send_timeout`] with no byte
//!   written meanwhile, request open or not (nginx's `send_timeout`): a client that never reads
//!   its response cannot hold the connection, and with it the backend's, forever. Also when an
//!   HTTP/2 response has waited that long for the client to take its next piece (at most
//!   [`H2_PIECE`] bytes) and no response stream of the connection took one meanwhile: an
//!   HTTP/2 client keeps its socket flowing (it answers PINGs, reads other streams) while a
//!   stream's or the connection's flow-control window stays closed, which blocks no write
//!   ([`Activity::piece_waiting`], [`Activity::piece_taken`]).
//!
//! One more HTTP/2 rule is not a close: when one stream's piece has waited
//! [`ConnLimits::send_timeout`] while other streams kept taking theirs (so the stall rule above
//! does not fire), the watchdog answers [`Expiry::StreamStall`] and the connection is drained
//! (GOAWAY: the client opens no new stream on it, the open ones finish). Once the others have
//! ended, nothing progresses and the stall rule cuts the connection, so a multiplexing client
//! cannot hold a stream it does not read by keeping new streams coming.
//!
//! [`TrackedIo`] also bounds a request head's size: once more than [`MAX_HEAD_BYTES`] were read
//! while a head is pending (bytes arrived, no request open) and the head has still not been
//! parsed, an HTTP/1 client is answered 431 and its further bytes are dropped until it closes
//! (or the header timeout ends the connection); an HTTP/2 one's next read fails and the
//! connection is closed ([`Expiry::HeadTooLarge`], [`TrackedIo::refuse_head`]). A
//! head-only bound: hyper's own (`max_buf_size`, ~400 KB) also sizes its read and write
//! buffers, which bodies and responses need large. Body bytes are read while their request is
//! open, so they never count, but for a body a refused request leaves to be drained
//! ([`Activity::linger`]).
//!
//! Otherwise a connection with a request open (head parsed, response body not finished) never
//! expires: long generations are bounded by the client and the backend, not by these timers,
//! as long as the client keeps reading. The clock is tokio's, so tests drive it with paused
//! time.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::h2scan::{self, Fed, Scan};

/// Connection limits of every mode-4 listener (env `LOXI_HEADER_TIMEOUT_MS`,
/// `LOXI_IDLE_TIMEOUT_MS`, `LOXI_SEND_TIMEOUT_MS`, `LOXI_MAX_CONNS_PER_LISTENER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Longest time from the first byte of a request head to its end. Default 10 s.
    pub header_timeout: Duration,
    /// Longest time a connection with no open request stays silent. Default 60 s.
    pub idle_timeout: Duration,
    /// Longest a write to the client may stay pending with no byte written, and an HTTP/2
    /// response may wait for the client's flow-control window with no stream of the
    /// connection taking a piece. Default 60 s.
    pub send_timeout: Duration,
    /// Open connections per listener; the listener stops accepting at this count and resumes
    /// when one closes (further clients wait in the kernel's accept backlog). Default 4096.
    pub max_conns: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            max_conns: 4096,
        }
    }
}

/// Why a connection's watchdog closed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// A request head did not complete within the header timeout.
    HeaderTimeout,
    /// No request and no traffic for the idle timeout.
    Idle,
    /// A write to the client made no progress for the send timeout.
    SendTimeout,
    /// A request head grew past [`MAX_HEAD_BYTES`] (an HTTP/1 client is answered 431, an
    /// HTTP/2 one's connection is closed).
    HeadTooLarge,
    /// An HTTP/2 stream's piece waited the send timeout while other streams progressed: not a
    /// close, the connection is drained (see the module doc).
    StreamStall,
    /// hyper refused a malformed HTTP/1 head (it answered 400, 414 or 431 itself, then
    /// closed).
    Malformed,
}

impl Expiry {
    /// Every reason, for the metric series of a listener that is removed.
    pub const ALL: [Self; 6] = [
        Self::HeaderTimeout,
        Self::Idle,
        Self::SendTimeout,
        Self::HeadTooLarge,
        Self::Malformed,
        Self::StreamStall,
    ];

    /// Metric label: `header_timeout`, `idle_timeout`, `send_timeout`, `head_too_large`,
    /// `malformed_request` or `stream_stall`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HeaderTimeout => "header_timeout",
            Self::Idle => "idle_timeout",
            Self::SendTimeout => "send_timeout",
            Self::HeadTooLarge => "head_too_large",
            Self::Malformed => "malformed_request",
            Self::StreamStall => "stream_stall",
        }
    }
}

/// The most bytes a request head may take: more read while one is pending closes the
/// connection ([`Expiry::HeadTooLarge`]). nginx's default bound is 4 × 8 KiB
/// (`large_client_header_buffers`); this leaves room for long cookies and tokens.
pub const MAX_HEAD_BYTES: u64 = 64 * 1024;

/// No head pending (value of `Activity::head_since`).
const NO_HEAD: u64 = u64::MAX;

/// No write pending (value of `Activity::blocked_since`).
const NOT_BLOCKED: u64 = u64::MAX;

/// A free slot of `Activity::waits`, and a [`RequestGuard`] whose piece does not wait.
const NOT_WAITING: u64 = u64::MAX;

/// The largest piece of an HTTP/2 response body handed to hyper at once (larger frames of the
/// backend's body are split): h2's default frame size, so that a stream taking at least this
/// much of its response per send timeout is never cut by the stall rule (see the module doc).
pub const H2_PIECE: usize = 16 * 1024;

/// One connection's activity: open requests and timestamps (milliseconds since `base`).
#[derive(Debug)]
pub struct Activity {
    base: Instant,
    limits: ConnLimits,
    /// Requests whose head was parsed and whose response has not finished.
    open: AtomicU32,
    /// Last read or write.
    last_ms: AtomicU64,
    /// First byte read while no request was open and no head was pending, or [`NO_HEAD`].
    head_since: AtomicU64,
    /// Since when a write to the client has been pending with nothing written, or
    /// [`NOT_BLOCKED`].
    blocked_since: AtomicU64,
    /// HTTP/2 response streams whose last piece waits for the client to take it (hyper polls
    /// a body again only once the client's flow-control window has room).
    waiting: AtomicU32,
    /// While `waiting` > 0: when the stall began, or the last time a response stream took a
    /// piece since (whichever is later): progress on any stream of the connection counts, as
    /// any byte written does for a blocked socket.
    stall_mark: AtomicU64,
    /// When each waiting HTTP/2 stream's piece was handed (a slot per stream, [`NOT_WAITING`]
    /// when free; at most the connection's concurrent streams): the oldest is what the drain
    /// rule ([`Expiry::StreamStall`]) measures. Empty, and never locked, on HTTP/1.
    waits: parking_lot::Mutex<Vec<u64>>,
    /// The drain rule fired: the connection was asked to finish gracefully.
    draining: AtomicBool,
    /// Bytes read since `head_since` (only the connection's task reads and writes it).
    head_bytes: AtomicU64,
    /// A refused request's body is being drained: no further head will be read.
    lingering: AtomicBool,
    /// The head bound closed the connection.
    head_too_large: AtomicBool,
    /// The listener's client traffic, which [`TrackedIo`] adds this connection's bytes to.
    traffic: Arc<crate::listen::Traffic>,
}

impl Activity {
    /// Activity of a connection accepted now, its bytes counted in a traffic record of its own.
    pub fn new(limits: ConnLimits) -> Arc<Self> {
        Self::counting(limits, Arc::default())
    }

    /// Activity of a connection accepted now on a listener whose client bytes are counted in
    /// `traffic` (see [`crate::listen::Traffic`]).
    pub fn counting(limits: ConnLimits, traffic: Arc<crate::listen::Traffic>) -> Arc<Self> {
        Arc::new(Self {
            base: Instant::now(),
            limits,
            open: AtomicU32::new(0),
            last_ms: AtomicU64::new(0),
            head_since: AtomicU64::new(NO_HEAD),
            blocked_since: AtomicU64::new(NOT_BLOCKED),
            waiting: AtomicU32::new(0),
            stall_mark: AtomicU64::new(0),
            waits: parking_lot::Mutex::new(Vec::new()),
            draining: AtomicBool::new(false),
            head_bytes: AtomicU64::new(0),
            lingering: AtomicBool::new(false),
            head_too_large: AtomicBool::new(false),
            traffic,
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    fn at(&self, ms: u64) -> Instant {
        self.base + Duration::from_millis(ms)
    }

    /// `n` bytes were read from the client.
    pub fn on_read(&self, n: usize) {
        let now = self.now_ms();
        self.last_ms.store(now, Ordering::Relaxed);
        if self.open.load(Ordering::Acquire) == 0 {
            // The first byte of a head starts the header timer (the watchdog finds it at its
            // next check, which is never later than the timer's end: see `expired`) and the
            // head's byte count; later ones add to the count (a load and a store: only this
            // connection's task reads).
            self.head_read(now, n as u64);
        }
    }

    /// `n` bytes of a pending head were read at `now`: the first starts the header timer and
    /// the head's byte count, later ones add to the count (a load and a store: only this
    /// connection's task reads).
    fn head_read(&self, now: u64, n: u64) {
        match self
            .head_since
            .compare_exchange(NO_HEAD, now, Ordering::AcqRel, Ordering::Relaxed)
        {
            Ok(_) => self.head_bytes.store(n, Ordering::Relaxed),
            Err(_) => {
                let so_far = self.head_bytes.load(Ordering::Relaxed);
                self.head_bytes.store(so_far + n, Ordering::Relaxed);
            }
        }
    }

    /// Bytes of an HTTP/2 connection were read (after its preface), holding what `fed` says
    /// of header blocks: only those start the header timer and count towards the head bound;
    /// the end of a block stops the timer (hyper then opens its request, or refuses it). The
    /// other frames are traffic (the idle timer).
    pub fn on_frames(&self, fed: Fed) {
        let now = self.now_ms();
        self.last_ms.store(now, Ordering::Relaxed);
        if fed.head_bytes > 0 {
            self.head_read(now, fed.head_bytes);
        }
        if !fed.head_open {
            self.clear_head();
        }
    }

    /// No head is pending (the bytes read so far were the HTTP/2 preface, or a header block
    /// ended).
    fn clear_head(&self) {
        if self.head_since.load(Ordering::Relaxed) != NO_HEAD {
            self.head_since.store(NO_HEAD, Ordering::Release);
            self.head_bytes.store(0, Ordering::Relaxed);
        }
    }

    /// More than [`MAX_HEAD_BYTES`] were read and the pending head is still not parsed.
    fn head_overflow(&self) -> bool {
        self.head_bytes.load(Ordering::Relaxed) > MAX_HEAD_BYTES
            && self.open.load(Ordering::Acquire) == 0
            && self.head_since.load(Ordering::Acquire) != NO_HEAD
            && !self.lingering.load(Ordering::Relaxed)
    }

    /// How many of the `read` bytes just counted were within [`MAX_HEAD_BYTES`] of the pending
    /// head's start.
    fn head_room(&self, read: usize) -> usize {
        let before = self
            .head_bytes
            .load(Ordering::Relaxed)
            .saturating_sub(read as u64);
        usize::try_from(MAX_HEAD_BYTES.saturating_sub(before)).unwrap_or(usize::MAX)
    }

    /// Whether the head bound closed the connection.
    pub fn head_was_too_large(&self) -> bool {
        self.head_too_large.load(Ordering::Relaxed)
    }

    /// Bytes were written to the client.
    pub fn on_write(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
        if self.blocked_since.load(Ordering::Relaxed) != NOT_BLOCKED {
            self.blocked_since.store(NOT_BLOCKED, Ordering::Relaxed);
        }
    }

    /// A write to the client is pending (its send buffer is full): starts the send timer,
    /// unless it already runs since an earlier pending write with no byte written since.
    pub fn on_write_blocked(&self) {
        if self.blocked_since.load(Ordering::Relaxed) == NOT_BLOCKED {
            self.blocked_since.store(self.now_ms(), Ordering::Relaxed);
        }
    }

    /// An HTTP/2 response body handed hyper a piece and waits to be polled again (the client
    /// has to take it first). Starts the stall timer when no other stream of the connection
    /// waits (the mark is stored before the count is raised, so the watchdog never pairs a
    /// raised count with an older episode's mark). Returns the stream's slot in `waits`, to
    /// give back to [`Activity::piece_taken`].
    pub fn piece_waiting(&self) -> u32 {
        let now = self.now_ms();
        if self.waiting.load(Ordering::Acquire) == 0 {
            self.stall_mark.store(now, Ordering::Relaxed);
        }
        let slot = {
            let mut waits = self.waits.lock();
            match waits.iter().position(|&t| t == NOT_WAITING) {
                Some(i) => {
                    waits[i] = now;
                    i
                }
                None => {
                    waits.push(now);
                    waits.len() - 1
                }
            }
        };
        self.waiting.fetch_add(1, Ordering::AcqRel);
        // Below the connection's concurrent streams (128): never truncated.
        slot as u32
    }

    /// A waiting HTTP/2 response body (in `slot`) was polled again (the client took its piece)
    /// or dropped (the stream ended). Taking a piece while other streams still wait is the
    /// connection's progress and moves their stall timer's start to now.
    pub fn piece_taken(&self, progressed: bool, slot: u32) {
        if progressed && self.waiting.load(Ordering::Acquire) > 1 {
            self.stall_mark.store(self.now_ms(), Ordering::Relaxed);
        }
        {
            let mut waits = self.waits.lock();
            if let Some(t) = waits.get_mut(slot as usize) {
                *t = NOT_WAITING;
            }
            while waits.last() == Some(&NOT_WAITING) {
                waits.pop();
            }
        }
        self.waiting.fetch_sub(1, Ordering::AcqRel);
    }

    /// The drain rule fired ([`Expiry::StreamStall`]): it does not fire again.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// A request head of HTTP `version` was parsed: the connection is busy until the guard
    /// drops. An HTTP/2 request's response is watched for stalls ([`RequestGuard::handed`]);
    /// an HTTP/1 one needs no watch: a client that does not take it blocks the socket's writes.
    pub fn begin(self: &Arc<Self>, version: http::Version) -> RequestGuard {
        self.open.fetch_add(1, Ordering::AcqRel);
        self.head_since.store(NO_HEAD, Ordering::Release);
        RequestGuard {
            act: Some(self.clone()),
            watched: version >= http::Version::HTTP_2,
            slot: NO_SLOT,
        }
    }

    /// The open request was refused with its body left to drain (413): the connection reads
    /// that body after the answer, then closes, and reads no further head, so the head bound
    /// no longer applies.
    pub fn linger(&self) {
        self.lingering.store(true, Ordering::Relaxed);
    }

    fn end(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
        self.open.fetch_sub(1, Ordering::AcqRel);
    }

    /// What the connection waits for now: the earliest deadline and what passing it means;
    /// `None` while a request is open, no write is pending and no HTTP/2 response waits for
    /// the client.
    fn deadline(&self) -> Option<(Instant, Expiry)> {
        let blocked = match self.blocked_since.load(Ordering::Relaxed) {
            NOT_BLOCKED => None,
            since => Some(since),
        };
        let stalled = (self.waiting.load(Ordering::Acquire) > 0)
            .then(|| self.stall_mark.load(Ordering::Relaxed));
        let send = match (blocked, stalled) {
            (Some(b), Some(s)) => Some(b.min(s)),
            (b, s) => b.or(s),
        }
        .map(|since| {
            (
                self.at(since) + self.limits.send_timeout,
                Expiry::SendTimeout,
            )
        });
        // The drain: the oldest waiting piece's age (a stream the client does not read while
        // it reads others). Never before the stall's cut, which wins a tie (a lone stuck
        // stream is cut, as before).
        let drain = (stalled.is_some() && !self.draining.load(Ordering::Relaxed))
            .then(|| self.waits.lock().iter().copied().min())
            .flatten()
            .filter(|&t| t != NOT_WAITING)
            .map(|t| (self.at(t) + self.limits.send_timeout, Expiry::StreamStall));
        let rest = self.unbusy_deadline();
        [send, drain, rest]
            .into_iter()
            .flatten()
            .min_by_key(|&(at, _)| at)
    }

    /// The header or idle deadline; `None` while a request is open.
    fn unbusy_deadline(&self) -> Option<(Instant, Expiry)> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        match self.head_since.load(Ordering::Acquire) {
            NO_HEAD => Some((
                self.at(self.last_ms.load(Ordering::Relaxed)) + self.limits.idle_timeout,
                Expiry::Idle,
            )),
            since => Some((
                self.at(since) + self.limits.header_timeout,
                Expiry::HeaderTimeout,
            )),
        }
    }

    /// Completes when the connection has outlived a limit (see the module doc), at the
    /// deadline exactly.
    ///
    /// The watchdog checks the state at the deadline it last computed, and at the latest one
    /// check period (the shortest of the three timeouts) after its previous check; nothing the
    /// connection does wakes it. That is enough: the only changes that move a deadline
    /// earlier are the first byte of a head, the start of a pending write and the start of an
    /// HTTP/2 stall, whose deadlines (that moment plus the header or send timeout) are never
    /// before the next check.
    /// Requests and reads cost the watchdog nothing (before, each head, request start and
    /// request end woke it, and with it the connection's task, to re-arm a timer: three extra
    /// polls of the connection per request).
    pub async fn expired(&self) -> Expiry {
        let period = self
            .limits
            .header_timeout
            .min(self.limits.idle_timeout)
            .min(self.limits.send_timeout);
        let sleep = tokio::time::sleep(period);
        tokio::pin!(sleep);
        loop {
            let now = Instant::now();
            let next = match self.deadline() {
                Some((at, why)) if at <= now => return why,
                Some((at, _)) => at.min(now + period),
                None => now + period,
            };
            sleep.as_mut().reset(next);
            sleep.as_mut().await;
        }
    }
}

/// Marks one request open on its connection until dropped (attach it to the response body).
#[derive(Debug)]
pub struct RequestGuard {
    act: Option<Arc<Activity>>,
    /// The response is an HTTP/2 stream whose waits for the client are watched.
    watched: bool,
    /// While the response body's last piece waits for the client: its slot in the
    /// connection's waits ([`Activity::piece_waiting`]); else [`NO_SLOT`] (a sentinel, not an
    /// `Option`: the guard stays 16 bytes in every HTTP/1 response body).
    slot: u32,
}

/// [`RequestGuard::slot`] when no piece waits (slots are below the connection's concurrent
/// streams).
const NO_SLOT: u32 = u32::MAX;

impl RequestGuard {
    /// See [`Activity::linger`].
    pub fn linger(&self) {
        if let Some(a) = &self.act {
            a.linger();
        }
    }

    /// Whether the response goes out on an HTTP/2 stream, whose waits for the client's
    /// flow-control window count towards the send timeout ([`RequestGuard::handed`],
    /// [`RequestGuard::polled`]).
    pub fn watched(&self) -> bool {
        self.watched
    }

    /// The response body was polled: a piece it handed before was taken.
    pub fn polled(&mut self) {
        let slot = std::mem::replace(&mut self.slot, NO_SLOT);
        if slot != NO_SLOT
            && let Some(a) = &self.act
        {
            a.piece_taken(true, slot);
        }
    }

    /// The response body handed a piece (not its last) to a watched stream: it waits until
    /// polled again.
    pub fn handed(&mut self) {
        if self.watched
            && self.slot == NO_SLOT
            && let Some(a) = &self.act
        {
            self.slot = a.piece_waiting();
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if let Some(a) = self.act.take() {
            if self.slot != NO_SLOT {
                a.piece_taken(false, self.slot);
            }
            a.end();
        }
    }
}

/// What a client connection's first bytes said it speaks.
#[derive(Debug)]
enum Proto {
    /// This many bytes of the HTTP/2 preface matched so far (none yet: nothing read).
    Unknown(usize),
    /// HTTP/1: every byte read while no request is open belongs to a head.
    Http1,
    /// HTTP/2: only header blocks are heads ([`h2scan`]); boxed, so an HTTP/1 connection's
    /// socket wrapper stays small.
    Http2(Box<Scan>),
}

/// A client socket that reports its reads and writes to an [`Activity`].
#[derive(Debug)]
pub struct TrackedIo<T> {
    inner: T,
    act: Arc<Activity>,
    proto: Proto,
    /// The last two bytes read (HTTP/1): a head's blank line may straddle two reads.
    tail: [u8; 2],
}

impl<T> TrackedIo<T> {
    /// Wraps `inner`.
    pub fn new(inner: T, act: Arc<Activity>) -> Self {
        Self {
            inner,
            act,
            proto: Proto::Unknown(0),
            tail: [0; 2],
        }
    }

    /// Reports the bytes `new` just read, by what the connection speaks. Until the first bytes
    /// tell (the HTTP/2 preface, or anything else), HTTP/1's rule applies, so a trickled
    /// preface is timed as a head too; the preface itself is no head once complete.
    fn read(&mut self, new: &[u8]) {
        match &mut self.proto {
            Proto::Http1 => self.act.on_read(new.len()),
            Proto::Http2(scan) => self.act.on_frames(scan.feed(new)),
            Proto::Unknown(seen) => {
                let want = &h2scan::PREFACE[*seen..];
                let m = new.len().min(want.len());
                if new[..m] != want[..m] {
                    self.proto = Proto::Http1;
                    self.act.on_read(new.len());
                } else if m < want.len() {
                    *seen += m;
                    self.act.on_read(new.len());
                } else {
                    let mut scan = Box::<Scan>::default();
                    self.act.clear_head();
                    self.act.on_frames(scan.feed(&new[m..]));
                    self.proto = Proto::Http2(scan);
                }
            }
        }
    }

    /// The pending head passed [`MAX_HEAD_BYTES`] (every read from then on comes here).
    ///
    /// Over HTTP/2 the read fails and the connection is closed: no HTTP/1 answer fits in h2's
    /// framing. Over HTTP/1, the first time, the 431 answer
    /// ([`super::error::head_too_large_answer`]) is written and the write side shut: best
    /// effort, one non-blocking write into a socket that has nothing else to send. From then on
    /// what the client still sends is read and dropped, hyper seeing none of it, until the
    /// client closes (hyper then ends the connection) or the header timeout, which still runs
    /// for this head, does: closing with the client's bytes unread would make the kernel reset
    /// the connection, and the client could lose the answer (nginx's lingering close).
    #[cold]
    #[inline(never)]
    fn refuse_head(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>>
    where
        T: AsyncRead + AsyncWrite + Unpin,
    {
        let first = !self.act.head_too_large.swap(true, Ordering::Relaxed);
        if matches!(self.proto, Proto::Http2(_)) {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("request head over {MAX_HEAD_BYTES} bytes"),
            )));
        }
        if first {
            let answer = super::error::head_too_large_answer(MAX_HEAD_BYTES);
            let wrote = Pin::new(&mut self.inner).poll_write(cx, &answer);
            self.wrote(&wrote);
            let _ = Pin::new(&mut self.inner).poll_flush(cx);
            let _ = Pin::new(&mut self.inner).poll_shutdown(cx);
        }
        let mut scratch = [0u8; 4096];
        // Bounded, so a client sending as fast as it can does not hold the thread.
        for _ in 0..64 {
            let mut dropped = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.inner).poll_read(cx, &mut dropped) {
                Poll::Ready(Ok(())) if dropped.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => self.act.traffic.read(dropped.filled().len()),
                other => return other,
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Reports a write's outcome: bytes written, or pending (the send buffer is full).
    fn wrote(&self, polled: &Poll<std::io::Result<usize>>) {
        match polled {
            Poll::Ready(Ok(n)) if *n > 0 => {
                self.act.on_write();
                self.act.traffic.written(*n);
            }
            Poll::Pending => self.act.on_write_blocked(),
            Poll::Ready(_) => {}
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for TrackedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.act.head_overflow() {
            return self.refuse_head(cx);
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        if matches!(polled, Poll::Ready(Ok(()))) && read > 0 {
            self.read(&buf.filled()[before..]);
            self.act.traffic.read(read);
            // The read that takes a pending head past the bound: refused unless the head ends
            // within it (else a head that arrives whole, in one read, would pass).
            if !matches!(self.proto, Proto::Http2(_)) {
                let data = &buf.filled()[before..];
                let tail = self.tail;
                self.tail = match data {
                    [.., a, b] => [*a, *b],
                    [b] => [tail[1], *b],
                    [] => tail,
                };
                if self.act.head_overflow()
                    && !head_ends_within(tail, data, self.act.head_room(read))
                {
                    buf.set_filled(before);
                    return self.refuse_head(cx);
                }
            }
        }
        polled
    }
}

/// Whether the first request head in `data` (a read of a pending HTTP/1 head, after `tail`,
/// the last two bytes read before it) ends, with its blank line (`\r\n\r\n`, or bare `\n\n`,
/// which httparse also takes), within the first `room` bytes of `data`.
fn head_ends_within(tail: [u8; 2], data: &[u8], room: usize) -> bool {
    let window = &data[..room.min(data.len())];
    let at = |i: usize, back: usize| -> u8 {
        match i.checked_sub(back) {
            Some(j) => window[j],
            None => tail[2 + i - back],
        }
    };
    window.iter().enumerate().any(|(i, &b)| {
        b == b'\n' && (at(i, 1) == b'\n' || (at(i, 1) == b'\r' && at(i, 2) == b'\n'))
    })
}

impl<T: AsyncWrite + Unpin> AsyncWrite for TrackedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote(&polled);
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // A TLS stream's flush writes what it buffered: pending is a blocked write too.
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        if polled.is_pending() {
            self.act.on_write_blocked();
        }
        polled
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
