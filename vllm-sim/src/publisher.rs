//! ZMQ publisher of KV-event batches, as vLLM's `ZmqEventPublisher`: a PUB socket sending
//! `[topic, seq (u64 big-endian, from 0), payload]` and, when configured, a ROUTER replay socket.
//!
//! Replay (`../shared/golden/README.md`): a DEALER sends `[b"", start_seq (8 bytes BE)]`; the
//! ROUTER answers one `[b"", topic, seq, payload]` per buffered batch with `seq >= start_seq`,
//! then the end marker `[b"", b"", ff×8, b""]`.
//!
//! Endpoints: `tcp://*:P` binds all interfaces (`0.0.0.0`); a concrete address binds that
//! address (vLLM would connect instead; an emulator only needs to be reachable). Port 0 lets
//! the OS choose; the bound endpoints are returned.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::config::KvEventsConfig;

/// Errors starting the publisher.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Binding a socket failed.
    #[error("kv events: bind {endpoint}: {source}")]
    Bind {
        /// The endpoint.
        endpoint: String,
        /// The cause.
        #[source]
        source: zeromq::ZmqError,
    },
    /// Only the `zmq` publisher exists.
    #[error("kv events: publisher {0:?} is not supported (use \"zmq\")")]
    Publisher(String),
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Handle to the publisher task: send encoded batches, in order.
#[derive(Debug, Clone)]
pub struct Publisher {
    tx: mpsc::UnboundedSender<Vec<u8>>,
}

/// Where the sockets ended up bound.
#[derive(Debug, Clone)]
pub struct BoundEndpoints {
    /// PUB endpoint, e.g. `tcp://127.0.0.1:40123`.
    pub publisher: String,
    /// ROUTER replay endpoint, when configured.
    pub replay: Option<String>,
}

impl Publisher {
    /// Binds the sockets of `cfg` and starts the publishing and replay tasks.
    pub async fn start(cfg: &KvEventsConfig) -> Result<(Self, BoundEndpoints), PublishError> {
        if cfg.publisher != "zmq" {
            return Err(PublishError::Publisher(cfg.publisher.clone()));
        }
        let mut socket = PubSocket::new();
        let publisher = bind(&mut socket, &cfg.endpoint).await?;
        let buffer: Buffer = Arc::default();
        let topic = Bytes::from(cfg.topic.clone().into_bytes());
        let replay = match &cfg.replay_endpoint {
            Some(ep) => {
                let mut router = RouterSocket::new();
                let bound = bind(&mut router, ep).await?;
                tokio::spawn(serve_replay(router, topic.clone(), buffer.clone()));
                Some(bound)
            }
            None => None,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let cap = cfg.buffer_steps.max(1);
        tokio::spawn(publish_loop(socket, rx, topic, buffer, cap));
        Ok((Self { tx }, BoundEndpoints { publisher, replay }))
    }

    /// Queues one encoded batch; it gets the next sequence number.
    pub fn publish(&self, payload: Vec<u8>) {
        if self.tx.send(payload).is_err() {
            tracing::warn!("kv events publisher task is gone; batch dropped");
        }
    }
}

async fn bind<S: Socket>(socket: &mut S, endpoint: &str) -> Result<String, PublishError> {
    let ep = endpoint.replace("tcp://*:", "tcp://0.0.0.0:");
    socket
        .bind(&ep)
        .await
        .map(|b| b.to_string())
        .map_err(|source| PublishError::Bind {
            endpoint: endpoint.to_string(),
            source,
        })
}

async fn publish_loop(
    mut socket: PubSocket,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
    topic: Bytes,
    buffer: Buffer,
    cap: usize,
) {
    let mut seq: u64 = 0;
    while let Some(payload) = rx.recv().await {
        let payload = Bytes::from(payload);
        {
            let mut buf = buffer.lock();
            buf.push_back((seq, payload.clone()));
            while buf.len() > cap {
                buf.pop_front();
            }
        }
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        if let Ok(msg) = ZmqMessage::try_from(frames)
            && let Err(e) = socket.send(msg).await
        {
            tracing::warn!(error = %e, "kv events: publish failed");
        }
        seq += 1;
    }
}

async fn serve_replay(mut router: RouterSocket, topic: Bytes, buffer: Buffer) {
    while let Ok(req) = router.recv().await {
        let frames = req.into_vec();
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            tracing::warn!("kv replay: request without an 8-byte start sequence");
            continue;
        };
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let reply = vec![
                identity.clone(),
                Bytes::new(),
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            send_reply(&mut router, reply).await;
        }
        let end = vec![
            identity.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::from_static(&[0xff; 8]),
            Bytes::new(),
        ];
        send_reply(&mut router, end).await;
    }
}

async fn send_reply(router: &mut RouterSocket, frames: Vec<Bytes>) {
    if let Ok(msg) = ZmqMessage::try_from(frames)
        && let Err(e) = router.send(msg).await
    {
        tracing::warn!(error = %e, "kv replay: send failed");
    }
}
