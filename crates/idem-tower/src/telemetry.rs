//! The span each covered request runs in, what it records, and the child spans of the store
//! calls (docs/contract.md §15).
//!
//! The layer speaks only `tracing`: an application that exports traces (with
//! `tracing-opentelemetry`, as `idem serve` and `idem proxy` do) sees one `idempotency` span
//! per covered request, with
//!
//! - `idempotency.outcome`: what the layer decided (the labels of `idem_requests_total`);
//! - `idempotency.mode`: `transaction` or `lease`;
//! - `idempotency.protocol`: `http` or `grpc`;
//! - `idempotency.key_hash`: a hash of the account and the key, never the key itself (the same
//!   label the logs use);
//! - `idempotency.after_wait`: for a request whose outcome is `waited`, the answer it got once
//!   the original's outcome landed or the wait ran out;
//!
//! and an `idempotency.store` child span, with `idempotency.store.operation`, around each call
//! to the store. With no subscriber interested, a span costs a check of its callsite.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tracing::{Instrument, Span, field};

/// The span's target, for filters: what an exporter keeps and a log formatter may leave out.
pub const REQUEST_SPAN_TARGET: &str = "idem::request";
/// The store spans' target.
pub const STORE_SPAN_TARGET: &str = "idem::store";

tokio::task_local! {
    /// The covered request being served on this task (or in its section's task, when the
    /// client hung up), so that the counting points record on its span without each being
    /// handed it. Not set when no subscriber wants the span.
    static REQUEST: RequestTrace;
}

/// A covered request's span, and what has been recorded on it so far.
#[derive(Clone)]
struct RequestTrace {
    span: Span,
    /// The outcome recorded, if any: each field is recorded once (an exporter may keep every
    /// value recorded, not only the last). Shared with the section's task.
    outcome: Arc<Mutex<Recorded>>,
}

/// Which outcome fields are recorded.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Recorded {
    Nothing,
    Outcome,
    /// `waited`, and `idempotency.after_wait` still to come.
    Waiting,
    Everything,
}

/// The span of one covered request: `mode` is the layer's, `grpc` whether it is a gRPC call.
pub(crate) fn request_span(mode: &'static str, grpc: bool) -> Span {
    tracing::info_span!(
        target: REQUEST_SPAN_TARGET,
        "idempotency",
        idempotency.mode = mode,
        idempotency.protocol = if grpc { "grpc" } else { "http" },
        idempotency.outcome = field::Empty,
        idempotency.key_hash = field::Empty,
        idempotency.after_wait = field::Empty,
    )
}

/// A future boxed once, where it is made: the request's and the section's futures are several
/// KiB, and each wrapper around an unboxed future copied all of it again.
pub(crate) type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Runs `request` (a covered request's future) in `span`, with the span reachable from the
/// counting points. With no subscriber interested in the span, `request` as it is.
pub(crate) fn in_request_span<'a, T: 'a>(span: Span, request: Boxed<'a, T>) -> Boxed<'a, T> {
    if span.is_disabled() {
        return request;
    }
    let trace = RequestTrace {
        span: span.clone(),
        outcome: Arc::new(Mutex::new(Recorded::Nothing)),
    };
    Box::pin(REQUEST.scope(trace, request.instrument(span)))
}

/// Carries the request's span over to its section, which may finish in a task of its own.
pub(crate) fn in_section<'a, T: 'a>(work: Boxed<'a, T>) -> Boxed<'a, T> {
    match REQUEST.try_with(Clone::clone) {
        Ok(trace) => {
            let span = trace.span.clone();
            Box::pin(REQUEST.scope(trace, work.instrument(span)))
        }
        Err(_unset) => work,
    }
}

/// Records the request's outcome (an `idem_requests_total` label) on its span: the first one
/// counted, except that the answer a waiting duplicate finally got goes to
/// `idempotency.after_wait`.
pub(crate) fn record_outcome(label: &'static str) {
    let _ = REQUEST.try_with(|trace| {
        let mut recorded = trace.outcome.lock().unwrap_or_else(|e| e.into_inner());
        match *recorded {
            Recorded::Nothing => {
                *recorded = if label == "waited" {
                    Recorded::Waiting
                } else {
                    Recorded::Outcome
                };
                trace.span.record("idempotency.outcome", label);
            }
            Recorded::Waiting if label != "waited" => {
                *recorded = Recorded::Everything;
                trace.span.record("idempotency.after_wait", label);
            }
            _ => {}
        }
    });
}

/// Records the key's hash on the request's span, computed only when a subscriber wants it.
pub(crate) fn record_key(scope: &idem_core::Scope) {
    let _ = REQUEST.try_with(|trace| {
        let hash = scope.log_label();
        trace.span.record("idempotency.key_hash", hash.as_str());
    });
}

/// A store call, in a child span of the request's named by `operation`.
pub(crate) fn store_call<F: Future>(
    operation: &'static str,
    call: F,
) -> impl Future<Output = F::Output> {
    call.instrument(tracing::info_span!(
        target: STORE_SPAN_TARGET,
        "idempotency.store",
        idempotency.store.operation = operation,
    ))
}
