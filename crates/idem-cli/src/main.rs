//! The `idem` command.

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = idem_cli::Cli::parse();
    match idem_cli::run(cli).await {
        Ok(code) => code,
        Err(e) => {
            // Each cause once: anyhow's `{:#}` would print a cause again wherever another
            // crate's error (sqlx's) holds it in its own message too.
            let e: &(dyn std::error::Error + 'static) = e.as_ref();
            eprintln!("idem: {}", idem_core::ErrorChain(e));
            ExitCode::from(2)
        }
    }
}
