//! actix-web middleware that makes retried POSTs safe: the idem HTTP contract, run by
//! idem-tower's own layer.
//!
//! [`Idempotent`] wraps an `App`, a `Scope` or a `Resource` with an [`IdempotencyLayer`],
//! built as for axum ([`IdempotencyLayer::transactional`] or [`IdempotencyLayer::leased`],
//! then its `with_*` setters). The answers are the layer's own, not a copy of them: the key
//! rules and their `400`s, the account's scope, `422` for a key reused with another request,
//! `409` or a wait for a duplicate in flight, replays with `Idempotent-Replayed: true`, the
//! stored headers, the storage cap (docs/contract.md §2).
//!
//! How, since actix-web is not tower-based: actix-web 4 speaks `http` 0.2 and its services are
//! `!Send`, while the layer needs `Send` futures over `http` 1. For a covered request the
//! middleware streams the body across, hands the layer an `http` 1 request, and the layer's
//! inner service passes the request it lets through back to the actix side, where the real
//! handler runs; its response crosses back to be stored, and the layer's answer becomes the
//! actix response. Requests whose method the policy does not cover go straight to the handler.
//!
//! What crosses in the request's extensions:
//!
//! - in: the [`idem_core::AccountId`] the app's authentication put in the actix request's
//!   extensions (`request.extensions_mut().insert(account)`). That authentication must run
//!   first: in actix-web the last `.wrap()` runs first. A covered request without one is
//!   refused with `500 urn:idem:problem:no-account`, as on axum;
//! - out: in transaction mode the [`Tx`] extractor; in lease mode the
//!   [`idem_core::DownstreamKey`] to pass to the system the handler calls
//!   (`web::ReqData<DownstreamKey>`); in both the request's [`idem_core::Scope`]
//!   (`web::ReqData<Scope>`).
//!
//! A handler tells the layer what its response means with an [`Outcome`] in the response's
//! extensions (`response.extensions_mut().insert(Outcome::Release)`).
//!
//! In transaction mode the handler's writes and the stored answer commit together:
//!
//! ```
//! use actix_web::body::MessageBody;
//! use actix_web::dev::{ServiceRequest, ServiceResponse};
//! use actix_web::middleware::{Next, from_fn};
//! use actix_web::{App, HttpMessage, HttpResponse, error, test, web};
//! use idem_actix::{IdempotencyLayer, Idempotent, Tx};
//! use idem_core::AccountId;
//! use idem_store::{SqliteStore, SqliteTx};
//!
//! async fn create_order(mut tx: Tx<SqliteTx>) -> actix_web::Result<HttpResponse> {
//!     sqlx::query("INSERT INTO orders (sku) VALUES ('A1')")
//!         .execute(&mut **tx)
//!         .await
//!         .map_err(error::ErrorInternalServerError)?;
//!     Ok(HttpResponse::Created().body("order 1"))
//! }
//!
//! /// The app's own authentication: it names the caller's account, or refuses.
//! async fn authenticate(
//!     request: ServiceRequest,
//!     next: Next<impl MessageBody>,
//! ) -> actix_web::Result<ServiceResponse<impl MessageBody>> {
//!     let token = request.headers().get("authorization").and_then(|v| v.to_str().ok());
//!     let account = match token {
//!         Some("Bearer sk_test_alice") => AccountId::new("acct_alice"),
//!         _ => return Err(error::ErrorUnauthorized("unknown token")),
//!     };
//!     request.extensions_mut().insert(account);
//!     next.call(request).await
//! }
//!
//! # #[actix_web::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("app.db")).await?;
//! sqlx::query("CREATE TABLE orders (sku TEXT)").execute(store.writer()).await?;
//! let layer = IdempotencyLayer::transactional(store);
//!
//! // `HttpServer::new(move || App::new()…)` builds the same app in every worker.
//! let app = test::init_service(
//!     App::new()
//!         .service(
//!             web::resource("/orders")
//!                 .wrap(Idempotent::new(layer.clone()))
//!                 .route(web::post().to(create_order)),
//!         )
//!         // Added last, so it runs first: the middleware sees the account it set.
//!         .wrap(from_fn(authenticate)),
//! )
//! .await;
//!
//! for attempt in 0..2 {
//!     let request = test::TestRequest::post()
//!         .uri("/orders")
//!         .insert_header(("authorization", "Bearer sk_test_alice"))
//!         .insert_header(("idempotency-key", "order-0001"))
//!         .to_request();
//!     let response = test::call_service(&app, request).await;
//!     assert_eq!(response.status(), 201);
//!     let replayed = response.headers().contains_key("idempotent-replayed");
//!     assert_eq!(replayed, attempt == 1, "the retry is a replay");
//! }
//! # Ok(()) }
//! ```
//!
//! The middleware needs actix-web's runtime (`#[actix_web::main]`, `HttpServer`): each
//! covered request runs in a local task of its own, so the work between the claim and the
//! stored outcome runs to its end even if actix drops the request's future.
#![warn(clippy::missing_errors_doc, clippy::missing_panics_doc)]

mod body;
mod bridge;
mod extract;
mod middleware;

pub use body::IdempotentBody;
pub use extract::Tx;
pub use middleware::{Idempotent, IdempotentMiddleware};
// What configuring the middleware takes, so an app needs no idem-tower of its own.
pub use idem_tower::{
    IdempotencyLayer, LeaseMode, Mode, Outcome, OutcomeSignal, Reconciliation, TransactionMode,
    Unidentified,
};
