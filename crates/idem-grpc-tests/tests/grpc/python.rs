//! Python's grpcio (PyPI), with its own retry policy (a service config `retryPolicy` for
//! `UNAVAILABLE` and `ABORTED`, `grpc.enable_retries`), sending each key from several threads
//! at once: one payment per key. The client is scripts/grpc_python.py, run with the venv that
//! scripts/grpc_python.sh installs (and reuses) under ~/.cache/idem-tools.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::Server;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The venv's python, with grpcio installed into it first if it is not there.
fn python() -> PathBuf {
    let script = root().join("scripts/grpc_python.sh");
    let output = std::process::Command::new("bash")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{} failed (it installs grpcio from PyPI into a venv): {}",
        script.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    PathBuf::from(String::from_utf8(output.stdout).unwrap().trim())
}

/// Runs scripts/grpc_python.py against `target` with `args`; what each copy of each key got.
pub(crate) async fn grpcio(target: &str, args: &[&str]) -> BTreeMap<String, Vec<Value>> {
    let proto = Path::new(env!("CARGO_MANIFEST_DIR")).join("proto/payments.proto");
    let output = tokio::process::Command::new(python())
        .arg(root().join("scripts/grpc_python.py"))
        .arg("--target")
        .arg(target)
        .arg("--proto")
        .arg(proto)
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "grpc_python.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// Checks that every copy of every key succeeded with the one payment of its key; returns the
/// keys. Prints how many copies were replays.
pub(crate) fn assert_one_payment_per_key(
    label: &str,
    results: &BTreeMap<String, Vec<Value>>,
) -> Vec<String> {
    let mut replays = 0;
    let mut copies = 0;
    for (key, answers) in results {
        let mut ids: Vec<&str> = answers
            .iter()
            .map(|a| {
                assert_eq!(a["code"], "OK", "{key}: {answers:?}");
                a["id"].as_str().unwrap()
            })
            .collect();
        ids.dedup();
        assert_eq!(
            ids.len(),
            1,
            "{key}: one payment for every copy: {answers:?}"
        );
        replays += answers.iter().filter(|a| a["replayed"] == true).count();
        copies += answers.len();
    }
    eprintln!(
        "{label}: {} keys, {copies} calls, all OK, one payment id per key, {replays} replays",
        results.len()
    );
    results.keys().cloned().collect()
}

/// Lease mode: a copy that finds its key in use gets `ABORTED` with a pushback, and grpcio's
/// retry comes back for the replay. `flaky` keys fail `UNAVAILABLE` on their first run, which is
/// not stored, so grpcio's retry runs them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpcio_retries_through_the_lease_layer_make_one_payment_per_key() {
    let server = Server::leased(|l| l).await;
    let target = server.addr.to_string();
    let results = grpcio(
        &target,
        &["--keys", "20", "--copies", "4", "--prefix", "py-lease"],
    )
    .await;
    for key in assert_one_payment_per_key("grpcio, lease mode", &results) {
        assert_eq!(server.payments.made(Some(&key)), 1, "{key}");
    }

    let flaky = grpcio(
        &target,
        &[
            "--keys", "10", "--copies", "3", "--script", "flaky", "--prefix", "py-flaky",
        ],
    )
    .await;
    for key in assert_one_payment_per_key("grpcio, lease mode, flaky", &flaky) {
        assert_eq!(server.payments.made(Some(&key)), 1, "{key}");
        assert_eq!(
            server.payments.runs(Some(&key)),
            2,
            "{key}: the UNAVAILABLE run was not stored"
        );
    }
}

/// Transaction mode: copies wait for the first's commit and replay it; one row per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpcio_through_the_transaction_layer_makes_one_row_per_key() {
    let server = Server::transactional(|l| l).await;
    let results = grpcio(
        &server.addr.to_string(),
        &["--keys", "20", "--copies", "4", "--prefix", "py-tx"],
    )
    .await;
    for key in assert_one_payment_per_key("grpcio, transaction mode", &results) {
        assert_eq!(server.rows(&key).await, 1, "{key}");
    }
}
