//! The state of one small world: the store, two instances, the clients, the downstream system,
//! the reconciler, the clock, and the ghost variables the properties read.
//!
//! Everything is a few bytes: the checker keeps millions of these.

/// Whole seconds on the store's clock, the model's one clock.
pub type Secs = u8;

/// A response a client can be given for good: what the work produced, and for which request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resp {
    /// Lease mode: the downstream's charge with this number (the first charge is 1).
    Charge {
        /// Its number.
        n: u8,
        /// The request it was made for: the class of equal fingerprints (ghost).
        class: u8,
    },
    /// Transaction mode: the business row with this number, committed with the key.
    Row {
        /// Its number.
        n: u8,
        /// The request it was made for (ghost).
        class: u8,
    },
}

impl Resp {
    /// The request it was made for.
    pub fn class(self) -> u8 {
        match self {
            Resp::Charge { class, .. } | Resp::Row { class, .. } => class,
        }
    }
}

/// Where the key's record stands (`idem_core::RecordState`, with seconds and small tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecState {
    /// Claimed, outcome not stored.
    InProgress {
        /// Until when the claim holds without renewal.
        lease_until: Secs,
        /// The claim's fencing token.
        token: u8,
    },
    /// Finished: replays return this.
    Completed(Resp),
}

/// The key's record: one row of the store's atomic map (the model has one key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rec {
    /// The body of the request that claimed the key (an index into [`crate::BODIES`]); its
    /// fingerprint is what `decide` compares.
    pub body: u8,
    /// Where it stands.
    pub state: RecState,
    /// When it was claimed.
    pub created: Secs,
    /// When its retention ends.
    pub expires: Secs,
}

/// One request being handled: which client sent it, and which of its attempts it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Req {
    /// The client.
    pub client: u8,
    /// The client's attempt number (its answer is dropped if the client moved on).
    pub attempt: u8,
}

/// A lease-mode claim an instance holds (or held: the store may have moved on).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Held {
    /// The request.
    pub req: Req,
    /// The claim's fencing token.
    pub token: u8,
    /// The epoch of the key when it was claimed (the tag of the answer).
    pub epoch: u8,
    /// When the lease was last renewed (or claimed): a live instance renews before `lease`
    /// has passed since then, unless it stalls.
    pub last_renew: Secs,
    /// The instance stalled (a pause fault): its renewals no longer come in time.
    pub slow: bool,
}

/// The downstream call an instance waits on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Call {
    /// Sent; nothing back yet.
    Pending {
        /// The caller's timeout: the call gives up then.
        deadline: Secs,
    },
    /// The downstream acted but its answer was lost: the caller times out.
    Lost {
        /// The caller's timeout.
        deadline: Secs,
    },
}

/// What the work's response says to do with the record (`idem_tower::Outcome`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Complete the record with this response.
    Store(Resp),
    /// Nothing happened: free the key.
    Release,
    /// It may have happened: keep the record in progress.
    Unknown,
}

/// Where one instance is in handling a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Waiting for a request.
    Idle,
    /// The replay read (`Store::get`) is next.
    Read(Req),
    /// Lease mode: the claim is next.
    Claim(Req),
    /// Mutant `claim-read-then-write`: the claim read a free key; its write is next.
    ClaimWrite(Req),
    /// Lease mode: claimed; the downstream call is next.
    Claimed(Held),
    /// Lease mode: the downstream call runs (the lease is renewed meanwhile).
    Calling(Held, Call),
    /// Lease mode: the work returned; its outcome is stored next.
    Returned(Held, Outcome),
    /// Transaction mode: `begin_claim` is next (it waits while another transaction holds the
    /// key).
    TxBegin(Req),
    /// Transaction mode: the key is claimed inside an open transaction.
    InTx {
        /// The request.
        req: Req,
        /// When it claimed (the record's `created_at`).
        at: Secs,
        /// It replaces a completed record past its retention.
        replaces: bool,
    },
}

/// The background task that keeps trying to store a completed outcome the store refused
/// (`store_outcome_later`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Retry {
    /// The claim's token.
    pub token: u8,
    /// The outcome to store.
    pub resp: Resp,
    /// When it gives up (a lease after the first try).
    pub give_up: Secs,
}

/// One idem instance: the request it handles and its background retry, both lost when it
/// crashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Inst {
    /// The request in hand.
    pub phase: Phase,
    /// A completion being retried.
    pub retry: Option<Retry>,
}

/// A client's final answer: it stops sending.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Final {
    /// A stored response (fresh or replayed), given in `epoch`.
    Stored {
        /// The response.
        resp: Resp,
        /// The key's epoch when it was produced or read.
        epoch: u8,
    },
    /// `422`: the key belongs to a different request.
    Mismatch,
}

/// A client with one intent and one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Client {
    /// Attempts sent so far.
    pub sent: u8,
    /// The attempt it waits on (an earlier one's answer is dropped: it timed out).
    pub waiting: Option<u8>,
    /// Its final answer.
    pub answer: Option<Final>,
}

/// The reconciler's pass over stale records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Recon {
    /// Between passes.
    Idle,
    /// Listed a stale in-progress record (`AdminStore::list`); asks the downstream next.
    Listed {
        /// The stale claim's token.
        token: u8,
    },
    /// The downstream answered the lookup by key; the record is resolved next.
    Looked {
        /// The stale claim's token.
        token: u8,
        /// The charge the downstream holds for the key (`None`: its `404`).
        charge: Option<Resp>,
    },
}

/// A call its caller no longer waits on, which the downstream may still act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Orphan {
    /// The caller's timeout (a non-deduping downstream never acts after it).
    pub deadline: Secs,
    /// The request it was made for.
    pub class: u8,
}

/// The whole world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct World {
    /// The store's clock.
    pub now: Secs,
    /// The key's record.
    pub record: Option<Rec>,
    /// Transaction mode: the instance whose open transaction holds the key's row.
    pub tx_lock: Option<u8>,
    /// Claims made so far; the newest claim's token is this number. (Real tokens are random;
    /// the store only compares them for equality. The order is for the fencing property.)
    pub tokens: u8,
    /// The two instances.
    pub instances: [Inst; 2],
    /// The clients (those past the configuration's count never act).
    pub clients: [Client; 3],
    /// Calls sent by instances that then crashed or gave up, not yet acted on, sorted
    /// (`None` last).
    pub orphans: [Option<Orphan>; 2],
    /// The downstream: the charge made under the key (a deduping one's only charge, else
    /// the latest), what a lookup by key answers.
    pub charge: Option<Resp>,
    /// Effects made in all (charges or committed rows): the next one's number is this plus one.
    pub made: u8,
    /// The reconciler.
    pub recon: Recon,
    /// Faults left to inject.
    pub faults: u8,
    /// Ghost: bumped when a completed record's retention ends and the key is new again.
    pub epoch: u8,
    /// Ghost: downstream effects (or committed rows) in this epoch.
    pub effects: u8,
    /// Ghost: a complete, renew or release succeeded with a token older than the newest claim.
    pub fence_broken: bool,
}

impl World {
    /// The instances whose request is in a lease-mode section: claimed, outcome not stored.
    pub fn held(&self, i: usize) -> Option<&Held> {
        match &self.instances[i].phase {
            Phase::Claimed(h) | Phase::Calling(h, _) | Phase::Returned(h, _) => Some(h),
            _ => None,
        }
    }

    /// Whether the record is in progress under `token`.
    pub fn holds(&self, token: u8) -> bool {
        matches!(
            self.record,
            Some(Rec { state: RecState::InProgress { token: t, .. }, .. }) if t == token
        )
    }

    /// Adds a call that nobody waits on any more.
    pub fn add_orphan(&mut self, orphan: Orphan) {
        let slot = self
            .orphans
            .iter_mut()
            .find(|o| o.is_none())
            .expect("no more orphaned calls than the fault budget allows");
        *slot = Some(orphan);
        self.sort_orphans();
    }

    /// Removes the orphaned call at `k`.
    pub fn remove_orphan(&mut self, k: usize) {
        self.orphans[k] = None;
        self.sort_orphans();
    }

    /// One order for the same calls, so equal worlds are one state.
    fn sort_orphans(&mut self) {
        self.orphans.sort_by_key(|o| (o.is_none(), *o));
    }

    /// The representative of the worlds that differ only in which instance is which: the two
    /// instances run the same code, so the checker need visit only one of each pair.
    pub fn canonical(&self) -> World {
        let mut w = *self;
        if w.instances[1] < w.instances[0] {
            w.instances.swap(0, 1);
            w.tx_lock = w.tx_lock.map(|i| 1 - i);
        }
        w
    }

    /// The key is new again: a completed record's retention ended.
    pub fn new_epoch(&mut self) {
        self.epoch += 1;
        self.effects = 0;
    }
}
