//! Logs and traces of the idem command (docs/contract.md §15).
//!
//! Log lines go to stderr as always. `idem serve`, `idem proxy` and `idem worker` also export
//! traces over OTLP when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, and nothing when it is not:
//! `OTEL_EXPORTER_OTLP_PROTOCOL` picks `http/protobuf` (the default) or `grpc`,
//! `OTEL_SERVICE_NAME` names the service (`idem-serve`, `idem-proxy` or `idem-worker`
//! otherwise), and the SDK's own variables (`OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_BSP_SCHEDULE_DELAY`, …) apply as documented by
//! OpenTelemetry. The spans exported are the HTTP server span of each request (joined to the
//! caller's trace by its `traceparent` header), the layer's `idempotency` span inside it, and
//! the store calls inside that.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Whether spans are exported: the server spans are made only then.
static EXPORTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The target of the server spans this module makes.
const HTTP_SPAN_TARGET: &str = "idem::http";

/// What was set up; [`shutdown`](Self::shutdown) sends the spans still buffered.
#[must_use = "shut it down before exiting, or the last spans are lost"]
pub(crate) struct Telemetry {
    export: Option<Export>,
}

/// A running OTLP export: its provider and the runtime its clients run on.
struct Export {
    provider: SdkTracerProvider,
    runtime: tokio::runtime::Runtime,
}

/// How traces leave the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    HttpProtobuf,
    Grpc,
}

impl Telemetry {
    /// Installs the log formatter and, for a service (`Some(name)`, its default service name)
    /// with an OTLP endpoint set, the trace export. Only a bad `OTEL_*` setting is an error.
    pub(crate) fn init(service: Option<&'static str>) -> anyhow::Result<Self> {
        let export = match service {
            Some(name) if export_configured() => Some(Export::start(name)?),
            _ => None,
        };
        // The layer's spans are for traces; in the log lines they would only repeat, before
        // every line, the fields those lines already carry.
        let logs = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(log_filter());
        let traces = export.as_ref().map(|export| {
            tracing_opentelemetry::layer()
                .with_tracer(export.provider.tracer("idem"))
                .with_location(false)
                .with_threads(false)
                .with_filter(trace_filter())
        });
        let _ = tracing_subscriber::registry()
            .with(logs)
            .with(traces)
            .try_init();
        if export.is_some() {
            opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
            EXPORTING.store(true, std::sync::atomic::Ordering::Relaxed);
            tracing::info!("exporting traces over OTLP");
        }
        Ok(Self { export })
    }

    /// Sends what is buffered and stops the export, waiting at most a few seconds for the
    /// receiver. Runs on a thread of its own: the export's runtime cannot be dropped on one of
    /// the main runtime's threads.
    pub(crate) fn shutdown(self) {
        let Some(export) = self.export else { return };
        let stopped = std::thread::spawn(move || {
            if let Err(e) = export
                .provider
                .shutdown_with_timeout(Duration::from_secs(5))
            {
                tracing::warn!(error = %e, "the last spans could not be exported");
            }
            export.runtime.shutdown_timeout(Duration::from_secs(1));
        });
        let _ = stopped.join();
    }
}

/// Whether an OTLP endpoint for traces is set, and not turned off by the SDK's switches.
fn export_configured() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
        || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.eq_ignore_ascii_case("none"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// The protocol the OTLP variables ask for (the traces' own first).
fn protocol() -> anyhow::Result<Protocol> {
    let value = [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ]
    .iter()
    .find_map(|name| std::env::var(name).ok().map(|v| (*name, v)));
    match value {
        None => Ok(Protocol::HttpProtobuf),
        Some((_, v)) if v.trim() == "http/protobuf" => Ok(Protocol::HttpProtobuf),
        Some((_, v)) if v.trim() == "grpc" => Ok(Protocol::Grpc),
        Some((name, v)) => anyhow::bail!(
            "{name}={v:?} is not a protocol idem exports with; use http/protobuf or grpc"
        ),
    }
}

impl Export {
    fn start(default_service: &str) -> anyhow::Result<Self> {
        let protocol = protocol()?;
        // The exporters' clients (reqwest, tonic) need a Tokio reactor, and the SDK's batch
        // processor runs them on a plain thread of its own: they run on this runtime instead,
        // which also keeps the export's work off the threads that serve requests.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("idem-otlp")
            .enable_all()
            .build()
            .context("cannot start the OTLP export's runtime")?;
        let exporter = {
            let _entered = runtime.enter();
            let builder = opentelemetry_otlp::SpanExporter::builder();
            match protocol {
                Protocol::HttpProtobuf => builder
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_http_client(reqwest::Client::new())
                    .build(),
                Protocol::Grpc => builder
                    .with_tonic()
                    .with_protocol(opentelemetry_otlp::Protocol::Grpc)
                    .build(),
            }
            .context("cannot set up the OTLP export (see the OTEL_EXPORTER_OTLP_* variables)")?
        };
        let exporter = OnRuntime {
            exporter: Arc::new(exporter),
            runtime: runtime.handle().clone(),
        };
        let mut resource = opentelemetry_sdk::Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name(default_service.to_owned());
        }
        let provider = SdkTracerProvider::builder()
            .with_span_processor(BatchSpanProcessor::builder(exporter).build())
            .with_resource(resource.build())
            .build();
        Ok(Self { provider, runtime })
    }
}

/// An exporter whose exports run on a given runtime. Written by hand: the SDK's batch
/// processor awaits exports on a thread with no reactor, and neither the SDK nor the OTLP
/// crate offers an adapter (their async processors are experimental).
#[derive(Debug)]
struct OnRuntime<E> {
    exporter: Arc<E>,
    runtime: tokio::runtime::Handle,
}

impl<E: SpanExporter + 'static> SpanExporter for OnRuntime<E> {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let exporter = self.exporter.clone();
        let exported = self
            .runtime
            .spawn(async move { exporter.export(batch).await });
        async move {
            exported.await.unwrap_or_else(|e| {
                Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                    e.to_string(),
                ))
            })
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.exporter.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.exporter.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        // Called once, while the provider is built and before any export shares the exporter.
        if let Some(exporter) = Arc::get_mut(&mut self.exporter) {
            exporter.set_resource(resource);
        }
    }
}

/// What the log lines show: `RUST_LOG`, or `info`, never the spans made for traces.
fn log_filter() -> EnvFilter {
    let filter = EnvFilter::try_from_default_env()
        // rustls' platform verifier logs every certificate it rejects as an ERROR of its own;
        // idem's error for that connection already names the host and the reason.
        .unwrap_or_else(|_| EnvFilter::new("info,rustls_platform_verifier=off"));
    [
        HTTP_SPAN_TARGET,
        idem_tower::REQUEST_SPAN_TARGET,
        idem_tower::STORE_SPAN_TARGET,
    ]
    .iter()
    .fold(filter, |filter, target| {
        filter.add_directive(format!("{target}=off").parse().expect("a valid directive"))
    })
}

/// What is exported: the spans, and warnings and errors of idem's own crates as their events.
fn trace_filter() -> Targets {
    Targets::new()
        .with_target(HTTP_SPAN_TARGET, LevelFilter::INFO)
        .with_target(idem_tower::REQUEST_SPAN_TARGET, LevelFilter::INFO)
        .with_target(idem_tower::STORE_SPAN_TARGET, LevelFilter::INFO)
        .with_target("idem", LevelFilter::WARN)
}

/// `router` with each request in a server span ([`server_span`]) when spans are exported;
/// as it is otherwise.
pub(crate) fn with_server_spans(router: axum::Router) -> axum::Router {
    if EXPORTING.load(std::sync::atomic::Ordering::Relaxed) {
        router.layer(axum::middleware::from_fn(server_span))
    } else {
        router
    }
}

/// Middleware: each request runs in a server span, a child of the caller's span when its
/// `traceparent` header names one (W3C Trace Context), and goes on with a `traceparent` that
/// names the server span. Without an export the span is
/// disabled and costs a callsite check.
async fn server_span(mut request: Request, next: Next) -> Response {
    let span = tracing::info_span!(
        target: HTTP_SPAN_TARGET,
        "http.server",
        otel.name = format!("{} {}", request.method(), request.uri().path()),
        otel.kind = "server",
        http.request.method = %request.method(),
        url.path = request.uri().path(),
        http.response.status_code = tracing::field::Empty,
    );
    if !span.is_disabled() {
        opentelemetry::global::get_text_map_propagator(|propagator| {
            let parent =
                propagator.extract(&opentelemetry_http::HeaderExtractor(request.headers()));
            let _ = span.set_parent(parent);
            // What the request passes on (the gateway's upstream call) carries this span as
            // its parent, so the upstream's spans nest under idem's, not beside them.
            let this = span.context();
            propagator.inject_context(
                &this,
                &mut opentelemetry_http::HeaderInjector(request.headers_mut()),
            );
        });
    }
    let response = tracing::Instrument::instrument(next.run(request), span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    response
}
