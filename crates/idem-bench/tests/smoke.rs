//! A smoke run of the workloads that need nothing beyond this repository, so the harness
//! cannot rot: `idem-bench --quick --json` on the layer and replays on SQLite, the gateway on
//! SQLite, the micro-benchmarks, and `idem serve`'s memory with 256 connections open. The figures are not checked against targets (a shared
//! CI machine says little about speed), only that the report has its shape and every number
//! is a positive measurement.

mod common;

use common::{measured_rows, positive, run_bench};

#[test]
fn quick_run_of_the_self_contained_workloads() {
    let (report, _) = run_bench(&[
        "--quick",
        "--concurrency",
        "8",
        "--only",
        "micro,serve-sqlite,gateway-sqlite,memory",
    ]);

    assert_eq!(report["version"], 1);
    assert_eq!(report["settings"]["quick"], true);
    assert_eq!(report["settings"]["concurrency"], 8);
    positive(&report["wall_secs"], "wall_secs");
    positive(&report["machine"]["cpus"], "cpus");

    let micro = report["micro"].as_array().expect("micro results");
    let ids: Vec<&str> = micro.iter().map(|m| m["id"].as_str().unwrap()).collect();
    for id in [
        "key-bare",
        "key-sf-string",
        "fingerprint-1k",
        "fingerprint-64k",
        "decide-replay",
    ] {
        assert!(ids.contains(&id), "no micro-benchmark {id}: {ids:?}");
    }
    for m in micro {
        positive(&m["ns_per_op"], "ns_per_op");
    }

    let rows = measured_rows(
        &report,
        &[
            "layer-sqlite",
            "layer-sqlite-grouped",
            "replays-sqlite",
            "layer-sqlite-claim-first",
            "replays-sqlite-claim-first",
            "gateway-sqlite",
        ],
    );
    for (id, row) in rows {
        assert_eq!(row["ratio_rounds"].as_array().unwrap().len(), 2, "{id}");
        // Each row but the claiming-first ones answers one of the targets.
        if !id.ends_with("claim-first") {
            assert!(row["target"]["ratio"].is_number(), "{id} has a target");
            assert!(row["met"].is_boolean(), "{id} says whether it met it");
        }
        for side in ["a", "b"] {
            let s = &row[side];
            for field in ["throughput", "p50_ms", "p99_ms"] {
                positive(&s[field], &format!("{id} {side}.{field}"));
            }
            assert!(s["label"].as_str().is_some_and(|l| !l.is_empty()));
            for round in s["rounds"].as_array().expect("rounds") {
                positive(&round["requests"], &format!("{id} {side} requests"));
                assert_eq!(round["errors"], 0, "{id} {side}: {round}");
            }
        }
        assert!(row["added_p50_ms"].is_number() && row["added_p99_ms"].is_number());
    }

    let memory = &report["memory"];
    assert_eq!(memory["status"], "ok", "memory: {}", memory["reason"]);
    assert_eq!(memory["connections"], 256);
    let idle = positive(&memory["rss_idle_mib"], "rss_idle_mib");
    let peak = positive(&memory["rss_peak_mib"], "rss_peak_mib");
    assert!(
        peak >= idle,
        "the peak {peak} MiB is below the idle {idle} MiB"
    );
    positive(&memory["connections_seen"], "connections_seen");
    positive(&memory["throughput"], "memory throughput");
    assert_eq!(memory["errors"], 0);
}

/// The instruction counts run their children under callgrind (valgrind, which the test
/// command installs, and Redis) and report a count per request for both proxies; the gateway
/// does everything the plain proxy does and more, so it must count more.
#[test]
fn quick_count_of_instructions_per_request() {
    let (report, _) = run_bench(&["--quick", "--only", "instructions"]);
    let counts = report["instructions"]
        .as_array()
        .expect("instruction counts");
    let count = |id: &str| {
        let found = counts
            .iter()
            .find(|c| c["id"] == id)
            .unwrap_or_else(|| panic!("no count {id}: {counts:?}"));
        assert_eq!(found["requests"], 100, "{id}");
        positive(&found["per_request"], &format!("{id} per_request: {found}"))
    };
    let (gateway, plain) = (count("proxy-redis"), count("plain-proxy"));
    assert!(
        gateway > plain,
        "idem proxy counted {gateway} instructions a request, the plain proxy {plain}"
    );
    let target = counts.iter().find(|c| c["id"] == "proxy-redis").unwrap();
    assert_eq!(target["target"], 160_000);
}
