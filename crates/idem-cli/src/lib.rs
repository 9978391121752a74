//! The `idem` command: the reference payments service and the tools around it.
//!
//! `main.rs` only parses arguments and prints errors; everything runs from here so the
//! integration tests can start the same service in-process.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use idem_cli::serve::{ServeConfig, serve};
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let config = ServeConfig::new("sqlite://idem.db");
//! serve(listener, config, std::future::pending()).await?;
//! # Ok(()) }
//! ```

use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod admin;
pub mod drill;
#[cfg(test)]
mod error_chains;
pub mod fake_psp;
pub mod keys;
pub mod proxy;
mod runtime;
pub mod serve;
pub mod simulate;
pub mod store_url;
mod telemetry;
pub mod tls_args;
pub mod worker;

/// idem: safe retries for payment and order APIs.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the reference payments API behind the idempotency layer.
    Serve(serve::ServeArgs),
    /// A fake payment provider for lease-mode payouts, with faults on demand.
    FakePsp(fake_psp::FakePspArgs),
    /// Inspect and act on idempotency keys: list, show, purge, resolve.
    Keys(keys::KeysArgs),
    /// Put the idempotency contract in front of any HTTP API (a reverse proxy).
    Proxy(proxy::ProxyArgs),
    /// Check an HTTP API against the idempotency contract (docs/contract.md §7) and report each check.
    Drill(drill::DrillArgs),
    /// Consume payment events and write one receipt per event, however often it is delivered.
    Worker(worker::WorkerArgs),
    /// Reproduce the ACK-loss experiment (docs/contract.md §8) over real HTTP: double charges without
    /// and with idempotency keys.
    Simulate(simulate::SimulateArgs),
}

/// Runs a parsed command line; returns the process exit code.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // The services export traces when an OTLP endpoint is set (docs/contract.md §15).
    let service = match &cli.command {
        Command::Serve(_) => Some("idem-serve"),
        Command::Proxy(_) => Some("idem-proxy"),
        Command::Worker(_) => Some("idem-worker"),
        _ => None,
    };
    let telemetry = telemetry::Telemetry::init(service)?;
    let result = match cli.command {
        Command::Serve(args) => serve::run(args).await.map(|()| ExitCode::SUCCESS),
        Command::Proxy(args) => proxy::run(args).await,
        Command::FakePsp(args) => fake_psp::run(args).await,
        Command::Keys(args) => keys::run(args).await,
        Command::Drill(args) => drill::run(args).await,
        Command::Simulate(args) => simulate::run(args).await,
        Command::Worker(args) => worker::run(args).await,
    };
    telemetry.shutdown();
    result
}
