//! [`AdminStore`] for [`RedisStore`]: what `idem keys` does on the gateway's store.
//!
//! A listing walks the sweep index with `ZSCAN` (see [Layout](RedisStore#layout)), not the
//! keyspace with `SCAN`: the index holds an entry for every record of this store and nothing
//! else, so a listing reads no other store's or application's keys, and on a cluster each
//! bucket's index is one key, routed to its node like any other, where a `SCAN` would have to
//! be sent to every primary. Both are cursors, so neither blocks Redis as `KEYS` would.

use std::time::Instant;

use idem_core::{Record, RecordEvent, Scope, StoredResponse, Timestamp};
use redis::Value;

use super::{
    Layout, MAX_TTL_MS, RedisStore, SCRIPTS, headers_json, outcome_args, record_from_fields,
};
use crate::{
    AdminStore, EVENTS_KEPT, EVENTS_RETENTION_MS, Error, RecordFilter, Result, in_caller_frame,
    millis,
};

/// How many index entries one `ZSCAN` asks for, and so about how many records one read script
/// looks at: a few hundred microseconds of Redis's time per step.
const PAGE: usize = 256;

impl AdminStore for RedisStore {
    async fn list(&self, filter: &RecordFilter, now: Timestamp) -> Result<Vec<Record>> {
        let limit = usize::try_from(filter.limit()).unwrap_or(usize::MAX);
        let mut listed = Newest::new(limit);
        let mut frame = None;
        let started = Instant::now();
        for (index, members) in self.indexes() {
            let mut cursor = 0_u64;
            loop {
                let (next, page) = self.scan(&index, cursor, &members, filter).await?;
                // The caller's now moved on by the time the listing has taken, for the
                // script's lease bound.
                let at = Timestamp(now.0.saturating_add(millis(started.elapsed())));
                self.read(&page, &members, filter, at, &mut frame, &mut listed)
                    .await?;
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(listed.records)
    }

    async fn purge(&self, scope: &Scope) -> Result<bool> {
        let (record, index) = (self.record_key(scope), self.index_key(scope));
        let events = self.events_key(scope);
        let (done, _) = self
            .run(&SCRIPTS.purge, &[&record, &index, &events], |_| {})
            .await?;
        Ok(done == Value::Int(1))
    }

    async fn force_complete(
        &self,
        scope: &Scope,
        response: &StoredResponse,
        _now: Timestamp,
    ) -> Result<bool> {
        // The retention counts from Redis's now, which is the caller's `now` in the store's
        // frame, as in `complete`.
        let headers = headers_json(response);
        let (record, index) = (self.record_key(scope), self.index_key(scope));
        let (done, confirmed) = self
            .run(&SCRIPTS.force_complete, &[&record, &index], |call| {
                outcome_args(call, response, &headers);
            })
            .await?;
        self.written(done, confirmed)
    }

    async fn record_event(&self, scope: &Scope, event: &RecordEvent) -> Result<()> {
        let entry = serde_json::json!({"at": event.at.0, "what": event.what, "by": event.by});
        let events = self.events_key(scope);
        self.run(&SCRIPTS.record_event, &[&events], |call| {
            call.arg(entry.to_string())
                .arg(EVENTS_KEPT)
                .arg(EVENTS_RETENTION_MS);
        })
        .await?;
        Ok(())
    }

    async fn events(&self, scope: &Scope) -> Result<Vec<RecordEvent>> {
        let mut range = redis::cmd("LRANGE");
        range.arg(self.events_key(scope)).arg(0).arg(-1);
        let entries: Vec<String> = self.conn.query(&range).await?;
        entries
            .iter()
            .map(|entry| {
                let unreadable =
                    || Error::Corrupt("an event of a key's history is unreadable".into());
                let entry: serde_json::Value =
                    serde_json::from_str(entry).map_err(|_| unreadable())?;
                Ok(RecordEvent {
                    at: Timestamp(entry["at"].as_i64().ok_or_else(unreadable)?),
                    what: entry["what"].as_str().ok_or_else(unreadable)?.to_owned(),
                    by: entry["by"].as_str().ok_or_else(unreadable)?.to_owned(),
                })
            })
            .collect()
    }
}

impl RedisStore {
    /// Every index of the store, each with the beginning its entries (record keys) share,
    /// up to the account's length: `{prefix}:k:`, or `{prefix}:{bN}:k:` on a cluster.
    fn indexes(&self) -> Vec<(String, String)> {
        match &self.layout {
            Layout::Single { index } => vec![(index.clone(), format!("{}:k:", self.prefix))],
            Layout::Cluster => (0..Self::CLUSTER_BUCKETS)
                .map(|b| (self.bucket_index(b), format!("{}:{{b{b}}}:k:", self.prefix)))
                .collect(),
        }
    }

    /// One step of `ZSCAN` through `index`: the next cursor, and the entries the filter may
    /// want (those of its account, in its state by their score: `+inf` while in progress).
    async fn scan(
        &self,
        index: &str,
        cursor: u64,
        members: &str,
        filter: &RecordFilter,
    ) -> Result<(u64, Vec<String>)> {
        let mut pattern = glob_escaped(members);
        if let Some(account) = &filter.account {
            let account = account.as_str();
            pattern.push_str(&glob_escaped(&format!("{}:{account}:", account.len())));
        }
        pattern.push('*');
        let mut zscan = redis::cmd("ZSCAN");
        zscan
            .arg(index)
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(PAGE);
        let (next, entries): (u64, Vec<String>) = self.conn.query(&zscan).await?;
        // Only a lease in progress can have run out.
        let in_progress = filter.in_progress.or(filter.lease_expired_by.map(|_| true));
        let wanted = entries
            .chunks_exact(2)
            .filter(|entry| in_progress.is_none_or(|p| p == (entry[1] == "inf")))
            .map(|entry| entry[0].clone())
            .collect();
        Ok((next, wanted))
    }

    /// Reads the records of `page` (entries of one index) that `filter` wants, and keeps them
    /// in `listed` if they are among its newest, their times in the caller's frame.
    ///
    /// `frame` is the first read's pair of Redis's now and the caller's `now`, and every read
    /// of a listing moves its records by that one pair. Moved by each read's own pair instead,
    /// the records of a page read later than the caller reckoned (a busy server, a slow round
    /// trip) would seem older by that delay, and a listing could put an older record first.
    async fn read(
        &self,
        page: &[String],
        members: &str,
        filter: &RecordFilter,
        now: Timestamp,
        frame: &mut Option<(i64, Timestamp)>,
        listed: &mut Newest,
    ) -> Result<()> {
        if page.is_empty() {
            return Ok(());
        }
        let keys: Vec<&str> = page.iter().map(String::as_str).collect();
        let state = filter.state().unwrap_or("");
        // The caller's bound as a distance from the caller's now, which the script applies
        // to Redis's now.
        let stale = filter
            .lease_expired_by
            .map(|by| by.0.saturating_sub(now.0).clamp(-MAX_TTL_MS, MAX_TTL_MS));
        let (answer, _) = self
            .run(&SCRIPTS.list, &keys, |call| {
                call.arg(state);
                match stale {
                    Some(stale) => call.arg(stale),
                    None => call.arg(""),
                };
            })
            .await?;
        let (store_now, found): (i64, Vec<Value>) =
            redis::from_redis_value(answer).map_err(|e| Error::Redis(e.into()))?;
        let (store_now, now) = *frame.get_or_insert((store_now, now));
        for pair in found.chunks_exact(2) {
            let (place, fields): (usize, _) = (
                redis::from_redis_value(pair[0].clone()).map_err(|e| Error::Redis(e.into()))?,
                redis::from_redis_value(pair[1].clone()).map_err(|e| Error::Redis(e.into()))?,
            );
            // Lua counts from 1.
            let member = place
                .checked_sub(1)
                .and_then(|i| page.get(i))
                .ok_or_else(|| Error::Corrupt("the listing script named no entry".into()))?;
            let scope = scope_of(member, members)?;
            // The pattern matched the account already; this guards against a pattern that
            // matched more than it should, since an operator acts on what is listed.
            if filter.account.as_ref().is_some_and(|a| *a != scope.account) {
                continue;
            }
            let record = record_from_fields(&scope, fields)?;
            listed.offer(in_caller_frame(record, store_now, now));
        }
        Ok(())
    }
}

/// The newest records offered, at most `limit` of them, newest first.
struct Newest {
    limit: usize,
    records: Vec<Record>,
}

impl Newest {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            records: Vec::new(),
        }
    }

    /// Keeps `record` if it is among the newest. `ZSCAN` may return an entry twice, so a
    /// record already kept is not kept again.
    fn offer(&mut self, record: Record) {
        if self.records.iter().any(|kept| kept.scope == record.scope) {
            return;
        }
        // Ties by scope, so that a listing's order does not depend on the index's.
        let at = self.records.partition_point(|kept| {
            (
                std::cmp::Reverse(kept.created_at),
                kept.scope.account.as_str(),
                kept.scope.key.as_str(),
            ) < (
                std::cmp::Reverse(record.created_at),
                record.scope.account.as_str(),
                record.scope.key.as_str(),
            )
        });
        if at < self.limit {
            self.records.insert(at, record);
            self.records.truncate(self.limit);
        }
    }
}

/// The scope of the record whose key is `member`, which begins with `members` (see
/// [Layout](RedisStore#layout)): then the account's length, `:`, the account, `:`, the key.
fn scope_of(member: &str, members: &str) -> Result<Scope> {
    let unreadable = || Error::Corrupt("an index entry that names no record".into());
    let rest = member.strip_prefix(members).ok_or_else(unreadable)?;
    let (length, rest) = rest.split_once(':').ok_or_else(unreadable)?;
    let length: usize = length.parse().map_err(|_| unreadable())?;
    let account = rest.get(..length).ok_or_else(unreadable)?;
    let key = rest
        .get(length..)
        .and_then(|rest| rest.strip_prefix(':'))
        .ok_or_else(unreadable)?;
    crate::stored_scope(account.to_owned(), key.to_owned())
}

/// `text` matched literally by a `SCAN`-family `MATCH` pattern.
fn glob_escaped(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_is_read_back_from_its_record_key_colons_and_all() {
        let scope = scope_of("p:{b7}:k:6:acct:1:key:with:colons", "p:{b7}:k:").unwrap();
        assert_eq!(scope.account.as_str(), "acct:1");
        assert_eq!(scope.key.as_str(), "key:with:colons");
        for bad in [
            "p:k:x:acct:key",
            "p:k:99:acct:key",
            "p:k:4:acctkey",
            "q:k:4:acct:key",
        ] {
            assert!(scope_of(bad, "p:k:").is_err(), "{bad}");
        }
    }

    #[test]
    fn glob_characters_match_only_themselves() {
        assert_eq!(glob_escaped(r"a*b?c[d]e\f"), r"a\*b\?c\[d\]e\\f");
    }
}
