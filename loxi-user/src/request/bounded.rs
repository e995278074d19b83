//! The routing parse of a request body, bounded in memory (issue 9 §1).
//!
//! Routing reads a few fields of an OpenAI body (model, prompt or messages, session fields),
//! but a plain `serde_json::Value` of a 32 MiB body can take gigabytes: 400,000 tiny chat
//! messages cost ~760 bytes each as `Value`s, a 30 MB prompt string is copied whole. This
//! parse builds the same `Value` with two bounds and says whether it applied one:
//!
//! - strings (values and keys) keep their first [`ParseLimits::max_string_bytes`] bytes (cut
//!   at a character boundary), so a text prompt is a prefix of the client's;
//! - arrays and objects below the top level keep elements while the node budget
//!   [`ParseLimits::max_nodes`] lasts (one node per array element or object entry); the rest
//!   is skipped without being built, so a token-id prompt is a prefix and a message list may
//!   be incomplete;
//! - the top-level object keeps its first [`MAX_TOP_LEVEL_KEYS`] entries whatever the node
//!   budget, so `model`, `stream` and the session fields after a long message list are kept.
//!
//! The forwarded body is never touched: only what routing sees is bounded. A string with JSON
//! escapes is unescaped by serde_json in full before it is cut (transient, freed at once).

use std::cell::Cell;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Top-level entries kept regardless of the node budget.
pub const MAX_TOP_LEVEL_KEYS: usize = 256;

/// Default node budget: a 16,384-id token prompt or ~5,000 chat messages (as `Value`s, about
/// 4 MB at most).
pub const DEFAULT_MAX_NODES: usize = 16_384;

/// Bounds of the routing parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseLimits {
    /// Array elements and object entries built below the top level, in total.
    pub max_nodes: usize,
    /// Bytes kept of any one string (the KV tier's `LOXI_KV_MAX_PROMPT_BYTES`).
    pub max_string_bytes: usize,
}

impl Default for ParseLimits {
    fn default() -> Self {
        Self {
            max_nodes: DEFAULT_MAX_NODES,
            max_string_bytes: 1 << 20,
        }
    }
}

/// A body parsed for routing.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedBody {
    /// The JSON, bounded as the module doc says.
    pub value: Value,
    /// True when a bound cut something (a string, an array, an object, top-level keys).
    pub cut: bool,
}

/// Parses `body` as JSON within `limits`; `None` for an empty or non-JSON body.
pub fn parse_body_bounded(body: &[u8], limits: ParseLimits) -> Option<ParsedBody> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    let budget = Budget {
        nodes: Cell::new(limits.max_nodes),
        max_str: limits.max_string_bytes,
        cut: Cell::new(false),
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = Node {
        b: &budget,
        top: true,
    }
    .deserialize(&mut de)
    .ok()?;
    de.end().ok()?;
    Some(ParsedBody {
        value,
        cut: budget.cut.get(),
    })
}

struct Budget {
    nodes: Cell<usize>,
    max_str: usize,
    cut: Cell<bool>,
}

impl Budget {
    /// True while nodes are left.
    fn left(&self) -> bool {
        self.nodes.get() > 0
    }

    /// One node was built.
    fn spend(&self) {
        self.nodes.set(self.nodes.get().saturating_sub(1));
    }

    fn string(&self, s: &str) -> String {
        if s.len() <= self.max_str {
            return s.to_owned();
        }
        self.cut.set(true);
        let mut end = self.max_str;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s[..end].to_owned()
    }
}

/// A value seed; `top` for the body's root.
#[derive(Clone, Copy)]
struct Node<'b> {
    b: &'b Budget,
    top: bool,
}

impl<'de> DeserializeSeed<'de> for Node<'_> {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

/// An object key (cut like any string).
struct Key<'b>(&'b Budget);

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = String;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key<'_> {
    type Value = String;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string key")
    }
    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<String, E> {
        Ok(self.0.string(s))
    }
}

impl<'de> Visitor<'de> for Node<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(self.b.string(v)))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let child = Node {
            b: self.b,
            top: false,
        };
        let mut out = Vec::new();
        loop {
            if self.b.left() {
                match seq.next_element_seed(child)? {
                    Some(v) => {
                        self.b.spend();
                        out.push(v);
                    }
                    None => break,
                }
            } else {
                match seq.next_element::<IgnoredAny>()? {
                    Some(_) => self.b.cut.set(true),
                    None => break,
                }
            }
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let child = Node {
            b: self.b,
            top: false,
        };
        let mut out = Map::new();
        let mut kept = 0usize;
        loop {
            let keep = if self.top {
                kept < MAX_TOP_LEVEL_KEYS
            } else {
                self.b.left()
            };
            if keep {
                let Some(k) = map.next_key_seed(Key(self.b))? else {
                    break;
                };
                let v = map.next_value_seed(child)?;
                if !self.top {
                    self.b.spend();
                }
                out.insert(k, v);
                kept += 1;
            } else {
                match map.next_entry::<IgnoredAny, IgnoredAny>()? {
                    Some(_) => self.b.cut.set(true),
                    None => break,
                }
            }
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: &str, max_nodes: usize, max_string_bytes: usize) -> ParsedBody {
        parse_body_bounded(
            body.as_bytes(),
            ParseLimits {
                max_nodes,
                max_string_bytes,
            },
        )
        .expect("json")
    }

    #[test]
    fn within_bounds_the_value_is_serde_jsons() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"h\u00e9"}],"n":1.5,"x":null,"ids":[1,-2,true]}"#;
        let p = parse(body, 100, 100);
        assert_eq!(p.value, serde_json::from_str::<Value>(body).expect("json"));
        assert!(!p.cut);
        assert!(parse_body_bounded(b"  ", ParseLimits::default()).is_none());
        assert!(parse_body_bounded(b"{\"a\":", ParseLimits::default()).is_none());
        assert!(parse_body_bounded(b"{} x", ParseLimits::default()).is_none());
    }

    #[test]
    fn long_strings_keep_a_prefix_at_a_char_boundary() {
        let p = parse(r#"{"prompt":"abcde\u00e9fgh","model":"m"}"#, 10, 6);
        assert_eq!(p.value, json!({"prompt": "abcde", "model": "m"}));
        assert!(p.cut);
    }

    #[test]
    fn nested_arrays_stop_at_the_node_budget_but_top_level_fields_after_them_are_kept() {
        let msgs: Vec<Value> = (0..1000)
            .map(|i| json!({"role": "user", "content": format!("m{i}")}))
            .collect();
        let body = json!({"messages": msgs, "model": "late", "stream": true}).to_string();
        let p = parse(&body, 30, 1000);
        assert!(p.cut);
        assert_eq!(p.value["model"], "late");
        assert_eq!(p.value["stream"], true);
        // 30 nodes: each message costs 1 (element) + 2 (entries).
        assert_eq!(p.value["messages"].as_array().map(Vec::len), Some(10));
        assert_eq!(p.value["messages"][9]["content"], "m9");
        let ids = parse(r#"{"prompt":[5,6,7,8,9]}"#, 3, 10);
        assert_eq!(ids.value["prompt"], json!([5, 6, 7]));
        assert!(ids.cut);
        let exact = parse(r#"{"prompt":[5,6,7]}"#, 3, 10);
        assert_eq!(exact.value["prompt"], json!([5, 6, 7]));
        assert!(!exact.cut, "a budget used up exactly cuts nothing");
    }
}
