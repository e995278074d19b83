use super::*;

/// A ZMTP 3.0 NULL greeting.
pub(crate) fn greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A frame: flags (more, long chosen by the body's size), length, body.
pub(crate) fn frame(body: &[u8], more: bool) -> Vec<u8> {
    let more = u8::from(more);
    let mut f = Vec::with_capacity(body.len() + 9);
    if let Ok(short) = u8::try_from(body.len()) {
        f.extend([more, short]);
    } else {
        f.push(more | 0b010);
        f.extend((body.len() as u64).to_be_bytes());
    }
    f.extend_from_slice(body);
    f
}

/// A long frame header claiming `len` bytes (no body).
pub(crate) fn long_header(len: u64, more: bool) -> Vec<u8> {
    let mut f = vec![u8::from(more) | 0b010];
    f.extend(len.to_be_bytes());
    f
}

/// A PUB's READY command.
pub(crate) fn ready_pub() -> Vec<u8> {
    let mut body = vec![5];
    body.extend(b"READY");
    body.push(11);
    body.extend(b"Socket-Type");
    body.extend(3u32.to_be_bytes());
    body.extend(b"PUB");
    let mut f = vec![0b100, u8::try_from(body.len()).expect("short")];
    f.extend(body);
    f
}

/// Feeds `stream` in pieces of `step` bytes.
fn feed_in_steps(limit: u64, stream: &[u8], step: usize) -> Result<(), Cut> {
    let mut f = Framing::new(limit);
    for piece in stream.chunks(step) {
        f.feed(piece)?;
    }
    Ok(())
}

#[test]
fn framing_follows_greeting_commands_and_messages_split_anywhere() {
    let mut stream = greeting();
    stream.extend(ready_pub());
    for _ in 0..3 {
        stream.extend(frame(b"kv", true));
        stream.extend(frame(&7u64.to_be_bytes(), true));
        stream.extend(frame(&[0xc1; 300], false));
    }
    stream.extend(frame(&[], false));
    // 1 KiB limit: each message is 310 bytes; three of them in a row stay separate.
    for step in [1, 2, 7, 64, 65, 4096] {
        assert_eq!(feed_in_steps(1024, &stream, step), Ok(()), "step {step}");
    }
    // One byte past the end of the greeting must be read as a flags byte, not skipped: a
    // header claiming 2 KiB right after the greeting is caught.
    let mut bad = greeting();
    bad.extend(long_header(2048, false));
    assert_eq!(
        feed_in_steps(1024, &bad, 1),
        Err(Cut {
            frame: 2048,
            message: 2048,
            frames: 1,
            limit: 1024
        })
    );
}

#[test]
fn a_huge_frame_header_is_cut_before_its_body() {
    let mut stream = greeting();
    stream.extend(ready_pub());
    stream.extend(long_header(1 << 60, false));
    let err = feed_in_steps(MAX_MESSAGE_BYTES, &stream, 5).expect_err("cut");
    assert_eq!(err.frame, 1 << 60);
    // u64::MAX does not wrap the message total.
    let mut stream = greeting();
    stream.extend(frame(b"kv", true));
    stream.extend(long_header(u64::MAX, false));
    let err = feed_in_steps(MAX_MESSAGE_BYTES, &stream, 3).expect_err("cut");
    assert_eq!(err.message, u64::MAX);
}

#[test]
fn a_multipart_message_is_bounded_as_a_whole_and_a_command_alone() {
    let limit = 1000;
    let mut stream = greeting();
    stream.extend(frame(&[1; 400], true));
    stream.extend(frame(&[2; 400], true));
    stream.extend(frame(&[3; 201], false));
    assert_eq!(
        feed_in_steps(limit, &stream, 100),
        Err(Cut {
            frame: 201,
            message: 1001,
            frames: 3,
            limit
        })
    );
    // The same three frames as separate messages pass, and a command between frames of a
    // message is not added to it.
    let mut stream = greeting();
    stream.extend(frame(&[1; 400], false));
    stream.extend(frame(&[2; 400], true));
    stream.extend(ready_pub());
    stream.extend(frame(&[3; 500], false));
    assert_eq!(feed_in_steps(limit, &stream, 33), Ok(()));
    let mut stream = greeting();
    let mut cmd = vec![0b110];
    cmd.extend(1001u64.to_be_bytes());
    stream.extend(cmd);
    assert_eq!(
        feed_in_steps(limit, &stream, 1).map_err(|c| c.frame),
        Err(1001)
    );
}

/// Frames of 0 or 1 bytes add (almost) nothing to a message's size but cost the crate a handle
/// each: a message is cut at its 9th frame, whatever their size; a command alone is one frame.
#[test]
fn a_message_of_many_tiny_frames_is_cut_at_its_frame_bound() {
    let mut stream = greeting();
    for _ in 0..MAX_MESSAGE_FRAMES - 1 {
        stream.extend(frame(&[], true));
    }
    stream.extend(frame(b"x", false));
    for _ in 0..MAX_MESSAGE_FRAMES {
        stream.extend(frame(b"y", true));
        stream.extend(ready_pub());
    }
    assert_eq!(
        feed_in_steps(MAX_MESSAGE_BYTES, &stream, 3),
        Ok(()),
        "8 frames per message, commands between them not counted"
    );
    stream.extend(frame(&[], true));
    assert_eq!(
        feed_in_steps(MAX_MESSAGE_BYTES, &stream, 3).map_err(|c| (c.frames, c.message)),
        Err((MAX_MESSAGE_FRAMES + 1, u64::from(MAX_MESSAGE_FRAMES)))
    );
}

/// Another process connecting to the relay's port is reset at once and never relayed, whether
/// it runs as this process's user (its socket is in no fd of this process) or as another
/// (`nobody`, as root only: CI is root); the publisher sees no connection, while one from this
/// process is relayed.
#[tokio::test]
async fn a_connection_from_another_process_is_refused() {
    use std::os::unix::fs::MetadataExt as _;
    use tokio::io::AsyncReadExt as _;
    let publisher = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let guard = Guard::start(publisher.local_addr().expect("addr").to_string(), 1024)
        .await
        .expect("guard");
    let script = format!(
        "import socket\ns = socket.create_connection(('127.0.0.1', {}))\ns.settimeout(5)\n\
         try:\n    print(len(s.recv(16)))\nexcept ConnectionResetError:\n    print('reset')",
        guard.addr().port()
    );
    let root = std::fs::metadata("/proc/self").expect("proc").uid() == 0;
    assert!(
        root || std::env::var_os("CI").is_none(),
        "CI runs as root: the other-user case must run"
    );
    let mut runs: Vec<Vec<&str>> = vec![vec!["python3", "-c", &script]];
    if root {
        runs.push(vec![
            // The system interpreter: a user's pyenv shims are not readable by `nobody`.
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            &script,
        ]);
    }
    for argv in runs {
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::process::Command::new(argv[0])
                .args(&argv[1..])
                .output(),
        )
        .await
        .expect("python3 within 10 s")
        .expect("run python3");
        let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(
            said == "reset" || said == "0",
            "{argv:?}: closed at once, got {said:?}, stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(300), publisher.accept())
                .await
                .is_err(),
            "{argv:?}: the foreign connection was relayed to the publisher"
        );
    }
    let mut own = TcpStream::connect(guard.addr()).await.expect("connect");
    let (mut upstream, _) = tokio::time::timeout(Duration::from_secs(5), publisher.accept())
        .await
        .expect("this process's connection is relayed")
        .expect("accept");
    use tokio::io::AsyncWriteExt as _;
    upstream.write_all(b"hello").await.expect("write");
    let mut got = [0u8; 5];
    own.read_exact(&mut got).await.expect("read");
    assert_eq!(&got, b"hello");
}

/// The `inet_diag` query finds this process's own connection (its uid, an inode of
/// `/proc/self/fd`) and nothing for a 4-tuple that does not exist.
#[tokio::test]
async fn the_socket_owner_query_finds_this_process_s_connection() {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let at = l.local_addr().expect("addr");
    let c = TcpStream::connect(at).await.expect("connect");
    let (_s, peer) = l.accept().await.expect("accept");
    assert_eq!(peer, c.local_addr().expect("local"));
    let (uid, inode) = tcp_socket_owner(peer, at).expect("query").expect("found");
    use std::os::unix::fs::MetadataExt as _;
    assert_eq!(uid, std::fs::metadata("/proc/self").expect("proc").uid());
    assert!(inode > 0);
    let mut own_uid = None;
    assert!(is_own_connection(peer, at, &mut own_uid).expect("check"));
    assert_eq!(own_uid, Some(uid), "the accepted end's uid, cached");
    let nobody: SocketAddr = "127.0.0.1:1".parse().expect("addr");
    assert_eq!(tcp_socket_owner(nobody, at).expect("query"), None);
    assert!(!is_own_connection(nobody, at, &mut own_uid).expect("check"));
}

/// The relay forwards both directions byte for byte, reports a cut for an oversized frame
/// before forwarding any of it, and closes both connections.
#[tokio::test]
async fn the_relay_forwards_both_ways_and_cuts_an_oversized_frame() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let publisher = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let mut guard = Guard::start(publisher.local_addr().expect("addr").to_string(), 1024)
        .await
        .expect("guard");
    let mut sub = TcpStream::connect(guard.addr()).await.expect("connect");
    let (mut pubs, _) = publisher.accept().await.expect("accept");
    sub.write_all(b"from the subscriber").await.expect("write");
    let mut got = [0u8; 19];
    pubs.read_exact(&mut got).await.expect("read");
    assert_eq!(&got, b"from the subscriber");
    let mut ok = greeting();
    ok.extend(frame(&[9; 1000], false));
    pubs.write_all(&ok).await.expect("write");
    let mut got = vec![0u8; ok.len()];
    sub.read_exact(&mut got).await.expect("read");
    assert_eq!(got, ok);
    pubs.write_all(&long_header(1025, false))
        .await
        .expect("write");
    pubs.write_all(&[7; 1025]).await.expect("write");
    let cut = tokio::time::timeout(Duration::from_secs(5), guard.next_cut())
        .await
        .expect("cut reported");
    assert_eq!(cut.frame, 1025);
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), sub.read_to_end(&mut rest))
        .await
        .expect("closed")
        .expect("read");
    assert!(
        rest.is_empty(),
        "{} bytes of the cut frame forwarded",
        rest.len()
    );
}

/// A publisher that cannot be reached closes the subscriber's connection at once, so the crate's
/// handshake fails rather than waiting.
#[tokio::test]
async fn an_unreachable_publisher_closes_the_relayed_connection() {
    use tokio::io::AsyncReadExt as _;
    let gone = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = gone.local_addr().expect("addr");
    drop(gone);
    let guard = Guard::start(addr.to_string(), 1024).await.expect("guard");
    let mut sub = TcpStream::connect(guard.addr()).await.expect("connect");
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), sub.read_to_end(&mut rest))
        .await
        .expect("closed within 5 s");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
}

/// The defect this guard exists for: a publisher whose frame header claims 2^60 bytes. Without
/// the guard the `zeromq` crate reserves that much and the process aborts. Through it the
/// connection is cut and counted, the crate reconnects, and the publisher's next batch is
/// applied.
///
/// The header comes in the greeting's write, so the cut lands while the crate's connect is
/// still in its handshake: it must be counted then too (it was not, and this publisher, which
/// waits for the count before serving the next connection, starved). The publisher serves
/// every connection it accepts, as a real PUB does: the crate (or the stream's rebuild of its
/// socket, on a loaded machine) may open a connection and drop it before the publisher gets to
/// it, so "the second accept is the reconnect" does not hold. Each connection gets the huge
/// header until a cut has been counted, then the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(
    clippy::disallowed_methods,
    reason = "the stream under test and the publisher; both end with the test"
)]
async fn a_publisher_claiming_a_huge_frame_is_cut_and_its_stream_goes_on() {
    use crate::kv::ingest::subscriber::{Stream, StreamAddr, StreamTiming};
    use crate::kv::metrics::EpReasonLabels;
    use crate::kv::settings::KvSettings;
    use crate::kv::testutil::{rule, state, stored_batch};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio_util::sync::CancellationToken;

    let publisher = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let (state, _reg) = state(KvSettings::default());
    let svc = state
        .service(&rule(1, 1, serde_json::json!({"kvBlockSize": 16})))
        .expect("kv rule");
    let addr = StreamAddr {
        member: 0,
        rank: 0,
        publisher: publisher.local_addr().expect("addr").to_string(),
        replay: None,
    };
    let timing = StreamTiming {
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        ..StreamTiming::default()
    };
    let rejected = {
        let state = state.clone();
        move || {
            state
                .metrics
                .events_rejected
                .get_or_create(&EpReasonLabels {
                    service: "1".into(),
                    ep: "0".into(),
                    reason: "frame_size".into(),
                })
                .get()
        }
    };
    let cancel = CancellationToken::new();
    tokio::spawn(Stream::new(state.clone(), svc.clone(), addr, timing).run(cancel.clone()));
    let serving = tokio::spawn({
        let rejected = rejected.clone();
        async move {
            let mut batch = frame(b"kv", true);
            batch.extend(frame(&0u64.to_be_bytes(), true));
            batch.extend(frame(&stored_batch(&[5], 16), false));
            // Connections that got the batch stay open, so the stream stays connected.
            let mut kept = Vec::new();
            loop {
                let Ok((mut c, _)) = publisher.accept().await else {
                    continue;
                };
                let mut out = greeting();
                out.extend(ready_pub());
                if rejected() == 0 {
                    out.extend(long_header(1 << 60, false));
                    if c.write_all(&out).await.is_ok() {
                        // The relay closes a cut connection (and one whose crate side went);
                        // the cut is counted when the stream reads it from the guard.
                        let mut sink = Vec::new();
                        let _ = c.read_to_end(&mut sink).await;
                        for _ in 0..1000 {
                            if rejected() > 0 {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                } else {
                    out.extend(&batch);
                    if c.write_all(&out).await.is_ok() {
                        kept.push(c);
                    }
                }
            }
        }
    });

    for _ in 0..1000 {
        if !svc.index.keys_of(0).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    serving.abort();
    cancel.cancel();
    let held: Vec<u64> = svc.index.keys_of(0).into_iter().map(|k| k.0).collect();
    assert_eq!(held, vec![5], "the batch after the cut is applied");
    assert_eq!(rejected(), 1, "one cut, counted once");
}

/// A cut's text names the bound that was crossed: the frame alone, the message's bytes, or its
/// frame count (a 1-byte frame in a 9-frame message is cut for frames, not bytes).
#[test]
fn a_cut_says_which_bound_was_crossed() {
    let text = |frame, message, frames| {
        Cut {
            frame,
            message,
            frames,
            limit: 1000,
        }
        .to_string()
    };
    assert_eq!(
        text(1, 10, 9),
        "a ZMTP message of 9 frames so far is over the bound of 8 frames a message (its frame 9 \
         has 1 bytes)"
    );
    assert_eq!(
        text(2048, 2048, 1),
        "a ZMTP frame of 2048 bytes is over the bound of 1000 bytes"
    );
    assert_eq!(
        text(201, 1001, 3),
        "a ZMTP frame of 201 bytes takes its message to 1001 bytes, over the bound of 1000 bytes \
         a message"
    );
}
