//! Large upstream answers stream through the gateway (docs/contract.md §9): on a covered route
//! past the storage cap, for uncovered methods, and on a `key = "off"` route.
//!
//! The upstream's body is fed by a bounded channel whose producer never runs more than
//! [`AHEAD`] bytes past what the client has read, so a gateway that collected the answer before
//! passing it on would wait forever: the test fails on its timeout instead.

mod common;

use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::StreamBody;
use idem_gateway::ConfigFile;
use idem_store::Store;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

/// The gateway's storage cap (the default).
const CAP: usize = 1 << 20;
const CHUNK: usize = 64 << 10;
/// Past the cap and a chunk (what the gateway reads before it answers), with room for what
/// sockets and the gateway's two connections hold; far short of [`LARGE`].
const AHEAD: usize = 3 << 20;
/// Sixteen times the cap.
const LARGE: usize = 16 << 20;
const _: () = assert!(LARGE > CAP + AHEAD);
const DEADLINE: Duration = Duration::from_secs(60);

fn byte_at(n: usize) -> u8 {
    (n % 251) as u8
}

type Chunk = Result<Bytes, std::io::Error>;

/// Answers every request with [`LARGE`] bytes, made only as fast as the client reads them
/// (`read`, how far the client got).
async fn upstream(State(read): State<watch::Receiver<usize>>) -> Response {
    let (tx, rx) = mpsc::channel::<Chunk>(1);
    tokio::spawn(async move {
        let mut read = read;
        let mut sent = 0;
        while sent < LARGE {
            if read.wait_for(|&read| sent < read + AHEAD).await.is_err() {
                return;
            }
            if tx
                .send(Ok((sent..sent + CHUNK).map(byte_at).collect()))
                .await
                .is_err()
            {
                return;
            }
            sent += CHUNK;
        }
    });
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((chunk.map(hyper::body::Frame::data), rx))
    });
    (
        StatusCode::OK,
        [("content-type", "application/octet-stream")],
        Body::new(StreamBody::new(frames)),
    )
        .into_response()
}

struct Gateway {
    url: String,
    read: watch::Sender<usize>,
    client: reqwest::Client,
}

/// An answer as the client read it, chunk by chunk.
struct Answer {
    status: u16,
    headers: HeaderMap,
    len: usize,
}

/// The gateway over `store` in front of the streaming upstream, with `POST /search` as a
/// `key = "off"` route.
async fn start<St: Store>(store: St) -> Gateway {
    let (read, reader) = watch::channel(0);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = listener.local_addr().unwrap();
    let app = Router::new().fallback(upstream).with_state(reader);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let file = ConfigFile::parse("[[route]]\nmatch = \"POST /search\"\nkey = \"off\"\n").unwrap();
    let mut config = common::config(upstream_addr);
    config.apply_file(&file);
    Gateway {
        url: common::serve(store, config).await,
        read,
        client: reqwest::Client::new(),
    }
}

impl Gateway {
    /// Sends `request` to `path` and reads the answer chunk by chunk, checking every byte and
    /// telling the upstream after each chunk how far it got, within [`DEADLINE`].
    async fn read(&self, method: reqwest::Method, path: &str, key: Option<&str>) -> Answer {
        let mut request = self
            .client
            .request(method, format!("{}{path}", self.url))
            .header("authorization", "Bearer sk_alice");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        self.read.send_replace(0);
        let work = async {
            let mut response = request.send().await.unwrap();
            let (status, headers) = (response.status().as_u16(), response.headers().clone());
            let mut len = 0;
            while let Some(chunk) = response.chunk().await.unwrap() {
                let expected: Vec<u8> = (len..len + chunk.len()).map(byte_at).collect();
                assert!(
                    chunk == expected,
                    "the bytes at {len} arrive as they were made"
                );
                len += chunk.len();
                self.read.send_replace(len);
            }
            Answer {
                status,
                headers,
                len,
            }
        };
        tokio::time::timeout(DEADLINE, work)
            .await
            .expect("the answer streams: a gateway that collects it first never ends")
    }
}

/// A covered POST whose answer is over the cap: the client gets all of it as it comes, and
/// the retry gets the stored head with the body omitted.
async fn a_covered_answer_over_the_cap_streams_and_replays_omitted<St: Store>(store: St) {
    let gateway = start(store).await;
    let first = gateway
        .read(reqwest::Method::POST, "/large", Some("large-key-0001"))
        .await;
    assert_eq!((first.status, first.len), (200, LARGE));
    let replay = gateway
        .read(reqwest::Method::POST, "/large", Some("large-key-0001"))
        .await;
    assert_eq!((replay.status, replay.len), (200, 0));
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.headers["idempotent-replay"], "omitted");
    assert_eq!(replay.headers["content-type"], "application/octet-stream");
}

/// A GET, which the policy does not cover, streams through untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_uncovered_answer_streams() {
    let (store, _dir) = common::sqlite_store().await;
    let gateway = start(store).await;
    let answer = gateway.read(reqwest::Method::GET, "/large", None).await;
    assert_eq!((answer.status, answer.len), (200, LARGE));
    assert!(!answer.headers.contains_key("idempotent-replayed"));
}

/// A `key = "off"` route goes straight to the upstream: its answer streams, key or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_off_route_answer_streams() {
    let (store, _dir) = common::sqlite_store().await;
    let gateway = start(store).await;
    for _ in 0..2 {
        let answer = gateway
            .read(reqwest::Method::POST, "/search", Some("search-key-0001"))
            .await;
        assert_eq!((answer.status, answer.len), (200, LARGE));
        assert!(!answer.headers.contains_key("idempotent-replayed"));
    }
}

on_every_store!(a_covered_answer_over_the_cap_streams_and_replays_omitted);
