//! The JetStream adapter against the real server on 127.0.0.1:4222 (JetStream on): the broker
//! suite, and what only JetStream does. Each test works in a namespace of its own and deletes
//! its stream at the end.
#![cfg(feature = "nats")]

mod common;

use std::time::Duration;

use common::suite::{Broker, adapter};
use common::{GROUP, TOPIC, message, namespace_on, nothing};

use idem_consumer::any::{AnyPublisher, BrokerSettings};
use idem_consumer::nats::{NatsConfig, NatsPublisher, NatsSubscription, delete_namespace};
use idem_consumer::{Delivery, Publisher};
use idem_testkit::Service;

const URL: &str = "nats://127.0.0.1:4222";
/// Long enough for any delivery that is coming on loopback.
const WAIT: Duration = Duration::from_secs(5);

fn config() -> NatsConfig {
    NatsConfig {
        // Short, so that a "crashed" consumer's message comes back quickly.
        ack_wait: Duration::from_secs(1),
        delivery_limit: 3,
        ..NatsConfig::new(URL, namespace_on(Service::Nats))
    }
}

/// A fresh namespace on JetStream.
impl Broker for NatsConfig {
    adapter!(Nats, WAIT, NatsPublisher, NatsSubscription);

    async fn fresh() -> Self {
        config()
    }

    async fn nothing_more(&self, mut sub: NatsSubscription) {
        // Longer than ack_wait, so an unacknowledged message would have come back.
        nothing(&mut sub, Duration::from_millis(1500)).await;
    }

    async fn delete(self) {
        delete_namespace(&self).await.unwrap();
    }

    fn any_settings() -> BrokerSettings {
        common::any_settings(Service::Nats, URL)
    }
}

common::broker_suite!(NatsConfig);

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

    let broker = NatsConfig {
        delivery_limit: 1,
        ..config()
    };
    let publisher = broker.publisher().await;
    publisher
        .publish(&message("evt_killer", "{}"))
        .await
        .unwrap();
    {
        // The worker takes its one allowed delivery and dies before any answer.
        let mut crashed = broker.subscribe().await;
        let delivery = NatsConfig::next(&mut crashed).await;
        assert_eq!(delivery.attempt(), 1);
    }
    let mut sub = broker.subscribe().await;
    let again = NatsConfig::next(&mut sub).await;
    assert_eq!(again.attempt(), 2);
    let consumer = Consumer::new("receipts", Counting::default()).with_delivery_limit(1);
    let mut stats = ConsumerStats::default();
    consumer.settle(again, &mut stats).await.unwrap();
    assert_eq!(consumer.handler().0.load(Ordering::SeqCst), 0);
    assert_eq!(stats.dead_lettered, 1);

    let mut dead = broker.dead_letters().await;
    let letter = NatsConfig::next(&mut dead).await;
    assert_eq!(letter.message().id.as_str(), "evt_killer");
    assert_eq!(letter.dead_reason(), Some("delivery limit exceeded"));
    letter.ack().await.unwrap();
    broker.delete().await;
}
