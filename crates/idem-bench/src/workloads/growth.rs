//! Costs as the key table grows (issue 20, item 4): `idem serve` on a key table of millions of
//! live records, and `idem serve` while its sweeper deletes expired records, each against the
//! same server on an empty key table.
//!
//! The three servers of a group run side by side, each on a database of its own, and are
//! loaded in turn as every group's variants are. The tables are filled once per run, with one
//! bulk INSERT of rows shaped as the stores write completed records, spread over many accounts
//! (the load's own among them) and in key order, so that filling is a sequential write.
//!
//! The records to sweep are filled live and split into one slice per round: before each of
//! its runs the sweeping variant expires the next slice, and the server's sweeper (looking
//! every 400 ms here, as every server of the group does) deletes it during that run. So the
//! sweeper works in that variant's windows and not in the others'.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::{Clock, SystemClock};
use idem_testkit::postgres::PgTestDatabase;
use serde::Serialize;
use sqlx::{PgPool, SqlitePool};

use super::{
    BeforeRun, Comparison, Entry, Env, Group, Prepared, Variant, at_least, ready, servers,
    sqlite_url,
};
use crate::servers::{ACCOUNT, payment_post};

/// growth-postgres's rows.
pub(super) const GROWTH_POSTGRES: &[Comparison] = &[
    Comparison::new(
        "growth-postgres-live",
        "first requests, key table of live records, PostgreSQL",
        "empty",
        "live",
        at_least(0.9),
    ),
    Comparison::new(
        "growth-postgres-swept",
        "first requests while sweeping, PostgreSQL",
        "empty",
        "swept",
        at_least(0.9),
    ),
];

/// growth-sqlite's rows.
pub(super) const GROWTH_SQLITE: &[Comparison] = &[
    Comparison::new(
        "growth-sqlite-live",
        "first requests, key table of live records, SQLite",
        "empty",
        "live",
        at_least(0.9),
    ),
    Comparison::new(
        "growth-sqlite-swept",
        "first requests while sweeping, SQLite",
        "empty",
        "swept",
        at_least(0.9),
    ),
];

/// How many accounts the filled records are spread over; the load's account is the first.
const ACCOUNTS: u64 = 1000;

/// `idem serve`'s default retention: a filled record was created within the last day.
const RETENTION_MS: i64 = 24 * 60 * 60 * 1000;

/// How often the group's servers sweep: an expired slice is taken up within the warm-up.
const SWEEP_EVERY: Duration = Duration::from_millis(400);

/// A key table a growth group filled, and how big it is.
#[derive(Debug, Clone, Serialize)]
pub struct KeyTable {
    /// The group.
    pub group: Group,
    /// The variant whose server uses it.
    pub variant: &'static str,
    /// What it holds, for the table.
    pub label: String,
    /// Records filled in.
    pub records: u64,
    /// Seconds the filling took (the INSERT, then VACUUM ANALYZE or a WAL checkpoint).
    pub fill_secs: f64,
    /// PostgreSQL: `pg_total_relation_size`; SQLite: the table and its index (dbstat).
    pub total_bytes: Option<u64>,
    /// PostgreSQL: `pg_relation_size`; SQLite: the table, which holds its primary key
    /// (`WITHOUT ROWID`).
    pub table_bytes: Option<u64>,
    /// PostgreSQL: `pg_indexes_size`; SQLite: the index on `expires_at`.
    pub indexes_bytes: Option<u64>,
    /// SQLite: the database file (page count × page size).
    pub file_bytes: Option<u64>,
}

impl KeyTable {
    /// Bytes per filled record, of the total (or the file).
    pub fn bytes_per_record(&self) -> Option<f64> {
        let bytes = self.total_bytes.or(self.file_bytes)?;
        (self.records > 0).then(|| bytes as f64 / self.records as f64)
    }
}

/// A key table's database, reached beside its server.
#[derive(Debug, Clone)]
enum KeyDb {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

/// What a group fills: `live` records in one table, `swept` in another, to be expired in
/// `slices` slices.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    live: u64,
    swept: u64,
    slices: u64,
}

impl Sizes {
    /// `live` live records (`--growth-records`, or a tenth of it), and a tenth of that to
    /// sweep, a slice per round.
    fn of(env: &Env, group: Group) -> Self {
        let records = env.settings.growth_records;
        let live = match group {
            Group::GrowthPostgres => records,
            _ => records / 10,
        };
        Self {
            live: live.max(1),
            swept: (records / 10).max(1),
            slices: env.settings.rounds as u64,
        }
    }
}

/// growth-postgres: three throwaway databases, one server on each.
pub(super) async fn growth_postgres(env: &Env) -> anyhow::Result<Prepared> {
    super::postgres_up().await?;
    let mut prepared = Prepared::default();
    let (mut urls, mut dbs) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let db = PgTestDatabase::create().await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(db.url())
            .await?;
        urls.push(db.url().to_owned());
        dbs.push(KeyDb::Postgres(pool));
        prepared.teardown.keep(db);
    }
    let urls: [String; 3] = urls.try_into().expect("three databases");
    let dbs: [KeyDb; 3] = dbs.try_into().expect("three databases");
    fill_and_start(env, Group::GrowthPostgres, &urls, dbs, &mut prepared).await?;
    Ok(prepared)
}

/// growth-sqlite: three database files in a temporary folder, one server on each.
pub(super) async fn growth_sqlite(env: &Env) -> anyhow::Result<Prepared> {
    let dir = tempfile::tempdir()?;
    let urls = ["empty", "live", "swept"].map(|name| sqlite_url(&dir.path().join(name)));
    let mut prepared = Prepared::default();
    prepared.teardown.keep(dir);
    let mut dbs = Vec::new();
    for url in &urls {
        // The store creates the file and the key table; its writer pool fills it.
        let store = idem_store::SqliteStore::connect(url).await?;
        dbs.push(KeyDb::Sqlite(store.writer().clone()));
    }
    let dbs: [KeyDb; 3] = dbs.try_into().expect("three databases");
    fill_and_start(env, Group::GrowthSqlite, &urls, dbs, &mut prepared).await?;
    Ok(prepared)
}

/// Starts a server on each of `urls` (empty, live, swept; which creates the tables), fills
/// the live and the swept tables through `dbs`, measures the three, and makes the variants.
async fn fill_and_start(
    env: &Env,
    group: Group,
    urls: &[String; 3],
    dbs: [KeyDb; 3],
    prepared: &mut Prepared,
) -> anyhow::Result<()> {
    let mut targets = Vec::new();
    for url in urls {
        let mut config = idem_cli::serve::ServeConfig::new(url.as_str());
        config.sweep_every = SWEEP_EVERY;
        let server = servers::idem_serve_with(&env.runtimes.subject, config).await?;
        targets.push(payment_post(&server.url("/payments")));
        prepared.teardown.servers.push(server);
    }
    let sizes = Sizes::of(env, group);
    let [empty_db, live_db, swept_db] = dbs;
    let labels = [
        "idem serve, empty key table".to_owned(),
        format!("idem serve, {} live records", thousands(sizes.live)),
        format!(
            "idem serve, sweeping {} expired records",
            thousands(sizes.swept)
        ),
    ];
    let fills = [
        (&empty_db, 0, "empty"),
        (&live_db, sizes.live, "live"),
        (&swept_db, sizes.swept, "swept"),
    ];
    for ((db, records, variant), label) in fills.into_iter().zip(&labels) {
        let fill_secs = fill(env, group, db, records, sizes.slices, variant).await?;
        let mut table = db.measure().await?;
        table.group = group;
        table.variant = variant;
        table.label = format!(
            "{}: {}",
            group.name(),
            label.trim_start_matches("idem serve, ")
        );
        table.records = records;
        table.fill_secs = fill_secs;
        prepared.key_tables.push(table);
    }
    let [empty, live, swept]: [_; 3] = targets.try_into().expect("three servers");
    let [empty_label, live_label, swept_label] = labels;
    let mut swept = Variant::http("swept", swept_label, swept);
    swept.before_run = Some(expire_slices(env, group, swept_db, sizes.slices));
    prepared.variants = vec![
        ready("empty", empty_label, empty),
        ready("live", live_label, live),
        ("swept", Ok(swept)) as Entry,
    ];
    Ok(())
}

/// Fills `records` records into `db` (nothing for 0), timing it and saying so on stderr.
async fn fill(
    env: &Env,
    group: Group,
    db: &KeyDb,
    records: u64,
    slices: u64,
    label: &str,
) -> anyhow::Result<f64> {
    if records == 0 {
        return Ok(0.0);
    }
    let what = format!(
        "{}: filling {} records ({label})",
        group.name(),
        thousands(records)
    );
    env.progress.set_message(what.clone());
    let started = Instant::now();
    db.fill(records, slices, SystemClock.now().0).await?;
    let inserted = started.elapsed().as_secs_f64();
    db.settle().await?;
    let total = started.elapsed().as_secs_f64();
    env.progress.suspend(|| {
        eprintln!(
            "idem-bench: {what}: INSERT {inserted:.1} s, then {:.1} s to settle ({total:.1} s)",
            total - inserted
        );
    });
    Ok(total)
}

/// Before each run of the sweeping variant: expires the next slice of `db`'s filled records
/// (all slices are filled live, so the sweeper has nothing to do before), and says on stderr
/// how many expired records the sweeper left since the last run (none if it kept up).
fn expire_slices(env: &Env, group: Group, db: KeyDb, slices: u64) -> BeforeRun {
    let next = Arc::new(AtomicU64::new(0));
    let progress = env.progress.clone();
    BeforeRun(Arc::new(move || {
        let (db, next, progress) = (db.clone(), next.clone(), progress.clone());
        Box::pin(async move {
            let slice = next.fetch_add(1, Ordering::Relaxed);
            if slice >= slices {
                return Ok(());
            }
            let unswept = db.expired(SystemClock.now().0).await?;
            let started = Instant::now();
            db.expire(slice).await?;
            progress.suspend(|| {
                eprintln!(
                    "idem-bench: {}: slice {} of {slices} expired in {:.1} s; {unswept} expired \
                     records were left unswept before it",
                    group.name(),
                    slice + 1,
                    started.elapsed().as_secs_f64()
                );
            });
            Ok(())
        })
    }))
}

/// `n` with a comma every three digits.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

// The filled records, as the stores write a completed payment: the fingerprint (32 bytes),
// status 201 with `content-type` and `location` (the headers idem keeps by default), the
// payment as the body, the default 30 s lease long over. Created within the last day (record
// n after record n-1), so they expire within the next day, never during a run. Keys and
// accounts are zero-padded so that record n also comes after record n-1 in the primary key,
// as its expiry does in the index: the filling writes both in order. The fencing token is the
// record's slice (growth-* only reads it to expire a slice).
//
// PostgreSQL: $1 records, $2 records per account, $3 the load's account, $4 now (Unix ms),
// $5 slices, $6 retention (ms).
const PG_FILL: &str = r#"
INSERT INTO idempotency_keys
    (account_id, idem_key, request_hash, status, response_code, response_headers,
     response_body, body_omitted, created_at, expires_at, lease_until, fencing_token)
SELECT CASE WHEN n / $2 = 0 THEN $3 ELSE 'acct_growth_' || lpad((n / $2)::text, 6, '0') END,
       'growth-' || lpad((n % $2)::text, 10, '0'),
       sha256(int8send(n)),
       'completed', 201,
       jsonb_build_array(jsonb_build_array('content-type', 'application/json'),
                         jsonb_build_array('location', '/payments/pay_' || md5(n::text))),
       convert_to('{"id":"pay_' || md5(n::text) || '","amount":49900,"currency":"INR",'
                  || '"status":"succeeded","created_at":' || ms || '}', 'UTF8'),
       false,
       to_timestamp(ms / 1000.0), to_timestamp((ms + $6) / 1000.0),
       to_timestamp((ms + 30000) / 1000.0),
       n % $5
FROM generate_series(0::bigint, $1 - 1) AS n,
     LATERAL (SELECT $4 - 23 * 3600000 + n * (22 * 3600000) / $1 AS ms) AS created"#;

/// The same for SQLite: ?1 to ?6 as `PG_FILL`'s $1 to $6.
const SQLITE_FILL: &str = r#"
WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n + 1 < ?1)
INSERT INTO idempotency_keys
    (account_id, idem_key, request_hash, status, response_code, response_headers,
     response_body, body_omitted, created_at, expires_at, lease_until, fencing_token)
SELECT CASE WHEN n / ?2 = 0 THEN ?3 ELSE printf('acct_growth_%06d', n / ?2) END,
       printf('growth-%010d', n % ?2),
       randomblob(32),
       'completed', 201,
       json_array(json_array('content-type', 'application/json'),
                  json_array('location', printf('/payments/pay_%032x', n))),
       CAST(printf('{"id":"pay_%032x","amount":49900,"currency":"INR","status":"succeeded","created_at":%d}',
                   n, ms) AS BLOB),
       0, ms, ms + ?6, ms + 30000, n % ?5
FROM (SELECT n, ?4 - 23 * 3600000 + n * (22 * 3600000) / ?1 AS ms FROM seq)"#;

// A slice's records, expired by a day: then they are what the sweeper deletes. Only filled
// records (`growth-` keys), whatever fencing tokens the load's own claims got.
const PG_EXPIRE: &str = "UPDATE idempotency_keys SET expires_at = expires_at - interval '2 days'
WHERE fencing_token = $1 AND idem_key LIKE 'growth-%'";
const SQLITE_EXPIRE: &str = "UPDATE idempotency_keys SET expires_at = expires_at - 172800000
WHERE fencing_token = ?1 AND idem_key LIKE 'growth-%'";

impl KeyDb {
    /// Fills `records` records, `slices` slices of them, created up to a day before `now_ms`.
    async fn fill(&self, records: u64, slices: u64, now_ms: i64) -> anyhow::Result<()> {
        let per_account = records.div_ceil(ACCOUNTS) as i64;
        let (records, slices) = (records as i64, slices.max(1) as i64);
        match self {
            KeyDb::Postgres(pool) => {
                let fill = bind_fill(sqlx::query(PG_FILL), [records, per_account], now_ms, slices);
                fill.execute(pool).await?;
            }
            KeyDb::Sqlite(pool) => {
                let fill = bind_fill(
                    sqlx::query(SQLITE_FILL),
                    [records, per_account],
                    now_ms,
                    slices,
                );
                fill.execute(pool).await?;
            }
        }
        Ok(())
    }

    /// Leaves the filled table as a long-lived one is, so that the first rounds do not pay
    /// for the filling: PostgreSQL vacuumed and analysed (autovacuum would do it during the
    /// rounds) with the WAL checkpointed; SQLite's WAL folded into the file.
    async fn settle(&self) -> anyhow::Result<()> {
        match self {
            KeyDb::Postgres(pool) => {
                sqlx::query("VACUUM (ANALYZE) idempotency_keys")
                    .execute(pool)
                    .await?;
                // Only a superuser may; without it the checkpoint comes when it comes.
                let _ = sqlx::query("CHECKPOINT").execute(pool).await;
            }
            KeyDb::Sqlite(pool) => {
                sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
                    .execute(pool)
                    .await?;
            }
        }
        Ok(())
    }

    /// Expires the filled records of `slice`.
    async fn expire(&self, slice: u64) -> anyhow::Result<()> {
        let slice = slice as i64;
        match self {
            KeyDb::Postgres(pool) => {
                sqlx::query(PG_EXPIRE).bind(slice).execute(pool).await?;
            }
            KeyDb::Sqlite(pool) => {
                sqlx::query(SQLITE_EXPIRE).bind(slice).execute(pool).await?;
            }
        }
        Ok(())
    }

    /// How many records have expired by `now_ms` (the sweeper's backlog).
    async fn expired(&self, now_ms: i64) -> anyhow::Result<i64> {
        let (count,): (i64,) = match self {
            KeyDb::Postgres(pool) => {
                sqlx::query_as(
                    "SELECT count(*) FROM idempotency_keys
                     WHERE expires_at <= to_timestamp($1 / 1000.0)",
                )
                .bind(now_ms)
                .fetch_one(pool)
                .await?
            }
            KeyDb::Sqlite(pool) => {
                sqlx::query_as("SELECT count(*) FROM idempotency_keys WHERE expires_at <= ?1")
                    .bind(now_ms)
                    .fetch_one(pool)
                    .await?
            }
        };
        Ok(count)
    }

    /// The key table's sizes (the group, variant, label and counts left for the caller).
    async fn measure(&self) -> anyhow::Result<KeyTable> {
        let mut table = KeyTable {
            group: Group::GrowthPostgres,
            variant: "",
            label: String::new(),
            records: 0,
            fill_secs: 0.0,
            total_bytes: None,
            table_bytes: None,
            indexes_bytes: None,
            file_bytes: None,
        };
        match self {
            KeyDb::Postgres(pool) => {
                let (total, heap, indexes): (i64, i64, i64) = sqlx::query_as(
                    "SELECT pg_total_relation_size('idempotency_keys'),
                            pg_relation_size('idempotency_keys'),
                            pg_indexes_size('idempotency_keys')",
                )
                .fetch_one(pool)
                .await?;
                table.total_bytes = Some(total as u64);
                table.table_bytes = Some(heap as u64);
                table.indexes_bytes = Some(indexes as u64);
            }
            KeyDb::Sqlite(pool) => measure_sqlite(pool, &mut table).await?,
        }
        Ok(table)
    }
}

/// SQLite's sizes: the file always; the table and its index from dbstat when SQLite was
/// built with it.
async fn measure_sqlite(pool: &SqlitePool, table: &mut KeyTable) -> anyhow::Result<()> {
    let (pages,): (i64,) = sqlx::query_as("PRAGMA page_count").fetch_one(pool).await?;
    let (page_size,): (i64,) = sqlx::query_as("PRAGMA page_size").fetch_one(pool).await?;
    table.file_bytes = Some((pages * page_size) as u64);
    let by_name: Result<Vec<(String, i64)>, _> = sqlx::query_as(
        "SELECT name, SUM(pgsize) FROM dbstat
         WHERE name IN ('idempotency_keys', 'idempotency_keys_expires_at') GROUP BY name",
    )
    .fetch_all(pool)
    .await;
    if let Ok(by_name) = by_name {
        let size = |name: &str| {
            by_name
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, bytes)| *bytes as u64)
        };
        table.table_bytes = size("idempotency_keys");
        table.indexes_bytes = size("idempotency_keys_expires_at");
        table.total_bytes = table
            .table_bytes
            .zip(table.indexes_bytes)
            .map(|(t, i)| t + i);
    }
    Ok(())
}

/// Binds the fill statement's parameters in the order both backends' statements number them:
/// how many records and how many per account, the load's account, now, the slices, and the
/// retention.
fn bind_fill<'q, DB>(
    query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>,
    [records, per_account]: [i64; 2],
    now_ms: i64,
    slices: i64,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>
where
    DB: sqlx::Database,
    for<'t> i64: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> &'t str: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    query
        .bind(records)
        .bind(per_account)
        .bind(ACCOUNT)
        .bind(now_ms)
        .bind(slices)
        .bind(RETENTION_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_are_separated() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(10_000_000), "10,000,000");
    }
}
