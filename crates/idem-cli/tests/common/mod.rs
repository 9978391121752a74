//! A real `idem serve` on 127.0.0.1:0, in-process, with its own database and clock.

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use idem_cli::serve::{ServeConfig, serve};
use idem_core::{ManualClock, Timestamp};
use sqlx::sqlite::SqlitePool;
use tokio::sync::oneshot;

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

    pub fn post(&self, token: &str, key: Option<&str>, body: &str) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(format!("{}/payments", self.url))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req
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

/// `idem drill --url URL` with the sandbox's two tokens, then `extra`.
pub fn drill_args(url: &str, extra: &[&str]) -> Vec<String> {
    ["drill", "--url", url, "--token-a", ALICE, "--token-b", BOB]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}
