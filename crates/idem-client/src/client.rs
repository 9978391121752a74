//! The attempt loop.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, StatusCode};
use idem_core::{Clock, IdempotencyKey, SystemClock};
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

use crate::classify::{is_retryable, retry_after};
use crate::{Error, Intent, RetryBudget, RetryPolicy, Sleeper, Stop, TokioSleeper};

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Sends [`Intent`]s, retrying each until the server gives a final answer.
///
/// Clones share the HTTP connection pool, the [`RetryBudget`] and the RNG, so one client (and
/// its clones) is the unit the budget protects a server from.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    policy: RetryPolicy,
    budget: RetryBudget,
    sleeper: Arc<dyn Sleeper>,
    clock: Arc<dyn Clock>,
    rng: Arc<Mutex<Box<dyn RngCore + Send>>>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("policy", &self.policy)
            .field("budget", &self.budget)
            .field("sleeper", &self.sleeper)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

impl Default for Client {
    fn default() -> Self {
        Self::new()
    }
}

impl Client {
    /// A client with the default policy and budget, Tokio's timer, the system clock, and an
    /// RNG seeded by the operating system.
    pub fn new() -> Self {
        Self {
            http: reqwest::Client::new(),
            policy: RetryPolicy::default(),
            budget: RetryBudget::default(),
            sleeper: Arc::new(TokioSleeper),
            clock: Arc::new(SystemClock),
            rng: Arc::new(Mutex::new(Box::new(StdRng::from_os_rng()))),
        }
    }

    /// Sends through `http` (for its TLS, proxy or default headers) instead of a plain
    /// `reqwest::Client`. The policy's `attempt_timeout` replaces the client's own total
    /// timeout; its connect timeout, if any, still applies.
    pub fn with_http_client(mut self, http: reqwest::Client) -> Self {
        self.http = http;
        self
    }

    /// Retries by `policy`.
    pub fn with_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Spends retries from `budget`, which may be shared with other clients.
    pub fn with_budget(mut self, budget: RetryBudget) -> Self {
        self.budget = budget;
        self
    }

    /// Waits between attempts with `sleeper`.
    pub fn with_sleeper(mut self, sleeper: impl Sleeper) -> Self {
        self.sleeper = Arc::new(sleeper);
        self
    }

    /// Reads "now" from `clock`, to turn a `Retry-After` HTTP-date into a wait.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Draws the jitter from `rng`; a seeded one (`StdRng::seed_from_u64(42)`) makes the
    /// waits of intents sent one after another the same on every run.
    pub fn with_rng(mut self, rng: impl RngCore + Send + 'static) -> Self {
        self.rng = Arc::new(Mutex::new(Box::new(rng)));
        self
    }

    /// The retry budget this client spends.
    pub fn budget(&self) -> &RetryBudget {
        &self.budget
    }

    /// Sends `intent` until the server gives a final answer, the policy's attempt limit is
    /// reached, or the budget has no retry left.
    ///
    /// Every attempt carries the same body, headers and key. A final answer (success, or a
    /// refusal that needs a changed request) is `Ok`, whatever its status; `Err` means the
    /// server never gave one. The wait before each retry is the jittered backoff, or what
    /// `Retry-After` asks for (at most the policy's `max_retry_after`) when the response has
    /// one.
    ///
    /// # Errors
    ///
    /// - [`Error::Build`] when the request cannot be built (an unparsable URL); nothing is sent.
    /// - [`Error::Transport`] when the last attempt got no response (a failed, dropped or
    ///   timed-out connection).
    /// - [`Error::Status`] when the last attempt's response still asked for a retry (`429`,
    ///   `5xx`, a key in use).
    ///
    /// The last two say why retrying stopped: the attempt limit or the retry budget.
    ///
    /// # Panics
    ///
    /// Never: the request's body is bytes, so each attempt's copy can always be made.
    pub async fn send(&self, intent: &Intent) -> Result<Answer, Error> {
        let request = self.build(intent)?;
        let mut delays = self.policy.delays(self.fork_rng());
        let mut attempts = 0;
        loop {
            attempts += 1;
            let attempt = request
                .try_clone()
                .expect("a request with a body of bytes can always be cloned");
            let failure = match self.attempt(attempt).await {
                Ok((status, headers, body)) => {
                    let answer = Answer {
                        status,
                        replayed: is_replay(&headers),
                        headers,
                        body,
                        attempts,
                        key: intent.key.clone(),
                    };
                    if !is_retryable(answer.status, &answer.headers, &answer.body) {
                        self.budget.earn();
                        return Ok(answer);
                    }
                    Failure::Status(answer)
                }
                // A request that cannot be built will not build on a retry either.
                Err(e) if e.is_builder() => return Err(Error::Build(e)),
                Err(e) => Failure::Transport(e),
            };

            // The delay is drawn even when Retry-After overrides it, so that retry n always
            // gets the n-th ceiling.
            let Some(jittered) = delays.next() else {
                return Err(failure.into_error(attempts, Stop::AttemptLimit));
            };
            if !self.budget.try_spend() {
                return Err(failure.into_error(attempts, Stop::BudgetExhausted));
            }
            let wait = match &failure {
                Failure::Status(answer) => retry_after(&answer.headers, self.clock.now())
                    .map(|asked| asked.min(self.policy.max_retry_after)),
                Failure::Transport(_) => None,
            }
            .unwrap_or(jittered);
            tracing::debug!(attempt = attempts, ?wait, failure = %failure, "retrying");
            self.sleeper.sleep(wait).await;
        }
    }

    fn build(&self, intent: &Intent) -> Result<reqwest::Request, Error> {
        let mut headers = intent.headers.clone();
        if let Some(key) = &intent.key {
            // Display is the sf-string form; a validated key is visible ASCII, so always a
            // valid header value.
            let value =
                HeaderValue::try_from(key.to_string()).expect("a validated key is visible ASCII");
            headers.insert(IDEMPOTENCY_KEY, value);
        }
        let mut builder = self
            .http
            .request(intent.method.clone(), intent.url.as_str())
            .headers(headers)
            .timeout(self.policy.attempt_timeout);
        if !intent.body.is_empty() {
            builder = builder.body(intent.body.clone());
        }
        builder.build().map_err(Error::Build)
    }

    async fn attempt(
        &self,
        request: reqwest::Request,
    ) -> Result<(StatusCode, HeaderMap, Bytes), reqwest::Error> {
        let response = self.http.execute(request).await?;
        let status = response.status();
        let headers = response.headers().clone();
        // The whole body is part of the attempt: a connection cut mid-body is a lost answer,
        // retried like any other.
        let body = response.bytes().await?;
        Ok((status, headers, body))
    }

    /// An RNG of the intent's own, seeded from the shared one: the intent draws its waits
    /// without holding a lock across its awaits.
    fn fork_rng(&self) -> StdRng {
        let mut shared = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        StdRng::from_rng(&mut *shared)
    }
}

/// The server's final answer to an intent.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Answer {
    /// The status of the last attempt.
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body, whole.
    pub body: Bytes,
    /// Whether the server replayed a stored response (`Idempotent-Replayed: true`) rather
    /// than doing the work on this attempt.
    pub replayed: bool,
    /// Attempts it took, the first one included.
    pub attempts: u32,
    /// The key every attempt carried, if any.
    pub key: Option<IdempotencyKey>,
}

fn is_replay(headers: &HeaderMap) -> bool {
    headers
        .get(IDEMPOTENT_REPLAYED)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

/// What an attempt that will be retried got.
enum Failure {
    Status(Answer),
    Transport(reqwest::Error),
}

impl Failure {
    fn into_error(self, attempts: u32, stop: Stop) -> Error {
        match self {
            Self::Status(answer) => Error::Status {
                stop,
                last: Box::new(answer),
            },
            Self::Transport(source) => Error::Transport {
                attempts,
                stop,
                source,
            },
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Status(answer) => write!(f, "HTTP {}", answer.status),
            Self::Transport(e) => write!(f, "{e}"),
        }
    }
}
