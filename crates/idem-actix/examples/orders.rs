//! An actix-web app with idem in both modes: `POST /orders` in transaction mode (the order row
//! commits with its key), `POST /payouts` in lease mode (the provider gets a downstream key).
//!
//! ```sh
//! cargo run -p idem-actix --example orders -- 127.0.0.1:8081
//! curl -i -X POST http://127.0.0.1:8081/orders -H 'authorization: Bearer sk_test_alice' \
//!     -H 'idempotency-key: order-0001' -H 'content-type: application/json' -d '{"sku":"A1"}'
//! ```

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::{Next, from_fn};
use actix_web::{App, HttpMessage, HttpResponse, HttpServer, error, web};
use idem_actix::{IdempotencyLayer, Idempotent, Tx};
use idem_core::{AccountId, DownstreamKey};
use idem_store::{SqliteStore, SqliteTx};

/// Writes the order through the layer's transaction: it commits with the key, or not at all.
async fn create_order(mut tx: Tx<SqliteTx>, body: web::Bytes) -> actix_web::Result<HttpResponse> {
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (body) VALUES (?) RETURNING id")
        .bind(String::from_utf8_lossy(&body).into_owned())
        .fetch_one(&mut **tx)
        .await
        .map_err(error::ErrorInternalServerError)?;
    Ok(HttpResponse::Created()
        .insert_header(("location", format!("/orders/{id}")))
        .json(serde_json::json!({ "id": id })))
}

/// Calls the provider (here, pretends to) with the key it dedupes on.
async fn create_payout(key: web::ReqData<DownstreamKey>) -> HttpResponse {
    HttpResponse::Created().json(serde_json::json!({ "provider_key": key.as_str() }))
}

/// The app's authentication: the bearer token names the account keys are scoped to.
async fn authenticate(
    request: ServiceRequest,
    next: Next<impl MessageBody>,
) -> actix_web::Result<ServiceResponse<impl MessageBody>> {
    let token = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok());
    let account = match token {
        Some("Bearer sk_test_alice") => AccountId::new("acct_alice"),
        Some("Bearer sk_test_bob") => AccountId::new("acct_bob"),
        _ => {
            return Err(error::ErrorUnauthorized(
                "send authorization: Bearer <token>",
            ));
        }
    };
    request.extensions_mut().insert(account);
    next.call(request).await
}

#[actix_web::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:8081".into());
    let store = SqliteStore::open("idem-actix-orders.db").await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, body TEXT)")
        .execute(store.writer())
        .await?;
    // Built once, cloned into each worker's App: one store, one sweeper.
    let orders = IdempotencyLayer::transactional(store.clone());
    let payouts = IdempotencyLayer::leased(store).without_takeover();
    println!("listening on http://{addr}");
    HttpServer::new(move || {
        App::new()
            .service(
                web::resource("/orders")
                    .wrap(Idempotent::new(orders.clone()))
                    .route(web::post().to(create_order)),
            )
            .service(
                web::resource("/payouts")
                    .wrap(Idempotent::new(payouts.clone()))
                    .route(web::post().to(create_payout)),
            )
            // Added last, so it runs first: the middleware finds the account it set.
            .wrap(from_fn(authenticate))
    })
    .bind(addr)?
    .run()
    .await?;
    Ok(())
}
