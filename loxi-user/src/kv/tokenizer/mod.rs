//! Tokenization exactly as the engine does it: the model's own HF `tokenizer.json`, its chat
//! template rendered the way transformers renders it, and vLLM 0.32's per-endpoint special-token
//! rules (see `../shared/golden/README.md`, "What vLLM 0.32 did with BOS here").
//!
//! - [`pool`]: [`TokenizerPool`], one lazily loaded tokenizer per model, staged at
//!   `<tokenizer-dir>/<model with / replaced by __>/tokenizer.json` (+ `tokenizer_config.json`),
//!   with a negative cache for load failures (logged once, counted, gauge
//!   `loxilb_kv_tokenizer_degraded{model}`).
//! - [`template`]: the chat template (minijinja + pycompat, transformers' environment).
//! - [`encode`]: which text is encoded, and with or without special tokens, per endpoint.
//! - [`cache`]: a bounded cache of recent tokenizations keyed by a hash of the full text.
//! - [`segment`]: per-segment (between added tokens) cache so a conversation's next turn only
//!   encodes its new text.
//! - [`fast_bpe`]: the exact fast byte-level BPE encoder segment encoding uses for ASCII splits
//!   of the tokenizers it supports (issue 17 §2), HF's pipeline for everything else.

pub mod cache;
pub mod compat;
pub mod encode;
pub mod fast_bpe;
pub mod metrics;
pub mod pool;
pub mod pyjson;
pub mod segment;
pub mod template;

pub use metrics::TokenizerMetrics;
pub use pool::TokenizerPool;

/// Why a prompt could not be tokenized. Every variant is a routing miss (`tokenize`), never a
/// client error: the request is still served by the rule's fallback selector.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    /// No usable `tokenizer.json` is staged for the model (or it failed to load; retried after
    /// the pool's retry interval).
    #[error("no tokenizer for model {model:?}")]
    NoTokenizer {
        /// The requested model.
        model: String,
    },
    /// The chat template is missing or failed to render (counted per model).
    #[error("chat template of model {model:?}: {message}")]
    Template {
        /// The requested model.
        model: String,
        /// minijinja's error, or "no chat_template".
        message: String,
    },
    /// The tokenizer rejected the text.
    #[error("tokenizer of model {model:?} failed: {message}")]
    Encode {
        /// The requested model.
        model: String,
        /// The tokenizers library's error.
        message: String,
    },
    /// The prompt produced no token at all (empty text, empty message list, empty id list).
    #[error("prompt is empty")]
    Empty,
    /// The prompt is a cut prefix (see [`EncodeBounds::prefix`]) this tokenizer cannot encode
    /// exactly (no word-boundary cut is exact for it, or the text has no word boundary): a
    /// routing miss `oversize`.
    #[error("prompt prefix of model {model:?} cannot be tokenized exactly")]
    Oversize {
        /// The requested model.
        model: String,
    },
    /// A chat with a non-text part ([`crate::request::MEDIA_MARKER`]) whose text before the
    /// part this tokenizer cannot encode as an exact prefix (or which has none): a routing
    /// miss `multimodal`.
    #[error("the text before the first media part of a {model:?} chat cannot be tokenized exactly")]
    Media {
        /// The requested model.
        model: String,
    },
}

/// How much of a prompt one encoding computes (issue 9 §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EncodeBounds {
    /// Stop once this many tokens are known and return only those (`None`: the model's context
    /// length from its `config.json`, else [`crate::kv::settings::DEFAULT_MAX_PROMPT_TOKENS`]).
    /// Tokens past the engine's context can never be cached, so they cannot matter for routing.
    pub max_tokens: Option<usize>,
    /// The prompt given is a cut prefix of the client's (the proxy's bounded parse kept only
    /// its leading bytes): it is encoded up to its last word boundary, without the
    /// post-processor's suffix, and only where that is exact (see [`segment`]).
    pub prefix: bool,
}

impl EncodeBounds {
    /// The most tokens one encoding keeps: `max_tokens`, else the model's `context` (from its
    /// `config.json`, when known), else
    /// [`crate::kv::settings::DEFAULT_MAX_PROMPT_TOKENS`]; at least 1. The one place this
    /// bound is decided, for text, chats and token-id prompts alike.
    pub fn limit(&self, context: Option<usize>) -> usize {
        self.max_tokens
            .or(context)
            .unwrap_or(crate::kv::settings::DEFAULT_MAX_PROMPT_TOKENS)
            .max(1)
    }
}

/// The directory name a model's tokenizer is staged under: the model id with `/` → `__`
/// (LoxiLB's slug, e.g. `Qwen/Qwen2.5-7B-Instruct` → `Qwen__Qwen2.5-7B-Instruct`).
pub fn model_slug(model: &str) -> String {
    model.replace('/', "__")
}
