//! Buffering a handler's response: the client gets it whole, the store what the policy keeps.

use std::fmt;

use bytes::Bytes;
use http::Response;
use http_body::Body;
use http_body_util::BodyExt;
use idem_core::{Policy, StoredResponse};

use crate::Outcome;

/// What went wrong while buffering a handler's response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BufferError {
    /// The response body failed while it was read. Its error is kept as text because the
    /// layer asks of a response body's error only that it displays (`ResBody::Error:
    /// Display`, a public bound), so it cannot be kept as a `source`.
    #[error("reading the response body failed: {0}")]
    ReadBody(String),
}

/// Reads a response's body whole and decides what to keep of it: the response to pass on, the
/// outcome it asks for, and what the store keeps.
pub(crate) async fn buffer_response<B>(
    policy: &Policy,
    response: Response<B>,
) -> Result<(Response<B>, Outcome, StoredResponse), BufferError>
where
    B: Body<Data = Bytes> + From<Bytes>,
    B::Error: fmt::Display,
{
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| BufferError::ReadBody(e.to_string()))?
        .to_bytes();
    let status = parts.status.as_u16();
    let outcome = parts
        .extensions
        .get::<Outcome>()
        .copied()
        .unwrap_or_else(|| Outcome::for_status(policy, status));
    let body_omitted = body.len() > policy.storage_cap;
    let stored = StoredResponse {
        status,
        headers: parts
            .headers
            .iter()
            .filter(|(name, _)| policy.stores_header(name.as_str()))
            .filter_map(|(name, value)| {
                Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
            })
            .collect(),
        body: if body_omitted {
            Vec::new()
        } else {
            body.to_vec()
        },
        body_omitted,
    };
    Ok((Response::from_parts(parts, B::from(body)), outcome, stored))
}
