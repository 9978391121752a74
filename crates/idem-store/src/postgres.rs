//! [`PgStore`]: records in PostgreSQL, shared by many server instances.
//!
//! Every operation is one statement. The claim is an `INSERT … ON CONFLICT DO UPDATE … WHERE`
//! that inserts, replaces a record the claim may replace, or leaves the row alone, so claims
//! from any number of instances at once have exactly one winner.
//!
//! Time is PostgreSQL's (see [One clock](crate#one-clock-the-stores)): each statement that
//! judges or writes a time reads `clock_timestamp()` once, cut to whole milliseconds, as its
//! now ([`store_clock!`]); the caller's times arrive as Unix milliseconds (`bigint`) and only
//! their distances from the caller's now are used, added to that clock as intervals. A
//! statement that hands back a record also hands back its now (`store_now`), so the record's
//! times can be moved into the caller's frame. `(extract(epoch FROM t) * 1000)::bigint` reads
//! times back exactly, every stored time being whole milliseconds.
//!
//! In transaction mode (docs/contract.md §3) the claim runs inside the handler's transaction under
//! `lock_timeout`: a duplicate blocks on the unique index until the first transaction commits
//! (it then finds the completed record) or rolls back (it then claims the key), and gives up
//! with [`TxClaim::Busy`] when the wait runs out, so waiting duplicates cannot hold
//! connections for longer than their wait.
//!
//! A URL may name several hosts, as libpq allows (`postgres://u@a:5432,b:5433/db`, optionally
//! `?target_session_attrs=read-write`, the default then): the store uses the first that takes
//! writes, refuses any new connection to one that does not, and looks for the primary again
//! (in the background, one search at a time) when a statement finds the database out of reach
//! or read-only, so a failover to a promoted standby needs no restart (modules `url` and
//! `primary`).

mod migrate;
mod primary;
pub(crate) mod session;
mod url;

pub use migrate::{MigrationError, migrate_pg};
pub use primary::NoPrimary;
pub use url::PgUrlError;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    Decision, FencingToken, Record, RecordEvent, Scope, StoredResponse, Timestamp, decide,
};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Connection as _, PgExecutor, Postgres, Row};
use tokio::sync::watch;
use tokio::time::Instant;

use self::primary::Primary;
pub(crate) use self::session::{ANSWER_MARGIN, STATEMENT_TIMEOUT, Sessions};
use self::url::PgUrl;

use crate::sql::{self, bind_claim, bind_filter, bind_scope, row_scope};
use crate::{
    AdminStore, ClaimOutcome, EVENTS_KEPT, EVENTS_RETENTION_MS, Error, NewClaim, RecordFilter,
    Result, Store, TransactionalStore, TxClaim, in_caller_frame, is_unavailable, millis,
};

/// The transaction a handler writes through in transaction mode.
pub type PgTx = sqlx::Transaction<'static, Postgres>;

/// Records in PostgreSQL, in the table `idempotency_keys`.
///
/// Cloning is cheap: clones share one connection pool.
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    /// With several hosts (or `target_session_attrs=read-write`): which one takes writes.
    primary: Option<Arc<Primary>>,
    /// Whether the connections are sessions of their own or lent per transaction by a pooler.
    sessions: Sessions,
    /// Where outcome wake-ups listen (`LISTEN` needs a session of its own): the direct URL of
    /// [`PgStore::with_notify_url`], if one was given.
    notify: Option<Arc<PgConnectOptions>>,
}

/// How long [`PgStore::connect`]'s pool waits for a connection before the store reports itself
/// unavailable: a request should get its `503` well within a client's timeout.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// A pooled connection idle for this long is tested (a round trip) before it is handed out.
const RETEST_AFTER_IDLE: Duration = Duration::from_secs(1);

/// How many times a claim is retried when the record it lost to vanished (released or swept)
/// or became replaceable before it could be read. Each retry means the key changed in between,
/// so a few are plenty.
const CLAIM_ATTEMPTS: usize = 5;

/// SQLSTATE `lock_not_available`: a lock wait ran past `lock_timeout`.
const LOCK_NOT_AVAILABLE: &str = "55P03";

// The store's now: PostgreSQL's clock, cut to whole milliseconds (the unit callers' times come
// in), so that every stored time reads back exactly. `clock_timestamp()` is read anew at each
// mention, even within one statement, so a statement names it once and refers to that.
macro_rules! store_clock {
    () => {
        "date_trunc('milliseconds', clock_timestamp())"
    };
}
pub(crate) use store_clock;

// A caller's time `$t` as an interval from the caller's now `$now`: what a shared store keeps
// of it, to add to its own clock.
macro_rules! from_callers_now {
    ($t:literal, $now:literal) => {
        concat!("(", $t, " - ", $now, ") * interval '1 millisecond'")
    };
}

// Claims a key if no record holds it, or replaces a record the claim may replace (completed and
// past its retention; or, if allowed, a stale claim of the same request whose lease ran out;
// never an in-progress record for its age). One statement, so two claims can never both win.
// The claimed row is selected `$from` a row whose `now` is the store's clock: a subquery here,
// the CTE that bounds the wait in transaction mode. `excluded.created_at` is that now; the
// caller's lease and retention ($6 and $5, Unix milliseconds) count from it as far as they do
// from the caller's now ($4). With `new_only` it claims only a key no record holds, `ON
// CONFLICT DO NOTHING`, which neither writes nor locks a row it finds (TokioPgStore claims so
// first, and replaces a record with the full statement only when it found one it may
// replace). (A macro, so that `concat!` can wrap it.)
macro_rules! claim_sql {
    (new_only, $($from:tt)+) => {
        concat!(
            $crate::postgres::claim_sql!(@insert $($from)+),
            "
ON CONFLICT (account_id, idem_key) DO NOTHING
RETURNING fencing_token"
        )
    };
    (@insert $($from:tt)+) => {
        concat!(
            "
INSERT INTO idempotency_keys AS k
    (account_id, idem_key, request_hash, status, created_at, expires_at, lease_until, fencing_token)
SELECT $1, $2, $3, 'in_progress', clock.now,
       clock.now + ",
            $crate::postgres::from_callers_now!("$5", "$4"),
            ",
       clock.now + ",
            $crate::postgres::from_callers_now!("$6", "$4"),
            ",
       $7
",
            $($from)+,
        )
    };
    ($($from:tt)+) => {
        concat!(
            $crate::postgres::claim_sql!(@insert $($from)+),
            crate::sql::claim_replaces_with!(),
            "WHERE (k.status = 'completed' AND k.expires_at <= excluded.created_at)
   OR ($8 AND k.status = 'in_progress'
       AND k.lease_until <= excluded.created_at
       AND k.request_hash = excluded.request_hash)
RETURNING fencing_token"
        )
    };
}
pub(crate) use {claim_sql, from_callers_now};

const CLAIM: &str = claim_sql!(concat!(
    "FROM (SELECT ",
    store_clock!(),
    " AS now) AS clock"
));

// A record's columns, times as Unix milliseconds (in the store's frame: each statement that
// reads them adds its now, `store_now`). (A macro, so that TokioPgStore's claim can read them
// too.)
macro_rules! record_columns {
    () => {
        "request_hash, status, response_code, response_headers::text AS response_headers,
       response_body, body_omitted,
       (extract(epoch FROM created_at) * 1000)::bigint AS created_at,
       (extract(epoch FROM expires_at) * 1000)::bigint AS expires_at,
       (extract(epoch FROM lease_until) * 1000)::bigint AS lease_until,
       fencing_token"
    };
}
#[cfg(feature = "tokio-postgres")]
pub(crate) use record_columns;

// A time as Unix milliseconds, exact for the whole milliseconds the store keeps. (A macro, so
// that `concat!` can use it.)
macro_rules! epoch_ms {
    ($($t:tt)+) => {
        concat!("(extract(epoch FROM ", $($t)+, ") * 1000)::bigint")
    };
}
#[cfg(feature = "tokio-postgres")]
pub(crate) use epoch_ms;

pub(crate) const SELECT: &str = concat!(
    "\nSELECT ",
    record_columns!(),
    ",\n       ",
    epoch_ms!(store_clock!()),
    " AS store_now\nFROM idempotency_keys WHERE account_id = $1 AND idem_key = $2"
);

// Completes an in-progress record: the one the claim holding the token $3 holds, or, with $3
// NULL, whatever claim holds it (an operator's `force_complete`). One statement, so the token
// is matched by the write itself. `$expires_at` is the record's new expiry: with
// `resolving`, the store's now plus the record's retention (an outcome resolved long after
// its claim is kept as long as any); `in_tx`, as claimed (transaction mode, where nobody saw
// the record in progress). (A macro, so that TokioPgStore's guarded form can wrap it.)
macro_rules! complete_sql {
    (resolving) => {
        $crate::postgres::complete_sql!(@expiring
            $crate::postgres::store_clock!(), " + (expires_at - created_at)")
    };
    (in_tx) => {
        $crate::postgres::complete_sql!(@expiring "expires_at")
    };
    (@expiring $($expires_at:tt)+) => {
        concat!(
            "
UPDATE idempotency_keys
SET status = 'completed', response_code = $4, response_headers = $5::jsonb, response_body = $6,
    body_omitted = $7, expires_at = ",
            $($expires_at)+,
            "
WHERE account_id = $1 AND idem_key = $2 AND ($3::bigint IS NULL OR fencing_token = $3)
  AND status = 'in_progress'"
        )
    };
}
pub(crate) use complete_sql;

const COMPLETE: &str = complete_sql!(resolving);
const COMPLETE_IN_TX: &str = complete_sql!(in_tx);

// $4: the lease in milliseconds.
const RENEW: &str = concat!(
    "
UPDATE idempotency_keys
SET lease_until = ",
    store_clock!(),
    " + $4 * interval '1 millisecond'
WHERE account_id = $1 AND idem_key = $2 AND fencing_token = $3 AND status = 'in_progress'"
);

const RELEASE: &str = "
DELETE FROM idempotency_keys
WHERE account_id = $1 AND idem_key = $2 AND fencing_token = $3 AND status = 'in_progress'";

// SKIP LOCKED lets sweepers on several instances take disjoint batches instead of queueing
// behind each other (or behind a transaction that holds a row). The batch is deleted by the
// row versions it locked (`ctid`, which a lock held to the end of the statement keeps
// valid), a TID scan: joining it back through the primary key cost four times as much
// (EXPLAIN ANALYZE on 1,000 expired rows of 400,000: 6.5 ms against 1.6 ms), and that cost
// competes with claims for the database's CPU. Only completed records: an in-progress one
// holds an outcome nobody knows yet. The clock is read in a subquery, once: the index on
// `expires_at` can then serve the range, which it cannot for a volatile function compared
// row by row.
const SWEEP: &str = concat!(
    "
DELETE FROM idempotency_keys
WHERE ctid = ANY (ARRAY (
    SELECT ctid FROM idempotency_keys
    WHERE expires_at <= (SELECT ",
    store_clock!(),
    ")
      AND status = 'completed'
    LIMIT $1
    FOR UPDATE SKIP LOCKED))"
);

// The claim inside a transaction (transaction mode): CLAIM with its wait bounded by
// `lock_timeout` ($9), in one round trip instead of three (set, claim, restore). The
// MATERIALIZED CTEs read the setting in force, then set the bound, before the row to insert is
// produced, so before the insert can block on a concurrent claim's row (PostgreSQL reads
// `lock_timeout` when a wait starts). RETURNING puts the old setting back once the key is
// ours: the handler's own writes should not inherit the claim's (possibly nearly spent) wait.
// A claim that loses or times out ends in a rollback, which undoes the setting anyway. (Macros,
// so that TokioPgStore bounds its claims with the same text.)
macro_rules! bounded_claim {
    () => {
        concat!(
            $crate::postgres::bound_the_wait!(),
            $crate::postgres::claim_sql!("FROM bounded AS clock"),
            $crate::postgres::restore_the_wait!()
        )
    };
}

// The CTEs that read `lock_timeout` and set the claim's bound ($9), and read the store's
// clock once for the claim (`bounded.now`).
macro_rules! bound_the_wait {
    () => {
        concat!(
            "
WITH previous AS MATERIALIZED (SELECT current_setting('lock_timeout') AS lock_timeout),
     bounded AS MATERIALIZED (
         SELECT previous.lock_timeout, set_config('lock_timeout', $9, true),
                ",
            $crate::postgres::store_clock!(),
            " AS now
         FROM previous)"
        )
    };
}
pub(crate) use bound_the_wait;

// What the claim returns after its token: `lock_timeout` put back.
macro_rules! restore_the_wait {
    () => {
        ",
          (SELECT set_config('lock_timeout', bounded.lock_timeout, true) FROM bounded)"
    };
}
#[cfg(feature = "tokio-postgres")]
pub(crate) use bounded_claim;
pub(crate) use restore_the_wait;

const CLAIM_WITH_LOCK_TIMEOUT: &str = bounded_claim!();

impl PgStore {
    /// Connects to the database named by a URL such as `postgres://user@host/db` (a pool of
    /// up to 10 connections) and applies the migrations.
    ///
    /// A URL may name several hosts, in libpq's form: `postgres://user@a:5432,b:5433/db` or
    /// `postgres://user@/db?host=a,b&port=5432,5433`, with `target_session_attrs=read-write`
    /// (the default with several hosts; also accepted with one). The store then connects only
    /// to a host that takes writes, the first in the URL's order, waiting for one as long as
    /// for a connection; and when a statement finds that host out of reach or read-only, it
    /// looks for the primary again and moves its pool (and its outcome listeners) there.
    ///
    /// The URL may lead to a pooler that lends a session per transaction (PgBouncer in
    /// transaction mode): the store finds out when it connects and then leaves nothing on a
    /// session past a transaction (no named statement, no `SET`, no `LISTEN`; see
    /// [`with_notify_url`](Self::with_notify_url) for outcome wake-ups).
    ///
    /// Every statement has a deadline: PostgreSQL's `statement_timeout` and `lock_timeout`
    /// (5 s each, unless the URL's `options` set them; behind a pooler, the server's own
    /// settings apply outside the store's transactions), and the store waits a second longer
    /// for an answer before it reports itself [`Unavailable`](Error::Unavailable).
    ///
    /// # Errors
    ///
    /// - [`Error::Url`] when `url` cannot be used.
    /// - [`Error::Unavailable`] when no host (no host that takes writes, if read-write) can be
    ///   reached in time.
    /// - [`Error::Database`] when PostgreSQL refuses a statement.
    /// - [`Error::PgMigrate`] when the migrations fail.
    ///
    /// # Panics
    ///
    /// Never: a URL that is not read-write names exactly one host.
    pub async fn connect(url: &str) -> Result<Self> {
        let url: PgUrl = url.parse().map_err(Error::Url)?;
        if !url.read_write {
            // One host, any session: sqlx connects, and reconnects, as it always did.
            let [host] = <[_; 1]>::try_from(url.hosts).expect("one host unless read-write");
            let (options, sessions) = session::settle(host.options).await?;
            let pool = pool_options(None).connect_with(options).await?;
            return Self::on_pool(pool, None, sessions).await;
        }
        let mut primary = Primary::find(url.hosts, ACQUIRE_TIMEOUT)
            .await
            .map_err(|e| Error::Unavailable(Box::new(e)))?;
        let sessions = primary.settle().await?;
        let primary = Arc::new(primary);
        let pool = pool_options(Some(primary.clone()))
            .connect_with(primary.options())
            .await?;
        Self::on_pool(pool, Some(primary), sessions).await
    }

    /// A store on an existing pool (sized and configured by the caller); applies the
    /// migrations. Several instances may start at once: the migrations run one at a time.
    /// Whether the pool's connections lead to a pooler is found out as [`connect`](Self::connect)
    /// does; the pool's options are left as they are.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the database cannot be reached, [`Error::Database`] when it
    /// refuses a statement, and [`Error::PgMigrate`] when the migrations fail.
    pub async fn from_pool(pool: PgPool) -> Result<Self> {
        let (_, sessions) = session::settle((*pool.connect_options()).clone()).await?;
        Self::on_pool(pool, None, sessions).await
    }

    async fn on_pool(
        pool: PgPool,
        primary: Option<Arc<Primary>>,
        sessions: Sessions,
    ) -> Result<Self> {
        let store = Self {
            pool,
            primary,
            sessions,
            notify: None,
        };
        // Not bounded by the statement timeout: a migration may take long on a large table.
        store.watched(migrate(&store.pool).await)?;
        Ok(store)
    }

    /// The same store, listening for outcome wake-ups ([`OutcomeChannel`](crate::OutcomeChannel))
    /// through `url`, a URL of the same database that leads to a session of its own: behind a
    /// pooler that lends sessions per transaction, `LISTEN` cannot work through the store's own
    /// URL. Without one there, duplicates that wait for an outcome look at the store again
    /// every [`OUTCOME_POLL`](crate::OUTCOME_POLL) instead of being woken, and the store says
    /// so once in the log. Direct sessions listen through the store's own URL anyway.
    ///
    /// # Errors
    ///
    /// [`Error::Url`] when sqlx cannot read `url`. Nothing connects yet.
    pub fn with_notify_url(mut self, url: &str) -> Result<Self> {
        let options: PgConnectOptions = url
            .parse()
            .map_err(|e| Error::Url(PgUrlError::Options(e)))?;
        self.notify = Some(Arc::new(options));
        Ok(self)
    }

    /// Whether the store's connections reach PostgreSQL through a pooler that lends a session
    /// per transaction (found out when it connected). Statements of the caller's own on
    /// [`pool`](Self::pool) must then be unnamed: `sqlx::query(…).persistent(!store.behind_a_pooler())`.
    pub fn behind_a_pooler(&self) -> bool {
        self.sessions == Sessions::Pooled
    }

    /// Whether sqlx may prepare the store's statements under a name and cache them on their
    /// connection: only on sessions of their own.
    pub(crate) fn persistent(&self) -> bool {
        !self.behind_a_pooler()
    }

    /// Where outcome wake-ups can listen, if anywhere: the notify URL, else the pool's own
    /// sessions where they are direct.
    pub(crate) fn listen_options(&self) -> Option<Listen> {
        match (&self.notify, self.sessions) {
            (Some(options), _) => Some(Listen::Direct(options.clone())),
            (None, Sessions::Direct) => Some(Listen::Pool),
            (None, Sessions::Pooled) => None,
        }
    }

    /// `operation`, given up on (as [`Error::Unavailable`]) when no answer came within the
    /// statement timeout and its margin (the database or the path to it is silent).
    pub(crate) async fn bounded<T>(&self, operation: impl Future<Output = Result<T>>) -> Result<T> {
        bounded(STATEMENT_TIMEOUT + ANSWER_MARGIN, operation).await
    }

    /// The connection pool. Business writes outside an idempotent request go through it too.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Tells the store that a statement it did not run itself (on [`pool`](Self::pool)) failed
    /// with `e`. When `e` says the database is out of reach or read-only
    /// ([`is_unavailable`]) and the URL named several hosts, the store looks for the primary
    /// again; its own statements do this by themselves.
    pub fn notice(&self, e: &sqlx::Error) {
        if is_unavailable(e) {
            self.look_for_primary();
        }
    }

    /// `result`, after setting off a search for the primary if it says the database is
    /// unavailable.
    pub(crate) fn watched<T>(&self, result: Result<T, impl Into<Error>>) -> Result<T> {
        let result = result.map_err(Into::into);
        if let Err(Error::Unavailable(_)) = &result {
            self.look_for_primary();
        }
        result
    }

    pub(crate) fn look_for_primary(&self) {
        if let Some(primary) = &self.primary {
            primary.search(&self.pool);
        }
    }

    /// Tells of every move of the pool to another host; `None` for a URL with one host.
    pub(crate) fn primary_moves(&self) -> Option<watch::Receiver<usize>> {
        self.primary.as_ref().map(|primary| primary.moves())
    }

    /// [`TxClaim::Busy`] when the wait ran out while no connection was free, as the contract
    /// asks for a burst of duplicates; but when the pool had room and still produced no
    /// connection in time, the database is out of reach and the request must get `503`.
    fn wait_ran_out(&self) -> Result<TxClaim<PgTx>> {
        if self.pool.size() < self.pool.options().get_max_connections() {
            Err(Error::Unavailable(Box::new(sqlx::Error::PoolTimedOut)))
        } else {
            Ok(TxClaim::Busy)
        }
    }
}

/// The pool [`PgStore::connect`] makes. With `primary` (a URL with several hosts), a new
/// connection must take writes, and a pooled one opened before the pool last moved to another
/// host is closed instead of handed out.
fn pool_options(primary: Option<Arc<Primary>>) -> PgPoolOptions {
    let retiring = primary.clone();
    let options = PgPoolOptions::new()
        .max_connections(10)
        // sqlx tests every connection on its way back to the pool (a round trip off the
        // request's path) and, by default, again on its way out: a round trip on the path of
        // every statement or transaction. Only a connection that sat idle for a while can have
        // broken since its last test, so only that one is tested again.
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            let retiring = retiring.clone();
            Box::pin(async move {
                if retiring.is_some_and(|primary| primary.leads_elsewhere(meta.age)) {
                    return Ok(false);
                }
                if meta.idle_for >= RETEST_AFTER_IDLE {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .acquire_timeout(ACQUIRE_TIMEOUT);
    match primary {
        None => options,
        Some(primary) => options.after_connect(move |conn, _meta| {
            let primary = primary.clone();
            Box::pin(async move { primary.vet(conn).await })
        }),
    }
}

/// Applies the migrations ([`migrate_pg`]: in one transaction, instances starting together
/// taking turns).
async fn migrate(pool: &PgPool) -> Result<()> {
    let mut migrator = sqlx::migrate!("migrations/postgres");
    migrator.dangerous_set_table_name("idem_store_migrations");
    match migrate_pg(pool, &migrator).await {
        Ok(()) => Ok(()),
        // A lazy pool first meets the database here.
        Err(MigrationError::Database(e)) if is_unavailable(&e) => {
            Err(Error::Unavailable(Box::new(e)))
        }
        Err(e) => Err(Error::PgMigrate(e)),
    }
}

/// Runs `$body` with `$conn`, a `&mut PgConnection`, and yields its `Result<_, Error>`: a
/// pooled connection where the store's sessions are its own; behind a pooler, that connection
/// inside a transaction of its own, so that the server session stays the same from sqlx's
/// preparation of an unnamed statement to its execution (sqlx syncs between the two, and a
/// pooler may lend the session to another client there: the execution would then bind that
/// client's unnamed statement, or none). Behind a pooler each operation so costs `BEGIN` and
/// `COMMIT` and a preparation more: three round trips.
macro_rules! on_session {
    ($store:expr, |$conn:ident| $body:expr) => {
        async {
            if $store.persistent() {
                let mut pooled = $store.pool().acquire().await?;
                let $conn: &mut sqlx::PgConnection = &mut pooled;
                Ok::<_, $crate::Error>($body?)
            } else {
                let mut tx = $store.pool().begin().await?;
                let $conn: &mut sqlx::PgConnection = &mut tx;
                let out = $body?;
                tx.commit().await?;
                Ok(out)
            }
        }
    };
}
pub(crate) use on_session;

/// How [`PgStore::listen_options`] says outcome wake-ups may listen.
#[derive(Debug, Clone)]
pub(crate) enum Listen {
    /// On a connection of the store's own pool: its sessions are direct.
    Pool,
    /// On a connection of their own, made with these options (the notify URL).
    Direct(Arc<PgConnectOptions>),
}

/// The database, or the path to it, said nothing for as long as a live server takes to answer
/// or cancel a statement.
#[derive(Debug, thiserror::Error)]
#[error("PostgreSQL did not answer within {0:?}")]
pub(crate) struct NoAnswer(Duration);

/// `operation`, or [`Error::Unavailable`] with [`NoAnswer`] if it has not finished `within`.
pub(crate) async fn bounded<T>(
    within: Duration,
    operation: impl Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(within, operation).await {
        Ok(result) => result,
        Err(_elapsed) => Err(Error::Unavailable(Box::new(NoAnswer(within)))),
    }
}

fn is_lock_timeout(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == LOCK_NOT_AVAILABLE)
}

/// `lock_timeout` for a wait, rounded up to whole milliseconds and at least one: zero would
/// mean no limit at all.
pub(crate) fn lock_timeout_setting(wait: Duration) -> String {
    let ms = wait.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128);
    format!("{ms}ms")
}

/// Whether a claim may replace `record`, which it lost to: the core's decision, which the
/// claim's `WHERE` states in SQL (the statement, not this, has the last word). A record read
/// after its claim lost can have become replaceable since (its lease or retention ran out in
/// between): the claim is then made again rather than answered with a record the caller's
/// decision would claim.
pub(crate) fn may_replace(record: &Record, claim: &NewClaim) -> bool {
    match decide(Some(record), &claim.fingerprint, claim.now) {
        Decision::LeaseExpired { .. } => claim.take_over_expired_lease,
        decision => decision.allows_claim(),
    }
}

pub(crate) fn vanished(scope: &Scope) -> Error {
    Error::Raced(format!(
        "a claim of key {} kept losing to records that vanished before they could be read",
        scope.log_label()
    ))
}

/// Runs the claim statement, its waits bounded by `lock_wait` (a `lock_timeout` setting) if
/// given; `true` if the key is now ours. Returns the driver's error so the caller can tell a
/// lock timeout apart.
async fn claim_on<'e>(
    ex: impl PgExecutor<'e>,
    persistent: bool,
    claim: &NewClaim,
    lock_wait: Option<String>,
) -> Result<bool, sqlx::Error> {
    let statement = if lock_wait.is_some() {
        CLAIM_WITH_LOCK_TIMEOUT
    } else {
        CLAIM
    };
    let mut query = bind_claim(sqlx::query(statement).persistent(persistent), claim);
    if let Some(lock_wait) = lock_wait {
        query = query.bind(lock_wait);
    }
    let row = query.fetch_optional(ex).await?;
    Ok(row.is_some())
}

/// The record `scope` names, in the frame of the caller's `now`.
async fn get_on<'e>(
    ex: impl PgExecutor<'e>,
    persistent: bool,
    scope: &Scope,
    now: Timestamp,
) -> Result<Option<Record>> {
    let row = bind_scope(sqlx::query(SELECT).persistent(persistent), scope)
        .fetch_optional(ex)
        .await?;
    row.map(|row| record_from_row(scope, &row, now)).transpose()
}

/// Whether a completion resolves an outcome others could see in progress (its retention then
/// counts from now), or ends a transaction that nobody saw in progress.
#[derive(Debug, Clone, Copy)]
enum Completion {
    Resolving,
    InTransaction,
}

/// Runs [`COMPLETE`] (or [`COMPLETE_IN_TX`]); whether the in-progress record held by `token`
/// (any token if `None`) was completed.
async fn complete_on<'e>(
    ex: impl PgExecutor<'e>,
    persistent: bool,
    scope: &Scope,
    token: Option<FencingToken>,
    response: &StoredResponse,
    completion: Completion,
) -> Result<bool> {
    let headers = serde_json::to_string(&response.headers).expect("headers always serialise");
    let statement = match completion {
        Completion::Resolving => COMPLETE,
        Completion::InTransaction => COMPLETE_IN_TX,
    };
    let done = bind_scope(sqlx::query(statement).persistent(persistent), scope)
        .bind(token.map(|token| token.0))
        .bind(i32::from(response.status))
        .bind(headers)
        .bind(&response.body[..])
        .bind(response.body_omitted)
        .execute(ex)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// The record of a row read with its statement's `store_now`, in the frame of the caller's
/// `now`.
fn record_from_row(scope: &Scope, row: &PgRow, now: Timestamp) -> Result<Record> {
    // `int` in PostgreSQL.
    let record = sql::record_from_row(scope, row, |row| {
        Ok(row.try_get::<i32, _>("response_code")?.into())
    })?;
    let store_now: i64 = row.try_get("store_now")?;
    Ok(in_caller_frame(record, store_now, now))
}

impl Store for PgStore {
    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>> {
        let persistent = self.persistent();
        let found = on_session!(self, |conn| get_on(conn, persistent, scope, now).await);
        self.watched(self.bounded(found).await)
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome> {
        self.watched(self.bounded(self.claim_on_pool(claim)).await)
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
        _now: Timestamp,
    ) -> Result<bool> {
        let persistent = self.persistent();
        let completed = on_session!(self, |conn| {
            complete_on(
                conn,
                persistent,
                scope,
                Some(token),
                response,
                Completion::Resolving,
            )
            .await
        });
        self.watched(self.bounded(completed).await)
    }

    async fn renew(
        &self,
        scope: &Scope,
        token: FencingToken,
        lease: Duration,
        _now: Timestamp,
    ) -> Result<bool> {
        let renew = bind_scope(sqlx::query(RENEW).persistent(self.persistent()), scope)
            .bind(token.0)
            .bind(millis(lease));
        let done = on_session!(self, |conn| renew.execute(conn).await);
        Ok(self.watched(self.bounded(done).await)?.rows_affected() == 1)
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> Result<bool> {
        let release =
            bind_scope(sqlx::query(RELEASE).persistent(self.persistent()), scope).bind(token.0);
        let done = on_session!(self, |conn| release.execute(conn).await);
        Ok(self.watched(self.bounded(done).await)?.rows_affected() == 1)
    }

    async fn sweep(&self, _now: Timestamp, batch: u32) -> Result<u64> {
        let sweep = sqlx::query(SWEEP)
            .persistent(self.persistent())
            .bind(i64::from(batch));
        let done = on_session!(self, |conn| sweep.execute(conn).await);
        Ok(self.watched(self.bounded(done).await)?.rows_affected())
    }
}

impl PgStore {
    /// [`Store::claim`], unwatched.
    async fn claim_on_pool(&self, claim: &NewClaim) -> Result<ClaimOutcome> {
        let persistent = self.persistent();
        on_session!(self, |conn| {
            async {
                for _ in 0..CLAIM_ATTEMPTS {
                    if claim_on(&mut *conn, persistent, claim, None).await? {
                        return Ok(ClaimOutcome::Claimed);
                    }
                    // The claim lost to a record; read it in a new statement. It may have been
                    // released or swept in between, or become one the claim may replace (its
                    // lease or retention ran out since), and then the key is free to claim again.
                    match get_on(&mut *conn, persistent, &claim.scope, claim.now).await? {
                        Some(record) if !may_replace(&record, claim) => {
                            return Ok(ClaimOutcome::Existing(record));
                        }
                        _ => {}
                    }
                }
                Err(vanished(&claim.scope))
            }
            .await
        })
        .await
    }

    /// [`TransactionalStore::begin_claim`], unwatched.
    async fn begin_claim_on_pool(&self, claim: &NewClaim, wait: Duration) -> Result<TxClaim<PgTx>> {
        // One deadline for the whole wait: for a free connection, then for the key.
        let deadline = Instant::now() + wait;
        for _ in 0..CLAIM_ATTEMPTS {
            let begin = self.pool.begin_with(AssertSqlSafe(session::begin(wait)));
            let mut tx = match tokio::time::timeout_at(deadline, begin).await {
                Ok(tx) => tx?,
                Err(_elapsed) => return self.wait_ran_out(),
            };
            let lock_wait =
                lock_timeout_setting(deadline.saturating_duration_since(Instant::now()));
            // Blocks while another open transaction holds the key, for at most `lock_wait`.
            match claim_on(&mut *tx, self.persistent(), claim, Some(lock_wait)).await {
                Ok(true) => return Ok(TxClaim::Claimed(tx)),
                Ok(false) => {}
                Err(e) if is_lock_timeout(&e) => {
                    // The timeout aborted the transaction; end it so the connection goes back
                    // to the pool now.
                    tx.rollback().await?;
                    return Ok(TxClaim::Busy);
                }
                Err(e) => return Err(e.into()),
            }
            // The claim lost to a committed record (and holds its row lock until the rollback).
            // Under READ COMMITTED this new statement sees it; should it have vanished all the
            // same, the key is free and the claim starts over.
            let record = get_on(&mut *tx, self.persistent(), &claim.scope, claim.now).await?;
            tx.rollback().await?;
            match record {
                Some(record) if !may_replace(&record, claim) => {
                    return Ok(TxClaim::Existing(record));
                }
                _ => {}
            }
        }
        Err(vanished(&claim.scope))
    }
}

impl TransactionalStore for PgStore {
    type Tx = PgTx;

    async fn begin_claim(&self, claim: &NewClaim, wait: Duration) -> Result<TxClaim<PgTx>> {
        // The claim may wait `wait` for a concurrent transaction, on top of its own deadline.
        let claimed = bounded(
            wait + STATEMENT_TIMEOUT + ANSWER_MARGIN,
            self.begin_claim_on_pool(claim, wait),
        );
        self.watched(claimed.await)
    }

    async fn commit_response(
        &self,
        mut tx: PgTx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<()> {
        let completed = complete_on(
            &mut *tx,
            self.persistent(),
            scope,
            Some(token),
            response,
            Completion::InTransaction,
        );
        let completed = self.watched(self.bounded(completed).await)?;
        if !completed {
            return Err(Error::Raced(format!(
                "the key row of {} vanished inside its own transaction",
                scope.log_label()
            )));
        }
        self.watched(self.bounded(async { Ok(tx.commit().await?) }).await)
    }

    async fn rollback(&self, tx: PgTx) -> Result<()> {
        self.watched(self.bounded(async { Ok(tx.rollback().await?) }).await)
    }
}

impl AdminStore for PgStore {
    async fn list(&self, filter: &RecordFilter, now: Timestamp) -> Result<Vec<Record>> {
        // `lease_expired_by` ($3) is the caller's: as far from the store's now as from the
        // caller's ($5).
        let list = sqlx::query(concat!(
            "WITH clock AS MATERIALIZED (SELECT ",
            store_clock!(),
            " AS now)
             SELECT account_id, idem_key, ",
            record_columns!(),
            ", ",
            epoch_ms!("clock.now"),
            " AS store_now
             FROM idempotency_keys, clock
             WHERE ($1::text IS NULL OR account_id = $1)
               AND ($2::text IS NULL OR status = $2)
               AND ($3::bigint IS NULL OR (status = 'in_progress'
                    AND lease_until <= clock.now + ",
            from_callers_now!("$3", "$5"),
            "))
             ORDER BY created_at DESC
             LIMIT $4",
        ));
        let list = bind_filter(list.persistent(self.persistent()), filter).bind(now.0);
        let rows = on_session!(self, |conn| list.fetch_all(conn).await);
        let rows = self.watched(self.bounded(rows).await)?;
        rows.iter()
            .map(|row| record_from_row(&row_scope(row)?, row, now))
            .collect()
    }

    async fn purge(&self, scope: &Scope) -> Result<bool> {
        // The key's history goes with it, in the same statement; the count is the record's.
        let purge = sqlx::query(
            "WITH events AS (
                 DELETE FROM idem_record_events WHERE account_id = $1 AND idem_key = $2
             )
             DELETE FROM idempotency_keys WHERE account_id = $1 AND idem_key = $2",
        )
        .persistent(self.persistent());
        let purge = bind_scope(purge, scope);
        let done = on_session!(self, |conn| purge.execute(conn).await);
        Ok(self.watched(self.bounded(done).await)?.rows_affected() == 1)
    }

    async fn force_complete(
        &self,
        scope: &Scope,
        response: &StoredResponse,
        _now: Timestamp,
    ) -> Result<bool> {
        let persistent = self.persistent();
        let completed = on_session!(self, |conn| {
            complete_on(
                conn,
                persistent,
                scope,
                None,
                response,
                Completion::Resolving,
            )
            .await
        });
        self.watched(self.bounded(completed).await)
    }

    async fn record_event(&self, scope: &Scope, event: &RecordEvent) -> Result<()> {
        // One statement: every key's events past the retention (by this event's time) go, and
        // this key's oldest beyond the latest EVENTS_KEPT - 1, then the event is added.
        let record = sqlx::query(
            "WITH expired AS (
                 DELETE FROM idem_record_events WHERE at < $3 - $6::bigint
             ), trimmed AS (
                 DELETE FROM idem_record_events
                 WHERE account_id = $1 AND idem_key = $2 AND id <= (
                     SELECT id FROM idem_record_events
                     WHERE account_id = $1 AND idem_key = $2
                     ORDER BY id DESC OFFSET $7::bigint LIMIT 1)
             )
             INSERT INTO idem_record_events (account_id, idem_key, at, what, by_whom)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .persistent(self.persistent());
        let record = bind_scope(record, scope)
            .bind(event.at.0)
            .bind(event.what.as_str())
            .bind(event.by.as_str())
            .bind(EVENTS_RETENTION_MS)
            .bind(i64::try_from(EVENTS_KEPT - 1).unwrap_or(i64::MAX));
        let done = on_session!(self, |conn| record.execute(conn).await);
        self.watched(self.bounded(done).await)?;
        Ok(())
    }

    async fn events(&self, scope: &Scope) -> Result<Vec<RecordEvent>> {
        let events = sqlx::query(
            "SELECT at, what, by_whom FROM idem_record_events
             WHERE account_id = $1 AND idem_key = $2 ORDER BY id",
        )
        .persistent(self.persistent());
        let events = bind_scope(events, scope);
        let rows = on_session!(self, |conn| events.fetch_all(conn).await);
        let rows = self.watched(self.bounded(rows).await)?;
        rows.iter()
            .map(|row| {
                Ok(RecordEvent {
                    at: Timestamp(row.try_get("at")?),
                    what: row.try_get("what")?,
                    by: row.try_get("by_whom")?,
                })
            })
            .collect()
    }
}
