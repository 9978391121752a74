//! `idem proxy` in front of a real upstream with no idempotency of its own (a tiny server that
//! counts its charges), for each store.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use futures_util::future::join_all;
use idem_core::{ManualClock, Timestamp};
use idem_gateway::{GatewayConfig, KeyForwarding};
use idem_store::Store;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{Mutex, Notify, Semaphore};

/// The upstream: charges a card per POST, remembers nothing.
#[derive(Clone)]
struct Upstream {
    charges: Arc<AtomicUsize>,
    gets: Arc<AtomicUsize>,
    keys_seen: Arc<Mutex<Vec<Option<String>>>>,
    headers_seen: Arc<Mutex<Vec<HeaderMap>>>,
    entered: Arc<Notify>,
    gate: Arc<Semaphore>,
    gated: Arc<std::sync::atomic::AtomicBool>,
}

impl Default for Upstream {
    fn default() -> Self {
        Self {
            charges: Default::default(),
            gets: Default::default(),
            keys_seen: Default::default(),
            headers_seen: Default::default(),
            entered: Default::default(),
            gate: Arc::new(Semaphore::new(0)),
            gated: Default::default(),
        }
    }
}

async fn charge(State(up): State<Upstream>, headers: HeaderMap, body: Bytes) -> impl IntoResponse {
    let n = up.charges.fetch_add(1, Ordering::SeqCst) + 1;
    up.keys_seen.lock().await.push(
        headers
            .get("idempotency-key")
            .map(|v| v.to_str().unwrap().to_owned()),
    );
    up.headers_seen.lock().await.push(headers);
    up.entered.notify_one();
    if up.gated.load(Ordering::SeqCst) {
        up.gate.acquire().await.unwrap().forget();
    }
    let status = if body.windows(4).any(|w| w == b"fail") {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::CREATED
    };
    (
        status,
        [("content-type", "application/json")],
        format!(r#"{{"charge":"ch_{n}"}}"#),
    )
}

async fn list(State(up): State<Upstream>) -> impl IntoResponse {
    up.gets.fetch_add(1, Ordering::SeqCst);
    format!(r#"{{"charges":{}}}"#, up.charges.load(Ordering::SeqCst))
}

async fn start_upstream(listener: TcpListener, up: Upstream) {
    let app = Router::new()
        .route("/charges", post(charge).get(list))
        .route(
            "/slow",
            post(|| async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                "never"
            }),
        )
        .with_state(up);
    tokio::spawn(async move { axum::serve(listener, app).await });
}

struct Proxy {
    url: String,
    upstream: Upstream,
    upstream_addr: std::net::SocketAddr,
    clock: ManualClock,
    client: reqwest::Client,
}

impl Proxy {
    fn post(
        &self,
        path: &str,
        credential: &str,
        key: Option<&str>,
        body: &str,
    ) -> reqwest::RequestBuilder {
        let key = key.map(|key| ("idempotency-key", key));
        let url = format!("{}{path}", self.url);
        common::json_post(&self.client, url, credential, key.as_slice(), body)
    }

    fn charges(&self) -> usize {
        self.upstream.charges.load(Ordering::SeqCst)
    }
}

async fn start_proxy<St: Store>(store: St, adjust: impl FnOnce(&mut GatewayConfig)) -> Proxy {
    let upstream_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream_listener.local_addr().unwrap();
    let upstream = Upstream::default();
    start_upstream(upstream_listener, upstream.clone()).await;
    start_proxy_to(store, upstream, upstream_addr, adjust).await
}

async fn start_proxy_to<St: Store>(
    store: St,
    upstream: Upstream,
    upstream_addr: std::net::SocketAddr,
    adjust: impl FnOnce(&mut GatewayConfig),
) -> Proxy {
    let clock = ManualClock::new(Timestamp(1_800_000_000_000));
    let mut config = common::config(upstream_addr);
    config.clock = Arc::new(clock.clone());
    adjust(&mut config);
    Proxy {
        url: common::serve(store, config).await,
        upstream,
        upstream_addr,
        clock,
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .build()
            .unwrap(),
    }
}

const ALICE: &str = "Bearer sk_alice";
const BOB: &str = "Bearer sk_bob";
const BODY: &str = r#"{"amount": 1000, "currency": "EUR"}"#;

async fn twenty_concurrent_copies_make_one_upstream_charge<St: Store>(store: St) {
    let proxy = start_proxy(store, |_| {}).await;
    let answers = join_all(
        (0..20).map(|_| send(proxy.post("/charges", ALICE, Some("twenty-key-0001"), BODY))),
    )
    .await;
    assert_eq!(proxy.charges(), 1);
    let fresh: Vec<_> = answers
        .iter()
        .filter(|a| a.status == 201 && !a.replayed())
        .collect();
    assert_eq!(fresh.len(), 1, "one answer came from the upstream");
    for answer in &answers {
        match answer.status {
            201 => assert_eq!(answer.body, fresh[0].body),
            409 => assert!(answer.headers.get("retry-after").is_some()),
            other => panic!("unexpected {other}: {}", answer.body),
        }
    }
    let retry = send(proxy.post("/charges", ALICE, Some("twenty-key-0001"), BODY)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, fresh[0].body);
    assert_eq!(proxy.charges(), 1);
}

async fn a_hundred_keys_times_four_shuffled_copies_make_a_hundred_charges<St: Store>(store: St) {
    let proxy = start_proxy(store, |_| {}).await;
    let mut requests: Vec<String> = (0..100)
        .flat_map(|k| std::iter::repeat_n(format!("hundred-key-{k:04}"), 4))
        .collect();
    // A fixed shuffle: deterministic, and copies of one key far apart and close together.
    requests.sort_by_key(|k| {
        let n: u64 = k[12..].parse().unwrap();
        (n * 7919) % 101
    });
    let answers = join_all(requests.iter().map(|key| {
        let req = proxy.post("/charges", ALICE, Some(key), BODY);
        async move { (key.clone(), send(req).await) }
    }))
    .await;
    assert_eq!(proxy.charges(), 100);
    let mut bodies: HashMap<String, HashSet<String>> = HashMap::new();
    for (key, answer) in answers {
        assert!(matches!(answer.status, 201 | 409), "{}", answer.body);
        if answer.status == 201 {
            bodies.entry(key).or_default().insert(answer.body);
        }
    }
    assert!(bodies.values().all(|b| b.len() == 1), "one charge per key");
    for k in 0..100 {
        let retry = send(proxy.post(
            "/charges",
            ALICE,
            Some(&format!("hundred-key-{k:04}")),
            BODY,
        ))
        .await;
        assert!(retry.replayed());
    }
    assert_eq!(proxy.charges(), 100);
}

/// `errors = stripe`: idem's own 4xx carry Stripe's `error` member beside the problem, so a
/// Stripe SDK raises instead of returning the body as the charge; the upstream's own answers
/// and their replays are untouched.
async fn the_stripe_dialect_adds_an_error_member_to_idem_refusals<St: Store>(store: St) {
    let proxy = start_proxy(store, |c| c.errors = idem_core::ErrorDialect::Stripe).await;
    let json =
        |answer: &Answer| -> serde_json::Value { serde_json::from_str(&answer.body).unwrap() };
    let first = send(proxy.post("/charges", ALICE, Some("stripe-key-0001"), BODY)).await;
    assert_eq!(first.status, 201);
    assert!(
        json(&first).get("error").is_none(),
        "the upstream's answer as it was"
    );
    let changed = r#"{"amount": 2000, "currency": "EUR"}"#;
    let mismatch = send(proxy.post("/charges", ALICE, Some("stripe-key-0001"), changed)).await;
    let missing = send(proxy.post("/charges", ALICE, None, BODY)).await;
    for (answer, status, kind) in [(&mismatch, 422, "mismatch"), (&missing, 400, "missing-key")] {
        let body = json(answer);
        assert_eq!(answer.status, status);
        assert_eq!(body["type"], format!("urn:idem:problem:{kind}"));
        assert_eq!(body["error"]["type"], "idempotency_error");
        assert_eq!(body["error"]["message"], body["detail"]);
    }
    let again = send(proxy.post("/charges", ALICE, Some("stripe-key-0001"), BODY)).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
}

async fn a_changed_body_is_422_and_the_original_still_replays<St: Store>(store: St) {
    let proxy = start_proxy(store, |_| {}).await;
    let first = send(proxy.post("/charges", ALICE, Some("mismatch-key-01"), BODY)).await;
    let changed = send(proxy.post(
        "/charges",
        ALICE,
        Some("mismatch-key-01"),
        r#"{"amount": 2000, "currency": "EUR"}"#,
    ))
    .await;
    assert_eq!(changed.status, 422);
    assert!(changed.body.contains("urn:idem:problem:mismatch"));
    assert_eq!(proxy.charges(), 1, "no upstream call for a mismatch");
    let again = send(proxy.post("/charges", ALICE, Some("mismatch-key-01"), BODY)).await;
    assert!(again.replayed());
    assert_eq!(
        again.body, first.body,
        "a mismatch does not poison the stored result"
    );
}

async fn another_credential_is_a_new_request<St: Store>(store: St) {
    let proxy = start_proxy(store, |_| {}).await;
    let alice = send(proxy.post("/charges", ALICE, Some("shared-key-0001"), BODY)).await;
    let bob = send(proxy.post("/charges", BOB, Some("shared-key-0001"), BODY)).await;
    assert_eq!((alice.status, bob.status), (201, 201));
    assert!(!bob.replayed());
    assert_ne!(alice.body, bob.body);
    assert_eq!(proxy.charges(), 2);
}

/// A platform calls for two connected accounts with one API key and a `Stripe-Account` header
/// each. With `Stripe-Account` as a scope header, the same key and body from the two accounts
/// are two charges; the same account again is a replay. Without it, the second account would
/// be replayed the first one's charge, which is what the option exists to prevent.
async fn scope_headers_keep_connected_accounts_apart<St: Store>(store: St) {
    let proxy = start_proxy(store, |c| {
        c.scope_headers = vec![http::HeaderName::from_static("stripe-account")]
    })
    .await;
    let as_account = |account: &str| {
        proxy
            .post("/charges", ALICE, Some("connect-key-0001"), BODY)
            .header("stripe-account", account)
    };
    let one = send(as_account("acct_one")).await;
    let two = send(as_account("acct_two")).await;
    assert_eq!((one.status, two.status), (201, 201));
    assert!(!two.replayed(), "another connected account is not a replay");
    assert_ne!(one.body, two.body);
    let again = send(as_account("acct_one")).await;
    assert!(again.replayed());
    assert_eq!(again.body, one.body);
    // No Stripe-Account at all is a scope of its own too.
    let platform = send(proxy.post("/charges", ALICE, Some("connect-key-0001"), BODY)).await;
    assert!(!platform.replayed());
    assert_eq!(proxy.charges(), 3);
}

/// The published rules say how long a claim is held: the lease plus the upstream's timeout.
async fn the_published_policy_says_how_long_a_claim_is_held<St: Store>(store: St) {
    let proxy = start_proxy(store, |c| {
        c.policy.lease = Duration::from_secs(20);
        c.upstream_timeout = Duration::from_secs(7);
    })
    .await;
    let answer = send(
        proxy
            .client
            .get(format!("{}/.well-known/idempotency-policy", proxy.url)),
    )
    .await;
    assert_eq!(answer.status, 200);
    let policy: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(policy["lease_seconds"], 20);
    assert_eq!(policy["upstream_timeout_seconds"], 7);
    assert_eq!(policy["claim_held_seconds"], 27);
    let after_timeout = policy["after_upstream_timeout"].as_str().unwrap();
    assert!(after_timeout.starts_with("504"), "{after_timeout}");
    assert_eq!(
        proxy.charges(),
        0,
        "the policy is the gateway's own, not the upstream's"
    );
}

async fn gets_pass_through_and_a_key_on_get_is_ignored<St: Store>(store: St) {
    let proxy = start_proxy(store, |_| {}).await;
    for _ in 0..2 {
        let answer = send(
            proxy
                .client
                .get(format!("{}/charges", proxy.url))
                .header("idempotency-key", "get-key-000001"),
        )
        .await;
        assert_eq!(answer.status, 200);
        assert!(!answer.replayed());
    }
    assert_eq!(proxy.upstream.gets.load(Ordering::SeqCst), 2);
}

async fn a_missing_key_is_400_and_the_upstream_never_sees_it<St: Store>(store: St) {
    let proxy = start_proxy(store, |_| {}).await;
    let answer = send(proxy.post("/charges", ALICE, None, BODY)).await;
    assert_eq!(answer.status, 400);
    assert!(answer.body.contains("urn:idem:problem:missing-key"));
    // The refusal points at the gateway's published rules.
    assert_eq!(
        answer.headers["link"],
        r#"</.well-known/idempotency-policy>; rel="describedby""#
    );
    assert_eq!(proxy.charges(), 0);
}

async fn keys_optional_passes_keyless_requests_through<St: Store>(store: St) {
    let proxy = start_proxy(store, |c| c.policy.require_key = false).await;
    send(proxy.post("/charges", ALICE, None, BODY)).await;
    send(proxy.post("/charges", ALICE, None, BODY)).await;
    assert_eq!(proxy.charges(), 2);
}

async fn the_upstream_down_gives_502_and_the_key_runs_once_when_it_is_back<St: Store>(store: St) {
    // A port with nothing behind it.
    let parked = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = parked.local_addr().unwrap();
    drop(parked);
    let upstream = Upstream::default();
    let proxy = start_proxy_to(store, upstream.clone(), addr, |_| {}).await;
    let down = send(proxy.post("/charges", ALICE, Some("down-key-000001"), BODY)).await;
    assert_eq!(down.status, 502);
    assert!(down.body.contains("urn:idem:problem:upstream-unavailable"));

    start_upstream(TcpListener::bind(addr).await.unwrap(), upstream).await;
    let back = send(proxy.post("/charges", ALICE, Some("down-key-000001"), BODY)).await;
    assert_eq!(back.status, 201);
    assert!(!back.replayed());
    let again = send(proxy.post("/charges", ALICE, Some("down-key-000001"), BODY)).await;
    assert!(again.replayed());
    assert_eq!(proxy.charges(), 1);
}

async fn a_duplicate_during_the_original_gets_409_with_retry_after<St: Store>(store: St) {
    let proxy = Arc::new(start_proxy(store, |_| {}).await);
    proxy.upstream.gated.store(true, Ordering::SeqCst);
    let original = tokio::spawn({
        let proxy = proxy.clone();
        async move { send(proxy.post("/charges", ALICE, Some("inflight-key-01"), BODY)).await }
    });
    proxy.upstream.entered.notified().await;
    let duplicate = send(proxy.post("/charges", ALICE, Some("inflight-key-01"), BODY)).await;
    assert_eq!(duplicate.status, 409);
    assert!(duplicate.body.contains("urn:idem:problem:in-use"));
    assert!(duplicate.headers.get("retry-after").is_some());
    proxy.upstream.gate.add_permits(1);
    assert_eq!(original.await.unwrap().status, 201);
    assert_eq!(proxy.charges(), 1);
}

async fn the_sf_string_form_and_any_header_case_work<St: Store>(store: St) {
    let proxy = start_proxy(store, |_| {}).await;
    let first = send(proxy.post("/charges", ALICE, Some("\"sf-key-0000001\""), BODY)).await;
    assert_eq!(first.status, 201);
    // Header names are case-insensitive; send one spelled oddly on a raw connection so no
    // client library normalises it.
    let addr = proxy.url.trim_start_matches("http://");
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /charges HTTP/1.1\r\nHost: x\r\nAuthorization: {ALICE}\r\nIdEmPoTeNcY-KeY: sf-key-0000001\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut reply = String::new();
    socket.read_to_string(&mut reply).await.unwrap();
    assert!(reply.starts_with("HTTP/1.1 201"), "{reply}");
    assert!(reply.contains("idempotent-replayed: true"), "{reply}");
    assert_eq!(proxy.charges(), 1);
}

async fn a_5xx_is_stored_and_replayed_by_default<St: Store>(store: St) {
    let proxy = start_proxy(store, |_| {}).await;
    let fail = r#"{"fail": true}"#;
    let first = send(proxy.post("/charges", ALICE, Some("five-hundred-01"), fail)).await;
    assert_eq!(first.status, 500);
    let again = send(proxy.post("/charges", ALICE, Some("five-hundred-01"), fail)).await;
    assert_eq!(again.status, 500);
    assert!(again.replayed());
    assert_eq!(proxy.charges(), 1);
}

async fn the_key_is_forwarded_as_sent_or_derived<St: Store>(store: St) {
    let proxy = start_proxy(store.clone(), |_| {}).await;
    send(proxy.post("/charges", ALICE, Some("forward-key-001"), BODY)).await;
    assert_eq!(
        proxy.upstream.keys_seen.lock().await[0].as_deref(),
        Some("forward-key-001")
    );
    let derived = start_proxy(store, |c| c.forwarding = KeyForwarding::Derived).await;
    // The same store: a new key, so the derived proxy really forwards.
    send(derived.post("/charges", ALICE, Some("forward-key-002"), BODY)).await;
    send(derived.post("/charges", BOB, Some("forward-key-002"), BODY)).await;
    let seen = derived.upstream.keys_seen.lock().await.clone();
    let (a, b) = (seen[0].clone().unwrap(), seen[1].clone().unwrap());
    assert_eq!(a.len(), 64, "an HMAC in hex");
    assert_ne!(a, "forward-key-002");
    assert_ne!(a, b, "derived keys differ per account");
}

async fn hop_by_hop_headers_are_not_forwarded<St: Store>(store: St) {
    let proxy = start_proxy(store, |_| {}).await;
    send(
        proxy
            .post("/charges", ALICE, Some("hop-key-0000001"), BODY)
            .header("connection", "x-private")
            .header("x-private", "secret")
            .header("x-public", "kept")
            .header("proxy-authorization", "Basic abc"),
    )
    .await;
    let seen = proxy.upstream.headers_seen.lock().await;
    assert!(seen[0].get("x-private").is_none());
    assert!(seen[0].get("proxy-authorization").is_none());
    assert_eq!(seen[0].get("x-public").unwrap(), "kept");
    assert_eq!(seen[0].get("authorization").unwrap(), ALICE);
}

/// The upstream learns who called and how: the client's address appended to what earlier
/// proxies said, the scheme, and RFC 7239's `Forwarded`.
async fn the_upstream_is_told_who_called<St: Store>(store: St) {
    let proxy = start_proxy(store, |_| {}).await;
    let host = proxy.url.trim_start_matches("http://").to_owned();
    send(proxy.post("/charges", ALICE, Some("fwd-key-0000001"), BODY)).await;
    send(
        proxy
            .post("/charges", ALICE, Some("fwd-key-0000002"), BODY)
            .header("x-forwarded-for", "203.0.113.7")
            .header("forwarded", "for=203.0.113.7;proto=https"),
    )
    .await;
    let seen = proxy.upstream.headers_seen.lock().await;
    let header = |i: usize, name: &str| seen[i].get(name).unwrap().to_str().unwrap().to_owned();
    assert_eq!(header(0, "x-forwarded-for"), "127.0.0.1");
    assert_eq!(header(0, "x-forwarded-proto"), "http");
    assert_eq!(header(0, "x-forwarded-host"), host);
    assert_eq!(
        header(0, "forwarded"),
        format!("for=127.0.0.1;proto=http;host=\"{host}\"")
    );
    assert_eq!(header(1, "x-forwarded-for"), "203.0.113.7, 127.0.0.1");
    assert_eq!(
        header(1, "forwarded"),
        format!("for=203.0.113.7;proto=https, for=127.0.0.1;proto=http;host=\"{host}\"")
    );
}

/// The lease is the store's to judge (docs/contract.md §12): on SQLite by the gateway's clock,
/// moved here; on PostgreSQL and Redis by their own, which only real time moves, so the lease
/// is a few seconds and the retry polls to a deadline until it has run out.
async fn a_timeout_keeps_the_key_until_its_lease_ends_then_retries_upstream<St: Store>(store: St) {
    let proxy = start_proxy(store, |c| {
        c.upstream_timeout = Duration::from_millis(200);
        c.policy.lease = Duration::from_secs(3);
    })
    .await;
    let timed_out = send(proxy.post("/slow", ALICE, Some("timeout-key-001"), BODY)).await;
    assert_eq!(timed_out.status, 504);
    assert!(timed_out.body.contains("urn:idem:problem:upstream-timeout"));
    let during = send(proxy.post("/slow", ALICE, Some("timeout-key-001"), BODY)).await;
    assert_eq!(
        during.status, 409,
        "the outcome is unknown until the lease ends"
    );
    proxy.clock.advance(Duration::from_secs(31));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let after = send(proxy.post("/slow", ALICE, Some("timeout-key-001"), BODY)).await;
        if after.status == 504 {
            break;
        }
        assert_eq!(after.status, 409, "{after:?}");
        assert!(
            std::time::Instant::now() < deadline,
            "the lease never ran out"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn require_auth_refuses_requests_without_a_credential<St: Store>(store: St) {
    let proxy = start_proxy(store, |c| c.require_auth = true).await;
    let answer = send(
        proxy
            .client
            .post(format!("{}/charges", proxy.url))
            .header("idempotency-key", "no-auth-key-001")
            .body(BODY),
    )
    .await;
    answer.assert_refused(401, "no-credential");
    assert_eq!(answer.headers["www-authenticate"], "Bearer");
    assert_eq!(proxy.charges(), 0);
    let _ = proxy.upstream_addr;
}

use common::{Answer, send, sqlite_store};

on_every_store!(
    twenty_concurrent_copies_make_one_upstream_charge,
    a_hundred_keys_times_four_shuffled_copies_make_a_hundred_charges,
    a_changed_body_is_422_and_the_original_still_replays,
    the_stripe_dialect_adds_an_error_member_to_idem_refusals,
    another_credential_is_a_new_request,
    scope_headers_keep_connected_accounts_apart,
    the_published_policy_says_how_long_a_claim_is_held,
    gets_pass_through_and_a_key_on_get_is_ignored,
    a_missing_key_is_400_and_the_upstream_never_sees_it,
    keys_optional_passes_keyless_requests_through,
    the_upstream_down_gives_502_and_the_key_runs_once_when_it_is_back,
    a_duplicate_during_the_original_gets_409_with_retry_after,
    the_sf_string_form_and_any_header_case_work,
    a_5xx_is_stored_and_replayed_by_default,
    the_key_is_forwarded_as_sent_or_derived,
    hop_by_hop_headers_are_not_forwarded,
    the_upstream_is_told_who_called,
    a_timeout_keeps_the_key_until_its_lease_ends_then_retries_upstream,
    require_auth_refuses_requests_without_a_credential,
);

/// A client that sends half a request head, or nothing, loses its connection after
/// `head_timeout` instead of holding it forever (a slowloris); the proxy goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_head_that_never_completes_is_closed() {
    let (store, _dir) = sqlite_store().await;
    let proxy = start_proxy(store, |c| c.head_timeout = Duration::from_millis(300)).await;
    idem_testkit::assert_unfinished_heads_are_closed(
        proxy.url.trim_start_matches("http://"),
        "/charges",
    )
    .await;
    let answer = send(proxy.post("/charges", ALICE, Some("after-slow-0001"), BODY)).await;
    assert_eq!(answer.status, 201, "{}", answer.body);
    assert_eq!(proxy.charges(), 1);
}
