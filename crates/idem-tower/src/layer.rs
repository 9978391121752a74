//! [`IdempotencyLayer`] and the [`Idempotency`] service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Buf;
use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use idem_core::{
    AccountId, Clock, Decision, ErrorDialect, Fingerprint, IdempotencyKey, KeyError, Policy,
    RequestParts, Scope, SystemClock, Timestamp, decide,
};
use idem_store::{OutcomeChannel, Store, TransactionalStore};
use tower::{Layer, Service};

use crate::body::ResponseBody;
use crate::claim::Claim;
use crate::grpc::{self, GrpcMethods};
use crate::mode::{LeaseMode, Mode, OutcomeWait, TransactionMode};
use crate::rebuild::RebuildBody;
use crate::response::{MadeBody, Refusal, Refused, Served, answer, store_unavailable};
use crate::section::{Panicked, Section};
use crate::signal::LazyListener;
use crate::sweep::{DEFAULT_SWEEP_EVERY, Sweeper};
use crate::telemetry;
use crate::{OutcomeSignal, Reconciliation};

/// Finds the account a request acts for, or says why there is none.
type AccountFn = Arc<dyn Fn(&Parts) -> Result<AccountId, Unidentified> + Send + Sync>;

/// Why a covered request has no account. The layer refuses such a request rather than file its
/// key under a scope shared with every other caller it cannot tell apart (docs/contract.md
/// §12), which would hand one caller another's stored answer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unidentified {
    /// Nothing before the layer said who the caller is: the service's authentication did not
    /// run first, or found no account. `500 urn:idem:problem:no-account`, and the
    /// misconfiguration is logged once per process.
    NoAccount,
    /// The caller sent no credential to derive its scope from. `401
    /// urn:idem:problem:no-credential`; the text tells the caller what to send.
    NoCredential(String),
}

/// Applies the idem HTTP contract (docs/contract.md §2) to the wrapped service.
///
/// Build it with [`IdempotencyLayer::transactional`] (the handler's writes share the key's
/// transaction) or [`IdempotencyLayer::leased`] (the work calls something outside the
/// database), then adjust it with the `with_*` setters.
#[derive(Clone)]
pub struct IdempotencyLayer<M> {
    mode: M,
    policy: Arc<Policy>,
    clock: Arc<dyn Clock>,
    account: AccountFn,
    replay_read: bool,
    /// `Link: <URL>; rel="describedby"` for the layer's own 400, 409 and 422.
    policy_link: Option<http::HeaderValue>,
    /// How the layer's own problem bodies are written.
    errors: ErrorDialect,
    /// Where the key comes from.
    key_source: Arc<KeySource>,
    /// What of a JSON body the fingerprint covers.
    body_selection: Arc<BodySelection>,
    /// Deletes expired records; shared by every clone.
    sweeper: Sweeper,
    /// gRPC methods with rules of their own.
    grpc: Arc<GrpcMethods>,
}

/// Where a request's key is found.
#[derive(Debug)]
enum KeySource {
    /// The first of these headers present (`label` names them for a `400`).
    Headers {
        names: Vec<http::HeaderName>,
        label: String,
    },
    /// The string at this JSON pointer in the body.
    Body(String),
}

impl Default for KeySource {
    fn default() -> Self {
        Self::Headers {
            names: vec![http::HeaderName::from_static("idempotency-key")],
            label: "Idempotency-Key".into(),
        }
    }
}

/// What of a JSON body the fingerprint covers.
#[derive(Debug, Default)]
enum BodySelection {
    #[default]
    Whole,
    Ignore(Vec<String>),
    Only(Vec<String>),
}

impl<M: fmt::Debug> fmt::Debug for IdempotencyLayer<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("mode", &self.mode)
            .field("policy", &self.policy)
            .field("clock", &self.clock)
            .field("replay_read", &self.replay_read)
            .field("policy_link", &self.policy_link)
            .field("errors", &self.errors)
            .field("key_source", &self.key_source)
            .field("body_selection", &self.body_selection)
            .field("sweeper", &self.sweeper)
            .field("grpc", &self.grpc)
            .finish_non_exhaustive()
    }
}

impl<M: Mode> IdempotencyLayer<M> {
    pub(crate) fn with_mode(mode: M) -> Self {
        // Where a lost claim answers as cheaply as a read, reading first only adds a round
        // trip to every first request.
        let replay_read = !mode.claim_answers_like_a_read();
        Self {
            mode,
            policy: Arc::new(Policy::default()),
            clock: Arc::new(SystemClock),
            account: Arc::new(account_from_extensions),
            replay_read,
            policy_link: None,
            errors: ErrorDialect::Problem,
            key_source: Arc::default(),
            body_selection: Arc::default(),
            sweeper: Sweeper::every(DEFAULT_SWEEP_EVERY),
            grpc: Arc::default(),
        }
    }

    /// Reads the key from the first of `names` the request carries, instead of from
    /// `Idempotency-Key` alone: aliases for clients that send `X-Idempotency-Key`, or one
    /// header a sender fills with its own id, such as `X-GitHub-Delivery` for webhooks (each
    /// redelivery carries the same id, so it runs once). A request with two of the headers is
    /// refused with `400 malformed-key`, since they could disagree.
    ///
    /// # Panics
    ///
    /// When `names` is empty or one of them is not a valid header name.
    pub fn with_key_headers<N: AsRef<str>>(mut self, names: impl IntoIterator<Item = N>) -> Self {
        let spelled: Vec<String> = names.into_iter().map(|n| n.as_ref().to_owned()).collect();
        assert!(!spelled.is_empty(), "at least one key header");
        let names = spelled
            .iter()
            .map(|n| http::HeaderName::try_from(n.as_str()).expect("a header name"))
            .collect();
        self.key_source = Arc::new(KeySource::Headers {
            names,
            label: spelled.join(" or "),
        });
        self
    }

    /// Reads the key from the JSON body: the string at `pointer` (RFC 6901, such as `/id`
    /// for the event id of a Stripe webhook). A body without a string there is refused with
    /// `400 missing-key` when keys are required (and passed through when they are not); the
    /// body is read for the fingerprint anyway, so this costs one more parse of it.
    ///
    /// # Panics
    ///
    /// When `pointer` is not a JSON pointer to a member (see [`Fingerprint::check_pointer`]).
    pub fn with_key_from_body(mut self, pointer: &str) -> Self {
        Fingerprint::check_pointer(pointer).expect("a JSON pointer");
        self.key_source = Arc::new(KeySource::Body(pointer.to_owned()));
        self
    }

    /// Leaves the members at `pointers` (RFC 6901 JSON pointers, such as
    /// `/metadata/trace_id`) out of a JSON body's fingerprint: a retry that differs only in
    /// them replays instead of getting `422`.
    ///
    /// # Panics
    ///
    /// When a pointer is not a JSON pointer to a member (see [`Fingerprint::check_pointer`]).
    pub fn with_fingerprint_ignoring<P: AsRef<str>>(
        self,
        pointers: impl IntoIterator<Item = P>,
    ) -> Self {
        self.with_body_selection(BodySelection::Ignore(checked_pointers(pointers)))
    }

    /// Fingerprints only the members at `pointers` of a JSON body: a retry that differs
    /// anywhere else replays.
    ///
    /// # Panics
    ///
    /// When a pointer is not a JSON pointer to a member (see [`Fingerprint::check_pointer`]).
    pub fn with_fingerprint_only<P: AsRef<str>>(
        self,
        pointers: impl IntoIterator<Item = P>,
    ) -> Self {
        self.with_body_selection(BodySelection::Only(checked_pointers(pointers)))
    }

    fn with_body_selection(mut self, selection: BodySelection) -> Self {
        self.body_selection = Arc::new(selection);
        self
    }

    /// Writes the layer's own problem bodies in `dialect`: [`ErrorDialect::Stripe`] adds the
    /// `error` member Stripe's SDKs look for, so they raise on a `409` or `422` from idem
    /// instead of returning its body as the result.
    pub fn with_error_dialect(mut self, dialect: ErrorDialect) -> Self {
        self.errors = dialect;
        self
    }

    /// Points the layer's own `400`, `409` and `422` answers at the published rules with
    /// `Link: <url>; rel="describedby"` (docs/contract.md §9), so a client that meets a
    /// refusal can find why. `url` is where the service publishes its policy (idem serve:
    /// `/idempotency-policy`).
    ///
    /// # Panics
    ///
    /// When `url` cannot be part of a header value (a control character, say).
    pub fn with_policy_link(mut self, url: &str) -> Self {
        let link = format!("<{url}>; rel=\"describedby\"");
        self.policy_link =
            Some(http::HeaderValue::try_from(link).expect("a policy URL fit for a header"));
        self
    }

    /// Replaces the [`Policy`] (default: [`Policy::default`]).
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = Arc::new(policy);
        self
    }

    /// Replaces the clock (default: the system clock).
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Sets how the account is found. The default reads the [`AccountId`] request extension
    /// that the service's authentication put there, and refuses a covered request without one
    /// ([`Unidentified::NoAccount`]). `account` may refuse likewise: the request is then
    /// answered with the refusal's problem, and nothing runs or is stored.
    pub fn with_account(
        mut self,
        account: impl Fn(&Parts) -> Result<AccountId, Unidentified> + Send + Sync + 'static,
    ) -> Self {
        self.account = Arc::new(account);
        self
    }

    /// Files every covered request that carries no [`AccountId`] under one shared scope,
    /// `anonymous`, instead of refusing it.
    ///
    /// **The risk:** keys are then global among unidentified callers, so a caller who sends
    /// another's key with the same body is replayed the other's stored response (an order, an
    /// address, a payment). Only for services whose callers are never told apart and whose
    /// responses hold nothing private.
    pub fn with_shared_anonymous_scope(mut self) -> Self {
        self.account = Arc::new(|parts: &Parts| {
            Ok(parts
                .extensions
                .get::<AccountId>()
                .cloned()
                .unwrap_or_else(|| AccountId::new("anonymous")))
        });
        self
    }

    /// Names the gRPC methods that stream (`/payments.v1.Payments/WatchPayments`): their
    /// calls pass through untouched, key or not. Nothing on the wire tells a streaming call
    /// from a unary one, and the layer reads a covered call's request and response whole, so
    /// a streaming method called with a key must be named here (docs/contract.md §14).
    pub fn with_grpc_streaming<P: AsRef<str>>(
        mut self,
        methods: impl IntoIterator<Item = P>,
    ) -> Self {
        Arc::make_mut(&mut self.grpc)
            .streaming
            .extend(methods.into_iter().map(|m| m.as_ref().to_owned()));
        self
    }

    /// Names the gRPC methods (`/payments.v1.Payments/CreatePayment`) whose calls must carry
    /// an `idempotency-key`: one without is refused with `INVALID_ARGUMENT`. A call to any
    /// other method without a key passes through (docs/contract.md §14), whatever
    /// [`Policy::require_key`] says, which is for HTTP requests.
    pub fn with_grpc_key_required<P: AsRef<str>>(
        mut self,
        methods: impl IntoIterator<Item = P>,
    ) -> Self {
        Arc::make_mut(&mut self.grpc)
            .key_required
            .extend(methods.into_iter().map(|m| m.as_ref().to_owned()));
        self
    }

    /// Skips the read that answers replays before anything is claimed. A first request then
    /// costs one statement less (on PgStore five instead of six: the claim comes first), and a
    /// replay costs what a lost claim does (in transaction mode BEGIN, the claim, a read,
    /// ROLLBACK) instead of one read. The answers are the same either way: every decision is
    /// also taken after the claim. For APIs whose retries are rare. Stores whose claim answers
    /// like a read (Redis, TokioPgStore) skip it from the start.
    pub fn without_replay_read(mut self) -> Self {
        self.replay_read = false;
        self
    }

    /// Reads before every claim, to answer replays with that read, also on a store whose claim
    /// answers like a read (which skips it by default). On TokioPgStore a replay is then one
    /// read instead of a lost claim (about a third of PostgreSQL's work), and every first
    /// request one round trip longer: for APIs whose requests are mostly retries.
    pub fn with_replay_read(mut self) -> Self {
        self.replay_read = true;
        self
    }

    /// Deletes expired records every `every` (default a minute), in the background, from
    /// the layer's first request on: one sweeper for the layer and all its clones, which ends
    /// with the last of them (see [`spawn_sweeper`](crate::spawn_sweeper) for how it sweeps).
    pub fn with_sweep_every(mut self, every: Duration) -> Self {
        self.sweeper = Sweeper::every(every);
        self
    }

    /// Runs no sweeper: expired records stay until something else deletes them (a
    /// [`spawn_sweeper`](crate::spawn_sweeper) of the app's own, another service on the same
    /// store). Without any, the key table grows for ever.
    pub fn without_sweeper(mut self) -> Self {
        self.sweeper = Sweeper::off();
        self
    }

    /// The policy in force.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }
}

fn checked_pointers<P: AsRef<str>>(pointers: impl IntoIterator<Item = P>) -> Vec<String> {
    pointers
        .into_iter()
        .map(|p| {
            Fingerprint::check_pointer(p.as_ref()).expect("a JSON pointer");
            p.as_ref().to_owned()
        })
        .collect()
}

/// The default account: the [`AccountId`] extension the service's authentication set.
fn account_from_extensions(parts: &Parts) -> Result<AccountId, Unidentified> {
    parts
        .extensions
        .get::<AccountId>()
        .cloned()
        .ok_or(Unidentified::NoAccount)
}

/// Logs, once per process, why requests are refused with `no-account`: it is a wiring mistake
/// that every covered request repeats, so one line that names the fix is worth more than a
/// line per request.
fn log_no_account_once(parts: &Parts) {
    static LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::error!(
            method = %parts.method,
            path = parts.uri.path(),
            "IdempotencyLayer refuses covered requests with 500 no-account: no AccountId \
             request extension. Put your authentication outside the layer so it runs first \
             (in axum the last .layer() runs first: call .layer(auth) after \
             .layer(IdempotencyLayer::..)), or set with_account; with_shared_anonymous_scope \
             shares one scope among all unidentified callers (one can be replayed another's \
             answer). Logged once."
        );
    }
}

impl<St: TransactionalStore> IdempotencyLayer<TransactionMode<St>> {
    /// A layer in transaction mode over `store`.
    pub fn transactional(store: St) -> Self {
        Self::with_mode(TransactionMode::new(store))
    }
}

impl<St: Store> IdempotencyLayer<LeaseMode<St>> {
    /// A layer in lease mode over `store`. A claim whose lease ran out (its worker crashed) is
    /// taken over by the next retry of the same request, which runs the work again: right when
    /// the work passes the key downstream to a service that dedupes on it.
    pub fn leased(store: St) -> Self {
        Self::with_mode(LeaseMode::new(store))
    }

    /// [`with_outcome_wait`](Self::with_outcome_wait) with a signal of the caller's, for a
    /// store that is no [`OutcomeChannel`] or a signal shared with other layers: a duplicate
    /// waits up to `max` for the original's outcome, woken by `signal` (not by polling),
    /// instead of taking `409` at once. Past `max` it gets the `409`. This layer wakes
    /// `signal` when it stores an outcome; waking it for outcomes stored elsewhere (other
    /// processes, a reconciler) is the caller's part ([`OutcomeSignal::for_store`] does it
    /// through the store).
    pub fn with_outcome_signal(mut self, max: Duration, signal: OutcomeSignal) -> Self {
        self.mode.wait = Some(OutcomeWait {
            max,
            signal,
            listener: None,
        });
        self
    }

    /// The signal that wakes this layer's waiting duplicates, if they wait
    /// ([`with_outcome_wait`](Self::with_outcome_wait)): for a reconciler of the app's own
    /// that resolves an outcome and wakes them ([`OutcomeSignal::wake`]).
    pub fn outcome_signal(&self) -> Option<&OutcomeSignal> {
        self.mode.wait.as_ref().map(|wait| &wait.signal)
    }

    /// Never takes over a claim whose lease ran out: retries get `409` until a reconciler
    /// has found out what happened and completed or released the record.
    pub fn without_takeover(mut self) -> Self {
        self.mode.take_over = false;
        self
    }

    /// Leaves the [`DownstreamKey`](idem_core::DownstreamKey) out of the work's request: for
    /// work that never passes one on (a proxy that forwards a key of its own), which then
    /// saves a SHA-256 per request. The [`Downstream`](crate::Downstream) extractor refuses
    /// such a request with `500`, naming what is missing.
    pub fn without_downstream_key(mut self) -> Self {
        self.mode.downstream_key = false;
        self
    }

    /// Tells the layer that a reconciler resolves records whose outcome is unknown, on
    /// `schedule`. When a handler returns [`Outcome::Unknown`], its calls are over, so the
    /// layer ends the record's lease at once and asks for a pass instead of letting the lease
    /// run out; the handler's answer and every duplicate's `409 outcome-unknown` carry a
    /// `Retry-After` that points just past that pass. With [`with_outcome_wait`], duplicates
    /// also wait for the reconciler's verdict: the reconciler wakes them by the key's label
    /// through [`outcome_signal`](Self::outcome_signal), which also tells the other processes
    /// on the store.
    ///
    /// [`Outcome::Unknown`]: crate::Outcome::Unknown
    /// [`with_outcome_wait`]: Self::with_outcome_wait
    pub fn with_reconciliation(mut self, schedule: Reconciliation) -> Self {
        self.mode.reconciliation = Some(schedule);
        self
    }
}

impl<St: OutcomeChannel> IdempotencyLayer<LeaseMode<St>> {
    /// Lets a duplicate wait up to `max` for the original's outcome instead of taking `409` at
    /// once; past `max` it gets the `409`. It is woken when the outcome is stored, never by
    /// polling the store: by this process directly, and through the store's own notification
    /// ([`OutcomeChannel`]) when another process sharing the store stores it (or, where the
    /// store cannot tell, by looking again every [`OutcomeChannel::outcome_poll`]).
    ///
    /// The store's listener starts with the layer's first request, inside the runtime, before
    /// that request looks at the store; if it cannot start, within a few seconds, the request
    /// is answered `503 store-unavailable` (logged) and the next one tries again. It ends with
    /// the last clone of the layer. To share one signal among several layers, or to bring
    /// your own, use [`with_outcome_signal`](Self::with_outcome_signal).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_store::MemoryStore;
    /// use idem_tower::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::leased(MemoryStore::new())
    ///     .with_outcome_wait(Duration::from_secs(10));
    /// # let _ = layer;
    /// ```
    pub fn with_outcome_wait(self, max: Duration) -> Self {
        let signal = OutcomeSignal::publishing_to(self.mode.store());
        let listener = Arc::new(LazyListener::new(self.mode.store(), &signal));
        let mut layer = self.with_outcome_signal(max, signal);
        if let Some(wait) = &mut layer.mode.wait {
            wait.listener = Some(listener);
        }
        layer
    }
}

impl<S, M: Clone> Layer<S> for IdempotencyLayer<M> {
    type Service = Idempotency<S, M>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around `S`.
///
/// It answers with a [`ResponseBody`] around `S`'s body. That body must be `Unpin`, because the
/// layer reads the first bytes of a response and hands the rest on unread: axum's and hyper's
/// bodies are, and boxing makes any other one so (axum's `Body::new`).
#[derive(Clone)]
pub struct Idempotency<S, M> {
    inner: S,
    layer: IdempotencyLayer<M>,
}

impl<S: fmt::Debug, M: fmt::Debug> fmt::Debug for Idempotency<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

impl<S, M, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, M>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    M: Mode,
    ReqBody: RebuildBody + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: fmt::Display,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        if !self.layer.policy.covers(request.method().as_str()) {
            return ResponseFuture::passthrough(self.inner.call(request));
        }
        self.layer
            .sweeper
            .start(self.layer.mode.store(), &self.layer.clock);
        let grpc = grpc::is_grpc(request.headers());
        if grpc && self.layer.grpc.streaming.contains(request.uri().path()) {
            return ResponseFuture::passthrough(self.inner.call(request));
        }
        // The ready service goes with the request; a fresh clone waits for the next one.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        let span = telemetry::request_span(layer.mode.name(), grpc);
        ResponseFuture::guarded(telemetry::in_request_span(
            span,
            Box::pin(async move {
                let (link, errors) = (layer.policy_link.clone(), layer.errors);
                let mut response = guard(layer, inner, request, grpc).await?;
                let Some(Refused { problem, kind }) =
                    response.extensions().get::<Refused>().cloned()
                else {
                    return Ok(response);
                };
                if grpc {
                    return Ok(grpc::refusal(response, &problem, kind));
                }
                if let Some(link) = link
                    && matches!(response.status().as_u16(), 400 | 409 | 422)
                {
                    response.headers_mut().append(http::header::LINK, link);
                }
                if errors != ErrorDialect::Problem {
                    *response.body_mut() =
                        ResponseBody::from(Bytes::from(problem.to_json_in(errors)));
                }
                Ok(response)
            }),
        ))
    }
}

/// Applies the contract to one covered request: the checks in the contract's order (method,
/// key, body size, body arrival, fingerprint, then the record; docs/contract.md §2.1), each a
/// step that either hands on what the next needs or answers the request.
async fn guard<S, M, ReqBody, ResBody>(
    layer: IdempotencyLayer<M>,
    mut inner: S,
    request: Request<ReqBody>,
    grpc: bool,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    M: Mode,
    ReqBody: RebuildBody + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: fmt::Display,
{
    let (parts, body) = request.into_parts();
    // A gRPC call's key is in its metadata, wherever an HTTP request's is, and it is required
    // only where its method says so (docs/contract.md §14).
    let default_source;
    let (source, require) = if grpc {
        let source = match &*layer.key_source {
            KeySource::Body(_) => {
                default_source = KeySource::default();
                &default_source
            }
            headers => headers,
        };
        let required = layer.grpc.key_required.contains(parts.uri.path());
        (source, required)
    } else {
        (&*layer.key_source, layer.policy.require_key)
    };
    // A key in the body is found once the body is read (in `admit`).
    let key = match source {
        KeySource::Body(pointer) => KeyAt::Body(pointer),
        KeySource::Headers { names, label } => {
            match key(&layer.policy, require, names, label, &parts) {
                Ok(Some(key)) => KeyAt::Header(key),
                Ok(None) => {
                    Served::Passthrough.count();
                    let request = Request::from_parts(parts, body);
                    return Ok(inner.call(request).await?.map(ResponseBody::passthrough));
                }
                Err(refused) => return Ok(refused),
            }
        }
    };
    let (claim, request) = match admit(&layer, key, parts, body).await {
        Ok(Admitted::Claim(claim, request)) => (claim, request),
        Ok(Admitted::Keyless(request)) => {
            Served::Passthrough.count();
            return Ok(inner.call(request).await?.map(ResponseBody::passthrough));
        }
        Err(answered) => return Ok(answered),
    };
    // From the claim to the stored outcome the work runs to its end: a client that hangs up
    // drops this future, and the section goes on in a task of its own, so the record is never
    // left half-written.
    let runtime = layer.mode.section_runtime();
    let section = telemetry::in_section(Box::pin(layer.mode.run(claim, inner, request)));
    let ran = match runtime {
        // A spawned task runs to its end whether or not its handle is awaited.
        Some(runtime) => match runtime.spawn(section).await {
            Ok(result) => Ok(result),
            Err(e) if e.is_panic() => Err(Panicked),
            // The store's runtime stopped with the work unfinished: nothing of it committed.
            Err(_cancelled) => {
                return Ok(Refusal::StoreUnavailable.refuse(
                    "the store stopped before the request's work ended; nothing was committed; retry with the same key",
                ));
            }
        },
        None => Section::new(section).await,
    };
    match ran {
        Ok(result) => result,
        // The handler's own panics are answered inside the section, where the claim can be
        // let go; this is one in the layer's own steps.
        Err(Panicked) => {
            tracing::error!("the idempotent section panicked");
            Ok(Refusal::HandlerFailed.refuse("the request failed unexpectedly"))
        }
    }
}

/// A request's key, or where in its body to find it.
enum KeyAt<'a> {
    Header(IdempotencyKey),
    /// A JSON pointer.
    Body(&'a str),
}

/// What [`admit`] lets through.
enum Admitted<ReqBody> {
    /// The claim to make and the request to run under it.
    Claim(Claim, Request<ReqBody>),
    /// A request whose body holds no key, on a route where keys are optional: it runs
    /// unprotected.
    Keyless(Request<ReqBody>),
}

/// The steps after the key, up to the claim: the body, the fingerprint, the key when it is in
/// the body, and the read that answers replays. `Err` is the answer that settles the request
/// first.
async fn admit<M, ReqBody, ResBody>(
    layer: &IdempotencyLayer<M>,
    key: KeyAt<'_>,
    parts: Parts,
    body: ReqBody,
) -> Result<Admitted<ReqBody>, Response<ResBody>>
where
    M: Mode,
    ReqBody: RebuildBody,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: MadeBody,
{
    // Before the body is read: a request that cannot be scoped is refused at once.
    let account = match (layer.account)(&parts) {
        Ok(account) => account,
        Err(Unidentified::NoAccount) => {
            log_no_account_once(&parts);
            return Err(Refusal::NoAccount.refuse(
                "the service found no account for this request, so its Idempotency-Key cannot be scoped; nothing was run",
            ));
        }
        Err(Unidentified::NoCredential(detail)) => {
            return Err(Refusal::NoCredential.refuse(detail));
        }
    };
    let body = read_body(&layer.policy, &parts, body).await?;
    let fingerprint = fingerprint(&parts, &account, &body, &layer.body_selection)?;
    let key = match key {
        KeyAt::Header(key) => key,
        KeyAt::Body(pointer) => match key_in_body(&layer.policy, pointer, &parts, &body)? {
            Some(key) => key,
            None => {
                let request = Request::from_parts(parts, ReqBody::from_bytes(body));
                return Ok(Admitted::Keyless(request));
            }
        },
    };
    let scope = Scope::new(account, key);
    telemetry::record_key(&scope);
    layer
        .mode
        .ready()
        .await
        .map_err(|e| store_unavailable(&e))?;
    let now = layer.clock.now();
    if layer.replay_read {
        replay_read(layer.mode.store(), &scope, &fingerprint, now).await?;
    }
    let claim = Claim::new(
        layer.policy.clone(),
        layer.clock.clone(),
        scope,
        fingerprint,
        now,
    );
    Ok(Admitted::Claim(
        claim,
        Request::from_parts(parts, ReqBody::from_bytes(body)),
    ))
}

/// The request's key from the first of `names` it carries (`label` names them all). `None`:
/// it has none and the policy lets it through unprotected.
fn key<B: From<Bytes>>(
    policy: &Policy,
    require: bool,
    names: &[http::HeaderName],
    label: &str,
    parts: &Parts,
) -> Result<Option<IdempotencyKey>, Response<B>> {
    let mut present = names.iter().filter(|n| parts.headers.contains_key(*n));
    let name = present.next().unwrap_or(&names[0]);
    if let Some(second) = present.next() {
        return Err(Refusal::MalformedKey.refuse(format!(
            "the request carries both {name} and {second}; send the key in one of {label}"
        )));
    }
    let fields = parts.headers.get_all(name).iter().map(|v| v.as_bytes());
    match IdempotencyKey::from_header_values(fields, policy.key_limits) {
        Ok(key) => Ok(Some(key)),
        Err(KeyError::Missing) if !require => Ok(None),
        Err(KeyError::Missing) => Err(Refusal::MissingKey.refuse(format!(
            "{} {} requires an {label} header",
            parts.method,
            parts.uri.path()
        ))),
        Err(e) => Err(Refusal::MalformedKey.refuse(e.to_string())),
    }
}

/// The key at `pointer` in a JSON body. `None`: there is none and the policy lets the
/// request through unprotected.
fn key_in_body<B: From<Bytes>>(
    policy: &Policy,
    pointer: &str,
    parts: &Parts,
    body: &[u8],
) -> Result<Option<IdempotencyKey>, Response<B>> {
    let value = serde_json::from_slice::<serde_json::Value>(body).ok();
    match value.as_ref().and_then(|v| v.pointer(pointer)) {
        Some(serde_json::Value::String(key)) => {
            IdempotencyKey::new(key.as_str(), policy.key_limits)
                .map(Some)
                .map_err(|e| Refusal::MalformedKey.refuse(format!("the key at {pointer}: {e}")))
        }
        _ if !policy.require_key => Ok(None),
        _ => Err(Refusal::MissingKey.refuse(format!(
            "{} {} requires a JSON body with a string at {pointer}, its idempotency key",
            parts.method,
            parts.uri.path()
        ))),
    }
}

/// The request body, read whole within the policy's size and time limits.
async fn read_body<ReqBody, B>(
    policy: &Policy,
    parts: &Parts,
    body: ReqBody,
) -> Result<Bytes, Response<B>>
where
    ReqBody: Body,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: From<Bytes>,
{
    let too_large = || {
        Refusal::BodyTooLarge.refuse(format!(
            "the request body exceeds {} bytes",
            policy.body_limit
        ))
    };
    // Refuse an over-long body before reading any of it when its length is declared. A client
    // that waits for `100 Continue` sends nothing more; one that does not is already sending,
    // so its body is drained (within bounds) for it to read the answer.
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > policy.body_limit as u64) {
        let expects_continue = parts
            .headers
            .get(http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if !expects_continue && declared.is_some_and(|len| len <= DRAIN_LIMIT) {
            drain(body, policy.body_timeout).await;
        }
        return Err(too_large());
    }
    let mut body = std::pin::pin!(body);
    let collected = tokio::time::timeout(policy.body_timeout, async {
        let mut buffer = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(mut data) = frame.map_err(Into::into)?.into_data() else {
                continue; // trailers: not part of what is fingerprinted
            };
            if buffer.len() + data.remaining() > policy.body_limit {
                return Ok(None);
            }
            while data.has_remaining() {
                let chunk = data.chunk();
                let n = chunk.len();
                buffer.extend_from_slice(chunk);
                data.advance(n);
            }
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Some(Bytes::from(buffer)))
    })
    .await
    .map_err(|_| {
        Refusal::BodyTimeout.refuse(format!(
            "the request body did not arrive within {} s",
            policy.body_timeout.as_secs_f64()
        ))
    })?;
    match collected {
        Ok(Some(collected)) => Ok(collected),
        Ok(None) => {
            drain(body, policy.body_timeout).await;
            Err(too_large())
        }
        Err(e) => {
            Err(Refusal::MalformedBody.refuse(format!("the request body could not be read: {e}")))
        }
    }
}

/// The most of an oversized body [`drain`] reads: past it, the connection is closed on the
/// client, which may then see a reset instead of the `413`.
const DRAIN_LIMIT: u64 = 128 << 20;

/// Reads and drops the rest of an oversized body, up to [`DRAIN_LIMIT`] bytes and `within`,
/// so a client that writes its whole body before reading (Python's `http.client`, many SDKs)
/// reads the `413` rather than a connection reset under its writes: what nginx's lingering
/// close does. A body past either bound is left, and hyper closes the connection.
async fn drain<ReqBody: Body>(body: ReqBody, within: Duration) {
    let mut body = std::pin::pin!(body);
    let _ = tokio::time::timeout(within, async {
        let mut drained = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(data) = frame.data_ref() {
                drained += data.remaining() as u64;
                if drained > DRAIN_LIMIT {
                    return;
                }
            }
        }
    })
    .await;
}

/// The request's fingerprint (docs/contract.md §2.4), of the members of its body that
/// `selection` names.
fn fingerprint<B: From<Bytes>>(
    parts: &Parts,
    account: &AccountId,
    body: &[u8],
    selection: &BodySelection,
) -> Result<Fingerprint, Response<B>> {
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    // A gRPC call's body is framed messages whatever its codec (`application/grpc+json` too):
    // fingerprinted byte for byte.
    let content_type = if idem_core::is_grpc_content_type(content_type.as_bytes()) {
        "application/grpc"
    } else {
        content_type
    };
    let request = RequestParts {
        account: account.as_str(),
        method: parts.method.as_str(),
        route: parts.uri.path(),
        query: parts.uri.query().unwrap_or(""),
        content_type,
        body,
    };
    match selection {
        BodySelection::Whole => Fingerprint::compute(&request),
        BodySelection::Ignore(pointers) => Fingerprint::compute_ignoring(&request, pointers),
        BodySelection::Only(pointers) => Fingerprint::compute_only(&request, pointers),
    }
    .map_err(|e| Refusal::MalformedBody.refuse(e.to_string()))
}

/// The fast path: a finished request replays (and a mismatch is refused) from a plain read,
/// without claiming anything. Work in flight goes on to the claim, which decides again under
/// its lock.
async fn replay_read<St: Store, B: MadeBody>(
    store: &St,
    scope: &Scope,
    fingerprint: &Fingerprint,
    now: Timestamp,
) -> Result<(), Response<B>> {
    let existing = telemetry::store_call("get", store.get(scope, now))
        .await
        .map_err(|e| store_unavailable(&e))?;
    let decision = decide(existing.as_ref(), fingerprint, now);
    if let Decision::Replay(_) | Decision::Mismatch = decision
        && let Some(settled) = answer(&decision, scope, None)
    {
        return Err(settled);
    }
    Ok(())
}

pin_project_lite::pin_project! {
    /// The response future of [`Idempotency`]: uncovered requests pass straight through, their
    /// bodies untouched; covered ones run the contract (boxed: it is a long async sequence
    /// around a spawned task, and its allocation is small beside the store round trip it
    /// makes).
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

type Guarded<B, E> = telemetry::Boxed<'static, Result<Response<ResponseBody<B>>, E>>;

pin_project_lite::pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Passthrough { #[pin] future: F },
        Guarded { future: Guarded<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    fn passthrough(future: F) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    fn guarded(future: Guarded<B, E>) -> Self {
        Self {
            kind: Kind::Guarded { future },
        }
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => future
                .poll(cx)
                .map_ok(|response| response.map(ResponseBody::passthrough)),
            KindProj::Guarded { future } => future.as_mut().poll(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::Full;
    use idem_store::SqliteStore;
    use tower::ServiceExt;

    use super::*;

    type Leased = IdempotencyLayer<LeaseMode<SqliteStore>>;

    /// A layer over its own SQLite file and a handler that counts its calls.
    struct Harness {
        layer: Leased,
        calls: Arc<AtomicUsize>,
        _dir: tempfile::TempDir,
    }

    async fn harness(adjust: impl FnOnce(Leased) -> Leased) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("layer.db"))
            .await
            .unwrap();
        Harness {
            layer: adjust(
                IdempotencyLayer::leased(store).with_account(|_| Ok(AccountId::new("acct_unit"))),
            ),
            calls: Arc::default(),
            _dir: dir,
        }
    }

    impl Harness {
        /// Sends a JSON POST with `headers`; returns the status, whether it was a replay and
        /// the problem type of a refusal.
        async fn post(&self, headers: &[(&str, &str)], body: &str) -> (u16, bool, String) {
            let calls = self.calls.clone();
            let handler = tower::service_fn(move |_: Request<Full<Bytes>>| {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    Ok::<_, Infallible>(Response::new(Full::from(Bytes::from(format!("call {n}")))))
                }
            });
            let mut request = Request::post("/events").header(CONTENT_TYPE, "application/json");
            for (name, value) in headers {
                request = request.header(*name, *value);
            }
            let request = request
                .body(Full::from(Bytes::from(body.to_owned())))
                .unwrap();
            let response = self.layer.layer(handler).oneshot(request).await.unwrap();
            let status = response.status().as_u16();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let kind = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["type"].as_str().map(str::to_owned))
                .unwrap_or_default();
            (status, replayed, kind)
        }

        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }
    }

    const MISSING: &str = "urn:idem:problem:missing-key";
    const MALFORMED: &str = "urn:idem:problem:malformed-key";

    #[tokio::test]
    async fn key_header_aliases_take_the_first_present_and_refuse_two() {
        let h = harness(|l| l.with_key_headers(["Idempotency-Key", "X-Idempotency-Key"])).await;
        assert_eq!(
            h.post(&[("x-idempotency-key", "alias-key-1")], "{}").await,
            (200, false, String::new())
        );
        assert!(
            h.post(&[("x-idempotency-key", "alias-key-1")], "{}")
                .await
                .1
        );
        assert!(
            h.post(&[("idempotency-key", "alias-key-1")], "{}").await.1,
            "one key, whichever header"
        );
        let both = h
            .post(
                &[
                    ("idempotency-key", "alias-key-2"),
                    ("x-idempotency-key", "alias-key-2"),
                ],
                "{}",
            )
            .await;
        assert_eq!((both.0, both.2.as_str()), (400, MALFORMED));
        assert_eq!(h.post(&[], "{}").await.2, MISSING);
        assert_eq!(h.calls(), 1);
    }

    #[tokio::test]
    async fn one_key_header_is_a_senders_delivery_id() {
        let h = harness(|l| l.with_key_headers(["X-GitHub-Delivery"])).await;
        let delivery = [("x-github-delivery", "72d3162e-cc78-11e3-81ab-dcbb1ef32bd5")];
        assert!(!h.post(&delivery, r#"{"action":"opened"}"#).await.1);
        assert!(h.post(&delivery, r#"{"action":"opened"}"#).await.1);
        // Idempotency-Key is not read on such a route.
        assert_eq!(
            h.post(&[("idempotency-key", "other-key-1")], "{}").await.2,
            MISSING
        );
        assert_eq!(h.calls(), 1);
    }

    #[tokio::test]
    async fn a_key_from_the_body_runs_a_redelivery_once() {
        let h = harness(|l| l.with_key_from_body("/id")).await;
        let event = r#"{"id":"evt_0001abcd","type":"charge.succeeded"}"#;
        assert_eq!(h.post(&[], event).await, (200, false, String::new()));
        assert!(h.post(&[], event).await.1);
        for no_key in [r#"{"type":"x"}"#, r#"{"id":42}"#, "[]"] {
            assert_eq!(h.post(&[], no_key).await.2, MISSING, "{no_key}");
        }
        assert_eq!(h.post(&[], r#"{"id":"short"}"#).await.2, MALFORMED);
        assert_eq!(h.calls(), 1);

        let optional = harness(|l| {
            l.with_key_from_body("/id").with_policy(Policy {
                require_key: false,
                ..Policy::default()
            })
        })
        .await;
        assert_eq!(optional.post(&[], r#"{"type":"x"}"#).await.0, 200);
        assert_eq!(optional.post(&[], r#"{"type":"x"}"#).await.0, 200);
        assert_eq!(optional.calls(), 2, "keyless requests run unprotected");
    }

    #[tokio::test]
    async fn an_ignored_member_is_not_part_of_the_request() {
        let h = harness(|l| l.with_fingerprint_ignoring(["/metadata/trace_id"])).await;
        let key = [("idempotency-key", "ignore-key-1")];
        h.post(&key, r#"{"amount":1,"metadata":{"trace_id":"t1"}}"#)
            .await;
        assert!(
            h.post(&key, r#"{"amount":1,"metadata":{"trace_id":"t2"}}"#)
                .await
                .1
        );
        let changed = h
            .post(&key, r#"{"amount":2,"metadata":{"trace_id":"t1"}}"#)
            .await;
        assert_eq!(changed.0, 422);
        assert_eq!(h.calls(), 1);
    }

    #[tokio::test]
    async fn only_the_selected_members_are_the_request() {
        let h = harness(|l| l.with_fingerprint_only(["/amount"])).await;
        let key = [("idempotency-key", "only-key-01")];
        h.post(&key, r#"{"amount":1,"note":"a"}"#).await;
        assert!(h.post(&key, r#"{"amount":1,"note":"b"}"#).await.1);
        assert_eq!(h.post(&key, r#"{"amount":2,"note":"a"}"#).await.0, 422);
        assert_eq!(h.calls(), 1);
    }

    #[tokio::test]
    #[should_panic(expected = "a JSON pointer")]
    async fn a_bad_pointer_is_refused_when_the_layer_is_built() {
        harness(|l| l.with_fingerprint_ignoring(["trace"])).await;
    }
}
