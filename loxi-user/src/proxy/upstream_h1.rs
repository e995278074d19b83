//! Cleartext HTTP/1.1 upstream connections driven by the request's own task.
//!
//! hyper-util's pooled client runs every upstream connection as a task of its own: each
//! response head and each body chunk crosses from that task to the request's task through a
//! channel (two wake-ups per chunk, so an SSE stream of 200 events costs ~400 task switches and
//! one client `writev` per event), and every HTTP/1.1 request spawns one more task that returns
//! the connection to the pool. Here the request's task polls the connection itself (hyper's
//! `client::conn::http1`, no spawned task): while waiting for the response head, and then from
//! [`DrivenBody::poll_frame`] while the response body streams. Chunks already read in one
//! socket read are then decoded and handed on in the same poll, so hyper's server writes them
//! to the client in one `writev`.
//!
//! With connection workers (`super::workers`), each worker has its own idle lists: a connection
//! is opened on, and only ever reused by, the worker whose runtime polls its socket, so its
//! readiness never has to cross threads.
//!
//! The pool keeps idle connections per endpoint authority (most recently used first, at most
//! [`MAX_IDLE_PER_HOST`], none idle longer than [`IDLE_TIMEOUT`], as hyper-util's default 90 s).
//! A connection goes back only when its response body ended cleanly (dropped early or failed:
//! closed). An idle connection is polled once when taken: one the backend closed meanwhile is
//! dropped and the next is tried. A request that a reused connection could not send (the backend
//! closed it as it was taken) is sent again on a new connection, as hyper-util does; a request
//! that was sent is never resent.
//!
//! Connect failures are reported as [`Attempt::ConnectFailed`] (`tcp connect error: ...`), so the
//! caller may retry another endpoint; anything after the request was handed to the connection is
//! [`Attempt::Failed`].

use std::collections::{HashMap, VecDeque};
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::attempt::{Attempt, LocalShortage, error_chain};

/// Longest an idle connection is kept (hyper-util's default pool idle timeout).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Idle connections kept per endpoint authority, over all connection workers (each worker's
/// idle list holds at most its share, rounded up: [`H1Pool::max_idle`]); more are closed when
/// they come back.
pub const MAX_IDLE_PER_HOST: usize = 1024;

/// How often a background task closes idle connections older than [`IDLE_TIMEOUT`], so that
/// connections to an endpoint no request goes to any more (removed, drained) are not kept open.
pub const REAP_INTERVAL: Duration = Duration::from_secs(30);

/// Idle connections per endpoint authority.
type IdleMap = HashMap<Arc<str>, VecDeque<Idle>, foldhash::fast::RandomState>;

type Conn = http1::Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// One upstream connection: its request handle and the connection future this module polls.
struct H1Conn {
    /// The endpoint authority (`ip:port`): the pool key.
    key: Arc<str>,
    /// The idle lists it returns to: the worker that opened it (see [`H1Pool::shard`]).
    shard: usize,
    send: http1::SendRequest<Full<Bytes>>,
    conn: Pin<Box<Conn>>,
    /// The connection future completed (closed or failed): never polled again nor pooled.
    done: bool,
}

impl H1Conn {
    /// Polls the connection once (reads, writes, hands chunks to the response body); false once
    /// it has ended.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.done && self.conn.as_mut().poll(cx).is_ready() {
            self.done = true;
        }
        !self.done
    }

    /// Waits until the connection can take a request; false when it closed instead.
    async fn ready(&mut self) -> bool {
        poll_fn(|cx| {
            if !self.drive(cx) {
                return Poll::Ready(false);
            }
            match self.send.poll_ready(cx) {
                Poll::Ready(r) => Poll::Ready(r.is_ok()),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }
}

struct Idle {
    conn: H1Conn,
    since: Instant,
}

/// The per-authority pool of idle HTTP/1.1 connections and how new ones are opened.
pub struct H1Pool {
    /// One map per connection worker, index = worker number (0: threads that are no worker).
    /// Keyed by authority with foldhash (the keys are the rules' own endpoint addresses, not
    /// client input; std's SipHash is the slower hash, paid on every checkout and return).
    idle: Box<[parking_lot::Mutex<IdleMap>]>,
    /// Idle connections kept per authority in one worker's list: [`MAX_IDLE_PER_HOST`] over the
    /// number of workers, rounded up, so the whole pool keeps about [`MAX_IDLE_PER_HOST`].
    max_idle: usize,
    connect_timeout: Duration,
}

impl std::fmt::Debug for H1Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle: usize = self
            .idle
            .iter()
            .map(|m| m.lock().values().map(VecDeque::len).sum::<usize>())
            .sum();
        f.debug_struct("H1Pool")
            .field("idle", &idle)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl H1Pool {
    /// An empty pool whose connects give up after `connect_timeout`, with idle lists for
    /// `workers` connection workers besides the one for every other thread. Inside a tokio
    /// runtime it also starts the reaper ([`REAP_INTERVAL`]), which ends when the pool is
    /// dropped.
    pub fn new(connect_timeout: Duration, workers: usize) -> Arc<Self> {
        Self::with_cap(
            connect_timeout,
            workers,
            MAX_IDLE_PER_HOST.div_ceil(workers.max(1)),
        )
    }

    /// [`Self::new`] with `max_idle` idle connections per authority in each worker's list.
    fn with_cap(connect_timeout: Duration, workers: usize, max_idle: usize) -> Arc<Self> {
        let pool = Arc::new(Self {
            idle: (0..=workers)
                .map(|_| parking_lot::Mutex::new(IdleMap::default()))
                .collect(),
            max_idle,
            connect_timeout,
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&pool);
            rt.spawn(async move {
                let mut tick = tokio::time::interval(REAP_INTERVAL);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    let Some(pool) = weak.upgrade() else { break };
                    pool.reap(Instant::now());
                }
            });
        }
        pool
    }

    /// Closes the idle connections that at `now` have been idle longer than [`IDLE_TIMEOUT`]
    /// or were closed, and forgets authorities left without any; returns how many it closed.
    fn reap(&self, now: Instant) -> usize {
        let mut closed = 0;
        for map in &self.idle {
            map.lock().retain(|_, q| {
                let before = q.len();
                q.retain(|i| {
                    now.saturating_duration_since(i.since) <= IDLE_TIMEOUT
                        && !i.conn.send.is_closed()
                });
                closed += before - q.len();
                !q.is_empty()
            });
        }
        closed
    }

    /// The idle lists of the calling thread: its worker's, or the shared ones (index 0) on a
    /// thread that is no worker of this pool.
    fn shard(&self) -> usize {
        let w = super::workers::current();
        if w < self.idle.len() { w } else { 0 }
    }

    /// Sends `req` (origin-form URI, `Host` set) to `authority` (`ip:port`) on an idle
    /// connection or a new one; the response body drives the connection (see the module doc).
    /// With [`Attempt::ConnectFailed`], and only then, `req` comes back unsent (its headers and
    /// body untouched), so the caller can send it to another endpoint without rebuilding it.
    ///
    /// Not an `async fn`: its argument `req` would be stored twice in the future (the argument
    /// and the body's local); the `async move` block keeps one (the future is part of every
    /// request's routing future, which is copied once into its box).
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn would store `req` twice in every request's future"
    )]
    pub fn send<'a>(
        self: &'a Arc<Self>,
        mut req: Request<Full<Bytes>>,
        authority: &'a str,
    ) -> impl Future<Output = (Attempt<DrivenBody>, Option<Request<Full<Bytes>>>)> + Send + 'a {
        async move {
            loop {
                let (mut c, reused) = match self.checkout(authority).await {
                    Some(c) => (c, true),
                    // Boxed: a new connection is the rare case, and its connect and handshake
                    // futures inline would size (and be copied with) every request's future.
                    None => match Box::pin(self.connect(authority)).await {
                        Ok(c) => (c, false),
                        Err(failed) => return (failed, Some(req)),
                    },
                };
                let mut sent = std::pin::pin!(c.send.try_send_request(req));
                let outcome = poll_fn(|cx| {
                    c.drive(cx);
                    sent.as_mut().poll(cx)
                })
                .await;
                match outcome {
                    // An unsolicited 101 fails the attempt (`Attempt::answered`); the
                    // connection, switched as far as the backend knows, is dropped here.
                    Ok(resp) if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS => {
                        let resp = resp.map(|body| DrivenBody { body, pool: None });
                        return (Attempt::answered(resp), None);
                    }
                    Ok(resp) => {
                        let pool = Some((c, self.clone()));
                        let resp = resp.map(|body| DrivenBody { body, pool });
                        return (Attempt::Response(resp), None);
                    }
                    Err(mut e) => match e.take_message() {
                        // Not sent: the connection closed as it was taken. Once more, new.
                        Some(unsent) if reused => req = unsent,
                        Some(unsent) => {
                            return (Attempt::ConnectFailed(error_chain(e.error())), Some(unsent));
                        }
                        None => return (Attempt::Failed(Box::new(e.into_error())), None),
                    },
                }
            }
        }
    }

    /// The most recently returned live connection to `authority`, if any.
    async fn checkout(&self, authority: &str) -> Option<H1Conn> {
        loop {
            let idle = {
                let mut map = self.idle[self.shard()].lock();
                map.get_mut(authority)?.pop_back()?
            };
            let mut c = idle.conn;
            if idle.since.elapsed() <= IDLE_TIMEOUT && !c.send.is_closed() && c.ready().await {
                return Some(c);
            }
        }
    }

    /// A new connection to `authority`; when it cannot be opened, the failed attempt:
    /// [`Attempt::ConnectFailed`] (`tcp connect error: ...`), or
    /// [`Attempt::NoLocalResources`] when the gateway ran out of its own descriptors, ports or
    /// buffers.
    async fn connect(&self, authority: &str) -> Result<H1Conn, Attempt<DrivenBody>> {
        let tcp =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(authority)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    return Err(match LocalShortage::of(&e) {
                        Some(s) => Attempt::NoLocalResources(s),
                        None => Attempt::ConnectFailed(format!("tcp connect error: {e}")),
                    });
                }
                Err(_) => {
                    return Err(Attempt::ConnectFailed(format!(
                        "tcp connect error: no connection within {} ms",
                        self.connect_timeout.as_millis()
                    )));
                }
            };
        let _ = tcp.set_nodelay(true);
        let (send, conn) = http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| Attempt::ConnectFailed(format!("http1 handshake: {e}")))?;
        let mut c = H1Conn {
            key: Arc::from(authority),
            shard: self.shard(),
            send,
            conn: Box::pin(conn),
            done: false,
        };
        if !c.ready().await {
            return Err(Attempt::ConnectFailed(
                "connection closed before the first request".into(),
            ));
        }
        Ok(c)
    }

    /// Returns a connection whose response ended cleanly.
    fn put(&self, conn: H1Conn) {
        if conn.done || conn.send.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut map = self.idle[conn.shard].lock();
        // One lookup for a known authority; the key's reference count is taken only for one
        // seen for the first time.
        match map.get_mut(&*conn.key) {
            Some(q) => keep(q, conn, now, self.max_idle),
            None => keep(
                map.entry(conn.key.clone()).or_default(),
                conn,
                now,
                self.max_idle,
            ),
        }
    }
}

/// Queues `conn` as idle since `now` behind the live ones of its authority's queue `q` (the
/// expired ones are dropped first), unless the queue holds `max` already.
fn keep(q: &mut VecDeque<Idle>, conn: H1Conn, now: Instant, max: usize) {
    while q
        .front()
        .is_some_and(|i| now.duration_since(i.since) > IDLE_TIMEOUT)
    {
        q.pop_front();
    }
    if q.len() < max {
        q.push_back(Idle { conn, since: now });
    }
}

/// An upstream response body that polls its connection while it is read, and returns the
/// connection to the pool when it ends cleanly (see the module doc).
pub struct DrivenBody {
    body: Incoming,
    /// The connection and its pool, until the body ends.
    pool: Option<(H1Conn, Arc<H1Pool>)>,
}

impl DrivenBody {
    fn release(&mut self, reuse: bool) {
        if let Some((c, pool)) = self.pool.take()
            && reuse
        {
            pool.put(c);
        }
    }
}

impl Body for DrivenBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let mut polled = Pin::new(&mut this.body).poll_frame(cx);
        if polled.is_pending()
            && let Some((c, _)) = this.pool.as_mut()
        {
            // The poll above asked for the next chunk; the connection reads and hands it on.
            c.drive(cx);
            polled = Pin::new(&mut this.body).poll_frame(cx);
        }
        match &polled {
            Poll::Ready(None) => this.release(true),
            Poll::Ready(Some(Err(_))) => this.release(false),
            Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.release(true),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for DrivenBody {
    fn drop(&mut self) {
        // A body that was complete without being read to its end (hyper does not poll a body
        // whose `is_end_stream` is already true) leaves its connection reusable; one dropped
        // early (the client went away) closes it.
        let done = self.body.is_end_stream();
        self.release(done);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use hyper::service::service_fn;
    use tokio::net::TcpListener;

    use super::*;

    /// A loopback HTTP/1.1 server answering `GET /n` with `n` chunked frames of `x`, counting
    /// the connections it accepted.
    async fn server() -> (String, Arc<AtomicUsize>) {
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr").to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = tcp.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = service_fn(|req: Request<Incoming>| async move {
                        let n: usize = req.uri().path()[1..].parse().unwrap_or(1);
                        let frames = (0..n).map(|_| {
                            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"x")))
                        });
                        let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
                        Ok::<_, std::convert::Infallible>(http::Response::new(body))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        (addr, accepted)
    }

    fn get(path: &str, authority: &str) -> Request<Full<Bytes>> {
        Request::builder()
            .uri(path)
            .header(http::header::HOST, authority)
            .body(Full::new(Bytes::new()))
            .expect("request")
    }

    async fn body_of(a: Attempt<DrivenBody>) -> Vec<u8> {
        match a {
            Attempt::Response(r) => r
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes()
                .to_vec(),
            other => panic!("no response: {:?}", other.error_type()),
        }
    }

    #[tokio::test]
    async fn a_connection_is_reused_after_a_complete_body_and_closed_after_a_dropped_one() {
        let (addr, accepted) = server().await;
        let pool = H1Pool::new(Duration::from_secs(1), 0);
        assert_eq!(
            body_of(pool.send(get("/3", &addr), &addr).await.0).await,
            b"xxx"
        );
        assert_eq!(
            body_of(pool.send(get("/200", &addr), &addr).await.0)
                .await
                .len(),
            200
        );
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the second request reused the first connection"
        );
        // A body dropped before its end takes its connection with it.
        let Attempt::Response(r) = pool.send(get("/50", &addr), &addr).await.0 else {
            panic!("no response");
        };
        drop(r);
        assert_eq!(
            body_of(pool.send(get("/1", &addr), &addr).await.0).await,
            b"x"
        );
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "a new connection after the dropped body"
        );
    }

    #[tokio::test]
    async fn the_reaper_closes_connections_idle_past_the_timeout_and_forgets_their_endpoint() {
        let (addr, accepted) = server().await;
        let pool = H1Pool::new(Duration::from_secs(1), 0);
        assert_eq!(
            body_of(pool.send(get("/2", &addr), &addr).await.0).await,
            b"xx"
        );
        assert_eq!(
            pool.reap(Instant::now()),
            0,
            "a fresh idle connection stays"
        );
        assert_eq!(pool.idle[0].lock().len(), 1);
        let later = Instant::now() + IDLE_TIMEOUT + Duration::from_secs(1);
        assert_eq!(pool.reap(later), 1, "idle past the timeout: closed");
        assert!(pool.idle[0].lock().is_empty(), "the endpoint is forgotten");
        assert_eq!(
            body_of(pool.send(get("/1", &addr), &addr).await.0).await,
            b"x"
        );
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "a new connection after the reap"
        );
    }

    #[tokio::test]
    async fn each_worker_reuses_only_the_connections_it_opened() {
        let (addr, accepted) = server().await;
        let pool = H1Pool::new(Duration::from_secs(1), 2);
        let workers = crate::proxy::workers::Workers::start(2).expect("workers");
        let (w1, _seat1) = workers.pick();
        let (w2, _seat2) = workers.pick();
        let on = |rt: &tokio::runtime::Handle, path: &'static str| {
            let (pool, addr) = (pool.clone(), addr.clone());
            rt.spawn(async move { body_of(pool.send(get(path, &addr), &addr).await.0).await })
        };
        assert_eq!(on(&w1, "/1").await.expect("task"), b"x");
        assert_eq!(on(&w2, "/2").await.expect("task"), b"xx");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "worker 2 did not take worker 1's idle connection"
        );
        assert_eq!(on(&w1, "/3").await.expect("task"), b"xxx");
        assert_eq!(on(&w2, "/1").await.expect("task"), b"x");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "each worker reused its own"
        );
        let idle = |i: usize| {
            pool.idle[i]
                .lock()
                .values()
                .map(VecDeque::len)
                .sum::<usize>()
        };
        assert_eq!((idle(0), idle(1), idle(2)), (0, 1, 1));
    }

    #[tokio::test]
    async fn each_worker_keeps_its_share_of_the_idle_cap() {
        assert_eq!(
            H1Pool::new(Duration::from_secs(1), 0).max_idle,
            MAX_IDLE_PER_HOST
        );
        assert_eq!(H1Pool::new(Duration::from_secs(1), 8).max_idle, 128);
        assert_eq!(H1Pool::new(Duration::from_secs(1), 3).max_idle, 342);
        // A list at its cap closes what comes back.
        let (addr, accepted) = server().await;
        let pool = H1Pool::with_cap(Duration::from_secs(1), 0, 1);
        let ((a, _), (b, _)) = tokio::join!(
            pool.send(get("/1", &addr), &addr),
            pool.send(get("/1", &addr), &addr)
        );
        let (Attempt::Response(a), Attempt::Response(b)) = (a, b) else {
            panic!("no responses");
        };
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "two concurrent connections"
        );
        a.into_body().collect().await.expect("body");
        b.into_body().collect().await.expect("body");
        assert_eq!(
            pool.idle[0]
                .lock()
                .values()
                .map(VecDeque::len)
                .sum::<usize>(),
            1
        );
    }

    #[tokio::test]
    async fn a_refused_connect_is_a_connect_failure_naming_the_reason() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp.local_addr().expect("addr").to_string();
        drop(tcp);
        let pool = H1Pool::new(Duration::from_secs(1), 0);
        match pool.send(get("/1", &addr), &addr).await {
            (Attempt::ConnectFailed(e), Some(unsent)) => {
                assert!(e.starts_with("tcp connect error: "), "{e}");
                // The request comes back as it was given, for the next endpoint.
                assert_eq!(unsent.uri(), "/1");
                assert_eq!(unsent.headers()[http::header::HOST], addr.as_str());
            }
            (other, back) => panic!(
                "expected a connect failure and the request back, got {:?}, back: {}",
                other.error_type(),
                back.is_some()
            ),
        }
    }
}
