//! [`OutcomeSignal`]: wakes duplicates that wait for a key's outcome instead of taking `409`.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_store::OutcomeChannel;
use tokio::sync::futures::OwnedNotified;
use tokio::sync::{Notify, OnceCell};
use tokio::task::JoinHandle;

type Publisher = Arc<dyn Fn(&str) + Send + Sync>;

/// Wakes duplicates waiting for a key's outcome (lease mode, [`with_outcome_wait`]).
///
/// Waiters are woken in this process directly. Processes that share a store relay wake-ups
/// with a publisher (`idem serve` on PostgreSQL uses `LISTEN`/`NOTIFY`): whoever stores an
/// outcome publishes the key's label, and each process's listener calls [`wake_local`].
/// A wake-up only prompts a waiter to look at the store again, so a spurious one (two keys
/// with one label) costs a read, never a wrong answer.
///
/// [`with_outcome_wait`] wires a signal to its store by itself; [`for_store`] makes one wired
/// the same way for callers that share it (several layers, a reconciler), to hand to
/// [`with_outcome_signal`].
///
/// [`with_outcome_wait`]: crate::IdempotencyLayer::with_outcome_wait
/// [`with_outcome_signal`]: crate::IdempotencyLayer::with_outcome_signal
/// [`for_store`]: OutcomeSignal::for_store
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

    /// The signal that wakes duplicates waiting on any process that shares `store`.
    ///
    /// Each outcome stored in this process is published through the store, in a task of its
    /// own so that the request never waits for it (a failure is logged: waiters elsewhere then
    /// wait out their bound). A listener, started before this returns and running for as long
    /// as the runtime does, wakes this process's waiters whenever any process published. Where
    /// the store cannot hear what others publish ([`OutcomeChannel::outcome_poll`]: PostgreSQL
    /// behind a pooler, without a notify URL), every waiter looks at the store again that often
    /// instead.
    ///
    /// # Errors
    ///
    /// The store's error (such as [`idem_store::Error::Unavailable`]) when the listener cannot
    /// start.
    pub async fn for_store<St: OutcomeChannel>(store: &St) -> Result<Self, idem_store::Error> {
        let signal = Self::publishing_to(store);
        // Detached: the listener serves the signal for the process's life.
        signal.listen_to(store).await?.detach();
        Ok(signal)
    }

    /// A signal that publishes each wake-up through `store`, not listening yet.
    pub(crate) fn publishing_to<St: OutcomeChannel>(store: &St) -> Self {
        let publisher = store.clone();
        Self::with_publisher(move |label| {
            let (store, label) = (publisher.clone(), label.to_owned());
            tokio::spawn(async move {
                if let Err(e) = store.publish_outcome(&label).await {
                    tracing::warn!(error = &e as &dyn std::error::Error, key = %label, "could not publish an outcome wake-up");
                }
            });
        })
    }

    /// Starts `store`'s listener, which wakes this signal's waiters whenever a process
    /// publishes, and the store's polling fallback where it needs one.
    pub(crate) async fn listen_to<St: OutcomeChannel>(
        &self,
        store: &St,
    ) -> Result<Listening, idem_store::Error> {
        let relay = self.clone();
        let listener = store
            .listen_outcomes(Arc::new(move |label: &str| relay.wake_local(label)))
            .await?;
        let mut tasks = vec![listener];
        if let Some(every) = store.outcome_poll() {
            // Nothing published elsewhere can be heard (the store said so in the log): waiters
            // look at the store again every so often instead.
            let polled = self.clone();
            tasks.push(tokio::spawn(async move {
                let mut ticks = tokio::time::interval(every);
                ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticks.tick().await;
                    polled.wake_all_local();
                }
            }));
        }
        Ok(Listening(tasks))
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

/// The tasks that feed a signal from its store (the listener, the polling fallback), ended
/// when this is dropped unless detached.
#[derive(Debug)]
pub(crate) struct Listening(Vec<JoinHandle<()>>);

impl Listening {
    /// Leaves the tasks running for the runtime's life.
    fn detach(mut self) {
        self.0.clear();
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// How long a layer's first request waits for the store's listener to start before it is
/// answered as if the store were unreachable (the next request tries again).
const LISTEN_WITHIN: Duration = Duration::from_secs(5);

type Start = Box<
    dyn Fn() -> Pin<Box<dyn Future<Output = Result<Listening, idem_store::Error>> + Send>>
        + Send
        + Sync,
>;

/// The store's listener of a layer made with
/// [`with_outcome_wait`](crate::IdempotencyLayer::with_outcome_wait), started by the layer's
/// first request that may wait: the layer is built before a runtime may exist, and a
/// listener is a task. Shared by the layer's clones; the listener ends with the last of them.
pub(crate) struct LazyListener {
    started: OnceCell<Listening>,
    start: Start,
}

impl fmt::Debug for LazyListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LazyListener")
            .field("started", &self.started.initialized())
            .finish_non_exhaustive()
    }
}

impl LazyListener {
    /// A listener of `store` that will wake `signal`'s waiters.
    pub(crate) fn new<St: OutcomeChannel>(store: &St, signal: &OutcomeSignal) -> Self {
        let (store, signal) = (store.clone(), signal.clone());
        Self {
            started: OnceCell::new(),
            start: Box::new(move || {
                let (store, signal) = (store.clone(), signal.clone());
                Box::pin(async move { signal.listen_to(&store).await })
            }),
        }
    }

    /// Starts the listener unless it runs already. Bounded: a store that cannot be reached
    /// fails this within [`LISTEN_WITHIN`], and the next caller tries again.
    pub(crate) async fn ensure_started(&self) -> Result<(), idem_store::Error> {
        if self.started.initialized() {
            return Ok(());
        }
        let started =
            tokio::time::timeout(LISTEN_WITHIN, self.started.get_or_try_init(&self.start)).await;
        let e = match started {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => e,
            Err(elapsed) => idem_store::Error::Unavailable(Box::new(elapsed)),
        };
        tracing::warn!(
            error = &e as &dyn std::error::Error,
            "cannot listen for outcome wake-ups; the request is answered as if the store were unreachable"
        );
        Err(e)
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
