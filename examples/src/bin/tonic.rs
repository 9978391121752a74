//! `payments.v1.Payments` on tonic, in transaction mode on SQLite: the payment's row, the key's
//! record and the stored answer (message and trailers) commit in one transaction. The handler
//! takes the transaction from the request's extensions, as any tower service can.
//!
//! ```sh
//! cargo run -p idem-examples --bin tonic     # gRPC on 127.0.0.1:3000 (IDEM_EXAMPLE_ADDR)
//! ```
//!
//! A call carries its key in the `idempotency-key` metadata and `authorization: Bearer
//! sk_test_alice` (or `sk_test_bob`). `IDEM_EXAMPLE_DB` names the database file (default
//! `payments-grpc.db`).

use idem_core::AccountId;
use idem_examples::{ACCOUNTS, listen_addr};
use idem_store::{SqliteStore, SqliteTx};
use idem_tower::{IdempotencyLayer, Tx};
use tonic::service::InterceptorLayer;
use tonic::{Request, Response, Status};

#[allow(missing_docs, unreachable_pub, missing_debug_implementations)] // generated
mod pb {
    tonic::include_proto!("payments.v1");
}

use pb::payments_server::{Payments, PaymentsServer};

const WATCH_PAYMENTS: &str = "/payments.v1.Payments/WatchPayments";

/// The app's authentication: the bearer token names the account the keys are scoped to.
fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    let token = request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let Some((_, account)) = ACCOUNTS.iter().find(|(known, _)| Some(*known) == token) else {
        return Err(Status::unauthenticated(
            "send authorization: Bearer <token>",
        ));
    };
    request.extensions_mut().insert(AccountId::new(*account));
    Ok(request)
}

struct PaymentsService;

#[tonic::async_trait]
impl Payments for PaymentsService {
    async fn create_payment(
        &self,
        request: Request<pb::CreatePaymentRequest>,
    ) -> Result<Response<pb::Payment>, Status> {
        let id = format!("pay_{}", uuid::Uuid::new_v4().simple());
        let mut tx = Tx::<SqliteTx>::from_extensions(request.extensions()).await?;
        let payment = request.into_inner();
        sqlx::query("INSERT INTO payments (id, amount, currency) VALUES (?1, ?2, ?3)")
            .bind(&id)
            .bind(payment.amount)
            .bind(&payment.currency)
            .execute(&mut **tx)
            .await
            // Not stored: the transaction rolls back and a retry runs afresh.
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(pb::Payment {
            id,
            amount: payment.amount,
            currency: payment.currency,
            attempt: 1,
        }))
    }

    type WatchPaymentsStream = tokio_stream::Empty<Result<pb::Payment, Status>>;

    async fn watch_payments(
        &self,
        _: Request<pb::WatchPaymentsRequest>,
    ) -> Result<Response<Self::WatchPaymentsStream>, Status> {
        Err(Status::unimplemented("this example creates payments only"))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::var("IDEM_EXAMPLE_DB").unwrap_or_else(|_| "payments-grpc.db".to_owned());
    let store = SqliteStore::open(path).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments \
         (id TEXT PRIMARY KEY, amount INTEGER NOT NULL, currency TEXT NOT NULL)",
    )
    .execute(store.writer())
    .await?;
    let idempotency = IdempotencyLayer::transactional(store)
        // Streaming methods pass through untouched, key or not.
        .with_grpc_streaming([WATCH_PAYMENTS]);

    let listener = tokio::net::TcpListener::bind(listen_addr()).await?;
    println!("listening on {}", listener.local_addr()?);
    tonic::transport::Server::builder()
        // tonic runs the first layer first: authentication, then idem.
        .layer(InterceptorLayer::new(authenticate))
        .layer(idempotency)
        .add_service(PaymentsServer::new(PaymentsService))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await?;
    Ok(())
}
