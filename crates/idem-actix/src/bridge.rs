//! The tower service idem-tower wraps: it hands each request it is called with to the actix
//! side, where the real handler runs, and waits for the answer.
//!
//! Also the conversions between actix-web's `http` 0.2 heads and idem-tower's `http` 1 ones.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::MessageBody;
use actix_web::dev::ServiceRequest;
use actix_web::{HttpMessage, HttpResponse, http as actix_http};
use idem_core::AccountId;
use idem_tower::Outcome;
use tokio::sync::{mpsc, oneshot};

use crate::body::{BridgeBody, IdempotentBody};

/// A request idem-tower lets through, on its way to the actix handler, and where its answer
/// goes.
pub(crate) struct Handoff {
    pub(crate) request: http::Request<BridgeBody>,
    pub(crate) reply: oneshot::Sender<Reply>,
}

/// What the actix side answers a [`Handoff`] with.
pub(crate) enum Reply {
    Response(http::Response<BridgeBody>),
    /// The handler panicked: the panic goes on inside idem-tower, which answers it as it
    /// answers any handler's panic (`500 handler-failed`, the transaction rolled back, the
    /// lease let go).
    Panicked(Box<dyn Any + Send>),
}

/// The inner service of idem-tower's `Idempotency`, one per request.
#[derive(Clone)]
pub(crate) struct Bridge {
    pub(crate) handoffs: mpsc::Sender<Handoff>,
}

/// The actix side went away without answering: the task that runs the handler ended.
#[derive(Debug)]
pub(crate) struct HandlerGone;

impl tower::Service<http::Request<BridgeBody>> for Bridge {
    type Response = http::Response<BridgeBody>;
    type Error = HandlerGone;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, HandlerGone>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), HandlerGone>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<BridgeBody>) -> Self::Future {
        let handoffs = self.handoffs.clone();
        Box::pin(async move {
            let (reply, answer) = oneshot::channel();
            handoffs
                .send(Handoff { request, reply })
                .await
                .map_err(|_| HandlerGone)?;
            match answer.await {
                Ok(Reply::Response(response)) => Ok(response),
                Ok(Reply::Panicked(panic)) => std::panic::resume_unwind(panic),
                Err(_) => Err(HandlerGone),
            }
        })
    }
}

/// The head of an actix request as an `http` 1 request around `body`, with the account the
/// app's authentication put in its extensions. `None` when the head does not convert, which
/// actix's own parsing makes impossible.
pub(crate) fn to_http(
    request: &ServiceRequest,
    body: BridgeBody,
) -> Option<http::Request<BridgeBody>> {
    let version = match request.version() {
        actix_http::Version::HTTP_09 => http::Version::HTTP_09,
        actix_http::Version::HTTP_10 => http::Version::HTTP_10,
        actix_http::Version::HTTP_2 => http::Version::HTTP_2,
        actix_http::Version::HTTP_3 => http::Version::HTTP_3,
        _ => http::Version::HTTP_11,
    };
    let mut builder = http::Request::builder()
        .method(request.method().as_str())
        .uri(request.uri().to_string())
        .version(version);
    for (name, value) in request.headers() {
        builder = builder.header(name.as_str(), value.as_bytes());
    }
    if let Some(account) = request.extensions().get::<AccountId>() {
        builder = builder.extension(account.clone());
    }
    builder.body(body).ok()
}

/// A handler's actix response as an `http` 1 one, with the [`Outcome`] it set, if any.
pub(crate) fn to_http_response<B: MessageBody + 'static>(
    response: HttpResponse<B>,
) -> http::Response<BridgeBody> {
    let (head, body) = response.into_parts();
    let mut response = http::Response::new(BridgeBody::of_message(body));
    *response.status_mut() = http::StatusCode::from_u16(head.status().as_u16())
        .unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in head.headers() {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.as_str().as_bytes()),
            http::HeaderValue::from_bytes(value.as_bytes()),
        ) {
            response.headers_mut().append(name, value);
        }
    }
    if let Some(outcome) = head.extensions().get::<Outcome>() {
        response.extensions_mut().insert(*outcome);
    }
    response
}

/// idem-tower's answer as an actix response. The length headers are left to actix, which
/// writes them from the body.
pub(crate) fn to_actix_response(
    response: http::Response<idem_tower::ResponseBody<BridgeBody>>,
) -> HttpResponse<IdempotentBody> {
    let (parts, body) = response.into_parts();
    let status = actix_http::StatusCode::from_u16(parts.status.as_u16())
        .unwrap_or(actix_http::StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = HttpResponse::with_body(status, IdempotentBody(body));
    for (name, value) in &parts.headers {
        if matches!(
            *name,
            http::header::CONTENT_LENGTH | http::header::TRANSFER_ENCODING
        ) {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            actix_http::header::HeaderName::from_bytes(name.as_str().as_bytes()),
            actix_http::header::HeaderValue::from_bytes(value.as_bytes()),
        ) {
            response.headers_mut().append(name, value);
        }
    }
    response
}
