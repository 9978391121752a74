//! A latency relay: a TCP proxy on `127.0.0.1:0` that holds every chunk a fixed time in each
//! direction before passing it on, so that PostgreSQL or Redis on loopback answers as one on
//! another host would (this machine has no netem). It counts round trips too: a client's
//! write that follows an answer from the server begins one.
//!
//! Tokio's timers tick in whole milliseconds, too coarse for a 0.25 ms hop, so chunks wait in
//! one queue that a thread of its own releases on time (`Condvar::wait_timeout` sleeps to the
//! tens of microseconds); tokio tasks read and write the sockets. Every chunk waits the same
//! delay, so the queue is already in the order chunks fall due. A hop takes the delay plus
//! the thread's wake-up, never less than the delay.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

use crate::cpu::RELAY_THREADS;

/// What a relay has seen, counted as it runs.
#[derive(Debug, Default)]
pub(crate) struct RelayCounts {
    /// Writes from a client that follow an answer from the server (or open the connection).
    round_trips: AtomicU64,
    /// Chunks written on.
    chunks: AtomicU64,
    /// How much later than their time the chunks were written on, in all, µs.
    late_micros: AtomicU64,
}

impl RelayCounts {
    /// The counts so far.
    pub(crate) fn tally(&self) -> RelayTally {
        RelayTally {
            round_trips: self.round_trips.load(Ordering::Relaxed),
            chunks: self.chunks.load(Ordering::Relaxed),
            late_micros: self.late_micros.load(Ordering::Relaxed),
        }
    }
}

/// [`RelayCounts`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RelayTally {
    /// Round trips, over every connection.
    pub(crate) round_trips: u64,
    chunks: u64,
    late_micros: u64,
}

impl RelayTally {
    /// How much later than its time a chunk was written on, on average, between `before` and
    /// `self`, ms: what the machine's scheduling added to the delay (nothing if no chunk).
    pub(crate) fn mean_late_ms(&self, before: &RelayTally) -> Option<f64> {
        let chunks = self.chunks - before.chunks;
        (chunks > 0).then(|| (self.late_micros - before.late_micros) as f64 / chunks as f64 / 1e3)
    }
}

/// A relay, running until dropped.
#[derive(Debug)]
pub(crate) struct Relay {
    addr: SocketAddr,
    counts: Arc<RelayCounts>,
    queue: Arc<Queue>,
    accept: JoinHandle<()>,
}

impl Relay {
    /// Starts a relay to `target` on `runtime` that holds each chunk for `delay` each way.
    pub(crate) async fn start(
        runtime: &Handle,
        target: SocketAddr,
        delay: Duration,
    ) -> anyhow::Result<Relay> {
        let queue = Arc::new(Queue::default());
        // Bound on the runtime itself, so the sockets belong to its I/O driver.
        let listener = runtime
            .spawn(TcpListener::bind("127.0.0.1:0"))
            .await?
            .context("the relay cannot bind")?;
        let addr = listener.local_addr()?;
        let releaser = Arc::clone(&queue);
        std::thread::Builder::new()
            .name(format!("{RELAY_THREADS}-clock"))
            .spawn(move || releaser.release())
            .context("cannot start the relay's thread")?;
        let counts = Arc::new(RelayCounts::default());
        let hop = Hop {
            target,
            delay,
            queue: Arc::clone(&queue),
            counts: Arc::clone(&counts),
        };
        let accept = runtime.spawn(accept(listener, hop));
        Ok(Relay {
            addr,
            counts,
            queue,
            accept,
        })
    }

    /// Where clients connect.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The counts, shared with whoever reads them while the relay runs.
    pub(crate) fn counts(&self) -> Arc<RelayCounts> {
        Arc::clone(&self.counts)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every connection's task.
        self.accept.abort();
        self.queue.stop();
    }
}

/// What each connection needs to relay.
#[derive(Debug, Clone)]
struct Hop {
    target: SocketAddr,
    delay: Duration,
    queue: Arc<Queue>,
    counts: Arc<RelayCounts>,
}

async fn accept(listener: TcpListener, hop: Hop) {
    let mut connections = JoinSet::new();
    loop {
        match listener.accept().await {
            Ok((client, _)) => {
                connections.spawn(relay_connection(client, hop.clone()));
            }
            // Too many open files, say: the client sees a refusal, and the loop waits a
            // moment rather than spin while nothing has closed.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
        while connections.try_join_next().is_some() {}
    }
}

/// Relays one connection both ways until both sides have closed.
async fn relay_connection(client: TcpStream, hop: Hop) {
    let Ok(server) = TcpStream::connect(hop.target).await else {
        return;
    };
    // Each chunk goes on at once: Nagle's algorithm would hold small ones back.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    // Set by the server's answers and taken by the client's next write. It starts set: the
    // first write of a client opens a round trip too.
    let answered = AtomicBool::new(true);
    let (to_server, for_server) = mpsc::unbounded_channel();
    let (to_client, for_client) = mpsc::unbounded_channel();
    tokio::join!(
        read(client_read, to_server, Flow::ToServer, &answered, &hop),
        write(for_server, server_write, &hop.counts),
        read(server_read, to_client, Flow::ToClient, &answered, &hop),
        write(for_client, client_write, &hop.counts),
    );
}

/// Which way a reader's bytes go.
#[derive(Debug, Clone, Copy)]
enum Flow {
    ToServer,
    ToClient,
}

/// Reads chunks from `from` and queues each for `to`, to be written after the delay.
async fn read(
    mut from: OwnedReadHalf,
    to: mpsc::UnboundedSender<Chunk>,
    flow: Flow,
    answered: &AtomicBool,
    hop: &Hop,
) {
    let mut buffer = vec![0; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        match flow {
            Flow::ToServer => {
                if answered.swap(false, Ordering::Relaxed) {
                    hop.counts.round_trips.fetch_add(1, Ordering::Relaxed);
                }
            }
            Flow::ToClient => answered.store(true, Ordering::Relaxed),
        }
        let chunk = Bytes::copy_from_slice(&buffer[..n]);
        hop.queue.push(hop.delay, to.clone(), chunk);
    }
    // Dropping `to` here closes the writer's channel once the chunks queued before (which
    // hold clones of it) have been written: the end of the stream is delayed like its bytes.
}

/// Writes what falls due to `to`, counting how late; closes its side once the reading side
/// has closed and every chunk queued before has been written.
async fn write(
    mut chunks: mpsc::UnboundedReceiver<Chunk>,
    mut to: OwnedWriteHalf,
    counts: &RelayCounts,
) {
    while let Some(Chunk { due, bytes }) = chunks.recv().await {
        if to.write_all(&bytes).await.is_err() {
            return;
        }
        let late = Instant::now().saturating_duration_since(due).as_micros() as u64;
        counts.chunks.fetch_add(1, Ordering::Relaxed);
        counts.late_micros.fetch_add(late, Ordering::Relaxed);
    }
    let _ = to.shutdown().await;
}

/// Bytes on their way, and when they were due to be written on.
#[derive(Debug)]
struct Chunk {
    due: Instant,
    bytes: Bytes,
}

/// Chunks waiting for their time, in the order they fall due, and the thread that releases
/// them. A std mutex, not a Tokio one: nothing awaits while it is held.
#[derive(Debug, Default)]
struct Queue {
    pending: Mutex<Pending>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Pending {
    chunks: VecDeque<Delayed>,
    stopped: bool,
}

/// A chunk and where it goes when it falls due.
#[derive(Debug)]
struct Delayed {
    to: mpsc::UnboundedSender<Chunk>,
    chunk: Chunk,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `chunk` for `to`, due `delay` from now. The time is read under the lock, so the
    /// queue stays in the order chunks fall due.
    fn push(&self, delay: Duration, to: mpsc::UnboundedSender<Chunk>, bytes: Bytes) {
        let mut pending = self.lock();
        let was_empty = pending.chunks.is_empty();
        let due = Instant::now() + delay;
        pending.chunks.push_back(Delayed {
            to,
            chunk: Chunk { due, bytes },
        });
        drop(pending);
        // The releasing thread waits for the first chunk, whose time a later one never moves.
        if was_empty {
            self.changed.notify_one();
        }
    }

    /// Ends [`Queue::release`]; the chunks still queued are dropped.
    fn stop(&self) {
        self.lock().stopped = true;
        self.changed.notify_one();
    }

    /// The releasing thread: hands each chunk to its writer when it falls due, until stopped.
    fn release(&self) {
        let mut due = Vec::new();
        let mut pending = self.lock();
        while !pending.stopped {
            let now = Instant::now();
            while pending
                .chunks
                .front()
                .is_some_and(|first| first.chunk.due <= now)
            {
                due.extend(pending.chunks.pop_front());
            }
            if !due.is_empty() {
                // Sending wakes a task; done without the lock, so readers never wait on it.
                drop(pending);
                for Delayed { to, chunk, .. } in due.drain(..) {
                    // An unbounded send never waits; it fails only once the connection is gone.
                    let _ = to.send(chunk);
                }
                pending = self.lock();
                continue;
            }
            let wait = pending
                .chunks
                .front()
                .map_or(Duration::from_secs(60), |first| first.chunk.due - now);
            pending = self
                .changed
                .wait_timeout(pending, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// A `postgres://` or `redis://` URL taken apart around its server, so that it can be
/// pointed at a relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DbUrl {
    /// `scheme://` and the user information with its `@`, if any.
    head: String,
    /// The server's `host:port` (the scheme's default port if the URL names none).
    server: String,
    /// The database, the query and the fragment, as written.
    tail: String,
}

impl DbUrl {
    pub(crate) fn parse(url: &str) -> anyhow::Result<Self> {
        let (scheme, rest) = url
            .split_once("://")
            .with_context(|| format!("{url:?} is not a URL"))?;
        let default_port = match scheme {
            "postgres" | "postgresql" => 5432,
            "redis" => 6379,
            _ => anyhow::bail!("the relay takes postgres:// and redis:// URLs, not {scheme}://"),
        };
        let (authority, tail) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
        let (userinfo, host_port) = match authority.rsplit_once('@') {
            Some((userinfo, host_port)) => (format!("{userinfo}@"), host_port),
            None => (String::new(), authority),
        };
        anyhow::ensure!(
            !host_port.is_empty() && !host_port.contains(','),
            "the relay needs one TCP host in the URL, not {host_port:?}"
        );
        // The port follows the last colon, unless that colon is inside an IPv6 address.
        let server = match host_port.rsplit_once(':') {
            Some((_, port)) if !port.contains(']') => host_port.to_owned(),
            _ => format!("{host_port}:{default_port}"),
        };
        Ok(Self {
            head: format!("{scheme}://{userinfo}"),
            server,
            tail: tail.to_owned(),
        })
    }

    /// The server's `host:port`.
    pub(crate) fn server(&self) -> &str {
        &self.server
    }

    /// The URL with `relay` in place of the server.
    pub(crate) fn through(&self, relay: SocketAddr) -> String {
        format!("{}{relay}{}", self.head, self.tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on 127.0.0.1:0: every connection gets back what it sends, then an end
    /// of stream when it ends its own.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                socket.set_nodelay(true).unwrap();
                tokio::spawn(async move {
                    let (mut read, mut write) = socket.into_split();
                    let _ = tokio::io::copy(&mut read, &mut write).await;
                    let _ = write.shutdown().await;
                });
            }
        });
        addr
    }

    /// Real time on purpose: the relay's delay is a wall-clock delay kept by a thread, which
    /// Tokio's paused clock does not drive.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_round_trip_takes_at_least_twice_the_delay_and_is_counted() {
        let echo = echo_server().await;
        for delay in [Duration::from_micros(250), Duration::from_millis(1)] {
            let relay = Relay::start(&Handle::current(), echo, delay).await.unwrap();
            let mut client = TcpStream::connect(relay.addr()).await.unwrap();
            client.set_nodelay(true).unwrap();
            let mut fastest = Duration::MAX;
            for i in 0..20u8 {
                let started = Instant::now();
                client.write_all(&[i]).await.unwrap();
                let mut answer = [0];
                client.read_exact(&mut answer).await.unwrap();
                fastest = fastest.min(started.elapsed());
                assert_eq!(answer, [i]);
            }
            assert!(
                fastest >= 2 * delay,
                "{fastest:?} through a {delay:?} relay"
            );
            assert_eq!(relay.counts().tally().round_trips, 20);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bytes_pass_intact_both_ways_and_so_does_the_end() {
        let echo = echo_server().await;
        let relay = Relay::start(&Handle::current(), echo, Duration::from_micros(250))
            .await
            .unwrap();
        let client = TcpStream::connect(relay.addr()).await.unwrap();
        let (mut read, mut write) = client.into_split();
        // Two MiB of every byte value in a pattern that never repeats within a chunk.
        let sent: Vec<u8> = (0..2u32 << 20).map(|i| (i ^ (i >> 9)) as u8).collect();
        let to_send = sent.clone();
        let writer = tokio::spawn(async move {
            for piece in to_send.chunks(7_777) {
                write.write_all(piece).await.unwrap();
            }
            write.shutdown().await.unwrap();
        });
        let mut received = Vec::new();
        // Ends only when the echo's end of stream has come back through the relay.
        read.read_to_end(&mut received).await.unwrap();
        writer.await.unwrap();
        assert_eq!(received.len(), sent.len());
        assert!(received == sent, "the bytes changed on the way");
    }

    #[test]
    fn urls_point_at_the_relay() {
        let relay: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let cases = [
            (
                "postgres://postgres@127.0.0.1:5432/idem_x?sslmode=disable",
                "postgres://postgres@127.0.0.1:40000/idem_x?sslmode=disable",
                "127.0.0.1:5432",
            ),
            (
                "redis://127.0.0.1:6379",
                "redis://127.0.0.1:40000",
                "127.0.0.1:6379",
            ),
            (
                "redis://:pw@localhost/2",
                "redis://:pw@127.0.0.1:40000/2",
                "localhost:6379",
            ),
            (
                "postgresql://u:p@[::1]/db",
                "postgresql://u:p@127.0.0.1:40000/db",
                "[::1]:5432",
            ),
        ];
        for (url, relayed, server) in cases {
            let parsed = DbUrl::parse(url).unwrap();
            assert_eq!(parsed.server(), server, "{url}");
            assert_eq!(parsed.through(relay), relayed, "{url}");
        }
        assert!(DbUrl::parse("sqlite://x.db").is_err());
        assert!(DbUrl::parse("postgres://a,b/db").is_err());
    }
}
