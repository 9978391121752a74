//! The layer's outcomes over the last hour, for the console's charts (`GET /admin/outcomes`):
//! `idem_requests_total` by `outcome`, read from the process's own Prometheus recorder every
//! 10 s into a ring of one hour. The figures are the counters `/metrics` serves, so the charts
//! cannot tell another story than the scrapes do; labels are kept as the opaque strings the
//! layer counts under.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use idem_core::{Clock, Timestamp};
use serde_json::{Value, json};

/// How often the counters are read.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// How far back the samples go.
pub(crate) const WINDOW: Duration = Duration::from_secs(60 * 60);

/// The samples of one hour, and the one before them, so the first interval has a start.
const KEPT: usize = (WINDOW.as_secs() / SAMPLE_EVERY.as_secs()) as usize + 1;

/// The counters as read at one instant: cumulative since the process started.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    at: Timestamp,
    requests: BTreeMap<String, u64>,
}

/// The ring of samples, filled by a task that lives as long as the ring is held.
#[derive(Debug, Default)]
pub(crate) struct OutcomeSamples {
    // A std Mutex: it is held for a push or a copy, never across an await.
    samples: Mutex<VecDeque<Sample>>,
}

impl OutcomeSamples {
    /// A ring sampled every [`SAMPLE_EVERY`] from the process's recorder, timed by `clock`.
    /// The sampling task holds only a weak reference, so it ends once the router that holds
    /// the ring is dropped (tests build many). Outside a Tokio runtime nothing is sampled.
    pub(crate) fn start(clock: Arc<dyn Clock>) -> Arc<Self> {
        let samples = Arc::new(Self::default());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sample(Arc::downgrade(&samples), clock));
        }
        samples
    }

    fn push(&self, sample: Sample) {
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        if samples.len() == KEPT {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    /// The answer to `GET /admin/outcomes`.
    pub(crate) fn to_json(&self) -> Value {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        json!({
            "metric": "idem_requests_total",
            "every_seconds": SAMPLE_EVERY.as_secs(),
            "window_seconds": WINDOW.as_secs(),
            "samples": samples
                .iter()
                .map(|s| json!({"at_ms": s.at.0, "requests": s.requests}))
                .collect::<Vec<_>>(),
        })
    }
}

async fn sample(samples: Weak<OutcomeSamples>, clock: Arc<dyn Clock>) {
    let metrics = crate::runtime::metrics_handle();
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(ring) = samples.upgrade() else {
            return;
        };
        ring.push(Sample {
            at: clock.now(),
            requests: requests_by_outcome(&metrics.render()),
        });
    }
}

/// `idem_requests_total` in Prometheus text, summed by its `outcome` label (over any other
/// labels a series may carry).
fn requests_by_outcome(text: &str) -> BTreeMap<String, u64> {
    let mut requests = BTreeMap::new();
    for line in text.lines() {
        let Some(series) = line.strip_prefix("idem_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = series.rsplit_once('}') else {
            continue;
        };
        let Some(outcome) = label(labels, "outcome") else {
            continue;
        };
        // Counters print as integers, or as floats once large; either is a count.
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        *requests.entry(outcome).or_default() += value as u64;
    }
    requests
}

/// The value of label `name` in `a="x",b="y"`, unescaped.
fn label(labels: &str, name: &str) -> Option<String> {
    let mut rest = labels;
    loop {
        let (key, after) = rest.split_once("=\"")?;
        let key = key.trim_start_matches(',').trim();
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        if key == name {
            return Some(value);
        }
        rest = &after[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counters_are_read_by_outcome_from_prometheus_text() {
        let text = "# TYPE idem_requests_total counter\n\
            idem_requests_total{outcome=\"fresh\"} 3\n\
            idem_requests_total{route=\"/a\",outcome=\"replayed\"} 2\n\
            idem_requests_total{outcome=\"replayed\",route=\"/b\"} 1\n\
            idem_requests_total{outcome=\"odd \\\"one\\\"\"} 1e1\n\
            idem_request_seconds_count{outcome=\"fresh\"} 9\n\
            idem_requests_total 7\n";
        let requests = requests_by_outcome(text);
        assert_eq!(
            requests,
            BTreeMap::from([
                ("fresh".to_owned(), 3),
                ("odd \"one\"".to_owned(), 10),
                ("replayed".to_owned(), 3),
            ])
        );
    }

    #[test]
    fn the_ring_keeps_one_hour() {
        let ring = OutcomeSamples::default();
        for i in 0..KEPT as i64 + 5 {
            ring.push(Sample {
                at: Timestamp(i * 10_000),
                requests: BTreeMap::new(),
            });
        }
        let shown = ring.to_json();
        let samples = shown["samples"].as_array().unwrap();
        assert_eq!(samples.len(), 361);
        assert_eq!(samples[0]["at_ms"], 50_000);
        assert_eq!(shown["every_seconds"], 10);
    }
}
