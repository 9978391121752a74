//! [`IdempotencyLayer`] and the [`Idempotency`] service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::{
    AccountId, Clock, Decision, FencingToken, Fingerprint, IdempotencyKey, KeyError, Policy,
    ProblemKind, RequestParts, Scope, SystemClock, decide,
};
use idem_store::Store;
use tower::{Layer, Service};

use crate::mode::Mode;
use crate::mode::sealed::Claim;
use crate::response::{answer, count, problem, store_unavailable, too_large};

/// Finds the account a request acts for.
type AccountFn = Arc<dyn Fn(&Parts) -> AccountId + Send + Sync>;

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
}

impl<M: fmt::Debug> fmt::Debug for IdempotencyLayer<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("mode", &self.mode)
            .field("policy", &self.policy)
            .field("clock", &self.clock)
            .field("replay_read", &self.replay_read)
            .finish_non_exhaustive()
    }
}

impl<M: Mode> IdempotencyLayer<M> {
    pub(crate) fn with_mode(mode: M) -> Self {
        Self {
            mode,
            policy: Arc::new(Policy::default()),
            clock: Arc::new(SystemClock),
            account: Arc::new(account_from_extensions),
            replay_read: true,
        }
    }

    pub(crate) fn mode_mut(&mut self) -> &mut M {
        &mut self.mode
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

    /// Sets how the account is found. The default reads an [`AccountId`] request extension
    /// (put there by the service's authentication, which must run before this layer) and
    /// falls back to one shared anonymous account.
    pub fn with_account(
        mut self,
        account: impl Fn(&Parts) -> AccountId + Send + Sync + 'static,
    ) -> Self {
        self.account = Arc::new(account);
        self
    }

    /// Skips the read that answers replays before anything is claimed. A first request then
    /// costs one statement less (on PostgreSQL five instead of six: the claim comes first),
    /// and a replay costs what a lost claim does (in transaction mode BEGIN, the claim, a
    /// read, ROLLBACK) instead of one read. The answers are the same either way: every
    /// decision is also taken after the claim. For APIs whose retries are rare.
    pub fn without_replay_read(mut self) -> Self {
        self.replay_read = false;
        self
    }

    /// The policy in force.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }
}

fn account_from_extensions(parts: &Parts) -> AccountId {
    parts
        .extensions
        .get::<AccountId>()
        .cloned()
        .unwrap_or_else(|| AccountId::new("anonymous"))
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
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResBody::Error: fmt::Display,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        if !self.layer.policy.covers(request.method().as_str()) {
            return ResponseFuture::passthrough(self.inner.call(request));
        }
        // The ready service goes with the request; a fresh clone waits for the next one.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        ResponseFuture::guarded(Box::pin(guard(layer, inner, request)))
    }
}

/// Applies the contract to one covered request.
async fn guard<S, M, ReqBody, ResBody>(
    layer: IdempotencyLayer<M>,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    M: Mode,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResBody::Error: fmt::Display,
{
    let policy = &layer.policy;
    let (parts, body) = request.into_parts();

    let key = match IdempotencyKey::from_header_values(
        parts
            .headers
            .get_all("idempotency-key")
            .iter()
            .map(|v| v.as_bytes()),
        policy.key_limits,
    ) {
        Ok(key) => key,
        Err(KeyError::Missing) if !policy.require_key => {
            count("passthrough");
            return inner.call(Request::from_parts(parts, body)).await;
        }
        Err(KeyError::Missing) => {
            count("missing_key");
            return Ok(problem(
                ProblemKind::MissingKey,
                format!(
                    "{} {} requires an Idempotency-Key header",
                    parts.method,
                    parts.uri.path()
                ),
                None,
            ));
        }
        Err(e) => {
            count("malformed_key");
            return Ok(problem(ProblemKind::MalformedKey, e.to_string(), None));
        }
    };

    // Refuse an over-long body before reading any of it when its length is declared.
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > policy.body_limit as u64) {
        count("body_too_large");
        return Ok(too_large(policy));
    }
    let collected = tokio::time::timeout(
        policy.body_timeout,
        Limited::new(body, policy.body_limit).collect(),
    )
    .await;
    let Ok(collected) = collected else {
        count("body_timeout");
        return Ok(problem(
            ProblemKind::BodyTimeout,
            format!(
                "the request body did not arrive within {} s",
                policy.body_timeout.as_secs_f64()
            ),
            None,
        ));
    };
    let body = match collected {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            count("body_too_large");
            return Ok(too_large(policy));
        }
        Err(e) => {
            count("malformed_body");
            return Ok(problem(
                ProblemKind::MalformedBody,
                format!("the request body could not be read: {e}"),
                None,
            ));
        }
    };

    let account = (layer.account)(&parts);
    let fingerprint = match Fingerprint::compute(&RequestParts {
        account: account.as_str(),
        method: parts.method.as_str(),
        route: parts.uri.path(),
        query: parts.uri.query().unwrap_or(""),
        content_type: parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(""),
        body: &body,
    }) {
        Ok(fp) => fp,
        Err(e) => {
            count("malformed_body");
            return Ok(problem(ProblemKind::MalformedBody, e.to_string(), None));
        }
    };
    let scope = Scope::new(account, key);
    let now = layer.clock.now();

    // Fast path: a finished request replays (and a mismatch is refused) from a plain read,
    // without claiming anything.
    if layer.replay_read {
        match layer.mode.store().get(&scope).await {
            Ok(existing) => {
                let decision = decide(existing.as_ref(), &fingerprint, now);
                // Work in flight goes on to the claim, which decides again under its lock.
                if let Decision::Replay(_) | Decision::Mismatch = decision
                    && let Some(settled) = answer(&decision, &scope, None)
                {
                    return Ok(settled);
                }
            }
            Err(e) => return Ok(store_unavailable(&e)),
        }
    }

    let claim = Claim {
        policy: layer.policy.clone(),
        clock: layer.clock.clone(),
        scope,
        fingerprint,
        now,
        token: FencingToken(random_token()),
    };
    let request = Request::from_parts(parts, ReqBody::from(body));
    // From the claim to the stored outcome the work runs in its own task: a client that hangs
    // up drops this future, not the task, so the record is never left half-written.
    let section = tokio::spawn(layer.mode.clone().run(claim, inner, request));
    match section.await {
        Ok(result) => result,
        Err(e) => {
            tracing::error!(error = %e, "the idempotent section panicked");
            Ok(problem(
                ProblemKind::StoreUnavailable,
                "the request failed unexpectedly; retry with the same key",
                Some(std::time::Duration::from_secs(1)),
            ))
        }
    }
}

fn random_token() -> i64 {
    // Tokens only need to be unique per claim; 63 random bits make a collision negligible.
    let bytes = uuid::Uuid::new_v4().into_bytes();
    i64::from_be_bytes(bytes[..8].try_into().expect("8 bytes")) & i64::MAX
}

pin_project_lite::pin_project! {
    /// The response future of [`Idempotency`]: uncovered requests pass straight through;
    /// covered ones run the contract (boxed: it is a long async sequence around a spawned
    /// task, and its allocation is small beside the store round trip it makes).
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

type Guarded<B, E> = Pin<Box<dyn Future<Output = Result<Response<B>, E>> + Send>>;

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
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => future.poll(cx),
            KindProj::Guarded { future } => future.as_mut().poll(cx),
        }
    }
}
