//! The chaos run: two `idem serve` processes on one PostgreSQL cluster of the test's own, under
//! a load of payment intents (each key sent as several concurrent copies, retried until it
//! gets its `201`, some copies cut off mid-request on a raw socket, some sent again after their
//! answer), while a seeded schedule kills the instances with SIGKILL and restarts them,
//! crashes PostgreSQL (`pg_ctl stop -m immediate`) and starts it again, and disturbs the
//! network between the instances and PostgreSQL: each instance reaches the database through a
//! fault relay of its own ([`idem_store::fault_relay`]) that the schedule switches to latency
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
//! - `IDEM_CHAOS_SECS`: seconds of chaos (default 45).
//! - `IDEM_CHAOS_SEED`: the seed of the chaos schedule and of every client's plan (copies, cuts,
//!   instances); printed by every run, so a failure's schedule can be replayed. Timing, and so
//!   the interleaving, still differs between runs.
//! - `IDEM_CHAOS_KEEP=1`: keep the log directory after a passing run too.
//!
//! The figures (requests, answers, cuts, kills, restarts, duplicates, lost acknowledgements,
//! and per kind of chaos: its steps, the requests sent during them and their answers) are
//! printed at the end (`--nocapture` shows them), with the request rate: a run of N requests
//! takes about N / rate seconds of `IDEM_CHAOS_SECS`.

#[path = "../common/processes.rs"]
mod processes;

mod checks;
mod journal;
mod load;
mod schedule;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use bytes::Bytes;
use checks::*;
use futures_util::StreamExt;
use futures_util::future::join_all;
use idem_client::RetryPolicy;
use idem_core::{Clock, SystemClock};
use idem_store::fault_relay::{Direction, Fault, FaultRelay, LATENCY_MAX, RelayStats};
use idem_store::{PgStore, Store};
use journal::*;
use load::*;
use processes::{Cluster, Serve};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use schedule::*;
use serde::Serialize;
use sqlx::{Connection, PgConnection};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Seconds of chaos when `IDEM_CHAOS_SECS` is not set: with the cluster's start, the settling
/// and the checks, about a minute, inside nextest's two-minute limit.
const DEFAULT_SECS: u64 = 45;

/// Intents in flight at once, each with its copies: enough to keep both instances and the
/// database busy on a two-core CI machine without turning the run into a benchmark.
const KEY_WORKERS: usize = 16;

/// Copies of each key sent at once (inclusive range).
const COPIES: std::ops::RangeInclusive<u8> = 2..=5;

/// The chance that a copy's first attempt is cut off on a raw socket.
const CUT_CHANCE: f64 = 0.3;

/// The chance that a copy is sent again a little after it got its `201` (a client that lost
/// the answer, or a user pressing "pay" twice): it must replay.
const LATE_RETRY_CHANCE: f64 = 0.2;

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

/// A session idle inside a transaction for longer than this, seen during the run, is a leak: a
/// request's transaction is idle only between its own statements, for milliseconds.
const LINGER_SECS: i64 = 15;

const TOKEN: &str = "sk_test_alice";

/// The run's settings, from the environment.
#[derive(Debug, Clone, Copy)]
struct Settings {
    chaos: Duration,
    seed: u64,
    keep: bool,
}

impl Settings {
    fn from_env() -> Self {
        let secs = std::env::var("IDEM_CHAOS_SECS").map_or(DEFAULT_SECS, |s| {
            s.parse()
                .unwrap_or_else(|_| panic!("IDEM_CHAOS_SECS={s:?} is not a number of seconds"))
        });
        let seed = std::env::var("IDEM_CHAOS_SEED").map_or_else(
            |_| rand::random(),
            |s| {
                s.parse()
                    .unwrap_or_else(|_| panic!("IDEM_CHAOS_SEED={s:?} is not a u64"))
            },
        );
        Self {
            chaos: Duration::from_secs(secs),
            seed,
            keep: std::env::var_os("IDEM_CHAOS_KEEP").is_some_and(|v| !v.is_empty() && v != "0"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_run_keeps_one_payment_per_key_and_every_acknowledgement() {
    let settings = Settings::from_env();
    let dir = tempfile::Builder::new()
        .prefix("idem-chaos-")
        .tempdir()
        .expect("temp dir")
        // Kept unless the run passes: a failed run leaves its evidence behind.
        .keep();
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

    let chaos_ends = Instant::now() + settings.chaos;
    let load = Arc::new(new_load(&settings, &log_path, chaos_ends));
    let mut chaos = Chaos::start(&cluster, &load, settings.seed, &dir).await;

    let workers: Vec<_> = (0..KEY_WORKERS)
        .map(|_| tokio::spawn(load.clone().worker()))
        .collect();
    chaos.run().await;
    let chaos_took = started.elapsed();
    for worker in workers {
        worker.await.expect("a client worker panicked");
    }
    load.late_copies().await;
    let settled_after = Instant::now() - chaos_ends;

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
        findings
            .failures
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_chaos_happened(&figures);
    if !settings.keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
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

/// The client side of the run, on its settings.
fn new_load(settings: &Settings, log_path: &Path, chaos_ends: Instant) -> Load {
    Load {
        http: reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(ATTEMPT_TIMEOUT)
            .build()
            .expect("an HTTP client"),
        fleet: Fleet::default(),
        journal: Journal::create(log_path),
        seed: settings.seed,
        backoff: RetryPolicy {
            base: Duration::from_millis(25),
            cap: Duration::from_secs(1),
            max_attempts: u32::MAX,
            ..RetryPolicy::default()
        },
        chaos_ends,
        gives_up: chaos_ends + SETTLE,
        next_key: AtomicU32::new(0),
        attempts: AtomicU64::new(0),
        late: Mutex::default(),
    }
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
        let cut_where = |a: &&Attempt| match (a.cut_at, a.head_len, a.request_len) {
            (Some(at), Some(head), _) if at < head => "mid-head",
            (Some(at), _, Some(len)) if at < len => "mid-body",
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
