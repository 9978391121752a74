//! What the tests of the two PostgreSQL stores share ([`PgStore`] on sqlx, [`TokioPgStore`] on
//! tokio-postgres): the test's values, and the behaviours of transaction mode that both must
//! show on a real server, written once and run against each by [`pg_transaction_tests!`].

use std::time::Duration;

use idem_core::{
    AccountId, Decision, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Policy, RecordState,
    RequestParts, Scope, StoredResponse, Timestamp, decide,
};
#[cfg(feature = "tokio-postgres")]
use idem_store::TokioPgStore;
use idem_store::{NewClaim, PgStore, Result, TransactionalStore, TxClaim};
use idem_testkit::postgres::PgTestDatabase;
use sqlx::PgPool;

pub(crate) const T0: Timestamp = Timestamp(1_800_000_000_000);

/// Long enough never to run out in a test that expects no timeout.
pub(crate) const LONG_WAIT: Duration = Duration::from_secs(10);

pub(crate) fn scope(key: &str) -> Scope {
    Scope::new(
        AccountId::new("acct_pg"),
        IdempotencyKey::new(key, KeyLimits::default()).expect("valid test key"),
    )
}

pub(crate) fn fingerprint() -> Fingerprint {
    Fingerprint::compute(&RequestParts {
        account: "acct_pg",
        method: "POST",
        route: "/payments",
        query: "",
        content_type: "application/json",
        body: br#"{"amount":49900,"currency":"INR"}"#,
    })
    .expect("valid test body")
}

pub(crate) fn claim(scope: &Scope, token: i64) -> NewClaim {
    NewClaim::new(
        scope.clone(),
        fingerprint(),
        FencingToken(token),
        T0,
        &Policy::default(),
    )
}

pub(crate) fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/payments/pay_1".into()),
        ],
        body: br#"{"id":"pay_1"}"#.to_vec(),
        body_omitted: false,
    }
}

/// A PostgreSQL store under test, and what the shared tests ask of it beyond the store traits.
pub(crate) trait PgTestStore: TransactionalStore {
    /// A store on `db` whose transactions share at most `max` connections.
    async fn with_connections(db: &PgTestDatabase, max: usize) -> Self;

    /// A sqlx pool on the store's database, for what the tests read beside the store.
    fn sqlx_pool(&self) -> &PgPool;

    /// The `lock_timeout` in force inside `tx`.
    async fn lock_timeout_in(tx: &mut Self::Tx) -> String;

    /// Whether a pooled connection of the store's transactions is outside any transaction:
    /// then two statements get two transaction ids; in a transaction left open they share one.
    /// With one connection, it is the one every step before used.
    async fn connection_is_idle(&self) -> bool;
}

impl PgTestStore for PgStore {
    async fn with_connections(db: &PgTestDatabase, max: usize) -> Self {
        PgStore::from_pool(db.pool(max as u32).await)
            .await
            .expect("migrate the test database")
    }

    fn sqlx_pool(&self) -> &PgPool {
        self.pool()
    }

    async fn lock_timeout_in(tx: &mut idem_store::PgTx) -> String {
        sqlx::query_scalar("SELECT current_setting('lock_timeout')")
            .fetch_one(&mut **tx)
            .await
            .unwrap()
    }

    async fn connection_is_idle(&self) -> bool {
        let xid = || {
            sqlx::query_scalar::<_, String>("SELECT pg_current_xact_id()::text")
                .fetch_one(self.pool())
        };
        xid().await.expect("ask the connection") != xid().await.expect("ask the connection")
    }
}

#[cfg(feature = "tokio-postgres")]
impl PgTestStore for TokioPgStore {
    async fn with_connections(db: &PgTestDatabase, max: usize) -> Self {
        TokioPgStore::connect(db.url())
            .await
            .expect("connect the store")
            .with_pool_size(max)
    }

    fn sqlx_pool(&self) -> &PgPool {
        self.pg_store().pool()
    }

    async fn lock_timeout_in(tx: &mut idem_store::TokioPgTx) -> String {
        let row = tx
            .query_one("SELECT current_setting('lock_timeout')", &[])
            .await
            .unwrap();
        row.get(0)
    }

    async fn connection_is_idle(&self) -> bool {
        let client = self.client().await.expect("a pooled connection");
        let xid = || async {
            let row = client
                .query_one("SELECT pg_current_xact_id()::text", &[])
                .await
                .expect("ask the connection");
            row.get::<_, String>(0)
        };
        xid().await != xid().await
    }
}

pub(crate) async fn begin_claimed<S: TransactionalStore>(store: &S, claim: &NewClaim) -> S::Tx {
    match store
        .begin_claim(claim, LONG_WAIT)
        .await
        .expect("begin_claim")
    {
        TxClaim::Claimed(tx) => tx,
        other => panic!("expected to claim the key, got {other:?}"),
    }
}

/// How many sessions of the test database are blocked on a lock, by the server's own view of
/// its sessions.
pub(crate) async fn sessions_waiting_on_a_lock(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(pool)
    .await
    .expect("read pg_stat_activity")
}

/// Waits until `n` sessions of the test database are blocked on a lock. PostgreSQL announces
/// no such event, so this watches the server's own view of its sessions (with a deadline)
/// rather than guessing with a sleep.
pub(crate) async fn lock_waiters(pool: &PgPool, n: i64) {
    let deadline = tokio::time::Instant::now() + LONG_WAIT;
    let mut poll = tokio::time::interval(Duration::from_millis(10));
    loop {
        poll.tick().await;
        if sessions_waiting_on_a_lock(pool).await >= n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no session started waiting for the key"
        );
    }
}

/// The first transaction to claim `key` (token 1), and a duplicate (token 2) spawned to claim
/// it too, once it is blocked on the first one's row.
async fn first_and_a_waiting_duplicate<S: PgTestStore>(
    store: &S,
    key: &Scope,
) -> (S::Tx, tokio::task::JoinHandle<Result<TxClaim<S::Tx>>>) {
    let first = begin_claimed(store, &claim(key, 1)).await;
    let waiter = tokio::spawn({
        let (store, claim) = (store.clone(), claim(key, 2));
        async move { store.begin_claim(&claim, LONG_WAIT).await }
    });
    lock_waiters(store.sqlx_pool(), 1).await;
    (first, waiter)
}

/// A duplicate waiting on an open transaction gets `Busy` once its lock_timeout passes, and
/// gives its connection back at once. (Two connections: the first transaction's and the
/// duplicate's.)
pub(crate) async fn busy_after_lock_timeout_frees_the_connection<S: PgTestStore>(
    db: PgTestDatabase,
) {
    let store = S::with_connections(&db, 2).await;
    // Both connections opened first: the duplicate's 300 ms must go to the lock, not to
    // connecting to a loaded server (with the pool not full, a wait that runs out while
    // connecting is `Unavailable`).
    let warm = (
        claim(&scope("busy-warm-0001"), 1),
        claim(&scope("busy-warm-0002"), 1),
    );
    let (one, two) = tokio::join!(
        begin_claimed(&store, &warm.0),
        begin_claimed(&store, &warm.1)
    );
    store.rollback(one).await.unwrap();
    store.rollback(two).await.unwrap();
    let key = scope("busy-key-0001");
    let first = begin_claimed(&store, &claim(&key, 1)).await;
    let wait = Duration::from_millis(300);
    let started = std::time::Instant::now();
    // Bounded only so that a wait that ignores its bound fails instead of hanging (the first
    // transaction never ends): a loaded server adds to the wait, so the bound is far past it.
    let second = tokio::time::timeout(LONG_WAIT, store.begin_claim(&claim(&key, 2), wait))
        .await
        .expect("the duplicate waited far past its wait")
        .unwrap();
    let waited = started.elapsed();
    assert!(matches!(second, TxClaim::Busy), "got {second:?}");
    assert!(waited >= wait, "gave up after {waited:?}, before its wait");
    assert_eq!(
        sessions_waiting_on_a_lock(store.sqlx_pool()).await,
        0,
        "a session still waits for the key"
    );
    // The duplicate's connection is free: with the first transaction holding the other one,
    // this claim gets a connection only if the duplicate gave its back. Had it kept it, the
    // claim would wait for a connection until LONG_WAIT and end in `Busy` (or `Unavailable`),
    // as the first transaction is still open.
    let other = match store
        .begin_claim(&claim(&scope("busy-key-0002"), 3), LONG_WAIT)
        .await
    {
        Ok(TxClaim::Claimed(tx)) => tx,
        other => panic!("the duplicate's connection did not go back to the pool: {other:?}"),
    };
    store.rollback(other).await.unwrap();
    store.rollback(first).await.unwrap();
}

/// With every connection taken by transactions on the key, a duplicate's wait for a
/// connection is bounded by the same wait and also ends in `Busy`, not `503`.
pub(crate) async fn busy_when_no_connection_is_free<S: PgTestStore>(db: PgTestDatabase) {
    let store = S::with_connections(&db, 1).await;
    let key = scope("busy-key-0003");
    let first = begin_claimed(&store, &claim(&key, 1)).await;
    let second = store
        .begin_claim(&claim(&key, 2), Duration::from_millis(200))
        .await
        .unwrap();
    assert!(matches!(second, TxClaim::Busy), "got {second:?}");
    store.rollback(first).await.unwrap();
}

/// The first transaction rolls back while a duplicate waits: the duplicate claims the key, and
/// its transaction runs under the session's lock_timeout, not the claim's.
pub(crate) async fn a_waiting_duplicate_claims_when_the_first_rolls_back<S: PgTestStore>(
    db: PgTestDatabase,
) {
    let store = S::with_connections(&db, 4).await;
    let key = scope("rollback-key1");
    let (first, waiter) = first_and_a_waiting_duplicate(&store, &key).await;
    store.rollback(first).await.unwrap();
    let TxClaim::Claimed(mut tx) = waiter.await.unwrap().unwrap() else {
        panic!("the duplicate must claim the key the first one gave up")
    };
    // The store's own lock timeout for the transaction's statements, not the claim's wait.
    assert_eq!(
        S::lock_timeout_in(&mut tx).await,
        "5s",
        "the claim's lock_timeout leaked into the handler's transaction"
    );
    store
        .commit_response(tx, &key, FencingToken(2), &response())
        .await
        .unwrap();
    let record = store
        .get(&key, T0)
        .await
        .unwrap()
        .expect("committed record");
    assert_eq!(record.state, RecordState::Completed(response()));
}

/// The first transaction commits while a duplicate waits: the duplicate gets the completed
/// record, to replay.
pub(crate) async fn a_waiting_duplicate_replays_when_the_first_commits<S: PgTestStore>(
    db: PgTestDatabase,
) {
    let store = S::with_connections(&db, 4).await;
    let key = scope("commit-key-01");
    let (first, waiter) = first_and_a_waiting_duplicate(&store, &key).await;
    store
        .commit_response(first, &key, FencingToken(1), &response())
        .await
        .unwrap();
    match waiter.await.unwrap().unwrap() {
        TxClaim::Existing(record) => {
            assert_eq!(record.state, RecordState::Completed(response()));
            assert_eq!(
                decide(Some(&record), &fingerprint(), T0),
                Decision::Replay(&response())
            );
        }
        other => panic!("expected the committed record, got {other:?}"),
    }
}

/// Accounts, keys, headers and bodies with quotes, backslashes, dollar signs, non-ASCII text
/// and every byte value go through transaction mode and come back exactly, and the key
/// claimed is that one key, no other.
pub(crate) async fn transaction_mode_stores_any_account_key_and_response_exactly<S: PgTestStore>(
    db: PgTestDatabase,
) {
    let store = S::with_connections(&db, 1).await;
    let account = "o'brien \\ $$ \"chef\" ☃ --";
    let key = IdempotencyKey::new("k'ey\\$$;--\"x", KeyLimits::default()).expect("valid key");
    let scope = Scope::new(AccountId::new(account), key);
    let response = StoredResponse {
        status: 402,
        headers: vec![("x-note".into(), "it's \\ \"quoted\" ☃ $$".into())],
        body: (0..=255u8).collect(),
        body_omitted: false,
    };
    let tx = begin_claimed(&store, &claim(&scope, -7)).await;
    store
        .commit_response(tx, &scope, FencingToken(-7), &response)
        .await
        .expect("commit");

    let record = store.get(&scope, T0).await.unwrap().expect("the record");
    assert_eq!(record.scope.account.as_str(), account);
    assert_eq!(record.fingerprint, fingerprint());
    assert_eq!(record.state, RecordState::Completed(response.clone()));
    // The duplicate's claim finds it rather than claiming anew.
    match store
        .begin_claim(&claim(&scope, 8), LONG_WAIT)
        .await
        .unwrap()
    {
        // Read twice, a time apart: the same record, its times aside.
        TxClaim::Existing(found) => {
            assert_eq!(
                (&found.scope, found.fingerprint, &found.state),
                (&record.scope, record.fingerprint, &record.state)
            );
        }
        other => panic!("expected the committed record, got {other:?}"),
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(store.sqlx_pool())
        .await
        .unwrap();
    assert_eq!(rows, 1, "one key row, the one named");
    assert!(store.connection_is_idle().await);
}

/// After a commit, a rollback, a lost claim and a transaction dropped unfinished (a handler
/// that panicked), no pooled connection is left inside a transaction, and what should have
/// committed did, alone. (One connection, so every step runs on the one the step before
/// returned.)
pub(crate) async fn every_ending_leaves_no_connection_in_a_transaction<S: PgTestStore>(
    db: PgTestDatabase,
) {
    let store = S::with_connections(&db, 1).await;
    assert!(store.connection_is_idle().await, "at first");
    let (committed, dropped, rolled_back) = (
        scope("ends-commit-1"),
        scope("ends-dropped-1"),
        scope("ends-rolled-1"),
    );
    let tx = begin_claimed(&store, &claim(&committed, 1)).await;
    store
        .commit_response(tx, &committed, FencingToken(1), &response())
        .await
        .unwrap();
    assert!(store.connection_is_idle().await, "after a commit");

    let tx = begin_claimed(&store, &claim(&rolled_back, 2)).await;
    store.rollback(tx).await.unwrap();
    assert!(store.connection_is_idle().await, "after a rollback");

    let lost = store
        .begin_claim(&claim(&committed, 3), LONG_WAIT)
        .await
        .unwrap();
    assert!(matches!(lost, TxClaim::Existing(_)), "got {lost:?}");
    assert!(store.connection_is_idle().await, "after a lost claim");

    drop(begin_claimed(&store, &claim(&dropped, 4)).await);
    assert!(store.connection_is_idle().await, "after a drop");

    assert!(store.get(&committed, T0).await.unwrap().is_some());
    assert!(store.get(&rolled_back, T0).await.unwrap().is_none());
    assert!(store.get(&dropped, T0).await.unwrap().is_none());
}

/// Writes one `#[tokio::test]` per shared test above, on a fresh database, for `$store`.
macro_rules! pg_transaction_tests {
    ($store:ty) => {
        $crate::common::pg::pg_transaction_tests!(@each $store;
            busy_after_lock_timeout_frees_the_connection,
            busy_when_no_connection_is_free,
            a_waiting_duplicate_claims_when_the_first_rolls_back,
            a_waiting_duplicate_replays_when_the_first_commits,
            transaction_mode_stores_any_account_key_and_response_exactly,
            every_ending_leaves_no_connection_in_a_transaction,
        );
    };
    (@each $store:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let db = idem_testkit::postgres::PgTestDatabase::create().await;
                $crate::common::pg::$name::<$store>(db).await;
            }
        )*
    };
}
pub(crate) use pg_transaction_tests;
