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
//!   its response cannot hold the connection, and with it the backend's, forever.
//!
//! [`TrackedIo`] also bounds a request head's size: once more than [`MAX_HEAD_BYTES`] were read
//! while a head is pending (bytes arrived, no request open) and the head has still not been
//! parsed, the next read fails, and the connection is closed ([`Expiry::HeadTooLarge`]). A
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

/// Connection limits of every mode-4 listener (env `LOXI_HEADER_TIMEOUT_MS`,
/// `LOXI_IDLE_TIMEOUT_MS`, `LOXI_SEND_TIMEOUT_MS`, `LOXI_MAX_CONNS_PER_LISTENER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Longest time from the first byte of a request head to its end. Default 10 s.
    pub header_timeout: Duration,
    /// Longest time a connection with no open request stays silent. Default 60 s.
    pub idle_timeout: Duration,
    /// Longest a write to the client may stay pending with no byte written. Default 60 s.
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
    /// A request head grew past [`MAX_HEAD_BYTES`] (the connection is closed unanswered).
    HeadTooLarge,
    /// hyper refused a malformed HTTP/1 head (it answered 400, 414 or 431 itself, then
    /// closed).
    Malformed,
}

impl Expiry {
    /// Metric label: `header_timeout`, `idle_timeout`, `send_timeout`, `head_too_large` or
    /// `malformed_request`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HeaderTimeout => "header_timeout",
            Self::Idle => "idle_timeout",
            Self::SendTimeout => "send_timeout",
            Self::HeadTooLarge => "head_too_large",
            Self::Malformed => "malformed_request",
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
            let n = n as u64;
            match self.head_since.compare_exchange(
                NO_HEAD,
                now,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => self.head_bytes.store(n, Ordering::Relaxed),
                Err(_) => {
                    let so_far = self.head_bytes.load(Ordering::Relaxed);
                    self.head_bytes.store(so_far + n, Ordering::Relaxed);
                }
            }
        }
    }

    /// More than [`MAX_HEAD_BYTES`] were read and the pending head is still not parsed.
    fn head_overflow(&self) -> bool {
        self.head_bytes.load(Ordering::Relaxed) > MAX_HEAD_BYTES
            && self.open.load(Ordering::Acquire) == 0
            && self.head_since.load(Ordering::Acquire) != NO_HEAD
            && !self.lingering.load(Ordering::Relaxed)
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

    /// A request head was parsed: the connection is busy until the guard drops.
    pub fn begin(self: &Arc<Self>) -> RequestGuard {
        self.open.fetch_add(1, Ordering::AcqRel);
        self.head_since.store(NO_HEAD, Ordering::Release);
        RequestGuard {
            act: Some(self.clone()),
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
    /// `None` while a request is open and no write is pending.
    fn deadline(&self) -> Option<(Instant, Expiry)> {
        let send = match self.blocked_since.load(Ordering::Relaxed) {
            NOT_BLOCKED => None,
            since => Some((
                self.at(since) + self.limits.send_timeout,
                Expiry::SendTimeout,
            )),
        };
        let rest = self.unbusy_deadline();
        match (send, rest) {
            (Some(s), Some(r)) => Some(if s.0 <= r.0 { s } else { r }),
            (s, r) => s.or(r),
        }
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
    /// earlier are the first byte of a head and the start of a pending write, whose deadlines
    /// (that moment plus the header or send timeout) are never before the next check.
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
}

impl RequestGuard {
    /// See [`Activity::linger`].
    pub fn linger(&self) {
        if let Some(a) = &self.act {
            a.linger();
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if let Some(a) = self.act.take() {
            a.end();
        }
    }
}

/// A client socket that reports its reads and writes to an [`Activity`].
#[derive(Debug)]
pub struct TrackedIo<T> {
    inner: T,
    act: Arc<Activity>,
}

impl<T> TrackedIo<T> {
    /// Wraps `inner`.
    pub fn new(inner: T, act: Arc<Activity>) -> Self {
        Self { inner, act }
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

impl<T: AsyncRead + Unpin> AsyncRead for TrackedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.act.head_overflow() {
            self.act.head_too_large.store(true, Ordering::Relaxed);
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("request head over {MAX_HEAD_BYTES} bytes"),
            )));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        if matches!(polled, Poll::Ready(Ok(()))) && read > 0 {
            self.act.on_read(read);
            self.act.traffic.read(read);
        }
        polled
    }
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
