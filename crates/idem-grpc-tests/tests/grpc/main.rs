//! idem's gRPC contract (docs/contract.md §14), end to end over real HTTP/2 on loopback: the
//! layer on a tonic server with a tonic client ([`layer`]), Python's grpcio with its own retry
//! policy ([`python`]), and `idem proxy` in front of a gRPC upstream ([`gateway`]).

mod gateway;
mod layer;
mod python;

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use idem_core::{AccountId, GrpcCode};
use idem_grpc_tests::pb::payments_client::PaymentsClient;
use idem_grpc_tests::pb::{CreatePaymentRequest, Payment};
use idem_grpc_tests::{Effects, Payments, PaymentsServer};
use idem_store::SqliteStore;
use idem_tower::{IdempotencyLayer, LeaseMode, TransactionMode};
use tonic::metadata::MetadataMap;
use tonic::service::InterceptorLayer;
use tonic::transport::Channel;
use tonic::{Code, Status};

/// The account the test clients act for, as `authorization: Bearer <account>`.
const ACCOUNT: &str = "acct_alice";

/// The app's authentication, a tonic interceptor: the bearer token names the account. A call
/// without one gets no account (the layer then refuses it).
fn authenticate(mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
    let account = request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(AccountId::new);
    if let Some(account) = account {
        request.extensions_mut().insert(account);
    }
    Ok(request)
}

/// A tonic server of [`Payments`] behind the layer, on a loopback port.
struct Server {
    addr: SocketAddr,
    payments: Payments,
    store: SqliteStore,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
}

type Leased = IdempotencyLayer<LeaseMode<SqliteStore>>;
type Transactional = IdempotencyLayer<TransactionMode<SqliteStore>>;

/// A SQLite store in a temporary folder, with the `payments` table of transaction mode.
async fn store() -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("grpc.db")).await.unwrap();
    sqlx::query("CREATE TABLE payments (idem_key TEXT NOT NULL, amount INTEGER NOT NULL)")
        .execute(store.writer())
        .await
        .unwrap();
    (store, dir)
}

impl Server {
    /// Lease mode: `adjust` sets the layer up.
    async fn leased(adjust: impl FnOnce(Leased) -> Leased) -> Self {
        let (store, dir) = store().await;
        let layer = adjust(IdempotencyLayer::leased(store.clone()));
        Self::serve(layer, Effects::Memory, store, dir).await
    }

    /// Transaction mode: the handler writes its payment through the layer's transaction.
    async fn transactional(adjust: impl FnOnce(Transactional) -> Transactional) -> Self {
        let (store, dir) = store().await;
        let layer = adjust(IdempotencyLayer::transactional(store.clone()));
        Self::serve(layer, Effects::Transaction, store, dir).await
    }

    async fn serve<M: idem_tower::Mode>(
        layer: IdempotencyLayer<M>,
        effects: Effects,
        store: SqliteStore,
        dir: tempfile::TempDir,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let payments = Payments::new(effects);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let router = tonic::transport::Server::builder()
            // tonic runs the first layer first: authentication, then idem, then the ledger
            // middleware next to the handler.
            .layer(InterceptorLayer::new(authenticate))
            .layer(layer)
            .layer(tower::layer::layer_fn(LedgerTrailer))
            .add_service(PaymentsServer::new(payments.clone()));
        tokio::spawn(router.serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            async {
                let _ = stopped.await;
            },
        ));
        Self {
            addr,
            payments,
            store,
            _dir: dir,
            _stop: stop,
        }
    }

    async fn client(&self) -> PaymentsClient<Channel> {
        client(self.addr).await
    }

    /// Rows the handler wrote through the layer's transaction for `key`.
    async fn rows(&self, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE idem_key = ?")
            .bind(key)
            .fetch_one(self.store.readers())
            .await
            .unwrap()
    }
}

async fn client(addr: SocketAddr) -> PaymentsClient<Channel> {
    PaymentsClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

/// A `CreatePayment` call under `key` (none: `None`) with `script`, as [`ACCOUNT`].
fn create(key: Option<&str>, amount: i64, script: &str) -> tonic::Request<CreatePaymentRequest> {
    let mut request = tonic::Request::new(CreatePaymentRequest {
        amount,
        currency: "EUR".into(),
        script: script.into(),
    });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {ACCOUNT}").parse().unwrap(),
    );
    request
}

/// What a call got: the payment and the metadata (headers and trailers merged, as tonic gives
/// them), or the status.
type Answer = Result<(Payment, MetadataMap), Status>;

async fn call(
    client: &mut PaymentsClient<Channel>,
    request: tonic::Request<CreatePaymentRequest>,
) -> Answer {
    client.create_payment(request).await.map(|response| {
        let (metadata, payment, _) = response.into_parts();
        (payment, metadata)
    })
}

fn replayed(metadata: &MetadataMap) -> bool {
    metadata
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// The status code of a call that failed, or `OK`.
fn code(answer: &Answer) -> Code {
    match answer {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    }
}

/// The `grpc-status` numbers idem-core knows, as tonic's codes.
fn tonic_code(code: GrpcCode) -> Code {
    Code::from_i32(code.as_field().parse().unwrap())
}

/// A middleware next to the handler that adds custom trailing metadata to every successful
/// unary answer (`x-ledger-entry`), as an app's ledger or tracing middleware would: tonic's
/// handlers cannot, and the layer must store and replay such trailers with the status.
#[derive(Clone)]
struct LedgerTrailer<S>(S);

impl<S, B> tower::Service<http::Request<B>> for LedgerTrailer<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let unary = request.uri().path() == idem_grpc_tests::CREATE_PAYMENT;
        let future = self.0.call(request);
        Box::pin(async move {
            let response = future.await?;
            if !unary {
                return Ok(response);
            }
            Ok(response.map(|body| tonic::body::Body::new(WithLedger(body))))
        })
    }
}

/// A body whose trailers, when it has any with `grpc-status: 0`, gain `x-ledger-entry`.
struct WithLedger(tonic::body::Body);

impl http_body::Body for WithLedger {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Status>>> {
        Pin::new(&mut self.0).poll_frame(cx).map_ok(|frame| {
            let mut trailers = match frame.into_trailers() {
                Ok(trailers) => trailers,
                Err(frame) => return frame,
            };
            if trailers.get("grpc-status").is_some_and(|s| s == "0") {
                trailers.insert("x-ledger-entry", http::HeaderValue::from_static("led_42"));
            }
            http_body::Frame::trailers(trailers)
        })
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}
