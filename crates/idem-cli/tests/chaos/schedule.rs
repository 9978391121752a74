//! The process side of the run: the cluster, the instances, the fault relays between them
//! and the cluster, and the seeded schedule of kills, crashes and network faults.

use super::*;

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

/// The process side of the run: the cluster, the instances, the relays between them and the
/// cluster, the seeded schedule.
pub(crate) struct Chaos<'a> {
    pub(crate) cluster: &'a Cluster,
    pub(crate) load: &'a Load,
    /// Relay `i` carries every connection of instance slot `i` to PostgreSQL, across restarts.
    pub(crate) relays: [FaultRelay; 2],
    pub(crate) instances: [Option<Serve>; 2],
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
    /// PostgreSQL stops with `-m immediate`, starts again after `down`.
    CrashPostgres,
    /// PostgreSQL crashes, and an instance is killed while it is down.
    CrashPostgresAndKill(usize),
    /// A network fault between instances and PostgreSQL, for `period`.
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
    pub(crate) async fn start(
        cluster: &'a Cluster,
        load: &'a Load,
        seed: u64,
        dir: &'a Path,
    ) -> Self {
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

    pub(crate) fn route(&self, slot: usize) -> (usize, u32, u16) {
        let port = self.load.fleet.get(slot).map_or(0, |r| r.port);
        (slot, self.generations[slot], port)
    }

    pub(crate) async fn start_instance(&mut self, slot: usize) {
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

    pub(crate) fn kill(&mut self, slot: usize) {
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

    pub(crate) async fn restart(&mut self, slot: usize) {
        self.start_instance(slot).await;
        self.figures.instance_restarts += 1;
    }

    pub(crate) fn crash_postgres(&mut self) {
        self.watcher = None;
        tokio::task::block_in_place(|| self.cluster.crash());
        self.load.journal.event("postgres stop -m immediate", None);
    }

    pub(crate) fn start_postgres(&mut self) {
        tokio::task::block_in_place(|| self.cluster.start_again());
        self.figures.pg_restarts += 1;
        self.load.journal.event("postgres start", None);
    }

    pub(crate) fn save_log(&self, slot: usize, serve: &Serve) {
        let path = self.dir.join(format!(
            "instance-{slot}-generation-{}.log",
            self.generations[slot]
        ));
        std::fs::write(path, serve.log()).expect("save an instance's log");
    }

    pub(crate) fn down_time(&mut self, max_ms: u64) -> Duration {
        Duration::from_millis(self.rng.random_range(100..=max_ms))
    }

    /// Runs the schedule until the chaos ends; leaves both instances and PostgreSQL up.
    pub(crate) async fn run(&mut self) {
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
    pub(crate) async fn watch_until(&mut self, until: Instant) {
        loop {
            let now = Instant::now();
            if now >= until {
                return;
            }
            tokio::time::sleep((until - now).min(Duration::from_secs(1))).await;
            self.look_for_lingering().await;
        }
    }

    pub(crate) async fn look_for_lingering(&mut self) {
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
    pub(crate) fn finish(mut self) -> Figures {
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
