//! Response bodies: the upstream body streamed through frame by frame (no buffering, no idle
//! timeout), carrying the request's [`Tracked`] guard so in-flight accounting ends exactly when
//! the stream ends, fails, or the client goes away (the body is dropped).
//!
//! A response is counted (`loxilb_proxy_requests_total`) and judged by the circuit breaker
//! when its body ends, not at its head ([`EndAccounting`]): a backend that dies mid-stream
//! (the upstream body fails: connection reset, chunked stream cut short, short
//! `content-length`) is an upstream error, counted as `5xx` and in
//! `loxilb_proxy_upstream_stream_errors_total`, and feeds the breaker like an origin 5xx. The
//! client's stream then ends abruptly: hyper aborts the response (HTTP/1.1: the connection
//! closes without the final chunk; HTTP/2: the stream is reset), so an SSE client sees no
//! `data: [DONE]` and its HTTP library reports an incomplete body. A client that goes away
//! first is not an upstream failure: the response counts under its status.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::sync::Arc;

use super::metrics::ProxyMetrics;
use super::pool::Pool;
use crate::health::breaker::{Breaker, Outcome};
use crate::routing::InFlightGuard;
use crate::routing::admission::Slot;

/// The body type of every proxy response (defined beside the error responses, which the
/// pool's errors build, so that this module may hold a pool without a cycle).
pub use super::error::ProxyBody;

/// How a response's end is accounted (see the module doc): its status, and the breaker that
/// judges it. Counters, histograms and the endpoint's health inputs are reached through the
/// [`Tracked`] guard's pool when the body ends, not cloned per request (each clone and drop is
/// an atomic on a cache line every worker thread shares).
#[derive(Debug)]
pub struct EndAccounting {
    /// The response status.
    pub status: http::StatusCode,
    /// The listener's passive circuit breaker.
    pub breaker: Arc<Breaker>,
    /// True once the response was found to be an SSE stream and the pool's
    /// `loxilb_ai_active_streams` was incremented (decremented when the body ends).
    pub streaming: bool,
}

/// One request's accounting: the endpoint's in-flight count (selectors read it), the
/// per-endpoint active gauge, the duration histograms (observed when the guard drops) and,
/// when set, the response's [`EndAccounting`] and the endpoint's admission [`Slot`] (released
/// when the body ends, like the rest). Holds its pool (one reference count) for the metric
/// handles and health inputs of endpoint `ep`.
#[derive(Debug)]
pub struct Tracked {
    load: InFlightGuard,
    _slot: Option<Slot>,
    pool: Arc<Pool>,
    ep: usize,
    start: Instant,
    end: Option<EndAccounting>,
}

impl Tracked {
    /// Starts accounting a request to endpoint `ep` of `pool` (whose metric handles are
    /// resolved in `metrics` now if they were not yet); the endpoint's active gauge is
    /// incremented now and decremented on drop.
    ///
    /// # Panics
    /// When `ep` is not an endpoint index of `pool` (callers pass the ladder's choice).
    pub fn new(
        load: InFlightGuard,
        pool: &Arc<Pool>,
        ep: usize,
        metrics: &ProxyMetrics,
        start: Instant,
    ) -> Self {
        pool.metrics(metrics).eps[ep].active.inc();
        Self {
            load,
            _slot: None,
            pool: pool.clone(),
            ep,
            start,
            end: None,
        }
    }

    /// Holds the endpoint's admission slot (if the gate applies) until the body ends.
    pub fn with_slot(mut self, slot: Option<Slot>) -> Self {
        self._slot = slot;
        self
    }

    /// Accounts the response by `end` when its body ends.
    pub fn with_end(mut self, end: EndAccounting) -> Self {
        self.end = Some(end);
        self
    }

    /// The response is an SSE stream: `loxilb_ai_active_streams` counts it until its body
    /// ends. No effect without a [`Self::with_end`] accounting, or when already marked.
    pub fn mark_streaming(&mut self) {
        if let Some(e) = self.end.as_mut()
            && !e.streaming
            && let Some(pm) = self.pool.resolved_metrics()
        {
            e.streaming = true;
            pm.ai.streams.inc();
        }
    }

    /// The response's end: counts it (status class, `loxilb_ai_*`) and feeds the breaker;
    /// `stream_failed` when the upstream body failed (counted as a 5xx and a stream error).
    fn settle(&mut self, stream_failed: bool) {
        self.settle_at(stream_failed, self.start.elapsed().as_secs_f64());
    }

    /// [`Self::settle`] with the request's duration so far, `elapsed` seconds.
    fn settle_at(&mut self, stream_failed: bool, elapsed: f64) {
        let (Some(e), Some(pm)) = (self.end.take(), self.pool.resolved_metrics()) else {
            return;
        };
        let ep = self.ep;
        let status = if stream_failed {
            http::StatusCode::BAD_GATEWAY
        } else {
            e.status
        };
        pm.ai.count(status.as_u16(), elapsed);
        if e.streaming {
            pm.ai.streams.dec();
        }
        let outcome = if stream_failed {
            pm.request(ep, http::StatusCode::BAD_GATEWAY);
            pm.stream_errors(ep).inc();
            tracing::warn!(
                service = self.pool.rule.id,
                ep,
                "backend failed mid-stream; the client's response is cut short"
            );
            Outcome::StreamFailed
        } else {
            pm.request(ep, e.status);
            Outcome::Status(e.status.as_u16())
        };
        let (cell, load) = (&self.pool.health[ep], &self.pool.loads[ep]);
        if e.breaker.observe(cell, load, outcome) {
            tracing::warn!(
                service = self.pool.rule.id,
                ep,
                ?outcome,
                "circuit breaker opened"
            );
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let elapsed = self.start.elapsed().as_secs_f64();
        self.settle_at(false, elapsed);
        if let Some(pm) = self.pool.resolved_metrics() {
            pm.eps[self.ep].active.dec();
            pm.duration.observe(elapsed);
        }
    }
}

/// Reads and discards `body` in the background until it ends or `within` passes, so that a
/// client still writing a body that was refused (413) reads the answer sent meanwhile instead
/// of a reset: closing a socket with unread bytes sends RST, and an HTTP client whose body
/// write then fails reports that, not the answer (nginx's lingering close does the same).
/// Bounded by time only (a byte bound would reset a client still sending past it): the bytes
/// are dropped as they arrive and nothing is kept, and a client that declares a terabyte and
/// sends nothing holds its connection no longer than `within`. Used by the fullproxy and the
/// REST API.
#[allow(
    clippy::disallowed_methods,
    reason = "bounded by `within` and owning nothing but the body: at shutdown it ends with \
              its connection"
)]
pub fn discard_for<B>(body: B, within: std::time::Duration)
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
{
    use http_body_util::BodyExt as _;
    let mut body = body;
    tokio::spawn(async move {
        let drain = async { while let Some(Ok(_)) = body.frame().await {} };
        let _ = tokio::time::timeout(within, drain).await;
    });
}

/// An upstream body with its guard. The guard is released at end of stream, on the first
/// error, or when the body is dropped (client disconnect), whichever comes first.
pub struct GuardedBody<B> {
    inner: B,
    guard: Option<Tracked>,
}

impl<B> GuardedBody<B> {
    /// Wraps `inner`.
    pub fn new(inner: B, guard: Tracked) -> Self {
        Self {
            inner,
            guard: Some(guard),
        }
    }
}

impl<B> Body for GuardedBody<B>
where
    B: Body<Data = Bytes, Error = hyper::Error> + Unpin,
{
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Err(_))) => {
                if let Some(g) = self.guard.as_mut() {
                    g.settle(true);
                }
                self.guard = None;
            }
            Poll::Ready(None) => self.guard = None,
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.guard = None,
            // The first frame: the engine finished this request's prefill.
            Poll::Ready(Some(Ok(_))) => {
                if let Some(g) = self.guard.as_mut() {
                    g.load.prefill_done();
                }
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An upstream body whose first frame was already read (the P/D decode leg waits for its first
/// byte before answering the client): that frame, then the rest as it comes.
pub struct PrimedBody<B> {
    first: Option<Frame<Bytes>>,
    inner: B,
}

impl<B> PrimedBody<B> {
    /// `first` (when some), then `inner`.
    pub fn new(first: Option<Frame<Bytes>>, inner: B) -> Self {
        Self { first, inner }
    }
}

impl<B> Body for PrimedBody<B>
where
    B: Body<Data = Bytes, Error = hyper::Error> + Unpin,
{
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(f) = self.first.take() {
            return Poll::Ready(Some(Ok(f)));
        }
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut h = self.inner.size_hint();
        if let Some(n) = self
            .first
            .as_ref()
            .and_then(Frame::data_ref)
            .map(Bytes::len)
        {
            let n = n as u64;
            let lower = h.lower() + n;
            match h.upper() {
                Some(u) if u + n == lower => h.set_exact(lower),
                Some(u) => {
                    h.set_upper(u + n);
                    h.set_lower(lower);
                }
                None => h.set_lower(lower),
            }
        }
        h
    }
}
