//! The request path of `IdempotencyLayer::transactional` over a real SqliteStore, around a
//! trivial handler. The input is a small text request, so seeds are readable:
//!
//! ```text
//! POST /payments?x=1
//! idempotency-key: "order-0001"
//! content-type: application/json
//!
//! {"amount": 1}
//! ```
//!
//! Each request is sent twice. The layer must never answer 5xx, its own refusals must be
//! problem details, and a response it stored must come back as a replay of the same bytes
//! (the handler numbers its answers, so running it twice would show).

#![no_main]

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use idem_core::{AccountId, Policy, Scope};
use idem_tower::{IDEMPOTENT_REPLAYED, IdempotencyLayer, ResponseBody};
use libfuzzer_sys::fuzz_target;
use tokio::runtime::Runtime;
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt};

type Service =
    BoxCloneService<Request<Full<Bytes>>, Response<ResponseBody<Full<Bytes>>>, Infallible>;

/// Marks a response the handler made, as opposed to one the layer made or replayed (it is not
/// on the stored-header allow-list, so replays never carry it).
const FROM_HANDLER: &str = "x-fuzz-handler";

struct Harness {
    runtime: Runtime,
    service: Service,
    policy: Policy,
    // Kept so the database outlives every call; scripts/fuzz.sh removes its TMPDIR afterwards.
    _dir: tempfile::TempDir,
}

thread_local! {
    // Built once: opening SQLite and running migrations per input would dominate the run.
    static HARNESS: Harness = Harness::new();
}

impl Harness {
    fn new() -> Self {
        let (runtime, store, dir) = idem_fuzz::sqlite_harness();
        // A small body limit so the fuzzer reaches 413 with inputs of a few KiB.
        let policy = Policy {
            body_limit: 2048,
            body_timeout: Duration::from_secs(2),
            in_flight_wait: Duration::from_secs(2),
            ..Policy::default()
        };
        let layer = IdempotencyLayer::transactional(store)
            .with_policy(policy.clone())
            .with_account(|parts| {
                // Vary the scope with the credential, as a service's authentication would.
                AccountId::new(
                    parts
                        .headers
                        .get(http::header::AUTHORIZATION)
                        .map_or("anonymous".into(), |v| {
                            String::from_utf8_lossy(v.as_bytes()).into_owned()
                        }),
                )
            });
        let covers = policy.clone();
        let handler = tower::service_fn(move |request: Request<Full<Bytes>>| {
            let covered = covers.covers(request.method().as_str());
            async move { Ok::<_, Infallible>(handle(covered, request)) }
        });
        Self {
            runtime,
            service: BoxCloneService::new(layer.layer(handler)),
            policy,
            _dir: dir,
        }
    }
}

/// The trivial handler: answers `x-status` (200–499, default 201) with a body that numbers the
/// call.
fn handle(covered: bool, request: Request<Full<Bytes>>) -> Response<Full<Bytes>> {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    if covered {
        assert!(
            request.extensions().get::<Scope>().is_some(),
            "a covered request reached the handler without a scope"
        );
    }
    let status = request
        .headers()
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse::<u16>().ok())
        .filter(|s| (200..500).contains(s))
        .unwrap_or(201);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    Response::builder()
        .status(status)
        .header(FROM_HANDLER, "1")
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(format!("{{\"call\":{call}}}"))))
        .expect("a valid response")
}

/// The request the input describes, or `None` where hyper would refuse it before any layer
/// runs (an invalid method or URI). Header lines it would refuse are left out.
struct Parsed {
    method: Method,
    uri: Uri,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
}

fn parse(input: &[u8]) -> Option<Parsed> {
    let mut rest = input;
    let mut line = || {
        let end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
        let (line, tail) = rest.split_at(end);
        rest = tail.get(1..).unwrap_or_default();
        line.strip_suffix(b"\r").unwrap_or(line)
    };
    let request_line = line();
    let mut words = request_line.splitn(2, |&b| b == b' ');
    let method = Method::from_bytes(words.next()?).ok()?;
    let uri = Uri::try_from(words.next().unwrap_or(&b"/payments"[..])).ok()?;
    let mut headers = Vec::new();
    loop {
        let header = line();
        if header.is_empty() {
            break;
        }
        // A line hyper would refuse is dropped rather than ending the input, so one bad
        // mutation does not waste the rest of it.
        let Some(colon) = header.iter().position(|&b| b == b':') else {
            continue;
        };
        let value = &header[colon + 1..];
        let value = value.strip_prefix(b" ").unwrap_or(value);
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&header[..colon]),
            HeaderValue::from_bytes(value),
        ) {
            headers.push((name, value));
        }
    }
    Some(Parsed {
        method,
        uri,
        headers,
        body: Bytes::copy_from_slice(rest),
    })
}

fn request(parsed: &Parsed) -> Request<Full<Bytes>> {
    let mut request = Request::new(Full::new(parsed.body.clone()));
    *request.method_mut() = parsed.method.clone();
    *request.uri_mut() = parsed.uri.clone();
    for (name, value) in &parsed.headers {
        request.headers_mut().append(name, value.clone());
    }
    request
}

struct Answer {
    status: StatusCode,
    from_handler: bool,
    replayed: bool,
    content_type: Option<HeaderValue>,
    body: Bytes,
}

async fn send(service: &Service, request: Request<Full<Bytes>>) -> Answer {
    let response = service.clone().oneshot(request).await.expect("Infallible");
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        from_handler: parts.headers.contains_key(FROM_HANDLER),
        replayed: parts
            .headers
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|v| v == "true"),
        content_type: parts.headers.get(http::header::CONTENT_TYPE).cloned(),
        body: body.collect().await.expect("a full body").to_bytes(),
    }
}

fuzz_target!(|input: &[u8]| {
    let Some(parsed) = parse(input) else { return };
    HARNESS.with(|h| {
        let (first, second) = h.runtime.block_on(async {
            let first = send(&h.service, request(&parsed)).await;
            let second = send(&h.service, request(&parsed)).await;
            (first, second)
        });
        for answer in [&first, &second] {
            assert!(
                !answer.status.is_server_error(),
                "{} from the layer: {:?}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            );
            if !answer.from_handler && !answer.replayed {
                assert_eq!(
                    answer.content_type.as_ref().map(HeaderValue::as_bytes),
                    Some(&b"application/problem+json"[..]),
                    "a refusal by the layer that is not problem details"
                );
                let problem: serde_json::Value =
                    serde_json::from_slice(&answer.body).expect("problem details are JSON");
                assert!(problem["type"].is_string());
            }
        }
        let covered = h.policy.covers(parsed.method.as_str());
        let stored =
            first.replayed || (first.from_handler && h.policy.stores_status(first.status.as_u16()));
        if covered && stored {
            assert!(second.replayed, "a stored outcome was not replayed");
            assert_eq!(second.status, first.status);
            assert_eq!(second.body, first.body, "the handler ran twice");
        }
    });
});
