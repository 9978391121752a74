//! [`ErrorChain`]: an error and its sources on one line, for logs.

use std::fmt;

/// Displays an error with its sources, `a: b: c`, each cause once. Every idem error names its
/// own layer only (the cause is a `#[source]`, never also in the message); errors of other
/// crates may not (sqlx's `error returned from database: {0}` is also the source of its cause),
/// so a cause whose text the last message printed already holds is left out.
///
/// ```
/// use idem_core::ErrorChain;
/// let e = std::io::Error::other("connection reset");
/// tracing_free_log(&format!("relay failed: {}", ErrorChain(&e)));
/// # fn tracing_free_log(_: &str) {}
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut last = self.0.to_string();
        f.write_str(&last)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            let text = e.to_string();
            if !last.contains(&text) {
                write!(f, ": {text}")?;
                last = text;
            }
            source = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("publishing evt_1 failed")]
    struct Outer(#[source] std::io::Error);

    /// As sqlx's errors are made: the cause both in the message and as the source.
    #[derive(Debug, thiserror::Error)]
    #[error("error returned from database: {0}")]
    struct Repeating(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("migrating failed")]
    struct Ours(#[source] Repeating);

    #[test]
    fn a_cause_another_crate_repeats_is_printed_once() {
        let e = Ours(Repeating(std::io::Error::other(
            r#"prepared statement "sqlx_s_1" already exists"#,
        )));
        assert_eq!(
            ErrorChain(&e).to_string(),
            r#"migrating failed: error returned from database: prepared statement "sqlx_s_1" already exists"#
        );
    }

    #[test]
    fn each_cause_once_in_order() {
        let e = Outer(std::io::Error::other("broker gone"));
        assert_eq!(
            ErrorChain(&e).to_string(),
            "publishing evt_1 failed: broker gone"
        );
    }
}
