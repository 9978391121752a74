//! Child processes the harness starts (`idem serve` for the memory workload, the peers): each
//! listens on a free loopback port, runs quietly, and is waited for until it answers.

use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

/// A free port on 127.0.0.1, for a child process to listen on.
pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts `command` with no input and its output thrown away; the child is killed when
/// dropped, so none outlives the harness.
pub(crate) fn spawn_quiet(command: &mut Command) -> std::io::Result<Child> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
}

/// Waits until `url` answers; fails at once if the child (`name` in the message) exits first.
pub(crate) async fn wait_until_up(child: &mut Child, url: &str, name: &str) -> anyhow::Result<()> {
    tokio::select! {
        up = crate::load::wait_until_up(url, Duration::from_secs(30)) => up,
        status = child.wait() => Err(anyhow::anyhow!("{name} exited at start: {}", status?)),
    }
}
