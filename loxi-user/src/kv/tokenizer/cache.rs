//! A bounded cache of recent tokenizations, keyed by XXH3-128 of the FULL input plus the
//! special-token flag (never by a truncated prefix, so two prompts that differ only at the end
//! never share an entry). Two key kinds, domain-separated: the encoded text itself, and a chat
//! message list (every role and content, length-prefixed, plus the API) so that a repeated chat
//! request skips the template render too.
//!
//! Eviction is two-generation (an O(1) approximation of LRU): lookups hit the young generation,
//! or the old one and are promoted; when the young generation reaches half the capacity it
//! becomes the old one and the previous old one is dropped. At most `capacity` entries are held.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use xxhash_rust::xxh3::Xxh3;

use crate::request::ChatMessage;

/// Cache key: hash of the full input and whether special tokens were added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TextKey {
    hash: u128,
    add_special_tokens: bool,
}

/// Domain tags so a text and a message list can never produce the same key.
const TAG_TEXT: u8 = 0;
const TAG_MESSAGES: u8 = 1;
const TAG_RAW_CHUNK: u8 = 2;

impl TextKey {
    /// The key of `text` encoded with or without special tokens.
    pub fn new(text: &str, add_special_tokens: bool) -> Self {
        Self::tagged(TAG_TEXT, text, add_special_tokens)
    }

    fn tagged(tag: u8, text: &str, add_special_tokens: bool) -> Self {
        let mut h = Xxh3::new();
        h.update(&[tag]);
        h.update(text.as_bytes());
        TextKey {
            hash: h.digest128(),
            add_special_tokens,
        }
    }

    /// The key of a word-boundary chunk of the raw (not yet normalized or split at added
    /// tokens) text, encoded without special tokens; a domain apart from [`Self::new`].
    pub fn raw_chunk(text: &str) -> Self {
        Self::tagged(TAG_RAW_CHUNK, text, false)
    }

    /// The key of a chat message list rendered for `api_tag` (an API discriminant) and encoded
    /// with or without special tokens. Every field is length-prefixed.
    pub fn messages(api_tag: u8, msgs: &[ChatMessage], add_special_tokens: bool) -> Self {
        let mut h = Xxh3::new();
        h.update(&[TAG_MESSAGES, api_tag]);
        h.update(&(msgs.len() as u64).to_le_bytes());
        for m in msgs {
            for field in [&m.role, &m.content] {
                h.update(&(field.len() as u64).to_le_bytes());
                h.update(field.as_bytes());
            }
        }
        TextKey {
            hash: h.digest128(),
            add_special_tokens,
        }
    }
}

#[derive(Debug, Default)]
struct Generations {
    young: HashMap<TextKey, Arc<[u32]>>,
    old: HashMap<TextKey, Arc<[u32]>>,
}

/// The cache (interior mutability; share by reference).
#[derive(Debug)]
pub struct TokenCache {
    half: usize,
    inner: Mutex<Generations>,
}

impl TokenCache {
    /// Default capacity (entries).
    pub const DEFAULT_CAPACITY: usize = 1024;

    /// A cache holding at most `capacity` entries (0 disables it).
    pub fn new(capacity: usize) -> Self {
        TokenCache {
            half: capacity / 2,
            inner: Mutex::new(Generations::default()),
        }
    }

    /// The cached ids for `key`, if any.
    pub fn get(&self, key: &TextKey) -> Option<Arc<[u32]>> {
        let mut g = self.inner.lock();
        if let Some(ids) = g.young.get(key) {
            return Some(ids.clone());
        }
        let ids = g.old.remove(key)?;
        Self::insert_young(&mut g, self.half, *key, ids.clone());
        Some(ids)
    }

    /// Remembers `ids` for `key`.
    pub fn put(&self, key: TextKey, ids: Arc<[u32]>) {
        if self.half == 0 {
            return;
        }
        let mut g = self.inner.lock();
        Self::insert_young(&mut g, self.half, key, ids);
    }

    /// Number of entries held.
    pub fn len(&self) -> usize {
        let g = self.inner.lock();
        g.young.len() + g.old.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn insert_young(g: &mut Generations, half: usize, key: TextKey, ids: Arc<[u32]>) {
        if half == 0 {
            return;
        }
        if g.young.len() >= half && !g.young.contains_key(&key) {
            g.old = std::mem::take(&mut g.young);
        }
        g.young.insert(key, ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> Arc<[u32]> {
        Arc::from(vec![n])
    }

    #[test]
    fn texts_differing_only_at_the_end_have_distinct_entries() {
        let c = TokenCache::new(8);
        let a = "x".repeat(10_000) + "a";
        let b = "x".repeat(10_000) + "b";
        c.put(TextKey::new(&a, true), ids(1));
        assert_eq!(c.get(&TextKey::new(&b, true)), None);
        assert_eq!(
            c.get(&TextKey::new(&a, false)),
            None,
            "special-token flag is part of the key"
        );
        assert_eq!(c.get(&TextKey::new(&a, true)), Some(ids(1)));
    }

    #[test]
    fn holds_at_most_capacity_and_keeps_recently_used_entries() {
        let c = TokenCache::new(4);
        for i in 0..4u32 {
            c.put(TextKey::new(&i.to_string(), true), ids(i));
        }
        // "0" used again: promoted into the young generation.
        assert_eq!(c.get(&TextKey::new("0", true)), Some(ids(0)));
        for i in 10..12u32 {
            c.put(TextKey::new(&i.to_string(), true), ids(i));
        }
        assert!(c.len() <= 4, "len {}", c.len());
        assert_eq!(c.get(&TextKey::new("0", true)), Some(ids(0)));
        assert_eq!(c.get(&TextKey::new("1", true)), None);
    }

    #[test]
    fn message_keys_separate_fields_and_differ_from_text_keys() {
        let m = |r: &str, c: &str| ChatMessage {
            role: r.into(),
            content: c.into(),
        };
        let a = TextKey::messages(1, &[m("user", "ab"), m("assistant", "c")], false);
        let b = TextKey::messages(1, &[m("user", "a"), m("assistant", "bc")], false);
        assert_ne!(a, b);
        assert_ne!(
            a,
            TextKey::messages(2, &[m("user", "ab"), m("assistant", "c")], false)
        );
        assert_ne!(TextKey::messages(1, &[], false), TextKey::new("", false));
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let c = TokenCache::new(0);
        c.put(TextKey::new("a", true), ids(1));
        assert!(c.is_empty());
    }
}
