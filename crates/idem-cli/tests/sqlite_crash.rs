//! SQLite's group commit under a crash: `idem serve` on an SQLite file of the test's own,
//! under 32 concurrent payment intents (so requests share commits), killed with SIGKILL in
//! the middle of the load and started again on the same file. Every payment it acknowledged
//! must still be there and replay byte for byte; retrying every intent afterwards must leave
//! exactly one payment per key.
//!
//! The kill is made sure to cut requests: the test freezes the service (SIGSTOP) where it
//! stands, mid-group or mid-commit, waits until a client has sent a key the frozen service
//! can no longer answer, and only then kills it. To the service, the kill lands at the freeze.

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::processes::Serve;
use sqlx::Connection as _;
use tokio::sync::Notify;

const CLIENTS: u32 = 32;
/// Acknowledged payments before the kill: enough that many groups committed and more were
/// open when the process died.
const ACKNOWLEDGED_BEFORE_KILL: usize = 400;

#[derive(Default)]
struct Ledger {
    /// Every key sent, answered or not.
    sent: HashSet<String>,
    /// The `201` bodies the service acknowledged, by key.
    acknowledged: HashMap<String, bytes::Bytes>,
}

fn body_of(key: &str) -> String {
    let amount = 100 + key.len() as u64 * 7;
    format!(r#"{{"amount": {amount}, "currency": "INR", "reference": "{key}"}}"#)
}

async fn pay(client: &reqwest::Client, url: &str, key: &str) -> reqwest::Result<reqwest::Response> {
    client
        .post(format!("{url}/payments"))
        .bearer_auth("sk_test_alice")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body_of(key))
        .send()
        .await
}

/// Stops process `pid` with SIGSTOP and waits until it is stopped (`T` in /proc): from then on
/// it neither commits nor answers, and its kill lands, for it, at this instant.
fn freeze(pid: u32) {
    let status = Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .expect("kill -STOP");
    assert!(status.success(), "kill -STOP {pid}: {status}");
    let state = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("its /proc stat");
        let after_name = stat.rsplit_once(')').expect("a stat line").1.to_owned();
        after_name.split_whitespace().next().map(str::to_owned)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while state().as_deref() != Some("T") {
        assert!(
            Instant::now() < deadline,
            "{pid} did not stop: {:?}",
            state()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_during_group_commits_loses_no_acknowledged_payment() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("idem.db");
    let database = format!("sqlite://{}", file.display());
    let mut serve = Serve::start(&database).await;

    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let enough = Arc::new(Notify::new());
    let stop = Arc::new(AtomicBool::new(false));
    let next_key = Arc::new(AtomicU32::new(0));
    let client = reqwest::Client::new();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (ledger, enough, stop, next_key, client, url) = (
            ledger.clone(),
            enough.clone(),
            stop.clone(),
            next_key.clone(),
            client.clone(),
            serve.url.clone(),
        );
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let key = format!("crash-{:05}", next_key.fetch_add(1, Ordering::SeqCst));
                ledger.lock().unwrap().sent.insert(key.clone());
                // After the kill a request fails to connect or is cut off: not acknowledged.
                let Ok(response) = pay(&client, &url, &key).await else {
                    break;
                };
                let status = response.status();
                let Ok(body) = response.bytes().await else {
                    break;
                };
                assert_eq!(
                    status, 201,
                    "before the kill every intent succeeds: {body:?}"
                );
                let mut ledger = ledger.lock().unwrap();
                ledger.acknowledged.insert(key, body);
                if ledger.acknowledged.len() >= ACKNOWLEDGED_BEFORE_KILL {
                    enough.notify_one();
                }
            }
        }));
    }
    enough.notified().await;
    // A kill right here could find every request answered (this test descheduled meanwhile).
    // Frozen, the service answers nothing more, though answers it wrote still reach clients.
    freeze(serve.pid());
    let acknowledged_at_freeze: Vec<String> = ledger
        .lock()
        .unwrap()
        .acknowledged
        .keys()
        .cloned()
        .collect();
    let mut db = sqlx::SqliteConnection::connect(&database)
        .await
        .expect("open the database file");
    let committed: HashSet<String> =
        sqlx::query_scalar("SELECT idem_key FROM payments WHERE idem_key IS NOT NULL")
            .fetch_all(&mut db)
            .await
            .expect("read the committed payments (WAL: the frozen writer does not block)")
            .into_iter()
            .collect();
    db.close().await.unwrap();
    // Answered only once durable: what was acknowledged is committed, so a key neither
    // acknowledged nor committed was never answered, and never will be.
    let uncommitted: Vec<&String> = acknowledged_at_freeze
        .iter()
        .filter(|key| !committed.contains(*key))
        .collect();
    assert!(
        uncommitted.is_empty(),
        "acknowledged and not committed: {uncommitted:?}"
    );
    // Either some client waits on such a key already, or one reads its last answer and sends
    // the next key, which the frozen service cannot answer.
    let deadline = Instant::now() + Duration::from_secs(60);
    let unanswerable_at_kill = loop {
        {
            let ledger = ledger.lock().unwrap();
            let unanswerable = ledger
                .sent
                .iter()
                .filter(|key| !ledger.acknowledged.contains_key(*key) && !committed.contains(*key))
                .count();
            if unanswerable > 0 {
                break unanswerable;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no client sent a key after the freeze"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    serve.kill();
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.await.expect("a client task panicked");
    }
    let Ledger { sent, acknowledged } = Arc::into_inner(ledger)
        .expect("the clients are done")
        .into_inner()
        .unwrap();
    assert!(
        sent.len() > acknowledged.len(),
        "some requests were in flight at the kill"
    );
    eprintln!(
        "sqlite crash: {} payments committed at the freeze, {} acknowledged before the kill, \
         {unanswerable_at_kill} requests unanswerable at it, {} sent in all",
        committed.len(),
        acknowledged.len(),
        sent.len()
    );

    let serve = Serve::start(&database).await;
    for (key, body) in &acknowledged {
        let again = pay(&client, &serve.url, key)
            .await
            .expect("the restarted service answers");
        assert_eq!(again.status(), 201, "{key}");
        assert_eq!(
            again
                .headers()
                .get("idempotent-replayed")
                .map(|v| v.as_bytes()),
            Some(&b"true"[..]),
            "an acknowledged payment ({key}) replays after the crash"
        );
        assert_eq!(
            &again.bytes().await.unwrap(),
            body,
            "{key} replays byte for byte"
        );
    }
    for key in sent.difference(&acknowledged.keys().cloned().collect()) {
        let retried = pay(&client, &serve.url, key)
            .await
            .expect("the restarted service answers");
        assert_eq!(retried.status(), 201, "a retried intent ({key}) succeeds");
    }

    let mut db = sqlx::SqliteConnection::connect(&database)
        .await
        .expect("open the database file");
    let (payments, keys): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT idem_key) FROM payments")
            .fetch_one(&mut db)
            .await
            .unwrap();
    assert_eq!(
        payments as usize,
        sent.len(),
        "one payment per intent: {} acknowledged before the kill, {} retried after it",
        acknowledged.len(),
        sent.len() - acknowledged.len()
    );
    assert_eq!(keys, payments, "no key holds two payments");
    db.close().await.unwrap();
}
