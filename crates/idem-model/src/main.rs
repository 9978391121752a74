//! `idem-model`: checks idem's protocol over every interleaving of small worlds.
//!
//! ```text
//! cargo run -p idem-model --release -- check              # every configuration: 0 violations
//! cargo run -p idem-model --release -- check --mutants    # every planted bug is caught
//! cargo run -p idem-model --release -- check --mutant complete-without-fence
//! ```

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use idem_model::{Config, Mutant, Report, Search, run};

#[derive(Parser, Debug)]
#[command(
    name = "idem-model",
    about = "Model-checks idem's protocol exhaustively for small worlds"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Checks every property in every configuration (exit 1 on any violation), or, with
    /// --mutant/--mutants, plants known bugs and checks each is caught (exit 1 if one survives).
    Check(CheckArgs),
    /// Lists the configurations and the mutants.
    List,
}

#[derive(clap::Args, Debug)]
struct CheckArgs {
    /// Only these configurations (default: all that `list` shows as checked).
    #[arg(long = "config", value_name = "NAME")]
    configs: Vec<String>,
    /// Plants this bug; the check passes only if a property catches it.
    #[arg(long = "mutant", value_name = "NAME", conflicts_with = "mutants")]
    mutant: Vec<Mutant>,
    /// Plants every known bug, one at a time.
    #[arg(long)]
    mutants: bool,
    /// Walks breadth first (a frontier in memory) instead of depth first with the two
    /// instances' symmetry folded. Counterexamples are always the shortest: a violation found
    /// depth first is looked for again breadth first.
    #[arg(long)]
    bfs: bool,
    /// Checker threads (default: the machine's cores).
    #[arg(long)]
    threads: Option<usize>,
    /// The smaller worlds the tests use.
    #[arg(long)]
    small: bool,
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::List => {
            list();
            ExitCode::SUCCESS
        }
        Command::Check(args) => match check(&args) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
    }
}

fn list() {
    println!("configurations checked by `check`:");
    for c in Config::all() {
        println!("  {:<26} {}", c.name, c.summary);
    }
    println!("configurations run only by name (--config):");
    for c in Config::extra() {
        println!("  {:<26} {}", c.name, c.summary);
    }
    println!("mutants (--mutant NAME, or --mutants for all):");
    for m in Mutant::ALL {
        println!("  {:<26} {}", m.name(), m.summary());
    }
}

/// The configurations `args` names.
fn configs(args: &CheckArgs, default: &[&str]) -> Result<Vec<Config>, String> {
    let all = if args.small {
        Config::small()
    } else {
        Config::all()
    };
    let names: Vec<&str> = if args.configs.is_empty() {
        default.to_vec()
    } else {
        args.configs.iter().map(String::as_str).collect()
    };
    names
        .into_iter()
        .map(|name| {
            all.iter()
                .find(|c| c.name == name)
                .cloned()
                .or_else(|| Config::by_name(name))
                .ok_or_else(|| {
                    format!("no configuration is called {name:?} (see `idem-model list`)")
                })
        })
        .collect()
}

/// Replaces the depth-first counterexamples of `report` by the shortest ones, found breadth
/// first (up to the first violation).
fn shortest_traces(report: &mut Report, config: Config, threads: usize) {
    let short = run(config, report.mutant, Search::Bfs, threads, true);
    for finding in &mut report.findings {
        if let Some(found) = short
            .findings
            .iter()
            .find(|s| s.property == finding.property && s.trace.is_some())
        {
            finding.trace.clone_from(&found.trace);
        }
    }
}

/// Runs what `args` asks; `Ok(true)` when it passed.
fn check(args: &CheckArgs) -> Result<bool, String> {
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let search = if args.bfs { Search::Bfs } else { Search::Dfs };
    let mutants: Vec<Mutant> = if args.mutants {
        Mutant::ALL.to_vec()
    } else {
        args.mutant.clone()
    };
    if mutants.is_empty() {
        let all: Vec<&str> = Config::all().iter().map(|c| c.name).collect();
        let mut passed = true;
        for config in configs(args, &all)? {
            eprintln!("checking {} ...", config.name);
            let mut report = run(config.clone(), None, search, threads, false);
            if search == Search::Dfs && report.violations().next().is_some() {
                shortest_traces(&mut report, config, threads);
            }
            println!("{report}");
            passed &= report.passed();
        }
        println!(
            "{}",
            if passed {
                "check passed"
            } else {
                "check FAILED"
            }
        );
        return Ok(passed);
    }
    let mut survivors = Vec::new();
    for mutant in mutants {
        println!("mutant {mutant}: {}", mutant.summary());
        let mut caught = false;
        for config in configs(args, mutant.configs())? {
            // Breadth first, to the first violation: the shortest counterexample.
            let report = run(config, Some(mutant), Search::Bfs, threads, true);
            caught |= report.violations().next().is_some();
            print!("{report}");
            if caught {
                break;
            }
        }
        println!(
            "mutant {mutant}: {}\n",
            if caught { "CAUGHT" } else { "SURVIVED" }
        );
        if !caught {
            survivors.push(mutant);
        }
    }
    if survivors.is_empty() {
        println!("every mutant was caught");
        Ok(true)
    } else {
        let names: Vec<_> = survivors.iter().map(|m| m.name()).collect();
        println!("mutants that SURVIVED: {}", names.join(", "));
        Ok(false)
    }
}
