//! Memory: the peak resident set of `idem serve` with many open connections under load.
//!
//! `idem serve` runs in a process of its own (this binary, started as `idem-bench idem serve
//! …`, which runs the `idem` command's own entry point), so its resident set is its own and not
//! the harness's or the load generator's. The load is the harness's client with
//! [`CONNECTIONS`] keep-alive connections, each sending fresh-key payments one after another;
//! the kernel's high-water mark (`VmHWM`) gives the peak, and sampling `/proc/net/tcp` while
//! the load runs shows the connections really were open at once.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use tokio::process::{Child, Command};

use crate::child;
use crate::load::{self, Keys, Plan};
use crate::servers::payment_post;
use crate::workloads::{Env, sqlite_url};

/// Open connections while the peak is measured.
pub const CONNECTIONS: usize = 256;

/// The first argument that makes this binary run the `idem` command instead of the harness.
pub const AS_IDEM: &str = "idem";

/// What the memory workload measured.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryResult {
    /// Whether it was measured (`ok`), or why not.
    pub status: crate::runner::Status,
    /// Why not, when it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What ran: `idem serve` on which database.
    pub subject: String,
    /// Connections the load generator kept open.
    pub connections: usize,
    /// The most established connections to the server seen at once while the load ran.
    pub connections_seen: Option<usize>,
    /// Resident set once started, before any load, MiB.
    pub rss_idle_mib: Option<f64>,
    /// Peak resident set (`VmHWM`) over start-up and load, MiB.
    pub rss_peak_mib: Option<f64>,
    /// Resident set when the load ended, MiB.
    pub rss_end_mib: Option<f64>,
    /// Good answers per second under that load.
    pub throughput: Option<f64>,
    /// 99th percentile latency under that load, ms.
    pub p99_ms: Option<f64>,
    /// Failed requests in the window.
    pub errors: Option<u64>,
}

impl MemoryResult {
    fn failed(subject: String, reason: String) -> Self {
        Self {
            status: crate::runner::Status::Failed,
            reason: Some(reason),
            subject,
            connections: CONNECTIONS,
            connections_seen: None,
            rss_idle_mib: None,
            rss_peak_mib: None,
            rss_end_mib: None,
            throughput: None,
            p99_ms: None,
            errors: None,
        }
    }
}

/// A `/proc/PID/status` field in kB, as MiB.
fn status_mib(pid: u32, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Established TCP connections whose local end is `127.0.0.1:port` (the server's side).
fn established_to(port: u16) -> usize {
    let local = format!("0100007F:{port:04X}");
    std::fs::read_to_string("/proc/net/tcp")
        .map(|text| {
            text.lines()
                .skip(1)
                .filter(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"01")
                })
                .count()
        })
        .unwrap_or(0)
}

/// Starts `idem serve --database DATABASE` as a child process on a free port.
async fn start_idem_serve(database: &str) -> anyhow::Result<(Child, u16)> {
    let port = child::free_port()?;
    let exe = std::env::current_exe().context("cannot find the harness's own binary")?;
    let mut command = Command::new(exe);
    command
        .args([AS_IDEM, "serve", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--database")
        .arg(database);
    // Its default log level logs every stored key: kept, and thrown away.
    let mut child = child::spawn_quiet(&mut command).context("cannot start idem serve")?;
    let health = format!("http://127.0.0.1:{port}/healthz");
    child::wait_until_up(&mut child, &health, "idem serve").await?;
    Ok((child, port))
}

/// Runs the memory workload: `idem serve` on a new SQLite file in `dir`.
pub(crate) async fn measure(env: &Env, dir: &Path) -> MemoryResult {
    let database = sqlite_url(&dir.join("memory.db"));
    let subject = "idem serve, SQLite".to_owned();
    match run(env, &database).await {
        Ok(mut result) => {
            result.subject = subject;
            result
        }
        Err(e) => MemoryResult::failed(subject, format!("{e:#}")),
    }
}

async fn run(env: &Env, database: &str) -> anyhow::Result<MemoryResult> {
    let (mut child, port) = start_idem_serve(database).await?;
    let pid = child.id().context("idem serve exited")?;
    let rss_idle_mib = status_mib(pid, "VmRSS:");
    let mut target = payment_post(&format!("http://127.0.0.1:{port}/payments"));
    target.keys = Keys::Fresh {
        prefix: format!("{}-memory-", env.tag),
    };
    let settings = &env.settings;
    let plan = Plan {
        concurrency: CONNECTIONS,
        warmup: settings.warmup,
        duration: settings.duration,
    };
    let loading = env.runtimes.load.spawn(load::run(
        Arc::new(target),
        plan,
        format!("{}-memory", env.tag),
    ));
    // Sample the open connections while the load runs.
    let mut connections_seen = 0;
    let mut ticks = tokio::time::interval(Duration::from_millis(100));
    while !loading.is_finished() {
        ticks.tick().await;
        connections_seen = connections_seen.max(established_to(port));
    }
    let sample = loading.await.context("the load generator panicked")?;
    let rss_peak_mib = status_mib(pid, "VmHWM:");
    let rss_end_mib = status_mib(pid, "VmRSS:");
    let _ = child.kill().await;
    if sample.errors > 0 {
        anyhow::bail!(
            "{} of {} requests failed: {}",
            sample.errors,
            sample.requests + sample.errors,
            sample.first_error.as_deref().unwrap_or("")
        );
    }
    Ok(MemoryResult {
        status: crate::runner::Status::Ok,
        reason: None,
        subject: String::new(),
        connections: CONNECTIONS,
        connections_seen: Some(connections_seen),
        rss_idle_mib,
        rss_peak_mib,
        rss_end_mib,
        throughput: Some(sample.throughput),
        p99_ms: Some(sample.p99_ms),
        errors: Some(sample.errors),
    })
}
