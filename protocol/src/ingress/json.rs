//! A borrowed JSON tree for the request converters: [`Json`] parses a body once, borrowing every
//! string (and key) that has no escape from the body's bytes, with objects as ordered pair lists
//! (no key hashing, no per-key allocation). The converters validate it with the same checks and
//! messages they applied to a `serde_json::Value`, and serialise the chat body straight from typed
//! structs over it: no second tree, no second parse (docs/performance.md, "Ingress conversion").
//!
//! It keeps `serde_json::Value`'s semantics where the converters can see them: serde_json's
//! nesting limit (128), the numbers it keeps (`u64` / `i64` / `f64`), and a repeated key keeps its
//! first position with the last value (`preserve_order`'s `IndexMap::insert`), both for lookups
//! and for parts passed through (tool schemas, tool-call inputs).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Number, Value};

use super::anthropic::IngressError;

/// One JSON value borrowing from the parsed bytes.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Json<'a> {
    Null,
    Bool(bool),
    Num(Number),
    Str(Cow<'a, str>),
    Arr(Vec<Json<'a>>),
    Obj(Obj<'a>),
}

/// An object's members in document order, keys unique (a repeated key kept its first position and
/// took the last value).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Obj<'a>(Vec<(Cow<'a, str>, Json<'a>)>);

/// The value `get` answers for a missing member.
pub(crate) static NULL: Json<'static> = Json::Null;

impl<'a> Obj<'a> {
    pub(crate) fn get(&self, key: &str) -> Option<&Json<'a>> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The member `key`, or [`NULL`] when it is absent.
    pub(crate) fn field(&self, key: &str) -> &Json<'a> {
        self.get(key).unwrap_or(&NULL)
    }

    pub(crate) fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }
}

impl<'a> Json<'a> {
    /// Parses a whole body (trailing bytes other than whitespace are an error, as for
    /// `serde_json::from_slice`).
    pub(crate) fn parse(bytes: &'a [u8]) -> serde_json::Result<Self> {
        serde_json::from_slice(bytes)
    }

    /// The member `key` of a body that is one JSON object (the last one when repeated); `None`
    /// when the body is not an object or not JSON. The other members are skipped, not built.
    pub(crate) fn parse_field(bytes: &'a [u8], key: &str) -> Option<Self> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let found = FieldSeed(key).deserialize(&mut de).ok()?;
        de.end().ok()?;
        found
    }

    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    pub(crate) fn as_object(&self) -> Option<&Obj<'a>> {
        match self {
            Json::Obj(o) => Some(o),
            _ => None,
        }
    }

    pub(crate) fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }

    /// `Some(self)` unless it is `null` (an absent member reads as `null`).
    pub(crate) fn present(&self) -> Option<&Self> {
        (!self.is_null()).then_some(self)
    }

    pub(crate) fn type_name(&self) -> &'static str {
        match self {
            Json::Null => "null",
            Json::Bool(_) => "boolean",
            Json::Num(_) => "number",
            Json::Str(_) => "string",
            Json::Arr(_) => "array",
            Json::Obj(_) => "object",
        }
    }

    /// The same value as a `serde_json::Value` (for the few parts a response echoes).
    pub(crate) fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Num(n) => Value::Number(n.clone()),
            Json::Str(s) => Value::String(s.to_string()),
            Json::Arr(a) => Value::Array(a.iter().map(Json::to_value).collect()),
            Json::Obj(o) => Value::Object(
                o.0.iter()
                    .map(|(k, v)| (k.to_string(), v.to_value()))
                    .collect(),
            ),
        }
    }

    /// The compact JSON text of the value (as `Value::to_string`).
    pub(crate) fn to_json_string(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Where a value sits in the request (`messages[3].content[1].text`), for error messages only:
/// built on the stack as the converters descend and formatted only when a check fails.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Path<'p> {
    Root(&'p str),
    Index(&'p Path<'p>, usize),
    Key(&'p Path<'p>, &'p str),
}

impl<'p> Path<'p> {
    /// `self[i]`.
    pub(crate) fn at(&'p self, i: usize) -> Path<'p> {
        Path::Index(self, i)
    }

    /// `self.key`.
    pub(crate) fn key(&'p self, key: &'p str) -> Path<'p> {
        Path::Key(self, key)
    }
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Root(name) => f.write_str(name),
            Path::Index(parent, i) => write!(f, "{parent}[{i}]"),
            Path::Key(parent, key) => write!(f, "{parent}.{key}"),
        }
    }
}

pub(crate) fn want_str<'j>(
    v: &'j Json<'_>,
    what: impl fmt::Display,
) -> Result<&'j str, IngressError> {
    v.as_str().ok_or_else(|| {
        IngressError::invalid(format!("{what}: expected a string, got {}", v.type_name()))
    })
}

pub(crate) fn want_obj<'j, 'a>(
    v: &'j Json<'a>,
    what: impl fmt::Display,
) -> Result<&'j Obj<'a>, IngressError> {
    v.as_object().ok_or_else(|| {
        IngressError::invalid(format!("{what}: expected an object, got {}", v.type_name()))
    })
}

pub(crate) fn want_arr<'j, 'a>(
    v: &'j Json<'a>,
    what: impl fmt::Display,
) -> Result<&'j [Json<'a>], IngressError> {
    match v {
        Json::Arr(a) => Ok(a),
        _ => Err(IngressError::invalid(format!(
            "{what}: expected an array, got {}",
            v.type_name()
        ))),
    }
}

pub(crate) fn want_num<'j>(
    v: &'j Json<'_>,
    what: impl fmt::Display,
) -> Result<&'j Number, IngressError> {
    match v {
        Json::Num(n) => Ok(n),
        _ => Err(IngressError::invalid(format!(
            "{what}: expected a number, got {}",
            v.type_name()
        ))),
    }
}

impl Serialize for Json<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => s.serialize_unit(),
            Json::Bool(b) => s.serialize_bool(*b),
            Json::Num(n) => n.serialize(s),
            Json::Str(v) => s.serialize_str(v),
            Json::Arr(a) => {
                let mut seq = s.serialize_seq(Some(a.len()))?;
                for v in a {
                    seq.serialize_element(v)?;
                }
                seq.end()
            }
            Json::Obj(o) => {
                let mut map = s.serialize_map(Some(o.0.len()))?;
                for (k, v) in &o.0 {
                    map.serialize_entry(k.as_ref(), v)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Json<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

/// Members an object collects before a repeated key is looked up in a hash index instead of by
/// a linear scan (a hostile object with many members stays linear).
const LINEAR_KEYS: usize = 8;
/// Capacity reserved from a size hint at most (the hint comes from the input).
const MAX_PREALLOC: usize = 64;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Json<'de>, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Json<'de>, E> {
        Ok(Json::Num(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Json<'de>, E> {
        Ok(Json::Num(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Json<'de>, E> {
        Ok(Number::from_f64(v).map_or(Json::Null, Json::Num))
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Json<'de>, E> {
        Ok(Json::Str(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Json<'de>, E> {
        Ok(Json::Str(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Json<'de>, E> {
        Ok(Json::Str(Cow::Owned(v)))
    }

    fn visit_unit<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json<'de>, D::Error> {
        Json::deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json<'de>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_PREALLOC));
        while let Some(v) = seq.next_element()? {
            out.push(v);
        }
        Ok(Json::Arr(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json<'de>, A::Error> {
        let mut members: Vec<(Cow<'de, str>, Json<'de>)> =
            Vec::with_capacity(map.size_hint().unwrap_or(0).min(MAX_PREALLOC));
        // Built once the object outgrows a linear scan: key → position.
        let mut index: Option<HashMap<Cow<'de, str>, usize>> = None;
        while let Some(key) = map.next_key_seed(KeySeed)? {
            let value: Json<'de> = map.next_value()?;
            let at = match &index {
                Some(index) => index.get(key.as_ref()).copied(),
                None => members.iter().position(|(k, _)| *k == key),
            };
            if let Some(at) = at {
                members[at].1 = value;
                continue;
            }
            if let Some(index) = &mut index {
                index.insert(key.clone(), members.len());
            } else if members.len() >= LINEAR_KEYS {
                let mut built: HashMap<Cow<'de, str>, usize> = members
                    .iter()
                    .enumerate()
                    .map(|(i, (k, _))| (k.clone(), i))
                    .collect();
                built.insert(key.clone(), members.len());
                index = Some(built);
            }
            members.push((key, value));
        }
        Ok(Json::Obj(Obj(members)))
    }
}

/// One member of a top-level object ([`Json::parse_field`]).
struct FieldSeed<'k>(&'k str);

impl<'de> DeserializeSeed<'de> for FieldSeed<'_> {
    type Value = Option<Json<'de>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for FieldSeed<'_> {
    type Value = Option<Json<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(key) = map.next_key_seed(KeySeed)? {
            if key == self.0 {
                found = Some(map.next_value()?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

/// An object key, borrowed from the input when it has no escape.
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn same_as_value(text: &str) {
        let ours = Json::parse(text.as_bytes()).expect("valid");
        let theirs: Value = serde_json::from_str(text).expect("valid");
        assert_eq!(ours.to_value(), theirs, "{text}");
        // Member order aside (`Value`'s follows serde_json's `preserve_order` feature), the text
        // written is the same value.
        let written: Value = serde_json::from_str(&ours.to_json_string()).expect("valid");
        assert_eq!(written, theirs, "{text}");
    }

    #[test]
    fn parses_and_serialises_as_serde_json_value_does() {
        same_as_value(r#"{"a":1,"b":[true,null,-2,2.5e3,"x\"y\u00e9"],"c":{"d":"e"}}"#);
        same_as_value("[18446744073709551615,-9223372036854775808,0.1,1e300]");
        same_as_value(r#""\ud83d\ude00 \n\t\\""#);
    }

    #[test]
    fn a_repeated_key_keeps_its_first_position_and_last_value() {
        same_as_value(r#"{"a":1,"b":2,"a":3}"#);
        let v = Json::parse(br#"{"b":1,"a":2,"b":3}"#).unwrap();
        assert_eq!(v.to_json_string(), r#"{"b":3,"a":2}"#);
        let many: String = (0..40)
            .map(|i| format!("\"k{}\":{i}", i % 20))
            .collect::<Vec<_>>()
            .join(",");
        same_as_value(&format!("{{{many}}}"));
        let v = Json::parse(br#"{"a":1,"a":"two"}"#).unwrap();
        let o = v.as_object().unwrap();
        assert_eq!(o.field("a").as_str(), Some("two"));
        assert_eq!(v.to_value(), json!({ "a": "two" }));
    }

    #[test]
    fn unescaped_strings_and_keys_are_borrowed() {
        let v = Json::parse(br#"{"key":"plain","esc\"":"a\nb"}"#).unwrap();
        let Json::Obj(o) = &v else { panic!("object") };
        assert!(matches!(&o.0[0].0, Cow::Borrowed(_)));
        assert!(matches!(&o.0[0].1, Json::Str(Cow::Borrowed(_))));
        assert!(matches!(&o.0[1].0, Cow::Owned(_)));
        assert!(matches!(&o.0[1].1, Json::Str(Cow::Owned(_))));
    }

    #[test]
    fn one_field_is_read_without_the_rest() {
        let body = br#"{"model":"a","input":[{"x":[1,2,{"y":"z"}]}],"model":"b"}"#;
        assert_eq!(
            Json::parse_field(body, "model"),
            Some(Json::Str("b".into()))
        );
        assert_eq!(Json::parse_field(body, "absent"), None);
        assert_eq!(Json::parse_field(b"[1]", "model"), None);
        assert_eq!(Json::parse_field(br#"{"model":"a"} x"#, "model"), None);
        assert_eq!(Json::parse_field(br#"{"model":"a","#, "model"), None);
    }

    #[test]
    fn errors_match_serde_json() {
        for bad in ["", "{", "[1,]", "{\"a\":1} x", "\"\\ud800\"", "nul"] {
            let ours = Json::parse(bad.as_bytes()).unwrap_err().to_string();
            let theirs = serde_json::from_str::<Value>(bad).unwrap_err().to_string();
            assert_eq!(ours, theirs, "{bad:?}");
        }
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert!(Json::parse(deep.as_bytes()).is_err());
        assert!(serde_json::from_str::<Value>(&deep).is_err());
    }
}
