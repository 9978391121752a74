//! The console page at `/admin` (docs/operations/console.md) of `idem serve` and `idem proxy`:
//! absent without `--admin-token`, served with strict headers and no data, its API refusing
//! calls without the token; and, in a real headless Chromium driven by Playwright
//! (`tests/console/console.js`), an operator who logs in, finds two payouts a killed `idem
//! serve` left of unknown outcome, completes one and releases the other, after which the
//! clients' retries through the running server get the resolved answer replayed and a fresh
//! run.
//!
//! Needs Node.js, `npm ci --prefix crates/idem-cli/tests/console` and Debian's `chromium`
//! (`.ci/run` installs both); without them the test fails at once, saying so.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{ALICE, RedisPrefix, TestServer, send, start_psp};
use crate::keys_resolve::{
    left_in_progress, proxy, retries_replay_and_rerun, serve, start_silent_upstream, strand_orders,
};
use crate::payouts::payout;

const TOKEN: &str = "console-token-for-the-tests-01";
const CHROMIUM: &str = "/usr/bin/chromium";

fn console_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/console")
}

/// Fails in seconds, naming the command that installs what is missing.
fn browser_tools() {
    let node = Command::new("node").arg("--version").output();
    assert!(
        node.is_ok_and(|o| o.status.success()),
        "no `node` on PATH: install Node.js (apt-get install -y nodejs npm)"
    );
    assert!(
        console_dir()
            .join("node_modules/playwright-core/package.json")
            .exists(),
        "playwright-core is not installed: run `npm ci --prefix crates/idem-cli/tests/console`"
    );
    assert!(
        Path::new(CHROMIUM).exists(),
        "no Chromium at {CHROMIUM}: run `apt-get update && apt-get install -y chromium`"
    );
}

fn get(url: &str, token: Option<&str>) -> reqwest::RequestBuilder {
    let request = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(30));
    match token {
        Some(token) => request.bearer_auth(token),
        None => request,
    }
}

/// `GET url` with the admin token: its JSON.
async fn admin_json(url: &str) -> Value {
    let response = get(url, Some(TOKEN)).send().await.unwrap();
    assert_eq!(response.status(), 200, "GET {url}");
    response.json().await.unwrap()
}

#[tokio::test]
async fn the_console_is_absent_without_a_token_and_holds_no_data() {
    let without = TestServer::start().await;
    for path in ["/admin", "/admin/console.js", "/admin/outcomes"] {
        let response = get(&format!("{}{path}", without.url), Some(ALICE))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 404, "{path} without --admin-token");
    }
    without.stop().await;

    let token = idem_cli::admin::parse_admin_token(TOKEN).unwrap();
    let server = TestServer::start_with(|config| config.admin_token = Some(token)).await;
    let page = get(&format!("{}/admin", server.url), None)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let headers = page.headers().clone();
    assert_eq!(headers["content-type"], "text/html; charset=utf-8");
    assert_eq!(headers["x-frame-options"], "DENY");
    let csp = headers["content-security-policy"].to_str().unwrap();
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "connect-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(directive), "{csp}");
    }
    let html = page.text().await.unwrap();
    assert!(
        html.contains(r#"<script src="/admin/console.js""#),
        "{html}"
    );
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "the page loads nothing from elsewhere"
    );
    let script = get(&format!("{}/admin/console.js", server.url), None)
        .send()
        .await
        .unwrap();
    assert_eq!(script.status(), 200);
    assert_eq!(script.headers()["x-frame-options"], "DENY");

    // What the page calls answers only to the token.
    for path in [
        "/admin/keys?state=unknown",
        "/admin/outcomes",
        "/admin/keys/acct_alice/some-key-0001",
    ] {
        let url = format!("{}{path}", server.url);
        for (token, what) in [
            (None, "no token"),
            (Some("wrong-token-of-length"), "a wrong one"),
        ] {
            let response = get(&url, token).send().await.unwrap();
            assert_eq!(response.status(), 401, "{path} with {what}");
        }
    }
    let outcomes = admin_json(&format!("{}/admin/outcomes", server.url)).await;
    assert_eq!(outcomes["metric"], "idem_requests_total", "{outcomes}");
    assert_eq!(
        (&outcomes["every_seconds"], &outcomes["window_seconds"]),
        (&Value::from(10), &Value::from(3600))
    );
    assert!(outcomes["samples"].is_array(), "{outcomes}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_serves_the_console_only_with_an_admin_token() {
    let prefix = RedisPrefix::new("admin-console");
    let dir = tempfile::tempdir().unwrap();
    let (upstream, _arrivals) = start_silent_upstream().await;
    let without = proxy(dir.path(), &upstream, &prefix.0, &[]);
    let response = get(&format!("{}/admin", without.url), Some(TOKEN))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404, "the upstream's own 404");
    assert!(!response.headers().contains_key("content-security-policy"));
    drop(without);

    let with = proxy(dir.path(), &upstream, &prefix.0, &["--admin-token", TOKEN]);
    let page = get(&format!("{}/admin", with.url), None)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    assert_eq!(page.headers()["x-frame-options"], "DENY");
    let outcomes = format!("{}/admin/outcomes", with.url);
    let refused = get(&outcomes, None).send().await.unwrap();
    assert_eq!(refused.status(), 401);
    let answered = get(&outcomes, Some(TOKEN)).send().await.unwrap();
    assert_eq!(answered.status(), 200);
}

/// Runs the Playwright script with `vars`; its output, or a panic with it when it fails or
/// takes over 150 s.
fn run_console_script(vars: &[(&str, &str)]) -> String {
    let mut child = Command::new("node")
        .arg(console_dir().join("console.js"))
        .current_dir(console_dir())
        .envs(vars.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start node");
    fn read_all(mut pipe: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<String> {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    }
    let stdout = read_all(child.stdout.take().expect("piped stdout"));
    let stderr = read_all(child.stderr.take().expect("piped stderr"));
    // The script bounds itself at 120 s; this bounds a node that never starts it.
    let deadline = Instant::now() + Duration::from_secs(150);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for node") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = format!("{}{}", stdout.join().unwrap(), stderr.join().unwrap());
    match status {
        Some(status) if status.success() => output,
        Some(status) => panic!("the console script failed ({status}):\n{output}"),
        None => panic!("the console script did not end within 150 s:\n{output}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_resolves_unknown_outcomes_in_the_console_in_chromium() {
    browser_tools();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let (psp, psp_url) = start_psp().await;
    // The server's reconciler would ask the provider: its questions wait there, so that the
    // operator is the one who resolves.
    psp.hold_lookups();
    left_in_progress(&db, &psp_url, "1", "after-provider", "console-charged-01").await;
    left_in_progress(&db, &psp_url, "1", "before-provider", "console-never-sent").await;
    let served = serve(&db, &psp_url, "1", &["--admin-token", TOKEN]);
    tokio::time::timeout(Duration::from_secs(20), psp.lookups_arrived(1))
        .await
        .expect("the reconciler found an unknown outcome");
    // Both leases ran out (within a second of each other), so both are listed as unknown.
    let unknown = format!("{}/admin/keys?state=unknown", served.url);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let listed = admin_json(&unknown).await;
        if listed["keys"].as_array().unwrap().len() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "not both unknown: {listed}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A client's retry before the operator acts, for the charts to count.
    let before = send(payout(&served.url, "console-charged-01")).await;
    assert_eq!(
        before.status, 409,
        "unknown until resolved: {}",
        before.body
    );

    let screenshot = std::env::var("IDEM_CONSOLE_SCREENSHOT")
        .unwrap_or_else(|_| dir.path().join("console.png").display().to_string());
    let started = Instant::now();
    let output = tokio::task::block_in_place(|| {
        run_console_script(&[
            ("IDEM_URL", served.url.as_str()),
            ("IDEM_ADMIN_TOKEN", TOKEN),
            ("CONSOLE_ACCOUNT", "acct_alice"),
            ("CONSOLE_COMPLETE_KEY", "console-charged-01"),
            ("CONSOLE_RELEASE_KEY", "console-never-sent"),
            ("CONSOLE_SCREENSHOT", screenshot.as_str()),
            ("CHROMIUM", CHROMIUM),
        ])
    });
    eprintln!(
        "the console in Chromium: {:.1} s\n{output}",
        started.elapsed().as_secs_f64()
    );
    let png = std::fs::read(&screenshot).expect("the screenshot was saved");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");

    // The clients' retries through the same running server.
    let replayed = send(payout(&served.url, "console-charged-01")).await;
    assert_eq!(replayed.status, 201, "{}", replayed.body);
    assert!(replayed.replayed(), "Idempotent-Replayed");
    assert_eq!(replayed.body, serde_json::json!({"id": "po_by_console"}));
    assert_eq!(replayed.headers["x-resolved-by"], "console");
    let fresh = send(payout(&served.url, "console-never-sent")).await;
    assert_eq!(fresh.status, 201, "{}", fresh.body);
    assert!(!fresh.replayed());
    psp.release_lookups();
    assert_eq!(psp.charges().await, 2, "one charge for each payout");

    // The keys' history, as the store keeps it: what the console did, and by whom.
    for (key, what) in [
        ("console-charged-01", "resolved: completed with status 201"),
        ("console-never-sent", "resolved: released"),
    ] {
        let shown = admin_json(&format!("{}/admin/keys/acct_alice/{key}", served.url)).await;
        let events = shown["events"].as_array().unwrap();
        assert!(
            events
                .iter()
                .any(|e| e["what"] == what && e["by"] == "console"),
            "{key}: {shown}"
        );
    }
}

/// The same operator's steps on `idem proxy` over Redis, the gateway's main store: two orders
/// a killed proxy left in progress under a caller's HMAC account are found, one completed and
/// one released in the console of a second proxy, and the client's retries through it get the
/// answer the operator stored, and a fresh run upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_resolves_a_killed_proxy_s_orders_on_redis_in_chromium() {
    browser_tools();
    let prefix = RedisPrefix::new("admin-console-redis");
    let dir = tempfile::tempdir().unwrap();
    let (upstream, mut arrivals) = start_silent_upstream().await;
    let first = proxy(dir.path(), &upstream, &prefix.0, &[]);
    let (completed, released) = ("order-done-by-console", "order-again-after-console");
    strand_orders(first, &[completed, released], &mut arrivals).await;

    let second = proxy(dir.path(), &upstream, &prefix.0, &["--admin-token", TOKEN]);
    let listed = admin_json(&format!("{}/admin/keys?state=in-progress", second.url)).await;
    let keys = listed["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 2, "{listed}");
    let account = keys[0]["account"].as_str().unwrap().to_owned();
    assert!(
        account.starts_with("hmac:"),
        "the caller's derived account: {account}"
    );
    // A client's retry before the operator acts: the claim still holds, and the chart counts it.
    let early = crate::keys_resolve::order(&second.url, completed)
        .send()
        .await
        .unwrap();
    assert_eq!(early.status(), 409, "in use until resolved");

    let output = tokio::task::block_in_place(|| {
        run_console_script(&[
            ("IDEM_URL", second.url.as_str()),
            ("IDEM_ADMIN_TOKEN", TOKEN),
            ("CONSOLE_ACCOUNT", account.as_str()),
            ("CONSOLE_COMPLETE_KEY", completed),
            ("CONSOLE_RELEASE_KEY", released),
            ("CONSOLE_STUCK", "in-progress"),
            (
                "CONSOLE_SCREENSHOT",
                &dir.path().join("console.png").display().to_string(),
            ),
            ("CHROMIUM", CHROMIUM),
        ])
    });
    eprintln!("the console of idem proxy on Redis:\n{output}");

    let resolved = (completed, r#"{"id":"po_by_console"}"#);
    retries_replay_and_rerun(&second.url, resolved, released, &mut arrivals).await;
}
