//! `idem proxy --store redis+cluster://…` as a real process, on a Redis Cluster of its own
//! (3 primaries, 3 replicas, Debian's `redis-server`), in front of an upstream of the test's
//! own that counts its calls per key: replays, mismatches and duplicates in flight with keys
//! on every primary; then, with `--redis-wait-replicas 1`, a primary killed with SIGKILL under
//! load from 16 clients.
//!
//! Each test prints what it measured (`--nocapture` shows it).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::common::processes::Proxy;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use bytes::Bytes;
use idem_testkit::redis_cluster::RedisCluster;
use tokio::sync::{Notify, Semaphore};

/// The upstream: answers `201` with a body naming the key and how many times it was called,
/// and keeps count. `POST /slow` waits for the test's go before it answers.
struct Upstream {
    inner: Mutex<Calls>,
    /// A permit per `/slow` call the test lets through.
    gate: Semaphore,
    /// Told when a `/slow` call has arrived.
    arrived: Notify,
}

#[derive(Default)]
struct Calls {
    /// Calls per key.
    calls: HashMap<String, usize>,
    /// Calls per key still running.
    running: HashMap<String, usize>,
    /// Keys called while an earlier call of theirs still ran.
    overlaps: Vec<String>,
}

impl Upstream {
    fn lock(&self) -> MutexGuard<'_, Calls> {
        // No await under it: a std Mutex.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn calls(&self, key: &str) -> usize {
        self.lock().calls.get(key).copied().unwrap_or(0)
    }
}

/// Ends a call when the handler ends, answered or dropped by a proxy that hung up.
struct Running<'a>(&'a Upstream, String);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        *self.0.lock().running.entry(self.1.clone()).or_default() -= 1;
    }
}

async fn call(
    State(upstream): State<Arc<Upstream>>,
    uri: Uri,
    headers: HeaderMap,
) -> impl axum::response::IntoResponse {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("<no key>")
        .to_owned();
    let n = {
        let mut calls = upstream.lock();
        let running = calls.running.entry(key.clone()).or_default();
        *running += 1;
        if *running > 1 {
            calls.overlaps.push(key.clone());
        }
        let n = calls.calls.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    let running = Running(&upstream, key);
    if uri.path() == "/slow" {
        upstream.arrived.notify_one();
        upstream
            .gate
            .acquire()
            .await
            .expect("the gate stays open")
            .forget();
    }
    let body = format!(r#"{{"id":"ord_{}_{n}"}}"#, running.1);
    drop(running);
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
}

async fn start_upstream() -> (String, Arc<Upstream>) {
    let upstream = Arc::new(Upstream {
        inner: Mutex::default(),
        gate: Semaphore::new(0),
        arrived: Notify::new(),
    });
    let app = axum::Router::new()
        .route("/orders", axum::routing::post(call))
        .route("/slow", axum::routing::post(call))
        .with_state(upstream.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, upstream)
}

/// A proxy on `cluster` in front of `upstream`, with `extra` flags; its log in `dir`.
async fn start_proxy(
    dir: &std::path::Path,
    upstream: &str,
    cluster: &RedisCluster,
    extra: &[&str],
) -> Proxy {
    let store = cluster.url();
    let mut args = vec!["--store", &store, "--upstream-timeout-secs", "5"];
    args.extend_from_slice(extra);
    Proxy::start_proxy(dir, upstream, &args, dir.join("proxy.log")).await
}

/// What the proxy answered.
#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    retry_after: Option<String>,
    body: Bytes,
}

async fn post(client: &reqwest::Client, url: &str, key: &str, body: &str) -> Answer {
    let response = client
        .post(url)
        .header("authorization", "Bearer t1")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("the proxy answers");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (replayed, retry_after) = (header("idempotent-replayed"), header("retry-after"));
    Answer {
        status: response.status().as_u16(),
        replayed: replayed.as_deref() == Some("true"),
        retry_after,
        body: response.bytes().await.expect("a body"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_the_proxy_replays_refuses_mismatches_and_holds_duplicates_in_flight() {
    let cluster = RedisCluster::start(3, 1);
    let dir = tempfile::tempdir().unwrap();
    let (upstream_url, upstream) = start_upstream().await;
    let proxy = start_proxy(dir.path(), &upstream_url, &cluster, &[]).await;
    let client = reqwest::Client::new();
    let orders = format!("{}/orders", proxy.url);
    for i in 0..30 {
        let key = format!("order-{i:04}");
        let body = format!(r#"{{"n":{i}}}"#);
        let first = post(&client, &orders, &key, &body).await;
        assert_eq!(
            (first.status, first.replayed),
            (201, false),
            "{key}: {first:?}"
        );
        let again = post(&client, &orders, &key, &body).await;
        assert_eq!(
            (again.status, again.replayed),
            (201, true),
            "{key}: {again:?}"
        );
        assert_eq!(
            again.body, first.body,
            "{key}: the replay carries the first answer"
        );
        let other = post(&client, &orders, &key, r#"{"n":-1}"#).await;
        assert_eq!(
            other.status, 422,
            "{key}: another body with the same key: {other:?}"
        );
        assert_eq!(upstream.calls(&key), 1, "{key}: called once");
    }
    // The keys' records are on every primary, so each answer above came from every one.
    for port in cluster.masters() {
        assert!(
            cluster.keys_on(port) > 0,
            "no records on the primary :{port}"
        );
    }

    // A duplicate while the first call runs is refused with 409 and Retry-After, not sent on.
    let slow = format!("{}/slow", proxy.url);
    let arrived = upstream.arrived.notified();
    let first = tokio::spawn({
        let (client, slow) = (client.clone(), slow.clone());
        async move { post(&client, &slow, "slow-0001", "{}").await }
    });
    arrived.await;
    let duplicate = post(&client, &slow, "slow-0001", "{}").await;
    assert_eq!(duplicate.status, 409, "{duplicate:?}");
    assert!(duplicate.retry_after.is_some(), "a 409 says when to retry");
    upstream.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
    let replay = post(&client, &slow, "slow-0001", "{}").await;
    assert_eq!(
        (replay.status, replay.replayed, &replay.body),
        (201, true, &first.body)
    );
    assert_eq!(upstream.calls("slow-0001"), 1);
    assert!(upstream.lock().overlaps.is_empty());

    // `idem keys` reaches the records on every primary through the cluster's URL.
    let (code, list, stderr) = crate::common::idem_output(
        "keys",
        &["--database", &cluster.url(), "list", "--limit", "100"],
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(list.contains("31 keys"), "{list}");
    let log = proxy.log();
    assert!(!log.contains("panicked"), "the proxy's log:\n{log}");
}

/// What the clients saw during the kill.
#[derive(Debug, Default)]
struct Seen {
    /// Keys answered `201`, with the body.
    acknowledged: Vec<(String, String, Bytes)>,
    /// The phase of the run the answers now come in (see [`PHASES`]).
    phase: usize,
    /// Answers by phase and status.
    statuses: BTreeMap<(&'static str, u16), usize>,
    /// Answers outside 201/409/503-with-Retry-After.
    unexpected: Vec<String>,
    /// Keys given up after their attempts, unanswered with a `201`.
    given_up: usize,
    /// The length of the latest run of fresh keys acknowledged at their first attempt.
    first_try_streak: usize,
}

/// The phases of the kill run, in order.
const PHASES: [&str; 4] = [
    "before the kill",
    "until the promotion",
    "until the killed node is back",
    "until every primary takes claims",
];

/// Attempts per key before a client gives up on it: enough to ride out a claim's `503`, few
/// enough that clients do not all wait on the killed primary's slots.
const ATTEMPTS: usize = 4;

/// Fresh keys in a row, each acknowledged at its first attempt, that show every primary taking
/// claims again: were one primary's slots (a third of the keys) still refused, 30 in a row
/// would happen once in 200,000 runs.
const RECOVERED_STREAK: usize = 30;

/// 16 clients sending fresh keys, each retried on `503` and `409` a few times.
struct Clients {
    seen: Arc<Mutex<Seen>>,
    acknowledged: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Clients {
    fn start(url: &str) -> Self {
        let seen: Arc<Mutex<Seen>> = Arc::default();
        let acknowledged: Arc<AtomicUsize> = Arc::default();
        let stop: Arc<AtomicBool> = Arc::default();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        let tasks = (0..16)
            .map(|task| {
                let (seen, acknowledged, stop, client) = (
                    seen.clone(),
                    acknowledged.clone(),
                    stop.clone(),
                    client.clone(),
                );
                let url = format!("{url}/orders");
                tokio::spawn(async move {
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        let (key, body) = (format!("kill-{task}-{n}"), format!(r#"{{"n":{n}}}"#));
                        let answered = one_key(&client, &url, &key, &body, &seen).await;
                        if answered {
                            acknowledged.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        Self {
            seen,
            acknowledged,
            stop,
            tasks,
        }
    }

    fn seen(&self) -> MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until `done` holds for what the clients saw, or panics after `patience`.
    async fn wait_for(&self, what: &str, patience: Duration, done: impl Fn(&Seen) -> bool) {
        let started = Instant::now();
        loop {
            let reached = done(&self.seen());
            if reached {
                return;
            }
            assert!(
                started.elapsed() < patience,
                "{what}: not within {patience:?}; {} acknowledged, statuses {:?}",
                self.acknowledged.load(Ordering::Relaxed),
                self.seen().statuses
            );
            // The clients announce nothing: look again shortly.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(self) -> Seen {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("a client task");
        }
        Arc::try_unwrap(self.seen)
            .map_err(|_| "the clients ended")
            .unwrap()
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Sends `key` until it is acknowledged or its attempts are spent; whether it was.
async fn one_key(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    body: &str,
    seen: &Mutex<Seen>,
) -> bool {
    for attempt in 1..=ATTEMPTS {
        let answer = post(client, url, key, body).await;
        if note(seen, key, body, attempt, answer) {
            return true;
        }
        // Sooner than the Retry-After (1 s) asks, so the run sees more of the failover.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    seen.lock().unwrap_or_else(PoisonError::into_inner).given_up += 1;
    false
}

/// Notes what `key`'s attempt was answered; whether it was acknowledged.
fn note(seen: &Mutex<Seen>, key: &str, body: &str, attempt: usize, answer: Answer) -> bool {
    let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
    let phase = PHASES[seen.phase];
    *seen.statuses.entry((phase, answer.status)).or_default() += 1;
    match answer.status {
        201 => {
            let streak = if attempt == 1 {
                seen.first_try_streak + 1
            } else {
                0
            };
            seen.first_try_streak = streak;
            seen.acknowledged
                .push((key.to_owned(), body.to_owned(), answer.body));
            true
        }
        409 | 503 if answer.retry_after.is_some() => {
            seen.first_try_streak = 0;
            false
        }
        _ => {
            seen.unexpected.push(format!("{key}: {answer:?}"));
            false
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_a_primary_kill_with_wait_clients_see_only_503_and_every_acknowledged_key_replays() {
    let mut cluster = RedisCluster::start(3, 1);
    let dir = tempfile::tempdir().unwrap();
    let (upstream_url, upstream) = start_upstream().await;
    let proxy = start_proxy(
        dir.path(),
        &upstream_url,
        &cluster,
        &["--redis-wait-replicas", "1"],
    )
    .await;
    let clients = Clients::start(&proxy.url);
    clients
        .wait_for(
            "200 keys before the kill",
            Duration::from_secs(60),
            |seen| seen.acknowledged.len() >= 200,
        )
        .await;
    let victim = cluster.masters()[0];
    let killed_at = Instant::now();
    clients.seen().phase = 1;
    cluster.kill(victim);
    tokio::task::block_in_place(|| cluster.wait_for_failover(victim, 3));
    let promoted = killed_at.elapsed();
    // Under WAIT 1 the promoted primary, left without a replica, refuses claims (503) until
    // the killed node is back as its replica: let the clients meet that first.
    clients.seen().phase = 2;
    clients
        .wait_for(
            "503s from the promoted primary",
            Duration::from_secs(20),
            |seen| {
                seen.statuses
                    .get(&(PHASES[2], 503))
                    .is_some_and(|&n| n >= 5)
            },
        )
        .await;
    tokio::task::block_in_place(|| {
        cluster.restart(victim);
        cluster.wait_for_replica(victim);
    });
    let back = killed_at.elapsed();
    {
        let mut seen = clients.seen();
        seen.phase = 3;
        seen.first_try_streak = 0;
    }
    clients
        .wait_for(
            "every primary taking claims again",
            Duration::from_secs(30),
            |seen| seen.first_try_streak >= RECOVERED_STREAK,
        )
        .await;
    let recovered = killed_at.elapsed();
    let seen = clients.stop().await;

    // After recovery, every acknowledged key replays its bytes without reaching the upstream.
    let client = reqwest::Client::new();
    let orders = format!("{}/orders", proxy.url);
    let mut not_replayed = Vec::new();
    for (key, body, first) in &seen.acknowledged {
        let replay = post(&client, &orders, key, body).await;
        if (replay.status, replay.replayed, &replay.body) != (201, true, first) {
            not_replayed.push(format!("{key}: {replay:?}"));
        }
    }
    let calls = upstream.lock();
    let called_twice: Vec<_> = calls.calls.iter().filter(|&(_, &n)| n > 1).collect();
    let by_phase: Vec<String> = PHASES
        .iter()
        .map(|&phase| {
            let statuses: Vec<String> = seen
                .statuses
                .iter()
                .filter(|&(&(p, _), _)| p == phase)
                .map(|(&(_, status), n)| format!("{n} × {status}"))
                .collect();
            format!("{phase}: {}", statuses.join(", "))
        })
        .collect();
    println!(
        "WAIT 1 proxy: {} keys acknowledged, {} given up; answers {}; replica promoted {:.1} s \
         after the kill, the killed node back as its replica at {:.1} s, {RECOVERED_STREAK} fresh \
         keys in a row acknowledged at once by {:.1} s; {} acknowledged keys not replayed, {} keys \
         called twice",
        seen.acknowledged.len(),
        seen.given_up,
        by_phase.join("; "),
        promoted.as_secs_f64(),
        back.as_secs_f64(),
        recovered.as_secs_f64(),
        not_replayed.len(),
        called_twice.len(),
    );
    assert!(
        seen.unexpected.is_empty(),
        "answers other than 201, 409 or 503 with Retry-After: {:?}",
        &seen.unexpected[..seen.unexpected.len().min(5)]
    );
    assert!(
        calls.overlaps.is_empty(),
        "keys called while their first call ran: {:?}",
        calls.overlaps
    );
    assert!(
        called_twice.is_empty(),
        "keys called twice: {called_twice:?}"
    );
    assert!(
        not_replayed.is_empty(),
        "acknowledged keys that did not replay: {:?}",
        &not_replayed[..not_replayed.len().min(5)]
    );
    let log = proxy.log();
    assert!(!log.contains("panicked"), "the proxy's log:\n{log}");
}

/// Two proxies on one cluster, each started without `--secret` from a directory of its own
/// (two pods): a request sent to the first and retried with the same key at the second is
/// replayed, since the scope secret lives in the cluster (one key, made by whichever proxy
/// started first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_two_proxies_share_their_scopes() {
    let cluster = RedisCluster::start(3, 0);
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (upstream_url, upstream) = start_upstream().await;
    let (a, b) = tokio::join!(
        start_proxy(one.path(), &upstream_url, &cluster, &[]),
        start_proxy(two.path(), &upstream_url, &cluster, &[]),
    );
    let client = reqwest::Client::new();
    let mut replays = 0;
    for i in 0..20 {
        let (key, body) = (format!("crossed-{i:04}"), format!(r#"{{"n":{i}}}"#));
        let sent = post(&client, &format!("{}/orders", a.url), &key, &body).await;
        let retried = post(&client, &format!("{}/orders", b.url), &key, &body).await;
        assert_eq!(
            (sent.status, retried.status),
            (201, 201),
            "{key}: {retried:?}"
        );
        if retried.replayed && retried.body == sent.body {
            replays += 1;
        }
    }
    let calls: usize = upstream.lock().calls.values().sum();
    println!(
        "two proxies on a cluster, 20 keys sent to one and retried at the other: {calls} upstream calls, {replays} replays"
    );
    assert_eq!((calls, replays), (20, 20));
    for proxy in [&a, &b] {
        let log = proxy.log();
        assert!(!log.contains("panicked"), "a proxy's log:\n{log}");
    }
}
