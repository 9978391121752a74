//! Exactly-once effects over at-least-once brokers (docs/contract.md §6).
//!
//! Brokers deliver at least once: a consumer that dies after its side effect and before its
//! ack gets the message again. Two tables make that harmless:
//!
//! - the **inbox** (`processed_events`, keyed by consumer and event id) is written in the same
//!   transaction as the side effect, so a redelivered event finds its row and does nothing
//!   ([`Inbox`]);
//! - the **outbox** is written in the same transaction as the business change, and a
//!   [`Relay`] publishes it with the event id as the broker's message id, so an event is never
//!   announced for a change that rolled back, nor lost for one that committed.
//!
//! A broker's own dedup (JetStream's duplicate window, Kafka's idempotent producer) protects
//! its log, never the consumer's side effects: the inbox does that on every broker.
//!
//! ```
//! use futures_util::FutureExt as _;
//! use idem_consumer::{Database as _, EventId, Inbox, Processed};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
//! sqlx::Sqlite::migrate(&pool).await?;
//! sqlx::query("CREATE TABLE emails (event_id TEXT)").execute(&pool).await?;
//!
//! let inbox = Inbox::new("emails");
//! let event = EventId::new("evt_1")?;
//! for delivery in 1..=3 {
//!     // The broker delivers the same event three times; the email goes out once.
//!     let outcome = inbox
//!         .process(&pool, &event, 0, |conn| {
//!             async move {
//!                 sqlx::query("INSERT INTO emails VALUES ('evt_1')").execute(conn).await
//!             }
//!             .boxed()
//!         })
//!         .await?;
//!     assert_eq!(matches!(outcome, Processed::Applied(_)), delivery == 1);
//! }
//! let sent: i64 = sqlx::query_scalar("SELECT count(*) FROM emails").fetch_one(&pool).await?;
//! assert_eq!(sent, 1);
//! # Ok(()) }
//! ```
// On docs.rs (nightly), mark each feature-gated item with the feature that enables it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(clippy::missing_errors_doc, clippy::missing_panics_doc)]

mod broker;
mod consumer;
mod inbox;
mod message;
#[cfg(any(feature = "nats", feature = "amqp", feature = "kafka"))]
mod names;
pub mod outbox;
#[cfg(any(feature = "nats", feature = "amqp", feature = "kafka"))]
mod received;
mod sql;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(any(feature = "nats", feature = "amqp", feature = "kafka"))]
pub mod any;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;

pub use broker::{BrokerError, Delivery, Published, Publisher, Subscription};
pub use consumer::{Consumer, ConsumerStats, Handled, Handler, HandlerError};
pub use inbox::{Inbox, ProcessError, Processed};
pub use message::{EventId, InvalidEventId, Message};
pub use outbox::{Relay, RelayError, RelayPass, enqueue};
pub use sql::{Database, INSERT_OUTBOX, MigrateError, PendingEvent};
