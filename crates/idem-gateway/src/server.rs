//! The HTTP server loop of [`serve`](crate::serve), `idem serve` and `idem proxy`: axum's
//! router on hyper, with a deadline for request heads.
//!
//! Written out rather than `axum::serve` because that gives hyper no timer, so a client that
//! sends half a request head (or nothing) holds its connection forever: a slowloris. Bodies
//! have their own deadline in the idempotency layer (`Policy::body_timeout`).

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;

/// How long a client may take to send a request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// How long connections may take to finish after shutdown begins.
const DRAIN: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown` completes, closing connections whose request
/// head does not arrive within `head_timeout`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    head_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
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
        let connection = graceful.watch(connection(stream, router.clone(), head_timeout));
        tokio::spawn(async move {
            // A client that goes away or times out ends its connection; nothing to report.
            let _ = connection.await;
        });
    }
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after {DRAIN:?}; closing them");
    }
    Ok(())
}

/// One client connection of the server loop: `router` on hyper's HTTP/1, closed when a request
/// head does not arrive within `head_timeout`. Public so the fuzzer can feed it bytes from
/// memory through exactly what a socket's bytes go through.
pub fn connection<I>(
    io: I,
    router: Router,
    head_timeout: Duration,
) -> http1::Connection<TokioIo<I>, TowerToHyperService<Router>>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // HTTP/1.1 only: the clients of a payments API speak it, and HTTP/2 detection would wait
    // for a preface before any head deadline applies. No upgrades: nothing here speaks
    // WebSocket.
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(head_timeout);
    builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(router))
}
