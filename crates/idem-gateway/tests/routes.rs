//! Per-route rules from a configuration file (docs/contract.md §10), in front of a real
//! upstream that counts its calls per path, for each store.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::IntoResponse;
use idem_core::{ManualClock, Timestamp};
use idem_gateway::ConfigFile;
use idem_store::Store;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};

/// The upstream: answers every POST with a new number, remembers nothing. A request with
/// `x-gate` waits for a permit of `gate`.
#[derive(Clone)]
struct Upstream {
    calls: Arc<Mutex<HashMap<String, usize>>>,
    total: Arc<Mutex<usize>>,
    entered: Arc<Notify>,
    gate: Arc<Semaphore>,
}

impl Default for Upstream {
    fn default() -> Self {
        Self {
            calls: Arc::default(),
            total: Arc::default(),
            entered: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        }
    }
}

async fn answer(
    State(up): State<Upstream>,
    uri: Uri,
    headers: HeaderMap,
    _body: Bytes,
) -> impl IntoResponse {
    let n = {
        let mut total = up.total.lock().unwrap();
        *total += 1;
        *up.calls
            .lock()
            .unwrap()
            .entry(uri.path().to_owned())
            .or_default() += 1;
        *total
    };
    up.entered.notify_one();
    if headers.contains_key("x-gate") {
        up.gate.acquire().await.unwrap().forget();
    }
    (
        StatusCode::CREATED,
        [
            ("content-type", "application/json".to_owned()),
            ("request-id", format!("req_{n}")),
        ],
        format!(r#"{{"n":{n}}}"#),
    )
}

struct Gateway {
    url: String,
    upstream: Upstream,
    clock: ManualClock,
    client: reqwest::Client,
}

/// Starts the gateway over `store` with the routes of `toml` (whose top-level values are the
/// defaults).
async fn start<St: Store>(store: St, toml: &str) -> Gateway {
    let upstream = Upstream::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = listener.local_addr().unwrap();
    let app = Router::new().fallback(answer).with_state(upstream.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let file = ConfigFile::parse(toml).expect("a valid file");
    let clock = ManualClock::new(Timestamp(1_800_000_000_000));
    let mut config = common::config(upstream_addr);
    config.clock = Arc::new(clock.clone());
    config.apply_file(&file);
    Gateway {
        url: common::serve(store, config).await,
        upstream,
        clock,
        client: reqwest::Client::new(),
    }
}

impl Gateway {
    /// POSTs `body` to `path` as Alice, with `headers`.
    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
        let url = format!("{}{path}", self.url);
        send(common::json_post(&self.client, url, ALICE, headers, body)).await
    }

    fn calls(&self, path: &str) -> usize {
        self.upstream
            .calls
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .unwrap_or(0)
    }
}

const ALICE: &str = "Bearer sk_alice";

/// One key per path: a key names one request of an account, whatever its path, so the same
/// key on a second path would be a mismatch.
const KEY: (&str, &str) = ("idempotency-key", "route-key-0001");

fn key_for(path: &str) -> (&'static str, String) {
    ("idempotency-key", format!("key-for-{path}"))
}

impl Gateway {
    /// POSTs to `path` with the key of `path`, held at the upstream until a permit of
    /// the gate is added.
    async fn post_gated(&self, path: &str) -> Answer {
        let (name, key) = key_for(path);
        self.post(path, &[(name, &key), ("x-gate", "1")], "{}")
            .await
    }

    /// POSTs `body` to `path` with the key of `path`.
    async fn post_keyed(&self, path: &str, body: &str) -> Answer {
        let (name, key) = key_for(path);
        self.post(path, &[(name, &key)], body).await
    }
}

async fn key_required_optional_and_off<St: Store>(store: St) {
    let routes = r#"
[[route]]
match = "POST /required"
key = "required"
[[route]]
match = "POST /optional"
key = "optional"
[[route]]
match = "POST /search"
key = "off"
"#;
    let gw = start(store, routes).await;
    let missing = gw.post("/required", &[], "{}").await;
    missing.assert_refused(400, "missing-key");
    assert_eq!(gw.calls("/required"), 0);
    assert!(gw.post("/required", &[KEY], "{}").await.status == 201);
    assert!(gw.post("/required", &[KEY], "{}").await.replayed());
    assert_eq!(gw.calls("/required"), 1);

    for _ in 0..2 {
        assert_eq!(gw.post("/optional", &[], "{}").await.status, 201);
    }
    assert_eq!(gw.calls("/optional"), 2, "keyless requests pass through");

    // Off: the key means nothing and no body is read, not even one that is no JSON.
    for _ in 0..2 {
        let searched = gw.post("/search", &[KEY], "{not json").await;
        assert_eq!(searched.status, 201);
        assert!(!searched.replayed());
    }
    assert_eq!(gw.calls("/search"), 2);
}

async fn key_header_aliases_take_the_first_present<St: Store>(store: St) {
    let routes = r#"
[[route]]
match = "POST /v1/charges"
key_header = ["Idempotency-Key", "X-Idempotency-Key"]
"#;
    let gw = start(store, routes).await;
    let alias = ("x-idempotency-key", "alias-key-0001");
    assert_eq!(gw.post("/v1/charges", &[alias], "{}").await.status, 201);
    assert!(gw.post("/v1/charges", &[alias], "{}").await.replayed());
    assert!(
        gw.post(
            "/v1/charges",
            &[("idempotency-key", "alias-key-0001")],
            "{}"
        )
        .await
        .replayed(),
        "one key, whichever of the headers carries it"
    );
    let both = gw
        .post(
            "/v1/charges",
            &[alias, ("idempotency-key", "alias-key-0001")],
            "{}",
        )
        .await;
    both.assert_refused(400, "malformed-key");
    assert_eq!(gw.calls("/v1/charges"), 1);
}

async fn a_webhook_delivered_twice_reaches_the_upstream_once<St: Store>(store: St) {
    let routes = r#"
[[route]]
match = "POST /webhooks/github"
key_from = "header:X-GitHub-Delivery"
[[route]]
match = "POST /webhooks/stripe"
key_from = "body:/id"
"#;
    let gw = start(store, routes).await;
    let delivery = ("x-github-delivery", "72d3162e-cc78-11e3-81ab-dcbb1ef32bd5");
    let push = r#"{"ref":"refs/heads/main"}"#;
    let first = gw.post("/webhooks/github", &[delivery], push).await;
    let again = gw.post("/webhooks/github", &[delivery], push).await;
    assert_eq!(first.status, 201);
    again.assert_replays(&first);
    assert_eq!(gw.calls("/webhooks/github"), 1);

    let event = r#"{"id":"evt_1NfGk2","type":"charge.succeeded"}"#;
    let first = gw.post("/webhooks/stripe", &[], event).await;
    let again = gw.post("/webhooks/stripe", &[], event).await;
    assert_eq!(first.status, 201);
    again.assert_replays(&first);
    let no_id = gw.post("/webhooks/stripe", &[], r#"{"type":"x"}"#).await;
    no_id.assert_refused(400, "missing-key");
    assert_eq!(gw.calls("/webhooks/stripe"), 1);
}

async fn scope_headers_are_per_route<St: Store>(store: St) {
    let routes = r#"
scope_headers = ["Authorization"]
[[route]]
match = "POST /connect/charges"
scope_headers = ["Authorization", "Stripe-Account"]
"#;
    let gw = start(store, routes).await;
    for account in ["acct_1", "acct_2", "acct_1"] {
        for path in ["/connect/charges", "/charges"] {
            let (name, key) = key_for(path);
            gw.post(path, &[(name, &key), ("stripe-account", account)], "{}")
                .await;
        }
    }
    assert_eq!(gw.calls("/connect/charges"), 2, "one call per account");
    assert_eq!(
        gw.calls("/charges"),
        1,
        "the defaults scope by credential only"
    );
}

async fn ignored_and_only_members_leave_the_fingerprint<St: Store>(store: St) {
    let routes = r#"
[[route]]
match = "POST /ignore"
fingerprint = { ignore = ["/metadata/trace_id"] }
[[route]]
match = "POST /only"
fingerprint = { only = ["/amount"] }
"#;
    let gw = start(store, routes).await;
    for (path, first, same, changed) in [
        (
            "/ignore",
            r#"{"amount":1,"metadata":{"trace_id":"t1"}}"#,
            r#"{"amount":1,"metadata":{"trace_id":"t2"}}"#,
            r#"{"amount":2,"metadata":{"trace_id":"t1"}}"#,
        ),
        (
            "/only",
            r#"{"amount":1,"note":"a"}"#,
            r#"{"amount":1,"note":"b"}"#,
            r#"{"amount":2,"note":"a"}"#,
        ),
    ] {
        assert_eq!(gw.post_keyed(path, first).await.status, 201);
        let retry = gw.post_keyed(path, same).await;
        assert!(retry.replayed(), "{path}: {retry:?}");
        assert_eq!(gw.post_keyed(path, changed).await.status, 422, "{path}");
        assert_eq!(gw.calls(path), 1);
    }
}

/// A route's short retention ends while the default's holds. Expiry is the store's to judge
/// (docs/contract.md §12): on SQLite by the gateway's clock, moved here; on PostgreSQL and Redis
/// by their own, which only real time moves, so the short retention is half a second and the
/// test polls to a deadline until it has passed.
async fn retention_is_per_route<St: Store>(store: St) {
    let routes = r#"
retention = "1h"
[[route]]
match = "POST /short"
retention = "500ms"
"#;
    let gw = start(store, routes).await;
    for path in ["/short", "/long"] {
        gw.post_keyed(path, "{}").await;
    }
    gw.clock.advance(Duration::from_secs(120));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while gw.post_keyed("/short", "{}").await.replayed() {
        assert!(
            std::time::Instant::now() < deadline,
            "the short retention never ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gw.post_keyed("/long", "{}").await.replayed());
    assert_eq!((gw.calls("/short"), gw.calls("/long")), (2, 1));
}

async fn store_headers_are_per_route<St: Store>(store: St) {
    let routes = r#"
[[route]]
match = "POST /kept"
store_headers = ["Request-Id"]
"#;
    let gw = start(store, routes).await;
    let first = gw.post_keyed("/kept", "{}").await;
    let replay = gw.post_keyed("/kept", "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.headers["request-id"], first.headers["request-id"]);
    gw.post_keyed("/plain", "{}").await;
    let replay = gw.post_keyed("/plain", "{}").await;
    assert!(replay.replayed());
    assert!(!replay.headers.contains_key("request-id"));
}

/// `errors` per route, and a request no route matches gets the top-level rules.
async fn errors_per_route_and_unmatched_requests_get_the_defaults<St: Store>(store: St) {
    let routes = r#"
errors = "stripe"
[[route]]
match = "POST /v1/charges/{id}/capture"
errors = "problem"
key = "optional"
"#;
    let gw = start(store, routes).await;
    for path in ["/v1/charges/ch_1/capture", "/v1/refunds"] {
        gw.post_keyed(path, r#"{"a":1}"#).await;
        let refused = gw.post_keyed(path, r#"{"a":2}"#).await;
        assert_eq!(refused.status, 422);
        let body: serde_json::Value = serde_json::from_str(&refused.body).unwrap();
        let stripe = path == "/v1/refunds";
        assert_eq!(body.get("error").is_some(), stripe, "{path}: {body}");
    }
    // The route's key is optional; other paths keep the default, required.
    assert_eq!(
        gw.post("/v1/charges/ch_2/capture", &[], "{}").await.status,
        201
    );
    let missing = gw.post("/v1/charges/ch_2/refund", &[], "{}").await;
    missing.assert_refused(400, "missing-key");
}

async fn the_published_policy_lists_every_route<St: Store>(store: St) {
    let routes = r#"
[[route]]
match = "POST /v1/charges"
in_flight = "wait 10s"
fingerprint = { ignore = ["/metadata/trace_id"] }
[[route]]
match = "POST /search"
key = "off"
"#;
    let gw = start(store, routes).await;
    let policy: serde_json::Value = gw
        .client
        .get(format!("{}/.well-known/idempotency-policy", gw.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(policy["key_required"], true, "the defaults stay at the top");
    let routes = policy["routes"].as_array().unwrap();
    assert_eq!(routes.len(), 2);
    assert_eq!(routes[0]["match"], "POST /v1/charges");
    assert_eq!(routes[0]["in_flight"], "wait 10s");
    assert_eq!(routes[0]["fingerprint"]["ignore"][0], "/metadata/trace_id");
    assert_eq!(routes[0]["retention_seconds"], 86_400);
    assert_eq!(
        routes[1],
        serde_json::json!({"match": "POST /search", "key": "off"})
    );
}

/// `in_flight = "wait …"`: a duplicate of a running request waits and replays its outcome;
/// with `"409"` it is refused at once.
async fn in_flight_waits_or_refuses_per_route<St: Store>(store: St) {
    let routes = r#"
[[route]]
match = "POST /wait"
in_flight = "wait 10s"
[[route]]
match = "POST /refuse"
in_flight = "409"
"#;
    let gw = Arc::new(start(store, routes).await);
    for (path, waits) in [("/wait", true), ("/refuse", false)] {
        a_duplicate_of_a_held_request(&gw, path, waits).await;
    }
}

/// A top-level `in_flight` is the rule of every route that sets none, and of requests no
/// route matches; a route's own still wins.
async fn routes_inherit_the_top_level_wait<St: Store>(store: St) {
    let routes = r#"
in_flight = "wait 10s"
[[route]]
match = "POST /inherits"
[[route]]
match = "POST /refuse"
in_flight = "409"
"#;
    let gw = Arc::new(start(store, routes).await);
    for (path, waits) in [("/inherits", true), ("/refuse", false), ("/unrouted", true)] {
        a_duplicate_of_a_held_request(&gw, path, waits).await;
    }
}

/// Sends a request to `path` that the upstream holds, then its duplicate: one that `waits`
/// has no answer while the original is held and then replays its outcome; one that does not
/// is refused with `409` and `Retry-After` at once. The upstream is called once.
async fn a_duplicate_of_a_held_request(gw: &Arc<Gateway>, path: &'static str, waits: bool) {
    let entered = gw.upstream.entered.notified();
    let mut first = tokio::spawn({
        let gw = gw.clone();
        async move { gw.post_gated(path).await }
    });
    tokio::select! {
        () = entered => {}
        answer = &mut first => panic!("{path}: answered before reaching the upstream: {answer:?}"),
    }
    let mut duplicate = tokio::spawn({
        let gw = gw.clone();
        async move { gw.post_gated(path).await }
    });
    if waits {
        // Refused, it would have its 409 in milliseconds; waiting, it has no answer while
        // the original is held.
        let early = tokio::time::timeout(Duration::from_millis(300), &mut duplicate).await;
        assert!(early.is_err(), "{path}: the duplicate waits: {early:?}");
        gw.upstream.gate.add_permits(1);
        let first = first.await.unwrap();
        let waited = duplicate.await.unwrap();
        assert_eq!(first.status, 201, "{path}");
        waited.assert_replays(&first);
    } else {
        let refused = duplicate.await.unwrap();
        refused.assert_refused(409, "in-use");
        assert!(refused.headers.contains_key("retry-after"));
        gw.upstream.gate.add_permits(1);
        assert_eq!(first.await.unwrap().status, 201, "{path}");
    }
    assert_eq!(gw.calls(path), 1, "{path}");
}

use common::{Answer, send};

on_every_store!(
    key_required_optional_and_off,
    key_header_aliases_take_the_first_present,
    a_webhook_delivered_twice_reaches_the_upstream_once,
    scope_headers_are_per_route,
    ignored_and_only_members_leave_the_fingerprint,
    retention_is_per_route,
    store_headers_are_per_route,
    errors_per_route_and_unmatched_requests_get_the_defaults,
    the_published_policy_lists_every_route,
    in_flight_waits_or_refuses_per_route,
    routes_inherit_the_top_level_wait,
);
