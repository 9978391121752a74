//! What the drill found: one row per check, as a table or as JSON.

use std::fmt::Write as _;
use std::process::ExitCode;

use serde::Serialize;

/// How a check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// The API did what the contract says.
    Pass,
    /// It did not; the detail says what it did instead.
    Fail,
    /// The check could not run against this API; the detail says why. Not a pass.
    Skip,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Self::Pass => "PASS",
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
    /// Pass, fail or skip.
    pub status: Status,
    /// What the drill saw, in a line.
    pub detail: String,
}

impl Check {
    pub(crate) fn pass(name: &'static str, detail: impl Into<String>) -> Self {
        Self::new(name, Status::Pass, detail)
    }

    pub(crate) fn fail(name: &'static str, detail: impl Into<String>) -> Self {
        Self::new(name, Status::Fail, detail)
    }

    pub(crate) fn skip(name: &'static str, detail: impl Into<String>) -> Self {
        Self::new(name, Status::Skip, detail)
    }

    /// Pass when `ok`; otherwise fail, with what the contract `expected` after what was seen.
    pub(crate) fn verdict(name: &'static str, ok: bool, detail: String, expected: &str) -> Self {
        if ok {
            Self::pass(name, detail)
        } else {
            Self::fail(name, format!("{detail}; expected {expected}"))
        }
    }

    fn new(name: &'static str, status: Status, detail: impl Into<String>) -> Self {
        Self {
            name,
            status,
            detail: detail.into(),
        }
    }
}

/// Every check the drill ran against one URL.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The POST endpoint drilled.
    pub url: String,
    /// The checks, in the order they ran.
    pub checks: Vec<Check>,
}

impl Report {
    fn count(&self, status: Status) -> usize {
        self.checks.iter().filter(|c| c.status == status).count()
    }

    /// Checks passed.
    pub fn passed(&self) -> usize {
        self.count(Status::Pass)
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

    /// `0` when no check failed (skips do not fail a run), `1` otherwise.
    pub fn exit_code(&self) -> ExitCode {
        if self.failed() == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    /// `{"url", "checks": [{"name", "status", "detail"}], "passed", "failed", "skipped"}`,
    /// pretty-printed, members in that order.
    pub fn to_json(&self) -> String {
        /// A struct rather than `json!`, whose map would sort the members.
        #[derive(Serialize)]
        struct Json<'a> {
            url: &'a str,
            checks: &'a [Check],
            passed: usize,
            failed: usize,
            skipped: usize,
        }
        let json = Json {
            url: &self.url,
            checks: &self.checks,
            passed: self.passed(),
            failed: self.failed(),
            skipped: self.skipped(),
        };
        serde_json::to_string_pretty(&json).expect("strings and numbers always serialise")
    }

    /// The table a person reads: a heading, one row per check, and the summary line.
    pub fn table(&self) -> String {
        let width = self
            .checks
            .iter()
            .map(|c| c.name.len())
            .chain(["CHECK".len()])
            .max()
            .unwrap_or(0);
        let mut out = format!("idem drill {}\n\n", self.url);
        let _ = writeln!(out, "{:<width$}  RESULT  WHAT IT SAW", "CHECK");
        for check in &self.checks {
            let _ = writeln!(
                out,
                "{:<width$}  {:<6}  {}",
                check.name,
                check.status.label(),
                check.detail
            );
        }
        let _ = writeln!(
            out,
            "\n{} passed, {} failed, {} skipped",
            self.passed(),
            self.failed(),
            self.skipped()
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        Report {
            url: "http://127.0.0.1:1/payments".into(),
            checks: vec![
                Check::pass("concurrent", "3 answers"),
                Check::fail("body-mismatch", "201, new id"),
                Check::skip("expiry", "no policy"),
            ],
        }
    }

    #[test]
    fn the_table_has_a_row_per_check_and_a_summary() {
        let table = report().table();
        assert!(
            table.contains("concurrent     PASS    3 answers\n"),
            "{table}"
        );
        assert!(
            table.contains("body-mismatch  FAIL    201, new id\n"),
            "{table}"
        );
        assert!(
            table.ends_with("\n1 passed, 1 failed, 1 skipped\n"),
            "{table}"
        );
    }

    #[test]
    fn json_names_each_check_and_counts_them() {
        let text = report().to_json();
        assert!(text.starts_with("{\n  \"url\""), "{text}");
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["url"], "http://127.0.0.1:1/payments");
        assert_eq!(json["checks"][1]["name"], "body-mismatch");
        assert_eq!(json["checks"][1]["status"], "fail");
        assert_eq!(json["checks"][2]["status"], "skip");
        assert_eq!(
            (&json["passed"], &json["failed"], &json["skipped"]),
            (&1.into(), &1.into(), &1.into())
        );
    }

    #[test]
    fn only_failures_fail_the_run() {
        let mut report = report();
        assert_eq!(report.exit_code(), ExitCode::FAILURE);
        report.checks.retain(|c| c.status != Status::Fail);
        assert_eq!(
            report.exit_code(),
            ExitCode::SUCCESS,
            "a skip is not a failure"
        );
        assert_eq!(report.names(Status::Skip), ["expiry"]);
    }
}
