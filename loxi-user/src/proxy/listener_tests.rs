//! Connection limits on tokio's paused clock: the real [`drive`] loop and hyper's server over
//! an in-memory duplex pipe, so the timeouts are exact virtual durations, not wall-clock races.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::time::{Instant, sleep};

use super::*;
use crate::proxy::error::full;

const HEADER: Duration = Duration::from_secs(10);
const IDLE: Duration = Duration::from_secs(60);
const SEND: Duration = Duration::from_secs(60);

fn limits() -> ConnLimits {
    ConnLimits {
        header_timeout: HEADER,
        idle_timeout: IDLE,
        send_timeout: SEND,
        max_conns: 1,
    }
}

/// Serves the server half of a pipe like a listener does: every request opens the connection's
/// guard at its head; the handler waits `delay`, then answers `ok`.
async fn serve(server: DuplexStream, delay: Duration) -> Option<Expiry> {
    serve_until(server, delay, CancellationToken::new()).await
}

/// [`serve`], closed gracefully when `cancel` fires (as a closing listener does).
async fn serve_until(
    server: DuplexStream,
    delay: Duration,
    cancel: CancellationToken,
) -> Option<Expiry> {
    serve_body(server, delay, cancel, Bytes::from_static(b"ok")).await
}

/// [`serve_until`], answering every request with `answer`.
async fn serve_body(
    server: DuplexStream,
    delay: Duration,
    cancel: CancellationToken,
    answer: Bytes,
) -> Option<Expiry> {
    serve_with(server, delay, cancel, move || full(answer.clone())).await
}

/// [`serve_until`], answering every request with a body from `answer`.
async fn serve_with(
    server: DuplexStream,
    delay: Duration,
    cancel: CancellationToken,
    answer: impl Fn() -> ProxyBody + Clone + Send + Sync + 'static,
) -> Option<Expiry> {
    let act = Activity::new(limits());
    let svc_act = act.clone();
    let svc = service_fn(move |req: Request<Incoming>| {
        let guard = svc_act.begin(req.version());
        let answer = answer.clone();
        async move {
            sleep(delay).await;
            let body = ConnBody::new(answer(), guard, None);
            Ok::<_, Infallible>(Response::new(body))
        }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    drive(&builder, server, &act, svc, &cancel, &|| {}).await
}

const REQUEST: &[u8] = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";

/// Reads until the response body `ok` arrived; returns false on EOF first.
async fn read_response(client: &mut DuplexStream) -> bool {
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    while !got.ends_with(b"\r\n\r\nok") {
        match client.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    true
}

/// Reads until EOF; returns when it came.
async fn eof_at(mut client: DuplexStream) -> Instant {
    let mut buf = [0u8; 512];
    while matches!(client.read(&mut buf).await, Ok(n) if n > 0) {}
    Instant::now()
}

#[tokio::test(start_paused = true)]
async fn slowloris_head_is_cut_at_the_header_timeout() {
    let (mut client, server) = tokio::io::duplex(4096);
    let t0 = Instant::now();
    let trickle = tokio::spawn(async move {
        // One byte a second of a head that never ends (300 s if nobody stops it).
        let head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ";
        for b in head.iter().chain(std::iter::repeat(&b'a')).take(300) {
            if client.write_all(&[*b]).await.is_err() {
                return Instant::now();
            }
            sleep(Duration::from_secs(1)).await;
        }
        Instant::now()
    });
    let why = serve(server, Duration::ZERO).await;
    let closed = t0.elapsed();
    assert_eq!(why, Some(Expiry::HeaderTimeout));
    assert!(
        closed >= HEADER && closed < HEADER + Duration::from_secs(1),
        "closed after {closed:?}, want the 10 s header timeout from the first byte"
    );
    let writer_saw_close = trickle.await.expect("trickle task") - t0;
    assert!(
        writer_saw_close <= HEADER + Duration::from_secs(1),
        "the client's next byte after the close failed at {writer_saw_close:?}"
    );
}

/// A connection served until a token fires (handler delay `delay`), with one request sent:
/// the client's half, the token, the serving task and the start time.
async fn closable(
    delay: Duration,
) -> (
    DuplexStream,
    CancellationToken,
    tokio::task::JoinHandle<Option<Expiry>>,
    Instant,
) {
    let (mut client, server) = tokio::io::duplex(4096);
    let cancel = CancellationToken::new();
    let t0 = Instant::now();
    let served = tokio::spawn(serve_until(server, delay, cancel.clone()));
    client.write_all(REQUEST).await.expect("write");
    (client, cancel, served, t0)
}

/// A closing listener (the token) lets the open request finish, then ends its connection: at
/// once after the answer, not at a timeout.
#[tokio::test(start_paused = true)]
async fn closing_finishes_the_open_request_then_ends_the_connection() {
    let (mut client, cancel, served, t0) = closable(Duration::from_secs(5)).await;
    sleep(Duration::from_secs(1)).await;
    cancel.cancel();
    assert!(
        read_response(&mut client).await,
        "the open request answered"
    );
    let answered = t0.elapsed();
    let eof = eof_at(client).await - t0;
    assert_eq!(
        served.await.expect("server task"),
        None,
        "ended, not expired"
    );
    assert!(
        answered >= Duration::from_secs(5) && eof < Duration::from_secs(6),
        "answered at {answered:?}, closed at {eof:?}"
    );
}

/// Closing with no request open ends an idle keep-alive connection at once.
#[tokio::test(start_paused = true)]
async fn closing_ends_an_idle_connection_at_once() {
    let (mut client, cancel, served, t0) = closable(Duration::ZERO).await;
    assert!(read_response(&mut client).await, "answered");
    sleep(Duration::from_secs(2)).await;
    cancel.cancel();
    let eof = eof_at(client).await - t0;
    assert_eq!(served.await.expect("server task"), None);
    assert!(eof < Duration::from_secs(3), "closed at {eof:?}");
}

#[tokio::test(start_paused = true)]
async fn keepalive_connection_is_closed_after_the_idle_timeout() {
    let (mut client, server) = tokio::io::duplex(4096);
    let client_side = tokio::spawn(async move {
        client.write_all(REQUEST).await.expect("write");
        assert!(read_response(&mut client).await, "first request answered");
        let answered = Instant::now();
        (answered, eof_at(client).await)
    });
    let why = serve(server, Duration::ZERO).await;
    let (answered, eof) = client_side.await.expect("client task");
    assert_eq!(why, Some(Expiry::Idle));
    let idle_for = eof - answered;
    assert!(
        idle_for >= IDLE && idle_for < IDLE + Duration::from_secs(1),
        "idle keep-alive connection closed after {idle_for:?}, want 60 s"
    );
}

#[tokio::test(start_paused = true)]
async fn silent_connection_is_closed_after_the_idle_timeout() {
    let (client, server) = tokio::io::duplex(4096);
    let t0 = Instant::now();
    let eof = tokio::spawn(eof_at(client));
    assert_eq!(serve(server, Duration::ZERO).await, Some(Expiry::Idle));
    let after = eof.await.expect("client task") - t0;
    assert!(
        after >= IDLE && after < IDLE + Duration::from_secs(1),
        "{after:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_longer_than_both_timeouts_is_not_cut() {
    let (mut client, server) = tokio::io::duplex(4096);
    let client_side = tokio::spawn(async move {
        client.write_all(REQUEST).await.expect("write");
        let answered = read_response(&mut client).await;
        drop(client);
        answered
    });
    let t0 = Instant::now();
    // The handler takes 300 s (a long generation): neither timer may fire meanwhile.
    let why = serve(server, Duration::from_secs(300)).await;
    assert!(client_side.await.expect("client task"), "response arrived");
    assert_eq!(
        why, None,
        "the connection ended because the client closed it"
    );
    assert!(t0.elapsed() >= Duration::from_secs(300));
}

#[tokio::test(start_paused = true)]
async fn requests_spaced_under_the_idle_timeout_keep_the_connection() {
    let (mut client, server) = tokio::io::duplex(4096);
    let client_side = tokio::spawn(async move {
        // Five requests 50 s apart: 200 s in all, each gap under the 60 s idle timeout.
        for _ in 0..5 {
            client.write_all(REQUEST).await.expect("write");
            assert!(
                read_response(&mut client).await,
                "answered on the same connection"
            );
            sleep(Duration::from_secs(50)).await;
        }
        eof_at(client).await
    });
    let t0 = Instant::now();
    assert_eq!(serve(server, Duration::ZERO).await, Some(Expiry::Idle));
    let closed = client_side.await.expect("client task") - t0;
    // Last answer at 200 s, then 60 s idle.
    assert!(closed >= Duration::from_secs(260), "{closed:?}");
    assert!(closed < Duration::from_secs(261), "{closed:?}");
}

#[tokio::test(start_paused = true)]
async fn a_head_started_late_in_an_idle_period_is_cut_at_its_own_header_timeout() {
    // After a request, the connection waits for the 60 s idle deadline; 45 s in, a slow head
    // starts, whose header deadline (55 s) is earlier than the idle one (105 s after its first
    // byte): the watchdog must close at 55 s, with nothing waking it when the head started.
    let (mut client, server) = tokio::io::duplex(4096);
    let client_side = tokio::spawn(async move {
        client.write_all(REQUEST).await.expect("write");
        assert!(read_response(&mut client).await, "first request answered");
        let answered = Instant::now();
        sleep(Duration::from_secs(45)).await;
        for b in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: "
            .iter()
            .chain(std::iter::repeat(&b'a'))
            .take(300)
        {
            if client.write_all(&[*b]).await.is_err() {
                break;
            }
            sleep(Duration::from_secs(1)).await;
        }
        (answered, Instant::now())
    });
    let why = serve(server, Duration::ZERO).await;
    let closed_at = Instant::now();
    let (answered, _) = client_side.await.expect("client task");
    assert_eq!(why, Some(Expiry::HeaderTimeout));
    let after = closed_at - answered;
    let want = Duration::from_secs(45) + HEADER;
    assert!(
        after >= want && after < want + Duration::from_millis(10),
        "closed {after:?} after the answer, want {want:?} (45 s idle + the 10 s header timeout)"
    );
}

/// 64 KiB answers through a 4 KiB pipe: the server's writes block until the client reads.
const BIG: usize = 64 * 1024;

#[tokio::test(start_paused = true)]
async fn a_client_that_never_reads_its_response_is_cut_at_the_send_timeout() {
    let (mut client, server) = tokio::io::duplex(4096);
    client.write_all(REQUEST).await.expect("write");
    let t0 = Instant::now();
    let answer = Bytes::from(vec![b'x'; BIG]);
    let served = serve_body(server, Duration::ZERO, CancellationToken::new(), answer);
    let why = tokio::time::timeout(SEND * 10, served).await;
    let closed = t0.elapsed();
    assert_eq!(why, Ok(Some(Expiry::SendTimeout)), "after {closed:?}");
    assert!(
        closed >= SEND && closed < SEND + Duration::from_secs(1),
        "closed after {closed:?}, want the 60 s send timeout from the first blocked write"
    );
    // The client still gets what was written before the close, then EOF.
    let mut got = Vec::new();
    client.read_to_end(&mut got).await.expect("read");
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        &got[..16.min(got.len())]
    );
    assert!(
        got.len() < BIG,
        "only part of the answer was written: {}",
        got.len()
    );
}

#[tokio::test(start_paused = true)]
async fn a_slow_reader_that_keeps_reading_is_not_cut() {
    let (mut client, server) = tokio::io::duplex(4096);
    let client_side = tokio::spawn(async move {
        client.write_all(REQUEST).await.expect("write");
        // 4 KiB every 50 s: each read unblocks the server's write within the 60 s send
        // timeout, though the whole answer takes ~13 minutes.
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while got.len() < BIG {
            sleep(Duration::from_secs(50)).await;
            match client.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        got.len()
    });
    let t0 = Instant::now();
    let answer = Bytes::from(vec![b'x'; BIG]);
    let why = serve_body(server, Duration::ZERO, CancellationToken::new(), answer).await;
    let read = client_side.await.expect("client task");
    assert_eq!(
        why, None,
        "ended because the client closed it, not at a limit"
    );
    assert!(read >= BIG, "the answer arrived: {read} bytes");
    assert!(
        t0.elapsed() > Duration::from_secs(600),
        "{:?}",
        t0.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_blocked_write_after_a_long_request_is_timed_from_its_own_start() {
    // The handler takes 300 s (a long generation, never cut), then answers 64 KiB to a client
    // that no longer reads: the send timeout runs from the blocked write, at 300 s, not from
    // the request.
    let (mut client, server) = tokio::io::duplex(4096);
    client.write_all(REQUEST).await.expect("write");
    let t0 = Instant::now();
    let answer = Bytes::from(vec![b'x'; BIG]);
    let served = serve_body(
        server,
        Duration::from_secs(300),
        CancellationToken::new(),
        answer,
    );
    let why = tokio::time::timeout(SEND * 10, served).await;
    let closed = t0.elapsed();
    assert_eq!(why, Ok(Some(Expiry::SendTimeout)), "after {closed:?}");
    let want = Duration::from_secs(300) + SEND;
    assert!(
        closed >= want && closed < want + Duration::from_secs(1),
        "closed after {closed:?}, want {want:?}"
    );
    drop(client);
}

/// An HTTP/2 client over `client` (prior knowledge) whose streams open a 65,535-byte window
/// (h2's default; the connection's is hyper's 5 MB): a stream whose body the client does not
/// read closes its window after 64 KiB.
async fn h2_client(
    client: DuplexStream,
) -> hyper::client::conn::http2::SendRequest<http_body_util::Empty<Bytes>> {
    let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(65_535)
        .handshake(TokioIo::new(client))
        .await
        .expect("h2 handshake");
    tokio::spawn(conn);
    send
}

/// A GET on an HTTP/2 connection; the response, its body unread.
async fn h2_get(
    mut send: hyper::client::conn::http2::SendRequest<http_body_util::Empty<Bytes>>,
) -> Response<Incoming> {
    send.ready().await.expect("h2 connection ready");
    let req = Request::get("http://x/")
        .body(http_body_util::Empty::new())
        .expect("request");
    let resp = send.send_request(req).await.expect("response");
    assert_eq!(resp.status(), 200);
    resp
}

/// 1 MiB answers for the HTTP/2 tests: a backend's body that gives it as one frame and then
/// a last byte (a stream: not ended by the large frame). The listener's body splits the frame
/// into 16 KiB pieces.
const H2_ANSWER: usize = (1 << 20) + 1;

fn h2_answer() -> ProxyBody {
    use http_body_util::BodyExt;
    let frames: Vec<Result<Frame<Bytes>, hyper::Error>> = vec![
        Ok(Frame::data(Bytes::from(vec![b'x'; 1 << 20]))),
        Ok(Frame::data(Bytes::from_static(b"\n"))),
    ];
    http_body_util::StreamBody::new(futures::stream::iter(frames)).boxed()
}

/// A connection served as a listener serves it, every request answered [`h2_answer`] at once,
/// over a pipe larger than the answer (the socket never blocks, only h2's flow control does):
/// the client's end, and the serving task.
fn serve_h2_answers() -> (DuplexStream, tokio::task::JoinHandle<Option<Expiry>>) {
    let (client, server) = tokio::io::duplex(4 << 20);
    let served = tokio::spawn(serve_with(
        server,
        Duration::ZERO,
        CancellationToken::new(),
        h2_answer,
    ));
    (client, served)
}

#[tokio::test(start_paused = true)]
async fn an_http2_stream_whose_window_stays_closed_is_cut_at_the_send_timeout() {
    let (client, served) = serve_h2_answers();
    let t0 = Instant::now();
    // The client keeps the response but reads none of its body (its connection task still
    // reads the socket and would answer PINGs).
    let resp = h2_get(h2_client(client).await).await;
    let why = tokio::time::timeout(SEND * 10, served)
        .await
        .expect("the connection was cut")
        .expect("server task");
    let closed = t0.elapsed();
    assert_eq!(why, Some(Expiry::SendTimeout), "after {closed:?}");
    assert!(
        closed >= SEND && closed < SEND + Duration::from_secs(1),
        "closed after {closed:?}, want the 60 s send timeout from the window's closing"
    );
    drop(resp);
}

#[tokio::test(start_paused = true)]
async fn http2_streams_that_keep_taking_their_answers_are_not_cut() {
    let (client, server) = tokio::io::duplex(4 << 20);
    // The handler first takes 120 s (a long generation: waiting for the backend is no stall).
    let served = tokio::spawn(serve_with(
        server,
        Duration::from_secs(120),
        CancellationToken::new(),
        h2_answer,
    ));
    let t0 = Instant::now();
    let send = h2_client(client).await;
    // Three streams on the connection, each read at 1.6 KB/s (16 KiB per 10 s, over 10 minutes
    // for the answer): every stream waits for its window most of the time, but each gets a
    // window update every ~20 s (the client sends one per 32 KiB read) and takes its next
    // pieces. (A client reading less than half its window per send timeout would be cut, as a
    // socket's writer waits for half the buffer to drain.)
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let send = send.clone();
            tokio::spawn(async move { read_slowly(h2_get(send).await.into_body()).await.0 })
        })
        .collect();
    for r in readers {
        assert_eq!(
            r.await.expect("reader"),
            H2_ANSWER,
            "a whole answer arrived"
        );
    }
    assert!(
        t0.elapsed() > Duration::from_secs(600),
        "{:?}",
        t0.elapsed()
    );
    assert!(
        !served.is_finished(),
        "the connection is still open: {:?}",
        served.await
    );
    drop(send);
}

/// Reads an HTTP/2 answer at 1.6 KB/s (16 KiB per 10 s: a slow client that keeps taking its
/// pieces); returns the bytes read and when the answer ended.
async fn read_slowly(body: Incoming) -> (usize, Instant) {
    let mut body = body;
    let mut got = 0usize;
    while let Some(frame) = http_body_util::BodyExt::frame(&mut body).await {
        let frame = frame.unwrap_or_else(|e| panic!("frame after {got} bytes: {e}"));
        if let Ok(data) = frame.into_data() {
            got += data.len();
            sleep(Duration::from_secs(10) * data.len() as u32 / 16_384).await;
        }
    }
    (got, Instant::now())
}

#[tokio::test(start_paused = true)]
async fn an_http2_stream_left_unread_beside_a_live_one_drains_the_connection() {
    let (client, served) = serve_h2_answers();
    let t0 = Instant::now();
    let send = h2_client(client).await;
    // One stream the client never reads (its window closes at once), one it reads slowly for
    // over 10 minutes: the live one keeps the connection progressing, so the stall rule alone
    // would never cut it, and the client could keep opening streams.
    let unread = h2_get(send.clone()).await;
    let live = tokio::spawn(read_slowly(h2_get(send.clone()).await.into_body()));
    sleep(Duration::from_secs(30)).await;
    drop(h2_get(send.clone()).await); // new streams are served before the drain
    sleep(Duration::from_secs(35)).await;
    // 65 s: the unread stream has waited the 60 s send timeout: GOAWAY, no new stream.
    let mut late = send.clone();
    let refused = match late.ready().await {
        Err(_) => true,
        Ok(()) => late
            .send_request(
                Request::get("http://x/")
                    .body(http_body_util::Empty::new())
                    .expect("request"),
            )
            .await
            .is_err(),
    };
    assert!(
        refused,
        "a new stream was accepted after the drain ({:?})",
        t0.elapsed()
    );
    assert!(
        !served.is_finished(),
        "the connection was cut, not drained: {:?}",
        served.await
    );
    // The live stream finishes; then nothing progresses, and the stall rule cuts the
    // connection (the unread stream's request with it) one send timeout later.
    let (got, done) = live.await.expect("live reader");
    assert_eq!(got, H2_ANSWER, "the live stream's whole answer arrived");
    assert!(done - t0 > Duration::from_secs(600), "{:?}", done - t0);
    assert!(
        !served.is_finished(),
        "cut before the live stream ended: {:?}",
        served.await
    );
    let why = tokio::time::timeout(SEND * 2, served)
        .await
        .expect("the connection was cut")
        .expect("server task");
    // The client reads its last 64 KiB window (40 s at its pace) after the server's last
    // progress, which the send timeout counts from.
    let after = done.elapsed();
    assert_eq!(
        why,
        Some(Expiry::SendTimeout),
        "{after:?} after the live stream"
    );
    assert!(
        after <= SEND + Duration::from_secs(1),
        "cut {after:?} after the live stream ended, want at most the send timeout"
    );
    drop(unread);
}

#[tokio::test(start_paused = true)]
async fn http2_answers_join_the_chunks_the_backend_already_sent() {
    use http_body_util::BodyExt;
    // 300 SSE-sized chunks, all ready at once (a stream running ahead of its client).
    fn events() -> ProxyBody {
        let frames: Vec<Result<Frame<Bytes>, hyper::Error>> = (0..300)
            .map(|i| {
                Ok(Frame::data(Bytes::from(format!(
                    "data: {{\"i\":{i:04}}}\n\n"
                ))))
            })
            .collect();
        http_body_util::StreamBody::new(futures::stream::iter(frames)).boxed()
    }
    let (client, server) = tokio::io::duplex(1 << 20);
    let served = tokio::spawn(serve_with(
        server,
        Duration::ZERO,
        CancellationToken::new(),
        events,
    ));
    let mut body = h2_get(h2_client(client).await).await.into_body();
    let (mut frames, mut got) = (0, Vec::new());
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("frame").into_data() {
            frames += 1;
            got.extend_from_slice(&data);
        }
    }
    let want: String = (0..300)
        .map(|i| format!("data: {{\"i\":{i:04}}}\n\n"))
        .collect();
    assert_eq!(String::from_utf8_lossy(&got), want, "every event, in order");
    // 64 chunks a piece at most: 5 DATA frames (one frame per chunk before: 300).
    assert_eq!(frames, 5, "DATA frames for 300 ready chunks");
    served.abort();
}

#[tokio::test(start_paused = true)]
async fn over_http2_only_a_header_block_is_timed_as_a_head() {
    let (mut client, server) = tokio::io::duplex(1 << 16);
    let served = tokio::spawn(serve(server, Duration::ZERO));
    client
        .write_all(crate::proxy::h2scan::PREFACE)
        .await
        .expect("preface");
    // An empty SETTINGS frame, then a PING every 5 s for 50 s: traffic on an idle connection,
    // not the start of a request head (before, the first one started the 10 s header timer).
    client
        .write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0])
        .await
        .expect("settings");
    for _ in 0..10 {
        sleep(Duration::from_secs(5)).await;
        client
            .write_all(&[0, 0, 8, 6, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8])
            .await
            .expect("ping");
    }
    assert!(
        !served.is_finished(),
        "cut while only PINGs arrived: {:?}",
        served.await
    );
    // A HEADERS frame (END_HEADERS) announcing 40 bytes, its payload trickled a byte per 2 s:
    // cut at the header timeout from the frame's arrival.
    client
        .write_all(&[0, 0, 40, 1, 4, 0, 0, 0, 1])
        .await
        .expect("headers");
    let t0 = Instant::now();
    let trickle = async {
        for _ in 0..40 {
            sleep(Duration::from_secs(2)).await;
            if client.write_all(&[0x82]).await.is_err() {
                break;
            }
        }
        sleep(IDLE).await;
    };
    tokio::select! {
        why = served => {
            let after = t0.elapsed();
            assert_eq!(why.expect("server task"), Some(Expiry::HeaderTimeout), "after {after:?}");
            assert!(
                after >= HEADER && after < HEADER + Duration::from_secs(1),
                "cut after {after:?}, want the 10 s header timeout"
            );
        }
        _ = trickle => panic!("a trickled HTTP/2 header block was not cut"),
    }
}

/// A request whose `X-Big` header is `len` bytes of `a`.
fn with_header(len: usize) -> Vec<u8> {
    let mut r = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
    r.extend(std::iter::repeat_n(b'a', len));
    r.extend_from_slice(b"\r\n\r\n");
    r
}

#[tokio::test(start_paused = true)]
async fn a_head_over_64_kib_is_answered_431_and_one_under_is_served() {
    // Under the bound (60 KiB of header): served, and the connection stays usable.
    let (mut client, server) = tokio::io::duplex(4096);
    let served = tokio::spawn(serve(server, Duration::ZERO));
    client
        .write_all(&with_header(60 * 1024))
        .await
        .expect("write");
    assert!(read_response(&mut client).await, "a 60 KiB head answered");
    client.write_all(REQUEST).await.expect("write");
    assert!(read_response(&mut client).await, "and the next request");
    drop(client);
    assert_eq!(served.await.expect("server task"), None);

    // Over it (200 KiB of header, which hyper's own ~400 KB buffer would take): answered 431
    // once 64 KiB were read; the rest of the head is taken and dropped (the client's writes
    // succeed, so it reads the answer rather than a reset), and the connection ends when the
    // client closes.
    let (mut client, server) = tokio::io::duplex(4096);
    let served = tokio::spawn(serve(server, Duration::ZERO));
    let t0 = Instant::now();
    let head = with_header(200 * 1024);
    for chunk in head.chunks(1024) {
        client
            .write_all(chunk)
            .await
            .expect("the whole head is taken");
    }
    let mut got = Vec::new();
    client.read_to_end(&mut got).await.expect("read the answer");
    let got = String::from_utf8_lossy(&got);
    assert!(
        got.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
        "{got}"
    );
    assert!(got.contains("\r\nconnection: close\r\n"), "{got}");
    let body: serde_json::Value =
        serde_json::from_str(got.split("\r\n\r\n").nth(1).expect("a body")).expect("JSON");
    assert_eq!(body["error"]["type"], "request_header_too_large", "{got}");
    assert_eq!(body["error"]["code"], 431);
    assert_eq!(body["error"]["party"], "client");
    drop(client);
    assert_eq!(
        served.await.expect("server task"),
        Some(Expiry::HeadTooLarge)
    );
    assert!(t0.elapsed() < HEADER, "ended by the client's close");

    // A head just over the bound sent at once (hyper takes it in a few growing reads, the last
    // one finishing it): refused too, not parsed and served.
    for len in [66_000, 70_000, 100_000] {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let served = tokio::spawn(serve(server, Duration::ZERO));
        client
            .write_all(&with_header(len))
            .await
            .expect("the whole head is taken");
        client.shutdown().await.expect("shutdown");
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.expect("read the answer");
        let got = String::from_utf8_lossy(&got);
        assert!(got.starts_with("HTTP/1.1 431 "), "{len}: {got}");
        assert_eq!(
            served.await.expect("server task"),
            Some(Expiry::HeadTooLarge),
            "{len}"
        );
    }

    // A client that keeps its connection open after the answer: ended at the header timeout
    // of its head, still reported as an oversized head.
    let (mut client, server) = tokio::io::duplex(4096);
    let served = tokio::spawn(serve(server, Duration::ZERO));
    let t0 = Instant::now();
    client
        .write_all(&with_header(100 * 1024))
        .await
        .expect("the whole head is taken");
    let why = served.await.expect("server task");
    assert_eq!(why, Some(Expiry::HeadTooLarge));
    let held = t0.elapsed();
    assert!(
        held >= HEADER && held < HEADER + Duration::from_secs(1),
        "{held:?}"
    );
    drop(client);
}

#[tokio::test(start_paused = true)]
async fn a_malformed_head_is_answered_400_by_hyper_and_reported() {
    let (mut client, server) = tokio::io::duplex(4096);
    let served = tokio::spawn(serve(server, Duration::ZERO));
    client
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n")
        .await
        .expect("write");
    let mut got = Vec::new();
    let _ = client.read_to_end(&mut got).await;
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 400"), "{got}");
    assert_eq!(served.await.expect("server task"), Some(Expiry::Malformed));
}
