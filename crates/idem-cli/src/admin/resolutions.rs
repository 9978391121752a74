//! The resolutions made through this process's admin API (`GET /admin/resolutions`), kept in
//! memory for the console's history of a record. A store keeps no history of a record, only
//! its latest state, so resolutions made with `idem keys` or through another instance's admin
//! API show only as their effect on the record; these are lost when the process stops.

use std::collections::VecDeque;
use std::sync::Mutex;

use idem_core::{Scope, Timestamp};
use serde_json::{Value, json};

use super::Resolved;

/// How many resolutions are kept: an operator's work of a long while, in little memory.
const KEPT: usize = 1000;

/// One resolution that succeeded.
#[derive(Debug, Clone)]
struct Entry {
    at: Timestamp,
    account: String,
    key: String,
    resolved: Resolved,
    /// The stored answer's status, for a completion.
    status: Option<u16>,
}

/// The log, newest last, bounded to [`KEPT`].
#[derive(Debug, Default)]
pub(crate) struct ResolutionLog {
    // A std Mutex: held for a push or a copy, never across an await.
    entries: Mutex<VecDeque<Entry>>,
}

impl ResolutionLog {
    /// Notes that `scope` was resolved at `at`.
    pub(crate) fn record(
        &self,
        at: Timestamp,
        scope: &Scope,
        resolved: Resolved,
        status: Option<u16>,
    ) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() == KEPT {
            entries.pop_front();
        }
        entries.push_back(Entry {
            at,
            account: scope.account.as_str().to_owned(),
            key: scope.key.as_str().to_owned(),
            resolved,
            status,
        });
    }

    /// The resolutions of `scope` (all of them when `None`), newest first.
    pub(crate) fn to_json(&self, scope: Option<&Scope>) -> Value {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let shown: Vec<Value> = entries
            .iter()
            .rev()
            .filter(|e| {
                scope.is_none_or(|s| e.account == s.account.as_str() && e.key == s.key.as_str())
            })
            .map(|e| {
                json!({
                    "at_ms": e.at.0,
                    "account": e.account,
                    "key": e.key,
                    "resolved": e.resolved.name(),
                    "status": e.status,
                    "by": "the admin API of this process",
                })
            })
            .collect();
        json!({ "resolutions": shown })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_is_per_key_newest_first_and_bounded() {
        let log = ResolutionLog::default();
        let one = crate::admin::scope("acct_a", "key-0001").unwrap();
        let two = crate::admin::scope("acct_a", "key-0002").unwrap();
        log.record(Timestamp(1), &one, Resolved::Completed, Some(201));
        log.record(Timestamp(2), &two, Resolved::Released, None);
        let shown = log.to_json(Some(&one));
        assert_eq!(
            shown["resolutions"],
            json!([{"at_ms": 1, "account": "acct_a", "key": "key-0001", "resolved": "completed",
                    "status": 201, "by": "the admin API of this process"}])
        );
        // Typed as the sf-string, the same key.
        let quoted = crate::admin::scope("acct_a", "\"key-0002\"").unwrap();
        assert_eq!(
            log.to_json(Some(&quoted))["resolutions"][0]["resolved"],
            "released"
        );
        for i in 0..KEPT as i64 {
            log.record(Timestamp(10 + i), &two, Resolved::Released, None);
        }
        let all = log.to_json(None);
        assert_eq!(all["resolutions"].as_array().unwrap().len(), KEPT);
        assert!(
            log.to_json(Some(&one))["resolutions"]
                .as_array()
                .unwrap()
                .is_empty()
        );
    }
}
