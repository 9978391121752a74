//! `idem drill` against a real `idem serve`, where every check passes, and against two broken
//! APIs built here, where the drill names the checks they fail.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::common::{ALICE, BOB, TestServer, drill_args, idem};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idem_cli::drill::{Drill, DrillConfig, Report, Status};
use idem_client::{RecordingSleeper, Sleep, Sleeper};
use idem_core::ManualClock;
use serde_json::Value;

/// Waits by moving the server's clock: the expiry check runs without sitting through the
/// retention.
#[derive(Debug)]
struct AdvanceClock(ManualClock);

impl Sleeper for AdvanceClock {
    fn sleep(&self, duration: Duration) -> Sleep<'_> {
        self.0.advance(duration);
        Box::pin(std::future::ready(()))
    }
}

fn config(url: &str) -> DrillConfig {
    DrillConfig::new(url.parse().unwrap(), ALICE, BOB)
}

async fn drill(url: &str, sleeper: impl Sleeper) -> Report {
    Drill::new(config(url))
        .unwrap()
        .with_sleeper(sleeper)
        .run()
        .await
        .unwrap()
}

fn detail<'a>(report: &'a Report, name: &str) -> &'a str {
    &report.check(name).unwrap().detail
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_check_passes_against_idem_serve() {
    let server = TestServer::start_with(|c| c.policy.retention = Duration::from_secs(1)).await;
    let report = drill(
        &format!("{}/payments", server.url),
        AdvanceClock(server.clock.clone()),
    )
    .await;

    assert_eq!(report.failed(), 0, "{}", report.table());
    assert_eq!(report.skipped(), 0, "{}", report.table());
    assert_eq!(report.passed(), 9);
    assert!(detail(&report, "concurrent").starts_with("3 answers: 201 201 201, 1 id, 2 replayed"));
    assert!(
        detail(&report, "expiry").starts_with("retention 1 s; after 2 s the key got: 201, new id")
    );
    // The concurrent copies made one payment, account B one, the expiry check two; every
    // refused request made none.
    assert_eq!(server.payments().await, 4);
    server.stop().await;
}

#[tokio::test]
async fn skipped_checks_are_reported_and_do_not_fail_the_run() {
    // Keys optional and a day's retention: two checks cannot run.
    let server = TestServer::start_with(|c| c.policy.require_key = false).await;
    let sleeper = RecordingSleeper::new();
    let report = drill(&format!("{}/payments", server.url), sleeper.clone()).await;

    assert_eq!(report.names(Status::Skip), ["missing-key", "expiry"]);
    assert_eq!(
        detail(&report, "missing-key"),
        "/idempotency-policy says key_required: false"
    );
    assert_eq!(
        detail(&report, "expiry"),
        "retention is 86400 s, more than --max-wait 5 s"
    );
    assert_eq!((report.passed(), report.failed()), (7, 0));
    assert_eq!(report.exit_code(), std::process::ExitCode::SUCCESS);
    assert!(sleeper.slept().is_empty(), "nothing to wait for");
    server.stop().await;
}

#[tokio::test]
async fn an_api_with_no_idempotency_fails_every_replay_check() {
    let url = serve_fixture(no_idempotency()).await;
    let report = drill(&url, RecordingSleeper::new()).await;

    assert_eq!(
        report.names(Status::Fail),
        [
            "concurrent",
            "replay",
            "reordered-body",
            "body-mismatch",
            "missing-key",
            "malformed-key"
        ],
        "{}",
        report.table()
    );
    // Making a new resource every time trivially keeps accounts apart, and its GETs are
    // plain; it publishes no policy, so there is no retention to test.
    assert_eq!(
        report.names(Status::Pass),
        ["account-scope", "get-with-key"]
    );
    assert_eq!(report.names(Status::Skip), ["expiry"]);
    assert!(detail(&report, "concurrent").starts_with("3 answers: 201 201 201, 3 ids, 0 replayed"));
    assert!(detail(&report, "body-mismatch").starts_with("amount 49900 -> 49901: 201, new id"));
    assert!(detail(&report, "missing-key").starts_with("no key: 201, id pay_"));
    assert!(detail(&report, "expiry").starts_with("GET /idempotency-policy: 404"));
    assert_eq!(report.exit_code(), std::process::ExitCode::FAILURE);
}

#[tokio::test]
async fn an_api_that_replays_by_key_alone_fails_the_payload_and_account_checks() {
    let url = serve_fixture(replay_by_key_alone()).await;
    let sleeper = RecordingSleeper::new();
    let report = drill(&url, sleeper.clone()).await;

    assert_eq!(
        report.names(Status::Fail),
        [
            "body-mismatch",
            "account-scope",
            "missing-key",
            "malformed-key",
            "expiry"
        ],
        "{}",
        report.table()
    );
    assert_eq!(
        report.names(Status::Pass),
        ["concurrent", "replay", "reordered-body", "get-with-key"]
    );
    assert!(
        detail(&report, "body-mismatch")
            .starts_with("amount 49900 -> 49901: 201, the same id, replayed"),
        "{}",
        detail(&report, "body-mismatch")
    );
    assert_eq!(
        detail(&report, "account-scope"),
        "account B, same key and body: 201, account A's id, replayed; expected a new id, not replayed"
    );
    assert!(
        detail(&report, "malformed-key").starts_with("not 400: empty 201, too short 201"),
        "{}",
        detail(&report, "malformed-key")
    );
    assert!(
        detail(&report, "expiry")
            .ends_with("the key got: 201, its first id, replayed; expected a new id, not replayed"),
        "{}",
        detail(&report, "expiry")
    );
    // It claims a 1 s retention: the drill waited that out, plus a second.
    assert_eq!(sleeper.slept(), [Duration::from_secs(2)]);
}

#[tokio::test]
async fn a_409_for_a_key_in_use_is_retried_as_a_client_would() {
    let url = serve_fixture(lease_mode()).await;
    let report = drill(&url, RecordingSleeper::new()).await;
    let concurrent = report.check("concurrent").unwrap();
    assert_eq!(concurrent.status, Status::Pass, "{}", report.table());
    assert!(
        concurrent
            .detail
            .starts_with("3 answers: 201 201 201, 1 id, 2 replayed, "),
        "{}",
        concurrent.detail
    );
    assert!(
        concurrent.detail.ends_with(" after a retry"),
        "{}",
        concurrent.detail
    );
}

#[tokio::test]
async fn an_unreachable_api_stops_the_drill_before_any_check() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/payments", listener.local_addr().unwrap());
    drop(listener);
    let err = Drill::new(config(&url)).unwrap().run().await.unwrap_err();
    assert!(
        err.to_string()
            .starts_with("cannot reach http://127.0.0.1:"),
        "{err:#}"
    );
}

#[tokio::test]
async fn a_refused_token_stops_the_drill_before_any_check() {
    let server = TestServer::start().await;
    let mut config = config(&format!("{}/payments", server.url));
    config.token_a = "sk_test_nobody".into();
    let err = Drill::new(config).unwrap().run().await.unwrap_err();
    assert!(
        err.to_string().contains("refused --token-a with 401"),
        "{err:#}"
    );
    assert_eq!(server.payments().await, 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_prints_json_and_exits_0_against_idem_serve() {
    let server = TestServer::start().await;
    let output = idem(drill_args(&format!("{}/payments", server.url), &["--json"])).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");

    let json: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(json["url"], format!("{}/payments", server.url));
    let checks = json["checks"].as_array().unwrap();
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "concurrent",
            "replay",
            "reordered-body",
            "body-mismatch",
            "account-scope",
            "missing-key",
            "malformed-key",
            "get-with-key",
            "expiry"
        ]
    );
    for check in checks {
        assert!(
            check["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{check}"
        );
    }
    let statuses: Vec<&str> = checks
        .iter()
        .map(|c| c["status"].as_str().unwrap())
        .collect();
    // The default retention (a day) is longer than --max-wait: the one skip.
    assert_eq!(
        statuses,
        [
            "pass", "pass", "pass", "pass", "pass", "pass", "pass", "pass", "skip"
        ]
    );
    assert_eq!(
        (&json["passed"], &json["failed"], &json["skipped"]),
        (&8.into(), &0.into(), &1.into())
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_exits_1_when_a_check_fails_and_2_when_it_cannot_start() {
    let url = serve_fixture(no_idempotency()).await;
    let output = idem(drill_args(&url, &[])).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("\nconcurrent      FAIL    3 answers: 201 201 201, 3 ids, 0 replayed; expected one id, all but one replayed\n"),
        "{stdout}"
    );
    assert!(
        stdout.ends_with("\n2 passed, 6 failed, 1 skipped\n"),
        "{stdout}"
    );

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = format!("http://{}/payments", listener.local_addr().unwrap());
    drop(listener);
    let output = idem(drill_args(&closed, &[])).await;
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("idem: cannot reach"), "{stderr}");
    assert!(output.stdout.is_empty());

    let output = idem(drill_args(&url, &["--concurrency", "1"])).await;
    assert_eq!(output.status.code(), Some(2), "a usage error");
}

// --- Two broken APIs, as small as they can be ------------------------------------------------

/// Payments by id, shared by both fixtures. A std Mutex: no await happens while it is held.
#[derive(Debug, Clone, Default)]
struct Payments(Arc<Mutex<HashMap<String, Value>>>);

impl Payments {
    /// Makes a payment from whatever JSON was posted: a new id every time.
    fn create(&self, body: &[u8]) -> (StatusCode, Value) {
        let id = format!("pay_{}", uuid::Uuid::new_v4().simple());
        let mut payment: Value = serde_json::from_slice(body).unwrap_or_default();
        payment["id"] = id.clone().into();
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, payment.clone());
        (StatusCode::CREATED, payment)
    }

    fn show(&self, id: &str) -> Response {
        match self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
        {
            Some(payment) => axum::Json(payment.clone()).into_response(),
            None => StatusCode::NOT_FOUND.into_response(),
        }
    }
}

/// A fixture's replay of the payment it stored for a key.
fn replayed(payment: &Value) -> Response {
    (
        StatusCode::CREATED,
        [(
            header::HeaderName::from_static("idempotent-replayed"),
            "true",
        )],
        axum::Json(payment.clone()),
    )
        .into_response()
}

/// Every POST is a new payment, key or not.
fn no_idempotency() -> Router {
    Router::new()
        .route(
            "/payments",
            post(|State(p): State<Payments>, body: Bytes| async move {
                let (status, payment) = p.create(&body);
                (status, axum::Json(payment))
            }),
        )
        .route(
            "/payments/{id}",
            get(|State(p): State<Payments>, Path(id): Path<String>| async move { p.show(&id) }),
        )
        .with_state(Payments::default())
}

/// The classic half-done implementation: a global map from the raw key header to the first
/// response, with neither the body nor the account in the lookup, and any header value taken
/// as a key. It also publishes a 1 s retention it never honours.
#[derive(Debug, Clone, Default)]
struct KeyOnly {
    payments: Payments,
    /// A Tokio Mutex, held while the payment is made, so concurrent copies wait and replay.
    seen: Arc<tokio::sync::Mutex<HashMap<Vec<u8>, Value>>>,
}

fn replay_by_key_alone() -> Router {
    async fn create(State(api): State<KeyOnly>, headers: HeaderMap, body: Bytes) -> Response {
        let Some(key) = headers.get("idempotency-key") else {
            let (status, payment) = api.payments.create(&body);
            return (status, axum::Json(payment)).into_response();
        };
        let mut seen = api.seen.lock().await;
        if let Some(payment) = seen.get(key.as_bytes()) {
            return replayed(payment);
        }
        let (status, payment) = api.payments.create(&body);
        seen.insert(key.as_bytes().to_vec(), payment.clone());
        (status, axum::Json(payment)).into_response()
    }

    Router::new()
        .route("/payments", post(create))
        .route(
            "/payments/{id}",
            get(
                |State(api): State<KeyOnly>, Path(id): Path<String>| async move {
                    api.payments.show(&id)
                },
            ),
        )
        .route(
            "/idempotency-policy",
            get(|| async { axum::Json(serde_json::json!({"retention_seconds": 1})) }),
        )
        .with_state(KeyOnly::default())
}

/// Not broken: a lease-mode API, which answers a duplicate of a request still running with
/// `409` and the `in-use` problem instead of making it wait.
fn lease_mode() -> Router {
    #[derive(Debug, Clone, Default)]
    struct Lease {
        payments: Payments,
        /// Key to its payment, `None` while the first request still runs.
        records: Arc<Mutex<HashMap<Vec<u8>, Option<Value>>>>,
        /// Told when a duplicate was turned away.
        refused: Arc<tokio::sync::Notify>,
        /// Whether the first request ever has come: only it holds its claim.
        started: Arc<std::sync::atomic::AtomicBool>,
    }

    async fn create(State(api): State<Lease>, headers: HeaderMap, body: Bytes) -> Response {
        let key = headers
            .get("idempotency-key")
            .map(|k| k.as_bytes().to_vec())
            .unwrap_or_default();
        {
            let mut records = api.records.lock().unwrap_or_else(PoisonError::into_inner);
            match records.get(&key) {
                Some(Some(payment)) => {
                    return replayed(payment);
                }
                Some(None) => {
                    api.refused.notify_one();
                    return (
                        StatusCode::CONFLICT,
                        [(header::CONTENT_TYPE, "application/problem+json")],
                        r#"{"type":"urn:idem:problem:in-use","status":409}"#,
                    )
                        .into_response();
                }
                None => {
                    records.insert(key.clone(), None);
                }
            }
        }
        // The drill's first request holds its claim until a duplicate has met the 409
        // (notify_one keeps the permit if that happened already), so the drill is sure to see
        // one, however late the copies arrive on a loaded machine; later requests, with no
        // duplicate coming, do not wait. The bound only keeps a drill that sends no copy
        // from hanging.
        if !api.started.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let _ = tokio::time::timeout(Duration::from_secs(30), api.refused.notified()).await;
        }
        let (status, payment) = api.payments.create(&body);
        api.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, Some(payment.clone()));
        (status, axum::Json(payment)).into_response()
    }

    Router::new()
        .route("/payments", post(create))
        .with_state(Lease::default())
}

/// Serves `router` on 127.0.0.1:0 for the rest of the test; returns its POST URL.
async fn serve_fixture(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/payments", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}
