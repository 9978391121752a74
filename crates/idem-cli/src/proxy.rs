//! `idem proxy`: the idempotency gateway in front of any HTTP API.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use http::{HeaderName, Uri};
use idem_gateway::{
    Anonymous, ClientTls, ConfigFile, Credential, GatewayConfig, InFlight, KeyForwarding, KeyRule,
    RouteRules, Secret, SecretOrigin, ServerTls, UnknownOutcome,
};
use idem_store::{
    AdminStore, OutcomeChannel, PgStore, RedisStore, SharedSecret, SqliteStore, Store,
};
use tokio::net::TcpListener;

use crate::runtime::{self, shutdown_signal};
use crate::store_url::{StoreUrl, redact};

/// `idem proxy` flags. Those that a configuration file also sets override its top-level
/// values.
#[derive(Debug, Clone, clap::Args)]
pub struct ProxyArgs {
    /// Per-route rules and their defaults from a TOML file (docs/contract.md §10).
    #[arg(long, value_name = "FILE.toml")]
    pub config: Option<PathBuf>,
    /// Validate FILE.toml, print the effective rules (every route, defaults filled in) and
    /// exit: 0 when valid, 2 with the error's line when not.
    #[arg(long, value_name = "FILE.toml", conflicts_with = "config")]
    pub check_config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:8081].
    #[arg(long)]
    pub listen: Option<std::net::SocketAddr>,
    /// HTTPS for clients instead of HTTP.
    #[command(flatten)]
    pub tls: crate::tls_args::ServerTlsArgs,
    /// The API to protect, e.g. `http://127.0.0.1:3000` or `https://api.internal:8443`
    /// (required unless the configuration file names it). Kept as text, checked by clap: a
    /// `Uri` would make these flags the largest of the commands by far.
    #[arg(long, value_parser = parse_upstream)]
    pub upstream: Option<String>,
    /// Private CAs for an https upstream.
    #[command(flatten)]
    pub upstream_tls: crate::tls_args::ClientTlsArgs,
    /// Where records live: `sqlite://PATH`, `postgres://…`, `redis://HOST:PORT` or a Redis
    /// Cluster, `redis+cluster://HOST:PORT,HOST:PORT,…` [default: sqlite://idem-proxy.db].
    #[arg(long)]
    pub store: Option<String>,
    /// PostgreSQL behind a pooler that lends sessions per transaction (PgBouncer in transaction
    /// mode): a URL of the same database that reaches PostgreSQL directly, for the
    /// notifications (`LISTEN`) that wake duplicates waiting for an outcome. Without one there,
    /// waiting duplicates look at the store again every 250 ms instead.
    #[arg(long, value_name = "URL")]
    pub notify_database_url: Option<String>,
    /// Key prefix in Redis (several gateways may share one Redis with different prefixes).
    #[arg(long, default_value = "idem")]
    pub redis_prefix: String,
    /// On Redis: make each claim and stored outcome wait until this many replicas have it
    /// (`WAIT`), and answer 503 when they do not confirm within --redis-wait-timeout-ms, so an
    /// answered request's record survives a failover [default: 0, asynchronous replication].
    #[arg(long, default_value_t = 0)]
    pub redis_wait_replicas: u32,
    /// How long replicas have to confirm a write under --redis-wait-replicas, in milliseconds.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub redis_wait_timeout_ms: u64,
    /// The server secret that scopes keys (HMAC key); also read from IDEM_PROXY_SECRET. Every
    /// proxy on one store must be given the same. Without it (and --secret-file) the secret
    /// lives in the store, made by the first proxy to start and read by the others.
    #[arg(long, env = "IDEM_PROXY_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
    /// Read the server secret from this file (its text, trimmed), which must exist; kept out
    /// of the store like --secret. Without it, an `idem-proxy.secret` in the working directory
    /// (made by earlier versions) is moved into a store that has no secret yet.
    #[arg(long, value_name = "FILE", conflicts_with = "secret")]
    pub secret_file: Option<PathBuf>,
    /// Where the caller's credential is, from which its scope is derived: `header:NAME` or
    /// `cookie:NAME` (a session cookie) [default: header:Authorization].
    #[arg(long, value_name = "header:NAME|cookie:NAME")]
    pub credential: Option<Credential>,
    /// The request header that identifies the caller: the same as `--credential header:NAME`.
    #[arg(long, value_name = "NAME", conflicts_with = "credential")]
    pub credential_header: Option<HeaderName>,
    /// What a covered request without the credential gets: `refuse` (401 no-credential),
    /// `route` (one scope per route for such callers) or `shared` (one scope for every such
    /// caller: one can be replayed another's answer) [default: refuse; routes with key_from:
    /// route].
    #[arg(long)]
    pub anonymous: Option<Anonymous>,
    /// A header that, with the credential, makes the scope, such as `Stripe-Account` for a
    /// platform that calls for many accounts with one key; repeatable, all HMACed together.
    #[arg(long = "scope-header", value_name = "NAME")]
    pub scope_headers: Vec<HeaderName>,
    /// How idem's own 4xx bodies are written: `problem` (RFC 9457) or `stripe` (problem details
    /// plus Stripe's `error` member, so Stripe's SDKs raise on them) [default: problem].
    #[arg(long, value_parser = parse_errors)]
    pub errors: Option<idem_core::ErrorDialect>,
    /// An upstream response header stored and replayed beside Content-Type and Location, such
    /// as `Request-Id`; repeatable.
    #[arg(long = "store-header", value_name = "NAME")]
    pub store_headers: Vec<HeaderName>,
    /// Refuse every request without the credential with 401, whatever its method or route
    /// (default: only covered requests need it; webhook routes need none).
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
    /// at once, or `"wait 10s"` (a duration as the configuration file writes it, at most 1m)
    /// for the first one's outcome and its replay, then 409. Every proxy sharing the store
    /// should say the same: one that answers 409 does not tell the others when it stores an
    /// outcome [default: 409].
    #[arg(long)]
    pub in_flight: Option<InFlight>,
    /// How long the upstream may take, in seconds.
    #[arg(long, default_value_t = 30)]
    pub upstream_timeout_secs: u64,
    /// Serve the proxy's own `/healthz` and `/metrics` on this address instead of on the
    /// main listener (where they shadow the upstream's paths of the same names).
    #[arg(long)]
    pub admin_listen: Option<std::net::SocketAddr>,
    /// Serve the admin API (`/admin/keys…`: list, show and resolve keys) to requests that
    /// carry `Authorization: Bearer TOKEN`, beside /healthz and /metrics (on --admin-listen
    /// if given, where it shadows no upstream path); also read from IDEM_ADMIN_TOKEN. Without
    /// it there is no admin API, and /admin paths go upstream like any other.
    #[arg(long, env = "IDEM_ADMIN_TOKEN", hide_env_values = true, value_parser = crate::admin::parse_admin_token)]
    pub admin_token: Option<crate::admin::api::AdminToken>,
    /// How long a key is remembered, in seconds [default: 86400].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub retention_secs: Option<u64>,
}

const DEFAULT_LISTEN: &str = "127.0.0.1:8081";
const DEFAULT_STORE: &str = "sqlite://idem-proxy.db";
/// Where versions before the secret moved into the store kept it.
const LEGACY_SECRET_FILE: &str = "idem-proxy.secret";

/// What the flags and the configuration file make together.
struct Settings {
    listen: std::net::SocketAddr,
    upstream: Option<Uri>,
    store: String,
    credential: Credential,
    defaults: RouteRules,
    routes: Vec<idem_gateway::Route>,
}

impl ProxyArgs {
    /// The settings from `file` (if any) with the flags given on top of its top-level values.
    fn settings(&self, file: Option<&ConfigFile>) -> Settings {
        let credential = self
            .credential
            .clone()
            .or_else(|| self.credential_header.clone().map(Credential::Header))
            .or_else(|| file.and_then(|f| f.credential.clone()))
            .unwrap_or_default();
        // The file lists a credential header among the scope headers (it is always part of
        // the scope); the gateway's scope headers are those HMACed besides it.
        let not_the_credential =
            |h: &HeaderName| !matches!(&credential, Credential::Header(c) if c == h);
        let mut defaults = RouteRules::default();
        if let Some(file) = file {
            file.defaults.apply(&mut defaults);
            defaults.scope_headers.retain(not_the_credential);
        }
        if !self.scope_headers.is_empty() {
            defaults.scope_headers = self.scope_headers.clone();
        }
        if !self.store_headers.is_empty() {
            defaults.store_headers = self.store_headers.clone();
        }
        if let Some(errors) = self.errors {
            defaults.errors = errors;
        }
        if self.key_optional {
            defaults.key = KeyRule::Optional;
        }
        if let Some(secs) = self.retention_secs {
            defaults.retention = Duration::from_secs(secs);
        }
        if let Some(in_flight) = self.in_flight {
            defaults.in_flight = in_flight;
        }
        if let Some(anonymous) = self.anonymous {
            defaults.anonymous = anonymous;
        }
        Settings {
            listen: self
                .listen
                .or(file.and_then(|f| f.listen))
                .unwrap_or_else(|| DEFAULT_LISTEN.parse().expect("an address")),
            upstream: self
                .upstream
                .as_deref()
                .map(|s| s.parse().expect("checked by parse_upstream"))
                .or_else(|| file.and_then(|f| f.upstream.clone())),
            store: self
                .store
                .clone()
                .or_else(|| file.and_then(|f| f.store.clone()))
                .unwrap_or_else(|| DEFAULT_STORE.to_owned()),
            routes: file
                .map(|f| f.routes(&defaults))
                .unwrap_or_default()
                .into_iter()
                .map(|mut route| {
                    route.rules.scope_headers.retain(not_the_credential);
                    route
                })
                .collect(),
            defaults,
            credential,
        }
    }
}

/// Reads the configuration file at `path`, its errors prefixed with the path.
fn load_config(path: &std::path::Path) -> anyhow::Result<ConfigFile> {
    ConfigFile::load(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// `--check-config FILE`: prints the effective rules, or fails (exit 2) with the error.
fn check_config(args: &ProxyArgs, path: &std::path::Path) -> anyhow::Result<ExitCode> {
    let file = load_config(path)?;
    let settings = args.settings(Some(&file));
    println!("# {}: valid", path.display());
    println!("listen = \"{}\"", settings.listen);
    if let Some(upstream) = &settings.upstream {
        println!("upstream = \"{upstream}\"");
    }
    println!("store = \"{}\"", redact(&settings.store));
    println!("credential = \"{}\"", settings.credential);
    print!(
        "\n{}",
        idem_gateway::describe(&settings.routes, &settings.defaults, &settings.credential)
    );
    Ok(ExitCode::SUCCESS)
}

fn parse_upstream(s: &str) -> Result<String, String> {
    s.parse::<Uri>()
        .map(|_| s.to_owned())
        .map_err(|e| format!("{s:?}: {e}"))
}

fn parse_errors(s: &str) -> Result<idem_core::ErrorDialect, String> {
    parse_named(
        s,
        &[
            ("problem", idem_core::ErrorDialect::Problem),
            ("stripe", idem_core::ErrorDialect::Stripe),
        ],
    )
}

fn parse_forwarding(s: &str) -> Result<KeyForwarding, String> {
    parse_named(
        s,
        &[
            ("as-sent", KeyForwarding::AsSent),
            ("derived", KeyForwarding::Derived),
            ("none", KeyForwarding::Drop),
        ],
    )
}

fn parse_outcome(s: &str) -> Result<UnknownOutcome, String> {
    parse_named(
        s,
        &[
            ("store", UnknownOutcome::Store),
            ("keep", UnknownOutcome::Keep),
            ("release", UnknownOutcome::Release),
        ],
    )
}

/// The value `s` names among `choices` (at least two), or an error that lists the names.
fn parse_named<T: Copy>(s: &str, choices: &[(&str, T)]) -> Result<T, String> {
    if let Some((_, value)) = choices.iter().find(|(name, _)| *name == s) {
        return Ok(*value);
    }
    let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
    let (last, others) = names.split_last().unwrap_or((&"", &[]));
    Err(format!(
        "expected {} or {last}, got {s:?}",
        others.join(", ")
    ))
}

/// Runs the gateway until Ctrl-C or SIGTERM (or checks a configuration file and exits).
pub async fn run(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    if let Some(path) = &args.check_config {
        return check_config(&args, path);
    }
    let file = args.config.as_deref().map(load_config).transpose()?;
    let settings = args.settings(file.as_ref());
    let upstream = settings
        .upstream
        .clone()
        .context("no upstream: give --upstream URL or upstream = \"URL\" in --config")?;
    // Everything that can be checked before the store is open is, so a bad flag or file
    // stops the start at once.
    let given = match (&args.secret, &args.secret_file) {
        (Some(secret), _) => Some(secret.clone().into_bytes()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).with_context(|| {
                format!(
                    "--secret-file {}: give a file that holds the secret (say 32 random bytes \
                     in hex), or leave --secret-file out to keep the secret in the store",
                    path.display()
                )
            })?;
            Some(text.trim().as_bytes().to_vec())
        }
        (None, None) => None,
    };
    if let Some(bytes) = &given {
        let flag = if args.secret.is_some() {
            "--secret"
        } else {
            "--secret-file"
        };
        Secret::new(bytes.clone()).context(flag)?;
    }
    let start = Start {
        upstream,
        upstream_tls: args.upstream_tls.load()?,
        tls: args.tls.load()?,
        given,
        settings,
        args,
    };

    let listener = TcpListener::bind(start.settings.listen)
        .await
        .with_context(|| format!("cannot listen on {}", start.settings.listen))?;
    let admin = match start.args.admin_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr}"))?,
        ),
        None => None,
    };
    println!(
        "idem proxy: listening on {}://{} -> {} (store {})",
        if start.tls.is_some() { "https" } else { "http" },
        listener.local_addr()?,
        start.upstream,
        redact(&start.settings.store)
    );
    let store = start.settings.store.clone();
    match store_url(&start.args, &store)? {
        StoreUrl::Sqlite(url) => {
            let store = SqliteStore::connect(&url)
                .await
                .with_context(|| format!("cannot open the store {url}"))?;
            run_on(listener, admin, store, start).await
        }
        StoreUrl::Postgres(url) => {
            let mut store = PgStore::connect(&url)
                .await
                .with_context(|| format!("cannot open the store {}", redact(&url)))?;
            if let Some(direct) = &start.args.notify_database_url {
                store = store.with_notify_url(direct).with_context(|| {
                    format!("cannot use the notify database URL {}", redact(direct))
                })?;
            }
            run_on(listener, admin, store, start).await
        }
        StoreUrl::Redis(url) => {
            let store = RedisStore::connect(&url, start.args.redis_prefix.clone())
                .await
                .with_context(|| format!("cannot open the store {}", redact(&url)))?
                .wait_for_replicas(
                    start.args.redis_wait_replicas,
                    Duration::from_millis(start.args.redis_wait_timeout_ms),
                );
            run_on(listener, admin, store, start).await
        }
    }
}

/// What the gateway is made of once the flags and the file are read, all but the store.
struct Start {
    args: ProxyArgs,
    settings: Settings,
    upstream: Uri,
    upstream_tls: ClientTls,
    tls: Option<ServerTls>,
    /// The secret given by --secret or --secret-file (checked); `None`: the store's.
    given: Option<Vec<u8>>,
}

impl Start {
    /// The secret the gateway runs with: the one given, or the one every proxy on `store`
    /// shares (made now if this is the first).
    async fn secret<St: SharedSecret>(&mut self, store: &St) -> anyhow::Result<Secret> {
        if let Some(given) = self.given.take() {
            // Advice only: a proxy with its own secret needs nothing from the store to start.
            let differs = Secret::differs_from_store(store, &given)
                .await
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %idem_core::ErrorChain(&e), "cannot compare the given secret with the store's");
                    false
                });
            if differs {
                tracing::warn!(
                    "the store holds a shared secret other than the one given: proxies on this \
                     store started without --secret use the store's, so they derive other \
                     scopes than this one (a retry that crosses from one to the other runs \
                     again). Give them all the same secret, or none"
                );
            }
            return Ok(Secret::new(given)?);
        }
        let legacy = PathBuf::from(LEGACY_SECRET_FILE);
        let (secret, origin) = Secret::shared(store, &legacy).await?;
        // The id (an HMAC under the secret, which gives nothing of it away) is the same in
        // every proxy with the same secret: one line per proxy shows that they agree.
        let id = secret.id();
        match origin {
            SecretOrigin::Created => tracing::info!(
                secret_id = %id,
                "made the scope secret and stored it, for every proxy on this store"
            ),
            SecretOrigin::File(path) => tracing::warn!(
                secret_id = %id,
                "moved the secret of {} into the store, so the keys stored under it keep their \
                 scopes and every proxy on this store shares it; from now on the store's copy \
                 is the one that counts, and the file may be deleted",
                path.display()
            ),
            SecretOrigin::StoreOverFile(path) => tracing::warn!(
                secret_id = %id,
                "{} holds another secret than the store, where another proxy put its own: \
                 using the store's, which every proxy on this store shares. Keys first sent \
                 through this proxy under the file's secret are not found again (a retry of \
                 one is sent upstream again, with the same key) until their retention ends. \
                 Delete the file to silence this",
                path.display()
            ),
            _ => tracing::info!(secret_id = %id, "read the scope secret from the store"),
        }
        Ok(secret)
    }

    /// The gateway's configuration, with `secret`.
    fn config(&self, secret: Secret) -> anyhow::Result<GatewayConfig> {
        let args = &self.args;
        let mut config = GatewayConfig::new(self.upstream.clone(), secret)?;
        config.credential = self.settings.credential.clone();
        config.set_default_rules(&self.settings.defaults);
        config.routes = self.settings.routes.clone();
        config.require_auth = args.require_auth;
        config.forwarding = args.forward_key;
        config.on_5xx = args.on_5xx;
        config.on_timeout = args.on_timeout;
        config.upstream_timeout = Duration::from_secs(args.upstream_timeout_secs);
        config.clock = Arc::new(idem_core::SystemClock);
        config.upstream_tls = self.upstream_tls.clone();
        config.tls = self.tls.clone();
        Ok(config)
    }
}

/// The store `--store` names, refusing the Redis-only flags for any other store.
fn store_url(args: &ProxyArgs, store: &str) -> anyhow::Result<StoreUrl> {
    let url = StoreUrl::parse(store)?;
    if args.notify_database_url.is_some() && !matches!(url, StoreUrl::Postgres(_)) {
        anyhow::bail!(
            "--notify-database-url applies to a PostgreSQL store, and the store is {}",
            redact(store)
        );
    }
    if args.redis_wait_replicas > 0 && !matches!(url, StoreUrl::Redis(_)) {
        anyhow::bail!(
            "--redis-wait-replicas applies to a Redis store, and the store is {}",
            redact(store)
        );
    }
    Ok(url)
}

async fn run_on<St: OutcomeChannel + SharedSecret + AdminStore>(
    listener: TcpListener,
    admin: Option<TcpListener>,
    store: St,
    mut start: Start,
) -> anyhow::Result<ExitCode> {
    let secret = start.secret(&store).await?;
    let mut config = start.config(secret)?;
    // Only a proxy with a route that waits listens (a connection held for good) and
    // publishes.
    let waits = |in_flight: InFlight| matches!(in_flight, InFlight::Wait(_));
    if waits(config.in_flight) || config.routes.iter().any(|r| waits(r.rules.in_flight)) {
        config.outcome_signal = idem_gateway::outcome_signal(&store)
            .await
            .context("cannot listen for outcome wake-ups")?;
    }
    let mut admin_routes = admin_router(store.clone());
    if let Some(token) = start.args.admin_token.clone() {
        admin_routes = admin_routes.merge(crate::admin::api::router(
            store.clone(),
            token,
            config.clock.clone(),
        ));
    }
    let head_timeout = config.head_timeout;
    let tls = config.tls.clone();
    // The sweeper, from the start rather than the first request as the gateway's routes
    // would (Redis also expires completed records itself).
    let sweeper = idem_tower::spawn_sweeper(
        store.clone(),
        config.clock.clone(),
        idem_tower::DEFAULT_SWEEP_EVERY,
    );
    config.sweep_every = None;
    let gateway = idem_gateway::router(store, config);
    let app = match admin {
        Some(admin) => {
            tokio::spawn(async move { axum::serve(admin, admin_routes).await });
            gateway
        }
        // Routes win over the gateway's fallback, so these two paths are the proxy's own.
        None => admin_routes.merge(gateway),
    };
    let app = crate::telemetry::with_server_spans(app);
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
                    match store.get(&probe, idem_core::Clock::now(&idem_core::SystemClock)).await {
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
