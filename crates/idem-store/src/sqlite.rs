//! [`SqliteStore`]: the embedded default.
//!
//! SQLite allows one writer at a time, so the store keeps exactly one writer connection (a
//! pool of one) and a pool of readers (WAL lets them read while the writer writes). Writers
//! queue in the pool, fairly, instead of spinning on `SQLITE_BUSY`; `busy_timeout` still covers
//! another process opening the same file.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use idem_core::{
    AccountId, FencingToken, Fingerprint, Record, RecordState, Scope, StoredResponse, Timestamp,
};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
};
use sqlx::{Row, Sqlite, SqliteConnection};

use crate::{
    AdminStore, ClaimOutcome, Error, NewClaim, RecordFilter, Result, Store, TransactionalStore,
    TxClaim, stored_scope,
};

/// The transaction a handler writes through in transaction mode.
pub type SqliteTx = sqlx::Transaction<'static, Sqlite>;

/// Records in an SQLite file.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    writer: SqlitePool,
    readers: SqlitePool,
}

// Claims a key if no record holds it, or replaces a record the claim may replace (past its
// retention and not held by a live lease; or, if allowed, a stale claim of the same request).
// One statement, so two claims can never both win.
const CLAIM: &str = "
INSERT INTO idempotency_keys
    (account_id, idem_key, request_hash, status, created_at, expires_at, lease_until, fencing_token)
VALUES (?1, ?2, ?3, 'in_progress', ?4, ?5, ?6, ?7)
ON CONFLICT (account_id, idem_key) DO UPDATE SET
    request_hash = excluded.request_hash,
    status = 'in_progress',
    response_code = NULL,
    response_headers = NULL,
    response_body = NULL,
    body_omitted = 0,
    created_at = excluded.created_at,
    expires_at = excluded.expires_at,
    lease_until = excluded.lease_until,
    fencing_token = excluded.fencing_token
WHERE (idempotency_keys.expires_at <= ?4
       AND NOT (idempotency_keys.status = 'in_progress' AND idempotency_keys.lease_until > ?4))
   OR (?8 AND idempotency_keys.status = 'in_progress'
       AND idempotency_keys.lease_until <= ?4
       AND idempotency_keys.request_hash = ?3)
RETURNING fencing_token";

const SELECT: &str = "
SELECT request_hash, status, response_code, response_headers, response_body, body_omitted,
       created_at, expires_at, lease_until, fencing_token
FROM idempotency_keys WHERE account_id = ?1 AND idem_key = ?2";

const COMPLETE: &str = "
UPDATE idempotency_keys
SET status = 'completed', response_code = ?4, response_headers = ?5, response_body = ?6,
    body_omitted = ?7
WHERE account_id = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND status = 'in_progress'";

impl SqliteStore {
    /// Opens (creating if needed) the database file at `path` and applies the migrations.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::with_options(SqliteConnectOptions::new().filename(path)).await
    }

    /// Opens a database named by a URL such as `sqlite://idem.db` or `sqlite:///var/lib/idem.db`.
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
        Ok(Self { writer, readers })
    }

    /// The single writer connection's pool. Business writes outside an idempotent request go
    /// through it too (SQLite has one writer); hold it briefly.
    pub fn writer(&self) -> &SqlitePool {
        &self.writer
    }

    /// The readers' pool.
    pub fn readers(&self) -> &SqlitePool {
        &self.readers
    }

    async fn claim_on(conn: &mut SqliteConnection, claim: &NewClaim) -> Result<bool> {
        let row = sqlx::query(CLAIM)
            .bind(claim.scope.account.as_str())
            .bind(claim.scope.key.as_str())
            .bind(&claim.fingerprint.as_bytes()[..])
            .bind(claim.now.0)
            .bind(claim.expires_at.0)
            .bind(claim.lease_until.0)
            .bind(claim.token.0)
            .bind(claim.take_over_expired_lease)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(row.is_some())
    }

    async fn get_on(conn: &mut SqliteConnection, scope: &Scope) -> Result<Option<Record>> {
        let row = sqlx::query(SELECT)
            .bind(scope.account.as_str())
            .bind(scope.key.as_str())
            .fetch_optional(&mut *conn)
            .await?;
        row.map(|row| record_from_row(scope, &row)).transpose()
    }
}

fn record_from_row(scope: &Scope, row: &SqliteRow) -> Result<Record> {
    let corrupt = |what: &str| Error::Corrupt(format!("{what} for key {}", scope.log_label()));
    let hash: Vec<u8> = row.try_get("request_hash")?;
    let fingerprint = Fingerprint::try_from(hash.as_slice())
        .map_err(|_| corrupt("a request hash of bad length"))?;
    let status: String = row.try_get("status")?;
    let state = match status.as_str() {
        "in_progress" => RecordState::InProgress {
            lease_until: Timestamp(row.try_get("lease_until")?),
            token: FencingToken(row.try_get("fencing_token")?),
        },
        "completed" => {
            let code: i64 = row.try_get("response_code")?;
            let headers: String = row.try_get("response_headers")?;
            RecordState::Completed(StoredResponse {
                status: u16::try_from(code).map_err(|_| corrupt("a bad response code"))?,
                headers: serde_json::from_str(&headers)
                    .map_err(|_| corrupt("unreadable response headers"))?,
                body: row.try_get("response_body")?,
                body_omitted: row.try_get("body_omitted")?,
            })
        }
        _ => return Err(corrupt("an unknown status")),
    };
    Ok(Record {
        scope: Scope::new(AccountId::new(scope.account.as_str()), scope.key.clone()),
        fingerprint,
        state,
        created_at: Timestamp(row.try_get("created_at")?),
        expires_at: Timestamp(row.try_get("expires_at")?),
    })
}

async fn complete_on(
    conn: &mut SqliteConnection,
    scope: &Scope,
    token: FencingToken,
    response: &StoredResponse,
) -> Result<bool> {
    let headers = serde_json::to_string(&response.headers).expect("headers always serialise");
    let done = sqlx::query(COMPLETE)
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .bind(token.0)
        .bind(i64::from(response.status))
        .bind(headers)
        .bind(&response.body[..])
        .bind(response.body_omitted)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

impl Store for SqliteStore {
    async fn get(&self, scope: &Scope) -> Result<Option<Record>> {
        let mut conn = self.readers.acquire().await?;
        Self::get_on(&mut conn, scope).await
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome> {
        let mut conn = self.writer.acquire().await?;
        if Self::claim_on(&mut conn, claim).await? {
            return Ok(ClaimOutcome::Claimed);
        }
        // The claim lost to a record; read it on the same connection. With one writer nothing
        // can change it in between.
        match Self::get_on(&mut conn, &claim.scope).await? {
            Some(record) => Ok(ClaimOutcome::Existing(record)),
            None => Err(Error::Corrupt(format!(
                "a claim of key {} conflicted with a record that does not exist",
                claim.scope.log_label()
            ))),
        }
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<bool> {
        let mut conn = self.writer.acquire().await?;
        complete_on(&mut conn, scope, token, response).await
    }

    async fn renew(
        &self,
        scope: &Scope,
        token: FencingToken,
        lease_until: Timestamp,
    ) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE idempotency_keys SET lease_until = ?4
             WHERE account_id = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND status = 'in_progress'",
        )
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .bind(token.0)
        .bind(lease_until.0)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> Result<bool> {
        let done = sqlx::query(
            "DELETE FROM idempotency_keys
             WHERE account_id = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND status = 'in_progress'",
        )
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .bind(token.0)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn sweep(&self, now: Timestamp, batch: u32) -> Result<u64> {
        let done = sqlx::query(
            "DELETE FROM idempotency_keys WHERE (account_id, idem_key) IN (
                 SELECT account_id, idem_key FROM idempotency_keys
                 WHERE expires_at <= ?1 AND (status = 'completed' OR lease_until <= ?1)
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

    async fn begin_claim(&self, claim: &NewClaim, wait: Duration) -> Result<TxClaim<SqliteTx>> {
        // A concurrent claim of this key holds the writer until it commits or rolls back, so
        // waiting for the writer is waiting for it.
        let mut tx =
            match tokio::time::timeout(wait, self.writer.begin_with("BEGIN IMMEDIATE")).await {
                Ok(tx) => tx?,
                Err(_elapsed) => return Ok(TxClaim::Busy),
            };
        if Self::claim_on(&mut tx, claim).await? {
            return Ok(TxClaim::Claimed(tx));
        }
        let record = Self::get_on(&mut tx, &claim.scope).await?;
        tx.rollback().await?;
        match record {
            Some(record) => Ok(TxClaim::Existing(record)),
            None => Err(Error::Corrupt(format!(
                "a claim of key {} conflicted with a record that does not exist",
                claim.scope.log_label()
            ))),
        }
    }

    async fn commit_response(
        &self,
        mut tx: SqliteTx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<()> {
        if !complete_on(&mut tx, scope, token, response).await? {
            return Err(Error::Corrupt(format!(
                "the key row of {} vanished inside its own transaction",
                scope.log_label()
            )));
        }
        tx.commit().await?;
        Ok(())
    }

    async fn rollback(&self, tx: SqliteTx) -> Result<()> {
        tx.rollback().await?;
        Ok(())
    }
}

impl AdminStore for SqliteStore {
    async fn list(&self, filter: &RecordFilter) -> Result<Vec<Record>> {
        let rows = sqlx::query(
            "SELECT account_id, idem_key, request_hash, status, response_code, response_headers,
                    response_body, body_omitted, created_at, expires_at, lease_until, fencing_token
             FROM idempotency_keys
             WHERE (?1 IS NULL OR account_id = ?1)
               AND (?2 IS NULL OR status = ?2)
               AND (?3 IS NULL OR (status = 'in_progress' AND lease_until <= ?3))
             ORDER BY created_at DESC
             LIMIT ?4",
        )
        .bind(filter.account.as_ref().map(|a| a.as_str()))
        .bind(filter.state())
        .bind(filter.lease_expired_by.map(|t| t.0))
        .bind(filter.limit())
        .fetch_all(&self.readers)
        .await?;
        rows.iter()
            .map(|row| {
                let scope = stored_scope(row.try_get("account_id")?, row.try_get("idem_key")?)?;
                record_from_row(&scope, row)
            })
            .collect()
    }

    async fn purge(&self, scope: &Scope) -> Result<bool> {
        let done =
            sqlx::query("DELETE FROM idempotency_keys WHERE account_id = ?1 AND idem_key = ?2")
                .bind(scope.account.as_str())
                .bind(scope.key.as_str())
                .execute(&self.writer)
                .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn force_complete(&self, scope: &Scope, response: &StoredResponse) -> Result<bool> {
        let mut conn = self.writer.acquire().await?;
        let token: Option<i64> = sqlx::query_scalar(
            "SELECT fencing_token FROM idempotency_keys
             WHERE account_id = ?1 AND idem_key = ?2 AND status = 'in_progress'",
        )
        .bind(scope.account.as_str())
        .bind(scope.key.as_str())
        .fetch_optional(&mut *conn)
        .await?;
        // One writer connection: nothing can change the row between the read and the write.
        match token {
            Some(token) => complete_on(&mut conn, scope, FencingToken(token), response).await,
            None => Ok(false),
        }
    }
}
