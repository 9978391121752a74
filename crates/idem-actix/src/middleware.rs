//! [`Idempotent`], the middleware factory, and [`IdempotentMiddleware`], the service it
//! wraps around a route.

use std::fmt;
use std::future::{Future, Ready, ready};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{Service, ServiceRequest, ServiceResponse, Transform, forward_ready};
use actix_web::error::InternalError;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, ResponseError};
use futures_util::FutureExt;
use idem_core::{DownstreamKey, Problem, ProblemKind, Scope};
use idem_tower::{IdempotencyLayer, Mode};
use tokio::sync::mpsc;
use tower::{Layer, ServiceExt};

use crate::body::{BridgeBody, IdempotentBody};
use crate::bridge::{
    Bridge, HandlerGone, Handoff, Reply, to_actix_response, to_http, to_http_response,
};
use crate::extract::LayerExtensions;

/// The idem contract as actix-web middleware: `.wrap(Idempotent::new(layer))` on an `App`, a
/// `Scope` or a `Resource`.
///
/// `layer` is idem-tower's [`IdempotencyLayer`], in transaction or lease mode, with every
/// setting it has; this middleware runs it, so the answers are the layer's (docs/contract.md
/// §2). Clone it into each worker's `App`: its clones share one store and one sweeper.
///
/// In lease mode the claim commits first and the handler calls another system, passing it the
/// request's [`DownstreamKey`] so that a retry after a crash is not a second payment there:
///
/// ```
/// use actix_web::dev::Service;
/// use actix_web::{App, HttpMessage, HttpResponse, test, web};
/// use idem_actix::{IdempotencyLayer, Idempotent};
/// use idem_core::{AccountId, DownstreamKey};
/// use idem_store::SqliteStore;
///
/// async fn create_payout(key: web::ReqData<DownstreamKey>) -> HttpResponse {
///     // The provider dedupes on the key: `provider.pay(amount, key.as_str())`.
///     HttpResponse::Created().body(format!("paid under {}", key.as_str()))
/// }
///
/// # #[actix_web::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// let store = SqliteStore::open(dir.path().join("payouts.db")).await?;
/// let payouts = Idempotent::new(IdempotencyLayer::leased(store).without_takeover());
/// let app = test::init_service(
///     App::new()
///         .service(
///             web::resource("/payouts")
///                 .wrap(payouts)
///                 .route(web::post().to(create_payout)),
///         )
///         // Stands in for the app's authentication.
///         .wrap_fn(|request, service| {
///             request.extensions_mut().insert(AccountId::new("acct_alice"));
///             service.call(request)
///         }),
/// )
/// .await;
/// let request = || {
///     test::TestRequest::post()
///         .uri("/payouts")
///         .insert_header(("idempotency-key", "payout-0001"))
///         .set_payload(r#"{"amount":100}"#)
///         .to_request()
/// };
/// let first = test::call_and_read_body(&app, request()).await;
/// let retry = test::call_and_read_body(&app, request()).await;
/// assert!(first.starts_with(b"paid under idem-"));
/// assert_eq!(retry, first, "the retry is the stored answer");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Idempotent<M> {
    layer: IdempotencyLayer<M>,
}

impl<M: Mode> Idempotent<M> {
    /// Middleware that runs `layer` around the wrapped service.
    pub fn new(layer: IdempotencyLayer<M>) -> Self {
        Self { layer }
    }
}

impl<M: Mode> From<IdempotencyLayer<M>> for Idempotent<M> {
    fn from(layer: IdempotencyLayer<M>) -> Self {
        Self::new(layer)
    }
}

impl<M: fmt::Debug> fmt::Debug for Idempotent<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotent")
            .field("layer", &self.layer)
            .finish()
    }
}

impl<S, B, M> Transform<S, ServiceRequest> for Idempotent<M>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
    M: Mode,
{
    type Response = ServiceResponse<EitherBody<B, IdempotentBody>>;
    type Error = actix_web::Error;
    type Transform = IdempotentMiddleware<S, M>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, ()>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(IdempotentMiddleware {
            service: Rc::new(service),
            layer: self.layer.clone(),
        }))
    }
}

/// The service [`Idempotent`] wraps around an actix service.
///
/// A request whose method the policy does not cover goes straight to the wrapped service.
/// A covered one is read into idem-tower's `Idempotency` service, which decides it; when it
/// lets the request through, the wrapped service runs with [`Tx`](crate::Tx) (transaction
/// mode), [`DownstreamKey`] (lease mode) and [`Scope`] in its extensions, and its answer goes
/// back to idem-tower to be stored.
pub struct IdempotentMiddleware<S, M> {
    service: Rc<S>,
    layer: IdempotencyLayer<M>,
}

impl<S, M: fmt::Debug> fmt::Debug for IdempotentMiddleware<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentMiddleware")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

type Answer<B> = Result<ServiceResponse<EitherBody<B, IdempotentBody>>, actix_web::Error>;

impl<S, B, M> Service<ServiceRequest> for IdempotentMiddleware<S, M>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
    M: Mode,
{
    type Response = ServiceResponse<EitherBody<B, IdempotentBody>>;
    type Error = actix_web::Error;
    type Future = Pin<Box<dyn Future<Output = Answer<B>>>>;

    forward_ready!(service);

    fn call(&self, request: ServiceRequest) -> Self::Future {
        if !self.layer.policy().covers(request.method().as_str()) {
            let passed = self.service.call(request);
            return Box::pin(async move { Ok(passed.await?.map_into_left_body()) });
        }
        // The guarded request runs in a local task of its own, so the work between the claim
        // and the stored outcome runs to its end (docs/contract.md §2.7) even if actix drops
        // the request's future. (Its HTTP/1 dispatcher did not, when a client hung up, in
        // 4.18; nothing in its API promises that.)
        let guarded =
            actix_web::rt::spawn(guard(self.layer.clone(), Rc::clone(&self.service), request));
        Box::pin(async move {
            guarded.await.unwrap_or_else(|_| {
                // `guard` answers a handler's panic itself; this is one in the middleware.
                tracing::error!("the idempotent section panicked");
                Err(failed("the request failed unexpectedly").into())
            })
        })
    }
}

/// Runs one covered request through idem-tower: idem-tower's service and the actix side that
/// serves its handoff run together, so a lease is renewed while the handler runs.
async fn guard<S, B, M>(
    layer: IdempotencyLayer<M>,
    service: Rc<S>,
    mut request: ServiceRequest,
) -> Answer<B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
    M: Mode,
{
    let body = BridgeBody::of_payload(request.parts_mut().1.take());
    let Some(converted) = to_http(&request, body) else {
        tracing::error!(uri = %request.uri(), "the request head does not convert to http 1");
        let answer = problem_response(&failed("the request head could not be read").0);
        return Ok(request.into_response(answer).map_into_right_body());
    };
    let (handoffs, handed) = mpsc::channel(1);
    let decided = layer.layer(Bridge { handoffs }).oneshot(converted);
    let (answer, request) = tokio::join!(decided, serve_handoff(handed, service, request));
    let answer = match answer {
        Ok(answer) => to_actix_response(answer),
        Err(HandlerGone) => {
            tracing::error!("the actix side ended without answering the handoff");
            problem_response(&failed("the handler did not answer").0)
        }
    };
    match request {
        Left::Unused(request) => Ok(request.into_response(answer).map_into_right_body()),
        Left::Answered(request) => Ok(ServiceResponse::new(request, answer).map_into_right_body()),
        // Without the request there is no `ServiceResponse` to make: the answer goes out as
        // an error's response, which actix writes as it is.
        Left::Lost => Err(InternalError::from_response(
            "idempotent request failed",
            answer.map_into_boxed_body(),
        )
        .into()),
    }
}

/// What is left of the actix request once idem-tower has decided.
enum Left {
    /// idem-tower answered without the handler (a replay, a refusal).
    Unused(ServiceRequest),
    /// The handler answered; its request, for the response.
    Answered(HttpRequest),
    /// The handler failed without a response (it panicked, or a middleware inside returned
    /// an error), and took the request with it.
    Lost,
}

/// Waits for idem-tower to hand the request on, then runs the actix service on it: with the
/// body idem-tower read, and what idem-tower put in its extensions moved over to actix's.
async fn serve_handoff<S, B>(
    mut handed: mpsc::Receiver<Handoff>,
    service: Rc<S>,
    mut request: ServiceRequest,
) -> Left
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    let Some(Handoff {
        request: handed,
        reply,
    }) = handed.recv().await
    else {
        return Left::Unused(request);
    };
    let (parts, body) = handed.into_parts();
    {
        let mut extensions = request.extensions_mut();
        if let Some(scope) = parts.extensions.get::<Scope>() {
            extensions.insert(scope.clone());
        }
        if let Some(key) = parts.extensions.get::<DownstreamKey>() {
            extensions.insert(key.clone());
        }
        extensions.insert(LayerExtensions(Arc::new(parts.extensions)));
    }
    *request.parts_mut().1 = body.into_payload();
    let called = AssertUnwindSafe(async move { service.call(request).await })
        .catch_unwind()
        .await;
    match called {
        Ok(Ok(response)) => {
            let (request, response) = response.into_parts();
            request.extensions_mut().remove::<LayerExtensions>();
            let _ = reply.send(Reply::Response(to_http_response(response)));
            Left::Answered(request)
        }
        Ok(Err(e)) => {
            let _ = reply.send(Reply::Response(to_http_response(e.error_response())));
            Left::Lost
        }
        Err(panic) => {
            let _ = reply.send(Reply::Panicked(panic));
            Left::Lost
        }
    }
}

/// The middleware's own failure: `500 urn:idem:problem:handler-failed`.
fn failed(detail: &str) -> ProblemError {
    ProblemError(ProblemKind::HandlerFailed.with_detail(detail))
}

/// A problem-details answer as an actix error.
#[derive(Debug)]
pub(crate) struct ProblemError(pub(crate) Problem);

impl fmt::Display for ProblemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.detail)
    }
}

impl ResponseError for ProblemError {
    fn status_code(&self) -> actix_web::http::StatusCode {
        actix_web::http::StatusCode::from_u16(self.0.status)
            .unwrap_or(actix_web::http::StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn error_response(&self) -> HttpResponse {
        tracing::error!(problem = %self.0.kind, "{}", self.0.detail);
        problem_response(&self.0).map_into_boxed_body()
    }
}

/// `problem` as a response: its status, `application/problem+json`, its JSON.
fn problem_response(problem: &Problem) -> HttpResponse<IdempotentBody> {
    let status = actix_web::http::StatusCode::from_u16(problem.status)
        .unwrap_or(actix_web::http::StatusCode::INTERNAL_SERVER_ERROR);
    let body = idem_tower::ResponseBody::from(bytes::Bytes::from(problem.to_json()));
    let mut response = HttpResponse::with_body(status, IdempotentBody(body));
    response.headers_mut().insert(
        actix_web::http::header::CONTENT_TYPE,
        actix_web::http::header::HeaderValue::from_static("application/problem+json"),
    );
    response
}
