//! The floor: `pgbench` running the SQL transaction `idem serve` commits for a payment (claim
//! the key, insert the payment, store the response, commit) with nothing around it; and, to
//! split the gap, pgbench sending every statement `idem serve` sends, pipelined as it sends
//! them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use tokio::process::Command;

use crate::load::{Plan, Sample, histogram};

/// A pgbench workload against one database.
#[derive(Debug, Clone)]
pub(crate) struct Pgbench {
    /// The database, as a libpq URI.
    url: String,
    /// Where the script and the transaction logs go.
    dir: PathBuf,
    /// Which statements.
    kind: Script,
    /// Clients, when not one per concurrent request of the plan.
    clients: Option<usize>,
}

/// `pgbench --version`, or why it cannot run.
pub(crate) async fn available() -> Result<String, String> {
    match Command::new("pgbench").arg("--version").output().await {
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).trim().into()),
        Ok(out) => Err(format!(
            "pgbench --version failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("pgbench is not installed ({e})")),
    }
}

/// Which statements a pgbench transaction sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Script {
    /// The transaction the issue names as the floor, five statements: BEGIN, claim the key,
    /// insert the payment, store the response, COMMIT.
    Transaction,
    /// Every statement `idem serve` sends for a first request, five, in its three round
    /// trips (pgbench's `\startpipeline`): BEGIN with the claim (`ON CONFLICT DO NOTHING`,
    /// bounding its own wait with `lock_timeout` and restoring it); the payment (which retires
    /// an expired key's payment only when one holds the key); the response (failing if the
    /// key row is not the claim's) with COMMIT. What idem would cost if HTTP and the Rust side
    /// were free.
    IdemStatements,
}

impl Script {
    fn file(self) -> &'static str {
        match self {
            Script::Transaction => "transaction.sql",
            Script::IdemStatements => "idem-statements.sql",
        }
    }
}

/// The script: idem's own statements with its values, keys drawn at random so that no two
/// transactions collide. `now_ms` stands in for the service's clock.
pub(crate) fn script(kind: Script, now_ms: i64) -> String {
    let at = Values::at(now_ms);
    let statements = match kind {
        Script::Transaction => vec![
            BEGIN.to_owned(),
            claim(&at, false),
            payment(&at, ""),
            complete(&at),
            COMMIT.to_owned(),
        ],
        // idem serve inserts with ON CONFLICT DO NOTHING and retires an expired key's payment
        // only when the insert found one (never, with fresh keys).
        Script::IdemStatements => vec![
            PIPELINE.to_owned(),
            BEGIN.to_owned(),
            claim(&at, true),
            END_PIPELINE.to_owned(),
            payment(&at, "\nON CONFLICT (account_id, idem_key) DO NOTHING"),
            PIPELINE.to_owned(),
            complete_guarded(&at),
            COMMIT.to_owned(),
            END_PIPELINE.to_owned(),
        ],
    };
    let mut out = String::from("\\set n random(1, 9000000000000000000)\n");
    out.extend(statements);
    out
}

/// What idem serve writes for a payment at one instant, as SQL literals.
struct Values {
    now: String,
    expires: String,
    lease: String,
    /// The request's fingerprint.
    hash: String,
    /// The stored response's body, hex-encoded.
    body_hex: String,
    /// The stored response's headers, as JSON.
    headers: &'static str,
}

impl Values {
    fn at(now_ms: i64) -> Self {
        let ts = |ms: i64| {
            format!(
                "to_timestamp({ms}::bigint / 1000) + ({ms}::bigint % 1000) * interval '1 millisecond'"
            )
        };
        // About the size of idem serve's 201 body and its stored headers.
        let body = r#"{"id":"pay_0192f0c1d2e37c4a9b5e6f7a8b9c0d1e","amount":49900,"currency":"INR","status":"succeeded","created_at":1795992070553}"#;
        Self {
            now: ts(now_ms),
            expires: ts(now_ms + 24 * 60 * 60 * 1000),
            lease: ts(now_ms + 30 * 1000),
            hash: "ab".repeat(32),
            body_hex: body.bytes().map(|b| format!("{b:02x}")).collect(),
            headers: r#"[["content-type","application/json"],["location","/payments/pay_0192f0c1d2e37c4a9b5e6f7a8b9c0d1e"]]"#,
        }
    }
}

const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED;\n";
const COMMIT: &str = "COMMIT;\n";

/// The statements up to [`END_PIPELINE`] are sent before any answer is read, as tokio-postgres
/// sends the statements idem serve polls together.
const PIPELINE: &str = "\\startpipeline\n";
const END_PIPELINE: &str = "\\endpipeline\n";

/// What a bounded claim sets `lock_timeout` to first, keeping the value it had.
const BOUND_THE_WAIT: &str =
    "WITH previous AS MATERIALIZED (SELECT current_setting('lock_timeout') AS lock_timeout),
     bounded AS MATERIALIZED (
         SELECT previous.lock_timeout, set_config('lock_timeout', '10000ms', true) FROM previous),
     claimed AS (
";

/// What a bounded claim returns besides the token: `lock_timeout` set back.
const RESTORE_THE_WAIT: &str =
    ",\n    (SELECT set_config('lock_timeout', bounded.lock_timeout, true) FROM bounded)";

/// The claim of the key. idem serve's claim bounds its wait in the same statement and takes a
/// key no record holds, `ON CONFLICT DO NOTHING` (see TokioPgStore); the floor's transaction
/// claims without a bound and with PgStore's `DO UPDATE … WHERE`, as the issue's five
/// statements do.
fn claim(at: &Values, bounded: bool) -> String {
    let (prefix, open, close, conflict, returning, then) = if bounded {
        (
            BOUND_THE_WAIT,
            "SELECT ",
            " FROM bounded",
            NEW_ONLY,
            RESTORE_THE_WAIT,
            OR_READ,
        )
    } else {
        ("", "VALUES (", ")", REPLACING, "", "")
    };
    let Values {
        now,
        expires,
        lease,
        hash,
        ..
    } = at;
    format!(
        r"{prefix}INSERT INTO idempotency_keys AS k
    (account_id, idem_key, request_hash, status, created_at, expires_at, lease_until, fencing_token)
{open}'acct_alice', 'pgbench-' || :n, '\x{hash}'::bytea, 'in_progress', {now}, {expires}, {lease}, :n{close}
{conflict}
RETURNING fencing_token{returning}{then};
"
    )
}

/// PgStore's claim: it also replaces a record the claim may replace.
const REPLACING: &str = "ON CONFLICT (account_id, idem_key) DO UPDATE SET
    request_hash = excluded.request_hash, status = 'in_progress', response_code = NULL,
    response_headers = NULL, response_body = NULL, body_omitted = false,
    created_at = excluded.created_at, expires_at = excluded.expires_at,
    lease_until = excluded.lease_until, fencing_token = excluded.fencing_token
WHERE (k.expires_at <= excluded.created_at
       AND NOT (k.status = 'in_progress' AND k.lease_until > excluded.created_at))
   OR (true AND k.status = 'in_progress' AND k.lease_until <= excluded.created_at
       AND k.request_hash = excluded.request_hash)";

/// TokioPgStore's first claim: a key no record holds.
const NEW_ONLY: &str = "ON CONFLICT (account_id, idem_key) DO NOTHING";

/// What TokioPgStore's first claim reads when it did not insert: the record.
const OR_READ: &str = ")
SELECT true AS claimed, NULL::bytea AS request_hash, NULL::text AS status,
       NULL::int AS response_code, NULL::text AS response_headers, NULL::bytea AS response_body,
       NULL::bool AS body_omitted, NULL::bigint AS created_at, NULL::bigint AS expires_at,
       NULL::bigint AS lease_until, fencing_token
FROM claimed
UNION ALL
SELECT false, request_hash, status, response_code, response_headers::text AS response_headers,
       response_body, body_omitted,
       (extract(epoch FROM created_at) * 1000)::bigint AS created_at,
       (extract(epoch FROM expires_at) * 1000)::bigint AS expires_at,
       (extract(epoch FROM lease_until) * 1000)::bigint AS lease_until,
       fencing_token
FROM idempotency_keys
WHERE account_id = 'acct_alice' AND idem_key = 'pgbench-' || :n AND NOT EXISTS (SELECT FROM claimed)";

/// The business INSERT, then `on_conflict` (a clause, or nothing).
fn payment(at: &Values, on_conflict: &str) -> String {
    let now = &at.now;
    format!(
        "INSERT INTO payments (id, account_id, idem_key, amount, currency, status, reference, created_at)
VALUES ('pay_pgbench_' || :n, 'acct_alice', 'pgbench-' || :n, 49900, 'INR', 'succeeded', NULL, {now}){on_conflict};
"
    )
}

/// The response stored in the claimed key.
fn complete(at: &Values) -> String {
    format!("{};\n", update_response(at))
}

/// [`complete`] as TokioPgStore sends it: failing when the key row is not the claim's.
fn complete_guarded(at: &Values) -> String {
    format!(
        "WITH completed AS ({}\n  RETURNING 1)\nSELECT 1 / count(*)::int FROM completed;\n",
        update_response(at)
    )
}

fn update_response(at: &Values) -> String {
    let Values {
        headers, body_hex, ..
    } = at;
    format!(
        r"UPDATE idempotency_keys
SET status = 'completed', response_code = 201, response_headers = '{headers}'::jsonb,
    response_body = '\x{body_hex}'::bytea, body_omitted = false
WHERE account_id = 'acct_alice' AND idem_key = 'pgbench-' || :n AND fencing_token = :n
  AND status = 'in_progress'"
    )
}

impl Pgbench {
    /// Writes the script into `dir`.
    pub(crate) fn new(url: &str, dir: &Path, kind: Script, now_ms: i64) -> anyhow::Result<Self> {
        std::fs::write(dir.join(kind.file()), script(kind, now_ms))
            .context("cannot write the pgbench script")?;
        Ok(Self {
            url: url.to_owned(),
            dir: dir.to_owned(),
            kind,
            clients: None,
        })
    }

    /// The same workload on `clients` connections, whatever the plan's concurrency.
    pub(crate) fn with_clients(mut self, clients: usize) -> Self {
        self.clients = Some(clients);
        self
    }

    /// Runs pgbench with `plan.concurrency` clients (or its own number) for the warm-up and the window, and reads
    /// throughput and latencies of the window from its per-transaction log.
    pub(crate) async fn run(&self, plan: Plan, run: &str) -> anyhow::Result<Sample> {
        // -T takes whole seconds; one more so the window never reaches past the last
        // transaction (the first one ends a moment after pgbench starts its clock).
        let total = (plan.warmup + plan.duration).as_secs_f64().ceil() as u64 + 1;
        let prefix = self.dir.join(format!("log-{run}"));
        let clients = self.clients.unwrap_or(plan.concurrency);
        // -M prepared: sqlx prepares its statements too. -j 2: this machine's cores.
        let out = Command::new("pgbench")
            .args(["-n", "-M", "prepared", "-j", "2", "-l"])
            .arg("-c")
            .arg(clients.to_string())
            .arg("-T")
            .arg(total.to_string())
            .arg("-f")
            .arg(self.dir.join(self.kind.file()))
            .arg(format!("--log-prefix={}", prefix.display()))
            .arg(&self.url)
            .current_dir(&self.dir)
            .output()
            .await
            .context("cannot run pgbench")?;
        if !out.status.success() {
            anyhow::bail!(
                "pgbench failed: {}",
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .rev()
                    .take(5)
                    .collect::<Vec<_>>()
                    .join(" / ")
            );
        }
        let mut lines = String::new();
        let name = format!("log-{run}");
        for entry in std::fs::read_dir(&self.dir)?.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&name) {
                lines.push_str(&std::fs::read_to_string(entry.path())?);
                std::fs::remove_file(entry.path())?;
            }
        }
        parse_log(&lines, plan.warmup, plan.duration)
    }
}

/// Reads a pgbench transaction log (`client tx latency_us script epoch epoch_us`): the
/// transactions that ended within `duration` after `warmup` past the first one's end.
pub(crate) fn parse_log(log: &str, warmup: Duration, duration: Duration) -> anyhow::Result<Sample> {
    let mut done = Vec::new();
    let mut failed = Vec::new();
    for line in log.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(latency), Some(epoch), Some(micros)) =
            (fields.get(2), fields.get(4), fields.get(5))
        else {
            continue;
        };
        let end = epoch.parse::<f64>()? + micros.parse::<f64>()? / 1e6;
        match latency.parse::<u64>() {
            Ok(latency) => done.push((end, latency)),
            // "failed" or "skipped" in place of a latency.
            Err(_) => failed.push(end),
        }
    }
    let first = done
        .iter()
        .map(|(end, _)| *end)
        .fold(f64::INFINITY, f64::min);
    anyhow::ensure!(first.is_finite(), "pgbench completed no transaction");
    let from = first + warmup.as_secs_f64();
    let to = from + duration.as_secs_f64();
    let mut latencies = histogram();
    for (end, latency) in &done {
        if (from..to).contains(end) {
            latencies.saturating_record((*latency).max(1));
        }
    }
    let errors = failed
        .iter()
        .filter(|end| (from..to).contains(*end))
        .count() as u64;
    Ok(Sample::from_histogram(
        &latencies,
        duration,
        errors,
        (done.len() + failed.len()) as u64,
        (errors > 0).then(|| format!("{errors} transactions failed")),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_window_starts_after_the_warmup() {
        let log = "0 0 1000 0 100 0\n0 1 2000 0 100 500000\n1 0 3000 0 101 200000\n1 1 4000 0 102 100000\n";
        let sample = parse_log(log, Duration::from_millis(400), Duration::from_secs(1)).unwrap();
        // The window is [100.4, 101.4): the second and third transactions.
        assert_eq!(sample.requests, 2);
        assert!((sample.throughput - 2.0).abs() < 1e-9);
        assert_eq!(sample.total_requests, 4);
    }

    /// The statements of `kind`'s script, which must be `count`.
    fn statements(kind: Script, count: usize) -> Vec<String> {
        let script = script(kind, 1_795_992_070_553);
        let statements: Vec<String> = script
            .split(";\n")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        assert_eq!(statements.len(), count, "{script}");
        statements
    }

    #[test]
    fn idem_statements_are_five_in_three_round_trips() {
        // The last "statement" is the pipeline's end.
        let statements = statements(Script::IdemStatements, 6);
        assert!(statements[0].ends_with("\\startpipeline\nBEGIN ISOLATION LEVEL READ COMMITTED"));
        assert!(statements[1].starts_with("WITH previous AS MATERIALIZED"));
        assert!(
            statements[1].contains("FROM bounded\nON CONFLICT (account_id, idem_key) DO NOTHING")
        );
        assert!(statements[2].starts_with("\\endpipeline\nINSERT INTO payments"));
        assert!(statements[2].ends_with("ON CONFLICT (account_id, idem_key) DO NOTHING"));
        assert!(statements[3].starts_with("\\startpipeline\nWITH completed AS (UPDATE"));
        assert_eq!(statements[4], "COMMIT");
        assert_eq!(statements[5], "\\endpipeline");
    }

    #[test]
    fn the_script_claims_inserts_completes_and_commits() {
        let statements = statements(Script::Transaction, 5);
        assert!(statements[1].contains("INSERT INTO idempotency_keys"));
        assert!(statements[2].contains("INSERT INTO payments"));
        assert!(statements[3].starts_with("UPDATE idempotency_keys"));
        assert_eq!(statements[4], "COMMIT");
    }
}
