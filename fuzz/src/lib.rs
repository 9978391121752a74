//! Helpers shared by the fuzz targets: a JSON tree read by serde_json (independent of idem's
//! own parser) that writes itself back in any equivalent spelling, and a small deterministic
//! RNG so a crashing input replays exactly.

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use std::fmt::Write as _;

/// SplitMix64, seeded from the input: the same input always scrambles the same way.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeds from the bytes of the fuzz input (FNV-1a).
    pub fn from_input(input: &[u8]) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in input {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        Self(h)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number below `n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// A JSON value with each number's text kept exactly as written, and members in input order.
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    /// `true`, `false`, `null`, or a number, as written.
    Atom(String),
    /// A string, unescaped.
    String(String),
    /// An array.
    Array(Vec<Json>),
    /// An object's members in input order.
    Object(Vec<(String, Json)>),
}

/// An object's members in order, duplicates kept (serde_json's own maps would merge them).
struct Members(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, Box<RawValue>>()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V)
    }
}

impl Json {
    /// Reads a JSON text with serde_json. Each level is parsed on its own from its raw text,
    /// so serde_json's recursion limit never applies across levels and numbers stay verbatim.
    pub fn parse(text: &[u8]) -> Result<Self, serde_json::Error> {
        let raw: Box<RawValue> = serde_json::from_slice(text)?;
        Self::from_raw(&raw)
    }

    fn from_raw(raw: &RawValue) -> Result<Self, serde_json::Error> {
        let text = raw.get();
        Ok(match text.as_bytes()[0] {
            b'{' => Json::Object(
                serde_json::from_str::<Members>(text)?
                    .0
                    .into_iter()
                    .map(|(name, value)| Ok((name, Self::from_raw(&value)?)))
                    .collect::<Result<_, serde_json::Error>>()?,
            ),
            b'[' => Json::Array(
                serde_json::from_str::<Vec<Box<RawValue>>>(text)?
                    .iter()
                    .map(|item| Self::from_raw(item))
                    .collect::<Result<_, _>>()?,
            ),
            b'"' => Json::String(serde_json::from_str(text)?),
            _ => Json::Atom(text.to_owned()),
        })
    }

    /// Writes the value plainly: members in their order, no whitespace, minimal escapes.
    pub fn write_plain(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, &mut None);
        out
    }

    /// Writes an equivalent JSON text as another client might: members shuffled, whitespace
    /// between any two tokens, each character of a string escaped in any valid way.
    pub fn write_scrambled(&self, rng: &mut Rng) -> String {
        let mut out = String::new();
        let mut rng = Some(rng);
        ws(&mut out, &mut rng);
        self.write(&mut out, &mut rng);
        ws(&mut out, &mut rng);
        out
    }

    fn write(&self, out: &mut String, rng: &mut Option<&mut Rng>) {
        match self {
            Json::Atom(text) => out.push_str(text),
            Json::String(s) => string(s, out, rng),
            Json::Array(items) => {
                out.push('[');
                ws(out, rng);
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                        ws(out, rng);
                    }
                    item.write(out, rng);
                    ws(out, rng);
                }
                out.push(']');
            }
            Json::Object(members) => {
                let mut order: Vec<usize> = (0..members.len()).collect();
                if let Some(rng) = rng.as_deref_mut() {
                    for i in (1..order.len()).rev() {
                        order.swap(i, rng.below(i + 1));
                    }
                }
                out.push('{');
                ws(out, rng);
                for (i, &m) in order.iter().enumerate() {
                    let (name, value) = &members[m];
                    if i > 0 {
                        out.push(',');
                        ws(out, rng);
                    }
                    string(name, out, rng);
                    ws(out, rng);
                    out.push(':');
                    ws(out, rng);
                    value.write(out, rng);
                    ws(out, rng);
                }
                out.push('}');
            }
        }
    }

    /// Changes one leaf (or fills one empty container), chosen by `rng`, so the value differs.
    pub fn mutate_one(&mut self, rng: &mut Rng) {
        match self {
            Json::Atom(text) => {
                *text = match text.as_str() {
                    "true" => "false".into(),
                    "false" => "true".into(),
                    "null" => "0".into(),
                    "0" => "1".into(),
                    _ => "0".into(),
                }
            }
            Json::String(s) => s.push('x'),
            Json::Array(items) if items.is_empty() => items.push(Json::Atom("null".into())),
            Json::Array(items) => {
                let i = rng.below(items.len());
                items[i].mutate_one(rng);
            }
            Json::Object(members) if members.is_empty() => {
                members.push((String::new(), Json::Atom("null".into())));
            }
            Json::Object(members) => {
                let i = rng.below(members.len());
                members[i].1.mutate_one(rng);
            }
        }
    }
}

/// Optional whitespace: nothing when writing plainly, else any mix of the four JSON spaces.
fn ws(out: &mut String, rng: &mut Option<&mut Rng>) {
    let Some(rng) = rng.as_deref_mut() else {
        return;
    };
    for _ in 0..rng.below(3) {
        out.push([' ', '\t', '\n', '\r'][rng.below(4)]);
    }
}

fn string(s: &str, out: &mut String, rng: &mut Option<&mut Rng>) {
    out.push('"');
    for c in s.chars() {
        let choice = rng.as_deref_mut().map_or(0, |rng| rng.below(4));
        match (c, choice) {
            ('"', 0 | 1) => out.push_str("\\\""),
            ('\\', 0 | 1) => out.push_str("\\\\"),
            ('/', 1) => out.push_str("\\/"),
            ('\u{8}', 0 | 1) => out.push_str("\\b"),
            ('\u{c}', 0 | 1) => out.push_str("\\f"),
            ('\n', 0 | 1) => out.push_str("\\n"),
            ('\r', 0 | 1) => out.push_str("\\r"),
            ('\t', 0 | 1) => out.push_str("\\t"),
            (c, 0 | 1) if (c as u32) >= 0x20 => out.push(c),
            // \uXXXX for anything (a surrogate pair above the BMP), in either hex case.
            (c, choice) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    if choice == 3 {
                        let _ = write!(out, "\\u{unit:04X}");
                    } else {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
            }
        }
    }
    out.push('"');
}

/// A current-thread runtime and a `SqliteStore` on a fresh temporary file, for the targets
/// that drive the layer. Built once per target: opening SQLite and migrating per input would
/// dominate the run. The directory must outlive every call (scripts/fuzz.sh removes its
/// TMPDIR afterwards).
pub fn sqlite_harness() -> (
    tokio::runtime::Runtime,
    idem_store::SqliteStore,
    tempfile::TempDir,
) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = runtime
        .block_on(idem_store::SqliteStore::open(dir.path().join("fuzz.db")))
        .expect("SqliteStore opens");
    (runtime, store, dir)
}
