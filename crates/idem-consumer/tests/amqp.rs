//! The RabbitMQ adapter against the real broker on 127.0.0.1:5672 (guest/guest): the broker
//! suite, and what only RabbitMQ does. Each test works in a namespace of its own and deletes
//! its exchanges and queues at the end.
#![cfg(feature = "amqp")]

mod common;

use std::time::Duration;

use common::suite::{Broker, adapter, fresh_with};
use common::{GROUP, TOPIC, message, namespace_on, nothing};

use idem_consumer::amqp::{AmqpConfig, AmqpPublisher, AmqpSubscription, declare, delete};
use idem_consumer::any::BrokerSettings;
use idem_consumer::{Delivery, Publisher};
use idem_testkit::Service;

const URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Long enough for any delivery that is coming on loopback.
const WAIT: Duration = Duration::from_secs(5);

/// A fresh namespace, its queues not declared yet.
fn config() -> AmqpConfig {
    AmqpConfig {
        delivery_limit: 3,
        ..AmqpConfig::new(URL, namespace_on(Service::RabbitMq))
    }
}

/// A fresh namespace on RabbitMQ, its group's queues declared so that publishes are routable.
impl Broker for AmqpConfig {
    adapter!(Amqp, WAIT, AmqpPublisher, AmqpSubscription);

    async fn fresh() -> Self {
        let config = config();
        declare(&config, GROUP, TOPIC).await.unwrap();
        config
    }

    async fn nothing_more(&self, mut sub: AmqpSubscription) {
        // RabbitMQ redelivers at once or not at all (no timer): a short quiet is enough.
        nothing(&mut sub, Duration::from_millis(300)).await;
    }

    async fn delete(self) {
        delete(&self, GROUP, TOPIC).await.unwrap();
    }

    fn any_settings() -> BrokerSettings {
        common::any_settings(Service::RabbitMq, URL)
    }
}

common::broker_suite!(AmqpConfig);

#[tokio::test]
async fn a_message_returned_too_often_is_dead_lettered_by_the_broker() {
    // Three "crashes" use up the three deliveries of delivery_limit 3; the quorum queue then
    // dead-letters the message itself, as no consumer lived to do it.
    let broker: AmqpConfig = fresh_with(&[message("evt_crashy", "x")]).await;
    for attempt in 1..=3 {
        let mut sub = broker.subscribe().await;
        let delivery = AmqpConfig::next(&mut sub).await;
        assert_eq!(delivery.attempt(), attempt);
    }
    let mut dead = broker.dead_letters().await;
    let letter = AmqpConfig::next(&mut dead).await;
    assert_eq!(letter.message(), &message("evt_crashy", "x"));
    assert_eq!(letter.dead_reason(), Some("delivery_limit"));
    letter.ack().await.unwrap();
    broker.nothing_more(broker.subscribe().await).await;
    broker.delete().await;
}

#[tokio::test]
async fn a_publish_nobody_would_receive_is_an_error() {
    // No queue declared: the exchange routes the message nowhere.
    let broker = config();
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
