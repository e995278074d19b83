//! One loaded model (tokenizer + chat template + recent-tokenization cache) and vLLM 0.32's
//! per-endpoint rules for what is encoded and whether special tokens are added
//! (`../shared/golden/README.md`, verified on the two captures):
//!
//! | request                         | text encoded                  | special tokens            |
//! |---------------------------------|-------------------------------|---------------------------|
//! | completions, string prompt      | the prompt                    | yes, unless `add_special_tokens: false` |
//! | any endpoint, token-id prompt   | none: ids used as given       | never                     |
//! | chat completions                | rendered template             | no, unless `add_special_tokens: true` |
//! | `/v1/responses`                 | rendered template             | yes (so BOS twice with a BOS template) |
//!
//! "Special tokens" means the tokenizer's post-processor (e.g. a BOS `TemplateProcessing`);
//! `add_bos_token` in `tokenizer_config.json` is not applied on top, as vLLM's fast tokenizer
//! path leaves that to the post-processor too. Text prompts sent to other endpoints are treated
//! as completions, message lists as chat.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokenizers::Tokenizer;

use super::cache::{TextKey, TokenCache};
use super::compat;
use super::segment::{DEFAULT_SEGMENT_CAPACITY, SegmentEncoder};
use super::template::ChatTemplate;
use super::{TokenizeError, TokenizerMetrics};
use crate::request::{ApiKind, ChatMessage, Prompt};

/// A loaded model: its tokenizer, its chat template (or why there is none) and a cache.
#[derive(Debug)]
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    template: Result<ChatTemplate, String>,
    cache: TokenCache,
    segments: SegmentEncoder,
    template_warned: AtomicBool,
}

impl ModelTokenizer {
    /// Loads `<dir>/tokenizer.json` and, when present, `<dir>/tokenizer_config.json`. A missing
    /// or broken config only disables chat templating (chat requests then fail with
    /// [`TokenizeError::Template`]); a missing or broken `tokenizer.json` is an error.
    pub fn load(dir: &Path, cache_capacity: usize) -> Result<Self, String> {
        let (tokenizer, json) = load_tokenizer(dir)?;
        let seg_capacity = if cache_capacity == 0 {
            0
        } else {
            DEFAULT_SEGMENT_CAPACITY
        };
        let segments = SegmentEncoder::new(
            &tokenizer,
            &json.pre_tokenizer,
            &json.normalizer,
            seg_capacity,
        );
        let cfg_path = dir.join("tokenizer_config.json");
        let template = match std::fs::read_to_string(&cfg_path) {
            Err(e) => Err(format!("{}: {e}", cfg_path.display())),
            Ok(text) => match serde_json::from_str::<serde_json::Value>(&text) {
                Err(e) => Err(format!("{}: {e}", cfg_path.display())),
                Ok(cfg) => match ChatTemplate::from_tokenizer_config(&cfg) {
                    Ok(Some(t)) => Ok(t),
                    Ok(None) => Err(format!("{}: no chat_template", cfg_path.display())),
                    Err(e) => Err(format!("{}: {e}", cfg_path.display())),
                },
            },
        };
        Ok(ModelTokenizer {
            tokenizer,
            template,
            cache: TokenCache::new(cache_capacity),
            segments,
            template_warned: AtomicBool::new(false),
        })
    }

    /// Token ids of `prompt` for `api` (see the module table). `add_special_tokens` is the
    /// request's own field. Errors: template missing/failing, tokenizer failure, empty prompt.
    pub fn encode(
        &self,
        model: &str,
        api: ApiKind,
        prompt: &Prompt,
        add_special_tokens: Option<bool>,
        metrics: &TokenizerMetrics,
    ) -> Result<Arc<[u32]>, TokenizeError> {
        match prompt {
            Prompt::TokenIds(ids) => token_ids(ids),
            Prompt::Text(text) => {
                self.encode_text(model, text, add_special_tokens.unwrap_or(true), metrics)
            }
            Prompt::Messages(msgs) => {
                let add = match api {
                    ApiKind::Responses => add_special_tokens.unwrap_or(true),
                    _ => add_special_tokens.unwrap_or(false),
                };
                self.encode_messages(model, api, msgs, add, metrics)
            }
        }
    }

    /// Renders and encodes a message list, through the message-level cache (skipped for
    /// templates that read the clock, whose output changes with the date).
    fn encode_messages(
        &self,
        model: &str,
        api: ApiKind,
        msgs: &[ChatMessage],
        add: bool,
        metrics: &TokenizerMetrics,
    ) -> Result<Arc<[u32]>, TokenizeError> {
        let cacheable = self.template.as_ref().is_ok_and(|t| !t.reads_clock());
        let key = TextKey::messages(api_tag(api), msgs, add);
        if cacheable && let Some(ids) = self.cache.get(&key) {
            metrics.cache_hits.inc();
            return Ok(ids);
        }
        let text = self.render(model, msgs)?;
        let ids = self.encode_text(model, &text, add, metrics)?;
        if cacheable {
            self.cache.put(key, ids.clone());
        }
        Ok(ids)
    }

    /// The chat template rendered with `add_generation_prompt=True`.
    pub fn render(&self, model: &str, msgs: &[ChatMessage]) -> Result<String, TokenizeError> {
        if msgs.is_empty() {
            return Err(TokenizeError::Empty);
        }
        let template = self
            .template
            .as_ref()
            .map_err(|e| self.template_error(model, e.clone()))?;
        template
            .render(msgs, true)
            .map_err(|e| self.template_error(model, format!("{e:#}")))
    }

    /// Encodes `text`, through the cache.
    pub fn encode_text(
        &self,
        model: &str,
        text: &str,
        add_special_tokens: bool,
        metrics: &TokenizerMetrics,
    ) -> Result<Arc<[u32]>, TokenizeError> {
        if text.is_empty() {
            return Err(TokenizeError::Empty);
        }
        let key = TextKey::new(text, add_special_tokens);
        if let Some(ids) = self.cache.get(&key) {
            metrics.cache_hits.inc();
            return Ok(ids);
        }
        metrics.cache_misses.inc();
        let ids: Arc<[u32]> =
            self.encode_uncached(text, add_special_tokens)
                .map_err(|message| TokenizeError::Encode {
                    model: model.to_owned(),
                    message,
                })?;
        if ids.is_empty() {
            return Err(TokenizeError::Empty);
        }
        self.cache.put(key, ids.clone());
        Ok(ids)
    }

    /// Encodes `text` through the segment cache when exact for this tokenizer, else whole.
    fn encode_uncached(&self, text: &str, add_special_tokens: bool) -> Result<Arc<[u32]>, String> {
        match self
            .segments
            .encode(&self.tokenizer, text, add_special_tokens)
        {
            Some(ids) => ids.map(Arc::from),
            None => self.encode_whole(text, add_special_tokens),
        }
    }

    /// The tokenizer's own whole-text encoding (no cache involved).
    pub fn encode_whole(&self, text: &str, add_special_tokens: bool) -> Result<Arc<[u32]>, String> {
        let enc = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| e.to_string())?;
        Ok(Arc::from(enc.get_ids()))
    }

    /// [`Self::encode_whole`] through the segment cache; `None` when segment encoding is not
    /// exact for this tokenizer. Exposed so tests can compare the two paths.
    pub fn encode_by_segments(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Option<Result<Vec<u32>, String>> {
        self.segments
            .encode(&self.tokenizer, text, add_special_tokens)
    }

    /// Entries currently cached.
    pub fn cached_entries(&self) -> usize {
        self.cache.len()
    }

    /// Entries currently in the segment (split and chunk) cache.
    pub fn segment_entries(&self) -> usize {
        self.segments.cached_entries()
    }

    /// True when long splits are cut into word-boundary chunks for this tokenizer
    /// (see [`super::segment::word_boundaries_exact`]).
    pub fn word_chunked(&self) -> bool {
        self.segments.chunked()
    }

    /// True when the raw text is cut into word-boundary chunks before added-token extraction
    /// (see [`super::segment::added_tokens_keep_off_word_boundaries`]).
    pub fn raw_chunked(&self) -> bool {
        self.segments.raw_chunked()
    }

    fn template_error(&self, model: &str, message: String) -> TokenizeError {
        if !self.template_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(model, error = %message, "chat template unusable; KV routing falls back for chat requests of this model");
        } else {
            tracing::debug!(model, error = %message, "chat template failed");
        }
        TokenizeError::Template {
            model: model.to_owned(),
            message,
        }
    }
}

/// The parts of the (substituted) `tokenizer.json` the segment encoder inspects.
struct PipelineJson {
    pre_tokenizer: serde_json::Value,
    normalizer: serde_json::Value,
}

/// `<dir>/tokenizer.json`, with transformers' class substitution for `<dir>/config.json`'s
/// `model_type` applied (see [`super::compat`]).
fn load_tokenizer(dir: &Path) -> Result<(Tokenizer, PipelineJson), String> {
    let tok_path = dir.join("tokenizer.json");
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", tok_path.display());
    let text = std::fs::read(&tok_path).map_err(|e| err(&e))?;
    let model_type = std::fs::read(dir.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|c| c["model_type"].as_str().map(str::to_owned));
    let mut json: serde_json::Value = serde_json::from_slice(&text).map_err(|e| err(&e))?;
    if compat::patch_for_model_type(&mut json, model_type.as_deref()) {
        tracing::debug!(dir = %dir.display(), model_type, "applied transformers tokenizer substitution");
    }
    let parts = PipelineJson {
        pre_tokenizer: json["pre_tokenizer"].clone(),
        normalizer: json["normalizer"].clone(),
    };
    let tok = serde_json::from_value::<Tokenizer>(json).map_err(|e| err(&e))?;
    Ok((tok, parts))
}

/// A stable discriminant of the API for message-level cache keys.
fn api_tag(api: ApiKind) -> u8 {
    match api {
        ApiKind::Completions => 0,
        ApiKind::ChatCompletions => 1,
        ApiKind::Responses => 2,
        ApiKind::Other => 3,
    }
}

/// A token-id prompt, used as given.
pub fn token_ids(ids: &[u32]) -> Result<Arc<[u32]>, TokenizeError> {
    if ids.is_empty() {
        return Err(TokenizeError::Empty);
    }
    Ok(Arc::from(ids))
}
