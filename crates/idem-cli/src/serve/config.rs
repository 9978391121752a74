//! What `idem serve` runs with: its flags, and the settings they are validated into.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{AccountId, Clock, Policy, SystemClock};

use super::provider::PausePoint;
use crate::runtime;

/// `idem serve` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// HTTPS instead of HTTP.
    #[command(flatten)]
    pub tls: crate::tls_args::ServerTlsArgs,
    /// Where records and payments live: `sqlite://PATH` (created on first start) or
    /// `postgres://USER@HOST/DB` (shared by any number of `idem serve` instances), or
    /// `postgres://USER@PRIMARY,STANDBY/DB` to follow the primary when a standby takes over.
    #[arg(long, default_value = "sqlite://idem.db")]
    pub database: String,
    /// PostgreSQL behind a pooler that lends sessions per transaction (PgBouncer in transaction
    /// mode): a URL of the same database that reaches PostgreSQL directly, for the
    /// notifications (`LISTEN`) that wake duplicate payouts waiting for an outcome. Without
    /// one there, waiting duplicates look at the database again every 250 ms instead.
    #[arg(long, value_name = "URL")]
    pub notify_database_url: Option<String>,
    /// A sandbox API token and the account it authenticates, `TOKEN=ACCOUNT`; repeatable.
    /// Without any, `sk_test_alice=acct_alice` and `sk_test_bob=acct_bob` are registered.
    #[arg(long = "token", value_name = "TOKEN=ACCOUNT", value_parser = parse_token)]
    pub tokens: Vec<(String, String)>,
    /// How long a key is remembered, in seconds (published at /idempotency-policy).
    #[arg(long, default_value_t = 24 * 60 * 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub retention_secs: u64,
    /// How long a duplicate waits for the original before 409, in seconds.
    #[arg(long, default_value_t = 10)]
    pub in_flight_wait_secs: u64,
    /// Accept POSTs without an Idempotency-Key (processed with no protection). For
    /// experiments such as `idem simulate`; never in production.
    #[arg(long)]
    pub key_optional: bool,
    /// The payment provider `POST /payouts` calls (see `idem fake-psp`). Without one, a fake
    /// provider runs inside the service.
    #[arg(long)]
    pub psp_url: Option<String>,
    /// How long the provider may take, in seconds. A payout's claim is held this much longer
    /// than its lease, so a crashed worker's call is over before anyone asks what it did.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub psp_timeout_secs: u64,
    /// How long a payout's claim holds without renewal, in seconds. A crashed worker's payout
    /// is reconciled with the provider once its lease and then the provider timeout have
    /// passed since its last renewal: no call it made can still be running by then.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_secs: u64,
    /// Let a duplicate payout wait up to this many seconds for the original's outcome
    /// (woken by a notification, LISTEN/NOTIFY on PostgreSQL) instead of answering 409 at
    /// once; 0 answers 409 at once.
    #[arg(long, default_value_t = 0)]
    pub wait_for_outcome_secs: u64,
    /// Freeze every payout at this point (for crash tests).
    #[arg(long, hide = true)]
    pub fault_pause: Option<PausePoint>,
    /// Announce each payment as a `payment.succeeded` event through the transactional outbox,
    /// and relay the outbox to this broker: `nats://HOST:PORT` (JetStream), `amqp://USER:PASS@HOST:PORT`
    /// (RabbitMQ) or `kafka://HOST:PORT`. Every instance on a PostgreSQL database may relay.
    #[arg(long, value_name = "URL")]
    pub broker: Option<String>,
    /// Keeps this deployment's streams, exchanges and topics apart from others' on the broker.
    #[arg(long, default_value = "idem")]
    pub broker_namespace: String,
    /// JetStream: how many servers keep a copy of the stream when it is created (3 on a
    /// three-node cluster; `--broker` then lists the servers, `nats://A,nats://B,nats://C`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=5))]
    pub broker_replicas: u16,
    /// How often the relay looks for events to publish, in milliseconds.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..))]
    pub relay_poll_ms: u64,
    /// Claim first, without the read that answers replays before anything is claimed: a
    /// payment costs one statement less, a replay a transaction instead of one read. For APIs
    /// whose retries are rare. The default on PostgreSQL, where a lost claim writes nothing
    /// and answers in the claim's one round trip.
    #[arg(long, conflicts_with = "replay_read")]
    pub no_replay_read: bool,
    /// Read before every claim, so that a replay is one read: the default on SQLite. On
    /// PostgreSQL a first payment then costs a round trip more (four), and a replay about a
    /// third of what a lost claim costs there: for APIs whose requests are mostly retries.
    #[arg(long)]
    pub replay_read: bool,
    /// PostgreSQL: how many connections this instance's requests share. Each request holds one
    /// for its three round trips, so with the database a round trip of R away an instance
    /// makes at most N / (3 × R) payments a second. Every instance opens up to this many, plus
    /// a few for its sweeper, outbox relay and wake-ups: keep the sum under the server's
    /// `max_connections`.
    #[arg(long, default_value_t = idem_store::DEFAULT_POOL_SIZE, value_parser = parse_pool_size)]
    pub db_pool_size: usize,
    /// Freeze the relay after it publishes an event and before it marks it sent (crash tests).
    #[arg(long, hide = true)]
    pub fault_pause_after_publish: bool,
    /// Serve the admin API (`/admin/keys…`: list, show and resolve keys) to requests that
    /// carry `Authorization: Bearer TOKEN`; also read from IDEM_ADMIN_TOKEN. Without it there
    /// is no admin API.
    #[arg(long, env = "IDEM_ADMIN_TOKEN", hide_env_values = true, value_parser = crate::admin::parse_admin_token)]
    pub admin_token: Option<crate::admin::api::AdminToken>,
}

fn parse_pool_size(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ 1..=10_000) => Ok(n),
        _ => Err(format!(
            "expected a number of connections from 1 to 10000, got {s:?}"
        )),
    }
}

fn parse_token(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((token, account)) if !token.is_empty() && !account.is_empty() => {
            Ok((token.to_owned(), account.to_owned()))
        }
        _ => Err(format!("expected TOKEN=ACCOUNT, got {s:?}")),
    }
}

/// Everything `serve` needs, validated.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The database URL.
    pub database: String,
    /// A direct URL of the same database for `LISTEN`, when `database` leads to a pooler.
    pub notify_database: Option<String>,
    /// Bearer token → account.
    pub tokens: HashMap<String, AccountId>,
    /// The idempotency policy.
    pub policy: Policy,
    /// The clock (tests move it).
    pub clock: Arc<dyn Clock>,
    /// The payment provider's base URL; `None` runs a fake one in-process.
    pub psp_url: Option<String>,
    /// How long the provider may take.
    pub psp_timeout: Duration,
    /// Where payouts freeze, for crash tests.
    pub fault_pause: Option<PausePoint>,
    /// How often stale payouts are reconciled (default: half the lease); a payout whose
    /// provider call failed is reconciled at once.
    pub reconcile_every: Option<Duration>,
    /// How long a duplicate payout waits for the original's outcome (zero: `409` at once).
    pub wait_for_outcome: Duration,
    /// How long a client may take to send a request head.
    pub head_timeout: Duration,
    /// Serve HTTPS with this certificate instead of plain HTTP.
    pub tls: Option<idem_gateway::ServerTls>,
    /// The broker the outbox relays to; `None` writes no events.
    pub broker: Option<idem_consumer::any::BrokerSettings>,
    /// How often the relay looks for events.
    pub relay_poll: Duration,
    /// Freeze the relay between publishing and marking sent, for crash tests.
    pub fault_pause_after_publish: bool,
    /// Whether replays are answered from a read before anything is claimed; `None`: as the
    /// store's layer does by default (read first on SQLite, claim first on PostgreSQL).
    pub replay_read: Option<bool>,
    /// How many PostgreSQL connections requests share.
    pub db_pool_size: usize,
    /// How often the sweeper looks for expired records (a minute; benchmarks look sooner).
    pub sweep_every: Duration,
    /// The admin API's token; `None`: no admin API.
    pub admin_token: Option<crate::admin::api::AdminToken>,
}

/// Where `idem serve` publishes its idempotency rules; its refusals link here.
pub const POLICY_PATH: &str = "/idempotency-policy";

/// The sandbox tokens registered when none are given.
pub const DEFAULT_TOKENS: [(&str, &str); 2] =
    [("sk_test_alice", "acct_alice"), ("sk_test_bob", "acct_bob")];

impl ServeConfig {
    /// Defaults: the sandbox tokens, the default policy, the system clock.
    pub fn new(database: impl Into<String>) -> Self {
        Self {
            database: database.into(),
            notify_database: None,
            tokens: DEFAULT_TOKENS
                .iter()
                .map(|(t, a)| (t.to_string(), AccountId::new(*a)))
                .collect(),
            policy: Policy::default(),
            clock: Arc::new(SystemClock),
            psp_url: None,
            psp_timeout: Duration::from_secs(10),
            fault_pause: None,
            reconcile_every: None,
            wait_for_outcome: Duration::ZERO,
            head_timeout: idem_gateway::server::HEAD_TIMEOUT,
            tls: None,
            broker: None,
            relay_poll: Duration::from_millis(200),
            fault_pause_after_publish: false,
            replay_read: None,
            db_pool_size: idem_store::DEFAULT_POOL_SIZE,
            sweep_every: idem_tower::DEFAULT_SWEEP_EVERY,
            admin_token: None,
        }
    }

    pub(super) fn from_args(args: &ServeArgs) -> Self {
        let mut config = Self::new(args.database.clone());
        config.notify_database = args.notify_database_url.clone();
        if !args.tokens.is_empty() {
            config.tokens = args
                .tokens
                .iter()
                .map(|(t, a)| (t.clone(), AccountId::new(a.clone())))
                .collect();
        }
        config.policy.retention = Duration::from_secs(args.retention_secs);
        config.policy.in_flight_wait = Duration::from_secs(args.in_flight_wait_secs);
        config.policy.require_key = !args.key_optional;
        config.policy.lease = Duration::from_secs(args.lease_secs);
        config.psp_url = args.psp_url.clone();
        config.psp_timeout = Duration::from_secs(args.psp_timeout_secs);
        config.fault_pause = args.fault_pause;
        config.wait_for_outcome = Duration::from_secs(args.wait_for_outcome_secs);
        config.broker = args.broker.as_ref().map(|url| {
            let mut settings = idem_consumer::any::BrokerSettings::new(
                url.clone(),
                args.broker_namespace.clone(),
                runtime::PAYMENTS_TOPIC,
                runtime::DEFAULT_CONSUMER,
            );
            settings.replicas = usize::from(args.broker_replicas);
            settings
        });
        config.relay_poll = Duration::from_millis(args.relay_poll_ms);
        config.fault_pause_after_publish = args.fault_pause_after_publish;
        config.replay_read = match (args.replay_read, args.no_replay_read) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        };
        config.db_pool_size = args.db_pool_size;
        config.admin_token = args.admin_token.clone();
        config
    }
}
