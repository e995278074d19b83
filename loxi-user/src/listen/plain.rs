//! Plain HTTP on a TLS port: telling a plain-HTTP client from a TLS one by its first bytes
//! ([`plain_http`]) and answering it `400` before closing ([`answer_400_and_close`]), or, for
//! an HTTP/2 prior-knowledge (h2c) client, a GOAWAY saying why ([`answer_goaway_and_close`]).
//! Used by
//! the fullproxy's TLS listeners (`crate::proxy::listener`, `crate::proxy::tls`) and the HTTPS
//! REST API (`crate::api::tls`), so it lives below both.

use std::time::Duration;

use tokio::net::TcpStream;

/// The HTTP/2 connection preface (RFC 9113 §3.4) a prior-knowledge (h2c) client opens with.
pub const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What the first bytes of a connection on a TLS port are: `None` for a TLS client (or
/// one too short to tell yet), else the plain-HTTP client it is. `PRI` (the start of the
/// HTTP/2 preface, not an HTTP/1 method) is HTTP/2; any other upper-case start an HTTP/1 method.
pub fn plain_http_kind(first: &[u8]) -> Option<PlainHttp> {
    match first.first() {
        Some(b) if b.is_ascii_uppercase() => {}
        _ => return None,
    }
    let n = first.len().min(H2_PREFACE.len());
    if n >= 3 && first[..n] == H2_PREFACE[..n] {
        Some(PlainHttp::H2)
    } else {
        Some(PlainHttp::H1)
    }
}

/// A plain-HTTP client on a TLS listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlainHttp {
    /// An HTTP/1 request line.
    H1,
    /// The HTTP/2 prior-knowledge preface.
    H2,
}

/// Which plain-HTTP client `stream` is (the fullproxy's TLS listeners and the HTTPS API ask):
/// `None` for a TLS client (its first byte, peeked, not
/// consumed, is not an upper-case letter). A plain-HTTP client is refused either way, so the
/// bytes that tell the HTTP/2 preface's `PRI` from an HTTP/1 method are then read (consumed;
/// each read waits for data, within the caller's handshake timeout, so a client that sends
/// `P` and stops costs one waiting read, not a polling loop).
pub async fn plain_http(stream: &mut TcpStream) -> Option<PlainHttp> {
    use tokio::io::AsyncReadExt;
    let mut first = [0u8; 1];
    if !matches!(stream.peek(&mut first).await, Ok(1) if first[0].is_ascii_uppercase()) {
        return None;
    }
    let mut head = [0u8; 3];
    let mut n = 0;
    while n < head.len() && H2_PREFACE.starts_with(&head[..n]) {
        match stream.read(&mut head[n..]).await {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    Some(plain_http_kind(&head[..n]).unwrap_or(PlainHttp::H1))
}

/// Reads (and drops) up to 64 KiB for at most a second before closing: closing with the
/// request unread would reset the connection, and the client could lose the answer.
pub async fn linger(mut stream: TcpStream) {
    use tokio::io::AsyncReadExt;
    let mut sink = [0u8; 4096];
    let mut left = 64 << 10;
    let drain = async {
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left -= n.min(left),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// Answers a plain-HTTP client on a TLS port with `400 Bad Request`, `content_type` and
/// `body`, `Connection: close`, then closes lingering (the request is drained, not read, so
/// that the close does not reset the connection before the client reads the answer).
pub async fn answer_400_and_close(mut stream: TcpStream, content_type: &str, body: &str) {
    use tokio::io::AsyncWriteExt;
    let head = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.shutdown().await;
    linger(stream).await;
}

/// The bytes answering an HTTP/2 prior-knowledge (h2c) client on a TLS port: the server's
/// connection preface (an empty SETTINGS frame) and a GOAWAY (last stream 0, error
/// `PROTOCOL_ERROR`) whose debug data is `debug` (RFC 9113 §6.5, §6.8), which clients such as
/// curl and nghttp show.
pub fn h2_goaway(debug: &str) -> Vec<u8> {
    let debug = debug.as_bytes();
    let mut out = Vec::with_capacity(9 + 9 + 8 + debug.len());
    // SETTINGS: length 0, type 0x4, flags 0, stream 0.
    out.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    let len = 8 + debug.len();
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8]);
    // GOAWAY: type 0x7, flags 0, stream 0; last stream id 0; PROTOCOL_ERROR (0x1).
    out.extend_from_slice(&[0x7, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0x1]);
    out.extend_from_slice(debug);
    out
}

/// Answers an HTTP/2 prior-knowledge (h2c) client on a TLS port with [`h2_goaway`] of `debug`
/// and closes, lingering as [`answer_400_and_close`] does.
pub async fn answer_goaway_and_close(mut stream: TcpStream, debug: &str) {
    use tokio::io::AsyncWriteExt;
    let _ = stream.write_all(&h2_goaway(debug)).await;
    let _ = stream.shutdown().await;
    linger(stream).await;
}
