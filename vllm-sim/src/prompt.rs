//! Tokenize and hash: the one place where the emulator turns a request's prompt into token ids
//! and token blocks into vLLM block digests, reusing loxi's own implementation of both
//! contracts (`loxi_user::kv::tokenizer::TokenizerPool`, `loxi_user::kv::block_hash`), so the
//! emulator's events are what a real vLLM would publish for the same model and seed.
//!
//! Without `--tokenizer-dir`, text prompts fall back to an approximate tokenizer (one token per
//! 4 bytes of UTF-8, chat messages rendered as ChatML first): prefixes still share leading ids,
//! but the ids are not the model's. Token-id prompts are always used as given.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;

use loxi_user::kv::block_hash::{BlockDigest, BlockHasher, ExtraKey, HashAlgo};
use loxi_user::kv::tokenizer::{TokenizerMetrics, TokenizerPool};
use loxi_user::proxy::meta::{ApiKind, ChatMessage, Prompt};
use prometheus_client::registry::Registry;

use super::config::SimArgs;

/// A full block digest (32 bytes for `sha256_cbor`, 16 for `xxhash_cbor`). The parent of block
/// i+1 is the full digest of block i.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest(pub BlockDigest);

impl Digest {
    /// A digest from raw bytes (at most 32; longer input is truncated to 32).
    pub fn from_bytes(b: &[u8]) -> Self {
        let b = &b[..b.len().min(32)];
        Digest(BlockDigest::from_bytes(b).unwrap_or(BlockDigest::EMPTY))
    }

    /// The digest bytes (published when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// The 64-bit id vLLM puts on the wire: the last 8 digest bytes read big-endian.
    pub fn wire_u64(&self) -> u64 {
        self.0.key(HashAlgo::Sha256Cbor).0
    }
}

/// Per-request hash inputs beyond the tokens (vLLM's extra keys).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestExtras {
    /// LoRA adapter name (extra key on every block; the emulator serves no adapters).
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

    /// The extra keys of block `idx` as vLLM hashes them (LoRA path = its name here).
    fn hashed(&self, idx: usize) -> Vec<ExtraKey> {
        let mut keys: Vec<ExtraKey> = self
            .lora
            .iter()
            .map(|l| ExtraKey::Lora(l.clone(), l.clone()))
            .collect();
        if idx == 0
            && let Some(s) = &self.cache_salt
        {
            keys.push(ExtraKey::CacheSalt(s.clone()));
        }
        keys
    }
}

/// Errors building the codec or tokenizing a prompt.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// `--prefix-caching-hash-algo` is not a vLLM CBOR contract.
    #[error("--prefix-caching-hash-algo: {0:?} is not supported (use sha256_cbor or xxhash_cbor)")]
    HashAlgo(String),
    /// The tokenizer for the model failed or is missing.
    #[error("tokenize: {0}")]
    Tokenize(#[from] loxi_user::kv::tokenizer::TokenizeError),
}

/// Tokenizer + block hasher for one served model.
#[derive(Debug)]
pub struct PromptCodec {
    model: String,
    block_size: usize,
    hasher: BlockHasher,
    tokenizers: Option<TokenizerPool>,
}

impl PromptCodec {
    /// Builds the codec from the flags (tokenizer dir, hash algorithm, `PYTHONHASHSEED`).
    /// With `--tokenizer-dir`, the model's tokenizer must load (checked here, not per request).
    pub fn new(args: &SimArgs) -> Result<Self, PromptError> {
        let algo = match args.prefix_caching_hash_algo.parse::<HashAlgo>() {
            Ok(a @ (HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor)) => a,
            _ => return Err(PromptError::HashAlgo(args.prefix_caching_hash_algo.clone())),
        };
        let tokenizers = args.tokenizer_dir.as_ref().map(|d| pool(d.clone()));
        if let Some(p) = &tokenizers {
            p.get(&args.model)?;
        }
        Ok(Self {
            model: args.model.clone(),
            block_size: args.block_size,
            hasher: BlockHasher::new(algo, args.python_hash_seed.as_deref()),
            tokenizers,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Token ids of `prompt` as vLLM 0.32 feeds them to the engine for `api` (completions add
    /// special tokens by default, chat does not, responses do); `add_special_tokens` is the
    /// request's own field.
    pub fn encode(
        &self,
        api: ApiKind,
        prompt: &Prompt,
        add_special_tokens: Option<bool>,
    ) -> Result<Arc<[u32]>, PromptError> {
        match (&self.tokenizers, prompt) {
            (_, Prompt::TokenIds(ids)) => Ok(ids.as_slice().into()),
            (Some(pool), _) => Ok(pool.encode(&self.model, api, prompt, add_special_tokens)?),
            (None, Prompt::Text(t)) => Ok(approx_tokens(t).into()),
            (None, Prompt::Messages(m)) => Ok(approx_tokens(&render_chatml(m)).into()),
        }
    }

    /// Digest of block `idx` whose tokens are `tokens`, chained on `parent` (`None`: block 0).
    pub fn hash_block(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        idx: usize,
        extras: &RequestExtras,
    ) -> Digest {
        let parent = parent.map_or(self.hasher.none_hash(), |d| &d.0);
        Digest(self.hasher.hash_block(parent, tokens, &extras.hashed(idx)))
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

/// A tokenizer pool whose own metrics go to a private registry: `/metrics` serves only the
/// vLLM families.
fn pool(dir: PathBuf) -> TokenizerPool {
    let mut private = Registry::default();
    TokenizerPool::new(dir, TokenizerMetrics::register(&mut private))
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

/// One id per 4-byte chunk, stable across runs (SipHash with fixed keys), in 0..2048.
fn approx_tokens(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(4)
        .map(|c| {
            let mut h = DefaultHasher::new();
            c.hash(&mut h);
            (h.finish() % 2048) as u32
        })
        .collect()
}
