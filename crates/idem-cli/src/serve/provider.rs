//! The payment provider `POST /payouts` calls: its client, the key it is called with, and the
//! points where a crash test may freeze a payout.

use std::time::Duration;

use idem_core::Scope;
use serde::Deserialize;
use sha2::{Digest, Sha256};

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

    /// `POST /charges` for the payout of `scope`, under the key derived from it.
    pub(crate) async fn charge(
        &self,
        scope: &Scope,
        amount: i64,
        currency: &str,
    ) -> reqwest::Result<reqwest::Response> {
        self.http
            .post(format!("{}/charges", self.url))
            .header("idempotency-key", provider_key(scope))
            .json(&serde_json::json!({"amount": amount, "currency": currency}))
            .send()
            .await
    }

    /// `GET /charges/{key}`: what the provider did for the payout of `scope`.
    pub(crate) async fn lookup(&self, scope: &Scope) -> reqwest::Result<reqwest::Response> {
        let url = format!("{}/charges/{}", self.url, provider_key(scope));
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

/// The key the provider sees: derived from ours, so it is stable across retries and takeovers,
/// and scoped to the account.
fn provider_key(scope: &Scope) -> String {
    let mut hash = Sha256::new();
    hash.update(b"idem-payout\0");
    hash.update(scope.account.as_str().as_bytes());
    hash.update([0]);
    hash.update(scope.key.as_str().as_bytes());
    format!("idem-{}", hex::encode(&hash.finalize()[..20]))
}
