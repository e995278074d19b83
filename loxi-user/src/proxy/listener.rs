//! One listener per distinct mode-4 `externalIP:port`: accepts TCP connections and serves them
//! with hyper-util's auto builder (HTTP/1.1 keep-alive and HTTP/2: prior knowledge on
//! cleartext, ALPN `h2` over TLS). When its rules have `security: 1` each connection first
//! completes a TLS handshake (certificate by SNI, [`super::tls`]; bounded by
//! [`super::tls::HANDSHAKE_TIMEOUT`]), then takes the same request path as a cleartext one. On close it
//! stops accepting, asks every connection to finish gracefully and waits up to the grace period.
//!
//! The accept loop runs on the runtime that opened the listener; each accepted connection is
//! then served by the least busy connection worker when the proxy has them
//! ([`super::workers`]), else where it was accepted.
//!
//! Limits (see [`super::conn`] and [`super::valve`]):
//! - at most [`ConnLimits::max_conns`] open connections: at the cap the listener accepts one
//!   more connection and holds it until a slot frees (counted in
//!   `loxilb_proxy_connections_queued_total`); later clients wait in the kernel backlog;
//! - each connection is closed by its watchdog at the header-read or idle timeout
//!   (`loxilb_proxy_connections_closed_total{reason}`);
//! - each request must pass the global valve first, else 429 `pd_overloaded`
//!   (`loxilb_pd_admission_shed_total{reason="total_inflight"}`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use arc_swap::ArcSwap;
use bytes::{Bytes, BytesMut};
use futures::task::AtomicWaker;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::listen::Traffic;
use crate::listen::plain::{PlainHttp, plain_http};

use super::body::ProxyBody;
use super::conn::{Activity, ConnLimits, Expiry, H2_PIECE, RequestGuard, TrackedIo};
use super::error::ProxyError;
use super::handler::Handler;
use super::pool::PoolTable;
use super::tls::ClientTls;
use super::valve::{Admitted, Valve};

/// A running listener.
pub struct Listener {
    /// The pools it serves; replace to reconfigure.
    pub table: Arc<ArcSwap<PoolTable>>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl Listener {
    /// Binds `addr` and starts serving `handler`; every request passes `valve` first.
    #[allow(
        clippy::disallowed_methods,
        reason = "the accept loop's JoinHandle is the Listener's; close() returns it to be awaited"
    )]
    pub async fn bind(
        addr: SocketAddr,
        handler: Arc<Handler>,
        valve: Arc<Valve>,
    ) -> std::io::Result<Self> {
        let tcp = TcpListener::bind(addr).await?;
        Ok(Self::serve(addr, tcp, handler, valve))
    }

    /// Starts serving `handler` on `tcp`, already bound to `addr`; every request passes
    /// `valve` first.
    pub fn serve(
        addr: SocketAddr,
        tcp: TcpListener,
        handler: Arc<Handler>,
        valve: Arc<Valve>,
    ) -> Self {
        let cancel = CancellationToken::new();
        let table = handler.table.clone();
        let tls = match super::tls::server_config(handler.ctx.certs.clone(), table.clone()) {
            Ok(cfg) => Some(TlsAcceptor::from(cfg)),
            Err(e) => {
                tracing::error!(%addr, error = %e, "TLS configuration failed; TLS connections will be closed");
                None
            }
        };
        let serving = Serving {
            addr,
            handler,
            valve,
            tls,
            cancel: cancel.clone(),
        };
        #[allow(
            clippy::disallowed_methods,
            reason = "the listener keeps the JoinHandle and awaits it when it closes"
        )]
        let task = tokio::spawn(serving.accept_loop(tcp));
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

/// One open client connection as the gauges count it: counted open from [`Counted::new`]
/// until dropped, also when the connection's task is dropped before it ends (its runtime shut
/// down), so the open-connection figures never keep a connection that is gone.
struct Counted {
    open: Gauge,
    traffic: Arc<Traffic>,
}

impl Counted {
    fn new(open: Gauge, traffic: Arc<Traffic>) -> Self {
        open.inc();
        traffic.accepted();
        Self { open, traffic }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.traffic.closed();
        self.open.dec();
    }
}

/// The most concurrent streams (requests) of one HTTP/2 client connection (nginx's default is
/// 128; hyper's 200). Each is a backend request and, for HTTP/1.1 backends, a connection.
pub const MAX_H2_STREAMS: u32 = 128;

/// The connection builder every listener serves with: HTTP/1.1 and HTTP/2 (prior knowledge
/// or ALPN), at most [`MAX_H2_STREAMS`] streams per HTTP/2 connection.
fn server_builder() -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http2().max_concurrent_streams(MAX_H2_STREAMS);
    b
}

/// What every connection of one listener shares.
#[derive(Clone)]
struct Serving {
    addr: SocketAddr,
    handler: Arc<Handler>,
    valve: Arc<Valve>,
    /// Handshakes connections while the listener's rules have `security: 1`.
    tls: Option<TlsAcceptor>,
    cancel: CancellationToken,
}

impl Serving {
    /// The limits of a connection accepted now: the daemon's, with the idle timeout the
    /// listener's rules set (`inactiveTimeOut`, [`super::pool::PoolTable::idle_timeout`]) in
    /// place of `LOXI_IDLE_TIMEOUT_MS`'s. A rule change applies to connections accepted after it.
    fn limits(&self) -> ConnLimits {
        let mut limits = self.handler.ctx.config.conn;
        if let Some(idle) = self.handler.table.load().idle_timeout() {
            limits.idle_timeout = idle;
        }
        limits
    }

    async fn accept_loop(self, tcp: TcpListener) {
        let conns = TaskTracker::new();
        let slots = Arc::new(Semaphore::new(self.limits().max_conns.max(1)));
        let open = self.handler.ctx.metrics.open_connections(self.addr);
        let traffic = self.handler.ctx.sockets.traffic(self.addr);
        let builder = server_builder();
        loop {
            let (stream, peer) = tokio::select! {
                _ = self.cancel.cancelled() => break,
                accepted = tcp.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Some(slot) = self.slot(&slots).await else {
                break;
            };
            let (s, b, open, traffic) =
                (self.clone(), builder.clone(), open.clone(), traffic.clone());
            let connection = async move |stream: TcpStream| {
                let counted = Counted::new(open, traffic);
                s.serve(&b, stream, peer, &counted.traffic).await;
                drop(counted);
                drop(slot);
            };
            let Some(workers) = &self.handler.ctx.workers else {
                conns.spawn(connection(stream));
                continue;
            };
            // To a worker: the socket leaves this runtime's reactor and joins the worker's.
            let stream = match stream.into_std() {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "cannot hand the connection to a worker");
                    continue;
                }
            };
            let (rt, seat) = workers.pick();
            conns.spawn_on(
                async move {
                    let _seat = seat;
                    match TcpStream::from_std(stream) {
                        Ok(stream) => connection(stream).await,
                        Err(e) => {
                            tracing::warn!(%peer, error = %e, "a worker cannot take the connection");
                        }
                    }
                },
                &rt,
            );
        }
        drop(tcp);
        conns.close();
        let grace = self.handler.ctx.config.shutdown_grace;
        if tokio::time::timeout(grace, conns.wait()).await.is_err() {
            tracing::warn!(
                ?grace,
                "listener closed with requests still in flight after the grace period"
            );
        }
    }

    /// A connection slot; waits (and counts the wait) at the cap. `None` when closing.
    async fn slot(&self, slots: &Arc<Semaphore>) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = slots.clone().try_acquire_owned() {
            return Some(p);
        }
        self.handler.ctx.metrics.connection_queued(self.addr);
        tokio::select! {
            _ = self.cancel.cancelled() => None,
            p = slots.clone().acquire_owned() => p.ok(),
        }
    }

    /// Serves one connection until it ends, a limit closes it, or the listener closes (then
    /// gracefully: in-flight requests finish, bounded by the accept loop's grace period).
    /// A TLS listener first completes the handshake (within the handshake timeout).
    async fn serve(
        self,
        builder: &auto::Builder<TokioExecutor>,
        stream: TcpStream,
        peer: SocketAddr,
        traffic: &Arc<crate::listen::Traffic>,
    ) {
        let _ = stream.set_nodelay(true);
        let act = Activity::counting(self.limits(), traffic.clone());
        let (cancel, addr) = (self.cancel.clone(), self.addr);
        let metrics = self.handler.ctx.metrics.clone();
        let on_drain = || metrics.connection_drained(addr, Expiry::StreamStall);
        let svc_act = act.clone();
        let ended = if self.handler.table.load().tls() {
            let Some(tls) = self.handshake(stream, peer).await else {
                return;
            };
            let conn = tls.get_ref().1;
            let client = ClientTls::of(
                conn.server_name(),
                &self.handler.table.load(),
                &self.handler.ctx.certs.snapshot(),
                conn.handshake_kind() == Some(rustls::HandshakeKind::Resumed),
            );
            let me = Arc::new(self);
            let svc = service_fn(move |req| {
                let guard = svc_act.begin(req.version());
                me.clone().request(req, peer, guard, Some(client.clone()))
            });
            drive(builder, tls, &act, svc, &cancel, &on_drain).await
        } else {
            // One reference count per request, not a copy of the listener's handles (four).
            let me = Arc::new(self);
            let svc = service_fn(move |req| {
                let guard = svc_act.begin(req.version());
                me.clone().request(req, peer, guard, None)
            });
            drive(builder, stream, &act, svc, &cancel, &on_drain).await
        };
        if let Some(why) = ended {
            tracing::debug!(%peer, reason = why.as_str(), "client connection closed at a limit");
            metrics.connection_closed(addr, why);
        }
    }

    /// The TLS handshake of a connection; `None` (logged at debug) when it fails, times out
    /// or the listener closes meanwhile.
    async fn handshake(
        &self,
        mut stream: TcpStream,
        peer: SocketAddr,
    ) -> Option<tokio_rustls::server::TlsStream<TcpStream>> {
        let acceptor = self.tls.as_ref()?;
        let shake = tokio::time::timeout(super::tls::HANDSHAKE_TIMEOUT, async {
            // A TLS client opens with a handshake record (0x16); an HTTP client with a method
            // name. The latter gets a 400 that says what is wrong (nginx's "plain HTTP request
            // was sent to HTTPS port") instead of a TLS alert it cannot read.
            // An HTTP/2 prior-knowledge client opens with `PRI * HTTP/2.0...` and gets a
            // GOAWAY saying so (it cannot read an HTTP/1 answer).
            match plain_http(&mut stream).await {
                Some(PlainHttp::H1) => {
                    super::tls::refuse_plain_http(stream).await;
                    return Err(std::io::Error::other("plain HTTP sent to a TLS listener"));
                }
                Some(PlainHttp::H2) => {
                    super::tls::refuse_plain_h2(stream).await;
                    return Err(std::io::Error::other("plain HTTP/2 sent to a TLS listener"));
                }
                None => {}
            }
            acceptor.accept(stream).await
        });
        let outcome = tokio::select! {
            _ = self.cancel.cancelled() => return None,
            r = shake => r,
        };
        match outcome {
            Ok(Ok(tls)) => Some(tls),
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                self.handler.ctx.metrics.tls_handshake_failed(self.addr);
                None
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out");
                self.handler.ctx.metrics.tls_handshake_failed(self.addr);
                None
            }
        }
    }

    /// One request: the valve, then the handler; the response body carries the connection's
    /// request guard and the valve's admission until it ends.
    async fn request(
        self: Arc<Self>,
        mut req: Request<Incoming>,
        peer: SocketAddr,
        guard: RequestGuard,
        tls: Option<ClientTls>,
    ) -> Result<Response<ConnBody>, Infallible> {
        if let Some(t) = tls {
            req.extensions_mut().insert(t);
        }
        let Some(admitted) = self.valve.try_admit() else {
            // Refused before routing: counted as the gateway's own refusal of no rule
            // (`service="0"`, `ep_idx="none"`), as a request without a `Host` is.
            self.handler.ctx.metrics.shed("total_inflight");
            let resp = self.handler.error_response(
                0,
                ProxyError::Overloaded {
                    limit: self.valve.limit(),
                },
            );
            return Ok(resp.map(|b| ConnBody::new(b, guard, None)));
        };
        let h1 = req.version() <= http::Version::HTTP_11;
        // The handler boxes its kilobytes of routing state itself (`Handler::handle`), so the
        // future hyper moves into its dispatcher stays small.
        let resp = self.handler.clone().handle(req, peer).await?;
        if h1 && resp.status() == http::StatusCode::PAYLOAD_TOO_LARGE {
            // Its body is drained after the answer (`body::discard_for`), then the
            // connection closes: those bytes are no next request's head.
            guard.linger();
        }
        Ok(resp.map(|b| ConnBody::new(b, guard, Some(admitted))))
    }
}

/// Serves `io` with `svc` until the connection ends (`None`) or `act`'s watchdog closes it
/// (`Some(why)`, dropped at once: no request is open then, or the client stopped reading its
/// response, and neither a slowloris head nor a response nobody reads would finish
/// gracefully). `cancel` starts a graceful shutdown (open requests finish), and so does the
/// HTTP/2 drain rule ([`Expiry::StreamStall`], which calls `on_drain` once; never returned).
///
/// The connection is polled on every wake-up of this task (three or more a request); the
/// watchdog and the cancellation only when they woke it ([`Alarm`]): polled on every wake-up
/// too, their timer and waiter-list checks cost ~700 instructions a request (valgrind).
pub async fn drive<I, S, B>(
    builder: &auto::Builder<TokioExecutor>,
    io: I,
    act: &Arc<Activity>,
    svc: S,
    cancel: &CancellationToken,
    on_drain: &(dyn Fn() + Sync),
) -> Option<Expiry>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>>,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let io = TokioIo::new(TrackedIo::new(io, act.clone()));
    let conn = builder.serve_connection(io, svc);
    let expired = act.expired();
    let cancelled = cancel.cancelled();
    tokio::pin!(conn, expired, cancelled);
    let alarm = Arc::new(Alarm::default());
    let alarm_waker = Waker::from(alarm.clone());
    let mut closing = false;
    std::future::poll_fn(|cx| {
        // Before the checks below: an alarm raised after them wakes this poll's waker.
        alarm.task.register(cx.waker());
        loop {
            // In order: the connection (the hot branch), the watchdog, the cancellation.
            if let Poll::Ready(ended) = conn.as_mut().poll(cx) {
                if act.head_was_too_large() {
                    tracing::debug!(
                        limit = super::conn::MAX_HEAD_BYTES,
                        "request head too large; answered 431 (HTTP/1) and closed"
                    );
                    return Poll::Ready(Some(Expiry::HeadTooLarge));
                }
                let Err(e) = ended else {
                    return Poll::Ready(None);
                };
                if refused_by_hyper(&*e) {
                    tracing::debug!(error = %e, "malformed request head; hyper answered it and closed");
                    return Poll::Ready(Some(Expiry::Malformed));
                }
                tracing::debug!(error = %e, "connection ended with error");
                return Poll::Ready(None);
            }
            if !alarm.due.swap(false, Ordering::AcqRel) {
                return Poll::Pending;
            }
            let mut acx = Context::from_waker(&alarm_waker);
            match expired.as_mut().poll(&mut acx) {
                Poll::Ready(Expiry::StreamStall) => {
                    // Not a close: no new streams, the open ones finish (the stuck one is cut
                    // by the stall rule once the others have ended). The watchdog goes on.
                    tracing::debug!(
                        "an HTTP/2 stream waited the send timeout for its client while others \
                         progressed; draining the connection"
                    );
                    act.drain();
                    on_drain();
                    if !closing {
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    expired.set(act.expired());
                    alarm.due.store(true, Ordering::Release);
                    continue;
                }
                // A refused head's connection lingers until the client closes or its header
                // timeout ends it: reported as what it is.
                Poll::Ready(_) if act.head_was_too_large() => {
                    return Poll::Ready(Some(Expiry::HeadTooLarge));
                }
                Poll::Ready(why) => return Poll::Ready(Some(why)),
                Poll::Pending => {}
            }
            if closing || cancelled.as_mut().poll(&mut acx).is_pending() {
                return Poll::Pending;
            }
            conn.as_mut().graceful_shutdown();
            closing = true;
        }
    })
    .await
}

/// Whether hyper's HTTP/1 server refused a malformed head itself (it answers 400, 414 or 431
/// and closes, without calling the service): a parse error anywhere in `e`'s chain.
fn refused_by_hyper(e: &(dyn std::error::Error + 'static)) -> bool {
    super::attempt::sources(e)
        .filter_map(|err| err.downcast_ref::<hyper::Error>())
        .any(|h| h.is_parse() || h.is_parse_too_large())
}

/// Wakes a connection's task for its watchdog and cancellation futures, which are polled with
/// this waker: their wake-up raises `due` (so the next poll polls them) and wakes the task.
/// `due` starts raised, so the first poll registers them.
struct Alarm {
    due: AtomicBool,
    task: AtomicWaker,
}

impl Default for Alarm {
    fn default() -> Self {
        Self {
            due: AtomicBool::new(true),
            task: AtomicWaker::new(),
        }
    }
}

impl Wake for Alarm {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.due.store(true, Ordering::Release);
        self.task.wake();
    }
}

/// A response body holding its connection's [`RequestGuard`] and its valve admission until the
/// body ends, fails or is dropped.
///
/// On an HTTP/2 stream ([`RequestGuard::watched`]) it hands hyper the backend's data in pieces
/// of at most [`H2_PIECE`] bytes: a larger chunk is split, and chunks the backend already sent
/// (an SSE stream running ahead of its client) are joined into one piece, up to 64 of them,
/// instead of one tiny DATA frame each. HTTP/2 clients bound the tiny frames they hold unread
/// (h2 ≥ 0.4.20, behind hyper and reqwest, answers GOAWAY `ENHANCE_YOUR_CALM` past its budget),
/// and every frame costs 9 bytes and a write. Each piece that waits for the client is reported
/// (the send timeout's stall rule, see `conn.rs`).
pub struct ConnBody {
    inner: ProxyBody,
    held: Option<(RequestGuard, Option<Admitted>)>,
    /// A watched stream's pieces in the making (boxed: an HTTP/1 answer carries one word).
    h2: Option<Box<Pieces>>,
}

/// What a watched (HTTP/2) stream's body keeps between polls.
#[derive(Default)]
struct Pieces {
    /// The rest of a data chunk split into pieces, handed before anything else.
    rest: Bytes,
    /// What the backend's body gave after the chunks joined into the last piece (its end, an
    /// error or trailers), handed at the next poll.
    next: Option<Option<Result<Frame<Bytes>, hyper::Error>>>,
}

/// The most backend chunks joined into one HTTP/2 piece.
const JOIN_CHUNKS: usize = 64;

impl ConnBody {
    fn new(inner: ProxyBody, guard: RequestGuard, admitted: Option<Admitted>) -> Self {
        Self {
            inner,
            h2: guard.watched().then(Box::default),
            held: Some((guard, admitted)),
        }
    }

    /// `data` up to [`H2_PIECE`] bytes; beyond that, its first piece, the rest kept for the
    /// next polls.
    fn piece(p: &mut Pieces, mut data: Bytes) -> Bytes {
        if data.len() > H2_PIECE {
            p.rest = data.split_off(H2_PIECE);
        }
        data
    }

    /// [`Body::poll_frame`] of a watched (HTTP/2) stream: the piece was taken when hyper polls
    /// again; a piece that is not the last waits for that.
    #[inline(never)]
    fn poll_watched(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some((g, _)) = self.held.as_mut() {
            g.polled();
        }
        let Some(p) = self.h2.as_deref_mut() else {
            return Poll::Ready(None);
        };
        let out = Self::next_piece(&mut self.inner, p, cx);
        match &out {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.held = None,
            Poll::Ready(Some(Ok(_))) if self.is_end_stream() => self.held = None,
            Poll::Ready(Some(Ok(_))) => {
                if let Some((g, _)) = self.held.as_mut() {
                    g.handed();
                }
            }
            Poll::Pending => {}
        }
        out
    }

    /// The next frame of a watched stream (see the type's doc).
    fn next_piece(
        inner: &mut ProxyBody,
        p: &mut Pieces,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if !p.rest.is_empty() {
            let rest = std::mem::take(&mut p.rest);
            return Poll::Ready(Some(Ok(Frame::data(Self::piece(p, rest)))));
        }
        if let Some(item) = p.next.take() {
            return Poll::Ready(item);
        }
        let first = match Pin::new(&mut *inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => f,
            other => return other,
        };
        let data = match first.into_data() {
            Ok(d) => d,
            Err(trailers) => return Poll::Ready(Some(Ok(trailers))),
        };
        if data.len() >= H2_PIECE || inner.is_end_stream() {
            return Poll::Ready(Some(Ok(Frame::data(Self::piece(p, data)))));
        }
        let mut joined: Option<BytesMut> = None;
        for _ in 1..JOIN_CHUNKS {
            if inner.is_end_stream() {
                break;
            }
            let more = match Pin::new(&mut *inner).poll_frame(cx) {
                Poll::Pending => break,
                Poll::Ready(Some(Ok(f))) => f,
                Poll::Ready(other) => {
                    p.next = Some(other);
                    break;
                }
            };
            let more = match more.into_data() {
                Ok(d) => d,
                Err(trailers) => {
                    p.next = Some(Some(Ok(trailers)));
                    break;
                }
            };
            let buf = joined.get_or_insert_with(|| {
                let mut b = BytesMut::with_capacity(H2_PIECE);
                b.extend_from_slice(&data);
                b
            });
            let room = H2_PIECE - buf.len();
            if more.len() >= room {
                buf.extend_from_slice(&more[..room]);
                p.rest = more.slice(room..);
                break;
            }
            buf.extend_from_slice(&more);
        }
        Poll::Ready(Some(Ok(Frame::data(joined.map_or(data, BytesMut::freeze)))))
    }
}

impl Body for ConnBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let me = &mut *self;
        if me.h2.is_some() {
            return me.poll_watched(cx);
        }
        let polled = Pin::new(&mut me.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => me.held = None,
            Poll::Ready(Some(Ok(_))) if me.inner.is_end_stream() => me.held = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match self.h2.as_deref() {
            None => self.inner.is_end_stream(),
            Some(p) => {
                p.rest.is_empty()
                    && match &p.next {
                        Some(None) => true,
                        Some(Some(_)) => false,
                        None => self.inner.is_end_stream(),
                    }
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        let Some(p) = self.h2.as_deref() else {
            return self.inner.size_hint();
        };
        let rest = p.rest.len() as u64;
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(rest));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint
    }
}

#[cfg(test)]
#[path = "listener_tests.rs"]
mod tests;
