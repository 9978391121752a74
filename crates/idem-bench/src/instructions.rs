//! Instructions per request under callgrind: the one figure that does not move with this
//! machine's neighbours. Each variant runs in a child process under
//! `valgrind --tool=callgrind`, which counts instructions only while [`measured`] is on the
//! stack: the load generator, the server under test and the upstream all run there, on one
//! current-thread runtime, one request at a time, each with a fresh key. Redis, another
//! process, is not counted. Per request is the total over the requests sent.

use std::process::Stdio;

use anyhow::Context as _;
use serde::Serialize;

use crate::load::{self, HttpTarget};
use crate::servers::{self, StoreUrl};

/// The first argument that makes `idem-bench` the child that a variant runs in.
pub const AS_CHILD: &str = "__instructions-child";

/// A variant measured under callgrind.
#[derive(Debug, Clone, Copy)]
struct Case {
    id: &'static str,
    title: &'static str,
    /// At most this many instructions per request, if the issue set a target.
    target: Option<u64>,
}

const CASES: [Case; 2] = [
    Case {
        id: "proxy-redis",
        title: "idem proxy on Redis, first requests",
        target: Some(160_000),
    },
    Case {
        id: "plain-proxy",
        title: "plain reverse proxy (hyper), the floor",
        target: None,
    },
];

/// One variant's count.
#[derive(Debug, Clone, Serialize)]
pub struct InstructionsResult {
    /// `proxy-redis` or `plain-proxy`.
    pub id: &'static str,
    /// What ran.
    pub title: &'static str,
    /// Requests counted.
    pub requests: u64,
    /// Instructions per request (the load generator's and the upstream's included), when
    /// measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_request: Option<f64>,
    /// At most this many per request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<u64>,
    /// Why there is no count (valgrind or Redis missing, the child failed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl InstructionsResult {
    /// Whether the count meets its target.
    pub fn met(&self) -> Option<bool> {
        Some(self.per_request? <= self.target? as f64)
    }
}

/// Counts each variant's instructions per request: `requests` of them after a warm-up.
pub(crate) fn measure(redis_url: &str, tag: &str, requests: u64) -> Vec<InstructionsResult> {
    let skipped = |case: &Case, reason: String| InstructionsResult {
        id: case.id,
        title: case.title,
        requests,
        per_request: None,
        target: case.target,
        reason: Some(reason),
    };
    CASES
        .iter()
        .map(|case| match count(case, redis_url, tag, requests) {
            Ok(total) => InstructionsResult {
                per_request: Some(total as f64 / requests as f64),
                reason: None,
                ..skipped(case, String::new())
            },
            Err(e) => skipped(case, format!("{e:#}")),
        })
        .collect()
}

/// Runs `case` in a child under callgrind; the instructions counted inside [`measured`].
fn count(case: &Case, redis_url: &str, tag: &str, requests: u64) -> anyhow::Result<u64> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("callgrind.out");
    let exe = std::env::current_exe().context("cannot find idem-bench's own binary")?;
    let output = std::process::Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg("--collect-atstart=no")
        .arg("--toggle-collect=*instructions::measured*")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(exe)
        .args([AS_CHILD, case.id, &requests.to_string(), redis_url, tag])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                anyhow::anyhow!("valgrind is not installed (apt-get install valgrind)")
            }
            _ => anyhow::Error::new(e).context("cannot start valgrind"),
        })?;
    anyhow::ensure!(
        output.status.success(),
        "the child under callgrind failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
            .lines()
            .filter(|line| !line.starts_with("=="))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let text = std::fs::read_to_string(&out)
        .with_context(|| format!("callgrind wrote no {}", out.display()))?;
    let total = totals(&text).context("callgrind's output has no totals")?;
    anyhow::ensure!(
        total > 0,
        "callgrind counted nothing inside the measured window"
    );
    Ok(total)
}

/// The instructions of callgrind's `totals:` (or `summary:`) line.
fn totals(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| {
            line.strip_prefix("totals:")
                .or_else(|| line.strip_prefix("summary:"))
        })
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// The child: `AS_CHILD CASE REQUESTS REDIS_URL TAG`. Starts the upstream and the proxy of
/// `CASE` on one current-thread runtime, warms them up, then sends the requests inside
/// [`measured`].
pub fn child(args: &[String]) -> anyhow::Result<()> {
    let [case, requests, redis_url, tag] = args else {
        anyhow::bail!("usage: idem-bench {AS_CHILD} CASE REQUESTS REDIS_URL TAG");
    };
    let requests: u64 = requests.parse().context("REQUESTS is a number")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let handle = runtime.handle().clone();
    let (target, _servers) = runtime.block_on(async {
        let upstream = servers::upstream(&handle).await?;
        let proxy = match case.as_str() {
            "proxy-redis" => {
                let prefix = format!("{tag}-instructions:");
                let store = StoreUrl::Redis(redis_url.clone(), prefix);
                servers::gateway(&handle, store, &upstream.url("/")).await?
            }
            "plain-proxy" => servers::plain_proxy(&handle, &upstream.url("/")).await?,
            other => anyhow::bail!("no case {other}"),
        };
        let target = servers::payment_post(&proxy.url("/payments"));
        anyhow::Ok((target, [upstream, proxy]))
    })?;
    let keys = |phase: &str, n: u64| -> Vec<String> {
        (0..n)
            .map(|i| format!("{tag}-{case}-{phase}-{i}"))
            .collect()
    };
    // Connections, script loading, first allocations: outside the count.
    runtime.block_on(load::prime(&target, &keys("warm", 200), 1))?;
    measured(&runtime, &target, &keys("counted", requests))
}

/// The counted window (callgrind's `--toggle-collect` names it): one request per key, one at
/// a time.
#[inline(never)]
fn measured(
    runtime: &tokio::runtime::Runtime,
    target: &HttpTarget,
    keys: &[String],
) -> anyhow::Result<()> {
    runtime.block_on(load::prime(target, keys, 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_totals_line_is_read() {
        let out = "events: Ir\nsummary: 12345\nfn=(1) main\n0 1\ntotals: 67890\n";
        assert_eq!(totals(out), Some(12345));
        assert_eq!(totals("events: Ir\ntotals: 42\n"), Some(42));
        assert_eq!(totals("events: Ir\n"), None);
    }
}
