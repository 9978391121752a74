//! [`ErrorChain`]: an error and its sources on one line, for logs.

use std::fmt;

/// Displays an error with its sources, `a: b: c`. Every idem error names its own layer only
/// (the cause is a `#[source]`, never also in the message), so this prints each cause once.
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
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
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

    #[test]
    fn each_cause_once_in_order() {
        let e = Outer(std::io::Error::other("broker gone"));
        assert_eq!(
            ErrorChain(&e).to_string(),
            "publishing evt_1 failed: broker gone"
        );
    }
}
