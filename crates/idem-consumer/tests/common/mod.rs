//! What the adapters' tests share: names, a fresh namespace, waiting for deliveries, and the
//! broker suite ([`suite`]) that each of them instantiates with [`broker_suite!`].

#![allow(dead_code, unreachable_pub)] // each test binary uses a different part

pub mod suite;

use std::time::Duration;

use idem_consumer::any::BrokerSettings;
use idem_consumer::{EventId, Message, Subscription};
use idem_testkit::Service;

pub const TOPIC: &str = "payment.succeeded";
pub const GROUP: &str = "receipts";

/// A namespace no other test uses, so tests run in parallel on one broker.
pub fn namespace() -> String {
    format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// A fresh [`namespace`] on the broker `service`, which must be up.
pub fn namespace_on(service: Service) -> String {
    idem_testkit::require(service);
    namespace()
}

/// Settings naming the broker `service` at `url` and a fresh namespace on it, for the `any`
/// module.
pub fn any_settings(service: Service, url: impl Into<String>) -> BrokerSettings {
    BrokerSettings::new(url, namespace_on(service), TOPIC, GROUP)
}

pub fn message(id: &str, payload: &str) -> Message {
    Message {
        id: EventId::new(id).unwrap(),
        topic: TOPIC.to_owned(),
        payload: payload.as_bytes().to_vec(),
    }
}

/// The next delivery, within `wait`.
pub async fn next_within<S: Subscription>(sub: &mut S, wait: Duration) -> S::Delivery {
    tokio::time::timeout(wait, sub.next())
        .await
        .expect("a delivery in time")
        .expect("no broker error")
        .expect("the subscription is open")
}

/// Nothing arrives within `quiet` (which must exceed any redelivery timer to mean anything).
pub async fn nothing<S: Subscription>(sub: &mut S, quiet: Duration)
where
    S::Delivery: std::fmt::Debug,
{
    if let Ok(delivery) = tokio::time::timeout(quiet, sub.next()).await {
        panic!("expected no delivery, got {delivery:?}");
    }
}

/// Instantiates every scenario of [`suite`] as a test of this binary, for the broker
/// `$broker` (a type implementing [`suite::Broker`]).
macro_rules! broker_suite {
    ($broker:ty) => {
        $crate::common::broker_suite!(@tests $broker;
            published_messages_arrive_with_their_ids_and_payloads,
            an_unacked_delivery_comes_back_to_the_next_consumer,
            a_retried_delivery_comes_back_with_a_higher_attempt,
            a_dead_lettered_message_is_kept_aside_and_not_redelivered,
            the_same_id_published_twice,
            any_broker_settings_reach_the_broker,
        );
    };
    (@tests $broker:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $name() {
                $crate::common::suite::$name::<$broker>().await;
            }
        )*
    };
}
pub(crate) use broker_suite;
