//! Responses the layer makes itself: problems and replays.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use idem_core::{ProblemKind, StoredResponse};

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
