//! Known bugs the checker must find when they are planted.

use std::fmt;
use std::str::FromStr;

/// A planted bug. Each is a past or known bug of idem (or of the class every idempotency
/// layer must avoid), changed in one place of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// Claims and renewals hold the key for the lease alone, not `Policy::lease_hold` (lease
    /// plus downstream timeout): the reconciler sees a crashed worker's record as stale and
    /// releases it on the downstream's `404` while the call it made may still land. The bug
    /// that `lease_hold` fixed: two charges for one intent.
    Reconciler404Early,
    /// The store's claim reads the record, then writes the claim in a second step, instead of
    /// one atomic insert-if-absent: two claims both see a free key.
    ClaimReadThenWrite,
    /// `complete` does not check the fencing token: an old holder overwrites its successor.
    CompleteWithoutFence,
    /// A record whose outcome is unknown and whose lease ran out is claimed afresh even without
    /// takeover: the work runs again though it may have happened (the behaviour before
    /// `without_takeover`).
    UnknownExpiresToFresh,
    /// An in-progress record past its retention is `Decision::Expired`, so it is claimed
    /// afresh or swept while its outcome is unknown. (`idem_core::decide` did this until the
    /// fix that lets only a completed record expire.)
    InProgressExpires,
}

impl Mutant {
    /// Every mutant.
    pub const ALL: [Mutant; 5] = [
        Mutant::Reconciler404Early,
        Mutant::ClaimReadThenWrite,
        Mutant::CompleteWithoutFence,
        Mutant::UnknownExpiresToFresh,
        Mutant::InProgressExpires,
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mutant::Reconciler404Early => "reconciler-404-early",
            Mutant::ClaimReadThenWrite => "claim-read-then-write",
            Mutant::CompleteWithoutFence => "complete-without-fence",
            Mutant::UnknownExpiresToFresh => "unknown-expires-to-fresh",
            Mutant::InProgressExpires => "in-progress-expires",
        }
    }

    /// What it plants, in one line.
    pub fn summary(self) -> &'static str {
        match self {
            Mutant::Reconciler404Early => {
                "claims and renewals hold the key for the lease without the downstream timeout, so the reconciler trusts a 404 before the old call's deadline"
            }
            Mutant::ClaimReadThenWrite => {
                "the claim is a read and then a write, not one atomic insert-if-absent"
            }
            Mutant::CompleteWithoutFence => "complete stores an outcome whatever the token",
            Mutant::UnknownExpiresToFresh => {
                "an unknown outcome whose lease ran out is claimed afresh, takeover or not"
            }
            Mutant::InProgressExpires => {
                "an in-progress record past its retention counts as expired (claimed afresh, swept)"
            }
        }
    }

    /// The configurations where it should be caught (any one catching it is enough).
    pub fn configs(self) -> &'static [&'static str] {
        match self {
            Mutant::Reconciler404Early => &["lease-reconciler"],
            Mutant::ClaimReadThenWrite => &["lease-reconciler"],
            Mutant::CompleteWithoutFence => &["lease-takeover-dedupe"],
            Mutant::UnknownExpiresToFresh => &["lease-reconciler"],
            Mutant::InProgressExpires => &["lease-reconciler"],
        }
    }
}

impl fmt::Display for Mutant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is no mutant's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownMutant(pub String);

impl fmt::Display for UnknownMutant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> = Mutant::ALL.iter().map(|m| m.name()).collect();
        write!(
            f,
            "no mutant is called {:?} (there are: {})",
            self.0,
            names.join(", ")
        )
    }
}

impl std::error::Error for UnknownMutant {}

impl FromStr for Mutant {
    type Err = UnknownMutant;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mutant::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| UnknownMutant(s.to_owned()))
    }
}
