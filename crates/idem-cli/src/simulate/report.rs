//! The figures of a simulation, and the table and JSON they print as.

use std::fmt::Write as _;

use serde::Serialize;

/// The figures of a simulation: what `--json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The seed used.
    pub seed: u64,
    /// Attempts allowed per intent, the first included.
    pub max_attempts: u32,
    /// One entry per loss rate, in the order they ran.
    pub rates: Vec<RateReport>,
}

/// The figures at one loss rate.
#[derive(Debug, Clone, Serialize)]
pub struct RateReport {
    /// The probability that an answer is lost after the server committed.
    pub loss: f64,
    /// Payment intents, each sent until an answer arrived.
    pub requests: u64,
    /// The run without idempotency keys.
    pub without_keys: WithoutKeys,
    /// The run with one key per intent.
    pub with_keys: WithKeys,
    /// What the statistics predict without keys.
    pub expected: Expected,
}

/// The run without keys: every retry that reached the server charged again.
#[derive(Debug, Clone, Serialize)]
pub struct WithoutKeys {
    /// Intents charged more than once (counted in the database, by `reference`).
    pub double_charge_incidents: u64,
    /// Charges beyond the first, summed over intents: Σ (charges − 1).
    pub extra_charges: u64,
    /// Payments the run's account holds in the database.
    pub charges_in_db: u64,
    /// Run details.
    #[serde(flatten)]
    pub run: RunFacts,
}

/// The run with keys: retries carry the intent's key and are answered from the stored
/// response.
#[derive(Debug, Clone, Serialize)]
pub struct WithKeys {
    /// Intents charged more than once (must be 0).
    pub double_charges: u64,
    /// Retries that reached the server after their intent had been charged and were answered
    /// with the stored response (`Idempotent-Replayed: true`, as the proxy saw it) instead of
    /// charging again: each one a charge the run without keys made.
    pub duplicates_prevented: u64,
    /// Payments the run's account holds in the database (must equal `requests`).
    pub charges_in_db: u64,
    /// Run details.
    #[serde(flatten)]
    pub run: RunFacts,
}

/// How a run went, beyond the headline figures.
#[derive(Debug, Clone, Serialize)]
pub struct RunFacts {
    /// The account the run's payments are in.
    pub account: String,
    /// Intents with at least one payment in the database.
    pub intents_charged: u64,
    /// Attempts that reached the server, all intents together.
    pub attempts: u64,
    /// Answers the fault injector cut after the server had committed.
    pub answers_lost: u64,
    /// Intents that got no answer within the attempt limit.
    pub unanswered: u64,
}

/// The statistics' prediction without keys.
#[derive(Debug, Clone, Serialize)]
pub struct Expected {
    /// N·p: intents whose first answer is lost.
    pub double_charge_incidents: f64,
    /// N·p/(1−p): the mean number of lost answers per intent, times N.
    pub extra_charges: f64,
}

impl Report {
    /// Whether idempotency held: with keys, every intent was charged exactly once.
    pub fn keys_held(&self) -> bool {
        self.rates.iter().all(|r| {
            r.with_keys.double_charges == 0
                && r.with_keys.charges_in_db == r.requests
                && r.with_keys.run.intents_charged == r.requests
        })
    }

    /// The figures as a text table, expected values in brackets.
    pub fn table(&self) -> String {
        let n = self.rates.first().map_or(0, |r| r.requests);
        let rows = self.rows();
        let columns = Columns::fit(&HEADERS, &rows);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "ACK loss after commit: {n} payment intents per rate, seed {}, up to {} retries each",
            self.seed,
            self.max_attempts - 1
        );
        let _ = writeln!(out);
        let lead = columns.width[0] + columns.width[1] + 2 * GAP.len();
        let _ = writeln!(
            out,
            "{:lead$}{}{GAP}{}",
            "",
            columns.group("without idempotency keys", 2, 5),
            columns.group("with idempotency keys", 5, 8)
        );
        let _ = writeln!(out, "{}", columns.line(&HEADERS));
        for row in &rows {
            let cells: Vec<&str> = row.iter().map(String::as_str).collect();
            let _ = writeln!(out, "{}", columns.line(&cells));
        }
        let _ = writeln!(out);
        self.notes(&mut out);
        out
    }

    /// One row of cells per rate, in the order of [`HEADERS`].
    fn rows(&self) -> Vec<[String; 8]> {
        self.rates
            .iter()
            .map(|r| {
                [
                    percent(r.loss),
                    r.requests.to_string(),
                    format!(
                        "{} (≈ {:.0})",
                        r.without_keys.double_charge_incidents, r.expected.double_charge_incidents
                    ),
                    format!(
                        "{} (≈ {:.0})",
                        r.without_keys.extra_charges, r.expected.extra_charges
                    ),
                    r.without_keys.charges_in_db.to_string(),
                    r.with_keys.double_charges.to_string(),
                    r.with_keys.duplicates_prevented.to_string(),
                    r.with_keys.charges_in_db.to_string(),
                ]
            })
            .collect()
    }

    /// What the table's figures mean, and what went wrong if anything did.
    fn notes(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "Charges counted in the database afterwards; expected values (N·p incidents, \
             N·p/(1−p) extra charges) in brackets."
        );
        let _ = writeln!(
            out,
            "Duplicates prevented: retries the server answered from the stored response \
             (Idempotent-Replayed: true)."
        );
        let unanswered: u64 = self
            .rates
            .iter()
            .map(|r| r.without_keys.run.unanswered + r.with_keys.run.unanswered)
            .sum();
        if unanswered > 0 {
            let _ = writeln!(
                out,
                "{unanswered} intent(s) got no answer within {} attempts (each was still charged).",
                self.max_attempts
            );
        }
        if !self.keys_held() {
            let _ = writeln!(
                out,
                "IDEMPOTENCY FAILED: with keys, some intent was not charged exactly once."
            );
        }
    }
}

/// The table's column headers: the rate, then three columns per variant.
const HEADERS: [&str; 8] = [
    "loss",
    "requests",
    "double-charged",
    "extra charges",
    "charges in db",
    "double charges",
    "duplicates prevented",
    "charges in db",
];

/// Between two columns.
const GAP: &str = "  ";

/// The widths of the table's columns, each that of its widest cell.
struct Columns {
    width: Vec<usize>,
}

impl Columns {
    fn fit(headers: &[&str], rows: &[[String; 8]]) -> Self {
        let width = (0..headers.len())
            .map(|c| {
                rows.iter()
                    .map(|row| row[c].chars().count())
                    .chain([headers[c].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        Self { width }
    }

    /// `cells` right-aligned in their columns.
    fn line(&self, cells: &[&str]) -> String {
        let cells: Vec<String> = cells
            .iter()
            .zip(&self.width)
            .map(|(cell, w)| format!("{cell:>w$}"))
            .collect();
        cells.join(GAP).trim_end().to_owned()
    }

    /// A title centred over columns `from..to`, in a rule of dashes.
    fn group(&self, title: &str, from: usize, to: usize) -> String {
        let span = self.width[from..to].iter().sum::<usize>() + GAP.len() * (to - from - 1);
        format!("{:-^span$}", format!(" {title} "))
    }
}

/// `0.05` → `5%`, `0.015` → `1.5%`.
pub(super) fn percent(loss: f64) -> String {
    let pct = (loss * 100.0 * 1e4).round() / 1e4;
    format!("{pct}%")
}
