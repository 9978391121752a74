//! The two ways to be atomic (docs/contract.md §3).

use std::fmt;
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use idem_core::{Decision, decide};
use idem_store::{ClaimOutcome, Store, TransactionalStore, TxClaim};
use tokio::sync::Mutex;
use tower::{Service, ServiceExt};

use crate::body::{ResponseBody, read_response};
use crate::claim::Claim;
use crate::response::{
    ErrorChain, MadeBody, Refusal, Served, retry_after_value, settle, store_unavailable,
};
use crate::section::{Panicked, catch_panic};
use crate::signal::LazyListener;
use crate::telemetry;
use crate::{Outcome, OutcomeSignal, Reconciliation};

/// How the layer makes a key's claim and its work atomic: [`TransactionMode`] or
/// [`LeaseMode`]. Sealed: the two modes are the contract's.
pub trait Mode: Clone + fmt::Debug + Send + Sync + 'static + sealed::Run {
    /// Where records live.
    type Store: Store;

    /// The store.
    fn store(&self) -> &Self::Store;
}

pub(crate) mod sealed {
    use super::*;

    /// The part of [`Mode`](super::Mode) only this crate sees.
    pub trait Run {
        /// `transaction` or `lease`: the request span's `idempotency.mode`.
        fn name(&self) -> &'static str;

        /// Whether this mode's claim answers a key that is taken as cheaply as a read would,
        /// so that reading before the claim only slows first requests.
        fn claim_answers_like_a_read(&self) -> bool;

        /// Makes what the mode needs besides the store ready, before a request looks at the
        /// store: lease mode's outcome listener, started by the layer's first request.
        fn ready(&self) -> impl Future<Output = idem_store::Result<()>> + Send;

        /// Where [`run`](Self::run) runs when not in the request's task: the store's
        /// [`transaction_runtime`](idem_store::TransactionalStore::transaction_runtime).
        fn section_runtime(&self) -> Option<tokio::runtime::Handle> {
            None
        }

        /// Claims the key, runs `inner`, and stores the outcome. Runs in its own task.
        fn run<S, ReqBody, ResBody>(
            self,
            claim: Claim,
            inner: S,
            request: Request<ReqBody>,
        ) -> impl Future<Output = Result<Response<ResponseBody<ResBody>>, S::Error>> + Send + 'static
        where
            S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
            S::Future: Send + 'static,
            S::Error: Send + 'static,
            ReqBody: Send + 'static,
            ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
            ResBody::Error: fmt::Display;
    }
}

/// Transaction mode: the key row, the handler's writes and the stored response commit in one
/// transaction, which the handler reaches through the [`Tx`](crate::Tx) extractor.
#[derive(Debug, Clone)]
pub struct TransactionMode<St>(St);

/// Lease mode: the claim commits first with a lease and a fencing token; the outcome is stored
/// only by the holder of the current token. For work that calls outside the database.
///
/// Its settings are made by the layer's setters
/// ([`with_outcome_wait`](crate::IdempotencyLayer::with_outcome_wait),
/// [`with_outcome_signal`](crate::IdempotencyLayer::with_outcome_signal),
/// [`without_takeover`](crate::IdempotencyLayer::without_takeover),
/// [`with_reconciliation`](crate::IdempotencyLayer::with_reconciliation)).
#[derive(Debug, Clone)]
pub struct LeaseMode<St> {
    // Shared: the layer clones its mode for every request, and a store's own clone may
    // allocate (Redis's holds its clients and key names).
    store: Arc<St>,
    pub(crate) take_over: bool,
    /// Whether the work gets a [`DownstreamKey`](idem_core::DownstreamKey) in its extensions.
    pub(crate) downstream_key: bool,
    pub(crate) wait: Option<OutcomeWait>,
    pub(crate) reconciliation: Option<Reconciliation>,
}

/// How duplicates wait for an outcome in lease mode.
#[derive(Debug, Clone)]
pub(crate) struct OutcomeWait {
    /// The longest wait.
    pub(crate) max: Duration,
    /// What wakes the waiters.
    pub(crate) signal: OutcomeSignal,
    /// The store's listener that feeds `signal`, when the layer wired it itself
    /// ([`with_outcome_wait`](crate::IdempotencyLayer::with_outcome_wait)); `None` when the
    /// caller's signal is fed by the caller.
    pub(crate) listener: Option<Arc<LazyListener>>,
}

impl<St: TransactionalStore> TransactionMode<St> {
    /// Transaction mode over `store`.
    pub(crate) fn new(store: St) -> Self {
        Self(store)
    }
}

impl<St: Store> LeaseMode<St> {
    /// Takes over a claim whose lease ran out; no waiting, no reconciler.
    pub(crate) fn new(store: St) -> Self {
        Self {
            store: Arc::new(store),
            take_over: true,
            downstream_key: true,
            wait: None,
            reconciliation: None,
        }
    }
}

/// Where the handler finds the transaction the layer opened. The layer takes it back when the
/// handler returns.
pub(crate) type TxSlot<T> = Arc<Mutex<Option<T>>>;

impl<St: TransactionalStore> Mode for TransactionMode<St> {
    type Store = St;

    fn store(&self) -> &St {
        &self.0
    }
}

impl<St: TransactionalStore> sealed::Run for TransactionMode<St> {
    fn name(&self) -> &'static str {
        "transaction"
    }

    fn claim_answers_like_a_read(&self) -> bool {
        self.0.begin_claim_answers_like_a_read()
    }

    async fn ready(&self) -> idem_store::Result<()> {
        Ok(())
    }

    fn section_runtime(&self) -> Option<tokio::runtime::Handle> {
        self.0.transaction_runtime()
    }

    async fn run<S, ReqBody, ResBody>(
        self,
        claim: Claim,
        mut inner: S,
        mut request: Request<ReqBody>,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Send + 'static,
        ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
        ResBody::Error: fmt::Display,
    {
        let tx = match self.claim_in_tx(&claim).await {
            ControlFlow::Continue(tx) => tx,
            ControlFlow::Break(answer) => return Ok(answer),
        };
        let slot: TxSlot<St::Tx> = Arc::new(Mutex::new(Some(tx)));
        request.extensions_mut().insert(slot.clone());
        request.extensions_mut().insert(claim.scope().clone());
        let Ok(response) = catch_panic(call(&mut inner, request)).await else {
            // The handler's future is gone, and its guard on the slot with it: roll back, so
            // the key row goes with whatever the handler wrote and a retry runs fresh.
            if let Some(tx) = slot.lock().await.take()
                && let Err(e) = self.0.rollback(tx).await
            {
                tracing::warn!(error = %ErrorChain(&e), "rollback after a panic failed");
            }
            return Ok(handler_failed(
                claim.scope(),
                "the handler failed (it panicked); nothing was committed and the key is free, so a retry with the same key runs again",
            ));
        };
        // The handler has returned, so its guard on the slot is gone (unless it leaked one
        // into a task; then this waits for that task).
        let Some(tx) = slot.lock().await.take() else {
            tracing::error!("the handler took the transaction out of its slot");
            return Ok(
                Refusal::StoreUnavailable.response("the handler did not return its transaction")
            );
        };
        let response = match response {
            Ok(response) => response,
            Err(e) => {
                let _ = self.0.rollback(tx).await;
                return Err(e);
            }
        };
        // A body over the storage cap is read only up to it: the commit comes before the
        // client gets any of it, and the rest streams after (docs/contract.md §2.5).
        let (response, outcome, stored) = match read_response(&claim.policy, response).await {
            Ok(read) => read,
            Err(e) => {
                tracing::error!(error = %e, "handler response failed");
                let _ = self.0.rollback(tx).await;
                return Ok(Refusal::StoreUnavailable.response(
                    "the response could not be produced; nothing was committed; retry with the same key",
                ));
            }
        };
        Ok(self
            .commit_or_roll_back(&claim, tx, response, outcome, &stored)
            .await)
    }
}

impl<St: TransactionalStore> TransactionMode<St> {
    /// Claims the key in a new transaction, or breaks with the answer when the key is taken
    /// (a replay, a mismatch, a wait that ran out) or the store is unreachable.
    async fn claim_in_tx<B: MadeBody>(&self, claim: &Claim) -> ControlFlow<Response<B>, St::Tx> {
        let wait = claim.policy.in_flight_wait;
        match telemetry::store_call("begin_claim", self.0.begin_claim(&claim.new_claim, wait)).await {
            Ok(TxClaim::Claimed(tx)) => ControlFlow::Continue(tx),
            Ok(TxClaim::Existing(record)) => {
                let decision = decide(Some(&record), claim.fingerprint(), claim.clock.now());
                // A committed record the claim could not replace always settles the request.
                ControlFlow::Break(settle(&decision, claim.scope(), None))
            }
            Ok(TxClaim::Busy) => ControlFlow::Break(Refusal::InUse.refuse(format!(
                "a request with this Idempotency-Key is still running after a {} s wait; retry later with the same key",
                wait.as_secs()
            ))),
            Err(e) => ControlFlow::Break(store_unavailable(&e)),
        }
    }

    /// Commits the key row, the handler's writes and the stored response together when the
    /// outcome is to be stored; rolls all of them back otherwise.
    async fn commit_or_roll_back<B: From<Bytes>>(
        &self,
        claim: &Claim,
        tx: St::Tx,
        response: Response<B>,
        outcome: Outcome,
        stored: &idem_core::StoredResponse,
    ) -> Response<B> {
        if outcome != Outcome::Store {
            Served::NotStored.count();
            if let Err(e) = telemetry::store_call("rollback", self.0.rollback(tx)).await {
                tracing::warn!(error = %ErrorChain(&e), "rollback failed");
            }
            return response;
        }
        let commit = self
            .0
            .commit_response(tx, claim.scope(), claim.token(), stored);
        match telemetry::store_call("commit", commit).await {
            Ok(()) => {
                Served::Fresh.count();
                tracing::info!(key = %claim.scope().log_label(), status = stored.status, "stored");
                response
            }
            // Nothing committed: the client must not see a success that did not happen.
            Err(e) => store_unavailable(&e),
        }
    }
}

impl<St: Store> Mode for LeaseMode<St> {
    type Store = St;

    fn store(&self) -> &St {
        &self.store
    }
}

impl<St: Store> sealed::Run for LeaseMode<St> {
    fn name(&self) -> &'static str {
        "lease"
    }

    fn claim_answers_like_a_read(&self) -> bool {
        self.store.claim_answers_like_a_read()
    }

    async fn ready(&self) -> idem_store::Result<()> {
        // Listening from before the request's first look at the store, so that no outcome
        // published while it waits goes unheard.
        match self.wait.as_ref().and_then(|wait| wait.listener.as_ref()) {
            Some(listener) => listener.ensure_started().await,
            None => Ok(()),
        }
    }

    async fn run<S, ReqBody, ResBody>(
        self,
        mut claim: Claim,
        mut inner: S,
        mut request: Request<ReqBody>,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Send + 'static,
        ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
        ResBody::Error: fmt::Display,
    {
        request.extensions_mut().insert(claim.scope().clone());
        // What the work passes downstream so the downstream can dedupe too (§3.2).
        if self.downstream_key {
            let downstream = idem_core::DownstreamKey::new(claim.scope(), claim.fingerprint());
            request.extensions_mut().insert(downstream);
        }
        claim.new_claim.take_over_expired_lease = self.take_over;
        if let ControlFlow::Break(answer) = self.claim_or_wait(&mut claim).await {
            return Ok(answer);
        }
        let response = self
            .renewing_lease(&claim, catch_panic(call(&mut inner, request)))
            .await;
        let response = match response {
            Ok(Ok(response)) => response,
            Err(Panicked) => return Ok(self.handler_panicked(&claim).await),
            // The service failed without a response: the outcome is unknown.
            Ok(Err(e)) => {
                let _ = self.outcome_unknown(&claim).await;
                return Err(e);
            }
        };
        // As in transaction mode, the outcome is stored before the client gets any of a body
        // over the cap.
        let (response, outcome, stored) = match read_response(&claim.policy, response).await {
            Ok(read) => read,
            Err(e) => {
                tracing::error!(error = %e, "handler response failed");
                let (_, retry_after) = self.outcome_unknown(&claim).await;
                return Ok(Refusal::OutcomeUnknown { retry_after }
                    .response("the response could not be produced; the outcome is unknown"));
            }
        };
        Ok(self.store_outcome(claim, response, outcome, stored).await)
    }
}

impl<St: Store> LeaseMode<St> {
    /// Claims the key, or breaks with the answer when a record the claim cannot replace
    /// settles the request. With an outcome wait, a duplicate of work still running (or of an
    /// unknown outcome a reconciler will resolve) waits for it and claims again when woken,
    /// until the wait runs out.
    async fn claim_or_wait<B: MadeBody>(&self, claim: &mut Claim) -> ControlFlow<Response<B>> {
        let deadline = self
            .wait
            .as_ref()
            .map(|wait| tokio::time::Instant::now() + wait.max);
        // Waiters are found by the key's label, a hash: made only where there are any.
        let label = self.wait.as_ref().map(|_| claim.scope().log_label());
        let label = label.as_deref().unwrap_or_default();
        loop {
            // Each attempt is dated when it is made: the first comes after the replay read,
            // later ones after a wait.
            let now = claim.clock.now();
            claim.restamp(now);
            // Listen before claiming, so an outcome stored in between still wakes us.
            let mut woken = self.wait.as_ref().map(|wait| wait.signal.listen(label));
            let record =
                match telemetry::store_call("claim", self.store.claim(&claim.new_claim)).await {
                    Ok(ClaimOutcome::Claimed) => {
                        drop(woken);
                        self.forget_waiters(label);
                        return ControlFlow::Continue(());
                    }
                    Ok(ClaimOutcome::Existing(record)) => record,
                    Err(e) => return ControlFlow::Break(store_unavailable(&e)),
                };
            let decision = decide(Some(&record), claim.fingerprint(), now);
            // A record whose outcome is unknown is worth waiting for only when a reconciler
            // will resolve it (and wake us).
            let worth_waiting = match decision {
                Decision::InFlight { .. } => true,
                Decision::LeaseExpired { .. } => self.reconciliation.is_some(),
                _ => false,
            };
            if !worth_waiting {
                // Not going to wait: leave no entry behind.
                drop(woken.take());
                self.forget_waiters(label);
            }
            match (woken, deadline) {
                (Some(woken), Some(deadline)) if worth_waiting => {
                    Served::Waited.count();
                    if tokio::time::timeout_at(deadline, woken).await.is_err() {
                        self.forget_waiters(label);
                        return ControlFlow::Break(settle(
                            &decision,
                            claim.scope(),
                            self.reconciliation.as_ref(),
                        ));
                    }
                    // Woken: the outcome landed (or the key was released); look again.
                }
                // A record the claim could not replace always settles the request.
                _ => {
                    return ControlFlow::Break(settle(
                        &decision,
                        claim.scope(),
                        self.reconciliation.as_ref(),
                    ));
                }
            }
        }
    }

    /// Runs `work` while renewing the lease every third of it, so a slow call is not taken
    /// over.
    async fn renewing_lease<T>(&self, claim: &Claim, work: impl Future<Output = T>) -> T {
        renew_while(claim.policy.lease / 3, work, || async {
            let (hold, now) = (claim.policy.lease_hold(), claim.clock.now());
            let renew = self.store.renew(claim.scope(), claim.token(), hold, now);
            match telemetry::store_call("renew", renew).await {
                Ok(true) => {}
                Ok(false) => tracing::warn!(
                    key = %claim.scope().log_label(),
                    "lease lost while the work ran"
                ),
                Err(e) => tracing::warn!(error = %ErrorChain(&e), "lease renewal failed"),
            }
        })
        .await
    }

    /// Stores the work's outcome as its response marks it (stored, released, or unknown),
    /// wakes the key's waiters once there is something new to see, and hands the response
    /// back. A completion the store missed is tried again in the background.
    async fn store_outcome<B>(
        self,
        claim: Claim,
        mut response: Response<B>,
        outcome: Outcome,
        stored: idem_core::StoredResponse,
    ) -> Response<B> {
        let stored_ok = match outcome {
            Outcome::Store => {
                let now = claim.clock.now();
                let complete = self
                    .store
                    .complete(claim.scope(), claim.token(), &stored, now);
                telemetry::store_call("complete", complete).await
            }
            Outcome::Release => {
                let release = self.store.release(claim.scope(), claim.token());
                telemetry::store_call("release", release).await
            }
            Outcome::Unknown => {
                let (ended, retry_after) = self.outcome_unknown(&claim).await;
                set_retry_after(&mut response, retry_after);
                ended
            }
        };
        // Waiters look again once there is something new to see (a later try of a failed
        // store wakes them itself).
        if outcome != Outcome::Unknown
            && matches!(stored_ok, Ok(true))
            && let Some(wait) = &self.wait
        {
            wait.signal.wake(&claim.scope().log_label());
        }
        match stored_ok {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(key = %claim.scope().log_label(), "outcome not stored: the claim was taken over")
            }
            // The work happened and the client gets its answer; left in progress, the record
            // would be taken over (the work run again) or reconciled once its lease runs out.
            // Keep trying to store it while the claim still holds.
            Err(e) if outcome == Outcome::Store => {
                tracing::warn!(error = %ErrorChain(&e), key = %claim.scope().log_label(), "storing the outcome failed; retrying while the claim holds");
                let signal = self.wait.map(|wait| wait.signal);
                let store = St::clone(&self.store);
                tokio::spawn(store_outcome_later(store, claim, stored, signal));
            }
            Err(e) => tracing::error!(error = %ErrorChain(&e), "storing the outcome failed"),
        }
        match outcome {
            Outcome::Store => Served::Fresh.count(),
            _ => Served::NotStored.count(),
        }
        response
    }

    /// The answer to a handler that panicked. Where retries take a claim over (the work
    /// passes the key to a downstream that dedupes on it), the key is released, so the retry
    /// runs again at once as a takeover would; where a reconciler decides (no takeover), the
    /// handler may have called out before it panicked, so the outcome is left unknown for it.
    async fn handler_panicked<B: From<Bytes>>(&self, claim: &Claim) -> Response<B> {
        if self.take_over {
            match self.store.release(claim.scope(), claim.token()).await {
                Ok(true) => {
                    if let Some(wait) = &self.wait {
                        wait.signal.wake(&claim.scope().log_label());
                    }
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(error = %ErrorChain(&e), "releasing the key after a panic failed; its lease will run out")
                }
            }
            return handler_failed(
                claim.scope(),
                "the handler failed (it panicked); nothing was stored and the key is free, so a retry with the same key runs again",
            );
        }
        let (_, retry_after) = self.outcome_unknown(claim).await;
        let mut response = handler_failed(
            claim.scope(),
            "the handler failed (it panicked) after it may have called another system; the outcome is being reconciled; retry after Retry-After with the same key",
        );
        set_retry_after(&mut response, retry_after);
        response
    }

    /// [`outcome_unknown`] with this mode's store and reconciler.
    async fn outcome_unknown(&self, claim: &Claim) -> (idem_store::Result<bool>, Duration) {
        outcome_unknown(&*self.store, claim, self.reconciliation.as_ref()).await
    }

    /// Drops the wait entry for `label` when nobody listens on it any more (without a wait,
    /// there are no entries).
    fn forget_waiters(&self, label: &str) {
        if let Some(wait) = &self.wait {
            wait.signal.forget_if_unused(label);
        }
    }
}

/// Runs `work`, calling `renew` every `every` while it runs, the first time a whole `every`
/// after the start. (Not `interval`'s first tick, which is due at once but, rounded up to the
/// timer's next millisecond, held every request up to a millisecond before its work began.)
async fn renew_while<T, R: Future<Output = ()>>(
    every: Duration,
    work: impl Future<Output = T>,
    mut renew: impl FnMut() -> R,
) -> T {
    tokio::pin!(work);
    let mut renewals = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            output = &mut work => return output,
            _ = renewals.tick() => renew().await,
        }
    }
}

/// The `500 handler-failed` answer to a handler that panicked, logged with its key.
fn handler_failed<B: From<Bytes>>(scope: &idem_core::Scope, detail: &str) -> Response<B> {
    tracing::error!(key = %scope.log_label(), "the handler panicked");
    Refusal::HandlerFailed.refuse(detail)
}

/// Calls `inner` once it is ready.
async fn call<S: Service<R>, R>(inner: &mut S, request: R) -> Result<S::Response, S::Error> {
    inner.ready().await?.call(request).await
}

/// The work ended and its outcome is unknown. With a reconciler, every call the work made is
/// over, so nothing is left to wait for: the lease ends now, which makes the record's state
/// honest at once (outcome unknown, not "still running"), and the reconciler looks right away.
/// Without one the lease runs out and the next retry takes the key over. Returns whether the
/// record was updated and when a client should ask again.
async fn outcome_unknown<St: Store>(
    store: &St,
    claim: &Claim,
    reconciliation: Option<&Reconciliation>,
) -> (idem_store::Result<bool>, Duration) {
    match reconciliation {
        Some(schedule) => {
            let now = claim.clock.now();
            let end_lease = store.renew(claim.scope(), claim.token(), Duration::ZERO, now);
            let ended = telemetry::store_call("end_lease", end_lease).await;
            schedule.request_pass();
            (ended, schedule.retry_after())
        }
        None => (Ok(true), claim.policy.lease_hold()),
    }
}

/// Retries storing a completed outcome whose first attempt failed (the store was unreachable),
/// with doubling pauses, until it is stored, the claim is lost, or the lease (renewed for the
/// last time when the work ended) is about to run out.
async fn store_outcome_later<St: Store>(
    store: St,
    claim: Claim,
    stored: idem_core::StoredResponse,
    signal: Option<OutcomeSignal>,
) {
    let label = claim.scope().log_label();
    let give_up = tokio::time::Instant::now() + claim.policy.lease;
    let mut pause = Duration::from_millis(100);
    loop {
        tokio::time::sleep(pause).await;
        let now = claim.clock.now();
        match store
            .complete(claim.scope(), claim.token(), &stored, now)
            .await
        {
            Ok(true) => {
                tracing::info!(key = %label, "stored the outcome on a later try");
                if let Some(signal) = &signal {
                    signal.wake(&label);
                }
                return;
            }
            Ok(false) => {
                tracing::warn!(key = %label, "outcome not stored: the claim was taken over");
                return;
            }
            Err(e) if tokio::time::Instant::now() + pause >= give_up => {
                tracing::error!(error = %ErrorChain(&e), key = %label, "giving up storing the outcome; the record stays in progress");
                return;
            }
            Err(_) => pause = (pause * 2).min(Duration::from_secs(2)),
        }
    }
}

/// Gives a response whose outcome is unknown a `Retry-After`, unless its handler chose one.
fn set_retry_after<B>(response: &mut Response<B>, after: Duration) {
    response
        .headers_mut()
        .entry(http::header::RETRY_AFTER)
        .or_insert_with(|| retry_after_value(after));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::time::Instant;

    /// The work starts with no wait for a timer, and the lease is renewed every `every` while
    /// it runs, not before the first `every` has passed. On a paused clock, any wait for a
    /// timer shows as time that passed.
    #[tokio::test(start_paused = true)]
    async fn work_starts_at_once_and_renewals_come_every_period() {
        // Between two of the timer's millisecond ticks, where a request usually starts.
        tokio::time::advance(Duration::from_micros(500)).await;
        let started = Instant::now();
        let began = renew_while(
            Duration::from_secs(10),
            async { Instant::now() },
            || async { panic!("no renewal for work that ends at once") },
        )
        .await;
        assert_eq!(
            began, started,
            "the work waited for a timer before it began"
        );

        let renewals = AtomicUsize::new(0);
        let work = tokio::time::sleep(Duration::from_secs(25));
        renew_while(Duration::from_secs(10), work, || async {
            renewals.fetch_add(1, Ordering::Relaxed);
        })
        .await;
        assert_eq!(
            renewals.load(Ordering::Relaxed),
            2,
            "renewed at 10 s and 20 s"
        );
    }
}
