//! A smoke run of the opt-in growth groups at a small size (`--growth-records 2000`), so their
//! filling, sweeping and sizes cannot rot: the rows are measured with finite ratios, and the
//! key tables are reported with their sizes. Needs the PostgreSQL server of the other tests
//! (IDEM_TEST_PG_URL, default postgres://postgres@127.0.0.1:5432/postgres).

mod common;

use common::{measured_rows, positive, run_bench};

#[test]
fn quick_run_of_the_growth_groups() {
    let (report, stderr) = run_bench(&[
        "--quick",
        "--concurrency",
        "8",
        "--growth-records",
        "2000",
        "--only",
        "growth-postgres,growth-sqlite",
    ]);
    // The filling is long at full size, so it is reported as it happens.
    assert!(stderr.contains("filling 2,000 records"), "{stderr}");

    let rows = measured_rows(
        &report,
        &[
            "growth-postgres-live",
            "growth-postgres-swept",
            "growth-sqlite-live",
            "growth-sqlite-swept",
        ],
    );
    for (id, row) in rows {
        assert_eq!(row["target"]["ratio"], 0.9, "{id}");
        assert!(row["met"].is_boolean(), "{id} says whether it met it");
        for side in ["a", "b"] {
            positive(&row[side]["throughput"], &format!("{id} {side}"));
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
            positive(&table["total_bytes"], &format!("{label} total_bytes"));
            positive(&table["table_bytes"], &format!("{label} table_bytes"));
            positive(&table["indexes_bytes"], &format!("{label} indexes_bytes"));
            assert!(table["fill_secs"].as_f64().is_some_and(f64::is_finite));
        }
        if table["group"] == "growth-sqlite" {
            positive(&table["file_bytes"], &format!("{label} file_bytes"));
        }
    }
}
