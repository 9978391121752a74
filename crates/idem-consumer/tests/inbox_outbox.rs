//! The inbox and the outbox on both databases, one suite run against SQLite and PostgreSQL
//! (a fresh database per test). The brokers themselves are exercised in the adapters' tests
//! and end to end in idem-cli's `outbox` tests; here a publisher that records what it was
//! given shows exactly which events a relay handed over, and how often.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt as _;
use idem_consumer::{
    BrokerError, Database, EventId, Inbox, Message, ProcessError, Processed, Published, Publisher,
    Relay, enqueue,
};
use sqlx::Pool;

/// Records every message handed to it, in order; fails while `failing` is set.
#[derive(Debug, Clone, Default)]
struct RecordingPublisher {
    seen: Arc<Mutex<Vec<String>>>,
    failing: Arc<Mutex<bool>>,
}

impl RecordingPublisher {
    fn ids(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

impl Publisher for RecordingPublisher {
    async fn publish(&self, message: &Message) -> Result<Published, BrokerError> {
        if *self.failing.lock().unwrap() {
            return Err(BrokerError::new("test", "publishing", "the broker is down"));
        }
        // Let other relays interleave, as a network round trip would.
        tokio::task::yield_now().await;
        self.seen.lock().unwrap().push(message.id.to_string());
        Ok(Published::Stored)
    }
}

fn message(i: usize) -> Message {
    Message {
        id: EventId::new(format!("evt_{i:05}")).unwrap(),
        topic: "orders".into(),
        payload: format!("{{\"n\":{i}}}").into_bytes(),
    }
}

async fn write_events<DB: Database>(pool: &Pool<DB>, range: std::ops::Range<usize>) {
    let mut tx = DB::begin_write(pool).await.unwrap();
    for i in range {
        enqueue::<DB>(&mut tx, &message(i), 1_000).await.unwrap();
    }
    tx.commit().await.unwrap();
}

async fn pending<DB: Database>(relay: &Relay<DB, RecordingPublisher>) -> i64 {
    relay.backlog().await.unwrap()
}

macro_rules! suite {
    ($db:ty, $pool:expr) => {
        use super::*;

        /// What the count query `sql` answers.
        async fn count(pool: &Pool<$db>, sql: &'static str) -> i64 {
            // Unnamed, as every statement that may go through a pooler, and in a transaction:
            // sqlx prepares an unnamed statement and binds it in two exchanges, which a pooler
            // lending sessions per transaction may send to two different sessions.
            let mut tx = pool.begin().await.unwrap();
            let n = sqlx::query_scalar(sql)
                .persistent(false)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            n
        }

        #[tokio::test]
        async fn the_inbox_applies_an_event_once_however_often_it_arrives() {
            let (pool, _guard) = $pool;
            sqlx::raw_sql("CREATE TABLE effects (event_id TEXT NOT NULL)")
                .execute(&pool)
                .await
                .unwrap();
            let inbox = Inbox::new("emails");
            let event = EventId::new("evt_once").unwrap();
            let mut applied = 0;
            for _ in 0..3 {
                let outcome = inbox
                    .process::<$db, _, sqlx::Error, _>(&pool, &event, 1, |conn| {
                        async move {
                            sqlx::raw_sql("INSERT INTO effects VALUES ('evt_once')")
                                .execute(conn)
                                .await
                                .map(|_| ())
                        }
                        .boxed()
                    })
                    .await
                    .unwrap();
                if matches!(outcome, Processed::Applied(())) {
                    applied += 1;
                }
            }
            assert_eq!(applied, 1);
            let effects = count(&pool, "SELECT count(*) FROM effects").await;
            assert_eq!(effects, 1);
            // Another consumer has an inbox of its own: it applies the event too.
            let other = Inbox::new("analytics");
            let outcome = other
                .process::<$db, _, sqlx::Error, _>(&pool, &event, 1, |_| async { Ok(()) }.boxed())
                .await
                .unwrap();
            assert_eq!(outcome, Processed::Applied(()));
        }

        #[tokio::test]
        async fn a_failed_side_effect_leaves_no_inbox_row_so_the_retry_applies_it() {
            let (pool, _guard) = $pool;
            let inbox = Inbox::new("emails");
            let event = EventId::new("evt_retry").unwrap();
            let failed = inbox
                .process::<$db, (), &str, _>(&pool, &event, 1, |_| {
                    async { Err("smtp down") }.boxed()
                })
                .await;
            assert!(matches!(
                failed,
                Err(ProcessError::Handler {
                    source: "smtp down",
                    ..
                })
            ));
            let retried = inbox
                .process::<$db, _, &str, _>(&pool, &event, 2, |_| async { Ok(7) }.boxed())
                .await
                .unwrap();
            assert_eq!(retried, Processed::Applied(7));
        }

        #[tokio::test]
        async fn concurrent_deliveries_of_one_event_apply_it_once() {
            let (pool, _guard) = $pool;
            let inbox = Inbox::new("emails");
            let event = EventId::new("evt_raced").unwrap();
            let runs: Vec<_> = (0..16)
                .map(|_| {
                    let (pool, inbox, event) = (pool.clone(), inbox.clone(), event.clone());
                    tokio::spawn(async move {
                        inbox
                            .process::<$db, _, sqlx::Error, _>(&pool, &event, 1, |_| {
                                async {
                                    // Hold the transaction open while the others arrive.
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                    Ok(())
                                }
                                .boxed()
                            })
                            .await
                            .unwrap()
                    })
                })
                .collect();
            let mut applied = 0;
            for run in runs {
                if run.await.unwrap() == Processed::Applied(()) {
                    applied += 1;
                }
            }
            assert_eq!(applied, 1);
        }

        #[tokio::test]
        async fn expiry_deletes_old_inbox_rows_in_batches_and_keeps_recent_ones() {
            let (pool, _guard) = $pool;
            let inbox = Inbox::new("emails");
            for i in 0..25 {
                let mut tx = <$db as Database>::begin_write(&pool).await.unwrap();
                let at = if i < 20 { 1_000 } else { 90_000 };
                assert!(
                    inbox
                        .record::<$db>(&mut tx, &EventId::new(format!("e{i}")).unwrap(), at)
                        .await
                        .unwrap()
                );
                tx.commit().await.unwrap();
            }
            let deleted = Inbox::expire(&pool, Duration::from_secs(60), 100_000, 7)
                .await
                .unwrap();
            assert_eq!(deleted, 20);
            let left = count(&pool, "SELECT count(*) FROM processed_events").await;
            assert_eq!(left, 5);
        }

        #[tokio::test]
        async fn the_relay_publishes_committed_events_in_order_and_marks_them_sent() {
            let (pool, _guard) = $pool;
            // An event written in a transaction that rolls back is never published.
            let mut tx = <$db as Database>::begin_write(&pool).await.unwrap();
            enqueue::<$db>(&mut tx, &message(999), 1).await.unwrap();
            tx.rollback().await.unwrap();
            write_events(&pool, 0..250).await;

            let publisher = RecordingPublisher::default();
            let relay = Relay::new(pool.clone(), publisher.clone()).with_batch(100);
            assert_eq!(pending(&relay).await, 250);
            let mut passes = 0;
            while relay.relay_once().await.unwrap().total() > 0 {
                passes += 1;
            }
            assert_eq!(passes, 3);
            let expected: Vec<String> = (0..250).map(|i| format!("evt_{i:05}")).collect();
            assert_eq!(publisher.ids(), expected);
            assert_eq!(pending(&relay).await, 0);
        }

        #[tokio::test]
        async fn a_broker_failure_leaves_events_pending_for_the_next_pass() {
            let (pool, _guard) = $pool;
            write_events(&pool, 0..10).await;
            let publisher = RecordingPublisher::default();
            *publisher.failing.lock().unwrap() = true;
            let relay = Relay::new(pool.clone(), publisher.clone());
            assert!(relay.relay_once().await.is_err());
            assert_eq!(pending(&relay).await, 10);
            *publisher.failing.lock().unwrap() = false;
            assert_eq!(relay.relay_once().await.unwrap().published, 10);
            assert_eq!(pending(&relay).await, 0);
        }

        #[tokio::test]
        async fn sent_events_expire_and_pending_ones_never_do() {
            let (pool, _guard) = $pool;
            write_events(&pool, 0..30).await;
            let clock = idem_core::ManualClock::new(idem_core::Timestamp(1_800_000_000_000));
            let relay = Relay::new(pool.clone(), RecordingPublisher::default())
                .with_batch(20)
                .with_clock(Arc::new(clock.clone()));
            relay.relay_once().await.unwrap();
            // Sent 0 ms ago is not more than a zero retention ago: all kept.
            assert_eq!(relay.expire_sent(Duration::ZERO, 8).await.unwrap(), 0);
            // A millisecond later the 20 sent expire; the 10 unsent stay.
            clock.advance(Duration::from_millis(1));
            let deleted = relay.expire_sent(Duration::ZERO, 8).await.unwrap();
            assert_eq!(deleted, 20);
            assert_eq!(pending(&relay).await, 10);
            let total = count(&pool, "SELECT count(*) FROM outbox").await;
            assert_eq!(total, 10);
        }
    };
}

mod sqlite {
    async fn fresh() -> (sqlx::SqlitePool, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(dir.path().join("events.db"))
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(std::time::Duration::from_secs(10));
        // One writer, as idem's SQLite store runs it.
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap();
        <sqlx::Sqlite as idem_consumer::Database>::migrate(&pool)
            .await
            .unwrap();
        (pool, dir)
    }

    suite!(sqlx::Sqlite, fresh().await);
}

mod postgres {
    async fn fresh() -> (sqlx::PgPool, idem_testkit::postgres::PgTestDatabase) {
        let db = idem_testkit::postgres::PgTestDatabase::create().await;
        let pool = db.pool(20).await;
        <sqlx::Postgres as idem_consumer::Database>::migrate(&pool)
            .await
            .unwrap();
        (pool, db)
    }

    suite!(sqlx::Postgres, fresh().await);

    /// Several relays on one PostgreSQL outbox split the work: `FOR UPDATE SKIP LOCKED` hands
    /// each pending row to one relay at a time, so no event is published twice and none is
    /// missed.
    #[tokio::test]
    async fn concurrent_relays_publish_each_event_exactly_once() {
        let (pool, _guard) = fresh().await;
        write_events(&pool, 0..600).await;
        let publisher = RecordingPublisher::default();
        let relays: Vec<_> = (0..4)
            .map(|_| {
                let relay = Relay::new(pool.clone(), publisher.clone()).with_batch(25);
                tokio::spawn(async move {
                    let mut published = 0;
                    loop {
                        let pass = relay.relay_once().await.unwrap();
                        if pass.total() == 0 && relay.backlog().await.unwrap() == 0 {
                            return published;
                        }
                        published += pass.total();
                    }
                })
            })
            .collect();
        let mut per_relay = Vec::new();
        for relay in relays {
            per_relay.push(relay.await.unwrap());
        }
        let mut times: HashMap<String, usize> = HashMap::new();
        for id in publisher.ids() {
            *times.entry(id).or_default() += 1;
        }
        assert_eq!(times.len(), 600, "every event published");
        assert!(times.values().all(|&n| n == 1), "no event published twice");
        assert!(
            per_relay.iter().filter(|&&n| n > 0).count() >= 2,
            "the relays shared the work: {per_relay:?}"
        );
    }
}

/// The same suite with PostgreSQL behind PgBouncer 1.18 in transaction pooling mode (a
/// PgBouncer of the test's own): the migrations, the inbox and the outbox leave nothing on a
/// server session past a transaction.
mod postgres_behind_a_pooler {
    use idem_testkit::pgbouncer::PgBouncer;

    async fn fresh() -> (
        sqlx::PgPool,
        (idem_testkit::postgres::PgTestDatabase, PgBouncer),
    ) {
        let db = idem_testkit::postgres::PgTestDatabase::create().await;
        let bouncer = PgBouncer::start(20);
        // PgBouncer 1.18 refuses sqlx's extra_float_digits startup parameter by default.
        let options: sqlx::postgres::PgConnectOptions = bouncer.url_for(db.url()).parse().unwrap();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(20)
            .connect_with(options.extra_float_digits(None))
            .await
            .unwrap();
        <sqlx::Postgres as idem_consumer::Database>::migrate(&pool)
            .await
            .unwrap();
        (pool, (db, bouncer))
    }

    suite!(sqlx::Postgres, fresh().await);
}
