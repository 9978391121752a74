//! Bodies across the bridge: actix-web's are `!Send` and idem-tower's must be `Send`, so each
//! crosses as bytes through a bounded channel, fed by a local task on the actix side.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use actix_web::body::{BodySize, MessageBody};
use actix_web::dev::Payload;
use actix_web::error::PayloadError;
use bytes::Bytes;
use futures_util::StreamExt;
use http_body::{Body, Frame, SizeHint};
use idem_tower::{RebuildBody, ResponseBody};
use tokio::sync::mpsc;

/// How many chunks a pump may run ahead of the side that reads them: enough to keep both
/// busy, few enough that a body nobody reads holds little.
const CHUNKS_AHEAD: usize = 4;

/// A body read on the actix side failed. Kept as text: actix-web's body errors are boxed
/// `!Send` errors, which cannot cross to idem-tower's side.
#[derive(Debug, Clone)]
pub(crate) struct BridgeError(String);

impl fmt::Display for BridgeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BridgeError {}

/// A body as idem-tower sees it: bytes held whole, or chunks from a pump on the actix side.
#[derive(Debug)]
pub(crate) enum BridgeBody {
    /// `None` once sent.
    Full(Option<Bytes>),
    Pumped {
        chunks: mpsc::Receiver<Result<Bytes, BridgeError>>,
        /// What is left of the length the actix side declared, if it did.
        left: Option<u64>,
    },
}

impl BridgeBody {
    fn full(bytes: Bytes) -> Self {
        Self::Full((!bytes.is_empty()).then_some(bytes))
    }

    /// A request's payload, pumped from a local task while idem-tower reads it.
    pub(crate) fn of_payload(payload: Payload) -> Self {
        if let Payload::None = payload {
            return Self::full(Bytes::new());
        }
        let (sender, chunks) = mpsc::channel(CHUNKS_AHEAD);
        actix_web::rt::spawn(async move {
            let mut payload = payload;
            while let Some(chunk) = payload.next().await {
                let chunk = chunk.map_err(|e| BridgeError(e.to_string()));
                let failed = chunk.is_err();
                // A receiver that is gone wants no more: the layer refused the request, or
                // read what it needed.
                if sender.send(chunk).await.is_err() || failed {
                    break;
                }
            }
        });
        Self::Pumped { chunks, left: None }
    }

    /// A handler's response body. One already in memory crosses as it is; any other is
    /// pumped, so that the layer reads only up to its storage cap and a longer body streams
    /// on to the client.
    pub(crate) fn of_message<B: MessageBody + 'static>(body: B) -> Self {
        let len = match body.size() {
            BodySize::None => return Self::full(Bytes::new()),
            BodySize::Sized(len) => Some(len),
            BodySize::Stream => None,
        };
        let body = match body.try_into_bytes() {
            Ok(bytes) => return Self::full(bytes),
            Err(body) => body,
        };
        let (sender, chunks) = mpsc::channel(CHUNKS_AHEAD);
        actix_web::rt::spawn(async move {
            let mut body = std::pin::pin!(body);
            while let Some(chunk) = std::future::poll_fn(|cx| body.as_mut().poll_next(cx)).await {
                let chunk = chunk.map_err(|e| BridgeError(e.into().to_string()));
                let failed = chunk.is_err();
                if sender.send(chunk).await.is_err() || failed {
                    break;
                }
            }
        });
        Self::Pumped { chunks, left: len }
    }

    /// The body as an actix payload again, for the handler (a keyless request that passes
    /// through still streams).
    pub(crate) fn into_payload(self) -> Payload {
        match self {
            Self::Full(None) => Payload::None,
            Self::Full(Some(bytes)) => Payload::from(bytes),
            Self::Pumped { chunks, .. } => {
                let stream = futures_util::stream::unfold(chunks, |mut chunks| async move {
                    let chunk = chunks.recv().await?;
                    let chunk = chunk.map_err(|e| PayloadError::Io(std::io::Error::other(e)));
                    Some((chunk, chunks))
                });
                let stream: Pin<Box<dyn futures_util::Stream<Item = _>>> = Box::pin(stream);
                Payload::from(stream)
            }
        }
    }
}

impl Body for BridgeBody {
    type Data = Bytes;
    type Error = BridgeError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BridgeError>>> {
        match self.get_mut() {
            Self::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Self::Pumped { chunks, left } => {
                let chunk = ready!(chunks.poll_recv(cx));
                // The hint is of what is left: the layer reads the first bytes of a response
                // over the storage cap and hands the rest on with its hint.
                if let (Some(left), Some(Ok(chunk))) = (left.as_mut(), &chunk) {
                    *left = left.saturating_sub(chunk.len() as u64);
                }
                Poll::Ready(chunk.map(|c| c.map(Frame::data)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Self::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            Self::Pumped {
                left: Some(left), ..
            } => SizeHint::with_exact(*left),
            Self::Pumped { left: None, .. } => SizeHint::new(),
        }
    }
}

impl RebuildBody for BridgeBody {
    fn from_bytes(bytes: Bytes) -> Self {
        Self::full(bytes)
    }
}

/// The body of a response the middleware answered for a covered request: the handler's
/// (held whole, or streamed past the storage cap), a replay's, or one of the layer's
/// refusals.
pub struct IdempotentBody(pub(crate) ResponseBody<BridgeBody>);

impl fmt::Debug for IdempotentBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotentBody").field(&self.0).finish()
    }
}

impl MessageBody for IdempotentBody {
    type Error = Box<dyn std::error::Error>;

    fn size(&self) -> BodySize {
        match self.0.size_hint().exact() {
            Some(len) => BodySize::Sized(len),
            None => BodySize::Stream,
        }
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let body = &mut self.get_mut().0;
        loop {
            match ready!(Pin::new(&mut *body).poll_frame(cx)) {
                None => return Poll::Ready(None),
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                Some(Ok(frame)) => {
                    // HTTP/1 has nowhere for trailers; only gRPC answers carry them.
                    if let Ok(data) = frame.into_data() {
                        return Poll::Ready(Some(Ok(data)));
                    }
                }
            }
        }
    }
}
