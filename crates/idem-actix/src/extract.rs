//! [`Tx`]: the transaction the layer opened, as an actix-web extractor.

use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::Arc;

use actix_web::dev::Payload;
use actix_web::{FromRequest, HttpMessage, HttpRequest};
use idem_core::ProblemKind;

use crate::middleware::ProblemError;

/// What idem-tower put in the `http` 1 request's extensions, kept whole in the actix request's:
/// the transaction's slot is a type of idem-tower's own, which only [`idem_tower::Tx`] reads.
#[derive(Clone)]
pub(crate) struct LayerExtensions(pub(crate) Arc<http::Extensions>);

/// The open transaction of a request in transaction mode, as an extractor: write the business
/// rows through it and they commit with the key row and the stored response, or not at all.
///
/// `T` is the store's transaction (`idem_store::SqliteTx` for a `SqliteStore`,
/// `idem_store::PgTx` for a `PgStore`); `&mut **tx` is what sqlx executes on. Keep it within
/// the handler: the middleware takes the transaction back, to commit it, when the handler
/// returns.
///
/// On a route not behind [`Idempotent`](crate::Idempotent) in transaction mode over a store
/// whose transaction is a `T`, extracting it fails with `500
/// urn:idem:problem:no-transaction`, naming `T`: a route wired wrong. `Option<Tx<T>>` is
/// `None` then, and when the layer let a keyless request through (on a route whose keys are
/// optional), so the handler can open a transaction of its own.
///
/// ```no_run
/// use actix_web::HttpResponse;
/// use idem_actix::Tx;
/// use idem_store::SqliteTx;
///
/// async fn create_order(mut tx: Tx<SqliteTx>) -> actix_web::Result<HttpResponse> {
///     sqlx::query("INSERT INTO orders (sku) VALUES ('A1')")
///         .execute(&mut **tx)
///         .await
///         .map_err(actix_web::error::ErrorInternalServerError)?;
///     Ok(HttpResponse::Created().finish())
/// }
/// ```
pub struct Tx<T: 'static>(idem_tower::Tx<T>);

impl<T: fmt::Debug> fmt::Debug for Tx<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Tx").field(&self.0).finish()
    }
}

impl<T: Send + 'static> Tx<T> {
    /// idem-tower's guard of the transaction, for code written against it.
    pub fn into_inner(self) -> idem_tower::Tx<T> {
        self.0
    }
}

impl<T> Deref for Tx<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for Tx<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T: Send + 'static> FromRequest for Tx<T> {
    type Error = actix_web::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self, actix_web::Error>>>>;

    fn from_request(request: &HttpRequest, _: &mut Payload) -> Self::Future {
        let extensions = request.extensions().get::<LayerExtensions>().cloned();
        Box::pin(async move {
            let opened = match &extensions {
                Some(LayerExtensions(extensions)) => {
                    idem_tower::Tx::<T>::from_extensions(extensions).await
                }
                None => idem_tower::Tx::<T>::from_extensions(&http::Extensions::new()).await,
            };
            // A route wired wrong, not a refusal of the contract: a `500` without
            // `Retry-After`, since a retry cannot help. Logged when it is answered, so an
            // `Option<Tx<T>>` that finds none logs nothing.
            opened.map(Tx).map_err(|e| {
                ProblemError(ProblemKind::NoTransaction.with_detail(e.to_string())).into()
            })
        })
    }
}
