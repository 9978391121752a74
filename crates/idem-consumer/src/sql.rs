//! The two databases the inbox and the outbox live in. Only the SQL differs: PostgreSQL lets
//! several relays share the outbox with `FOR UPDATE SKIP LOCKED`; SQLite has one writer, so its
//! relay reads without a lock and never holds the writer while it talks to the broker.

use std::future::Future;

use sqlx::Pool;

use crate::{EventId, Message};

mod sealed {
    pub trait Sealed {}
}

/// Why [`Database::migrate`] failed.
#[derive(Debug, thiserror::Error)]
#[error("migrating the inbox and outbox schema failed")]
pub struct MigrateError(#[source] Box<dyn std::error::Error + Send + Sync>);

/// A pending outbox row: its place in the outbox and the event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingEvent {
    /// The row's place in the outbox (the relay's order).
    pub seq: i64,
    /// The event.
    pub message: Message,
}

/// A database that holds `processed_events` and `outbox`: [`sqlx::Sqlite`] or
/// [`sqlx::Postgres`]. Sealed: the SQL is written and tested for these two.
pub trait Database: sqlx::Database + sealed::Sealed {
    /// Creates or updates the `processed_events` and `outbox` tables (migration history in
    /// `idem_consumer_migrations`). On PostgreSQL in one transaction with unnamed statements,
    /// so that it works through a pooler that lends sessions per transaction (PgBouncer in
    /// transaction mode), as every statement of this crate does.
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), MigrateError>> + Send;

    /// Opens a transaction that will write (on SQLite, `BEGIN IMMEDIATE`, so it never fails
    /// half-way to upgrade to a writer).
    fn begin_write(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<sqlx::Transaction<'static, Self>, sqlx::Error>> + Send;

    /// Inserts `(consumer, event)` into the inbox; `false` if it was there already.
    fn insert_processed<'c>(
        conn: &'c mut Self::Connection,
        consumer: &'c str,
        event: &'c EventId,
        now_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'c;

    /// Deletes at most `batch` inbox rows processed before `before_ms`; the number deleted.
    fn delete_processed_before(
        pool: &Pool<Self>,
        before_ms: i64,
        batch: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Writes `message` to the outbox in the caller's transaction.
    fn insert_outbox<'c>(
        conn: &'c mut Self::Connection,
        message: &'c Message,
        now_ms: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;

    /// Up to `limit` unsent rows, oldest first. On PostgreSQL the rows stay locked until `conn`'s
    /// transaction ends and rows another relay holds are skipped.
    fn pending<'c>(
        conn: &'c mut Self::Connection,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<PendingEvent>, sqlx::Error>> + Send + 'c;

    /// Marks the rows `seqs` sent.
    fn mark_sent<'c>(
        conn: &'c mut Self::Connection,
        seqs: &'c [i64],
        now_ms: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'c;

    /// Deletes at most `batch` rows sent before `before_ms`; the number deleted.
    fn delete_sent_before(
        pool: &Pool<Self>,
        before_ms: i64,
        batch: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// The number of rows not yet sent.
    fn count_pending(pool: &Pool<Self>) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// Whether [`Database::pending`] locks its rows, so relays can hold them while publishing.
    const LOCKS_PENDING: bool;
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn pending_from_row<R: sqlx::Row>(row: &R) -> Result<PendingEvent, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let id: String = row.try_get("event_id")?;
    Ok(PendingEvent {
        seq: row.try_get("seq")?,
        message: Message {
            id: EventId::new(id).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
            topic: row.try_get("topic")?,
            payload: row.try_get("payload")?,
        },
    })
}

// The statements written once for both databases. Their `$n` placeholders are PostgreSQL's;
// SQLite reads them too (sqlx binds `$n` to the n-th argument there as well).

#[cfg(any(feature = "sqlite", feature = "postgres"))]
const INSERT_PROCESSED: &str = "INSERT INTO processed_events (consumer, event_id, processed_at)
     VALUES ($1, $2, $3) ON CONFLICT DO NOTHING";

/// The statement [`enqueue`](crate::enqueue) runs, for a transaction of another client than
/// sqlx's (tokio-postgres): it binds the event id, the topic, the payload and the time in Unix
/// milliseconds, in that order. The same text on both databases.
pub const INSERT_OUTBOX: &str =
    "INSERT INTO outbox (event_id, topic, payload, created_at) VALUES ($1, $2, $3, $4)";

#[cfg(any(feature = "sqlite", feature = "postgres"))]
const COUNT_PENDING: &str = "SELECT count(*) FROM outbox WHERE sent_at IS NULL";

// Up to `$1` unsent rows, oldest first. (A macro, so that `concat!` can add PostgreSQL's lock.)
#[cfg(any(feature = "sqlite", feature = "postgres"))]
macro_rules! pending_sql {
    () => {
        "SELECT seq, event_id, topic, payload FROM outbox
         WHERE sent_at IS NULL ORDER BY seq LIMIT $1"
    };
}

/// The methods both databases implement alike, written once. What differs is passed in:
/// whether pending rows are locked, whether statements may be prepared under a name and cached
/// on their connection (not on PostgreSQL, which may be behind a pooler that lends sessions per
/// transaction; SQLite's cache lives in the process), how the migrations run, the statement
/// that opens a write transaction, the query of pending rows, and the batched deletes, each a
/// method named with its statement (`$1` the time before which rows go, `$2` the batch) written
/// in the database's own way of deleting a bounded batch.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
macro_rules! common_methods {
    (
        locks_pending: $locks_pending:expr,
        persistent: $persistent:expr,
        migrate: $migrate:path,
        begin_write: $begin_write:expr,
        pending: $pending:expr,
        batched_deletes: [$($delete:ident: $delete_statement:expr),+ $(,)?] $(,)?
    ) => {
        const LOCKS_PENDING: bool = $locks_pending;

        async fn migrate(pool: &Pool<Self>) -> Result<(), MigrateError> {
            $migrate(pool).await.map_err(|e| MigrateError(Box::new(e)))
        }

        async fn begin_write(
            pool: &Pool<Self>,
        ) -> Result<sqlx::Transaction<'static, Self>, sqlx::Error> {
            pool.begin_with($begin_write).await
        }

        async fn insert_processed<'c>(
            conn: &'c mut Self::Connection,
            consumer: &'c str,
            event: &'c EventId,
            now_ms: i64,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(INSERT_PROCESSED)
                .persistent($persistent)
                .bind(consumer)
                .bind(event.as_str())
                .bind(now_ms)
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        $(
            async fn $delete(
                pool: &Pool<Self>,
                before_ms: i64,
                batch: i64,
            ) -> Result<u64, sqlx::Error> {
                // In a transaction of its own: behind a pooler that lends sessions per
                // transaction, sqlx's preparation and execution of an unnamed statement must
                // not be split across two sessions.
                let mut tx = Self::begin_write(pool).await?;
                let done = sqlx::query($delete_statement)
                    .persistent($persistent)
                    .bind(before_ms)
                    .bind(batch)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(done.rows_affected())
            }
        )+

        async fn insert_outbox<'c>(
            conn: &'c mut Self::Connection,
            message: &'c Message,
            now_ms: i64,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(INSERT_OUTBOX)
                .persistent($persistent)
                .bind(message.id.as_str())
                .bind(&message.topic)
                .bind(&message.payload)
                .bind(now_ms)
                .execute(conn)
                .await?;
            Ok(())
        }

        async fn pending(
            conn: &mut Self::Connection,
            limit: i64,
        ) -> Result<Vec<PendingEvent>, sqlx::Error> {
            let rows = sqlx::query($pending)
                .persistent($persistent)
                .bind(limit)
                .fetch_all(conn)
                .await?;
            rows.iter().map(pending_from_row).collect()
        }

        async fn count_pending(pool: &Pool<Self>) -> Result<i64, sqlx::Error> {
            // A simple query (no parameters): one round trip, nothing prepared.
            let row = sqlx::raw_sql(COUNT_PENDING).fetch_one(pool).await?;
            sqlx::Row::try_get(&row, 0)
        }
    };
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use sqlx::{Sqlite, SqliteConnection};

    impl sealed::Sealed for Sqlite {}

    async fn migrate_sqlite(pool: &Pool<Sqlite>) -> Result<(), sqlx::migrate::MigrateError> {
        let mut migrator = sqlx::migrate!("migrations/sqlite");
        migrator.dangerous_set_table_name("idem_consumer_migrations");
        migrator.run(pool).await
    }

    impl Database for Sqlite {
        common_methods! {
            locks_pending: false,
            persistent: true,
            migrate: migrate_sqlite,
            // Takes the write lock at once, so the transaction never fails half-way to upgrade
            // to a writer.
            begin_write: "BEGIN IMMEDIATE",
            pending: pending_sql!(),
            batched_deletes: [
                // A WITHOUT ROWID table: delete by the key.
                delete_processed_before: "DELETE FROM processed_events WHERE (consumer, event_id) IN
                    (SELECT consumer, event_id FROM processed_events WHERE processed_at < $1 LIMIT $2)",
                delete_sent_before: "DELETE FROM outbox WHERE seq IN
                    (SELECT seq FROM outbox WHERE sent_at IS NOT NULL AND sent_at < $1 LIMIT $2)",
            ],
        }

        async fn mark_sent<'c>(
            conn: &'c mut SqliteConnection,
            seqs: &'c [i64],
            now_ms: i64,
        ) -> Result<(), sqlx::Error> {
            // One statement per row: SQLite has no array parameter, and these run inside one
            // short transaction.
            for seq in seqs {
                sqlx::query("UPDATE outbox SET sent_at = $1 WHERE seq = $2 AND sent_at IS NULL")
                    .bind(now_ms)
                    .bind(seq)
                    .execute(&mut *conn)
                    .await?;
            }
            Ok(())
        }
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use sqlx::{PgConnection, Postgres};

    impl sealed::Sealed for Postgres {}

    async fn migrate_postgres(pool: &Pool<Postgres>) -> Result<(), idem_store::MigrationError> {
        let mut migrator = sqlx::migrate!("migrations/postgres");
        migrator.dangerous_set_table_name("idem_consumer_migrations");
        idem_store::migrate_pg(pool, &migrator).await
    }

    impl Database for Postgres {
        common_methods! {
            locks_pending: true,
            persistent: false,
            migrate: migrate_postgres,
            begin_write: "BEGIN",
            pending: concat!(pending_sql!(), " FOR UPDATE SKIP LOCKED"),
            batched_deletes: [
                delete_processed_before: "DELETE FROM processed_events WHERE ctid = ANY (ARRAY(
                    SELECT ctid FROM processed_events WHERE processed_at < $1 LIMIT $2))",
                delete_sent_before: "DELETE FROM outbox WHERE seq = ANY (ARRAY(
                    SELECT seq FROM outbox WHERE sent_at IS NOT NULL AND sent_at < $1 LIMIT $2))",
            ],
        }

        async fn mark_sent<'c>(
            conn: &'c mut PgConnection,
            seqs: &'c [i64],
            now_ms: i64,
        ) -> Result<(), sqlx::Error> {
            sqlx::query("UPDATE outbox SET sent_at = $1 WHERE seq = ANY($2) AND sent_at IS NULL")
                .persistent(false)
                .bind(now_ms)
                .bind(seqs)
                .execute(conn)
                .await?;
            Ok(())
        }
    }
}
