//! `idem keys list --state` and `idem keys resolve` on real stores: records of unknown outcome
//! left by a killed `idem serve` (SQLite) and keys a killed `idem proxy` left in progress
//! (Redis), found by state and by the caller's credential, resolved from the command line,
//! and then a real client's retry through a restarted server gets the resolved answer.

use std::process::Command;
use std::time::{Duration, Instant};

use idem_core::Clock as _;
use idem_core::{
    AccountId, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Policy, RequestParts, Scope,
    SystemClock,
};
use idem_store::{NewClaim, RedisStore, Store};

use crate::common::{RedisPrefix, Spawned, idem_output, send, start_psp};
use crate::payouts::payout;

pub(crate) const REDIS: &str = "redis://127.0.0.1:6379/0";

/// `idem serve` on `db` whose payouts hold their key `lease` seconds past the provider's 2 s
/// timeout, with `extra` flags (`--fault-pause before-provider` freezes every payout there).
pub(crate) fn serve(db: &std::path::Path, psp: &str, lease: &str, extra: &[&str]) -> Spawned {
    Spawned::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["serve", "--listen", "127.0.0.1:0", "--lease-secs", lease])
            .args(["--database", &format!("sqlite://{}", db.display())])
            .args(["--psp-url", psp, "--psp-timeout-secs", "2"])
            .args(extra)
            .env_remove("IDEM_ADMIN_TOKEN"),
    )
}

/// Leaves `key`'s payout in progress on `db`: a server frozen at `pause` is killed.
pub(crate) async fn left_in_progress(
    db: &std::path::Path,
    psp: &str,
    lease: &str,
    pause: &str,
    key: &str,
) {
    let mut served = serve(db, psp, lease, &["--fault-pause", pause]);
    let request = payout(&served.url, key);
    let lost = tokio::spawn(async move {
        let _ = request.send().await;
    });
    let paused =
        tokio::task::block_in_place(|| served.await_line("paused at", Duration::from_secs(20)));
    assert!(paused, "idem serve never paused at {pause}");
    served.kill9();
    lost.await.unwrap();
}

/// `idem keys ARGS` until its stdout contains `needle`, within 20 s; that stdout. The wait is
/// for a real lease to run out, which no clock of the test's can move.
fn keys_until(args: &[&str], needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (code, stdout, stderr) = idem_output("keys", args);
        assert_eq!(code, Some(0), "{stderr}");
        if stdout.contains(needle) || Instant::now() > deadline {
            return stdout;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_lists_by_state_and_resolves_unknown_outcomes_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let (psp, psp_url) = start_psp().await;
    // One paid payout; two whose servers died under a 1 s lease (their outcomes soon
    // unknown): one after the provider charged, one before; and one under an hour's lease,
    // in progress all along.
    {
        let served = serve(&db, &psp_url, "1", &[]);
        assert_eq!(
            send(payout(&served.url, "paid-key-000001")).await.status,
            201
        );
    }
    // The short leases last, so that no server started after them finds them run out and
    // reconciles them before the operator does.
    left_in_progress(&db, &psp_url, "3600", "before-provider", "running-key-0001").await;
    left_in_progress(&db, &psp_url, "1", "before-provider", "never-sent-0001").await;
    left_in_progress(&db, &psp_url, "1", "after-provider", "charged-key-0001").await;
    assert_eq!(psp.charges().await, 2);

    let database = format!("sqlite://{}", db.display());
    let keys =
        |args: &[&str]| idem_output("keys", &[&["--database", database.as_str()], args].concat());
    let unknown = tokio::task::block_in_place(|| {
        keys_until(
            &["--database", &database, "list", "--state", "unknown"],
            "2 keys",
        )
    });
    assert!(unknown.contains("2 keys"), "both leases ran out: {unknown}");
    for key in ["charged-key-0001", "never-sent-0001"] {
        let row = unknown
            .lines()
            .find(|l| l.contains(key))
            .unwrap_or_else(|| panic!("{unknown}"));
        assert!(row.contains(" unknown "), "{row}");
    }
    let (_, in_progress, _) = keys(&["list", "--state", "in-progress"]);
    assert!(
        in_progress.contains("3 keys") && in_progress.contains("running-key-0001"),
        "{in_progress}"
    );
    // The same keys in the same states; the ages may have ticked over a second since.
    let keys_and_states = |listing: &str| -> Vec<(String, String)> {
        listing
            .lines()
            .filter_map(|l| {
                let mut columns = l.split_whitespace().skip(1);
                Some((columns.next()?.to_owned(), columns.next()?.to_owned()))
            })
            .collect()
    };
    let (_, alias, _) = keys(&["list", "--in-progress"]);
    assert_eq!(
        keys_and_states(&alias),
        keys_and_states(&in_progress),
        "--in-progress is --state in-progress"
    );
    let (_, completed, _) = keys(&["list", "--state", "completed"]);
    assert!(
        completed.contains("1 keys") && completed.contains("paid-key-000001"),
        "{completed}"
    );
    let (code, _, stderr) = keys(&["list", "--state", "stale"]);
    assert_eq!(code, Some(2), "{stderr}");

    // The operator learnt from the provider that one was charged, the other never sent.
    let resolve = [
        "resolve",
        "acct_alice",
        "charged-key-0001",
        "--status",
        "201",
    ];
    let answer = [
        "--header",
        "X-Resolved-By: ops",
        "--body",
        r#"{"id":"po_by_operator"}"#,
    ];
    let (code, _, stderr) = keys(&[&resolve[..], &["--body", "not json"]].concat());
    assert_eq!(code, Some(2), "a body labelled JSON must be JSON");
    assert!(stderr.contains("not JSON"), "{stderr}");
    let (code, _, stderr) = keys(&[&resolve[..], &["--release"]].concat());
    assert_eq!(
        code,
        Some(2),
        "--status and --release are two resolutions: {stderr}"
    );
    let (code, stdout, stderr) = keys(&[&resolve[..], &answer[..]].concat());
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("completed key"), "{stdout}");
    let (code, _, stderr) = keys(&["resolve", "acct_alice", "charged-key-0001", "--release"]);
    assert_eq!(code, Some(1), "a completed key is not released");
    assert!(
        stderr.contains("is not in progress: it is completed"),
        "{stderr}"
    );
    let (code, stdout, stderr) = keys(&["resolve", "acct_alice", "never-sent-0001", "--release"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("released key"), "{stdout}");
    let (code, _, stderr) = keys(&["resolve", "acct_alice", "never-sent-0001", "--release"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("no record"), "{stderr}");
    let (_, shown, _) = keys(&["show", "acct_alice", "charged-key-0001", "--body"]);
    assert!(
        shown.contains("state        completed")
            && shown.contains("header       x-resolved-by: ops")
            && shown.contains("po_by_operator"),
        "{shown}"
    );
    let (_, unknown, _) = keys(&["list", "--state", "unknown"]);
    assert!(unknown.contains("0 keys"), "{unknown}");

    // The clients' retries, through a server started again: the resolved answer replayed,
    // and the released payout paid once, now.
    let served = serve(&db, &psp_url, "1", &[]);
    let replayed = send(payout(&served.url, "charged-key-0001")).await;
    assert_eq!(replayed.status, 201, "{}", replayed.body);
    assert!(replayed.replayed());
    assert_eq!(replayed.body["id"], "po_by_operator");
    let fresh = send(payout(&served.url, "never-sent-0001")).await;
    assert_eq!(fresh.status, 201, "{}", fresh.body);
    assert!(!fresh.replayed());
    assert_eq!(psp.charges().await, 3, "one charge for each payout");
}

/// An upstream that holds every `POST /orders` without answering, and tells of each arrival.
pub(crate) async fn start_silent_upstream() -> (String, tokio::sync::mpsc::UnboundedReceiver<String>)
{
    let (arrived, arrivals) = tokio::sync::mpsc::unbounded_channel();
    let app = axum::Router::new().route(
        "/orders",
        axum::routing::post(move |headers: axum::http::HeaderMap| {
            let arrived = arrived.clone();
            async move {
                let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok());
                let _ = arrived.send(key.unwrap_or("").to_owned());
                tokio::time::sleep(Duration::from_secs(600)).await;
                axum::http::StatusCode::CREATED
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, arrivals)
}

/// `idem proxy` on the test's Redis prefix, with the secret the proxies keep there, and
/// `extra` flags.
pub(crate) fn proxy(
    dir: &std::path::Path,
    upstream: &str,
    prefix: &str,
    extra: &[&str],
) -> Spawned {
    Spawned::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream])
            .args(["--store", REDIS, "--redis-prefix", prefix])
            .args(["--upstream-timeout-secs", "5"])
            .args(extra)
            .env_remove("IDEM_PROXY_SECRET")
            .env_remove("IDEM_ADMIN_TOKEN")
            .current_dir(dir),
    )
}

pub(crate) fn order(url: &str, key: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("{url}/orders"))
        .header("authorization", "Bearer t1")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"sku":"A1"}"#)
        .timeout(Duration::from_secs(30))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_finds_a_callers_keys_by_credential_and_resolves_them_on_redis() {
    let prefix = RedisPrefix::new("keys-resolve");
    let dir = tempfile::tempdir().unwrap();
    let (upstream, mut arrivals) = start_silent_upstream().await;

    // A proxy dies while the upstream holds two of Bearer t1's orders.
    let first = proxy(dir.path(), &upstream, &prefix.0, &[]);
    strand_orders(
        first,
        &["order-resolved-01", "order-released-01"],
        &mut arrivals,
    )
    .await;
    // And another caller's record of unknown outcome: claimed with a lease that ran out at
    // once, as a gateway that stalled past its lease leaves it.
    let store = RedisStore::connect(REDIS, prefix.0.clone()).await.unwrap();
    let limits = KeyLimits::default();
    let scope = Scope::new(
        AccountId::new("acct_other"),
        IdempotencyKey::parse(b"stalled-order-01", limits).unwrap(),
    );
    let parts = RequestParts {
        account: "acct_other",
        method: "POST",
        route: "/orders",
        query: "",
        content_type: "application/json",
        body: b"{}",
    };
    let now = SystemClock.now();
    let fingerprint = Fingerprint::compute(&parts).unwrap();
    let mut claim = NewClaim::new(scope, fingerprint, FencingToken(7), now, &Policy::default());
    claim.lease_until = now;
    assert_eq!(
        store.claim(&claim).await.unwrap(),
        idem_store::ClaimOutcome::Claimed
    );

    let keys = |args: &[&str]| {
        let database = ["--database", REDIS, "--redis-prefix", &prefix.0];
        idem_output("keys", &[&database[..], args].concat())
    };
    let (code, unknown, stderr) = keys(&["list", "--state", "unknown"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        unknown.contains("1 keys") && unknown.contains("stalled-order-01"),
        "{unknown}"
    );
    let (_, in_progress, _) = keys(&["list", "--state", "in-progress"]);
    assert!(in_progress.contains("3 keys"), "{in_progress}");
    let (_, completed, _) = keys(&["list", "--state", "completed"]);
    assert!(completed.contains("0 keys"), "{completed}");

    // Bearer t1's keys, by its credential and the secret the proxy keeps in the store.
    let (code, mine, stderr) = keys(&["list", "--credential", "Bearer t1"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        mine.contains("2 keys") && mine.contains("order-released-01") && mine.contains("hmac:"),
        "{mine}"
    );
    let (_, theirs, _) = keys(&["list", "--credential", "Bearer t2"]);
    assert!(theirs.contains("0 keys"), "{theirs}");
    let other_secret = ["--secret", "not-the-proxy-secret-of-32-bytes"];
    let (_, elsewhere, _) =
        keys(&[&["list", "--credential", "Bearer t1"][..], &other_secret].concat());
    assert!(
        elsewhere.contains("0 keys"),
        "another secret, other accounts: {elsewhere}"
    );
    let (code, _, stderr) = keys(&[
        "show",
        "--credential",
        "Bearer t1",
        "acct",
        "order-resolved-01",
    ]);
    assert_eq!(code, Some(2), "the credential names the account: {stderr}");

    let by_t1 = ["resolve", "--credential", "Bearer t1"];
    let answer = ["--status", "201", "--body", r#"{"id":"order-by-operator"}"#];
    let (code, _, stderr) = keys(&[&by_t1[..], &["order-resolved-01"], &answer].concat());
    assert_eq!(code, Some(0), "{stderr}");
    let (code, _, stderr) = keys(&[&by_t1[..], &["order-released-01", "--release"]].concat());
    assert_eq!(code, Some(0), "{stderr}");
    let (code, _, stderr) = keys(&[&by_t1[..], &["order-resolved-01", "--release"]].concat());
    assert_eq!(code, Some(1), "a completed key is not released");
    assert!(stderr.contains("is not in progress"), "{stderr}");
    let (code, _, stderr) = keys(&["resolve", "acct_other", "stalled-order-01", "--release"]);
    assert_eq!(code, Some(0), "an unknown outcome released: {stderr}");
    let (_, left, _) = keys(&["list"]);
    assert!(
        left.contains("1 keys") && left.contains("order-resolved-01"),
        "{left}"
    );

    // The retries through a proxy started again: the resolved one replays the operator's
    // answer, the released one goes upstream again.
    let second = proxy(dir.path(), &upstream, &prefix.0, &[]);
    let resolved = ("order-resolved-01", r#"{"id":"order-by-operator"}"#);
    retries_replay_and_rerun(&second.url, resolved, "order-released-01", &mut arrivals).await;
}

/// Sends an order per key through `proxy`, and once the upstream holds them all kills the
/// proxy (`kill -9`): each key is left in progress, and its client never gets an answer.
pub(crate) async fn strand_orders(
    mut proxy: Spawned,
    keys: &[&str],
    arrivals: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let mut lost = Vec::new();
    for &key in keys {
        lost.push(tokio::spawn(order(&proxy.url, key).send()));
        let arrived = tokio::time::timeout(Duration::from_secs(30), arrivals.recv()).await;
        assert_eq!(
            arrived.expect("the order reaches the upstream").as_deref(),
            Some(key)
        );
    }
    proxy.kill9();
    for lost in lost {
        assert!(
            lost.await.unwrap().is_err(),
            "the client never got an answer"
        );
    }
}

/// The retries of two orders through the proxy at `url`: `resolved` (key, body) replays the
/// answer an operator stored, and `released` goes upstream again (seen on `arrivals`).
pub(crate) async fn retries_replay_and_rerun(
    url: &str,
    (resolved, body): (&str, &str),
    released: &str,
    arrivals: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let retry = order(url, resolved).send().await.unwrap();
    assert_eq!(retry.status(), 201);
    assert!(retry.headers().contains_key("idempotent-replayed"));
    assert_eq!(retry.text().await.unwrap(), body);
    let again = tokio::spawn(order(url, released).send());
    let arrived = tokio::time::timeout(Duration::from_secs(30), arrivals.recv()).await;
    assert_eq!(
        arrived.expect("sent upstream again").as_deref(),
        Some(released)
    );
    again.abort();
}
