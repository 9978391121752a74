//! Payments on axum in lease mode: the handler calls another system (a card provider) that
//! dedupes on the key it is given. The layer claims the key first and stores the answer after;
//! a retry after a crash takes the claim over and calls the provider again under the same
//! downstream key, which the provider answers with the charge it already made.
//!
//! ```sh
//! cargo run -p idem-examples --bin axum-lease
//! ```
//!
//! The provider runs in the same process on a port of its own, as a stand-in for a real one;
//! `IDEM_EXAMPLE_DB` names the SQLite file of idem's records (default `payments-lease.db`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router, middleware};
use idem_examples::{NewPayment, POLICY_PATH, Payment, sandbox_auth};
use idem_store::SqliteStore;
use idem_tower::{Downstream, IdempotencyLayer};

/// The provider's answer to `POST /charges`.
#[derive(serde::Serialize, serde::Deserialize, Clone)]
struct Charge {
    id: String,
    amount: i64,
    currency: String,
}

/// A card provider that makes one charge per `Idempotency-Key`, as real ones do.
async fn provider_charge(
    State(charges): State<Arc<Mutex<HashMap<String, Charge>>>>,
    headers: HeaderMap,
    Json(new): Json<serde_json::Value>,
) -> Result<Json<Charge>, StatusCode> {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .ok_or(StatusCode::BAD_REQUEST)?;
    let mut charges = charges.lock().expect("no panic holds the lock");
    let charge = charges.entry(key.to_owned()).or_insert_with(|| Charge {
        id: format!("ch_{}", uuid::Uuid::new_v4().simple()),
        amount: new["amount"].as_i64().unwrap_or_default(),
        currency: new["currency"].as_str().unwrap_or_default().to_owned(),
    });
    Ok(Json(charge.clone()))
}

#[derive(Clone)]
struct App {
    http: reqwest::Client,
    provider: String,
}

async fn create_payment(
    State(app): State<App>,
    // The key to give the provider: the same for every retry of this request, and different
    // for another request that reuses the key after its retention.
    key: Downstream,
    Json(new): Json<NewPayment>,
) -> Result<(StatusCode, Json<Payment>), StatusCode> {
    let charge: Charge = app
        .http
        .post(format!("{}/charges", app.provider))
        .header("Idempotency-Key", key.as_str())
        .json(&serde_json::json!({ "amount": new.amount, "currency": new.currency }))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        // Not stored: a retry runs again, and the provider's dedupe keeps it one charge.
        .map_err(|_| StatusCode::BAD_GATEWAY)?
        .json()
        .await
        .map_err(|_| StatusCode::BAD_GATEWAY)?;
    let payment = Payment {
        id: charge.id.replacen("ch_", "pay_", 1),
        amount: charge.amount,
        currency: charge.currency,
    };
    Ok((StatusCode::CREATED, Json(payment)))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let provider = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let provider_url = format!("http://{}", provider.local_addr()?);
    let charges = Router::new()
        .route("/charges", post(provider_charge))
        .with_state(Arc::new(Mutex::new(HashMap::new())));
    tokio::spawn(async move { axum::serve(provider, charges).await });

    let path = std::env::var("IDEM_EXAMPLE_DB").unwrap_or_else(|_| "payments-lease.db".to_owned());
    let store = SqliteStore::open(path).await?;
    let idempotency = IdempotencyLayer::leased(store)
        // A duplicate that meets the original in flight waits for its answer (woken by the
        // store, not by polling) instead of taking a 409.
        .with_outcome_wait(Duration::from_secs(10))
        .with_policy_link(POLICY_PATH);
    let policy = idempotency.policy().published("lease");
    let app = Router::new()
        .route("/payments", post(create_payment))
        // In axum the layer added last runs first: auth, then idem, then the handler.
        .layer(idempotency)
        .layer(middleware::from_fn(sandbox_auth))
        // Added after the layers, so it is public and outside idem.
        .route(POLICY_PATH, get(move || async move { Json(policy) }))
        .with_state(App {
            http: reqwest::Client::new(),
            provider: provider_url,
        });
    idem_examples::serve(app).await?;
    Ok(())
}
