//! `idem serve`: the reference payments API (docs/contract.md §4), the testbed for everything else.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use idem_core::Policy;
use idem_store::{SqliteStore, TokioPgStore};

use idem_tower::IdempotencyLayer;
use tokio::net::TcpListener;

use self::app::App;
use self::backend::Backend;
use self::provider::Provider;
use crate::runtime::{self, metrics_handle, shutdown_signal};
use crate::store_url::{StoreUrl, redact};

mod app;
mod auth;
mod backend;
mod config;
mod error;
mod invoices;
mod openapi;
mod payments;
mod payouts;
mod provider;
mod relay;

pub(crate) use backend::{Backend as ServiceBackend, Receipt};
pub use config::{DEFAULT_TOKENS, POLICY_PATH, ServeArgs, ServeConfig};
pub use provider::PausePoint;

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
            if config.notify_database.is_some() {
                anyhow::bail!("--notify-database-url applies to a PostgreSQL database");
            }
            let store = SqliteStore::open_service(&url).await?;
            serve_on(store, listener, &config, shutdown).await
        }
        StoreUrl::Postgres(url) => {
            let mut store = TokioPgStore::open_service(&url)
                .await?
                .with_pool_size(config.db_pool_size);
            if let Some(direct) = &config.notify_database {
                store = store.with_notify_url(direct).with_context(|| {
                    format!("cannot use the notify database URL {}", redact(direct))
                })?;
            }
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
        provider: Provider::new(psp_url, config.psp_timeout, config.fault_pause),
    };
    let addr = listener.local_addr()?;
    tracing::info!(%addr, database = %redact(&config.database), "idem serve listening");

    // The sweeper, from the start (the layers run none of their own: both cover this one
    // store). Every instance may run it; each statement deletes at most 1,000 rows.
    let sweeper =
        idem_tower::spawn_sweeper(app.store.clone(), config.clock.clone(), config.sweep_every);
    let reconciler = payouts::spawn_reconciler(&app);
    let mut background = vec![sweeper.abort_handle(), reconciler.abort_handle()];
    // A relay pass cut short leaves its rows pending (PostgreSQL rolls back): the next start
    // publishes them again, and the consumers' inbox absorbs any copy.
    background.extend(relay.into_iter().flatten());

    let router = crate::telemetry::with_server_spans(app.router(config));
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

impl<B: Backend> App<B> {
    fn router(&self, config: &ServeConfig) -> Router {
        let mut idempotency = IdempotencyLayer::transactional(self.store.clone())
            .without_sweeper()
            .with_policy(config.policy.clone())
            .with_policy_link(POLICY_PATH)
            .with_clock(config.clock.clone());
        // Payouts call the provider: lease mode, and a crashed worker's payout is reconciled
        // with the provider rather than run again.
        let mut leased = IdempotencyLayer::leased(self.store.clone())
            .without_sweeper()
            .without_takeover()
            .with_reconciliation(self.reconciliation.clone());
        if !config.wait_for_outcome.is_zero() {
            leased = leased.with_outcome_signal(config.wait_for_outcome, self.signal.clone());
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
        match config.replay_read {
            Some(false) => {
                idempotency = idempotency.without_replay_read();
                leased = leased.without_replay_read();
            }
            Some(true) => {
                idempotency = idempotency.with_replay_read();
                leased = leased.with_replay_read();
            }
            None => {}
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
        let router = Router::new()
            .route("/healthz", get(healthz::<B>))
            .route("/metrics", get(metrics::<B>))
            .route(POLICY_PATH, get(policy::<B>))
            .route("/openapi.json", get(openapi::document::<B>))
            .merge(api)
            .with_state(self.clone());
        // Mounted only with a token: without one, /admin is a path like any other (404).
        match &config.admin_token {
            Some(token) => router.merge(crate::admin::api::router(
                self.store.clone(),
                token.clone(),
                config.clock.clone(),
            )),
            None => router,
        }
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
