//! A store for tests of what sits on a store (the layer, the gateway): it passes every call to
//! the store it wraps, and lets the test watch some calls or make them fail.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{FencingToken, Record, RecordState, Scope, StoredResponse, Timestamp};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::{
    ClaimOutcome, Error, NewClaim, OutcomeChannel, Result, Store, TransactionalStore, TxClaim,
};

/// `inner`, watched: each [`get`](Store::get) is counted in `reads`, each
/// [`sweep`](Store::sweep) in `sweeps`; each claim that finds its key in progress is reported
/// on `in_progress_claims`, if set; the next `failing_completes` completions and
/// `failing_listens` listeners fail as an unreachable store's would.
#[derive(Clone, Debug)]
pub struct WatchedStore<S> {
    /// The store every call goes to.
    pub inner: S,
    /// How many reads were made.
    pub reads: Arc<AtomicUsize>,
    /// How many sweeps were made.
    pub sweeps: Arc<AtomicUsize>,
    /// How many of the next completions fail with [`Error::Unavailable`].
    pub failing_completes: Arc<AtomicUsize>,
    /// How many of the next [`OutcomeChannel::listen_outcomes`] fail with
    /// [`Error::Unavailable`].
    pub failing_listens: Arc<AtomicUsize>,
    /// Told once for each claim that found its key held by another request.
    pub in_progress_claims: Option<mpsc::UnboundedSender<()>>,
    /// What [`Store::claim_answers_like_a_read`] and
    /// [`TransactionalStore::begin_claim_answers_like_a_read`] say, if not what `inner` says.
    pub claims_like_reads: Option<bool>,
}

impl<S: Store> WatchedStore<S> {
    /// `inner`, watched, with nothing failing yet.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            reads: Arc::default(),
            sweeps: Arc::default(),
            failing_completes: Arc::default(),
            failing_listens: Arc::default(),
            in_progress_claims: None,
            claims_like_reads: None,
        }
    }
}

/// Takes one from `count` if it is above zero; whether it did.
fn take_one(count: &AtomicUsize) -> bool {
    count
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

/// What an unreachable store answers.
fn refused() -> Error {
    let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    Error::Unavailable(Box::new(refused))
}

impl<S: Store> Store for WatchedStore<S> {
    async fn get(&self, scope: &Scope, now: Timestamp) -> Result<Option<Record>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.get(scope, now).await
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome> {
        let outcome = self.inner.claim(claim).await;
        if let (Ok(ClaimOutcome::Existing(record)), Some(tell)) =
            (&outcome, &self.in_progress_claims)
            && matches!(record.state, RecordState::InProgress { .. })
        {
            let _ = tell.send(());
        }
        outcome
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool> {
        if take_one(&self.failing_completes) {
            return Err(refused());
        }
        self.inner.complete(scope, token, response, now).await
    }

    async fn renew(
        &self,
        scope: &Scope,
        token: FencingToken,
        lease: Duration,
        now: Timestamp,
    ) -> Result<bool> {
        self.inner.renew(scope, token, lease, now).await
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> Result<bool> {
        self.inner.release(scope, token).await
    }

    async fn sweep(&self, now: Timestamp, batch: u32) -> Result<u64> {
        self.sweeps.fetch_add(1, Ordering::SeqCst);
        self.inner.sweep(now, batch).await
    }

    fn claim_answers_like_a_read(&self) -> bool {
        self.claims_like_reads
            .unwrap_or_else(|| self.inner.claim_answers_like_a_read())
    }
}

impl<S: TransactionalStore> TransactionalStore for WatchedStore<S> {
    type Tx = S::Tx;

    fn begin_claim_answers_like_a_read(&self) -> bool {
        self.claims_like_reads
            .unwrap_or_else(|| self.inner.begin_claim_answers_like_a_read())
    }

    async fn begin_claim(&self, claim: &NewClaim, wait: Duration) -> Result<TxClaim<S::Tx>> {
        self.inner.begin_claim(claim, wait).await
    }

    async fn commit_response(
        &self,
        tx: S::Tx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<()> {
        self.inner.commit_response(tx, scope, token, response).await
    }

    async fn rollback(&self, tx: S::Tx) -> Result<()> {
        self.inner.rollback(tx).await
    }
}

impl<S: OutcomeChannel> OutcomeChannel for WatchedStore<S> {
    async fn publish_outcome(&self, label: &str) -> Result<()> {
        self.inner.publish_outcome(label).await
    }

    async fn listen_outcomes(
        &self,
        wake: Arc<dyn Fn(&str) + Send + Sync>,
    ) -> Result<JoinHandle<()>> {
        if take_one(&self.failing_listens) {
            return Err(refused());
        }
        self.inner.listen_outcomes(wake).await
    }

    fn outcome_poll(&self) -> Option<Duration> {
        self.inner.outcome_poll()
    }
}
