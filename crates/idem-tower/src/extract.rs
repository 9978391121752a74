//! [`Tx`] and [`Downstream`] as axum extractors.

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use idem_core::ProblemKind;

use crate::response::problem_response;
use crate::{Downstream, NoDownstreamKey, NoTransaction, Tx};

impl IntoResponse for NoTransaction {
    fn into_response(self) -> Response {
        tracing::error!("{self}");
        // Not a refusal of the contract but a route wired wrong: a `500` without
        // `Retry-After`, since a retry cannot help.
        problem_response(&ProblemKind::NoTransaction.with_detail(self.to_string()))
    }
}

impl<S: Send + Sync, T: Send + 'static> FromRequestParts<S> for Tx<T> {
    type Rejection = NoTransaction;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Tx::from_extensions(&parts.extensions).await
    }
}

/// `Option<Tx<T>>`: `None` when the layer opened no transaction (a keyless request on a route
/// whose keys are optional), so the handler can open its own.
impl<S: Send + Sync, T: Send + 'static> OptionalFromRequestParts<S> for Tx<T> {
    type Rejection = NoTransaction;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Tx::if_opened(&parts.extensions).await
    }
}

impl IntoResponse for NoDownstreamKey {
    fn into_response(self) -> Response {
        tracing::error!("{self}");
        problem_response(&self.problem())
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Downstream {
    type Rejection = NoDownstreamKey;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Downstream::from_extensions(&parts.extensions)
    }
}

/// `Option<Downstream>`: `None` when the layer made no downstream key (a keyless request on a
/// route whose keys are optional, or a route outside lease mode).
impl<S: Send + Sync> OptionalFromRequestParts<S> for Downstream {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(Downstream::from_extensions(&parts.extensions).ok())
    }
}
