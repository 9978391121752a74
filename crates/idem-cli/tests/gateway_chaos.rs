//! The gateway's chaos run: two `idem proxy` processes on one Redis, each reaching it through
//! a fault relay of its own ([`idem_testkit::fault_relay`]), in front of an upstream of the
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
//! The load, the journal, the schedule and the settings are the `chaos` run's own modules
//! (`tests/chaos/`), with clients and a target of this run: no cut copies, `idem proxy` on
//! Redis, no database crash. `IDEM_CHAOS_SECS`, `IDEM_CHAOS_SEED` and `IDEM_CHAOS_KEEP` work
//! as in the `chaos` run.
//!
//! ```text
//! IDEM_CHAOS_SECS=300 cargo test -p idem-cli --test gateway_chaos -- --nocapture
//! ```

use crate::chaos::journal;
use crate::chaos::load;
use crate::chaos::schedule;
use crate::chaos::settings;
use crate::common::RedisPrefix;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use bytes::Bytes;
use futures_util::StreamExt;
use idem_testkit::fault_relay::LATENCY_MAX;
use journal::{Attempt, Via, tally};
use load::{Clients, Load};
use schedule::{Chaos, MAX_NET_FAULT, Target, per_kind};
use settings::{Settings, first_failures};
use tokio::time::Instant;

/// Seconds of chaos by default (the schedule goes on until its first steps, one of each kind,
/// have run): with the start, the settling (a lease, for the keys whose outcome went unstored)
/// and the final replays, about a minute.
const DEFAULT_SECS: u64 = 25;

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

/// An attempt unanswered after this hung: the gateway's bound plus the longest a fault holds
/// its commands (its period, then one chunk still held each way by a latency spike).
const ATTEMPT_TIMEOUT: Duration = GATEWAY_BOUND
    .saturating_add(MAX_NET_FAULT)
    .saturating_add(LATENCY_MAX.saturating_mul(2));

/// After the chaos, how long copies may take to get their `201`: a claim's hold (a key whose
/// outcome went unstored is sent again after it) and a margin.
const SETTLE: Duration = HOLD.saturating_add(Duration::from_secs(20));

/// The clients: many intents in flight at once (`workers`), since a copy that meets its key
/// in flight waits the `409`'s `Retry-After` (a second) and the machine mostly idles
/// meanwhile; no copy cut off.
const CLIENTS: Clients = Clients {
    workers: 96,
    copies: 2..=4,
    cut_chance: None,
    path: "/charges",
    token: "sk_test_gateway",
    key_prefix: "gw-chaos-",
    attempt_timeout: ATTEMPT_TIMEOUT,
    settle: SETTLE,
};

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

/// The checker's replay of `key` after the run: until a replayed `201`, so a key whose last
/// outcome went unstored is seen sent again once its lease ran out, and then stored.
async fn final_replay(load: &Load, key: u32) -> Vec<Attempt> {
    let slot = (key % 2) as usize;
    let route = load
        .fleet
        .get(slot)
        .expect("both proxies run after the chaos");
    let until = Instant::now() + HOLD + Duration::from_secs(10);
    let mut seen = Vec::new();
    for attempt in 1.. {
        let answer = load.send(key, 0, attempt, Via::Final, &route).await;
        let done = (answer.created() && answer.replayed) || !answer.allowed();
        seen.push(answer);
        if done || Instant::now() >= until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    seen
}

/// The logs of the proxies still running, by slot (after [`Chaos::check_alive`]): the checker
/// looks in them for a panic.
fn running_logs(chaos: &mut Chaos<'_>) -> Vec<(usize, String)> {
    chaos.check_alive();
    (0..2)
        .filter_map(|slot| Some((slot, chaos.instances[slot].as_ref()?.log())))
        .collect()
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
fn check(load: &Load, attempts: &[Attempt], upstream: &Upstream, findings: &mut Findings) {
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
        let charged = inner.charges.get(&load.key_name(a.key));
        if first.raw != a.raw || charged != Some(&a.raw) {
            findings.lost_acks.insert(a.key);
            findings.failures.push(format!(
                "key {} acknowledged with {:?} (first {:?}); the upstream charged {charged:?}",
                load.key_name(a.key),
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
    let settings = Settings::from_env(DEFAULT_SECS);
    let (chaos_for, seed) = (settings.chaos, settings.seed);
    let dir = Settings::new_dir("idem-gateway-chaos-");
    let log_path = dir.join("attempts.jsonl");
    eprintln!(
        "gateway chaos run: {chaos_for:?} of chaos, seed {seed} (IDEM_CHAOS_SEED={seed} replays \
         the schedule); log {}",
        log_path.display()
    );
    let started = Instant::now();
    let prefix = RedisPrefix(format!("idem-gw-chaos-{}-{seed}", std::process::id()));
    let (upstream_url, upstream) = start_upstream(started).await;
    let load = Arc::new(Load::new(&settings, CLIENTS, &log_path));
    let target = Target::Proxy {
        redis: "127.0.0.1:6379".parse().unwrap(),
        upstream: upstream_url,
        args: [
            "--redis-prefix",
            &prefix.0,
            // One secret for every process: the scopes survive restarts.
            "--secret",
            "gateway-chaos-secret-of-32-bytes",
            "--upstream-timeout-secs",
            &UPSTREAM_TIMEOUT_SECS.to_string(),
        ]
        .map(str::to_owned)
        .into(),
    };
    let mut chaos = Chaos::start(target, &load, seed, &dir).await;

    let chaos_over = load.under(chaos.run()).await;
    let chaos_took = chaos_over - started;
    let during = load.journal.attempts();
    let keys: Vec<u32> = during
        .iter()
        .map(|a| a.key)
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let finals: Vec<Attempt> = futures_util::stream::iter(keys.iter().copied())
        .map(|key| final_replay(&load, key))
        .buffer_unordered(32)
        .flat_map(futures_util::stream::iter)
        .collect()
        .await;
    let all = load.journal.attempts();
    load.journal.flush();

    let mut findings = Findings::default();
    check(&load, &all, &upstream, &mut findings);
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
                load.key_name(*key)
            ));
        }
    }
    let running_logs = running_logs(&mut chaos);
    let figures = chaos.finish();
    findings.failures.extend(figures.died.iter().cloned());
    for (slot, log) in running_logs {
        if log.contains("panicked") {
            findings
                .failures
                .push(format!("proxy {slot} panicked:\n{log}"));
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
        figures.relays,
        findings.failures.len(),
        per_kind(&figures.windows, &during),
    );
    assert!(
        findings.failures.is_empty(),
        "the gateway chaos run failed (log and proxy logs kept in {}):\n{}",
        dir.display(),
        first_failures(&findings.failures)
    );
    let kinds: HashSet<&str> = figures.windows.iter().map(|w| w.kind).collect();
    for kind in ["kill -9 one", "latency", "stall", "reset", "black hole"] {
        assert!(
            kinds.contains(kind),
            "the run had no {kind}: {:?}",
            figures.windows
        );
    }
    settings.passed(&dir);
}
