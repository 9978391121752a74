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
