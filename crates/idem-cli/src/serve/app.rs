//! The state every handler of `idem serve` shares.

use std::sync::Arc;

use idem_core::{Clock, Policy};
use metrics_exporter_prometheus::PrometheusHandle;

use super::provider::Provider;

/// Shared state of the service.
#[derive(Debug, Clone)]
pub(crate) struct App<B> {
    pub(crate) store: B,
    pub(crate) policy: Arc<Policy>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) metrics: PrometheusHandle,
    pub(crate) provider: Provider,
    pub(crate) signal: idem_tower::OutcomeSignal,
    /// When the payout reconciler looks next.
    pub(crate) reconciliation: idem_tower::Reconciliation,
    /// Whether payments write `payment.succeeded` to the outbox (a broker is configured).
    pub(crate) outbox: bool,
}
