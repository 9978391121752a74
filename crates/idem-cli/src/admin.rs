//! What an operator does to keys, on any [`AdminStore`]: list them by state, read one, resolve
//! one whose outcome is in progress or unknown. One implementation, called by `idem keys` and
//! by the admin API of `idem serve` and `idem proxy` (docs/contract.md §15), so the two cannot
//! disagree on what a state or a resolution means.

pub mod api;
mod console;
mod outcomes;

use idem_core::{
    AccountId, IdempotencyKey, KeyLimits, Record, RecordEvent, RecordState, Scope, StoredResponse,
    Timestamp,
};
use idem_store::{AdminStore, RecordFilter};

/// A record's state as operators name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeyState {
    /// Still in progress, whether or not its lease has run out (`unknown` ones included).
    #[value(alias = "in_progress")]
    #[serde(alias = "in_progress")]
    InProgress,
    /// In progress with its lease run out: its worker crashed or stalled, and whether the work
    /// happened is unknown until it is resolved.
    Unknown,
    /// Completed: its retries replay its stored answer.
    Completed,
}

impl KeyState {
    /// The state of `record` at `now`: the narrowest of the three that holds.
    pub fn of(record: &Record, now: Timestamp) -> Self {
        match record.state {
            RecordState::InProgress { lease_until, .. } if lease_until <= now => Self::Unknown,
            RecordState::InProgress { .. } => Self::InProgress,
            RecordState::Completed(_) => Self::Completed,
        }
    }

    /// How lists and answers print it (`in_progress`, as `idem keys list` always has).
    pub fn name(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Unknown => "unknown",
            Self::Completed => "completed",
        }
    }
}

/// The filter that lists `state` (every state when `None`), of `account` if one is given.
pub fn filter(
    state: Option<KeyState>,
    account: Option<AccountId>,
    limit: u32,
    now: Timestamp,
) -> RecordFilter {
    RecordFilter {
        account,
        in_progress: state.map(|state| state != KeyState::Completed),
        // An unknown outcome is an in-progress record whose lease ran out by now, which a
        // shared store judges by its own clock.
        lease_expired_by: (state == Some(KeyState::Unknown)).then_some(now),
        limit,
    }
}

/// The scope of `key` of `account`, as an operator types it: either form the API accepts,
/// `order-1042` or the sf-string `"order-1042"`, of any length (the server's limits may have
/// changed since the key was stored).
///
/// # Errors
///
/// When `key` is not a key at all.
pub fn scope(account: &str, key: &str) -> Result<Scope, idem_core::KeyError> {
    let limits = KeyLimits {
        min_len: 1,
        max_len: usize::MAX,
    };
    let key = IdempotencyKey::parse(key.as_bytes(), limits)?;
    Ok(Scope::new(AccountId::new(account), key))
}

/// How an operator resolves a key in progress or of unknown outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// Store this answer as the key's outcome: its retries replay it, and it is kept for the
    /// retention from now.
    Complete(StoredResponse),
    /// Delete the in-progress record, so the key's next copy runs afresh: for work known not
    /// to have happened.
    Release,
}

impl Resolution {
    /// A completion with `status`, `headers` and `body`; a non-empty body without a
    /// `Content-Type` among the headers must be JSON, and is labelled so.
    ///
    /// # Errors
    ///
    /// [`ResolveError::BadAnswer`] when `status` is not an HTTP status, a header is not one,
    /// or the body is not JSON where it must be.
    pub fn complete(
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    ) -> Result<Self, ResolveError> {
        if !(100..600).contains(&status) {
            return Err(ResolveError::BadAnswer(format!(
                "{status} is not an HTTP status"
            )));
        }
        let mut stored = Vec::with_capacity(headers.len() + 1);
        for (name, value) in headers {
            let name = http::HeaderName::try_from(name.trim())
                .map_err(|_| ResolveError::BadAnswer(format!("{name:?} is not a header name")))?;
            http::HeaderValue::try_from(value.trim()).map_err(|_| {
                ResolveError::BadAnswer(format!("{value:?} is not a value of {name}"))
            })?;
            // Stores keep header names in lower case, as `HeaderName` gives them.
            stored.push((name.as_str().to_owned(), value.trim().to_owned()));
        }
        if !body.is_empty() && !stored.iter().any(|(name, _)| name == "content-type") {
            // Labelled JSON, so it must be: a typo would be replayed to every retry.
            serde_json::from_slice::<serde::de::IgnoredAny>(&body).map_err(|e| {
                ResolveError::BadAnswer(format!(
                    "the body is not JSON ({e}); give a Content-Type header for another type"
                ))
            })?;
            stored.insert(0, ("content-type".into(), "application/json".into()));
        }
        Ok(Self::Complete(StoredResponse {
            status,
            headers: stored,
            body,
            body_omitted: false,
        }))
    }
}

/// `Name: value`, as `--header` takes it, split.
///
/// # Errors
///
/// When there is no `:`.
pub fn parse_header(text: &str) -> Result<(String, String), String> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| format!("{text:?}: expected \"Name: value\""))?;
    Ok((name.trim().to_owned(), value.trim().to_owned()))
}

/// What a resolution did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// The answer is stored; retries replay it.
    Completed,
    /// The record is gone; the next copy runs.
    Released,
}

impl Resolved {
    /// How the admin API names it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Released => "released",
        }
    }
}

/// Why a key was not resolved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    /// The answer to store is not one.
    #[error("not an answer to store: {0}")]
    BadAnswer(String),
    /// No record has the key.
    #[error("no record for the key")]
    NoRecord,
    /// The key's outcome is known already: resolving it would change an answer clients may
    /// have been given.
    #[error("the key is completed, not in progress: its answer is known and replayed")]
    Completed,
    /// The record changed (completed, or taken over by a new claim) while it was being
    /// resolved.
    #[error("the record changed while it was being resolved; look at it again")]
    Changed,
    /// The store failed.
    #[error("the store failed")]
    Store(#[source] idem_store::Error),
}

impl ResolveError {
    /// The HTTP status the admin API answers it with.
    pub fn status(&self) -> u16 {
        match self {
            Self::BadAnswer(_) => 422,
            Self::NoRecord => 404,
            Self::Completed | Self::Changed => 409,
            Self::Store(_) => 503,
        }
    }
}

/// Who resolved a key with `idem keys resolve`, as its history names them.
pub const BY_CLI: &str = "idem keys (CLI)";

/// Who resolved a key through the admin API when the call named nobody.
pub const BY_ADMIN_API: &str = "admin API";

/// Who completed or released a payout of unknown outcome after asking the provider.
pub const BY_RECONCILER: &str = "reconciler";

/// Resolves the in-progress (or unknown) record `scope` names, and adds what it did to the
/// key's history in the store (`resolved: completed with status N` or `resolved: released`,
/// by `by`), where every process that shares the store reads it. A completed record is
/// refused: its answer is known, and clients may have been given it.
///
/// # Errors
///
/// [`ResolveError::NoRecord`], [`ResolveError::Completed`], [`ResolveError::Changed`] when a
/// release finds the record taken over or completed between its read and its delete, and
/// [`ResolveError::Store`]. A history the store fails to keep is logged, not an error: the
/// resolution itself is done, and resolving again would be refused.
pub async fn resolve<S: AdminStore>(
    store: &S,
    scope: &Scope,
    resolution: &Resolution,
    now: Timestamp,
    by: &str,
) -> Result<Resolved, ResolveError> {
    let resolved = resolve_record(store, scope, resolution, now).await?;
    let what = match resolution {
        Resolution::Complete(response) => {
            format!("resolved: completed with status {}", response.status)
        }
        Resolution::Release => "resolved: released".to_owned(),
    };
    note(store, scope, now, what, by).await;
    Ok(resolved)
}

/// Adds `what`, done by `by` at `now`, to the history of `scope`'s key; a failure is logged
/// (what it notes has happened already).
pub async fn note<S: AdminStore>(store: &S, scope: &Scope, now: Timestamp, what: String, by: &str) {
    let event = RecordEvent {
        at: now,
        what,
        by: by.to_owned(),
    };
    if let Err(e) = store.record_event(scope, &event).await {
        tracing::warn!(
            key = %scope.log_label(),
            error = %idem_core::ErrorChain(&e),
            "the store did not keep an event of the key's history"
        );
    }
}

/// Whether `by` may name who resolved a key: 1 to 64 characters, none of them a control
/// character, as the admin API's callers give it.
pub fn valid_by(by: &str) -> bool {
    let count = by.chars().count();
    (1..=64).contains(&count) && !by.trim().is_empty() && !by.chars().any(char::is_control)
}

async fn resolve_record<S: AdminStore>(
    store: &S,
    scope: &Scope,
    resolution: &Resolution,
    now: Timestamp,
) -> Result<Resolved, ResolveError> {
    match resolution {
        Resolution::Complete(response) => {
            if store
                .force_complete(scope, response, now)
                .await
                .map_err(ResolveError::Store)?
            {
                return Ok(Resolved::Completed);
            }
            // Not in progress: say whether it is missing or completed.
            match store.get(scope, now).await.map_err(ResolveError::Store)? {
                None => Err(ResolveError::NoRecord),
                Some(_) => Err(ResolveError::Completed),
            }
        }
        Resolution::Release => {
            let record = store.get(scope, now).await.map_err(ResolveError::Store)?;
            let token = match record.map(|r| r.state) {
                None => return Err(ResolveError::NoRecord),
                Some(RecordState::Completed(_)) => return Err(ResolveError::Completed),
                Some(RecordState::InProgress { token, .. }) => token,
            };
            // The claim's own release, fenced by the token just read: one atomic delete of
            // that claim's in-progress record, so a record completed (or claimed anew) since
            // the read is never deleted.
            if store
                .release(scope, token)
                .await
                .map_err(ResolveError::Store)?
            {
                Ok(Resolved::Released)
            } else {
                Err(ResolveError::Changed)
            }
        }
    }
}

/// Parses `--admin-token` (and `IDEM_ADMIN_TOKEN`).
///
/// # Errors
///
/// When the token is too short to be one.
pub fn parse_admin_token(text: &str) -> Result<api::AdminToken, String> {
    api::AdminToken::new(text)
}

#[cfg(test)]
mod tests {
    use idem_core::{FencingToken, Fingerprint, Policy, RequestParts};
    use idem_store::{ClaimOutcome, MemoryStore, NewClaim, Store};

    use super::*;

    async fn claimed(store: &MemoryStore, key: &str, now: Timestamp) -> (Scope, NewClaim) {
        let scope = scope("acct_1", key).unwrap();
        let fingerprint = Fingerprint::compute(&RequestParts {
            account: "acct_1",
            method: "POST",
            route: "/orders",
            query: "",
            content_type: "application/json",
            body: b"{}",
        })
        .unwrap();
        let claim = NewClaim::new(
            scope.clone(),
            fingerprint,
            FencingToken(1),
            now,
            &Policy::default(),
        );
        assert_eq!(store.claim(&claim).await.unwrap(), ClaimOutcome::Claimed);
        (scope, claim)
    }

    #[tokio::test]
    async fn a_release_frees_an_unknown_outcome_and_never_a_completed_one() {
        let store = MemoryStore::new();
        let now = Timestamp(1_700_000_000_000);
        let (scope, claim) = claimed(&store, "order-0001", now).await;
        let later = claim.lease_until.plus(std::time::Duration::from_secs(1));
        let record = store.get(&scope, later).await.unwrap().unwrap();
        assert_eq!(KeyState::of(&record, now), KeyState::InProgress);
        assert_eq!(KeyState::of(&record, later), KeyState::Unknown);
        let unknown = filter(Some(KeyState::Unknown), None, 0, later);
        assert_eq!(store.list(&unknown, later).await.unwrap().len(), 1);
        let unknown_earlier = filter(Some(KeyState::Unknown), None, 0, now);
        assert!(store.list(&unknown_earlier, now).await.unwrap().is_empty());

        let answer =
            Resolution::complete(201, vec![("X-By".into(), "ops".into())], b"{}".to_vec()).unwrap();
        assert_eq!(
            resolve(&store, &scope, &answer, later, BY_CLI)
                .await
                .unwrap(),
            Resolved::Completed
        );
        let Some(Record {
            state: RecordState::Completed(response),
            ..
        }) = store.get(&scope, later).await.unwrap()
        else {
            panic!("completed")
        };
        assert_eq!(
            response.headers,
            [
                ("content-type".to_owned(), "application/json".to_owned()),
                ("x-by".to_owned(), "ops".to_owned())
            ]
        );
        for resolution in [&Resolution::Release, &answer] {
            assert!(matches!(
                resolve(&store, &scope, resolution, later, BY_CLI).await,
                Err(ResolveError::Completed)
            ));
        }

        let (other, _) = claimed(&store, "order-0002", now).await;
        assert_eq!(
            resolve(&store, &other, &Resolution::Release, now, "console")
                .await
                .unwrap(),
            Resolved::Released
        );
        assert!(store.get(&other, now).await.unwrap().is_none());
        // Each resolution is in its key's history, refusals not.
        let history = |at: Timestamp, what: &str, by: &str| RecordEvent {
            at,
            what: what.into(),
            by: by.into(),
        };
        assert_eq!(
            store.events(&scope).await.unwrap(),
            [history(
                later,
                "resolved: completed with status 201",
                BY_CLI
            )]
        );
        assert_eq!(
            store.events(&other).await.unwrap(),
            [history(now, "resolved: released", "console")]
        );
        assert!(matches!(
            resolve(&store, &other, &Resolution::Release, now, "console").await,
            Err(ResolveError::NoRecord)
        ));
    }

    #[test]
    fn an_answer_to_store_is_checked() {
        assert!(Resolution::complete(99, vec![], vec![]).is_err());
        assert!(Resolution::complete(201, vec![], b"not json".to_vec()).is_err());
        assert!(Resolution::complete(201, vec![("bad name".into(), "v".into())], vec![]).is_err());
        let text = vec![("Content-Type".into(), "text/plain".into())];
        assert!(Resolution::complete(201, text, b"not json".to_vec()).is_ok());
        assert_eq!(
            parse_header("X-A: b: c").unwrap(),
            ("X-A".into(), "b: c".into())
        );
        assert!(parse_header("no colon").is_err());
        assert!(valid_by("console") && valid_by(BY_CLI));
        for bad in ["", "  ", "a\nb", "\u{7f}", &"x".repeat(65)] {
            assert!(!valid_by(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_admin_token_is_compared_whole() {
        let token = api::AdminToken::new("a-token-of-enough-length").unwrap();
        assert!(api::AdminToken::new("short").is_err());
        assert!(token.accepts(b"a-token-of-enough-length"));
        assert!(!token.accepts(b"a-token-of-enough-lengtH"));
        assert!(!token.accepts(b"a-token-of-enough-length-and-more"));
        assert!(!token.accepts(b""));
    }
}
