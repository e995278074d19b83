//! An exact fast encoder for byte-level BPE pieces (issue 17 §2: a cold 4,096-token decision
//! under 1 ms).
//!
//! HF `tokenizers` encodes one split (the text between two added tokens, already normalized)
//! by building a `NormalizedString` per pre-token (a copy of the text, an alignment vector),
//! rewriting it through the byte-level table, and asking the BPE model for each word (a lock,
//! a `String` key, a `Token` with its own `String` per id). [`FastBpe::encode_piece`] computes
//! the same ids for the pieces it can prove exact, on bytes, with no allocation per token:
//!
//! 1. The piece must be made of printable ASCII, tab, line feed and carriage return only (see
//!    [`is_fast_byte`]); anything else (other control characters, non-ASCII) is refused and
//!    the caller encodes the piece with HF's own components.
//! 2. Pre-tokenization: each configured regex is replaced by a hand-written scanner that
//!    follows the regex engine's own search on that alphabet (leftmost start, alternatives in
//!    order, greedy quantifiers with backtracking, see [`PreStep`]); a `Sequence` applies its
//!    `Split`s one after another, each on the previous pieces, as HF's `Sequence` does.
//!    `Isolated` splits keep both the matches and the text between them.
//! 3. The byte-level step maps each byte to one character of GPT-2's table; BPE over those
//!    characters is BPE over the bytes, so the table is folded into a byte → initial-id array
//!    and nothing is materialised.
//! 4. BPE: when `ignore_merges` is set and the whole word is a vocabulary entry, that one id
//!    (HF's `BPE::tokenize_with_cache`); otherwise merges by lowest rank, leftmost on ties,
//!    exactly as HF's `Word::merge_all` (ported as is for long words, a linear scan over the
//!    pair ranks for short ones: the same order of merges, see [`FastBpe::merge`]).
//! 5. A per-thread word cache (raw bytes → ids), bounded, per model.
//!
//! Which tokenizers qualify is decided once per model by [`FastBpe::new`] from HF's own loaded
//! pipeline: a `BPE` model without dropout, continuing-subword prefix, end-of-word suffix or
//! byte fallback; a pre-tokenizer that is GPT-2's `ByteLevel` (`add_prefix_space` false, with
//! or without its regex), or a `Sequence` of allow-listed `Isolated` `Split` regexes ending
//! with such a `ByteLevel`. The normalizer does not matter here: the encoder starts where HF's
//! model step starts, on the already normalized split (`segment.rs` skips the normalizer only
//! when it is the identity on ASCII).
//!
//! Sources of the contract: `tokenizers` 0.22 `pre_tokenizers/byte_level.rs` (the GPT-2 regex
//! and byte table), `pre_tokenizers/split.rs` + `tokenizer/pattern.rs` (Isolated splits over
//! `find_iter`), `models/bpe/model.rs` (`tokenize_with_cache`, `merge_word`) and
//! `models/bpe/word.rs` (`merge_all`). Tests compare every path with HF on the golden models,
//! the captured requests and randomized texts.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;
use tokenizers::Tokenizer;
use tokenizers::models::ModelWrapper;

/// Llama 3's pre-tokenization regex (digits in runs of up to three).
pub const LLAMA3_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's pre-tokenization regex (digits one by one; transformers
/// `models/qwen2/tokenization_qwen2.py`).
pub const QWEN2_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek V3's first split: digits in runs of up to three.
pub const DIGITS3_SPLIT_REGEX: &str = r"\p{N}{1,3}";

/// DeepSeek V3's second split: CJK ideographs, hiragana, katakana (never matches ASCII).
pub const CJK_SPLIT_REGEX: &str = "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+";

/// DeepSeek V3's third split (`golden/bos-model`).
pub const DEEPSEEK3_SPLIT_REGEX: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;

/// Words longer than this (bytes) are merged but not cached (HF caches words under 256).
const MAX_CACHED_WORD: usize = 64;

/// Words per model and thread in the word cache; reaching it empties that cache.
pub const WORD_CACHE_CAPACITY: usize = 16_384;

/// Models whose word caches one thread keeps (the least recently used beyond is dropped).
const MODELS_PER_THREAD: usize = 4;

/// Words of at most this many bytes are merged by scanning pair ranks; longer ones with HF's
/// heap (O(n log n), for long whitespace or punctuation runs).
const SCAN_MERGE_MAX: usize = 48;

/// No id / no merge.
const NONE: u32 = u32::MAX;

/// One pre-tokenization step, each the exact equivalent of a regex on the fast alphabet
/// ([`is_fast_byte`]: letters `A-Za-z`, digits, space, tab, `\n`, `\r`, the other printable
/// ASCII characters as punctuation). The regex engine (oniguruma) finds the leftmost position
/// where some alternative matches, tries alternatives in order, quantifiers greedy with
/// backtracking; each scanner answers the end of the match at a position, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreStep {
    /// GPT-2's `ByteLevel` regex:
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    /// (contractions case-sensitive).
    Gpt2,
    /// [`LLAMA3_SPLIT_REGEX`] (`max_digits` 3) or [`QWEN2_SPLIT_REGEX`] (`max_digits` 1);
    /// contractions case-insensitive.
    LlamaQwen {
        /// Longest digit run one match takes.
        max_digits: usize,
    },
    /// [`DIGITS3_SPLIT_REGEX`].
    Digits3,
    /// [`DEEPSEEK3_SPLIT_REGEX`].
    DeepSeek3,
}

/// Why a tokenizer does not take the fast path (it keeps HF's path, unchanged).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fast byte-level BPE not applicable: {0}")]
pub struct NotApplicable(pub String);

fn not_applicable<T>(why: impl Into<String>) -> Result<T, NotApplicable> {
    Err(NotApplicable(why.into()))
}

/// The fast encoder of one model (see the module documentation). Immutable and shared; the
/// scratch buffers and the word cache are per thread.
pub struct FastBpe {
    /// Namespace of this model's per-thread word caches.
    cache_id: u64,
    steps: Box<[PreStep]>,
    /// Initial id of each ASCII byte (its byte-level character's vocabulary id), or [`NONE`].
    byte_ids: [u32; 128],
    /// `(left id << 32) | right id` → (rank, merged id).
    merges: HashMap<u64, (u32, u32), foldhash::fast::RandomState>,
    /// With `ignore_merges`: every vocabulary entry spelling an ASCII byte string, by those
    /// bytes.
    whole_words: Option<HashMap<Box<[u8]>, u32, foldhash::fast::RandomState>>,
}

impl std::fmt::Debug for FastBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastBpe")
            .field("steps", &self.steps)
            .field("merges", &self.merges.len())
            .field("ignore_merges", &self.whole_words.is_some())
            .finish_non_exhaustive()
    }
}

static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

impl FastBpe {
    /// The fast encoder for `tok`, read from HF's loaded pipeline (so it sees exactly what HF
    /// runs, after any class substitution): the model's settings, vocabulary and merges (in
    /// rank order, as HF serializes them) and the pre-tokenizer. Errors name the first setting
    /// outside the supported set (the module documentation lists it).
    pub fn new(tok: &Tokenizer) -> Result<Self, NotApplicable> {
        let ModelWrapper::BPE(bpe) = tok.get_model() else {
            return not_applicable("the model is not BPE");
        };
        if bpe.dropout.is_some() {
            return not_applicable("BPE dropout is set");
        }
        if bpe.continuing_subword_prefix.is_some() {
            return not_applicable("BPE continuing_subword_prefix is set");
        }
        if bpe.end_of_word_suffix.is_some() {
            return not_applicable("BPE end_of_word_suffix is set");
        }
        if bpe.byte_fallback {
            return not_applicable("BPE byte_fallback is true");
        }
        let Some(pre) = tok.get_pre_tokenizer() else {
            return not_applicable("no pre-tokenizer (no byte-level step)");
        };
        let pre = serde_json::to_value(pre)
            .map_err(|e| NotApplicable(format!("pre-tokenizer does not serialize: {e}")))?;
        let steps = pre_steps(&pre)?;

        let vocab = bpe.get_vocab();
        let mut byte_ids = [NONE; 128];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            let c = byte_level_char(b as u8);
            if let Some(&v) = vocab.get(c.encode_utf8(&mut [0; 4]) as &str) {
                *id = v;
            }
        }
        let model = serde_json::to_value(bpe)
            .map_err(|e| NotApplicable(format!("BPE model does not serialize: {e}")))?;
        let Some(list) = model["merges"].as_array() else {
            return not_applicable("BPE merges are not a list");
        };
        let mut merges =
            HashMap::with_capacity_and_hasher(list.len(), foldhash::fast::RandomState::default());
        for (rank, m) in list.iter().enumerate() {
            let (Some(a), Some(b)) = (m[0].as_str(), m[1].as_str()) else {
                return not_applicable(format!("merge {rank} is not a pair of strings: {m}"));
            };
            let (Some(&l), Some(&r), Some(&n)) = (
                vocab.get(a),
                vocab.get(b),
                vocab.get(format!("{a}{b}").as_str()),
            ) else {
                return not_applicable(format!(
                    "merge {rank} ({a:?}, {b:?}) is not in the vocabulary"
                ));
            };
            let rank = u32::try_from(rank)
                .ok()
                .filter(|&r| r != NONE)
                .ok_or_else(|| NotApplicable("too many merges".into()))?;
            merges.insert(pair_key(l, r), (rank, n));
        }
        let whole_words = bpe.ignore_merges.then(|| {
            vocab
                .iter()
                .filter_map(|(s, &id)| {
                    let bytes: Option<Box<[u8]>> = s.chars().map(ascii_byte_of).collect();
                    bytes.map(|b| (b, id))
                })
                .collect()
        });
        Ok(FastBpe {
            cache_id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
            steps: steps.into(),
            byte_ids,
            merges,
            whole_words,
        })
    }

    /// The pre-tokenization steps in the order they run.
    pub fn steps(&self) -> &[PreStep] {
        &self.steps
    }

    /// Appends to `ids` the ids HF's pre-tokenizer and BPE model give for `piece` (one split of
    /// normalized text between added tokens) and answers true; answers false and leaves `ids`
    /// as it was when the piece has a byte outside [`is_fast_byte`] or a byte whose byte-level
    /// character is not in the vocabulary (the caller then uses HF's path).
    pub fn encode_piece(&self, piece: &str, ids: &mut Vec<u32>) -> bool {
        let text = piece.as_bytes();
        if !text.iter().all(|&b| is_fast_byte(b)) {
            return false;
        }
        SCRATCH.with(|cell| {
            let Ok(mut guard) = cell.try_borrow_mut() else {
                return false;
            };
            let Scratch {
                cur,
                next,
                merge,
                caches,
            } = &mut *guard;
            pre_tokenize(&self.steps, text, cur, next);
            let cache = word_cache(caches, self.cache_id);
            let start = ids.len();
            for &(a, e) in cur.iter() {
                if !self.encode_word(&text[a..e], ids, cache, merge) {
                    ids.truncate(start);
                    return false;
                }
            }
            true
        })
    }

    /// The ids of one pre-token, from the word cache or merged (then cached).
    fn encode_word(
        &self,
        word: &[u8],
        ids: &mut Vec<u32>,
        cache: &mut WordCache,
        merge: &mut MergeScratch,
    ) -> bool {
        let cacheable = word.len() <= MAX_CACHED_WORD;
        if cacheable && let Some(&(at, len)) = cache.map.get(word) {
            ids.extend_from_slice(&cache.ids[at as usize..(at + len) as usize]);
            return true;
        }
        let start = ids.len();
        if !self.word_ids(word, ids, merge) {
            return false;
        }
        if cacheable {
            cache.insert(word, &ids[start..]);
        }
        true
    }

    /// HF's `BPE::tokenize_with_cache` (without its cache) for a non-empty ASCII word.
    fn word_ids(&self, word: &[u8], ids: &mut Vec<u32>, m: &mut MergeScratch) -> bool {
        if let Some(whole) = &self.whole_words
            && let Some(&id) = whole.get(word)
        {
            ids.push(id);
            return true;
        }
        m.syms.clear();
        for &b in word {
            let id = self.byte_ids[usize::from(b)];
            if id == NONE {
                return false;
            }
            m.syms.push(id);
        }
        self.merge(m);
        ids.extend_from_slice(&m.syms);
        true
    }

    /// The (rank, merged id) of a pair, `(NONE, NONE)` when it does not merge.
    #[inline]
    fn pair(&self, l: u32, r: u32) -> (u32, u32) {
        self.merges
            .get(&pair_key(l, r))
            .copied()
            .unwrap_or((NONE, NONE))
    }

    /// HF's `Word::merge_all` on `m.syms`: repeatedly the adjacent pair of lowest rank, the
    /// leftmost among equals, is replaced by its merged id. `merge_all` keeps a heap of
    /// (rank, position) with stale entries skipped; every adjacent pair gets an entry when it
    /// forms, so each pop is the lowest-rank, leftmost current pair, which is what the scan
    /// below picks too (ranks are distinct per pair; equal ranks are the same pair).
    fn merge(&self, m: &mut MergeScratch) {
        if m.syms.len() > SCAN_MERGE_MAX {
            self.merge_heap(m);
        } else {
            self.merge_scan(m);
        }
    }

    /// The merge order of [`Self::merge`] by scanning the pair ranks (O(n²), for short words).
    fn merge_scan(&self, m: &mut MergeScratch) {
        let MergeScratch { syms, pairs, .. } = m;
        pairs.clear();
        pairs.extend(syms.windows(2).map(|w| self.pair(w[0], w[1])));
        loop {
            let mut best = NONE;
            let mut at = 0;
            for (i, &(rank, _)) in pairs.iter().enumerate() {
                if rank < best {
                    best = rank;
                    at = i;
                }
            }
            if best == NONE {
                break;
            }
            syms[at] = pairs[at].1;
            syms.remove(at + 1);
            pairs.remove(at);
            if at > 0 {
                pairs[at - 1] = self.pair(syms[at - 1], syms[at]);
            }
            if at < pairs.len() {
                pairs[at] = self.pair(syms[at], syms[at + 1]);
            }
        }
    }

    /// `Word::merge_all` as HF writes it (no dropout): a min-heap of (rank, position, id).
    fn merge_heap(&self, m: &mut MergeScratch) {
        let MergeScratch {
            syms,
            symbols,
            queue,
            ..
        } = m;
        let n = syms.len();
        symbols.clear();
        symbols.extend(syms.iter().enumerate().map(|(i, &c)| Symbol {
            c,
            prev: i.checked_sub(1),
            next: (i + 1 < n).then_some(i + 1),
            alive: true,
        }));
        queue.clear();
        for i in 0..n.saturating_sub(1) {
            let (rank, id) = self.pair(syms[i], syms[i + 1]);
            if rank != NONE {
                queue.push(Reverse((rank, i, id)));
            }
        }
        while let Some(Reverse((_, pos, new_id))) = queue.pop() {
            if !symbols[pos].alive {
                continue;
            }
            let Some(next_pos) = symbols[pos].next else {
                continue;
            };
            let right = symbols[next_pos];
            // An expired entry: the pair at `pos` changed since it was pushed.
            let (rank, id) = self.pair(symbols[pos].c, right.c);
            if rank == NONE || id != new_id {
                continue;
            }
            symbols[pos].c = new_id;
            symbols[pos].next = right.next;
            symbols[next_pos].alive = false;
            if let Some(after) = right.next {
                symbols[after].prev = Some(pos);
            }
            let cur = symbols[pos];
            if let Some(p) = cur.prev {
                let (rank, id) = self.pair(symbols[p].c, cur.c);
                if rank != NONE {
                    queue.push(Reverse((rank, p, id)));
                }
            }
            if let Some(nx) = cur.next {
                let (rank, id) = self.pair(cur.c, symbols[nx].c);
                if rank != NONE {
                    queue.push(Reverse((rank, pos, id)));
                }
            }
        }
        syms.clear();
        syms.extend(symbols.iter().filter(|s| s.alive).map(|s| s.c));
    }
}

fn pair_key(l: u32, r: u32) -> u64 {
    (u64::from(l) << 32) | u64::from(r)
}

/// The pre-tokenization steps of a serialized HF pre-tokenizer: `ByteLevel` alone, or a
/// `Sequence` of allow-listed `Split`s (behavior `Isolated`, not inverted) ending with one
/// `ByteLevel`; that `ByteLevel` must not add a prefix space, and contributes GPT-2's regex
/// when `use_regex` (default true).
pub fn pre_steps(pre: &Value) -> Result<Vec<PreStep>, NotApplicable> {
    match pre["type"].as_str() {
        Some("ByteLevel") => byte_level_step(pre).map(|s| s.into_iter().collect()),
        Some("Sequence") => {
            let Some((last, splits)) = pre["pretokenizers"].as_array().and_then(|a| a.split_last())
            else {
                return not_applicable("empty pre-tokenizer Sequence");
            };
            if last["type"].as_str() != Some("ByteLevel") {
                return not_applicable("the pre-tokenizer Sequence does not end with ByteLevel");
            }
            let mut steps = Vec::new();
            for s in splits {
                steps.extend(split_step(s)?);
            }
            steps.extend(byte_level_step(last)?);
            Ok(steps)
        }
        other => not_applicable(format!("pre-tokenizer {other:?} is not supported")),
    }
}

fn byte_level_step(v: &Value) -> Result<Option<PreStep>, NotApplicable> {
    if v["add_prefix_space"].as_bool() != Some(false) {
        return not_applicable("ByteLevel add_prefix_space is not false");
    }
    Ok(v["use_regex"]
        .as_bool()
        .unwrap_or(true)
        .then_some(PreStep::Gpt2))
}

/// The step of one `Split`; `None` for a regex that never matches the fast alphabet (CJK).
fn split_step(v: &Value) -> Result<Option<PreStep>, NotApplicable> {
    if v["type"].as_str() != Some("Split") {
        return not_applicable(format!(
            "pre-tokenizer {:?} before ByteLevel is not a Split",
            v["type"]
        ));
    }
    if v["behavior"].as_str() != Some("Isolated") || v["invert"].as_bool() != Some(false) {
        return not_applicable("Split is not Isolated and non-inverted");
    }
    let Some(re) = v["pattern"]["Regex"].as_str() else {
        return not_applicable("Split pattern is not a regex");
    };
    // Some files spell `\r`/`\n` as the characters themselves (the same regex).
    let re = re.replace('\r', r"\r").replace('\n', r"\n");
    Ok(match re.as_str() {
        LLAMA3_SPLIT_REGEX => Some(PreStep::LlamaQwen { max_digits: 3 }),
        QWEN2_SPLIT_REGEX => Some(PreStep::LlamaQwen { max_digits: 1 }),
        DIGITS3_SPLIT_REGEX => Some(PreStep::Digits3),
        DEEPSEEK3_SPLIT_REGEX => Some(PreStep::DeepSeek3),
        CJK_SPLIT_REGEX => None,
        _ => return not_applicable(format!("Split regex {re:?} is not allow-listed")),
    })
}

/// The bytes the fast path accepts: printable ASCII (`0x20..=0x7e`), tab, `\n`, `\r`. On these
/// `\s` is exactly space, tab, `\n`, `\r`; `\p{L}` `A-Za-z`; `\p{N}` `0-9`; `\p{P}` ∪ `\p{S}`
/// the other 32 printable characters; `\p{M}` empty.
pub fn is_fast_byte(b: u8) -> bool {
    matches!(b, 0x20..=0x7e | b'\t' | b'\n' | b'\r')
}

/// GPT-2's byte-level character of byte `b` (`bytes_to_unicode`: printable Latin-1 bytes map
/// to themselves, the others in byte order to U+0100, U+0101, ...).
pub fn byte_level_char(b: u8) -> char {
    let printable = |x: u8| matches!(x, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// The ASCII byte whose byte-level character is `c`, if any.
fn ascii_byte_of(c: char) -> Option<u8> {
    (0u8..128).find(|&b| byte_level_char(b) == c)
}

fn is_letter(b: u8) -> bool {
    b.is_ascii_alphabetic()
}

fn is_digit(b: u8) -> bool {
    b.is_ascii_digit()
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

fn is_newline(b: u8) -> bool {
    matches!(b, b'\n' | b'\r')
}

/// `[^\s\p{L}\p{N}]` (and `[\p{P}\p{S}]`) on the fast alphabet.
fn is_punct(b: u8) -> bool {
    !is_space(b) && !is_letter(b) && !is_digit(b)
}

/// The end of the run of bytes of `class` starting at `i`.
fn run(s: &[u8], i: usize, class: fn(u8) -> bool) -> usize {
    i + s[i..].iter().take_while(|&&b| class(b)).count()
}

/// True when `s[i]` exists and is in `class`.
fn at(s: &[u8], i: usize, class: fn(u8) -> bool) -> bool {
    s.get(i).is_some_and(|&b| class(b))
}

/// The whitespace alternatives at a whitespace byte `s[i]`: `\s*[\r\n]+` (when
/// `newline_alt`), then `\s+(?!\S)`, then `\s+`.
fn whitespace(s: &[u8], i: usize, newline_alt: bool) -> usize {
    let j = run(s, i, is_space);
    // `\s*` takes the run, gives back until `[\r\n]+` can match: at the run's last newline,
    // which `[\r\n]+` takes alone (no newline follows it inside the run, a non-space after).
    if newline_alt && let Some(k) = (i..j).rev().find(|&k| is_newline(s[k])) {
        return k + 1;
    }
    // `\s+(?!\S)`: the whole run at the end of the text, else all but its last byte (that one
    // is followed by a non-space); a single space before a non-space falls to `\s+`.
    if j == s.len() || j - i == 1 { j } else { j - 1 }
}

/// `'s|'t|'re|'ve|'m|'ll|'d` at `s[i] == '\''`, case-sensitive or not.
fn contraction(s: &[u8], i: usize, any_case: bool) -> Option<usize> {
    let fold = |b: u8| if any_case { b.to_ascii_lowercase() } else { b };
    let c1 = fold(*s.get(i + 1)?);
    if matches!(c1, b's' | b't' | b'm' | b'd') {
        return Some(i + 2);
    }
    let c2 = fold(*s.get(i + 2)?);
    matches!((c1, c2), (b'r', b'e') | (b'v', b'e') | (b'l', b'l')).then_some(i + 3)
}

/// ` ?X+` for a class X: with the optional space when X follows it, else from `s[i]`.
fn space_then(s: &[u8], i: usize, class: fn(u8) -> bool) -> Option<usize> {
    if s[i] == b' ' && at(s, i + 1, class) {
        Some(run(s, i + 1, class))
    } else if class(s[i]) {
        Some(run(s, i, class))
    } else {
        None
    }
}

impl PreStep {
    /// The end of the match starting at `s[i]`, or `None` when no alternative matches there.
    fn match_at(self, s: &[u8], i: usize) -> Option<usize> {
        let c = s[i];
        match self {
            PreStep::Gpt2 => {
                if c == b'\''
                    && let Some(e) = contraction(s, i, false)
                {
                    return Some(e);
                }
                space_then(s, i, is_letter)
                    .or_else(|| space_then(s, i, is_digit))
                    .or_else(|| space_then(s, i, is_punct))
                    .or_else(|| is_space(c).then(|| whitespace(s, i, false)))
            }
            PreStep::LlamaQwen { max_digits } => {
                if c == b'\''
                    && let Some(e) = contraction(s, i, true)
                {
                    return Some(e);
                }
                // `[^\r\n\p{L}\p{N}]?\p{L}+`
                if !is_newline(c) && !is_letter(c) && !is_digit(c) && at(s, i + 1, is_letter) {
                    return Some(run(s, i + 1, is_letter));
                }
                if is_letter(c) {
                    return Some(run(s, i, is_letter));
                }
                // `\p{N}{1,n}`
                if is_digit(c) {
                    return Some(run(s, i, is_digit).min(i + max_digits));
                }
                // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
                if let Some(e) = space_then(s, i, is_punct) {
                    return Some(run(s, e, is_newline));
                }
                is_space(c).then(|| whitespace(s, i, true))
            }
            PreStep::Digits3 => is_digit(c).then(|| run(s, i, is_digit).min(i + 3)),
            PreStep::DeepSeek3 => {
                // `[!"#...~][A-Za-z]+`
                if is_punct(c) && at(s, i + 1, is_letter) {
                    return Some(run(s, i + 1, is_letter));
                }
                // `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`: the optional byte is a space, a tab
                // or a digit here.
                if matches!(c, b' ' | b'\t' | b'0'..=b'9') && at(s, i + 1, is_letter) {
                    return Some(run(s, i + 1, is_letter));
                }
                if is_letter(c) {
                    return Some(run(s, i, is_letter));
                }
                // ` ?[\p{P}\p{S}]+[\r\n]*`
                if let Some(e) = space_then(s, i, is_punct) {
                    return Some(run(s, e, is_newline));
                }
                is_space(c).then(|| whitespace(s, i, true))
            }
        }
    }

    /// HF's `Isolated` split of `s[range]` (matches and the text between them, in order, none
    /// empty), appended to `out` as absolute ranges.
    fn split(self, s: &[u8], (from, to): (usize, usize), out: &mut Vec<(usize, usize)>) {
        let piece = &s[from..to];
        let (mut pos, mut gap) = (0, 0);
        while pos < piece.len() {
            match self.match_at(piece, pos) {
                Some(end) => {
                    if gap < pos {
                        out.push((from + gap, from + pos));
                    }
                    out.push((from + pos, from + end));
                    pos = end;
                    gap = end;
                }
                None => pos += 1,
            }
        }
        if gap < piece.len() {
            out.push((from + gap, to));
        }
    }
}

/// The pre-tokens of `text` under `steps` into `cur` (byte ranges, in order, none empty).
fn pre_tokenize(
    steps: &[PreStep],
    text: &[u8],
    cur: &mut Vec<(usize, usize)>,
    next: &mut Vec<(usize, usize)>,
) {
    cur.clear();
    if text.is_empty() {
        return;
    }
    cur.push((0, text.len()));
    for step in steps {
        next.clear();
        for &range in cur.iter() {
            step.split(text, range, next);
        }
        std::mem::swap(cur, next);
    }
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    c: u32,
    prev: Option<usize>,
    next: Option<usize>,
    alive: bool,
}

/// Reused buffers of the merge step.
#[derive(Default)]
struct MergeScratch {
    syms: Vec<u32>,
    pairs: Vec<(u32, u32)>,
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Reverse<(u32, usize, u32)>>,
}

/// One model's word cache on one thread: word bytes → a range of `ids`.
#[derive(Default)]
struct WordCache {
    map: HashMap<Box<[u8]>, (u32, u32), foldhash::fast::RandomState>,
    ids: Vec<u32>,
}

impl WordCache {
    fn insert(&mut self, word: &[u8], ids: &[u32]) {
        if self.map.len() >= WORD_CACHE_CAPACITY {
            self.map.clear();
            self.ids.clear();
        }
        let (Ok(at), Ok(len)) = (u32::try_from(self.ids.len()), u32::try_from(ids.len())) else {
            return;
        };
        self.ids.extend_from_slice(ids);
        self.map.insert(word.into(), (at, len));
    }
}

/// Per-thread state: pre-token ranges, merge buffers, word caches by model.
#[derive(Default)]
struct Scratch {
    cur: Vec<(usize, usize)>,
    next: Vec<(usize, usize)>,
    merge: MergeScratch,
    caches: Vec<(u64, WordCache)>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The word cache of model `id` on this thread, most recently used first.
fn word_cache(caches: &mut Vec<(u64, WordCache)>, id: u64) -> &mut WordCache {
    match caches.iter().position(|(m, _)| *m == id) {
        Some(0) => {}
        Some(i) => {
            let c = caches.remove(i);
            caches.insert(0, c);
        }
        None => {
            caches.truncate(MODELS_PER_THREAD - 1);
            caches.insert(0, (id, WordCache::default()));
        }
    }
    &mut caches[0].1
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{Model, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    use super::*;
    use crate::kv::testutil::{golden_json, shared_dir};
    use crate::kv::tokenizer::compat;
    use crate::kv::tokenizer::segment::{SegmentEncoder, hf_encode_piece};

    /// `golden/<dir>/tokenizer.json`, changed by `edit`, loaded by HF.
    fn variant(dir: &str, edit: impl FnOnce(&mut Value)) -> (Tokenizer, Value) {
        let path = shared_dir().join("golden").join(dir).join("tokenizer.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let mut v: Value = serde_json::from_str(&text).expect("tokenizer.json is JSON");
        edit(&mut v);
        let tok = serde_json::from_value::<Tokenizer>(v.clone())
            .unwrap_or_else(|e| panic!("{dir}: HF refuses the variant: {e}"));
        (tok, v)
    }

    fn byte_level(use_regex: bool) -> Value {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex})
    }

    fn split(re: &str) -> Value {
        json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false})
    }

    /// Every supported shape, each with the steps it must compile to: the golden models as
    /// served (Qwen 2 substitution for `tiny`, DeepSeek V3's three splits for `bos-model`),
    /// `tiny` with GPT-2's `ByteLevel` regex (its file as is), with Llama 3's regex and
    /// `ignore_merges` (Llama 3's setting), and with stacked steps.
    fn variants() -> Vec<(&'static str, Tokenizer, Value, Vec<PreStep>)> {
        let qwen = PreStep::LlamaQwen { max_digits: 1 };
        let llama = PreStep::LlamaQwen { max_digits: 3 };
        let (tiny_qwen, j1) = variant("tiny-model", |v| {
            assert!(compat::patch_for_model_type(v, Some("qwen2")));
        });
        let (tiny_gpt2, j2) = variant("tiny-model", |_| {});
        let (tiny_llama, j3) = variant("tiny-model", |v| {
            v["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT_REGEX), byte_level(false)]});
            v["model"]["ignore_merges"] = json!(true);
        });
        let (tiny_stacked, j4) = variant("tiny-model", |v| {
            v["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
                split(DIGITS3_SPLIT_REGEX), split(CJK_SPLIT_REGEX), split(LLAMA3_SPLIT_REGEX), byte_level(true)]});
        });
        let (tiny_deepseek, j7) = variant("tiny-model", |v| {
            v["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [split(DEEPSEEK3_SPLIT_REGEX), byte_level(false)]});
        });
        let (bos, j5) = variant("bos-model", |_| {});
        let (bos_ignore, j6) = variant("bos-model", |v| {
            v["model"]["ignore_merges"] = json!(true);
        });
        vec![
            ("tiny/qwen2", tiny_qwen, j1, vec![qwen]),
            ("tiny/gpt2", tiny_gpt2, j2, vec![PreStep::Gpt2]),
            ("tiny/llama3+ignore_merges", tiny_llama, j3, vec![llama]),
            (
                "tiny/digits+cjk+llama3+gpt2",
                tiny_stacked,
                j4,
                vec![PreStep::Digits3, llama, PreStep::Gpt2],
            ),
            (
                "tiny/deepseek3-alone",
                tiny_deepseek,
                j7,
                vec![PreStep::DeepSeek3],
            ),
            (
                "bos/deepseek3",
                bos,
                j5,
                vec![PreStep::Digits3, PreStep::DeepSeek3],
            ),
            (
                "bos/deepseek3+ignore_merges",
                bos_ignore,
                j6,
                vec![PreStep::Digits3, PreStep::DeepSeek3],
            ),
        ]
    }

    /// A deterministic sequence of random `u64`s from `seed` (`rand`'s seeded `StdRng`).
    fn seeded(seed: u64) -> impl FnMut() -> u64 {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        move || rng.random()
    }

    /// Fragments that stress each regex alternative: both letter cases, digit runs longer than
    /// three, contractions in every case, whitespace runs (trailing, before newlines, mixed),
    /// punctuation runs followed by newlines, chat markers; then bytes outside the fast
    /// alphabet (other whitespace and control characters, non-ASCII) that must fall back.
    const FRAGMENTS: [&str; 64] = [
        "a",
        "Z",
        "the",
        "The",
        "HELLO",
        "wOrLd",
        "x",
        "Q",
        "1",
        "42",
        "1234567",
        "007",
        "'s",
        "'S",
        "'t",
        "'T",
        "'re",
        "'RE",
        "'Re",
        "'ve",
        "'VE",
        "'m",
        "'M",
        "'ll",
        "'LL",
        "'lL",
        "'d",
        "'D",
        "'",
        "'x",
        " ",
        "  ",
        "    ",
        "\t",
        " \t ",
        "\n",
        "\r",
        "\r\n",
        "\n\n",
        " \n",
        "\t\n ",
        "  \n  ",
        "!",
        "?!",
        "...",
        ".\n",
        "!!\r\n",
        "(",
        ")",
        "{}",
        "\"",
        "#$%&",
        "*+,-/",
        ":;<=>",
        "@[\\]^_`|~",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "user\n",
        " 9",
        ",5",
        "'99",
        "a1b2",
        "_x",
    ];

    const FALLBACK_FRAGMENTS: [&str; 10] = [
        "\u{b}", "\u{c}", "\u{0}", "\u{7f}", "\u{85}", "\u{a0}", "é", "北京", "🚚", "e\u{301}",
    ];

    /// `n` random texts; about one in `foreign` also holds a fragment outside the fast
    /// alphabet (0: none).
    fn random_texts(seed: u64, n: usize, max_len: u64, foreign: u64) -> Vec<String> {
        let mut next = seeded(seed);
        (0..n)
            .map(|_| {
                let len = 1 + next() % max_len;
                let mut s: String = (0..len)
                    .map(|_| FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize])
                    .collect();
                if foreign > 0 && next().is_multiple_of(foreign) {
                    let f = FALLBACK_FRAGMENTS[(next() % FALLBACK_FRAGMENTS.len() as u64) as usize];
                    let mut at = (next() % (s.len() as u64 + 1)) as usize;
                    while !s.is_char_boundary(at) {
                        at -= 1;
                    }
                    s.insert_str(at, f);
                }
                s
            })
            .collect()
    }

    #[test]
    fn byte_table_equals_hf_byte_level_on_every_ascii_byte() {
        let pre = ByteLevel::new(false, false, false);
        for b in 0u8..128 {
            let mut pts = PreTokenizedString::from(String::from(char::from(b)));
            pre.pre_tokenize(&mut pts).expect("pre-tokenize");
            let splits = pts.get_splits(OffsetReferential::Original, OffsetType::None);
            assert_eq!(splits.len(), 1, "byte {b:#x}");
            assert_eq!(splits[0].0, byte_level_char(b).to_string(), "byte {b:#x}");
            assert_eq!(ascii_byte_of(byte_level_char(b)), Some(b));
        }
        assert_eq!(byte_level_char(b' '), '\u{120}', "Ġ");
        assert_eq!(byte_level_char(b'\n'), '\u{10a}', "Ċ");
        assert_eq!(byte_level_char(0x7f), '\u{121}');
        assert_eq!(byte_level_char(0xad), '\u{143}');
    }

    #[test]
    fn supported_shapes_compile_to_their_steps() {
        for (name, tok, _, steps) in variants() {
            let fast = FastBpe::new(&tok).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(fast.steps(), &steps[..], "{name}");
            assert_eq!(
                fast.whole_words.is_some(),
                name.contains("ignore_merges"),
                "{name}"
            );
        }
    }

    /// A three-token BPE model with one setting changed (HF cannot load the golden merges with
    /// a subword prefix or suffix).
    fn small_bpe(field: &str, value: Value) -> Value {
        let mut m = json!({"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false,
            "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": []});
        m[field] = value;
        m
    }

    /// A change to a parsed `tokenizer.json`.
    type Edit = Box<dyn FnOnce(&mut Value)>;

    #[test]
    fn unsupported_configurations_keep_hf_s_path() {
        let cases: [(&str, &str, Edit); 9] = [
            (
                "metaspace",
                "pre-tokenizer Some(\"Metaspace\")",
                Box::new(|v| {
                    v["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true});
                }),
            ),
            (
                "byte_fallback",
                "byte_fallback",
                Box::new(|v| v["model"]["byte_fallback"] = json!(true)),
            ),
            (
                "dropout",
                "dropout",
                Box::new(|v| v["model"]["dropout"] = json!(0.1)),
            ),
            (
                "continuing_subword_prefix",
                "continuing_subword_prefix",
                Box::new(|v| v["model"] = small_bpe("continuing_subword_prefix", json!("##"))),
            ),
            (
                "end_of_word_suffix",
                "end_of_word_suffix",
                Box::new(|v| v["model"] = small_bpe("end_of_word_suffix", json!("</w>"))),
            ),
            (
                "add_prefix_space",
                "add_prefix_space",
                Box::new(|v| v["pre_tokenizer"]["add_prefix_space"] = json!(true)),
            ),
            (
                "unknown regex",
                "not allow-listed",
                Box::new(|v| {
                    v["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [split(r"\w+"), byte_level(false)]});
                }),
            ),
            (
                "ByteLevel first",
                "does not end with ByteLevel",
                Box::new(|v| {
                    v["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [byte_level(false), split(DIGITS3_SPLIT_REGEX)]});
                }),
            ),
            (
                "no pre-tokenizer",
                "no pre-tokenizer",
                Box::new(|v| v["pre_tokenizer"] = Value::Null),
            ),
        ];
        for (name, reason, edit) in cases {
            let (tok, json) = variant("tiny-model", edit);
            let err = FastBpe::new(&tok).expect_err(name);
            assert!(err.0.contains(reason), "{name}: {err}");
            let seg = SegmentEncoder::new(&tok, &json["pre_tokenizer"], &json["normalizer"], 64);
            assert!(seg.fast_bpe().is_none(), "{name}");
        }
        let (tok, _) = variant("tiny-model", |v| {
            v["model"] =
                json!({"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1}, "unk_token": "[UNK]"});
        });
        assert_eq!(
            FastBpe::new(&tok).expect_err("WordLevel").0,
            "the model is not BPE"
        );
    }

    /// `ignore_merges` (Llama 3): a whole word in the vocabulary is that one id even where the
    /// merges would not build it; without the flag the merges decide. Both as HF.
    #[test]
    fn ignore_merges_takes_whole_vocabulary_words() {
        for (ignore, abc, abcab) in [
            (true, vec![4], vec![3, 2, 3]),
            (false, vec![3, 2], vec![3, 2, 3]),
        ] {
            let mut model = small_bpe("ignore_merges", json!(ignore));
            model["vocab"] = json!({"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4});
            model["merges"] = json!([["a", "b"]]);
            let (tok, _) = variant("tiny-model", |v| v["model"] = model);
            let fast = FastBpe::new(&tok).expect("supported");
            for (text, want) in [("abc", &abc), ("abcab", &abcab)] {
                let mut ids = Vec::new();
                assert!(fast.encode_piece(text, &mut ids), "{text}");
                assert_eq!(&ids, want, "ignore_merges={ignore} {text}");
                assert_eq!(ids, hf_encode_piece(&tok, text).expect("HF"), "{text}");
            }
            // The space's byte-level character `Ġ` is not in this vocabulary: HF drops it
            // (no unk token), the fast path refuses rather than guess.
            assert!(!fast.encode_piece("ab c", &mut Vec::new()));
        }
    }

    /// The core differential test: thousands of random pieces through the fast encoder and
    /// through HF's pre-tokenizer + model, for every supported shape.
    #[test]
    fn fast_pieces_equal_hf_pieces_on_random_texts() {
        for (name, tok, _, _) in variants() {
            let fast = FastBpe::new(&tok).unwrap_or_else(|e| panic!("{name}: {e}"));
            let (mut accepted, mut refused) = (0, 0);
            for text in random_texts(0x5eed_0001, 4000, 40, 8) {
                let hf = hf_encode_piece(&tok, &text).expect("HF encodes");
                let mut ours = vec![7];
                if fast.encode_piece(&text, &mut ours) {
                    assert_eq!(&ours[1..], &hf[..], "{name}: {text:?}");
                    accepted += 1;
                } else {
                    assert_eq!(ours, [7], "{name}: a refusal leaves the ids alone");
                    assert!(
                        !text.bytes().all(is_fast_byte),
                        "{name}: refused a fast-alphabet text {text:?}"
                    );
                    refused += 1;
                }
            }
            assert!(
                accepted > 3000 && refused > 300,
                "{name}: {accepted} / {refused}"
            );
        }
    }

    /// Long words take the heap merge, short ones the scan; both equal HF's model on random
    /// byte-level words up to 300 bytes (whitespace and punctuation runs, letter soup).
    #[test]
    fn scan_and_heap_merges_equal_hf_s_model() {
        for (name, tok, _, _) in variants() {
            let fast = FastBpe::new(&tok).unwrap_or_else(|e| panic!("{name}: {e}"));
            let mut next = seeded(0xb0e5_0002);
            let alphabets: [&[u8]; 4] = [b" ", b" \t\n", b"etaoin shrdlu", b"=-.!*_#"];
            let mut m = MergeScratch::default();
            for i in 0..1500 {
                let abc = alphabets[i % alphabets.len()];
                let len = 1 + (next() % if i % 10 == 0 { 300 } else { 24 }) as usize;
                let word: Vec<u8> = (0..len)
                    .map(|_| abc[(next() % abc.len() as u64) as usize])
                    .collect();
                let chars: String = word.iter().map(|&b| byte_level_char(b)).collect();
                let hf: Vec<u32> = tok
                    .get_model()
                    .tokenize(&chars)
                    .expect("HF model")
                    .iter()
                    .map(|t| t.id)
                    .collect();
                let init: Vec<u32> = word
                    .iter()
                    .map(|&b| fast.byte_ids[usize::from(b)])
                    .collect();
                assert!(!init.contains(&NONE), "{name}: every ASCII byte has an id");
                m.syms.clone_from(&init);
                fast.merge_scan(&mut m);
                let scan = m.syms.clone();
                m.syms.clone_from(&init);
                fast.merge_heap(&mut m);
                assert_eq!(scan, m.syms, "{name}: scan vs heap on {chars:?}");
                let mut ids = Vec::new();
                assert!(fast.word_ids(&word, &mut ids, &mut m));
                assert_eq!(ids, hf, "{name}: {chars:?}");
            }
        }
    }

    /// The fast path inside segment encoding, against HF's whole-text `encode` with and without
    /// special tokens: random texts with chat markers (split at added tokens), long texts (cut
    /// into word-boundary chunks), the captured requests' prompts and rendered chats of both
    /// golden models and the chat-template reference renderings.
    #[test]
    fn segment_encoding_with_the_fast_path_equals_hf_whole_text() {
        let mut captured = Vec::new();
        for file in ["vllm_kv_events_capture.json", "bos_kv_events_capture.json"] {
            for req in golden_json(file)["requests"].as_array().expect("requests") {
                captured.push(req["request_body"].clone());
            }
        }
        let reference: Value = serde_json::from_str(include_str!("testdata/jinja2_reference.json"))
            .expect("reference JSON");
        let rendered: Vec<String> = reference["cases"]
            .as_object()
            .expect("cases")
            .values()
            .filter_map(|c| c["rendered"].as_str().map(str::to_owned))
            .collect();
        assert!(
            rendered.len() >= 3,
            "{} reference renderings",
            rendered.len()
        );
        for (dir, model) in [("tiny-model", "tiny"), ("bos-model", "bos-tiny")] {
            let tok = super::super::encode::ModelTokenizer::load(
                &shared_dir().join("golden").join(dir),
                1024,
            )
            .expect("loads");
            assert!(tok.fast_bpe().is_some(), "{model}: fast path applies");
            let mut texts = random_texts(0x5eed_0003, 600, 60, 6);
            // Long texts: thousands of bytes between markers, so raw chunking applies.
            texts.extend(random_texts(0x5eed_0004, 40, 1500, 3));
            texts.extend(rendered.iter().cloned());
            for body in &captured {
                if let Some(p) = body["prompt"].as_str() {
                    texts.push(p.to_owned());
                }
                if let Some(msgs) = body["messages"].as_array() {
                    let msgs: Vec<crate::request::ChatMessage> = msgs
                        .iter()
                        .map(|m| crate::request::ChatMessage {
                            role: m["role"].as_str().unwrap_or("user").to_owned(),
                            content: match &m["content"] {
                                Value::String(s) => s.clone(),
                                Value::Array(parts) => {
                                    parts.iter().filter_map(|p| p["text"].as_str()).collect()
                                }
                                _ => String::new(),
                            },
                        })
                        .collect();
                    texts.push(tok.render(model, &msgs).expect("renders"));
                }
            }
            assert!(texts.len() > 650, "{model}: {} texts", texts.len());
            for text in &texts {
                for add in [false, true] {
                    let whole = tok.encode_whole(text, add).expect("whole");
                    let seg = tok
                        .encode_by_segments(text, add)
                        .expect("segment encoding applies")
                        .expect("encodes");
                    assert_eq!(seg, whole.to_vec(), "{model} add={add}: {text:?}");
                }
            }
        }
    }
}
