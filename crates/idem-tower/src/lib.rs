//! A tower layer that makes retried POSTs safe: the idem HTTP contract for axum and any tower
//! service.
//!
//! [`IdempotencyLayer`] parses the `Idempotency-Key`, scopes it to the request's account,
//! fingerprints the request, and then either replays the stored response, refuses a reused key
//! (`422`), reports a request still running (`409`), or runs the handler once and stores what
//! it answered. Refusals are RFC 9457 problem-details responses with stable `type`s.
//!
//! The handler finds the request's [`idem_core::Scope`] (account and key) among the request
//! extensions.
//!
//! Responses come back as [`ResponseBody`]: the handler's own body, streamed, for requests the
//! layer does not guard and for a response larger than the storage cap
//! ([`idem_core::Policy::storage_cap`]), which is stored with its body omitted before the
//! client gets its first byte; otherwise a body the layer holds whole (a response within the
//! cap, a replay, a refusal). So the layer never holds more of a response than the cap.
//!
//! The layer also keeps the store tidy: from its first request on, a sweeper deletes the
//! completed records past their retention every minute
//! ([`with_sweep_every`](IdempotencyLayer::with_sweep_every),
//! [`without_sweeper`](IdempotencyLayer::without_sweeper)).
//!
//! In transaction mode the handler writes through the transaction the layer opened ([`Tx`]),
//! so the key and the business rows commit together:
//!
//! ```
//! use axum::{Router, routing::post, http::StatusCode};
//! use idem_store::{SqliteStore, SqliteTx};
//! use idem_tower::{IdempotencyLayer, Tx};
//!
//! async fn create_order(mut tx: Tx<SqliteTx>) -> (StatusCode, &'static str) {
//!     sqlx::query("INSERT INTO orders (sku) VALUES ('A1')")
//!         .execute(&mut **tx)
//!         .await
//!         .unwrap();
//!     (StatusCode::CREATED, "created")
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("app.db")).await?;
//! sqlx::query("CREATE TABLE orders (sku TEXT)").execute(store.writer()).await?;
//!
//! let app: Router = Router::new()
//!     .route("/orders", post(create_order))
//!     .layer(IdempotencyLayer::transactional(store));
//! # let _ = app;
//! # Ok(()) }
//! ```

mod body;
mod claim;
mod layer;
mod mode;
mod outcome;
mod reconcile;
mod response;
mod section;
mod signal;
mod sweep;

#[cfg(feature = "axum")]
mod extract;

pub use body::ResponseBody;
#[cfg(feature = "axum")]
pub use extract::{NoTransaction, Tx};
pub use layer::{Idempotency, IdempotencyLayer, ResponseFuture};
pub use mode::{LeaseMode, Mode, TransactionMode};
pub use outcome::Outcome;
pub use reconcile::Reconciliation;
pub use response::{IDEMPOTENT_REPLAY, IDEMPOTENT_REPLAYED};
pub use signal::OutcomeSignal;
pub use sweep::{DEFAULT_SWEEP_EVERY, spawn_sweeper};
