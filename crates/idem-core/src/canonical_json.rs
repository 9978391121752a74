//! Canonical JSON for fingerprints: RFC 8785's member order and string form, with numbers kept
//! exactly as written.
//!
//! Written by hand because no maintained crate does all three things docs/contract.md §2 asks: RFC 8785
//! crates (`serde_json_canonicalizer`) re-serialise numbers through `f64`, which makes
//! `9007199254740993` equal `9007199254740992` and `1` equal `1.0`; `serde_json` keeps the last
//! of duplicate members silently. The parser is strict RFC 8259 with a depth limit, so hostile
//! bodies (10,000 nested arrays) fail with an error instead of overflowing the stack.
//!
//! It is on every request's path, so it is written not to copy: the text is read once into a
//! flat list of values that borrow from it (numbers, literals and strings without escapes are
//! written back exactly as they came), each object's members are sorted as it closes, and the
//! canonical form is then written into a [`Sink`], which for a fingerprint is the hash itself.

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
/// # Errors
///
/// [`JsonError::Syntax`] when `input` is not valid JSON, [`JsonError::DuplicateMember`] when an
/// object names a member twice, and [`JsonError::TooDeep`] when nesting passes [`MAX_DEPTH`].
///
/// ```
/// use idem_core::canonical_json;
/// let a = canonical_json(br#"{ "b": 2, "a": [1.0, "\u0041"] }"#)?;
/// assert_eq!(a, br#"{"a":[1.0,"A"],"b":2}"#);
/// # Ok::<(), idem_core::JsonError>(())
/// ```
pub fn canonical_json(input: &[u8]) -> Result<Vec<u8>, JsonError> {
    let canonical = Canonical::parse(input)?;
    let mut out = Vec::with_capacity(canonical.len());
    canonical.write(&mut out);
    Ok(out)
}

/// Where canonical text goes: a `Vec`, a counter, or the fingerprint's hash, which takes it
/// piece by piece so that the whole text is never built.
pub(crate) trait Sink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]);

    /// Appends one byte (punctuation: most of what is written, piece by piece).
    fn put_byte(&mut self, byte: u8) {
        self.put(&[byte]);
    }

    /// Appends `text[..len]`. `text` may go on past `len`, so that a sink can copy a short
    /// text as a fixed number of bytes, which costs less than a copy of any length.
    fn put_prefix(&mut self, text: &[u8], len: usize) {
        self.put(&text[..len]);
    }
}

impl Sink for Vec<u8> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    #[inline]
    fn put_byte(&mut self, byte: u8) {
        self.push(byte);
    }
}

/// Counts what it is given: the length of a selection's text, which a fingerprint frames the
/// text with before hashing it.
struct Counter(usize);

impl Sink for Counter {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len();
    }
}

/// Which members of a body a fingerprint covers, named by JSON pointers (RFC 6901).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Selection<'p, P> {
    /// Everything but these members.
    Ignore(&'p [P]),
    /// Only these members (with the objects and arrays that lead to them).
    Only(&'p [P]),
}

/// A JSON text read and checked, whose canonical form is then written into a [`Sink`].
pub(crate) struct Canonical<'a> {
    doc: Document<'a>,
    /// The pointers' tree and whether it keeps what it names (`only`) or leaves it out
    /// (`ignore`).
    selection: Option<(PointerTree, bool)>,
    /// The canonical form's length in bytes.
    len: usize,
}

impl<'a> Canonical<'a> {
    /// Reads `input`; every error canonical JSON can have is found here, none while writing.
    pub(crate) fn parse(input: &'a [u8]) -> Result<Self, JsonError> {
        let doc = Document::parse(input)?;
        Ok(Self {
            len: doc.len,
            doc,
            selection: None,
        })
    }

    /// Reads `input` with `selection` applied: the members it leaves out are skipped when the
    /// text is written, so a body that differs only in them has the same canonical form.
    pub(crate) fn parse_selected<P: AsRef<str>>(
        input: &'a [u8],
        selection: Selection<'_, P>,
    ) -> Result<Self, JsonError> {
        let doc = Document::parse(input)?;
        let (pointers, keep_selected) = match selection {
            Selection::Ignore(pointers) => (pointers, false),
            Selection::Only(pointers) => (pointers, true),
        };
        let tree = PointerTree::of(pointers)?;
        // What is left out is known only while writing, so the length takes a walk of its own.
        let mut counter = Counter(0);
        doc.write_selected(ROOT, &mut counter, &tree, keep_selected);
        Ok(Self {
            len: counter.0,
            doc,
            selection: Some((tree, keep_selected)),
        })
    }

    /// The canonical form's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Writes the canonical form into `out`.
    pub(crate) fn write(&self, out: &mut impl Sink) {
        match &self.selection {
            None => self.doc.write(ROOT, out),
            Some((tree, keep_selected)) => self.doc.write_selected(ROOT, out, tree, *keep_selected),
        }
    }
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
/// all, each to the document as it was written (leaving out one array element does not shift
/// what another pointer names).
#[derive(Debug, Default)]
pub(crate) struct PointerTree {
    /// A pointer ends here: this member is selected whole.
    pub(crate) whole: bool,
    children: Vec<(String, PointerTree)>,
}

impl PointerTree {
    pub(crate) fn of<P: AsRef<str>>(pointers: &[P]) -> Result<Self, JsonError> {
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

    pub(crate) fn child(&self, name: &[u8]) -> Option<&PointerTree> {
        self.children
            .iter()
            .find(|(segment, _)| segment.as_bytes() == name)
            .map(|(_, tree)| tree)
    }
}

/// The node of the document's top-level value.
const ROOT: usize = 0;

/// One value of a document. Containers are followed by their contents, so a document is a
/// flat list that borrows from its input instead of a tree of owned values.
#[derive(Debug, Clone, Copy)]
enum Node<'a> {
    /// A number, a literal, or a string without escapes: its canonical form is its text as
    /// written (a string's with its quotes), `rest[..len]`. Numbers are kept exactly as
    /// written, and a string without escapes holds nothing RFC 8785 escapes (`"`, `\` or a
    /// control character). `rest` runs on to the end of the input, so that a short text can be
    /// copied as a fixed 16 bytes (see [`Sink::put_prefix`]).
    Verbatim { rest: &'a [u8], len: usize },
    /// A string that had escapes, unescaped: bytes `start..end` of [`Document::text`].
    Unescaped { start: usize, end: usize },
    /// An array; its elements follow, up to the node at `end`.
    Array { end: usize },
    /// An object; its members follow, each a name's node and then its value's, up to the node
    /// at `end`. Its names' nodes, sorted, are `len` entries of [`Document::order`] from
    /// `members`.
    Object {
        members: usize,
        len: usize,
        end: usize,
    },
}

/// A JSON text, read: its values in input order and each object's members in canonical order.
#[derive(Debug)]
struct Document<'a> {
    nodes: Vec<Node<'a>>,
    /// The name nodes of each object, sorted, one object after another.
    order: Vec<usize>,
    /// Every string that had escapes, unescaped, one after another (one buffer for all of
    /// them, rather than a `String` each). UTF-8: the runs between escapes are checked, and
    /// the escapes are written as characters.
    text: Vec<u8>,
    /// The length of the canonical form with nothing left out.
    len: usize,
}

impl<'a> Document<'a> {
    fn parse(input: &'a [u8]) -> Result<Self, JsonError> {
        Self::read(input).map_err(|e| *e)
    }

    fn read(input: &'a [u8]) -> Parsed<Self> {
        let mut parser = Parser {
            input,
            pos: 0,
            // Room for a typical body's values (one per six bytes or so), so that the lists
            // rarely grow while the text is read.
            doc: Document {
                nodes: Vec::with_capacity(input.len() / 6 + 4),
                order: Vec::with_capacity(input.len() / 12 + 4),
                text: Vec::new(),
                len: 0,
            },
            open: Vec::with_capacity(16),
        };
        parser.skip_ws();
        parser.value(0)?;
        parser.skip_ws();
        if parser.pos != input.len() {
            return Err(parser.error("trailing characters after the JSON value"));
        }
        Ok(parser.doc)
    }

    /// The node after the value at `at` and everything in it.
    fn after(&self, at: usize) -> usize {
        match self.nodes[at] {
            Node::Array { end } | Node::Object { end, .. } => end,
            Node::Verbatim { .. } | Node::Unescaped { .. } => at + 1,
        }
    }

    /// The unescaped text of the string at `at`.
    fn string_at(&self, at: usize) -> &[u8] {
        string_at(&self.nodes, &self.text, at)
    }

    /// Writes the canonical form of the value at `at`.
    fn write(&self, at: usize, out: &mut impl Sink) {
        self.write_next(at, out);
    }

    /// Writes the canonical form of the value at `at` and returns the node after it. Most
    /// values are verbatim, and those are written without a call of their own.
    #[inline]
    fn write_next(&self, at: usize, out: &mut impl Sink) -> usize {
        match self.nodes[at] {
            Node::Verbatim { rest, len } => {
                out.put_prefix(rest, len);
                at + 1
            }
            _ => self.write_other(at, out),
        }
    }

    /// [`Document::write_next`] for what is not verbatim: strings with escapes and containers.
    fn write_other(&self, at: usize, out: &mut impl Sink) -> usize {
        match self.nodes[at] {
            Node::Verbatim { rest, len } => out.put_prefix(rest, len),
            Node::Unescaped { start, end } => write_string(&self.text[start..end], out),
            Node::Array { end } => {
                out.put_byte(b'[');
                let mut item = at + 1;
                while item < end {
                    if item > at + 1 {
                        out.put_byte(b',');
                    }
                    item = self.write_next(item, out);
                }
                out.put_byte(b']');
            }
            Node::Object { members, len, .. } => {
                out.put_byte(b'{');
                for (i, &name) in self.order[members..members + len].iter().enumerate() {
                    if i > 0 {
                        out.put_byte(b',');
                    }
                    self.write_next(name, out);
                    out.put_byte(b':');
                    self.write_next(name + 1, out);
                }
                out.put_byte(b'}');
            }
        }
        self.after(at)
    }

    /// Writes the canonical form of the value at `at` with `tree`'s selection applied to its
    /// members: with `keep_selected` (`only`) the members no pointer leads to are left out,
    /// without it (`ignore`) the members the pointers name. A pointer names an object member
    /// by its name, an array element by its index. A scalar where a pointer leads deeper
    /// stays, since a member that changed type is a different request.
    fn write_selected(
        &self,
        at: usize,
        out: &mut impl Sink,
        tree: &PointerTree,
        keep_selected: bool,
    ) {
        let mut first = true;
        match self.nodes[at] {
            Node::Array { end } => {
                out.put_byte(b'[');
                let (mut item, mut index) = (at + 1, 0usize);
                while item < end {
                    let mut digits = [0; 20];
                    let child = tree.child(decimal(index, &mut digits));
                    self.write_member(None, item, (child, keep_selected), &mut first, out);
                    item = self.after(item);
                    index += 1;
                }
                out.put_byte(b']');
            }
            Node::Object { members, len, .. } => {
                out.put_byte(b'{');
                for &name in &self.order[members..members + len] {
                    let child = tree.child(self.string_at(name));
                    let value = name + 1;
                    self.write_member(Some(name), value, (child, keep_selected), &mut first, out);
                }
                out.put_byte(b'}');
            }
            Node::Verbatim { .. } | Node::Unescaped { .. } => self.write(at, out),
        }
    }

    /// Writes one element or member (the name at `name` first, if a member) with its commas,
    /// unless the selection below its parent leaves it out.
    fn write_member(
        &self,
        name: Option<usize>,
        value: usize,
        (tree, keep_selected): (Option<&PointerTree>, bool),
        first: &mut bool,
        out: &mut impl Sink,
    ) {
        let within = match tree {
            Some(tree) if tree.whole => keep_selected.then_some(None),
            Some(tree) => Some(Some(tree)),
            None => (!keep_selected).then_some(None),
        };
        let Some(within) = within else { return };
        if !std::mem::take(first) {
            out.put_byte(b',');
        }
        if let Some(name) = name {
            self.write(name, out);
            out.put_byte(b':');
        }
        match within {
            Some(tree) => self.write_selected(value, out, tree, keep_selected),
            None => self.write(value, out),
        }
    }
}

/// The unescaped text of the string node at `at` (a name: always a string).
fn string_at<'d>(nodes: &'d [Node<'_>], text: &'d [u8], at: usize) -> &'d [u8] {
    let (run_on, len) = string_run_on(nodes, text, at);
    &run_on[..len]
}

/// The unescaped text of the string node at `at`, as `(run_on, len)`: the text is
/// `run_on[..len]`, and `run_on` goes on past it to the end of its buffer.
fn string_run_on<'d>(nodes: &'d [Node<'_>], text: &'d [u8], at: usize) -> (&'d [u8], usize) {
    match nodes[at] {
        // Without its quotes.
        Node::Verbatim { rest, len } => (&rest[1..], len - 2),
        Node::Unescaped { start, end } => (&text[start..], end - start),
        Node::Array { .. } | Node::Object { .. } => unreachable!("a member's name is a string"),
    }
}

/// `n` in decimal, as a pointer names an array element, written into `digits`.
fn decimal(mut n: usize, digits: &mut [u8; 20]) -> &[u8] {
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &digits[at..];
        }
    }
}

/// RFC 8785 §3.2.3 sorts names by their UTF-16 code units. UTF-8 bytes sort as code points
/// do, which is the same order but for one swap: U+E000..U+FFFF (lead bytes 0xEE and 0xEF)
/// come after the supplementary planes (lead bytes 0xF0 to 0xF4) in code points and before
/// them in UTF-16, which writes those as surrogates (0xD800..0xDFFF). So the bytes decide,
/// without building the UTF-16 units.
fn utf16_order(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        None => a.len().cmp(&b.len()),
        Some(i) => {
            // Equal bytes before `i` mean both characters at `i` start at the same byte, and a
            // byte of 0xEE or above is a lead byte (continuation bytes are below 0xC0).
            let (x, y) = (a[i], b[i]);
            if x >= 0xEE && y >= 0xEE && (x >= 0xF0) != (y >= 0xF0) {
                y.cmp(&x)
            } else {
                x.cmp(&y)
            }
        }
    }
}

/// RFC 8785 §3.2.2.2: the ECMAScript `JSON.stringify` string form of the UTF-8 text `bytes`.
/// Escapes are ASCII, so the text is copied in runs between the bytes that need one.
fn write_string(bytes: &[u8], out: &mut impl Sink) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.put_byte(b'"');
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let control: [u8; 6];
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..0x20 => {
                control = [
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[usize::from(b >> 4)],
                    HEX[usize::from(b & 15)],
                ];
                &control
            }
            _ => continue,
        };
        out.put(&bytes[run..i]);
        out.put(escape);
        run = i + 1;
    }
    out.put(&bytes[run..]);
    out.put_byte(b'"');
}

/// The length of [`write_string`]'s form of `bytes`.
fn string_len(bytes: &[u8]) -> usize {
    let escapes: usize = bytes
        .iter()
        .map(|&b| match b {
            b'"' | b'\\' | 0x08 | 0x0c | b'\n' | b'\r' | b'\t' => 1,
            0..0x20 => 5,
            _ => 0,
        })
        .sum();
    bytes.len() + 2 + escapes
}

/// The high bit of each byte of a word.
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// Flags (with its high bit) each byte of `word` that ends a run of plain characters: a
/// quote, a backslash or a control character. Bytes above the first flagged one (in memory
/// order) may be flagged wrongly, by a borrow; the first never is, and none is missed.
fn stop_bytes(word: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let zero_bytes = |x: u64| x.wrapping_sub(ONES) & !x & HIGH_BITS;
    let below_space = word.wrapping_sub(ONES * 0x20) & !word & HIGH_BITS;
    zero_bytes(word ^ (ONES * u64::from(b'"')))
        | zero_bytes(word ^ (ONES * u64::from(b'\\')))
        | below_space
}

/// Bytes that end a run of plain characters in a string.
const STRING_STOPS: [bool; 256] = {
    let mut stops = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        stops[b] = true;
        b += 1;
    }
    stops[b'"' as usize] = true;
    stops[b'\\' as usize] = true;
    stops
};

/// What the parser's steps return. The error is boxed so that a step's result fits in a
/// register or two: the steps run once per value, and errors are rare.
type Parsed<T = ()> = Result<T, Box<JsonError>>;

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    doc: Document<'a>,
    /// The names of the objects still open, innermost last.
    open: Vec<Name>,
}

/// A member's name while its object is open: its node, and its first bytes as a number, which
/// decide most comparisons without looking at the name itself.
#[derive(Debug, Clone, Copy)]
struct Name {
    /// The first eight bytes of the unescaped name, big-endian, padded with zeros.
    prefix: u64,
    /// `prefix` holds no byte of 0xEE or above, so where it differs from another name's
    /// prefix it sorts as the UTF-16 units do (see [`utf16_order`]).
    plain_prefix: bool,
    node: usize,
}

impl Name {
    /// The name `run_on[..len]` of the member whose name is node `node`.
    fn new(run_on: &[u8], len: usize, node: usize) -> Self {
        // Eight bytes at once where the buffer has them, the bytes past the name masked off.
        let prefix = match run_on.first_chunk::<8>() {
            Some(first) if len >= 8 => u64::from_be_bytes(*first),
            Some(first) => u64::from_be_bytes(*first) & !(u64::MAX >> (8 * len)),
            None => run_on[..len]
                .iter()
                .zip((0..8).rev())
                .fold(0, |prefix, (&b, place)| {
                    prefix | u64::from(b) << (8 * place)
                }),
        };
        // A byte is 0xEE or above when it has its high bit and its low seven bits plus 0x12
        // reach 0x80 (which never carries into the next byte).
        let low = prefix & !HIGH_BITS;
        let above_ed = (low + 0x1212_1212_1212_1212) & prefix & HIGH_BITS;
        Self {
            prefix,
            plain_prefix: above_ed == 0,
            node,
        }
    }
}

impl<'a> Parser<'a> {
    #[cold]
    fn error(&self, reason: &'static str) -> Box<JsonError> {
        Box::new(JsonError::Syntax {
            offset: self.pos,
            reason,
        })
    }

    #[inline]
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    #[inline]
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    #[inline]
    fn expect(&mut self, byte: u8, reason: &'static str) -> Parsed {
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.error(reason))
        }
    }

    /// Adds a value whose canonical form is `input[start..self.pos]`.
    #[inline]
    fn verbatim(&mut self, start: usize) {
        let len = self.pos - start;
        self.doc.len += len;
        let rest = &self.input[start..];
        self.doc.nodes.push(Node::Verbatim { rest, len });
    }

    fn value(&mut self, depth: usize) -> Parsed {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string(),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b't') => self.literal("true"),
            Some(b'f') => self.literal("false"),
            Some(b'n') => self.literal("null"),
            _ => Err(self.error("expected a JSON value")),
        }
    }

    fn literal(&mut self, word: &'static str) -> Parsed {
        if self.input[self.pos..].starts_with(word.as_bytes()) {
            let start = self.pos;
            self.pos += word.len();
            self.verbatim(start);
            Ok(())
        } else {
            Err(self.error("expected true, false or null"))
        }
    }

    #[inline]
    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> Parsed {
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
        self.verbatim(start);
        Ok(())
    }

    fn hex4(&mut self) -> Parsed<u32> {
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

    /// Moves past the longest run of plain characters (up to a quote, a backslash, a control
    /// character or the end) and checks that it is UTF-8.
    #[inline(always)]
    fn plain_run(&mut self) -> Parsed<&'a [u8]> {
        let start = self.pos;
        // Eight bytes at a time while the run goes on and is ASCII, which needs no UTF-8
        // check (most strings are short, and most of their bytes ASCII).
        while let Some(chunk) = self.input.get(self.pos..).and_then(<[u8]>::first_chunk) {
            let word = u64::from_le_bytes(*chunk);
            let stops = stop_bytes(word) | (word & HIGH_BITS);
            if stops != 0 {
                // The lowest flagged byte is the first stop or non-ASCII byte (see
                // stop_bytes).
                self.pos += stops.trailing_zeros() as usize / 8;
                if self.input[self.pos] < 0x80 {
                    return Ok(&self.input[start..self.pos]);
                }
                break;
            }
            self.pos += 8;
        }
        self.rest_of_run(start)
    }

    /// The rest of [`Parser::plain_run`]'s run, a byte at a time, and its UTF-8 check.
    #[inline(never)]
    fn rest_of_run(&mut self, start: usize) -> Parsed<&'a [u8]> {
        while let Some(&b) = self.input.get(self.pos) {
            if STRING_STOPS[usize::from(b)] {
                break;
            }
            self.pos += 1;
        }
        let run = &self.input[start..self.pos];
        if let Err(e) = std::str::from_utf8(run) {
            return Err(Box::new(JsonError::Syntax {
                offset: start + e.valid_up_to(),
                reason: "invalid UTF-8 in a string",
            }));
        }
        Ok(run)
    }

    /// A string. One without escapes (most are) stays in the input; one with escapes is
    /// unescaped into the document's text.
    #[inline]
    fn string(&mut self) -> Parsed {
        self.expect(b'"', "expected a string")?;
        let start = self.pos - 1;
        let first = self.plain_run()?;
        match self.peek() {
            Some(b'"') => {
                self.pos += 1;
                self.verbatim(start);
                Ok(())
            }
            Some(b'\\') => self.unescape(first),
            Some(_) => Err(self.error("control character in a string")),
            None => Err(self.error("unterminated string")),
        }
    }

    /// The rest of a string that has escapes, from its first backslash, after `first`.
    fn unescape(&mut self, first: &[u8]) -> Parsed {
        if self.doc.text.capacity() == 0 {
            // Unescaped text is never longer than its source, so this is room for every
            // string still to come: the buffer is allocated once, and only if it is needed.
            self.doc
                .text
                .reserve(first.len() + self.input.len() - self.pos);
        }
        let start = self.doc.text.len();
        self.doc.text.extend_from_slice(first);
        loop {
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    break;
                }
                Some(b'\\') => {
                    let c = self.escape()?;
                    let mut utf8 = [0; 4];
                    let c = c.encode_utf8(&mut utf8);
                    self.doc.text.extend_from_slice(c.as_bytes());
                }
                Some(_) => return Err(self.error("control character in a string")),
                None => return Err(self.error("unterminated string")),
            }
            let run = self.plain_run()?;
            self.doc.text.extend_from_slice(run);
        }
        let end = self.doc.text.len();
        self.doc.len += string_len(&self.doc.text[start..]);
        self.doc.nodes.push(Node::Unescaped { start, end });
        Ok(())
    }

    /// One escape sequence, from its backslash.
    fn escape(&mut self) -> Parsed<char> {
        self.pos += 1;
        let escaped = self
            .peek()
            .ok_or_else(|| self.error("unterminated escape"))?;
        self.pos += 1;
        Ok(match escaped {
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
        })
    }

    /// `\uXXXX`, joining a surrogate pair; a lone surrogate is refused (RFC 8785 needs I-JSON).
    fn unicode_escape(&mut self) -> Parsed<char> {
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

    /// Steps into an array or object at `depth`, past its opening bracket: the index of its
    /// node, a placeholder until the container's end is known.
    fn open_container(&mut self, depth: usize) -> Parsed<usize> {
        if depth > MAX_DEPTH {
            return Err(Box::new(JsonError::TooDeep));
        }
        let at = self.doc.nodes.len();
        self.doc.nodes.push(Node::Array { end: at });
        self.pos += 1;
        Ok(at)
    }

    fn array(&mut self, depth: usize) -> Parsed {
        let at = self.open_container(depth)?;
        let mut count = 0usize;
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
        } else {
            loop {
                self.skip_ws();
                self.value(depth)?;
                count += 1;
                self.skip_ws();
                match self.peek() {
                    Some(b',') => self.pos += 1,
                    Some(b']') => {
                        self.pos += 1;
                        break;
                    }
                    _ => return Err(self.error("expected ',' or ']'")),
                }
            }
        }
        // Brackets and the commas between elements.
        self.doc.len += 2 + count.saturating_sub(1);
        self.doc.nodes[at] = Node::Array {
            end: self.doc.nodes.len(),
        };
        Ok(())
    }

    fn object(&mut self, depth: usize) -> Parsed {
        let at = self.open_container(depth)?;
        let first = self.open.len();
        self.skip_ws();
        if self.peek() != Some(b'}') {
            loop {
                self.skip_ws();
                let node = self.doc.nodes.len();
                self.string()?;
                let (run_on, len) = string_run_on(&self.doc.nodes, &self.doc.text, node);
                let name = Name::new(run_on, len, node);
                self.skip_ws();
                self.expect(b':', "expected ':'")?;
                self.skip_ws();
                self.value(depth)?;
                self.open.push(name);
                self.skip_ws();
                match self.peek() {
                    Some(b',') => self.pos += 1,
                    Some(b'}') => break,
                    _ => return Err(self.error("expected ',' or '}'")),
                }
            }
        }
        self.pos += 1;
        self.close_object(at, first)
    }

    /// Sorts the members of the object at `at` (those in `open` from `first`), refuses a
    /// duplicate, and records their order.
    fn close_object(&mut self, at: usize, first: usize) -> Parsed {
        let Document {
            nodes,
            order,
            text,
            len: doc_len,
        } = &mut self.doc;
        let names = &mut self.open[first..];
        let bytes = |name: &Name| string_at(nodes, text, name.node);
        names.sort_unstable_by(|a, b| {
            if a.prefix != b.prefix && (a.plain_prefix || b.plain_prefix) {
                a.prefix.cmp(&b.prefix)
            } else {
                utf16_order(bytes(a), bytes(b))
            }
        });
        if let Some(pair) = names
            .windows(2)
            .find(|w| w[0].prefix == w[1].prefix && bytes(&w[0]) == bytes(&w[1]))
        {
            return Err(Box::new(JsonError::DuplicateMember {
                name: String::from_utf8_lossy(bytes(&pair[0])).into_owned(),
            }));
        }
        let (members, len) = (order.len(), names.len());
        order.extend(names.iter().map(|name| name.node));
        // Braces, a colon per member and the commas between them.
        *doc_len += 2 + len + len.saturating_sub(1);
        nodes[at] = Node::Object {
            members,
            len,
            end: nodes.len(),
        };
        self.open.truncate(first);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> Result<String, JsonError> {
        canonical_json(s.as_bytes()).map(|v| String::from_utf8(v).unwrap())
    }

    /// The canonical form of `input` with `selection` applied, as a fingerprint hashes it.
    fn canonical_json_selected<P: AsRef<str>>(
        input: &[u8],
        selection: Selection<'_, P>,
    ) -> Result<Vec<u8>, JsonError> {
        let canonical = Canonical::parse_selected(input, selection)?;
        let mut out = Vec::new();
        canonical.write(&mut out);
        assert_eq!(out.len(), canonical.len());
        Ok(out)
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

    /// The fast writer against the one it replaced (kept in `canonical_json_reference`):
    /// the same bytes for every text, and the same error (kind, offset, reason, name) for
    /// every text that is not canonical JSON. The `canonical_json` fuzz target compares it
    /// with serde_json besides, where nightly is at hand (scripts/fuzz.sh).
    mod against_the_reference {
        use super::*;
        use crate::canonical_json_reference::{self as reference, texts};
        use proptest::prelude::*;

        fn same(input: &[u8]) -> Result<(), TestCaseError> {
            let canonical = canonical_json(input);
            prop_assert_eq!(
                &canonical,
                &reference::canonical_json(input),
                "{:?}",
                String::from_utf8_lossy(input)
            );
            if let Ok(canonical) = canonical {
                prop_assert_eq!(canonical_json(&canonical), Ok(canonical.clone()));
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn generated_texts(text in texts::json()) {
                same(text.as_bytes())?;
            }

            #[test]
            fn damaged_texts(bytes in texts::damaged()) {
                same(&bytes)?;
            }

            #[test]
            fn any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..48)) {
                same(&bytes)?;
            }

            #[test]
            fn selections(text in texts::json(), pointers in texts::pointers()) {
                let pointers: Vec<&str> = pointers.iter().map(String::as_str).collect();
                for selection in [Selection::Ignore(&pointers[..]), Selection::Only(&pointers[..])] {
                    prop_assert_eq!(
                        canonical_json_selected(text.as_bytes(), selection),
                        reference::canonical_json_selected(text.as_bytes(), selection),
                        "{:?} {:?}", text, pointers
                    );
                }
            }
        }

        /// Fewer cases than the others: each deep text is long.
        #[test]
        fn deep_texts() {
            let mut runner =
                proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(200));
            runner
                .run(&texts::deep(), |text| same(text.as_bytes()))
                .unwrap();
        }

        #[test]
        fn the_fuzz_seeds() {
            let dir = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../fuzz/corpus/canonical_json"
            );
            let seeds = std::fs::read_dir(dir).expect("the fuzz corpus");
            for seed in seeds {
                let bytes = std::fs::read(seed.expect("a seed").path()).expect("a readable seed");
                same(&bytes).unwrap();
            }
        }

        /// Generated texts are mostly canonical JSON, so that the comparison covers output
        /// and not only errors.
        #[test]
        fn most_generated_texts_are_valid() {
            use proptest::strategy::ValueTree;
            use proptest::test_runner::TestRunner;
            let mut runner = TestRunner::deterministic();
            let strategy = texts::json();
            let valid = (0..500)
                .filter(|_| {
                    let text = strategy.new_tree(&mut runner).unwrap().current();
                    canonical_json(text.as_bytes()).is_ok()
                })
                .count();
            assert!(valid > 250, "{valid} of 500");
        }
    }
}
