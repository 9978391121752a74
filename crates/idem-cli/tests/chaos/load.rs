//! The load: payment intents, each sent as several concurrent copies retried until their
//! `201`, some cut off mid-request on a raw socket, some sent again after their answer. Both
//! chaos runs (`chaos` and `gateway_chaos`) drive it, each with [`Clients`] of its own.

use std::future::Future;
use std::ops::RangeInclusive;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use idem_client::RetryPolicy;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::chaos::journal::{Attempt, Cut, Journal, Process, Via};
use crate::chaos::settings::Settings;

/// The chance that a copy is sent again a little after it got its `201` (a client that lost
/// the answer, or a user pressing "pay" twice): it must replay.
pub(crate) const LATE_RETRY_CHANCE: f64 = 0.2;

/// What a run's clients send, and how many: the part of the load that differs between runs.
#[derive(Debug, Clone)]
pub(crate) struct Clients {
    /// Intents in flight at once, each with its copies.
    pub(crate) workers: usize,
    /// Copies of each key sent at once.
    pub(crate) copies: RangeInclusive<u8>,
    /// The chance that a copy's first attempt is cut off on a raw socket; `None`, never (and
    /// no draw for it from the copy's plan).
    pub(crate) cut_chance: Option<f64>,
    /// Every attempt is `POST {path}` with this bearer token.
    pub(crate) path: &'static str,
    pub(crate) token: &'static str,
    /// Key `n` is sent as `{key_prefix}{n:07}`.
    pub(crate) key_prefix: &'static str,
    /// An attempt still unanswered after this counts as hung.
    pub(crate) attempt_timeout: Duration,
    /// After the chaos ends, how long the copies still running may take to get their `201`.
    pub(crate) settle: Duration,
}

/// Where a live instance listens.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    pub(crate) slot: usize,
    pub(crate) generation: u32,
    pub(crate) url: String,
    pub(crate) port: u16,
}

/// The instances clients may send to: a killed one leaves the table until its restart, as
/// behind a load balancer with health checks.
#[derive(Debug, Default)]
pub(crate) struct Fleet {
    pub(crate) routes: RwLock<[Option<Route>; 2]>,
}

impl Fleet {
    pub(crate) fn set(&self, slot: usize, route: Option<Route>) {
        self.routes.write().unwrap_or_else(PoisonError::into_inner)[slot] = route;
    }

    /// A live instance chosen at random, `None` while both are down.
    pub(crate) fn pick(&self, rng: &mut StdRng) -> Option<Route> {
        let routes = self.routes.read().unwrap_or_else(PoisonError::into_inner);
        let live: Vec<&Route> = routes.iter().flatten().collect();
        (!live.is_empty()).then(|| live[rng.random_range(0..live.len())].clone())
    }

    pub(crate) fn get(&self, slot: usize) -> Option<Route> {
        self.routes.read().unwrap_or_else(PoisonError::into_inner)[slot].clone()
    }
}

/// What every client task shares.
pub(crate) struct Load {
    pub(crate) clients: Clients,
    pub(crate) http: reqwest::Client,
    pub(crate) fleet: Fleet,
    pub(crate) journal: Journal,
    pub(crate) seed: u64,
    pub(crate) backoff: RetryPolicy,
    /// The chaos lasts at least this long: the schedule runs until it is up and every kind
    /// of step it must have has run.
    pub(crate) chaos_for: Duration,
    /// When the schedule ended ([`Load::under`] sets it): no new key starts after it, and a
    /// copy still without its `201` gives up `clients.settle` after it (the checker then
    /// fails the run).
    pub(crate) chaos_over: OnceLock<Instant>,
    pub(crate) next_key: AtomicU32,
    pub(crate) attempts: AtomicU64,
    /// The late copies, each in a task of its own so that its key's worker moves on.
    pub(crate) late: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

/// The same bytes on every attempt of a key: the fingerprint covers the body (canonicalised)
/// and the content type.
pub(crate) fn body_of(key: u32) -> String {
    format!(r#"{{"amount":{},"currency":"EUR"}}"#, 100 + u64::from(key))
}

/// A seed of its own for each key and copy, derived from the run's seed, so a run's plan is
/// reproducible whatever order the tasks run in.
pub(crate) fn sub_seed(seed: u64, key: u32, copy: u8) -> u64 {
    seed ^ ((u64::from(key) << 8) | u64::from(copy)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Load {
    /// The clients of a run on `settings`, logging to `log_path`.
    pub(crate) fn new(settings: &Settings, clients: Clients, log_path: &Path) -> Self {
        Self {
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .timeout(clients.attempt_timeout)
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
            chaos_for: settings.chaos,
            chaos_over: OnceLock::new(),
            next_key: AtomicU32::new(0),
            attempts: AtomicU64::new(0),
            late: Mutex::default(),
            clients,
        }
    }

    /// The name key `key` is sent with.
    pub(crate) fn key_name(&self, key: u32) -> String {
        format!("{}{key:07}", self.clients.key_prefix)
    }

    /// The workers, while `schedule` runs the chaos; then waits for them and the late copies.
    /// Returns when the schedule ended.
    pub(crate) async fn under(self: &Arc<Self>, schedule: impl Future<Output = ()>) -> Instant {
        let workers: Vec<_> = (0..self.clients.workers)
            .map(|_| tokio::spawn(self.clone().worker()))
            .collect();
        schedule.await;
        let ended = Instant::now();
        self.chaos_over
            .set(ended)
            .expect("one schedule runs under a load");
        for worker in workers {
            worker.await.expect("a client worker panicked");
        }
        self.late_copies().await;
        ended
    }

    /// Takes keys one after another until the schedule ends.
    pub(crate) async fn worker(self: Arc<Self>) {
        while self.chaos_over.get().is_none() {
            let key = self.next_key.fetch_add(1, Ordering::Relaxed);
            self.key(key).await;
        }
    }

    /// All copies of one key, at once.
    pub(crate) async fn key(self: &Arc<Self>, key: u32) {
        let copies = StdRng::seed_from_u64(sub_seed(self.seed, key, 0))
            .random_range(self.clients.copies.clone());
        join_all((1..=copies).map(|copy| self.copy(key, copy))).await;
    }

    /// One copy of a key: maybe a cut-off first attempt, then attempts until a `201`, then
    /// maybe the same request again later.
    pub(crate) async fn copy(self: &Arc<Self>, key: u32, copy: u8) {
        let mut rng = StdRng::seed_from_u64(sub_seed(self.seed, key, copy));
        let mut attempt = 0;
        // A little stagger: some copies arrive while the first is running, some just after.
        tokio::time::sleep(Duration::from_micros(rng.random_range(0..20_000))).await;
        if self
            .clients
            .cut_chance
            .is_some_and(|chance| rng.random_bool(chance))
        {
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
    pub(crate) async fn late_copies(&self) {
        let late = std::mem::take(&mut *self.late.lock().unwrap_or_else(PoisonError::into_inner));
        for copy in late {
            copy.await.expect("a late copy panicked");
        }
    }

    /// Sends the copy until it gets a `201`, as a retrying client would: after `Retry-After`
    /// when the answer has one, else after a jittered backoff; to any live instance. Returns
    /// whether it got the `201`.
    pub(crate) async fn until_created(
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
            if self.gave_up() {
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

    /// Whether a copy still without its `201` gives up: `clients.settle` after the schedule
    /// ended, never while it runs.
    fn gave_up(&self) -> bool {
        self.chaos_over
            .get()
            .is_some_and(|&over| Instant::now() >= over + self.clients.settle)
    }

    /// One whole attempt over HTTP, recorded.
    pub(crate) async fn send(
        &self,
        key: u32,
        copy: u8,
        attempt: u32,
        via: Via,
        route: &Route,
    ) -> Attempt {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let sent = Instant::now();
        let result = async {
            let response = self
                .http
                .post(format!("{}{}", route.url, self.clients.path))
                .header(AUTHORIZATION, format!("Bearer {}", self.clients.token))
                .header(CONTENT_TYPE, "application/json")
                .header("idempotency-key", self.key_name(key))
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
        let mut seen = self.unanswered((key, copy, attempt), via, route, sent);
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
                seen.error = Some(idem_core::ErrorChain(&e).to_string());
            }
        }
        self.journal.attempt(seen.clone());
        seen
    }

    /// Writes the first bytes of the request to a raw socket and closes it: somewhere in the
    /// head, in the body, or after the whole request (then the service may well commit the
    /// payment, and the copy's retry must replay it).
    pub(crate) async fn cut(&self, key: u32, copy: u8, attempt: u32, rng: &mut StdRng) {
        let Some(route) = self.fleet.pick(rng) else {
            return;
        };
        let body = body_of(key);
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nAuthorization: Bearer {}\r\n\
             Content-Type: application/json\r\nIdempotency-Key: {}\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            self.clients.path,
            route.port,
            self.clients.token,
            self.key_name(key),
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
        let mut cut = self.unanswered((key, copy, attempt), Via::Cut, &route, sent);
        cut.error = written.err().map(|e| e.to_string());
        cut.cut = Some(Cut {
            cut_at,
            head_len: head.len(),
            request_len: request.len(),
        });
        self.journal.attempt(cut);
    }

    /// The record of attempt `attempt` of copy `copy` of `key`, sent at `sent` through `route`
    /// and done now, with no answer: the caller adds what came back.
    fn unanswered(
        &self,
        (key, copy, attempt): (u32, u8, u32),
        via: Via,
        route: &Route,
        sent: Instant,
    ) -> Attempt {
        Attempt {
            key,
            copy,
            attempt,
            via,
            on: Process {
                instance: route.slot,
                generation: route.generation,
                port: route.port,
            },
            sent_ms: self.journal.ms(sent),
            done_ms: self.journal.ms(Instant::now()),
            status: None,
            retry_after: None,
            replayed: false,
            body: String::new(),
            raw: Bytes::new(),
            error: None,
            timed_out: false,
            cut: None,
        }
    }
}
