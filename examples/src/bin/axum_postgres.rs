//! Payments on axum and PostgreSQL, in transaction mode: the payment's row, the key's record
//! and the stored answer commit in one PostgreSQL transaction, or none of them does. Any
//! number of instances may share the database.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1/payments cargo run -p idem-examples --bin axum-postgres
//! ```

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Extension, Json, Router, middleware};
use idem_core::AccountId;
use idem_examples::{NewPayment, POLICY_PATH, Payment, sandbox_auth};
use idem_store::{PgStore, PgTx};
use idem_tower::{IdempotencyLayer, Tx};

async fn create_payment(
    Extension(account): Extension<AccountId>,
    mut tx: Tx<PgTx>,
    Json(new): Json<NewPayment>,
) -> Result<(StatusCode, Json<Payment>), StatusCode> {
    let payment = Payment::new(new);
    sqlx::query("INSERT INTO payments (id, account, amount, currency) VALUES ($1, $2, $3, $4)")
        .bind(&payment.id)
        .bind(account.as_str())
        .bind(payment.amount)
        .bind(&payment.currency)
        .execute(&mut **tx)
        .await
        // A 5xx rolls the transaction back: no payment, no key, and a retry runs afresh.
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((StatusCode::CREATED, Json(payment)))
}

async fn get_payment(
    State(store): State<PgStore>,
    Extension(account): Extension<AccountId>,
    Path(id): Path<String>,
) -> Result<Json<Payment>, StatusCode> {
    sqlx::query_as("SELECT id, amount, currency FROM payments WHERE id = $1 AND account = $2")
        .bind(id)
        .bind(account.as_str())
        .fetch_optional(store.pool())
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?
        .map(Json)
        .ok_or(StatusCode::NOT_FOUND)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "set DATABASE_URL, such as postgres://postgres@127.0.0.1/payments")?;
    // Runs idem's migrations (its tables beside the app's own).
    let store = PgStore::connect(&url).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments \
         (id TEXT PRIMARY KEY, account TEXT NOT NULL, amount BIGINT NOT NULL, currency TEXT NOT NULL)",
    )
    .execute(store.pool())
    .await?;

    let idempotency = IdempotencyLayer::transactional(store.clone()).with_policy_link(POLICY_PATH);
    let policy = idempotency.policy().published("transaction");
    let app = Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/{id}", get(get_payment))
        // In axum the layer added last runs first: auth, then idem, then the handler.
        .layer(idempotency)
        .layer(middleware::from_fn(sandbox_auth))
        // Added after the layers, so it is public and outside idem.
        .route(POLICY_PATH, get(move || async move { Json(policy) }))
        .with_state(store);
    idem_examples::serve(app).await?;
    Ok(())
}
