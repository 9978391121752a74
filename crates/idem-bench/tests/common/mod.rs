//! What the bench's smoke tests share: running `idem-bench --json` to its end, and checking
//! that a figure is a measurement.

use std::process::Command;

use serde_json::Value;

/// `value` as a number above zero (a measurement), or the test fails naming `what`.
pub(crate) fn positive(value: &Value, what: &str) -> f64 {
    let n = value
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {value}"));
    assert!(n > 0.0 && n.is_finite(), "{what} is not positive: {n}");
    n
}

/// Runs `idem-bench --json` with `args`; its report and what it wrote to stderr, or the test
/// fails with both.
pub(crate) fn run_bench(args: &[&str]) -> (Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem-bench"))
        .arg("--json")
        .args(args)
        .output()
        .expect("run idem-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "idem-bench failed: {stderr}\n{stdout}"
    );
    let report = serde_json::from_str(&stdout).expect("JSON on stdout");
    (report, stderr)
}

/// The report's rows, after checking that they are the rows `ids`, in that order, each
/// measured (`ok`) with a positive ratio; each with its id.
pub(crate) fn measured_rows<'r>(report: &'r Value, ids: &[&str]) -> Vec<(&'r str, &'r Value)> {
    let rows = report["rows"].as_array().expect("rows");
    let found: Vec<&str> = rows.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(found, ids);
    rows.iter()
        .map(|row| {
            let id = row["id"].as_str().unwrap();
            assert_eq!(row["status"], "ok", "{id}: {}", row["reason"]);
            positive(&row["ratio"], &format!("{id} ratio"));
            (id, row)
        })
        .collect()
}
