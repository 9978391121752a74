//! The payment provider `POST /payouts` calls: its client, the key it is called with, and the
//! points where a crash test may freeze a payout.

use std::time::Duration;

use idem_core::DownstreamKey;
use serde::Deserialize;

/// Where a test may freeze a payout, to kill the process at that point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PausePoint {
    /// After the claim, before the provider is called.
    BeforeProvider,
    /// After the provider answered, before the outcome is stored.
    AfterProvider,
}

/// The provider's answer to a charge.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Charge {
    pub(crate) id: String,
    pub(crate) amount: i64,
    pub(crate) currency: String,
}

/// The payment provider `idem serve` pays out through.
#[derive(Debug, Clone)]
pub(crate) struct Provider {
    url: String,
    http: reqwest::Client,
    /// How long one call may take (the client's timeout).
    pub(crate) timeout: Duration,
    pause: Option<PausePoint>,
}

impl Provider {
    pub(crate) fn new(url: String, timeout: Duration, pause: Option<PausePoint>) -> Self {
        Self {
            url: url.trim_end_matches('/').to_owned(),
            http: reqwest::Client::builder()
                .timeout(timeout)
                .build()
                .expect("a plain HTTP client builds"),
            timeout,
            pause,
        }
    }

    /// `POST /charges` under `key`, the payout request's [`DownstreamKey`]: the provider
    /// charges once per key.
    pub(crate) async fn charge(
        &self,
        key: &DownstreamKey,
        amount: i64,
        currency: &str,
    ) -> reqwest::Result<reqwest::Response> {
        self.http
            .post(format!("{}/charges", self.url))
            .header("idempotency-key", key.as_str())
            .json(&serde_json::json!({"amount": amount, "currency": currency}))
            .send()
            .await
    }

    /// `GET /charges/{key}`: what the provider did for the payout whose key is `key`.
    pub(crate) async fn lookup(&self, key: &DownstreamKey) -> reqwest::Result<reqwest::Response> {
        let url = format!("{}/charges/{key}", self.url);
        self.http.get(url).send().await
    }

    /// Freezes forever if the service was told to pause `here` (the test then kills it).
    pub(crate) async fn pause_at(&self, here: PausePoint) {
        if self.pause == Some(here) {
            eprintln!("idem-fault: paused at {here:?}");
            std::future::pending::<()>().await;
        }
    }
}
