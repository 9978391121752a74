//! Responses the layer makes itself: refusals and replays, and the one function that turns a
//! decision into its answer.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
pub(crate) use idem_core::ErrorChain;
use idem_core::{Decision, ProblemKind, Scope, StoredResponse};

use crate::Reconciliation;

/// The header that marks a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// Marks a replay whose body was over the storage cap and was not kept.
pub const IDEMPOTENT_REPLAY: HeaderName = HeaderName::from_static("idempotent-replay");

/// A problem the layer answers (docs/contract.md §2.8). Each knows its [`ProblemKind`] (and so
/// its status), its `Retry-After` and its metric label, so no call site chooses them.
///
/// A type of this crate rather than methods on [`ProblemKind`]: the kind is idem-core's, shared
/// with the gateway, while the `Retry-After` of an unknown outcome and the metric labels are
/// this layer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    MissingKey,
    MalformedKey,
    MalformedBody,
    BodyTooLarge,
    BodyTimeout,
    Mismatch,
    InUse,
    /// `retry_after`: when the outcome will be known, which depends on the reconciler.
    OutcomeUnknown {
        retry_after: Duration,
    },
    StoreUnavailable,
    /// No account to scope the key to (docs/contract.md §12).
    NoAccount,
    /// No credential to derive the scope from.
    NoCredential,
    /// The handler panicked; nothing was stored.
    HandlerFailed,
}

impl Refusal {
    /// The problem type, which also gives the status.
    pub(crate) fn kind(self) -> ProblemKind {
        match self {
            Self::MissingKey => ProblemKind::MissingKey,
            Self::MalformedKey => ProblemKind::MalformedKey,
            Self::MalformedBody => ProblemKind::MalformedBody,
            Self::BodyTooLarge => ProblemKind::BodyTooLarge,
            Self::BodyTimeout => ProblemKind::BodyTimeout,
            Self::Mismatch => ProblemKind::Mismatch,
            Self::InUse => ProblemKind::InUse,
            Self::OutcomeUnknown { .. } => ProblemKind::OutcomeUnknown,
            Self::StoreUnavailable => ProblemKind::StoreUnavailable,
            Self::NoAccount => ProblemKind::NoAccount,
            Self::NoCredential => ProblemKind::NoCredential,
            Self::HandlerFailed => ProblemKind::HandlerFailed,
        }
    }

    /// The `Retry-After` it carries, if any. Refusals of the request itself carry none: the
    /// client has to change the request, not wait.
    pub(crate) fn retry_after(self) -> Option<Duration> {
        match self {
            Self::MissingKey
            | Self::MalformedKey
            | Self::MalformedBody
            | Self::BodyTooLarge
            | Self::BodyTimeout
            | Self::Mismatch
            | Self::NoCredential => None,
            // A wiring mistake, and a handler that panicked would most likely panic again: a
            // client that retries at once only repeats it.
            Self::NoAccount | Self::HandlerFailed => None,
            // A lease's remaining time is only the worst case (it is renewed while the work
            // runs), and most work ends in well under a second: ask for a retry in one.
            Self::InUse => Some(Duration::from_secs(1)),
            Self::OutcomeUnknown { retry_after } => Some(retry_after),
            Self::StoreUnavailable => Some(Duration::from_secs(1)),
        }
    }

    /// Its `outcome` in `idem_requests_total` and on the request's span.
    pub(crate) fn metric_label(self) -> &'static str {
        match self {
            Self::MissingKey => "missing_key",
            Self::MalformedKey => "malformed_key",
            Self::MalformedBody => "malformed_body",
            Self::BodyTooLarge => "body_too_large",
            Self::BodyTimeout => "body_timeout",
            Self::Mismatch => "mismatch",
            Self::InUse => "in_use",
            Self::OutcomeUnknown { .. } => "unknown_outcome",
            Self::StoreUnavailable => "store_unavailable",
            Self::NoAccount => "no_account",
            Self::NoCredential => "no_credential",
            Self::HandlerFailed => "handler_failed",
        }
    }

    /// The answer to a request refused for this reason, counted under its label.
    pub(crate) fn refuse<B: From<Bytes>>(self, detail: impl Into<String>) -> Response<B> {
        count(self.metric_label());
        self.response(detail)
    }

    /// The problem response alone, not counted: for failures of the layer or the handler
    /// themselves (a panic, a response that could not be read), which are logged as errors
    /// rather than counted as a request's outcome.
    pub(crate) fn response<B: From<Bytes>>(self, detail: impl Into<String>) -> Response<B> {
        let problem = Arc::new(self.kind().with_detail(detail));
        let mut response = problem_response(&problem);
        response.extensions_mut().insert(Refused {
            problem,
            kind: self.kind(),
        });
        if let Some(after) = self.retry_after() {
            response
                .headers_mut()
                .insert(RETRY_AFTER, retry_after_value(after));
        }
        response
    }
}

/// Marks a response as the layer's own refusal, not the handler's answer nor a replay, so the
/// layer can add what only its refusals carry (the policy `Link`). It carries the problem, for
/// the layer to write again in another dialect or as a gRPC status.
#[derive(Debug, Clone)]
pub(crate) struct Refused {
    pub(crate) problem: Arc<idem_core::Problem>,
    pub(crate) kind: ProblemKind,
}

/// A response body the layer makes itself from bytes: a refusal's, or a replay's, which may
/// end with stored trailers.
pub(crate) trait MadeBody: From<Bytes> {
    /// `data`, then `trailers`.
    fn with_trailers(data: Bytes, trailers: HeaderMap) -> Self;
}

impl<B> MadeBody for crate::ResponseBody<B> {
    fn with_trailers(data: Bytes, trailers: HeaderMap) -> Self {
        Self::with_trailers(data, Some(trailers))
    }
}

/// A problem-details response of `problem`, with no `Retry-After`.
pub(crate) fn problem_response<B: From<Bytes>>(problem: &idem_core::Problem) -> Response<B> {
    let mut response = Response::new(B::from(Bytes::from(problem.to_json())));
    *response.status_mut() =
        StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// A `Retry-After` value: whole seconds (the header's unit), at least one.
pub(crate) fn retry_after_value(after: Duration) -> HeaderValue {
    HeaderValue::from(after.as_secs().max(1))
}

/// The stored response, marked as a replay: its status, headers, body and trailers.
pub(crate) fn replay<B: MadeBody>(stored: &StoredResponse) -> Response<B> {
    let fields = |fields: &mut dyn Iterator<Item = (&str, &str)>| {
        let mut map = HeaderMap::new();
        for (name, value) in fields {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) {
                map.append(name, value);
            }
        }
        map
    };
    let mut headers = fields(&mut stored.header_fields());
    let trailers = fields(&mut stored.trailers());
    let body = Bytes::copy_from_slice(&stored.body);
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    if stored.body_omitted {
        headers.insert(IDEMPOTENT_REPLAY, HeaderValue::from_static("omitted"));
        if crate::grpc::is_grpc(&headers) {
            crate::grpc::omitted_status(&mut headers);
        }
    }
    let mut response = Response::new(B::with_trailers(body, trailers));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    *response.headers_mut() = headers;
    response
}

/// The one answer for a decision that settles the request without running it: a replay, a
/// mismatch, or a request in flight or of unknown outcome. `None` for a key to claim.
pub(crate) fn answer<B: MadeBody>(
    decision: &Decision<'_>,
    scope: &Scope,
    reconciliation: Option<&Reconciliation>,
) -> Option<Response<B>> {
    match decision {
        Decision::Fresh | Decision::Expired => None,
        Decision::Replay(stored) => {
            Served::Replay.count();
            tracing::debug!(key = %scope.log_label(), "replayed");
            Some(replay(stored))
        }
        Decision::Mismatch => {
            tracing::info!(key = %scope.log_label(), "key reused for a different request");
            Some(Refusal::Mismatch.refuse(
                "this Idempotency-Key was used for a different request (method, path, query, content type or body); use a new key for a new request",
            ))
        }
        Decision::InFlight { .. } | Decision::LeaseExpired { .. } => {
            Some(unsettled(decision, reconciliation))
        }
    }
}

/// The answer for a record that a claim could not replace, which always settles the request:
/// [`answer`], and for a decision that would have claimed the key, the answer to work whose
/// outcome is not known.
pub(crate) fn settle<B: MadeBody>(
    decision: &Decision<'_>,
    scope: &Scope,
    reconciliation: Option<&Reconciliation>,
) -> Response<B> {
    answer(decision, scope, reconciliation).unwrap_or_else(|| unsettled(decision, reconciliation))
}

/// The answer to a duplicate of work that is still running or whose outcome is unknown.
fn unsettled<B: From<Bytes>>(
    decision: &Decision<'_>,
    reconciliation: Option<&Reconciliation>,
) -> Response<B> {
    match decision {
        Decision::InFlight { .. } => Refusal::InUse.refuse(
            "a request with this Idempotency-Key holds its lease: it is running, or its worker stopped while a call it made may still be running; retry later with the same key",
        ),
        _ => Refusal::OutcomeUnknown {
            // Without a reconciler only an operator resolves it (`idem keys`).
            retry_after: reconciliation.map_or(Duration::from_secs(5), Reconciliation::retry_after),
        }
        .refuse(
            "the request with this Idempotency-Key ended without a known outcome; it is being reconciled with the system it called; retry after Retry-After with the same key",
        ),
    }
}

/// What `idem_requests_total` counts besides refusals, which know their own label
/// ([`Refusal::metric_label`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Served {
    /// A keyless request let through because keys are optional.
    Passthrough,
    /// A stored response replayed.
    Replay,
    /// Work done once and its outcome stored.
    Fresh,
    /// Work done and its outcome not stored (released, unknown, or rolled back).
    NotStored,
    /// A duplicate that started waiting for the original's outcome (its answer is counted
    /// too, when it comes).
    Waited,
}

impl Served {
    /// Its `outcome` in `idem_requests_total`.
    pub(crate) fn metric_label(self) -> &'static str {
        match self {
            Self::Passthrough => "passthrough",
            Self::Replay => "replayed",
            Self::Fresh => "fresh",
            Self::NotStored => "not_stored",
            Self::Waited => "waited",
        }
    }

    /// Counts one request as this.
    pub(crate) fn count(self) {
        count(self.metric_label());
    }
}

fn count(outcome: &'static str) {
    metrics::counter!("idem_requests_total", "outcome" => outcome).increment(1);
    crate::telemetry::record_outcome(outcome);
}

/// The answer when the record store failed: nothing was processed.
pub(crate) fn store_unavailable<B: From<Bytes>>(error: &idem_store::Error) -> Response<B> {
    tracing::error!(error = %ErrorChain(error), "idempotency store failed");
    Refusal::StoreUnavailable.refuse(
        "the idempotency store is unavailable; the request was not processed; retry with the same key",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/contract.md §2.8: which refusals carry `Retry-After`, and what.
    #[test]
    fn each_refusal_carries_the_retry_after_of_the_contract() {
        let unknown = Refusal::OutcomeUnknown {
            retry_after: Duration::from_secs(61),
        };
        let cases = [
            (Refusal::MissingKey, 400, None),
            (Refusal::MalformedKey, 400, None),
            (Refusal::MalformedBody, 400, None),
            (Refusal::Mismatch, 422, None),
            (Refusal::InUse, 409, Some("1")),
            (unknown, 409, Some("61")),
            (Refusal::BodyTooLarge, 413, None),
            (Refusal::BodyTimeout, 408, None),
            (Refusal::StoreUnavailable, 503, Some("1")),
            (Refusal::NoAccount, 500, None),
            (Refusal::NoCredential, 401, None),
            (Refusal::HandlerFailed, 500, None),
        ];
        for (refusal, status, retry_after) in cases {
            let response: Response<Bytes> = refusal.response("d");
            assert_eq!(response.status().as_u16(), status, "{refusal:?}");
            assert_eq!(
                response
                    .headers()
                    .get(RETRY_AFTER)
                    .map(|v| v.to_str().unwrap()),
                retry_after,
                "{refusal:?}"
            );
            assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        }
    }

    #[test]
    fn a_retry_after_under_a_second_is_one() {
        assert_eq!(retry_after_value(Duration::from_millis(300)), "1");
        assert_eq!(retry_after_value(Duration::from_millis(2900)), "2");
    }
}
