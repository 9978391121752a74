//! The set of keys `IdempotencyKey::parse` accepts, written a second time from the key module's
//! doc and not from the parser: what a reviewer would check by hand. The parser's property
//! tests and the `key_parser` fuzz target compare the two; nothing else should use it.

use crate::KeyLimits;

/// The key `value` names if it is a valid `Idempotency-Key` field under `limits`, else `None`.
pub fn parse(value: &[u8], limits: KeyLimits) -> Option<String> {
    // Optional whitespace around the field value (RFC 9110 §5.5).
    let mut value = value;
    while let [b' ' | b'\t', rest @ ..] = value {
        value = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = value {
        value = rest;
    }
    let key = if let Some(inner) = value.strip_prefix(b"\"") {
        // An sf-string with no parameters and nothing after it.
        let inner = inner.strip_suffix(b"\"")?;
        let mut key = Vec::new();
        let mut bytes = inner.iter();
        while let Some(&b) = bytes.next() {
            match b {
                b'\\' => match bytes.next() {
                    Some(&e @ (b'"' | b'\\')) => key.push(e),
                    _ => return None,
                },
                b'"' => return None,
                // An sf-string may hold a space; a key may not.
                0x21..=0x7e => key.push(b),
                _ => return None,
            }
        }
        key
    } else {
        // The bare form: visible ASCII without the characters that would make it a list or
        // parameters.
        if value
            .iter()
            .any(|&b| !(0x21..=0x7e).contains(&b) || matches!(b, b'"' | b',' | b';'))
        {
            return None;
        }
        value.to_vec()
    };
    (limits.min_len..=limits.max_len)
        .contains(&key.len())
        .then(|| String::from_utf8(key).expect("visible ASCII"))
}
