//! Serving the REST API's connections with bounds: no client can hold the daemon's sockets or
//! tasks by connecting and saying nothing, trickling a request, or opening connections without
//! end (before this, `axum::serve` kept a silent or slowloris connection open forever, and
//! ~15,000 idle connections held as many file descriptors, all before any token check).
//!
//! A connection speaks HTTP/1.1 or HTTP/2, told by its first bytes (hyper-util's auto
//! builder: the HTTP/2 preface, sent by a prior-knowledge client such as `curl
//! --http2-prior-knowledge`, or after ALPN `h2` on the HTTPS API), so plain and HTTPS APIs
//! answer both alike.
//!
//! - At most [`ApiLimits::max_conns`] connections are open at once. At the cap the accept loop
//!   stops accepting until one closes (further clients wait in the kernel's backlog), as the
//!   fullproxy's listeners do.
//! - A connection must complete each request head within [`ApiLimits::header_timeout`] of
//!   starting to wait for it: a connection with no request in progress for that long is
//!   closed (a silent connection, one that never finishes its first bytes, an idle keep-alive
//!   connection and a slowloris head alike; HTTP/1 also has hyper's header-read timer, HTTP/2
//!   is told to go away, GOAWAY, and cut if it has not closed one more header timeout later).
//! - An HTTP/2 connection carries at most [`MAX_STREAMS`] requests at once.
//! - A request (body read and answer) must finish within [`ApiLimits::request_timeout`], else
//!   408 in LoxiLB's error shape: a body trickled byte by byte cannot hold a task.
//!
//! Graceful shutdown: on `shutdown` the loop stops accepting and every open connection is
//! asked to finish its request and close; the daemon's drain bounds the wait and aborts this
//! task (and with it every connection task it owns) beyond the grace period.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tower_service::Service;

use super::ApiError;

/// Connection bounds of the REST API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiLimits {
    /// Longest wait for a request head, from when the connection starts waiting for it (after
    /// accept, or after the previous response). Default 10 s.
    pub header_timeout: Duration,
    /// Longest time from a request's head to the end of its answer. Default 30 s.
    pub request_timeout: Duration,
    /// Open connections at once. Default 256.
    pub max_conns: usize,
}

impl Default for ApiLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_conns: 256,
        }
    }
}

/// Most requests in flight at once on one HTTP/2 connection of the API (its
/// `SETTINGS_MAX_CONCURRENT_STREAMS`).
pub const MAX_STREAMS: u32 = 32;

/// The requests in progress on one connection, and since when it has had none: what the idle
/// bound of [`serve`] reads.
#[derive(Debug, Clone, Copy)]
struct Busy {
    /// Requests between the service's call and the end of its answer.
    requests: usize,
    /// When `requests` last became 0 (or the connection was accepted).
    idle_since: tokio::time::Instant,
}

/// Counts one request of a connection in progress while it lives.
struct InFlight(Arc<tokio::sync::watch::Sender<Busy>>);

impl InFlight {
    fn start(busy: &Arc<tokio::sync::watch::Sender<Busy>>) -> Self {
        busy.send_modify(|b| b.requests += 1);
        Self(busy.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|b| {
            b.requests -= 1;
            if b.requests == 0 {
                b.idle_since = tokio::time::Instant::now();
            }
        });
    }
}

/// Resolves once the connection watched by `busy` has had no request in progress for `bound`.
async fn idle_for(busy: &mut tokio::sync::watch::Receiver<Busy>, bound: Duration) {
    loop {
        let b = *busy.borrow_and_update();
        if b.requests == 0 {
            tokio::select! {
                () = tokio::time::sleep_until(b.idle_since + bound) => return,
                changed = busy.changed() => if changed.is_err() {
                    return std::future::pending().await;
                },
            }
        } else if busy.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// Serves `app` on `listener` within `limits` until `shutdown`, then waits for the open
/// connections to finish their requests (see the module doc).
pub async fn serve<L>(mut listener: L, app: Router, limits: ApiLimits, shutdown: CancellationToken)
where
    L: axum::serve::Listener,
{
    let slots = Arc::new(Semaphore::new(limits.max_conns.max(1)));
    let mut conns = JoinSet::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS);
    let builder = Arc::new(builder);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            () = shutdown.cancelled() => break,
        };
        let (io, _peer) = tokio::select! {
            c = listener.accept() => c,
            () = shutdown.cancelled() => break,
        };
        // Reap finished connection tasks so the set holds only open ones.
        while conns.try_join_next().is_some() {}
        let app = app.clone();
        let timeout = limits.request_timeout;
        let (busy, mut watch) = tokio::sync::watch::channel(Busy {
            requests: 0,
            idle_since: tokio::time::Instant::now(),
        });
        let busy = Arc::new(busy);
        let svc = hyper::service::service_fn(move |req| {
            let mut app = app.clone();
            let in_flight = InFlight::start(&busy);
            async move {
                let _in_flight = in_flight;
                let answer = tokio::time::timeout(timeout, app.call(req)).await;
                Ok::<_, Infallible>(match answer {
                    Ok(Ok(resp)) => resp,
                    Ok(Err(never)) => match never {},
                    Err(_) => ApiError::with_status(
                        StatusCode::REQUEST_TIMEOUT,
                        format!("request not completed within {} s", timeout.as_secs_f64()),
                    )
                    .into_response(),
                })
            }
        });
        let (builder, shutdown, idle) = (builder.clone(), shutdown.clone(), limits.header_timeout);
        conns.spawn(async move {
            let _permit = permit;
            let conn = builder.serve_connection(TokioIo::new(io), svc);
            let mut conn = std::pin::pin!(conn);
            // Set once the connection was asked to close: by the daemon's shutdown (the
            // daemon's drain bounds the wait) or for idleness (cut one more bound later).
            let mut closing = false;
            let mut cut: Option<tokio::time::Instant> = None;
            loop {
                tokio::select! {
                    end = conn.as_mut() => {
                        if let Err(e) = end {
                            tracing::debug!(error = %e, "API connection ended with an error");
                        }
                        break;
                    }
                    () = shutdown.cancelled(), if !closing => {
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    () = idle_for(&mut watch, idle), if !closing => {
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                        cut = Some(tokio::time::Instant::now() + idle);
                    }
                    () = tokio::time::sleep_until(cut.unwrap_or_else(tokio::time::Instant::now)), if cut.is_some() => {
                        tracing::debug!("API connection cut: idle, and not closed after being told to go away");
                        break;
                    }
                }
            }
        });
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
}

#[cfg(test)]
#[path = "serve_tests.rs"]
mod tests;
