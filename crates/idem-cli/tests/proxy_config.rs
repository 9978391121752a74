//! `idem proxy --config` and `--check-config`: the binary reads a routes file, checks it, and
//! serves its rules; flags override the file's top-level values.

use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::processes::Idem;

/// The example of docs/contract.md §10.1.
const GOOD: &str = include_str!("../../idem-gateway/tests/gateway.example.toml");

fn idem(dir: &std::path::Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

/// `idem proxy --check-config PATH` in `dir`: what it printed, once it said the file is valid.
fn valid_config(dir: &std::path::Path, path: &str) -> String {
    let out = idem(dir, &["proxy", "--check-config", path]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn write(dir: &std::path::Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn check_config_prints_every_route_with_its_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "gateway.toml", GOOD);
    let stdout = valid_config(dir.path(), &path);
    for route in [
        "POST /v1/charges",
        "POST /webhooks/github",
        "POST /webhooks/stripe",
        "POST /search",
    ] {
        assert!(
            stdout.contains(&format!("match = \"{route}\"")),
            "{route}: {stdout}"
        );
    }
    for line in [
        "upstream = \"https://api.internal:8443/\"",
        "key_header = [\"idempotency-key\", \"x-idempotency-key\"]",
        "scope_headers = [\"authorization\", \"stripe-account\"]",
        "fingerprint = { ignore = [\"/metadata/trace_id\"] }",
        "in_flight = \"wait 10s\"",
        "store_headers = [\"request-id\"]",
        "errors = \"stripe\"",
        "key_header = [\"x-github-delivery\"]",
        "key_from = \"body:/id\"",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    // Every route says every rule, its defaults filled in: the webhook routes inherit.
    assert_eq!(stdout.matches("retention = \"24h\"").count(), 4, "{stdout}");
    assert_eq!(
        stdout.matches("in_flight = \"wait 5s\"").count(),
        3,
        "{stdout}"
    );
    assert_eq!(stdout.matches("in_flight = \"409\"").count(), 0, "{stdout}");
    // Where the credential is, and what a request without it gets: the webhook routes are
    // scoped by their route, the others refuse it.
    assert!(
        stdout.contains("credential = \"header:authorization\""),
        "{stdout}"
    );
    assert_eq!(
        stdout.matches("anonymous = \"route\"").count(),
        2,
        "{stdout}"
    );
    assert_eq!(
        stdout.matches("anonymous = \"refuse\"").count(),
        2,
        "{stdout}"
    );
    // Nothing was started and no secret was made.
    assert!(!dir.path().join("idem-proxy.secret").exists());
    assert!(!dir.path().join("idem-proxy.db").exists());
}

/// A session cookie as the credential, from the file or the flags; `--credential-header`
/// still names a header; `anonymous` from the file or `--anonymous`.
#[test]
fn the_credential_and_the_anonymous_rule_come_from_the_file_or_the_flags() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "gateway.toml",
        "upstream = \"http://127.0.0.1:1\"\ncredential = \"cookie:session\"\n\n[[route]]\nmatch = \"POST /public/quotes\"\nanonymous = \"shared\"\n",
    );
    let check = |extra: &[&str]| {
        let mut args = vec!["proxy", "--check-config", &path];
        args.extend_from_slice(extra);
        let out = idem(dir.path(), &args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {stdout}");
        stdout
    };
    let from_file = check(&[]);
    assert!(
        from_file.contains("credential = \"cookie:session\""),
        "{from_file}"
    );
    assert!(from_file.contains("anonymous = \"shared\""), "{from_file}");
    assert!(from_file.contains("anonymous = \"refuse\""), "{from_file}");
    let flagged = check(&["--credential", "cookie:sid", "--anonymous", "shared"]);
    assert!(flagged.contains("credential = \"cookie:sid\""), "{flagged}");
    assert_eq!(
        flagged.matches("anonymous = \"shared\"").count(),
        2,
        "{flagged}"
    );
    let header = check(&["--credential-header", "X-Api-Key"]);
    assert!(
        header.contains("credential = \"header:x-api-key\""),
        "{header}"
    );
    assert!(
        header.contains("scope_headers = [\"x-api-key\"]"),
        "{header}"
    );

    for (flags, needle) in [
        (
            &["--credential", "session"][..],
            "expected \"header:NAME\" or \"cookie:NAME\"",
        ),
        (
            &["--anonymous", "allow"][..],
            "expected \"refuse\", \"route\" or \"shared\"",
        ),
        (
            &["--credential", "cookie:s", "--credential-header", "x-a"][..],
            "cannot be used with",
        ),
    ] {
        let mut args = vec!["proxy", "--check-config", &path];
        args.extend_from_slice(flags);
        let out = idem(dir.path(), &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(needle), "{flags:?}: {stderr}");
    }
}

/// README's HTTPS walk-through runs `examples/gateway.toml`: it must stay a valid file with
/// the routes the walk-through shows.
#[test]
fn the_shipped_example_configuration_is_valid() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/gateway.toml");
    let dir = tempfile::tempdir().unwrap();
    let stdout = valid_config(dir.path(), example);
    for line in [
        "upstream = \"https://localhost:3443/\"",
        "match = \"POST /charges\"",
        "scope_headers = [\"authorization\", \"stripe-account\"]",
        "errors = \"stripe\"",
        "key_header = [\"x-github-delivery\"]",
        "key_from = \"body:/id\"",
        "match = \"POST /search\"\nkey = \"off\"",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
}

#[test]
fn flags_override_the_files_top_level_values() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "gateway.toml", GOOD);
    let out = idem(
        dir.path(),
        &[
            "proxy",
            "--check-config",
            &path,
            "--retention-secs",
            "60",
            "--errors",
            "stripe",
            "--in-flight",
            "409",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    // The defaults and the three routes that do not set their own take the flags.
    assert_eq!(stdout.matches("retention = \"1m\"").count(), 4, "{stdout}");
    assert_eq!(stdout.matches("errors = \"stripe\"").count(), 4, "{stdout}");
    // The two webhook routes and the defaults; the charges route keeps its own wait.
    assert_eq!(stdout.matches("in_flight = \"409\"").count(), 3, "{stdout}");
    assert_eq!(
        stdout.matches("in_flight = \"wait 10s\"").count(),
        1,
        "{stdout}"
    );
}

/// `--in-flight` reads waits as the file does, with the same longest wait.
#[test]
fn the_in_flight_flag_takes_the_files_waits_and_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "gateway.toml",
        "upstream = \"http://127.0.0.1:1\"\n",
    );
    let check = |in_flight: &str| {
        idem(
            dir.path(),
            &["proxy", "--check-config", &path, "--in-flight", in_flight],
        )
    };
    let out = check("wait 1m");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("in_flight = \"wait 1m\""), "{stdout}");
    for (refused, needle) in [
        ("wait 2m", "waits at most 1m"),
        ("wait 1h", "waits at most 1m"),
        ("wait 0s", "not a duration"),
        ("410", "expected \"409\""),
    ] {
        let out = check(refused);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{refused}: {stderr}");
        assert!(stderr.contains("--in-flight"), "{refused}: {stderr}");
        assert!(stderr.contains(needle), "{refused}: {stderr}");
    }
}

#[test]
fn check_config_names_the_line_of_each_error() {
    let dir = tempfile::tempdir().unwrap();
    for (n, (text, line, needle)) in [
        ("upstream = \"http://a:1\"\n\nlisen = \"x\"\n", 3, "unknown field `lisen`"),
        ("[[route]]\nmatch = \"POST /v1/*\"\n[[route]]\nmatch = \"POST /v1/charges\"\n", 4, "can never match"),
        ("[[route]]\nmatch = \"FETCH /a\"\n", 2, "method"),
        ("[[route]]\nmatch = \"POST /a\"\nretention = \"a week\"\n", 3, "not a duration"),
        ("[[route]]\nmatch = \"POST /a\"\nfingerprint = { ignore = [\"trace_id\"] }\n", 3, "JSON pointer"),
        ("[[route]]\nmatch = \"POST /a\"\nfingerprint = { ignore = [\"/a\"], only = [\"/b\"] }\n", 3, "not both"),
        ("[[route]]\nmatch = \"POST /a\"\nkey_header = [\"K-Key\"]\nkey_from = \"body:/id\"\n", 3, "cannot both"),
        ("[[route]]\nmatch = \"POST /a\"\nin_flight = \"wait forever\"\n", 3, "not a duration"),
        ("store = \"sqlite://x.db\"\nin_flight = \"wait 2m\"\n", 2, "waits at most 1m"),
        ("upstream = \"http://a:1\"\ncredential = \"cookie:\"\n", 2, "cookie:NAME"),
        ("[[route]]\nmatch = \"POST /a\"\nanonymous = \"nobody\"\n", 3, "expected \"refuse\""),
    ]
    .into_iter()
    .enumerate()
    {
        let path = write(dir.path(), &format!("bad-{n}.toml"), text);
        let out = idem(dir.path(), &["proxy", "--check-config", &path]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text:?}: {stderr}");
        assert!(stderr.contains(&format!("{path}: line {line}: ")), "{text:?}: {stderr}");
        assert!(stderr.contains(needle), "{text:?}: {stderr}");
    }
}

/// The gateway started from a file: a webhook delivered twice reaches the upstream once, an
/// `off` route passes every request, and a path no route names keeps the default rules.
#[tokio::test]
async fn the_proxy_serves_the_files_routes() {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new().fallback({
        let calls = calls.clone();
        move || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { (axum::http::StatusCode::CREATED, "done") }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let dir = tempfile::tempdir().unwrap();
    // The file's upstream is wrong on purpose: the flag overrides it.
    let config = "upstream = \"http://127.0.0.1:1\"\nstore = \"sqlite://gw.db\"\n\n[[route]]\nmatch = \"POST /webhooks/stripe\"\nkey_from = \"body:/id\"\n[[route]]\nmatch = \"POST /search\"\nkey = \"off\"\n";
    let path = write(dir.path(), "gateway.toml", config);
    let args = [
        "--config",
        &path,
        "--secret",
        "a-test-secret-of-enough-bytes",
    ];
    let proxy = Idem::start_proxy(dir.path(), &upstream, &args, dir.path().join("proxy.log")).await;
    let url = proxy.url.clone();
    let client = reqwest::Client::new();
    let post = |path: &str, body: &str| {
        client
            .post(format!("{url}{path}"))
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
    };
    let event = r#"{"id":"evt_0001abcd","type":"charge.succeeded"}"#;
    let first = post("/webhooks/stripe", event).await.unwrap();
    let again = post("/webhooks/stripe", event).await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    for _ in 0..2 {
        assert_eq!(post("/search", "{}").await.unwrap().status(), 201);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(
        post("/orders", "{}").await.unwrap().status(),
        400,
        "the default: a key is required"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}
