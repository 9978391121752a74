//! Real processes for crash tests: `idem serve` children, a private database on the shared
//! PostgreSQL server, and a throwaway PostgreSQL cluster a test may crash at will. Every guard
//! cleans up on drop, also when the test fails.

#![allow(dead_code, unreachable_pub)]

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use tokio::sync::oneshot;

/// Where Debian puts PostgreSQL 15's server programs.
const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// How long a child may take to start before the test gives up on it.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A database of one test on the shared server; dropping it drops the database.
#[allow(unused_imports)] // not every test binary that includes this module uses it
pub use idem_testkit::postgres::PgTestDatabase as PgDatabase;

/// A running `idem` command that serves HTTP (`serve`, `proxy`); dropping it kills the
/// process.
pub struct Idem {
    /// `http://127.0.0.1:PORT` (or `https://`), as the process announced it.
    pub url: String,
    what: &'static str,
    child: Child,
    log: PathBuf,
}

impl Idem {
    /// Starts `idem ARGS` from `dir` with its stderr (warnings and errors) in `log`, reads the
    /// line that says where it listens, and waits until it answers `/healthz` (it prints that
    /// line before it opens its store).
    async fn start(what: &'static str, args: &[&str], dir: &Path, log: PathBuf) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .env("RUST_LOG", "warn")
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::create(&log).expect("create the log file"))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let mut idem = Self {
            url: String::new(),
            what,
            child,
            log,
        };
        idem.url = announced_url(stdout, what, || read_log(&idem.log)).await;
        // The listener is bound, so this request waits in its backlog until the service runs.
        // This probe only asks whether the process is up; the TLS tests check certificates.
        let health = reqwest::Client::builder()
            .tls_danger_accept_invalid_certs(true)
            .build()
            .expect("a client")
            .get(format!("{}/healthz", idem.url))
            .timeout(START_TIMEOUT)
            .send()
            .await
            .map(|r| r.status());
        assert!(
            matches!(health, Ok(s) if s.is_success()),
            "{what} is not healthy: {health:?}; its log:\n{}",
            idem.log()
        );
        idem
    }

    /// Kills the process with SIGKILL, as `kill -9` does: no shutdown, no cleanup.
    pub fn kill(&mut self) {
        let what = self.what;
        self.child
            .kill()
            .unwrap_or_else(|e| panic!("SIGKILL {what}: {e}"));
        self.child
            .wait()
            .unwrap_or_else(|e| panic!("reap {what}: {e}"));
    }

    /// The process's id, for signals other than the kill (e.g. SIGSTOP).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running (it was neither killed nor crashed).
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("poll the child").is_none()
    }

    /// What the process wrote to stderr so far.
    pub fn log(&self) -> String {
        read_log(&self.log)
    }
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

impl Drop for Idem {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `idem serve` process, with its own working directory; dropping it kills it.
pub struct Serve {
    idem: Idem,
    _dir: tempfile::TempDir,
}

impl Serve {
    /// Starts `idem serve --database DATABASE` on a free loopback port (see [`Idem`]).
    pub async fn start(database: &str) -> Self {
        Self::start_with(database, &[]).await
    }

    /// [`Serve::start`] with more flags.
    pub async fn start_with(database: &str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("serve.log");
        let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--database", database];
        args.extend_from_slice(extra);
        let idem = Idem::start("idem serve", &args, dir.path(), log).await;
        Self { idem, _dir: dir }
    }
}

impl std::ops::Deref for Serve {
    type Target = Idem;
    fn deref(&self) -> &Idem {
        &self.idem
    }
}

impl std::ops::DerefMut for Serve {
    fn deref_mut(&mut self) -> &mut Idem {
        &mut self.idem
    }
}

/// A running `idem proxy` process; dropping it kills it.
pub type Proxy = Idem;

impl Idem {
    /// Starts `idem proxy --listen 127.0.0.1:0 --upstream UPSTREAM` with `args` (the store,
    /// the secret…) from `dir`, its stderr in `log` (see [`Idem`]).
    pub async fn start_proxy(dir: &Path, upstream: &str, args: &[&str], log: PathBuf) -> Self {
        let mut all = vec!["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream];
        all.extend_from_slice(args);
        Self::start("idem proxy", &all, dir, log).await
    }
}

/// The `http://…` address in the first line a child prints, read on a thread of its own
/// (which then reads the pipe to its end: once it closed, the child's next println would
/// panic). `log` is shown if the line never comes.
async fn announced_url(
    stdout: std::process::ChildStdout,
    what: &str,
    log: impl FnOnce() -> String,
) -> String {
    let (first_line, announced) = oneshot::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(first)) = lines.next() {
            let _ = first_line.send(first);
        }
        lines.for_each(drop);
    });
    let first = match tokio::time::timeout(START_TIMEOUT, announced).await {
        Ok(Ok(line)) => line,
        _ => panic!("{what} did not say where it listens; its log:\n{}", log()),
    };
    first
        .split_whitespace()
        .find(|w| w.starts_with("http://") || w.starts_with("https://"))
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .to_owned()
}

/// A PostgreSQL cluster of the test's own, in a temporary directory on a free port, so it can
/// be crashed without touching the shared server. Dropping it stops it and deletes it.
pub struct Cluster {
    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub url: String,
    port: u16,
    data: PathBuf,
    dir: tempfile::TempDir,
}

impl Cluster {
    /// Creates a cluster with `initdb` (trust authentication, superuser `postgres`, also for
    /// replication) and starts it. PostgreSQL refuses to run as root, so its programs run as
    /// the `postgres` user, which owns the directory.
    pub fn start() -> Self {
        let cluster = Self::new();
        // --no-sync: a crash of the server, unlike one of the machine, keeps the page cache,
        // so the files need not reach the disk for the test to be sound.
        run(as_postgres(cluster.dir.path(), "initdb")
            .arg("-D")
            .arg(&cluster.data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync"]));
        cluster.start_on_a_free_port()
    }

    /// A hot standby of this cluster, streaming from it, started: a copy made with
    /// `pg_basebackup -R`, which also writes `standby.signal` and the `primary_conninfo` that
    /// points at this cluster. It takes no writes until [`promote`](Self::promote)d.
    pub fn standby(&self) -> Self {
        let standby = Self::new();
        run(as_postgres(standby.dir.path(), "pg_basebackup")
            .arg("-D")
            .arg(&standby.data)
            .args(self.client_args())
            .args(["-R", "-X", "stream", "--no-sync"]));
        standby.start_on_a_free_port()
    }

    /// Runs `sql` as `postgres` with psql (one statement per call: `ALTER SYSTEM` refuses to
    /// run in a transaction block); what it printed, unaligned, without headers.
    pub fn sql(&self, sql: &str) -> String {
        let output = run(as_postgres(self.dir.path(), "psql")
            .args(self.client_args())
            .args([
                "-d",
                "postgres",
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ]));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// Promotes a standby to a primary (`pg_ctl promote`) and waits until it takes writes.
    pub fn promote(&self) {
        run(self.pg_ctl().args(["-w", "-t", "60", "promote"]));
    }

    /// Where the server listens.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A cluster not created yet: a directory of the `postgres` user's, a port.
    fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("idem-pg-")
            .tempdir()
            .expect("temp dir");
        run(Command::new("chown")
            .arg("postgres:postgres")
            .arg(dir.path()));
        let port = free_port();
        Self {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            port,
            data: dir.path().join("data"),
            dir,
        }
    }

    /// Starts the server and waits until it accepts connections (after crash recovery, if
    /// it crashed).
    pub fn start_again(&self) {
        if let Err(failure) = self.try_start() {
            panic!("{failure}");
        }
    }

    /// Starts a new cluster. The port [`free_port`] found free may have been taken since,
    /// often by a client socket given it as its ephemeral port; then the server cannot bind
    /// it and exits, and the cluster starts again on another port.
    fn start_on_a_free_port(mut self) -> Self {
        for _ in 0..4 {
            let logged_before = self.log().len();
            match self.try_start() {
                Ok(()) => return self,
                Err(_) if self.log()[logged_before..].contains("could not bind") => {
                    self.port = free_port();
                    self.url = format!("postgres://postgres@127.0.0.1:{}/postgres", self.port);
                }
                Err(failure) => panic!("{failure}"),
            }
        }
        panic!(
            "no free port for a test cluster after 4 tries; its log:\n{}",
            self.log()
        )
    }

    /// `pg_ctl start`, waiting; on failure, what it and the server's log said.
    fn try_start(&self) -> Result<(), String> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1",
            self.port,
            self.dir.path().display()
        );
        let mut command = self.pg_ctl();
        command
            .arg("-l")
            .arg(self.dir.path().join("postgres.log"))
            .args(["-w", "-t", "60", "-o", &options, "start"]);
        let output = command
            .output()
            .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
        if output.status.success() {
            return Ok(());
        }
        Err(format!(
            "{command:?} failed ({}):\n{}{}\nthe server's log:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            self.log()
        ))
    }

    /// Stops the server with `-m immediate`: every server process quits at once, with no
    /// checkpoint, as in a crash; the next start runs crash recovery.
    pub fn crash(&self) {
        run(self.pg_ctl().args(["-m", "immediate", "-w", "stop"]));
    }

    /// Where the server listens (what a relay in front of it connects to).
    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// What the server logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    /// How a client program (psql, pg_basebackup) reaches this server, as `postgres`.
    fn client_args(&self) -> [String; 6] {
        let port = self.port.to_string();
        ["-h", "127.0.0.1", "-p", &port, "-U", "postgres"].map(str::to_owned)
    }

    fn pg_ctl(&self) -> Command {
        let mut command = as_postgres(self.dir.path(), "pg_ctl");
        command.arg("-D").arg(&self.data);
        command
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Fails harmlessly when the server is already down; the directory goes with `dir`.
        let stopped = self
            .pg_ctl()
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if let Err(e) = stopped {
            eprintln!("could not stop the test cluster on port {}: {e}", self.port);
        }
    }
}

/// `tool` from PostgreSQL's directory, run as the `postgres` user from `dir` (a directory it
/// can enter, unlike the test's own working directory).
fn as_postgres(dir: &Path, tool: &str) -> Command {
    let mut command = Command::new("runuser");
    command
        .args(["-u", "postgres", "--", &format!("{PG_BIN}/{tool}")])
        .current_dir(dir)
        .stdin(Stdio::null());
    command
}

/// Runs `command` to its end; panics with its output if it fails.
fn run(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// A loopback port nothing listens on now. The port is released before the server binds it;
/// another process taking it in between is possible but unlikely on a test machine.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}
