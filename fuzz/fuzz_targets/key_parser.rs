//! `IdempotencyKey::parse` on any bytes a client could put in the header: it never panics, it
//! accepts exactly the set key.rs documents (checked against a reference written from that
//! doc, not from the parser), and an accepted key round-trips through `Display`.

#![no_main]

use idem_core::{IdempotencyKey, KeyError, KeyLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|value: &[u8]| {
    let limits = KeyLimits::default();
    let parsed = IdempotencyKey::parse(value, limits);
    assert_eq!(
        parsed.as_ref().ok().map(IdempotencyKey::as_str),
        reference(value, limits).as_deref(),
        "parser and reference disagree on {:?}",
        String::from_utf8_lossy(value)
    );
    let Ok(key) = parsed else { return };

    // Display writes the sf-string form, which must parse back to the same key.
    let shown = key.to_string();
    assert_eq!(
        IdempotencyKey::parse(shown.as_bytes(), limits).as_ref(),
        Ok(&key)
    );
    // A key without `"`, `,` or `;` can also be sent bare; both forms name the same key.
    if !key.as_str().contains(['"', ',', ';']) {
        assert_eq!(
            IdempotencyKey::parse(key.as_str().as_bytes(), limits).as_ref(),
            Ok(&key)
        );
    }
    // The same value twice is two fields: refused whatever each holds.
    assert_eq!(
        IdempotencyKey::from_header_values([value, value], limits),
        Err(KeyError::SeveralFields(2))
    );
});

/// The accepted set as key.rs's module doc states it.
fn reference(value: &[u8], limits: KeyLimits) -> Option<String> {
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
                // sf-strings allow a space; keys do not.
                0x21..=0x7e => key.push(b),
                _ => return None,
            }
        }
        key
    } else {
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
