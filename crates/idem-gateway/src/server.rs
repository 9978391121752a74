//! The HTTP server loop of [`serve`](crate::serve), `idem serve` and `idem proxy`: axum's
//! router on hyper, with a deadline for request heads, over plain TCP or TLS
//! ([`serve_tls`]).
//!
//! Written out rather than `axum::serve` because that gives hyper no timer, so a client that
//! sends half a request head (or nothing) holds its connection forever: a slowloris. Bodies
//! have their own deadline in the idempotency layer (`Policy::body_timeout`).

use std::future::Future;
use std::net::SocketAddr;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tower::Service;

use crate::tls::ServerTls;

/// How long a client may take to send a request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// How long connections may take to finish after shutdown begins.
const DRAIN: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown` completes, closing connections whose request
/// head does not arrive within `head_timeout`.
///
/// # Errors
///
/// None in practice: a failed accept (out of file descriptors, say) is logged and retried, and
/// it returns `Ok(())` once `shutdown` completes and open connections have finished or been
/// closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    head_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    accept_loop(listener, router, head_timeout, None, shutdown).await
}

/// [`serve`] over TLS: HTTP/2 to clients that ask for it over ALPN, HTTP/1.1 to the rest. The
/// handshake has the head's deadline too, so a client that stalls in it is dropped.
///
/// # Errors
///
/// As for [`serve`]: none in practice.
pub async fn serve_tls(
    listener: TcpListener,
    router: Router,
    head_timeout: Duration,
    tls: ServerTls,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    accept_loop(listener, router, head_timeout, Some(tls), shutdown).await
}

async fn accept_loop(
    listener: TcpListener,
    router: Router,
    head_timeout: Duration,
    tls: Option<ServerTls>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let acceptor = tls.map(|tls| tls.acceptor());
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, addr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of file descriptors and the like: wait a moment rather than spin.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let tls = acceptor.is_some();
        // A client that goes away, times out or fails its handshake ends its connection;
        // nothing to report.
        match &acceptor {
            None => {
                let peer = Peer { addr, tls };
                let watcher = graceful.watcher();
                tokio::spawn(async move {
                    // gRPC clients speak HTTP/2 without TLS from their first byte (h2c with
                    // prior knowledge); everyone else HTTP/1.1.
                    match tokio::time::timeout(head_timeout, h2_preface(&stream)).await {
                        Ok(Ok(true)) => {
                            let _ = watcher
                                .watch(h2_connection(stream, WithPeer::new(router, peer)))
                                .await;
                        }
                        Ok(Ok(false)) => {
                            let _ = watcher
                                .watch(connection(
                                    stream,
                                    WithPeer::new(router, peer),
                                    head_timeout,
                                ))
                                .await;
                        }
                        // Silent past the head's deadline, or gone.
                        Ok(Err(_)) | Err(_) => {}
                    }
                });
            }
            Some(acceptor) => {
                let handshake = acceptor.accept(stream);
                let watcher = graceful.watcher();
                tokio::spawn(async move {
                    let Ok(Ok(stream)) = tokio::time::timeout(head_timeout, handshake).await else {
                        return;
                    };
                    let peer = Peer { addr, tls };
                    if stream.get_ref().1.alpn_protocol() == Some(b"h2") {
                        let _ = watcher
                            .watch(h2_connection(stream, WithPeer::new(router, peer)))
                            .await;
                    } else {
                        let _ = watcher
                            .watch(connection(
                                stream,
                                WithPeer::new(router, peer),
                                head_timeout,
                            ))
                            .await;
                    }
                });
            }
        }
    }
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after {DRAIN:?}; closing them");
    }
    Ok(())
}

/// The first bytes of every HTTP/2 connection (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether a plain TCP connection opens with HTTP/2's preface, from its first bytes, left
/// unread for the connection that serves it. An HTTP/1.1 request differs from it by its second
/// or third byte; a client that stops within the preface's first bytes is looked at again a
/// millisecond later (the bytes it sent stay readable, so waiting for more would not block).
async fn h2_preface(stream: &tokio::net::TcpStream) -> std::io::Result<bool> {
    let mut first = [0u8; H2_PREFACE.len()];
    loop {
        let n = stream.peek(&mut first).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if first[..n] != H2_PREFACE[..n] {
            return Ok(false);
        }
        if n == H2_PREFACE.len() {
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// An HTTP/2 connection: TLS with ALPN `h2`, or plain TCP that opened with HTTP/2's preface
/// (gRPC's h2c). hyper has no head deadline for HTTP/2; its keep-alive pings close a
/// connection whose peer stops answering.
fn h2_connection<I>(
    io: I,
    service: WithPeer,
) -> http2::Connection<TokioIo<I>, TowerToHyperService<WithPeer>, TokioExecutor>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(HEAD_TIMEOUT))
        .keep_alive_timeout(Duration::from_secs(20));
    builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service))
}

/// One client connection of the server loop: `service` (the router, with or without its
/// connection's [`Peer`]) on hyper's HTTP/1, closed when a request head does not arrive within
/// `head_timeout`. Public so the fuzzer can feed it bytes from memory through exactly what a
/// socket's bytes go through; a bare router's requests have no [`Peer`], so the gateway's
/// forwarding headers name no client address for them.
pub fn connection<I>(
    io: I,
    service: impl Into<WithPeer>,
    head_timeout: Duration,
) -> http1::Connection<TokioIo<I>, TowerToHyperService<WithPeer>>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // HTTP/1.1: the server loop sends a plain TCP connection that opens with HTTP/2's preface
    // (within the head's deadline) to `h2_connection` instead; over TLS, ALPN tells. No
    // upgrades: nothing here speaks WebSocket.
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(head_timeout);
    builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service.into()))
}

/// Who is on the other end of a connection, for the gateway's forwarding headers.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// The client's address.
    pub addr: SocketAddr,
    /// Whether the connection is TLS (`X-Forwarded-Proto: https`).
    pub tls: bool,
}

/// The router, with each request told its connection's [`Peer`] (a request extension).
#[derive(Debug, Clone)]
pub struct WithPeer {
    router: Router,
    peer: Option<Peer>,
}

impl WithPeer {
    fn new(router: Router, peer: Peer) -> Self {
        Self {
            router,
            peer: Some(peer),
        }
    }
}

/// A router whose requests are told no [`Peer`] (a connection the server loop did not accept).
impl From<Router> for WithPeer {
    fn from(router: Router) -> Self {
        Self { router, peer: None }
    }
}

impl<B> Service<http::Request<B>> for WithPeer
where
    Router: Service<http::Request<B>>,
{
    type Response = <Router as Service<http::Request<B>>>::Response;
    type Error = <Router as Service<http::Request<B>>>::Error;
    type Future = <Router as Service<http::Request<B>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        <Router as Service<http::Request<B>>>::poll_ready(&mut self.router, cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if let Some(peer) = self.peer {
            request.extensions_mut().insert(peer);
        }
        self.router.call(request)
    }
}
