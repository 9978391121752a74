//! The workload groups: each starts what it compares (servers, databases, peers), names its
//! variants, and says which pairs of variants make a row of the report.
//!
//! Variants of one group share one set-up and are alternated round by round, so that a change
//! in the machine's load hits all of them alike.

use std::any::Any;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use idem_core::{Clock, SystemClock};
use serde::Serialize;
use sqlx::Connection as _;

use crate::cpu::Component;
use crate::load::{HttpTarget, Keys};
use crate::peers;
use crate::pgbench::{self, Pgbench, Script};
use crate::servers::{self, PAYMENT, Server, StoreUrl, TOKEN};
use crate::{Runtimes, Settings};

/// A group of workloads sharing one set-up; `--only` selects groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Group {
    /// `idem serve` on SQLite against the bare handler, and its replays.
    ServeSqlite,
    /// `idem serve` on PostgreSQL against the bare handler and pgbench, and its replays.
    ServePostgres,
    /// `idem proxy` on SQLite against the upstream alone.
    GatewaySqlite,
    /// `idem proxy` on PostgreSQL against the upstream alone.
    GatewayPostgres,
    /// `idem proxy` on Redis against the upstream alone and against idempotent-proxy-server.
    GatewayRedis,
    /// idem's layer on Redis in axum against express-idempotency on Redis in Express.
    PeerLayer,
    /// The core's micro-benchmarks.
    Micro,
    /// Peak RSS of `idem serve` with 256 open connections under load.
    Memory,
}

impl Group {
    /// Every group, in the order the full command runs them.
    pub const ALL: [Group; 8] = [
        Group::Micro,
        Group::ServeSqlite,
        Group::ServePostgres,
        Group::GatewaySqlite,
        Group::GatewayPostgres,
        Group::GatewayRedis,
        Group::PeerLayer,
        Group::Memory,
    ];

    /// The name `--only` takes.
    pub fn name(self) -> &'static str {
        match self {
            Group::ServeSqlite => "serve-sqlite",
            Group::ServePostgres => "serve-postgres",
            Group::GatewaySqlite => "gateway-sqlite",
            Group::GatewayPostgres => "gateway-postgres",
            Group::GatewayRedis => "gateway-redis",
            Group::PeerLayer => "peer-layer",
            Group::Micro => "micro",
            Group::Memory => "memory",
        }
    }

    /// The group's variants, by id, and the rows they make.
    pub(crate) fn plan(self) -> (Vec<&'static str>, Vec<Comparison>) {
        let at_least = |ratio| {
            Some(Target {
                ratio,
                ahead: false,
            })
        };
        let ahead = Some(Target {
            ratio: 1.0,
            ahead: true,
        });
        match self {
            Group::ServeSqlite => (
                vec!["bare", "bare-grouped", "idem", "replay"],
                vec![
                    Comparison::new(
                        "layer-sqlite",
                        "layer cost, SQLite",
                        "bare",
                        "idem",
                        at_least(0.8),
                    ),
                    Comparison::new(
                        "layer-sqlite-grouped",
                        "layer cost, SQLite, same writer",
                        "bare-grouped",
                        "idem",
                        None,
                    ),
                    Comparison::new(
                        "replays-sqlite",
                        "replays, SQLite",
                        "idem",
                        "replay",
                        at_least(3.0),
                    ),
                ],
            ),
            Group::ServePostgres => (
                vec![
                    "bare",
                    "idem",
                    "replay",
                    "pgbench",
                    "pgbench-idem",
                    "claim-first",
                    "claim-first-replay",
                ],
                vec![
                    Comparison::new(
                        "layer-postgres",
                        "layer cost, PostgreSQL",
                        "bare",
                        "idem",
                        None,
                    ),
                    Comparison::new(
                        "floor-pgbench",
                        "floor: pgbench, same transaction",
                        "pgbench",
                        "idem",
                        at_least(0.8),
                    ),
                    Comparison::new(
                        "floor-statements",
                        "pgbench sending idem's statements",
                        "pgbench-idem",
                        "idem",
                        None,
                    ),
                    Comparison::new(
                        "replays-postgres",
                        "replays, PostgreSQL",
                        "idem",
                        "replay",
                        at_least(3.0),
                    ),
                    Comparison::new(
                        "floor-claim-first",
                        "floor, without the replay read",
                        "pgbench",
                        "claim-first",
                        None,
                    ),
                    Comparison::new(
                        "replays-claim-first",
                        "replays, without the replay read",
                        "claim-first",
                        "claim-first-replay",
                        None,
                    ),
                ],
            ),
            Group::GatewaySqlite => (
                vec!["upstream", "proxy"],
                vec![Comparison::new(
                    "gateway-sqlite",
                    "gateway, SQLite",
                    "upstream",
                    "proxy",
                    at_least(0.8),
                )],
            ),
            Group::GatewayPostgres => (
                vec!["upstream", "proxy"],
                vec![Comparison::new(
                    "gateway-postgres",
                    "gateway, PostgreSQL",
                    "upstream",
                    "proxy",
                    at_least(0.8),
                )],
            ),
            Group::GatewayRedis => (
                vec![
                    "upstream",
                    "plain",
                    "proxy",
                    "peer",
                    "upstream-slow",
                    "proxy-slow",
                ],
                vec![
                    Comparison::new(
                        "gateway-redis",
                        "gateway, Redis",
                        "upstream",
                        "proxy",
                        at_least(0.8),
                    ),
                    Comparison::new(
                        "gateway-redis-slow",
                        "gateway, Redis, 5 ms upstream",
                        "upstream-slow",
                        "proxy-slow",
                        None,
                    ),
                    Comparison::new(
                        "proxy-floor",
                        "any proxy: no idempotency",
                        "upstream",
                        "plain",
                        None,
                    ),
                    Comparison::new("peer-proxy", "peer proxy, Redis", "peer", "proxy", ahead),
                ],
            ),
            Group::PeerLayer => (
                vec!["peer", "idem"],
                vec![Comparison::new(
                    "peer-layer",
                    "peer layer, Redis",
                    "peer",
                    "idem",
                    ahead,
                )],
            ),
            Group::Micro | Group::Memory => (vec![], vec![]),
        }
    }

    /// Starts the group's servers and returns its variants; a variant that cannot run says
    /// why instead.
    pub(crate) async fn setup(self, env: &Env) -> anyhow::Result<Prepared> {
        match self {
            Group::ServeSqlite => serve_sqlite(env).await,
            Group::ServePostgres => serve_postgres(env).await,
            Group::GatewaySqlite => {
                let dir = tempfile::tempdir()?;
                let url = sqlite_url(&dir.path().join("gateway.db"));
                let (mut prepared, _) = gateway(env, StoreUrl::Sqlite(url), "SQLite").await?;
                prepared.teardown.keep(dir);
                Ok(prepared)
            }
            Group::GatewayPostgres => {
                postgres_up().await?;
                let db = idem_store::testing::PgTestDatabase::create().await;
                let (mut prepared, _) =
                    gateway(env, StoreUrl::Postgres(db.url().to_owned()), "PostgreSQL").await?;
                prepared.teardown.keep(db);
                Ok(prepared)
            }
            Group::GatewayRedis => gateway_redis(env).await,
            Group::PeerLayer => peer_layer(env).await,
            Group::Micro | Group::Memory => Ok(Prepared::default()),
        }
    }
}

/// A row's goal for the ratio B/A.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Target {
    /// The ratio to reach.
    pub ratio: f64,
    /// `true`: B must be ahead (ratio above); `false`: at least the ratio.
    pub ahead: bool,
}

impl Target {
    /// Whether `ratio` meets the target.
    pub fn met(&self, ratio: f64) -> bool {
        if self.ahead {
            ratio > self.ratio
        } else {
            ratio >= self.ratio
        }
    }

    /// `≥ 0.8×` or `> 1×`.
    pub fn describe(&self) -> String {
        format!("{} {}×", if self.ahead { ">" } else { "≥" }, self.ratio)
    }
}

/// A row of the report: B measured against A.
#[derive(Debug, Clone)]
pub(crate) struct Comparison {
    pub(crate) id: &'static str,
    pub(crate) title: &'static str,
    pub(crate) a: &'static str,
    pub(crate) b: &'static str,
    pub(crate) target: Option<Target>,
}

impl Comparison {
    fn new(
        id: &'static str,
        title: &'static str,
        a: &'static str,
        b: &'static str,
        target: Option<Target>,
    ) -> Self {
        Self {
            id,
            title,
            a,
            b,
            target,
        }
    }
}

/// How a variant is loaded.
#[derive(Debug, Clone)]
pub(crate) enum Driver {
    /// The harness's HTTP client.
    Http(Arc<HttpTarget>),
    /// pgbench.
    Pgbench(Pgbench),
}

/// One thing measured.
#[derive(Debug, Clone)]
pub(crate) struct Variant {
    /// Its id within the group.
    pub(crate) id: &'static str,
    /// What it is, for the table.
    pub(crate) label: String,
    /// How it is loaded.
    pub(crate) driver: Driver,
    /// Child processes whose CPU counts, and as what.
    pub(crate) children: Vec<(u32, Component)>,
}

impl Variant {
    fn http(id: &'static str, label: impl Into<String>, target: HttpTarget) -> Self {
        Self {
            id,
            label: label.into(),
            driver: Driver::Http(Arc::new(target)),
            children: Vec::new(),
        }
    }
}

/// What the runner needs from the outside: settings, runtimes, names.
#[derive(Debug)]
pub(crate) struct Env {
    pub(crate) settings: Settings,
    pub(crate) runtimes: Runtimes,
    /// Unique per invocation; in every key, Redis prefix and database row the run makes.
    pub(crate) tag: String,
    /// Reports what a set-up is doing (installs take minutes).
    pub(crate) progress: indicatif::ProgressBar,
}

/// Everything a group started, stopped when the group is done.
#[derive(Default)]
pub(crate) struct Teardown {
    servers: Vec<Server>,
    peers: Vec<peers::Peer>,
    keep: Vec<Box<dyn Any + Send>>,
    redis_cleanup: Option<(String, String)>,
}

impl std::fmt::Debug for Teardown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Teardown")
            .field("servers", &self.servers)
            .field("peers", &self.peers)
            .finish_non_exhaustive()
    }
}

impl Teardown {
    /// Keeps `value` (a temporary folder, a throwaway database) alive until the group ends.
    fn keep(&mut self, value: impl Any + Send) {
        self.keep.push(Box::new(value));
    }

    /// Stops servers and peers, deletes the run's Redis keys, then drops databases and
    /// folders.
    pub(crate) async fn run(mut self) {
        for server in self.servers.drain(..) {
            server.stop().await;
        }
        for mut peer in self.peers.drain(..) {
            let _ = peer.child.kill().await;
        }
        if let Some((url, pattern)) = self.redis_cleanup.take()
            && let Err(e) = delete_redis_keys(&url, &pattern).await
        {
            eprintln!("idem-bench: could not delete the Redis keys {pattern}: {e:#}");
        }
        // Dropping a PgTestDatabase blocks while it drops the database; off the runtime.
        let keep = std::mem::take(&mut self.keep);
        let _ = tokio::task::spawn_blocking(move || drop(keep)).await;
    }
}

/// A group, started.
#[derive(Debug, Default)]
pub(crate) struct Prepared {
    /// Each variant, or why it cannot run.
    pub(crate) variants: Vec<(&'static str, Result<Variant, String>)>,
    /// What to stop afterwards.
    pub(crate) teardown: Teardown,
}

/// How many keys a replay workload cycles through.
const REPLAY_KEYS: usize = 2000;

fn sqlite_url(path: &std::path::Path) -> String {
    format!("sqlite://{}", path.display())
}

fn bearer() -> String {
    format!("Bearer {TOKEN}")
}

/// A replay workload on `idem serve`: the keys are used once first, then cycled through.
async fn replay_variant(
    env: &Env,
    fresh: &HttpTarget,
    id: &'static str,
    label: &str,
) -> anyhow::Result<Variant> {
    let keys: Vec<String> = (0..REPLAY_KEYS)
        .map(|i| format!("{}-{id}-{i}", env.tag))
        .collect();
    let target = fresh.clone();
    let concurrency = env.settings.concurrency;
    let primed = keys.clone();
    env.runtimes
        .load
        .spawn(async move { crate::load::prime(&target, &primed, concurrency).await })
        .await??;
    let mut target = fresh.clone();
    target.keys = Keys::Cycle(Arc::new(keys));
    target.expect_replayed = true;
    Ok(Variant::http(id, label, target))
}

async fn serve_sqlite(env: &Env) -> anyhow::Result<Prepared> {
    let dir = tempfile::tempdir()?;
    let url = sqlite_url(&dir.path().join("serve.db"));
    let mut prepared = Prepared::default();
    prepared.teardown.keep(dir);
    // idem serve first: it creates the payments table the bare handler writes to.
    let idem = servers::idem_serve(&env.runtimes.subject, &url, true).await?;
    let bare = servers::bare_payments(&env.runtimes.subject, &url).await?;
    let fresh = HttpTarget::post(&idem.url("/payments"), Some(&bearer()), PAYMENT);
    let bare_target = HttpTarget::post(&bare.url("/payments"), Some(&bearer()), PAYMENT);
    let grouped_target = HttpTarget::post(&bare.url("/grouped/payments"), Some(&bearer()), PAYMENT);
    let replay = replay_variant(env, &fresh, "replay", "idem serve, replays").await;
    prepared.variants = vec![
        (
            "bare",
            Ok(Variant::http(
                "bare",
                "bare handler, same INSERT",
                bare_target,
            )),
        ),
        (
            "bare-grouped",
            Ok(Variant::http(
                "bare-grouped",
                "bare handler, group commit",
                grouped_target,
            )),
        ),
        ("idem", Ok(Variant::http("idem", "idem serve", fresh))),
        ("replay", replay.map_err(|e| format!("{e:#}"))),
    ];
    prepared.teardown.servers.extend([idem, bare]);
    Ok(prepared)
}

/// Checks that the PostgreSQL server the throwaway databases live on answers.
async fn postgres_up() -> anyhow::Result<()> {
    let url = idem_store::testing::admin_url();
    let connect = sqlx::PgConnection::connect(&url);
    let conn = tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .map_err(|_| anyhow::anyhow!("PostgreSQL did not answer within 5 s"))?
        .with_context(|| {
            format!(
                "PostgreSQL is not reachable at {} (set IDEM_TEST_PG_URL)",
                redact(&url)
            )
        })?;
    conn.close().await?;
    Ok(())
}

/// A URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

async fn serve_postgres(env: &Env) -> anyhow::Result<Prepared> {
    postgres_up().await?;
    let db = idem_store::testing::PgTestDatabase::create().await;
    let url = db.url().to_owned();
    let dir = tempfile::tempdir()?;
    let mut prepared = Prepared::default();
    let idem = servers::idem_serve(&env.runtimes.subject, &url, true).await?;
    let claim_first = servers::idem_serve(&env.runtimes.subject, &url, false).await?;
    let bare = servers::bare_payments(&env.runtimes.subject, &url).await?;
    let fresh = HttpTarget::post(&idem.url("/payments"), Some(&bearer()), PAYMENT);
    let fresh_claim_first =
        HttpTarget::post(&claim_first.url("/payments"), Some(&bearer()), PAYMENT);
    let bare_target = HttpTarget::post(&bare.url("/payments"), Some(&bearer()), PAYMENT);
    let replay = replay_variant(env, &fresh, "replay", "idem serve, replays").await;
    let replay_claim_first = replay_variant(
        env,
        &fresh_claim_first,
        "claim-first-replay",
        "idem serve --no-replay-read, replays",
    )
    .await;
    let available = pgbench::available().await;
    let pgbench = |id, label: &str, script| match &available {
        Ok(_) => Pgbench::new(&url, dir.path(), script, SystemClock.now().0)
            .map(|p| Variant {
                id,
                label: label.into(),
                driver: Driver::Pgbench(p),
                children: Vec::new(),
            })
            .map_err(|e| format!("{e:#}")),
        Err(why) => Err(why.clone()),
    };
    let floor = pgbench("pgbench", "pgbench, same transaction", Script::Transaction);
    let statements = pgbench(
        "pgbench-idem",
        "pgbench, idem's 6 statements",
        Script::IdemStatements,
    );
    prepared.variants = vec![
        (
            "bare",
            Ok(Variant::http(
                "bare",
                "bare handler, same INSERT",
                bare_target,
            )),
        ),
        ("idem", Ok(Variant::http("idem", "idem serve", fresh))),
        ("replay", replay.map_err(|e| format!("{e:#}"))),
        ("pgbench", floor),
        ("pgbench-idem", statements),
        (
            "claim-first",
            Ok(Variant::http(
                "claim-first",
                "idem serve --no-replay-read",
                fresh_claim_first,
            )),
        ),
        (
            "claim-first-replay",
            replay_claim_first.map_err(|e| format!("{e:#}")),
        ),
    ];
    prepared.teardown.servers.extend([idem, claim_first, bare]);
    // Servers stop before the database is dropped.
    prepared.teardown.keep(dir);
    prepared.teardown.keep(db);
    Ok(prepared)
}

/// The upstream alone and `idem proxy` on `store` in front of it; also returns the
/// upstream's payments URL.
async fn gateway(
    env: &Env,
    store: StoreUrl,
    store_name: &str,
) -> anyhow::Result<(Prepared, String)> {
    let upstream = servers::upstream(&env.runtimes.upstream).await?;
    let proxy = servers::gateway(&env.runtimes.subject, store, &upstream.url("")).await?;
    let mut prepared = Prepared {
        variants: vec![
            (
                "upstream",
                Ok(Variant::http(
                    "upstream",
                    "upstream alone",
                    HttpTarget::post(&upstream.url("/payments"), Some(&bearer()), PAYMENT),
                )),
            ),
            (
                "proxy",
                Ok(Variant::http(
                    "proxy",
                    format!("idem proxy, {store_name}"),
                    HttpTarget::post(&proxy.url("/payments"), Some(&bearer()), PAYMENT),
                )),
            ),
        ],
        teardown: Teardown::default(),
    };
    let upstream_url = upstream.url("/payments");
    prepared.teardown.servers.extend([upstream, proxy]);
    Ok((prepared, upstream_url))
}

/// Checks that Redis answers a PING.
async fn redis_up(url: &str) -> anyhow::Result<()> {
    let client = redis::Client::open(url)?;
    let ping = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    tokio::time::timeout(Duration::from_secs(5), ping)
        .await
        .map_err(|_| anyhow::anyhow!("Redis did not answer within 5 s"))?
        .with_context(|| format!("Redis is not reachable at {url}"))?;
    Ok(())
}

/// Deletes the keys matching `pattern` (SCAN, then UNLINK in batches).
async fn delete_redis_keys(url: &str, pattern: &str) -> anyhow::Result<()> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<i64>(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// The peers' scratch folder.
fn peers_dir(env: &Env) -> PathBuf {
    env.settings
        .peers_dir
        .clone()
        .unwrap_or_else(peers::default_dir)
}

async fn gateway_redis(env: &Env) -> anyhow::Result<Prepared> {
    let url = env.settings.redis_url.clone();
    redis_up(&url).await?;
    let prefix = format!("idem-bench:{}", env.tag);
    let (mut prepared, upstream) =
        gateway(env, StoreUrl::Redis(url.clone(), prefix), "Redis").await?;
    prepared.teardown.redis_cleanup = Some((url.clone(), format!("*{}*", env.tag)));
    // The same pair in front of an upstream that takes its time, as real APIs do.
    let slow = |id, label: &str, of: &str| {
        let url = format!("{}slow/payments", of.trim_end_matches("payments"));
        (
            id,
            Ok(Variant::http(
                id,
                format!("{label}, {} ms", servers::SLOW_UPSTREAM.as_millis()),
                HttpTarget::post(&url, Some(&bearer()), PAYMENT),
            )),
        )
    };
    let proxy_url = match prepared.variants.iter().find(|(id, _)| *id == "proxy") {
        Some((
            _,
            Ok(Variant {
                driver: Driver::Http(target),
                ..
            }),
        )) => target.uri.to_string(),
        _ => anyhow::bail!("gateway() makes an HTTP proxy variant"),
    };
    prepared.variants.extend([
        slow("upstream-slow", "upstream alone", &upstream),
        slow("proxy-slow", "idem proxy, Redis", &proxy_url),
    ]);
    let base = upstream.trim_end_matches("payments").to_owned();
    let plain = servers::plain_proxy(&env.runtimes.subject, &base).await?;
    prepared.variants.push((
        "plain",
        Ok(Variant::http(
            "plain",
            "plain reverse proxy (hyper)",
            HttpTarget::post(&plain.url("/payments"), Some(&bearer()), PAYMENT),
        )),
    ));
    prepared.teardown.servers.push(plain);
    let peer = if env.settings.no_peers {
        Err("--no-peers".to_owned())
    } else {
        let work = tempfile::tempdir()?;
        env.progress
            .set_message("installing idempotent-proxy-server (cached after the first run)");
        let started = async {
            let binary = peers::install_proxy_peer(&peers_dir(env)).await?;
            peers::start_proxy_peer(&binary, work.path(), &upstream, &url).await
        }
        .await;
        prepared.teardown.keep(work);
        match started {
            Ok(peer) => {
                let variant = Variant {
                    id: "peer",
                    label: "idempotent-proxy-server, Redis".into(),
                    driver: Driver::Http(Arc::new(HttpTarget::post(
                        &peer.url,
                        Some(&bearer()),
                        PAYMENT,
                    ))),
                    children: vec![(peer.pid, Component::Subject)],
                };
                prepared.teardown.peers.push(peer);
                Ok(variant)
            }
            Err(e) => Err(format!("{e:#}")),
        }
    };
    prepared.variants.push(("peer", peer));
    Ok(prepared)
}

async fn peer_layer(env: &Env) -> anyhow::Result<Prepared> {
    let url = env.settings.redis_url.clone();
    redis_up(&url).await?;
    let mut prepared = Prepared::default();
    prepared.teardown.redis_cleanup = Some((url.clone(), format!("*{}*", env.tag)));
    let idem = servers::layer_on_redis(
        &env.runtimes.subject,
        &url,
        &format!("idem-bench:{}:layer", env.tag),
    )
    .await?;
    let idem_variant = Variant::http(
        "idem",
        "axum + idem layer, Redis",
        HttpTarget::post(&idem.url("/payments"), Some(&bearer()), PAYMENT),
    );
    prepared.teardown.servers.push(idem);
    let peer = if env.settings.no_peers {
        Err("--no-peers".to_owned())
    } else {
        env.progress
            .set_message("installing express-idempotency (cached after the first run)");
        let started = async {
            let npm_dir = peers::install_express_peer(&peers_dir(env)).await?;
            peers::start_express_peer(&npm_dir, &url).await
        }
        .await;
        match started {
            Ok(peer) => {
                let variant = Variant {
                    id: "peer",
                    label: "Express + express-idempotency, Redis".into(),
                    driver: Driver::Http(Arc::new(HttpTarget::post(
                        &peer.url,
                        Some(&bearer()),
                        PAYMENT,
                    ))),
                    children: vec![(peer.pid, Component::Subject)],
                };
                prepared.teardown.peers.push(peer);
                Ok(variant)
            }
            Err(e) => Err(format!("{e:#}")),
        }
    };
    prepared.variants = vec![("peer", peer), ("idem", Ok(idem_variant))];
    Ok(prepared)
}
