//! What the SQL backends share: the parameters their statements bind in the same order, the
//! record a row's columns make, and the scope of a row read back without one. Written over
//! sqlx's generic `Query` and `Row`, for the types that both SQLite and PostgreSQL encode and
//! decode alike; what they store differently (the response code's width) each backend reads
//! itself.

use idem_core::{
    AccountId, FencingToken, Fingerprint, Record, RecordState, Scope, StoredResponse, Timestamp,
};

use sqlx::query::Query;
use sqlx::{ColumnIndex, Decode, Encode, Row, Type};

use crate::{Error, NewClaim, RecordFilter, Result};

/// The head of both backends' claim `ON CONFLICT` clause: a claim that replaces a record
/// starts it afresh, as an in-progress record of the new request. Each backend adds its own
/// `WHERE` (which records a claim may replace). (A macro, so that `concat!` can join it.)
macro_rules! claim_replaces_with {
    () => {
        "
ON CONFLICT (account_id, idem_key) DO UPDATE SET
    request_hash = excluded.request_hash,
    status = 'in_progress',
    response_code = NULL,
    response_headers = NULL,
    response_body = NULL,
    body_omitted = false,
    created_at = excluded.created_at,
    expires_at = excluded.expires_at,
    lease_until = excluded.lease_until,
    fencing_token = excluded.fencing_token
"
    };
}
pub(crate) use claim_replaces_with;

/// A query on `DB`, as `sqlx::query` makes it.
type DbQuery<'q, DB> = Query<'q, DB, <DB as sqlx::Database>::Arguments>;

/// Binds a scope's account and key: the first two parameters of every statement on one record.
pub(crate) fn bind_scope<'q, DB>(query: DbQuery<'q, DB>, scope: &Scope) -> DbQuery<'q, DB>
where
    DB: sqlx::Database,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
{
    query.bind(scope.account.as_str()).bind(scope.key.as_str())
}

/// Binds a claim's parameters in the order both backends' claim statements number them: the
/// scope, the request hash, the claim's now, expiry, lease and token, then whether it may take
/// over a stale claim of the same request.
pub(crate) fn bind_claim<'q, DB>(query: DbQuery<'q, DB>, claim: &NewClaim) -> DbQuery<'q, DB>
where
    DB: sqlx::Database,
    for<'t> &'t str: Encode<'t, DB> + Type<DB>,
    for<'t> &'t [u8]: Encode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB> + Type<DB>,
    for<'t> bool: Encode<'t, DB> + Type<DB>,
{
    bind_scope(query, &claim.scope)
        .bind(&claim.fingerprint.as_bytes()[..])
        .bind(claim.now.0)
        .bind(claim.expires_at.0)
        .bind(claim.lease_until.0)
        .bind(claim.token.0)
        .bind(claim.take_over_expired_lease)
}

/// The columns of a record's row that are never NULL, as a backend decoded them.
#[derive(Debug)]
struct RecordColumns {
    request_hash: Vec<u8>,
    status: String,
    created_at: i64,
    expires_at: i64,
    lease_until: i64,
    fencing_token: i64,
}

/// The response columns of a completed record's row.
#[derive(Debug)]
struct ResponseColumns {
    code: i64,
    headers: String,
    body: Vec<u8>,
    body_omitted: bool,
}

/// Binds a listing's filter in the order both backends' `list` statements number it: the
/// account, the state, the time by which a lease must have run out, then the limit.
pub(crate) fn bind_filter<'q, DB>(query: DbQuery<'q, DB>, filter: &RecordFilter) -> DbQuery<'q, DB>
where
    DB: sqlx::Database,
    for<'t> Option<&'t str>: Encode<'t, DB> + Type<DB>,
    for<'t> Option<i64>: Encode<'t, DB> + Type<DB>,
    for<'t> i64: Encode<'t, DB> + Type<DB>,
{
    query
        .bind(filter.account.as_ref().map(|a| a.as_str()))
        .bind(filter.state())
        .bind(filter.lease_expired_by.map(|t| t.0))
        .bind(filter.limit())
}

impl RecordColumns {
    /// Reads the columns from a row of `idempotency_keys` (times as Unix milliseconds).
    fn read<R: Row>(row: &R) -> Result<Self>
    where
        for<'r> &'r str: ColumnIndex<R>,
        for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
        for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
        for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    {
        Ok(Self {
            request_hash: row.try_get("request_hash")?,
            status: row.try_get("status")?,
            created_at: row.try_get("created_at")?,
            expires_at: row.try_get("expires_at")?,
            lease_until: row.try_get("lease_until")?,
            fencing_token: row.try_get("fencing_token")?,
        })
    }

    /// The record `scope` names. `response` decodes the response columns, and is called only
    /// for a completed record: they are NULL while it is in progress.
    fn into_record(
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

/// The record `scope` names, from its row; `code` reads the response code, which each backend
/// stores at its own width.
pub(crate) fn record_from_row<R: Row>(
    scope: &Scope,
    row: &R,
    code: impl FnOnce(&R) -> std::result::Result<i64, sqlx::Error>,
) -> Result<Record>
where
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
{
    RecordColumns::read(row)?.into_record(scope, || {
        Ok(ResponseColumns {
            code: code(row)?,
            headers: row.try_get("response_headers")?,
            body: row.try_get("response_body")?,
            body_omitted: row.try_get("body_omitted")?,
        })
    })
}

/// The scope of a row listed without one (its `account_id` and `idem_key` columns).
pub(crate) fn row_scope<R: Row>(row: &R) -> Result<Scope>
where
    for<'r> &'r str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
{
    crate::stored_scope(row.try_get("account_id")?, row.try_get("idem_key")?)
}

/// [`record_from_row`] for a row tokio-postgres read (`TokioPgStore`), of the same columns and
/// the statement's `store_now`; its times in the frame of the caller's `now`.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn record_from_client_row(
    scope: &Scope,
    row: &tokio_postgres::Row,
    now: Timestamp,
) -> Result<Record> {
    let corrupt = |e: tokio_postgres::Error| {
        Error::Corrupt(format!(
            "an unreadable row for key {}: {e}",
            scope.log_label()
        ))
    };
    let columns = RecordColumns {
        request_hash: row.try_get("request_hash").map_err(corrupt)?,
        status: row.try_get("status").map_err(corrupt)?,
        created_at: row.try_get("created_at").map_err(corrupt)?,
        expires_at: row.try_get("expires_at").map_err(corrupt)?,
        lease_until: row.try_get("lease_until").map_err(corrupt)?,
        fencing_token: row.try_get("fencing_token").map_err(corrupt)?,
    };
    let store_now: i64 = row.try_get("store_now").map_err(corrupt)?;
    let record = columns.into_record(scope, || {
        Ok(ResponseColumns {
            code: row
                .try_get::<_, i32>("response_code")
                .map_err(corrupt)?
                .into(),
            headers: row.try_get("response_headers").map_err(corrupt)?,
            body: row.try_get("response_body").map_err(corrupt)?,
            body_omitted: row.try_get("body_omitted").map_err(corrupt)?,
        })
    })?;
    Ok(crate::in_caller_frame(record, store_now, now))
}
