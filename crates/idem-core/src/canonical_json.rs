//! Canonical JSON for fingerprints: RFC 8785's member order and string form, with numbers kept
//! exactly as written.
//!
//! Written by hand because no maintained crate does all three things docs/contract.md §2 asks: RFC 8785
//! crates (`serde_json_canonicalizer`) re-serialise numbers through `f64`, which makes
//! `9007199254740993` equal `9007199254740992` and `1` equal `1.0`; `serde_json` keeps the last
//! of duplicate members silently. The parser is strict RFC 8259 with a depth limit, so hostile
//! bodies (10,000 nested arrays) fail with an error instead of overflowing the stack.

/// Deepest nesting of arrays and objects accepted.
pub const MAX_DEPTH: usize = 128;

/// Why a JSON body could not be canonicalised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JsonError {
    /// Not valid JSON (RFC 8259).
    #[error("invalid JSON at byte {offset}: {reason}")]
    Syntax {
        /// Where the parser stopped.
        offset: usize,
        /// What it expected.
        reason: &'static str,
    },
    /// An object names the same member twice, so two readers may disagree on its value.
    #[error("duplicate member {name:?} in a JSON object")]
    DuplicateMember {
        /// The repeated name.
        name: String,
    },
    /// Nesting deeper than [`MAX_DEPTH`].
    #[error("JSON nested deeper than {MAX_DEPTH} levels")]
    TooDeep,
    /// A JSON pointer that selects members for a fingerprint is not one (RFC 6901), or names
    /// the whole document.
    #[error("{pointer:?} is not a JSON pointer to a member: {reason}")]
    BadPointer {
        /// The pointer as written.
        pointer: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Returns the canonical form of a JSON text.
///
/// ```
/// use idem_core::canonical_json;
/// let a = canonical_json(br#"{ "b": 2, "a": [1.0, "\u0041"] }"#)?;
/// assert_eq!(a, br#"{"a":[1.0,"A"],"b":2}"#);
/// # Ok::<(), idem_core::JsonError>(())
/// ```
pub fn canonical_json(input: &[u8]) -> Result<Vec<u8>, JsonError> {
    let value = parse(input)?;
    let mut out = Vec::with_capacity(input.len());
    value.write(&mut out);
    Ok(out)
}

fn parse(input: &[u8]) -> Result<Value<'_>, JsonError> {
    let mut parser = Parser { input, pos: 0 };
    parser.skip_ws();
    let value = parser.value(0)?;
    parser.skip_ws();
    if parser.pos != input.len() {
        return Err(parser.error("trailing characters after the JSON value"));
    }
    Ok(value)
}

/// Which members of a body a fingerprint covers, named by JSON pointers (RFC 6901).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Selection<'p, P> {
    /// Everything but these members.
    Ignore(&'p [P]),
    /// Only these members (with the objects and arrays that lead to them).
    Only(&'p [P]),
}

/// The canonical form of a JSON text with `selection` applied: the members it leaves out are
/// gone before the text is written, so a body that differs only in them canonicalises to the
/// same bytes.
pub(crate) fn canonical_json_selected<P: AsRef<str>>(
    input: &[u8],
    selection: Selection<'_, P>,
) -> Result<Vec<u8>, JsonError> {
    let mut value = parse(input)?;
    let (pointers, keep_selected) = match selection {
        Selection::Ignore(pointers) => (pointers, false),
        Selection::Only(pointers) => (pointers, true),
    };
    PointerTree::of(pointers)?.select(&mut value, keep_selected);
    let mut out = Vec::with_capacity(input.len());
    value.write(&mut out);
    Ok(out)
}

/// The unescaped segments of a JSON pointer to a member (RFC 6901: `~1` is `/`, `~0` is `~`).
/// The empty pointer (the whole document) is refused: no fingerprint leaves out everything.
pub(crate) fn pointer_segments(pointer: &str) -> Result<Vec<String>, JsonError> {
    let bad = |reason| JsonError::BadPointer {
        pointer: pointer.to_owned(),
        reason,
    };
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(bad("it must start with '/'"));
    };
    rest.split('/')
        .map(|segment| {
            let mut out = String::with_capacity(segment.len());
            let mut chars = segment.chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    out.push(c);
                    continue;
                }
                match chars.next() {
                    Some('0') => out.push('~'),
                    Some('1') => out.push('/'),
                    _ => return Err(bad("'~' must be followed by 0 or 1")),
                }
            }
            Ok(out)
        })
        .collect()
}

/// Pointers merged into a tree of their segments, so one walk of the document applies them
/// all, each to the document as it was written (removing one array element does not shift
/// what another pointer names).
#[derive(Debug, Default)]
struct PointerTree {
    /// A pointer ends here: this member is selected whole.
    whole: bool,
    children: Vec<(String, PointerTree)>,
}

impl PointerTree {
    fn of<P: AsRef<str>>(pointers: &[P]) -> Result<Self, JsonError> {
        let mut root = Self::default();
        for pointer in pointers {
            let mut node = &mut root;
            for segment in pointer_segments(pointer.as_ref())? {
                let at = match node.children.iter().position(|(name, _)| *name == segment) {
                    Some(at) => at,
                    None => {
                        node.children.push((segment, Self::default()));
                        node.children.len() - 1
                    }
                };
                node = &mut node.children[at].1;
            }
            node.whole = true;
        }
        Ok(root)
    }

    fn child(&self, name: &str) -> Option<&PointerTree> {
        self.children
            .iter()
            .find(|(segment, _)| segment == name)
            .map(|(_, tree)| tree)
    }

    /// Applies the selection to `value`: with `keep_selected` (`only`) the members no pointer
    /// leads to go, without it (`ignore`) the members the pointers name go. Members on the way
    /// to a named one are visited in turn; a scalar where a pointer leads deeper stays, since a
    /// member that changed type is a different request.
    fn select(&self, value: &mut Value<'_>, keep_selected: bool) {
        let keep = |tree: Option<&PointerTree>, member: &mut Value<'_>| match tree {
            Some(tree) if tree.whole => keep_selected,
            Some(tree) => {
                tree.select(member, keep_selected);
                true
            }
            None => !keep_selected,
        };
        // A pointer names an object member by its name, an array element by its index.
        match value {
            Value::Object(members) => {
                members.retain_mut(|(name, member)| keep(self.child(name), member));
            }
            Value::Array(items) => {
                let mut index = 0usize;
                items.retain_mut(|item| {
                    let tree = self.child(&index.to_string());
                    index += 1;
                    keep(tree, item)
                });
            }
            _ => {}
        }
    }
}

enum Value<'a> {
    Literal(&'static str),
    /// The number's text exactly as written (validated against the RFC 8259 grammar).
    Number(&'a [u8]),
    String(String),
    Array(Vec<Value<'a>>),
    Object(Vec<(String, Value<'a>)>),
}

impl Value<'_> {
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Value::Literal(s) => out.extend_from_slice(s.as_bytes()),
            Value::Number(n) => out.extend_from_slice(n),
            Value::String(s) => write_string(s, out),
            Value::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.write(out);
                }
                out.push(b']');
            }
            Value::Object(members) => {
                out.push(b'{');
                for (i, (name, value)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_string(name, out);
                    out.push(b':');
                    value.write(out);
                }
                out.push(b'}');
            }
        }
    }
}

/// RFC 8785 §3.2.2.2: the ECMAScript `JSON.stringify` string form.
fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes());
            }
            c => {
                let mut buf = [0; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
}

impl<'a> Parser<'a> {
    fn error(&self, reason: &'static str) -> JsonError {
        JsonError::Syntax {
            offset: self.pos,
            reason,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn expect(&mut self, byte: u8, reason: &'static str) -> Result<(), JsonError> {
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.error(reason))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value<'a>, JsonError> {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string().map(Value::String),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b't') => self.literal("true"),
            Some(b'f') => self.literal("false"),
            Some(b'n') => self.literal("null"),
            _ => Err(self.error("expected a JSON value")),
        }
    }

    fn literal(&mut self, word: &'static str) -> Result<Value<'a>, JsonError> {
        if self.input[self.pos..].starts_with(word.as_bytes()) {
            self.pos += word.len();
            Ok(Value::Literal(word))
        } else {
            Err(self.error("expected true, false or null"))
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> Result<Value<'a>, JsonError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.error("expected a digit")),
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return Err(self.error("expected a digit after the decimal point"));
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.error("expected a digit in the exponent"));
            }
        }
        Ok(Value::Number(&self.input[start..self.pos]))
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let hex = self
            .input
            .get(self.pos..self.pos + 4)
            .ok_or_else(|| self.error("expected four hex digits"))?;
        let mut n = 0;
        for &h in hex {
            let d = (h as char)
                .to_digit(16)
                .ok_or_else(|| self.error("expected four hex digits"))?;
            n = n * 16 + d;
        }
        self.pos += 4;
        Ok(n)
    }

    fn string(&mut self) -> Result<String, JsonError> {
        self.expect(b'"', "expected a string")?;
        let mut out = String::new();
        loop {
            // Copy the longest run of plain characters at once.
            let run_start = self.pos;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            let run = std::str::from_utf8(&self.input[run_start..self.pos]).map_err(|e| {
                JsonError::Syntax {
                    offset: run_start + e.valid_up_to(),
                    reason: "invalid UTF-8 in a string",
                }
            })?;
            out.push_str(run);
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let escaped = self
                        .peek()
                        .ok_or_else(|| self.error("unterminated escape"))?;
                    self.pos += 1;
                    let c = match escaped {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode_escape()?,
                        _ => return Err(self.error("invalid escape")),
                    };
                    out.push(c);
                }
                Some(_) => return Err(self.error("control character in a string")),
                None => return Err(self.error("unterminated string")),
            }
        }
    }

    /// `\uXXXX`, joining a surrogate pair; a lone surrogate is refused (RFC 8785 needs I-JSON).
    fn unicode_escape(&mut self) -> Result<char, JsonError> {
        let first = self.hex4()?;
        let code = match first {
            0xD800..=0xDBFF => {
                if !self.input[self.pos..].starts_with(b"\\u") {
                    return Err(self.error("lone surrogate in a string"));
                }
                self.pos += 2;
                let second = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&second) {
                    return Err(self.error("lone surrogate in a string"));
                }
                0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00)
            }
            0xDC00..=0xDFFF => return Err(self.error("lone surrogate in a string")),
            c => c,
        };
        char::from_u32(code).ok_or_else(|| self.error("invalid unicode escape"))
    }

    fn array(&mut self, depth: usize) -> Result<Value<'a>, JsonError> {
        if depth > MAX_DEPTH {
            return Err(JsonError::TooDeep);
        }
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.skip_ws();
            items.push(self.value(depth)?);
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.error("expected ',' or ']'")),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value<'a>, JsonError> {
        if depth > MAX_DEPTH {
            return Err(JsonError::TooDeep);
        }
        self.pos += 1;
        let mut members: Vec<(String, Value<'a>)> = Vec::new();
        self.skip_ws();
        if self.peek() != Some(b'}') {
            loop {
                self.skip_ws();
                let name = self.string()?;
                self.skip_ws();
                self.expect(b':', "expected ':'")?;
                self.skip_ws();
                let value = self.value(depth)?;
                members.push((name, value));
                self.skip_ws();
                match self.peek() {
                    Some(b',') => self.pos += 1,
                    Some(b'}') => break,
                    _ => return Err(self.error("expected ',' or '}'")),
                }
            }
        }
        self.pos += 1;
        // RFC 8785 §3.2.3: members sorted by the UTF-16 code units of their names.
        members.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
        if let Some(pair) = members.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(JsonError::DuplicateMember {
                name: pair[0].0.clone(),
            });
        }
        Ok(Value::Object(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> Result<String, JsonError> {
        canonical_json(s.as_bytes()).map(|v| String::from_utf8(v).unwrap())
    }

    fn selected(s: &str, selection: Selection<'_, &str>) -> String {
        String::from_utf8(canonical_json_selected(s.as_bytes(), selection).unwrap()).unwrap()
    }

    #[test]
    fn ignore_removes_the_named_members_wherever_they_are() {
        let body = r#"{"b":{"trace_id":"t1","x":1},"a":[{"n":1},{"n":2,"m":3}],"c":true}"#;
        assert_eq!(
            selected(body, Selection::Ignore(&["/b/trace_id", "/a/1/m", "/c"])),
            r#"{"a":[{"n":1},{"n":2}],"b":{"x":1}}"#
        );
        // Each pointer names the document as written: removing element 0 does not make
        // element 1 the target of "/a/0".
        assert_eq!(
            selected(r#"{"a":[1,2,3]}"#, Selection::Ignore(&["/a/0", "/a/1"])),
            r#"{"a":[3]}"#
        );
        // A pointer to nothing changes nothing.
        assert_eq!(
            selected(r#"{"a":1}"#, Selection::Ignore(&["/zz/y"])),
            r#"{"a":1}"#
        );
    }

    #[test]
    fn only_keeps_the_named_members_and_the_way_to_them() {
        let body = r#"{"amount":5,"customer":{"id":"c1","name":"N"},"meta":{"t":1}}"#;
        assert_eq!(
            selected(body, Selection::Only(&["/amount", "/customer/id"])),
            r#"{"amount":5,"customer":{"id":"c1"}}"#
        );
        // A scalar where a pointer leads deeper is kept: its type changed.
        assert_eq!(
            selected(
                r#"{"customer":"c1","x":2}"#,
                Selection::Only(&["/customer/id"])
            ),
            r#"{"customer":"c1"}"#
        );
    }

    #[test]
    fn pointers_are_unescaped_and_checked() {
        assert_eq!(pointer_segments("/a~1b/c~0d/").unwrap(), ["a/b", "c~d", ""]);
        assert_eq!(
            selected(r#"{"a/b":1,"c":2}"#, Selection::Ignore(&["/a~1b"])),
            r#"{"c":2}"#
        );
        for bad in ["", "a", "/a~2", "/a~"] {
            assert!(
                matches!(pointer_segments(bad), Err(JsonError::BadPointer { .. })),
                "{bad:?}"
            );
        }
        // Duplicates are refused with a selection too.
        assert!(matches!(
            canonical_json_selected(br#"{"a":1,"a":2}"#, Selection::Ignore(&["/a"])),
            Err(JsonError::DuplicateMember { .. })
        ));
    }

    #[test]
    fn sorts_members_and_drops_whitespace() {
        assert_eq!(
            canon(" { \"b\" : 2 ,\n \"a\": {\"y\":[1, 2], \"x\": null} } ").unwrap(),
            r#"{"a":{"x":null,"y":[1,2]},"b":2}"#
        );
    }

    #[test]
    fn numbers_stay_as_written() {
        assert_eq!(canon("9007199254740993").unwrap(), "9007199254740993");
        assert_ne!(canon("9007199254740993"), canon("9007199254740992"));
        assert_ne!(canon("1"), canon("1.0"));
        assert_eq!(canon("-0.5e+10").unwrap(), "-0.5e+10");
    }

    #[test]
    fn strings_take_one_escaping_form() {
        assert_eq!(canon(r#""\u0041\/\u00e9""#).unwrap(), "\"A/é\"");
        assert_eq!(canon(r#""\u001F\n""#).unwrap(), r#""\u001f\n""#);
        assert_eq!(canon(r#""\ud83d\ude00""#).unwrap(), "\"😀\"");
    }

    #[test]
    fn sorts_by_utf16_code_units() {
        // U+FB33 sorts after U+1F600 in UTF-8 order but before it in UTF-16 (surrogates).
        assert_eq!(
            canon("{\"\u{1F600}\":1,\"\u{FB33}\":2}").unwrap(),
            "{\"\u{1F600}\":1,\"\u{FB33}\":2}"
        );
    }

    #[test]
    fn refuses_duplicates_deep_nesting_and_bad_syntax() {
        assert_eq!(
            canon(r#"{"a":1,"a":1}"#).unwrap_err(),
            JsonError::DuplicateMember { name: "a".into() }
        );
        assert_eq!(canon(&"[".repeat(10_000)).unwrap_err(), JsonError::TooDeep);
        for bad in [
            "",
            "NaN",
            "01",
            "1.",
            "-",
            "1e",
            "\"\\x\"",
            "\"\\ud800\"",
            "{\"a\"}",
            "[1,]",
            "{\"a\":1,}",
            "\u{feff}{}",
            "\"a\u{1}\"",
            "[1] 2",
            "tru",
        ] {
            assert!(
                matches!(canon(bad), Err(JsonError::Syntax { .. })),
                "{bad:?} should be a syntax error"
            );
        }
        assert!(canonical_json(b"\"\xff\"").is_err());
    }
}
