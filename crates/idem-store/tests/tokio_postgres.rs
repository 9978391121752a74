//! The conformance suite and the pipelined transaction against [`TokioPgStore`], each test in a
//! database of its own on the server at `IDEM_TEST_PG_URL` (default: the local server, trust
//! authentication), created for the test and dropped when it ends, pass or fail.

#![cfg(feature = "tokio-postgres")]

use std::time::Duration;

use idem_core::{FencingToken, Scope};
use idem_store::conformance::assert_unavailable;
use idem_store::{
    ClaimOutcome, Store, TokioPgStore, TokioPgTx, TransactionalStore, TxClaim, admin_conformance,
    shared_admin_conformance, shared_store_conformance, store_conformance,
    table_events_conformance, transactional_conformance,
};
use idem_testkit::fault_relay::FaultRelay;
use idem_testkit::postgres::PgTestDatabase;

mod common;

use common::pg::{
    LONG_WAIT, PgTestStore, T0, begin_claimed, claim, pg_transaction_tests, response, scope,
};

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
table_events_conformance!(fresh_store());
shared_store_conformance!(fresh_store());
shared_admin_conformance!(fresh_store());
pg_transaction_tests!(TokioPgStore);

/// The handler's writes commit with the key's response, in one transaction: a business row
/// written through the transaction is there after the commit, and gone after a rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn handler_writes_commit_and_roll_back_with_the_key() {
    let db = PgTestDatabase::create().await;
    let store = TokioPgStore::with_connections(&db, 2).await;
    create_notes(&store).await;
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
    assert!(store.get(&undone, T0).await.unwrap().is_none());
}

/// The response is stored only in the transaction's own key row. When the handler deleted that
/// row, the commit fails as raced and rolls everything back: the handler's writes never commit
/// without their key's response, though the `COMMIT` was already on its way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_row_gone_from_its_transaction_commits_nothing() {
    let db = PgTestDatabase::create().await;
    let store = TokioPgStore::with_connections(&db, 1).await;
    create_notes(&store).await;
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
    assert!(store.connection_is_idle().await);
}

/// Counts round trips through a relay: a first request (claim, one statement of the handler's,
/// response) waits for three, a replay for one (its `ROLLBACK` follows, unawaited), once each
/// connection has prepared its statements; and the replay's transaction ends without anyone
/// taking its connection from the pool again (a session left idle in a transaction would hold
/// its snapshot until then).
/// A current-thread runtime, so that the client's connection task runs only when the request
/// has sent all it pipelines, as it does on a busy server: the count is exact.
#[tokio::test(flavor = "current_thread")]
async fn a_first_request_is_three_round_trips_and_a_replay_one() {
    let db = PgTestDatabase::create().await;
    let direct: sqlx::postgres::PgConnectOptions = db.url().parse().unwrap();
    let relay = FaultRelay::start_to(direct.get_host(), direct.get_port(), 0)
        .await
        .unwrap();
    let url = idem_testkit::postgres::with_hosts(db.url(), &[relay.addr()], "");
    let store = TokioPgStore::connect(&url).await.unwrap().with_pool_size(1);
    create_notes(&store).await;
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
    // Asked directly, not through the relay, whose round trips are counted.
    let observer = db.pool(1).await;
    // The first of each prepares the statements on the pool's one connection.
    replay(first_request("warm-up-key-1", 1).await).await;
    no_session_idle_in_a_transaction(&observer).await;

    let before = relay.stats().round_trips;
    let key = first_request("counted-key-1", 2).await;
    let after_first = relay.stats().round_trips;
    assert_eq!(after_first - before, 3, "round trips of a first request");
    replay(key.clone()).await;
    // Read before the connection task runs again, so the ROLLBACK is not among them yet.
    let after_replay = relay.stats().round_trips;
    assert_eq!(
        after_replay - after_first,
        1,
        "round trips a replay waits for"
    );
    no_session_idle_in_a_transaction(&observer).await;
    assert!(
        store.connection_is_idle().await,
        "the ROLLBACK ended the transaction"
    );
}

/// Waits, with a deadline, until no session of the store's database is idle in a transaction
/// (PostgreSQL announces no such event).
async fn no_session_idle_in_a_transaction(observer: &sqlx::PgPool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let idle: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
        )
        .fetch_one(observer)
        .await
        .unwrap();
        if idle == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{idle} sessions stayed idle in a transaction"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
    let url = idem_testkit::postgres::with_hosts(db.url(), &[relay.addr()], "");
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
    assert!(store.pg_store().get(&key, T0).await.unwrap().is_some());
    let found = store.begin_claim(&claim(&key, 2), LONG_WAIT).await.unwrap();
    assert!(matches!(found, TxClaim::Existing(_)), "got {found:?}");
}

/// The test's own business table, `notes`.
async fn create_notes(store: &TokioPgStore) {
    sqlx::raw_sql("CREATE TABLE notes (key text PRIMARY KEY)")
        .execute(store.pg_store().pool())
        .await
        .unwrap();
}

/// Inserts `key` into the test's `notes` table, in `tx`.
async fn note(tx: &TokioPgTx, key: &str) {
    tx.execute("INSERT INTO notes VALUES ($1)", &[&key])
        .await
        .unwrap();
}

/// Connections a burst opened are closed once they sat unused for the idle timeout, and the
/// store opens new ones when it needs them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_connections_are_closed_after_the_idle_timeout() {
    let db = PgTestDatabase::create().await;
    // The default idle timeout (ten minutes) while the burst runs and is counted: a short one
    // counts from each connection's creation, so on a loaded machine it could close one
    // before the count below sees the four.
    let store = TokioPgStore::with_connections(&db, 4).await;
    let burst: Vec<_> = (0..4).map(|_| store.client()).collect();
    let clients = futures_util::future::try_join_all(burst).await.unwrap();
    // The burst's own sessions, by backend pid: the sqlx pool beside it opens and closes its
    // connections on its own, so a count of the database's sessions would move with it too.
    let mut pids = Vec::new();
    for client in &clients {
        let row = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap();
        pids.push(row.get::<_, i32>(0));
    }
    drop(clients);
    let sessions = store.pg_store().pool().clone();
    let open = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)")
            .bind(&pids)
            .fetch_one(&sessions)
            .await
            .unwrap()
    };
    assert_eq!(open().await, 4, "the burst's connections are open");
    // Now the short timeout; the store's task looks with it at once, and every tenth of it.
    let store = store.with_idle_timeout(Duration::from_millis(300));
    // PostgreSQL announces no such event, so this watches its sessions, with a deadline far
    // past the timeout.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while open().await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "idle connections stayed open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let key = scope("after-idle-01");
    let tx = begin_claimed(&store, &claim(&key, 1)).await;
    store.rollback(tx).await.unwrap();
}

/// In a black hole between the store and the database, every operation answers `Unavailable`
/// within the statement timeout and its margin (6 s) and a little slack, never later; a claim
/// in a transaction within its wait on top.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_black_hole_is_unavailable_within_the_deadline() {
    let db = PgTestDatabase::create().await;
    let direct: sqlx::postgres::PgConnectOptions = db.url().parse().unwrap();
    let relay = FaultRelay::start_to(direct.get_host(), direct.get_port(), 0)
        .await
        .unwrap();
    let url = idem_testkit::postgres::with_hosts(db.url(), &[relay.addr()], "");
    let store = TokioPgStore::connect(&url).await.unwrap();
    // A pooled transaction connection, made before the black hole.
    drop(store.client().await.unwrap());
    idem_store::conformance::a_black_hole_is_unavailable_within(
        &store,
        |on| relay.set_black_hole(on),
        Duration::from_secs(8),
        Some(idem_store::conformance::begin_claim_of(&store)),
    )
    .await;
}
