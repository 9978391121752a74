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

use common::suite::{Broker, adapter};
use common::{GROUP, TOPIC, message, namespace_on};

use idem_consumer::any::BrokerSettings;
use idem_consumer::kafka::{KafkaConfig, KafkaPublisher, KafkaSubscription, delete};
use idem_consumer::{Delivery, Publisher};
use idem_testkit::Service;

const SERVERS: &str = "127.0.0.1:19092";
/// Joining a group takes a rebalance, which takes a few seconds on a fresh group.
const WAIT: Duration = Duration::from_secs(15);

/// How long the group waits for a silent member: short, so that a killed consumer's partition
/// moves on quickly, and within what the broker allows.
const SESSION_TIMEOUT: Duration = Duration::from_secs(6);

/// The config for `namespace`, as this test binary's children get it too.
fn config_for(namespace: String) -> KafkaConfig {
    KafkaConfig {
        session_timeout: SESSION_TIMEOUT,
        ..KafkaConfig::new(SERVERS, namespace)
    }
}

fn config() -> KafkaConfig {
    config_for(namespace_on(Service::Kafka))
}

/// The group's committed offset is past everything published so far: a marker published
/// now is the first thing a fresh member of the group sees.
async fn assert_committed_to_the_end(config: &KafkaConfig, publisher: &KafkaPublisher) {
    publisher
        .publish(&message("evt_marker", "x"))
        .await
        .unwrap();
    let mut sub = config.subscribe().await;
    assert_eq!(
        KafkaConfig::next(&mut sub).await.message().id.as_str(),
        "evt_marker"
    );
}

/// A fresh namespace on Kafka.
impl Broker for KafkaConfig {
    adapter!(Kafka, WAIT, KafkaPublisher, KafkaSubscription);

    async fn fresh() -> Self {
        config()
    }

    async fn nothing_more(&self, sub: KafkaSubscription) {
        // The member leaves the group, so the marker's reader gets the partition at once.
        drop(sub);
        assert_committed_to_the_end(self, &self.publisher().await).await;
    }

    async fn delete(self) {
        delete(&self, GROUP, TOPIC).await.unwrap();
    }

    fn any_settings() -> BrokerSettings {
        BrokerSettings {
            session_timeout: SESSION_TIMEOUT,
            ..common::any_settings(Service::Kafka, format!("kafka://{SERVERS}"))
        }
    }
}

common::broker_suite!(KafkaConfig);

#[tokio::test]
async fn offsets_of_unacked_messages_are_not_committed() {
    let config = config();
    let publisher = config.publisher().await;
    for id in ["evt_a", "evt_b", "evt_c"] {
        publisher.publish(&message(id, "x")).await.unwrap();
    }

    let mut sub = config.subscribe().await;
    KafkaConfig::next(&mut sub).await.ack().await.unwrap();
    let b = KafkaConfig::next(&mut sub).await;
    assert_eq!(b.message().id.as_str(), "evt_b");
    let c = KafkaConfig::next(&mut sub).await;
    // evt_b is never acknowledged ("crash"): acknowledging evt_c must not commit past it.
    c.ack().await.unwrap();
    drop(b);
    drop(sub);

    let mut sub = config.subscribe().await;
    for id in ["evt_b", "evt_c"] {
        let delivery = KafkaConfig::next(&mut sub).await;
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
    let config = config_for(namespace);
    let mut sub = config.subscribe().await;
    let delivery = KafkaConfig::next(&mut sub).await;
    println!("CHILD GOT {}", delivery.message().id);
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn a_killed_consumers_partition_goes_to_the_next_one() {
    use std::io::{BufRead, BufReader};

    // A consumer killed outright (no LeaveGroup, no commit) holds its partition until the
    // group's session timeout; then the next member gets the message again.
    let config = config();
    let publisher = config.publisher().await;
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

    let mut sub = config.subscribe().await;
    let again = KafkaConfig::next(&mut sub).await;
    assert_eq!(again.message().id.as_str(), "evt_killed");
    again.ack().await.unwrap();
    drop(sub);
    delete(&config, GROUP, TOPIC).await.unwrap();
}
