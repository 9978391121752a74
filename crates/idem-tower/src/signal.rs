//! [`OutcomeSignal`]: wakes duplicates that wait for a key's outcome instead of taking `409`.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

type Publisher = Arc<dyn Fn(&str) + Send + Sync>;

/// Wakes duplicates waiting for a key's outcome (lease mode, [`with_outcome_wait`]).
///
/// Waiters are woken in this process directly. Processes that share a store relay wake-ups
/// with a publisher (`idem serve` on PostgreSQL uses `LISTEN`/`NOTIFY`): whoever stores an
/// outcome publishes the key's label, and each process's listener calls [`wake_local`].
/// A wake-up only prompts a waiter to look at the store again, so a spurious one (two keys
/// with one label) costs a read, never a wrong answer.
///
/// [`with_outcome_wait`]: crate::IdempotencyLayer::with_outcome_wait
/// [`wake_local`]: OutcomeSignal::wake_local
#[derive(Clone, Default)]
pub struct OutcomeSignal {
    // A std Mutex: no await happens while it is held.
    waiters: Arc<Mutex<HashMap<String, Arc<Notify>>>>,
    publisher: Option<Publisher>,
}

impl fmt::Debug for OutcomeSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutcomeSignal")
            .field("publishes", &self.publisher.is_some())
            .finish_non_exhaustive()
    }
}

impl OutcomeSignal {
    /// A signal that also hands every wake-up to `publish` (to reach other processes).
    pub fn with_publisher(publish: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Self {
            waiters: Default::default(),
            publisher: Some(Arc::new(publish)),
        }
    }

    /// A future that completes at the next wake-up for `label`. Create it *before* looking
    /// at the store, so an outcome stored in between is not missed.
    ///
    /// # Panics
    ///
    /// Never: nothing panics while the waiters' lock is held, so it is never poisoned.
    pub fn listen(&self, label: &str) -> OwnedNotified {
        let notify = self
            .waiters
            .lock()
            .expect("the waiters map is never poisoned")
            .entry(label.to_owned())
            .or_default()
            .clone();
        // `notify_waiters` reaches a future from its creation, even before it is polled.
        notify.notified_owned()
    }

    /// Wakes this process's waiters for `label` and publishes it to other processes.
    pub fn wake(&self, label: &str) {
        self.wake_local(label);
        if let Some(publish) = &self.publisher {
            publish(label);
        }
    }

    /// Wakes this process's waiters for `label` (a relayed wake-up).
    ///
    /// # Panics
    ///
    /// Never: nothing panics while the waiters' lock is held, so it is never poisoned.
    pub fn wake_local(&self, label: &str) {
        let notify = self
            .waiters
            .lock()
            .expect("the waiters map is never poisoned")
            .remove(label);
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }

    /// Wakes every waiter of this process, whatever its key: each looks at the store again.
    /// For stores that cannot tell other processes' outcomes, called every so often
    /// ([`OutcomeChannel::outcome_poll`](idem_store::OutcomeChannel::outcome_poll)).
    ///
    /// # Panics
    ///
    /// Never: nothing panics while the waiters' lock is held, so it is never poisoned.
    pub fn wake_all_local(&self) {
        let waiters = std::mem::take(
            &mut *self
                .waiters
                .lock()
                .expect("the waiters map is never poisoned"),
        );
        for notify in waiters.into_values() {
            notify.notify_waiters();
        }
    }

    /// How many keys have waiters in this process.
    ///
    /// # Panics
    ///
    /// Never: nothing panics while the waiters' lock is held, so it is never poisoned.
    pub fn waiting(&self) -> usize {
        self.waiters
            .lock()
            .expect("the waiters map is never poisoned")
            .len()
    }

    /// Forgets `label`'s entry when nobody waits on it any more (after a timeout).
    pub(crate) fn forget_if_unused(&self, label: &str) {
        let mut waiters = self
            .waiters
            .lock()
            .expect("the waiters map is never poisoned");
        if waiters
            .get(label)
            .is_some_and(|notify| Arc::strong_count(notify) == 1)
        {
            waiters.remove(label);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The polling fallback's wake-up reaches the waiters of every key, and leaves no entry.
    #[tokio::test]
    async fn wake_all_local_wakes_the_waiters_of_every_key() {
        let signal = OutcomeSignal::default();
        let (a, b) = (signal.listen("key-a"), signal.listen("key-b"));
        assert_eq!(signal.waiting(), 2);
        signal.wake_all_local();
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            a.await;
            b.await;
        })
        .await
        .expect("both woken");
        assert_eq!(signal.waiting(), 0);
    }
}
