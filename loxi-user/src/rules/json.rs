//! JSON with repeated keys seen: serde_json's `Value` (and Go's `encoding/json`, so LoxiLB)
//! keep the last of a key an object names twice silently, so the first value would be
//! accepted and inert. The API refuses such a body ([`first_repeat`]); restore drops such a
//! rule of the state file ([`with_repeats`]).

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// `text` parsed until the first key an object names twice: the value (or the syntax error,
/// or the error the repeat stopped the parse with) and the repeated key's path
/// (`serviceArguments.port`, `endpoints[1].weight`), if any.
pub fn first_repeat(text: &[u8]) -> (Result<Value, serde_json::Error>, Option<String>) {
    let repeated = RefCell::new(Vec::new());
    let mut de = serde_json::Deserializer::from_slice(text);
    let parsed = Seed {
        path: String::new(),
        repeated: &repeated,
        keep_going: false,
    }
    .deserialize(&mut de)
    .and_then(|v| de.end().map(|()| v));
    (parsed, repeated.into_inner().into_iter().next())
}

/// `text` as a JSON value together with the path of every key an object of it names more than
/// once (`rules[0].rule.serviceArguments.port`), where [`first_repeat`] stops at the first: the
/// state file at restore, where a rule with a repeated key is dropped (as a `POST` of it is
/// refused) and the file's other rules are still restored. The value holds the last of a
/// repeated key's values (serde_json's choice). Errors: JSON syntax.
pub fn with_repeats(text: &[u8]) -> Result<(Value, Vec<String>), serde_json::Error> {
    let repeated = RefCell::new(Vec::new());
    let mut de = serde_json::Deserializer::from_slice(text);
    let v = Seed {
        path: String::new(),
        repeated: &repeated,
        keep_going: true,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok((v, repeated.into_inner()))
}

/// Deserialises one value at `path`; a repeated key's path is put in `repeated`, and the
/// parse stops there unless `keep_going` (then the last value is kept).
struct Seed<'a> {
    path: String,
    repeated: &'a RefCell<Vec<String>>,
    keep_going: bool,
}

impl<'de> DeserializeSeed<'de> for Seed<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl Seed<'_> {
    fn child(&self, seg: fmt::Arguments<'_>) -> Self {
        Self {
            path: format!("{}{seg}", self.path),
            repeated: self.repeated,
            keep_going: self.keep_going,
        }
    }
}

impl<'de> Visitor<'de> for Seed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
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

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("a number JSON cannot hold"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(self.child(format_args!("[{}]", out.len())))? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        let dot = if self.path.is_empty() { "" } else { "." };
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                let field = format!("{}{dot}{key}", self.path);
                let e = de::Error::custom(format_args!("key {field} appears twice"));
                self.repeated.borrow_mut().push(field);
                if !self.keep_going {
                    return Err(e);
                }
            }
            let v = map.next_value_seed(self.child(format_args!("{dot}{key}")))?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}
