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
    let mut parser = Parser { input, pos: 0 };
    parser.skip_ws();
    let value = parser.value(0)?;
    parser.skip_ws();
    if parser.pos != input.len() {
        return Err(parser.error("trailing characters after the JSON value"));
    }
    let mut out = Vec::with_capacity(input.len());
    value.write(&mut out);
    Ok(out)
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
