//! Waiting between attempts, injected so tests record the waits instead of sitting through
//! them.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The future a [`Sleeper`] returns.
pub type Sleep<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Waits for a given time between attempts.
pub trait Sleeper: Send + Sync + fmt::Debug + 'static {
    /// Completes after `duration` (or, for a test sleeper, whenever it likes).
    fn sleep(&self, duration: Duration) -> Sleep<'_>;
}

/// Sleeps on Tokio's timer: the default.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioSleeper;

impl Sleeper for TokioSleeper {
    fn sleep(&self, duration: Duration) -> Sleep<'_> {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// Returns at once and remembers every wait it was asked for, for tests.
///
/// Clones share one record, so a test keeps a clone and reads it after the client used the
/// other.
#[derive(Debug, Clone, Default)]
pub struct RecordingSleeper(Arc<Mutex<Vec<Duration>>>);

impl RecordingSleeper {
    /// A sleeper with nothing recorded.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every wait asked for so far, in order.
    pub fn slept(&self) -> Vec<Duration> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Sleeper for RecordingSleeper {
    fn sleep(&self, duration: Duration) -> Sleep<'_> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(duration);
        Box::pin(std::future::ready(()))
    }
}
