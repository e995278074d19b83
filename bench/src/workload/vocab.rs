//! Words that encode to exactly one token each, for prompts of a known token length.
//!
//! Taken from a byte-level BPE `tokenizer.json`: every vocabulary entry `Ġword` (a space followed
//! by 3+ lower-case ASCII letters) is one token, and the byte-level pre-tokenizer splits text at
//! each space-letter boundary, so `" w1 w2 … wn"` encodes to exactly `n` tokens.

use super::WorkloadError;
use rand::Rng;
use std::path::Path;

/// A sorted list of single-token words (each stored with its leading space).
#[derive(Debug, Clone)]
pub struct Vocab {
    words: Vec<String>,
}

/// Fewest words a usable vocabulary must have.
const MIN_WORDS: usize = 64;

impl Vocab {
    /// Reads `model.vocab` of a BPE `tokenizer.json` and keeps the `Ġ[a-z]{3,}` entries.
    ///
    /// Errors: the file is unreadable, not JSON, has no `model.vocab` object, or yields fewer
    /// than 64 words.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, WorkloadError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
            path: shown.clone(),
            source,
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| WorkloadError::Format {
                path: shown.clone(),
                msg: e.to_string(),
            })?;
        let vocab = json["model"]["vocab"]
            .as_object()
            .ok_or_else(|| WorkloadError::Format {
                path: shown.clone(),
                msg: "no object field model.vocab".into(),
            })?;
        let mut words: Vec<String> = vocab.keys().filter_map(|k| single_word(k)).collect();
        words.sort();
        if words.len() < MIN_WORDS {
            let msg = format!("only {} single-token words in model.vocab", words.len());
            return Err(WorkloadError::Format { path: shown, msg });
        }
        Ok(Self { words })
    }

    /// Number of words.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Always false (construction requires 64+ words).
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// A text of exactly `tokens` words (each with a leading space), drawn from `rng`.
    pub fn text<R: Rng>(&self, rng: &mut R, tokens: usize) -> String {
        let mut out = String::with_capacity(tokens * 7);
        for _ in 0..tokens {
            out.push_str(&self.words[rng.random_range(0..self.words.len())]);
        }
        out
    }
}

/// `Ġabc…` → `" abc…"` when the rest is 3+ lower-case ASCII letters.
fn single_word(entry: &str) -> Option<String> {
    let rest = entry.strip_prefix('Ġ')?;
    let ok = rest.len() >= 3 && rest.bytes().all(|b| b.is_ascii_lowercase());
    ok.then(|| format!(" {rest}"))
}
