//! Segment-level tokenization cache, so a conversation's next turn re-encodes only its new
//! text.
//!
//! The HF pipeline first splits the input at added tokens (`AddedVocabulary::
//! extract_and_normalize`: the chat template's role markers, BOS, ...), then pre-tokenizes and
//! runs the model on each remaining split independently, then the post-processor adds special
//! tokens. We run that same first step, and for every non-added split look up its ids by
//! XXH3-128 of the split's full text, else pre-tokenize + model-tokenize that split alone with the
//! tokenizer's own components. The result is the whole-text encoding by construction; a test
//! checks it on every captured request and on random texts.
//!
//! Not used (whole-text encoding instead) when a split's result may depend on its position:
//! a `Metaspace` pre-tokenizer (`prepend_scheme: first`), truncation or padding configured. Special
//! tokens (`add_special_tokens`) are added as the constant prefix/suffix the post-processor puts
//! around a probe text, when it does so consistently; otherwise whole-text encoding is used.

use tokenizers::{
    Model, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer,
};

use super::cache::{TextKey, TokenCache};

/// Default segment cache size (entries) per model.
pub const DEFAULT_SEGMENT_CAPACITY: usize = 8192;

/// The per-model segment encoder.
#[derive(Debug)]
pub struct SegmentEncoder {
    enabled: bool,
    affixes: Option<(Vec<u32>, Vec<u32>)>,
    cache: TokenCache,
}

impl SegmentEncoder {
    /// Decides whether segment encoding is exact for `tok` (`pre_tokenizer_json` is the
    /// `pre_tokenizer` object of `tokenizer.json`) and probes the special-token affixes.
    pub fn new(tok: &Tokenizer, pre_tokenizer_json: &serde_json::Value, capacity: usize) -> Self {
        let enabled = capacity > 0
            && !pre_tokenizer_json.to_string().contains("Metaspace")
            && tok.get_truncation().is_none()
            && tok.get_padding().is_none();
        let affixes = if enabled { probe_affixes(tok) } else { None };
        SegmentEncoder {
            enabled,
            affixes,
            cache: TokenCache::new(capacity),
        }
    }

    /// The ids of `text` through the segment cache; `None` when segment encoding is not exact
    /// for this tokenizer (the caller encodes the whole text). Errors are the tokenizer's.
    pub fn encode(
        &self,
        tok: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> Option<Result<Vec<u32>, String>> {
        if !self.enabled {
            return None;
        }
        let (prefix, suffix) = match (&self.affixes, add_special_tokens) {
            (_, false) => (&[][..], &[][..]),
            (Some((p, s)), true) => (&p[..], &s[..]),
            (None, true) => return None,
        };
        Some(self.encode_splits(tok, text).map(|body| {
            let mut ids = Vec::with_capacity(prefix.len() + body.len() + suffix.len());
            ids.extend_from_slice(prefix);
            ids.extend(body);
            ids.extend_from_slice(suffix);
            ids
        }))
    }

    /// Entries currently cached.
    pub fn cached_entries(&self) -> usize {
        self.cache.len()
    }

    fn encode_splits(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
        let pts = tok
            .get_added_vocabulary()
            .extract_and_normalize(tok.get_normalizer(), text);
        let mut ids = Vec::new();
        for (piece, _, tokens) in pts.get_splits(OffsetReferential::Original, OffsetType::None) {
            match tokens {
                Some(added) => ids.extend(added.iter().map(|t| t.id)),
                None if piece.is_empty() => {}
                None => {
                    let key = TextKey::new(piece, false);
                    if let Some(cached) = self.cache.get(&key) {
                        ids.extend_from_slice(&cached);
                        continue;
                    }
                    let seg = encode_piece(tok, piece)?;
                    ids.extend_from_slice(&seg);
                    self.cache.put(key, seg.into());
                }
            }
        }
        Ok(ids)
    }
}

/// Pre-tokenizes and model-tokenizes one already-normalized split, exactly as the pipeline does.
fn encode_piece(tok: &Tokenizer, piece: &str) -> Result<Vec<u32>, String> {
    let mut pts = PreTokenizedString::from(piece);
    if let Some(pre) = tok.get_pre_tokenizer() {
        pre.pre_tokenize(&mut pts).map_err(|e| e.to_string())?;
    }
    pts.tokenize(|n| tok.get_model().tokenize(n.get()))
        .map_err(|e| e.to_string())?;
    Ok(pts
        .get_splits(OffsetReferential::Original, OffsetType::None)
        .into_iter()
        .flat_map(|(_, _, t)| t.iter().flatten().map(|t| t.id))
        .collect())
}

/// The constant ids the post-processor puts before and after a sequence, found by encoding
/// probes with and without special tokens; `None` unless two probes agree.
fn probe_affixes(tok: &Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    let ids = |t: &str, add: bool| tok.encode_fast(t, add).ok().map(|e| e.get_ids().to_vec());
    let (plain, full) = (ids("a", false)?, ids("a", true)?);
    if plain.is_empty() {
        return None;
    }
    let at = full
        .windows(plain.len())
        .position(|w| w == plain.as_slice())?;
    let (prefix, suffix) = (full[..at].to_vec(), full[at + plain.len()..].to_vec());
    let (plain2, full2) = (ids("Hello world 42", false)?, ids("Hello world 42", true)?);
    let expected: Vec<u32> = prefix
        .iter()
        .chain(&plain2)
        .chain(&suffix)
        .copied()
        .collect();
    (expected == full2).then_some((prefix, suffix))
}
