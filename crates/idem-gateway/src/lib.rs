//! `idem proxy`: the idempotency contract (docs/contract.md §2) in front of any HTTP API, in any language.
//!
//! The gateway is [`idem_tower::IdempotencyLayer`] in lease mode around a reverse proxy. It
//! scopes keys to the caller's credential as HMAC-SHA256(server secret, credential), so a
//! guessed key never reaches another client's response, forwards the key (or a key derived
//! from it) so an idempotent upstream can dedupe too, and tells the layer what each upstream
//! answer means:
//!
//! | upstream | client gets | the key |
//! | --- | --- | --- |
//! | refused the connection (nothing sent) | `502` | released: the retry runs fresh |
//! | answered 2xx/3xx/4xx | the answer | stored and replayed (rejections before work excepted) |
//! | answered 5xx | the answer | stored and replayed, as Stripe does ([`UnknownOutcome`] to change) |
//! | timed out after the request was sent | `504` | kept in progress until its lease ends; then the next retry is sent upstream with the same key |
//!
//! ```no_run
//! use idem_gateway::{GatewayConfig, Secret, serve};
//! use idem_store::SqliteStore;
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::open("gateway.db").await?;
//! let config = GatewayConfig::new("http://127.0.0.1:3000".parse()?, Secret::new(*b"a-secret-of-32-bytes-or-so.....")?)?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8081").await?;
//! serve(listener, store, config, std::future::pending()).await?;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, StatusCode, Uri, header};
use idem_core::{AccountId, Clock, ErrorDialect, Policy, SystemClock};
use idem_store::Store;
use idem_tower::{IdempotencyLayer, Outcome};
use tokio::net::TcpListener;

mod secret;
pub mod server;
pub mod tls;
mod upstream;
mod wake;

pub use secret::{Secret, SecretError};
pub use tls::{ClientTls, ServerTls, TlsError};
pub use upstream::KeyForwarding;
pub use wake::{InFlight, InFlightError, outcome_signal};

use upstream::Upstream;

/// What to do with the key when the upstream's outcome is uncertain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownOutcome {
    /// Store the answer and replay it to every retry.
    Store,
    /// Keep the key in progress until its lease ends; then a retry is sent upstream again with
    /// the same key.
    Keep,
    /// Forget the key: the next retry is sent upstream at once.
    Release,
}

impl UnknownOutcome {
    pub(crate) fn as_outcome(self) -> Outcome {
        match self {
            UnknownOutcome::Store => Outcome::Store,
            UnknownOutcome::Keep => Outcome::Unknown,
            UnknownOutcome::Release => Outcome::Release,
        }
    }
}

/// How the gateway runs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The upstream's base URL (`http://127.0.0.1:3000`).
    pub upstream: Uri,
    /// The HMAC key for scopes and derived keys.
    pub secret: Secret,
    /// The header whose value identifies the caller (default `Authorization`).
    pub credential_header: HeaderName,
    /// More headers that, with the credential, make the scope (all HMACed together), such as
    /// `Stripe-Account`: a platform that calls for many accounts with one API key gets a
    /// scope per account, so one account's response is never replayed to another.
    pub scope_headers: Vec<HeaderName>,
    /// Refuse requests without a credential with `401` (default: they share one anonymous
    /// scope).
    pub require_auth: bool,
    /// The idempotency policy; `require_key` false passes keyless requests through untouched.
    pub policy: Policy,
    /// What the upstream receives as its `Idempotency-Key`.
    pub forwarding: KeyForwarding,
    /// What a 5xx answer does to the key (default: stored).
    pub on_5xx: UnknownOutcome,
    /// What a timeout or a connection lost after sending does to the key (default: kept until
    /// its lease ends).
    pub on_timeout: UnknownOutcome,
    /// How long the upstream may take.
    pub upstream_timeout: Duration,
    /// How long a client may take to send a request head before [`serve`] closes its
    /// connection (default [`server::HEAD_TIMEOUT`]).
    pub head_timeout: Duration,
    /// How the upstream's certificate is checked when it is `https://` (default: the
    /// platform's roots).
    pub upstream_tls: ClientTls,
    /// How idem's own problem bodies are written: [`ErrorDialect::Stripe`] adds the `error`
    /// member Stripe's SDKs need to raise on a `409` or `422` (default: problem details only).
    pub errors: ErrorDialect,
    /// Serve clients over TLS with this certificate (HTTP/2 and HTTP/1.1 over ALPN) instead of
    /// plain HTTP/1.1 (default).
    pub tls: Option<ServerTls>,
    /// The clock.
    pub clock: Arc<dyn Clock>,
    /// What a duplicate gets while the first request with its key is at the upstream
    /// (default: `409` at once).
    pub in_flight: InFlight,
    /// What wakes duplicates that wait ([`InFlight::Wait`]). The default wakes those in this
    /// process only; gateways sharing a store each need the store's ([`outcome_signal`]).
    pub outcome_signal: idem_tower::OutcomeSignal,
}

impl GatewayConfig {
    /// The defaults for `upstream`. Fails only when the platform's root certificates cannot
    /// be loaded.
    pub fn new(upstream: Uri, secret: Secret) -> Result<Self, TlsError> {
        Ok(Self {
            upstream,
            secret,
            credential_header: header::AUTHORIZATION,
            scope_headers: Vec::new(),
            require_auth: false,
            policy: Policy::default(),
            forwarding: KeyForwarding::AsSent,
            on_5xx: UnknownOutcome::Store,
            on_timeout: UnknownOutcome::Keep,
            upstream_timeout: Duration::from_secs(30),
            head_timeout: server::HEAD_TIMEOUT,
            upstream_tls: ClientTls::platform()?,
            tls: None,
            errors: ErrorDialect::Problem,
            clock: Arc::new(SystemClock),
            in_flight: InFlight::Refuse,
            outcome_signal: Default::default(),
        })
    }
}

/// The path where the gateway publishes its rules, out of the way of upstream paths.
pub const POLICY_PATH: &str = "/.well-known/idempotency-policy";

/// The gateway as an axum router over `store`.
pub fn router<St: Store>(store: St, config: GatewayConfig) -> Router {
    let mut upstream = Upstream::new(config.upstream.clone(), &config.upstream_tls);
    upstream.timeout = config.upstream_timeout;
    upstream.forwarding = config.forwarding;
    upstream.secret = config.secret.clone();
    upstream.on_5xx = config.on_5xx;
    upstream.on_timeout = config.on_timeout;

    let secret = config.secret.clone();
    let credential = config.credential_header.clone();
    let scope_headers = config.scope_headers.clone();
    // A claim outlasts its longest upstream call, so a crashed gateway's key is not taken over
    // (and the request forwarded again) while the upstream may still be working on it.
    let policy = Policy {
        downstream_timeout: config
            .policy
            .downstream_timeout
            .max(config.upstream_timeout),
        ..config.policy.clone()
    };
    let published = Arc::new(published_policy(&policy, &config));
    let idempotency = IdempotencyLayer::leased(store)
        .with_policy(policy)
        .with_policy_link(POLICY_PATH)
        .with_error_dialect(config.errors)
        .with_clock(config.clock.clone())
        .with_account(move |parts| scope_of(&secret, &credential, &scope_headers, parts));
    let idempotency = match config.in_flight {
        InFlight::Wait(max) => idempotency.with_outcome_wait(max, config.outcome_signal.clone()),
        InFlight::Refuse => idempotency,
    };
    let auth = Arc::new((config.credential_header.clone(), config.require_auth));
    Router::new()
        .route(
            POLICY_PATH,
            axum::routing::get(move || {
                let published = published.clone();
                async move { axum::Json((*published).clone()) }
            }),
        )
        .fallback_service(
            tower::ServiceBuilder::new()
                .layer(idempotency)
                .service(upstream),
        )
        .layer(axum::middleware::from_fn_with_state(
            auth,
            require_credential,
        ))
}

/// The rules the gateway publishes: the policy's, and how long a claim is held (the lease plus
/// the upstream's timeout) and what a timed-out key does, which a client needs to know when to
/// retry.
fn published_policy(policy: &Policy, config: &GatewayConfig) -> serde_json::Value {
    let mut published =
        serde_json::to_value(policy.published("lease")).expect("the policy serialises");
    published["lease_seconds"] = policy.lease.as_secs().into();
    published["upstream_timeout_seconds"] = config.upstream_timeout.as_secs().into();
    published["claim_held_seconds"] = policy.lease_hold().as_secs().into();
    published["after_upstream_timeout"] = match config.on_timeout {
        UnknownOutcome::Keep => "504; the key stays in progress until its claim ends, then the next retry is sent upstream",
        UnknownOutcome::Store => "504, stored and replayed to every retry",
        UnknownOutcome::Release => "504; the next retry is sent upstream at once",
    }
    .into();
    if let Some(in_flight) = config.in_flight.published() {
        published["in_flight"] = in_flight.into();
    }
    published
}

/// The account a request is scoped to: the HMAC of its credential and its scope headers under
/// the server secret, so neither is ever stored. With no scope headers configured the HMAC is
/// the credential's alone, as before they existed, so records made then still match.
fn scope_of(
    secret: &Secret,
    credential: &HeaderName,
    scope_headers: &[HeaderName],
    parts: &http::request::Parts,
) -> AccountId {
    // Each scope header as its name and, so that absent and empty differ, a marker byte
    // before its value.
    let mut extra: Vec<Vec<u8>> = Vec::with_capacity(2 * scope_headers.len());
    for name in scope_headers {
        extra.push(name.as_str().as_bytes().to_vec());
        extra.push(match parts.headers.get(name) {
            Some(value) => [&[1u8][..], value.as_bytes()].concat(),
            None => vec![0],
        });
    }
    let any_scope_value = scope_headers.iter().any(|h| parts.headers.contains_key(h));
    let mut hashed: Vec<&[u8]> = Vec::with_capacity(2 + extra.len());
    match parts.headers.get(credential) {
        Some(value) => hashed.extend([&b"idem-scope"[..], value.as_bytes()]),
        None if !any_scope_value => return AccountId::new("anonymous"),
        None => hashed.push(b"idem-scope-anonymous"),
    }
    hashed.extend(extra.iter().map(Vec::as_slice));
    AccountId::new(format!("hmac:{}", &secret.hmac_hex(&hashed)[..32]))
}

async fn require_credential(
    State(auth): State<Arc<(HeaderName, bool)>>,
    request: Request,
    next: Next,
) -> Response {
    let (header_name, required) = &*auth;
    if *required && !request.headers().contains_key(header_name) {
        let body = serde_problem(
            StatusCode::UNAUTHORIZED,
            &format!("this gateway requires the {header_name} header"),
        );
        return (
            StatusCode::UNAUTHORIZED,
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/problem+json"),
                ),
                (header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")),
            ],
            body,
        )
            .into_response();
    }
    next.run(request).await
}

fn serde_problem(status: StatusCode, detail: &str) -> Body {
    Body::from(
        idem_core::Problem::other(
            "unauthorized",
            "Authentication required",
            status.as_u16(),
            detail,
        )
        .to_json(),
    )
}

/// Serves the gateway on `listener` until `shutdown` completes, closing connections whose
/// request head does not arrive within `config.head_timeout`.
pub async fn serve<St: Store>(
    listener: TcpListener,
    store: St,
    config: GatewayConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let head_timeout = config.head_timeout;
    match config.tls.clone() {
        Some(tls) => {
            server::serve_tls(listener, router(store, config), head_timeout, tls, shutdown).await
        }
        None => server::serve(listener, router(store, config), head_timeout, shutdown).await,
    }
}
