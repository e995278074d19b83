//! The floor of a hyper-based HTTP/1.1 reverse proxy, for `scripts/bench-proxy.sh`: what the
//! libraries loxi's fullproxy is built on (tokio, hyper's HTTP/1.1 server and client) cost per
//! request with nothing of loxi's on top. Each client connection gets its own hyper server
//! connection and, lazily, one hyper client connection per backend (no pool, no routing
//! table, no metrics, no limits, no tracing); requests go round robin over the backends; the
//! request body is read whole (as loxi does) and the response streamed back.
//!
//! Not a product: it trusts its backends, never times out and panics on a bad flag.
//! Usage: `hyper-floor LISTEN_ADDR BACKEND_ADDR...` (worker threads from `TOKIO_WORKER_THREADS`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

/// One client connection's upstream connections, by backend index.
type Upstreams = Arc<Mutex<Vec<Option<SendRequest<Full<Bytes>>>>>>;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let listen: SocketAddr = args.next().expect("LISTEN_ADDR").parse()?;
    let backends: Vec<SocketAddr> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    anyhow::ensure!(
        !backends.is_empty(),
        "usage: hyper-floor LISTEN_ADDR BACKEND_ADDR..."
    );
    let backends = Arc::new(backends);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = TcpListener::bind(listen).await?;
        let next = Arc::new(AtomicUsize::new(0));
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let (backends, next) = (backends.clone(), next.clone());
            tokio::spawn(async move {
                let ups: Upstreams =
                    Arc::new(Mutex::new((0..backends.len()).map(|_| None).collect()));
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    forward(req, backends.clone(), next.clone(), ups.clone())
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}

/// Forwards one request to the next backend (round robin) on this connection's upstream.
async fn forward(
    req: Request<Incoming>,
    backends: Arc<Vec<SocketAddr>>,
    next: Arc<AtomicUsize>,
    ups: Upstreams,
) -> anyhow::Result<Response<Incoming>> {
    let (mut parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let i = next.fetch_add(1, Ordering::Relaxed) % backends.len();
    let mut ups = ups.lock().await;
    if ups[i].as_ref().is_none_or(|s| s.is_closed()) {
        let tcp = TcpStream::connect(backends[i]).await?;
        tcp.set_nodelay(true)?;
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
        tokio::spawn(conn);
        ups[i] = Some(send);
    }
    let send = ups[i].as_mut().expect("connected above");
    send.ready().await?;
    parts.headers.remove(hyper::header::CONNECTION);
    Ok(send
        .send_request(Request::from_parts(parts, Full::new(body)))
        .await?)
}
