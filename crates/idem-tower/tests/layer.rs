//! The layer around a scripted axum handler, over real TCP: in-flight duplicates, rollbacks,
//! leases, hang-ups, the storage cap and header rules.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing;
use idem_core::{
    AccountId, Clock, IdempotencyKey, KeyLimits, ManualClock, Policy, Record, Scope, Timestamp,
};
use idem_store::watched::WatchedStore;
use idem_store::{MemoryStore, OutcomeChannel, SqliteStore, SqliteTx};
use idem_tower::{Downstream, IdempotencyLayer, Outcome, Tx, Unidentified};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinHandle;

/// What the scripted handler does, read from its JSON body.
#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct Script {
    status: Option<u16>,
    gate: bool,
    body_len: usize,
    release: bool,
    panic: bool,
}

#[derive(Clone)]
struct Handler {
    calls: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    gate: Arc<Semaphore>,
}

impl Handler {
    fn new() -> Self {
        Self {
            calls: Arc::new(AtomicUsize::new(0)),
            entered: Arc::new(Notify::new()),
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    async fn run(&self, body: &Bytes) -> Response {
        let script: Script = serde_json::from_slice(body).unwrap_or_default();
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.entered.notify_one();
        if script.gate {
            self.gate.acquire().await.unwrap().forget();
        }
        assert!(!script.panic, "the scripted handler panics");
        let status = StatusCode::from_u16(script.status.unwrap_or(201)).unwrap();
        let mut response = (
            status,
            [
                ("content-type", "text/plain"),
                ("set-cookie", "session=secret"),
                ("x-trace", "kept-if-allowed"),
            ],
            "b".repeat(script.body_len.max(1)),
        )
            .into_response();
        if script.release {
            response.extensions_mut().insert(Outcome::Release);
        }
        response
    }
}

async fn tx_handler(State(h): State<Handler>, mut tx: Tx<SqliteTx>, body: Bytes) -> Response {
    sqlx::query("INSERT INTO effects (n) VALUES (1)")
        .execute(&mut **tx)
        .await
        .unwrap();
    h.run(&body).await
}

async fn lease_handler(State(h): State<Handler>, body: Bytes) -> Response {
    h.run(&body).await
}

struct App {
    url: String,
    handler: Handler,
    store: SqliteStore,
    clock: ManualClock,
    client: reqwest::Client,
    /// The reconciler's schedule ([`Kind::LeaseReconciled`]; unused by the others).
    schedule: idem_tower::Reconciliation,
    /// What wakes waiting duplicates ([`Kind::LeaseWaiting`]; unused by the others).
    signal: idem_tower::OutcomeSignal,
    _dir: tempfile::TempDir,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Transaction,
    /// Transaction mode without the read before the claim.
    TransactionClaimFirst,
    Lease,
    /// Lease mode without the read before the claim.
    LeaseClaimFirst,
    LeaseWithoutTakeover,
    /// Lease mode without takeover, a reconciler resolving unknown outcomes.
    LeaseReconciled,
    /// Lease mode, duplicates waiting up to this long for the outcome (woken by
    /// [`App::signal`]).
    LeaseWaiting(Duration),
}

/// The request body that holds the handler at its gate until the test lets it go.
const GATE: &str = r#"{"gate": true}"#;

/// A SQLite store in a temporary directory, with the `effects` table transaction mode's
/// handler writes to.
async fn sqlite_store() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("t.db")).await.unwrap();
    sqlx::query("CREATE TABLE effects (n INTEGER)")
        .execute(store.writer())
        .await
        .unwrap();
    (store, dir)
}

/// The account every test request acts for, unless a test says otherwise.
const ACCOUNT: &str = "acct_test";

/// The service's authentication, as an app puts it outside the layer: the `x-account` header
/// names the caller's account (a request without it has none).
async fn authenticate(
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(account) = request.headers().get("x-account") {
        let account = AccountId::new(account.to_str().unwrap());
        request.extensions_mut().insert(account);
    }
    next.run(request).await
}

/// Serves `router`, behind [`authenticate`] (added last, so it runs first), on a loopback
/// port; returns the URL of its `/work` route.
async fn serve(router: Router) -> String {
    let router = router.layer(axum::middleware::from_fn(authenticate));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/work", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

/// A JSON POST of `body` to `url`, under `key` if there is one.
fn post(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: &str,
) -> reqwest::RequestBuilder {
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .header("x-account", ACCOUNT)
        .body(body.to_owned());
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    req
}

async fn start(kind: Kind, adjust: impl FnOnce(&mut Policy)) -> App {
    let (store, dir) = sqlite_store().await;
    let clock = ManualClock::new(Timestamp(1_800_000_000_000));
    let mut policy = Policy::default();
    adjust(&mut policy);
    let handler = Handler::new();
    let schedule = idem_tower::Reconciliation::new(Duration::from_secs(60));
    let signal = idem_tower::OutcomeSignal::default();
    let router = match kind {
        Kind::Transaction | Kind::TransactionClaimFirst => {
            let mut layer = IdempotencyLayer::transactional(store.clone());
            if kind == Kind::TransactionClaimFirst {
                layer = layer.without_replay_read();
            }
            let layer = layer.with_policy(policy).with_clock(clock.clone());
            Router::new()
                .route("/work", routing::post(tx_handler))
                .layer(layer)
        }
        Kind::Lease
        | Kind::LeaseClaimFirst
        | Kind::LeaseWithoutTakeover
        | Kind::LeaseReconciled
        | Kind::LeaseWaiting(_) => {
            let mut layer = IdempotencyLayer::leased(store.clone());
            if kind == Kind::LeaseClaimFirst {
                layer = layer.without_replay_read();
            }
            if matches!(kind, Kind::LeaseWithoutTakeover | Kind::LeaseReconciled) {
                layer = layer.without_takeover();
            }
            if kind == Kind::LeaseReconciled {
                layer = layer.with_reconciliation(schedule.clone());
            }
            if let Kind::LeaseWaiting(max) = kind {
                layer = layer.with_outcome_signal(max, signal.clone());
            }
            let layer = layer.with_policy(policy).with_clock(clock.clone());
            Router::new()
                .route("/work", routing::post(lease_handler))
                .layer(layer)
        }
    }
    .with_state(handler.clone());
    let url = serve(router).await;
    App {
        url,
        handler,
        store,
        clock,
        client: reqwest::Client::new(),
        schedule,
        signal,
        _dir: dir,
    }
}

impl App {
    async fn send(&self, key: Option<&str>, body: &str) -> (u16, HeaderMap, Bytes) {
        let response = post(&self.client, &self.url, key, body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        (status, headers, response.bytes().await.unwrap())
    }

    /// Sends a request under `key` whose handler answers `status`.
    async fn answering(&self, key: &str, status: u16) -> (u16, HeaderMap, Bytes) {
        self.send(Some(key), &format!(r#"{{"status": {status}}}"#))
            .await
    }

    /// [`App::answering`], checking that the client got the handler's `status`; its headers.
    async fn answered(&self, key: &str, status: u16) -> HeaderMap {
        let (got, headers, body) = self.answering(key, status).await;
        assert_eq!(got, status, "{body:?}");
        headers
    }

    fn calls(&self) -> usize {
        self.handler.calls.load(Ordering::SeqCst)
    }

    async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(self.store.readers())
            .await
            .unwrap()
    }

    /// Sends `body` under `key` from a task of its own (a copy of the request).
    fn spawn_send(
        self: &Arc<Self>,
        key: &'static str,
        body: &'static str,
    ) -> JoinHandle<(u16, HeaderMap, Bytes)> {
        let app = self.clone();
        tokio::spawn(async move { app.send(Some(key), body).await })
    }

    /// Sends the gated request under `key` from a task, once its handler has been entered.
    async fn send_held(self: &Arc<Self>, key: &'static str) -> JoinHandle<(u16, HeaderMap, Bytes)> {
        let original = self.spawn_send(key, GATE);
        self.handler.entered.notified().await;
        original
    }

    /// A raw connection to the server, for what a client library would not send.
    async fn connect(&self) -> tokio::net::TcpStream {
        let addr = self
            .url
            .trim_start_matches("http://")
            .trim_end_matches("/work");
        tokio::net::TcpStream::connect(addr).await.unwrap()
    }

    /// The records whose lease has run out by the clock's now: what a reconciler looks at.
    async fn lease_expired(&self) -> Vec<Record> {
        use idem_store::{AdminStore, RecordFilter};
        let now = self.clock.now();
        self.store
            .list(
                &RecordFilter {
                    lease_expired_by: Some(now),
                    ..Default::default()
                },
                now,
            )
            .await
            .unwrap()
    }
}

/// The `type` of a problem-details body.
fn problem_type(body: &[u8]) -> serde_json::Value {
    let problem: serde_json::Value = serde_json::from_slice(body).unwrap();
    problem["type"].clone()
}

/// The scope the layer gives `key` on a test request ([`ACCOUNT`]'s).
fn test_scope(key: &[u8]) -> Scope {
    Scope::new(
        AccountId::new(ACCOUNT),
        IdempotencyKey::parse(key, KeyLimits::default()).unwrap(),
    )
}

fn replayed(headers: &HeaderMap) -> bool {
    headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// Without the read before the claim, every answer comes from the claim: the same replays,
/// refusals and single effect under concurrent copies, in both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_replay_read_the_claim_gives_the_same_answers() {
    for kind in [Kind::TransactionClaimFirst, Kind::LeaseClaimFirst] {
        let app = Arc::new(start(kind, |_| {}).await);
        let body = r#"{"n": 1}"#;
        let copies: Vec<_> = (0..16)
            .map(|_| app.spawn_send("claim-first-1", body))
            .collect();
        let mut created = Vec::new();
        for copy in copies {
            let (status, headers, bytes) = copy.await.unwrap();
            match status {
                201 => created.push((replayed(&headers), bytes)),
                409 => assert!(headers.contains_key("retry-after")),
                other => panic!("unexpected {other}: {bytes:?}"),
            }
        }
        assert_eq!(app.calls(), 1, "one effect for sixteen concurrent copies");
        if kind == Kind::TransactionClaimFirst {
            assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 1);
        }
        let originals = created.iter().filter(|(replayed, _)| !replayed).count();
        assert_eq!(originals, 1, "exactly one copy ran the handler");

        let (status, headers, bytes) = app.send(Some("claim-first-1"), body).await;
        assert_eq!(status, 201);
        assert!(replayed(&headers), "a later copy replays");
        assert_eq!(bytes, created[0].1, "byte for byte");
        let (status, _, _) = app.send(Some("claim-first-1"), r#"{"n": 2}"#).await;
        assert_eq!(status, 422, "a different request under the key is refused");
        assert_eq!(app.calls(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transaction_mode_duplicate_waits_for_the_original_then_replays() {
    let app = Arc::new(start(Kind::Transaction, |_| {}).await);
    let original = app.send_held("in-flight-key-1").await;
    let duplicate = app.spawn_send("in-flight-key-1", GATE);
    app.handler.gate.add_permits(1);
    let (s1, h1, b1) = original.await.unwrap();
    let (s2, h2, b2) = duplicate.await.unwrap();
    assert_eq!((s1, s2), (201, 201));
    assert!(!replayed(&h1));
    assert!(replayed(&h2));
    assert_eq!(b1, b2);
    assert_eq!(app.calls(), 1);
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transaction_mode_wait_is_bounded_then_409_with_retry_after() {
    let app = start(Kind::Transaction, |p| {
        p.in_flight_wait = Duration::from_millis(300)
    })
    .await;
    a_duplicate_is_in_use_until_the_original_ends(Arc::new(app), "bounded-key-001").await;
}

/// While the original runs, a duplicate is refused with `409 in-use` and `Retry-After: 1`;
/// once it has ended, the key replays and the handler ran once.
async fn a_duplicate_is_in_use_until_the_original_ends(app: Arc<App>, key: &'static str) {
    let original = app.send_held(key).await;
    let (status, headers, problem) = app.send(Some(key), GATE).await;
    assert_eq!(status, 409);
    assert_eq!(headers.get("retry-after").unwrap(), "1");
    assert_eq!(problem_type(&problem), "urn:idem:problem:in-use");
    app.handler.gate.add_permits(1);
    assert_eq!(original.await.unwrap().0, 201);
    let (status, headers, _) = app.send(Some(key), GATE).await;
    assert_eq!(status, 201);
    assert!(replayed(&headers));
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn transaction_mode_5xx_rolls_back_key_and_writes_so_a_retry_runs_fresh() {
    let app = start(Kind::Transaction, |_| {}).await;
    app.answered("rollback-key-01", 500).await;
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 0);
    assert_eq!(app.count("SELECT COUNT(*) FROM idempotency_keys").await, 0);
    // A retry is a fresh attempt (here it fails the same way, and runs again).
    app.answering("rollback-key-01", 500).await;
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn business_4xx_is_stored_but_a_validation_400_is_not() {
    let app = start(Kind::Transaction, |_| {}).await;
    app.answered("declined-key-01", 402).await;
    let headers = app.answered("declined-key-01", 402).await;
    assert!(replayed(&headers));
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 1);

    app.answering("invalid-key-001", 400).await;
    let (_, headers, _) = app.answering("invalid-key-001", 400).await;
    assert!(!replayed(&headers));
    assert_eq!(app.calls(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_mode_duplicate_gets_409_with_retry_after_while_the_original_runs() {
    let app = start(Kind::Lease, |_| {}).await;
    a_duplicate_is_in_use_until_the_original_ends(Arc::new(app), "lease-key-00001").await;
}

#[tokio::test]
async fn lease_mode_5xx_keeps_the_key_until_its_lease_runs_out() {
    let app = start(Kind::Lease, |_| {}).await;
    app.answered("unknown-key-001", 502).await;
    // The outcome is unknown: a retry within the lease is told to wait.
    let (status, headers, _) = app.answering("unknown-key-001", 502).await;
    assert_eq!(status, 409);
    assert!(headers.get("retry-after").is_some());
    assert_eq!(app.calls(), 1);
    // After the lease the same request takes the key over and runs again.
    app.clock.advance(Duration::from_secs(31));
    let (status, _, _) = app.answering("unknown-key-001", 201).await;
    assert_eq!(status, 422, "a different request may not take over");
    app.answered("unknown-key-001", 502).await;
    assert_eq!(app.calls(), 2);
}

/// A `kind` app whose work calls out with a 60 s timeout, after a request under `key` that
/// ended in a 502 (an unknown outcome); the 502's headers.
async fn after_an_unknown_outcome(kind: Kind, key: &str) -> (App, HeaderMap) {
    let app = start(kind, |p| p.downstream_timeout = Duration::from_secs(60)).await;
    let headers = app.answered(key, 502).await;
    (app, headers)
}

#[tokio::test]
async fn a_claim_is_held_through_the_downstream_timeout_before_a_takeover() {
    let (app, headers) = after_an_unknown_outcome(Kind::Lease, "held-key-00001").await;
    assert_eq!(
        headers["retry-after"], "90",
        "the lease and the downstream timeout"
    );
    // Past the lease, a call the work made may still be running: no takeover yet.
    app.clock.advance(Duration::from_secs(31));
    let (status, _, _) = app.answering("held-key-00001", 502).await;
    assert_eq!(status, 409);
    assert_eq!(app.calls(), 1);
    app.clock.advance(Duration::from_secs(60));
    let (status, _, _) = app.answering("held-key-00001", 502).await;
    assert_eq!(status, 502, "taken over once no call can still run");
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn with_a_reconciler_an_unknown_outcome_is_told_at_once_and_looked_at() {
    let (app, headers) = after_an_unknown_outcome(Kind::LeaseReconciled, "unknown-key-002").await;
    assert_eq!(
        headers["retry-after"], "1",
        "the reconciler was asked to look at once"
    );
    // The handler returned: the record's lease ended with it, though the clock stands still.
    let stale = app.lease_expired().await;
    assert_eq!(stale.len(), 1, "visible to the reconciler now");
    let (status, headers, problem) = app.answering("unknown-key-002", 502).await;
    assert_eq!(status, 409);
    assert_eq!(problem_type(&problem), "urn:idem:problem:outcome-unknown");
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(app.calls(), 1, "never run again");
    // Once that pass is over (it learnt nothing) and the reconciler waits for its next one,
    // clients are sent just past it.
    app.schedule.until_next_pass().await;
    let next = tokio::spawn({
        let schedule = app.schedule.clone();
        async move { schedule.until_next_pass().await }
    });
    // The reconciler is waiting once its next pass lies a period ahead.
    while app.schedule.retry_after() <= Duration::from_secs(1) {
        tokio::task::yield_now().await;
    }
    // The schedule counts down with the real clock (61 s at once, 60 s after 250 ms), so the
    // header lies between its answers before and after the request: a period away, not "1".
    let before = app.schedule.retry_after();
    let (_, headers, _) = app.answering("unknown-key-002", 502).await;
    let after = app.schedule.retry_after();
    let told: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    println!("retry-after {told} s, the schedule's {after:?}..={before:?}");
    assert!(
        (after.as_secs()..=before.as_secs()).contains(&told),
        "told {told} s, not the schedule's {after:?}..={before:?}"
    );
    next.abort();
}

#[tokio::test]
async fn lease_mode_release_lets_a_retry_run_fresh() {
    let app = start(Kind::Lease, |_| {}).await;
    let body = r#"{"status": 503, "release": true}"#;
    app.send(Some("release-key-001"), body).await;
    assert_eq!(app.count("SELECT COUNT(*) FROM idempotency_keys").await, 0);
    app.send(Some("release-key-001"), body).await;
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_hanging_up_does_not_cancel_the_work() {
    for kind in [Kind::Transaction, Kind::Lease] {
        let app = start(kind, |_| {}).await;
        let body = GATE;
        let mut socket = app.connect().await;
        let request = format!(
            "POST /work HTTP/1.1\r\nhost: x\r\nx-account: acct_test\r\nidempotency-key: hangup-key-0001\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(request.as_bytes()).await.unwrap();
        app.handler.entered.notified().await;
        drop(socket);
        app.handler.gate.add_permits(1);
        // The work goes on without its client and stores its outcome; cancelled work would
        // leave none (rolled back, or in progress), and the wait runs out.
        let scope = test_scope(b"hangup-key-0001");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let record = idem_store::Store::get(&app.store, &scope, app.clock.now())
                .await
                .unwrap();
            if record
                .as_ref()
                .is_some_and(|r| matches!(r.state, idem_core::RecordState::Completed(_)))
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no outcome stored after the hang-up: {record:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The retry finds the finished record and replays it.
        let answer = app.send(Some("hangup-key-0001"), body).await;
        assert_eq!(answer.0, 201, "{:?}", answer.2);
        assert!(replayed(&answer.1));
        assert_eq!(app.calls(), 1);
    }
}

/// A handler that panics gets its client a `500 handler-failed` (not a store outage: nothing
/// to retry at once, so no `Retry-After`), and takes neither the connection's other requests
/// nor the server down. Nothing is stored and the key is free, so the retry runs: in
/// transaction mode with nothing the handler wrote kept, in lease mode released as a takeover
/// would. Where a reconciler decides instead of takeovers, the handler may have called out
/// before it panicked, so the outcome is left to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_answered_500_and_its_key_is_free() {
    for kind in [Kind::Transaction, Kind::Lease, Kind::LeaseReconciled] {
        let app = start(kind, |_| {}).await;
        let (status, headers, body) = app.send(Some("panic-key-0001"), r#"{"panic": true}"#).await;
        assert_eq!(status, 500, "{}", String::from_utf8_lossy(&body));
        assert_eq!(problem_type(&body), "urn:idem:problem:handler-failed");
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            problem["status"], 500,
            "the body says what the status line says"
        );
        let (status, _, _) = app.send(Some("panic-key-0002"), "{}").await;
        assert_eq!(status, 201, "the server goes on");
        if kind == Kind::LeaseReconciled {
            let (status, _, body) = app.send(Some("panic-key-0001"), r#"{"panic": true}"#).await;
            assert!(headers.contains_key("retry-after"), "{kind:?}");
            assert_eq!(
                (status, problem_type(&body)),
                (409, "urn:idem:problem:outcome-unknown".into())
            );
            assert_eq!(app.calls(), 2, "the panicked work is not run again");
            continue;
        }
        assert!(!headers.contains_key("retry-after"), "{kind:?}");
        // Another body under the same key would be refused 422 had anything been stored.
        let (status, _, _) = app.send(Some("panic-key-0001"), "{}").await;
        assert_eq!(status, 201, "{kind:?}: the panicked request's key is free");
        assert_eq!(app.calls(), 3);
        if kind == Kind::Transaction {
            assert_eq!(
                app.count("SELECT COUNT(*) FROM effects").await,
                2,
                "the panicked handler's write was rolled back with its key"
            );
        }
    }
}

/// A covered request that reaches the layer with no account (its authentication did not run
/// first) is refused, not filed under a scope shared with every other such caller: nothing
/// runs and nothing is stored.
#[tokio::test]
async fn a_request_without_an_account_is_refused_and_nothing_runs() {
    for kind in [Kind::Transaction, Kind::Lease] {
        let app = start(kind, |_| {}).await;
        let request = app
            .client
            .post(&app.url)
            .header("content-type", "application/json")
            .header("idempotency-key", "checkout-3fa1b2")
            .body(r#"{"item":"sku-42"}"#);
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 500);
        let body = response.bytes().await.unwrap();
        assert_eq!(problem_type(&body), "urn:idem:problem:no-account");
        assert_eq!(app.calls(), 0);
        assert_eq!(app.count("SELECT COUNT(*) FROM idempotency_keys").await, 0);
    }
}

/// Two accounts that send the same key and body each get their own answer.
#[tokio::test]
async fn one_key_from_two_accounts_names_two_requests() {
    let app = start(Kind::Transaction, |_| {}).await;
    let mut answers = Vec::new();
    for account in ["acct_alice", "acct_bob", "acct_alice"] {
        let response = app
            .client
            .post(&app.url)
            .header("content-type", "application/json")
            .header("idempotency-key", "checkout-3fa1b2")
            .header("x-account", account)
            .body(r#"{"item":"sku-42"}"#)
            .send()
            .await
            .unwrap();
        answers.push((response.status().as_u16(), replayed(response.headers())));
    }
    assert_eq!(answers, [(201, false), (201, false), (201, true)]);
    assert_eq!(app.calls(), 2);
}

/// The opt-in shared scope does what its name says, and so shows its risk: the second
/// unidentified caller is replayed the first one's answer.
#[tokio::test]
async fn the_shared_anonymous_scope_is_an_opt_in_and_shares() {
    let (store, _dir) = sqlite_store().await;
    let handler = Handler::new();
    let router = Router::new()
        .route("/work", routing::post(tx_handler))
        .layer(IdempotencyLayer::transactional(store).with_shared_anonymous_scope())
        .with_state(handler.clone());
    let url = serve(router).await;
    let client = reqwest::Client::new();
    let mut replays = Vec::new();
    for _ in 0..2 {
        let response = client
            .post(&url)
            .header("content-type", "application/json")
            .header("idempotency-key", "checkout-3fa1b2")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        replays.push(replayed(response.headers()));
    }
    assert_eq!(replays, [false, true]);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1);
}

/// `with_account` can refuse: here a service scoped by its session cookie answers a request
/// without one `401 no-credential`, and runs nothing.
#[tokio::test]
async fn with_account_can_refuse_a_request_without_its_credential() {
    let (store, _dir) = sqlite_store().await;
    let handler = Handler::new();
    let layer = IdempotencyLayer::leased(store).with_account(|parts| {
        parts
            .headers
            .get("cookie")
            .and_then(|c| c.to_str().ok())
            .and_then(|c| c.strip_prefix("session="))
            .map(|session| AccountId::new(format!("session:{session}")))
            .ok_or_else(|| {
                Unidentified::NoCredential("log in first: send your session cookie".into())
            })
    });
    let router = Router::new()
        .route("/work", routing::post(lease_handler))
        .layer(layer)
        .with_state(handler.clone());
    let url = serve(router).await;
    let client = reqwest::Client::new();
    let send = |cookie: Option<&'static str>| {
        let mut request = client
            .post(&url)
            .header("idempotency-key", "checkout-3fa1b2")
            .body("{}");
        if let Some(cookie) = cookie {
            request = request.header("cookie", cookie);
        }
        request.send()
    };
    let refused = send(None).await.unwrap();
    assert_eq!(refused.status(), 401);
    let body = refused.bytes().await.unwrap();
    assert_eq!(problem_type(&body), "urn:idem:problem:no-credential");
    assert!(String::from_utf8_lossy(&body).contains("session cookie"));
    assert_eq!(handler.calls.load(Ordering::SeqCst), 0);
    let alice = send(Some("session=alice")).await.unwrap();
    let bob = send(Some("session=bob")).await.unwrap();
    assert_eq!(
        (alice.status(), bob.status()),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!replayed(bob.headers()), "bob's key is his own");
    assert_eq!(handler.calls.load(Ordering::SeqCst), 2);
}

/// A handler that asks for a transaction on a route the layer opened none for is told so by a
/// `500` whose body agrees with its status and names the type it asked for.
#[tokio::test]
async fn a_tx_asked_for_without_transaction_mode_is_a_500_naming_the_type() {
    let (store, _dir) = sqlite_store().await;
    let router = Router::new()
        .route("/work", routing::post(tx_handler))
        .layer(IdempotencyLayer::leased(store))
        .with_state(Handler::new());
    let url = serve(router).await;
    let response = post(&reqwest::Client::new(), &url, Some("no-tx-key-0001"), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 500);
    let problem: serde_json::Value = response.json().await.unwrap();
    assert_eq!(problem["type"], "urn:idem:problem:no-transaction");
    assert_eq!(problem["status"], 500);
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("SqliteTx"), "{detail}");
}

#[tokio::test]
async fn a_response_over_the_storage_cap_passes_whole_and_replays_without_body() {
    let app = start(Kind::Transaction, |p| p.storage_cap = 100).await;
    let body = r#"{"body_len": 1000}"#;
    let (status, _, first) = app.send(Some("big-reply-key-1"), body).await;
    assert_eq!((status, first.len()), (201, 1000));
    let (status, headers, again) = app.send(Some("big-reply-key-1"), body).await;
    assert_eq!(status, 201);
    assert!(replayed(&headers));
    assert_eq!(headers.get("idempotent-replay").unwrap(), "omitted");
    assert_eq!(headers.get("content-type").unwrap(), "text/plain");
    assert!(again.is_empty());
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn only_allow_listed_headers_are_stored_and_never_set_cookie() {
    let app = start(Kind::Transaction, |p| {
        p.stored_headers = vec!["x-trace".into(), "set-cookie".into()]
    })
    .await;
    let (_, first, _) = app.send(Some("headers-key-001"), "{}").await;
    assert_eq!(first.get("set-cookie").unwrap(), "session=secret");
    let (_, replay, _) = app.send(Some("headers-key-001"), "{}").await;
    assert!(replayed(&replay));
    assert_eq!(replay.get("x-trace").unwrap(), "kept-if-allowed");
    assert_eq!(replay.get("content-type").unwrap(), "text/plain");
    assert!(replay.get("set-cookie").is_none());
}

#[tokio::test]
async fn keyless_requests_pass_through_when_keys_are_optional() {
    let app = start(Kind::Lease, |p| p.require_key = false).await;
    app.send(None, "{}").await;
    app.send(None, "{}").await;
    assert_eq!(app.calls(), 2);
    assert_eq!(app.count("SELECT COUNT(*) FROM idempotency_keys").await, 0);
}

#[tokio::test]
async fn a_chunked_body_over_the_limit_is_413() {
    let app = start(Kind::Transaction, |p| p.body_limit = 1024).await;
    let mut socket = app.connect().await;
    let chunk = "x".repeat(600);
    let request = format!(
        "POST /work HTTP/1.1\r\nhost: x\r\nx-account: acct_test\r\nidempotency-key: chunked-key-001\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        chunk.len(),
        chunk.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut reply = vec![0; 4096];
    let n = socket.read(&mut reply).await.unwrap();
    let reply = String::from_utf8_lossy(&reply[..n]);
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert_eq!(app.calls(), 0);
    assert_eq!(app.count("SELECT COUNT(*) FROM idempotency_keys").await, 0);
}

#[tokio::test]
async fn a_body_that_trickles_in_gets_408_not_a_hung_connection() {
    let app = start(Kind::Transaction, |p| {
        p.body_timeout = Duration::from_millis(300)
    })
    .await;
    let mut socket = app.connect().await;
    // Declares 100 bytes, sends 10, then stalls.
    socket
        .write_all(b"POST /work HTTP/1.1\r\nhost: x\r\nx-account: acct_test\r\nidempotency-key: trickle-key-001\r\ncontent-type: text/plain\r\ncontent-length: 100\r\n\r\n0123456789")
        .await
        .unwrap();
    let mut reply = vec![0; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut reply))
        .await
        .expect("answered, not hung")
        .unwrap();
    let reply = String::from_utf8_lossy(&reply[..n]);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("urn:idem:problem:body-timeout"), "{reply}");
    assert_eq!(app.calls(), 0);
    assert_eq!(app.count("SELECT COUNT(*) FROM idempotency_keys").await, 0);
}

#[tokio::test]
async fn without_takeover_an_expired_lease_waits_for_reconciliation() {
    use idem_store::AdminStore;
    let app = start(Kind::LeaseWithoutTakeover, |_| {}).await;
    app.answered("reconcile-key-1", 504).await;
    app.clock.advance(Duration::from_secs(31));
    let (status, headers, problem) = app.answering("reconcile-key-1", 504).await;
    assert_eq!(status, 409);
    assert!(headers.get("retry-after").is_some());
    assert_eq!(problem_type(&problem), "urn:idem:problem:outcome-unknown");
    assert_eq!(app.calls(), 1, "the work is not run again");

    // A reconciler learns the outcome and completes the record; the retry replays it.
    let stale = app.lease_expired().await;
    assert_eq!(stale.len(), 1);
    let outcome = idem_core::StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: b"reconciled".to_vec(),
        body_omitted: false,
    };
    assert!(
        app.store
            .force_complete(&stale[0].scope, &outcome, app.clock.now())
            .await
            .unwrap()
    );
    let (status, headers, body) = app.answering("reconcile-key-1", 504).await;
    assert_eq!(status, 201);
    assert!(replayed(&headers));
    assert_eq!(&body[..], b"reconciled");
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_an_outcome_wait_a_duplicate_waits_and_replays_instead_of_409() {
    let app = Arc::new(start(Kind::LeaseWaiting(Duration::from_secs(10)), |_| {}).await);
    let original = app.send_held("waiting-key-001").await;
    let duplicate = app.spawn_send("waiting-key-001", GATE);
    // Release the original only once the duplicate is parked on the signal (it would have had
    // its 409 long before without the wait).
    let parked = tokio::time::Instant::now() + Duration::from_secs(5);
    while app.signal.waiting() == 0 {
        assert!(
            tokio::time::Instant::now() < parked,
            "the duplicate never waited"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    app.handler.gate.add_permits(1);
    let (original, _, _) = original.await.unwrap();
    let (duplicate, headers, _) = duplicate.await.unwrap();
    assert_eq!(app.signal.waiting(), 0, "no entry is left behind");
    assert_eq!((original, duplicate), (201, 201));
    assert!(replayed(&headers));
    assert_eq!(app.calls(), 1);
}

/// Past its wait a duplicate gets the `409` it would have had at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outcome_wait_is_bounded_then_409() {
    let app = start(Kind::LeaseWaiting(Duration::from_millis(200)), |_| {}).await;
    a_duplicate_is_in_use_until_the_original_ends(Arc::new(app), "bounded-wait-01").await;
}

#[tokio::test]
async fn an_outcome_the_store_missed_is_stored_on_a_later_try_and_replays() {
    let (inner, _dir) = sqlite_store().await;
    let store = WatchedStore::new(inner);
    store.failing_completes.store(1, Ordering::SeqCst);
    let handler = Handler::new();
    let signal = idem_tower::OutcomeSignal::default();
    let router = Router::new()
        .route("/work", routing::post(lease_handler))
        .layer(
            IdempotencyLayer::leased(store.clone())
                .with_outcome_signal(Duration::from_secs(5), signal.clone()),
        )
        .with_state(handler.clone());
    let url = serve(router).await;
    let key = "late-store-key1";
    let scope = test_scope(key.as_bytes());
    let send = || {
        post(
            &reqwest::Client::new(),
            &url,
            Some(key),
            r#"{"status": 201}"#,
        )
        .send()
    };
    // Listen before the request, so the later store's wake-up cannot be missed.
    let stored_later = signal.listen(&scope.log_label());
    let first = send().await.unwrap();
    assert_eq!(
        first.status(),
        201,
        "the work happened: the client is told so"
    );
    let first_body = first.bytes().await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), stored_later)
        .await
        .expect("the outcome was stored on a later try");
    assert!(matches!(
        idem_store::Store::get(&store.inner, &scope, Clock::now(&idem_core::SystemClock))
            .await
            .unwrap()
            .unwrap()
            .state,
        idem_core::RecordState::Completed(_)
    ));
    let replay = send().await.unwrap();
    assert!(replayed(replay.headers()));
    assert_eq!(replay.bytes().await.unwrap(), first_body);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1, "never run again");
}

/// On TokioPgStore, whose lost claim writes nothing and answers with the record, the layer
/// claims first: a first request and its replay read nothing outside the claim. With
/// `with_replay_read` each reads first, and the answers are the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_tokio_postgres_the_layer_claims_first_unless_told_to_read() {
    let db = idem_testkit::postgres::PgTestDatabase::create().await;
    let inner = idem_store::TokioPgStore::connect(db.url()).await.unwrap();
    for (read_first, key, reads) in [(false, "claims-first-1", 0), (true, "reads-first-1", 2)] {
        let store = WatchedStore::new(inner.clone());
        let mut layer = IdempotencyLayer::transactional(store.clone());
        if read_first {
            layer = layer.with_replay_read();
        }
        let router = Router::new()
            .route("/work", routing::post(tokio_pg_handler))
            .layer(layer)
            .with_state(Handler::new());
        let url = serve(router).await;
        let client = reqwest::Client::new();
        let mut answers = Vec::new();
        for _ in 0..2 {
            let response = post(&client, &url, Some(key), "{}").send().await.unwrap();
            assert_eq!(response.status(), 201);
            let replay = replayed(response.headers());
            answers.push((replay, response.bytes().await.unwrap()));
        }
        assert!(!answers[0].0 && answers[1].0, "the second copy replays");
        assert_eq!(answers[0].1, answers[1].1);
        assert_eq!(
            store.reads.load(Ordering::SeqCst),
            reads,
            "read first: {read_first}"
        );
    }
}

async fn tokio_pg_handler(
    State(h): State<Handler>,
    tx: Tx<idem_store::TokioPgTx>,
    body: Bytes,
) -> Response {
    tx.execute("SELECT 1", &[]).await.unwrap();
    h.run(&body).await
}

#[tokio::test]
async fn without_the_replay_read_nothing_is_read_before_the_claim() {
    // (replay read asked for, the store's claims answer like reads)
    for (replay_read, claims_like_reads) in [(true, false), (false, false), (true, true)] {
        let (inner, _dir) = sqlite_store().await;
        let mut store = WatchedStore::new(inner);
        store.claims_like_reads = Some(claims_like_reads);
        let mut layer = IdempotencyLayer::transactional(store.clone());
        if !replay_read {
            layer = layer.without_replay_read();
        }
        let router = Router::new()
            .route("/work", routing::post(tx_handler))
            .layer(layer)
            .with_state(Handler::new());
        let url = serve(router).await;
        let client = reqwest::Client::new();
        let mut answers = Vec::new();
        for _ in 0..2 {
            let response = post(&client, &url, Some("replay-reads-1"), "{}")
                .send()
                .await
                .unwrap();
            let (status, replay) = (response.status(), replayed(response.headers()));
            let bytes = response.bytes().await.unwrap();
            assert_eq!(status, 201, "{bytes:?}");
            answers.push((replay, bytes));
        }
        assert!(!answers[0].0 && answers[1].0, "the second copy replays");
        assert_eq!(answers[0].1, answers[1].1);
        let expected = if replay_read && !claims_like_reads {
            2
        } else {
            0
        };
        assert_eq!(store.reads.load(Ordering::SeqCst), expected);
    }
}

/// An outcome nobody knows never expires into a fresh claim (docs/contract.md §12): past its
/// lease and its retention, the retry of a request whose outcome is unknown is still told
/// `409 outcome-unknown`, and a different request under its key `422`; the work never runs
/// again. Resolved at last, the record is kept for a whole retention from the resolution.
#[tokio::test]
async fn an_unknown_outcome_is_409_after_its_retention() {
    use idem_store::AdminStore;
    let retention = Duration::from_secs(3600);
    let app = start(Kind::LeaseWithoutTakeover, |p| p.retention = retention).await;
    app.answered("unknown-key-old", 504).await;
    app.clock.advance(retention * 2);
    let (status, headers, problem) = app.answering("unknown-key-old", 504).await;
    assert_eq!(status, 409);
    assert!(headers.get("retry-after").is_some());
    assert_eq!(problem_type(&problem), "urn:idem:problem:outcome-unknown");
    let (status, _, problem) = app.answering("unknown-key-old", 201).await;
    assert_eq!(status, 422, "a different request may not claim it afresh");
    assert_eq!(problem_type(&problem), "urn:idem:problem:mismatch");
    assert_eq!(app.calls(), 1, "never run again");
    // The sweeper leaves it too.
    let swept = idem_store::sweep_all(&app.store, app.clock.now(), 100)
        .await
        .unwrap();
    assert_eq!(swept, 0);

    // Resolved two retentions after its claim, it replays for a retention from then.
    let stale = app.lease_expired().await;
    assert_eq!(stale.len(), 1);
    let outcome = idem_core::StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: b"reconciled".to_vec(),
        body_omitted: false,
    };
    assert!(
        app.store
            .force_complete(&stale[0].scope, &outcome, app.clock.now())
            .await
            .unwrap()
    );
    app.clock.advance(retention - Duration::from_secs(1));
    let (status, headers, body) = app.answering("unknown-key-old", 504).await;
    assert_eq!((status, &body[..]), (201, &b"reconciled"[..]));
    assert!(replayed(&headers));
    app.clock.advance(Duration::from_secs(1));
    app.answered("unknown-key-old", 201).await;
    assert_eq!(
        app.calls(),
        2,
        "a new request, once the retention from the resolution ended"
    );
}

/// With takeover, the same request takes an unknown outcome over once its lease has run out
/// (the work passes the key downstream, which dedupes), but past its retention a different
/// request under the key is still refused: the key is not new.
#[tokio::test]
async fn past_its_retention_an_unknown_outcome_is_still_no_new_key() {
    let retention = Duration::from_secs(3600);
    let app = start(Kind::Lease, |p| p.retention = retention).await;
    app.answered("unknown-key-new", 502).await;
    app.clock.advance(retention * 2);
    let (status, _, problem) = app.answering("unknown-key-new", 201).await;
    assert_eq!(status, 422, "claimed afresh: {problem:?}");
    assert_eq!(app.calls(), 1);
    app.answered("unknown-key-new", 502).await;
    assert_eq!(app.calls(), 2, "taken over by the same request");
}

/// Housekeeping comes with the layer (docs/contract.md §12): with no code of the app's, a
/// layer sweeps the records past their retention, from its first request on, once for all the
/// routes it was cloned onto; `without_sweeper` leaves them. Two apps side by side on stores of
/// their own: once the sweeping one has deleted its record and swept a few times more, the
/// other has had as long, and has swept nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_sweeps_expired_records_unless_told_not_to() {
    let clock = ManualClock::new(Timestamp(1_800_000_000_000));
    let policy = Policy {
        retention: Duration::from_secs(3600),
        ..Policy::default()
    };
    let (sweeping_store, _sweeping_dir) = sqlite_store().await;
    let (idle_store, _idle_dir) = sqlite_store().await;
    let (sweeping_store, idle_store) = (
        WatchedStore::new(sweeping_store),
        WatchedStore::new(idle_store),
    );
    let app = |layer| {
        let made = || async { (StatusCode::CREATED, "made") };
        Router::new()
            .route("/work", routing::post(made))
            .route("/other", routing::post(made))
            .layer(layer)
    };
    let sweeping = serve(app(IdempotencyLayer::leased(sweeping_store.clone())
        .with_policy(policy.clone())
        .with_clock(clock.clone())
        .with_sweep_every(Duration::from_millis(50))))
    .await;
    let idle = serve(app(IdempotencyLayer::leased(idle_store.clone())
        .with_policy(policy)
        .with_clock(clock.clone())
        .without_sweeper()))
    .await;
    let client = reqwest::Client::new();
    for url in [&sweeping, &idle] {
        let made = post(&client, url, Some("swept-key-0001"), "{}")
            .send()
            .await
            .unwrap();
        assert_eq!(made.status(), 201);
    }
    let scope = test_scope(b"swept-key-0001");
    let record = |store: &WatchedStore<SqliteStore>| {
        let (store, scope, now) = (store.inner.clone(), scope.clone(), clock.now());
        async move { idem_store::Store::get(&store, &scope, now).await.unwrap() }
    };
    assert!(record(&sweeping_store).await.is_some());

    clock.advance(Duration::from_secs(2 * 3600));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while record(&sweeping_store).await.is_some() {
        assert!(tokio::time::Instant::now() < deadline, "never swept");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sweeps = sweeping_store.sweeps.load(Ordering::SeqCst);
    while sweeping_store.sweeps.load(Ordering::SeqCst) < sweeps + 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sweeper stopped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(idle_store.sweeps.load(Ordering::SeqCst), 0);
    assert!(
        record(&idle_store).await.is_some(),
        "swept without a sweeper"
    );
}

/// A lease-mode router over `store` whose duplicates wait up to 10 s, wired in one call
/// ([`IdempotencyLayer::with_outcome_wait`]); served on its own port.
async fn serve_waiting<St: OutcomeChannel>(store: St, handler: &Handler) -> String {
    let router = Router::new()
        .route("/work", routing::post(lease_handler))
        .layer(IdempotencyLayer::leased(store).with_outcome_wait(Duration::from_secs(10)))
        .with_state(handler.clone());
    serve(router).await
}

/// Sends `body` under `key` to `url` from a task; its status, whether it replayed, its body.
fn spawn_post(url: &str, key: &'static str, body: &'static str) -> JoinHandle<(u16, bool, Bytes)> {
    let url = url.to_owned();
    tokio::spawn(async move {
        let response = post(&reqwest::Client::new(), &url, Some(key), body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let replay = replayed(response.headers());
        (status, replay, response.bytes().await.unwrap())
    })
}

/// The original goes to `original_url` and is held in its handler; a duplicate goes to
/// `duplicate_url` once it is; the original is let go once the duplicate's claim has found it
/// in progress (so the duplicate waits: it listens before it claims). The duplicate must get
/// the original's answer as a replay, not `409`, and the work must run once.
async fn a_duplicate_waits_and_replays(
    told: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
    handler: &Handler,
    original_url: &str,
    duplicate_url: &str,
    key: &'static str,
) {
    let original = spawn_post(original_url, key, GATE);
    handler.entered.notified().await;
    let duplicate = spawn_post(duplicate_url, key, GATE);
    tokio::time::timeout(Duration::from_secs(10), told.recv())
        .await
        .expect("the duplicate's claim within 10 s")
        .expect("the store is alive");
    handler.gate.add_permits(1);
    let (status, replay, body) = original.await.unwrap();
    assert_eq!((status, replay), (201, false));
    let (dup_status, dup_replay, dup_body) = duplicate.await.unwrap();
    assert_eq!(
        (dup_status, dup_replay),
        (201, true),
        "the duplicate waited and replayed: {dup_body:?}"
    );
    assert_eq!(dup_body, body);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1);
}

/// `store`, watched: each claim that finds its key in progress is told on the receiver.
fn told_of_busy_claims<St: idem_store::Store>(
    inner: St,
) -> (WatchedStore<St>, tokio::sync::mpsc::UnboundedReceiver<()>) {
    let (tell, told) = tokio::sync::mpsc::unbounded_channel();
    let mut store = WatchedStore::new(inner);
    store.in_progress_claims = Some(tell);
    (store, told)
}

/// The one-call outcome wait, with nothing wired by hand: a duplicate sent over TCP while the
/// original is in flight waits and replays, on MemoryStore and on SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_one_call_outcome_wait_replays_a_duplicate_on_memory_and_sqlite() {
    let (store, mut told) = told_of_busy_claims(MemoryStore::new());
    let handler = Handler::new();
    let url = serve_waiting(store, &handler).await;
    a_duplicate_waits_and_replays(&mut told, &handler, &url, &url, "one-call-mem-1").await;

    let (sqlite, _dir) = sqlite_store().await;
    let (store, mut told) = told_of_busy_claims(sqlite);
    let handler = Handler::new();
    let url = serve_waiting(store, &handler).await;
    a_duplicate_waits_and_replays(&mut told, &handler, &url, &url, "one-call-sql-1").await;
}

/// Two layers on one MemoryStore stand for two processes on one shared store: the duplicate's
/// layer hears of the original's outcome only through the store's notification, which the
/// one-call outcome wait listens to from its first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_one_call_outcome_wait_hears_another_layer_through_the_store() {
    let (store, mut told) = told_of_busy_claims(MemoryStore::new());
    let handler = Handler::new();
    let first = serve_waiting(store.clone(), &handler).await;
    let second = serve_waiting(store, &handler).await;
    a_duplicate_waits_and_replays(&mut told, &handler, &first, &second, "two-layers-01").await;
}

/// A store whose listener cannot start costs the request a `503 store-unavailable`, at once,
/// never a hang or a panic; the next request starts it and runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_listener_that_cannot_start_is_a_store_outage_then_retried() {
    let store = WatchedStore::new(MemoryStore::new());
    store.failing_listens.store(1, Ordering::SeqCst);
    let handler = Handler::new();
    let url = serve_waiting(store.clone(), &handler).await;
    let (status, _, body) = spawn_post(&url, "no-listener-1", r#"{"status": 201}"#)
        .await
        .unwrap();
    assert_eq!(status, 503, "{body:?}");
    assert!(
        std::str::from_utf8(&body)
            .unwrap()
            .contains("urn:idem:problem:store-unavailable")
    );
    assert_eq!(handler.calls.load(Ordering::SeqCst), 0, "nothing ran");
    let (status, replay, _) = spawn_post(&url, "no-listener-1", r#"{"status": 201}"#)
        .await
        .unwrap();
    assert_eq!((status, replay), (201, false));
    assert_eq!(store.failing_listens.load(Ordering::SeqCst), 0);
}

async fn downstream_handler(Downstream(key): Downstream) -> String {
    key.to_string()
}

/// A lease-mode handler takes the request's downstream key in one line (`Downstream`): the
/// same key for the request's replay, derived from its scope and fingerprint. Outside lease
/// mode, or with `without_downstream_key`, the extractor refuses with `500 no-downstream-key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_extracts_the_downstream_key_in_lease_mode_only() {
    let leased = Router::new()
        .route("/work", routing::post(downstream_handler))
        .layer(IdempotencyLayer::leased(MemoryStore::new()));
    let url = serve(leased).await;
    let body = r#"{"amount": 100}"#;
    let (status, replay, first) = spawn_post(&url, "downstream-01", body).await.unwrap();
    assert_eq!((status, replay), (200, false));
    let fingerprint = idem_core::Fingerprint::compute(&idem_core::RequestParts {
        account: ACCOUNT,
        method: "POST",
        route: "/work",
        query: "",
        content_type: "application/json",
        body: body.as_bytes(),
    })
    .unwrap();
    let expected = idem_core::DownstreamKey::new(&test_scope(b"downstream-01"), &fingerprint);
    assert_eq!(first, expected.as_str());
    let (_, replay, again) = spawn_post(&url, "downstream-01", body).await.unwrap();
    assert!(replay);
    assert_eq!(again, first);

    let (store, _dir) = sqlite_store().await;
    let transactional = Router::new()
        .route("/work", routing::post(downstream_handler))
        .layer(IdempotencyLayer::transactional(store));
    let url = serve(transactional).await;
    let (status, _, refused) = spawn_post(&url, "downstream-02", body).await.unwrap();
    assert_eq!(status, 500);
    let problem: serde_json::Value = serde_json::from_slice(&refused).unwrap();
    assert_eq!(problem["type"], "urn:idem:problem:no-downstream-key");

    // A lease-mode layer told to leave it out (a proxy forwarding a key of its own).
    let (store, _dir) = sqlite_store().await;
    let without = Router::new()
        .route("/work", routing::post(downstream_handler))
        .layer(IdempotencyLayer::leased(store).without_downstream_key());
    let url = serve(without).await;
    let (status, _, refused) = spawn_post(&url, "downstream-03", body).await.unwrap();
    assert_eq!(status, 500);
    let problem: serde_json::Value = serde_json::from_slice(&refused).unwrap();
    assert_eq!(problem["type"], "urn:idem:problem:no-downstream-key");
}

/// The thread a handler runs on, as its body.
async fn thread_name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .to_owned()
}

/// On SQLite, transaction mode runs the work from the claim to the commit on the writer's own
/// thread (what the guide's "Transaction mode" says a handler can rely on); lease mode runs it
/// where the request runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_transaction_mode_handler_runs_on_the_writer_s_thread() {
    let (store, _dir) = sqlite_store().await;
    let routes = Router::new().route("/work", routing::post(thread_name));
    let transactional = serve(
        routes
            .clone()
            .layer(IdempotencyLayer::transactional(store.clone())),
    )
    .await;
    let (status, replay, body) = spawn_post(&transactional, "thread-01", "{}").await.unwrap();
    assert_eq!((status, replay), (200, false));
    assert_eq!(body, "idem-sqlite-w");
    // The replay comes from the stored response, whichever thread answers it.
    let (_, replay, again) = spawn_post(&transactional, "thread-01", "{}").await.unwrap();
    assert!(replay);
    assert_eq!(again, body);

    let leased = serve(routes.layer(IdempotencyLayer::leased(store))).await;
    let (status, _, body) = spawn_post(&leased, "thread-02", "{}").await.unwrap();
    assert_eq!(status, 200);
    assert_ne!(body, "idem-sqlite-w");
}
