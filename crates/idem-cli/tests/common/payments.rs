//! Payment intents sent to `idem serve` processes, every answer a client saw recorded, and
//! the checks on what the database holds afterwards: shared by the multi-process PostgreSQL
//! tests (postgres_cluster, postgres_failover). Include it beside `processes`.

#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use idem_client::{Client, Intent, RetryBudget, RetryPolicy};
use idem_core::{IdempotencyKey, KeyLimits};
use rand::SeedableRng;
use rand::rngs::StdRng;
use reqwest::header::{AUTHORIZATION, HeaderValue, RETRY_AFTER};
use sqlx::{Connection, PgConnection};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::processes::Serve;

/// One answer (or the lack of one) as a client saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub key: usize,
    pub instance: usize,
    /// `None`: no response at all (connection refused or cut, timeout).
    pub status: Option<u16>,
    pub retry_after: Option<String>,
    pub replayed: bool,
    /// The payment id of a `201`.
    pub id: Option<String>,
    pub body: Bytes,
    /// Why there was no response.
    pub error: Option<String>,
    pub sent: Instant,
    pub answered: Instant,
}

impl Seen {
    pub fn created(&self) -> bool {
        self.status == Some(201)
    }

    pub fn label(&self) -> String {
        match self.status {
            None => "no response".into(),
            Some(201) if self.replayed => "201 replayed".into(),
            Some(201) => "201 fresh".into(),
            Some(code) => code.to_string(),
        }
    }
}

/// Every answer of a test, in the order they arrived; waiters are woken on each one.
#[derive(Default)]
pub struct Journal {
    seen: Mutex<Vec<Seen>>,
    changed: Notify,
}

impl Journal {
    pub fn record(&self, seen: Seen) {
        self.lock().push(seen);
        self.changed.notify_waiters();
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Seen>> {
        // Only pushes and reads happen under the lock; a panic cannot leave it half-written.
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn snapshot(&self) -> Vec<Seen> {
        self.lock().clone()
    }

    /// Waits until `done` holds for the answers so far, or panics at `deadline`.
    pub async fn until(&self, what: &str, deadline: Instant, done: impl Fn(&[Seen]) -> bool) {
        loop {
            // Registered before the check, so an answer arriving in between still wakes us.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if done(&self.lock()) {
                return;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                panic!("timed out waiting for {what}");
            }
        }
    }
}

impl Journal {
    /// Waits until `more` answers beyond those so far are `201`s, or panics at `deadline`.
    pub async fn until_more_payments(&self, what: &str, more: usize, deadline: Instant) {
        let created = |s: &[Seen]| s.iter().filter(|s| s.created()).count();
        let before = created(&self.lock());
        self.until(what, deadline, |s| created(s) >= before + more)
            .await;
    }
}

/// Sends payment intents to the instances and records every answer.
pub struct Load {
    client: Client,
    urls: Vec<String>,
    prefix: &'static str,
    pub journal: Arc<Journal>,
    backoff: RetryPolicy,
    deadline: Instant,
    pub attempts: AtomicUsize,
}

impl Load {
    pub fn new(instances: &[Serve], prefix: &'static str, deadline: Instant) -> Self {
        // reqwest opens a connection per concurrent request (no cap), so a burst goes out at
        // once.
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .expect("an HTTP client");
        // One attempt per `send`: the test runs the retry loop itself so that it sees every
        // answer, a 500 included, which the client's own loop would retry silently.
        let client = Client::new()
            .with_http_client(http)
            .with_budget(RetryBudget::unlimited())
            .with_policy(RetryPolicy {
                max_attempts: 1,
                attempt_timeout: Duration::from_secs(20),
                ..RetryPolicy::default()
            });
        Self {
            client,
            urls: instances.iter().map(|s| s.url.clone()).collect(),
            prefix,
            journal: Arc::default(),
            backoff: RetryPolicy {
                base: Duration::from_millis(20),
                cap: Duration::from_millis(500),
                max_attempts: u32::MAX,
                ..RetryPolicy::default()
            },
            deadline,
            attempts: AtomicUsize::new(0),
        }
    }

    pub fn key(&self, key: usize) -> String {
        format!("{}-{key:06}", self.prefix)
    }

    pub fn intent(&self, key: usize, instance: usize) -> Intent {
        let key_name = IdempotencyKey::new(self.key(key), KeyLimits::default()).expect("valid");
        Intent::post(format!("{}/payments", self.urls[instance]))
            .with_key(key_name)
            .header(
                AUTHORIZATION,
                HeaderValue::from_static("Bearer sk_test_alice"),
            )
            .json(&serde_json::json!({"amount": 1000 + key, "currency": "EUR"}))
    }

    /// Sends one copy of `key` to `instance` until it gets a final answer, and returns that.
    /// A refusal (409, 503, or a 500 that must not happen) is retried on the same instance
    /// after its `Retry-After`; no response at all moves the copy to the next instance, as a
    /// client behind a load balancer would.
    pub async fn copy(&self, key: usize, mut instance: usize) -> Seen {
        let mut waits = self.backoff.delays(StdRng::from_os_rng());
        loop {
            let intent = self.intent(key, instance);
            let sent = Instant::now();
            self.attempts.fetch_add(1, Ordering::Relaxed);
            let (status, headers, body, replayed, error, is_final) =
                match self.client.send(&intent).await {
                    Ok(answer) => (
                        Some(answer.status.as_u16()),
                        answer.headers,
                        answer.body,
                        answer.replayed,
                        None,
                        true,
                    ),
                    Err(idem_client::Error::Status { last, .. }) => (
                        Some(last.status.as_u16()),
                        last.headers,
                        last.body,
                        false,
                        None,
                        false,
                    ),
                    Err(e @ idem_client::Error::Transport { .. }) => (
                        None,
                        Default::default(),
                        Bytes::new(),
                        false,
                        Some(format!("{:#}", anyhow::Error::new(e))),
                        false,
                    ),
                    Err(e) => panic!("the request for key {key} could not be sent: {e}"),
                };
            let id = (status == Some(201))
                .then(|| serde_json::from_slice::<serde_json::Value>(&body).ok())
                .flatten()
                .and_then(|v| v["id"].as_str().map(str::to_owned));
            let seen = Seen {
                key,
                instance,
                status,
                retry_after: headers
                    .get(RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
                replayed,
                id,
                body,
                error,
                sent,
                answered: Instant::now(),
            };
            self.journal.record(seen.clone());
            if is_final {
                return seen;
            }
            assert!(
                Instant::now() < self.deadline,
                "key {} got no final answer in time; the last attempt got {seen:?}",
                self.key(key)
            );
            let jittered = waits.next().expect("the backoff never runs out");
            let wait = match &seen.retry_after {
                // The service asks for whole seconds; capped so a test never idles long.
                Some(asked) => asked.parse().map_or(jittered, |secs| {
                    Duration::from_secs(secs).min(Duration::from_secs(2))
                }),
                None => jittered,
            };
            if seen.status.is_none() {
                instance = (instance + 1) % self.urls.len();
            }
            tokio::time::sleep(wait).await;
        }
    }
}

/// Answers by label, for the figures.
pub fn tally<'a>(seen: impl IntoIterator<Item = &'a Seen>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for s in seen {
        *counts.entry(s.label()).or_default() += 1;
    }
    counts
}

/// Every answer is a `201`, or a refusal the client may retry: `409` or `503`, each with
/// `Retry-After`. Anything else (a `500` above all) fails with the answer and the instances'
/// logs as evidence.
pub fn assert_only_payments_and_refusals(
    seen: &[Seen],
    no_response_allowed: bool,
    logs: &[String],
) {
    let bad: Vec<&Seen> = seen
        .iter()
        .filter(|s| match s.status {
            Some(201) => false,
            Some(409 | 503) => s.retry_after.is_none(),
            Some(_) => true,
            None => !no_response_allowed,
        })
        .collect();
    assert!(
        bad.is_empty(),
        "{} unexpected answers, the first: {:?} (body {:?}); answers by status: {:?}\nlogs:\n{}",
        bad.len(),
        bad[0],
        String::from_utf8_lossy(&bad[0].body),
        tally(seen),
        logs.join("\n---\n")
    );
}

/// The final state in the database: one payment per key that got a `201`, with the id every
/// `201` of that key carried; no other payment; every key row completed, none in progress.
/// Returns the payment count.
pub async fn assert_one_payment_per_key(database: &str, load: &Load, seen: &[Seen]) -> usize {
    let mut ids: HashMap<String, HashSet<&str>> = HashMap::new();
    for s in seen.iter().filter(|s| s.created()) {
        ids.entry(load.key(s.key))
            .or_default()
            .insert(s.id.as_deref().expect("a 201 carries an id"));
    }
    for (key, key_ids) in &ids {
        assert_eq!(
            key_ids.len(),
            1,
            "key {key} answered with several ids: {key_ids:?}"
        );
    }

    let mut db = PgConnection::connect(database).await.expect("connect");
    let rows: Vec<(Option<String>, String)> =
        sqlx::query_as("SELECT idem_key, id FROM payments ORDER BY idem_key")
            .fetch_all(&mut db)
            .await
            .expect("read payments");
    let mut stored: HashMap<String, Vec<String>> = HashMap::new();
    for (key, id) in rows.iter().cloned() {
        stored
            .entry(key.expect("every payment was made with a key"))
            .or_default()
            .push(id);
    }
    let doubled: Vec<_> = stored.iter().filter(|(_, p)| p.len() > 1).collect();
    assert!(
        doubled.is_empty(),
        "keys charged more than once: {doubled:?}"
    );
    assert_eq!(
        stored.len(),
        ids.len(),
        "payments for keys that never got a 201, or 201s without a payment"
    );
    for (key, key_ids) in &ids {
        let stored_id = stored.get(key).map(|p| p[0].as_str());
        assert_eq!(
            stored_id,
            key_ids.iter().next().copied(),
            "key {key}: the answered id is not the stored payment"
        );
    }

    let in_progress: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE status = 'in_progress'")
            .fetch_one(&mut db)
            .await
            .expect("count keys in progress");
    assert_eq!(in_progress, 0, "keys left in progress");
    let completed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE status = 'completed'")
            .fetch_one(&mut db)
            .await
            .expect("count completed keys");
    assert_eq!(
        completed as usize,
        ids.len(),
        "one completed key row per key"
    );
    db.close().await.expect("close");
    rows.len()
}

/// Waits until `n` sessions of `database` running a statement that contains `statement` are
/// blocked on a lock.
pub async fn lock_waiters(database: &str, statement: &str, n: i64, deadline: Instant) {
    until_sessions(
        database,
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND strpos(query, $1) > 0",
        Some(statement),
        n,
        Duration::from_millis(10),
        deadline,
        &format!("waiting on a lock in {statement:?}"),
    )
    .await;
}

/// Waits until `n` sessions of `database` match `sql`, a count over `pg_stat_activity` (with
/// `arg` as its `$1` if it takes one), asking every `period`. PostgreSQL announces no such
/// event, so this watches its own view of its sessions, with a deadline; `what` the sessions
/// were waited for to do says, with their count, what was missing when it passes.
pub async fn until_sessions(
    database: &str,
    sql: &'static str,
    arg: Option<&str>,
    n: i64,
    period: Duration,
    deadline: Instant,
    what: &str,
) {
    let mut db = PgConnection::connect(database).await.expect("connect");
    let mut every = tokio::time::interval(period);
    loop {
        every.tick().await;
        let mut count = sqlx::query_scalar::<_, i64>(sql);
        if let Some(arg) = arg {
            count = count.bind(arg);
        }
        let sessions = count
            .fetch_one(&mut db)
            .await
            .expect("read pg_stat_activity");
        if sessions >= n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{sessions} sessions {what}, not {n}"
        );
    }
    db.close().await.expect("close");
}

pub fn logs(instances: &[Serve]) -> Vec<String> {
    instances.iter().map(|serve| serve.log()).collect()
}

/// Whether each of the first `workers` workers of [`Workers`] sent a copy at or after
/// `since`, and so met whatever happened then (its answers are in `seen`).
pub fn every_worker_sent_since(seen: &[Seen], since: Instant, workers: usize) -> bool {
    seen.iter()
        .filter(|s| s.sent >= since && s.key / STRIDE < workers)
        .map(|s| s.key / STRIDE)
        .collect::<HashSet<_>>()
        .len()
        == workers
}

/// When an outage of the database under load began and ended, as [`Workers::outage`] made
/// it.
pub struct Outage {
    /// Just before the crash.
    pub crashed_at: Instant,
    /// Just after it: the database is down.
    pub down_at: Instant,
    /// Once every worker met the outage, just before the database is brought back.
    pub recovering_at: Instant,
    /// Once it is back.
    pub up_at: Instant,
}

impl Outage {
    /// The answers in `seen` to copies sent once the database was down, answered before its
    /// recovery began.
    pub fn answers_while_down<'a>(&self, seen: &'a [Seen]) -> Vec<&'a Seen> {
        seen.iter()
            .filter(|s| s.sent >= self.down_at && s.answered <= self.recovering_at)
            .collect()
    }
}

/// The keys of worker `w` of [`Workers`] are `w * STRIDE + n`.
pub const STRIDE: usize = 100_000;

/// Workers that each pay one intent after another, each until it gets its `201`, until told
/// to stop: worker `w` pays keys `w * STRIDE + n` through instance `w % 2`.
pub struct Workers {
    load: Arc<Load>,
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Workers {
    pub fn start(load: &Arc<Load>, workers: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..workers)
            .map(|w| {
                let (load, stop) = (load.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        load.copy(w * STRIDE + n, w % 2).await;
                        n += 1;
                    }
                })
            })
            .collect();
        Self {
            load: load.clone(),
            stop,
            tasks,
        }
    }

    /// An outage under their load: `crash` brings the database down; once each worker sent a
    /// copy into it (or at `deadline`, a panic), `recover` brings it back. Both block, so they
    /// run with `block_in_place`.
    pub async fn outage(
        &self,
        deadline: Instant,
        crash: impl FnOnce(),
        recover: impl FnOnce(),
    ) -> Outage {
        let crashed_at = Instant::now();
        tokio::task::block_in_place(crash);
        let down_at = Instant::now();
        let workers = self.tasks.len();
        self.load
            .journal
            .until(
                "every worker answered while the database was down",
                deadline,
                |s| every_worker_sent_since(s, down_at, workers),
            )
            .await;
        let recovering_at = Instant::now();
        tokio::task::block_in_place(recover);
        Outage {
            crashed_at,
            down_at,
            recovering_at,
            up_at: Instant::now(),
        }
    }

    /// Stops them; returns once each finished its last intent.
    pub async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("a worker finished its last intent");
        }
    }
}
