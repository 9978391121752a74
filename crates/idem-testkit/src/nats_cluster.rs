//! [`NatsCluster`]: a throwaway JetStream cluster of Debian's `nats-server` processes on loopback
//! ports picked for one test, each node with a store folder of its own, stopped by their PIDs
//! when it is dropped, pass or fail.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::processes::{kill, wait_until};

/// One `nats-server` of the cluster.
#[derive(Debug)]
pub struct NatsNode {
    /// Its `--server_name`, as JetStream names stream leaders.
    pub name: String,
    /// Its client port on 127.0.0.1.
    pub port: u16,
    cluster_port: u16,
    monitor_port: u16,
    store: PathBuf,
    process: Option<Child>,
}

/// A JetStream cluster of `nats-server` processes, all routed to each other.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<NatsNode>,
    dir: PathBuf,
}

impl NatsCluster {
    /// Starts `size` nodes and returns once JetStream has a meta leader that every node knows.
    ///
    /// # Panics
    ///
    /// Saying what failed, when `nats-server` is missing or the cluster does not form within
    /// 30 s.
    pub fn start(size: usize) -> Self {
        let ports = free_ports(3 * size);
        // The first port is this cluster's alone while it runs.
        let dir = std::env::temp_dir().join(format!("idem-nats-cluster-{}", ports[0]));
        let nodes = (0..size)
            .map(|i| NatsNode {
                name: format!("n{i}"),
                port: ports[3 * i],
                cluster_port: ports[3 * i + 1],
                monitor_port: ports[3 * i + 2],
                store: dir.join(format!("n{i}")),
                process: None,
            })
            .collect();
        let mut cluster = Self { nodes, dir };
        for i in 0..size {
            cluster.start_node(i);
        }
        for node in &cluster.nodes {
            wait_until(&format!("{} knows the meta leader", node.name), || {
                jsz(node.monitor_port, "").is_some_and(|v| {
                    v["meta_cluster"]["leader"]
                        .as_str()
                        .is_some_and(|l| !l.is_empty())
                })
            });
        }
        cluster
    }

    /// `nats://127.0.0.1:P1,nats://127.0.0.1:P2,…`: every node, for a client that moves to
    /// another when one is lost.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|node| format!("nats://127.0.0.1:{}", node.port))
            .collect();
        nodes.join(",")
    }

    /// The name of the node that leads `stream`, once one does.
    ///
    /// # Panics
    ///
    /// When no node leads `stream` within 30 s.
    pub fn stream_leader(&self, stream: &str) -> String {
        let mut leader = None;
        wait_until(&format!("a leader of the stream {stream}"), || {
            leader = self.running().find_map(|node| {
                let v = jsz(node.monitor_port, "?streams=true")?;
                v["account_details"]
                    .as_array()?
                    .iter()
                    .flat_map(|account| account["stream_detail"].as_array().into_iter().flatten())
                    .find(|s| s["name"] == stream)?["cluster"]["leader"]
                    .as_str()
                    .filter(|l| !l.is_empty())
                    .map(str::to_owned)
            });
            leader.is_some()
        });
        leader.expect("waited for it")
    }

    /// Kills the node called `name` with SIGKILL, as a crash would, and returns at once.
    ///
    /// # Panics
    ///
    /// When no node of this cluster is called `name`.
    pub fn kill(&mut self, name: &str) {
        let node = self.node_mut(name);
        kill(&mut node.process);
    }

    /// Starts the node called `name` again on its ports and store, and waits until it serves
    /// clients; it catches up with the stream's new leader by itself.
    ///
    /// # Panics
    ///
    /// When no node of this cluster is called `name`, or the node does not accept clients
    /// within 30 s.
    pub fn restart(&mut self, name: &str) {
        let i = self
            .nodes
            .iter()
            .position(|node| node.name == name)
            .expect("a node of this cluster");
        self.start_node(i);
    }

    fn running(&self) -> impl Iterator<Item = &NatsNode> {
        self.nodes.iter().filter(|node| node.process.is_some())
    }

    fn node_mut(&mut self, name: &str) -> &mut NatsNode {
        self.nodes
            .iter_mut()
            .find(|node| node.name == name)
            .expect("a node of this cluster")
    }

    /// Starts node `i` with routes to every other node, and waits until it accepts clients.
    fn start_node(&mut self, i: usize) {
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, node)| format!("nats://127.0.0.1:{}", node.cluster_port))
            .collect();
        let node = &mut self.nodes[i];
        std::fs::create_dir_all(&node.store).expect("a store folder for one node");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(node.store.join("nats.log"))
            .expect("a log file");
        let process = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &node.port.to_string()])
            .args(["-m", &node.monitor_port.to_string()])
            .args(["--server_name", &node.name, "--cluster_name", "idem-test"])
            .arg("--cluster")
            .arg(format!("nats://127.0.0.1:{}", node.cluster_port))
            .args(["--routes", &routes.join(",")])
            .arg("-js")
            .arg("-sd")
            .arg(&node.store)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("nats-server runs (Debian's nats-server package)");
        node.process = Some(process);
        let port = node.port;
        wait_until(&format!("nats-server :{port} accepts clients"), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            kill(&mut node.process);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The node's JetStream report (`/jsz` on its monitoring port), or `None` while it cannot
/// give one. A hand-made HTTP/1.0 GET: the one request a test helper needs does not warrant
/// an HTTP client in every test binary.
fn jsz(monitor_port: u16, query: &str) -> Option<serde_json::Value> {
    let mut stream = TcpStream::connect(("127.0.0.1", monitor_port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET /jsz{query} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let (_, body) = answer.split_once("\r\n\r\n")?;
    serde_json::from_str(body).ok()
}

/// `count` free ports: bound at once (so none repeats), then released.
fn free_ports(count: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port"))
        .collect();
    held.iter()
        .map(|listener| listener.local_addr().expect("bound").port())
        .collect()
}
