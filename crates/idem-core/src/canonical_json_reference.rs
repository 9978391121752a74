//! The canonical JSON writer as it was before it was made fast: a tree of owned values, sorted
//! and written into a `Vec`. Kept only so tests can compare the fast one with it, byte for byte
//! and error for error; nothing else should use it.

use crate::canonical_json::{JsonError, MAX_DEPTH, PointerTree, Selection};

/// The canonical form of `input`, the way it was computed before.
pub(crate) fn canonical_json(input: &[u8]) -> Result<Vec<u8>, JsonError> {
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

/// The canonical form of `input` with `selection` applied, the way it was computed before.
pub(crate) fn canonical_json_selected<P: AsRef<str>>(
    input: &[u8],
    selection: Selection<'_, P>,
) -> Result<Vec<u8>, JsonError> {
    let mut value = parse(input)?;
    let (pointers, keep_selected) = match selection {
        Selection::Ignore(pointers) => (pointers, false),
        Selection::Only(pointers) => (pointers, true),
    };
    select(&PointerTree::of(pointers)?, &mut value, keep_selected);
    let mut out = Vec::with_capacity(input.len());
    value.write(&mut out);
    Ok(out)
}

/// Applies the selection to `value`: with `keep_selected` (`only`) the members no pointer
/// leads to go, without it (`ignore`) the members the pointers name go. Members on the way
/// to a named one are visited in turn; a scalar where a pointer leads deeper stays, since a
/// member that changed type is a different request.
fn select(tree: &PointerTree, value: &mut Value<'_>, keep_selected: bool) {
    let keep = |tree: Option<&PointerTree>, member: &mut Value<'_>| match tree {
        Some(tree) if tree.whole => keep_selected,
        Some(tree) => {
            select(tree, member, keep_selected);
            true
        }
        None => !keep_selected,
    };
    // A pointer names an object member by its name, an array element by its index.
    match value {
        Value::Object(members) => {
            members.retain_mut(|(name, member)| keep(tree.child(name.as_bytes()), member));
        }
        Value::Array(items) => {
            let mut index = 0usize;
            items.retain_mut(|item| {
                let child = tree.child(index.to_string().as_bytes());
                index += 1;
                keep(child, item)
            });
        }
        _ => {}
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

/// JSON texts for comparing the two: escapes of every kind, characters on both sides of the
/// UTF-16 swap, numbers as clients write them (`1.0`, `-0`, `1e5`), names from a small set so
/// that objects often repeat one (spelled the same or escaped), and any whitespace.
pub(crate) mod texts {
    use proptest::prelude::*;
    use proptest::sample::select;

    fn whitespace() -> impl Strategy<Value = &'static str> + Clone {
        select(vec!["", "", " ", "\n", "\t", "\r\n  "])
    }

    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            "-?(0|[1-9][0-9]{0,19})(\\.[0-9]{1,4})?([eE][+-]?[0-9]{1,3})?",
            select(vec![
                "1.0",
                "-0",
                "1e5",
                "0.0",
                "-0.0",
                "1E+2",
                "9007199254740993"
            ])
            .prop_map(str::to_owned),
        ]
    }

    /// A character as `\uXXXX` (a surrogate pair above the BMP), in either case.
    fn escaped(c: char, upper: bool) -> String {
        let mut units = [0; 2];
        c.encode_utf16(&mut units)
            .iter()
            .map(|u| {
                let hex = format!("\\u{u:04x}");
                if upper {
                    hex.to_uppercase().replace("\\U", "\\u")
                } else {
                    hex
                }
            })
            .collect()
    }

    /// A piece of a string's text, as written inside its quotes.
    fn piece() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => "[a-zA-Z0-9 ]{1,6}",
            2 => select(vec!["é", "😀", "\u{FB33}", "\u{E000}", "\u{FFFF}", "\u{10000}",
                             "\u{7f}", "\u{2028}", "/", "~"])
                .prop_map(str::to_owned),
            2 => select(vec![r#"\""#, r"\\", r"\/", r"\b", r"\f", r"\n", r"\r", r"\t",
                             r"\u0000", r"\u001f", r"\u001F", r"\u0041", r"\u00e9",
                             r"\uFB33", r"\ud83d\ude00", r"\uDBFF\uDFFF", r"\u20AC"])
                .prop_map(str::to_owned),
            1 => (any::<char>(), any::<bool>()).prop_map(|(c, upper)| escaped(c, upper)),
            1 => any::<char>().prop_map(String::from),
        ]
    }

    fn string() -> impl Strategy<Value = String> {
        prop::collection::vec(piece(), 0..5).prop_map(|pieces| format!("\"{}\"", pieces.concat()))
    }

    /// A member name: mostly from a few, written plainly or escaped, so duplicates happen.
    fn name() -> impl Strategy<Value = String> {
        let few = select(vec![
            "a", "b", "A", "aa", "ab", "", "é", "😀", "\u{FB33}", "\u{E000}",
        ]);
        prop_oneof![
            3 => (few, any::<bool>()).prop_map(|(name, escape)| if escape {
                format!("\"{}\"", name.chars().map(|c| escaped(c, false)).collect::<String>())
            } else {
                format!("\"{name}\"")
            }),
            1 => string(),
        ]
    }

    /// A JSON text (valid, but for the rare duplicate member).
    pub(crate) fn json() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            select(vec!["true", "false", "null"]).prop_map(str::to_owned),
            number(),
            string(),
        ];
        let value = leaf.prop_recursive(6, 64, 6, |inner| {
            let spaced =
                (whitespace(), inner, whitespace()).prop_map(|(a, v, b)| format!("{a}{v}{b}"));
            prop_oneof![
                prop::collection::vec(spaced.clone(), 0..6)
                    .prop_map(|items| format!("[{}]", items.join(","))),
                prop::collection::vec((name(), whitespace(), spaced), 0..6).prop_map(|members| {
                    let members: Vec<String> = members
                        .into_iter()
                        .map(|(name, ws, value)| format!("{name}{ws}:{value}"))
                        .collect();
                    format!("{{{}}}", members.join(","))
                }),
            ]
        });
        (whitespace(), value, whitespace()).prop_map(|(a, v, b)| format!("{a}{v}{b}"))
    }

    /// A JSON text inside `depth` arrays or objects (around the depth limit, 128).
    pub(crate) fn deep() -> impl Strategy<Value = String> {
        (118usize..=138, json(), any::<u64>()).prop_map(|(depth, inner, mut bits)| {
            let (mut open, mut close) = (String::new(), String::new());
            for _ in 0..depth {
                if bits & 1 == 0 {
                    open.push('[');
                    close.insert(0, ']');
                } else {
                    open.push_str("{\"a\":");
                    close.insert(0, '}');
                }
                bits = bits.rotate_right(1);
            }
            format!("{open}{inner}{close}")
        })
    }

    /// `text` with a few bytes deleted, inserted or replaced, and maybe cut short: mostly not
    /// JSON any more, so the errors (kind, offset, reason) are compared too.
    pub(crate) fn damaged() -> impl Strategy<Value = Vec<u8>> {
        let byte = select(vec![
            b'"', b'\\', b',', b'}', b']', b'{', b'[', b':', b' ', b'u', b'0', b'e', b'.', b'-',
            0x01, 0x1f, 0xff, 0xc3, 0xed, 0xf0, 0x80,
        ]);
        let edit = (0usize..3, any::<prop::sample::Index>(), byte);
        (
            json(),
            prop::collection::vec(edit, 1..4),
            any::<Option<prop::sample::Index>>(),
        )
            .prop_map(|(text, edits, cut)| {
                let mut bytes = text.into_bytes();
                for (kind, at, byte) in edits {
                    let at = at.index(bytes.len() + 1);
                    match kind {
                        0 if at < bytes.len() => drop(bytes.remove(at)),
                        1 if at < bytes.len() => bytes[at] = byte,
                        _ => bytes.insert(at, byte),
                    }
                }
                if let Some(cut) = cut {
                    bytes.truncate(cut.index(bytes.len() + 1));
                }
                bytes
            })
    }

    /// Pointers into texts from [`json`]: its names and indices, and some malformed ones.
    pub(crate) fn pointers() -> impl Strategy<Value = Vec<String>> {
        let segment = select(vec![
            "a", "b", "A", "aa", "", "é", "😀", "0", "1", "2", "01", "~0", "~1",
        ]);
        let pointer = prop_oneof![
            9 => prop::collection::vec(segment, 1..4).prop_map(|s| format!("/{}", s.join("/"))),
            1 => select(vec!["", "a", "/a~2", "/~"]).prop_map(str::to_owned),
        ];
        prop::collection::vec(pointer, 0..4)
    }
}
