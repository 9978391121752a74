//! `idem serve`: the reference payments API (docs/contract.md §4), the testbed for everything else.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use idem_core::{AccountId, Clock, Policy, SystemClock};
use idem_store::{PgStore, SqliteStore};

use idem_tower::IdempotencyLayer;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

use self::backend::Backend;
use crate::runtime::{self, metrics_handle, shutdown_signal};
use crate::store_url::{StoreUrl, redact};

mod auth;
mod backend;
mod invoices;
mod openapi;
mod payments;
mod payouts;
mod relay;

pub(crate) use backend::{Backend as ServiceBackend, Receipt};
pub use payouts::PausePoint;

/// `idem serve` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// HTTPS instead of HTTP.
    #[command(flatten)]
    pub tls: crate::tls_args::ServerTlsArgs,
    /// Where records and payments live: `sqlite://PATH` (created on first start) or
    /// `postgres://USER@HOST/DB` (shared by any number of `idem serve` instances).
    #[arg(long, default_value = "sqlite://idem.db")]
    pub database: String,
    /// A sandbox API token and the account it authenticates, `TOKEN=ACCOUNT`; repeatable.
    /// Without any, `sk_test_alice=acct_alice` and `sk_test_bob=acct_bob` are registered.
    #[arg(long = "token", value_name = "TOKEN=ACCOUNT", value_parser = parse_token)]
    pub tokens: Vec<(String, String)>,
    /// How long a key is remembered, in seconds (published at /idempotency-policy).
    #[arg(long, default_value_t = 24 * 60 * 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub retention_secs: u64,
    /// How long a duplicate waits for the original before 409, in seconds.
    #[arg(long, default_value_t = 10)]
    pub in_flight_wait_secs: u64,
    /// Accept POSTs without an Idempotency-Key (processed with no protection). For
    /// experiments such as `idem simulate`; never in production.
    #[arg(long)]
    pub key_optional: bool,
    /// The payment provider `POST /payouts` calls (see `idem fake-psp`). Without one, a fake
    /// provider runs inside the service.
    #[arg(long)]
    pub psp_url: Option<String>,
    /// How long the provider may take, in seconds. A payout's claim is held this much longer
    /// than its lease, so a crashed worker's call is over before anyone asks what it did.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub psp_timeout_secs: u64,
    /// How long a payout's claim holds without renewal, in seconds. A crashed worker's payout
    /// is reconciled with the provider once its lease and then the provider timeout have
    /// passed since its last renewal: no call it made can still be running by then.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_secs: u64,
    /// Let a duplicate payout wait up to this many seconds for the original's outcome
    /// (woken by a notification, LISTEN/NOTIFY on PostgreSQL) instead of answering 409 at
    /// once; 0 answers 409 at once.
    #[arg(long, default_value_t = 0)]
    pub wait_for_outcome_secs: u64,
    /// Freeze every payout at this point (for crash tests).
    #[arg(long, hide = true)]
    pub fault_pause: Option<PausePoint>,
    /// Announce each payment as a `payment.succeeded` event through the transactional outbox,
    /// and relay the outbox to this broker: `nats://HOST:PORT` (JetStream), `amqp://USER:PASS@HOST:PORT`
    /// (RabbitMQ) or `kafka://HOST:PORT`. Every instance on a PostgreSQL database may relay.
    #[arg(long, value_name = "URL")]
    pub broker: Option<String>,
    /// Keeps this deployment's streams, exchanges and topics apart from others' on the broker.
    #[arg(long, default_value = "idem")]
    pub broker_namespace: String,
    /// How often the relay looks for events to publish, in milliseconds.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..))]
    pub relay_poll_ms: u64,
    /// Claim first, without the read that answers replays before anything is claimed: a
    /// payment costs one statement less, a replay a transaction instead of one read. For APIs
    /// whose retries are rare.
    #[arg(long)]
    pub no_replay_read: bool,
    /// Freeze the relay after it publishes an event and before it marks it sent (crash tests).
    #[arg(long, hide = true)]
    pub fault_pause_after_publish: bool,
}

fn parse_token(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((token, account)) if !token.is_empty() && !account.is_empty() => {
            Ok((token.to_owned(), account.to_owned()))
        }
        _ => Err(format!("expected TOKEN=ACCOUNT, got {s:?}")),
    }
}

/// Everything `serve` needs, validated.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The database URL.
    pub database: String,
    /// Bearer token → account.
    pub tokens: HashMap<String, AccountId>,
    /// The idempotency policy.
    pub policy: Policy,
    /// The clock (tests move it).
    pub clock: Arc<dyn Clock>,
    /// The payment provider's base URL; `None` runs a fake one in-process.
    pub psp_url: Option<String>,
    /// How long the provider may take.
    pub psp_timeout: Duration,
    /// Where payouts freeze, for crash tests.
    pub fault_pause: Option<PausePoint>,
    /// How often stale payouts are reconciled (default: half the lease); a payout whose
    /// provider call failed is reconciled at once.
    pub reconcile_every: Option<Duration>,
    /// How long a duplicate payout waits for the original's outcome (zero: `409` at once).
    pub wait_for_outcome: Duration,
    /// How long a client may take to send a request head.
    pub head_timeout: Duration,
    /// Serve HTTPS with this certificate instead of plain HTTP.
    pub tls: Option<idem_gateway::ServerTls>,
    /// The broker the outbox relays to; `None` writes no events.
    pub broker: Option<idem_consumer::any::BrokerSettings>,
    /// How often the relay looks for events.
    pub relay_poll: Duration,
    /// Freeze the relay between publishing and marking sent, for crash tests.
    pub fault_pause_after_publish: bool,
    /// Whether replays are answered from a read before anything is claimed (the default).
    pub replay_read: bool,
}

/// Where `idem serve` publishes its idempotency rules; its refusals link here.
pub const POLICY_PATH: &str = "/idempotency-policy";

/// The sandbox tokens registered when none are given.
pub const DEFAULT_TOKENS: [(&str, &str); 2] =
    [("sk_test_alice", "acct_alice"), ("sk_test_bob", "acct_bob")];

impl ServeConfig {
    /// Defaults: the sandbox tokens, the default policy, the system clock.
    pub fn new(database: impl Into<String>) -> Self {
        Self {
            database: database.into(),
            tokens: DEFAULT_TOKENS
                .iter()
                .map(|(t, a)| (t.to_string(), AccountId::new(*a)))
                .collect(),
            policy: Policy::default(),
            clock: Arc::new(SystemClock),
            psp_url: None,
            psp_timeout: Duration::from_secs(10),
            fault_pause: None,
            reconcile_every: None,
            wait_for_outcome: Duration::ZERO,
            head_timeout: idem_gateway::server::HEAD_TIMEOUT,
            tls: None,
            broker: None,
            relay_poll: Duration::from_millis(200),
            fault_pause_after_publish: false,
            replay_read: true,
        }
    }

    fn from_args(args: &ServeArgs) -> Self {
        let mut config = Self::new(args.database.clone());
        if !args.tokens.is_empty() {
            config.tokens = args
                .tokens
                .iter()
                .map(|(t, a)| (t.clone(), AccountId::new(a.clone())))
                .collect();
        }
        config.policy.retention = Duration::from_secs(args.retention_secs);
        config.policy.in_flight_wait = Duration::from_secs(args.in_flight_wait_secs);
        config.policy.require_key = !args.key_optional;
        config.policy.lease = Duration::from_secs(args.lease_secs);
        config.psp_url = args.psp_url.clone();
        config.psp_timeout = Duration::from_secs(args.psp_timeout_secs);
        config.fault_pause = args.fault_pause;
        config.wait_for_outcome = Duration::from_secs(args.wait_for_outcome_secs);
        config.broker = args.broker.as_ref().map(|url| {
            idem_consumer::any::BrokerSettings::new(
                url.clone(),
                args.broker_namespace.clone(),
                runtime::PAYMENTS_TOPIC,
                runtime::DEFAULT_CONSUMER,
            )
        });
        config.relay_poll = Duration::from_millis(args.relay_poll_ms);
        config.fault_pause_after_publish = args.fault_pause_after_publish;
        config.replay_read = !args.no_replay_read;
        config
    }
}

/// Runs `idem serve` until Ctrl-C or SIGTERM.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = ServeConfig::from_args(&args);
    config.tls = args.tls.load()?;
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let mut accounts: Vec<_> = config.tokens.iter().collect();
    accounts.sort_by(|a, b| a.1.cmp(b.1));
    println!(
        "idem serve: listening on {}://{} (database {})",
        if config.tls.is_some() {
            "https"
        } else {
            "http"
        },
        listener.local_addr()?,
        redact(&config.database)
    );
    for (token, account) in accounts {
        println!("  sandbox token {token} -> account {account}");
    }
    serve(listener, config, shutdown_signal()).await
}

/// Serves the API on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    match StoreUrl::parse_database(&config.database)? {
        StoreUrl::Sqlite(url) => {
            let store = SqliteStore::open_service(&url).await?;
            serve_on(store, listener, &config, shutdown).await
        }
        StoreUrl::Postgres(url) => {
            let store = PgStore::open_service(&url).await?;
            serve_on(store, listener, &config, shutdown).await
        }
        StoreUrl::Redis(_) => unreachable!("parse_database refuses Redis"),
    }
}

async fn serve_on<B: Backend>(
    store: B,
    listener: TcpListener,
    config: &ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let psp_url = match &config.psp_url {
        Some(url) => url.clone(),
        None => start_fake_provider().await?,
    };
    let signal = store.outcome_signal().await?;
    let reconciliation = idem_tower::Reconciliation::new(
        config
            .reconcile_every
            .unwrap_or(config.policy.lease / 2)
            .max(Duration::from_millis(100)),
    );
    // Connecting to the broker first means a wrong URL stops the service at start, not
    // silently later.
    let relay = match &config.broker {
        Some(settings) => Some(relay::start(&store, settings, config).await?),
        None => None,
    };
    let app = App {
        outbox: config.broker.is_some(),
        signal,
        reconciliation,
        store,
        policy: Arc::new(config.policy.clone()),
        clock: config.clock.clone(),
        metrics: metrics_handle(),
        provider: payouts::Provider::new(psp_url, config.psp_timeout, config.fault_pause),
    };
    let addr = listener.local_addr()?;
    tracing::info!(%addr, database = %redact(&config.database), "idem serve listening");

    // The sweeper: every instance may run it; each statement deletes at most 1,000 rows.
    let sweeper = crate::sweeper::spawn(app.store.clone(), config.clock.clone());
    let reconciler = payouts::spawn_reconciler(&app);
    let mut background = vec![sweeper.abort_handle(), reconciler.abort_handle()];
    // A relay pass cut short leaves its rows pending (PostgreSQL rolls back): the next start
    // publishes them again, and the consumers' inbox absorbs any copy.
    background.extend(relay.into_iter().flatten());

    let router = app.router(config);
    let result = match config.tls.clone() {
        Some(tls) => {
            idem_gateway::server::serve_tls(listener, router, config.head_timeout, tls, shutdown)
                .await
        }
        None => idem_gateway::server::serve(listener, router, config.head_timeout, shutdown).await,
    }
    .context("the server failed");
    for task in background {
        task.abort();
    }
    result
}

/// Starts a fake payment provider on a free loopback port; returns its URL.
async fn start_fake_provider() -> anyhow::Result<String> {
    // A newcomer's `idem serve` pays out through a fake provider of its own.
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let psp = crate::fake_psp::FakePsp::default();
    tokio::spawn(async move { axum::serve(listener, psp.router()).await });
    tracing::info!(%url, "payouts go to a fake payment provider inside the service");
    Ok(url)
}

/// Shared state of the service.
#[derive(Debug, Clone)]
pub(crate) struct App<B> {
    pub(crate) store: B,
    pub(crate) policy: Arc<Policy>,
    pub(crate) clock: Arc<dyn Clock>,
    metrics: PrometheusHandle,
    pub(crate) provider: payouts::Provider,
    pub(crate) signal: idem_tower::OutcomeSignal,
    /// When the payout reconciler looks next.
    pub(crate) reconciliation: idem_tower::Reconciliation,
    /// Whether payments write `payment.succeeded` to the outbox (a broker is configured).
    pub(crate) outbox: bool,
}

impl<B: Backend> App<B> {
    fn router(&self, config: &ServeConfig) -> Router {
        let mut idempotency = IdempotencyLayer::transactional(self.store.clone())
            .with_policy(config.policy.clone())
            .with_policy_link(POLICY_PATH)
            .with_clock(config.clock.clone());
        // Payouts call the provider: lease mode, and a crashed worker's payout is reconciled
        // with the provider rather than run again.
        let mut leased = IdempotencyLayer::leased(self.store.clone())
            .without_takeover()
            .with_reconciliation(self.reconciliation.clone());
        if !config.wait_for_outcome.is_zero() {
            leased = leased.with_outcome_wait(config.wait_for_outcome, self.signal.clone());
        }
        // A payout's claim outlasts its longest provider call (derived, never guessed).
        let payout_policy = Policy {
            downstream_timeout: config.psp_timeout,
            ..config.policy.clone()
        };
        let mut leased = leased
            .with_policy(payout_policy)
            .with_policy_link(POLICY_PATH)
            .with_clock(config.clock.clone());
        if !config.replay_read {
            idempotency = idempotency.without_replay_read();
            leased = leased.without_replay_read();
        }
        let tokens = Arc::new(config.tokens.clone());
        // Each layer wraps the methods it guards and nothing else, so a method a route does
        // not have is answered 405 before any key rule (route_layer leaves the 405 fallback
        // outside it); GET passes through untouched anyway.
        let transactional = Router::new()
            .route(
                "/payments",
                axum::routing::post(payments::create::<B>)
                    .route_layer(idempotency.clone())
                    .get(payments::list::<B>),
            )
            .route("/payments/{id}", get(payments::show::<B>))
            .route(
                "/invoices",
                axum::routing::post(invoices::create::<B>).route_layer(idempotency),
            );
        let leased = Router::new().route(
            "/payouts",
            axum::routing::post(payouts::create::<B>).route_layer(leased),
        );
        // The layers cover POST and PATCH; authentication runs before them, so the account is
        // known when the key is scoped.
        let api = transactional
            .merge(leased)
            .layer(axum::middleware::from_fn_with_state(
                tokens,
                auth::authenticate,
            ));
        Router::new()
            .route("/healthz", get(healthz::<B>))
            .route("/metrics", get(metrics::<B>))
            .route(POLICY_PATH, get(policy::<B>))
            .route("/openapi.json", get(openapi::document::<B>))
            .merge(api)
            .with_state(self.clone())
    }
}

async fn healthz<B: Backend>(State(app): State<App<B>>) -> Response {
    match app.store.ping().await {
        Ok(_) => axum::Json(serde_json::json!({"status": "ok"})).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"status": "unavailable", "error": e.to_string()})),
        )
            .into_response(),
    }
}

async fn metrics<B: Backend>(State(app): State<App<B>>) -> Response {
    runtime::metrics_response(&app.metrics)
}

async fn policy<B: Backend>(State(app): State<App<B>>) -> Response {
    let mut published =
        serde_json::to_value(app.policy.published("transaction")).expect("the policy serialises");
    // /payouts runs in lease mode: its own rules, beside the transaction mode's above.
    let (lease, timeout) = (app.policy.lease, app.provider.timeout);
    published["lease_mode"] = serde_json::json!({
        "routes": ["POST /payouts"],
        "in_flight": "409 urn:idem:problem:in-use with Retry-After (or a bounded wait for the outcome, --wait-for-outcome-secs)",
        "lease_seconds": lease.as_secs(),
        "downstream_timeout_seconds": timeout.as_secs(),
        "claim_held_seconds": (lease + timeout).as_secs(),
        "unknown_outcome": "409 urn:idem:problem:outcome-unknown with Retry-After until the reconciler has asked the provider; never run again without asking",
        "reconcile_every_seconds": app.reconciliation.period().as_secs_f64(),
    });
    axum::Json(published).into_response()
}
