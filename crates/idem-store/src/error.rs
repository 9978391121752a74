//! The store's errors.

/// Why a store operation failed. The layer answers each with `503` and `Retry-After`: the
/// request is never processed without its key record.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The store could not be reached, or no connection was free in time. The cause is the
    /// backend driver's error (`sqlx::Error`, `redis::RedisError`).
    #[error("the idempotency store is unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The database answered with an error.
    #[error("the idempotency store failed")]
    Database(#[source] sqlx::Error),
    /// Applying the schema migrations failed.
    #[error("migrating the idempotency store's schema failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// The PostgreSQL URL cannot be used.
    #[cfg(feature = "postgres")]
    #[error("the PostgreSQL URL of the idempotency store is invalid")]
    Url(#[source] crate::PgUrlError),
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
        // Class 08: connection exceptions; 53300: too many connections; 57P01-03: the server
        // is shutting down, crashed, or cannot accept connections yet; 25006
        // (read_only_sql_transaction): a standby, or a primary demoted under the session,
        // refused a write, and the primary is elsewhere for now.
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08")
                || matches!(&*code, "53300" | "57P01" | "57P02" | "57P03" | "25006")
        }),
        _ => false,
    }
}
