//! Housekeeping that comes with the layer (docs/contract.md §12): completed records past their
//! retention are deleted in small batches, so an app's key table stays the size of its
//! retention window without a line of code for it.
//!
//! A layer starts its sweeper on its first covered request (building a layer needs no
//! runtime), once for the layer and every clone of it (axum clones a layer for each route it
//! wraps), and the sweeper ends when the last clone is dropped. The pace is set with
//! [`with_sweep_every`], and [`without_sweeper`] turns it off for an app that sweeps
//! otherwise. Every instance of an app may sweep at once: each batch is one statement (or
//! script), and the stores let concurrent sweepers take disjoint rows.
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::post};
//! use idem_store::SqliteStore;
//! use idem_tower::IdempotencyLayer;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("app.db")).await?;
//! // One sweeper for both routes, every five minutes instead of every minute.
//! let app: Router = Router::new()
//!     .route("/orders", post(|| async { "created" }))
//!     .route("/refunds", post(|| async { "refunded" }))
//!     .layer(IdempotencyLayer::leased(store.clone()).with_sweep_every(Duration::from_secs(300)));
//! // An app that sweeps otherwise turns it off.
//! let quiet: Router = Router::new()
//!     .route("/orders", post(|| async { "created" }))
//!     .layer(IdempotencyLayer::leased(store).without_sweeper());
//! # let _ = (app, quiet);
//! # Ok(()) }
//! ```
//!
//! [`with_sweep_every`]: crate::IdempotencyLayer::with_sweep_every
//! [`without_sweeper`]: crate::IdempotencyLayer::without_sweeper

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::Clock;
use idem_store::{Store, sweep_all_paced};
use tokio::task::{AbortHandle, JoinHandle};

/// How often a sweeper looks for expired records unless told otherwise.
pub const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Records deleted by one statement at most.
const BATCH: u32 = 1000;

/// After each full batch the sweeper pauses four times as long as the batch took: it takes at
/// most a fifth of the store's time from claims. A batch that waits for a busy store counts
/// as busy, so the sweep slows with the load: measured under full load, about 4,000 (SQLite)
/// and 4,500 (PostgreSQL) records a second on one machine, above the rate one server created
/// them; on a slower one SQLite's was 1,300 to 2,400, below that rate (about 3,000), so there
/// a saturated server's backlog waits for the load to fall.
const PAUSE_PER_BUSY: u32 = 4;

/// Starts a sweeper on `store`: every `every` (the first time at once) it deletes the completed
/// records past their retention, in paced batches of at most a thousand, until none is left.
/// `clock` is the caller's (a shared store sweeps by its own). In-progress records are never
/// deleted: their outcome is unknown until it is resolved.
///
/// The layer runs one by itself; this is for a service that sweeps a store no layer of its own
/// covers, or wants its sweeper running from its start (`idem serve` does both). Abort the
/// handle to stop it.
pub fn spawn_sweeper<St: Store>(
    store: St,
    clock: Arc<dyn Clock>,
    every: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        // A sweep that took longer than the period is followed by a whole period, not a burst.
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            match sweep_all_paced(&store, clock.now(), BATCH, PAUSE_PER_BUSY).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(deleted = n, "swept expired keys"),
                Err(e) => tracing::warn!(error = %e, "sweep failed"),
            }
        }
    })
}

/// A layer's sweeper: its pace, and the task once started. Clones share it.
#[derive(Debug, Clone)]
pub(crate) struct Sweeper(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// How often it sweeps; `None`: never (turned off).
    every: Option<Duration>,
    /// The task, once the first request has started it.
    task: OnceLock<AbortHandle>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last clone of the layer is gone: nothing will sweep for it any more.
        if let Some(task) = self.task.get() {
            task.abort();
        }
    }
}

impl Sweeper {
    /// A sweeper that sweeps every `every` once started.
    pub(crate) fn every(every: Duration) -> Self {
        Self::with(Some(every))
    }

    /// A sweeper that never sweeps.
    pub(crate) fn off() -> Self {
        Self::with(None)
    }

    fn with(every: Option<Duration>) -> Self {
        Self(Arc::new(Inner {
            every,
            task: OnceLock::new(),
        }))
    }

    /// Starts sweeping `store` unless this sweeper (or a clone) already does or is turned off;
    /// whether this call started it. Called on each covered request: past the first, a load.
    pub(crate) fn start<St: Store>(&self, store: &St, clock: &Arc<dyn Clock>) -> bool {
        let Some(every) = self.0.every else {
            return false;
        };
        if self.0.task.get().is_some() {
            return false;
        }
        // Outside a runtime (a layer driven by hand) there is nowhere to run it: not yet.
        if tokio::runtime::Handle::try_current().is_err() {
            return false;
        }
        let mut started = false;
        self.0.task.get_or_init(|| {
            started = true;
            spawn_sweeper(store.clone(), clock.clone(), every).abort_handle()
        });
        started
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::SystemClock;
    use idem_store::SqliteStore;

    /// Started once for a layer and all its clones, never when turned off, and stopped when
    /// the last clone goes.
    #[tokio::test]
    async fn one_sweeper_for_a_layer_and_its_clones() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("sweep.db"))
            .await
            .unwrap();
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);

        let sweeper = Sweeper::every(Duration::from_secs(3600));
        let clone = sweeper.clone();
        assert!(sweeper.start(&store, &clock), "the first request starts it");
        assert!(
            !clone.start(&store, &clock),
            "a clone's request finds it running"
        );
        assert!(!sweeper.start(&store, &clock));
        let task = sweeper.0.task.get().unwrap().clone();
        assert!(!task.is_finished());
        drop((sweeper, clone));
        // An aborted task is finished once the runtime has dropped it.
        for _ in 0..1000 {
            if task.is_finished() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(task.is_finished(), "the sweeper outlived its layer");

        let off = Sweeper::off();
        assert!(!off.start(&store, &clock));
        assert!(off.0.task.get().is_none());
    }
}
