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

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use idem_client::{Client, Intent, RetryBudget, RetryPolicy, Sleep, Sleeper};
use idem_core::AccountId;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::SeedableRng as _;
use rand::rngs::StdRng;
use serde::Serialize;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use self::proxy::{FaultProxy, INTENT_HEADER, ProxyCounts};
use crate::serve::{ServeConfig, serve};

mod plot;
mod proxy;

/// Attempts per intent: the first and at most 20 retries, as in the published experiment.
const MAX_ATTEMPTS: u32 = 21;

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
    if s.starts_with("sqlite:") {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "idem simulate runs on SQLite: expected sqlite://PATH, got {s:?}"
        ))
    }
}

/// What one simulation does, validated.
#[derive(Debug, Clone)]
pub struct SimulateConfig {
    /// Payment intents per rate.
    pub requests: u64,
    /// The answer-loss rates, each in `[0, 1)`, in the order they run.
    pub losses: Vec<f64>,
    /// The seed of the fault schedule and the client's jitter.
    pub seed: u64,
    /// Intents in flight at once (at least 1).
    pub concurrency: u64,
    /// `sqlite://PATH`, or `None` for a fresh file in a temporary folder.
    pub database: Option<String>,
}

impl SimulateConfig {
    /// `requests` intents at each of `losses`, with seed 42, 32 in flight, a fresh database.
    pub fn new(requests: u64, losses: Vec<f64>) -> Self {
        Self {
            requests,
            losses,
            seed: 42,
            concurrency: 32,
            database: None,
        }
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

/// The figures of a simulation: what `--json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The seed used.
    pub seed: u64,
    /// Attempts allowed per intent, the first included.
    pub max_attempts: u32,
    /// One entry per loss rate, in the order they ran.
    pub rates: Vec<RateReport>,
}

/// The figures at one loss rate.
#[derive(Debug, Clone, Serialize)]
pub struct RateReport {
    /// The probability that an answer is lost after the server committed.
    pub loss: f64,
    /// Payment intents, each sent until an answer arrived.
    pub requests: u64,
    /// The run without idempotency keys.
    pub without_keys: WithoutKeys,
    /// The run with one key per intent.
    pub with_keys: WithKeys,
    /// What the statistics predict without keys.
    pub expected: Expected,
}

/// The run without keys: every retry that reached the server charged again.
#[derive(Debug, Clone, Serialize)]
pub struct WithoutKeys {
    /// Intents charged more than once (counted in the database, by `reference`).
    pub double_charge_incidents: u64,
    /// Charges beyond the first, summed over intents: Σ (charges − 1).
    pub extra_charges: u64,
    /// Payments the run's account holds in the database.
    pub charges_in_db: u64,
    /// Run details.
    #[serde(flatten)]
    pub run: RunFacts,
}

/// The run with keys: retries carry the intent's key and are answered from the stored
/// response.
#[derive(Debug, Clone, Serialize)]
pub struct WithKeys {
    /// Intents charged more than once (must be 0).
    pub double_charges: u64,
    /// Retries that reached the server after their intent had been charged and were answered
    /// with the stored response (`Idempotent-Replayed: true`, as the proxy saw it) instead of
    /// charging again: each one a charge the run without keys made.
    pub duplicates_prevented: u64,
    /// Payments the run's account holds in the database (must equal `requests`).
    pub charges_in_db: u64,
    /// Run details.
    #[serde(flatten)]
    pub run: RunFacts,
}

/// How a run went, beyond the headline figures.
#[derive(Debug, Clone, Serialize)]
pub struct RunFacts {
    /// The account the run's payments are in.
    pub account: String,
    /// Intents with at least one payment in the database.
    pub intents_charged: u64,
    /// Attempts that reached the server, all intents together.
    pub attempts: u64,
    /// Answers the fault injector cut after the server had committed.
    pub answers_lost: u64,
    /// Intents that got no answer within the attempt limit.
    pub unanswered: u64,
}

/// The statistics' prediction without keys.
#[derive(Debug, Clone, Serialize)]
pub struct Expected {
    /// N·p: intents whose first answer is lost.
    pub double_charge_incidents: f64,
    /// N·p/(1−p): the mean number of lost answers per intent, times N.
    pub extra_charges: f64,
}

impl Report {
    /// Whether idempotency held: with keys, every intent was charged exactly once.
    pub fn keys_held(&self) -> bool {
        self.rates.iter().all(|r| {
            r.with_keys.double_charges == 0
                && r.with_keys.charges_in_db == r.requests
                && r.with_keys.run.intents_charged == r.requests
        })
    }

    /// The figures as a text table, expected values in brackets.
    pub fn table(&self) -> String {
        let n = self.rates.first().map_or(0, |r| r.requests);
        let headers = [
            "loss",
            "requests",
            "double-charged",
            "extra charges",
            "charges in db",
            "double charges",
            "duplicates prevented",
            "charges in db",
        ];
        let rows: Vec<[String; 8]> = self
            .rates
            .iter()
            .map(|r| {
                [
                    percent(r.loss),
                    r.requests.to_string(),
                    format!(
                        "{} (≈ {:.0})",
                        r.without_keys.double_charge_incidents, r.expected.double_charge_incidents
                    ),
                    format!(
                        "{} (≈ {:.0})",
                        r.without_keys.extra_charges, r.expected.extra_charges
                    ),
                    r.without_keys.charges_in_db.to_string(),
                    r.with_keys.double_charges.to_string(),
                    r.with_keys.duplicates_prevented.to_string(),
                    r.with_keys.charges_in_db.to_string(),
                ]
            })
            .collect();
        let width: Vec<usize> = (0..headers.len())
            .map(|c| {
                rows.iter()
                    .map(|row| row[c].chars().count())
                    .chain([headers[c].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        const GAP: &str = "  ";
        let line = |cells: &[&str]| {
            let cells: Vec<String> = cells
                .iter()
                .zip(&width)
                .map(|(cell, w)| format!("{cell:>w$}"))
                .collect();
            cells.join(GAP).trim_end().to_owned()
        };
        // A title centred over columns `from..to`, in a rule of dashes.
        let group = |title: &str, from: usize, to: usize| {
            let span = width[from..to].iter().sum::<usize>() + GAP.len() * (to - from - 1);
            format!("{:-^span$}", format!(" {title} "))
        };

        let mut out = String::new();
        let _ = writeln!(
            out,
            "ACK loss after commit: {n} payment intents per rate, seed {}, up to {} retries each",
            self.seed,
            self.max_attempts - 1
        );
        let _ = writeln!(out);
        let lead = width[0] + width[1] + 2 * GAP.len();
        let _ = writeln!(
            out,
            "{:lead$}{}{GAP}{}",
            "",
            group("without idempotency keys", 2, 5),
            group("with idempotency keys", 5, 8)
        );
        let _ = writeln!(out, "{}", line(&headers));
        for row in &rows {
            let cells: Vec<&str> = row.iter().map(String::as_str).collect();
            let _ = writeln!(out, "{}", line(&cells));
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "Charges counted in the database afterwards; expected values (N·p incidents, \
             N·p/(1−p) extra charges) in brackets."
        );
        let _ = writeln!(
            out,
            "Duplicates prevented: retries the server answered from the stored response \
             (Idempotent-Replayed: true)."
        );
        let unanswered: u64 = self
            .rates
            .iter()
            .map(|r| r.without_keys.run.unanswered + r.with_keys.run.unanswered)
            .sum();
        if unanswered > 0 {
            let _ = writeln!(
                out,
                "{unanswered} intent(s) got no answer within {} attempts (each was still charged).",
                self.max_attempts
            );
        }
        if !self.keys_held() {
            let _ = writeln!(
                out,
                "IDEMPOTENCY FAILED: with keys, some intent was not charged exactly once."
            );
        }
        out
    }
}

/// `0.05` → `5%`, `0.015` → `1.5%`.
fn percent(loss: f64) -> String {
    let pct = (loss * 100.0 * 1e4).round() / 1e4;
    format!("{pct}%")
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

/// Which run of a rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Variant {
    WithoutKeys,
    WithKeys,
}

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Self::WithoutKeys => "without keys",
            Self::WithKeys => "with keys",
        }
    }

    fn slug(self) -> &'static str {
        match self {
            Self::WithoutKeys => "nokeys",
            Self::WithKeys => "keys",
        }
    }
}

/// Runs the simulation and returns its figures; `progress` counts intents as they finish
/// (pass [`ProgressBar::hidden`] to show nothing).
pub async fn simulate(config: &SimulateConfig, progress: &ProgressBar) -> anyhow::Result<Report> {
    anyhow::ensure!(config.requests > 0, "no intents to simulate");
    anyhow::ensure!(
        config.concurrency > 0,
        "at least one intent must be in flight"
    );
    anyhow::ensure!(
        config.losses.iter().all(|p| (0.0..1.0).contains(p)),
        "loss rates must be fractions in [0, 1)"
    );
    let temp = tempfile::tempdir().context("cannot make a temporary folder")?;
    let database = match &config.database {
        Some(url) => url.clone(),
        None => format!("sqlite://{}", temp.path().join("simulate.db").display()),
    };

    // The run id keeps this simulation's accounts apart from any other in the same database.
    let run_id = uuid::Uuid::now_v7().simple().to_string();
    let runs: Vec<(f64, Variant, String)> = config
        .losses
        .iter()
        .flat_map(|&loss| {
            [Variant::WithoutKeys, Variant::WithKeys]
                .map(|v| (loss, v, format!("sim-{run_id}-p{loss}-{}", v.slug())))
        })
        .collect();

    let mut serve_config = ServeConfig::new(database.clone());
    // Keys optional: the run without keys is the unprotected baseline. Requests with a key
    // are covered exactly as in production.
    serve_config.policy.require_key = false;
    serve_config.tokens = runs
        .iter()
        .map(|(_, _, account)| (token(account), AccountId::new(account.clone())))
        .collect();
    let server = Server::start(serve_config).await?;

    let counter = SqlitePool::connect_with(
        SqliteConnectOptions::from_str(&database)
            .with_context(|| format!("bad database URL {database}"))?
            .read_only(true),
    )
    .await
    .with_context(|| format!("cannot open {database} to count the charges"))?;

    progress.set_length(config.requests * runs.len() as u64);
    progress.set_style(
        ProgressStyle::with_template(
            "{spinner} {msg:<24} [{bar:30}] {pos}/{len} intents  {elapsed_precise} (eta {eta})",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    progress.enable_steady_tick(Duration::from_millis(200));

    let mut outcomes: HashMap<(u64, Variant), Outcome> = HashMap::new();
    for (loss, variant, account) in &runs {
        progress.set_message(format!("{} {}", percent(*loss), variant.label()));
        let outcome = run_one(
            config,
            server.addr,
            *loss,
            *variant,
            account,
            &counter,
            progress,
        )
        .await
        .with_context(|| format!("the run at {} {}", percent(*loss), variant.label()))?;
        outcomes.insert((loss.to_bits(), *variant), outcome);
    }
    counter.close().await;
    server.stop().await?;

    let n = config.requests;
    let rates = config
        .losses
        .iter()
        .map(|&loss| {
            let without = &outcomes[&(loss.to_bits(), Variant::WithoutKeys)];
            let with = &outcomes[&(loss.to_bits(), Variant::WithKeys)];
            RateReport {
                loss,
                requests: n,
                without_keys: WithoutKeys {
                    double_charge_incidents: without.charges.incidents,
                    extra_charges: without.charges.extra,
                    charges_in_db: without.charges.total,
                    run: without.facts(),
                },
                with_keys: WithKeys {
                    double_charges: with.charges.incidents,
                    duplicates_prevented: with.proxy.replayed,
                    charges_in_db: with.charges.total,
                    run: with.facts(),
                },
                expected: Expected {
                    double_charge_incidents: n as f64 * loss,
                    extra_charges: n as f64 * loss / (1.0 - loss),
                },
            }
        })
        .collect();
    Ok(Report {
        seed: config.seed,
        max_attempts: MAX_ATTEMPTS,
        rates,
    })
}

fn token(account: &str) -> String {
    format!("sk_{account}")
}

/// An in-process `idem serve` on a thread and a Tokio runtime of its own.
///
/// Its own thread, because the service logs every stored key at INFO: tens of thousands of
/// lines in a run would bury the progress bar and the table. A current-thread runtime runs
/// every task the server spawns on that one thread, so a thread-local subscriber that shows
/// only warnings and errors (or what `RUST_LOG` asks for) covers all of the server, and
/// nothing else in the process. It also keeps the server's work apart from the client's and
/// the fault injector's, much as a separate process would.
struct Server {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    done: oneshot::Receiver<anyhow::Result<()>>,
}

impl Server {
    async fn start(config: ServeConfig) -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let (finished, mut done) = oneshot::channel();
        std::thread::Builder::new()
            .name("idem-serve".into())
            .spawn(move || {
                let filter = tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
                let subscriber = tracing_subscriber::fmt()
                    .with_env_filter(filter)
                    .with_writer(std::io::stderr)
                    .finish();
                let _quiet = tracing::subscriber::set_default(subscriber);
                let result = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("cannot start the server's runtime")
                    .and_then(|runtime| {
                        runtime.block_on(async {
                            let listener = TcpListener::from_std(listener)?;
                            serve(listener, config, async {
                                let _ = stopped.await;
                            })
                            .await
                        })
                    });
                let _ = finished.send(result);
            })
            .context("cannot start the server's thread")?;

        // The listener is bound already, so this request waits until the database is open;
        // if opening fails the server returns and the connection is refused.
        let health = reqwest::Client::builder()
            .no_proxy()
            .build()?
            .get(format!("http://{addr}/healthz"))
            .timeout(Duration::from_secs(60))
            .send();
        tokio::select! {
            answer = health => {
                let healthy = answer.is_ok_and(|a| a.status().is_success());
                anyhow::ensure!(healthy, "the in-process idem serve did not become healthy");
            }
            ended = &mut done => {
                ended.context("idem serve panicked")??;
                anyhow::bail!("idem serve stopped at start");
            }
        }
        Ok(Self { addr, stop, done })
    }

    async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.done.await.context("idem serve panicked")?
    }
}

/// Retries at once. The figures depend only on which attempts lose their answer, never on
/// when a retry is sent, so sleeping the client's backoff (100 ms upward by default) would
/// only stretch the run. The jittered waits are still drawn from the seeded RNG, as in
/// production, and then skipped.
#[derive(Debug, Clone, Copy)]
struct NoWait;

impl Sleeper for NoWait {
    fn sleep(&self, _: Duration) -> Sleep<'_> {
        Box::pin(std::future::ready(()))
    }
}

/// Charges of one account, counted per intent.
#[derive(Debug, Clone, Copy, Default)]
struct Charges {
    /// Payments in all.
    total: u64,
    /// Intents with at least one payment.
    intents: u64,
    /// Intents with more than one.
    incidents: u64,
    /// Σ (payments − 1) over intents.
    extra: u64,
}

/// Counts the account's payments per intent (`reference`, which every attempt of an intent
/// carries, with or without a key).
async fn count_charges(pool: &SqlitePool, account: &str) -> anyhow::Result<Charges> {
    let per_intent: Vec<(Option<String>, i64)> = sqlx::query_as(
        "SELECT reference, COUNT(*) FROM payments WHERE account_id = ?1 GROUP BY reference",
    )
    .bind(account)
    .fetch_all(pool)
    .await
    .context("cannot count the charges")?;
    let mut charges = Charges::default();
    for (_, count) in per_intent {
        let count = u64::try_from(count).unwrap_or(0);
        charges.total += count;
        charges.intents += 1;
        if count > 1 {
            charges.incidents += 1;
            charges.extra += count - 1;
        }
    }
    Ok(charges)
}

/// What one run produced.
#[derive(Debug, Clone)]
struct Outcome {
    account: String,
    charges: Charges,
    proxy: ProxyCounts,
    unanswered: u64,
}

impl Outcome {
    fn facts(&self) -> RunFacts {
        RunFacts {
            account: self.account.clone(),
            intents_charged: self.charges.intents,
            attempts: self.proxy.forwarded,
            answers_lost: self.proxy.cut,
            unanswered: self.unanswered,
        }
    }
}

/// Sends the N intents of one (rate, variant) through a fresh fault injector, then counts.
async fn run_one(
    config: &SimulateConfig,
    server: SocketAddr,
    loss: f64,
    variant: Variant,
    account: &str,
    counter: &SqlitePool,
    progress: &ProgressBar,
) -> anyhow::Result<Outcome> {
    let proxy = FaultProxy::start(server, config.seed, loss)
        .await
        .context("cannot start the fault injector")?;
    // No system proxy may sit between the client and the fault injector on loopback.
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .context("cannot build the HTTP client")?;
    let client = Client::new()
        .with_http_client(http)
        .with_policy(RetryPolicy {
            max_attempts: MAX_ATTEMPTS,
            ..RetryPolicy::default()
        })
        // The default budget stops retrying once retries outnumber answers; the experiment
        // is what happens when every intent is retried to its limit.
        .with_budget(RetryBudget::unlimited())
        .with_sleeper(NoWait)
        .with_rng(StdRng::seed_from_u64(config.seed));
    let url = format!("http://{}/payments", proxy.addr());
    let authorization: hyper::header::HeaderValue = format!("Bearer {}", token(account))
        .parse()
        .context("the run's token is not a header value")?;

    let next = Arc::new(AtomicU64::new(0));
    let mut workers = JoinSet::new();
    for _ in 0..config.concurrency.min(config.requests) {
        let (client, url, authorization, next, progress) = (
            client.clone(),
            url.clone(),
            authorization.clone(),
            next.clone(),
            progress.clone(),
        );
        let n = config.requests;
        workers.spawn(async move {
            let mut unanswered = 0u64;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, anyhow::Error>(unanswered);
                }
                let mut intent = Intent::post(url.as_str())
                    .header(hyper::header::AUTHORIZATION, authorization.clone())
                    .header(INTENT_HEADER, hyper::header::HeaderValue::from(i))
                    .json(&serde_json::json!({
                        "amount": 49900,
                        "currency": "INR",
                        "reference": format!("intent-{i}"),
                    }));
                if variant == Variant::WithoutKeys {
                    intent = intent.without_key();
                }
                match client.send(&intent).await {
                    Ok(answer) if answer.status == hyper::StatusCode::CREATED => {}
                    // A final refusal means the set-up is wrong, not that an answer was lost.
                    Ok(answer) => anyhow::bail!(
                        "intent {i} was refused with {}: {}",
                        answer.status,
                        String::from_utf8_lossy(&answer.body)
                    ),
                    Err(idem_client::Error::Transport { .. }) => unanswered += 1,
                    Err(e) => return Err(anyhow::Error::new(e).context(format!("intent {i}"))),
                }
                progress.inc(1);
            }
        });
    }
    let mut unanswered = 0;
    while let Some(done) = workers.join_next().await {
        unanswered += done.context("a client task panicked")??;
    }
    let counts = proxy.counts();
    drop(proxy);
    anyhow::ensure!(
        counts.upstream_errors == 0,
        "the fault injector could not reach the server {} time(s)",
        counts.upstream_errors
    );
    let charges = count_charges(counter, account).await?;
    Ok(Outcome {
        account: account.to_owned(),
        charges,
        proxy: counts,
        unanswered,
    })
}
