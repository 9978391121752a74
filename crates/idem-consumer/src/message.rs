//! What travels through a broker: an event with its business id.

use std::fmt;

/// The id an event was given when its intent was created (docs/contract.md §6). It is the broker's
/// message id (JetStream `Nats-Msg-Id`, AMQP `message-id`, the Kafka record key) and the
/// consumer's inbox key, so it must survive every hop unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(String);

/// Why a string is not an [`EventId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidEventId {
    /// The id is empty.
    #[error("an event id must not be empty")]
    Empty,
    /// The id is longer than [`EventId::MAX_LEN`] bytes.
    #[error("an event id is at most {max} bytes; this one has {len}", max = EventId::MAX_LEN)]
    TooLong {
        /// The length found.
        len: usize,
    },
    /// The id holds a byte outside visible ASCII (space and controls included).
    #[error("an event id is visible ASCII only; byte {byte:#04x} at {at} is not")]
    Invisible {
        /// The offending byte.
        byte: u8,
        /// Its position.
        at: usize,
    },
}

impl EventId {
    /// The longest id accepted: it must fit every broker's message-id field and a database key.
    pub const MAX_LEN: usize = 255;

    /// Checks `id`: 1 to 255 bytes of visible ASCII, which every broker carries unchanged
    /// (AMQP short strings, NATS headers, Kafka keys).
    ///
    /// # Errors
    ///
    /// [`InvalidEventId::Empty`], [`InvalidEventId::TooLong`] past [`MAX_LEN`](Self::MAX_LEN)
    /// bytes, or [`InvalidEventId::Invisible`] at the first byte outside visible ASCII.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidEventId> {
        let id = id.into();
        if id.is_empty() {
            return Err(InvalidEventId::Empty);
        }
        if id.len() > Self::MAX_LEN {
            return Err(InvalidEventId::TooLong { len: id.len() });
        }
        if let Some((at, &byte)) = id
            .as_bytes()
            .iter()
            .enumerate()
            .find(|(_, b)| !b.is_ascii_graphic())
        {
            return Err(InvalidEventId::Invisible { byte, at });
        }
        Ok(Self(id))
    }

    /// A fresh time-ordered id (UUIDv7), for producers that have no business id of their own.
    pub fn generate() -> Self {
        Self(format!("evt_{}", uuid::Uuid::now_v7().simple()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An event on its way through a broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The event's business id, also the broker's message id.
    pub id: EventId,
    /// Where it goes: a NATS subject, an AMQP routing key, a Kafka topic.
    pub topic: String,
    /// The event itself, usually JSON.
    pub payload: Vec<u8>,
}
