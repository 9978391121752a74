//! `idem fake-psp`: a small payment provider to call from lease mode, with its own
//! `Idempotency-Key`, a lookup by key, a charge counter, and faults on demand.
//!
//! - `POST /charges` `{"amount": 100, "currency": "EUR"}` with `Idempotency-Key`: charges once
//!   per key (a repeat answers the same charge; a different body with the key is `422`).
//! - `GET /charges/{key}`: the charge made with that key, or `404`.
//! - `GET /stats`: `{"charges": N, "requests": M}`.
//! - `POST /faults` `{"delay_ms": 0, "fail_next": 0, "drop_next": 0, "decline_next": 0,
//!   "no_dedupe": false, "lookup_delay_ms": 0}`: answer after a delay; fail the next N requests with `500` before
//!   charging; charge the next N and then cut the connection instead of answering; decline the
//!   next N with `402`; charge every `POST`, a repeated key too (a provider without
//!   idempotency, so only its caller can keep a payout to one charge); answer lookups by key
//!   after a delay.
//!
//! A charge, once started, completes even when the caller hangs up, as a real provider's would.
//!
//! Tests that run it in-process can also hold lookups by key until they release them
//! ([`FakePsp::hold_lookups`]), to act while a caller waits for the provider's answer.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, Notify, watch};

use crate::runtime::shutdown_signal;

/// `idem fake-psp` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct FakePspArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub listen: SocketAddr,
}

/// A charge the provider made.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Charge {
    /// `ch_<n>`.
    pub id: String,
    /// Minor units.
    pub amount: i64,
    /// Currency code.
    pub currency: String,
    /// `succeeded`.
    pub status: String,
}

/// Faults the next requests suffer.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Faults {
    /// Wait this long before charging.
    pub delay_ms: u64,
    /// Answer this many requests with 500, charging nothing.
    pub fail_next: u32,
    /// Charge this many, then cut the connection without answering.
    pub drop_next: u32,
    /// Decline this many with 402, charging nothing.
    pub decline_next: u32,
    /// Charge every request, a repeated key too; the lookup by key finds the first charge.
    pub no_dedupe: bool,
    /// Wait this long before answering a lookup by key.
    pub lookup_delay_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    body: Bytes,
    charge: Charge,
}

/// The provider's state, shared with tests that run it in-process.
#[derive(Debug, Clone, Default)]
pub struct FakePsp {
    charges: Arc<Mutex<HashMap<String, Entry>>>,
    faults: Arc<Mutex<Faults>>,
    requests: Arc<AtomicU64>,
    next_id: Arc<AtomicU64>,
    /// Wakes whoever waits for a charge request to arrive.
    pub arrived: Arc<Notify>,
    /// While `true`, lookups by key wait at the door.
    lookups_held: Arc<watch::Sender<bool>>,
    /// How many lookups by key arrived, held ones included.
    lookups: Arc<watch::Sender<u64>>,
}

impl FakePsp {
    /// The provider's routes.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/charges", post(charge))
            .route("/charges/{key}", get(lookup))
            .route("/stats", get(stats))
            .route("/faults", post(set_faults))
            .with_state(self.clone())
    }

    /// How many charges were made.
    pub async fn charges(&self) -> usize {
        self.charges.lock().await.len()
    }

    /// How many `POST /charges` requests arrived.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// Sets the faults.
    pub async fn set_faults(&self, faults: Faults) {
        *self.faults.lock().await = faults;
    }

    /// Holds every lookup by key from now on until [`FakePsp::release_lookups`] (on top of
    /// any `lookup_delay_ms`).
    pub fn hold_lookups(&self) {
        self.lookups_held.send_replace(true);
    }

    /// Lets the held lookups, and later ones, answer.
    pub fn release_lookups(&self) {
        self.lookups_held.send_replace(false);
    }

    /// Waits until `n` lookups by key have arrived in all, held ones included.
    pub async fn lookups_arrived(&self, n: u64) {
        let mut arrived = self.lookups.subscribe();
        // The sender lives as long as `self`: the wait ends only when the count is reached.
        let _ = arrived.wait_for(|&count| count >= n).await;
    }
}

/// The body of `POST /charges`.
#[derive(Deserialize)]
struct ChargeRequest {
    amount: i64,
    currency: String,
}

/// What one `POST /charges` came to.
enum Outcome {
    /// A new charge (`201`), or with `replayed` the key's earlier one (`200`).
    Charged { charge: Charge, replayed: bool },
    /// Charged, and the answer is to be lost.
    Dropped,
    /// Refused with this status; nothing was charged.
    Refused(StatusCode),
}

impl IntoResponse for Outcome {
    fn into_response(self) -> Response {
        match self {
            Self::Dropped => {
                // Charged; now lose the answer: the body fails, so the connection is cut.
                let failing = futures_util::stream::once(async {
                    Err::<Bytes, _>(std::io::Error::other("answer dropped by fault injection"))
                });
                (StatusCode::OK, Body::from_stream(failing)).into_response()
            }
            Self::Charged { charge, replayed } => {
                let status = if replayed {
                    StatusCode::OK
                } else {
                    StatusCode::CREATED
                };
                (status, Json(charge)).into_response()
            }
            Self::Refused(StatusCode::PAYMENT_REQUIRED) => (
                StatusCode::PAYMENT_REQUIRED,
                Json(serde_json::json!({"error": "card_declined"})),
            )
                .into_response(),
            Self::Refused(status) => (status, "charge failed").into_response(),
        }
    }
}

impl FakePsp {
    /// Charges `request` once per `key`, suffering the faults set for it.
    async fn make_charge(&self, key: String, body: Bytes, request: ChargeRequest) -> Outcome {
        let (delay, fault, dedupe) = self.take_fault().await;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if let Some(status) = fault {
            return Outcome::Refused(status);
        }
        let mut charges = self.charges.lock().await;
        let repeated = match charges.get(&key) {
            Some(existing) if dedupe => {
                return if existing.body == body {
                    Outcome::Charged {
                        charge: existing.charge.clone(),
                        replayed: true,
                    }
                } else {
                    Outcome::Refused(StatusCode::UNPROCESSABLE_ENTITY)
                };
            }
            Some(_) => true,
            None => false,
        };
        let drop_answer = self.take_drop().await;
        let n = self.next_id.fetch_add(1, Ordering::SeqCst) + 1;
        // A second charge for the key is kept apart, so the lookup still finds the first.
        let key = if repeated { format!("{key}#{n}") } else { key };
        let charge = Charge {
            id: format!("ch_{n}"),
            amount: request.amount,
            currency: request.currency,
            status: "succeeded".into(),
        };
        charges.insert(
            key,
            Entry {
                body,
                charge: charge.clone(),
            },
        );
        if drop_answer {
            Outcome::Dropped
        } else {
            Outcome::Charged {
                charge,
                replayed: false,
            }
        }
    }

    /// The delay, the refusal (if any) and whether to deduplicate, for the next request. Each
    /// request takes at most one refusal: a failure first, then a decline.
    async fn take_fault(&self) -> (Duration, Option<StatusCode>, bool) {
        let mut faults = self.faults.lock().await;
        let fault = if faults.fail_next > 0 {
            faults.fail_next -= 1;
            Some(StatusCode::INTERNAL_SERVER_ERROR)
        } else if faults.decline_next > 0 {
            faults.decline_next -= 1;
            Some(StatusCode::PAYMENT_REQUIRED)
        } else {
            None
        };
        (
            Duration::from_millis(faults.delay_ms),
            fault,
            !faults.no_dedupe,
        )
    }

    /// Whether the answer to this charge is to be lost.
    async fn take_drop(&self) -> bool {
        let mut faults = self.faults.lock().await;
        let drop = faults.drop_next > 0;
        faults.drop_next = faults.drop_next.saturating_sub(1);
        drop
    }
}

async fn charge(State(psp): State<FakePsp>, headers: HeaderMap, body: Bytes) -> Response {
    psp.requests.fetch_add(1, Ordering::SeqCst);
    psp.arrived.notify_waiters();
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return (StatusCode::BAD_REQUEST, "Idempotency-Key required").into_response();
    };
    let Ok(request) = serde_json::from_slice::<ChargeRequest>(&body) else {
        return (StatusCode::BAD_REQUEST, "invalid body").into_response();
    };
    // The work runs in its own task: a caller that hangs up does not stop a charge.
    let work = tokio::spawn(async move { psp.make_charge(key, body, request).await });
    match work.await {
        Ok(outcome) => outcome.into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn lookup(State(psp): State<FakePsp>, Path(key): Path<String>) -> Response {
    psp.lookups.send_modify(|count| *count += 1);
    let mut held = psp.lookups_held.subscribe();
    // `psp` owns the sender, so the channel stays open while this waits.
    let _ = held.wait_for(|&held| !held).await;
    let delay = psp.faults.lock().await.lookup_delay_ms;
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    match psp.charges.lock().await.get(&key) {
        Some(entry) => Json(entry.charge.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn stats(State(psp): State<FakePsp>) -> Response {
    Json(serde_json::json!({
        "charges": psp.charges.lock().await.len(),
        "requests": psp.requests.load(Ordering::SeqCst),
    }))
    .into_response()
}

async fn set_faults(State(psp): State<FakePsp>, Json(faults): Json<Faults>) -> Response {
    psp.set_faults(faults).await;
    StatusCode::NO_CONTENT.into_response()
}

/// Runs `idem fake-psp` until Ctrl-C or SIGTERM.
pub async fn run(args: FakePspArgs) -> anyhow::Result<ExitCode> {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    println!(
        "idem fake-psp: listening on http://{}",
        listener.local_addr()?
    );
    axum::serve(listener, FakePsp::default().router())
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    Ok(ExitCode::SUCCESS)
}
