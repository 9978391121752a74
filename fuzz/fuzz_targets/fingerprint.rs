//! `Fingerprint::compute` over every part of a request. The input is text, one part per line:
//! account, method, route, query, content type, then the body (the rest, newlines included),
//! so seeds are readable.
//!
//! - It never panics, and fails only where a JSON body is not canonical JSON.
//! - Content-type case and spacing never change it; equivalent JSON bodies never change it.
//! - Moving a character from one part to the next always changes it (the parts are framed,
//!   never simply concatenated); so does any change to a non-JSON body, whose bytes are never
//!   normalised.

#![no_main]

use idem_core::{Fingerprint, RequestParts, canonical_json};
use idem_fuzz::{Json, Rng};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let mut lines = input.splitn(6, |&b| b == b'\n');
    let mut field = || String::from_utf8_lossy(lines.next().unwrap_or_default()).into_owned();
    let (account, method, route, query, content_type) =
        (field(), field(), field(), field(), field());
    let body = lines.next().unwrap_or_default();
    let parts = RequestParts {
        account: &account,
        method: &method,
        route: &route,
        query: &query,
        content_type: &content_type,
        body,
    };

    // A JSON content type is recognised by its refusing a body that is not JSON.
    let is_json = Fingerprint::compute(&RequestParts {
        body: b"{",
        ..parts
    })
    .is_err();
    let fp = Fingerprint::compute(&parts);
    let canonical = canonical_json(body);
    match &fp {
        Ok(_) => assert!(!is_json || body.is_empty() || canonical.is_ok()),
        Err(e) => {
            assert!(is_json, "a non-JSON content type failed: {e}");
            assert_eq!(canonical.as_ref().err(), Some(e));
        }
    }
    assert_eq!(fp, Fingerprint::compute(&parts), "not deterministic");
    let Ok(fp) = fp else { return };

    let shouted = format!(
        " {}\t",
        content_type.to_ascii_uppercase().replace(';', " ; ")
    );
    assert_eq!(
        Fingerprint::compute(&RequestParts {
            content_type: &shouted,
            ..parts
        }),
        Ok(fp),
        "content type {content_type:?} and {shouted:?} differ"
    );

    // Shift one character across each boundary between the parts hashed as written.
    let raw = [&account, &method, &route, &query];
    for i in 0..raw.len() - 1 {
        let Some(last) = raw[i].chars().next_back() else {
            continue;
        };
        let mut moved = raw.map(String::clone);
        moved[i].pop();
        moved[i + 1].insert(0, last);
        let shifted = RequestParts {
            account: &moved[0],
            method: &moved[1],
            route: &moved[2],
            query: &moved[3],
            ..parts
        };
        assert_ne!(
            Fingerprint::compute(&shifted),
            Ok(fp),
            "{moved:?} hashed like {raw:?}"
        );
    }

    if is_json && !body.is_empty() {
        let canonical = canonical.expect("checked above");
        assert_eq!(
            Fingerprint::compute(&RequestParts {
                body: &canonical,
                ..parts
            }),
            Ok(fp)
        );
        if let Ok(value) = Json::parse(body) {
            let scrambled = value.write_scrambled(&mut Rng::from_input(input));
            assert_eq!(
                Fingerprint::compute(&RequestParts {
                    body: scrambled.as_bytes(),
                    ..parts
                }),
                Ok(fp),
                "equivalent JSON hashed differently: {scrambled:?}"
            );
        }
    } else if !is_json {
        let mut longer = body.to_vec();
        longer.push(b' ');
        assert_ne!(
            Fingerprint::compute(&RequestParts {
                body: &longer,
                ..parts
            }),
            Ok(fp),
            "a trailing space in a non-JSON body went unnoticed"
        );
    }
});
