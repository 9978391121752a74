//! What both chaos runs (`chaos` and `gateway_chaos`) share around their load and schedule:
//! the settings from the environment, the run's directory, and its failures' summary.

use std::path::{Path, PathBuf};
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

    /// A new directory for the run's logs, named `prefix…`. It is kept unless the run passes
    /// ([`Settings::passed`]): a failed run leaves its evidence behind.
    pub(crate) fn new_dir(prefix: &str) -> PathBuf {
        tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .expect("temp dir")
            .keep()
    }

    /// The run passed: its directory goes, unless `IDEM_CHAOS_KEEP` keeps it.
    pub(crate) fn passed(&self, dir: &Path) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The first twenty failures, a line each, for the run's assertion.
pub(crate) fn first_failures(failures: &[String]) -> String {
    failures
        .iter()
        .take(20)
        .cloned()
        .collect::<Vec<_>>()
        .join("\n")
}
