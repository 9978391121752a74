//! The layer's response body, and reading a handler's response up to the storage cap: a body
//! that ends within the cap is held whole and stored, a larger one streams on to the client.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use idem_core::{Policy, StoredResponse};

use crate::{Outcome, grpc};

pin_project_lite::pin_project! {
    /// The body of every response [`Idempotency`](crate::Idempotency) answers.
    ///
    /// It is the handler's own body `B`, streamed, for requests the layer does not guard and
    /// for a response larger than the storage cap ([`Policy::storage_cap`]), of which the
    /// layer has read the first bytes to find out; or a body the layer holds whole: a
    /// handler's response within the cap, a replay, or one of the layer's own refusals
    /// (docs/contract.md §2.5).
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project_lite::pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        /// Held whole, then its trailers; each `None` once sent, or when there is none.
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        /// The bytes the layer already read (`None` once sent, or when it read none), then
        /// the rest of the handler's body as it comes.
        Streamed { prefix: Option<Bytes>, #[pin] rest: B },
    }
}

impl<B> ResponseBody<B> {
    /// A body of `data`, held whole.
    pub(crate) fn full(data: Bytes) -> Self {
        Self::with_trailers(data, None)
    }

    /// A body of `data`, held whole, then `trailers` (a gRPC call's `grpc-status`).
    pub(crate) fn with_trailers(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
                trailers: trailers.filter(|t| !t.is_empty()),
            },
        }
    }

    /// `prefix`, the bytes already read of a handler's body, then `rest`, the rest of it.
    pub(crate) fn streamed(prefix: Bytes, rest: B) -> Self {
        Self {
            kind: Kind::Streamed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
            },
        }
    }

    /// The handler's body, untouched.
    pub(crate) fn passthrough(body: B) -> Self {
        Self::streamed(Bytes::new(), body)
    }
}

/// The layer's own bodies (refusals and replays) are made from bytes.
impl<B> From<Bytes> for ResponseBody<B> {
    fn from(data: Bytes) -> Self {
        Self::full(data)
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Full { .. } => "full",
            Kind::Streamed { .. } => "streamed",
        };
        f.debug_struct("ResponseBody")
            .field("kind", &kind)
            .finish_non_exhaustive()
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Full { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
            KindProj::Streamed { prefix, rest } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(Frame::data(prefix)))),
                None => rest.poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Streamed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Streamed { prefix, rest } => {
                let read = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(read));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(read));
                }
                hint
            }
        }
    }
}

/// What went wrong while reading a handler's response.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BufferError {
    /// The response body failed while it was read. Its error is kept as text because the
    /// layer asks of a response body's error only that it displays (`ResBody::Error:
    /// Display`, a public bound), so it cannot be kept as a `source`.
    #[error("reading the response body failed: {0}")]
    ReadBody(String),
}

/// Reads a handler's response up to the storage cap and decides what to keep of it: the
/// response to pass on, the outcome it asks for, and what the store keeps.
///
/// A body that ends within the cap is held whole and stored, with its trailers (a gRPC call's
/// status). A longer one is known from its first `cap + 1` bytes: its outcome comes from the
/// head alone, it is stored with its body omitted, and the response carries the bytes read so
/// far and then the rest of the body, unread, so the layer never holds more than the cap (and
/// one frame) of it.
pub(crate) async fn read_response<B>(
    policy: &Policy,
    response: Response<B>,
) -> Result<(Response<ResponseBody<B>>, Outcome, StoredResponse), BufferError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: fmt::Display,
{
    let (parts, mut body) = response.into_parts();
    let read = read_up_to(policy.storage_cap, &mut body).await?;
    let status = parts.status.as_u16();
    let grpc = grpc::is_grpc(&parts.headers);
    let outcome = match parts.extensions.get::<Outcome>() {
        Some(outcome) => *outcome,
        None if grpc => Outcome::for_grpc(
            grpc::status(&parts.headers, read.trailers.as_ref()),
            read.over_cap,
        ),
        None => Outcome::for_status(policy, status),
    };
    let mut stored = StoredResponse {
        status,
        headers: stored_headers(policy, &parts.headers, grpc),
        body: if read.over_cap {
            Vec::new()
        } else {
            read.data.to_vec()
        },
        body_omitted: read.over_cap,
    };
    for (name, value) in read.trailers.iter().flatten() {
        if let Ok(value) = value.to_str()
            && policy.stores_trailer(name.as_str())
        {
            stored.push_trailer(name.as_str(), value);
        }
    }
    let body = if read.over_cap {
        ResponseBody::streamed(read.data, body)
    } else {
        ResponseBody::with_trailers(read.data, read.trailers)
    };
    Ok((Response::from_parts(parts, body), outcome, stored))
}

/// What [`read_up_to`] read of a body.
struct Read {
    data: Bytes,
    /// More than the cap came: the body goes on past `data`.
    over_cap: bool,
    /// The trailers, when the body ended within the cap with some.
    trailers: Option<HeaderMap>,
}

/// Reads `body` until it ends or more than `cap` bytes have come.
async fn read_up_to<B>(cap: usize, body: &mut B) -> Result<Read, BufferError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: fmt::Display,
{
    // A body that tells its length is read into one allocation, never larger than the cap.
    let expected = body.size_hint().lower().min(cap as u64 + 1);
    let mut read = BytesMut::with_capacity(usize::try_from(expected).unwrap_or(cap));
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BufferError::ReadBody(e.to_string()))?;
        match frame.into_data() {
            Ok(data) => {
                read.extend_from_slice(&data);
                if read.len() > cap {
                    return Ok(Read {
                        data: read.freeze(),
                        over_cap: true,
                        trailers: None,
                    });
                }
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(more);
                }
            }
        }
    }
    Ok(Read {
        data: read.freeze(),
        over_cap: false,
        trailers,
    })
}

/// The response headers the policy stores, as text; values that are not visible ASCII are
/// dropped. A gRPC response keeps its status fields too; a trailers-only one (an error, its
/// status in the headers) keeps every field a trailer would keep, since they are its trailing
/// metadata, but `date`, which belongs to the one response.
fn stored_headers(policy: &Policy, headers: &HeaderMap, grpc: bool) -> Vec<(String, String)> {
    let trailers_only = grpc && headers.contains_key(grpc::GRPC_STATUS);
    headers
        .iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            policy.stores_header(name)
                || grpc && grpc::STATUS_FIELDS.contains(&name)
                || trailers_only && policy.stores_trailer(name) && name != "date"
        })
        .filter_map(|(name, value)| {
            Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use http_body_util::Full;

    use super::*;

    /// A body of frames given in advance, one of which may fail; its size hint is exactly
    /// what is left, so a test can see how much of it the layer read.
    struct Chunks(VecDeque<Result<Bytes, &'static str>>);

    impl Chunks {
        fn new(frames: &[Result<&'static [u8], &'static str>]) -> Self {
            Self(
                frames
                    .iter()
                    .map(|f| (*f).map(Bytes::from_static))
                    .collect(),
            )
        }
    }

    impl Body for Chunks {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            Poll::Ready(self.0.pop_front().map(|f| f.map(Frame::data)))
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.0.iter().flatten().map(|c| c.len() as u64).sum())
        }
    }

    fn policy(storage_cap: usize) -> Policy {
        Policy {
            storage_cap,
            ..Policy::default()
        }
    }

    async fn read_all<B: Body<Data = Bytes>>(body: B) -> Result<Bytes, B::Error> {
        Ok(body.collect().await?.to_bytes())
    }

    #[tokio::test]
    async fn a_body_that_ends_at_the_cap_is_held_and_stored_whole() {
        let chunks = Chunks::new(&[Ok(b"123"), Ok(b"45")]);
        let (response, outcome, stored) = read_response(&policy(5), Response::new(chunks))
            .await
            .unwrap();
        assert_eq!(outcome, Outcome::Store);
        assert_eq!(stored.body, b"12345");
        assert!(!stored.body_omitted);
        assert_eq!(response.body().size_hint().exact(), Some(5));
        assert_eq!(read_all(response.into_body()).await.unwrap(), "12345");
    }

    #[tokio::test]
    async fn a_body_one_byte_over_the_cap_streams_on_and_is_stored_omitted() {
        let chunks = Chunks::new(&[Ok(b"123"), Ok(b"456"), Ok(b"789")]);
        let (response, _, stored) = read_response(&policy(5), Response::new(chunks))
            .await
            .unwrap();
        assert!(stored.body_omitted);
        assert!(stored.body.is_empty());
        // Read up to the frame that passed the cap, no further: the last frame is still the
        // handler's, and the hint counts both.
        assert_eq!(response.body().size_hint().exact(), Some(9));
        assert_eq!(read_all(response.into_body()).await.unwrap(), "123456789");
    }

    #[tokio::test]
    async fn the_outcome_over_the_cap_comes_from_the_head() {
        let mut response = Response::new(Chunks::new(&[Ok(b"123456")]));
        *response.status_mut() = http::StatusCode::BAD_GATEWAY;
        let (_, outcome, stored) = read_response(&policy(5), response).await.unwrap();
        assert_eq!((outcome, stored.status), (Outcome::Unknown, 502));
        let mut response = Response::new(Chunks::new(&[Ok(b"123456")]));
        response.extensions_mut().insert(Outcome::Release);
        let (_, outcome, _) = read_response(&policy(5), response).await.unwrap();
        assert_eq!(outcome, Outcome::Release);
    }

    #[tokio::test]
    async fn a_body_that_fails_within_the_cap_is_an_error_and_after_it_cuts_the_stream() {
        let early = Chunks::new(&[Ok(b"12"), Err("gone")]);
        assert!(
            read_response(&policy(5), Response::new(early))
                .await
                .is_err()
        );
        let late = Chunks::new(&[Ok(b"123456"), Err("gone")]);
        let (response, _, stored) = read_response(&policy(5), Response::new(late))
            .await
            .unwrap();
        assert!(stored.body_omitted);
        assert_eq!(read_all(response.into_body()).await, Err("gone"));
    }

    /// A gRPC answer: a message, then its status in the trailers. Both reach the client and
    /// the store; a transient status is not stored, a business one is.
    #[tokio::test]
    async fn trailers_are_passed_on_and_stored_and_a_grpc_status_decides() {
        let answer = |status: &'static str| {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static(status));
            trailers.insert("x-ledger", http::HeaderValue::from_static("l-1"));
            let body = http_body_util::StreamBody::new(futures_util::stream::iter([
                Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"msg"))),
                Ok(Frame::trailers(trailers)),
            ]));
            http::Response::builder()
                .header("content-type", "application/grpc")
                .body(body)
                .unwrap()
        };
        let (response, outcome, stored) = read_response(&policy(64), answer("0")).await.unwrap();
        assert_eq!(outcome, Outcome::Store);
        assert_eq!(stored.body, b"msg");
        assert_eq!(
            stored.trailers().collect::<Vec<_>>(),
            [("grpc-status", "0"), ("x-ledger", "l-1")]
        );
        let collected = response.into_body().collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["x-ledger"], "l-1");
        assert_eq!(collected.to_bytes(), "msg");

        let (_, outcome, _) = read_response(&policy(64), answer("14")).await.unwrap();
        assert_eq!(outcome, Outcome::Release, "UNAVAILABLE is not stored");
        let (_, outcome, _) = read_response(&policy(64), answer("9")).await.unwrap();
        assert_eq!(outcome, Outcome::Store, "FAILED_PRECONDITION is a result");
        let (_, outcome, _) = read_response(&policy(64), answer("13")).await.unwrap();
        assert_eq!(outcome, Outcome::Unknown, "INTERNAL follows the 5xx rule");
    }

    #[test]
    fn bodies_the_layer_makes_are_whole_and_an_empty_one_has_ended() {
        let full: ResponseBody<Full<Bytes>> = ResponseBody::from(Bytes::from_static(b"abc"));
        assert_eq!(full.size_hint().exact(), Some(3));
        assert!(!full.is_end_stream());
        let empty: ResponseBody<Full<Bytes>> = ResponseBody::from(Bytes::new());
        assert!(empty.is_end_stream());
        let passed = ResponseBody::passthrough(Full::new(Bytes::from_static(b"abcd")));
        assert_eq!(passed.size_hint().exact(), Some(4));
    }
}
