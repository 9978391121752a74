//! The Kafka adapter against a Kafka-compatible broker on 127.0.0.1:19092 (tansu in CI): the
//! broker suite, and what only Kafka does. Each test works in a namespace of its own and
//! deletes its topics and groups at the end.
//!
//! Where a test must show that something is *not* delivered again, it publishes a marker
//! after it and waits for the marker: the first thing a fresh consumer of the group sees
//! then says whether the group's committed offset skipped the rest, without a fixed sleep.
#![cfg(feature = "kafka")]

mod common;

use std::time::Duration;

use common::suite::Broker;
use common::{GROUP, TOPIC, message, namespace, next_within};

use idem_consumer::any::BrokerSettings;
use idem_consumer::kafka::{KafkaConfig, KafkaDelivery, KafkaPublisher, KafkaSubscription, delete};
use idem_consumer::{Delivery, Publisher, Subscription};

const SERVERS: &str = "127.0.0.1:19092";
/// Joining a group takes a rebalance, which takes a few seconds on a fresh group.
const WAIT: Duration = Duration::from_secs(15);

fn config() -> KafkaConfig {
    idem_testkit::require(idem_testkit::Service::Kafka);
    let namespace = namespace();
    KafkaConfig {
        session_timeout: Duration::from_secs(6),
        ..KafkaConfig::new(SERVERS, namespace)
    }
}

async fn next<S: Subscription>(sub: &mut S) -> S::Delivery {
    next_within(sub, WAIT).await
}

async fn subscribe(config: &KafkaConfig) -> KafkaSubscription {
    KafkaSubscription::connect(config.clone(), GROUP, TOPIC)
        .await
        .unwrap()
}

/// The group's committed offset is past everything published so far: a marker published
/// now is the first thing a fresh member of the group sees.
async fn assert_committed_to_the_end(config: &KafkaConfig, publisher: &KafkaPublisher) {
    publisher
        .publish(&message("evt_marker", "x"))
        .await
        .unwrap();
    let mut sub = subscribe(config).await;
    assert_eq!(next(&mut sub).await.message().id.as_str(), "evt_marker");
}

/// A fresh namespace on Kafka.
struct Kafka(KafkaConfig);

impl Broker for Kafka {
    type Publisher = KafkaPublisher;
    type Subscription = KafkaSubscription;
    type Delivery = KafkaDelivery;

    const WAIT: Duration = WAIT;
    const COUNTS_DELIVERIES: bool = false;
    const DROPS_DUPLICATES: bool = false;
    const RETRIES_IN_ORDER: bool = true;

    async fn fresh() -> Self {
        Self(config())
    }

    async fn publisher(&self) -> KafkaPublisher {
        KafkaPublisher::connect(self.0.clone()).await.unwrap()
    }

    async fn subscribe(&self) -> KafkaSubscription {
        subscribe(&self.0).await
    }

    async fn dead_letters(&self) -> KafkaSubscription {
        KafkaSubscription::dead_letters(self.0.clone(), GROUP, TOPIC)
            .await
            .unwrap()
    }

    fn dead_reason(delivery: &KafkaDelivery) -> Option<&str> {
        delivery.dead_reason()
    }

    async fn nothing_more(&self, sub: KafkaSubscription) {
        // The member leaves the group, so the marker's reader gets the partition at once.
        drop(sub);
        assert_committed_to_the_end(&self.0, &self.publisher().await).await;
    }

    async fn delete(self) {
        delete(&self.0, GROUP, TOPIC).await.unwrap();
    }

    fn any_settings() -> BrokerSettings {
        idem_testkit::require(idem_testkit::Service::Kafka);
        BrokerSettings {
            session_timeout: Duration::from_secs(6),
            ..BrokerSettings::new(format!("kafka://{SERVERS}"), namespace(), TOPIC, GROUP)
        }
    }
}

common::broker_suite!(Kafka);

#[tokio::test]
async fn offsets_of_unacked_messages_are_not_committed() {
    let config = config();
    let publisher = KafkaPublisher::connect(config.clone()).await.unwrap();
    for id in ["evt_a", "evt_b", "evt_c"] {
        publisher.publish(&message(id, "x")).await.unwrap();
    }

    let mut sub = subscribe(&config).await;
    next(&mut sub).await.ack().await.unwrap();
    let b = next(&mut sub).await;
    assert_eq!(b.message().id.as_str(), "evt_b");
    let c = next(&mut sub).await;
    // evt_b is never acknowledged ("crash"): acknowledging evt_c must not commit past it.
    c.ack().await.unwrap();
    drop(b);
    drop(sub);

    let mut sub = subscribe(&config).await;
    for id in ["evt_b", "evt_c"] {
        let delivery = next(&mut sub).await;
        assert_eq!(delivery.message().id.as_str(), id);
        // A new process: the count restarts (Kafka keeps none).
        assert_eq!(delivery.attempt(), 1);
        delivery.ack().await.unwrap();
    }
    drop(sub);

    assert_committed_to_the_end(&config, &publisher).await;
    delete(&config, GROUP, TOPIC).await.unwrap();
}

/// The child half of [`a_killed_consumers_partition_goes_to_the_next_one`]: takes one
/// delivery, says so, and then hangs until it is killed.
#[tokio::test]
#[ignore = "run only as the child of a_killed_consumers_partition_goes_to_the_next_one"]
async fn child_takes_one_and_hangs() {
    let Ok(namespace) = std::env::var("IDEM_KAFKA_CHILD_NAMESPACE") else {
        return;
    };
    let config = KafkaConfig {
        session_timeout: Duration::from_secs(6),
        ..KafkaConfig::new(SERVERS, namespace)
    };
    let mut sub = subscribe(&config).await;
    let delivery = next(&mut sub).await;
    println!("CHILD GOT {}", delivery.message().id);
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn a_killed_consumers_partition_goes_to_the_next_one() {
    use std::io::{BufRead, BufReader};

    // A consumer killed outright (no LeaveGroup, no commit) holds its partition until the
    // group's session timeout; then the next member gets the message again.
    let config = config();
    let publisher = KafkaPublisher::connect(config.clone()).await.unwrap();
    publisher
        .publish(&message("evt_killed", "x"))
        .await
        .unwrap();

    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_takes_one_and_hangs",
            "--ignored",
            "--nocapture",
        ])
        .env("IDEM_KAFKA_CHILD_NAMESPACE", &config.namespace)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let got = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("CHILD GOT evt_killed"))
    });
    assert!(tokio::time::timeout(WAIT, got).await.unwrap().unwrap());
    child.kill().unwrap();
    child.wait().unwrap();

    let mut sub = subscribe(&config).await;
    let again = next(&mut sub).await;
    assert_eq!(again.message().id.as_str(), "evt_killed");
    again.ack().await.unwrap();
    drop(sub);
    delete(&config, GROUP, TOPIC).await.unwrap();
}
