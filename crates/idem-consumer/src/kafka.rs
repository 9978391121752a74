//! Kafka (and Kafka-compatible brokers such as tansu): topics `{namespace}.{topic}`, consumer
//! groups `{namespace}.{group}`, offsets committed by hand.
//!
//! **What Kafka guarantees.** The producer runs with `enable.idempotence=true` and
//! `acks=all`: a publish returns once the delivery report says every in-sync replica has the
//! record, and librdkafka's own retries of a send never write it twice. The record key is the
//! event id (so one id always lands on one partition, in order) and the `idem-event-id` header
//! carries it too. The consumer commits a partition's offset only when every message before
//! it was acknowledged or dead-lettered, which happens after the side effect; anything not
//! committed is delivered again to whoever owns the partition next.
//!
//! **What it does not.** The idempotent producer dedupes librdkafka's retries within one
//! producer session, never two publishes of the same event: a relay that crashed between the
//! delivery report and marking its outbox row sent appends the event again
//! ([`Published::Duplicate`] is never answered). And it protects the log, not the consumer's
//! side effects: a consumer that crashes after its side effect and before its commit gets the
//! message again. The inbox (`processed_events`) dedups both. Kafka has no per-message
//! acknowledgement, redelivery count, delivery limit nor dead-letter queue: a retried message
//! is re-read by seeking back to its offset (which also re-reads the messages after it in that
//! partition), [`Delivery::attempt`] counts the deliveries this process saw (it starts again at
//! 1 in a new process), and dead letters are records produced to `{namespace}.{topic}.dead`
//! with an `idem-dead-reason` header before the offset is committed.
//!
//! A crashed consumer's partitions move to another group member after `session_timeout`
//! (a consumer that is dropped leaves the group at once). Topics are created on first use with
//! [`KafkaConfig::partitions`] partitions.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rdkafka::{
    ClientConfig, Message as _, Offset, TopicPartitionList,
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    consumer::{CommitMode, Consumer as _, StreamConsumer},
    error::{
        KafkaError, KafkaResult, RDKafkaErrorCode,
        RDKafkaErrorCode::{GroupIdNotFound, TopicAlreadyExists, UnknownTopicOrPartition},
    },
    message::{Header, Headers as _, OwnedHeaders, OwnedMessage},
    producer::{FutureProducer, FutureRecord},
};

use crate::names::{check_plain_name, check_topic};
use crate::received::{Received, Source, constructors_by_source, event_id, fmt_fields};
use crate::{BrokerError, Delivery, EventId, Message, Published, Publisher, Subscription};

const BROKER: &str = "kafka";
/// The event id, also the record key.
const EVENT_ID: &str = "idem-event-id";
/// Why a message was dead-lettered.
const DEAD_REASON: &str = "idem-dead-reason";
/// Which consumer group dead-lettered it.
const DEAD_GROUP: &str = "idem-consumer-group";
/// How long a blocking librdkafka call (commit, seek, admin request) may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and how to use Kafka.
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    /// The bootstrap servers, `host:port[,host:port…]`.
    pub bootstrap_servers: String,
    /// Keeps deployments (and tests) apart: topics `{namespace}.{topic}`, groups
    /// `{namespace}.{group}`. 1 to 64 of `A-Z a-z 0-9 _ -`.
    pub namespace: String,
    /// How long the group waits for a silent member before handing its partitions to another
    /// (default 10 s); the broker bounds it (`group.min.session.timeout.ms`).
    pub session_timeout: Duration,
    /// How long the producer keeps trying to deliver a record before reporting failure
    /// (`message.timeout.ms`, default 30 s).
    pub delivery_timeout: Duration,
    /// Partitions of a topic this adapter creates (default 1).
    pub partitions: i32,
    /// Replication factor of a topic this adapter creates (default 1).
    pub replication: i32,
}

impl KafkaConfig {
    /// The defaults above for `bootstrap_servers` and `namespace`.
    pub fn new(bootstrap_servers: impl Into<String>, namespace: impl Into<String>) -> Self {
        Self {
            bootstrap_servers: bootstrap_servers.into(),
            namespace: namespace.into(),
            session_timeout: Duration::from_secs(10),
            delivery_timeout: Duration::from_secs(30),
            partitions: 1,
            replication: 1,
        }
    }

    /// The Kafka topic of an idem topic: `{namespace}.{topic}`.
    pub fn topic(&self, topic: &str) -> String {
        format!("{}.{topic}", self.namespace)
    }

    /// Where that topic's dead letters go: `{namespace}.{topic}.dead`.
    pub fn dead_letter_topic(&self, topic: &str) -> String {
        format!("{}.dead", self.topic(topic))
    }

    /// The Kafka consumer group of an idem consumer group: `{namespace}.{group}`.
    pub fn group_id(&self, group: &str) -> String {
        format!("{}.{group}", self.namespace)
    }

    fn producer(&self) -> Result<FutureProducer, BrokerError> {
        ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap_servers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", millis(self.delivery_timeout))
            .create()
            .map_err(|e| BrokerError::new(BROKER, "creating the producer", e))
    }

    fn admin(&self) -> Result<AdminClient<DefaultClientContext>, BrokerError> {
        ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap_servers)
            .create()
            .map_err(|e| BrokerError::new(BROKER, "creating the admin client", e))
    }
}

fn millis(d: Duration) -> String {
    d.as_millis().to_string()
}

fn err(context: impl Into<String>, source: KafkaError) -> BrokerError {
    BrokerError::new(BROKER, context, source)
}

/// Locks a std mutex of this adapter. Each holds plain bookkeeping that a panic cannot leave
/// half-written, so a poisoned lock is used as it is.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The broker's answer to an admin request: one result per object named.
type AdminAnswer = KafkaResult<Vec<Result<String, (String, RDKafkaErrorCode)>>>;

/// Checks the broker's answer to an admin request (`doing`: "creating", "deleting") on the
/// objects `names` (`what`: "topic", "group"): a failed request is an error, and so is any
/// object's code but `fine` (the object was already there, or already gone).
fn check_admin_answer(
    answer: AdminAnswer,
    doing: &str,
    what: &str,
    names: &dyn std::fmt::Debug,
    fine: RDKafkaErrorCode,
) -> Result<(), BrokerError> {
    let results = answer.map_err(|e| err(format!("{doing} the {what}s {names:?}"), e))?;
    for result in results {
        match result {
            Ok(_) => {}
            Err((_, code)) if code == fine => {}
            Err((name, code)) => {
                return Err(BrokerError::new(
                    BROKER,
                    format!("{doing} the {what} {name}"),
                    code,
                ));
            }
        }
    }
    Ok(())
}

/// Creates the topics that are missing; one that already exists is fine.
async fn create_topics(config: &KafkaConfig, topics: &[String]) -> Result<(), BrokerError> {
    let admin = config.admin()?;
    // A topic named twice in one request is a malformed request to the broker.
    let topics: BTreeSet<&String> = topics.iter().collect();
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| {
            NewTopic::new(
                t,
                config.partitions,
                TopicReplication::Fixed(config.replication),
            )
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(CALL_TIMEOUT));
    let answer = admin.create_topics(&new, &options).await;
    check_admin_answer(answer, "creating", "topic", &topics, TopicAlreadyExists)
}

/// Sends a record and waits for its delivery report.
async fn produce(
    producer: &FutureProducer,
    topic: &str,
    id: &str,
    payload: &[u8],
    headers: OwnedHeaders,
) -> Result<(), BrokerError> {
    let record = FutureRecord::to(topic)
        .key(id)
        .payload(payload)
        .headers(headers.insert(Header {
            key: EVENT_ID,
            value: Some(id),
        }));
    producer
        .send(record, CALL_TIMEOUT)
        .await
        .map(drop)
        .map_err(|(e, _)| err(format!("publishing {id} to {topic}"), e))
}

/// Produces with the idempotent producer and waits for each delivery report.
pub struct KafkaPublisher {
    producer: FutureProducer,
    config: KafkaConfig,
    /// Topics known to exist, so each is created once per publisher rather than per publish.
    /// A std mutex: it is never held across an await.
    created: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fields: [(&str, &dyn std::fmt::Debug); 2] = [
            ("bootstrap_servers", &self.config.bootstrap_servers),
            ("namespace", &self.config.namespace),
        ];
        fmt_fields(f, "KafkaPublisher", &fields)
    }
}

impl KafkaPublisher {
    /// Creates the producer (it connects lazily, on the first publish).
    ///
    /// # Errors
    ///
    /// [`BrokerError`] when the namespace is not a valid name or librdkafka refuses the
    /// producer's configuration.
    pub async fn connect(config: KafkaConfig) -> Result<Self, BrokerError> {
        check_plain_name(BROKER, "namespace", &config.namespace)?;
        Ok(Self {
            producer: config.producer()?,
            config,
            created: Mutex::new(HashSet::new()),
        })
    }
}

impl Publisher for KafkaPublisher {
    async fn publish(&self, message: &Message) -> Result<Published, BrokerError> {
        check_topic(BROKER, &message.topic)?;
        let topic = self.config.topic(&message.topic);
        let known = lock(&self.created).contains(&topic);
        if !known {
            create_topics(
                &self.config,
                &[topic.clone(), self.config.dead_letter_topic(&message.topic)],
            )
            .await?;
            lock(&self.created).insert(topic.clone());
        }
        produce(
            &self.producer,
            &topic,
            message.id.as_str(),
            &message.payload,
            OwnedHeaders::new(),
        )
        .await?;
        Ok(Published::Stored)
    }
}

/// What one subscription has handed out and what it may commit, per partition.
#[derive(Debug, Default)]
struct Partition {
    /// Offsets handed out and neither acknowledged nor dead-lettered yet (retried ones
    /// included: they will come back).
    pending: BTreeSet<i64>,
    /// One past the highest offset handed out.
    next: i64,
    /// The offset last committed by this subscription.
    committed: i64,
    /// Deliveries seen per offset in this process.
    attempts: HashMap<i64, u32>,
}

impl Partition {
    /// The offset that may be committed: the first still pending, or everything handed out.
    fn committable(&self) -> i64 {
        self.pending.first().copied().unwrap_or(self.next)
    }
}

/// A std mutex: it is never held across an await.
type Tracker = Arc<Mutex<HashMap<i32, Partition>>>;

/// One member of a consumer group on one topic.
pub struct KafkaSubscription {
    consumer: Arc<StreamConsumer>,
    producer: FutureProducer,
    tracker: Tracker,
    kafka_topic: String,
    dead_topic: String,
    topic: String,
    group: String,
}

impl std::fmt::Debug for KafkaSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fmt_fields(
            f,
            "KafkaSubscription",
            &[("topic", &self.kafka_topic), ("group", &self.group)],
        )
    }
}

impl KafkaSubscription {
    constructors_by_source! {
        KafkaConfig;
        /// Joins `group` on `topic` (creating the topic and its dead-letter topic if missing),
        /// starting from the group's committed offsets, or from the beginning for a new group.
        ///
        /// # Errors
        ///
        /// [`BrokerError`] when the namespace, `group` or `topic` is not a valid name, or the
        /// brokers refuse the topics or the consumer.
        connect: Events;
        /// Reads the dead letters `group` left on `topic`, as the group `{namespace}.{group}.dead`.
        /// The messages carry their original id and topic; a dead letter dead-lettered again is
        /// appended to the same dead-letter topic.
        ///
        /// # Errors
        ///
        /// [`BrokerError`] when the namespace, `group` or `topic` is not a valid name, or the
        /// brokers refuse the topics or the consumer.
        dead_letters: DeadLetters;
    }

    /// Joins `group`'s member of what `source` names on `topic`, creating the topic and its
    /// dead-letter topic if they are missing.
    pub(crate) async fn open(
        config: KafkaConfig,
        group: &str,
        topic: &str,
        source: Source,
    ) -> Result<Self, BrokerError> {
        check_topic(BROKER, topic)?;
        check_plain_name(BROKER, "namespace", &config.namespace)?;
        // Dead letters dead-lettered again are appended to the same dead-letter topic.
        let dead_topic = config.dead_letter_topic(topic);
        let (group_id, kafka_topic) = match source {
            Source::Events => (config.group_id(group), config.topic(topic)),
            Source::DeadLetters => (
                format!("{}.dead", config.group_id(group)),
                dead_topic.clone(),
            ),
        };
        check_plain_name(BROKER, "consumer group", group)?;
        create_topics(&config, &[kafka_topic.clone(), dead_topic.clone()]).await?;
        let heartbeat = (config.session_timeout / 3).max(Duration::from_millis(100));
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &config.bootstrap_servers)
            .set("group.id", &group_id)
            // Offsets are committed by hand, after the side effect, never on a timer.
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", millis(config.session_timeout))
            .set("heartbeat.interval.ms", millis(heartbeat))
            .create()
            .map_err(|e| err("creating the consumer", e))?;
        consumer
            .subscribe(&[&kafka_topic])
            .map_err(|e| err(format!("subscribing {group_id} to {kafka_topic}"), e))?;
        Ok(Self {
            consumer: Arc::new(consumer),
            producer: config.producer()?,
            tracker: Tracker::default(),
            kafka_topic,
            dead_topic,
            topic: topic.to_owned(),
            group: group.to_owned(),
        })
    }

    fn delivery(&self, record: OwnedMessage, message: Message, attempt: u32) -> KafkaDelivery {
        KafkaDelivery {
            received: Received {
                message,
                attempt,
                dead_reason: header(&record, DEAD_REASON),
            },
            record,
            consumer: self.consumer.clone(),
            producer: self.producer.clone(),
            tracker: self.tracker.clone(),
            dead_topic: self.dead_topic.clone(),
            group: self.group.clone(),
        }
    }
}

fn header(record: &OwnedMessage, name: &str) -> Option<String> {
    let value = record.headers()?.iter().find(|h| h.key == name)?.value?;
    Some(String::from_utf8_lossy(value).into_owned())
}

impl Subscription for KafkaSubscription {
    type Delivery = KafkaDelivery;

    async fn next(&mut self) -> Result<Option<KafkaDelivery>, BrokerError> {
        loop {
            let record = self
                .consumer
                .recv()
                .await
                .map_err(|e| err(format!("consuming {}", self.kafka_topic), e))?
                .detach();
            let (partition, offset) = (record.partition(), record.offset());
            let attempt = {
                let mut tracker = lock(&self.tracker);
                let state = tracker.entry(partition).or_default();
                state.pending.insert(offset);
                state.next = state.next.max(offset + 1);
                let attempt = state.attempts.entry(offset).or_default();
                *attempt += 1;
                *attempt
            };
            let id = header(&record, EVENT_ID).or_else(|| {
                record
                    .key()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
            });
            let reason = match event_id(id, "record key") {
                Ok(id) => {
                    let message = Message {
                        id,
                        topic: self.topic.clone(),
                        payload: record.payload().unwrap_or_default().to_vec(),
                    };
                    return Ok(Some(self.delivery(record, message, attempt)));
                }
                Err(reason) => reason,
            };
            // A record without a usable id can never be deduped, and redelivering it would
            // loop: it goes straight to the dead letters.
            tracing::warn!(topic = %self.kafka_topic, partition, offset, %reason, "dead-lettering a record without a usable id");
            let placeholder = Message {
                id: EventId::new(format!("{}-{partition}-{offset}", self.kafka_topic))
                    .map_err(|e| BrokerError::new(BROKER, "naming a record without an id", e))?,
                topic: self.topic.clone(),
                payload: record.payload().unwrap_or_default().to_vec(),
            };
            self.delivery(record, placeholder, attempt)
                .dead_letter(&reason)
                .await?;
        }
    }
}

/// One Kafka record handed to the consumer.
pub struct KafkaDelivery {
    received: Received,
    record: OwnedMessage,
    consumer: Arc<StreamConsumer>,
    producer: FutureProducer,
    tracker: Tracker,
    dead_topic: String,
    group: String,
}

crate::received::delivery_debug_and_dead_reason! {
    /// Why the message was dead-lettered, when it was read from a dead-letter topic.
    KafkaDelivery(delivery) {
        partition: delivery.record.partition(),
        offset: delivery.record.offset(),
    }
}

impl KafkaDelivery {
    /// The partition and offset of the record.
    pub fn position(&self) -> (i32, i64) {
        (self.record.partition(), self.record.offset())
    }

    /// Marks the record done and commits as far as every earlier record is done too: a
    /// record still pending before this one holds the commit back, so it is re-read after a
    /// crash or a rebalance.
    async fn done(self) -> Result<(), BrokerError> {
        let (partition, offset) = self.position();
        let commit = {
            let mut tracker = lock(&self.tracker);
            let state = tracker.entry(partition).or_default();
            state.pending.remove(&offset);
            state.attempts.remove(&offset);
            let to = state.committable();
            (to > state.committed).then(|| {
                state.committed = to;
                to
            })
        };
        let Some(to) = commit else { return Ok(()) };
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(self.record.topic(), partition, Offset::Offset(to))
            .map_err(|e| err("naming the offset to commit", e))?;
        let consumer = self.consumer.clone();
        // A synchronous commit blocks until the broker answers: off the async workers.
        let committed =
            tokio::task::spawn_blocking(move || consumer.commit(&list, CommitMode::Sync))
                .await
                .map_err(|e| BrokerError::new(BROKER, "committing an offset", e))?;
        committed.map_err(|e| {
            // Not committed after all: a later ack will try again from the same point.
            if let Some(state) = lock(&self.tracker).get_mut(&partition) {
                state.committed = state.committed.min(to - 1);
            }
            err(
                format!(
                    "committing offset {to} of {} [{partition}] for {}",
                    self.record.topic(),
                    self.received.message.id
                ),
                e,
            )
        })
    }
}

impl Delivery for KafkaDelivery {
    crate::received::delivery_message_and_attempt!();

    async fn ack(self) -> Result<(), BrokerError> {
        self.done().await
    }

    async fn retry(self) -> Result<(), BrokerError> {
        // The offset stays pending (it holds back commits) and the consumer is rewound to it;
        // librdkafka drops what it had already fetched past it.
        let (partition, offset) = self.position();
        let topic = self.record.topic().to_owned();
        let consumer = self.consumer.clone();
        let sought = tokio::task::spawn_blocking(move || {
            consumer.seek(&topic, partition, Offset::Offset(offset), CALL_TIMEOUT)
        })
        .await
        .map_err(|e| BrokerError::new(BROKER, "seeking back", e))?;
        sought.map_err(|e| {
            err(
                format!(
                    "seeking back to offset {offset} of {} [{partition}] for {}",
                    self.record.topic(),
                    self.received.message.id
                ),
                e,
            )
        })
    }

    async fn dead_letter(self, reason: &str) -> Result<(), BrokerError> {
        // Produced and reported first, committed after: a crash in between leaves the record
        // to be read and dead-lettered again (the dead-letter topic then holds it twice).
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: DEAD_REASON,
                value: Some(reason),
            })
            .insert(Header {
                key: DEAD_GROUP,
                value: Some(self.group.as_str()),
            });
        produce(
            &self.producer,
            &self.dead_topic,
            self.received.message.id.as_str(),
            &self.received.message.payload,
            headers,
        )
        .await?;
        self.done().await
    }
}

/// Deletes `topic`, its dead-letter topic and the committed offsets of `group` (and of its
/// dead-letter reader): for tests and sandboxes. Objects already gone are not an error.
///
/// # Errors
///
/// [`BrokerError`] when the admin client cannot be made or the brokers refuse a deletion.
pub async fn delete(config: &KafkaConfig, group: &str, topic: &str) -> Result<(), BrokerError> {
    let admin = config.admin()?;
    let options = AdminOptions::new().operation_timeout(Some(CALL_TIMEOUT));
    let groups = [
        config.group_id(group),
        format!("{}.dead", config.group_id(group)),
    ];
    let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
    let answer = admin.delete_groups(&groups, &options).await;
    check_admin_answer(answer, "deleting", "group", &groups, GroupIdNotFound)?;
    let topics = [config.topic(topic), config.dead_letter_topic(topic)];
    let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
    let answer = admin.delete_topics(&topics, &options).await;
    check_admin_answer(
        answer,
        "deleting",
        "topic",
        &topics,
        UnknownTopicOrPartition,
    )
}
