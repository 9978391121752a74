//! One broker chosen at run time by its URL: `nats://…` (JetStream), `amqp://…` or `amqps://…`
//! (RabbitMQ), `kafka://host:port[,host:port…]`.
//!
//! The CLI (`idem serve --broker URL`, `idem worker --broker URL`) knows only this module: it
//! fills a [`BrokerSettings`], checks the URL early with [`BrokerKind::from_url`] (a typed
//! [`UnsupportedBroker`] for anything else), and then works through [`AnyPublisher`],
//! [`AnySubscription`] and [`AnyDelivery`], which implement the same traits as the adapters
//! they wrap. What each broker does and does not guarantee is in its own module's docs.

use std::time::Duration;

use crate::received::Source;
use crate::{BrokerError, Delivery, Message, Published, Publisher, Subscription};

/// Re-exported from where the adapters' name checks live, so `any::InvalidName` still names it.
pub use crate::names::InvalidName;

#[cfg(feature = "amqp")]
use crate::amqp::{AmqpConfig, AmqpDelivery, AmqpPublisher, AmqpSubscription};
#[cfg(feature = "kafka")]
use crate::kafka::{KafkaConfig, KafkaDelivery, KafkaPublisher, KafkaSubscription};
#[cfg(feature = "nats")]
use crate::nats::{NatsConfig, NatsDelivery, NatsPublisher, NatsSubscription};

/// Which broker a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BrokerKind {
    /// NATS with JetStream: `nats://host:port`.
    Nats,
    /// RabbitMQ: `amqp://user:password@host:port/vhost` (or `amqps://`).
    Amqp,
    /// Kafka (or tansu): `kafka://host:port[,host:port…]`.
    Kafka,
}

impl BrokerKind {
    /// Reads the broker from the URL's scheme. Only the brokers compiled in (features `nats`,
    /// `amqp`, `kafka`) are accepted.
    ///
    /// # Errors
    ///
    /// [`UnsupportedBroker`] when the scheme names no broker compiled into this build.
    pub fn from_url(url: &str) -> Result<Self, UnsupportedBroker> {
        let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
        let kind = match scheme.to_ascii_lowercase().as_str() {
            #[cfg(feature = "nats")]
            "nats" | "tls" => Self::Nats,
            #[cfg(feature = "amqp")]
            "amqp" | "amqps" => Self::Amqp,
            #[cfg(feature = "kafka")]
            "kafka" => Self::Kafka,
            // The URL itself is left out of the error: it may hold a password.
            _ => {
                return Err(UnsupportedBroker {
                    scheme: scheme.to_owned(),
                });
            }
        };
        Ok(kind)
    }

    /// The name used in errors and logs: "nats", "amqp", "kafka".
    pub fn name(self) -> &'static str {
        match self {
            Self::Nats => "nats",
            Self::Amqp => "amqp",
            Self::Kafka => "kafka",
        }
    }
}

/// A broker URL whose scheme names no broker compiled into this build.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unsupported broker URL scheme {scheme:?}: expected nats://, amqp://, amqps:// or kafka:// \
     (only those whose feature is enabled)"
)]
pub struct UnsupportedBroker {
    /// The scheme found (empty when the URL has none).
    pub scheme: String,
}

/// Everything needed to reach one topic on one broker, whichever it is. Fields a broker has
/// no use for are ignored by it (Kafka has no `ack_wait`; only Kafka has `session_timeout`).
#[derive(Debug, Clone)]
pub struct BrokerSettings {
    /// The broker's URL; its scheme picks the adapter (see [`BrokerKind::from_url`]).
    pub url: String,
    /// Keeps one deployment's (or one test's) broker objects apart from another's:
    /// the JetStream stream `IDEM_{NAMESPACE}`, the AMQP exchange `{namespace}`, Kafka topics
    /// `{namespace}.{topic}`.
    pub namespace: String,
    /// The topic events are published to and consumed from (`payment.succeeded`).
    pub topic: String,
    /// The consumer group: a JetStream durable consumer, an AMQP queue, a Kafka group. Workers
    /// sharing a group share the work; each group gets every event.
    pub consumer_group: String,
    /// How many deliveries a message gets before the consumer dead-letters it (default 5).
    pub delivery_limit: u32,
    /// How long a delivery may stay unacknowledged before JetStream redelivers it
    /// (default 30 s). RabbitMQ and Kafka redeliver when the consumer's connection or
    /// session ends instead.
    pub ack_wait: Duration,
    /// JetStream only: how long a retried (nak'd) message waits before its redelivery
    /// (default none). RabbitMQ requeues at once; Kafka seeks back at once.
    pub retry_delay: Duration,
    /// How many unacknowledged deliveries one subscription may hold (default 1; see the
    /// adapters' docs for why more inflates delivery counts when a consumer crashes).
    pub prefetch: u16,
    /// Kafka only: how long the group waits for a silent consumer before giving its
    /// partitions to another (default 10 s).
    pub session_timeout: Duration,
    /// JetStream only: how many servers keep a copy of the stream (default 1; 3 on a
    /// three-node cluster). RabbitMQ's quorum queues and Kafka's topics take their replication
    /// from the broker's own settings.
    pub replicas: usize,
}

impl BrokerSettings {
    /// Settings with the defaults above.
    pub fn new(
        url: impl Into<String>,
        namespace: impl Into<String>,
        topic: impl Into<String>,
        consumer_group: impl Into<String>,
    ) -> Self {
        Self {
            url: url.into(),
            namespace: namespace.into(),
            topic: topic.into(),
            consumer_group: consumer_group.into(),
            delivery_limit: 5,
            ack_wait: Duration::from_secs(30),
            retry_delay: Duration::ZERO,
            prefetch: 1,
            session_timeout: Duration::from_secs(10),
            replicas: 1,
        }
    }

    /// Which broker the URL names.
    ///
    /// # Errors
    ///
    /// [`UnsupportedBroker`] as for [`BrokerKind::from_url`].
    pub fn kind(&self) -> Result<BrokerKind, UnsupportedBroker> {
        BrokerKind::from_url(&self.url)
    }

    fn checked_kind(&self) -> Result<BrokerKind, BrokerError> {
        self.kind()
            .map_err(|e| BrokerError::new("broker", "choosing a broker by URL scheme", e))
    }

    #[cfg(feature = "nats")]
    fn nats(&self) -> NatsConfig {
        NatsConfig {
            delivery_limit: self.delivery_limit,
            ack_wait: self.ack_wait,
            retry_delay: self.retry_delay,
            prefetch: usize::from(self.prefetch.max(1)),
            replicas: self.replicas.max(1),
            ..NatsConfig::new(&self.url, &self.namespace)
        }
    }

    #[cfg(feature = "amqp")]
    fn amqp(&self) -> AmqpConfig {
        AmqpConfig {
            delivery_limit: self.delivery_limit,
            prefetch: self.prefetch.max(1),
            ..AmqpConfig::new(&self.url, &self.namespace)
        }
    }

    #[cfg(feature = "kafka")]
    fn kafka(&self) -> KafkaConfig {
        // kafka://a:9092,b:9092 → bootstrap servers "a:9092,b:9092".
        let servers = self.url.split_once("://").map_or("", |(_, rest)| rest);
        KafkaConfig {
            session_timeout: self.session_timeout,
            ..KafkaConfig::new(servers.trim_end_matches('/'), &self.namespace)
        }
    }
}

/// Runs `$call` on the adapter's value that `$any` (an `AnyPublisher` or `AnyDelivery`) wraps,
/// bound to `$inner`, whichever broker it is: the one list of the compiled-in variants that
/// every forwarding method uses.
macro_rules! forward {
    ($any:expr, |$inner:ident| $call:expr) => {
        match $any {
            #[cfg(feature = "nats")]
            Self::Nats($inner) => $call,
            #[cfg(feature = "amqp")]
            Self::Amqp($inner) => $call,
            #[cfg(feature = "kafka")]
            Self::Kafka($inner) => $call,
        }
    };
}

/// A publisher for whichever broker the settings name.
#[derive(Debug)]
#[non_exhaustive]
pub enum AnyPublisher {
    /// NATS JetStream.
    #[cfg(feature = "nats")]
    Nats(NatsPublisher),
    /// RabbitMQ.
    #[cfg(feature = "amqp")]
    Amqp(AmqpPublisher),
    /// Kafka.
    #[cfg(feature = "kafka")]
    Kafka(KafkaPublisher),
}

impl AnyPublisher {
    /// Connects and declares what publishing needs. On RabbitMQ this also declares the
    /// settings' consumer group queue, so events published before the first worker starts
    /// are kept rather than dropped as unroutable.
    ///
    /// # Errors
    ///
    /// [`BrokerError`] when the URL names no broker compiled in, or the broker cannot be
    /// reached or refuses a declaration. A name the broker cannot take (namespace, group,
    /// topic) is one too.
    pub async fn connect(settings: &BrokerSettings) -> Result<Self, BrokerError> {
        Ok(match settings.checked_kind()? {
            #[cfg(feature = "nats")]
            BrokerKind::Nats => Self::Nats(NatsPublisher::connect(settings.nats()).await?),
            #[cfg(feature = "amqp")]
            BrokerKind::Amqp => {
                let config = settings.amqp();
                crate::amqp::declare(&config, &settings.consumer_group, &settings.topic).await?;
                Self::Amqp(AmqpPublisher::connect(config).await?)
            }
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => Self::Kafka(KafkaPublisher::connect(settings.kafka()).await?),
            #[allow(unreachable_patterns)]
            kind => return Err(not_compiled(kind)),
        })
    }
}

impl Publisher for AnyPublisher {
    async fn publish(&self, message: &Message) -> Result<Published, BrokerError> {
        forward!(self, |p| p.publish(message).await)
    }
}

/// A subscription on whichever broker the settings name.
#[derive(Debug)]
#[non_exhaustive]
pub enum AnySubscription {
    /// A JetStream durable pull consumer.
    #[cfg(feature = "nats")]
    Nats(NatsSubscription),
    /// A RabbitMQ quorum queue.
    #[cfg(feature = "amqp")]
    Amqp(AmqpSubscription),
    /// A Kafka consumer group member.
    #[cfg(feature = "kafka")]
    Kafka(KafkaSubscription),
}

impl AnySubscription {
    /// Joins the settings' consumer group on their topic, declaring what is missing.
    ///
    /// # Errors
    ///
    /// [`BrokerError`] when the URL names no broker compiled in, or the broker cannot be
    /// reached or refuses a declaration or the subscription.
    pub async fn connect(settings: &BrokerSettings) -> Result<Self, BrokerError> {
        Self::open(settings, Source::Events).await
    }

    /// Reads the messages the settings' consumer group dead-lettered on their topic. Each
    /// delivery's `dead_reason()` says why; acknowledging one removes it for good.
    ///
    /// # Errors
    ///
    /// [`BrokerError`] when the URL names no broker compiled in, or the broker cannot be
    /// reached or refuses the subscription.
    pub async fn dead_letters(settings: &BrokerSettings) -> Result<Self, BrokerError> {
        Self::open(settings, Source::DeadLetters).await
    }

    async fn open(settings: &BrokerSettings, source: Source) -> Result<Self, BrokerError> {
        let (group, topic) = (&settings.consumer_group, &settings.topic);
        Ok(match settings.checked_kind()? {
            #[cfg(feature = "nats")]
            BrokerKind::Nats => {
                Self::Nats(NatsSubscription::open(settings.nats(), group, topic, source).await?)
            }
            #[cfg(feature = "amqp")]
            BrokerKind::Amqp => {
                Self::Amqp(AmqpSubscription::open(settings.amqp(), group, topic, source).await?)
            }
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => {
                Self::Kafka(KafkaSubscription::open(settings.kafka(), group, topic, source).await?)
            }
            #[allow(unreachable_patterns)]
            kind => return Err(not_compiled(kind)),
        })
    }
}

impl Subscription for AnySubscription {
    type Delivery = AnyDelivery;

    async fn next(&mut self) -> Result<Option<AnyDelivery>, BrokerError> {
        Ok(match self {
            #[cfg(feature = "nats")]
            Self::Nats(s) => s.next().await?.map(AnyDelivery::Nats),
            #[cfg(feature = "amqp")]
            Self::Amqp(s) => s.next().await?.map(AnyDelivery::Amqp),
            #[cfg(feature = "kafka")]
            Self::Kafka(s) => s.next().await?.map(AnyDelivery::Kafka),
        })
    }
}

/// A delivery from whichever broker the settings name.
#[derive(Debug)]
#[non_exhaustive]
pub enum AnyDelivery {
    /// From JetStream.
    #[cfg(feature = "nats")]
    Nats(NatsDelivery),
    /// From RabbitMQ.
    #[cfg(feature = "amqp")]
    Amqp(AmqpDelivery),
    /// From Kafka.
    #[cfg(feature = "kafka")]
    Kafka(KafkaDelivery),
}

impl AnyDelivery {
    /// Why the message was dead-lettered, on deliveries read from a dead-letter destination.
    pub fn dead_reason(&self) -> Option<&str> {
        forward!(self, |d| d.dead_reason())
    }
}

impl Delivery for AnyDelivery {
    fn message(&self) -> &Message {
        forward!(self, |d| d.message())
    }

    fn attempt(&self) -> u32 {
        forward!(self, |d| d.attempt())
    }

    async fn ack(self) -> Result<(), BrokerError> {
        forward!(self, |d| d.ack().await)
    }

    async fn retry(self) -> Result<(), BrokerError> {
        forward!(self, |d| d.retry().await)
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        forward!(self, |d| d.dead_letter(reason).await)
    }
}

/// Deletes the broker objects the settings' namespace, topic and group use, dead letters
/// included: for tests and for tearing down a sandbox, never for a live deployment.
///
/// JetStream: the namespace's stream (every topic and group in it). RabbitMQ: the group's
/// queue and dead-letter queue, then the namespace's exchanges. Kafka: the topic, its
/// dead-letter topic and the group's committed offsets.
///
/// # Errors
///
/// [`BrokerError`] when the URL names no broker compiled in, or the broker cannot be reached
/// or refuses a deletion.
pub async fn delete_broker_objects(settings: &BrokerSettings) -> Result<(), BrokerError> {
    match settings.checked_kind()? {
        #[cfg(feature = "nats")]
        BrokerKind::Nats => crate::nats::delete_namespace(&settings.nats()).await,
        #[cfg(feature = "amqp")]
        BrokerKind::Amqp => {
            crate::amqp::delete(&settings.amqp(), &settings.consumer_group, &settings.topic).await
        }
        #[cfg(feature = "kafka")]
        BrokerKind::Kafka => {
            crate::kafka::delete(&settings.kafka(), &settings.consumer_group, &settings.topic).await
        }
        #[allow(unreachable_patterns)]
        kind => Err(not_compiled(kind)),
    }
}

fn not_compiled(kind: BrokerKind) -> BrokerError {
    BrokerError::new(
        kind.name(),
        "choosing a broker by URL scheme",
        UnsupportedBroker {
            scheme: kind.name().to_owned(),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_pick_brokers() {
        assert_eq!(
            BrokerKind::from_url("nats://127.0.0.1:4222"),
            Ok(BrokerKind::Nats)
        );
        assert_eq!(
            BrokerKind::from_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            Ok(BrokerKind::Amqp)
        );
        assert_eq!(
            BrokerKind::from_url("KAFKA://127.0.0.1:19092"),
            Ok(BrokerKind::Kafka)
        );
    }

    #[test]
    fn unknown_scheme_is_typed_and_hides_the_url() {
        let err = BrokerKind::from_url("redis://user:secret@host").unwrap_err();
        assert_eq!(err.scheme, "redis");
        assert!(!err.to_string().contains("secret"));
        assert_eq!(
            BrokerKind::from_url("127.0.0.1:4222").unwrap_err().scheme,
            ""
        );
    }
}
