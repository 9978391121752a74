//! [`RebuildBody`]: the request body types the layer can hand on after reading them.

use bytes::Bytes;

/// A request body type the layer can make again from the bytes it read.
///
/// The layer reads a covered request's body whole (to fingerprint it) and hands the inner
/// service a body of the same type holding those bytes. Implemented for axum's `Body` (feature
/// `axum`), tonic's `Body` (feature `tonic`, what `Server::builder().layer(..)` passes) and
/// http-body-util's `Full<Bytes>`. A hyper server receives `hyper::body::Incoming`, which
/// cannot be made from bytes: map it to one of these before the layer
/// (`request.map(axum::body::Body::new)`), or implement this trait for a body of your own.
pub trait RebuildBody: http_body::Body + Sized {
    /// A body of `bytes`.
    fn from_bytes(bytes: Bytes) -> Self;
}

impl RebuildBody for http_body_util::Full<Bytes> {
    fn from_bytes(bytes: Bytes) -> Self {
        Self::new(bytes)
    }
}

#[cfg(feature = "axum")]
impl RebuildBody for axum::body::Body {
    fn from_bytes(bytes: Bytes) -> Self {
        Self::from(bytes)
    }
}

#[cfg(feature = "tonic")]
impl RebuildBody for tonic::body::Body {
    fn from_bytes(bytes: Bytes) -> Self {
        Self::new(http_body_util::Full::new(bytes))
    }
}
