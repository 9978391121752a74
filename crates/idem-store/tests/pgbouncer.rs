//! Both PostgreSQL stores through PgBouncer 1.18 in transaction pooling mode (Debian's
//! `pgbouncer`, started by each test on a free port in front of the test server): the whole
//! conformance suite, each store finding out that it is behind a pooler, and the round trips of
//! a first request, which the pooler must not change.

#![cfg(feature = "tokio-postgres")]

use idem_core::FencingToken;
use idem_store::{
    OutcomeChannel, PgStore, TokioPgStore, TransactionalStore, TxClaim, admin_conformance,
    store_conformance, transactional_conformance,
};
use idem_testkit::fault_relay::FaultRelay;
use idem_testkit::pgbouncer::PgBouncer;
use idem_testkit::postgres::{PgTestDatabase, with_hosts};

// Only the shared values: the shared transaction-mode tests run in the stores' own files.
#[allow(dead_code, unused_macros, unused_imports)]
mod common;

use common::pg::{LONG_WAIT, T0, begin_claimed, claim, response, scope};

/// A PgBouncer whose pools have room for both stores' connections at once.
const POOL_SIZE: usize = 30;

/// The test's database, and a PgBouncer in front of the server.
async fn database_behind_a_pooler() -> (PgTestDatabase, PgBouncer) {
    let db = PgTestDatabase::create().await;
    let bouncer = PgBouncer::start(POOL_SIZE);
    (db, bouncer)
}

mod pg_store {
    use super::*;

    async fn fresh_store() -> (PgStore, (PgTestDatabase, PgBouncer)) {
        let (db, bouncer) = database_behind_a_pooler().await;
        let store = PgStore::connect(&bouncer.url_for(db.url()))
            .await
            .expect("connect the store through PgBouncer");
        (store, (db, bouncer))
    }

    store_conformance!(fresh_store());
    transactional_conformance!(fresh_store());
    admin_conformance!(fresh_store());
}

mod tokio_pg_store {
    use super::*;

    async fn fresh_store() -> (TokioPgStore, (PgTestDatabase, PgBouncer)) {
        let (db, bouncer) = database_behind_a_pooler().await;
        let store = TokioPgStore::connect(&bouncer.url_for(db.url()))
            .await
            .expect("connect the store through PgBouncer");
        (store, (db, bouncer))
    }

    store_conformance!(fresh_store());
    transactional_conformance!(fresh_store());
    admin_conformance!(fresh_store());
}

/// The store asks once whether its sessions are its own: through PgBouncer they are not; on
/// the server, and through a plain TCP relay, they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_store_knows_whether_a_pooler_lends_its_sessions() {
    let (db, bouncer) = database_behind_a_pooler().await;
    let pooled = PgStore::connect(&bouncer.url_for(db.url())).await.unwrap();
    assert!(pooled.behind_a_pooler());
    assert!(
        pooled.outcome_poll().is_some(),
        "without a notify URL, waiters poll"
    );
    let pooled = pooled.with_notify_url(db.url()).unwrap();
    assert_eq!(pooled.outcome_poll(), None, "the notify URL listens");

    let direct = PgStore::connect(db.url()).await.unwrap();
    assert!(!direct.behind_a_pooler());
    assert_eq!(direct.outcome_poll(), None);

    let options: sqlx::postgres::PgConnectOptions = db.url().parse().unwrap();
    let relay = FaultRelay::start_to(options.get_host(), options.get_port(), 0)
        .await
        .unwrap();
    let relayed = PgStore::connect(&with_hosts(db.url(), &[relay.addr()], ""))
        .await
        .unwrap();
    assert!(!relayed.behind_a_pooler(), "a TCP relay keeps the session");

    let tokio = TokioPgStore::connect(&bouncer.url_for(db.url()))
        .await
        .unwrap();
    assert!(tokio.pg_store().behind_a_pooler());
}

/// Direct sessions carry the store's statement and lock timeouts from their startup packet;
/// through PgBouncer (which refuses that packet's `options`) the store's transactions set
/// theirs with `SET LOCAL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_session_and_transaction_has_a_statement_timeout() {
    let (db, bouncer) = database_behind_a_pooler().await;
    let direct = PgStore::connect(db.url()).await.unwrap();
    let timeout: String = sqlx::query_scalar("SELECT current_setting('statement_timeout')")
        .fetch_one(direct.pool())
        .await
        .unwrap();
    assert_eq!(timeout, "5s");

    for (url, key) in [
        (db.url().to_owned(), "timeout-key-01"),
        (bouncer.url_for(db.url()), "timeout-key-02"),
    ] {
        let store = TokioPgStore::connect(&url).await.unwrap();
        let key = scope(key);
        let tx = begin_claimed(&store, &claim(&key, 1)).await;
        let row = tx
            .query_typed_one(
                "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')",
                &[],
            )
            .await
            .unwrap();
        let (statement, lock): (String, String) = (row.get(0), row.get(1));
        // The claim's own wait (up to 10 s) on top of the statement timeout, for every
        // statement of the transaction; the store's lock timeout once the claim is done.
        let statement_ms = milliseconds(&statement);
        assert!(
            (10_000..=15_000).contains(&statement_ms),
            "{url}: statement_timeout {statement}"
        );
        assert_eq!(lock, "5s", "{url}");
        store
            .commit_response(tx, &key, FencingToken(1), &response())
            .await
            .unwrap();
    }
}

/// A time setting as PostgreSQL shows it (`15s`, `14998ms`), in milliseconds.
fn milliseconds(setting: &str) -> u64 {
    match setting.strip_suffix("ms") {
        Some(ms) => ms.parse().unwrap(),
        None => setting.strip_suffix('s').unwrap().parse::<u64>().unwrap() * 1000,
    }
}

/// Through PgBouncer, with a relay in front of it counting round trips: a first request
/// (claim, one statement of the handler's, response) waits for three, a replay for one, from
/// the first request on (no statement is prepared ahead).
#[tokio::test(flavor = "current_thread")]
async fn a_first_request_through_the_pooler_is_three_round_trips() {
    let (db, bouncer) = database_behind_a_pooler().await;
    let relay = FaultRelay::start(bouncer.addr(), 0).await.unwrap();
    let url = with_hosts(db.url(), &[relay.addr()], "");
    let store = TokioPgStore::connect(&url).await.unwrap().with_pool_size(1);
    sqlx::raw_sql("CREATE TABLE notes (key text PRIMARY KEY)")
        .execute(store.pg_store().pool())
        .await
        .unwrap();
    // The pool's one connection, made before the count.
    drop(store.client().await.unwrap());
    let key = scope("counted-key-1");
    let before = relay.stats().round_trips;
    let tx = begin_claimed(&store, &claim(&key, 1)).await;
    tx.execute_typed(
        "INSERT INTO notes VALUES ($1)",
        &[(&key.key.as_str(), tokio_postgres::types::Type::TEXT)],
    )
    .await
    .unwrap();
    store
        .commit_response(tx, &key, FencingToken(1), &response())
        .await
        .unwrap();
    let after_first = relay.stats().round_trips;
    assert_eq!(after_first - before, 3, "round trips of a first request");
    let found = store.begin_claim(&claim(&key, 2), LONG_WAIT).await.unwrap();
    assert!(matches!(found, TxClaim::Existing(_)), "got {found:?}");
    assert_eq!(
        relay.stats().round_trips - after_first,
        1,
        "round trips a replay waits for"
    );
}

/// What a first request costs in lease mode (the gateway's: the read that answers replays, the
/// claim, the stored outcome) on [`PgStore`], counted by a relay, with and without PgBouncer
/// behind it: one round trip each on direct sessions, four behind the pooler (`BEGIN`, the
/// preparation of the unnamed statement, its execution, `COMMIT`: sqlx cannot send an unnamed
/// statement in one message, and a pooler may switch sessions between its two). Measured:
/// 6 and 15, each with sqlx's three tests of a connection handed back to the pool.
#[tokio::test(flavor = "current_thread")]
async fn lease_mode_round_trips_with_and_without_the_pooler() {
    use idem_store::Store;
    let (db, bouncer) = database_behind_a_pooler().await;
    let options: sqlx::postgres::PgConnectOptions = db.url().parse().unwrap();
    let direct = FaultRelay::start_to(options.get_host(), options.get_port(), 0)
        .await
        .unwrap();
    let pooled = FaultRelay::start(bouncer.addr(), 0).await.unwrap();
    let mut figures = Vec::new();
    for (relay, name, per_operation) in [(&direct, "direct", 1), (&pooled, "PgBouncer", 4)] {
        // One connection, so that the warm-up prepares on the one the count uses (PgBouncer
        // 1.18 refuses sqlx's extra_float_digits: not sent).
        let options: sqlx::postgres::PgConnectOptions =
            with_hosts(db.url(), &[relay.addr()], "").parse().unwrap();
        // As PgStore::connect's pool: no test of the connection on its way out.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect_with(options.extra_float_digits(None))
            .await
            .unwrap();
        let store = PgStore::from_pool(pool).await.unwrap();
        // Warm: on direct sessions the statements prepared.
        let warm = scope(&format!("warm-{name}-key"));
        let _ = store.get(&warm, T0).await.unwrap();
        store.claim(&claim(&warm, 1)).await.unwrap();
        store
            .complete(&warm, FencingToken(1), &response(), T0)
            .await
            .unwrap();
        let key = scope(&format!("lease-{name}-key"));
        let before = relay.stats().round_trips;
        assert!(store.get(&key, T0).await.unwrap().is_none());
        assert_eq!(
            store.claim(&claim(&key, 2)).await.unwrap(),
            idem_store::ClaimOutcome::Claimed
        );
        assert!(
            store
                .complete(&key, FencingToken(2), &response(), T0)
                .await
                .unwrap()
        );
        let round_trips = relay.stats().round_trips - before;
        figures.push(format!("{name}: {round_trips}"));
        // Each operation's statements, and sqlx's test of the connection on its way back to
        // the pool (after the answer, off the request's path).
        assert_eq!(round_trips, 3 * (per_operation + 1), "{name}");
    }
    println!("PgStore, a first request in lease mode (read, claim, outcome): {figures:?}");
}
