//! NATS JetStream: one stream per namespace, one durable pull consumer per consumer group.
//!
//! **What JetStream guarantees.** A publish returns once the stream has stored the message
//! (the PubAck). Within the stream's duplicate window (default 2 minutes) a second publish
//! with the same `Nats-Msg-Id` is dropped and answered `duplicate: true`
//! ([`Published::Duplicate`]), so a relay that crashed between publishing and marking its
//! outbox row sent does not put the event in the stream twice. A delivery not acknowledged
//! within `ack_wait` (or nak'd) is delivered again, and the consumer counts the deliveries
//! itself, so [`Delivery::attempt`] is the broker's own count and survives consumer crashes.
//!
//! **What it does not.** The duplicate window protects the stream, never the consumer's side
//! effects: a consumer that crashes after its side effect and before its ack gets the message
//! again, so the inbox (`processed_events`) still does the dedup. A publish outside the window
//! is stored again. After `max_deliver` deliveries JetStream simply stops delivering the
//! message (it has no dead-letter queue of its own), so the consumer loop dead-letters at the
//! last attempt; `max_deliver` is one more than the delivery limit, so a message whose last
//! attempt died with its consumer comes back once more and is dead-lettered unhandled; [`NatsDelivery::dead_letter`] copies the message to the subject
//! `{namespace}.dead.{topic}` in the same stream and then acknowledges the original.
//!
//! **Prefetch.** Every message pulled counts as delivered, even one still waiting in the
//! client's buffer when the consumer crashes, and its `ack_wait` clock is already running.
//! So the default pulls one message at a time: a larger [`NatsConfig::prefetch`] is faster but
//! inflates delivery counts on crashes and redelivers buffered messages whose `ack_wait`
//! ran out while earlier ones were being handled.
//!
//! Subjects are `{namespace}.{topic}` and the stream `IDEM_{NAMESPACE}` holds `{namespace}.>`.
//! Dead letters share that stream under a message id of their own (`{id}:dead:{group}`),
//! because the duplicate window is per stream and would drop a copy under the original id;
//! the original id travels in the `Idem-Event-Id` header, the reason in `Idem-Dead-Reason`.
//! Only server features of NATS 2.9 are used (single filter subject, no per-message TTL).

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{
    self, AckKind, Context,
    consumer::{AckPolicy, DeliverPolicy, pull},
    context::PublishAckFuture,
    stream,
};
use futures_util::StreamExt;

use crate::names::{check_plain_name, check_topic, invalid};
use crate::received::{Received, Source, constructors_by_source, event_id, fmt_fields};
use crate::{BrokerError, Delivery, EventId, Message, Published, Publisher, Subscription};

const BROKER: &str = "nats";
/// How long one pull waits on the server for messages before the client asks again.
const PULL_EXPIRES: Duration = Duration::from_secs(5);
/// How often the server says an open pull is still alive.
const PULL_HEARTBEAT: Duration = Duration::from_secs(1);
/// The header JetStream dedupes on.
const MSG_ID: &str = "Nats-Msg-Id";
/// The original event id on a dead letter, whose `Nats-Msg-Id` is its own.
const EVENT_ID: &str = "Idem-Event-Id";
/// Why a message was dead-lettered.
const DEAD_REASON: &str = "Idem-Dead-Reason";
/// Which consumer group dead-lettered it.
const DEAD_GROUP: &str = "Idem-Consumer-Group";

/// Where and how to use JetStream.
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// The server, e.g. `nats://127.0.0.1:4222`, or several servers of one cluster separated
    /// by commas (`nats://a:4222,nats://b:4222,nats://c:4222`): the client connects to one and
    /// moves to another when it is lost.
    pub url: String,
    /// Keeps deployments (and tests) apart: the stream is `IDEM_{NAMESPACE}`, subjects
    /// `{namespace}.{topic}`. 1 to 64 of `A-Z a-z 0-9 _ -`.
    pub namespace: String,
    /// How long the stream remembers message ids to drop duplicates (default 2 min). Set when
    /// the stream is created; an existing stream keeps its own.
    pub duplicate_window: Duration,
    /// How long the stream keeps a message, delivered or not (default 7 days): JetStream's
    /// limits retention keeps every message for every consumer group until then. Set when the
    /// stream is created.
    pub max_age: Duration,
    /// How long a delivery may go unacknowledged before it is delivered again (default 30 s).
    /// It bounds how long a crashed consumer's message waits, and must exceed the longest
    /// side effect. Set when the consumer is created; an existing consumer keeps its own.
    pub ack_wait: Duration,
    /// How many deliveries the consumer loop gives a message (default 5). JetStream's
    /// `max_deliver` is one more, for the delivery that dead-letters a message whose last
    /// attempt crashed.
    pub delivery_limit: u32,
    /// How long a retried (nak'd) message waits before its redelivery (default none).
    pub retry_delay: Duration,
    /// How many messages one pull asks for (default 1; see the module docs).
    pub prefetch: usize,
    /// How many servers of a cluster keep a copy of the stream (default 1; 3 on a three-node
    /// cluster, so a publish is acknowledged only once a majority stored it and the stream
    /// survives losing any one server). Set when the stream is created; an existing stream
    /// keeps its own. The consumers inherit it.
    pub replicas: usize,
}

impl NatsConfig {
    /// The defaults above for `url` and `namespace`.
    pub fn new(url: impl Into<String>, namespace: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            namespace: namespace.into(),
            duplicate_window: Duration::from_secs(120),
            max_age: Duration::from_secs(7 * 24 * 3600),
            ack_wait: Duration::from_secs(30),
            delivery_limit: 5,
            retry_delay: Duration::ZERO,
            prefetch: 1,
            replicas: 1,
        }
    }

    /// The stream's name: `IDEM_` and the namespace in capitals, `-` turned into `_`.
    pub fn stream_name(&self) -> String {
        format!(
            "IDEM_{}",
            self.namespace.to_ascii_uppercase().replace('-', "_")
        )
    }

    /// The subject a topic is published on: `{namespace}.{topic}`.
    pub fn subject(&self, topic: &str) -> String {
        format!("{}.{topic}", self.namespace)
    }

    /// The subject a topic's dead letters go to: `{namespace}.dead.{topic}`.
    pub fn dead_letter_subject(&self, topic: &str) -> String {
        format!("{}.dead.{topic}", self.namespace)
    }
}

/// Checks a topic, which must also stay clear of the dead-letter subjects.
fn check_nats_topic(topic: &str) -> Result<(), BrokerError> {
    check_topic(BROKER, topic)?;
    if topic == "dead" || topic.starts_with("dead.") {
        return Err(invalid(
            BROKER,
            "topic",
            topic,
            "`dead` as a first part is reserved for dead letters on NATS",
        ));
    }
    Ok(())
}

/// Checks the namespace and connects to JetStream, through any of the servers the URL lists.
async fn connect(config: &NatsConfig) -> Result<Context, BrokerError> {
    check_plain_name(BROKER, "namespace", &config.namespace)?;
    // async-nats reads one address from a string; a cluster's list is split here.
    let servers = config
        .url
        .split(',')
        .map(|server| server.trim().parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            BrokerError::new(BROKER, format!("reading the server list {}", config.url), e)
        })?;
    let client = async_nats::connect(servers)
        .await
        .map_err(|e| BrokerError::new(BROKER, format!("connecting to {}", config.url), e))?;
    Ok(jetstream::new(client))
}

/// Connects and makes sure the namespace's stream exists.
async fn open(config: &NatsConfig) -> Result<(Context, stream::Stream), BrokerError> {
    let js = connect(config).await?;
    let name = config.stream_name();
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{}.>", config.namespace)],
            duplicate_window: config.duplicate_window,
            max_age: config.max_age,
            storage: stream::StorageType::File,
            num_replicas: config.replicas.max(1),
            ..Default::default()
        })
        .await
        .map_err(|e| BrokerError::new(BROKER, format!("creating the stream {name}"), e))?;
    Ok((js, stream))
}

/// Publishes to the namespace's stream and waits for each PubAck.
#[derive(Debug, Clone)]
pub struct NatsPublisher {
    js: Context,
    config: NatsConfig,
}

impl NatsPublisher {
    /// Connects, creating the namespace's stream if it is missing.
    ///
    /// # Errors
    ///
    /// [`BrokerError`] when the namespace is not a valid name, or the server cannot be reached
    /// or refuses the stream.
    pub async fn connect(config: NatsConfig) -> Result<Self, BrokerError> {
        let (js, _) = open(&config).await?;
        Ok(Self { js, config })
    }
}

impl Publisher for NatsPublisher {
    async fn publish(&self, message: &Message) -> Result<Published, BrokerError> {
        check_nats_topic(&message.topic)?;
        let mut headers = HeaderMap::new();
        headers.insert(MSG_ID, message.id.as_str());
        let subject = self.config.subject(&message.topic);
        let context = || format!("publishing {} to {subject}", message.id);
        let ack = self
            .js
            .publish_with_headers(subject.clone(), headers, message.payload.clone().into())
            .await
            .map_err(|e| BrokerError::new(BROKER, context(), e))?;
        await_ack(ack, context).await
    }
}

async fn await_ack(
    ack: PublishAckFuture,
    context: impl Fn() -> String,
) -> Result<Published, BrokerError> {
    let ack = ack
        .await
        .map_err(|e| BrokerError::new(BROKER, context(), e))?;
    Ok(if ack.duplicate {
        Published::Duplicate
    } else {
        Published::Stored
    })
}

/// A durable pull consumer on one topic, shared by every subscription of the same group.
pub struct NatsSubscription {
    // Boxed: the stream is several hundred bytes, and `AnySubscription` is as big as its
    // biggest variant.
    messages: Box<pull::Stream>,
    js: Context,
    config: NatsConfig,
    group: String,
    topic: String,
    dead_subject: String,
    /// The durable consumer's name: the group, or `{group}_dead` for dead letters.
    consumer_name: String,
}

impl std::fmt::Debug for NatsSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fields: [(&str, &dyn std::fmt::Debug); 3] = [
            ("stream", &self.config.stream_name()),
            ("consumer", &self.consumer_name),
            ("topic", &self.topic),
        ];
        fmt_fields(f, "NatsSubscription", &fields)
    }
}

impl NatsSubscription {
    constructors_by_source! {
        NatsConfig;
        /// Joins the durable consumer `group` on `topic`, creating the stream and the consumer if
        /// they are missing. Several subscriptions of one group share the messages.
        ///
        /// # Errors
        ///
        /// [`BrokerError`] when the namespace, `group` or `topic` is not a valid name, or the
        /// server cannot be reached or refuses the stream or the consumer.
        connect: Events;
        /// Reads the dead letters `group` left on `topic` (through a durable consumer of its own,
        /// `{group}_dead`). The messages carry their original id and topic; a dead letter that
        /// cannot be handled here either is dead-lettered to `{namespace}.dead.dead.{topic}`.
        ///
        /// # Errors
        ///
        /// [`BrokerError`] when the namespace, `group` or `topic` is not a valid name, or the
        /// server cannot be reached or refuses the stream or the consumer.
        dead_letters: DeadLetters;
    }

    /// Joins `group`'s durable consumer of what `source` names on `topic`, creating the
    /// stream and the consumer if they are missing.
    pub(crate) async fn open(
        config: NatsConfig,
        group: &str,
        topic: &str,
        source: Source,
    ) -> Result<Self, BrokerError> {
        check_nats_topic(topic)?;
        check_plain_name(BROKER, "consumer group", group)?;
        // The durable consumer, the subject it reads, and where what it cannot handle goes.
        let (durable, subject, dead_subject) = match source {
            Source::Events => (
                group.to_owned(),
                config.subject(topic),
                config.dead_letter_subject(topic),
            ),
            Source::DeadLetters => (
                format!("{group}_dead"),
                config.dead_letter_subject(topic),
                config.dead_letter_subject(&format!("dead.{topic}")),
            ),
        };
        let (js, stream) = open(&config).await?;
        let consumer: jetstream::consumer::PullConsumer = stream
            .get_or_create_consumer(
                &durable,
                pull::Config {
                    durable_name: Some(durable.clone()),
                    filter_subject: subject.clone(),
                    deliver_policy: DeliverPolicy::All,
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: config.ack_wait,
                    max_deliver: i64::from(config.delivery_limit.max(1)) + 1,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| {
                BrokerError::new(
                    BROKER,
                    format!("creating the consumer {durable} on {subject}"),
                    e,
                )
            })?;
        // A pull lives on the consumer's leader. When that server dies the pull is lost, and the
        // client only notices by missed heartbeats: two of them, 30 s with async-nats's
        // defaults (15 s heartbeats, 30 s pulls). Short pulls and 1 s heartbeats make a lost
        // leader cost about 2 s, for one small request every 5 s while idle.
        let messages = consumer
            .stream()
            .max_messages_per_batch(config.prefetch.max(1))
            .expires(PULL_EXPIRES)
            .heartbeat(PULL_HEARTBEAT)
            .messages()
            .await
            .map_err(|e| BrokerError::new(BROKER, format!("pulling from {durable}"), e))?;
        Ok(Self {
            messages: Box::new(messages),
            js,
            group: group.to_owned(),
            topic: topic.to_owned(),
            dead_subject,
            consumer_name: durable,
            config,
        })
    }

    /// Turns a JetStream message into a delivery, or dead-letters it when it has no usable
    /// event id: such a message can never be deduped, and redelivering it would loop.
    async fn delivery(
        &self,
        inner: jetstream::Message,
    ) -> Result<Option<NatsDelivery>, BrokerError> {
        let info = inner
            .info()
            .map_err(|e| BrokerError::new(BROKER, "reading a delivery's metadata", e))?;
        let attempt = u32::try_from(info.delivered).unwrap_or(u32::MAX).max(1);
        let sequence = info.stream_sequence;
        let header = |name: &str| {
            inner
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_owned())
        };
        let id = match event_id(header(EVENT_ID).or_else(|| header(MSG_ID)), MSG_ID) {
            Ok(id) => id,
            Err(reason) => {
                tracing::warn!(sequence, subject = %inner.subject, %reason, "dead-lettering a message without a usable id");
                let copy = DeadCopy {
                    msg_id: format!("seq-{sequence}:dead:{}", self.group),
                    event_id: None,
                };
                dead_letter(
                    &self.js,
                    &inner,
                    &self.dead_subject,
                    &self.group,
                    copy,
                    &reason,
                )
                .await?;
                return Ok(None);
            }
        };
        Ok(Some(NatsDelivery {
            received: Received {
                message: Message {
                    id,
                    topic: self.topic.clone(),
                    payload: inner.payload.to_vec(),
                },
                attempt,
                dead_reason: header(DEAD_REASON),
            },
            inner,
            js: self.js.clone(),
            dead_subject: self.dead_subject.clone(),
            group: self.group.clone(),
            retry_delay: self.config.retry_delay,
        }))
    }
}

impl Subscription for NatsSubscription {
    type Delivery = NatsDelivery;

    async fn next(&mut self) -> Result<Option<NatsDelivery>, BrokerError> {
        loop {
            let Some(inner) = self.messages.next().await else {
                return Ok(None);
            };
            let inner = match inner {
                Ok(inner) => inner,
                // The client re-issues its pull after a missed heartbeat: a blip, not an end.
                Err(e) if e.kind() == pull::MessagesErrorKind::MissingHeartbeat => {
                    tracing::warn!(consumer = %self.consumer_name, "missed a JetStream heartbeat; pulling again");
                    continue;
                }
                Err(e) if e.kind() == pull::MessagesErrorKind::ConsumerDeleted => return Ok(None),
                Err(e) => {
                    let context = format!("pulling from {}", self.consumer_name);
                    return Err(BrokerError::new(BROKER, context, e));
                }
            };
            if let Some(delivery) = self.delivery(inner).await? {
                return Ok(Some(delivery));
            }
        }
    }
}

/// One JetStream delivery.
pub struct NatsDelivery {
    received: Received,
    inner: jetstream::Message,
    js: Context,
    dead_subject: String,
    group: String,
    retry_delay: Duration,
}

crate::received::delivery_debug_and_dead_reason! {
    /// Why the message was dead-lettered, when it was read from a dead-letter subject.
    NatsDelivery
}

impl Delivery for NatsDelivery {
    crate::received::delivery_message_and_attempt!();

    async fn ack(self) -> Result<(), BrokerError> {
        // A double ack waits for the server to confirm, so a returned Ok means the message
        // will not come back (a plain ack can be lost on the way).
        self.inner.double_ack().await.map_err(|e| {
            BrokerError::new(
                BROKER,
                format!("acknowledging {}", self.received.message.id),
                e,
            )
        })
    }

    async fn retry(self) -> Result<(), BrokerError> {
        let delay = (!self.retry_delay.is_zero()).then_some(self.retry_delay);
        self.inner.ack_with(AckKind::Nak(delay)).await.map_err(|e| {
            BrokerError::new(BROKER, format!("nak'ing {}", self.received.message.id), e)
        })
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        let copy = DeadCopy {
            msg_id: format!("{}:dead:{}", self.received.message.id, self.group),
            event_id: Some(&self.received.message.id),
        };
        dead_letter(
            &self.js,
            &self.inner,
            &self.dead_subject,
            &self.group,
            copy,
            reason,
        )
        .await
    }
}

struct DeadCopy<'a> {
    /// The dead letter's own `Nats-Msg-Id`: the same on every try, so a dead-lettering
    /// repeated after a crash before the ack is dropped as a duplicate.
    msg_id: String,
    event_id: Option<&'a EventId>,
}

/// Copies the message to the dead-letter subject, waits for the PubAck, and only then
/// acknowledges the original: a crash in between leaves the original to be redelivered and
/// dead-lettered again, which the duplicate window absorbs.
async fn dead_letter(
    js: &Context,
    inner: &jetstream::Message,
    dead_subject: &str,
    group: &str,
    copy: DeadCopy<'_>,
    reason: &str,
) -> Result<(), BrokerError> {
    let mut headers = HeaderMap::new();
    headers.insert(MSG_ID, copy.msg_id.as_str());
    if let Some(id) = copy.event_id {
        headers.insert(EVENT_ID, id.as_str());
    }
    // Header values cannot hold line breaks.
    headers.insert(DEAD_REASON, reason.replace(['\r', '\n'], " ").as_str());
    headers.insert(DEAD_GROUP, group);
    let context = || format!("dead-lettering {} to {dead_subject}", copy.msg_id);
    let ack = js
        .publish_with_headers(dead_subject.to_owned(), headers, inner.payload.clone())
        .await
        .map_err(|e| BrokerError::new(BROKER, context(), e))?;
    await_ack(ack, context).await?;
    inner.double_ack().await.map_err(|e| {
        BrokerError::new(
            BROKER,
            format!("acknowledging {} after dead-lettering", copy.msg_id),
            e,
        )
    })
}

/// Deletes the namespace's stream, with every message, dead letter and consumer in it. A
/// stream that does not exist is not an error.
///
/// # Errors
///
/// [`BrokerError`] when the namespace is not a valid name, or the server cannot be reached or
/// refuses the deletion.
pub async fn delete_namespace(config: &NatsConfig) -> Result<(), BrokerError> {
    let js = connect(config).await?;
    let name = config.stream_name();
    match js.delete_stream(&name).await {
        Ok(_) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                jetstream::context::DeleteStreamErrorKind::JetStream(ref js_err)
                    if js_err.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(BrokerError::new(
            BROKER,
            format!("deleting the stream {name}"),
            e,
        )),
    }
}
