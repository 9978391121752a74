//! docs/contract.md §2, row by row, against a real `idem serve`: each test sends the request and checks
//! the status, the body and what the database holds afterwards.

use std::time::Duration;

use crate::common::{ALICE, BOB, TestServer, assert_healthy, keyed, metrics, send};

const BODY: &str = r#"{"amount": 49900, "currency": "INR"}"#;

#[tokio::test]
async fn uncovered_methods_pass_through_untouched_key_or_not() {
    let server = TestServer::start().await;
    let created = send(server.post(ALICE, Some("passthrough-key-1"), BODY)).await;
    assert_eq!(created.status, 201);

    let path = format!("/payments/{}", created.id());
    for key in [None, Some("passthrough-key-1"), Some("bad key")] {
        let answer = send(keyed(server.get(&path).bearer_auth(ALICE), key)).await;
        assert_eq!(answer.status, 200, "GET with key {key:?}");
        assert!(!answer.replayed());
        assert_eq!(answer.body["id"], created.body["id"]);
    }
    // PUT and DELETE reach the router (which has no such route), not the layer's 400.
    for method in [reqwest::Method::PUT, reqwest::Method::DELETE] {
        let answer = send(
            server
                .request(method.clone(), "/payments")
                .bearer_auth(ALICE),
        )
        .await;
        assert_eq!(answer.status, 405, "{method}");
    }
    assert_eq!(server.keys().await, 1);
    server.stop().await;
}

#[tokio::test]
async fn a_method_the_route_does_not_have_is_405_before_any_key_rule() {
    let server = TestServer::start().await;
    // PATCH is a covered method, so only the routing decides: no key, a malformed key and a
    // valid key all get the route's 405 and its Allow, never a 400.
    let routes = [
        ("/payments", "POST,GET,HEAD"),
        ("/payments/pay_1", "GET,HEAD"),
        ("/invoices", "POST"),
        ("/payouts", "POST"),
    ];
    for (path, allow) in routes {
        for key in [None, Some("bad key"), Some("patch-key-00001")] {
            let patch = server
                .request(reqwest::Method::PATCH, path)
                .bearer_auth(ALICE)
                .header("content-type", "application/json")
                .body(BODY);
            let answer = send(keyed(patch, key)).await;
            assert_eq!(answer.status, 405, "PATCH {path} with key {key:?}");
            assert_eq!(answer.headers["allow"], allow, "PATCH {path}");
        }
    }
    assert_eq!(server.keys().await, 0, "nothing was claimed");
    server.stop().await;
}

/// Sends one `POST /payments` with `key` and `body`: it is refused with `status` and the
/// problem `kind`, and nothing is stored.
async fn assert_refused_unstored(key: Option<&str>, body: &str, status: u16, kind: &str) {
    let server = TestServer::start().await;
    let answer = send(server.post(ALICE, key, body)).await;
    assert_eq!(answer.status, status);
    assert_eq!(answer.problem_type(), format!("urn:idem:problem:{kind}"));
    assert_eq!(answer.body["status"], status);
    assert_eq!((server.keys().await, server.payments().await), (0, 0));
    server.stop().await;
}

#[tokio::test]
async fn a_missing_key_is_400_and_nothing_is_stored() {
    assert_refused_unstored(None, BODY, 400, "missing-key").await;
}

/// idem's own refusals point at the published rules (`Link: …; rel="describedby"`); the
/// service's own answers (a validation 400, a 201, its replay) do not.
#[tokio::test]
async fn idem_refusals_link_the_published_rules_and_nothing_else_does() {
    let server = TestServer::start().await;
    let link = |answer: &crate::common::Answer| {
        answer
            .headers
            .get("link")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let expected = Some(r#"</idempotency-policy>; rel="describedby""#.to_owned());
    let missing = send(server.post(ALICE, None, BODY)).await;
    assert_eq!((missing.status, link(&missing)), (400, expected.clone()));
    let malformed = send(server.post(ALICE, Some("short"), BODY)).await;
    assert_eq!(
        (malformed.status, link(&malformed)),
        (400, expected.clone())
    );
    let invalid = send(server.post(ALICE, Some("link-key-0001"), r#"{"amount": -5}"#)).await;
    assert_eq!(
        (invalid.status, link(&invalid)),
        (400, None),
        "the service's own 400"
    );
    let created = send(server.post(ALICE, Some("link-key-0002"), BODY)).await;
    let replayed = send(server.post(ALICE, Some("link-key-0002"), BODY)).await;
    assert_eq!((created.status, link(&created)), (201, None));
    assert_eq!((replayed.status, link(&replayed)), (201, None));
    assert!(replayed.replayed());
    let other = r#"{"amount": 1, "currency": "EUR"}"#;
    let mismatch = send(server.post(ALICE, Some("link-key-0002"), other)).await;
    assert_eq!((mismatch.status, link(&mismatch)), (422, expected));
    server.stop().await;
}

#[tokio::test]
async fn malformed_keys_are_400_and_nothing_is_stored() {
    let server = TestServer::start().await;
    let long = "k".repeat(256);
    let cases: Vec<(&str, Vec<&[u8]>)> = vec![
        ("empty", vec![b""]),
        ("too short", vec![b"short"]),
        ("too long", vec![long.as_bytes()]),
        ("a space", vec![b"has a space"]),
        ("obs-text", vec![b"abcdefgh\xe9"]),
        ("a comma-joined list", vec![b"key-aaaaaaaa, key-bbbbbbbb"]),
        ("parameters", vec![b"\"key-aaaaaaaa\";v=1"]),
        ("an unterminated sf-string", vec![b"\"key-aaaaaaaa"]),
        ("two fields", vec![b"key-aaaaaaaa", b"key-aaaaaaaa"]),
    ];
    for (what, values) in cases {
        let mut req = server.post(ALICE, None, BODY);
        for value in values {
            req = req.header(
                "idempotency-key",
                reqwest::header::HeaderValue::from_bytes(value).unwrap(),
            );
        }
        let answer = send(req).await;
        assert_eq!(answer.status, 400, "{what}");
        assert_eq!(
            answer.problem_type(),
            "urn:idem:problem:malformed-key",
            "{what}"
        );
    }
    assert_eq!((server.keys().await, server.payments().await), (0, 0));
    server.stop().await;
}

#[tokio::test]
async fn a_retry_replays_status_body_and_headers_without_doing_the_work_again() {
    let server = TestServer::start().await;
    let first = send(server.post(ALICE, Some("replay-key-0001"), BODY)).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    let location = first.headers.get("location").unwrap().clone();

    server.clock.advance(Duration::from_secs(3600));
    let again = send(server.post(ALICE, Some("replay-key-0001"), BODY)).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.raw, first.raw, "the stored body, byte for byte");
    assert_eq!(again.headers.get("location"), Some(&location));
    assert_eq!(
        again.headers.get("content-type").unwrap(),
        "application/json"
    );
    assert_eq!(server.payments().await, 1);
    server.stop().await;
}

/// Sends `first`, then `again` (each a key and a body): `again` is the same request, a `201`
/// that replays the first's payment, and the database holds that one payment.
async fn assert_same_request(first: (&str, &str), again: (&str, &str)) {
    let server = TestServer::start().await;
    let first = send(server.post(ALICE, Some(first.0), first.1)).await;
    let again = send(server.post(ALICE, Some(again.0), again.1)).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.id(), first.id());
    assert_eq!(server.payments().await, 1);
    server.stop().await;
}

#[tokio::test]
async fn the_sf_string_and_bare_forms_name_the_same_key() {
    assert_same_request(("form-key-0001", BODY), ("\"form-key-0001\"", BODY)).await;
}

#[tokio::test]
async fn a_reordered_json_body_is_the_same_request() {
    let reordered = "{\n  \"currency\":\"INR\",\n  \"amount\":49900\n}";
    assert_same_request(("reorder-key-001", BODY), ("reorder-key-001", reordered)).await;
}

#[tokio::test]
async fn a_changed_body_is_422_and_the_stored_record_is_untouched() {
    let server = TestServer::start().await;
    let first = send(server.post(ALICE, Some("mismatch-key-01"), BODY)).await;
    let changed = send(server.post(
        ALICE,
        Some("mismatch-key-01"),
        r#"{"amount": 49901, "currency": "INR"}"#,
    ))
    .await;
    assert_eq!(changed.status, 422);
    assert_eq!(changed.problem_type(), "urn:idem:problem:mismatch");
    // The original still replays, and no second payment exists.
    let again = send(server.post(ALICE, Some("mismatch-key-01"), BODY)).await;
    assert!(again.replayed());
    assert_eq!(again.id(), first.id());
    assert_eq!(server.payments().await, 1);
    let amount: i64 = server.count("SELECT amount FROM payments").await;
    assert_eq!(amount, 49900);
    server.stop().await;
}

#[tokio::test]
async fn numbers_are_compared_as_written() {
    let server = TestServer::start().await;
    send(server.post(
        ALICE,
        Some("numbers-key-001"),
        r#"{"amount": 1, "currency": "INR"}"#,
    ))
    .await;
    let as_float = send(server.post(
        ALICE,
        Some("numbers-key-001"),
        r#"{"amount": 1.0, "currency": "INR"}"#,
    ))
    .await;
    assert_eq!(as_float.status, 422, "1 and 1.0 are different requests");
    server.stop().await;
}

#[tokio::test]
async fn the_same_key_from_another_account_is_an_unrelated_request() {
    let server = TestServer::start().await;
    let alice = send(server.post(ALICE, Some("shared-key-0001"), BODY)).await;
    let bob = send(server.post(BOB, Some("shared-key-0001"), BODY)).await;
    assert_eq!((alice.status, bob.status), (201, 201));
    assert!(!bob.replayed());
    assert_ne!(alice.id(), bob.id());
    assert_eq!(server.payments().await, 2);
    server.stop().await;
}

#[tokio::test]
async fn another_account_cannot_read_a_payment() {
    let server = TestServer::start().await;
    let alice = send(server.post(ALICE, Some("private-key-001"), BODY)).await;
    let path = format!("/payments/{}", alice.id());
    let by_bob = send(server.get(&path).bearer_auth(BOB)).await;
    assert_eq!(by_bob.status, 404);
    assert_eq!(by_bob.problem_type(), "urn:idem:problem:not-found");
    let by_alice = send(server.get(&path).bearer_auth(ALICE)).await;
    assert_eq!(by_alice.status, 200);
    assert_eq!(by_alice.body["amount"], 49900);

    let bobs_list = send(server.get("/payments").bearer_auth(BOB)).await;
    assert_eq!(bobs_list.body["data"].as_array().unwrap().len(), 0);
    let alices_list = send(server.get("/payments").bearer_auth(ALICE)).await;
    assert_eq!(alices_list.body["data"][0]["id"], alice.id());
    let anonymous = send(server.get(&path)).await;
    assert_eq!(anonymous.status, 401);
    server.stop().await;
}

#[tokio::test]
async fn a_key_past_its_retention_is_new() {
    let server = TestServer::start().await;
    let first = send(server.post(ALICE, Some("retention-key-1"), BODY)).await;
    server.clock.advance(Duration::from_secs(24 * 3600 - 1));
    let within = send(server.post(ALICE, Some("retention-key-1"), BODY)).await;
    assert!(within.replayed());
    server.clock.advance(Duration::from_secs(1));
    let after = send(server.post(ALICE, Some("retention-key-1"), BODY)).await;
    assert_eq!(after.status, 201);
    assert!(!after.replayed());
    assert_ne!(after.id(), first.id());
    assert_eq!(server.payments().await, 2);
    // The new payment holds the key; the old one keeps it as retired.
    let retired = "SELECT COUNT(*) FROM payments WHERE retired_idem_key = 'retention-key-1'";
    assert_eq!(server.count(retired).await, 1);
    server.stop().await;
}

/// The same on PostgreSQL, whose payment insert takes another path (one statement when the key
/// is free, the retirement only when a payment holds it). PostgreSQL judges the key's
/// retention by its own clock (docs/contract.md §12), which only real time moves: the retention
/// is half a second, waited out by retrying to a deadline (each try before it replays), and
/// the service's clock, which dates the payments, is moved past it too.
#[tokio::test]
async fn a_key_past_its_retention_is_new_on_postgres() {
    let database = idem_testkit::postgres::PgTestDatabase::create().await;
    let url = database.url().to_owned();
    let retention = Duration::from_millis(500);
    let server = TestServer::start_with(|c| {
        c.database = url;
        c.policy.retention = retention;
    })
    .await;
    let first = send(server.post(ALICE, Some("retention-key-1"), BODY)).await;
    assert_eq!(first.status, 201);
    server.clock.advance(retention);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let after = loop {
        let again = send(server.post(ALICE, Some("retention-key-1"), BODY)).await;
        assert_eq!(again.status, 201, "{}", again.body);
        if !again.replayed() {
            break again;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the retention never ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_ne!(after.id(), first.id());
    let pool = database.pool(1).await;
    let holders: Vec<(String, Option<String>, Option<String>)> =
        sqlx::query_as("SELECT id, idem_key, retired_idem_key FROM payments ORDER BY created_at")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        holders,
        vec![
            (
                first.id().to_owned(),
                None,
                Some("retention-key-1".to_owned())
            ),
            (
                after.id().to_owned(),
                Some("retention-key-1".to_owned()),
                None
            ),
        ]
    );
    pool.close().await;
    server.stop().await;
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_before_any_work() {
    let big = format!(
        r#"{{"amount": 1, "currency": "INR", "note": "{}"}}"#,
        "x".repeat(2 * 1024 * 1024)
    );
    assert_refused_unstored(Some("big-body-key-01"), &big, 413, "body-too-large").await;
}

/// `key` sent again (with [`BODY`]) after a refusal that stored nothing: a fresh `201`, the
/// one payment in the database.
async fn assert_retry_pays(server: &TestServer, key: &str) {
    let retry = send(server.post(ALICE, Some(key), BODY)).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(server.payments().await, 1);
}

#[tokio::test]
async fn a_rejected_request_is_not_stored_so_the_fixed_request_succeeds_with_the_same_key() {
    let server = TestServer::start().await;
    for bad in [
        r#"{"amount": -5, "currency": "INR"}"#,
        r#"{"amount": 10.5, "currency": "INR"}"#,
        r#"{"amount": "10", "currency": "INR"}"#,
        r#"{"amount": 10, "currency": "inr"}"#,
        r#"{"amount": 10}"#,
    ] {
        let answer = send(server.post(ALICE, Some("fixable-key-001"), bad)).await;
        assert_eq!(answer.status, 400, "{bad}");
        assert_eq!(answer.problem_type(), "urn:idem:problem:validation");
    }
    assert_eq!((server.keys().await, server.payments().await), (0, 0));
    assert_retry_pays(&server, "fixable-key-001").await;
    server.stop().await;
}

#[tokio::test]
async fn duplicate_json_members_are_400_and_not_stored() {
    let duplicate = r#"{"amount": 1, "amount": 100000, "currency": "INR"}"#;
    assert_refused_unstored(Some("duplicate-key-01"), duplicate, 400, "malformed-body").await;
}

#[tokio::test]
async fn an_unreachable_store_is_503_with_retry_after_and_nothing_is_processed() {
    let server = TestServer::start().await;
    // Another process-like holder takes SQLite's write lock and keeps it past busy_timeout.
    let blocker = server.db().await;
    let mut lock = blocker.acquire().await.unwrap();
    sqlx::query("BEGIN EXCLUSIVE")
        .execute(&mut *lock)
        .await
        .unwrap();

    // Three requests at once, three keys: each waits on the locked database (one busy_timeout
    // after another at the single writer), never on another key, so each is a 503, the last
    // one too, though its wait outlasts the in-flight wait.
    let keys = ["outage-key-0001", "outage-key-0002", "outage-key-0003"];
    let answers =
        futures_util::future::join_all(keys.map(|key| send(server.post(ALICE, Some(key), BODY))))
            .await;
    for (key, answer) in keys.iter().zip(&answers) {
        assert_eq!(answer.status, 503, "{key}");
        assert_eq!(answer.problem_type(), "urn:idem:problem:store-unavailable");
        assert!(answer.headers.get("retry-after").is_some());
    }

    sqlx::query("ROLLBACK").execute(&mut *lock).await.unwrap();
    drop(lock);
    blocker.close().await;
    assert_eq!(
        server.payments().await,
        0,
        "never processed without its key record"
    );
    assert_retry_pays(&server, "outage-key-0001").await;
    server.stop().await;
}

#[tokio::test]
async fn the_published_rules_health_and_metrics() {
    let server = TestServer::start_with(|c| c.policy.retention = Duration::from_secs(3600)).await;
    let policy = send(server.get("/idempotency-policy")).await;
    assert_eq!(policy.status, 200);
    assert_eq!(policy.body["header"], "Idempotency-Key");
    assert_eq!(policy.body["retention_seconds"], 3600);
    assert_eq!(
        policy.body["covered_methods"],
        serde_json::json!(["POST", "PATCH"])
    );
    assert_eq!(policy.body["key_min_length"], 8);
    assert_eq!(policy.body["key_max_length"], 255);
    assert!(policy.body["scope"].as_str().unwrap().contains("account"));
    assert!(policy.body["mismatch"].as_str().unwrap().starts_with("422"));
    // Payouts' lease mode publishes its own rules: the claim holds the lease and the
    // provider timeout.
    let lease = &policy.body["lease_mode"];
    assert_eq!(lease["routes"], serde_json::json!(["POST /payouts"]));
    assert_eq!(lease["lease_seconds"], 30);
    assert_eq!(lease["downstream_timeout_seconds"], 10);
    assert_eq!(lease["claim_held_seconds"], 40);
    assert!(
        lease["unknown_outcome"]
            .as_str()
            .unwrap()
            .contains("outcome-unknown")
    );

    assert_healthy(&server.client, &server.url).await;

    send(server.post(ALICE, Some("metrics-key-001"), BODY)).await;
    send(server.post(ALICE, Some("metrics-key-001"), BODY)).await;
    let metrics = metrics(&server.client, &server.url).await;
    assert!(
        metrics.contains("idem_requests_total{outcome=\"fresh\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("idem_requests_total{outcome=\"replayed\"}"),
        "{metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn with_keys_optional_a_keyless_post_is_processed_every_time() {
    let server = TestServer::start_with(|c| c.policy.require_key = false).await;
    let a = send(server.post(ALICE, None, BODY)).await;
    let b = send(server.post(ALICE, None, BODY)).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert_ne!(a.id(), b.id(), "no key, no protection: two payments");
    let keyed = send(server.post(ALICE, Some("optional-key-01"), BODY)).await;
    let again = send(server.post(ALICE, Some("optional-key-01"), BODY)).await;
    assert!(again.replayed());
    assert_eq!(again.id(), keyed.id());
    assert_eq!(server.payments().await, 3);
    server.stop().await;
}
