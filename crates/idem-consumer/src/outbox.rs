//! The producer's side: events written to `outbox` in the business transaction, and a relay
//! that publishes them to the broker and marks them sent.
//!
//! The relay publishes first and marks second, so a relay that dies between the two publishes
//! the event again: at least once, never lost. The copy is harmless: JetStream's duplicate
//! window drops it, and on every broker the consumer's inbox does.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Clock, SystemClock};
use sqlx::Pool;
use tokio::sync::Notify;

use crate::sql::{Database, PendingEvent};
use crate::{BrokerError, Message, Published, Publisher};

/// Writes `message` to the outbox in the caller's transaction (the one making the business
/// change it announces). It is published after that transaction commits, by a [`Relay`].
///
/// # Errors
///
/// The database's error when the row cannot be inserted (the caller's transaction should then
/// roll back).
pub async fn enqueue<DB: Database>(
    conn: &mut DB::Connection,
    message: &Message,
    now_ms: i64,
) -> Result<(), sqlx::Error> {
    DB::insert_outbox(conn, message, now_ms).await
}

/// Why a relay pass failed. Rows it had not marked sent stay pending for the next pass.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The outbox's database failed.
    #[error("the outbox's database failed")]
    Database(#[from] sqlx::Error),
    /// The broker did not take an event.
    #[error("the broker did not take an event")]
    Broker(#[from] BrokerError),
}

/// What one relay pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayPass {
    /// Events the broker stored.
    pub published: usize,
    /// Events the broker recognised as already stored and dropped (a relay had published them
    /// before it could mark them sent).
    pub duplicates: usize,
}

impl RelayPass {
    /// Events handed to the broker in the pass.
    pub fn total(&self) -> usize {
        self.published + self.duplicates
    }
}

/// Publishes pending outbox rows in order and marks them sent.
///
/// Several relays may run at once. On PostgreSQL each pass locks its batch with
/// `FOR UPDATE SKIP LOCKED`, so relays split the work. On SQLite (one process) a pass reads
/// without a lock; two relays on one file would publish some events twice, which the broker's
/// window or the consumer's inbox absorbs.
#[derive(Debug)]
pub struct Relay<DB: sqlx::Database, P> {
    pool: Pool<DB>,
    publisher: P,
    batch: i64,
    poll: Duration,
    wake: Arc<Notify>,
    clock: Arc<dyn Clock>,
}

impl<DB: Database, P: Publisher> Relay<DB, P> {
    /// A relay over the outbox in `pool`, publishing through `publisher`, 100 rows a pass,
    /// looking for work every second when nobody wakes it.
    pub fn new(pool: Pool<DB>, publisher: P) -> Self {
        Self {
            pool,
            publisher,
            batch: 100,
            poll: Duration::from_secs(1),
            wake: Arc::new(Notify::new()),
            clock: Arc::new(SystemClock),
        }
    }

    /// Rows per pass (at least 1).
    pub fn with_batch(mut self, batch: usize) -> Self {
        self.batch = i64::try_from(batch.max(1)).unwrap_or(i64::MAX);
        self
    }

    /// How long [`Relay::run`] waits between passes when nothing wakes it: the longest an
    /// event written by another process waits.
    pub fn with_poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// The clock that stamps `sent_at`.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// A handle that wakes [`Relay::run`] at once: call `notify_one()` after committing a
    /// transaction that wrote to the outbox.
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// One pass: publishes up to a batch of pending rows, oldest first, each awaited until the
    /// broker has it, then marks them sent.
    ///
    /// # Errors
    ///
    /// [`RelayError::Database`] when the outbox's database fails, and [`RelayError::Broker`]
    /// when the broker does not take an event. Rows not marked sent stay pending.
    pub async fn relay_once(&self) -> Result<RelayPass, RelayError> {
        if DB::LOCKS_PENDING {
            // The rows stay locked while they are published, so no other relay takes them; a
            // relay that dies releases them with its connection.
            let mut tx = DB::begin_write(&self.pool).await?;
            let pending = DB::pending(&mut tx, self.batch).await?;
            let pass = match self.publish(&pending).await {
                Ok(pass) => pass,
                Err(e) => {
                    // Unlock the rows now: a transaction merely dropped ends only when its
                    // connection is next used, and until then the next pass (or another
                    // relay, on another connection) skips them.
                    let _ = tx.rollback().await;
                    return Err(e.into());
                }
            };
            let seqs: Vec<i64> = pending.iter().map(|p| p.seq).collect();
            if !seqs.is_empty() {
                DB::mark_sent(&mut tx, &seqs, self.clock.now().0).await?;
            }
            tx.commit().await?;
            Ok(pass)
        } else {
            // SQLite has one writer: never hold it across the broker's round trips.
            let mut conn = self.pool.acquire().await?;
            let pending = DB::pending(&mut conn, self.batch).await?;
            drop(conn);
            let pass = self.publish(&pending).await?;
            if !pending.is_empty() {
                let seqs: Vec<i64> = pending.iter().map(|p| p.seq).collect();
                let mut tx = DB::begin_write(&self.pool).await?;
                DB::mark_sent(&mut tx, &seqs, self.clock.now().0).await?;
                tx.commit().await?;
            }
            Ok(pass)
        }
    }

    async fn publish(&self, pending: &[PendingEvent]) -> Result<RelayPass, BrokerError> {
        let mut pass = RelayPass::default();
        for event in pending {
            match self.publisher.publish(&event.message).await? {
                Published::Stored => pass.published += 1,
                Published::Duplicate => {
                    tracing::info!(
                        event_id = %event.message.id,
                        "the broker already had this event (published before a relay could mark it sent); dropped"
                    );
                    pass.duplicates += 1;
                }
            }
        }
        metrics::counter!("idem_outbox_published_total", "outcome" => "stored")
            .increment(pass.published as u64);
        metrics::counter!("idem_outbox_published_total", "outcome" => "duplicate")
            .increment(pass.duplicates as u64);
        Ok(pass)
    }

    /// Relays until `shutdown` completes: a pass whenever woken or every poll interval, passes
    /// back to back while there is a backlog. Failures are logged and retried with backoff
    /// (capped at 30 s); they never end the loop.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut backoff = Duration::from_millis(100);
        loop {
            let idle = match self.relay_once().await {
                Ok(pass) => {
                    backoff = Duration::from_millis(100);
                    if pass.total() > 0 {
                        tracing::debug!(
                            published = pass.published,
                            duplicates = pass.duplicates,
                            "outbox relayed"
                        );
                    }
                    // A full batch means more may be waiting: go again at once.
                    if pass.total() as i64 >= self.batch {
                        continue;
                    }
                    self.poll
                }
                Err(e) => {
                    tracing::warn!(error = %idem_core::ErrorChain(&e), retry_in = ?backoff, "the outbox relay failed; retrying");
                    let wait = backoff;
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                    wait
                }
            };
            tokio::select! {
                () = &mut shutdown => return,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(idle) => {}
            }
        }
    }

    /// Deletes at most `batch` rows per statement that were sent more than `retention` ago;
    /// the number deleted.
    ///
    /// # Errors
    ///
    /// The database's error; the batches deleted before it stay deleted.
    pub async fn expire_sent(&self, retention: Duration, batch: i64) -> Result<u64, sqlx::Error> {
        let before = self
            .clock
            .now()
            .0
            .saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
        let mut deleted = 0;
        loop {
            let n = DB::delete_sent_before(&self.pool, before, batch).await?;
            deleted += n;
            if n < batch.max(1) as u64 {
                return Ok(deleted);
            }
        }
    }

    /// The number of events not yet relayed.
    ///
    /// # Errors
    ///
    /// The database's error.
    pub async fn backlog(&self) -> Result<i64, sqlx::Error> {
        DB::count_pending(&self.pool).await
    }
}
