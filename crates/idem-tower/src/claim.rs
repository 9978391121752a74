//! [`Claim`]: what a covered request carries into the section that claims its key.

use std::sync::Arc;

use idem_core::{Clock, FencingToken, Fingerprint, Policy, Scope, Timestamp};
use idem_store::NewClaim;

/// A covered request's claim, built once by the layer after every check has passed, and
/// handed whole to the mode that makes it.
///
/// `pub` only because the sealed [`Run`](crate::mode::sealed::Run) trait names it; it is not
/// reachable from outside the crate.
#[derive(Debug, Clone)]
pub struct Claim {
    pub(crate) policy: Arc<Policy>,
    pub(crate) clock: Arc<dyn Clock>,
    /// The claim as the store takes it: scope, fingerprint, a fresh token, made at the time
    /// the layer looked at the request.
    pub(crate) new_claim: NewClaim,
}

impl Claim {
    /// A claim of `scope` for the request with `fingerprint` at `now`, with a token of its own.
    pub(crate) fn new(
        policy: Arc<Policy>,
        clock: Arc<dyn Clock>,
        scope: Scope,
        fingerprint: Fingerprint,
        now: Timestamp,
    ) -> Self {
        let new_claim = NewClaim::new(
            scope,
            fingerprint,
            FencingToken(random_token()),
            now,
            &policy,
        );
        Self {
            policy,
            clock,
            new_claim,
        }
    }

    /// The key and its account.
    pub(crate) fn scope(&self) -> &Scope {
        &self.new_claim.scope
    }

    /// The request's fingerprint.
    pub(crate) fn fingerprint(&self) -> &Fingerprint {
        &self.new_claim.fingerprint
    }

    /// The token this claim holds.
    pub(crate) fn token(&self) -> FencingToken {
        self.new_claim.token
    }

    /// Dates the claim to `now`, keeping its scope, token and takeover rule: lease mode claims
    /// again after each wait, and its lease and retention must run from that attempt.
    pub(crate) fn restamp(&mut self, now: Timestamp) {
        let take_over = self.new_claim.take_over_expired_lease;
        let scope = self.new_claim.scope.clone();
        self.new_claim = NewClaim {
            take_over_expired_lease: take_over,
            ..NewClaim::new(
                scope,
                self.new_claim.fingerprint,
                self.new_claim.token,
                now,
                &self.policy,
            )
        };
    }
}

fn random_token() -> i64 {
    // Tokens only need to be unique per claim; 63 random bits make a collision negligible.
    let bytes = uuid::Uuid::new_v4().into_bytes();
    i64::from_be_bytes(bytes[..8].try_into().expect("8 bytes")) & i64::MAX
}
