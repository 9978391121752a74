//! The chaos run: two `idem serve` processes on one PostgreSQL cluster of the test's own, under
//! a load of payment intents (each key sent as several concurrent copies, retried until it
//! gets its `201`, some copies cut off mid-request on a raw socket, some sent again after their
//! answer), while a seeded schedule kills the instances with SIGKILL and restarts them,
//! crashes PostgreSQL (`pg_ctl stop -m immediate`) and starts it again, and disturbs the
//! network between the instances and PostgreSQL: each instance reaches the database through a
//! fault relay of its own ([`idem_testkit::fault_relay`]) that the schedule switches to latency
//! spikes, stalls, resets in the middle of a statement, or a black hole, for seconds at a time.
//!
//! Every attempt and every chaos event goes to a JSON-lines log (its path is printed first; the
//! directory is kept when the run fails). Then a checker asserts, from the log and the
//! database: at most one payment per key, exactly one for each key that got a `2xx`; every
//! acknowledged `2xx` still in the database and replaying byte for byte; no key left in
//! progress after a sweep; no answer other than `201`, or `409`/`503` with `Retry-After`
//! (a `500` above all), and no attempt that hung; no `idle in transaction` session left, nor
//! one seen lingering during the run.
//!
//! The default run (CI) lasts about a minute: 45 s of chaos, then the settling and the checks.
//! The long run is one command (a plain `cargo test`: nextest's slow-timeout would end it):
//!
//! ```text
//! IDEM_CHAOS_SECS=300 cargo test -p idem-cli --test chaos -- --nocapture
//! ```
//!
//! - `IDEM_CHAOS_SECS`: seconds of chaos (default 45), counted once both instances are up; the
//!   schedule goes on past them until its first steps, one of each kind, have run.
//! - `IDEM_CHAOS_SEED`: the seed of the chaos schedule and of every client's plan (copies, cuts,
//!   instances); printed by every run, so a failure's schedule can be replayed. Timing, and so
//!   the interleaving, still differs between runs.
//! - `IDEM_CHAOS_KEEP=1`: keep the log directory after a passing run too.
//!
//! The figures (requests, answers, cuts, kills, restarts, duplicates, lost acknowledgements,
//! and per kind of chaos: its steps, the requests sent during them and their answers) are
//! printed at the end (`--nocapture` shows them), with the request rate: a run of N requests
//! takes about N / rate seconds of `IDEM_CHAOS_SECS`.

use crate::common::processes;

pub(crate) mod checks;
pub(crate) mod journal;
pub(crate) mod load;
pub(crate) mod schedule;
pub(crate) mod settings;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use checks::*;
use futures_util::StreamExt;
use idem_core::{Clock, SystemClock};
use idem_store::{PgStore, Store};
use idem_testkit::fault_relay::LATENCY_MAX;
use journal::*;
use load::*;
use processes::Cluster;
use schedule::*;
use settings::{Settings, first_failures};
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;

/// Seconds of chaos when `IDEM_CHAOS_SECS` is not set: with the cluster's start, the settling
/// and the checks, about a minute, inside nextest's two-minute limit.
const DEFAULT_SECS: u64 = 45;

/// The longest the service may take to answer while the network to its database works: every
/// wait in it is bounded well below this (lock wait 10 s, pool 5 s), and a killed process or
/// database ends its connections at once.
const SERVICE_BOUND: Duration = Duration::from_secs(30);

/// An attempt still unanswered after this counts as hung, a failure: the service's own bound,
/// plus the longest a network fault can hold the attempt's statements (one fault at a time:
/// its period, then at most one chunk still held each way by a latency spike).
const ATTEMPT_TIMEOUT: Duration = SERVICE_BOUND
    .saturating_add(MAX_NET_FAULT)
    .saturating_add(LATENCY_MAX.saturating_mul(2));

/// After the chaos ends, how long the copies still running may take to get their `201`.
const SETTLE: Duration = Duration::from_secs(60);

/// The clients: intents in flight at once (`workers`), each with its copies, enough to keep
/// both instances and the database busy on a two-core CI machine without turning the run into
/// a benchmark; a third of the copies cut off on their first attempt.
const CLIENTS: Clients = Clients {
    workers: 16,
    copies: 2..=5,
    cut_chance: Some(0.3),
    path: "/payments",
    token: "sk_test_alice",
    key_prefix: "chaos-",
    attempt_timeout: ATTEMPT_TIMEOUT,
    settle: SETTLE,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_run_keeps_one_payment_per_key_and_every_acknowledgement() {
    let settings = Settings::from_env(DEFAULT_SECS);
    let dir = Settings::new_dir("idem-chaos-");
    let log_path = dir.join("attempts.jsonl");
    eprintln!(
        "chaos run: {:?} of chaos, seed {} (IDEM_CHAOS_SEED={} replays the schedule); log {}",
        settings.chaos,
        settings.seed,
        settings.seed,
        log_path.display()
    );
    let started = Instant::now();
    let cluster = tokio::task::block_in_place(Cluster::start);

    let load = Arc::new(Load::new(&settings, CLIENTS, &log_path));
    let mut chaos = Chaos::start(Target::Serve(&cluster), &load, settings.seed, &dir).await;

    let chaos_over = load.under(chaos.run()).await;
    let chaos_took = chaos_over - started;
    let settled_after = chaos_over.elapsed();

    let mut findings = Findings::default();
    let during = load.journal.attempts();
    let finals = check(&load, &cluster, &mut findings).await;
    let figures = chaos.finish();
    load.journal.flush();
    std::fs::write(dir.join("postgres.log"), cluster.log()).expect("save the PostgreSQL log");
    for died in &figures.died {
        findings.fail(died.clone());
    }
    findings.failures.extend(scan_instance_logs(&dir));
    if !figures.lingering.is_empty() {
        findings.fail(format!(
            "sessions idle in a transaction for over {LINGER_SECS} s during the run: {:?}",
            figures.lingering
        ));
    }

    Report {
        settings: &settings,
        load: &load,
        during: &during,
        finals: &finals,
        figures: &figures,
        findings: &findings,
        log_path: &log_path,
        times: (chaos_took, started.elapsed(), settled_after),
    }
    .print();
    assert!(
        findings.failures.is_empty(),
        "the chaos run failed ({} findings; log and instance logs kept in {}):\n{}",
        findings.failures.len(),
        dir.display(),
        first_failures(&findings.failures)
    );
    assert_chaos_happened(&figures);
    settings.passed(&dir);
}

/// Even the shortest run had every kind of chaos it is meant to have.
fn assert_chaos_happened(figures: &Figures) {
    let kinds: HashSet<&str> = figures.windows.iter().map(|w| w.kind).collect();
    for kind in ["latency", "stall", "reset", "black hole"] {
        assert!(kinds.contains(kind), "the run had no {kind}: {figures:?}");
    }
    assert!(
        figures.kills > 0 && figures.pg_restarts > 0,
        "the run was too short for chaos: {figures:?}"
    );
}

/// What the run prints at its end.
struct Report<'a> {
    settings: &'a Settings,
    load: &'a Load,
    during: &'a [Attempt],
    finals: &'a [Attempt],
    figures: &'a Figures,
    findings: &'a Findings,
    log_path: &'a Path,
    /// The chaos's length, the wall time, and how long the copies took to settle after it.
    times: (Duration, Duration, Duration),
}

impl Report<'_> {
    fn print(&self) {
        let Self {
            settings,
            load,
            during,
            finals,
            figures,
            findings,
            log_path,
            times: (chaos_took, wall, settled_after),
        } = self;
        let keys: HashSet<u32> = during.iter().map(|a| a.key).collect();
        let cuts: Vec<&Attempt> = during.iter().filter(|a| a.via == Via::Cut).collect();
        let cut_where = |a: &&Attempt| match a.cut {
            Some(cut) if cut.cut_at < cut.head_len => "mid-head",
            Some(cut) if cut.cut_at < cut.request_len => "mid-body",
            _ => "after the request",
        };
        let mut cut_tally: BTreeMap<&str, usize> = BTreeMap::new();
        for cut in &cuts {
            *cut_tally.entry(cut_where(cut)).or_default() += 1;
        }
        let connection_errors = during
            .iter()
            .filter(|a| a.status.is_none() && a.via != Via::Cut)
            .count();
        let events = load.journal.events();
        let per_kind = per_kind(&figures.windows, during);
        eprintln!(
            "chaos run figures (seed {}): {:?} of chaos, {:.1?} wall time, settled {settled_after:.1?} \
         after the chaos; {} keys, {} requests sent ({} during the run, {} final replays); \
         answers by status {:?}; final replays {:?}; {connection_errors} connection errors; \
         {} cuts {cut_tally:?}; {} kills -9, {} instance restarts, {} PostgreSQL restarts \
         ({} events); {} duplicates found; {} lost acknowledgements; {} failures; log {}",
            settings.seed,
            chaos_took,
            wall,
            keys.len(),
            load.attempts.load(Ordering::Relaxed),
            during.len(),
            finals.len(),
            tally(during.iter().filter(|a| a.via != Via::Cut)),
            tally(finals.iter()),
            cuts.len(),
            figures.kills,
            figures.instance_restarts,
            figures.pg_restarts,
            events.len(),
            findings.duplicates,
            findings.lost_acks.len(),
            findings.failures.len(),
            log_path.display(),
        );
        eprintln!(
            "chaos run per kind of chaos (requests sent during its steps, their answers):\n{per_kind}\n\
         relays (connections, resets, delayed chunks): {:?}; {:.0} requests/s",
            figures.relays,
            during.len() as f64 / chaos_took.as_secs_f64(),
        );
    }
}
