//! The gateway's configuration file (`idem proxy --config FILE.toml`, docs/contract.md §10):
//! parsed with serde, then validated into typed [`RouteRules`], every error naming its line.
//!
//! ```
//! use idem_gateway::{ConfigFile, RouteRules};
//! let file = ConfigFile::parse(r#"
//! upstream = "http://127.0.0.1:3000"
//! [[route]]
//! match = "POST /webhooks/stripe"
//! key_from = "body:/id"
//! "#)?;
//! let routes = file.routes(&RouteRules::default());
//! assert_eq!(routes.len(), 1);
//! # Ok::<(), idem_gateway::ConfigError>(())
//! ```

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::time::Duration;

use http::{HeaderName, Uri};
use idem_core::{ErrorDialect, Fingerprint};
use serde::Deserialize;
use toml::Spanned;

use crate::credential::{Anonymous, Credential};
use crate::duration::{display_duration, parse_duration};
use crate::routes::{RouteError, RoutePattern};
use crate::wake::InFlight;

/// A configuration file that is not valid, with the line where it went wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ConfigError {
    /// The line (from 1) of the value at fault.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// Whether a route's requests need a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyRule {
    /// A covered request without a key is refused with `400 missing-key`.
    Required,
    /// A request without a key passes through unprotected.
    Optional,
    /// The route passes through untouched: no key is read, no body buffered.
    Off,
}

/// Where a route's key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyFrom {
    /// The first of these headers present; two present is `400 malformed-key`.
    Headers(Vec<HeaderName>),
    /// The string at this JSON pointer in the body (an inbound webhook's event id).
    Body(String),
}

impl Default for KeyFrom {
    fn default() -> Self {
        Self::Headers(vec![HeaderName::from_static("idempotency-key")])
    }
}

/// What of a JSON body the fingerprint covers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum FingerprintRule {
    /// All of it.
    #[default]
    Whole,
    /// All but the members at these JSON pointers.
    Ignore(Vec<String>),
    /// Only the members at these JSON pointers.
    Only(Vec<String>),
}

/// The rules one route applies, every default filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRules {
    /// Whether a key is needed.
    pub key: KeyRule,
    /// Where the key comes from.
    pub key_from: KeyFrom,
    /// Headers HMACed with the credential into the scope (the credential header itself is
    /// always part of it and not listed here).
    pub scope_headers: Vec<HeaderName>,
    /// What a covered request without the credential gets. A route read from a file with
    /// `key_from` (an inbound webhook) is [`Anonymous::Route`] unless it says otherwise;
    /// routes made in code say so themselves.
    pub anonymous: Anonymous,
    /// What of the body the fingerprint covers.
    pub fingerprint: FingerprintRule,
    /// What a duplicate of a running request gets.
    pub in_flight: InFlight,
    /// Upstream response headers stored and replayed besides `Content-Type` and `Location`.
    pub store_headers: Vec<HeaderName>,
    /// How idem's own problem bodies are written.
    pub errors: ErrorDialect,
    /// How long a key is remembered.
    pub retention: Duration,
}

impl Default for RouteRules {
    /// The gateway's built-in defaults (those of [`crate::GatewayConfig::new`]).
    fn default() -> Self {
        Self {
            key: KeyRule::Required,
            key_from: KeyFrom::default(),
            scope_headers: Vec::new(),
            anonymous: Anonymous::Refuse,
            fingerprint: FingerprintRule::Whole,
            in_flight: InFlight::Refuse,
            store_headers: Vec::new(),
            errors: ErrorDialect::Problem,
            retention: Duration::from_secs(24 * 60 * 60),
        }
    }
}

/// One `[[route]]`: the requests it matches and its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Which requests it takes.
    pub pattern: RoutePattern,
    /// What it does with them.
    pub rules: RouteRules,
    /// Where it is in the file (0 for a route made in code).
    pub line: usize,
}

/// The top-level values of a file: the defaults every route inherits (and that apply to a
/// request no route matches). `None` leaves the value as it was.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Defaults {
    /// `key`.
    pub key: Option<KeyRule>,
    /// `scope_headers`, the credential header left out.
    pub scope_headers: Option<Vec<HeaderName>>,
    /// `anonymous`.
    pub anonymous: Option<Anonymous>,
    /// `store_headers`.
    pub store_headers: Option<Vec<HeaderName>>,
    /// `errors`.
    pub errors: Option<ErrorDialect>,
    /// `retention`.
    pub retention: Option<Duration>,
    /// `in_flight`.
    pub in_flight: Option<InFlight>,
}

impl Defaults {
    /// Overlays the values given on `rules`.
    pub fn apply(&self, rules: &mut RouteRules) {
        // The top level sets no key source and no fingerprint.
        let given = Overrides {
            key: self.key,
            scope_headers: self.scope_headers.clone(),
            anonymous: self.anonymous,
            store_headers: self.store_headers.clone(),
            errors: self.errors,
            retention: self.retention,
            in_flight: self.in_flight,
            ..Overrides::default()
        };
        given.apply(rules);
    }
}

/// Rules as the file writes them, at the top level or in a route: each `None` leaves the rule
/// as it was.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Overrides {
    key: Option<KeyRule>,
    key_from: Option<KeyFrom>,
    scope_headers: Option<Vec<HeaderName>>,
    anonymous: Option<Anonymous>,
    fingerprint: Option<FingerprintRule>,
    in_flight: Option<InFlight>,
    store_headers: Option<Vec<HeaderName>>,
    errors: Option<ErrorDialect>,
    retention: Option<Duration>,
}

impl Overrides {
    /// Overlays the rules given on `rules`.
    fn apply(&self, rules: &mut RouteRules) {
        fn overlay<T: Clone>(value: &mut T, given: &Option<T>) {
            if let Some(given) = given {
                *value = given.clone();
            }
        }
        overlay(&mut rules.key, &self.key);
        overlay(&mut rules.key_from, &self.key_from);
        overlay(&mut rules.scope_headers, &self.scope_headers);
        overlay(&mut rules.anonymous, &self.anonymous);
        overlay(&mut rules.fingerprint, &self.fingerprint);
        overlay(&mut rules.in_flight, &self.in_flight);
        overlay(&mut rules.store_headers, &self.store_headers);
        overlay(&mut rules.errors, &self.errors);
        overlay(&mut rules.retention, &self.retention);
    }
}

/// A route as written: its rules inherit from the defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RouteDraft {
    pattern: RoutePattern,
    line: usize,
    rules: Overrides,
}

/// A parsed and validated configuration file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigFile {
    /// `listen`.
    pub listen: Option<SocketAddr>,
    /// `upstream`.
    pub upstream: Option<Uri>,
    /// `store` (a store URL, checked when it is opened).
    pub store: Option<String>,
    /// `credential`: where the caller's credential is (`header:NAME`, `cookie:NAME`).
    pub credential: Option<Credential>,
    /// The top-level rules.
    pub defaults: Defaults,
    routes: Vec<RouteDraft>,
}

impl ConfigFile {
    /// Parses and validates `text`: unknown keys, bad values, and routes that can never match
    /// are errors with their line.
    ///
    /// # Errors
    ///
    /// [`ConfigError`], with the line at fault, when `text` is not valid TOML, a key is
    /// unknown, a value is invalid, or a route can never match.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let raw: RawFile = toml::from_str(text).map_err(|e| ConfigError {
            line: e.span().map_or(1, |span| line_of(text, span.start)),
            message: e.message().to_owned(),
        })?;
        let at = |span: Range<usize>, message: String| ConfigError {
            line: line_of(text, span.start),
            message,
        };
        let mut file = Self {
            listen: spanned(raw.listen, |s| {
                s.parse().map_err(|e| format!("listen: {e}"))
            })
            .map_err(|(span, m)| at(span, m))?,
            upstream: spanned(raw.upstream, |s| parse_upstream(&s))
                .map_err(|(span, m)| at(span, m))?,
            store: raw.store,
            credential: spanned(raw.credential, |s| s.parse::<Credential>())
                .map_err(|(s, m)| at(s, m))?,
            defaults: Defaults {
                key: raw.key,
                scope_headers: header_list(raw.scope_headers).map_err(|(s, m)| at(s, m))?,
                anonymous: parse_anonymous(raw.anonymous).map_err(|(s, m)| at(s, m))?,
                store_headers: header_list(raw.store_headers).map_err(|(s, m)| at(s, m))?,
                errors: raw.errors.map(Into::into),
                retention: spanned(raw.retention, |s| parse_duration(&s))
                    .map_err(|(s, m)| at(s, m))?,
                in_flight: parse_in_flight(raw.in_flight).map_err(|(s, m)| at(s, m))?,
            },
            routes: Vec::with_capacity(raw.route.len()),
        };
        for route in raw.route {
            let draft = route.validate(text).map_err(|(s, m)| at(s, m))?;
            if let Some(earlier) = file
                .routes
                .iter()
                .find(|earlier| earlier.pattern.covers(&draft.pattern))
            {
                return Err(ConfigError {
                    line: draft.line,
                    message: format!(
                        "route {} can never match: the route on line {} ({}) takes all its requests",
                        draft.pattern, earlier.line, earlier.pattern
                    ),
                });
            }
            file.routes.push(draft);
        }
        Ok(file)
    }

    /// Reads and parses the file at `path`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] with line 0 when the file cannot be read, and otherwise the errors of
    /// [`parse`](Self::parse).
    pub fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            line: 0,
            message: format!("cannot read {}: {e}", path.display()),
        })?;
        Self::parse(&text)
    }

    /// The routes with every value they do not set taken from `defaults` (the file's
    /// top-level values, and flags, already applied to it).
    pub fn routes(&self, defaults: &RouteRules) -> Vec<Route> {
        self.routes
            .iter()
            .map(|draft| {
                let mut rules = defaults.clone();
                draft.rules.apply(&mut rules);
                Route {
                    pattern: draft.pattern.clone(),
                    rules,
                    line: draft.line,
                }
            })
            .collect()
    }
}

/// The line (from 1) of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

type Located = (Range<usize>, String);

/// Validates an optional spanned value, keeping its span for the error.
fn spanned<T, E: fmt::Display>(
    value: Option<Spanned<String>>,
    parse: impl FnOnce(String) -> Result<T, E>,
) -> Result<Option<T>, Located> {
    value
        .map(|v| {
            let span = v.span();
            parse(v.into_inner()).map_err(|e| (span, e.to_string()))
        })
        .transpose()
}

/// A route's or the top level's `anonymous`.
fn parse_anonymous(value: Option<Spanned<String>>) -> Result<Option<Anonymous>, Located> {
    spanned(value, |s| s.parse::<Anonymous>())
}

/// A route's or the top level's `in_flight`, its error naming the key.
fn parse_in_flight(value: Option<Spanned<String>>) -> Result<Option<InFlight>, Located> {
    spanned(value, |s| {
        s.parse::<InFlight>().map_err(|e| format!("in_flight: {e}"))
    })
}

fn header_list(names: Option<Vec<Spanned<String>>>) -> Result<Option<Vec<HeaderName>>, Located> {
    names
        .map(|names| names.into_iter().map(header_name).collect())
        .transpose()
}

fn header_name(name: Spanned<String>) -> Result<HeaderName, Located> {
    HeaderName::try_from(name.get_ref().as_str()).map_err(|_| {
        (
            name.span(),
            format!("{:?} is not a header name", name.get_ref()),
        )
    })
}

fn parse_upstream(s: &str) -> Result<Uri, String> {
    let uri: Uri = s.parse().map_err(|e| format!("upstream: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.authority().is_some() => Ok(uri),
        _ => Err(format!(
            "upstream {s:?}: expected http://HOST:PORT or https://…"
        )),
    }
}

fn parse_key_from(s: &str) -> Result<KeyFrom, String> {
    if let Some(name) = s.strip_prefix("header:") {
        let name =
            HeaderName::try_from(name).map_err(|_| format!("{name:?} is not a header name"))?;
        Ok(KeyFrom::Headers(vec![name]))
    } else if let Some(pointer) = s.strip_prefix("body:") {
        Fingerprint::check_pointer(pointer).map_err(|e| e.to_string())?;
        Ok(KeyFrom::Body(pointer.to_owned()))
    } else {
        Err(format!(
            "key_from {s:?}: expected \"header:NAME\" or \"body:/json/pointer\""
        ))
    }
}

/// The file as serde reads it; [`ConfigFile::parse`] validates it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    listen: Option<Spanned<String>>,
    upstream: Option<Spanned<String>>,
    store: Option<String>,
    credential: Option<Spanned<String>>,
    key: Option<KeyRule>,
    scope_headers: Option<Vec<Spanned<String>>>,
    anonymous: Option<Spanned<String>>,
    store_headers: Option<Vec<Spanned<String>>>,
    errors: Option<Dialect>,
    retention: Option<Spanned<String>>,
    in_flight: Option<Spanned<String>>,
    #[serde(default)]
    route: Vec<RawRoute>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    #[serde(rename = "match")]
    pattern: Spanned<String>,
    key: Option<KeyRule>,
    key_header: Option<Spanned<Vec<Spanned<String>>>>,
    key_from: Option<Spanned<String>>,
    scope_headers: Option<Vec<Spanned<String>>>,
    anonymous: Option<Spanned<String>>,
    fingerprint: Option<Spanned<RawFingerprint>>,
    in_flight: Option<Spanned<String>>,
    store_headers: Option<Vec<Spanned<String>>>,
    errors: Option<Dialect>,
    retention: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFingerprint {
    ignore: Option<Vec<Spanned<String>>>,
    only: Option<Vec<Spanned<String>>>,
}

/// `errors`, read by serde so a bad value is reported with its line.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Dialect {
    Problem,
    Stripe,
}

impl From<Dialect> for ErrorDialect {
    fn from(d: Dialect) -> Self {
        match d {
            Dialect::Problem => ErrorDialect::Problem,
            Dialect::Stripe => ErrorDialect::Stripe,
        }
    }
}

impl RawRoute {
    /// The route's rules, checked; `text` is the file, for the route's line.
    fn validate(self, text: &str) -> Result<RouteDraft, Located> {
        let match_span = self.pattern.span();
        let pattern = RoutePattern::parse(self.pattern.get_ref())
            .map_err(|e: RouteError| (match_span.clone(), e.to_string()))?;
        let key_header = match self.key_header {
            Some(names) => {
                let span = names.span();
                let names = names.into_inner();
                if names.is_empty() {
                    return Err((span, "key_header needs at least one header name".into()));
                }
                Some((span, header_list(Some(names))?.unwrap_or_default()))
            }
            None => None,
        };
        // The sender's delivery id is the key: a webhook sender has no caller's credential to
        // send, so its deliveries are scoped by their route unless the route says otherwise.
        let from_sender = self.key_from.is_some();
        let key_from = match (key_header, self.key_from) {
            (Some((span, _)), Some(_)) => {
                return Err((
                    span,
                    "key_header and key_from cannot both be set: key_from names the one place the key comes from".into(),
                ));
            }
            (Some((_, names)), None) => Some(KeyFrom::Headers(names)),
            (None, key_from) => spanned(key_from, |s| parse_key_from(&s))?,
        };
        let rules = Overrides {
            key: self.key,
            key_from,
            scope_headers: header_list(self.scope_headers)?,
            anonymous: parse_anonymous(self.anonymous)?.or(from_sender.then_some(Anonymous::Route)),
            fingerprint: self.fingerprint.map(RawFingerprint::validate).transpose()?,
            in_flight: parse_in_flight(self.in_flight)?,
            store_headers: header_list(self.store_headers)?,
            errors: self.errors.map(Into::into),
            retention: spanned(self.retention, |s| parse_duration(&s))?,
        };
        Ok(RouteDraft {
            pattern,
            line: line_of(text, match_span.start),
            rules,
        })
    }
}

impl RawFingerprint {
    fn validate(this: Spanned<Self>) -> Result<FingerprintRule, Located> {
        let span = this.span();
        let pointers = |list: Vec<Spanned<String>>| {
            list.into_iter()
                .map(|p| {
                    Fingerprint::check_pointer(p.get_ref())
                        .map_err(|e| (p.span(), e.to_string()))?;
                    Ok(p.into_inner())
                })
                .collect::<Result<Vec<_>, Located>>()
        };
        match this.into_inner() {
            Self {
                ignore: Some(_),
                only: Some(_),
            } => Err((
                span,
                "fingerprint takes ignore or only, not both".to_owned(),
            )),
            Self {
                ignore: Some(list),
                only: None,
            } => pointers(list).map(FingerprintRule::Ignore),
            Self {
                ignore: None,
                only: Some(list),
            } => pointers(list).map(FingerprintRule::Only),
            Self {
                ignore: None,
                only: None,
            } => Ok(FingerprintRule::Whole),
        }
    }
}

impl KeyRule {
    fn as_str(self) -> &'static str {
        match self {
            Self::Required => "required",
            Self::Optional => "optional",
            Self::Off => "off",
        }
    }
}

impl RouteRules {
    /// The rules as `(name, value)` pairs, named as the file names them: a credential header
    /// is listed first among the scope headers, since it is always part of the scope (a
    /// credential cookie is not a header, and is said once, at the top). A route with
    /// `key = "off"` has nothing else to say.
    pub fn described(&self, credential: &Credential) -> Vec<(&'static str, serde_json::Value)> {
        use serde_json::{Value, json};
        let names = |names: &[HeaderName]| -> Value {
            names
                .iter()
                .map(HeaderName::as_str)
                .collect::<Vec<_>>()
                .into()
        };
        let mut pairs = vec![("key", Value::from(self.key.as_str()))];
        if self.key == KeyRule::Off {
            return pairs;
        }
        pairs.push(match &self.key_from {
            KeyFrom::Headers(headers) => ("key_header", names(headers)),
            KeyFrom::Body(pointer) => ("key_from", format!("body:{pointer}").into()),
        });
        let header = match credential {
            Credential::Header(name) => Some(name),
            Credential::Cookie(_) => None,
        };
        let scope: Vec<HeaderName> = header
            .cloned()
            .into_iter()
            .chain(
                self.scope_headers
                    .iter()
                    .filter(|h| Some(*h) != header)
                    .cloned(),
            )
            .collect();
        pairs.push(("scope_headers", names(&scope)));
        pairs.push(("anonymous", self.anonymous.as_str().into()));
        pairs.push((
            "fingerprint",
            match &self.fingerprint {
                FingerprintRule::Whole => json!({}),
                FingerprintRule::Ignore(pointers) => json!({ "ignore": pointers }),
                FingerprintRule::Only(pointers) => json!({ "only": pointers }),
            },
        ));
        pairs.push(("in_flight", self.in_flight.to_string().into()));
        pairs.push(("store_headers", names(&self.store_headers)));
        pairs.push((
            "errors",
            match self.errors {
                ErrorDialect::Stripe => "stripe",
                _ => "problem",
            }
            .into(),
        ));
        pairs.push(("retention", display_duration(self.retention).into()));
        pairs
    }
}

/// The effective rules as a configuration file would write them: the defaults (for requests
/// no route matches) first, then every route with its defaults filled in. What
/// `idem proxy --check-config` prints.
pub fn describe(routes: &[Route], defaults: &RouteRules, credential: &Credential) -> String {
    use std::fmt::Write as _;
    let mut out = String::from("# requests that match no route\n");
    let write_rules = |out: &mut String, rules: &RouteRules| {
        for (name, value) in rules.described(credential) {
            let _ = writeln!(out, "{name} = {}", toml_value(&value));
        }
    };
    write_rules(&mut out, defaults);
    for route in routes {
        let _ = write!(out, "\n[[route]]");
        if route.line > 0 {
            let _ = write!(out, "  # line {}", route.line);
        }
        let _ = writeln!(
            out,
            "\nmatch = {}",
            toml_value(&route.pattern.to_string().into())
        );
        write_rules(&mut out, &route.rules);
    }
    out
}

/// A JSON value of [`RouteRules::described`] in TOML: strings and arrays read the same; a
/// table is written inline.
fn toml_value(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::Object(members) if members.is_empty() => "{}".to_owned(),
        serde_json::Value::Object(members) => {
            let inner: Vec<String> = members
                .iter()
                .map(|(k, v)| format!("{k} = {}", toml_value(v)))
                .collect();
            format!("{{ {} }}", inner.join(", "))
        }
        serde_json::Value::Array(items) => {
            let inner: Vec<String> = items.iter().map(toml_value).collect();
            format!("[{}]", inner.join(", "))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(text: &str) -> ConfigError {
        ConfigFile::parse(text).expect_err("an invalid file")
    }

    /// The example of docs/contract.md §10.1, shared with the binary's tests.
    const EXAMPLE: &str = include_str!("../tests/gateway.example.toml");

    #[test]
    fn the_documented_example_parses_into_typed_rules() {
        let file = ConfigFile::parse(EXAMPLE).unwrap();
        assert_eq!(file.listen, Some("127.0.0.1:8081".parse().unwrap()));
        assert_eq!(file.store.as_deref(), Some("redis://127.0.0.1:6379"));
        let mut defaults = RouteRules::default();
        file.defaults.apply(&mut defaults);
        let routes = file.routes(&defaults);
        assert_eq!(routes.len(), 4);
        let charges = &routes[0].rules;
        assert_eq!(routes[0].line, 9);
        assert_eq!(
            charges.key_from,
            KeyFrom::Headers(vec![
                HeaderName::from_static("idempotency-key"),
                HeaderName::from_static("x-idempotency-key")
            ])
        );
        assert_eq!(
            charges.fingerprint,
            FingerprintRule::Ignore(vec!["/metadata/trace_id".into()])
        );
        assert_eq!(charges.in_flight, InFlight::Wait(Duration::from_secs(10)));
        assert_eq!(charges.errors, ErrorDialect::Stripe);
        assert_eq!(
            routes[1].rules.key_from,
            KeyFrom::Headers(vec![HeaderName::from_static("x-github-delivery")])
        );
        assert_eq!(routes[2].rules.key_from, KeyFrom::Body("/id".into()));
        assert_eq!(routes[3].rules.key, KeyRule::Off);
        // Webhook routes need no credential: the sender's id is the key, scoped by the route.
        let anonymous: Vec<Anonymous> = routes.iter().map(|r| r.rules.anonymous).collect();
        assert_eq!(
            anonymous,
            [
                Anonymous::Refuse,
                Anonymous::Route,
                Anonymous::Route,
                Anonymous::Refuse
            ]
        );
        assert_eq!(
            file.credential, None,
            "the default: the Authorization header"
        );
        // Inherited from the defaults.
        assert_eq!(routes[1].rules.retention, Duration::from_secs(86_400));
        assert_eq!(
            routes[1].rules.in_flight,
            InFlight::Wait(Duration::from_secs(5))
        );
        assert_eq!(routes[1].rules.errors, ErrorDialect::Problem);
    }

    /// A file with one error, the line it must name, and a text its message must hold: one case
    /// per kind of error.
    const ERRORS_AND_LINES: &[(&str, usize, &str)] = &[
        (
            "upstream = \"http://a:1\"\nlisen = \"x\"\n",
            2,
            "unknown field `lisen`",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\nkye = \"off\"\n",
            3,
            "unknown field `kye`",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\nfingerprint = { ignor = [] }\n",
            3,
            "unknown field `ignor`",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\n\n[[route]]\nmatch = \"POST /a\"\n",
            5,
            "can never match",
        ),
        (
            "[[route]]\nmatch = \"POST /v1/*\"\n[[route]]\nmatch = \"POST /v1/{id}/x\"\n",
            4,
            "line 2",
        ),
        ("[[route]]\nmatch = \"POTS /a\"\n", 2, "method"),
        (
            "[[route]]\nmatch = \"POST /a\"\nretention = \"1 day\"\n",
            3,
            "not a duration",
        ),
        ("retention = \"forever\"\n", 1, "not a duration"),
        (
            "[[route]]\nmatch = \"POST /a\"\nfingerprint = { ignore = [\"/ok\", \"trace\"] }\n",
            3,
            "JSON pointer",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\nkey_from = \"body:id\"\n",
            3,
            "JSON pointer",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\n\nfingerprint = { ignore = [\"/a\"], only = [\"/b\"] }\n",
            4,
            "not both",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\nkey_header = [\"A-Key\"]\nkey_from = \"header:B\"\n",
            3,
            "cannot both",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\nkey = \"sometimes\"\n",
            3,
            "unknown variant",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\nerrors = \"rfc\"\n",
            3,
            "unknown variant",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\nscope_headers = [\"Bad Header\"]\n",
            3,
            "not a header name",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\nkey_from = \"query:k\"\n",
            3,
            "expected \"header:NAME\"",
        ),
        ("upstream = \"ftp://x\"\n", 1, "expected http"),
        ("\n\nlisten = \"localhost\"\n", 3, "listen"),
        ("[[route]]\nkey = \"off\"\n", 1, "missing field `match`"),
        ("[[route]]\nmatch = \"POST v1\"\n", 2, "path"),
        (
            "upstream = \"http://a:1\"\ncredential = \"session\"\n",
            2,
            "expected \"header:NAME\" or \"cookie:NAME\"",
        ),
        ("\ncredential = \"cookie:a b\"\n", 2, "cookie:NAME"),
        (
            "anonymous = \"allow\"\n",
            1,
            "expected \"refuse\", \"route\" or \"shared\"",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\nanonymous = \"share\"\n",
            3,
            "anonymous \"share\"",
        ),
        (
            "[[route]]\nmatch = \"POST /a\"\ncredential = \"cookie:s\"\n",
            3,
            "unknown field `credential`",
        ),
    ];

    /// Each kind of error names the line of the value at fault.
    #[test]
    fn every_error_names_its_line() {
        for (text, line, needle) in ERRORS_AND_LINES {
            let e = error(text);
            assert_eq!(e.line, *line, "{text:?}: {e}");
            assert!(e.message.contains(needle), "{text:?}: {e} lacks {needle:?}");
        }
    }

    /// A bad `in_flight`, at the top level or in a route, names its line.
    #[test]
    fn in_flight_errors_name_their_line() {
        for (in_flight, needle) in [
            ("410", "in_flight: expected \"409\""),
            ("wait", "in_flight: expected \"409\""),
            ("wait 1y", "not a duration"),
            ("wait 0ms", "not a duration"),
            ("wait 2m", "waits at most 1m"),
            ("wait 1h", "waits at most 1m"),
        ] {
            let top = error(&format!(
                "upstream = \"http://a:1\"\n\nin_flight = \"{in_flight}\"\n"
            ));
            let route = error(&format!(
                "[[route]]\nmatch = \"POST /a\"\n\n\nin_flight = \"{in_flight}\"\n"
            ));
            for (e, line) in [(top, 3), (route, 5)] {
                assert_eq!(e.line, line, "{in_flight:?}: {e}");
                assert!(
                    e.message.contains(needle),
                    "{in_flight:?}: {e} lacks {needle:?}"
                );
            }
        }
    }

    /// A route without `in_flight` takes the top level's; one with its own keeps it.
    #[test]
    fn routes_inherit_the_top_level_in_flight() {
        let file = ConfigFile::parse(
            "in_flight = \"wait 5s\"\n[[route]]\nmatch = \"POST /a\"\n[[route]]\nmatch = \"POST /b\"\nin_flight = \"409\"\n[[route]]\nmatch = \"POST /c\"\nin_flight = \"wait 250ms\"\n",
        )
        .unwrap();
        let wait = InFlight::Wait(Duration::from_secs(5));
        assert_eq!(file.defaults.in_flight, Some(wait));
        let mut defaults = RouteRules::default();
        file.defaults.apply(&mut defaults);
        assert_eq!(
            defaults.in_flight, wait,
            "requests no route matches wait too"
        );
        let in_flight: Vec<InFlight> = file
            .routes(&defaults)
            .iter()
            .map(|route| route.rules.in_flight)
            .collect();
        assert_eq!(
            in_flight,
            [
                wait,
                InFlight::Refuse,
                InFlight::Wait(Duration::from_millis(250))
            ]
        );
        assert_eq!(
            ConfigFile::parse("").unwrap().defaults.in_flight,
            None,
            "without it the defaults are left as they were"
        );
    }

    /// `credential` at the top; `anonymous` at the top (inherited) and per route, where an
    /// explicit rule wins over a webhook route's own default.
    #[test]
    fn credential_and_anonymous_rules_are_read_and_inherited() {
        let file = ConfigFile::parse(
            "credential = \"cookie:session\"\nanonymous = \"shared\"\n[[route]]\nmatch = \"POST /a\"\n[[route]]\nmatch = \"POST /b\"\nanonymous = \"refuse\"\n[[route]]\nmatch = \"POST /hooks/a\"\nkey_from = \"body:/id\"\n[[route]]\nmatch = \"POST /hooks/b\"\nkey_from = \"body:/id\"\nanonymous = \"refuse\"\n[[route]]\nmatch = \"POST /c\"\nkey_header = [\"X-Key\"]\n",
        )
        .unwrap();
        assert_eq!(file.credential, Some(Credential::Cookie("session".into())));
        let mut defaults = RouteRules::default();
        file.defaults.apply(&mut defaults);
        assert_eq!(defaults.anonymous, Anonymous::Shared);
        let anonymous: Vec<Anonymous> = file
            .routes(&defaults)
            .iter()
            .map(|route| route.rules.anonymous)
            .collect();
        assert_eq!(
            anonymous,
            [
                Anonymous::Shared,
                Anonymous::Refuse,
                Anonymous::Route,
                Anonymous::Refuse,
                // key_header names the client's key: not a webhook's.
                Anonymous::Shared,
            ]
        );
        let described = describe(
            &file.routes(&defaults),
            &defaults,
            file.credential.as_ref().unwrap(),
        );
        assert!(described.contains("anonymous = \"route\""), "{described}");
        assert!(described.contains("scope_headers = []"), "{described}");
    }

    #[test]
    fn routes_that_differ_in_method_or_come_before_a_prefix_are_fine() {
        let file = ConfigFile::parse(
            "[[route]]\nmatch = \"POST /v1/charges\"\n[[route]]\nmatch = \"PATCH /v1/charges\"\n[[route]]\nmatch = \"POST /v1/*\"\n",
        )
        .unwrap();
        assert_eq!(file.routes(&RouteRules::default()).len(), 3);
    }
}
