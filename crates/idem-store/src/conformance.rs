//! The conformance suite: written once, run against every store.
//!
//! A backend's test file instantiates it with [`store_conformance!`](crate::store_conformance)
//! (and [`transactional_conformance!`](crate::transactional_conformance) for transactional
//! stores), giving a factory that makes a fresh, isolated store for each test (its own file,
//! database or key prefix) plus a guard that cleans it up when dropped.
//! Time is passed explicitly, so expiry and leases are tested without waiting.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{
    AccountId, Decision, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Policy, RecordState,
    RequestParts, Scope, StoredResponse, Timestamp, decide,
};

use crate::{
    AdminStore, ClaimOutcome, Error, NewClaim, RecordFilter, Result, Store, TransactionalStore,
    TxClaim, sweep_all, sweep_all_paced,
};

const T0: Timestamp = Timestamp(1_800_000_000_000);

/// The scope of `key` in `account` (a test key: it must be valid).
pub fn scope(account: &str, key: &str) -> Scope {
    Scope::new(
        AccountId::new(account),
        IdempotencyKey::new(key, KeyLimits::default()).expect("valid test key"),
    )
}

/// The fingerprint of a `POST /payments` with the JSON `body`.
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

/// Claims `key` for the request `fp` with `token` at `now`, and checks that the claim won.
async fn claims<S: Store>(store: &S, key: &Scope, fp: Fingerprint, token: i64, now: Timestamp) {
    assert_eq!(
        store.claim(&claim_at(key, fp, token, now)).await.unwrap(),
        ClaimOutcome::Claimed,
        "the claim of {key:?} with token {token} wins"
    );
}

/// Whether the holder of `token` stored the response `body` for `key`.
async fn completes<S: Store>(store: &S, key: &Scope, token: i64, body: &str) -> bool {
    store
        .complete(key, FencingToken(token), &response(body))
        .await
        .unwrap()
}

/// Checks that `result` is [`Error::Unavailable`], what the layer answers with `503`.
#[track_caller]
pub fn assert_unavailable<T: std::fmt::Debug>(result: Result<T>) {
    match result {
        Err(Error::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// Every operation of `store`, whose connections go through `relay`, ends within `deadline`
/// with [`Error::Unavailable`] while the relay is a black hole (nothing gets through, nothing is
/// refused: a dead host, a partition): no store call waits forever (docs/contract.md §12).
/// With `transactional`, a claim in a transaction too, which may take its wait on top. The
/// relay is cleared again at the end.
///
/// The operations run at once, each timed from its own start.
pub async fn a_black_hole_is_unavailable_within<S: Store>(
    store: &S,
    relay: &crate::fault_relay::FaultRelay,
    deadline: Duration,
    transactional: Option<BoxedUnit<'_>>,
) {
    use std::future::Future;
    use std::pin::Pin;
    use tokio::time::Instant;

    let key = scope("acct_a", "black-hole-key");
    // A record to act on, and pooled connections to the store, made before the black hole.
    claims(store, &key, fingerprint("{}"), 1, T0).await;
    relay.set(crate::fault_relay::Fault::BlackHole);
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
        timed("get", store.get(&key)),
        timed("claim", store.claim(&other)),
        timed("complete", store.complete(&key, FencingToken(1), &stored)),
        timed(
            "renew",
            store.renew(&key, FencingToken(1), T0.plus(Duration::from_secs(60))),
        ),
        timed("release", store.release(&key, FencingToken(1))),
        timed("sweep", store.sweep(T0, 100)),
    ];
    if let Some(begin_claim) = transactional {
        ops.push(timed("begin_claim", begin_claim));
    }
    let results = futures_util::future::join_all(ops).await;
    relay.clear();
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
pub async fn completed_record_replays<S: Store>(store: S) {
    let key = scope("acct_a", "replay-key-01");
    let fp = fingerprint(r#"{"amount":1}"#);
    claims(&store, &key, fp, 7, T0).await;
    let body = r#"{"id":"pay_1"}"#;
    let stored = response(body);
    assert!(completes(&store, &key, 7, body).await);
    let record = store.get(&key).await.unwrap().expect("record exists");
    assert_eq!(record.fingerprint, fp);
    assert_eq!(decide(Some(&record), &fp, T0), Decision::Replay(&stored));
    // A second claim does not disturb it.
    match store.claim(&claim_at(&key, fp, 8, T0)).await.unwrap() {
        ClaimOutcome::Existing(again) => assert_eq!(again, record),
        other => panic!("expected the completed record, got {other:?}"),
    }
}

/// A different request with the same key is a mismatch and leaves the record untouched; the
/// same key from another account is unrelated.
pub async fn mismatch_leaves_record_untouched<S: Store>(store: S) {
    let key = scope("acct_a", "mismatch-key1");
    let fp = fingerprint(r#"{"amount":1}"#);
    let other = fingerprint(r#"{"amount":2}"#);
    claims(&store, &key, fp, 1, T0).await;
    assert!(completes(&store, &key, 1, "{}").await);
    match store.claim(&claim_at(&key, other, 2, T0)).await.unwrap() {
        ClaimOutcome::Existing(record) => {
            assert_eq!(decide(Some(&record), &other, T0), Decision::Mismatch)
        }
        ClaimOutcome::Claimed => panic!("a mismatched request claimed a completed key"),
    }
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.fingerprint, fp);
    assert_eq!(record.state, RecordState::Completed(response("{}")));

    claims(&store, &scope("acct_b", "mismatch-key1"), other, 3, T0).await;
}

/// Only the holder of the current fencing token may store an outcome, renew or release.
pub async fn fencing_token_guards_the_outcome<S: Store>(store: S) {
    let key = scope("acct_a", "fenced-key-01");
    let fp = fingerprint("{}");
    claims(&store, &key, fp, 10, T0).await;
    assert!(!completes(&store, &key, 11, "x").await);
    assert!(
        !store
            .renew(&key, FencingToken(11), T0.plus(Duration::from_secs(60)))
            .await
            .unwrap()
    );
    assert!(!store.release(&key, FencingToken(11)).await.unwrap());
    assert!(matches!(
        store.get(&key).await.unwrap().unwrap().state,
        RecordState::InProgress {
            token: FencingToken(10),
            ..
        }
    ));
    assert!(completes(&store, &key, 10, "ok").await);
    // A completed record can be neither completed again nor released.
    assert!(!completes(&store, &key, 10, "again").await);
    assert!(!store.release(&key, FencingToken(10)).await.unwrap());
}

/// A claim whose lease runs out can be taken over by the same request (with a new token), never
/// by a different one; the old holder is then fenced out. Renewal keeps a lease alive.
pub async fn lease_expiry_and_renewal<S: Store>(store: S) {
    let key = scope("acct_a", "lease-key-001");
    let fp = fingerprint("{}");
    let lease = Policy::default().lease;
    claims(&store, &key, fp, 1, T0).await;

    // Within the lease: in flight.
    let mid = T0.plus(lease / 2);
    match store.claim(&claim_at(&key, fp, 2, mid)).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert!(matches!(
                decide(Some(&r), &fp, mid),
                Decision::InFlight { .. }
            ))
        }
        ClaimOutcome::Claimed => panic!("claimed a key under a live lease"),
    }
    // Renewed at mid-lease: still in flight past the original lease.
    assert!(
        store
            .renew(&key, FencingToken(1), mid.plus(lease))
            .await
            .unwrap()
    );
    let past_original = T0.plus(lease + Duration::from_secs(1));
    assert!(matches!(
        store
            .claim(&claim_at(&key, fp, 3, past_original))
            .await
            .unwrap(),
        ClaimOutcome::Existing(_)
    ));

    // After the renewed lease: a different request may not take over...
    let after = mid.plus(lease + Duration::from_secs(1));
    let other = fingerprint(r#"{"x":1}"#);
    match store.claim(&claim_at(&key, other, 4, after)).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert_eq!(decide(Some(&r), &other, after), Decision::Mismatch)
        }
        ClaimOutcome::Claimed => panic!("a different request took over a lease"),
    }
    // ... nor the same request when take-over is not allowed ...
    let mut no_takeover = claim_at(&key, fp, 5, after);
    no_takeover.take_over_expired_lease = false;
    match store.claim(&no_takeover).await.unwrap() {
        ClaimOutcome::Existing(r) => assert_eq!(
            decide(Some(&r), &fp, after),
            Decision::LeaseExpired {
                token: FencingToken(1)
            }
        ),
        ClaimOutcome::Claimed => panic!("took over although take-over was not allowed"),
    }
    // ... but the same request may, and the old holder is fenced out.
    claims(&store, &key, fp, 6, after).await;
    assert!(!completes(&store, &key, 1, "old").await);
    assert!(completes(&store, &key, 6, "new").await);
}

/// A record past its retention is new again; a released key is new at once.
pub async fn retention_and_release<S: Store>(store: S) {
    let key = scope("acct_a", "retained-key1");
    let fp = fingerprint("{}");
    let retention = Policy::default().retention;
    claims(&store, &key, fp, 1, T0).await;
    assert!(completes(&store, &key, 1, "first").await);

    let before = T0.plus(retention - Duration::from_secs(1));
    assert!(matches!(
        store.claim(&claim_at(&key, fp, 2, before)).await.unwrap(),
        ClaimOutcome::Existing(_)
    ));
    let at_expiry = T0.plus(retention);
    let different = fingerprint(r#"{"new":true}"#);
    claims(&store, &key, different, 3, at_expiry).await;
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.fingerprint, different);
    assert_eq!(record.created_at, at_expiry);

    assert!(store.release(&key, FencingToken(3)).await.unwrap());
    assert_eq!(store.get(&key).await.unwrap(), None);
    claims(&store, &key, fp, 4, at_expiry).await;
}

/// The sweeper deletes expired records in bounded batches, keeps live ones and in-progress
/// records whose lease still runs, and is safe to run from several places at once.
pub async fn sweep_deletes_expired_in_batches<S: Store>(store: S) {
    let fp = fingerprint("{}");
    let policy = Policy::default();
    for i in 0..250 {
        let key = scope("acct_a", &format!("old-key-{i:05}"));
        claims(&store, &key, fp, 1, T0).await;
        assert!(completes(&store, &key, 1, "{}").await);
    }
    let later = T0.plus(policy.retention / 2);
    let fresh = scope("acct_a", "fresh-key-001");
    claims(&store, &fresh, fp, 1, later).await;
    assert!(completes(&store, &fresh, 1, "{}").await);
    // In progress past its retention but with a lease still running (a very long call).
    let long = scope("acct_a", "long-call-001");
    let mut claim = claim_at(&long, fp, 1, T0);
    claim.lease_until = T0.plus(policy.retention * 2);
    store.claim(&claim).await.unwrap();

    let now = T0.plus(policy.retention);
    assert_eq!(store.sweep(now, 100).await.unwrap(), 100);
    // Two sweepers at once (one pausing between its batches) delete the rest between them,
    // each row once.
    let (a, b) = tokio::join!(
        sweep_all(&store, now, 40),
        sweep_all_paced(&store, now, 40, 1)
    );
    assert_eq!(a.unwrap() + b.unwrap(), 150);
    assert_eq!(store.sweep(now, 100).await.unwrap(), 0);
    assert!(store.get(&fresh).await.unwrap().is_some());
    assert!(store.get(&long).await.unwrap().is_some());
    assert_eq!(
        store.get(&scope("acct_a", "old-key-00007")).await.unwrap(),
        None
    );
}

/// A sweep racing claims that take expired keys afresh deletes none of the new records: a
/// row the sweeper chose while it was expired is checked again once it is locked. 200 expired
/// records are claimed again by one task each while two sweepers delete in small batches.
pub async fn sweep_spares_keys_claimed_again<S: Store>(store: S) {
    let (old, new) = (fingerprint("{}"), fingerprint(r#"{"again":true}"#));
    let keys: Vec<_> = (0..200)
        .map(|i| scope("acct_a", &format!("again-key-{i:05}")))
        .collect();
    for key in &keys {
        claims(&store, key, old, 1, T0).await;
        assert!(completes(&store, key, 1, "{}").await);
    }
    let now = T0.plus(Policy::default().retention);
    let claimers: Vec<_> = keys
        .iter()
        .map(|key| {
            let (store, claim) = (store.clone(), claim_at(key, new, 2, now));
            tokio::spawn(async move { store.claim(&claim).await })
        })
        .collect();
    let (a, b) = tokio::join!(sweep_all(&store, now, 7), sweep_all(&store, now, 5));
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
        let record = store.get(key).await.unwrap();
        let record = record.unwrap_or_else(|| panic!("the sweeper deleted {key:?}'s new claim"));
        assert_eq!((record.fingerprint, record.created_at), (new, now));
    }
    assert_eq!(store.sweep(now, 100).await.unwrap(), 0);
}

/// Transaction mode: the key row commits with the response; a rollback takes the key with it;
/// 64 concurrent transactions on one key have one winner and the rest see its outcome.
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
        store.get(&key).await.unwrap(),
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
    let second = store
        .begin_claim(&claim_at(&key, fp, 2, T0), Duration::from_millis(200))
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
/// mismatch) until its retention ends; then the next claim replaces it, in a transaction that
/// commits the new request's record, or rolls back and leaves the old one.
pub async fn transaction_mode_replaces_an_expired_record<S: TransactionalStore>(store: S) {
    let key = scope("acct_a", "tx-expired-01");
    let (fp, other) = (fingerprint("{}"), fingerprint(r#"{"b":2}"#));
    let retention = Policy::default().retention;
    claims_in_tx(&store, &claim_at(&key, fp, 1, T0), "first").await;

    let before = T0.plus(retention - Duration::from_millis(1));
    let replay = found_in_tx(&store, &claim_at(&key, fp, 2, before)).await;
    assert!(
        matches!(decide(Some(&replay), &fp, before), Decision::Replay(r) if r.body == b"first")
    );
    let mismatch = found_in_tx(&store, &claim_at(&key, other, 3, before)).await;
    assert_eq!(decide(Some(&mismatch), &other, before), Decision::Mismatch);

    let expired = T0.plus(retention);
    let TxClaim::Claimed(tx) = store
        .begin_claim(&claim_at(&key, other, 4, expired), Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!("an expired record must give way")
    };
    store.rollback(tx).await.unwrap();
    let kept = store.get(&key).await.unwrap().unwrap();
    assert_eq!(
        (kept.fingerprint, kept.created_at),
        (fp, T0),
        "the rollback keeps the old record"
    );

    claims_in_tx(&store, &claim_at(&key, other, 5, expired), "second").await;
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!((record.fingerprint, record.created_at), (other, expired));
    assert!(
        matches!(decide(Some(&record), &other, expired), Decision::Replay(r) if r.body == b"second")
    );
}

/// A lease-mode claim of the same request whose lease ran out (its worker crashed) is taken
/// over by a transaction's claim, unless take-over is off; a different request's is not.
pub async fn transaction_mode_takes_over_only_a_stale_lease_of_the_same_request<
    S: TransactionalStore,
>(
    store: S,
) {
    let key = scope("acct_a", "tx-stale-0001");
    let (fp, other) = (fingerprint("{}"), fingerprint(r#"{"c":3}"#));
    claims(&store, &key, fp, 1, T0).await;
    let live = T0.plus(Policy::default().lease / 2);
    let running = found_in_tx(&store, &claim_at(&key, fp, 2, live)).await;
    assert!(matches!(
        decide(Some(&running), &fp, live),
        Decision::InFlight { .. }
    ));

    let stale = T0.plus(Policy::default().lease_hold() + Duration::from_secs(1));
    let mismatch = found_in_tx(&store, &claim_at(&key, other, 3, stale)).await;
    assert_eq!(decide(Some(&mismatch), &other, stale), Decision::Mismatch);
    let mut no_takeover = claim_at(&key, fp, 4, stale);
    no_takeover.take_over_expired_lease = false;
    let left = found_in_tx(&store, &no_takeover).await;
    assert_eq!(
        decide(Some(&left), &fp, stale),
        Decision::LeaseExpired {
            token: FencingToken(1)
        }
    );

    claims_in_tx(&store, &claim_at(&key, fp, 5, stale), "taken over").await;
    assert!(
        !completes(&store, &key, 1, "late").await,
        "the old holder is fenced out"
    );
    let record = store.get(&key).await.unwrap().unwrap();
    assert!(
        matches!(decide(Some(&record), &fp, stale), Decision::Replay(r) if r.body == b"taken over")
    );
}

/// Operators list records by account, state and expired lease, purge one, and complete an
/// in-progress one whatever its token.
pub async fn admin_lists_purges_and_force_completes<S: AdminStore>(store: S) {
    let records = AdminRecords::store(&store).await;
    lists_by_account_state_lease_and_limit(&store, &records).await;
    force_completes_only_in_progress_records(&store, &records).await;
    purges_once(&store, &records.done).await;
}

/// The admin checks' records: one completed and one in progress in `acct_a`, one in progress
/// in `acct_b`, claimed a second apart in that order.
struct AdminRecords {
    done: Scope,
    running: Scope,
    other: Scope,
}

impl AdminRecords {
    async fn store<S: Store>(store: &S) -> Self {
        let fp = fingerprint("{}");
        let records = Self {
            done: scope("acct_a", "admin-done-001"),
            running: scope("acct_a", "admin-running-1"),
            other: scope("acct_b", "admin-other-01"),
        };
        claims(store, &records.done, fp, 1, T0).await;
        assert!(completes(store, &records.done, 1, "{}").await);
        let second = T0.plus(Duration::from_secs(1));
        claims(store, &records.running, fp, 2, second).await;
        claims(
            store,
            &records.other,
            fp,
            3,
            T0.plus(Duration::from_secs(2)),
        )
        .await;
        records
    }
}

async fn lists_by_account_state_lease_and_limit<S: AdminStore>(store: &S, records: &AdminRecords) {
    let lease = Policy::default().lease;
    let all = store.list(&RecordFilter::default()).await.unwrap();
    assert_eq!(all.len(), 3);
    assert_eq!(all[0].scope, records.other, "newest first");
    let mine = RecordFilter {
        account: Some(AccountId::new("acct_a")),
        ..Default::default()
    };
    assert_eq!(store.list(&mine).await.unwrap().len(), 2);
    let in_progress = RecordFilter {
        in_progress: Some(true),
        ..Default::default()
    };
    assert_eq!(store.list(&in_progress).await.unwrap().len(), 2);
    let stale = |at| RecordFilter {
        lease_expired_by: Some(at),
        ..Default::default()
    };
    assert!(store.list(&stale(T0.plus(lease))).await.unwrap().is_empty());
    let expired = store
        .list(&stale(T0.plus(lease + Duration::from_secs(1))))
        .await
        .unwrap();
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].scope, records.running);
    let limited = RecordFilter {
        limit: 1,
        ..Default::default()
    };
    assert_eq!(store.list(&limited).await.unwrap().len(), 1);
}

async fn force_completes_only_in_progress_records<S: AdminStore>(
    store: &S,
    records: &AdminRecords,
) {
    let (done, running) = (&records.done, &records.running);
    let none = scope("acct_a", "admin-none-001");
    assert!(
        store
            .force_complete(running, &response("operator"))
            .await
            .unwrap()
    );
    assert!(
        !store
            .force_complete(done, &response("again"))
            .await
            .unwrap()
    );
    assert!(
        !store
            .force_complete(&none, &response("none"))
            .await
            .unwrap()
    );
    assert!(matches!(
        store.get(running).await.unwrap().unwrap().state,
        RecordState::Completed(ref r) if r.body == b"operator"
    ));
    assert!(matches!(
        store.get(done).await.unwrap().unwrap().state,
        RecordState::Completed(ref r) if r.body == b"{}"
    ));
    assert_eq!(store.get(&none).await.unwrap(), None);
}

async fn purges_once<S: AdminStore>(store: &S, done: &Scope) {
    assert!(store.purge(done).await.unwrap());
    assert!(!store.purge(done).await.unwrap());
    assert_eq!(store.get(done).await.unwrap(), None);
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
            sweep_deletes_expired_in_batches,
            sweep_spares_keys_claimed_again,
        );
    };
}

/// Instantiates the [`AdminStore`] part of the suite.
#[macro_export]
macro_rules! admin_conformance {
    ($make:expr) => {
        $crate::tests_per_store!($make => [$crate::conformance]; admin_lists_purges_and_force_completes);
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
