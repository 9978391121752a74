//! The service the gRPC tests run idem against: `payments.v1.Payments` on tonic, with a
//! unary `CreatePayment` whose effect must happen once per key, and a server-streaming
//! `WatchPayments` that idem must leave alone.
//!
//! `CreatePayment` does what its request's `script` says (proto/payments.proto) and counts its
//! effects per key: in memory for lease mode, or as rows written through the layer's
//! transaction ([`idem_tower::Tx`] taken from the request's extensions) in transaction mode.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use idem_core::Scope;
use idem_store::SqliteTx;
use idem_tower::Tx;
use tokio::sync::{Notify, Semaphore};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// The generated `payments.v1` messages, server and client.
#[allow(missing_docs, unreachable_pub, missing_debug_implementations)]
pub mod pb {
    tonic::include_proto!("payments.v1");
}

pub use pb::payments_server::PaymentsServer;

/// The full name of the unary method, as the layer's settings name it.
pub const CREATE_PAYMENT: &str = "/payments.v1.Payments/CreatePayment";
/// The full name of the server-streaming method.
pub const WATCH_PAYMENTS: &str = "/payments.v1.Payments/WatchPayments";

/// Where the service records its effects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effects {
    /// In memory: for lease mode, where the work is outside the key's database.
    Memory,
    /// Rows in the `payments` table of the layer's SQLite store, written through the layer's
    /// transaction: for transaction mode.
    Transaction,
}

/// The `payments.v1.Payments` service; clones share their counts and gates.
#[derive(Debug, Clone)]
pub struct Payments {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    effects: Effects,
    /// Per key: how many times the handler ran, and how many payments it made.
    runs: Mutex<HashMap<String, u32>>,
    made: Mutex<HashMap<String, u32>>,
    /// Told each time a `CreatePayment` handler starts.
    entered: Notify,
    /// What `hold` waits for.
    gate: Semaphore,
    /// What `WatchPayments` waits for between its first event and the rest.
    stream_gate: Semaphore,
}

impl Payments {
    /// A service that records its effects in `effects`.
    pub fn new(effects: Effects) -> Self {
        Self {
            shared: Arc::new(Shared {
                effects,
                runs: Mutex::default(),
                made: Mutex::default(),
                entered: Notify::new(),
                gate: Semaphore::new(0),
                stream_gate: Semaphore::new(0),
            }),
        }
    }

    /// How many times `CreatePayment` ran for `key` (every key: `None`).
    pub fn runs(&self, key: Option<&str>) -> u32 {
        count(&self.shared.runs, key)
    }

    /// How many payments `CreatePayment` made in memory for `key` (every key: `None`).
    pub fn made(&self, key: Option<&str>) -> u32 {
        count(&self.shared.made, key)
    }

    /// Waits until a `CreatePayment` handler has started (one that started before counts).
    pub async fn entered(&self) {
        self.shared.entered.notified().await;
    }

    /// Lets `n` held `CreatePayment` handlers go on.
    pub fn release(&self, n: usize) {
        self.shared.gate.add_permits(n);
    }

    /// Lets the held `WatchPayments` streams go on.
    pub fn release_streams(&self, n: usize) {
        self.shared.stream_gate.add_permits(n);
    }
}

fn count(map: &Mutex<HashMap<String, u32>>, key: Option<&str>) -> u32 {
    let map = map.lock().expect("not poisoned");
    match key {
        Some(key) => map.get(key).copied().unwrap_or(0),
        None => map.values().sum(),
    }
}

fn bump(map: &Mutex<HashMap<String, u32>>, key: &str) -> u32 {
    let mut map = map.lock().expect("not poisoned");
    let n = map.entry(key.to_owned()).or_default();
    *n += 1;
    *n
}

type PaymentStream = Pin<Box<dyn Stream<Item = Result<pb::Payment, Status>> + Send>>;

#[tonic::async_trait]
impl pb::payments_server::Payments for Payments {
    async fn create_payment(
        &self,
        request: Request<pb::CreatePaymentRequest>,
    ) -> Result<Response<pb::Payment>, Status> {
        // Behind the layer, the request's scope is among the extensions; behind idem proxy,
        // the key comes as sent in the metadata. A keyless call has neither.
        let key = match request.extensions().get::<Scope>() {
            Some(scope) => scope.key.as_str().to_owned(),
            None => request
                .metadata()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned(),
        };
        let attempt = bump(&self.shared.runs, &key);
        self.shared.entered.notify_one();
        let script = request.get_ref().script.clone();
        match script.as_str() {
            "hold" => self
                .shared
                .gate
                .acquire()
                .await
                .expect("the gate stays open")
                .forget(),
            "decline" => {
                let mut status = Status::with_details(
                    tonic::Code::FailedPrecondition,
                    "card declined",
                    bytes_of(b"declined: insufficient funds"),
                );
                status.metadata_mut().insert(
                    "x-decline-code",
                    tonic::metadata::MetadataValue::from_static("insufficient_funds"),
                );
                return Err(status);
            }
            "unavailable" => return Err(Status::unavailable("the bank is down")),
            "flaky" if attempt == 1 => return Err(Status::unavailable("the bank blinked")),
            "panic" => panic!("the scripted handler panics"),
            _ => {}
        }
        match self.shared.effects {
            Effects::Memory => {
                bump(&self.shared.made, &key);
            }
            Effects::Transaction => {
                let mut tx = Tx::<SqliteTx>::from_extensions(request.extensions()).await?;
                sqlx::query("INSERT INTO payments (idem_key, amount) VALUES (?, ?)")
                    .bind(&key)
                    .bind(request.get_ref().amount)
                    .execute(&mut **tx)
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?;
            }
        }
        if script == "internal" {
            return Err(Status::internal("the ledger write failed"));
        }
        let payment = request.into_inner();
        Ok(Response::new(pb::Payment {
            id: format!("pay_{key}_{attempt}"),
            amount: payment.amount,
            currency: payment.currency,
            attempt,
        }))
    }

    type WatchPaymentsStream = PaymentStream;

    async fn watch_payments(
        &self,
        request: Request<pb::WatchPaymentsRequest>,
    ) -> Result<Response<PaymentStream>, Status> {
        let count = request.into_inner().count;
        let shared = self.shared.clone();
        let (send, receive) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            for n in 1..=count {
                if n == 2 {
                    // The first event is out; the rest wait for the test.
                    shared
                        .stream_gate
                        .acquire()
                        .await
                        .expect("the gate stays open")
                        .forget();
                }
                let event = pb::Payment {
                    id: format!("evt_{n}"),
                    amount: i64::from(n),
                    currency: "EUR".into(),
                    attempt: 1,
                };
                if send.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(receive),
        )))
    }
}

fn bytes_of(data: &'static [u8]) -> tonic::codegen::Bytes {
    tonic::codegen::Bytes::from_static(data)
}
