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
//!
//! **`--url`: any API.** The same experiment against an endpoint of the caller's own, the
//! fault injector in front of it (forwarding to its origin, over TLS for `https://`). Its
//! database is out of reach, so the charges are counted where they can be seen: every `2xx`
//! answer carries the id of the resource it made (`--id-field`), and the fault injector
//! reads it before it decides to lose the answer, so per intent the distinct ids are its
//! charges, the lost answers' included. With `--list-url` the API's own list is read before
//! and after each run too, and the resources it gained are reported beside. The run id is
//! `{{run}}` in `--body`, `--header` values and `--list-url` (and `{{intent}}` the intent's
//! number), so that an API which keeps a reference or metadata can tell the runs apart.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use idem_cli::simulate::{ResourceList, SimulateConfig, TargetApi, simulate};
//! let mut api = TargetApi::new("http://127.0.0.1:8080/payments".parse()?);
//! api.headers.push(("authorization".parse()?, "Bearer sk_test_alice".parse()?));
//! api.list = Some(ResourceList::new("http://127.0.0.1:8080/payments"));
//! let mut config = SimulateConfig::new(1_000, vec![0.05]);
//! config.target = Some(api);
//! let report = simulate(&config, &indicatif::ProgressBar::hidden()).await?;
//! print!("{}", report.table());
//! # Ok(()) }
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressDrawTarget};
use reqwest::Url;
use reqwest::header::{HeaderName, HeaderValue};

use crate::drill::{DEFAULT_BODY, parse_header, parse_url};
use crate::store_url::StoreUrl;

pub use self::config::{ResourceList, SimulateConfig, TargetApi};
pub use self::report::{Expected, RateReport, Report, RunFacts, Target, WithKeys, WithoutKeys};
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
    #[arg(long, value_parser = parse_database, conflicts_with = "url")]
    pub database: Option<String>,
    /// Measure this API instead of an in-process `idem serve`: the endpoint each intent
    /// POSTs to, http:// or https://. Charges are then counted as distinct resource ids per
    /// intent. Point it at a sandbox: every run creates real resources.
    #[arg(long, value_parser = parse_url)]
    pub url: Option<Url>,
    /// With --url: each intent's body, sent as JSON unless a --header sets Content-Type;
    /// `{{run}}` becomes the run's id and `{{intent}}` the intent's number.
    #[arg(long, requires = "url", default_value = DEFAULT_BODY)]
    pub body: String,
    /// With --url: a header for every request, `NAME:VALUE` (`{{run}}` and `{{intent}}`
    /// replaced), such as `Authorization: Bearer sk_test_…`; repeatable.
    #[arg(long = "header", value_name = "NAME:VALUE", requires = "url", value_parser = parse_header)]
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// With --url: where a 2xx answer's resource id is, a dotted path such as `data.id` or a
    /// JSON pointer such as `/data/id`.
    #[arg(
        long,
        visible_alias = "id-pointer",
        requires = "url",
        default_value = "id"
    )]
    pub id_field: String,
    /// With --url: a GET that lists the API's resources, read before and after each run to
    /// count what the run created (`{{run}}` replaced). It answers a JSON array, or an
    /// object with the array at --list-field; pages are not followed.
    #[arg(long, value_name = "URL", requires = "url", value_parser = parse_list_url)]
    pub list_url: Option<String>,
    /// Where the --list-url answer's array is when it is an object: a dotted path or a JSON
    /// pointer.
    #[arg(long, requires = "list_url", default_value = "data")]
    pub list_field: String,
    /// Private CAs for an https --url.
    #[command(flatten)]
    pub tls: crate::tls_args::ClientTlsArgs,
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

/// An http(s) URL once `{{run}}` is filled in; kept as text, so the placeholder is not
/// percent-encoded away.
fn parse_list_url(s: &str) -> Result<String, String> {
    parse_url(&config::render(s, "sim-run", 0))?;
    Ok(s.to_owned())
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

impl SimulateConfig {
    /// The settings `args` ask for.
    pub fn from_args(args: &SimulateArgs) -> anyhow::Result<Self> {
        let target = match &args.url {
            Some(url) => Some(TargetApi {
                url: url.clone(),
                body: args.body.clone(),
                headers: args.headers.clone(),
                id_field: args.id_field.clone(),
                list: args.list_url.as_ref().map(|list| ResourceList {
                    url: list.clone(),
                    field: args.list_field.clone(),
                }),
                ca_certs: args.tls.ca_certs.clone(),
            }),
            None => {
                anyhow::ensure!(
                    args.tls.ca_certs.is_empty(),
                    "--ca-cert is for an https --url; the in-process server speaks plain HTTP"
                );
                None
            }
        };
        Ok(Self {
            requests: args.requests,
            losses: args.loss.clone(),
            seed: args.seed,
            concurrency: args.concurrency,
            database: args.database.clone(),
            target,
        })
    }
}

/// Runs `idem simulate`; prints the table (or JSON) and draws the chart.
pub async fn run(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    let config = SimulateConfig::from_args(&args)?;
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
