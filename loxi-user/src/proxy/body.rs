//! Response bodies: the upstream body streamed through frame by frame (no buffering, no idle
//! timeout), carrying the request's [`Tracked`] guard so in-flight accounting ends exactly when
//! the stream ends, fails, or the client goes away (the body is dropped).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::BoxBody;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::routing::InFlightGuard;

/// The body type of every proxy response.
pub type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// One request's accounting: the endpoint's in-flight count (selectors read it), the
/// per-endpoint active gauge, and the duration histogram (observed when the guard drops).
#[derive(Debug)]
pub struct Tracked {
    _load: InFlightGuard,
    active: Gauge,
    duration: Histogram,
    start: Instant,
}

impl Tracked {
    /// Starts accounting; `active` is incremented now and decremented on drop.
    pub fn new(load: InFlightGuard, active: Gauge, duration: Histogram, start: Instant) -> Self {
        active.inc();
        Self {
            _load: load,
            active,
            duration,
            start,
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
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
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.guard = None,
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.guard = None,
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
