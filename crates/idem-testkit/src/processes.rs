//! What the throwaway clusters share: waiting for a state they announce to no one, and stopping
//! a node's process by its PID.

use std::process::Child;
use std::time::{Duration, Instant};

/// How long a cluster may take to form, or to elect or promote after a node died.
const SETTLE_WITHIN: Duration = Duration::from_secs(30);

/// Polls `done` every 50 ms (a cluster announces nothing one could await) until it holds;
/// panics naming `what` after [`SETTLE_WITHIN`].
pub(crate) fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < SETTLE_WITHIN,
            "waited {SETTLE_WITHIN:?} for: {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills a node's process with SIGKILL, as a crash would, and reaps it; nothing if it is not
/// running.
pub(crate) fn kill(process: &mut Option<Child>) {
    if let Some(mut process) = process.take() {
        let _ = process.kill();
        let _ = process.wait();
    }
}
