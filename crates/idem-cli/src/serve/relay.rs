//! The crash-test hook around the relay's publisher.

use idem_consumer::{BrokerError, Message, Published, Publisher};

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
