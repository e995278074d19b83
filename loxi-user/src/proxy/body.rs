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
use http_body_util::combinators::BoxBody;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use std::sync::Arc;

use crate::health::HealthCell;
use crate::health::breaker::{Breaker, Outcome};
use crate::routing::admission::Slot;
use crate::routing::{EndpointLoad, InFlightGuard};

/// The body type of every proxy response.
pub type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// How a response's end is accounted (see the module doc).
#[derive(Debug)]
pub struct EndAccounting {
    /// Service id and endpoint index (logs).
    pub service: u32,
    /// Endpoint index.
    pub ep: usize,
    /// The response status.
    pub status: u16,
    /// Bumped when the body ends cleanly or the client leaves: the status's class.
    pub ok: Counter,
    /// Bumped when the upstream body fails: the endpoint's `5xx` class.
    pub failed: Counter,
    /// Bumped when the upstream body fails.
    pub stream_errors: Counter,
    /// The endpoint's breaker inputs.
    pub breaker: Breaker,
    /// The endpoint's health cell.
    pub cell: Arc<HealthCell>,
    /// The endpoint's load (the breaker publishes health through it).
    pub load: Arc<EndpointLoad>,
    /// LoxiLB's `loxilb_ai_*` accounting of the response.
    pub ai: AiEnd,
}

/// One response's `loxilb_ai_*` accounting (see [`super::ai_metrics`]): the status counter
/// and the duration are settled when the body ends; the stream gauge is held while an SSE
/// response streams.
#[derive(Debug)]
pub struct AiEnd {
    /// `loxilb_ai_requests_total` of the response's status (bumped when the body ends cleanly
    /// or the client leaves).
    pub ok: Counter,
    /// `loxilb_ai_requests_total` of `502` (bumped when the upstream body fails).
    pub failed: Counter,
    /// `loxilb_ai_request_duration_seconds` of the pool's model.
    pub duration: Histogram,
    /// `loxilb_ai_active_streams` of the pool's model.
    pub streams: Gauge,
    /// True once the response was found to be an SSE stream and `streams` was incremented.
    pub streaming: bool,
}

impl AiEnd {
    fn settle(self, stream_failed: bool, elapsed_secs: f64) {
        if stream_failed {
            self.failed.inc();
        } else {
            self.ok.inc();
        }
        self.duration.observe(elapsed_secs);
        if self.streaming {
            self.streams.dec();
        }
    }
}

impl EndAccounting {
    fn settle(self, stream_failed: bool, elapsed_secs: f64) {
        self.ai.settle(stream_failed, elapsed_secs);
        let outcome = if stream_failed {
            self.failed.inc();
            self.stream_errors.inc();
            tracing::warn!(
                service = self.service,
                ep = self.ep,
                "backend failed mid-stream; the client's response is cut short"
            );
            Outcome::StreamFailed
        } else {
            self.ok.inc();
            Outcome::Status(self.status)
        };
        if self.breaker.observe(&self.cell, &self.load, outcome) {
            tracing::warn!(
                service = self.service,
                ep = self.ep,
                ?outcome,
                "circuit breaker opened"
            );
        }
    }
}

/// One request's accounting: the endpoint's in-flight count (selectors read it), the
/// per-endpoint active gauge, the duration histogram (observed when the guard drops) and,
/// when set, the response's [`EndAccounting`] and the endpoint's admission [`Slot`] (released
/// when the body ends, like the rest).
#[derive(Debug)]
pub struct Tracked {
    load: InFlightGuard,
    _slot: Option<Slot>,
    active: Gauge,
    duration: Histogram,
    start: Instant,
    end: Option<EndAccounting>,
}

impl Tracked {
    /// Starts accounting; `active` is incremented now and decremented on drop.
    pub fn new(load: InFlightGuard, active: Gauge, duration: Histogram, start: Instant) -> Self {
        active.inc();
        Self {
            load,
            _slot: None,
            active,
            duration,
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
        if let Some(ai) = self.end.as_mut().map(|e| &mut e.ai)
            && !ai.streaming
        {
            ai.streaming = true;
            ai.streams.inc();
        }
    }

    /// The upstream body failed.
    fn stream_failed(&mut self) {
        if let Some(e) = self.end.take() {
            e.settle(true, self.start.elapsed().as_secs_f64());
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(e) = self.end.take() {
            e.settle(false, self.start.elapsed().as_secs_f64());
        }
        self.active.dec();
        self.duration.observe(self.start.elapsed().as_secs_f64());
    }
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
                    g.stream_failed();
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
