//! [`RedisCluster`]: a throwaway Redis Cluster of Debian's `redis-server` processes on
//! loopback ports picked for one test, stopped by their PIDs when it is dropped, pass or fail.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::processes::{kill, wait_until};

/// How long a node that misses pings counts as alive: short, so that a killed primary's
/// replica takes over within a few seconds.
const NODE_TIMEOUT_MS: u32 = 1000;

/// One `redis-server` of the cluster.
#[derive(Debug)]
pub struct Node {
    /// Its client port on 127.0.0.1 (the cluster bus is this plus 10000).
    pub port: u16,
    process: Option<Child>,
}

/// A Redis Cluster of `masters` primaries with `replicas` replicas each, in a temporary folder.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<Node>,
    dir: PathBuf,
}

impl RedisCluster {
    /// Starts the nodes, joins them into a cluster with `redis-cli --cluster create`, and
    /// returns once every node reports every slot served.
    ///
    /// # Panics
    ///
    /// Saying what failed, when `redis-server` or `redis-cli` is missing, or a step of forming
    /// the cluster takes more than 30 s.
    pub fn start(masters: usize, replicas: usize) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "idem-redis-cluster-{}-{}",
            std::process::id(),
            unique()
        ));
        std::fs::create_dir_all(&dir).expect("a folder for the cluster's nodes");
        let mut cluster = Self {
            nodes: Vec::new(),
            dir,
        };
        for port in free_ports(masters * (1 + replicas)) {
            let node_dir = cluster.dir.join(port.to_string());
            std::fs::create_dir_all(&node_dir).expect("a folder for one node");
            let process = start_node(port, &node_dir);
            cluster.nodes.push(Node {
                port,
                process: Some(process),
            });
        }
        for node in &cluster.nodes {
            wait_until(&format!("redis-server :{} answers", node.port), || {
                cli(node.port, &["PING"]).is_some_and(|out| out.trim() == "PONG")
            });
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdout(Stdio::null());
        let status = create
            .status()
            .expect("redis-cli runs (Debian's redis-tools)");
        assert!(status.success(), "redis-cli --cluster create failed");
        for node in &cluster.nodes {
            wait_until(&format!("node :{} sees the cluster ok", node.port), || {
                cluster_ok(node.port)
            });
        }
        // `--cluster create` makes the replicas replicas after the cluster says ok, and the news
        // travels by gossip: until every node has it, a replica-to-be is listed as a primary
        // with no slots (a test counting primaries would count four of three). And `in_sync`
        // below takes a node that still calls itself a primary for one.
        let roles = (masters, masters * replicas);
        wait_until("the cluster lists every primary and replica", || {
            (cluster.masters().len(), cluster.replicas().len()) == roles
        });
        // A replica that has not finished its first copy of its primary's data set refuses to
        // take over from it ("disconnected from master for longer than allowed"): a primary
        // killed before then would leave its slots unserved for good.
        for node in &cluster.nodes {
            wait_until(
                &format!("node :{} is a primary or a replica in sync", node.port),
                || in_sync(node.port),
            );
        }
        cluster
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,…` with every node still running.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .running()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// The nodes still running.
    pub fn running(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|node| node.process.is_some())
    }

    /// The ports of the running primaries, as the cluster reports them.
    ///
    /// # Panics
    ///
    /// When no node is running.
    pub fn masters(&self) -> Vec<u16> {
        self.with_role("master")
    }

    /// The ports of the running replicas, as the cluster reports them.
    ///
    /// # Panics
    ///
    /// When no node is running.
    pub fn replicas(&self) -> Vec<u16> {
        self.with_role("slave")
    }

    /// The ports of the nodes that `CLUSTER NODES` flags with `role` and not as failed.
    fn with_role(&self, role: &str) -> Vec<u16> {
        let alive = self.running().next().expect("a running node").port;
        let nodes = cli(alive, &["CLUSTER", "NODES"]).unwrap_or_default();
        nodes
            .lines()
            .filter(|line| {
                let flags = line.split(' ').nth(2).unwrap_or("");
                flags.contains(role) && !flags.contains("fail")
            })
            .filter_map(|line| {
                let addr = line.split(' ').nth(1)?;
                let port = addr.split('@').next()?.rsplit(':').next()?;
                port.parse().ok()
            })
            .collect()
    }

    /// The port of the primary that serves `key` (by its hash slot).
    ///
    /// # Panics
    ///
    /// When no node is running, or no running node answers for `key`'s slot.
    pub fn master_of(&self, key: &str) -> u16 {
        let alive = self.running().next().expect("a running node").port;
        let slot: u16 = cli(alive, &["CLUSTER", "KEYSLOT", key])
            .and_then(|out| out.trim().parse().ok())
            .expect("CLUSTER KEYSLOT answers");
        let shards = cli(alive, &["CLUSTER", "NODES"]).unwrap_or_default();
        shards
            .lines()
            .filter(|line| line.split(' ').nth(2).is_some_and(|f| f.contains("master")))
            .find_map(|line| {
                let fields: Vec<&str> = line.split(' ').collect();
                let serves = fields.iter().skip(8).any(|range| {
                    let (low, high) = range.split_once('-').unwrap_or((range, range));
                    matches!((low.parse::<u16>(), high.parse::<u16>()), (Ok(l), Ok(h)) if (l..=h).contains(&slot))
                });
                let port = fields.get(1)?.split('@').next()?.rsplit(':').next()?;
                serves.then(|| port.parse().ok()).flatten()
            })
            .expect("a primary serves every slot")
    }

    /// How many keys the node on `port` holds (`DBSIZE`).
    ///
    /// # Panics
    ///
    /// When the node on `port` does not answer.
    pub fn keys_on(&self, port: u16) -> usize {
        cli(port, &["DBSIZE"])
            .and_then(|out| out.trim().parse().ok())
            .expect("DBSIZE answers")
    }

    /// Kills the node on `port` with SIGKILL, as a crash would, and returns at once.
    ///
    /// # Panics
    ///
    /// When no node of this cluster is on `port`.
    pub fn kill(&mut self, port: u16) {
        let node = self
            .nodes
            .iter_mut()
            .find(|node| node.port == port)
            .expect("a node of this cluster");
        kill(&mut node.process);
    }

    /// Starts the node on `port` again (after [`kill`](Self::kill)), from the cluster
    /// configuration it kept on disk, and returns once it answers and the cluster reports
    /// every slot served. A primary that was replaced while it was down comes back as a
    /// replica of the node that took over, which copies its data set.
    ///
    /// # Panics
    ///
    /// When no node of this cluster is on `port` or it is still running, and when it does not
    /// answer, or a node does not report every slot served, within 30 s.
    pub fn restart(&mut self, port: u16) {
        let dir = self.dir.join(port.to_string());
        let node = self
            .nodes
            .iter_mut()
            .find(|node| node.port == port)
            .expect("a node of this cluster");
        assert!(node.process.is_none(), "node :{port} is running");
        node.process = Some(start_node(port, &dir));
        wait_until(&format!("redis-server :{port} answers again"), || {
            cli(port, &["PING"]).is_some_and(|out| out.trim() == "PONG")
        });
        self.wait_until_healthy();
    }

    /// Waits until the node on `port` is a replica whose copy of its primary's data set is
    /// complete (`master_link_status:up`).
    ///
    /// # Panics
    ///
    /// When it is not such a replica within 30 s.
    pub fn wait_for_replica(&self, port: u16) {
        wait_until(&format!("node :{port} replicates its primary"), || {
            cli(port, &["INFO", "replication"]).is_some_and(|info| {
                info.contains("role:slave") && info.contains("master_link_status:up")
            })
        });
    }

    /// The process ids of the nodes still running, for checking that they are stopped.
    pub fn pids(&self) -> Vec<u32> {
        self.nodes
            .iter()
            .filter_map(|node| node.process.as_ref().map(Child::id))
            .collect()
    }

    /// Waits until the cluster has replaced the dead primary on `port` (a replica of it promoted,
    /// as many primaries as before) and every running node reports every slot served.
    ///
    /// # Panics
    ///
    /// When no replica takes over, or a node does not report every slot served, within 30 s.
    pub fn wait_for_failover(&self, port: u16, primaries: usize) {
        wait_until(&format!("a replica takes over from :{port}"), || {
            let masters = self.masters();
            masters.len() == primaries && !masters.contains(&port)
        });
        self.wait_until_healthy();
    }

    /// Waits until every running node reports every slot served again (after a failover, by
    /// a promoted replica).
    ///
    /// # Panics
    ///
    /// When a node does not report every slot served within 30 s.
    pub fn wait_until_healthy(&self) {
        for node in self.running() {
            wait_until(&format!("node :{} sees the cluster ok", node.port), || {
                cluster_ok(node.port)
            });
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            kill(&mut node.process);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A node in cluster mode, keeping nothing on disk but its cluster configuration.
fn start_node(port: u16, dir: &Path) -> Child {
    let log = std::fs::File::create(dir.join("redis.log")).expect("a log file");
    Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args([
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        ])
        .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
        .args(["--save", "", "--appendonly", "no"])
        // A replica's first copy starts at once, not after the 5 s Redis waits by default for
        // more replicas to share the transfer.
        .args(["--repl-diskless-sync-delay", "0"])
        .arg("--dir")
        .arg(dir)
        .stdout(log)
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server runs (Debian's redis-server package)")
}

/// What `redis-cli -p PORT ARGS…` printed, or `None` when it failed.
fn cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether the node on `port` is a primary, or a replica whose link to its primary is up (its
/// first copy of the data set done).
fn in_sync(port: u16) -> bool {
    cli(port, &["INFO", "replication"])
        .is_some_and(|info| info.contains("role:master") || info.contains("master_link_status:up"))
}

/// Whether the node on `port` reports the cluster ok with all 16384 slots served.
fn cluster_ok(port: u16) -> bool {
    cli(port, &["CLUSTER", "INFO"]).is_some_and(|info| {
        info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
    })
}

/// `count` ports whose cluster-bus ports (+10000) are free too: bound at once, then released.
fn free_ports(count: usize) -> Vec<u16> {
    let mut ports = Vec::new();
    let mut held = Vec::new();
    let mut candidate = 20_000 + (unique() % 20_000) as u16;
    while ports.len() < count {
        candidate = if candidate >= 40_000 {
            20_000
        } else {
            candidate + 1
        };
        if let (Ok(client), Ok(bus)) = (
            TcpListener::bind(("127.0.0.1", candidate)),
            TcpListener::bind(("127.0.0.1", candidate + 10_000)),
        ) {
            held.push((client, bus));
            ports.push(candidate);
        }
    }
    ports
}

/// A number that differs between calls and between test processes.
pub(crate) fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    u64::from(nanos) ^ (u64::from(std::process::id()) << 20) ^ CALLS.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a process with `pid` exists: a child killed and reaped leaves no `/proc` entry.
    fn exists(pid: u32) -> bool {
        Path::new(&format!("/proc/{pid}")).exists()
    }

    #[test]
    fn a_test_that_panics_leaves_no_node_running_and_no_folder_behind() {
        let (started, nodes) = std::sync::mpsc::channel();
        let test = std::thread::spawn(move || {
            let cluster = RedisCluster::start(3, 0);
            started
                .send((cluster.pids(), cluster.dir.clone()))
                .expect("the test waits for the nodes");
            panic!("a failing test, on purpose");
        });
        assert!(test.join().is_err(), "the thread panicked");
        let (pids, dir) = nodes.recv().expect("the cluster started");
        assert_eq!(pids.len(), 3);
        let running: Vec<u32> = pids.into_iter().filter(|&pid| exists(pid)).collect();
        assert!(running.is_empty(), "nodes still running: {running:?}");
        assert!(!dir.exists(), "{} is left behind", dir.display());
    }

    #[test]
    fn a_killed_node_restarts_as_the_replica_of_the_one_that_took_over() {
        let mut cluster = RedisCluster::start(3, 1);
        let victim = cluster.masters()[0];
        cluster.kill(victim);
        cluster.wait_for_failover(victim, 3);
        cluster.restart(victim);
        // Its own word (INFO): a replica with its copy done. Other nodes may still list it as
        // a primary for a moment, until gossip reaches them.
        cluster.wait_for_replica(victim);
        assert_eq!(cluster.pids().len(), 6);
    }
}
