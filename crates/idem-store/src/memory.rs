//! [`MemoryStore`]: records in this process's memory, for tests and quickstarts.
//!
//! Always compiled, not behind a feature: it needs no I/O and no dependency beyond the crate's
//! own, so it costs a few kilobytes of code, and a feature would only add a step to the first
//! hour with idem (and a `cfg` to every test that wants a store without a database).
//!
//! Its clock is its callers', as SQLite's is: one process holds the records, so the `now` each
//! operation is given is the store's now (see [One clock](crate#one-clock-the-stores)), and a
//! test that moves an injected clock ([`idem_core::ManualClock`]) moves the store's with it.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use idem_core::{FencingToken, Record, RecordEvent, RecordState, Scope, StoredResponse, Timestamp};
use tokio::task::JoinHandle;

use crate::{
    AdminStore, ClaimOutcome, EVENTS_KEPT, EVENTS_RETENTION, NewClaim, OutcomeChannel,
    RecordFilter, Result, Store,
};

/// Records in this process's memory: lease mode ([`Store`]), outcome wake-ups
/// ([`OutcomeChannel`]) and the operators' calls ([`AdminStore`]), with the same semantics as
/// the database stores (atomic claims, leases, fencing tokens, retention, sweeps), checked by
/// the same conformance suite.
///
/// For tests, examples and quickstarts, not for production: the records live as long as the
/// process (a restart forgets every key, so a retry after it runs again), they are not shared
/// with other processes, and they take memory until the layer's sweeper deletes them. Clones
/// share the records. There is no transaction mode: the handler's writes cannot share a
/// transaction with a key kept here.
///
/// ```
/// use std::time::Duration;
/// use idem_core::*;
/// use idem_store::{ClaimOutcome, MemoryStore, NewClaim, Store};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
///
/// let scope = Scope::new(AccountId::new("acct_1"), IdempotencyKey::parse(b"order-0001", KeyLimits::default())?);
/// let fingerprint = Fingerprint::compute(&RequestParts {
///     account: "acct_1", method: "POST", route: "/orders", query: "",
///     content_type: "application/json", body: br#"{"sku":"A1"}"#,
/// })?;
/// let now = Timestamp(1_700_000_000_000);
/// let claim = NewClaim::new(scope.clone(), fingerprint, FencingToken(1), now, &Policy::default());
///
/// assert_eq!(store.claim(&claim).await?, ClaimOutcome::Claimed);
/// // A second claim of the same key finds the first one in progress.
/// assert!(matches!(store.claim(&claim).await?, ClaimOutcome::Existing(_)));
///
/// let response = StoredResponse { status: 201, headers: vec![], body: b"{}".to_vec(), body_omitted: false };
/// assert!(store.complete(&scope, FencingToken(1), &response, now).await?);
/// let record = store.get(&scope, now).await?.unwrap();
/// assert_eq!(decide(Some(&record), &fingerprint, now), Decision::Replay(&response));
///
/// // Past its retention the record is swept.
/// let later = now.plus(Policy::default().retention);
/// assert_eq!(store.sweep(later, 100).await?, 1);
/// assert_eq!(store.get(&scope, later).await?, None);
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    // A std Mutex, not a Tokio one: no await happens while it is held, and each operation is
    // one short critical section, which is what makes a claim one atomic insert-if-absent.
    records: Mutex<HashMap<Scope, Record>>,
    /// Each key's history ([`AdminStore::record_event`]), oldest first.
    events: Mutex<HashMap<Scope, Vec<RecordEvent>>>,
    /// Who hears [`OutcomeChannel::publish_outcome`], by an id that ends their subscription.
    listeners: Mutex<HashMap<u64, Wake>>,
    next_listener: AtomicU64,
}

type Wake = Arc<dyn Fn(&str) + Send + Sync>;

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.records().len())
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many records it holds, completed or in progress, expired or not.
    pub fn len(&self) -> usize {
        self.records().len()
    }

    /// Whether it holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn records(&self) -> MutexGuard<'_, HashMap<Scope, Record>> {
        lock(&self.shared.records)
    }

    /// Runs `change` on the in-progress record of `scope` held by `token` (any token if
    /// `None`); whether there was one.
    fn change_held(
        &self,
        scope: &Scope,
        token: Option<FencingToken>,
        change: impl FnOnce(&mut Record),
    ) -> bool {
        let mut records = self.records();
        match records.get_mut(scope) {
            Some(record) if holds(record, token) => {
                change(record);
                true
            }
            _ => false,
        }
    }
}

/// Takes `mutex`, whose holders never panic, so it is never poisoned; were it, the records
/// are still whole (each change is a single assignment), so they are used as they are.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether `record` is in progress under `token` (any token if `None`).
fn holds(record: &Record, token: Option<FencingToken>) -> bool {
    match record.state {
        RecordState::InProgress { token: held, .. } => token.is_none_or(|token| token == held),
        RecordState::Completed(_) => false,
    }
}

/// Whether `claim` may replace `record`: a completed record past its retention, or, if the
/// claim allows it, a claim of the same request whose lease ran out. Never an in-progress
/// record for its age alone.
fn replaceable(record: &Record, claim: &NewClaim) -> bool {
    match record.state {
        RecordState::Completed(_) => record.expires_at <= claim.now,
        RecordState::InProgress { lease_until, .. } => {
            claim.take_over_expired_lease
                && lease_until <= claim.now
                && record.fingerprint == claim.fingerprint
        }
    }
}

/// Completes `record` with `response` at `now`: its retention (as claimed) counts from then.
fn complete(record: &mut Record, response: &StoredResponse, now: Timestamp) {
    let retention = record.expires_at.0.saturating_sub(record.created_at.0);
    record.expires_at = Timestamp(now.0.saturating_add(retention));
    record.state = RecordState::Completed(response.clone());
}

impl Store for MemoryStore {
    async fn get(&self, scope: &Scope, _now: Timestamp) -> Result<Option<Record>> {
        Ok(self.records().get(scope).cloned())
    }

    async fn claim(&self, claim: &NewClaim) -> Result<ClaimOutcome> {
        let mut records = self.records();
        if let Some(record) = records.get(&claim.scope)
            && !replaceable(record, claim)
        {
            return Ok(ClaimOutcome::Existing(record.clone()));
        }
        let record = Record {
            scope: claim.scope.clone(),
            fingerprint: claim.fingerprint,
            state: RecordState::InProgress {
                lease_until: claim.lease_until,
                token: claim.token,
            },
            created_at: claim.now,
            expires_at: claim.expires_at,
        };
        records.insert(claim.scope.clone(), record);
        Ok(ClaimOutcome::Claimed)
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool> {
        Ok(self.change_held(scope, Some(token), |record| {
            complete(record, response, now);
        }))
    }

    async fn renew(
        &self,
        scope: &Scope,
        token: FencingToken,
        lease: Duration,
        now: Timestamp,
    ) -> Result<bool> {
        Ok(self.change_held(scope, Some(token), |record| {
            record.state = RecordState::InProgress {
                lease_until: now.plus(lease),
                token,
            };
        }))
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> Result<bool> {
        let mut records = self.records();
        if records
            .get(scope)
            .is_some_and(|record| holds(record, Some(token)))
        {
            records.remove(scope);
            return Ok(true);
        }
        Ok(false)
    }

    async fn sweep(&self, now: Timestamp, batch: u32) -> Result<u64> {
        let mut deleted = 0u64;
        self.records().retain(|_, record| {
            let expired =
                matches!(record.state, RecordState::Completed(_)) && record.expires_at <= now;
            if expired && deleted < u64::from(batch) {
                deleted += 1;
                return false;
            }
            true
        });
        Ok(deleted)
    }
}

/// Wakes the listeners of this store (its clones included) in the publishing call itself: they
/// are in this process, so nothing polls and nothing is queued.
impl OutcomeChannel for MemoryStore {
    async fn publish_outcome(&self, label: &str) -> Result<()> {
        // Called outside the lock, so a listener may publish or stop listening in turn.
        let listeners: Vec<Wake> = lock(&self.shared.listeners).values().cloned().collect();
        for wake in listeners {
            wake(label);
        }
        Ok(())
    }

    async fn listen_outcomes(&self, wake: Wake) -> Result<JoinHandle<()>> {
        let id = self.shared.next_listener.fetch_add(1, Ordering::Relaxed);
        lock(&self.shared.listeners).insert(id, wake);
        // Subscribed before returning. The task only holds the subscription: when it is aborted
        // (or the runtime shuts down) the guard drops and the listener is gone.
        let subscription = Subscription {
            shared: Arc::downgrade(&self.shared),
            id,
        };
        Ok(tokio::spawn(async move {
            let _subscription = subscription;
            std::future::pending::<()>().await;
        }))
    }
}

/// Ends a listener's subscription when dropped. Holds the store weakly, so a forgotten listener
/// does not keep its records alive.
struct Subscription {
    shared: Weak<Shared>,
    id: u64,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            lock(&shared.listeners).remove(&self.id);
        }
    }
}

impl AdminStore for MemoryStore {
    async fn list(&self, filter: &RecordFilter, _now: Timestamp) -> Result<Vec<Record>> {
        let mut listed: Vec<Record> = self
            .records()
            .values()
            .filter(|record| {
                let in_progress = matches!(record.state, RecordState::InProgress { .. });
                filter
                    .account
                    .as_ref()
                    .is_none_or(|account| record.scope.account == *account)
                    && filter.in_progress.is_none_or(|wanted| wanted == in_progress)
                    && filter.lease_expired_by.is_none_or(|by| {
                        matches!(record.state, RecordState::InProgress { lease_until, .. } if lease_until <= by)
                    })
            })
            .cloned()
            .collect();
        listed.sort_by_key(|record| std::cmp::Reverse(record.created_at));
        listed.truncate(usize::try_from(filter.limit()).unwrap_or(usize::MAX));
        Ok(listed)
    }

    async fn purge(&self, scope: &Scope) -> Result<bool> {
        lock(&self.shared.events).remove(scope);
        Ok(self.records().remove(scope).is_some())
    }

    async fn record_event(&self, scope: &Scope, event: &RecordEvent) -> Result<()> {
        let mut events = lock(&self.shared.events);
        // As the SQL stores do: every key's events older than the retention go, by the new
        // event's time, so the map holds at most the events of the last 30 days.
        let cutoff = event
            .at
            .0
            .saturating_sub(i64::try_from(EVENTS_RETENTION.as_millis()).unwrap_or(i64::MAX));
        events.retain(|_, kept| {
            kept.retain(|e| e.at.0 >= cutoff);
            !kept.is_empty()
        });
        let kept = events.entry(scope.clone()).or_default();
        kept.push(event.clone());
        if kept.len() > EVENTS_KEPT {
            kept.drain(..kept.len() - EVENTS_KEPT);
        }
        Ok(())
    }

    async fn events(&self, scope: &Scope) -> Result<Vec<RecordEvent>> {
        Ok(lock(&self.shared.events)
            .get(scope)
            .cloned()
            .unwrap_or_default())
    }

    async fn force_complete(
        &self,
        scope: &Scope,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<bool> {
        Ok(self.change_held(scope, None, |record| complete(record, response, now)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    /// A listener hears every label published through any clone of the store, and nothing once
    /// its task is aborted.
    #[tokio::test]
    async fn listeners_hear_every_clone_until_aborted() {
        let store = MemoryStore::new();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let listener = store
            .listen_outcomes(Arc::new(move |label: &str| {
                let _ = tx.send(label.to_owned());
            }))
            .await
            .unwrap();
        store.clone().publish_outcome("label-one").await.unwrap();
        assert_eq!(rx.try_recv().unwrap(), "label-one", "heard at once");

        listener.abort();
        let _ = listener.await;
        store.publish_outcome("label-two").await.unwrap();
        // The listener, and with it the only sender, is gone without a word.
        assert_eq!(rx.recv().await, None);
        assert!(lock(&store.shared.listeners).is_empty());
    }
}
