//! Exactly-once receipts over at-least-once brokers (docs/contract.md §6), with real processes on the real
//! brokers: `idem worker` killed with SIGKILL after committing a receipt and before its ack,
//! `idem serve`'s relay killed after publishing and before marking the event sent, and two
//! relays with two workers at once. Every test counts receipts per event in the database.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::ALICE;
use futures_util::StreamExt as _;
use idem_consumer::any::{AnyPublisher, BrokerSettings, delete_broker_objects};
use idem_consumer::{EventId, Message, Publisher as _};
use idem_testkit::postgres::PgTestDatabase as PgDatabase;

const NATS: &str = "nats://127.0.0.1:4222";
const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const KAFKA: &str = "kafka://127.0.0.1:19092";

/// How long any one awaited event may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(120);

/// The broker objects of one test (a namespace of its own); deleted when dropped.
struct Namespace {
    settings: BrokerSettings,
}

impl Namespace {
    fn new(url: &str) -> Self {
        idem_testkit::require(match url {
            NATS => idem_testkit::Service::Nats,
            AMQP => idem_testkit::Service::RabbitMq,
            _ => idem_testkit::Service::Kafka,
        });
        let name = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        Self {
            settings: BrokerSettings::new(url, name, "payments", "receipts"),
        }
    }

    fn name(&self) -> &str {
        &self.settings.namespace
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let settings = self.settings.clone();
        // Drop cannot await; a runtime of its own on a thread of its own can.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for clean-up");
            runtime.block_on(async {
                if let Err(e) = delete_broker_objects(&settings).await {
                    eprintln!("could not delete the test's broker objects: {e}");
                }
            });
        })
        .join();
    }
}

/// A real `idem` child process whose stderr lines arrive on a channel (and are kept).
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    log: Arc<Mutex<Vec<String>>>,
    stdout_url: Option<String>,
}

impl Proc {
    fn spawn(args: &[&str]) -> Self {
        Self::spawn_with(args, &[])
    }

    /// [`spawn`](Self::spawn) with `env` set for the child.
    fn spawn_with(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn idem");
        let (tx, lines) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = BufReader::new(child.stderr.take().expect("piped stderr")).lines();
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in stderr.map_while(Result::ok) {
                kept.lock().unwrap().push(line.clone());
                let _ = tx.send(line);
            }
        });
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let stdout_url = if args[0] == "serve" {
            let first = stdout
                .next()
                .expect("idem serve says where it listens")
                .expect("a line");
            first
                .split_whitespace()
                .find(|w| w.starts_with("http://"))
                .map(str::to_owned)
        } else {
            None
        };
        // Keep reading stdout: a closed pipe would kill the child at its next line.
        std::thread::spawn(move || stdout.for_each(drop));
        Self {
            child,
            lines,
            log,
            stdout_url,
        }
    }

    fn url(&self) -> &str {
        self.stdout_url.as_deref().expect("a serve process")
    }

    /// Waits for a stderr line containing `needle`.
    fn await_line(&self, needle: &str) -> String {
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            if let Ok(line) = self.lines.recv_timeout(Duration::from_millis(100))
                && line.contains(needle)
            {
                return line;
            }
        }
        panic!("idem never printed {needle:?}; its log:\n{}", self.log());
    }

    /// How many stderr lines so far contain `needle`.
    fn count_lines(&self, needle: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// SIGKILL, as `kill -9`: no shutdown, no ack, no clean-up.
    fn kill9(&mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    /// SIGTERM and wait: the worker prints its summary on the way out.
    fn terminate(&mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().expect("poll").is_none() {
            assert!(Instant::now() < deadline, "idem did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `idem SUBCOMMAND` on `broker` in `namespace` and on `database`, with `flags`, then `extra`.
fn spawn_on(
    subcommand: &str,
    broker: &str,
    namespace: &str,
    database: &str,
    flags: &[&str],
    extra: &[&str],
) -> Proc {
    let mut args = vec![
        subcommand,
        "--broker",
        broker,
        "--broker-namespace",
        namespace,
        "--database",
        database,
    ];
    args.extend_from_slice(flags);
    args.extend_from_slice(extra);
    Proc::spawn(&args)
}

fn worker(broker: &str, namespace: &str, database: &str, extra: &[&str]) -> Proc {
    // A delivery left unacknowledged by a killed worker comes back within a second.
    let flags = ["--ack-wait-ms", "1000", "--session-timeout-ms", "6000"];
    let proc = spawn_on("worker", broker, namespace, database, &flags, extra);
    proc.await_line("idem worker: consuming");
    proc
}

fn serve(broker: &str, namespace: &str, database: &str, extra: &[&str]) -> Proc {
    let flags = ["--listen", "127.0.0.1:0", "--relay-poll-ms", "50"];
    spawn_on("serve", broker, namespace, database, &flags, extra)
}

/// The test's view of the database the service and the workers share.
enum Db {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

async fn pool(database: &str) -> Db {
    if database.starts_with("sqlite:") {
        Db::Sqlite(
            sqlx::SqlitePool::connect(database)
                .await
                .expect("open SQLite"),
        )
    } else {
        Db::Postgres(
            sqlx::PgPool::connect(database)
                .await
                .expect("open PostgreSQL"),
        )
    }
}

/// Runs a `SELECT count(*) …` (written by the test, never from input).
async fn count(db: &Db, sql: &str) -> i64 {
    let sql = sqlx::AssertSqlSafe(sql.to_owned());
    match db {
        Db::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
        Db::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
    }
    .expect("count")
}

/// Runs a statement written by the test.
async fn execute(db: &Db, sql: &str) {
    let sql = sqlx::AssertSqlSafe(sql.to_owned());
    match db {
        Db::Sqlite(pool) => sqlx::query(sql).execute(pool).await.map(drop),
        Db::Postgres(pool) => sqlx::query(sql).execute(pool).await.map(drop),
    }
    .expect("execute")
}

/// Waits until the database holds `n` receipts (the worker commits them as it goes). Fails
/// when no receipt arrives for [`PATIENCE`]: a stalled worker, not a slow machine, is the bug.
async fn await_receipts(pool: &Db, n: i64, workers: &[&Proc]) {
    let mut deadline = Instant::now() + PATIENCE;
    let mut had = -1;
    loop {
        let have = count(pool, "SELECT count(*) FROM receipts").await;
        if have >= n {
            return;
        }
        if have > had {
            had = have;
            deadline = Instant::now() + PATIENCE;
        }
        if Instant::now() >= deadline {
            panic!(
                "{have} of {n} receipts; missing {}; the workers' logs:\n{}",
                missing_payments(pool, n).await,
                workers
                    .iter()
                    .map(|w| w.log())
                    .collect::<Vec<_>>()
                    .join("\n----\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Which of the payments `pay_00000000` … the receipts lack, as ranges (for failure messages).
async fn missing_payments(pool: &Db, n: i64) -> String {
    let sql = sqlx::AssertSqlSafe("SELECT payment_id FROM receipts".to_owned());
    let ids: Vec<String> = match pool {
        Db::Sqlite(p) => sqlx::query_scalar(sql).fetch_all(p).await,
        Db::Postgres(p) => sqlx::query_scalar(sql).fetch_all(p).await,
    }
    .unwrap_or_default();
    let have: std::collections::HashSet<String> = ids.into_iter().collect();
    let missing: Vec<i64> = (0..n)
        .filter(|i| !have.contains(&format!("pay_{i:08}")))
        .collect();
    let mut ranges = Vec::new();
    let mut i = 0;
    while i < missing.len() {
        let start = missing[i];
        while i + 1 < missing.len() && missing[i + 1] == missing[i] + 1 {
            i += 1;
        }
        ranges.push(format!("{start}..={}", missing[i]));
        i += 1;
    }
    ranges.join(", ")
}

/// Exactly one receipt per event, for `n` events.
async fn assert_one_receipt_per_event(pool: &Db, n: i64) {
    assert_eq!(count(pool, "SELECT count(*) FROM receipts").await, n);
    assert_eq!(
        count(pool, "SELECT count(DISTINCT event_id) FROM receipts").await,
        n
    );
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM (SELECT event_id FROM receipts GROUP BY event_id HAVING count(*) > 1) AS twice"
        )
        .await,
        0
    );
    assert_eq!(
        count(pool, "SELECT count(*) FROM processed_events").await,
        n
    );
}

fn payment_event(i: usize) -> Message {
    let payment = format!("pay_{i:08}");
    Message {
        id: EventId::new(format!("{payment}.succeeded")).unwrap(),
        topic: "payments".into(),
        payload: serde_json::json!({
            "type": "payment.succeeded",
            "payment_id": payment,
            "account_id": "acct_alice",
            "amount": 100 + i,
            "currency": "EUR",
            "created_at": 0,
        })
        .to_string()
        .into_bytes(),
    }
}

/// Publishes `n` payment events, `in_flight` at a time.
async fn publish_events(settings: &BrokerSettings, n: usize, in_flight: usize) {
    let publisher = AnyPublisher::connect(settings).await.expect("connect");
    let publisher = &publisher;
    futures_util::stream::iter(0..n)
        .map(|i| async move {
            publisher
                .publish(&payment_event(i))
                .await
                .unwrap_or_else(|e| panic!("publish event {i}: {e}"))
        })
        .buffer_unordered(in_flight)
        .for_each(|_| async {})
        .await;
}

/// 10,000 events; the worker is killed with SIGKILL right after committing a receipt and
/// before acknowledging it, `kills` times. The broker redelivers each unacknowledged event,
/// the inbox turns each redelivery into "already done", and every event has one receipt.
async fn worker_killed_between_commit_and_ack(broker: &str, kills: usize) {
    const EVENTS: usize = 10_000;
    let namespace = Namespace::new(broker);
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("idem.db").display());
    // NATS and RabbitMQ drop events for want of a consumer: a worker declares its
    // subscription before anything is published. Kafka keeps them (the publisher creates the
    // topic and a new group starts at the earliest offset), and there a worker stopped while
    // its group is still forming must be avoided: tansu's coordinator keeps a member that left
    // mid-join as the group's leader, and every later member waits on that leader for ever
    // (tansu 0.6, `leave` in the forming state; real Kafka ends the rebalance).
    if broker != KAFKA {
        let mut first = worker(broker, namespace.name(), &database, &[]);
        first.terminate();
    }
    // tansu (our Kafka) resumes a group at the record batch after the one holding the
    // committed offset, skipping the rest of that batch; one record per batch, as idem's relay
    // publishes, keeps its resumption exact. Real Kafka needs no such care.
    let in_flight = if broker == KAFKA { 1 } else { 64 };
    publish_events(&namespace.settings, EVENTS, in_flight).await;

    let mut duplicates = 0;
    for kill in 0..kills {
        // Kill at a different count each time: somewhere in the next few hundred events.
        let every = (150 + 97 * kill % 400).to_string();
        let mut w = worker(
            broker,
            namespace.name(),
            &database,
            &["--fault-pause-after-commit", &every],
        );
        w.await_line("fault: paused after committing");
        w.kill9();
        duplicates += w.count_lines("duplicate suppressed");
    }
    let db = pool(&database).await;
    let mut last = worker(broker, namespace.name(), &database, &[]);
    await_receipts(&db, EVENTS as i64, &[&last]).await;
    last.terminate();
    duplicates += last.count_lines("duplicate suppressed");

    assert_one_receipt_per_event(&db, EVENTS as i64).await;
    // Each kill left a committed receipt unacknowledged; its redelivery was suppressed.
    assert!(
        duplicates >= kills,
        "{kills} kills but only {duplicates} duplicates suppressed"
    );
    let summary = last.await_line("idem worker:");
    assert!(summary.contains("receipts written"), "{summary}");
}

/// `idem worker` exports a span per delivery over OTLP (docs/contract.md §15): an event
/// published twice (RabbitMQ keeps both copies) is one `applied` and one `duplicate`
/// `idempotency.message` span, from the service `idem-worker`.
#[tokio::test(flavor = "multi_thread")]
async fn a_worker_exports_a_span_per_delivery() {
    let (receiver, endpoint) = crate::telemetry::Receiver::http().await;
    let namespace = Namespace::new(AMQP);
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("idem.db").display());
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50"),
    ];
    let args = [
        "worker",
        "--broker",
        AMQP,
        "--broker-namespace",
        namespace.name(),
        "--database",
        &database,
    ];
    let worker = Proc::spawn_with(&args, &env);
    worker.await_line("idem worker: consuming");
    publish_events(&namespace.settings, 1, 1).await;
    publish_events(&namespace.settings, 1, 1).await;
    let spans = receiver
        .spans_until(|spans| {
            spans
                .iter()
                .filter(|s| s.name == "idempotency.message")
                .count()
                >= 2
        })
        .await;
    let mut outcomes: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "idempotency.message")
        .map(|s| {
            assert_eq!(s.service, "idem-worker");
            assert_eq!(s.attribute("idempotency.mode"), Some("inbox"));
            s.attribute("idempotency.outcome").unwrap_or("none")
        })
        .collect();
    outcomes.sort_unstable();
    assert_eq!(outcomes, ["applied", "duplicate"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_worker_killed_between_commit_and_ack_writes_each_receipt_once() {
    worker_killed_between_commit_and_ack(NATS, 12).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_worker_killed_between_commit_and_ack_writes_each_receipt_once() {
    worker_killed_between_commit_and_ack(AMQP, 12).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_worker_killed_between_commit_and_ack_writes_each_receipt_once() {
    // Each restart waits for the group to drop the dead member (the session timeout), so
    // two kills keep the claim tested in fewer seconds than twelve.
    worker_killed_between_commit_and_ack(KAFKA, 2).await;
}

/// `idem serve`'s relay publishes a payment's event and is killed before it marks it sent.
/// The restarted relay publishes it again; the worker writes one receipt. Returns the
/// restarted server's and the worker's processes for broker-specific checks, and the namespace
/// to drop after them.
async fn relay_killed_between_publish_and_mark(broker: &str) -> (Proc, Proc, Namespace) {
    let namespace = Namespace::new(broker);
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("idem.db").display());
    let w = worker(broker, namespace.name(), &database, &[]);

    let mut crashing = serve(
        broker,
        namespace.name(),
        &database,
        &["--fault-pause-after-publish"],
    );
    let created = reqwest::Client::new()
        .post(format!("{}/payments", crashing.url()))
        .bearer_auth(ALICE)
        .header("idempotency-key", "relay-crash-1")
        .header("content-type", "application/json")
        .body(r#"{"amount": 4990, "currency": "EUR"}"#)
        .send()
        .await
        .expect("create a payment");
    assert_eq!(created.status(), 201);
    let payment: serde_json::Value = created.json().await.unwrap();
    crashing.await_line("fault: paused after publishing");
    crashing.kill9();

    let db = pool(&database).await;
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox WHERE sent_at IS NULL").await,
        1,
        "the killed relay never marked the event sent"
    );
    let restarted = serve(broker, namespace.name(), &database, &[]);
    await_receipts(&db, 1, &[&w]).await;
    let deadline = Instant::now() + PATIENCE;
    while count(&db, "SELECT count(*) FROM outbox WHERE sent_at IS NULL").await > 0 {
        assert!(
            Instant::now() < deadline,
            "the relay never marked the event sent"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let id = payment["id"].as_str().unwrap();
    assert!(id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
    let sql = format!("SELECT count(*) FROM receipts WHERE payment_id = '{id}'");
    assert_eq!(count(&db, &sql).await, 1);
    (restarted, w, namespace)
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_relay_killed_after_publishing_is_deduplicated_by_the_duplicate_window() {
    let (restarted, w, _namespace) = relay_killed_between_publish_and_mark(NATS).await;
    // JetStream recognised the second publish by its Nats-Msg-Id and dropped it.
    restarted.await_line("the broker already had this event");
    assert_eq!(w.count_lines("duplicate suppressed"), 0, "{}", w.log());
}

#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_relay_killed_after_publishing_is_deduplicated_by_the_inbox() {
    let (_restarted, w, _namespace) = relay_killed_between_publish_and_mark(AMQP).await;
    // RabbitMQ has no duplicate window: both copies arrive and the inbox drops the second.
    w.await_line("duplicate suppressed");
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_relay_killed_after_publishing_is_deduplicated_by_the_inbox() {
    let (_restarted, w, _namespace) = relay_killed_between_publish_and_mark(KAFKA).await;
    // A new producer session is a new producer id: Kafka's idempotence does not span it.
    w.await_line("duplicate suppressed");
}

/// Makes the payments `range` (key `{prefix}-{i}`, amount `100 + i`), spread over `urls` in
/// turn, `in_flight` at a time; each must be created.
async fn make_payments(
    urls: &[String],
    prefix: &str,
    range: std::ops::Range<usize>,
    in_flight: usize,
) {
    let client = reqwest::Client::new();
    futures_util::stream::iter(range)
        .map(|i| {
            let request = client
                .post(format!("{}/payments", urls[i % urls.len()]))
                .bearer_auth(ALICE)
                .header("idempotency-key", format!("{prefix}-{i}"))
                .header("content-type", "application/json")
                .body(format!(r#"{{"amount": {}, "currency": "EUR"}}"#, 100 + i));
            async move {
                let response = request.send().await.expect("create a payment");
                assert_eq!(response.status(), 201);
            }
        })
        .buffer_unordered(in_flight)
        .for_each(|_| async {})
        .await;
}

/// Two `idem serve` instances on one PostgreSQL database, each relaying the outbox, and two
/// workers in one group: every payment's receipt is written once, none is lost.
async fn two_relays_two_workers(broker: &str) {
    two_relays_two_workers_on(broker, None).await;
}

/// [`two_relays_two_workers`], the instances reaching the database through `pooler` when
/// given (the test reads it directly).
async fn two_relays_two_workers_on(
    broker: &str,
    pooler: Option<&idem_testkit::pgbouncer::PgBouncer>,
) {
    const PAYMENTS: usize = 300;
    let namespace = Namespace::new(broker);
    let database = PgDatabase::create().await;
    let direct = database.url().to_owned();
    let url = pooler.map_or_else(|| direct.clone(), |pooler| pooler.url_for(&direct));
    let w1 = worker(broker, namespace.name(), &url, &[]);
    let w2 = worker(broker, namespace.name(), &url, &[]);
    let s1 = serve(broker, namespace.name(), &url, &[]);
    let s2 = serve(broker, namespace.name(), &url, &[]);
    let urls = [s1.url().to_owned(), s2.url().to_owned()];
    make_payments(&urls, "two-relays", 0..PAYMENTS, 32).await;

    let db = pool(&direct).await;
    await_receipts(&db, PAYMENTS as i64, &[&w1, &w2]).await;
    assert_one_receipt_per_event(&db, PAYMENTS as i64).await;
    assert_eq!(
        count(&db, "SELECT count(*) FROM payments").await,
        PAYMENTS as i64
    );
    // Each receipt names its own payment.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM receipts r JOIN payments p ON p.id = r.payment_id"
        )
        .await,
        PAYMENTS as i64
    );
    drop((s1, s2, w1, w2));
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_two_relays_and_two_workers_deliver_every_event_once() {
    two_relays_two_workers(NATS).await;
}

/// The same through PgBouncer 1.18 in transaction pooling mode: the relays, the workers' inbox
/// and the service's migrations leave nothing on a server session past a transaction.
#[tokio::test(flavor = "multi_thread")]
async fn nats_two_relays_and_two_workers_deliver_every_event_once_through_pgbouncer() {
    let pooler = idem_testkit::pgbouncer::PgBouncer::start(40);
    two_relays_two_workers_on(NATS, Some(&pooler)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_two_relays_and_two_workers_deliver_every_event_once() {
    two_relays_two_workers(AMQP).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_two_relays_and_two_workers_deliver_every_event_once() {
    two_relays_two_workers(KAFKA).await;
}

/// The worker deletes inbox rows older than `--inbox-retention-hours` (at start, then hourly)
/// and keeps the recent ones.
#[tokio::test(flavor = "multi_thread")]
async fn the_worker_expires_old_inbox_rows_and_keeps_recent_ones() {
    let namespace = Namespace::new(NATS);
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite://{}", dir.path().join("idem.db").display());
    let mut first = worker(NATS, namespace.name(), &database, &[]);
    first.terminate();
    let db = pool(&database).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    execute(
        &db,
        &format!(
            "INSERT INTO processed_events (consumer, event_id, processed_at) VALUES
             ('receipts', 'evt_old', 0), ('receipts', 'evt_recent', {now})"
        ),
    )
    .await;
    let w = worker(
        NATS,
        namespace.name(),
        &database,
        &["--inbox-retention-hours", "1"],
    );
    // The first expiry runs as the worker starts (it may print before "consuming").
    let old = "SELECT count(*) FROM processed_events WHERE event_id = 'evt_old'";
    let deadline = Instant::now() + PATIENCE;
    while count(&db, old).await > 0 {
        assert!(Instant::now() < deadline, "never expired:\n{}", w.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The worker logs the expiry after its DELETE commits, and a thread of this test copies
    // the line from its stderr: it may come after the row is gone.
    let expired = "expired old inbox rows";
    while w.count_lines(expired) == 0 {
        assert!(
            Instant::now() < deadline,
            "never logged {expired:?}:\n{}",
            w.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(w.count_lines(expired), 1, "{}", w.log());
    assert_eq!(count(&db, old).await, 0);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM processed_events WHERE event_id = 'evt_recent'"
        )
        .await,
        1
    );
}

/// A three-node JetStream cluster, the stream replicated on all three: `idem serve`'s relay and
/// `idem worker` keep going while the stream's leader is killed with SIGKILL (every payment made
/// meanwhile gets its receipt from the two nodes left) and after it is started again, and every
/// payment gets exactly one receipt.
#[tokio::test(flavor = "multi_thread")]
async fn jetstream_leader_killed_on_a_three_node_cluster_every_payment_gets_one_receipt() {
    const BEFORE: usize = 200;
    const DURING: usize = 200;
    const AFTER: usize = 50;
    let mut cluster = idem_testkit::nats_cluster::NatsCluster::start(3);
    let broker = cluster.url();
    let namespace = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let stream = format!("IDEM_{}", namespace.to_ascii_uppercase());
    let database = PgDatabase::create().await;
    let url = database.url().to_owned();
    let replicated = ["--broker-replicas", "3"];
    let w = worker(&broker, &namespace, &url, &replicated);
    let s = serve(&broker, &namespace, &url, &replicated);
    let urls = [s.url().to_owned()];
    let pay = |payments| make_payments(&urls, "cluster-pay", payments, 16);
    let db = pool(&url).await;
    pay(0..BEFORE).await;
    await_receipts(&db, (BEFORE / 2) as i64, &[&w]).await;

    let leader = cluster.stream_leader(&stream);
    let in_flight = count(&db, "SELECT count(*) FROM receipts").await;
    cluster.kill(&leader);
    let killed = Instant::now();
    pay(BEFORE..BEFORE + DURING).await;
    await_receipts(&db, (BEFORE + DURING) as i64, &[&w]).await;
    let caught_up = killed.elapsed();
    let new_leader = cluster.stream_leader(&stream);
    assert_ne!(new_leader, leader, "a surviving node leads the stream");

    cluster.restart(&leader);
    pay(BEFORE + DURING..BEFORE + DURING + AFTER).await;
    let total = (BEFORE + DURING + AFTER) as i64;
    await_receipts(&db, total, &[&w]).await;
    assert_one_receipt_per_event(&db, total).await;
    eprintln!(
        "jetstream cluster: {total} payments, {total} receipts, one each; the stream's leader \
         {leader} killed with {in_flight} receipts written, {new_leader} led next; the {DURING} \
         payments made without it all had receipts {:.1} s after the kill; {leader} restarted \
         and {AFTER} more went through; duplicates suppressed by the inbox: {}",
        caught_up.as_secs_f64(),
        w.count_lines("duplicate suppressed")
    );
}
