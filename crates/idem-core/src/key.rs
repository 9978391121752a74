//! The `Idempotency-Key` request header: parsing and validation.
//!
//! Two spellings name the same key: the RFC 9651 sf-string the IETF draft specifies
//! (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`) and the bare form Stripe's
//! clients send (`Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`).
//!
//! The accepted set, exactly:
//! - exactly one header field (several fields are ambiguous: which one is the key?);
//! - after trimming optional whitespace (SP, HTAB), either
//!   - an sf-string Item with no parameters, whose value is the key, or
//!   - a bare key: visible ASCII (0x21–0x7E) without `"`, `,` or `;`, so that it can never be
//!     mistaken for an sf-string, a list or an item with parameters;
//! - the key itself is [`KeyLimits::min_len`]..=[`KeyLimits::max_len`] characters of visible
//!   ASCII (0x21–0x7E). A space inside an sf-string is therefore rejected too.

use std::fmt;

/// Bounds on the length of a key, in characters (all keys are ASCII, so also in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyLimits {
    /// The shortest key accepted (default 8): shorter keys are too easy to collide.
    pub min_len: usize,
    /// The longest key accepted (default 255).
    pub max_len: usize,
}

impl Default for KeyLimits {
    fn default() -> Self {
        Self {
            min_len: 8,
            max_len: 255,
        }
    }
}

/// Why a key was refused. Every variant maps to `400` with the `malformed-key` problem type,
/// except [`KeyError::Missing`], which has its own type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// No `Idempotency-Key` field on a request that needs one.
    #[error("the Idempotency-Key header is missing")]
    Missing,
    /// More than one `Idempotency-Key` field.
    #[error("the Idempotency-Key header appears {0} times; send it once")]
    SeveralFields(usize),
    /// A comma-separated list instead of one key.
    #[error("the Idempotency-Key header holds a list; send one key")]
    List,
    /// An sf-string followed by parameters (`"key";a=1`).
    #[error("the Idempotency-Key header has parameters; send the key alone")]
    Parameters,
    /// Not an sf-string and not a valid bare key.
    #[error("the Idempotency-Key header is neither an sf-string nor a bare key of visible ASCII")]
    Syntax,
    /// A character outside visible ASCII (0x21–0x7E) in the key.
    #[error("the idempotency key contains a character outside visible ASCII (0x21-0x7E)")]
    InvalidCharacter,
    /// Shorter than the minimum.
    #[error("the idempotency key is {len} characters long; at least {min} are required")]
    TooShort {
        /// The key's length.
        len: usize,
        /// The minimum.
        min: usize,
    },
    /// Longer than the maximum.
    #[error("the idempotency key is {len} characters long; at most {max} are allowed")]
    TooLong {
        /// The key's length (or a lower bound of it for very long fields).
        len: usize,
        /// The maximum.
        max: usize,
    },
}

/// A validated idempotency key, as the client chose it (without sf-string quoting).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Parses the values of every `Idempotency-Key` field of a request, in order.
    ///
    /// # Errors
    ///
    /// [`KeyError::Missing`] when there is no value, [`KeyError::SeveralFields`] when there is
    /// more than one, and otherwise the errors of [`parse`](Self::parse).
    ///
    /// ```
    /// use idem_core::{IdempotencyKey, KeyLimits};
    /// let bare = IdempotencyKey::from_header_values([&b"order-12345"[..]], KeyLimits::default())?;
    /// let quoted = IdempotencyKey::from_header_values([&b"\"order-12345\""[..]], KeyLimits::default())?;
    /// assert_eq!(bare, quoted);
    /// # Ok::<(), idem_core::KeyError>(())
    /// ```
    pub fn from_header_values<'a>(
        values: impl IntoIterator<Item = &'a [u8]>,
        limits: KeyLimits,
    ) -> Result<Self, KeyError> {
        let mut values = values.into_iter();
        let first = values.next().ok_or(KeyError::Missing)?;
        let extra = values.count();
        if extra > 0 {
            return Err(KeyError::SeveralFields(extra + 1));
        }
        Self::parse(first, limits)
    }

    /// Parses one header field value.
    ///
    /// # Errors
    ///
    /// - [`KeyError::List`] for a comma-separated list of keys.
    /// - [`KeyError::Parameters`] for a key followed by parameters (`"key";a=1`).
    /// - [`KeyError::Syntax`] when the value is neither an sf-string nor a bare key.
    /// - [`KeyError::InvalidCharacter`], [`KeyError::TooShort`] and [`KeyError::TooLong`] as
    ///   for [`new`](Self::new).
    pub fn parse(value: &[u8], limits: KeyLimits) -> Result<Self, KeyError> {
        let value = trim_ows(value);
        // An sf-string of a valid key is at most twice its length plus quotes; anything longer
        // is refused before parsing so a 64 KiB header costs nothing.
        if value.len() > limits.max_len.saturating_mul(2).saturating_add(2) {
            return Err(KeyError::TooLong {
                len: value.len(),
                max: limits.max_len,
            });
        }
        let key = if value.first() == Some(&b'"') {
            parse_sf_string(value)?
        } else {
            parse_bare(value)?
        };
        Self::check(key, limits)
    }

    /// Validates an already-unquoted key (for keys that did not arrive in a header, such as a
    /// queue message's event id).
    ///
    /// # Errors
    ///
    /// [`KeyError::InvalidCharacter`] when a character is outside visible ASCII,
    /// [`KeyError::TooShort`] or [`KeyError::TooLong`] when the length is outside `limits`.
    pub fn new(key: impl Into<String>, limits: KeyLimits) -> Result<Self, KeyError> {
        Self::check(key.into(), limits)
    }

    fn check(key: String, limits: KeyLimits) -> Result<Self, KeyError> {
        if !key.bytes().all(is_visible_ascii) {
            return Err(KeyError::InvalidCharacter);
        }
        let len = key.len();
        if len < limits.min_len {
            return Err(KeyError::TooShort {
                len,
                min: limits.min_len,
            });
        }
        if len > limits.max_len {
            return Err(KeyError::TooLong {
                len,
                max: limits.max_len,
            });
        }
        Ok(Self(key))
    }

    /// The key as the client chose it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Shows the key as an sf-string, the form the IETF draft uses.
impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"")?;
        for c in self.0.chars() {
            if c == '"' || c == '\\' {
                f.write_str("\\")?;
            }
            write!(f, "{c}")?;
        }
        f.write_str("\"")
    }
}

/// Keys are secrets of a sort (a guessed key plus a stolen credential replays a response), so
/// `Debug` shows only the length.
impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(<{} chars>)", self.0.len())
    }
}

fn is_visible_ascii(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

fn trim_ows(mut value: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = value {
        value = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = value {
        value = rest;
    }
    value
}

fn parse_sf_string(value: &[u8]) -> Result<String, KeyError> {
    let item: sfv::Item = match sfv::Parser::new(value).parse() {
        Ok(item) => item,
        Err(_) => {
            // Tell a list (`"a", "b"`) apart from other syntax errors: it is the one mistake a
            // client makes by joining two retries' headers.
            return Err(if sfv::Parser::new(value).parse::<sfv::List>().is_ok() {
                KeyError::List
            } else {
                KeyError::Syntax
            });
        }
    };
    if !item.params.is_empty() {
        return Err(KeyError::Parameters);
    }
    match item.bare_item.as_string() {
        Some(s) => Ok(s.as_str().to_owned()),
        None => Err(KeyError::Syntax),
    }
}

fn parse_bare(value: &[u8]) -> Result<String, KeyError> {
    if value.contains(&b',') {
        return Err(KeyError::List);
    }
    if value.contains(&b';') {
        return Err(KeyError::Parameters);
    }
    if value.contains(&b'"') {
        return Err(KeyError::Syntax);
    }
    if !value.iter().copied().all(is_visible_ascii) {
        return Err(KeyError::InvalidCharacter);
    }
    // Every byte is ASCII, so this cannot fail.
    Ok(String::from_utf8_lossy(value).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(v: &[u8]) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::parse(v, KeyLimits::default())
    }

    #[test]
    fn both_forms_name_the_same_key() {
        let a = parse(b"8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap();
        let b = parse(b"\"8e03978e-40d5-43e8-bc93-6894a57f9324\"").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.as_str(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
    }

    #[test]
    fn sf_string_escapes_are_unescaped() {
        let k = parse(br#""abc\"def\\gh""#).unwrap();
        assert_eq!(k.as_str(), r#"abc"def\gh"#);
        assert_eq!(k.to_string(), r#""abc\"def\\gh""#);
    }

    #[test]
    fn optional_whitespace_is_trimmed() {
        assert_eq!(parse(b"  abcdefgh\t").unwrap().as_str(), "abcdefgh");
        assert_eq!(parse(b" \"abcdefgh\" ").unwrap().as_str(), "abcdefgh");
    }

    #[test]
    fn malformed_keys_are_refused_with_a_reason() {
        let cases: &[(&[u8], KeyError)] = &[
            (b"", KeyError::TooShort { len: 0, min: 8 }),
            (b"short", KeyError::TooShort { len: 5, min: 8 }),
            (b"abcdefgh, ijklmnop", KeyError::List),
            (b"\"abcdefgh\", \"ijklmnop\"", KeyError::List),
            (b"\"abcdefgh\";a=1", KeyError::Parameters),
            (b"abcdefgh;a=1", KeyError::Parameters),
            (b"\"abcd efgh\"", KeyError::InvalidCharacter),
            (b"abcd efgh", KeyError::InvalidCharacter),
            (b"abcd\x7fefgh", KeyError::InvalidCharacter),
            (b"abcd\x80efgh", KeyError::InvalidCharacter),
            (b"abcd\0efgh", KeyError::InvalidCharacter),
            (b"\"unterminated", KeyError::Syntax),
            (b"?1", KeyError::TooShort { len: 2, min: 8 }),
            (b"\"abcdefgh\" x", KeyError::Syntax),
        ];
        for (input, want) in cases {
            assert_eq!(
                parse(input).unwrap_err(),
                *want,
                "{}",
                String::from_utf8_lossy(input)
            );
        }
        let long = "k".repeat(256);
        assert_eq!(
            parse(long.as_bytes()).unwrap_err(),
            KeyError::TooLong { len: 256, max: 255 }
        );
        assert!(parse("k".repeat(255).as_bytes()).is_ok());
        assert!(parse(&vec![b'k'; 65536]).is_err());
        // Bare keys are Stripe's form: any visible ASCII without `"`, `,`, `;`, even when it
        // happens to look like another structured-field type.
        assert!(parse(b":YWJjZGVmZ2hpams=:").is_ok());
        assert!(parse(b"123456789").is_ok());
    }

    #[test]
    fn several_fields_are_refused() {
        let err = IdempotencyKey::from_header_values(
            [&b"abcdefgh"[..], &b"abcdefgh"[..]],
            KeyLimits::default(),
        )
        .unwrap_err();
        assert_eq!(err, KeyError::SeveralFields(2));
        let none: [&[u8]; 0] = [];
        assert_eq!(
            IdempotencyKey::from_header_values(none, KeyLimits::default()).unwrap_err(),
            KeyError::Missing
        );
    }

    #[test]
    fn limits_are_configurable() {
        let limits = KeyLimits {
            min_len: 2,
            max_len: 4,
        };
        assert!(IdempotencyKey::parse(b"ab", limits).is_ok());
        assert!(IdempotencyKey::parse(b"abcde", limits).is_err());
    }

    fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
        // Mostly bytes near the interesting set, with some arbitrary ones, so both accepted and
        // refused inputs are common.
        let interesting = prop_oneof![
            8 => 0x21u8..=0x7e,
            1 => Just(b'"'),
            1 => Just(b'\\'),
            1 => Just(b' '),
            1 => Just(b','),
            1 => Just(b';'),
            1 => any::<u8>(),
        ];
        prop_oneof![
            prop::collection::vec(interesting.clone(), 0..300),
            prop::collection::vec(interesting, 6..40).prop_map(|mut v| {
                v.insert(0, b'"');
                v.push(b'"');
                v
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn accepts_exactly_the_specified_set(value in header_bytes()) {
            let got = parse(&value).ok().map(|k| k.as_str().to_owned());
            prop_assert_eq!(got, crate::key_reference::parse(&value, KeyLimits::default()));
        }

        #[test]
        fn never_panics_on_any_bytes(value in prop::collection::vec(any::<u8>(), 0..600)) {
            let _ = parse(&value);
        }

        #[test]
        fn display_round_trips(key in "[!-~]{8,255}") {
            let parsed = parse(key.as_bytes());
            if let Ok(k) = parsed {
                let again = parse(k.to_string().as_bytes()).unwrap();
                prop_assert_eq!(again, k);
            }
        }
    }
}
