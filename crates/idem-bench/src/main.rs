//! `idem-bench`: parses the command line and runs the harness (see the library). Started as
//! `idem-bench idem …` it is the `idem` command instead: the memory workload runs `idem serve`
//! in a process of its own that way, whatever has been built besides this binary.

use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == idem_bench::memory::AS_IDEM)
    {
        return idem();
    }
    let args: Vec<String> = std::env::args().collect();
    if args
        .get(1)
        .is_some_and(|a| a == idem_bench::instructions::AS_CHILD)
    {
        return match idem_bench::instructions::child(&args[2..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("idem-bench {}: {e:#}", idem_bench::instructions::AS_CHILD);
                ExitCode::from(2)
            }
        };
    }
    match idem_bench::run(idem_bench::Args::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem-bench: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// What the `idem` binary's `main` does, on the arguments after `idem`.
fn idem() -> ExitCode {
    let cli = idem_cli::Cli::parse_from(std::env::args_os().skip(1));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("idem: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(idem_cli::run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem: {e:#}");
            ExitCode::from(2)
        }
    }
}
