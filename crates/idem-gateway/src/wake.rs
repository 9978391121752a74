//! What a duplicate gets while the first request with its key is still at the upstream
//! ([`InFlight`]), and the [`outcome_signal`] that wakes the duplicates that wait, on whichever
//! gateway sharing the store they arrived.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use idem_store::OutcomeChannel;
use idem_tower::OutcomeSignal;

use crate::duration::{DurationError, display_duration, parse_duration};

/// What a duplicate gets while the first request with its key is still at the upstream
/// (`in_flight = "409"` or `"wait 10s"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InFlight {
    /// `409` with `Retry-After` at once (default).
    #[default]
    Refuse,
    /// Waits up to this long for the first request's outcome, then gets its replay; `409`
    /// with `Retry-After` if the wait runs out first. The wait ends when
    /// [`GatewayConfig::outcome_signal`](crate::GatewayConfig::outcome_signal) says the outcome
    /// is stored, never by polling the store: gateways that share a store need the store's
    /// signal ([`outcome_signal`]).
    Wait(Duration),
}

/// Why a text is not an [`InFlight`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(transparent)]
pub struct InFlightError(Refusal);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Refusal {
    /// Neither `409` nor `wait` and one word.
    #[error("expected \"409\" or \"wait DURATION\" (such as \"wait 10s\"), not {0:?}")]
    Shape(String),
    /// `wait` and a word that is not a duration.
    #[error(transparent)]
    Duration(#[from] DurationError),
    #[error(
        "wait {}: a duplicate waits at most {} (it holds its connection while it waits)",
        display_duration(*.0),
        display_duration(InFlight::MAX_WAIT)
    )]
    /// A wait past [`InFlight::MAX_WAIT`].
    TooLong(Duration),
}

impl FromStr for InFlight {
    type Err = InFlightError;

    /// `409`, or `wait` and a duration of the gateway's (`wait 500ms`, `wait 10s`, `wait 1m`)
    /// up to [`InFlight::MAX_WAIT`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut words = s.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("409"), None, None) => Ok(InFlight::Refuse),
            (Some("wait"), Some(duration), None) => {
                let wait = parse_duration(duration).map_err(|e| InFlightError(e.into()))?;
                if wait > Self::MAX_WAIT {
                    return Err(InFlightError(Refusal::TooLong(wait)));
                }
                Ok(InFlight::Wait(wait))
            }
            _ => Err(InFlightError(Refusal::Shape(s.to_owned()))),
        }
    }
}

impl InFlight {
    /// The longest wait: how long a claim is held with the gateway's defaults (the 30 s lease
    /// plus the 30 s upstream timeout). A waiting duplicate holds its connection, and once the
    /// original's claim has run out nothing is left to wake it: a longer wait would only hold
    /// the connection longer for the same `409`.
    pub const MAX_WAIT: Duration = Duration::from_secs(60);

    /// How the published policy puts a wait; `None` for [`InFlight::Refuse`], which the
    /// policy's own `in_flight` text already says.
    pub(crate) fn published(self) -> Option<String> {
        match self {
            InFlight::Refuse => None,
            InFlight::Wait(wait) => Some(format!(
                "the duplicate waits up to {} for the original's outcome, then replays it; past the wait 409 application/problem+json with Retry-After",
                display_duration(wait)
            )),
        }
    }
}

impl fmt::Display for InFlight {
    /// The form [`FromStr`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InFlight::Refuse => f.write_str("409"),
            InFlight::Wait(wait) => write!(f, "wait {}", display_duration(*wait)),
        }
    }
}

/// The signal that wakes duplicates waiting on any gateway that shares `store`:
/// [`OutcomeSignal::for_store`], the same wiring a layer's
/// [`with_outcome_wait`](idem_tower::IdempotencyLayer::with_outcome_wait) makes by itself. The
/// gateway makes it once and hands it to every route's layer, so its routes share one
/// listener.
///
/// # Errors
///
/// The store's error (such as [`idem_store::Error::Unavailable`]) when the listener cannot
/// start.
pub async fn outcome_signal<St: OutcomeChannel>(
    store: &St,
) -> Result<OutcomeSignal, idem_store::Error> {
    OutcomeSignal::for_store(store).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(s: &str) -> Result<InFlight, InFlightError> {
        s.parse()
    }

    #[test]
    fn in_flight_reads_409_and_waits() {
        assert_eq!(read("409"), Ok(InFlight::Refuse));
        assert_eq!(
            read("wait 10s"),
            Ok(InFlight::Wait(Duration::from_secs(10)))
        );
        assert_eq!(
            read(" wait   250ms "),
            Ok(InFlight::Wait(Duration::from_millis(250)))
        );
        assert_eq!(read("wait 1m"), Ok(InFlight::Wait(InFlight::MAX_WAIT)));
        for bad in ["", "410", "wait", "wait 10 s", "409 wait 1s", "sleep 1s"] {
            assert_eq!(
                read(bad),
                Err(InFlightError(Refusal::Shape(bad.to_owned()))),
                "{bad:?}"
            );
        }
        // The durations of the file: a whole number above zero and a unit.
        for bad in [
            "wait 0s",
            "wait 10",
            "wait s",
            "wait -1s",
            "wait 1.5s",
            "wait ten",
        ] {
            assert!(
                matches!(read(bad), Err(InFlightError(Refusal::Duration(_)))),
                "{bad:?}: {:?}",
                read(bad)
            );
        }
    }

    /// The flag and the file read one parser, so they refuse the same waits: the units past
    /// minutes are durations, but no wait may be that long.
    #[test]
    fn a_wait_past_the_longest_is_refused() {
        for duration in ["61s", "60001ms", "2m", "1h", "1d"] {
            let wait = parse_duration(duration).unwrap();
            let refused = read(&format!("wait {duration}")).unwrap_err();
            assert_eq!(refused, InFlightError(Refusal::TooLong(wait)), "{duration}");
            assert!(
                refused.to_string().contains("waits at most 1m"),
                "{duration}: {refused}"
            );
        }
    }

    #[test]
    fn in_flight_writes_what_it_reads() {
        for text in [
            "409",
            "wait 250ms",
            "wait 10s",
            "wait 1m",
            "wait 45s",
            "wait 1500ms",
        ] {
            assert_eq!(read(text).unwrap().to_string(), text);
        }
        assert_eq!(InFlight::default(), InFlight::Refuse);
    }
}
