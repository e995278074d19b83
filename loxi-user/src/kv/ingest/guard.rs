//! A message-size guard in front of the `zeromq` crate's KV-event sockets.
//!
//! The crate's ZMTP decoder (`zeromq` 0.7, `ZmqCodec::decode`) reserves the length a frame
//! header claims before any of its bytes arrive, so a peer claiming 2^60 bytes aborts the whole
//! process on the failed allocation, and it buffers the frames of a multipart message without
//! limit. Each KV stream and each replay fetch therefore connects its socket to a [`Guard`]: a
//! relay on a loopback port that connects to the real publisher, forwards the bytes of both
//! directions unchanged, and follows the publisher's direction as far as ZMTP 3 framing (RFC
//! 23/ZMTP: a 64-byte greeting, then frames of a flags byte, a 1- or 8-byte big-endian length
//! and the body). A frame or a multipart message over the guard's limit
//! ([`MAX_MESSAGE_BYTES`] for event streams) closes both connections before a byte of that
//! frame reaches the crate, and is reported as a [`Cut`]. The crate then sees a disconnect and
//! reconnects, and the stream's sequence rules repair or clear what was lost: a hostile or
//! broken publisher costs routing quality, never the gateway.
//!
//! The relay connects to the publisher only when the crate connects to it, and closes the
//! crate's connection when the publisher cannot be reached, so the crate's `Connected` event
//! (sent after the ZMTP handshake) still means the publisher answered. It relays only this
//! process's own connections ([`is_own_connection`], one `inet_diag` query per connection):
//! another local process connecting to the loopback port is reset at once, so it can neither
//! hold descriptors nor read the stream.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// Largest frame, and largest multipart message, a KV event stream or replay accepts: 16 MiB.
/// A vLLM `KVEventBatch` holds one scheduler step's events (a 128k-token prefill in 16-token
/// blocks is about 1 MB of msgpack), so this is far above real batches. What one message
/// costs decoded is bounded by its value count ([`super::events::MAX_BATCH_VALUES`]), not by
/// this: 16 MiB of 1-byte values would decode to gigabytes.
pub const MAX_MESSAGE_BYTES: u64 = 16 << 20;

/// Most frames one multipart message may have: an event is 3 frames (`[topic, seq, payload]`),
/// a replay reply at most 4 (`[b"", topic, seq, payload]`). Without a bound, frames of 0 or 1
/// bytes stay under [`MAX_MESSAGE_BYTES`] while the crate keeps a handle (tens of bytes) per
/// frame: gigabytes within seconds.
pub const MAX_MESSAGE_FRAMES: u32 = 8;

/// How long the relay waits for the publisher's TCP connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A relayed connection closed because the publisher sent more than the limit. Its text names
/// the bound that was crossed: the message's bytes (`limit`) or its frames
/// ([`MAX_MESSAGE_FRAMES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct Cut {
    /// The length the offending frame's header claims, in bytes.
    pub frame: u64,
    /// The bytes of its multipart message so far, that frame included.
    pub message: u64,
    /// The frames of its multipart message so far, that frame included.
    pub frames: u32,
    /// The byte limit, in bytes.
    pub limit: u64,
}

impl Cut {
    /// The text of the cut: which bound, and the sizes that crossed it.
    fn describe(&self) -> String {
        if self.frames > MAX_MESSAGE_FRAMES {
            format!(
                "a ZMTP message of {} frames so far is over the bound of {MAX_MESSAGE_FRAMES} \
                 frames a message (its frame {} has {} bytes)",
                self.frames, self.frames, self.frame
            )
        } else if self.frame > self.limit {
            format!(
                "a ZMTP frame of {} bytes is over the bound of {} bytes",
                self.frame, self.limit
            )
        } else {
            format!(
                "a ZMTP frame of {} bytes takes its message to {} bytes, over the bound of {} \
                 bytes a message",
                self.frame, self.message, self.limit
            )
        }
    }
}

/// A running relay: a loopback listener whose every connection is relayed to one publisher.
/// Dropping it stops the listener and closes every relayed connection.
pub struct Guard {
    addr: SocketAddr,
    cuts: mpsc::Receiver<Cut>,
    /// The accept loop; dropping the set aborts it, and its relays with their own set.
    _task: JoinSet<()>,
}

impl Guard {
    /// Binds `127.0.0.1:0` (`[::1]:0` on a host without IPv4 loopback) and relays each
    /// connection accepted there to `publisher` (`host:port`, resolved per connection), cutting
    /// it at `limit` bytes per frame or multipart message.
    ///
    /// Errors: neither loopback bind succeeding (the IPv6 one's error).
    pub async fn start(publisher: String, limit: u64) -> std::io::Result<Self> {
        let listener = match TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await {
            Ok(l) => l,
            Err(_) => TcpListener::bind((std::net::Ipv6Addr::LOCALHOST, 0)).await?,
        };
        let addr = listener.local_addr()?;
        let (tx, cuts) = mpsc::channel(16);
        let mut task = JoinSet::new();
        task.spawn(accept_loop(listener, addr, publisher, limit, tx));
        Ok(Self {
            addr,
            cuts,
            _task: task,
        })
    }

    /// The loopback address to connect the `zeromq` socket to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `tcp://` endpoint of [`Self::addr`], for `Socket::connect`.
    pub fn endpoint(&self) -> String {
        format!("tcp://{}", self.addr)
    }

    /// The next connection cut for size (pending forever when there is none).
    pub async fn next_cut(&mut self) -> Cut {
        match self.cuts.recv().await {
            Some(c) => c,
            None => std::future::pending().await,
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    at: SocketAddr,
    publisher: String,
    limit: u64,
    cuts: mpsc::Sender<Cut>,
) {
    let mut relays = JoinSet::new();
    let (mut foreign_logged, mut unchecked_logged) = (false, false);
    let mut own_uid = None;
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((down, peer)) => {
                    match is_own_connection(peer, at, &mut own_uid) {
                        Ok(true) => {}
                        Ok(false) => {
                            // Another local process: reset at once (no TIME_WAIT entry), so
                            // it can neither hold the daemon's descriptors nor read the
                            // engine's stream through it.
                            if !std::mem::replace(&mut foreign_logged, true) {
                                tracing::warn!(%publisher, %peer, "kv event relay: a connection not from this process refused");
                            }
                            let _ = down.set_zero_linger();
                            continue;
                        }
                        // The check itself failed (no inet_diag in this kernel, /proc not
                        // mounted): relayed, as before the check existed, rather than losing
                        // the stream; said once.
                        Err(e) => {
                            if !std::mem::replace(&mut unchecked_logged, true) {
                                tracing::warn!(%publisher, %peer, error = %e, "kv event relay: cannot tell whether a connection is this process's own; relaying unchecked");
                            }
                        }
                    }
                    let publisher = publisher.clone();
                    let cuts = cuts.clone();
                    relays.spawn(async move {
                        match relay(down, &publisher, limit).await {
                            Err(RelayEnd::Cut(c)) => {
                                // Full only when the stream stopped reading cuts; it counts
                                // the ones it reads.
                                let _ = cuts.try_send(c);
                            }
                            Err(RelayEnd::Io(e)) => {
                                tracing::debug!(%publisher, error = %e, "kv event relay closed");
                            }
                            Ok(()) => {}
                        }
                    });
                }
                Err(e) => {
                    // EMFILE and the like: back off instead of spinning.
                    tracing::warn!(%publisher, error = %e, "kv event relay accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = relays.join_next(), if !relays.is_empty() => {}
        }
    }
}

/// Whether the TCP connection whose client end is `peer`, connected to `listener`, is a socket
/// of this process. One `NETLINK_SOCK_DIAG` query ([`tcp_socket_owner`], for that exact
/// 4-tuple) gives the client socket's owner uid and inode: another uid is refused at that cost
/// alone, whatever the size of the host's socket table (a flood of
/// foreign connects must not starve the crate's own reconnect); a socket of this uid must
/// also be one of `/proc/self/fd`. The client's socket exists, connected, before the listener
/// accepts it. Errors: the netlink query or `/proc` failing (the caller then relays the
/// connection unchecked, with one warning, rather than losing the stream).
///
/// `own_uid` caches this process's socket uid, read once from the first accepted end (the
/// kernel stamps every socket of the process with the same one).
fn is_own_connection(
    peer: SocketAddr,
    listener: SocketAddr,
    own_uid: &mut Option<u32>,
) -> std::io::Result<bool> {
    let Some((uid, inode)) = tcp_socket_owner(peer, listener)? else {
        return Ok(false);
    };
    let own = match *own_uid {
        Some(u) => u,
        // This process's uid, as the kernel stamped it on the accepted (server) end.
        None => match tcp_socket_owner(listener, peer)? {
            Some((u, _)) => *own_uid.insert(u),
            None => return Ok(false),
        },
    };
    if own != uid {
        return Ok(false);
    }
    let target = format!("socket:[{inode}]");
    for fd in std::fs::read_dir("/proc/self/fd")? {
        let Ok(fd) = fd else { continue };
        if std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == target.as_str()) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Owner uid and inode of this network namespace's TCP socket whose local end is `local` and
/// remote end `remote`, from one `inet_diag` request (`netlink-packet-sock-diag` messages on a
/// `NETLINK_SOCK_DIAG` socket); `None` when there is no such socket (the kernel answers
/// `ENOENT`). Both addresses must be of one family.
fn tcp_socket_owner(local: SocketAddr, remote: SocketAddr) -> std::io::Result<Option<(u32, u64)>> {
    use netlink_packet_core::{NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
    use netlink_packet_sock_diag::{
        AF_INET, AF_INET6, IPPROTO_TCP, SockDiagMessage,
        inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
    };
    use netlink_sys::{Socket, SocketAddr as NlAddr, protocols::NETLINK_SOCK_DIAG};
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST;
    let mut req = NetlinkMessage::new(
        header,
        SockDiagMessage::InetRequest(InetRequest {
            family: if local.is_ipv4() { AF_INET } else { AF_INET6 },
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::all(),
            socket_id: SocketId {
                source_port: local.port(),
                destination_port: remote.port(),
                source_address: local.ip(),
                destination_address: remote.ip(),
                interface_id: 0,
                // No cookie: the socket is named by its 4-tuple.
                cookie: [0xff; 8],
            },
        })
        .into(),
    );
    req.finalize();
    let mut out = vec![0; req.buffer_len()];
    req.serialize(&mut out);
    let mut sock = Socket::new(NETLINK_SOCK_DIAG)?;
    sock.bind_auto()?;
    sock.connect(&NlAddr::new(0, 0))?;
    sock.send(&out, 0)?;
    let mut buf = Vec::with_capacity(4096);
    sock.recv(&mut buf, 0)?;
    let answer = NetlinkMessage::<SockDiagMessage>::deserialize(&buf)
        .map_err(|e| std::io::Error::other(format!("inet_diag answer: {e}")))?;
    match answer.payload {
        NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
            Ok(Some((r.header.uid, u64::from(r.header.inode))))
        }
        NetlinkPayload::Error(e) if e.raw_code() == -libc::ENOENT => Ok(None),
        NetlinkPayload::Error(e) => Err(e.to_io()),
        other => Err(std::io::Error::other(format!(
            "unexpected inet_diag answer {other:?}"
        ))),
    }
}

enum RelayEnd {
    Cut(Cut),
    Io(std::io::Error),
}

impl From<std::io::Error> for RelayEnd {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

/// Relays `down` (the crate's connection) to a new connection to `publisher` until either side
/// closes or the publisher's side goes past `limit`.
async fn relay(down: TcpStream, publisher: &str, limit: u64) -> Result<(), RelayEnd> {
    let up = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(publisher))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
    up.set_nodelay(true)?;
    down.set_nodelay(true)?;
    let (mut up_r, mut up_w) = up.into_split();
    let (mut down_r, mut down_w) = down.into_split();
    let to_publisher = async {
        tokio::io::copy(&mut down_r, &mut up_w).await?;
        Ok::<(), RelayEnd>(())
    };
    let from_publisher = async {
        let mut framing = Framing::new(limit);
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = up_r.read(&mut buf).await?;
            if n == 0 {
                return Ok::<(), RelayEnd>(());
            }
            framing.feed(&buf[..n]).map_err(RelayEnd::Cut)?;
            down_w.write_all(&buf[..n]).await?;
        }
    };
    tokio::select! {
        r = to_publisher => r,
        r = from_publisher => r,
    }
}

/// Where [`Framing`] is in the byte stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    /// Inside the 64-byte greeting.
    Greeting,
    /// At a frame's flags byte.
    Flags,
    /// Inside a frame's length field.
    Len,
    /// Inside a frame's body.
    Body,
}

/// ZMTP 3 framing of one direction of a connection, followed byte by byte without buffering.
#[derive(Debug)]
pub struct Framing {
    at: At,
    /// Bytes left in the current greeting, length field or body.
    left: u64,
    long: bool,
    more: bool,
    command: bool,
    len: u64,
    /// Bytes of the current multipart message so far.
    message: u64,
    /// Frames of the current multipart message so far.
    frames: u32,
    limit: u64,
}

impl Framing {
    /// A connection's start, before the greeting; frames and messages over `limit` bytes are
    /// refused.
    pub fn new(limit: u64) -> Self {
        Self {
            at: At::Greeting,
            left: 64,
            long: false,
            more: false,
            command: false,
            len: 0,
            message: 0,
            frames: 0,
            limit,
        }
    }

    /// Follows `bytes`, the next bytes of the stream. Errors: a frame header claiming more than
    /// the limit, a multipart message's frames adding up to more, or a message of more than
    /// [`MAX_MESSAGE_FRAMES`] frames (checked at each header, before its body).
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<(), Cut> {
        while !bytes.is_empty() {
            match self.at {
                At::Greeting | At::Body => {
                    let take = self.left.min(bytes.len() as u64);
                    bytes = &bytes[usize::try_from(take).unwrap_or(bytes.len())..];
                    self.left -= take;
                    if self.left == 0 {
                        self.frame_done();
                    }
                }
                At::Flags => {
                    let flags = bytes[0];
                    bytes = &bytes[1..];
                    self.more = flags & 0b001 != 0;
                    self.long = flags & 0b010 != 0;
                    self.command = flags & 0b100 != 0;
                    self.at = At::Len;
                    self.left = if self.long { 8 } else { 1 };
                    self.len = 0;
                }
                At::Len => {
                    self.len = (self.len << 8) | u64::from(bytes[0]);
                    bytes = &bytes[1..];
                    self.left -= 1;
                    if self.left == 0 {
                        self.header_done()?;
                    }
                }
            }
        }
        Ok(())
    }

    fn header_done(&mut self) -> Result<(), Cut> {
        let (message, frames) = if self.command {
            (self.len, 1)
        } else {
            (self.message.saturating_add(self.len), self.frames + 1)
        };
        if message > self.limit || frames > MAX_MESSAGE_FRAMES {
            return Err(Cut {
                frame: self.len,
                message,
                frames,
                limit: self.limit,
            });
        }
        if !self.command {
            self.message = message;
            self.frames = frames;
        }
        self.at = At::Body;
        self.left = self.len;
        if self.left == 0 {
            self.frame_done();
        }
        Ok(())
    }

    /// The greeting or a frame's body ended.
    fn frame_done(&mut self) {
        if self.at == At::Body && !self.command && !self.more {
            self.message = 0;
            self.frames = 0;
        }
        self.at = At::Flags;
    }
}

#[cfg(test)]
#[path = "guard_tests.rs"]
mod tests;
