//! `POST /invoices`: gapless invoice numbers per account, in the key's transaction.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_core::Scope;
use idem_tower::Tx;

use super::app::App;
use super::backend::{Backend, Invoice};
use super::error::ApiError;
use super::payments::{database_error, parse_request};

/// Issues the account's next invoice number. The counter, the invoice and the key's stored
/// response commit together: a retry gets the number already issued, and a request that rolls
/// back gives its number back, so numbers have no gaps and no repeats.
pub(crate) async fn create<B: Backend>(
    State(app): State<App<B>>,
    Extension(scope): Extension<Scope>,
    mut tx: Tx<B::Tx>,
    body: Bytes,
) -> Response {
    let request = match parse_request(&body) {
        Ok(parsed) => parsed,
        Err(detail) => return ApiError::Invalid(detail).into_response(),
    };
    let mut invoice = Invoice {
        id: format!("inv_{}", uuid::Uuid::now_v7().simple()),
        number: 0,
        amount: request.amount,
        currency: request.currency,
        created_at: app.clock.now().0,
    };
    match B::issue_invoice(
        &mut tx,
        scope.account.as_str(),
        scope.key.as_str(),
        &mut invoice,
    )
    .await
    {
        Ok(()) => (StatusCode::CREATED, Json(invoice)).into_response(),
        // Nothing commits on an error (5xx rolls back), so no number is used.
        Err(e) => database_error(e).into_response(),
    }
}
