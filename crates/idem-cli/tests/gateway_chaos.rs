//! The gateway's chaos run: two `idem proxy` processes on one Redis, each reaching it through
//! a fault relay of its own ([`idem_store::fault_relay`]), in front of an upstream of the
//! test's own that charges once per forwarded key and counts every time a key's request
//! reaches it. Payment intents arrive as several concurrent copies per key, each retried until
//! it gets its `201`, while a seeded schedule kills the proxies with SIGKILL (and restarts
//! them) and switches the relays to latency spikes, stalls, resets in the middle of a command,
//! and black holes. Redis itself keeps running: a Redis restart (which forgets every key when
//! it keeps nothing on disk) is outside what this run checks.
//!
//! What the gateway promises here, and what the checker asserts (the README's gateway section
//! says the same):
//!
//! - A key's request never reaches the upstream while an earlier reach of it still runs, and a
//!   later reach comes only after the claim of the one before could have run out (at least
//!   [`HOLD`], the lease plus the upstream timeout, minus the claim's own time in flight after
//!   its start): a reach again means the
//!   gateway lost track of the outcome (a proxy killed mid-request, or an outcome it could not
//!   store while Redis was out of reach), and it sends the same key again, for the upstream
//!   to dedupe on.
//! - Every `2xx` a client gets for a key carries the same bytes, the upstream's answer for that
//!   key; a key the upstream never saw is never acknowledged.
//! - No `500`, no `502`/`504` (the upstream is healthy); `409` and `503` always carry
//!   `Retry-After`; no attempt hangs; every copy gets its `201`.
//! - After the run, every key replays its bytes; one whose last outcome could not be stored is
//!   sent again once its lease ran out, and then replays.
//!
//! `IDEM_CHAOS_SECS`, `IDEM_CHAOS_SEED` and `IDEM_CHAOS_KEEP` work as in the `chaos` run.
//!
//! ```text
//! IDEM_CHAOS_SECS=300 cargo test -p idem-cli --test gateway_chaos -- --nocapture
//! ```

#[path = "common/processes.rs"]
mod processes;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::join_all;
use idem_client::RetryPolicy;
use idem_store::fault_relay::{Direction, Fault, FaultRelay, LATENCY_MAX, RelayStats};
use processes::Proxy;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use serde::Serialize;
use tokio::time::Instant;

/// Seconds of chaos by default: with the start, the settling (a lease, for the keys whose
/// outcome went unstored) and the final replays, about a minute.
const DEFAULT_SECS: u64 = 25;

/// Intents in flight at once: many, since a copy that meets its key in flight waits the
/// `409`'s `Retry-After` (a second) and the machine mostly idles meanwhile.
const KEY_WORKERS: usize = 96;

/// Copies of each key sent at once (inclusive range).
const COPIES: std::ops::RangeInclusive<u8> = 2..=4;

/// The chance that a copy is sent again a little after it got its `201`.
const LATE_RETRY_CHANCE: f64 = 0.2;

/// The gateway's lease (`Policy::default()`; `idem proxy` has no flag for it).
const LEASE: Duration = Duration::from_secs(30);

/// The proxies' upstream timeout (`--upstream-timeout-secs`): the upstream answers in
/// milliseconds, and a claim is held for the lease plus this past its last renewal.
const UPSTREAM_TIMEOUT_SECS: u64 = 5;

/// How long a claim whose gateway died holds its key: the lease and the upstream timeout.
const HOLD: Duration = LEASE.saturating_add(Duration::from_secs(UPSTREAM_TIMEOUT_SECS));

/// How much later than its claim a reach may start: the claim's answer on its way back from
/// Redis (at most the store's 2 s response timeout, else the claim fails) and the proxy's own
/// work before it sends upstream.
const CLAIM_SLACK: Duration = Duration::from_secs(3);

/// The longest the gateway may take to answer while its network works: a store command waits
/// at most 1 s to connect and 2 s for its answer, tried three times (9 s), a request makes two
/// (claim, outcome), and the upstream answers in milliseconds.
const GATEWAY_BOUND: Duration = Duration::from_secs(20);

/// The longest a network fault lasts.
const MAX_NET_FAULT: Duration = Duration::from_secs(5);

/// An attempt unanswered after this hung: the gateway's bound plus the longest a fault holds
/// its commands (its period, then one chunk still held each way by a latency spike).
const ATTEMPT_TIMEOUT: Duration = GATEWAY_BOUND
    .saturating_add(MAX_NET_FAULT)
    .saturating_add(LATENCY_MAX.saturating_mul(2));

/// After the chaos, how long copies may take to get their `201`: a claim's hold (a key whose
/// outcome went unstored is sent again after it) and a margin.
const SETTLE: Duration = HOLD.saturating_add(Duration::from_secs(20));

const TOKEN: &str = "sk_test_gateway";

fn settings() -> (Duration, u64, bool) {
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
    let keep = std::env::var_os("IDEM_CHAOS_KEEP").is_some_and(|v| !v.is_empty() && v != "0");
    (Duration::from_secs(secs), seed, keep)
}

fn key_name(key: u32) -> String {
    format!("gw-chaos-{key:07}")
}

fn body_of(key: u32) -> String {
    format!(r#"{{"amount":{},"currency":"EUR"}}"#, 100 + u64::from(key))
}

fn sub_seed(seed: u64, key: u32, copy: u8) -> u64 {
    seed ^ ((u64::from(key) << 8) | u64::from(copy)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Milliseconds since `started`.
fn ms_since(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1000.0
}

/// One time a key's request reached the upstream.
#[derive(Debug, Clone, Copy)]
struct Reach {
    from_ms: f64,
    to_ms: f64,
    /// The gateway hung up before the answer (a proxy killed mid-request).
    cut: bool,
}

/// The upstream: charges once per forwarded key (a second reach gets the first charge's
/// answer, as an upstream that dedupes on the key does) and records every reach.
struct Upstream {
    started: Instant,
    inner: Mutex<UpstreamInner>,
}

#[derive(Default)]
struct UpstreamInner {
    reaches: HashMap<String, Vec<Reach>>,
    running: HashMap<String, usize>,
    charges: HashMap<String, Bytes>,
    /// Keys that reached the upstream while an earlier reach of theirs still ran.
    overlaps: Vec<String>,
}

impl Upstream {
    fn lock(&self) -> MutexGuard<'_, UpstreamInner> {
        // No await under it: a std Mutex.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Ends a reach when the handler ends, answered or dropped by a gateway that hung up.
struct Running<'a> {
    upstream: &'a Upstream,
    key: String,
    from_ms: f64,
    answered: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let to_ms = ms_since(self.upstream.started);
        let mut inner = self.upstream.lock();
        *inner.running.entry(self.key.clone()).or_default() -= 1;
        inner
            .reaches
            .entry(self.key.clone())
            .or_default()
            .push(Reach {
                from_ms: self.from_ms,
                to_ms,
                cut: !self.answered,
            });
    }
}

async fn charge(
    State(upstream): State<Arc<Upstream>>,
    headers: HeaderMap,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("<no key>")
        .to_owned();
    let body = {
        let mut inner = upstream.lock();
        let running = inner.running.entry(key.clone()).or_default();
        *running += 1;
        if *running > 1 {
            inner.overlaps.push(key.clone());
        }
        // The charge happens when the work starts, so a reach cut off still charged.
        let n = inner.charges.len();
        inner
            .charges
            .entry(key.clone())
            .or_insert_with(|| Bytes::from(format!(r#"{{"id":"ch_{n:07}","key":"{key}"}}"#)))
            .clone()
    };
    let mut running = Running {
        upstream: &upstream,
        key,
        from_ms: ms_since(upstream.started),
        answered: false,
    };
    // The work's own duration: a few milliseconds, as a call to a bank would take.
    let work = 5 + running.key.bytes().map(u64::from).sum::<u64>() % 25;
    tokio::time::sleep(Duration::from_millis(work)).await;
    running.answered = true;
    drop(running);
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

async fn start_upstream(started: Instant) -> (String, Arc<Upstream>) {
    let upstream = Arc::new(Upstream {
        started,
        inner: Mutex::default(),
    });
    let app = axum::Router::new()
        .route("/charges", axum::routing::post(charge))
        .with_state(upstream.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, upstream)
}

/// One attempt and its answer, as a line of the log.
#[derive(Debug, Clone, Serialize)]
struct Attempt {
    key: u32,
    copy: u8,
    attempt: u32,
    /// Which proxy slot.
    slot: usize,
    sent_ms: f64,
    done_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after: Option<String>,
    replayed: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    body: String,
    #[serde(skip)]
    raw: Bytes,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    timed_out: bool,
    /// The checker's replay after the run.
    #[serde(rename = "final")]
    last: bool,
}

impl Attempt {
    fn created(&self) -> bool {
        self.status == Some(201)
    }

    fn acknowledged(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
    }

    fn label(&self) -> String {
        match self.status {
            Some(201) if self.replayed => "201 replayed".into(),
            Some(201) => "201 fresh".into(),
            Some(code) => code.to_string(),
            None if self.timed_out => "timed out".into(),
            None => "connection error".into(),
        }
    }

    /// A `201`, a refusal to retry (`409`, `503`, with `Retry-After`), or no answer short of a
    /// hang; never a `500`, nor a `502`/`504` from a healthy upstream.
    fn allowed(&self) -> bool {
        match self.status {
            Some(201) => true,
            Some(409 | 503) => self.retry_after.is_some(),
            Some(_) => false,
            None => !self.timed_out,
        }
    }
}

fn tally<'a>(attempts: impl IntoIterator<Item = &'a Attempt>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for a in attempts {
        *counts.entry(a.label()).or_default() += 1;
    }
    counts
}

/// Every attempt, in memory for the checker and on disk as JSON lines.
struct Journal {
    started: Instant,
    inner: Mutex<(Vec<Attempt>, BufWriter<File>)>,
}

impl Journal {
    fn record(&self, attempt: Attempt) {
        let line = serde_json::to_string(&attempt).expect("serialise");
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        writeln!(inner.1, "{line}").expect("write the log");
        inner.0.push(attempt);
    }

    fn note(&self, what: &str) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let line = serde_json::json!({"event": what, "ms": ms_since(self.started)});
        writeln!(inner.1, "{line}").expect("write the log");
        inner.1.flush().expect("flush the log");
    }

    fn attempts(&self) -> Vec<Attempt> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.1.flush().expect("flush the log");
        inner.0.clone()
    }
}

/// What the client tasks share.
struct Load {
    http: reqwest::Client,
    /// The live proxies' URLs, by slot: a killed one leaves until its restart.
    fleet: RwLock<[Option<String>; 2]>,
    journal: Journal,
    seed: u64,
    backoff: RetryPolicy,
    chaos_ends: Instant,
    gives_up: Instant,
    next_key: AtomicU32,
    late: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Load {
    fn pick(&self, rng: &mut StdRng) -> Option<(usize, String)> {
        let fleet = self.fleet.read().unwrap_or_else(PoisonError::into_inner);
        let live: Vec<(usize, &String)> = fleet
            .iter()
            .enumerate()
            .filter_map(|(slot, url)| url.as_ref().map(|u| (slot, u)))
            .collect();
        (!live.is_empty()).then(|| {
            let (slot, url) = live[rng.random_range(0..live.len())];
            (slot, url.clone())
        })
    }

    async fn worker(self: Arc<Self>) {
        while Instant::now() < self.chaos_ends {
            let key = self.next_key.fetch_add(1, Ordering::Relaxed);
            let copies = StdRng::seed_from_u64(sub_seed(self.seed, key, 0)).random_range(COPIES);
            join_all((1..=copies).map(|copy| self.copy(key, copy))).await;
        }
    }

    async fn copy(self: &Arc<Self>, key: u32, copy: u8) {
        let mut rng = StdRng::seed_from_u64(sub_seed(self.seed, key, copy));
        let mut attempt = 0;
        tokio::time::sleep(Duration::from_micros(rng.random_range(0..20_000))).await;
        let late = rng.random_bool(LATE_RETRY_CHANCE);
        if !self.until_created(key, copy, &mut attempt, &mut rng).await || !late {
            return;
        }
        let load = self.clone();
        let late = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..3_000))).await;
            load.until_created(key, copy, &mut attempt, &mut rng).await;
        });
        self.late
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(late);
    }

    /// Sends the copy until it gets a `201`, after `Retry-After` or a jittered backoff.
    async fn until_created(&self, key: u32, copy: u8, attempt: &mut u32, rng: &mut StdRng) -> bool {
        let mut waits = self
            .backoff
            .delays(StdRng::seed_from_u64(rng.random::<u64>()));
        while Instant::now() < self.gives_up {
            let Some((slot, url)) = self.pick(rng) else {
                // Both proxies are down: wait for a restart rather than count a refusal.
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            };
            *attempt += 1;
            let seen = self.send(key, copy, *attempt, slot, &url, false).await;
            match seen.status {
                Some(201) => return true,
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
                .map_or(backoff, |secs| {
                    Duration::from_secs(secs).min(Duration::from_secs(2))
                });
            tokio::time::sleep(wait).await;
        }
        false
    }

    async fn send(
        &self,
        key: u32,
        copy: u8,
        attempt: u32,
        slot: usize,
        url: &str,
        last: bool,
    ) -> Attempt {
        let sent_ms = ms_since(self.journal.started);
        let result = async {
            let response = self
                .http
                .post(format!("{url}/charges"))
                .header(AUTHORIZATION, format!("Bearer {TOKEN}"))
                .header(CONTENT_TYPE, "application/json")
                .header("idempotency-key", key_name(key))
                .body(body_of(key))
                .send()
                .await?;
            let status = response.status().as_u16();
            let header = |name: &str| {
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
            slot,
            sent_ms,
            done_ms: ms_since(self.journal.started),
            status: None,
            retry_after: None,
            replayed: false,
            body: String::new(),
            raw: Bytes::new(),
            error: None,
            timed_out: false,
            last,
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
                seen.error = Some(format!("{e:?}"));
            }
        }
        self.journal.record(seen.clone());
        seen
    }

    /// The checker's replay of `key` after the run: until a replayed `201`, so a key whose last
    /// outcome went unstored is seen sent again once its lease ran out, and then stored.
    async fn final_replay(&self, key: u32) -> Vec<Attempt> {
        let slot = (key % 2) as usize;
        let url = self.fleet.read().unwrap_or_else(PoisonError::into_inner)[slot]
            .clone()
            .expect("both proxies run after the chaos");
        let until = Instant::now() + HOLD + Duration::from_secs(10);
        let mut seen = Vec::new();
        for attempt in 1.. {
            let answer = self.send(key, 0, attempt, slot, &url, true).await;
            let done = (answer.created() && answer.replayed) || !answer.allowed();
            seen.push(answer);
            if done || Instant::now() >= until {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        seen
    }
}

/// One step of the schedule.
#[derive(Debug, Clone, Copy)]
enum Step {
    KillOne(usize),
    KillBoth,
    Net(Fault, Option<usize>, Duration),
}

impl Step {
    fn kind(self) -> &'static str {
        match self {
            Step::KillOne(_) => "kill -9 one",
            Step::KillBoth => "kill -9 both",
            Step::Net(Fault::Stall(_), ..) => "stall",
            Step::Net(fault, ..) => fault.name(),
        }
    }
}

/// The proxies, their relays to Redis, the schedule.
struct Chaos<'a> {
    load: &'a Load,
    upstream: String,
    prefix: String,
    dir: PathBuf,
    relays: [FaultRelay; 2],
    proxies: [Option<Proxy>; 2],
    generations: [u32; 2],
    rng: StdRng,
    /// Each step's kind and span (ms since the start).
    windows: Vec<(&'static str, f64, f64)>,
    died: Vec<String>,
}

impl Chaos<'_> {
    async fn start_proxy(&mut self, slot: usize) {
        let store = format!("redis://{}/0", self.relays[slot].addr());
        let log = self.dir.join(format!(
            "proxy-{slot}-generation-{}.log",
            self.generations[slot]
        ));
        let proxy = Proxy::start_proxy(
            &self.dir,
            &self.upstream,
            &[
                "--store",
                &store,
                "--redis-prefix",
                &self.prefix,
                // One secret for every process: the scopes survive restarts.
                "--secret",
                "gateway-chaos-secret-of-32-bytes",
                "--upstream-timeout-secs",
                &UPSTREAM_TIMEOUT_SECS.to_string(),
            ],
            log,
        )
        .await;
        self.load
            .fleet
            .write()
            .unwrap_or_else(PoisonError::into_inner)[slot] = Some(proxy.url.clone());
        self.proxies[slot] = Some(proxy);
        self.load.journal.note(&format!("start proxy {slot}"));
    }

    fn kill(&mut self, slot: usize) {
        self.load
            .fleet
            .write()
            .unwrap_or_else(PoisonError::into_inner)[slot] = None;
        let mut proxy = self.proxies[slot].take().expect("the proxy runs");
        tokio::task::block_in_place(|| proxy.kill());
        self.generations[slot] += 1;
        self.load.journal.note(&format!("kill -9 proxy {slot}"));
    }

    fn check_alive(&mut self) {
        for slot in 0..2 {
            if self.proxies[slot].as_mut().is_some_and(|p| !p.is_running()) {
                let proxy = self.proxies[slot].take().expect("checked above");
                self.load
                    .fleet
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)[slot] = None;
                self.died.push(format!(
                    "proxy {slot} generation {} exited by itself; its log:\n{}",
                    self.generations[slot],
                    proxy.log()
                ));
                self.generations[slot] += 1;
            }
        }
    }

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
        let on = self
            .rng
            .random_bool(0.7)
            .then(|| self.rng.random_range(0..2));
        Step::Net(fault, on, period)
    }

    async fn step(&mut self, step: Step) {
        match step {
            Step::KillOne(slot) => {
                self.kill(slot);
                tokio::time::sleep(Duration::from_millis(self.rng.random_range(100..1_500))).await;
                self.start_proxy(slot).await;
            }
            Step::KillBoth => {
                self.kill(0);
                self.kill(1);
                tokio::time::sleep(Duration::from_millis(self.rng.random_range(100..1_000))).await;
                self.start_proxy(0).await;
                self.start_proxy(1).await;
            }
            Step::Net(fault, on, period) => {
                self.load
                    .journal
                    .note(&format!("{fault} on {on:?} for {period:?}"));
                match on {
                    Some(slot) => self.relays[slot].inject(fault, period).await,
                    None => {
                        let [a, b] = &self.relays;
                        tokio::join!(a.inject(fault, period), b.inject(fault, period));
                    }
                }
                self.load.journal.note(&format!("{fault} cleared"));
            }
        }
    }

    async fn run(&mut self) {
        let mut steps = vec![Step::KillOne(self.rng.random_range(0..2))];
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
            let gap = Duration::from_millis(self.rng.random_range(500..2_500));
            tokio::time::sleep(gap).await;
            if Instant::now() >= self.load.chaos_ends {
                break;
            }
            let step = steps
                .pop()
                .unwrap_or_else(|| match self.rng.random_range(0..100) {
                    0..25 => Step::KillOne(self.rng.random_range(0..2)),
                    25..30 => Step::KillBoth,
                    _ => self.net_step(None),
                });
            self.check_alive();
            let from = ms_since(self.load.journal.started);
            self.step(step).await;
            self.windows
                .push((step.kind(), from, ms_since(self.load.journal.started)));
        }
        self.check_alive();
    }

    fn relay_stats(&self) -> Vec<RelayStats> {
        self.relays.iter().map(FaultRelay::stats).collect()
    }
}

/// Deletes the run's keys from the shared Redis, pass or fail.
struct RedisPrefix(String);

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        let _ = std::process::Command::new("redis-cli")
            .args([
                "EVAL",
                "for _, k in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('DEL', k) end",
                "0",
                &format!("{}:*", self.0),
            ])
            .output();
    }
}

/// Per kind of step: how many, the requests sent during them, and their answers.
fn per_kind(windows: &[(&'static str, f64, f64)], attempts: &[Attempt]) -> String {
    let mut kinds: BTreeMap<&str, (usize, Vec<&Attempt>)> = BTreeMap::new();
    for (kind, ..) in windows {
        kinds.entry(kind).or_default().0 += 1;
    }
    for a in attempts.iter().filter(|a| !a.last) {
        let kind = windows
            .iter()
            .find(|(_, from, to)| (*from..=*to).contains(&a.sent_ms))
            .map_or("between steps", |w| w.0);
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

/// The checker's findings, and the figures it counts.
#[derive(Debug, Default)]
struct Findings {
    failures: Vec<String>,
    /// Keys whose request reached the upstream more than once (each time a lease apart).
    sent_again: usize,
    /// Keys acknowledged with different bytes, or with bytes the upstream never sent.
    lost_acks: HashSet<u32>,
}

/// The checks on the answers and on the upstream's record of reaches.
fn check(attempts: &[Attempt], upstream: &Upstream, findings: &mut Findings) {
    let bad: Vec<&Attempt> = attempts.iter().filter(|a| !a.allowed()).collect();
    if !bad.is_empty() {
        findings.failures.push(format!(
            "{} answers outside the contract ({:?}); the first: {:?}",
            bad.len(),
            tally(bad.iter().copied()),
            &bad[..bad.len().min(3)]
        ));
    }
    let inner = upstream.lock();
    let mut copies = HashSet::new();
    let mut created = HashSet::new();
    let mut acked: BTreeMap<u32, &Attempt> = BTreeMap::new();
    for a in attempts {
        copies.insert((a.key, a.copy));
        if a.created() {
            created.insert((a.key, a.copy));
        }
        if !a.acknowledged() {
            continue;
        }
        let first = acked.entry(a.key).or_insert(a);
        let charged = inner.charges.get(&key_name(a.key));
        if first.raw != a.raw || charged != Some(&a.raw) {
            findings.lost_acks.insert(a.key);
            findings.failures.push(format!(
                "key {} acknowledged with {:?} (first {:?}); the upstream charged {charged:?}",
                key_name(a.key),
                a.body,
                first.body
            ));
        }
    }
    let unfinished: Vec<_> = copies.difference(&created).collect();
    if !unfinished.is_empty() {
        findings.failures.push(format!(
            "{} copies got no 201, such as {:?}",
            unfinished.len(),
            &unfinished[..unfinished.len().min(5)]
        ));
    }
    if !inner.overlaps.is_empty() {
        findings.failures.push(format!(
            "keys that reached the upstream while an earlier reach still ran: {:?}",
            inner.overlaps
        ));
    }
    let min_gap = (HOLD - CLAIM_SLACK).as_secs_f64() * 1000.0;
    for (key, reaches) in &inner.reaches {
        // Recorded as they end; compared in the order they began.
        let mut reaches = reaches.clone();
        reaches.sort_by(|a, b| a.from_ms.total_cmp(&b.from_ms));
        if reaches.len() > 1 {
            findings.sent_again += 1;
        }
        for pair in reaches.windows(2) {
            if pair[1].from_ms < pair[0].to_ms {
                findings.failures.push(format!(
                    "key {key} reached the upstream before its earlier reach ended: {reaches:?}"
                ));
            }
            if pair[1].from_ms - pair[0].from_ms < min_gap {
                findings.failures.push(format!(
                    "key {key} reached the upstream again {:.0} ms after the reach before \
                     (less than a lease): {reaches:?}",
                    pair[1].from_ms - pair[0].from_ms
                ));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gateway_chaos_run_sends_each_key_upstream_as_promised() {
    let (chaos_for, seed, keep) = settings();
    let dir = tempfile::Builder::new()
        .prefix("idem-gateway-chaos-")
        .tempdir()
        .expect("temp dir")
        .keep();
    let log_path = dir.join("attempts.jsonl");
    eprintln!(
        "gateway chaos run: {chaos_for:?} of chaos, seed {seed} (IDEM_CHAOS_SEED={seed} replays \
         the schedule); log {}",
        log_path.display()
    );
    let started = Instant::now();
    let prefix = RedisPrefix(format!("idem-gw-chaos-{}-{seed}", std::process::id()));
    let (upstream_url, upstream) = start_upstream(started).await;
    let redis: std::net::SocketAddr = "127.0.0.1:6379".parse().unwrap();
    let chaos_ends = Instant::now() + chaos_for;
    let load = Arc::new(Load {
        http: reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(ATTEMPT_TIMEOUT)
            .build()
            .expect("an HTTP client"),
        fleet: RwLock::default(),
        journal: Journal {
            started,
            inner: Mutex::new((
                Vec::new(),
                BufWriter::new(File::create(&log_path).expect("create the log")),
            )),
        },
        seed,
        backoff: RetryPolicy {
            base: Duration::from_millis(25),
            cap: Duration::from_secs(1),
            max_attempts: u32::MAX,
            ..RetryPolicy::default()
        },
        chaos_ends,
        gives_up: chaos_ends + SETTLE,
        next_key: AtomicU32::new(0),
        late: Mutex::default(),
    });
    let relay = |n: u8| FaultRelay::start(redis, sub_seed(seed, u32::MAX, n));
    let mut chaos = Chaos {
        load: &load,
        upstream: upstream_url,
        prefix: prefix.0.clone(),
        dir: dir.clone(),
        relays: [relay(0).await.unwrap(), relay(1).await.unwrap()],
        proxies: [None, None],
        generations: [0, 0],
        rng: StdRng::seed_from_u64(seed),
        windows: Vec::new(),
        died: Vec::new(),
    };
    chaos.start_proxy(0).await;
    chaos.start_proxy(1).await;

    let workers: Vec<_> = (0..KEY_WORKERS)
        .map(|_| tokio::spawn(load.clone().worker()))
        .collect();
    chaos.run().await;
    let chaos_took = started.elapsed();
    for worker in workers {
        worker.await.expect("a client worker panicked");
    }
    let late = std::mem::take(&mut *load.late.lock().unwrap_or_else(PoisonError::into_inner));
    for copy in late {
        copy.await.expect("a late copy panicked");
    }
    let during = load.journal.attempts();
    let keys: Vec<u32> = during
        .iter()
        .map(|a| a.key)
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let finals: Vec<Attempt> = futures_util::stream::iter(keys.iter().copied())
        .map(|key| {
            let load = load.clone();
            async move { load.final_replay(key).await }
        })
        .buffer_unordered(32)
        .flat_map(futures_util::stream::iter)
        .collect()
        .await;
    let all = load.journal.attempts();

    let mut findings = Findings::default();
    check(&all, &upstream, &mut findings);
    // The final replays by key, in order: linear in their number, for the long runs.
    let mut finals_by_key: HashMap<u32, Vec<&Attempt>> = HashMap::new();
    for a in &finals {
        finals_by_key.entry(a.key).or_default().push(a);
    }
    let sent_again_at_the_end = finals_by_key
        .values()
        .filter(|seen| seen.iter().any(|a| a.created() && !a.replayed))
        .count();
    for key in &keys {
        let last = finals_by_key.get(key).and_then(|seen| seen.last());
        if !last.is_some_and(|a| a.created() && a.replayed) {
            findings.failures.push(format!(
                "key {} does not replay after the run: {last:?}",
                key_name(*key)
            ));
        }
    }
    chaos.check_alive();
    findings.failures.extend(chaos.died.iter().cloned());
    for slot in 0..2 {
        if let Some(proxy) = &chaos.proxies[slot]
            && proxy.log().contains("panicked")
        {
            findings
                .failures
                .push(format!("proxy {slot} panicked:\n{}", proxy.log()));
        }
    }

    let reaches: usize = upstream.lock().reaches.values().map(Vec::len).sum();
    let cut_reaches = upstream
        .lock()
        .reaches
        .values()
        .flatten()
        .filter(|r| r.cut)
        .count();
    eprintln!(
        "gateway chaos run figures (seed {seed}): {chaos_took:.1?} of chaos, {:.1?} wall time; \
         {} keys, {} requests during the run ({:.0} requests/s), answers {:?}; final replays \
         {:?}; upstream reached {reaches} times ({cut_reaches} cut off by a kill), {} keys \
         reached more than once (a lease apart), {sent_again_at_the_end} of them sent again by \
         the final replay; {} lost acknowledgements; relays {:?}; {} failures\n\
         per kind of chaos:\n{}",
        started.elapsed(),
        keys.len(),
        during.len(),
        during.len() as f64 / chaos_took.as_secs_f64(),
        tally(&during),
        tally(&finals),
        findings.sent_again,
        findings.lost_acks.len(),
        chaos.relay_stats(),
        findings.failures.len(),
        per_kind(&chaos.windows, &during),
    );
    assert!(
        findings.failures.is_empty(),
        "the gateway chaos run failed (log and proxy logs kept in {}):\n{}",
        dir.display(),
        findings
            .failures
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    let kinds: HashSet<&str> = chaos.windows.iter().map(|w| w.0).collect();
    for kind in ["kill -9 one", "latency", "stall", "reset", "black hole"] {
        assert!(
            kinds.contains(kind),
            "the run had no {kind}: {:?}",
            chaos.windows
        );
    }
    drop(chaos);
    if !keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
