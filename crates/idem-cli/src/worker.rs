//! `idem worker`: consumes `payment.succeeded` events and writes one receipt per event, however
//! often the broker delivers it (docs/contract.md §6).
//!
//! Each delivery runs one transaction: the inbox row `(consumer, event id)` and the receipt.
//! The ack goes to the broker only after that commit, so a crash in between means a
//! redelivery, and the redelivery finds the inbox row and writes nothing.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use futures_util::FutureExt as _;
use idem_consumer::any::{AnySubscription, BrokerSettings};
use idem_consumer::{
    Consumer, ConsumerStats, Handled, Handler, HandlerError, Inbox, Message, ProcessError,
    Processed,
};
use idem_core::{Clock, SystemClock};
use idem_store::{SqliteStore, TokioPgStore};
use serde::Deserialize;
use tokio::task::JoinHandle;

pub use crate::runtime::DEFAULT_CONSUMER;
use crate::runtime::{PAYMENTS_TOPIC, export_metrics, metrics_handle, shutdown_signal};
use crate::serve::{Receipt, ServiceBackend};
use crate::store_url::{StoreUrl, redact};

/// `idem worker` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The broker to consume from: `nats://HOST:PORT`, `amqp://USER:PASS@HOST:PORT` or
    /// `kafka://HOST:PORT`.
    #[arg(long, value_name = "URL")]
    pub broker: String,
    /// Where receipts and the inbox live: `sqlite://PATH` or `postgres://…` (usually the same
    /// database as `idem serve`'s).
    #[arg(long, default_value = "sqlite://idem.db")]
    pub database: String,
    /// The namespace `idem serve --broker-namespace` publishes under.
    #[arg(long, default_value = "idem")]
    pub broker_namespace: String,
    /// JetStream: how many servers keep a copy of the stream if this worker creates it; say
    /// what `idem serve --broker-replicas` says.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=5))]
    pub broker_replicas: u16,
    /// The consumer group: workers in one group share the events; the inbox is per group.
    #[arg(long, default_value = DEFAULT_CONSUMER)]
    pub consumer: String,
    /// Deliveries a message gets before it goes to the dead-letter destination.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub delivery_limit: u32,
    /// How long a delivery may go unacknowledged before the broker redelivers it (JetStream),
    /// in milliseconds.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..))]
    pub ack_wait_ms: u64,
    /// Kafka: how long the group waits for a silent worker before reassigning its partitions,
    /// in milliseconds.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1000..))]
    pub session_timeout_ms: u64,
    /// How long an event stays in the inbox after it was applied, in hours. A redelivery after
    /// that would apply it again: keep it longer than the broker keeps messages (JetStream's
    /// stream max age, Kafka's topic retention).
    #[arg(long, default_value_t = 7 * 24, value_parser = clap::value_parser!(u64).range(1..))]
    pub inbox_retention_hours: u64,
    /// Serve Prometheus metrics (`idem_consumer_duplicates_total`, …) at
    /// `http://ADDR/metrics`.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// Freeze after committing every Nth receipt, before its ack (crash tests).
    #[arg(long, hide = true, value_name = "N")]
    pub fault_pause_after_commit: Option<u64>,
}

/// Runs `idem worker` until Ctrl-C or SIGTERM.
pub async fn run(args: WorkerArgs) -> anyhow::Result<ExitCode> {
    match StoreUrl::parse_database(&args.database)? {
        StoreUrl::Sqlite(url) => work(SqliteStore::open_service(&url).await?, &args).await,
        StoreUrl::Postgres(url) => work(TokioPgStore::open_service(&url).await?, &args).await,
        StoreUrl::Redis(_) => unreachable!("parse_database refuses Redis"),
    }
}

async fn work<B: ServiceBackend>(store: B, args: &WorkerArgs) -> anyhow::Result<ExitCode> {
    let mut settings = BrokerSettings::new(
        args.broker.clone(),
        args.broker_namespace.clone(),
        PAYMENTS_TOPIC,
        args.consumer.clone(),
    );
    settings.delivery_limit = args.delivery_limit;
    settings.ack_wait = Duration::from_millis(args.ack_wait_ms);
    settings.session_timeout = Duration::from_millis(args.session_timeout_ms);
    settings.replicas = usize::from(args.broker_replicas);

    if let Some(addr) = args.metrics_listen {
        export_metrics(addr).await?;
    } else {
        // Counters still count (and show in the summary) without an exporter.
        metrics_handle();
    }
    let expiry = spawn_inbox_expiry(
        &store,
        Duration::from_secs(args.inbox_retention_hours * 3600),
    );

    let mut subscription = AnySubscription::connect(&settings)
        .await
        .with_context(|| format!("cannot subscribe on {}", redact(&settings.url)))?;
    eprintln!(
        "idem worker: consuming {} events from {} as {:?} (database {})",
        PAYMENTS_TOPIC,
        redact(&settings.url),
        args.consumer,
        redact(&args.database)
    );
    let handler = ReceiptWriter {
        store,
        inbox: Inbox::new(args.consumer.clone()),
        clock: Arc::new(SystemClock),
        pause_every: args.fault_pause_after_commit,
        applied: AtomicU64::new(0),
    };
    let consumer =
        Consumer::new(args.consumer.clone(), handler).with_delivery_limit(args.delivery_limit);
    let stats = consume(&consumer, &settings, &mut subscription).await;
    expiry.abort();
    eprintln!(
        "idem worker: {} receipts written, {} duplicates suppressed, {} retried, {} dead-lettered",
        stats.applied, stats.duplicates, stats.retried, stats.dead_lettered
    );
    Ok(ExitCode::SUCCESS)
}

/// Runs `consumer` until Ctrl-C or SIGTERM. A subscription that fails (a lost broker, a stream
/// between leaders) is opened again, after a pause that doubles up to 10 s, rather than ending
/// the worker: what it had not acknowledged is delivered again, and the inbox suppresses what
/// it had already applied.
async fn consume<H: Handler>(
    consumer: &Consumer<H>,
    settings: &BrokerSettings,
    subscription: &mut AnySubscription,
) -> ConsumerStats {
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut stats = ConsumerStats::default();
    loop {
        let Err(e) = consumer
            .run_counting(subscription, &mut shutdown, &mut stats)
            .await
        else {
            return stats;
        };
        tracing::warn!(error = %idem_core::ErrorChain(&e), "the subscription failed; subscribing again");
        let mut pause = Duration::from_millis(250);
        *subscription = loop {
            tokio::select! {
                () = &mut shutdown => return stats,
                () = tokio::time::sleep(pause) => {}
            }
            match AnySubscription::connect(settings).await {
                Ok(again) => break again,
                Err(e) => {
                    tracing::warn!(error = %idem_core::ErrorChain(&e), "subscribing again failed")
                }
            }
            pause = (pause * 2).min(Duration::from_secs(10));
        };
        tracing::info!(broker = %redact(&settings.url), "subscribed again");
    }
}

/// Old inbox rows go in batches, every hour, from any worker (deletes are idempotent).
fn spawn_inbox_expiry<B: ServiceBackend>(store: &B, retention: Duration) -> JoinHandle<()> {
    let pool = store.write_pool().clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(3600));
        loop {
            every.tick().await;
            let now = SystemClock.now().0;
            match Inbox::expire(&pool, retention, now, 1000).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(deleted = n, "expired old inbox rows"),
                Err(e) => tracing::warn!(error = %e, "expiring inbox rows failed"),
            }
        }
    })
}

/// The body of a `payment.succeeded` event.
#[derive(Debug, Deserialize)]
struct PaymentSucceeded {
    #[serde(rename = "type")]
    kind: String,
    payment_id: String,
    account_id: String,
    amount: i64,
    currency: String,
}

/// Writes a receipt per event, inside the inbox's transaction.
#[derive(Debug)]
struct ReceiptWriter<B> {
    store: B,
    inbox: Inbox,
    clock: Arc<dyn Clock>,
    pause_every: Option<u64>,
    applied: AtomicU64,
}

impl<B: ServiceBackend> Handler for ReceiptWriter<B> {
    async fn handle(&self, message: &Message) -> Result<Handled, HandlerError> {
        let event: PaymentSucceeded = serde_json::from_slice(&message.payload)
            .map_err(|e| HandlerError::Poison(format!("not a payment event: {e}")))?;
        if event.kind != "payment.succeeded" {
            return Err(HandlerError::Poison(format!(
                "unexpected event type {:?}",
                event.kind
            )));
        }
        let now = self.clock.now().0;
        let receipt = Receipt {
            event_id: message.id.to_string(),
            payment_id: event.payment_id,
            account_id: event.account_id,
            amount: event.amount,
            currency: event.currency,
            created_at: now,
        };
        let payment_id = receipt.payment_id.clone();
        let processed = self
            .inbox
            .process(self.store.write_pool(), &message.id, now, move |conn| {
                async move { B::insert_receipt(conn, &receipt).await }.boxed()
            })
            .await
            .map_err(|e| {
                // On PostgreSQL, a primary gone or turned read-only is looked for again.
                if let ProcessError::Database { source, .. }
                | ProcessError::Handler { source, .. } = &e
                {
                    self.store.failed(source);
                }
                HandlerError::Transient(Box::new(e))
            })?;
        match processed {
            Processed::Applied(()) => {
                let n = self.applied.fetch_add(1, Ordering::Relaxed) + 1;
                tracing::debug!(event_id = %message.id, %payment_id, "receipt written");
                if self
                    .pause_every
                    .is_some_and(|every| n.is_multiple_of(every.max(1)))
                {
                    eprintln!("fault: paused after committing {} (not acked)", message.id);
                    std::future::pending::<()>().await;
                }
                Ok(Handled::Applied)
            }
            Processed::AlreadyDone => Ok(Handled::Duplicate),
        }
    }
}
