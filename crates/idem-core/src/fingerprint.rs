//! The request fingerprint: what makes two requests with one key "the same request".

use std::borrow::Cow;
use std::fmt;

use sha2::{Digest, Sha256};

use crate::canonical_json::{Canonical, JsonError, Selection, Sink, pointer_segments};

/// The parts of a request that a fingerprint covers (docs/contract.md §2).
#[derive(Debug, Clone, Copy)]
pub struct RequestParts<'a> {
    /// The account the request is scoped to: the same key and body from two accounts are two
    /// different requests.
    pub account: &'a str,
    /// The HTTP method, as sent (`POST`).
    pub method: &'a str,
    /// The path (`/payments`).
    pub route: &'a str,
    /// The raw query string without `?`, or empty.
    pub query: &'a str,
    /// The `Content-Type` field value, or empty.
    pub content_type: &'a str,
    /// The request body.
    pub body: &'a [u8],
}

/// SHA-256 over a request's method, route, query, content type, account and canonical body.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Computes the fingerprint. JSON bodies (`application/json` or any `+json` type) are
    /// canonicalised first; other bodies count byte for byte.
    ///
    /// # Errors
    ///
    /// The errors of [`canonical_json`](crate::canonical_json) when a non-empty JSON body
    /// cannot be canonicalised (invalid JSON, a duplicate member, too deep).
    ///
    /// ```
    /// use idem_core::{Fingerprint, RequestParts};
    /// let parts = |body: &'static str| RequestParts {
    ///     account: "acct_1", method: "POST", route: "/payments", query: "",
    ///     content_type: "application/json", body: body.as_bytes(),
    /// };
    /// assert_eq!(
    ///     Fingerprint::compute(&parts(r#"{"a":1,"b":2}"#))?,
    ///     Fingerprint::compute(&parts(r#"{ "b": 2, "a": 1 }"#))?,
    /// );
    /// assert_ne!(
    ///     Fingerprint::compute(&parts(r#"{"a":1}"#))?,
    ///     Fingerprint::compute(&parts(r#"{"a":2}"#))?,
    /// );
    /// # Ok::<(), idem_core::JsonError>(())
    /// ```
    pub fn compute(parts: &RequestParts<'_>) -> Result<Self, JsonError> {
        Self::compute_with(parts, Canonical::parse)
    }

    /// Computes the fingerprint of a JSON body without the members at `pointers` (RFC 6901
    /// JSON pointers, such as `/metadata/trace_id`): a retry that differs only in them is the
    /// same request. Each pointer names the body as sent; a pointer to a member the body lacks
    /// changes nothing. Other bodies count byte for byte, as in [`compute`](Self::compute).
    ///
    /// # Errors
    ///
    /// As for [`compute`](Self::compute) when a non-empty JSON body cannot be canonicalised,
    /// and [`JsonError::BadPointer`] when a pointer is not one (see
    /// [`check_pointer`](Self::check_pointer)); pointers are read only for such a body.
    ///
    /// ```
    /// use idem_core::{Fingerprint, RequestParts};
    /// let parts = |body: &'static str| RequestParts {
    ///     account: "acct_1", method: "POST", route: "/payments", query: "",
    ///     content_type: "application/json", body: body.as_bytes(),
    /// };
    /// let ignoring = |body| Fingerprint::compute_ignoring(&parts(body), &["/trace"]);
    /// assert_eq!(ignoring(r#"{"a":1,"trace":"t1"}"#)?, ignoring(r#"{"a":1,"trace":"t2"}"#)?);
    /// assert_ne!(ignoring(r#"{"a":1,"trace":"t1"}"#)?, ignoring(r#"{"a":2,"trace":"t1"}"#)?);
    /// # Ok::<(), idem_core::JsonError>(())
    /// ```
    pub fn compute_ignoring<P: AsRef<str>>(
        parts: &RequestParts<'_>,
        pointers: &[P],
    ) -> Result<Self, JsonError> {
        Self::compute_selected(parts, Selection::Ignore(pointers))
    }

    /// Computes the fingerprint of a JSON body from only the members at `pointers` (and the
    /// objects and arrays that lead to them): a retry that differs anywhere else is the same
    /// request. Other bodies count byte for byte, as in [`compute`](Self::compute).
    ///
    /// # Errors
    ///
    /// As for [`compute`](Self::compute) when a non-empty JSON body cannot be canonicalised,
    /// and [`JsonError::BadPointer`] when a pointer is not one (see
    /// [`check_pointer`](Self::check_pointer)); pointers are read only for such a body.
    pub fn compute_only<P: AsRef<str>>(
        parts: &RequestParts<'_>,
        pointers: &[P],
    ) -> Result<Self, JsonError> {
        Self::compute_selected(parts, Selection::Only(pointers))
    }

    /// Checks that `pointer` can select members for [`compute_ignoring`] and
    /// [`compute_only`]: an RFC 6901 JSON pointer (`/a/b`, `~1` for `/`, `~0` for `~`) to
    /// something inside the document, not the empty pointer to all of it.
    ///
    /// # Errors
    ///
    /// [`JsonError::BadPointer`] when `pointer` does not start with `/` or has a `~` not
    /// followed by `0` or `1`.
    ///
    /// [`compute_ignoring`]: Self::compute_ignoring
    /// [`compute_only`]: Self::compute_only
    pub fn check_pointer(pointer: &str) -> Result<(), JsonError> {
        pointer_segments(pointer).map(drop)
    }

    /// The fingerprint of a JSON body with only the members `selection` covers.
    fn compute_selected<P: AsRef<str>>(
        parts: &RequestParts<'_>,
        selection: Selection<'_, P>,
    ) -> Result<Self, JsonError> {
        Self::compute_with(parts, |body| Canonical::parse_selected(body, selection))
    }

    /// The fingerprint with a JSON body read by `canonicalise` (a generic, so the plain
    /// [`compute`](Self::compute) pays nothing for selections).
    fn compute_with<'b>(
        parts: &RequestParts<'b>,
        canonicalise: impl FnOnce(&'b [u8]) -> Result<Canonical<'b>, JsonError>,
    ) -> Result<Self, JsonError> {
        let content_type = normalize_content_type(parts.content_type);
        let canonical = if is_json(&content_type) && !parts.body.is_empty() {
            Some(canonicalise(parts.body)?)
        } else {
            None
        };
        let mut hash = hash_head(parts, &content_type);
        match canonical {
            // The canonical text goes into the hash as it is written; it is never built whole.
            Some(body) => {
                hash.update((body.len() as u64).to_be_bytes());
                let mut sink = HashSink::new(hash);
                body.write(&mut sink);
                hash = sink.finish(body.len());
            }
            None => {
                hash.update((parts.body.len() as u64).to_be_bytes());
                hash.update(parts.body);
            }
        }
        Ok(Self(hash.finalize().into()))
    }

    /// Rebuilds a fingerprint read back from a store.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes, for storing.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl TryFrom<&[u8]> for Fingerprint {
    type Error = std::array::TryFromSliceError;
    fn try_from(bytes: &[u8]) -> Result<Self, Self::Error> {
        Ok(Self(bytes.try_into()?))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..8]))
    }
}

/// How many bytes [`HashSink`] gathers before it hashes them: eight SHA-256 blocks, few
/// enough that zeroing the buffer for each fingerprint costs next to nothing.
const HASH_BUFFER: usize = 512;

/// Feeds a hash through a buffer: canonical text comes in many small pieces (a comma, a
/// quote, a number), and copying each into a buffer costs less than handing each to the hash.
struct HashSink {
    hash: Sha256,
    buffer: [u8; HASH_BUFFER],
    filled: usize,
    /// Bytes hashed so far, to check the length the text was framed with.
    hashed: usize,
}

impl HashSink {
    fn new(hash: Sha256) -> Self {
        Self {
            hash,
            buffer: [0; HASH_BUFFER],
            filled: 0,
            hashed: 0,
        }
    }

    /// Hashes what the buffer holds, then `bytes`, or keeps `bytes` if they fit.
    #[cold]
    fn spill(&mut self, bytes: &[u8]) {
        self.hash.update(&self.buffer[..self.filled]);
        self.hashed += self.filled;
        self.filled = 0;
        if bytes.len() < HASH_BUFFER {
            self.put(bytes);
        } else {
            self.hash.update(bytes);
            self.hashed += bytes.len();
        }
    }

    /// The hash with everything put into it, which must be `expected_len` bytes: the length
    /// the text was framed with.
    fn finish(mut self, expected_len: usize) -> Sha256 {
        self.hash.update(&self.buffer[..self.filled]);
        debug_assert_eq!(self.hashed + self.filled, expected_len);
        self.hash
    }
}

impl Sink for HashSink {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        match self.buffer.get_mut(self.filled..self.filled + bytes.len()) {
            Some(room) => {
                room.copy_from_slice(bytes);
                self.filled += bytes.len();
            }
            None => self.spill(bytes),
        }
    }

    #[inline]
    fn put_prefix(&mut self, text: &[u8], len: usize) {
        // Most pieces (a name, a number) are short: sixteen bytes are copied whatever their
        // length, and the bytes past `len` are overwritten by the next piece or never hashed.
        let room = self.buffer.get_mut(self.filled..self.filled + 16);
        match (text.first_chunk::<16>(), room) {
            (Some(chunk), Some(room)) if len <= 16 => {
                room.copy_from_slice(chunk);
                self.filled += len;
            }
            _ => self.put(&text[..len]),
        }
    }

    #[inline]
    fn put_byte(&mut self, byte: u8) {
        match self.buffer.get_mut(self.filled) {
            Some(room) => {
                *room = byte;
                self.filled += 1;
            }
            None => self.spill(&[byte]),
        }
    }
}

/// The hash of every part of a request but its body, each field length-prefixed so no two
/// different requests can concatenate to the same bytes. The body follows the same way.
fn hash_head(parts: &RequestParts<'_>, content_type: &str) -> Sha256 {
    let mut hash = Sha256::new();
    for field in [
        b"idem-fingerprint-v1".as_slice(),
        parts.account.as_bytes(),
        parts.method.as_bytes(),
        parts.route.as_bytes(),
        parts.query.as_bytes(),
        content_type.as_bytes(),
    ] {
        hash.update((field.len() as u64).to_be_bytes());
        hash.update(field);
    }
    hash
}

/// Media types are case-insensitive and parameters are separated by optional whitespace; the
/// fingerprint should not change with either. Most requests send the normal form already
/// (`application/json`), which is then borrowed rather than rebuilt.
fn normalize_content_type(value: &str) -> Cow<'_, str> {
    let already_normal = value
        .bytes()
        .all(|b| b.is_ascii() && !b.is_ascii_uppercase() && !(b as char).is_whitespace())
        && !value.starts_with(';')
        && !value.ends_with(';')
        && !value.contains(";;");
    if already_normal {
        return Cow::Borrowed(value);
    }
    Cow::Owned(
        value
            .split(';')
            .map(|part| part.trim().to_ascii_lowercase())
            .filter(|part| !part.is_empty())
            .collect::<Vec<_>>()
            .join(";"),
    )
}

fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("");
    essence == "application/json" || essence.ends_with("+json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Map, Value};

    /// A `POST /payments` of `body` as `content_type`.
    fn typed<'a>(content_type: &'a str, body: &'a [u8]) -> RequestParts<'a> {
        RequestParts {
            account: "acct_a",
            method: "POST",
            route: "/payments",
            query: "",
            content_type,
            body,
        }
    }

    fn parts(body: &[u8]) -> RequestParts<'_> {
        typed("application/json", body)
    }

    fn fp(p: &RequestParts<'_>) -> Fingerprint {
        Fingerprint::compute(p).unwrap()
    }

    proptest! {
        /// The borrowed fast path of `normalize_content_type` gives what the slow one does.
        #[test]
        fn content_types_normalise_alike(value in "[a-zA-Z/+;= \t\u{b}\u{a0}é-]{0,16}") {
            let slow = value
                .split(';')
                .map(|part| part.trim().to_ascii_lowercase())
                .filter(|part| !part.is_empty())
                .collect::<Vec<_>>()
                .join(";");
            prop_assert_eq!(normalize_content_type(&value), slow);
        }
    }

    #[test]
    fn content_type_case_and_spacing_do_not_matter() {
        assert_eq!(
            fp(&typed("application/json; charset=utf-8", b"{}")),
            fp(&typed("Application/JSON;charset=UTF-8", b"{}"))
        );
    }

    #[test]
    fn non_json_bodies_count_byte_for_byte() {
        assert_ne!(
            fp(&typed("text/plain", b"{\"a\":1}")),
            fp(&typed("text/plain", b"{ \"a\":1}"))
        );
        // ... and are never parsed, so invalid JSON is fine there.
        assert!(Fingerprint::compute(&typed("text/plain", b"{")).is_ok());
    }

    /// A fingerprint made before selections existed: the plain path must keep producing it,
    /// or every stored record would stop matching its retries.
    #[test]
    fn the_plain_fingerprint_is_unchanged() {
        assert_eq!(
            fp(&parts(br#"{"b":2,"a":1}"#)).to_string(),
            PLAIN_FINGERPRINT
        );
    }

    const PLAIN_FINGERPRINT: &str =
        "8a07a9753bfeb876f1dc1e478a94450b2184da55023012fb3ffe3f48058e8ff1";

    #[test]
    fn an_empty_selection_is_the_plain_fingerprint() {
        let body = br#"{"b":2,"a":[1,{"c":null}]}"#;
        let none: &[&str] = &[];
        assert_eq!(
            Fingerprint::compute_ignoring(&parts(body), none).unwrap(),
            fp(&parts(body))
        );
        assert_eq!(
            Fingerprint::compute_only(&parts(body), &["/a", "/b"]).unwrap(),
            fp(&parts(body))
        );
    }

    #[test]
    fn selections_leave_other_bodies_alone() {
        let ignoring_t = |body: &[u8]| {
            Fingerprint::compute_ignoring(&typed("text/plain", body), &["/t"]).unwrap()
        };
        assert_ne!(ignoring_t(br#"{"t":1}"#), ignoring_t(br#"{"t":2}"#));
        assert!(Fingerprint::check_pointer("/metadata/trace_id").is_ok());
        assert!(Fingerprint::check_pointer("metadata").is_err());
    }

    #[test]
    fn json_duplicates_are_refused() {
        assert!(matches!(
            Fingerprint::compute(&parts(br#"{"amount":1,"amount":2}"#)),
            Err(JsonError::DuplicateMember { .. })
        ));
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            "[a-z\"\\\\\u{0}-\u{1f}é😀]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map("[a-z]{1,4}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
            ]
        })
    }

    /// Writes `value` with members in a shuffled order and random whitespace, as a different
    /// client library would.
    fn next(seed: &mut u64) -> usize {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 33) as usize
    }

    fn write_scrambled(value: &Value, seed: &mut u64, out: &mut String) {
        let ws = [" ", "", "\n", "\t ", "\r\n"];
        out.push_str(ws[next(seed) % ws.len()]);
        match value {
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_scrambled(item, seed, out);
                }
                out.push(']');
            }
            Value::Object(members) => {
                let mut members: Vec<_> = members.iter().collect();
                for i in (1..members.len()).rev() {
                    members.swap(i, next(seed) % (i + 1));
                }
                out.push('{');
                for (i, (name, v)) in members.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    // Escape some names with \u so the string form varies too.
                    if name.len() % 2 == 0 {
                        out.push('"');
                        for c in name.chars() {
                            out.push_str(&format!("\\u{:04x}", c as u32));
                        }
                        out.push('"');
                    } else {
                        out.push_str(&serde_json::to_string(name).unwrap());
                    }
                    out.push_str(" : ");
                    write_scrambled(v, seed, out);
                }
                out.push('}');
            }
            other => out.push_str(&other.to_string()),
        }
        out.push_str(ws[next(seed) % ws.len()]);
    }

    fn count_leaves(value: &Value) -> usize {
        match value {
            Value::Array(items) => items.iter().map(count_leaves).sum(),
            Value::Object(members) => members.values().map(count_leaves).sum(),
            _ => 1,
        }
    }

    /// Changes one leaf of `value` (chosen by `pick`), returning whether a leaf was changed.
    fn mutate(value: &mut Value, pick: &mut usize) -> bool {
        match value {
            Value::Array(items) => items.iter_mut().any(|v| mutate(v, pick)),
            Value::Object(members) => members.values_mut().any(|v| mutate(v, pick)),
            leaf => {
                if *pick > 0 {
                    *pick -= 1;
                    return false;
                }
                *leaf = match leaf {
                    Value::Null => Value::Bool(false),
                    Value::Bool(b) => Value::Bool(!*b),
                    Value::Number(n) => Value::String(n.to_string()),
                    Value::String(s) => Value::String(format!("{s}x")),
                    _ => unreachable!(),
                };
                true
            }
        }
    }

    /// `value` with one of its leaves (chosen by `pick`) changed; it must have one.
    fn one_leaf_changed(value: &Value, pick: usize) -> Value {
        let mut changed = value.clone();
        assert!(mutate(&mut changed, &mut (pick % count_leaves(value))));
        changed
    }

    /// A selection's property. `body` makes a JSON body of a value the selection covers and
    /// one it leaves out, and `selected` fingerprints a body with the selection: whatever is
    /// left out never changes the fingerprint, and a change to any leaf of the covered value
    /// (the one `pick` chooses) always does.
    fn check_selection(
        selected: impl Fn(&str) -> Fingerprint,
        body: impl Fn(&Value, &Value) -> String,
        (covered, pick): (&Value, usize),
        left_out: &(Value, Value),
    ) -> Result<(), TestCaseError> {
        let fingerprint = |covered: &Value, left_out: &Value| selected(&body(covered, left_out));
        prop_assert_eq!(
            fingerprint(covered, &left_out.0),
            fingerprint(covered, &left_out.1)
        );
        if count_leaves(covered) > 0 {
            let changed = one_leaf_changed(covered, pick);
            prop_assert_ne!(
                fingerprint(covered, &left_out.0),
                fingerprint(&changed, &left_out.0)
            );
        }
        Ok(())
    }

    /// The fingerprint as it was computed before the canonical text was hashed as it is
    /// written: the reference canonical form, built whole, then hashed like any other field.
    fn reference_fingerprint(
        parts: &RequestParts<'_>,
        selection: Option<Selection<'_, &str>>,
    ) -> Result<Fingerprint, JsonError> {
        use crate::canonical_json_reference as reference;
        let content_type = normalize_content_type(parts.content_type);
        let canonical;
        let body = if is_json(&content_type) && !parts.body.is_empty() {
            canonical = match selection {
                None => reference::canonical_json(parts.body)?,
                Some(selection) => reference::canonical_json_selected(parts.body, selection)?,
            };
            &canonical[..]
        } else {
            parts.body
        };
        let mut hash = super::hash_head(parts, &content_type);
        hash.update((body.len() as u64).to_be_bytes());
        hash.update(body);
        Ok(Fingerprint(hash.finalize().into()))
    }

    /// Every way to compute a fingerprint of `body` agrees with [`reference_fingerprint`].
    fn same_as_the_reference(body: &[u8], pointers: &[&str]) -> Result<(), TestCaseError> {
        let parts = parts(body);
        prop_assert_eq!(
            Fingerprint::compute(&parts),
            reference_fingerprint(&parts, None)
        );
        prop_assert_eq!(
            Fingerprint::compute_ignoring(&parts, pointers),
            reference_fingerprint(&parts, Some(Selection::Ignore(pointers)))
        );
        prop_assert_eq!(
            Fingerprint::compute_only(&parts, pointers),
            reference_fingerprint(&parts, Some(Selection::Only(pointers)))
        );
        Ok(())
    }

    /// Bodies longer than the hash's buffer, with pieces (a long string) longer than it too,
    /// and a selection that leaves most of the body out.
    #[test]
    fn long_bodies_hash_as_before() {
        let long = "x\\u00e9".repeat(HASH_BUFFER);
        for items in [0, 1, 40, 400, 4000] {
            let mut body = String::from("{\"items\": [");
            for i in 0..items {
                if i > 0 {
                    body.push_str(", ");
                }
                body.push_str(&format!(
                    r#"{{"sku": "SKU-{i:05}", "qty": {i}, "price": 12.50, "note": "line\n{i}"}}"#
                ));
            }
            let plain = "y".repeat(HASH_BUFFER - 3);
            body.push_str(&format!(
                "], \"long\": \"{long}\", \"plain\": \"{plain}\"}}"
            ));
            assert!(Fingerprint::compute(&parts(body.as_bytes())).is_ok());
            same_as_the_reference(body.as_bytes(), &["/items/1", "/long"]).unwrap();
            same_as_the_reference(body.as_bytes(), &["/items/0/qty"]).unwrap();
        }
    }

    proptest! {
        #[test]
        fn hashing_as_it_is_written_changes_nothing(
            text in crate::canonical_json_reference::texts::json(),
            pointers in crate::canonical_json_reference::texts::pointers(),
        ) {
            let pointers: Vec<&str> = pointers.iter().map(String::as_str).collect();
            same_as_the_reference(text.as_bytes(), &pointers)?;
        }

        #[test]
        fn reordering_and_whitespace_never_change_it(value in json_value(), seed in any::<u64>()) {
            let plain = value.to_string();
            let mut scrambled = String::new();
            write_scrambled(&value, &mut seed.clone(), &mut scrambled);
            prop_assert_eq!(fp(&parts(plain.as_bytes())), fp(&parts(scrambled.as_bytes())));
        }

        #[test]
        fn changing_any_value_always_changes_it(value in json_value(), pick in 0usize..64) {
            prop_assume!(count_leaves(&value) > 0);
            let changed = one_leaf_changed(&value, pick);
            prop_assert_ne!(
                fp(&parts(value.to_string().as_bytes())),
                fp(&parts(changed.to_string().as_bytes()))
            );
        }

        /// `ignore`: an ignored member never changes it and any other always does; `only`:
        /// only the selected members change it.
        #[test]
        fn a_selection_covers_what_it_names_and_nothing_else(
            value in json_value(),
            left_out in (json_value(), json_value()),
            pick in 0usize..64,
        ) {
            // "ig0" cannot be a generated name ([a-z]{1,4}), so it is the only ignored member.
            check_selection(
                |b| Fingerprint::compute_ignoring(&parts(b.as_bytes()), &["/ig0", "/deep/ig0"]).unwrap(),
                |v, ig| serde_json::json!({"kept": v, "ig0": ig, "deep": {"ig0": ig}}).to_string(),
                (&value, pick),
                &left_out,
            )?;
            check_selection(
                |b| Fingerprint::compute_only(&parts(b.as_bytes()), &["/k0"]).unwrap(),
                |v, other| serde_json::json!({"k0": v, "other": other}).to_string(),
                (&value, pick),
                &left_out,
            )?;
        }

        #[test]
        fn method_route_query_and_account_always_change_it(
            value in json_value(),
            method in "(POST|PATCH|PUT)",
            route in "/[a-z]{1,8}",
            query in "[a-z=&]{0,8}",
            account in "acct_[a-z0-9]{1,8}",
        ) {
            let body = value.to_string();
            let base = parts(body.as_bytes());
            let base_fp = fp(&base);
            if method != base.method {
                prop_assert_ne!(fp(&RequestParts { method: &method, ..base }), base_fp);
            }
            if route != base.route {
                prop_assert_ne!(fp(&RequestParts { route: &route, ..base }), base_fp);
            }
            if !query.is_empty() {
                prop_assert_ne!(fp(&RequestParts { query: &query, ..base }), base_fp);
            }
            if account != base.account {
                prop_assert_ne!(fp(&RequestParts { account: &account, ..base }), base_fp);
            }
        }
    }
}
