//! The sweeper every long-running command runs beside its server: expired records are deleted
//! in small batches, so the key table stays the size of its retention window.

use std::sync::Arc;
use std::time::Duration;

use idem_core::Clock;
use idem_store::{Store, sweep_all_paced};
use tokio::task::JoinHandle;

/// How often the sweeper looks, unless told otherwise; each statement deletes at most
/// [`BATCH`] rows, and the sweep is paced ([`PAUSE_PER_BUSY`]) so it cannot starve claims.
pub(crate) const EVERY: Duration = Duration::from_secs(60);
const BATCH: u32 = 1000;
/// After each full batch the sweeper pauses four times as long as the batch took: it takes at
/// most a fifth of the store's time from claims. A batch that waits for a busy store counts
/// as busy, so the sweep slows with the load: measured under full load, about 4,000 (SQLite)
/// and 4,500 (PostgreSQL) records a second on one machine, above the rate one server created
/// them; on a slower one SQLite's was 1,300 to 2,400, below that rate (about 3,000), so there
/// a saturated server's backlog waits for the load to fall.
const PAUSE_PER_BUSY: u32 = 4;

/// Starts the sweeper on `store`, looking every `every`; every instance may run one at once.
pub(crate) fn spawn<St: Store>(
    store: St,
    clock: Arc<dyn Clock>,
    every: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(every);
        loop {
            every.tick().await;
            match sweep_all_paced(&store, clock.now(), BATCH, PAUSE_PER_BUSY).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(deleted = n, "swept expired keys"),
                Err(e) => tracing::warn!(error = %e, "sweep failed"),
            }
        }
    })
}
