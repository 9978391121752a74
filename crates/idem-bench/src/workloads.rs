//! The workload groups: each starts what it compares (servers, databases, peers), names its
//! variants, and says which pairs of variants make a row of the report.
//!
//! Variants of one group share one set-up and are alternated round by round, so that a change
//! in the machine's load hits all of them alike.

use std::fmt::Debug;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
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
use crate::relay::{DbUrl, Relay, RelayCounts};
use crate::servers::{self, Server, StoreUrl, payment_post};
use crate::{Runtimes, Settings};

pub mod growth;
mod scale;

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
    /// Instructions per request through `idem proxy` on Redis and a plain proxy, under
    /// callgrind (needs valgrind).
    Instructions,
    /// Peak RSS of `idem serve` with 256 open connections under load.
    Memory,
    /// 1, 2 and 4 `idem serve` instances on one PostgreSQL database.
    ScalePostgres,
    /// The gateway on one Redis against a Redis Cluster of three primaries.
    ScaleRedis,
    /// Opt-in (about 5 minutes at full size, mostly filling the table): `idem serve` on
    /// PostgreSQL with 10 million live records, and sweeping 1 million expired ones, against
    /// an empty key table (`--growth-records`).
    GrowthPostgres,
    /// Opt-in (about 2 minutes at full size): `idem serve` on SQLite with 1 million live
    /// records, and sweeping 1 million expired ones, against an empty key table.
    GrowthSqlite,
}

impl Group {
    /// Every group, in the order the full command runs them (the opt-in ones only with
    /// `--only`).
    pub const ALL: [Group; 13] = [
        Group::Micro,
        Group::Instructions,
        Group::ServeSqlite,
        Group::ServePostgres,
        Group::GatewaySqlite,
        Group::GatewayPostgres,
        Group::GatewayRedis,
        Group::PeerLayer,
        Group::ScalePostgres,
        Group::ScaleRedis,
        Group::GrowthPostgres,
        Group::GrowthSqlite,
        Group::Memory,
    ];

    /// Whether the group runs only when `--only` names it (it takes minutes to set up).
    pub fn opt_in(self) -> bool {
        matches!(self, Group::GrowthPostgres | Group::GrowthSqlite)
    }

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
            Group::Instructions => "instructions",
            Group::Memory => "memory",
            Group::ScalePostgres => "scale-postgres",
            Group::ScaleRedis => "scale-redis",
            Group::GrowthPostgres => "growth-postgres",
            Group::GrowthSqlite => "growth-sqlite",
        }
    }

    /// The rows the group makes, each comparing two of its variants.
    pub(crate) fn comparisons(self) -> &'static [Comparison] {
        match self {
            Group::ServeSqlite => SERVE_SQLITE,
            Group::ServePostgres => SERVE_POSTGRES,
            Group::GatewaySqlite => GATEWAY_SQLITE,
            Group::GatewayPostgres => GATEWAY_POSTGRES,
            Group::GatewayRedis => GATEWAY_REDIS,
            Group::PeerLayer => PEER_LAYER,
            Group::ScalePostgres => scale::SCALE_POSTGRES,
            Group::ScaleRedis => scale::SCALE_REDIS,
            Group::GrowthPostgres => growth::GROWTH_POSTGRES,
            Group::GrowthSqlite => growth::GROWTH_SQLITE,
            Group::Micro | Group::Instructions | Group::Memory => &[],
        }
    }

    /// The database latencies the group runs at: each of `--db-latency-ms` for the groups
    /// whose servers talk to PostgreSQL or Redis through the relay, else only 0 (directly).
    pub(crate) fn db_latencies_ms(self, settings: &Settings) -> &[f64] {
        match self {
            Group::ServePostgres | Group::GatewayRedis => &settings.db_latencies_ms,
            _ => &[0.0],
        }
    }

    /// How many variants the group runs: those its rows compare.
    pub(crate) fn variant_count(self) -> usize {
        let mut ids: Vec<&str> = self.comparisons().iter().flat_map(|c| [c.a, c.b]).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }

    /// Starts the group's servers (their database `db_latency_ms` away, for the groups that
    /// take a latency) and returns its variants; a variant that cannot run says why instead.
    pub(crate) async fn setup(self, env: &Env, db_latency_ms: f64) -> anyhow::Result<Prepared> {
        match self {
            Group::ServeSqlite => serve_sqlite(env).await,
            Group::ServePostgres => serve_postgres(env, db_latency_ms).await,
            Group::GatewaySqlite => {
                let dir = tempfile::tempdir()?;
                let url = sqlite_url(&dir.path().join("gateway.db"));
                let mut prepared = gateway(env, StoreUrl::Sqlite(url), "SQLite")
                    .await?
                    .prepared;
                prepared.teardown.keep(dir);
                Ok(prepared)
            }
            Group::GatewayPostgres => {
                postgres_up().await?;
                let db = idem_testkit::postgres::PgTestDatabase::create().await;
                let store = StoreUrl::Postgres(db.url().to_owned());
                let mut prepared = gateway(env, store, "PostgreSQL").await?.prepared;
                prepared.teardown.keep(db);
                Ok(prepared)
            }
            Group::GatewayRedis => gateway_redis(env, db_latency_ms).await,
            Group::PeerLayer => peer_layer(env).await,
            Group::ScalePostgres => scale::scale_postgres(env).await,
            Group::ScaleRedis => scale::scale_redis(env).await,
            Group::GrowthPostgres => growth::growth_postgres(env).await,
            Group::GrowthSqlite => growth::growth_sqlite(env).await,
            Group::Micro | Group::Instructions | Group::Memory => Ok(Prepared::default()),
        }
    }
}

/// A row's goal for the ratio B/A (and, for some, for the latency B adds).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Target {
    /// The ratio to reach.
    pub ratio: f64,
    /// `true`: B must be ahead (ratio above); `false`: at least the ratio.
    pub ahead: bool,
    /// The target holds with the database at least this far away (ms each way); closer, the
    /// row is measured without one.
    pub from_db_latency_ms: f64,
    /// At most this many ms added to A's p50, if the target bounds it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_added_p50_ms: Option<f64>,
}

impl Target {
    /// Whether `ratio` and `added_p50_ms` meet the target.
    pub fn met(&self, ratio: f64, added_p50_ms: Option<f64>) -> bool {
        let ratio_met = if self.ahead {
            ratio > self.ratio
        } else {
            ratio >= self.ratio
        };
        let latency_met = match (self.max_added_p50_ms, added_p50_ms) {
            (Some(max), Some(added)) => added <= max,
            (Some(_), None) => false,
            (None, _) => true,
        };
        ratio_met && latency_met
    }

    /// How far `ratio` is from the target's ratio, as a fraction of it: `0.1` is 10% past
    /// it, `-0.29` is 29% short.
    pub fn distance(&self, ratio: f64) -> f64 {
        ratio / self.ratio - 1.0
    }

    /// `≥ 0.8×`, `> 1×` or `≥ 0.92×, ≤ +0.7 ms p50`.
    pub fn describe(&self) -> String {
        let ratio = format!("{} {}×", if self.ahead { ">" } else { "≥" }, self.ratio);
        match self.max_added_p50_ms {
            Some(max) => format!("{ratio}, ≤ +{max} ms p50"),
            None => ratio,
        }
    }

    /// The target, whether it is met, and how far from it `ratio` and `added_p50_ms` are:
    /// `≥ 0.85× MISSED -29%`, `≥ 0.92×, ≤ +0.7 ms p50 met +1%, -0.12 ms`.
    pub fn verdict(&self, ratio: f64, added_p50_ms: Option<f64>) -> String {
        let met = if self.met(ratio, added_p50_ms) {
            "met"
        } else {
            "MISSED"
        };
        let mut out = format!(
            "{} {met} {:+.0}%",
            self.describe(),
            self.distance(ratio) * 100.0
        );
        if let (Some(max), Some(added)) = (self.max_added_p50_ms, added_p50_ms) {
            out.push_str(&format!(", {:+.2} ms", added - max));
        }
        out
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
    const fn new(
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

    /// The row's target with the database `db_latency_ms` away, if it has one there.
    pub(crate) fn target_at(&self, db_latency_ms: f64) -> Option<Target> {
        self.target
            .filter(|target| db_latency_ms >= target.from_db_latency_ms)
    }
}

/// B must reach `ratio` times A's throughput.
const fn at_least(ratio: f64) -> Option<Target> {
    at_least_from(ratio, 0.0)
}

/// B must reach `ratio` times A's throughput with the database `ms` or more away.
const fn at_least_from(ratio: f64, ms: f64) -> Option<Target> {
    Some(Target {
        ratio,
        ahead: false,
        from_db_latency_ms: ms,
        max_added_p50_ms: None,
    })
}

/// B must reach `ratio` times A's throughput and add at most `ms` to its p50.
const fn at_least_adding(ratio: f64, ms: f64) -> Option<Target> {
    Some(Target {
        ratio,
        ahead: false,
        from_db_latency_ms: 0.0,
        max_added_p50_ms: Some(ms),
    })
}

/// B must beat A.
const AHEAD: Option<Target> = Some(Target {
    ratio: 1.0,
    ahead: true,
    from_db_latency_ms: 0.0,
    max_added_p50_ms: None,
});

// Each group's rows: id, title, A, B (the ids of the variants its set-up makes), and the goal
// for B/A if the issue set one.
const SERVE_SQLITE: &[Comparison] = &[
    Comparison::new(
        "layer-sqlite",
        "layer cost, SQLite",
        "bare",
        "idem",
        at_least(1.5),
    ),
    Comparison::new(
        "layer-sqlite-grouped",
        "layer cost, SQLite, same writer",
        "bare-grouped",
        "idem",
        at_least(0.85),
    ),
    Comparison::new(
        "replays-sqlite",
        "replays, SQLite",
        "idem",
        "replay",
        at_least(3.0),
    ),
    Comparison::new(
        "layer-sqlite-claim-first",
        "same writer, claiming first",
        "bare-grouped",
        "claim-first",
        None,
    ),
    Comparison::new(
        "replays-sqlite-claim-first",
        "replays, SQLite, claiming first",
        "claim-first",
        "claim-first-replay",
        None,
    ),
];

const SERVE_POSTGRES: &[Comparison] = &[
    Comparison::new(
        "layer-postgres",
        "layer cost, PostgreSQL",
        "bare",
        "idem",
        at_least(0.65),
    ),
    Comparison::new(
        "floor-pgbench",
        "floor: pgbench, same transaction",
        "pgbench",
        "idem",
        at_least(0.8),
    ),
    // The target for a database 1 ms away: pgbench sending the same statements
    // through the same relay, on as many connections as idem serve's pool.
    Comparison::new(
        "floor-statements",
        "pgbench sending idem's statements",
        "pgbench-idem",
        "idem",
        at_least_from(0.9, 1.0),
    ),
    Comparison::new(
        "replays-postgres",
        "replays, PostgreSQL",
        "idem",
        "replay",
        at_least(3.0),
    ),
    Comparison::new(
        "floor-read-first",
        "floor, reading before the claim",
        "pgbench",
        "read-first",
        None,
    ),
    Comparison::new(
        "replays-read-first",
        "replays, reading before the claim",
        "read-first",
        "read-first-replay",
        None,
    ),
];

const GATEWAY_SQLITE: &[Comparison] = &[Comparison::new(
    "gateway-sqlite",
    "gateway, SQLite",
    "upstream",
    "proxy",
    at_least(0.8),
)];

const GATEWAY_POSTGRES: &[Comparison] = &[Comparison::new(
    "gateway-postgres",
    "gateway, PostgreSQL",
    "upstream",
    "proxy",
    at_least(0.8),
)];

const GATEWAY_REDIS: &[Comparison] = &[
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
        at_least_adding(0.92, 0.7),
    ),
    Comparison::new(
        "proxy-floor",
        "any proxy: no idempotency",
        "upstream",
        "plain",
        None,
    ),
    Comparison::new(
        "proxy-floor-slow",
        "any proxy, 5 ms upstream",
        "upstream-slow",
        "plain-slow",
        None,
    ),
    // What idempotency adds to a proxy: the same HTTP client and server, same upstream.
    Comparison::new(
        "gateway-vs-plain",
        "gateway vs a plain proxy, Redis",
        "plain",
        "proxy",
        at_least(0.6),
    ),
    Comparison::new(
        "peer-proxy",
        "peer proxy, Redis",
        "peer",
        "proxy",
        at_least(2.0),
    ),
];

const PEER_LAYER: &[Comparison] = &[Comparison::new(
    "peer-layer",
    "peer layer, Redis",
    "peer",
    "idem",
    AHEAD,
)];

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
    /// The latency relay's counts, when the variant's database is behind one.
    pub(crate) relay: Option<Arc<RelayCounts>>,
    /// What to do before each of its runs, outside the measured window.
    pub(crate) before_run: Option<BeforeRun>,
}

/// The future a [`BeforeRun`] returns.
pub(crate) type BeforeRunFuture = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// Something a variant does before each of its runs (growth-*: expire the next slice of
/// records for the sweeper).
#[derive(Clone)]
pub(crate) struct BeforeRun(pub(crate) Arc<dyn Fn() -> BeforeRunFuture + Send + Sync>);

impl Debug for BeforeRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BeforeRun")
    }
}

impl Variant {
    fn http(id: &'static str, label: impl Into<String>, target: HttpTarget) -> Self {
        Self {
            id,
            label: label.into(),
            driver: Driver::Http(Arc::new(target)),
            children: Vec::new(),
            relay: None,
            before_run: None,
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
#[derive(Debug, Default)]
pub(crate) struct Teardown {
    servers: Vec<Server>,
    peers: Vec<peers::Peer>,
    keep: Vec<Box<dyn Debug + Send>>,
    redis_cleanup: Option<(String, String)>,
}

impl Teardown {
    /// Keeps `value` (a temporary folder, a throwaway database) alive until the group ends.
    fn keep(&mut self, value: impl Debug + Send + 'static) {
        self.keep.push(Box::new(value));
    }

    /// Deletes the run's keys from the Redis server at `env`'s URL when the group ends.
    fn clean_up_redis(&mut self, env: &Env) {
        self.redis_cleanup = Some((env.settings.redis_url.clone(), format!("*{}*", env.tag)));
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
    pub(crate) variants: Vec<Entry>,
    /// What to stop afterwards.
    pub(crate) teardown: Teardown,
    /// The key tables the set-up filled, and their sizes (growth-*).
    pub(crate) key_tables: Vec<growth::KeyTable>,
}

impl Prepared {
    /// Gives every variant `relay`'s counts (only one variant is loaded at a time, so what
    /// the relay counts over a variant's window is that variant's) and keeps the relay until
    /// the group ends.
    fn behind(&mut self, relay: Option<Relay>) {
        let Some(relay) = relay else { return };
        for (_, variant) in &mut self.variants {
            if let Ok(variant) = variant {
                variant.relay = Some(relay.counts());
            }
        }
        self.teardown.keep(relay);
    }
}

/// `url` as the group's servers use it: the database itself at 0 ms, else a latency relay in
/// front of it, started on the relay's runtime, and the URL pointed at the relay.
async fn db_route(
    env: &Env,
    url: &str,
    latency_ms: f64,
) -> anyhow::Result<(String, Option<Relay>)> {
    if latency_ms == 0.0 {
        return Ok((url.to_owned(), None));
    }
    let parsed = DbUrl::parse(url)?;
    let server = tokio::net::lookup_host(parsed.server())
        .await?
        .next()
        .with_context(|| format!("{} does not resolve", parsed.server()))?;
    let delay = Duration::from_secs_f64(latency_ms / 1000.0);
    let relay = Relay::start(&env.runtimes.relay, server, delay).await?;
    Ok((parsed.through(relay.addr()), Some(relay)))
}

/// How many keys a replay workload cycles through.
const REPLAY_KEYS: usize = 2000;

/// A variant as a group's set-up made it: its id, and the variant or why it cannot run.
pub(crate) type Entry = (&'static str, Result<Variant, String>);

/// An HTTP variant that is ready to run.
fn ready(id: &'static str, label: impl Into<String>, target: HttpTarget) -> Entry {
    (id, Ok(Variant::http(id, label, target)))
}

/// A variant that may not have started, with the cause's chain as the reason.
fn entry(id: &'static str, variant: anyhow::Result<Variant>) -> Entry {
    (id, variant.map_err(|e| format!("{e:#}")))
}

/// The SQLite database file at `path`, as `idem serve --database` takes it.
pub(crate) fn sqlite_url(path: &Path) -> String {
    format!("sqlite://{}", path.display())
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

/// The layer's baseline: the bare handler, the same INSERT without idempotency.
fn bare_variant(bare: &Server) -> Entry {
    let target = payment_post(&bare.url("/payments"));
    ready("bare", "bare handler, same INSERT", target)
}

async fn serve_sqlite(env: &Env) -> anyhow::Result<Prepared> {
    let dir = tempfile::tempdir()?;
    let url = sqlite_url(&dir.path().join("serve.db"));
    let mut prepared = Prepared::default();
    prepared.teardown.keep(dir);
    // idem serve first: it creates the payments table the bare handler writes to.
    // (The pool size is PostgreSQL's.)
    let pool = idem_store::DEFAULT_POOL_SIZE;
    let idem = servers::idem_serve(&env.runtimes.subject, &url, pool).await?;
    let bare = servers::bare_payments(&env.runtimes.subject, &url, pool).await?;
    let fresh = payment_post(&idem.url("/payments"));
    let replay = replay_variant(env, &fresh, "replay", "idem serve, replays").await;
    // Claiming first: no read on a reader before each claim, every replay a turn at the writer.
    let claim_first =
        servers::idem_serve_replay_read(&env.runtimes.subject, &url, pool, false).await?;
    let claim_first_fresh = payment_post(&claim_first.url("/payments"));
    let claim_first_replay = replay_variant(
        env,
        &claim_first_fresh,
        "claim-first-replay",
        "idem serve --no-replay-read, replays",
    )
    .await;
    prepared.variants = vec![
        bare_variant(&bare),
        ready(
            "bare-grouped",
            "bare handler, group commit",
            payment_post(&bare.url("/grouped/payments")),
        ),
        ready("idem", "idem serve", fresh),
        entry("replay", replay),
        ready(
            "claim-first",
            "idem serve --no-replay-read",
            claim_first_fresh,
        ),
        entry("claim-first-replay", claim_first_replay),
    ];
    prepared.teardown.servers.extend([idem, bare, claim_first]);
    Ok(prepared)
}

/// Waits up to 5 s for `answer`, the first thing asked of `service`.
async fn within_5s<T>(service: &str, answer: impl Future<Output = T>) -> anyhow::Result<T> {
    tokio::time::timeout(Duration::from_secs(5), answer)
        .await
        .map_err(|_| anyhow::anyhow!("{service} did not answer within 5 s"))
}

/// The connections each `idem serve` and the bare handler get: one per concurrent request, as
/// pgbench has one per client (the floor on equal terms, also with the database a round trip
/// away, where a request holds its connection for its round trips), unless the server's
/// `max_connections` cannot hold `pools` pools and pgbench's clients, with 20 to spare for the
/// servers' other connections (sweepers, wake-ups) and everyone else's.
async fn pg_pool_size(concurrency: usize, pools: usize) -> anyhow::Result<usize> {
    let url = idem_testkit::postgres::admin_url();
    let mut conn = within_5s("PostgreSQL", sqlx::PgConnection::connect(&url)).await??;
    let max: String = sqlx::query_scalar("SHOW max_connections")
        .fetch_one(&mut conn)
        .await?;
    conn.close().await?;
    let max: usize = max.parse().context("max_connections is a number")?;
    let room = max.saturating_sub(concurrency + 20) / pools;
    anyhow::ensure!(
        room >= 2,
        "PostgreSQL's max_connections ({max}) leaves no room for {pools} pools beside pgbench's {concurrency} clients"
    );
    Ok(room.min(concurrency))
}

/// Checks that the PostgreSQL server the throwaway databases live on answers.
async fn postgres_up() -> anyhow::Result<()> {
    let url = idem_testkit::postgres::admin_url();
    let conn = within_5s("PostgreSQL", sqlx::PgConnection::connect(&url))
        .await?
        .with_context(|| {
            format!(
                "PostgreSQL is not reachable at {} (set IDEM_TEST_PG_URL)",
                idem_cli::store_url::redact(&url)
            )
        })?;
    conn.close().await?;
    Ok(())
}

async fn serve_postgres(env: &Env, db_latency_ms: f64) -> anyhow::Result<Prepared> {
    postgres_up().await?;
    let db = idem_testkit::postgres::PgTestDatabase::create().await;
    let (url, relay) = db_route(env, db.url(), db_latency_ms).await?;
    let dir = tempfile::tempdir()?;
    let mut prepared = Prepared::default();
    // Reading before the claim is a trade of CPU between first requests and replays, measured
    // with the database at hand; a round trip away its cost is plain (one more).
    let read_first = db_latency_ms == 0.0;
    let pool = pg_pool_size(env.settings.concurrency, if read_first { 3 } else { 2 }).await?;
    let idem = servers::idem_serve(&env.runtimes.subject, &url, pool).await?;
    let bare = servers::bare_payments(&env.runtimes.subject, &url, pool).await?;
    let fresh = payment_post(&idem.url("/payments"));
    let replay = replay_variant(env, &fresh, "replay", "idem serve, replays").await;
    let available = pgbench::available().await;
    let pgbench = |id, label: &str, script| match &available {
        Ok(_) => entry(
            id,
            Pgbench::new(&url, dir.path(), script, SystemClock.now().0).map(|p| Variant {
                // idem's own statements on as many connections as idem serve has: the same
                // database work on equal terms, also where the round trips bound it.
                driver: Driver::Pgbench(match script {
                    Script::IdemStatements => p.with_clients(pool),
                    Script::Transaction => p,
                }),
                id,
                label: label.into(),
                children: Vec::new(),
                relay: None,
                before_run: None,
            }),
        ),
        Err(why) => (id, Err(why.clone())),
    };
    prepared.variants = vec![
        bare_variant(&bare),
        ready("idem", format!("idem serve, pool of {pool}"), fresh),
        entry("replay", replay),
        pgbench("pgbench", "pgbench, same transaction", Script::Transaction),
        pgbench(
            "pgbench-idem",
            &format!("pgbench, idem's statements, pipelined, {pool} clients"),
            Script::IdemStatements,
        ),
    ];
    prepared.teardown.servers.extend([idem, bare]);
    if read_first {
        let server =
            servers::idem_serve_replay_read(&env.runtimes.subject, &url, pool, true).await?;
        let fresh = payment_post(&server.url("/payments"));
        let replay = replay_variant(
            env,
            &fresh,
            "read-first-replay",
            "idem serve --replay-read, replays",
        )
        .await;
        prepared.variants.extend([
            ready(
                "read-first",
                format!("idem serve --replay-read, pool of {pool}"),
                fresh,
            ),
            entry("read-first-replay", replay),
        ]);
        prepared.teardown.servers.push(server);
    } else {
        let why = "measured with the database at hand (--db-latency-ms 0) only".to_owned();
        prepared.variants.extend([
            ("read-first", Err(why.clone())),
            ("read-first-replay", Err(why)),
        ]);
    }
    // Servers stop before the relay and the database are dropped.
    prepared.behind(relay);
    prepared.teardown.keep(dir);
    prepared.teardown.keep(db);
    Ok(prepared)
}

/// What [`gateway`] started, and where each side takes payments.
struct Gateway {
    prepared: Prepared,
    upstream: String,
    proxy: String,
}

/// The upstream alone and `idem proxy` on `store` in front of it.
async fn gateway(env: &Env, store: StoreUrl, store_name: &str) -> anyhow::Result<Gateway> {
    let upstream = servers::upstream(&env.runtimes.upstream).await?;
    let proxy = servers::gateway(&env.runtimes.subject, store, &upstream.url("")).await?;
    let (upstream_url, proxy_url) = (upstream.url("/payments"), proxy.url("/payments"));
    let mut prepared = Prepared {
        variants: vec![
            ready("upstream", "upstream alone", payment_post(&upstream_url)),
            ready(
                "proxy",
                format!("idem proxy, {store_name}"),
                payment_post(&proxy_url),
            ),
        ],
        teardown: Teardown::default(),
        key_tables: Vec::new(),
    };
    prepared.teardown.servers.extend([upstream, proxy]);
    Ok(Gateway {
        prepared,
        upstream: upstream_url,
        proxy: proxy_url,
    })
}

/// Checks that Redis answers a PING.
async fn redis_up(url: &str) -> anyhow::Result<()> {
    let client = redis::Client::open(url)?;
    let ping = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut conn).await
    };
    within_5s("Redis", ping)
        .await?
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

/// A peer idem is compared with, on the Redis server of the settings.
#[derive(Debug, Clone, Copy)]
enum PeerApp<'a> {
    /// `idempotent-proxy-server` in front of `upstream`, a payments URL.
    Proxy { upstream: &'a str },
    /// Express with `express-idempotency`.
    Express,
}

impl PeerApp<'_> {
    /// Installs the peer under `dir` unless it is there already, and starts it.
    async fn start(self, dir: &Path, redis_url: &str) -> anyhow::Result<peers::Peer> {
        match self {
            PeerApp::Proxy { upstream } => {
                let binary = peers::install_proxy_peer(dir).await?;
                peers::start_proxy_peer(&binary, upstream, redis_url).await
            }
            PeerApp::Express => {
                let npm_dir = peers::install_express_peer(dir).await?;
                peers::start_express_peer(&npm_dir, redis_url).await
            }
        }
    }
}

/// The peer variant on the Redis server at `redis_url`, unless `--no-peers`: installs `peer`
/// (cached after the first run) and starts it; its process is stopped with the group.
async fn peer_variant(
    env: &Env,
    teardown: &mut Teardown,
    peer: PeerApp<'_>,
    redis_url: &str,
) -> Entry {
    if env.settings.no_peers {
        return ("peer", Err("--no-peers".to_owned()));
    }
    let (package, label) = match peer {
        PeerApp::Proxy { .. } => (peers::PROXY_CRATE, "idempotent-proxy-server, Redis"),
        PeerApp::Express => (
            "express-idempotency",
            "Express + express-idempotency, Redis",
        ),
    };
    env.progress
        .set_message(format!("installing {package} (cached after the first run)"));
    let peer = match peer.start(&peers_dir(env), redis_url).await {
        Ok(peer) => peer,
        Err(e) => return ("peer", Err(format!("{e:#}"))),
    };
    let mut variant = Variant::http("peer", label, payment_post(&peer.url));
    variant.children = vec![(peer.pid, Component::Subject)];
    teardown.peers.push(peer);
    ("peer", Ok(variant))
}

async fn gateway_redis(env: &Env, db_latency_ms: f64) -> anyhow::Result<Prepared> {
    redis_up(&env.settings.redis_url).await?;
    let (url, relay) = db_route(env, &env.settings.redis_url, db_latency_ms).await?;
    let prefix = format!("idem-bench:{}", env.tag);
    let Gateway {
        mut prepared,
        upstream,
        proxy,
    } = gateway(env, StoreUrl::Redis(url.clone(), prefix), "Redis").await?;
    prepared.teardown.clean_up_redis(env);
    // The same pair in front of an upstream that takes its time, as real APIs do.
    let slow = |id, label: &str, of: &str| {
        let url = format!("{}slow/payments", of.trim_end_matches("payments"));
        let label = format!("{label}, {} ms", servers::SLOW_UPSTREAM.as_millis());
        ready(id, label, payment_post(&url))
    };
    prepared.variants.extend([
        slow("upstream-slow", "upstream alone", &upstream),
        slow("proxy-slow", "idem proxy, Redis", &proxy),
    ]);
    let base = upstream.trim_end_matches("payments");
    let plain = servers::plain_proxy(&env.runtimes.subject, base).await?;
    prepared.variants.push(ready(
        "plain",
        "plain reverse proxy (hyper)",
        payment_post(&plain.url("/payments")),
    ));
    prepared.variants.push(slow(
        "plain-slow",
        "plain reverse proxy",
        &plain.url("/payments"),
    ));
    prepared.teardown.servers.push(plain);
    let peer = PeerApp::Proxy {
        upstream: &upstream,
    };
    let peer = peer_variant(env, &mut prepared.teardown, peer, &url).await;
    prepared.variants.push(peer);
    prepared.behind(relay);
    Ok(prepared)
}

async fn peer_layer(env: &Env) -> anyhow::Result<Prepared> {
    let url = env.settings.redis_url.clone();
    redis_up(&url).await?;
    let mut prepared = Prepared::default();
    prepared.teardown.clean_up_redis(env);
    let prefix = format!("idem-bench:{}:layer", env.tag);
    let idem = servers::layer_on_redis(&env.runtimes.subject, &url, &prefix).await?;
    let idem_variant = ready(
        "idem",
        "axum + idem layer, Redis",
        payment_post(&idem.url("/payments")),
    );
    prepared.teardown.servers.push(idem);
    let peer = peer_variant(env, &mut prepared.teardown, PeerApp::Express, &url).await;
    prepared.variants = vec![peer, idem_variant];
    Ok(prepared)
}
