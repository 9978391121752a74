//! `in_flight`: what a duplicate gets while the first request with its key is still at the
//! upstream, for each store. With `wait`, it waits for the outcome and is replayed it, woken by
//! the store's signal: on PostgreSQL and Redis also when the first request went through
//! another gateway on the same store. With `409` (the default), or once the wait runs out, it
//! gets `409` with `Retry-After`.
//!
//! Run with `--no-capture` to read the wake-up latencies (the upstream's answer released to
//! the duplicate's answer received).

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use idem_gateway::InFlight;
use idem_store::watched::WatchedStore;
use idem_store::{OutcomeChannel, Store};
use idem_tower::OutcomeSignal;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use common::send;

/// How long the harness waits for an event before the test fails: far above any real delay.
const EVENT_BOUND: Duration = Duration::from_secs(10);

/// The upstream: counts its calls and holds each until the test releases it.
#[derive(Clone)]
struct Upstream {
    calls: Arc<AtomicUsize>,
    held: mpsc::UnboundedSender<oneshot::Sender<()>>,
}

async fn charge(State(up): State<Upstream>) -> impl IntoResponse {
    let n = up.calls.fetch_add(1, Ordering::SeqCst) + 1;
    let (release, released) = oneshot::channel();
    up.held.send(release).expect("the test is listening");
    let _ = released.await;
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        format!(r#"{{"charge":"ch_{n}"}}"#),
    )
}

/// The upstream, the events the test awaits, and a client.
struct Harness {
    upstream: SocketAddr,
    calls: Arc<AtomicUsize>,
    held: mpsc::UnboundedReceiver<oneshot::Sender<()>>,
    waiting_tx: mpsc::UnboundedSender<()>,
    waiting: mpsc::UnboundedReceiver<()>,
    client: reqwest::Client,
}

impl Harness {
    async fn new() -> Self {
        let (held_tx, held) = mpsc::unbounded_channel();
        let (waiting_tx, waiting) = mpsc::unbounded_channel();
        let calls = Arc::new(AtomicUsize::new(0));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = listener.local_addr().unwrap();
        let app = Router::new()
            .route("/charges", post(charge))
            .with_state(Upstream {
                calls: calls.clone(),
                held: held_tx,
            });
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self {
            upstream,
            calls,
            held,
            waiting_tx,
            waiting,
            client: reqwest::Client::new(),
        }
    }

    /// A gateway on `store` (watched) in front of the upstream; its URL.
    async fn gateway<St: Store>(
        &self,
        store: St,
        in_flight: InFlight,
        signal: OutcomeSignal,
    ) -> String {
        let mut config = common::config(self.upstream);
        config.in_flight = in_flight;
        config.outcome_signal = signal;
        // The layer listens for the outcome before it claims, so once a claim that found the
        // key in progress is reported, the duplicate is listening: an outcome stored from then
        // on must reach it through the signal, since it has already read the record.
        let mut store = WatchedStore::new(store);
        store.in_progress_claims = Some(self.waiting_tx.clone());
        common::serve(store, config).await
    }

    /// A gateway on `store` whose duplicates wait up to `wait`, woken by the store's signal.
    async fn waiting_gateway<St: OutcomeChannel>(&self, store: St, wait: Duration) -> String {
        let signal = idem_gateway::outcome_signal(&store)
            .await
            .expect("the store's listener starts");
        self.gateway(store, InFlight::Wait(wait), signal).await
    }

    fn post(&self, gateway: &str, key: &str) -> reqwest::RequestBuilder {
        common::json_post(
            &self.client,
            format!("{gateway}/charges"),
            "Bearer sk_alice",
            &[("idempotency-key", key)],
            r#"{"amount": 1000, "currency": "EUR"}"#,
        )
    }

    /// The release of the request the upstream holds next.
    async fn held(&mut self) -> oneshot::Sender<()> {
        tokio::time::timeout(EVENT_BOUND, self.held.recv())
            .await
            .expect("the request reaches the upstream")
            .unwrap()
    }

    /// Returns once a duplicate has found its key in progress (and so listens for it).
    async fn duplicate_waits(&mut self) {
        tokio::time::timeout(EVENT_BOUND, self.waiting.recv())
            .await
            .expect("the duplicate finds its key in progress")
            .unwrap();
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    async fn published_in_flight(&self, gateway: &str) -> String {
        let answer = send(
            self.client
                .get(format!("{gateway}/.well-known/idempotency-policy")),
        )
        .await;
        let policy: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
        policy["in_flight"].as_str().unwrap().to_owned()
    }

    /// Sends `tries` keys, each to `first` and, while the upstream holds it, again to
    /// `second`, and releases the upstream once the duplicate waits. Each duplicate gets the
    /// first one's answer, replayed, and the upstream is called once per key. Returns the time
    /// from each release to the duplicate's answer.
    async fn duplicates_wait_for_the_outcome(
        &mut self,
        first: &str,
        second: &str,
        tries: usize,
    ) -> Vec<Duration> {
        let mut latencies = Vec::with_capacity(tries);
        for i in 0..tries {
            let key = format!("wait-key-{i:04}");
            let original = tokio::spawn(send(self.post(first, &key)));
            let release = self.held().await;
            let duplicate = tokio::spawn(send(self.post(second, &key)));
            self.duplicate_waits().await;
            let released = Instant::now();
            release.send(()).unwrap();
            let duplicate = duplicate.await.unwrap();
            latencies.push(released.elapsed());
            let original = original.await.unwrap();
            assert_eq!(original.status, 201, "{}", original.body);
            assert!(!original.replayed());
            assert_eq!(duplicate.status, 201, "{}", duplicate.body);
            assert!(
                duplicate.replayed(),
                "the duplicate is the first one's replay"
            );
            assert_eq!(duplicate.body, original.body);
            assert_eq!(self.calls(), i + 1, "the upstream is called once per key");
        }
        latencies
    }
}

/// Prints the minimum, median and maximum of `latencies`.
fn report(store: &str, how: &str, mut latencies: Vec<Duration>) {
    latencies.sort();
    eprintln!(
        "{store}, {how}: wake-up latency over {} tries: min {:.2?}, median {:.2?}, max {:.2?}",
        latencies.len(),
        latencies[0],
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1],
    );
}

/// Where a test's records live; each gateway opens its own store on it, as a process would.
trait Backend {
    type Store: OutcomeChannel;
    const NAME: &'static str;
    async fn open(&self) -> Self::Store;
}

async fn a_duplicate_waits_and_is_replayed_the_outcome<B: Backend>(backend: B) {
    let mut h = Harness::new().await;
    let gateway = h
        .waiting_gateway(backend.open().await, Duration::from_secs(10))
        .await;
    let latencies = h
        .duplicates_wait_for_the_outcome(&gateway, &gateway, 20)
        .await;
    report(B::NAME, "one gateway", latencies);
    assert_eq!(
        h.published_in_flight(&gateway).await,
        "the duplicate waits up to 10s for the original's outcome, then replays it; past the wait 409 application/problem+json with Retry-After"
    );
}

/// Only the store's notification can wake the second gateway's duplicate: without it, it
/// would answer when its 30 s ran out.
async fn a_duplicate_on_another_gateway_is_woken_by_the_store<B: Backend>(backend: B) {
    let mut h = Harness::new().await;
    let wait = Duration::from_secs(30);
    let first = h.waiting_gateway(backend.open().await, wait).await;
    let second = h.waiting_gateway(backend.open().await, wait).await;
    let latencies = h.duplicates_wait_for_the_outcome(&first, &second, 20).await;
    let slowest = *latencies.iter().max().unwrap();
    report(B::NAME, "across two gateways", latencies);
    // A missed notification shows as the whole wait (then a 409); half of it is far above
    // any wake-up, however loaded the machine.
    assert!(
        slowest < wait / 2,
        "woken by the notification, not by the end of the wait ({slowest:?})"
    );
}

async fn with_409_a_duplicate_is_refused_at_once<B: Backend>(backend: B) {
    let mut h = Harness::new().await;
    let gateway = h
        .gateway(
            backend.open().await,
            InFlight::Refuse,
            OutcomeSignal::default(),
        )
        .await;
    let original = tokio::spawn(send(h.post(&gateway, "refuse-key-0001")));
    let release = h.held().await;
    // Answered while the upstream still holds the original.
    let duplicate = send(h.post(&gateway, "refuse-key-0001")).await;
    assert_eq!(duplicate.status, 409);
    assert!(duplicate.body.contains("urn:idem:problem:in-use"));
    assert!(duplicate.headers.get("retry-after").is_some());
    release.send(()).unwrap();
    assert_eq!(original.await.unwrap().status, 201);
    assert_eq!(h.calls(), 1);
    assert_eq!(
        h.published_in_flight(&gateway).await,
        "409 application/problem+json with Retry-After",
        "the policy's own words, as before waiting existed"
    );
}

async fn a_wait_that_runs_out_is_409_with_retry_after<B: Backend>(backend: B) {
    let mut h = Harness::new().await;
    let wait = Duration::from_secs(1);
    let gateway = h.waiting_gateway(backend.open().await, wait).await;
    let original = tokio::spawn(send(h.post(&gateway, "timeout-key-001")));
    let release = h.held().await;
    let sent = Instant::now();
    // The upstream holds the original until the duplicate has its answer.
    let duplicate = send(h.post(&gateway, "timeout-key-001")).await;
    assert!(sent.elapsed() >= wait, "it waited ({:?})", sent.elapsed());
    assert_eq!(duplicate.status, 409);
    assert!(duplicate.body.contains("urn:idem:problem:in-use"));
    assert!(duplicate.headers.get("retry-after").is_some());
    release.send(()).unwrap();
    let original = original.await.unwrap();
    assert_eq!(original.status, 201);
    let retry = send(h.post(&gateway, "timeout-key-001")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, original.body);
    assert_eq!(h.calls(), 1);
}

macro_rules! in_flight_tests {
    ($store:ident, $make:expr; $($name:ident),* $(,)?) => {
        mod $store {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name($make.await).await;
                }
            )*
        }
    };
}

/// One SQLite file, removed with its directory. One gateway only: a file is one process's.
struct Sqlite(tempfile::TempDir);

impl Backend for Sqlite {
    type Store = idem_store::SqliteStore;
    const NAME: &'static str = "SQLite";
    async fn open(&self) -> Self::Store {
        idem_store::SqliteStore::open(self.0.path().join("in-flight.db"))
            .await
            .unwrap()
    }
}

async fn sqlite() -> Sqlite {
    Sqlite(tempfile::tempdir().unwrap())
}

in_flight_tests!(sqlite, sqlite();
    a_duplicate_waits_and_is_replayed_the_outcome,
    with_409_a_duplicate_is_refused_at_once,
    a_wait_that_runs_out_is_409_with_retry_after,
);

/// A PostgreSQL database of the test's own, dropped after it.
struct Postgres(idem_testkit::postgres::PgTestDatabase);

impl Backend for Postgres {
    type Store = idem_store::PgStore;
    const NAME: &'static str = "PostgreSQL";
    async fn open(&self) -> Self::Store {
        idem_store::PgStore::connect(self.0.url()).await.unwrap()
    }
}

async fn postgres() -> Postgres {
    Postgres(idem_testkit::postgres::PgTestDatabase::create().await)
}

in_flight_tests!(postgres, postgres();
    a_duplicate_waits_and_is_replayed_the_outcome,
    a_duplicate_on_another_gateway_is_woken_by_the_store,
    with_409_a_duplicate_is_refused_at_once,
    a_wait_that_runs_out_is_409_with_retry_after,
);

/// A Redis key prefix of the test's own; dropping it deletes its keys.
struct Redis {
    url: String,
    prefix: common::RedisPrefix,
}

impl Backend for Redis {
    type Store = idem_store::RedisStore;
    const NAME: &'static str = "Redis";
    async fn open(&self) -> Self::Store {
        idem_store::RedisStore::connect(&self.url, self.prefix.0.clone())
            .await
            .unwrap()
    }
}

async fn redis() -> Redis {
    Redis {
        url: common::redis_url(),
        prefix: common::RedisPrefix(format!("idem-test-{}", uuid::Uuid::new_v4().simple())),
    }
}

in_flight_tests!(redis, redis();
    a_duplicate_waits_and_is_replayed_the_outcome,
    a_duplicate_on_another_gateway_is_woken_by_the_store,
    with_409_a_duplicate_is_refused_at_once,
    a_wait_that_runs_out_is_409_with_retry_after,
);
