//! The sweeper every long-running command runs beside its server: expired records are deleted
//! in small batches, so the key table stays the size of its retention window.

use std::sync::Arc;
use std::time::Duration;

use idem_core::Clock;
use idem_store::{Store, sweep_all_paced};
use tokio::task::JoinHandle;

/// How often the sweeper looks, unless told otherwise; each statement deletes at most
/// [`BATCH`] rows, so it never holds locks long enough to stall claims.
pub(crate) const EVERY: Duration = Duration::from_secs(60);
const BATCH: u32 = 1000;
/// After each full batch the sweeper pauses four times as long as the batch took: it takes at
/// most a fifth of the store's time from claims. On SQLite, where a 1,000-row batch takes
/// about 8 ms, that still deletes some 25,000 records a second, many times what one server
/// creates.
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
