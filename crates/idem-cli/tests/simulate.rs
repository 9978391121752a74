//! `idem simulate` through the real fault injector and a real `idem serve`: the statistics
//! of a small run, the database afterwards, and the `--json` shape of the binary.

use std::process::Command;

use idem_cli::simulate::{SimulateConfig, simulate};
use indicatif::ProgressBar;
use sqlx::sqlite::SqlitePool;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_intents_at_ten_percent_match_the_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("sim.db").display());
    let n = 2_000u64;
    let p = 0.10;
    let mut config = SimulateConfig::new(n, vec![p]);
    config.database = Some(url.clone());
    let report = simulate(&config, &ProgressBar::hidden()).await.unwrap();

    assert_eq!(report.rates.len(), 1);
    let rate = &report.rates[0];
    let (without, with) = (&rate.without_keys, &rate.with_keys);
    let n_f = n as f64;

    // Without keys: about N·p intents charged twice or more, N·p/(1−p) extra charges.
    let incidents = without.double_charge_incidents as f64;
    assert!(
        (incidents - n_f * p).abs() <= 0.4 * n_f * p,
        "incidents {incidents}, expected about {}",
        n_f * p
    );
    let extra = without.extra_charges as f64;
    let expected_extra = n_f * p / (1.0 - p);
    assert!(
        (extra - expected_extra).abs() <= 0.4 * expected_extra,
        "extra charges {extra}, expected about {expected_extra}"
    );
    assert_eq!(without.charges_in_db, n + without.extra_charges);
    // Every lost answer was a real commit followed by a real retry: the charges beyond one per
    // intent are exactly the answers the fault injector cut.
    assert_eq!(without.extra_charges, without.run.answers_lost);
    assert_eq!(without.run.intents_charged, n);

    // With keys: the same faults (same seed), no double charge, one charge per intent, and
    // every lost answer's retry answered from the stored response.
    assert_eq!(with.double_charges, 0);
    assert_eq!(with.charges_in_db, n);
    assert_eq!(with.run.intents_charged, n);
    assert_eq!(with.run.answers_lost, without.run.answers_lost);
    assert_eq!(with.duplicates_prevented, with.run.answers_lost);
    assert_eq!(with.run.attempts, n + with.duplicates_prevented);
    assert_eq!(with.run.unanswered + without.run.unanswered, 0);
    assert!(report.keys_held());

    // The database, read on its own: with keys, exactly one payment per intent, each under a
    // key of its own.
    let db = SqlitePool::connect(&url).await.unwrap();
    let (payments, intents, keys, most): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT COUNT(*), COUNT(DISTINCT reference), COUNT(DISTINCT idem_key),
                (SELECT MAX(c) FROM (SELECT COUNT(*) AS c FROM payments
                                     WHERE account_id = ?1 GROUP BY reference))
         FROM payments WHERE account_id = ?1",
    )
    .bind(&with.run.account)
    .fetch_one(&db)
    .await
    .unwrap();
    assert_eq!((payments, intents, keys, most), (2_000, 2_000, 2_000, 1));
    let (payments, keyed): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COUNT(idem_key) FROM payments WHERE account_id = ?1")
            .bind(&without.run.account)
            .fetch_one(&db)
            .await
            .unwrap();
    assert_eq!(payments as u64, without.charges_in_db);
    assert_eq!(keyed, 0, "the baseline sends no keys");
    db.close().await;
}

#[test]
fn the_binary_prints_the_documented_json_and_draws_the_chart() {
    let dir = tempfile::tempdir().unwrap();
    let chart = dir.path().join("sim.svg");
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "simulate",
            "--requests",
            "200",
            "--loss",
            "0.05,0.10",
            "--json",
        ])
        .arg("--plot")
        .arg(&chart)
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stdout)));

    let rates = json["rates"].as_array().expect("rates is an array");
    assert_eq!(rates.len(), 2);
    for (rate, loss) in rates.iter().zip([0.05, 0.10]) {
        assert_eq!(rate["loss"], loss);
        assert_eq!(rate["requests"], 200);
        for field in ["double_charge_incidents", "extra_charges", "charges_in_db"] {
            assert!(
                rate["without_keys"][field].is_u64(),
                "without_keys.{field} in {rate}"
            );
        }
        for field in ["double_charges", "duplicates_prevented", "charges_in_db"] {
            assert!(
                rate["with_keys"][field].is_u64(),
                "with_keys.{field} in {rate}"
            );
        }
        assert_eq!(rate["with_keys"]["double_charges"], 0);
        assert_eq!(rate["with_keys"]["charges_in_db"], 200);
        let extra = rate["without_keys"]["extra_charges"].as_u64().unwrap();
        assert_eq!(rate["without_keys"]["charges_in_db"], 200 + extra);
        assert_eq!(rate["with_keys"]["duplicates_prevented"], extra);
    }

    let svg = std::fs::read_to_string(&chart).expect("the chart was written");
    assert!(svg.starts_with("<svg"), "{svg:.80}");
    assert!(svg.contains("<polyline"));
}

#[test]
fn loss_rates_outside_zero_to_one_are_refused() {
    for bad in ["1", "1.5", "-0.1", "five"] {
        let output = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["simulate", &format!("--loss={bad}")])
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "--loss {bad}");
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("--loss"),
            "--loss {bad}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_seed_gives_the_same_figures() {
    let figures = |seed: u64| async move {
        let mut config = SimulateConfig::new(300, vec![0.2]);
        config.seed = seed;
        let report = simulate(&config, &ProgressBar::hidden()).await.unwrap();
        let r = &report.rates[0];
        (
            r.without_keys.double_charge_incidents,
            r.without_keys.extra_charges,
            r.with_keys.duplicates_prevented,
        )
    };
    let first = figures(7).await;
    assert_eq!(first, figures(7).await);
    assert_ne!(first, figures(8).await, "another seed, other faults");
}
