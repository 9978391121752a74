//! [`RedisStore`]: records in Redis, for the gateway's lease mode.
//!
//! Every operation is one Lua script, and Redis runs a script as a single atomic step, so the
//! claim is one insert-if-absent however many instances claim at once, and `complete`, `renew`
//! and `release` check the fencing token and the status in the same step as they write.
//!
//! The store's own docs ([`RedisStore`]) say what Redis does not give, how keys are laid out,
//! whose clock judges time, and what bounds its memory.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{
    AccountId, FencingToken, Fingerprint, Record, RecordState, Scope, StoredResponse, Timestamp,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, ErrorKind, Pipeline, RedisError, Script, ServerErrorKind, Value};

use crate::{ClaimOutcome, Error, NewClaim, Result, Store, in_caller_frame, millis};

mod admin;

/// The longest TTL set: Redis rejects expiry times beyond `i64` milliseconds, and a retention
/// this long (or saturated) means "keep".
const MAX_TTL_MS: i64 = 1000 * 365 * 24 * 60 * 60 * 1000;

/// How long one connection attempt may take before the store reports itself unavailable.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a command may wait for its answer. The outcome of a command that times out is
/// unknown (Redis may have run it), which callers treat like a lost connection.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Reconnection attempts after the first, with jittered backoff, before a command fails: a
/// request should get its `503` well within a client's timeout.
const RECONNECT_RETRIES: usize = 2;

// The scripts are Lua files in `redis_store/lua/`, put together at compile time. Every script
// that judges or writes a time begins with `now.lua`, which reads Redis's clock as `now` (Unix
// milliseconds): the one clock of every instance on this store (docs/contract.md §12). Since
// Redis 5 a script's writes are replicated as their effects, so a script may read `TIME`
// before it writes.

// Claims a key if no record holds it, or replaces a record the claim may replace (completed and
// past its retention; or, if allowed, a stale claim of the same request; never an in-progress
// record for its age), the conditions of the SQL stores' claim. Otherwise returns Redis's now
// and the record that holds the key, so the loser needs no second round trip. The new record
// has no TTL while in progress (its outcome is unknown until it is resolved) and waits in the
// index at `+inf` until it completes.
//
// Every `redis.call` costs Redis about a microsecond beyond its command (measured with `INFO
// commandstats`), so a first claim makes only the calls it needs: no DEL of a record that is
// not there, and the index trimmed only when the caller asks (`trim` empty otherwise).
//
// KEYS: record, index. ARGV: request_hash, lease_ms, retention_ms, fencing_token, take_over
// (1/0), trim (the slack in ms, or empty).
const CLAIM: &str = concat!(
    include_str!("redis_store/lua/now.lua"),
    include_str!("redis_store/lua/claim.lua")
);

// The record and Redis's now, for a read whose record's times are moved into the caller's
// frame.
//
// KEYS: record.
const GET: &str = concat!(
    include_str!("redis_store/lua/now.lua"),
    include_str!("redis_store/lua/get.lua")
);

// What a completion writes once its script has found the record in progress, `held` holding
// its `expires_at` and `created_at` as [3] and [4]: the outcome, the record's retention
// (expires_at less created_at, as claimed) counted from now, its index entry at the new expiry
// (sweepable then), and its first TTL, for then plus the slack: `store_outcome.lua`. Shared by
// `COMPLETE` and an operator's `FORCE_COMPLETE`, so that an outcome resolved by hand is kept and
// forgotten exactly as one its claim stored.
//
// ARGV (the first six): response_code, response_headers, response_body, body_omitted (1/0),
// slack_ms, max_ttl_ms.

// Stores the outcome if the claim holding the token still holds the key.
//
// KEYS: record, index. ARGV: those of `store_outcome.lua`, then fencing_token.
const COMPLETE: &str = concat!(
    include_str!("redis_store/lua/now.lua"),
    include_str!("redis_store/lua/complete_check.lua"),
    include_str!("redis_store/lua/store_outcome.lua")
);

// Stores an operator's outcome of a record in progress, whatever claim holds it.
//
// KEYS: record, index. ARGV: those of `store_outcome.lua`.
const FORCE_COMPLETE: &str = concat!(
    include_str!("redis_store/lua/now.lua"),
    include_str!("redis_store/lua/force_complete_check.lua"),
    include_str!("redis_store/lua/store_outcome.lua")
);

// Moves the lease of the claim holding the token to `lease_ms` past now.
//
// KEYS: record. ARGV: fencing_token, lease_ms.
const RENEW: &str = concat!(
    include_str!("redis_store/lua/now.lua"),
    include_str!("redis_store/lua/renew.lua")
);

// Deletes the in-progress record of the claim holding the token.
//
// KEYS: record, index. ARGV: fencing_token.
const RELEASE: &str = include_str!("redis_store/lua/release.lua");

// Deletes a record whatever its state, its index entry and its key's history: `1` if there
// was a record.
//
// KEYS: record, index, events.
const PURGE: &str = include_str!("redis_store/lua/purge.lua");

// Adds an event to a key's history, keeping its latest ones and expiring the list.
//
// KEYS: events. ARGV: the event (JSON), how many to keep, how long to keep the list (ms).
const RECORD_EVENT: &str = include_str!("redis_store/lua/record_event.lua");

// Reads the records among KEYS (entries of one index, so of one slot on a cluster) that a
// listing wants: in the state ARGV[1] names (`in_progress`, `completed`, or empty for either)
// and, when ARGV[2] is not empty, in progress with a lease run out by Redis's now plus ARGV[2]
// (ms: the caller's bound less the caller's now). Returns Redis's now and, for each record
// wanted, its place in KEYS and its fields. A record gone since its entry was read is left out.
const LIST: &str = concat!(
    include_str!("redis_store/lua/now.lua"),
    include_str!("redis_store/lua/list.lua")
);

// Deletes at most `batch` completed records past their retention, found through the index and
// checked against their stored state. One script, so concurrent sweepers take disjoint records
// and each deletion is counted once. An entry whose record Redis has already expired is
// dropped uncounted; one whose record is not sweepable after all (claimed again since) is
// given its true place, `+inf` while in progress, so it cannot stay in front of the range.
//
// KEYS: index. ARGV: batch.
const SWEEP: &str = concat!(
    include_str!("redis_store/lua/now.lua"),
    include_str!("redis_store/lua/sweep.lua")
);

/// Records in Redis, every key under one prefix, for lease mode: on one server (or a primary
/// with replicas) or on a Redis Cluster.
///
/// Cloning is cheap: clones share one multiplexed connection (on a cluster, one per node),
/// which reconnects by itself after the server comes back.
///
/// # What Redis does not give
///
/// - **No atomicity with the upstream's own database.** The key lives in Redis and the business
///   write in another system, so this store serves lease mode only (docs/contract.md §3) and does not
///   implement [`TransactionalStore`](crate::TransactionalStore).
/// - **Durability is the server's configuration.** With `appendonly no` (the default) a restart
///   loses every record written since the last RDB snapshot (all of them if snapshots are off
///   too), and a retried request is then run again. `appendonly yes` with `appendfsync
///   everysec` loses at most about a second; `always` loses nothing, at a cost per write.
/// - **Replication is asynchronous.** A failover can promote a replica that has not seen the
///   latest claims or outcomes, and their keys are then free again. [`wait_for_replicas`]
///   makes every claim, renewal and completion wait until that many replicas have it (`WAIT`)
///   and fail as unavailable when they do not confirm in time, so a record a client was
///   answered from survives the loss of its primary. `WAIT` does not make Redis strongly
///   consistent (a replica that confirmed may still lose the race to be promoted), but on a
///   failover that promotes a confirming replica nothing acknowledged is lost.
/// - **Eviction forgets keys.** Completed records have a TTL, so under `maxmemory` any
///   `volatile-*` or `allkeys-*` policy may evict live records (and `allkeys-*` in-progress ones
///   too). Run with `maxmemory-policy noeviction`: a full server then refuses claims (the layer
///   answers `503`) instead of forgetting them.
///
/// [`wait_for_replicas`]: Self::wait_for_replicas
///
/// # Layout
///
/// All keys of a store begin with its prefix, so several stores (or tests) share one server:
///
/// - `{prefix}:k:{account length}:{account}:{key}`: one hash per record, its fields named like
///   the SQL stores' columns (`request_hash`, `status`, `created_at`, `expires_at`,
///   `lease_until`, `fencing_token`, and once completed `response_code`, `response_headers`,
///   `response_body`, `body_omitted`). Accounts and keys may contain `:`; the account's length
///   in bytes says where it ends, so no two scopes share a key.
/// - `{prefix}:sweep`: a sorted set of record keys, each scored with the time the record
///   becomes sweepable: its `expires_at` once completed, `+inf` while in progress (never, while
///   its outcome is not known). The sweeper takes the lowest scores up to Redis's now, so
///   records in progress never stand in front of those it may delete, and `ZCOUNT
///   {prefix}:sweep +inf +inf` counts the records in progress. Operators' listings
///   ([`AdminStore::list`](crate::AdminStore::list), `idem keys list`) walk it with `ZSCAN`
///   and read every record of the state asked for: an operator's tool, not the request path's.
///
/// - `{prefix}:e:{account length}:{account}:{key}`: a list per key of the operators' and
///   reconcilers' events ([`AdminStore::record_event`](crate::AdminStore::record_event)), JSON
///   each (`at`, `what`, `by`), oldest first, capped to the latest
///   [`EVENTS_KEPT`](crate::EVENTS_KEPT) and expiring
///   [`EVENTS_RETENTION`](crate::EVENTS_RETENTION) after its latest event. Requests never
///   write it.
///
/// On a cluster (`redis+cluster://`) a script may touch keys of one hash slot only, so the
/// records are spread over [`CLUSTER_BUCKETS`](Self::CLUSTER_BUCKETS) buckets, each with an
/// index of its own, and a record's keys carry its bucket as their hash tag:
/// `{prefix}:{bN}:k:…`, `{prefix}:{bN}:sweep` and `{prefix}:{bN}:e:…`. A record's bucket is a
/// hash of its scope, so every instance finds it in the same place; the buckets' slots fall on
/// every primary, and the sweeper goes through every bucket's index, so it covers every
/// primary. A cluster's prefix may not contain `{` or `}`, which would move the hash tag.
///
/// # Time
///
/// Time is Redis's: every script that judges or writes a time reads `TIME` first (on a
/// cluster, the clock of the node that holds the record), so instances whose clocks disagree
/// judge leases and expiry alike (see [One clock](crate#one-clock-the-stores)). A claim is given
/// the caller's lease and retention as durations and applies them to Redis's now; a record
/// handed back comes with Redis's now, and is moved into the caller's frame.
///
/// # Memory
///
/// A completed record gets a TTL when it completes: its retention plus
/// [`TTL_SLACK`](Self::TTL_SLACK), so that the sweeper, which counts what it deletes, normally
/// gets to it first, and Redis's own expiry only collects what nobody sweeps. A record in
/// progress has no TTL: its outcome is unknown until it is completed, released, taken over by a
/// retry of the same request, or deleted by an operator, and a record that vanished would let a
/// fresh claim run the work a second time. So what bounds Redis's memory is the retention
/// window's completed records plus the records whose outcome nobody has learnt: one per call
/// cut short (a crashed instance, an upstream that timed out) that no retry has taken over yet.
/// `ZCOUNT {prefix}:sweep +inf +inf` counts the records in progress.
///
/// The index has no TTL. The sweeper removes the entries it handles, and the first claim of
/// each second (paced by the callers' clock) drops the entries of its index more than the
/// slack past their time by Redis's clock (Redis has expired their records by then), so the
/// index stays bounded where no sweeper runs. An entry whose record Redis expired first is
/// dropped by the sweeper uncounted, so a sweep can report fewer than its batch while more
/// remain; the next run goes on.
///
/// Times and scores are compared as Lua numbers (doubles): exact for times within 2^53 ms
/// (285,000 years) of 1970. Fencing tokens are compared as the decimal strings they were
/// written as, so every `i64` is exact.
#[derive(Debug, Clone)]
pub struct RedisStore {
    // The clients and prefix are the crate's: `notify` subscribes with the clients (one per
    // node given; a cluster's pub/sub reaches every node) and names its channel from the prefix.
    pub(crate) clients: Vec<redis::Client>,
    pub(crate) conn: Connection,
    pub(crate) prefix: String,
    layout: Layout,
    wait: Option<WaitReplicas>,
    // Where the next sweep starts among a cluster's buckets, so that no bucket waits behind
    // the others when there is more to delete than one batch.
    next_bucket: Arc<AtomicUsize>,
    // When (the callers' clock, ms) a claim last trimmed the index: trimming is cheap but not
    // free, and once a second keeps the index as bounded as every claim did.
    last_trim: Arc<AtomicI64>,
}

/// A connection to one server or to a cluster.
#[derive(Clone)]
pub(crate) enum Connection {
    Single(ConnectionManager),
    Cluster(Arc<Cluster>),
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "Connection::Single",
            Self::Cluster(_) => "Connection::Cluster",
        })
    }
}

/// A cluster connection that is built anew from the seed nodes when a command finds a node
/// not answering.
///
/// Why by hand: redis-rs 1.8.1's cluster connection does not always recover by itself from a
/// primary killed outright. In 3 of 5 runs of the kill test without this
/// (crates/idem-store/tests/redis_cluster.rs), it began a refresh of its slot map as the
/// replica took over and never finished it (42 s until the test gave up, no node contacted
/// meanwhile), and every command, on every slot, waited behind it until it timed out. A new
/// connection asks a live seed node for the slot map, so the store recovers without a restart.
pub(crate) struct Cluster {
    client: redis::cluster::ClusterClient,
    current: std::sync::RwLock<ClusterConnection>,
    rebuilding: std::sync::atomic::AtomicBool,
}

/// How long after one rebuild of the cluster connection the next may start.
const REBUILD_PAUSE: Duration = Duration::from_millis(500);

/// How long a rebuild may take (a connection to every seed, the slot map, a connection to every
/// node, each within its own timeout) before it is given up: redis-rs puts no bound on it, and
/// one that hung would keep every later rebuild from starting.
const REBUILD_TIMEOUT: Duration = Duration::from_secs(10);

impl Cluster {
    fn connection(&self) -> ClusterConnection {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Starts building a new connection, unless one is being built already.
    fn rebuild(self: &Arc<Self>) {
        if self.rebuilding.swap(true, Ordering::AcqRel) {
            return;
        }
        let cluster = Arc::clone(self);
        tokio::spawn(async move {
            let fresh =
                tokio::time::timeout(REBUILD_TIMEOUT, cluster.client.get_async_connection()).await;
            match fresh {
                Ok(Ok(fresh)) => {
                    *cluster
                        .current
                        .write()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "cannot reconnect to the Redis Cluster"),
                Err(_) => tracing::warn!(
                    timeout = ?REBUILD_TIMEOUT,
                    "reconnecting to the Redis Cluster timed out"
                ),
            }
            tokio::time::sleep(REBUILD_PAUSE).await;
            cluster.rebuilding.store(false, Ordering::Release);
        });
    }

    /// `answer`, after starting a rebuild when it says a node did not answer.
    fn checked<T>(self: &Arc<Self>, answer: redis::RedisResult<T>) -> redis::RedisResult<T> {
        if let Err(e) = &answer
            && is_connection_failure(e)
        {
            self.rebuild();
        }
        answer
    }
}

impl Connection {
    /// Sends one command; on a cluster it goes to the node of its first key.
    pub(crate) async fn query<T: redis::FromRedisValue>(&self, cmd: &Cmd) -> Result<T> {
        match self {
            Self::Single(conn) => cmd.query_async(&mut conn.clone()).await,
            Self::Cluster(cluster) => {
                cluster.checked(cmd.query_async(&mut cluster.connection()).await)
            }
        }
        .map_err(classify)
    }

    /// Sends `pipeline` on one connection, on a cluster to the primary of `key`'s slot.
    async fn pipeline(&self, pipeline: Pipeline, key: &str) -> Result<Vec<Value>> {
        match self {
            Self::Single(conn) => pipeline.query_async(&mut conn.clone()).await,
            Self::Cluster(cluster) => {
                let route =
                    SingleNodeRoutingInfo::SpecificNode(Route::with_key(key, SlotAddr::Master));
                let count = pipeline.len();
                let answer = cluster
                    .connection()
                    .route_pipeline(pipeline, 0, count, route)
                    .await;
                cluster.checked(answer)
            }
        }
        .map_err(classify)
    }
}

/// Where a store's keys are.
#[derive(Debug, Clone)]
enum Layout {
    /// One server: one index for every record.
    Single { index: String },
    /// A cluster: [`RedisStore::CLUSTER_BUCKETS`] buckets, each hash-tagged.
    Cluster,
}

/// How many replicas must confirm a write, and how long they are given.
#[derive(Debug, Clone, Copy)]
struct WaitReplicas {
    replicas: u32,
    timeout: Duration,
}

/// Replicas did not confirm a write in time (`WAIT` counted fewer than asked for).
#[derive(Debug, thiserror::Error)]
#[error("{confirmed} of {asked} Redis replicas confirmed the write within {timeout:?}")]
pub struct ReplicasUnconfirmed {
    /// Replicas that confirmed.
    pub confirmed: i64,
    /// Replicas asked for.
    pub asked: u32,
    /// How long they were given.
    pub timeout: Duration,
}

/// One of the store's scripts: its source (for `SCRIPT LOAD` on a node that lacks it) and its
/// SHA1, hashed once (for `EVALSHA`).
struct Lua {
    source: &'static str,
    script: Script,
    /// Whether replicas must confirm its write under `wait_for_replicas`: a claim, renewal or
    /// outcome, not a release or a sweep, whose loss in a failover frees nothing that is held.
    confirmed: bool,
}

impl Lua {
    fn new(source: &'static str, confirmed: bool) -> Self {
        Self {
            source,
            script: Script::new(source),
            confirmed,
        }
    }
}

/// The store's scripts.
struct Scripts {
    get: Lua,
    claim: Lua,
    complete: Lua,
    renew: Lua,
    release: Lua,
    sweep: Lua,
    list: Lua,
    purge: Lua,
    force_complete: Lua,
    record_event: Lua,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    get: Lua::new(GET, false),
    claim: Lua::new(CLAIM, true),
    complete: Lua::new(COMPLETE, true),
    renew: Lua::new(RENEW, true),
    release: Lua::new(RELEASE, false),
    sweep: Lua::new(SWEEP, false),
    list: Lua::new(LIST, false),
    // Like a release, a purge whose loss in a failover leaves the record as it was.
    purge: Lua::new(PURGE, false),
    force_complete: Lua::new(FORCE_COMPLETE, true),
    // An operator's note, not a claim or an outcome: nothing held is freed by its loss.
    record_event: Lua::new(RECORD_EVENT, false),
});

/// The scheme of a cluster's URL: `redis+cluster://HOST:PORT,HOST:PORT,…`.
const CLUSTER_SCHEME: &str = "redis+cluster://";

impl RedisStore {
    /// How much longer than its retention Redis keeps a completed record, so that the sweeper
    /// deletes it first (see [Memory](Self#memory)).
    pub const TTL_SLACK: Duration = Duration::from_secs(60 * 60);

    /// How many buckets a cluster's records are spread over (see [Layout](Self#layout)):
    /// enough that their slots fall on every primary of a cluster of any usual size.
    pub const CLUSTER_BUCKETS: usize = 128;

    /// Connects to the server named by a URL such as `redis://127.0.0.1:6379/0`, or to the
    /// cluster named by `redis+cluster://HOST:PORT,HOST:PORT,…` (any of its nodes; the others
    /// are found from them; `redis+cluster://USER:PASSWORD@…` applies to every node), keeping
    /// every key under `prefix` (see [Layout](Self#layout)). Choose prefixes so that none is
    /// another's prefix followed by `:`.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the server (or no node of the cluster) can be reached in
    /// time, and [`Error::Redis`] when the URL cannot be read, a cluster URL names no node, a
    /// cluster store's prefix contains `{` or `}`, or Redis refuses the connection.
    pub async fn connect(url: &str, prefix: impl Into<String>) -> Result<Self> {
        let prefix = prefix.into();
        if let Some(nodes) = url.strip_prefix(CLUSTER_SCHEME) {
            return Self::connect_cluster(&cluster_nodes(nodes)?, prefix).await;
        }
        let client = redis::Client::open(url).map_err(classify)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_number_of_retries(RECONNECT_RETRIES);
        let conn = ConnectionManager::new_with_config(client.clone(), config)
            .await
            .map_err(classify)?;
        Ok(Self {
            clients: vec![client],
            conn: Connection::Single(conn),
            layout: Layout::Single {
                index: format!("{prefix}:sweep"),
            },
            prefix,
            wait: None,
            next_bucket: Arc::default(),
            last_trim: Arc::new(AtomicI64::new(i64::MIN)),
        })
    }

    /// Connects to a Redis Cluster through `nodes` (`redis://HOST:PORT` each).
    async fn connect_cluster(nodes: &[String], prefix: String) -> Result<Self> {
        if prefix.contains(['{', '}']) {
            return Err(Error::Redis(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "a Redis Cluster store's prefix may not contain { or }",
                prefix,
            ))));
        }
        let clients = nodes
            .iter()
            .map(|node| redis::Client::open(node.as_str()))
            .collect::<redis::RedisResult<Vec<_>>>()
            .map_err(classify)?;
        // Every request, with its redirects and retries, ends within the response timeout, so
        // a failover mid-request is a prompt `503`, not a hang.
        let client = ClusterClientBuilder::new(nodes.to_vec())
            .connection_timeout(CONNECTION_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .build()
            .map_err(classify)?;
        let conn = client.get_async_connection().await.map_err(classify)?;
        Ok(Self {
            clients,
            conn: Connection::Cluster(Arc::new(Cluster {
                client,
                current: std::sync::RwLock::new(conn),
                rebuilding: std::sync::atomic::AtomicBool::new(false),
            })),
            layout: Layout::Cluster,
            prefix,
            wait: None,
            next_bucket: Arc::default(),
            last_trim: Arc::new(AtomicI64::new(i64::MIN)),
        })
    }

    /// Makes every claim, lease renewal and completion wait until `replicas` replicas of the
    /// record's primary have it (`WAIT replicas timeout`, on the connection that wrote it), and
    /// fail with [`Error::Unavailable`] (a [`ReplicasUnconfirmed`] inside) when fewer confirm
    /// within `timeout`. A claim that is not confirmed is released again, so its retry is not
    /// kept waiting for a lease. A primary with fewer replicas than that, such as one just
    /// promoted in place of a failed primary whose only replica it was, refuses every claim
    /// until it has them again. See [What Redis does not give](Self#what-redis-does-not-give).
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = (replicas > 0).then_some(WaitReplicas { replicas, timeout });
        self
    }

    /// The hash tag of `scope`'s bucket on a cluster, or nothing on one server.
    fn tag(&self, scope: &Scope) -> Option<usize> {
        match self.layout {
            Layout::Single { .. } => None,
            Layout::Cluster => Some(bucket_of(scope)),
        }
    }

    /// The Redis key of the hash holding `scope`'s record (see [Layout](Self#layout)), for
    /// looking at it with `redis-cli`, or asking a cluster which node serves it.
    pub fn record_key(&self, scope: &Scope) -> String {
        let account = scope.account.as_str();
        let key = scope.key.as_str();
        let length = account.len().to_string();
        // Built by hand, not with `format!`: it is made twice for every request.
        let mut record = String::with_capacity(
            self.prefix.len() + 16 + length.len() + account.len() + key.len(),
        );
        record.push_str(&self.prefix);
        if let Some(bucket) = self.tag(scope) {
            record.push_str(":{b");
            record.push_str(&bucket.to_string());
            record.push('}');
        }
        record.push_str(":k:");
        record.push_str(&length);
        record.push(':');
        record.push_str(account);
        record.push(':');
        record.push_str(key);
        record
    }

    /// The Redis key of the list holding the history of `scope`'s key
    /// ([`AdminStore::record_event`](crate::AdminStore::record_event)):
    /// `{prefix}:e:{account length}:{account}:{key}`, with the record's hash tag on a cluster,
    /// so that it sits in the record's slot. Not under `:k:`, so no listing or sweep reads it.
    fn events_key(&self, scope: &Scope) -> String {
        let account = scope.account.as_str();
        let tag = self
            .tag(scope)
            .map(|bucket| format!(":{{b{bucket}}}"))
            .unwrap_or_default();
        format!(
            "{}{tag}:e:{}:{account}:{}",
            self.prefix,
            account.len(),
            scope.key.as_str()
        )
    }

    /// The sweep index that holds `scope`'s record.
    fn index_key(&self, scope: &Scope) -> Cow<'_, str> {
        match &self.layout {
            Layout::Single { index } => Cow::Borrowed(index),
            Layout::Cluster => Cow::Owned(self.bucket_index(bucket_of(scope))),
        }
    }

    /// Whether the claim made at `now` trims the index of entries more than the slack past
    /// their time: the first claim a second does (by the callers' clock, which only paces it;
    /// a clock that went back trims at once).
    fn trims(&self, now: Timestamp) -> bool {
        let last = self.last_trim.load(Ordering::Relaxed);
        let due = now.0 >= last.saturating_add(TRIM_EVERY_MS) || now.0 < last;
        due && self
            .last_trim
            .compare_exchange(last, now.0, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// The sweep index of a cluster's bucket.
    fn bucket_index(&self, bucket: usize) -> String {
        format!("{}:{{b{bucket}}}:sweep", self.prefix)
    }

    /// Runs `script` on `keys` with `args` (an `EVALSHA`, sent in full when the server lacks
    /// it). With [`wait_for_replicas`](Self::wait_for_replicas), a confirmed script is followed by `WAIT` in the same
    /// pipeline on the same connection, so it counts the replicas that have this very write;
    /// its count is returned beside the script's answer.
    async fn run(
        &self,
        lua: &Lua,
        keys: &[&str],
        args: impl Fn(&mut Cmd),
    ) -> Result<(Value, Option<i64>)> {
        // Room for every argument up front: a script call has up to a dozen.
        let mut call = redis::Cmd::with_capacity(16, 256);
        call.arg("EVALSHA")
            .arg(lua.script.get_hash())
            .arg(keys.len())
            .arg(keys);
        args(&mut call);
        let first = self.send(&call, keys[0], lua.confirmed).await;
        match first {
            Err(Error::Redis(e)) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                // Loaded on every node of a cluster, so it is there after a failover too.
                let mut load = redis::cmd("SCRIPT");
                load.arg("LOAD").arg(lua.source);
                let _hash: String = self.conn.query(&load).await?;
                self.send(&call, keys[0], lua.confirmed).await
            }
            other => other,
        }
    }

    /// Sends one script call, with its `WAIT` when replicas must confirm: a pipeline on one
    /// connection, on a cluster to the primary of `key`'s slot.
    async fn send(&self, call: &Cmd, key: &str, confirmed: bool) -> Result<(Value, Option<i64>)> {
        let wait = self.wait.filter(|_| confirmed);
        if let (None, Connection::Single(_)) = (wait, &self.conn) {
            // Nothing to send after it: the command alone, without a pipeline's copy of it.
            return Ok((self.conn.query(call).await?, None));
        }
        let mut pipeline = redis::pipe();
        pipeline.add_command(call.clone());
        if let Some(wait) = wait {
            pipeline
                .cmd("WAIT")
                .arg(wait.replicas)
                .arg(u64::try_from(wait.timeout.as_millis()).unwrap_or(u64::MAX));
        }
        let mut answers = self.conn.pipeline(pipeline, key).await?.into_iter();
        // A pipeline hands back a command's error as its answer.
        let answer = answers
            .next()
            .unwrap_or(Value::Nil)
            .extract_error()
            .map_err(classify)?;
        let confirmed = match (wait, answers.next()) {
            (None, _) => None,
            (Some(_), Some(Value::Int(confirmed))) => Some(confirmed),
            (Some(_), _) => {
                return Err(Error::Corrupt(
                    "WAIT answered with something else than a count".into(),
                ));
            }
        };
        Ok((answer, confirmed))
    }

    /// The error for a write that `confirmed` replicas had, when not enough.
    fn unconfirmed(&self, confirmed: Option<i64>) -> Option<Error> {
        let (wait, confirmed) = (self.wait?, confirmed?);
        (confirmed < i64::from(wait.replicas)).then(|| {
            Error::Unavailable(Box::new(ReplicasUnconfirmed {
                confirmed,
                asked: wait.replicas,
                timeout: wait.timeout,
            }))
        })
    }
}

/// The nodes of `redis+cluster://[USER:PASSWORD@]HOST:PORT,HOST:PORT[/]`, each as a
/// `redis://` URL carrying the credentials.
fn cluster_nodes(rest: &str) -> Result<Vec<String>> {
    let rest = rest.trim_end_matches('/');
    let (credentials, hosts) = match rest.rsplit_once('@') {
        Some((credentials, hosts)) => (format!("{credentials}@"), hosts),
        None => (String::new(), rest),
    };
    let nodes: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|host| !host.is_empty())
        .map(|host| format!("redis://{credentials}{host}"))
        .collect();
    if nodes.is_empty() {
        return Err(Error::Redis(RedisError::from((
            ErrorKind::InvalidClientConfig,
            "a Redis Cluster URL names its nodes: redis+cluster://HOST:PORT,HOST:PORT",
        ))));
    }
    Ok(nodes)
}

/// The cluster bucket of `scope`: FNV-1a of its account and key. Any stable, well-spread hash
/// does (it only places records, it guards nothing), and this one is a few lines.
fn bucket_of(scope: &Scope) -> usize {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let account = scope.account.as_str().as_bytes();
    // The account's length first, as in the record key, so no two scopes hash the same bytes.
    for byte in account
        .len()
        .to_le_bytes()
        .iter()
        .chain(account)
        .chain(scope.key.as_str().as_bytes())
    {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    // The remainder is below CLUSTER_BUCKETS, so it fits.
    (hash % RedisStore::CLUSTER_BUCKETS as u64) as usize
}

/// Whether Redis could not be reached or cannot serve right now: I/O failures (refused,
/// dropped, timed out) and the server's own "not now" answers (loading its data set, a
/// replica during failover, a cluster without a primary, a slot on its way to another node).
fn is_connection_failure(e: &RedisError) -> bool {
    e.is_io_error()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::ReadOnly
                    | ServerErrorKind::Moved
                    | ServerErrorKind::Ask
            ) | ErrorKind::ClusterConnectionNotFound
        )
}

/// How often, by the callers' clock, a claim trims the sweep index (milliseconds).
const TRIM_EVERY_MS: i64 = 1000;

/// [`RedisStore::TTL_SLACK`] in milliseconds.
fn slack_ms() -> i64 {
    i64::try_from(RedisStore::TTL_SLACK.as_millis()).expect("the slack fits in i64 milliseconds")
}

/// The store's error for a failed command.
pub(crate) fn classify(e: RedisError) -> Error {
    if is_connection_failure(&e) {
        Error::Unavailable(Box::new(e))
    } else {
        Error::Redis(e)
    }
}

/// The distance from `now` to `t`, a caller's time, as Redis is given it: whole
/// milliseconds, never negative, within what its scripts compute exactly.
fn from_now(now: Timestamp, t: Timestamp) -> i64 {
    t.0.saturating_sub(now.0).clamp(0, MAX_TTL_MS)
}

/// A script's answer of Redis's now and a record's fields (none: no record), as the record in
/// the frame of the caller's `now`.
fn record_at(scope: &Scope, answer: Value, now: Timestamp) -> Result<Option<Record>> {
    let (store_now, fields): (i64, HashMap<String, Vec<u8>>) =
        redis::from_redis_value(answer).map_err(|e| Error::Redis(e.into()))?;
    // A missing hash reads as no fields.
    if fields.is_empty() {
        return Ok(None);
    }
    let record = record_from_fields(scope, fields)?;
    Ok(Some(in_caller_frame(record, store_now, now)))
}

/// A response's headers as a record stores them.
fn headers_json(response: &StoredResponse) -> String {
    serde_json::to_string(&response.headers).expect("headers always serialise")
}

/// The arguments of `store_outcome.lua` (`headers` is [`headers_json`] of `response`).
fn outcome_args(call: &mut Cmd, response: &StoredResponse, headers: &str) {
    call.arg(response.status)
        .arg(headers)
        .arg(&response.body[..])
        .arg(u8::from(response.body_omitted))
        .arg(slack_ms())
        .arg(MAX_TTL_MS);
}

/// The error for a record whose hash cannot be read back.
fn corrupt(scope: &Scope, what: &str) -> Error {
    Error::Corrupt(format!("{what} for key {}", scope.log_label()))
}

/// Takes one field of a record's hash.
fn take(scope: &Scope, fields: &mut HashMap<String, Vec<u8>>, name: &str) -> Result<Vec<u8>> {
    fields
        .remove(name)
        .ok_or_else(|| corrupt(scope, &format!("no {name}")))
}

/// Takes one field of a record's hash, written as a decimal integer.
fn take_number(scope: &Scope, fields: &mut HashMap<String, Vec<u8>>, name: &str) -> Result<i64> {
    let raw = take(scope, fields, name)?;
    std::str::from_utf8(&raw)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| corrupt(scope, &format!("a bad {name}")))
}

/// Reads a record from its hash's fields.
fn record_from_fields(scope: &Scope, mut fields: HashMap<String, Vec<u8>>) -> Result<Record> {
    let fields = &mut fields;
    let fingerprint = Fingerprint::try_from(take(scope, fields, "request_hash")?.as_slice())
        .map_err(|_| corrupt(scope, "a request hash of bad length"))?;
    let state = match take(scope, fields, "status")?.as_slice() {
        b"in_progress" => RecordState::InProgress {
            lease_until: Timestamp(take_number(scope, fields, "lease_until")?),
            token: FencingToken(take_number(scope, fields, "fencing_token")?),
        },
        b"completed" => {
            let code = take_number(scope, fields, "response_code")?;
            let headers = take(scope, fields, "response_headers")?;
            RecordState::Completed(StoredResponse {
                status: u16::try_from(code).map_err(|_| corrupt(scope, "a bad response code"))?,
                headers: serde_json::from_slice(&headers)
                    .map_err(|_| corrupt(scope, "unreadable response headers"))?,
                body: take(scope, fields, "response_body")?,
                body_omitted: take(scope, fields, "body_omitted")? == b"1",
            })
        }
        _ => return Err(corrupt(scope, "an unknown status")),
    };
    Ok(Record {
        scope: Scope::new(AccountId::new(scope.account.as_str()), scope.key.clone()),
        fingerprint,
        state,
        created_at: Timestamp(take_number(scope, fields, "created_at")?),
        expires_at: Timestamp(take_number(scope, fields, "expires_at")?),
    })
}

impl Store for RedisStore {
    fn claim_answers_like_a_read(&self) -> bool {
        // The claim script returns the record it finds, in one round trip, as HGETALL would.
        true
    }

    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>> {
        let record = self.record_key(scope);
        let (answer, _) = self.run(&SCRIPTS.get, &[&record], |_| {}).await?;
        record_at(scope, answer, now)
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome> {
        let (record, index) = (self.record_key(&claim.scope), self.index_key(&claim.scope));
        let trim = self.trims(claim.now);
        let (answer, confirmed) = self
            .run(&SCRIPTS.claim, &[&record, &index], |call| {
                call.arg(&claim.fingerprint.as_bytes()[..])
                    .arg(from_now(claim.now, claim.lease_until))
                    .arg(from_now(claim.now, claim.expires_at))
                    .arg(claim.token.0)
                    .arg(u8::from(claim.take_over_expired_lease));
                if trim {
                    call.arg(slack_ms());
                } else {
                    call.arg("");
                }
            })
            .await?;
        if let Value::Int(1) = answer {
            if let Some(unconfirmed) = self.unconfirmed(confirmed) {
                // Not on enough replicas: give the key back (best effort; should this fail
                // too, the record stays in progress, its outcome unknown), so the retry that
                // the `503` invites may claim it.
                let _released = self.release(&claim.scope, claim.token).await;
                return Err(unconfirmed);
            }
            return Ok(ClaimOutcome::Claimed);
        }
        // Anything but `1` is Redis's now and the record that holds the key.
        match record_at(&claim.scope, answer, claim.now)? {
            Some(record) => Ok(ClaimOutcome::Existing(record)),
            None => Err(corrupt(&claim.scope, "a lost claim without a record")),
        }
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
        _now: Timestamp,
    ) -> Result<bool> {
        let headers = headers_json(response);
        let (record, index) = (self.record_key(scope), self.index_key(scope));
        let (done, confirmed) = self
            .run(&SCRIPTS.complete, &[&record, &index], |call| {
                outcome_args(call, response, &headers);
                call.arg(token.0);
            })
            .await?;
        self.written(done, confirmed)
    }

    async fn renew(
        &self,
        scope: &Scope,
        token: FencingToken,
        lease: Duration,
        _now: Timestamp,
    ) -> Result<bool> {
        let record = self.record_key(scope);
        let (done, confirmed) = self
            .run(&SCRIPTS.renew, &[&record], |call| {
                call.arg(token.0).arg(millis(lease).min(MAX_TTL_MS));
            })
            .await?;
        self.written(done, confirmed)
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> Result<bool> {
        let (record, index) = (self.record_key(scope), self.index_key(scope));
        let (done, _) = self
            .run(&SCRIPTS.release, &[&record, &index], |call| {
                call.arg(token.0);
            })
            .await?;
        Ok(done == Value::Int(1))
    }

    async fn sweep(&self, _now: Timestamp, batch: u32) -> Result<u64> {
        let indexes = match &self.layout {
            Layout::Single { index } => vec![index.clone()],
            Layout::Cluster => {
                let first = self.next_bucket.fetch_add(1, Ordering::Relaxed);
                (0..Self::CLUSTER_BUCKETS)
                    .map(|i| self.bucket_index((first + i) % Self::CLUSTER_BUCKETS))
                    .collect()
            }
        };
        let mut deleted = 0;
        for index in &indexes {
            let left = u64::from(batch).saturating_sub(deleted);
            if left == 0 {
                break;
            }
            let (count, _) = self
                .run(&SCRIPTS.sweep, &[index], |call| {
                    call.arg(left);
                })
                .await?;
            deleted += redis::from_redis_value::<u64>(count).map_err(|e| Error::Redis(e.into()))?;
        }
        Ok(deleted)
    }
}

impl RedisStore {
    /// Whether a fenced write (`1` from its script) was made, and an error when it was made
    /// but not confirmed by enough replicas.
    fn written(&self, done: Value, confirmed: Option<i64>) -> Result<bool> {
        let done = done == Value::Int(1);
        match self.unconfirmed(confirmed) {
            Some(unconfirmed) if done => Err(unconfirmed),
            _ => Ok(done),
        }
    }
}
