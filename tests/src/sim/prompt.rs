//! Tokenize and hash: the one place where the emulator turns a request's prompt into token ids
//! and token blocks into vLLM block digests.
//!
//! TEMPORARY: until `loxi_user::kv::tokenizer::TokenizerPool` and
//! `loxi_user::kv::block_hash::BlockHasher` land on `main`, this file uses a stand-in
//! tokenizer (4-byte chunks of the UTF-8 text, ChatML rendering for messages) and a stand-in
//! chained digest. Both keep the properties routing depends on (same prefix → same leading
//! ids and digests; salt/LoRA change the digests) but do NOT match vLLM's ids or hashes.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use loxi_user::proxy::meta::{ApiKind, ChatMessage, Prompt};

use super::config::SimArgs;

/// A full block digest as the hash function produced it (32 bytes for `sha256_cbor`, 16 for
/// `xxhash_cbor`). The parent of block i+1 is the full digest of block i.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Digest(pub Arc<[u8]>);

impl Digest {
    /// The 64-bit id vLLM puts on the wire: the last 8 digest bytes read big-endian.
    pub fn wire_u64(&self) -> u64 {
        let mut buf = [0u8; 8];
        let tail = &self.0[self.0.len().saturating_sub(8)..];
        buf[8 - tail.len()..].copy_from_slice(tail);
        u64::from_be_bytes(buf)
    }
}

/// Per-request hash inputs beyond the tokens (vLLM's extra keys).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestExtras {
    /// LoRA adapter name (extra key on every block).
    pub lora: Option<String>,
    /// `cache_salt` (extra key on block 0 only).
    pub cache_salt: Option<String>,
}

impl RequestExtras {
    /// The extra keys of block `idx` as vLLM publishes them in `BlockStored.extra_keys`
    /// (LoRA → its name, salt → the bare string); `None` when the block has none.
    pub fn published(&self, idx: usize) -> Option<Vec<String>> {
        let mut keys = Vec::new();
        if let Some(l) = &self.lora {
            keys.push(l.clone());
        }
        if idx == 0
            && let Some(s) = &self.cache_salt
        {
            keys.push(s.clone());
        }
        (!keys.is_empty()).then_some(keys)
    }
}

/// Errors turning a prompt into token ids.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The tokenizer for the model failed or is missing.
    #[error("tokenize: {0}")]
    Tokenize(String),
}

/// Tokenizer + block hasher for one served model.
#[derive(Debug)]
pub struct PromptCodec {
    block_size: usize,
    none_hash: Digest,
}

impl PromptCodec {
    /// Builds the codec from the flags (tokenizer dir, hash algorithm, `PYTHONHASHSEED`).
    pub fn new(args: &SimArgs) -> Result<Self, PromptError> {
        let seed = args
            .python_hash_seed
            .clone()
            .unwrap_or_else(|| "vllm-none-hash".into());
        let none_hash = stand_in_digest(&(args.prefix_caching_hash_algo.as_str(), seed.as_str()));
        Ok(Self {
            block_size: args.block_size,
            none_hash,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Token ids of `prompt` as vLLM would feed them to the engine for `api`.
    pub fn encode(&self, _api: ApiKind, prompt: &Prompt) -> Result<Arc<[u32]>, PromptError> {
        Ok(match prompt {
            Prompt::TokenIds(ids) => ids.as_slice().into(),
            Prompt::Text(t) => stand_in_tokens(t).into(),
            Prompt::Messages(m) => stand_in_tokens(&render_chatml(m)).into(),
        })
    }

    /// Digest of block `idx` whose tokens are `tokens`, chained on `parent` (`None`: block 0).
    pub fn hash_block(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        idx: usize,
        extras: &RequestExtras,
    ) -> Digest {
        let parent = parent.unwrap_or(&self.none_hash);
        stand_in_digest(&(&parent.0[..], tokens, extras.published(idx)))
    }

    /// Digests of every full block of `tokens`.
    pub fn hash_prompt(&self, tokens: &[u32], extras: &RequestExtras) -> Vec<Digest> {
        let mut out: Vec<Digest> = Vec::with_capacity(tokens.len() / self.block_size);
        for (idx, chunk) in tokens.chunks_exact(self.block_size).enumerate() {
            let d = self.hash_block(out.last(), chunk, idx, extras);
            out.push(d);
        }
        out
    }

    /// Text of generated token `id` (filler; deterministic).
    pub fn decode_token(&self, id: u32) -> String {
        format!(" t{}", id % 100)
    }
}

fn render_chatml(msgs: &[ChatMessage]) -> String {
    let mut s = String::new();
    for m in msgs {
        s.push_str(&format!(
            "<|im_start|>{}\n{}<|im_end|>\n",
            m.role, m.content
        ));
    }
    s.push_str("<|im_start|>assistant\n");
    s
}

fn stand_in_tokens(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(4)
        .map(|c| {
            let mut h = DefaultHasher::new();
            c.hash(&mut h);
            (h.finish() % 2048) as u32
        })
        .collect()
}

fn stand_in_digest<T: Hash>(v: &T) -> Digest {
    let mut out = Vec::with_capacity(32);
    for i in 0u8..4 {
        let mut h = DefaultHasher::new();
        (i, v).hash(&mut h);
        out.extend_from_slice(&h.finish().to_be_bytes());
    }
    Digest(out.into())
}
