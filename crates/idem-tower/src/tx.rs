//! [`Tx`]: the transaction the layer opened, for the handler's writes, from any tower service.

use std::ops::{Deref, DerefMut};

use tokio::sync::OwnedMutexGuard;

use crate::mode::TxSlot;

/// The open transaction of a request in transaction mode. Write the business rows through it
/// and they commit together with the key row and the stored response, or not at all.
///
/// In axum it is an extractor; any other tower service (a tonic method, a hand-written
/// service) takes it from the request's extensions with [`Tx::from_extensions`]. Drop it
/// before the handler returns: the layer takes the transaction back then to commit it.
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

impl<T: Send + 'static> Tx<T> {
    /// The transaction the layer opened for this request, from its extensions (tonic:
    /// `request.extensions()`); [`NoTransaction`] when the request is not behind
    /// [`IdempotencyLayer::transactional`](crate::IdempotencyLayer::transactional) over a
    /// store whose transaction is a `T`, or when it passed through without a key.
    ///
    /// # Errors
    ///
    /// [`NoTransaction`] when the layer opened no transaction of type `T` for the request, or
    /// has already taken it back (the handler returned).
    ///
    /// ```no_run
    /// # use idem_store::SqliteTx;
    /// # use idem_tower::{NoTransaction, Tx};
    /// async fn create_order(extensions: &http::Extensions) -> Result<(), NoTransaction> {
    ///     let mut tx = Tx::<SqliteTx>::from_extensions(extensions).await?;
    ///     sqlx::query("INSERT INTO orders (sku) VALUES ('A1')")
    ///         .execute(&mut **tx)
    ///         .await
    ///         .expect("a row");
    ///     Ok(())
    /// }
    /// ```
    pub async fn from_extensions(extensions: &http::Extensions) -> Result<Self, NoTransaction> {
        match Self::if_opened(extensions).await? {
            Some(tx) => Ok(tx),
            None => Err(NoTransaction::of::<T>()),
        }
    }

    /// Like [`from_extensions`](Self::from_extensions), but `None` when the layer opened no
    /// transaction for the request (a keyless request on a method whose keys are optional),
    /// so the handler can open its own.
    ///
    /// # Errors
    ///
    /// [`NoTransaction`] when the layer opened one but has already taken it back (the handler
    /// returned).
    pub async fn if_opened(extensions: &http::Extensions) -> Result<Option<Self>, NoTransaction> {
        let Some(slot) = extensions.get::<TxSlot<T>>().cloned() else {
            return Ok(None);
        };
        let guard = slot.lock_owned().await;
        if guard.is_none() {
            return Err(NoTransaction::of::<T>());
        }
        Ok(Some(Tx(guard)))
    }
}

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
///
/// axum answers it as `500 urn:idem:problem:no-transaction`; with the `tonic` feature it
/// converts into a `tonic::Status` (`INTERNAL`).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error(
    "no idempotency transaction of type {asked_for}: the route is not behind IdempotencyLayer::transactional over a store whose transaction is that type"
)]
pub struct NoTransaction {
    asked_for: &'static str,
}

impl NoTransaction {
    pub(crate) fn of<T>() -> Self {
        Self {
            asked_for: std::any::type_name::<T>(),
        }
    }

    /// The transaction type the handler asked for (`Tx<T>`'s `T`).
    pub fn asked_for(&self) -> &'static str {
        self.asked_for
    }
}

#[cfg(feature = "tonic")]
impl From<NoTransaction> for tonic::Status {
    fn from(e: NoTransaction) -> Self {
        tracing::error!("{e}");
        // A method wired wrong, not a refusal of the contract: a retry cannot help.
        tonic::Status::internal(e.to_string())
    }
}
