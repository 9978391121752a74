//! idem's protocol as a stateright [`Model`]: every step of every part of the world, and the
//! properties checked over all of their interleavings.

use idem_core::{
    AccountId, Decision, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Policy, Record,
    RecordState, RequestParts, Scope, StoredResponse, Timestamp,
};
use stateright::{Model, Property};

use crate::config::{BODIES, Config, Downstream, Mode};
use crate::mutant::Mutant;
use crate::world::{
    Call, Client, Final, Held, Inst, Orphan, Outcome, Phase, Rec, RecState, Recon, Req, Resp,
    Retry, Secs, World,
};

/// What [`idem_core::decide`] answered, without the response it borrows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dec {
    /// No record.
    Fresh,
    /// Past its retention.
    Expired,
    /// A stored response for the same request.
    Replay,
    /// Another request's record.
    Mismatch,
    /// Held by a live lease.
    InFlight,
    /// In progress, its lease ran out.
    LeaseExpired,
}

/// One step of one part of the world. Instances and clients are numbered from 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The store's clock advances a second.
    Tick,
    /// A client sends an attempt to an instance (giving up on its earlier attempt, if any:
    /// its answer is lost to it).
    Send {
        /// The client.
        client: u8,
        /// The instance.
        instance: u8,
    },
    /// An instance reads the record before claiming (`Store::get`), and answers a replay or
    /// a mismatch from it.
    Read(u8),
    /// An instance claims the key (`Store::claim`, one atomic step).
    Claim(u8),
    /// Fault: the claim is made but its answer is lost; the client gets `503`.
    ClaimLost(u8),
    /// Mutant `claim-read-then-write`: the second half of the claim.
    ClaimWrite(u8),
    /// An instance's work calls the downstream with the key.
    Call(u8),
    /// An instance renews its lease (`Store::renew`) while the call runs.
    Renew(u8),
    /// Fault: an instance stalls; its renewals stop coming in time.
    Stall(u8),
    /// The downstream acts on an instance's call and answers.
    Answer(u8),
    /// Fault: the downstream acts on the call; its answer is lost.
    AnswerLost(u8),
    /// Fault: the downstream answers `5xx` without acting.
    Fail(u8),
    /// Fault: the connection is refused; nothing was sent.
    Refuse(u8),
    /// An instance's call reaches its timeout.
    Timeout(u8),
    /// An instance stores its work's outcome (complete, release, or end the lease of an
    /// unknown outcome) and answers its client.
    Store(u8),
    /// Fault: the store refuses the completion; the client still gets the answer, and a
    /// background task retries.
    StoreFails(u8),
    /// The background task stores the outcome.
    RetryStore(u8),
    /// The background task gives up (its lease has passed).
    RetryGiveUp(u8),
    /// The downstream acts on a call whose caller crashed or gave up.
    Orphan(u8),
    /// Fault: an instance crashes (and restarts at once, empty).
    Crash(u8),
    /// Transaction mode: an instance opens a transaction and claims the key in it.
    TxBegin(u8),
    /// Transaction mode: the wait for another transaction on the key runs out: `409`.
    TxBusy(u8),
    /// Transaction mode: the business row and the response commit with the key.
    TxCommit(u8),
    /// Fault: the handler fails or the commit does: the transaction rolls back.
    TxRollback(u8),
    /// The sweeper deletes the record past its retention (`Store::sweep`).
    Sweep,
    /// The reconciler lists a stale in-progress record (`AdminStore::list`).
    ReconList,
    /// The reconciler asks the downstream by key what happened.
    ReconLookup,
    /// Fault: the downstream cannot be asked; the record stays as it is.
    ReconLookupFails,
    /// The reconciler completes the record with the downstream's charge, or releases it on
    /// its `404`.
    ReconResolve,
}

/// What an instance answers a client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reply {
    /// A final answer.
    Final(Final),
    /// An answer the client retries on (`409`, `502`, `503`, `504`).
    Retry,
}

/// The model of one configuration, optionally with a planted bug.
#[derive(Debug, Clone)]
pub struct IdemModel {
    /// The small world.
    pub config: Config,
    /// The planted bug.
    pub mutant: Option<Mutant>,
    policy: Policy,
    scope: Scope,
    fingerprints: [Fingerprint; 3],
    /// For each body, the first body with an equal fingerprint: which request it is.
    classes: [u8; 3],
}

/// The model's seconds as the core's milliseconds.
pub fn ts(s: Secs) -> Timestamp {
    Timestamp(i64::from(s) * 1000)
}

/// The core's milliseconds as the model's seconds (every time the model makes is whole).
fn secs(t: Timestamp) -> Secs {
    assert_eq!(t.0 % 1000, 0, "the model's times are whole seconds");
    Secs::try_from(t.0 / 1000).expect("the model's times fit a byte")
}

impl IdemModel {
    /// The model of `config`, with `mutant` planted.
    pub fn new(config: Config, mutant: Option<Mutant>) -> Self {
        let account = "acct_model";
        let fingerprints = BODIES.map(|body| {
            Fingerprint::compute(&RequestParts {
                account,
                method: "POST",
                route: "/payouts",
                query: "",
                content_type: "application/json",
                body: body.as_bytes(),
            })
            .expect("the model's bodies are valid JSON")
        });
        let key = IdempotencyKey::new("payout-0001", KeyLimits::default()).expect("a valid key");
        // Two bodies are one request when their fingerprints are equal: idem-core decides.
        let classes = std::array::from_fn(|b| {
            fingerprints
                .iter()
                .position(|f| *f == fingerprints[b])
                .expect("a body's own fingerprint") as u8
        });
        Self {
            classes,
            policy: config.policy(),
            config,
            mutant,
            scope: Scope::new(AccountId::new(account), key),
            fingerprints,
        }
    }

    fn mutant(&self, m: Mutant) -> bool {
        self.mutant == Some(m)
    }

    /// The fingerprint of body `b`.
    pub fn fingerprint(&self, b: u8) -> &Fingerprint {
        &self.fingerprints[usize::from(b)]
    }

    /// The body client `c` sends.
    pub fn body_of(&self, c: u8) -> u8 {
        self.config.clients[usize::from(c)].body
    }

    /// Which request body `b` is: bodies with equal fingerprints are one request.
    pub fn class(&self, b: u8) -> u8 {
        self.classes[usize::from(b)]
    }

    /// Which request client `c` sends.
    fn class_of(&self, c: u8) -> u8 {
        self.class(self.body_of(c))
    }

    fn clients(&self) -> usize {
        self.config.clients.len()
    }

    // ---- The policy's timing rules, from idem-core ----

    /// Until when a claim or renewal at `now` holds the key: `Policy::lease_hold` past it.
    pub fn hold_until(&self, now: Secs) -> Secs {
        let hold = if self.mutant(Mutant::Reconciler404Early) {
            self.policy.lease
        } else {
            self.policy.lease_hold()
        };
        secs(ts(now).plus(hold))
    }

    /// When a record claimed at `now` expires: `Policy::retention` past it.
    fn expires_at(&self, now: Secs) -> Secs {
        secs(ts(now).plus(self.policy.retention))
    }

    /// When a call sent at `now` times out: `Policy::downstream_timeout` past it.
    fn deadline(&self, now: Secs) -> Secs {
        secs(ts(now).plus(self.policy.downstream_timeout))
    }

    /// By when a live instance that renewed at `last` renews again. The layer renews every
    /// `lease / 3`; the model lets it be as late as a whole lease, which only makes the
    /// reconciler's and the takeover's view of a crashed holder's lease earlier.
    fn renew_by(&self, last: Secs) -> Secs {
        secs(ts(last).plus(self.policy.lease))
    }

    /// When the background retry of a completion gives up: a lease after it starts.
    fn give_up(&self, now: Secs) -> Secs {
        secs(ts(now).plus(self.policy.lease))
    }

    // ---- The one decision, from idem-core ----

    /// The core record the model's record stands for.
    fn core_record(&self, rec: &Rec) -> Record {
        Record {
            scope: self.scope.clone(),
            fingerprint: *self.fingerprint(rec.body),
            state: match rec.state {
                RecState::InProgress { lease_until, token } => RecordState::InProgress {
                    lease_until: ts(lease_until),
                    token: FencingToken(token.into()),
                },
                RecState::Completed(resp) => RecordState::Completed(stored(resp)),
            },
            created_at: ts(rec.created),
            expires_at: ts(rec.expires),
        }
    }

    /// `idem_core::decide` for a request with body `body` at `now`.
    pub fn decide(&self, rec: Option<&Rec>, body: u8, now: Secs) -> Dec {
        let record = rec.map(|r| self.core_record(r));
        let dec = match idem_core::decide(record.as_ref(), self.fingerprint(body), ts(now)) {
            Decision::Fresh => Dec::Fresh,
            Decision::Expired => Dec::Expired,
            Decision::Replay(_) => Dec::Replay,
            Decision::Mismatch => Dec::Mismatch,
            Decision::InFlight { .. } => Dec::InFlight,
            Decision::LeaseExpired { .. } => Dec::LeaseExpired,
        };
        if self.mutant(Mutant::InProgressExpires)
            && let Some(Rec {
                state: RecState::InProgress { lease_until, .. },
                expires,
                ..
            }) = rec
            && *lease_until <= now
            && *expires <= now
        {
            return Dec::Expired;
        }
        dec
    }

    /// Whether the store's claim replaces a record of which `decide` said `dec`: what the
    /// conformance suite pins every backend's claim statement to.
    fn claimable(&self, dec: Dec) -> bool {
        match dec {
            Dec::Fresh | Dec::Expired => true,
            Dec::LeaseExpired => {
                self.config.takeover() || self.mutant(Mutant::UnknownExpiresToFresh)
            }
            Dec::Replay | Dec::Mismatch | Dec::InFlight => false,
        }
    }

    // ---- The store: one atomic map, the operations of `idem_store::Store` ----

    /// `Store::claim`: one atomic insert-if-absent that replaces a record past its retention
    /// and, with takeover, a stale claim of the same request. The claim's token, or what
    /// `decide` said of the record that keeps the key.
    fn claim(&self, w: &mut World, body: u8) -> Result<u8, Dec> {
        let dec = self.decide(w.record.as_ref(), body, w.now);
        if !self.claimable(dec) {
            return Err(dec);
        }
        Ok(self.write_claim(w, body))
    }

    /// Writes a new claim over whatever the record is.
    fn write_claim(&self, w: &mut World, body: u8) -> u8 {
        if let Some(rec) = &w.record
            && matches!(rec.state, RecState::Completed(_))
            && self.decide(Some(rec), rec.body, w.now) == Dec::Expired
        {
            w.new_epoch();
        }
        w.tokens += 1;
        w.record = Some(Rec {
            body,
            state: RecState::InProgress {
                lease_until: self.hold_until(w.now),
                token: w.tokens,
            },
            created: w.now,
            expires: self.expires_at(w.now),
        });
        w.tokens
    }

    /// A write by the holder of `token` succeeded: the fencing property's ghost.
    fn fenced(w: &mut World, token: u8) {
        if token != w.tokens {
            w.fence_broken = true;
        }
    }

    /// `Store::complete`: stores `resp` if the claim holding `token` still holds the key.
    fn complete(&self, w: &mut World, token: u8, resp: Resp) -> bool {
        let fence = !self.mutant(Mutant::CompleteWithoutFence);
        let Some(rec) = &mut w.record else {
            return false;
        };
        match rec.state {
            RecState::InProgress { token: t, .. } if t == token || !fence => {
                rec.state = RecState::Completed(resp);
                Self::fenced(w, token);
                true
            }
            _ => false,
        }
    }

    /// `Store::renew`: moves the lease of the claim holding `token`.
    fn renew(w: &mut World, token: u8, until: Secs) -> bool {
        let Some(rec) = &mut w.record else {
            return false;
        };
        match &mut rec.state {
            RecState::InProgress {
                token: t,
                lease_until,
            } if *t == token => {
                *lease_until = until;
                Self::fenced(w, token);
                true
            }
            _ => false,
        }
    }

    /// `Store::release`: deletes the in-progress record of the claim holding `token`.
    fn release(w: &mut World, token: u8) -> bool {
        if w.holds(token) {
            w.record = None;
            Self::fenced(w, token);
            true
        } else {
            false
        }
    }

    /// Whether `Store::sweep` deletes the record: past its retention and not held by a live
    /// lease, which is exactly what `decide` calls expired.
    fn sweepable(&self, w: &World) -> bool {
        w.tx_lock.is_none()
            && w.record
                .as_ref()
                .is_some_and(|r| self.decide(Some(r), r.body, w.now) == Dec::Expired)
    }

    // ---- The downstream ----

    /// Whether the downstream may still act on a call whose caller times out at `deadline`.
    fn may_act(&self, w: &World, deadline: Secs) -> bool {
        self.config.downstream == Downstream::Dedupe || w.now < deadline
    }

    /// A call nobody waits on any more, which the downstream may still act on. A deduping
    /// downstream acts on the first of a request's calls only (the rest find its charge),
    /// whenever it likes: one slot stands for a request's calls, and none once the key is
    /// charged.
    fn orphan(&self, w: &mut World, deadline: Secs, class: u8) {
        match self.config.downstream {
            Downstream::Dedupe => {
                let known = w.orphans.iter().flatten().any(|o| o.class == class);
                if w.charge.is_none() && !known {
                    w.add_orphan(Orphan { deadline: 0, class });
                }
            }
            Downstream::NoDedupe => w.add_orphan(Orphan { deadline, class }),
        }
    }

    /// The downstream acts on a call with the key for request `class`: the charge it answers,
    /// or `None` for a deduping downstream's `422` (the key's charge is another request's).
    fn act(&self, w: &mut World, class: u8) -> Option<Resp> {
        if self.config.downstream == Downstream::Dedupe {
            if let Some(charge) = w.charge {
                return (charge.class() == class).then_some(charge);
            }
            // Its first charge: calls still in flight will only find it.
            w.orphans = [None; 2];
        }
        w.made += 1;
        w.effects += 1;
        let charge = Resp::Charge { n: w.made, class };
        w.charge = Some(charge);
        Some(charge)
    }

    // ---- Instances and clients ----

    /// The phase a request starts its claim in.
    fn claim_phase(&self, req: Req) -> Phase {
        match self.config.mode {
            Mode::Transaction => Phase::TxBegin(req),
            Mode::Lease { .. } => Phase::Claim(req),
        }
    }

    /// The answer to a request whose key a record keeps.
    fn settle(w: &World, dec: Dec) -> Reply {
        match (dec, w.record) {
            (
                Dec::Replay,
                Some(Rec {
                    state: RecState::Completed(resp),
                    ..
                }),
            ) => Reply::Final(Final::Stored {
                resp,
                epoch: w.epoch,
            }),
            (Dec::Mismatch, _) => Reply::Final(Final::Mismatch),
            // In flight, unknown: 409; anything else here is the store's error: 503.
            _ => Reply::Retry,
        }
    }

    /// Hands `answer` to the client of `req`, unless it stopped waiting for that attempt.
    fn deliver(w: &mut World, req: Req, answer: Reply) {
        let client = &mut w.clients[usize::from(req.client)];
        if client.waiting != Some(req.attempt) {
            return;
        }
        client.waiting = None;
        if let Reply::Final(f) = answer {
            client.answer = Some(f);
        }
    }

    /// Whether faults may still happen.
    fn may_fault(&self, w: &World) -> bool {
        w.faults > 0 && w.now < self.config.active_until
    }

    /// Whether something is still waiting on the clock: a live lease, or a call before its
    /// timeout.
    pub fn pending(&self, w: &World) -> bool {
        let lease = matches!(
            w.record,
            Some(Rec { state: RecState::InProgress { lease_until, .. }, .. }) if lease_until > w.now
        );
        let call = w.instances.iter().any(|inst| {
            matches!(
                inst.phase,
                Phase::Calling(_, Call::Pending { deadline } | Call::Lost { deadline })
                    if deadline > w.now
            )
        });
        lease || call
    }

    /// Whether the clock may advance: within the horizon, while anything is active or
    /// pending, and only as far as every instance lets it.
    fn may_tick(&self, w: &World) -> bool {
        if w.now >= self.config.horizon {
            return false;
        }
        if w.now >= self.config.active_until && !self.pending(w) {
            return false;
        }
        (0..2).all(|i| self.lets_time_pass(w, i))
    }

    /// Whether instance `i` lets the clock advance a second. A live instance's own steps (its
    /// store round trips, its handler's code) take no time; only its downstream call does, up
    /// to the call's timeout, and meanwhile it renews its lease before a lease has passed.
    /// Only a stall (a fault) lets time pass under it otherwise.
    fn lets_time_pass(&self, w: &World, i: usize) -> bool {
        // A stall lasts while faults happen; once they stop, the instance has resumed.
        let stalled = |h: Held| h.slow && w.now < self.config.active_until;
        match w.instances[i].phase {
            Phase::Idle => true,
            Phase::Calling(h, call) => {
                let (Call::Pending { deadline } | Call::Lost { deadline }) = call;
                stalled(h)
                    || (w.now < deadline
                        && (!w.holds(h.token) || w.now < self.renew_by(h.last_renew)))
            }
            Phase::Claimed(h) | Phase::Returned(h, _) => stalled(h),
            Phase::Read(_)
            | Phase::Claim(_)
            | Phase::ClaimWrite(_)
            | Phase::TxBegin(_)
            | Phase::InTx { .. } => false,
        }
    }

    fn instance_actions(&self, w: &World, i: usize, out: &mut Vec<Action>) {
        let n = i as u8;
        let inst = &w.instances[i];
        let fault = self.may_fault(w);
        match inst.phase {
            Phase::Idle => {}
            Phase::Read(_) => out.push(Action::Read(n)),
            Phase::Claim(req) => {
                out.push(Action::Claim(n));
                let dec = self.decide(w.record.as_ref(), self.body_of(req.client), w.now);
                if fault && !self.mutant(Mutant::ClaimReadThenWrite) && self.claimable(dec) {
                    out.push(Action::ClaimLost(n));
                }
            }
            Phase::ClaimWrite(_) => out.push(Action::ClaimWrite(n)),
            Phase::Claimed(_) => out.push(Action::Call(n)),
            Phase::Calling(h, call) => {
                if let Call::Pending { deadline } = call {
                    if self.may_act(w, deadline) {
                        out.push(Action::Answer(n));
                        if fault {
                            out.push(Action::AnswerLost(n));
                        }
                    }
                    if fault {
                        out.push(Action::Fail(n));
                        out.push(Action::Refuse(n));
                    }
                }
                let (Call::Pending { deadline } | Call::Lost { deadline }) = call;
                if w.now >= deadline {
                    out.push(Action::Timeout(n));
                }
                // Renewals come when due (the latest a live instance makes them, which makes
                // a crashed holder's lease run out soonest), and a stalled one's later.
                if w.holds(h.token) && w.now >= self.renew_by(h.last_renew) {
                    out.push(Action::Renew(n));
                }
            }
            Phase::Returned(_, outcome) => {
                out.push(Action::Store(n));
                if fault && matches!(outcome, Outcome::Store(_)) && inst.retry.is_none() {
                    out.push(Action::StoreFails(n));
                }
            }
            Phase::TxBegin(_) => match w.tx_lock {
                None => out.push(Action::TxBegin(n)),
                Some(other) if usize::from(other) != i => out.push(Action::TxBusy(n)),
                Some(_) => unreachable!("an instance waits on its own transaction"),
            },
            Phase::InTx { .. } => {
                out.push(Action::TxCommit(n));
                if fault {
                    out.push(Action::TxRollback(n));
                }
            }
        }
        if fault
            && self.config.faults.stalls
            && let Some(h) = w.held(i)
            && !h.slow
        {
            out.push(Action::Stall(n));
        }
        if let Some(retry) = inst.retry {
            if w.now < retry.give_up {
                out.push(Action::RetryStore(n));
            } else {
                out.push(Action::RetryGiveUp(n));
            }
        }
        if fault && (inst.phase != Phase::Idle || inst.retry.is_some()) {
            out.push(Action::Crash(n));
        }
    }

    /// Whether the run is over: time has passed every bound, faults and clients have stopped,
    /// and nothing can move. The end-of-run properties look only here.
    pub fn is_end(&self, w: &World) -> bool {
        // While clients and faults are active the clock runs on, unless something holds it.
        if w.now < self.config.active_until && self.may_tick(w) {
            return false;
        }
        let mut actions = Vec::new();
        self.actions(w, &mut actions);
        actions.is_empty()
    }

    /// Whether the record, at the end of a run, is not stuck: absent, completed, held by a
    /// live lease, or (with takeover) claimable by the next copy of its request.
    pub fn nothing_stuck(&self, w: &World) -> bool {
        match w.record {
            None
            | Some(Rec {
                state: RecState::Completed(_),
                ..
            }) => true,
            Some(Rec {
                state: RecState::InProgress { lease_until, .. },
                ..
            }) => lease_until > w.now || self.config.takeover(),
        }
    }

    /// Whether, at the end of a run, every client has its answer, or would get one from one
    /// more copy of its request (replayed, refused as a mismatch, or run on a free key).
    pub fn all_answered(&self, w: &World) -> bool {
        (0..self.clients()).all(|c| {
            let client = &w.clients[c];
            client.answer.is_some() || {
                let dec = self.decide(w.record.as_ref(), self.body_of(c as u8), w.now);
                matches!(dec, Dec::Replay | Dec::Mismatch) || self.claimable(dec)
            }
        })
    }

    /// Whether every stored response a client holds, and the completed record's, was made
    /// for the request it answers.
    pub fn own_answers(&self, w: &World) -> bool {
        let clients = (0..self.clients()).all(|c| match w.clients[c].answer {
            Some(Final::Stored { resp, .. }) => resp.class() == self.class_of(c as u8),
            _ => true,
        });
        clients
            && match w.record {
                Some(Rec {
                    body,
                    state: RecState::Completed(resp),
                    ..
                }) => resp.class() == self.class(body),
                _ => true,
            }
    }

    /// Whether every stored response clients were given in this epoch is the same, and the
    /// completed record (what every later copy gets) is that response.
    pub fn acked_consistent(&self, w: &World) -> bool {
        let mut acked = None;
        for client in &w.clients[..self.clients()] {
            if let Some(Final::Stored { resp, epoch }) = client.answer
                && epoch == w.epoch
            {
                if acked.is_some_and(|a| a != resp) {
                    return false;
                }
                acked = Some(resp);
            }
        }
        match (acked, w.record) {
            (
                Some(a),
                Some(Rec {
                    state: RecState::Completed(r),
                    ..
                }),
            ) => a == r,
            _ => true,
        }
    }
}

/// The response the model's `resp` stands for.
fn stored(resp: Resp) -> StoredResponse {
    let body = match resp {
        Resp::Charge { n, class } => vec![b'c', n, class],
        Resp::Row { n, class } => vec![b'r', n, class],
    };
    StoredResponse {
        status: 201,
        headers: Vec::new(),
        body,
        body_omitted: false,
    }
}

/// The names of the properties, as the report prints them.
pub mod names {
    /// At most one downstream effect per key (per retention period).
    pub const ONE_EFFECT: &str = "at most one effect per key";
    /// Every acknowledged outcome is what later copies get.
    pub const ACKED: &str = "acknowledged outcome is what later copies get";
    /// A fencing token never lets an old holder write.
    pub const FENCING: &str = "fencing: an old holder never writes";
    /// No request is answered, or its record completed, with another request's outcome.
    pub const OWN_ANSWER: &str = "every answer is its own request's";
    /// No record stays in progress past its bound once faults stop.
    pub const NOT_STUCK: &str = "no record stuck in progress past its bound";
    /// Every client eventually gets an answer.
    pub const LIVENESS: &str = "every client gets an answer";
    /// The configuration's horizon never cut a run short.
    pub const HORIZON: &str = "the horizon is long enough";
    /// Reachable: an effect happens (the world is not vacuous).
    pub const SOME_EFFECT: &str = "reachable: an effect happens";
    /// Reachable: a client is answered with a stored response.
    pub const SOME_ANSWER: &str = "reachable: a client gets a stored response";
}

impl Model for IdemModel {
    type State = World;
    type Action = Action;

    fn init_states(&self) -> Vec<World> {
        let idle = Inst {
            phase: Phase::Idle,
            retry: None,
        };
        let client = Client {
            sent: 0,
            waiting: None,
            answer: None,
        };
        vec![World {
            now: 0,
            record: None,
            tx_lock: None,
            tokens: 0,
            instances: [idle; 2],
            clients: [client; 3],
            orphans: [None; 2],
            charge: None,
            made: 0,
            recon: Recon::Idle,
            faults: self.config.faults.budget,
            epoch: 0,
            effects: 0,
            fence_broken: false,
        }]
    }

    fn actions(&self, w: &World, out: &mut Vec<Action>) {
        if self.may_tick(w) {
            out.push(Action::Tick);
        }
        if w.now < self.config.active_until {
            for (c, spec) in self.config.clients.iter().enumerate() {
                let client = &w.clients[c];
                if client.answer.is_some() || client.sent >= spec.attempts {
                    continue;
                }
                for (i, inst) in w.instances.iter().enumerate() {
                    if inst.phase == Phase::Idle {
                        out.push(Action::Send {
                            client: c as u8,
                            instance: i as u8,
                        });
                    }
                }
            }
        }
        for i in 0..2 {
            self.instance_actions(w, i, out);
        }
        for (k, orphan) in w.orphans.iter().enumerate() {
            if let Some(orphan) = orphan
                && self.may_act(w, orphan.deadline)
            {
                out.push(Action::Orphan(k as u8));
            }
        }
        if self.sweepable(w) {
            out.push(Action::Sweep);
        }
        if self.config.reconciler() {
            match w.recon {
                Recon::Idle => {
                    if matches!(
                        w.record,
                        Some(Rec { state: RecState::InProgress { lease_until, .. }, .. })
                            if lease_until <= w.now
                    ) {
                        out.push(Action::ReconList);
                    }
                }
                Recon::Listed { .. } => {
                    out.push(Action::ReconLookup);
                    if self.may_fault(w) {
                        out.push(Action::ReconLookupFails);
                    }
                }
                Recon::Looked { .. } => out.push(Action::ReconResolve),
            }
        }
    }

    fn next_state(&self, last: &World, action: Action) -> Option<World> {
        let mut w = *last;
        let idx = |n: u8| usize::from(n);
        match action {
            Action::Tick => {
                w.now += 1;
                // A call that does not dedupe is never acted on after its caller's timeout.
                if self.config.downstream == Downstream::NoDedupe {
                    for k in (0..2).rev() {
                        if w.orphans[k].is_some_and(|o| o.deadline <= w.now) {
                            w.remove_orphan(k);
                        }
                    }
                }
            }
            Action::Send { client, instance } => {
                let c = &mut w.clients[idx(client)];
                c.sent += 1;
                c.waiting = Some(c.sent);
                let req = Req {
                    client,
                    attempt: c.sent,
                };
                w.instances[idx(instance)].phase = if self.config.replay_read {
                    Phase::Read(req)
                } else {
                    self.claim_phase(req)
                };
            }
            Action::Read(i) => {
                let Phase::Read(req) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                let dec = self.decide(w.record.as_ref(), self.body_of(req.client), w.now);
                w.instances[idx(i)].phase = match dec {
                    Dec::Replay | Dec::Mismatch => {
                        Self::deliver(&mut w, req, Self::settle(last, dec));
                        Phase::Idle
                    }
                    _ => self.claim_phase(req),
                };
            }
            Action::Claim(i) => {
                let Phase::Claim(req) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                let body = self.body_of(req.client);
                let result = if self.mutant(Mutant::ClaimReadThenWrite) {
                    let dec = self.decide(w.record.as_ref(), body, w.now);
                    if self.claimable(dec) {
                        w.instances[idx(i)].phase = Phase::ClaimWrite(req);
                        return Some(w);
                    }
                    Err(dec)
                } else {
                    self.claim(&mut w, body)
                };
                w.instances[idx(i)].phase = match result {
                    Ok(token) => Phase::Claimed(self.held(&w, req, token)),
                    Err(dec) => {
                        let answer = Self::settle(&w, dec);
                        Self::deliver(&mut w, req, answer);
                        Phase::Idle
                    }
                };
            }
            Action::ClaimLost(i) => {
                let Phase::Claim(req) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                w.faults -= 1;
                self.claim(&mut w, self.body_of(req.client))
                    .expect("offered only when the claim succeeds");
                Self::deliver(&mut w, req, Reply::Retry);
                w.instances[idx(i)].phase = Phase::Idle;
            }
            Action::ClaimWrite(i) => {
                let Phase::ClaimWrite(req) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                let token = self.write_claim(&mut w, self.body_of(req.client));
                w.instances[idx(i)].phase = Phase::Claimed(self.held(&w, req, token));
            }
            Action::Call(i) => {
                let Phase::Claimed(h) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                let deadline = self.deadline(w.now);
                w.instances[idx(i)].phase = Phase::Calling(h, Call::Pending { deadline });
            }
            Action::Renew(i) => {
                let Phase::Calling(mut h, call) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                let until = self.hold_until(w.now);
                Self::renew(&mut w, h.token, until);
                h.last_renew = w.now;
                w.instances[idx(i)].phase = Phase::Calling(h, call);
            }
            Action::Stall(i) => {
                w.faults -= 1;
                match &mut w.instances[idx(i)].phase {
                    Phase::Claimed(h) | Phase::Calling(h, _) | Phase::Returned(h, _) => {
                        h.slow = true
                    }
                    _ => unreachable!(),
                }
            }
            Action::Answer(i) | Action::AnswerLost(i) => {
                let Phase::Calling(h, Call::Pending { deadline }) = w.instances[idx(i)].phase
                else {
                    unreachable!()
                };
                let charge = self.act(&mut w, self.class_of(h.req.client));
                w.instances[idx(i)].phase = if action == Action::AnswerLost(i) {
                    w.faults -= 1;
                    Phase::Calling(h, Call::Lost { deadline })
                } else {
                    // The work stores a charge; any other answer (a 422) leaves it unknown.
                    let outcome = charge.map_or(Outcome::Unknown, Outcome::Store);
                    Phase::Returned(h, outcome)
                };
            }
            Action::Fail(i) | Action::Refuse(i) => {
                let Phase::Calling(h, Call::Pending { .. }) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                w.faults -= 1;
                let outcome = if action == Action::Fail(i) {
                    Outcome::Unknown
                } else {
                    Outcome::Release
                };
                w.instances[idx(i)].phase = Phase::Returned(h, outcome);
            }
            Action::Timeout(i) => {
                let Phase::Calling(h, call) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                // A deduping downstream may still act on a call it has not answered.
                if let Call::Pending { deadline } = call
                    && self.config.downstream == Downstream::Dedupe
                {
                    self.orphan(&mut w, deadline, self.class_of(h.req.client));
                }
                w.instances[idx(i)].phase = Phase::Returned(h, Outcome::Unknown);
            }
            Action::Store(i) => {
                let Phase::Returned(h, outcome) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                let answer = match outcome {
                    Outcome::Store(resp) => {
                        self.complete(&mut w, h.token, resp);
                        Reply::Final(Final::Stored {
                            resp,
                            epoch: h.epoch,
                        })
                    }
                    Outcome::Release => {
                        Self::release(&mut w, h.token);
                        Reply::Retry
                    }
                    Outcome::Unknown => {
                        // With a reconciler the work's calls are over: the lease ends now.
                        if self.config.reconciler() {
                            let now = w.now;
                            Self::renew(&mut w, h.token, now);
                        }
                        Reply::Retry
                    }
                };
                Self::deliver(&mut w, h.req, answer);
                w.instances[idx(i)].phase = Phase::Idle;
            }
            Action::StoreFails(i) => {
                let Phase::Returned(h, Outcome::Store(resp)) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                w.faults -= 1;
                // The work was done: the client gets its answer; the completion is retried.
                let answer = Reply::Final(Final::Stored {
                    resp,
                    epoch: h.epoch,
                });
                Self::deliver(&mut w, h.req, answer);
                w.instances[idx(i)] = Inst {
                    phase: Phase::Idle,
                    retry: Some(Retry {
                        token: h.token,
                        resp,
                        give_up: self.give_up(w.now),
                    }),
                };
            }
            Action::RetryStore(i) => {
                let retry = w.instances[idx(i)].retry.take().expect("a retry");
                self.complete(&mut w, retry.token, retry.resp);
            }
            Action::RetryGiveUp(i) => {
                w.instances[idx(i)].retry = None;
            }
            Action::Orphan(k) => {
                let orphan = w.orphans[idx(k)].expect("an orphaned call");
                w.remove_orphan(idx(k));
                self.act(&mut w, orphan.class);
            }
            Action::Crash(i) => {
                w.faults -= 1;
                let inst = w.instances[idx(i)];
                match inst.phase {
                    Phase::Calling(h, Call::Pending { deadline }) if self.may_act(&w, deadline) => {
                        self.orphan(&mut w, deadline, self.class_of(h.req.client))
                    }
                    Phase::InTx { .. } => w.tx_lock = None,
                    _ => {}
                }
                w.instances[idx(i)] = Inst {
                    phase: Phase::Idle,
                    retry: None,
                };
            }
            Action::TxBegin(i) => {
                let Phase::TxBegin(req) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                let dec = self.decide(w.record.as_ref(), self.body_of(req.client), w.now);
                w.instances[idx(i)].phase = if self.claimable(dec) {
                    w.tx_lock = Some(i);
                    Phase::InTx {
                        req,
                        at: w.now,
                        replaces: dec == Dec::Expired,
                    }
                } else {
                    Self::deliver(&mut w, req, Self::settle(last, dec));
                    Phase::Idle
                };
            }
            Action::TxBusy(i) => {
                let Phase::TxBegin(req) = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                Self::deliver(&mut w, req, Reply::Retry);
                w.instances[idx(i)].phase = Phase::Idle;
            }
            Action::TxCommit(i) => {
                let Phase::InTx { req, at, replaces } = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                if replaces
                    && matches!(
                        w.record,
                        Some(Rec {
                            state: RecState::Completed(_),
                            ..
                        })
                    )
                {
                    w.new_epoch();
                }
                w.made += 1;
                w.effects += 1;
                let resp = Resp::Row {
                    n: w.made,
                    class: self.class_of(req.client),
                };
                w.record = Some(Rec {
                    body: self.body_of(req.client),
                    state: RecState::Completed(resp),
                    created: at,
                    expires: self.expires_at(at),
                });
                w.tx_lock = None;
                let epoch = w.epoch;
                Self::deliver(&mut w, req, Reply::Final(Final::Stored { resp, epoch }));
                w.instances[idx(i)].phase = Phase::Idle;
            }
            Action::TxRollback(i) => {
                let Phase::InTx { req, .. } = w.instances[idx(i)].phase else {
                    unreachable!()
                };
                w.faults -= 1;
                w.tx_lock = None;
                Self::deliver(&mut w, req, Reply::Retry);
                w.instances[idx(i)].phase = Phase::Idle;
            }
            Action::Sweep => {
                if matches!(
                    w.record,
                    Some(Rec {
                        state: RecState::Completed(_),
                        ..
                    })
                ) {
                    w.new_epoch();
                }
                w.record = None;
            }
            Action::ReconList => {
                let Some(Rec {
                    state: RecState::InProgress { token, .. },
                    ..
                }) = w.record
                else {
                    unreachable!()
                };
                w.recon = Recon::Listed { token };
            }
            Action::ReconLookup => {
                let Recon::Listed { token } = w.recon else {
                    unreachable!()
                };
                w.recon = Recon::Looked {
                    token,
                    charge: w.charge,
                };
            }
            Action::ReconLookupFails => {
                w.faults -= 1;
                w.recon = Recon::Idle;
            }
            Action::ReconResolve => {
                let Recon::Looked { token, charge } = w.recon else {
                    unreachable!()
                };
                match charge {
                    Some(c) => {
                        self.complete(&mut w, token, c);
                    }
                    None => {
                        Self::release(&mut w, token);
                    }
                }
                w.recon = Recon::Idle;
            }
        }
        Some(w)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![Property::always(names::ONE_EFFECT, |_, w: &World| {
            w.effects <= 1
        })];
        properties.push(Property::always(names::ACKED, |m: &Self, w: &World| {
            m.acked_consistent(w)
        }));
        properties.push(Property::always(names::FENCING, |_, w: &World| {
            !w.fence_broken
        }));
        properties.push(Property::always(
            names::OWN_ANSWER,
            |m: &Self, w: &World| m.own_answers(w),
        ));
        properties.push(Property::always(names::NOT_STUCK, |m: &Self, w: &World| {
            !m.is_end(w) || m.nothing_stuck(w)
        }));
        properties.push(Property::always(names::LIVENESS, |m: &Self, w: &World| {
            !m.is_end(w) || m.all_answered(w)
        }));
        properties.push(Property::always(names::HORIZON, |m: &Self, w: &World| {
            !(w.now >= m.config.horizon && m.pending(w))
        }));
        properties.push(Property::sometimes(names::SOME_EFFECT, |_, w: &World| {
            w.effects > 0
        }));
        properties.push(Property::sometimes(names::SOME_ANSWER, |_, w: &World| {
            w.clients
                .iter()
                .any(|c| matches!(c.answer, Some(Final::Stored { .. })))
        }));
        properties
    }
}

impl IdemModel {
    /// The claim an instance holds once it claimed with `token`.
    fn held(&self, w: &World, req: Req, token: u8) -> Held {
        Held {
            req,
            token,
            epoch: w.epoch,
            last_renew: w.now,
            slow: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world(m: &IdemModel) -> World {
        m.init_states().remove(0)
    }

    const CHARGE: Resp = Resp::Charge { n: 1, class: 0 };

    #[test]
    fn bodies_with_equal_fingerprints_are_one_request() {
        let m = IdemModel::new(Config::transaction(), None);
        assert_eq!(m.class(0), m.class(1), "{BODIES:?}: canonical JSON");
        assert_ne!(m.class(0), m.class(2));
    }

    /// As the conformance suite's `lease_expiry_and_renewal` and `fencing_token_guards_the_outcome`
    /// pin every store.
    #[test]
    fn a_claim_takes_a_free_key_a_stale_one_only_with_takeover_and_fences_the_old_holder() {
        let no_takeover = IdemModel::new(Config::lease_reconciler(), None);
        let mut w = world(&no_takeover);
        assert_eq!(no_takeover.claim(&mut w, 0), Ok(1));
        assert_eq!(no_takeover.claim(&mut w, 1), Err(Dec::InFlight));
        assert_eq!(no_takeover.claim(&mut w, 2), Err(Dec::Mismatch));
        w.now = no_takeover.hold_until(0);
        assert_eq!(no_takeover.claim(&mut w, 0), Err(Dec::LeaseExpired));
        assert_eq!(no_takeover.claim(&mut w, 2), Err(Dec::Mismatch));

        let takeover = IdemModel::new(Config::lease_takeover_dedupe(), None);
        assert_eq!(
            takeover.claim(&mut w, 1),
            Ok(2),
            "the same request takes it over"
        );
        assert!(
            !takeover.complete(&mut w, 1, CHARGE),
            "the old holder is fenced out"
        );
        assert!(!IdemModel::renew(&mut w, 1, 9) && !IdemModel::release(&mut w, 1));
        assert!(takeover.complete(&mut w, 2, CHARGE));
        assert!(!takeover.complete(&mut w, 2, CHARGE), "completed once");
        assert!(!w.fence_broken);
    }

    /// As `retention_and_release` and `sweep_deletes_expired_in_batches` pin every store.
    #[test]
    fn a_completed_record_past_its_retention_is_new_again() {
        let m = IdemModel::new(Config::lease_reconciler(), None);
        let mut w = world(&m);
        assert_eq!(m.claim(&mut w, 0), Ok(1));
        assert!(m.complete(&mut w, 1, CHARGE));
        w.now = m.expires_at(0) - 1;
        assert_eq!(m.claim(&mut w, 2), Err(Dec::Mismatch));
        assert!(!m.sweepable(&w));
        w.now = m.expires_at(0);
        assert!(m.sweepable(&w));
        assert_eq!(
            m.claim(&mut w, 2),
            Ok(2),
            "another request may use the key now"
        );
        assert_eq!(w.epoch, 1);
        assert!(IdemModel::release(&mut w, 2));
        assert_eq!(m.claim(&mut w, 0), Ok(3), "a released key is free at once");
    }

    /// The policy's timing rules, from idem-core: the hold covers the lease and the longest
    /// downstream call.
    #[test]
    fn a_claim_is_held_for_the_lease_and_the_downstream_timeout() {
        let m = IdemModel::new(Config::lease_reconciler(), None);
        assert_eq!(m.hold_until(4), 4 + 1 + 2);
        assert_eq!(m.deadline(4), 4 + 2);
        let early = IdemModel::new(Config::lease_reconciler(), Some(Mutant::Reconciler404Early));
        assert_eq!(
            early.hold_until(4),
            4 + 1,
            "the planted bug drops the call's time"
        );
    }
}
