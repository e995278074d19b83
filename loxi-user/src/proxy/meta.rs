//! Request metadata the selectors and the KV tier read, extracted once per request from the
//! headers and (for JSON bodies) the body.
//!
//! The proxy fills this in (`RequestMeta::extract`, in this file); everything downstream reads
//! it and never re-parses the body.

use std::net::SocketAddr;

/// Which OpenAI endpoint a request targets; decides how the prompt is tokenized (vLLM adds
/// special tokens for completions, not for chat, and with them for `/v1/responses`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ApiKind {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    ChatCompletions,
    /// `/v1/responses`.
    Responses,
    /// Anything else (forwarded, routed by the plain selector).
    #[default]
    Other,
}

/// A prompt as the request gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// `prompt` as a string (or the first of an array of strings).
    Text(String),
    /// `prompt` as token ids (used as given: vLLM adds nothing).
    TokenIds(Vec<u32>),
    /// `messages` (chat) or `instructions` + `input` (responses), normalised to chat messages
    /// in order. `content` part arrays are flattened to their text parts joined by "".
    Messages(Vec<ChatMessage>),
}

/// One chat message, as the chat template receives it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, `developer`...
    pub role: String,
    /// Text content (content parts flattened).
    pub content: String,
}

/// Everything routing needs to know about one request.
#[derive(Debug, Clone, Default)]
pub struct RequestMeta {
    /// Client socket address (persist / hash fallback key).
    pub client: Option<SocketAddr>,
    /// Target API (from the path).
    pub api: ApiKind,
    /// Model: header `X-Model` wins over the body's `model`.
    pub model: Option<String>,
    /// The prompt, when the body had one.
    pub prompt: Option<Prompt>,
    /// The request's own `add_special_tokens`, when given.
    pub add_special_tokens: Option<bool>,
    /// `cache_salt` (vLLM extra key on block 0).
    pub cache_salt: Option<String>,
    /// LoRA adapter name when the model names one (vLLM extra key on every block).
    pub lora_name: Option<String>,
    /// `user` field.
    pub user: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// Session key per `session_header_name` (header, cookie, query, basic-auth user).
    pub session_key: Option<String>,
    /// Conversation id (`X-Conversation-Id` header, or `conversation`/`previous_response_id`).
    pub conversation_id: Option<String>,
    /// True when the body was JSON and parsed.
    pub json_ok: bool,
}
