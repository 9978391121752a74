//! `idem keys` on `idem proxy`'s Redis store: a key left in progress by a proxy killed while
//! the upstream held its request is listed and shown, completed by the operator, and its
//! retry through a new proxy replays the operator's answer without calling the upstream again.

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{RedisPrefix, Spawned, idem_output};
use crate::keys_resolve::order;

const REDIS: &str = "redis://127.0.0.1:6379/0";

/// An upstream that counts each `POST /orders` per `Idempotency-Key`, tells of its arrival,
/// and never answers it in the test's time.
struct SilentUpstream {
    url: String,
    calls: Arc<Mutex<HashMap<String, usize>>>,
    arrivals: tokio::sync::mpsc::UnboundedReceiver<String>,
}

async fn start_silent_upstream() -> SilentUpstream {
    let calls: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let (arrived, arrivals) = tokio::sync::mpsc::unbounded_channel();
    let counted = calls.clone();
    let app = axum::Router::new().route(
        "/orders",
        axum::routing::post(move |headers: axum::http::HeaderMap| {
            let (calls, arrived) = (counted.clone(), arrived.clone());
            async move {
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                // A std Mutex: no await while it is held.
                *calls.lock().unwrap().entry(key.clone()).or_default() += 1;
                let _ = arrived.send(key);
                tokio::time::sleep(Duration::from_secs(600)).await;
                axum::http::StatusCode::CREATED
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    SilentUpstream {
        url,
        calls,
        arrivals,
    }
}

/// `idem proxy` in front of `upstream` on the test's Redis prefix.
fn start_proxy(dir: &std::path::Path, upstream: &str, prefix: &str) -> Spawned {
    Spawned::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream])
            .args(["--store", REDIS, "--redis-prefix", prefix])
            .args(["--secret", "keys-redis-test-secret-of-32-bytes"])
            .current_dir(dir),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_resolves_a_key_a_killed_proxy_left_in_progress_on_redis() {
    idem_testkit::require(idem_testkit::Service::Redis);
    let prefix = RedisPrefix(format!("idem-keys-{}", uuid::Uuid::new_v4().simple()));
    let dir = tempfile::tempdir().unwrap();
    let mut upstream = start_silent_upstream().await;
    let key = "stuck-order-0001";

    // The proxy dies while the upstream holds the request: the key's outcome is unknown.
    let mut proxy = start_proxy(dir.path(), &upstream.url, &prefix.0);
    let lost = tokio::spawn(order(&proxy.url, key).send());
    let arrived = tokio::time::timeout(Duration::from_secs(30), upstream.arrivals.recv())
        .await
        .expect("the request reaches the upstream");
    assert_eq!(arrived.as_deref(), Some(key));
    proxy.kill9();
    assert!(
        lost.await.unwrap().is_err(),
        "the client never got an answer"
    );

    let keys = |args: &[&str]| {
        let database = ["--database", REDIS, "--redis-prefix", &prefix.0];
        idem_output("keys", &[&database[..], args].concat())
    };
    let (code, list, stderr) = keys(&["list", "--in-progress"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(list.contains("1 keys"), "{list}");
    let row = list
        .lines()
        .find(|line| line.contains(key))
        .unwrap_or_else(|| panic!("{list}"));
    assert!(row.contains("unknown (token"), "{row}");
    // The proxy files each caller under an account derived from its credential.
    let account = row.split_whitespace().next().unwrap().to_owned();
    assert!(account.starts_with("hmac:"), "{row}");
    let (code, shown, _) = keys(&["show", &account, key]);
    assert_eq!(code, Some(0));
    assert!(shown.contains("never while in progress"), "{shown}");
    let (_, completed, _) = keys(&["list", "--completed"]);
    assert!(completed.contains("0 keys"), "{completed}");

    let complete = ["complete", &account, key, "--status", "201"];
    let (code, _, stderr) =
        keys(&[&complete[..], &["--body", r#"{"id":"order-by-operator"}"#]].concat());
    assert_eq!(code, Some(0), "{stderr}");
    let (code, _, stderr) = keys(&complete);
    assert_eq!(code, Some(1), "only an in-progress key can be completed");
    assert!(stderr.contains("is not in progress"), "{stderr}");
    let (_, shown, _) = keys(&["show", &account, key, "--body"]);
    assert!(
        shown.contains("state        completed") && shown.contains("order-by-operator"),
        "{shown}"
    );

    // The client's retry, through a proxy started again, gets the operator's answer.
    let proxy = start_proxy(dir.path(), &upstream.url, &prefix.0);
    let retry = order(&proxy.url, key).send().await.unwrap();
    assert_eq!(retry.status(), 201);
    assert!(retry.headers().contains_key("idempotent-replayed"));
    assert_eq!(retry.text().await.unwrap(), r#"{"id":"order-by-operator"}"#);
    assert_eq!(upstream.calls.lock().unwrap()[key], 1, "no second call");

    let (code, _, _) = keys(&["purge", &account, key]);
    assert_eq!(code, Some(0));
    let (code, _, stderr) = keys(&["purge", &account, key]);
    assert_eq!(code, Some(1), "{stderr}");
    let (_, list, _) = keys(&["list"]);
    assert!(list.contains("0 keys"), "{list}");
}

#[test]
fn keys_refuses_an_unknown_store_and_reaches_no_redis_that_is_not_there() {
    let (code, _, stderr) = idem_output("keys", &["--database", "mysql://h/db", "list"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("unsupported store URL"), "{stderr}");
    // Port 1: nothing listens there.
    let (code, _, stderr) = idem_output("keys", &["--database", "redis://127.0.0.1:1", "list"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("cannot open redis://127.0.0.1:1"),
        "{stderr}"
    );
}
