//! How long to wait between attempts: capped exponential backoff with full jitter.

use std::time::Duration;

use rand::Rng;

/// When and how often an intent is retried.
///
/// The wait before retry `n` (0 for the first retry) is drawn uniformly from
/// `[0, min(cap, base · 2^n)]`: the "full jitter" of AWS's backoff study, which spreads a crowd
/// of failed clients over the whole window instead of sending them back together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The ceiling of the first retry's wait (default 100 ms).
    pub base: Duration,
    /// No wait's ceiling grows past this (default 10 s).
    pub cap: Duration,
    /// Attempts in all, the first one included (default 5; `21` means 20 retries). `0` is
    /// taken as `1`: an intent is always tried once.
    pub max_attempts: u32,
    /// How long one attempt may take, from connecting to the last byte of the response body
    /// (default 30 s). An attempt that runs out is retried like any other lost answer.
    pub attempt_timeout: Duration,
    /// The longest wait a `Retry-After` header can impose (default 60 s). A longer one is
    /// shortened to this rather than obeyed, so one header cannot park a caller for an hour;
    /// the retry may then meet the same refusal and spend an attempt.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(10),
            max_attempts: 5,
            attempt_timeout: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The longest wait before retry `retry` (0-based): `min(cap, base · 2^retry)`, saturating
    /// at `cap` where the product would overflow.
    pub fn ceiling(&self, retry: u32) -> Duration {
        2u32.checked_pow(retry)
            .and_then(|factor| self.base.checked_mul(factor))
            .map_or(self.cap, |d| d.min(self.cap))
    }

    /// The jittered waits before each retry this policy allows, in order: `max_attempts - 1`
    /// of them. A pure function of the policy and `rng`, so a seeded RNG gives the same waits
    /// every run.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_client::RetryPolicy;
    /// use rand::{SeedableRng, rngs::StdRng};
    ///
    /// let policy = RetryPolicy { max_attempts: 4, ..RetryPolicy::default() };
    /// let waits: Vec<Duration> = policy.delays(StdRng::seed_from_u64(42)).collect();
    /// assert_eq!(waits.len(), 3);
    /// assert!(waits.iter().enumerate().all(|(n, w)| *w <= policy.ceiling(n as u32)));
    /// ```
    pub fn delays<R: Rng>(&self, rng: R) -> Delays<R> {
        Delays {
            policy: self.clone(),
            rng,
            retry: 0,
        }
    }

    /// The attempt limit, never below one.
    pub(crate) fn attempts(&self) -> u32 {
        self.max_attempts.max(1)
    }
}

/// The waits before each retry, from [`RetryPolicy::delays`].
#[derive(Debug, Clone)]
pub struct Delays<R> {
    policy: RetryPolicy,
    rng: R,
    retry: u32,
}

impl<R: Rng> Iterator for Delays<R> {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        if self.retry + 1 >= self.policy.attempts() {
            return None;
        }
        let ceiling = self.policy.ceiling(self.retry);
        self.retry += 1;
        // Whole nanoseconds keep the draw exact and inclusive of the ceiling; 2^64 ns is five
        // centuries, so the clamp never bites a sane policy.
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Some(Duration::from_nanos(self.rng.random_range(0..=nanos)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
            max_attempts: 8,
            ..RetryPolicy::default()
        }
    }

    #[test]
    fn ceilings_double_then_stop_at_the_cap() {
        let p = policy();
        let ceilings: Vec<u64> = (0..6).map(|n| p.ceiling(n).as_millis() as u64).collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn ceiling_saturates_instead_of_overflowing() {
        let p = RetryPolicy {
            base: Duration::from_secs(u64::MAX / 2),
            cap: Duration::from_secs(30),
            ..RetryPolicy::default()
        };
        assert_eq!(p.ceiling(1), Duration::from_secs(30));
        assert_eq!(p.ceiling(40), Duration::from_secs(30));
        assert_eq!(p.ceiling(u32::MAX), Duration::from_secs(30));
    }

    #[test]
    fn one_wait_per_retry_each_within_its_ceiling() {
        let p = policy();
        for seed in 0..200 {
            let waits: Vec<Duration> = p.delays(StdRng::seed_from_u64(seed)).collect();
            assert_eq!(waits.len(), 7);
            for (n, wait) in waits.iter().enumerate() {
                assert!(
                    *wait <= p.ceiling(n as u32),
                    "seed {seed}, retry {n}: {wait:?}"
                );
            }
        }
    }

    #[test]
    fn waits_spread_over_the_whole_window() {
        // Full jitter, not "ceiling plus a little": over many draws the first wait covers both
        // halves of [0, base].
        let p = policy();
        let firsts: Vec<Duration> = (0..500)
            .filter_map(|seed| p.delays(StdRng::seed_from_u64(seed)).next())
            .collect();
        let half = p.base / 2;
        assert!(firsts.iter().any(|w| *w < half / 5));
        assert!(firsts.iter().any(|w| *w > half + half * 4 / 5));
    }

    #[test]
    fn the_same_seed_gives_the_same_waits() {
        let p = policy();
        let a: Vec<Duration> = p.delays(StdRng::seed_from_u64(42)).collect();
        let b: Vec<Duration> = p.delays(StdRng::seed_from_u64(42)).collect();
        let c: Vec<Duration> = p.delays(StdRng::seed_from_u64(43)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn one_attempt_means_no_retries_and_zero_means_one() {
        for max_attempts in [0, 1] {
            let p = RetryPolicy {
                max_attempts,
                ..policy()
            };
            assert_eq!(p.attempts(), 1);
            assert_eq!(p.delays(StdRng::seed_from_u64(1)).count(), 0);
        }
    }
}
