//! Runs one micro-benchmark case a fixed number of times and nothing else, for instruction
//! counts that do not move with the machine's load:
//!
//! ```text
//! cargo build --release -p idem-bench --example micro_once
//! valgrind --tool=callgrind target/release/examples/micro_once fingerprint-64k 10
//! ```
//!
//! The count per operation is the difference between two runs (say 10 and 110 operations)
//! divided by their difference, so the setup (building the body) cancels out.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (Some(id), Some(times)) = (args.next(), args.next().and_then(|n| n.parse::<u64>().ok()))
    else {
        eprintln!("usage: micro_once CASE TIMES");
        return ExitCode::from(2);
    };
    let Some(mut case) = idem_bench::micro::cases().into_iter().find(|c| c.id == id) else {
        eprintln!("micro_once: no case {id:?}");
        return ExitCode::from(2);
    };
    for _ in 0..times {
        (case.run)();
    }
    ExitCode::SUCCESS
}
