//! `idem simulate`: the ACK-loss experiment (docs/contract.md §8) over real HTTP with real faults.
//!
//! A published write-up of the Idempotency-Key pattern modelled, in a few lines of numpy,
//! 10,000 payment requests (seed 42) whose answers are lost with probability p and retried:
//! without idempotency 101 / 508 / 984 requests were charged more than once at 1 / 5 / 10 %
//! loss; with a key, none. This runs the same experiment against the real system:
//!
//! - an `idem serve` in this process, on a fresh SQLite file in a temporary folder (or the
//!   `--database` given), with keys optional so that requests without one go through
//!   unprotected;
//! - a fault injector (`simulate/proxy.rs`) on loopback between client and server that lets each request through,
//!   waits for the server's whole answer (the server has committed), and then, with
//!   probability p, closes the client's connection instead of relaying it;
//! - `idem-client` as a caller would use it, retrying each intent until an answer arrives
//!   (at most 20 retries);
//! - for each rate, the N intents twice, without keys and then with one key per intent; and
//!   afterwards the charges counted in the database, not in the client's memory.
//!
//! Expected: without keys about N·p intents charged more than once and N·p/(1−p) extra
//! charges (each attempt is lost with probability p, so an intent is charged 1/(1−p) times on
//! average); with keys exactly one charge per intent.
//!
//! **Runs share one database, one account each.** Every (rate, variant) run authenticates as
//! an account of its own, named after a run id (`sim-<uuid v7>-p<rate>-<variant>`), and the
//! counts are taken per account. So a `--database` that already holds payments (or an earlier
//! simulation) is neither disturbed nor miscounted, and nothing is ever deleted.

use std::path::PathBuf;
use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressDrawTarget};

use crate::store_url::StoreUrl;

pub use self::config::SimulateConfig;
pub use self::report::{Expected, RateReport, Report, RunFacts, WithKeys, WithoutKeys};
pub use self::run::simulate;

mod config;
mod plot;
mod proxy;
mod report;
mod run;
mod server;

/// `idem simulate` flags.
///
/// Exit code 0 when every intent with a key was charged exactly once, 1 when idempotency
/// failed (a double charge or a missing charge with keys), 2 when the simulation could not
/// run.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// Payment intents per loss rate; each rate runs them twice, without and with keys.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: u64,
    /// Rates at which answers are lost after the server committed, comma-separated fractions
    /// in [0, 1).
    #[arg(long, value_delimiter = ',', default_value = "0.01,0.05,0.10", value_parser = parse_loss)]
    pub loss: Vec<f64>,
    /// Seed of the fault schedule (which attempts lose their answer) and of the client's
    /// jitter: the same seed gives the same figures.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Intents in flight at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub concurrency: u64,
    /// Where the service keeps payments, `sqlite://PATH`. Default: a fresh file in a
    /// temporary folder, removed afterwards.
    #[arg(long, value_parser = parse_database)]
    pub database: Option<String>,
    /// Print the figures as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also draw extra charges against loss rate, both variants, to this SVG file (a `.png`
    /// name gives a PNG).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

fn parse_loss(s: &str) -> Result<f64, String> {
    let loss: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    // At 1 every answer is lost and no intent could ever end.
    if (0.0..1.0).contains(&loss) {
        Ok(loss)
    } else {
        Err(format!(
            "a loss rate is a fraction in [0, 1), such as 0.05; got {s}"
        ))
    }
}

fn parse_database(s: &str) -> Result<String, String> {
    // The charges are counted with a SQLite connection of our own.
    if let Ok(StoreUrl::Sqlite(url)) = StoreUrl::parse(s) {
        Ok(url)
    } else {
        Err(format!(
            "idem simulate runs on SQLite: expected sqlite://PATH, got {s:?}"
        ))
    }
}

impl From<&SimulateArgs> for SimulateConfig {
    fn from(args: &SimulateArgs) -> Self {
        Self {
            requests: args.requests,
            losses: args.loss.clone(),
            seed: args.seed,
            concurrency: args.concurrency,
            database: args.database.clone(),
        }
    }
}

/// Runs `idem simulate`; prints the table (or JSON) and draws the chart.
pub async fn run(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    let config = SimulateConfig::from(&args);
    let progress = if args.json || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
    };
    let report = simulate(&config, &progress).await?;
    progress.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    if let Some(path) = &args.plot {
        plot::draw(path, &report)?;
        if !args.json {
            println!("Chart: {}", path.display());
        }
    }
    Ok(if report.keys_held() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
