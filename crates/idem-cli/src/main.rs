//! The `idem` command.

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = idem_cli::Cli::parse();
    match idem_cli::run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem: {e:#}");
            ExitCode::from(2)
        }
    }
}
