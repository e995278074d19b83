//! Hash keys the hashing selectors (hash, persist, chwbl, gpu-aware, wrr-hash) place on a ring
//! or a rendezvous table.
//!
//! Every hash is xxh3-64 without a random seed, so the same key maps to the same endpoint in
//! every process, across restarts and across machines.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::{EpIdx, Reason};
use crate::request::{Prompt, RequestMeta};
use crate::rules::ServiceArgs;

/// Characters of a text prompt that form the CHWBL prefix, per `chwbl_prefix_hash_level`.
pub const PROMPT_HEAD_CHARS: usize = 256;
/// Token ids of a token prompt that form the CHWBL prefix, per `chwbl_prefix_hash_level`.
pub const PROMPT_HEAD_TOKENS: usize = 64;
/// `chwbl_prefix_hash_flags` bit 0: mix the LoRA adapter name into the prefix key.
pub const FLAG_LORA: u8 = 1;
/// `chwbl_prefix_hash_flags` bit 1: mix the request's image inputs into the prefix key.
pub const FLAG_IMAGE: u8 = crate::request::HashInputs::IMAGES;
/// `chwbl_prefix_hash_flags` bit 2: mix the request's audio inputs into the prefix key.
pub const FLAG_AUDIO: u8 = crate::request::HashInputs::AUDIO;
/// `chwbl_prefix_hash_flags` bit 3: mix `cache_salt` into the prefix key.
pub const FLAG_CACHE_SALT: u8 = 8;
/// `chwbl_prefix_hash_flags` bit 4: mix the tool / function definitions into the prefix key.
pub const FLAG_TOOLS: u8 = crate::request::HashInputs::TOOLS;
/// `chwbl_prefix_hash_flags` bit 5: mix the session key into the prefix key.
pub const FLAG_SESSION: u8 = 32;
/// `chwbl_prefix_hash_flags` bit 6: mix the RAG template (the request's `chat_template`) in.
pub const FLAG_RAG_TEMPLATE: u8 = crate::request::HashInputs::RAG_TEMPLATE;
/// `chwbl_prefix_hash_flags` bit 7: mix the RAG documents (`documents`) into the prefix key.
pub const FLAG_RAG_DOCUMENTS: u8 = crate::request::HashInputs::RAG_DOCUMENTS;

/// Stable 64-bit hash of a string (xxh3, seed 0).
pub fn hash_str(s: &str) -> u64 {
    xxh3_64(s.as_bytes())
}

/// Stable identity of an endpoint (`ip:port`), used for ring points and rendezvous weights so
/// that placement follows the endpoint, not its position in the list.
pub fn endpoint_id(ip: &str, port: u16) -> u64 {
    hash_str(&format!("{ip}:{port}"))
}

/// Rendezvous (highest random weight) score of `key` on endpoint `id`.
pub fn rendezvous(key: u64, id: u64) -> u64 {
    xxh3_64_with_seed(&key.to_le_bytes(), id)
}

/// The eligible endpoint with the highest rendezvous score for `key` (ties: lower index).
/// Removing an endpoint moves only the keys it owned; the walk is deterministic.
pub fn rendezvous_pick(
    key: u64,
    ids: &[u64],
    eligible: impl Iterator<Item = EpIdx>,
) -> Option<EpIdx> {
    let mut best: Option<(u64, EpIdx)> = None;
    for ep in eligible {
        let score = rendezvous(key, ids.get(ep).copied().unwrap_or(ep as u64));
        if best.is_none_or(|(s, _)| score > s) {
            best = Some((score, ep));
        }
    }
    best.map(|(_, ep)| ep)
}

/// The CHWBL prefix key of a request: model + the head of the prompt, scoped by
/// `chwbl_prefix_hash_level` L (1–3): chat messages contribute their leading system /
/// developer messages plus the first L−1 other messages (at least one message in all, so a
/// chat without a system prompt keys on its first message); a text prompt its first L × 256
/// characters; a token prompt its first L × 64 ids. `None` when the request has no prompt.
pub fn prefix_key(meta: &RequestMeta, args: &ServiceArgs) -> Option<u64> {
    let level = usize::from(args.chwbl_prefix_hash_level.clamp(1, 3));
    let mut buf = String::new();
    buf.push_str(meta.model.as_deref().unwrap_or(""));
    buf.push('\u{1}');
    match meta.prompt.as_ref()? {
        Prompt::Text(t) => buf.extend(t.chars().take(level * PROMPT_HEAD_CHARS)),
        Prompt::TokenIds(ids) => {
            for id in ids.iter().take(level * PROMPT_HEAD_TOKENS) {
                buf.push_str(&id.to_string());
                buf.push(',');
            }
        }
        Prompt::Messages(msgs) => push_message_head(&mut buf, msgs, level),
    }
    mix_flags(&mut buf, meta, args);
    Some(hash_str(&buf))
}

fn push_message_head(buf: &mut String, msgs: &[crate::request::ChatMessage], level: usize) {
    let (mut others, mut taken) = (0, 0);
    for m in msgs {
        let system = m.role == "system" || m.role == "developer";
        if !system {
            if others + 1 >= level && taken > 0 {
                break;
            }
            others += 1;
        }
        taken += 1;
        buf.push_str(&m.role);
        buf.push('\u{2}');
        buf.push_str(&m.content);
        buf.push('\u{3}');
    }
}

fn mix_flags(buf: &mut String, meta: &RequestMeta, args: &ServiceArgs) {
    let flags = args.chwbl_prefix_hash_flags;
    if flags & FLAG_LORA != 0
        && let Some(l) = &meta.lora_name
    {
        buf.push_str("\u{4}lora=");
        buf.push_str(l);
    }
    if (flags & FLAG_CACHE_SALT != 0 || args.chwbl_enable_cache_salt)
        && let Some(s) = &meta.cache_salt
    {
        buf.push_str("\u{4}salt=");
        buf.push_str(s);
    }
    if flags & FLAG_SESSION != 0
        && let Some(s) = &meta.session_key
    {
        buf.push_str("\u{4}session=");
        buf.push_str(s);
    }
    let h = &meta.hash_inputs;
    for (flag, name, digest) in [
        (FLAG_IMAGE, "image", h.images),
        (FLAG_AUDIO, "audio", h.audio),
        (FLAG_TOOLS, "tools", h.tools),
        (FLAG_RAG_TEMPLATE, "rag_template", h.rag_template),
        (FLAG_RAG_DOCUMENTS, "rag_documents", h.rag_documents),
    ] {
        if flags & flag != 0
            && let Some(d) = digest
        {
            buf.push_str(&format!("\u{4}{name}={d:016x}"));
        }
    }
}

/// The affinity key shared by the key-placed selectors (sel 8 CHWBL, 9 GPU-aware, 10
/// weighted hash): the prefix key ([`Reason::RingPrefix`]), else the conversation key
/// ([`Reason::RingConversation`]). `None` when the request has neither; each selector has
/// its own fallback then.
pub fn affinity_key(meta: &RequestMeta, args: &ServiceArgs) -> Option<(u64, Reason)> {
    prefix_key(meta, args)
        .map(|k| (k, Reason::RingPrefix))
        .or_else(|| conversation_key(meta).map(|k| (k, Reason::RingConversation)))
}

/// The conversation key: the conversation id, else the session key. `None` when neither.
pub fn conversation_key(meta: &RequestMeta) -> Option<u64> {
    meta.conversation_id
        .as_deref()
        .or(meta.session_key.as_deref())
        .map(hash_str)
}

/// The persist / hash key of a client: its IP (persist) or full socket address (hash).
pub fn client_key(meta: &RequestMeta, with_port: bool) -> u64 {
    match meta.client {
        Some(a) if with_port => hash_str(&a.to_string()),
        Some(a) => hash_str(&a.ip().to_string()),
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ChatMessage;

    fn chat(msgs: &[(&str, &str)]) -> RequestMeta {
        let msgs = msgs.iter().map(|(r, c)| ChatMessage {
            role: (*r).into(),
            content: (*c).into(),
        });
        RequestMeta {
            model: Some("m".into()),
            prompt: Some(Prompt::Messages(msgs.collect())),
            ..Default::default()
        }
    }

    fn level(l: u8) -> ServiceArgs {
        serde_json::from_value(serde_json::json!({
            "externalIP": "10.0.0.1", "port": 80, "mode": 4, "sel": 8, "chwbl_prefix_hash_level": l
        }))
        .expect("args")
    }

    #[test]
    fn prefix_level_scopes_the_messages() {
        let a = chat(&[
            ("system", "S"),
            ("user", "u1"),
            ("assistant", "a1"),
            ("user", "u2"),
        ]);
        let b = chat(&[("system", "S"), ("user", "u1"), ("assistant", "other")]);
        let c = chat(&[("system", "S"), ("user", "different")]);
        // Level 1: the system prompt alone.
        assert_eq!(prefix_key(&a, &level(1)), prefix_key(&c, &level(1)));
        // Level 2: + the first user message.
        assert_eq!(prefix_key(&a, &level(2)), prefix_key(&b, &level(2)));
        assert_ne!(prefix_key(&a, &level(2)), prefix_key(&c, &level(2)));
        // Level 3: + the first reply.
        assert_ne!(prefix_key(&a, &level(3)), prefix_key(&b, &level(3)));
        // No system prompt: the first message is the prefix.
        let d = chat(&[("user", "hello"), ("assistant", "x")]);
        let e = chat(&[("user", "hello"), ("assistant", "y")]);
        let f = chat(&[("user", "bye")]);
        assert_eq!(prefix_key(&d, &level(1)), prefix_key(&e, &level(1)));
        assert_ne!(prefix_key(&d, &level(1)), prefix_key(&f, &level(1)));
        // The model is part of the key.
        let mut g = chat(&[("system", "S")]);
        g.model = Some("other".into());
        assert_ne!(prefix_key(&g, &level(1)), prefix_key(&c, &level(1)));
    }

    /// Every bit of LoxiLB's `chwbl_prefix_hash_flags` table works: with its bit set, two
    /// requests that differ only in that part (images, audio, tools, RAG template, RAG
    /// documents) get different keys; without it (flags 0) the same key. Requests parsed from
    /// real OpenAI bodies.
    #[test]
    fn each_prefix_hash_flag_mixes_its_request_part_into_the_key() {
        let parts = http::Request::post("/v1/chat/completions")
            .body(())
            .expect("request")
            .into_parts()
            .0;
        let base = serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]});
        let with = |path: &[&str], v: serde_json::Value| {
            let mut b = base.clone();
            match path {
                [k] => b[*k] = v,
                _ => b["messages"][1]["content"] = v,
            }
            b
        };
        let image = |url: &str| {
            serde_json::json!([{"type": "text", "text": "hi"},
                               {"type": "image_url", "image_url": {"url": url}}])
        };
        let audio = |data: &str| {
            serde_json::json!([{"type": "text", "text": "hi"},
                               {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}])
        };
        let cases = [
            (
                FLAG_IMAGE,
                with(&["messages", "content"], image("a.png")),
                with(&["messages", "content"], image("b.png")),
            ),
            (
                FLAG_AUDIO,
                with(&["messages", "content"], audio("AAAA")),
                with(&["messages", "content"], audio("BBBB")),
            ),
            (
                FLAG_TOOLS,
                with(
                    &["tools"],
                    serde_json::json!([{"type": "function", "function": {"name": "a"}}]),
                ),
                with(
                    &["tools"],
                    serde_json::json!([{"type": "function", "function": {"name": "b"}}]),
                ),
            ),
            (
                FLAG_RAG_TEMPLATE,
                with(&["chat_template"], serde_json::json!("{{ messages }}")),
                with(&["chat_template"], serde_json::json!("{{ documents }}")),
            ),
            (
                FLAG_RAG_DOCUMENTS,
                with(
                    &["documents"],
                    serde_json::json!([{"title": "a", "text": "x"}]),
                ),
                with(
                    &["documents"],
                    serde_json::json!([{"title": "b", "text": "y"}]),
                ),
            ),
        ];
        let args = |flags: u8| -> ServiceArgs {
            serde_json::from_value(serde_json::json!({
                "externalIP": "10.0.0.1", "port": 80, "mode": 4, "sel": 8,
                "chwbl_prefix_hash_flags": flags
            }))
            .expect("args")
        };
        // Each request is parsed for the rule that keys it (the parse digests only the parts
        // the rule's bits name).
        let key = |body: &serde_json::Value, flags: u8| {
            let rule = args(flags);
            let meta = RequestMeta::extract(&parts, body.to_string().as_bytes(), None, &rule);
            prefix_key(&meta, &rule)
        };
        for (flag, a, b) in cases {
            assert_ne!(
                key(&a, flag),
                key(&b, flag),
                "bit {flag} set: the part is in the key"
            );
            assert_eq!(key(&a, 0), key(&b, 0), "bit {flag} clear: it is not");
            // The other bits do not read this part.
            assert_eq!(key(&a, !flag), key(&b, !flag), "bits other than {flag}");
            // The parse digests this part only for a rule that asks for it.
            let digested = |flags: u8| {
                let h = RequestMeta::extract(&parts, a.to_string().as_bytes(), None, &args(flags))
                    .hash_inputs;
                [h.images, h.audio, h.tools, h.rag_template, h.rag_documents]
                    .iter()
                    .filter(|d| d.is_some())
                    .count()
            };
            assert_eq!((digested(flag), digested(!flag)), (1, 0), "bit {flag}");
        }
    }

    #[test]
    fn hash_str_is_fixed_xxh3_without_seed() {
        // xxh3_64("") is a published constant of the algorithm.
        assert_eq!(hash_str(""), 0x2d06_8005_38d3_94c2);
    }

    #[test]
    fn rendezvous_skips_ineligible_and_keeps_other_owners() {
        let ids: Vec<u64> = (0..5).map(|i| endpoint_id("10.0.0.1", 8000 + i)).collect();
        let all: Vec<_> = (0..1000u64)
            .map(|k| rendezvous_pick(k, &ids, 0..5))
            .collect();
        let without_2: Vec<_> = (0..1000u64)
            .map(|k| rendezvous_pick(k, &ids, [0, 1, 3, 4].into_iter()))
            .collect();
        for (a, b) in all.iter().zip(&without_2) {
            if *a != Some(2) {
                assert_eq!(a, b, "a key not owned by the removed endpoint moved");
            } else {
                assert_ne!(*b, Some(2));
            }
        }
    }
}
