//! What the examples share, so that each binary shows only its stack's own wiring: two sandbox
//! accounts behind bearer tokens, the payment they create, and where to listen.
//!
//! Every example serves the same small payments API, which `idem drill` checks in CI
//! (`tests/examples.rs`):
//!
//! - `POST /payments` with `{"amount": 49900, "currency": "INR"}` and an `Idempotency-Key`
//!   creates a payment: `201` and its JSON, with an `id`;
//! - `GET /payments/{id}` reads it back;
//! - `GET /idempotency-policy` publishes the layer's rules.

use std::net::SocketAddr;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idem_core::AccountId;
use serde::{Deserialize, Serialize};

/// Where the layer's rules are published, and what its refusals link to.
pub const POLICY_PATH: &str = "/idempotency-policy";

/// The two sandbox accounts: `(token, account)`.
pub const ACCOUNTS: [(&str, &str); 2] =
    [("sk_test_alice", "acct_alice"), ("sk_test_bob", "acct_bob")];

/// Authentication, the app's own: `Authorization: Bearer <token>` names the account, which goes
/// into the request's extensions for idem's layer to scope keys by. It must run before the layer
/// (in axum, the `.layer(..)` added after it).
pub async fn sandbox_auth(mut request: Request, next: Next) -> Response {
    let token = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    let Some((_, account)) = ACCOUNTS.iter().find(|(known, _)| Some(*known) == token) else {
        return StatusCode::UNAUTHORIZED.into_response();
    };
    request.extensions_mut().insert(AccountId::new(*account));
    next.run(request).await
}

/// What `POST /payments` takes.
#[derive(Debug, Deserialize)]
pub struct NewPayment {
    /// In the currency's minor unit.
    pub amount: i64,
    /// ISO 4217, such as `INR`.
    pub currency: String,
}

/// A payment, as stored and as answered.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct Payment {
    /// `pay_` and 32 hex digits.
    pub id: String,
    /// In the currency's minor unit.
    pub amount: i64,
    /// ISO 4217.
    pub currency: String,
}

impl Payment {
    /// A new payment with a fresh id.
    pub fn new(new: NewPayment) -> Self {
        Self {
            id: format!("pay_{}", uuid::Uuid::new_v4().simple()),
            amount: new.amount,
            currency: new.currency,
        }
    }
}

/// The address to listen on: `IDEM_EXAMPLE_ADDR`, else `127.0.0.1:3000`.
///
/// # Panics
///
/// When `IDEM_EXAMPLE_ADDR` is not an address such as `127.0.0.1:0`.
pub fn listen_addr() -> SocketAddr {
    std::env::var("IDEM_EXAMPLE_ADDR")
        .map(|addr| {
            addr.parse()
                .expect("IDEM_EXAMPLE_ADDR is an address such as 127.0.0.1:0")
        })
        .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 3000)))
}

/// Binds [`listen_addr`], says where it listens on stdout (the tests wait for that line), and
/// serves `app` until the process ends.
///
/// # Errors
///
/// When the address cannot be bound.
pub async fn serve(app: axum::Router) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen_addr()).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await
}
