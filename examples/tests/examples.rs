//! Each example as a user would run it: its own binary on a port of its own, its database
//! fresh. The HTTP ones face `idem drill --profile idem --strict` (the same contract checks for
//! every stack; a FAIL or a WARN fails the test, and the report is printed either way); the
//! tonic one faces Python's grpcio with its retry policy, each key sent from several threads.

use std::process::Stdio;
use std::time::Duration;

use idem_cli::drill::{Drill, DrillConfig, Profile};
use idem_testkit::grpcio::{assert_one_payment_per_key, grpcio};
use idem_testkit::postgres::PgTestDatabase;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// An example running until dropped; where it listens.
struct Example {
    _child: Child,
    base: String,
}

/// Starts the example binary `exe` with `env`, and waits (at most 60 s) for the line that says
/// where it listens.
async fn start(exe: &str, env: &[(&str, &str)]) -> Example {
    let mut child = Command::new(exe)
        .env("IDEM_EXAMPLE_ADDR", "127.0.0.1:0")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("start {exe}: {e}"));
    let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let listening = async {
        while let Some(line) = lines.next_line().await.expect("read the example's stdout") {
            if let Some(base) = line.strip_prefix("listening on ") {
                return base.to_owned();
            }
        }
        panic!("{exe} ended without saying where it listens")
    };
    let base = tokio::time::timeout(Duration::from_secs(60), listening)
        .await
        .unwrap_or_else(|_| panic!("{exe} did not say where it listens within 60 s"));
    // Keep reading, so a full pipe never blocks the example.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Example {
        _child: child,
        base,
    }
}

/// Drills `example` under idem's own profile, strict, and prints the report.
async fn drill(name: &str, example: &Example) {
    let url = format!("{}/payments", example.base).parse().expect("a URL");
    let mut config = DrillConfig::new(url, "sk_test_alice", "sk_test_bob");
    config.profile = Profile::Idem;
    config.strict = true;
    let report = Drill::new(config)
        .expect("a valid drill")
        .run()
        .await
        .expect("the drill runs");
    println!(
        "idem drill --profile idem --strict against {name}:\n{}",
        report.table()
    );
    assert_eq!(
        (report.failed(), report.warned()),
        (0, 0),
        "{name} departs from idem's contract: {:?} failed, {:?} warned",
        report.names(idem_cli::drill::Status::Fail),
        report.names(idem_cli::drill::Status::Warn),
    );
}

#[tokio::test]
async fn axum_on_sqlite_in_transaction_mode_passes_the_drill() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let db = dir.path().join("payments.db");
    let example = start(
        env!("CARGO_BIN_EXE_axum-sqlite"),
        &[("IDEM_EXAMPLE_DB", db.to_str().expect("a UTF-8 path"))],
    )
    .await;
    drill("axum-sqlite", &example).await;
}

#[tokio::test]
async fn axum_on_postgres_in_transaction_mode_passes_the_drill() {
    let db = PgTestDatabase::create().await;
    let example = start(
        env!("CARGO_BIN_EXE_axum-postgres"),
        &[("DATABASE_URL", db.url())],
    )
    .await;
    drill("axum-postgres", &example).await;
}

#[tokio::test]
async fn axum_in_lease_mode_with_a_downstream_passes_the_drill() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let db = dir.path().join("payments.db");
    let example = start(
        env!("CARGO_BIN_EXE_axum-lease"),
        &[("IDEM_EXAMPLE_DB", db.to_str().expect("a UTF-8 path"))],
    )
    .await;
    drill("axum-lease", &example).await;
}

#[tokio::test]
async fn actix_web_on_sqlite_in_transaction_mode_passes_the_drill() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let db = dir.path().join("payments.db");
    let example = start(
        env!("CARGO_BIN_EXE_actix"),
        &[("IDEM_EXAMPLE_DB", db.to_str().expect("a UTF-8 path"))],
    )
    .await;
    drill("actix", &example).await;
}

#[tokio::test]
async fn tonic_in_transaction_mode_makes_one_payment_per_key_under_grpcio_retries() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let db = dir.path().join("payments.db");
    let db = db.to_str().expect("a UTF-8 path");
    let example = start(env!("CARGO_BIN_EXE_tonic"), &[("IDEM_EXAMPLE_DB", db)]).await;
    let target = example.base.trim_start_matches("http://");
    let results = grpcio(
        target,
        &[
            "--keys",
            "20",
            "--copies",
            "4",
            "--account",
            "sk_test_alice",
        ],
    )
    .await;
    let keys = assert_one_payment_per_key("grpcio against the tonic example", &results);
    let replayed = results
        .values()
        .flatten()
        .filter(|answer| answer["replayed"] == true)
        .count();
    assert_eq!(
        replayed,
        3 * keys.len(),
        "every copy but the first of each key replays"
    );
    // One row per key in the example's own table, written through the layer's transaction.
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{db}"))
        .await
        .expect("open the example's database");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(&pool)
        .await
        .expect("count the payments");
    assert_eq!(rows, 20, "one payment per key");
}
