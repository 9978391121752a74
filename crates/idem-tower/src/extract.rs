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

/// The handler asked for a [`Tx`] on a request the layer did not open one for: the route is
/// not behind [`IdempotencyLayer::transactional`](crate::IdempotencyLayer::transactional), or
/// its store's transaction is another type than the one asked for.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error(
    "no idempotency transaction of type {asked_for}: the route is not behind IdempotencyLayer::transactional over a store whose transaction is that type"
)]
pub struct NoTransaction {
    asked_for: &'static str,
}

impl NoTransaction {
    fn of<T>() -> Self {
        Self {
            asked_for: std::any::type_name::<T>(),
        }
    }

    /// The transaction type the handler asked for (`Tx<T>`'s `T`).
    pub fn asked_for(&self) -> &'static str {
        self.asked_for
    }
}

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
        let slot = parts
            .extensions
            .get::<TxSlot<T>>()
            .cloned()
            .ok_or_else(NoTransaction::of::<T>)?;
        let guard = slot.lock_owned().await;
        if guard.is_none() {
            return Err(NoTransaction::of::<T>());
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
            return Err(NoTransaction::of::<T>());
        }
        Ok(Some(Tx(guard)))
    }
}
