//! Failover with real processes: a PostgreSQL 15 primary and a synchronous hot standby made
//! with `pg_basebackup -R`, two `idem serve` instances on a URL that names both hosts, payment
//! intents under load; the primary is stopped with `pg_ctl stop -m immediate` and the standby
//! promoted with `pg_ctl promote`. The clusters are the test's own, on ports picked for it,
//! and are stopped and deleted when it ends, pass or fail.
//!
//! The test prints the outage as the clients saw it (`--nocapture` shows it).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::common::payments::{
    Load, Seen, Workers, assert_one_payment_per_key, assert_only_payments_and_refusals, logs,
    tally, until_sessions,
};
use crate::common::processes::{Cluster, Serve};
use futures_util::future::join_all;
use tokio::task::block_in_place;
use tokio::time::Instant;

const WORKERS: usize = 16;

/// Waits until the primary's standby is synchronous: each commit then waits until the standby
/// has flushed it. PostgreSQL announces no such event, so this asks, with a deadline.
fn until_synchronous(primary: &Cluster, deadline: Instant) {
    loop {
        let state = primary.sql("SELECT string_agg(sync_state, ',') FROM pg_stat_replication");
        if state == "sync" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the standby is not synchronous: {state:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until `n` sessions on `database` listen for outcome wake-ups (`LISTEN`), as each
/// `idem serve` instance's listener does once it follows its pool to the new primary.
async fn listeners(database: &str, n: i64, deadline: Instant) {
    until_sessions(
        database,
        "SELECT count(*) FROM pg_stat_activity
         WHERE state = 'idle' AND query LIKE 'LISTEN %'",
        None,
        n,
        Duration::from_millis(50),
        deadline,
        "listen on the new primary",
    )
    .await;
}

/// When each instance first answered `201` after `since`.
fn first_payments_after(seen: &[Seen], since: Instant) -> [Option<Instant>; 2] {
    [0, 1].map(|instance| {
        seen.iter()
            .filter(|s| s.created() && s.instance == instance && s.answered >= since)
            .map(|s| s.answered)
            .min()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_promoted_synchronous_standby_takes_over_with_every_acknowledged_payment() {
    let deadline = Instant::now() + Duration::from_secs(90);
    let primary = block_in_place(Cluster::start);
    let standby = block_in_place(|| primary.standby());
    // Set after the copy, so that the standby, once promoted, waits for no standby of its own.
    block_in_place(|| {
        primary.sql("ALTER SYSTEM SET synchronous_standby_names = '*'");
        primary.sql("ALTER SYSTEM SET synchronous_commit = 'on'");
        primary.sql("SELECT pg_reload_conf()");
        until_synchronous(&primary, deadline);
    });
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port(),
        standby.port()
    );
    let mut instances = [Serve::start(&url).await, Serve::start(&url).await];
    let load = Arc::new(Load::new(&instances, "failover", deadline));
    let workers = Workers::start(&load, WORKERS);
    let journal = load.journal.clone();
    let created = |s: &[Seen]| s.iter().filter(|s| s.created()).count();

    journal
        .until("payments before the failover", deadline, |s| {
            created(s) >= 150
        })
        .await;
    // No primary until every worker met the outage; then the standby is promoted, as an
    // operator or a failover manager would.
    let crash = workers
        .outage(deadline, || primary.crash(), || standby.promote())
        .await;
    // Both instances pay again, by themselves, on the promoted standby.
    journal
        .until(
            "a payment on each instance after the promotion",
            deadline,
            |s| {
                first_payments_after(s, crash.up_at)
                    .iter()
                    .all(Option::is_some)
            },
        )
        .await;
    journal
        .until_more_payments("more payments after the recovery", 150, deadline)
        .await;
    workers.stop().await;
    let seen = journal.snapshot();
    let mut logs = logs(&instances);
    logs.push(standby.log());

    // Never a 500: payments, and refusals with Retry-After.
    assert_only_payments_and_refusals(&seen, true, &logs);
    // While no primary was up, every answer was a 503 with Retry-After (or none at all).
    let down = crash.answers_while_down(&seen);
    assert!(
        down.iter()
            .all(|s| s.status.is_none() || (s.status == Some(503) && s.retry_after.is_some())),
        "answers while no primary was up: {:?}",
        tally(down.iter().copied())
    );
    assert!(instances.iter_mut().all(|serve| serve.is_running()));
    // Every key has exactly one payment on the new primary, the one its 201s named; no key is
    // left in progress.
    let payments = assert_one_payment_per_key(&standby.url, &load, &seen).await;
    // Every acknowledged payment replays, byte for byte, from the new primary.
    let mut acknowledged: BTreeMap<usize, &Seen> = BTreeMap::new();
    for s in seen.iter().filter(|s| s.created()) {
        acknowledged.entry(s.key).or_insert(s);
    }
    let replays = join_all(acknowledged.values().map(|s| load.copy(s.key, s.instance))).await;
    for (before, after) in acknowledged.values().zip(&replays) {
        assert!(
            after.created() && after.replayed && after.body == before.body,
            "payment for key {}: acknowledged as {before:?}, now {after:?}",
            load.key(before.key)
        );
    }
    // The outcome listeners of both instances followed the pool to the new primary.
    listeners(&standby.url, 2, deadline).await;

    let recovered = first_payments_after(&seen, crash.up_at).map(|at| at.expect("a payment"));
    // From the moment the primary was down to the first payment after the promotion.
    let outage: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.answered >= crash.down_at && s.answered < recovered[0].min(recovered[1]))
        .collect();
    let refusals: Vec<Instant> = outage
        .iter()
        .filter(|s| s.status == Some(503))
        .map(|s| s.answered)
        .collect();
    let slowest_refusal = seen
        .iter()
        .filter(|s| s.status == Some(503))
        .map(|s| s.answered - s.sent)
        .max()
        .unwrap_or_default();
    let refusing_for = match (refusals.iter().min(), refusals.iter().max()) {
        (Some(first), Some(last)) => *last - *first,
        _ => Duration::ZERO,
    };
    let acknowledged_before_crash = acknowledged
        .values()
        .filter(|s| s.answered <= crash.crashed_at)
        .count();
    eprintln!(
        "failover to a synchronous standby under load: {WORKERS} workers over two instances; \
         pg_ctl stop -m immediate took {:.2?}; no primary for {:.2?}, then pg_ctl promote took \
         {:.2?}; first 201 after the promotion: instance 0 {:.2?}, instance 1 {:.2?} after \
         promote returned ({:.2?} and {:.2?} after the crash); clients saw 503s for {:.2?} \
         (first to last, the slowest after {slowest_refusal:.2?}), answers from the primary's end to the first payment after the \
         promotion {:?}; {} payments \
         acknowledged ({} before the crash), {payments} payments found on the new primary, one \
         per key, each replayed byte for byte; 0 keys in progress; answers by status {:?}",
        crash.down_at - crash.crashed_at,
        crash.recovering_at - crash.down_at,
        crash.up_at - crash.recovering_at,
        recovered[0] - crash.up_at,
        recovered[1] - crash.up_at,
        recovered[0] - crash.crashed_at,
        recovered[1] - crash.crashed_at,
        refusing_for,
        tally(outage.iter().copied()),
        acknowledged.len(),
        acknowledged_before_crash,
        tally(&seen),
    );
}
