//! Test support: a TCP relay on `127.0.0.1:0` in front of a store (or any TCP service) whose
//! behaviour a test switches at run time, to put network faults between a client and its
//! server without touching either: latency spikes, stalls, resets in the middle of a
//! statement, black holes, and a cut of every connection.
//!
//! Every fault is bounded in time by the test ([`FaultRelay::inject`] holds it for a period and
//! clears it), the randomness (delays, where a reset cuts) comes from a seed, and dropping the
//! relay stops every task it started and closes every socket it holds.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_testkit::fault_relay::{Fault, FaultRelay};
//! # async fn demo() -> std::io::Result<()> {
//! let relay = FaultRelay::start("127.0.0.1:5432".parse().unwrap(), 42).await?;
//! let url = format!("postgres://postgres@{}/postgres", relay.addr());
//! // … point the client at `url` …
//! relay.inject(Fault::BlackHole, Duration::from_secs(2)).await;
//! # Ok(()) }
//! ```

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// The shortest delay of a chunk during [`Fault::Latency`].
pub const LATENCY_MIN: Duration = Duration::from_millis(50);

/// The longest delay of a chunk during [`Fault::Latency`].
pub const LATENCY_MAX: Duration = Duration::from_millis(500);

/// Which way bytes flow through the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the client to the target (requests, statements).
    ToTarget,
    /// From the target to the client (answers).
    ToClient,
    /// Both ways.
    Both,
}

impl Direction {
    fn covers(self, flow: Direction) -> bool {
        self == Direction::Both || self == flow
    }
}

/// A fault the relay applies while it is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Every chunk, both ways, is held a random [`LATENCY_MIN`]–[`LATENCY_MAX`] before it is
    /// passed on.
    Latency,
    /// The connections open when the stall began stop forwarding in `Direction`; they stay
    /// open, and connections made during the stall flow normally (one path stuck, as behind a
    /// NAT entry gone stale).
    Stall(Direction),
    /// Every connection that forwards client bytes is reset part-way through them: a random
    /// prefix of the chunk reaches the target, then both sockets close with an RST.
    Reset,
    /// Nothing gets through: new connections are accepted and left unanswered (they reach the
    /// target once the black hole ends, as a retransmitted SYN would), and existing ones stop
    /// forwarding both ways.
    BlackHole,
}

impl Fault {
    /// A short name for logs and figures.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Latency => "latency",
            Fault::Stall(Direction::ToTarget) => "stall to target",
            Fault::Stall(Direction::ToClient) => "stall to client",
            Fault::Stall(Direction::Both) => "stall both ways",
            Fault::Reset => "reset",
            Fault::BlackHole => "black hole",
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the connections consult before passing each chunk on.
#[derive(Debug, Clone, Copy)]
struct State {
    fault: Option<Fault>,
    /// Connections numbered below this were open when the fault was set (a stall affects
    /// only those).
    first_spared: u64,
}

/// What the relay did, for a test's figures.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayStats {
    /// Connections accepted.
    pub connections: u64,
    /// Connections reset part-way through a chunk.
    pub resets: u64,
    /// Chunks delayed by a latency spike.
    pub delayed_chunks: u64,
    /// Round trips: client chunks that followed an answer on their connection (or opened it).
    /// Statements a client pipelines, sent before it reads any answer, count once.
    pub round_trips: u64,
}

#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    resets: AtomicU64,
    delayed_chunks: AtomicU64,
    round_trips: AtomicU64,
}

/// A TCP relay with switchable faults; see the [module](self). Dropping it stops its tasks
/// and closes every connection.
#[derive(Debug)]
pub struct FaultRelay {
    addr: SocketAddr,
    state: watch::Sender<State>,
    counters: Arc<Counters>,
    next_id: Arc<AtomicU64>,
    /// The accept loop; it owns the connections' tasks, so aborting it ends them all.
    task: tokio::task::JoinHandle<()>,
}

impl FaultRelay {
    /// Listens on `127.0.0.1:0` and relays every connection to `target`, with no fault set.
    /// `seed` drives every random choice (each connection's from the seed and its number).
    ///
    /// # Errors
    ///
    /// The I/O error when the listener cannot be bound.
    pub async fn start(target: SocketAddr, seed: u64) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (state, _) = watch::channel(State {
            fault: None,
            first_spared: 0,
        });
        let counters = Arc::new(Counters::default());
        let next_id = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(accept_loop(
            listener,
            target,
            seed,
            state.clone(),
            counters.clone(),
            next_id.clone(),
        ));
        Ok(Self {
            addr,
            state,
            counters,
            next_id,
            task,
        })
    }

    /// [`FaultRelay::start`] in front of `host:port`, resolved first (a test server's URL may
    /// name `localhost`).
    ///
    /// # Errors
    ///
    /// The I/O error when `host` cannot be resolved or resolves to no address, and otherwise
    /// the errors of [`start`](Self::start).
    pub async fn start_to(host: &str, port: u16, seed: u64) -> std::io::Result<Self> {
        let target = tokio::net::lookup_host((host, port))
            .await?
            .next()
            .ok_or_else(|| std::io::Error::other(format!("{host} resolves to no address")))?;
        Self::start(target, seed).await
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets `fault` until [`clear`](Self::clear) or another `set`.
    pub fn set(&self, fault: Fault) {
        let first_spared = self.next_id.load(Ordering::SeqCst);
        self.state.send_replace(State {
            fault: Some(fault),
            first_spared,
        });
    }

    /// Back to plain forwarding; held chunks and connections go on.
    pub fn clear(&self) {
        self.state.send_modify(|state| state.fault = None);
    }

    /// A black hole when `on`, plain forwarding when not: the switch idem-store's conformance
    /// suite (`a_black_hole_is_unavailable_within`) takes.
    pub fn set_black_hole(&self, on: bool) {
        if on {
            self.set(Fault::BlackHole);
        } else {
            self.clear();
        }
    }

    /// The fault in force.
    pub fn fault(&self) -> Option<Fault> {
        self.state.borrow().fault
    }

    /// Sets `fault`, waits `period` (the fault's duration), and clears it.
    pub async fn inject(&self, fault: Fault, period: Duration) {
        self.set(fault);
        // Cleared even if the caller's future is dropped mid-period.
        let _clear = ClearOnDrop(self);
        tokio::time::sleep(period).await;
    }

    /// What the relay did so far.
    pub fn stats(&self) -> RelayStats {
        RelayStats {
            connections: self.counters.connections.load(Ordering::Relaxed),
            resets: self.counters.resets.load(Ordering::Relaxed),
            delayed_chunks: self.counters.delayed_chunks.load(Ordering::Relaxed),
            round_trips: self.counters.round_trips.load(Ordering::Relaxed),
        }
    }

    /// Closes the port and every connection (each with a FIN), and returns once they are
    /// closed: the server gone for good, as far as the client can tell.
    pub async fn cut(mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl Drop for FaultRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct ClearOnDrop<'a>(&'a FaultRelay);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.clear();
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    seed: u64,
    state: watch::Sender<State>,
    counters: Arc<Counters>,
    next_id: Arc<AtomicU64>,
) {
    // Owned here: when the loop's task is aborted, the set drops and aborts every connection.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                let id = next_id.fetch_add(1, Ordering::SeqCst);
                counters.connections.fetch_add(1, Ordering::Relaxed);
                let rng = StdRng::seed_from_u64(
                    seed ^ id.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                );
                connections.spawn(connection(
                    client,
                    target,
                    id,
                    state.subscribe(),
                    counters.clone(),
                    rng,
                ));
            }
            // Reap finished connections so the set does not grow with the run.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// How a pump ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// Its source closed (or failed); its sink was shut down.
    Closed,
    /// The fault reset the connection.
    Reset,
    /// The relay is gone.
    Gone,
}

async fn connection(
    mut client: TcpStream,
    target: SocketAddr,
    id: u64,
    mut state: watch::Receiver<State>,
    counters: Arc<Counters>,
    mut rng: StdRng,
) {
    // A connection made into a black hole waits, unanswered, for it to end.
    if !flowing(&mut state, id, None).await {
        return;
    }
    let Ok(mut server) = TcpStream::connect(target).await else {
        // The target refuses: so does the relay, with an RST as a closed port would.
        let _ = client.set_zero_linger();
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    // Whether the server answered since the client last sent: the client's next chunk starts
    // a round trip.
    let answered = std::sync::atomic::AtomicBool::new(true);
    let end = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let mut rng_down = StdRng::seed_from_u64(rng.random());
        let up = pump(
            Direction::ToTarget,
            client_read,
            server_write,
            id,
            state.clone(),
            (&counters, &answered),
            &mut rng,
        );
        let down = pump(
            Direction::ToClient,
            server_read,
            client_write,
            id,
            state,
            (&counters, &answered),
            &mut rng_down,
        );
        tokio::pin!(up, down);
        // One side closing leaves the other flowing (a half-close); a reset ends both.
        tokio::select! {
            end = &mut up => if end == End::Closed { down.await } else { end },
            end = &mut down => if end == End::Closed { up.await } else { end },
        }
    };
    if end == End::Reset {
        counters.resets.fetch_add(1, Ordering::Relaxed);
        // SO_LINGER 0: the close sends an RST instead of a FIN, and does not block.
        let _ = client.set_zero_linger();
        let _ = server.set_zero_linger();
    }
}

/// Waits until `flow` may pass a chunk on connection `id` (`None`: a connection not yet
/// made, which only a black hole holds). `false` when the relay is gone.
async fn flowing(state: &mut watch::Receiver<State>, id: u64, flow: Option<Direction>) -> bool {
    loop {
        let now = *state.borrow_and_update();
        let held = match (now.fault, flow) {
            (Some(Fault::BlackHole), _) => true,
            (Some(Fault::Stall(stalled)), Some(flow)) => {
                id < now.first_spared && stalled.covers(flow)
            }
            _ => false,
        };
        if !held {
            return true;
        }
        if state.changed().await.is_err() {
            return false;
        }
    }
}

/// Copies `from` to `to` chunk by chunk, applying the fault in force to each chunk.
async fn pump(
    flow: Direction,
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    id: u64,
    mut state: watch::Receiver<State>,
    (counters, answered): (&Counters, &std::sync::atomic::AtomicBool),
    rng: &mut StdRng,
) -> End {
    let mut buf = vec![0; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return End::Closed;
            }
            Ok(n) => n,
        };
        match flow {
            Direction::ToTarget if answered.swap(false, Ordering::Relaxed) => {
                counters.round_trips.fetch_add(1, Ordering::Relaxed);
            }
            Direction::ToClient => answered.store(true, Ordering::Relaxed),
            _ => {}
        }
        if !flowing(&mut state, id, Some(flow)).await {
            return End::Gone;
        }
        let fault = state.borrow().fault;
        match fault {
            Some(Fault::Latency) => {
                counters.delayed_chunks.fetch_add(1, Ordering::Relaxed);
                let delay = rng.random_range(LATENCY_MIN..=LATENCY_MAX);
                tokio::time::sleep(delay).await;
            }
            Some(Fault::Reset) if flow == Direction::ToTarget => {
                // Part of the statement reaches the server, never all of it.
                let part = rng.random_range(0..n);
                let _ = to.write_all(&buf[..part]).await;
                let _ = to.flush().await;
                return End::Reset;
            }
            _ => {}
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return End::Closed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::{Instant, timeout};

    /// An echo server on loopback: what it reads, it writes back.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut read, mut write) = socket.split();
                    let _ = tokio::io::copy(&mut read, &mut write).await;
                });
            }
        });
        addr
    }

    async fn round_trip(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<Vec<u8>> {
        stream.write_all(bytes).await?;
        let mut back = vec![0; bytes.len()];
        stream.read_exact(&mut back).await?;
        Ok(back)
    }

    const SHORT: Duration = Duration::from_millis(300);

    #[tokio::test]
    async fn without_a_fault_bytes_pass_both_ways() {
        let relay = FaultRelay::start(echo().await, 1).await.unwrap();
        let mut stream = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(round_trip(&mut stream, b"hello").await.unwrap(), b"hello");
        assert_eq!(relay.stats().connections, 1);
        assert_eq!(relay.stats().round_trips, 1);
        round_trip(&mut stream, b"again").await.unwrap();
        assert_eq!(relay.stats().round_trips, 2);
    }

    #[tokio::test]
    async fn latency_delays_each_chunk_within_its_range() {
        let relay = FaultRelay::start(echo().await, 2).await.unwrap();
        let mut stream = TcpStream::connect(relay.addr()).await.unwrap();
        relay.set(Fault::Latency);
        let started = Instant::now();
        assert_eq!(round_trip(&mut stream, b"slow").await.unwrap(), b"slow");
        let took = started.elapsed();
        // One chunk each way, each held once, 50–500 ms. A loaded machine only adds to the
        // holds, so the lower bound is exact; the upper one allows it seconds, so it catches
        // only a hold far past the range.
        assert_eq!(relay.stats().delayed_chunks, 2);
        assert!(took >= 2 * LATENCY_MIN, "{took:?}");
        assert!(took < 2 * LATENCY_MAX + Duration::from_secs(5), "{took:?}");
        // Once cleared, no chunk is held: the relay counts every chunk it holds.
        relay.clear();
        assert_eq!(round_trip(&mut stream, b"fast").await.unwrap(), b"fast");
        assert_eq!(
            relay.stats().delayed_chunks,
            2,
            "a chunk was held after the clear"
        );
    }

    #[tokio::test]
    async fn a_stall_holds_open_connections_and_spares_new_ones() {
        let relay = FaultRelay::start(echo().await, 3).await.unwrap();
        let mut old = TcpStream::connect(relay.addr()).await.unwrap();
        round_trip(&mut old, b"up").await.unwrap();
        relay.set(Fault::Stall(Direction::ToClient));
        old.write_all(b"held").await.unwrap();
        let mut back = [0; 4];
        assert!(
            timeout(SHORT, old.read_exact(&mut back)).await.is_err(),
            "the answer got through a stall"
        );
        // A connection made during the stall flows.
        let mut new = TcpStream::connect(relay.addr()).await.unwrap();
        assert_eq!(round_trip(&mut new, b"new").await.unwrap(), b"new");
        // The stalled connection stayed open: its answer arrives once the stall ends.
        relay.clear();
        old.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"held");
    }

    #[tokio::test]
    async fn a_reset_cuts_a_chunk_part_way_with_an_rst() {
        // A target that records what it received, so the test sees the partial chunk.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = listener.local_addr().unwrap();
        let relay = FaultRelay::start(target, 4).await.unwrap();
        let mut stream = TcpStream::connect(relay.addr()).await.unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        relay.set(Fault::Reset);
        let statement = [7u8; 1000];
        stream.write_all(&statement).await.unwrap();
        let mut received = Vec::new();
        let read = server.read_to_end(&mut received).await;
        // The server's side: fewer bytes than were sent, then a reset (or an end).
        assert!(received.len() < statement.len(), "{}", received.len());
        assert!(
            matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
                || read.is_ok(),
            "{read:?}"
        );
        // The client's side: an RST, not a clean end of stream.
        let mut buf = [0; 8];
        let err = stream.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset);
        assert_eq!(relay.stats().resets, 1);
    }

    #[tokio::test]
    async fn a_black_hole_answers_nothing_old_or_new_until_it_ends() {
        let relay = FaultRelay::start(echo().await, 5).await.unwrap();
        let mut old = TcpStream::connect(relay.addr()).await.unwrap();
        round_trip(&mut old, b"up").await.unwrap();
        relay.set(Fault::BlackHole);
        // The connection is accepted (the kernel does that) but nothing comes back.
        let mut new = TcpStream::connect(relay.addr()).await.unwrap();
        assert!(timeout(SHORT, round_trip(&mut new, b"new")).await.is_err());
        assert!(timeout(SHORT, round_trip(&mut old, b"old")).await.is_err());
        relay.clear();
        // Both were held, not dropped: what was sent arrives once it ends.
        let mut back = [0; 3];
        new.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"new");
        old.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"old");
    }

    #[tokio::test]
    async fn inject_clears_the_fault_after_its_period() {
        let relay = FaultRelay::start(echo().await, 6).await.unwrap();
        let started = Instant::now();
        relay.inject(Fault::BlackHole, SHORT).await;
        assert!(started.elapsed() >= SHORT);
        assert_eq!(relay.fault(), None);
    }

    #[tokio::test]
    async fn dropping_the_relay_closes_its_port_and_connections() {
        let relay = FaultRelay::start(echo().await, 7).await.unwrap();
        let addr = relay.addr();
        let mut stream = TcpStream::connect(addr).await.unwrap();
        round_trip(&mut stream, b"up").await.unwrap();
        relay.cut().await;
        let mut buf = [0; 1];
        // The connection's task is gone with the relay: end of stream.
        assert_eq!(stream.read(&mut buf).await.unwrap(), 0);
        assert!(TcpStream::connect(addr).await.is_err());
    }
}
