//! A retry client for idempotent HTTP requests, on reqwest: what a caller uses instead of a
//! hand-written retry loop.
//!
//! An [`Intent`] is one thing to be done once: a request and an idempotency key made with it
//! (a UUID v4), sent unchanged on every attempt so the server can tell a retry from a new
//! request. [`Client::send`] tries it until the server gives a final answer:
//!
//! - retried: connection errors, dropped connections, timeouts, `429`, `5xx`, and `409` for a
//!   key still in use (idem's `in-use` or `outcome-unknown` problem, or any `409` with
//!   `Retry-After`);
//! - final: everything else, `400`, `422` and the other `4xx` included, which need a changed
//!   request and so a new key;
//! - the wait before retry `n` is drawn from `[0, min(cap, base · 2^n)]` (capped exponential
//!   backoff with full jitter, [`RetryPolicy`]), unless the response has `Retry-After`
//!   (delta-seconds or an HTTP-date), which is obeyed up to [`RetryPolicy::max_retry_after`];
//! - a [`RetryBudget`] shared by the client's intents stops retries when a struggling server
//!   would otherwise be stormed by them.
//!
//! The [`Answer`] says whether the server replayed a stored response and how many attempts it
//! took; an [`Error`] says why no final answer came, with the attempt count and the last
//! response or transport error.
//!
//! The clock, the sleeper and the RNG are injected ([`Client::with_clock`],
//! [`Client::with_sleeper`], [`Client::with_rng`]): tests record the waits instead of sitting
//! through them, and a seeded RNG makes a run reproducible.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//!
//! use axum::{Router, http::StatusCode, routing::post};
//! use idem_client::{Client, Intent, RecordingSleeper, RetryPolicy};
//! use rand::{SeedableRng, rngs::StdRng};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A server that is overloaded once, then takes the payment.
//! let calls = Arc::new(AtomicU32::new(0));
//! let app = Router::new().route(
//!     "/payments",
//!     post(move || async move {
//!         match calls.fetch_add(1, Ordering::SeqCst) {
//!             0 => StatusCode::SERVICE_UNAVAILABLE,
//!             _ => StatusCode::CREATED,
//!         }
//!     }),
//! );
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let url = format!("http://{}/payments", listener.local_addr()?);
//! tokio::spawn(async move { axum::serve(listener, app).await });
//!
//! // The default sleeper waits on Tokio's timer; this one only records the waits.
//! let sleeper = RecordingSleeper::new();
//! let client = Client::new()
//!     .with_policy(RetryPolicy { max_attempts: 3, ..RetryPolicy::default() })
//!     .with_sleeper(sleeper.clone())
//!     .with_rng(StdRng::seed_from_u64(42));
//!
//! let intent = Intent::post(url).json(&serde_json::json!({"amount": 49900, "currency": "INR"}));
//! let answer = client.send(&intent).await?;
//!
//! assert_eq!(answer.status, StatusCode::CREATED);
//! assert_eq!(answer.attempts, 2);
//! assert!(!answer.replayed);
//! assert_eq!(answer.key.as_ref(), intent.key());
//! assert!(sleeper.slept()[0] <= Duration::from_millis(100));
//! # Ok(()) }
//! ```

#![warn(clippy::missing_errors_doc, clippy::missing_panics_doc)]

mod budget;
mod classify;
mod client;
mod error;
mod intent;
mod policy;
mod sleep;

pub use budget::RetryBudget;
pub use client::{Answer, Client};
pub use error::{Error, Stop};
pub use intent::Intent;
pub use policy::{Delays, RetryPolicy};
pub use sleep::{RecordingSleeper, Sleep, Sleeper, TokioSleeper};

/// A `Result` whose error is this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
