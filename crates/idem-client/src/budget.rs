//! A retry budget: a token bucket shared by every intent of a client, so a struggling server
//! meets a trickle of retries instead of a storm.

use std::sync::{Arc, Mutex, PoisonError};

/// Tokens that retries spend and answers earn back, shared by the clones of one budget.
///
/// Each retry takes one token; each intent that ends with an answer the server gave for good
/// (anything not retried: a success, a 4xx) puts back `earned_per_answer`, up to the bucket's
/// size. When fewer than one token is left, intents stop retrying and return what their last
/// attempt got. The idea is gRPC's retry throttling and Finagle's `RetryBudget`: while the
/// server answers, retries stay cheap; once most attempts fail, retries are limited to a
/// fixed fraction of the traffic that still gets through.
#[derive(Debug, Clone)]
pub struct RetryBudget(Arc<Mutex<Bucket>>);

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    max_tokens: f64,
    earned_per_answer: f64,
}

impl Default for RetryBudget {
    /// 10 retries in hand, and one more earned by every five answers (20 %).
    fn default() -> Self {
        Self::new(10, 0.2)
    }
}

impl RetryBudget {
    /// A full bucket of `max_retries` tokens, refilled by `earned_per_answer` (a fraction,
    /// clamped to be at least zero) for each intent that ends with a final answer.
    pub fn new(max_retries: u32, earned_per_answer: f64) -> Self {
        let max_tokens = f64::from(max_retries);
        Self(Arc::new(Mutex::new(Bucket {
            tokens: max_tokens,
            max_tokens,
            earned_per_answer: earned_per_answer.max(0.0),
        })))
    }

    /// A budget that never runs out, for callers (such as a simulator) whose point is to retry
    /// every intent up to its attempt limit.
    pub fn unlimited() -> Self {
        Self(Arc::new(Mutex::new(Bucket {
            tokens: f64::INFINITY,
            max_tokens: f64::INFINITY,
            earned_per_answer: 0.0,
        })))
    }

    /// The tokens left: how many retries may still start.
    pub fn remaining(&self) -> f64 {
        self.bucket(|b| b.tokens)
    }

    /// Takes one token for a retry; `false` when there is none.
    pub(crate) fn try_spend(&self) -> bool {
        self.bucket(|b| {
            if b.tokens >= 1.0 {
                b.tokens -= 1.0;
                true
            } else {
                false
            }
        })
    }

    /// Puts back the share one final answer earns.
    pub(crate) fn earn(&self) {
        self.bucket(|b| b.tokens = (b.tokens + b.earned_per_answer).min(b.max_tokens));
    }

    fn bucket<T>(&self, f: impl FnOnce(&mut Bucket) -> T) -> T {
        // A std Mutex: the section is a few arithmetic operations and never awaits. A panic
        // elsewhere cannot leave the numbers half-written, so a poisoned lock is still usable.
        let mut bucket = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut bucket)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_spend_tokens_until_the_bucket_is_empty() {
        let budget = RetryBudget::new(2, 0.5);
        assert!(budget.try_spend());
        assert!(budget.try_spend());
        assert!(!budget.try_spend());
        assert_eq!(budget.remaining(), 0.0);
    }

    #[test]
    fn answers_earn_a_fraction_back_up_to_the_size() {
        let budget = RetryBudget::new(2, 0.5);
        budget.try_spend();
        budget.try_spend();
        budget.earn();
        assert!(!budget.try_spend(), "half a token is not a retry");
        budget.earn();
        assert!(budget.try_spend());
        for _ in 0..10 {
            budget.earn();
        }
        assert_eq!(budget.remaining(), 2.0);
    }

    #[test]
    fn clones_share_one_bucket() {
        let a = RetryBudget::new(1, 0.0);
        let b = a.clone();
        assert!(a.try_spend());
        assert!(!b.try_spend());
    }

    #[test]
    fn unlimited_never_runs_out() {
        let budget = RetryBudget::unlimited();
        assert!((0..10_000).all(|_| budget.try_spend()));
        budget.earn();
        assert!(budget.try_spend());
    }

    #[test]
    fn a_negative_share_earns_nothing() {
        let budget = RetryBudget::new(1, -3.0);
        budget.earn();
        assert_eq!(budget.remaining(), 1.0);
    }
}
