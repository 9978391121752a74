//! The figures of a simulation, and the table and JSON they print as.

use std::fmt::Write as _;

use serde::Serialize;

/// The figures of a simulation: what `--json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// What was measured, and so how its charges were counted.
    pub target: Target,
    /// The seed used.
    pub seed: u64,
    /// Attempts allowed per intent, the first included.
    pub max_attempts: u32,
    /// One entry per loss rate, in the order they ran.
    pub rates: Vec<RateReport>,
}

/// What a simulation measured.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Target {
    /// The `idem serve` the simulation started in its own process; charges counted in its
    /// SQLite database, per intent by the payment's `reference`.
    InProcess {
        /// The `--database` given, or `None` for a temporary file removed afterwards.
        database: Option<String>,
    },
    /// An API at `url` (`--url`); charges counted as the distinct resource ids each intent's
    /// `2xx` answers carried, as the fault injector saw them.
    Url {
        /// The endpoint the intents were POSTed to.
        url: String,
        /// Where each answer's resource id was read.
        id_field: String,
        /// The list fetched before and after each run, if any (`{{run}}` not replaced).
        list_url: Option<String>,
    },
}

impl Target {
    /// A few words naming the target, for the table and the chart.
    pub(super) fn label(&self) -> String {
        match self {
            Self::InProcess { .. } => "idem serve in this process (SQLite)".to_owned(),
            Self::Url { url, .. } => url.clone(),
        }
    }
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
    /// Intents charged more than once (in the database by `reference`, or with `--url`
    /// intents whose answers carried more than one resource id).
    pub double_charge_incidents: u64,
    /// Charges beyond the first, summed over intents: Σ (charges − 1).
    pub extra_charges: u64,
    /// Payments the run's account holds in the in-process server's database; 0 with `--url`,
    /// whose database the simulator cannot see (see `resources_seen`).
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
    /// Charges beyond the first, summed over intents (must be 0).
    pub extra_charges: u64,
    /// Retries that reached the server after their intent had been charged and were answered
    /// with the stored response (`Idempotent-Replayed: true`, as the proxy saw it) instead of
    /// charging again: each one a charge the run without keys made.
    pub duplicates_prevented: u64,
    /// Payments the run's account holds in the in-process server's database (must equal
    /// `requests`); 0 with `--url` (see `resources_seen`).
    pub charges_in_db: u64,
    /// Run details.
    #[serde(flatten)]
    pub run: RunFacts,
}

/// How a run went, beyond the headline figures.
#[derive(Debug, Clone, Serialize)]
pub struct RunFacts {
    /// The run's id, `sim-<uuid v7>-p<rate>-<variant>`: what `{{run}}` became in `--url`'s
    /// templates.
    pub run_id: String,
    /// The account the run's payments are in, in the in-process server (named after the run
    /// id); empty with `--url`, where the headers given authenticate.
    pub account: String,
    /// Intents charged at least once.
    pub intents_charged: u64,
    /// Resource ids the fault injector saw in the run's `2xx` answers, lost ones included:
    /// Σ over intents of the distinct ids each got.
    pub resources_seen: u64,
    /// Resources the `--list-url` gained during the run (absent without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources_listed: Option<u64>,
    /// Of those, resources whose id no answer carried: made by something else, or by a
    /// request whose answer never came back at all (absent without a list).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listed_not_seen: Option<u64>,
    /// Attempts that reached the server, all intents together.
    pub attempts: u64,
    /// Answers the fault injector cut after the server had committed.
    pub answers_lost: u64,
    /// `2xx` answers without a resource id where `--id-field` points, not counted as charges.
    pub answers_without_id: u64,
    /// Intents that got no answer within the attempt limit.
    pub unanswered: u64,
    /// Intents whose final answer was a refusal (a 4xx other than a set-up error such as 401
    /// or 404): a key the API requires, a replay it answers with a 409. They show no charge.
    pub refused: u64,
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
                && r.with_keys.extra_charges == 0
                && r.with_keys.run.intents_charged == r.requests
        })
    }

    /// The figures as a text table, expected values in brackets.
    pub fn table(&self) -> String {
        let n = self.rates.first().map_or(0, |r| r.requests);
        let (without, with) = self.columns();
        let columns: Vec<Column> = LEAD.iter().chain(&without).chain(&with).copied().collect();
        let headers: Vec<&str> = columns.iter().map(|c| c.header()).collect();
        let rows: Vec<Vec<String>> = self
            .rates
            .iter()
            .map(|r| columns.iter().map(|c| c.cell(r)).collect())
            .collect();
        let widths = Widths::fit(&headers, &rows);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "ACK loss after commit: {n} payment intents per rate, seed {}, up to {} retries each",
            self.seed,
            self.max_attempts - 1
        );
        let _ = writeln!(out, "Target: {}", self.target.label());
        let _ = writeln!(out);
        let lead = widths.span(0, LEAD.len()) + GAP.len();
        let split = LEAD.len() + without.len();
        let _ = writeln!(
            out,
            "{:lead$}{}{GAP}{}",
            "",
            widths.group("without idempotency keys", LEAD.len(), split),
            widths.group("with idempotency keys", split, columns.len())
        );
        let _ = writeln!(out, "{}", widths.line(&headers));
        for row in &rows {
            let cells: Vec<&str> = row.iter().map(String::as_str).collect();
            let _ = writeln!(out, "{}", widths.line(&cells));
        }
        let _ = writeln!(out);
        self.notes(&mut out);
        out
    }

    /// The columns of each variant: charges in the database for the in-process server,
    /// resource ids (and the list) for an API of the caller's own.
    fn columns(&self) -> (Vec<Column>, Vec<Column>) {
        use Column::{
            ChargesInDb, DoubleCharges, ExtraCharges, ExtraChargesWithKeys, Incidents, Listed,
            Prevented, ResourcesSeen,
        };
        use Variant::{WithKeys, WithoutKeys};
        match &self.target {
            Target::InProcess { .. } => (
                vec![Incidents, ExtraCharges, ChargesInDb(WithoutKeys)],
                vec![DoubleCharges, Prevented, ChargesInDb(WithKeys)],
            ),
            Target::Url { list_url, .. } => {
                let listed = list_url.is_some();
                let mut without = vec![Incidents, ExtraCharges, ResourcesSeen(WithoutKeys)];
                let mut with = vec![
                    DoubleCharges,
                    ExtraChargesWithKeys,
                    Prevented,
                    ResourcesSeen(WithKeys),
                ];
                if listed {
                    without.push(Listed(WithoutKeys));
                    with.push(Listed(WithKeys));
                }
                (without, with)
            }
        }
    }

    /// What the table's figures mean, and what went wrong if anything did.
    fn notes(&self, out: &mut String) {
        let expected = "expected values (N·p incidents, N·p/(1−p) extra charges) in brackets.";
        match &self.target {
            Target::InProcess { .. } => {
                let _ = writeln!(
                    out,
                    "Charges counted in the database afterwards; {expected}"
                );
            }
            Target::Url {
                id_field, list_url, ..
            } => {
                let _ = writeln!(
                    out,
                    "Charges counted as distinct resource ids ({id_field:?} of each 2xx answer) \
                     per intent, as the fault injector saw them, lost answers included; \
                     {expected}"
                );
                if let Some(list) = list_url {
                    let _ = writeln!(out, "Listed: the resources {list} gained during each run.");
                }
            }
        }
        let _ = writeln!(
            out,
            "Duplicates prevented: retries the server answered from the stored response \
             (Idempotent-Replayed: true)."
        );
        let runs = || {
            self.rates.iter().flat_map(|r| {
                [
                    (r.loss, "without keys", &r.without_keys.run),
                    (r.loss, "with keys", &r.with_keys.run),
                ]
            })
        };
        let unanswered: u64 = runs().map(|(_, _, run)| run.unanswered).sum();
        if unanswered > 0 {
            let _ = writeln!(
                out,
                "{unanswered} intent(s) got no answer within {} attempts (each was still charged).",
                self.max_attempts
            );
        }
        for (loss, variant, run) in runs() {
            if run.refused > 0 {
                let _ = writeln!(
                    out,
                    "At {} {variant}, {} intent(s) ended refused (a 4xx that is not a set-up \
                     error): no charge could be seen for them.",
                    percent(loss),
                    run.refused
                );
            }
        }
        let without_id: u64 = runs().map(|(_, _, run)| run.answers_without_id).sum();
        if without_id > 0 {
            let _ = writeln!(
                out,
                "{without_id} 2xx answer(s) had no resource id where --id-field points: \
                 their charges are not counted."
            );
        }
        for (loss, variant, run) in runs() {
            if let Some(listed) = run.resources_listed
                && (listed != run.resources_seen || run.listed_not_seen != Some(0))
            {
                let _ = writeln!(
                    out,
                    "At {} {variant} the list gained {listed} resource(s), {} of them unseen, \
                     and the answers carried {}: a list that pages or holds other resources \
                     counts wrong.",
                    percent(loss),
                    run.listed_not_seen.unwrap_or(0),
                    run.resources_seen
                );
            }
        }
        if !self.keys_held() {
            let _ = writeln!(
                out,
                "IDEMPOTENCY FAILED: with keys, some intent was not charged exactly once."
            );
        }
    }
}

/// Which of a rate's two runs a column reads.
#[derive(Clone, Copy)]
enum Variant {
    WithoutKeys,
    WithKeys,
}

impl Variant {
    fn run(self, r: &RateReport) -> &RunFacts {
        match self {
            Self::WithoutKeys => &r.without_keys.run,
            Self::WithKeys => &r.with_keys.run,
        }
    }

    fn charges_in_db(self, r: &RateReport) -> u64 {
        match self {
            Self::WithoutKeys => r.without_keys.charges_in_db,
            Self::WithKeys => r.with_keys.charges_in_db,
        }
    }
}

/// One column of the table; the last three come in both variants.
#[derive(Clone, Copy)]
enum Column {
    Loss,
    Requests,
    /// Without keys, beside the expected number.
    Incidents,
    /// Without keys, beside the expected number.
    ExtraCharges,
    DoubleCharges,
    ExtraChargesWithKeys,
    Prevented,
    ChargesInDb(Variant),
    ResourcesSeen(Variant),
    Listed(Variant),
}

impl Column {
    fn header(self) -> &'static str {
        match self {
            Self::Loss => "loss",
            Self::Requests => "requests",
            Self::Incidents => "double-charged",
            Self::ExtraCharges | Self::ExtraChargesWithKeys => "extra charges",
            Self::DoubleCharges => "double charges",
            Self::Prevented => "duplicates prevented",
            Self::ChargesInDb(_) => "charges in db",
            Self::ResourcesSeen(_) => "resources seen",
            Self::Listed(_) => "listed",
        }
    }

    /// The cell of rate `r`.
    fn cell(self, r: &RateReport) -> String {
        let with_expected = |actual: u64, expected: f64| format!("{actual} (≈ {expected:.0})");
        match self {
            Self::Loss => percent(r.loss),
            Self::Requests => r.requests.to_string(),
            Self::Incidents => with_expected(
                r.without_keys.double_charge_incidents,
                r.expected.double_charge_incidents,
            ),
            Self::ExtraCharges => {
                with_expected(r.without_keys.extra_charges, r.expected.extra_charges)
            }
            Self::DoubleCharges => r.with_keys.double_charges.to_string(),
            Self::ExtraChargesWithKeys => r.with_keys.extra_charges.to_string(),
            Self::Prevented => r.with_keys.duplicates_prevented.to_string(),
            Self::ChargesInDb(variant) => variant.charges_in_db(r).to_string(),
            Self::ResourcesSeen(variant) => variant.run(r).resources_seen.to_string(),
            Self::Listed(variant) => variant
                .run(r)
                .resources_listed
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
        }
    }
}

/// The rate and its intents, before either variant's columns.
const LEAD: [Column; 2] = [Column::Loss, Column::Requests];

/// Between two columns.
const GAP: &str = "  ";

/// The widths of the table's columns, each that of its widest cell.
struct Widths(Vec<usize>);

impl Widths {
    fn fit(headers: &[&str], rows: &[Vec<String>]) -> Self {
        let widths = (0..headers.len())
            .map(|c| {
                rows.iter()
                    .map(|row| row[c].chars().count())
                    .chain([headers[c].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        Self(widths)
    }

    /// `cells` right-aligned in their columns.
    fn line(&self, cells: &[&str]) -> String {
        let cells: Vec<String> = cells
            .iter()
            .zip(&self.0)
            .map(|(cell, w)| format!("{cell:>w$}"))
            .collect();
        cells.join(GAP).trim_end().to_owned()
    }

    /// The width of columns `from..to` with the gaps between them.
    fn span(&self, from: usize, to: usize) -> usize {
        self.0[from..to].iter().sum::<usize>() + GAP.len() * (to - from - 1)
    }

    /// A title centred over columns `from..to`, in a rule of dashes.
    fn group(&self, title: &str, from: usize, to: usize) -> String {
        let span = self.span(from, to);
        format!("{:-^span$}", format!(" {title} "))
    }
}

/// `0.05` → `5%`, `0.015` → `1.5%`.
pub(super) fn percent(loss: f64) -> String {
    let pct = (loss * 100.0 * 1e4).round() / 1e4;
    format!("{pct}%")
}
