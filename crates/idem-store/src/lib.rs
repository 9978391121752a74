//! Where idem keeps its records.
//!
//! Every backend implements [`Store`], whose [`Store::claim`] is one atomic insert-if-absent:
//! of any number of concurrent claims of a key, exactly one wins. Backends whose business
//! writes can share the key's transaction also implement [`TransactionalStore`] (docs/contract.md §3,
//! transaction mode). One conformance suite ([`conformance`], feature `conformance`) runs
//! against every backend.
//!
//! # One clock: the store's
//!
//! Lease deadlines, takeovers, expiry and sweeps are judged by one clock for every instance
//! that shares a store: PostgreSQL's (`clock_timestamp()`, read inside each statement) and
//! Redis's (`TIME`, read inside each script), so an instance whose clock is minutes off can
//! neither take a live claim over nor expire a record early. SQLite is reached by one machine,
//! whose clock is the callers' own: it takes the callers' times as they are.
//!
//! Callers still speak in their own clock's terms: every operation that takes or returns a time
//! carries the caller's `now` (a [`NewClaim`]'s, or a `now` argument). A shared store keeps
//! only the distances from it (the lease, the retention) and applies them to its own clock, and
//! hands records back moved into the caller's frame (a stored time minus the store's now plus
//! the caller's), so that [`idem_core::decide`] at the caller's `now` decides as the store did.
//! No operation costs a round trip more for it: the store reads its clock in the statement or
//! script that does the work.
//!
//! Backends: [`SqliteStore`] (feature `sqlite`, the embedded default), [`PgStore`] (feature
//! `postgres`, shared by many server instances, and following its primary to a promoted
//! standby when its URL names both), [`TokioPgStore`] (feature `tokio-postgres`: transaction
//! mode on PostgreSQL through a client that pipelines, three round trips for a first request
//! where `PgStore` takes eight; what `idem serve` runs on) and [`RedisStore`] (feature `redis`,
//! lease mode only: the gateway's). [`MemoryStore`], always compiled, keeps records in this
//! process's memory for tests and quickstarts (lease mode only).
//!
//! # Your database client, and ours
//!
//! The transaction types a handler writes through are the database client's own types:
//! [`SqliteTx`] and [`PgTx`] are sqlx's, [`TokioPgTx`] is tokio-postgres's. An app that writes
//! through them must use the same version of that client as idem-store does, or its queries
//! will not accept them; [`sqlx`] and [`tokio_postgres`] are re-exported here for that, so
//! `idem_store::sqlx::query(..)` always fits.
//!
//! ```
//! use idem_core::*;
//! use idem_store::{ClaimOutcome, NewClaim, SqliteStore, Store};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("idem.db")).await?;
//!
//! let scope = Scope::new(AccountId::new("acct_1"), IdempotencyKey::parse(b"order-0001", KeyLimits::default())?);
//! let fingerprint = Fingerprint::compute(&RequestParts {
//!     account: "acct_1", method: "POST", route: "/orders", query: "",
//!     content_type: "application/json", body: br#"{"sku":"A1"}"#,
//! })?;
//! let now = Timestamp(1_700_000_000_000);
//! let claim = NewClaim::new(scope.clone(), fingerprint, FencingToken(1), now, &Policy::default());
//!
//! assert!(matches!(store.claim(&claim).await?, ClaimOutcome::Claimed));
//! // A second claim of the same key finds the first one in progress.
//! assert!(matches!(store.claim(&claim).await?, ClaimOutcome::Existing(_)));
//!
//! let response = StoredResponse { status: 201, headers: vec![], body: b"{}".to_vec(), body_omitted: false };
//! assert!(store.complete(&scope, FencingToken(1), &response, now).await?);
//! let record = store.get(&scope, now).await?.unwrap();
//! assert_eq!(decide(Some(&record), &fingerprint, now), Decision::Replay(&response));
//! # Ok(()) }
//! ```
// On docs.rs (nightly), mark each feature-gated item with the feature that enables it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(clippy::missing_errors_doc, clippy::missing_panics_doc)]

use std::future::Future;
use std::time::Duration;

use idem_core::{
    AccountId, FencingToken, Fingerprint, Policy, Record, RecordEvent, Scope, StoredResponse,
    Timestamp,
};

mod error;
mod memory;
mod notify;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis_store;
mod shared_secret;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "tokio-postgres")]
mod tokio_pg;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod watched;

pub use error::{Error, Result, is_unavailable};
pub use memory::MemoryStore;
pub use notify::{OUTCOME_POLL, OutcomeChannel};
#[cfg(feature = "postgres")]
pub use postgres::{MigrationError, NoPrimary, PgStore, PgTx, PgUrlError, migrate_pg};
#[cfg(feature = "redis")]
pub use redis_store::{RedisStore, ReplicasUnconfirmed};
pub use shared_secret::{Shared, SharedSecret};
#[cfg(feature = "sqlite")]
pub use sqlite::{GroupCommitFailed, SqliteStore, SqliteTx};
#[cfg(feature = "tokio-postgres")]
pub use tokio_pg::{DEFAULT_POOL_SIZE, TokioPgClient, TokioPgStore, TokioPgTx};

/// The sqlx this crate is built on. [`SqliteTx`] and [`PgTx`] are sqlx's own types (they
/// dereference to its connections), so an app that writes through them must use this sqlx, or
/// the same version of it: `idem_store::sqlx::query(..)`.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use sqlx;
/// The tokio-postgres this crate is built on. [`TokioPgTx`] holds its client, so an app that
/// writes through it must use this tokio-postgres, or the same version of it.
#[cfg(feature = "tokio-postgres")]
pub use tokio_postgres;

/// A request to claim a key.
#[derive(Debug, Clone)]
pub struct NewClaim {
    /// The key and its account.
    pub scope: Scope,
    /// The claiming request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The token this claim will hold.
    pub token: FencingToken,
    /// The time of the claim by the caller's clock: the frame of `lease_until` and
    /// `expires_at`, and of the record a lost claim returns. A shared store claims at its own
    /// clock's now (see [One clock](crate#one-clock-the-stores)).
    pub now: Timestamp,
    /// Until when the claim holds without renewal: `now` plus the policy's
    /// [`lease_hold`](Policy::lease_hold), which covers the longest downstream call.
    pub lease_until: Timestamp,
    /// When the record's retention would end if it completed at once: `now` plus the
    /// retention. A completion moves it to the completion time plus the retention; an
    /// in-progress record never expires.
    pub expires_at: Timestamp,
    /// Whether a record of the same request whose lease ran out may be taken over. Lease-mode
    /// callers that pass the key downstream may; callers that must reconcile first may not.
    pub take_over_expired_lease: bool,
}

impl NewClaim {
    /// A claim at `now` held for the policy's [`lease_hold`](Policy::lease_hold), with its
    /// retention, taking over expired leases.
    pub fn new(
        scope: Scope,
        fingerprint: Fingerprint,
        token: FencingToken,
        now: Timestamp,
        policy: &Policy,
    ) -> Self {
        Self {
            scope,
            fingerprint,
            token,
            now,
            lease_until: now.plus(policy.lease_hold()),
            expires_at: now.plus(policy.retention),
            take_over_expired_lease: true,
        }
    }
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
// Exhaustive on purpose: whoever claims must handle every outcome, so a new one is a compile
// error in each caller rather than a silent catch-all.
pub enum ClaimOutcome {
    /// The key is ours: a new in-progress record holds the claim's token.
    Claimed,
    /// A record that the claim may not replace (see [`idem_core::decide`] for what it means).
    Existing(Record),
}

/// A record store, atomic by contract.
///
/// Times are judged by the store's clock; each `now` a method takes is the caller's, the frame
/// of the times it passes and gets back (see [One clock](crate#one-clock-the-stores)).
///
/// # Errors
///
/// Every method may fail with [`Error::Unavailable`] when the store cannot be reached, no
/// connection is free in time, or a statement passes its deadline; and with the backend's
/// own variant ([`Error::Database`], `Postgres`, `Redis`) when it refuses a statement. Those
/// that read a record back give [`Error::Corrupt`] when it cannot be read as one, and
/// [`claim`](Self::claim) gives [`Error::Raced`] when it kept losing to records that vanished.
pub trait Store: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// Reads the record `scope` names, if any, its times in the frame of the caller's `now`.
    /// Never blocks on a concurrent claim.
    fn get(
        &self,
        scope: &Scope,
        now: Timestamp,
    ) -> impl Future<Output = Result<Option<Record>>> + Send;

    /// Claims a key (lease mode): one atomic insert-if-absent that also replaces a completed
    /// record past its retention and, if allowed, a stale claim of the same request whose lease
    /// ran out. Otherwise returns the record that holds the key (in the frame of the claim's
    /// `now`). An in-progress record is never replaced for its age alone.
    fn claim(&self, claim: &NewClaim) -> impl Future<Output = Result<ClaimOutcome>> + Send;

    /// Stores the outcome of the claim holding `token`, at the caller's `now`: the record's
    /// retention (its `expires_at` less its `created_at`, as claimed) counts from then. Returns
    /// `false`, storing nothing, when that claim no longer holds the key (it was taken over or
    /// released).
    fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Extends the lease of the claim holding `token` to `lease` past now (the store's now; a
    /// zero `lease` ends it at once); `false` if it no longer holds the key.
    fn renew(
        &self,
        scope: &Scope,
        token: FencingToken,
        lease: Duration,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Deletes the in-progress record of the claim holding `token`, so the next request runs
    /// fresh (nothing happened). `false` if it no longer holds the key.
    fn release(
        &self,
        scope: &Scope,
        token: FencingToken,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Deletes at most `batch` completed records past their retention in one statement;
    /// returns how many. In-progress records are never swept, however old: their outcome is
    /// unknown until it is resolved. `now` is the caller's (a shared store sweeps by its own
    /// clock). Safe to run from every instance at once.
    fn sweep(&self, now: Timestamp, batch: u32) -> impl Future<Output = Result<u64>> + Send;

    /// Whether a [`claim`](Self::claim) that finds the key taken costs no more than a
    /// [`get`](Self::get): one round trip that answers with the record, as Redis's claim
    /// script does. A layer then claims at once instead of reading first to answer replays,
    /// since the read would only add a round trip to every first request. `false` (the
    /// default) where a lost claim costs more than a read: on SQLite it queues for the one
    /// writer, on PostgreSQL it is a write and then a read.
    fn claim_answers_like_a_read(&self) -> bool {
        false
    }
}

/// A store whose key row can share a transaction with the handler's business writes.
///
/// # Errors
///
/// As for [`Store`]; [`commit_response`](Self::commit_response) also gives [`Error::Raced`]
/// when the transaction's own key row vanished, and then nothing was committed.
pub trait TransactionalStore: Store {
    /// The open transaction the handler writes through.
    type Tx: Send + std::fmt::Debug + 'static;

    /// Whether a [`begin_claim`](Self::begin_claim) that finds the key taken answers with the
    /// record at little more than a [`get`](Store::get)'s cost, so that a layer claims at once
    /// instead of reading first to answer replays, as for [`Store::claim_answers_like_a_read`].
    /// `false` (the default) where a lost claim costs much more than a read: on SQLite it
    /// queues for the one writer, on [`PgStore`] it locks the row it lost to.
    fn begin_claim_answers_like_a_read(&self) -> bool {
        false
    }

    /// Where the work from a claim to its commit runs best, when not on the runtime of the
    /// request: for a store with one writer, the writer's own thread, so that a request
    /// holding the writer is not queued behind other requests' work. `None` (the default):
    /// where the request runs.
    fn transaction_runtime(&self) -> Option<tokio::runtime::Handle> {
        None
    }

    /// Opens a transaction and claims the key inside it. A concurrent claim of the same key
    /// is waited for up to `wait`: then its committed record is returned, or, if it rolled
    /// back, the key is claimed.
    fn begin_claim(
        &self,
        claim: &NewClaim,
        wait: Duration,
    ) -> impl Future<Output = Result<TxClaim<Self::Tx>>> + Send;

    /// Stores `response` in the transaction's key row and commits: key, business rows and
    /// response become visible together or not at all.
    fn commit_response(
        &self,
        tx: Self::Tx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Rolls back: the key row goes with the business writes, so a retry runs fresh.
    fn rollback(&self, tx: Self::Tx) -> impl Future<Output = Result<()>> + Send;
}

/// What [`TransactionalStore::begin_claim`] found.
#[derive(Debug)]
// Exhaustive on purpose: whoever claims must handle every outcome, so a new one is a compile
// error in each caller rather than a silent catch-all.
pub enum TxClaim<Tx> {
    /// The key is claimed inside this open transaction.
    Claimed(Tx),
    /// A committed record holds the key.
    Existing(Record),
    /// Another transaction held the key for longer than the wait.
    Busy,
}

/// Which records [`AdminStore::list`] returns.
#[derive(Debug, Clone, Default)]
pub struct RecordFilter {
    /// Only this account's.
    pub account: Option<AccountId>,
    /// Only in-progress records (`true`) or only completed ones (`false`).
    pub in_progress: Option<bool>,
    /// Only records whose lease ran out by then, in the frame of the `now` given to
    /// [`AdminStore::list`] (in-progress records a crashed worker left). A shared store judges
    /// it by its own clock, so `Some(now)` is "ran out by now" whatever the caller's clock says.
    pub lease_expired_by: Option<Timestamp>,
    /// At most this many (default 100 when zero).
    pub limit: u32,
}

impl RecordFilter {
    /// The limit every backend applies: the `limit` field, or 100 when it is zero.
    fn limit(&self) -> i64 {
        if self.limit == 0 {
            100
        } else {
            i64::from(self.limit)
        }
    }

    /// The state the filter asks for, as every SQL and Redis backend stores it.
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "redis"))]
    fn state(&self) -> Option<&'static str> {
        self.in_progress
            .map(|p| if p { "in_progress" } else { "completed" })
    }
}

/// What operators and reconcilers need beyond the request path (`idem keys`, the lease
/// reconciler of `idem serve`).
///
/// # Errors
///
/// As for [`Store`].
pub trait AdminStore: Store {
    /// Records matching `filter`, newest first, their times in the frame of the caller's `now`.
    fn list(
        &self,
        filter: &RecordFilter,
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<Record>>> + Send;

    /// Deletes the record `scope` names, whatever its state; `false` if there was none.
    fn purge(&self, scope: &Scope) -> impl Future<Output = Result<bool>> + Send;

    /// Completes the in-progress record `scope` names with `response`, whatever its token: an
    /// operator (or reconciler) who knows the outcome. As with [`Store::complete`], its
    /// retention counts from the caller's `now`. `false` if it is not in progress.
    fn force_complete(
        &self,
        scope: &Scope,
        response: &StoredResponse,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Adds `event` to the history of the key `scope` names: what an operator or a reconciler
    /// did to it (a resolution, a reconciliation), kept apart from the record, so that it
    /// outlives a release and is read by every process that shares the store. Only those rare
    /// operations write one, never a request's claim, renewal or completion.
    ///
    /// The history is bounded: a key keeps its latest [`EVENTS_KEPT`] events; events older
    /// than [`EVENTS_RETENTION`] (by the new event's time) are deleted, every key's, when an
    /// event is written (on Redis a key's list expires that long after its latest event); and
    /// [`purge`](Self::purge) deletes a key's events with its record. The sweeper leaves them:
    /// a key's events are its own, whether or not it has a record, so a record released,
    /// swept or claimed anew keeps the history of its key. `event.at` is the writer's clock,
    /// kept as it is given.
    fn record_event(
        &self,
        scope: &Scope,
        event: &RecordEvent,
    ) -> impl Future<Output = Result<()>> + Send;

    /// The history of the key `scope` names, oldest first (in the order they were recorded):
    /// empty when nothing was recorded, or all of it has expired.
    fn events(&self, scope: &Scope) -> impl Future<Output = Result<Vec<RecordEvent>>> + Send;
}

/// How many events a key's history keeps ([`AdminStore::record_event`]): the latest ones.
pub const EVENTS_KEPT: usize = 100;

/// How long an event of a key's history is kept ([`AdminStore::record_event`]): 30 days from
/// its time, until the next event is written (on Redis, 30 days from the key's latest event,
/// when the list expires whole).
pub const EVENTS_RETENTION: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// [`EVENTS_RETENTION`] in milliseconds.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "redis"))]
pub(crate) const EVENTS_RETENTION_MS: i64 = 30 * 24 * 60 * 60 * 1000;

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "redis"))]
/// Rebuilds a scope read back from a store: the key was validated when it was stored, under
/// limits that may since have changed, so it is not validated again.
pub(crate) fn stored_scope(account: String, key: String) -> Result<idem_core::Scope> {
    let limits = idem_core::KeyLimits {
        min_len: 1,
        max_len: usize::MAX,
    };
    let key = idem_core::IdempotencyKey::new(key, limits)
        .map_err(|e| Error::Corrupt(format!("a stored key is invalid: {e}")))?;
    Ok(idem_core::Scope::new(
        idem_core::AccountId::new(account),
        key,
    ))
}

/// `record`, read when the store's clock said `store_now` (Unix milliseconds), with its times
/// moved into the frame of the caller's `now`: a time's distance from the store's now becomes
/// its distance from the caller's.
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) fn in_caller_frame(mut record: Record, store_now: i64, now: Timestamp) -> Record {
    let shift = |t: &mut Timestamp| t.0 = t.0.saturating_sub(store_now).saturating_add(now.0);
    shift(&mut record.created_at);
    shift(&mut record.expires_at);
    if let idem_core::RecordState::InProgress { lease_until, .. } = &mut record.state {
        shift(lease_until);
    }
    record
}

/// `d` in whole milliseconds, saturating: how the shared stores pass durations.
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Runs the sweeper once: deletes expired records in batches until none is left.
///
/// # Errors
///
/// The first error of the store's [`sweep`](Store::sweep); the batches before it stay deleted.
pub async fn sweep_all<S: Store>(store: &S, now: Timestamp, batch: u32) -> Result<u64> {
    sweep_all_paced(store, now, batch, 0).await
}

/// [`sweep_all`], pausing after each full batch `pause_per_busy` times as long as the batch
/// took, so the sweep takes at most `1 / (1 + pause_per_busy)` of the store's time. Claims
/// need that time: on SQLite they wait for the same one writer, and 1,000 rows deleted back
/// to back there held it long enough to cost a server under load a third to a half of its
/// throughput.
///
/// # Errors
///
/// As for [`sweep_all`].
pub async fn sweep_all_paced<S: Store>(
    store: &S,
    now: Timestamp,
    batch: u32,
    pause_per_busy: u32,
) -> Result<u64> {
    let mut total = 0;
    loop {
        let started = tokio::time::Instant::now();
        let deleted = store.sweep(now, batch).await?;
        total += deleted;
        if deleted < u64::from(batch) {
            return Ok(total);
        }
        if pause_per_busy > 0 {
            tokio::time::sleep(started.elapsed() * pause_per_busy).await;
        }
    }
}
