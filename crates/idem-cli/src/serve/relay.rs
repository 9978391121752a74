//! The relay that publishes the outbox to the broker, the expiry of what it sent, and the
//! crash-test hook around its publisher.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use idem_consumer::any::{AnyPublisher, BrokerSettings};
use idem_consumer::{BrokerError, Message, Published, Publisher, Relay};
use tokio::task::{AbortHandle, JoinHandle};

use super::backend::Backend;
use super::config::ServeConfig;
use crate::store_url::redact;

/// How long a sent outbox event is kept before it is deleted.
const SENT_EVENT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The relay of a service on backend `B`.
type OutboxRelay<B> = Relay<<B as Backend>::Db, PausingPublisher<AnyPublisher>>;

/// Connects to the broker, then starts the relay and the expiry of sent events.
pub(super) async fn start<B: Backend>(
    store: &B,
    settings: &BrokerSettings,
    config: &ServeConfig,
) -> anyhow::Result<[AbortHandle; 2]> {
    let publisher = AnyPublisher::connect(settings)
        .await
        .with_context(|| format!("cannot reach the broker {}", redact(&settings.url)))?;
    let publisher = PausingPublisher::new(publisher, config.fault_pause_after_publish);
    let relay = Relay::new(store.write_pool().clone(), publisher)
        .with_poll_interval(config.relay_poll)
        .with_clock(config.clock.clone());
    tracing::info!(broker = %redact(&settings.url), "relaying payment events from the outbox");
    let relay = Arc::new(relay);
    let expiry = spawn_expiry::<B>(relay.clone());
    let relaying = tokio::spawn(async move { relay.run(std::future::pending()).await });
    Ok([relaying.abort_handle(), expiry.abort_handle()])
}

/// Sent rows are kept a while (to look into what was announced), then deleted in batches,
/// every hour; unsent rows are never deleted.
fn spawn_expiry<B: Backend>(relay: Arc<OutboxRelay<B>>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(3600));
        loop {
            every.tick().await;
            match relay.expire_sent(SENT_EVENT_RETENTION, 1000).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(deleted = n, "expired sent outbox events"),
                Err(e) => tracing::warn!(error = %e, "expiring sent outbox events failed"),
            }
        }
    })
}

/// Publishes through the broker's publisher; with the fault on, freezes for good after the
/// first publish, before the relay can mark the event sent, so a test can kill the process at
/// exactly that point.
#[derive(Debug)]
pub(crate) struct PausingPublisher<P> {
    inner: P,
    pause_after_publish: bool,
}

impl<P> PausingPublisher<P> {
    pub(crate) fn new(inner: P, pause_after_publish: bool) -> Self {
        Self {
            inner,
            pause_after_publish,
        }
    }
}

impl<P: Publisher> Publisher for PausingPublisher<P> {
    async fn publish(&self, message: &Message) -> Result<Published, BrokerError> {
        let published = self.inner.publish(message).await?;
        if self.pause_after_publish {
            eprintln!(
                "fault: paused after publishing {} (not marked sent)",
                message.id
            );
            std::future::pending::<()>().await;
        }
        Ok(published)
    }
}
