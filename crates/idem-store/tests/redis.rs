//! The conformance suite and Redis's own behaviour against [`RedisStore`], each test under a
//! key prefix of its own on the server at `IDEM_TEST_REDIS_URL` (default: the local server),
//! whose keys are deleted when the test ends, pass or fail.

#![cfg(feature = "redis")]

use std::time::Duration;

use idem_core::{FencingToken, Policy, RecordState, Scope, StoredResponse, Timestamp};
use idem_store::conformance::{assert_unavailable, fingerprint, scope, sweep_boundary_is_exact};
use idem_store::fault_relay::FaultRelay;
use idem_store::{ClaimOutcome, NewClaim, RedisStore, Store, store_conformance};
use redis::Commands as _;

const DEFAULT_URL: &str = "redis://127.0.0.1:6379/0";

const T0: Timestamp = Timestamp(1_800_000_000_000);

fn url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| {
        idem_testkit::require(idem_testkit::Service::Redis);
        DEFAULT_URL.to_owned()
    })
}

/// A key prefix for one test; dropping it deletes every key under it.
struct TestPrefix {
    prefix: String,
}

impl TestPrefix {
    fn new() -> Self {
        // A UUID's simple form is lower-case hex: nothing in the prefix is special to `SCAN
        // MATCH`.
        Self {
            prefix: format!("idem-test-{}", uuid::Uuid::new_v4().simple()),
        }
    }

    async fn store(&self) -> RedisStore {
        RedisStore::connect(&url(), self.prefix.clone())
            .await
            .expect("connect to the test server (set IDEM_TEST_REDIS_URL)")
    }

    /// Every key under the prefix.
    fn keys(&self) -> redis::RedisResult<Vec<String>> {
        let mut conn = redis::Client::open(url())?.get_connection()?;
        let keys = conn
            .scan_match::<_, String>(format!("{}:*", self.prefix))?
            .collect::<redis::RedisResult<_>>()?;
        Ok(keys)
    }

    fn delete_all(&self) -> redis::RedisResult<()> {
        let keys = self.keys()?;
        if !keys.is_empty() {
            let mut conn = redis::Client::open(url())?.get_connection()?;
            redis::cmd("DEL").arg(keys).exec(&mut conn)?;
        }
        Ok(())
    }
}

impl Drop for TestPrefix {
    fn drop(&mut self) {
        // A blocking connection: Drop cannot await. No panic here: this may run while a failed
        // test unwinds, and a second panic aborts.
        if let Err(e) = self.delete_all() {
            eprintln!("could not delete the keys under {}: {e}", self.prefix);
        }
    }
}

async fn fresh_store() -> (RedisStore, TestPrefix) {
    let prefix = TestPrefix::new();
    (prefix.store().await, prefix)
}

store_conformance!(fresh_store());

fn claim(scope: &Scope, token: i64, now: Timestamp) -> NewClaim {
    NewClaim::new(
        scope.clone(),
        fingerprint("{}"),
        FencingToken(token),
        now,
        &Policy::default(),
    )
}

fn response(body: &[u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/octet-stream".into())],
        body: body.to_vec(),
        body_omitted: false,
    }
}

/// Claims `key` at `T0` with token 1 and a lease of twice the retention (a very long call);
/// the claim made.
async fn claim_a_long_call(store: &RedisStore, key: &Scope) -> NewClaim {
    let mut long = claim(key, 1, T0);
    long.lease_until = T0.plus(Policy::default().retention * 2);
    assert_eq!(store.claim(&long).await.unwrap(), ClaimOutcome::Claimed);
    long
}

/// The record's remaining TTL in Redis, in milliseconds.
fn pttl(key: &str) -> i64 {
    let mut conn = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .unwrap();
    conn.pttl(key).unwrap()
}

/// 64 tasks on four separate connections (as four gateway instances would be) claim one key:
/// exactly one wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claim_race_across_connections_has_one_winner() {
    let prefix = TestPrefix::new();
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(prefix.store().await);
    }
    let key = scope("acct_redis", "race-key-0001");
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(64));
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let store = stores[i % 4].clone();
            let (claim, start) = (claim(&key, i as i64 + 1, T0), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                store.claim(&claim).await
            })
        })
        .collect();
    let mut winners = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        match task.await.unwrap().unwrap() {
            ClaimOutcome::Claimed => winners.push(i as i64 + 1),
            ClaimOutcome::Existing(record) => {
                assert!(matches!(record.state, RecordState::InProgress { .. }))
            }
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    // The record holds the winner's token, whichever connection read it.
    for store in &stores {
        assert_eq!(
            store.get(&key).await.unwrap().unwrap().state,
            RecordState::InProgress {
                lease_until: T0.plus(Policy::default().lease),
                token: FencingToken(winners[0])
            }
        );
    }
}

/// A store pointed at a port nobody listens on reports `Unavailable`, which the layer answers
/// with `503`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_server_is_unavailable() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    assert_unavailable(
        RedisStore::connect(&format!("redis://127.0.0.1:{port}/0"), "idem-test-none").await,
    );
}

/// A store whose server goes away after it connected reports `Unavailable` (so `503`) for
/// every operation, both on the dropped connection and on the reconnection attempts after it.
/// (The store reaches the server through the forwarder without a password.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn server_lost_after_connect_is_unavailable() {
    let prefix = TestPrefix::new();
    let client = redis::Client::open(url()).unwrap();
    let redis::ConnectionAddr::Tcp(host, port) = client.get_connection_info().addr() else {
        panic!("the test server must be reached over plain TCP")
    };
    let proxy = FaultRelay::start_to(host, *port, 0).await.unwrap();
    let store = RedisStore::connect(
        &format!("redis://127.0.0.1:{}/0", proxy.addr().port()),
        prefix.prefix.clone(),
    )
    .await
    .unwrap();
    let key = scope("acct_redis", "lost-key-0001");
    assert_eq!(
        store.claim(&claim(&key, 1, T0)).await.unwrap(),
        ClaimOutcome::Claimed
    );

    proxy.cut().await;
    assert_unavailable(store.get(&key).await);
    assert_unavailable(store.claim(&claim(&key, 2, T0)).await);
    assert_unavailable(
        store
            .complete(&key, FencingToken(1), &response(b"{}"))
            .await,
    );
    assert_unavailable(store.sweep(T0, 10).await);
}

/// In a black hole between the store and Redis (nothing answers, nothing is refused), every
/// operation answers `Unavailable` within the command timeout (2 s) and a little slack.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_black_hole_is_unavailable_within_the_deadline() {
    let prefix = TestPrefix::new();
    let client = redis::Client::open(url()).unwrap();
    let redis::ConnectionAddr::Tcp(host, port) = client.get_connection_info().addr() else {
        panic!("the test server must be reached over plain TCP")
    };
    let relay = FaultRelay::start_to(host, *port, 0).await.unwrap();
    let store = RedisStore::connect(
        &format!("redis://127.0.0.1:{}/0", relay.addr().port()),
        prefix.prefix.clone(),
    )
    .await
    .unwrap();
    idem_store::conformance::a_black_hole_is_unavailable_within(
        &store,
        &relay,
        Duration::from_secs(4),
        None,
    )
    .await;
}

/// Every record carries a TTL, the time until it becomes sweepable by the caller's clock plus
/// the slack, however far that clock is from Redis's own; renewing a lease lengthens it.
/// The guard leaves no key behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_carry_a_relative_ttl_and_the_guard_cleans_up() {
    let prefix = TestPrefix::new();
    let store = prefix.store().await;
    let policy = Policy::default();
    let slack = RedisStore::TTL_SLACK;
    let within = |ttl: i64, expected: Duration| {
        let expected = expected.as_millis() as i64;
        // The test's own round trips take a little of it.
        assert!(
            ttl > 0 && ttl <= expected && ttl > expected - 60_000,
            "TTL {ttl} ms, expected about {expected} ms"
        );
    };

    // The clock a century from Redis's, and one in 1970: the TTL is the same duration.
    for (i, now) in [Timestamp(4_900_000_000_000), Timestamp(1_000)]
        .into_iter()
        .enumerate()
    {
        let key = scope("acct_redis", &format!("ttl-key-{i:05}"));
        store.claim(&claim(&key, 1, now)).await.unwrap();
        let redis_key = format!("{}:k:10:acct_redis:ttl-key-{i:05}", prefix.prefix);
        within(pttl(&redis_key), policy.retention + slack);

        // A lease that now runs past the retention moves the TTL with it.
        let lease_until = now.plus(policy.retention + Duration::from_secs(3600));
        assert!(
            store
                .renew(&key, FencingToken(1), lease_until)
                .await
                .unwrap()
        );
        within(
            pttl(&redis_key),
            policy.retention + Duration::from_secs(3600) + slack,
        );
        // Completing keeps it (a longer backstop is safe).
        assert!(
            store
                .complete(&key, FencingToken(1), &response(b"{}"))
                .await
                .unwrap()
        );
        assert!(pttl(&redis_key) > 0);
        // Redis has not expired it, but by the caller's clock its retention is over: it is new.
        let after = lease_until.plus(Duration::from_millis(1));
        assert_eq!(
            store.claim(&claim(&key, 2, after)).await.unwrap(),
            ClaimOutcome::Claimed
        );
    }
    assert!(!prefix.keys().unwrap().is_empty());

    let name = prefix.prefix.clone();
    drop(prefix);
    let left = TestPrefix { prefix: name }.keys().unwrap();
    assert!(left.is_empty(), "keys left behind: {left:?}");
}

/// Accounts and keys may contain `:`; scopes that would read alike when joined stay apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn colons_in_accounts_and_keys_do_not_collide() {
    let (store, prefix) = fresh_store().await;
    let scopes = [
        scope("acct:a", "b:key-0001"),
        scope("acct", "a:b:key-0001"),
        scope("acct:a:b", "key-0001"),
        scope("acct:a:b:key-0001", "k:k:k:k:"),
        scope("4:acct", "key-0001"),
        scope("acct", "4:acct:key-0001"),
    ];
    for (i, scope) in scopes.iter().enumerate() {
        let token = i as i64 + 1;
        assert_eq!(
            store.claim(&claim(scope, token, T0)).await.unwrap(),
            ClaimOutcome::Claimed,
            "{scope:?}"
        );
        assert!(
            store
                .complete(scope, FencingToken(token), &response(&[token as u8]))
                .await
                .unwrap()
        );
    }
    for (i, scope) in scopes.iter().enumerate() {
        let record = store.get(scope).await.unwrap().unwrap();
        assert_eq!(record.scope, *scope);
        assert_eq!(
            record.state,
            RecordState::Completed(response(&[i as u8 + 1]))
        );
    }
    // One hash per scope, plus the sweeper's index.
    assert_eq!(prefix.keys().unwrap().len(), scopes.len() + 1);
}

/// Bodies are bytes, not text: every byte value survives the trip through the scripts, and so
/// do fencing tokens across the whole `i64` range.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn binary_bodies_and_extreme_tokens_round_trip() {
    let (store, _prefix) = fresh_store().await;
    let body: Vec<u8> = (0..=255).collect();
    for (i, token) in [i64::MIN, -1, 0, i64::MAX, 9_007_199_254_740_993]
        .into_iter()
        .enumerate()
    {
        let key = scope("acct_redis", &format!("bytes-key-{i:04}"));
        store.claim(&claim(&key, token, T0)).await.unwrap();
        // A token one off (as a double rounds it) is not the holder's.
        assert!(
            !store
                .renew(&key, FencingToken(token.wrapping_add(1)), T0)
                .await
                .unwrap()
        );
        assert!(matches!(
            store.get(&key).await.unwrap().unwrap().state,
            RecordState::InProgress { token: t, .. } if t == FencingToken(token)
        ));
        let stored = StoredResponse {
            body_omitted: i % 2 == 0,
            ..response(&body)
        };
        assert!(
            store
                .complete(&key, FencingToken(token), &stored)
                .await
                .unwrap()
        );
        assert_eq!(
            store.get(&key).await.unwrap().unwrap().state,
            RecordState::Completed(stored)
        );
    }
}

/// The sweeper's boundary is exact to the millisecond, and a record under a lease past its
/// retention is kept until the lease ends, without standing in the way of the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sweep_boundaries_and_long_leases() {
    let (store, _prefix) = fresh_store().await;
    sweep_boundary_is_exact(&store).await;

    // Five long calls ahead of five finished records, all past retention at `now`.
    let policy = Policy::default();
    let now = T0.plus(policy.retention);
    for i in 0..5 {
        let mut long = claim(&scope("acct_redis", &format!("long-key-{i:04}")), 1, T0);
        long.lease_until = now.plus(Duration::from_secs(60));
        store.claim(&long).await.unwrap();
    }
    for i in 0..5 {
        let key = scope("acct_redis", &format!("done-key-{i:04}"));
        store
            .claim(&claim(&key, 1, T0.plus(Duration::from_secs(1))))
            .await
            .unwrap();
        store
            .complete(&key, FencingToken(1), &response(b"{}"))
            .await
            .unwrap();
    }
    assert_eq!(
        store
            .sweep(now.plus(Duration::from_secs(1)), 5)
            .await
            .unwrap(),
        5
    );
    assert_eq!(
        store
            .sweep(now.plus(Duration::from_secs(1)), 5)
            .await
            .unwrap(),
        0
    );
    // The leases end; so do the long calls.
    assert_eq!(
        store
            .sweep(now.plus(Duration::from_secs(60)), 10)
            .await
            .unwrap(),
        5
    );
}

/// An in-progress record past its retention whose lease still runs holds its key against any
/// claim, the same request's or another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_live_lease_past_retention_holds_the_key() {
    let (store, _prefix) = fresh_store().await;
    let policy = Policy::default();
    let key = scope("acct_redis", "long-call-0001");
    claim_a_long_call(&store, &key).await;

    let now = T0.plus(policy.retention);
    let mut other = claim(&key, 2, now);
    other.fingerprint = fingerprint(r#"{"other":true}"#);
    for attempt in [claim(&key, 3, now), other] {
        match store.claim(&attempt).await.unwrap() {
            ClaimOutcome::Existing(record) => assert!(matches!(
                record.state,
                RecordState::InProgress {
                    token: FencingToken(1),
                    ..
                }
            )),
            ClaimOutcome::Claimed => panic!("claimed a key under a live lease"),
        }
    }
}

/// The sweeper checks each record's stored state, not only its index entry: an entry that
/// says "due" for a record under a live lease deletes nothing and is given its true time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sweep_trusts_the_record_over_the_index() {
    let (store, prefix) = fresh_store().await;
    let policy = Policy::default();
    let key = scope("acct_redis", "long-call-0002");
    let long = claim_a_long_call(&store, &key).await;

    let index = format!("{}:sweep", prefix.prefix);
    let record = format!("{}:k:10:acct_redis:long-call-0002", prefix.prefix);
    let mut conn = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .unwrap();
    let score: Option<i64> = conn.zscore(&index, &record).unwrap();
    assert_eq!(score, Some(long.lease_until.0));
    let () = conn.zadd(&index, &record, 0).unwrap();

    let now = T0.plus(policy.retention);
    assert_eq!(store.sweep(now, 10).await.unwrap(), 0);
    assert!(store.get(&key).await.unwrap().is_some());
    let score: Option<i64> = conn.zscore(&index, &record).unwrap();
    assert_eq!(score, Some(long.lease_until.0));
}

/// Without a sweeper the index stays bounded: the first claim of each second drops entries
/// more than the slack past their time (Redis has expired their records by then, by its own
/// clock), and the claims in between leave the index alone. The record itself is left to its
/// TTL, and by the caller's clock it is expired all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_trim_the_index_past_the_slack() {
    let (store, prefix) = fresh_store().await;
    let retention = Policy::default().retention;
    let old = scope("acct_redis", "old-key-00001");
    store.claim(&claim(&old, 1, T0)).await.unwrap();
    let index = format!("{}:sweep", prefix.prefix);
    let mut conn = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .unwrap();

    // Within the slack the entry stays, for the sweeper.
    let within = T0.plus(retention + RedisStore::TTL_SLACK);
    store
        .claim(&claim(&scope("acct_redis", "new-key-00001"), 1, within))
        .await
        .unwrap();
    let entries: u64 = conn.zcard(&index).unwrap();
    assert_eq!(entries, 2);

    // Past the slack, but within a second of the last trim: left for the next one.
    let soon = within.plus(Duration::from_millis(1));
    store
        .claim(&claim(&scope("acct_redis", "new-key-00002"), 1, soon))
        .await
        .unwrap();
    let entries: u64 = conn.zcard(&index).unwrap();
    assert_eq!(entries, 3, "no trim within a second of the last");

    let past = within.plus(Duration::from_secs(1));
    store
        .claim(&claim(&scope("acct_redis", "new-key-00003"), 1, past))
        .await
        .unwrap();
    let entries: u64 = conn.zcard(&index).unwrap();
    assert_eq!(entries, 3, "the old entry is gone, the new ones stay");
    assert_eq!(
        store.claim(&claim(&old, 2, past)).await.unwrap(),
        ClaimOutcome::Claimed
    );
}
