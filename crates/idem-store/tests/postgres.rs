//! The conformance suite and PostgreSQL's own behaviour against [`PgStore`], each test in a
//! database of its own on the server at `IDEM_TEST_PG_URL` (default: the local server, trust
//! authentication), created for the test and dropped when it ends, pass or fail.

#![cfg(feature = "postgres")]

use std::time::Duration;

use idem_core::{
    Clock, Decision, FencingToken, Policy, RecordState, SystemClock, Timestamp, decide,
};
use idem_store::conformance::assert_unavailable;
use idem_store::{
    ClaimOutcome, NewClaim, PgStore, Store, TransactionalStore, admin_conformance,
    shared_admin_conformance, shared_store_conformance, store_conformance,
    table_events_conformance, transactional_conformance,
};
use idem_testkit::fault_relay::FaultRelay;
use idem_testkit::postgres::{PgTestDatabase, with_database, with_hosts};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

mod common;

use common::pg::{T0, begin_claimed, claim, pg_transaction_tests, response, scope};

async fn fresh_store() -> (PgStore, PgTestDatabase) {
    let db = PgTestDatabase::create().await;
    let store = PgStore::connect(db.url()).await.expect("connect the store");
    (store, db)
}

store_conformance!(fresh_store());
transactional_conformance!(fresh_store());
admin_conformance!(fresh_store());
table_events_conformance!(fresh_store());
shared_store_conformance!(fresh_store());
shared_admin_conformance!(fresh_store());
pg_transaction_tests!(PgStore);

/// A database of the test's own and a store on a pool of at most `max` connections to it.
async fn store_of_its_own(max: u32) -> (PgTestDatabase, PgStore) {
    let db = PgTestDatabase::create().await;
    let store = PgStore::from_pool(db.pool(max).await)
        .await
        .expect("migrate the test database");
    (db, store)
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
    assert!(store.get(&key, T0).await.unwrap().is_some());
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
    assert_eq!(
        applied, 3,
        "0001 the keys, 0002 the shared secrets, 0003 the keys' events"
    );
    let key = scope("after-migrate");
    assert_eq!(
        stores[3].claim(&claim(&key, 1)).await.unwrap(),
        ClaimOutcome::Claimed
    );
}

/// Times are PostgreSQL's, whatever the caller's clock says: a claim from callers whose clocks
/// lie anywhere in `timestamptz`'s range (or outside it) stores the server's now, in whole
/// milliseconds, with the lease and retention the caller gave, exactly; and the record comes
/// back in each caller's frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn times_are_the_servers_in_any_callers_frame() {
    let (_db, store) = store_of_its_own(4).await;
    let frames = [
        0,
        -1,
        1_800_000_000_123,
        253_402_300_799_999,   // 9999-12-31T23:59:59.999Z
        -62_135_596_800_001,   // 1 ms before 0001-01-01
        9_000_000_000_000_000, // past timestamptz's range
        SystemClock.now().0,
    ];
    for (i, &ms) in frames.iter().enumerate() {
        let key = scope(&format!("time-key-{i:04}"));
        let mut c = claim(&key, 1);
        c.now = Timestamp(ms);
        c.lease_until = Timestamp(ms + 1);
        c.expires_at = Timestamp(ms + 999);
        assert_eq!(store.claim(&c).await.unwrap(), ClaimOutcome::Claimed);
        let record = store.get(&key, c.now).await.unwrap().unwrap();
        assert!(
            (record.created_at.0 - ms).abs() < 10_000,
            "created_at {:?} in the frame of {ms}",
            record.created_at
        );
        assert_eq!(
            record.expires_at.0 - record.created_at.0,
            999,
            "expiry of {ms}"
        );
        let RecordState::InProgress { lease_until, .. } = record.state else {
            panic!("in progress")
        };
        assert_eq!(lease_until.0 - record.created_at.0, 1, "lease of {ms}");
        assert!(
            store
                .renew(&key, FencingToken(1), Duration::from_millis(3), c.now)
                .await
                .unwrap()
        );
    }

    // What a DBA sees is the server's time, in whole milliseconds.
    let (servers, whole): (bool, bool) = sqlx::query_as(
        "SELECT bool_and(abs(extract(epoch FROM clock_timestamp() - created_at)) < 60),
                bool_and(created_at = date_trunc('milliseconds', created_at)
                         AND lease_until = date_trunc('milliseconds', lease_until))
         FROM idempotency_keys",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert!(servers, "a time not the server's");
    assert!(whole, "a time not in whole milliseconds");
}

/// A sweeper neither blocks on nor deletes a row another transaction holds; it takes the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sweep_skips_rows_locked_elsewhere() {
    let (_db, store) = store_of_its_own(4).await;
    let short = Duration::from_millis(300);
    for i in 0..3 {
        let key = scope(&format!("sweep-key-{i:04}"));
        let policy = Policy {
            retention: short,
            ..Policy::default()
        };
        let c = NewClaim::new(
            key.clone(),
            common::pg::fingerprint(),
            FencingToken(1),
            SystemClock.now(),
            &policy,
        );
        store.claim(&c).await.unwrap();
        assert!(
            store
                .complete(&key, FencingToken(1), &response(), SystemClock.now())
                .await
                .unwrap()
        );
    }
    let mut holder = store.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE idem_key = 'sweep-key-0001' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    // Once the last one completed has expired, they all have.
    let last = scope("sweep-key-0002");
    let other = idem_store::conformance::fingerprint("{}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let at = SystemClock.now();
        let record = store.get(&last, at).await.unwrap().unwrap();
        if decide(Some(&record), &other, at) == Decision::Expired {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Bounded only so that a sweeper blocked on the row fails instead of hanging (the holder
    // never lets go before the sweep ends): far past a sweep on a loaded server.
    let swept = tokio::time::timeout(Duration::from_secs(60), store.sweep(SystemClock.now(), 10))
        .await
        .expect("the sweeper does not wait for the locked row")
        .unwrap();
    assert_eq!(swept, 2);
    holder.commit().await.unwrap();
    assert_eq!(store.sweep(SystemClock.now(), 10).await.unwrap(), 1);
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
    assert_unavailable(store.get(&key, T0).await);
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

/// In a black hole between the store and the database, every operation answers `Unavailable`
/// within the statement timeout and its margin (6 s) and a little slack, never later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_black_hole_is_unavailable_within_the_deadline() {
    let db = PgTestDatabase::create().await;
    let direct: PgConnectOptions = db.url().parse().unwrap();
    let relay = FaultRelay::start_to(direct.get_host(), direct.get_port(), 0)
        .await
        .unwrap();
    let store = PgStore::connect(&with_hosts(db.url(), &[relay.addr()], ""))
        .await
        .unwrap();
    idem_store::conformance::a_black_hole_is_unavailable_within(
        &store,
        |on| relay.set_black_hole(on),
        Duration::from_secs(8),
        Some(idem_store::conformance::begin_claim_of(&store)),
    )
    .await;
}
