//! The payments API: create (idempotent, in the key's transaction), show, list.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::{AccountId, Scope};
use idem_store::SqliteTx;
use idem_tower::Tx;
use serde::Serialize;
use serde_json::Value;
use sqlx::Row;

use super::App;

/// A payment as the API shows it.
#[derive(Debug, Serialize)]
struct Payment {
    id: String,
    amount: i64,
    currency: String,
    status: String,
    created_at: i64,
}

/// A problem-details response for the service's own errors (validation, not found).
pub(crate) fn problem(status: StatusCode, kind: &str, title: &str, detail: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        Json(serde_json::json!({
            "type": format!("urn:idem:problem:{kind}"),
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        })),
    )
        .into_response()
}

fn invalid(detail: &str) -> Response {
    problem(
        StatusCode::BAD_REQUEST,
        "validation",
        "The payment request is invalid",
        detail,
    )
}

/// Validates `{"amount": <positive integer>, "currency": "<3 capital letters>"}`.
fn parse_request(body: &[u8]) -> Result<(i64, String), String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let amount = value
        .get("amount")
        .and_then(Value::as_i64)
        .filter(|a| *a > 0)
        // as_i64 refuses 1.0 and "1": amounts are integers in minor units.
        .ok_or("amount must be a positive integer (minor units)")?;
    let currency = value
        .get("currency")
        .and_then(Value::as_str)
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()))
        .ok_or("currency must be three capital letters, such as \"INR\"")?;
    Ok((amount, currency.to_owned()))
}

/// `POST /payments`. Runs inside the transaction the idempotency layer opened, so the payment
/// and the key's stored response commit together.
pub(crate) async fn create(
    State(app): State<App>,
    Extension(scope): Extension<Scope>,
    mut tx: Tx<SqliteTx>,
    body: Bytes,
) -> Response {
    let (amount, currency) = match parse_request(&body) {
        Ok(parsed) => parsed,
        Err(detail) => return invalid(&detail),
    };
    let now = app.clock.now();
    let id = format!("pay_{}", uuid::Uuid::now_v7().simple());
    let account = scope.account.as_str();
    let key = scope.key.as_str();
    // A key reused after its retention is a new request: its old payment gives the key up.
    let retire = sqlx::query(
        "UPDATE payments SET retired_idem_key = idem_key, idem_key = NULL
         WHERE account_id = ?1 AND idem_key = ?2 AND created_at <= ?3",
    )
    .bind(account)
    .bind(key)
    .bind(now.0 - app.policy.retention.as_millis() as i64)
    .execute(&mut **tx)
    .await;
    let insert = match retire {
        Ok(_) => sqlx::query(
            "INSERT INTO payments (id, account_id, idem_key, amount, currency, status, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, 'succeeded', ?6)",
        )
        .bind(&id)
        .bind(account)
        .bind(key)
        .bind(amount)
        .bind(&currency)
        .bind(now.0)
        .execute(&mut **tx)
        .await,
        Err(e) => Err(e),
    };
    if let Err(e) = insert {
        // A unique violation here means the idempotency layer let a duplicate through: the
        // safety net held. Either way nothing is committed (5xx rolls back).
        let safety_net = e
            .as_database_error()
            .is_some_and(|d| d.is_unique_violation());
        tracing::error!(error = %e, safety_net, "inserting a payment failed");
        return problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "The payment could not be recorded",
            "nothing was charged; retry with the same key",
        );
    }
    let payment = Payment {
        id: id.clone(),
        amount,
        currency,
        status: "succeeded".into(),
        created_at: now.0,
    };
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{id}"))],
        Json(payment),
    )
        .into_response()
}

fn payment_from_row(row: &sqlx::sqlite::SqliteRow) -> Result<Payment, sqlx::Error> {
    Ok(Payment {
        id: row.try_get("id")?,
        amount: row.try_get("amount")?,
        currency: row.try_get("currency")?,
        status: row.try_get("status")?,
        created_at: row.try_get("created_at")?,
    })
}

fn database_error(e: sqlx::Error) -> Response {
    tracing::error!(error = %e, "reading payments failed");
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        "The database is unavailable",
        "retry later",
    )
}

/// `GET /payments/{id}`: only the owning account sees a payment; others get `404`.
pub(crate) async fn show(
    State(app): State<App>,
    Extension(account): Extension<AccountId>,
    Path(id): Path<String>,
) -> Response {
    let row = sqlx::query(
        "SELECT id, amount, currency, status, created_at FROM payments
         WHERE id = ?1 AND account_id = ?2",
    )
    .bind(&id)
    .bind(account.as_str())
    .fetch_optional(app.store.readers())
    .await;
    match row {
        Ok(Some(row)) => match payment_from_row(&row) {
            Ok(payment) => Json(payment).into_response(),
            Err(e) => database_error(e),
        },
        Ok(None) => problem(
            StatusCode::NOT_FOUND,
            "not-found",
            "No such payment",
            &format!("no payment {id} in this account"),
        ),
        Err(e) => database_error(e),
    }
}

/// `GET /payments`: the account's payments, newest first (at most 100).
pub(crate) async fn list(
    State(app): State<App>,
    Extension(account): Extension<AccountId>,
) -> Response {
    let rows = sqlx::query(
        "SELECT id, amount, currency, status, created_at FROM payments
         WHERE account_id = ?1 ORDER BY created_at DESC, id DESC LIMIT 100",
    )
    .bind(account.as_str())
    .fetch_all(app.store.readers())
    .await;
    match rows.and_then(|rows| {
        rows.iter()
            .map(payment_from_row)
            .collect::<Result<Vec<_>, _>>()
    }) {
        Ok(data) => Json(serde_json::json!({ "data": data })).into_response(),
        Err(e) => database_error(e),
    }
}
