//! The [`Tx`] extractor: the transaction the layer opened, for the handler's writes.

use std::ops::{Deref, DerefMut};

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use idem_core::ProblemKind;
use tokio::sync::OwnedMutexGuard;

use crate::mode::TxSlot;
use crate::response::problem_response;

/// The open transaction of a request in transaction mode. Write the business rows through it
/// and they commit together with the key row and the stored response, or not at all.
///
/// ```no_run
/// use idem_store::SqliteTx;
/// use idem_tower::Tx;
///
/// async fn create_order(mut tx: Tx<SqliteTx>) -> &'static str {
///     sqlx::query("INSERT INTO orders (sku) VALUES ('A1')")
///         .execute(&mut **tx)
///         .await
///         .unwrap();
///     "created"
/// }
/// ```
#[derive(Debug)]
pub struct Tx<T: 'static>(OwnedMutexGuard<Option<T>>);

impl<T> Deref for Tx<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0
            .as_ref()
            .expect("the layer holds the transaction until the handler returns")
    }
}

impl<T> DerefMut for Tx<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0
            .as_mut()
            .expect("the layer holds the transaction until the handler returns")
    }
}

/// The handler asked for a [`Tx`] on a request the layer did not open one for.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("no idempotency transaction: the route is not behind IdempotencyLayer::transactional")]
pub struct NoTransaction;

impl IntoResponse for NoTransaction {
    fn into_response(self) -> Response {
        tracing::error!("{self}");
        // Not a refusal of the contract but a route wired wrong: a `500` (under the store's
        // problem type, the nearest there is) without `Retry-After`, since a retry cannot help.
        let mut response: Response =
            problem_response(&ProblemKind::StoreUnavailable.with_detail(self.to_string()));
        *response.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
        response
    }
}

impl<S: Send + Sync, T: Send + 'static> FromRequestParts<S> for Tx<T> {
    type Rejection = NoTransaction;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let slot = parts
            .extensions
            .get::<TxSlot<T>>()
            .cloned()
            .ok_or(NoTransaction)?;
        let guard = slot.lock_owned().await;
        if guard.is_none() {
            return Err(NoTransaction);
        }
        Ok(Tx(guard))
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
        let Some(slot) = parts.extensions.get::<TxSlot<T>>().cloned() else {
            return Ok(None);
        };
        let guard = slot.lock_owned().await;
        if guard.is_none() {
            return Err(NoTransaction);
        }
        Ok(Some(Tx(guard)))
    }
}
