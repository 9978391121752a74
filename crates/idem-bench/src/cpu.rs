//! CPU time per component, read from `/proc` before and after each run. Throughput on a shared
//! machine moves with the neighbours' load; the CPU a request costs moves much less, and says
//! where the time goes (idem's threads, PostgreSQL, Redis, a peer's process, the load
//! generator, the latency relay).

use std::collections::BTreeMap;
use std::fs;

/// Which component a thread or process belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Component {
    /// The server under test: idem's threads (and SQLite's), or a peer's process.
    Subject,
    /// The fast upstream behind a proxy.
    Upstream,
    /// The load generator (the harness's client, or pgbench).
    Load,
    /// Every PostgreSQL backend.
    Postgres,
    /// The Redis server.
    Redis,
    /// The latency relay between the servers and their database (it stands in for the
    /// network, so it is not counted as serving).
    Relay,
}

impl Component {
    fn name(self) -> &'static str {
        match self {
            Component::Subject => "subject",
            Component::Upstream => "upstream",
            Component::Load => "load",
            Component::Postgres => "postgres",
            Component::Redis => "redis",
            Component::Relay => "relay",
        }
    }
}

/// Thread-name prefixes of the harness's runtimes (`/proc` keeps 15 bytes of a name).
pub(crate) const SUBJECT_THREADS: &str = "idem-subject";
/// See [`SUBJECT_THREADS`].
pub(crate) const UPSTREAM_THREADS: &str = "idem-upstream";
/// See [`SUBJECT_THREADS`].
pub(crate) const LOAD_THREADS: &str = "idem-load";
/// See [`SUBJECT_THREADS`].
pub(crate) const RELAY_THREADS: &str = "idem-relay";

/// CPU seconds used so far, by component, and the whole machine's idle and total ticks.
#[derive(Debug, Clone, Default)]
pub(crate) struct Snapshot {
    components: BTreeMap<Component, f64>,
    machine: Option<(f64, f64)>,
}

/// `(idle + iowait, total)` ticks of all CPUs since boot, from `/proc/stat`.
fn machine_ticks() -> Option<(f64, f64)> {
    let text = fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<f64> = text
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...
    Some((ticks.get(3)? + ticks.get(4)?, ticks.iter().sum()))
}

/// The kernel's clock tick for `/proc` times (USER_HZ), fixed at 100 on Linux.
const TICKS_PER_SECOND: f64 = 100.0;

/// `(comm, utime + stime in seconds)` of a `/proc/.../stat` file.
fn read_stat(path: &str) -> Option<(String, f64)> {
    let text = fs::read_to_string(path).ok()?;
    // comm is in parentheses and may contain spaces; the fields after it are plain.
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text[open + 1..close].to_owned();
    let fields: Vec<&str> = text[close + 2..].split(' ').collect();
    // After comm: state is field 3 of stat(5), so utime (14) and stime (15) are at 11 and 12.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((comm, (utime + stime) / TICKS_PER_SECOND))
}

/// Reads every component's CPU time. `children` are processes the harness started (a peer
/// server, pgbench) and the component each belongs to.
pub(crate) fn snapshot(children: &[(u32, Component)]) -> Snapshot {
    let mut totals = BTreeMap::new();
    let mut add = |component, seconds| *totals.entry(component).or_insert(0.0) += seconds;
    if let Ok(tasks) = fs::read_dir("/proc/self/task") {
        for task in tasks.flatten() {
            let path = format!("{}/stat", task.path().display());
            let Some((comm, seconds)) = read_stat(&path) else {
                continue;
            };
            if comm.starts_with(SUBJECT_THREADS) || comm.starts_with("sqlx-sqlite") {
                add(Component::Subject, seconds);
            } else if comm.starts_with(UPSTREAM_THREADS) {
                add(Component::Upstream, seconds);
            } else if comm.starts_with(LOAD_THREADS) {
                add(Component::Load, seconds);
            } else if comm.starts_with(RELAY_THREADS) {
                add(Component::Relay, seconds);
            }
        }
    }
    if let Ok(processes) = fs::read_dir("/proc") {
        for process in processes.flatten() {
            let name = process.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let Some((comm, seconds)) = read_stat(&format!("/proc/{pid}/stat")) else {
                continue;
            };
            if let Some((_, component)) = children.iter().find(|(child, _)| *child == pid) {
                add(*component, seconds);
            } else if comm == "postgres" {
                add(Component::Postgres, seconds);
            } else if comm == "redis-server" {
                add(Component::Redis, seconds);
            } else if comm == "pgbench" {
                add(Component::Load, seconds);
            }
        }
    }
    Snapshot {
        components: totals,
        machine: machine_ticks(),
    }
}

impl Snapshot {
    /// CPU microseconds per request between `self` (before) and `after`, by component; the
    /// components that used next to nothing are left out.
    pub(crate) fn per_request(&self, after: &Snapshot, requests: u64) -> BTreeMap<String, f64> {
        let requests = requests.max(1) as f64;
        after
            .components
            .iter()
            .map(|(component, seconds)| {
                let before = self.components.get(component).copied().unwrap_or(0.0);
                (component, (seconds - before).max(0.0) * 1e6 / requests)
            })
            .filter(|(_, micros)| *micros >= 0.5)
            .map(|(component, micros)| (component.name().to_owned(), micros))
            .collect()
    }

    /// The share of the machine's CPU time that went idle between `self` and `after`: near
    /// zero when a run is CPU-bound, large when it waits (on a lock, a disk flush).
    pub(crate) fn idle_fraction(&self, after: &Snapshot) -> Option<f64> {
        let ((idle_a, total_a), (idle_b, total_b)) = (self.machine?, after.machine?);
        let total = total_b - total_a;
        (total > 0.0).then(|| ((idle_b - idle_a) / total).clamp(0.0, 1.0))
    }
}

/// The CPU per request of everything but the load generator and the latency relay: the cost
/// of serving.
pub(crate) fn serving(per_request: &BTreeMap<String, f64>) -> f64 {
    let not_serving = [Component::Load.name(), Component::Relay.name()];
    per_request
        .iter()
        .filter(|(name, _)| !not_serving.contains(&name.as_str()))
        .map(|(_, micros)| micros)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_own_process_stat_parses() {
        let (comm, seconds) = read_stat("/proc/self/stat").expect("a readable stat");
        assert!(!comm.is_empty());
        assert!(seconds >= 0.0);
    }

    #[test]
    fn per_request_divides_the_difference() {
        let before = Snapshot {
            components: BTreeMap::from([(Component::Subject, 1.0)]),
            machine: Some((10.0, 100.0)),
        };
        let after = Snapshot {
            components: BTreeMap::from([
                (Component::Subject, 1.5),
                (Component::Load, 0.25),
                (Component::Relay, 0.125),
            ]),
            machine: Some((40.0, 200.0)),
        };
        let per = before.per_request(&after, 1000);
        assert!((per["subject"] - 500.0).abs() < 1e-6);
        assert!((per["load"] - 250.0).abs() < 1e-6);
        assert!((per["relay"] - 125.0).abs() < 1e-6);
        assert!((serving(&per) - 500.0).abs() < 1e-6);
        assert_eq!(before.idle_fraction(&after), Some(0.3));
    }

    #[test]
    fn the_machine_ticks_parse() {
        let (idle, total) = machine_ticks().expect("a readable /proc/stat");
        assert!(idle <= total && total > 0.0);
    }
}
