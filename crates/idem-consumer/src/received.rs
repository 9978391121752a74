//! What every adapter's delivery does the same way: it holds the message, the broker's
//! attempt count and, on a dead letter, the reason; it shows them in its `Debug`; and it
//! reads the event id off the broker's message, or says why there is none to use.

use std::fmt;

use crate::{EventId, Message};

/// The part of a delivery that is the same on every broker. The adapters' delivery types
/// hold one beside their client's handles.
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
    /// adapter's `own` fields, then the dead-letter reason. The client's handles are left out.
    pub(crate) fn fmt_debug(
        &self,
        f: &mut fmt::Formatter<'_>,
        name: &str,
        own: &[(&str, &dyn fmt::Debug)],
    ) -> fmt::Result {
        let mut debug = f.debug_struct(name);
        debug
            .field("message", &self.message)
            .field("attempt", &self.attempt);
        for (field, value) in own {
            debug.field(field, value);
        }
        debug
            .field("dead_reason", &self.dead_reason)
            .finish_non_exhaustive()
    }
}

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
