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

pub mod serve;

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
}

/// Runs a parsed command line; returns the process exit code.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    init_tracing();
    match cli.command {
        Command::Serve(args) => {
            serve::run(args).await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
