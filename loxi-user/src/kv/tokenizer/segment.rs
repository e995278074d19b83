//! Segment-level tokenization cache, so a conversation's next turn re-encodes only its new
//! text.
//!
//! The HF pipeline first splits the input at added tokens (`AddedVocabulary::
//! extract_and_normalize`: the chat template's role markers, BOS, ...), then pre-tokenizes and
//! runs the model on each remaining split independently, then the post-processor adds special
//! tokens. We run that same first step, and for every non-added split look up its ids by
//! XXH3-128 of the split's full text, else pre-tokenize + model-tokenize that split alone with the
//! tokenizer's own components. The result is the whole-text encoding by construction; a test
//! checks it on every captured request and on random texts. For byte-level BPE tokenizers of the
//! supported shapes, a split of printable ASCII is pre-tokenized and model-tokenized by
//! [`FastBpe`] instead (the same ids without HF's per-token allocations, see `fast_bpe.rs`).
//!
//! Long splits are cut further into chunks of about [`CHUNK_BYTES`] at *word boundaries*: an
//! ASCII letter, a space, an ASCII letter (`"…d w…"`, cut before the space). For the
//! pre-tokenizers listed in [`word_boundaries_exact`] every pre-token that covers the letter
//! before the space ends at the space (each alternative that matches a letter runs greedily over
//! letters and cannot take a following space), none of their regexes look behind, and their
//! lookaheads only follow whitespace, so pre-tokenizing the chunks one by one gives the same
//! pre-tokens as the whole split; the BPE model then works per pre-token. Chunks are cut at
//! positions that depend only on the text before them, so prompts sharing a long prefix (a
//! system prompt, a document) share its chunks and only the new tail is encoded.
//!
//! Not used (whole-text encoding instead) when a split's result may depend on its position:
//! a `Metaspace` pre-tokenizer (`prepend_scheme: first`), truncation or padding configured. Special
//! tokens (`add_special_tokens`) are added as the constant prefix/suffix the post-processor puts
//! around a probe text, when it does so consistently; otherwise whole-text encoding is used.

use tokenizers::{
    Model, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer,
};

use super::cache::{TextKey, TokenCache};
use super::fast_bpe::{
    CJK_SPLIT_REGEX, DEEPSEEK3_SPLIT_REGEX, DIGITS3_SPLIT_REGEX, FastBpe, LLAMA3_SPLIT_REGEX,
    QWEN2_SPLIT_REGEX,
};

/// Default segment cache size (entries) per model.
pub const DEFAULT_SEGMENT_CAPACITY: usize = 8192;

/// Smallest chunk a long split is cut into, bytes (chunks end at the first word boundary at or
/// after this length; a split shorter than twice this is not cut).
pub const CHUNK_BYTES: usize = 512;

/// The regexes of `Split` pre-tokenizers (behaviour `Isolated`, not inverted) for which cutting
/// at a word boundary is exact: Llama 3, Qwen 2 and DeepSeek V3 (its three splits, see
/// `golden/bos-model`). Each alternative that can match an ASCII letter either stops at a
/// non-letter or matches no letters at all, and no pattern looks behind.
const WORD_SAFE_SPLIT_REGEXES: [&str; 5] = [
    LLAMA3_SPLIT_REGEX,
    QWEN2_SPLIT_REGEX,
    DIGITS3_SPLIT_REGEX,
    CJK_SPLIT_REGEX,
    DEEPSEEK3_SPLIT_REGEX,
];

/// True when cutting a split at word boundaries cannot change its pre-tokens: a `ByteLevel`
/// pre-tokenizer (GPT-2's regex when `use_regex`, none otherwise) without `add_prefix_space`,
/// or a `Sequence` of those and of `Split`s whose regex is in [`WORD_SAFE_SPLIT_REGEXES`].
/// Anything else (Metaspace, Whitespace, unknown regexes) answers false.
pub fn word_boundaries_exact(pre_tokenizer_json: &serde_json::Value) -> bool {
    let v = pre_tokenizer_json;
    match v["type"].as_str() {
        Some("ByteLevel") => v["add_prefix_space"].as_bool() == Some(false),
        Some("Split") => {
            v["behavior"].as_str() == Some("Isolated")
                && v["invert"].as_bool() == Some(false)
                && v["pattern"]["Regex"].as_str().is_some_and(|r| {
                    // Some files spell `\r`/`\n` as the characters themselves.
                    let r = r.replace('\r', r"\r").replace('\n', r"\n");
                    WORD_SAFE_SPLIT_REGEXES.contains(&r.as_str())
                })
        }
        Some("Sequence") => v["pretokenizers"]
            .as_array()
            .is_some_and(|a| !a.is_empty() && a.iter().all(word_boundaries_exact)),
        _ => false,
    }
}

/// True when no added token can match across a word boundary (`letter|space letter`) or take
/// its space: no content has an ASCII letter followed by a space, and no token that begins or
/// ends with an ASCII letter strips whitespace or must be a single word. Then added-token
/// extraction on word-boundary chunks finds the same tokens as on the whole text (chat role
/// markers such as `<|im_start|>` qualify).
pub fn added_tokens_keep_off_word_boundaries(tok: &Tokenizer) -> bool {
    tok.get_added_tokens_decoder().values().all(|t| {
        let b = t.content.as_bytes();
        let spans = b
            .windows(2)
            .any(|w| w[0].is_ascii_alphabetic() && w[1] == b' ');
        let letter_edge = b.first().is_some_and(u8::is_ascii_alphabetic)
            || b.last().is_some_and(u8::is_ascii_alphabetic);
        !spans && !(letter_edge && (t.lstrip || t.rstrip || t.single_word))
    })
}

/// True when the normalizer is absent or only Unicode normalization forms (NFC, NFD, NFKC,
/// NFKD, alone or in a `Sequence`), each of which maps ASCII text to itself.
pub fn unicode_forms_only(normalizer_json: &serde_json::Value) -> bool {
    let v = normalizer_json;
    match v["type"].as_str() {
        None => v.is_null(),
        Some("NFC" | "NFD" | "NFKC" | "NFKD") => true,
        Some("Sequence") => v["normalizers"]
            .as_array()
            .is_some_and(|a| a.iter().all(unicode_forms_only)),
        Some(_) => false,
    }
}

/// Cuts `text` into chunks of at least `min` bytes, each ending just before a word boundary's
/// space (or at the end); the last chunk may be shorter. A cut depends only on the text up to
/// one byte past it.
pub fn word_chunks(text: &str, min: usize) -> impl Iterator<Item = &str> {
    let b = text.as_bytes();
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= b.len() {
            return None;
        }
        let mut end = b.len();
        let mut p = start + min;
        while p + 1 < b.len() {
            if b[p] == b' ' && b[p - 1].is_ascii_alphabetic() && b[p + 1].is_ascii_alphabetic() {
                end = p;
                break;
            }
            p += 1;
        }
        let chunk = &text[start..end];
        start = end;
        Some(chunk)
    })
}

/// The longest prefix of `text` that ends at a word boundary (just before the space of an
/// ASCII letter, a space, an ASCII letter), or `None` when it has none. Cutting there is exact
/// for the tokenizers whose [`SegmentEncoder::raw_chunked`] is true.
pub fn last_word_boundary(text: &str) -> Option<&str> {
    let b = text.as_bytes();
    (1..b.len().saturating_sub(1))
        .rev()
        .find(|&p| b[p] == b' ' && b[p - 1].is_ascii_alphabetic() && b[p + 1].is_ascii_alphabetic())
        .map(|p| &text[..p])
}

/// The per-model segment encoder.
#[derive(Debug)]
pub struct SegmentEncoder {
    enabled: bool,
    chunked: bool,
    raw_chunked: bool,
    ascii_unnormalized: bool,
    affixes: Option<(Vec<u32>, Vec<u32>)>,
    cache: TokenCache,
    fast: Option<FastBpe>,
}

impl SegmentEncoder {
    /// Decides whether segment encoding is exact for `tok` (`pre_tokenizer_json` and
    /// `normalizer_json` are those objects of `tokenizer.json`, after any class substitution)
    /// and probes the special-token affixes.
    pub fn new(
        tok: &Tokenizer,
        pre_tokenizer_json: &serde_json::Value,
        normalizer_json: &serde_json::Value,
        capacity: usize,
    ) -> Self {
        let enabled = capacity > 0
            && !pre_tokenizer_json.to_string().contains("Metaspace")
            && tok.get_truncation().is_none()
            && tok.get_padding().is_none();
        let affixes = if enabled { probe_affixes(tok) } else { None };
        let chunked = enabled && word_boundaries_exact(pre_tokenizer_json);
        let ascii_unnormalized = unicode_forms_only(normalizer_json);
        let fast = if enabled {
            FastBpe::new(tok)
                .inspect_err(|e| tracing::debug!(error = %e, "segment encoding uses HF's pipeline"))
                .ok()
        } else {
            None
        };
        SegmentEncoder {
            enabled,
            chunked,
            raw_chunked: chunked
                && ascii_unnormalized
                && added_tokens_keep_off_word_boundaries(tok),
            ascii_unnormalized,
            affixes,
            cache: TokenCache::new(capacity),
            fast,
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
        self.encode_upto(tok, text, add_special_tokens, usize::MAX)
            .map(|r| r.map(|(ids, _)| ids))
    }

    /// Like [`Self::encode`], but stops between segments once `max_ids` body ids are known;
    /// then the post-processor's suffix is left off and the flag is true. The ids returned are
    /// always a prefix of the whole text's.
    pub fn encode_upto(
        &self,
        tok: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
        max_ids: usize,
    ) -> Option<Result<(Vec<u32>, bool), String>> {
        if !self.enabled {
            return None;
        }
        let (prefix, suffix) = match (&self.affixes, add_special_tokens) {
            (_, false) => (&[][..], &[][..]),
            (Some((p, s)), true) => (&p[..], &s[..]),
            (None, true) => return None,
        };
        Some(self.encode_body(tok, text, max_ids).map(|(body, stopped)| {
            let mut ids = Vec::with_capacity(prefix.len() + body.len() + suffix.len());
            ids.extend_from_slice(prefix);
            ids.extend(body);
            if !stopped {
                ids.extend_from_slice(suffix);
            }
            (ids, stopped)
        }))
    }

    /// Entries currently cached.
    pub fn cached_entries(&self) -> usize {
        self.cache.len()
    }

    /// The body ids of `text`: when raw chunking is exact, word-boundary chunks of the raw text
    /// each from the cache or encoded alone (so a long shared prefix costs only hashing);
    /// otherwise [`Self::encode_splits`]. Stops between chunks once `max_ids` ids are known
    /// (the flag says it stopped before the end).
    fn encode_body(
        &self,
        tok: &Tokenizer,
        text: &str,
        max_ids: usize,
    ) -> Result<(Vec<u32>, bool), String> {
        if !self.raw_chunked || text.len() < 2 * CHUNK_BYTES {
            return self.encode_splits(tok, text, max_ids);
        }
        let mut ids = Vec::new();
        let mut chunks = word_chunks(text, CHUNK_BYTES).peekable();
        while let Some(chunk) = chunks.next() {
            self.cached(TextKey::raw_chunk(chunk), &mut ids, || {
                self.encode_splits(tok, chunk, usize::MAX)
                    .map(|(ids, _)| ids)
            })?;
            if ids.len() >= max_ids && chunks.peek().is_some() {
                return Ok((ids, true));
            }
        }
        Ok((ids, false))
    }

    fn encode_splits(
        &self,
        tok: &Tokenizer,
        text: &str,
        max_ids: usize,
    ) -> Result<(Vec<u32>, bool), String> {
        // Unicode normalization forms leave ASCII unchanged; skipping them saves a full
        // decompose/recompose pass over long prompts (Qwen2's NFC).
        let normalizer = if self.ascii_unnormalized && text.is_ascii() {
            None
        } else {
            tok.get_normalizer()
        };
        let pts = tok
            .get_added_vocabulary()
            .extract_and_normalize(normalizer, text);
        let mut ids = Vec::new();
        let splits = pts.get_splits(OffsetReferential::Original, OffsetType::None);
        let last = splits.len().saturating_sub(1);
        for (i, (piece, _, tokens)) in splits.into_iter().enumerate() {
            match tokens {
                Some(added) => ids.extend(added.iter().map(|t| t.id)),
                None if piece.is_empty() => {}
                None if self.chunked && piece.len() >= 2 * CHUNK_BYTES => {
                    let mut chunks = word_chunks(piece, CHUNK_BYTES).peekable();
                    while let Some(chunk) = chunks.next() {
                        self.cached(TextKey::new(chunk, false), &mut ids, || {
                            self.encode_piece(tok, chunk)
                        })?;
                        if ids.len() >= max_ids && (chunks.peek().is_some() || i < last) {
                            return Ok((ids, true));
                        }
                    }
                }
                None => self.cached(TextKey::new(piece, false), &mut ids, || {
                    self.encode_piece(tok, piece)
                })?,
            }
            if ids.len() >= max_ids && i < last {
                return Ok((ids, true));
            }
        }
        Ok((ids, false))
    }

    /// Appends the ids cached under `key`, else those `encode` gives (then cached).
    fn cached(
        &self,
        key: TextKey,
        ids: &mut Vec<u32>,
        encode: impl FnOnce() -> Result<Vec<u32>, String>,
    ) -> Result<(), String> {
        if let Some(cached) = self.cache.get(&key) {
            ids.extend_from_slice(&cached);
            return Ok(());
        }
        let seg = encode()?;
        ids.extend_from_slice(&seg);
        self.cache.put(key, seg.into());
        Ok(())
    }

    /// The ids the post-processor appends after a sequence with special tokens `add` (`None`
    /// when not probed).
    pub fn suffix(&self, add: bool) -> Option<&[u32]> {
        match (&self.affixes, add) {
            (_, false) => Some(&[]),
            (Some((_, s)), true) => Some(s),
            (None, true) => None,
        }
    }

    /// Pre-tokenizes and model-tokenizes one already-normalized split: with the fast
    /// byte-level encoder when it applies to this tokenizer and accepts the split (see
    /// [`FastBpe::encode_piece`]), else with HF's components.
    fn encode_piece(&self, tok: &Tokenizer, piece: &str) -> Result<Vec<u32>, String> {
        if let Some(fast) = &self.fast {
            let mut ids = Vec::new();
            if fast.encode_piece(piece, &mut ids) {
                return Ok(ids);
            }
        }
        hf_encode_piece(tok, piece)
    }

    /// The fast byte-level encoder, when this tokenizer qualifies (see [`FastBpe::new`]).
    pub fn fast_bpe(&self) -> Option<&FastBpe> {
        self.fast.as_ref()
    }

    /// True when long splits are cut at word boundaries (see [`word_boundaries_exact`]).
    pub fn chunked(&self) -> bool {
        self.chunked
    }

    /// True when the raw text is cut at word boundaries before added-token extraction and
    /// normalization (see [`added_tokens_keep_off_word_boundaries`]).
    pub fn raw_chunked(&self) -> bool {
        self.raw_chunked
    }
}

/// Pre-tokenizes and model-tokenizes one already-normalized split with HF's own components,
/// exactly as the pipeline does.
pub fn hf_encode_piece(tok: &Tokenizer, piece: &str) -> Result<Vec<u32>, String> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chunks_end_before_a_letter_space_letter_and_concatenate_to_the_text() {
        let text = "aaaa bbbb 1 cc\u{e9} dd. ee ff";
        let chunks: Vec<&str> = word_chunks(text, 3).collect();
        assert_eq!(chunks, ["aaaa", " bbbb 1 cc\u{e9} dd. ee", " ff"]);
        assert_eq!(chunks.concat(), text);
        // A cut depends only on the text before it (plus one byte): a shared prefix cuts alike.
        let other: Vec<&str> = word_chunks("aaaa bbbb 1 cc\u{e9} dd. ee zz yy", 3).collect();
        assert_eq!(&other[..2], &chunks[..2]);
        assert_eq!(word_chunks("", 4).count(), 0);
        assert_eq!(word_chunks("abc", 10).collect::<Vec<_>>(), ["abc"]);
    }

    #[test]
    fn only_listed_pre_tokenizers_are_cut_at_word_boundaries() {
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true});
        assert!(word_boundaries_exact(&byte_level));
        let prefix_space =
            json!({"type": "ByteLevel", "add_prefix_space": true, "use_regex": true});
        assert!(!word_boundaries_exact(&prefix_space));
        let split = |re: &str, behavior: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": behavior, "invert": false});
        let digits = split(r"\p{N}{1,3}", "Isolated");
        assert!(word_boundaries_exact(
            &json!({"type": "Sequence", "pretokenizers": [digits, byte_level]})
        ));
        let words = split(r"\w+", "Isolated");
        assert!(!word_boundaries_exact(
            &json!({"type": "Sequence", "pretokenizers": [words, byte_level]})
        ));
        assert!(!word_boundaries_exact(&split(r"\p{N}{1,3}", "Removed")));
        assert!(!word_boundaries_exact(
            &json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first"})
        ));
        assert!(!word_boundaries_exact(
            &json!({"type": "Sequence", "pretokenizers": []})
        ));
        assert!(!word_boundaries_exact(&serde_json::Value::Null));
    }

    #[test]
    fn only_unicode_normal_forms_are_skipped_for_ascii() {
        assert!(unicode_forms_only(&serde_json::Value::Null));
        assert!(unicode_forms_only(&json!({"type": "NFC"})));
        assert!(unicode_forms_only(
            &json!({"type": "Sequence", "normalizers": [{"type": "NFKD"}, {"type": "NFC"}]})
        ));
        assert!(!unicode_forms_only(&json!({"type": "Lowercase"})));
        assert!(!unicode_forms_only(
            &json!({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Prepend", "prepend": "_"}]})
        ));
    }
}
