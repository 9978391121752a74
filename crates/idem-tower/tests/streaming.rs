//! Responses over the storage cap stream through the layer (docs/contract.md §2.5), in both
//! modes, on SQLite and on a throwaway PostgreSQL database through each of its two stores.
//!
//! The handler's body is fed by a bounded channel whose producer never runs more than
//! [`AHEAD`] bytes past what the client has read. A layer that held the body whole before
//! answering would wait for an end the producer cannot reach: the test then fails on its
//! timeout instead of hanging.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body::Frame;
use http_body_util::StreamBody;
use idem_core::{AccountId, IdempotencyKey, KeyLimits, Record, RecordState, Scope, StoredResponse};
use idem_store::{Store, TransactionalStore};
use idem_tower::{IdempotencyLayer, Mode};
use tokio::sync::{mpsc, watch};

/// `Policy::storage_cap`'s default.
const CAP: usize = 1 << 20;
/// The producer's chunk.
const CHUNK: usize = 64 << 10;
/// How far the producer may run ahead of the client: past what the layer reads before it
/// answers (the cap and one chunk), with room for what sockets hold, and far short of
/// [`LARGE`].
const AHEAD: usize = 2 << 20;
/// The large response: eight times the cap.
const LARGE: usize = 8 << 20;
/// Ample for 8 MiB over loopback in a debug build; a layer that buffers never gets there.
const DEADLINE: Duration = Duration::from_secs(60);

/// The `n`th byte of every body the handler produces, so the client can check each one.
fn byte_at(n: usize) -> u8 {
    (n % 251) as u8
}

fn expected(len: usize) -> Vec<u8> {
    (0..len).map(byte_at).collect()
}

/// What the handler does, read from its JSON body: `len` bytes, failing at `fail_at` if set.
#[derive(serde::Deserialize)]
struct Script {
    len: usize,
    #[serde(default)]
    fail_at: Option<usize>,
}

#[derive(Clone)]
struct Handler {
    /// How many bytes the client has read of the current answer.
    read: watch::Receiver<usize>,
    calls: Arc<AtomicUsize>,
}

type Chunk = Result<Bytes, std::io::Error>;

async fn handler(State(h): State<Handler>, body: Bytes) -> Response {
    let script: Script = serde_json::from_slice(&body).expect("a script");
    h.calls.fetch_add(1, Ordering::SeqCst);
    let (tx, rx) = mpsc::channel::<Chunk>(1);
    tokio::spawn(produce(script, h.read.clone(), tx));
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((chunk.map(Frame::data), rx))
    });
    (
        StatusCode::CREATED,
        [
            ("content-type", "application/octet-stream"),
            ("x-trace", "not-stored"),
        ],
        Body::new(StreamBody::new(frames)),
    )
        .into_response()
}

/// Sends the script's bytes in chunks, never more than [`AHEAD`] past what the client read.
async fn produce(script: Script, mut read: watch::Receiver<usize>, tx: mpsc::Sender<Chunk>) {
    let mut sent = 0;
    while sent < script.len {
        if script.fail_at.is_some_and(|at| sent >= at) {
            let _ = tx.send(Err(std::io::Error::other("the body failed"))).await;
            return;
        }
        if read.wait_for(|&read| sent < read + AHEAD).await.is_err() {
            return;
        }
        let n = CHUNK.min(script.len - sent);
        if tx
            .send(Ok((sent..sent + n).map(byte_at).collect()))
            .await
            .is_err()
        {
            return;
        }
        sent += n;
    }
}

struct App<St> {
    url: String,
    store: St,
    read: watch::Sender<usize>,
    calls: Arc<AtomicUsize>,
    client: reqwest::Client,
}

/// An answer as the client read it, chunk by chunk.
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Vec<u8>,
    /// Why the body ended early, if it did.
    cut: Option<String>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

const KEY: &str = "stream-key-0001";
/// The account every request of these tests acts for.
const ACCOUNT: &str = "acct_stream";

impl<St: Store> App<St> {
    async fn start<M: Mode>(store: St, layer: IdempotencyLayer<M>) -> Self {
        let (read, reader) = watch::channel(0);
        let calls = Arc::new(AtomicUsize::new(0));
        let router = Router::new()
            .route("/work", axum::routing::post(handler))
            // One caller per app: every request acts for the same account.
            .layer(layer.with_account(|_| Ok(AccountId::new(ACCOUNT))))
            .with_state(Handler {
                read: reader,
                calls: calls.clone(),
            });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/work", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await });
        Self {
            url,
            store,
            read,
            calls,
            client: reqwest::Client::new(),
        }
    }

    /// POSTs `script` under [`KEY`] and reads the answer chunk by chunk, telling the handler's
    /// producer after each chunk how far it got.
    async fn send(&self, script: &str) -> Answer {
        self.read.send_replace(0);
        let mut response = self
            .client
            .post(&self.url)
            .header("idempotency-key", KEY)
            .header("content-type", "application/json")
            .body(script.to_owned())
            .send()
            .await
            .unwrap();
        let (status, headers) = (response.status().as_u16(), response.headers().clone());
        let mut body = Vec::new();
        let cut = loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    body.extend_from_slice(&chunk);
                    self.read.send_replace(body.len());
                }
                Ok(None) => break None,
                Err(e) => break Some(format!("{e:?}")),
            }
        };
        Answer {
            status,
            headers,
            body,
            cut,
        }
    }

    /// [`App::send`] for a body of `len` bytes, within [`DEADLINE`].
    async fn send_len(&self, len: usize) -> Answer {
        self.within(self.send(&format!(r#"{{"len": {len}}}"#)))
            .await
    }

    /// [`App::send`] for a body of `len` bytes that fails after `fail_at`, within [`DEADLINE`].
    async fn send_failing(&self, len: usize, fail_at: usize) -> Answer {
        let script = format!(r#"{{"len": {len}, "fail_at": {fail_at}}}"#);
        self.within(self.send(&script)).await
    }

    async fn within<T>(&self, work: impl Future<Output = T>) -> T {
        tokio::time::timeout(DEADLINE, work)
            .await
            .expect("the answer streams: a layer that holds it whole until its end never ends")
    }

    async fn record(&self) -> Option<Record> {
        let scope = Scope::new(
            AccountId::new(ACCOUNT),
            IdempotencyKey::parse(KEY.as_bytes(), KeyLimits::default()).unwrap(),
        );
        let now = idem_core::Clock::now(&idem_core::SystemClock);
        self.store.get(&scope, now).await.unwrap()
    }

    async fn stored(&self) -> StoredResponse {
        match self.record().await.map(|r| r.state) {
            Some(RecordState::Completed(stored)) => stored,
            other => panic!("no completed record: {other:?}"),
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// A body of `len` bytes, over the cap: the client gets every byte as the handler made
    /// it, the record keeps the head only, and a replay says the body was omitted.
    async fn streams_and_replays_omitted(&self, len: usize) {
        let first = self.send_len(len).await;
        assert_eq!((first.status, first.cut.as_deref()), (201, None));
        assert_eq!(first.body.len(), len);
        assert!(
            first.body == expected(len),
            "the bytes arrive as they were made"
        );
        assert_eq!(first.header("x-trace"), Some("not-stored"));

        let stored = self.stored().await;
        assert_eq!((stored.status, stored.body_omitted), (201, true));
        assert!(stored.body.is_empty());
        let names: Vec<&str> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type"]);

        let replay = self.send_len(len).await;
        assert_eq!(replay.status, 201);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.header("idempotent-replay"), Some("omitted"));
        assert_eq!(
            replay.header("content-type"),
            Some("application/octet-stream")
        );
        assert_eq!(replay.header("x-trace"), None);
        assert!(replay.body.is_empty());
        assert_eq!(self.calls(), 1);
    }

    /// A body that fails past the cap, after the head was stored: the client's body is cut
    /// short, and the record stays as stored.
    async fn fails_past_the_cap(&self) {
        let first = self.send_failing(LARGE, 2 * CAP).await;
        assert_eq!(first.status, 201);
        assert!(first.cut.is_some(), "the client sees the body cut off");
        assert!(first.body.len() < LARGE);
        assert!(first.body == expected(first.body.len()));
        assert!(self.stored().await.body_omitted);
        let replay = self.send_failing(LARGE, 2 * CAP).await;
        assert_eq!(replay.header("idempotent-replay"), Some("omitted"));
        assert!(replay.body.is_empty());
        assert_eq!(self.calls(), 1);
    }
}

async fn transaction<St: TransactionalStore>(store: St) -> App<St> {
    App::start(store.clone(), IdempotencyLayer::transactional(store)).await
}

async fn lease<St: Store>(store: St) -> App<St> {
    App::start(store.clone(), IdempotencyLayer::leased(store)).await
}

async fn transaction_mode_streams_a_response_over_the_cap<St: TransactionalStore>(store: St) {
    transaction(store)
        .await
        .streams_and_replays_omitted(LARGE)
        .await;
}

async fn lease_mode_streams_a_response_over_the_cap<St: Store>(store: St) {
    lease(store).await.streams_and_replays_omitted(LARGE).await;
}

async fn transaction_mode_omits_a_body_one_byte_over_the_cap<St: TransactionalStore>(store: St) {
    transaction(store)
        .await
        .streams_and_replays_omitted(CAP + 1)
        .await;
}

async fn lease_mode_omits_a_body_one_byte_over_the_cap<St: Store>(store: St) {
    lease(store)
        .await
        .streams_and_replays_omitted(CAP + 1)
        .await;
}

/// A body of exactly the cap is stored whole and replayed byte for byte.
async fn stores_a_body_at_the_cap_whole<St: Store>(app: App<St>) {
    let first = app.send_len(CAP).await;
    assert_eq!((first.status, first.body.len()), (201, CAP));
    assert!(first.body == expected(CAP));
    let stored = app.stored().await;
    assert!(!stored.body_omitted);
    assert!(stored.body == expected(CAP));
    let replay = app.send_len(CAP).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("idempotent-replay"), None);
    assert!(replay.body == expected(CAP));
    assert_eq!(app.calls(), 1);
}

async fn transaction_mode_stores_a_body_at_the_cap_whole<St: TransactionalStore>(store: St) {
    stores_a_body_at_the_cap_whole(transaction(store).await).await;
}

async fn lease_mode_stores_a_body_at_the_cap_whole<St: Store>(store: St) {
    stores_a_body_at_the_cap_whole(lease(store).await).await;
}

async fn transaction_mode_keeps_the_commit_when_the_body_fails_past_the_cap<
    St: TransactionalStore,
>(
    store: St,
) {
    transaction(store).await.fails_past_the_cap().await;
}

async fn lease_mode_keeps_the_outcome_when_the_body_fails_past_the_cap<St: Store>(store: St) {
    lease(store).await.fails_past_the_cap().await;
}

/// Within the cap nothing was committed yet: a body that fails there rolls everything back
/// (`503`), and the retry runs afresh.
async fn transaction_mode_rolls_back_when_the_body_fails_within_the_cap<St: TransactionalStore>(
    store: St,
) {
    let app = transaction(store).await;
    let failed = app.send_failing(CAP, CHUNK).await;
    assert_eq!(failed.status, 503);
    assert!(app.record().await.is_none(), "nothing committed");
    assert_eq!(app.send_len(CAP).await.status, 201);
    assert_eq!(app.calls(), 2);
}

/// In lease mode the work ran: a body that fails within the cap leaves its outcome unknown.
async fn lease_mode_leaves_the_outcome_unknown_when_the_body_fails_within_the_cap<St: Store>(
    store: St,
) {
    let app = lease(store).await;
    let failed = app.send_failing(CAP, CHUNK).await;
    assert_eq!(failed.status, 409);
    assert!(matches!(
        app.record().await.map(|r| r.state),
        Some(RecordState::InProgress { .. })
    ));
}

async fn sqlite_store() -> (idem_store::SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = idem_store::SqliteStore::open(dir.path().join("stream.db"))
        .await
        .unwrap();
    (store, dir)
}

async fn postgres_store() -> (idem_store::PgStore, idem_testkit::postgres::PgTestDatabase) {
    let db = idem_testkit::postgres::PgTestDatabase::create().await;
    let store = idem_store::PgStore::connect(db.url()).await.unwrap();
    (store, db)
}

async fn tokio_postgres_store() -> (
    idem_store::TokioPgStore,
    idem_testkit::postgres::PgTestDatabase,
) {
    let db = idem_testkit::postgres::PgTestDatabase::create().await;
    let store = idem_store::TokioPgStore::connect(db.url()).await.unwrap();
    (store, db)
}

macro_rules! on_sqlite_and_postgres {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            idem_store::tests_per_store!(super::sqlite_store() => [super]; $($name),*);
        }
        mod postgres {
            idem_store::tests_per_store!(super::postgres_store() => [super]; $($name),*);
        }
        mod tokio_postgres {
            idem_store::tests_per_store!(super::tokio_postgres_store() => [super]; $($name),*);
        }
    };
}

on_sqlite_and_postgres!(
    transaction_mode_streams_a_response_over_the_cap,
    lease_mode_streams_a_response_over_the_cap,
    transaction_mode_omits_a_body_one_byte_over_the_cap,
    lease_mode_omits_a_body_one_byte_over_the_cap,
    transaction_mode_stores_a_body_at_the_cap_whole,
    lease_mode_stores_a_body_at_the_cap_whole,
    transaction_mode_keeps_the_commit_when_the_body_fails_past_the_cap,
    lease_mode_keeps_the_outcome_when_the_body_fails_past_the_cap,
    transaction_mode_rolls_back_when_the_body_fails_within_the_cap,
    lease_mode_leaves_the_outcome_unknown_when_the_body_fails_within_the_cap,
);
