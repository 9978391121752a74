//! [`TokioPgStore`]: transaction mode on PostgreSQL through tokio-postgres, which pipelines
//! statements: several are sent before the first answer is read, so they cost one round trip
//! to the database together.
//!
//! Where the store's connections are sessions of their own, each statement is prepared once
//! per connection and cached; behind a pooler that lends sessions per transaction (PgBouncer
//! in transaction mode, found out when the store connects) every statement is unnamed instead
//! (tokio-postgres's `query_typed`: parse, bind and execute in one message, the parameter types
//! given), since a connection's next transaction may run on a session that never saw a
//! prepared one. The round trips are the same either way; what the pooler costs is PostgreSQL
//! parsing and planning every statement again. `BEGIN`, `COMMIT` and
//! `ROLLBACK` are simple queries either way.
//!
//! A first request costs three round trips: `BEGIN` with the claim; the handler's own
//! statements; the stored response with `COMMIT`. On [`PgStore`] (sqlx, which sends one
//! statement at a time and tests each connection it takes back) the same request costs eight,
//! counting the read before the claim and the pool's pings. With the database a millisecond
//! away each round trip is a millisecond a payment holds its connection; on loopback it is
//! CPU, PostgreSQL's and ours, spent on every wake-up.
//!
//! The claim is `INSERT … ON CONFLICT DO NOTHING`: a key no record holds is claimed, and a key
//! that is taken is neither written nor locked; the same statement then reads the record that
//! holds it, and the `ROLLBACK` goes out with the connection's next statements (or within
//! 100 ms, should the connection sit idle), its answer not awaited. So a replay costs one
//! round trip and no write, as a read before the claim would, and the layer claims first on
//! this store rather than reading before every claim. (A record whose transaction the claim
//! waited for is read by a second statement, since the first one's snapshot predates it.) A
//! record that the claim may replace (past its retention, or a stale lease of the same
//! request) is replaced by PgStore's full claim, `ON CONFLICT DO UPDATE … WHERE`, which stays
//! the arbiter.
//!
//! Everything off the request path (lease mode, the sweeper, `idem keys`, migrations, outcome
//! wake-ups) goes through a [`PgStore`] on the same URL, reached with
//! [`TokioPgStore::pg_store`]: one code path for each, already proven against failovers.
//! Handlers that write with sqlx keep using `PgStore` and its `PgTx`; this store is for those
//! on tokio-postgres, and for the shortest path a payment can take.

use std::ops::Deref;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool::managed::{Metrics, QueueMode, RecycleResult};
use deadpool_postgres::{ClientWrapper, Manager, ManagerConfig, RecyclingMethod, Runtime};
use futures_util::FutureExt as _;
use idem_core::{FencingToken, Record, RecordEvent, Scope, StoredResponse, Timestamp};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_postgres::NoTls;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::postgres::{
    ANSWER_MARGIN, SELECT, STATEMENT_TIMEOUT, bound_the_wait, bounded, bounded_claim, claim_sql,
    complete_sql, epoch_ms, lock_timeout_setting, may_replace, record_columns, restore_the_wait,
    session, vanished,
};
use crate::{
    AdminStore, ClaimOutcome, Error, NewClaim, PgStore, PgUrlError, RecordFilter, Result, Store,
    TransactionalStore, TxClaim,
};

/// The claim of a key no record holds, its wait bounded by `lock_timeout` ($9); when the key
/// is taken, the record that holds it, in the same statement, with the store's now the claim
/// read (`store_now`). The read sees what was committed when the statement began: a record
/// whose transaction the claim had to wait for is not among that, and then the statement
/// returns no row (a later read finds it). The key's row, absent or claimed, is read only when
/// the claim did not insert (a one-time filter).
const CLAIM_NEW_OR_READ: &str = concat!(
    bound_the_wait!(),
    ",
     claimed AS (",
    claim_sql!(new_only, "FROM bounded AS clock"),
    restore_the_wait!(),
    ")
SELECT true AS claimed, NULL::bytea AS request_hash, NULL::text AS status,
       NULL::int AS response_code, NULL::text AS response_headers, NULL::bytea AS response_body,
       NULL::bool AS body_omitted, NULL::bigint AS created_at, NULL::bigint AS expires_at,
       NULL::bigint AS lease_until, fencing_token, NULL::bigint AS store_now
FROM claimed
UNION ALL
SELECT false, ",
    record_columns!(),
    ", ",
    epoch_ms!("bounded.now"),
    "
FROM idempotency_keys, bounded
WHERE account_id = $1 AND idem_key = $2 AND NOT EXISTS (SELECT FROM claimed)"
);

/// The claim that may also replace a record, as [`PgStore`] claims in a transaction.
const CLAIM_REPLACING: &str = bounded_claim!();

/// The claims' parameters: scope, request hash, now, expiry, lease, token, take-over, wait.
const CLAIM_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::BYTEA,
    Type::INT8,
    Type::INT8,
    Type::INT8,
    Type::INT8,
    Type::BOOL,
    Type::TEXT,
];

/// The response stored in the transaction's own key row, failing (division by zero) when the
/// row is not the claim's any more. The `COMMIT` is sent with it, before its answer is read:
/// the failure aborts the transaction, so that `COMMIT` rolls back instead, and the handler's
/// writes never commit without their key's response.
const COMPLETE_IN_TX: &str = concat!(
    "WITH completed AS (",
    complete_sql!(in_tx),
    "\n  RETURNING 1)\nSELECT 1 / count(*)::int FROM completed"
);

const COMPLETE_TYPES: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::INT8,
    Type::INT4,
    Type::TEXT,
    Type::BYTEA,
    Type::BOOL,
];

const SCOPE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT];

const COMMIT: &str = "COMMIT";
const ROLLBACK: &str = "ROLLBACK";

/// How long the pool waits for a free connection, or for a new one to be made, before the
/// store reports itself unavailable: as long as [`PgStore`] waits.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// The pool's size unless [`TokioPgStore::with_pool_size`] says otherwise: sqlx's default, and
/// PgStore's.
pub const DEFAULT_POOL_SIZE: usize = 10;

/// How long a pooled connection may sit unused before it is closed, unless
/// [`TokioPgStore::with_idle_timeout`] says otherwise.
const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// Claims retried after the record a claim lost to vanished, or was replaced under it.
const CLAIM_ATTEMPTS: usize = 5;

/// Transaction mode on PostgreSQL through tokio-postgres (module docs): the claim pipelined
/// with `BEGIN`, the stored response with `COMMIT`.
///
/// Cloning is cheap: clones share one pool.
#[derive(Debug, Clone)]
pub struct TokioPgStore {
    /// Lease mode, administration, the sweeper, migrations, wake-ups.
    sql: PgStore,
    /// Transaction mode.
    pool: Pool,
    /// How long a pooled connection may sit unused before it is closed.
    idle_timeout: Arc<watch::Sender<Duration>>,
}

type Pool = deadpool::managed::Pool<Connections>;
type Object = deadpool::managed::Object<Connections>;

/// deadpool-postgres's connections, each also knowing whether it owes the server a `ROLLBACK`.
/// Written by hand around deadpool-postgres's manager because a lost claim's `ROLLBACK` is
/// cheapest sent with the next statements on its connection (PostgreSQL then reads both in
/// one go: about a quarter of a replay's work in the database, measured with pgbench), and
/// deadpool's own hooks cannot carry that from one use of a connection to the next.
#[derive(Debug)]
struct Connections(Manager);

/// A pooled connection.
#[derive(Debug)]
struct Connection {
    client: ClientWrapper,
    /// Its last transaction wrote nothing and has not been ended yet. Atomic because the task
    /// that settles idle connections sees them through a shared reference.
    rollback_owed: AtomicBool,
}

impl Connection {
    /// Sends the `ROLLBACK` this connection owes, if it owes one, without waiting for the
    /// answer: whatever is sent next on it queues behind, so it costs no round trip of its own.
    /// (tokio-postgres sends a request when its future is first polled, and reads and drops the
    /// answers of one whose future is gone. A closed connection answers at once, with an error
    /// the next statement meets too.)
    fn settle(&self) {
        if self.rollback_owed.swap(false, Ordering::Relaxed) {
            let _ = self.client.batch_execute(ROLLBACK).now_or_never();
        }
    }
}

impl deadpool::managed::Manager for Connections {
    type Type = Connection;
    type Error = tokio_postgres::Error;

    async fn create(&self) -> Result<Connection, tokio_postgres::Error> {
        Ok(Connection {
            client: self.0.create().await?,
            rollback_owed: AtomicBool::new(false),
        })
    }

    async fn recycle(
        &self,
        connection: &mut Connection,
        metrics: &Metrics,
    ) -> RecycleResult<tokio_postgres::Error> {
        self.0.recycle(&mut connection.client, metrics).await?;
        // Whoever takes the connection gets it outside any transaction.
        connection.settle();
        Ok(())
    }

    fn detach(&self, connection: &mut Connection) {
        self.0.detach(&mut connection.client);
    }
}

/// How long a connection that owes a `ROLLBACK` may sit in the pool before it is sent anyway:
/// an open transaction, even one that wrote nothing, holds its table locks (a migration's
/// `ALTER TABLE` would wait behind it) and shows as `idle in transaction`, which operators
/// watch and may have PostgreSQL end.
const SETTLE_EVERY: Duration = Duration::from_millis(100);

/// A pooled connection of a [`TokioPgStore`], outside any transaction, for statements of the
/// handler's own outside an idempotent request ([`TokioPgStore::client`]).
#[derive(Debug)]
pub struct TokioPgClient(Object);

impl Deref for TokioPgClient {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        &self.0.client
    }
}

/// The transaction a handler writes through on a [`TokioPgStore`]: a pooled tokio-postgres
/// client inside `BEGIN`. Futures of its statements polled together (with `tokio::join!`) are
/// pipelined: sent at once, answered in one round trip.
///
/// Write with [`execute_sql`](Self::execute_sql) and its siblings to work behind a pooler that
/// lends sessions per transaction as well as directly: a statement prepared under a name and
/// cached ([`ClientWrapper::prepare_cached`]) stays on the server session it was prepared on,
/// which the connection's next transaction may not get there.
///
/// The layer commits or rolls it back. Dropped without either (a panic in the handler), it
/// closes its connection instead of handing it back in the middle of a transaction, and
/// PostgreSQL rolls the transaction back.
#[derive(Debug)]
pub struct TokioPgTx {
    /// `None` only while dropping.
    client: Option<Object>,
    /// Whether `BEGIN` may have been sent and no end of the transaction has been.
    open: bool,
    /// Whether statements may be prepared under a name and cached on the connection: its
    /// sessions are its own (no pooler lends them per transaction).
    named: bool,
}

impl Deref for TokioPgTx {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        &self
            .client
            .as_ref()
            .expect("the client is there until the drop")
            .client
    }
}

impl Drop for TokioPgTx {
    fn drop(&mut self) {
        let Some(client) = self.client.take() else {
            return;
        };
        if self.open {
            tracing::warn!("a transaction was dropped while open; closing its connection");
            // Taken out of the pool, the client is dropped with its connection task.
            drop(Object::take(client));
        }
        // Otherwise the client goes back to the pool as it drops.
    }
}

impl TokioPgTx {
    /// Commits. For a transaction of the handler's own ([`TokioPgStore::begin`]); the layer
    /// commits the ones it opened.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the connection is lost (the outcome is then unknown), and
    /// [`Error::Postgres`] when PostgreSQL refuses the commit. The transaction is over either
    /// way.
    pub async fn commit(mut self) -> Result<()> {
        self.end_with(COMMIT).await
    }

    /// Rolls back.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the connection is lost, and [`Error::Postgres`] when
    /// PostgreSQL refuses the rollback. The transaction is over either way.
    pub async fn rollback(mut self) -> Result<()> {
        self.end_with(ROLLBACK).await
    }

    /// A pooled client, outside any transaction.
    fn new(client: Object, named: bool) -> Self {
        Self {
            client: Some(client),
            open: false,
            named,
        }
    }

    /// Runs `sql` with `params` (of `types`) and returns how many rows it changed. Prepared
    /// once per connection and cached where the store's sessions are its own; unnamed behind a
    /// pooler that lends sessions per transaction, where a prepared statement would not
    /// outlive the transaction. One round trip either way (and futures polled together are
    /// pipelined), besides the first preparation on a connection; a statement that waits for
    /// its preparation is sent after the others polled with it.
    ///
    /// # Errors
    ///
    /// PostgreSQL's error when the statement cannot be prepared or fails, or the connection
    /// is lost.
    pub async fn execute_sql(
        &self,
        sql: &str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        if self.named {
            let statement = self.prepare_typed_cached(sql, types).await?;
            self.execute(&statement, params).await
        } else {
            self.execute_typed(sql, &typed(params, types)).await
        }
    }

    /// Where statements are named, prepares `sql` on this connection unless it was before, so
    /// that the statement is sent the moment it is first polled: a pipeline whose order
    /// matters (a statement, then `COMMIT`) must not have one wait for its preparation.
    async fn prepare_if_named(
        &self,
        sql: &str,
        types: &[Type],
    ) -> Result<(), tokio_postgres::Error> {
        if self.named {
            self.prepare_typed_cached(sql, types).await?;
        }
        Ok(())
    }

    /// [`execute_sql`](Self::execute_sql) for a statement that returns one row.
    ///
    /// # Errors
    ///
    /// As for [`execute_sql`](Self::execute_sql), and an error when the statement returns no
    /// row or more than one.
    pub async fn query_one_sql(
        &self,
        sql: &str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<tokio_postgres::Row, tokio_postgres::Error> {
        if self.named {
            let statement = self.prepare_typed_cached(sql, types).await?;
            self.query_one(&statement, params).await
        } else {
            self.query_typed_one(sql, &typed(params, types)).await
        }
    }

    /// [`execute_sql`](Self::execute_sql) for a statement that returns at most one row.
    ///
    /// # Errors
    ///
    /// As for [`execute_sql`](Self::execute_sql), and an error when the statement returns more
    /// than one row.
    pub async fn query_opt_sql(
        &self,
        sql: &str,
        types: &[Type],
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<tokio_postgres::Row>, tokio_postgres::Error> {
        if self.named {
            let statement = self.prepare_typed_cached(sql, types).await?;
            self.query_opt(&statement, params).await
        } else {
            self.query_typed_opt(sql, &typed(params, types)).await
        }
    }

    /// Ends the transaction with `COMMIT` or `ROLLBACK`.
    async fn end_with(&mut self, sql: &str) -> Result<()> {
        let ended = self.batch_execute(sql).await;
        self.end();
        ended?;
        Ok(())
    }

    /// The transaction is over, by its end or by a failure of that end (which ends it too, or
    /// breaks the connection, which the pool finds out by itself): the client may go back to
    /// the pool.
    fn end(&mut self) {
        self.open = false;
    }

    /// `BEGIN` and `claim_sql` in one round trip; the row the claim returned, if any. The
    /// claim waits up to `wait` for a concurrent claim's transaction.
    async fn begin_and_claim(
        &mut self,
        claim_sql: &str,
        claim: &NewClaim,
        wait: Duration,
    ) -> Result<Option<tokio_postgres::Row>, tokio_postgres::Error> {
        // An earlier attempt's ROLLBACK goes out ahead of this BEGIN.
        if let Some(connection) = self.client.as_ref() {
            connection.settle();
        }
        let begin = session::begin(wait);
        let lock_wait = lock_timeout_setting(wait);
        self.prepare_if_named(claim_sql, CLAIM_TYPES).await?;
        let (account, key) = (claim.scope.account.as_str(), claim.scope.key.as_str());
        let fingerprint = &claim.fingerprint.as_bytes()[..];
        self.open = true;
        let params: [&(dyn ToSql + Sync); 9] = [
            &account,
            &key,
            &fingerprint,
            &claim.now.0,
            &claim.expires_at.0,
            &claim.lease_until.0,
            &claim.token.0,
            &claim.take_over_expired_lease,
            &lock_wait,
        ];
        let (begun, claimed) = tokio::join!(
            self.batch_execute(&begin),
            self.query_opt_sql(claim_sql, CLAIM_TYPES, &params)
        );
        // Should BEGIN alone have failed on a live connection, the claim ran outside a
        // transaction and committed a claim with a lease, which runs out as a crashed lease
        // does; the error goes back and the connection with it.
        begun?;
        claimed
    }

    /// Ends the transaction with the next statements sent on its connection, whoever sends
    /// them, or within [`SETTLE_EVERY`] if nobody does (see [`Connection::settle`]): a lost
    /// claim wrote nothing, so nothing can fail to roll back, and its `ROLLBACK` costs no
    /// round trip of its own.
    fn roll_back_in_passing(&mut self) {
        if let Some(connection) = self.client.as_ref() {
            connection.rollback_owed.store(true, Ordering::Relaxed);
        }
        self.end();
    }

    /// The record `scope` names, read in the transaction, which ends with it: one round trip.
    /// Its times in the frame of the caller's `now`.
    async fn read_and_roll_back(
        &mut self,
        scope: &Scope,
        now: Timestamp,
    ) -> Result<Option<Record>> {
        self.prepare_if_named(SELECT, SCOPE_TYPES).await?;
        let (account, key) = (scope.account.as_str(), scope.key.as_str());
        let params: [&(dyn ToSql + Sync); 2] = [&account, &key];
        let (row, rolled_back) = tokio::join!(
            self.query_opt_sql(SELECT, SCOPE_TYPES, &params),
            self.batch_execute(ROLLBACK)
        );
        self.end();
        rolled_back?;
        row?.map(|row| crate::sql::record_from_client_row(scope, &row, now))
            .transpose()
    }

    /// The response stored in the key row and `COMMIT`, in one round trip.
    async fn complete_and_commit(
        mut self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<()> {
        // Prepared first: the COMMIT must follow the response, not overtake it.
        self.prepare_if_named(COMPLETE_IN_TX, COMPLETE_TYPES)
            .await?;
        let headers = serde_json::to_string(&response.headers).expect("headers always serialise");
        let (account, key) = (scope.account.as_str(), scope.key.as_str());
        let (token, status) = (Some(token.0), i32::from(response.status));
        let body = &response.body[..];
        let params: [&(dyn ToSql + Sync); 7] = [
            &account,
            &key,
            &token,
            &status,
            &headers,
            &body,
            &response.body_omitted,
        ];
        let (completed, committed) = tokio::join!(
            self.query_one_sql(COMPLETE_IN_TX, COMPLETE_TYPES, &params),
            self.batch_execute(COMMIT)
        );
        // Whatever the answers, the transaction is over: committed, or rolled back by a
        // failure (the COMMIT of an aborted transaction rolls it back).
        self.end();
        match completed {
            Err(e) if e.code() == Some(&SqlState::DIVISION_BY_ZERO) => {
                return Err(Error::Raced(format!(
                    "the key row of {} vanished inside its own transaction; nothing was committed",
                    scope.log_label()
                )));
            }
            Err(e) => return Err(e.into()),
            Ok(_) => {}
        }
        committed?;
        Ok(())
    }
}

impl TokioPgStore {
    /// Connects to the database named by `url` (one host or several, as [`PgStore::connect`]
    /// takes them: tokio-postgres reads libpq's host lists and `target_session_attrs` itself)
    /// with a pool of [`DEFAULT_POOL_SIZE`] connections, and applies the migrations.
    ///
    /// With several hosts, a new connection goes to the first that takes writes; connections
    /// to a host that is lost close, and the pool replaces them, so after a failover the
    /// store is on the promoted standby without a restart.
    ///
    /// # Errors
    ///
    /// The errors of [`PgStore::connect`], and [`Error::Url`] when tokio-postgres cannot read
    /// `url`.
    ///
    /// # Panics
    ///
    /// Never: the pool is built with a runtime, which is all its timeouts need.
    pub async fn connect(url: &str) -> Result<Self> {
        let sql = PgStore::connect(url).await?;
        let mut config =
            tokio_postgres::Config::from_str(url).map_err(|e| Error::Url(PgUrlError::Client(e)))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(ACQUIRE_TIMEOUT);
        }
        if !sql.behind_a_pooler() {
            // Sessions of their own: the statement and lock timeouts ride in the startup packet.
            let options = session::options_text(config.get_options());
            config.options(&options);
        }
        if config.get_hosts().len() > 1 {
            // As PgStore reads such a URL: several hosts mean the one that takes writes.
            config.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
        }
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                // A pooled connection is handed out again without a round trip: one that broke
                // shows as closed, and a statement on one that broke since fails as unavailable.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(Connections(manager))
            .max_size(DEFAULT_POOL_SIZE)
            // The connection used last is used next: its deferred ROLLBACK rides with the next
            // request's statements, and connections a burst opened fall idle and are closed.
            .queue_mode(QueueMode::Lifo)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(ACQUIRE_TIMEOUT))
            .create_timeout(Some(ACQUIRE_TIMEOUT))
            .recycle_timeout(Some(ACQUIRE_TIMEOUT))
            .build()
            .expect("a runtime is given, so timeouts can be");
        let store = Self {
            sql,
            pool,
            idle_timeout: Arc::new(watch::Sender::new(DEFAULT_IDLE_TIMEOUT)),
        };
        store.tend_idle_connections();
        Ok(store)
    }

    /// The same store with a pool of at most `size` connections for transactions. With the
    /// database on another host each request holds its connection for its three round trips,
    /// so the pool bounds throughput at `size / (3 × round trip)`.
    pub fn with_pool_size(self, size: usize) -> Self {
        self.pool.resize(size.max(1));
        self
    }

    /// The same store, listening for outcome wake-ups through `url`, a URL of the same database
    /// that reaches PostgreSQL directly ([`PgStore::with_notify_url`]).
    ///
    /// # Errors
    ///
    /// [`Error::Url`] when sqlx cannot read `url`.
    pub fn with_notify_url(mut self, url: &str) -> Result<Self> {
        self.sql = self.sql.with_notify_url(url)?;
        Ok(self)
    }

    /// The same store, closing pooled connections that sat unused for `timeout` (ten minutes
    /// unless set, as sqlx closes its own), so that a burst's connections do not stay open on
    /// the server for good. Looked for every tenth of the timeout.
    pub fn with_idle_timeout(self, timeout: Duration) -> Self {
        self.idle_timeout
            .send_replace(timeout.max(Duration::from_millis(1)));
        self
    }

    /// Starts the task that settles the `ROLLBACK`s idle connections owe and closes the
    /// connections idle for longer than the idle timeout; it ends with the pool.
    fn tend_idle_connections(&self) {
        let (pool, mut timeout) = (self.pool.weak(), self.idle_timeout.subscribe());
        tokio::spawn(async move {
            let mut next_close = Instant::now();
            loop {
                let idle = *timeout.borrow_and_update();
                tokio::select! {
                    _ = tokio::time::sleep(SETTLE_EVERY.min(idle / 10)) => {}
                    // A new timeout: look with it at once.
                    changed = timeout.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        next_close = Instant::now();
                    }
                }
                let Some(pool) = pool.upgrade() else {
                    return;
                };
                let idle = *timeout.borrow();
                let close = Instant::now() >= next_close;
                if close {
                    next_close = Instant::now() + idle / 10;
                }
                pool.retain(|connection, metrics| {
                    connection.settle();
                    !close || metrics.last_used() < idle
                });
            }
        });
    }

    /// A pooled connection, outside any transaction: for statements of the caller's own
    /// outside an idempotent request.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when no connection is free or can be made in time, and
    /// [`Error::Postgres`] when PostgreSQL refuses a new connection's setup.
    pub async fn client(&self) -> Result<TokioPgClient> {
        Ok(TokioPgClient(self.watched(self.pool.get().await)?))
    }

    /// The sqlx store on the same database: lease mode, the sweeper, administration and
    /// outcome wake-ups run on it, and so may anything of the handler's written with sqlx
    /// outside an idempotent request.
    pub fn pg_store(&self) -> &PgStore {
        &self.sql
    }

    /// Opens a transaction of the caller's own (for a request without a key).
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when no connection is free in time, the connection is lost or
    /// `BEGIN` passes its deadline, and [`Error::Postgres`] when PostgreSQL refuses it.
    pub async fn begin(&self) -> Result<TokioPgTx> {
        let begun = bounded(STATEMENT_TIMEOUT + ANSWER_MARGIN, async {
            let mut tx = TokioPgTx::new(self.pool.get().await?, self.named());
            tx.open = true;
            tx.batch_execute(&session::begin(Duration::ZERO)).await?;
            Ok(tx)
        });
        self.watched(begun.await)
    }

    /// Whether statements may be prepared under a name and cached on their connection.
    fn named(&self) -> bool {
        !self.sql.behind_a_pooler()
    }

    /// Tells the store that a statement it did not run itself failed with `e`, so that a lost
    /// primary is looked for again (as [`PgStore::notice`]).
    pub fn notice(&self, e: &Error) {
        if let Error::Unavailable(_) = e {
            self.sql.look_for_primary();
        }
    }

    /// `result`, after [`notice`](Self::notice) of its error.
    fn watched<T>(&self, result: Result<T, impl Into<Error>>) -> Result<T> {
        result.map_err(Into::into).inspect_err(|e| self.notice(e))
    }

    /// [`TransactionalStore::begin_claim`], unwatched.
    async fn begin_claim_on_pool(
        &self,
        claim: &NewClaim,
        wait: Duration,
    ) -> Result<TxClaim<TokioPgTx>> {
        // One deadline for the whole wait: for a free connection, then for the key.
        let deadline = Instant::now() + wait;
        let client = match tokio::time::timeout_at(deadline, self.pool.get()).await {
            Ok(client) => client?,
            Err(_elapsed) => return self.wait_ran_out(),
        };
        let mut tx = TokioPgTx::new(client, self.named());
        // First the claim that writes only a key no record holds; the full claim, which may
        // replace a record, only for a record it may replace.
        let mut replacing = false;
        for _ in 0..CLAIM_ATTEMPTS {
            let wait = deadline.saturating_duration_since(Instant::now());
            let claim_sql = if replacing {
                CLAIM_REPLACING
            } else {
                CLAIM_NEW_OR_READ
            };
            // Blocks while another open transaction holds the key, for at most `lock_wait`.
            let found = match tx.begin_and_claim(claim_sql, claim, wait).await {
                Ok(Some(row)) if replacing || row.try_get::<_, bool>("claimed")? => {
                    return Ok(TxClaim::Claimed(tx));
                }
                Ok(Some(row)) => Some(crate::sql::record_from_client_row(
                    &claim.scope,
                    &row,
                    claim.now,
                )?),
                Ok(None) => None,
                Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                    tx.rollback().await?;
                    return Ok(TxClaim::Busy);
                }
                Err(e) => return Err(e.into()),
            };
            let record = match found {
                // The claim wrote nothing: the transaction can end in passing.
                Some(record) => {
                    tx.roll_back_in_passing();
                    Some(record)
                }
                // The claim waited for the transaction that wrote the record (or lost to the
                // full claim), so its statement could not see it: a new one does.
                None => tx.read_and_roll_back(&claim.scope, claim.now).await?,
            };
            match record {
                // Released or swept since the claim saw it: the key is free again.
                None => replacing = false,
                // Replaceable (also when it became so after the full claim lost to it: its
                // lease or retention ran out in between).
                Some(record) if may_replace(&record, claim) => replacing = true,
                Some(record) => return Ok(TxClaim::Existing(record)),
            }
        }
        Err(vanished(&claim.scope))
    }

    /// [`TxClaim::Busy`] when the wait ran out while every connection was taken, as the
    /// contract asks for a burst of duplicates; but when the pool had room and still produced
    /// no connection in time, the database is out of reach and the request must get `503`.
    fn wait_ran_out(&self) -> Result<TxClaim<TokioPgTx>> {
        let status = self.pool.status();
        if status.size < status.max_size {
            Err(Error::Unavailable(
                "no connection to PostgreSQL could be made within the wait".into(),
            ))
        } else {
            Ok(TxClaim::Busy)
        }
    }
}

/// `params` paired with their `types`, as tokio-postgres's unnamed statements
/// (`query_typed`) take them.
fn typed<'a>(
    params: &[&'a (dyn ToSql + Sync)],
    types: &[Type],
) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    debug_assert_eq!(params.len(), types.len());
    params.iter().copied().zip(types.iter().cloned()).collect()
}

impl Store for TokioPgStore {
    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>> {
        self.sql.get(scope, now).await
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome> {
        self.sql.claim(claim).await
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool> {
        self.sql.complete(scope, token, response, now).await
    }

    async fn renew(
        &self,
        scope: &Scope,
        token: FencingToken,
        lease: Duration,
        now: Timestamp,
    ) -> Result<bool> {
        self.sql.renew(scope, token, lease, now).await
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> Result<bool> {
        self.sql.release(scope, token).await
    }

    async fn sweep(&self, now: Timestamp, batch: u32) -> Result<u64> {
        self.sql.sweep(now, batch).await
    }
}

impl TransactionalStore for TokioPgStore {
    type Tx = TokioPgTx;

    /// Claims first: a lost claim writes nothing and answers with the record in its one round
    /// trip, as a read would.
    fn begin_claim_answers_like_a_read(&self) -> bool {
        true
    }

    async fn begin_claim(&self, claim: &NewClaim, wait: Duration) -> Result<TxClaim<TokioPgTx>> {
        // The claim may wait `wait` for a concurrent transaction, on top of its own deadline. A
        // transaction given up on closes its connection as it drops (TokioPgTx's Drop).
        let claimed = bounded(
            wait + STATEMENT_TIMEOUT + ANSWER_MARGIN,
            self.begin_claim_on_pool(claim, wait),
        );
        self.watched(claimed.await)
    }

    async fn commit_response(
        &self,
        tx: TokioPgTx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<()> {
        let committed = bounded(
            STATEMENT_TIMEOUT + ANSWER_MARGIN,
            tx.complete_and_commit(scope, token, response),
        );
        self.watched(committed.await)
    }

    async fn rollback(&self, tx: TokioPgTx) -> Result<()> {
        let rolled_back = bounded(STATEMENT_TIMEOUT + ANSWER_MARGIN, tx.rollback());
        self.watched(rolled_back.await)
    }
}

impl AdminStore for TokioPgStore {
    async fn list(&self, filter: &RecordFilter, now: Timestamp) -> Result<Vec<Record>> {
        self.sql.list(filter, now).await
    }

    async fn purge(&self, scope: &Scope) -> Result<bool> {
        self.sql.purge(scope).await
    }

    async fn force_complete(
        &self,
        scope: &Scope,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool> {
        self.sql.force_complete(scope, response, now).await
    }

    async fn record_event(&self, scope: &Scope, event: &RecordEvent) -> Result<()> {
        self.sql.record_event(scope, event).await
    }

    async fn events(&self, scope: &Scope) -> Result<Vec<RecordEvent>> {
        self.sql.events(scope).await
    }
}
