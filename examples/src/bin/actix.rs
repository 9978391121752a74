//! Payments on actix-web and SQLite, in transaction mode: the payment's row, the key's record
//! and the stored answer commit in one SQLite transaction, or none of them does. idem-actix
//! runs idem-tower's own layer from actix-web, so the answers are the axum examples' own.
//!
//! ```sh
//! cargo run -p idem-examples --bin actix
//! ```
//!
//! `IDEM_EXAMPLE_DB` names the database file (default `payments-actix.db`).

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::{Next, from_fn};
use actix_web::{App, HttpMessage, HttpResponse, HttpServer, error, web};
use idem_actix::{IdempotencyLayer, Idempotent, Tx};
use idem_core::AccountId;
use idem_examples::{ACCOUNTS, NewPayment, POLICY_PATH, Payment, listen_addr};
use idem_store::{SqliteStore, SqliteTx};

async fn create_payment(
    account: web::ReqData<AccountId>,
    mut tx: Tx<SqliteTx>,
    new: web::Json<NewPayment>,
) -> actix_web::Result<HttpResponse> {
    let payment = Payment::new(new.into_inner());
    sqlx::query("INSERT INTO payments (id, account, amount, currency) VALUES (?1, ?2, ?3, ?4)")
        .bind(&payment.id)
        .bind(account.as_str())
        .bind(payment.amount)
        .bind(&payment.currency)
        .execute(&mut **tx)
        .await
        // A 5xx rolls the transaction back: no payment, no key, and a retry runs afresh.
        .map_err(error::ErrorInternalServerError)?;
    Ok(HttpResponse::Created().json(payment))
}

async fn get_payment(
    store: web::Data<SqliteStore>,
    account: web::ReqData<AccountId>,
    id: web::Path<String>,
) -> actix_web::Result<HttpResponse> {
    let payment: Option<Payment> =
        sqlx::query_as("SELECT id, amount, currency FROM payments WHERE id = ?1 AND account = ?2")
            .bind(id.into_inner())
            .bind(account.as_str())
            .fetch_optional(store.readers())
            .await
            .map_err(error::ErrorInternalServerError)?;
    payment
        .map(|payment| HttpResponse::Ok().json(payment))
        .ok_or_else(|| error::ErrorNotFound("no such payment"))
}

/// The app's authentication: the bearer token names the account keys are scoped to.
async fn authenticate(
    request: ServiceRequest,
    next: Next<impl MessageBody>,
) -> actix_web::Result<ServiceResponse<impl MessageBody>> {
    let token = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let Some((_, account)) = ACCOUNTS.iter().find(|(known, _)| Some(*known) == token) else {
        return Err(error::ErrorUnauthorized(
            "send authorization: Bearer <token>",
        ));
    };
    request.extensions_mut().insert(AccountId::new(*account));
    next.call(request).await
}

#[actix_web::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::var("IDEM_EXAMPLE_DB").unwrap_or_else(|_| "payments-actix.db".to_owned());
    let store = SqliteStore::open(path).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments \
         (id TEXT PRIMARY KEY, account TEXT NOT NULL, amount INTEGER NOT NULL, currency TEXT NOT NULL)",
    )
    .execute(store.writer())
    .await?;
    // Built once, cloned into each worker's App: one store, one sweeper.
    let idempotency = IdempotencyLayer::transactional(store.clone()).with_policy_link(POLICY_PATH);
    let policy = idempotency.policy().published("transaction");

    let server = HttpServer::new(move || {
        let policy = policy.clone();
        App::new()
            .app_data(web::Data::new(store.clone()))
            // Public, and outside idem.
            .route(
                POLICY_PATH,
                web::get().to(move || {
                    let policy = policy.clone();
                    async move { HttpResponse::Ok().json(policy) }
                }),
            )
            .service(
                web::scope("/payments")
                    .route("", web::post().to(create_payment))
                    .route("/{id}", web::get().to(get_payment))
                    .wrap(Idempotent::new(idempotency.clone()))
                    // Added last, so it runs first: idem finds the account it set.
                    .wrap(from_fn(authenticate)),
            )
    })
    .bind(listen_addr())?;
    println!("listening on http://{}", server.addrs()[0]);
    server.run().await?;
    Ok(())
}
