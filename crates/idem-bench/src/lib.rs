//! What idem costs, measured as ratios that hold on a noisy shared machine.
//!
//! One command runs every workload and prints a table (or `--json`):
//!
//! ```text
//! cargo run --release -p idem-bench
//! cargo run --release -p idem-bench -- --quick --only serve-sqlite,gateway-sqlite --json
//! ```
//!
//! Each workload compares two variants under the same load: a fixed number of keep-alive
//! HTTP/1.1 connections (the harness's own hyper client), each sending one POST after another
//! for a fixed time. Variants of a group are alternated round by round, in rotating order, and
//! a row reports the median over rounds of each side's throughput and latency percentiles, and
//! the median of the per-round throughput ratios B/A. CPU per request by component (idem's
//! threads, PostgreSQL, Redis, a peer, the load generator) is read from `/proc` over each
//! window, so a row also says where the time goes.
//!
//! The rows: the layer against a bare handler doing the same INSERT (SQLite, PostgreSQL);
//! `idem serve` against `pgbench` running its SQL transaction, and against pgbench sending
//! every statement `idem serve` sends (which splits the gap into SQL and everything else);
//! replays against first requests; `idem proxy` against the upstream alone (SQLite,
//! PostgreSQL, Redis), with a plain reverse proxy as the floor any proxy has; `idem proxy`
//! against `idempotent-proxy-server`; idem's layer against `express-idempotency`. The peers are
//! installed into `$HOME/.cache/idem-bench-peers` on first use; a row whose dependency is
//! missing says so and is skipped. The core's micro-benchmarks are timed too (and run under
//! criterion with `cargo bench -p idem-bench`). Instructions per request through `idem proxy`
//! on Redis and through a plain hyper proxy are counted under callgrind (valgrind), the one
//! figure the neighbours' load does not move. Last, the peak resident set of `idem serve` (in
//! a process of its own) with 256 connections open under load.
//!
//! Each row with a target says whether it met it and how far it is from it: `≥ 0.85× MISSED
//! -23%` is 23% short of the ratio, `met +10%` 10% past it.
//!
//! Two groups are opt-in, run only when `--only` names them: `growth-postgres` and
//! `growth-sqlite` fill key tables with millions of records (`--growth-records`) and compare
//! `idem serve` on them, and while its sweeper deletes expired ones, with `idem serve` on an
//! empty table.
//!
//! `--db-latency-ms 0,0.25,1` runs the PostgreSQL and Redis groups once per latency, with a
//! relay that holds every chunk that long each way between the servers (pgbench included)
//! and their database, as if it were on another host; the relay also counts the round trips
//! each request costs. `--compare OLD.json` prints each row's ratio beside the same row's in
//! an earlier `--json` report.
//!
//! ```no_run
//! use clap::Parser as _;
//! let args = idem_bench::Args::parse_from(["idem-bench", "--quick", "--only", "micro"]);
//! let code = idem_bench::run(args)?;
//! # Ok::<(), anyhow::Error>(())
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use tokio::runtime::Handle;

mod child;
pub mod compare;
mod cpu;
pub mod instructions;
mod load;
pub mod memory;
pub mod micro;
mod peers;
mod pgbench;
mod relay;
pub mod report;
pub mod runner;
mod servers;
mod stats;
pub mod workloads;

pub use load::Sample;
pub use report::Report;
pub use workloads::Group;

/// `idem-bench` flags.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "idem-bench",
    version,
    about = "What idem costs: A/B workloads and micro-benchmarks"
)]
pub struct Args {
    /// Smoke mode: two short rounds per variant (a few seconds per workload).
    #[arg(long)]
    pub quick: bool,
    /// Print the report as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Run only these groups (comma-separated). growth-postgres and growth-sqlite are opt-in:
    /// they run only when named here (at full size about 5 and 2 minutes, mostly filling the
    /// key table).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub only: Vec<Group>,
    /// The growth groups' size: live records in growth-postgres's key table (default
    /// 10,000,000; 100,000 with --quick). growth-sqlite's live records, and each group's
    /// expired records, are a tenth of it.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(10..=1_000_000_000))]
    pub growth_records: Option<u64>,
    /// Rounds per variant (default 4; 2 with --quick).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub rounds: Option<u64>,
    /// Measured seconds per run (default 4; 1 with --quick).
    #[arg(long)]
    pub duration_secs: Option<f64>,
    /// Unmeasured seconds before each run's window (default 0.5, as with --quick: the servers
    /// outlive the rounds, so only the load's own connections are new; a second here kept the
    /// full run over ten minutes).
    #[arg(long)]
    pub warmup_secs: Option<f64>,
    /// Concurrent connections (and pgbench clients).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub concurrency: u64,
    /// The Redis server for the Redis workloads. PostgreSQL workloads make throwaway databases
    /// on the server at IDEM_TEST_PG_URL (default postgres://postgres@127.0.0.1:5432/postgres).
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,
    /// Where peers are installed (default $HOME/.cache/idem-bench-peers).
    #[arg(long)]
    pub peers_dir: Option<PathBuf>,
    /// Do not install or run the peers.
    #[arg(long)]
    pub no_peers: bool,
    /// Run only these variants of the selected groups (ids such as `idem`, `bare`, `pgbench`),
    /// for profiling one at a time.
    #[arg(long, value_delimiter = ',', hide = true)]
    pub variants: Vec<String>,
    /// Also write the JSON report to this file.
    #[arg(long, value_name = "PATH")]
    pub json_file: Option<PathBuf>,
    /// Print each row's ratio beside the same row's in this earlier `--json` report, and the
    /// change (to stderr with --json).
    #[arg(long, value_name = "OLD.json")]
    pub compare: Option<PathBuf>,
    /// Run the PostgreSQL and Redis groups once per latency (milliseconds, comma-separated),
    /// with a relay holding every chunk that long each way between the servers and their
    /// database; 0 connects directly.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0",
        value_name = "MS,..."
    )]
    pub db_latency_ms: Vec<f64>,
}

/// The validated settings.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) groups: Vec<Group>,
    pub(crate) quick: bool,
    pub(crate) rounds: usize,
    pub(crate) duration: Duration,
    pub(crate) warmup: Duration,
    pub(crate) concurrency: usize,
    pub(crate) redis_url: String,
    pub(crate) peers_dir: Option<PathBuf>,
    pub(crate) no_peers: bool,
    pub(crate) variants: Vec<String>,
    /// The latencies the database groups run at, in milliseconds, each once, in order.
    pub(crate) db_latencies_ms: Vec<f64>,
    /// Live records in growth-postgres's key table (a tenth of it for the rest of growth-*).
    pub(crate) growth_records: u64,
}

impl Settings {
    fn from_args(args: &Args) -> anyhow::Result<Self> {
        let seconds = |value: Option<f64>, full: f64, quick: f64, name: &str| {
            let secs = value.unwrap_or(if args.quick { quick } else { full });
            anyhow::ensure!(
                secs.is_finite() && (0.0..=3600.0).contains(&secs),
                "--{name} must be between 0 and 3600 seconds"
            );
            Ok(Duration::from_secs_f64(secs))
        };
        let duration = seconds(args.duration_secs, 4.0, 1.0, "duration-secs")?;
        anyhow::ensure!(
            duration >= Duration::from_millis(100),
            "--duration-secs must be at least 0.1"
        );
        let groups = if args.only.is_empty() {
            Group::ALL.into_iter().filter(|g| !g.opt_in()).collect()
        } else {
            // In the full command's order, each once.
            Group::ALL
                .into_iter()
                .filter(|g| args.only.contains(g))
                .collect()
        };
        let mut db_latencies_ms = Vec::new();
        for &ms in &args.db_latency_ms {
            anyhow::ensure!(
                ms.is_finite() && (0.0..=1000.0).contains(&ms),
                "--db-latency-ms takes milliseconds between 0 and 1000, not {ms}"
            );
            if !db_latencies_ms.contains(&ms) {
                db_latencies_ms.push(ms);
            }
        }
        Ok(Self {
            groups,
            quick: args.quick,
            rounds: args.rounds.unwrap_or(if args.quick { 2 } else { 4 }) as usize,
            duration,
            warmup: seconds(args.warmup_secs, 0.5, 0.5, "warmup-secs")?,
            concurrency: args.concurrency as usize,
            redis_url: args.redis_url.clone(),
            peers_dir: args.peers_dir.clone(),
            no_peers: args.no_peers,
            variants: args.variants.clone(),
            db_latencies_ms,
            growth_records: args.growth_records.unwrap_or(if args.quick {
                100_000
            } else {
                10_000_000
            }),
        })
    }

    /// The settings, as the report shows them.
    fn reported(&self) -> report::ReportSettings {
        report::ReportSettings {
            concurrency: self.concurrency,
            rounds: self.rounds,
            duration_secs: self.duration.as_secs_f64(),
            warmup_secs: self.warmup.as_secs_f64(),
            quick: self.quick,
            db_latency_ms: self.db_latencies_ms.clone(),
        }
    }
}

/// The runtimes: servers under test, the upstream, the load generator and the latency relay
/// each get their own threads, so none of them is scheduled behind another's tasks, and a peer
/// server (a process of its own) is compared on equal terms.
#[derive(Debug, Clone)]
pub(crate) struct Runtimes {
    pub(crate) subject: Handle,
    pub(crate) upstream: Handle,
    pub(crate) load: Handle,
    pub(crate) relay: Handle,
}

fn runtime(name: &'static str) -> anyhow::Result<tokio::runtime::Runtime> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    runtime_with(name, threads)
}

fn runtime_with(name: &'static str, threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .with_context(|| format!("cannot start the {name} runtime"))
}

/// Runs the selected workloads and prints the report. Returns failure when a workload failed
/// (not when a target was missed, nor when a dependency was missing and a row was skipped).
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let settings = Settings::from_args(&args)?;
    // Read first: a typo in the path should not cost a run.
    let earlier = args
        .compare
        .as_deref()
        .map(compare::Summary::read)
        .transpose()?;
    let report = measure(settings)?;
    if let Some(path) = &args.json_file {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    if let (Some(earlier), Some(path)) = (&earlier, &args.compare) {
        let name = path.display().to_string();
        let table = compare::table(earlier, &compare::Summary::of(&report)?, &name);
        // stdout stays one JSON document with --json.
        if args.json {
            eprint!("\n{table}");
        } else {
            print!("\n{table}");
        }
    }
    let failed = report
        .rows
        .iter()
        .map(|r| r.status)
        .chain(report.memory.iter().map(|m| m.status))
        .any(|status| status == runner::Status::Failed);
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Runs the workloads `settings` select.
fn measure(settings: Settings) -> anyhow::Result<Report> {
    let started = Instant::now();
    let mut report = Report {
        version: 1,
        settings: settings.reported(),
        machine: report::Machine::read(),
        micro: Vec::new(),
        instructions: Vec::new(),
        rows: Vec::new(),
        key_tables: Vec::new(),
        memory: None,
        wall_secs: 0.0,
    };
    let subject = runtime(cpu::SUBJECT_THREADS)?;
    let upstream = runtime(cpu::UPSTREAM_THREADS)?;
    let load = runtime(cpu::LOAD_THREADS)?;
    // One thread: the relay only moves bytes (its clock has a thread of its own).
    let relay = runtime_with(cpu::RELAY_THREADS, 1)?;
    // The orchestration (timers, child processes) runs on the main thread.
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let progress = progress_bar(&settings);
    let env = workloads::Env {
        runtimes: Runtimes {
            subject: subject.handle().clone(),
            upstream: upstream.handle().clone(),
            load: load.handle().clone(),
            relay: relay.handle().clone(),
        },
        tag: format!("ib{}", &uuid::Uuid::new_v4().simple().to_string()[..10]),
        progress: progress.clone(),
        settings,
    };
    for group in &env.settings.groups {
        match group {
            Group::Memory => report.memory = Some(measure_memory(&main, &env)?),
            Group::Micro => report.micro = time_micro(&env),
            Group::Instructions => report.instructions = count_instructions(&env),
            _ => {
                for &latency_ms in group.db_latencies_ms(&env.settings) {
                    let result = main.block_on(runner::run_group(&env, *group, latency_ms));
                    report.rows.extend(result.rows);
                    report.key_tables.extend(result.key_tables);
                }
            }
        }
    }
    progress.finish_and_clear();
    drop(env);
    // Servers have stopped; do not wait for anything a stuck connection still holds.
    for rt in [subject, upstream, load, relay] {
        rt.shutdown_timeout(Duration::from_secs(2));
    }
    report.wall_secs = started.elapsed().as_secs_f64();
    Ok(report)
}

/// A progress bar over the milliseconds of load the selected groups plan.
fn progress_bar(settings: &Settings) -> indicatif::ProgressBar {
    let total: u64 = settings
        .groups
        .iter()
        .map(|g| runner::planned_ms(*g, settings))
        .sum();
    let progress = indicatif::ProgressBar::new(total);
    progress.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} ETA {eta} {msg}",
        )
        .expect("a valid template"),
    );
    progress.enable_steady_tick(Duration::from_millis(200));
    progress
}

/// The memory workload, on the main runtime, in a folder of its own.
fn measure_memory(
    main: &tokio::runtime::Runtime,
    env: &workloads::Env,
) -> anyhow::Result<memory::MemoryResult> {
    env.progress.set_message(format!(
        "memory: idem serve with {} connections",
        memory::CONNECTIONS
    ));
    let dir = tempfile::tempdir()?;
    let result = main.block_on(memory::measure(env, dir.path()));
    env.progress
        .inc(runner::planned_ms(Group::Memory, &env.settings));
    Ok(result)
}

/// Instructions per request under callgrind, in child processes (about a minute).
fn count_instructions(env: &workloads::Env) -> Vec<instructions::InstructionsResult> {
    env.progress
        .set_message("instructions per request under callgrind");
    let requests = if env.settings.quick { 100 } else { 2_000 };
    let counted = instructions::measure(&env.settings.redis_url, &env.tag, requests);
    env.progress
        .inc(runner::planned_ms(Group::Instructions, &env.settings));
    counted
}

/// The core's micro-benchmarks, each timed for a short budget.
fn time_micro(env: &workloads::Env) -> Vec<micro::MicroResult> {
    env.progress.set_message("core micro-benchmarks");
    let budget = if env.settings.quick {
        Duration::from_millis(20)
    } else {
        Duration::from_millis(300)
    };
    micro::cases()
        .into_iter()
        .map(|case| micro::time(case, budget))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_growth_groups_run_only_when_named() {
        let default = Settings::from_args(&Args::parse_from(["idem-bench"])).unwrap();
        assert!(!default.groups.is_empty());
        assert!(default.groups.iter().all(|g| !g.opt_in()));
        let named = Args::parse_from(["idem-bench", "--only", "growth-sqlite,micro"]);
        let named = Settings::from_args(&named).unwrap();
        assert_eq!(named.groups, [Group::Micro, Group::GrowthSqlite]);
        assert_eq!(named.growth_records, 10_000_000);
        let quick = Args::parse_from(["idem-bench", "--quick"]);
        assert_eq!(Settings::from_args(&quick).unwrap().growth_records, 100_000);
    }
}
