//! The broker suite: every scenario written once, as a generic async function, and run
//! against NATS, RabbitMQ and Kafka by [`broker_suite!`](crate::common::broker_suite), as the
//! store conformance suite runs against every store.
//!
//! A broker's test file implements [`Broker`] for its adapter's config (a fresh namespace,
//! the adapter's types through [`adapter!`](crate::common::suite::adapter), how to show that
//! nothing more comes and how to clean up) and instantiates the suite; where brokers differ on
//! purpose is written here, side by side, by [`BrokerKind`]. What only one broker does stays a
//! test of its own in that file.

use std::fmt::Debug;
use std::time::Duration;

use idem_consumer::any::{
    AnyPublisher, AnySubscription, BrokerKind, BrokerSettings, delete_broker_objects,
};
use idem_consumer::{Delivery, Message, Published, Publisher, Subscription};

use super::{message, next_within};

/// One broker as the suite sees it, implemented by its adapter's config: a value is one fresh
/// namespace on it, with whatever publishing there needs already declared.
pub trait Broker: Sized {
    /// Which broker it is.
    const KIND: BrokerKind;
    /// Long enough for any delivery that is coming.
    const WAIT: Duration;

    /// The adapter's publisher.
    type Publisher: Publisher;
    /// The adapter's subscription.
    type Subscription: Subscription<Delivery = Self::Delivery>;
    /// The adapter's delivery.
    type Delivery: Delivery + Debug;

    /// A fresh namespace on the broker.
    async fn fresh() -> Self;
    /// The next delivery on `sub`, within [`Broker::WAIT`].
    async fn next<S: Subscription>(sub: &mut S) -> S::Delivery {
        next_within(sub, Self::WAIT).await
    }
    /// A publisher into the namespace.
    async fn publisher(&self) -> Self::Publisher;
    /// A subscription of the group `GROUP` on `TOPIC`.
    async fn subscribe(&self) -> Self::Subscription;
    /// The dead letters `GROUP` left on `TOPIC`.
    async fn dead_letters(&self) -> Self::Subscription;
    /// Why a delivery read from the dead letters was dead-lettered.
    fn dead_reason(delivery: &Self::Delivery) -> Option<&str>;
    /// Shows that `sub`'s group is given nothing more, and lets `sub` go.
    async fn nothing_more(&self, sub: Self::Subscription);
    /// Deletes the namespace's broker objects; every subscription must be gone.
    async fn delete(self);
    /// Settings naming this broker and a fresh namespace, for the `any` module.
    fn any_settings() -> BrokerSettings;
}

/// Writes, inside `impl Broker for` an adapter's config, the items that only name the broker
/// (the [`BrokerKind`] variant `$kind`, its `$wait`) and the adapter's types, and call the
/// adapter's constructors on the config: alike on every broker.
macro_rules! adapter {
    ($kind:ident, $wait:expr, $publisher:ident, $subscription:ident) => {
        const KIND: idem_consumer::any::BrokerKind = idem_consumer::any::BrokerKind::$kind;
        const WAIT: std::time::Duration = $wait;

        type Publisher = $publisher;
        type Subscription = $subscription;
        type Delivery = <$subscription as idem_consumer::Subscription>::Delivery;

        async fn publisher(&self) -> $publisher {
            $publisher::connect(self.clone()).await.unwrap()
        }

        async fn subscribe(&self) -> $subscription {
            let (group, topic) = ($crate::common::GROUP, $crate::common::TOPIC);
            $subscription::connect(self.clone(), group, topic)
                .await
                .unwrap()
        }

        async fn dead_letters(&self) -> $subscription {
            let (group, topic) = ($crate::common::GROUP, $crate::common::TOPIC);
            $subscription::dead_letters(self.clone(), group, topic)
                .await
                .unwrap()
        }

        fn dead_reason(delivery: &Self::Delivery) -> Option<&str> {
            delivery.dead_reason()
        }
    };
}
pub(crate) use adapter;

/// Whether the broker counts deliveries itself, so that a message redelivered to the next
/// consumer says attempt 2. Kafka keeps no count: a new subscription starts again at 1.
fn counts_deliveries<B: Broker>() -> bool {
    B::KIND != BrokerKind::Kafka
}

/// Whether a second publish of one id is dropped by the broker (JetStream's duplicate
/// window). Brokers without one store both copies, for the inbox to dedup.
fn drops_duplicates<B: Broker>() -> bool {
    B::KIND == BrokerKind::Nats
}

/// Whether a retried message comes back before the messages behind it (Kafka seeks back to
/// its offset). Elsewhere the order of a redelivery and the next message is open.
fn retries_in_order<B: Broker>() -> bool {
    B::KIND == BrokerKind::Kafka
}

/// A fresh namespace on `B` with `messages` published into it, each stored.
pub async fn fresh_with<B: Broker>(messages: &[Message]) -> B {
    let broker = B::fresh().await;
    let publisher = broker.publisher().await;
    for message in messages {
        assert_eq!(publisher.publish(message).await.unwrap(), Published::Stored);
    }
    broker
}

/// Five published messages arrive in order, with their ids and payloads, once each.
pub async fn published_messages_arrive_with_their_ids_and_payloads<B: Broker>() {
    let broker = B::fresh().await;
    let publisher = broker.publisher().await;
    let mut sub = broker.subscribe().await;
    for i in 0..5 {
        let outcome = publisher
            .publish(&message(&format!("evt_{i}"), &format!("{{\"n\":{i}}}")))
            .await;
        assert_eq!(outcome.unwrap(), Published::Stored);
    }
    for i in 0..5 {
        let delivery = B::next(&mut sub).await;
        assert_eq!(
            delivery.message(),
            &message(&format!("evt_{i}"), &format!("{{\"n\":{i}}}"))
        );
        assert_eq!(delivery.attempt(), 1);
        delivery.ack().await.unwrap();
    }
    broker.nothing_more(sub).await;
    broker.delete().await;
}

/// A consumer that "crashes" (no ack, its connection goes) gets its message delivered again
/// to the next consumer of the group.
pub async fn an_unacked_delivery_comes_back_to_the_next_consumer<B: Broker>() {
    let broker: B = fresh_with(&[message("evt_crash", "x")]).await;

    let mut sub = broker.subscribe().await;
    let first = B::next(&mut sub).await;
    assert_eq!(
        (first.message().id.as_str(), first.attempt()),
        ("evt_crash", 1)
    );
    drop(first);
    drop(sub);

    let mut sub = broker.subscribe().await;
    let again = B::next(&mut sub).await;
    let attempt = if counts_deliveries::<B>() { 2 } else { 1 };
    assert_eq!(
        (again.message().id.as_str(), again.attempt()),
        ("evt_crash", attempt)
    );
    again.ack().await.unwrap();
    broker.nothing_more(sub).await;
    broker.delete().await;
}

/// A retried delivery comes back with its attempt counted up, and the message behind it
/// still arrives, once.
pub async fn a_retried_delivery_comes_back_with_a_higher_attempt<B: Broker>() {
    let broker: B = fresh_with(&[message("evt_retry", "x"), message("evt_after", "y")]).await;
    let mut sub = broker.subscribe().await;

    // evt_retry is retried on its first two attempts; everything else is acknowledged.
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let delivery = B::next(&mut sub).await;
        let (id, attempt) = (delivery.message().id.to_string(), delivery.attempt());
        if id == "evt_retry" && attempt < 3 {
            delivery.retry().await.unwrap();
        } else {
            delivery.ack().await.unwrap();
        }
        seen.push((id, attempt));
    }
    let attempts = |of: &str| -> Vec<u32> {
        seen.iter()
            .filter(|(id, _)| id == of)
            .map(|&(_, attempt)| attempt)
            .collect()
    };
    assert_eq!(
        attempts("evt_retry"),
        [1, 2, 3],
        "the delivery limit's last attempt is visible as such"
    );
    assert_eq!(attempts("evt_after"), [1]);
    if retries_in_order::<B>() {
        let ids: Vec<&str> = seen.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["evt_retry", "evt_retry", "evt_retry", "evt_after"]);
    }
    drop(sub);
    broker.delete().await;
}

/// A dead-lettered message is not delivered again to its group; it waits in the dead letters
/// with its id, payload and reason, and the message behind it is delivered as usual.
pub async fn a_dead_lettered_message_is_kept_aside_and_not_redelivered<B: Broker>() {
    let broker: B = fresh_with(&[message("evt_poison", "{bad"), message("evt_fine", "{}")]).await;
    let mut sub = broker.subscribe().await;

    let poison = B::next(&mut sub).await;
    assert_eq!(poison.message().id.as_str(), "evt_poison");
    poison
        .dead_letter("cannot parse the payload")
        .await
        .unwrap();
    let fine = B::next(&mut sub).await;
    assert_eq!(fine.message().id.as_str(), "evt_fine");
    fine.ack().await.unwrap();
    broker.nothing_more(sub).await;

    let mut dead = broker.dead_letters().await;
    let letter = B::next(&mut dead).await;
    assert_eq!(letter.message(), &message("evt_poison", "{bad"));
    assert_eq!(B::dead_reason(&letter), Some("cannot parse the payload"));
    letter.ack().await.unwrap();
    drop(dead);
    broker.delete().await;
}

/// The same id published twice: JetStream's duplicate window drops the second copy and says
/// so; a broker without one stores and delivers both, for the inbox to dedup.
pub async fn the_same_id_published_twice<B: Broker>() {
    let broker = B::fresh().await;
    let publisher = broker.publisher().await;
    let event = message("evt_twice", "x");
    assert_eq!(publisher.publish(&event).await.unwrap(), Published::Stored);
    let (second, copies) = if drops_duplicates::<B>() {
        (Published::Duplicate, 1)
    } else {
        (Published::Stored, 2)
    };
    assert_eq!(publisher.publish(&event).await.unwrap(), second);

    let mut sub = broker.subscribe().await;
    for _ in 0..copies {
        let delivery = B::next(&mut sub).await;
        assert_eq!(delivery.message(), &event);
        delivery.ack().await.unwrap();
    }
    broker.nothing_more(sub).await;
    broker.delete().await;
}

/// `BrokerSettings` with the broker's URL reach it through the `any` types: publish, consume,
/// dead-letter, read the dead letters back, and delete what they declared.
pub async fn any_broker_settings_reach_the_broker<B: Broker>() {
    let settings = B::any_settings();
    let publisher = AnyPublisher::connect(&settings).await.unwrap();
    let mut sub = AnySubscription::connect(&settings).await.unwrap();
    publisher.publish(&message("evt_any", "x")).await.unwrap();
    let delivery = B::next(&mut sub).await;
    assert_eq!(delivery.message(), &message("evt_any", "x"));
    delivery
        .dead_letter("checking the dead letters")
        .await
        .unwrap();
    drop(sub);

    let mut dead = AnySubscription::dead_letters(&settings).await.unwrap();
    let letter = B::next(&mut dead).await;
    assert_eq!(letter.message(), &message("evt_any", "x"));
    assert_eq!(letter.dead_reason(), Some("checking the dead letters"));
    letter.ack().await.unwrap();
    drop(dead);
    delete_broker_objects(&settings).await.unwrap();
}
