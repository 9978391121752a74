//! What a duplicate gets while the first request with its key is still at the upstream
//! ([`InFlight`]), and the [`outcome_signal`] that wakes the duplicates that wait, on whichever
//! gateway sharing the store they arrived.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idem_store::OutcomeChannel;
use idem_tower::OutcomeSignal;

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
#[error(
    "expected 409 or \"wait DURATION\" with a whole number of ms, s or m above zero (such as \"wait 10s\"), not {0:?}"
)]
pub struct InFlightError(String);

impl FromStr for InFlight {
    type Err = InFlightError;

    /// `409`, or `wait` and a duration: `wait 500ms`, `wait 10s`, `wait 2m`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let refused = || InFlightError(s.to_owned());
        let mut words = s.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("409"), None, None) => Ok(InFlight::Refuse),
            (Some("wait"), Some(duration), None) => {
                let digits = duration
                    .find(|c: char| !c.is_ascii_digit())
                    .ok_or_else(refused)?;
                let amount: u64 = duration[..digits].parse().map_err(|_| refused())?;
                let wait = match &duration[digits..] {
                    "ms" => Duration::from_millis(amount),
                    "s" => Duration::from_secs(amount),
                    "m" => Duration::from_secs(amount.checked_mul(60).ok_or_else(refused)?),
                    _ => return Err(refused()),
                };
                // A wait of nothing is a 409 that pretends otherwise.
                if wait.is_zero() {
                    return Err(refused());
                }
                Ok(InFlight::Wait(wait))
            }
            _ => Err(refused()),
        }
    }
}

impl InFlight {
    /// How the published policy puts a wait; `None` for [`InFlight::Refuse`], which the
    /// policy's own `in_flight` text already says.
    pub(crate) fn published(self) -> Option<String> {
        match self {
            InFlight::Refuse => None,
            InFlight::Wait(wait) => Some(format!(
                "the duplicate waits up to {} for the original's outcome, then replays it; past the wait 409 application/problem+json with Retry-After",
                DurationText(wait)
            )),
        }
    }
}

impl fmt::Display for InFlight {
    /// The form [`FromStr`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InFlight::Refuse => f.write_str("409"),
            InFlight::Wait(wait) => write!(f, "wait {}", DurationText(*wait)),
        }
    }
}

/// A duration as `wait` takes it, in the largest unit that is exact (to the millisecond).
struct DurationText(Duration);

impl fmt::Display for DurationText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms.is_multiple_of(60_000) {
            write!(f, "{}m", ms / 60_000)
        } else if ms.is_multiple_of(1000) {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

/// The signal that wakes duplicates waiting on any gateway that shares `store`.
///
/// Each outcome this gateway stores is published through the store, in a task of its own so
/// that the request never waits for it (a failure is logged: waiters elsewhere then wait out
/// their bound). A listener, started before this returns and running for as long as the
/// runtime does, wakes this gateway's waiters whenever any gateway published. Fails only when
/// the listener cannot start (the store is unreachable).
pub async fn outcome_signal<St: OutcomeChannel>(
    store: &St,
) -> Result<OutcomeSignal, idem_store::Error> {
    let publisher = store.clone();
    let signal = OutcomeSignal::with_publisher(move |label| {
        let (store, label) = (publisher.clone(), label.to_owned());
        tokio::spawn(async move {
            if let Err(e) = store.publish_outcome(&label).await {
                tracing::warn!(error = &e as &dyn std::error::Error, key = %label, "could not publish an outcome wake-up");
            }
        });
    });
    let relay = signal.clone();
    // Detached: the listener serves the signal for the process's life.
    let _listener = store
        .listen_outcomes(Arc::new(move |label: &str| relay.wake_local(label)))
        .await?;
    Ok(signal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_reads_409_and_waits() {
        let read = |s: &str| s.parse::<InFlight>();
        assert_eq!(read("409"), Ok(InFlight::Refuse));
        assert_eq!(
            read("wait 10s"),
            Ok(InFlight::Wait(Duration::from_secs(10)))
        );
        assert_eq!(
            read(" wait   250ms "),
            Ok(InFlight::Wait(Duration::from_millis(250)))
        );
        assert_eq!(
            read("wait 2m"),
            Ok(InFlight::Wait(Duration::from_secs(120)))
        );
        for bad in [
            "",
            "410",
            "wait",
            "wait 0s",
            "wait 10",
            "wait s",
            "wait -1s",
            "wait 1.5s",
            "wait 10 s",
            "wait 10h",
            "409 wait 1s",
        ] {
            assert_eq!(read(bad), Err(InFlightError(bad.to_owned())), "{bad:?}");
        }
    }

    #[test]
    fn in_flight_writes_what_it_reads() {
        for text in [
            "409",
            "wait 250ms",
            "wait 10s",
            "wait 2m",
            "wait 90s",
            "wait 1500ms",
        ] {
            assert_eq!(text.parse::<InFlight>().unwrap().to_string(), text);
        }
        assert_eq!(InFlight::default(), InFlight::Refuse);
    }
}
