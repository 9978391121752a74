//! The consumer's side: `processed_events`, written in the same transaction as the side
//! effect. A row inserted means "first time, apply it"; no row inserted means "already done".

use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::Pool;

use crate::EventId;
use crate::sql::Database;

/// What [`Inbox::process`] did with an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed<T> {
    /// The event was new: the side effect ran and committed with its inbox row.
    Applied(T),
    /// The inbox already held the event: nothing ran, nothing changed.
    AlreadyDone,
}

/// Why [`Inbox::process`] failed. Nothing was committed in either case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessError<E> {
    /// The database failed (begin, inbox insert, commit).
    #[error("the inbox's database failed while processing event {event}")]
    Database {
        /// The event being processed.
        event: EventId,
        /// The database's error.
        #[source]
        source: sqlx::Error,
    },
    /// The side effect failed; its transaction was rolled back with the inbox row.
    #[error("the side effect of event {event} failed")]
    Handler {
        /// The event being processed.
        event: EventId,
        /// The side effect's error.
        #[source]
        source: E,
    },
}

/// The processed-events inbox of one named consumer. Consumers with different names keep
/// separate records in the same table: each applies every event once.
#[derive(Debug, Clone)]
pub struct Inbox {
    consumer: String,
}

impl Inbox {
    /// The inbox of the consumer called `consumer` (e.g. `"receipts"`).
    pub fn new(consumer: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
        }
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Records `event` in the caller's transaction: `true` if this is its first time, in which
    /// case the caller applies its side effect in the same transaction before committing;
    /// `false` if it was done before, in which case the caller does nothing.
    ///
    /// Two transactions recording the same event at once cannot both get `true`: the second
    /// waits on the first's row and finds it there once the first commits.
    ///
    /// # Errors
    ///
    /// The database's error when the insert fails; the caller's transaction should then roll
    /// back.
    pub async fn record<DB: Database>(
        &self,
        conn: &mut DB::Connection,
        event: &EventId,
        now_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        DB::insert_processed(conn, &self.consumer, event, now_ms).await
    }

    /// Runs `side_effect` and the inbox insert in one transaction: the side effect runs only if
    /// the insert inserted, and both commit or neither does.
    ///
    /// `side_effect` receives the transaction's connection; write the effect's rows through it.
    /// An effect outside the database (an email, an HTTP call) cannot join the transaction:
    /// give it the event id as its own idempotency key.
    ///
    /// # Errors
    ///
    /// Nothing is committed when it fails: [`ProcessError::Database`] when the begin, the
    /// inbox insert or the commit fails, and [`ProcessError::Handler`] with `side_effect`'s
    /// error when it fails.
    pub async fn process<DB, T, E, F>(
        &self,
        pool: &Pool<DB>,
        event: &EventId,
        now_ms: i64,
        side_effect: F,
    ) -> Result<Processed<T>, ProcessError<E>>
    where
        DB: Database,
        F: for<'c> FnOnce(&'c mut DB::Connection) -> BoxFuture<'c, Result<T, E>>,
    {
        let database = |source| ProcessError::Database {
            event: event.clone(),
            source,
        };
        let mut tx = DB::begin_write(pool).await.map_err(database)?;
        if !self
            .record::<DB>(&mut tx, event, now_ms)
            .await
            .map_err(database)?
        {
            // Nothing written: ending the transaction either way is the same.
            tx.rollback().await.map_err(database)?;
            return Ok(Processed::AlreadyDone);
        }
        let value = match side_effect(&mut tx).await {
            Ok(value) => value,
            Err(source) => {
                // Dropping the transaction rolls it back; an explicit rollback reports nothing
                // more useful than the side effect's own error.
                drop(tx);
                return Err(ProcessError::Handler {
                    event: event.clone(),
                    source,
                });
            }
        };
        tx.commit().await.map_err(database)?;
        Ok(Processed::Applied(value))
    }

    /// Deletes inbox rows (of every consumer) processed more than `retention` before `now_ms`,
    /// `batch` rows per statement so no statement holds locks for long. Returns how many went.
    ///
    /// Keep rows longer than the longest a broker may redeliver (a JetStream stream's max age,
    /// a Kafka topic's retention): an event redelivered after its row expired runs again.
    ///
    /// # Errors
    ///
    /// The database's error; the batches deleted before it stay deleted.
    pub async fn expire<DB: Database>(
        pool: &Pool<DB>,
        retention: Duration,
        now_ms: i64,
        batch: i64,
    ) -> Result<u64, sqlx::Error> {
        let before =
            now_ms.saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
        let mut deleted = 0;
        loop {
            let n = DB::delete_processed_before(pool, before, batch).await?;
            deleted += n;
            if n < batch.max(1) as u64 {
                return Ok(deleted);
            }
        }
    }
}
