//! How a handler tells the layer what its response means.

/// What to do with a response's outcome, set by a handler as a response extension when the
/// default (by status, see [`idem_core::Policy::stores_status`]) is wrong for it.
///
/// ```
/// use idem_tower::Outcome;
/// let mut response = http::Response::new(());
/// *response.status_mut() = http::StatusCode::UNPROCESSABLE_ENTITY;
/// // A validation failure: nothing happened, let the client fix the request and reuse its key.
/// response.extensions_mut().insert(Outcome::Release);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Keep the response and replay it to every retry.
    Store,
    /// Nothing happened: forget the key, so a retry runs fresh. In transaction mode the
    /// transaction is rolled back.
    Release,
    /// The work may or may not have happened, and the handler has returned, so every call it
    /// made is over (answered, cut off, or timed out): lease mode keeps the key in progress
    /// until the outcome is found out. With a reconciler
    /// ([`with_reconciliation`](crate::IdempotencyLayer::with_reconciliation)) the lease ends
    /// at once and the reconciler looks; without one the lease runs out and the next retry
    /// takes the key over. In transaction mode, a rollback.
    Unknown,
}

impl Outcome {
    /// The default for a status: stored statuses are kept, 5xx are unknown, the rest released.
    pub(crate) fn for_status(policy: &idem_core::Policy, status: u16) -> Self {
        if policy.stores_status(status) {
            Outcome::Store
        } else if status >= 500 {
            Outcome::Unknown
        } else {
            Outcome::Release
        }
    }
}
