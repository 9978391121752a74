//! `payments.v1.Payments` on tonic behind idem's layer, in lease mode on a SQLite file: the
//! snippet of the gRPC guide, runnable.
//!
//! ```sh
//! cargo run -p idem-grpc-tests --example payments_server -- 127.0.0.1:50051
//! ```

use idem_core::AccountId;
use idem_grpc_tests::{Effects, Payments, PaymentsServer, WATCH_PAYMENTS};
use idem_store::SqliteStore;
use idem_tower::IdempotencyLayer;
use tonic::service::InterceptorLayer;
use tonic::{Request, Status};

/// The app's authentication: the bearer token names the account the keys are scoped to.
fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    let token = request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| Status::unauthenticated("send authorization: Bearer <token>"))?;
    let account = AccountId::new(token);
    request.extensions_mut().insert(account);
    Ok(request)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:50051".into())
        .parse()?;
    let store = SqliteStore::open("payments-grpc.db").await?;
    let idempotency = IdempotencyLayer::leased(store)
        // Streaming methods pass through untouched, key or not.
        .with_grpc_streaming([WATCH_PAYMENTS]);
    println!("listening on {addr}");
    tonic::transport::Server::builder()
        // tonic runs the first layer first: authentication, then idem.
        .layer(InterceptorLayer::new(authenticate))
        .layer(idempotency)
        .add_service(PaymentsServer::new(Payments::new(Effects::Memory)))
        .serve(addr)
        .await?;
    Ok(())
}
