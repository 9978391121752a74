//! [`SqliteStore`]: the embedded default.
//!
//! SQLite allows one writer at a time, so the store keeps exactly one writer connection (a
//! pool of one) and a pool of readers (WAL lets them read while the writer writes). Requests'
//! writes (claims, outcomes, leases, handlers' transactions) take turns at the writer through
//! a group committer ([`group_commit`]), which commits the writes of every request waiting at
//! once: one `fsync` for many requests, each answered only after its writes are durable;
//! sweeps and admin writes take the pool between groups. Writers queue, fairly, instead of
//! spinning on `SQLITE_BUSY`; `busy_timeout` still covers another process opening the same
//! file.
//!
//! Its clock is its callers': an SQLite file is used by one machine, so the `now` each
//! operation is given is the store's now (see [One clock](crate#one-clock-the-stores)).

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use idem_core::{FencingToken, Record, RecordEvent, Scope, StoredResponse, Timestamp};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
};
use sqlx::{Row, SqliteConnection};

use crate::sql::{self, bind_claim, bind_filter, bind_scope, row_scope};
use crate::{
    AdminStore, ClaimOutcome, EVENTS_KEPT, EVENTS_RETENTION_MS, Error, NewClaim, RecordFilter,
    Result, Store, TransactionalStore, TxClaim,
};

mod group_commit;

use group_commit::GroupCommitter;
pub use group_commit::{GroupCommitFailed, SqliteTx};

/// Records in an SQLite file.
///
/// Writes take turns at SQLite's single writer and commit in groups: the requests waiting for
/// the writer share one transaction (in transaction mode each in a savepoint of its own) and
/// one commit, and each hears of its commit only once it is durable.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    writer: SqlitePool,
    readers: SqlitePool,
    committer: GroupCommitter,
}

// Claims a key if no record holds it, or replaces a record the claim may replace (completed and
// past its retention; or, if allowed, a stale claim of the same request; never an in-progress
// record for its age). One statement, so two claims can never both win. (A macro, so that
// `concat!` can prefix it.)
macro_rules! claim_sql {
    () => {
        concat!(
            "
INSERT INTO idempotency_keys
    (account_id, idem_key, request_hash, status, created_at, expires_at, lease_until, fencing_token)
VALUES (?1, ?2, ?3, 'in_progress', ?4, ?5, ?6, ?7)",
            crate::sql::claim_replaces_with!(),
            "WHERE (idempotency_keys.status = 'completed' AND idempotency_keys.expires_at <= ?4)
   OR (?8 AND idempotency_keys.status = 'in_progress'
       AND idempotency_keys.lease_until <= ?4
       AND idempotency_keys.request_hash = ?3)
RETURNING fencing_token"
        )
    };
}
const CLAIM: &str = claim_sql!();
/// [`CLAIM`], opening the request's savepoint (`group_commit::SAVEPOINT`) in the same round
/// trip.
const SAVEPOINT_AND_CLAIM: &str = concat!("SAVEPOINT idem_request;", claim_sql!());

const SELECT: &str = "
SELECT request_hash, status, response_code, response_headers, response_body, body_omitted,
       created_at, expires_at, lease_until, fencing_token
FROM idempotency_keys WHERE account_id = ?1 AND idem_key = ?2";

// Completes an in-progress record: the one the claim holding the token ?3 holds, or, with ?3
// NULL, whatever claim holds it (an operator's `force_complete`). One statement, so the token
// is matched by the write itself. At ?8, the completion's time, the retention starts again
// (an outcome resolved long after its claim is kept as long as any); NULL in transaction mode,
// where claim and completion are one transaction's and nobody saw the record in progress.
macro_rules! complete_sql {
    () => {
        "
UPDATE idempotency_keys
SET status = 'completed', response_code = ?4, response_headers = ?5, response_body = ?6,
    body_omitted = ?7, expires_at = COALESCE(?8 + (expires_at - created_at), expires_at)
WHERE account_id = ?1 AND idem_key = ?2 AND (?3 IS NULL OR fencing_token = ?3)
  AND status = 'in_progress'
RETURNING 1;"
    };
}
const COMPLETE: &str = complete_sql!();
/// [`COMPLETE`], then the end of the request's savepoint (`group_commit::RELEASE`), in one
/// round trip.
const COMPLETE_AND_RELEASE: &str = concat!(complete_sql!(), "RELEASE idem_request;");

impl SqliteStore {
    /// Opens (creating if needed) the database file at `path` and applies the migrations.
    ///
    /// # Errors
    ///
    /// [`Error::Database`] (or [`Error::Unavailable`], for an I/O error) when the file cannot
    /// be opened or created or SQLite refuses a statement, and [`Error::Migrate`] when the
    /// migrations fail.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::with_options(SqliteConnectOptions::new().filename(path)).await
    }

    /// Opens a database named by a URL such as `sqlite://idem.db` or `sqlite:///var/lib/idem.db`.
    ///
    /// # Errors
    ///
    /// [`Error::Database`] when `url` cannot be parsed, and otherwise the errors of
    /// [`open`](Self::open).
    pub async fn connect(url: &str) -> Result<Self> {
        Self::with_options(SqliteConnectOptions::from_str(url).map_err(Error::Database)?).await
    }

    async fn with_options(options: SqliteConnectOptions) -> Result<Self> {
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(5))
            .foreign_keys(true);
        // No test of a connection on its way out of a pool: an SQLite connection is a file
        // handle in this process, not a socket that can break while idle, and sqlx's test is a
        // round trip to the connection's worker thread; for the writer, one more step of the
        // single writer's hold on every transaction. (sqlx still tests it on its way back.)
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            // Waits are bounded by the callers (`begin_claim`'s wait); this is the backstop.
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options.clone())
            .await?;
        let mut migrator = sqlx::migrate!("migrations/sqlite");
        migrator.dangerous_set_table_name("idem_store_migrations");
        migrator.run(&writer).await.map_err(Error::Migrate)?;
        let readers = SqlitePoolOptions::new()
            .max_connections(4)
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        let committer =
            GroupCommitter::spawn(writer.clone()).map_err(|e| Error::Unavailable(Box::new(e)))?;
        Ok(Self {
            writer,
            readers,
            committer,
        })
    }

    /// The single writer connection's pool, for writes that take it outside the group
    /// committer (migrations, background jobs). Hold it briefly: the group committer waits
    /// for it.
    pub fn writer(&self) -> &SqlitePool {
        &self.writer
    }

    /// A turn at the writer for business writes outside an idempotent request: they run in a
    /// savepoint of the group committer's current transaction and commit with it
    /// ([`SqliteTx::commit`]).
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the group committer has stopped or the writer cannot be
    /// reached, and [`Error::Database`] when SQLite refuses to open the savepoint.
    pub async fn begin(&self) -> Result<SqliteTx> {
        let mut tx = self.committer.turn().await?;
        tx.savepoint = true;
        if let Err(e) = sqlx::query(group_commit::SAVEPOINT).execute(&mut *tx).await {
            tx.fail();
            return Err(e.into());
        }
        Ok(tx)
    }

    /// The readers' pool.
    pub fn readers(&self) -> &SqlitePool {
        &self.readers
    }

    /// Runs `sql` ([`CLAIM`], maybe with a prefix) for `claim`; whether the claim won.
    async fn claim_on(
        conn: &mut SqliteConnection,
        sql: &'static str,
        claim: &NewClaim,
    ) -> Result<bool, sqlx::Error> {
        let rows = bind_claim(sqlx::query(sql), claim)
            .fetch_all(&mut *conn)
            .await?;
        Ok(!rows.is_empty())
    }

    async fn get_on(conn: &mut SqliteConnection, scope: &Scope) -> Result<Option<Record>> {
        let row = bind_scope(sqlx::query(SELECT), scope)
            .fetch_optional(&mut *conn)
            .await?;
        row.map(|row| record_from_row(scope, &row)).transpose()
    }

    /// Claims in a turn of the group committer, without a savepoint (one statement is
    /// atomic); a lost claim reads the record that holds the key, on the same connection.
    async fn claim_in_turn(tx: &mut SqliteTx, claim: &NewClaim) -> Result<ClaimOutcome> {
        if Self::claim_on(tx, CLAIM, claim).await? {
            return Ok(ClaimOutcome::Claimed);
        }
        // With one writer nothing can change the record in between.
        match Self::get_on(tx, &claim.scope).await? {
            Some(record) => Ok(ClaimOutcome::Existing(record)),
            None => Err(lost_to_nothing(&claim.scope)),
        }
    }

    /// Runs `write` in a turn of the group committer and returns its result once the group
    /// has committed (a failed write ends the group at once, without it).
    async fn in_turn<T>(&self, write: impl AsyncFnOnce(&mut SqliteTx) -> Result<T>) -> Result<T> {
        let mut tx = self.committer.turn().await?;
        match write(&mut tx).await {
            Ok(value) => {
                tx.commit_with_group().await?;
                Ok(value)
            }
            Err(e) => {
                tx.fail();
                Err(e)
            }
        }
    }
}

fn lost_to_nothing(scope: &Scope) -> Error {
    Error::Raced(format!(
        "a claim of key {} conflicted with a record that does not exist",
        scope.log_label()
    ))
}

fn record_from_row(scope: &Scope, row: &SqliteRow) -> Result<Record> {
    sql::record_from_row(scope, row, |row| row.try_get("response_code"))
}

/// Runs `sql` ([`COMPLETE`], maybe with a suffix); whether the in-progress record held by
/// `token` (any token if `None`) was completed. Its retention counts from `now` if given.
async fn complete_on(
    conn: &mut SqliteConnection,
    sql: &'static str,
    scope: &Scope,
    token: Option<FencingToken>,
    response: &StoredResponse,
    now: Option<Timestamp>,
) -> Result<bool, sqlx::Error> {
    let headers = serde_json::to_string(&response.headers).expect("headers always serialise");
    let rows = bind_scope(sqlx::query(sql), scope)
        .bind(token.map(|token| token.0))
        .bind(i64::from(response.status))
        .bind(headers)
        .bind(&response.body[..])
        .bind(response.body_omitted)
        .bind(now.map(|now| now.0))
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows.len() == 1)
}

impl Store for SqliteStore {
    async fn get(&self, scope: &Scope, _now: Timestamp) -> Result<Option<Record>> {
        let mut conn = self.readers.acquire().await?;
        Self::get_on(&mut conn, scope).await
    }

    /// Answers once the claim is committed: a claim the caller acts on survives a crash.
    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome> {
        self.in_turn(async |tx| Self::claim_in_turn(tx, claim).await)
            .await
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool> {
        self.in_turn(async |tx| {
            Ok(complete_on(tx, COMPLETE, scope, Some(token), response, Some(now)).await?)
        })
        .await
    }

    async fn renew(
        &self,
        scope: &Scope,
        token: FencingToken,
        lease: Duration,
        now: Timestamp,
    ) -> Result<bool> {
        self.in_turn(async |tx| {
            let renew = sqlx::query(
                "UPDATE idempotency_keys SET lease_until = ?4
                 WHERE account_id = ?1 AND idem_key = ?2 AND fencing_token = ?3
                   AND status = 'in_progress'",
            );
            let done = bind_scope(renew, scope)
                .bind(token.0)
                .bind(now.plus(lease).0)
                .execute(&mut **tx)
                .await?;
            Ok(done.rows_affected() == 1)
        })
        .await
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> Result<bool> {
        self.in_turn(async |tx| {
            let release = sqlx::query(
                "DELETE FROM idempotency_keys
                 WHERE account_id = ?1 AND idem_key = ?2 AND fencing_token = ?3
                   AND status = 'in_progress'",
            );
            let done = bind_scope(release, scope)
                .bind(token.0)
                .execute(&mut **tx)
                .await?;
            Ok(done.rows_affected() == 1)
        })
        .await
    }

    async fn sweep(&self, now: Timestamp, batch: u32) -> Result<u64> {
        let done = sqlx::query(
            "DELETE FROM idempotency_keys WHERE (account_id, idem_key) IN (
                 SELECT account_id, idem_key FROM idempotency_keys
                 WHERE expires_at <= ?1 AND status = 'completed'
                 LIMIT ?2)",
        )
        .bind(now.0)
        .bind(i64::from(batch))
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected())
    }
}

impl TransactionalStore for SqliteStore {
    type Tx = SqliteTx;

    fn transaction_runtime(&self) -> Option<tokio::runtime::Handle> {
        Some(self.committer.runtime().clone())
    }

    async fn begin_claim(&self, claim: &NewClaim, wait: Duration) -> Result<TxClaim<SqliteTx>> {
        // A concurrent claim of this key holds the writer until its turn ends, so waiting
        // for a turn is waiting for it.
        let mut tx = match tokio::time::timeout(wait, self.committer.turn()).await {
            Ok(tx) => tx?,
            // Still no writer for a group: the database is held (another process's lock,
            // busy_timeout running), which is an outage, not this key in use.
            Err(_elapsed) if self.committer.waiting_on_the_database() => {
                return Err(Error::Unavailable(Box::new(sqlx::Error::PoolTimedOut)));
            }
            Err(_elapsed) => return Ok(TxClaim::Busy),
        };
        tx.savepoint = true;
        let won = match Self::claim_on(&mut tx, SAVEPOINT_AND_CLAIM, claim).await {
            Ok(won) => won,
            Err(e) => {
                tx.fail();
                return Err(e.into());
            }
        };
        if won {
            return Ok(TxClaim::Claimed(tx));
        }
        let record = match Self::get_on(&mut tx, &claim.scope).await {
            Ok(record) => record,
            Err(e) => {
                tx.fail();
                return Err(e);
            }
        };
        // The record may be an earlier request's of this group, not yet committed: answer
        // with it only once it is.
        tx.rollback_then_wait_for_group().await?;
        let record = record.ok_or_else(|| lost_to_nothing(&claim.scope))?;
        Ok(TxClaim::Existing(record))
    }

    async fn commit_response(
        &self,
        mut tx: SqliteTx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<()> {
        match complete_on(
            &mut tx,
            COMPLETE_AND_RELEASE,
            scope,
            Some(token),
            response,
            None,
        )
        .await
        {
            Ok(true) => {
                tx.savepoint = false;
                tx.commit_with_group().await
            }
            // The savepoint is released, so this request's writes can no longer be undone
            // alone: the whole group rolls back rather than commit them without a response.
            Ok(false) => {
                tx.poison();
                Err(Error::Raced(format!(
                    "the key row of {} vanished inside its own transaction",
                    scope.log_label()
                )))
            }
            Err(e) => {
                tx.fail();
                Err(e.into())
            }
        }
    }

    async fn rollback(&self, tx: SqliteTx) -> Result<()> {
        tx.rollback().await
    }
}

impl AdminStore for SqliteStore {
    async fn list(&self, filter: &RecordFilter, _now: Timestamp) -> Result<Vec<Record>> {
        let list = sqlx::query(
            "SELECT account_id, idem_key, request_hash, status, response_code, response_headers,
                    response_body, body_omitted, created_at, expires_at, lease_until, fencing_token
             FROM idempotency_keys
             WHERE (?1 IS NULL OR account_id = ?1)
               AND (?2 IS NULL OR status = ?2)
               AND (?3 IS NULL OR (status = 'in_progress' AND lease_until <= ?3))
             ORDER BY created_at DESC
             LIMIT ?4",
        );
        let rows = bind_filter(list, filter).fetch_all(&self.readers).await?;
        rows.iter()
            .map(|row| record_from_row(&row_scope(row)?, row))
            .collect()
    }

    async fn purge(&self, scope: &Scope) -> Result<bool> {
        // The key's history goes with it, in the same transaction.
        let mut tx = self.writer.begin().await?;
        let events =
            sqlx::query("DELETE FROM idem_record_events WHERE account_id = ?1 AND idem_key = ?2");
        bind_scope(events, scope).execute(&mut *tx).await?;
        let purge =
            sqlx::query("DELETE FROM idempotency_keys WHERE account_id = ?1 AND idem_key = ?2");
        let done = bind_scope(purge, scope).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    async fn record_event(&self, scope: &Scope, event: &RecordEvent) -> Result<()> {
        // Every key's events past the retention (by this event's time) go, and this key's
        // oldest beyond the latest EVENTS_KEPT - 1; then the event is added. One transaction.
        let mut tx = self.writer.begin().await?;
        sqlx::query("DELETE FROM idem_record_events WHERE at < ?1")
            .bind(event.at.0.saturating_sub(EVENTS_RETENTION_MS))
            .execute(&mut *tx)
            .await?;
        let trim = sqlx::query(
            "DELETE FROM idem_record_events
             WHERE account_id = ?1 AND idem_key = ?2 AND id <= (
                 SELECT id FROM idem_record_events
                 WHERE account_id = ?1 AND idem_key = ?2
                 ORDER BY id DESC LIMIT 1 OFFSET ?3)",
        );
        bind_scope(trim, scope)
            .bind(i64::try_from(EVENTS_KEPT - 1).unwrap_or(i64::MAX))
            .execute(&mut *tx)
            .await?;
        let insert = sqlx::query(
            "INSERT INTO idem_record_events (account_id, idem_key, at, what, by_whom)
             VALUES (?1, ?2, ?3, ?4, ?5)",
        );
        bind_scope(insert, scope)
            .bind(event.at.0)
            .bind(event.what.as_str())
            .bind(event.by.as_str())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn events(&self, scope: &Scope) -> Result<Vec<RecordEvent>> {
        let events = sqlx::query(
            "SELECT at, what, by_whom FROM idem_record_events
             WHERE account_id = ?1 AND idem_key = ?2 ORDER BY id",
        );
        let rows = bind_scope(events, scope).fetch_all(&self.readers).await?;
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

    async fn force_complete(
        &self,
        scope: &Scope,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool> {
        // One statement, whatever the token: no read of it before the write.
        let mut conn = self.writer.acquire().await?;
        Ok(complete_on(&mut conn, COMPLETE, scope, None, response, Some(now)).await?)
    }
}
