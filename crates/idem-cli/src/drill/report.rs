//! What the drill found: one row per check, each naming the rule that decided it, as a table or
//! as JSON.

use std::fmt::Write as _;
use std::process::ExitCode;

use serde::Serialize;

use super::rules::{Profile, Rule, Weight};

/// How a check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// The check could not run against this API, or the profile does not judge it; the
    /// detail says why. Not a pass.
    Skip,
    /// The API did what the rule says.
    Pass,
    /// It departed from a rule the profile only recommends (a SHOULD of the draft, a
    /// convention): it keeps its promise, differently. Fails the run only with `--strict`.
    Warn,
    /// It broke the promise, or a rule the profile requires; the detail says what it did.
    Fail,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Self::Pass => "PASS",
            Self::Warn => "WARN",
            Self::Fail => "FAIL",
            Self::Skip => "SKIP",
        }
    }
}

/// One check's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// A short stable name, such as `concurrent` or `body-mismatch`.
    pub name: &'static str,
    /// Pass, warn, fail or skip.
    pub status: Status,
    /// Where the rule that decided the status is written: a section of the IETF draft
    /// (`draft §2.7`), `Stripe convention`, or a section of idem's contract.
    pub rule: &'static str,
    /// What the drill saw, in a line, and what the rule expected instead.
    pub detail: String,
}

impl Check {
    /// A check that could not run (or that the profile does not judge), with why.
    pub(crate) fn skip(
        name: &'static str,
        rule: Rule,
        profile: Profile,
        why: impl Into<String>,
    ) -> Self {
        Self {
            name,
            status: Status::Skip,
            rule: rule.citation(profile),
            detail: why.into(),
        }
    }
}

/// What one check saw, and each way the API departed from a rule; judged into a [`Check`]
/// under a profile.
#[derive(Debug)]
pub(crate) struct Findings {
    name: &'static str,
    /// The rule named when nothing departs.
    main: Rule,
    saw: String,
    /// Each departure: the rule, and what it expected.
    departures: Vec<(Rule, String)>,
}

impl Findings {
    pub(crate) fn new(name: &'static str, main: Rule, saw: impl Into<String>) -> Self {
        Self {
            name,
            main,
            saw: saw.into(),
            departures: Vec::new(),
        }
    }

    /// The API departed from `rule`, which `expected` something else.
    pub(crate) fn depart(&mut self, rule: Rule, expected: impl Into<String>) -> &mut Self {
        self.departures.push((rule, expected.into()));
        self
    }

    /// Departs from `rule` unless `ok`.
    pub(crate) fn require(&mut self, ok: bool, rule: Rule, expected: &str) -> &mut Self {
        if !ok {
            self.depart(rule, expected);
        }
        self
    }

    /// The row under `profile`: the worst judged departure decides the status and names its
    /// rule; departures the profile does not judge are left out.
    pub(crate) fn judge(self, profile: Profile) -> Check {
        let judged: Vec<(Status, Rule, String)> = self
            .departures
            .into_iter()
            .filter_map(|(rule, expected)| {
                let status = match rule.weight(profile) {
                    Weight::Required => Status::Fail,
                    Weight::Warning => Status::Warn,
                    Weight::Skipped => return None,
                };
                Some((status, rule, expected))
            })
            .collect();
        // The first of the worst, so the row names the rule a reader should look at first.
        let worst = judged.iter().fold(
            None,
            |worst: Option<&(Status, Rule, String)>, d| match worst {
                Some(w) if w.0 >= d.0 => Some(w),
                _ => Some(d),
            },
        );
        let (status, rule) = worst.map_or((Status::Pass, self.main), |(s, r, _)| (*s, *r));
        let citation = rule.citation(profile);
        let mut detail = self.saw;
        for (_, rule, expected) in &judged {
            detail += &format!("; expected {expected}");
            if rule.citation(profile) != citation {
                detail += &format!(" ({})", rule.citation(profile));
            }
        }
        Check {
            name: self.name,
            status,
            rule: citation,
            detail,
        }
    }
}

/// How the concurrent rounds went, for tables built from the JSON.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Rounds {
    /// Rounds run, each with a fresh key.
    pub rounds: usize,
    /// Identical requests sent at once in each round.
    pub copies: usize,
    /// Rounds whose copies made more than one resource.
    pub with_extra_resources: usize,
}

/// Every check the drill ran against one URL.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The POST endpoint drilled.
    pub url: String,
    /// The rules it was held to.
    pub profile: Profile,
    /// Whether a warning fails the run.
    pub strict: bool,
    /// The checks, in the order they ran.
    pub checks: Vec<Check>,
    /// The concurrent rounds' figures.
    pub concurrency: Rounds,
}

impl Report {
    fn count(&self, status: Status) -> usize {
        self.checks.iter().filter(|c| c.status == status).count()
    }

    /// Checks passed.
    pub fn passed(&self) -> usize {
        self.count(Status::Pass)
    }

    /// Checks that departed from a recommended rule.
    pub fn warned(&self) -> usize {
        self.count(Status::Warn)
    }

    /// Checks failed.
    pub fn failed(&self) -> usize {
        self.count(Status::Fail)
    }

    /// Checks that could not run.
    pub fn skipped(&self) -> usize {
        self.count(Status::Skip)
    }

    /// The names of the checks with `status`, in order.
    pub fn names(&self, status: Status) -> Vec<&'static str> {
        self.checks
            .iter()
            .filter(|c| c.status == status)
            .map(|c| c.name)
            .collect()
    }

    /// The check called `name`, if it ran.
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// `0` when no check failed (and, with `--strict`, none warned), `1` otherwise. Skips
    /// never fail a run.
    pub fn exit_code(&self) -> ExitCode {
        if self.failed() == 0 && !(self.strict && self.warned() > 0) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    /// `{"url", "profile", "strict", "checks": [{"name", "status", "rule", "detail"}],
    /// "concurrency": {"rounds", "copies", "with_extra_resources"}, "passed", "warned",
    /// "failed", "skipped"}`, pretty-printed, members in that order.
    pub fn to_json(&self) -> String {
        /// A struct rather than `json!`, whose map would sort the members.
        #[derive(Serialize)]
        struct Json<'a> {
            url: &'a str,
            profile: Profile,
            strict: bool,
            checks: &'a [Check],
            concurrency: Rounds,
            passed: usize,
            warned: usize,
            failed: usize,
            skipped: usize,
        }
        let json = Json {
            url: &self.url,
            profile: self.profile,
            strict: self.strict,
            checks: &self.checks,
            concurrency: self.concurrency,
            passed: self.passed(),
            warned: self.warned(),
            failed: self.failed(),
            skipped: self.skipped(),
        };
        serde_json::to_string_pretty(&json).expect("strings and numbers always serialise")
    }

    /// The table a person reads: a heading, one row per check, and the summary line.
    pub fn table(&self) -> String {
        let width = |column: fn(&Check) -> usize, heading: &str| {
            self.checks
                .iter()
                .map(column)
                .chain([heading.len()])
                .max()
                .unwrap_or(0)
        };
        let name_width = width(|c| c.name.len(), "CHECK");
        let rule_width = width(|c| c.rule.chars().count(), "RULE");
        let mut out = format!("idem drill {} (profile {})\n\n", self.url, self.profile);
        let _ = writeln!(
            out,
            "{:<name_width$}  RESULT  {:<rule_width$}  WHAT IT SAW",
            "CHECK", "RULE"
        );
        for check in &self.checks {
            let _ = writeln!(
                out,
                "{:<name_width$}  {:<6}  {:<rule_width$}  {}",
                check.name,
                check.status.label(),
                check.rule,
                check.detail
            );
        }
        let _ = writeln!(
            out,
            "\n{} passed, {} warned, {} failed, {} skipped{}",
            self.passed(),
            self.warned(),
            self.failed(),
            self.skipped(),
            if self.strict {
                " (--strict: a warning fails the run)"
            } else {
                ""
            }
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &'static str, status: Status, rule: &'static str, detail: &str) -> Check {
        Check {
            name,
            status,
            rule,
            detail: detail.to_owned(),
        }
    }

    fn report() -> Report {
        Report {
            url: "http://127.0.0.1:1/payments".into(),
            profile: Profile::Draft,
            strict: false,
            checks: vec![
                check("concurrent", Status::Pass, "draft §2.6", "3 answers"),
                check("replay-marker", Status::Warn, "Stripe convention", "none"),
                check("body-mismatch", Status::Fail, "draft §2.7", "201, new id"),
                check("expiry", Status::Skip, "draft §2.3", "no policy"),
            ],
            concurrency: Rounds {
                rounds: 5,
                copies: 3,
                with_extra_resources: 0,
            },
        }
    }

    #[test]
    fn the_table_has_a_row_per_check_with_its_rule_and_a_summary() {
        let table = report().table();
        assert!(
            table.starts_with("idem drill http://127.0.0.1:1/payments (profile draft)\n"),
            "{table}"
        );
        assert!(
            table.contains("\nconcurrent     PASS    draft §2.6         3 answers\n"),
            "{table}"
        );
        assert!(
            table.contains("\nreplay-marker  WARN    Stripe convention  none\n"),
            "{table}"
        );
        assert!(
            table.ends_with("\n1 passed, 1 warned, 1 failed, 1 skipped\n"),
            "{table}"
        );
    }

    #[test]
    fn json_names_each_check_its_level_and_rule() {
        let text = report().to_json();
        assert!(text.starts_with("{\n  \"url\""), "{text}");
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["profile"], "draft");
        assert_eq!(json["strict"], false);
        assert_eq!(json["checks"][1]["name"], "replay-marker");
        assert_eq!(json["checks"][1]["status"], "warn");
        assert_eq!(json["checks"][1]["rule"], "Stripe convention");
        assert_eq!(json["checks"][2]["status"], "fail");
        assert_eq!(json["checks"][3]["status"], "skip");
        assert_eq!(json["concurrency"]["rounds"], 5);
        assert_eq!(
            (
                &json["passed"],
                &json["warned"],
                &json["failed"],
                &json["skipped"]
            ),
            (&1.into(), &1.into(), &1.into(), &1.into())
        );
    }

    #[test]
    fn only_failures_fail_the_run_unless_strict() {
        let mut report = report();
        assert_eq!(report.exit_code(), ExitCode::FAILURE);
        report.checks.retain(|c| c.status != Status::Fail);
        assert_eq!(
            report.exit_code(),
            ExitCode::SUCCESS,
            "a warning and a skip are not failures"
        );
        report.strict = true;
        assert_eq!(report.exit_code(), ExitCode::FAILURE, "--strict");
        report.checks.retain(|c| c.status != Status::Warn);
        assert_eq!(report.exit_code(), ExitCode::SUCCESS, "a skip never fails");
    }

    #[test]
    fn the_worst_departure_decides_and_names_its_rule() {
        let mut findings = Findings::new("replay", Rule::SameAnswer, "201, no marker");
        findings
            .depart(Rule::ReplayMarker, "Idempotent-Replayed: true")
            .depart(Rule::SameBytes, "the same bytes");
        let draft = Findings {
            departures: findings.departures.clone(),
            ..Findings::new("replay", Rule::SameAnswer, "201, no marker")
        }
        .judge(Profile::Draft);
        assert_eq!(draft.status, Status::Warn);
        assert_eq!(draft.rule, "Stripe convention");
        assert_eq!(
            draft.detail, "201, no marker; expected Idempotent-Replayed: true",
            "a rule the profile does not judge is left out"
        );

        let idem = findings.judge(Profile::Idem);
        assert_eq!(idem.status, Status::Fail);
        assert_eq!(idem.rule, "idem contract §2.1");

        let mut broken = Findings::new("replay", Rule::SameAnswer, "201, new id");
        broken
            .depart(Rule::ReplayMarker, "a marker")
            .depart(Rule::SameAnswer, "the same id");
        let row = broken.judge(Profile::Draft);
        assert_eq!((row.status, row.rule), (Status::Fail, "draft §2.6"));
        assert_eq!(
            row.detail,
            "201, new id; expected a marker (Stripe convention); expected the same id"
        );

        let clean = Findings::new("replay", Rule::SameAnswer, "201").judge(Profile::Draft);
        assert_eq!((clean.status, clean.rule), (Status::Pass, "draft §2.6"));
    }
}
