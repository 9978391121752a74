//! A real `idem serve` on 127.0.0.1:0, in-process, with its own database and clock; and the
//! helpers of the tests that run `idem` as a child process.

#![allow(dead_code, unreachable_pub)]

pub mod payments;
pub mod processes;

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use idem_cli::serve::{ServeConfig, serve};
use idem_core::{ManualClock, Timestamp};
use sqlx::sqlite::SqlitePool;
use tokio::sync::oneshot;

/// A test's own key prefix on the shared Redis (records, the gateway's secret): its keys are
/// deleted when it is dropped, pass or fail.
pub struct RedisPrefix(pub String);

impl RedisPrefix {
    /// A fresh prefix naming `what`; fails at once, naming the command that starts it, if
    /// Redis is down.
    pub fn new(what: &str) -> Self {
        idem_testkit::require(idem_testkit::Service::Redis);
        Self(format!("idem-test-{what}-{}", rand::random::<u64>()))
    }
}

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        let _ = Command::new("redis-cli")
            .args([
                "EVAL",
                "for _, k in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('DEL', k) end",
                "0",
                &format!("{}:*", self.0),
            ])
            .output();
    }
}

pub const ALICE: &str = "sk_test_alice";
pub const BOB: &str = "sk_test_bob";

pub struct TestServer {
    pub url: String,
    pub clock: ManualClock,
    pub db_path: std::path::PathBuf,
    pub client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    _dir: tempfile::TempDir,
}

impl TestServer {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(adjust: impl FnOnce(&mut ServeConfig)) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let db_path = dir.path().join("idem.db");
        let clock = ManualClock::new(Timestamp(1_800_000_000_000));
        let mut config = ServeConfig::new(format!("sqlite://{}", db_path.display()));
        config.clock = std::sync::Arc::new(clock.clone());
        adjust(&mut config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, config, async {
            let _ = stopped.await;
        }));
        let server = Self {
            url,
            clock,
            db_path,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .build()
                .unwrap(),
            stop: Some(stop),
            task: Some(task),
            _dir: dir,
        };
        server.wait_healthy().await;
        server
    }

    async fn wait_healthy(&self) {
        // The listener is bound before `serve` runs, so the first request queues until the
        // database is open; no polling needed beyond one request.
        let status = self
            .client
            .get(format!("{}/healthz", self.url))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .expect("healthz answers")
            .status();
        assert_eq!(status, 200);
    }

    /// A `method` request to `path` on the server, with no credentials yet.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client.request(method, format!("{}{path}", self.url))
    }

    /// A `GET` of `path`, with no credentials yet.
    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.request(reqwest::Method::GET, path)
    }

    /// A JSON `POST` of `body` to `path` as `token`, with `key` as its Idempotency-Key when
    /// there is one.
    pub fn post_to(
        &self,
        path: &str,
        token: &str,
        key: Option<&str>,
        body: &str,
    ) -> reqwest::RequestBuilder {
        let request = self
            .request(reqwest::Method::POST, path)
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body.to_owned());
        keyed(request, key)
    }

    /// [`TestServer::post_to`] `/payments`.
    pub fn post(&self, token: &str, key: Option<&str>, body: &str) -> reqwest::RequestBuilder {
        self.post_to("/payments", token, key, body)
    }

    /// A separate connection to the service's database, for checking what it holds.
    pub async fn db(&self) -> SqlitePool {
        SqlitePool::connect(&format!("sqlite://{}", self.db_path.display()))
            .await
            .unwrap()
    }

    pub async fn count(&self, sql: &'static str) -> i64 {
        let db = self.db().await;
        let n: i64 = sqlx::query_scalar(sql).fetch_one(&db).await.unwrap();
        db.close().await;
        n
    }

    pub async fn payments(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM payments").await
    }

    pub async fn keys(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM idempotency_keys").await
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap().unwrap();
        }
    }
}

pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: serde_json::Value,
    pub raw: bytes::Bytes,
}

impl Answer {
    pub async fn of(response: reqwest::Response) -> Self {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let raw = response.bytes().await.unwrap();
        let body = serde_json::from_slice(&raw).unwrap_or(serde_json::Value::Null);
        Self {
            status,
            headers,
            body,
            raw,
        }
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn id(&self) -> &str {
        self.body["id"].as_str().unwrap_or("")
    }

    pub fn problem_type(&self) -> &str {
        assert_eq!(
            self.headers.get("content-type").unwrap(),
            "application/problem+json",
            "a problem-details response"
        );
        self.body["type"].as_str().unwrap()
    }
}

/// `request` with `key` as its Idempotency-Key, if there is one.
pub fn keyed(request: reqwest::RequestBuilder, key: Option<&str>) -> reqwest::RequestBuilder {
    match key {
        Some(key) => request.header("idempotency-key", key),
        None => request,
    }
}

pub async fn send(req: reqwest::RequestBuilder) -> Answer {
    Answer::of(req.send().await.expect("the server answers")).await
}

/// Runs the `idem` binary with `args` to its end (off the async runtime's threads).
pub async fn idem(args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

/// `idem SUBCOMMAND ARGS` run to its end: its exit code, stdout and stderr.
pub fn idem_output(subcommand: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg(subcommand)
        .args(args)
        .output()
        .unwrap();
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (
        output.status.code(),
        text(&output.stdout),
        text(&output.stderr),
    )
}

/// `idem drill --url URL` with the sandbox's two tokens, then `extra`.
pub fn drill_args(url: &str, extra: &[&str]) -> Vec<String> {
    ["drill", "--url", url, "--token-a", ALICE, "--token-b", BOB]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

/// `GET {url}/healthz` answers `{"status": "ok"}`.
pub async fn assert_healthy(client: &reqwest::Client, url: &str) {
    let health: serde_json::Value = answered_get(client, &format!("{url}/healthz"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "ok");
}

/// The text of `GET {url}/metrics`.
pub async fn metrics(client: &reqwest::Client, url: &str) -> String {
    answered_get(client, &format!("{url}/metrics"))
        .await
        .text()
        .await
        .unwrap()
}

async fn answered_get(client: &reqwest::Client, url: &str) -> reqwest::Response {
    client.get(url).send().await.expect("the server answers")
}

/// A fake payment provider on 127.0.0.1:0: the provider and its URL.
pub async fn start_psp() -> (idem_cli::fake_psp::FakePsp, String) {
    let psp = idem_cli::fake_psp::FakePsp::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let router = psp.router();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (psp, url)
}

/// A child process that says where it listens in its first line on stdout (`idem serve`,
/// `idem proxy`), its output read on threads of its own; dropping it kills it.
pub struct Spawned {
    pub child: std::process::Child,
    /// The first line it printed.
    pub first_line: String,
    /// The `http://…` address in that line.
    pub url: String,
    /// Its stderr, line by line as it comes.
    pub stderr: mpsc::Receiver<String>,
}

impl Spawned {
    /// Spawns `command` with stdout and stderr piped and waits for its first line.
    pub fn spawn(command: &mut Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the child");
        let (tx, stderr) = mpsc::channel();
        let lines = BufReader::new(child.stderr.take().expect("piped stderr")).lines();
        // Read to the end even when nobody listens any more: a full pipe would block the child.
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let first_line = stdout
            .next()
            .expect("the child printed a line")
            .expect("a line of text");
        // Keep reading stdout: a closed pipe would kill the child at its next line.
        std::thread::spawn(move || stdout.for_each(drop));
        let url = first_line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address in {first_line:?}"))
            .to_owned();
        Self {
            child,
            first_line,
            url,
            stderr,
        }
    }

    /// Waits up to `patience` for a line on stderr that contains `needle`; whether one came.
    pub fn await_line(&self, needle: &str, patience: Duration) -> bool {
        self.line_with(needle, patience).is_some()
    }

    /// The first line the child prints on stderr from now on that contains `needle`, within
    /// `patience`; `None` if it runs out, or the child closed its stderr (it died).
    pub fn line_with(&self, needle: &str, patience: Duration) -> Option<String> {
        let deadline = Instant::now() + patience;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return Some(line),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    }

    /// SIGKILL, as `kill -9`: no shutdown, no cleanup.
    pub fn kill9(&mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    /// SIGTERM, and how the child ended.
    pub fn terminate(&mut self) -> ExitStatus {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(sent.success());
        self.child.wait().expect("reap")
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
