//! Crash and concurrency tests with real processes: `idem serve` instances sharing one
//! PostgreSQL database, one of them killed with SIGKILL mid-burst, and PostgreSQL itself crashed
//! (`pg_ctl stop -m immediate`) and started again under load. Each test has a database of its own
//! on the shared server, or a cluster of its own, and leaves nothing behind.
//!
//! Each test prints what it measured (`--nocapture` shows it).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::payments::{
    Load, STRIDE, Seen, Workers, assert_one_payment_per_key, assert_only_payments_and_refusals,
    lock_waiters, logs, tally,
};
use crate::common::processes::{Cluster, PgDatabase, Serve};
use futures_util::future::join_all;
use rand::seq::SliceRandom;
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;

const KEYS: usize = 200;
const COPIES: usize = 10;

/// The tests measure bursts on a small machine: one at a time, so they do not measure each
/// other.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `KEYS` keys × `COPIES` copies, the copies of each key split evenly between two instances,
/// in a random order.
fn split_copies() -> Vec<(usize, usize)> {
    let mut copies: Vec<(usize, usize)> = (0..KEYS)
        .flat_map(|key| (0..COPIES).map(move |copy| (key, copy % 2)))
        .collect();
    copies.shuffle(&mut rand::rng());
    copies
}

/// Writes, uncommitted in `holding`, a payment row with `key`: a request for that key then
/// claims it and blocks in the handler's `INSERT INTO payments` until `holding` ends.
async fn hold_payment_row(
    holding: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: &str,
    key: &str,
) {
    sqlx::query(
        "INSERT INTO payments (id, account_id, idem_key, amount, currency, status, created_at)
         VALUES ($1, 'acct_alice', $2, 1, 'EUR', 'held', now())",
    )
    .bind(id)
    .bind(key)
    .execute(&mut **holding)
    .await
    .expect("hold a payment row");
}

/// The final answers of a burst, which must all be `201`s: the keys answered fresh, each as
/// often as it was, and the set of them.
fn fresh_keys(finals: &[Seen]) -> (Vec<usize>, HashSet<usize>) {
    assert!(finals.iter().all(Seen::created), "{:?}", tally(finals));
    let fresh: Vec<usize> = finals
        .iter()
        .filter(|s| !s.replayed)
        .map(|s| s.key)
        .collect();
    let distinct = fresh.iter().copied().collect();
    (fresh, distinct)
}

/// The final answers of a burst: every one a `201`, exactly one fresh per key.
fn assert_one_fresh_answer_per_key(finals: &[Seen]) {
    let (fresh, distinct) = fresh_keys(finals);
    assert_eq!(
        fresh.len(),
        KEYS,
        "one fresh answer per key: {:?}",
        tally(finals)
    );
    assert_eq!(distinct.len(), KEYS, "one fresh answer per key");
}

/// The final answers of a burst cut by a kill: every one a `201`, no key answered fresh twice,
/// and every key answered fresh once unless an attempt of it lost its answer to the kill. That
/// attempt may have committed: its COMMIT was on its way, or PostgreSQL was flushing it, when
/// the process died, so the one fresh answer died with it and every retry replays. (That the
/// key still has exactly one payment is checked against the database.)
fn assert_one_fresh_answer_per_key_unless_cut(finals: &[Seen], cut_keys: &HashSet<usize>) {
    let (fresh, distinct) = fresh_keys(finals);
    assert_eq!(distinct.len(), fresh.len(), "a key answered fresh twice");
    let unanswered: Vec<usize> = (0..KEYS).filter(|k| !distinct.contains(k)).collect();
    assert!(
        unanswered.iter().all(|k| cut_keys.contains(k)),
        "keys with no fresh answer that no kill explains: {:?} ({:?})",
        unanswered
            .iter()
            .filter(|k| !cut_keys.contains(k))
            .collect::<Vec<_>>(),
        tally(finals)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_on_one_database_make_one_payment_per_key_and_replay_every_copy() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = PgDatabase::create().await;
    let instances = [Serve::start(db.url()).await, Serve::start(db.url()).await];
    let load = Load::new(
        &instances,
        "burst",
        Instant::now() + Duration::from_secs(30),
    );

    let started = Instant::now();
    let finals = join_all(split_copies().into_iter().map(|(k, i)| load.copy(k, i))).await;
    let elapsed = started.elapsed();
    let seen = load.journal.snapshot();

    assert_only_payments_and_refusals(&seen, false, &logs(&instances));
    assert_one_fresh_answer_per_key(&finals);
    let payments = assert_one_payment_per_key(db.url(), &load, &seen).await;
    assert_eq!(payments, KEYS);
    let per_instance: Vec<usize> = (0..2)
        .map(|i| finals.iter().filter(|s| s.instance == i).count())
        .collect();

    eprintln!(
        "two instances, one database: {} copies of {KEYS} keys sent at once, split {per_instance:?}; \
         {} attempts in {elapsed:.2?}; answers by status {:?}; final answers {:?}; \
         {payments} payments",
        finals.len(),
        load.attempts.load(Ordering::Relaxed),
        tally(&seen),
        tally(&finals),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_transaction_mode_a_duplicate_waits_for_the_running_original_then_replays() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = PgDatabase::create().await;
    let instances = [Serve::start(db.url()).await, Serve::start(db.url()).await];
    let deadline = Instant::now() + Duration::from_secs(20);
    let load = Load::new(&instances, "held", deadline);

    // The test plays an original still running on a third instance: its transaction holds
    // the key's row, uncommitted, so every copy's claim blocks on it. From outside, a copy
    // that waited and one that came after the commit both just replay; holding the row makes
    // every copy wait.
    let mut original = PgConnection::connect(db.url()).await.expect("connect");
    let mut running = original.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO idempotency_keys
             (account_id, idem_key, request_hash, status, created_at, expires_at, lease_until,
              fencing_token)
         VALUES ('acct_alice', $1, $2, 'in_progress', now(), now() + interval '1 day',
                 now() + interval '1 day', 1)",
    )
    .bind(load.key(0))
    .bind(&[0u8; 32][..])
    .execute(&mut *running)
    .await
    .expect("hold the key");

    let started = Instant::now();
    let (finals, waited) = tokio::join!(
        join_all((0..COPIES).map(|copy| load.copy(0, copy % 2))),
        async {
            lock_waiters(
                db.url(),
                "INSERT INTO idempotency_keys",
                COPIES as i64,
                deadline,
            )
            .await;
            let waited = started.elapsed();
            // The original fails: the key is free again, and one copy must run it afresh
            // while the others now wait for that one.
            running.rollback().await.expect("roll back the original");
            waited
        }
    );
    let elapsed = started.elapsed();
    let seen = load.journal.snapshot();

    assert_only_payments_and_refusals(&seen, false, &logs(&instances));
    assert_eq!(
        seen.len(),
        COPIES,
        "one answer per copy, none refused: {:?}",
        tally(&seen)
    );
    assert!(finals.iter().all(Seen::created));
    assert_eq!(
        finals.iter().filter(|s| !s.replayed).count(),
        1,
        "{:?}",
        tally(&finals)
    );
    assert_eq!(assert_one_payment_per_key(db.url(), &load, &seen).await, 1);
    original.close().await.expect("close");

    eprintln!(
        "a duplicate waits then replays: {COPIES} copies of one key sent to two instances while \
         its original held the key; all {COPIES} waiting on its lock after {waited:.2?}; the \
         original rolled back; answers {:?} in {elapsed:.2?}; 1 payment",
        tally(&finals),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_one_instance_mid_burst_leaves_one_payment_per_key_and_none_in_progress() {
    // A key outside the burst whose one request is caught inside instance 0's handler when it
    // dies: so the kill cuts at least one request that holds a claim, whatever the burst's
    // timing on a loaded machine.
    const CAUGHT: usize = KEYS;
    let _one = ONE_AT_A_TIME.lock().await;
    let db = PgDatabase::create().await;
    let mut instances = [Serve::start(db.url()).await, Serve::start(db.url()).await];
    let deadline = Instant::now() + Duration::from_secs(30);
    let load = Load::new(&instances, "kill", deadline);
    // A quarter of the burst answered: the rest is in flight, much of it on instance 0.
    let kill_after = KEYS * COPIES / 4;

    // The test's own transaction holds a payment row with the caught key, so the caught
    // request claims its key and then blocks in the handler's INSERT INTO payments.
    let mut holder = PgConnection::connect(db.url()).await.expect("connect");
    let mut holding = holder.begin().await.expect("begin");
    hold_payment_row(&mut holding, "pay_held", &load.key(CAUGHT)).await;

    let started = Instant::now();
    let (finals, caught_final, (in_flight, killed_at)) = tokio::join!(
        join_all(split_copies().into_iter().map(|(k, i)| load.copy(k, i))),
        load.copy(CAUGHT, 0),
        async {
            lock_waiters(db.url(), "INSERT INTO payments", 1, deadline).await;
            load.journal
                .until("the answers before the kill", deadline, |s| {
                    s.len() >= kill_after
                })
                .await;
            let in_flight = load.attempts.load(Ordering::Relaxed) - load.journal.lock().len();
            tokio::task::block_in_place(|| instances[0].kill());
            // The caught request's retry, now on instance 1, may pay once the row is free.
            holding
                .rollback()
                .await
                .expect("roll back the held payment");
            (in_flight, started.elapsed())
        }
    );
    let elapsed = started.elapsed();
    holder.close().await.expect("close");
    let seen = load.journal.snapshot();
    let logs = logs(&instances);

    assert_only_payments_and_refusals(&seen, true, &logs);
    let cut: Vec<&Seen> = seen.iter().filter(|s| s.status.is_none()).collect();
    let cut_keys: HashSet<usize> = cut.iter().map(|s| s.key).collect();
    assert_one_fresh_answer_per_key_unless_cut(&finals, &cut_keys);
    let payments = assert_one_payment_per_key(db.url(), &load, &seen).await;
    assert_eq!(payments, KEYS + 1);
    // The caught request is one attempt in flight; the burst had more.
    assert!(in_flight > 1, "the kill came after the burst");
    // The caught request lost its answer with its process; its claim died with the
    // process's transaction, so its retry on the survivor paid, fresh.
    let caught_first = seen.iter().find(|s| s.key == CAUGHT).expect("an answer");
    assert!(
        caught_first.status.is_none() && caught_first.instance == 0,
        "the request caught in the handler by the kill got {caught_first:?}"
    );
    assert!(
        caught_final.created() && !caught_final.replayed && caught_final.instance == 1,
        "the caught key's retry on the survivor: {caught_final:?}"
    );
    assert!(
        cut.iter().all(|s| s.instance == 0),
        "only the killed instance failed to answer: {:?}",
        cut.iter().find(|s| s.instance != 0)
    );
    assert!(instances[1].is_running());
    let finished_on_survivor = finals.iter().filter(|s| s.instance == 1).count();
    let cut_in_burst = cut.iter().filter(|s| s.key != CAUGHT).count();

    eprintln!(
        "kill -9 mid-burst: {} copies of {KEYS} keys sent at once to two instances, and 1 \
         request caught in instance 0's handler; 1 kill after {kill_after} answers \
         ({killed_at:.2?} in, {in_flight} attempts in flight); {} attempts in {elapsed:.2?}; \
         {} attempts got no answer ({cut_in_burst} of the burst's; keys affected: {}); answers \
         by status {:?}; final answers {:?}, {finished_on_survivor} of them from the survivor; \
         {payments} payments, 0 keys in progress; a lost answer looked like: {}",
        finals.len(),
        load.attempts.load(Ordering::Relaxed),
        cut.len(),
        cut_keys.len(),
        tally(&seen),
        tally(&finals),
        caught_first.error.as_deref().unwrap_or(""),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_crash_under_load_gives_503_then_recovers_with_every_payment_kept() {
    const WORKERS: usize = 16;
    // Keys of the requests the crash catches inside the handler, one per instance.
    const CAUGHT: [usize; 2] = [90 * STRIDE, 91 * STRIDE];
    let _one = ONE_AT_A_TIME.lock().await;
    let cluster = tokio::task::block_in_place(Cluster::start);
    let mut instances = [
        Serve::start(&cluster.url).await,
        Serve::start(&cluster.url).await,
    ];
    let deadline = Instant::now() + Duration::from_secs(40);
    let load = Arc::new(Load::new(&instances, "outage", deadline));
    let workers = Workers::start(&load, WORKERS);
    let journal = load.journal.clone();
    let created = |s: &[Seen]| s.iter().filter(|s| s.created()).count();

    journal
        .until("payments before the crash", deadline, |s| created(s) >= 150)
        .await;
    // Requests caught inside the handler by the crash, one per instance, on cue: the test's
    // own transaction holds a payment row with their key, so each claims its key and then
    // blocks in the handler's INSERT INTO payments until the server goes down.
    let mut holder = PgConnection::connect(&cluster.url).await.expect("connect");
    let mut holding = holder.begin().await.expect("begin");
    for (n, key) in CAUGHT.into_iter().enumerate() {
        hold_payment_row(&mut holding, &format!("pay_held_{n}"), &load.key(key)).await;
    }
    let caught: Vec<_> = CAUGHT
        .into_iter()
        .enumerate()
        .map(|(instance, key)| {
            let load = load.clone();
            tokio::spawn(async move {
                load.copy(key, instance).await;
            })
        })
        .collect();
    lock_waiters(
        &cluster.url,
        "INSERT INTO payments",
        CAUGHT.len() as i64,
        deadline,
    )
    .await;
    // Down long enough that every worker's retry met a server that was already gone.
    let crash = workers
        .outage(deadline, || cluster.crash(), || cluster.start_again())
        .await;
    // Recovered: a payment made after the restart began, by the same processes.
    let recovered = |s: &Seen| s.created() && s.answered >= crash.recovering_at;
    journal
        .until("the first payment after the restart", deadline, |s| {
            s.iter().any(recovered)
        })
        .await;
    let recovered_at = journal
        .snapshot()
        .iter()
        .filter(|s| recovered(s))
        .map(|s| s.answered)
        .min()
        .expect("a payment after the restart");
    journal
        .until_more_payments("more payments after the recovery", 150, deadline)
        .await;
    workers.stop().await;
    for worker in caught {
        worker.await.expect("a caught request got its final answer");
    }
    // The crash ended the holding transaction; nothing of it is left to close.
    drop(holding);
    drop(holder);
    let seen = journal.snapshot();
    let attempts = load.attempts.load(Ordering::Relaxed);
    let mut logs = logs(&instances);
    logs.push(cluster.log());

    // A request inside the handler when the database goes down is refused like any other:
    // 503 with Retry-After (its retry pays once after the restart, checked below).
    for key in CAUGHT {
        let first = seen.iter().find(|s| s.key == key).expect("an answer");
        assert!(
            first.status == Some(503) && first.retry_after.is_some(),
            "the request caught in the handler by the crash got {first:?} (body {:?}); \
             its instance's log:\n{}",
            String::from_utf8_lossy(&first.body),
            logs[first.instance]
        );
    }
    // During the outage and everywhere else: 201s, or refusals with Retry-After; never a 500,
    // and every request got an answer.
    assert_only_payments_and_refusals(&seen, false, &logs);
    let down = crash.answers_while_down(&seen);
    assert!(
        down.iter().all(|s| matches!(s.status, Some(409 | 503))),
        "answers while the database was down: {:?}",
        tally(down.iter().copied())
    );
    // The instances recovered by themselves.
    assert!(instances.iter_mut().all(|serve| serve.is_running()));
    let payments = assert_one_payment_per_key(&cluster.url, &load, &seen).await;

    // Every payment acknowledged before the crash survived it and replays, byte for byte.
    let acknowledged: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.created() && s.answered <= crash.crashed_at)
        .collect();
    let replays = join_all(acknowledged.iter().map(|s| load.copy(s.key, s.instance))).await;
    for (before, after) in acknowledged.iter().zip(&replays) {
        assert!(
            after.created() && after.replayed && after.body == before.body,
            "payment for key {} acknowledged before the crash: then {:?}, now {:?}",
            load.key(before.key),
            before,
            after
        );
    }

    // From the crash to the first payment after the restart. The 201s in it are work that
    // committed before the server went down and whose answers left after the crash.
    let outage: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.answered >= crash.crashed_at && s.answered < recovered_at)
        .collect();
    let slowest_refusal = outage
        .iter()
        .filter(|s| !s.created())
        .map(|s| s.answered - s.sent)
        .max()
        .unwrap_or_default();
    let keys: HashSet<usize> = seen.iter().map(|s| s.key).collect();
    let caught_answers = tally(seen.iter().filter(|s| CAUGHT.contains(&s.key)));
    eprintln!(
        "PostgreSQL crash (-m immediate) under load: {WORKERS} workers over two instances, and \
         {} requests caught in the handler by the crash, answered {caught_answers:?}; \
         {attempts} attempts for {} keys; answers by status {:?}; from the crash to the \
         recovery {:?}, of which while fully down {:?}; slowest refusal {slowest_refusal:.2?}; \
         pg_ctl stop took {:.2?}, down {:.2?}, pg_ctl start {:.2?}; first 201 {:.2?} after \
         the start began ({:.2?} after the crash); {} payments acknowledged before the crash \
         all replayed; {payments} payments, one per key; 0 keys in progress",
        CAUGHT.len(),
        keys.len(),
        tally(&seen),
        tally(outage.iter().copied()),
        tally(down.iter().copied()),
        crash.down_at - crash.crashed_at,
        crash.recovering_at - crash.down_at,
        crash.up_at - crash.recovering_at,
        recovered_at - crash.recovering_at,
        recovered_at - crash.crashed_at,
        acknowledged.len(),
    );
}
