//! The conformance suite: written once, run against every store.
//!
//! A backend's test file instantiates it with [`store_conformance!`](crate::store_conformance)
//! (and [`transactional_conformance!`](crate::transactional_conformance) for transactional
//! stores, [`shared_store_conformance!`](crate::shared_store_conformance) for stores that
//! instances share), giving a factory that makes a fresh, isolated store for each test (its own
//! file, database or key prefix) plus a guard that cleans it up when dropped.
//!
//! Time is the store's (see [One clock](crate#one-clock-the-stores)): a shared store's clock
//! cannot be moved by a test, so a test that needs a lease or a retention to run out gives it a
//! fraction of a second and waits for the store to say it has (polling, to a deadline), then
//! checks that no less time passed. Tests in which time stands still pass a caller's clock years
//! away from the store's, `T0` (in 2027), which a shared store must take in its stride.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_core::{
    AccountId, Clock, Decision, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Policy,
    Record, RecordEvent, RecordState, RequestParts, Scope, StoredResponse, SystemClock, Timestamp,
    decide,
};

use crate::{
    AdminStore, ClaimOutcome, EVENTS_KEPT, Error, NewClaim, RecordFilter, Result, Store,
    TransactionalStore, TxClaim, sweep_all, sweep_all_paced,
};

/// A caller's clock that stands still, years from the store's (2027).
const T0: Timestamp = Timestamp(1_800_000_000_000);

/// A lease or retention a test waits out: short, so the suite stays quick, and long enough
/// that a store cannot pass it by accident in the steps between.
const SHORT: Duration = Duration::from_millis(300);

/// How long a test waits for a store to show what a [`SHORT`] time brings about, far past it
/// on a loaded machine.
const DEADLINE: Duration = Duration::from_secs(30);

/// The caller's now, by the system's clock: the store's own on this machine.
fn now() -> Timestamp {
    SystemClock.now()
}

/// The scope of `key` in `account` (a test key: it must be valid).
///
/// # Panics
///
/// When `key` is not a valid idempotency key (8 to 255 characters of visible ASCII).
pub fn scope(account: &str, key: &str) -> Scope {
    Scope::new(
        AccountId::new(account),
        IdempotencyKey::new(key, KeyLimits::default()).expect("valid test key"),
    )
}

/// The fingerprint of a `POST /payments` with the JSON `body`.
///
/// # Panics
///
/// When `body` is not valid JSON.
pub fn fingerprint(body: &str) -> Fingerprint {
    Fingerprint::compute(&RequestParts {
        account: "acct_a",
        method: "POST",
        route: "/payments",
        query: "",
        content_type: "application/json",
        body: body.as_bytes(),
    })
    .expect("valid test body")
}

fn response(body: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/payments/pay_1".into()),
        ],
        body: body.as_bytes().to_vec(),
        body_omitted: false,
    }
}

fn claim_at(scope: &Scope, fp: Fingerprint, token: i64, now: Timestamp) -> NewClaim {
    NewClaim::new(
        scope.clone(),
        fp,
        FencingToken(token),
        now,
        &Policy::default(),
    )
}

/// A claim at the caller's now with `lease` and `retention`.
fn claim_for(
    scope: &Scope,
    fp: Fingerprint,
    token: i64,
    lease: Duration,
    retention: Duration,
) -> NewClaim {
    let policy = Policy {
        lease,
        retention,
        ..Policy::default()
    };
    NewClaim::new(scope.clone(), fp, FencingToken(token), now(), &policy)
}

/// Claims `key` for the request `fp` with `token` at `now`, and checks that the claim won.
async fn claims<S: Store>(store: &S, key: &Scope, fp: Fingerprint, token: i64, now: Timestamp) {
    claims_with(store, &claim_at(key, fp, token, now)).await;
}

/// Makes `claim`, and checks that it won.
async fn claims_with<S: Store>(store: &S, claim: &NewClaim) {
    assert_eq!(
        store.claim(claim).await.unwrap(),
        ClaimOutcome::Claimed,
        "the claim of {:?} with token {} wins",
        claim.scope,
        claim.token.0
    );
}

/// Whether the holder of `token` stored the response `body` for `key`, now.
async fn completes<S: Store>(store: &S, key: &Scope, token: i64, body: &str) -> bool {
    completes_at(store, key, token, body, now()).await
}

/// Whether the holder of `token` stored the response `body` for `key`, at the caller's `at`.
async fn completes_at<S: Store>(
    store: &S,
    key: &Scope,
    token: i64,
    body: &str,
    at: Timestamp,
) -> bool {
    store
        .complete(key, FencingToken(token), &response(body), at)
        .await
        .unwrap()
}

/// The record `claim` found, when the claim did not win.
async fn found<S: Store>(store: &S, claim: &NewClaim) -> Record {
    match store.claim(claim).await.unwrap() {
        ClaimOutcome::Existing(record) => record,
        ClaimOutcome::Claimed => panic!(
            "the claim of {:?} with token {} won a key a record holds",
            claim.scope, claim.token.0
        ),
    }
}

/// Polls `attempt` until it yields, failing after [`DEADLINE`] with `what` was awaited.
async fn eventually<T, F: Future<Output = Option<T>>>(
    what: &str,
    mut attempt: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(done) = attempt().await {
            return done;
        }
        assert!(Instant::now() < deadline, "waited {DEADLINE:?} for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Checks that `a` and `b` are one record read twice: equal but for their times, which may
/// differ by the time between the reads (a caller's clock that stands still sees a shared
/// store's move).
#[track_caller]
fn same_record(a: &Record, b: &Record) {
    let untimed = |r: &Record| {
        let state = match &r.state {
            RecordState::InProgress { token, .. } => RecordState::InProgress {
                lease_until: Timestamp(0),
                token: *token,
            },
            completed => completed.clone(),
        };
        (r.scope.clone(), r.fingerprint, state)
    };
    assert_eq!(untimed(a), untimed(b));
    let near = |x: Timestamp, y: Timestamp| (x.0 - y.0).abs() < 10_000;
    assert!(
        near(a.created_at, b.created_at) && near(a.expires_at, b.expires_at),
        "{a:?} and {b:?} are far apart"
    );
}

/// Checks that `t` lies within a second of `expected`: a time a store handed back in the
/// caller's frame, computed by the caller from its own now.
#[track_caller]
fn about(t: Timestamp, expected: Timestamp, what: &str) {
    assert!(
        (t.0 - expected.0).abs() <= 1_000,
        "{what}: {t:?} is not about {expected:?} (off by {} ms)",
        t.0 - expected.0
    );
}

/// Checks that `result` is [`Error::Unavailable`], what the layer answers with `503`.
///
/// # Panics
///
/// When `result` is not an [`Error::Unavailable`].
#[track_caller]
pub fn assert_unavailable<T: std::fmt::Debug>(result: Result<T>) {
    match result {
        Err(Error::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// Every operation of `store` ends within `deadline` with [`Error::Unavailable`] while its
/// connections lead into a black hole (nothing gets through, nothing is refused: a dead host, a
/// partition): no store call waits forever (docs/contract.md §12). `black_hole(true)` must put
/// the black hole between the store and its server (idem's tests: a fault relay of
/// idem-testkit's), `black_hole(false)` take it away; it is taken away again at the end. With
/// `transactional`, a claim in a transaction too, which may take its wait on top.
///
/// The operations run at once, each timed from its own start.
///
/// # Panics
///
/// When an operation does not fail with [`Error::Unavailable`] within its deadline, or
/// `store` fails while the record is set up.
pub async fn a_black_hole_is_unavailable_within<S: Store>(
    store: &S,
    black_hole: impl Fn(bool),
    deadline: Duration,
    transactional: Option<BoxedUnit<'_>>,
) {
    use std::future::Future;
    use std::pin::Pin;
    use tokio::time::Instant;

    let key = scope("acct_a", "black-hole-key");
    // A record to act on, and pooled connections to the store, made before the black hole.
    claims(store, &key, fingerprint("{}"), 1, T0).await;
    black_hole(true);
    let wait = BLACK_HOLE_WAIT;
    type Op<'a> = Pin<Box<dyn Future<Output = (&'static str, Duration, String)> + Send + 'a>>;
    fn timed<'a, T: std::fmt::Debug>(
        name: &'static str,
        op: impl Future<Output = Result<T>> + Send + 'a,
    ) -> Op<'a> {
        Box::pin(async move {
            let started = Instant::now();
            let result = op.await;
            let took = started.elapsed();
            let verdict = match result {
                Err(Error::Unavailable(_)) => String::new(),
                other => format!("expected Unavailable, got {other:?}"),
            };
            (name, took, verdict)
        })
    }
    let other = claim_at(
        &scope("acct_a", "black-hole-key2"),
        fingerprint("{}"),
        3,
        T0,
    );
    let stored = response("{}");
    let mut ops: Vec<Op<'_>> = vec![
        timed("get", store.get(&key, T0)),
        timed("claim", store.claim(&other)),
        timed(
            "complete",
            store.complete(&key, FencingToken(1), &stored, T0),
        ),
        timed(
            "renew",
            store.renew(&key, FencingToken(1), Duration::from_secs(60), T0),
        ),
        timed("release", store.release(&key, FencingToken(1))),
        timed("sweep", store.sweep(T0, 100)),
    ];
    if let Some(begin_claim) = transactional {
        ops.push(timed("begin_claim", begin_claim));
    }
    let results = futures_util::future::join_all(ops).await;
    black_hole(false);
    for (name, took, verdict) in results {
        assert!(verdict.is_empty(), "{name} in a black hole: {verdict}");
        let allowed = if name == "begin_claim" {
            deadline + wait
        } else {
            deadline
        };
        assert!(
            took <= allowed,
            "{name} in a black hole took {took:?}, past its deadline of {allowed:?}"
        );
    }
}

/// A transactional store's claim as [`a_black_hole_is_unavailable_within`] takes it.
pub type BoxedUnit<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send + 'a>>;

/// How long the claim in a transaction of [`a_black_hole_is_unavailable_within`] waits for a
/// concurrent claim.
const BLACK_HOLE_WAIT: Duration = Duration::from_millis(500);

/// A claim in a transaction on `store` (not started until polled), for
/// [`a_black_hole_is_unavailable_within`]; what it claimed, if anything, is dropped.
pub fn begin_claim_of<S: TransactionalStore>(store: &S) -> BoxedUnit<'_> {
    let claim = claim_at(
        &scope("acct_a", "black-hole-key3"),
        fingerprint("{}"),
        4,
        T0,
    );
    Box::pin(async move { store.begin_claim(&claim, BLACK_HOLE_WAIT).await.map(|_| ()) })
}

/// The sweeper's boundary, exact to the millisecond: a completed record expiring at E is kept
/// by a sweep at E - 1 ms and deleted by one at E. Called by the tests of backends that store
/// times in another form than the claim's milliseconds, on a store that holds nothing else.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn sweep_boundary_is_exact<S: Store>(store: &S) {
    let key = scope("acct_a", "boundary-key1");
    let mut boundary = claim_at(&key, fingerprint("{}"), 1, Timestamp(1_800_000_000_123));
    boundary.lease_until = Timestamp(1_800_000_000_124);
    boundary.expires_at = Timestamp(1_800_000_000_457);
    assert_eq!(store.claim(&boundary).await.unwrap(), ClaimOutcome::Claimed);
    assert!(completes(store, &key, 1, "{}").await);
    let (before, at) = (Timestamp(1_800_000_000_456), Timestamp(1_800_000_000_457));
    assert_eq!(store.sweep(before, 10).await.unwrap(), 0);
    assert_eq!(store.sweep(at, 10).await.unwrap(), 1);
}

/// 64 tasks claim one key at once: exactly one wins, every other sees its record.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn claim_race_has_one_winner<S: Store>(store: S) {
    let key = scope("acct_a", "race-key-0001");
    let fp = fingerprint(r#"{"amount":1}"#);
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let store = store.clone();
            let claim = claim_at(&key, fp, i + 1, T0);
            tokio::spawn(async move { store.claim(&claim).await })
        })
        .collect();
    let mut winners = 0;
    let mut existing = 0;
    for task in tasks {
        match task.await.expect("task ran").expect("claim succeeded") {
            ClaimOutcome::Claimed => winners += 1,
            ClaimOutcome::Existing(record) => {
                assert!(matches!(record.state, RecordState::InProgress { .. }));
                assert!(matches!(
                    decide(Some(&record), &fp, T0),
                    Decision::InFlight { .. }
                ));
                existing += 1;
            }
        }
    }
    assert_eq!((winners, existing), (1, 63));
}

/// A completed record replays with its exact status, headers and body.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn completed_record_replays<S: Store>(store: S) {
    let key = scope("acct_a", "replay-key-01");
    let fp = fingerprint(r#"{"amount":1}"#);
    claims(&store, &key, fp, 7, T0).await;
    let body = r#"{"id":"pay_1"}"#;
    let stored = response(body);
    assert!(completes_at(&store, &key, 7, body, T0).await);
    let record = store.get(&key, T0).await.unwrap().expect("record exists");
    assert_eq!(record.fingerprint, fp);
    assert_eq!(decide(Some(&record), &fp, T0), Decision::Replay(&stored));
    // A second claim does not disturb it.
    let again = found(&store, &claim_at(&key, fp, 8, T0)).await;
    same_record(&again, &record);
}

/// A different request with the same key is a mismatch and leaves the record untouched; the
/// same key from another account is unrelated.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn mismatch_leaves_record_untouched<S: Store>(store: S) {
    let key = scope("acct_a", "mismatch-key1");
    let fp = fingerprint(r#"{"amount":1}"#);
    let other = fingerprint(r#"{"amount":2}"#);
    claims(&store, &key, fp, 1, T0).await;
    assert!(completes_at(&store, &key, 1, "{}", T0).await);
    let record = found(&store, &claim_at(&key, other, 2, T0)).await;
    assert_eq!(decide(Some(&record), &other, T0), Decision::Mismatch);
    let record = store.get(&key, T0).await.unwrap().unwrap();
    assert_eq!(record.fingerprint, fp);
    assert_eq!(record.state, RecordState::Completed(response("{}")));

    claims(&store, &scope("acct_b", "mismatch-key1"), other, 3, T0).await;
}

/// Only the holder of the current fencing token may store an outcome, renew or release.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn fencing_token_guards_the_outcome<S: Store>(store: S) {
    let key = scope("acct_a", "fenced-key-01");
    let fp = fingerprint("{}");
    claims(&store, &key, fp, 10, T0).await;
    assert!(!completes_at(&store, &key, 11, "x", T0).await);
    let lease = Duration::from_secs(60);
    assert!(
        !store
            .renew(&key, FencingToken(11), lease, T0)
            .await
            .unwrap()
    );
    assert!(!store.release(&key, FencingToken(11)).await.unwrap());
    assert!(matches!(
        store.get(&key, T0).await.unwrap().unwrap().state,
        RecordState::InProgress {
            token: FencingToken(10),
            ..
        }
    ));
    assert!(completes_at(&store, &key, 10, "ok", T0).await);
    // A completed record can be neither completed again, renewed nor released.
    assert!(!completes_at(&store, &key, 10, "again", T0).await);
    assert!(
        !store
            .renew(&key, FencingToken(10), lease, T0)
            .await
            .unwrap()
    );
    assert!(!store.release(&key, FencingToken(10)).await.unwrap());
}

/// A claim whose lease runs out can be taken over by the same request (with a new token), never
/// by a different one, and not before its lease has run; the old holder is then fenced out.
/// Renewal keeps a lease alive.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn lease_expiry_and_renewal<S: Store>(store: S) {
    let fp = fingerprint("{}");
    let other = fingerprint(r#"{"x":1}"#);

    // Within the lease: in flight.
    let held = scope("acct_a", "lease-key-001");
    claims(&store, &held, fp, 1, now()).await;
    let at = now();
    let running = found(&store, &claim_at(&held, fp, 2, at)).await;
    match decide(Some(&running), &fp, at) {
        Decision::InFlight { retry_after } => assert!(retry_after <= Policy::default().lease),
        other => panic!("expected in flight, got {other:?}"),
    }
    let RecordState::InProgress { lease_until, .. } = running.state else {
        panic!("in progress")
    };
    about(lease_until, at.plus(Policy::default().lease), "the lease");

    // Renewed before its short lease ran out, a claim holds past it: once a twin claimed just
    // after it has lost its lease, so has its first one.
    let (renewed, twin) = (
        scope("acct_a", "lease-key-002"),
        scope("acct_a", "lease-key-003"),
    );
    claims_with(
        &store,
        &claim_for(&renewed, fp, 1, SHORT, Policy::default().retention),
    )
    .await;
    claims_with(
        &store,
        &claim_for(&twin, fp, 1, SHORT, Policy::default().retention),
    )
    .await;
    let lease = Duration::from_secs(30);
    assert!(
        store
            .renew(&renewed, FencingToken(1), lease, now())
            .await
            .unwrap()
    );
    eventually("the twin's lease to run out", || async {
        match store.claim(&claim_at(&twin, fp, 2, now())).await.unwrap() {
            ClaimOutcome::Claimed => Some(()),
            ClaimOutcome::Existing(_) => None,
        }
    })
    .await;
    let at = now();
    let record = found(&store, &claim_at(&renewed, fp, 3, at)).await;
    assert!(matches!(
        decide(Some(&record), &fp, at),
        Decision::InFlight { .. }
    ));

    // A short lease: a different request never takes it over; the same one, not allowed to
    // take over, learns the outcome is unknown once the lease has run out, and not before.
    let stale = scope("acct_a", "lease-key-004");
    let claimed = Instant::now();
    claims_with(
        &store,
        &claim_for(&stale, fp, 1, SHORT, Policy::default().retention),
    )
    .await;
    let token = eventually("the lease to run out", || async {
        let at = now();
        let mismatch = found(&store, &claim_at(&stale, other, 4, at)).await;
        assert_eq!(decide(Some(&mismatch), &other, at), Decision::Mismatch);
        let mut no_takeover = claim_at(&stale, fp, 5, at);
        no_takeover.take_over_expired_lease = false;
        let record = found(&store, &no_takeover).await;
        match decide(Some(&record), &fp, at) {
            Decision::InFlight { .. } => None,
            Decision::LeaseExpired { token } => Some(token),
            other => panic!("expected in flight or an expired lease, got {other:?}"),
        }
    })
    .await;
    assert_eq!(token, FencingToken(1));
    assert!(
        claimed.elapsed() >= SHORT,
        "taken over before its lease ran out"
    );
    // ... but the same request may take it over, and the old holder is fenced out.
    claims(&store, &stale, fp, 6, now()).await;
    assert!(!completes(&store, &stale, 1, "old").await);
    assert!(completes(&store, &stale, 6, "new").await);
}

/// A completed record past its retention is new again, and not before; a released key is new
/// at once.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn retention_and_release<S: Store>(store: S) {
    let fp = fingerprint("{}");
    let kept = scope("acct_a", "retained-key1");
    claims(&store, &kept, fp, 1, now()).await;
    assert!(completes(&store, &kept, 1, "first").await);
    let at = now();
    let record = found(&store, &claim_at(&kept, fp, 2, at)).await;
    assert!(matches!(decide(Some(&record), &fp, at), Decision::Replay(r) if r.body == b"first"));
    about(
        record.expires_at,
        at.plus(Policy::default().retention),
        "the expiry",
    );

    let key = scope("acct_a", "retained-key2");
    claims_with(
        &store,
        &claim_for(&key, fp, 1, Policy::default().lease, SHORT),
    )
    .await;
    let completed = Instant::now();
    assert!(completes(&store, &key, 1, "first").await);
    let different = fingerprint(r#"{"new":true}"#);
    eventually("the retention to end", || async {
        let at = now();
        match store
            .claim(&claim_at(&key, different, 3, at))
            .await
            .unwrap()
        {
            ClaimOutcome::Claimed => Some(()),
            ClaimOutcome::Existing(record) => {
                assert_eq!(decide(Some(&record), &different, at), Decision::Mismatch);
                None
            }
        }
    })
    .await;
    assert!(
        completed.elapsed() >= SHORT,
        "claimed anew before the retention ended"
    );
    let at = now();
    let record = store.get(&key, at).await.unwrap().unwrap();
    assert_eq!(record.fingerprint, different);
    assert!(matches!(
        record.state,
        RecordState::InProgress {
            token: FencingToken(3),
            ..
        }
    ));
    about(record.created_at, at, "the new claim's time");

    assert!(store.release(&key, FencingToken(3)).await.unwrap());
    assert_eq!(store.get(&key, now()).await.unwrap(), None);
    claims(&store, &key, fp, 4, now()).await;
}

/// An outcome nobody knows never expires into a fresh claim (docs/contract.md §12): a record in
/// progress whose lease and retention have both run out is still the same request's (whose
/// retry learns the outcome is unknown) and a mismatch for any other; the sweeper leaves it.
/// Once resolved (completed late, as a reconciler does with the stale token), its retention
/// counts from the resolution.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn an_unknown_outcome_never_expires<S: Store>(store: S) {
    let fp = fingerprint(r#"{"amount":7}"#);
    let other = fingerprint(r#"{"amount":8}"#);
    let unknown = scope("acct_a", "unknown-key-01");
    claims_with(&store, &claim_for(&unknown, fp, 1, SHORT, SHORT)).await;
    // Claimed and completed after it with the same retention: once their retention has ended
    // (the one sweepable, the other claimed anew), so has the unknown record's.
    let (swept, renewed) = (
        scope("acct_a", "unknown-key-02"),
        scope("acct_a", "unknown-key-03"),
    );
    for key in [&swept, &renewed] {
        claims_with(&store, &claim_for(key, fp, 1, SHORT, SHORT)).await;
        assert!(completes(&store, key, 1, "{}").await);
    }
    eventually("the retention to end", || async {
        match store
            .claim(&claim_at(&renewed, other, 2, now()))
            .await
            .unwrap()
        {
            ClaimOutcome::Claimed => Some(()),
            ClaimOutcome::Existing(_) => None,
        }
    })
    .await;

    let at = now();
    let mut retry = claim_at(&unknown, fp, 3, at);
    retry.take_over_expired_lease = false;
    let record = found(&store, &retry).await;
    assert_eq!(
        decide(Some(&record), &fp, at),
        Decision::LeaseExpired {
            token: FencingToken(1)
        },
        "the retry learns the outcome is unknown"
    );
    let record = found(&store, &claim_at(&unknown, other, 4, at)).await;
    assert_eq!(decide(Some(&record), &other, at), Decision::Mismatch);

    assert_eq!(
        sweep_all(&store, now(), 10).await.unwrap(),
        1,
        "the completed one"
    );
    assert_eq!(store.get(&swept, now()).await.unwrap(), None);
    let left = store.get(&unknown, now()).await.unwrap();
    assert!(
        matches!(
            left,
            Some(Record {
                state: RecordState::InProgress { .. },
                ..
            })
        ),
        "the sweeper deleted an unknown outcome: {left:?}"
    );

    // Resolved at last: kept for a whole retention from now, however old its claim.
    let resolved = Instant::now();
    assert!(completes(&store, &unknown, 1, "resolved").await);
    let at = now();
    let record = store.get(&unknown, at).await.unwrap().unwrap();
    assert!(matches!(decide(Some(&record), &fp, at), Decision::Replay(r) if r.body == b"resolved"));
    assert!(record.expires_at > at, "expired at once: {record:?}");
    about(
        record.expires_at,
        at.plus(SHORT),
        "the retention from the resolution",
    );
    eventually("the resolved record to expire", || async {
        let at = now();
        let record = store.get(&unknown, at).await.unwrap().unwrap();
        (decide(Some(&record), &other, at) == Decision::Expired).then_some(())
    })
    .await;
    assert!(
        resolved.elapsed() >= SHORT,
        "expired before a retention from its resolution"
    );
}

/// The records [`sweep_deletes_expired_in_batches`] and [`sweep_spares_keys_claimed_again`]
/// start from: `n` records of `fp` under `prefix`, each completed with a [`SHORT`] retention;
/// returns their scopes once every one has expired.
async fn expired_records<S: Store>(
    store: &S,
    prefix: &str,
    n: usize,
    fp: Fingerprint,
) -> Vec<Scope> {
    let keys: Vec<_> = (0..n)
        .map(|i| scope("acct_a", &format!("{prefix}-{i:05}")))
        .collect();
    for key in &keys {
        claims_with(
            store,
            &claim_for(key, fp, 1, Policy::default().lease, SHORT),
        )
        .await;
        assert!(completes(store, key, 1, "{}").await);
    }
    // The last one completed is the last to expire.
    let last = keys.last().expect("some records");
    let other = fingerprint(r#"{"not":"it"}"#);
    eventually("the records to expire", || async {
        let at = now();
        let record = store.get(last, at).await.unwrap().unwrap();
        (decide(Some(&record), &other, at) == Decision::Expired).then_some(())
    })
    .await;
    keys
}

/// The sweeper deletes expired records in bounded batches, keeps live ones and records in
/// progress (a long call under a live lease, and an unknown outcome whose lease and retention
/// ran out), and is safe to run from several places at once.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn sweep_deletes_expired_in_batches<S: Store>(store: S) {
    let fp = fingerprint("{}");
    let fresh = scope("acct_a", "fresh-key-001");
    claims(&store, &fresh, fp, 1, now()).await;
    assert!(completes(&store, &fresh, 1, "{}").await);
    let long = scope("acct_a", "long-call-001");
    claims_with(
        &store,
        &claim_for(&long, fp, 1, Duration::from_secs(600), SHORT),
    )
    .await;
    let unknown = scope("acct_a", "unknown-call1");
    claims_with(&store, &claim_for(&unknown, fp, 1, SHORT, SHORT)).await;
    let old = expired_records(&store, "old-key", 250, fp).await;

    let at = now();
    assert_eq!(store.sweep(at, 100).await.unwrap(), 100);
    // Two sweepers at once (one pausing between its batches) delete the rest between them,
    // each row once.
    let (a, b) = tokio::join!(
        sweep_all(&store, at, 40),
        sweep_all_paced(&store, at, 40, 1)
    );
    assert_eq!(a.unwrap() + b.unwrap(), 150);
    assert_eq!(store.sweep(now(), 100).await.unwrap(), 0);
    assert!(store.get(&fresh, now()).await.unwrap().is_some());
    assert!(store.get(&long, now()).await.unwrap().is_some());
    assert!(store.get(&unknown, now()).await.unwrap().is_some());
    assert_eq!(store.get(&old[7], now()).await.unwrap(), None);
}

/// A sweep racing claims that take expired keys afresh deletes none of the new records: a
/// row the sweeper chose while it was expired is checked again once it is locked. 200 expired
/// records are claimed again by one task each while two sweepers delete in small batches.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn sweep_spares_keys_claimed_again<S: Store>(store: S) {
    let (old, new) = (fingerprint("{}"), fingerprint(r#"{"again":true}"#));
    let keys = expired_records(&store, "again-key", 200, old).await;
    let at = now();
    let claimers: Vec<_> = keys
        .iter()
        .map(|key| {
            let (store, claim) = (store.clone(), claim_at(key, new, 2, at));
            tokio::spawn(async move { store.claim(&claim).await })
        })
        .collect();
    let (a, b) = tokio::join!(sweep_all(&store, at, 7), sweep_all(&store, at, 5));
    let swept = a.unwrap() + b.unwrap();
    for claimer in claimers {
        assert_eq!(
            claimer.await.expect("task ran").unwrap(),
            ClaimOutcome::Claimed,
            "an expired key gives way"
        );
    }
    assert!(swept <= 200, "each old record is deleted once at most");
    for key in &keys {
        let record = store.get(key, now()).await.unwrap();
        let record = record.unwrap_or_else(|| panic!("the sweeper deleted {key:?}'s new claim"));
        assert_eq!(record.fingerprint, new);
        assert!(matches!(
            record.state,
            RecordState::InProgress {
                token: FencingToken(2),
                ..
            }
        ));
    }
    assert_eq!(store.sweep(now(), 100).await.unwrap(), 0);
}

/// A store that instances share judges time by its own clock: a claim made through a handle
/// whose caller's clock is minutes ahead or behind can neither take a live lease over nor find
/// a completed record expired, a sweep by such a clock deletes nothing live, and the times it
/// sees are right in its own frame (docs/contract.md §12).
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn a_caller_clock_minutes_off_changes_nothing<S: Store>(store: S) {
    let fp = fingerprint(r#"{"amount":3}"#);
    let other = fingerprint(r#"{"amount":4}"#);
    let lease = Policy::default().lease;
    let minutes = Duration::from_secs(300);
    let ahead = || now().plus(minutes);
    let behind = || Timestamp(now().0 - 300_000);

    let key = scope("acct_a", "skewed-key-01");
    claims(&store, &key, fp, 1, now()).await;
    for (at, clock) in [(ahead(), "ahead"), (behind(), "behind")] {
        let record = found(&store, &claim_at(&key, fp, 2, at)).await;
        match decide(Some(&record), &fp, at) {
            Decision::InFlight { retry_after } => {
                assert!(retry_after <= lease, "{clock}: {retry_after:?}")
            }
            other => panic!("a caller {clock} took a live lease for {other:?}"),
        }
        about(record.created_at, at, clock);
        let RecordState::InProgress { lease_until, .. } = record.state else {
            panic!("in progress")
        };
        about(lease_until, at.plus(lease), clock);
    }
    // A renewal by a clock ahead runs the lease from the store's now.
    assert!(
        store
            .renew(&key, FencingToken(1), lease, ahead())
            .await
            .unwrap()
    );
    let at = ahead();
    let record = store.get(&key, at).await.unwrap().unwrap();
    let RecordState::InProgress { lease_until, .. } = record.state else {
        panic!("in progress")
    };
    about(lease_until, at.plus(lease), "the renewed lease");

    // A short retention, judged by the store's clock whatever the caller's says.
    let done = scope("acct_a", "skewed-key-02");
    claims_with(
        &store,
        &claim_for(&done, fp, 1, lease, Duration::from_secs(60)),
    )
    .await;
    assert!(completes(&store, &done, 1, "{}").await);
    let at = ahead();
    let record = found(&store, &claim_at(&done, other, 3, at)).await;
    assert_eq!(
        decide(Some(&record), &other, at),
        Decision::Mismatch,
        "expired early"
    );
    about(
        record.expires_at,
        at.plus(Duration::from_secs(60)),
        "the expiry",
    );
    assert_eq!(
        store.sweep(ahead(), 10).await.unwrap(),
        0,
        "swept a live record"
    );
    assert_eq!(
        store
            .sweep(now().plus(Duration::from_secs(86_400)), 10)
            .await
            .unwrap(),
        0
    );
    let at = behind();
    let record = store.get(&done, at).await.unwrap().unwrap();
    about(
        record.expires_at,
        at.plus(Duration::from_secs(60)),
        "the expiry, behind",
    );
}

/// Times are kept to the millisecond: the distances a claim gives (a lease of 1 ms, a
/// retention of 333 ms) come back exact in any caller's frame, however far it is from the
/// store's, and a completed record is swept once its retention has run, not before.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn times_are_kept_to_the_millisecond<S: Store>(store: S) {
    let fp = fingerprint("{}");
    for (i, frame) in [T0, Timestamp(0), Timestamp(-62_135_596_800_001), now()]
        .into_iter()
        .enumerate()
    {
        let key = scope("acct_a", &format!("exact-key-{i:03}"));
        let mut claim = claim_at(&key, fp, 1, frame);
        claim.lease_until = Timestamp(frame.0 + 1);
        claim.expires_at = Timestamp(frame.0 + 333);
        claims_with(&store, &claim).await;
        let record = store.get(&key, frame).await.unwrap().unwrap();
        about(record.created_at, frame, "created_at");
        assert_eq!(record.expires_at.0 - record.created_at.0, 333);
        let RecordState::InProgress { lease_until, .. } = record.state else {
            panic!("in progress")
        };
        assert_eq!(lease_until.0 - record.created_at.0, 1);
    }

    let key = scope("acct_a", "exact-sweep01");
    let mut claim = claim_at(&key, fp, 1, now());
    claim.expires_at = Timestamp(claim.now.0 + 333);
    claims_with(&store, &claim).await;
    let completed = Instant::now();
    assert!(completes(&store, &key, 1, "{}").await);
    eventually("the sweeper to delete it", || async {
        (store.sweep(now(), 10).await.unwrap() == 1).then_some(())
    })
    .await;
    assert!(
        completed.elapsed() >= Duration::from_millis(333),
        "swept early"
    );
    assert_eq!(store.get(&key, now()).await.unwrap(), None);
}

/// Transaction mode: the key row commits with the response; a rollback takes the key with it;
/// 64 concurrent transactions on one key have one winner and the rest see its outcome.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn transaction_mode_commits_or_rolls_back<S: TransactionalStore>(store: S) {
    let wait = Duration::from_secs(10);
    let key = scope("acct_a", "tx-key-000001");
    let fp = fingerprint("{}");

    let TxClaim::Claimed(tx) = store
        .begin_claim(&claim_at(&key, fp, 1, T0), wait)
        .await
        .unwrap()
    else {
        panic!("first claim must win")
    };
    store.rollback(tx).await.unwrap();
    assert_eq!(
        store.get(&key, T0).await.unwrap(),
        None,
        "rollback leaves no key row"
    );

    let winners = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let store = store.clone();
            let key = key.clone();
            let winners = winners.clone();
            tokio::spawn(async move {
                match store
                    .begin_claim(&claim_at(&key, fp, i + 10, T0), wait)
                    .await
                    .unwrap()
                {
                    TxClaim::Claimed(tx) => {
                        winners.fetch_add(1, Ordering::SeqCst);
                        store
                            .commit_response(tx, &key, FencingToken(i + 10), &response("{}"))
                            .await
                            .unwrap();
                        None
                    }
                    TxClaim::Existing(record) => Some(record),
                    TxClaim::Busy => panic!("a 10 s wait ran out"),
                }
            })
        })
        .collect();
    for task in tasks {
        if let Some(record) = task.await.unwrap() {
            assert!(matches!(
                decide(Some(&record), &fp, T0),
                Decision::Replay(_)
            ));
        }
    }
    assert_eq!(winners.load(Ordering::SeqCst), 1);
}

/// A duplicate waiting on an open transaction gives up after its wait with `Busy`.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn transaction_wait_is_bounded<S: TransactionalStore>(store: S) {
    let key = scope("acct_a", "tx-busy-00001");
    let fp = fingerprint("{}");
    let TxClaim::Claimed(tx) = store
        .begin_claim(&claim_at(&key, fp, 1, T0), Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!("first claim must win")
    };
    // Long enough for a second connection to open on a loaded machine (a pool with room that
    // yields none within the wait reports the database out of reach), short for a test.
    let second = store
        .begin_claim(&claim_at(&key, fp, 2, T0), Duration::from_secs(1))
        .await
        .unwrap();
    assert!(matches!(second, TxClaim::Busy), "got {second:?}");
    store.rollback(tx).await.unwrap();
}

/// Begins a transaction that must claim `claim`, and commits `body` as its response.
async fn claims_in_tx<S: TransactionalStore>(store: &S, claim: &NewClaim, body: &str) {
    match store
        .begin_claim(claim, Duration::from_secs(10))
        .await
        .unwrap()
    {
        TxClaim::Claimed(tx) => store
            .commit_response(tx, &claim.scope, claim.token, &response(body))
            .await
            .unwrap(),
        other => panic!("expected to claim {:?}, got {other:?}", claim.scope),
    }
}

/// What a transaction's claim found, when it must not claim.
async fn found_in_tx<S: TransactionalStore>(store: &S, claim: &NewClaim) -> idem_core::Record {
    match store
        .begin_claim(claim, Duration::from_secs(10))
        .await
        .unwrap()
    {
        TxClaim::Existing(record) => record,
        TxClaim::Claimed(tx) => {
            store.rollback(tx).await.unwrap();
            panic!("claimed {:?}, which a record holds", claim.scope)
        }
        TxClaim::Busy => panic!("a 10 s wait ran out"),
    }
}

/// In a transaction as in lease mode, a committed record answers a claim (a replay, a
/// mismatch) until its retention ends, and not after; then the next claim replaces it, in a
/// transaction that commits the new request's record, or rolls back and leaves the old one.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn transaction_mode_replaces_an_expired_record<S: TransactionalStore>(store: S) {
    let (fp, other) = (fingerprint("{}"), fingerprint(r#"{"b":2}"#));
    let kept = scope("acct_a", "tx-kept-00001");
    claims_in_tx(&store, &claim_at(&kept, fp, 1, now()), "first").await;
    let at = now();
    let replay = found_in_tx(&store, &claim_at(&kept, fp, 2, at)).await;
    assert!(matches!(decide(Some(&replay), &fp, at), Decision::Replay(r) if r.body == b"first"));
    let mismatch = found_in_tx(&store, &claim_at(&kept, other, 3, at)).await;
    assert_eq!(decide(Some(&mismatch), &other, at), Decision::Mismatch);

    let key = scope("acct_a", "tx-expired-01");
    let claimed = Instant::now();
    claims_in_tx(
        &store,
        &claim_for(&key, fp, 1, Policy::default().lease, SHORT),
        "first",
    )
    .await;
    let tx = eventually("the retention to end", || async {
        let at = now();
        match store
            .begin_claim(&claim_at(&key, other, 4, at), Duration::from_secs(10))
            .await
            .unwrap()
        {
            TxClaim::Claimed(tx) => Some(tx),
            TxClaim::Existing(record) => {
                assert_eq!(decide(Some(&record), &other, at), Decision::Mismatch);
                None
            }
            TxClaim::Busy => panic!("a 10 s wait ran out"),
        }
    })
    .await;
    assert!(
        claimed.elapsed() >= SHORT,
        "replaced before its retention ended"
    );
    store.rollback(tx).await.unwrap();
    let left = store.get(&key, now()).await.unwrap().unwrap();
    assert_eq!(left.fingerprint, fp, "the rollback keeps the old record");

    let at = now();
    claims_in_tx(&store, &claim_at(&key, other, 5, at), "second").await;
    let record = store.get(&key, at).await.unwrap().unwrap();
    assert_eq!(record.fingerprint, other);
    assert!(
        matches!(decide(Some(&record), &other, at), Decision::Replay(r) if r.body == b"second")
    );
}

/// A lease-mode claim of the same request whose lease ran out (its worker crashed) is taken
/// over by a transaction's claim, unless take-over is off; a different request's is not.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn transaction_mode_takes_over_only_a_stale_lease_of_the_same_request<
    S: TransactionalStore,
>(
    store: S,
) {
    let (fp, other) = (fingerprint("{}"), fingerprint(r#"{"c":3}"#));
    let live = scope("acct_a", "tx-live-00001");
    claims(&store, &live, fp, 1, now()).await;
    let at = now();
    let running = found_in_tx(&store, &claim_at(&live, fp, 2, at)).await;
    assert!(matches!(
        decide(Some(&running), &fp, at),
        Decision::InFlight { .. }
    ));

    let key = scope("acct_a", "tx-stale-0001");
    let claimed = Instant::now();
    claims_with(
        &store,
        &claim_for(&key, fp, 1, SHORT, Policy::default().retention),
    )
    .await;
    eventually("the lease to run out", || async {
        let at = now();
        let mismatch = found_in_tx(&store, &claim_at(&key, other, 3, at)).await;
        assert_eq!(decide(Some(&mismatch), &other, at), Decision::Mismatch);
        let mut no_takeover = claim_at(&key, fp, 4, at);
        no_takeover.take_over_expired_lease = false;
        let left = found_in_tx(&store, &no_takeover).await;
        match decide(Some(&left), &fp, at) {
            Decision::InFlight { .. } => None,
            Decision::LeaseExpired {
                token: FencingToken(1),
            } => Some(()),
            other => panic!("expected in flight or an expired lease, got {other:?}"),
        }
    })
    .await;
    assert!(
        claimed.elapsed() >= SHORT,
        "taken over before its lease ran out"
    );

    claims_in_tx(&store, &claim_at(&key, fp, 5, now()), "taken over").await;
    assert!(
        !completes(&store, &key, 1, "late").await,
        "the old holder is fenced out"
    );
    let at = now();
    let record = store.get(&key, at).await.unwrap().unwrap();
    assert!(
        matches!(decide(Some(&record), &fp, at), Decision::Replay(r) if r.body == b"taken over")
    );
}

/// Operators list records by account, state and expired lease, purge one, and complete an
/// in-progress one whatever its token.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn admin_lists_purges_and_force_completes<S: AdminStore>(store: S) {
    let records = AdminRecords::store(&store).await;
    lists_by_account_state_lease_and_limit(&store, &records).await;
    force_completes_only_in_progress_records(&store, &records).await;
    purges_once(&store, &records.done).await;
}

/// The admin checks' records: one completed and one in progress (its lease [`SHORT`]) in
/// `acct_a`, one in progress (the default lease) in `acct_b`, claimed in that order.
struct AdminRecords {
    done: Scope,
    running: Scope,
    other: Scope,
    /// When `running` was claimed.
    running_claimed: Instant,
}

impl AdminRecords {
    async fn store<S: Store>(store: &S) -> Self {
        let fp = fingerprint("{}");
        let (done, running, other) = (
            scope("acct_a", "admin-done-001"),
            scope("acct_a", "admin-running-1"),
            scope("acct_b", "admin-other-01"),
        );
        // Apart by a few milliseconds, so that their times differ: the listing is newest first.
        let apart = || tokio::time::sleep(Duration::from_millis(5));
        claims(store, &done, fp, 1, now()).await;
        assert!(completes(store, &done, 1, "{}").await);
        apart().await;
        let running_claimed = Instant::now();
        claims_with(
            store,
            &claim_for(&running, fp, 2, SHORT, Policy::default().retention),
        )
        .await;
        apart().await;
        claims(store, &other, fp, 3, now()).await;
        Self {
            done,
            running,
            other,
            running_claimed,
        }
    }
}

async fn lists_by_account_state_lease_and_limit<S: AdminStore>(store: &S, records: &AdminRecords) {
    let list = |filter: RecordFilter| async move { store.list(&filter, now()).await.unwrap() };
    let all = list(RecordFilter::default()).await;
    assert_eq!(all.len(), 3);
    assert_eq!(all[0].scope, records.other, "newest first");
    let mine = RecordFilter {
        account: Some(AccountId::new("acct_a")),
        ..Default::default()
    };
    assert_eq!(list(mine).await.len(), 2);
    let in_progress = RecordFilter {
        in_progress: Some(true),
        ..Default::default()
    };
    assert_eq!(list(in_progress).await.len(), 2);
    let stale_by = |at| RecordFilter {
        lease_expired_by: Some(at),
        ..Default::default()
    };
    // A minute from now, in the caller's frame, both leases have run out.
    let at = now();
    let later = store
        .list(&stale_by(at.plus(Duration::from_secs(60))), at)
        .await
        .unwrap();
    assert_eq!(later.len(), 2);
    // By now, the short one once it has run, never the other.
    let stale = eventually("the short lease to run out", || async {
        let at = now();
        let stale = store.list(&stale_by(at), at).await.unwrap();
        (!stale.is_empty()).then_some(stale)
    })
    .await;
    assert!(
        records.running_claimed.elapsed() >= SHORT,
        "listed before its lease ran out"
    );
    assert_eq!(stale.len(), 1);
    assert_eq!(stale[0].scope, records.running);
    let limited = RecordFilter {
        limit: 1,
        ..Default::default()
    };
    assert_eq!(list(limited).await.len(), 1);
}

/// An operator completes a record in progress, whatever its token (its lease ran out: the
/// listing above waited for it), and its retention counts from then; a completed record or
/// none is left alone.
async fn force_completes_only_in_progress_records<S: AdminStore>(
    store: &S,
    records: &AdminRecords,
) {
    let (done, running) = (&records.done, &records.running);
    let none = scope("acct_a", "admin-none-001");
    let force = |scope: Scope, body: &'static str| async move {
        store
            .force_complete(&scope, &response(body), now())
            .await
            .unwrap()
    };
    assert!(force(running.clone(), "operator").await);
    assert!(!force(done.clone(), "again").await);
    assert!(!force(none.clone(), "none").await);
    let resolved = store.get(running, now()).await.unwrap().unwrap();
    assert!(matches!(
        resolved.state,
        RecordState::Completed(ref r) if r.body == b"operator"
    ));
    let kept = resolved.expires_at.0 - resolved.created_at.0;
    let retention = Policy::default().retention.as_millis() as i64;
    assert!(
        kept >= retention + SHORT.as_millis() as i64,
        "kept {kept} ms from the claim: the retention counts from the claim, not the resolution"
    );
    assert!(matches!(
        store.get(done, now()).await.unwrap().unwrap().state,
        RecordState::Completed(ref r) if r.body == b"{}"
    ));
    assert_eq!(store.get(&none, now()).await.unwrap(), None);
}

/// A shared store lists leases by its own clock: a listing by a caller's clock minutes ahead,
/// for leases run out by that caller's now, leaves out a lease still running.
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn a_listing_by_a_clock_ahead_sees_live_leases_running<S: AdminStore>(store: S) {
    let key = scope("acct_a", "skewed-list-01");
    claims(&store, &key, fingerprint("{}"), 1, now()).await;
    let ahead = now().plus(Duration::from_secs(300));
    let stale = RecordFilter {
        lease_expired_by: Some(ahead),
        ..Default::default()
    };
    assert!(
        store.list(&stale, ahead).await.unwrap().is_empty(),
        "listed a live lease as run out"
    );
    let listed = store.list(&RecordFilter::default(), ahead).await.unwrap();
    assert_eq!(listed.len(), 1);
    about(
        listed[0].created_at,
        ahead,
        "the claim's time, in the caller's frame",
    );
}

async fn purges_once<S: AdminStore>(store: &S, done: &Scope) {
    assert!(store.purge(done).await.unwrap());
    assert!(!store.purge(done).await.unwrap());
    assert_eq!(store.get(done, now()).await.unwrap(), None);
}

/// A key's history: events come back oldest first, each key's and account's apart, whether
/// the key has a record or not; a release leaves them, a purge deletes them, and a key keeps
/// its latest [`EVENTS_KEPT`].
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn admin_keeps_a_history_of_events<S: AdminStore>(store: S) {
    let event = |at: i64, what: &str, by: &str| RecordEvent {
        at: Timestamp(T0.0 + at),
        what: what.to_owned(),
        by: by.to_owned(),
    };
    let (key, other_key, other_account) = (
        scope("acct_a", "history-key-01"),
        scope("acct_a", "history-key-02"),
        scope("acct_b", "history-key-01"),
    );
    let events = |scope: Scope| {
        let store = &store;
        async move { store.events(&scope).await.unwrap() }
    };
    assert_eq!(events(key.clone()).await, [], "no history yet");

    // A key of unknown outcome, resolved by an operator; the later event written first by the
    // clock (the writer's clocks may disagree): the order is the order of writing.
    claims(&store, &key, fingerprint("{}"), 1, now()).await;
    let (first, second) = (
        event(10, "resolved: completed with status 201", "idem keys (CLI)"),
        event(5, "reconciled: released", "reconciler"),
    );
    store.record_event(&key, &first).await.unwrap();
    store.record_event(&key, &second).await.unwrap();
    store
        .record_event(&other_account, &event(1, "resolved: released", "console"))
        .await
        .unwrap();
    assert_eq!(events(key.clone()).await, [first.clone(), second.clone()]);
    assert_eq!(events(other_key.clone()).await, [], "another key's history");
    assert_eq!(
        events(other_account.clone()).await,
        [event(1, "resolved: released", "console")],
        "the same key of another account"
    );

    // The history is the key's: a release of its record leaves it.
    assert!(store.release(&key, FencingToken(1)).await.unwrap());
    assert_eq!(events(key.clone()).await, [first, second]);
    // A purge deletes it, with a record or without.
    assert!(!store.purge(&key).await.unwrap());
    assert_eq!(events(key.clone()).await, [], "purged");
    claims(&store, &other_key, fingerprint("{}"), 2, now()).await;
    store
        .record_event(&other_key, &event(2, "resolved: released", "admin API"))
        .await
        .unwrap();
    assert!(store.purge(&other_key).await.unwrap());
    assert_eq!(events(other_key).await, [], "purged with its record");
    assert_eq!(
        events(other_account).await.len(),
        1,
        "another account's left"
    );

    // Bounded: the latest EVENTS_KEPT.
    for i in 0..EVENTS_KEPT + 3 {
        let what = format!("resolved: completed with status {i}");
        store
            .record_event(&key, &event(i as i64, &what, "reconciler"))
            .await
            .unwrap();
    }
    let kept = events(key).await;
    assert_eq!(kept.len(), EVENTS_KEPT, "capped");
    assert_eq!(
        kept[0].what, "resolved: completed with status 3",
        "the oldest went"
    );
    assert_eq!(
        kept[EVENTS_KEPT - 1].what,
        format!("resolved: completed with status {}", EVENTS_KEPT + 2)
    );
}

/// On the stores that keep one table (or map) of events (SQLite, PostgreSQL, memory), writing
/// an event deletes every key's events older than [`EVENTS_RETENTION`](crate::EVENTS_RETENTION)
/// by the new event's time, and leaves the younger ones. (Redis expires a key's list whole,
/// [`EVENTS_RETENTION`](crate::EVENTS_RETENTION) after its latest event.)
///
/// # Panics
///
/// When `store` fails or breaks the contract this checks; the message says how.
pub async fn events_past_their_retention_go_when_an_event_is_written<S: AdminStore>(store: S) {
    let event = |at: Timestamp| RecordEvent {
        at,
        what: "resolved: released".to_owned(),
        by: "console".to_owned(),
    };
    let (old, young, writer) = (
        scope("acct_a", "history-old-001"),
        scope("acct_b", "history-young-1"),
        scope("acct_a", "history-writer1"),
    );
    let retention = crate::EVENTS_RETENTION;
    store.record_event(&old, &event(T0)).await.unwrap();
    let young_at = T0.plus(Duration::from_secs(60 * 60));
    store.record_event(&young, &event(young_at)).await.unwrap();
    // Just within the retention of the old one: nothing goes.
    let within = T0.plus(retention);
    store.record_event(&writer, &event(within)).await.unwrap();
    assert_eq!(store.events(&old).await.unwrap().len(), 1, "kept 30 days");
    // Past it: the old one goes, the younger stays.
    let past = within.plus(Duration::from_secs(1));
    store.record_event(&writer, &event(past)).await.unwrap();
    assert_eq!(store.events(&old).await.unwrap(), [], "expired");
    assert_eq!(store.events(&young).await.unwrap(), [event(young_at)]);
    assert_eq!(store.events(&writer).await.unwrap().len(), 2);
}

/// Writes one `#[tokio::test]` per name, each making a fresh `(store, guard)` with the async
/// expression `$make` and running `$suite::$name(store)`, the guard dropped when the test
/// ends. The conformance macros below are made with it; so is any suite of another crate that
/// runs once per store (`[super]` names the functions of the module that invokes it).
#[macro_export]
macro_rules! tests_per_store {
    (@one $make:expr => [$($suite:tt)+]; $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let (store, _guard) = $make.await;
            $($suite)+::$name(store).await;
        }
    };
    ($make:expr => $suite:tt; $($name:ident),* $(,)?) => {
        $($crate::tests_per_store!(@one $make => $suite; $name);)*
    };
}

/// Instantiates the [`Store`] conformance suite. `$make` is an async expression that yields
/// `(store, guard)`; the guard is dropped when the test ends.
#[macro_export]
macro_rules! store_conformance {
    ($make:expr) => {
        $crate::tests_per_store!($make => [$crate::conformance];
            claim_race_has_one_winner,
            completed_record_replays,
            mismatch_leaves_record_untouched,
            fencing_token_guards_the_outcome,
            lease_expiry_and_renewal,
            retention_and_release,
            an_unknown_outcome_never_expires,
            sweep_deletes_expired_in_batches,
            sweep_spares_keys_claimed_again,
            times_are_kept_to_the_millisecond,
        );
    };
}

/// Instantiates the part of the suite for stores that instances share (PostgreSQL, Redis),
/// whose clock is not their callers': callers' clocks that disagree change nothing.
#[macro_export]
macro_rules! shared_store_conformance {
    ($make:expr) => {
        $crate::tests_per_store!($make => [$crate::conformance];
            a_caller_clock_minutes_off_changes_nothing);
    };
}

/// Instantiates the part of the suite for shared stores that are [`AdminStore`]s.
#[macro_export]
macro_rules! shared_admin_conformance {
    ($make:expr) => {
        $crate::tests_per_store!($make => [$crate::conformance];
            a_listing_by_a_clock_ahead_sees_live_leases_running);
    };
}

/// Instantiates the [`AdminStore`] part of the suite.
#[macro_export]
macro_rules! admin_conformance {
    ($make:expr) => {
        $crate::tests_per_store!($make => [$crate::conformance];
            admin_lists_purges_and_force_completes,
            admin_keeps_a_history_of_events,
        );
    };
}

/// Instantiates the part of the suite for [`AdminStore`]s whose events expire one by one as
/// events are written: SQLite, PostgreSQL, memory (not Redis, whose lists expire whole).
#[macro_export]
macro_rules! table_events_conformance {
    ($make:expr) => {
        $crate::tests_per_store!($make => [$crate::conformance];
            events_past_their_retention_go_when_an_event_is_written);
    };
}

/// Instantiates the [`TransactionalStore`] part of the suite.
#[macro_export]
macro_rules! transactional_conformance {
    ($make:expr) => {
        $crate::tests_per_store!($make => [$crate::conformance];
            transaction_mode_commits_or_rolls_back,
            transaction_wait_is_bounded,
            transaction_mode_replaces_an_expired_record,
            transaction_mode_takes_over_only_a_stale_lease_of_the_same_request,
        );
    };
}
