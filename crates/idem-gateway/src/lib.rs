//! `idem proxy`: the idempotency contract (docs/contract.md §2) in front of any HTTP API, in any language.
//!
//! The gateway is [`idem_tower::IdempotencyLayer`] in lease mode around a reverse proxy. It
//! scopes keys to the caller's credential (a header, or a session cookie: [`Credential`]) as
//! HMAC-SHA256(server secret, credential), so a guessed key never reaches another client's
//! response, refuses a covered request that carries no credential with `401
//! urn:idem:problem:no-credential` rather than file it under a scope shared with every other
//! such caller ([`Anonymous`]; a webhook route is scoped by its route), forwards the key (or a
//! key derived from it) so an idempotent upstream can dedupe too, and tells the layer what
//! each upstream answer means:
//!
//! | upstream | client gets | the key |
//! | --- | --- | --- |
//! | refused the connection (nothing sent) | `502` | released: the retry runs fresh |
//! | answered 2xx/3xx/4xx | the answer | stored and replayed (rejections before work excepted) |
//! | answered 5xx | the answer | stored and replayed, as Stripe does ([`UnknownOutcome`] to change) |
//! | timed out after the request was sent | `504` | kept in progress until its lease ends; then the next retry is sent upstream with the same key |
//!
//! An answer larger than the storage cap (`Policy::storage_cap`, 1 MiB) is stored with its
//! body omitted as soon as that shows, then streamed on, so the gateway holds at most the cap
//! of it; uncovered methods and `key = "off"` routes stream both ways untouched.
//!
//! Gateways that share a store share their scopes: the secret lives in the store, made by
//! whichever starts first ([`Secret::shared`]), unless one is given ([`Secret::new`]).
//!
//! Paths may have rules of their own ([`GatewayConfig::routes`], read from a configuration
//! file by [`ConfigFile`]): each route gets its own layer over the one upstream client, and a
//! request no route matches gets the configuration's top-level rules.
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

#![warn(clippy::missing_errors_doc, clippy::missing_panics_doc)]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use idem_core::{AccountId, Clock, ErrorDialect, Policy, ProblemKind, SystemClock};
use idem_store::Store;
use idem_tower::{IdempotencyLayer, LeaseMode, Outcome, OutcomeSignal, ResponseBody, Unidentified};
use tokio::net::TcpListener;
use tower::Layer as _;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

mod config;
mod credential;
mod duration;
mod routes;
mod secret;
pub mod server;
pub mod tls;
mod upstream;
mod wake;

pub use config::{
    ConfigError, ConfigFile, Defaults, FingerprintRule, KeyFrom, KeyRule, Route, RouteRules,
    describe,
};
pub use credential::{Anonymous, AnonymousError, Credential, CredentialError};
pub use routes::{RouteError, RoutePattern};
pub use secret::{SCOPE_SECRET, Secret, SecretError, SecretOrigin};
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
    /// Where the caller's credential is: a header (default `Authorization`) or a cookie.
    pub credential: Credential,
    /// More headers that, with the credential, make the scope (all HMACed together), such as
    /// `Stripe-Account`: a platform that calls for many accounts with one API key gets a
    /// scope per account, so one account's response is never replayed to another.
    pub scope_headers: Vec<HeaderName>,
    /// What a covered request without the credential gets on paths no route matches (default:
    /// `401 no-credential`).
    pub anonymous: Anonymous,
    /// Refuse every request without the credential with `401 no-credential`, whatever its
    /// method, route or key: uncovered methods, `key = "off"` routes, keyless requests where
    /// keys are optional and webhook routes included, so the gateway lets no anonymous caller
    /// through (default: only covered requests need it, as [`anonymous`](Self::anonymous) and
    /// each route's rule say).
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
    /// What a duplicate gets while the first request with its key is at the upstream, on
    /// paths no route matches (default: `409` at once).
    pub in_flight: InFlight,
    /// What wakes duplicates that wait ([`InFlight::Wait`]), on every route. The default wakes
    /// those in this process only; gateways sharing a store each need the store's
    /// ([`outcome_signal`]).
    pub outcome_signal: idem_tower::OutcomeSignal,
    /// Paths with rules of their own, tried in order; a request that matches none gets the
    /// rules above (default: none, one set of rules for every path).
    pub routes: Vec<Route>,
    /// How often the routes delete expired records from the store, one sweeper for them all
    /// from the first request on (default: every minute, [`idem_tower::DEFAULT_SWEEP_EVERY`]);
    /// `None` for a gateway whose store something else sweeps (`idem proxy` sweeps from its
    /// start, with [`idem_tower::spawn_sweeper`]).
    pub sweep_every: Option<Duration>,
}

impl GatewayConfig {
    /// The defaults for `upstream`.
    ///
    /// # Errors
    ///
    /// [`TlsError::Rustls`] when the platform's root certificates cannot be loaded.
    pub fn new(upstream: Uri, secret: Secret) -> Result<Self, TlsError> {
        Ok(Self {
            upstream,
            secret,
            credential: Credential::default(),
            scope_headers: Vec::new(),
            anonymous: Anonymous::Refuse,
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
            routes: Vec::new(),
            sweep_every: Some(idem_tower::DEFAULT_SWEEP_EVERY),
        })
    }

    /// The rules a request that matches no route gets, as a route's rules.
    pub fn default_rules(&self) -> RouteRules {
        RouteRules {
            key: if self.policy.covered_methods.is_empty() {
                KeyRule::Off
            } else if self.policy.require_key {
                KeyRule::Required
            } else {
                KeyRule::Optional
            },
            scope_headers: self.scope_headers.clone(),
            anonymous: self.anonymous,
            store_headers: self
                .policy
                .stored_headers
                .iter()
                .filter_map(|name| HeaderName::try_from(name.as_str()).ok())
                .collect(),
            errors: self.errors,
            retention: self.policy.retention,
            in_flight: self.in_flight,
            ..RouteRules::default()
        }
    }

    /// Sets the rules a request that matches no route gets (the inverse of
    /// [`default_rules`](Self::default_rules); `key = "off"` leaves every method uncovered).
    pub fn set_default_rules(&mut self, rules: &RouteRules) {
        self.policy.require_key = rules.key == KeyRule::Required;
        if rules.key == KeyRule::Off {
            self.policy.covered_methods.clear();
        }
        self.scope_headers = rules.scope_headers.clone();
        self.anonymous = rules.anonymous;
        self.policy.stored_headers = rules
            .store_headers
            .iter()
            .map(|h| h.as_str().to_owned())
            .collect();
        self.errors = rules.errors;
        self.policy.retention = rules.retention;
        self.in_flight = rules.in_flight;
    }

    /// Applies a configuration file: its credential, its `[defaults]` over this
    /// configuration's own rules, then its routes, each over those defaults.
    pub fn apply_file(&mut self, file: &ConfigFile) {
        if let Some(credential) = &file.credential {
            self.credential = credential.clone();
        }
        let mut defaults = self.default_rules();
        file.defaults.apply(&mut defaults);
        self.set_default_rules(&defaults);
        self.routes = file.routes(&defaults);
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

    // One signal for every route; the store's (`outcome_signal`) also wakes a duplicate
    // whose original runs in another gateway process.
    let signal = config.outcome_signal.clone();
    // Every route's layer is a clone of this one, so that they share its sweeper: one for the
    // store, however many routes.
    // The upstream gets the key as `forwarding` says, never the layer's downstream key.
    let base = IdempotencyLayer::leased(store)
        .with_clock(config.clock.clone())
        .without_downstream_key();
    let base = match config.sweep_every {
        Some(every) => base.with_sweep_every(every),
        None => base.without_sweeper(),
    };
    let defaults = config.default_rules();
    let fallback = route_service(&base, &config, &defaults, None, &upstream, &signal);
    let mut published = published_policy(&route_policy(&config, &defaults, None), &config);
    published["credential"] = config.credential.to_string().into();
    published["anonymous"] = defaults.anonymous.as_str().into();
    let services = if config.routes.is_empty() {
        fallback
    } else {
        published["routes"] = config
            .routes
            .iter()
            .map(|route| published_route(route, &config.credential))
            .collect();
        let routes = config
            .routes
            .iter()
            .map(|route| {
                let service = route_service(
                    &base,
                    &config,
                    &route.rules,
                    Some(&route.pattern),
                    &upstream,
                    &signal,
                );
                (route.pattern.clone(), service)
            })
            .collect();
        BoxCloneSyncService::new(routes::Dispatch { routes, fallback })
    };
    let published = Arc::new(published);
    let router = Router::new()
        .route(
            POLICY_PATH,
            axum::routing::get(move || {
                let published = published.clone();
                async move { axum::Json((*published).clone()) }
            }),
        )
        .fallback_service(services);
    if !config.require_auth {
        // Nothing to refuse: no middleware to pass through (it boxes every request's future
        // and clones the router behind it).
        return router;
    }
    let credential = Arc::new(config.credential.clone());
    router.layer(axum::middleware::from_fn_with_state(
        credential,
        require_credential,
    ))
}

/// The policy of a route with `rules`: the configuration's, with the route's key rule,
/// retention and stored headers, covering the route's `method` (`None`: the configuration's
/// methods, for requests no route matches).
fn route_policy(config: &GatewayConfig, rules: &RouteRules, method: Option<&Method>) -> Policy {
    let mut policy = Policy {
        // A claim outlasts its longest upstream call, so a crashed gateway's key is not taken
        // over (and the request forwarded again) while the upstream may still be working on it.
        downstream_timeout: config
            .policy
            .downstream_timeout
            .max(config.upstream_timeout),
        require_key: rules.key == KeyRule::Required,
        retention: rules.retention,
        stored_headers: rules
            .store_headers
            .iter()
            .map(|h| h.as_str().to_owned())
            .collect(),
        ..config.policy.clone()
    };
    if let Some(method) = method {
        policy.covered_methods = vec![method.as_str().to_owned()];
    }
    policy
}

/// One route's service over the shared upstream: the upstream alone for `key = "off"` (no
/// layer: the request and the answer stream through), else the idempotency layer with the
/// route's rules, which buffers a covered request's body and at most the storage cap of its
/// answer (docs/contract.md §9).
fn route_service<St: Store>(
    base: &IdempotencyLayer<LeaseMode<St>>,
    config: &GatewayConfig,
    rules: &RouteRules,
    pattern: Option<&RoutePattern>,
    upstream: &Upstream,
    signal: &OutcomeSignal,
) -> routes::RouteService {
    if rules.key == KeyRule::Off {
        return BoxCloneSyncService::new(upstream.clone());
    }
    let scoping = Scoping {
        secret: config.secret.clone(),
        credential: config.credential.clone(),
        scope_headers: rules.scope_headers.clone(),
        anonymous: rules.anonymous,
        route: pattern.map_or_else(|| "*".to_owned(), RoutePattern::to_string),
    };
    let method = pattern.map(RoutePattern::method);
    let layer = base
        .clone()
        .with_policy(route_policy(config, rules, method))
        .with_policy_link(POLICY_PATH)
        .with_error_dialect(rules.errors)
        .with_account(move |parts| scoping.account(parts));
    let layer = match &rules.key_from {
        // The layer's own default keeps its messages naming `Idempotency-Key` as spelled.
        key_from if *key_from == KeyFrom::default() => layer,
        KeyFrom::Headers(names) => layer.with_key_headers(names.iter().map(HeaderName::as_str)),
        KeyFrom::Body(pointer) => layer.with_key_from_body(pointer),
    };
    let layer = match &rules.fingerprint {
        FingerprintRule::Whole => layer,
        FingerprintRule::Ignore(pointers) => layer.with_fingerprint_ignoring(pointers),
        FingerprintRule::Only(pointers) => layer.with_fingerprint_only(pointers),
    };
    let layer = with_in_flight(layer, rules.in_flight, signal);
    // The layer's body streams the upstream's (past the storage cap, or uncovered); axum's
    // `Body` only boxes it.
    let service = ServiceExt::<Request>::map_response(
        layer.layer(upstream.clone()),
        |response: http::Response<ResponseBody<Body>>| response.map(Body::new),
    );
    match config.credential.challenge() {
        Some(challenge) if rules.anonymous == Anonymous::Refuse => {
            BoxCloneSyncService::new(Challenged {
                inner: service,
                credential: Arc::new(config.credential.clone()),
                challenge,
            })
        }
        _ => BoxCloneSyncService::new(service),
    }
}

/// Applies a route's `in_flight`: a duplicate waits for the original's outcome, woken by
/// `signal`, or gets `409` at once.
fn with_in_flight<St: Store>(
    layer: IdempotencyLayer<LeaseMode<St>>,
    rule: InFlight,
    signal: &OutcomeSignal,
) -> IdempotencyLayer<LeaseMode<St>> {
    match rule {
        InFlight::Refuse => layer,
        InFlight::Wait(max) => layer.with_outcome_signal(max, signal.clone()),
    }
}

/// A route's rules as the published policy lists them.
fn published_route(route: &Route, credential: &Credential) -> serde_json::Value {
    let mut published = serde_json::Map::new();
    published.insert("match".into(), route.pattern.to_string().into());
    for (name, value) in route.rules.described(credential) {
        published.insert(name.into(), value);
    }
    if route.rules.key != KeyRule::Off {
        published.insert(
            "retention_seconds".into(),
            route.rules.retention.as_secs().into(),
        );
    }
    published.into()
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

/// How a route finds the account a request is scoped to.
struct Scoping {
    secret: Secret,
    credential: Credential,
    scope_headers: Vec<HeaderName>,
    anonymous: Anonymous,
    /// The route's `match` (`*` for requests no route matches), for [`Anonymous::Route`].
    route: String,
}

impl Scoping {
    /// The HMAC of the request's credential and its scope headers under the server secret, so
    /// neither is ever stored. With no scope headers configured the HMAC is the credential's
    /// alone, and a header credential is hashed as it was before cookies and scope headers
    /// existed, so records made then still match. Without a credential: the route's rule
    /// ([`Anonymous`]).
    fn account(&self, parts: &http::request::Parts) -> Result<AccountId, Unidentified> {
        // Each scope header as its name and, so that absent and empty differ, a marker byte
        // before its value.
        let mut extra: Vec<Vec<u8>> = Vec::with_capacity(2 * self.scope_headers.len());
        for name in &self.scope_headers {
            extra.push(name.as_str().as_bytes().to_vec());
            extra.push(match parts.headers.get(name) {
                Some(value) => [&[1u8][..], value.as_bytes()].concat(),
                None => vec![0],
            });
        }
        let any_scope_value = self
            .scope_headers
            .iter()
            .any(|h| parts.headers.contains_key(h));
        let values = self.credential.values(&parts.headers);
        let count = values.len().to_be_bytes();
        let mut hashed: Vec<&[u8]> = Vec::with_capacity(3 + values.len() + extra.len());
        match (&self.credential, values.is_empty(), self.anonymous) {
            (Credential::Header(_), false, _) => hashed.extend([&b"idem-scope"[..], values[0]]),
            (Credential::Cookie(name), false, _) => {
                hashed.extend([&b"idem-scope-cookie"[..], name.as_bytes(), &count]);
                hashed.extend(values);
            }
            (_, true, Anonymous::Refuse) => {
                if let Some(seen) = parts.extensions.get::<RefusedForNoCredential>() {
                    seen.0.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                return Err(Unidentified::NoCredential(format!(
                    "this request needs {}: its key is scoped to the caller it identifies, so \
                     that no caller is ever replayed another's answer; nothing was run or stored",
                    self.credential.needed()
                )));
            }
            (_, true, Anonymous::Route) if !any_scope_value => {
                return Ok(AccountId::new(format!("route:{}", self.route)));
            }
            (_, true, Anonymous::Route) => {
                hashed.extend([&b"idem-scope-route"[..], self.route.as_bytes()]);
            }
            // Where gateways before the refusal filed every caller without a credential.
            (_, true, Anonymous::Shared) if !any_scope_value => {
                return Ok(AccountId::new("anonymous"));
            }
            (_, true, Anonymous::Shared) => hashed.push(b"idem-scope-anonymous"),
        }
        hashed.extend(extra.iter().map(Vec::as_slice));
        Ok(self.secret.account(&hashed))
    }
}

/// Set by a route's [`Scoping`] when it refuses the request for want of a credential, so that
/// [`Challenged`] adds the challenge to that refusal only (not to an upstream's own `401`).
#[derive(Clone)]
struct RefusedForNoCredential(Arc<std::sync::atomic::AtomicBool>);

/// A route's service that adds `WWW-Authenticate` to the layer's `401 no-credential`.
#[derive(Clone)]
struct Challenged<S> {
    inner: S,
    credential: Arc<Credential>,
    challenge: HeaderValue,
}

impl<S> tower::Service<Request> for Challenged<S>
where
    S: tower::Service<Request, Response = Response, Error = std::convert::Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = futures_util::future::Either<
        S::Future,
        std::pin::Pin<Box<dyn Future<Output = Result<Response, Self::Error>> + Send>>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        // Most requests carry their credential: they go through as they are.
        if self.credential.is_present(request.headers()) {
            return futures_util::future::Either::Left(self.inner.call(request));
        }
        let seen = Arc::new(std::sync::atomic::AtomicBool::new(false));
        request
            .extensions_mut()
            .insert(RefusedForNoCredential(seen.clone()));
        let answer = self.inner.call(request);
        let challenge = self.challenge.clone();
        futures_util::future::Either::Right(Box::pin(async move {
            let mut response = answer.await?;
            if seen.load(std::sync::atomic::Ordering::Relaxed) {
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, challenge);
            }
            Ok(response)
        }))
    }
}

/// `require_auth`: refuses every request without the credential with `401 no-credential`.
async fn require_credential(
    State(credential): State<Arc<Credential>>,
    request: Request,
    next: Next,
) -> Response {
    if credential.is_present(request.headers()) {
        return next.run(request).await;
    }
    let problem = ProblemKind::NoCredential.with_detail(format!(
        "this gateway requires {} on every request; nothing was forwarded",
        credential.needed()
    ));
    let mut response = (
        StatusCode::UNAUTHORIZED,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        )],
        problem.to_json(),
    )
        .into_response();
    if let Some(challenge) = credential.challenge() {
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, challenge);
    }
    response
}

/// Serves the gateway on `listener` until `shutdown` completes, closing connections whose
/// request head does not arrive within `config.head_timeout`.
///
/// # Errors
///
/// None in practice: a failed accept (out of file descriptors, say) is logged and retried, and
/// it returns `Ok(())` once `shutdown` completes and open connections have finished or been
/// closed.
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
