//! `idem drill`: checks any HTTP API against the idempotency contract from the outside, the
//! field's conformance suite. Each check reports PASS, WARN, FAIL or SKIP with the rule it
//! holds the API to (a section of the IETF draft, a Stripe convention, or idem's contract) and
//! what it saw.
//!
//! `FAIL` is kept for what breaks the promise of a key (a second effect for one key, a
//! different answer to a repeat, another caller's answer, a mismatch processed, a key stuck
//! after a failure) and for the rules a `--profile` makes required; a departure from a rule
//! the profile only recommends is a `WARN`, which fails the run only with `--strict`.
//!
//! The drill is a client like any other: it sends real requests with fresh UUID v4 keys (so
//! it can run again and again against the same API), through [`idem_client`] wherever a retry
//! is part of what is checked. It creates real resources, a few dozen per run: point it at a
//! sandbox.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use idem_cli::drill::{Drill, DrillConfig, Profile};
//! let url = "http://127.0.0.1:8080/payments".parse()?;
//! let mut config = DrillConfig::new(url, "sk_test_alice", "sk_test_bob");
//! config.profile = Profile::Idem;
//! let report = Drill::new(config)?.run().await?;
//! print!("{}", report.table());
//! # Ok(()) }
//! ```

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use idem_client::{Client, RetryBudget, RetryPolicy, Sleeper, TokioSleeper};
use reqwest::Url;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};

pub(crate) mod body;
mod checks;
mod concurrent;
mod report;
mod rules;

pub use report::{Check, Report, Rounds, Status};
pub use rules::Profile;

/// The body `--body` defaults to: the reference service's payment.
pub const DEFAULT_BODY: &str = r#"{"amount": 49900, "currency": "INR"}"#;

/// Concurrent rounds by default. One round of three copies met inside the race window of the
/// gallery's racy express-idempotency app in 57 of 60 rounds: five rounds miss it about once
/// in three million runs, for five payments per run.
pub const DEFAULT_ROUNDS: u16 = 5;

const AFTER_HELP: &str = "\
Checks, in order (RULE: where the rule is written; the draft is
draft-ietf-httpapi-idempotency-key-header, sections of -06/-07):
  policy          the rules published at /idempotency-policy or /.well-known/idempotency-policy
  concurrent      --rounds rounds of --concurrency identical requests at once, a fresh key each
                  round: one resource per round. The original is the answer that carries the
                  resource, never a 409; the count of rounds that made more than one is reported
  in-flight       copies that met the original running: 409 (with Retry-After under stripe and
                  idem), or a wait and its answer; tried again, each gets the original's answer
  replay          the same request again: the same status and content (bytes, under idem)
  replay-marker   replays marked Idempotent-Replayed: true
  reordered-body  the same JSON members in another order: never a second resource (a replay
                  under idem; the draft lets a fingerprint be a checksum of the bytes)
  body-mismatch   the same key with a changed body: not processed, 422, the key still replays
  account-scope   the same key and body from account B: a resource of B's own, never A's
  unknown-token   a token nobody holds with A's key and body: never A's answer
  auth-failure    a token nobody holds with a fresh key is refused; A's request with that key
                  then runs (the refusal was not stored)
  missing-key     no key: 400
  malformed-key   empty, too short, too long, a space, non-ASCII, a list, two fields: refused
  problem-details the refusals met: problem details, or a Link to the documentation
  get-with-key    GET <url>/<id> with no key, a key twice and a malformed key: the same answer
  after-5xx       with --failing-body: after the 5xx, a retry is not refused as in flight past
                  the published hold of a claim (or --failing-wait)
  expiry          if the policy publishes retention_seconds of at most --max-wait, the drill
                  waits it out: the key then makes a new resource

Levels: FAIL for what breaks the promise (a second effect for one key, a different answer to a
repeat, another caller's answer, a mismatch processed, a key stuck after a failure) and for
the rules the profile requires; WARN for a departure from a rule the profile recommends; SKIP
when a check cannot run here or the profile does not judge it (not a pass).

Profiles:
  draft   the promise required; the draft's SHOULDs (400, 409, 422, a published policy, keys
          scoped to the client, problem details) and Stripe's replay header warn
  stripe  also required: Idempotent-Replayed, 409 with Retry-After, keys of at most 255
          characters; keys may be optional
  idem    everything in idem's contract (docs/contract.md) required

Each run uses fresh keys and creates a few dozen real resources: point it at a sandbox.

Exit status: 0 when no check failed (with --strict: and none warned), 1 otherwise, 2 when the
drill could not start (bad arguments, the API unreachable, token A refused).";

/// `idem drill` flags.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct DrillArgs {
    /// The POST endpoint that creates a resource, such as http://127.0.0.1:8080/payments.
    #[arg(long, value_parser = parse_url)]
    pub url: Url,
    /// Account A's API token, sent as `Authorization: Bearer <token>`.
    #[arg(long, env = "IDEM_DRILL_TOKEN_A", hide_env_values = true)]
    pub token_a: String,
    /// Account B's API token, for the check that keys are scoped to the account.
    #[arg(long, env = "IDEM_DRILL_TOKEN_B", hide_env_values = true)]
    pub token_b: String,
    /// The request body every POST sends (as JSON unless a --header sets Content-Type).
    #[arg(long, default_value = DEFAULT_BODY)]
    pub body: String,
    /// How many identical requests each concurrent round sends at once.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(2..=1000))]
    pub concurrency: u16,
    /// How many concurrent rounds, each with a fresh key: a race shows only in some rounds.
    #[arg(long, default_value_t = DEFAULT_ROUNDS, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub rounds: u16,
    /// The rules the API is held to: what is required, what warns, what is not judged.
    #[arg(long, value_enum, default_value_t = Profile::Draft)]
    pub profile: Profile,
    /// A warning fails the run too.
    #[arg(long)]
    pub strict: bool,
    /// A body the API answers with a 5xx (its work fails): the after-5xx check sends it and
    /// checks that the key is not refused as in flight for ever afterwards.
    #[arg(long, value_name = "JSON")]
    pub failing_body: Option<String>,
    /// How long after the 5xx the key may stay refused as in flight, in seconds. Default:
    /// the hold of a claim the policy publishes, plus a second, else --max-wait.
    #[arg(long, value_name = "SECS", requires = "failing_body")]
    pub failing_wait: Option<u64>,
    /// An extra header for every request, `NAME:VALUE`; repeatable.
    #[arg(long = "header", value_name = "NAME:VALUE", value_parser = parse_header)]
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Where the created resource's id is in the JSON answer: a dotted path such as `data.id`,
    /// or a JSON pointer such as `/data/id`.
    #[arg(long, default_value = "id")]
    pub id_field: String,
    /// The longest published retention, in seconds, the expiry check will wait out.
    #[arg(long, value_name = "SECS", default_value_t = 5)]
    pub max_wait: u64,
    /// How long one request may take, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    /// Private CAs for an https URL.
    #[command(flatten)]
    pub tls: crate::tls_args::ClientTlsArgs,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn parse_url(s: &str) -> Result<Url, String> {
    let url = Url::parse(s).map_err(|e| format!("not a URL: {e}"))?;
    check_scheme(&url)?;
    Ok(url)
}

pub(crate) fn check_scheme(url: &Url) -> Result<(), String> {
    match url.scheme() {
        "http" | "https" => Ok(()),
        other => Err(format!("expected an http or https URL, not {other}:")),
    }
}

pub(crate) fn parse_header(s: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = s
        .split_once(':')
        .ok_or_else(|| format!("expected NAME:VALUE, got {s:?}"))?;
    let name = HeaderName::try_from(name.trim()).map_err(|e| format!("header name: {e}"))?;
    let value = HeaderValue::try_from(value.trim()).map_err(|e| format!("header value: {e}"))?;
    Ok((name, value))
}

/// What to drill and how, validated by [`Drill::new`].
#[derive(Debug, Clone)]
pub struct DrillConfig {
    /// The POST endpoint.
    pub url: Url,
    /// Account A's bearer token.
    pub token_a: String,
    /// Account B's bearer token.
    pub token_b: String,
    /// The body every POST sends.
    pub body: String,
    /// Identical requests sent at once in each concurrent round (at least 2).
    pub concurrency: usize,
    /// Concurrent rounds, each with a fresh key (at least 1).
    pub rounds: usize,
    /// The rules the API is held to.
    pub profile: Profile,
    /// Whether a warning fails the run.
    pub strict: bool,
    /// A body the API answers with a 5xx, for the after-5xx check.
    pub failing_body: Option<String>,
    /// How long the key may stay refused after that 5xx; `None`: the published hold of a
    /// claim plus a second, else `max_wait`.
    pub failing_wait: Option<Duration>,
    /// Extra headers for every request (never `Authorization` or `Idempotency-Key`).
    pub headers: HeaderMap,
    /// Dotted path or JSON pointer to the resource id in a JSON answer.
    pub id_field: String,
    /// The longest retention the expiry check waits out.
    pub max_wait: Duration,
    /// How long one request may take.
    pub timeout: Duration,
    /// PEM files of private CAs trusted beside the platform's roots, for an https URL.
    pub ca_certs: Vec<std::path::PathBuf>,
}

impl DrillConfig {
    /// The defaults: [`DEFAULT_BODY`], [`DEFAULT_ROUNDS`] rounds of 3 at once, the draft
    /// profile, not strict, no failing body, `id`, 5 s of waiting, a 10 s timeout.
    pub fn new(url: Url, token_a: impl Into<String>, token_b: impl Into<String>) -> Self {
        Self {
            url,
            token_a: token_a.into(),
            token_b: token_b.into(),
            body: DEFAULT_BODY.to_owned(),
            concurrency: 3,
            rounds: usize::from(DEFAULT_ROUNDS),
            profile: Profile::Draft,
            strict: false,
            failing_body: None,
            failing_wait: None,
            headers: HeaderMap::new(),
            id_field: "id".to_owned(),
            max_wait: Duration::from_secs(5),
            timeout: Duration::from_secs(10),
            ca_certs: Vec::new(),
        }
    }

    /// The settings `args` ask for.
    pub fn from_args(args: &DrillArgs) -> Self {
        Self {
            url: args.url.clone(),
            token_a: args.token_a.clone(),
            token_b: args.token_b.clone(),
            body: args.body.clone(),
            concurrency: usize::from(args.concurrency),
            rounds: usize::from(args.rounds),
            profile: args.profile,
            strict: args.strict,
            failing_body: args.failing_body.clone(),
            failing_wait: args.failing_wait.map(Duration::from_secs),
            headers: args.headers.iter().cloned().collect(),
            id_field: args.id_field.clone(),
            max_wait: Duration::from_secs(args.max_wait),
            timeout: Duration::from_secs(args.timeout),
            ca_certs: args.tls.ca_certs.clone(),
        }
    }
}

/// A drill ready to run against one API.
#[derive(Debug)]
pub struct Drill {
    config: DrillConfig,
    auth_a: HeaderValue,
    auth_b: HeaderValue,
    /// For requests whose retries are part of the check: every POST with a valid key.
    client: Client,
    /// For requests whose first answer is the point (no key, a malformed key, GETs), where a
    /// retry would hide what the API did, or duplicate an unkeyed POST.
    once: Client,
    /// Waits out the published retention in the expiry check.
    sleeper: Arc<dyn Sleeper>,
}

impl Drill {
    /// Validates `config`: an http or https URL (with readable CA files), tokens usable in a header, no header the drill sets
    /// itself, at least two concurrent requests.
    pub fn new(config: DrillConfig) -> anyhow::Result<Self> {
        check_scheme(&config.url).map_err(anyhow::Error::msg)?;
        let auth_a = bearer(&config.token_a).context("--token-a")?;
        let auth_b = bearer(&config.token_b).context("--token-b")?;
        for name in [AUTHORIZATION.as_str(), "idempotency-key"] {
            if config.headers.contains_key(name) {
                bail!("--header {name} is set by the drill itself; it cannot be given");
            }
        }
        if config.token_a == config.token_b {
            bail!("--token-a and --token-b must be two accounts' tokens, not the same one");
        }
        if config.concurrency < 2 {
            bail!("--concurrency must be at least 2 for concurrent copies to meet");
        }
        if config.rounds < 1 {
            bail!("--rounds must be at least 1");
        }
        let http = crate::tls_args::reqwest_builder(&config.ca_certs)?
            // The drill judges the answer the API gives, not where a redirect leads.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .context("cannot build the HTTP client")?;
        let retrying = RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(2),
            max_attempts: 5,
            attempt_timeout: config.timeout,
            max_retry_after: Duration::from_secs(10),
        };
        let client = Client::new()
            .with_http_client(http.clone())
            .with_policy(retrying.clone())
            // A handful of intents: the attempt limit is the bound that matters.
            .with_budget(RetryBudget::unlimited());
        let once = Client::new()
            .with_http_client(http)
            .with_policy(RetryPolicy {
                max_attempts: 1,
                ..retrying
            });
        Ok(Self {
            config,
            auth_a,
            auth_b,
            client,
            once,
            sleeper: Arc::new(TokioSleeper),
        })
    }

    /// Waits out the retention with `sleeper` instead of Tokio's timer; a test's sleeper can
    /// move the server's clock instead of sitting through the wait.
    pub fn with_sleeper(mut self, sleeper: impl Sleeper) -> Self {
        self.sleeper = Arc::new(sleeper);
        self
    }
}

fn bearer(token: &str) -> anyhow::Result<HeaderValue> {
    let mut value = HeaderValue::try_from(format!("Bearer {token}"))
        .context("the token cannot be sent in a header")?;
    value.set_sensitive(true);
    Ok(value)
}

/// Runs `idem drill`, prints the report, and returns 0 when no check failed (with `--strict`,
/// none warned either), 1 otherwise. An error (exit 2) means no check could run.
pub async fn run(args: DrillArgs) -> anyhow::Result<ExitCode> {
    let json = args.json;
    let report = Drill::new(DrillConfig::from_args(&args))?.run().await?;
    if json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.table());
    }
    Ok(report.exit_code())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url() -> Url {
        "http://127.0.0.1:1/payments".parse().unwrap()
    }

    #[test]
    fn headers_parse_as_name_colon_value() {
        let (name, value) = parse_header("X-Tenant: acme:eu").unwrap();
        assert_eq!(
            (name.as_str(), value.to_str().unwrap()),
            ("x-tenant", "acme:eu")
        );
        assert!(parse_header("no colon").is_err());
        assert!(parse_header("bad name: x").is_err());
    }

    #[test]
    fn only_http_and_https_urls_are_drilled() {
        assert!(parse_url("http://localhost:8080/payments").is_ok());
        assert!(parse_url("https://api.example/payments").is_ok());
        assert!(
            parse_url("ftp://x/y")
                .unwrap_err()
                .contains("expected an http or https URL")
        );
        assert!(parse_url("/payments").is_err());
    }

    #[test]
    fn the_drill_refuses_headers_it_sets_itself() {
        for name in ["authorization", "idempotency-key"] {
            let mut config = DrillConfig::new(url(), "a", "b");
            config
                .headers
                .insert(HeaderName::from_static(name), HeaderValue::from_static("x"));
            let err = Drill::new(config).unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
    }

    #[test]
    fn the_two_tokens_must_differ() {
        let err = Drill::new(DrillConfig::new(url(), "a", "a")).unwrap_err();
        assert!(err.to_string().contains("two accounts"), "{err}");
    }

    #[test]
    fn a_token_must_fit_in_a_header() {
        let err = Drill::new(DrillConfig::new(url(), "a\nb", "b")).unwrap_err();
        assert!(format!("{err:#}").contains("--token-a"), "{err:#}");
    }
}
