//! The peers idem is compared with, installed by the harness into a scratch folder (cached
//! across runs) and started as child processes: `idempotent-proxy-server` from crates.io (a
//! Rust reverse proxy on Redis) and an Express app with `express-idempotency` and its Redis
//! adapter from npm. Nothing downloaded is ever part of the repository.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};

use anyhow::Context as _;
use tempfile::TempDir;
use tokio::process::{Child, Command};

use crate::child;

/// `$HOME/.cache/idem-bench-peers`, where peers are installed.
pub(crate) fn default_dir() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
    home.join(".cache").join("idem-bench-peers")
}

/// The package `cargo install` fetches.
pub(crate) const PROXY_CRATE: &str = "idempotent-proxy-server";

/// Installs `idempotent-proxy-server` under `dir/cargo` unless it is there already; returns
/// the binary.
pub(crate) async fn install_proxy_peer(dir: &Path) -> anyhow::Result<PathBuf> {
    let root = dir.join("cargo");
    let binary = root.join("bin").join(PROXY_CRATE);
    if binary.exists() {
        return Ok(binary);
    }
    std::fs::create_dir_all(&root)?;
    let log = dir.join("cargo-install.log");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .args(["install", "--locked", PROXY_CRATE, "--root"])
        .arg(&root)
        // Its own temporary target folder, not the harness's.
        .env_remove("CARGO_TARGET_DIR")
        .current_dir(dir);
    let status = install(&mut command, &log)
        .await
        .context("cannot run cargo install")?;
    anyhow::ensure!(
        status.success() && binary.exists(),
        "cargo install {PROXY_CRATE} failed ({status}); see {}",
        log.display()
    );
    Ok(binary)
}

/// Runs an installer, its output (both streams) in `log`.
async fn install(command: &mut Command, log: &Path) -> std::io::Result<ExitStatus> {
    command
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(log)?)
        .stderr(std::fs::File::options().append(true).open(log)?)
        .status()
        .await
}

/// A peer server running as a child process.
#[derive(Debug)]
pub(crate) struct Peer {
    /// The process (killed when dropped).
    pub(crate) child: Child,
    /// Where its payments endpoint is.
    pub(crate) url: String,
    /// Its process id, for CPU accounting.
    pub(crate) pid: u32,
    /// Its working folder, when it has a temporary one (removed after the process).
    _work: Option<TempDir>,
}

impl Peer {
    /// Waits until `child`, listening on `port`, answers at `health`; its payments endpoint is
    /// at `payments`, and `work` goes with it.
    async fn up(
        mut child: Child,
        port: u16,
        health: &str,
        payments: &str,
        work: Option<TempDir>,
    ) -> anyhow::Result<Self> {
        let base = format!("http://127.0.0.1:{port}");
        child::wait_until_up(&mut child, &format!("{base}{health}"), "the peer").await?;
        let pid = child.id().context("the peer exited")?;
        Ok(Self {
            child,
            url: format!("{base}{payments}"),
            pid,
            _work: work,
        })
    }
}

/// Starts `idempotent-proxy-server` in front of `upstream` (a full URL) with its cache on
/// `redis_url`. It reads its settings from a `.env` in its working folder, a temporary one;
/// requests to `/URL_UPSTREAM` go to `upstream`.
pub(crate) async fn start_proxy_peer(
    binary: &Path,
    upstream: &str,
    redis_url: &str,
) -> anyhow::Result<Peer> {
    let work = tempfile::tempdir()?;
    let port = child::free_port()?;
    // LOG_LEVEL=warn: it logs every request at info; idem's layer logs nothing per request
    // without a subscriber, so both run quiet.
    std::fs::write(
        work.path().join(".env"),
        format!(
            "SERVER_ADDR=127.0.0.1:{port}\nREDIS_URL={redis_url}\nURL_UPSTREAM={upstream}\nLOG_LEVEL=warn\n"
        ),
    )?;
    let child = child::spawn_quiet(Command::new(binary).current_dir(work.path()))
        .with_context(|| format!("cannot start {}", binary.display()))?;
    Peer::up(child, port, "/", "/URL_UPSTREAM", Some(work)).await
}

/// The npm packages of the Express peer.
const NPM_PACKAGES: [&str; 3] = [
    "express@5",
    "express-idempotency@1",
    "express-idempotency-redis-adapter@1",
];

/// Installs the Express peer's packages under `dir/npm` unless they are there already;
/// returns that folder.
pub(crate) async fn install_express_peer(dir: &Path) -> anyhow::Result<PathBuf> {
    let npm_dir = dir.join("npm");
    let installed = NPM_PACKAGES.iter().all(|package| {
        let name = package.rsplit_once('@').map_or(*package, |(name, _)| name);
        let manifest = npm_dir.join("node_modules").join(name).join("package.json");
        manifest.exists()
    });
    if installed {
        return Ok(npm_dir);
    }
    std::fs::create_dir_all(&npm_dir)?;
    let manifest = npm_dir.join("package.json");
    if !manifest.exists() {
        std::fs::write(&manifest, r#"{"name":"idem-bench-peer","private":true}"#)?;
    }
    let log = dir.join("npm-install.log");
    let mut command = Command::new("npm");
    command
        .args(["install", "--no-audit", "--no-fund"])
        .args(NPM_PACKAGES)
        .current_dir(&npm_dir);
    let status = install(&mut command, &log)
        .await
        .context("cannot run npm (is Node.js installed?)")?;
    anyhow::ensure!(
        status.success(),
        "npm install failed ({status}); see {}",
        log.display()
    );
    Ok(npm_dir)
}

/// The Express app: the same trivial in-memory handler as the axum app, behind
/// `express-idempotency` on Redis. The middleware answers a replay itself and then still calls
/// the handler, which must check `isHit` (as its README says).
const EXPRESS_APP: &str = r#"'use strict';
// Written by idem-bench at run time; see crates/idem-bench/src/peers.rs.
const express = require('express');
const { idempotency, getSharedIdempotencyService } = require('express-idempotency');
const RedisAdapter = require('express-idempotency-redis-adapter').default;

const adapter = new RedisAdapter({ connectionConfig: { url: process.env.REDIS_URL }, ttl: 3600 });
const app = express();
let counter = 0;

app.get('/healthz', (req, res) => res.send('ok'));
app.post('/payments', express.json(), idempotency({ dataAdapter: adapter }), (req, res) => {
  if (getSharedIdempotencyService().isHit(req)) {
    return;
  }
  const { amount, currency } = req.body || {};
  if (!Number.isInteger(amount) || amount <= 0 || !/^[A-Z]{3}$/.test(currency || '')) {
    res.status(400).json({ error: 'invalid payment' });
    return;
  }
  counter += 1;
  const id = `pay_${counter}`;
  res.status(201).location(`/payments/${id}`)
    .json({ id, amount, currency, status: 'succeeded', created_at: 0 });
});

adapter.connect().then(() => {
  app.listen(Number(process.env.PORT), '127.0.0.1');
}).catch((e) => { console.error(e); process.exit(1); });
"#;

/// Starts the Express app (written into `npm_dir` at run time) with its records on
/// `redis_url`.
pub(crate) async fn start_express_peer(npm_dir: &Path, redis_url: &str) -> anyhow::Result<Peer> {
    let app = npm_dir.join("idem-bench-express.js");
    std::fs::write(&app, EXPRESS_APP)?;
    let port = child::free_port()?;
    let mut command = Command::new("node");
    command
        .arg(&app)
        .env("PORT", port.to_string())
        .env("REDIS_URL", redis_url)
        .env("NODE_ENV", "production")
        .current_dir(npm_dir);
    let child = child::spawn_quiet(&mut command).context("cannot start node")?;
    Peer::up(child, port, "/healthz", "/payments", None).await
}
