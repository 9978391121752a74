//! The core of idem: everything about idempotency keys that needs no I/O.
//!
//! A request with an `Idempotency-Key` is parsed ([`IdempotencyKey`]), scoped to its account
//! ([`Scope`]), fingerprinted ([`Fingerprint`]), and then [`decide`]d against the record its
//! scope names: do the work, replay, refuse a mismatch, or report that it is still running.
//! Stores (`idem-store`) keep [`Record`]s; the layer (`idem-tower`) turns decisions into HTTP.
//! Time is injected ([`Clock`]), so every decision is a function of its inputs.
//!
//! ```
//! use idem_core::*;
//!
//! let key = IdempotencyKey::parse(b"\"pay-2026-0001\"", KeyLimits::default())?;
//! let scope = Scope::new(AccountId::new("acct_42"), key);
//! let fingerprint = Fingerprint::compute(&RequestParts {
//!     account: scope.account.as_str(),
//!     method: "POST",
//!     route: "/payments",
//!     query: "",
//!     content_type: "application/json",
//!     body: br#"{"amount": 49900, "currency": "INR"}"#,
//! })?;
//! let now = Timestamp(1_000);
//!
//! // Nothing stored yet: claim the key and do the work.
//! assert_eq!(decide(None, &fingerprint, now), Decision::Fresh);
//!
//! // Finished earlier: replay the stored response.
//! let record = Record {
//!     scope,
//!     fingerprint,
//!     state: RecordState::Completed(StoredResponse {
//!         status: 201, headers: vec![], body: b"{}".to_vec(), body_omitted: false,
//!     }),
//!     created_at: now,
//!     expires_at: now.plus(Policy::default().retention),
//! };
//! assert!(matches!(decide(Some(&record), &fingerprint, now), Decision::Replay(_)));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(clippy::missing_errors_doc, clippy::missing_panics_doc)]

mod canonical_json;
#[cfg(test)]
mod canonical_json_reference;
mod error_chain;
mod fingerprint;
mod grpc;
mod key;
#[cfg(any(test, feature = "key-reference"))]
#[doc(hidden)]
pub mod key_reference;
mod policy;
mod problem;
mod record;
mod scope;
mod time;

pub use canonical_json::{JsonError, MAX_DEPTH, canonical_json};
pub use error_chain::ErrorChain;
pub use fingerprint::{Fingerprint, RequestParts};
pub use grpc::{GrpcClass, GrpcCode, grpc_message, is_grpc_content_type};
pub use key::{IdempotencyKey, KeyError, KeyLimits};
pub use policy::{Policy, PublishedPolicy};
pub use problem::{ErrorDialect, Problem, ProblemKind};
pub use record::{
    Decision, FencingToken, Record, RecordEvent, RecordState, StoredResponse, TRAILER_PREFIX,
    decide,
};
pub use scope::{AccountId, DownstreamKey, Scope};
pub use time::{Clock, ManualClock, SystemClock, Timestamp};
