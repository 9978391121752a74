//! The conformance suite and the pipelined transaction against [`TokioPgStore`], each test in a
//! database of its own on the server at `IDEM_TEST_PG_URL` (default: the local server, trust
//! authentication), created for the test and dropped when it ends, pass or fail.

#![cfg(feature = "tokio-postgres")]

use std::time::Duration;

use idem_core::{
    AccountId, Decision, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Policy, RecordState,
    RequestParts, Scope, StoredResponse, Timestamp, decide,
};
use idem_store::conformance::assert_unavailable;
use idem_store::fault_relay::FaultRelay;
use idem_store::testing::PgTestDatabase;
use idem_store::{
    ClaimOutcome, NewClaim, Result, Store, TokioPgStore, TokioPgTx, TransactionalStore, TxClaim,
    admin_conformance, store_conformance, transactional_conformance,
};

const T0: Timestamp = Timestamp(1_800_000_000_000);

/// Long enough never to run out in a test that expects no timeout.
const LONG_WAIT: Duration = Duration::from_secs(10);

async fn fresh_store() -> (TokioPgStore, PgTestDatabase) {
    let db = PgTestDatabase::create().await;
    let store = TokioPgStore::connect(db.url())
        .await
        .expect("connect the store");
    (store, db)
}

store_conformance!(fresh_store());
transactional_conformance!(fresh_store());
admin_conformance!(fresh_store());

/// A database of the test's own and a store whose transactions share at most `max`
/// connections.
async fn store_of_its_own(max: usize) -> (TokioPgStore, PgTestDatabase) {
    let (store, db) = fresh_store().await;
    (store.with_pool_size(max), db)
}

fn scope(key: &str) -> Scope {
    Scope::new(
        AccountId::new("acct_pg"),
        IdempotencyKey::new(key, KeyLimits::default()).expect("valid test key"),
    )
}

fn fingerprint() -> Fingerprint {
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

fn claim(scope: &Scope, token: i64) -> NewClaim {
    NewClaim::new(
        scope.clone(),
        fingerprint(),
        FencingToken(token),
        T0,
        &Policy::default(),
    )
}

fn response() -> StoredResponse {
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

async fn begin_claimed(store: &TokioPgStore, claim: &NewClaim) -> TokioPgTx {
    match store
        .begin_claim(claim, LONG_WAIT)
        .await
        .expect("begin_claim")
    {
        TxClaim::Claimed(tx) => tx,
        other => panic!("expected to claim the key, got {other:?}"),
    }
}

/// How many sessions of `store`'s database wait on a lock, by the server's own view.
async fn sessions_waiting_on_a_lock(store: &TokioPgStore) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(store.pg_store().pool())
    .await
    .expect("read pg_stat_activity")
}

/// The first transaction to claim `key` (token 1), and a duplicate (token 2) spawned to claim
/// it too, once the server shows it blocked on the first one's row. PostgreSQL announces no
/// such event, so this watches its sessions, with a deadline, rather than guess with a sleep.
async fn first_and_a_waiting_duplicate(
    store: &TokioPgStore,
    key: &Scope,
) -> (
    TokioPgTx,
    tokio::task::JoinHandle<Result<TxClaim<TokioPgTx>>>,
) {
    let first = begin_claimed(store, &claim(key, 1)).await;
    let waiter = tokio::spawn({
        let (store, claim) = (store.clone(), claim(key, 2));
        async move { store.begin_claim(&claim, LONG_WAIT).await }
    });
    let deadline = tokio::time::Instant::now() + LONG_WAIT;
    let mut poll = tokio::time::interval(Duration::from_millis(10));
    while sessions_waiting_on_a_lock(store).await < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the duplicate never waited"
        );
        poll.tick().await;
    }
    (first, waiter)
}

/// The first transaction commits while a duplicate waits on its row: the duplicate gets the
/// committed record (the claim wrote and locked nothing), to replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_duplicate_replays_when_the_first_commits() {
    let (store, _db) = store_of_its_own(4).await;
    let key = scope("commit-key-01");
    let (first, waiter) = first_and_a_waiting_duplicate(&store, &key).await;
    store
        .commit_response(first, &key, FencingToken(1), &response())
        .await
        .unwrap();
    match waiter.await.unwrap().unwrap() {
        TxClaim::Existing(record) => assert_eq!(
            decide(Some(&record), &fingerprint(), T0),
            Decision::Replay(&response())
        ),
        other => panic!("expected the committed record, got {other:?}"),
    }
}

/// The first transaction rolls back while a duplicate waits: the duplicate claims the key, and
/// the handler's statements after the claim run under the session's `lock_timeout`, not the
/// claim's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_duplicate_claims_when_the_first_rolls_back() {
    let (store, _db) = store_of_its_own(4).await;
    let key = scope("rollback-key1");
    let (first, waiter) = first_and_a_waiting_duplicate(&store, &key).await;
    store.rollback(first).await.unwrap();
    let TxClaim::Claimed(tx) = waiter.await.unwrap().unwrap() else {
        panic!("the duplicate must claim the key the first one gave up")
    };
    let row = tx
        .query_one("SELECT current_setting('lock_timeout')", &[])
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, String>(0),
        "0",
        "the claim's lock_timeout leaked into the handler's transaction"
    );
    store
        .commit_response(tx, &key, FencingToken(2), &response())
        .await
        .unwrap();
    let record = store.get(&key).await.unwrap().expect("committed record");
    assert_eq!(record.state, RecordState::Completed(response()));
}

/// A duplicate waiting on an open transaction gets `Busy` once its wait passes, and gives its
/// connection back at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busy_after_lock_timeout_frees_the_connection() {
    let (store, _db) = store_of_its_own(2).await;
    let key = scope("busy-key-0001");
    let first = begin_claimed(&store, &claim(&key, 1)).await;
    let wait = Duration::from_millis(300);
    let started = std::time::Instant::now();
    let second = store.begin_claim(&claim(&key, 2), wait).await.unwrap();
    let waited = started.elapsed();
    assert!(matches!(second, TxClaim::Busy), "got {second:?}");
    assert!(waited >= wait, "gave up after {waited:?}, before its wait");
    assert!(
        waited < wait + Duration::from_secs(3),
        "gave up only after {waited:?}"
    );
    assert_eq!(sessions_waiting_on_a_lock(&store).await, 0);
    // The second connection is free: a third transaction gets it at once.
    let other = tokio::time::timeout(
        Duration::from_secs(1),
        begin_claimed(&store, &claim(&scope("busy-key-0002"), 3)),
    )
    .await
    .expect("the duplicate's connection went back to the pool");
    store.rollback(other).await.unwrap();
    store.rollback(first).await.unwrap();
}

/// With every connection taken by transactions, a duplicate's wait for one is bounded by the
/// same wait and ends in `Busy`, not `503`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busy_when_no_connection_is_free() {
    let (store, _db) = store_of_its_own(1).await;
    let key = scope("busy-key-0003");
    let first = begin_claimed(&store, &claim(&key, 1)).await;
    let second = store
        .begin_claim(&claim(&key, 2), Duration::from_millis(200))
        .await
        .unwrap();
    assert!(matches!(second, TxClaim::Busy), "got {second:?}");
    store.rollback(first).await.unwrap();
}

/// Whether the pool's one connection is outside any transaction: then two statements get two
/// transaction ids; in a transaction left open they share one.
async fn connection_is_idle(store: &TokioPgStore) -> bool {
    let client = store.client().await.expect("a pooled connection");
    let xid = || async {
        let row = client
            .query_one("SELECT pg_current_xact_id()::text", &[])
            .await
            .expect("ask the connection");
        row.get::<_, String>(0)
    };
    xid().await != xid().await
}

/// After a commit, a rollback, a lost claim and a transaction dropped open (a handler that
/// panicked), no pooled connection is left inside a transaction, and what should have
/// committed did, alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_ending_leaves_no_connection_in_a_transaction() {
    let (store, _db) = store_of_its_own(1).await;
    assert!(connection_is_idle(&store).await, "at first");
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
    assert!(connection_is_idle(&store).await, "after a commit");

    let tx = begin_claimed(&store, &claim(&rolled_back, 2)).await;
    store.rollback(tx).await.unwrap();
    assert!(connection_is_idle(&store).await, "after a rollback");

    let lost = store
        .begin_claim(&claim(&committed, 3), LONG_WAIT)
        .await
        .unwrap();
    assert!(matches!(lost, TxClaim::Existing(_)), "got {lost:?}");
    assert!(connection_is_idle(&store).await, "after a lost claim");

    drop(begin_claimed(&store, &claim(&dropped, 4)).await);
    assert!(connection_is_idle(&store).await, "after a drop");

    assert!(store.get(&committed).await.unwrap().is_some());
    assert!(store.get(&rolled_back).await.unwrap().is_none());
    assert!(store.get(&dropped).await.unwrap().is_none());
}

/// The handler's writes commit with the key's response, in one transaction: a business row
/// written through the transaction is there after the commit, and gone after a rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn handler_writes_commit_and_roll_back_with_the_key() {
    let (store, _db) = store_of_its_own(2).await;
    sqlx::raw_sql("CREATE TABLE notes (key text PRIMARY KEY)")
        .execute(store.pg_store().pool())
        .await
        .unwrap();
    let (kept, undone) = (scope("notes-key-kept"), scope("notes-key-undone"));
    let tx = begin_claimed(&store, &claim(&kept, 1)).await;
    note(&tx, "kept").await;
    store
        .commit_response(tx, &kept, FencingToken(1), &response())
        .await
        .unwrap();
    let tx = begin_claimed(&store, &claim(&undone, 2)).await;
    note(&tx, "undone").await;
    store.rollback(tx).await.unwrap();

    let notes: Vec<String> = sqlx::query_scalar("SELECT key FROM notes")
        .fetch_all(store.pg_store().pool())
        .await
        .unwrap();
    assert_eq!(notes, ["kept"]);
    assert!(store.get(&undone).await.unwrap().is_none());
}

/// The response is stored only in the transaction's own key row. When the handler deleted that
/// row, the commit fails as raced and rolls everything back: the handler's writes never commit
/// without their key's response, though the `COMMIT` was already on its way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_row_gone_from_its_transaction_commits_nothing() {
    let (store, _db) = store_of_its_own(1).await;
    sqlx::raw_sql("CREATE TABLE notes (key text PRIMARY KEY)")
        .execute(store.pg_store().pool())
        .await
        .unwrap();
    let key = scope("vanishing-key1");
    let tx = begin_claimed(&store, &claim(&key, 1)).await;
    tx.execute("INSERT INTO notes VALUES ('orphan')", &[])
        .await
        .unwrap();
    tx.execute("DELETE FROM idempotency_keys", &[])
        .await
        .unwrap();
    let committed = store
        .commit_response(tx, &key, FencingToken(1), &response())
        .await;
    assert!(
        matches!(committed, Err(idem_store::Error::Raced(_))),
        "got {committed:?}"
    );
    let notes: i64 = sqlx::query_scalar("SELECT count(*) FROM notes")
        .fetch_one(store.pg_store().pool())
        .await
        .unwrap();
    assert_eq!(notes, 0, "the handler's write committed without its key");
    assert!(connection_is_idle(&store).await);
}

/// Counts round trips through a relay: a first request (claim, one statement of the handler's,
/// response) costs three, a replay one (its `ROLLBACK` rides ahead of the next request's
/// statements), once each connection has prepared its statements.
/// A current-thread runtime, so that the client's connection task runs only when the request
/// has sent all it pipelines, as it does on a busy server: the count is exact.
#[tokio::test(flavor = "current_thread")]
async fn a_first_request_is_three_round_trips_and_a_replay_one() {
    let db = PgTestDatabase::create().await;
    let direct: sqlx::postgres::PgConnectOptions = db.url().parse().unwrap();
    let relay = FaultRelay::start_to(direct.get_host(), direct.get_port(), 0)
        .await
        .unwrap();
    let url = idem_store::testing::with_hosts(db.url(), &[relay.addr()], "");
    let store = TokioPgStore::connect(&url).await.unwrap().with_pool_size(1);
    sqlx::raw_sql("CREATE TABLE notes (key text PRIMARY KEY)")
        .execute(store.pg_store().pool())
        .await
        .unwrap();
    let first_request = |key: &'static str, token: i64| {
        let store = store.clone();
        async move {
            let key = scope(key);
            let tx = begin_claimed(&store, &claim(&key, token)).await;
            let insert = tx
                .prepare_cached("INSERT INTO notes VALUES ($1)")
                .await
                .unwrap();
            tx.execute(&insert, &[&key.key.as_str()]).await.unwrap();
            store
                .commit_response(tx, &key, FencingToken(token), &response())
                .await
                .unwrap();
            key
        }
    };
    let replay = |key: Scope| {
        let store = store.clone();
        async move {
            let found = store.begin_claim(&claim(&key, 99), LONG_WAIT).await;
            assert!(matches!(found.unwrap(), TxClaim::Existing(_)));
        }
    };
    // The first of each prepares the statements on the pool's one connection.
    replay(first_request("warm-up-key-1", 1).await).await;

    let before = relay.stats().round_trips;
    let key = first_request("counted-key-1", 2).await;
    let after_first = relay.stats().round_trips;
    replay(key.clone()).await;
    let after_replay = relay.stats().round_trips;
    // Two replays in a row: the second's statements go out behind the first's ROLLBACK.
    replay(key).await;
    let after_second_replay = relay.stats().round_trips;
    assert_eq!(after_first - before, 3, "round trips of a first request");
    assert_eq!(after_replay - after_first, 1, "round trips of a replay");
    assert_eq!(
        after_second_replay - after_replay,
        1,
        "round trips of the next replay"
    );
    assert!(
        connection_is_idle(&store).await,
        "the ROLLBACK in passing ended the transaction"
    );
}

/// A store pointed at a port nobody listens on reports `Unavailable` (the layer's `503`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_database_is_unavailable() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    assert_unavailable(TokioPgStore::connect(&url).await);
}

/// A store whose database goes away after it connected reports `Unavailable` in transaction
/// mode, for a connection that broke and for one that cannot be made; a wait for a connection
/// that ends because none could be made is not a `Busy` key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_lost_after_connect_is_unavailable() {
    let db = PgTestDatabase::create().await;
    let direct: sqlx::postgres::PgConnectOptions = db.url().parse().unwrap();
    let relay = FaultRelay::start_to(direct.get_host(), direct.get_port(), 0)
        .await
        .unwrap();
    let url = idem_store::testing::with_hosts(db.url(), &[relay.addr()], "");
    let store = TokioPgStore::connect(&url).await.unwrap();
    let key = scope("lost-key-0001");
    let tx = begin_claimed(&store, &claim(&key, 1)).await;
    store
        .commit_response(tx, &key, FencingToken(1), &response())
        .await
        .unwrap();

    relay.cut().await;
    assert_unavailable(
        store
            .begin_claim(&claim(&scope("lost-key-0002"), 2), Duration::from_secs(2))
            .await,
    );
    assert_unavailable(
        store
            .begin_claim(
                &claim(&scope("lost-key-0003"), 3),
                Duration::from_millis(200),
            )
            .await,
    );
    assert_unavailable(store.begin().await);
}

/// The lease-mode path is PgStore's, on the same database: a claim made through one is seen
/// through the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_mode_runs_on_the_same_records() {
    let (store, _db) = fresh_store().await;
    let key = scope("lease-shared-1");
    assert_eq!(
        store.claim(&claim(&key, 1)).await.unwrap(),
        ClaimOutcome::Claimed
    );
    assert!(store.pg_store().get(&key).await.unwrap().is_some());
    let found = store.begin_claim(&claim(&key, 2), LONG_WAIT).await.unwrap();
    assert!(matches!(found, TxClaim::Existing(_)), "got {found:?}");
}

/// Inserts `key` into the test's `notes` table, in `tx`.
async fn note(tx: &TokioPgTx, key: &str) {
    tx.execute("INSERT INTO notes VALUES ($1)", &[&key])
        .await
        .unwrap();
}
