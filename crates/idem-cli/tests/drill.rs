//! `idem drill` against a real `idem serve`, where every check passes under the idem profile,
//! and against broken APIs built here, where the drill names the checks they fail (the
//! promise) or warn on (the draft's SHOULDs and conventions).

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::common::{ALICE, BOB, TestServer, drill_args, idem};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idem_cli::drill::{Drill, DrillConfig, Profile, Report, Status};
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

/// The names of the checks, in the order they run.
const CHECKS: [&str; 16] = [
    "policy",
    "concurrent",
    "in-flight",
    "replay",
    "replay-marker",
    "reordered-body",
    "body-mismatch",
    "account-scope",
    "unknown-token",
    "auth-failure",
    "missing-key",
    "malformed-key",
    "problem-details",
    "get-with-key",
    "after-5xx",
    "expiry",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_serve_passes_the_idem_profile_with_no_warning() {
    let server = TestServer::start_with(|c| c.policy.retention = Duration::from_secs(1)).await;
    let mut config = config(&format!("{}/payments", server.url));
    config.profile = Profile::Idem;
    let report = Drill::new(config)
        .unwrap()
        .with_sleeper(AdvanceClock(server.clock.clone()))
        .run()
        .await
        .unwrap();

    let names: Vec<&str> = report.checks.iter().map(|c| c.name).collect();
    assert_eq!(names, CHECKS);
    assert_eq!(
        (report.failed(), report.warned()),
        (0, 0),
        "{}",
        report.table()
    );
    // idem serve's payments never answer a 5xx on demand: nothing for after-5xx to send.
    assert_eq!(
        report.names(Status::Skip),
        ["after-5xx"],
        "{}",
        report.table()
    );
    assert!(
        report
            .checks
            .iter()
            .all(|c| c.rule.starts_with("idem contract") || c.rule.starts_with("draft §2.6")),
        "{}",
        report.table()
    );
    assert!(
        detail(&report, "concurrent")
            .starts_with("5 rounds of 3 copies, a fresh key each: one resource per round"),
        "{}",
        detail(&report, "concurrent")
    );
    assert_eq!(
        (
            report.concurrency.rounds,
            report.concurrency.with_extra_resources
        ),
        (5, 0)
    );
    assert!(
        detail(&report, "expiry").starts_with("retention 1 s; after 2 s the key got: 201, new id")
    );
    assert!(
        detail(&report, "unknown-token").starts_with("an unknown token, A's key and body: 401"),
        "{}",
        detail(&report, "unknown-token")
    );
    // One payment per round, account B's, the one after the refused stranger, and the
    // expiry check's two; every refused request made none.
    assert_eq!(server.payments().await, 5 + 1 + 1 + 2);
    server.stop().await;
}

#[tokio::test]
async fn optional_keys_warn_and_do_not_fail_the_run_unless_strict() {
    // Keys optional and a day's retention.
    let server = TestServer::start_with(|c| c.policy.require_key = false).await;
    let sleeper = RecordingSleeper::new();
    let report = drill(&format!("{}/payments", server.url), sleeper.clone()).await;

    assert_eq!(
        report.names(Status::Warn),
        ["missing-key"],
        "{}",
        report.table()
    );
    assert_eq!(
        detail(&report, "missing-key"),
        "/idempotency-policy says key_required: false; expected keys required (400 without one)"
    );
    assert_eq!(report.check("missing-key").unwrap().rule, "draft §2.7");
    assert_eq!(report.names(Status::Skip), ["after-5xx", "expiry"]);
    assert_eq!(
        detail(&report, "expiry"),
        "retention is 86400 s, more than --max-wait 5 s"
    );
    assert_eq!(report.failed(), 0);
    assert_eq!(report.exit_code(), ExitCode::SUCCESS);
    assert!(sleeper.slept().is_empty(), "nothing to wait for");

    let mut strict = config(&format!("{}/payments", server.url));
    strict.strict = true;
    let report = Drill::new(strict).unwrap().run().await.unwrap();
    assert_eq!(report.exit_code(), ExitCode::FAILURE, "--strict");
    server.stop().await;
}

#[tokio::test]
async fn an_api_with_no_idempotency_fails_the_promise_and_warns_on_the_rest() {
    let url = serve_fixture(no_idempotency()).await;
    let report = drill(&url, RecordingSleeper::new()).await;

    assert_eq!(
        report.names(Status::Fail),
        ["concurrent", "replay", "reordered-body", "body-mismatch"],
        "{}",
        report.table()
    );
    assert_eq!(
        report.names(Status::Warn),
        ["policy", "missing-key", "malformed-key"],
        "{}",
        report.table()
    );
    assert_eq!(
        report.names(Status::Skip),
        [
            "replay-marker",
            "auth-failure",
            "problem-details",
            "after-5xx",
            "expiry"
        ],
        "{}",
        report.table()
    );
    // Every round made three payments.
    assert_eq!(report.concurrency.with_extra_resources, 5);
    assert!(
        detail(&report, "concurrent").starts_with(
            "5 of 5 rounds of 3 copies, a fresh key each made more than one resource; round 1: 201 201 201, 3 resources"
        ),
        "{}",
        detail(&report, "concurrent")
    );
    assert_eq!(report.check("concurrent").unwrap().rule, "draft §2.6");
    assert!(detail(&report, "body-mismatch").starts_with("amount 49900 -> 49901: 201, new id"));
    assert!(detail(&report, "missing-key").starts_with("no key: 201, id pay_"));
    assert!(
        detail(&report, "auth-failure").starts_with("an unknown token got 201"),
        "the fixture authenticates nobody"
    );
    assert_eq!(report.exit_code(), ExitCode::FAILURE);
}

#[tokio::test]
async fn an_api_that_replays_by_key_alone_hands_account_a_s_answer_to_others() {
    let url = serve_fixture(replay_by_key_alone()).await;
    let sleeper = RecordingSleeper::new();
    let report = drill(&url, sleeper.clone()).await;

    assert_eq!(
        report.names(Status::Fail),
        ["account-scope", "unknown-token"],
        "{}",
        report.table()
    );
    assert_eq!(
        report.names(Status::Warn),
        ["body-mismatch", "missing-key", "malformed-key", "expiry"],
        "{}",
        report.table()
    );
    assert!(
        detail(&report, "body-mismatch").starts_with(
            "amount 49900 -> 49901: 201, the same id, replayed (the first answer, for a changed request)"
        ),
        "{}",
        detail(&report, "body-mismatch")
    );
    assert_eq!(
        detail(&report, "account-scope"),
        "account B, same key and body: 201, account A's id, replayed; expected a resource of B's own, never A's"
    );
    assert_eq!(report.check("account-scope").unwrap().rule, "draft §5");
    assert!(
        detail(&report, "malformed-key").starts_with("not refused: empty 201"),
        "{}",
        detail(&report, "malformed-key")
    );
    assert!(
        detail(&report, "expiry").ends_with(
            "the key got: 201, its first id, replayed; expected a new resource once the published retention has passed"
        ),
        "{}",
        detail(&report, "expiry")
    );
    // It claims a 1 s retention: the drill waited that out, plus a second.
    assert_eq!(sleeper.slept(), [Duration::from_secs(2)]);
}

#[tokio::test]
async fn a_409_for_a_request_in_flight_is_the_draft_s_answer_and_is_tried_again() {
    let url = serve_fixture(lease_mode()).await;
    let report = drill(&url, RecordingSleeper::new()).await;
    for name in ["concurrent", "in-flight", "replay"] {
        assert_eq!(
            report.check(name).unwrap().status,
            Status::Pass,
            "{}",
            report.table()
        );
    }
    let in_flight = detail(&report, "in-flight");
    assert!(in_flight.contains("409 ×"), "{in_flight}");
    assert!(in_flight.contains("(0 with Retry-After)"), "{in_flight}");
    assert!(
        in_flight.ends_with("tried again once the original had answered, each got its answer"),
        "{in_flight}"
    );

    // Under --profile stripe a 409 must say when to retry.
    let mut stripe = config(&url);
    stripe.profile = Profile::Stripe;
    let report = Drill::new(stripe).unwrap().run().await.unwrap();
    let in_flight = report.check("in-flight").unwrap();
    // The fixture holds only its first request; later rounds may not meet a copy in flight.
    if in_flight.detail.contains("409 ×") {
        assert_eq!(
            (in_flight.status, in_flight.rule),
            (Status::Fail, "Stripe convention"),
            "{}",
            report.table()
        );
    }
}

/// The shape of the third-party API in issue 37: the copy that wins a round is the last to
/// arrive (so the drill's first copy gets a 409), keys are global, the key is looked up before
/// authentication, every outcome is stored, and a 5xx leaves the key in progress for ever.
/// The drill once took the first copy's 409 for the original and flipped verdicts from run to
/// run; each verdict must now be the same every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_original_is_the_copy_that_made_the_resource_wherever_it_stands() {
    let url = serve_fixture(last_copy_wins()).await;
    let mut config = config(&url);
    config.failing_body = Some(FAILING_BODY.to_owned());
    config.failing_wait = Some(Duration::from_secs(3));
    let report = Drill::new(config)
        .unwrap()
        .with_sleeper(RecordingSleeper::new())
        .run()
        .await
        .unwrap();

    for name in ["concurrent", "in-flight", "replay"] {
        assert_eq!(
            report.check(name).unwrap().status,
            Status::Pass,
            "{name}: {}",
            report.table()
        );
    }
    assert!(
        detail(&report, "replay").starts_with("201, the same id, not marked replayed, same bytes"),
        "{}",
        detail(&report, "replay")
    );
    assert_eq!(
        report.names(Status::Fail),
        [
            "account-scope",
            "unknown-token",
            "auth-failure",
            "after-5xx"
        ],
        "{}",
        report.table()
    );
    assert!(
        detail(&report, "account-scope")
            .starts_with("account B, same key and body: 201, account A's id"),
        "{}",
        detail(&report, "account-scope")
    );
    assert!(
        detail(&report, "unknown-token")
            .starts_with("an unknown token, A's key and body: 201, account A's id"),
        "{}",
        detail(&report, "unknown-token")
    );
    assert!(
        detail(&report, "auth-failure").starts_with(
            "an unknown token with a fresh key: 401; then account A with that key: 401"
        ),
        "{}",
        detail(&report, "auth-failure")
    );
    assert!(
        detail(&report, "after-5xx").contains("then 409"),
        "{}",
        detail(&report, "after-5xx")
    );
    assert_eq!(report.check("after-5xx").unwrap().rule, "draft §2.6");
    // A correct replay that lacks only Stripe's header is a warning, not a failure.
    assert_eq!(report.check("replay-marker").unwrap().status, Status::Warn);
}

/// A check-then-act implementation with a provider call between the check and the record:
/// every round whose copies meet inside that window makes several payments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_racy_implementation_is_caught_and_its_rounds_counted() {
    let url = serve_fixture(racy()).await;
    let mut config = config(&url);
    config.rounds = 4;
    let report = Drill::new(config).unwrap().run().await.unwrap();
    let concurrent = report.check("concurrent").unwrap();
    assert_eq!(concurrent.status, Status::Fail, "{}", report.table());
    assert!(
        report.concurrency.with_extra_resources >= 1,
        "{}",
        report.table()
    );
    assert_eq!(
        (report.concurrency.rounds, report.concurrency.copies),
        (4, 3)
    );
    assert!(
        concurrent
            .detail
            .ends_with("; expected one resource per key, however many copies meet"),
        "{}",
        concurrent.detail
    );
    // The race is counted once: the later checks compare with the resource the key kept, so
    // its replays pass. (Its keys are global, so other callers get account A's payment.)
    assert_eq!(
        report.names(Status::Fail),
        ["concurrent", "account-scope", "unknown-token"],
        "{}",
        report.table()
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
async fn the_binary_prints_levels_and_rules_as_json_and_exits_0_against_idem_serve() {
    let server = TestServer::start().await;
    let output = idem(drill_args(&format!("{}/payments", server.url), &["--json"])).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");

    let json: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(json["url"], format!("{}/payments", server.url));
    assert_eq!(json["profile"], "draft");
    assert_eq!(json["strict"], false);
    let checks = json["checks"].as_array().unwrap();
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, CHECKS);
    for check in checks {
        assert!(
            check["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{check}"
        );
        assert!(
            check["rule"].as_str().is_some_and(|r| !r.is_empty()),
            "{check}"
        );
    }
    let statuses: Vec<&str> = checks
        .iter()
        .map(|c| c["status"].as_str().unwrap())
        .collect();
    // No --failing-body, and the default retention (a day) is longer than --max-wait.
    let mut expected = ["pass"; 16];
    expected[14] = "skip";
    expected[15] = "skip";
    assert_eq!(statuses, expected, "{stdout}");
    assert_eq!(checks[1]["rule"], "draft §2.6");
    assert_eq!(checks[4]["rule"], "Stripe convention");
    assert_eq!(
        json["concurrency"],
        serde_json::json!({"rounds": 5, "copies": 3, "with_extra_resources": 0})
    );
    assert_eq!(
        (
            &json["passed"],
            &json["warned"],
            &json["failed"],
            &json["skipped"]
        ),
        (&14.into(), &0.into(), &0.into(), &2.into())
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_exits_1_when_a_check_fails_and_2_when_it_cannot_start() {
    let url = serve_fixture(no_idempotency()).await;
    let output = idem(drill_args(&url, &["--rounds", "2"])).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.starts_with(&format!("idem drill {url} (profile draft)\n")),
        "{stdout}"
    );
    assert!(
        stdout.contains("\nconcurrent       FAIL    draft §2.6          2 of 2 rounds of 3 copies"),
        "{stdout}"
    );
    assert!(
        stdout.ends_with("\n4 passed, 3 warned, 4 failed, 5 skipped\n"),
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

    for usage in [
        &["--concurrency", "1"][..],
        &["--rounds", "0"],
        &["--profile", "rfc"],
        &["--failing-wait", "3"],
    ] {
        let output = idem(drill_args(&url, usage)).await;
        assert_eq!(output.status.code(), Some(2), "a usage error: {usage:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_fails_a_warning_only_with_strict() {
    let server = TestServer::start_with(|c| c.policy.require_key = false).await;
    let url = format!("{}/payments", server.url);
    let output = idem(drill_args(&url, &["--rounds", "1"])).await;
    assert_eq!(output.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("\nmissing-key      WARN    draft §2.7  "),
        "{stdout}"
    );

    let output = idem(drill_args(&url, &["--rounds", "1", "--strict"])).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.ends_with("skipped (--strict: a warning fails the run)\n"),
        "{stdout}"
    );
    server.stop().await;
}

// --- APIs built here, as small as they can be -------------------------------------------------

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

/// A body the fixtures' payment provider fails on: XTS is the ISO 4217 code kept for tests.
const FAILING_BODY: &str = r#"{"amount": 500, "currency": "XTS"}"#;

/// The copies a drill round sends by default.
const COPIES: usize = 3;

/// The account a fixture's bearer token names, if any.
fn account_of(headers: &HeaderMap) -> Option<&'static str> {
    match headers.get(header::AUTHORIZATION)?.to_str().ok()? {
        "Bearer sk_test_alice" => Some("acct_alice"),
        "Bearer sk_test_bob" => Some("acct_bob"),
        _ => None,
    }
}

/// See [`the_original_is_the_copy_that_made_the_resource_wherever_it_stands`].
fn last_copy_wins() -> Router {
    #[derive(Debug, Default)]
    struct KeyState {
        arrivals: usize,
        claimed: bool,
        /// Copies told 409 while the winner ran.
        refused: usize,
        /// Every outcome but a 5xx, stored and replayed by key alone.
        stored: Option<(StatusCode, Value)>,
    }

    #[derive(Debug, Clone, Default)]
    struct LastWins {
        payments: Payments,
        keys: Arc<Mutex<HashMap<Vec<u8>, KeyState>>>,
        /// Woken whenever a key's state changes.
        changed: Arc<tokio::sync::Notify>,
    }

    impl LastWins {
        fn state<T>(&self, key: &[u8], f: impl FnOnce(&mut KeyState) -> T) -> T {
            let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
            f(keys.entry(key.to_vec()).or_default())
        }

        /// The handler proper, behind the key logic: authentication comes only here.
        fn work(&self, headers: &HeaderMap, body: &[u8]) -> (StatusCode, Value) {
            if account_of(headers).is_none() {
                return (
                    StatusCode::UNAUTHORIZED,
                    serde_json::json!({"error": "unknown token"}),
                );
            }
            if body == FAILING_BODY.as_bytes() {
                return (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    serde_json::json!({"error": "provider failed"}),
                );
            }
            self.payments.create(body)
        }
    }

    fn in_progress() -> Response {
        (
            StatusCode::CONFLICT,
            axum::Json(serde_json::json!({"error": "a request with this key is in progress"})),
        )
            .into_response()
    }

    async fn create(State(api): State<LastWins>, headers: HeaderMap, body: Bytes) -> Response {
        let Some(key) = headers
            .get("idempotency-key")
            .map(|k| k.as_bytes().to_vec())
        else {
            let (status, value) = api.work(&headers, &body);
            return (status, axum::Json(value)).into_response();
        };
        enum Seen {
            Stored(StatusCode, Value),
            Claimed,
            Arrival(usize),
        }
        let seen = api.state(&key, |s| match (&s.stored, s.claimed) {
            (Some((status, value)), _) => Seen::Stored(*status, value.clone()),
            (None, true) => Seen::Claimed,
            (None, false) => {
                s.arrivals += 1;
                Seen::Arrival(s.arrivals)
            }
        });
        let me = match seen {
            Seen::Stored(status, value) => return (status, axum::Json(value)).into_response(),
            Seen::Claimed => return in_progress(),
            Seen::Arrival(n) => n,
        };
        if me < COPIES {
            // An early copy waits for the round's last copy to claim the key, then is
            // refused; alone (no copy follows within the bound) it runs itself.
            let deadline = tokio::time::Instant::now() + Duration::from_millis(300);
            loop {
                let changed = api.changed.notified();
                let claimed = api.state(&key, |s| {
                    if s.claimed {
                        s.refused += 1;
                    }
                    s.claimed
                });
                if claimed {
                    api.changed.notify_waiters();
                    return in_progress();
                }
                if tokio::time::timeout_at(deadline, changed).await.is_err() {
                    break;
                }
            }
        }
        let claimed_now = api.state(&key, |s| !std::mem::replace(&mut s.claimed, true));
        if !claimed_now {
            return in_progress();
        }
        api.changed.notify_waiters();
        // The earlier copies are refused before the work ends, so none of them replays.
        let earlier = me - 1;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        loop {
            let changed = api.changed.notified();
            if api.state(&key, |s| s.refused >= earlier) {
                break;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                break;
            }
        }
        let (status, value) = api.work(&headers, &body);
        if !status.is_server_error() {
            api.state(&key, |s| s.stored = Some((status, value.clone())));
        }
        (status, axum::Json(value)).into_response()
    }

    Router::new()
        .route("/payments", post(create))
        .route(
            "/payments/{id}",
            get(
                |State(api): State<LastWins>, Path(id): Path<String>| async move {
                    api.payments.show(&id)
                },
            ),
        )
        .with_state(LastWins::default())
}

/// Check, then a provider call, then record the key: copies that arrive during the call all
/// find no record and all pay.
fn racy() -> Router {
    async fn create(State(api): State<KeyOnly>, headers: HeaderMap, body: Bytes) -> Response {
        let key = headers
            .get("idempotency-key")
            .map(|k| k.as_bytes().to_vec());
        if let Some(key) = &key {
            let seen = api.seen.lock().await;
            if let Some(payment) = seen.get(key) {
                return replayed(payment);
            }
        }
        // The provider call: a real API's race window.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (status, payment) = api.payments.create(&body);
        if let Some(key) = key {
            api.seen.lock().await.insert(key, payment.clone());
        }
        (status, axum::Json(payment)).into_response()
    }

    Router::new()
        .route("/payments", post(create))
        .with_state(KeyOnly::default())
}

/// Serves `router` on 127.0.0.1:0 for the rest of the test; returns its POST URL.
async fn serve_fixture(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/payments", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}
