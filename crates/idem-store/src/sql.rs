//! What the SQL backends share: the record a row's decoded columns make, and the scope of a
//! row read back without one. Each backend decodes its own row type into these columns.

use idem_core::{
    AccountId, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Record, RecordState, Scope,
    StoredResponse, Timestamp,
};

use crate::{Error, Result};

/// The columns of a record's row that are never NULL, as a backend decoded them.
#[derive(Debug)]
pub(crate) struct RecordColumns {
    pub(crate) request_hash: Vec<u8>,
    pub(crate) status: String,
    pub(crate) created_at: i64,
    pub(crate) expires_at: i64,
    pub(crate) lease_until: i64,
    pub(crate) fencing_token: i64,
}

/// The response columns of a completed record's row.
#[derive(Debug)]
pub(crate) struct ResponseColumns {
    pub(crate) code: i64,
    pub(crate) headers: String,
    pub(crate) body: Vec<u8>,
    pub(crate) body_omitted: bool,
}

impl RecordColumns {
    /// The record `scope` names. `response` decodes the response columns, and is called only
    /// for a completed record: they are NULL while it is in progress.
    pub(crate) fn into_record(
        self,
        scope: &Scope,
        response: impl FnOnce() -> Result<ResponseColumns>,
    ) -> Result<Record> {
        let corrupt = |what: &str| Error::Corrupt(format!("{what} for key {}", scope.log_label()));
        let fingerprint = Fingerprint::try_from(self.request_hash.as_slice())
            .map_err(|_| corrupt("a request hash of bad length"))?;
        let state = match self.status.as_str() {
            "in_progress" => RecordState::InProgress {
                lease_until: Timestamp(self.lease_until),
                token: FencingToken(self.fencing_token),
            },
            "completed" => {
                let response = response()?;
                RecordState::Completed(StoredResponse {
                    status: u16::try_from(response.code)
                        .map_err(|_| corrupt("a bad response code"))?,
                    headers: serde_json::from_str(&response.headers)
                        .map_err(|_| corrupt("unreadable response headers"))?,
                    body: response.body,
                    body_omitted: response.body_omitted,
                })
            }
            _ => return Err(corrupt("an unknown status")),
        };
        Ok(Record {
            scope: Scope::new(AccountId::new(scope.account.as_str()), scope.key.clone()),
            fingerprint,
            state,
            created_at: Timestamp(self.created_at),
            expires_at: Timestamp(self.expires_at),
        })
    }
}

/// Rebuilds a scope read back from a store: the key was validated when it was stored, under
/// limits that may since have changed, so it is not validated again.
pub(crate) fn stored_scope(account: String, key: String) -> Result<Scope> {
    let limits = KeyLimits {
        min_len: 1,
        max_len: usize::MAX,
    };
    let key = IdempotencyKey::new(key, limits)
        .map_err(|e| Error::Corrupt(format!("a stored key is invalid: {e}")))?;
    Ok(Scope::new(AccountId::new(account), key))
}
