//! The prompt of an OpenAI request body: `messages` (chat), `instructions` + `input`
//! (`/v1/responses`) or `prompt` (completions), normalised to [`Prompt`].

use serde_json::Value;

/// A prompt as the request gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// `prompt` as a string (or the first of an array of strings).
    Text(String),
    /// `prompt` as token ids (used as given: vLLM adds nothing).
    TokenIds(Vec<u32>),
    /// `messages` (chat) or `instructions` + `input` (responses), normalised to chat messages
    /// in order. `content` part arrays are flattened to their text parts joined by ""; a
    /// non-text part (an image, audio, video or file) becomes one [`MEDIA_MARKER`] in place.
    Messages(Vec<ChatMessage>),
}

/// Stands for one non-text content part (`image_url`, `input_image`, `input_audio`,
/// `video_url`, `file`, ...) in a flattened chat message: U+FFFC OBJECT REPLACEMENT CHARACTER.
/// The engine replaces such a part with tokens loxi cannot reproduce (vLLM mixes each item's
/// hash into the blocks it overlaps), so the KV tier hashes only the text before the first
/// marker: two chats that differ only in an image never share the image's blocks.
pub const MEDIA_MARKER: char = '\u{FFFC}';

/// One chat message, as the chat template receives it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, `developer`...
    pub role: String,
    /// Text content (content parts flattened).
    pub content: String,
}

impl Prompt {
    /// True when a message carries a non-text content part ([`MEDIA_MARKER`]).
    pub fn has_media(&self) -> bool {
        match self {
            Prompt::Messages(m) => m.iter().any(|m| m.content.contains(MEDIA_MARKER)),
            _ => false,
        }
    }

    /// True when there is nothing to tokenize (empty text, no token ids, no messages).
    pub fn is_empty(&self) -> bool {
        match self {
            Prompt::Text(t) => t.is_empty(),
            Prompt::TokenIds(ids) => ids.is_empty(),
            Prompt::Messages(m) => m.is_empty(),
        }
    }
}

/// The body's prompt: `messages`, else `input`/`instructions`, else `prompt`. `None` when the
/// body has none of them in a known shape.
pub fn prompt_of(v: &Value) -> Option<Prompt> {
    if let Some(Value::Array(msgs)) = v.get("messages") {
        return Some(Prompt::Messages(msgs.iter().filter_map(message).collect()));
    }
    if v.get("input").is_some() || v.get("instructions").is_some() {
        return responses_prompt(v);
    }
    completion_prompt(v.get("prompt")?)
}

/// `prompt`: a string, an array of strings (the first), token ids, or arrays of token ids
/// (the first).
fn completion_prompt(p: &Value) -> Option<Prompt> {
    match p {
        Value::String(s) => Some(Prompt::Text(s.clone())),
        Value::Array(items) => match items.first()? {
            Value::String(s) => Some(Prompt::Text(s.clone())),
            Value::Number(_) => token_ids(items).map(Prompt::TokenIds),
            Value::Array(inner) => token_ids(inner).map(Prompt::TokenIds),
            _ => None,
        },
        _ => None,
    }
}

fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// One chat message; `content` may be a string, null, or an array of content parts whose text
/// parts are joined with "".
fn message(m: &Value) -> Option<ChatMessage> {
    let role = m.get("role")?.as_str()?.to_string();
    let content = content_text(m.get("content").unwrap_or(&Value::Null));
    Some(ChatMessage { role, content })
}

fn content_text(c: &Value) -> String {
    const MARKER: &str = "\u{FFFC}";
    match c {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.as_str()),
                Value::Object(o) => match o.get("text").and_then(Value::as_str) {
                    Some(t) => Some(t),
                    // A typed part without text: media (image, audio, video, file).
                    None if o.contains_key("type") => Some(MARKER),
                    None => None,
                },
                _ => None,
            })
            .collect(),
        _ => String::new(),
    }
}

/// `/v1/responses`: `instructions` becomes a leading system message; `input` is a user string
/// or a list of message items (items without a role, e.g. tool calls, are skipped).
fn responses_prompt(v: &Value) -> Option<Prompt> {
    let mut msgs = Vec::new();
    if let Some(i) = v.get("instructions").and_then(Value::as_str) {
        msgs.push(ChatMessage {
            role: "system".into(),
            content: i.into(),
        });
    }
    match v.get("input") {
        Some(Value::String(s)) => msgs.push(ChatMessage {
            role: "user".into(),
            content: s.clone(),
        }),
        Some(Value::Array(items)) => msgs.extend(items.iter().filter_map(message)),
        _ => {}
    }
    (!msgs.is_empty()).then_some(Prompt::Messages(msgs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msg(r: &str, c: &str) -> ChatMessage {
        ChatMessage {
            role: r.into(),
            content: c.into(),
        }
    }

    #[test]
    fn completion_prompt_shapes() {
        assert_eq!(
            prompt_of(&json!({"prompt": "hi"})),
            Some(Prompt::Text("hi".into()))
        );
        assert_eq!(
            prompt_of(&json!({"prompt": ["a", "b"]})),
            Some(Prompt::Text("a".into()))
        );
        assert_eq!(
            prompt_of(&json!({"prompt": [1, 2, 3]})),
            Some(Prompt::TokenIds(vec![1, 2, 3]))
        );
        assert_eq!(
            prompt_of(&json!({"prompt": [[7, 8], [9]]})),
            Some(Prompt::TokenIds(vec![7, 8]))
        );
        assert_eq!(prompt_of(&json!({"prompt": [-1]})), None);
        assert_eq!(prompt_of(&json!({"prompt": 5})), None);
    }

    #[test]
    fn chat_messages_with_content_parts() {
        let v = json!({"messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null}
        ]});
        assert_eq!(
            prompt_of(&v),
            Some(Prompt::Messages(vec![
                msg("system", "sys"),
                msg("user", "a\u{FFFC}b"),
                msg("assistant", "")
            ]))
        );
        assert!(prompt_of(&v).is_some_and(|p| p.has_media()));
        let text_only =
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]});
        assert!(prompt_of(&text_only).is_some_and(|p| !p.has_media()));
        let responses = json!({"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "look: "}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]});
        assert_eq!(
            prompt_of(&responses),
            Some(Prompt::Messages(vec![msg("user", "look: \u{FFFC}")]))
        );
    }

    #[test]
    fn responses_input_and_instructions() {
        let v = json!({"instructions": "be brief", "input": "hello"});
        assert_eq!(
            prompt_of(&v),
            Some(Prompt::Messages(vec![
                msg("system", "be brief"),
                msg("user", "hello")
            ]))
        );
        let v = json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]}, {"type": "function_call"}]});
        assert_eq!(
            prompt_of(&v),
            Some(Prompt::Messages(vec![msg("user", "q")]))
        );
    }
}
