//! `idem proxy`: the idempotency gateway in front of any HTTP API.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use http::{HeaderName, Uri};
use idem_gateway::{GatewayConfig, InFlight, KeyForwarding, Secret, UnknownOutcome};
use idem_store::{OutcomeChannel, PgStore, RedisStore, SqliteStore, Store};
use tokio::net::TcpListener;

use crate::runtime::{self, shutdown_signal};
use crate::store_url::{StoreUrl, redact};

/// `idem proxy` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ProxyArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub listen: std::net::SocketAddr,
    /// HTTPS for clients instead of HTTP.
    #[command(flatten)]
    pub tls: crate::tls_args::ServerTlsArgs,
    /// The API to protect, e.g. `http://127.0.0.1:3000` or `https://api.internal:8443`.
    #[arg(long)]
    pub upstream: Uri,
    /// Private CAs for an https upstream.
    #[command(flatten)]
    pub upstream_tls: crate::tls_args::ClientTlsArgs,
    /// Where records live: `sqlite://PATH`, `postgres://…` or `redis://HOST:PORT`.
    #[arg(long, default_value = "sqlite://idem-proxy.db")]
    pub store: String,
    /// Key prefix in Redis (several gateways may share one Redis with different prefixes).
    #[arg(long, default_value = "idem")]
    pub redis_prefix: String,
    /// The server secret that scopes keys (HMAC key); also read from IDEM_PROXY_SECRET.
    #[arg(long, env = "IDEM_PROXY_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
    /// Where the secret is kept when not given: read if it exists, generated on first start.
    #[arg(long, default_value = "idem-proxy.secret")]
    pub secret_file: PathBuf,
    /// The request header that identifies the caller.
    #[arg(long, default_value = "authorization")]
    pub credential_header: HeaderName,
    /// A header that, with the credential, makes the scope, such as `Stripe-Account` for a
    /// platform that calls for many accounts with one key; repeatable, all HMACed together.
    #[arg(long = "scope-header", value_name = "NAME")]
    pub scope_headers: Vec<HeaderName>,
    /// How idem's own 4xx bodies are written: `problem` (RFC 9457) or `stripe` (problem details
    /// plus Stripe's `error` member, so Stripe's SDKs raise on them).
    #[arg(long, default_value = "problem", value_parser = parse_errors)]
    pub errors: idem_core::ErrorDialect,
    /// An upstream response header stored and replayed beside Content-Type and Location, such
    /// as `Request-Id`; repeatable.
    #[arg(long = "store-header", value_name = "NAME")]
    pub store_headers: Vec<HeaderName>,
    /// Refuse requests without the credential header with 401 (default: they share one
    /// anonymous scope).
    #[arg(long)]
    pub require_auth: bool,
    /// Pass POST/PATCH requests without an Idempotency-Key through untouched (default: 400).
    #[arg(long)]
    pub key_optional: bool,
    /// What the upstream receives as Idempotency-Key: `as-sent`, `derived` (an HMAC per
    /// account and key) or `none`.
    #[arg(long, default_value = "as-sent", value_parser = parse_forwarding)]
    pub forward_key: KeyForwarding,
    /// What an upstream 5xx does to the key: `store` (replay it, as Stripe does), `keep` (in
    /// progress until the lease ends) or `release` (the next retry goes upstream at once).
    #[arg(long, default_value = "store", value_parser = parse_outcome)]
    pub on_5xx: UnknownOutcome,
    /// What a timeout after the request was sent does to the key: `keep` (default), `store`
    /// or `release`.
    #[arg(long, default_value = "keep", value_parser = parse_outcome)]
    pub on_timeout: UnknownOutcome,
    /// What a duplicate gets while the first request with its key is at the upstream: `409`
    /// at once, or `"wait 10s"` (ms, s or m) for the first one's outcome and its replay, then
    /// 409. Every proxy sharing the store should say the same: one that answers 409 does
    /// not tell the others when it stores an outcome.
    #[arg(long, default_value = "409")]
    pub in_flight: InFlight,
    /// How long the upstream may take, in seconds.
    #[arg(long, default_value_t = 30)]
    pub upstream_timeout_secs: u64,
    /// Serve the proxy's own `/healthz` and `/metrics` on this address instead of on the
    /// main listener (where they shadow the upstream's paths of the same names).
    #[arg(long)]
    pub admin_listen: Option<std::net::SocketAddr>,
    /// How long a key is remembered, in seconds.
    #[arg(long, default_value_t = 24 * 60 * 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub retention_secs: u64,
}

fn parse_errors(s: &str) -> Result<idem_core::ErrorDialect, String> {
    match s {
        "problem" => Ok(idem_core::ErrorDialect::Problem),
        "stripe" => Ok(idem_core::ErrorDialect::Stripe),
        other => Err(format!("expected problem or stripe, not {other:?}")),
    }
}

fn parse_forwarding(s: &str) -> Result<KeyForwarding, String> {
    match s {
        "as-sent" => Ok(KeyForwarding::AsSent),
        "derived" => Ok(KeyForwarding::Derived),
        "none" => Ok(KeyForwarding::Drop),
        _ => Err(format!("expected as-sent, derived or none, got {s:?}")),
    }
}

fn parse_outcome(s: &str) -> Result<UnknownOutcome, String> {
    match s {
        "store" => Ok(UnknownOutcome::Store),
        "keep" => Ok(UnknownOutcome::Keep),
        "release" => Ok(UnknownOutcome::Release),
        _ => Err(format!("expected store, keep or release, got {s:?}")),
    }
}

/// Runs the gateway until Ctrl-C or SIGTERM.
pub async fn run(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    let secret = match &args.secret {
        Some(secret) => Secret::new(secret.as_bytes().to_vec()).context("--secret")?,
        None => Secret::load_or_create(&args.secret_file)?,
    };
    let mut config = GatewayConfig::new(args.upstream.clone(), secret)?;
    config.credential_header = args.credential_header.clone();
    config.scope_headers = args.scope_headers.clone();
    config.errors = args.errors;
    config.policy.stored_headers = args
        .store_headers
        .iter()
        .map(|name| name.as_str().to_owned())
        .collect();
    config.require_auth = args.require_auth;
    config.policy.require_key = !args.key_optional;
    config.policy.retention = Duration::from_secs(args.retention_secs);
    config.forwarding = args.forward_key;
    config.on_5xx = args.on_5xx;
    config.on_timeout = args.on_timeout;
    config.in_flight = args.in_flight;
    config.upstream_timeout = Duration::from_secs(args.upstream_timeout_secs);
    config.clock = Arc::new(idem_core::SystemClock);
    config.upstream_tls = args.upstream_tls.load()?;
    config.tls = args.tls.load()?;

    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let admin = match args.admin_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr}"))?,
        ),
        None => None,
    };
    println!(
        "idem proxy: listening on {}://{} -> {} (store {})",
        if config.tls.is_some() {
            "https"
        } else {
            "http"
        },
        listener.local_addr()?,
        args.upstream,
        redact(&args.store)
    );
    match StoreUrl::parse(&args.store)? {
        StoreUrl::Sqlite(url) => {
            let store = SqliteStore::connect(&url)
                .await
                .with_context(|| format!("cannot open the store {url}"))?;
            run_on(listener, admin, store, config).await
        }
        StoreUrl::Postgres(url) => {
            let store = PgStore::connect(&url)
                .await
                .with_context(|| format!("cannot open the store {}", redact(&url)))?;
            run_on(listener, admin, store, config).await
        }
        StoreUrl::Redis(url) => {
            let store = RedisStore::connect(&url, args.redis_prefix.clone())
                .await
                .with_context(|| format!("cannot open the store {}", redact(&url)))?;
            run_on(listener, admin, store, config).await
        }
    }
}

async fn run_on<St: OutcomeChannel>(
    listener: TcpListener,
    admin: Option<TcpListener>,
    store: St,
    mut config: GatewayConfig,
) -> anyhow::Result<ExitCode> {
    // Only a proxy that waits listens (a connection held for good) and publishes.
    if let InFlight::Wait(_) = config.in_flight {
        config.outcome_signal = idem_gateway::outcome_signal(&store)
            .await
            .context("cannot listen for outcome wake-ups")?;
    }
    let admin_routes = admin_router(store.clone());
    let head_timeout = config.head_timeout;
    let tls = config.tls.clone();
    // Redis expires its records itself too; SQLite and PostgreSQL rely on this alone.
    let sweeper = crate::sweeper::spawn(store.clone(), config.clock.clone());
    let gateway = idem_gateway::router(store, config);
    let app = match admin {
        Some(admin) => {
            tokio::spawn(async move { axum::serve(admin, admin_routes).await });
            gateway
        }
        // Routes win over the gateway's fallback, so these two paths are the proxy's own.
        None => admin_routes.merge(gateway),
    };
    let served = match tls {
        Some(tls) => {
            idem_gateway::server::serve_tls(listener, app, head_timeout, tls, shutdown_signal())
                .await
        }
        None => idem_gateway::server::serve(listener, app, head_timeout, shutdown_signal()).await,
    }
    .context("the gateway failed");
    sweeper.abort();
    served?;
    Ok(ExitCode::SUCCESS)
}

/// `/healthz` (the store answers) and `/metrics` (Prometheus text).
fn admin_router<St: Store>(store: St) -> axum::Router {
    use axum::response::IntoResponse;
    let metrics = runtime::metrics_handle();
    axum::Router::new()
        .route(
            "/healthz",
            axum::routing::get(move || {
                let store = store.clone();
                async move {
                    // A read of a key nobody uses: it proves the store answers.
                    let probe = idem_core::Scope::new(
                        idem_core::AccountId::new("idem-healthz"),
                        idem_core::IdempotencyKey::new("healthz-probe", Default::default())
                            .expect("a valid key"),
                    );
                    match store.get(&probe).await {
                        Ok(_) => axum::Json(serde_json::json!({"status": "ok"})).into_response(),
                        Err(e) => (
                            http::StatusCode::SERVICE_UNAVAILABLE,
                            axum::Json(serde_json::json!({"status": "unavailable", "error": e.to_string()})),
                        )
                            .into_response(),
                    }
                }
            }),
        )
        .route(
            "/metrics",
            axum::routing::get(move || {
                let metrics = metrics.clone();
                async move { runtime::metrics_response(&metrics) }
            }),
        )
}
