//! Request metadata the selectors and the KV tier read, extracted once per request from the
//! headers and (for JSON bodies) the body.
//!
//! The proxy fills this in (`RequestMeta::extract`, in this file); everything downstream reads
//! it and never re-parses the body.

use std::net::SocketAddr;

use super::prompt::Prompt;

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

impl ApiKind {
    /// True for the generation APIs (completions, chat completions, responses): the only
    /// requests that enter tier 1.5. Everything else (`/v1/embeddings`, `/tokenize`, `/health`,
    /// model lists) is routed by the rule's `sel` alone.
    pub fn is_generation(self) -> bool {
        !matches!(self, ApiKind::Other)
    }
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
    /// `X-Session-ID` header (LoxiLB's second tier-0 key, after `X-Conversation-Id`).
    pub session_id: Option<String>,
    /// True when the body was JSON and parsed.
    pub json_ok: bool,
    /// True when the routing parse bounded the body ([`super::bounded`]): a text prompt or a
    /// token-id list is then a prefix of the client's, a message list may be incomplete.
    pub body_cut: bool,
    /// True when the client's connection was TLS (`X-Forwarded-Proto: https` to the backend).
    pub https: bool,
    /// Digests of the request parts `chwbl_prefix_hash_flags` can mix into the CHWBL key.
    pub hash_inputs: HashInputs,
}

/// XXH3 digests of the JSON text of the request parts LoxiLB's `chwbl_prefix_hash_flags`
/// names (`load-balancing-algorithms.txt`, "chwbl_prefix_hash_flags bits"); each `None` when
/// the request has no such part or the rule's flags do not ask for it (computed only for the
/// parts a rule mixes into its key: a rule without those bits pays nothing, not even for a
/// request carrying large tool definitions).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HashInputs {
    /// Bit 1: image inputs: chat content parts of type `image_url`, `input_image` or `image`
    /// (chat `messages` and the Responses API's `input` items), in order.
    pub images: Option<u64>,
    /// Bit 2: audio inputs: content parts of type `input_audio`, `audio_url` or `audio`.
    pub audio: Option<u64>,
    /// Bit 4: the tool / function definitions (`tools`, else the legacy `functions`).
    pub tools: Option<u64>,
    /// Bit 6: the RAG template: the request's own `chat_template`.
    pub rag_template: Option<u64>,
    /// Bit 7: the RAG documents (`documents`).
    pub rag_documents: Option<u64>,
}

impl HashInputs {
    /// Bit of `chwbl_prefix_hash_flags` for [`Self::images`] (`routing::key::FLAG_IMAGE`).
    pub const IMAGES: u8 = 1 << 1;
    /// Bit for [`Self::audio`].
    pub const AUDIO: u8 = 1 << 2;
    /// Bit for [`Self::tools`].
    pub const TOOLS: u8 = 1 << 4;
    /// Bit for [`Self::rag_template`].
    pub const RAG_TEMPLATE: u8 = 1 << 6;
    /// Bit for [`Self::rag_documents`].
    pub const RAG_DOCUMENTS: u8 = 1 << 7;

    /// The digests of `body` (an OpenAI request object) for the parts whose bit is set in
    /// `flags` (a rule's `chwbl_prefix_hash_flags`); the others stay `None`.
    pub fn of(body: &serde_json::Value, flags: u8) -> Self {
        let digest = |v: &serde_json::Value| {
            xxhash_rust::xxh3::xxh3_64(serde_json::to_string(v).unwrap_or_default().as_bytes())
        };
        let want = |bit: u8| flags & bit != 0;
        let (mut images, mut audio) = (None::<xxhash_rust::xxh3::Xxh3>, None);
        let parts_wanted = want(Self::IMAGES) || want(Self::AUDIO);
        for list in ["messages", "input"].into_iter().filter(|_| parts_wanted) {
            let Some(items) = body.get(list).and_then(|l| l.as_array()) else {
                continue;
            };
            for item in items {
                let Some(parts) = item.get("content").and_then(|c| c.as_array()) else {
                    continue;
                };
                for part in parts {
                    let into = match part.get("type").and_then(|t| t.as_str()) {
                        Some("image_url" | "input_image" | "image") if want(Self::IMAGES) => {
                            &mut images
                        }
                        Some("input_audio" | "audio_url" | "audio") if want(Self::AUDIO) => {
                            &mut audio
                        }
                        _ => continue,
                    };
                    into.get_or_insert_with(xxhash_rust::xxh3::Xxh3::new)
                        .update(serde_json::to_string(part).unwrap_or_default().as_bytes());
                }
            }
        }
        Self {
            images: images.map(|h| h.digest()),
            audio: audio.map(|h| h.digest()),
            tools: body
                .get("tools")
                .or_else(|| body.get("functions"))
                .filter(|v| want(Self::TOOLS) && !v.is_null())
                .map(digest),
            rag_template: body
                .get("chat_template")
                .filter(|v| want(Self::RAG_TEMPLATE) && !v.is_null())
                .map(digest),
            rag_documents: body
                .get("documents")
                .filter(|v| want(Self::RAG_DOCUMENTS) && !v.is_null())
                .map(digest),
        }
    }
}

impl RequestMeta {
    /// The P/D tier-0 pin key: `X-Conversation-Id` (or the body's conversation), else
    /// `X-Session-ID`, else the body's `user` (LoxiLB's order); `None` when there is none.
    pub fn pin_key(&self) -> Option<&str> {
        self.conversation_id
            .as_deref()
            .or(self.session_id.as_deref())
            .or(self.user.as_deref())
    }
}

/// Header that carries a conversation id (LoxiLB's tier-0 key; CHWBL's conversation key).
pub const CONVERSATION_HEADER: &str = "x-conversation-id";
/// Header that names the model and wins over the body's `model`.
pub const MODEL_HEADER: &str = "x-model";
/// Header that carries a session id (the P/D tier-0 key when no conversation id is given).
pub const SESSION_HEADER: &str = "x-session-id";

// The same names as `HeaderName`s, built at compile time: a lookup by `&str` parses the name
// on every call (measured on the proxy's per-request path, issue 17 §3).
static CONVERSATION_NAME: http::HeaderName = http::HeaderName::from_static(CONVERSATION_HEADER);
static MODEL_NAME: http::HeaderName = http::HeaderName::from_static(MODEL_HEADER);
static SESSION_NAME: http::HeaderName = http::HeaderName::from_static(SESSION_HEADER);

impl RequestMeta {
    /// Extracts routing metadata from a request's head and (already bounded) body.
    ///
    /// The body is parsed as JSON when it is non-empty and [`declares_json`]; a body declared
    /// as another media type, or one that does not parse, leaves
    /// `json_ok = false` and every body field empty (the request is still forwarded unchanged
    /// and routed by the plain selector). Never fails.
    pub fn extract(
        parts: &http::request::Parts,
        body: &[u8],
        client: Option<SocketAddr>,
        rule: &crate::rules::ServiceArgs,
    ) -> Self {
        let json = declares_json(&parts.headers)
            .then(|| parse_body(body))
            .flatten();
        Self::from_json(parts, json.as_ref(), client, rule)
    }

    /// Like [`RequestMeta::extract`] with the body already parsed (`None`: not JSON).
    pub fn from_json(
        parts: &http::request::Parts,
        json: Option<&serde_json::Value>,
        client: Option<SocketAddr>,
        rule: &crate::rules::ServiceArgs,
    ) -> Self {
        let [model, conversation, session] = scan(
            &parts.headers,
            [&MODEL_NAME, &CONVERSATION_NAME, &SESSION_NAME],
        );
        let mut m = RequestMeta {
            client,
            api: api_kind(parts.uri.path()),
            model: value_str(model).or_else(|| json.and_then(|v| str_field(v, "model"))),
            session_key: super::session::session_key(parts, &rule.session_header_name),
            conversation_id: value_str(conversation),
            session_id: value_str(session),
            ..Default::default()
        };
        if let Some(v) = json.filter(|v| v.is_object()) {
            m.fill_from_body(v, rule.chwbl_prefix_hash_flags);
        }
        m
    }

    fn fill_from_body(&mut self, v: &serde_json::Value, hash_flags: u8) {
        self.json_ok = true;
        self.prompt = super::prompt::prompt_of(v);
        self.add_special_tokens = v.get("add_special_tokens").and_then(|b| b.as_bool());
        self.cache_salt = str_field(v, "cache_salt");
        self.user = str_field(v, "user");
        self.stream = v.get("stream").and_then(|b| b.as_bool()).unwrap_or(false);
        if self.conversation_id.is_none() {
            self.conversation_id = body_conversation(v);
        }
        self.hash_inputs = HashInputs::of(v, hash_flags);
    }
}

/// Whether the request's body may be read as OpenAI JSON: it has no `Content-Type`, or its
/// media type is `application/json` or a `+json` one (RFC 6839), whatever its parameters. A
/// body declared as anything else (`text/plain`, `application/x-www-form-urlencoded`, curl's
/// default for `-d`) is not read, even when its bytes happen to be JSON: its model is empty
/// and it takes the plain selector (LoxiLB's kv-cache-aware-routing §4: "a text/plain body
/// leaves the model empty and takes the topology-specific fallback"), as vLLM's OpenAI
/// server refuses such a request (415) and nothing should be predicted from it.
pub fn declares_json(headers: &http::HeaderMap) -> bool {
    let Some(ct) = headers.get(http::header::CONTENT_TYPE) else {
        return true;
    };
    let b = ct.as_bytes();
    let media = b.split(|&c| c == b';').next().unwrap_or(b).trim_ascii();
    media.eq_ignore_ascii_case(b"application/json")
        || (media.len() > 5 && media[media.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// Parses a request body as JSON; `None` for an empty or non-JSON body.
pub fn parse_body(body: &[u8]) -> Option<serde_json::Value> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    serde_json::from_slice(body).ok()
}

/// The request's model: header `X-Model` first, then the body's `model` string.
pub fn request_model(
    headers: &http::HeaderMap,
    json: Option<&serde_json::Value>,
) -> Option<String> {
    let [model] = scan(headers, [&MODEL_NAME]);
    value_str(model).or_else(|| json.and_then(|v| str_field(v, "model")))
}

/// Which OpenAI API a path targets.
pub fn api_kind(path: &str) -> ApiKind {
    let path = path.trim_end_matches('/');
    if path.ends_with("/chat/completions") {
        ApiKind::ChatCompletions
    } else if path.ends_with("/completions") {
        ApiKind::Completions
    } else if path.ends_with("/responses") {
        ApiKind::Responses
    } else {
        ApiKind::Other
    }
}

/// The first value of each of `names` in `h`, as `HeaderMap::get` gives it, found in one pass
/// over the map. A lookup hashes the name (FNV over its bytes for a custom name): ~150
/// instructions for each of these names a request, found or not (callgrind, issue 17 §3), where
/// the pass compares each of a request's few headers by length and bytes.
fn scan<'h, const N: usize>(
    h: &'h http::HeaderMap,
    names: [&http::HeaderName; N],
) -> [Option<&'h http::HeaderValue>; N] {
    let mut found = [None; N];
    for (name, value) in h {
        for (slot, want) in found.iter_mut().zip(names) {
            if slot.is_none() && name == want {
                *slot = Some(value);
            }
        }
    }
    found
}

/// A header value as routing reads it: UTF-8, trimmed, non-empty.
fn value_str(v: Option<&http::HeaderValue>) -> Option<String> {
    v.and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
}

fn str_field(v: &serde_json::Value, name: &str) -> Option<String> {
    v.get(name).and_then(|s| s.as_str()).map(String::from)
}

fn body_conversation(v: &serde_json::Value) -> Option<String> {
    match v.get("conversation") {
        Some(serde_json::Value::String(s)) => return Some(s.clone()),
        Some(o @ serde_json::Value::Object(_)) => {
            if let Some(id) = str_field(o, "id") {
                return Some(id);
            }
        }
        _ => {}
    }
    str_field(v, "previous_response_id")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ChatMessage;

    fn args(session: &str) -> crate::rules::ServiceArgs {
        serde_json::from_value(serde_json::json!({
            "externalIP": "10.0.0.1", "port": 80, "mode": 4, "session_header_name": session
        }))
        .expect("args")
    }

    fn parts(uri: &str, headers: &[(&str, &str)]) -> http::request::Parts {
        let mut b = http::Request::post(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).expect("request").into_parts().0
    }

    #[test]
    fn only_a_body_declared_as_json_or_undeclared_is_read() {
        let body = br#"{"model":"llama","prompt":"hi"}"#;
        let cases = [
            (None, true),
            (Some("application/json"), true),
            (Some("Application/JSON; charset=utf-8"), true),
            (Some("application/vnd.api+json"), true),
            (Some("text/plain"), false),
            (Some("application/x-www-form-urlencoded"), false),
            (Some("application/jsonx"), false),
            (Some("+json"), false),
        ];
        for (ct, read) in cases {
            let headers: Vec<(&str, &str)> = ct.map(|c| ("content-type", c)).into_iter().collect();
            let m =
                RequestMeta::extract(&parts("/v1/completions", &headers), body, None, &args(""));
            assert_eq!(m.json_ok, read, "{ct:?}");
            let model = if read { Some("llama") } else { None };
            assert_eq!(m.model.as_deref(), model, "{ct:?}");
        }
    }

    #[test]
    fn chat_body_fields() {
        let body = br#"{"model":"llama","messages":[{"role":"user","content":"hi"}],"stream":true,
            "user":"u1","cache_salt":"salt","add_special_tokens":false}"#;
        let m = RequestMeta::extract(&parts("/v1/chat/completions", &[]), body, None, &args(""));
        assert!(m.json_ok && m.stream);
        assert_eq!(m.api, ApiKind::ChatCompletions);
        assert_eq!(m.model.as_deref(), Some("llama"));
        assert_eq!(m.user.as_deref(), Some("u1"));
        assert_eq!(m.cache_salt.as_deref(), Some("salt"));
        assert_eq!(m.add_special_tokens, Some(false));
        assert_eq!(
            m.prompt,
            Some(Prompt::Messages(vec![ChatMessage {
                role: "user".into(),
                content: "hi".into()
            }]))
        );
    }

    #[test]
    fn model_header_wins_and_conversation_sources() {
        let p = parts("/v1/completions", &[("x-model", "from-header")]);
        let m = RequestMeta::extract(
            &p,
            br#"{"model":"from-body","prompt":[1,2]}"#,
            None,
            &args(""),
        );
        assert_eq!(m.model.as_deref(), Some("from-header"));
        assert_eq!(m.prompt, Some(Prompt::TokenIds(vec![1, 2])));
        let p = parts("/v1/responses", &[]);
        let m = RequestMeta::extract(
            &p,
            br#"{"input":"q","previous_response_id":"resp_1"}"#,
            None,
            &args(""),
        );
        assert_eq!(m.api, ApiKind::Responses);
        assert_eq!(m.conversation_id.as_deref(), Some("resp_1"));
        let p = parts("/v1/responses", &[("x-conversation-id", "c-9")]);
        let m = RequestMeta::extract(
            &p,
            br#"{"input":"q","conversation":{"id":"c-1"}}"#,
            None,
            &args(""),
        );
        assert_eq!(m.conversation_id.as_deref(), Some("c-9"), "header wins");
    }

    #[test]
    fn routing_headers_are_the_first_values_of_their_names_among_many() {
        // As `HeaderMap::get`: the first value of a repeated name, any spelling of the name;
        // a blank value counts as absent.
        let p = parts(
            "/v1/completions",
            &[
                ("Content-Type", "application/json"),
                ("X-Stainless-Lang", "python"),
                ("X-Session-Id", "s-1"),
                ("x-model", " first "),
                ("X-MODEL", "second"),
                ("x-conversation-id", "  "),
                ("x-conversation-ids", "c-other"),
                ("user-agent", "openai"),
            ],
        );
        let m = RequestMeta::extract(&p, br#"{"model":"body"}"#, None, &args(""));
        assert_eq!(m.model.as_deref(), Some("first"));
        assert_eq!(m.session_id.as_deref(), Some("s-1"));
        assert_eq!(m.conversation_id, None);
        assert_eq!(
            request_model(&p.headers, None).as_deref(),
            Some("first"),
            "the routing table's model read agrees"
        );
        let p = parts("/v1/completions", &[("x-models", "not-this")]);
        assert_eq!(request_model(&p.headers, None), None);
    }

    #[test]
    fn non_json_and_non_object_bodies_are_tolerated() {
        let client = Some("10.1.2.3:4000".parse().expect("addr"));
        for body in [
            &b"not json"[..],
            b"",
            b"[1,2]",
            b"\"str\"",
            b"{\"model\": 5}",
        ] {
            let m = RequestMeta::extract(&parts("/x", &[("x-s", "k")]), body, client, &args("x-s"));
            assert_eq!(m.model, None);
            assert_eq!(m.prompt, None);
            assert_eq!(
                m.session_key.as_deref(),
                Some("k"),
                "session key comes from the head"
            );
            assert_eq!(m.client, client);
        }
        let m = RequestMeta::extract(&parts("/x", &[]), b"not json", None, &args(""));
        assert!(!m.json_ok);
    }
}
