//! A minimal ZMTP 3.0 client (NULL mechanism) for the two sockets the KV path needs: SUB
//! (engine event stream) and DEALER (engine replay ROUTER). Wire format: RFC 23/ZMTP
//! (<https://rfc.zeromq.org/spec/23/>): 64-byte greeting, `READY` command with `Socket-Type`,
//! then frames `flags(1) size(1|8) body`, flag bits MORE = 1, LONG = 2, COMMAND = 4. A ZMTP 3.0
//! subscriber subscribes by sending the message `\x01<topic>` (empty topic = everything).
//!
//! Why not the `zeromq` crate (0.4.1, the workspace pin): its `SubSocket` never reconnects after
//! the publisher goes away and reports no disconnect (no monitor event), so an engine restart
//! would silently stop the stream; and its `recv` reaches `todo!()` (a panic) on an unexpected
//! frame kind or when its peer set becomes empty (`sub.rs` lines 194 and 198). Owning the
//! connection lets the subscriber see EOF, reconnect with backoff, and never panic on bad input.
//! Interoperability is tested against real libzmq (pyzmq) PUB/XPUB and ROUTER sockets.

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest frame accepted (64 MiB): a bigger size field is treated as a corrupt stream.
pub const MAX_FRAME: u64 = 64 << 20;

/// ZMTP errors.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// Socket error (connect refused, reset, EOF).
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The peer spoke something other than ZMTP 3.x with the NULL mechanism.
    #[error("protocol: {0}")]
    Protocol(&'static str),
}

/// One ZMTP connection.
pub struct Conn {
    io: TcpStream,
    buf: BytesMut,
}

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    frame(0x04, &body)
}

fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 9);
    if body.len() > 255 {
        out.push(flags | 0x02);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
    out
}

impl Conn {
    /// Connects to `addr` (`host:port`) and completes the handshake as `socket_type`
    /// (`SUB` or `DEALER`).
    pub async fn connect(addr: &str, socket_type: &str) -> Result<Self, ZmtpError> {
        let mut io = TcpStream::connect(addr).await?;
        io.set_nodelay(true)?;
        io.write_all(&greeting()).await?;
        let mut peer = [0u8; 64];
        io.read_exact(&mut peer).await?;
        if peer[0] != 0xFF || peer[9] != 0x7F || peer[10] < 3 {
            return Err(ZmtpError::Protocol("not a ZMTP 3 greeting"));
        }
        if &peer[12..16] != b"NULL" {
            return Err(ZmtpError::Protocol("peer mechanism is not NULL"));
        }
        io.write_all(&ready(socket_type)).await?;
        let mut conn = Self {
            io,
            buf: BytesMut::with_capacity(64 << 10),
        };
        let (flags, _) = conn.read_frame().await?;
        if flags & 0x04 == 0 {
            return Err(ZmtpError::Protocol("expected READY command"));
        }
        Ok(conn)
    }

    /// Subscribes to every topic (SUB).
    pub async fn subscribe_all(&mut self) -> Result<(), ZmtpError> {
        self.io.write_all(&frame(0, &[1])).await?;
        Ok(())
    }

    /// Sends one multipart message.
    pub async fn send(&mut self, parts: &[&[u8]]) -> Result<(), ZmtpError> {
        let mut out = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            let more = if i + 1 < parts.len() { 1 } else { 0 };
            out.extend(frame(more, p));
        }
        self.io.write_all(&out).await?;
        Ok(())
    }

    /// Receives one multipart message (commands in between are skipped).
    pub async fn recv(&mut self) -> Result<Vec<Vec<u8>>, ZmtpError> {
        let mut parts = Vec::new();
        loop {
            let (flags, body) = self.read_frame().await?;
            if flags & 0x04 != 0 {
                continue;
            }
            parts.push(body);
            if flags & 0x01 == 0 {
                return Ok(parts);
            }
        }
    }

    async fn fill(&mut self, n: usize) -> Result<(), ZmtpError> {
        while self.buf.len() < n {
            if self.io.read_buf(&mut self.buf).await? == 0 {
                return Err(ZmtpError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
        }
        Ok(())
    }

    async fn read_frame(&mut self) -> Result<(u8, Vec<u8>), ZmtpError> {
        self.fill(2).await?;
        let flags = self.buf[0];
        let (hdr, len) = if flags & 0x02 != 0 {
            self.fill(9).await?;
            let mut l = [0u8; 8];
            l.copy_from_slice(&self.buf[1..9]);
            (9, u64::from_be_bytes(l))
        } else {
            (2, u64::from(self.buf[1]))
        };
        if len > MAX_FRAME {
            return Err(ZmtpError::Protocol("frame larger than 64 MiB"));
        }
        self.fill(hdr + len as usize).await?;
        self.buf.advance(hdr);
        Ok((flags, self.buf.split_to(len as usize).to_vec()))
    }
}
