//! The load generator: N keep-alive HTTP/1.1 connections, each sending one request after
//! another for a fixed time, latencies in an HDR histogram.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;

/// Where each request's `Idempotency-Key` comes from.
#[derive(Debug, Clone)]
pub(crate) enum Keys {
    /// A new key per request: `{prefix}-{worker}-{n}`.
    Fresh {
        /// Unique per run, so no two runs share a key.
        prefix: String,
    },
    /// Keys already used once, cycled through: every request is a replay.
    Cycle(Arc<Vec<String>>),
}

/// One HTTP endpoint under load, and what a good answer looks like.
#[derive(Debug, Clone)]
pub(crate) struct HttpTarget {
    /// The full URL requests go to.
    pub(crate) uri: Uri,
    /// More URLs serving the same thing (other instances of one service): connection `i`
    /// sends to the `i`-th of `uri` and these, in turn.
    pub(crate) more_uris: Vec<Uri>,
    /// `Authorization` sent with every request.
    pub(crate) authorization: Option<String>,
    /// The JSON body of every request.
    pub(crate) body: Bytes,
    /// The `Idempotency-Key` of each request.
    pub(crate) keys: Keys,
    /// The status every answer must have.
    pub(crate) expect_status: u16,
    /// Every answer must carry `Idempotent-Replayed: true` (a replay workload that did the
    /// work afresh would measure the wrong thing).
    pub(crate) expect_replayed: bool,
}

impl HttpTarget {
    /// A fresh-key POST of `body` with `authorization` to `uri`, expecting `201`.
    pub(crate) fn post(uri: &str, authorization: Option<&str>, body: &'static str) -> Self {
        Self {
            uri: uri.parse().expect("a valid URL"),
            more_uris: Vec::new(),
            authorization: authorization.map(str::to_owned),
            body: Bytes::from_static(body.as_bytes()),
            keys: Keys::Fresh {
                prefix: String::new(),
            },
            expect_status: 201,
            expect_replayed: false,
        }
    }

    /// Where worker `worker`'s requests go.
    fn uri_for(&self, worker: usize) -> &Uri {
        match worker % (1 + self.more_uris.len()) {
            0 => &self.uri,
            i => &self.more_uris[i - 1],
        }
    }

    fn key(&self, run: &str, worker: usize, n: u64) -> String {
        match &self.keys {
            Keys::Fresh { prefix } => format!("{prefix}{run}-{worker}-{n}"),
            Keys::Cycle(keys) => {
                // Workers start at different places so they do not all hit one key at once.
                let i = (worker as u64 * 7919 + n) % keys.len() as u64;
                keys[i as usize].clone()
            }
        }
    }
}

/// How long and how hard to load.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    /// Concurrent connections, each with one request in flight.
    pub(crate) concurrency: usize,
    /// Load that is sent but not measured (connections, caches, JIT in Node).
    pub(crate) warmup: Duration,
    /// The measured window.
    pub(crate) duration: Duration,
}

/// What one run measured, over its measured window.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Good answers per second.
    pub throughput: f64,
    /// Median latency, ms.
    pub p50_ms: f64,
    /// 99th percentile latency, ms.
    pub p99_ms: f64,
    /// Good answers in the window.
    pub requests: u64,
    /// Failed requests (transport errors, unexpected status) in the window.
    pub errors: u64,
    /// Everything completed during the run, warm-up included (for CPU per request).
    pub total_requests: u64,
    /// The first failure seen, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
}

impl Sample {
    /// Builds a sample from a histogram of latencies in microseconds.
    pub(crate) fn from_histogram(
        histogram: &Histogram<u64>,
        window: Duration,
        errors: u64,
        total_requests: u64,
        first_error: Option<String>,
    ) -> Self {
        let requests = histogram.len();
        let ms = |q: f64| {
            if requests == 0 {
                0.0
            } else {
                histogram.value_at_quantile(q) as f64 / 1000.0
            }
        };
        Self {
            throughput: requests as f64 / window.as_secs_f64(),
            p50_ms: ms(0.50),
            p99_ms: ms(0.99),
            requests,
            errors,
            total_requests,
            first_error,
        }
    }

    /// Whether the run is fit to report: it answered, and (nearly) never failed.
    pub(crate) fn check(&self) -> Result<(), String> {
        let failed = self.errors > self.requests / 100;
        if self.requests == 0 || failed {
            return Err(format!(
                "{} good answers, {} failures; first failure: {}",
                self.requests,
                self.errors,
                self.first_error.as_deref().unwrap_or("none")
            ));
        }
        Ok(())
    }
}

/// Latencies from 1 µs to 60 s, three significant digits.
pub(crate) fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds")
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A keep-alive HTTP/1.1 client with up to `connections` pooled connections.
fn client(connections: usize) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(connections)
        .build(connector)
}

/// Loads `target` according to `plan`. `run` makes this run's keys unique.
pub(crate) async fn run(target: Arc<HttpTarget>, plan: Plan, run: String) -> Sample {
    // A new client per run: no connection outlives the run (servers close idle ones between
    // runs), and connecting is part of the warm-up.
    let client = client(plan.concurrency);
    let start = Instant::now();
    let measure_from = start + plan.warmup;
    let end = measure_from + plan.duration;
    let run = Arc::new(run);
    let workers: Vec<_> = (0..plan.concurrency)
        .map(|worker| {
            let (client, target, run) = (client.clone(), target.clone(), run.clone());
            tokio::spawn(async move {
                let mut latencies = histogram();
                let (mut errors, mut total, mut first_error) = (0u64, 0u64, None);
                let mut n = 0u64;
                while Instant::now() < end {
                    let key = target.key(&run, worker, n);
                    n += 1;
                    let sent = Instant::now();
                    let outcome = send(&client, &target, worker, key).await;
                    let done = Instant::now();
                    total += 1;
                    if done < measure_from || done > end {
                        continue;
                    }
                    match outcome {
                        Ok(()) => {
                            let micros = (done - sent).as_micros().max(1) as u64;
                            latencies.saturating_record(micros);
                        }
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert(format!("{e:#}"));
                        }
                    }
                }
                (latencies, errors, total, first_error)
            })
        })
        .collect();
    let mut latencies = histogram();
    let (mut errors, mut total, mut first_error) = (0, 0, None);
    for worker in workers {
        let (h, e, t, f) = worker.await.expect("a load worker panicked");
        latencies.add(&h).expect("histograms with the same bounds");
        errors += e;
        total += t;
        first_error = first_error.or(f);
    }
    Sample::from_histogram(&latencies, plan.duration, errors, total, first_error)
}

/// Sends one request and checks its answer.
async fn send(
    client: &HttpClient,
    target: &HttpTarget,
    worker: usize,
    key: String,
) -> anyhow::Result<()> {
    let mut request = Request::post(target.uri_for(worker).clone())
        .header(CONTENT_TYPE, "application/json")
        .header("idempotency-key", key);
    if let Some(authorization) = &target.authorization {
        request = request.header(AUTHORIZATION, authorization);
    }
    let request = request.body(Full::new(target.body.clone()))?;
    let response = client.request(request).await.context("request failed")?;
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body = response
        .into_body()
        .collect()
        .await
        .context("reading the body failed")?
        .to_bytes();
    if status != target.expect_status {
        anyhow::bail!(
            "expected {}, got {status}: {}",
            target.expect_status,
            String::from_utf8_lossy(&body[..body.len().min(200)])
        );
    }
    if target.expect_replayed && !replayed {
        anyhow::bail!("expected a replay, got fresh work");
    }
    Ok(())
}

/// Sends one request per key (with `concurrency` in flight), so that a replay workload finds
/// every key completed.
pub(crate) async fn prime(
    target: &HttpTarget,
    keys: &[String],
    concurrency: usize,
) -> anyhow::Result<()> {
    let client = client(concurrency);
    let target = Arc::new(HttpTarget {
        keys: Keys::Cycle(Arc::new(keys.to_vec())),
        expect_replayed: false,
        ..target.clone()
    });
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let workers: Vec<_> = (0..concurrency)
        .map(|worker| {
            let (client, target, next, keys) =
                (client.clone(), target.clone(), next.clone(), keys.to_vec());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(key) = keys.get(i) else {
                        return Ok::<_, anyhow::Error>(());
                    };
                    send(&client, &target, worker, key.clone())
                        .await
                        .with_context(|| format!("priming key {key}"))?;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await??;
    }
    Ok(())
}

/// Waits until `uri` answers a GET (any status) or `timeout` passes.
pub(crate) async fn wait_until_up(uri: &str, timeout: Duration) -> anyhow::Result<()> {
    let client = client(1);
    let uri: Uri = uri.parse()?;
    let deadline = Instant::now() + timeout;
    loop {
        let request = Request::get(uri.clone()).body(Full::new(Bytes::new()))?;
        match client.request(request).await {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() > deadline => {
                return Err(anyhow::Error::new(e).context(format!("{uri} did not come up")));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_take_the_instances_in_turn() {
        let mut target = HttpTarget::post("http://a/p", None, "{}");
        assert_eq!(
            target.uri_for(3),
            &target.uri,
            "one instance takes every connection"
        );
        target.more_uris = vec!["http://b/p".parse().unwrap(), "http://c/p".parse().unwrap()];
        let hosts: Vec<_> = (0..6)
            .map(|worker| target.uri_for(worker).host().unwrap().to_owned())
            .collect();
        assert_eq!(hosts, ["a", "b", "c", "a", "b", "c"]);
    }

    #[test]
    fn a_sample_reports_percentiles_in_milliseconds() {
        let mut h = histogram();
        for micros in 1..=1000 {
            h.record(micros).unwrap();
        }
        let sample = Sample::from_histogram(&h, Duration::from_secs(2), 0, 1000, None);
        assert_eq!(sample.requests, 1000);
        assert!((sample.throughput - 500.0).abs() < 1e-9);
        assert!((sample.p50_ms - 0.5).abs() < 0.01, "{}", sample.p50_ms);
        assert!((sample.p99_ms - 0.99).abs() < 0.01, "{}", sample.p99_ms);
        assert!(sample.check().is_ok());
    }

    #[test]
    fn a_sample_with_many_failures_is_unfit() {
        let mut h = histogram();
        h.record(10).unwrap();
        let sample = Sample::from_histogram(&h, Duration::from_secs(1), 5, 6, Some("boom".into()));
        assert!(sample.check().unwrap_err().contains("boom"));
    }

    #[test]
    fn cycled_keys_are_spread_over_workers() {
        let mut target = HttpTarget::post("http://127.0.0.1:1/p", None, "{}");
        target.keys = Keys::Cycle(Arc::new((0..10).map(|i| i.to_string()).collect()));
        assert_ne!(target.key("r", 0, 0), target.key("r", 1, 0));
        let fresh = HttpTarget::post("http://127.0.0.1:1/p", None, "{}");
        assert_eq!(fresh.key("r", 3, 4), "r-3-4");
    }
}
