//! RabbitMQ (AMQP 0-9-1): a direct exchange per namespace, a quorum queue per consumer group
//! and topic, and a dead-letter queue beside it.
//!
//! **What RabbitMQ guarantees.** With publisher confirms on, a publish returns once the broker
//! has taken the message (persistent, into a durable quorum queue, replicated where there are
//! replicas); a nack or a returned (unroutable) message is an error, so the outbox relay tries
//! again. A delivery not acknowledged before its channel closes (a consumer crash) is
//! delivered again. The quorum queue counts returns itself (`x-delivery-count`), so
//! [`Delivery::attempt`] is the broker's own count and survives consumer crashes, and its
//! `x-delivery-limit` dead-letters a message returned too often even when no consumer lived
//! to do it (RabbitMQ 3.10 here; quorum queues have had both since 3.8).
//!
//! **What it does not.** RabbitMQ has no duplicate window: a relay that crashed between the
//! confirm and marking its outbox row sent publishes the event again and the queue holds it
//! twice ([`Published::Duplicate`] is never answered). The inbox (`processed_events`) dedups
//! that, as it dedups redeliveries after a consumer crash. Broker-side dead-lettering on the
//! delivery limit is at most once (RabbitMQ's default for quorum queues).
//!
//! **Prefetch.** Messages prefetched but not yet handled are returned when a consumer crashes,
//! and each return counts towards the delivery limit. The default prefetch is therefore 1, so
//! a crash only counts against the message being handled.
//!
//! **Topology.** Events go to the exchange `{namespace}` with the topic as routing key. Each
//! consumer group has the queue `{namespace}.{group}.{topic}` bound to it; dead letters go
//! through the exchange `{namespace}.dead` into `{namespace}.{group}.{topic}.dead`, with the
//! original `message-id` and an `idem-dead-reason` header. An event published before any
//! group's queue exists is unroutable and answered with an error, so declare the queues
//! first ([`declare`]; `AnyPublisher` does it for its group).

use futures_util::StreamExt;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Consumer,
    ExchangeKind,
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
        BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
        QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    },
    types::{AMQPValue, FieldTable, ShortString},
};

use crate::names::{check_plain_name, check_topic};
use crate::received::{Received, Source, constructors_by_source, event_id, fmt_fields};
use crate::{BrokerError, Delivery, Message, Published, Publisher, Subscription};

const BROKER: &str = "amqp";
/// Why a message was dead-lettered.
const DEAD_REASON: &str = "idem-dead-reason";
/// Which consumer group dead-lettered it.
const DEAD_GROUP: &str = "idem-consumer-group";
/// Set by quorum queues on redeliveries: how many times the message was returned before.
const DELIVERY_COUNT: &str = "x-delivery-count";
/// AMQP's persistent delivery mode: the broker writes the message to disk.
const PERSISTENT: u8 = 2;

/// Where and how to use RabbitMQ.
#[derive(Debug, Clone)]
pub struct AmqpConfig {
    /// The broker, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub url: String,
    /// Keeps deployments (and tests) apart: the exchanges `{namespace}` and
    /// `{namespace}.dead`, queues `{namespace}.{group}.{topic}`. 1 to 64 of `A-Z a-z 0-9 _ -`.
    pub namespace: String,
    /// How many deliveries a message gets (default 5): the queue's `x-delivery-limit` is one
    /// less, since RabbitMQ counts returns, not deliveries. Set when the queue is declared; a
    /// queue declared with another limit makes the declaration fail (RabbitMQ's
    /// `PRECONDITION_FAILED`).
    pub delivery_limit: u32,
    /// How many unacknowledged deliveries one subscription holds (`basic.qos`, default 1; see
    /// the module docs).
    pub prefetch: u16,
}

impl AmqpConfig {
    /// The defaults above for `url` and `namespace`.
    pub fn new(url: impl Into<String>, namespace: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            namespace: namespace.into(),
            delivery_limit: 5,
            prefetch: 1,
        }
    }

    /// The exchange events are published to: `{namespace}`.
    pub fn exchange(&self) -> String {
        self.namespace.clone()
    }

    /// The exchange dead letters go through: `{namespace}.dead`.
    pub fn dead_letter_exchange(&self) -> String {
        format!("{}.dead", self.namespace)
    }

    /// A consumer group's queue for a topic: `{namespace}.{group}.{topic}`.
    pub fn queue(&self, group: &str, topic: &str) -> String {
        format!("{}.{group}.{topic}", self.namespace)
    }

    /// Where that queue's dead letters land: `{namespace}.{group}.{topic}.dead`.
    pub fn dead_letter_queue(&self, group: &str, topic: &str) -> String {
        format!("{}.dead", self.queue(group, topic))
    }
}

/// The broker would not take a published message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PublishRefused {
    /// No queue is bound to the routing key, so the message went nowhere (it was published
    /// `mandatory` precisely to find this out).
    #[error(
        "no queue is bound to routing key {0:?} on exchange {1:?}; declare the consumer group's queue first"
    )]
    Unroutable(String, String),
    /// The broker nacked the message: it could not store it.
    #[error("the broker nacked the message")]
    Nacked,
    /// The channel was not in confirm mode, so nothing was confirmed.
    #[error("the channel does not confirm publishes")]
    NotConfirmed,
}

fn err(context: impl Into<String>, source: lapin::Error) -> BrokerError {
    BrokerError::new(BROKER, context, source)
}

async fn connect(config: &AmqpConfig) -> Result<(Connection, Channel), BrokerError> {
    check_plain_name(BROKER, "namespace", &config.namespace)?;
    // The URL is not in the context: it usually carries a password.
    let connection = Connection::connect(&config.url, ConnectionProperties::default())
        .await
        .map_err(|e| err("connecting", e))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| err("opening a channel", e))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| err("turning publisher confirms on", e))?;
    for exchange in [config.exchange(), config.dead_letter_exchange()] {
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| err(format!("declaring the exchange {exchange}"), e))?;
    }
    Ok((connection, channel))
}

async fn declare_on(
    channel: &Channel,
    config: &AmqpConfig,
    group: &str,
    topic: &str,
) -> Result<(), BrokerError> {
    check_plain_name(BROKER, "consumer group", group)?;
    check_topic(BROKER, topic)?;
    let queue = config.queue(group, topic);
    let dead_queue = config.dead_letter_queue(group, topic);
    // The dead letters are routed by the name of the queue they come from.
    declare_queue(
        channel,
        &dead_queue,
        quorum_queue(),
        config.dead_letter_exchange(),
        &queue,
    )
    .await?;

    let mut args = quorum_queue();
    let limit = i64::from(config.delivery_limit.max(1) - 1);
    args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(config.dead_letter_exchange().into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(queue.as_str().into()),
    );
    declare_queue(channel, &queue, args, config.exchange(), topic).await
}

/// The arguments of a quorum queue.
fn quorum_queue() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args
}

/// Declares the durable queue `queue` with `args` and binds it to `exchange` under `key`.
async fn declare_queue(
    channel: &Channel,
    queue: &str,
    args: FieldTable,
    exchange: String,
    key: &str,
) -> Result<(), BrokerError> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.into(), durable, args)
        .await
        .map_err(|e| err(format!("declaring the queue {queue}"), e))?;
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| err(format!("binding the queue {queue}"), e))?;
    Ok(())
}

/// Declares the exchanges, `group`'s queue for `topic` and its dead-letter queue, as a
/// subscription would. Publishers call it so that events published before the first worker
/// starts are queued rather than unroutable.
///
/// # Errors
///
/// [`BrokerError`] when the namespace, `group` or `topic` is not a valid name, or the broker
/// cannot be reached or refuses a declaration.
pub async fn declare(config: &AmqpConfig, group: &str, topic: &str) -> Result<(), BrokerError> {
    let (connection, channel) = connect(config).await?;
    declare_on(&channel, config, group, topic).await?;
    close(connection).await
}

async fn close(connection: Connection) -> Result<(), BrokerError> {
    connection
        .close(200, "bye".into())
        .await
        .map_err(|e| err("closing the connection", e))
}

/// Publishes persistent messages to the namespace's exchange and waits for each confirm.
pub struct AmqpPublisher {
    // Kept alive for the channel; lapin closes the connection when it is dropped.
    _connection: Connection,
    channel: Channel,
    config: AmqpConfig,
}

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fmt_fields(f, "AmqpPublisher", &[("exchange", &self.config.exchange())])
    }
}

impl AmqpPublisher {
    /// Connects, turns publisher confirms on and declares the namespace's exchanges.
    ///
    /// # Errors
    ///
    /// [`BrokerError`] when the namespace is not a valid name, or the broker cannot be reached
    /// or refuses confirms or a declaration.
    pub async fn connect(config: AmqpConfig) -> Result<Self, BrokerError> {
        let (connection, channel) = connect(&config).await?;
        Ok(Self {
            _connection: connection,
            channel,
            config,
        })
    }
}

impl Publisher for AmqpPublisher {
    async fn publish(&self, message: &Message) -> Result<Published, BrokerError> {
        check_topic(BROKER, &message.topic)?;
        let properties = BasicProperties::default()
            .with_message_id(message.id.as_str().into())
            .with_delivery_mode(PERSISTENT);
        publish_confirmed(
            &self.channel,
            self.config.exchange(),
            &message.topic,
            &message.payload,
            properties,
            || format!("publishing {} to {}", message.id, message.topic),
        )
        .await?;
        Ok(Published::Stored)
    }
}

async fn publish_confirmed(
    channel: &Channel,
    exchange: String,
    routing_key: &str,
    payload: &[u8],
    properties: BasicProperties,
    context: impl Fn() -> String,
) -> Result<(), BrokerError> {
    let confirm = channel
        .basic_publish(
            exchange.as_str().into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            payload,
            properties,
        )
        .await
        .map_err(|e| err(context(), e))?
        .await
        .map_err(|e| err(context(), e))?;
    let refused = match confirm {
        Confirmation::Ack(None) => return Ok(()),
        Confirmation::Ack(Some(_)) => PublishRefused::Unroutable(routing_key.to_owned(), exchange),
        Confirmation::Nack(_) => PublishRefused::Nacked,
        Confirmation::NotRequested => PublishRefused::NotConfirmed,
    };
    Err(BrokerError::new(BROKER, context(), refused))
}

/// A consumer on one group's queue for one topic. Subscriptions of the same group share the
/// queue's messages.
pub struct AmqpSubscription {
    consumer: Consumer,
    channel: Channel,
    _connection: Connection,
    group: String,
    topic: String,
    queue: String,
    /// Dead letters of this subscription's messages go here (exchange, routing key).
    dead_route: (String, String),
}

impl std::fmt::Debug for AmqpSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fmt_fields(
            f,
            "AmqpSubscription",
            &[("queue", &self.queue), ("topic", &self.topic)],
        )
    }
}

impl AmqpSubscription {
    constructors_by_source! {
        AmqpConfig;
        /// Declares (if missing) and consumes `group`'s queue for `topic`.
        ///
        /// # Errors
        ///
        /// [`BrokerError`] when the namespace, `group` or `topic` is not a valid name, or the
        /// broker cannot be reached or refuses a declaration or the consumer.
        connect: Events;
        /// Consumes the dead letters `group` left on `topic`. The messages carry their original id
        /// and topic. A dead letter dead-lettered again goes back to the end of the same queue.
        ///
        /// # Errors
        ///
        /// [`BrokerError`] when the namespace, `group` or `topic` is not a valid name, or the
        /// broker cannot be reached or refuses a declaration or the consumer.
        dead_letters: DeadLetters;
    }

    /// Declares (if missing) `group`'s queues for `topic` and consumes the one `source` names.
    pub(crate) async fn open(
        config: AmqpConfig,
        group: &str,
        topic: &str,
        source: Source,
    ) -> Result<Self, BrokerError> {
        let queue = match source {
            Source::Events => config.queue(group, topic),
            Source::DeadLetters => config.dead_letter_queue(group, topic),
        };
        // Dead letters are routed by the main queue's name, whichever queue they leave: a
        // dead letter dead-lettered again lands at the end of the same dead-letter queue.
        let dead_route = (config.dead_letter_exchange(), config.queue(group, topic));
        let (connection, channel) = connect(&config).await?;
        declare_on(&channel, &config, group, topic).await?;
        channel
            .basic_qos(config.prefetch.max(1), BasicQosOptions::default())
            .await
            .map_err(|e| err("setting the prefetch", e))?;
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| err(format!("consuming {queue}"), e))?;
        Ok(Self {
            consumer,
            channel,
            _connection: connection,
            group: group.to_owned(),
            topic: topic.to_owned(),
            queue,
            dead_route,
        })
    }
}

impl Subscription for AmqpSubscription {
    type Delivery = AmqpDelivery;

    async fn next(&mut self) -> Result<Option<AmqpDelivery>, BrokerError> {
        loop {
            let Some(inner) = self.consumer.next().await else {
                return Ok(None);
            };
            let mut inner = inner.map_err(|e| err(format!("consuming {}", self.queue), e))?;
            let id = inner.properties.message_id().as_ref().map(|id| id.as_str());
            let reason = match event_id(id, "message-id") {
                Ok(id) => {
                    return Ok(Some(AmqpDelivery {
                        received: Received {
                            message: Message {
                                id,
                                topic: self.topic.clone(),
                                payload: std::mem::take(&mut inner.data),
                            },
                            attempt: attempt(&inner.properties),
                            // Ours, or the reason RabbitMQ gives when it dead-lettered the
                            // message itself (`delivery_limit`).
                            dead_reason: header_str(&inner.properties, DEAD_REASON)
                                .or_else(|| header_str(&inner.properties, "x-first-death-reason")),
                        },
                        inner,
                        channel: self.channel.clone(),
                        dead_route: self.dead_route.clone(),
                        group: self.group.clone(),
                    }));
                }
                Err(reason) => reason,
            };
            // A message without a usable id can never be deduped, and redelivering it would
            // loop: it goes straight to the dead letters.
            tracing::warn!(queue = %self.queue, %reason, "dead-lettering a message without a usable id");
            let payload = std::mem::take(&mut inner.data);
            dead_letter(
                &self.channel,
                &inner,
                &payload,
                &self.dead_route,
                &self.group,
                &reason,
                "a message without an id",
            )
            .await?;
        }
    }
}

fn header_str(properties: &BasicProperties, name: &str) -> Option<String> {
    let value = properties.headers().as_ref()?.inner().get(name)?;
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// The quorum queue's return count plus this delivery; 1 when the header is absent (a first
/// delivery, or a classic queue, which does not count).
fn attempt(properties: &BasicProperties) -> u32 {
    let count = properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get(DELIVERY_COUNT))
        .and_then(|v| match *v {
            AMQPValue::LongLongInt(n) => Some(n),
            AMQPValue::LongInt(n) => Some(i64::from(n)),
            AMQPValue::LongUInt(n) => Some(i64::from(n)),
            AMQPValue::ShortInt(n) => Some(i64::from(n)),
            AMQPValue::ShortUInt(n) => Some(i64::from(n)),
            AMQPValue::ShortShortInt(n) => Some(i64::from(n)),
            AMQPValue::ShortShortUInt(n) => Some(i64::from(n)),
            _ => None,
        })
        .unwrap_or(0);
    u32::try_from(count.saturating_add(1))
        .unwrap_or(u32::MAX)
        .max(1)
}

/// One RabbitMQ delivery.
pub struct AmqpDelivery {
    received: Received,
    inner: lapin::message::Delivery,
    channel: Channel,
    dead_route: (String, String),
    group: String,
}

crate::received::delivery_debug_and_dead_reason! {
    /// Why the message was dead-lettered, when it was read from a dead-letter queue: ours,
    /// or `delivery_limit` when RabbitMQ itself moved it there.
    AmqpDelivery
}

impl Delivery for AmqpDelivery {
    crate::received::delivery_message_and_attempt!();

    async fn ack(self) -> Result<(), BrokerError> {
        self.inner
            .acker
            .ack(BasicAckOptions::default())
            .await
            .map(drop)
            .map_err(|e| err(format!("acknowledging {}", self.received.message.id), e))
    }

    async fn retry(self) -> Result<(), BrokerError> {
        // Requeued, the message goes back to the head of the quorum queue and its
        // x-delivery-count goes up by one.
        self.inner
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .map(drop)
            .map_err(|e| err(format!("requeueing {}", self.received.message.id), e))
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        let what = self.received.message.id.to_string();
        dead_letter(
            &self.channel,
            &self.inner,
            &self.received.message.payload,
            &self.dead_route,
            &self.group,
            reason,
            &what,
        )
        .await
    }
}

/// Publishes a copy with the reason to the dead-letter exchange, waits for the confirm, and
/// only then acknowledges the original: a crash in between leaves the original to be
/// redelivered and dead-lettered again (RabbitMQ keeps both copies; the inbox of whoever reads
/// the dead letters sees one id).
async fn dead_letter(
    channel: &Channel,
    inner: &lapin::message::Delivery,
    payload: &[u8],
    (exchange, routing_key): &(String, String),
    group: &str,
    reason: &str,
    what: &str,
) -> Result<(), BrokerError> {
    // The count belongs to the queue the message leaves; the dead-letter queue keeps its own.
    let mut headers = FieldTable::from(
        inner
            .properties
            .headers()
            .iter()
            .flat_map(|h| h.inner())
            .filter(|(k, _)| k.as_str() != DELIVERY_COUNT)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<std::collections::BTreeMap<_, _>>(),
    );
    headers.insert(DEAD_REASON.into(), AMQPValue::LongString(reason.into()));
    headers.insert(DEAD_GROUP.into(), AMQPValue::LongString(group.into()));
    let properties = inner.properties.clone().with_headers(headers);
    publish_confirmed(
        channel,
        exchange.clone(),
        routing_key,
        payload,
        properties,
        || format!("dead-lettering {what} to {routing_key}.dead"),
    )
    .await?;
    inner
        .acker
        .ack(BasicAckOptions::default())
        .await
        .map(drop)
        .map_err(|e| err(format!("acknowledging {what} after dead-lettering"), e))
}

/// Deletes `group`'s queue and dead-letter queue for `topic`, then the namespace's exchanges:
/// for tests and sandboxes. Objects already gone are not an error.
///
/// # Errors
///
/// [`BrokerError`] when the namespace is not a valid name, or the broker cannot be reached or
/// refuses a deletion.
pub async fn delete(config: &AmqpConfig, group: &str, topic: &str) -> Result<(), BrokerError> {
    let (connection, channel) = connect(config).await?;
    for queue in [
        config.queue(group, topic),
        config.dead_letter_queue(group, topic),
    ] {
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .map_err(|e| err(format!("deleting the queue {queue}"), e))?;
    }
    for exchange in [config.exchange(), config.dead_letter_exchange()] {
        channel
            .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .map_err(|e| err(format!("deleting the exchange {exchange}"), e))?;
    }
    close(connection).await
}
