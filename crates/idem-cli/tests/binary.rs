//! The `idem` binary as a newcomer runs it: `idem serve` with no set-up.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

#[tokio::test]
async fn serve_starts_on_a_fresh_sqlite_file_with_no_setup() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let url = first
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .to_owned();
    assert!(first.contains("sqlite://idem.db"), "{first}");

    let client = reqwest::Client::new();
    let health: serde_json::Value = client
        .get(format!("{url}/healthz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "ok");
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
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(child.wait().unwrap().success());
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
