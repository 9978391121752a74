//! [`RedisStore`]: records in Redis, for the gateway's lease mode.
//!
//! Every operation is one Lua script (or, for [`Store::get`], one `HGETALL`), and Redis runs a
//! script as a single atomic step, so the claim is one insert-if-absent however many instances
//! claim at once, and `complete`, `renew` and `release` check the fencing token and the status
//! in the same step as they write.
//!
//! The store's own docs ([`RedisStore`]) say what Redis does not give, how keys are laid out
//! and how idem's clock and Redis's expiry meet.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use idem_core::{
    AccountId, FencingToken, Fingerprint, Record, RecordState, Scope, StoredResponse, Timestamp,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, Script, ServerErrorKind, Value};

use crate::{ClaimOutcome, Error, NewClaim, Result, Store};

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

// Claims a key if no record holds it, or replaces a record the claim may replace (past its
// retention and not held by a live lease; or, if allowed, a stale claim of the same request),
// the conditions of the SQL stores' claim. Otherwise returns the record that holds the key, so
// the loser needs no second round trip.
//
// KEYS: record, index. ARGV: request_hash, now, expires_at, lease_until, fencing_token,
// take_over (1/0), ttl_ms, sweepable_at, trim_before.
const CLAIM: &str = r"
local record, index = KEYS[1], KEYS[2]
local now = tonumber(ARGV[2])
local held = redis.call('HMGET', record, 'status', 'expires_at', 'lease_until', 'request_hash')
local status = held[1]
if status then
    local expires_at, lease_until = tonumber(held[2]), tonumber(held[3])
    local live_lease = status == 'in_progress' and lease_until > now
    local expired = expires_at <= now and not live_lease
    local take_over = ARGV[6] == '1' and status == 'in_progress' and lease_until <= now
        and held[4] == ARGV[1]
    if not (expired or take_over) then
        return redis.call('HGETALL', record)
    end
end
redis.call('DEL', record)
redis.call('HSET', record,
    'request_hash', ARGV[1], 'status', 'in_progress', 'created_at', ARGV[2],
    'expires_at', ARGV[3], 'lease_until', ARGV[4], 'fencing_token', ARGV[5])
redis.call('PEXPIRE', record, ARGV[7])
redis.call('ZADD', index, ARGV[8], record)
redis.call('ZREMRANGEBYSCORE', index, '-inf', '(' .. ARGV[9])
return 1
";

// Stores the outcome if the claim holding the token still holds the key. A completed record
// becomes sweepable at its retention's end, whatever its lease said.
//
// KEYS: record, index. ARGV: fencing_token, response_code, response_headers, response_body,
// body_omitted (1/0).
const COMPLETE: &str = r"
local record, index = KEYS[1], KEYS[2]
local held = redis.call('HMGET', record, 'status', 'fencing_token', 'expires_at')
if held[1] ~= 'in_progress' or held[2] ~= ARGV[1] then
    return 0
end
redis.call('HSET', record, 'status', 'completed', 'response_code', ARGV[2],
    'response_headers', ARGV[3], 'response_body', ARGV[4], 'body_omitted', ARGV[5])
redis.call('ZADD', index, held[3], record)
return 1
";

// Moves the lease of the claim holding the token. The record's TTL grows by as much as its
// sweepable time moved later (never shrinks: a longer backstop is always safe); the TTL is a
// duration, so this needs no `now`.
//
// KEYS: record, index. ARGV: fencing_token, lease_until, max_ttl_ms.
const RENEW: &str = r"
local record, index = KEYS[1], KEYS[2]
local held = redis.call('HMGET', record, 'status', 'fencing_token', 'expires_at', 'lease_until')
if held[1] ~= 'in_progress' or held[2] ~= ARGV[1] then
    return 0
end
local expires_at, old_lease, new_lease = tonumber(held[3]), tonumber(held[4]), tonumber(ARGV[2])
redis.call('HSET', record, 'lease_until', ARGV[2])
local sweepable_at = held[3]
if new_lease > expires_at then
    sweepable_at = ARGV[2]
end
redis.call('ZADD', index, sweepable_at, record)
local later = math.max(expires_at, new_lease) - math.max(expires_at, old_lease)
local ttl = redis.call('PTTL', record)
if later > 0 and ttl > 0 then
    local extended = math.min(ttl + later, tonumber(ARGV[3]))
    redis.call('PEXPIRE', record, string.format('%d', extended))
end
return 1
";

// Deletes the in-progress record of the claim holding the token.
//
// KEYS: record, index. ARGV: fencing_token.
const RELEASE: &str = r"
local record, index = KEYS[1], KEYS[2]
local held = redis.call('HMGET', record, 'status', 'fencing_token')
if held[1] ~= 'in_progress' or held[2] ~= ARGV[1] then
    return 0
end
redis.call('DEL', record)
redis.call('ZREM', index, record)
return 1
";

// Deletes at most `batch` sweepable records, found through the index and checked against
// their stored state. One script, so concurrent sweepers take disjoint records and each
// deletion is counted once. An entry whose record Redis has already expired is dropped
// uncounted; one whose record is not sweepable after all is given its true time, so it cannot
// stay in front of the range.
//
// KEYS: index. ARGV: now, batch.
const SWEEP: &str = r"
local index = KEYS[1]
local now = tonumber(ARGV[1])
local deleted = 0
local due = redis.call('ZRANGEBYSCORE', index, '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, record in ipairs(due) do
    local held = redis.call('HMGET', record, 'status', 'expires_at', 'lease_until')
    local status = held[1]
    if not status then
        redis.call('ZREM', index, record)
    elseif tonumber(held[2]) <= now
        and (status == 'completed' or tonumber(held[3]) <= now) then
        redis.call('DEL', record)
        redis.call('ZREM', index, record)
        deleted = deleted + 1
    elseif status == 'completed' or tonumber(held[2]) >= tonumber(held[3]) then
        redis.call('ZADD', index, held[2], record)
    else
        redis.call('ZADD', index, held[3], record)
    end
end
return deleted
";

/// Records in Redis, every key under one prefix, for lease mode.
///
/// Cloning is cheap: clones share one multiplexed connection, which reconnects by itself
/// after the server comes back.
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
///   latest claims or outcomes, and their keys are then free again. `WAIT` narrows the window
///   but does not close it.
/// - **Eviction forgets keys.** Every record has a TTL, so under `maxmemory` any `volatile-*`
///   or `allkeys-*` policy may evict live records. Run with `maxmemory-policy noeviction`: a
///   full server then refuses claims (the layer answers `503`) instead of forgetting them.
/// - **No Redis Cluster.** Each script touches a record and the prefix's index, which a cluster
///   would place in different slots, and the sweeper deletes records it finds through the
///   index, keys it cannot declare in advance. It needs one server (or a primary with
///   replicas).
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
///   becomes sweepable: its `expires_at` once completed, `max(expires_at, lease_until)` while in
///   progress. The sweeper takes the lowest scores up to `now`, so records under a long lease
///   never stand in front of those it may delete.
///
/// # Time
///
/// idem's time is an injected clock, which need not agree with Redis's (tests run years away
/// from it). So every decision compares the stored times with the caller's `now`, exactly as
/// the SQL stores do, and Redis's own expiry decides nothing: it is a garbage-collection
/// backstop for records nobody sweeps. A record's TTL is a duration, not an instant: the time
/// from the claim's `now` until the record becomes sweepable, plus
/// [`TTL_SLACK`](Self::TTL_SLACK) for the clocks of other instances running behind the
/// claimer's. Renewing a lease lengthens it by as much as the sweepable time moved (a duration
/// again, as `renew` is given no `now`); completing leaves it as it is, since longer is safe.
/// So while the instances' clocks keep pace with real time, Redis only ever drops a record the
/// sweeper could have deleted already. (Under a clock that stands still, a test's manual clock,
/// records still vanish once their TTL has passed in real time.)
///
/// The index has no TTL. The sweeper removes the entries it handles, and each claim drops the
/// entries more than the slack past their time (by then Redis has expired their records), so the
/// index stays bounded where no sweeper runs. An entry whose record Redis expired first is
/// dropped by the sweeper uncounted, so a sweep can report fewer than its batch while more
/// remain; the next run goes on.
///
/// Times and scores are compared as Lua numbers (doubles): exact for times within 2^53 ms
/// (285,000 years) of 1970. Fencing tokens are compared as the decimal strings they were
/// written as, so every `i64` is exact.
#[derive(Debug, Clone)]
pub struct RedisStore {
    // The client and prefix are the crate's: `notify` subscribes with the one and names its
    // channel from the other.
    pub(crate) client: redis::Client,
    pub(crate) conn: ConnectionManager,
    pub(crate) prefix: String,
    index: String,
}

/// The scripts, each hashed once: they are sent by their SHA1 (`EVALSHA`), and in full only
/// when the server does not have them yet.
struct Scripts {
    claim: Script,
    complete: Script,
    renew: Script,
    release: Script,
    sweep: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: Script::new(CLAIM),
    complete: Script::new(COMPLETE),
    renew: Script::new(RENEW),
    release: Script::new(RELEASE),
    sweep: Script::new(SWEEP),
});

impl RedisStore {
    /// How much longer than its sweepable time Redis keeps a record: a generous bound on how
    /// far the clocks of the instances sharing the store may disagree.
    pub const TTL_SLACK: Duration = Duration::from_secs(60 * 60);

    /// Connects to the server named by a URL such as `redis://127.0.0.1:6379/0`, keeping every
    /// key under `prefix` (see [Layout](Self#layout)). Choose prefixes so that none is
    /// another's prefix followed by `:`.
    pub async fn connect(url: &str, prefix: impl Into<String>) -> Result<Self> {
        let client = redis::Client::open(url).map_err(classify)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_number_of_retries(RECONNECT_RETRIES);
        let conn = ConnectionManager::new_with_config(client.clone(), config)
            .await
            .map_err(classify)?;
        let prefix = prefix.into();
        Ok(Self {
            client,
            conn,
            index: format!("{prefix}:sweep"),
            prefix,
        })
    }

    /// The key of the hash holding `scope`'s record.
    fn record_key(&self, scope: &Scope) -> String {
        let account = scope.account.as_str();
        format!(
            "{}:k:{}:{account}:{}",
            self.prefix,
            account.len(),
            scope.key.as_str()
        )
    }
}

/// Whether Redis could not be reached or cannot serve right now: I/O failures (refused,
/// dropped, timed out) and the server's own "not now" answers (loading its data set, a
/// replica during failover, a cluster without a primary).
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
            ) | ErrorKind::ClusterConnectionNotFound
        )
}

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

/// The record's TTL in Redis: from `now` until it becomes sweepable, plus the slack, within
/// what Redis accepts.
fn ttl_ms(claim: &NewClaim) -> i64 {
    let sweepable_at = claim.expires_at.max(claim.lease_until);
    sweepable_at
        .0
        .saturating_sub(claim.now.0)
        .saturating_add(slack_ms())
        .clamp(1, MAX_TTL_MS)
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
    async fn get(&self, scope: &Scope) -> Result<Option<Record>> {
        let fields: HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
            .arg(self.record_key(scope))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(classify)?;
        // A missing hash reads as no fields.
        if fields.is_empty() {
            return Ok(None);
        }
        record_from_fields(scope, fields).map(Some)
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome> {
        let sweepable_at = claim.expires_at.max(claim.lease_until);
        let answer: Value = SCRIPTS
            .claim
            .key(self.record_key(&claim.scope))
            .key(&self.index)
            .arg(&claim.fingerprint.as_bytes()[..])
            .arg(claim.now.0)
            .arg(claim.expires_at.0)
            .arg(claim.lease_until.0)
            .arg(claim.token.0)
            .arg(u8::from(claim.take_over_expired_lease))
            .arg(ttl_ms(claim))
            .arg(sweepable_at.0)
            .arg(claim.now.0.saturating_sub(slack_ms()))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(classify)?;
        if let Value::Int(1) = answer {
            return Ok(ClaimOutcome::Claimed);
        }
        // Anything but `1` is the record that holds the key, as `HGETALL` gives it.
        let fields: HashMap<String, Vec<u8>> =
            redis::from_redis_value(answer).map_err(|e| Error::Redis(e.into()))?;
        record_from_fields(&claim.scope, fields).map(ClaimOutcome::Existing)
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<bool> {
        let headers = serde_json::to_string(&response.headers).expect("headers always serialise");
        let done: i64 = SCRIPTS
            .complete
            .key(self.record_key(scope))
            .key(&self.index)
            .arg(token.0)
            .arg(response.status)
            .arg(headers)
            .arg(&response.body[..])
            .arg(u8::from(response.body_omitted))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(classify)?;
        Ok(done == 1)
    }

    async fn renew(
        &self,
        scope: &Scope,
        token: FencingToken,
        lease_until: Timestamp,
    ) -> Result<bool> {
        let done: i64 = SCRIPTS
            .renew
            .key(self.record_key(scope))
            .key(&self.index)
            .arg(token.0)
            .arg(lease_until.0)
            .arg(MAX_TTL_MS)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(classify)?;
        Ok(done == 1)
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> Result<bool> {
        let done: i64 = SCRIPTS
            .release
            .key(self.record_key(scope))
            .key(&self.index)
            .arg(token.0)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(classify)?;
        Ok(done == 1)
    }

    async fn sweep(&self, now: Timestamp, batch: u32) -> Result<u64> {
        SCRIPTS
            .sweep
            .key(&self.index)
            .arg(now.0)
            .arg(batch)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(classify)
    }
}
