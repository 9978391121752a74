//! The servers the harness starts in-process, each on the runtime it is given: `idem serve`,
//! the bare payments handler it is compared with, `idem proxy`, the fast upstream, and an axum
//! app with idem's layer on Redis.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_core::{AccountId, Clock, SystemClock};
use idem_gateway::{GatewayConfig, Secret};
use idem_store::{PgStore, RedisStore, SqliteStore, Store, TokioPgStore};
use idem_tower::IdempotencyLayer;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::load::HttpTarget;

/// The sandbox token `idem serve` registers by default, and the bare handler too.
pub(crate) const TOKEN: &str = "sk_test_alice";
/// The account [`TOKEN`] authenticates.
pub(crate) const ACCOUNT: &str = "acct_alice";
/// Every workload's request body.
pub(crate) const PAYMENT: &str = r#"{"amount": 49900, "currency": "INR"}"#;

/// Every workload's request: a fresh-key [`PAYMENT`] POSTed to `url` with [`TOKEN`].
pub(crate) fn payment_post(url: &str) -> HttpTarget {
    HttpTarget::post(url, Some(&format!("Bearer {TOKEN}")), PAYMENT)
}

/// A server running on one of the harness's runtimes.
#[derive(Debug)]
pub(crate) struct Server {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Server {
    /// `http://ADDR{path}`.
    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Waits until `path` answers; if the server stopped instead, returns why.
    pub(crate) async fn wait_until_up(&mut self, path: &str) -> anyhow::Result<()> {
        let up = crate::load::wait_until_up(&self.url(path), Duration::from_secs(60)).await;
        if up.is_err() && self.task.is_finished() {
            return match (&mut self.task).await {
                Ok(Err(e)) => Err(e),
                Ok(Ok(())) => Err(anyhow::anyhow!("the server stopped at once")),
                Err(e) => Err(anyhow::Error::new(e).context("the server panicked")),
            };
        }
        up
    }

    /// Stops the server: a graceful shutdown, cut short after a few seconds.
    pub(crate) async fn stop(mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if tokio::time::timeout(Duration::from_secs(5), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

type Shutdown = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Binds 127.0.0.1:0 on `runtime`, runs `serve(listener, shutdown)` there, and waits until
/// `health` answers. Binding happens on the runtime itself, so the server's sockets belong to
/// its I/O driver.
async fn start<F, Fut>(runtime: &Handle, health: &str, serve: F) -> anyhow::Result<Server>
where
    F: FnOnce(TcpListener, Shutdown) -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let (addr_tx, addr_rx) = oneshot::channel();
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let task = runtime.spawn(async move {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let _ = addr_tx.send(listener.local_addr()?);
        let shutdown: Shutdown = Box::pin(async move {
            let _ = shutdown_rx.await;
        });
        serve(listener, shutdown).await
    });
    let addr = addr_rx.await.context("the server could not bind")?;
    let mut server = Server {
        addr,
        shutdown: Some(shutdown_tx),
        task,
    };
    server.wait_until_up(health).await?;
    Ok(server)
}

/// [`start`]s the axum app `app` makes (on the runtime, once the socket is bound), with a
/// graceful shutdown.
async fn start_app<F, Fut>(runtime: &Handle, health: &str, app: F) -> anyhow::Result<Server>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<Router>> + Send + 'static,
{
    start(runtime, health, |listener, shutdown| async move {
        axum::serve(listener, app().await?)
            .with_graceful_shutdown(shutdown)
            .await?;
        Ok(())
    })
    .await
}

/// `idem serve` on `database`, as `idem serve --database DATABASE --db-pool-size POOL` runs
/// it (the pool size matters on PostgreSQL only).
pub(crate) async fn idem_serve(
    runtime: &Handle,
    database: &str,
    pool: usize,
) -> anyhow::Result<Server> {
    let mut config = idem_cli::serve::ServeConfig::new(database);
    config.db_pool_size = pool;
    idem_serve_with(runtime, config).await
}

/// `idem serve` on `database` reading before each claim (`--replay-read`) or claiming first
/// (`--no-replay-read`), whatever its store's default.
pub(crate) async fn idem_serve_replay_read(
    runtime: &Handle,
    database: &str,
    pool: usize,
    replay_read: bool,
) -> anyhow::Result<Server> {
    let mut config = idem_cli::serve::ServeConfig::new(database);
    config.db_pool_size = pool;
    config.replay_read = Some(replay_read);
    idem_serve_with(runtime, config).await
}

/// `idem serve` with `config`.
pub(crate) async fn idem_serve_with(
    runtime: &Handle,
    config: idem_cli::serve::ServeConfig,
) -> anyhow::Result<Server> {
    start(runtime, "/healthz", move |listener, shutdown| {
        idem_cli::serve::serve(listener, config, shutdown)
    })
    .await
}

/// The bare handler's database: the same stores (so the same connection settings and pool
/// sizes) as `idem serve`, without the layer.
#[derive(Debug, Clone)]
enum BareDb {
    Sqlite(SqliteStore),
    Postgres(TokioPgStore),
}

/// The bare handler's state.
#[derive(Debug, Clone)]
struct Bare {
    db: BareDb,
}

/// A payment as `idem serve` shows it.
#[derive(Debug, Serialize)]
struct Payment {
    id: String,
    amount: i64,
    currency: String,
    status: &'static str,
    created_at: i64,
}

/// `POST /payments` without the layer, on `database`, which `idem serve` has migrated: the
/// same authentication, validation and business INSERT in a transaction of its own, as
/// `idem serve` does for a keyless request, on the same client and a pool of `pool`
/// connections on PostgreSQL.
pub(crate) async fn bare_payments(
    runtime: &Handle,
    database: &str,
    pool: usize,
) -> anyhow::Result<Server> {
    let database = database.to_owned();
    start_app(runtime, "/payments", move || async move {
        let db = if database.starts_with("sqlite:") {
            BareDb::Sqlite(SqliteStore::connect(&database).await?)
        } else {
            BareDb::Postgres(TokioPgStore::connect(&database).await?.with_pool_size(pool))
        };
        let tokens = Arc::new(HashMap::from([(TOKEN.to_owned(), AccountId::new(ACCOUNT))]));
        Ok(Router::new()
            .route(
                "/payments",
                post(bare_create::<false>).get(|| async { "ok" }),
            )
            .route("/grouped/payments", post(bare_create::<true>))
            .layer(axum::middleware::from_fn_with_state(tokens, authenticate))
            .with_state(Bare { db }))
    })
    .await
}

/// Bearer-token authentication as `idem serve` does it, in a middleware as there: the
/// account goes into the request's extensions; a missing or unknown token gets `401`.
async fn authenticate(
    State(tokens): State<Arc<HashMap<String, AccountId>>>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(account) = bearer_account(request.headers(), &tokens) else {
        return StatusCode::UNAUTHORIZED.into_response();
    };
    request.extensions_mut().insert(account.clone());
    next.run(request).await
}

/// The account whose token `headers` carry as `Authorization: Bearer TOKEN`.
fn bearer_account<'t>(
    headers: &HeaderMap,
    tokens: &'t HashMap<String, AccountId>,
) -> Option<&'t AccountId> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    tokens.get(value.strip_prefix("Bearer ")?.trim())
}

/// Validates the body as `idem serve` does: a positive integer amount, three capital letters.
fn parse_payment(body: &[u8]) -> Option<(i64, String)> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let amount = value.get("amount")?.as_i64().filter(|a| *a > 0)?;
    let currency = value
        .get("currency")?
        .as_str()
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()))?;
    Some((amount, currency.to_owned()))
}

// The business INSERTs of idem serve's backends, as they are sent for a keyless request.
const SQLITE_INSERT: &str = "INSERT INTO payments
        (id, account_id, idem_key, amount, currency, status, reference, created_at)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)";
const PG_INSERT: &str = "INSERT INTO payments
        (id, account_id, idem_key, amount, currency, status, reference, created_at)
    VALUES ($1, $2, $3, $4, $5, $6, $7,
            to_timestamp($8 / 1000) + ($8 % 1000) * interval '1 millisecond')";

/// The bare handler: validates the payment and INSERTs it in a transaction of its own. With
/// `GROUPED` it writes through idem's SQLite group committer ([`SqliteStore::begin`]), as idem
/// serve's own writes do: what the layer costs on the same writer.
async fn bare_create<const GROUPED: bool>(
    State(app): State<Bare>,
    Extension(account): Extension<AccountId>,
    body: Bytes,
) -> Response {
    let Some((amount, currency)) = parse_payment(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let payment = Payment {
        id: format!("pay_{}", uuid::Uuid::now_v7().simple()),
        amount,
        currency,
        status: "succeeded",
        created_at: SystemClock.now().0,
    };
    let inserted = match &app.db {
        BareDb::Sqlite(store) if GROUPED => {
            insert_sqlite_grouped(store, account.as_str(), &payment).await
        }
        BareDb::Sqlite(store) => insert_sqlite(store, account.as_str(), &payment)
            .await
            .map_err(Into::into),
        BareDb::Postgres(_) if GROUPED => {
            return (StatusCode::NOT_FOUND, "group commit is SQLite's").into_response();
        }
        BareDb::Postgres(store) => insert_pg(store, account.as_str(), &payment).await,
    };
    match inserted {
        Ok(()) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/payments/{}", payment.id))],
            axum::Json(payment),
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn insert_sqlite(
    store: &SqliteStore,
    account: &str,
    payment: &Payment,
) -> Result<(), sqlx::Error> {
    // The writer, as idem serve's own transactions take it: SQLite has one writer.
    let mut tx = store.writer().begin_with("BEGIN IMMEDIATE").await?;
    payment_insert(SQLITE_INSERT, account, payment)
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// The same INSERT in a turn of idem's SQLite group committer.
async fn insert_sqlite_grouped(
    store: &SqliteStore,
    account: &str,
    payment: &Payment,
) -> Result<(), idem_store::Error> {
    let mut tx = store.begin().await?;
    payment_insert(SQLITE_INSERT, account, payment)
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

async fn insert_pg(
    store: &TokioPgStore,
    account: &str,
    payment: &Payment,
) -> Result<(), idem_store::Error> {
    use tokio_postgres::types::{ToSql, Type};
    let tx = store.begin().await?;
    let insert = tx
        .prepare_typed_cached(
            PG_INSERT,
            &[
                Type::TEXT,
                Type::TEXT,
                Type::TEXT,
                Type::INT8,
                Type::TEXT,
                Type::TEXT,
                Type::TEXT,
                Type::INT8,
            ],
        )
        .await?;
    let (key, reference) = (None::<&str>, None::<&str>);
    let params: [&(dyn ToSql + Sync); 8] = [
        &payment.id,
        &account,
        &key,
        &payment.amount,
        &payment.currency,
        &payment.status,
        &reference,
        &payment.created_at,
    ];
    tx.execute(&insert, &params).await?;
    tx.commit().await
}

/// `insert` (either backend's INSERT) bound to `payment`'s values in the order of its
/// columns, with no idempotency key and no reference, as for a keyless request.
fn payment_insert<'a, DB>(
    insert: &'static str,
    account: &'a str,
    payment: &'a Payment,
) -> sqlx::query::Query<'static, DB, DB::Arguments>
where
    DB: sqlx::Database,
    &'a str: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    Option<&'a str>: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
{
    sqlx::query(insert)
        .bind(payment.id.as_str())
        .bind(account)
        .bind(None::<&str>)
        .bind(payment.amount)
        .bind(payment.currency.as_str())
        .bind(payment.status)
        .bind(None::<&str>)
        .bind(payment.created_at)
}

/// A counter for ids, shared by the trivial handlers.
#[derive(Debug, Clone, Default)]
struct Counter(Arc<AtomicU64>);

/// The trivial in-memory handler behind the proxies and the layer comparison: reads the JSON
/// body, takes the next id, answers `201` with the payment.
async fn trivial_create(State(counter): State<Counter>, body: Bytes) -> Response {
    let Some((amount, currency)) = parse_payment(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let n = counter.0.fetch_add(1, Ordering::Relaxed) + 1;
    let id = format!("pay_{n}");
    let location =
        HeaderValue::from_str(&format!("/payments/{id}")).expect("an id is a valid header value");
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        axum::Json(Payment {
            id,
            amount,
            currency,
            status: "succeeded",
            created_at: 0,
        }),
    )
        .into_response()
}

/// The fast upstream the proxies stand in front of: [`trivial_create`] at `/payments`.
pub(crate) async fn upstream(runtime: &Handle) -> anyhow::Result<Server> {
    start_app(runtime, "/payments", || async {
        Ok(Router::new()
            .route("/payments", post(trivial_create).get(|| async { "ok" }))
            .route("/slow/payments", post(slow_create))
            .with_state(Counter::default()))
    })
    .await
}

/// How long the slow upstream's payments take: an API that waits on its database or a
/// payment processor, without using this machine's CPU meanwhile.
pub(crate) const SLOW_UPSTREAM: std::time::Duration = std::time::Duration::from_millis(5);

/// [`trivial_create`] after [`SLOW_UPSTREAM`].
async fn slow_create(state: State<Counter>, body: Bytes) -> Response {
    tokio::time::sleep(SLOW_UPSTREAM).await;
    trivial_create(state, body).await
}

/// A plain reverse proxy in front of `upstream` (a base URL), with the same HTTP client and
/// server as `idem proxy` and nothing else: what any proxy costs on this machine.
pub(crate) async fn plain_proxy(runtime: &Handle, upstream: &str) -> anyhow::Result<Server> {
    let upstream: http::Uri = upstream.parse()?;
    start_app(runtime, "/payments", move || async move {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client: Client<HttpConnector, axum::body::Body> =
            Client::builder(TokioExecutor::new()).build(connector);
        let forward = move |request: Request| {
            let (client, upstream) = (client.clone(), upstream.clone());
            async move {
                let (mut parts, body) = request.into_parts();
                let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                parts.uri = format!("{upstream}{}", path.trim_start_matches('/'))
                    .parse()
                    .expect("a valid upstream URL");
                parts.headers.remove(header::HOST);
                match client.request(Request::from_parts(parts, body)).await {
                    Ok(response) => response.map(axum::body::Body::new),
                    Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
                }
            }
        };
        Ok(Router::new().fallback(forward))
    })
    .await
}

/// Which store a gateway or layer keeps its records in.
#[derive(Debug, Clone)]
pub(crate) enum StoreUrl {
    /// `sqlite://PATH`.
    Sqlite(String),
    /// `postgres://…`.
    Postgres(String),
    /// A Redis URL and the key prefix.
    Redis(String, String),
}

/// `idem proxy` in front of `upstream`, as `idem proxy --store STORE` runs it.
pub(crate) async fn gateway(
    runtime: &Handle,
    store: StoreUrl,
    upstream: &str,
) -> anyhow::Result<Server> {
    let config = GatewayConfig::new(
        upstream.parse()?,
        Secret::new(*b"idem-bench-secret-of-32-bytes...")?,
    )?;
    start(
        runtime,
        idem_gateway::POLICY_PATH,
        move |listener, shutdown| async move {
            use idem_gateway::serve;
            match store {
                StoreUrl::Sqlite(url) => {
                    serve(
                        listener,
                        SqliteStore::connect(&url).await?,
                        config,
                        shutdown,
                    )
                    .await?
                }
                StoreUrl::Postgres(url) => {
                    serve(listener, PgStore::connect(&url).await?, config, shutdown).await?
                }
                StoreUrl::Redis(url, prefix) => {
                    let store = RedisStore::connect(&url, prefix).await?;
                    serve(listener, store, config, shutdown).await?
                }
            }
            Ok(())
        },
    )
    .await
}

/// An axum app with idem's layer (lease mode: Redis has no transactions to share) on Redis
/// around [`trivial_create`].
pub(crate) async fn layer_on_redis(
    runtime: &Handle,
    url: &str,
    prefix: &str,
) -> anyhow::Result<Server> {
    let (url, prefix) = (url.to_owned(), prefix.to_owned());
    start_app(runtime, "/healthz", move || async move {
        Ok(layered(RedisStore::connect(&url, prefix).await?))
    })
    .await
}

fn layered<St: Store>(store: St) -> Router {
    Router::new()
        .route("/payments", post(trivial_create))
        // The load is one caller, as for the peers it is compared with.
        .layer(IdempotencyLayer::leased(store).with_account(|_| Ok(AccountId::new("acct_bench"))))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .with_state(Counter::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payments_are_validated_as_idem_serve_does() {
        assert_eq!(
            parse_payment(PAYMENT.as_bytes()),
            Some((49900, "INR".into()))
        );
        assert_eq!(
            parse_payment(br#"{"amount": 1.0, "currency": "INR"}"#),
            None
        );
        assert_eq!(parse_payment(br#"{"amount": 5, "currency": "inr"}"#), None);
    }
}
