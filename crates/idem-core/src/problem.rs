//! The problem types of docs/contract.md §2, each with a stable `type` URI (RFC 9457).

use std::borrow::Cow;

use serde::Serialize;

use crate::GrpcCode;

/// Every way the contract can refuse or defer a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// `400`: a covered request came without a key.
    MissingKey,
    /// `400`: the key is malformed.
    MalformedKey,
    /// `400`: the body could not be fingerprinted (invalid JSON, a duplicate member).
    MalformedBody,
    /// `422`: the key was used for a different request.
    Mismatch,
    /// `409`: the key's original request is still running.
    InUse,
    /// `409`: the key's original request ended in an unknown state and needs reconciling.
    OutcomeUnknown,
    /// `413`: the body is over the limit.
    BodyTooLarge,
    /// `408`: the body did not arrive in time.
    BodyTimeout,
    /// `503`: the record store cannot be reached; the request was not processed.
    StoreUnavailable,
    /// `502`: a gateway could not reach its upstream (nothing was sent, so a retry runs fresh),
    /// or its connection failed after the request was sent (the outcome is unknown).
    UpstreamUnavailable,
    /// `504`: a gateway sent the request but its upstream did not answer in time; the outcome
    /// is unknown.
    UpstreamTimeout,
    /// `500`: the layer found no account for a covered request (no authentication ran before
    /// it), so it cannot scope the key; nothing was run or stored (docs/contract.md §12).
    NoAccount,
    /// `401`: a covered request came without the credential its scope is derived from (the
    /// gateway's); nothing was run or stored.
    NoCredential,
    /// `500`: the handler panicked; nothing was stored and the key is free again.
    HandlerFailed,
    /// `500`: the handler asked for the layer's transaction on a request the layer opened none
    /// for (a route wired wrong); a retry cannot help.
    NoTransaction,
}

impl ProblemKind {
    /// Every kind, in declaration order: for documents that list them all (an OpenAPI
    /// document's problem schemas), so that a new kind is not left out by a copied list.
    pub const ALL: [Self; 15] = [
        Self::MissingKey,
        Self::MalformedKey,
        Self::MalformedBody,
        Self::Mismatch,
        Self::InUse,
        Self::OutcomeUnknown,
        Self::BodyTooLarge,
        Self::BodyTimeout,
        Self::StoreUnavailable,
        Self::UpstreamUnavailable,
        Self::UpstreamTimeout,
        Self::NoAccount,
        Self::NoCredential,
        Self::HandlerFailed,
        Self::NoTransaction,
    ];

    /// The stable `type` URI.
    pub fn type_uri(self) -> &'static str {
        match self {
            Self::MissingKey => "urn:idem:problem:missing-key",
            Self::MalformedKey => "urn:idem:problem:malformed-key",
            Self::MalformedBody => "urn:idem:problem:malformed-body",
            Self::Mismatch => "urn:idem:problem:mismatch",
            Self::InUse => "urn:idem:problem:in-use",
            Self::OutcomeUnknown => "urn:idem:problem:outcome-unknown",
            Self::BodyTooLarge => "urn:idem:problem:body-too-large",
            Self::BodyTimeout => "urn:idem:problem:body-timeout",
            Self::StoreUnavailable => "urn:idem:problem:store-unavailable",
            Self::UpstreamUnavailable => "urn:idem:problem:upstream-unavailable",
            Self::UpstreamTimeout => "urn:idem:problem:upstream-timeout",
            Self::NoAccount => "urn:idem:problem:no-account",
            Self::NoCredential => "urn:idem:problem:no-credential",
            Self::HandlerFailed => "urn:idem:problem:handler-failed",
            Self::NoTransaction => "urn:idem:problem:no-transaction",
        }
    }

    /// The HTTP status.
    pub fn status(self) -> u16 {
        match self {
            Self::MissingKey | Self::MalformedKey | Self::MalformedBody => 400,
            Self::Mismatch => 422,
            Self::InUse | Self::OutcomeUnknown => 409,
            Self::BodyTooLarge => 413,
            Self::BodyTimeout => 408,
            Self::StoreUnavailable => 503,
            Self::UpstreamUnavailable => 502,
            Self::UpstreamTimeout => 504,
            Self::NoAccount | Self::HandlerFailed | Self::NoTransaction => 500,
            Self::NoCredential => 401,
        }
    }

    /// The gRPC status a gRPC call gets for this problem instead of the HTTP status
    /// (docs/contract.md §14), in a trailers-only response.
    pub fn grpc_code(self) -> GrpcCode {
        match self {
            Self::MissingKey | Self::MalformedKey | Self::MalformedBody => {
                GrpcCode::InvalidArgument
            }
            Self::Mismatch => GrpcCode::FailedPrecondition,
            Self::InUse | Self::OutcomeUnknown => GrpcCode::Aborted,
            Self::BodyTooLarge => GrpcCode::ResourceExhausted,
            Self::BodyTimeout | Self::UpstreamTimeout => GrpcCode::DeadlineExceeded,
            Self::StoreUnavailable | Self::UpstreamUnavailable => GrpcCode::Unavailable,
            Self::NoAccount | Self::HandlerFailed | Self::NoTransaction => GrpcCode::Internal,
            Self::NoCredential => GrpcCode::Unauthenticated,
        }
    }

    /// A short summary that does not change from occurrence to occurrence.
    pub fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key is missing",
            Self::MalformedKey => "Idempotency-Key is malformed",
            Self::MalformedBody => "The request body is malformed",
            Self::Mismatch => "Idempotency-Key was used for a different request",
            Self::InUse => "A request with this Idempotency-Key is in progress",
            Self::OutcomeUnknown => {
                "The outcome of this Idempotency-Key's request is being reconciled"
            }
            Self::BodyTooLarge => "The request body is too large",
            Self::BodyTimeout => "The request body did not arrive in time",
            Self::StoreUnavailable => "The idempotency store is unavailable",
            Self::UpstreamUnavailable => "The upstream service is unavailable",
            Self::UpstreamTimeout => "The upstream service did not answer in time",
            Self::NoAccount => "The request's account is unknown",
            Self::NoCredential => "The request carries no credential",
            Self::HandlerFailed => "The request's handler failed",
            Self::NoTransaction => "The handler asked for a transaction the layer did not open",
        }
    }

    /// A problem-details document for this kind with `detail`.
    pub fn with_detail(self, detail: impl Into<String>) -> Problem {
        Problem {
            kind: Cow::Borrowed(self.type_uri()),
            title: Cow::Borrowed(self.title()),
            status: self.status(),
            detail: detail.into(),
        }
    }
}

/// An RFC 9457 problem-details document: the one body every problem idem answers has, its
/// members always in this order (`type`, `title`, `status`, `detail`), whichever part of idem
/// (the layer, the gateway, `idem serve`) answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// The problem type URI.
    #[serde(rename = "type")]
    pub kind: Cow<'static, str>,
    /// Its summary.
    pub title: Cow<'static, str>,
    /// The HTTP status.
    pub status: u16,
    /// What happened this time.
    pub detail: String,
}

impl Problem {
    /// A problem of a service's own (`urn:idem:problem:` + `name`), beside the contract's
    /// [`ProblemKind`]s: `idem serve`'s validation errors and declines, the gateway's `401`.
    pub fn other(
        name: &str,
        title: impl Into<Cow<'static, str>>,
        status: u16,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            kind: Cow::Owned(format!("urn:idem:problem:{name}")),
            title: title.into(),
            status,
            detail: detail.into(),
        }
    }

    /// The JSON body (`application/problem+json`).
    ///
    /// # Panics
    ///
    /// Never: a problem's members are strings and a number, which always serialise.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a Problem always serialises")
    }

    /// The body in `dialect`: the problem document, and for [`ErrorDialect::Stripe`] an
    /// `error` member after it (`{"type": "idempotency_error", "message": detail}`), which is
    /// what Stripe's SDKs look for before they raise; without it they hand the body to the
    /// application as if it were the resource.
    ///
    /// # Panics
    ///
    /// Never, as for [`to_json`](Self::to_json).
    pub fn to_json_in(&self, dialect: ErrorDialect) -> Vec<u8> {
        match dialect {
            ErrorDialect::Problem => self.to_json(),
            ErrorDialect::Stripe => {
                #[derive(Serialize)]
                struct StripeError<'a> {
                    #[serde(rename = "type")]
                    kind: &'static str,
                    message: &'a str,
                }
                #[derive(Serialize)]
                struct WithStripeError<'a> {
                    #[serde(flatten)]
                    problem: &'a Problem,
                    error: StripeError<'a>,
                }
                serde_json::to_vec(&WithStripeError {
                    problem: self,
                    error: StripeError {
                        kind: "idempotency_error",
                        message: &self.detail,
                    },
                })
                .expect("a Problem always serialises")
            }
        }
    }
}

/// How a problem body is written for clients (docs/contract.md §10).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorDialect {
    /// RFC 9457 problem details alone (the default).
    #[default]
    Problem,
    /// Problem details plus Stripe's `error` member, so Stripe's own SDKs raise.
    Stripe,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stripe_dialect_adds_an_error_member_after_the_problem() {
        let problem = ProblemKind::Mismatch.with_detail("changed");
        let body: serde_json::Value =
            serde_json::from_slice(&problem.to_json_in(ErrorDialect::Stripe)).unwrap();
        assert_eq!(body["type"], "urn:idem:problem:mismatch");
        assert_eq!(body["status"], 422);
        assert_eq!(body["error"]["type"], "idempotency_error");
        assert_eq!(body["error"]["message"], "changed");
        assert_eq!(problem.to_json_in(ErrorDialect::Problem), problem.to_json());
    }

    #[test]
    fn all_lists_every_kind_once_in_declaration_order() {
        // Exhaustive on purpose: a new kind does not compile here until it has the next place
        // and the range below counts it; then the test fails until `ALL` lists it there.
        let place = |kind: ProblemKind| match kind {
            ProblemKind::MissingKey => 0,
            ProblemKind::MalformedKey => 1,
            ProblemKind::MalformedBody => 2,
            ProblemKind::Mismatch => 3,
            ProblemKind::InUse => 4,
            ProblemKind::OutcomeUnknown => 5,
            ProblemKind::BodyTooLarge => 6,
            ProblemKind::BodyTimeout => 7,
            ProblemKind::StoreUnavailable => 8,
            ProblemKind::UpstreamUnavailable => 9,
            ProblemKind::UpstreamTimeout => 10,
            ProblemKind::NoAccount => 11,
            ProblemKind::NoCredential => 12,
            ProblemKind::HandlerFailed => 13,
            ProblemKind::NoTransaction => 14,
        };
        let places: Vec<usize> = ProblemKind::ALL.into_iter().map(place).collect();
        assert_eq!(places, (0..=14).collect::<Vec<_>>());
        let uris: std::collections::HashSet<_> = ProblemKind::ALL.map(ProblemKind::type_uri).into();
        assert_eq!(uris.len(), ProblemKind::ALL.len(), "one type URI per kind");
    }

    #[test]
    fn every_problem_body_has_its_members_in_one_order() {
        let ours = ProblemKind::Mismatch.with_detail("d").to_json();
        let theirs = Problem::other("card-declined", "Declined", 402, "d").to_json();
        for body in [ours, theirs] {
            let text = String::from_utf8(body).unwrap();
            let at = |member: &str| text.find(&format!("\"{member}\":")).unwrap();
            assert!(
                at("type") < at("title") && at("title") < at("status"),
                "{text}"
            );
            assert!(at("status") < at("detail"), "{text}");
        }
    }
}
