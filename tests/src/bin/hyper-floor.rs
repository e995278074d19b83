//! The floor of a hyper-based HTTP/1.1 reverse proxy, for `scripts/bench-proxy.sh`: what the
//! libraries loxi's fullproxy is built on (tokio, hyper's HTTP/1.1 server and client) cost per
//! request with nothing of loxi's on top. Each client connection gets its own hyper server
//! connection and, lazily, one hyper client connection per backend (no pool, no routing
//! table, no metrics, no limits, no tracing); requests go round robin over the backends; the
//! request body is read whole (as loxi does) and the response streamed back.
//!
//! Threads as loxi's fullproxy with its connection workers (`--proxy-workers`): one thread per
//! worker, each a single-threaded tokio runtime that serves its connections to their end (here
//! each worker accepts on its own `SO_REUSEPORT` socket).
//!
//! Not a product: it trusts its backends, never times out and panics on a bad flag.
//! Usage: `hyper-floor LISTEN_ADDR BACKEND_ADDR...` (workers: `TOKIO_WORKER_THREADS`, else one
//! per CPU).

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
    let workers = match std::env::var("TOKIO_WORKER_THREADS") {
        Ok(n) => n.parse()?,
        Err(_) => std::thread::available_parallelism()?.get(),
    };
    let threads: Vec<_> = (0..workers)
        .map(|_| {
            let backends = backends.clone();
            std::thread::spawn(move || -> anyhow::Result<()> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    // One socket per worker (SO_REUSEPORT: the kernel spreads connections).
                    let s = socket2::Socket::new(
                        socket2::Domain::for_address(listen),
                        socket2::Type::STREAM,
                        None,
                    )?;
                    s.set_reuse_port(true)?;
                    s.set_reuse_address(true)?;
                    s.set_nonblocking(true)?;
                    s.bind(&listen.into())?;
                    s.listen(1024)?;
                    serve(TcpListener::from_std(s.into())?, backends).await
                })
            })
        })
        .collect();
    for t in threads {
        t.join().expect("worker thread")?;
    }
    Ok(())
}

/// Accepts and serves connections on the calling worker's runtime, forever.
async fn serve(listener: TcpListener, backends: Arc<Vec<SocketAddr>>) -> anyhow::Result<()> {
    let next = Arc::new(AtomicUsize::new(0));
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let (backends, next) = (backends.clone(), next.clone());
        tokio::spawn(async move {
            let ups: Upstreams = Arc::new(Mutex::new((0..backends.len()).map(|_| None).collect()));
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                forward(req, backends.clone(), next.clone(), ups.clone())
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
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
