//! The store's errors.

/// Why a store operation failed. The layer answers each with `503` and `Retry-After`: the
/// request is never processed without its key record.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store could not be reached, or no connection was free in time. The cause is the
    /// backend driver's error (`sqlx::Error`, `tokio_postgres::Error`, deadpool's `PoolError`,
    /// `redis::RedisError`).
    #[error("the idempotency store is unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The database answered with an error.
    #[error("the idempotency store failed")]
    Database(#[source] sqlx::Error),
    /// Applying the schema migrations failed (SQLite).
    #[error("migrating the idempotency store's schema failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// Applying the schema migrations failed (PostgreSQL).
    #[cfg(feature = "postgres")]
    #[error("migrating the idempotency store's schema failed")]
    PgMigrate(#[source] crate::MigrationError),
    /// The PostgreSQL URL cannot be used.
    #[cfg(feature = "postgres")]
    #[error("the PostgreSQL URL of the idempotency store is invalid")]
    Url(#[source] crate::PgUrlError),
    /// PostgreSQL, through tokio-postgres ([`TokioPgStore`](crate::TokioPgStore)), answered
    /// with an error.
    #[cfg(feature = "tokio-postgres")]
    #[error("the PostgreSQL idempotency store failed")]
    Postgres(#[source] tokio_postgres::Error),
    /// Redis answered with an error.
    #[cfg(feature = "redis")]
    #[error("the Redis idempotency store failed")]
    Redis(#[source] redis::RedisError),
    /// A stored record (an SQL row, a Redis hash) could not be read back as a record: it is
    /// corrupt, not merely gone or changed (that is [`Error::Raced`]).
    #[error("a stored idempotency record is corrupt: {0}")]
    Corrupt(String),
    /// Concurrent changes left the operation nothing consistent to act on (a claim kept losing
    /// to records that vanished before they could be read; a transaction's own key row
    /// vanished). Nothing was stored; a retry may succeed.
    #[error("the idempotency record changed under the operation: {0}")]
    Raced(String),
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        if is_unavailable(&e) {
            Error::Unavailable(Box::new(e))
        } else {
            Error::Database(e)
        }
    }
}

#[cfg(feature = "tokio-postgres")]
impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        if client_error_is_unavailable(&e) {
            Error::Unavailable(Box::new(e))
        } else {
            Error::Postgres(e)
        }
    }
}

#[cfg(feature = "tokio-postgres")]
impl From<deadpool_postgres::PoolError> for Error {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            // A wait for a free connection that ran out, a connection that could not be made in
            // time, a pool shut down: the store cannot be reached for now.
            other => Error::Unavailable(Box::new(other)),
        }
    }
}

impl Error {
    /// Whether the database refused a write for breaking a unique constraint: for a business
    /// table with its own `UNIQUE (account_id, idem_key)`, a duplicate that got past the layer.
    pub fn is_unique_violation(&self) -> bool {
        match self {
            Error::Database(e) => e
                .as_database_error()
                .is_some_and(|db| db.is_unique_violation()),
            #[cfg(feature = "tokio-postgres")]
            Error::Postgres(e) => {
                e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
            }
            _ => false,
        }
    }
}

/// The store's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Whether a database error means the database cannot be reached (a lost or refused
/// connection, no free connection, a server shutting down or starting up, a node that takes no
/// writes) rather than that it refused the statement. Callers answer the first with `503` and
/// `Retry-After`, since a retry may succeed; classified by kind and SQLSTATE, never by message.
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| sqlstate_is_unavailable(&code)),
        _ => false,
    }
}

/// Class 08: connection exceptions; 53300: too many connections; 57P01-03: the server is
/// shutting down, crashed, or cannot accept connections yet; 25006 (read_only_sql_transaction):
/// a standby, or a primary demoted under the session, refused a write, and the primary is
/// elsewhere for now.
fn sqlstate_is_unavailable(code: &str) -> bool {
    code.starts_with("08") || matches!(code, "53300" | "57P01" | "57P02" | "57P03" | "25006")
}

/// [`is_unavailable`] for tokio-postgres: the SQLSTATEs it names, a closed connection, or a
/// failure to reach the server at all (an I/O error, a refused or timed-out connect).
#[cfg(feature = "tokio-postgres")]
pub(crate) fn client_error_is_unavailable(e: &tokio_postgres::Error) -> bool {
    match e.as_db_error() {
        Some(db) => sqlstate_is_unavailable(db.code().code()),
        None => {
            e.is_closed()
                || std::error::Error::source(e).is_some_and(|cause| cause.is::<std::io::Error>())
        }
    }
}
