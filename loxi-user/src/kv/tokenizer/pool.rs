//! [`TokenizerPool`]: one tokenizer per model, loaded lazily from
//! `<tokenizer-dir>/<model with / replaced by __>/` on first use.
//!
//! A model whose tokenizer is missing or broken is logged ONCE (warn, at the first failure),
//! counted (`loxilb_kv_tokenizer_load_failures_total{model}`, one per attempt), flagged
//! (`loxilb_kv_tokenizer_degraded{model}` = 1) and kept in a negative cache: requests for it
//! fail fast with [`TokenizeError::NoTokenizer`] without touching the disk until the retry
//! interval (default 30 s) has passed; then one request retries the load. Never a log line per
//! request. Token-id prompts need no tokenizer and are returned as given even for such models.
//!
//! Loading blocks the calling thread (hundreds of ms for a 4 MB `tokenizer.json`); encoding is
//! CPU-bound. The KV tier calls it from its fixed tokenization threads
//! (`kv::route::workers`), never on a runtime thread.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::cache::TokenCache;
use super::encode::{ModelTokenizer, token_ids};
use super::{EncodeBounds, TokenizeError, TokenizerMetrics, model_slug};
use crate::request::{ApiKind, Prompt};

/// Default time a failed load stays in the negative cache before one retry.
pub const DEFAULT_RETRY_INTERVAL: Duration = Duration::from_secs(30);

/// Most models tracked at once; beyond it, failed (negative-cache) entries are dropped first so
/// clients naming many unknown models cannot grow memory without bound.
const MAX_SLOTS: usize = 4096;

/// At most one `error` line per this interval for failed loads of models no rule names (a
/// client sending many made-up model names cannot flood the log).
const OTHER_MODEL_ERROR_INTERVAL: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
enum Slot {
    Ready(Arc<ModelTokenizer>),
    Failed { at: Instant },
}

/// Tokenizers per model (share via `Arc`; all methods take `&self`).
#[derive(Debug)]
pub struct TokenizerPool {
    dir: PathBuf,
    metrics: TokenizerMetrics,
    retry_interval: Duration,
    cache_capacity: usize,
    slots: RwLock<HashMap<String, Slot>>,
    load_lock: Mutex<()>,
    /// When a model no rule names last logged its failed load at `error` (clients choose those
    /// names, so one such line per [`OTHER_MODEL_ERROR_INTERVAL`] at most; the rest at debug).
    other_error_logged: Mutex<Option<Instant>>,
}

impl TokenizerPool {
    /// A pool reading tokenizers from `dir` (`--tokenizer-dir`), reporting to `metrics`.
    pub fn new(dir: PathBuf, metrics: TokenizerMetrics) -> Self {
        TokenizerPool {
            dir,
            metrics,
            retry_interval: DEFAULT_RETRY_INTERVAL,
            cache_capacity: TokenCache::DEFAULT_CAPACITY,
            slots: RwLock::new(HashMap::new()),
            load_lock: Mutex::new(()),
            other_error_logged: Mutex::new(None),
        }
    }

    /// Sets how long a failed load is remembered before it is retried.
    pub fn with_retry_interval(mut self, interval: Duration) -> Self {
        self.retry_interval = interval;
        self
    }

    /// Sets the per-model recent-tokenization cache size in entries (0 disables it).
    pub fn with_cache_capacity(mut self, entries: usize) -> Self {
        self.cache_capacity = entries;
        self
    }

    /// The tokenizer directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Token ids of `prompt` as vLLM computes them for `api` on `model` (see
    /// [`super::encode`]). Errors: [`TokenizeError::NoTokenizer`] (missing/broken tokenizer,
    /// negative-cached), [`TokenizeError::Template`] (counted per model),
    /// [`TokenizeError::Encode`], [`TokenizeError::Empty`].
    pub fn encode(
        &self,
        model: &str,
        api: ApiKind,
        prompt: &Prompt,
        add_special_tokens: Option<bool>,
    ) -> Result<Arc<[u32]>, TokenizeError> {
        // Token-id prompts need no tokenizer.
        if let Prompt::TokenIds(ids) = prompt {
            return token_ids(ids, usize::MAX);
        }
        let tok = self.get(model)?;
        let out = tok.encode(model, api, prompt, add_special_tokens, &self.metrics);
        if let Err(TokenizeError::Template { .. }) = &out {
            self.metrics
                .template_errors
                .get_or_create(&self.metrics.label(model))
                .inc();
        }
        out
    }

    /// [`Self::encode`] within `bounds` (see [`ModelTokenizer::encode_bounded`]); also
    /// [`TokenizeError::Oversize`] for a cut prefix the tokenizer cannot encode exactly.
    pub fn encode_bounded(
        &self,
        model: &str,
        api: ApiKind,
        prompt: &Prompt,
        add_special_tokens: Option<bool>,
        bounds: EncodeBounds,
    ) -> Result<Arc<[u32]>, TokenizeError> {
        if let Prompt::TokenIds(ids) = prompt {
            return token_ids(ids, bounds.limit(None));
        }
        let tok = self.get(model)?;
        let out = tok.encode_bounded(
            model,
            api,
            prompt,
            add_special_tokens,
            bounds,
            &self.metrics,
        );
        if let Err(TokenizeError::Template { .. }) = &out {
            self.metrics
                .template_errors
                .get_or_create(&self.metrics.label(model))
                .inc();
        }
        out
    }

    /// The loaded tokenizer of `model`, loading it if needed (see the module doc).
    pub fn get(&self, model: &str) -> Result<Arc<ModelTokenizer>, TokenizeError> {
        if let Some(r) = self.cached(model) {
            return r;
        }
        let _guard = self.load_lock.lock();
        if let Some(r) = self.cached(model) {
            return r;
        }
        self.load(model)
    }

    /// `Some` when the slot answers without loading: ready, or failed within the interval.
    fn cached(&self, model: &str) -> Option<Result<Arc<ModelTokenizer>, TokenizeError>> {
        match self.slots.read().get(model)? {
            Slot::Ready(t) => Some(Ok(t.clone())),
            Slot::Failed { at } if at.elapsed() < self.retry_interval => {
                Some(Err(no_tokenizer(model)))
            }
            Slot::Failed { .. } => None,
        }
    }

    fn load(&self, model: &str) -> Result<Arc<ModelTokenizer>, TokenizeError> {
        let label = self.metrics.label(model);
        let result = match valid_model_name(model) {
            Err(e) => Err(e),
            Ok(()) => ModelTokenizer::load(&self.dir.join(model_slug(model)), self.cache_capacity),
        };
        if result.is_err() && model.len() > MAX_MODEL_DIR_BYTES {
            // A name no directory can have is not remembered: clients choose model names, and
            // 4,096 slots of names up to the routing parse's string bound (1 MiB) would hold
            // gigabytes. Refusing it again costs its length check alone.
            self.metrics.load_failures.get_or_create(&label).inc();
            tracing::debug!(
                model_bytes = model.len(),
                "tokenizer lookup refused: the model name is too long for a directory"
            );
            return Err(no_tokenizer(&bounded_name(model)));
        }
        let mut slots = self.slots.write();
        let first_failure = !slots.contains_key(model);
        if slots.len() >= MAX_SLOTS {
            slots.retain(|_, s| matches!(s, Slot::Ready(_)));
        }
        match result {
            Ok(tok) => {
                let tok = Arc::new(tok);
                slots.insert(model.to_owned(), Slot::Ready(tok.clone()));
                self.metrics.degraded.get_or_create(&label).set(0);
                tracing::info!(model, dir = %self.dir.display(), "tokenizer loaded");
                Ok(tok)
            }
            Err(error) => {
                slots.insert(model.to_owned(), Slot::Failed { at: Instant::now() });
                self.metrics.degraded.get_or_create(&label).set(1);
                self.metrics.load_failures.get_or_create(&label).inc();
                let named = self.metrics.rule_models.read().contains(model);
                if first_failure && named {
                    tracing::error!(model, %error, retry_secs = self.retry_interval.as_secs(),
                        "no usable tokenizer; KV routing for this model falls back to the rule's selector");
                } else if first_failure && self.other_warn_due() {
                    tracing::error!(model, %error, retry_secs = self.retry_interval.as_secs(),
                        quiet_secs = OTHER_MODEL_ERROR_INTERVAL.as_secs(),
                        "no usable tokenizer; KV routing for this model falls back to the rule's \
                         selector (no rule names this model: further such models are logged at \
                         debug for quiet_secs, and counted in \
                         loxilb_kv_tokenizer_load_failures_total{{model=\"other\"}})");
                } else {
                    tracing::debug!(model, %error, "tokenizer load failed (a retry, or a model no rule names within the quiet interval)");
                }
                Err(no_tokenizer(model))
            }
        }
    }
}

impl TokenizerPool {
    /// True at most once per [`OTHER_MODEL_ERROR_INTERVAL`].
    fn other_warn_due(&self) -> bool {
        let mut last = self.other_error_logged.lock();
        if last.is_some_and(|t| t.elapsed() < OTHER_MODEL_ERROR_INTERVAL) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }
}

/// `model` as kept in reports and errors: itself up to [`MAX_MODEL_DIR_BYTES`] bytes; a longer
/// (client-chosen) name is cut to its first 64 bytes (at a character boundary) with its
/// length, so neither memory nor an operator's screen holds it whole.
pub fn bounded_name(model: &str) -> std::borrow::Cow<'_, str> {
    if model.len() <= MAX_MODEL_DIR_BYTES {
        return model.into();
    }
    let mut end = 64;
    while !model.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &model[..end], model.len()).into()
}

/// True for a name [`bounded_name`] shortened (it ends `… (N bytes)`).
pub fn is_shortened(name: &str) -> bool {
    name.rsplit_once("… (").is_some_and(|(_, tail)| {
        tail.strip_suffix(" bytes)")
            .is_some_and(|n| n.parse::<usize>().is_ok_and(|n| n > MAX_MODEL_DIR_BYTES))
    })
}

fn no_tokenizer(model: &str) -> TokenizeError {
    TokenizeError::NoTokenizer {
        model: model.to_owned(),
    }
}

/// Longest directory name a model's tokenizer can be staged under, in bytes (Linux's
/// `NAME_MAX`), once `/` became `__` ([`model_slug`]).
pub const MAX_MODEL_DIR_BYTES: usize = 255;

/// A model id usable as a directory name once `/` became `__`; the error says why not (a
/// longer model name than [`MAX_MODEL_DIR_BYTES`] allows is said by its length, not quoted).
pub fn valid_model_name(model: &str) -> Result<(), String> {
    let dir_bytes = model.len() + model.matches('/').count();
    if dir_bytes > MAX_MODEL_DIR_BYTES {
        return Err(format!(
            "a model name of {} bytes cannot name a tokenizer directory (at most \
             {MAX_MODEL_DIR_BYTES} bytes once / became __)",
            model.len()
        ));
    }
    if model.is_empty() || model == "." || model == ".." || model.contains(['\\', '\0']) {
        return Err(format!(
            "model {model:?} is not a valid tokenizer directory name"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model name longer than any directory's is refused without a slot (clients choose
    /// model names: 4,096 slots of megabyte names would hold gigabytes) and named shortened
    /// in the error; an ordinary unknown name is remembered in the negative cache.
    #[test]
    fn an_overlong_model_name_takes_no_slot_and_is_named_shortened() {
        let dir = tempfile::tempdir().expect("tmp");
        let metrics = TokenizerMetrics::default();
        let pool = TokenizerPool::new(dir.path().to_path_buf(), metrics.clone());
        let long = "x".repeat(1 << 20);
        for _ in 0..3 {
            let Err(TokenizeError::NoTokenizer { model }) = pool.get(&long) else {
                panic!("no tokenizer for an over-long name");
            };
            assert_eq!(model, format!("{}… (1048576 bytes)", "x".repeat(64)));
            assert!(is_shortened(&model));
        }
        assert_eq!(pool.slots.read().len(), 0, "no slot for it");
        let failures = metrics
            .load_failures
            .get_or_create(&metrics.label(&long))
            .get();
        assert_eq!(failures, 3, "each refusal counted");
        assert!(matches!(
            pool.get("unknown/model"),
            Err(TokenizeError::NoTokenizer { .. })
        ));
        assert_eq!(
            pool.slots.read().len(),
            1,
            "an ordinary name is negative-cached"
        );
        assert_eq!(
            valid_model_name(&"a/".repeat(100)),
            Err(
                "a model name of 200 bytes cannot name a tokenizer directory (at most 255 bytes \
                 once / became __)"
                    .to_string()
            ),
            "its directory name would be 300 bytes"
        );
    }
}
