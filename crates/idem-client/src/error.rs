//! How an intent can end without a final answer.

use std::fmt;

use crate::Answer;

/// Why an intent ended without an answer the caller can act on.
///
/// Every final answer, a `422` or a declined payment included, is an [`Answer`], not an error:
/// the server decided. An error means the server never decided, or the client stopped asking.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request could not be built (an unparsable URL, say); nothing was sent.
    #[error("the request could not be built")]
    Build(#[source] reqwest::Error),
    /// The last attempt got no response: the connection failed, was dropped or timed out.
    #[error("no answer after {attempts} attempt(s): {stop}")]
    Transport {
        /// Attempts made.
        attempts: u32,
        /// Why no further attempt was made.
        stop: Stop,
        /// What went wrong on the last attempt.
        #[source]
        source: reqwest::Error,
    },
    /// The last attempt got a response that asked for a retry (`429`, `5xx`, a key in use).
    #[error("still {} after {} attempt(s): {stop}", last.status, last.attempts)]
    Status {
        /// Why no further attempt was made.
        stop: Stop,
        /// The last response, with the attempt count.
        last: Box<Answer>,
    },
}

impl Error {
    /// Attempts made before giving up (zero when the request could not be built).
    pub fn attempts(&self) -> u32 {
        match self {
            Self::Build(_) => 0,
            Self::Transport { attempts, .. } => *attempts,
            Self::Status { last, .. } => last.attempts,
        }
    }
}

/// Why retrying stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The policy's `max_attempts` were made.
    AttemptLimit,
    /// The client's [`RetryBudget`](crate::RetryBudget) had no token left.
    BudgetExhausted,
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::AttemptLimit => "attempt limit reached",
            Self::BudgetExhausted => "retry budget exhausted",
        })
    }
}
