//! The RabbitMQ adapter against the real broker on 127.0.0.1:5672 (guest/guest): the broker
//! suite, and what only RabbitMQ does. Each test works in a namespace of its own and deletes
//! its exchanges and queues at the end.
#![cfg(feature = "amqp")]

mod common;

use std::time::Duration;

use common::suite::Broker;
use common::{GROUP, TOPIC, message, namespace, next_within, nothing};

use idem_consumer::amqp::{
    AmqpConfig, AmqpDelivery, AmqpPublisher, AmqpSubscription, declare, delete,
};
use idem_consumer::any::BrokerSettings;
use idem_consumer::{Delivery, Publisher, Subscription};

const URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Long enough for any delivery that is coming on loopback.
const WAIT: Duration = Duration::from_secs(5);

fn config() -> AmqpConfig {
    idem_testkit::require(idem_testkit::Service::RabbitMq);
    let namespace = namespace();
    AmqpConfig {
        delivery_limit: 3,
        ..AmqpConfig::new(URL, namespace)
    }
}

/// A fresh namespace with the group's queues declared, so publishes are routable.
async fn setup() -> AmqpConfig {
    let config = config();
    declare(&config, GROUP, TOPIC).await.unwrap();
    config
}

async fn next<S: Subscription>(sub: &mut S) -> S::Delivery {
    next_within(sub, WAIT).await
}

/// A fresh namespace on RabbitMQ, its group's queues declared.
struct Amqp(AmqpConfig);

impl Broker for Amqp {
    type Publisher = AmqpPublisher;
    type Subscription = AmqpSubscription;
    type Delivery = AmqpDelivery;

    const WAIT: Duration = WAIT;
    const COUNTS_DELIVERIES: bool = true;
    const DROPS_DUPLICATES: bool = false;
    const RETRIES_IN_ORDER: bool = false;

    async fn fresh() -> Self {
        Self(setup().await)
    }

    async fn publisher(&self) -> AmqpPublisher {
        AmqpPublisher::connect(self.0.clone()).await.unwrap()
    }

    async fn subscribe(&self) -> AmqpSubscription {
        AmqpSubscription::connect(self.0.clone(), GROUP, TOPIC)
            .await
            .unwrap()
    }

    async fn dead_letters(&self) -> AmqpSubscription {
        AmqpSubscription::dead_letters(self.0.clone(), GROUP, TOPIC)
            .await
            .unwrap()
    }

    fn dead_reason(delivery: &AmqpDelivery) -> Option<&str> {
        delivery.dead_reason()
    }

    async fn nothing_more(&self, mut sub: AmqpSubscription) {
        // RabbitMQ redelivers at once or not at all (no timer): a short quiet is enough.
        nothing(&mut sub, Duration::from_millis(300)).await;
    }

    async fn delete(self) {
        delete(&self.0, GROUP, TOPIC).await.unwrap();
    }

    fn any_settings() -> BrokerSettings {
        idem_testkit::require(idem_testkit::Service::RabbitMq);
        BrokerSettings::new(URL, namespace(), TOPIC, GROUP)
    }
}

common::broker_suite!(Amqp);

#[tokio::test]
async fn a_message_returned_too_often_is_dead_lettered_by_the_broker() {
    // Three "crashes" use up the three deliveries of delivery_limit 3; the quorum queue then
    // dead-letters the message itself, as no consumer lived to do it.
    let broker = Amqp::fresh().await;
    let publisher = broker.publisher().await;
    publisher
        .publish(&message("evt_crashy", "x"))
        .await
        .unwrap();
    for attempt in 1..=3 {
        let mut sub = broker.subscribe().await;
        let delivery = next(&mut sub).await;
        assert_eq!(delivery.attempt(), attempt);
    }
    let mut dead = broker.dead_letters().await;
    let letter = next(&mut dead).await;
    assert_eq!(letter.message(), &message("evt_crashy", "x"));
    assert_eq!(letter.dead_reason(), Some("delivery_limit"));
    letter.ack().await.unwrap();
    broker.nothing_more(broker.subscribe().await).await;
    broker.delete().await;
}

#[tokio::test]
async fn a_publish_nobody_would_receive_is_an_error() {
    // No queue declared: the exchange routes the message nowhere.
    let broker = Amqp(config());
    let publisher = broker.publisher().await;
    let err = publisher
        .publish(&message("evt_lost", "x"))
        .await
        .unwrap_err();
    let refused = std::error::Error::source(&err)
        .and_then(|e| e.downcast_ref::<idem_consumer::amqp::PublishRefused>());
    assert!(
        matches!(
            refused,
            Some(idem_consumer::amqp::PublishRefused::Unroutable(..))
        ),
        "{err}"
    );
    broker.delete().await;
}
