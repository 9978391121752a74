//! What every adapter does the same way: its delivery holds the message, the broker's attempt
//! count and, on a dead letter, the reason, and shows them in its `Debug`; its subscriptions
//! read either a topic's events or the dead letters a group left on it; its types' `Debug`
//! shows what names them and leaves the client's handles out; and it reads the event id off
//! the broker's message, or says why there is none to use.

use std::fmt;

use crate::{EventId, Message};

/// What a subscription reads: the events of its topic, or the dead letters its group left
/// there. Each adapter's `connect` and `dead_letters` are one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// The topic's events.
    Events,
    /// The group's dead letters of the topic.
    DeadLetters,
}

/// The part of a delivery that is the same on every broker. The adapters' delivery types
/// hold one, in a field `received`, beside their client's handles.
pub(crate) struct Received {
    /// The message delivered.
    pub(crate) message: Message,
    /// The attempt, as `Delivery::attempt` reports it.
    pub(crate) attempt: u32,
    /// Why the message was dead-lettered, on a delivery read from the dead letters.
    pub(crate) dead_reason: Option<String>,
}

impl Received {
    /// Writes the `Debug` of the delivery type `name`: the message and the attempt, the
    /// adapter's `own` fields, then the dead-letter reason.
    pub(crate) fn fmt_debug(
        &self,
        f: &mut fmt::Formatter<'_>,
        name: &str,
        own: &[(&str, &dyn fmt::Debug)],
    ) -> fmt::Result {
        let mut fields: Vec<(&str, &dyn fmt::Debug)> =
            vec![("message", &self.message), ("attempt", &self.attempt)];
        fields.extend_from_slice(own);
        fields.push(("dead_reason", &self.dead_reason));
        fmt_fields(f, name, &fields)
    }
}

/// Writes the `Debug` of the adapter type `name` as the `fields` that say what it is, marked
/// non-exhaustive: the client's handles (connections, channels, consumers) are left out.
pub(crate) fn fmt_fields(
    f: &mut fmt::Formatter<'_>,
    name: &str,
    fields: &[(&str, &dyn fmt::Debug)],
) -> fmt::Result {
    let mut debug = f.debug_struct(name);
    for (field, value) in fields {
        debug.field(field, value);
    }
    debug.finish_non_exhaustive()
}

/// Implements, for an adapter's delivery type (which holds a [`Received`] in `received`), its
/// `Debug` through [`Received::fmt_debug`] and its public `dead_reason()`, documented by the
/// doc comment given. The adapter's own `Debug` fields, if any, follow the type's name as
/// `(binding) { field: expression of the binding, … }`.
macro_rules! delivery_debug_and_dead_reason {
    (
        $(#[$doc:meta])*
        $delivery:ident $(($this:ident) { $($field:ident: $value:expr),* $(,)? })?
    ) => {
        impl std::fmt::Debug for $delivery {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                $(let $this = self;)?
                self.received.fmt_debug(
                    f,
                    stringify!($delivery),
                    &[$($((stringify!($field), &$value)),*)?],
                )
            }
        }

        impl $delivery {
            $(#[$doc])*
            pub fn dead_reason(&self) -> Option<&str> {
                self.received.dead_reason.as_deref()
            }
        }
    };
}
pub(crate) use delivery_debug_and_dead_reason;

/// Writes, inside an adapter's `impl Delivery`, the two methods that only read its
/// [`Received`]: `message()` and `attempt()`.
macro_rules! delivery_message_and_attempt {
    () => {
        fn message(&self) -> &crate::Message {
            &self.received.message
        }

        fn attempt(&self) -> u32 {
            self.received.attempt
        }
    };
}
pub(crate) use delivery_message_and_attempt;

/// Writes, inside an adapter subscription's `impl`, public constructors that each open the
/// subscription through the adapter's own `open` with one [`Source`], written as
/// `/// docs name: Source;` (`connect: Events`, `dead_letters: DeadLetters`).
macro_rules! constructors_by_source {
    ($config:ty; $($(#[$doc:meta])* $name:ident: $source:ident;)+) => {
        $(
            $(#[$doc])*
            pub async fn $name(
                config: $config,
                group: &str,
                topic: &str,
            ) -> Result<Self, crate::BrokerError> {
                Self::open(config, group, topic, crate::received::Source::$source).await
            }
        )+
    };
}
pub(crate) use constructors_by_source;

/// The event id a broker's message carries (`raw`, read from `carrier`, e.g. the
/// `Nats-Msg-Id` header), or the reason it has none usable: such a message can never be
/// deduped, so the adapters dead-letter it with that reason instead of delivering it.
pub(crate) fn event_id(raw: Option<impl Into<String>>, carrier: &str) -> Result<EventId, String> {
    match raw.map(EventId::new) {
        Some(Ok(id)) => Ok(id),
        Some(Err(e)) => Err(format!("invalid event id: {e}")),
        None => Err(format!("no event id ({carrier})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unusable_id_says_why() {
        assert_eq!(event_id(Some("evt_1"), "key").unwrap().as_str(), "evt_1");
        assert_eq!(
            event_id(None::<String>, "message-id").unwrap_err(),
            "no event id (message-id)"
        );
        assert!(
            event_id(Some("a b"), "key")
                .unwrap_err()
                .starts_with("invalid event id: ")
        );
    }
}
