//! Prefix-cache block hashing, bit-exact with the engines: vLLM 0.32's `sha256_cbor` and
//! `xxhash_cbor`, and SGLang 0.5.23's page hash (`sha256_sglang`).
//!
//! # vLLM contract (`vllm/v1/core/kv_cache_utils.py::hash_block_tokens`)
//! Block `i` of a request hashes the canonical CBOR of the 3-element array
//! `[parent digest (byte string), [token ids] (unsigned ints, shortest encoding), extra keys
//! (array) or null]` with SHA-256 (`sha256_cbor`, 32-byte digest) or XXH3-128 (`xxhash_cbor`,
//! 16-byte digest in canonical big-endian form). Only full blocks are hashed. The parent of
//! block 0 is NONE_HASH = H(CBOR text string of the seed); the parent of block `i + 1` is the
//! FULL digest of block `i`. The 64-bit id engines publish (and [`BlockKey`] holds) is the last 8
//! digest bytes read big-endian.
//!
//! Extra keys, in vLLM's order: LoRA `["lora", name, path]` on every block, then
//! `["cache_salt", salt]` on block 0 only; `null` when a block has none. (Multimodal and
//! prompt-embedding keys are not produced by text requests and are not modelled.)
//!
//! # Seed (`LLB_KV_NONE_HASH_SEED`)
//! When set, the seed is the string itself, exactly as vLLM uses `PYTHONHASHSEED`. When unset,
//! loxi follows vLLM 0.32, not LoxiLB's documentation (which says "zero seed"): `sha256_cbor`
//! uses the fixed string `vllm-none-hash` (deterministic, so an unseeded vLLM matches an
//! unseeded loxi), and `xxhash_cbor` uses a random per-process seed, as vLLM does, so an
//! unseeded `xxhash_cbor` fleet never matches anything (not even another vLLM process); set the
//! same seed on both sides. Source: `../shared/golden/README.md` and
//! `vllm_block_hashes.json:none_hash_determinism_unset`.
//!
//! # SGLang contract (`sha256_sglang`)
//! Page `i` hashes `SHA-256(parent digest ‖ token ids as u32 little-endian)`, where page 0 has
//! no parent bytes at all (its NONE_HASH is the empty digest). The published id is the FIRST 8
//! digest bytes read big-endian (a signed i64 on the wire, stored as its two's complement).
//! SGLang namespaces page 0 when a request carries `extra_key`/`cache_salt`; that is not
//! supported, so [`BlockHasher::hash_prompt`] returns no blocks for such requests (a miss).
//!
//! # CBOR encoding
//! The five CBOR items the contract needs (unsigned int, byte string, text string, definite
//! array header, null) are written by a small infallible encoder into a reused buffer instead
//! of going through `ciborium`'s fallible `io::Write` serializer: the hash API is infallible and
//! allocation-light. Tests prove the bytes equal both vLLM's recorded `cbor_input_hex` and
//! `ciborium`'s encoding of the same value.

use std::fmt;

use sha2::{Digest, Sha256};

use super::BlockKey;

/// The fixed NONE_HASH seed vLLM 0.32 uses for `sha256`/`sha256_cbor` when `PYTHONHASHSEED`
/// is unset.
pub const VLLM_UNSET_SEED: &str = "vllm-none-hash";

/// Largest digest any algorithm produces (SHA-256).
const MAX_DIGEST: usize = 32;

/// The hash contracts (`kvHashAlgo`) are part of the typed rule spec, which validation compiles;
/// this module computes them.
pub use crate::rules::spec::{HashAlgo, UnknownHashAlgo};

/// A full block digest: 32 bytes for SHA-256, 16 for XXH3-128 (big-endian canonical form), or
/// empty for SGLang's "no parent". This, not the 64-bit key, is the parent of the next block.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockDigest {
    len: u8,
    bytes: [u8; MAX_DIGEST],
}

impl BlockDigest {
    /// The empty digest (SGLang's absent parent of page 0).
    pub const EMPTY: BlockDigest = BlockDigest {
        len: 0,
        bytes: [0; MAX_DIGEST],
    };

    /// A digest from raw bytes; `None` when longer than 32 bytes.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() > MAX_DIGEST {
            return None;
        }
        let mut bytes = [0u8; MAX_DIGEST];
        bytes[..b.len()].copy_from_slice(b);
        Some(BlockDigest {
            len: b.len() as u8,
            bytes,
        })
    }

    /// The digest bytes (length 0, 16 or 32).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// Lower-case hex of the digest bytes.
    pub fn to_hex(&self) -> String {
        hex::encode(self.as_bytes())
    }

    /// The 64-bit id engines publish for this digest under `algo`: vLLM takes the last 8 bytes
    /// big-endian, SGLang the first 8 bytes big-endian. Digests shorter than 8 bytes are
    /// zero-padded on the left (only the empty digest is; its key is 0).
    pub fn key(&self, algo: HashAlgo) -> BlockKey {
        let b = self.as_bytes();
        let window = match algo {
            HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor => &b[b.len().saturating_sub(8)..],
            HashAlgo::Sha256Sglang => &b[..b.len().min(8)],
        };
        let mut buf = [0u8; 8];
        buf[8 - window.len()..].copy_from_slice(window);
        BlockKey(u64::from_be_bytes(buf))
    }
}

impl fmt::Debug for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockDigest({})", self.to_hex())
    }
}

/// One vLLM extra key as it is hashed (the tagged tuple, not the untagged event form).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// `("lora", name, path)`: on every block of a LoRA request.
    Lora(String, String),
    /// `("cache_salt", salt)`: on block 0 only.
    CacheSalt(String),
}

/// The request-level inputs that become extra keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestExtras {
    /// LoRA adapter `(name, path)` as the engine knows it.
    pub lora: Option<(String, String)>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<String>,
}

impl RequestExtras {
    /// True when the request carries no extra key at all.
    pub fn is_empty(&self) -> bool {
        self.lora.is_none() && self.cache_salt.is_none()
    }

    /// The extra keys of block 0 and of every later block, in vLLM's order.
    fn per_block(&self) -> (Vec<ExtraKey>, Vec<ExtraKey>) {
        let rest: Vec<ExtraKey> = self
            .lora
            .iter()
            .map(|(n, p)| ExtraKey::Lora(n.clone(), p.clone()))
            .collect();
        let mut first = rest.clone();
        if let Some(salt) = &self.cache_salt {
            first.push(ExtraKey::CacheSalt(salt.clone()));
        }
        (first, rest)
    }
}

/// Hashes prompts into block digests and keys under one contract and seed. Cheap to share
/// (`Send + Sync`, immutable); build one per (algorithm, seed) pair.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    algo: HashAlgo,
    none_hash: BlockDigest,
    seed_set: bool,
}

impl BlockHasher {
    /// A hasher for `algo` with `seed` = `LLB_KV_NONE_HASH_SEED` (`None` = unset; see the
    /// module doc for what unset means per algorithm). SGLang ignores the seed.
    pub fn new(algo: HashAlgo, seed: Option<&str>) -> Self {
        let none_hash = match algo {
            HashAlgo::Sha256Sglang => BlockDigest::EMPTY,
            HashAlgo::Sha256Cbor => none_hash_of(algo, seed.unwrap_or(VLLM_UNSET_SEED)),
            HashAlgo::XxhashCbor => match seed {
                Some(s) => none_hash_of(algo, s),
                None => none_hash_of(algo, &random_seed()),
            },
        };
        BlockHasher {
            algo,
            none_hash,
            seed_set: seed.is_some(),
        }
    }

    /// Whether `LLB_KV_NONE_HASH_SEED` was given (remedies say "unset" only then).
    pub fn seed_set(&self) -> bool {
        self.seed_set
    }

    /// The contract this hasher implements.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The parent of block 0: H(CBOR text of the seed) for vLLM, the empty digest for SGLang.
    pub fn none_hash(&self) -> &BlockDigest {
        &self.none_hash
    }

    /// The digest of one block given its parent's full digest, its tokens and its extra keys
    /// (ignored by SGLang). Any token count is accepted (SGLang's vectors hash partial pages).
    pub fn hash_block(
        &self,
        parent: &BlockDigest,
        tokens: &[u32],
        extra: &[ExtraKey],
    ) -> BlockDigest {
        let mut buf = Vec::with_capacity(48 + tokens.len() * 5);
        self.hash_block_buf(&mut buf, parent, tokens, extra)
    }

    /// The digests of every FULL block of `tokens` (`tokens.len() / block_size` of them; none
    /// when `block_size` is 0, and none for SGLang requests with extras, which are unsupported).
    pub fn hash_prompt(
        &self,
        tokens: &[u32],
        block_size: usize,
        extras: &RequestExtras,
    ) -> Vec<BlockDigest> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        self.each_digest(tokens, block_size, extras, |d| out.push(d));
        out
    }

    /// The 64-bit keys of every full block of `tokens` (see [`Self::hash_prompt`]).
    pub fn keys(&self, tokens: &[u32], block_size: usize, extras: &RequestExtras) -> Vec<BlockKey> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        self.each_digest(tokens, block_size, extras, |d| out.push(d.key(self.algo)));
        out
    }

    /// Calls `f` with the digest of every full block, in order (see [`Self::hash_prompt`]).
    fn each_digest(
        &self,
        tokens: &[u32],
        block_size: usize,
        extras: &RequestExtras,
        mut f: impl FnMut(BlockDigest),
    ) {
        if block_size == 0 || (self.algo == HashAlgo::Sha256Sglang && !extras.is_empty()) {
            return;
        }
        let (first, rest) = extras.per_block();
        let mut buf = Vec::with_capacity(48 + block_size * 5);
        let mut parent = self.none_hash;
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let extra = if i == 0 { &first } else { &rest };
            parent = self.hash_block_buf(&mut buf, &parent, block, extra);
            f(parent);
        }
    }

    /// [`Self::hash_block`] for token ids wider than u32, as KV events may carry them (vLLM
    /// hashes any non-negative Python int; CBOR widens to 8 bytes above `u32::MAX`). `None` for
    /// SGLang when an id exceeds `u32::MAX` (SGLang's tagged u64 encoding is unsupported).
    pub fn hash_block_wide(
        &self,
        parent: &BlockDigest,
        tokens: &[u64],
        extra: &[ExtraKey],
    ) -> Option<BlockDigest> {
        if self.algo == HashAlgo::Sha256Sglang {
            let narrow: Option<Vec<u32>> = tokens.iter().map(|&t| u32::try_from(t).ok()).collect();
            return narrow.map(|n| self.hash_block(parent, &n, extra));
        }
        let mut buf = Vec::with_capacity(48 + tokens.len() * 9);
        encode_block(&mut buf, parent, tokens, extra);
        Some(digest(self.algo, &buf))
    }

    /// The exact bytes a CBOR contract hashes for one block (empty for SGLang, which hashes raw
    /// bytes). Exposed for parity forensics (`LLB_KV_HASH_DEBUG`) and tests.
    pub fn cbor_input<T: Copy + Into<u64>>(
        &self,
        parent: &BlockDigest,
        tokens: &[T],
        extra: &[ExtraKey],
    ) -> Vec<u8> {
        let mut buf = Vec::new();
        if self.algo != HashAlgo::Sha256Sglang {
            encode_block(&mut buf, parent, tokens, extra);
        }
        buf
    }

    fn hash_block_buf(
        &self,
        buf: &mut Vec<u8>,
        parent: &BlockDigest,
        tokens: &[u32],
        extra: &[ExtraKey],
    ) -> BlockDigest {
        buf.clear();
        match self.algo {
            HashAlgo::Sha256Sglang => {
                buf.extend_from_slice(parent.as_bytes());
                for t in tokens {
                    buf.extend_from_slice(&t.to_le_bytes());
                }
            }
            HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor => encode_block(buf, parent, tokens, extra),
        }
        digest(self.algo, buf)
    }
}

/// NONE_HASH for a CBOR contract: H(CBOR text string of `seed`).
fn none_hash_of(algo: HashAlgo, seed: &str) -> BlockDigest {
    let mut buf = Vec::with_capacity(seed.len() + 9);
    cbor::text(&mut buf, seed);
    digest(algo, &buf)
}

/// A random per-process seed, as vLLM 0.32 draws for `xxhash_cbor` (`os.urandom(32).hex()`).
fn random_seed() -> String {
    let bytes: [u8; 32] = rand::random();
    hex::encode(bytes)
}

fn digest(algo: HashAlgo, input: &[u8]) -> BlockDigest {
    let mut d = BlockDigest {
        len: algo.digest_len() as u8,
        bytes: [0; MAX_DIGEST],
    };
    match algo {
        HashAlgo::Sha256Cbor | HashAlgo::Sha256Sglang => {
            d.bytes.copy_from_slice(&Sha256::digest(input));
        }
        HashAlgo::XxhashCbor => {
            d.bytes[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(input).to_be_bytes());
        }
    }
    d
}

/// `[parent bytes, [tokens], extra keys or null]` in canonical CBOR.
fn encode_block<T: Copy + Into<u64>>(
    buf: &mut Vec<u8>,
    parent: &BlockDigest,
    tokens: &[T],
    extra: &[ExtraKey],
) {
    cbor::array(buf, 3);
    cbor::bytes(buf, parent.as_bytes());
    cbor::array(buf, tokens.len() as u64);
    for &t in tokens {
        cbor::uint(buf, t.into());
    }
    if extra.is_empty() {
        cbor::null(buf);
        return;
    }
    cbor::array(buf, extra.len() as u64);
    for key in extra {
        match key {
            ExtraKey::Lora(name, path) => {
                cbor::array(buf, 3);
                cbor::text(buf, "lora");
                cbor::text(buf, name);
                cbor::text(buf, path);
            }
            ExtraKey::CacheSalt(salt) => {
                cbor::array(buf, 2);
                cbor::text(buf, "cache_salt");
                cbor::text(buf, salt);
            }
        }
    }
}

/// Canonical (RFC 8949 §4.2.1 "preferred", shortest-length) CBOR heads.
mod cbor {
    const UINT: u8 = 0;
    const BYTES: u8 = 2;
    const TEXT: u8 = 3;
    const ARRAY: u8 = 4;

    fn head(buf: &mut Vec<u8>, major: u8, n: u64) {
        let m = major << 5;
        if n < 24 {
            buf.push(m | n as u8);
        } else if n <= u64::from(u8::MAX) {
            buf.extend_from_slice(&[m | 24, n as u8]);
        } else if n <= u64::from(u16::MAX) {
            buf.push(m | 25);
            buf.extend_from_slice(&(n as u16).to_be_bytes());
        } else if n <= u64::from(u32::MAX) {
            buf.push(m | 26);
            buf.extend_from_slice(&(n as u32).to_be_bytes());
        } else {
            buf.push(m | 27);
            buf.extend_from_slice(&n.to_be_bytes());
        }
    }

    pub(super) fn uint(buf: &mut Vec<u8>, n: u64) {
        head(buf, UINT, n);
    }

    pub(super) fn bytes(buf: &mut Vec<u8>, b: &[u8]) {
        head(buf, BYTES, b.len() as u64);
        buf.extend_from_slice(b);
    }

    pub(super) fn text(buf: &mut Vec<u8>, s: &str) {
        head(buf, TEXT, s.len() as u64);
        buf.extend_from_slice(s.as_bytes());
    }

    pub(super) fn array(buf: &mut Vec<u8>, len: u64) {
        head(buf, ARRAY, len);
    }

    pub(super) fn null(buf: &mut Vec<u8>) {
        buf.push(0xf6);
    }
}

#[cfg(test)]
mod tests;
