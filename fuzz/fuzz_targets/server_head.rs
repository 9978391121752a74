//! Raw bytes on a connection of idem's server loop (`idem_gateway::server::connection`, the
//! loop of `idem serve` and `idem proxy`), in front of `IdempotencyLayer::transactional` over a
//! real SqliteStore and a trivial handler: hyper parses whatever head arrives, under idem's
//! head deadline, and the layer gets what hyper lets through.
//!
//! The input is written as the client's whole side of the connection, then the client stops
//! writing. The server must end the connection by itself within a few seconds (a head cut
//! short by the client's end, a pipelined second request, a body shorter than declared), and
//! everything it wrote must be HTTP/1.x responses, none a 5xx: idem never answers 500 to
//! malformed input, and nothing here can make the store unavailable. (The clock is real: a
//! paused one would also fire the SQLite pool's acquire timeout while a statement runs.)

#![no_main]

use std::convert::Infallible;
use std::time::Duration;

use axum::Router;
use bytes::Bytes;
use http::{Request, Response};
use idem_core::Policy;
use idem_tower::IdempotencyLayer;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;

/// The deadline for a request head, as `idem serve` has it.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the server may take to end a connection whose client has stopped writing.
const CLOSE_BOUND: Duration = Duration::from_secs(10);

struct Harness {
    runtime: Runtime,
    router: Router,
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
        let policy = Policy {
            body_limit: 2048,
            ..Policy::default()
        };
        let handler = tower::service_fn(|_request: Request<axum::body::Body>| async {
            Ok::<_, Infallible>(Response::new(axum::body::Body::from("{\"ok\":true}")))
        });
        let router = Router::new()
            .route_service("/payments", handler)
            .layer(IdempotencyLayer::transactional(store).with_policy(policy));
        Self {
            runtime,
            router,
            _dir: dir,
        }
    }
}

/// Every status line in `output`, in order; panics on bytes that do not start a response.
fn statuses(output: &[u8]) -> Vec<u16> {
    let mut statuses = Vec::new();
    let mut rest = output;
    while !rest.is_empty() {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut response = httparse::Response::new(&mut headers);
        let head_len = match response.parse(rest) {
            Ok(httparse::Status::Complete(len)) => len,
            other => panic!("not an HTTP/1.1 response: {other:?} in {output:?}"),
        };
        // An HTTP/1.0 request is answered in HTTP/1.0.
        assert!(matches!(response.version, Some(0 | 1)), "HTTP/1.x only");
        let status = response.code.expect("a status");
        let length = response
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .map(|h| {
                std::str::from_utf8(h.value)
                    .unwrap()
                    .parse::<usize>()
                    .unwrap()
            });
        let chunked = response.headers.iter().any(|h| {
            h.name.eq_ignore_ascii_case("transfer-encoding")
                && h.value.eq_ignore_ascii_case(b"chunked")
        });
        statuses.push(status);
        rest = &rest[head_len..];
        match (length, chunked) {
            // The answer to a HEAD carries the length of a body it does not send: skip the
            // body only when a response (or nothing) follows it.
            (Some(length), _) => {
                let after = &rest[length.min(rest.len())..];
                if after.is_empty() || after.starts_with(b"HTTP/") || !rest.starts_with(b"HTTP/") {
                    rest = after;
                }
            }
            // A chunked body ends the parse here: enough to have checked its head.
            (None, true) => break,
            (None, false) => {}
        }
    }
    statuses
}

fuzz_target!(|input: &[u8]| {
    if input.len() > 16 * 1024 {
        return;
    }
    HARNESS.with(|harness| {
        let output = harness.runtime.block_on(async {
            let (mut client, server) = tokio::io::duplex(64 * 1024);
            let connection =
                idem_gateway::server::connection(server, harness.router.clone(), HEAD_TIMEOUT);
            let served = tokio::spawn(connection);
            client.write_all(input).await.expect("the server reads");
            client.shutdown().await.expect("half-close");
            let mut output = Vec::new();
            tokio::time::timeout(CLOSE_BOUND, client.read_to_end(&mut output))
                .await
                .expect("the server ended the connection")
                .expect("a readable connection");
            let _ = served.await;
            Bytes::from(output)
        });
        for status in statuses(&output) {
            assert!(
                status < 500,
                "a {status} for malformed input: {:?}",
                String::from_utf8_lossy(&output)
            );
        }
    });
});
