//! The problems `idem serve`'s handlers answer themselves, beside the idempotency layer's.
//!
//! Like axum's rejections, each error knows its status, its `type` and its headers, and turns
//! itself into the response (RFC 9457 problem details), so no handler chooses them.

use std::borrow::Cow;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::{Problem, ProblemKind};

/// A request the service refuses, or could not carry out, as the client is told.
///
/// Causes are logged where they happen (a handler knows what it was doing); the error holds
/// only what its response says.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
    /// `400`: the body is not a valid payment request; the text says what is wrong.
    #[error("the payment request is invalid: {0}")]
    Invalid(String),
    /// `401`: no registered sandbox token in `Authorization: Bearer <token>`.
    #[error("no registered bearer token")]
    Unauthorized,
    /// `402`: the payment provider declined the payout, a business outcome (stored and
    /// replayed).
    #[error("the payment provider declined the payout")]
    CardDeclined,
    /// `404`: the account has no payment with this id.
    #[error("no payment {id} in this account")]
    NotFound {
        /// The id asked for.
        id: String,
    },
    /// `500`: the payment could not be recorded; nothing was charged.
    #[error("the payment could not be recorded")]
    NotRecorded,
    /// `502`: the payment provider could not be reached, so nothing was sent to it.
    #[error("the payment provider is unavailable")]
    ProviderUnreachable,
    /// `502`: the payment provider answered with a failure; the payout may have happened.
    #[error("the payment provider failed")]
    ProviderFailed,
    /// `502`: the payment provider's answer could not be read; the payout may have happened.
    #[error("the payment provider's answer is unreadable")]
    ProviderUnreadable,
    /// `504`: the payment provider did not answer; the payout may have happened.
    #[error("the payment provider did not answer")]
    ProviderSilent,
    /// `503`: the database could not be reached; nothing was done.
    #[error("the database is unavailable")]
    StoreUnavailable,
}

impl ApiError {
    /// The `type` of [`ApiError::Invalid`].
    pub(crate) const VALIDATION: &'static str = "urn:idem:problem:validation";
    /// The `type` of [`ApiError::Unauthorized`].
    pub(crate) const UNAUTHORIZED: &'static str = "urn:idem:problem:unauthorized";
    /// The `type` of [`ApiError::CardDeclined`].
    pub(crate) const CARD_DECLINED: &'static str = "urn:idem:problem:card-declined";
    /// The `type` of [`ApiError::NotFound`].
    pub(crate) const NOT_FOUND: &'static str = "urn:idem:problem:not-found";
    /// The `type` of [`ApiError::NotRecorded`].
    pub(crate) const INTERNAL: &'static str = "urn:idem:problem:internal";

    /// One error of each variant (with placeholder data), so that the OpenAPI document lists
    /// every `type` and status the service answers.
    pub(crate) fn every() -> [Self; 10] {
        [
            Self::Invalid(String::new()),
            Self::Unauthorized,
            Self::CardDeclined,
            Self::NotFound { id: String::new() },
            Self::NotRecorded,
            Self::ProviderUnreachable,
            Self::ProviderFailed,
            Self::ProviderUnreadable,
            Self::ProviderSilent,
            Self::StoreUnavailable,
        ]
    }

    /// The HTTP status.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Self::Invalid(_) => StatusCode::BAD_REQUEST,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::CardDeclined => StatusCode::PAYMENT_REQUIRED,
            Self::NotFound { .. } => StatusCode::NOT_FOUND,
            Self::NotRecorded => StatusCode::INTERNAL_SERVER_ERROR,
            Self::ProviderUnreachable | Self::ProviderFailed | Self::ProviderUnreadable => {
                StatusCode::BAD_GATEWAY
            }
            Self::ProviderSilent => StatusCode::GATEWAY_TIMEOUT,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The problem `type`: the service's own, or the contract's where a client should read
    /// the answer as the layer's (the provider's unknown outcomes, an unreachable database).
    pub(crate) fn type_uri(&self) -> &'static str {
        match self {
            Self::Invalid(_) => Self::VALIDATION,
            Self::Unauthorized => Self::UNAUTHORIZED,
            Self::CardDeclined => Self::CARD_DECLINED,
            Self::NotFound { .. } => Self::NOT_FOUND,
            Self::NotRecorded => Self::INTERNAL,
            Self::ProviderUnreachable => ProblemKind::UpstreamUnavailable.type_uri(),
            Self::ProviderFailed | Self::ProviderUnreadable | Self::ProviderSilent => {
                ProblemKind::OutcomeUnknown.type_uri()
            }
            Self::StoreUnavailable => ProblemKind::StoreUnavailable.type_uri(),
        }
    }

    /// The problem's `title`.
    fn title(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "The payment request is invalid",
            Self::Unauthorized => "Authentication required",
            Self::CardDeclined => "The payment provider declined the payout",
            Self::NotFound { .. } => "No such payment",
            Self::NotRecorded => "The payment could not be recorded",
            Self::ProviderUnreachable => "The payment provider is unavailable",
            Self::ProviderFailed => "The payment provider failed",
            Self::ProviderUnreadable => "The payment provider's answer is unreadable",
            Self::ProviderSilent => "The payment provider did not answer",
            Self::StoreUnavailable => "The database is unavailable",
        }
    }

    /// The problem's `detail`: what happened, and what the client may do about it.
    fn detail(&self) -> String {
        let text = match self {
            Self::Invalid(detail) => return detail.clone(),
            Self::NotFound { id } => return format!("no payment {id} in this account"),
            Self::Unauthorized => {
                "send Authorization: Bearer <token> with a registered sandbox token"
            }
            Self::CardDeclined => "declined by the provider",
            Self::NotRecorded => "nothing was charged; retry with the same key",
            Self::ProviderUnreachable => {
                "nothing was sent to the provider; retry with the same key"
            }
            Self::ProviderFailed | Self::ProviderSilent => {
                "the payout may or may not have happened; retry with the same key to learn which"
            }
            Self::ProviderUnreadable => {
                "the payout may have happened; retry with the same key to learn which"
            }
            Self::StoreUnavailable => "nothing was done; retry later",
        };
        text.to_owned()
    }

    /// The problem-details document of this error.
    pub(crate) fn problem(&self) -> Problem {
        Problem {
            kind: Cow::Borrowed(self.type_uri()),
            title: Cow::Borrowed(self.title()),
            status: self.status().as_u16(),
            detail: self.detail(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status(),
            [(header::CONTENT_TYPE, "application/problem+json")],
            self.problem().to_json(),
        )
            .into_response();
        let headers = response.headers_mut();
        match self {
            Self::Unauthorized => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            // Both pass soon or not at all: a retry a second later costs little.
            Self::ProviderUnreachable | Self::StoreUnavailable => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lists_each_variant_once() {
        // Exhaustive on purpose: a new variant does not compile here until it has the next
        // place and the range below counts it; then the test fails until `every` lists it.
        let place = |error: &ApiError| match error {
            ApiError::Invalid(_) => 0,
            ApiError::Unauthorized => 1,
            ApiError::CardDeclined => 2,
            ApiError::NotFound { .. } => 3,
            ApiError::NotRecorded => 4,
            ApiError::ProviderUnreachable => 5,
            ApiError::ProviderFailed => 6,
            ApiError::ProviderUnreadable => 7,
            ApiError::ProviderSilent => 8,
            ApiError::StoreUnavailable => 9,
        };
        let places: Vec<usize> = ApiError::every().iter().map(place).collect();
        assert_eq!(places, (0..=9).collect::<Vec<_>>());
    }

    #[test]
    fn an_error_answers_problem_details_with_its_headers() {
        let not_found = ApiError::NotFound { id: "pay_1".into() };
        let body: serde_json::Value =
            serde_json::from_slice(&not_found.problem().to_json()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "type": "urn:idem:problem:not-found",
                "title": "No such payment",
                "status": 404,
                "detail": "no payment pay_1 in this account",
            })
        );
        let response = not_found.into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );

        let unauthorized = ApiError::Unauthorized.into_response();
        assert_eq!(unauthorized.headers()[header::WWW_AUTHENTICATE], "Bearer");
        for retried in [ApiError::ProviderUnreachable, ApiError::StoreUnavailable] {
            assert_eq!(retried.into_response().headers()[header::RETRY_AFTER], "1");
        }
        assert!(
            !ApiError::ProviderSilent
                .into_response()
                .headers()
                .contains_key(header::RETRY_AFTER)
        );
    }
}
