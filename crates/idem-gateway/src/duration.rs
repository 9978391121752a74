//! Durations as the gateway reads and writes them (`500ms`, `10s`, `30m`, `24h`, `7d`), one
//! parser and one printer for the configuration file and the flags alike.

use std::time::Duration;

/// A text that is not a duration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a duration (a whole number above zero and ms, s, m, h or d, such as 500ms, 10s, 30m, 24h or 7d)"
)]
pub(crate) struct DurationError(String);

/// `500ms`, `10s`, `30m`, `24h`, `7d`: every duration the gateway reads, from the file
/// (`retention`, an `in_flight` wait) or a flag (`--in-flight`). Zero is refused: a retention
/// of nothing stores nothing, and a wait of nothing is a `409` that pretends otherwise.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let bad = || DurationError(s.to_owned());
    let split = s.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (number, unit) = s.split_at(split);
    let n: u64 = number.parse().map_err(|_| bad())?;
    let ms = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    n.checked_mul(ms)
        .map(Duration::from_millis)
        .filter(|d| !d.is_zero())
        .ok_or_else(bad)
}

/// A duration as the gateway writes it, in the form [`parse_duration`] reads: the largest unit
/// up to hours that divides it (`24h` reads better than `1d`).
pub(crate) fn display_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [("h", 3_600_000), ("m", 60_000), ("s", 1000)] {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_and_print_alike() {
        for (text, d) in [
            ("500ms", Duration::from_millis(500)),
            ("10s", Duration::from_secs(10)),
            ("30m", Duration::from_secs(1800)),
            ("24h", Duration::from_secs(86_400)),
        ] {
            assert_eq!(parse_duration(text), Ok(d));
            assert_eq!(display_duration(d), text);
        }
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(display_duration(Duration::from_secs(7 * 86_400)), "168h");
        for bad in ["", "10", "h", "1.5h", "-1s", "10 s", "10S", "0s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
