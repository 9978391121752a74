//! The JetStream adapter against the real server on 127.0.0.1:4222 (JetStream on). Each test
//! works in a namespace of its own and deletes its stream at the end.
#![cfg(feature = "nats")]

mod common;

use std::time::Duration;

use common::{GROUP, TOPIC, message, namespace, next_within, nothing};

use idem_consumer::any::{AnyPublisher, AnySubscription, BrokerSettings, delete_broker_objects};
use idem_consumer::nats::{NatsConfig, NatsPublisher, NatsSubscription, delete_namespace};
use idem_consumer::{Delivery, Published, Publisher, Subscription};

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

#[tokio::test]
async fn published_messages_arrive_with_their_ids_and_payloads() {
    let config = config();
    let publisher = NatsPublisher::connect(config.clone()).await.unwrap();
    let mut sub = NatsSubscription::connect(config.clone(), GROUP, TOPIC)
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
    nothing(&mut sub, Duration::from_millis(1500)).await;
    delete_namespace(&config).await.unwrap();
}

#[tokio::test]
async fn an_unacked_delivery_comes_back_to_the_next_consumer() {
    let config = config();
    let publisher = NatsPublisher::connect(config.clone()).await.unwrap();
    publisher.publish(&message("evt_crash", "x")).await.unwrap();

    let mut sub = NatsSubscription::connect(config.clone(), GROUP, TOPIC)
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

    let mut sub = NatsSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    let again = next(&mut sub).await;
    assert_eq!(
        (again.message().id.as_str(), again.attempt()),
        ("evt_crash", 2)
    );
    again.ack().await.unwrap();
    nothing(&mut sub, Duration::from_millis(1500)).await;
    delete_namespace(&config).await.unwrap();
}

#[tokio::test]
async fn a_retried_delivery_comes_back_with_a_higher_attempt() {
    let config = config();
    let publisher = NatsPublisher::connect(config.clone()).await.unwrap();
    publisher.publish(&message("evt_retry", "x")).await.unwrap();
    let mut sub = NatsSubscription::connect(config.clone(), GROUP, TOPIC)
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
    delete_namespace(&config).await.unwrap();
}

#[tokio::test]
async fn a_dead_lettered_message_is_kept_aside_and_not_redelivered() {
    let config = config();
    let publisher = NatsPublisher::connect(config.clone()).await.unwrap();
    publisher
        .publish(&message("evt_poison", "{bad"))
        .await
        .unwrap();
    publisher.publish(&message("evt_fine", "{}")).await.unwrap();
    let mut sub = NatsSubscription::connect(config.clone(), GROUP, TOPIC)
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
    nothing(&mut sub, Duration::from_millis(1500)).await;

    let mut dead = NatsSubscription::dead_letters(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    let letter = next(&mut dead).await;
    assert_eq!(letter.message(), &message("evt_poison", "{bad"));
    assert_eq!(letter.dead_reason(), Some("cannot parse the payload"));
    letter.ack().await.unwrap();
    delete_namespace(&config).await.unwrap();
}

#[tokio::test]
async fn the_same_id_twice_within_the_window_is_stored_once() {
    let config = config();
    let publisher = NatsPublisher::connect(config.clone()).await.unwrap();
    let event = message("evt_twice", "x");
    assert_eq!(publisher.publish(&event).await.unwrap(), Published::Stored);
    assert_eq!(
        publisher.publish(&event).await.unwrap(),
        Published::Duplicate
    );

    let mut sub = NatsSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    next(&mut sub).await.ack().await.unwrap();
    nothing(&mut sub, Duration::from_millis(1500)).await;
    delete_namespace(&config).await.unwrap();
}

#[tokio::test]
async fn any_broker_settings_reach_jetstream() {
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

    let config = NatsConfig {
        delivery_limit: 1,
        ..config()
    };
    let publisher = NatsPublisher::connect(config.clone()).await.unwrap();
    publisher
        .publish(&message("evt_killer", "{}"))
        .await
        .unwrap();
    {
        // The worker takes its one allowed delivery and dies before any answer.
        let mut crashed = NatsSubscription::connect(config.clone(), GROUP, TOPIC)
            .await
            .unwrap();
        let delivery = next(&mut crashed).await;
        assert_eq!(delivery.attempt(), 1);
    }
    let mut sub = NatsSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    let again = next(&mut sub).await;
    assert_eq!(again.attempt(), 2);
    let consumer = Consumer::new("receipts", Counting::default()).with_delivery_limit(1);
    let mut stats = ConsumerStats::default();
    consumer.settle(again, &mut stats).await.unwrap();
    assert_eq!(consumer.handler().0.load(Ordering::SeqCst), 0);
    assert_eq!(stats.dead_lettered, 1);

    let mut dead = NatsSubscription::dead_letters(config.clone(), GROUP, TOPIC)
        .await
        .unwrap();
    let letter = next(&mut dead).await;
    assert_eq!(letter.message().id.as_str(), "evt_killer");
    assert_eq!(letter.dead_reason(), Some("delivery limit exceeded"));
    letter.ack().await.unwrap();
    delete_namespace(&config).await.unwrap();
}
