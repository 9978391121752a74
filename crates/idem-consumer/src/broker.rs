//! What idem needs from a broker, whichever it is: a publisher the outbox relay hands events
//! to, and a subscription the consumer loop takes deliveries from.
//!
//! The adapters ([`crate::nats`], [`crate::amqp`], [`crate::kafka`], each behind its feature)
//! implement these traits over the brokers' own clients.

use std::future::Future;

use crate::Message;

/// A broker failed or refused; the operation may be retried.
#[derive(Debug, thiserror::Error)]
#[error("{broker}: {context}")]
pub struct BrokerError {
    /// Which broker: "nats", "amqp", "kafka".
    pub broker: &'static str,
    /// What was being done, e.g. "publishing evt_… to payments".
    pub context: String,
    /// The client's own error.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl BrokerError {
    /// Wraps a client error with what was being done.
    pub fn new(
        broker: &'static str,
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            broker,
            context: context.into(),
            source: source.into(),
        }
    }
}

/// What the broker said of a published message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// The broker stored it.
    Stored,
    /// The broker recognised the id as one it already has and dropped this copy (JetStream's
    /// duplicate window). Brokers without such a window never answer this.
    Duplicate,
}

/// Hands messages to a broker.
pub trait Publisher: Send + Sync {
    /// Publishes `message` with its event id as the broker's message id, and returns only once
    /// the broker has taken responsibility for it (a JetStream ack, an AMQP publisher confirm, a
    /// Kafka delivery report). An error means it may or may not have been stored: publish again.
    fn publish(
        &self,
        message: &Message,
    ) -> impl Future<Output = Result<Published, BrokerError>> + Send;
}

/// One delivery of a message: the broker will deliver it again unless it is acknowledged.
pub trait Delivery: Send {
    /// The message delivered.
    fn message(&self) -> &Message;

    /// How many times the broker has delivered this message, this time included (1 on the
    /// first delivery). Brokers that do not count (Kafka) report the count this process saw.
    fn attempt(&self) -> u32;

    /// Tells the broker the message is done with: it will not be delivered again.
    fn ack(self) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Hands the message back for a later delivery (a transient failure).
    fn retry(self) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Moves the message to the dead-letter destination (a poison message, or one that has
    /// used up its deliveries), and acknowledges it here.
    fn dead_letter(self, reason: &str) -> impl Future<Output = Result<(), BrokerError>> + Send;
}

/// A stream of deliveries for one consumer (a JetStream durable consumer, an AMQP queue, a
/// Kafka consumer group).
pub trait Subscription: Send {
    /// The delivery type.
    type Delivery: Delivery;

    /// The next delivery, waiting for one; `None` once the subscription has ended.
    fn next(&mut self) -> impl Future<Output = Result<Option<Self::Delivery>, BrokerError>> + Send;
}
