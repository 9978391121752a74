//! The RabbitMQ adapter against the real broker on 127.0.0.1:5672 (guest/guest). Each test
//! works in a namespace of its own and deletes its exchanges and queues at the end.
#![cfg(feature = "amqp")]

mod common;

use std::time::Duration;

use common::{GROUP, TOPIC, message, namespace, next_within, nothing};

use idem_consumer::amqp::{AmqpConfig, AmqpPublisher, AmqpSubscription, declare, delete};
use idem_consumer::any::{AnyPublisher, AnySubscription, BrokerSettings, delete_broker_objects};
use idem_consumer::{Delivery, Published, Publisher, Subscription};

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

#[tokio::test]
async fn published_messages_arrive_with_their_ids_and_payloads() {
    let config = setup().await;
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    let mut sub = AmqpSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    for i in 0..5 {
        let outcome = publisher
            .publish(&message(&format!("evt_{i}"), &format!("{{\"n\":{i}}}")))
            .await;
        assert_eq!(outcome.unwrap(), Published::Stored);
    }
    for i in 0..5 {
        let delivery = next(&mut sub).await;
        assert_eq!(
            delivery.message(),
            &message(&format!("evt_{i}"), &format!("{{\"n\":{i}}}"))
        );
        assert_eq!(delivery.attempt(), 1);
        delivery.ack().await.unwrap();
    }
    nothing(&mut sub, Duration::from_millis(300)).await;
    delete(&config, GROUP, TOPIC).await.unwrap();
}

#[tokio::test]
async fn an_unacked_delivery_comes_back_to_the_next_consumer() {
    let config = setup().await;
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    publisher.publish(&message("evt_crash", "x")).await.unwrap();

    let mut sub = AmqpSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    let first = next(&mut sub).await;
    assert_eq!(
        (first.message().id.as_str(), first.attempt()),
        ("evt_crash", 1)
    );
    // The consumer "crashes": no ack, its connection goes.
    drop(first);
    drop(sub);

    let mut sub = AmqpSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    let again = next(&mut sub).await;
    assert_eq!(
        (again.message().id.as_str(), again.attempt()),
        ("evt_crash", 2)
    );
    again.ack().await.unwrap();
    nothing(&mut sub, Duration::from_millis(300)).await;
    delete(&config, GROUP, TOPIC).await.unwrap();
}

#[tokio::test]
async fn a_retried_delivery_comes_back_with_a_higher_attempt() {
    let config = setup().await;
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    publisher.publish(&message("evt_retry", "x")).await.unwrap();
    let mut sub = AmqpSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();

    for attempt in 1..=2 {
        let delivery = next(&mut sub).await;
        assert_eq!(
            (delivery.message().id.as_str(), delivery.attempt()),
            ("evt_retry", attempt)
        );
        delivery.retry().await.unwrap();
    }
    let last = next(&mut sub).await;
    assert_eq!(
        last.attempt(),
        3,
        "the delivery limit's last attempt is visible as such"
    );
    last.ack().await.unwrap();
    delete(&config, GROUP, TOPIC).await.unwrap();
}

#[tokio::test]
async fn a_dead_lettered_message_is_kept_aside_and_not_redelivered() {
    let config = setup().await;
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    publisher
        .publish(&message("evt_poison", "{bad"))
        .await
        .unwrap();
    publisher.publish(&message("evt_fine", "{}")).await.unwrap();
    let mut sub = AmqpSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();

    next(&mut sub)
        .await
        .dead_letter("cannot parse the payload")
        .await
        .unwrap();
    let fine = next(&mut sub).await;
    assert_eq!(fine.message().id.as_str(), "evt_fine");
    fine.ack().await.unwrap();
    nothing(&mut sub, Duration::from_millis(300)).await;

    let mut dead = AmqpSubscription::dead_letters(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    let letter = next(&mut dead).await;
    assert_eq!(letter.message(), &message("evt_poison", "{bad"));
    assert_eq!(letter.dead_reason(), Some("cannot parse the payload"));
    letter.ack().await.unwrap();
    delete(&config, GROUP, TOPIC).await.unwrap();
}

#[tokio::test]
async fn the_same_id_twice_is_queued_twice_for_the_inbox_to_dedup() {
    // RabbitMQ has no duplicate window: both copies are stored and delivered.
    let config = setup().await;
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    let event = message("evt_twice", "x");
    assert_eq!(publisher.publish(&event).await.unwrap(), Published::Stored);
    assert_eq!(publisher.publish(&event).await.unwrap(), Published::Stored);

    let mut sub = AmqpSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    for _ in 0..2 {
        let delivery = next(&mut sub).await;
        assert_eq!(delivery.message(), &event);
        delivery.ack().await.unwrap();
    }
    delete(&config, GROUP, TOPIC).await.unwrap();
}

#[tokio::test]
async fn a_message_returned_too_often_is_dead_lettered_by_the_broker() {
    // Three "crashes" use up the three deliveries of delivery_limit 3; the quorum queue then
    // dead-letters the message itself, as no consumer lived to do it.
    let config = setup().await;
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    publisher
        .publish(&message("evt_crashy", "x"))
        .await
        .unwrap();
    for attempt in 1..=3 {
        let mut sub = AmqpSubscription::connect(config.clone(), GROUP, TOPIC)
            .await
            .unwrap();
        let delivery = next(&mut sub).await;
        assert_eq!(delivery.attempt(), attempt);
    }
    let mut dead = AmqpSubscription::dead_letters(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    let letter = next(&mut dead).await;
    assert_eq!(letter.message(), &message("evt_crashy", "x"));
    assert_eq!(letter.dead_reason(), Some("delivery_limit"));
    letter.ack().await.unwrap();
    let mut sub = AmqpSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    nothing(&mut sub, Duration::from_millis(300)).await;
    delete(&config, GROUP, TOPIC).await.unwrap();
}

#[tokio::test]
async fn a_publish_nobody_would_receive_is_an_error() {
    let config = config();
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
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
    delete(&config, GROUP, TOPIC).await.unwrap();
}

#[tokio::test]
async fn any_broker_settings_reach_rabbitmq() {
    let namespace = namespace();
    let settings = BrokerSettings::new(URL, namespace, TOPIC, GROUP);
    let publisher = AnyPublisher::connect(&settings).await.unwrap();
    let mut sub = AnySubscription::connect(&settings).await.unwrap();
    publisher.publish(&message("evt_any", "x")).await.unwrap();
    let delivery = next(&mut sub).await;
    assert_eq!(delivery.message(), &message("evt_any", "x"));
    delivery
        .dead_letter("checking the dead letters")
        .await
        .unwrap();

    let mut dead = AnySubscription::dead_letters(&settings).await.unwrap();
    let letter = next(&mut dead).await;
    assert_eq!(letter.dead_reason(), Some("checking the dead letters"));
    letter.ack().await.unwrap();
    delete_broker_objects(&settings).await.unwrap();
}
