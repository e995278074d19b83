//! KV events and their msgpack wire encoding, byte-compatible with vLLM 0.32's
//! `ZmqEventPublisher` (msgspec, default settings): see `../shared/golden/README.md` and
//! `vllm_kv_events_capture.json`.
//!
//! Batch = `[ts (float64), [events...], dp_rank]`. Map-shaped events (default) carry, in order:
//! - `BlockStored`: `type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!   medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind`;
//! - `BlockRemoved`: `type, block_hashes, medium, group_idx`;
//! - `AllBlocksCleared`: `type`.
//!
//! The legacy array shape (older vLLM, `--kv-events-legacy-array`) is `[tag, fields...]` with the
//! fields of vLLM 0.9: `BlockStored` `[tag, block_hashes, parent_block_hash, token_ids,
//! block_size, lora_id, medium]`, `BlockRemoved` `[tag, block_hashes, medium]`,
//! `AllBlocksCleared` `[tag]`. Integers use the shortest msgpack encoding; hashes are u64
//! (last 8 digest bytes, big-endian) or raw digest bytes.

use rmp::encode::{self, ValueWriteError};

use super::prompt::Digest;

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks became full and cached (one event per request per step).
    BlockStored {
        /// Digests of the stored blocks, in order.
        hashes: Vec<Digest>,
        /// Digest of the block before the first stored one; `None` when the first is block 0.
        parent: Option<Digest>,
        /// All tokens of the stored blocks (`hashes.len() × block_size`).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// LoRA adapter name, if any.
        lora_name: Option<String>,
        /// Published extra keys, one entry per stored block.
        extra_keys: Vec<Option<Vec<String>>>,
    },
    /// A cached free block was reused for new data (one block per event, lazily).
    BlockRemoved {
        /// The evicted block's digest.
        hash: Digest,
    },
    /// The prefix cache was reset.
    AllBlocksCleared,
}

/// Wire options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireFormat {
    /// u64 hashes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, default) or raw bytes.
    pub int_hashes: bool,
    /// Legacy array-shaped events instead of maps.
    pub legacy_array: bool,
}

impl Default for WireFormat {
    fn default() -> Self {
        Self {
            int_hashes: true,
            legacy_array: false,
        }
    }
}

/// Encodes one batch `[ts, events, dp_rank]` (`dp_rank` `None` → nil).
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    dp_rank: Option<u32>,
    fmt: WireFormat,
) -> Result<Vec<u8>, ValueWriteError> {
    let mut w = Vec::with_capacity(256);
    encode::write_array_len(&mut w, 3)?;
    encode::write_f64(&mut w, ts)?;
    encode::write_array_len(&mut w, len32(events.len()))?;
    for ev in events {
        write_event(&mut w, ev, fmt)?;
    }
    match dp_rank {
        Some(r) => encode::write_uint(&mut w, u64::from(r)).map(|_| ())?,
        None => nil(&mut w)?,
    }
    Ok(w)
}

fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn write_event(w: &mut Vec<u8>, ev: &KvEvent, fmt: WireFormat) -> Result<(), ValueWriteError> {
    match ev {
        KvEvent::BlockStored { .. } => write_stored(w, ev, fmt),
        KvEvent::BlockRemoved { hash } => write_removed(w, hash, fmt),
        KvEvent::AllBlocksCleared => {
            if fmt.legacy_array {
                encode::write_array_len(w, 1)?;
            } else {
                encode::write_map_len(w, 1)?;
                encode::write_str(w, "type")?;
            }
            encode::write_str(w, "AllBlocksCleared")
        }
    }
}

fn write_removed(w: &mut Vec<u8>, hash: &Digest, fmt: WireFormat) -> Result<(), ValueWriteError> {
    if fmt.legacy_array {
        encode::write_array_len(w, 3)?;
        encode::write_str(w, "BlockRemoved")?;
        write_hashes(w, std::slice::from_ref(hash), fmt)?;
        return encode::write_str(w, "GPU");
    }
    encode::write_map_len(w, 4)?;
    key_str(w, "type", "BlockRemoved")?;
    encode::write_str(w, "block_hashes")?;
    write_hashes(w, std::slice::from_ref(hash), fmt)?;
    key_str(w, "medium", "GPU")?;
    encode::write_str(w, "group_idx")?;
    encode::write_uint(w, 0).map(|_| ())
}

fn write_stored(w: &mut Vec<u8>, ev: &KvEvent, fmt: WireFormat) -> Result<(), ValueWriteError> {
    let KvEvent::BlockStored {
        hashes,
        parent,
        token_ids,
        block_size,
        lora_name,
        extra_keys,
    } = ev
    else {
        return Ok(());
    };
    if fmt.legacy_array {
        encode::write_array_len(w, 7)?;
        encode::write_str(w, "BlockStored")?;
    } else {
        encode::write_map_len(w, 11)?;
        key_str(w, "type", "BlockStored")?;
        encode::write_str(w, "block_hashes")?;
    }
    write_hashes(w, hashes, fmt)?;
    if !fmt.legacy_array {
        encode::write_str(w, "parent_block_hash")?;
    }
    match parent {
        Some(p) => write_hash(w, p, fmt)?,
        None => nil(w)?,
    }
    if !fmt.legacy_array {
        encode::write_str(w, "token_ids")?;
    }
    encode::write_array_len(w, len32(token_ids.len()))?;
    for t in token_ids {
        encode::write_uint(w, u64::from(*t))?;
    }
    if !fmt.legacy_array {
        encode::write_str(w, "block_size")?;
    }
    encode::write_uint(w, *block_size as u64)?;
    if !fmt.legacy_array {
        encode::write_str(w, "lora_id")?;
    }
    match lora_name {
        Some(_) => encode::write_uint(w, 1).map(|_| ())?,
        None => nil(w)?,
    }
    if fmt.legacy_array {
        return encode::write_str(w, "GPU");
    }
    key_str(w, "medium", "GPU")?;
    encode::write_str(w, "lora_name")?;
    opt_str(w, lora_name.as_deref())?;
    encode::write_str(w, "extra_keys")?;
    write_extra_keys(w, extra_keys)?;
    encode::write_str(w, "group_idx")?;
    encode::write_uint(w, 0)?;
    key_str(w, "kv_cache_spec_kind", "full_attention")
}

fn write_extra_keys(w: &mut Vec<u8>, keys: &[Option<Vec<String>>]) -> Result<(), ValueWriteError> {
    encode::write_array_len(w, len32(keys.len()))?;
    for k in keys {
        match k {
            None => nil(w)?,
            Some(list) => {
                encode::write_array_len(w, len32(list.len()))?;
                for s in list {
                    encode::write_str(w, s)?;
                }
            }
        }
    }
    Ok(())
}

fn nil(w: &mut Vec<u8>) -> Result<(), ValueWriteError> {
    encode::write_nil(w).map_err(ValueWriteError::InvalidMarkerWrite)
}

fn key_str(w: &mut Vec<u8>, k: &str, v: &str) -> Result<(), ValueWriteError> {
    encode::write_str(w, k)?;
    encode::write_str(w, v)
}

fn opt_str(w: &mut Vec<u8>, v: Option<&str>) -> Result<(), ValueWriteError> {
    match v {
        Some(s) => encode::write_str(w, s),
        None => nil(w),
    }
}

fn write_hashes(w: &mut Vec<u8>, hs: &[Digest], fmt: WireFormat) -> Result<(), ValueWriteError> {
    encode::write_array_len(w, len32(hs.len()))?;
    hs.iter().try_for_each(|h| write_hash(w, h, fmt))
}

fn write_hash(w: &mut Vec<u8>, h: &Digest, fmt: WireFormat) -> Result<(), ValueWriteError> {
    if fmt.int_hashes {
        encode::write_uint(w, h.wire_u64()).map(|_| ())
    } else {
        encode::write_bin(w, h.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn digest_with_tail(tail: u64) -> Digest {
        let mut v = vec![0u8; 24];
        v.extend_from_slice(&tail.to_be_bytes());
        Digest::from_bytes(&v)
    }

    #[test]
    fn removed_and_cleared_match_vllm_bytes() {
        // ../shared/golden/vllm_kv_events_encoding.json, batch "removed_and_cleared".
        let evs = [
            KvEvent::BlockRemoved {
                hash: digest_with_tail(0x1234567890abcdef),
            },
            KvEvent::AllBlocksCleared,
        ];
        let b = encode_batch(1_700_000_003.0, &evs, Some(0), WireFormat::default()).expect("enc");
        assert_eq!(
            hex(&b),
            "93cb41d954fc40c000009284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573\
             91cf1234567890abcdefa66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c42\
             6c6f636b73436c656172656400"
        );
    }

    #[test]
    fn nil_dp_rank_encodes_as_nil() {
        let b = encode_batch(
            0.0,
            &[KvEvent::AllBlocksCleared],
            None,
            WireFormat::default(),
        )
        .expect("enc");
        assert_eq!(
            hex(&b),
            "93cb00000000000000009181a474797065b0416c6c426c6f636b73436c6561726564c0"
        );
    }
}
