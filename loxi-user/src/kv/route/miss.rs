//! Why tier 1.5 did not decide: the `reason` label of `loxilb_pd_kv_tier15_miss_reason_total`,
//! in the order of the guard ladder (`select.rs`). Its own file so that the metrics (which
//! pre-create one series per reason) and the selection (which returns one) both import it
//! without importing each other.

/// Why tier 1.5 did not decide (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MissReason {
    /// kvExactMode 0.
    ModeOff,
    /// Inside the kvWarmupSec window.
    Warmup,
    /// No prompt text.
    TextEmpty,
    /// No model.
    ModelEmpty,
    /// A model no engine lists in its `/v1/models` (loxi extension; only once a poll of the
    /// engines answered, `LOXI_KV_MODELS_POLL_MS`): not tokenized, so a client's unknown or
    /// misspelt model never reads as a tokenizer failure; the engine answers it (404).
    ModelUnknown,
    /// Tokenizer missing or failed.
    Tokenize,
    /// Block hashes could not be computed.
    Hashes,
    /// Fewer tokens than `LLB_KV_MIN_MATCH_TOKENS`.
    Shallow,
    /// Shorter than one block: nothing cacheable (loxi extension).
    ShortPrompt,
    /// No endpoint holds the first block.
    NoWorker,
    /// Only ineligible endpoints hold it.
    Excluded,
    /// A chat with a media part (image, audio, video, file) whose text before the part cannot
    /// be tokenized as an exact prefix, or is empty (loxi extension): nothing of it is scored,
    /// never a hit on blocks that depend on the media.
    Multimodal,
    /// The prompt is beyond what the tier tokenizes (loxi extension): more chat messages than
    /// `LOXI_KV_MAX_MESSAGES`, a whitespace-free run longer than `LOXI_KV_MAX_RUN_BYTES`, a chat
    /// longer than `LOXI_KV_MAX_PROMPT_BYTES`, or a cut prompt the tokenizer cannot encode as an
    /// exact prefix.
    Oversize,
    /// The tokenization queue (`LOXI_KV_TOKENIZE_QUEUE`) was full (loxi extension).
    Overload,
    /// No decision within `LOXI_KV_DECISION_BUDGET_MS`, queue wait included (loxi extension).
    Budget,
}

impl MissReason {
    /// Every reason, for pre-creating series.
    pub const ALL: [MissReason; 15] = [
        Self::ModeOff,
        Self::Warmup,
        Self::TextEmpty,
        Self::ModelEmpty,
        Self::ModelUnknown,
        Self::Tokenize,
        Self::Hashes,
        Self::Shallow,
        Self::ShortPrompt,
        Self::NoWorker,
        Self::Excluded,
        Self::Multimodal,
        Self::Oversize,
        Self::Overload,
        Self::Budget,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ModeOff => "mode_off",
            Self::Warmup => "warmup",
            Self::TextEmpty => "text_empty",
            Self::ModelEmpty => "model_empty",
            Self::ModelUnknown => "model_unknown",
            Self::Tokenize => "tokenize",
            Self::Hashes => "hashes",
            Self::Shallow => "shallow",
            Self::ShortPrompt => "short_prompt",
            Self::NoWorker => "no_worker",
            Self::Excluded => "excluded",
            Self::Multimodal => "multimodal",
            Self::Oversize => "oversize",
            Self::Overload => "overload",
            Self::Budget => "budget",
        }
    }
}
