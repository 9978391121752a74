//! The settings both chaos runs (`chaos` and `gateway_chaos`) take from the environment.

use std::time::Duration;

/// A run's settings: `IDEM_CHAOS_SECS`, `IDEM_CHAOS_SEED` and `IDEM_CHAOS_KEEP`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) chaos: Duration,
    pub(crate) seed: u64,
    pub(crate) keep: bool,
}

impl Settings {
    /// The settings from the environment; `default_secs` of chaos when `IDEM_CHAOS_SECS` is not
    /// set, and a random seed when `IDEM_CHAOS_SEED` is not.
    pub(crate) fn from_env(default_secs: u64) -> Self {
        let secs = std::env::var("IDEM_CHAOS_SECS").map_or(default_secs, |s| {
            s.parse()
                .unwrap_or_else(|_| panic!("IDEM_CHAOS_SECS={s:?} is not a number of seconds"))
        });
        let seed = std::env::var("IDEM_CHAOS_SEED").map_or_else(
            |_| rand::random(),
            |s| {
                s.parse()
                    .unwrap_or_else(|_| panic!("IDEM_CHAOS_SEED={s:?} is not a u64"))
            },
        );
        Self {
            chaos: Duration::from_secs(secs),
            seed,
            keep: std::env::var_os("IDEM_CHAOS_KEEP").is_some_and(|v| !v.is_empty() && v != "0"),
        }
    }
}
