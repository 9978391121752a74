//! idem's protocol, model-checked (SPEC §16): both modes, every interleaving of a small world,
//! with idem-core's own decisions, and known past bugs caught when they are planted.
//!
//! ```text
//! cargo run -p idem-model --release -- check             # every configuration, 0 violations
//! cargo run -p idem-model --release -- check --mutants   # every planted bug is caught
//! cargo run -p idem-model --release -- list              # configurations and mutants
//! ```
//!
//! `check` walks every reachable state of each configuration ([`Config::all`]) with
//! [stateright](https://docs.rs/stateright)'s checker (depth first, the two instances'
//! symmetry folded), prints per configuration the states visited and per property
//! `0 violations` or the shortest counterexample (found again breadth first), and exits 1 on
//! any violation. `check --mutant NAME` (or `--mutants`) plants a known bug ([`Mutant`]) and
//! exits 0 only when a property catches it, printing the counterexample step by step.
//!
//! ```
//! use idem_model::{Config, Search, run};
//!
//! // A small world: two clients, one fault, every interleaving.
//! let report = run(Config::transaction().shrunk(), None, Search::Dfs, 1, false);
//! assert!(report.passed(), "{report}");
//! assert!(report.states > 1_000);
//! ```
//!
//! # The world
//!
//! One key; the store's clock in whole seconds ([`World`]); these parts, each step of which
//! is one action of the checker, interleaved in every order:
//!
//! | part | steps | in the code |
//! | --- | --- | --- |
//! | clients (two or three), one intent each, the same key | send a copy to an idle instance, at any time, up to a number of attempts; giving up on the copy in flight (its answer is lost to the client); stop at a final answer (a stored response, `422`) | `idem-client`, any caller |
//! | two idem instances, the layer in one mode | the replay read (`get`, `decide`); the claim (`claim`, or `begin_claim` in a transaction); the call downstream with the key; renewals while it runs (due once a lease has passed since the last one); the call's timeout; storing the outcome (`complete`, `release`, or an unknown outcome: with a reconciler the lease ends at once, `renew(now)`); the background retry of a completion the store refused (`store_outcome_later`) | `idem-tower`: `layer.rs` (`admit`, `replay_read`), `mode.rs` (`claim_or_wait`, `renewing_lease`, `store_outcome`, `outcome_unknown`, `store_outcome_later`, transaction mode's `claim_in_tx`, `commit_or_roll_back`) |
//! | the store | one atomic map; exactly the operations of `idem_store::Store` (table below) | `idem-store` |
//! | the downstream | acts on a call (a charge), with or without deduping by key; answers, fails (`5xx`), refuses the connection, loses its answer, or hangs until the caller's timeout; a non-deduping one never acts after its caller's timeout (the contract asks that of it), a deduping one may act on a call any time; answers lookups by key | `idem fake-psp`, a payment provider |
//! | the reconciler | lists a stale in-progress record, asks the downstream by key, completes the record with its charge or releases it on `404` (three separate steps) | `idem-cli/src/serve/payouts.rs` (`reconcile`, `reconcile_one`) |
//! | the sweeper | deletes the record once `decide` calls it expired | `sweep_all` |
//! | faults, a budget per run | an instance crashes at any step (and restarts empty; a call it sent may still land); a claim's answer is lost (`503`); the downstream fails, refuses, or acts and loses its answer; the store refuses a completion; the reconciler cannot reach the downstream; a transaction rolls back; an instance stalls (its lease runs out while it works); the clock advances between any two steps | |
//!
//! Transaction mode has no downstream: its effect is the business row, committed with the key
//! and the response in one step, or rolled back (a crash, a rollback fault) with the key.
//!
//! # Decisions from idem-core, not copies of them
//!
//! Every decision the model shares with the code is made by idem-core's own functions, so the
//! two cannot drift apart there:
//!
//! - [`idem_core::decide`] for every read, claim, transaction claim and sweep, and for what a
//!   copy would get at the end of a run (a model record is turned into an `idem_core::Record`
//!   for each call);
//! - the policy's timing rules: [`idem_core::Policy::lease_hold`] for every claim and renewal,
//!   `Policy::retention` for every expiry, `Policy::downstream_timeout` for every call,
//!   `Policy::lease` for renewals and the completion retry's give-up;
//! - [`idem_core::Fingerprint::compute`] over the bodies clients send ([`BODIES`]): two spell
//!   the same request differently (equal fingerprints: canonical JSON), one is another
//!   request. `decide` compares them; which request a response was made for follows the
//!   same equality.
//!
//! # The store, and the conformance tests that pin the real ones to it
//!
//! | model operation | `Store` method | what it does in the model | conformance tests (`idem_store::conformance`) |
//! | --- | --- | --- | --- |
//! | claim | `claim` | one atomic step: replaces the record iff `decide` says `Fresh` or `Expired`, or `LeaseExpired` with takeover; then a new in-progress record with a new token, `lease_until = now + lease_hold`, `expires_at = now + retention`; else returns the record | `claim_race_has_one_winner`, `lease_expiry_and_renewal`, `retention_and_release`, `completed_record_replays`, `mismatch_leaves_record_untouched`, `sweep_spares_keys_claimed_again` |
//! | complete | `complete` | stores the response iff the record is in progress under the token | `fencing_token_guards_the_outcome`, `completed_record_replays`, `lease_expiry_and_renewal` |
//! | renew | `renew` | moves `lease_until` iff in progress under the token (a run-out lease included) | `fencing_token_guards_the_outcome`, `lease_expiry_and_renewal` |
//! | release | `release` | deletes the record iff in progress under the token | `fencing_token_guards_the_outcome`, `retention_and_release` |
//! | sweep | `sweep` | deletes the record iff `decide` calls it expired | `sweep_deletes_expired_in_batches`, `sweep_spares_keys_claimed_again`, `sweep_boundary_is_exact` |
//! | get | `get` | reads the record | `completed_record_replays`, `mismatch_leaves_record_untouched` |
//! | list stale | `AdminStore::list` (`in_progress`, `lease_expired_by: now`) | the record if in progress with `lease_until <= now` | `admin_lists_purges_and_force_completes` |
//! | begin_claim, commit_response, rollback | `TransactionalStore` | the claim as above under a row lock (a second transaction waits, or gets `409` when its wait runs out); the row, key and response commit in one step | `transaction_mode_commits_or_rolls_back`, `transaction_wait_is_bounded`, `transaction_mode_replaces_an_expired_record` |
//!
//! The stores repeat `decide`'s rule of what a claim may replace and a sweep may delete in
//! their own statements (SQL, the Redis scripts and TTLs); the model follows `decide`. No
//! conformance test pins yet that an in-progress record whose lease ran out and whose
//! retention passed is neither claimed afresh nor swept: until one does, a store can disagree
//! with the model there.
//!
//! Tokens are numbered in claim order in the model (the store only compares them for
//! equality; the order is the fencing property's ghost).
//!
//! # Properties
//!
//! Checked in every state, or at the end of every run (time past every bound, faults and
//! clients stopped, nothing able to move):
//!
//! | property | meaning |
//! | --- | --- |
//! | at most one effect per key | downstream effects (transaction mode: committed rows) per key and retention period; a new period starts only when a completed record's retention ends |
//! | acknowledged outcome is what later copies get | every stored response clients were given in a period is the same, and the completed record replays it |
//! | fencing: an old holder never writes | no `complete`, `renew` or `release` succeeds with a token older than the newest claim's |
//! | every answer is its own request's | no client gets, and no record stores, a response made for another request |
//! | no record stuck in progress past its bound (end) | the record is absent, completed, or (with takeover) claimable by the next copy of its request |
//! | every client gets an answer (end) | each client holds its final answer, or one more copy would get one (a replay, a `422`, or a free key) |
//! | the horizon is long enough | no run was cut short by the configuration's last second |
//! | reachable: an effect happens; a client gets a stored response | the world is not vacuous |
//!
//! # Configurations
//!
//! Each where the contract promises what is checked ([`Config::all`]). States are the
//! distinct states visited with the two instances' symmetry folded, with `decide` letting only
//! a completed record expire; times in release on two cores shared with other builds (load
//! about 14), 65 s for the whole `check`:
//!
//! | configuration | world | states | time |
//! | --- | --- | ---: | ---: |
//! | `transaction` | transaction mode; A 3 attempts, A' 2, B 2; 3 faults | 375,505 | 2.7 s |
//! | `lease-takeover-dedupe` | takeover, deduping downstream, stalls; A 3, A' 2; 2 faults | 2,114,619 | 19 s |
//! | `lease-reconciler` | no takeover, reconciler, non-deduping downstream; A 3, A' 2; 2 faults | 984,562 | 8 s |
//! | `lease-reconciler-mismatch` | the same with B instead of A', retention past the run | 666,445 | 3.4 s |
//! | `lease-reconciler-dedupe` | no takeover, reconciler, deduping downstream, stalls, no replay read; A 3, A' 2; 2 faults | 4,676,148 | 32 s |
//!
//! A and A' send the same request written two ways, B another request with the same key.
//! Lease 1 s, downstream timeout 2 s (a hold of 3 s), retention 5 s (3 s in transaction mode);
//! clients and faults act in the first 7 s (5 s), after which time runs on only while a lease
//! or a call is pending.
//!
//! # What is not modelled
//!
//! - **One clock.** Every lease and expiry is judged by the store's own clock, the model's
//!   only clock. Clock skew between instances is outside the model, except as far as it
//!   shows through that one clock.
//! - **Timing assumptions**, where the contract rests on them: a live instance's own steps
//!   (its store round trips, its handler's code) take no time, only its downstream call
//!   does, and it renews before a lease has passed since its last renewal (the layer renews
//!   every third of one). Only the stall fault lifts that, and only in the configurations
//!   whose promise survives it (a deduping downstream). `lease-reconciler-stalls` shows why
//!   the others need it: a worker that stalls past its lease before its call, over a
//!   downstream that does not dedupe, charges again after the reconciler's `404` released the
//!   key (no store operation can fence a call the downstream does not check).
//! - **The store's own durability and atomicity**: the model assumes each operation is atomic
//!   and durable once answered (the conformance suite, the crash and chaos tests check the
//!   real stores); a lost answer is modelled, a lost write is not.
//! - **One key**: keys are independent in every store operation.
//! - **Not modelled**: the outcome wait (`with_outcome_wait`), the gateway and its Redis
//!   store, more than one background completion retry per instance at a time, the reconciler
//!   crashing (its pass only reads, then writes under a token), operators' `force_complete`
//!   and `purge`.
//!
//!
//! # Beyond the promises
//!
//! Two configurations run only by name (`check --config NAME`) and fail, showing where a
//! promise stops:
//!
//! - `lease-reconciler-stalls`: lease mode without takeover over a non-deduping downstream,
//!   with stalls. A worker stalls past its lease before its call; the reconciler's lookup
//!   answers `404` and it releases the key; a retry charges; the stalled worker wakes and
//!   charges again.
//! - `key-reuse-after-retention`: another request reuses the key after the first one's
//!   retention. The key passed downstream is the same for both (idem serve derives it from
//!   the scope alone), so the reconciler's lookup by key answers the old request's charge, and
//!   the new request's record is completed with it.
//!
//! [`World`]: world::World
//! [`BODIES`]: config::BODIES

pub mod check;
pub mod config;
pub mod model;
pub mod mutant;
pub mod trace;
pub mod world;

pub use check::{Report, Search, run};
pub use config::{BODIES, Config};
pub use model::IdemModel;
pub use mutant::Mutant;
