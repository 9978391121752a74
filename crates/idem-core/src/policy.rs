//! Policy: which requests are covered, how long keys live, what is stored.

use std::time::Duration;

use serde::Serialize;

use crate::KeyLimits;

/// Headers never stored, whatever the allow-list says: cookies belong to one response, and
/// hop-by-hop headers to one connection (RFC 9110 §7.6.1).
const NEVER_STORED: &[&str] = &[
    "set-cookie",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

/// How the layer treats requests. [`Policy::default`] is the published default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Methods the contract applies to (upper case). Others pass through untouched.
    pub covered_methods: Vec<String>,
    /// Whether a covered request without a key is refused with `400` (else passed through).
    pub require_key: bool,
    /// Key length bounds.
    pub key_limits: KeyLimits,
    /// How long a key is remembered (default 24 h).
    pub retention: Duration,
    /// Largest request body accepted (default 1 MiB); larger bodies get `413`.
    pub body_limit: usize,
    /// Largest response body stored (default 1 MiB); larger ones are passed through and their
    /// replays carry an empty body.
    pub storage_cap: usize,
    /// Response headers stored besides `content-type` and `location` (lower case).
    pub stored_headers: Vec<String>,
    /// Statuses below 500 that are *not* stored, because they reject a request before any work,
    /// so the client may fix it and retry with the same key.
    pub unstored_statuses: Vec<u16>,
    /// How long a duplicate waits for the original in transaction mode before `409`.
    pub in_flight_wait: Duration,
    /// How long a lease-mode claim holds without renewal.
    pub lease: Duration,
    /// The longest one call that lease-mode work makes to another system (a payment provider,
    /// an upstream API) may take: the client's timeout for it. A claim is held for
    /// [`lease_hold`](Self::lease_hold) past each renewal, so a crashed worker's key is neither
    /// taken over nor reconciled as "nothing happened" while a call it made may still be
    /// running. Zero (the default) for work that calls nothing outside.
    pub downstream_timeout: Duration,
    /// How long a request body may take to arrive; a body that trickles in slower gets `408`
    /// instead of holding a connection forever.
    pub body_timeout: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            covered_methods: vec!["POST".into(), "PATCH".into()],
            require_key: true,
            key_limits: KeyLimits::default(),
            retention: Duration::from_secs(24 * 60 * 60),
            body_limit: 1024 * 1024,
            storage_cap: 1024 * 1024,
            stored_headers: Vec::new(),
            unstored_statuses: vec![400, 401, 403, 404, 405, 408, 413, 415, 429],
            in_flight_wait: Duration::from_secs(10),
            lease: Duration::from_secs(30),
            downstream_timeout: Duration::ZERO,
            body_timeout: Duration::from_secs(30),
        }
    }
}

impl Policy {
    /// Whether requests with `method` are covered.
    pub fn covers(&self, method: &str) -> bool {
        self.covered_methods
            .iter()
            .any(|m| m.eq_ignore_ascii_case(method))
    }

    /// How long past its claim or its last renewal a lease-mode claim holds the key: the lease
    /// plus the downstream timeout. A call started while the claim held cannot outlast it.
    pub fn lease_hold(&self) -> Duration {
        self.lease + self.downstream_timeout
    }

    /// Whether a response with `status` is stored for replay: 2xx, 3xx and business 4xx
    /// outcomes are; rejections before any work and 5xx are not.
    pub fn stores_status(&self, status: u16) -> bool {
        status < 500 && !self.unstored_statuses.contains(&status) && status >= 200
    }

    /// Whether the response header `name` is kept with a stored response.
    pub fn stores_header(&self, name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        if NEVER_STORED.contains(&name.as_str()) {
            return false;
        }
        name == "content-type"
            || name == "location"
            || self
                .stored_headers
                .iter()
                .any(|h| h.eq_ignore_ascii_case(&name))
    }

    /// Whether the response trailer `name` is kept with a stored response: every trailer is
    /// (a gRPC call's status and its custom trailing metadata), but never one of the fields
    /// that are never stored as headers either.
    pub fn stores_trailer(&self, name: &str) -> bool {
        !NEVER_STORED
            .iter()
            .any(|never| never.eq_ignore_ascii_case(name))
    }

    /// The rules as published at `GET /idempotency-policy`.
    pub fn published(&self, mode: &str) -> PublishedPolicy {
        PublishedPolicy {
            header: "Idempotency-Key",
            key_format: format!(
                "an RFC 9651 sf-string (\"...\") or a bare key; {}-{} characters of visible ASCII (0x21-0x7E); a bare key may not contain '\"', ',' or ';'",
                self.key_limits.min_len, self.key_limits.max_len
            ),
            key_min_length: self.key_limits.min_len,
            key_max_length: self.key_limits.max_len,
            scope: "per authenticated account: the same key from two accounts names two unrelated requests",
            covered_methods: self.covered_methods.clone(),
            key_required: self.require_key,
            retention_seconds: self.retention.as_secs(),
            fingerprint: "SHA-256 over account, method, route, query, content type and the canonical body (JSON: members sorted, whitespace dropped, numbers kept as written; duplicate members refused)",
            mismatch: "422 application/problem+json; the stored record is untouched",
            in_flight: match mode {
                "transaction" => format!(
                    "the duplicate waits up to {} s for the original, then replays it (or runs fresh if it rolled back); past the wait 409 with Retry-After",
                    self.in_flight_wait.as_secs()
                ),
                _ => "409 application/problem+json with Retry-After".to_string(),
            },
            replay_header: "Idempotent-Replayed: true",
            stored_outcomes: "2xx, 3xx and business 4xx; not 5xx and not the rejections before any work",
            unstored_statuses: self.unstored_statuses.clone(),
            request_body_limit_bytes: self.body_limit,
            response_storage_cap_bytes: self.storage_cap,
        }
    }
}

/// The published idempotency rules, as JSON.
#[derive(Debug, Clone, Serialize)]
#[allow(missing_docs)] // the field names are the documentation; README explains each
pub struct PublishedPolicy {
    pub header: &'static str,
    pub key_format: String,
    pub key_min_length: usize,
    pub key_max_length: usize,
    pub scope: &'static str,
    pub covered_methods: Vec<String>,
    pub key_required: bool,
    pub retention_seconds: u64,
    pub fingerprint: &'static str,
    pub mismatch: &'static str,
    pub in_flight: String,
    pub replay_header: &'static str,
    pub stored_outcomes: &'static str,
    pub unstored_statuses: Vec<u16>,
    pub request_body_limit_bytes: usize,
    pub response_storage_cap_bytes: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_business_outcomes_only() {
        let p = Policy::default();
        for stored in [200, 201, 202, 303, 402, 409, 422] {
            assert!(p.stores_status(stored), "{stored}");
        }
        for not in [100, 400, 401, 403, 404, 405, 413, 415, 429, 500, 502, 503] {
            assert!(!p.stores_status(not), "{not}");
        }
    }

    #[test]
    fn never_stores_cookies_or_hop_by_hop_headers() {
        let p = Policy {
            stored_headers: vec!["Set-Cookie".into(), "x-request-id".into()],
            ..Policy::default()
        };
        assert!(p.stores_header("Content-Type"));
        assert!(p.stores_header("location"));
        assert!(p.stores_header("X-Request-Id"));
        assert!(!p.stores_header("set-cookie"));
        assert!(!p.stores_header("transfer-encoding"));
        assert!(!p.stores_header("date"));
    }

    #[test]
    fn a_claim_is_held_through_its_longest_downstream_call() {
        let p = Policy {
            lease: Duration::from_secs(2),
            downstream_timeout: Duration::from_secs(10),
            ..Policy::default()
        };
        assert_eq!(p.lease_hold(), Duration::from_secs(12));
        assert_eq!(Policy::default().lease_hold(), Policy::default().lease);
    }

    #[test]
    fn covers_post_and_patch_by_default() {
        let p = Policy::default();
        assert!(p.covers("POST") && p.covers("PATCH"));
        for m in ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"] {
            assert!(!p.covers(m), "{m}");
        }
    }
}
