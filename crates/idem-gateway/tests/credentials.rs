//! Who a request is scoped to (docs/contract.md §12): the credential from a header or a
//! session cookie; a covered request without one refused with `401 no-credential`, neither
//! forwarded nor stored; webhook routes scoped by their route; `anonymous = "shared"` as the
//! explicit opt-in. In front of a real upstream that answers each call with a new order naming
//! the session it saw, for each store.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use idem_core::{AccountId, Clock, IdempotencyKey, KeyLimits, Scope, SystemClock};
use idem_gateway::{ConfigFile, Credential, GatewayConfig};
use idem_store::Store;
use tokio::net::TcpListener;

use common::{Answer, send};

/// The upstream: a new order per call, naming the cookies it was sent (an order holds its
/// buyer's details: what must never reach another buyer).
#[derive(Clone, Default)]
struct Upstream {
    calls: Arc<AtomicUsize>,
}

async fn order(State(up): State<Upstream>, headers: HeaderMap) -> impl IntoResponse {
    let n = up.calls.fetch_add(1, Ordering::SeqCst) + 1;
    let cookies: Vec<&str> = headers
        .get_all("cookie")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        serde_json::json!({"order": n, "cookies": cookies}).to_string(),
    )
}

struct Gateway {
    url: String,
    upstream: Upstream,
    client: reqwest::Client,
}

impl Gateway {
    fn calls(&self) -> usize {
        self.upstream.calls.load(Ordering::SeqCst)
    }

    /// A POST of `body` to `path` with `headers` and nothing else.
    async fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
        let request = headers.iter().fold(
            self.client
                .post(format!("{}{path}", self.url))
                .header("content-type", "application/json")
                .body(body.to_owned()),
            |request, (name, value)| request.header(*name, *value),
        );
        send(request).await
    }
}

/// Starts the gateway over `store` with `toml`'s routes and credential, then `adjust`.
async fn start<St: Store>(
    store: St,
    toml: &str,
    adjust: impl FnOnce(&mut GatewayConfig),
) -> Gateway {
    let upstream = Upstream::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = listener.local_addr().unwrap();
    let app = Router::new().fallback(order).with_state(upstream.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let file = ConfigFile::parse(toml).expect("a valid file");
    let mut config = common::config(upstream_addr);
    config.apply_file(&file);
    adjust(&mut config);
    Gateway {
        url: common::serve(store, config).await,
        upstream,
        client: reqwest::Client::new(),
    }
}

const CART: &str = r#"{"item":"sku-42"}"#;
const KEY: (&str, &str) = ("idempotency-key", "checkout-3fa1b2");

/// The scope a gateway before the refusal filed every caller without a credential under.
fn anonymous(key: &str) -> Scope {
    scope("anonymous", key)
}

fn scope(account: &str, key: &str) -> Scope {
    Scope::new(
        AccountId::new(account),
        IdempotencyKey::parse(key.as_bytes(), KeyLimits::default()).unwrap(),
    )
}

/// Issue 31's case: two shoppers logged in with session cookies post the same cart with the
/// same key (a front end derives it from the cart). Each gets an order of their own; a retry
/// replays each their own.
async fn two_cookie_users_with_the_same_key_and_body_each_get_their_own_answer<St: Store>(
    store: St,
) {
    let gw = start(store.clone(), "credential = \"cookie:session\"\n", |_| {}).await;
    let alice = [("cookie", "theme=dark; session=alice-7f3a; lang=en"), KEY];
    // Bob's cookies come in two fields, as HTTP/2 clients send them.
    let bob = [("cookie", "lang=fr"), ("cookie", "session=bob-91c2"), KEY];
    let alices = gw.post("/orders", &alice, CART).await;
    let bobs = gw.post("/orders", &bob, CART).await;
    assert_eq!((alices.status, bobs.status), (201, 201), "{bobs:?}");
    assert!(!bobs.replayed(), "Bob is not replayed Alice's order");
    assert!(alices.body.contains("alice-7f3a"), "{}", alices.body);
    assert!(bobs.body.contains("bob-91c2"), "{}", bobs.body);
    assert!(!bobs.body.contains("alice"), "{}", bobs.body);
    assert_eq!(gw.calls(), 2, "the upstream saw both orders");

    gw.post("/orders", &alice, CART)
        .await
        .assert_replays(&alices);
    gw.post("/orders", &bob, CART).await.assert_replays(&bobs);
    // The same session in a differently spaced header is the same caller.
    let spaced = [("cookie", "session=bob-91c2 ;lang=fr"), KEY];
    gw.post("/orders", &spaced, CART)
        .await
        .assert_replays(&bobs);
    assert_eq!(gw.calls(), 2);
    assert_eq!(
        store
            .get(&anonymous(KEY.1), SystemClock.now())
            .await
            .unwrap(),
        None
    );
}

/// The same with the default credential, `Authorization`: two tokens, one key, two orders.
async fn two_bearer_tokens_with_the_same_key_and_body_each_get_their_own_answer<St: Store>(
    store: St,
) {
    let gw = start(store, "", |_| {}).await;
    let alice = [("authorization", "Bearer sk_alice"), KEY];
    let bob = [("authorization", "Bearer sk_bob"), KEY];
    let alices = gw.post("/orders", &alice, CART).await;
    let bobs = gw.post("/orders", &bob, CART).await;
    assert_eq!((alices.status, bobs.status), (201, 201));
    assert_ne!(alices.body, bobs.body);
    assert!(!bobs.replayed());
    gw.post("/orders", &bob, CART).await.assert_replays(&bobs);
    assert_eq!(gw.calls(), 2);
}

/// A covered request without the credential is refused before anything happens: `401
/// no-credential` as problem details (with `Bearer` as the challenge for `Authorization`),
/// never forwarded, nothing stored (not where earlier gateways shared one anonymous scope, nor
/// anywhere else: the same key from a caller with a credential runs fresh).
async fn a_covered_request_without_its_credential_is_401_and_nothing_is_stored<St: Store>(
    store: St,
) {
    let gw = start(store.clone(), "", |_| {}).await;
    for headers in [
        &[KEY][..],
        &[KEY, ("authorization", "")][..],
        &[KEY, ("cookie", "authorization=sk_x")][..],
    ] {
        let refused = gw.post("/orders", headers, CART).await;
        refused.assert_refused(401, "no-credential");
        assert_eq!(refused.headers["content-type"], "application/problem+json");
        assert_eq!(refused.headers["www-authenticate"], "Bearer");
        assert!(
            refused.body.contains("the Authorization header"),
            "{}",
            refused.body
        );
        assert!(!refused.headers.contains_key("retry-after"));
    }
    assert_eq!(gw.calls(), 0, "never forwarded");
    assert_eq!(
        store
            .get(&anonymous(KEY.1), SystemClock.now())
            .await
            .unwrap(),
        None
    );
    let alice = gw
        .post(
            "/orders",
            &[("authorization", "Bearer sk_alice"), KEY],
            CART,
        )
        .await;
    assert_eq!(alice.status, 201);
    assert!(!alice.replayed(), "nothing was stored under the key");
    assert_eq!(gw.calls(), 1);

    // A cookie credential: an Authorization header is not it, and no header names a challenge
    // for a cookie.
    let gw = start(store.clone(), "credential = \"cookie:session\"\n", |_| {}).await;
    let refused = gw
        .post(
            "/orders",
            &[
                ("authorization", "Bearer sk_alice"),
                ("cookie", "sessionid=x"),
                KEY,
            ],
            CART,
        )
        .await;
    refused.assert_refused(401, "no-credential");
    assert!(
        refused.body.contains("the session cookie"),
        "{}",
        refused.body
    );
    assert!(!refused.headers.contains_key("www-authenticate"));
    assert_eq!(gw.calls(), 0);
}

/// The refusal is for covered requests with a key only: a GET, and a keyless POST where keys
/// are optional, pass through without a credential (nothing is stored for them); a keyless
/// POST where keys are required is refused for its key first.
async fn uncovered_and_keyless_requests_need_no_credential<St: Store>(store: St) {
    let routes = "[[route]]\nmatch = \"POST /search\"\nkey = \"optional\"\n";
    let gw = start(store, routes, |_| {}).await;
    let got = send(gw.client.get(format!("{}/orders", gw.url))).await;
    assert_eq!(got.status, 201, "the upstream's own answer to a GET");
    assert_eq!(gw.post("/search", &[], "{}").await.status, 201);
    gw.post("/orders", &[], CART)
        .await
        .assert_refused(400, "missing-key");
    assert_eq!(gw.calls(), 2);
}

/// Webhook routes (`key_from`): the sender's delivery id is the key and the sender has no
/// caller's credential, so a delivery needs none; a redelivery still reaches the upstream
/// once. Each route is a scope of its own: the same id on another route is another delivery.
/// Another route of the same gateway still refuses a request without a credential.
async fn webhook_routes_need_no_credential_and_are_scoped_by_their_route<St: Store>(store: St) {
    let routes = r#"
[[route]]
match = "POST /webhooks/github"
key_from = "header:X-GitHub-Delivery"
[[route]]
match = "POST /webhooks/stripe"
key_from = "body:/id"
[[route]]
match = "POST /webhooks/mirror"
key_from = "header:X-GitHub-Delivery"
"#;
    let gw = start(store.clone(), routes, |_| {}).await;
    let delivery = ("x-github-delivery", "72d3162e-cc78-11e3-81ab-dcbb1ef32bd5");
    let push = r#"{"ref":"refs/heads/main"}"#;
    let first = gw.post("/webhooks/github", &[delivery], push).await;
    assert_eq!(first.status, 201, "{first:?}");
    gw.post("/webhooks/github", &[delivery], push)
        .await
        .assert_replays(&first);
    let stripe = r#"{"id":"evt_1NfGk2","type":"charge.succeeded"}"#;
    let event = gw.post("/webhooks/stripe", &[], stripe).await;
    gw.post("/webhooks/stripe", &[], stripe)
        .await
        .assert_replays(&event);
    let mirrored = gw.post("/webhooks/mirror", &[delivery], push).await;
    assert!(!mirrored.replayed(), "another route, another scope");
    assert_eq!(gw.calls(), 3);
    // Where the records are: under their route, readable in `idem keys`.
    let github = scope("route:POST /webhooks/github", delivery.1);
    assert!(
        store
            .get(&github, SystemClock.now())
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(
        store
            .get(&anonymous(delivery.1), SystemClock.now())
            .await
            .unwrap(),
        None
    );

    gw.post("/orders", &[KEY], CART)
        .await
        .assert_refused(401, "no-credential");
    assert_eq!(gw.calls(), 3);
}

/// `anonymous = "shared"`, the explicit opt-in: callers without a credential share one scope
/// on that route, so the second is replayed the first one's answer (the documented risk), in
/// the scope earlier gateways used. A route without it still refuses them.
async fn anonymous_shared_is_the_explicit_opt_in_to_one_scope<St: Store>(store: St) {
    let routes = r#"
[[route]]
match = "POST /public/quotes"
anonymous = "shared"
"#;
    let gw = start(store.clone(), routes, |_| {}).await;
    let first = gw.post("/public/quotes", &[KEY], CART).await;
    assert_eq!(first.status, 201);
    gw.post(
        "/public/quotes",
        &[KEY, ("cookie", "session=someone-else")],
        CART,
    )
    .await
    .assert_replays(&first);
    assert!(
        store
            .get(&anonymous(KEY.1), SystemClock.now())
            .await
            .unwrap()
            .is_some()
    );
    gw.post("/private/orders", &[KEY], CART)
        .await
        .assert_refused(401, "no-credential");
    // A caller with a credential keeps a scope of its own there.
    let alice = gw
        .post(
            "/public/quotes",
            &[KEY, ("authorization", "Bearer sk_alice")],
            CART,
        )
        .await;
    assert!(!alice.replayed());
    assert_eq!(gw.calls(), 2);
}

/// The rules say where the credential is and what each route does without it, in the
/// published policy.
async fn the_published_policy_says_the_credential_and_each_routes_anonymous_rule<St: Store>(
    store: St,
) {
    let routes = r#"
credential = "cookie:session"
[[route]]
match = "POST /webhooks/stripe"
key_from = "body:/id"
[[route]]
match = "POST /public/quotes"
anonymous = "shared"
[[route]]
match = "POST /orders"
"#;
    let gw = start(store, routes, |_| {}).await;
    let policy: serde_json::Value = gw
        .client
        .get(format!("{}/.well-known/idempotency-policy", gw.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(policy["credential"], "cookie:session");
    assert_eq!(policy["anonymous"], "refuse");
    let anonymous: Vec<&str> = policy["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|route| route["anonymous"].as_str().unwrap())
        .collect();
    assert_eq!(anonymous, ["route", "shared", "refuse"]);
}

/// `require_auth`: every request without the credential is refused, whatever it is (a GET, a
/// webhook delivery); with it they pass.
async fn require_auth_refuses_every_request_without_the_credential<St: Store>(store: St) {
    let routes = "[[route]]\nmatch = \"POST /webhooks/stripe\"\nkey_from = \"body:/id\"\n";
    let gw = start(store, routes, |c| {
        c.require_auth = true;
        c.credential = Credential::Cookie("session".into());
    })
    .await;
    let get = send(gw.client.get(format!("{}/orders", gw.url))).await;
    get.assert_refused(401, "no-credential");
    let event = r#"{"id":"evt_1NfGk3"}"#;
    gw.post("/webhooks/stripe", &[], event)
        .await
        .assert_refused(401, "no-credential");
    assert_eq!(gw.calls(), 0);
    let session = ("cookie", "session=s1");
    let got = send(
        gw.client
            .get(format!("{}/orders", gw.url))
            .header(session.0, session.1),
    )
    .await;
    assert_eq!(got.status, 201);
    assert_eq!(
        gw.post("/webhooks/stripe", &[session], event).await.status,
        201
    );
    assert_eq!(gw.calls(), 2);
}

on_every_store!(
    two_cookie_users_with_the_same_key_and_body_each_get_their_own_answer,
    two_bearer_tokens_with_the_same_key_and_body_each_get_their_own_answer,
    a_covered_request_without_its_credential_is_401_and_nothing_is_stored,
    uncovered_and_keyless_requests_need_no_credential,
    webhook_routes_need_no_credential_and_are_scoped_by_their_route,
    anonymous_shared_is_the_explicit_opt_in_to_one_scope,
    the_published_policy_says_the_credential_and_each_routes_anonymous_rule,
    require_auth_refuses_every_request_without_the_credential,
);
