//! OpenTelemetry (docs/contract.md §15): real `idem serve` and `idem proxy` processes export
//! their spans to an OTLP receiver of the test's own, over HTTP/protobuf and over gRPC, and
//! the receiver decodes them with `opentelemetry-proto`. Each request carries a `traceparent`
//! of its own, so its spans are found by their trace, under the caller's span: the server
//! span, the `idempotency` span with the outcome's attributes, and the store calls.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message as _;
use tokio::sync::Notify;

use crate::common::{ALICE, Spawned, keyed, send, start_psp};
use crate::payouts::payout;
use idem_cli::fake_psp::Faults;

/// One span as the receiver got it.
#[derive(Debug, Clone)]
pub(crate) struct ReceivedSpan {
    /// The `service.name` of the resource it came with.
    pub(crate) service: String,
    pub(crate) name: String,
    kind: i32,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attributes: BTreeMap<String, String>,
}

impl ReceivedSpan {
    pub(crate) fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.get(name).map(String::as_str)
    }
}

/// An OTLP receiver: what it decoded, and a wake-up for each export that arrives.
#[derive(Clone, Default)]
pub(crate) struct Receiver {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    arrived: Arc<Notify>,
}

impl Receiver {
    /// Listens for OTLP over HTTP (`POST /v1/traces`, protobuf); the receiver and its
    /// endpoint.
    pub(crate) async fn http() -> (Self, String) {
        let receiver = Self::default();
        let taken = receiver.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: bytes::Bytes| async move {
                let request = ExportTraceServiceRequest::decode(body)
                    .expect("an ExportTraceServiceRequest in protobuf");
                taken.take(request);
                (
                    [("content-type", "application/x-protobuf")],
                    ExportTraceServiceResponse::default().encode_to_vec(),
                )
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (receiver, endpoint)
    }

    /// Listens for OTLP over gRPC (the collector's `TraceService`); the receiver and its
    /// endpoint.
    async fn grpc() -> (Self, String) {
        let receiver = Self::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let service = TraceServiceServer::new(receiver.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await
        });
        (receiver, endpoint)
    }

    fn take(&self, request: ExportTraceServiceRequest) {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.resource_spans {
            let resource = resource_spans
                .resource
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            let service = resource.get("service.name").cloned().unwrap_or_default();
            for span in resource_spans
                .scope_spans
                .into_iter()
                .flat_map(|scope| scope.spans)
            {
                spans.push(ReceivedSpan {
                    service: service.clone(),
                    name: span.name,
                    kind: span.kind,
                    trace_id: hex::encode(span.trace_id),
                    span_id: hex::encode(span.span_id),
                    parent_span_id: hex::encode(span.parent_span_id),
                    attributes: attributes(&span.attributes),
                });
            }
        }
        self.arrived.notify_waiters();
    }

    /// The spans of `trace` once `complete` says they are all there.
    async fn trace(
        &self,
        trace: &Trace,
        complete: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let spans = self
            .spans_until(|spans| {
                let of_trace: Vec<_> = spans
                    .iter()
                    .filter(|s| s.trace_id == trace.trace_id)
                    .cloned()
                    .collect();
                complete(&of_trace)
            })
            .await;
        spans
            .into_iter()
            .filter(|s| s.trace_id == trace.trace_id)
            .collect()
    }

    /// Every span received, once `complete` says enough are there (within 20 s).
    pub(crate) async fn spans_until(
        &self,
        complete: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let wait = async {
            loop {
                // Listen before looking, so an export landing in between still wakes us.
                let arrived = self.arrived.notified();
                let spans = self.spans.lock().unwrap().clone();
                if complete(&spans) {
                    return spans;
                }
                arrived.await;
            }
        };
        match tokio::time::timeout(Duration::from_secs(20), wait).await {
            Ok(spans) => spans,
            Err(_) => panic!(
                "the spans awaited never arrived; the receiver has {:#?}",
                self.spans.lock().unwrap()
            ),
        }
    }

    /// The `idempotency` span of `trace`, with its outcome (and the rest of the trace), once
    /// exported.
    async fn request_span(&self, trace: &Trace) -> (ReceivedSpan, Vec<ReceivedSpan>) {
        let spans = self
            .trace(trace, |spans| {
                spans.iter().any(|s| s.name == "idempotency")
                    && spans.iter().any(|s| s.kind == SpanKind::Server as i32)
            })
            .await;
        let span = spans.iter().find(|s| s.name == "idempotency").unwrap();
        (span.clone(), spans)
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.take(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// Attributes as text: strings as they are, other values as they print.
fn attributes(list: &[KeyValue]) -> BTreeMap<String, String> {
    list.iter()
        .map(|kv| {
            let value = match kv.value.as_ref().and_then(|v: &AnyValue| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                Some(any_value::Value::IntValue(i)) => i.to_string(),
                Some(any_value::Value::BoolValue(b)) => b.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), value)
        })
        .collect()
}

/// A caller's span: the trace a request joins with its `traceparent` header.
struct Trace {
    trace_id: String,
    parent_id: String,
}

impl Trace {
    fn new() -> Self {
        let trace_id = uuid::Uuid::new_v4().simple().to_string();
        let parent_id = uuid::Uuid::new_v4().simple().to_string()[..16].to_owned();
        Self {
            trace_id,
            parent_id,
        }
    }

    fn on(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        request.header(
            "traceparent",
            format!("00-{}-{}-01", self.trace_id, self.parent_id),
        )
    }
}

/// The `idempotency` span of a request: its outcome, its mode, a key hash that is not the key,
/// under the server span that joined the caller's trace, and the store calls under it.
fn assert_request_span(
    (span, trace): &(ReceivedSpan, Vec<ReceivedSpan>),
    caller: &Trace,
    outcome: &str,
    mode: &str,
) {
    assert_eq!(
        span.attribute("idempotency.outcome"),
        Some(outcome),
        "{span:#?}"
    );
    assert_eq!(span.attribute("idempotency.mode"), Some(mode), "{span:#?}");
    assert_eq!(span.attribute("idempotency.protocol"), Some("http"));
    let server = trace
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("a server span");
    assert_eq!(server.parent_span_id, caller.parent_id, "the caller's span");
    assert_eq!(span.parent_span_id, server.span_id, "{trace:#?}");
    assert!(server.attribute("http.response.status_code").is_some());
    if let Some(hash) = span.attribute("idempotency.key_hash") {
        assert_eq!(hash.len(), 12, "{hash}");
        assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()), "{hash}");
    }
    for store in trace.iter().filter(|s| s.name == "idempotency.store") {
        assert_eq!(store.parent_span_id, span.span_id, "{store:#?}");
        assert!(store.attribute("idempotency.store.operation").is_some());
    }
}

/// A trace as an operator reads it: one line per span, children under their parent, with
/// the idem attributes (printed by the tests; docs/operations/tracing.md shows a run's).
fn describe(trace: &[ReceivedSpan]) -> String {
    fn lines(trace: &[ReceivedSpan], parent: &str, depth: usize, out: &mut String) {
        for span in trace.iter().filter(|s| s.parent_span_id == parent) {
            let attributes: Vec<String> = span
                .attributes
                .iter()
                .filter(|(k, _)| k.starts_with("idempotency.") || k.starts_with("http."))
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            out.push_str(&format!(
                "{}{} [{}] {}\n",
                "  ".repeat(depth),
                span.name,
                span.service,
                attributes.join(" ")
            ));
            lines(trace, &span.span_id, depth + 1, out);
        }
    }
    let ids: Vec<&str> = trace.iter().map(|s| s.span_id.as_str()).collect();
    let mut out = String::new();
    for root in trace
        .iter()
        .filter(|s| !ids.contains(&s.parent_span_id.as_str()))
    {
        out.push_str(&format!("(caller {})\n", root.parent_span_id));
        lines(trace, &root.parent_span_id, 1, &mut out);
    }
    out
}

/// The store calls of a trace, in the order they were received.
fn store_calls(trace: &[ReceivedSpan]) -> Vec<String> {
    trace
        .iter()
        .filter(|s| s.name == "idempotency.store")
        .filter_map(|s| {
            s.attribute("idempotency.store.operation")
                .map(str::to_owned)
        })
        .collect()
}

/// `idem serve` exporting to `endpoint`, with spans sent every 50 ms.
fn serve_exporting(db: &std::path::Path, psp: &str, endpoint: &str, extra: &[&str]) -> Spawned {
    Spawned::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["serve", "--listen", "127.0.0.1:0", "--lease-secs", "1"])
            .args(["--database", &format!("sqlite://{}", db.display())])
            .args(["--psp-url", psp, "--psp-timeout-secs", "60"])
            .args(extra)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            .env("OTEL_BSP_SCHEDULE_DELAY", "50")
            .env_remove("OTEL_SERVICE_NAME")
            .env_remove("OTEL_EXPORTER_OTLP_PROTOCOL"),
    )
}

fn payment(url: &str, key: Option<&str>, amount: u32) -> reqwest::RequestBuilder {
    let request = reqwest::Client::new()
        .post(format!("{url}/payments"))
        .bearer_auth(ALICE)
        .header("content-type", "application/json")
        .body(format!(r#"{{"amount": {amount}, "currency": "EUR"}}"#));
    keyed(request, key)
}

/// Over HTTP/protobuf from `idem serve`: a fresh payment, its replay, a mismatch, a missing
/// and a malformed key, and a payout of unknown outcome, each a span with its outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_exports_each_outcome_over_http_protobuf() {
    let (receiver, endpoint) = Receiver::http().await;
    let dir = tempfile::tempdir().unwrap();
    let (psp, psp_url) = start_psp().await;
    let served = serve_exporting(&dir.path().join("idem.db"), &psp_url, &endpoint, &[]);
    let url = &served.url;

    let key = "otel-payment-000001";
    let fresh = Trace::new();
    assert_eq!(
        send(fresh.on(payment(url, Some(key), 100))).await.status,
        201
    );
    let fresh_span = receiver.request_span(&fresh).await;
    assert_request_span(&fresh_span, &fresh, "fresh", "transaction");
    assert_eq!(
        fresh_span.0.service, "idem-serve",
        "the default service name"
    );
    let hash = fresh_span.0.attribute("idempotency.key_hash").unwrap();
    assert!(!hash.contains("otel"), "never the key itself");
    let stored = receiver
        .trace(&fresh, |spans| {
            store_calls(spans).contains(&"commit".to_owned())
        })
        .await;
    assert!(
        store_calls(&stored).contains(&"begin_claim".to_owned()),
        "{stored:#?}"
    );

    let replay = Trace::new();
    let replayed = send(replay.on(payment(url, Some(key), 100))).await;
    assert!(replayed.replayed());
    let replay_span = receiver.request_span(&replay).await;
    assert_request_span(&replay_span, &replay, "replayed", "transaction");
    eprintln!("the fresh payment:\n{}", describe(&stored));
    eprintln!("its replay:\n{}", describe(&replay_span.1));
    assert_eq!(
        replay_span.0.attribute("idempotency.key_hash"),
        Some(hash),
        "the same key, the same hash"
    );

    let refusals = [
        (Some(key), 999, 422, "mismatch"),
        (None, 100, 400, "missing_key"),
        (Some("bad key with spaces"), 100, 400, "malformed_key"),
    ];
    for (key, amount, status, outcome) in refusals {
        let caller = Trace::new();
        assert_eq!(
            send(caller.on(payment(url, key, amount))).await.status,
            status
        );
        let span = receiver.request_span(&caller).await;
        assert_request_span(&span, &caller, outcome, "transaction");
        if outcome != "mismatch" {
            assert_eq!(
                span.0.attribute("idempotency.key_hash"),
                None,
                "no key, no hash"
            );
        }
    }

    // A payout whose provider charged and hung up: its outcome is unknown until the
    // reconciler has asked the provider, which holds the question meanwhile.
    psp.set_faults(Faults {
        drop_next: 1,
        ..Faults::default()
    })
    .await;
    psp.hold_lookups();
    let key = "otel-payout-000001";
    let lost = Trace::new();
    assert_eq!(send(lost.on(payout(url, key))).await.status, 504);
    let lost_span = receiver.request_span(&lost).await;
    assert_request_span(&lost_span, &lost, "not_stored", "lease");
    tokio::time::timeout(Duration::from_secs(20), psp.lookups_arrived(1))
        .await
        .expect("the reconciler never asked the provider");
    let unknown = Trace::new();
    assert_eq!(send(unknown.on(payout(url, key))).await.status, 409);
    let unknown_span = receiver.request_span(&unknown).await;
    assert_request_span(&unknown_span, &unknown, "unknown_outcome", "lease");
    psp.release_lookups();
}

/// A duplicate of a payout still running is `in_use`, with a `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_exports_in_use_for_a_duplicate_of_running_work() {
    let (receiver, endpoint) = Receiver::http().await;
    let dir = tempfile::tempdir().unwrap();
    let (_psp, psp_url) = start_psp().await;
    let extra = ["--fault-pause", "before-provider"];
    let served = serve_exporting(&dir.path().join("idem.db"), &psp_url, &endpoint, &extra);
    let key = "otel-payout-running";
    let running = tokio::spawn(payout(&served.url, key).send());
    let paused =
        tokio::task::block_in_place(|| served.await_line("paused at", Duration::from_secs(20)));
    assert!(paused, "idem serve never paused before the provider");
    let caller = Trace::new();
    let duplicate = send(caller.on(payout(&served.url, key))).await;
    assert_eq!(duplicate.status, 409);
    assert!(duplicate.headers.contains_key("retry-after"));
    let span = receiver.request_span(&caller).await;
    assert_request_span(&span, &caller, "in_use", "lease");
    assert!(
        store_calls(&span.1).contains(&"claim".to_owned()),
        "{:#?}",
        span.1
    );
    running.abort();
}

/// An upstream whose first `POST /orders` waits for `release` (its arrival, with the
/// `traceparent` it carried, is sent on `arrived`); every other answers at once.
async fn held_upstream() -> (
    String,
    tokio::sync::mpsc::UnboundedReceiver<Option<String>>,
    Arc<Notify>,
) {
    let (arrivals, arrived) = tokio::sync::mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    let held = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let app = axum::Router::new().route(
        "/orders",
        axum::routing::post({
            let release = release.clone();
            move |headers: axum::http::HeaderMap| async move {
                if !held.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    let released = release.notified();
                    let traceparent = headers
                        .get("traceparent")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    let _ = arrivals.send(traceparent);
                    released.await;
                }
                (axum::http::StatusCode::CREATED, "order-1")
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, arrived, release)
}

fn order(url: &str, credential: Option<&str>) -> reqwest::RequestBuilder {
    let request = reqwest::Client::new()
        .post(format!("{url}/orders"))
        .header("idempotency-key", "otel-order-000001")
        .body("{}");
    match credential {
        Some(credential) => request.header("authorization", credential),
        None => request,
    }
}

/// Over gRPC from `idem proxy`, under the service name `OTEL_SERVICE_NAME` gives: a fresh
/// order, a duplicate that waited for it and then replayed its answer, and a request without
/// the credential the gateway scopes by.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_exports_waits_and_refusals_over_grpc() {
    let (receiver, endpoint) = Receiver::grpc().await;
    let dir = tempfile::tempdir().unwrap();
    let (upstream, mut arrived, release) = held_upstream().await;
    let proxy = Spawned::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", &upstream])
            .args(["--in-flight", "wait 20s"])
            .current_dir(dir.path())
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            .env("OTEL_SERVICE_NAME", "orders-gateway")
            .env("OTEL_BSP_SCHEDULE_DELAY", "50"),
    );
    let url = proxy.url.clone();

    let first = Trace::new();
    let original = tokio::spawn(first.on(order(&url, Some("Bearer t1"))).send());
    let traceparent = tokio::time::timeout(Duration::from_secs(20), arrived.recv())
        .await
        .expect("the order reaches the upstream")
        .unwrap()
        .expect("the upstream call carries a traceparent");
    let second = Trace::new();
    let duplicate = tokio::spawn(second.on(order(&url, Some("Bearer t1"))).send());
    // The duplicate has claimed and found the original running (its claim's span ended, and
    // is exported) before the original is let go: it is waiting.
    receiver
        .trace(&second, |spans| {
            store_calls(spans).contains(&"claim".to_owned())
        })
        .await;
    release.notify_one();
    assert_eq!(original.await.unwrap().unwrap().status(), 201);
    let duplicate = duplicate.await.unwrap().unwrap();
    assert_eq!(duplicate.status(), 201);
    assert!(duplicate.headers().contains_key("idempotent-replayed"));

    let fresh_span = receiver.request_span(&first).await;
    assert_request_span(&fresh_span, &first, "fresh", "lease");
    assert_eq!(fresh_span.0.service, "orders-gateway");
    // The upstream was called as a child of idem's server span, in the caller's trace.
    let server = fresh_span
        .1
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .unwrap();
    assert_eq!(
        traceparent,
        format!("00-{}-{}-01", first.trace_id, server.span_id)
    );
    let waited_span = receiver.request_span(&second).await;
    assert_request_span(&waited_span, &second, "waited", "lease");
    eprintln!("the duplicate that waited:\n{}", describe(&waited_span.1));
    assert_eq!(
        waited_span.0.attribute("idempotency.after_wait"),
        Some("replayed"),
        "{waited_span:#?}"
    );
    assert_eq!(
        waited_span.0.attribute("idempotency.key_hash"),
        fresh_span.0.attribute("idempotency.key_hash")
    );

    let anonymous = Trace::new();
    let refused = anonymous.on(order(&url, None)).send().await.unwrap();
    assert_eq!(refused.status(), 401);
    let refused_span = receiver.request_span(&anonymous).await;
    assert_request_span(&refused_span, &anonymous, "no_credential", "lease");
}

/// A protocol idem does not export with stops the service at start, naming the variable,
/// rather than running with traces silently lost.
#[test]
fn an_unknown_otlp_protocol_stops_the_service_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--listen", "127.0.0.1:0", "--database"])
        .arg(format!("sqlite://{}", dir.path().join("idem.db").display()))
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "OTEL_EXPORTER_OTLP_PROTOCOL=\"http/json\" is not a protocol idem exports with"
        ),
        "{stderr}"
    );
    assert!(output.stdout.is_empty(), "it never listened");
}

/// A store that stops answering: the request's span says `store_unavailable` (the `503` the
/// client gets), through `idem proxy` on Redis behind a relay that starts resetting every
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_exports_store_unavailable_when_redis_goes_away() {
    use idem_testkit::fault_relay::{Fault, FaultRelay};
    let (receiver, endpoint) = Receiver::http().await;
    let prefix = crate::common::RedisPrefix::new("otel-store-down");
    let relay = FaultRelay::start("127.0.0.1:6379".parse().unwrap(), 7)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (upstream, _arrivals, release) = held_upstream().await;
    release.notify_one();
    let proxy = Spawned::spawn(
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", &upstream])
            .args(["--store", &format!("redis://{}/0", relay.addr())])
            .args(["--redis-prefix", &prefix.0])
            .current_dir(dir.path())
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
            .env("OTEL_BSP_SCHEDULE_DELAY", "50")
            .env_remove("IDEM_PROXY_SECRET"),
    );
    // Up, with its store, before the store goes away.
    crate::common::assert_healthy(&reqwest::Client::new(), &proxy.url).await;
    relay.set(Fault::Reset);
    let caller = Trace::new();
    let refused = caller
        .on(order(&proxy.url, Some("Bearer t1")))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    let span = receiver.request_span(&caller).await;
    assert_request_span(&span, &caller, "store_unavailable", "lease");
}
