//! [`PgBouncer`]: a throwaway PgBouncer (Debian's `pgbouncer`) in transaction pooling mode, on
//! a loopback port picked for one test, in front of the test PostgreSQL (127.0.0.1:5432, user
//! `postgres`, trust), stopped by its PID when it is dropped, pass or fail.
//!
//! Transaction pooling is what Supabase, Neon, Heroku and many RDS set-ups put in front of
//! PostgreSQL: each transaction (each statement outside one) runs on whichever server session
//! is free, so nothing a client leaves on a session (a named statement, a `SET`, a `LISTEN`)
//! is there for its next transaction. PgBouncer 1.18 passes named statements through as they
//! are (1.21 and later can track them), and refuses the `options` startup parameter.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::processes::{kill, wait_until};

/// A PgBouncer in transaction pooling mode in front of the test PostgreSQL.
#[derive(Debug)]
pub struct PgBouncer {
    port: u16,
    dir: PathBuf,
    process: Option<Child>,
}

impl PgBouncer {
    /// Starts one whose pools hold up to `pool_size` server sessions per database, and returns
    /// once it accepts connections.
    ///
    /// # Panics
    ///
    /// At once, naming the command that installs it, when `pgbouncer` is missing; when
    /// PostgreSQL is down; when its files cannot be written; and when it does not accept
    /// connections within 30 s.
    pub fn start(pool_size: usize) -> Self {
        crate::require(crate::Service::Postgres);
        if Command::new("pgbouncer")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            panic!(
                "pgbouncer is not installed: this test puts Debian's PgBouncer between idem and \
                 PostgreSQL. Install it with `apt-get install -y pgbouncer` (.ci/run does)"
            );
        }
        let dir = std::env::temp_dir().join(format!(
            "idem-pgbouncer-{}-{}",
            std::process::id(),
            crate::redis_cluster::unique()
        ));
        std::fs::create_dir_all(&dir).expect("a folder for PgBouncer's files");
        let port = free_port();
        std::fs::write(dir.join("userlist.txt"), "\"postgres\" \"\"\n").expect("the auth file");
        std::fs::write(
            dir.join("pgbouncer.ini"),
            format!(
                "[databases]\n\
                 * = host=127.0.0.1 port=5432\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {auth}\n\
                 pool_mode = transaction\n\
                 default_pool_size = {pool_size}\n\
                 max_client_conn = 2000\n\
                 logfile = {log}\n",
                auth = dir.join("userlist.txt").display(),
                log = dir.join("pgbouncer.log").display(),
            ),
        )
        .expect("the configuration file");
        let mut bouncer = Self {
            port,
            dir,
            process: None,
        };
        bouncer.run();
        bouncer
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `url`, a URL of the test PostgreSQL (`postgres://postgres@127.0.0.1:5432/DB…`), through
    /// this PgBouncer instead: the same URL with its host and port.
    ///
    /// # Panics
    ///
    /// When `url` does not contain `127.0.0.1:5432`.
    pub fn url_for(&self, url: &str) -> String {
        let replaced = url.replacen("127.0.0.1:5432", &format!("127.0.0.1:{}", self.port), 1);
        assert_ne!(replaced, url, "expected a URL of 127.0.0.1:5432, got {url}");
        replaced
    }

    /// Kills it (SIGKILL: every client and server connection drops at once, as in a crash or
    /// a redeploy of the pooler); nothing listens on its port until [`start_again`](Self::start_again).
    pub fn kill(&mut self) {
        kill(&mut self.process);
    }

    /// Starts it again on the same port after a [`kill`](Self::kill); returns once it accepts
    /// connections.
    ///
    /// # Panics
    ///
    /// When it is still running, or does not accept connections within 30 s.
    pub fn start_again(&mut self) {
        assert!(self.process.is_none(), "PgBouncer is still running");
        self.run();
    }

    /// What PgBouncer logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    fn run(&mut self) {
        let mut command = Command::new("pgbouncer");
        // Run as root (CI), it refuses to start unless told which user to become, and that user
        // must read its files.
        if is_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&self.dir)
                .status()
                .expect("chown runs");
            assert!(status.success(), "chown -R postgres {}", self.dir.display());
            command.args(["-u", "postgres"]);
        }
        let process = command
            .arg(self.dir.join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("pgbouncer starts");
        self.process = Some(process);
        let addr = self.addr();
        wait_until(&format!("pgbouncer accepts connections on {addr}"), || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        });
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        kill(&mut self.process);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether this process runs as root (who must name the user PgBouncer becomes).
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}
