//! What the adapters' tests share: names, a fresh namespace, and waiting for deliveries.

#![allow(dead_code, unreachable_pub)] // each test binary uses a different part

use std::time::Duration;

use idem_consumer::{EventId, Message, Subscription};

pub const TOPIC: &str = "payment.succeeded";
pub const GROUP: &str = "receipts";

/// A namespace no other test uses, so tests run in parallel on one broker.
pub fn namespace() -> String {
    format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
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
