//! The proxy itself: forwards a request to the upstream and tells the idempotency layer what
//! its answer means.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_core::{ProblemKind, Scope};
use idem_tower::Outcome;
use tower::Service;

use crate::server::Peer;
use crate::{ClientTls, Secret, UnknownOutcome};

/// What the upstream receives in its `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyForwarding {
    /// The client's key, unchanged.
    AsSent,
    /// HMAC-SHA256(secret, account, key) in hex: unique per account, so an upstream that
    /// dedupes on the key alone cannot mix two accounts' requests.
    Derived,
    /// No key.
    Drop,
}

/// Forwards requests to one upstream.
#[derive(Debug, Clone)]
pub(crate) struct Upstream {
    pub(crate) client: Client<HttpsConnector<HttpConnector>, Body>,
    /// For gRPC calls: HTTP/2 only, over TLS with ALPN `h2` or in clear text with prior
    /// knowledge (h2c), as gRPC servers speak.
    pub(crate) grpc_client: Client<HttpsConnector<HttpConnector>, Body>,
    pub(crate) base: Uri,
    pub(crate) timeout: Duration,
    pub(crate) forwarding: KeyForwarding,
    pub(crate) secret: Secret,
    pub(crate) on_5xx: UnknownOutcome,
    pub(crate) on_timeout: UnknownOutcome,
}

impl Upstream {
    /// An upstream at `base` (`http://` or `https://`, checked with `tls`).
    pub(crate) fn new(base: Uri, tls: &ClientTls) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        // The TLS layer above takes https; plain http passes through it untouched.
        connector.enforce_http(false);
        let grpc_connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*tls.config()).clone())
            .https_or_http()
            .enable_http2()
            .wrap_connector(connector.clone());
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*tls.config()).clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            grpc_client: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build(grpc_connector),
            base,
            timeout: Duration::from_secs(30),
            forwarding: KeyForwarding::AsSent,
            secret: Secret::new(vec![0; 16]).expect("16 bytes"),
            on_5xx: UnknownOutcome::Store,
            on_timeout: UnknownOutcome::Keep,
        }
    }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// Tells the upstream who called and how: `X-Forwarded-For` (the client's address appended to
/// any the request brought), `X-Forwarded-Proto`, and `Forwarded` (RFC 7239) with `for`,
/// `proto` and `host`, appended after any element an earlier proxy wrote. Without a [`Peer`]
/// (a connection the gateway did not accept itself) only the host is told.
fn add_forwarding(headers: &mut HeaderMap, peer: Option<Peer>, host: Option<&HeaderValue>) {
    use std::fmt::Write as _;
    // One element, its pairs joined by `;`, written into one string (this runs for every
    // request).
    let mut element = String::with_capacity(64);
    if let Some(peer) = peer {
        let ip = peer.addr.ip();
        let mut seen = String::with_capacity(48);
        if let Some(earlier) = headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok())
            && !earlier.trim().is_empty()
        {
            seen.push_str(earlier);
            seen.push_str(", ");
        }
        let _ = write!(seen, "{ip}");
        if let Ok(value) = HeaderValue::try_from(seen) {
            headers.insert(X_FORWARDED_FOR, value);
        }
        let proto = if peer.tls { "https" } else { "http" };
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
        // RFC 7239 §6: an IPv6 address is quoted and bracketed.
        let _ = match ip {
            std::net::IpAddr::V4(ip) => write!(element, "for={ip}"),
            std::net::IpAddr::V6(ip) => write!(element, "for=\"[{ip}]\""),
        };
        element.push_str(";proto=");
        element.push_str(proto);
    }
    // A host with characters outside a token is sent as a quoted string.
    if let Some(host) = host.and_then(|h| h.to_str().ok()) {
        let token = host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-_~".contains(&b));
        if token || !host.contains(['"', '\\']) {
            if !element.is_empty() {
                element.push(';');
            }
            element.push_str(if token { "host=" } else { "host=\"" });
            element.push_str(host);
            if !token {
                element.push('"');
            }
        }
    }
    if element.is_empty() {
        return;
    }
    let value = match headers.get(header::FORWARDED).and_then(|v| v.to_str().ok()) {
        Some(earlier) if !earlier.trim().is_empty() => format!("{earlier}, {element}"),
        _ => element,
    };
    if let Ok(value) = HeaderValue::try_from(value) {
        headers.insert(header::FORWARDED, value);
    }
}

/// Headers that belong to one connection, never forwarded (RFC 9110 §7.6.1). Names, not
/// strings: a string is parsed into a name on every lookup.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers named in `Connection` are hop-by-hop too.
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The gateway's own answer when the upstream failed: a problem-details response, or for a
/// gRPC call a trailers-only response with the problem's gRPC status (docs/contract.md §14).
fn problem(kind: ProblemKind, detail: &str, outcome: Outcome, grpc: bool) -> Response<Body> {
    if grpc {
        let mut response = Response::new(Body::empty());
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert(
            GRPC_STATUS,
            HeaderValue::from_static(kind.grpc_code().as_field()),
        );
        let message = idem_core::grpc_message(&format!("{}: {detail}", kind.type_uri()));
        if let Ok(message) = HeaderValue::try_from(message) {
            headers.insert(HeaderName::from_static("grpc-message"), message);
        }
        response.extensions_mut().insert(outcome);
        return response;
    }
    let mut response = Response::new(Body::from(Bytes::from(kind.with_detail(detail).to_json())));
    *response.status_mut() = StatusCode::from_u16(kind.status()).expect("a valid status");
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response.extensions_mut().insert(outcome);
    response
}

impl Service<Request<Body>> for Upstream {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(request).await) })
    }
}

impl Upstream {
    /// Sends the request on to the upstream and marks the answer with what it means for the
    /// key: a connection never made releases it, a failure after sending leaves the outcome
    /// unknown.
    async fn forward(self, request: Request<Body>) -> Response<Body> {
        let (mut parts, body) = request.into_parts();
        let grpc = parts
            .headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| idem_core::is_grpc_content_type(v.as_bytes()));
        let uri = match self.upstream_uri(&parts.uri) {
            Ok(uri) => uri,
            Err(e) => {
                return problem(
                    ProblemKind::UpstreamUnavailable,
                    &format!("cannot build the upstream URL: {e}"),
                    Outcome::Release,
                    grpc,
                );
            }
        };
        self.rewrite_headers(&mut parts);
        parts.uri = uri;
        parts.extensions = Default::default();
        let client = if grpc {
            // gRPC is HTTP/2 end to end, and its servers want to hear that the client reads
            // trailers (the one `TE` value HTTP/2 allows; stripped above as hop-by-hop).
            parts.version = http::Version::HTTP_2;
            parts
                .headers
                .insert(header::TE, HeaderValue::from_static("trailers"));
            &self.grpc_client
        } else {
            // The upstream hop is HTTP/1.1 whatever the client spoke: an HTTP/2 request (over
            // TLS with ALPN) would otherwise be refused by the HTTP/1 client before it is sent.
            parts.version = http::Version::HTTP_11;
            &self.client
        };
        let outgoing = Request::from_parts(parts, body);

        match tokio::time::timeout(self.timeout, client.request(outgoing)).await {
            Ok(Ok(response)) => self.relay(response),
            // The connection was never made: nothing reached the upstream, so the key is
            // released and a retry runs fresh.
            Ok(Err(e)) if e.is_connect() => {
                tracing::warn!(error = %e, "upstream refused the connection");
                problem(
                    ProblemKind::UpstreamUnavailable,
                    "the upstream could not be reached; nothing was sent; retry with the same key",
                    Outcome::Release,
                    grpc,
                )
            }
            // Sent, then lost: the upstream may have acted.
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "upstream connection failed after the request was sent");
                problem(
                    ProblemKind::UpstreamUnavailable,
                    "the upstream connection failed after the request was sent; the outcome is unknown",
                    self.on_timeout.as_outcome(),
                    grpc,
                )
            }
            Err(_elapsed) => problem(
                ProblemKind::UpstreamTimeout,
                "the upstream did not answer in time; the outcome is unknown; retry with the same key",
                self.on_timeout.as_outcome(),
                grpc,
            ),
        }
    }

    /// The upstream's URL for a request to `requested`: its path and query under the base.
    fn upstream_uri(&self, requested: &Uri) -> Result<Uri, http::Error> {
        let path = requested
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        let base_path = self.base.path().trim_end_matches('/');
        Uri::builder()
            .scheme(self.base.scheme_str().unwrap_or("http"))
            .authority(self.base.authority().map(|a| a.as_str()).unwrap_or(""))
            .path_and_query(format!("{base_path}{path}"))
            .build()
    }

    /// Rewrites the request's headers for the upstream: no hop-by-hop headers, who called
    /// (`Forwarded` and the `X-Forwarded-*` headers), and the key as [`KeyForwarding`] says.
    fn rewrite_headers(&self, parts: &mut http::request::Parts) {
        let original_host = parts.headers.get(header::HOST).cloned();
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::HOST);
        let peer = parts.extensions.get::<Peer>().copied();
        add_forwarding(&mut parts.headers, peer, original_host.as_ref());
        if let Some(host) = original_host {
            parts.headers.insert(X_FORWARDED_HOST, host);
        }
        let scope = parts.extensions.get::<Scope>();
        match (self.forwarding, scope) {
            (KeyForwarding::AsSent, _) => {}
            (KeyForwarding::Derived, Some(scope)) => {
                let derived = self.secret.hmac_hex(&[
                    b"idem-forwarded-key",
                    scope.account.as_str().as_bytes(),
                    scope.key.as_str().as_bytes(),
                ]);
                parts.headers.insert(
                    IDEMPOTENCY_KEY,
                    HeaderValue::from_str(&derived).expect("hex is a valid header value"),
                );
            }
            (KeyForwarding::Derived, None) | (KeyForwarding::Drop, _) => {
                parts.headers.remove(IDEMPOTENCY_KEY);
            }
        }
    }

    /// The upstream's answer as the client gets it: no hop-by-hop headers, the client's own
    /// HTTP version, and a 5xx marked with the outcome configured for it.
    fn relay(&self, response: Response<hyper::body::Incoming>) -> Response<Body> {
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        // The client speaks its own HTTP version with the gateway, whatever the upstream
        // spoke.
        parts.version = http::Version::default();
        // A gRPC server error (`INTERNAL`, `UNKNOWN`, `DATA_LOSS`) travels as HTTP 200; when it
        // is in the headers (a trailers-only response, as errors are) it is the upstream's
        // 5xx. In trailers after a message, the layer's rule for it applies.
        let grpc_server_error = parts
            .headers
            .get(GRPC_STATUS)
            .and_then(|v| idem_core::GrpcCode::from_field(v.as_bytes()))
            .is_some_and(|code| code.class() == idem_core::GrpcClass::ServerError);
        if parts.status.is_server_error() || grpc_server_error {
            parts.extensions.insert(match self.on_5xx {
                UnknownOutcome::Store => Outcome::Store,
                UnknownOutcome::Keep => Outcome::Unknown,
                UnknownOutcome::Release => Outcome::Release,
            });
        }
        Response::from_parts(parts, Body::new(body))
    }
}
