//! Python's grpcio (PyPI) as a client of `payments.v1.Payments`, with its own retry policy:
//! `scripts/grpc_python.py`, run with the venv `scripts/grpc_python.sh` installs (once, under
//! `~/.cache/idem-tools`), sends each key from several threads at once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The workspace's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The venv's python, with grpcio installed into it first if it is not there.
fn python() -> PathBuf {
    let script = root().join("scripts/grpc_python.sh");
    let output = std::process::Command::new("bash")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    assert!(
        output.status.success(),
        "{} failed (it installs grpcio from PyPI into a venv): {}",
        script.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

/// Runs `scripts/grpc_python.py` against `target` (`HOST:PORT`) with `args` (`--keys`,
/// `--copies`, `--prefix`, `--account`, …); what each copy of each key got: `code`, and `id`
/// and `replayed` when it is `OK`.
///
/// # Panics
///
/// When grpcio cannot be installed or the script fails.
pub async fn grpcio(target: &str, args: &[&str]) -> BTreeMap<String, Vec<Value>> {
    let proto = root().join("crates/idem-grpc-tests/proto/payments.proto");
    let output = tokio::process::Command::new(python())
        .arg(root().join("scripts/grpc_python.py"))
        .arg("--target")
        .arg(target)
        .arg("--proto")
        .arg(proto)
        .args(args)
        .output()
        .await
        .expect("run grpc_python.py");
    assert!(
        output.status.success(),
        "grpc_python.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("grpc_python.py prints JSON")
}

/// Checks that every copy of every key succeeded with the one payment of its key; returns the
/// keys. Prints how many copies were replays.
///
/// # Panics
///
/// When a copy failed, or two copies of a key got two payments.
pub fn assert_one_payment_per_key(
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
                a["id"].as_str().expect("an OK answer has an id")
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
