//! Scope: keys belong to an account, never to the world.

use std::fmt;

use crate::IdempotencyKey;

/// The authenticated account a request acts for. It comes from authentication, never from the
/// request body.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AccountId(String);

impl AccountId {
    /// Wraps an account identifier chosen by the service's authentication.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The identifier.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AccountId({:?})", self.0)
    }
}

impl fmt::Display for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The lookup key of a record: (account, key). The same key from two accounts names two
/// unrelated records.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    /// Whose key it is.
    pub account: AccountId,
    /// The client's key.
    pub key: IdempotencyKey,
}

impl Scope {
    /// Scopes `key` to `account`.
    pub fn new(account: AccountId, key: IdempotencyKey) -> Self {
        Self { account, key }
    }

    /// A short, non-reversible label for logs: the first 12 hex digits of SHA-256 over the
    /// scope, so logs can correlate requests without holding keys.
    pub fn log_label(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        hash.update(self.account.as_str().as_bytes());
        hash.update([0]);
        hash.update(self.key.as_str().as_bytes());
        hex::encode(&hash.finalize()[..6])
    }
}

/// The key to pass to a downstream service (a payment provider, an upstream API) for the work
/// of one request, so that the downstream can dedupe too (docs/contract.md §3.2).
///
/// Derived from the scope and the request's fingerprint: the same for every retry and every
/// takeover of the request, so a downstream that dedupes by it acts once; different for
/// another account's request, and for a different request that reuses the key after its
/// retention, so that one is never answered with the other's effect. Not the client's key
/// itself, which the downstream would then share among all of a service's accounts.
///
/// ```
/// use idem_core::*;
/// let scope = Scope::new(AccountId::new("acct_1"), IdempotencyKey::new("order-0001", KeyLimits::default())?);
/// let fingerprint = |body: &[u8]| Fingerprint::compute(&RequestParts {
///     account: "acct_1", method: "POST", route: "/payouts", query: "",
///     content_type: "application/json", body,
/// });
/// let first = DownstreamKey::new(&scope, &fingerprint(br#"{"amount":100}"#)?);
/// assert_eq!(first, DownstreamKey::new(&scope, &fingerprint(br#"{ "amount": 100 }"#)?));
/// assert_ne!(first, DownstreamKey::new(&scope, &fingerprint(br#"{"amount":200}"#)?));
/// assert!(first.as_str().starts_with("idem-"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DownstreamKey(String);

impl DownstreamKey {
    /// The downstream key of the request with `fingerprint` under `scope`.
    pub fn new(scope: &Scope, fingerprint: &crate::Fingerprint) -> Self {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        hash.update(b"idem-downstream\0");
        hash.update(scope.account.as_str().as_bytes());
        hash.update([0]);
        hash.update(scope.key.as_str().as_bytes());
        hash.update([0]);
        hash.update(fingerprint.as_bytes());
        Self(format!("idem-{}", hex::encode(&hash.finalize()[..20])))
    }

    /// The downstream key of the request that claimed `record`: what a reconciler asks the
    /// downstream about.
    pub fn of(record: &crate::Record) -> Self {
        Self::new(&record.scope, &record.fingerprint)
    }

    /// The key, 45 characters of visible ASCII (`idem-` and 40 hex digits).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DownstreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
