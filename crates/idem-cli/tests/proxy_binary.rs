//! The `idem proxy` binary: start-up, its own `/healthz` and `/metrics`, and a replay through it.

mod common;

use std::process::Command;

use common::{Spawned, assert_healthy, metrics};

/// Starts `idem proxy` from `dir` in front of `upstream`, with `extra` flags.
fn start_proxy(dir: &std::path::Path, upstream: &str, extra: &[&str]) -> Spawned {
    Spawned::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream])
            .args(extra)
            .current_dir(dir),
    )
}

async fn start_upstream() -> String {
    let app = axum::Router::new().route(
        "/orders",
        axum::routing::post(|| async {
            let id = uuid::Uuid::new_v4().to_string();
            (
                axum::http::StatusCode::CREATED,
                [("request-id", id)],
                "order-1",
            )
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// `POST {url}/orders` with `key`, which the upstream (or the replay) answers `201`.
async fn order(client: &reqwest::Client, url: &str, key: &str) -> reqwest::Response {
    let answer = client
        .post(format!("{url}/orders"))
        .header("authorization", "Bearer t1")
        .header("idempotency-key", key)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 201);
    answer
}

#[tokio::test]
async fn the_proxy_answers_health_and_metrics_and_replays() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = start_upstream().await;
    let proxy = start_proxy(dir.path(), &upstream, &[]);
    let url = &proxy.url;
    let client = reqwest::Client::new();
    assert_healthy(&client, url).await;
    for _ in 0..2 {
        order(&client, url, "order-key-0001").await;
    }
    let metrics = metrics(&client, url).await;
    assert!(
        metrics.contains("idem_requests_total{outcome=\"replay\"}"),
        "{metrics}"
    );
    // The secret was generated and kept, readable by its owner only.
    let secret = dir.path().join("idem-proxy.secret");
    assert!(secret.exists());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(secret).unwrap().permissions().mode() & 0o777,
        0o600
    );
}

/// `--store-header request-id`: a replay carries the upstream's `Request-Id` (an SDK shows it
/// in its errors and logs); without the flag the replay has none.
#[tokio::test]
async fn a_stored_header_is_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = start_upstream().await;
    let client = reqwest::Client::new();
    for (flags, kept) in [
        (&["--store-header", "request-id"][..], true),
        (&[][..], false),
    ] {
        let sub = dir.path().join(if kept { "kept" } else { "plain" });
        std::fs::create_dir(&sub).unwrap();
        let proxy = start_proxy(&sub, &upstream, flags);
        let url = &proxy.url;
        let mut ids = Vec::new();
        for _ in 0..2 {
            let answer = order(&client, url, "order-key-0002").await;
            ids.push(answer.headers().get("request-id").cloned());
        }
        assert!(ids[0].is_some(), "the first answer is the upstream's own");
        if kept {
            assert_eq!(ids[1], ids[0], "the replay carries the stored Request-Id");
        } else {
            assert_eq!(ids[1], None, "not stored, not replayed");
        }
    }
}

#[tokio::test]
async fn with_admin_listen_health_moves_off_the_main_listener() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = start_upstream().await;
    let admin = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let admin_addr = admin.local_addr().unwrap();
    drop(admin);
    let proxy = start_proxy(
        dir.path(),
        &upstream,
        &["--admin-listen", &admin_addr.to_string()],
    );
    let url = &proxy.url;
    let client = reqwest::Client::new();
    // The main listener passes /healthz to the upstream (which has no such route).
    let main = client.get(format!("{url}/healthz")).send().await.unwrap();
    assert_eq!(main.status(), 404);
    let admin = client
        .get(format!("http://{admin_addr}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(admin.status(), 200);
}

#[test]
fn a_bad_store_url_fails_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
        ])
        .args(["--store", "mysql://x"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported store URL"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_sweeps_expired_keys_on_sqlite() {
    use idem_core::{
        AccountId, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Policy, RequestParts,
        Scope, StoredResponse, Timestamp,
    };
    use idem_store::{NewClaim, SqliteStore, Store};

    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem-proxy.db");
    // A record claimed and completed long ago: past its retention.
    let scope = Scope::new(
        AccountId::new("acct"),
        IdempotencyKey::parse(b"swept-key-0001", KeyLimits::default()).unwrap(),
    );
    let fingerprint = Fingerprint::compute(&RequestParts {
        account: "acct",
        method: "POST",
        route: "/orders",
        query: "",
        content_type: "",
        body: b"",
    })
    .unwrap();
    let long_ago = Timestamp(946_684_800_000); // 2000-01-01
    let store = SqliteStore::open(&db).await.unwrap();
    let claim = NewClaim::new(
        scope.clone(),
        fingerprint,
        FencingToken(1),
        long_ago,
        &Policy::default(),
    );
    store.claim(&claim).await.unwrap();
    let done = StoredResponse {
        status: 201,
        headers: vec![],
        body: b"order-1".to_vec(),
        body_omitted: false,
    };
    assert!(
        store
            .complete(&scope, FencingToken(1), &done)
            .await
            .unwrap()
    );

    let store_url = format!("sqlite://{}", db.display());
    let proxy = start_proxy(dir.path(), "http://127.0.0.1:1", &["--store", &store_url]);
    assert!(
        proxy.await_line("swept expired keys", std::time::Duration::from_secs(20)),
        "the proxy swept at start (it logs each sweep that deleted keys)"
    );
    assert_eq!(
        store.get(&scope).await.unwrap(),
        None,
        "the expired record is gone"
    );
}
