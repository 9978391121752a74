//! `IdempotencyKey::parse` on any bytes a client could put in the header: it never panics, it
//! accepts exactly the set key.rs documents (checked against `idem_core::key_reference`,
//! written from that doc, not from the parser), and an accepted key round-trips through `Display`.

#![no_main]

use idem_core::{IdempotencyKey, KeyError, KeyLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|value: &[u8]| {
    let limits = KeyLimits::default();
    let parsed = IdempotencyKey::parse(value, limits);
    assert_eq!(
        parsed.as_ref().ok().map(IdempotencyKey::as_str),
        idem_core::key_reference::parse(value, limits).as_deref(),
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
