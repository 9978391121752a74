//! `canonical_json` on any bytes a client could send as a JSON body.
//!
//! - It never panics (10,000 nested arrays included: the depth limit must hold).
//! - It agrees with serde_json on what is JSON: it refuses only what RFC 8259 refuses, plus
//!   duplicate members and nesting past `MAX_DEPTH`, which serde_json lets through.
//! - Its output is a fixed point: canonical(canonical(x)) == canonical(x).
//! - Differential: the value, read independently by serde_json and written back with members
//!   shuffled, whitespace added and strings escaped another way, has the same canonical form
//!   and the same fingerprint; the value with one leaf changed has a different one.

#![no_main]

use idem_core::{Fingerprint, JsonError, RequestParts, canonical_json};
use idem_fuzz::{Json, Rng};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let canonical = canonical_json(input);
    // Into a Value, not IgnoredAny: serde_json skips an ignored string's UTF-8 check.
    let serde = serde_json::from_slice::<serde_json::Value>(input);
    match (&canonical, serde) {
        (Ok(_), Err(e)) => {
            // serde_json stops at 127 levels (idem allows 128) and refuses numbers beyond f64;
            // idem keeps numbers as text, so both are expected differences.
            let message = e.to_string();
            assert!(
                message.contains("recursion limit exceeded")
                    || message.contains("number out of range"),
                "idem accepted what serde_json refuses ({message}): {:?}",
                String::from_utf8_lossy(input)
            );
        }
        (Err(JsonError::Syntax { offset, reason }), Ok(_)) => panic!(
            "idem refused valid JSON at {offset} ({reason}): {:?}",
            String::from_utf8_lossy(input)
        ),
        _ => {}
    }
    let Ok(canonical) = canonical else { return };

    assert!(std::str::from_utf8(&canonical).is_ok());
    assert_eq!(
        canonical_json(&canonical).as_ref(),
        Ok(&canonical),
        "not a fixed point"
    );

    let value = match Json::parse(input) {
        Ok(value) => value,
        // Only serde_json's own limits (see above) can refuse what idem accepted.
        Err(_) => return,
    };
    let mut rng = Rng::from_input(input);
    let scrambled = value.write_scrambled(&mut rng);
    assert_eq!(
        canonical_json(scrambled.as_bytes()).as_ref(),
        Ok(&canonical),
        "an equivalent spelling canonicalised differently: {scrambled:?}"
    );
    assert_eq!(
        fingerprint(input, "application/json"),
        fingerprint(scrambled.as_bytes(), " Application/JSON"),
        "equivalent bodies hashed differently: {scrambled:?}"
    );

    let mut changed = value.clone();
    changed.mutate_one(&mut rng);
    let changed = changed.write_plain();
    assert_ne!(
        canonical_json(changed.as_bytes()).as_ref(),
        Ok(&canonical),
        "a different value canonicalised the same: {changed:?}"
    );
    assert_ne!(
        fingerprint(input, "application/json"),
        fingerprint(changed.as_bytes(), "application/json"),
        "different bodies hashed alike: {changed:?}"
    );
});

fn fingerprint(body: &[u8], content_type: &str) -> Fingerprint {
    Fingerprint::compute(&RequestParts {
        account: "acct_fuzz",
        method: "POST",
        route: "/payments",
        query: "",
        content_type,
        body,
    })
    .expect("a body canonical_json accepted")
}
