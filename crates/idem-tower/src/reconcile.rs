//! [`Reconciliation`]: when records whose outcome is unknown will next be looked at.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// The schedule of a reconciler: the task that asks the other system what happened to work
/// whose outcome is unknown, then completes or releases its record.
///
/// Lease mode given one ([`with_reconciliation`]) ends the lease of a record at once when its
/// handler returns [`Outcome::Unknown`](crate::Outcome::Unknown) (the handler's calls are over,
/// so there is nothing left to wait for), asks for a pass, and tells every client the truth:
/// the handler's own `5xx` and each duplicate's `409 outcome-unknown` carry a `Retry-After`
/// that points just past the reconciler's next pass.
///
/// The reconciler itself runs its passes between calls to [`until_next_pass`].
///
/// ```
/// use std::time::Duration;
/// use idem_tower::Reconciliation;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let schedule = Reconciliation::new(Duration::from_secs(15));
/// let reconciler = schedule.clone();
/// tokio::spawn(async move {
///     loop {
///         reconciler.until_next_pass().await;
///         // ... ask the provider about every in-progress record whose lease ran out ...
///     }
/// });
/// // A handler's outcome became unknown: the reconciler looks at once.
/// schedule.request_pass();
/// assert_eq!(schedule.retry_after(), Duration::from_secs(1));
/// # }
/// ```
///
/// [`with_reconciliation`]: crate::IdempotencyLayer::with_reconciliation
/// [`until_next_pass`]: Reconciliation::until_next_pass
#[derive(Clone)]
pub struct Reconciliation {
    inner: Arc<Inner>,
}

struct Inner {
    period: Duration,
    wake: Notify,
    /// A pass was asked for and has not started yet.
    requested: AtomicBool,
    /// When the next pass is due unless one is asked for. A std Mutex: no await happens while
    /// it is held.
    next_pass: Mutex<Instant>,
}

impl fmt::Debug for Reconciliation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconciliation")
            .field("period", &self.inner.period)
            .field("requested", &self.inner.requested.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// What a pass itself may take, added to every `Retry-After`, so that a client which honours
/// it arrives after the pass rather than racing it.
const PASS_MARGIN: Duration = Duration::from_millis(250);

impl Reconciliation {
    /// A reconciler that passes every `period`, and at once when asked.
    pub fn new(period: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                period,
                wake: Notify::new(),
                requested: AtomicBool::new(false),
                next_pass: Mutex::new(Instant::now()),
            }),
        }
    }

    /// How long the reconciler waits between passes when nobody asks for one.
    pub fn period(&self) -> Duration {
        self.inner.period
    }

    /// Asks for a pass now. A request made while a pass runs gets a pass of its own after it.
    pub fn request_pass(&self) {
        self.inner.requested.store(true, Ordering::SeqCst);
        *self.next_pass() = Instant::now();
        // notify_one keeps a permit when the reconciler is busy, so the request is not lost.
        self.inner.wake.notify_one();
    }

    /// Completes when the next pass is due: a period after this call, or as soon as a pass is
    /// asked for. The reconciler calls it before each pass.
    pub async fn until_next_pass(&self) {
        if !self.inner.requested.load(Ordering::SeqCst) {
            let due = Instant::now() + self.inner.period;
            *self.next_pass() = due;
            tokio::select! {
                _ = tokio::time::sleep_until(due) => {}
                _ = self.inner.wake.notified() => {}
            }
        }
        // The pass starts now: requests from here on ask for the one after it.
        self.inner.requested.store(false, Ordering::SeqCst);
    }

    /// How long a client should wait before asking again about a record whose outcome is
    /// unknown: until the next pass plus a margin for the pass itself, in whole seconds (the
    /// unit of `Retry-After`), at least one.
    pub fn retry_after(&self) -> Duration {
        let until_pass = if self.inner.requested.load(Ordering::SeqCst) {
            Duration::ZERO
        } else {
            self.next_pass().saturating_duration_since(Instant::now())
        };
        let millis = (until_pass + PASS_MARGIN).as_millis();
        Duration::from_secs(millis.div_ceil(1000).max(1) as u64)
    }

    fn next_pass(&self) -> std::sync::MutexGuard<'_, Instant> {
        // Poisoning cannot leave an Instant half-written: take the value either way.
        self.inner
            .next_pass
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn passes_every_period_and_at_once_when_asked() {
        let schedule = Reconciliation::new(Duration::from_secs(15));
        let passes = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let reconciler = {
            let (schedule, passes) = (schedule.clone(), passes.clone());
            tokio::spawn(async move {
                loop {
                    schedule.until_next_pass().await;
                    passes.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        tokio::task::yield_now().await;
        // Waiting for its first period: a client is told to come back after it.
        assert_eq!(passes.load(Ordering::SeqCst), 0);
        assert_eq!(schedule.retry_after(), Duration::from_secs(16));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(schedule.retry_after(), Duration::from_secs(6));

        schedule.request_pass();
        assert_eq!(schedule.retry_after(), Duration::from_secs(1));
        tokio::task::yield_now().await;
        assert_eq!(passes.load(Ordering::SeqCst), 1, "the asked-for pass ran");
        assert_eq!(schedule.retry_after(), Duration::from_secs(16));

        tokio::time::advance(Duration::from_secs(15)).await;
        tokio::task::yield_now().await;
        assert_eq!(passes.load(Ordering::SeqCst), 2, "and the periodic one");
        reconciler.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_during_a_pass_gets_a_pass_after_it() {
        let schedule = Reconciliation::new(Duration::from_secs(60));
        schedule.request_pass();
        schedule.until_next_pass().await; // the pass starts
        schedule.request_pass(); // asked while it runs
        tokio::time::timeout(Duration::from_millis(1), schedule.until_next_pass())
            .await
            .expect("the second request is not lost");
    }
}
