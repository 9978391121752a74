//! The `idem proxy` binary: start-up, its own `/healthz` and `/metrics`, a replay through it,
//! and 100 MiB answers streamed through it in bounded memory.

use std::process::Command;

use crate::common::{RedisPrefix, Spawned, assert_healthy, keyed, metrics};

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

/// `METHOD {url}` as the proxy's client (token `t1`), with `key` as its Idempotency-Key when
/// there is one.
async fn send_as_client(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    key: Option<&str>,
) -> reqwest::Response {
    let request = client
        .request(method, url)
        .header("authorization", "Bearer t1");
    keyed(request, key).send().await.unwrap()
}

/// `POST {url}/orders` with `key`, which the upstream (or the replay) answers `201`.
async fn order(client: &reqwest::Client, url: &str, key: &str) -> reqwest::Response {
    let orders = format!("{url}/orders");
    let answer = send_as_client(client, reqwest::Method::POST, &orders, Some(key)).await;
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
        metrics.contains("idem_requests_total{outcome=\"replayed\"}"),
        "{metrics}"
    );
    // The scope secret was made and kept in the store, beside the records it scopes, where
    // any other proxy on the store finds it; no file was made for it.
    assert!(!dir.path().join("idem-proxy.secret").exists());
    let db = sqlx::SqlitePool::connect(&format!(
        "sqlite://{}",
        dir.path().join("idem-proxy.db").display()
    ))
    .await
    .unwrap();
    let secret: String =
        sqlx::query_scalar("SELECT value FROM idem_secrets WHERE name = 'idem-proxy-scope'")
            .fetch_one(&db)
            .await
            .unwrap();
    assert_eq!(secret.len(), 64, "32 random bytes in hex");
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

/// The large answer: a hundred times the storage cap.
const LARGE: usize = 100 << 20;
const CHUNK: usize = 64 << 10;
/// The large answer's bytes repeat every 251 (a prime), so a chunk lost, doubled or out of
/// order shows.
const PERIOD: usize = 251;
/// How much the proxy's peak resident memory may grow while it passes the answer on: a sixth
/// of the answer, four times what streaming it was measured to cost (under 4 MiB: the storage
/// cap and a few buffers), where holding it cost over 100 MiB.
const GROWTH_LIMIT_KIB: u64 = 16 << 10;

/// A chunk of the pattern and a period more: any piece of the answer up to a chunk long,
/// wherever it starts, is a slice of it.
fn pattern() -> bytes::Bytes {
    (0..CHUNK + PERIOD).map(|i| (i % PERIOD) as u8).collect()
}

/// An upstream whose `GET /large` and `POST /large` answer [`LARGE`] bytes, made chunk by chunk
/// as they are sent (never held whole), with their `Content-Length`.
async fn start_large_upstream() -> String {
    let pattern = pattern();
    let large = move || {
        let pattern = pattern.clone();
        async move {
            let chunks = futures_util::stream::iter((0..LARGE / CHUNK).map(move |k| {
                let at = k * CHUNK % PERIOD;
                Ok::<_, std::convert::Infallible>(pattern.slice(at..at + CHUNK))
            }));
            (
                [
                    ("content-type", "application/octet-stream".to_owned()),
                    ("content-length", LARGE.to_string()),
                ],
                axum::body::Body::from_stream(chunks),
            )
        }
    };
    let app = axum::Router::new().route("/large", axum::routing::get(large.clone()).post(large));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Reads `response` to its end, checking every byte against the pattern; its length.
async fn read_large(mut response: reqwest::Response) -> usize {
    let pattern = pattern();
    let mut len = 0;
    while let Some(chunk) = response.chunk().await.unwrap() {
        for piece in chunk.chunks(CHUNK) {
            let at = len % PERIOD;
            assert!(
                piece == &pattern[at..at + piece.len()],
                "the bytes at {len} arrive as the upstream sent them"
            );
            len += piece.len();
        }
    }
    len
}

/// The peak resident memory of `child` so far (`VmHWM`), in KiB.
fn peak_kib(child: &std::process::Child) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status")
}

/// Sends `method /large` (with `key`) through a fresh proxy and reads the 100 MiB answer;
/// checks that the proxy's peak memory grew by less than [`GROWTH_LIMIT_KIB`], and returns the
/// proxy and its client for more requests.
async fn large_through_a_proxy(
    dir: &std::path::Path,
    what: &str,
    method: reqwest::Method,
    key: Option<&str>,
) -> (Spawned, reqwest::Client) {
    let upstream = start_large_upstream().await;
    let proxy = start_proxy(dir, &upstream, &[]);
    let client = reqwest::Client::new();
    assert_healthy(&client, &proxy.url).await;
    let idle = peak_kib(&proxy.child);
    let large = format!("{}/large", proxy.url);
    let answer = send_as_client(&client, method, &large, key).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(read_large(answer).await, LARGE, "every byte arrives");
    let peak = peak_kib(&proxy.child);
    eprintln!(
        "idem proxy, {what}, 100 MiB answer: VmHWM {idle} KiB idle, {peak} KiB after (+{} KiB)",
        peak - idle
    );
    assert!(
        peak - idle < GROWTH_LIMIT_KIB,
        "the proxy grew by {} KiB passing on a 100 MiB answer: it held the answer, not streamed it",
        peak - idle
    );
    (proxy, client)
}

/// A covered POST whose answer is a hundred times the storage cap: the client gets every
/// byte, the proxy holds at most the cap of it, and the retry replays the stored head with the
/// body omitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mib_covered_answer_streams_through_the_proxy() {
    let dir = tempfile::tempdir().unwrap();
    let key = "large-key-0001";
    let (proxy, client) =
        large_through_a_proxy(dir.path(), "covered POST", reqwest::Method::POST, Some(key)).await;
    let large = format!("{}/large", proxy.url);
    let replay = send_as_client(&client, reqwest::Method::POST, &large, Some(key)).await;
    assert_eq!(replay.status(), 200);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["idempotent-replay"], "omitted");
    assert!(replay.bytes().await.unwrap().is_empty());
}

/// An uncovered GET streams through untouched, whatever its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mib_uncovered_answer_streams_through_the_proxy() {
    let dir = tempfile::tempdir().unwrap();
    large_through_a_proxy(dir.path(), "uncovered GET", reqwest::Method::GET, None).await;
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
            .complete(&scope, FencingToken(1), &done, long_ago)
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
        store.get(&scope, long_ago).await.unwrap(),
        None,
        "the expired record is gone"
    );
}

/// libfaketime from Debian's `faketime` package, the thread-safe build (the proxy runs many
/// threads), preloaded into a child so that its clock runs ahead (`FAKETIME=+120s`).
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// An upstream that holds each `POST /orders` for `hold` before it answers `201`, counts the
/// calls per `Idempotency-Key`, and tells of each call's arrival.
struct HeldUpstream {
    url: String,
    calls: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    arrivals: tokio::sync::mpsc::UnboundedReceiver<String>,
}

async fn start_held_upstream(hold: std::time::Duration) -> HeldUpstream {
    use std::sync::{Arc, Mutex};
    let calls: Arc<Mutex<std::collections::HashMap<String, usize>>> = Arc::default();
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
                let _ = arrived.send(key.clone());
                tokio::time::sleep(hold).await;
                (axum::http::StatusCode::CREATED, format!("order for {key}"))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    HeldUpstream {
        url,
        calls,
        arrivals,
    }
}

/// The time a proxy's `Date` header says, in seconds since the epoch: its clock, as it sees it.
async fn proxy_clock(client: &reqwest::Client, url: &str) -> i64 {
    let answer = client.get(format!("{url}/healthz")).send().await.unwrap();
    let date = answer.headers()["date"].to_str().unwrap().to_owned();
    let parsed = Command::new("date")
        .args(["-u", "-d", &date, "+%s"])
        .output()
        .expect("date(1)");
    String::from_utf8(parsed.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// One clock, the store's (docs/contract.md §12): two `idem proxy` processes on one Redis with
/// one secret, the second's clock minutes ahead under libfaketime (a VM resumed from a pause, a
/// broken NTP). Requests held 5 s by the upstream at the first proxy, and their duplicates sent
/// to the second once the originals have reached the upstream: each key reaches the upstream
/// once, the duplicates are told `409`, and the second proxy replays the outcomes. (Judged by
/// each proxy's own clock, the second took the live claims over: 2 calls per key.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_whose_clock_is_minutes_ahead_takes_no_live_claim_over() {
    idem_testkit::require(idem_testkit::Service::Redis);
    assert!(
        std::path::Path::new(LIBFAKETIME).exists(),
        "this test runs a proxy under libfaketime: apt-get install -y faketime"
    );
    let mut upstream = start_held_upstream(std::time::Duration::from_secs(5)).await;
    let prefix = RedisPrefix(format!("idem-skew-{}", uuid::Uuid::new_v4().simple()));
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--store",
        "redis://127.0.0.1:6379/0",
        "--redis-prefix",
        &prefix.0,
        "--secret",
        "skew-test-secret-of-32-bytes-long",
    ];
    let client = reqwest::Client::new();
    let mut counts = Vec::new();
    for skew in [120, 300] {
        let first = start_proxy(dir.path(), &upstream.url, &args);
        let ahead = Spawned::spawn(
            Command::new(env!("CARGO_BIN_EXE_idem"))
                .args([
                    "proxy",
                    "--listen",
                    "127.0.0.1:0",
                    "--upstream",
                    &upstream.url,
                ])
                .args(args)
                .env("LD_PRELOAD", LIBFAKETIME)
                .env("FAKETIME", format!("+{skew}s"))
                // Only the wall clock: Tokio's timers run on the monotonic one.
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
                .current_dir(dir.path()),
        );
        let seen = proxy_clock(&client, &ahead.url).await - proxy_clock(&client, &first.url).await;
        assert!(
            (seen - skew).abs() <= 2,
            "the second proxy's clock is {seen} s ahead, not {skew} s: libfaketime did not take"
        );

        let keys: Vec<String> = (0..3).map(|i| format!("skew-{skew}-order-{i}")).collect();
        let originals: Vec<_> = keys
            .iter()
            .map(|key| {
                let (client, url, key) = (client.clone(), first.url.clone(), key.clone());
                tokio::spawn(async move {
                    let orders = format!("{url}/orders");
                    send_as_client(&client, reqwest::Method::POST, &orders, Some(&key)).await
                })
            })
            .collect();
        for _ in &keys {
            let arrived =
                tokio::time::timeout(std::time::Duration::from_secs(30), upstream.arrivals.recv())
                    .await
                    .expect("the originals reach the upstream");
            assert!(arrived.is_some());
        }
        // All at once, while the upstream still holds every original.
        let orders = format!("{}/orders", ahead.url);
        let duplicates: Vec<u16> = futures_util::future::join_all(keys.iter().map(|key| {
            let (client, orders) = (&client, &orders);
            async move {
                let duplicate =
                    send_as_client(client, reqwest::Method::POST, orders, Some(key)).await;
                duplicate.status().as_u16()
            }
        }))
        .await;
        for original in originals {
            assert_eq!(original.await.unwrap().status(), 201);
        }
        let mut replays = Vec::new();
        for key in &keys {
            let replay = send_as_client(&client, reqwest::Method::POST, &orders, Some(key)).await;
            replays.push((
                replay.status().as_u16(),
                replay.headers().contains_key("idempotent-replayed"),
            ));
        }
        let calls = upstream.calls.lock().unwrap().clone();
        let per_key: Vec<usize> = keys
            .iter()
            .map(|k| calls.get(k).copied().unwrap_or(0))
            .collect();
        println!(
            "{skew} s of skew: upstream calls per key {per_key:?}, duplicates answered {duplicates:?}"
        );
        counts.push((skew, per_key, duplicates, replays));
    }
    for (skew, per_key, duplicates, replays) in counts {
        assert_eq!(
            per_key,
            [1, 1, 1],
            "upstream calls per key with {skew} s of skew"
        );
        assert_eq!(
            duplicates,
            [409, 409, 409],
            "the duplicates with {skew} s of skew"
        );
        assert_eq!(
            replays,
            [(201, true); 3],
            "the replays with {skew} s of skew"
        );
    }
}
