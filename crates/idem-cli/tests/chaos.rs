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

#[path = "common/processes.rs"]
mod processes;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::join_all;
use idem_client::RetryPolicy;
use idem_core::{Clock, SystemClock};
use idem_store::fault_relay::{Direction, Fault, FaultRelay, LATENCY_MAX, RelayStats};
use idem_store::{PgStore, Store};
use processes::{Cluster, Serve};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
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

/// How an attempt was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Via {
    /// A whole request over HTTP, read to its answer.
    Http,
    /// A copy sent again after it already got its `201`.
    Late,
    /// The request's first `cut_at` bytes on a raw socket, then the socket closed.
    Cut,
    /// The checker's replay of the key after the run.
    Final,
}

/// One attempt and its answer (or the lack of one), as a line of the log.
#[derive(Debug, Clone, Serialize)]
struct Attempt {
    key: u32,
    copy: u8,
    attempt: u32,
    via: Via,
    /// Which instance slot (0 or 1), which of its processes (restarts count up), on what port.
    instance: usize,
    generation: u32,
    port: u16,
    /// Milliseconds since the run started.
    sent_ms: f64,
    done_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after: Option<String>,
    replayed: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    body: String,
    /// The body as received, for byte-for-byte comparison.
    #[serde(skip)]
    raw: Bytes,
    /// Why there was no answer (connection refused or dropped, the cut itself).
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    timed_out: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    cut_at: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    head_len: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_len: Option<usize>,
}

impl Attempt {
    fn created(&self) -> bool {
        self.status == Some(201)
    }

    /// A `2xx`: an acknowledgement the client may act on.
    fn acknowledged(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
    }

    fn label(&self) -> String {
        match (self.via, self.status) {
            (Via::Cut, _) if self.error.is_none() => "cut".into(),
            (_, Some(201)) if self.replayed => "201 replayed".into(),
            (_, Some(201)) => "201 fresh".into(),
            (_, Some(code)) => code.to_string(),
            (_, None) if self.timed_out => "timed out".into(),
            (_, None) => "connection error".into(),
        }
    }

    /// An answer the contract allows during chaos: a `201`, a refusal the client may retry
    /// (`409`, `503`, each with `Retry-After`), or no answer at all, short of a hang.
    fn allowed(&self) -> bool {
        match self.status {
            Some(201) => true,
            Some(409 | 503) => self.retry_after.is_some(),
            Some(_) => false,
            None => !self.timed_out,
        }
    }

    fn id(&self) -> Option<String> {
        let body: serde_json::Value = serde_json::from_slice(&self.raw).ok()?;
        body["id"].as_str().map(str::to_owned)
    }
}

/// A chaos event, as a line of the log.
#[derive(Debug, Clone, Serialize)]
struct Event {
    what: &'static str,
    ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    instance: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    generation: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
    /// A network fault's name, and which relays it is on (`0`, `1` or `both`).
    #[serde(skip_serializing_if = "Option::is_none")]
    fault: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    relays: Option<&'static str>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Line<'a> {
    Attempt(&'a Attempt),
    Event(&'a Event),
}

/// Every attempt and event of the run, in memory for the checker and on disk as JSON lines.
struct Journal {
    started: Instant,
    inner: Mutex<JournalInner>,
}

struct JournalInner {
    attempts: Vec<Attempt>,
    events: Vec<Event>,
    out: BufWriter<File>,
}

impl Journal {
    fn create(path: &Path) -> Self {
        let out = BufWriter::new(File::create(path).expect("create the chaos log"));
        Self {
            started: Instant::now(),
            inner: Mutex::new(JournalInner {
                attempts: Vec::new(),
                events: Vec::new(),
                out,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, JournalInner> {
        // Only pushes and writes happen under the lock, and no await: a std Mutex. A panic
        // cannot leave the vectors half-written.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn ms(&self, at: Instant) -> f64 {
        (at - self.started).as_secs_f64() * 1000.0
    }

    fn attempt(&self, attempt: Attempt) {
        let mut inner = self.lock();
        let line = serde_json::to_string(&Line::Attempt(&attempt)).expect("serialise");
        writeln!(inner.out, "{line}").expect("write the chaos log");
        inner.attempts.push(attempt);
    }

    fn event(&self, what: &'static str, instance: Option<(usize, u32, u16)>) {
        self.push_event(Event {
            what,
            ms: self.ms(Instant::now()),
            instance: instance.map(|i| i.0),
            generation: instance.map(|i| i.1),
            port: instance.map(|i| i.2),
            fault: None,
            relays: None,
        });
    }

    fn net_event(&self, what: &'static str, fault: Fault, on: Relays) {
        self.push_event(Event {
            what,
            ms: self.ms(Instant::now()),
            instance: None,
            generation: None,
            port: None,
            fault: Some(fault.name()),
            relays: Some(on.name()),
        });
    }

    fn push_event(&self, event: Event) {
        let mut inner = self.lock();
        let line = serde_json::to_string(&Line::Event(&event)).expect("serialise");
        writeln!(inner.out, "{line}").expect("write the chaos log");
        // Flushed at each event, so a run that dies midway leaves its log up to there.
        inner.out.flush().expect("flush the chaos log");
        inner.events.push(event);
    }

    fn flush(&self) {
        self.lock().out.flush().expect("flush the chaos log");
    }

    fn attempts(&self) -> Vec<Attempt> {
        self.lock().attempts.clone()
    }

    fn events(&self) -> Vec<Event> {
        self.lock().events.clone()
    }
}

/// Where a live instance listens.
#[derive(Debug, Clone)]
struct Route {
    slot: usize,
    generation: u32,
    url: String,
    port: u16,
}

/// The instances clients may send to: a killed one leaves the table until its restart, as
/// behind a load balancer with health checks.
#[derive(Debug, Default)]
struct Fleet {
    routes: RwLock<[Option<Route>; 2]>,
}

impl Fleet {
    fn set(&self, slot: usize, route: Option<Route>) {
        self.routes.write().unwrap_or_else(PoisonError::into_inner)[slot] = route;
    }

    /// A live instance chosen at random, `None` while both are down.
    fn pick(&self, rng: &mut StdRng) -> Option<Route> {
        let routes = self.routes.read().unwrap_or_else(PoisonError::into_inner);
        let live: Vec<&Route> = routes.iter().flatten().collect();
        (!live.is_empty()).then(|| live[rng.random_range(0..live.len())].clone())
    }

    fn get(&self, slot: usize) -> Option<Route> {
        self.routes.read().unwrap_or_else(PoisonError::into_inner)[slot].clone()
    }
}

/// What every client task shares.
struct Load {
    http: reqwest::Client,
    fleet: Fleet,
    journal: Journal,
    seed: u64,
    backoff: RetryPolicy,
    /// No new key starts after this.
    chaos_ends: Instant,
    /// A copy still without its `201` gives up here (and the checker fails the run).
    gives_up: Instant,
    next_key: AtomicU32,
    attempts: AtomicU64,
    /// The late copies, each in a task of its own so that its key's worker moves on.
    late: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

fn key_name(key: u32) -> String {
    format!("chaos-{key:07}")
}

/// The same bytes on every attempt of a key: the fingerprint covers the body (canonicalised)
/// and the content type.
fn body_of(key: u32) -> String {
    format!(r#"{{"amount":{},"currency":"EUR"}}"#, 100 + u64::from(key))
}

/// A seed of its own for each key and copy, derived from the run's seed, so a run's plan is
/// reproducible whatever order the tasks run in.
fn sub_seed(seed: u64, key: u32, copy: u8) -> u64 {
    seed ^ ((u64::from(key) << 8) | u64::from(copy)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Load {
    /// Takes keys one after another until the chaos ends.
    async fn worker(self: Arc<Self>) {
        while Instant::now() < self.chaos_ends {
            let key = self.next_key.fetch_add(1, Ordering::Relaxed);
            self.key(key).await;
        }
    }

    /// All copies of one key, at once.
    async fn key(self: &Arc<Self>, key: u32) {
        let copies = StdRng::seed_from_u64(sub_seed(self.seed, key, 0)).random_range(COPIES);
        join_all((1..=copies).map(|copy| self.copy(key, copy))).await;
    }

    /// One copy of a key: maybe a cut-off first attempt, then attempts until a `201`, then
    /// maybe the same request again later.
    async fn copy(self: &Arc<Self>, key: u32, copy: u8) {
        let mut rng = StdRng::seed_from_u64(sub_seed(self.seed, key, copy));
        let mut attempt = 0;
        // A little stagger: some copies arrive while the first is running, some just after.
        tokio::time::sleep(Duration::from_micros(rng.random_range(0..20_000))).await;
        if rng.random_bool(CUT_CHANCE) {
            attempt += 1;
            self.cut(key, copy, attempt, &mut rng).await;
        }
        let late = rng.random_bool(LATE_RETRY_CHANCE);
        if !self
            .until_created(key, copy, &mut attempt, Via::Http, &mut rng)
            .await
        {
            return;
        }
        if late {
            let load = self.clone();
            let late = tokio::spawn(async move {
                // Up to a few seconds: often across a kill or a database restart.
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..3_000))).await;
                load.until_created(key, copy, &mut attempt, Via::Late, &mut rng)
                    .await;
            });
            self.late
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(late);
        }
    }

    /// Waits for the late copies.
    async fn late_copies(&self) {
        let late = std::mem::take(&mut *self.late.lock().unwrap_or_else(PoisonError::into_inner));
        for copy in late {
            copy.await.expect("a late copy panicked");
        }
    }

    /// Sends the copy until it gets a `201`, as a retrying client would: after `Retry-After`
    /// when the answer has one, else after a jittered backoff; to any live instance. Returns
    /// whether it got the `201`.
    async fn until_created(
        &self,
        key: u32,
        copy: u8,
        attempt: &mut u32,
        via: Via,
        rng: &mut StdRng,
    ) -> bool {
        let mut waits = self
            .backoff
            .delays(StdRng::seed_from_u64(rng.random::<u64>()));
        loop {
            if Instant::now() >= self.gives_up {
                return false;
            }
            let Some(route) = self.fleet.pick(rng) else {
                // Both instances are down: wait for a restart rather than count a refusal.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            *attempt += 1;
            let seen = self.send(key, copy, *attempt, via, &route).await;
            match seen.status {
                Some(201) => return true,
                // Not retryable: the checker reports it; retrying a request the service
                // refuses for good would only spin.
                Some(code) if (400..500).contains(&code) && code != 409 && code != 429 => {
                    return false;
                }
                _ => {}
            }
            let backoff = waits.next().expect("the backoff never runs out");
            let wait = seen
                .retry_after
                .as_deref()
                .and_then(|s| s.parse::<u64>().ok())
                // The service asks for whole seconds; capped so a run never idles long.
                .map_or(backoff, |secs| {
                    Duration::from_secs(secs).min(Duration::from_secs(2))
                });
            tokio::time::sleep(wait).await;
        }
    }

    /// One whole attempt over HTTP, recorded.
    async fn send(&self, key: u32, copy: u8, attempt: u32, via: Via, route: &Route) -> Attempt {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let sent = Instant::now();
        let result = async {
            let response = self
                .http
                .post(format!("{}/payments", route.url))
                .header(AUTHORIZATION, format!("Bearer {TOKEN}"))
                .header(CONTENT_TYPE, "application/json")
                .header("idempotency-key", key_name(key))
                .body(body_of(key))
                .send()
                .await?;
            let status = response.status().as_u16();
            let header = |name| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            let retry_after = header(RETRY_AFTER.as_str());
            let replayed = header("idempotent-replayed").is_some_and(|v| v == "true");
            let body = response.bytes().await?;
            Ok::<_, reqwest::Error>((status, retry_after, replayed, body))
        }
        .await;
        let mut seen = Attempt {
            key,
            copy,
            attempt,
            via,
            instance: route.slot,
            generation: route.generation,
            port: route.port,
            sent_ms: self.journal.ms(sent),
            done_ms: self.journal.ms(Instant::now()),
            status: None,
            retry_after: None,
            replayed: false,
            body: String::new(),
            raw: Bytes::new(),
            error: None,
            timed_out: false,
            cut_at: None,
            head_len: None,
            request_len: None,
        };
        match result {
            Ok((status, retry_after, replayed, body)) => {
                seen.status = Some(status);
                seen.retry_after = retry_after;
                seen.replayed = replayed;
                seen.body = String::from_utf8_lossy(&body).into_owned();
                seen.raw = body;
            }
            Err(e) => {
                seen.timed_out = e.is_timeout();
                seen.error = Some(error_chain(&e));
            }
        }
        self.journal.attempt(seen.clone());
        seen
    }

    /// Writes the first bytes of the request to a raw socket and closes it: somewhere in the
    /// head, in the body, or after the whole request (then the service may well commit the
    /// payment, and the copy's retry must replay it).
    async fn cut(&self, key: u32, copy: u8, attempt: u32, rng: &mut StdRng) {
        let Some(route) = self.fleet.pick(rng) else {
            return;
        };
        let body = body_of(key);
        let head = format!(
            "POST /payments HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: Bearer {TOKEN}\r\n\
             Content-Type: application/json\r\nIdempotency-Key: {}\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            route.port,
            key_name(key),
            body.len()
        );
        let request = [head.as_bytes(), body.as_bytes()].concat();
        // A third of the cuts come after the whole request: the case where the work may run.
        let cut_at = if rng.random_bool(1.0 / 3.0) {
            request.len()
        } else {
            rng.random_range(0..request.len())
        };
        let linger = Duration::from_micros(rng.random_range(0..50_000));
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let sent = Instant::now();
        let written = async {
            let mut stream = TcpStream::connect(("127.0.0.1", route.port)).await?;
            stream.write_all(&request[..cut_at]).await?;
            if cut_at == request.len() {
                // Sometimes the answer is on its way, sometimes the work has barely begun.
                tokio::time::sleep(linger).await;
            }
            drop(stream);
            Ok::<_, std::io::Error>(())
        }
        .await;
        self.journal.attempt(Attempt {
            key,
            copy,
            attempt,
            via: Via::Cut,
            instance: route.slot,
            generation: route.generation,
            port: route.port,
            sent_ms: self.journal.ms(sent),
            done_ms: self.journal.ms(Instant::now()),
            status: None,
            retry_after: None,
            replayed: false,
            body: String::new(),
            raw: Bytes::new(),
            error: written.err().map(|e| e.to_string()),
            timed_out: false,
            cut_at: Some(cut_at),
            head_len: Some(head.len()),
            request_len: Some(request.len()),
        });
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// What the chaos schedule did.
#[derive(Debug, Default)]
struct Figures {
    kills: usize,
    instance_restarts: usize,
    pg_restarts: usize,
    /// Every step, as the kind of chaos and the time it lasted, for the figures per kind.
    windows: Vec<Window>,
    /// What the relays did (connections, resets, delayed chunks), per relay.
    relays: Vec<RelayStats>,
    /// Sessions seen idle in a transaction for longer than `LINGER_SECS` during the run.
    lingering: Vec<String>,
    /// Instances that exited without being killed, with their logs.
    died: Vec<String>,
}

/// One step of the schedule, from its start to its end, in milliseconds since the run began.
#[derive(Debug, Clone, Copy)]
struct Window {
    kind: &'static str,
    from_ms: f64,
    to_ms: f64,
}

/// The process side of the run: the cluster, the instances, the relays between them and the
/// cluster, the seeded schedule.
struct Chaos<'a> {
    cluster: &'a Cluster,
    load: &'a Load,
    /// Relay `i` carries every connection of instance slot `i` to PostgreSQL, across restarts.
    relays: [FaultRelay; 2],
    instances: [Option<Serve>; 2],
    generations: [u32; 2],
    rng: StdRng,
    dir: &'a Path,
    figures: Figures,
    watcher: Option<PgConnection>,
}

/// One step of the schedule.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// SIGKILL one instance, restart it after `down`.
    KillOne(usize),
    /// Both at once: for a while no instance answers at all.
    KillBoth,
    /// PostgreSQL stops with `-m immediate`, starts again after `down`.
    CrashPostgres,
    /// PostgreSQL crashes, and an instance is killed while it is down.
    CrashPostgresAndKill(usize),
    /// A network fault between instances and PostgreSQL, for `period`.
    Net(Fault, Relays, Duration),
}

/// Which relays a network fault is on.
#[derive(Debug, Clone, Copy)]
enum Relays {
    One(usize),
    Both,
}

impl Relays {
    fn name(self) -> &'static str {
        match self {
            Relays::One(0) => "0",
            Relays::One(_) => "1",
            Relays::Both => "both",
        }
    }
}

impl Step {
    /// The kind of chaos, as the figures count it.
    fn kind(self) -> &'static str {
        match self {
            Step::KillOne(_) => "kill -9 one",
            Step::KillBoth => "kill -9 both",
            Step::CrashPostgres => "postgres crash",
            Step::CrashPostgresAndKill(_) => "postgres crash and kill",
            Step::Net(fault, ..) => match fault {
                Fault::Stall(_) => "stall",
                other => other.name(),
            },
        }
    }
}

/// The longest a network fault lasts. An attempt caught by one waits at most this long for
/// the network (then one held chunk each way), on top of the service's own bounded waits.
const MAX_NET_FAULT: Duration = Duration::from_secs(5);

impl<'a> Chaos<'a> {
    async fn start(cluster: &'a Cluster, load: &'a Load, seed: u64, dir: &'a Path) -> Self {
        let relay = |n: u64| FaultRelay::start(cluster.addr(), sub_seed(seed, u32::MAX, n as u8));
        let relays = [
            relay(0).await.expect("a relay"),
            relay(1).await.expect("a relay"),
        ];
        let mut chaos = Self {
            cluster,
            load,
            relays,
            instances: [None, None],
            generations: [0, 0],
            rng: StdRng::seed_from_u64(seed),
            dir,
            figures: Figures::default(),
            watcher: None,
        };
        chaos.start_instance(0).await;
        chaos.start_instance(1).await;
        chaos
    }

    fn route(&self, slot: usize) -> (usize, u32, u16) {
        let port = self.load.fleet.get(slot).map_or(0, |r| r.port);
        (slot, self.generations[slot], port)
    }

    async fn start_instance(&mut self, slot: usize) {
        let database = format!("postgres://postgres@{}/postgres", self.relays[slot].addr());
        let serve = Serve::start(&database).await;
        let port = serve
            .url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("a port in the instance's URL");
        self.load.fleet.set(
            slot,
            Some(Route {
                slot,
                generation: self.generations[slot],
                url: serve.url.clone(),
                port,
            }),
        );
        self.instances[slot] = Some(serve);
        self.load.journal.event("start", Some(self.route(slot)));
    }

    fn kill(&mut self, slot: usize) {
        let route = self.route(slot);
        let mut serve = self.instances[slot].take().expect("the instance runs");
        // Out of the table first: a client that picked it just before still meets the kill.
        self.load.fleet.set(slot, None);
        tokio::task::block_in_place(|| serve.kill());
        self.save_log(slot, &serve);
        self.generations[slot] += 1;
        self.figures.kills += 1;
        self.load.journal.event("kill -9", Some(route));
    }

    async fn restart(&mut self, slot: usize) {
        self.start_instance(slot).await;
        self.figures.instance_restarts += 1;
    }

    fn crash_postgres(&mut self) {
        self.watcher = None;
        tokio::task::block_in_place(|| self.cluster.crash());
        self.load.journal.event("postgres stop -m immediate", None);
    }

    fn start_postgres(&mut self) {
        tokio::task::block_in_place(|| self.cluster.start_again());
        self.figures.pg_restarts += 1;
        self.load.journal.event("postgres start", None);
    }

    fn save_log(&self, slot: usize, serve: &Serve) {
        let path = self.dir.join(format!(
            "instance-{slot}-generation-{}.log",
            self.generations[slot]
        ));
        std::fs::write(path, serve.log()).expect("save an instance's log");
    }

    fn down_time(&mut self, max_ms: u64) -> Duration {
        Duration::from_millis(self.rng.random_range(100..=max_ms))
    }

    /// Runs the schedule until the chaos ends; leaves both instances and PostgreSQL up.
    async fn run(&mut self) {
        // The first steps are one kill, one crash and one of each network fault, in a random
        // order, so that even a short run has them all; then steps at random.
        let mut steps = vec![
            Step::KillOne(self.rng.random_range(0..2)),
            Step::CrashPostgres,
        ];
        for fault in [
            Fault::Latency,
            Fault::Stall(Direction::Both),
            Fault::Reset,
            Fault::BlackHole,
        ] {
            steps.push(self.net_step(Some(fault)));
        }
        steps.shuffle(&mut self.rng);
        while Instant::now() < self.load.chaos_ends {
            let gap = Duration::from_millis(self.rng.random_range(1_000..4_000));
            self.watch_until(Instant::now() + gap).await;
            if Instant::now() >= self.load.chaos_ends {
                break;
            }
            let step = steps.pop().unwrap_or_else(|| {
                let slot = self.rng.random_range(0..2);
                match self.rng.random_range(0..100) {
                    0..25 => Step::KillOne(slot),
                    25..30 => Step::KillBoth,
                    30..45 => Step::CrashPostgres,
                    45..50 => Step::CrashPostgresAndKill(slot),
                    _ => self.net_step(None),
                }
            });
            self.check_alive();
            let from_ms = self.load.journal.ms(Instant::now());
            self.step(step).await;
            self.figures.windows.push(Window {
                kind: step.kind(),
                from_ms,
                to_ms: self.load.journal.ms(Instant::now()),
            });
        }
        self.check_alive();
    }

    /// A network fault (`fault`, or one at random) on one relay or both, for a random period
    /// of its kind: latency and black holes for seconds, stalls for up to a few, resets in
    /// bursts under a second (every connection that sends meanwhile is reset once).
    fn net_step(&mut self, fault: Option<Fault>) -> Step {
        let direction = [Direction::ToTarget, Direction::ToClient, Direction::Both]
            [self.rng.random_range(0..3)];
        let fault = fault.unwrap_or_else(|| {
            [
                Fault::Latency,
                Fault::Stall(direction),
                Fault::Reset,
                Fault::BlackHole,
            ][self.rng.random_range(0..4)]
        });
        let max = MAX_NET_FAULT.as_millis() as u64;
        let period = Duration::from_millis(match fault {
            Fault::Latency | Fault::BlackHole => self.rng.random_range(1_000..=max),
            Fault::Stall(_) => self.rng.random_range(500..=max.min(4_000)),
            Fault::Reset => self.rng.random_range(100..=1_000),
        });
        let on = if self.rng.random_bool(0.3) {
            Relays::Both
        } else {
            Relays::One(self.rng.random_range(0..2))
        };
        Step::Net(fault, on, period)
    }

    async fn net_fault(&mut self, fault: Fault, on: Relays, period: Duration) {
        self.load.journal.net_event("net fault", fault, on);
        match on {
            Relays::One(slot) => self.relays[slot].inject(fault, period).await,
            Relays::Both => {
                let [first, second] = &self.relays;
                tokio::join!(first.inject(fault, period), second.inject(fault, period));
            }
        }
        self.load.journal.net_event("net fault cleared", fault, on);
    }

    async fn step(&mut self, step: Step) {
        match step {
            Step::Net(fault, on, period) => self.net_fault(fault, on, period).await,
            Step::KillOne(slot) => {
                self.kill(slot);
                tokio::time::sleep(self.down_time(1_500)).await;
                self.restart(slot).await;
            }
            Step::KillBoth => {
                self.kill(0);
                self.kill(1);
                tokio::time::sleep(self.down_time(1_000)).await;
                self.restart(0).await;
                self.restart(1).await;
            }
            Step::CrashPostgres => {
                self.crash_postgres();
                tokio::time::sleep(self.down_time(3_000)).await;
                self.start_postgres();
            }
            Step::CrashPostgresAndKill(slot) => {
                self.crash_postgres();
                tokio::time::sleep(self.down_time(1_500)).await;
                self.kill(slot);
                tokio::time::sleep(self.down_time(1_500)).await;
                // An instance cannot start without its database: PostgreSQL first.
                self.start_postgres();
                self.restart(slot).await;
            }
        }
    }

    /// An instance that exited without being killed is a crash of the service: its log is
    /// kept as evidence, and it is started again so the run goes on.
    fn check_alive(&mut self) {
        for slot in 0..2 {
            let exited = self.instances[slot]
                .as_mut()
                .is_some_and(|serve| !serve.is_running());
            if exited {
                let serve = self.instances[slot].take().expect("checked above");
                self.load.fleet.set(slot, None);
                self.save_log(slot, &serve);
                self.figures.died.push(format!(
                    "instance {slot} generation {} exited by itself; its log:\n{}",
                    self.generations[slot],
                    serve.log()
                ));
                self.generations[slot] += 1;
            }
        }
    }

    /// Waits until `until`, looking every second for sessions idle in a transaction for
    /// longer than any request takes.
    async fn watch_until(&mut self, until: Instant) {
        loop {
            let now = Instant::now();
            if now >= until {
                return;
            }
            tokio::time::sleep((until - now).min(Duration::from_secs(1))).await;
            self.look_for_lingering().await;
        }
    }

    async fn look_for_lingering(&mut self) {
        if self.watcher.is_none() {
            self.watcher = PgConnection::connect(&self.cluster.url).await.ok();
        }
        let Some(watcher) = self.watcher.as_mut() else {
            return;
        };
        let rows: Result<Vec<(i32, String, String)>, _> = sqlx::query_as(
            "SELECT pid, state, query FROM pg_stat_activity
             WHERE state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()
               AND state_change < now() - make_interval(secs => $1)",
        )
        .bind(LINGER_SECS as f64)
        .fetch_all(&mut *watcher)
        .await;
        match rows {
            Ok(rows) => self
                .figures
                .lingering
                .extend(rows.into_iter().map(|r| format!("{r:?}"))),
            Err(_) => self.watcher = None,
        }
    }

    /// Stops the instances, keeping their logs; returns the figures.
    fn finish(mut self) -> Figures {
        self.check_alive();
        self.figures.relays = self.relays.iter().map(FaultRelay::stats).collect();
        for slot in 0..2 {
            if let Some(serve) = self.instances[slot].take() {
                self.save_log(slot, &serve);
            }
        }
        self.figures
    }
}

/// The checker's findings.
#[derive(Debug, Default)]
struct Findings {
    failures: Vec<String>,
    duplicates: usize,
    lost_acks: HashSet<u32>,
}

impl Findings {
    fn fail(&mut self, what: String) {
        self.failures.push(what);
    }
}

/// Per kind of chaos step: how many steps, how many attempts were sent during them, and their
/// answers; and the same for the attempts sent between steps.
fn per_kind(windows: &[Window], attempts: &[Attempt]) -> String {
    let mut kinds: BTreeMap<&str, (usize, Vec<&Attempt>)> = BTreeMap::new();
    for window in windows {
        kinds.entry(window.kind).or_default().0 += 1;
    }
    for a in attempts.iter().filter(|a| a.via != Via::Cut) {
        let during = windows
            .iter()
            .find(|w| (w.from_ms..=w.to_ms).contains(&a.sent_ms));
        let kind = during.map_or("between steps", |w| w.kind);
        kinds.entry(kind).or_default().1.push(a);
    }
    kinds
        .iter()
        .map(|(kind, (steps, sent))| {
            format!(
                "  {kind}: {steps} steps, {} requests, {:?}",
                sent.len(),
                tally(sent.iter().copied())
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Answers by label, for the figures.
fn tally<'a>(attempts: impl IntoIterator<Item = &'a Attempt>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for a in attempts {
        *counts.entry(a.label()).or_default() += 1;
    }
    counts
}

/// The payments in the database, by key.
async fn payments_by_key(db: &mut PgConnection) -> (HashMap<String, Vec<String>>, usize) {
    let rows: Vec<(Option<String>, String)> =
        sqlx::query_as("SELECT idem_key, id FROM payments ORDER BY created_at")
            .fetch_all(&mut *db)
            .await
            .expect("read the payments");
    let total = rows.len();
    let mut by_key: HashMap<String, Vec<String>> = HashMap::new();
    for (key, id) in rows {
        by_key
            .entry(key.unwrap_or_else(|| "<no key>".into()))
            .or_default()
            .push(id);
    }
    (by_key, total)
}

async fn count(db: &mut PgConnection, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(&mut *db)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// The checks on the log and the database, after the chaos and the settling.
async fn check(load: &Load, cluster: &Cluster, findings: &mut Findings) -> Vec<Attempt> {
    let during = load.journal.attempts();

    // No answer outside the contract, at any time.
    let bad: Vec<&Attempt> = during.iter().filter(|a| !a.allowed()).collect();
    if !bad.is_empty() {
        findings.fail(format!(
            "{} answers outside the contract ({:?}); the first ones:\n{}",
            bad.len(),
            tally(bad.iter().copied()),
            bad.iter()
                .take(5)
                .map(|a| format!("  {a:?}"))
                .collect::<Vec<_>>()
                .join("\n")
        ));
    }

    // Every copy got its 201, and every 2xx of a key carried the same bytes.
    let mut copies: HashSet<(u32, u8)> = HashSet::new();
    let mut created: HashSet<(u32, u8)> = HashSet::new();
    let mut acked: BTreeMap<u32, &Attempt> = BTreeMap::new();
    for a in &during {
        copies.insert((a.key, a.copy));
        if a.created() && a.via == Via::Http {
            created.insert((a.key, a.copy));
        }
        if a.acknowledged() {
            let first = acked.entry(a.key).or_insert(a);
            if first.raw != a.raw {
                findings.lost_acks.insert(a.key);
                findings.fail(format!(
                    "key {} acknowledged with different bodies: {:?} then {:?}",
                    key_name(a.key),
                    first.body,
                    a.body
                ));
            }
        }
    }
    // A fresh 201 is the answer of the request that paid: two for one key are two payments
    // (or one answered twice), whatever the database says now.
    let mut fresh: BTreeMap<u32, usize> = BTreeMap::new();
    for a in during.iter().filter(|a| a.created() && !a.replayed) {
        *fresh.entry(a.key).or_default() += 1;
    }
    let twice: Vec<String> = fresh
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(key, n)| format!("{} ({n})", key_name(*key)))
        .collect();
    if !twice.is_empty() {
        findings.fail(format!("keys with more than one fresh 201: {twice:?}"));
    }
    let unfinished: Vec<_> = copies.difference(&created).collect();
    if !unfinished.is_empty() {
        findings.fail(format!(
            "{} copies got no 201 within {SETTLE:?} after the chaos, such as {:?}",
            unfinished.len(),
            &unfinished[..unfinished.len().min(5)]
        ));
    }
    let keys: BTreeMap<u32, ()> = copies.iter().map(|(k, _)| (*k, ())).collect();

    // The database as the chaos left it: at most one payment per key, the acknowledged one.
    let mut db = PgConnection::connect(&cluster.url)
        .await
        .expect("connect to the cluster");
    let (stored, _) = payments_by_key(&mut db).await;
    for (key, ids) in &stored {
        if ids.len() > 1 {
            findings.duplicates += ids.len() - 1;
            findings.fail(format!("key {key} has {} payments: {ids:?}", ids.len()));
        }
    }
    let sent: HashSet<String> = keys.keys().map(|k| key_name(*k)).collect();
    let strangers: Vec<&String> = stored.keys().filter(|k| !sent.contains(*k)).collect();
    if !strangers.is_empty() {
        findings.fail(format!("payments for keys never sent: {strangers:?}"));
    }
    for (key, ack) in &acked {
        let ids = stored
            .get(&key_name(*key))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        if ids.len() != 1 || ack.id().as_deref() != Some(ids[0].as_str()) {
            findings.lost_acks.insert(*key);
            findings.fail(format!(
                "key {} was acknowledged with {:?} but the database holds {ids:?}",
                key_name(*key),
                ack.body
            ));
        }
    }

    // One sweep (it deletes nothing within the retention), then no key in progress. In
    // transaction mode a claim commits together with its outcome, so a committed in-progress
    // row is a bug at once; there is no lease to wait out.
    let store = PgStore::connect(&cluster.url).await.expect("a store");
    store
        .sweep(SystemClock.now(), 1000)
        .await
        .expect("one sweep");
    store.pool().close().await;
    let in_progress = count(
        &mut db,
        "SELECT count(*) FROM idempotency_keys WHERE status = 'in_progress'",
    )
    .await;
    if in_progress != 0 {
        findings.fail(format!("{in_progress} keys left in progress"));
    }

    // Every key once more, through both instances: the acknowledged ones must replay byte for
    // byte; the others (none, if every copy finished) may pay now, once.
    let finals: Vec<Attempt> = futures_util::stream::iter(keys.keys().copied())
        .map(|key| final_replay(load, key))
        .buffer_unordered(32)
        .collect()
        .await;
    for replay in &finals {
        match acked.get(&replay.key) {
            _ if !replay.created() => findings.fail(format!(
                "the final replay of key {} got {:?}",
                key_name(replay.key),
                replay
            )),
            Some(ack) if !replay.replayed || replay.raw != ack.raw => {
                findings.lost_acks.insert(replay.key);
                findings.fail(format!(
                    "key {} acknowledged with {:?} at {:.0} ms; the final replay got {} {:?}",
                    key_name(replay.key),
                    ack.body,
                    ack.done_ms,
                    replay.label(),
                    replay.body
                ));
            }
            _ => {}
        }
    }
    let (after, total) = payments_by_key(&mut db).await;
    if after.len() != keys.len() || total != keys.len() {
        findings.fail(format!(
            "after the final replays: {total} payments for {} keys, {} keys sent",
            after.len(),
            keys.len()
        ));
    }
    let completed = count(
        &mut db,
        "SELECT count(*) FROM idempotency_keys WHERE status = 'completed'",
    )
    .await;
    if completed as usize != keys.len() {
        findings.fail(format!(
            "{completed} completed key rows for {} keys",
            keys.len()
        ));
    }

    // No session left inside a transaction once the services settle. A request's transaction
    // shows as idle in transaction between its statements; none runs now, so a few seconds
    // are a generous margin.
    let settle_by = Instant::now() + Duration::from_secs(10);
    loop {
        let idle: Vec<(i32, String, String, String)> = sqlx::query_as(
            "SELECT pid, state, coalesce(application_name, ''), query FROM pg_stat_activity
             WHERE state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()",
        )
        .fetch_all(&mut db)
        .await
        .expect("read pg_stat_activity");
        if idle.is_empty() {
            break;
        }
        if Instant::now() >= settle_by {
            findings.fail(format!("sessions left idle in a transaction: {idle:?}"));
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    db.close().await.expect("close");
    finals
}

/// What the instances' logs say that no client could see: a `500` written to a socket a cut
/// had closed shows there only. `safety_net=true` is the payments table's unique index
/// stopping a second payment the idempotency layer let through.
fn scan_instance_logs(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let logs = std::fs::read_dir(dir).expect("read the run's directory");
    for entry in logs {
        let path = entry.expect("a directory entry").path();
        if !path.to_string_lossy().ends_with(".log") || path.ends_with("postgres.log") {
            continue;
        }
        let log = without_colours(&std::fs::read_to_string(&path).expect("read a log"));
        for line in log.lines() {
            if line.contains("safety_net=true") || line.contains("panicked") {
                found.push(format!("{}: {line}", path.display()));
            }
        }
    }
    found
}

/// `text` without ANSI colour sequences (`ESC [ … m`), which split `field=value` in tracing's
/// coloured output.
fn without_colours(text: &str) -> String {
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // Up to and including the sequence's final letter.
            chars.by_ref().find(char::is_ascii_alphabetic);
        } else {
            plain.push(c);
        }
    }
    plain
}

/// The checker's replay of `key`, retried briefly should an instance still be reconnecting
/// to the restarted database.
async fn final_replay(load: &Load, key: u32) -> Attempt {
    let slot = (key % 2) as usize;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let route = load
            .fleet
            .get(slot)
            .expect("both instances run after the chaos");
        let seen = load.send(key, 0, attempt, Via::Final, &route).await;
        if seen.created() || attempt >= 5 || !seen.allowed() {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
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
    let load = Arc::new(Load {
        http: reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(ATTEMPT_TIMEOUT)
            .build()
            .expect("an HTTP client"),
        fleet: Fleet::default(),
        journal: Journal::create(&log_path),
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
    });
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
    let per_kind = per_kind(&figures.windows, &during);
    eprintln!(
        "chaos run figures (seed {}): {:?} of chaos, {:.1?} wall time, settled {settled_after:.1?} \
         after the chaos; {} keys, {} requests sent ({} during the run, {} final replays); \
         answers by status {:?}; final replays {:?}; {connection_errors} connection errors; \
         {} cuts {cut_tally:?}; {} kills -9, {} instance restarts, {} PostgreSQL restarts \
         ({} events); {} duplicates found; {} lost acknowledgements; {} failures; log {}",
        settings.seed,
        chaos_took,
        started.elapsed(),
        keys.len(),
        load.attempts.load(Ordering::Relaxed),
        during.len(),
        finals.len(),
        tally(during.iter().filter(|a| a.via != Via::Cut)),
        tally(&finals),
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
    let kinds: HashSet<&str> = figures.windows.iter().map(|w| w.kind).collect();
    for kind in ["latency", "stall", "reset", "black hole"] {
        assert!(kinds.contains(kind), "the run had no {kind}: {figures:?}");
    }
    assert!(
        figures.kills > 0 && figures.pg_restarts > 0,
        "the run was too short for chaos: {figures:?}"
    );
    if !settings.keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
