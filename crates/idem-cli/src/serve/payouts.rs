//! `POST /payouts`: work outside the database, in lease mode (docs/contract.md §3).
//!
//! The key is claimed and committed with a lease first; the provider is called with a key
//! derived from ours (so the provider dedupes a repeated call); the outcome is stored only by
//! the holder of the claim. The claim is held for the lease plus the provider timeout past
//! every renewal, so no call made under it can still be running once it has run out.
//!
//! A worker that dies mid-call leaves its record in progress: retries get `409` until the
//! [`reconcile`] loop has asked the provider what happened and completed the record with the
//! provider's answer, or released it when nothing happened. A call that fails (the provider
//! answers `5xx`, cuts the connection, or times out) ends the handler with its outcome
//! unknown: the layer ends the lease at once and the reconciler looks right away, so the
//! client's `502`/`504` and every duplicate's `409 outcome-unknown` carry a `Retry-After`
//! just past that look.

use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::{Clock, DownstreamKey, StoredResponse};
use idem_store::RecordFilter;
use idem_tower::Outcome;
use serde::Serialize;
use tokio::task::JoinHandle;

use super::app::App;
use super::backend::Backend;
use super::error::ApiError;
use super::payments::parse_request;
use super::provider::{Charge, PausePoint, Provider};
use crate::admin::{BY_RECONCILER, note};

/// A payout as the API shows it.
#[derive(Debug, Clone, Serialize)]
struct Payout {
    id: String,
    amount: i64,
    currency: String,
    status: &'static str,
    provider_charge: String,
}

/// The response for a charge: the handler and the reconciler build the very same bytes.
fn payout_response(charge: &Charge) -> (StatusCode, Vec<u8>) {
    let payout = Payout {
        id: format!("po_{}", charge.id),
        amount: charge.amount,
        currency: charge.currency.clone(),
        status: "paid",
        provider_charge: charge.id.clone(),
    };
    (
        StatusCode::CREATED,
        serde_json::to_vec(&payout).expect("a payout serialises"),
    )
}

/// The response of `error`, telling the lease layer what became of the payout.
fn with_outcome(error: ApiError, outcome: Outcome) -> Response {
    let mut response = error.into_response();
    response.extensions_mut().insert(outcome);
    response
}

/// `POST /payouts` `{"amount": 100, "currency": "EUR"}`.
pub(crate) async fn create<B: Backend>(
    State(app): State<App<B>>,
    Extension(key): Extension<DownstreamKey>,
    body: Bytes,
) -> Response {
    let request = match parse_request(&body) {
        Ok(parsed) => parsed,
        Err(detail) => return ApiError::Invalid(detail).into_response(),
    };
    app.provider.pause_at(PausePoint::BeforeProvider).await;
    let call = app
        .provider
        .charge(&key, request.amount, &request.currency)
        .await;
    let answer = match call {
        Ok(answer) => answer,
        Err(e) => return call_failed(&e),
    };
    let status = answer.status();
    let body = answer.bytes().await;
    app.provider.pause_at(PausePoint::AfterProvider).await;
    answered(status.as_u16(), body)
}

/// The answer to a payout whose provider call got no answer: a retry runs fresh when nothing
/// was sent, and waits for the reconciler when the call was sent.
fn call_failed(e: &reqwest::Error) -> Response {
    if e.is_connect() {
        // Nothing reached the provider: nothing happened, the retry runs fresh.
        return with_outcome(ApiError::ProviderUnreachable, Outcome::Release);
    }
    // Sent, then no answer: the provider may have paid. The record stays in progress until
    // the reconciler finds out.
    tracing::warn!(error = %e, "the provider call failed after it was sent");
    with_outcome(ApiError::ProviderSilent, Outcome::Unknown)
}

/// The answer to a payout from the provider's `status` and `body`: the payout, a decline
/// (stored and replayed like the payout), or an outcome left to the reconciler.
fn answered(status: u16, body: reqwest::Result<Bytes>) -> Response {
    match (status, body) {
        (200 | 201, Ok(body)) => match serde_json::from_slice::<Charge>(&body) {
            Ok(charge) => {
                let (status, body) = payout_response(&charge);
                (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
            }
            Err(e) => {
                tracing::error!(error = %e, "the provider's answer is unreadable");
                with_outcome(ApiError::ProviderUnreadable, Outcome::Unknown)
            }
        },
        // A decline is a business outcome: stored and replayed.
        (402, _) => ApiError::CardDeclined.into_response(),
        (code, _) => {
            tracing::warn!(status = code, "the provider failed");
            with_outcome(ApiError::ProviderFailed, Outcome::Unknown)
        }
    }
}

/// Starts the reconciler: it resolves payouts whose worker died or whose provider call
/// failed, by asking the provider. Its first pass runs at once, for what a crash left behind.
pub(super) fn spawn_reconciler<B: Backend>(app: &App<B>) -> JoinHandle<()> {
    let (store, provider, clock, signal, reconciliation) = (
        app.store.clone(),
        app.provider.clone(),
        app.clock.clone(),
        app.signal.clone(),
        app.reconciliation.clone(),
    );
    reconciliation.request_pass();
    tokio::spawn(async move {
        loop {
            reconciliation.until_next_pass().await;
            if let Err(e) = reconcile(&store, &provider, clock.as_ref(), &signal).await {
                tracing::warn!(error = %e, "reconciling payouts failed");
            }
        }
    })
}

/// What the reconciler did with one stale record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reconciled {
    Completed,
    Released,
    Unknown,
}

/// Resolves in-progress records whose lease ran out (their worker died, or its provider call
/// failed): asks the provider by key what happened, then completes the record with the
/// provider's answer, or releases it when the provider has no such charge; when the provider
/// cannot be asked, the record stays in progress, visible to operators (`idem keys list`),
/// and is tried again next round. What it did goes into the key's history in the store
/// (`reconciled: completed with status 201` or `reconciled: released`, by `reconciler`).
///
/// A `404` may be trusted because the lease covers the provider timeout: once it has run out,
/// no call made under the claim can still be running, so no charge can still appear.
pub(crate) async fn reconcile<B: Backend>(
    store: &B,
    provider: &Provider,
    clock: &dyn Clock,
    signal: &idem_tower::OutcomeSignal,
) -> anyhow::Result<usize> {
    // Run out by the store's clock, whatever this instance's says: so the lease covers the
    // provider timeout as the store counts it, and a call it covers cannot still be running.
    let now = clock.now();
    let stale = store
        .list(
            &RecordFilter {
                in_progress: Some(true),
                lease_expired_by: Some(now),
                limit: 100,
                ..Default::default()
            },
            now,
        )
        .await?;
    let mut resolved = 0;
    for record in stale {
        let result = reconcile_one(store, provider, &record, clock).await;
        tracing::info!(key = %record.scope.log_label(), ?result, "reconciled a stale payout");
        if result != Reconciled::Unknown {
            resolved += 1;
            // Duplicates waiting for this payout learn its outcome now.
            signal.wake(&record.scope.log_label());
        }
    }
    Ok(resolved)
}

async fn reconcile_one<B: Backend>(
    store: &B,
    provider: &Provider,
    record: &idem_core::Record,
    clock: &dyn Clock,
) -> Reconciled {
    let idem_core::RecordState::InProgress { token, .. } = record.state else {
        return Reconciled::Unknown;
    };
    let answer = match provider.lookup(&DownstreamKey::of(record)).await {
        Ok(answer) => answer,
        Err(e) => {
            tracing::warn!(error = %e, "cannot ask the provider; the outcome stays unknown");
            return Reconciled::Unknown;
        }
    };
    match answer.status().as_u16() {
        200 => {
            let Ok(charge) = answer.json::<Charge>().await else {
                return Reconciled::Unknown;
            };
            let (status, body) = payout_response(&charge);
            let stored = StoredResponse {
                status: status.as_u16(),
                headers: vec![("content-type".into(), "application/json".into())],
                body,
                body_omitted: false,
            };
            let now = clock.now();
            match store.complete(&record.scope, token, &stored, now).await {
                Ok(true) => {
                    let what = format!("reconciled: completed with status {}", stored.status);
                    note(store, &record.scope, now, what, BY_RECONCILER).await;
                    Reconciled::Completed
                }
                _ => Reconciled::Unknown,
            }
        }
        404 => match store.release(&record.scope, token).await {
            Ok(true) => {
                let what = "reconciled: released".to_owned();
                note(store, &record.scope, clock.now(), what, BY_RECONCILER).await;
                Reconciled::Released
            }
            _ => Reconciled::Unknown,
        },
        _ => Reconciled::Unknown,
    }
}
