//! The report: a table for people, JSON for scripts.

use std::fmt::Write as _;

use serde::Serialize;

use crate::instructions::InstructionsResult;
use crate::memory::MemoryResult;
use crate::micro::MicroResult;
use crate::runner::{Row, Status};
use crate::workloads::growth::KeyTable;

/// Everything one invocation measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The JSON shape's version.
    pub version: u32,
    /// How it was measured.
    pub settings: ReportSettings,
    /// Where.
    pub machine: Machine,
    /// The core's micro-benchmarks.
    pub micro: Vec<MicroResult>,
    /// Instructions per request under callgrind.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub instructions: Vec<InstructionsResult>,
    /// The HTTP workloads.
    pub rows: Vec<Row>,
    /// The key tables the growth groups filled, and their sizes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub key_tables: Vec<KeyTable>,
    /// `idem serve`'s memory under load, when the group ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryResult>,
    /// Wall time of the whole invocation, seconds.
    pub wall_secs: f64,
}

/// The settings, as reported.
#[derive(Debug, Clone, Serialize)]
pub struct ReportSettings {
    /// Concurrent connections (pgbench: clients).
    pub concurrency: usize,
    /// Rounds per variant.
    pub rounds: usize,
    /// Measured seconds per run.
    pub duration_secs: f64,
    /// Unmeasured seconds before each run's window.
    pub warmup_secs: f64,
    /// Smoke mode.
    pub quick: bool,
    /// The latencies the database groups ran at, ms each way (0: connected directly).
    pub db_latency_ms: Vec<f64>,
}

/// The machine the figures come from.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// Logical CPUs.
    pub cpus: usize,
    /// The 1-minute load average when the run started (other jobs on a shared machine).
    pub load_average: Option<f64>,
}

impl Machine {
    /// Reads the machine.
    pub fn read() -> Self {
        Self {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            load_average: std::fs::read_to_string("/proc/loadavg")
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse().ok()),
        }
    }
}

/// Left or right.
#[derive(Clone, Copy)]
pub(crate) enum Align {
    Left,
    Right,
}

/// Lays out `rows` under the headers of `columns`, two spaces apart, each aligned its way.
pub(crate) fn columns(columns: &[(&str, Align)], rows: &[Vec<String>]) -> String {
    let width = |s: &str| s.chars().count();
    let mut widths: Vec<usize> = columns.iter().map(|(h, _)| width(h)).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(width(cell));
        }
    }
    let mut out = String::new();
    let header: Vec<String> = columns.iter().map(|(h, _)| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            let pad = " ".repeat(widths[i] - width(cell));
            match columns[i].1 {
                Align::Left => write!(line, "{cell}{pad}  "),
                Align::Right => write!(line, "{pad}{cell}  "),
            }
            .expect("writing to a String");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// A row's title, with the database latency it ran at when there was one.
pub(crate) fn row_label(title: &str, db_latency_ms: f64) -> String {
    if db_latency_ms > 0.0 {
        format!("{title} @ {db_latency_ms} ms")
    } else {
        title.to_owned()
    }
}

fn num(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.decimals$}"))
}

fn pair(a: Option<f64>, b: Option<f64>, decimals: usize) -> String {
    format!("{}/{}", num(a, decimals), num(b, decimals))
}

/// The micro-benchmarks' table: its columns, then a row per result.
const MICRO_COLUMNS: [(&str, Align); 5] = [
    ("micro", Align::Left),
    ("what", Align::Left),
    ("bytes", Align::Right),
    ("ns/op", Align::Right),
    ("MiB/s", Align::Right),
];

fn micro_row(m: &MicroResult) -> Vec<String> {
    vec![
        m.id.to_owned(),
        m.title.to_owned(),
        m.bytes.map_or_else(String::new, |b| b.to_string()),
        format!("{:.0}", m.ns_per_op),
        num(m.mib_per_s, 0),
    ]
}

/// The instruction counts' table: its columns, then a row per count.
const INSTRUCTIONS_COLUMNS: [(&str, Align); 5] = [
    ("instructions", Align::Left),
    ("what", Align::Left),
    ("requests", Align::Right),
    ("per request", Align::Right),
    ("target", Align::Left),
];

fn instructions_row(i: &InstructionsResult) -> Vec<String> {
    let target = match (i.target, i.per_request) {
        (Some(target), Some(count)) => format!(
            "≤ {target} {} {:+.0}%",
            if count <= target as f64 {
                "met"
            } else {
                "MISSED"
            },
            (count / target as f64 - 1.0) * 100.0
        ),
        (Some(target), None) => format!("≤ {target}"),
        (None, _) => String::new(),
    };
    vec![
        i.id.to_owned(),
        i.title.to_owned(),
        i.requests.to_string(),
        i.per_request.map_or_else(
            || format!("skipped: {}", i.reason.as_deref().unwrap_or("")),
            |n| format!("{n:.0}"),
        ),
        target,
    ]
}

/// The workloads' table: its columns, then [`table_row`] per row.
const ROW_COLUMNS: [(&str, Align); 11] = [
    ("row", Align::Left),
    ("A", Align::Left),
    ("B", Align::Left),
    ("A req/s", Align::Right),
    ("B req/s", Align::Right),
    ("B/A", Align::Right),
    ("target", Align::Left),
    ("A p50/p99 ms", Align::Right),
    ("B p50/p99 ms", Align::Right),
    ("CPU µs/req A/B", Align::Right),
    ("idle % A/B", Align::Right),
];

impl Report {
    /// The table, with a line on how it was measured and notes for rows that did not run.
    pub fn table(&self) -> String {
        let mut out = self.how_measured();
        if !self.micro.is_empty() {
            let rows: Vec<Vec<String>> = self.micro.iter().map(micro_row).collect();
            out.push_str(&columns(&MICRO_COLUMNS, &rows));
            out.push('\n');
        }
        if !self.instructions.is_empty() {
            let rows: Vec<Vec<String>> = self.instructions.iter().map(instructions_row).collect();
            out.push_str(&columns(&INSTRUCTIONS_COLUMNS, &rows));
            out.push('\n');
        }
        if !self.rows.is_empty() {
            let rows: Vec<Vec<String>> = self.rows.iter().map(table_row).collect();
            out.push_str(&columns(&ROW_COLUMNS, &rows));
        }
        out.push_str(&self.latency_table());
        out.push_str(&key_tables(&self.key_tables));
        if let Some(m) = &self.memory {
            out.push('\n');
            out.push_str(&memory_line(m));
        }
        out.push_str(&self.notes());
        out.push_str(&self.missed());
        writeln!(out, "\nwall time {:.0} s", self.wall_secs).expect("writing to a String");
        out
    }

    /// The opening paragraph: the settings and the machine.
    fn how_measured(&self) -> String {
        let s = &self.settings;
        format!(
            "idem-bench: {} connections; each variant {} rounds of {:.1} s warm-up + {:.1} s measured, \
             variants of a group alternated in rotating order; medians over rounds, B/A = median of \
             per-round ratios. {} CPUs, load average {} at start.\n\n",
            s.concurrency,
            s.rounds,
            s.warmup_secs,
            s.duration_secs,
            self.machine.cpus,
            num(self.machine.load_average, 2),
        )
    }

    /// The rows that ran at more than one database latency, their ratios side by side, and
    /// the round trips to the database per request the relay counted; nothing without
    /// `--db-latency-ms`.
    fn latency_table(&self) -> String {
        let latencies = &self.settings.db_latency_ms;
        if latencies.len() < 2 && latencies.iter().all(|&ms| ms == 0.0) {
            return String::new();
        }
        let headers: Vec<String> = latencies.iter().map(|ms| format!("{ms} ms")).collect();
        let mut header: Vec<(&str, Align)> = vec![("row", Align::Left)];
        header.extend(headers.iter().map(|h| (h.as_str(), Align::Right)));
        header.push(("round trips/request A/B", Align::Right));
        header.push(("relay late ms A/B", Align::Right));
        let mut ids: Vec<&str> = Vec::new();
        for row in self.rows.iter().filter(|r| r.db_latency_ms > 0.0) {
            if !ids.contains(&row.id) {
                ids.push(row.id);
            }
        }
        let lines: Vec<Vec<String>> = ids.iter().map(|id| self.latency_line(id)).collect();
        if lines.is_empty() {
            return String::new();
        }
        format!(
            "\ndatabase latency added each way by the relay: B/A at each; the round trips to the \
             database per request the relay counted (a client's write after an answer, on each \
             connection: on a multiplexed one, such as Redis's, one carries several requests' \
             commands); and how much later than asked the relay passed chunks on (the busy \
             machine's scheduling), at the first latency above 0\n{}",
            columns(&header, &lines)
        )
    }

    /// [`Report::latency_table`]'s line for the row `id`.
    fn latency_line(&self, id: &str) -> Vec<String> {
        let at = |ms: f64| {
            self.rows
                .iter()
                .find(|r| r.id == id && r.db_latency_ms == ms)
        };
        let mut line = vec![
            self.rows
                .iter()
                .find(|r| r.id == id)
                .map_or("", |r| r.title)
                .to_owned(),
        ];
        for &ms in &self.settings.db_latency_ms {
            line.push(at(ms).map_or_else(|| "-".into(), ratio_cell));
        }
        // The counts hardly move with the latency: the first relayed run's are shown.
        let relayed = self
            .rows
            .iter()
            .find(|r| r.id == id && r.db_latency_ms > 0.0 && r.status == Status::Ok);
        let both = |f: fn(&crate::runner::Side) -> Option<f64>, decimals| {
            relayed.map_or_else(
                || "-".into(),
                |r| pair(r.a.as_ref().and_then(f), r.b.as_ref().and_then(f), decimals),
            )
        };
        line.push(both(|s| s.usage.db_round_trips, 1));
        line.push(both(|s| s.usage.db_relay_late_ms, 2));
        line
    }

    /// A line per row that was skipped or failed, and why; nothing if every row ran.
    fn notes(&self) -> String {
        let notes: Vec<String> = self
            .rows
            .iter()
            .filter(|r| r.status != Status::Ok)
            .map(|r| {
                let what = match r.status {
                    Status::Skipped => "skipped",
                    _ => "failed",
                };
                let id = row_label(r.id, r.db_latency_ms);
                format!("- {id} {what}: {}", r.reason.as_deref().unwrap_or(""))
            })
            .collect();
        if notes.is_empty() {
            return String::new();
        }
        format!("\n{}\n", notes.join("\n"))
    }

    /// The rows that missed their targets, if any did.
    fn missed(&self) -> String {
        let missed: Vec<String> = self
            .instructions
            .iter()
            .filter(|i| i.met() == Some(false))
            .map(|i| format!("instructions {}", i.id))
            .chain(
                self.rows
                    .iter()
                    .filter(|r| r.met == Some(false))
                    .map(|r| row_label(r.id, r.db_latency_ms)),
            )
            .collect();
        if missed.is_empty() {
            return String::new();
        }
        format!(
            "\ntargets missed: {}. docs/performance.md says where the time goes.\n",
            missed.join(", ")
        )
    }
}

/// The key tables' sizes, as filled before the first round; nothing without growth-*.
fn key_tables(tables: &[KeyTable]) -> String {
    if tables.is_empty() {
        return String::new();
    }
    const HEADER: [(&str, Align); 8] = [
        ("key table", Align::Left),
        ("records", Align::Right),
        ("filled in s", Align::Right),
        ("total MiB", Align::Right),
        ("table MiB", Align::Right),
        ("indexes MiB", Align::Right),
        ("file MiB", Align::Right),
        ("bytes/record", Align::Right),
    ];
    let mib = |bytes: Option<u64>| num(bytes.map(|b| b as f64 / (1024.0 * 1024.0)), 1);
    let lines: Vec<Vec<String>> = tables
        .iter()
        .map(|t| {
            vec![
                t.label.clone(),
                t.records.to_string(),
                format!("{:.1}", t.fill_secs),
                mib(t.total_bytes),
                mib(t.table_bytes),
                mib(t.indexes_bytes),
                mib(t.file_bytes),
                num(t.bytes_per_record(), 0),
            ]
        })
        .collect();
    format!(
        "\nkey tables (idempotency_keys) as filled, before the first round; filled in: the bulk \
         INSERT, then VACUUM ANALYZE and a checkpoint (SQLite: a WAL checkpoint)\n{}",
        columns(&HEADER, &lines)
    )
}

/// The memory workload's line.
fn memory_line(m: &MemoryResult) -> String {
    match m.status {
        Status::Ok => format!(
            "memory: {} with {} connections open ({} seen at once): RSS {} MiB idle, \
             peak {} MiB, {} MiB at the end; {} req/s, p99 {} ms under that load\n",
            m.subject,
            m.connections,
            m.connections_seen
                .map_or_else(|| "-".into(), |n| n.to_string()),
            num(m.rss_idle_mib, 1),
            num(m.rss_peak_mib, 1),
            num(m.rss_end_mib, 1),
            num(m.throughput, 0),
            num(m.p99_ms, 1),
        ),
        _ => format!(
            "memory: {} failed: {}\n",
            m.subject,
            m.reason.as_deref().unwrap_or("")
        ),
    }
}

/// B/A, or why a row has none.
fn ratio_cell(r: &Row) -> String {
    match r.status {
        Status::Ok => r.ratio.map_or_else(|| "-".into(), |v| format!("{v:.2}×")),
        Status::Skipped => "skipped".into(),
        Status::Failed => "FAILED".into(),
    }
}

fn table_row(r: &Row) -> Vec<String> {
    let side_label = |side: &Option<crate::runner::Side>| {
        side.as_ref()
            .map_or_else(|| "-".to_owned(), |s| s.label.clone())
    };
    let (a, b) = (r.a.as_ref(), r.b.as_ref());
    let target = match (r.target, r.ratio) {
        (Some(t), Some(ratio)) => t.verdict(ratio, r.added_p50_ms),
        (Some(t), None) => t.describe(),
        (None, _) => String::new(),
    };
    vec![
        row_label(r.title, r.db_latency_ms),
        side_label(&r.a),
        side_label(&r.b),
        num(a.and_then(|s| s.throughput), 0),
        num(b.and_then(|s| s.throughput), 0),
        ratio_cell(r),
        target,
        pair(a.and_then(|s| s.p50_ms), a.and_then(|s| s.p99_ms), 2),
        pair(b.and_then(|s| s.p50_ms), b.and_then(|s| s.p99_ms), 2),
        pair(
            a.and_then(|s| s.serving_cpu_us),
            b.and_then(|s| s.serving_cpu_us),
            0,
        ),
        pair(
            a.and_then(|s| s.usage.machine_idle).map(|f| f * 100.0),
            b.and_then(|s| s.usage.machine_idle).map(|f| f * 100.0),
            0,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workloads::Target;

    #[test]
    fn a_target_says_whether_it_is_met_and_how_far_the_row_is_from_it() {
        let ratio = Target {
            ratio: 0.85,
            ahead: false,
            from_db_latency_ms: 0.0,
            max_added_p50_ms: None,
        };
        assert_eq!(ratio.verdict(0.6545, None), "≥ 0.85× MISSED -23%");
        assert_eq!(ratio.verdict(0.935, None), "≥ 0.85× met +10%");
        let latency = Target {
            ratio: 0.92,
            max_added_p50_ms: Some(0.7),
            ..ratio
        };
        assert_eq!(
            latency.verdict(0.95, Some(0.9)),
            "≥ 0.92×, ≤ +0.7 ms p50 MISSED +3%, +0.20 ms",
            "the ratio is met, the latency is not"
        );
        assert_eq!(
            latency.verdict(0.93, Some(0.5)),
            "≥ 0.92×, ≤ +0.7 ms p50 met +1%, -0.20 ms"
        );
    }

    #[test]
    fn columns_align_wide_characters() {
        let out = columns(
            &[("a", Align::Left), ("b", Align::Right)],
            &[
                vec!["≥ 0.8×".into(), "1".into()],
                vec!["x".into(), "100".into()],
            ],
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "a         b");
        assert_eq!(lines[1], "≥ 0.8×    1");
        assert_eq!(lines[2], "x       100");
    }
}
