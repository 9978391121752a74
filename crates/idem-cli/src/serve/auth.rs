//! Bearer-token authentication for the sandbox accounts.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idem_core::AccountId;

use super::error::ApiError;

/// Puts the request's [`AccountId`] in its extensions, or answers `401`.
pub(crate) async fn authenticate(
    State(tokens): State<Arc<HashMap<String, AccountId>>>,
    mut request: Request,
    next: Next,
) -> Response {
    let account = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|token| tokens.get(token.trim()));
    match account {
        Some(account) => {
            request.extensions_mut().insert(account.clone());
            next.run(request).await
        }
        None => ApiError::Unauthorized.into_response(),
    }
}
