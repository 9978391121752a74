//! The fault injector: a real HTTP proxy on loopback between the simulated client and the
//! API under test (the in-process `idem serve`, or `--url`), which loses answers on the wire
//! after the API has committed.
//!
//! Every request is forwarded whole to the API's origin (over TLS for `https://`, with the
//! API's own `Host`), and the API's response is read to its last byte before anything is
//! decided, so the API has finished (and committed) the work. Then, with probability `loss`,
//! the proxy closes the client's connection without writing a byte of the answer: the client
//! sees a connection closed before the message completed, exactly what a lost ACK looks like
//! from the caller's side. Otherwise the answer is relayed.
//!
//! The proxy is also where charges can be counted without the API's database: it sees every
//! answer, the lost ones too, and records the resource id of each `2xx` per intent. A client
//! never sees the answers that were lost, so it could not.
//!
//! Which attempts are lost is a pure function of the seed, the intent (the
//! [`INTENT_HEADER`] the simulator puts on every attempt, and which the proxy removes before
//! forwarding: the API gets the request a real client would send) and the attempt's number
//! for that intent, which the proxy counts as attempts arrive. One intent's attempts are
//! sequential (the client sends the next only after the previous failed), so the numbering,
//! and with it the whole fault schedule, is the same however the intents interleave.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderName};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use reqwest::Url;
use sha2::{Digest, Sha256};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};

use crate::drill::body::id_in;

/// The header that names the intent an attempt belongs to (its index in the run).
pub(crate) const INTENT_HEADER: HeaderName = HeaderName::from_static("x-idem-sim-intent");

/// Whether attempt `attempt` (1 for the first) of intent `intent` loses its answer when
/// answers are lost with probability `loss`.
///
/// The draw is the first 53 bits of SHA-256 over a domain tag, the seed, the intent and the
/// attempt, read as a number in `[0, 1)`. The loss rate is not hashed in: the same seed gives
/// every rate the same draws (an attempt lost at 5 % is also lost at 10 %), and the runs
/// without and with keys at one rate meet exactly the same faults, so their figures compare
/// one to one.
pub(crate) fn is_lost(seed: u64, intent: u64, attempt: u32, loss: f64) -> bool {
    let mut hash = Sha256::new();
    hash.update(b"idem simulate ack loss");
    hash.update(seed.to_be_bytes());
    hash.update(intent.to_be_bytes());
    hash.update(attempt.to_be_bytes());
    let digest = hash.finalize();
    let bits = u64::from_be_bytes(digest[..8].try_into().expect("SHA-256 has 32 bytes"));
    let unit = (bits >> 11) as f64 / (1u64 << 53) as f64;
    unit < loss
}

/// Where the proxy forwards to and how it reads the answers.
#[derive(Debug, Clone)]
pub(crate) struct Upstream {
    /// The API's origin, `http://host:port` or `https://host:port`; each request's path and
    /// query are kept.
    pub(crate) origin: Url,
    /// The client that calls it (its TLS roots, no redirects followed).
    pub(crate) client: reqwest::Client,
    /// Where a `2xx` answer's resource id is (see [`id_in`]).
    pub(crate) id_field: String,
}

/// What the proxy saw during one run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ProxyCounts {
    /// Requests the API answered (every attempt that reached it).
    pub(crate) forwarded: u64,
    /// Of those, answers the API marked `Idempotent-Replayed: true`: a duplicate it
    /// recognised and answered from the stored response, without charging again.
    pub(crate) replayed: u64,
    /// Answers lost on purpose: the API had answered, the client's connection was closed.
    pub(crate) cut: u64,
    /// `2xx` answers in which no resource id was found.
    pub(crate) without_id: u64,
    /// Requests the API could not be reached for (answered `502` to the client).
    pub(crate) upstream_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    forwarded: AtomicU64,
    replayed: AtomicU64,
    cut: AtomicU64,
    without_id: AtomicU64,
    upstream_errors: AtomicU64,
}

/// One intent as the proxy saw it.
#[derive(Debug, Default)]
struct IntentLog {
    /// Attempts so far.
    attempts: u32,
    /// The distinct resource ids its `2xx` answers carried, in the order first seen.
    ids: Vec<String>,
}

#[derive(Debug)]
struct Shared {
    upstream: Upstream,
    seed: u64,
    loss: f64,
    /// Per intent. A std Mutex, not a Tokio one: it is held for one map update and never
    /// across an await.
    intents: Mutex<HashMap<u64, IntentLog>>,
    counters: Counters,
    /// Why the first request the API could not be reached for failed, to say so at the end.
    first_upstream_error: Mutex<Option<String>>,
}

impl Shared {
    fn next_attempt(&self, intent: u64) -> u32 {
        let mut intents = self.intents.lock().unwrap_or_else(PoisonError::into_inner);
        let log = intents.entry(intent).or_default();
        log.attempts += 1;
        log.attempts
    }

    fn record_id(&self, intent: u64, id: String) {
        let mut intents = self.intents.lock().unwrap_or_else(PoisonError::into_inner);
        let ids = &mut intents.entry(intent).or_default().ids;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }

    fn upstream_failed(&self, error: &reqwest::Error) {
        let reason = error_chain(error);
        tracing::warn!(error = %reason, "the fault injector cannot reach the API");
        self.counters
            .upstream_errors
            .fetch_add(1, Ordering::Relaxed);
        self.first_upstream_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(reason);
    }
}

/// `error: cause: cause`, as `{:#}` prints an anyhow chain: reqwest's own message names only
/// the URL, the reason (a refused certificate, say) is in its sources.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// A running fault injector; it stops (and drops every connection it holds) when dropped.
#[derive(Debug)]
pub(crate) struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:0` and forwards to `upstream`, losing answers with probability
    /// `loss` by the fault schedule of `seed`.
    pub(crate) async fn start(upstream: Upstream, seed: u64, loss: f64) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            seed,
            loss,
            intents: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            first_upstream_error: Mutex::new(None),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Self {
            addr,
            shared,
            accept,
        })
    }

    /// The address clients send to.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the proxy has seen so far.
    pub(crate) fn counts(&self) -> ProxyCounts {
        let c = &self.shared.counters;
        ProxyCounts {
            forwarded: c.forwarded.load(Ordering::Relaxed),
            replayed: c.replayed.load(Ordering::Relaxed),
            cut: c.cut.load(Ordering::Relaxed),
            without_id: c.without_id.load(Ordering::Relaxed),
            upstream_errors: c.upstream_errors.load(Ordering::Relaxed),
        }
    }

    /// The distinct resource ids each intent's `2xx` answers carried, lost answers included;
    /// an intent without any is absent.
    pub(crate) fn ids_per_intent(&self) -> HashMap<u64, Vec<String>> {
        let intents = self
            .shared
            .intents
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        intents
            .iter()
            .filter(|(_, log)| !log.ids.is_empty())
            .map(|(intent, log)| (*intent, log.ids.clone()))
            .collect()
    }

    /// Why the first unreachable request failed, if one did.
    pub(crate) fn first_upstream_error(&self) -> Option<String> {
        self.shared
            .first_upstream_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // The accept task owns the connection tasks (a JoinSet), so they go with it.
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                while connections.try_join_next().is_some() {}
                connections.spawn(serve_connection(stream, shared.clone()));
            }
            Err(e) => {
                // Out of file descriptors, typically: pause rather than spin on the error.
                tracing::warn!(error = %e, "the fault injector cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let cut = Arc::new(Notify::new());
    let service = {
        let cut = cut.clone();
        service_fn(move |request| relay(request, shared.clone(), cut.clone()))
    };
    let connection = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        // Dropping the connection closes the socket with the API's answer unsent: the
        // client reads end-of-stream where the response should be.
        () = cut.notified() => {}
        result = connection => {
            if let Err(e) = result {
                tracing::debug!(error = %e, "a client connection to the fault injector failed");
            }
        }
    }
}

async fn relay(
    request: Request<Incoming>,
    shared: Arc<Shared>,
    cut: Arc<Notify>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let intent = request
        .headers()
        .get(INTENT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let attempt = intent.map(|intent| (intent, shared.next_attempt(intent)));

    let (mut parts, body) = request.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        // The client went away mid-request; nothing reached the API.
        return Ok(plain(StatusCode::BAD_REQUEST, "incomplete request body"));
    };
    let mut url = shared.upstream.origin.clone();
    url.set_path(parts.uri.path());
    url.set_query(parts.uri.query());
    strip_hop_by_hop(&mut parts.headers);
    // The client addressed the proxy; the API is addressed by its own name (reqwest sets
    // Host from the URL, and TLS verifies that same name).
    parts.headers.remove(header::HOST);
    parts.headers.remove(INTENT_HEADER);

    let sent = shared
        .upstream
        .client
        .request(parts.method, url)
        .headers(parts.headers)
        .body(body)
        .send()
        .await;
    let answered = match sent {
        Ok(response) => {
            let (status, headers) = (response.status(), response.headers().clone());
            response.bytes().await.map(|body| (status, headers, body))
        }
        Err(e) => Err(e),
    };
    let (status, mut headers, body) = match answered {
        Ok(answer) => answer,
        Err(e) => {
            shared.upstream_failed(&e);
            return Ok(plain(StatusCode::BAD_GATEWAY, "the API did not answer"));
        }
    };

    // The whole answer is here, so the API has committed whatever it did.
    count_answer(&shared, intent, status, &headers, &body);
    let counters = &shared.counters;
    if let Some((intent, attempt)) = attempt
        && is_lost(shared.seed, intent, attempt, shared.loss)
    {
        counters.cut.fetch_add(1, Ordering::Relaxed);
        cut.notify_one();
        // Never answer: the connection task drops this future along with the socket.
        return std::future::pending().await;
    }
    strip_hop_by_hop(&mut headers);
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    Ok(response)
}

/// Counts an answer from the API: forwarded, replayed or not, and the resource id of a 2xx
/// (recorded for its intent), or that a 2xx carried none.
fn count_answer(
    shared: &Shared,
    intent: Option<u64>,
    status: StatusCode,
    headers: &http::HeaderMap,
    body: &Bytes,
) {
    let counters = &shared.counters;
    counters.forwarded.fetch_add(1, Ordering::Relaxed);
    if headers
        .get("idempotent-replayed")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
    {
        counters.replayed.fetch_add(1, Ordering::Relaxed);
    }
    if status.is_success() {
        match id_in(body, &shared.upstream.id_field) {
            Some(id) => {
                if let Some(intent) = intent {
                    shared.record_id(intent, id);
                }
            }
            None => {
                counters.without_id.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Removes the headers that describe one connection, not the message (RFC 9110 §7.6.1): each
/// side of the proxy frames its own.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::TE,
        header::TRAILER,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_is_a_function_of_its_inputs() {
        for intent in 0..100 {
            for attempt in 1..5 {
                assert_eq!(
                    is_lost(42, intent, attempt, 0.3),
                    is_lost(42, intent, attempt, 0.3)
                );
            }
        }
        let at = |seed| {
            (0..200)
                .map(|i| is_lost(seed, i, 1, 0.5))
                .collect::<Vec<_>>()
        };
        assert_ne!(at(42), at(43), "another seed, another schedule");
    }

    #[test]
    fn losses_come_at_the_asked_rate() {
        let n = 100_000;
        for loss in [0.01, 0.05, 0.10, 0.5] {
            let lost = (0..n).filter(|i| is_lost(42, *i, 1, loss)).count() as f64;
            let expected = n as f64 * loss;
            // Five standard deviations of a binomial count.
            let tolerance = 5.0 * (n as f64 * loss * (1.0 - loss)).sqrt();
            assert!((lost - expected).abs() < tolerance, "{loss}: {lost}");
        }
        assert!((0..n).all(|i| !is_lost(42, i, 1, 0.0)));
        assert!((0..n).all(|i| is_lost(42, i, 1, 1.0)));
    }

    #[test]
    fn a_higher_rate_loses_a_superset() {
        for i in 0..10_000 {
            if is_lost(42, i, 1, 0.05) {
                assert!(is_lost(42, i, 1, 0.10));
            }
        }
    }
}
