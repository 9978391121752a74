//! The request bodies the drill derives from `--body`: the same members in another order, and
//! a body that differs in one value. Both keep every other value byte for byte, because the
//! contract's fingerprint keeps numbers exactly as written (`1` and `1.0` differ).

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// A JSON object's top-level members in document order, each value's text untouched.
#[derive(Debug)]
pub(crate) struct JsonObject(Vec<(String, Box<RawValue>)>);

impl JsonObject {
    /// The object `text` holds; `None` when it is not JSON or not an object.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        serde_json::from_str(text).ok()
    }

    /// The same members in reverse order, spaced differently: the same request under the
    /// contract. `None` with fewer than two members, where no other order exists.
    pub(crate) fn reordered(&self) -> Option<String> {
        if self.0.len() < 2 {
            return None;
        }
        let members: Vec<String> = self
            .0
            .iter()
            .rev()
            .map(|(name, value)| format!("{}: {}", quote(name), value.get()))
            .collect();
        Some(format!("{{ {} }}", members.join(", ")))
    }

    /// A body that is a different request: the first integer member plus one (most likely
    /// still valid for the API), or else an added member. Returns the body and a few words
    /// saying what changed.
    pub(crate) fn varied(&self) -> (String, String) {
        let bumped = self.0.iter().enumerate().find_map(|(i, (name, value))| {
            let n: i128 = integer(value.get())?.parse().ok()?;
            Some((i, name, value.get(), (n + 1).to_string()))
        });
        let mut members: Vec<(String, String)> = self
            .0
            .iter()
            .map(|(name, value)| (name.clone(), value.get().to_owned()))
            .collect();
        let what = match bumped {
            Some((i, name, old, new)) => {
                let what = format!("{name} {old} -> {new}");
                members[i].1 = new;
                what
            }
            None => {
                members.push(("idem_drill_variant".to_owned(), "1".to_owned()));
                "an added member idem_drill_variant".to_owned()
            }
        };
        let members: Vec<String> = members
            .iter()
            .map(|(name, value)| format!("{}:{value}", quote(name)))
            .collect();
        (format!("{{{}}}", members.join(",")), what)
    }
}

/// `text` if it is a JSON integer literal (no fraction, no exponent).
fn integer(text: &str) -> Option<&str> {
    let digits = text.strip_prefix('-').unwrap_or(text);
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then_some(text)
}

fn quote(name: &str) -> String {
    serde_json::to_string(name).expect("a string always serialises")
}

impl<'de> Deserialize<'de> for JsonObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Members;

        impl<'de> Visitor<'de> for Members {
            type Value = JsonObject;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonObject, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, Box<RawValue>>()? {
                    members.push(member);
                }
                Ok(JsonObject(members))
            }
        }

        deserializer.deserialize_map(Members)
    }
}

/// The resource id at `field` in a JSON answer: a dotted path (`id`, `data.id`) or a JSON
/// pointer (`/data/0/id`, RFC 6901) to a string or a number. `None` when the body is not JSON
/// or the field is absent or empty.
pub(crate) fn id_in(body: &[u8], field: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    id_at(&value, field)
}

/// The resource id at `field` in `value`, as [`id_in`] finds it.
pub(crate) fn id_at(value: &serde_json::Value, field: &str) -> Option<String> {
    match member(value, field)? {
        serde_json::Value::String(s) if !s.is_empty() => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The value at `field` in `value`: a JSON pointer when it starts with `/`, else a dotted
/// path of member names.
pub(crate) fn member<'a>(
    value: &'a serde_json::Value,
    field: &str,
) -> Option<&'a serde_json::Value> {
    if field.starts_with('/') {
        value.pointer(field)
    } else {
        field.split('.').try_fold(value, |v, name| v.get(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reordering_reverses_members_and_keeps_values_verbatim() {
        let body =
            JsonObject::parse(r#"{"amount": 1.0, "currency": "INR", "n": 9007199254740993}"#)
                .unwrap();
        assert_eq!(
            body.reordered().unwrap(),
            r#"{ "n": 9007199254740993, "currency": "INR", "amount": 1.0 }"#
        );
        assert_eq!(
            idem_core::canonical_json(body.reordered().unwrap().as_bytes()).unwrap(),
            idem_core::canonical_json(br#"{"amount":1.0,"currency":"INR","n":9007199254740993}"#)
                .unwrap(),
            "the same request once canonical"
        );
    }

    #[test]
    fn one_member_has_no_other_order_and_non_objects_are_refused() {
        assert!(
            JsonObject::parse(r#"{"a": 1}"#)
                .unwrap()
                .reordered()
                .is_none()
        );
        for text in ["[1, 2]", "3", "not json", r#"{"a": 1"#] {
            assert!(JsonObject::parse(text).is_none(), "{text}");
        }
    }

    #[test]
    fn the_varied_body_bumps_the_first_integer() {
        let body = JsonObject::parse(r#"{"currency": "INR", "amount": 49900}"#).unwrap();
        let (text, what) = body.varied();
        assert_eq!(text, r#"{"currency":"INR","amount":49901}"#);
        assert_eq!(what, "amount 49900 -> 49901");
    }

    #[test]
    fn without_an_integer_the_varied_body_gains_a_member() {
        let body = JsonObject::parse(r#"{"price": 1.5, "sku": "A-1"}"#).unwrap();
        let (text, _) = body.varied();
        assert_eq!(text, r#"{"price":1.5,"sku":"A-1","idem_drill_variant":1}"#);
    }

    #[test]
    fn ids_are_found_by_dotted_path() {
        let body = br#"{"id": "pay_1", "data": {"id": 42}, "empty": ""}"#;
        assert_eq!(id_in(body, "id").as_deref(), Some("pay_1"));
        assert_eq!(id_in(body, "data.id").as_deref(), Some("42"));
        assert_eq!(id_in(body, "empty"), None);
        assert_eq!(id_in(body, "missing"), None);
        assert_eq!(id_in(b"<html>", "id"), None);
    }

    #[test]
    fn ids_are_found_by_json_pointer() {
        let body = br#"{"data": [{"id": "ch_1"}], "a.b": {"id": 7}}"#;
        assert_eq!(id_in(body, "/data/0/id").as_deref(), Some("ch_1"));
        assert_eq!(id_in(body, "/a.b/id").as_deref(), Some("7"));
        assert_eq!(id_in(body, "/data/1/id"), None);
    }
}
