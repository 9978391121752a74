//! A smoke run of the opt-in growth groups at a small size (`--growth-records 2000`), so their
//! filling, sweeping and sizes cannot rot: the rows are measured with finite ratios, and the
//! key tables are reported with their sizes. Needs the PostgreSQL server of the other tests
//! (IDEM_TEST_PG_URL, default postgres://postgres@127.0.0.1:5432/postgres).

use std::process::Command;

use serde_json::Value;

fn finite_positive(value: &Value, what: &str) -> f64 {
    let n = value
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {value}"));
    assert!(n > 0.0 && n.is_finite(), "{what} is not positive: {n}");
    n
}

#[test]
fn quick_run_of_the_growth_groups() {
    let out = Command::new(env!("CARGO_BIN_EXE_idem-bench"))
        .args([
            "--quick",
            "--json",
            "--concurrency",
            "8",
            "--growth-records",
            "2000",
            "--only",
            "growth-postgres,growth-sqlite",
        ])
        .output()
        .expect("run idem-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "idem-bench failed: {stderr}\n{stdout}"
    );
    // The filling is long at full size, so it is reported as it happens.
    assert!(stderr.contains("filling 2,000 records"), "{stderr}");
    let report: Value = serde_json::from_str(&stdout).expect("JSON on stdout");

    let rows = report["rows"].as_array().expect("rows");
    let ids: Vec<&str> = rows.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        [
            "growth-postgres-live",
            "growth-postgres-swept",
            "growth-sqlite-live",
            "growth-sqlite-swept"
        ]
    );
    for row in rows {
        let id = row["id"].as_str().unwrap();
        assert_eq!(row["status"], "ok", "{id}: {}", row["reason"]);
        finite_positive(&row["ratio"], &format!("{id} ratio"));
        assert_eq!(row["target"]["ratio"], 0.9, "{id}");
        assert!(row["met"].is_boolean(), "{id} says whether it met it");
        for side in ["a", "b"] {
            finite_positive(&row[side]["throughput"], &format!("{id} {side}"));
        }
    }

    let tables = report["key_tables"].as_array().expect("key tables");
    assert_eq!(tables.len(), 6, "empty, live and swept, per group");
    for table in tables {
        let label = table["label"].as_str().unwrap();
        let records = table["records"].as_u64().expect("records");
        assert_eq!(records == 0, table["variant"] == "empty", "{label}");
        let expected = match (table["group"].as_str().unwrap(), table["variant"].as_str()) {
            (_, Some("empty")) => 0,
            ("growth-postgres", Some("live")) => 2000,
            _ => 200,
        };
        assert_eq!(records, expected, "{label}");
        if records > 0 {
            finite_positive(&table["total_bytes"], &format!("{label} total_bytes"));
            finite_positive(&table["table_bytes"], &format!("{label} table_bytes"));
            finite_positive(&table["indexes_bytes"], &format!("{label} indexes_bytes"));
            assert!(table["fill_secs"].as_f64().is_some_and(f64::is_finite));
        }
        if table["group"] == "growth-sqlite" {
            finite_positive(&table["file_bytes"], &format!("{label} file_bytes"));
        }
    }
}
