//! The names every adapter checks before it uses them: namespaces, consumer groups and
//! topics end up in JetStream stream and consumer names, AMQP exchanges and queues, and Kafka
//! topics and groups, so they are held to what all three carry unchanged.
//!
//! The adapters and [`crate::any`] all depend on this module, and it on none of them.

use crate::BrokerError;

/// A namespace, topic or consumer group name the brokers cannot all carry unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {name:?}: {rule}")]
pub struct InvalidName {
    /// What the name is for: "namespace", "topic", "consumer group".
    pub what: &'static str,
    /// The name given.
    pub name: String,
    /// The rule it breaks.
    pub rule: &'static str,
}

/// Checks a namespace or a consumer group: 1 to 64 of `A-Z a-z 0-9 _ -`. No dots, because
/// both end up inside JetStream stream and durable consumer names, which forbid them.
pub(crate) fn check_plain_name(
    broker: &'static str,
    what: &'static str,
    name: &str,
) -> Result<(), BrokerError> {
    let ok = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            broker,
            what,
            name,
            "use 1 to 64 of A-Z a-z 0-9 _ -",
        ))
    }
}

/// Checks a topic: 1 to 128 of `A-Z a-z 0-9 _ -` in dot-separated non-empty parts
/// (`payment.succeeded`). That is a valid NATS subject suffix, AMQP routing key and Kafka
/// topic name alike, with no wildcard that would widen a subscription.
pub(crate) fn check_topic(broker: &'static str, topic: &str) -> Result<(), BrokerError> {
    let ok = (1..=128).contains(&topic.len())
        && topic.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(invalid(
            broker,
            "topic",
            topic,
            "use 1 to 128 of A-Z a-z 0-9 _ - in dot-separated non-empty parts",
        ))
    }
}

/// The error for a `name` that breaks `rule`, as `broker` reports it; for the checks above
/// and for an adapter's own rules (NATS reserves the topic `dead`).
pub(crate) fn invalid(
    broker: &'static str,
    what: &'static str,
    name: &str,
    rule: &'static str,
) -> BrokerError {
    BrokerError::new(
        broker,
        format!("checking the {what}"),
        InvalidName {
            what,
            name: name.to_owned(),
            rule,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(check_topic("nats", "payment.succeeded").is_ok());
        for bad in ["", "a..b", ".a", "a.", "a.*", "a.>", "a b"] {
            assert!(check_topic("nats", bad).is_err(), "{bad:?}");
        }
        assert!(check_plain_name("nats", "namespace", "t_1-x").is_ok());
        assert!(check_plain_name("nats", "namespace", "a.b").is_err());
    }
}
