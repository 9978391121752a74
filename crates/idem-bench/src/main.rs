//! `idem-bench`: parses the command line and runs the harness (see the library).

use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    match idem_bench::run(idem_bench::Args::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem-bench: {e:#}");
            ExitCode::from(2)
        }
    }
}
