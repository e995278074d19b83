//! KV-cache-aware routing (tier 1.5): block hashing with vLLM's and SGLang's contracts,
//! tokenization with the model's own tokenizer and chat template, KV-event decoding and
//! subscribers, the per-service block index, and selection with the guard ladder and blend laws.
//!
//! See `README.md` in this folder for the data structures, event semantics and complexity.

pub mod block_hash;
pub mod cross;
pub mod index;
pub mod ingest;
pub mod lora;
pub mod members;
pub mod metrics;
pub mod readiness;
pub mod route;
pub mod settings;
pub mod state;
#[cfg(test)]
pub(crate) mod testutil;
pub mod tokenizer;
pub mod wiring;

/// The 64-bit block id engines publish and the index is keyed by: for vLLM the last 8 digest
/// bytes read big-endian (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, often above `i64::MAX`); for
/// SGLang the first 8 digest bytes read big-endian (published as a signed i64, stored here as
/// its two's-complement u64).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct BlockKey(pub u64);

/// A block hash exactly as an engine put it on the wire: an integer key, or raw digest bytes
/// (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). Convert with [`EngineBlockHash::key`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EngineBlockHash {
    /// An integer hash (u64; negative msgpack ints are taken as their two's complement).
    Int(u64),
    /// Raw digest bytes.
    Bytes(Vec<u8>),
}

impl EngineBlockHash {
    /// The index key: the integer itself, or the last 8 bytes of a digest read big-endian
    /// (vLLM's rule; digests shorter than 8 bytes are left-padded with zeros).
    pub fn key(&self) -> BlockKey {
        match self {
            EngineBlockHash::Int(v) => BlockKey(*v),
            EngineBlockHash::Bytes(b) => {
                let mut buf = [0u8; 8];
                let tail = &b[b.len().saturating_sub(8)..];
                buf[8 - tail.len()..].copy_from_slice(tail);
                BlockKey(u64::from_be_bytes(buf))
            }
        }
    }
}
