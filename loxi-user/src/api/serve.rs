//! Serving the REST API's connections with bounds: no client can hold the daemon's sockets or
//! tasks by connecting and saying nothing, trickling a request, or opening connections without
//! end (before this, `axum::serve` kept a silent or slowloris connection open forever, and
//! ~15,000 idle connections held as many file descriptors, all before any token check).
//!
//! - At most [`ApiLimits::max_conns`] connections are open at once. At the cap the accept loop
//!   stops accepting until one closes (further clients wait in the kernel's backlog), as the
//!   fullproxy's listeners do.
//! - A connection must complete each request head within [`ApiLimits::header_timeout`] of
//!   starting to wait for it (hyper's HTTP/1 header-read timer, which runs from the moment the
//!   connection waits for a head: a silent connection, an idle keep-alive connection and a
//!   slowloris head are all closed at that bound).
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
use hyper_util::server::graceful::GracefulShutdown;
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

/// Serves `app` on `listener` within `limits` until `shutdown`, then waits for the open
/// connections to finish their requests (see the module doc).
pub async fn serve<L>(mut listener: L, app: Router, limits: ApiLimits, shutdown: CancellationToken)
where
    L: axum::serve::Listener,
{
    let slots = Arc::new(Semaphore::new(limits.max_conns.max(1)));
    let graceful = GracefulShutdown::new();
    let mut conns = JoinSet::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let builder = builder.http1_only();
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
        let svc = hyper::service::service_fn(move |req| {
            let mut app = app.clone();
            async move {
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
        let conn = builder.serve_connection(TokioIo::new(io), svc).into_owned();
        let conn = graceful.watch(conn);
        conns.spawn(async move {
            let _permit = permit;
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "API connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    while conns.join_next().await.is_some() {}
}

#[cfg(test)]
#[path = "serve_tests.rs"]
mod tests;
