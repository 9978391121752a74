//! Runs a group: its variants in rotating order, round after round, then one row per
//! comparison with medians over rounds and the median of per-round ratios.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::Settings;
use crate::cpu;
use crate::load::{self, Plan, Sample};
use crate::stats::median;
use crate::workloads::growth::KeyTable;
use crate::workloads::{Comparison, Driver, Entry, Env, Group, Target, Variant};

/// One run of one variant.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// What the load generator measured.
    #[serde(flatten)]
    pub sample: Sample,
    /// What it cost, over the window (CPU) or the run (the relay's figures).
    #[serde(flatten)]
    pub usage: Usage,
}

/// What serving a run's requests cost beside the answers: CPU, and the database's round
/// trips as the latency relay saw them. A [`Side`]'s are the medians over its rounds.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    /// CPU µs per request, by component.
    pub cpu_us_per_request: BTreeMap<String, f64>,
    /// The share of the machine's CPU left idle.
    pub machine_idle: Option<f64>,
    /// Round trips to the database per request, counted by the latency relay (when the
    /// variant runs through one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub db_round_trips: Option<f64>,
    /// How much later than its time the relay passed a chunk on, on average, ms (scheduling
    /// on a busy machine; the relay's hop is its delay plus this).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub db_relay_late_ms: Option<f64>,
}

impl Usage {
    /// The medians of `rounds`: per component, and of each figure over the rounds that have
    /// it.
    fn median(rounds: &[RunResult]) -> Self {
        let median_of = |f: fn(&Usage) -> Option<f64>| {
            median(
                &rounds
                    .iter()
                    .filter_map(|r| f(&r.usage))
                    .collect::<Vec<_>>(),
            )
        };
        let mut components: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for r in rounds {
            for (name, micros) in &r.usage.cpu_us_per_request {
                components.entry(name.clone()).or_default().push(*micros);
            }
        }
        Self {
            cpu_us_per_request: components
                .into_iter()
                .filter_map(|(name, values)| Some((name, median(&values)?)))
                .collect(),
            machine_idle: median_of(|u| u.machine_idle),
            db_round_trips: median_of(|u| u.db_round_trips),
            db_relay_late_ms: median_of(|u| u.db_relay_late_ms),
        }
    }
}

/// One side of a row: a variant's medians over its rounds.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    /// The variant's id in its group.
    pub variant: &'static str,
    /// What it is.
    pub label: String,
    /// Median good answers per second.
    pub throughput: Option<f64>,
    /// Median of the rounds' median latencies, ms.
    pub p50_ms: Option<f64>,
    /// Median of the rounds' 99th percentiles, ms.
    pub p99_ms: Option<f64>,
    /// Median CPU µs per request of everything but the load generator.
    pub serving_cpu_us: Option<f64>,
    /// The medians of what the rounds cost.
    #[serde(flatten)]
    pub usage: Usage,
    /// Every round.
    pub rounds: Vec<RunResult>,
}

/// Whether a row was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Both sides ran.
    Ok,
    /// A dependency was missing (a service down, an install failed); nothing was measured.
    Skipped,
    /// A side ran but failed (errors, wrong answers).
    Failed,
}

/// A row of the report: B against A.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Stable id (`layer-sqlite`).
    pub id: &'static str,
    /// The group it belongs to.
    pub group: Group,
    /// What it measures.
    pub title: &'static str,
    /// The latency the relay added each way between the servers and their database, ms (0:
    /// connected directly). A row's id and this latency identify it in a report.
    pub db_latency_ms: f64,
    /// Whether it was measured.
    pub status: Status,
    /// Why not, when it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The baseline.
    pub a: Option<Side>,
    /// The one measured against it.
    pub b: Option<Side>,
    /// Median of the per-round throughput ratios B/A.
    pub ratio: Option<f64>,
    /// The per-round ratios.
    pub ratio_rounds: Vec<f64>,
    /// Median per-round p50 of B minus that of A, ms.
    pub added_p50_ms: Option<f64>,
    /// Median per-round p99 of B minus that of A, ms.
    pub added_p99_ms: Option<f64>,
    /// The goal for the ratio, if the issue set one.
    pub target: Option<Target>,
    /// Whether the ratio meets it.
    pub met: Option<bool>,
}

impl Row {
    fn not_measured(run: Run, c: &Comparison, status: Status, reason: String) -> Self {
        Self {
            id: c.id,
            group: run.group,
            title: c.title,
            db_latency_ms: run.db_latency_ms,
            status,
            reason: Some(reason),
            a: None,
            b: None,
            ratio: None,
            ratio_rounds: Vec::new(),
            added_p50_ms: None,
            added_p99_ms: None,
            target: c.target_at(run.db_latency_ms),
            met: None,
        }
    }
}

/// A variant's rounds so far, or why it stopped.
#[derive(Debug, Default)]
struct Runs {
    rounds: Vec<Option<RunResult>>,
    failure: Option<String>,
}

/// How many milliseconds of load a group's plan holds, at every latency it runs at (the
/// progress bar's unit).
pub(crate) fn planned_ms(group: Group, settings: &Settings) -> u64 {
    let latencies = group.db_latencies_ms(settings).len() as u64;
    latencies * planned_ms_once(group, settings)
}

/// How many milliseconds of load one run of a group holds.
fn planned_ms_once(group: Group, settings: &Settings) -> u64 {
    if group == Group::Memory {
        return run_ms(settings);
    }
    if group == Group::Instructions {
        // Two children under callgrind, about 50 times slower than the CPU.
        return if settings.quick { 10_000 } else { 60_000 };
    }
    (group.variant_count() * settings.rounds) as u64 * run_ms(settings)
}

/// A group at one database latency: what [`run_group`] runs once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    pub(crate) group: Group,
    /// Milliseconds each way; 0 connects directly.
    pub(crate) db_latency_ms: f64,
}

impl Run {
    /// The group's name, with the latency if there is one.
    fn name(self) -> String {
        if self.db_latency_ms > 0.0 {
            format!("{} @ {} ms", self.group.name(), self.db_latency_ms)
        } else {
            self.group.name().to_owned()
        }
    }
}

/// Milliseconds of one run.
fn run_ms(settings: &Settings) -> u64 {
    (settings.warmup + settings.duration).as_millis() as u64
}

/// What a group's run reports: its rows, and the key tables it filled (growth-*).
pub(crate) struct GroupResult {
    pub(crate) rows: Vec<Row>,
    pub(crate) key_tables: Vec<KeyTable>,
}

/// Sets up `group` with `db_latency_ms` between its servers and their database, runs its
/// rounds and tears it down.
pub(crate) async fn run_group(env: &Env, group: Group, db_latency_ms: f64) -> GroupResult {
    let run = Run {
        group,
        db_latency_ms,
    };
    let comparisons = group.comparisons();
    env.progress
        .set_message(format!("{}: starting", run.name()));
    let prepared = match group.setup(env, db_latency_ms).await {
        Ok(prepared) => prepared,
        Err(e) => {
            env.progress
                .dec_length(planned_ms_once(group, &env.settings));
            let rows = comparisons
                .iter()
                .map(|c| Row::not_measured(run, c, Status::Skipped, format!("{e:#}")))
                .collect();
            return GroupResult {
                rows,
                key_tables: Vec::new(),
            };
        }
    };
    let key_tables = prepared.key_tables;
    let selection = Selection::new(&env.settings, prepared.variants, comparisons);
    let skipped_runs = group
        .variant_count()
        .saturating_sub(selection.variants.len())
        * env.settings.rounds;
    env.progress
        .dec_length(skipped_runs as u64 * run_ms(&env.settings));
    let runs = run_rounds(env, run, &selection.variants).await;
    prepared.teardown.run().await;
    let rows = comparisons
        .iter()
        .map(|c| selection.row(run, c, &runs))
        .collect();
    GroupResult { rows, key_tables }
}

/// The variants of a group that run, and why each other one does not.
struct Selection {
    variants: Vec<Variant>,
    unavailable: HashMap<&'static str, String>,
}

impl Selection {
    /// Of the variants the set-up made, those that started, that `--variants` selects, and
    /// that some runnable row needs (or that were asked for by name).
    fn new(settings: &Settings, prepared: Vec<Entry>, comparisons: &[Comparison]) -> Self {
        let mut unavailable = HashMap::new();
        let mut variants = Vec::new();
        for (id, variant) in prepared {
            match variant {
                Ok(_)
                    if !settings.variants.is_empty()
                        && !settings.variants.iter().any(|v| v == id) =>
                {
                    unavailable.insert(id, "not selected (--variants)".into());
                }
                Ok(v) => variants.push(v),
                Err(why) => {
                    unavailable.insert(id, why);
                }
            }
        }
        variants.retain(|v: &Variant| {
            settings.variants.iter().any(|id| id == v.id)
                || comparisons.iter().any(|c| {
                    (c.a == v.id || c.b == v.id)
                        && !unavailable.contains_key(c.a)
                        && !unavailable.contains_key(c.b)
                })
        });
        Self {
            variants,
            unavailable,
        }
    }

    /// The row of `c`: skipped when a side could not run, failed when a side failed, else
    /// measured.
    fn row(&self, run: Run, c: &Comparison, runs: &HashMap<&str, Runs>) -> Row {
        if let Some(why) = self.unavailable.get(c.a).or(self.unavailable.get(c.b)) {
            return Row::not_measured(run, c, Status::Skipped, why.clone());
        }
        let (a, b) = (&runs[c.a], &runs[c.b]);
        if let Some(why) = a.failure.as_ref().or(b.failure.as_ref()) {
            let side = if a.failure.is_some() { c.a } else { c.b };
            return Row::not_measured(run, c, Status::Failed, format!("{side}: {why}"));
        }
        let label = |id| {
            self.variants
                .iter()
                .find(|v| v.id == id)
                .map(|v| v.label.clone())
                .unwrap_or_default()
        };
        row(run, c, side(c.a, label(c.a), a), side(c.b, label(c.b), b))
    }
}

/// Runs each of `variants` once a round, in an order that rotates each round; a variant that
/// failed is not run again.
async fn run_rounds(env: &Env, run: Run, variants: &[Variant]) -> HashMap<&'static str, Runs> {
    let per_run = run_ms(&env.settings);
    let mut runs: HashMap<&str, Runs> = variants.iter().map(|v| (v.id, Runs::default())).collect();
    for round in 0..env.settings.rounds {
        // Rotating the order each round spreads any drift in the machine over all variants.
        for i in 0..variants.len() {
            let variant = &variants[(i + round) % variants.len()];
            let entry = runs.get_mut(variant.id).expect("every variant has runs");
            if entry.failure.is_some() {
                env.progress.inc(per_run);
                entry.rounds.push(None);
                continue;
            }
            env.progress.set_message(format!(
                "{}: {} (round {}/{})",
                run.name(),
                variant.label,
                round + 1,
                env.settings.rounds
            ));
            let run_tag = format!("{}-{}-{round}", env.tag, variant.id);
            match run_variant(env, variant, &run_tag).await {
                Ok(result) => entry.rounds.push(Some(result)),
                Err(e) => {
                    entry.failure = Some(e);
                    entry.rounds.push(None);
                }
            }
        }
    }
    runs
}

/// Loads one variant for one round and measures its CPU over the window.
async fn run_variant(env: &Env, variant: &Variant, run_tag: &str) -> Result<RunResult, String> {
    if let Some(before) = &variant.before_run {
        (before.0)().await.map_err(|e| format!("{e:#}"))?;
    }
    let settings = &env.settings;
    let plan = Plan {
        concurrency: settings.concurrency,
        warmup: settings.warmup,
        duration: settings.duration,
    };
    let position = env.progress.position();
    let started = Instant::now();
    // CPU is read at the window's start and just before its end, while every process that
    // serves the load (pgbench's backends included) is still alive.
    let cpu_window = async {
        tokio::time::sleep(settings.warmup).await;
        let before = cpu::snapshot(&variant.children);
        let from = Instant::now();
        tokio::time::sleep(settings.duration.saturating_sub(Duration::from_millis(20))).await;
        let after = cpu::snapshot(&variant.children);
        (before, after, from.elapsed())
    };
    // Round trips are counted over the whole run and divided by every request it completed:
    // pgbench's window (from its log) and the harness's clock need not line up, and pgbench
    // connects while the window may already run.
    let tally = || variant.relay.as_ref().map(|counts| counts.tally());
    let relay_before = tally();
    let ticker = async {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let elapsed = started.elapsed().min(settings.warmup + settings.duration);
            env.progress
                .set_position(position + elapsed.as_millis() as u64);
        }
    };
    let load = async {
        match &variant.driver {
            Driver::Http(target) => env
                .runtimes
                .load
                .spawn(load::run(target.clone(), plan, run_tag.to_owned()))
                .await
                .map_err(|e| format!("the load generator panicked: {e}")),
            Driver::Pgbench(pgbench) => pgbench
                .run(plan, run_tag)
                .await
                .map_err(|e| format!("{e:#}")),
        }
    };
    let (sample, (before, after, window)) = tokio::select! {
        both = async { tokio::join!(load, cpu_window) } => both,
        _ = ticker => unreachable!("the ticker never ends"),
    };
    env.progress.set_position(position + run_ms(settings));
    let sample = sample?;
    sample.check()?;
    let served = (sample.throughput * window.as_secs_f64()).round() as u64;
    let relay = relay_before.zip(tally());
    let db_round_trips = relay.map(|(before, after)| {
        (after.round_trips - before.round_trips) as f64 / sample.total_requests.max(1) as f64
    });
    let usage = Usage {
        cpu_us_per_request: before.per_request(&after, served),
        machine_idle: before.idle_fraction(&after),
        db_round_trips,
        db_relay_late_ms: relay.and_then(|(before, after)| after.mean_late_ms(&before)),
    };
    Ok(RunResult { sample, usage })
}

fn side(variant: &'static str, label: String, runs: &Runs) -> Side {
    let rounds: Vec<RunResult> = runs.rounds.iter().flatten().cloned().collect();
    let of = |f: fn(&RunResult) -> f64| median(&rounds.iter().map(f).collect::<Vec<_>>());
    Side {
        variant,
        label,
        throughput: of(|r| r.sample.throughput),
        p50_ms: of(|r| r.sample.p50_ms),
        p99_ms: of(|r| r.sample.p99_ms),
        serving_cpu_us: of(|r| cpu::serving(&r.usage.cpu_us_per_request)),
        usage: Usage::median(&rounds),
        rounds,
    }
}

/// Builds a measured row; ratios pair the two sides round by round.
fn row(run: Run, c: &Comparison, a: Side, b: Side) -> Row {
    let pairs: Vec<(&RunResult, &RunResult)> = a.rounds.iter().zip(b.rounds.iter()).collect();
    let ratio_rounds: Vec<f64> = pairs
        .iter()
        .map(|(a, b)| b.sample.throughput / a.sample.throughput)
        .collect();
    let added = |f: fn(&Sample) -> f64| {
        median(
            &pairs
                .iter()
                .map(|(a, b)| f(&b.sample) - f(&a.sample))
                .collect::<Vec<_>>(),
        )
    };
    let ratio = median(&ratio_rounds);
    let added_p50_ms = added(|s| s.p50_ms);
    Row {
        id: c.id,
        group: run.group,
        title: c.title,
        db_latency_ms: run.db_latency_ms,
        status: Status::Ok,
        reason: None,
        ratio,
        added_p50_ms,
        added_p99_ms: added(|s| s.p99_ms),
        ratio_rounds,
        target: c.target_at(run.db_latency_ms),
        met: c
            .target_at(run.db_latency_ms)
            .zip(ratio)
            .map(|(t, r)| t.met(r, added_p50_ms)),
        a: Some(a),
        b: Some(b),
    }
}
