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
use super::{EncodeBounds, TokenizeError, TokenizerMetrics};
use crate::request::{ApiKind, ChatMessage, MEDIA_MARKER, Prompt};

/// A loaded model: its tokenizer, its chat template (or why there is none) and a cache.
#[derive(Debug)]
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    template: Result<ChatTemplate, String>,
    cache: TokenCache,
    segments: SegmentEncoder,
    template_warned: AtomicBool,
    max_context: Option<usize>,
}

impl ModelTokenizer {
    /// Loads `<dir>/tokenizer.json` and, when present, `<dir>/tokenizer_config.json`. A missing
    /// or broken config only disables chat templating (chat requests then fail with
    /// [`TokenizeError::Template`]); a missing or broken `tokenizer.json` is an error.
    pub fn load(dir: &Path, cache_capacity: usize) -> Result<Self, String> {
        let (tokenizer, json, max_context) = load_tokenizer(dir)?;
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
            max_context,
        })
    }

    /// The model's context length from its `config.json` (see [`context_length`]), if staged.
    pub fn max_context(&self) -> Option<usize> {
        self.max_context
    }

    /// Like [`Self::encode`], within `bounds` (issue 9 §1): at most `max_tokens` tokens (the
    /// bound, else the model's context, else the default), computed only as far as needed
    /// where segment encoding allows; a `prefix` prompt is encoded up to its last word
    /// boundary without the post-processor's suffix, or refused ([`TokenizeError::Oversize`])
    /// where that would not be exact. The ids returned are always a prefix of the engine's.
    pub fn encode_bounded(
        &self,
        model: &str,
        api: ApiKind,
        prompt: &Prompt,
        add_special_tokens: Option<bool>,
        bounds: EncodeBounds,
        metrics: &TokenizerMetrics,
    ) -> Result<Arc<[u32]>, TokenizeError> {
        let max = bounds.limit(self.max_context);
        let ids = match prompt {
            Prompt::Text(text) if bounds.prefix => {
                self.encode_prefix(model, text, add_special_tokens.unwrap_or(true), max)?
            }
            Prompt::Messages(_) if bounds.prefix => {
                return Err(TokenizeError::Oversize {
                    model: model.to_owned(),
                });
            }
            Prompt::TokenIds(ids) => token_ids(ids, max)?,
            Prompt::Text(text) => self.encode_text_upto(
                model,
                text,
                add_special_tokens.unwrap_or(true),
                max,
                metrics,
            )?,
            Prompt::Messages(msgs) => {
                let add = match api {
                    ApiKind::Responses => add_special_tokens.unwrap_or(true),
                    _ => add_special_tokens.unwrap_or(false),
                };
                let cacheable = self.template.as_ref().is_ok_and(|t| !t.reads_clock());
                let key = TextKey::messages(api_tag(api), msgs, add);
                if cacheable && let Some(ids) = self.cache.get(&key) {
                    metrics.cache_hits.inc();
                    return Ok(at_most(ids, max));
                }
                let text = self.render(model, msgs)?;
                if let Some(cut) = text.find(MEDIA_MARKER) {
                    return self.encode_media_prefix(model, &text[..cut], add, max);
                }
                let ids = self.encode_text_upto(model, &text, add, max, metrics)?;
                // A result cut at `max` depends on it: only whole results are cached.
                if cacheable && ids.len() < max {
                    self.cache.put(key, ids.clone());
                }
                ids
            }
        };
        Ok(ids)
    }

    /// [`Self::encode_text`] computing at most `max` tokens (see [`Self::encode_bounded`]).
    fn encode_text_upto(
        &self,
        model: &str,
        text: &str,
        add: bool,
        max: usize,
        metrics: &TokenizerMetrics,
    ) -> Result<Arc<[u32]>, TokenizeError> {
        if text.is_empty() {
            return Err(TokenizeError::Empty);
        }
        let key = TextKey::new(text, add);
        if let Some(ids) = self.cache.get(&key) {
            metrics.cache_hits.inc();
            return Ok(at_most(ids, max));
        }
        metrics.cache_misses.inc();
        let encode_err = |message| TokenizeError::Encode {
            model: model.to_owned(),
            message,
        };
        let mut ids = match self.segments.encode_upto(&self.tokenizer, text, add, max) {
            Some(r) => r.map_err(encode_err)?.0,
            None => self.encode_whole(text, add).map_err(encode_err)?.to_vec(),
        };
        ids.truncate(max);
        if ids.is_empty() {
            return Err(TokenizeError::Empty);
        }
        let ids: Arc<[u32]> = ids.into();
        if ids.len() < max {
            self.cache.put(key, ids.clone());
        }
        Ok(ids)
    }

    /// The ids of a rendered chat's text before its first media part (`head`), up to its last
    /// word boundary (a word cut by the part may encode differently in the engine's prompt);
    /// [`TokenizeError::Media`] where that is not exact or leaves nothing. Never cached.
    fn encode_media_prefix(
        &self,
        model: &str,
        head: &str,
        add: bool,
        max: usize,
    ) -> Result<Arc<[u32]>, TokenizeError> {
        self.encode_prefix(model, head, add, max)
            .map_err(|_| TokenizeError::Media {
                model: model.to_owned(),
            })
    }

    /// The ids of a cut prefix `text` up to its last word boundary, when word-boundary cuts
    /// are exact for this tokenizer (never cached: the text is not a whole prompt).
    fn encode_prefix(
        &self,
        model: &str,
        text: &str,
        add: bool,
        max: usize,
    ) -> Result<Arc<[u32]>, TokenizeError> {
        let oversize = || TokenizeError::Oversize {
            model: model.to_owned(),
        };
        if !self.segments.raw_chunked() {
            return Err(oversize());
        }
        let head = super::segment::last_word_boundary(text).ok_or_else(oversize)?;
        let (mut ids, stopped) = self
            .segments
            .encode_upto(&self.tokenizer, head, add, max)
            .ok_or_else(oversize)?
            .map_err(|message| TokenizeError::Encode {
                model: model.to_owned(),
                message,
            })?;
        // The post-processor's suffix belongs after the whole prompt, not after this head.
        if !stopped && let Some(suffix) = self.segments.suffix(add) {
            ids.truncate(ids.len().saturating_sub(suffix.len()));
        }
        ids.truncate(max);
        if ids.is_empty() {
            return Err(TokenizeError::Empty);
        }
        Ok(ids.into())
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
            Prompt::TokenIds(ids) => token_ids(ids, usize::MAX),
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
        if let Some(cut) = text.find(MEDIA_MARKER) {
            return self.encode_media_prefix(model, &text[..cut], add, usize::MAX);
        }
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

    /// The fast byte-level BPE encoder segment encoding uses for the splits it accepts, when
    /// this tokenizer qualifies (see [`super::fast_bpe::FastBpe::new`]).
    pub fn fast_bpe(&self) -> Option<&super::fast_bpe::FastBpe> {
        self.segments.fast_bpe()
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

/// The context length a model's `config.json` states: the first of `max_model_len`,
/// `max_position_embeddings`, `n_positions`, `max_sequence_length`, `seq_length`,
/// `max_seq_len` that is a positive integer, at the top level or in `text_config` (multimodal
/// models).
pub fn context_length(config: &serde_json::Value) -> Option<usize> {
    const FIELDS: [&str; 6] = [
        "max_model_len",
        "max_position_embeddings",
        "n_positions",
        "max_sequence_length",
        "seq_length",
        "max_seq_len",
    ];
    [config, &config["text_config"]].into_iter().find_map(|c| {
        FIELDS
            .iter()
            .find_map(|f| c[*f].as_u64().filter(|&n| n > 0))
            .and_then(|n| usize::try_from(n).ok())
    })
}

/// `<dir>/tokenizer.json`, with transformers' class substitution for `<dir>/config.json`'s
/// `model_type` applied (see [`super::compat`]), and the context length `config.json` states.
fn load_tokenizer(dir: &Path) -> Result<(Tokenizer, PipelineJson, Option<usize>), String> {
    let tok_path = dir.join("tokenizer.json");
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", tok_path.display());
    let text = std::fs::read(&tok_path).map_err(|e| err(&e))?;
    let config = std::fs::read(dir.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
    let model_type = config
        .as_ref()
        .and_then(|c| c["model_type"].as_str().map(str::to_owned));
    let max_context = config.as_ref().and_then(context_length);
    let mut json: serde_json::Value = serde_json::from_slice(&text).map_err(|e| err(&e))?;
    if compat::patch_for_model_type(&mut json, model_type.as_deref()) {
        tracing::debug!(dir = %dir.display(), model_type, "applied transformers tokenizer substitution");
    }
    let parts = PipelineJson {
        pre_tokenizer: json["pre_tokenizer"].clone(),
        normalizer: json["normalizer"].clone(),
    };
    let tok = serde_json::from_value::<Tokenizer>(json).map_err(|e| err(&e))?;
    Ok((tok, parts, max_context))
}

/// The first `max` of `ids`.
fn at_most(ids: Arc<[u32]>, max: usize) -> Arc<[u32]> {
    if ids.len() > max {
        Arc::from(&ids[..max])
    } else {
        ids
    }
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

/// A token-id prompt, used as given up to its first `max` ids (the tokenizer's one handling of
/// token-id prompts; `max` from [`super::EncodeBounds::limit`]). Errors:
/// [`TokenizeError::Empty`].
pub fn token_ids(ids: &[u32], max: usize) -> Result<Arc<[u32]>, TokenizeError> {
    if ids.is_empty() {
        return Err(TokenizeError::Empty);
    }
    Ok(Arc::from(&ids[..ids.len().min(max)]))
}
