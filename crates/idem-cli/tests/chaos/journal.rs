//! What the run records: every attempt and every chaos event, in memory for the checker and
//! on disk as JSON lines. Both chaos runs (`chaos` and `gateway_chaos`) record this way.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use idem_testkit::fault_relay::Fault;
use serde::Serialize;
use tokio::time::Instant;

use crate::chaos::schedule::Relays;

/// How an attempt was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Via {
    /// A whole request over HTTP, read to its answer.
    Http,
    /// A copy sent again after it already got its `201`.
    Late,
    /// The request's first `cut_at` bytes on a raw socket, then the socket closed.
    Cut,
    /// The checker's replay of the key after the run.
    Final,
}

/// One attempt and its answer (or the lack of one), as a line of the log.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Attempt {
    pub(crate) key: u32,
    pub(crate) copy: u8,
    pub(crate) attempt: u32,
    pub(crate) via: Via,
    /// Where it was sent.
    #[serde(flatten)]
    pub(crate) on: Process,
    /// Milliseconds since the run started.
    pub(crate) sent_ms: f64,
    pub(crate) done_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) retry_after: Option<String>,
    pub(crate) replayed: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) body: String,
    /// The body as received, for byte-for-byte comparison.
    #[serde(skip)]
    pub(crate) raw: Bytes,
    /// Why there was no answer (connection refused or dropped, the cut itself).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<String>,
    pub(crate) timed_out: bool,
    /// Where a cut attempt was cut.
    #[serde(flatten)]
    pub(crate) cut: Option<Cut>,
}

/// Which instance slot (0 or 1), which of its processes (restarts count up), on what port (an
/// instance is an `idem serve`, or an `idem proxy` in the gateway's run).
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Process {
    pub(crate) instance: usize,
    pub(crate) generation: u32,
    pub(crate) port: u16,
}

/// Where a request was cut: after its first `cut_at` bytes, of a head of `head_len` bytes and
/// a request of `request_len`.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Cut {
    pub(crate) cut_at: usize,
    pub(crate) head_len: usize,
    pub(crate) request_len: usize,
}

impl Attempt {
    pub(crate) fn created(&self) -> bool {
        self.status == Some(201)
    }

    /// A `2xx`: an acknowledgement the client may act on.
    pub(crate) fn acknowledged(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
    }

    pub(crate) fn label(&self) -> String {
        match (self.via, self.status) {
            (Via::Cut, _) if self.error.is_none() => "cut".into(),
            (_, Some(201)) if self.replayed => "201 replayed".into(),
            (_, Some(201)) => "201 fresh".into(),
            (_, Some(code)) => code.to_string(),
            (_, None) if self.timed_out => "timed out".into(),
            (_, None) => "connection error".into(),
        }
    }

    /// An answer the contract allows during chaos: a `201`, a refusal the client may retry
    /// (`409`, `503`, each with `Retry-After`), or no answer at all, short of a hang; never a
    /// `500`, nor (through the gateway, to a healthy upstream) a `502` or `504`.
    pub(crate) fn allowed(&self) -> bool {
        match self.status {
            Some(201) => true,
            Some(409 | 503) => self.retry_after.is_some(),
            Some(_) => false,
            None => !self.timed_out,
        }
    }
}

/// A chaos event, as a line of the log.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Event {
    pub(crate) what: &'static str,
    pub(crate) ms: f64,
    /// The process it happened to, if any.
    #[serde(flatten)]
    pub(crate) on: Option<Process>,
    /// A network fault's name, and which relays it is on (`0`, `1` or `both`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) fault: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) relays: Option<&'static str>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum Line<'a> {
    Attempt(&'a Attempt),
    Event(&'a Event),
}

/// Every attempt and event of the run, in memory for the checker and on disk as JSON lines.
pub(crate) struct Journal {
    pub(crate) started: Instant,
    pub(crate) inner: Mutex<JournalInner>,
}

pub(crate) struct JournalInner {
    pub(crate) attempts: Vec<Attempt>,
    pub(crate) events: Vec<Event>,
    pub(crate) out: BufWriter<File>,
}

impl Journal {
    pub(crate) fn create(path: &Path) -> Self {
        let out = BufWriter::new(File::create(path).expect("create the chaos log"));
        Self {
            started: Instant::now(),
            inner: Mutex::new(JournalInner {
                attempts: Vec::new(),
                events: Vec::new(),
                out,
            }),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, JournalInner> {
        // Only pushes and writes happen under the lock, and no await: a std Mutex. A panic
        // cannot leave the vectors half-written.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn ms(&self, at: Instant) -> f64 {
        (at - self.started).as_secs_f64() * 1000.0
    }

    pub(crate) fn attempt(&self, attempt: Attempt) {
        let mut inner = self.lock();
        let line = serde_json::to_string(&Line::Attempt(&attempt)).expect("serialise");
        writeln!(inner.out, "{line}").expect("write the chaos log");
        inner.attempts.push(attempt);
    }

    pub(crate) fn event(&self, what: &'static str, instance: Option<(usize, u32, u16)>) {
        self.push_event(Event {
            what,
            ms: self.ms(Instant::now()),
            on: instance.map(|(instance, generation, port)| Process {
                instance,
                generation,
                port,
            }),
            fault: None,
            relays: None,
        });
    }

    pub(crate) fn net_event(&self, what: &'static str, fault: Fault, on: Relays) {
        self.push_event(Event {
            what,
            ms: self.ms(Instant::now()),
            on: None,
            fault: Some(fault.name()),
            relays: Some(on.name()),
        });
    }

    pub(crate) fn push_event(&self, event: Event) {
        let mut inner = self.lock();
        let line = serde_json::to_string(&Line::Event(&event)).expect("serialise");
        writeln!(inner.out, "{line}").expect("write the chaos log");
        // Flushed at each event, so a run that dies midway leaves its log up to there.
        inner.out.flush().expect("flush the chaos log");
        inner.events.push(event);
    }

    pub(crate) fn flush(&self) {
        self.lock().out.flush().expect("flush the chaos log");
    }

    pub(crate) fn attempts(&self) -> Vec<Attempt> {
        self.lock().attempts.clone()
    }

    #[allow(dead_code)] // the gateway's run does not count its events
    pub(crate) fn events(&self) -> Vec<Event> {
        self.lock().events.clone()
    }
}

/// Answers by label, for the figures.
pub(crate) fn tally<'a>(
    attempts: impl IntoIterator<Item = &'a Attempt>,
) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for a in attempts {
        *counts.entry(a.label()).or_default() += 1;
    }
    counts
}
