//! Decoding of vLLM's KV-event batches (msgpack), tolerant of every shape vLLM has published.
//!
//! Contract (`../shared/golden/README.md`, vLLM 0.32 `ZmqEventPublisher`): a batch is the
//! msgpack array `[ts (float), events (array), dp_rank (int or nil)]`; older releases sent only
//! `[ts, events]`. Each event is either a map with `"type"` (current) or a tagged array
//! `[tag, ...fields]` (legacy `array_like` structs):
//!
//! | event              | map keys read                                                   | array layout |
//! |--------------------|-----------------------------------------------------------------|--------------|
//! | `BlockStored`      | `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`, `extra_keys`, `group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, `locality`, `ownership` | `[tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality, ownership, ...]` |
//! | `BlockRemoved`     | `block_hashes`, `medium`, `group_idx`                           | `[tag, block_hashes, medium, group_idx, ...]` |
//! | `AllBlocksCleared` | none                                                            | `[tag, ...]` |
//!
//! Hashes are ints (u64, values above `i64::MAX` included; negative ints are taken as their
//! two's complement) or byte strings ([`EngineBlockHash`]). Unknown keys and trailing array
//! elements are ignored. A malformed event becomes an `Err` entry in [`EventBatch::events`];
//! the other events of the batch are still returned. Nothing here panics on any input.

use rmpv::Value;

use crate::kv::EngineBlockHash;

/// Why an event (or a whole batch) could not be decoded. Names the offending field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// The payload is not valid msgpack.
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    /// The batch is not `[ts, events]` / `[ts, events, dp_rank]`.
    #[error("batch envelope: {0}")]
    Envelope(&'static str),
    /// An event has no recognisable type tag.
    #[error("event has no type tag")]
    NoType,
    /// An event's type tag is not one we know.
    #[error("unknown event type {0:?}")]
    UnknownType(String),
    /// The payload holds more msgpack values than [`MAX_BATCH_VALUES`] (counted before it is
    /// decoded: decoded, each value costs tens of bytes and each event slot more).
    #[error("batch of more than {MAX_BATCH_VALUES} msgpack values")]
    TooManyValues,
    /// The events array holds more than [`MAX_BATCH_EVENTS`] entries (each decodes into a
    /// slot of a few hundred bytes, even a nil).
    #[error("batch of {0} events (at most {MAX_BATCH_EVENTS})")]
    TooManyEvents(usize),
    /// A field is missing or has the wrong msgpack type.
    #[error("event field `{field}`: {problem}")]
    Field {
        /// The field name as vLLM spells it.
        field: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
}

/// One decoded KV event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks became full and cached.
    BlockStored(BlockStored),
    /// Cached blocks were evicted (vLLM sends one per event, lazily on reuse).
    BlockRemoved {
        /// The removed blocks.
        block_hashes: Vec<EngineBlockHash>,
        /// The tier they left (`None` = GPU, vLLM's default).
        medium: Medium,
        /// The KV cache group they belonged to (`None`: a single-group model).
        group_idx: Option<u32>,
    },
    /// The engine reset its prefix cache.
    AllBlocksCleared,
}

/// Where an engine holds a block (`medium` on `BlockStored` / `BlockRemoved`): `"GPU"` (and an
/// absent or nil field, vLLM's default) is the device tier; `"CPU"` is the host offload tier
/// (`OffloadingConnector`); any other value (`"DISK"`, a remote store) is kept by name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Medium {
    /// Device memory: a prefix hit costs nothing.
    #[default]
    Gpu,
    /// Host memory: a hit loads the blocks back (cheaper than recompute).
    Cpu,
    /// Another tier, by the name the engine published.
    Other(String),
}

impl Medium {
    /// The medium a published name means (case-insensitive; nil/absent = GPU).
    pub fn from_name(name: Option<&str>) -> Self {
        match name {
            None => Medium::Gpu,
            Some(n) if n.eq_ignore_ascii_case("gpu") => Medium::Gpu,
            Some(n) if n.eq_ignore_ascii_case("cpu") => Medium::Cpu,
            Some(n) => Medium::Other(n.to_owned()),
        }
    }
}

/// Fields of a `BlockStored` event that routing and the parity check use.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// One hash per stored block, in chain order.
    pub block_hashes: Vec<EngineBlockHash>,
    /// Parent of the first block (`None` = the chain starts at NONE_HASH).
    pub parent_block_hash: Option<EngineBlockHash>,
    /// All tokens of the stored blocks (`block_size` per block), possibly empty.
    pub token_ids: Vec<u32>,
    /// Tokens per block as the engine reports it.
    pub block_size: Option<u32>,
    /// LoRA adapter id, if any.
    pub lora_id: Option<i64>,
    /// LoRA adapter name, if any.
    pub lora_name: Option<String>,
    /// Published extra keys, one entry per block (`null` or an untagged tuple: LoRA name,
    /// multimodal `(identifier, offset)` pairs, cache salt string, prompt-embeddings bytes;
    /// interpreted by the parity check). Kept raw; `None` when absent.
    pub extra_keys: Option<Vec<Value>>,
    /// The tier holding the blocks.
    pub medium: Medium,
    /// The KV cache group (hybrid models publish one event per group; `None`: single group).
    pub group_idx: Option<u32>,
    /// The group's cache spec kind (`full_attention`, `mla_attention`, `sliding_window`,
    /// `chunked_local_attention`, `mamba`, ...); `None` when not published.
    pub kv_cache_spec_kind: Option<String>,
    /// The sliding window of a sliding-window group, in tokens.
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// `locality` (published by some engines; informational).
    pub locality: Option<String>,
    /// `ownership` (published by some engines; informational).
    pub ownership: Option<String>,
}

/// A decoded batch: `[ts, events, dp_rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine timestamp (seconds since the epoch, float).
    pub ts: f64,
    /// Events in order; malformed ones are `Err` and must be counted, not applied.
    pub events: Vec<Result<KvEvent, EventError>>,
    /// Data-parallel rank (`None` when the envelope has 2 elements or a nil rank).
    pub dp_rank: Option<u32>,
}

/// Nesting limit for a batch: real batches nest 6 deep (batch, events, event, extra_keys,
/// per-block entry, tuple); the limit keeps hostile payloads from exhausting the stack.
const MAX_DEPTH: usize = 32;

/// Decodes one msgpack batch payload (the third frame of a ZMQ message).
///
/// Errors only when the envelope itself is unusable; per-event problems are returned inside
/// [`EventBatch::events`].
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, EventError> {
    count_values(payload, MAX_BATCH_VALUES)?;
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| EventError::Msgpack(e.to_string()))?;
    let Value::Array(parts) = value else {
        return Err(EventError::Envelope("not an array"));
    };
    if parts.len() < 2 {
        return Err(EventError::Envelope("fewer than 2 elements"));
    }
    let ts = number_f64(&parts[0]).ok_or(EventError::Envelope("ts is not a number"))?;
    let Value::Array(raw_events) = &parts[1] else {
        return Err(EventError::Envelope("events is not an array"));
    };
    if raw_events.len() > MAX_BATCH_EVENTS {
        return Err(EventError::TooManyEvents(raw_events.len()));
    }
    let dp_rank = match parts.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or(EventError::Envelope("dp_rank is not a small unsigned int"))?,
        ),
    };
    let events = raw_events.iter().map(decode_event).collect();
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
    })
}

/// Most msgpack values (every scalar, string, array and map counts one) one batch may hold:
/// 2^20, about 40 MB decoded. A vLLM batch is one scheduler step's events, a token id and a
/// block hash one value each, so even a step of 100k prefill tokens is far below; a 16 MiB
/// payload of 1-byte nils (16.7 M events) decoded to about 4.9 GB before this bound.
pub const MAX_BATCH_VALUES: u64 = 1 << 20;

/// Most events one batch may hold: 65,536 (a step has one event per request and kind, a few
/// hundred at most). With [`MAX_BATCH_VALUES`] a batch decodes to tens of MB at most; 2^21
/// nil events, under the value bound of the time, took 626 MB.
pub const MAX_BATCH_EVENTS: usize = 1 << 16;

/// Walks the msgpack values at the start of `payload` without decoding them and fails when
/// there are more than `limit`. Errors: [`EventError::TooManyValues`]; a truncated payload or
/// a reserved marker is [`EventError::Msgpack`] (as the decoder would report it).
fn count_values(payload: &[u8], limit: u64) -> Result<(), EventError> {
    use rmp::Marker as M;
    let truncated = || EventError::Msgpack("truncated".into());
    let mut at = 0usize;
    // Big-endian unsigned of `n` bytes at `at`, advancing past it.
    let uint = |at: &mut usize, n: usize| -> Result<u64, EventError> {
        let b = payload.get(*at..*at + n).ok_or_else(truncated)?;
        *at += n;
        Ok(b.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
    };
    let (mut pending, mut seen) = (1u64, 0u64);
    while pending > 0 {
        pending -= 1;
        seen += 1;
        if seen > limit {
            return Err(EventError::TooManyValues);
        }
        let marker = M::from_u8(*payload.get(at).ok_or_else(truncated)?);
        at += 1;
        // (bytes to skip, values it contains)
        let (skip, items) = match marker {
            M::FixPos(_) | M::FixNeg(_) | M::Null | M::True | M::False => (0, 0),
            M::U8 | M::I8 => (1, 0),
            M::U16 | M::I16 => (2, 0),
            M::U32 | M::I32 | M::F32 => (4, 0),
            M::U64 | M::I64 | M::F64 => (8, 0),
            M::FixExt1 => (2, 0),
            M::FixExt2 => (3, 0),
            M::FixExt4 => (5, 0),
            M::FixExt8 => (9, 0),
            M::FixExt16 => (17, 0),
            M::FixStr(n) => (u64::from(n), 0),
            M::Str8 | M::Bin8 => (uint(&mut at, 1)?, 0),
            M::Str16 | M::Bin16 => (uint(&mut at, 2)?, 0),
            M::Str32 | M::Bin32 => (uint(&mut at, 4)?, 0),
            M::Ext8 => (uint(&mut at, 1)? + 1, 0),
            M::Ext16 => (uint(&mut at, 2)? + 1, 0),
            M::Ext32 => (uint(&mut at, 4)? + 1, 0),
            M::FixArray(n) => (0, u64::from(n)),
            M::Array16 => (0, uint(&mut at, 2)?),
            M::Array32 => (0, uint(&mut at, 4)?),
            M::FixMap(n) => (0, 2 * u64::from(n)),
            M::Map16 => (0, 2 * uint(&mut at, 2)?),
            M::Map32 => (0, 2 * uint(&mut at, 4)?),
            M::Reserved => return Err(EventError::Msgpack("reserved marker 0xc1".into())),
        };
        at = usize::try_from(skip)
            .ok()
            .and_then(|s| at.checked_add(s))
            .filter(|&end| end <= payload.len())
            .ok_or_else(truncated)?;
        pending += items;
    }
    Ok(())
}

fn number_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F64(f) => Some(*f),
        Value::F32(f) => Some(f64::from(*f)),
        Value::Integer(i) => i.as_f64(),
        _ => None,
    }
}

/// Decodes one event, map- or array-shaped.
pub fn decode_event(v: &Value) -> Result<KvEvent, EventError> {
    match v {
        Value::Map(_) => decode_map_event(v),
        Value::Array(items) => decode_array_event(items),
        _ => Err(EventError::NoType),
    }
}

fn map_get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    let Value::Map(entries) = v else { return None };
    entries
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, val)| val)
}

fn decode_map_event(v: &Value) -> Result<KvEvent, EventError> {
    let tag = map_get(v, "type")
        .and_then(Value::as_str)
        .ok_or(EventError::NoType)?;
    let get = |k| map_get(v, k);
    match tag {
        "BlockStored" => Ok(KvEvent::BlockStored(BlockStored {
            block_hashes: hash_list(get("block_hashes"))?,
            parent_block_hash: opt_hash(get("parent_block_hash"), "parent_block_hash")?,
            token_ids: token_list(get("token_ids"))?,
            block_size: opt_u32(get("block_size"), "block_size")?,
            lora_id: opt_i64(get("lora_id"), "lora_id")?,
            lora_name: opt_string(get("lora_name")),
            extra_keys: opt_array(get("extra_keys")),
            medium: Medium::from_name(get("medium").and_then(Value::as_str)),
            group_idx: lenient_u32(get("group_idx")),
            kv_cache_spec_kind: opt_string(get("kv_cache_spec_kind")),
            kv_cache_spec_sliding_window: lenient_u32(get("kv_cache_spec_sliding_window")),
            locality: opt_string(get("locality")),
            ownership: opt_string(get("ownership")),
        })),
        "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: hash_list(get("block_hashes"))?,
            medium: Medium::from_name(get("medium").and_then(Value::as_str)),
            group_idx: lenient_u32(get("group_idx")),
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(EventError::UnknownType(other.to_owned())),
    }
}

fn decode_array_event(items: &[Value]) -> Result<KvEvent, EventError> {
    let tag = items
        .first()
        .and_then(Value::as_str)
        .ok_or(EventError::NoType)?;
    let get = |i: usize| items.get(i);
    match tag {
        "BlockStored" => Ok(KvEvent::BlockStored(BlockStored {
            block_hashes: hash_list(get(1))?,
            parent_block_hash: opt_hash(get(2), "parent_block_hash")?,
            token_ids: token_list(get(3))?,
            block_size: opt_u32(get(4), "block_size")?,
            lora_id: opt_i64(get(5), "lora_id")?,
            lora_name: opt_string(get(7)),
            extra_keys: opt_array(get(8)),
            medium: Medium::from_name(get(6).and_then(Value::as_str)),
            group_idx: lenient_u32(get(9)),
            kv_cache_spec_kind: opt_string(get(10)),
            kv_cache_spec_sliding_window: lenient_u32(get(11)),
            locality: opt_string(get(12)),
            ownership: opt_string(get(13)),
        })),
        "BlockRemoved" => Ok(KvEvent::BlockRemoved {
            block_hashes: hash_list(get(1))?,
            medium: Medium::from_name(get(2).and_then(Value::as_str)),
            group_idx: lenient_u32(get(3)),
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(EventError::UnknownType(other.to_owned())),
    }
}

/// An int (u64 or negative → two's complement) or bytes hash.
pub fn hash_value(v: &Value) -> Option<EngineBlockHash> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|n| n as u64))
            .map(EngineBlockHash::Int),
        Value::Binary(b) => Some(EngineBlockHash::Bytes(b.clone())),
        _ => None,
    }
}

fn hash_list(v: Option<&Value>) -> Result<Vec<EngineBlockHash>, EventError> {
    let field = "block_hashes";
    let Some(Value::Array(items)) = v else {
        return Err(EventError::Field {
            field,
            problem: "missing or not an array",
        });
    };
    items
        .iter()
        .map(|h| {
            hash_value(h).ok_or(EventError::Field {
                field,
                problem: "element is not an int or bytes",
            })
        })
        .collect()
}

fn opt_hash(v: Option<&Value>, field: &'static str) -> Result<Option<EngineBlockHash>, EventError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(h) => hash_value(h).map(Some).ok_or(EventError::Field {
            field,
            problem: "not an int or bytes",
        }),
    }
}

fn token_list(v: Option<&Value>) -> Result<Vec<u32>, EventError> {
    let field = "token_ids";
    match v {
        None | Some(Value::Nil) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or(EventError::Field {
                        field,
                        problem: "element is not a u32",
                    })
            })
            .collect(),
        Some(_) => Err(EventError::Field {
            field,
            problem: "not an array",
        }),
    }
}

fn opt_u32(v: Option<&Value>, field: &'static str) -> Result<Option<u32>, EventError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(x) => x
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or(EventError::Field {
                field,
                problem: "not a u32",
            }),
    }
}

/// An optional u32 of the newer (hybrid / offload) fields; a value of another type reads as
/// absent, like an unknown trailing field (older engines put other things there).
fn lenient_u32(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
}

fn opt_i64(v: Option<&Value>, field: &'static str) -> Result<Option<i64>, EventError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(x) => x.as_i64().map(Some).ok_or(EventError::Field {
            field,
            problem: "not an i64",
        }),
    }
}

fn opt_string(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

fn opt_array(v: Option<&Value>) -> Option<Vec<Value>> {
    match v {
        Some(Value::Array(a)) => Some(a.clone()),
        _ => None,
    }
}

#[cfg(test)]
#[path = "events_tests.rs"]
mod tests;
