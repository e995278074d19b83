//! Tokenizer substitutions transformers 5 makes before vLLM ever encodes a prompt, so that our
//! ids equal the engine's rather than what `tokenizer.json` alone would give.
//!
//! transformers 5 picks the tokenizer class from `config.json`'s `model_type` for some models,
//! whatever `tokenizer_config.json` says. For `qwen2` (and `qwen2_moe`, same class) its
//! `Qwen2Tokenizer` rebuilds the pipeline around the file's vocabulary and merges: NFC
//! normalizer, then a `Split` on Qwen2's pre-tokenization regex (digits one by one) followed by
//! a byte-level step without its own regex. Real Qwen2 checkpoints already ship exactly this
//! pipeline, so the patch changes nothing for them; it matters for files that differ, such as
//! the captured `golden/tiny-model` (plain GPT-2 byte-level pre-tokenizer: `" 0"` is one token
//! there, two for vLLM). Source: `../shared/golden/README.md` (the `qwen3` note) and the capture.

use serde_json::{Value, json};

/// Qwen2's pre-tokenization regex (transformers `models/qwen2/tokenization_qwen2.py`).
const QWEN2_PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `model_type`s whose tokenizer transformers 5 substitutes with `Qwen2Tokenizer`.
const QWEN2_MODEL_TYPES: [&str; 2] = ["qwen2", "qwen2_moe"];

/// Applies transformers' class substitution for `model_type` to a parsed `tokenizer.json`.
/// Returns true when the pipeline was changed.
pub fn patch_for_model_type(tokenizer_json: &mut Value, model_type: Option<&str>) -> bool {
    let Some(mt) = model_type else { return false };
    if !QWEN2_MODEL_TYPES.contains(&mt) {
        return false;
    }
    let Some(obj) = tokenizer_json.as_object_mut() else {
        return false;
    };
    obj.insert("normalizer".into(), json!({"type": "NFC"}));
    obj.insert(
        "pre_tokenizer".into(),
        json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PRETOKENIZE_REGEX}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
            ]
        }),
    );
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_qwen2_model_types_are_patched() {
        let mut t = json!({"normalizer": null, "pre_tokenizer": {"type": "ByteLevel"}});
        assert!(!patch_for_model_type(&mut t, Some("qwen3")));
        assert!(!patch_for_model_type(&mut t, None));
        assert_eq!(t["pre_tokenizer"]["type"], "ByteLevel");
        assert!(patch_for_model_type(&mut t, Some("qwen2")));
        assert_eq!(t["normalizer"]["type"], "NFC");
        assert_eq!(
            t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"],
            QWEN2_PRETOKENIZE_REGEX
        );
    }
}
