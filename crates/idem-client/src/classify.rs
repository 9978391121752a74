//! Which answers are worth another attempt, and what `Retry-After` asks for.

use std::time::{Duration, UNIX_EPOCH};

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, StatusCode};
use idem_core::{ProblemKind, Timestamp};

/// Whether an answer with this status, headers and body should be tried again with the same
/// key.
///
/// - `429` and every `5xx`: the server could not take the request now.
/// - `409` when it is idem's "key in use" (the original request is still running) or
///   "outcome unknown" (it is being reconciled), told by the problem `type`, or any `409`
///   with `Retry-After`: the server itself says a later try can succeed. A `409` without
///   either is a business conflict (the resource's state forbids the request) that the same
///   request will meet again, so it is final.
/// - Everything else, `400`, `422` and the other `4xx` included, is final: it needs a changed
///   request, and a changed request needs a new key.
pub(crate) fn is_retryable(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> bool {
    match status {
        StatusCode::TOO_MANY_REQUESTS => true,
        StatusCode::CONFLICT => {
            headers.contains_key(RETRY_AFTER) || is_key_in_use_problem(headers, body)
        }
        s => s.is_server_error(),
    }
}

fn is_key_in_use_problem(headers: &HeaderMap, body: &[u8]) -> bool {
    let is_problem = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/problem+json"));
    if !is_problem {
        return false;
    }
    let Ok(problem) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    let kind = problem.get("type").and_then(serde_json::Value::as_str);
    [ProblemKind::InUse, ProblemKind::OutcomeUnknown]
        .iter()
        .any(|k| kind == Some(k.type_uri()))
}

/// The wait a `Retry-After` header asks for, measured from `now` when it is an HTTP-date
/// (zero for a date already past). `None` when absent or unreadable, in which case the
/// jittered backoff applies.
pub(crate) fn retry_after(headers: &HeaderMap, now: Timestamp) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // delta-seconds too large for a u64 still mean "a very long time".
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    let millis = date.duration_since(UNIX_EPOCH).ok()?.as_millis();
    let at = Timestamp(i64::try_from(millis).unwrap_or(i64::MAX));
    Some(now.until(at))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(n, v)| {
                (
                    http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                )
            })
            .collect()
    }

    fn retryable(status: u16, hs: &[(&str, &str)], body: &str) -> bool {
        is_retryable(
            StatusCode::from_u16(status).unwrap(),
            &headers(hs),
            body.as_bytes(),
        )
    }

    #[test]
    fn overload_and_server_errors_are_retried() {
        for status in [429, 500, 502, 503, 504] {
            assert!(retryable(status, &[], ""), "{status}");
        }
    }

    #[test]
    fn answers_that_need_a_changed_request_are_final() {
        for status in [200, 201, 204, 301, 400, 401, 402, 403, 404, 413, 415, 422] {
            assert!(!retryable(status, &[], ""), "{status}");
        }
    }

    #[test]
    fn conflict_is_retried_only_when_it_is_a_key_in_use() {
        let problem = [("content-type", "application/problem+json")];
        let in_use = r#"{"type":"urn:idem:problem:in-use","status":409}"#;
        let unknown = r#"{"type":"urn:idem:problem:outcome-unknown","status":409}"#;
        let other = r#"{"type":"urn:example:already-refunded","status":409}"#;
        assert!(retryable(409, &problem, in_use));
        assert!(retryable(409, &problem, unknown));
        assert!(retryable(409, &[("retry-after", "3")], "busy"));
        assert!(!retryable(409, &problem, other));
        assert!(
            !retryable(409, &[], in_use),
            "a type is read only from problem details"
        );
        assert!(!retryable(409, &problem, "not json"));
    }

    #[test]
    fn retry_after_in_seconds() {
        let now = Timestamp(0);
        let at = |v: &str| retry_after(&headers(&[("retry-after", v)]), now);
        assert_eq!(at("7"), Some(Duration::from_secs(7)));
        assert_eq!(at(" 0 "), Some(Duration::ZERO));
        assert_eq!(
            at("99999999999999999999999"),
            Some(Duration::from_secs(u64::MAX))
        );
        assert_eq!(at("-1"), None);
        assert_eq!(at("1.5"), None);
        assert_eq!(at("soon"), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn retry_after_as_a_date_counts_from_the_clock() {
        let now = Timestamp(1_700_000_000_000);
        let at = |v: &str| retry_after(&headers(&[("retry-after", v)]), now);
        let later = httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(1_700_000_042));
        let earlier = httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(1_699_999_000));
        assert_eq!(at(&later), Some(Duration::from_secs(42)));
        assert_eq!(at(&earlier), Some(Duration::ZERO));
    }
}
