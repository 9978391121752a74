//! Responses the layer makes itself: problems and replays.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
pub(crate) use idem_core::ErrorChain;
use idem_core::{Decision, Policy, ProblemKind, Scope, StoredResponse};

use crate::Reconciliation;

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// Marks a replay whose body was over the storage cap and was not kept.
pub const IDEMPOTENT_REPLAY: HeaderName = HeaderName::from_static("idempotent-replay");

/// A problem-details response, with `Retry-After` where given.
pub(crate) fn problem<B: From<Bytes>>(
    kind: ProblemKind,
    detail: impl Into<String>,
    retry_after: Option<Duration>,
) -> Response<B> {
    let problem = kind.with_detail(detail);
    let mut response = Response::new(B::from(Bytes::from(problem.to_json())));
    *response.status_mut() =
        StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    if let Some(after) = retry_after {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(after.as_secs().max(1)));
    }
    response
}

/// The stored response, marked as a replay.
pub(crate) fn replay<B: From<Bytes>>(stored: &StoredResponse) -> Response<B> {
    let mut response = Response::new(B::from(Bytes::copy_from_slice(&stored.body)));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if stored.body_omitted {
        headers.insert(IDEMPOTENT_REPLAY, HeaderValue::from_static("omitted"));
    }
    response
}

/// The one answer for a decision that settles the request without running it: a replay, a
/// mismatch, or a request in flight or of unknown outcome. `None` for a key to claim.
pub(crate) fn answer<B: From<Bytes>>(
    decision: &Decision<'_>,
    scope: &Scope,
    reconciliation: Option<&Reconciliation>,
) -> Option<Response<B>> {
    match decision {
        Decision::Fresh | Decision::Expired => None,
        Decision::Replay(stored) => {
            count("replay");
            tracing::debug!(key = %scope.log_label(), "replayed");
            Some(replay(stored))
        }
        Decision::Mismatch => Some(mismatch(scope)),
        Decision::InFlight { .. } | Decision::LeaseExpired { .. } => {
            Some(in_use(decision, reconciliation))
        }
    }
}

pub(crate) fn in_use<B: From<Bytes>>(
    decision: &Decision<'_>,
    reconciliation: Option<&Reconciliation>,
) -> Response<B> {
    count("in_flight");
    match decision {
        // The lease's remaining time is only the worst case (it is renewed while the work
        // runs); most work ends in well under a second, so ask for a retry in one.
        Decision::InFlight { retry_after } => problem(
            ProblemKind::InUse,
            "a request with this Idempotency-Key holds its lease: it is running, or its worker stopped while a call it made may still be running; retry later with the same key",
            Some((*retry_after).min(Duration::from_secs(1))),
        ),
        _ => problem(
            ProblemKind::OutcomeUnknown,
            "the request with this Idempotency-Key ended without a known outcome; it is being reconciled with the system it called; retry after Retry-After with the same key",
            // Without a reconciler only an operator resolves it (`idem keys`).
            Some(reconciliation.map_or(Duration::from_secs(5), Reconciliation::retry_after)),
        ),
    }
}

pub(crate) fn count(outcome: &'static str) {
    metrics::counter!("idem_requests_total", "outcome" => outcome).increment(1);
}

pub(crate) fn too_large<B: From<Bytes>>(policy: &Policy) -> Response<B> {
    problem(
        ProblemKind::BodyTooLarge,
        format!("the request body exceeds {} bytes", policy.body_limit),
        None,
    )
}

pub(crate) fn mismatch<B: From<Bytes>>(scope: &Scope) -> Response<B> {
    count("mismatch");
    tracing::info!(key = %scope.log_label(), "key reused for a different request");
    problem(
        ProblemKind::Mismatch,
        "this Idempotency-Key was used for a different request (method, path, query, content type or body); use a new key for a new request",
        None,
    )
}

pub(crate) fn store_unavailable<B: From<Bytes>>(error: &idem_store::Error) -> Response<B> {
    count("store_unavailable");
    tracing::error!(error = %ErrorChain(error), "idempotency store failed");
    problem(
        ProblemKind::StoreUnavailable,
        "the idempotency store is unavailable; the request was not processed; retry with the same key",
        Some(std::time::Duration::from_secs(1)),
    )
}
