//! The process side of a run: the instances (`idem serve` on the run's PostgreSQL cluster, or
//! `idem proxy` on Redis in the gateway's run), the fault relays between them and their store,
//! and the seeded schedule of kills, crashes and network faults.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::{Deref, DerefMut, Range};
use std::path::Path;
use std::time::Duration;

use idem_testkit::fault_relay::{Direction, Fault, FaultRelay, RelayStats};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;

use crate::chaos::journal::{Attempt, Via, tally};
use crate::chaos::load::{Load, Route, sub_seed};
use crate::common::processes::{Cluster, Idem, Proxy, Serve};

/// A session idle inside a transaction for longer than this, seen during the run, is a leak: a
/// request's transaction is idle only between its own statements, for milliseconds.
pub(crate) const LINGER_SECS: i64 = 15;

/// What the schedule starts, kills and restarts, and the store behind their relays.
#[allow(dead_code)] // each test binary (`chaos`, `gateway_chaos`) builds one of the two
pub(crate) enum Target<'a> {
    /// `idem serve` on the run's own PostgreSQL cluster, which the schedule crashes too and
    /// watches for sessions left idle in a transaction.
    Serve(&'a Cluster),
    /// `idem proxy` in front of `upstream`, on the Redis at `redis`, with `args` after its
    /// `--store` (the key prefix, the secret…). Redis keeps running: a restart of one that
    /// keeps nothing on disk forgets every key, which is outside what the gateway promises.
    Proxy {
        redis: SocketAddr,
        upstream: String,
        args: Vec<String>,
    },
}

impl Target<'_> {
    /// What the figures and the failures call one of the processes.
    fn noun(&self) -> &'static str {
        match self {
            Target::Serve(_) => "instance",
            Target::Proxy { .. } => "proxy",
        }
    }

    /// The pause between two steps: long enough for the load to meet the last one's aftermath.
    fn gaps(&self) -> Range<u64> {
        match self {
            Target::Serve(_) => 1_000..4_000,
            Target::Proxy { .. } => 500..2_500,
        }
    }
}

/// A running instance of either kind.
#[allow(dead_code)] // each test binary starts one of the two
pub(crate) enum Instance {
    Serve(Serve),
    Proxy(Proxy),
}

impl Deref for Instance {
    type Target = Idem;
    fn deref(&self) -> &Idem {
        match self {
            Instance::Serve(serve) => serve,
            Instance::Proxy(proxy) => proxy,
        }
    }
}

impl DerefMut for Instance {
    fn deref_mut(&mut self) -> &mut Idem {
        match self {
            Instance::Serve(serve) => serve,
            Instance::Proxy(proxy) => proxy,
        }
    }
}

/// What the chaos schedule did.
#[derive(Debug, Default)]
pub(crate) struct Figures {
    pub(crate) kills: usize,
    pub(crate) instance_restarts: usize,
    pub(crate) pg_restarts: usize,
    /// Every step, as the kind of chaos and the time it lasted, for the figures per kind.
    pub(crate) windows: Vec<Window>,
    /// What the relays did (connections, resets, delayed chunks), per relay.
    pub(crate) relays: Vec<RelayStats>,
    /// Sessions seen idle in a transaction for longer than `LINGER_SECS` during the run.
    pub(crate) lingering: Vec<String>,
    /// Instances that exited without being killed, with their logs.
    pub(crate) died: Vec<String>,
}

/// One step of the schedule, from its start to its end, in milliseconds since the run began.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    pub(crate) kind: &'static str,
    pub(crate) from_ms: f64,
    pub(crate) to_ms: f64,
}

/// The process side of the run: the instances, the relays between them and their store, the
/// seeded schedule.
pub(crate) struct Chaos<'a> {
    pub(crate) target: Target<'a>,
    pub(crate) load: &'a Load,
    /// Relay `i` carries every connection of instance slot `i` to the store, across restarts.
    pub(crate) relays: [FaultRelay; 2],
    pub(crate) instances: [Option<Instance>; 2],
    pub(crate) generations: [u32; 2],
    pub(crate) rng: StdRng,
    pub(crate) dir: &'a Path,
    pub(crate) figures: Figures,
    pub(crate) watcher: Option<PgConnection>,
}

/// One step of the schedule.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Step {
    /// SIGKILL one instance, restart it after `down`.
    KillOne(usize),
    /// Both at once: for a while no instance answers at all.
    KillBoth,
    /// PostgreSQL stops with `-m immediate`, starts again after `down` (`idem serve` only).
    CrashPostgres,
    /// PostgreSQL crashes, and an instance is killed while it is down.
    CrashPostgresAndKill(usize),
    /// A network fault between instances and their store, for `period`.
    Net(Fault, Relays, Duration),
}

/// Which relays a network fault is on.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Relays {
    One(usize),
    Both,
}

impl Relays {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Relays::One(0) => "0",
            Relays::One(_) => "1",
            Relays::Both => "both",
        }
    }
}

impl Step {
    /// The kind of chaos, as the figures count it.
    pub(crate) fn kind(self) -> &'static str {
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
pub(crate) const MAX_NET_FAULT: Duration = Duration::from_secs(5);

impl<'a> Chaos<'a> {
    /// Starts the relays to the target's store and both instances.
    pub(crate) async fn start(
        target: Target<'a>,
        load: &'a Load,
        seed: u64,
        dir: &'a Path,
    ) -> Self {
        let store = match &target {
            Target::Serve(cluster) => cluster.addr(),
            Target::Proxy { redis, .. } => *redis,
        };
        let relay = |n: u64| FaultRelay::start(store, sub_seed(seed, u32::MAX, n as u8));
        let relays = [
            relay(0).await.expect("a relay"),
            relay(1).await.expect("a relay"),
        ];
        let mut chaos = Self {
            target,
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

    pub(crate) fn route(&self, slot: usize) -> (usize, u32, u16) {
        let port = self.load.fleet.get(slot).map_or(0, |r| r.port);
        (slot, self.generations[slot], port)
    }

    pub(crate) async fn start_instance(&mut self, slot: usize) {
        let store = self.relays[slot].addr();
        let instance = match &self.target {
            Target::Serve(_) => {
                let database = format!("postgres://postgres@{store}/postgres");
                Instance::Serve(Serve::start(&database).await)
            }
            Target::Proxy { upstream, args, .. } => {
                let store = format!("redis://{store}/0");
                let mut all = vec!["--store", &store];
                all.extend(args.iter().map(String::as_str));
                let log = self.dir.join(format!(
                    "proxy-{slot}-generation-{}.log",
                    self.generations[slot]
                ));
                Instance::Proxy(Proxy::start_proxy(self.dir, upstream, &all, log).await)
            }
        };
        let port = instance
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
                url: instance.url.clone(),
                port,
            }),
        );
        self.instances[slot] = Some(instance);
        self.load.journal.event("start", Some(self.route(slot)));
    }

    pub(crate) fn kill(&mut self, slot: usize) {
        let route = self.route(slot);
        let mut instance = self.instances[slot].take().expect("the instance runs");
        // Out of the table first: a client that picked it just before still meets the kill.
        self.load.fleet.set(slot, None);
        tokio::task::block_in_place(|| instance.kill());
        self.save_log(slot, &instance);
        self.generations[slot] += 1;
        self.figures.kills += 1;
        self.load.journal.event("kill -9", Some(route));
    }

    pub(crate) async fn restart(&mut self, slot: usize) {
        self.start_instance(slot).await;
        self.figures.instance_restarts += 1;
    }

    /// The run's cluster; only `idem serve` has one, and only its schedule crashes it.
    pub(crate) fn cluster(&self) -> &'a Cluster {
        match self.target {
            Target::Serve(cluster) => cluster,
            Target::Proxy { .. } => unreachable!("the gateway's run has no database to crash"),
        }
    }

    pub(crate) fn crash_postgres(&mut self) {
        self.watcher = None;
        let cluster = self.cluster();
        tokio::task::block_in_place(|| cluster.crash());
        self.load.journal.event("postgres stop -m immediate", None);
    }

    pub(crate) fn start_postgres(&mut self) {
        let cluster = self.cluster();
        tokio::task::block_in_place(|| cluster.start_again());
        self.figures.pg_restarts += 1;
        self.load.journal.event("postgres start", None);
    }

    /// Keeps an instance's log in the run's directory: `idem serve` writes it into a directory
    /// of its own, which goes with it; a proxy writes it there already.
    pub(crate) fn save_log(&self, slot: usize, instance: &Instance) {
        if let Instance::Serve(serve) = instance {
            let path = self.dir.join(format!(
                "instance-{slot}-generation-{}.log",
                self.generations[slot]
            ));
            std::fs::write(path, serve.log()).expect("save an instance's log");
        }
    }

    pub(crate) fn down_time(&mut self, max_ms: u64) -> Duration {
        Duration::from_millis(self.rng.random_range(100..=max_ms))
    }

    /// Runs the schedule for the load's `chaos_for`, and past it until its first steps are
    /// done; leaves both instances and their store up.
    pub(crate) async fn run(&mut self) {
        // The first steps are one kill, one crash (of PostgreSQL, where there is one) and one
        // of each network fault, in a random order, so that even a short run has them all;
        // then steps at random. They run however long they take (the gaps, a restart on a
        // loaded machine): the run asserts that it had every kind.
        let crashes = matches!(self.target, Target::Serve(_));
        let mut steps = vec![Step::KillOne(self.rng.random_range(0..2))];
        if crashes {
            steps.push(Step::CrashPostgres);
        }
        for fault in [
            Fault::Latency,
            Fault::Stall(Direction::Both),
            Fault::Reset,
            Fault::BlackHole,
        ] {
            steps.push(self.net_step(Some(fault)));
        }
        steps.shuffle(&mut self.rng);
        // From here, not from before the instances started: the chaos gets all of its time.
        let ends = Instant::now() + self.load.chaos_for;
        while Instant::now() < ends || !steps.is_empty() {
            let gap = Duration::from_millis(self.rng.random_range(self.target.gaps()));
            self.watch_until(Instant::now() + gap).await;
            if Instant::now() >= ends && steps.is_empty() {
                break;
            }
            let step = steps.pop().unwrap_or_else(|| {
                let slot = self.rng.random_range(0..2);
                match self.rng.random_range(0..100) {
                    0..25 => Step::KillOne(slot),
                    25..30 => Step::KillBoth,
                    30..45 if crashes => Step::CrashPostgres,
                    45..50 if crashes => Step::CrashPostgresAndKill(slot),
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
    pub(crate) fn net_step(&mut self, fault: Option<Fault>) -> Step {
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

    pub(crate) async fn net_fault(&mut self, fault: Fault, on: Relays, period: Duration) {
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

    pub(crate) async fn step(&mut self, step: Step) {
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
    pub(crate) fn check_alive(&mut self) {
        for slot in 0..2 {
            let exited = self.instances[slot]
                .as_mut()
                .is_some_and(|instance| !instance.is_running());
            if exited {
                let instance = self.instances[slot].take().expect("checked above");
                self.load.fleet.set(slot, None);
                self.save_log(slot, &instance);
                self.figures.died.push(format!(
                    "{} {slot} generation {} exited by itself; its log:\n{}",
                    self.target.noun(),
                    self.generations[slot],
                    instance.log()
                ));
                self.generations[slot] += 1;
            }
        }
    }

    /// Waits until `until`, looking every second for sessions idle in a transaction for
    /// longer than any request takes (where there is a database to look in).
    pub(crate) async fn watch_until(&mut self, until: Instant) {
        let Target::Serve(cluster) = self.target else {
            tokio::time::sleep_until(until).await;
            return;
        };
        loop {
            let now = Instant::now();
            if now >= until {
                return;
            }
            tokio::time::sleep((until - now).min(Duration::from_secs(1))).await;
            self.look_for_lingering(cluster).await;
        }
    }

    pub(crate) async fn look_for_lingering(&mut self, cluster: &Cluster) {
        if self.watcher.is_none() {
            self.watcher = PgConnection::connect(&cluster.url).await.ok();
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
    pub(crate) fn finish(mut self) -> Figures {
        self.check_alive();
        self.figures.relays = self.relays.iter().map(FaultRelay::stats).collect();
        for slot in 0..2 {
            if let Some(instance) = self.instances[slot].take() {
                self.save_log(slot, &instance);
            }
        }
        self.figures
    }
}

/// Per kind of chaos step: how many steps, how many attempts were sent during them, and their
/// answers; and the same for the attempts sent between steps.
pub(crate) fn per_kind(windows: &[Window], attempts: &[Attempt]) -> String {
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
