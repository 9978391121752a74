//! `idem serve` and `idem proxy` as real processes with PostgreSQL behind PgBouncer 1.18 in
//! transaction pooling mode (Debian's `pgbouncer`, started by each test on a free port in front
//! of the test server), with the plain URL: starting and migrating, concurrent duplicates, the
//! gateway under 80 keys × 4 concurrent copies, and PgBouncer killed and started again under
//! load. Then the deadlines (docs/contract.md §12): a black hole between either process and
//! PostgreSQL gets `503` with `Retry-After` within the deadline, never a hang.
//!
//! Each test prints what it measured (`--nocapture` shows it).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::common::processes::{PgDatabase, Proxy, Serve};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use bytes::Bytes;
use futures_util::future::join_all;
use idem_testkit::fault_relay::{Fault, FaultRelay};
use idem_testkit::pgbouncer::PgBouncer;

const ALICE: &str = "sk_test_alice";

/// What the service answered one request.
#[derive(Debug, Clone)]
struct Answer {
    status: u16,
    replayed: bool,
    retry_after: Option<String>,
    body: Bytes,
}

async fn post(client: &reqwest::Client, url: &str, key: &str, body: &str) -> Answer {
    let response = client
        .post(url)
        .bearer_auth(ALICE)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("the service answers");
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

fn payment(i: usize) -> String {
    format!(r#"{{"amount": {}, "currency": "EUR"}}"#, 100 + i)
}

/// Statuses and how many times each came.
fn tally(answers: &[Answer]) -> BTreeMap<u16, usize> {
    let mut statuses = BTreeMap::new();
    for answer in answers {
        *statuses.entry(answer.status).or_default() += 1;
    }
    statuses
}

/// Payments per key in the test's database (read directly, not through the pooler).
async fn payments_per_key(db: &PgDatabase) -> HashMap<String, i64> {
    let pool = db.pool(1).await;
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT idem_key, count(*) FROM payments GROUP BY idem_key")
            .fetch_all(&pool)
            .await
            .unwrap();
    rows.into_iter().collect()
}

/// `idem serve` through PgBouncer starts (migrating every schema through it) and takes 40 keys
/// × 4 concurrent copies: one payment per key, every copy `201` (a duplicate waits for the
/// first and replays it) or `409`, the replays byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_through_pgbouncer_migrates_and_takes_concurrent_duplicates() {
    const KEYS: usize = 40;
    const COPIES: usize = 4;
    let db = PgDatabase::create().await;
    let bouncer = PgBouncer::start(20);
    let serve = Serve::start(&bouncer.url_for(db.url())).await;
    let client = reqwest::Client::new();
    let url = format!("{}/payments", serve.url);
    let copies = (0..KEYS).flat_map(|i| (0..COPIES).map(move |_| i));
    let answers = join_all(copies.map(|i| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let key = format!("dup-{i:04}");
            (i, post(&client, &url, &key, &payment(i)).await)
        }
    }))
    .await;
    let all: Vec<Answer> = answers.iter().map(|(_, a)| a.clone()).collect();
    let statuses = tally(&all);
    println!("serve through PgBouncer, {KEYS} keys × {COPIES} concurrent copies: {statuses:?}");
    assert!(
        statuses.keys().all(|s| [201, 409].contains(s)),
        "only 201 and 409: {statuses:?}; the log:\n{}",
        serve.log()
    );
    for i in 0..KEYS {
        let key = format!("dup-{i:04}");
        let created: Vec<&Answer> = answers
            .iter()
            .filter(|(k, a)| *k == i && a.status == 201)
            .map(|(_, a)| a)
            .collect();
        assert!(!created.is_empty(), "{key}: no copy got its payment");
        let replay = post(&client, &url, &key, &payment(i)).await;
        assert_eq!((replay.status, replay.replayed), (201, true), "{key}");
        for answer in created {
            assert_eq!(answer.body, replay.body, "{key}: a replay byte for byte");
        }
    }
    let paid = payments_per_key(&db).await;
    assert_eq!(paid.len(), KEYS, "one payment per key");
    assert!(paid.values().all(|&n| n == 1), "{paid:?}");

    // Reads outside the layer's transactions, many at once: each must run the statement it
    // prepared, on the server session it prepared it on (the pooler lends sessions per
    // transaction), and answer its own payment.
    let ids: Vec<String> = (0..KEYS)
        .map(|i| {
            let created = answers.iter().find(|(k, a)| *k == i && a.status == 201);
            let body: serde_json::Value = serde_json::from_slice(&created.unwrap().1.body).unwrap();
            body["id"].as_str().unwrap().to_owned()
        })
        .collect();
    let reads = join_all(ids.iter().flat_map(|id| {
        let (client, url) = (client.clone(), url.clone());
        [format!("{url}/{id}"), format!("{url}?limit=5")]
            .into_iter()
            .map(move |target| {
                let client = client.clone();
                async move {
                    let response = client.get(&target).bearer_auth(ALICE).send().await;
                    let response = response.expect("the service answers");
                    (
                        target,
                        response.status().as_u16(),
                        response.text().await.unwrap(),
                    )
                }
            })
            .collect::<Vec<_>>()
    }))
    .await;
    for (target, status, body) in reads {
        assert_eq!(status, 200, "GET {target}: {body}");
        if let Some(id) = target
            .rsplit('/')
            .next()
            .filter(|id| id.starts_with("pay_"))
        {
            assert!(
                body.contains(id),
                "GET {target} answered another payment: {body}"
            );
        }
    }
}

/// The gateway's upstream: counts its calls per key and answers `201` with a body naming the
/// key and the call.
#[derive(Default)]
struct Upstream {
    calls: Mutex<HashMap<String, usize>>,
}

impl Upstream {
    fn calls(&self) -> HashMap<String, usize> {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

async fn call(
    State(upstream): State<Arc<Upstream>>,
    headers: HeaderMap,
) -> impl axum::response::IntoResponse {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("<no key>")
        .to_owned();
    let n = {
        let mut calls = upstream
            .calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let n = calls.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    // Long enough for the concurrent copies to find the first one in flight.
    tokio::time::sleep(Duration::from_millis(50)).await;
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        format!(r#"{{"id":"ord_{key}_{n}"}}"#),
    )
}

async fn start_upstream() -> (String, Arc<Upstream>) {
    let upstream = Arc::new(Upstream::default());
    let app = axum::Router::new()
        .route("/orders", axum::routing::post(call))
        .with_state(upstream.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, upstream)
}

async fn start_proxy(dir: &std::path::Path, upstream: &str, store: &str) -> Proxy {
    let args = ["--store", store, "--secret", "pgbouncer-test-secret"];
    Proxy::start_proxy(dir, upstream, &args, dir.join("proxy.log")).await
}

/// `idem proxy --store postgres://…` through PgBouncer: 80 keys × 4 concurrent copies. Each
/// key reaches the upstream once; every copy gets `201` (the first, or a replay) or `409` (a
/// duplicate while the first is in flight).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_through_pgbouncer_calls_the_upstream_once_per_key() {
    const KEYS: usize = 80;
    const COPIES: usize = 4;
    let db = PgDatabase::create().await;
    let bouncer = PgBouncer::start(20);
    let dir = tempfile::tempdir().unwrap();
    let (upstream_url, upstream) = start_upstream().await;
    let proxy = start_proxy(dir.path(), &upstream_url, &bouncer.url_for(db.url())).await;
    let client = reqwest::Client::new();
    let url = format!("{}/orders", proxy.url);
    let copies = (0..KEYS).flat_map(|i| (0..COPIES).map(move |_| i));
    let answers = join_all(copies.map(|i| {
        let (client, url) = (client.clone(), url.clone());
        async move { post(&client, &url, &format!("order-{i:04}"), &payment(i)).await }
    }))
    .await;
    let statuses = tally(&answers);
    let calls = upstream.calls();
    println!(
        "gateway through PgBouncer, {KEYS} keys × {COPIES} concurrent copies: {statuses:?}; \
         upstream calls {} for {} keys",
        calls.values().sum::<usize>(),
        calls.len()
    );
    assert!(
        statuses.keys().all(|s| [201, 409].contains(s)),
        "only 201 and 409: {statuses:?}; the log:\n{}",
        proxy.log()
    );
    assert_eq!(calls.len(), KEYS, "every key reached the upstream");
    assert!(calls.values().all(|&n| n == 1), "once each: {calls:?}");
}

/// One client's intents: each key retried (honouring `Retry-After`, at most every 100 ms) until
/// it gets its `201`; every answer kept with when it came.
async fn pay_until_created(
    client: reqwest::Client,
    url: String,
    keys: std::ops::Range<usize>,
    answers: Arc<Mutex<Vec<(Instant, usize, Answer)>>>,
    deadline: Instant,
) {
    for i in keys {
        let key = format!("restart-{i:05}");
        loop {
            assert!(Instant::now() < deadline, "{key} never got its 201");
            let answer = post(&client, &url, &key, &payment(i)).await;
            let status = answer.status;
            answers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((Instant::now(), i, answer));
            if status == 201 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// PgBouncer killed (SIGKILL) while 8 clients pay, and started again 2 s later: only `201`,
/// `409` and `503` (with `Retry-After`) come back, no key is paid twice, and the service takes
/// payments again without a restart of idem. Prints how long the `503`s lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_rides_out_a_pgbouncer_restart_under_load() {
    const CLIENTS: usize = 8;
    const KEYS_EACH: usize = 60;
    let db = PgDatabase::create().await;
    let mut bouncer = PgBouncer::start(20);
    let serve = Serve::start(&bouncer.url_for(db.url())).await;
    let client = reqwest::Client::new();
    let url = format!("{}/payments", serve.url);
    let answers = Arc::new(Mutex::new(Vec::new()));
    let deadline = Instant::now() + Duration::from_secs(120);
    let load: Vec<_> = (0..CLIENTS)
        .map(|c| {
            tokio::spawn(pay_until_created(
                client.clone(),
                url.clone(),
                c * KEYS_EACH..(c + 1) * KEYS_EACH,
                answers.clone(),
                deadline,
            ))
        })
        .collect();
    // Let the load run, then restart PgBouncer under it.
    let before = answers.lock().unwrap().len();
    while answers.lock().unwrap().len() < before + 100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let killed_at = Instant::now();
    bouncer.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    tokio::task::block_in_place(|| bouncer.start_again());
    let back_at = killed_at.elapsed();
    for client in load {
        client.await.unwrap();
    }
    let answers = answers.lock().unwrap().clone();
    let all: Vec<Answer> = answers.iter().map(|(_, _, a)| a.clone()).collect();
    let statuses = tally(&all);
    let unavailable: Vec<Instant> = answers
        .iter()
        .filter(|(_, _, a)| a.status == 503)
        .map(|(at, _, _)| *at)
        .collect();
    let outage = match (unavailable.first(), unavailable.last()) {
        (Some(first), Some(last)) => format!(
            "PgBouncer killed at 0 s and listening again at {:.2} s; 503s from {:.2} s to \
             {:.2} s ({:.2} s)",
            back_at.as_secs_f64(),
            first.saturating_duration_since(killed_at).as_secs_f64(),
            last.saturating_duration_since(killed_at).as_secs_f64(),
            last.duration_since(*first).as_secs_f64()
        ),
        _ => "no 503".to_owned(),
    };
    println!(
        "PgBouncer restart under load ({CLIENTS} clients, {} keys): {statuses:?}; {outage}",
        CLIENTS * KEYS_EACH
    );
    assert!(
        statuses.keys().all(|s| [201, 409, 503].contains(s)),
        "only 201, 409 and 503: {statuses:?}; the log:\n{}",
        serve.log()
    );
    for (_, i, answer) in &answers {
        if answer.status == 503 || answer.status == 409 {
            assert!(answer.retry_after.is_some(), "key {i}: {answer:?}");
        }
    }
    let paid = payments_per_key(&db).await;
    assert_eq!(paid.len(), CLIENTS * KEYS_EACH, "every key paid");
    assert!(paid.values().all(|&n| n == 1), "no key paid twice");
    assert!(
        bouncer.log().contains("process up"),
        "PgBouncer ran again: {}",
        bouncer.log()
    );
}

/// A relay to the test PostgreSQL, for a black hole between a process and it.
async fn relay_to_postgres(db: &PgDatabase) -> (FaultRelay, String) {
    let options: sqlx::postgres::PgConnectOptions = db.url().parse().unwrap();
    let relay = FaultRelay::start_to(options.get_host(), options.get_port(), 0)
        .await
        .unwrap();
    let url = idem_testkit::postgres::with_hosts(db.url(), &[relay.addr()], "");
    (relay, url)
}

/// Times one request; asserts it got `503` with `Retry-After` within `deadline`.
async fn unavailable_within(client: &reqwest::Client, url: &str, key: &str, deadline: Duration) {
    let started = Instant::now();
    let answer = post(client, url, key, &payment(1)).await;
    let took = started.elapsed();
    println!("{url} in a black hole: {} after {took:.2?}", answer.status);
    assert_eq!(answer.status, 503, "{answer:?}");
    assert!(answer.retry_after.is_some(), "{answer:?}");
    assert!(took <= deadline, "took {took:?}, past {deadline:?}");
}

/// A black hole between `idem serve` and PostgreSQL: a payment (transaction mode, its claim
/// waiting at most the 1 s in-flight wait on top of the 6 s deadline) and a payout (lease mode)
/// get `503` with `Retry-After` within their deadlines; once the black hole ends, payments go
/// through again without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_503_within_the_deadline_in_a_black_hole() {
    let db = PgDatabase::create().await;
    let (relay, url) = relay_to_postgres(&db).await;
    let serve = Serve::start_with(&url, &["--in-flight-wait-secs", "1"]).await;
    let client = reqwest::Client::new();
    let payments = format!("{}/payments", serve.url);
    let first = post(&client, &payments, "before-the-hole", &payment(0)).await;
    assert_eq!(first.status, 201, "{first:?}");
    relay.set(Fault::BlackHole);
    let slack = Duration::from_secs(2);
    unavailable_within(
        &client,
        &payments,
        "in-the-hole-1",
        Duration::from_secs(7) + slack,
    )
    .await;
    let payouts = format!("{}/payouts", serve.url);
    unavailable_within(
        &client,
        &payouts,
        "in-the-hole-2",
        Duration::from_secs(6) + slack,
    )
    .await;
    relay.clear();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let after = post(&client, &payments, "after-the-hole", &payment(2)).await;
        if after.status == 201 {
            break;
        }
        assert_eq!(after.status, 503, "{after:?}");
        assert!(Instant::now() < deadline, "payments never came back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The same for `idem proxy --store postgres://…`: `503` with `Retry-After` within the 6 s
/// deadline, and the upstream never called for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_answers_503_within_the_deadline_in_a_black_hole() {
    let db = PgDatabase::create().await;
    let (relay, url) = relay_to_postgres(&db).await;
    let dir = tempfile::tempdir().unwrap();
    let (upstream_url, upstream) = start_upstream().await;
    let proxy = start_proxy(dir.path(), &upstream_url, &url).await;
    let client = reqwest::Client::new();
    let orders = format!("{}/orders", proxy.url);
    assert_eq!(
        post(&client, &orders, "before-the-hole", &payment(0))
            .await
            .status,
        201
    );
    relay.set(Fault::BlackHole);
    unavailable_within(&client, &orders, "in-the-hole-1", Duration::from_secs(8)).await;
    relay.clear();
    assert!(!upstream.calls().contains_key("in-the-hole-1"));
}
