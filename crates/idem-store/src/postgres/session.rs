//! Whether the store's connections are PostgreSQL sessions of their own, or lent a session per
//! transaction by a pooler (PgBouncer in transaction mode), and the deadlines of every
//! statement.
//!
//! Behind such a pooler no state may outlive a transaction: a statement prepared under a name
//! stays on a server session that the next transaction may not get (`prepared statement
//! "sqlx_s_1" does not exist`) while another client's statement of the same name lands on it
//! (`… already exists`); a `SET` or a `LISTEN` stays on a session someone else gets next. So
//! the store asks, once when it connects: it opens one connection whose startup packet sets a
//! marker (`-c idem.session=direct`, PostgreSQL's `options`) and reads the marker back. A
//! session of its own carries it (through a plain TCP relay too); a pooler refuses the
//! `options` parameter (PgBouncer's default) or drops it (`ignore_startup_parameters`), and
//! then the store assumes nothing of any session.
//!
//! Where sessions are the store's own, statements are prepared once per connection and cached
//! (sqlx's default: one round trip each), and the timeouts ride in every connection's startup
//! packet, costing no round trip at all. Behind a pooler statements are unnamed (sqlx then
//! prepares each before it runs it: a round trip more per statement), and the timeouts are
//! the server's (`ALTER ROLE … SET statement_timeout`) outside the store's own transactions,
//! which set theirs with `SET LOCAL` in the message that opens them.

use std::time::Duration;

use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection};

/// How long PostgreSQL lets one statement of the store run (`statement_timeout`) before it
/// cancels it, unless the URL's `options` set one.
pub(crate) const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a statement of the store may wait for a lock (`lock_timeout`), unless the URL's
/// `options` set one. The claim in a transaction bounds its own wait with the caller's.
pub(crate) const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// How much longer than [`STATEMENT_TIMEOUT`] the store waits for an answer before it gives up
/// on the database: past it, a live server would have cancelled the statement and said so, so
/// the silence is the network's (a black hole, a dead host that sent no reset).
pub(crate) const ANSWER_MARGIN: Duration = Duration::from_secs(1);

/// The marker a session of the store's own carries.
const MARKER: (&str, &str) = ("idem.session", "direct");

/// How the store's connections reach sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sessions {
    /// Each connection is a server session of its own, for as long as it is open.
    Direct,
    /// A pooler lends a session per transaction: nothing may outlive one.
    Pooled,
}

/// Asks which [`Sessions`] `given` leads to (module docs); returns them with the options every
/// connection of the store is to use: with the marker and the timeouts on direct sessions, as
/// given otherwise, and in both cases without the startup parameters a pooler refuses.
pub(crate) async fn settle(
    given: PgConnectOptions,
) -> Result<(PgConnectOptions, Sessions), sqlx::Error> {
    let plain = without_refused_parameters(given);
    let marked = with_session_settings(plain.clone());
    match PgConnection::connect_with(&marked).await {
        Ok(mut conn) => {
            // A simple query: nothing prepared, one round trip, safe on any session.
            let row = sqlx::raw_sql("SELECT current_setting('idem.session', true)")
                .fetch_one(&mut conn)
                .await?;
            let marker: Option<String> = sqlx::Row::try_get(&row, 0)?;
            let _ = conn.close().await;
            if marker.as_deref() == Some(MARKER.1) {
                Ok((marked, Sessions::Direct))
            } else {
                log_pooled();
                Ok((plain, Sessions::Pooled))
            }
        }
        Err(refused) => {
            // Refused for the startup parameter, or not reachable at all: a plain connection
            // tells which.
            let conn = PgConnection::connect_with(&plain).await?;
            let _ = conn.close().await;
            tracing::debug!(error = %refused, "a connection with startup options was refused");
            log_pooled();
            Ok((plain, Sessions::Pooled))
        }
    }
}

fn log_pooled() {
    tracing::info!(
        "PostgreSQL is reached through a pooler that lends sessions per transaction \
         (PgBouncer in transaction mode): statements are unnamed, and the server's own \
         statement_timeout and lock_timeout apply outside idem's transactions"
    );
}

/// `options` without the startup parameters PgBouncer refuses by default: sqlx's
/// `extra_float_digits` (PostgreSQL 12 and later print floats exactly without it, and the
/// store reads none in text).
pub(crate) fn without_refused_parameters(options: PgConnectOptions) -> PgConnectOptions {
    options.extra_float_digits(None)
}

/// `options` with the session marker and, unless the URL's `options` already name them, the
/// store's statement and lock timeouts.
pub(crate) fn with_session_settings(options: PgConnectOptions) -> PgConnectOptions {
    let given = options.get_options().unwrap_or_default().to_owned();
    options.options(settings(&given))
}

/// The `options` startup parameter of a direct session, as tokio-postgres takes it: `given`
/// (the URL's) with the session settings after it.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn options_text(given: Option<&str>) -> String {
    let given = given.unwrap_or_default();
    let mut text = given.to_owned();
    for (name, value) in settings(given) {
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(&format!("-c {name}={value}"));
    }
    text
}

/// The marker, and the timeouts that `given` (the URL's `options`) does not name already.
fn settings(given: &str) -> Vec<(&'static str, String)> {
    let mut settings = vec![(MARKER.0, MARKER.1.to_owned())];
    for (name, value) in [
        ("statement_timeout", STATEMENT_TIMEOUT),
        ("lock_timeout", LOCK_TIMEOUT),
    ] {
        if !given.contains(name) {
            settings.push((name, milliseconds(value)));
        }
    }
    settings
}

/// A duration as PostgreSQL reads a time setting: whole milliseconds, at least one (zero would
/// mean no limit at all).
pub(crate) fn milliseconds(d: Duration) -> String {
    let ms = d.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128);
    format!("{ms}ms")
}

/// The statement that opens one of the store's transactions: `READ COMMITTED` (whatever the
/// server's default; it is what makes a blocked duplicate see the first transaction's committed
/// row once it is let through), and its timeouts set with `SET LOCAL`, which a pooler carries
/// since it ends with the transaction. Every statement in it may take `wait` more than
/// [`STATEMENT_TIMEOUT`] (the claim waits up to `wait` for a concurrent claim's transaction).
/// One simple-query message: no round trip of its own.
pub(crate) fn begin(wait: Duration) -> String {
    format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = '{}'; \
         SET LOCAL lock_timeout = '{}'",
        milliseconds(STATEMENT_TIMEOUT + wait),
        milliseconds(LOCK_TIMEOUT)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_whole_milliseconds_and_never_zero() {
        assert_eq!(milliseconds(Duration::from_secs(5)), "5000ms");
        assert_eq!(milliseconds(Duration::from_micros(1)), "1ms");
        assert_eq!(milliseconds(Duration::ZERO), "1ms");
        assert_eq!(
            begin(Duration::from_secs(10)),
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL statement_timeout = '15000ms'; \
             SET LOCAL lock_timeout = '5000ms'"
        );
    }

    #[test]
    fn the_url_s_own_timeouts_are_kept() {
        let given: PgConnectOptions = "postgres://u@h/db?options=-c%20statement_timeout%3D9s"
            .parse()
            .unwrap();
        let options = with_session_settings(given)
            .get_options()
            .unwrap()
            .to_owned();
        assert!(options.contains("statement_timeout=9s"), "{options}");
        assert!(!options.contains("statement_timeout=5000ms"), "{options}");
        assert!(options.contains("lock_timeout=5000ms"), "{options}");
        assert!(options.contains("idem.session=direct"), "{options}");
    }
}
