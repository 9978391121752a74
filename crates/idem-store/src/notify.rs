//! [`OutcomeChannel`]: "this key's outcome changed", told between the processes that share a
//! store.
//!
//! A duplicate that waits for the outcome of a request still in flight (idem-tower's
//! `OutcomeSignal`) is woken directly when its own process stores that outcome. When another
//! process stores it, the news can only travel through the store: whoever stores an outcome
//! publishes the key's label, and every process listens and wakes its own waiters.
//!
//! A wake-up only prompts a waiter to read the store again. So a lost one (a listener
//! reconnecting) costs a waiter its full wait and a `409` at its end, and a spurious one (two
//! keys with one label, a process hearing its own publication) costs a read: never a wrong
//! answer.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::{Result, Store};

/// A store that tells the processes sharing it when a key's outcome changes.
///
/// ```no_run
/// use std::sync::Arc;
/// use idem_store::{OutcomeChannel, PgStore};
/// # async fn demo() -> idem_store::Result<()> {
/// let store = PgStore::connect("postgres://postgres@127.0.0.1/idem").await?;
/// let _listener = store
///     .listen_outcomes(Arc::new(|label: &str| println!("{label} has an outcome")))
///     .await?;
/// // In this process or any other on the same database:
/// store.publish_outcome("3f2a9c01b7e4").await?;
/// # Ok(()) }
/// ```
pub trait OutcomeChannel: Store {
    /// Tells every process listening on this store (this one included) that the outcome of
    /// the key labelled `label` ([`Scope::log_label`](idem_core::Scope::log_label)) changed.
    fn publish_outcome(&self, label: &str) -> impl Future<Output = Result<()>> + Send;

    /// Calls `wake` with every label published on this store from the moment this returns,
    /// until the runtime shuts down or the returned task is aborted. The listener reconnects
    /// by itself after a lost connection; labels published while it was away are not heard.
    fn listen_outcomes(
        &self,
        wake: Arc<dyn Fn(&str) + Send + Sync>,
    ) -> impl Future<Output = Result<JoinHandle<()>>> + Send;

    /// How often a duplicate waiting for an outcome must look at the store again by itself,
    /// because [`listen_outcomes`](Self::listen_outcomes) cannot hear what other processes
    /// publish; `None` (the default) where it can. A [`PgStore`](crate::PgStore) behind a
    /// pooler that lends sessions per transaction, without a notify URL, answers
    /// [`OUTCOME_POLL`].
    fn outcome_poll(&self) -> Option<Duration> {
        None
    }
}

/// How often duplicates that wait for an outcome look at the store again where no
/// notification can reach them ([`OutcomeChannel::outcome_poll`]): a read per waiting
/// duplicate each time, and a wait up to this much longer than the outcome took.
pub const OUTCOME_POLL: Duration = Duration::from_millis(250);

/// How long a listener pauses after failing to reconnect, at first; the pause doubles up to
/// [`MAX_RECONNECT_PAUSE`].
#[cfg(any(feature = "postgres", feature = "redis"))]
const MIN_RECONNECT_PAUSE: Duration = Duration::from_millis(100);

/// The longest pause between a listener's attempts to reconnect.
#[cfg(any(feature = "postgres", feature = "redis"))]
const MAX_RECONNECT_PAUSE: Duration = Duration::from_secs(5);

/// PostgreSQL: `NOTIFY` and `LISTEN` on one channel, `idem_outcome`.
///
/// A notification reaches the sessions listening in the same database only, so one channel
/// name serves every gateway: those on one database share its records, those on others never
/// hear each other. The listener holds one of the pool's connections for as long as it runs;
/// sqlx's `PgListener` reconnects by itself (and listens again) after losing it. When the store
/// moves its pool to another host (a URL with several hosts, after a failover), the listener
/// moves too: left on the old host, it would hear nothing the others publish on the new one.
///
/// `LISTEN` needs a session of its own. Behind a pooler that lends sessions per transaction
/// the listener connects through the store's notify URL ([`PgStore::with_notify_url`]), which
/// leads to PostgreSQL directly; without one nothing is heard, the store says so once in the
/// log, and [`OutcomeChannel::outcome_poll`] tells waiters to look again by themselves.
#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use crate::PgStore;
    use crate::postgres::Listen;
    use sqlx::postgres::{PgListener, PgPoolOptions};
    use tokio::sync::watch;

    /// The channel outcomes are published on; `idem serve` uses the same one.
    const PG_CHANNEL: &str = "idem_outcome";

    type Wake = Arc<dyn Fn(&str) + Send + Sync>;

    impl OutcomeChannel for PgStore {
        async fn publish_outcome(&self, label: &str) -> Result<()> {
            // Delivered as its statement (or its own transaction, behind a pooler) commits.
            let notify = sqlx::query("SELECT pg_notify($1, $2)")
                .persistent(self.persistent())
                .bind(PG_CHANNEL)
                .bind(label);
            let published = crate::postgres::on_session!(self, |conn| notify.execute(conn).await);
            self.watched(self.bounded(published).await)?;
            Ok(())
        }

        async fn listen_outcomes(&self, wake: Wake) -> Result<JoinHandle<()>> {
            let Some(listen_on) = self.listen_options() else {
                tracing::warn!(
                    "PostgreSQL is reached through a pooler and no notify URL was given (idem: \
                     --notify-database-url): duplicates waiting for an outcome look at the store \
                     again every {OUTCOME_POLL:?} instead of being woken"
                );
                return Ok(tokio::spawn(async {}));
            };
            // Watched from before the first listener exists, so no move goes unseen. A notify
            // URL names one host of its own: no move to follow.
            let moves = match listen_on {
                Listen::Pool => self.primary_moves(),
                Listen::Direct(_) => None,
            };
            let pool = match listen_on {
                Listen::Pool => self.pool().clone(),
                // One connection, made when the listener first needs it.
                Listen::Direct(options) => PgPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(Duration::from_secs(5))
                    .connect_lazy_with((*options).clone()),
            };
            let listener = listen(&pool).await.inspect_err(|e| self.notice(e))?;
            Ok(tokio::spawn(relay(
                self.clone(),
                pool,
                listener,
                moves,
                wake,
            )))
        }

        fn outcome_poll(&self) -> Option<Duration> {
            self.listen_options().is_none().then_some(OUTCOME_POLL)
        }
    }

    /// A listener on a connection of `pool`, listening.
    async fn listen(pool: &sqlx::PgPool) -> Result<PgListener, sqlx::Error> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(PG_CHANNEL).await?;
        Ok(listener)
    }

    /// Hands every notification to `wake`; listens anew, on the host the pool moved to, after
    /// each move. Ends when the store's pool is closed.
    async fn relay(
        store: PgStore,
        pool: sqlx::PgPool,
        mut listener: PgListener,
        mut moves: Option<watch::Receiver<usize>>,
        wake: Wake,
    ) {
        while hear(&store, &mut listener, &wake, &mut moves).await {
            // Its connection goes back to the pool, which closes it rather than hand it out
            // again: it leads to the old host.
            drop(listener);
            listener = match listen_again(&store, &pool).await {
                Some(listener) => listener,
                None => return,
            };
        }
    }

    /// Hears on `listener` until the pool moves to another host (`true`) or is closed.
    async fn hear(
        store: &PgStore,
        listener: &mut PgListener,
        wake: &Wake,
        moves: &mut Option<watch::Receiver<usize>>,
    ) -> bool {
        let mut pause = MIN_RECONNECT_PAUSE;
        loop {
            tokio::select! {
                received = listener.recv() => match received {
                    Ok(notification) => {
                        pause = MIN_RECONNECT_PAUSE;
                        wake(notification.payload());
                    }
                    // The store's pool was closed: nothing is left to listen with.
                    Err(sqlx::Error::PoolClosed) => return false,
                    // A lost connection is re-established by the next `recv`; this error
                    // means that failed, so pause before the next try.
                    Err(e) => back_off(store, &e, &mut pause).await,
                },
                () = moved(moves) => return true,
            }
        }
    }

    /// Reports a failure to listen, then waits `pause`, twice as long as the last time.
    async fn back_off(store: &PgStore, error: &sqlx::Error, pause: &mut Duration) {
        store.notice(error);
        tracing::warn!(%error, "cannot listen for outcome wake-ups; retrying");
        tokio::time::sleep(*pause).await;
        *pause = (*pause * 2).min(MAX_RECONNECT_PAUSE);
    }

    /// Completes when the pool moves to another host; never, for a URL with one host.
    async fn moved(moves: &mut Option<watch::Receiver<usize>>) {
        if let Some(moves) = moves
            && moves.changed().await.is_ok()
        {
            return;
        }
        // One host, or the store is gone: no move will come.
        std::future::pending().await
    }

    /// A new listener, once one can be made; `None` when the pool was closed.
    async fn listen_again(store: &PgStore, pool: &sqlx::PgPool) -> Option<PgListener> {
        let mut pause = MIN_RECONNECT_PAUSE;
        loop {
            match listen(pool).await {
                Ok(listener) => return Some(listener),
                Err(sqlx::Error::PoolClosed) => return None,
                Err(e) => back_off(store, &e, &mut pause).await,
            }
        }
    }
}

/// Redis: `PUBLISH` and `SUBSCRIBE` on the channel `{prefix}:outcome`.
///
/// Named from the store's key prefix, so gateways that share one server under different
/// prefixes (and so different records) do not wake each other. Subscribing takes a connection
/// of its own, since a subscribed connection can send nothing else; publishing goes through
/// the store's shared one. Redis keeps no messages for a subscriber that is away, so the
/// listener pings its connection to find out that it is lost (a dead peer may send nothing at
/// all), then reconnects and subscribes again.
#[cfg(feature = "redis")]
mod redis_channel {
    use super::*;
    use crate::RedisStore;
    use crate::redis_store::classify;
    use futures_util::StreamExt;
    use redis::aio::PubSub;
    use redis::{RedisError, RedisResult};

    /// How often the listener checks that its connection still answers.
    const PING_EVERY: Duration = Duration::from_secs(15);

    /// How long a connection attempt or a ping may take before the connection counts as lost.
    const ANSWER_WITHIN: Duration = Duration::from_secs(2);

    impl RedisStore {
        /// The pub/sub channel of this store's outcomes.
        pub(super) fn outcome_channel(&self) -> String {
            format!("{}:outcome", self.prefix)
        }
    }

    impl OutcomeChannel for RedisStore {
        async fn publish_outcome(&self, label: &str) -> Result<()> {
            let _listeners: i64 = self
                .conn
                .query(redis::cmd("PUBLISH").arg(self.outcome_channel()).arg(label))
                .await?;
            Ok(())
        }

        async fn listen_outcomes(
            &self,
            wake: Arc<dyn Fn(&str) + Send + Sync>,
        ) -> Result<JoinHandle<()>> {
            let channel = self.outcome_channel();
            // Subscribed before returning, so every label published from then on is heard.
            let pubsub = subscribe(&self.clients, &channel).await.map_err(classify)?;
            Ok(tokio::spawn(relay(
                self.clients.clone(),
                channel,
                pubsub,
                wake,
            )))
        }
    }

    /// A new connection subscribed to `channel`, to the first of `clients` that answers. A
    /// cluster passes every `PUBLISH` to all its nodes, so any one of them hears them all.
    pub(super) async fn subscribe(clients: &[redis::Client], channel: &str) -> RedisResult<PubSub> {
        let mut failed = None;
        for client in clients {
            match subscribe_to(client, channel).await {
                Ok(pubsub) => return Ok(pubsub),
                Err(e) => failed = Some(e),
            }
        }
        Err(failed.unwrap_or_else(timed_out_error))
    }

    async fn subscribe_to(client: &redis::Client, channel: &str) -> RedisResult<PubSub> {
        let mut pubsub = tokio::time::timeout(ANSWER_WITHIN, client.get_async_pubsub())
            .await
            .map_err(timed_out)??;
        pubsub.subscribe(channel).await?;
        Ok(pubsub)
    }

    fn timed_out(_: tokio::time::error::Elapsed) -> RedisError {
        timed_out_error()
    }

    fn timed_out_error() -> RedisError {
        std::io::Error::from(std::io::ErrorKind::TimedOut).into()
    }

    /// Hands every message on `pubsub` to `wake`; when its connection is lost, subscribes
    /// again on a new one.
    async fn relay(
        clients: Vec<redis::Client>,
        channel: String,
        mut pubsub: PubSub,
        wake: Arc<dyn Fn(&str) + Send + Sync>,
    ) {
        loop {
            let (mut sink, mut messages) = pubsub.split();
            let mut pings = tokio::time::interval(PING_EVERY);
            pings.tick().await;
            loop {
                tokio::select! {
                    message = messages.next() => match message {
                        Some(message) => {
                            wake(&String::from_utf8_lossy(message.get_payload_bytes()));
                        }
                        // The connection closed.
                        None => break,
                    },
                    _ = pings.tick() => {
                        let answered = tokio::time::timeout(ANSWER_WITHIN, sink.ping::<redis::Value>()).await;
                        if !matches!(answered, Ok(Ok(_))) {
                            break;
                        }
                    }
                }
            }
            tracing::warn!("lost the connection that hears outcome wake-ups; reconnecting");
            let mut pause = MIN_RECONNECT_PAUSE;
            pubsub = loop {
                match subscribe(&clients, &channel).await {
                    Ok(pubsub) => break pubsub,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot subscribe to outcome wake-ups; retrying");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(MAX_RECONNECT_PAUSE);
                    }
                }
            };
        }
    }
}

/// SQLite: nothing to tell, so publishing does nothing and the listener ends at once.
///
/// An SQLite file is the store of the one process that serves requests from it (others that
/// open it, such as `idem keys`, store no outcomes), and that process's own signal already wakes
/// its waiters. Two gateways serving from one file would not wake each other: a duplicate on
/// one would wait out its bound for an outcome stored by the other, then answer `409`.
#[cfg(feature = "sqlite")]
impl OutcomeChannel for crate::SqliteStore {
    async fn publish_outcome(&self, _label: &str) -> Result<()> {
        Ok(())
    }

    async fn listen_outcomes(
        &self,
        _wake: Arc<dyn Fn(&str) + Send + Sync>,
    ) -> Result<JoinHandle<()>> {
        Ok(tokio::spawn(async {}))
    }
}

#[cfg(all(test, any(feature = "postgres", feature = "redis", feature = "sqlite")))]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    type Wake = Arc<dyn Fn(&str) + Send + Sync>;

    /// A `wake` that sends each label it is given, and the receiving end.
    fn heard() -> (Wake, mpsc::UnboundedReceiver<String>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let wake = Arc::new(move |label: &str| {
            let _ = tx.send(label.to_owned());
        });
        (wake, rx)
    }

    /// The next label heard, within a bound far above any delivery time.
    #[cfg(any(feature = "postgres", feature = "redis"))]
    async fn next(rx: &mut mpsc::UnboundedReceiver<String>) -> String {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("a label within 10 s")
            .expect("the listener is alive")
    }

    #[cfg(all(feature = "postgres", feature = "conformance"))]
    #[tokio::test]
    async fn postgres_tells_every_store_on_the_database() {
        let db = idem_testkit::postgres::PgTestDatabase::create().await;
        let (one, two) = (
            crate::PgStore::from_pool(db.pool(2).await)
                .await
                .expect("migrate the test database"),
            crate::PgStore::from_pool(db.pool(2).await)
                .await
                .expect("migrate the test database"),
        );
        let (wake, mut rx) = heard();
        let listener = one.listen_outcomes(wake).await.unwrap();
        two.publish_outcome("label-from-two").await.unwrap();
        one.publish_outcome("label-from-one").await.unwrap();
        assert_eq!(next(&mut rx).await, "label-from-two");
        assert_eq!(next(&mut rx).await, "label-from-one");
        listener.abort();
    }

    /// A store on two hosts (relays to the test server) follows the first one's loss to the
    /// second, and so does its listener: a label published there is heard.
    #[cfg(all(feature = "postgres", feature = "conformance"))]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_postgres_listener_follows_the_pool_to_another_host() {
        use idem_testkit::fault_relay::FaultRelay;
        use sqlx::postgres::PgConnectOptions;

        let db = idem_testkit::postgres::PgTestDatabase::create().await;
        let direct: PgConnectOptions = db.url().parse().unwrap();
        let relay = || FaultRelay::start_to(direct.get_host(), direct.get_port(), 0);
        let (a, b) = (relay().await.unwrap(), relay().await.unwrap());
        let url = idem_testkit::postgres::with_hosts(db.url(), &[a.addr(), b.addr()], "");
        let store = crate::PgStore::connect(&url).await.unwrap();
        let elsewhere = crate::PgStore::from_pool(db.pool(2).await)
            .await
            .expect("migrate the test database");
        let (wake, mut rx) = heard();
        let listener = store.listen_outcomes(wake).await.unwrap();
        let mut moves = store.primary_moves().expect("several hosts");

        a.cut().await;
        // Finds the host gone, so sets off the search for the primary.
        assert!(store.publish_outcome("lost").await.is_err());
        tokio::time::timeout(Duration::from_secs(10), moves.changed())
            .await
            .expect("a move within 10 s")
            .unwrap();
        // PostgreSQL tells nobody when a session starts to listen: publish until it hears.
        let label = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                elsewhere.publish_outcome("after-the-move").await.unwrap();
                if let Ok(label) = tokio::time::timeout(Duration::from_millis(100), rx.recv()).await
                {
                    return label.expect("the listener is alive");
                }
            }
        })
        .await
        .expect("heard within 10 s");
        assert_eq!(label, "after-the-move");
        listener.abort();
    }

    #[cfg(feature = "redis")]
    fn redis_url() -> String {
        std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }

    /// A store under a prefix of its own. Publishing and subscribing write no keys, so there
    /// is nothing to delete afterwards.
    #[cfg(feature = "redis")]
    async fn redis_store(prefix: &str) -> crate::RedisStore {
        crate::RedisStore::connect(&redis_url(), prefix)
            .await
            .expect("the test Redis (set IDEM_TEST_REDIS_URL)")
    }

    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn redis_tells_the_stores_of_one_prefix_only() {
        let prefix = format!("idem-test-{}", uuid::Uuid::new_v4().simple());
        let (one, two) = (redis_store(&prefix).await, redis_store(&prefix).await);
        let other = redis_store(&format!("{prefix}-other")).await;
        let (wake, mut rx) = heard();
        let listener = one.listen_outcomes(wake).await.unwrap();
        // Published first, so were it heard it would arrive first.
        other.publish_outcome("another-prefix").await.unwrap();
        two.publish_outcome("label-from-two").await.unwrap();
        assert_eq!(next(&mut rx).await, "label-from-two");
        listener.abort();
    }

    /// The listener's liveness check: a subscribed connection answers `PING`.
    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn a_subscribed_redis_connection_answers_a_ping() {
        let store = redis_store(&format!("idem-test-{}", uuid::Uuid::new_v4().simple())).await;
        let pubsub = redis_channel::subscribe(&store.clients, &store.outcome_channel())
            .await
            .unwrap();
        let (mut sink, _messages) = pubsub.split();
        let _: redis::Value = sink.ping().await.unwrap();
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn sqlite_publishes_nothing_and_its_listener_ends_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::SqliteStore::open(dir.path().join("notify.db"))
            .await
            .unwrap();
        let (wake, mut rx) = heard();
        let listener = store.listen_outcomes(wake).await.unwrap();
        store.publish_outcome("label").await.unwrap();
        listener.await.unwrap();
        // The listener, and with it the only sender, is gone without a word.
        assert_eq!(rx.recv().await, None);
    }
}
