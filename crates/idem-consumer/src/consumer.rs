//! The consumer loop: takes deliveries, runs the handler, and acknowledges only after the
//! handler's transaction has committed. A crash between the two means a redelivery, which the
//! inbox turns into "already done".

use std::future::Future;

use crate::{BrokerError, Delivery, Message, Subscription};

/// What a handler did with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// First time: the side effect was applied.
    Applied,
    /// The inbox already had the event: a redelivery or a duplicate publish, suppressed.
    Duplicate,
}

/// Why a handler could not apply a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// The message can never be applied (it does not parse, it names nothing): dead-letter it
    /// now rather than redeliver it.
    #[error("poison message: {0}")]
    Poison(String),
    /// Applying failed this time (a database outage, a timeout): deliver it again later, up to
    /// the delivery limit.
    #[error("transient failure")]
    Transient(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Applies messages. Implementations record the event in an [`crate::Inbox`] in the same
/// transaction as their side effect, and answer [`Handled::Duplicate`] when it was there.
pub trait Handler: Send + Sync {
    /// Applies `message` once, committing before it returns.
    fn handle(
        &self,
        message: &Message,
    ) -> impl Future<Output = Result<Handled, HandlerError>> + Send;
}

/// Counts of what a consumer did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Messages applied for the first time.
    pub applied: u64,
    /// Redeliveries and duplicates the inbox suppressed.
    pub duplicates: u64,
    /// Deliveries handed back after a transient failure.
    pub retried: u64,
    /// Messages moved to the dead-letter destination.
    pub dead_lettered: u64,
}

/// Runs a [`Handler`] over a [`Subscription`].
#[derive(Debug, Clone)]
pub struct Consumer<H> {
    name: String,
    handler: H,
    delivery_limit: u32,
}

impl<H: Handler> Consumer<H> {
    /// A consumer called `name` (its metrics label) applying `handler`, giving a message at
    /// most 5 deliveries before it is dead-lettered.
    pub fn new(name: impl Into<String>, handler: H) -> Self {
        Self {
            name: name.into(),
            handler,
            delivery_limit: 5,
        }
    }

    /// The most deliveries a message gets before it goes to the dead-letter destination (at
    /// least 1). Crashes count too, on brokers that count deliveries: a message that kills
    /// the worker every time is dead-lettered instead of killing it forever.
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = limit.max(1);
        self
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// Consumes until the subscription ends or `shutdown` completes. Returns when the
    /// subscription fails (the caller reconnects); unacknowledged deliveries are redelivered by
    /// the broker. A delivery whose outcome the broker did not take (an ack that timed out while
    /// a JetStream stream elected a new leader, say) is logged and left: the broker delivers it
    /// again, and the inbox turns that delivery into "already done".
    ///
    /// # Errors
    ///
    /// [`BrokerError`] when the subscription fails to give the next delivery.
    pub async fn run<S: Subscription>(
        &self,
        subscription: &mut S,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, BrokerError> {
        let mut stats = ConsumerStats::default();
        self.run_counting(subscription, shutdown, &mut stats)
            .await
            .map(|()| stats)
    }

    /// [`run`](Self::run), adding what it does to `stats` as it goes, so that a caller that
    /// subscribes again after a failure keeps the counts of every run.
    ///
    /// # Errors
    ///
    /// As for [`run`](Self::run).
    pub async fn run_counting<S: Subscription>(
        &self,
        subscription: &mut S,
        shutdown: impl Future<Output = ()>,
        stats: &mut ConsumerStats,
    ) -> Result<(), BrokerError> {
        tokio::pin!(shutdown);
        loop {
            let delivery = tokio::select! {
                () = &mut shutdown => return Ok(()),
                next = subscription.next() => match next? {
                    Some(delivery) => delivery,
                    None => return Ok(()),
                },
            };
            if let Err(e) = self.settle(delivery, stats).await {
                tracing::warn!(error = %idem_core::ErrorChain(&e), consumer = %self.name, "the broker did not take a delivery's outcome; it will deliver it again");
            }
        }
    }

    /// Handles one delivery and tells the broker how it went.
    ///
    /// # Errors
    ///
    /// [`BrokerError`] when the broker does not take the outcome (the ack, the retry or the
    /// dead-lettering); it will deliver the message again.
    pub async fn settle<D: Delivery>(
        &self,
        delivery: D,
        stats: &mut ConsumerStats,
    ) -> Result<(), BrokerError> {
        // One span per delivery, as the HTTP layer makes one per request (docs/contract.md
        // §15): its outcome is the `idem_consumer_events_total` label. The event's id is the
        // dedup key, so it is not recorded.
        let span = tracing::info_span!(
            target: "idem::request",
            "idempotency.message",
            idempotency.mode = "inbox",
            idempotency.outcome = tracing::field::Empty,
            messaging.consumer.group.name = %self.name,
            messaging.message.delivery_attempt = delivery.attempt(),
        );
        tracing::Instrument::instrument(self.settle_in_span(delivery, stats), span).await
    }

    async fn settle_in_span<D: Delivery>(
        &self,
        delivery: D,
        stats: &mut ConsumerStats,
    ) -> Result<(), BrokerError> {
        let attempt = delivery.attempt();
        let id = delivery.message().id.clone();
        if attempt > self.delivery_limit {
            // Delivered past the limit: the earlier deliveries died with their worker.
            tracing::error!(event_id = %id, attempt, limit = self.delivery_limit, "delivery limit exceeded; dead-lettering");
            self.count(&mut stats.dead_lettered, "dead_lettered");
            return delivery.dead_letter("delivery limit exceeded").await;
        }
        match self.handler.handle(delivery.message()).await {
            Ok(Handled::Applied) => {
                self.count(&mut stats.applied, "applied");
                delivery.ack().await
            }
            Ok(Handled::Duplicate) => {
                tracing::info!(event_id = %id, consumer = %self.name, attempt, "duplicate suppressed: the inbox already has this event");
                metrics::counter!("idem_consumer_duplicates_total", "consumer" => self.name.clone()).increment(1);
                self.count(&mut stats.duplicates, "duplicate");
                delivery.ack().await
            }
            Err(HandlerError::Poison(reason)) => {
                tracing::error!(event_id = %id, %reason, "poison message; dead-lettering");
                self.count(&mut stats.dead_lettered, "dead_lettered");
                delivery.dead_letter(&reason).await
            }
            Err(HandlerError::Transient(e)) if attempt >= self.delivery_limit => {
                tracing::error!(event_id = %id, attempt, error = %idem_core::ErrorChain(&*e), "failed on its last delivery; dead-lettering");
                self.count(&mut stats.dead_lettered, "dead_lettered");
                delivery
                    .dead_letter(&format!("failed {attempt} times; last: {e}"))
                    .await
            }
            Err(HandlerError::Transient(e)) => {
                tracing::warn!(event_id = %id, attempt, error = %idem_core::ErrorChain(&*e), "failed; the broker will deliver it again");
                self.count(&mut stats.retried, "retried");
                delivery.retry().await
            }
        }
    }

    fn count(&self, field: &mut u64, outcome: &'static str) {
        *field += 1;
        tracing::Span::current().record("idempotency.outcome", outcome);
        metrics::counter!("idem_consumer_events_total", "consumer" => self.name.clone(), "outcome" => outcome)
            .increment(1);
    }
}
