//! The request vocabulary every layer shares: what one OpenAI request asks for, read once from
//! its head and body ([`RequestMeta`]), its prompt ([`Prompt`], [`ChatMessage`]), the API it
//! targets ([`ApiKind`]) and its session key.
//!
//! This is the bottom layer beside `rules/`: selectors (`routing/`), the KV tier (`kv/`) and the
//! proxy read these types; nothing here imports a layer above (see `docs/architecture.md`).
//!
//! Files: `meta.rs` ([`RequestMeta::extract`] and the header/body fields), `prompt.rs` (the
//! prompt shapes of completions, chat and responses bodies), `session.rs` (the persist session
//! key per `session_header_name`), `bounded.rs` (the routing parse of a body, bounded in
//! memory).

pub mod bounded;
pub mod meta;
pub mod prompt;
pub mod session;

pub use bounded::{ParseLimits, ParsedBody, parse_body_bounded};
pub use meta::{
    ApiKind, CONVERSATION_HEADER, HashInputs, MODEL_HEADER, RequestMeta, api_kind, declares_json,
    parse_body, request_model,
};
pub use prompt::{ChatMessage, MEDIA_MARKER, Prompt, prompt_of};
