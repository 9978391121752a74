//! The conformance suite and PostgreSQL's own behaviour against [`PgStore`], each test in a
//! database of its own on the server at `IDEM_TEST_PG_URL` (default: the local server, trust
//! authentication), created for the test and dropped when it ends, pass or fail.

#![cfg(feature = "postgres")]

use std::time::Duration;

use idem_core::{
    AccountId, Decision, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Policy, RecordState,
    RequestParts, Scope, StoredResponse, Timestamp, decide,
};
use idem_store::conformance::{assert_unavailable, sweep_boundary_is_exact};
use idem_store::fault_relay::FaultRelay;
use idem_store::testing::{PgTestDatabase, with_database, with_hosts};
use idem_store::{
    ClaimOutcome, NewClaim, PgStore, PgTx, Result, Store, TransactionalStore, TxClaim,
    admin_conformance, store_conformance, transactional_conformance,
};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

const T0: Timestamp = Timestamp(1_800_000_000_000);

/// Long enough never to run out in a test that expects no timeout.
const LONG_WAIT: Duration = Duration::from_secs(10);

async fn fresh_store() -> (PgStore, PgTestDatabase) {
    let db = PgTestDatabase::create().await;
    let store = PgStore::connect(db.url()).await.expect("connect the store");
    (store, db)
}

store_conformance!(fresh_store());
transactional_conformance!(fresh_store());
admin_conformance!(fresh_store());

/// A database of the test's own and a store on a pool of at most `max` connections to it.
async fn store_of_its_own(max: u32) -> (PgTestDatabase, PgStore) {
    let db = PgTestDatabase::create().await;
    let store = db.store(max).await;
    (db, store)
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

async fn begin_claimed(store: &PgStore, claim: &NewClaim) -> PgTx {
    match store
        .begin_claim(claim, LONG_WAIT)
        .await
        .expect("begin_claim")
    {
        TxClaim::Claimed(tx) => tx,
        other => panic!("expected to claim the key, got {other:?}"),
    }
}

/// The first transaction to claim `key` (token 1), and a duplicate (token 2) spawned to claim
/// it too, once it is blocked on the first one's row.
async fn first_and_a_waiting_duplicate(
    store: &PgStore,
    key: &Scope,
) -> (PgTx, tokio::task::JoinHandle<Result<TxClaim<PgTx>>>) {
    let first = begin_claimed(store, &claim(key, 1)).await;
    let waiter = tokio::spawn({
        let (store, claim) = (store.clone(), claim(key, 2));
        async move { store.begin_claim(&claim, LONG_WAIT).await }
    });
    lock_waiters(store.pool(), 1).await;
    (first, waiter)
}

/// Waits until `n` sessions of the test database are blocked on a lock. PostgreSQL announces
/// no such event, so this watches the server's own view of its sessions (with a deadline)
/// rather than guessing with a sleep.
async fn lock_waiters(pool: &PgPool, n: i64) {
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

/// How many sessions of the test database are blocked on a lock, by the server's own view of
/// its sessions.
async fn sessions_waiting_on_a_lock<'c>(db: impl sqlx::PgExecutor<'c>) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(db)
    .await
    .expect("read pg_stat_activity")
}

/// A duplicate waiting on an open transaction gets `Busy` once its lock_timeout passes, and
/// gives its connection back at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busy_after_lock_timeout_frees_the_connection() {
    // Two connections: the first transaction's and the duplicate's.
    let (_db, store) = store_of_its_own(2).await;
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

    // The first transaction still holds one of the two connections; the other is free again.
    let mut conn = tokio::time::timeout(Duration::from_secs(1), store.pool().acquire())
        .await
        .expect("the duplicate's connection went back to the pool")
        .unwrap();
    assert_eq!(
        sessions_waiting_on_a_lock(&mut *conn).await,
        0,
        "a session still waits for the key"
    );
    drop(conn);
    store.rollback(first).await.unwrap();
}

/// With every connection taken by transactions on the key, a duplicate's wait for a
/// connection is bounded by the same wait and also ends in `Busy`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn busy_when_no_connection_is_free() {
    let (_db, store) = store_of_its_own(1).await;
    let key = scope("busy-key-0002");
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
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_claims_when_the_first_rolls_back() {
    let (_db, store) = store_of_its_own(4).await;
    let key = scope("rollback-key1");
    let (first, waiter) = first_and_a_waiting_duplicate(&store, &key).await;
    store.rollback(first).await.unwrap();

    let TxClaim::Claimed(mut tx) = waiter.await.unwrap().unwrap() else {
        panic!("the duplicate must claim the key the first one gave up")
    };
    let lock_timeout: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(
        lock_timeout, "0",
        "the claim's lock_timeout leaked into the handler's transaction"
    );
    store
        .commit_response(tx, &key, FencingToken(2), &response())
        .await
        .unwrap();
    let record = store.get(&key).await.unwrap().expect("committed record");
    assert_eq!(record.state, RecordState::Completed(response()));
}

/// The first transaction commits while a duplicate waits: the duplicate gets the completed
/// record, to replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_replays_when_the_first_commits() {
    let (_db, store) = store_of_its_own(4).await;
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

/// Whether the pool's only connection is outside any transaction: then two statements run
/// in two transactions, with two transaction ids; in one left open, they share one.
async fn connection_is_idle(pool: &PgPool) -> bool {
    let xid =
        || sqlx::query_scalar::<_, String>("SELECT pg_current_xact_id()::text").fetch_one(pool);
    xid().await.expect("ask the connection") != xid().await.expect("ask the connection")
}

/// Accounts, keys, headers and bodies with quotes, backslashes, dollar signs, non-ASCII text
/// and every byte value go through transaction mode and come back exactly, and the key
/// claimed is that one key, no other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transaction_mode_stores_any_account_key_and_response_exactly() {
    let (_db, store) = store_of_its_own(1).await;
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

    let record = store.get(&scope).await.unwrap().expect("the record");
    assert_eq!(record.scope.account.as_str(), account);
    assert_eq!(record.fingerprint, fingerprint());
    assert_eq!(record.state, RecordState::Completed(response.clone()));
    // The duplicate's claim finds it rather than claiming anew.
    match store
        .begin_claim(&claim(&scope, 8), LONG_WAIT)
        .await
        .unwrap()
    {
        TxClaim::Existing(found) => assert_eq!(found, record),
        other => panic!("expected the committed record, got {other:?}"),
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 1, "one key row, the one named");
    assert!(connection_is_idle(store.pool()).await);
}

/// After a commit, a rollback, a lost claim and a transaction dropped unfinished, the pooled
/// connection is back outside any transaction, and what should have committed did, alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_ending_returns_the_connection_outside_a_transaction() {
    // One connection, so every step below runs on the one the step before returned.
    let (_db, store) = store_of_its_own(1).await;
    assert!(connection_is_idle(store.pool()).await, "at first");
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
    assert!(connection_is_idle(store.pool()).await, "after a commit");

    let tx = begin_claimed(&store, &claim(&rolled_back, 2)).await;
    store.rollback(tx).await.unwrap();
    assert!(connection_is_idle(store.pool()).await, "after a rollback");

    let lost = store
        .begin_claim(&claim(&committed, 3), LONG_WAIT)
        .await
        .unwrap();
    assert!(matches!(lost, TxClaim::Existing(_)), "got {lost:?}");
    assert!(connection_is_idle(store.pool()).await, "after a lost claim");

    // A handler that panics drops its transaction.
    drop(begin_claimed(&store, &claim(&dropped, 4)).await);
    assert!(connection_is_idle(store.pool()).await, "after a drop");

    assert!(store.get(&committed).await.unwrap().is_some());
    assert!(store.get(&rolled_back).await.unwrap().is_none());
    assert!(store.get(&dropped).await.unwrap().is_none());
}

/// A handler may nest with sqlx's own `begin` on the transaction: a savepoint, whose rollback
/// undoes only its writes; the key and the rest commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nested_begin_is_a_savepoint() {
    use sqlx::Connection as _;
    let (_db, store) = store_of_its_own(2).await;
    sqlx::raw_sql("CREATE TABLE notes (body text)")
        .execute(store.pool())
        .await
        .unwrap();
    let key = scope("nested-key-01");
    let mut tx = begin_claimed(&store, &claim(&key, 1)).await;
    sqlx::query("INSERT INTO notes VALUES ('kept')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let mut nested = tx.begin().await.expect("a savepoint");
    sqlx::query("INSERT INTO notes VALUES ('undone')")
        .execute(&mut *nested)
        .await
        .unwrap();
    nested.rollback().await.unwrap();
    store
        .commit_response(tx, &key, FencingToken(1), &response())
        .await
        .unwrap();

    let notes: Vec<String> = sqlx::query_scalar("SELECT body FROM notes")
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(notes, ["kept"]);
    assert!(store.get(&key).await.unwrap().is_some());
}

/// Instances starting together on a fresh database all migrate it without error, and the
/// migration is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations_of_a_fresh_database_succeed() {
    let db = PgTestDatabase::create().await;
    let instances = 4;
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(instances));
    let tasks: Vec<_> = (0..instances)
        .map(|_| {
            let (url, start) = (db.url().to_owned(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                PgStore::connect(&url).await
            })
        })
        .collect();
    let mut stores = Vec::new();
    for task in tasks {
        stores.push(task.await.unwrap().expect("every instance migrates"));
    }
    let applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_store_migrations WHERE success")
            .fetch_one(stores[0].pool())
            .await
            .unwrap();
    assert_eq!(applied, 1);
    let key = scope("after-migrate");
    assert_eq!(
        stores[3].claim(&claim(&key, 1)).await.unwrap(),
        ClaimOutcome::Claimed
    );
}

/// Millisecond timestamps survive the trip through `timestamptz` exactly, across its range,
/// and comparisons in SQL (the sweeper's) are exact to the millisecond.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn timestamps_round_trip_exactly() {
    let (_db, store) = store_of_its_own(4).await;

    sweep_boundary_is_exact(&store).await;

    let mut millis = vec![
        0,
        1,
        -1,
        999,
        -999,
        -1_001,
        1_800_000_000_123,
        4_102_444_800_001,   // 2100-01-01T00:00:00.001Z
        253_402_300_799_999, // 9999-12-31T23:59:59.999Z, where float8 seconds lose exactness
        -62_135_596_800_001, // 1 ms before 0001-01-01
    ];
    // And a spread of ordinary times with every millisecond digit.
    millis.extend((0..40_i64).map(|i| 1_600_000_000_000 + i * 7_919_000_003 + i * 37 % 1000));

    for (i, &ms) in millis.iter().enumerate() {
        let key = scope(&format!("time-key-{i:04}"));
        let mut c = claim(&key, 1);
        c.now = Timestamp(ms);
        c.lease_until = Timestamp(ms + 1);
        c.expires_at = Timestamp(ms + 999);
        assert_eq!(store.claim(&c).await.unwrap(), ClaimOutcome::Claimed);
        let record = store.get(&key).await.unwrap().unwrap();
        assert_eq!(record.created_at, c.now, "created_at of {ms}");
        assert_eq!(record.expires_at, c.expires_at, "expires_at of {ms}");
        assert_eq!(
            record.state,
            RecordState::InProgress {
                lease_until: c.lease_until,
                token: FencingToken(1)
            },
            "lease_until of {ms}"
        );
        assert!(
            store
                .renew(&key, FencingToken(1), Timestamp(ms + 3))
                .await
                .unwrap()
        );
        assert!(matches!(
            store.get(&key).await.unwrap().unwrap().state,
            RecordState::InProgress { lease_until, .. } if lease_until == Timestamp(ms + 3)
        ));
    }

    // What a DBA sees is the instant itself, not an approximation of it.
    for (i, expected) in [
        (6, "2027-01-15 08:00:00.123+00"),
        (8, "9999-12-31 23:59:59.999+00"),
        (2, "1969-12-31 23:59:59.999+00"),
    ] {
        let exact: bool = sqlx::query_scalar(
            "SELECT created_at = $1::timestamptz FROM idempotency_keys WHERE idem_key = $2",
        )
        .bind(expected)
        .bind(format!("time-key-{i:04}"))
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert!(exact, "time-key-{i:04} is not stored as {expected}");
    }
}

/// A sweeper neither blocks on nor deletes a row another transaction holds; it takes the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sweep_skips_rows_locked_elsewhere() {
    let (_db, store) = store_of_its_own(4).await;
    for i in 0..3 {
        let key = scope(&format!("sweep-key-{i:04}"));
        store.claim(&claim(&key, 1)).await.unwrap();
        assert!(
            store
                .complete(&key, FencingToken(1), &response())
                .await
                .unwrap()
        );
    }
    let mut holder = store.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE idem_key = 'sweep-key-0001' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();

    let expired = T0.plus(Policy::default().retention);
    let swept = tokio::time::timeout(Duration::from_secs(5), store.sweep(expired, 10))
        .await
        .expect("the sweeper does not wait for the locked row")
        .unwrap();
    assert_eq!(swept, 2);
    holder.commit().await.unwrap();
    assert_eq!(store.sweep(expired, 10).await.unwrap(), 1);
}

/// A store pointed at a port nobody listens on reports `Unavailable`, which the layer answers
/// with `503`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_database_is_unavailable() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");

    // `connect` retries refused connections until its pool's acquire timeout.
    assert_unavailable(PgStore::connect(&url).await);
    // A lazy pool first meets the database when the migrations run.
    let lazy = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(200))
        .connect_lazy(&url)
        .unwrap();
    assert_unavailable(PgStore::from_pool(lazy).await);
}

/// A store whose database goes away after it connected reports `Unavailable` (so `503`), in
/// lease mode and in transaction mode, where a wait for a connection that ends because none
/// could be made is not a `Busy` key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_lost_after_connect_is_unavailable() {
    let db = PgTestDatabase::create().await;
    let direct: PgConnectOptions = db.url().parse().unwrap();
    let proxy = FaultRelay::start_to(direct.get_host(), direct.get_port(), 0)
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_millis(500))
        .connect_with(direct.host("127.0.0.1").port(proxy.addr().port()))
        .await
        .unwrap();
    let store = PgStore::from_pool(pool).await.unwrap();
    let key = scope("lost-key-0001");
    assert_eq!(
        store.claim(&claim(&key, 1)).await.unwrap(),
        ClaimOutcome::Claimed
    );

    proxy.cut().await;
    assert_unavailable(store.get(&key).await);
    assert_unavailable(store.claim(&claim(&key, 2)).await);
    assert_unavailable(
        store
            .begin_claim(&claim(&key, 3), Duration::from_millis(200))
            .await,
    );
}

#[test]
fn test_urls_name_the_test_database() {
    assert_eq!(
        with_database("postgres://postgres@127.0.0.1:5432/postgres", "idem_test_1"),
        "postgres://postgres@127.0.0.1:5432/idem_test_1"
    );
    assert_eq!(
        with_database("postgres://u:p@db:5432?sslmode=disable", "t"),
        "postgres://u:p@db:5432/t?sslmode=disable"
    );
    assert_eq!(
        with_database("postgres://u@db/admin?application_name=x", "t"),
        "postgres://u@db/t?application_name=x"
    );
}

#[test]
fn test_urls_can_name_several_hosts() {
    let hosts = [
        "127.0.0.1:6001".parse().unwrap(),
        "127.0.0.1:6002".parse().unwrap(),
    ];
    assert_eq!(
        with_hosts("postgres://postgres@127.0.0.1:5432/idem_test_1", &hosts, ""),
        "postgres://postgres@127.0.0.1:6001,127.0.0.1:6002/idem_test_1"
    );
    assert_eq!(
        with_hosts(
            "postgres://u:p@db/t?sslmode=disable",
            &hosts[..1],
            "target_session_attrs=read-write"
        ),
        "postgres://u:p@127.0.0.1:6001/t?sslmode=disable&target_session_attrs=read-write"
    );
}
