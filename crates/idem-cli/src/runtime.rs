//! What every long-running command shares: the shutdown signal, the process's metrics
//! recorder and its exporter, and the names the service and its workers meet under on the
//! broker.
//!
//! It depends on no command, so `serve`, `worker`, `fake-psp` and `proxy` can all depend on
//! it without depending on each other.

use std::net::SocketAddr;
use std::sync::OnceLock;

use anyhow::Context as _;

use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The topic payment events go to.
pub(crate) const PAYMENTS_TOPIC: &str = "payments";

/// The consumer group (and inbox name) receipts are written under.
pub const DEFAULT_CONSUMER: &str = "receipts";

/// The process has one metrics recorder; every server in it (tests start several) shares it.
pub(crate) fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // Fails only if another recorder is installed; then this one just stays empty.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// The answer to `GET /metrics`: the recorder's figures in Prometheus text format.
pub(crate) fn metrics_response(metrics: &PrometheusHandle) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        metrics.render(),
    )
        .into_response()
}

/// Serves the recorder's figures at `http://addr/metrics`, in a task of its own (`idem worker
/// --metrics-listen`).
pub(crate) async fn export_metrics(addr: SocketAddr) -> anyhow::Result<()> {
    let metrics = metrics_handle();
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} for metrics"))?;
    let router = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            async move { metrics_response(&metrics) }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(())
}

/// Completes on Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
    tracing::info!("shutting down");
}
