//! A real libzmq KV-event publisher for the integration tests: `tests/py/kv_pub.py` (pyzmq)
//! driven over stdin, standing in for one engine's `--kv-events-config` ZMQ PUB socket, plus
//! the vLLM wire encoding of a `BlockStored` batch.

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// One pyzmq publisher bound on `host:port` (killed on drop).
pub struct Publisher {
    _child: Child,
    stdin: ChildStdin,
    out: Lines<BufReader<ChildStdout>>,
    seq: u64,
}

impl Publisher {
    /// Starts `kv_pub.py --host host --port port` and waits for its `ready` line.
    pub async fn start(host: &str, port: u16) -> Self {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/py/kv_pub.py");
        let mut child = Command::new("python3")
            .args([script, "--host", host, "--port", &port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn python3 kv_pub.py (pyzmq: scripts/setup.sh)");
        let stdin = child.stdin.take().expect("stdin");
        let out = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut p = Self {
            _child: child,
            stdin,
            out,
            seq: 0,
        };
        assert!(p.line().await.starts_with("ready"));
        p
    }

    async fn line(&mut self) -> String {
        tokio::time::timeout(Duration::from_secs(15), self.out.next_line())
            .await
            .expect("publisher answered in time")
            .expect("read publisher")
            .expect("publisher alive")
    }

    /// Waits for the line `want` (`subscribed` once a SUB socket subscribed).
    pub async fn wait_for(&mut self, want: &str) {
        while self.line().await != want {}
    }

    async fn command(&mut self, cmd: Value) {
        self.stdin
            .write_all(format!("{cmd}\n").as_bytes())
            .await
            .expect("write to publisher");
        self.wait_for("ok").await;
    }

    /// Publishes arbitrary frames (hex strings), e.g. a captured engine frame.
    pub async fn raw(&mut self, frames_hex: &Value) {
        self.command(json!({"op": "raw", "frames_hex": frames_hex}))
            .await;
    }

    /// Publishes `payload` as `[b"kv", seq, payload]` with the next sequence number (from 0).
    pub async fn send(&mut self, payload: &[u8]) {
        let seq = self.seq;
        self.seq += 1;
        self.command(json!({"op": "send", "seq": seq, "payload_hex": hex(payload)}))
            .await;
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// vLLM's payload for one map-shaped `BlockStored` event: `[ts, [event], dp_rank 0]` with the
/// stored blocks' keys, the parent's key (`None` at a chain root), their tokens and block size.
pub fn block_stored_batch(
    keys: &[u64],
    parent: Option<u64>,
    token_ids: &[u32],
    block_size: u32,
) -> Vec<u8> {
    use rmpv::Value as V;
    let ev = V::Map(vec![
        (V::from("type"), V::from("BlockStored")),
        (
            V::from("block_hashes"),
            V::Array(keys.iter().map(|&k| V::from(k)).collect()),
        ),
        (V::from("parent_block_hash"), parent.map_or(V::Nil, V::from)),
        (
            V::from("token_ids"),
            V::Array(token_ids.iter().map(|&t| V::from(t)).collect()),
        ),
        (V::from("block_size"), V::from(block_size)),
        (V::from("lora_id"), V::Nil),
        (V::from("medium"), V::from("GPU")),
    ]);
    let batch = V::Array(vec![V::F64(0.0), V::Array(vec![ev]), V::from(0)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("encode msgpack");
    out
}
