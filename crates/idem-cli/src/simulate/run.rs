//! The experiment itself: for each loss rate, the intents without and then with keys, sent
//! through a fresh fault injector and counted in the database afterwards.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use hyper::header::HeaderValue;
use idem_client::{Client, Intent, RetryBudget, RetryPolicy, Sleep, Sleeper};
use idem_core::AccountId;
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng as _;
use rand::rngs::StdRng;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};
use tokio::task::JoinSet;

use super::config::SimulateConfig;
use super::proxy::{FaultProxy, INTENT_HEADER, ProxyCounts};
use super::report::{Expected, RateReport, Report, RunFacts, WithKeys, WithoutKeys, percent};
use super::server::Server;
use crate::serve::ServeConfig;

/// Attempts per intent: the first and at most 20 retries, as in the published experiment.
const MAX_ATTEMPTS: u32 = 21;

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

/// One (rate, variant) run, and the account its payments go to.
#[derive(Debug, Clone)]
struct Run {
    loss: f64,
    variant: Variant,
    account: String,
}

impl Run {
    /// Both variants of every rate, in the order they run. The run id keeps this
    /// simulation's accounts apart from any other in the same database.
    fn all(losses: &[f64]) -> Vec<Self> {
        let run_id = uuid::Uuid::now_v7().simple().to_string();
        losses
            .iter()
            .flat_map(|&loss| {
                [Variant::WithoutKeys, Variant::WithKeys].map(|variant| Self {
                    loss,
                    variant,
                    account: format!("sim-{run_id}-p{loss}-{}", variant.slug()),
                })
            })
            .collect()
    }

    /// `5% without keys`.
    fn label(&self) -> String {
        format!("{} {}", percent(self.loss), self.variant.label())
    }
}

/// Runs the simulation and returns its figures; `progress` counts intents as they finish
/// (pass [`ProgressBar::hidden`] to show nothing).
pub async fn simulate(config: &SimulateConfig, progress: &ProgressBar) -> anyhow::Result<Report> {
    validate(config)?;
    let temp = tempfile::tempdir().context("cannot make a temporary folder")?;
    let database = match &config.database {
        Some(url) => url.clone(),
        None => format!("sqlite://{}", temp.path().join("simulate.db").display()),
    };
    let runs = Run::all(&config.losses);
    let server = start_server(&database, &runs).await?;
    let counter = open_counter(&database).await?;
    start_progress(progress, config.requests * runs.len() as u64);

    let mut outcomes: HashMap<(u64, Variant), Outcome> = HashMap::new();
    for run in &runs {
        progress.set_message(run.label());
        let outcome = run_one(config, server.addr, run, &counter, progress)
            .await
            .with_context(|| format!("the run at {}", run.label()))?;
        outcomes.insert((run.loss.to_bits(), run.variant), outcome);
    }
    counter.close().await;
    server.stop().await?;

    let rates = config
        .losses
        .iter()
        .map(|&loss| rate_report(loss, config.requests, &outcomes))
        .collect();
    Ok(Report {
        seed: config.seed,
        max_attempts: MAX_ATTEMPTS,
        rates,
    })
}

fn validate(config: &SimulateConfig) -> anyhow::Result<()> {
    anyhow::ensure!(config.requests > 0, "no intents to simulate");
    anyhow::ensure!(
        config.concurrency > 0,
        "at least one intent must be in flight"
    );
    anyhow::ensure!(
        config.losses.iter().all(|p| (0.0..1.0).contains(p)),
        "loss rates must be fractions in [0, 1)"
    );
    Ok(())
}

/// An `idem serve` on `database` that knows every run's token.
async fn start_server(database: &str, runs: &[Run]) -> anyhow::Result<Server> {
    let mut serve_config = ServeConfig::new(database);
    // Keys optional: the run without keys is the unprotected baseline. Requests with a key
    // are covered exactly as in production.
    serve_config.policy.require_key = false;
    serve_config.tokens = runs
        .iter()
        .map(|run| (token(&run.account), AccountId::new(run.account.clone())))
        .collect();
    Server::start(serve_config).await
}

/// A read-only connection to `database`, to count the charges with.
async fn open_counter(database: &str) -> anyhow::Result<SqlitePool> {
    SqlitePool::connect_with(
        SqliteConnectOptions::from_str(database)
            .with_context(|| format!("bad database URL {database}"))?
            .read_only(true),
    )
    .await
    .with_context(|| format!("cannot open {database} to count the charges"))
}

fn start_progress(progress: &ProgressBar, intents: u64) {
    progress.set_length(intents);
    progress.set_style(
        ProgressStyle::with_template(
            "{spinner} {msg:<24} [{bar:30}] {pos}/{len} intents  {elapsed_precise} (eta {eta})",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    progress.enable_steady_tick(Duration::from_millis(200));
}

/// The figures at `loss` from its two runs' outcomes, beside the statistics' prediction.
fn rate_report(loss: f64, n: u64, outcomes: &HashMap<(u64, Variant), Outcome>) -> RateReport {
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
}

fn token(account: &str) -> String {
    format!("sk_{account}")
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
    run: &Run,
    counter: &SqlitePool,
    progress: &ProgressBar,
) -> anyhow::Result<Outcome> {
    let proxy = FaultProxy::start(server, config.seed, run.loss)
        .await
        .context("cannot start the fault injector")?;
    let sender = Sender {
        client: client(config.seed)?,
        url: format!("http://{}/payments", proxy.addr()),
        authorization: format!("Bearer {}", token(&run.account))
            .parse()
            .context("the run's token is not a header value")?,
        variant: run.variant,
        next: Arc::new(AtomicU64::new(0)),
        requests: config.requests,
        progress: progress.clone(),
    };
    let mut workers = JoinSet::new();
    for _ in 0..config.concurrency.min(config.requests) {
        workers.spawn(sender.clone().send_all());
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
    let charges = count_charges(counter, &run.account).await?;
    Ok(Outcome {
        account: run.account.clone(),
        charges,
        proxy: counts,
        unanswered,
    })
}

/// The client as a caller would configure it, less the waits, retrying each intent to the
/// attempt limit.
fn client(seed: u64) -> anyhow::Result<Client> {
    // No system proxy may sit between the client and the fault injector on loopback.
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .context("cannot build the HTTP client")?;
    Ok(Client::new()
        .with_http_client(http)
        .with_policy(RetryPolicy {
            max_attempts: MAX_ATTEMPTS,
            ..RetryPolicy::default()
        })
        // The default budget stops retrying once retries outnumber answers; the experiment
        // is what happens when every intent is retried to its limit.
        .with_budget(RetryBudget::unlimited())
        .with_sleeper(NoWait)
        .with_rng(StdRng::seed_from_u64(seed)))
}

/// One run's intents, shared by the tasks that send them: each takes the next number until
/// all `requests` are taken.
#[derive(Debug, Clone)]
struct Sender {
    client: Client,
    url: String,
    authorization: HeaderValue,
    variant: Variant,
    next: Arc<AtomicU64>,
    requests: u64,
    progress: ProgressBar,
}

impl Sender {
    /// Sends intents until none is left; how many got no answer.
    async fn send_all(self) -> anyhow::Result<u64> {
        let mut unanswered = 0u64;
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.requests {
                return Ok(unanswered);
            }
            match self.client.send(&self.intent(i)).await {
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
            self.progress.inc(1);
        }
    }

    /// Intent `i`: its number in a header for the fault injector, its reference in the body
    /// for the count, and a key unless this is the run without.
    fn intent(&self, i: u64) -> Intent {
        let intent = Intent::post(self.url.as_str())
            .header(hyper::header::AUTHORIZATION, self.authorization.clone())
            .header(INTENT_HEADER, HeaderValue::from(i))
            .json(&serde_json::json!({
                "amount": 49900,
                "currency": "INR",
                "reference": format!("intent-{i}"),
            }));
        if self.variant == Variant::WithoutKeys {
            intent.without_key()
        } else {
            intent
        }
    }
}
