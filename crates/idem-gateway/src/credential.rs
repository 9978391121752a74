//! Who is calling: the credential a caller's scope is derived from (a header, or one cookie),
//! and what happens to a covered request that carries none ([`Anonymous`]).

use std::fmt;
use std::str::FromStr;

use http::header::{AUTHORIZATION, COOKIE};
use http::{HeaderMap, HeaderName, HeaderValue};

/// Where the gateway finds the credential that identifies a caller: the HMAC of its value
/// under the server secret is the account its keys are scoped to.
///
/// Written `header:NAME` or `cookie:NAME` (`--credential`, `credential = "…"` in the file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// The value of a request header (the default: `Authorization`). A request with the header
    /// several times is scoped by its first.
    Header(HeaderName),
    /// The value of one cookie, found in the request's `Cookie` header fields: for an API
    /// whose callers log in with a session cookie. A request carrying that cookie several
    /// times (say, set for two paths) is scoped by all its values together, in order.
    Cookie(String),
}

impl Default for Credential {
    fn default() -> Self {
        Self::Header(AUTHORIZATION)
    }
}

/// A credential source that is not `header:NAME` or `cookie:NAME`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("credential {0:?}: expected \"header:NAME\" or \"cookie:NAME\" with a valid name")]
pub struct CredentialError(String);

impl FromStr for Credential {
    type Err = CredentialError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || CredentialError(s.to_owned());
        if let Some(name) = s.strip_prefix("header:") {
            HeaderName::try_from(name)
                .map(Self::Header)
                .map_err(|_| bad())
        } else if let Some(name) = s.strip_prefix("cookie:") {
            // RFC 6265: a cookie's name is an RFC 9110 token, compared case-sensitively.
            let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
            if !name.is_empty() && name.bytes().all(token) {
                Ok(Self::Cookie(name.to_owned()))
            } else {
                Err(bad())
            }
        } else {
            Err(bad())
        }
    }
}

impl fmt::Display for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Header(name) => write!(f, "header:{name}"),
            Self::Cookie(name) => write!(f, "cookie:{name}"),
        }
    }
}

impl Credential {
    /// The credential's values in `headers`, in order: none when the request carries no
    /// credential. An empty value is no credential: callers that send an empty header would
    /// otherwise all share one scope.
    pub(crate) fn values<'h>(&self, headers: &'h HeaderMap) -> Vec<&'h [u8]> {
        match self {
            Self::Header(name) => headers
                .get(name)
                .map(HeaderValue::as_bytes)
                .filter(|value| !value.trim_ascii().is_empty())
                .into_iter()
                .collect(),
            Self::Cookie(name) => cookie_values(headers, name.as_bytes()).collect(),
        }
    }

    /// Whether `headers` carry the credential.
    pub(crate) fn is_present(&self, headers: &HeaderMap) -> bool {
        match self {
            Self::Header(name) => headers
                .get(name)
                .is_some_and(|value| !value.as_bytes().trim_ascii().is_empty()),
            Self::Cookie(name) => cookie_values(headers, name.as_bytes()).next().is_some(),
        }
    }

    /// The `WWW-Authenticate` challenge of a `401` for a missing credential, where one fits:
    /// `Bearer` for the `Authorization` header (what the gateway's `401`s always said). A
    /// cookie or another header has no scheme to name.
    pub(crate) fn challenge(&self) -> Option<HeaderValue> {
        match self {
            Self::Header(name) if *name == AUTHORIZATION => {
                Some(HeaderValue::from_static("Bearer"))
            }
            _ => None,
        }
    }

    /// What a caller must send, for a refusal's text: "the Authorization header", "the
    /// session cookie".
    pub(crate) fn needed(&self) -> String {
        match self {
            Self::Header(name) if *name == AUTHORIZATION => "the Authorization header".into(),
            Self::Header(name) => format!("the {name} header"),
            Self::Cookie(name) => format!("the {name} cookie"),
        }
    }
}

/// The values of the cookie `name` in every `Cookie` field of `headers`, in order
/// (`a=1; session=x` and a second field `session=y` give `x`, `y`). Pairs are split at `;`,
/// spaces around them trimmed; a pair without `=` or with an empty value is no cookie.
fn cookie_values<'h>(headers: &'h HeaderMap, name: &[u8]) -> impl Iterator<Item = &'h [u8]> {
    headers
        .get_all(COOKIE)
        .into_iter()
        .flat_map(|field| field.as_bytes().split(|&b| b == b';'))
        .filter_map(move |pair| {
            let pair = pair.trim_ascii();
            let at = pair.iter().position(|&b| b == b'=')?;
            let (found, value) = (pair[..at].trim_ascii(), pair[at + 1..].trim_ascii());
            (found == name && !value.is_empty()).then_some(value)
        })
}

/// What a covered request without its credential gets, per route (`anonymous = "…"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Anonymous {
    /// `401 urn:idem:problem:no-credential`, neither forwarded nor stored (the default).
    #[default]
    Refuse,
    /// Scoped by its route: every caller without a credential on the route shares one scope
    /// (`route:` and the route's `match`). The default of a route whose key is the sender's
    /// (`key_from`, inbound webhooks), where the key is a delivery id unique to the sender.
    /// On a route whose key the client chooses, callers can be replayed each other's answers,
    /// as with [`Shared`](Self::Shared).
    Route,
    /// **Shares one scope among every caller without a credential**, on every route that says
    /// so (`anonymous`). The risk: keys are then global among those callers, so one who sends
    /// another's key with the same body is replayed the other's stored answer (an order, an
    /// address). Only for APIs whose callers are never told apart and whose answers hold
    /// nothing private. Records stay where gateways before this rule filed them.
    Shared,
}

impl Anonymous {
    /// As the file writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Refuse => "refuse",
            Self::Route => "route",
            Self::Shared => "shared",
        }
    }
}

/// An `anonymous` that is none of `refuse`, `route`, `shared`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("anonymous {0:?}: expected \"refuse\", \"route\" or \"shared\"")]
pub struct AnonymousError(String);

impl FromStr for Anonymous {
    type Err = AnonymousError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "refuse" => Ok(Self::Refuse),
            "route" => Ok(Self::Route),
            "shared" => Ok(Self::Shared),
            _ => Err(AnonymousError(s.to_owned())),
        }
    }
}

impl fmt::Display for Anonymous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(fields: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in fields {
            map.append(
                HeaderName::try_from(*name).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    fn values(credential: &str, fields: &[(&str, &str)]) -> Vec<String> {
        let credential: Credential = credential.parse().unwrap();
        credential
            .values(&headers(fields))
            .into_iter()
            .map(|v| String::from_utf8(v.to_vec()).unwrap())
            .collect()
    }

    #[test]
    fn a_cookie_is_found_among_others_in_any_field_with_any_spacing() {
        let session = "cookie:session";
        assert_eq!(values(session, &[("cookie", "session=abc")]), ["abc"]);
        assert_eq!(
            values(session, &[("cookie", "theme=dark;session=abc;lang=en")]),
            ["abc"]
        );
        assert_eq!(
            values(
                session,
                &[("cookie", "  theme = dark ;  session = abc  ; x")]
            ),
            ["abc"]
        );
        assert_eq!(
            values(
                session,
                &[("cookie", "theme=dark"), ("cookie", "session=abc")]
            ),
            ["abc"],
            "a second Cookie field (HTTP/2 sends one per cookie)"
        );
        assert_eq!(
            values(
                session,
                &[("cookie", "session=a"), ("cookie", "b=1; session=b")]
            ),
            ["a", "b"],
            "every value, in order"
        );
        assert_eq!(
            values(session, &[("cookie", "session=\"quoted=x\"")]),
            ["\"quoted=x\""],
            "the value whole, as the upstream sees it"
        );
    }

    #[test]
    fn no_such_cookie_or_an_empty_one_is_no_credential() {
        let session = "cookie:session";
        for fields in [
            &[][..],
            &[("cookie", "")][..],
            &[("cookie", "sessionid=abc; Session=abc")][..],
            &[("cookie", "session=")][..],
            &[("cookie", "session")][..],
            &[("cookie", "xsession=abc; session_x=abc")][..],
            &[("authorization", "Bearer t")][..],
        ] {
            assert_eq!(values(session, fields), Vec::<String>::new(), "{fields:?}");
        }
    }

    #[test]
    fn a_header_credential_is_its_first_non_empty_value() {
        let auth = "header:Authorization";
        assert_eq!(
            values(
                auth,
                &[("authorization", "Bearer a"), ("authorization", "Bearer b")]
            ),
            ["Bearer a"]
        );
        assert!(values(auth, &[("authorization", "  ")]).is_empty());
        assert!(values(auth, &[("cookie", "authorization=x")]).is_empty());
    }

    #[test]
    fn sources_parse_and_print_as_the_file_writes_them() {
        for (text, printed) in [
            ("header:Authorization", "header:authorization"),
            ("header:X-Api-Key", "header:x-api-key"),
            ("cookie:session", "cookie:session"),
            ("cookie:__Host-SID", "cookie:__Host-SID"),
        ] {
            assert_eq!(text.parse::<Credential>().unwrap().to_string(), printed);
        }
        for bad in [
            "Authorization",
            "cookie:",
            "cookie:a b",
            "cookie:a=b",
            "header:a b",
            "query:x",
        ] {
            assert!(bad.parse::<Credential>().is_err(), "{bad}");
        }
        assert_eq!(Credential::default().to_string(), "header:authorization");
    }
}
