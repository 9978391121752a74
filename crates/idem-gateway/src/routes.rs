//! Routes: which requests a `[[route]]` takes (`METHOD /path/{param}/*`), and the service that
//! sends each request to the first route that matches it.

use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use http::{Method, Request, Response};
use tower::util::{BoxCloneSyncService, Oneshot};
use tower::{Service, ServiceExt};

/// A route's `match`: a method and a path whose `{name}` segments match any one segment and
/// whose trailing `/*` matches any rest (none included).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePattern {
    method: Method,
    segments: Vec<Segment>,
    /// Ends in `/*`.
    prefix: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// `{name}`: any one non-empty segment.
    Param(String),
}

/// A `match` that is not `METHOD /path`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// Not two words.
    #[error("match {0:?}: expected METHOD and a path, such as \"POST /v1/charges\"")]
    Shape(String),
    /// A method that is not one of HTTP's.
    #[error("match {0:?}: the method must be one of GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")]
    Method(String),
    /// A path that does not start with `/`, or a `*` or `{` out of place.
    #[error(
        "match {0:?}: the path must start with '/'; {{name}} is a whole segment, and * only the last one"
    )]
    Path(String),
}

impl RoutePattern {
    /// Parses `"POST /v1/charges/{id}"` or `"POST /v1/*"`.
    ///
    /// # Errors
    ///
    /// [`RouteError::Shape`] when `text` is not two words, [`RouteError::Method`] when the
    /// method is not one of HTTP's, and [`RouteError::Path`] when the path does not start with
    /// `/` or has a `*` or `{` out of place.
    ///
    /// # Panics
    ///
    /// Never: the method is checked against a list of valid ones first.
    pub fn parse(text: &str) -> Result<Self, RouteError> {
        let mut words = text.split_whitespace();
        let (Some(method), Some(path), None) = (words.next(), words.next(), words.next()) else {
            return Err(RouteError::Shape(text.to_owned()));
        };
        const METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];
        if !METHODS.contains(&method) {
            return Err(RouteError::Method(text.to_owned()));
        }
        let method = Method::from_bytes(method.as_bytes()).expect("a known method");
        let bad_path = || RouteError::Path(text.to_owned());
        let rest = path.strip_prefix('/').ok_or_else(bad_path)?;
        let mut parts: Vec<&str> = rest.split('/').collect();
        let prefix = parts.last() == Some(&"*");
        if prefix {
            parts.pop();
        }
        let segments = parts
            .into_iter()
            .map(
                |part| match part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                    Some(name) if !name.is_empty() && !name.contains(['{', '}', '*']) => {
                        Ok(Segment::Param(name.to_owned()))
                    }
                    None if !part.contains(['{', '}', '*']) => {
                        Ok(Segment::Literal(part.to_owned()))
                    }
                    _ => Err(bad_path()),
                },
            )
            .collect::<Result<_, _>>()?;
        Ok(Self {
            method,
            segments,
            prefix,
        })
    }

    /// The method it takes.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// Whether a request with `method` and `path` is this route's.
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        if *method != self.method {
            return false;
        }
        let mut parts = path.strip_prefix('/').unwrap_or(path).split('/');
        for segment in &self.segments {
            match (segment, parts.next()) {
                (Segment::Literal(l), Some(p)) if l == p => {}
                (Segment::Param(_), Some(p)) if !p.is_empty() => {}
                _ => return false,
            }
        }
        self.prefix || parts.next().is_none()
    }

    /// Whether every request `later` matches is matched by `self` too, so that `later`, put
    /// after `self`, could never be reached.
    pub(crate) fn covers(&self, later: &RoutePattern) -> bool {
        if self.method != later.method {
            return false;
        }
        let fixed = self.segments.len();
        let lengths_fit = if self.prefix {
            later.segments.len() >= fixed
        } else {
            !later.prefix && later.segments.len() == fixed
        };
        lengths_fit
            && self
                .segments
                .iter()
                .zip(&later.segments)
                .all(|(mine, theirs)| match (mine, theirs) {
                    (Segment::Param(_), _) => true,
                    (Segment::Literal(a), Segment::Literal(b)) => a == b,
                    (Segment::Literal(_), Segment::Param(_)) => false,
                })
    }
}

impl fmt::Display for RoutePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ", self.method)?;
        for segment in &self.segments {
            match segment {
                Segment::Literal(l) => write!(f, "/{l}")?,
                Segment::Param(p) => write!(f, "/{{{p}}}")?,
            }
        }
        if self.prefix {
            f.write_str("/*")?;
        }
        Ok(())
    }
}

/// One route's service: its layers over the shared upstream, or the upstream alone.
pub(crate) type RouteService = BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

/// Sends each request to the first route whose pattern matches it, or to `fallback`.
#[derive(Clone)]
pub(crate) struct Dispatch {
    pub(crate) routes: Arc<[(RoutePattern, RouteService)]>,
    pub(crate) fallback: RouteService,
}

impl Service<Request<Body>> for Dispatch {
    type Response = Response<Body>;
    type Error = Infallible;
    /// The chosen route's own call, unboxed.
    type Future = Oneshot<RouteService, Request<Body>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Each request is sent to a clone of its route's service, made ready by `oneshot`.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let service = self
            .routes
            .iter()
            .find(|(pattern, _)| pattern.matches(request.method(), request.uri().path()))
            .map_or(&self.fallback, |(_, service)| service)
            .clone();
        service.oneshot(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> RoutePattern {
        RoutePattern::parse(s).unwrap()
    }

    #[test]
    fn patterns_match_segments_params_and_prefixes() {
        let post = Method::POST;
        assert!(p("POST /v1/charges").matches(&post, "/v1/charges"));
        assert!(!p("POST /v1/charges").matches(&post, "/v1/charges/x"));
        assert!(!p("POST /v1/charges").matches(&Method::PATCH, "/v1/charges"));
        assert!(p("POST /v1/charges/{id}/capture").matches(&post, "/v1/charges/ch_1/capture"));
        assert!(!p("POST /v1/charges/{id}/capture").matches(&post, "/v1/charges//capture"));
        assert!(p("POST /v1/*").matches(&post, "/v1/a/b"));
        assert!(p("POST /v1/*").matches(&post, "/v1"));
        assert!(!p("POST /v1/*").matches(&post, "/v2/a"));
        assert!(p("POST /*").matches(&post, "/anything"));
        assert_eq!(p("POST /v1/{id}/*").to_string(), "POST /v1/{id}/*");
    }

    #[test]
    fn a_route_covers_the_routes_it_takes_every_request_of() {
        assert!(p("POST /v1/*").covers(&p("POST /v1/charges")));
        assert!(p("POST /v1/*").covers(&p("POST /v1/x/*")));
        assert!(p("POST /v1/{id}").covers(&p("POST /v1/charges")));
        assert!(p("POST /a").covers(&p("POST /a")));
        assert!(!p("POST /v1/charges").covers(&p("POST /v1/{id}")));
        assert!(!p("POST /v1/charges").covers(&p("POST /v1/*")));
        assert!(!p("POST /v1/x/*").covers(&p("POST /v1/*")));
        assert!(!p("POST /v1/*").covers(&p("PATCH /v1/charges")));
    }

    #[test]
    fn bad_patterns_say_why() {
        let refused = |text: &str| RoutePattern::parse(text).unwrap_err();
        assert_eq!(refused("POST"), RouteError::Shape("POST".into()));
        assert_eq!(refused("post /a"), RouteError::Method("post /a".into()));
        for path in ["POST a", "POST /a/*/b", "POST /a/{}", "POST /a{b}"] {
            assert_eq!(refused(path), RouteError::Path(path.into()), "{path}");
        }
    }
}
