//! A tower layer that makes retried POSTs safe: the idem HTTP contract for axum and any tower
//! service.
//!
//! [`IdempotencyLayer`] parses the `Idempotency-Key`, scopes it to the request's account,
//! fingerprints the request, and then either replays the stored response, refuses a reused key
//! (`422`), reports a request still running (`409`), or runs the handler once and stores what
//! it answered. Refusals are RFC 9457 problem-details responses with stable `type`s.
//!
//! The handler finds the request's [`idem_core::Scope`] (account and key) among the request
//! extensions; in lease mode also the [`idem_core::DownstreamKey`] to pass to the system it
//! calls (axum: the [`Downstream`] extractor), the same for every retry and takeover of the
//! request, so a downstream that dedupes by it acts once.
//!
//! Responses come back as [`ResponseBody`]: the handler's own body, streamed, for requests the
//! layer does not guard and for a response larger than the storage cap
//! ([`idem_core::Policy::storage_cap`]), which is stored with its body omitted before the
//! client gets its first byte; otherwise a body the layer holds whole (a response within the
//! cap, a replay, a refusal). So the layer never holds more of a response than the cap.
//!
//! Keys are scoped to the caller's account: the layer reads the [`idem_core::AccountId`] that
//! the service's authentication put in the request's extensions, so that authentication must
//! run first (in axum the last `.layer()` runs first). A covered request without one is
//! refused with `500 urn:idem:problem:no-account` rather than filed under a scope shared with
//! every other caller ([`IdempotencyLayer::with_account`] and
//! [`IdempotencyLayer::with_shared_anonymous_scope`] change that).
//!
//! The layer also keeps the store tidy: from its first request on, a sweeper deletes the
//! completed records past their retention every minute
//! ([`with_sweep_every`](IdempotencyLayer::with_sweep_every),
//! [`without_sweeper`](IdempotencyLayer::without_sweeper)).
//!
//! gRPC calls (`content-type: application/grpc`) get the same contract on tonic's
//! `Server::builder().layer(IdempotencyLayer::..)` (feature `tonic`): the key is the
//! `idempotency-key` metadata; a replay carries the stored message and trailers
//! (`grpc-status`, `grpc-message`, details, custom trailers) and `idempotent-replayed: true`;
//! the layer's own refusals are gRPC statuses in trailers-only responses; what a status means
//! for the key is [`idem_core::GrpcCode::class`]. Streaming methods must be named
//! ([`IdempotencyLayer::with_grpc_streaming`]) to pass through untouched when they carry a key.
//! The request body types the layer can hand on are those of [`RebuildBody`].
//!
//! In transaction mode the handler writes through the transaction the layer opened ([`Tx`]:
//! an axum extractor, or [`Tx::from_extensions`] from any tower service, tonic's included),
//! so the key and the business rows commit together:
//!
//! ```
//! use axum::{Router, extract::Request, middleware::{self, Next}, response::Response};
//! use axum::{http::StatusCode, routing::post};
//! use idem_core::AccountId;
//! use idem_store::{SqliteStore, SqliteTx};
//! use idem_tower::{IdempotencyLayer, Tx};
//!
//! async fn create_order(mut tx: Tx<SqliteTx>) -> Result<StatusCode, StatusCode> {
//!     sqlx::query("INSERT INTO orders (sku) VALUES ('A1')")
//!         .execute(&mut **tx)
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(StatusCode::CREATED)
//! }
//!
//! /// The app's own authentication: it names the caller's account, or refuses.
//! async fn authenticate(mut request: Request, next: Next) -> Result<Response, StatusCode> {
//!     let token = request.headers().get("authorization").and_then(|v| v.to_str().ok());
//!     let account = match token {
//!         Some("Bearer sk_test_alice") => AccountId::new("acct_alice"),
//!         _ => return Err(StatusCode::UNAUTHORIZED),
//!     };
//!     request.extensions_mut().insert(account);
//!     Ok(next.run(request).await)
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
//!     .layer(IdempotencyLayer::transactional(store))
//!     // Added last, so it runs first: the layer sees the account it set.
//!     .layer(middleware::from_fn(authenticate));
//! # let _ = app;
//! # Ok(()) }
//! ```
// On docs.rs (nightly), mark each feature-gated item with the feature that enables it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(clippy::missing_errors_doc, clippy::missing_panics_doc)]

mod body;
mod claim;
mod downstream;
mod grpc;
mod layer;
mod mode;
mod outcome;
mod rebuild;
mod reconcile;
mod response;
mod section;
mod signal;
mod sweep;
mod telemetry;
mod tx;

#[cfg(feature = "axum")]
mod extract;

pub use body::ResponseBody;
pub use downstream::{Downstream, NoDownstreamKey};
pub use layer::{Idempotency, IdempotencyLayer, ResponseFuture, Unidentified};
pub use mode::{LeaseMode, Mode, TransactionMode};
pub use outcome::Outcome;
pub use rebuild::RebuildBody;
pub use reconcile::Reconciliation;
pub use response::{IDEMPOTENT_REPLAY, IDEMPOTENT_REPLAYED};
pub use signal::OutcomeSignal;
pub use sweep::{DEFAULT_SWEEP_EVERY, spawn_sweeper};
pub use telemetry::{REQUEST_SPAN_TARGET, STORE_SPAN_TARGET};
pub use tx::{NoTransaction, Tx};
