//! The JetStream adapter against the real server on 127.0.0.1:4222 (JetStream on): the broker
//! suite, and what only JetStream does. Each test works in a namespace of its own and deletes
//! its stream at the end.
#![cfg(feature = "nats")]

mod common;

use std::time::Duration;

use common::suite::Broker;
use common::{GROUP, TOPIC, message, namespace, next_within, nothing};

use idem_consumer::any::{AnyPublisher, BrokerSettings};
use idem_consumer::nats::{
    NatsConfig, NatsDelivery, NatsPublisher, NatsSubscription, delete_namespace,
};
use idem_consumer::{Delivery, Publisher, Subscription};

const URL: &str = "nats://127.0.0.1:4222";
/// Long enough for any delivery that is coming on loopback.
const WAIT: Duration = Duration::from_secs(5);

fn config() -> NatsConfig {
    idem_testkit::require(idem_testkit::Service::Nats);
    let namespace = namespace();
    NatsConfig {
        // Short, so that a "crashed" consumer's message comes back quickly.
        ack_wait: Duration::from_secs(1),
        delivery_limit: 3,
        ..NatsConfig::new(URL, namespace)
    }
}

async fn next<S: Subscription>(sub: &mut S) -> S::Delivery {
    next_within(sub, WAIT).await
}

/// A fresh namespace on JetStream.
struct Nats(NatsConfig);

impl Broker for Nats {
    type Publisher = NatsPublisher;
    type Subscription = NatsSubscription;
    type Delivery = NatsDelivery;

    const WAIT: Duration = WAIT;
    const COUNTS_DELIVERIES: bool = true;
    const DROPS_DUPLICATES: bool = true;
    const RETRIES_IN_ORDER: bool = false;

    async fn fresh() -> Self {
        Self(config())
    }

    async fn publisher(&self) -> NatsPublisher {
        NatsPublisher::connect(self.0.clone()).await.unwrap()
    }

    async fn subscribe(&self) -> NatsSubscription {
        NatsSubscription::connect(self.0.clone(), GROUP, TOPIC)
            .await
            .unwrap()
    }

    async fn dead_letters(&self) -> NatsSubscription {
        NatsSubscription::dead_letters(self.0.clone(), GROUP, TOPIC)
            .await
            .unwrap()
    }

    fn dead_reason(delivery: &NatsDelivery) -> Option<&str> {
        delivery.dead_reason()
    }

    async fn nothing_more(&self, mut sub: NatsSubscription) {
        // Longer than ack_wait, so an unacknowledged message would have come back.
        nothing(&mut sub, Duration::from_millis(1500)).await;
    }

    async fn delete(self) {
        delete_namespace(&self.0).await.unwrap();
    }

    fn any_settings() -> BrokerSettings {
        idem_testkit::require(idem_testkit::Service::Nats);
        BrokerSettings::new(URL, namespace(), TOPIC, GROUP)
    }
}

common::broker_suite!(Nats);

#[tokio::test]
async fn an_unknown_scheme_is_a_typed_error() {
    let settings = BrokerSettings::new("redis://127.0.0.1", "t", TOPIC, GROUP);
    let err = AnyPublisher::connect(&settings).await.unwrap_err();
    let source = std::error::Error::source(&err).unwrap();
    let unsupported = source
        .downcast_ref::<idem_consumer::any::UnsupportedBroker>()
        .expect("an UnsupportedBroker");
    assert_eq!(unsupported.scheme, "redis");
}

/// A message whose last allowed delivery died with its worker (no ack, no retry) comes back
/// once more, and the consumer loop dead-letters it without running the handler again: a
/// message that kills every worker cannot kill them forever.
#[tokio::test]
async fn a_message_whose_last_attempt_crashed_is_dead_lettered_unhandled() {
    use idem_consumer::{Consumer, ConsumerStats, Handled, Handler, HandlerError};
    use std::sync::atomic::{AtomicU32, Ordering};

    #[derive(Debug, Default)]
    struct Counting(AtomicU32);
    impl Handler for Counting {
        async fn handle(&self, _: &idem_consumer::Message) -> Result<Handled, HandlerError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(Handled::Applied)
        }
    }

    let broker = Nats(NatsConfig {
        delivery_limit: 1,
        ..config()
    });
    let publisher = broker.publisher().await;
    publisher
        .publish(&message("evt_killer", "{}"))
        .await
        .unwrap();
    {
        // The worker takes its one allowed delivery and dies before any answer.
        let mut crashed = broker.subscribe().await;
        let delivery = next(&mut crashed).await;
        assert_eq!(delivery.attempt(), 1);
    }
    let mut sub = broker.subscribe().await;
    let again = next(&mut sub).await;
    assert_eq!(again.attempt(), 2);
    let consumer = Consumer::new("receipts", Counting::default()).with_delivery_limit(1);
    let mut stats = ConsumerStats::default();
    consumer.settle(again, &mut stats).await.unwrap();
    assert_eq!(consumer.handler().0.load(Ordering::SeqCst), 0);
    assert_eq!(stats.dead_lettered, 1);

    let mut dead = broker.dead_letters().await;
    let letter = next(&mut dead).await;
    assert_eq!(letter.message().id.as_str(), "evt_killer");
    assert_eq!(letter.dead_reason(), Some("delivery limit exceeded"));
    letter.ack().await.unwrap();
    broker.delete().await;
}
