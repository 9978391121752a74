//! The experiment itself: for each loss rate, the intents without and then with keys, sent
//! through a fresh fault injector to the API under test, and counted afterwards: in the
//! in-process server's database, or as the resource ids the fault injector saw (and the
//! resources the API lists).

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use idem_client::{Client, Intent, RetryBudget, RetryPolicy, Sleep, Sleeper};
use idem_core::AccountId;
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng as _;
use rand::rngs::StdRng;
use reqwest::Url;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};
use tokio::task::JoinSet;

use super::config::{ResourceList, SimulateConfig, TargetApi, render};
use super::proxy::{FaultProxy, INTENT_HEADER, ProxyCounts, Upstream};
use super::report::{
    Expected, RateReport, Report, RunFacts, Target, WithKeys, WithoutKeys, percent,
};
use super::server::Server;
use crate::drill::body::{id_at, member};
use crate::serve::ServeConfig;

/// Attempts per intent: the first and at most 20 retries, as in the published experiment.
const MAX_ATTEMPTS: u32 = 21;

/// The in-process server's payment, one `reference` per intent: the database count groups by
/// it.
const OWN_BODY: &str = r#"{"amount": 49900, "currency": "INR", "reference": "intent-{{intent}}"}"#;

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

/// One (rate, variant) run, and the id that tells it apart: the account its payments go to
/// in the in-process server, `{{run}}` in an API's templates.
#[derive(Debug, Clone)]
struct Run {
    loss: f64,
    variant: Variant,
    id: String,
}

impl Run {
    /// Both variants of every rate, in the order they run. The run id keeps this
    /// simulation's runs apart from any other's against the same API or database.
    fn all(losses: &[f64]) -> Vec<Self> {
        let run_id = uuid::Uuid::now_v7().simple().to_string();
        losses
            .iter()
            .flat_map(|&loss| {
                [Variant::WithoutKeys, Variant::WithKeys].map(|variant| Self {
                    loss,
                    variant,
                    id: format!("sim-{run_id}-p{loss}-{}", variant.slug()),
                })
            })
            .collect()
    }

    /// `5% without keys`.
    fn label(&self) -> String {
        format!("{} {}", percent(self.loss), self.variant.label())
    }
}

/// The API under test, as the runs send to it.
#[derive(Debug)]
struct Api {
    /// Where the fault injector forwards to.
    upstream: Upstream,
    /// The endpoint's path and query, requested from the fault injector.
    path: String,
    /// What each intent sends.
    request: RequestTemplate,
    /// Where the API lists its resources, if it is to be counted there too.
    list: Option<ResourceList>,
}

/// What each intent sends, `{{run}}` and `{{intent}}` not yet filled in.
#[derive(Debug, Clone)]
struct RequestTemplate {
    body: String,
    /// Every request's headers, the list's GET included.
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl RequestTemplate {
    fn body(&self, run: &str, intent: u64) -> String {
        render(&self.body, run, intent)
    }

    /// The headers of intent `intent` of run `run`. `Content-Type` is JSON unless a header
    /// says otherwise.
    fn headers(&self, run: &str, intent: u64) -> anyhow::Result<HeaderMap> {
        let mut headers = HeaderMap::with_capacity(self.headers.len() + 1);
        for (name, value) in &self.headers {
            let value = match value.to_str() {
                Ok(text) if text.contains("{{") => HeaderValue::try_from(render(text, run, intent))
                    .with_context(|| format!("--header {name}: not a header value"))?,
                _ => value.clone(),
            };
            headers.append(name.clone(), value);
        }
        if !headers.contains_key(CONTENT_TYPE) {
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        Ok(headers)
    }
}

impl Api {
    /// An API of the caller's own.
    fn remote(target: &TargetApi) -> anyhow::Result<Self> {
        crate::drill::check_scheme(&target.url).map_err(anyhow::Error::msg)?;
        for name in ["idempotency-key", INTENT_HEADER.as_str()] {
            anyhow::ensure!(
                !target.headers.iter().any(|(n, _)| n == name),
                "--header {name} is set by the simulator itself; it cannot be given"
            );
        }
        let client = crate::tls_args::reqwest_builder(&target.ca_certs)?
            // The fault injector relays the answer the API gives, not where a redirect leads.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .context("cannot build the HTTP client")?;
        let mut origin = target.url.clone();
        origin.set_path("/");
        origin.set_query(None);
        origin.set_fragment(None);
        let path = match target.url.query() {
            Some(query) => format!("{}?{query}", target.url.path()),
            None => target.url.path().to_owned(),
        };
        let api = Self {
            upstream: Upstream {
                origin,
                client,
                id_field: target.id_field.clone(),
            },
            path,
            request: RequestTemplate {
                body: target.body.clone(),
                headers: target.headers.clone(),
            },
            list: target.list.clone(),
        };
        // A template that cannot make a header stops the start, not the first run.
        api.request.headers("sim-check", 0)?;
        Ok(api)
    }

    /// The in-process server at `addr`: one account per run, by its token.
    fn own(addr: std::net::SocketAddr) -> anyhow::Result<Self> {
        // No system proxy may sit between the fault injector and the server on loopback.
        let client = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .context("cannot build the HTTP client")?;
        Ok(Self {
            upstream: Upstream {
                origin: Url::parse(&format!("http://{addr}/")).context("the server's address")?,
                client,
                id_field: "id".to_owned(),
            },
            path: "/payments".to_owned(),
            request: RequestTemplate {
                body: OWN_BODY.to_owned(),
                // The token `start_server` registered for the run's account.
                headers: vec![(AUTHORIZATION, HeaderValue::from_static("Bearer sk_{{run}}"))],
            },
            list: None,
        })
    }

    /// The ids of every resource the list holds for `run` (see [`ResourceList`]).
    async fn listed(&self, list: &ResourceList, run: &str) -> anyhow::Result<HashSet<String>> {
        let url = render(&list.url, run, 0);
        let mut headers = self.request.headers(run, 0)?;
        headers.remove(CONTENT_TYPE);
        let answer = self
            .upstream
            .client
            .get(&url)
            .headers(headers)
            .send()
            .await
            .with_context(|| format!("cannot GET the list {url}"))?;
        let status = answer.status();
        let body = answer
            .bytes()
            .await
            .with_context(|| format!("cannot read the list {url}"))?;
        anyhow::ensure!(
            status.is_success(),
            "the list {url} answered {status}: {}",
            String::from_utf8_lossy(&body)
        );
        let value: serde_json::Value = serde_json::from_slice(&body)
            .with_context(|| format!("the list {url} did not answer JSON"))?;
        let items = match &value {
            serde_json::Value::Array(items) => Some(items),
            other => member(other, &list.field).and_then(serde_json::Value::as_array),
        }
        .with_context(|| {
            format!(
                "the list {url} answered neither an array nor an object with one at {:?}",
                list.field
            )
        })?;
        Ok(items
            .iter()
            .filter_map(|item| id_at(item, &self.upstream.id_field))
            .collect())
    }
}

/// The in-process server and the connection its charges are counted with.
struct OwnServer {
    server: Server,
    counter: SqlitePool,
}

/// Runs the simulation and returns its figures; `progress` counts intents as they finish
/// (pass [`ProgressBar::hidden`] to show nothing).
pub async fn simulate(config: &SimulateConfig, progress: &ProgressBar) -> anyhow::Result<Report> {
    validate(config)?;
    let runs = Run::all(&config.losses);
    let temp = tempfile::tempdir().context("cannot make a temporary folder")?;
    let (api, own, target) = match &config.target {
        Some(target) => {
            let api = Api::remote(target)?;
            let measured = Target::Url {
                url: target.url.to_string(),
                id_field: target.id_field.clone(),
                list_url: target.list.as_ref().map(|list| list.url.clone()),
            };
            (api, None, measured)
        }
        None => {
            let database = match &config.database {
                Some(url) => url.clone(),
                None => format!("sqlite://{}", temp.path().join("simulate.db").display()),
            };
            let server = start_server(&database, &runs).await?;
            let counter = open_counter(&database).await?;
            let api = Api::own(server.addr)?;
            let measured = Target::InProcess {
                database: config.database.clone(),
            };
            (api, Some(OwnServer { server, counter }), measured)
        }
    };
    start_progress(progress, config.requests * runs.len() as u64);

    let mut outcomes: HashMap<(u64, Variant), Outcome> = HashMap::new();
    for run in &runs {
        progress.set_message(run.label());
        let outcome = run_one(config, &api, run, own.as_ref(), progress)
            .await
            .with_context(|| format!("the run at {}", run.label()))?;
        outcomes.insert((run.loss.to_bits(), run.variant), outcome);
    }
    if let Some(own) = own {
        own.counter.close().await;
        own.server.stop().await?;
    }

    let rates = config
        .losses
        .iter()
        .map(|&loss| rate_report(loss, config.requests, &outcomes))
        .collect();
    Ok(Report {
        target,
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
        .map(|run| (token(&run.id), AccountId::new(run.id.clone())))
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
            double_charge_incidents: without.charges().incidents,
            extra_charges: without.charges().extra,
            charges_in_db: without.in_db.map_or(0, |c| c.total),
            run: without.facts(),
        },
        with_keys: WithKeys {
            double_charges: with.charges().incidents,
            extra_charges: with.charges().extra,
            duplicates_prevented: with.proxy.replayed,
            charges_in_db: with.in_db.map_or(0, |c| c.total),
            run: with.facts(),
        },
        expected: Expected {
            double_charge_incidents: n as f64 * loss,
            extra_charges: n as f64 * loss / (1.0 - loss),
        },
    }
}

/// The in-process server's token for the account named `run`.
fn token(run: &str) -> String {
    format!("sk_{run}")
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

/// A run's charges, counted per intent.
#[derive(Debug, Clone, Copy, Default)]
struct Charges {
    /// Charges in all.
    total: u64,
    /// Intents charged at least once.
    intents: u64,
    /// Intents charged more than once.
    incidents: u64,
    /// Σ (charges − 1) over intents.
    extra: u64,
}

impl Charges {
    /// From the number of charges of each intent that has any.
    fn per_intent(counts: impl IntoIterator<Item = u64>) -> Self {
        let mut charges = Self::default();
        for count in counts.into_iter().filter(|&c| c > 0) {
            charges.total += count;
            charges.intents += 1;
            if count > 1 {
                charges.incidents += 1;
                charges.extra += count - 1;
            }
        }
        charges
    }
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
    Ok(Charges::per_intent(
        per_intent
            .into_iter()
            .map(|(_, count)| u64::try_from(count).unwrap_or(0)),
    ))
}

/// The resources a list gained during a run.
#[derive(Debug, Clone, Copy)]
struct Listed {
    /// Ids in the list after the run that were not in it before.
    created: u64,
    /// Of those, ids no answer carried.
    not_seen: u64,
}

/// What one run produced.
#[derive(Debug, Clone)]
struct Outcome {
    run_id: String,
    /// The in-process server's account (the run id), or empty for an API of the caller's own.
    account: String,
    /// Distinct resource ids per intent, as the fault injector saw them.
    seen: Charges,
    /// Payments per intent in the in-process server's database.
    in_db: Option<Charges>,
    listed: Option<Listed>,
    proxy: ProxyCounts,
    unanswered: u64,
    refused: u64,
}

impl Outcome {
    /// The charges the figures report: the database's where there is one, else the ids seen.
    fn charges(&self) -> Charges {
        self.in_db.unwrap_or(self.seen)
    }

    fn facts(&self) -> RunFacts {
        RunFacts {
            run_id: self.run_id.clone(),
            account: self.account.clone(),
            intents_charged: self.charges().intents,
            resources_seen: self.seen.total,
            resources_listed: self.listed.map(|l| l.created),
            listed_not_seen: self.listed.map(|l| l.not_seen),
            attempts: self.proxy.forwarded,
            answers_lost: self.proxy.cut,
            answers_without_id: self.proxy.without_id,
            unanswered: self.unanswered,
            refused: self.refused,
        }
    }
}

/// Sends the N intents of one (rate, variant) through a fresh fault injector, then counts.
async fn run_one(
    config: &SimulateConfig,
    api: &Api,
    run: &Run,
    own: Option<&OwnServer>,
    progress: &ProgressBar,
) -> anyhow::Result<Outcome> {
    let before = match &api.list {
        Some(list) => Some(api.listed(list, &run.id).await?),
        None => None,
    };
    let proxy = FaultProxy::start(api.upstream.clone(), config.seed, run.loss)
        .await
        .context("cannot start the fault injector")?;
    let sender = Sender {
        client: client(config.seed)?,
        url: format!("http://{}{}", proxy.addr(), api.path),
        request: api.request.clone(),
        run_id: run.id.clone(),
        variant: run.variant,
        next: Arc::new(AtomicU64::new(0)),
        requests: config.requests,
        progress: progress.clone(),
    };
    let mut workers = JoinSet::new();
    for _ in 0..config.concurrency.min(config.requests) {
        workers.spawn(sender.clone().send_all());
    }
    let mut sent = Vec::new();
    while let Some(done) = workers.join_next().await {
        sent.push(done.context("a client task panicked")?);
    }
    let counts = proxy.counts();
    let ids = proxy.ids_per_intent();
    // Before the clients' errors: an unreachable API is why they gave up.
    if let Some(error) = proxy.first_upstream_error() {
        anyhow::bail!(
            "the fault injector could not reach the API {} time(s), the first: {error}",
            counts.upstream_errors
        );
    }
    drop(proxy);
    let mut ended = Ended::default();
    for sender in sent {
        let sender = sender?;
        ended.unanswered += sender.unanswered;
        ended.refused += sender.refused;
    }
    let seen = Charges::per_intent(ids.values().map(|ids| ids.len() as u64));
    let listed = match (&api.list, before) {
        (Some(list), Some(before)) => {
            let after = api.listed(list, &run.id).await?;
            let seen_ids: HashSet<&String> = ids.values().flatten().collect();
            let created: Vec<&String> = after.difference(&before).collect();
            Some(Listed {
                created: created.len() as u64,
                not_seen: created.iter().filter(|id| !seen_ids.contains(*id)).count() as u64,
            })
        }
        _ => None,
    };
    let in_db = match own {
        Some(own) => Some(count_charges(&own.counter, &run.id).await?),
        None => None,
    };
    Ok(Outcome {
        run_id: run.id.clone(),
        account: if own.is_some() {
            run.id.clone()
        } else {
            String::new()
        },
        seen,
        in_db,
        listed,
        proxy: counts,
        unanswered: ended.unanswered,
        refused: ended.refused,
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

/// How a sender's intents ended short of a success.
#[derive(Debug, Clone, Copy, Default)]
struct Ended {
    /// Intents that got no answer within the attempt limit.
    unanswered: u64,
    /// Intents whose final answer was a refusal other than a set-up error.
    refused: u64,
}

/// A final answer that says the simulation is set up wrong: a token refused (401, 403), no
/// such route (404, 405), a body the API cannot read (413, 415).
fn is_set_up_error(status: reqwest::StatusCode) -> bool {
    matches!(status.as_u16(), 401 | 403 | 404 | 405 | 413 | 415)
}

/// One run's intents, shared by the tasks that send them: each takes the next number until
/// all `requests` are taken.
#[derive(Debug, Clone)]
struct Sender {
    client: Client,
    url: String,
    request: RequestTemplate,
    run_id: String,
    variant: Variant,
    next: Arc<AtomicU64>,
    requests: u64,
    progress: ProgressBar,
}

impl Sender {
    /// Sends intents until none is left; how many got no answer, and how many a refusal.
    async fn send_all(self) -> anyhow::Result<Ended> {
        let mut ended = Ended::default();
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.requests {
                return Ok(ended);
            }
            match self.client.send(&self.intent(i)?).await {
                Ok(answer) if answer.status.is_success() => {}
                // These mean the set-up is wrong (the token, the URL, the method, the body),
                // not that an answer was lost.
                Ok(answer) if is_set_up_error(answer.status) => anyhow::bail!(
                    "intent {i} was refused with {}: {}",
                    answer.status,
                    String::from_utf8_lossy(&answer.body)
                ),
                // The API's own answer to the intent (a key it requires, a replay it answers
                // with a 409): counted, and the intent made no charge the figures can see.
                Ok(_) => ended.refused += 1,
                Err(idem_client::Error::Transport { .. }) => ended.unanswered += 1,
                Err(e) => return Err(anyhow::Error::new(e).context(format!("intent {i}"))),
            }
            self.progress.inc(1);
        }
    }

    /// Intent `i`: its number in a header for the fault injector, the templates filled in
    /// for this run and intent, and a key unless this is the run without.
    fn intent(&self, i: u64) -> anyhow::Result<Intent> {
        let mut intent = Intent::post(self.url.as_str());
        for (name, value) in &self.request.headers(&self.run_id, i)? {
            intent = intent.header(name.clone(), value.clone());
        }
        let intent = intent
            .header(INTENT_HEADER, HeaderValue::from(i))
            .body(self.request.body(&self.run_id, i));
        Ok(if self.variant == Variant::WithoutKeys {
            intent.without_key()
        } else {
            intent
        })
    }
}
