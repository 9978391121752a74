//! The middleware on a real actix-web server on a loopback port, over real HTTP: replays,
//! concurrent duplicates, rollbacks, refusals, and lease mode's downstream key.

use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use std::convert::Infallible;

use actix_web::body::{BodyStream, MessageBody, SizedStream};
use actix_web::dev::{ServerHandle, ServiceRequest, ServiceResponse};
use actix_web::middleware::{Next, from_fn};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, HttpServer, web};
use idem_actix::{
    IdempotencyLayer, Idempotent, LeaseMode, Outcome, OutcomeSignal, TransactionMode, Tx,
};
use idem_core::{
    AccountId, Clock, DownstreamKey, IdempotencyKey, KeyLimits, Policy, Scope, SystemClock,
};
use idem_store::{PgStore, PgTx, SqliteStore, SqliteTx, Store};
use idem_testkit::postgres::PgTestDatabase;
use reqwest::header::HeaderMap;
use tokio::sync::{Notify, Semaphore};

/// The account every test request acts for, unless a test says otherwise.
const ACCOUNT: &str = "acct_actix";

/// What the handlers share with the test: how often they ran, a signal that one was entered,
/// and a gate that holds a request marked `x-gate` until the test opens it.
#[derive(Clone)]
struct Probe {
    calls: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    gate: Arc<Semaphore>,
}

impl Probe {
    fn new() -> Self {
        Self {
            calls: Arc::default(),
            entered: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    /// The handler's work, steered by the request's headers (which are not part of its
    /// fingerprint): `x-gate` waits for the test, `x-fail` answers 500, `x-panic` panics.
    async fn run(&self, request: &HttpRequest, said: &str) -> HttpResponse {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        self.entered.notify_one();
        let marked = |name: &str| request.headers().contains_key(name);
        if marked("x-gate") {
            self.gate.acquire().await.unwrap().forget();
        }
        assert!(!marked("x-panic"), "the handler panics, as asked");
        if marked("x-fail") {
            return HttpResponse::InternalServerError().body("failed");
        }
        let len = request.headers().get("x-len").and_then(|v| v.to_str().ok());
        let body = match len.and_then(|v| v.parse().ok()) {
            Some(len) => "b".repeat(len),
            None => format!("call {n}: {said}"),
        };
        let mut response = HttpResponse::Created();
        response
            .insert_header(("location", format!("/work/{n}")))
            .content_type("text/plain");
        // `x-stream: sized` or `unsized`: the body comes as a stream of ten chunks, with its
        // length declared or not.
        let chunks = body.as_bytes().chunks(body.len().div_ceil(10).max(1));
        let chunks: Vec<_> = chunks.map(web::Bytes::copy_from_slice).collect();
        let stream = futures_util::stream::iter(chunks.into_iter().map(Ok::<_, Infallible>));
        let mut response = match request.headers().get("x-stream").map(|v| v.as_bytes()) {
            Some(b"sized") => response.body(SizedStream::new(body.len() as u64, stream)),
            Some(_) => response.body(BodyStream::new(stream)),
            None => response.body(body),
        };
        if marked("x-release") {
            response.extensions_mut().insert(Outcome::Release);
        }
        response
    }
}

async fn tx_handler(
    probe: web::Data<Probe>,
    request: HttpRequest,
    mut tx: Tx<SqliteTx>,
    scope: web::ReqData<Scope>,
    body: web::Bytes,
) -> HttpResponse {
    // The scope the layer filed the request under crossed over too.
    let key = request.headers().get("idempotency-key").unwrap();
    assert_eq!(scope.key.as_str().as_bytes(), key.as_bytes());
    assert_eq!(scope.account, AccountId::new(ACCOUNT));
    sqlx::query("INSERT INTO effects (n) VALUES (1)")
        .execute(&mut **tx)
        .await
        .unwrap();
    probe.run(&request, &String::from_utf8_lossy(&body)).await
}

/// Says whether the layer opened a transaction for the request.
async fn maybe_tx_handler(tx: Option<Tx<SqliteTx>>) -> &'static str {
    if tx.is_some() { "opened" } else { "none" }
}

/// Lease mode's handler answers with the downstream key it would pass on, or the body it read
/// when it has none (a keyless request let through).
async fn lease_handler(
    probe: web::Data<Probe>,
    request: HttpRequest,
    key: Option<web::ReqData<DownstreamKey>>,
    body: web::Bytes,
) -> HttpResponse {
    match key {
        Some(key) => probe.run(&request, key.as_str()).await,
        None => probe.run(&request, &String::from_utf8_lossy(&body)).await,
    }
}

/// The service's authentication, as an app puts it outside the middleware: `x-account` names
/// the caller's account (a request without it has none).
async fn authenticate(
    request: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let account = request
        .headers()
        .get("x-account")
        .and_then(|v| v.to_str().ok())
        .map(AccountId::new);
    if let Some(account) = account {
        request.extensions_mut().insert(account);
    }
    next.call(request).await
}

async fn pg_tx_handler(
    probe: web::Data<Probe>,
    request: HttpRequest,
    mut tx: Tx<PgTx>,
    body: web::Bytes,
) -> HttpResponse {
    sqlx::query("INSERT INTO effects (n) VALUES (1)")
        .execute(&mut **tx)
        .await
        .unwrap();
    probe.run(&request, &String::from_utf8_lossy(&body)).await
}

#[derive(Clone)]
enum Layer {
    Transaction(IdempotencyLayer<TransactionMode<SqliteStore>>),
    Lease(Leased),
    PgTransaction(IdempotencyLayer<TransactionMode<PgStore>>),
}

/// A server under test, over a store of type `St`.
struct App<St = SqliteStore> {
    url: String,
    probe: Probe,
    store: St,
    client: reqwest::Client,
    server: ServerHandle,
    /// The store's temporary directory or database, removed when the test ends.
    _place: Box<dyn std::any::Any + Send + Sync>,
}

/// How a test counts the rows its store holds.
trait Rows {
    async fn count(&self, sql: &'static str) -> i64;
}

impl Rows for SqliteStore {
    async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(self.readers())
            .await
            .unwrap()
    }
}

impl Rows for PgStore {
    async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(self.pool())
            .await
            .unwrap()
    }
}

impl<St> Drop for App<St> {
    fn drop(&mut self) {
        // Stops the workers; the future it returns need not be awaited for that.
        drop(self.server.stop(false));
    }
}

/// Serves `/work` behind the middleware in transaction or lease mode (as `lease` says), over a
/// SQLite store in a temporary directory, on two workers. In transaction mode `/optional`'s
/// handler takes the transaction if there is one; in lease mode `/wrong` is a route wired
/// wrong: its handler asks for a transaction.
async fn start(lease: bool) -> App {
    start_with(lease, |_| {}).await
}

/// A SQLite store in a temporary directory, with the `effects` table the handlers write to.
async fn sqlite_store() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("t.db")).await.unwrap();
    sqlx::query("CREATE TABLE effects (n INTEGER)")
        .execute(store.writer())
        .await
        .unwrap();
    (store, dir)
}

/// [`start`] with the policy `adjust` makes.
async fn start_with(lease: bool, adjust: impl FnOnce(&mut Policy)) -> App {
    let (store, dir) = sqlite_store().await;
    let mut policy = Policy::default();
    adjust(&mut policy);
    let layer = if lease {
        Layer::Lease(IdempotencyLayer::leased(store.clone()).with_policy(policy))
    } else {
        Layer::Transaction(IdempotencyLayer::transactional(store.clone()).with_policy(policy))
    };
    serve(layer, store, Box::new(dir))
}

/// Serves `/work` in lease mode, with the layer `adjust` makes.
async fn start_leased(adjust: impl FnOnce(Leased) -> Leased) -> App {
    let (store, dir) = sqlite_store().await;
    let layer = Layer::Lease(adjust(IdempotencyLayer::leased(store.clone())));
    serve(layer, store, Box::new(dir))
}

type Leased = IdempotencyLayer<LeaseMode<SqliteStore>>;

/// Serves `/work` in transaction mode over `PgStore`, in a database of the test's own.
async fn start_pg() -> App<PgStore> {
    let db = PgTestDatabase::create().await;
    let store = PgStore::from_pool(db.pool(10).await)
        .await
        .expect("migrate the test database");
    sqlx::query("CREATE TABLE effects (n INTEGER)")
        .execute(store.pool())
        .await
        .unwrap();
    let layer = Layer::PgTransaction(IdempotencyLayer::transactional(store.clone()));
    serve(layer, store, Box::new(db))
}

/// Serves the routes of `layer` on a loopback port, behind [`authenticate`].
fn serve<St>(layer: Layer, store: St, place: Box<dyn std::any::Any + Send + Sync>) -> App<St> {
    let probe = Probe::new();
    let data = web::Data::new(probe.clone());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/work", listener.local_addr().unwrap());
    let server = HttpServer::new(move || {
        let layer = layer.clone();
        actix_web::App::new()
            .app_data(data.clone())
            .configure(move |routes| match layer {
                Layer::Transaction(layer) => {
                    routes.service(
                        web::resource("/work")
                            .wrap(Idempotent::new(layer.clone()))
                            .route(web::post().to(tx_handler))
                            .route(web::get().to(|| async { "read" })),
                    );
                    routes.service(
                        web::resource("/optional")
                            .wrap(Idempotent::new(layer))
                            .route(web::post().to(maybe_tx_handler)),
                    );
                }
                Layer::PgTransaction(layer) => {
                    routes.service(
                        web::resource("/work")
                            .wrap(Idempotent::new(layer))
                            .route(web::post().to(pg_tx_handler)),
                    );
                }
                Layer::Lease(layer) => {
                    routes
                        .service(
                            web::resource("/work")
                                .wrap(Idempotent::new(layer.clone()))
                                .route(web::post().to(lease_handler)),
                        )
                        .service(
                            web::resource("/wrong")
                                .wrap(Idempotent::new(layer))
                                .route(web::post().to(tx_handler)),
                        );
                }
            })
            // Added last, so it runs first: the middleware sees the account it set.
            .wrap(from_fn(authenticate))
    })
    .workers(2)
    .listen(listener)
    .unwrap()
    .run();
    let handle = server.handle();
    actix_web::rt::spawn(server);
    App {
        url,
        probe,
        store,
        client: reqwest::Client::new(),
        server: handle,
        _place: place,
    }
}

/// An answer: its status, headers and body.
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The `type` of a problem-details body.
    fn problem(&self) -> String {
        let problem: serde_json::Value = serde_json::from_str(&self.body).unwrap();
        problem["type"].as_str().unwrap().to_owned()
    }
}

impl<St: Rows> App<St> {
    /// A JSON POST of `body` as [`ACCOUNT`], under `key` if there is one, with `marks` (the
    /// handler's `x-` steering headers) set.
    fn post(&self, key: Option<&str>, body: &str, marks: &[&str]) -> reqwest::RequestBuilder {
        let mut request = self
            .client
            .post(&self.url)
            .header("content-type", "application/json")
            .header("x-account", ACCOUNT)
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        for mark in marks {
            request = request.header(*mark, "1");
        }
        request
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Answer {
        let response = request.send().await.unwrap();
        Answer {
            status: response.status().as_u16(),
            headers: response.headers().clone(),
            body: response.text().await.unwrap(),
        }
    }

    async fn send_json(&self, key: &str, body: &str) -> Answer {
        self.send(self.post(Some(key), body, &[])).await
    }

    fn calls(&self) -> usize {
        self.probe.calls.load(Ordering::SeqCst)
    }

    async fn count(&self, sql: &'static str) -> i64 {
        self.store.count(sql).await
    }
}

fn scope(key: &str) -> Scope {
    Scope::new(
        AccountId::new(ACCOUNT),
        IdempotencyKey::new(key, KeyLimits::default()).unwrap(),
    )
}

#[actix_web::test]
async fn a_first_request_runs_once_and_its_retries_replay() {
    let app = start(false).await;
    let first = app.send_json("order-0001", r#"{"sku":"A1"}"#).await;
    assert_eq!(first.status, 201, "{}", first.body);
    assert!(!first.replayed());
    for _ in 0..2 {
        let again = app.send_json("order-0001", r#"{"sku":"A1"}"#).await;
        assert_eq!(again.status, 201);
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        assert_eq!(again.headers.get("location"), first.headers.get("location"));
    }
    assert_eq!(app.calls(), 1);
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 1);
}

#[actix_web::test]
async fn concurrent_duplicates_make_one_effect() {
    let app = start(false).await;
    let copies = (0..8).map(|_| app.send_json("order-burst-1", r#"{"sku":"B2"}"#));
    let answers = futures_util::future::join_all(copies).await;
    assert!(answers.iter().all(|a| a.status == 201), "all answered 201");
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
    assert!(answers.iter().all(|a| a.body == answers[0].body));
    assert_eq!(app.calls(), 1);
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 1);
}

#[actix_web::test]
async fn a_handler_error_rolls_back_its_write_and_the_claim() {
    let app = start(false).await;
    let body = r#"{"sku":"C3"}"#;
    let failed = app
        .send(app.post(Some("order-fail-1"), body, &["x-fail"]))
        .await;
    assert_eq!(failed.status, 500);
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 0);
    assert_eq!(app.count("SELECT COUNT(*) FROM idempotency_keys").await, 0);

    // The key is free: its retry runs afresh, and is the one effect.
    let retry = app.send_json("order-fail-1", body).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(app.calls(), 2);
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 1);
}

#[actix_web::test]
async fn a_handler_panic_is_500_handler_failed_and_frees_the_key() {
    let app = start(false).await;
    let body = r#"{"sku":"D4"}"#;
    let panicked = app
        .send(app.post(Some("order-panic-1"), body, &["x-panic"]))
        .await;
    assert_eq!(panicked.status, 500);
    assert_eq!(panicked.problem(), "urn:idem:problem:handler-failed");
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 0);
    let retry = app.send_json("order-panic-1", body).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
}

#[actix_web::test]
async fn a_key_reused_with_another_body_is_422() {
    let app = start(false).await;
    app.send_json("order-0002", r#"{"sku":"E5"}"#).await;
    let reused = app.send_json("order-0002", r#"{"sku":"F6"}"#).await;
    assert_eq!(reused.status, 422);
    assert_eq!(reused.problem(), "urn:idem:problem:mismatch");
    assert_eq!(app.calls(), 1);
}

#[actix_web::test]
async fn keys_are_checked_before_anything_runs() {
    let app = start(false).await;
    let missing = app.send(app.post(None, "{}", &[])).await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.problem(), "urn:idem:problem:missing-key");
    let malformed = app.send_json("short", "{}").await;
    assert_eq!(malformed.status, 400);
    assert_eq!(malformed.problem(), "urn:idem:problem:malformed-key");
    // A method the policy does not cover passes through untouched.
    let read = app.send(app.client.get(&app.url)).await;
    assert_eq!((read.status, read.body.as_str()), (200, "read"));
    assert_eq!(app.calls(), 0);
}

/// A covered request that reaches the middleware with no account (its authentication did not
/// run first) gets the same refusal as on axum: nothing runs and nothing is stored.
#[actix_web::test]
async fn a_request_without_an_account_is_refused_and_nothing_runs() {
    for lease in [false, true] {
        let app = start(lease).await;
        let request = app
            .client
            .post(&app.url)
            .header("content-type", "application/json")
            .header("idempotency-key", "checkout-3fa1b2")
            .body(r#"{"item":"sku-42"}"#);
        let refused = app.send(request).await;
        assert_eq!(refused.status, 500);
        assert_eq!(refused.problem(), "urn:idem:problem:no-account");
        assert_eq!(app.calls(), 0);
        assert_eq!(app.count("SELECT COUNT(*) FROM idempotency_keys").await, 0);
    }
}

#[actix_web::test]
async fn lease_mode_hands_the_downstream_key_and_refuses_duplicates_in_flight() {
    let app = Arc::new(start(true).await);
    let body = r#"{"amount":100}"#;
    let original = {
        let app = app.clone();
        actix_web::rt::spawn(async move {
            let request = app.post(Some("payout-0001"), body, &["x-gate"]);
            app.send(request).await
        })
    };
    app.probe.entered.notified().await;
    let copies = (0..7).map(|_| app.send_json("payout-0001", body));
    for duplicate in futures_util::future::join_all(copies).await {
        assert_eq!(duplicate.status, 409);
        assert_eq!(duplicate.problem(), "urn:idem:problem:in-use");
        assert!(duplicate.headers.contains_key("retry-after"));
    }
    app.probe.gate.add_permits(1);
    let original = original.await.unwrap();
    assert_eq!(original.status, 201, "{}", original.body);

    // The key the handler was given is the one a reconciler derives from the record.
    let now = SystemClock.now();
    let record = app.store.get(&scope("payout-0001"), now).await.unwrap();
    let expected = DownstreamKey::of(&record.expect("a record"));
    assert_eq!(original.body, format!("call 1: {expected}"));

    let replay = app.send_json("payout-0001", body).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, original.body);
    assert_eq!(app.calls(), 1);
}

#[actix_web::test]
async fn a_response_over_the_storage_cap_streams_whole_and_replays_without_body() {
    let app = start_with(false, |p| p.storage_cap = 100).await;
    let request = || {
        app.post(Some("big-reply-key-1"), "{}", &[])
            .header("x-len", "100000")
    };
    let first = app.send(request()).await;
    assert_eq!((first.status, first.body.len()), (201, 100_000));
    let again = app.send(request()).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.headers.get("idempotent-replay").unwrap(), "omitted");
    assert_eq!(again.headers.get("content-type").unwrap(), "text/plain");
    assert!(again.body.is_empty());
    assert_eq!(app.calls(), 1);
}

/// A keyless request on a route whose keys are optional reaches the handler with its body
/// still streaming, and runs every time.
#[actix_web::test]
async fn keyless_requests_pass_through_with_their_body_when_keys_are_optional() {
    let app = start_with(true, |p| p.require_key = false).await;
    let body = format!(r#"{{"pad":"{}"}}"#, "p".repeat(200_000));
    for n in 1..=2 {
        let answer = app.send(app.post(None, &body, &[])).await;
        assert_eq!(answer.status, 201);
        assert_eq!(answer.body, format!("call {n}: {body}"));
    }
    assert_eq!(app.count("SELECT COUNT(*) FROM idempotency_keys").await, 0);
}

#[actix_web::test]
async fn a_tx_asked_for_outside_transaction_mode_is_500_no_transaction() {
    let app = start(true).await;
    let request = app
        .post(Some("wrong-route-1"), "{}", &[])
        .try_clone()
        .unwrap();
    let wrong = app.client.execute({
        let mut built = request.build().unwrap();
        *built.url_mut() = app.url.replace("/work", "/wrong").parse().unwrap();
        built
    });
    let response = wrong.await.unwrap();
    assert_eq!(response.status(), 500);
    let body = response.text().await.unwrap();
    assert!(body.contains("urn:idem:problem:no-transaction"), "{body}");
    assert!(body.contains("SqliteTx"), "names the type: {body}");
}

/// The client hangs up while its handler runs; the work goes on and commits, so the retry
/// (which waits for it, in transaction mode) replays it instead of running it again.
#[actix_web::test]
async fn a_client_hanging_up_does_not_cancel_the_work() {
    use tokio::io::AsyncWriteExt;
    let app = start(false).await;
    let body = r#"{"sku":"H8"}"#;
    let addr = app
        .url
        .trim_start_matches("http://")
        .trim_end_matches("/work");
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /work HTTP/1.1\r\nhost: x\r\nx-account: {ACCOUNT}\r\nx-gate: 1\r\nidempotency-key: hangup-key-0001\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    app.probe.entered.notified().await;
    drop(socket);
    let retry = app.send_json("hangup-key-0001", body);
    let open_gate = async { app.probe.gate.add_permits(1) };
    let (retry, ()) = tokio::join!(retry, open_gate);
    assert_eq!(retry.status, 201, "{}", retry.body);
    assert!(retry.replayed());
    assert_eq!(app.calls(), 1);
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 1);
}

#[actix_web::test]
async fn an_outcome_release_set_by_the_handler_frees_the_key() {
    let app = start(false).await;
    let body = r#"{"sku":"R9"}"#;
    for n in 1..=2 {
        let answer = app
            .send(app.post(Some("order-release-1"), body, &["x-release"]))
            .await;
        assert_eq!((answer.status, answer.replayed()), (201, false));
        assert_eq!(app.calls(), n, "each request runs: nothing was stored");
    }
    assert_eq!(
        app.count("SELECT COUNT(*) FROM effects").await,
        0,
        "rolled back"
    );
}

/// `Option<Tx<T>>` is `None` for a keyless request the layer let through, so the handler can
/// open its own transaction.
#[actix_web::test]
async fn an_optional_tx_is_none_for_a_keyless_request() {
    let app = start_with(false, |p| p.require_key = false).await;
    let url = app.url.replace("/work", "/optional");
    for (key, expected) in [(None, "none"), (Some("optional-key-1"), "opened")] {
        let mut request = app
            .client
            .post(&url)
            .header("x-account", ACCOUNT)
            .header("content-type", "application/json")
            .body("{}");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let answer = app.send(request).await;
        assert_eq!((answer.status, answer.body.as_str()), (200, expected));
    }
}

/// Transaction mode on PostgreSQL, whose pool the actix workers share across their runtimes:
/// concurrent copies make one effect, and a failed handler leaves neither its row nor its key.
#[actix_web::test]
async fn on_postgres_copies_make_one_effect_and_a_failure_leaves_nothing() {
    let app = start_pg().await;
    let copies = (0..8).map(|_| app.send_json("pg-order-0001", r#"{"sku":"P1"}"#));
    let answers = futures_util::future::join_all(copies).await;
    assert!(answers.iter().all(|a| a.status == 201), "all answered 201");
    assert_eq!(answers.iter().filter(|a| !a.replayed()).count(), 1);
    assert_eq!(app.calls(), 1);
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 1);

    let failed = app
        .send(app.post(Some("pg-order-0002"), "{}", &["x-fail"]))
        .await;
    assert_eq!(failed.status, 500);
    assert_eq!(app.count("SELECT COUNT(*) FROM effects").await, 1);
    let keys = "SELECT COUNT(*) FROM idempotency_keys";
    assert_eq!(app.count(keys).await, 1, "only the first key");
}

/// A body over the limit is refused before anything runs, whether its length is declared or
/// it comes in chunks through the pump.
#[actix_web::test]
async fn a_body_over_the_limit_is_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = start_with(false, |p| p.body_limit = 1024).await;
    let declared = app
        .send(app.post(Some("large-key-0001"), &"x".repeat(2000), &[]))
        .await;
    assert_eq!(declared.status, 413);
    assert_eq!(declared.problem(), "urn:idem:problem:body-too-large");

    let addr = app
        .url
        .trim_start_matches("http://")
        .trim_end_matches("/work");
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let chunk = "x".repeat(600);
    let request = format!(
        "POST /work HTTP/1.1\r\nhost: x\r\nx-account: {ACCOUNT}\r\nidempotency-key: chunked-key-001\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n{len:x}\r\n{chunk}\r\n{len:x}\r\n{chunk}\r\n0\r\n\r\n",
        len = chunk.len(),
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut reply = vec![0; 4096];
    let n = socket.read(&mut reply).await.unwrap();
    let reply = String::from_utf8_lossy(&reply[..n]);
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert!(reply.contains("urn:idem:problem:body-too-large"), "{reply}");
    assert_eq!(app.calls(), 0);
    assert_eq!(app.count("SELECT COUNT(*) FROM idempotency_keys").await, 0);
}

/// With an outcome wait, a copy that meets the original running waits for its outcome (woken
/// by the signal, across the middleware's tasks) and replays it instead of getting `409`.
#[actix_web::test]
async fn with_an_outcome_wait_a_duplicate_waits_and_replays() {
    let signal = OutcomeSignal::default();
    let wait = signal.clone();
    let app = Rc::new(start_leased(|l| l.with_outcome_signal(Duration::from_secs(10), wait)).await);
    let body = r#"{"amount":7}"#;
    let original = {
        let app = app.clone();
        actix_web::rt::spawn(async move {
            app.send(app.post(Some("waiting-key-001"), body, &["x-gate"]))
                .await
        })
    };
    app.probe.entered.notified().await;
    let duplicate = {
        let app = app.clone();
        actix_web::rt::spawn(async move { app.send_json("waiting-key-001", body).await })
    };
    // Release the original only once the duplicate is parked on the signal (without the wait
    // it would have had its 409 at once).
    let parked = tokio::time::Instant::now() + Duration::from_secs(5);
    while signal.waiting() == 0 {
        assert!(
            tokio::time::Instant::now() < parked,
            "the duplicate never waited"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    app.probe.gate.add_permits(1);
    let (original, duplicate) = (original.await.unwrap(), duplicate.await.unwrap());
    assert_eq!((original.status, duplicate.status), (201, 201));
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, original.body);
    assert_eq!(app.calls(), 1);
}

/// A handler's body that streams, with its length declared or not, crosses whole: stored and
/// replayed within the storage cap, passed on with its length past it.
#[actix_web::test]
async fn streamed_bodies_cross_whole_within_and_past_the_cap() {
    let app = start_with(false, |p| p.storage_cap = 100).await;
    for (n, stream) in ["sized", "unsized"].into_iter().enumerate() {
        for (len, stored) in [(50, true), (100_000, false)] {
            let key = format!("stream-key-{n}-{len}");
            let request = || {
                app.post(Some(&key), "{}", &[])
                    .header("x-stream", stream)
                    .header("x-len", len.to_string())
            };
            let first = app.send(request()).await;
            assert_eq!((first.status, first.body.len()), (201, len), "{stream}");
            if stream == "sized" {
                let declared = first.headers.get("content-length");
                assert_eq!(declared.unwrap(), &len.to_string(), "{stream} {len}");
            }
            let again = app.send(request()).await;
            assert!(again.replayed());
            let body = if stored { first.body.as_str() } else { "" };
            assert_eq!(again.body, body, "{stream} {len}");
        }
    }
    assert_eq!(app.calls(), 4);
}
