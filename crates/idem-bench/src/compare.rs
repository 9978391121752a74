//! `--compare OLD.json`: each row's ratio beside the same row's ratio in an earlier run's
//! `--json` report, and the change, so that a change's effect shows in one table. The
//! micro-benchmarks compare their time per operation.

use std::collections::HashSet;
use std::hash::Hash;
use std::path::Path;

use anyhow::Context as _;
use serde::Deserialize;

use crate::report::{Align, Report, columns, row_label};

/// What a comparison reads of a report. Read leniently (unknown fields ignored, missing ones
/// defaulted), so that a report from an earlier build still compares.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Summary {
    /// The micro-benchmarks.
    #[serde(default)]
    pub micro: Vec<MicroSummary>,
    /// The rows.
    #[serde(default)]
    pub rows: Vec<RowSummary>,
    /// The instruction counts.
    #[serde(default)]
    pub instructions: Vec<InstructionsSummary>,
}

/// An instruction count, as compared.
#[derive(Debug, Clone, Deserialize)]
pub struct InstructionsSummary {
    /// Its id (`proxy-redis`).
    pub id: String,
    /// Instructions per request, when counted.
    #[serde(default)]
    pub per_request: Option<f64>,
}

/// A micro-benchmark, as compared.
#[derive(Debug, Clone, Deserialize)]
pub struct MicroSummary {
    /// Its id (`fingerprint-64k`).
    pub id: String,
    /// Nanoseconds per operation.
    pub ns_per_op: f64,
    /// MiB/s, where bytes are meaningful.
    #[serde(default)]
    pub mib_per_s: Option<f64>,
}

/// A row, as compared.
#[derive(Debug, Clone, Deserialize)]
pub struct RowSummary {
    /// Its id (`floor-pgbench`).
    pub id: String,
    /// What it measures.
    pub title: String,
    /// `ok`, `skipped` or `failed`.
    pub status: String,
    /// B/A, when measured.
    #[serde(default)]
    pub ratio: Option<f64>,
    /// The latency the relay added to the database each way (0: none; reports from before
    /// the relay have none).
    #[serde(default)]
    pub db_latency_ms: f64,
}

impl RowSummary {
    /// What identifies the same row in two reports.
    fn key(&self) -> (&str, u64) {
        (&self.id, self.db_latency_ms.to_bits())
    }

    /// The ratio, or why there is none.
    fn shown(&self) -> String {
        match (self.status.as_str(), self.ratio) {
            ("ok", Some(ratio)) => format!("{ratio:.2}×"),
            ("ok", None) => "-".into(),
            (status, _) => status.into(),
        }
    }
}

impl Summary {
    /// Reads a report written by `--json` or `--json-file`.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not an idem-bench JSON report", path.display()))
    }

    /// The summary of this run's report.
    pub fn of(report: &Report) -> anyhow::Result<Self> {
        Ok(serde_json::from_value(serde_json::to_value(report)?)?)
    }
}

/// The comparison of `new` with `old` (read from `old_name`): the rows in `new`'s order, then
/// those only `old` has; then the micro-benchmarks the same way.
pub fn table(old: &Summary, new: &Summary, old_name: &str) -> String {
    let mut tables = Vec::new();
    if !old.rows.is_empty() || !new.rows.is_empty() {
        tables.push(columns(&ROW_COLUMNS, &row_lines(old, new, old_name)));
    }
    if !old.instructions.is_empty() || !new.instructions.is_empty() {
        tables.push(columns(
            &INSTRUCTIONS_COLUMNS,
            &instructions_lines(old, new, old_name),
        ));
    }
    if !old.micro.is_empty() || !new.micro.is_empty() {
        tables.push(columns(&MICRO_COLUMNS, &micro_lines(old, new, old_name)));
    }
    format!(
        "compared with {old_name}: B/A then and now, and the change\n{}",
        tables.join("\n")
    )
}

const ROW_COLUMNS: [(&str, Align); 4] = [
    ("row", Align::Left),
    ("then", Align::Right),
    ("now", Align::Right),
    ("change", Align::Left),
];

/// A result of the new report, or one only the old report has.
enum Matched<'a, T> {
    /// In the new report, beside the same result in the old one if it has it.
    Now { before: Option<&'a T>, now: &'a T },
    /// Only in the old report.
    Gone(&'a T),
}

/// `new`'s results in order, each with the same one (by `key`) of `old`; then those only `old`
/// has.
fn matched<'a, T, K: Eq + Hash>(
    old: &'a [T],
    new: &'a [T],
    key: impl Fn(&'a T) -> K,
) -> Vec<Matched<'a, T>> {
    let mut seen = HashSet::new();
    let mut matched = Vec::new();
    for now in new {
        seen.insert(key(now));
        let before = old.iter().find(|&o| key(o) == key(now));
        matched.push(Matched::Now { before, now });
    }
    let gone = old.iter().filter(|&o| !seen.contains(&key(o)));
    matched.extend(gone.map(Matched::Gone));
    matched
}

fn row_lines(old: &Summary, new: &Summary, old_name: &str) -> Vec<Vec<String>> {
    let lines = matched(&old.rows, &new.rows, RowSummary::key);
    lines
        .into_iter()
        .map(|line| match line {
            Matched::Now { before, now: row } => {
                let change = match (before.and_then(|b| b.ratio), row.ratio) {
                    _ if before.is_none() => format!("not in {old_name}"),
                    (Some(then), Some(now)) if row.status == "ok" => change(then, now),
                    _ => String::new(),
                };
                let then = before.map_or_else(|| "-".into(), RowSummary::shown);
                let label = row_label(&row.title, row.db_latency_ms);
                vec![label, then, row.shown(), change]
            }
            Matched::Gone(row) => vec![
                row_label(&row.title, row.db_latency_ms),
                row.shown(),
                "-".into(),
                "not in this run".into(),
            ],
        })
        .collect()
}

/// `+0.06 (+11%)`: the difference of the ratios, and relative to the earlier one.
fn change(then: f64, now: f64) -> String {
    let relative = if then > 0.0 {
        format!(" ({:+.0}%)", (now / then - 1.0) * 100.0)
    } else {
        String::new()
    };
    format!("{:+.2}{relative}", now - then)
}

const INSTRUCTIONS_COLUMNS: [(&str, Align); 4] = [
    ("instructions", Align::Left),
    ("per request then", Align::Right),
    ("now", Align::Right),
    ("now/then", Align::Right),
];

fn instructions_lines(old: &Summary, new: &Summary, old_name: &str) -> Vec<Vec<String>> {
    let count = |n: Option<f64>| n.map_or_else(|| "-".into(), |n| format!("{n:.0}"));
    matched(&old.instructions, &new.instructions, |i| i.id.as_str())
        .into_iter()
        .map(|line| match line {
            Matched::Now { before, now } => {
                let then = before.and_then(|b| b.per_request);
                let ratio = match (before, then, now.per_request) {
                    (None, _, _) => format!("not in {old_name}"),
                    (_, Some(then), Some(now)) => format!("{:.2}×", now / then),
                    _ => String::new(),
                };
                vec![now.id.clone(), count(then), count(now.per_request), ratio]
            }
            Matched::Gone(i) => vec![
                i.id.clone(),
                count(i.per_request),
                "-".into(),
                "not in this run".into(),
            ],
        })
        .collect()
}

const MICRO_COLUMNS: [(&str, Align); 5] = [
    ("micro", Align::Left),
    ("ns/op then", Align::Right),
    ("ns/op now", Align::Right),
    ("now/then", Align::Right),
    ("MiB/s then → now", Align::Left),
];

fn micro_lines(old: &Summary, new: &Summary, old_name: &str) -> Vec<Vec<String>> {
    let mib = |m: Option<&MicroSummary>| {
        m.and_then(|m| m.mib_per_s)
            .map_or_else(|| "-".into(), |v| format!("{v:.0}"))
    };
    let lines = matched(&old.micro, &new.micro, |m| m.id.as_str());
    lines
        .into_iter()
        .map(|line| match line {
            Matched::Now { before, now: m } => {
                let (then, ratio) = match before {
                    Some(b) => (
                        format!("{:.0}", b.ns_per_op),
                        format!("{:.2}×", m.ns_per_op / b.ns_per_op),
                    ),
                    None => ("-".into(), format!("not in {old_name}")),
                };
                let speed = if m.mib_per_s.is_some() {
                    format!("{} → {}", mib(before), mib(Some(m)))
                } else {
                    String::new()
                };
                vec![
                    m.id.clone(),
                    then,
                    format!("{:.0}", m.ns_per_op),
                    ratio,
                    speed,
                ]
            }
            Matched::Gone(m) => vec![
                m.id.clone(),
                format!("{:.0}", m.ns_per_op),
                "-".into(),
                "not in this run".into(),
                String::new(),
            ],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: &str = r#"{
        "version": 1,
        "micro": [
            {"id": "fingerprint-64k", "title": "t", "ns_per_op": 812749.0, "bytes": 65478, "mib_per_s": 76.8},
            {"id": "decide-replay", "title": "t", "ns_per_op": 4.0},
            {"id": "gone", "title": "t", "ns_per_op": 10.0}
        ],
        "rows": [
            {"id": "floor-pgbench", "title": "floor: pgbench, same transaction", "status": "ok", "ratio": 0.55},
            {"id": "gateway-redis", "title": "gateway, Redis", "status": "ok", "ratio": 0.12},
            {"id": "peer-proxy", "title": "peer proxy, Redis", "status": "skipped", "ratio": null}
        ],
        "instructions": [
            {"id": "proxy-redis", "per_request": 211000.0},
            {"id": "plain-proxy", "per_request": 122000.0}
        ]
    }"#;

    const NEW: &str = r#"{
        "micro": [
            {"id": "fingerprint-64k", "ns_per_op": 162500.0, "mib_per_s": 384.3},
            {"id": "decide-replay", "ns_per_op": 4.0}
        ],
        "rows": [
            {"id": "floor-pgbench", "title": "floor: pgbench, same transaction", "status": "ok", "ratio": 0.61, "db_latency_ms": 0.0},
            {"id": "floor-pgbench", "title": "floor: pgbench, same transaction", "status": "ok", "ratio": 0.93, "db_latency_ms": 1.0},
            {"id": "peer-proxy", "title": "peer proxy, Redis", "status": "ok", "ratio": 1.2, "db_latency_ms": 0.0}
        ],
        "instructions": [
            {"id": "proxy-redis", "per_request": 158250.0},
            {"id": "plain-proxy"}
        ]
    }"#;

    #[test]
    fn rows_and_micro_benchmarks_side_by_side_with_what_is_missing() {
        let old: Summary = serde_json::from_str(OLD).unwrap();
        let new: Summary = serde_json::from_str(NEW).unwrap();
        let table = table(&old, &new, "old.json");
        let expected = "\
compared with old.json: B/A then and now, and the change
row                                         then    now  change
floor: pgbench, same transaction           0.55×  0.61×  +0.06 (+11%)
floor: pgbench, same transaction @ 1 ms        -  0.93×  not in old.json
peer proxy, Redis                        skipped  1.20×
gateway, Redis                             0.12×      -  not in this run

instructions  per request then     now  now/then
proxy-redis             211000  158250     0.75×
plain-proxy             122000       -

micro            ns/op then  ns/op now         now/then  MiB/s then → now
fingerprint-64k      812749     162500            0.20×  77 → 384
decide-replay             4          4            1.00×
gone                     10          -  not in this run
";
        assert_eq!(table, expected, "\n{table}");
    }
}
