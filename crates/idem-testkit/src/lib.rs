//! What idem's tests share.
//!
//! [`require`] checks that a service a test talks to is up, so a test whose service is missing
//! fails in seconds with a message naming the command that starts it, instead of hanging in a
//! client's own connect or delivery timeout (librdkafka waits a minute and more).
//!
//! ```
//! use idem_testkit::{Service, require};
//! # fn test() {
//! require(Service::Redis); // panics at once, naming scripts/services.sh, if Redis is down
//! # }
//! ```
//!
//! [`assert_unfinished_heads_are_closed`] checks that an HTTP server closes a connection
//! whose request head never completes (a slowloris), whichever server it is.
//!
//! The rest puts real parts in a test's way: [`fault_relay`] a TCP relay that injects network
//! faults, [`grpcio`] Python's gRPC client with its retry policy, [`postgres`] a throwaway
//! database per test (feature `postgres`), [`pgbouncer`], [`redis_cluster`] and
//! [`nats_cluster`] servers started from the machine's binaries. Test
//! support lives here, not in the libraries it tests, so that a library's public surface holds
//! only what its users call, and a change to a test helper rebuilds tests, not libraries.

#![warn(clippy::missing_errors_doc, clippy::missing_panics_doc)]

pub mod fault_relay;
pub mod grpcio;
pub mod nats_cluster;
pub mod pgbouncer;
#[cfg(feature = "postgres")]
pub mod postgres;
mod processes;
pub mod redis_cluster;

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A service on loopback that idem's tests talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Service {
    /// PostgreSQL on 127.0.0.1:5432, user `postgres`, trust authentication.
    Postgres,
    /// Redis on 127.0.0.1:6379.
    Redis,
    /// NATS with JetStream on 127.0.0.1:4222.
    Nats,
    /// RabbitMQ on 127.0.0.1:5672, guest/guest.
    RabbitMq,
    /// A Kafka-compatible broker (tansu) on 127.0.0.1:19092.
    Kafka,
}

impl Service {
    /// Its name, as an operator knows it.
    pub fn name(self) -> &'static str {
        match self {
            Service::Postgres => "PostgreSQL",
            Service::Redis => "Redis",
            Service::Nats => "NATS (with JetStream)",
            Service::RabbitMq => "RabbitMQ",
            Service::Kafka => "a Kafka-compatible broker (tansu)",
        }
    }

    /// Where the tests expect it.
    pub fn addr(self) -> SocketAddr {
        let port = match self {
            Service::Postgres => 5432,
            Service::Redis => 6379,
            Service::Nats => 4222,
            Service::RabbitMq => 5672,
            Service::Kafka => 19092,
        };
        SocketAddr::from(([127, 0, 0, 1], port))
    }
}

/// How long a service on loopback may take to accept a connection before it counts as down.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Panics, naming the command that starts it, unless `service` accepts a TCP connection.
///
/// # Panics
///
/// When `service` does not accept a TCP connection at its [`addr`](Service::addr) within 2 s.
pub fn require(service: Service) {
    if let Err(message) = check(service, service.addr()) {
        panic!("{message}");
    }
}

/// Whether `service` answers at `addr`; the message says what to do when it does not.
fn check(service: Service, addr: SocketAddr) -> Result<(), String> {
    match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
        Ok(_) => Ok(()),
        Err(error) => Err(format!(
            "{} is not reachable on {addr} ({error}): this test needs it. Start every service \
             the tests use with `bash scripts/services.sh` from the repository root (it builds \
             tansu once); see CONTRIBUTING.md",
            service.name()
        )),
    }
}

/// How long a server may hold a connection whose request head never completes before
/// [`assert_unfinished_heads_are_closed`] fails: far above any head deadline a test sets.
const UNFINISHED_HEAD_BOUND: Duration = Duration::from_secs(10);

/// Sends half a request head (a `POST` to `path` cut off inside a header name), and on another
/// connection nothing at all, to the HTTP server at `addr` (`HOST:PORT`), and returns once the
/// server has ended both connections, by EOF or reset.
///
/// # Panics
///
/// When a connection to `addr` cannot be made or written to, or is still open after 10 s.
pub async fn assert_unfinished_heads_are_closed(addr: &str, path: &str) {
    let half_head = format!("POST {path} HTTP/1.1\r\nHost: x\r\nIdempot");
    for partial in [half_head.as_bytes(), b""] {
        let mut socket = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connect to the server");
        socket
            .write_all(partial)
            .await
            .expect("write the partial head");
        let mut rest = Vec::new();
        // EOF or a reset: either way the server ended it, well before the bound.
        let _ended = tokio::time::timeout(UNFINISHED_HEAD_BOUND, socket.read_to_end(&mut rest))
            .await
            .expect("closed by the server, not left hanging");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_port_is_named_with_its_address_and_the_command_that_starts_it() {
        // A port nobody listens on: bound, then closed.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let message = check(Service::Kafka, addr).unwrap_err();
        assert!(message.contains("tansu"), "{message}");
        assert!(message.contains(&addr.to_string()), "{message}");
        assert!(message.contains("scripts/services.sh"), "{message}");
    }

    #[test]
    fn a_listening_port_passes() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert_eq!(
            check(Service::Redis, listener.local_addr().unwrap()),
            Ok(())
        );
    }
}
