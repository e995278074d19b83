//! One listener per distinct mode-4 `externalIP:port`: accepts TCP connections and serves them
//! with hyper-util's auto builder (HTTP/1.1 keep-alive and HTTP/2 prior knowledge). On close it
//! stops accepting, asks every connection to finish gracefully and waits up to the grace period.

use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::handler::Handler;
use super::pool::PoolTable;

/// A running listener.
pub struct Listener {
    /// The pools it serves; replace to reconfigure.
    pub table: Arc<ArcSwap<PoolTable>>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl Listener {
    /// Binds `addr` and starts serving `handler`.
    pub async fn bind(addr: SocketAddr, handler: Arc<Handler>) -> std::io::Result<Self> {
        let tcp = TcpListener::bind(addr).await?;
        Ok(Self::serve(addr, tcp, handler))
    }

    /// Starts serving `handler` on `tcp`, already bound to `addr`.
    pub fn serve(addr: SocketAddr, tcp: TcpListener, handler: Arc<Handler>) -> Self {
        let cancel = CancellationToken::new();
        let table = handler.table.clone();
        let task = tokio::spawn(accept_loop(tcp, handler, cancel.clone()));
        tracing::info!(%addr, "fullproxy listener open");
        Self {
            table,
            cancel,
            task,
        }
    }

    /// Stops accepting and returns a future that completes when in-flight requests finished.
    pub fn close(self) -> JoinHandle<()> {
        self.cancel.cancel();
        self.task
    }
}

async fn accept_loop(tcp: TcpListener, handler: Arc<Handler>, cancel: CancellationToken) {
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            accepted = tcp.accept() => match accepted {
                Ok((stream, peer)) => serve(&builder, &graceful, stream, peer, handler.clone()),
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
        }
    }
    drop(tcp);
    let grace = handler.ctx.config.shutdown_grace;
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            ?grace,
            "listener closed with requests still in flight after the grace period"
        );
    }
}

fn serve(
    builder: &auto::Builder<TokioExecutor>,
    graceful: &GracefulShutdown,
    stream: TcpStream,
    peer: SocketAddr,
    handler: Arc<Handler>,
) {
    let _ = stream.set_nodelay(true);
    let svc = service_fn(move |req| handler.clone().handle(req, peer));
    let conn = builder
        .serve_connection(TokioIo::new(stream), svc)
        .into_owned();
    let conn = graceful.watch(conn);
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, %peer, "connection ended with error");
        }
    });
}
