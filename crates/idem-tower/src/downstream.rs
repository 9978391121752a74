//! [`Downstream`]: the key a lease-mode handler passes to the system it calls.

use std::ops::Deref;

use idem_core::DownstreamKey;

/// The [`DownstreamKey`] of a request in lease mode: what the handler passes to the system it
/// calls (a payment provider's `Idempotency-Key`, an upstream's request id), the same for every
/// retry and takeover of the request, so a downstream that dedupes by it acts once
/// (docs/contract.md §3.2).
///
/// In axum it is an extractor (feature `axum`); `Option<Downstream>` is `None` on a request the
/// layer let through without a key. Any other tower service (a tonic method) takes it from the
/// request's extensions with [`Downstream::from_extensions`].
///
/// ```
/// use idem_tower::Downstream;
///
/// async fn create_payout(Downstream(key): Downstream) -> String {
///     // e.g. .header("Idempotency-Key", key.as_str()) on the call to the provider
///     format!("paid out under {key}")
/// }
/// # let _ = create_payout;
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Downstream(pub DownstreamKey);

impl Downstream {
    /// The downstream key the layer put in the request's extensions (tonic:
    /// `request.extensions()`).
    ///
    /// # Errors
    ///
    /// [`NoDownstreamKey`] when there is none: the request is not behind
    /// [`IdempotencyLayer::leased`](crate::IdempotencyLayer::leased) (transaction mode makes
    /// none: its work is the database's), or it passed through without a key.
    pub fn from_extensions(extensions: &http::Extensions) -> Result<Self, NoDownstreamKey> {
        extensions
            .get::<DownstreamKey>()
            .cloned()
            .map(Self)
            .ok_or(NoDownstreamKey)
    }

    /// The key itself.
    pub fn into_inner(self) -> DownstreamKey {
        self.0
    }
}

impl Deref for Downstream {
    type Target = DownstreamKey;

    fn deref(&self) -> &DownstreamKey {
        &self.0
    }
}

/// The handler asked for a [`Downstream`] key on a request the layer made none for: the route
/// is not behind [`IdempotencyLayer::leased`](crate::IdempotencyLayer::leased), or the request
/// passed through without a key (take `Option<Downstream>` where keys are optional).
///
/// axum answers it as `500 urn:idem:problem:no-downstream-key`, without `Retry-After`: a route
/// wired wrong, which a retry cannot mend. With the `tonic` feature it converts into a
/// `tonic::Status` (`INTERNAL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "no downstream key: the route is not behind IdempotencyLayer::leased, or the request came without an idempotency key"
)]
pub struct NoDownstreamKey;

impl NoDownstreamKey {
    /// The HTTP status it is answered with: `500`.
    pub const STATUS: http::StatusCode = http::StatusCode::INTERNAL_SERVER_ERROR;

    /// The problem details it is answered with.
    #[cfg(feature = "axum")]
    pub(crate) fn problem(self) -> idem_core::Problem {
        idem_core::Problem::other(
            "no-downstream-key",
            "The handler asked for a downstream key the layer did not make",
            Self::STATUS.as_u16(),
            self.to_string(),
        )
    }
}

#[cfg(feature = "tonic")]
impl From<NoDownstreamKey> for tonic::Status {
    fn from(e: NoDownstreamKey) -> Self {
        tracing::error!("{e}");
        // A method wired wrong, not a refusal of the contract: a retry cannot help.
        tonic::Status::internal(e.to_string())
    }
}
