//! Two `idem proxy` processes on one store, each started as README shows (no `--secret`, each
//! in a working directory of its own, as two pods behind a load balancer): a payment sent to
//! the first and retried with the same key at the second is charged once, because the two
//! share the secret their scopes derive from (it lives in the store). Then an earlier
//! version's secret file: its secret moves into the store, so the keys stored under it keep
//! their scopes.
//!
//! Each test prints what it counted (`--nocapture` shows it).

use crate::common::RedisPrefix;
use crate::common::processes::{PgDatabase, Proxy};
use idem_cli::fake_psp::{FakePsp, Faults};

/// Intents per run.
const INTENTS: usize = 20;

/// What a run of [`INTENTS`] intents, each sent to one proxy and retried at the other, came to.
#[derive(Debug)]
struct Crossed {
    /// Charges the upstream made.
    charges: usize,
    /// Retries the second proxy answered with the first one's stored answer.
    replays: usize,
}

/// A payment provider that charges every `POST`, the same key again too (no idempotency of
/// its own), and its URL.
async fn charging_upstream() -> (FakePsp, String) {
    let (psp, url) = crate::common::start_psp().await;
    psp.set_faults(Faults {
        no_dedupe: true,
        ..Faults::default()
    })
    .await;
    (psp, url)
}

/// Two proxies on the store of `args` (with `first` and `second` after them), started at
/// once, each from a directory of its own; each intent sent to the first, then retried with
/// the same key and body at the second.
async fn cross(args: &[&str], first: &[&str], second: &[&str]) -> Crossed {
    let (psp, upstream) = charging_upstream().await;
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let start = |dir: &std::path::Path, extra: &[&str]| {
        let all: Vec<&str> = args.iter().chain(extra).copied().collect();
        let (dir, upstream) = (dir.to_path_buf(), upstream.clone());
        let all: Vec<String> = all.into_iter().map(str::to_owned).collect();
        async move {
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            Proxy::start_proxy(&dir, &upstream, &all, dir.join("proxy.log")).await
        }
    };
    let (a, b) = tokio::join!(start(one.path(), first), start(two.path(), second));
    let client = reqwest::Client::new();
    let mut replays = 0;
    for i in 0..INTENTS {
        let key = format!("intent-{i:04}-{}", std::process::id());
        let body = format!(r#"{{"amount":{},"currency":"EUR"}}"#, 1000 + i);
        let at = |proxy: &Proxy| {
            let request = client
                .post(format!("{}/charges", proxy.url))
                .bearer_auth(crate::common::ALICE)
                .header("content-type", "application/json")
                .body(body.clone());
            crate::common::send(crate::common::keyed(request, Some(&key)))
        };
        let sent = at(&a).await;
        assert_eq!(
            sent.status, 201,
            "{key} at the first proxy: {:?}",
            sent.body
        );
        let retried = at(&b).await;
        assert!(
            matches!(retried.status, 200 | 201),
            "{key} at the second proxy: {} {:?}",
            retried.status,
            retried.body
        );
        if retried.replayed() {
            assert_eq!(
                retried.raw, sent.raw,
                "{key}: the replay is the first answer"
            );
            replays += 1;
        }
    }
    for proxy in [&a, &b] {
        let log = proxy.log();
        assert!(!log.contains("panicked"), "a proxy's log:\n{log}");
    }
    Crossed {
        charges: psp.charges().await,
        replays,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_on_one_redis_charge_a_retried_payment_once() {
    let prefix = RedisPrefix::new("two-proxies");
    let store = [
        "--store",
        "redis://127.0.0.1:6379",
        "--redis-prefix",
        &prefix.0,
    ];
    let shared = cross(&store, &[], &[]).await;

    // What the default did before the secret moved into the store: each proxy a secret of its
    // own (then generated per working directory; here given, to show the same split).
    let split_prefix = RedisPrefix::new("two-secrets");
    let split_store = [
        "--store",
        "redis://127.0.0.1:6379",
        "--redis-prefix",
        &split_prefix.0,
    ];
    let split = cross(
        &split_store,
        &["--secret", "the-first-proxys-own-secret"],
        &["--secret", "the-second-proxys-own-secret"],
    )
    .await;
    eprintln!(
        "two proxies on one Redis, {INTENTS} intents each sent to the first and retried at the \
         second: {} upstream charges and {} replays with the secret in the store; {} charges \
         and {} replays with a secret per proxy",
        shared.charges, shared.replays, split.charges, split.replays
    );
    assert_eq!(shared.charges, INTENTS, "{shared:?}");
    assert_eq!(shared.replays, INTENTS, "{shared:?}");
    assert_eq!(split.charges, 2 * INTENTS, "the control: {split:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_on_one_postgres_charge_a_retried_payment_once() {
    let db = PgDatabase::create().await;
    let shared = cross(&["--store", db.url()], &[], &[]).await;
    eprintln!(
        "two proxies on one PostgreSQL database, {INTENTS} intents each sent to the first and \
         retried at the second: {} upstream charges, {} replays",
        shared.charges, shared.replays
    );
    assert_eq!(shared.charges, INTENTS, "{shared:?}");
    assert_eq!(shared.replays, INTENTS, "{shared:?}");
}

/// An existing deployment: a proxy whose working directory holds the `idem-proxy.secret` an
/// earlier version made. Its secret moves into the store (and the proxy says so), so a key
/// stored under it is still found by a proxy that derives scopes from that same secret, as
/// the earlier version did; a proxy started later without the file reads it from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_versions_secret_file_keeps_its_scopes() {
    const OLD: &str = "5e1d0c9b8a7f6e5d4c3b2a1908f7e6d5";
    let (psp, upstream) = charging_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("idem-proxy.secret"), format!("{OLD}\n")).unwrap();
    let db = format!("sqlite://{}", dir.path().join("idem-proxy.db").display());
    let store = ["--store", db.as_str()];
    let client = reqwest::Client::new();
    let pay = |url: &str| {
        let request = client
            .post(format!("{url}/charges"))
            .bearer_auth(crate::common::ALICE)
            .header("content-type", "application/json")
            .body(r#"{"amount":1000,"currency":"EUR"}"#);
        crate::common::send(crate::common::keyed(request, Some("upgrade-key-0001")))
    };

    let log = dir.path().join("first.log");
    let mut first = Proxy::start_proxy(dir.path(), &upstream, &store, log).await;
    let paid = pay(&first.url).await;
    assert_eq!(paid.status, 201);
    let said = first.log();
    assert!(
        said.contains("moved the secret of idem-proxy.secret into the store"),
        "{said}"
    );
    first.kill();

    // The old secret, given explicitly: the same scope, so the same record.
    let log = dir.path().join("explicit.log");
    let mut explicit = Proxy::start_proxy(
        dir.path(),
        &upstream,
        &[store[0], store[1], "--secret", OLD],
        log,
    )
    .await;
    let replayed = pay(&explicit.url).await;
    assert!(replayed.replayed(), "{:?}", replayed.body);
    let said = explicit.log();
    assert!(!said.contains("other than the one given"), "{said}");
    explicit.kill();

    // Without the file, from another directory: the store's secret.
    std::fs::remove_file(dir.path().join("idem-proxy.secret")).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let log = elsewhere.path().join("later.log");
    let later = Proxy::start_proxy(elsewhere.path(), &upstream, &store, log).await;
    assert!(pay(&later.url).await.replayed());
    assert!(
        !elsewhere.path().join("idem-proxy.secret").exists(),
        "no file is made"
    );
    assert_eq!(psp.charges().await, 1);
}
