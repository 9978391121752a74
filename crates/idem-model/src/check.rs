//! Running the checker over a configuration, and what it found.

use std::fmt;
use std::time::{Duration, Instant};

use stateright::{Checker, Expectation, HasDiscoveries, Model};

use crate::config::Config;
use crate::model::IdemModel;
use crate::mutant::Mutant;
use crate::trace;
use crate::world::World;

/// How the state space is walked. Both visit every reachable state once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Search {
    /// Breadth first: the counterexamples it finds are the shortest. Keeps a wide frontier.
    Bfs,
    /// Depth first: a frontier only as deep as a run.
    Dfs,
}

/// What the checker found for one property.
#[derive(Debug, Clone)]
pub struct Finding {
    /// The property's name.
    pub property: &'static str,
    /// `true` for an invariant (a discovery is a violation), `false` for a reachability check
    /// (a discovery is the example that shows the world is not vacuous).
    pub invariant: bool,
    /// The discovery, rendered as a trace: a violation's counterexample, or a reachability
    /// example.
    pub trace: Option<String>,
}

impl Finding {
    /// Whether this property failed: an invariant violated, or something never reached.
    pub fn failed(&self) -> bool {
        self.invariant == self.trace.is_some()
    }
}

/// One run of the checker: a configuration, maybe a mutant, the states and the findings.
#[derive(Debug, Clone)]
pub struct Report {
    /// The configuration's name.
    pub config: &'static str,
    /// Its one-line summary.
    pub summary: &'static str,
    /// The planted bug.
    pub mutant: Option<Mutant>,
    /// Distinct states visited.
    pub states: usize,
    /// States generated, repeats included.
    pub generated: usize,
    /// The longest run explored, in steps.
    pub depth: usize,
    /// Wall time.
    pub elapsed: Duration,
    /// Whether every reachable state was visited (not stopped at the first violation).
    pub complete: bool,
    /// One finding per property.
    pub findings: Vec<Finding>,
}

impl Report {
    /// The invariants violated.
    pub fn violations(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.invariant && f.trace.is_some())
    }

    /// Whether every invariant held and everything expected was reached.
    pub fn passed(&self) -> bool {
        !self.findings.iter().any(Finding::failed)
    }
}

/// Runs the checker on `config` with `mutant` planted, to completion (or, with
/// `stop_at_violation`, to the first violation).
pub fn run(
    config: Config,
    mutant: Option<Mutant>,
    search: Search,
    threads: usize,
    stop_at_violation: bool,
) -> Report {
    let (name, summary) = (config.name, config.summary);
    let model = IdemModel::new(config, mutant);
    let properties = model.properties();
    let started = Instant::now();
    let mut builder = model.checker().threads(threads.max(1));
    if stop_at_violation {
        builder = builder.finish_when(HasDiscoveries::AnyFailures);
    }
    let mut report = match search {
        Search::Bfs => report(
            builder.spawn_bfs().join(),
            &properties,
            started,
            name,
            summary,
        ),
        // Depth first also folds the worlds that differ only in which instance is which.
        Search::Dfs => report(
            builder.symmetry_fn(World::canonical).spawn_dfs().join(),
            &properties,
            started,
            name,
            summary,
        ),
    };
    report.complete = !(stop_at_violation && report.violations().next().is_some());
    report
}

/// The report of a finished `checker`.
fn report(
    checker: impl Checker<IdemModel>,
    properties: &[stateright::Property<IdemModel>],
    started: Instant,
    config: &'static str,
    summary: &'static str,
) -> Report {
    let elapsed = started.elapsed();
    let discoveries = checker.discoveries();
    let findings = properties
        .iter()
        .map(|p| Finding {
            property: p.name,
            invariant: p.expectation != Expectation::Sometimes,
            trace: discoveries
                .get(p.name)
                .map(|path| trace::render(checker.model(), path)),
        })
        .collect();
    Report {
        config,
        summary,
        mutant: checker.model().mutant,
        states: checker.unique_state_count(),
        generated: checker.state_count(),
        depth: checker.max_depth(),
        elapsed,
        complete: true,
        findings,
    }
}

/// Groups digits by thousands: 1,234,567.
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let planted = self
            .mutant
            .map_or(String::new(), |m| format!(" with mutant {m}"));
        writeln!(
            f,
            "{}{planted}: {} states ({} generated), depth {}, {:.1} s\n  ({})",
            self.config,
            thousands(self.states),
            thousands(self.generated),
            self.depth,
            self.elapsed.as_secs_f64(),
            self.summary,
        )?;
        if !self.complete {
            writeln!(f, "  (stopped at the first violation)")?;
        }
        for finding in &self.findings {
            // A run stopped early has only its violation to show.
            let violated = finding.invariant && finding.trace.is_some();
            if !self.complete && !violated {
                continue;
            }
            let verdict = match (finding.invariant, &finding.trace) {
                (true, None) => "0 violations".to_string(),
                (true, Some(_)) => "VIOLATED; counterexample:".to_string(),
                (false, Some(_)) => "reached".to_string(),
                (false, None) => "NEVER REACHED (the world is vacuous)".to_string(),
            };
            let dots = ".".repeat(52usize.saturating_sub(finding.property.len()));
            writeln!(f, "  {} {dots} {verdict}", finding.property)?;
            if finding.invariant
                && let Some(trace) = &finding.trace
            {
                write!(f, "{trace}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::names;

    /// Checks the small world of `config` to completion, depth first (as `check` does), on
    /// one thread: the test runner runs the tests side by side.
    fn check(config: Config) -> Report {
        run(config.shrunk(), None, Search::Dfs, 1, false)
    }

    #[track_caller]
    fn assert_kept(report: Report) {
        assert!(report.passed(), "{report}");
        assert!(
            report.states > 1_000,
            "a world this small checks nothing:\n{report}"
        );
    }

    #[test]
    fn transaction_mode_keeps_its_promises() {
        assert_kept(check(Config::transaction()));
    }

    #[test]
    fn lease_mode_with_takeover_keeps_its_promises_over_a_deduping_downstream() {
        assert_kept(check(Config::lease_takeover_dedupe()));
    }

    /// Fails while `idem_core::decide` lets an in-progress record expire by retention: the
    /// unknown outcome is then claimed afresh (or swept) and the work runs twice.
    #[test]
    fn lease_mode_with_a_reconciler_keeps_its_promises_over_any_downstream() {
        assert_kept(check(Config::lease_reconciler()));
    }

    #[test]
    fn lease_mode_with_a_reconciler_refuses_another_request_with_the_key() {
        assert_kept(check(Config::lease_reconciler_mismatch()));
    }

    #[test]
    fn lease_mode_with_a_reconciler_keeps_its_promises_through_stalls_over_a_deduping_downstream() {
        assert_kept(check(Config::lease_reconciler_dedupe()));
    }

    /// Plants `mutant` in the small worlds it belongs to; the violation that caught it.
    fn catch(mutant: Mutant) -> (Report, &'static str) {
        for name in mutant.configs() {
            let config = Config::by_name(name).expect("a mutant's configuration exists");
            let report = run(config.shrunk(), Some(mutant), Search::Bfs, 1, true);
            let caught = report.violations().next().map(|f| f.property);
            if let Some(property) = caught {
                return (report, property);
            }
        }
        panic!("mutant {mutant} survived");
    }

    #[test]
    fn a_reconciler_trusting_a_404_before_the_old_calls_deadline_is_caught() {
        let (report, property) = catch(Mutant::Reconciler404Early);
        assert_eq!(property, names::ONE_EFFECT, "{report}");
        let trace = report
            .violations()
            .next()
            .unwrap()
            .trace
            .as_deref()
            .unwrap();
        assert!(trace.contains("downstream says 404"), "{trace}");
    }

    #[test]
    fn a_claim_made_of_a_read_and_a_write_is_caught() {
        let (report, property) = catch(Mutant::ClaimReadThenWrite);
        assert_eq!(property, names::ONE_EFFECT, "{report}");
    }

    #[test]
    fn a_completion_without_the_fence_is_caught() {
        let (report, property) = catch(Mutant::CompleteWithoutFence);
        assert_eq!(property, names::FENCING, "{report}");
    }

    #[test]
    fn an_unknown_outcome_claimed_afresh_is_caught() {
        let (report, property) = catch(Mutant::UnknownExpiresToFresh);
        assert_eq!(property, names::ONE_EFFECT, "{report}");
    }

    #[test]
    fn an_in_progress_record_expiring_by_retention_is_caught() {
        let (report, property) = catch(Mutant::InProgressExpires);
        assert_eq!(property, names::ONE_EFFECT, "{report}");
    }

    /// Where the contract stops: a worker that stalls past its lease before its call, over a
    /// downstream that does not dedupe, charges a second time after the reconciler's `404`.
    #[test]
    fn a_stall_past_the_lease_double_charges_a_downstream_that_does_not_dedupe() {
        let report = run(
            Config::lease_reconciler_stalls(),
            None,
            Search::Bfs,
            1,
            true,
        );
        let finding = report.violations().next().expect("a violation");
        assert_eq!(finding.property, names::ONE_EFFECT, "{report}");
        assert!(
            finding.trace.as_deref().unwrap().contains("stalls"),
            "{report}"
        );
    }

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(12_345_678), "12,345,678");
    }
}
