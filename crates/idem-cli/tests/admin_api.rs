//! The admin API of `idem serve` and `idem proxy` (`--admin-token`): absent without the flag,
//! 401 without the token or with a wrong one, and, with it, keys of unknown outcome (a killed
//! `idem serve` on SQLite) and keys a killed `idem proxy` left in progress (Redis) listed,
//! shown and resolved over HTTP, then retried through the running server; and each key's
//! history, kept by the store, holding what `idem keys`, the console and the reconciler did.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{ALICE, RedisPrefix, TestServer, idem_output, send, start_psp};
use crate::keys_resolve::{
    left_in_progress, proxy, retries_replay_and_rerun, serve, start_silent_upstream, strand_orders,
};
use crate::payouts::payout;

const TOKEN: &str = "admin-token-for-the-tests-0001";

fn admin(method: reqwest::Method, url: &str, token: Option<&str>) -> reqwest::RequestBuilder {
    let request = reqwest::Client::new()
        .request(method, url)
        .timeout(Duration::from_secs(30));
    match token {
        Some(token) => request.bearer_auth(token),
        None => request,
    }
}

async fn json_of(request: reqwest::RequestBuilder) -> (u16, String, Value) {
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, content_type, body)
}

#[tokio::test]
async fn the_admin_api_is_absent_without_a_token_and_refuses_a_wrong_one() {
    let without = TestServer::start().await;
    // A path like any other the server does not have: 404 to a caller it knows.
    let (status, _, _) = json_of(admin(
        reqwest::Method::GET,
        &format!("{}/admin/keys", without.url),
        Some(ALICE),
    ))
    .await;
    assert_eq!(status, 404, "no admin API without --admin-token");
    without.stop().await;

    let token = idem_cli::admin::parse_admin_token(TOKEN).unwrap();
    let server = TestServer::start_with(|config| config.admin_token = Some(token)).await;
    let keys = format!("{}/admin/keys", server.url);
    let resolve = format!("{}/admin/keys/acct_alice/some-key-0001/resolve", server.url);
    for (request, what) in [
        (
            admin(reqwest::Method::GET, &keys, Some(ALICE)),
            "an API token",
        ),
        (admin(reqwest::Method::GET, &keys, None), "no token"),
        (
            admin(
                reqwest::Method::GET,
                &keys,
                Some("admin-token-for-the-tests-0002"),
            ),
            "a wrong token",
        ),
        (
            admin(reqwest::Method::GET, &keys, Some("admin")),
            "a short wrong token",
        ),
        (
            admin(reqwest::Method::POST, &resolve, Some("wrong")).json(&json!({"release": true})),
            "a wrong token on a resolution",
        ),
    ] {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 401, "{what}");
        assert_eq!(response.headers()["www-authenticate"], "Bearer", "{what}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{what}"
        );
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["status"], 401, "{what}");
    }
    let (status, _, listed) = json_of(admin(reqwest::Method::GET, &keys, Some(TOKEN))).await;
    assert_eq!((status, listed), (200, json!({"keys": []})));
    let (status, content_type, _) = json_of(admin(
        reqwest::Method::GET,
        &format!("{keys}?state=stale"),
        Some(TOKEN),
    ))
    .await;
    assert_eq!(
        (status, content_type.as_str()),
        (400, "application/problem+json")
    );
    let (status, _, problem) = json_of(
        admin(reqwest::Method::POST, &resolve, Some(TOKEN)).json(&json!({"release": true})),
    )
    .await;
    assert_eq!(status, 404, "{problem}");
    let (status, _, problem) = json_of(
        admin(reqwest::Method::POST, &resolve, Some(TOKEN))
            .json(&json!({"release": true, "status": 201})),
    )
    .await;
    assert_eq!(status, 400, "a release or an answer, not both: {problem}");
    for answer in [
        json!({"status": 99}),
        json!({"status": 201, "headers": {"bad name": "v"}}),
    ] {
        let (status, content_type, problem) =
            json_of(admin(reqwest::Method::POST, &resolve, Some(TOKEN)).json(&answer)).await;
        assert_eq!(status, 422, "{answer} is no answer to store: {problem}");
        assert_eq!(content_type, "application/problem+json");
    }
    // The public API is as it was.
    assert_eq!(send(server.get("/healthz")).await.status, 200);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_admin_api_resolves_unknown_outcomes_that_the_running_serve_then_replays() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let (psp, psp_url) = start_psp().await;
    // The server's own reconciler would ask the provider about them: its questions wait
    // there, so that the operator is the one who resolves.
    psp.hold_lookups();
    left_in_progress(&db, &psp_url, "1", "before-provider", "api-never-sent-1").await;
    left_in_progress(&db, &psp_url, "1", "after-provider", "api-charged-0001").await;
    let served = serve(&db, &psp_url, "1", &["--admin-token", TOKEN]);
    tokio::time::timeout(Duration::from_secs(20), psp.lookups_arrived(1))
        .await
        .expect("the reconciler found an unknown outcome");

    let keys = format!("{}/admin/keys", served.url);
    let deadline = Instant::now() + Duration::from_secs(20);
    let unknown = loop {
        let (status, _, listed) = json_of(admin(
            reqwest::Method::GET,
            &format!("{keys}?state=unknown"),
            Some(TOKEN),
        ))
        .await;
        assert_eq!(status, 200, "{listed}");
        // Both leases run out within a second of each other.
        if listed["keys"].as_array().unwrap().len() == 2 || Instant::now() > deadline {
            break listed;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let listed = unknown["keys"].as_array().unwrap();
    assert_eq!(listed.len(), 2, "{unknown}");
    assert!(
        listed
            .iter()
            .all(|k| k["state"] == "unknown" && k["account"] == "acct_alice"),
        "{unknown}"
    );
    let (_, _, completed) = json_of(admin(
        reqwest::Method::GET,
        &format!("{keys}?state=completed&account=acct_alice"),
        Some(TOKEN),
    ))
    .await;
    assert_eq!(completed, json!({"keys": []}));
    let before = send(payout(&served.url, "api-charged-0001")).await;
    assert_eq!(
        before.status, 409,
        "unknown until resolved: {}",
        before.body
    );

    let charged = format!("{keys}/acct_alice/api-charged-0001");
    let answer =
        json!({"status": 201, "headers": {"X-Resolved-By": "api"}, "body": {"id": "po_by_api"}});
    let (status, _, resolved) = json_of(
        admin(
            reqwest::Method::POST,
            &format!("{charged}/resolve"),
            Some(TOKEN),
        )
        .json(&answer),
    )
    .await;
    assert_eq!((status, resolved), (200, json!({"resolved": "completed"})));
    let (status, _, problem) = json_of(
        admin(
            reqwest::Method::POST,
            &format!("{charged}/resolve"),
            Some(TOKEN),
        )
        .json(&json!({"release": true})),
    )
    .await;
    assert_eq!(status, 409, "a completed key is not released: {problem}");
    let (status, _, shown) = json_of(admin(reqwest::Method::GET, &charged, Some(TOKEN))).await;
    assert_eq!(status, 200);
    assert_eq!(shown["state"], "completed", "{shown}");
    assert_eq!(shown["response"]["status"], 201, "{shown}");
    assert_eq!(
        shown["response"]["body"], r#"{"id":"po_by_api"}"#,
        "{shown}"
    );
    let released = format!("{keys}/acct_alice/api-never-sent-1/resolve");
    let (status, _, resolved) = json_of(
        admin(reqwest::Method::POST, &released, Some(TOKEN)).json(&json!({"release": true})),
    )
    .await;
    assert_eq!((status, resolved), (200, json!({"resolved": "released"})));

    // The clients' retries through the same running server.
    let replayed = send(payout(&served.url, "api-charged-0001")).await;
    assert_eq!(replayed.status, 201, "{}", replayed.body);
    assert!(replayed.replayed());
    assert_eq!(replayed.body["id"], "po_by_api");
    assert_eq!(replayed.headers["x-resolved-by"], "api");
    let fresh = send(payout(&served.url, "api-never-sent-1")).await;
    assert_eq!(fresh.status, 201, "{}", fresh.body);
    assert!(!fresh.replayed());
    psp.release_lookups();
    assert_eq!(psp.charges().await, 2, "one charge for each payout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_proxys_admin_api_resolves_keys_a_killed_proxy_left_on_redis() {
    let prefix = RedisPrefix::new("admin-api");
    let dir = tempfile::tempdir().unwrap();
    let (upstream, mut arrivals) = start_silent_upstream().await;
    let first = proxy(dir.path(), &upstream, &prefix.0, &[]);
    // Without --admin-token, /admin is the upstream's path like any other.
    let (status, _, _) = json_of(admin(
        reqwest::Method::GET,
        &format!("{}/admin/keys", first.url),
        Some(TOKEN),
    ))
    .await;
    assert_eq!(status, 404, "the upstream's own 404");
    strand_orders(
        first,
        &["api-order-resolved", "api-order-released"],
        &mut arrivals,
    )
    .await;

    let second = proxy(dir.path(), &upstream, &prefix.0, &["--admin-token", TOKEN]);
    let keys = format!("{}/admin/keys", second.url);
    let (status, _, _) = json_of(admin(
        reqwest::Method::GET,
        &keys,
        Some("wrong-token-of-some-length"),
    ))
    .await;
    assert_eq!(status, 401);
    let (status, _, listed) = json_of(admin(
        reqwest::Method::GET,
        &format!("{keys}?state=in-progress"),
        Some(TOKEN),
    ))
    .await;
    assert_eq!(status, 200, "{listed}");
    let listed = listed["keys"].as_array().unwrap().clone();
    assert_eq!(listed.len(), 2, "{listed:?}");
    let account = listed[0]["account"].as_str().unwrap().to_owned();
    assert!(account.starts_with("hmac:"), "{account}");

    let key_url = |key: &str| format!("{keys}/{account}/{key}");
    let (status, _, shown) = json_of(admin(
        reqwest::Method::GET,
        &key_url("api-order-resolved"),
        Some(TOKEN),
    ))
    .await;
    assert_eq!(
        (status, &shown["state"]),
        (200, &json!("in_progress")),
        "{shown}"
    );
    let answer = json!({"status": 201, "body": {"id": "order-by-api"}});
    let (status, _, resolved) = json_of(
        admin(
            reqwest::Method::POST,
            &format!("{}/resolve", key_url("api-order-resolved")),
            Some(TOKEN),
        )
        .json(&answer),
    )
    .await;
    assert_eq!((status, resolved), (200, json!({"resolved": "completed"})));
    let (status, _, resolved) = json_of(
        admin(
            reqwest::Method::POST,
            &format!("{}/resolve", key_url("api-order-released")),
            Some(TOKEN),
        )
        .json(&json!({"release": true})),
    )
    .await;
    assert_eq!((status, resolved), (200, json!({"resolved": "released"})));

    // The retries through the running proxy.
    let resolved = ("api-order-resolved", r#"{"id":"order-by-api"}"#);
    retries_replay_and_rerun(&second.url, resolved, "api-order-released", &mut arrivals).await;
}

/// `GET /admin/keys/{account}/{key}` until its `events` are `count` long (the body then), within
/// 30 s.
async fn events_until(url: &str, count: usize) -> (u16, Value) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, _, shown) = json_of(admin(reqwest::Method::GET, url, Some(TOKEN))).await;
        let seen = shown["events"].as_array().map_or(0, Vec::len);
        if seen >= count || Instant::now() > deadline {
            return (status, shown);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The `what` and `by` of each event of a shown key, and that each has a time.
fn whats_and_bys(shown: &Value) -> Vec<(String, String)> {
    let events = shown["events"].as_array().expect("a key's events");
    events
        .iter()
        .map(|event| {
            assert!(event["at_ms"].as_i64().is_some_and(|at| at > 0), "{event}");
            (
                event["what"].as_str().unwrap().to_owned(),
                event["by"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// A key's history is the store's, across processes: a key resolved by `idem keys` (another
/// process, while the server runs) shows in the running server's admin API by `idem keys
/// (CLI)`; a release through the API by the console (`"by"`) keeps its history once the record
/// is gone, and `idem keys show` prints both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_keys_history_holds_resolutions_made_by_any_process() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let (psp, psp_url) = start_psp().await;
    // The server's reconciler waits at the provider: the operators resolve.
    psp.hold_lookups();
    left_in_progress(&db, &psp_url, "1", "after-provider", "history-by-cli-01").await;
    left_in_progress(&db, &psp_url, "1", "before-provider", "history-by-console").await;
    let served = serve(&db, &psp_url, "1", &["--admin-token", TOKEN]);
    let keys = format!("{}/admin/keys/acct_alice", served.url);
    let (status, shown) = events_until(&format!("{keys}/history-by-cli-01"), 0).await;
    assert_eq!(status, 200, "{shown}");
    assert_eq!(shown["events"], json!([]), "no history yet: {shown}");

    let database = format!("sqlite://{}", db.display());
    let cli =
        |args: &[&str]| idem_output("keys", &[&["--database", database.as_str()], args].concat());
    let (code, stdout, stderr) = cli(&[
        "resolve",
        "acct_alice",
        "history-by-cli-01",
        "--status",
        "201",
        "--body",
        r#"{"id": "po_by_cli"}"#,
    ]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    let (status, shown) = events_until(&format!("{keys}/history-by-cli-01"), 1).await;
    assert_eq!(
        (status, &shown["state"]),
        (200, &json!("completed")),
        "{shown}"
    );
    assert_eq!(
        whats_and_bys(&shown),
        [(
            "resolved: completed with status 201".to_owned(),
            "idem keys (CLI)".to_owned()
        )],
        "{shown}"
    );

    let console = format!("{keys}/history-by-console");
    for by in [json!("a\nb"), json!(""), json!("x".repeat(65)), json!(7)] {
        let (status, _, problem) = json_of(
            admin(
                reqwest::Method::POST,
                &format!("{console}/resolve"),
                Some(TOKEN),
            )
            .json(&json!({"release": true, "by": by})),
        )
        .await;
        assert_eq!(status, 400, "by {by}: {problem}");
    }
    let (status, _, resolved) = json_of(
        admin(
            reqwest::Method::POST,
            &format!("{console}/resolve"),
            Some(TOKEN),
        )
        .json(&json!({"release": true, "by": "console"})),
    )
    .await;
    assert_eq!((status, resolved), (200, json!({"resolved": "released"})));
    let (status, shown) = events_until(&console, 1).await;
    assert_eq!(status, 404, "the record is gone: {shown}");
    assert_eq!(
        whats_and_bys(&shown),
        [("resolved: released".to_owned(), "console".to_owned())],
        "its history is not: {shown}"
    );

    let (code, stdout, _) = cli(&["show", "acct_alice", "history-by-cli-01"]);
    assert_eq!(code, Some(0));
    assert!(
        stdout.contains("resolved: completed with status 201, by idem keys (CLI)"),
        "{stdout}"
    );
    let (code, stdout, stderr) = cli(&["show", "acct_alice", "history-by-console"]);
    assert_eq!(code, Some(1), "no record: {stderr}");
    assert!(
        stdout.contains("resolved: released, by console"),
        "{stdout}"
    );
    // A purge deletes the history with the record.
    let (code, _, stderr) = cli(&["purge", "acct_alice", "history-by-cli-01"]);
    assert_eq!(code, Some(0), "{stderr}");
    let (status, shown) = events_until(&format!("{keys}/history-by-cli-01"), 0).await;
    assert_eq!((status, &shown["events"]), (404, &json!([])), "{shown}");
    psp.release_lookups();
}

/// The payout reconciler's work is in the key's history, by `reconciler`: a payout the provider
/// charged before its server died is completed, one it never saw is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reconciled_payout_shows_in_its_keys_history() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let (_psp, psp_url) = start_psp().await;
    left_in_progress(&db, &psp_url, "1", "after-provider", "history-charged-1").await;
    left_in_progress(&db, &psp_url, "1", "before-provider", "history-never-sent").await;
    // A new server's reconciler asks the provider once the leases have run out.
    let served = serve(&db, &psp_url, "1", &["--admin-token", TOKEN]);
    let keys = format!("{}/admin/keys/acct_alice", served.url);
    let (status, shown) = events_until(&format!("{keys}/history-charged-1"), 1).await;
    assert_eq!(
        (status, &shown["state"]),
        (200, &json!("completed")),
        "{shown}"
    );
    assert_eq!(
        whats_and_bys(&shown),
        [(
            "reconciled: completed with status 201".to_owned(),
            "reconciler".to_owned()
        )],
        "{shown}"
    );
    let (status, shown) = events_until(&format!("{keys}/history-never-sent"), 1).await;
    assert_eq!(status, 404, "released: {shown}");
    assert_eq!(
        whats_and_bys(&shown),
        [("reconciled: released".to_owned(), "reconciler".to_owned())],
        "{shown}"
    );
}
