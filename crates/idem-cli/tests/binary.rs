//! The `idem` binary as a newcomer runs it: `idem serve` with no set-up.

use std::process::Command;

use crate::common::{Spawned, assert_healthy};

#[tokio::test]
async fn serve_starts_on_a_fresh_sqlite_file_with_no_setup() {
    let dir = tempfile::tempdir().unwrap();
    let mut serve = Spawned::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .current_dir(dir.path()),
    );
    let first = &serve.first_line;
    assert!(first.contains("sqlite://idem.db"), "{first}");
    let url = &serve.url;

    let client = reqwest::Client::new();
    assert_healthy(&client, url).await;
    let created = client
        .post(format!("{url}/payments"))
        .bearer_auth("sk_test_alice")
        .header("idempotency-key", "first-run-key-1")
        .header("content-type", "application/json")
        .body(r#"{"amount": 49900, "currency": "INR"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    assert!(
        dir.path().join("idem.db").exists(),
        "the database file was created"
    );

    // SIGTERM shuts it down cleanly.
    assert!(serve.terminate().success());
}

#[test]
fn bad_flags_fail_with_a_clear_message_and_exit_code() {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--token", "no-equals-sign"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("expected TOKEN=ACCOUNT"), "{stderr}");

    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database",
            "mysql://x",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unsupported database URL"), "{stderr}");
}

/// A failure prints its chain of causes once each, on one line: here sqlx's own error holds its
/// cause both in its message and as its source, which `{:#}` would print twice.
#[test]
fn a_failure_prints_each_cause_once() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--listen", "127.0.0.1:0", "--database"])
        .arg(format!("postgres://postgres@127.0.0.1:{port}/idem"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .find(|l| l.starts_with("idem: "))
        .unwrap_or_else(|| panic!("no error line in {stderr}"));
    assert!(line.contains("cannot open the database"), "{line}");
    assert_eq!(line.matches("Connection refused").count(), 1, "{line}");
}
