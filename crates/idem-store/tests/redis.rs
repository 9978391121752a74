//! The conformance suite and Redis's own behaviour against [`RedisStore`], each test under a
//! key prefix of its own on the server at `IDEM_TEST_REDIS_URL` (default: the local server),
//! whose keys are deleted when the test ends, pass or fail.

#![cfg(feature = "redis")]

use std::time::Duration;

use idem_core::{
    Clock, Decision, FencingToken, Policy, RecordState, Scope, StoredResponse, SystemClock,
    Timestamp, decide,
};
use idem_store::conformance::{assert_unavailable, fingerprint, scope};
use idem_store::{
    AdminStore, ClaimOutcome, NewClaim, RecordFilter, RedisStore, Store, admin_conformance,
    shared_admin_conformance, shared_store_conformance, store_conformance,
};
use idem_testkit::fault_relay::FaultRelay;
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
shared_store_conformance!(fresh_store());
admin_conformance!(fresh_store());
shared_admin_conformance!(fresh_store());

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

/// A retention or lease the tests wait out.
const SHORT: Duration = Duration::from_millis(300);

/// The caller's now, by the system's clock.
fn now() -> Timestamp {
    SystemClock.now()
}

/// A claim at the caller's now with `lease` and `retention`.
fn claim_for(scope: &Scope, token: i64, lease: Duration, retention: Duration) -> NewClaim {
    let policy = Policy {
        lease,
        retention,
        ..Policy::default()
    };
    NewClaim::new(
        scope.clone(),
        fingerprint("{}"),
        FencingToken(token),
        now(),
        &policy,
    )
}

/// Completes `keys`, each claimed with a [`SHORT`] retention, and returns once every one has
/// expired by Redis's clock (the last one completed shows it), polling to a deadline.
async fn completed_and_expired(store: &RedisStore, keys: &[Scope]) {
    for key in keys {
        store
            .claim(&claim_for(key, 1, Policy::default().lease, SHORT))
            .await
            .unwrap();
        assert!(
            store
                .complete(key, FencingToken(1), &response(b"{}"), now())
                .await
                .unwrap()
        );
    }
    let last = keys.last().expect("some keys");
    let other = fingerprint(r#"{"other":true}"#);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let at = now();
        let record = store.get(last, at).await.unwrap().unwrap();
        if decide(Some(&record), &other, at) == Decision::Expired {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Redis's own clock, in Unix milliseconds.
fn redis_now(conn: &mut redis::Connection) -> i64 {
    let (seconds, micros): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    seconds * 1000 + micros / 1000
}

/// The record's remaining TTL in Redis, in milliseconds.
fn pttl(key: &str) -> i64 {
    let mut conn = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .unwrap();
    conn.pttl(key).unwrap()
}

/// A record completed when Redis's clock said `completed` (Unix ms) is kept for `retention`
/// from then: its TTL is the retention plus the store's slack, and its index score is its
/// expiry. (The test's own round trips take a little of both, so each is allowed a minute.)
fn assert_kept_for_the_retention(
    conn: &mut redis::Connection,
    index: &str,
    redis_key: &str,
    retention: std::time::Duration,
    completed: i64,
) {
    let expected = (retention + RedisStore::TTL_SLACK).as_millis() as i64;
    let ttl = pttl(redis_key);
    assert!(
        ttl <= expected && ttl > expected - 60_000,
        "TTL {ttl} ms, expected about {expected} ms"
    );
    let expires_at = completed + retention.as_millis() as i64;
    let score: Option<f64> = conn.zscore(index, redis_key).unwrap();
    let score = score.expect("in the index") as i64;
    assert!(
        (expires_at..expires_at + 60_000).contains(&score),
        "scored {score}, expected about {expires_at}"
    );
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
        assert!(matches!(
            store.get(&key, T0).await.unwrap().unwrap().state,
            RecordState::InProgress { token, .. } if token == FencingToken(winners[0])
        ));
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
    assert_unavailable(store.get(&key, T0).await);
    assert_unavailable(store.claim(&claim(&key, 2, T0)).await);
    assert_unavailable(
        store
            .complete(&key, FencingToken(1), &response(b"{}"), T0)
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
        |on| relay.set_black_hole(on),
        Duration::from_secs(4),
        None,
    )
    .await;
}

/// A record in progress has no TTL and waits in the sweeper's index at `+inf`: its outcome is
/// unknown until it is resolved, and Redis must not forget it (docs/contract.md §12). Completing
/// it gives it a TTL of its retention plus the slack and its place in the index, whatever the
/// caller's clock says (one a century from Redis's, one in 1970). The guard leaves no key
/// behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_completed_records_carry_a_ttl_and_the_guard_cleans_up() {
    let prefix = TestPrefix::new();
    let store = prefix.store().await;
    let policy = Policy::default();
    let index = format!("{}:sweep", prefix.prefix);
    let mut conn = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .unwrap();

    for (i, now) in [Timestamp(4_900_000_000_000), Timestamp(1_000)]
        .into_iter()
        .enumerate()
    {
        let key = scope("acct_redis", &format!("ttl-key-{i:05}"));
        store.claim(&claim(&key, 1, now)).await.unwrap();
        let redis_key = format!("{}:k:10:acct_redis:ttl-key-{i:05}", prefix.prefix);
        assert_eq!(pttl(&redis_key), -1, "an unknown outcome must not expire");
        let score: Option<f64> = conn.zscore(&index, &redis_key).unwrap();
        assert_eq!(score, Some(f64::INFINITY));
        assert!(
            store
                .renew(&key, FencingToken(1), policy.lease, now)
                .await
                .unwrap()
        );
        assert_eq!(pttl(&redis_key), -1, "a renewal gives it no TTL");

        let completed = redis_now(&mut conn);
        assert!(
            store
                .complete(&key, FencingToken(1), &response(b"{}"), now)
                .await
                .unwrap()
        );
        assert_kept_for_the_retention(&mut conn, &index, &redis_key, policy.retention, completed);
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
                .complete(scope, FencingToken(token), &response(&[token as u8]), T0)
                .await
                .unwrap()
        );
    }
    for (i, scope) in scopes.iter().enumerate() {
        let record = store.get(scope, T0).await.unwrap().unwrap();
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
                .renew(&key, FencingToken(token.wrapping_add(1)), SHORT, T0)
                .await
                .unwrap()
        );
        assert!(matches!(
            store.get(&key, T0).await.unwrap().unwrap().state,
            RecordState::InProgress { token: t, .. } if t == FencingToken(token)
        ));
        let stored = StoredResponse {
            body_omitted: i % 2 == 0,
            ..response(&body)
        };
        assert!(
            store
                .complete(&key, FencingToken(token), &stored, T0)
                .await
                .unwrap()
        );
        assert_eq!(
            store.get(&key, T0).await.unwrap().unwrap().state,
            RecordState::Completed(stored)
        );
    }
}

/// Records in progress, however old (their leases and retentions run out), are never swept
/// and never stand in front of the completed records the sweeper may delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_in_progress_never_stand_in_the_sweepers_way() {
    let (store, prefix) = fresh_store().await;
    for i in 0..5 {
        let key = scope("acct_redis", &format!("unknown-key-{i:04}"));
        store
            .claim(&claim_for(&key, 1, SHORT, SHORT))
            .await
            .unwrap();
    }
    let done: Vec<_> = (0..5)
        .map(|i| scope("acct_redis", &format!("done-key-{i:04}")))
        .collect();
    completed_and_expired(&store, &done).await;
    assert_eq!(store.sweep(now(), 5).await.unwrap(), 5);
    assert_eq!(store.sweep(now(), 5).await.unwrap(), 0);
    for i in 0..5 {
        let key = scope("acct_redis", &format!("unknown-key-{i:04}"));
        assert!(store.get(&key, now()).await.unwrap().is_some());
    }
    let mut conn = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .unwrap();
    let waiting: u64 = conn
        .zcount(format!("{}:sweep", prefix.prefix), "+inf", "+inf")
        .unwrap();
    assert_eq!(waiting, 5, "the records in progress, counted");
}

/// An in-progress record past its retention holds its key against any claim, the same
/// request's or another's, while its lease runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_live_lease_past_retention_holds_the_key() {
    let (store, _prefix) = fresh_store().await;
    let key = scope("acct_redis", "long-call-0001");
    let long = claim_for(&key, 1, Duration::from_secs(600), SHORT);
    assert_eq!(store.claim(&long).await.unwrap(), ClaimOutcome::Claimed);
    // Claimed after it with the same retention: once expired, so is the long call's.
    completed_and_expired(&store, &[scope("acct_redis", "done-key-0001")]).await;

    let at = now();
    let mut other = claim(&key, 2, at);
    other.fingerprint = fingerprint(r#"{"other":true}"#);
    for attempt in [claim(&key, 3, at), other] {
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
/// says "due" for a record in progress deletes nothing and is given its true place, `+inf`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sweep_trusts_the_record_over_the_index() {
    let (store, prefix) = fresh_store().await;
    let key = scope("acct_redis", "long-call-0002");
    store.claim(&claim(&key, 1, T0)).await.unwrap();

    let index = format!("{}:sweep", prefix.prefix);
    let record = format!("{}:k:10:acct_redis:long-call-0002", prefix.prefix);
    let mut conn = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .unwrap();
    let () = conn.zadd(&index, &record, 0).unwrap();

    assert_eq!(store.sweep(T0, 10).await.unwrap(), 0);
    assert!(store.get(&key, T0).await.unwrap().is_some());
    let score: Option<f64> = conn.zscore(&index, &record).unwrap();
    assert_eq!(score, Some(f64::INFINITY));
}

/// Without a sweeper the index stays bounded: the first claim of each second (by the callers'
/// clock, which only paces it) drops entries more than the slack past their time by Redis's
/// clock (Redis has expired their records by then), and the claims in between leave the index
/// alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_trim_the_index_past_the_slack() {
    let (store, prefix) = fresh_store().await;
    let index = format!("{}:sweep", prefix.prefix);
    let mut conn = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .unwrap();
    let slack = RedisStore::TTL_SLACK.as_millis() as i64;
    // Entries of records Redis has expired: one past the slack, one within it.
    let redis_now = redis_now(&mut conn);
    let () = conn
        .zadd(&index, "gone-past", redis_now - slack - 60_000)
        .unwrap();
    let () = conn
        .zadd(&index, "gone-within", redis_now - slack + 600_000)
        .unwrap();

    store
        .claim(&claim(&scope("acct_redis", "new-key-00001"), 1, T0))
        .await
        .unwrap();
    let left: Vec<String> = conn.zrange(&index, 0, -1).unwrap();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(!left.contains(&"gone-past".to_owned()), "{left:?}");

    // Past the slack, but within a second of the last trim: left for the next one.
    let () = conn
        .zadd(&index, "gone-past-2", redis_now - slack - 60_000)
        .unwrap();
    store
        .claim(&claim(
            &scope("acct_redis", "new-key-00002"),
            1,
            T0.plus(Duration::from_millis(1)),
        ))
        .await
        .unwrap();
    let entries: u64 = conn.zcard(&index).unwrap();
    assert_eq!(entries, 4, "no trim within a second of the last");

    store
        .claim(&claim(
            &scope("acct_redis", "new-key-00003"),
            1,
            T0.plus(Duration::from_secs(1)),
        ))
        .await
        .unwrap();
    let left: Vec<String> = conn.zrange(&index, 0, -1).unwrap();
    assert_eq!(
        left.len(),
        4,
        "the old entry is gone, the new ones stay: {left:?}"
    );
    assert!(left.contains(&"gone-within".to_owned()));
}

/// An operator's outcome is kept and forgotten as a claim's own: the same TTL (retention plus
/// slack) and index score; a purge takes the record and its index entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forced_outcome_gets_a_completions_ttl_and_a_purge_leaves_nothing() {
    let (store, prefix) = fresh_store().await;
    let policy = Policy::default();
    let index = format!("{}:sweep", prefix.prefix);
    let mut conn = redis::Client::open(url())
        .and_then(|c| c.get_connection())
        .unwrap();
    let key = scope("acct_redis", "forced-key-001");
    let redis_key = format!("{}:k:10:acct_redis:forced-key-001", prefix.prefix);
    // A caller's clock years off: the retention still counts from Redis's now.
    store.claim(&claim(&key, 7, T0)).await.unwrap();
    let completed = redis_now(&mut conn);
    assert!(
        store
            .force_complete(&key, &response(b"operator"), T0)
            .await
            .unwrap()
    );
    assert_kept_for_the_retention(&mut conn, &index, &redis_key, policy.retention, completed);
    // The claim's token no longer holds the key.
    assert!(
        !store
            .complete(&key, FencingToken(7), &response(b"late"), T0)
            .await
            .unwrap()
    );

    assert!(store.purge(&key).await.unwrap());
    let left = prefix.keys().unwrap();
    assert!(left.is_empty(), "keys left behind: {left:?}");
}

/// A listing reads every page of the index, keeps the newest, and matches an account whose
/// name holds glob characters literally.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_listing_pages_through_the_index_and_takes_accounts_literally() {
    let (store, _prefix) = fresh_store().await;
    // More than one `ZSCAN` page, in two accounts, one named like a pattern of the other.
    for i in 0..600 {
        let account = if i % 2 == 0 { "acct_*" } else { "acct_x" };
        let key = scope(account, &format!("paged-key-{i:04}"));
        // Each a millisecond later than the last by the caller's clock; Redis's decides,
        // so they are spread out by real time instead, a few at a time.
        store.claim(&claim(&key, 1, T0)).await.unwrap();
        if i % 100 == 99 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let newest = scope("acct_*", "paged-key-last");
    store.claim(&claim(&newest, 1, T0)).await.unwrap();
    let list = |account: Option<&str>, limit| {
        let filter = RecordFilter {
            account: account.map(idem_core::AccountId::new),
            limit,
            ..RecordFilter::default()
        };
        let store = store.clone();
        async move { store.list(&filter, T0).await.unwrap() }
    };
    assert_eq!(list(None, 1000).await.len(), 601);
    let starred = list(Some("acct_*"), 1000).await;
    assert_eq!(starred.len(), 301, "the * is a character, not a pattern");
    assert!(starred.iter().all(|r| r.scope.account.as_str() == "acct_*"));
    assert_eq!(list(Some("acct_?"), 1000).await.len(), 0);
    let top = list(None, 3).await;
    assert_eq!(top.len(), 3);
    assert_eq!(top[0].scope, newest, "newest first");
    assert!(top.windows(2).all(|w| w[0].created_at >= w[1].created_at));
    assert_eq!(list(None, 0).await.len(), 100, "the default limit");
}

/// A key's history is one list beside its record, not under the records' `:k:`, expiring
/// 30 days after its latest event, and requests never write it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_keys_history_is_a_list_that_expires() {
    let (store, prefix) = fresh_store().await;
    let key = scope("acct_a", "history-ttl-01");
    let now = Timestamp(1_800_000_000_000);
    claim_and_complete_without_events(&store, &key, now).await;
    assert!(
        !prefix.keys().unwrap().iter().any(|k| k.contains(":e:")),
        "a request wrote a history"
    );
    let event = idem_core::RecordEvent {
        at: now,
        what: "resolved: released".into(),
        by: "console".into(),
    };
    store.record_event(&key, &event).await.unwrap();
    let events = format!("{}:e:6:acct_a:history-ttl-01", prefix.prefix);
    let mut conn = redis::Client::open(url())
        .unwrap()
        .get_connection()
        .unwrap();
    let ttl: i64 = redis::cmd("PTTL").arg(&events).query(&mut conn).unwrap();
    let retention = i64::try_from(idem_store::EVENTS_RETENTION.as_millis()).unwrap();
    assert!(
        ttl > retention - 60_000 && ttl <= retention,
        "the list expires 30 days on: {ttl} ms"
    );
    let len: i64 = redis::cmd("LLEN").arg(&events).query(&mut conn).unwrap();
    assert_eq!(len, 1);
    assert!(store.purge(&key).await.unwrap());
    let exists: i64 = redis::cmd("EXISTS").arg(&events).query(&mut conn).unwrap();
    assert_eq!(exists, 0, "purged with the record");
}

async fn claim_and_complete_without_events(store: &RedisStore, key: &Scope, now: Timestamp) {
    assert_eq!(
        store.claim(&claim(key, 1, now)).await.unwrap(),
        ClaimOutcome::Claimed
    );
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: b"{}".to_vec(),
        body_omitted: false,
    };
    assert!(
        store
            .complete(key, FencingToken(1), &response, now)
            .await
            .unwrap()
    );
}
