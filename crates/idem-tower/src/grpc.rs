//! gRPC calls through the layer (docs/contract.md §14): which calls it covers, their status,
//! and idem's own refusals as trailers-only responses.
//!
//! A call is told by its `content-type` (`application/grpc`, `application/grpc+proto`, ...).
//! Nothing on the wire tells a unary method from a streaming one, so the methods that stream
//! are named ([`IdempotencyLayer::with_grpc_streaming`](crate::IdempotencyLayer::with_grpc_streaming))
//! and pass through untouched, key or not; the others are covered when they carry a key, and
//! refuse a call without one only when named in
//! [`with_grpc_key_required`](crate::IdempotencyLayer::with_grpc_key_required).

use std::collections::HashSet;

use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use idem_core::{GrpcClass, GrpcCode, Problem, ProblemKind, grpc_message, is_grpc_content_type};

use crate::Outcome;

/// `grpc-status`.
pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// `grpc-message`.
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// gRPC's `Retry-After`: a client whose retry policy covers the status waits this long
/// (milliseconds) before its next attempt.
const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// The fields that carry a call's status: in the trailers, or in the headers of a
/// trailers-only response, where they are stored like `content-type`.
pub(crate) const STATUS_FIELDS: [&str; 3] =
    ["grpc-status", "grpc-message", "grpc-status-details-bin"];

/// Whether a request or a response is a gRPC call's, by its `content-type`.
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| is_grpc_content_type(v.as_bytes()))
}

/// The call's status: from the trailers, or from the headers of a trailers-only response.
pub(crate) fn status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<GrpcCode> {
    trailers
        .and_then(|t| t.get(GRPC_STATUS))
        .or_else(|| headers.get(GRPC_STATUS))
        .and_then(|v| GrpcCode::from_field(v.as_bytes()))
}

impl Outcome {
    /// The default for a gRPC call that ended with `code` (docs/contract.md §14): results are
    /// stored, transient and authentication failures released, server errors follow the 5xx
    /// rule. A response without a status is a server error too, unless its message was over
    /// the storage cap, so that its status, which comes after the message, was not read: a
    /// message is a result.
    pub(crate) fn for_grpc(code: Option<GrpcCode>, over_cap: bool) -> Self {
        match code.map(GrpcCode::class) {
            Some(GrpcClass::Stored) => Outcome::Store,
            Some(GrpcClass::NotStored) => Outcome::Release,
            Some(GrpcClass::ServerError) => Outcome::Unknown,
            None if over_cap => Outcome::Store,
            None => Outcome::Unknown,
        }
    }
}

/// The methods (`/package.Service/Method`) with rules of their own.
#[derive(Debug, Clone, Default)]
pub(crate) struct GrpcMethods {
    /// Streaming methods: passed through untouched, key or not.
    pub(crate) streaming: HashSet<String>,
    /// Unary methods that refuse a call without a key.
    pub(crate) key_required: HashSet<String>,
}

/// A trailers-only response for one of the layer's refusals of a gRPC call: HTTP `200`, no
/// body, the status in the headers. Its `Retry-After`, if any, becomes
/// `grpc-retry-pushback-ms`, which gRPC clients with a retry policy honour.
pub(crate) fn refusal<B>(
    mut response: Response<B>,
    problem: &Problem,
    kind: ProblemKind,
) -> Response<B>
where
    B: From<bytes::Bytes>,
{
    let pushback = response
        .headers()
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    *response.status_mut() = StatusCode::OK;
    *response.body_mut() = B::from(bytes::Bytes::new());
    let headers = response.headers_mut();
    headers.clear();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(
        GRPC_STATUS,
        HeaderValue::from_static(kind.grpc_code().as_field()),
    );
    let message = grpc_message(&format!("{}: {}", problem.kind, problem.detail));
    if let Ok(message) = HeaderValue::try_from(message) {
        headers.insert(GRPC_MESSAGE, message);
    }
    if let Some(seconds) = pushback {
        headers.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from(seconds * 1000));
    }
    response
}

/// The status of a replayed call whose message was over the storage cap and was not kept,
/// when its own status was not read either: `INTERNAL`, which gRPC clients do not retry, with
/// a message that says the call was done.
pub(crate) fn omitted_status(headers: &mut HeaderMap) {
    if headers.contains_key(GRPC_STATUS) {
        return;
    }
    headers.insert(
        GRPC_STATUS,
        HeaderValue::from_static(GrpcCode::Internal.as_field()),
    );
    headers.insert(
        GRPC_MESSAGE,
        HeaderValue::from_static(
            "the call was done, but its response was larger than the storage cap and was not kept",
        ),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn a_refusal_becomes_a_trailers_only_status_with_pushback() {
        let refused: Response<Bytes> = crate::response::Refusal::InUse.response("busy");
        let problem = ProblemKind::InUse.with_detail("busy");
        let response = refusal(refused, &problem, ProblemKind::InUse);
        assert_eq!(response.status(), 200);
        assert!(response.body().is_empty());
        assert_eq!(response.headers()["grpc-status"], "10");
        assert_eq!(response.headers()["grpc-retry-pushback-ms"], "1000");
        assert_eq!(response.headers()["content-type"], "application/grpc");
        assert_eq!(
            response.headers()["grpc-message"],
            "urn:idem:problem:in-use: busy"
        );
    }

    #[test]
    fn the_status_is_read_from_the_trailers_first() {
        let mut headers = HeaderMap::new();
        headers.insert(GRPC_STATUS, HeaderValue::from_static("5"));
        let mut trailers = HeaderMap::new();
        trailers.insert(GRPC_STATUS, HeaderValue::from_static("0"));
        assert_eq!(status(&headers, Some(&trailers)), Some(GrpcCode::Ok));
        assert_eq!(status(&headers, None), Some(GrpcCode::NotFound));
        assert_eq!(status(&HeaderMap::new(), None), None);
    }
}
